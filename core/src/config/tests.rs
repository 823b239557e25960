use super::*;
use crate::wire::TlsError;

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn write_file(dir: &tempfile::TempDir, text: &str) -> PathBuf {
    let path = dir.path().join("floe.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn defaults_are_the_documented_values() {
    let config = ConfigLoader::new().load().unwrap();
    assert_eq!(config.memory.object_store_fraction, 0.3);
    assert_eq!(config.memory.system_reserve_fraction, 0.1);
    assert_eq!(config.memory.object_store_min, ByteSize::mib(75));
    assert_eq!(config.memory.object_store_max, ByteSize(200_000_000_000));
    assert_eq!(config.memory.total, MemoryTotal::Auto);
    assert_eq!(config.memory.spill_threshold, 0.8);
    assert_eq!(config.memory.min_spilling_size, ByteSize::mib(100));
    assert_eq!(config.scheduler.rpc_port, 7700);
    assert_eq!(config.scheduler.http_port, 7780);
    assert_eq!(config.node.rpc_port, 7800);
    assert_eq!(config.net.bind_host.to_string(), "127.0.0.1");
    assert_eq!(config.paths.spill_dir(), PathBuf::from("/tmp/floe/spill"));
    assert_eq!(config.paths.cache_dir(), PathBuf::from("/tmp/floe/cache"));
    assert_eq!(config.timeouts.connect(), Duration::from_secs(5));
    assert_eq!(config.log.format, LogFormat::Text);
    assert!(config.cluster.secret.is_empty());
}

#[test]
fn file_then_env_then_flag() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(
        &dir,
        "[scheduler]\nrpc_port = 1111\nhttp_port = 1112\n[node]\nrpc_port = 1113\n",
    );
    // The file alone.
    let config = ConfigLoader::new().file(&path).load().unwrap();
    assert_eq!(
        (config.scheduler.rpc_port, config.scheduler.http_port),
        (1111, 1112)
    );

    // The environment overrides the file; unrelated variables are ignored.
    let vars = env(&[
        ("FLOE_SCHEDULER_RPC_PORT", "2221"),
        ("FLOE_NODE_RPC_PORT", "2223"),
        ("FLOE_CONFIG", "ignored: it names the file"),
        ("HOME", "/root"),
    ]);
    let config = ConfigLoader::new()
        .file(&path)
        .env(vars.clone())
        .load()
        .unwrap();
    assert_eq!(config.scheduler.rpc_port, 2221);
    assert_eq!(config.scheduler.http_port, 1112, "untouched by env");
    assert_eq!(config.node.rpc_port, 2223);

    // A flag overrides both, whatever order the layers were given in.
    let config = ConfigLoader::new()
        .set("scheduler.rpc_port=3331")
        .unwrap()
        .env(vars)
        .file(&path)
        .load()
        .unwrap();
    assert_eq!(config.scheduler.rpc_port, 3331);
    assert_eq!(config.node.rpc_port, 2223);
    assert_eq!(config.scheduler.http_port, 1112);
}

#[test]
fn env_and_flags_are_typed_by_the_setting() {
    let config = ConfigLoader::new()
        .env(env(&[
            ("FLOE_MEMORY_TOTAL", "16GiB"),
            ("FLOE_NET_MAX_FRAME", "1048576"),
            ("FLOE_LOG_FORMAT", "json"),
            ("FLOE_CLUSTER_SECRET", "12345"),
            ("FLOE_NET_BIND_HOST", "0.0.0.0"),
            ("FLOE_MEMORY_OBJECT_STORE_FRACTION", "0.25"),
        ]))
        .set("paths.data_dir=/srv/floe")
        .unwrap()
        .load()
        .unwrap();
    assert_eq!(config.memory.total, MemoryTotal::Fixed(ByteSize::gib(16)));
    assert_eq!(config.net.max_frame, ByteSize::mib(1));
    assert_eq!(config.log.format, LogFormat::Json);
    assert_eq!(config.cluster.secret, ClusterSecret::new("12345"));
    assert_eq!(config.net.bind_host.to_string(), "0.0.0.0");
    assert_eq!(config.memory.object_store_fraction, 0.25);
    assert_eq!(config.paths.spill_dir(), PathBuf::from("/srv/floe/spill"));
}

