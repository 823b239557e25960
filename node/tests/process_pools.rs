//! The node's process-UDF pools with real child processes (`sleep`, which needs no protocol to
//! be leased and given back): growth up to the maximum, waiting when busy, shrinking to the
//! minimum, retiring, discarding, the command allowlist, the code policy, the pinned files and
//! the children's environment.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use floe_core::fingerprint::FileDigest;
use floe_core::plan::{Concurrency, ProcessUdf, UdfCodePolicy};
use floe_node::udf_pools::{PoolsConfig, ProcessPools};

/// Pools running `sleep`, which is no script: inline code allowed.
fn pools(dir: &Path) -> Arc<ProcessPools> {
    pools_with(
        dir,
        UdfCodePolicy {
            roots: Vec::new(),
            allow_inline: true,
        },
    )
}

fn pools_with(dir: &Path, code: UdfCodePolicy) -> Arc<ProcessPools> {
    Arc::new(
        ProcessPools::new(PoolsConfig {
            runtime_dir: dir.join("udf"),
            allowed_commands: vec!["sleep".into()],
            code,
            default_max: 4,
            shrink_after: Duration::from_millis(200),
            retire_after: Duration::from_millis(1500),
        })
        .unwrap(),
    )
}

fn alive(pid: u32) -> bool {
    // A zombie is dead too: the pools reap what they stop, so the entry goes away.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        !stat
            .rsplit_once(')')
            .unwrap()
            .1
            .trim_start()
            .starts_with('Z')
    })
}

