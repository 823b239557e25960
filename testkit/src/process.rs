//! The processes of a test: the `floe` command, signals by pid, and waiting for processes to
//! be gone.

use std::process::Command;
use std::time::{Duration, Instant};

/// `binary` (the `floe` under test) as a command, without the caller's `FLOE_*` settings: a
/// variable in the developer's shell must not change what the test sees.
pub fn floe_command(binary: &str) -> Command {
    let mut command = Command::new(binary);
    for (name, _) in std::env::vars() {
        if name.starts_with("FLOE_") {
            command.env_remove(name);
        }
    }
    command
}

/// Sends `signal` (`"KILL"`, `"STOP"`, …) to process `pid` with kill(1); panics when it fails.
pub fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} {pid} failed");
}

/// Whether process `pid` exists (kill -0).
pub fn is_running(pid: u32) -> bool {
    Command::new("kill")
        .args(["-0", &pid.to_string()])
        .status()
        .unwrap()
        .success()
}

/// The bytes of shared memory process `pid` has resident (`RssShmem` in /proc/PID/status):
/// the pages of mapped shared memory it touched itself.
pub fn resident_shared_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("RssShmem:"))
        .and_then(|value| value.trim().strip_suffix("kB"))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no RssShmem in the status of {pid}:\n{status}"));
    kib * 1024
}

/// Live processes whose command line mentions `text`, from /proc (zombies excluded).
pub fn processes_mentioning(text: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let zombie = state
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
            !zombie && String::from_utf8_lossy(&cmdline).contains(text)
        })
        .collect()
}

/// Waits until no live process mentions `text`; panics naming `what` and the survivors after
/// `timeout`.
pub fn wait_until_none_mention(text: &str, what: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let left = processes_mentioning(text);
        if left.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {left:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs the `floe` CLI at `binary` with `args` against `cluster`'s schedulers, with its admin
/// token.
pub fn run_floe_against(
    binary: &str,
    cluster: &floe_client::LocalCluster,
    args: &[&str],
) -> std::process::Output {
    floe_command(binary)
        .args(args)
        .arg("--scheduler")
        .arg(cluster.addresses().join(","))
        .env("FLOE_CLIENT_TOKEN", cluster.token())
        .output()
        .unwrap()
}