#[test]
fn the_client_reads_its_address_and_token_from_short_names() {
    let config = ConfigLoader::new()
        .env(env(&[
            ("FLOE_ADDRESS", "10.0.0.1:7700, 10.0.0.2:7700"),
            ("FLOE_TOKEN", "short"),
        ]))
        .load()
        .unwrap();
    assert_eq!(config.client.address, ["10.0.0.1:7700", "10.0.0.2:7700"]);
    assert_eq!(config.client.token.expose(), "short");

    // The full name wins over its alias, whichever the environment lists first.
    let config = ConfigLoader::new()
        .env(env(&[
            ("FLOE_CLIENT_TOKEN", "full"),
            ("FLOE_TOKEN", "short"),
            ("FLOE_CLIENT_ADDRESS", "b:1"),
            ("FLOE_ADDRESS", "a:1"),
        ]))
        .load()
        .unwrap();
    assert_eq!(config.client.token.expose(), "full");
    assert_eq!(config.client.address, ["b:1"]);
}

#[test]
fn list_settings_are_written_comma_separated() {
    assert_eq!(Config::default().node.udf_commands, ["python3"]);
    let listed = ConfigLoader::new()
        .env(env(&[("FLOE_NODE_UDF_COMMANDS", "python3, python3.12")]))
        .load()
        .unwrap();
    assert_eq!(listed.node.udf_commands, ["python3", "python3.12"]);
    let emptied = ConfigLoader::new()
        .set("node.udf_commands=")
        .unwrap()
        .load()
        .unwrap();
    assert!(emptied.node.udf_commands.is_empty());
    let rooted = ConfigLoader::new()
        .set("node.udf_roots=/srv/udfs,/opt/udfs")
        .unwrap()
        .load()
        .unwrap();
    assert_eq!(
        rooted.node.udf_roots,
        [PathBuf::from("/srv/udfs"), PathBuf::from("/opt/udfs")]
    );
    assert!(!rooted.node.udf_allow_inline);
    let relative = ConfigLoader::new()
        .set("node.udf_roots=udfs")
        .unwrap()
        .load()
        .unwrap_err();
    assert!(
        relative.to_string().contains("node.udf_roots"),
        "{relative}"
    );
}

#[test]
fn absolute_subdirectories_are_kept() {
    let config = ConfigLoader::new()
        .set("paths.spill_dir=/mnt/fast/spill")
        .unwrap()
        .load()
        .unwrap();
    assert_eq!(config.paths.spill_dir(), PathBuf::from("/mnt/fast/spill"));
}

#[test]
fn unknown_settings_are_errors_naming_their_origin() {
    let error = ConfigLoader::new()
        .env(env(&[("FLOE_SCHEDULER_RPC_PROT", "1")]))
        .load()
        .unwrap_err();
    let text = error.to_string();
    assert!(
        text.starts_with(
            "environment variable FLOE_SCHEDULER_RPC_PROT: unknown setting \"scheduler.rpc_prot\""
        ),
        "{text}"
    );
    assert!(
        text.contains("scheduler.rpc_port"),
        "lists known keys: {text}"
    );
    assert!(
        !text.contains("node.rpc_port"),
        "only the section's keys: {text}"
    );

    let error = ConfigLoader::new()
        .set("nosuch.key=1")
        .unwrap()
        .load()
        .unwrap_err();
    assert!(matches!(
        error,
        ConfigError::UnknownKey {
            origin: Origin::Flag,
            ..
        }
    ));
    assert!(
        error.to_string().contains("node.rpc_port"),
        "an unknown section lists every key: {error}"
    );

    let error = ConfigLoader::new().set("no-equals-sign").unwrap_err();
    assert_eq!(
        error.to_string(),
        "command-line flag: expected section.key=value, got \"no-equals-sign\""
    );
}

