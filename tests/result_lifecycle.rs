//! Lifecycle on real processes: a job's result is freed from memory and disk when its client
//! releases it, when `jobs.result_ttl` passes and when the job is deleted (CLI and REST), and
//! reading it afterwards names the reason; finished jobs past `jobs.keep_finished` leave the
//! replicated state for the history that `floe jobs --all` lists; a dead node is forgotten
//! after `nodes.forget_dead_after`; a driver's node lets the job's task table go once the job
//! left the state; a node frees what was made for a job on `FreeJob`, as a later attempt asks
//! when an earlier one's driver died.

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::AsArray;
use arrow::datatypes::Int64Type;
use arrow::record_batch::RecordBatch;

use floe_api::node_protocol::{NodeRequest, NodeResponse, TaskKind, TaskSpec, TaskTable, TestTask};
use floe_client::{
    Client, ClusterExecutor, Dataset, Error, JobHandle, JobOutput, WriteOptions, col, lit,
};
use floe_core::config::ByteSize;
use floe_core::job::{CacheMode, JobOptions};
use floe_core::plan::Operator;
use floe_core::{JobId, TaskId};
use floe_testkit::cluster::{TestCluster, TestClusterConfig, fast_timing};
use floe_testkit::process::floe_command;

/// Long enough for a test to fetch and release a result before it expires on a busy machine.
const RESULT_TTL_S: u64 = 6;

/// One scheduler and `nodes` nodes whose small store spills most of a result to disk.
async fn start(nodes: usize, settings: &[&str]) -> TestCluster {
    start_with(nodes, settings, &[]).await
}

/// [`start`], with more settings for the nodes.
async fn start_with(nodes: usize, settings: &[&str], node_settings: &[&str]) -> TestCluster {
    let mut config = TestClusterConfig {
        settings: fast_timing(),
        node_settings: vec![
            "data.min_block_size=64KiB".into(),
            "data.max_block_size=4MiB".into(),
            // A 77 MiB store, with room besides it for the debug build's processes, which the
            // memory monitor counts against the node's memory.
            "memory.total=1GiB".into(),
            "memory.object_store_fraction=0.075".into(),
            "memory.spill_threshold=0.1".into(),
        ],
        max_frame: Some(ByteSize::mib(128)),
        ..TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"))
    };
    config
        .settings
        .extend(settings.iter().map(|setting| (*setting).to_owned()));
    config
        .node_settings
        .extend(node_settings.iter().map(|setting| (*setting).to_owned()));
    TestCluster::start(config, nodes).await
}

fn no_cache() -> JobOptions {
    JobOptions {
        cache: CacheMode::NoCache,
        ..JobOptions::default()
    }
}

/// About 24 MB of output: several blocks, most of them spilled by the small store.
fn big_result() -> Dataset {
    Dataset::range(3_000_000)
        .unwrap()
        .with_column("twice", col("id") * lit(2i64))
        .unwrap()
}

/// What node 0 holds: store bytes in memory, spilled and in fallback files, and the files in
/// its spill and fallback directories.
async fn held(cluster: &TestCluster) -> (u64, u64, u64, usize) {
    let store = cluster.node_status(0).await.store;
    let node_dir = cluster.dir.path().join("node-0");
    let files = ["spill", "fallback"]
        .iter()
        .map(|dir| files_in(&node_dir.join(dir)))
        .sum();
    (store.used, store.spilled_bytes, store.fallback_bytes, files)
}

fn files_in(dir: &PathBuf) -> usize {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .filter_map(Result::ok)
            .filter(|entry| entry.path().is_file())
            .count()
    })
}

