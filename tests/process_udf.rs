//! Process UDFs (Python via `floe_udf`) on real local clusters: results against a reference,
//! state kept per process, every failure kind with its stderr tail, the command allowlist, and
//! the cache invalidated by editing the script but not by touching it; a child's environment
//! and where its code may come from (`node.udf_roots`, no inline code).
//!
//! Needs `python3` with pyarrow on `PATH` (`.ci/run` installs it).

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use arrow::record_batch::RecordBatch;
use floe_client::jobspec::parse_job_file;
use floe_client::{Client, Dataset, JobOptions, LocalCluster, LocalClusterOptions, Registry};

/// Nodes that run UDF scripts from anywhere under the temporary directory, where the tests
/// write theirs.
fn options(nodes: usize) -> LocalClusterOptions {
    options_with_roots(nodes, &std::env::temp_dir())
}

fn options_with_roots(nodes: usize, roots: &Path) -> LocalClusterOptions {
    LocalClusterOptions {
        nodes,
        binary: env!("CARGO_BIN_EXE_floe").into(),
        workers_per_node: 2,
        node_settings: vec![
            "data.max_block_size=1MiB".into(),
            format!("node.udf_roots={}", roots.display()),
        ],
        ports: floe_client::local::LocalPorts::default(),
        tls: false,
    }
}

/// Writes a UDF script: `body` is the Python after the imports.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    let text = format!(
        "import os, sys, time\nimport pyarrow as pa\nimport pyarrow.compute as pc\nimport floe_udf\n{body}\nif __name__ == \"__main__\":\n    floe_udf.serve()\n"
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// A job file over `range(rows)` whose one step is the process UDF `udf` (TOML inline table
/// fields).
fn job(rows: u64, udf: &str) -> Dataset {
    let text = format!("[source]\nrange = {rows}\n[[steps]]\nmap_batches = {{ {udf} }}\n");
    parse_job_file(
        "job.toml",
        &text,
        std::sync::Arc::new(Registry::with_builtins()),
    )
    .unwrap()
    .dataset
}

/// The Int64 column `name` of the batches, sorted.
fn int_column(batches: &[RecordBatch], name: &str) -> Vec<i64> {
    let mut values = floe_testkit::batches::int_column(batches, name);
    values.sort_unstable();
    values
}

async fn run(client: &Client, dataset: &Dataset, retries: u32) -> floe_client::JobOutput {
    let options = JobOptions {
        max_task_retries: retries,
        ..JobOptions::default()
    };
    client
        .submit_with(dataset, options)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap()
}

/// Posts `spec` to the cluster's `POST /api/jobs` with its token.
async fn post_job(cluster: &LocalCluster, spec: &str) -> floe_testkit::http::Response {
    let addr = floe_testkit::http::http_addr(cluster);
    let (token, spec) = (cluster.token().to_owned(), spec.to_owned());
    tokio::task::spawn_blocking(move || {
        floe_testkit::http::post_json(
            &addr,
            "/api/jobs",
            &token,
            &serde_json::json!({ "job": spec }),
        )
    })
    .await
    .unwrap()
}

async fn failure(client: &Client, dataset: &Dataset, retries: u32) -> String {
    let options = JobOptions {
        max_task_retries: retries,
        ..JobOptions::default()
    };
    let handle = client.submit_with(dataset, options).await.unwrap();
    let ended = handle.wait().await;
    assert!(ended.is_err(), "the job should fail");
    handle.error().await.unwrap().unwrap_or_default()
}

const STATEFUL: &str = r#"
marker_dir = sys.argv[1]

@floe_udf.init
def load():
    with open(os.path.join(marker_dir, "init-%d" % os.getpid()), "a") as f:
        f.write("init\n")
    return {"offset": 7}

@floe_udf.batch
def triple(batch):
    with open(os.path.join(marker_dir, "batches-%d" % os.getpid()), "a") as f:
        f.write("batch\n")
    ids = batch.column("id")
    y = pc.add(pc.multiply(ids, 3), floe_udf.state["offset"])
    return pa.RecordBatch.from_arrays([ids, y], names=["id", "y"])