#[test]
fn file_errors_name_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "[scheduler]\nrpc_port = 1\nrpc_prot = 2\n");
    let text = ConfigLoader::new()
        .file(&path)
        .load()
        .unwrap_err()
        .to_string();
    assert!(text.contains("floe.toml"), "{text}");
    assert!(text.contains("line 3"), "{text}");
    assert!(text.contains("unknown field `rpc_prot`"), "{text}");

    let path = write_file(&dir, "[scheduler]\nrpc_port = \"many\"\n");
    let text = ConfigLoader::new()
        .file(&path)
        .load()
        .unwrap_err()
        .to_string();
    assert!(text.contains("line 2"), "{text}");

    let missing = dir.path().join("missing.toml");
    let error = ConfigLoader::new().file(&missing).load().unwrap_err();
    assert!(matches!(error, ConfigError::ReadFile { .. }), "{error}");
}

#[test]
fn bad_values_name_the_variable_and_the_expectation() {
    let cases = [
        ("FLOE_SCHEDULER_RPC_PORT", "abc", "expected an integer"),
        ("FLOE_SCHEDULER_RPC_PORT", "70000", "invalid value"),
        (
            "FLOE_MEMORY_OBJECT_STORE_FRACTION",
            "lots",
            "expected a number",
        ),
        ("FLOE_MEMORY_TOTAL", "12XB", "is not a byte size"),
        ("FLOE_LOG_FORMAT", "xml", "unknown variant `xml`"),
        ("FLOE_NET_BIND_HOST", "localhost:80", "invalid IP address"),
    ];
    for (name, value, expected) in cases {
        let error = ConfigLoader::new()
            .env(env(&[(name, value)]))
            .load()
            .unwrap_err();
        let text = error.to_string();
        assert!(
            text.starts_with(&format!("environment variable {name}: bad value {value:?}")),
            "{text}"
        );
        assert!(text.contains(expected), "{name}: {text}");
    }
}

fn invalid(assignments: &[&str]) -> (String, String) {
    let mut loader = ConfigLoader::new();
    for assignment in assignments {
        loader = loader.set(assignment).unwrap();
    }
    match loader.load() {
        Err(ConfigError::Invalid { key, reason }) => (key.to_owned(), reason),
        other => panic!("{assignments:?} should be invalid, got {other:?}"),
    }
}

#[test]
fn validation_errors() {
    let (key, reason) = invalid(&[
        "memory.object_store_fraction=0.8",
        "memory.system_reserve_fraction=0.3",
    ]);
    assert_eq!(key, "memory.object_store_fraction");
    assert!(
        reason.contains("0.8 + system_reserve_fraction 0.3") && reason.contains("less than 1"),
        "{reason}"
    );

    let (key, reason) = invalid(&["memory.system_reserve_fraction=-0.1"]);
    assert_eq!(key, "memory.system_reserve_fraction");
    assert!(reason.contains("not a fraction"), "{reason}");

    let (key, _) = invalid(&["memory.object_store_fraction=NaN"]);
    assert_eq!(key, "memory.object_store_fraction");

    let (key, reason) = invalid(&[
        "memory.object_store_min=1GiB",
        "memory.object_store_max=1MiB",
    ]);
    assert_eq!(key, "memory.object_store_min");
    assert!(
        reason.contains("larger than object_store_max 1MiB"),
        "{reason}"
    );

    let (key, _) = invalid(&["memory.total=10MiB"]);
    assert_eq!(key, "memory.total");

    for threshold in ["0", "1.5", "-0.2", "NaN"] {
        let (key, reason) = invalid(&[&format!("memory.spill_threshold={threshold}")]);
        assert_eq!(key, "memory.spill_threshold");
        assert!(reason.contains("(0, 1]"), "{reason}");
    }
    let (key, _) = invalid(&["memory.min_spilling_size=0"]);
    assert_eq!(key, "memory.min_spilling_size");

    let (key, reason) = invalid(&["net.max_frame=100"]);
    assert_eq!(key, "net.max_frame");
    assert!(reason.contains("1MiB..=1GiB"), "{reason}");

    let (key, reason) = invalid(&["scheduler.rpc_port=9000", "scheduler.http_port=9000"]);
    assert_eq!(key, "scheduler.http_port");
    assert!(reason.contains("different ports"), "{reason}");

    let (key, _) = invalid(&["timeouts.read_ms=0"]);
    assert_eq!(key, "timeouts.read_ms");

    let (key, _) = invalid(&["paths.data_dir="]);
    assert_eq!(key, "paths.data_dir");
}

