//! The client library and the `floe` CLI against real local clusters: submit, wait, status,
//! cancel, job-file validation, a scheduler leader killed while a client waits, and results
//! streamed in order.

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{Array, Int64Array};
use floe_client::{
    ClusterExecutor, Dataset, JobState, LocalCluster, LocalClusterOptions, UdfCall, col, lit,
};
use floe_testkit::batches::int_column;
use floe_testkit::cluster::{FAST_ELECTIONS, READY_TIMEOUT, TestCluster, TestClusterConfig};
use floe_testkit::process::{floe_command, processes_mentioning, wait_until_none_mention};

fn options(nodes: usize) -> LocalClusterOptions {
    LocalClusterOptions {
        nodes,
        binary: env!("CARGO_BIN_EXE_floe").into(),
        workers_per_node: 2,
        node_settings: vec!["data.max_block_size=8MiB".into()],
        tls: false,
        ports: floe_client::local::LocalPorts::default(),
    }
}

/// Runs the CLI against `cluster`.
fn floe(cluster: &LocalCluster, args: &[&str]) -> Output {
    floe_testkit::process::run_floe_against(env!("CARGO_BIN_EXE_floe"), cluster, args)
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "floe failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

const JOB_FILE: &str = r#"
[source]
range = 5000

[[steps]]
with_column = { name = "k", expr = "id % 7" }

[[steps]]
filter = "k != 3 and id >= 100"

[[steps]]
groupby = ["k"]
agg = ["count(*) as n", "sum(id) as total"]

[[steps]]
sort = ["k desc"]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_submits_waits_lists_and_cancels_jobs() {
    let cluster = LocalCluster::start(options(2)).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let job_file = dir.path().join("job.toml");
    std::fs::write(&job_file, JOB_FILE).unwrap();
    let file = job_file.to_str().unwrap();

    let submitted = stdout(&floe(&cluster, &["submit", file, "--wait"]));
    assert!(submitted.contains("job 1 succeeded: 6 rows"), "{submitted}");
    // The printed head: the largest key first, and its count and total computed here.
    let members: Vec<i64> = (100..5000).filter(|id| id % 7 == 6).collect();
    let first_row = format!("6  {}  {}", members.len(), members.iter().sum::<i64>());
    assert!(
        submitted.contains(&first_row),
        "{first_row:?} not in {submitted}"
    );

    let jobs = stdout(&floe(&cluster, &["jobs"]));
    assert!(
        jobs.lines()
            .any(|line| line.starts_with("1 ") && line.contains("succeeded")),
        "{jobs}"
    );
    let status = stdout(&floe(&cluster, &["status"]));
    assert!(
        status.contains("leader") && status.contains("nodes: 2 alive, 0 dead"),
        "{status}"
    );
    let nodes = stdout(&floe(&cluster, &["nodes"]));
    assert_eq!(nodes.matches("alive").count(), 2, "{nodes}");

    // A slow job, cancelled while it runs.
    let slow = dir.path().join("slow.toml");
    std::fs::write(
        &slow,
        "[source]\nrange = 200000\n[[steps]]\nmap_batches = { udf = \"delay\", version = 1, args = { ms = 500 } }\n",
    )
    .unwrap();
    let submitted = stdout(&floe(&cluster, &["submit", slow.to_str().unwrap()]));
    assert!(submitted.contains("job 2 submitted"), "{submitted}");
    let client = cluster.connect().await.unwrap();
    while client
        .job(floe_core::JobId::new(2))
        .progress()
        .await
        .unwrap()
        .is_none()
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cancelled = stdout(&floe(&cluster, &["cancel", "2"]));
    assert!(cancelled.contains("cancel requested"), "{cancelled}");
    let error = client
        .job(floe_core::JobId::new(2))
        .wait()
        .await
        .err()
        .unwrap();
    assert!(
        matches!(error, floe_client::Error::JobCancelled(_)),
        "{error}"
    );
    let shown = stdout(&floe(&cluster, &["job", "2"]));
    assert!(shown.contains("job 2: cancelled"), "{shown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_job_file_is_refused_naming_the_line_and_field() {
    let cluster = LocalCluster::start(options(1)).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let job_file = dir.path().join("bad.toml");
    std::fs::write(
        &job_file,
        "[source]\nrange = 10\n\n[[steps]]\nfilter = \"idd > 3\"\n",
    )
    .unwrap();
    let output = floe(&cluster, &["submit", job_file.to_str().unwrap()]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("bad.toml:4: steps[0].filter"), "{stderr}");
    assert!(stderr.contains("idd"), "{stderr}");
    // Nothing was submitted.
    let jobs = cluster.connect().await.unwrap().jobs().await.unwrap();
    assert!(jobs.is_empty(), "{jobs:?}");
}

/// Three scheduler replicas and two nodes of two workers each, with `node_settings` besides.
async fn three_replicas_and_two_nodes(node_settings: &[&str]) -> TestCluster {
    let config = TestClusterConfig {
        replicas: 3,
        settings: vec![FAST_ELECTIONS.into()],
        node_settings: node_settings.iter().map(|s| (*s).to_owned()).collect(),
        ..TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"))
    };
    TestCluster::start(config, 2).await
}

/// The `id` column of a job's output, in output order.
async fn output_ids(output: &floe_client::JobOutput) -> Vec<i64> {
    int_column(&output.to_arrow().await.unwrap(), "id")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_client_survives_a_scheduler_leader_kill() {
    let mut cluster = three_replicas_and_two_nodes(&[]).await;
    let leader = cluster
        .schedulers
        .wait_for_leader(READY_TIMEOUT)
        .await
        .unwrap();
    let client = cluster.connect().await;
    let slow = Dataset::range(60_000)
        .unwrap()
        .map_batches(UdfCall::new("delay", 1).with("ms", 300i64))
        .unwrap();
    let job = client.submit(&slow).await.unwrap();
    while job.progress().await.unwrap().is_none() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cluster.schedulers.kill(leader).unwrap();
    let output = job.wait().await.unwrap();
    assert_eq!(output.rows(), 60_000);
    assert_eq!(job.state().await.unwrap(), JobState::Succeeded);
    // Every row, once and in order, from the blocks the new leader's state points at.
    let ids = output_ids(&output).await;
    assert_eq!(ids, (0..60_000).collect::<Vec<_>>());
    // The committed state survived the kill: both nodes and the job are there, and the
    // cluster runs the next job.
    let info = client.cluster().await.unwrap();
    assert_eq!(info.nodes.iter().filter(|node| node.alive).count(), 2);
    let jobs = client.jobs().await.unwrap();
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!(jobs[0].state, JobState::Succeeded);
    let after = client
        .submit(
            &Dataset::range(5_000)
                .unwrap()
                .filter(col("id").lt(lit(10i64)))
                .unwrap(),
        )
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(after.rows(), 10);
}

#[test]
fn iter_batches_on_a_cluster_returns_every_row_once_in_order() {
    let runtime = floe_testkit::cluster::runtime();
    let cluster = runtime.block_on(LocalCluster::start(options(2))).unwrap();
    let executor =
        Arc::new(ClusterExecutor::connect(&cluster.addresses(), cluster.token()).unwrap());
    let n = 150_000i64;
    let doubled = Dataset::range(n as u64)
        .unwrap()
        .with_column("twice", col("id") * lit(2i64))
        .unwrap()
        .with_executor(executor);
    let mut ids = Vec::new();
    for batch in doubled.iter_batches().unwrap() {
        let batch = batch.unwrap();
        let column = batch.column_by_name("id").unwrap();
        ids.extend_from_slice(
            column
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .values(),
        );
        let twice = batch.column_by_name("twice").unwrap();
        assert_eq!(twice.null_count(), 0);
    }
    assert_eq!(ids, (0..n).collect::<Vec<_>>());
    assert_eq!(doubled.count().unwrap(), n as u64);
    let head = doubled.take(5).unwrap();
    assert_eq!(head.iter().map(|b| b.num_rows()).sum::<usize>(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_floe_binary_runs_its_own_udf_on_the_cluster() {
    // `cargo test` builds the examples beside the binaries.
    let custom = std::path::Path::new(env!("CARGO_BIN_EXE_floe"))
        .parent()
        .unwrap()
        .join("examples/custom_floe");
    assert!(
        custom.is_file(),
        "{} is missing: run the tests with `cargo test`, which builds the examples",
        custom.display()
    );
    let cluster = LocalCluster::start(LocalClusterOptions {
        binary: custom.clone(),
        ..options(2)
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let job_file = dir.path().join("square.toml");
    std::fs::write(
        &job_file,
        "[source]\nrange = 1000\n[[steps]]\nmap_batches = { udf = \"square\", version = 1, args = { column = \"id\" } }\n",
    )
    .unwrap();
    let file = job_file.to_str().unwrap();

    // The stock binary does not know the UDF; the job file is refused before submission.
    let refused = floe(&cluster, &["submit", file]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("unknown UDF \"square\"@1"), "{stderr}");

    let output = Command::new(&custom)
        .args(["submit", file, "--wait", "--scheduler"])
        .arg(cluster.addresses().join(","))
        .env("FLOE_CLIENT_TOKEN", cluster.token())
        .output()
        .unwrap();
    let printed = stdout(&output);
    assert!(printed.contains("succeeded: 1000 rows"), "{printed}");
    let client = cluster.connect().await.unwrap();
    let batches = client
        .job(floe_core::JobId::new(1))
        .wait()
        .await
        .unwrap()
        .to_arrow()
        .await
        .unwrap();
    let squares: Vec<f64> = batches
        .iter()
        .flat_map(|batch| {
            let column = batch.column_by_name("id").unwrap();
            let values = column
                .as_any()
                .downcast_ref::<arrow::array::Float64Array>()
                .unwrap();
            values.values().to_vec()
        })
        .collect();
    let expected: Vec<f64> = (0..1000).map(|id| f64::from(id) * f64::from(id)).collect();
    assert_eq!(squares, expected);
}

/// Shard files in the cache directory of the node data directory `data_dir`.
fn cache_files(data_dir: &std::path::Path) -> usize {
    std::fs::read_dir(data_dir.join("cache"))
        .unwrap()
        .filter(|entry| {
            let name = entry.as_ref().unwrap().file_name();
            name.to_string_lossy().starts_with("cache-")
        })
        .count()
}

/// Runs `floe cache …` on the node data directory `data_dir` of `cluster`.
fn floe_cache(cluster: &LocalCluster, data_dir: &std::path::Path, args: &[&str]) -> String {
    let output = floe_command(env!("CARGO_BIN_EXE_floe"))
        .env("FLOE_CLIENT_TOKEN", cluster.token())
        .args([
            "--set",
            &format!("paths.data_dir={}", data_dir.display()),
            "cache",
        ])
        .args(args)
        .output()
        .unwrap();
    stdout(&output)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_cli_lists_explains_and_cleans_and_jobs_survive_the_clean() {
    let cluster = LocalCluster::start(options(1)).await.unwrap();
    let client = cluster.connect().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let job_file = |name: &str, modulus: i64| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "[source]\nrange = 20000\n[[steps]]\nwith_column = {{ name = \"k\", expr = \"id % {modulus}\" }}\n"
            ),
        )
        .unwrap();
        path
    };
    let cached = job_file("cached.toml", 7);
    let parsed = floe_client::jobspec::parse_job_file(
        "cached.toml",
        &std::fs::read_to_string(&cached).unwrap(),
        Arc::new(floe_client::Registry::with_builtins()),
    )
    .unwrap();
    let first = client
        .submit(&parsed.dataset)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert!(first.stats.compute_tasks() > 0);

    let data_dir = cluster.dir().join("node-0");
    let listed = floe_cache(&cluster, &data_dir, &["ls"]);
    let shard_files = cache_files(&data_dir);
    assert!(shard_files > 0);
    assert!(
        listed.contains(&format!("{shard_files}/{shard_files}")),
        "{listed}"
    );

    let explained = floe_cache(&cluster, &data_dir, &["explain", cached.to_str().unwrap()]);
    assert!(
        explained.contains("cached, with shard counts"),
        "{explained}"
    );
    let changed = job_file("changed.toml", 9);
    let explained = floe_cache(&cluster, &data_dir, &["explain", changed.to_str().unwrap()]);
    assert!(explained.contains("nearest cached entry"), "{explained}");
    assert!(
        explained.contains("expr"),
        "the changed argument is named: {explained}"
    );
    // With a sink, the explanation is about what the sink writes: cached for the cached
    // pipeline; for the changed one, the operator whose result is missing and why.
    let with_sink = |name: &str, job: &std::path::Path| {
        let path = dir.path().join(name);
        let text = std::fs::read_to_string(job).unwrap();
        let out = dir.path().join("out");
        std::fs::write(
            &path,
            format!("{text}[sink]\nwrite_csv = \"{}\"\n", out.display()),
        )
        .unwrap();
        path
    };
    let sunk = with_sink("cached_sink.toml", &cached);
    let explained = floe_cache(&cluster, &data_dir, &["explain", sunk.to_str().unwrap()]);
    assert!(
        explained.contains("(files, not cached)")
            && explained.contains("cached, with shard counts"),
        "{explained}"
    );
    let sunk = with_sink("changed_sink.toml", &changed);
    let explained = floe_cache(&cluster, &data_dir, &["explain", sunk.to_str().unwrap()]);
    assert!(
        explained.contains("nearest cached entry") && explained.contains("expr"),
        "{explained}"
    );
    assert!(
        explained.contains("  with_column ") && explained.contains("not cached"),
        "{explained}"
    );
    assert!(!explained.contains("write_csv"), "{explained}");

    // Against the cluster: the index says which job and operator made each entry.
    let listed = stdout(
        &floe_command(env!("CARGO_BIN_EXE_floe"))
            .args(["cache", "ls"])
            .env("FLOE_ADDRESS", cluster.addresses().join(","))
            .env("FLOE_CLIENT_TOKEN", cluster.token())
            .output()
            .unwrap(),
    );
    let entry = listed
        .lines()
        .find(|line| line.contains("range→with_column"))
        .unwrap_or_else(|| panic!("no entry made by range→with_column: {listed}"));
    let columns: Vec<&str> = entry.split_whitespace().collect();
    assert_eq!(
        columns[1],
        format!("{shard_files}/{shard_files}"),
        "{listed}"
    );
    assert_eq!(
        columns[3],
        format!("1:{shard_files}"),
        "node 1 holds every shard: {listed}"
    );
    assert_eq!(columns[5], "1", "made by job 1: {listed}");

    let cleaned = floe_cache(&cluster, &data_dir, &["clean"]);
    assert!(
        cleaned.contains(&format!("removed {shard_files} shards"))
            && cleaned.contains("through the node"),
        "{cleaned}"
    );
    assert_eq!(cache_files(&data_dir), 0);
    // The running node took the shards out of the index before removing their files.
    let url = cluster.dashboard_url();
    let http = url.trim_start_matches("http://").trim_end_matches('/');
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let cache = floe_testkit::http::get(http, "/api/cache", cluster.token()).json();
        if cache["entries"] == serde_json::json!([]) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the dashboard still lists cleaned entries: {cache}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Nothing indexed, nothing missing: the job recomputes and caches again.
    let again = client
        .submit(&parsed.dataset)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(again.rows(), 20_000);
    assert!(again.stats.compute_tasks() > 0, "{:?}", again.stats);
    assert_eq!(cache_files(&data_dir), shard_files);
}

/// A `floe up` that is interrupted (and so stops its cluster) when the test ends, even when
/// an assertion fails first.
struct StopOnDrop(std::process::Child);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = Command::new("kill")
                .args(["-INT", &self.0.id().to_string()])
                .status();
            let _ = self.0.wait();
        }
    }
}

/// `floe up` generates its secrets and an admin token, stores the token in a file only its
/// owner can read, prints the file's path but never the token, and the token works, over TLS
/// with the CA it prints; without the CA a client is told the cluster requires TLS. Its REST
/// API (HTTPS) refuses reads without a token (401) and serves them with a read token (200),
/// one created with `floe token create` while the cluster runs.
#[test]
fn floe_up_keeps_a_generated_token_in_a_private_file() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::fs::PermissionsExt;

    // `--set paths.data_dir` places the cluster, which keeps the directory when it stops;
    // the ports set are the ones it listens on.
    let data_dir = tempfile::tempdir().unwrap();
    let ports: Vec<u16> = (0..3)
        .map(|_| {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().port()
        })
        .collect();
    let port_settings = [
        format!("scheduler.rpc_port={}", ports[0]),
        format!("scheduler.http_port={}", ports[1]),
        format!("node.rpc_port={}", ports[2]),
    ];
    let mut up = StopOnDrop(
        floe_command(env!("CARGO_BIN_EXE_floe"))
            .args(["up", "--nodes", "1", "--workers", "1", "--set"])
            .arg(format!("paths.data_dir={}", data_dir.path().display()))
            .args(port_settings.iter().flat_map(|setting| ["--set", setting]))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut printed = String::new();
    let mut lines = BufReader::new(up.0.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        printed.push_str(&line);
        printed.push('\n');
        if line.contains("press Ctrl-C") {
            break;
        }
    }
    let field = |name: &str| {
        printed
            .lines()
            .find_map(|line| line.trim().strip_prefix(name))
            .map(|rest| rest.trim().to_owned())
            .unwrap_or_else(|| panic!("no {name} line in:\n{printed}"))
    };
    assert_eq!(field("schedulers:"), format!("127.0.0.1:{}", ports[0]));
    assert_eq!(
        field("dashboard:"),
        format!("https://127.0.0.1:{}/", ports[1])
    );
    assert_eq!(field("nodes:"), format!("127.0.0.1:{}", ports[2]));
    // A second cluster on the same scheduler port is refused, naming the setting.
    let second = floe_command(env!("CARGO_BIN_EXE_floe"))
        .args(["up", "--temp", "--nodes", "1", "--set", &port_settings[0]])
        .output()
        .unwrap();
    assert!(
        !second.status.success(),
        "a second cluster started on a taken port"
    );
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(
        stderr.contains(&format!(
            "scheduler.rpc_port={}: the port is taken",
            ports[0]
        )),
        "{stderr}"
    );
    let token_file = field("token:")
        .trim_end_matches("(an admin client token, mode 0600)")
        .trim()
        .to_owned();
    let schedulers = field("schedulers:");
    let metadata = std::fs::metadata(&token_file).unwrap();
    assert_eq!(metadata.permissions().mode() & 0o777, 0o600);
    let token = std::fs::read_to_string(&token_file).unwrap();
    assert!(
        token.len() >= 32,
        "a short token: {} characters",
        token.len()
    );
    assert!(
        !printed.contains(&token),
        "the token was printed:\n{printed}"
    );

    let ca = field("ca:")
        .trim_end_matches("(TLS: clients verify with it)")
        .trim()
        .to_owned();
    assert!(std::path::Path::new(&ca).is_file(), "{ca}");
    let status = floe_command(env!("CARGO_BIN_EXE_floe"))
        .args(["status", "--scheduler", &schedulers])
        .env("FLOE_CLIENT_TOKEN", &token)
        .env("FLOE_TLS_CA", &ca)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let refused = floe_command(env!("CARGO_BIN_EXE_floe"))
        .args(["status", "--scheduler", &schedulers])
        .env("FLOE_CLIENT_TOKEN", "not-the-token")
        .env("FLOE_TLS_CA", &ca)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let plaintext = floe_command(env!("CARGO_BIN_EXE_floe"))
        .args(["status", "--scheduler", &schedulers])
        .env("FLOE_CLIENT_TOKEN", &token)
        .output()
        .unwrap();
    assert!(!plaintext.status.success());
    let stderr = String::from_utf8_lossy(&plaintext.stderr);
    assert!(stderr.contains("requires TLS"), "{stderr}");

    // The REST API, over HTTPS: reads need a token by default.
    let files = field("files:");
    let http = field("dashboard:")
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .to_owned();
    let ca = std::path::Path::new(&ca);
    let get = |token: &str| floe_testkit::http::get_tls(&http, "/api/jobs", token, ca).unwrap();
    assert_eq!(get("").status, 401);
    assert_eq!(get("not-the-token").status, 401);
    let created = floe_command(env!("CARGO_BIN_EXE_floe"))
        .args(["token", "create", "--name", "reader", "--scopes", "read"])
        .arg("--set")
        .arg(format!("auth.tokens_file={files}/tokens"))
        .output()
        .unwrap();
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let read_token = String::from_utf8(created.stdout).unwrap().trim().to_owned();
    let jobs = get(&read_token);
    assert_eq!(jobs.status, 200, "{}", jobs.body);
    let submitted = floe_testkit::http::post_json_tls(
        &http,
        "/api/jobs",
        &read_token,
        &serde_json::json!({"job": "[source]\nrange = 3\n"}),
        ca,
    )
    .unwrap();
    assert_eq!(submitted.status, 403, "{}", submitted.body);

    // SIGTERM (a service manager, `timeout`, `kill`) stops the cluster like Ctrl-C: every
    // process it started is gone, and the token file goes with it.
    let started = processes_mentioning(&files);
    assert!(started.len() >= 2, "a scheduler and a node: {started:?}");
    let terminated = Command::new("kill")
        .args(["-TERM", &up.0.id().to_string()])
        .status()
        .unwrap();
    assert!(terminated.success());
    assert!(up.0.wait().unwrap().success());
    assert!(!std::path::Path::new(&token_file).exists());
    assert_eq!(std::path::Path::new(&files), data_dir.path());
    assert!(
        data_dir.path().join("node-0").is_dir(),
        "the kept directory"
    );
    wait_until_none_mention(&files, "left running", Duration::from_secs(10));
}

/// Every scheduler replica stopped in the middle of a job, then started again on its Raft
/// directory: the nodes and the driver wait it out, the job completes with every row, and
/// the committed state (nodes, the job) is what it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_survives_every_scheduler_replica_stopping_and_restarting() {
    let small_blocks = ["data.min_block_size=16KiB", "data.max_block_size=64KiB"];
    let mut cluster = three_replicas_and_two_nodes(&small_blocks).await;
    let client = cluster.connect().await;
    let n = 200_000i64;
    let slow = Dataset::range(n as u64)
        .unwrap()
        .map_batches(UdfCall::new("delay", 1).with("ms", 400i64))
        .unwrap();
    let job = client.submit(&slow).await.unwrap();
    while job.progress().await.unwrap().is_none() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // About 25 blocks of 400 ms on 4 workers: seconds of work are left.
    assert_eq!(job.state().await.unwrap(), JobState::Running);
    for id in 1..=3 {
        cluster.schedulers.kill(id).unwrap();
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    for id in 1..=3 {
        cluster.schedulers.start_replica(id).unwrap();
    }
    cluster
        .schedulers
        .wait_for_leader(Duration::from_secs(30))
        .await
        .unwrap();

    let client = cluster.connect().await;
    let output = client.job(job.id()).wait().await.unwrap();
    let ids = output_ids(&output).await;
    assert_eq!(ids, (0..n).collect::<Vec<_>>());
    let info = client.cluster().await.unwrap();
    assert_eq!(
        info.nodes.iter().filter(|node| node.alive).count(),
        2,
        "{:?}",
        info.nodes
    );
    assert_eq!(client.jobs().await.unwrap().len(), 1);
}

/// From a directory of its own, with only `FLOE_ADDRESS` and `FLOE_TOKEN` in the environment:
/// the job reads `in.csv` and writes `./out` there; submitting it again is refused (mode
/// `error`); `--wait` piped into a reader that stops early ends quietly with status 0; the
/// job's name is listed and filtered on; and a strict cast of text to int64 fails the job,
/// naming the value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_finds_the_cluster_from_the_environment() {
    let cluster = LocalCluster::start(options(1)).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let rows: String = (0..20)
        .map(|i| format!("{i},{},{}\n", i % 3, ["north", "south"][i % 2]))
        .collect();
    std::fs::write(home.path().join("in.csv"), format!("id,k,region\n{rows}")).unwrap();
    std::fs::write(
        home.path().join("job.toml"),
        "name = \"ones to out\"\n[source]\nread_csv = [\"in.csv\"]\n[[steps]]\nfilter = \"k == 1\"\n[sink]\nwrite_csv = \"out\"\n",
    )
    .unwrap();
    let submit = || {
        floe_command(env!("CARGO_BIN_EXE_floe"))
            .args(["submit", "job.toml", "--wait"])
            .current_dir(home.path())
            .env("FLOE_ADDRESS", cluster.addresses().join(","))
            .env("FLOE_TOKEN", cluster.token())
            .output()
            .unwrap()
    };
    let first = stdout(&submit());
    assert!(first.contains("job 1 succeeded"), "{first}");
    let written: usize = std::fs::read_dir(home.path().join("out"))
        .unwrap()
        .map(|entry| {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            text.lines().skip(1).count()
        })
        .sum();
    assert_eq!(written, 7, "rows in ./out");

    let again = submit();
    assert!(!again.status.success(), "the second write was not refused");
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(stderr.contains("already holds files"), "{stderr}");

    // Without an address anywhere, the command says how to give one.
    let lost = floe_command(env!("CARGO_BIN_EXE_floe"))
        .arg("jobs")
        .output()
        .unwrap();
    assert!(!lost.status.success());
    assert!(
        String::from_utf8_lossy(&lost.stderr).contains("FLOE_ADDRESS"),
        "{}",
        String::from_utf8_lossy(&lost.stderr)
    );

    // `floe submit --wait | head -1`: the reader exits after the first line; the rest of the
    // output (stats, rows) meets a closed pipe, and floe ends with status 0 and no panic.
    let piped = dir_job_without_sink(home.path());
    let mut child = floe_command(env!("CARGO_BIN_EXE_floe"))
        .args(["submit", piped.to_str().unwrap(), "--wait"])
        .env("FLOE_ADDRESS", cluster.addresses().join(","))
        .env("FLOE_TOKEN", cluster.token())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut reader = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut first_line = String::new();
    std::io::BufRead::read_line(&mut reader, &mut first_line).unwrap();
    assert!(first_line.contains("submitted"), "{first_line}");
    drop(reader);
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{:?}: {stderr}", output.status);
    assert!(!stderr.contains("panicked"), "{stderr}");

    // `floe jobs`: newest first, a page at a time, with times and the sink.
    let run = |args: &[&str]| {
        stdout(
            &floe_command(env!("CARGO_BIN_EXE_floe"))
                .args(args)
                .env("FLOE_ADDRESS", cluster.addresses().join(","))
                .env("FLOE_TOKEN", cluster.token())
                .output()
                .unwrap(),
        )
    };
    let jobs = run(&["jobs"]);
    let ids: Vec<&str> = jobs
        .lines()
        .skip(1)
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    // The refused second submission never became a job.
    assert_eq!(ids, ["2", "1"], "{jobs}");
    let out = home.path().join("out");
    let first = jobs.lines().find(|line| line.starts_with("1 ")).unwrap();
    assert!(
        first.contains("succeeded")
            && first.contains(" UTC")
            && first.contains(out.to_str().unwrap()),
        "{jobs}"
    );
    let page = run(&["jobs", "--limit", "1"]);
    assert!(page.lines().nth(1).unwrap().starts_with("2 "), "{page}");
    assert!(page.contains("(1 more: --offset 1)"), "{page}");
    let page = run(&["jobs", "--limit", "1", "--offset", "1"]);
    assert!(page.lines().nth(1).unwrap().starts_with("1 "), "{page}");
    assert!(!page.contains("more"), "{page}");

    // `floe job ID`: times, plan, where the output is; `--rows N` prints N rows.
    let written = run(&["job", "1"]);
    assert!(
        written.contains("submitted: ") && written.contains("plan:"),
        "{written}"
    );
    assert!(
        written.contains(&format!("output: written to {}", out.display())),
        "{written}"
    );
    let held = run(&["job", "2", "--rows", "3"]);
    assert!(held.contains("output: 1000 rows"), "{held}");
    let printed_rows = held
        .lines()
        .skip_while(|line| line.trim() != "id")
        .skip(1)
        .count();
    assert_eq!(printed_rows, 3, "{held}");

    // The job file's name: in the list, in `floe job`, and the list filtered on it.
    assert!(first.contains("ones to out"), "{jobs}");
    assert!(written.contains("name:      ones to out"), "{written}");
    let named = run(&["jobs", "--name", "to o"]);
    let ids: Vec<&str> = named
        .lines()
        .skip(1)
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    assert_eq!(ids, ["1"], "{named}");

    // A strict cast of text to int64 fails the job and names the first value.
    std::fs::write(
        home.path().join("cast.toml"),
        "[source]\nread_csv = [\"in.csv\"]\n[[steps]]\nwith_column = { name = \"r\", expr = \"cast(region, 'int64')\" }\n",
    )
    .unwrap();
    let cast = floe_command(env!("CARGO_BIN_EXE_floe"))
        .args(["submit", "cast.toml", "--wait"])
        .current_dir(home.path())
        .env("FLOE_ADDRESS", cluster.addresses().join(","))
        .env("FLOE_TOKEN", cluster.token())
        .output()
        .unwrap();
    assert!(!cast.status.success(), "the strict cast did not fail");
    let stderr = String::from_utf8_lossy(&cast.stderr);
    assert!(
        stderr.contains("\"north\" does not convert to Int64"),
        "{stderr}"
    );
}

/// A job with no sink whose result is printed after the wait.
fn dir_job_without_sink(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("print.toml");
    std::fs::write(&path, "[source]\nrange = 1000\n").unwrap();
    path
}

/// A cluster in a kept directory leaves it behind, the nodes' caches included, and the next
/// cluster starts in it (with new secrets: the last run's scheduler state and token go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_directory_outlives_its_cluster() {
    let home = tempfile::tempdir().unwrap();
    let dir = floe_client::LocalClusterDir::Kept(home.path().join("up"));
    let plan = || {
        Dataset::range(1000)
            .unwrap()
            .filter(col("id").gt(lit(10)))
            .unwrap()
    };
    let cluster = LocalCluster::start_in(options(1), &dir).await.unwrap();
    let first_token = cluster.token().to_owned();
    let client = cluster.connect().await.unwrap();
    let output = client.submit(&plan()).await.unwrap().wait().await.unwrap();
    assert_eq!(output.rows(), 989);
    drop(client);
    drop(cluster);
    let node_dir = home.path().join("up/node-0");
    assert!(
        node_dir.is_dir(),
        "the node's directory went with the cluster"
    );

    let cluster = LocalCluster::start_in(options(1), &dir).await.unwrap();
    assert_ne!(cluster.token(), first_token);
    let client = cluster.connect().await.unwrap();
    let output = client.submit(&plan()).await.unwrap().wait().await.unwrap();
    assert_eq!(output.rows(), 989);
    let cached: u64 = output.stats.operators.iter().map(|op| op.cache_hits).sum();
    assert!(
        cached > 0,
        "the second cluster missed the first one's cache"
    );
}