"#;

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path).unwrap().lines().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_udf_pipeline_matches_the_reference_and_keeps_state_per_process() {
    let cluster = LocalCluster::start(options(2)).await.unwrap();
    let client = cluster.connect().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let markers = dir.path().join("markers");
    std::fs::create_dir(&markers).unwrap();
    let udf = script(dir.path(), "stateful.py", STATEFUL);
    let rows = 50_000u64;
    let dataset = job(
        rows,
        &format!(
            "command = \"python3\", args = [{:?}, {:?}], output = [\"id int64\", \"y int64\"], batch_size = 2000, concurrency = [1, 2]",
            udf.to_str().unwrap(),
            markers.to_str().unwrap()
        ),
    );
    let output = run(&client, &dataset, 0).await;
    let batches = output.to_arrow().await.unwrap();
    let ids = int_column(&batches, "id");
    assert_eq!(ids, (0..rows as i64).collect::<Vec<_>>());
    let expected: Vec<i64> = (0..rows as i64).map(|id| id * 3 + 7).collect();
    assert_eq!(int_column(&batches, "y"), expected);

    // Every process that served batches ran its init exactly once, and served many batches.
    let mut inits = BTreeSet::new();
    let mut served = BTreeSet::new();
    let mut batch_calls = 0;
    for entry in std::fs::read_dir(&markers).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if let Some(pid) = name.strip_prefix("init-") {
            assert_eq!(lines(&path), 1, "init ran more than once in process {pid}");
            inits.insert(pid.to_owned());
        } else if let Some(pid) = name.strip_prefix("batches-") {
            batch_calls += lines(&path);
            served.insert(pid.to_owned());
        }
    }
    assert!(served.is_subset(&inits), "{served:?} vs {inits:?}");
    // batch_size 2000 over 50,000 rows: at least 25 calls, by at most 2 processes per node.
    assert!(batch_calls >= 25, "{batch_calls} calls");
    assert!(
        inits.len() <= 4,
        "{} processes for 2 nodes × max 2",
        inits.len()
    );
    assert!(
        batch_calls > inits.len() * 4,
        "{batch_calls} calls, {inits:?}"
    );
}

const FAILURES: &str = r#"
mode = sys.argv[1]

if mode == "garbage":
    # Not a floe_udf process: answers the connection with text instead of a greeting.
    import socket
    open(os.path.join(sys.argv[2], "garbage-%d" % os.getpid()), "w").close()
    connection, _ = socket.socket(fileno=3).accept()
    connection.sendall(b"Welcome to my server, friend!")
    time.sleep(60)

@floe_udf.init
def start():
    with open(os.path.join(sys.argv[2], "init-%d" % os.getpid()), "w") as f:
        f.write("init\n")

@floe_udf.batch
def fail(batch):
    if mode == "raise":
        raise ValueError("bad row in batch of %d" % batch.num_rows)
    if mode == "crash":
        print("about to crash", file=sys.stderr, flush=True)
        os._exit(3)
    if mode == "schema":
        return pa.RecordBatch.from_arrays([batch.column(0)], names=["renamed"])
    if mode == "hang":
        print("hanging now", file=sys.stderr, flush=True)
        time.sleep(3600)
    return batch
"#;