#[test]
fn host_check_creates_directories() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let config = ConfigLoader::new()
        .env(env(&[("FLOE_CLUSTER_SECRET", "secret")]))
        .set(&format!("paths.data_dir={}", data_dir.display()))
        .unwrap()
        .set("node.rpc_port=0")
        .unwrap()
        .load()
        .unwrap();
    config.preflight(Service::Node).unwrap();
    for sub in ["spill", "cache", "fallback"] {
        assert!(data_dir.join(sub).is_dir(), "{sub} created");
    }
    let leftovers: Vec<_> = std::fs::read_dir(&data_dir)
        .unwrap()
        .filter_map(|entry| entry.ok())
        .filter(|entry| {
            entry
                .file_name()
                .to_string_lossy()
                .starts_with(".floe-write-probe")
        })
        .collect();
    assert!(leftovers.is_empty(), "probe files are removed");
}

#[test]
fn host_check_reports_an_unusable_directory() {
    let dir = tempfile::tempdir().unwrap();
    // A regular file where a directory should be: fails even for root, unlike permissions.
    let blocker = dir.path().join("blocker");
    std::fs::write(&blocker, b"").unwrap();
    let config = ConfigLoader::new()
        .env(env(&[
            ("FLOE_CLUSTER_SECRET", "secret"),
            ("FLOE_SCHEDULER_REPLICA_SECRET", "replica"),
        ]))
        .set(&format!("paths.data_dir={}", dir.path().display()))
        .unwrap()
        .set(&format!("paths.raft_dir={}/raft", blocker.display()))
        .unwrap()
        .set("scheduler.rpc_port=0")
        .unwrap()
        .set("scheduler.http_port=0")
        .unwrap()
        .load()
        .unwrap();
    let error = config.preflight(Service::Scheduler).unwrap_err();
    let text = error.to_string();
    assert!(
        text.starts_with(&format!(
            "paths.raft_dir = {}/raft: cannot create",
            blocker.display()
        )),
        "{text}"
    );
}

#[test]
fn host_check_reports_a_taken_port() {
    let dir = tempfile::tempdir().unwrap();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let config = ConfigLoader::new()
        .env(env(&[("FLOE_CLUSTER_SECRET", "secret")]))
        .set(&format!("paths.data_dir={}", dir.path().display()))
        .unwrap()
        .set(&format!("node.rpc_port={port}"))
        .unwrap()
        .load()
        .unwrap();
    let error = config.preflight(Service::Node).unwrap_err();
    assert!(
        matches!(
            error,
            ConfigError::PortUnavailable {
                key: "node.rpc_port",
                ..
            }
        ),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .starts_with(&format!("node.rpc_port: cannot listen on 127.0.0.1:{port}")),
        "{error}"
    );
}

