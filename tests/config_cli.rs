//! The `floe` binary's configuration layers and checks, run as a real process.

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::net::TcpListener;
use std::path::Path;
use std::process::Output;

use floe_testkit::process::floe_command;

/// `floe` with `args` and, of the `FLOE_*` variables, only `env`.
fn floe(args: &[&str], env: &[(&str, &str)]) -> Output {
    floe_command(env!("CARGO_BIN_EXE_floe"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("the floe binary runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The value of `key` in `section` of `floe config show` output, parsed as TOML.
fn shown(output: &Output, section: &str, key: &str) -> toml::Value {
    assert!(output.status.success(), "floe failed: {}", stderr(output));
    let table: toml::Table = stdout(output).parse().expect("config show prints TOML");
    table[section][key].clone()
}

fn write_config(dir: &Path, text: &str) -> String {
    let path = dir.join("floe.toml");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn file_then_env_then_flag() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_config(
        dir.path(),
        "[scheduler]\nrpc_port = 1001\nhttp_port = 1002\n[node]\nrpc_port = 1003\n",
    );

    let output = floe(&["config", "show", "--config", &file], &[]);
    assert_eq!(
        shown(&output, "scheduler", "rpc_port").as_integer(),
        Some(1001)
    );

    // FLOE_CONFIG names the file just as --config does.
    let env = [
        ("FLOE_CONFIG", file.as_str()),
        ("FLOE_SCHEDULER_RPC_PORT", "2001"),
        ("FLOE_NODE_RPC_PORT", "2003"),
    ];
    let output = floe(&["config", "show"], &env);
    assert_eq!(
        shown(&output, "scheduler", "rpc_port").as_integer(),
        Some(2001)
    );
    assert_eq!(
        shown(&output, "scheduler", "http_port").as_integer(),
        Some(1002)
    );
    assert_eq!(shown(&output, "node", "rpc_port").as_integer(), Some(2003));

    let output = floe(
        &["config", "show", "--set", "scheduler.rpc_port=3001"],
        &env,
    );
    assert_eq!(
        shown(&output, "scheduler", "rpc_port").as_integer(),
        Some(3001)
    );
    assert_eq!(shown(&output, "node", "rpc_port").as_integer(), Some(2003));
    assert_eq!(
        shown(&output, "scheduler", "http_port").as_integer(),
        Some(1002)
    );
}

#[test]
fn log_format_flag_beats_the_environment() {
    let output = floe(&["config", "show"], &[("FLOE_LOG_FORMAT", "json")]);
    assert_eq!(shown(&output, "log", "format").as_str(), Some("json"));
    let output = floe(
        &["config", "show", "--log-format", "text"],
        &[("FLOE_LOG_FORMAT", "json")],
    );
    assert_eq!(shown(&output, "log", "format").as_str(), Some("text"));
}

#[test]
fn json_logs_are_json_lines() {
    let output = floe(
        &["config", "show", "--log-format", "json"],
        &[("RUST_LOG", "debug")],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    let logs = stderr(&output);
    assert!(!logs.is_empty(), "a debug line is logged");
    for line in logs.lines() {
        let record: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|error| panic!("not a JSON line ({error}): {line}"));
        assert!(record["level"].is_string(), "{line}");
        assert!(record["fields"]["message"].is_string(), "{line}");
    }
}

#[test]
fn every_secret_is_redacted() {
    let output = floe(
        &["config", "show"],
        &[
            ("FLOE_CLUSTER_SECRET", "hunter2"),
            ("FLOE_SCHEDULER_REPLICA_SECRET", "hunter3"),
            ("FLOE_CLIENT_TOKEN", "hunter4"),
        ],
    );
    for (section, key) in [
        ("cluster", "secret"),
        ("scheduler", "replica_secret"),
        ("client", "token"),
    ] {
        assert_eq!(
            shown(&output, section, key).as_str(),
            Some("<redacted>"),
            "{section}.{key}"
        );
    }
    for secret in ["hunter2", "hunter3", "hunter4"] {
        assert!(!stdout(&output).contains(secret));
    }
}

/// Arguments, environment, and the text the error must contain.
type FailureCase<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);

#[test]
fn bad_settings_fail_with_the_culprit_named() {
    let cases: [FailureCase; 5] = [
        (
            &["config", "show"],
            &[("FLOE_SCHEDULER_RPC_PROT", "1")],
            "environment variable FLOE_SCHEDULER_RPC_PROT: unknown setting \"scheduler.rpc_prot\"",
        ),
        (
            &["config", "show", "--set", "node.rpc_port=many"],
            &[],
            "command-line flag: bad value \"many\" for node.rpc_port: expected an integer",
        ),
        (
            &[
                "config",
                "show",
                "--set",
                "memory.object_store_fraction=0.7",
                "--set",
                "memory.system_reserve_fraction=0.4",
            ],
            &[],
            "invalid setting memory.object_store_fraction",
        ),
        (
            &["config", "show", "--config", "/nonexistent/floe.toml"],
            &[],
            "cannot read config file /nonexistent/floe.toml",
        ),
        (
            &["config", "show"],
            &[("RUST_LOG", "=[")],
            "RUST_LOG is not a valid filter",
        ),
    ];
    for (args, env, expected) in cases {
        let output = floe(args, env);
        assert_eq!(output.status.code(), Some(1), "{args:?} {env:?}");
        let error = stderr(&output);
        assert!(error.starts_with("error: "), "{error}");
        assert!(error.contains(expected), "{args:?}: {error}");
    }
}

#[test]
fn check_passes_on_a_usable_host() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let output = floe(
        &[
            "config",
            "check",
            "--set",
            "scheduler.rpc_port=0",
            "--set",
            "scheduler.http_port=0",
            "--set",
            "node.rpc_port=0",
        ],
        &[
            ("FLOE_CLUSTER_SECRET", "secret"),
            ("FLOE_SCHEDULER_REPLICA_SECRET", "replica-secret"),
            ("FLOE_PATHS_DATA_DIR", data_dir.to_str().unwrap()),
        ],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        stdout(&output),
        "ok: Scheduler can start with this configuration\nok: Node can start with this configuration\n"
    );
    for sub in ["raft", "spill", "cache", "fallback"] {
        assert!(data_dir.join(sub).is_dir(), "{sub} was created");
    }
}

#[test]
fn check_reports_a_taken_port() {
    let dir = tempfile::tempdir().unwrap();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let output = floe(
        &["config", "check", "--service", "node"],
        &[
            ("FLOE_CLUSTER_SECRET", "secret"),
            ("FLOE_PATHS_DATA_DIR", dir.path().to_str().unwrap()),
            ("FLOE_NODE_RPC_PORT", &port),
        ],
    );
    assert_eq!(output.status.code(), Some(1));
    let error = stderr(&output);
    assert!(
        error.contains(&format!("node.rpc_port: cannot listen on 127.0.0.1:{port}")),
        "{error}"
    );
}

#[test]
fn check_reports_a_missing_secret() {
    let dir = tempfile::tempdir().unwrap();
    let output = floe(
        &["config", "check", "--service", "node"],
        &[("FLOE_PATHS_DATA_DIR", dir.path().to_str().unwrap())],
    );
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("cluster.secret: is empty"),
        "{}",
        stderr(&output)
    );
}