fn pid_in(message: &str) -> u32 {
    let start = message.find("(pid ").unwrap() + 5;
    let end = start + message[start..].find(')').unwrap();
    message[start..end].parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udf_failures_come_back_with_the_stderr_tail_and_the_cluster_keeps_working() {
    let cluster = LocalCluster::start(options(1)).await.unwrap();
    let client = cluster.connect().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let udf = script(dir.path(), "failures.py", FAILURES);
    let markers = |mode: &str| {
        let markers = dir.path().join(format!("markers-{mode}"));
        std::fs::create_dir_all(&markers).unwrap();
        markers
    };
    let step = |mode: &str, extra: &str| {
        job(
            100,
            &format!(
                "command = \"python3\", args = [{:?}, {mode:?}, {:?}]{extra}",
                udf.to_str().unwrap(),
                markers(mode).to_str().unwrap()
            ),
        )
    };

    let raised = failure(&client, &step("raise", ""), 0).await;
    assert!(raised.contains("the UDF raised an error"), "{raised}");
    assert!(
        raised.contains("ValueError: bad row in batch of 100"),
        "{raised}"
    );
    assert!(raised.contains("Traceback"), "{raised}");

    // A crash is retried per the job's policy: every attempt starts a new process.
    let crashed = failure(&client, &step("crash", ""), 2).await;
    assert!(crashed.contains("exited (exit code 3)"), "{crashed}");
    assert!(crashed.contains("about to crash"), "{crashed}");
    let attempts = std::fs::read_dir(markers("crash")).unwrap().count();
    assert_eq!(attempts, 3, "one process per attempt: {crashed}");

    // Not speaking the protocol is permanent: no retry, whatever the job allows.
    let garbage = failure(&client, &step("garbage", ""), 2).await;
    assert!(
        garbage.contains("did not greet with floe_udf/1"),
        "{garbage}"
    );
    assert_eq!(std::fs::read_dir(markers("garbage")).unwrap().count(), 1);

    let wrong = failure(&client, &step("schema", ""), 0).await;
    assert!(
        wrong.contains("returned renamed Int64") && wrong.contains("output schema is id Int64"),
        "{wrong}"
    );

    let hung = failure(&client, &step("hang", ", timeout_s = 2"), 0).await;
    assert!(
        hung.contains("did not answer a batch within 2000 ms"),
        "{hung}"
    );
    assert!(hung.contains("hanging now"), "{hung}");
    let pid = pid_in(&hung);
    let gone = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        !Path::new(&format!("/proc/{pid}")).exists()
    });
    assert!(gone, "the hung process {pid} is still there");

    let refused = failure(
        &client,
        &job(10, "command = \"sh\", args = [\"-c\", \"true\"]"),
        0,
    )
    .await;
    assert!(refused.contains("node.udf_commands (python3)"), "{refused}");

    // The cluster is healthy: the same script in pass-through mode succeeds.
    let output = run(&client, &step("pass", ""), 0).await;
    assert_eq!(output.rows(), 100);
}

const VERSIONED: &str = r#"
@floe_udf.batch
def add(batch):
    ids = batch.column("id")
    return pa.RecordBatch.from_arrays([ids, pc.add(ids, OFFSET)], names=["id", "v"])
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn editing_the_script_invalidates_the_cache_and_touching_it_does_not() {
    let cluster = LocalCluster::start(options(1)).await.unwrap();
    let client = cluster.connect().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let write = |offset: i64| {
        script(
            dir.path(),
            "versioned.py",
            &format!("OFFSET = {offset}\n{VERSIONED}"),
        )
    };
    let udf = write(1);
    let dataset = || {
        job(
            1000,
            &format!(
                "command = \"python3\", args = [{:?}], output = [\"id int64\", \"v int64\"]",
                udf.to_str().unwrap()
            ),
        )
    };
    let values = |batches: &[RecordBatch]| int_column(batches, "v");

    let first = run(&client, &dataset(), 0).await;
    assert!(first.stats.compute_tasks() > 0);
    assert_eq!(
        values(&first.to_arrow().await.unwrap()),
        (1..1001).collect::<Vec<_>>()
    );

    let again = run(&client, &dataset(), 0).await;
    assert_eq!(again.stats.compute_tasks(), 0, "{:?}", again.stats);

    // Touching the script (same bytes, new modification time) keeps the cache.
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(&udf, std::fs::read(&udf).unwrap()).unwrap();
    let touched = run(&client, &dataset(), 0).await;
    assert_eq!(touched.stats.compute_tasks(), 0, "{:?}", touched.stats);

    write(100);
    let edited = run(&client, &dataset(), 0).await;
    assert!(edited.stats.compute_tasks() > 0, "{:?}", edited.stats);
    assert_eq!(
        values(&edited.to_arrow().await.unwrap()),
        (100..1100).collect::<Vec<_>>()
    );
}

/// A pool's warm child keeps its state between jobs: idle past the 10 s after which children
/// beyond the pool's minimum are stopped, the one the minimum keeps serves the next job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_child_keeps_its_state_between_jobs() {
    let cluster = LocalCluster::start(options(1)).await.unwrap();
    let client = cluster.connect().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let markers = dir.path().join("markers");
    std::fs::create_dir(&markers).unwrap();
    let udf = script(dir.path(), "stateful.py", STATEFUL);
    let dataset = job(
        5_000,
        &format!(
            "command = \"python3\", args = [{:?}, {:?}], output = [\"id int64\", \"y int64\"], concurrency = [1, 1]",
            udf.to_str().unwrap(),
            markers.to_str().unwrap()
        ),
    );
    let no_cache = JobOptions {
        cache: floe_client::CacheMode::NoCache,
        max_task_retries: 0,
        ..JobOptions::default()
    };
    let mut totals = Vec::new();
    for pause in [Duration::ZERO, Duration::from_secs(12)] {
        tokio::time::sleep(pause).await;
        let output = client
            .submit_with(&dataset, no_cache.clone())
            .await
            .unwrap()
            .wait()
            .await
            .unwrap();
        totals.push(
            int_column(&output.to_arrow().await.unwrap(), "y")
                .iter()
                .sum::<i64>(),
        );
    }
    let expected: i64 = (0..5_000i64).map(|id| id * 3 + 7).sum();
    assert_eq!(totals, [expected, expected]);
    let inits: Vec<String> = std::fs::read_dir(&markers)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("init-"))
        .collect();
    assert_eq!(inits.len(), 1, "one process served both jobs: {inits:?}");
}