#[test]
fn secrets_are_never_shown() {
    let config = ConfigLoader::new()
        .env(env(&[
            ("FLOE_CLUSTER_SECRET", "hunter2-secret"),
            ("FLOE_SCHEDULER_REPLICA_SECRET", "hunter3-secret"),
            ("FLOE_CLIENT_TOKEN", "hunter4-secret"),
        ]))
        .load()
        .unwrap();
    let debug = format!("{config:?}");
    let shown = config.to_toml_redacted().unwrap();
    for secret in ["hunter2", "hunter3", "hunter4"] {
        assert!(!debug.contains(secret), "{debug}");
        assert!(!shown.contains(secret), "{shown}");
    }
    assert!(shown.contains("secret = \"<redacted>\""), "{shown}");
    assert!(shown.contains("replica_secret = \"<redacted>\""), "{shown}");
    assert!(shown.contains("token = \"<redacted>\""), "{shown}");
}

#[test]
fn shown_config_loads_back_identically() {
    let config = ConfigLoader::new()
        .set("memory.total=8GiB")
        .unwrap()
        .load()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, &config.to_toml_redacted().unwrap());
    assert_eq!(ConfigLoader::new().file(&path).load().unwrap(), config);
}

#[test]
fn preflight_requires_the_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let config = ConfigLoader::new()
        .set(&format!("paths.data_dir={}", dir.path().display()))
        .unwrap()
        .load()
        .unwrap();
    let error = config.preflight(Service::Node).unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("invalid setting cluster.secret: is empty"),
        "{error}"
    );
    let config = ConfigLoader::new()
        .set(&format!("paths.data_dir={}", dir.path().display()))
        .unwrap()
        .set("cluster.secret=s")
        .unwrap()
        .load()
        .unwrap();
    let error = config.preflight(Service::Scheduler).unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("invalid setting scheduler.replica_secret: is empty"),
        "{error}"
    );
}

#[test]
fn spill_settings_come_from_the_environment() {
    let config = ConfigLoader::new()
        .env(env(&[
            ("FLOE_MEMORY_SPILL_THRESHOLD", "1"),
            ("FLOE_MEMORY_MIN_SPILLING_SIZE", "4MiB"),
        ]))
        .load()
        .unwrap();
    assert_eq!(config.memory.spill_threshold, 1.0);
    assert_eq!(config.memory.min_spilling_size, ByteSize::mib(4));
}

#[test]
fn scheduler_timing_defaults_and_validation() {
    let config = ConfigLoader::new().load().unwrap();
    let scheduler = &config.scheduler;
    assert_eq!(scheduler.heartbeat_interval(), Duration::from_secs(1));
    assert_eq!(scheduler.missed_heartbeats, 5);
    assert_eq!(scheduler.node_timeout(), Duration::from_secs(5));
    assert_eq!(scheduler.raft_tick(), Duration::from_millis(100));
    assert_eq!(
        (scheduler.election_ticks, scheduler.heartbeat_ticks),
        (10, 2)
    );
    assert_eq!(scheduler.snapshot_entries, 10_000);

    for key in [
        "heartbeat_interval_ms",
        "missed_heartbeats",
        "raft_tick_ms",
        "heartbeat_ticks",
        "snapshot_entries",
    ] {
        let (invalid_key, reason) = invalid(&[&format!("scheduler.{key}=0")]);
        assert_eq!(invalid_key, format!("scheduler.{key}"));
        assert!(reason.contains("at least 1"), "{reason}");
    }
    let (key, reason) = invalid(&["scheduler.election_ticks=3", "scheduler.heartbeat_ticks=3"]);
    assert_eq!(key, "scheduler.election_ticks");
    assert!(
        reason.contains("larger than scheduler.heartbeat_ticks (3)"),
        "{reason}"
    );
}