/// Waits until node 0 holds nothing: no object bytes and no spill or fallback file.
async fn wait_until_freed(cluster: &TestCluster, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(RESULT_TTL_S * 4);
    loop {
        let now = held(cluster).await;
        if now == (0, 0, 0, 0) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: node 0 still holds {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs the job and checks its result is really held: spilled, on disk. The output is kept
/// (dropping it does not release it).
async fn run_held(client: &Client, cluster: &TestCluster) -> (JobHandle, JobOutput) {
    let job = client.submit_with(&big_result(), no_cache()).await.unwrap();
    let output = job.wait().await.unwrap();
    assert_eq!(output.rows(), 3_000_000);
    output.keep();
    let (used, spilled, _, files) = held(cluster).await;
    assert!(
        used > 0 && spilled > 0 && files > 0,
        "{:?}",
        held(cluster).await
    );
    (job, output)
}

fn released_reason<T>(result: Result<T, Error>) -> String {
    match result {
        Err(error @ Error::ResultReleased { .. }) => error.to_string(),
        Err(other) => panic!("expected a released result, got {other}"),
        Ok(_) => panic!("the result is still there"),
    }
}

fn floe(cluster: &TestCluster, args: &[&str]) -> String {
    let output = floe_command(env!("CARGO_BIN_EXE_floe"))
        .args(args)
        .arg("--scheduler")
        .arg(cluster.schedulers.addrs().join(","))
        .env("FLOE_CLIENT_TOKEN", cluster.config.token())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "floe {args:?} failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_is_freed_when_released_expired_or_deleted_and_says_why() {
    let ttl = format!("jobs.result_ttl={RESULT_TTL_S}s");
    let cluster = start(1, &[&ttl]).await;
    let client = cluster.connect().await;
    assert_eq!(held(&cluster).await, (0, 0, 0, 0));

    // Fetched, then released by dropping the output: the common path.
    let job = client.submit_with(&big_result(), no_cache()).await.unwrap();
    let output = job.wait().await.unwrap();
    let rows: usize = output
        .to_arrow()
        .await
        .unwrap()
        .iter()
        .map(|batch| batch.num_rows())
        .sum();
    assert_eq!(rows, 3_000_000);
    drop(output);
    wait_until_freed(&cluster, "after the client dropped the output").await;
    let reason = released_reason(job.wait().await);
    assert!(reason.contains("released by the client at"), "{reason}");

    // Kept by the client and never released: gone after the TTL.
    let (job, output) = run_held(&client, &cluster).await;
    wait_until_freed(&cluster, "after jobs.result_ttl").await;
    let reason = released_reason(job.wait().await);
    assert!(
        reason.contains(&format!(
            "{RESULT_TTL_S}s after the job ended (jobs.result_ttl)"
        )),
        "{reason}"
    );
    let reason = released_reason(output.to_arrow().await);
    assert!(reason.contains("expired at"), "{reason}");

    // Deleted with the CLI: the job leaves the list, the history keeps it.
    let (job, output) = run_held(&client, &cluster).await;
    let id = job.id().to_string();
    let said = floe(&cluster, &["job", "delete", &id]);
    assert!(said.contains("deleted"), "{said}");
    wait_until_freed(&cluster, "after floe job delete").await;
    let reason = released_reason(output.to_arrow().await);
    assert!(reason.contains("the job was deleted"), "{reason}");
    assert!(matches!(job.wait().await, Err(Error::UnknownJob(_))));
    let live = client.jobs().await.unwrap();
    assert!(live.iter().all(|info| info.id != job.id()), "{live:?}");
    let listed = floe(&cluster, &["jobs", "--all"]);
    assert!(
        listed
            .lines()
            .any(|line| line.starts_with(&format!("{id} ")) && line.ends_with("(deleted)")),
        "{listed}"
    );

    // Deleted over REST, the same way.
    let (job, _output) = run_held(&client, &cluster).await;
    let http = cluster.schedulers.http_addr(1).unwrap().to_owned();
    let path = format!("/api/jobs/{}", job.id());
    let bearer = format!("Bearer {}", cluster.config.token());
    let response =
        floe_testkit::http::request("DELETE", &http, &path, &[("Authorization", &bearer)], b"");
    assert_eq!(response.status, 200, "{}", response.body);
    assert_eq!(response.json()["deleted"], true);
    wait_until_freed(&cluster, "after DELETE /api/jobs/ID").await;
    let again =
        floe_testkit::http::request("DELETE", &http, &path, &[("Authorization", &bearer)], b"");
    assert_eq!(again.status, 404, "{}", again.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_jobs_past_keep_finished_move_to_the_history_and_dead_nodes_are_forgotten() {
    let cluster = start(2, &["jobs.keep_finished=5", "nodes.forget_dead_after=2s"]).await;
    let client = cluster.connect().await;
    let mut jobs: Vec<JobId> = Vec::new();
    for n in 1..=9u64 {
        let job = client
            .submit_with(&Dataset::range(n * 10).unwrap(), no_cache())
            .await
            .unwrap();
        job.wait().await.unwrap().release().await.unwrap();
        jobs.push(job.id());
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let state = loop {
        let state = cluster.state().await;
        if state.jobs.len() == 5 {
            break state;
        }
        assert!(
            Instant::now() < deadline,
            "{} jobs still in the state",
            state.jobs.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        state.jobs.keys().copied().collect::<Vec<_>>(),
        jobs[4..],
        "the newest five stay"
    );
    assert_eq!(state.submissions.len(), 5);
    // The newest five from the state, the four oldest from the history: nine, newest first.
    let listed = floe(&cluster, &["jobs", "--all"]);
    let ids: Vec<String> = listed
        .lines()
        .skip(1)
        .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
        .collect();
    let expected: Vec<String> = jobs.iter().rev().map(ToString::to_string).collect();
    assert_eq!(ids, expected, "{listed}");
    assert_eq!(listed.matches("(history)").count(), 4, "{listed}");
    let http = cluster.schedulers.http_addr(1).unwrap().to_owned();
    let token = cluster.config.token().to_owned();
    // The HTTP API answers from the replica's applied state, published every 250 ms: wait
    // until it shows the prune the CLI already saw, not only the nine jobs.
    let all =
        floe_testkit::http::wait_for("all nine jobs over REST", Duration::from_secs(10), || {
            let all = floe_testkit::http::get(&http, "/api/jobs?all=true", &token).json();
            (all["total"] == 9 && all["jobs"][8]["removed"] != serde_json::Value::Null)
                .then_some(all)
        });
    assert_eq!(all["jobs"][8]["removed"], "pruned", "{all}");

    // A dead node leaves the state once it has been dead for nodes.forget_dead_after.
    let mut cluster = cluster;
    let dead = cluster.node_status(1).await.node.unwrap();
    cluster.kill_node(1);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen_dead = false;
    loop {
        let state = cluster.state().await;
        match state.nodes.get(&dead) {
            Some(node) if !node.is_alive() => seen_dead = true,
            Some(_) => {}
            None => break,
        }
        assert!(Instant::now() < deadline, "node {dead} is still remembered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        seen_dead,
        "node {dead} was forgotten before it was seen dead"
    );
    assert_eq!(cluster.state().await.nodes.len(), 1);
}

/// The task table the node keeps for `job`'s driver, if any.
async fn task_table(cluster: &TestCluster, job: JobId) -> Option<TaskTable> {
    let addr = cluster.node(0).addr().to_owned();
    match floe_testkit::node::call(&addr, &cluster.wire(), &NodeRequest::JobTasks { job }).await {
        NodeResponse::Tasks(table) => table,
        other => panic!("unexpected {other:?}"),
    }
}

/// Waits (up to two of the node's 10-second sweeps and then some) until `job`'s table is gone.
async fn wait_until_table_gone(cluster: &TestCluster, job: JobId, why: &str) {
    let deadline = Instant::now() + Duration::from_secs(40);
    while task_table(cluster, job).await.is_some() {
        assert!(
            Instant::now() < deadline,
            "job {job}'s task table is still on its driver's node after {why}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drivers_task_table_is_freed_when_its_job_is_pruned_or_deleted() {
    let cluster = start(1, &["jobs.keep_finished=2"]).await;
    let client = cluster.connect().await;
    let mut jobs = Vec::new();
    for n in 1..=3u64 {
        let job = client
            .submit_with(&Dataset::range(n * 1000).unwrap(), no_cache())
            .await
            .unwrap();
        let output = job.wait().await.unwrap();
        assert_eq!(output.rows(), n * 1000);
        output.release().await.unwrap();
        jobs.push(job);
    }
    // The newest two stay in the state, and so do their tables, with every row they made.
    for (n, job) in jobs.iter().enumerate().skip(1) {
        let table = task_table(&cluster, job.id())
            .await
            .unwrap_or_else(|| panic!("job {} has no table", job.id()));
        let rows: u64 = table.tasks.iter().map(|task| task.rows).sum();
        assert_eq!(rows, (n as u64 + 1) * 1000);
    }
    // The oldest was pruned: the node lets its table go.
    wait_until_table_gone(&cluster, jobs[0].id(), "its job was pruned").await;
    assert!(!cluster.state().await.jobs.contains_key(&jobs[0].id()));
    jobs[2].delete().await.unwrap();
    wait_until_table_gone(&cluster, jobs[2].id(), "its job was deleted").await;
    assert!(
        task_table(&cluster, jobs[1].id()).await.is_some(),
        "a job still in the state keeps its table"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_frees_what_was_made_for_a_job_and_keeps_the_rest() {
    let cluster = start(1, &[]).await;
    let addr = cluster.node(0).addr().to_owned();
    let wire = cluster.wire();
    let mut made = Vec::new();
    for (task, job) in [(1u128, 1u64), (2, 1), (3, 2)] {
        let spec = TaskSpec {
            task: TaskId::new(task),
            job: JobId::new(job),
            kind: TaskKind::Test(TestTask::Fill {
                bytes: 1 << 20,
                seed: 1,
            }),
            inputs: Vec::new(),
        };
        match floe_testkit::node::call(&addr, &wire, &NodeRequest::RunTask(spec)).await {
            NodeResponse::Task {
                result: Ok(done), ..
            } => made.push(done.outputs[0].object),
            other => panic!("unexpected {other:?}"),
        }
    }
    let objects = || async {
        let store = cluster.node_status(0).await.store;
        store.objects_in_memory + store.spilled_objects + store.fallback_objects
    };
    assert_eq!(objects().await, 3);
    let free = |job: u64, keep: Vec<floe_core::ObjectId>| NodeRequest::FreeJob {
        job: JobId::new(job),
        keep,
    };
    // Job 1's second object is kept (a later attempt's own output); its first goes.
    let answer = floe_testkit::node::call(&addr, &wire, &free(1, vec![made[1]])).await;
    assert_eq!(answer, NodeResponse::Freed);
    assert_eq!(objects().await, 2);
    let meta = floe_testkit::node::connect(&addr, &wire)
        .await
        .call(&NodeRequest::ObjectMeta { object: made[0] })
        .await;
    assert!(meta.is_err(), "job 1's first object is still there");
    floe_testkit::node::call(&addr, &wire, &free(2, Vec::new())).await;
    assert_eq!(objects().await, 1);
}

/// Made by reading a file, so that no plan carries it: only the rows do.
const NEEDLE: &str = "floe-materialized-needle-5e0c";

/// The names of the files under `dir` (recursively).
fn files_named(dir: &std::path::Path) -> Vec<String> {
    let mut names = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().filter_map(Result::ok) {
            if entry.path().is_dir() {
                pending.push(entry.path());
            } else {
                names.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
    }
    names
}

/// Files under `dir` (recursively) whose bytes contain `needle`.
fn files_containing(dir: &std::path::Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().filter_map(Result::ok) {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if let Ok(bytes) = std::fs::read(&path)
                && bytes.windows(needle.len()).any(|window| window == needle)
            {
                found.push(path);
            }
        }
    }
    found
}

#[test]
fn materialize_keeps_its_rows_in_the_object_store_owned_by_the_dataset() {
    let runtime = floe_testkit::cluster::runtime();
    // Snapshots every few entries, so the check below covers snapshots as well as the log.
    let cluster = runtime.block_on(start(1, &["scheduler.snapshot_entries=3"]));
    let executor = Arc::new(
        ClusterExecutor::connect(&cluster.schedulers.addrs(), cluster.config.token())
            .unwrap()
            .with_options(no_cache()),
    );
    let input = tempfile::tempdir().unwrap();
    let csv = input.path().join("input.csv");
    let rows = 200_000u64;
    let mut text = String::from("id,tag\n");
    for id in 0..rows {
        let tag = if id % 3 == 0 { NEEDLE } else { "plain" };
        text.push_str(&format!("{id},{tag}\n"));
    }
    std::fs::write(&csv, text).unwrap();
    let dataset = Dataset::read_csv(&[&csv])
        .unwrap()
        .with_executor(executor.clone());
    let materialized = dataset.materialize().unwrap();
    let Operator::Materialized(source) = materialized.plan().operator() else {
        panic!("not a materialized source: {materialized:?}");
    };
    let owner = source.job;
    assert_eq!(source.rows(), rows);
    // The materializing job's output fingerprint, not the rows'.
    assert_eq!(materialized.fingerprint(), dataset.fingerprint());

    // Two jobs read it from its holder; their results are exact.
    let sevens = materialized
        .filter((col("id") % lit(7i64)).eq(lit(0i64)))
        .unwrap();
    assert_eq!(sevens.count().unwrap(), rows.div_ceil(7));
    let batches: Vec<RecordBatch> = materialized
        .iter_batches()
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let mut seen = 0u64;
    for batch in &batches {
        let ids = batch.column(0).as_primitive::<Int64Type>();
        let tags = batch.column(1).as_string::<i32>();
        for row in 0..batch.num_rows() {
            let id = u64::try_from(ids.value(row)).unwrap();
            assert_eq!(id, seen, "rows out of order");
            let expected = if id % 3 == 0 { NEEDLE } else { "plain" };
            assert_eq!(tags.value(row), expected);
            seen += 1;
        }
    }
    assert_eq!(seen, rows);

    // The rows are in the node's store, and in no file of the replica: not in its log, not
    // in its snapshots.
    let (used, spilled, _, _) = runtime.block_on(held(&cluster));
    assert!(used + spilled > 0, "the materialized rows are not held");
    let replica = cluster.dir.path().join("replica-1");
    let names = files_named(&replica);
    assert!(
        names.iter().any(|name| name == "wal") && names.iter().any(|name| name == "snapshot"),
        "no log and snapshot in {}: {names:?}",
        replica.display()
    );
    let leaked = files_containing(&replica, NEEDLE.as_bytes());
    assert!(leaked.is_empty(), "the rows reached {leaked:?}");

    // Dropping the last dataset that reads it releases the output: freed on the node.
    drop(sevens);
    drop(materialized);
    runtime.block_on(wait_until_freed(
        &cluster,
        "after the materialized dataset was dropped",
    ));
    let client = runtime.block_on(cluster.connect());
    let reason = released_reason(runtime.block_on(client.job(owner).wait()));
    assert!(reason.contains("released by the client"), "{reason}");

    // A result let go while a dataset still reads it: jobs on it say so.
    let again = dataset.materialize().unwrap();
    let Operator::Materialized(source) = again.plan().operator() else {
        panic!("not a materialized source: {again:?}");
    };
    runtime
        .block_on(client.job(source.job).release_output())
        .unwrap();
    let reason = released_reason(again.count());
    assert!(reason.contains("released by the client"), "{reason}");

    // The old way, rows inline in the plan, does put them in the replica's files: the check
    // above can see them.
    let inline = Dataset::from_batches(dataset.schema(), &batches[..1]).unwrap();
    runtime.block_on(async {
        let job = client.submit_with(&inline, no_cache()).await.unwrap();
        job.wait().await.unwrap().release().await.unwrap();
    });
    let leaked = files_containing(&replica, NEEDLE.as_bytes());
    assert!(
        !leaked.is_empty(),
        "inline rows not found in the replica's files"
    );
    drop(again);
    drop(executor);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_and_cache_served_results_hold_no_store_memory() {
    let cluster = start(1, &[]).await;
    let client = cluster.connect().await;
    assert_eq!(held(&cluster).await, (0, 0, 0, 0));

    // A sink job's result is its files: nothing stays in the store, released or not.
    let out = tempfile::tempdir().unwrap();
    let sink = big_result()
        .write_parquet(out.path().join("written"), WriteOptions::default())
        .unwrap();
    let job = client.submit(&sink).await.unwrap();
    let output = job.wait().await.unwrap();
    output.keep();
    wait_until_freed(&cluster, "after a sink job ended").await;
    let written = files_in(&out.path().join("written"));
    assert!(written > 0, "the sink wrote no file");

    // Computed once (its result cached, then released)…
    let first = client.submit(&big_result()).await.unwrap();
    first.wait().await.unwrap().release().await.unwrap();
    wait_until_freed(&cluster, "after the computed result was released").await;
    // …then served from the cache: its blocks are the shard files, mapped in place, so the
    // held result takes no byte of the store's memory, before the fetch or after it.
    let again = client.submit(&big_result()).await.unwrap();
    let output = again.wait().await.unwrap();
    output.keep();
    let stats = &output.stats.operators;
    assert!(
        stats.iter().all(|op| op.tasks == 0) && stats.iter().any(|op| op.cache_hits > 0),
        "not served from the cache: {stats:?}"
    );
    let blocks = output.blocks.len() as u64;
    assert_eq!(served_in_place(&cluster).await, (0, 0, 0, blocks));
    let mut rows = 0u64;
    let mut sum = 0i64;
    for batch in output.to_arrow().await.unwrap() {
        let twice = batch.column(1).as_primitive::<Int64Type>();
        sum += twice.values().iter().sum::<i64>();
        rows += batch.num_rows() as u64;
    }
    assert_eq!(rows, 3_000_000);
    assert_eq!(sum, 2 * (0..3_000_000i64).sum::<i64>());
    assert_eq!(served_in_place(&cluster).await, (0, 0, 0, blocks));
    // Kept, so released through the handle: the blocks' mappings and links go with it.
    again.release_output().await.unwrap();
    let reason = released_reason(again.wait().await);
    assert!(reason.contains("released by the client"), "{reason}");
    wait_until_freed(&cluster, "after the cache-served result was released").await;
}

/// Node 0's store memory in use, spilled and in fallback objects, and its objects that are
/// cache shards served in place (each a link in the fallback directory).
async fn served_in_place(cluster: &TestCluster) -> (u64, u64, u64, u64) {
    let store = cluster.node_status(0).await.store;
    let (_, _, _, files) = held(cluster).await;
    assert_eq!(
        files as u64, store.shard_objects,
        "the node's files are not its served shards' links"
    );
    (
        store.used,
        store.spilled_bytes,
        store.fallback_bytes,
        store.shard_objects,
    )
}

/// `range(n)` with `id * factor`: cached outputs of a few MB, one per factor.
fn scaled(n: u64, factor: i64) -> Dataset {
    Dataset::range(n)
        .unwrap()
        .with_column("scaled", col("id") * lit(factor))
        .unwrap()
}

/// Shards the replicated index lists, and shard files in node 0's cache directory.
async fn indexed_and_on_disk(cluster: &TestCluster) -> (usize, usize) {
    let indexed = cluster.indexed_shards().await;
    let on_disk = std::fs::read_dir(cluster.dir.path().join("node-0").join("cache"))
        .unwrap()
        .filter_map(Result::ok)
        .filter(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            name.starts_with("cache-") && name.ends_with(".arrow")
        })
        .count();
    (indexed, on_disk)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_eviction_updates_the_index_before_it_removes_files() {
    // Room for about one of the outputs below, not two.
    let cluster = start_with(1, &[], &["cache.max_bytes=5MiB"]).await;
    let client = cluster.connect().await;
    let rows = 200_000u64;
    let expected = |factor: i64| factor * (0..rows as i64).sum::<i64>();
    let sum = |batches: Vec<RecordBatch>| -> i64 {
        batches
            .iter()
            .map(|batch| {
                let scaled = batch.column(1).as_primitive::<Int64Type>();
                scaled.values().iter().sum::<i64>()
            })
            .sum()
    };
    for factor in 2..=5 {
        let job = client.submit(&scaled(rows, factor)).await.unwrap();
        let output = job.wait().await.unwrap();
        assert_eq!(sum(output.to_arrow().await.unwrap()), expected(factor));
        output.release().await.unwrap();
        // Every shard the index lists is on disk: none was removed behind its back.
        let (indexed, on_disk) = indexed_and_on_disk(&cluster).await;
        assert_eq!(indexed, on_disk, "after factor {factor}");
        assert!(indexed > 0, "nothing cached after factor {factor}");
    }
    let first = scaled(rows, 2).fingerprint().to_string();
    let state = cluster.state().await;
    assert!(
        !state.cache.contains_key(&first),
        "the first output is still indexed: {:?}",
        state.cache.get(&first)
    );
    // The first output was evicted: run again, it is computed (not planned against missing
    // shards) and exact.
    let job = client.submit(&scaled(rows, 2)).await.unwrap();
    let output = job.wait().await.unwrap();
    assert_eq!(sum(output.to_arrow().await.unwrap()), expected(2));
    assert!(
        output.stats.operators.iter().all(|op| op.cache_hits == 0),
        "{:?}",
        output.stats.operators
    );
}

#[test]
fn a_materialized_result_served_from_the_cache_is_read_from_its_shards() {
    let runtime = floe_testkit::cluster::runtime();
    let cluster = runtime.block_on(start(1, &[]));
    // The default options: the materializing job's output is cached.
    let executor = Arc::new(
        ClusterExecutor::connect(&cluster.schedulers.addrs(), cluster.config.token()).unwrap(),
    );
    let dataset = big_result().with_executor(executor.clone());
    // Computed and cached, then let go.
    drop(dataset.materialize().unwrap());
    runtime.block_on(wait_until_freed(
        &cluster,
        "after the first materialization",
    ));
    // Served from the cache: its blocks are the shard files mapped in place (no store
    // memory), and a job on the node that holds them reads every row from them.
    let materialized = dataset.materialize().unwrap();
    let (used, spilled, fallback, served) = runtime.block_on(served_in_place(&cluster));
    assert_eq!((used, spilled, fallback), (0, 0, 0));
    assert!(served > 0, "no block is served in place");
    let odd = materialized
        .filter((col("id") % lit(2i64)).eq(lit(1i64)))
        .unwrap();
    let mut rows = 0u64;
    let mut sum = 0i64;
    for batch in odd.iter_batches().unwrap() {
        let batch = batch.unwrap();
        rows += batch.num_rows() as u64;
        sum += batch
            .column(1)
            .as_primitive::<Int64Type>()
            .values()
            .iter()
            .sum::<i64>();
    }
    assert_eq!(rows, 1_500_000);
    let odd_ids: i64 = (0..3_000_000i64).filter(|id| id % 2 == 1).sum();
    assert_eq!(sum, 2 * odd_ids);
    assert_eq!(
        runtime.block_on(served_in_place(&cluster)),
        (0, 0, 0, served)
    );
    drop(odd);
    drop(materialized);
    runtime.block_on(wait_until_freed(
        &cluster,
        "after the materialized result was dropped",
    ));
    drop(executor);
}