/// The REST API takes the same job spec: a process UDF submitted over HTTP runs on the nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rest_api_accepts_process_udfs() {
    let cluster = LocalCluster::start(options(1)).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let markers = dir.path().join("markers");
    std::fs::create_dir(&markers).unwrap();
    let udf = script(dir.path(), "stateful.py", STATEFUL);
    let spec = format!(
        "[source]\nrange = 3000\n[[steps]]\nmap_batches = {{ command = \"python3\", args = [{:?}, {:?}], output = [\"id int64\", \"y int64\"] }}\n[[steps]]\ngroupby = []\nagg = [\"sum(y) as total\"]\n",
        udf.to_str().unwrap(),
        markers.to_str().unwrap()
    );
    let submitted = post_job(&cluster, &spec).await;
    assert_eq!(submitted.status, 201, "{}", submitted.body);
    let job = submitted.json()["job_id"].as_str().unwrap().to_owned();
    let client = cluster.connect().await.unwrap();
    let output = client
        .job(job.parse().unwrap())
        .wait()
        .await
        .unwrap()
        .to_arrow()
        .await
        .unwrap();
    let expected: i64 = (0..3000i64).map(|id| id * 3 + 7).sum();
    assert_eq!(int_column(&output, "total"), [expected]);

    // Over the network, the files a UDF pins must be named by absolute paths.
    let relative = spec.replace("output = [", "files = [\"stateful.py\"], output = [");
    let refused = post_job(&cluster, &relative).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(refused.body.contains("absolute"), "{}", refused.body);
}

/// A UDF's memory hint is reserved on the node for each task and given back after it; a hint
/// no node can hold fails the job after a short grace, naming the largest heap there is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_hints_are_given_back_and_an_impossible_one_fails_with_the_reason() {
    let cluster = LocalCluster::start(options(1)).await.unwrap();
    let client = cluster.connect().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let udf = script(dir.path(), "failures.py", FAILURES);
    let markers = dir.path().join("markers");
    std::fs::create_dir(&markers).unwrap();
    // Memory is a performance setting, not hashed: distinct row counts keep the second job
    // from being served by the first one's cache.
    let step = |rows: u64, memory: &str| {
        job(
            rows,
            &format!(
                "command = \"python3\", args = [{:?}, \"pass\", {:?}], memory = {memory:?}, batch_size = 1000",
                udf.to_str().unwrap(),
                markers.to_str().unwrap()
            ),
        )
    };
    let output = run(&client, &step(20_000, "1GiB"), 0).await;
    assert_eq!(output.rows(), 20_000);
    let addr = floe_testkit::http::http_addr(&cluster);
    let token = cluster.token().to_owned();
    let reserved = tokio::task::spawn_blocking(move || {
        floe_testkit::http::wait_for(
            "the reservations to be given back",
            Duration::from_secs(10),
            || {
                let nodes = floe_testkit::http::get(&addr, "/api/nodes", &token).json();
                let usage = &nodes["nodes"][0]["usage"];
                (usage["heap_reserved_bytes"] == 0 && usage["cpu_reserved"] == 0.0).then_some(())
            },
        )
    });
    reserved.await.unwrap();

    // Asked again for about 10 s (a node big enough may be restarting), then the job fails
    // with the placement's reason, not after every task retry.
    let started = std::time::Instant::now();
    let error = failure(&client, &step(20_001, "1TiB"), 3).await;
    assert!(error.contains("fits no alive node"), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "it kept waiting: {:?}",
        started.elapsed()
    );
}