#[test]
fn node_agent_settings_have_documented_defaults_and_are_validated() {
    let config = ConfigLoader::new().load().unwrap();
    assert_eq!(config.node.workers, 0);
    assert_eq!(config.node.memory_monitor_threshold, 0.95);
    assert_eq!(config.node.transfer_chunk, ByteSize::mib(5));
    assert_eq!(config.node.transfer_inline_max, ByteSize::kib(100));
    for (assignments, key) in [
        (
            &["node.memory_monitor_threshold=0"][..],
            "node.memory_monitor_threshold",
        ),
        (
            &["node.memory_monitor_threshold=1.5"],
            "node.memory_monitor_threshold",
        ),
        (
            &["node.memory_monitor_interval_ms=0"],
            "node.memory_monitor_interval_ms",
        ),
        (&["node.transfer_chunk=0"], "node.transfer_chunk"),
        (
            &["node.transfer_max_in_flight=1MiB"],
            "node.transfer_max_in_flight",
        ),
        (
            &[
                "node.transfer_chunk=64KiB",
                "node.transfer_max_in_flight=64KiB",
            ],
            "node.transfer_inline_max",
        ),
    ] {
        assert_eq!(invalid(assignments).0, key, "{assignments:?}");
    }
    let config = ConfigLoader::new()
        .set("node.workers=3")
        .unwrap()
        .set("node.memory_monitor_threshold=1")
        .unwrap()
        .load()
        .unwrap();
    assert_eq!(config.node.workers, 3);
    assert_eq!(config.node.memory_monitor_threshold, 1.0);
}

#[test]
fn the_cache_cap_has_a_default_comes_from_every_layer_and_is_validated() {
    let config = ConfigLoader::new().load().unwrap();
    assert_eq!(config.cache.max_bytes, ByteSize::gib(20));

    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "[cache]\nmax_bytes = \"3GiB\"\n");
    let config = ConfigLoader::new().file(&path).load().unwrap();
    assert_eq!(config.cache.max_bytes, ByteSize::gib(3));
    // The section is `cache`, the key `max_bytes`: only the first underscore splits.
    let config = ConfigLoader::new()
        .file(&path)
        .env(env(&[("FLOE_CACHE_MAX_BYTES", "512MiB")]))
        .load()
        .unwrap();
    assert_eq!(config.cache.max_bytes, ByteSize::mib(512));
    let config = ConfigLoader::new()
        .env(env(&[("FLOE_CACHE_MAX_BYTES", "512MiB")]))
        .set("cache.max_bytes=1000000000")
        .unwrap()
        .load()
        .unwrap();
    assert_eq!(config.cache.max_bytes, ByteSize(1_000_000_000));

    let error = ConfigLoader::new()
        .env(env(&[("FLOE_CACHE_MAX_BYTES", "lots")]))
        .load()
        .unwrap_err()
        .to_string();
    assert!(
        error.starts_with("environment variable FLOE_CACHE_MAX_BYTES: bad value \"lots\""),
        "{error}"
    );

    for cap in ["0", "127MiB"] {
        let (key, reason) = invalid(&[&format!("cache.max_bytes={cap}")]);
        assert_eq!(key, "cache.max_bytes");
        assert!(
            reason.contains("less than one block (data.max_block_size 128MiB)"),
            "{reason}"
        );
    }
    // The floor follows the block size.
    let config = ConfigLoader::new()
        .set("cache.max_bytes=16MiB")
        .unwrap()
        .set("data.max_block_size=16MiB")
        .unwrap()
        .load()
        .unwrap();
    assert_eq!(config.cache.max_bytes, ByteSize::mib(16));
}