fn eventually(what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn live_children(pools: &ProcessPools) -> u32 {
    pools.sizes().iter().map(|(_, n)| n).sum()
}

#[test]
fn a_pool_grows_to_its_maximum_waits_when_busy_and_shrinks_to_its_minimum() {
    let dir = tempfile::tempdir().unwrap();
    let pools = pools(dir.path());
    let udf = ProcessUdf::new("sleep", &["1000"]).concurrency(Concurrency::new(1, 2));

    let first = pools.lease(&udf).unwrap();
    let second = pools.lease(&udf).unwrap();
    let (first_pid, second_pid) = (first.endpoint().pid, second.endpoint().pid);
    assert_ne!(first_pid, second_pid);
    assert!(alive(first_pid) && alive(second_pid));
    assert!(first.endpoint().socket.exists());
    assert_eq!(live_children(&pools), 2);

    // At the maximum, a third lease waits until a child comes back, and gets that child.
    let waiting = {
        let pools = Arc::clone(&pools);
        let udf = udf.clone();
        std::thread::spawn(move || pools.lease(&udf).unwrap().endpoint().pid)
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiting.is_finished(), "the third lease did not wait");
    drop(first);
    assert_eq!(waiting.join().unwrap(), first_pid);
    drop(second);

    // Idle past `shrink_after`, the pool stops children down to its minimum of one...
    eventually("the pool shrinks to its minimum", || {
        pools.reap();
        live_children(&pools) == 1
    });
    let survivors = [first_pid, second_pid]
        .into_iter()
        .filter(|pid| alive(*pid))
        .count();
    assert_eq!(survivors, 1);
    // ...and unused for `retire_after`, it is stopped entirely, files and all.
    eventually("the pool retires", || {
        pools.reap();
        pools.sizes().is_empty()
    });
    assert!(!alive(first_pid) && !alive(second_pid));
    let left: Vec<_> = std::fs::read_dir(dir.path().join("udf"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("child-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_discarded_or_exited_child_is_never_leased_again() {
    let dir = tempfile::tempdir().unwrap();
    let pools = pools(dir.path());
    let udf = ProcessUdf::new("sleep", &["1000"]).concurrency(Concurrency::new(0, 1));

    let mut lease = pools.lease(&udf).unwrap();
    let discarded = lease.endpoint().pid;
    lease.discard();
    drop(lease);
    assert!(!alive(discarded));

    let lease = pools.lease(&udf).unwrap();
    let killed = lease.endpoint().pid;
    assert_ne!(killed, discarded);
    drop(lease);
    // A child that dies while idle (here: killed from outside) is replaced on the next lease.
    std::process::Command::new("kill")
        .args(["-9", &killed.to_string()])
        .status()
        .unwrap();
    eventually("the idle child is dead", || !alive(killed));
    let replaced = pools.lease(&udf).unwrap();
    assert_ne!(replaced.endpoint().pid, killed);
}

#[test]
fn only_allowed_commands_and_unchanged_files_run() {
    let dir = tempfile::tempdir().unwrap();
    let pools = pools(dir.path());
    let refused = pools
        .lease(&ProcessUdf::new("sh", &["-c", "true"]))
        .err()
        .unwrap();
    assert!(!refused.is_transient());
    assert!(
        refused.to_string().contains("node.udf_commands (sleep)"),
        "{refused}"
    );

    let script = dir.path().join("model.txt");
    std::fs::write(&script, "v1").unwrap();
    let udf = ProcessUdf::new("sleep", &["1000"]).file(&script).unwrap();
    drop(pools.lease(&udf).unwrap());
    pools.shutdown();

    let pools = self::pools(&dir.path().join("again"));
    std::fs::write(&script, "v2").unwrap();
    let changed = pools.lease(&udf).err().unwrap();
    assert!(!changed.is_transient());
    assert!(
        changed
            .to_string()
            .contains("changed since the job was submitted"),
        "{changed}"
    );
}

#[test]
fn only_a_pinned_script_under_the_roots_runs_unless_inline_code_is_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let roots = dir.path().join("udfs");
    std::fs::create_dir(&roots).unwrap();
    let pools = pools_with(
        &dir.path().join("node"),
        UdfCodePolicy {
            roots: vec![roots.clone()],
            allow_inline: false,
        },
    );
    let script_udf = |path: &Path| {
        std::fs::write(path, "1000").unwrap();
        let digest = FileDigest::of(path).unwrap();
        ProcessUdf::new("sleep", &[digest.path.to_str().unwrap()]).pinned(digest)
    };
    // `sleep` exits at once on a file name; a lease only needs it started.
    drop(pools.lease(&script_udf(&roots.join("udf.py"))).unwrap());

    let outside = script_udf(&dir.path().join("stray.py"));
    let refused = pools.lease(&outside).err().unwrap();
    assert!(!refused.is_transient());
    assert!(
        refused.to_string().contains("is not under node.udf_roots"),
        "{refused}"
    );
    for inline in [
        ProcessUdf::new("sleep", &["-c", "1000"]),
        ProcessUdf::new("sleep", &["1000"]),
    ] {
        let refused = pools.lease(&inline).err().unwrap();
        assert!(
            refused.to_string().contains("inline code is refused")
                && refused.to_string().contains("node.udf_allow_inline = true"),
            "{refused}"
        );
    }
}

#[test]
fn a_child_gets_only_path_pythonpath_its_socket_and_what_the_udf_declares() {
    let dir = tempfile::tempdir().unwrap();
    let pools = pools(dir.path());
    let udf = ProcessUdf::new("sleep", &["1000"]).env("GREETING", "hello");
    let lease = pools.lease(&udf).unwrap();
    let environ = std::fs::read(format!("/proc/{}/environ", lease.endpoint().pid)).unwrap();
    let mut names: Vec<String> = environ
        .split(|byte| *byte == 0)
        .filter(|entry| !entry.is_empty())
        .map(|entry| String::from_utf8_lossy(entry).into_owned())
        .collect();
    assert!(names.contains(&"GREETING=hello".to_owned()), "{names:?}");
    assert!(names.contains(&"FLOE_UDF_FD=3".to_owned()), "{names:?}");
    names = names
        .iter()
        .map(|entry| entry.split_once('=').unwrap().0.to_owned())
        .collect();
    names.sort();
    // The test process has HOME, CARGO_* and more; none of it is passed on.
    assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
    assert_eq!(names, ["FLOE_UDF_FD", "GREETING", "PATH", "PYTHONPATH"]);
}