const PRINT_ENV: &str = r#"
@floe_udf.batch
def environment(batch):
    text = "\n".join("%s=%s" % item for item in sorted(os.environ.items()))
    return pa.RecordBatch.from_arrays(
        [batch.column("id"), pa.array([text] * batch.num_rows, pa.utf8())], names=["id", "env"])
"#;

/// A child sees only `PATH`, `PYTHONPATH`, its socket and what the UDF declares: never the
/// node's token. Its code is a pinned script under `node.udf_roots`; inline code is refused
/// by the REST API, by `floe submit` and by the nodes, and a script elsewhere by the nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_udf_gets_a_clean_environment_and_runs_only_scripts_under_the_roots() {
    let roots = tempfile::tempdir().unwrap();
    // The interpreter itself, not a wrapper on PATH (pyenv's shim is a shell script that
    // sets variables of its own).
    let found = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .unwrap();
    let python = String::from_utf8(found.stdout).unwrap().trim().to_owned();
    let mut options = options_with_roots(1, roots.path());
    options
        .node_settings
        .push(format!("node.udf_commands=python3,{python}"));
    let cluster = LocalCluster::start(options).await.unwrap();
    let client = cluster.connect().await.unwrap();
    let token = cluster.token().to_owned();
    assert!(!token.is_empty());

    let printer = script(roots.path(), "print_env.py", PRINT_ENV);
    let udf = format!(
        "command = {python:?}, args = [{:?}], output = [\"id int64\", \"env utf8\"], env = {{ GREETING = \"hello\" }}",
        printer.to_str().unwrap()
    );
    let output = run(&client, &job(3, &udf), 0)
        .await
        .to_arrow()
        .await
        .unwrap();
    let column = output[0]
        .column_by_name("env")
        .unwrap()
        .as_any()
        .downcast_ref::<arrow::array::StringArray>()
        .unwrap()
        .value(0)
        .to_owned();
    assert!(
        !column.contains(&token),
        "the token reached the UDF:\n{column}"
    );
    assert!(column.contains("GREETING=hello"), "{column}");
    let names: BTreeSet<&str> = column
        .lines()
        .map(|line| line.split_once('=').unwrap().0)
        // Python sets LC_CTYPE itself when the locale is C (PEP 538).
        .filter(|name| *name != "LC_CTYPE")
        .collect();
    assert_eq!(
        names,
        BTreeSet::from(["FLOE_UDF_FD", "GREETING", "PATH", "PYTHONPATH"]),
        "{column}"
    );

    // Inline code over REST: refused before the job exists.
    let inline = "command = \"python3\", args = [\"-c\", \"import floe_udf\"]";
    let inline_job = format!("[source]\nrange = 10\n[[steps]]\nmap_batches = {{ {inline} }}\n");
    let refused = post_job(&cluster, &inline_job).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    for expected in [
        "inline code is refused",
        "-c\\\" comes before the script",
        "node.udf_allow_inline",
    ] {
        assert!(refused.body.contains(expected), "{}", refused.body);
    }

    // The same through the CLI.
    let job_file = roots.path().join("inline.toml");
    std::fs::write(&job_file, &inline_job).unwrap();
    let submitted = floe_testkit::process::run_floe_against(
        env!("CARGO_BIN_EXE_floe"),
        &cluster,
        &["submit", job_file.to_str().unwrap()],
    );
    let stderr = String::from_utf8_lossy(&submitted.stderr);
    assert!(!submitted.status.success(), "{stderr}");
    assert!(
        stderr.contains("inline code is refused") && stderr.contains("node.udf_allow_inline"),
        "{stderr}"
    );

    // A client that skips those checks meets the node's: inline code, and a pinned script
    // outside the roots, are refused before any process starts, and not retried.
    let from_client = failure(&client, &job(10, inline), 2).await;
    assert!(
        from_client.contains("inline code is refused"),
        "{from_client}"
    );
    let elsewhere = tempfile::tempdir().unwrap();
    let stray = script(elsewhere.path(), "stray.py", PRINT_ENV);
    let outside = failure(
        &client,
        &job(
            10,
            &format!(
                "command = \"python3\", args = [{:?}]",
                stray.to_str().unwrap()
            ),
        ),
        2,
    )
    .await;
    assert!(outside.contains("is not under node.udf_roots"), "{outside}");

    // Nothing of that stuck: the cluster still runs the script under the roots.
    assert_eq!(run(&client, &job(3, &udf), 0).await.rows(), 3);
}