#[test]
fn allowed_paths_hold_paths_under_their_roots_after_resolving_them() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("data");
    let outside = dir.path().join("secrets");
    std::fs::create_dir_all(root.join("in")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(root.join("in/a.csv"), "x\n1\n").unwrap();
    std::fs::write(outside.join("key"), "secret").unwrap();
    std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
    std::os::unix::fs::symlink(outside.join("not-yet"), root.join("dangling")).unwrap();
    let allowed = AllowedPaths::under(std::slice::from_ref(&root));

    assert!(allowed.check(&root.join("in/a.csv")).is_ok());
    // A sink directory that does not exist yet, under the root.
    assert!(allowed.check(&root.join("out/2026/part")).is_ok());
    for escape in [
        outside.join("key"),
        root.join("../secrets/key"),
        root.join("link/key"),
        root.join("dangling"),
        root.join("dangling/part-0.csv"),
        root.join("new/../../secrets"),
        PathBuf::from("relative/a.csv"),
    ] {
        let refused = allowed.check(&escape).unwrap_err();
        assert!(
            refused.to_string().contains("outside data.allowed_paths"),
            "{refused}"
        );
    }
    assert!(AllowedPaths::any().check(&outside.join("key")).is_ok());

    let listed = ConfigLoader::new()
        .set(&format!("data.allowed_paths={}", root.display()))
        .unwrap()
        .load()
        .unwrap();
    assert!(listed.data.allowed().check(&root.join("in/a.csv")).is_ok());
    let relative = ConfigLoader::new()
        .set("data.allowed_paths=data")
        .unwrap()
        .load()
        .unwrap_err();
    assert!(
        relative.to_string().contains("data.allowed_paths"),
        "{relative}"
    );
}

fn service_config(dir: &tempfile::TempDir, settings: &[String]) -> Result<Config, ConfigError> {
    let mut loader = ConfigLoader::new()
        .env(env(&[("FLOE_CLUSTER_SECRET", "secret")]))
        .set(&format!("paths.data_dir={}", dir.path().display()))?
        .set("node.rpc_port=0")?;
    for setting in settings {
        loader = loader.set(setting)?;
    }
    loader.load()
}

#[test]
fn a_server_off_loopback_without_tls_does_not_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = service_config(&dir, &["net.bind_host=0.0.0.0".into()]).unwrap();
    let error = config.preflight(Service::Node).unwrap_err();
    assert!(
        matches!(
            error,
            ConfigError::Invalid {
                key: "net.bind_host",
                ..
            }
        ),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .contains("plaintext is allowed only on loopback"),
        "{error}"
    );

    // With the CA alone it is a client, and still cannot serve.
    let tls_dir = tempfile::tempdir().unwrap();
    let member = crate::wire::tls::generate_throwaway(tls_dir.path(), &[]).unwrap();
    let ca_only = format!("tls.ca={}", member.ca.display());
    let config = service_config(&dir, &["net.bind_host=0.0.0.0".into(), ca_only]).unwrap();
    let error = config.preflight(Service::Node).unwrap_err();
    assert!(
        matches!(
            error,
            ConfigError::Invalid {
                key: "tls.cert",
                ..
            }
        ),
        "{error}"
    );

    // With a certificate and key it serves anywhere.
    let config = service_config(
        &dir,
        &[
            "net.bind_host=0.0.0.0".into(),
            format!("tls.ca={}", member.ca.display()),
            format!("tls.cert={}", member.cert.display()),
            format!("tls.key={}", member.key.display()),
        ],
    )
    .unwrap();
    config.preflight(Service::Node).unwrap();
    assert_eq!(config.tls, member);
}

#[test]
fn tls_files_come_from_the_environment_and_must_make_sense() {
    let config = ConfigLoader::new()
        .env(env(&[("FLOE_TLS_CA", "/etc/floe/ca.pem")]))
        .load()
        .unwrap();
    assert_eq!(
        config.tls.role().unwrap(),
        TlsRole::Client {
            ca: Path::new("/etc/floe/ca.pem")
        }
    );

    let incomplete = |vars: &[(&str, &str)]| match ConfigLoader::new().env(env(vars)).load() {
        Err(ConfigError::Tls(TlsError::Incomplete { key, .. })) => key,
        other => panic!("an incomplete [tls] was accepted: {other:?}"),
    };
    assert_eq!(
        incomplete(&[("FLOE_TLS_CERT", "/etc/floe/node.pem")]),
        "tls.key"
    );
    assert_eq!(
        incomplete(&[("FLOE_TLS_KEY", "/etc/floe/node-key.pem")]),
        "tls.cert"
    );
    assert_eq!(
        incomplete(&[("FLOE_TLS_CERT", "/c.pem"), ("FLOE_TLS_KEY", "/k.pem")]),
        "tls.ca"
    );
}

#[test]
fn a_server_whose_tls_files_do_not_load_does_not_start() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere.pem");
    let config = service_config(
        &dir,
        &[
            format!("tls.ca={}", missing.display()),
            format!("tls.cert={}", missing.display()),
            format!("tls.key={}", missing.display()),
        ],
    )
    .unwrap();
    let error = config.preflight(Service::Node).unwrap_err();
    assert!(matches!(error, ConfigError::Tls(_)), "{error}");
    assert!(error.to_string().contains("nowhere.pem"), "{error}");
}
#[test]
fn allowed_paths_hold_object_urls_under_remote_prefixes() {
    let allowed = AllowedPaths::under(&[PathBuf::from("s3://lake/raw")]);
    assert!(allowed.check(Path::new("s3://lake/raw")).is_ok());
    assert!(
        allowed
            .check(Path::new("s3://lake/raw/2026/a.parquet"))
            .is_ok()
    );
    for refused in [
        "s3://lake/rawer/a.parquet",
        "s3://lake/other/a.parquet",
        "s3://other/raw/a.parquet",
        "gs://lake/raw/a.parquet",
        "s3://lake/raw/../secret/a.parquet",
        "/lake/raw/a.parquet",
    ] {
        assert!(allowed.check(Path::new(refused)).is_err(), "{refused}");
    }
    // A local root does not admit object URLs.
    let local = AllowedPaths::under(&[PathBuf::from("/data")]);
    assert!(local.check(Path::new("s3://data/a.parquet")).is_err());
    let listed = ConfigLoader::new()
        .set("data.allowed_paths=s3://lake/raw")
        .unwrap()
        .load()
        .unwrap();
    assert!(
        listed
            .data
            .allowed()
            .check(Path::new("s3://lake/raw/x"))
            .is_ok()
    );
}

#[test]
fn storage_credentials_load_from_the_file_and_env_and_never_show() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(
        &dir,
        "[storage]\naws_access_key_id = \"AKIDEXAMPLE\"\naws_secret_access_key = \"hunter5\"\n\
         aws_endpoint = \"http://127.0.0.1:9000\"\naws_allow_http = true\n",
    );
    let config = ConfigLoader::new()
        .file(&path)
        .env(env(&[("FLOE_STORAGE_AWS_SESSION_TOKEN", "hunter6")]))
        .load()
        .unwrap();
    assert_eq!(
        config.storage.options(),
        [
            ("aws_access_key_id", "AKIDEXAMPLE"),
            ("aws_secret_access_key", "hunter5"),
            ("aws_session_token", "hunter6"),
            ("aws_endpoint", "http://127.0.0.1:9000"),
            ("aws_allow_http", "true"),
        ]
    );
    let debug = format!("{config:?}");
    let shown = config.to_toml_redacted().unwrap();
    for secret in ["hunter5", "hunter6"] {
        assert!(!debug.contains(secret), "{debug}");
        assert!(!shown.contains(secret), "{shown}");
    }
    assert!(
        shown.contains("aws_secret_access_key = \"<redacted>\""),
        "{shown}"
    );

    // A misspelled key is an error naming it, in the file and in the environment.
    let typo = write_file(&dir, "[storage]\naws_secret_key = \"hunter5\"\n");
    let error = ConfigLoader::new()
        .file(&typo)
        .load()
        .unwrap_err()
        .to_string();
    assert!(error.contains("aws_secret_key"), "{error}");
    let error = ConfigLoader::new()
        .env(env(&[("FLOE_STORAGE_AWS_SECRET", "hunter5")]))
        .load()
        .unwrap_err()
        .to_string();
    assert!(error.contains("storage.aws_secret"), "{error}");
    assert!(!error.contains("hunter5"), "{error}");
}
