//! Jobs end to end on real multi-process clusters: a `floe scheduler` and `floe node`s on
//! loopback, jobs committed through Raft, drivers placed by the leader, tasks in worker
//! processes. Results are checked against independent computations; nodes are really killed.

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use arrow::array::{Array, Float64Array};
use floe_api::state::{JobRecord, JobStatus};
use floe_client::{
    AggFunction, Aggregation, Dataset, JoinType, SortKey, UdfCall, WriteOptions, col, lit, when,
};
use floe_core::config::ByteSize;
use floe_core::job::{CacheMode, JobOptions, JobStats};
use floe_core::{JobId, NodeId, SubmissionId};
use floe_testkit::batches::int_column;
use floe_testkit::cluster::{JOB_TIMEOUT, TestCluster, TestClusterConfig, fast_timing};
use floe_testkit::files::read_parquet_dir;
use floe_testkit::process;

/// Nodes whose object store is as small as a 256 MiB node's (76 MiB), with room besides it
/// for the debug build's processes, which the memory monitor counts against the node's memory.
const SMALL_STORE: [&str; 2] = ["memory.total=1GiB", "memory.object_store_max=76MiB"];

/// A scheduler and `nodes` nodes of two workers, with `node_settings` besides.
async fn start(nodes: usize, node_settings: &[&str]) -> TestCluster {
    let mut config = TestClusterConfig {
        settings: fast_timing(),
        node_settings: vec![
            "data.min_block_size=64KiB".into(),
            "data.max_block_size=8MiB".into(),
        ],
        max_frame: Some(ByteSize::mib(128)),
        ..TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"))
    };
    config
        .node_settings
        .extend(node_settings.iter().map(|s| (*s).to_owned()));
    TestCluster::start(config, nodes).await
}

/// Rows in the job's output, from its blocks' metadata.
fn output_rows(record: &JobRecord) -> u64 {
    record.outputs.iter().map(|block| block.rows).sum()
}

fn operator<'a>(stats: &'a JobStats, name: &str) -> &'a floe_core::job::OperatorStats {
    stats
        .operators
        .iter()
        .find(|operator| floe_core::job::stage_kind(&operator.name) == name)
        .unwrap_or_else(|| panic!("no {name} operator in {stats:?}"))
}

fn write_csv_inputs(dir: &Path) -> Vec<(i64, i64)> {
    std::fs::create_dir_all(dir).unwrap();
    let mut rows = Vec::new();
    for file in 0..4i64 {
        let mut text = String::from("id,value\n");
        for row in 0..2_500i64 {
            let id = file * 10_000 + row;
            let value = (id * 7919) % 1_000;
            text.push_str(&format!("{id},{value}\n"));
            rows.push((id, value));
        }
        std::fs::write(dir.join(format!("part-{file}.csv")), text).unwrap();
    }
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_filter_map_write_pipeline_runs_on_both_nodes_and_matches() {
    let cluster = start(2, &[]).await;
    let input = cluster.dir.path().join("input");
    let rows = write_csv_inputs(&input);
    let output = cluster.dir.path().join("output");
    let dataset = Dataset::read_csv(&[&input])
        .unwrap()
        .filter((col("value") % lit(3i64)).eq(lit(0i64)))
        .unwrap()
        .with_column("doubled", col("value") * lit(2i64))
        .unwrap()
        .write_parquet(&output, WriteOptions::default())
        .unwrap();
    let record = cluster.run(&dataset, JobOptions::default()).await;

    let batches = read_parquet_dir(&output);
    let mut got: Vec<(i64, i64)> = int_column(&batches, "id")
        .into_iter()
        .zip(int_column(&batches, "doubled"))
        .collect();
    got.sort();
    let expected: Vec<(i64, i64)> = rows
        .iter()
        .filter(|(_, value)| value % 3 == 0)
        .map(|(id, value)| (*id, value * 2))
        .collect();
    assert_eq!(got, expected);
    let stats = record.stats.unwrap();
    assert_eq!(
        operator(&stats, "read").tasks,
        4,
        "one read task per file: {stats:?}"
    );
    // The write tasks' rows reach the stats from the worker processes that wrote them.
    assert_eq!(operator(&stats, "write").rows, expected.len() as u64);
    // Uncached, the sink runs in the read tasks: their rows are still the rows written.
    let uncached = JobOptions {
        cache: CacheMode::NoCache,
        ..JobOptions::default()
    };
    let fused_output = cluster.dir.path().join("fused");
    let fused = Dataset::read_csv(&[&input])
        .unwrap()
        .filter((col("value") % lit(3i64)).eq(lit(0i64)))
        .unwrap()
        .write_parquet(&fused_output, WriteOptions::default())
        .unwrap();
    let stats = cluster.run(&fused, uncached).await.stats.unwrap();
    let read = operator(&stats, "read");
    assert!(read.name.ends_with("write"), "{stats:?}");
    assert_eq!(read.rows, expected.len() as u64);
    assert_eq!(
        read_parquet_dir(&fused_output)
            .iter()
            .map(|batch| batch.num_rows())
            .sum::<usize>(),
        expected.len()
    );
    for index in 0..2 {
        assert!(
            cluster.node_status(index).await.tasks_finished > 0,
            "node {index} ran no task"
        );
    }
}

fn cached_pipeline(mean: f64) -> Dataset {
    Dataset::range(40_000)
        .unwrap()
        .with_column("x", col("id") * lit(3i64))
        .unwrap()
        .cache()
        .unwrap()
        .map_batches(
            UdfCall::new("standardize", 1)
                .with("column", "x")
                .with("mean", mean),
        )
        .unwrap()
}

/// Runs the cached pipeline with `mean`, checks its rows and their sum against the formula,
/// and returns the stats.
async fn run_cached_pipeline(cluster: &TestCluster, mean: f64, options: JobOptions) -> JobStats {
    let record = cluster.run(&cached_pipeline(mean), options).await;
    let batches = cluster.outputs(&record).await;
    let mut rows = 0;
    let mut sum = 0.0;
    for batch in &batches {
        let x = batch.column_by_name("x").unwrap();
        let x = x.as_any().downcast_ref::<Float64Array>().unwrap();
        rows += x.len();
        sum += x.values().iter().sum::<f64>();
    }
    let n = 40_000f64;
    assert_eq!((rows, sum), (40_000, 3.0 * n * (n - 1.0) / 2.0 - mean * n));
    record.stats.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_job_runs_no_compute_and_a_changed_argument_reruns_only_downstream() {
    let cluster = start(2, &[]).await;
    let first = run_cached_pipeline(&cluster, 1.0, JobOptions::default()).await;
    assert!(first.compute_tasks() > 0);

    let again = run_cached_pipeline(&cluster, 1.0, JobOptions::default()).await;
    assert_eq!(again.compute_tasks(), 0, "{again:?}");
    assert!(again.cache_hits() > 0);

    let changed = run_cached_pipeline(&cluster, 5.0, JobOptions::default()).await;
    let range = operator(&changed, "range");
    assert_eq!(range.tasks, 0, "the cached upstream reran: {changed:?}");
    assert!(range.cache_hits > 0);
    assert!(operator(&changed, "map").tasks > 0);

    let recompute = JobOptions {
        cache: CacheMode::Recompute,
        ..JobOptions::default()
    };
    let recomputed = run_cached_pipeline(&cluster, 1.0, recompute).await;
    assert_eq!(recomputed.compute_tasks(), first.compute_tasks());
}

/// `range(n)` through a slow map: tasks are running for a while.
fn slow_pipeline(n: u64, delay_ms: i64) -> Dataset {
    Dataset::range(n)
        .unwrap()
        .with_column("double", col("id") * lit(2i64))
        .unwrap()
        .cache()
        .unwrap()
        .map_batches(UdfCall::new("delay", 1).with("ms", delay_ms))
        .unwrap()
}

async fn assert_ids(cluster: &TestCluster, record: &JobRecord, n: i64) {
    let batches = cluster.outputs(record).await;
    let ids = int_column(&batches, "id");
    assert_eq!(
        ids,
        (0..n).collect::<Vec<_>>(),
        "rows lost, repeated or out of order"
    );
    let doubled = int_column(&batches, "double");
    assert!(doubled.iter().zip(&ids).all(|(d, id)| *d == id * 2));
}

/// kill -9 of a node that is not running `job`'s driver; then waits for the job, which must
/// succeed with the same driver and with retries or rebuilds in its stats.
async fn kill_a_worker_node_and_wait(cluster: &mut TestCluster, job: JobId) -> JobRecord {
    let driver = cluster.state().await.jobs[&job].driver.unwrap();
    let driver_index = cluster.index_of(driver).await;
    let victim = (0..cluster.nodes.len())
        .find(|index| *index != driver_index && cluster.nodes[*index].is_some())
        .unwrap();
    cluster.kill_node(victim);
    let record = cluster.wait_for_job(job).await;
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
    let stats = record.stats.clone().unwrap();
    assert_eq!(stats.attempt, 1, "the driver should not have restarted");
    let recovered: u64 = stats
        .operators
        .iter()
        .map(|op| op.retries + op.rebuilt)
        .sum();
    assert!(recovered > 0, "no retry or rebuild in {stats:?}");
    record
}

/// Waits until the job's operators (those named `operator`, or all) finished `tasks` tasks.
async fn wait_for_tasks(cluster: &TestCluster, job: JobId, operator: Option<&str>, tasks: u64) {
    let deadline = Instant::now() + JOB_TIMEOUT;
    loop {
        match cluster.client().job_progress(job).await.unwrap() {
            Some(progress) => {
                let done: u64 = progress
                    .operators
                    .iter()
                    .filter(|op| {
                        operator.is_none_or(|name| floe_core::job::stage_kind(&op.name) == name)
                    })
                    .map(|op| op.tasks_done)
                    .sum();
                if done >= tasks {
                    return;
                }
            }
            // Progress is only kept while the job runs: one that ended first is not waited for.
            None => {
                let status = cluster.state().await.jobs[&job].status.clone();
                assert!(
                    !status.is_finished(),
                    "job {job} ended ({status:?}) before {tasks} tasks were seen done: its slow \
                     stage was too quick for the test"
                );
            }
        }
        assert!(Instant::now() < deadline, "job {job} made no progress");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worker_node_mid_job_gives_the_right_result_with_retries() {
    let mut cluster = start(3, &[]).await;
    let n = 400_000;
    let job = cluster
        .submit(&slow_pipeline(n as u64, 150), JobOptions::default())
        .await;
    // 13 range tasks, then 13 slow map tasks: kill while most maps are still to run.
    wait_for_tasks(&cluster, job, None, 16).await;
    let record = kill_a_worker_node_and_wait(&mut cluster, job).await;
    assert_ids(&cluster, &record, n).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_drivers_node_restarts_the_driver_which_reuses_cached_stages() {
    let mut cluster = start(3, &[]).await;
    let n = 400_000;
    let job = cluster
        .submit(&slow_pipeline(n as u64, 400), JobOptions::default())
        .await;
    // Wait until the range tasks are done (their shards cached) and the slow map is running.
    let range_tasks = 13;
    wait_for_tasks(&cluster, job, None, range_tasks + 1).await;
    let driver = cluster.state().await.jobs[&job].driver.unwrap();
    let victim = cluster.index_of(driver).await;
    cluster.kill_node(victim);

    let record = cluster.wait_for_job(job).await;
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
    assert_eq!(record.attempts, 2);
    let stats = record.stats.clone().unwrap();
    assert_eq!(stats.attempt, 2);
    let range = operator(&stats, "range");
    assert!(range.cache_hits > 0, "nothing was reused: {stats:?}");
    assert_eq!(
        range.tasks + range.cache_hits,
        range_tasks,
        "only the shards lost with the node may be recomputed: {stats:?}"
    );
    assert_ids(&cluster, &record, n).await;
}

/// Bytes a row of [`nine_columns`] takes.
const NINE_COLUMNS_ROW_BYTES: u64 = 72;

/// `range(n)` with eight more Int64 columns, `c{k} = id × k`.
fn nine_columns(n: u64) -> Dataset {
    (1..9i64).fold(Dataset::range(n).unwrap(), |dataset, column| {
        dataset
            .with_column(&format!("c{column}"), col("id") * lit(column))
            .unwrap()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataset_three_times_the_object_stores_spills_and_completes() {
    let cluster = start(2, &SMALL_STORE).await;
    let capacity: u64 =
        cluster.node_status(0).await.store.capacity + cluster.node_status(1).await.store.capacity;
    let n = 3 * capacity / NINE_COLUMNS_ROW_BYTES + 100_000;
    let dataset = nine_columns(n);
    let options = JobOptions {
        cache: CacheMode::NoCache,
        ..JobOptions::default()
    };
    let record = cluster.run(&dataset, options).await;
    let rows = output_rows(&record);
    let bytes: u64 = record.outputs.iter().map(|block| block.bytes).sum();
    assert_eq!(rows, n);
    assert!(
        bytes > 3 * capacity,
        "{bytes} bytes against stores of {capacity}"
    );
    let stats = record.stats.unwrap();
    assert!(stats.spilled_bytes > 0, "nothing spilled: {stats:?}");
    assert_eq!(stats.retries(), 0, "a task failed: {stats:?}");
    for index in 0..2 {
        let status = cluster.node_status(index).await;
        assert_eq!(status.tasks_failed, 0, "node {index} failed a task (OOM?)");
        assert_eq!(status.workers_respawned, 0, "node {index} lost a worker");
    }
    // The output stays in the stores, spilled; the nodes' heartbeats say so.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reports = cluster.client().node_reports().await.unwrap();
        let spilled: u64 = reports
            .values()
            .map(|report| report.usage.spilled_bytes)
            .sum();
        if spilled > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no heartbeat reported spilled bytes: {reports:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Every row comes back from the spill files intact: streamed block by block (the output
    // is three times what the stores hold), each column equal to id × its number.
    let client = cluster.connect().await;
    let output = client.job(record.id).wait().await.unwrap();
    let mut reader = output.stream();
    let (mut seen, mut id_sum) = (0u64, 0i64);
    while let Some(batch) = reader.next_batch().await.unwrap() {
        let ids = int_column(std::slice::from_ref(&batch), "id");
        for column in 1..9i64 {
            let values = int_column(std::slice::from_ref(&batch), &format!("c{column}"));
            let expected: Vec<i64> = ids.iter().map(|id| id * column).collect();
            assert_eq!(values, expected, "column c{column} is wrong after spilling");
        }
        seen += ids.len() as u64;
        id_sum = id_sum.wrapping_add(ids.iter().sum::<i64>());
    }
    assert_eq!(seen, n);
    let n = n as i64;
    assert_eq!(id_sum, n * (n - 1) / 2);
    // And the cluster runs the next job.
    let after = cluster
        .run(&Dataset::range(1_000).unwrap(), JobOptions::default())
        .await;
    assert_eq!(output_rows(&after), 1_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_job_ends_cancelled_and_frees_its_objects() {
    let cluster = start(1, &[]).await;
    let job = cluster
        .submit(&slow_pipeline(200_000, 500), JobOptions::default())
        .await;
    wait_for_tasks(&cluster, job, None, 1).await;
    let outcome = cluster
        .client()
        .propose(floe_api::state::Command::CancelJob { job })
        .await
        .unwrap();
    assert_eq!(outcome, floe_api::state::Outcome::Applied);
    let record = cluster.wait_for_job(job).await;
    assert_eq!(record.status, JobStatus::Cancelled);
    // Freed asynchronously right before the job ended.
    let deadline = Instant::now() + Duration::from_secs(5);
    while cluster.node_status(0).await.store.objects_in_memory > 0 {
        assert!(
            Instant::now() < deadline,
            "the cancelled job's objects stayed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(cluster.node_status(0).await.running.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_with_a_bad_plan_fails_with_the_reason_and_the_cluster_keeps_serving() {
    let cluster = start(1, &[]).await;
    let job = cluster
        .client()
        .submit_job(vec![1, 2, 3], SubmissionId::random(), None)
        .await
        .unwrap();
    let record = cluster.wait_for_job(job).await;
    match &record.status {
        JobStatus::Failed { message } => assert!(message.contains("job spec"), "{message}"),
        other => panic!("unexpected {other:?}"),
    }
    let fine = cluster
        .run(&Dataset::range(1_000).unwrap(), JobOptions::default())
        .await;
    assert_eq!(output_rows(&fine), 1_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groupby_sort_join_unique_and_shuffle_match_independent_computations() {
    let cluster = start(2, &[]).await;
    let n = 30_000i64;
    // groupby → sort descending, across several input blocks and both nodes.
    let totals = Dataset::range(n as u64)
        .unwrap()
        .with_column("k", col("id") % lit(97i64))
        .unwrap()
        .groupby(&["k"])
        .agg(vec![
            Aggregation::count_rows("n"),
            Aggregation::of(AggFunction::Sum, "id"),
        ])
        .unwrap()
        .sort(vec![SortKey::desc("k")])
        .unwrap();
    let record = cluster.run(&totals, JobOptions::default()).await;
    let batches = cluster.outputs(&record).await;
    let keys = int_column(&batches, "k");
    assert_eq!(
        keys,
        (0..97).rev().collect::<Vec<_>>(),
        "sorted descending, one row per key"
    );
    let counts = int_column(&batches, "n");
    let sums = int_column(&batches, "sum_id");
    for ((k, count), sum) in keys.iter().zip(&counts).zip(&sums) {
        let members: Vec<i64> = (0..n).filter(|id| id % 97 == *k).collect();
        assert_eq!(*count, members.len() as i64, "count of {k}");
        assert_eq!(*sum, members.iter().sum::<i64>(), "sum of {k}");
    }
    // The groupby reduced through aggregator actors (the sort, a range shuffle, did not), and
    // they ended with the job: in the scheduler's state and on the nodes that hosted them.
    let stats = record.stats.clone().unwrap();
    let groupby = operator(&stats, "aggregate");
    assert!(
        groupby.aggregators >= 1 && groupby.aggregators_recreated == 0,
        "{groupby:?}"
    );
    assert_eq!(operator(&stats, "sort").aggregators, 0);
    assert!(cluster.state().await.actors.is_empty());
    cluster.wait_for_no_actors().await;

    // A join, and distinct keys.
    let left = Dataset::range(2_000)
        .unwrap()
        .with_column("k", col("id") % lit(50i64))
        .unwrap();
    let right = Dataset::range(40)
        .unwrap()
        .rename(&[("id", "k")])
        .unwrap()
        .with_column("v", col("k") * lit(10i64))
        .unwrap();
    let joined = left.join(&right, &["k"], JoinType::Inner).unwrap();
    let record = cluster.run(&joined, JobOptions::default()).await;
    let batches = cluster.outputs(&record).await;
    let mut rows: Vec<(i64, i64, i64)> = int_column(&batches, "id")
        .into_iter()
        .zip(int_column(&batches, "k"))
        .zip(int_column(&batches, "v"))
        .map(|((id, k), v)| (id, k, v))
        .collect();
    rows.sort();
    let expected: Vec<(i64, i64, i64)> = (0..2_000i64)
        .filter(|id| id % 50 < 40)
        .map(|id| (id, id % 50, (id % 50) * 10))
        .collect();
    assert_eq!(rows, expected);
    let distinct = left.unique(&["k"]).unwrap();
    let record = cluster.run(&distinct, JobOptions::default()).await;
    let mut keys = int_column(&cluster.outputs(&record).await, "k");
    keys.sort();
    assert_eq!(keys, (0..50).collect::<Vec<_>>());

    // A seeded random shuffle is a permutation, the same for the same seed.
    let shuffled = |seed| {
        Dataset::range(5_000)
            .unwrap()
            .random_shuffle(Some(seed))
            .unwrap()
    };
    let options = JobOptions {
        cache: CacheMode::NoCache,
        ..JobOptions::default()
    };
    let first = cluster.run(&shuffled(7), options.clone()).await;
    let first = int_column(&cluster.outputs(&first).await, "id");
    let again = cluster.run(&shuffled(7), options.clone()).await;
    assert_eq!(int_column(&cluster.outputs(&again).await, "id"), first);
    assert_ne!(first, (0..5_000).collect::<Vec<_>>(), "not shuffled");
    let mut sorted = first.clone();
    sorted.sort();
    assert_eq!(sorted, (0..5_000).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shuffle_larger_than_the_object_stores_completes_by_spilling() {
    let cluster = start(2, &SMALL_STORE).await;
    let capacity: u64 =
        cluster.node_status(0).await.store.capacity + cluster.node_status(1).await.store.capacity;
    // Four Int64 columns: 32 bytes a row, 1.5 × the stores.
    let n = 3 * capacity / 2 / 32;
    let dataset = Dataset::range(n)
        .unwrap()
        .with_column("a", col("id") * lit(3i64))
        .unwrap()
        .with_column("b", col("id") % lit(1_000i64))
        .unwrap()
        .with_column("c", col("id") + lit(1i64))
        .unwrap()
        .repartition_by(8, &["b"])
        .unwrap();
    let options = JobOptions {
        cache: CacheMode::NoCache,
        ..JobOptions::default()
    };
    let record = cluster.run(&dataset, options).await;
    let rows = output_rows(&record);
    assert_eq!(rows, n);
    let stats = record.stats.unwrap();
    assert!(stats.spilled_bytes > 0, "nothing spilled: {stats:?}");
    for index in 0..2 {
        assert_eq!(cluster.node_status(index).await.tasks_failed, 0);
    }
}

/// The slow pipeline's ids grouped by `id % 13`: each group's row count and sum of `double`.
fn groups_of_13(n: i64, delay_ms: i64) -> Dataset {
    slow_pipeline(n as u64, delay_ms)
        .with_column("k", col("id") % lit(13i64))
        .unwrap()
        .groupby(&["k"])
        .agg(vec![
            Aggregation::count_rows("n"),
            Aggregation::of(AggFunction::Sum, "double"),
        ])
        .unwrap()
}

/// Checks [`groups_of_13`]'s output against the groups computed here.
async fn assert_groups_of_13(cluster: &TestCluster, record: &JobRecord, n: i64) {
    let batches = cluster.outputs(record).await;
    let mut groups: Vec<(i64, i64, i64)> = int_column(&batches, "k")
        .into_iter()
        .zip(int_column(&batches, "n"))
        .zip(int_column(&batches, "sum_double"))
        .map(|((k, count), sum)| (k, count, sum))
        .collect();
    groups.sort();
    let expected: Vec<(i64, i64, i64)> = (0..13)
        .map(|k| {
            let members: Vec<i64> = (0..n).filter(|id| id % 13 == k).collect();
            (
                k,
                members.len() as i64,
                members.iter().map(|id| id * 2).sum(),
            )
        })
        .collect();
    assert_eq!(groups, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_node_mid_shuffle_still_gives_the_right_groups() {
    // Progress every 50 ms, not every 500: the window between the tenth task's end and the
    // job's is about one slow task long, and one run under load saw no report inside it.
    let mut cluster = start(3, &["node.progress_interval_ms=50"]).await;
    let n = 400_000i64;
    // Slow enough that the last tasks still run when the test sees ten done, whatever the
    // load (with all six workers busy, the thirteenth runs alone after two waves of six).
    let totals = groups_of_13(n, 400);
    let job = cluster.submit(&totals, JobOptions::default()).await;
    // Kill while the last of the 13 slow tasks feeding the shuffle run: the shuffle cannot
    // have started (it needs all of them), and its inputs on the victim are lost, so its
    // partition tasks must have them rebuilt from lineage. (The shuffle itself is over in
    // moments with partial aggregation, so waiting for one of its tasks would race with the
    // job's end.)
    wait_for_tasks(&cluster, job, Some("map"), 10).await;
    let record = kill_a_worker_node_and_wait(&mut cluster, job).await;
    assert_groups_of_13(&cluster, &record, n).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_node_hosting_aggregators_recreates_them_and_the_groups_are_right() {
    let mut cluster = start(3, &["node.progress_interval_ms=50"]).await;
    let n = 400_000i64;
    // A second per slow batch: the aggregators live from the groupby's first input until it
    // closes, and the test must see them spread before it kills one.
    let totals = groups_of_13(n, 1_000);
    let job = cluster.submit(&totals, JobOptions::default()).await;
    // The aggregators are created at the groupby's first input, placed with SPREAD and
    // recorded in the replicated state: wait until they live on every node.
    let deadline = Instant::now() + JOB_TIMEOUT;
    loop {
        let state = cluster.state().await;
        let nodes: std::collections::BTreeSet<NodeId> = state
            .actors
            .values()
            .filter(|actor| actor.job == job && actor.kind == "HashShuffleAggregator")
            .map(|actor| actor.node)
            .collect();
        if nodes.len() == 3 {
            break;
        }
        assert!(
            !state.jobs[&job].status.is_finished(),
            "the job ended ({:?}) before its aggregators were spread: {:?}",
            state.jobs[&job].status,
            state.actors
        );
        assert!(Instant::now() < deadline, "the aggregators never spread");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The driver is an actor too. Any node answers for any actor: a node that does not host
    // it forwards the call to the one the scheduler's state names.
    let state = cluster.state().await;
    let driver_node = state.jobs[&job].driver.unwrap();
    let driver = floe_api::state::driver_actor(job, 1);
    assert_eq!(state.actors[&driver].node, driver_node);
    let elsewhere = (0..3)
        .find(|index| state.nodes[&driver_node].addresses.rpc != cluster.node(*index).addr())
        .unwrap();
    let described = cluster.describe(elsewhere, driver).await;
    assert_eq!(
        (described.kind.as_str(), described.job, described.node),
        ("JobDriver", job, Some(driver_node))
    );
    let aggregator = state
        .actors
        .values()
        .find(|actor| actor.kind == "HashShuffleAggregator" && actor.node == driver_node)
        .unwrap();
    let described = cluster.describe(elsewhere, aggregator.id).await;
    assert_eq!(
        (described.kind.as_str(), described.node),
        ("HashShuffleAggregator", Some(driver_node))
    );
    // Every node hosts an aggregator, so the victim (not the driver's node) does.
    let record = kill_a_worker_node_and_wait(&mut cluster, job).await;
    let stats = record.stats.clone().unwrap();
    let groupby = operator(&stats, "aggregate");
    assert!(groupby.aggregators_recreated >= 1, "{groupby:?}");
    assert_groups_of_13(&cluster, &record, n).await;
    assert!(cluster.state().await.actors.is_empty());
    cluster.wait_for_no_actors().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_may_run_longer_than_the_rpc_read_timeout() {
    // Quick calls time out after a second here; a 2.5 s task must still be waited for, not
    // retried as if its node were gone.
    let cluster = start(1, &["timeouts.read_ms=1000"]).await;
    let slow = Dataset::range(100)
        .unwrap()
        .map_batches(UdfCall::new("delay", 1).with("ms", 2_500i64))
        .unwrap();
    let record = cluster.run(&slow, JobOptions::default()).await;
    let stats = record.stats.clone().unwrap();
    assert_eq!(stats.retries(), 0, "{stats:?}");
    assert_eq!(output_rows(&record), 100);
}

/// A repartition's reduce stores each map task's part as it is, not concatenated: an output
/// block holds several batches, every row arrives exactly once, and each key lies in one block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repartitions_blocks_hold_the_map_tasks_parts_as_they_are() {
    let cluster = start(1, &[]).await;
    let n = 200_000;
    let dataset = Dataset::range(n as u64)
        .unwrap()
        .with_column("k", col("id") % lit(97i64))
        .unwrap()
        .repartition_by(4, &["k"])
        .unwrap();
    let options = JobOptions {
        cache: CacheMode::NoCache,
        ..JobOptions::default()
    };
    let record = cluster.run(&dataset, options).await;
    let output = cluster.connect().await.job(record.id).wait().await.unwrap();
    let mut reader = output.stream();
    let mut batches_per_block = std::collections::BTreeMap::<u64, usize>::new();
    let mut block_of_key = std::collections::BTreeMap::new();
    let mut ids = Vec::new();
    while let Some(batch) = reader.next_batch().await.unwrap() {
        let block = reader.blocks_read();
        *batches_per_block.entry(block).or_default() += 1;
        let batch = [batch];
        for (id, k) in int_column(&batch, "id")
            .into_iter()
            .zip(int_column(&batch, "k"))
        {
            assert_eq!(k, id % 97);
            assert_eq!(*block_of_key.entry(k).or_insert(block), block, "key {k}");
            ids.push(id);
        }
    }
    ids.sort_unstable();
    assert_eq!(ids, (0..n).collect::<Vec<i64>>());
    assert!(batches_per_block.len() <= 4, "{batches_per_block:?}");
    assert!(
        batches_per_block.values().all(|&batches| batches > 1),
        "a block of one batch: {batches_per_block:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skewed_shuffle_names_its_hot_key_in_the_stats() {
    let cluster = start(1, &[]).await;
    // Nine rows in ten have k = 0, and so does id 0.
    let skewed = Dataset::range(300_000)
        .unwrap()
        .with_column(
            "k",
            when((col("id") % lit(10i64)).eq(lit(0i64)), col("id"), lit(0i64)),
        )
        .unwrap()
        .repartition_by(8, &["k"])
        .unwrap();
    let record = cluster.run(&skewed, JobOptions::default()).await;
    assert_eq!(output_rows(&record), 300_000);
    let stats = record.stats.unwrap();
    let hot_key = operator(&stats, "repartition").hot_key.clone();
    let hot_key = hot_key.unwrap_or_else(|| panic!("no hot key in {stats:?}"));
    assert!(
        hot_key.contains("most frequent key is k=0 (270001 rows)"),
        "{hot_key}"
    );

    // An even shuffle names none.
    let even = Dataset::range(300_000)
        .unwrap()
        .repartition_by(8, &["id"])
        .unwrap();
    let record = cluster.run(&even, JobOptions::default()).await;
    let stats = record.stats.unwrap();
    assert_eq!(operator(&stats, "repartition").hot_key, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subplan_shared_by_a_union_and_a_limit_or_filter_keeps_all_its_rows() {
    let cluster = start(1, &[]).await;
    let a = Dataset::range(100_000).unwrap();
    let limited = a.union(&a.limit(5).unwrap()).unwrap();
    let record = cluster.run(&limited, JobOptions::default()).await;
    let mut got = int_column(&cluster.outputs(&record).await, "id");
    got.sort();
    let mut expected: Vec<i64> = (0..100_000).chain(0..5).collect();
    expected.sort();
    assert_eq!(
        got, expected,
        "the limit must not stop the union's other input"
    );

    let filtered = a
        .union(&a.filter((col("id") % lit(4i64)).eq(lit(0i64))).unwrap())
        .unwrap();
    let record = cluster.run(&filtered, JobOptions::default()).await;
    let mut got = int_column(&cluster.outputs(&record).await, "id");
    got.sort();
    let mut expected: Vec<i64> = (0..100_000).chain((0..100_000).step_by(4)).collect();
    expected.sort();
    assert_eq!(
        got, expected,
        "blocks shared by both inputs must all reach the output"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_hangs_without_closing_its_connections_is_given_up() {
    // SIGSTOP: the node's sockets stay open but nothing answers, as when a machine loses
    // power. Its tasks must move once the scheduler declares it dead.
    let mut cluster = start(3, &["timeouts.read_ms=3000"]).await;
    let n = 400_000;
    let job = cluster
        .submit(&slow_pipeline(n as u64, 150), JobOptions::default())
        .await;
    wait_for_tasks(&cluster, job, None, 16).await;
    let driver = cluster.state().await.jobs[&job].driver.unwrap();
    let driver_index = cluster.index_of(driver).await;
    let victim = (0..3).find(|index| *index != driver_index).unwrap();
    cluster.node(victim).signal("STOP").unwrap();

    let record = cluster.wait_for_job(job).await;
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
    // The frozen node holds nothing the result needs.
    let frozen = cluster.nodes[victim].take().unwrap();
    assert_ids(&cluster, &record, n).await;
    drop(frozen);
}

/// Unmounts a tmpfs when dropped, even when the test fails.
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// `None` when this process may not mount (not root): the test is then skipped.
    fn mount(path: &Path, size: &str) -> Option<Self> {
        std::fs::create_dir_all(path).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(path)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        mounted.then(|| Self(path.to_owned()))
    }

    fn used_bytes(&self) -> u64 {
        let output = std::process::Command::new("df")
            .args(["--output=used", "-B1"])
            .arg(&self.0)
            .output()
            .unwrap();
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .nth(1)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_spill_disk_fails_the_job_clearly_and_the_cluster_runs_the_next() {
    let disk_dir = tempfile::tempdir().unwrap();
    let Some(disk) = Tmpfs::mount(&disk_dir.path().join("disk"), "48m") else {
        eprintln!("skipped: mounting a tmpfs needs root");
        return;
    };
    let spill = disk.0.join("spill");
    let fallback = disk.0.join("fallback");
    let cluster = start(
        1,
        &[
            SMALL_STORE[0],
            SMALL_STORE[1],
            &format!("paths.spill_dir={}", spill.display()),
            &format!("paths.fallback_dir={}", fallback.display()),
        ],
    )
    .await;
    let capacity = cluster.node_status(0).await.store.capacity;
    // The store plus the 48 MiB disk twice over.
    let n = 2 * (capacity + (48 << 20)) / NINE_COLUMNS_ROW_BYTES;
    let dataset = nine_columns(n);
    let options = JobOptions {
        cache: CacheMode::NoCache,
        max_task_retries: 1,
        ..JobOptions::default()
    };
    let job = cluster.submit(&dataset, options).await;
    let record = cluster.wait_for_job(job).await;
    let JobStatus::Failed { message: error } = &record.status else {
        panic!("the job should fail: {record:?}");
    };
    assert!(
        error.contains("full") || error.contains("No space left"),
        "the error should say the disk is full: {error}"
    );

    // The failed job's objects and spill files go; the node is alive and runs the next job.
    let deadline = Instant::now() + Duration::from_secs(20);
    while cluster.node_status(0).await.store.objects_in_memory > 0 || disk.used_bytes() > 1 << 20 {
        assert!(
            Instant::now() < deadline,
            "the failed job's data stayed: {} bytes on the spill disk",
            disk.used_bytes()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = cluster
        .run(
            &Dataset::range(50_000)
                .unwrap()
                .filter(col("id").lt(lit(7i64)))
                .unwrap(),
            JobOptions::default(),
        )
        .await;
    assert_eq!(output_rows(&after), 7);
    drop(cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_survives_kill_9_of_a_worker_process() {
    let cluster = start(2, &[]).await;
    let n = 400_000;
    let job = cluster
        .submit(&slow_pipeline(n as u64, 300), JobOptions::default())
        .await;
    // Kill a worker while it runs one of the slow map tasks: once the 13 quick range tasks
    // are done, every running task is one of those (300 ms each).
    wait_for_tasks(&cluster, job, Some("range"), 13).await;
    let deadline = Instant::now() + JOB_TIMEOUT;
    let (index, worker) = loop {
        let mut found = None;
        for index in 0..2 {
            if let Some(task) = cluster.node_status(index).await.running.first() {
                found = Some((index, task.worker_pid));
                break;
            }
        }
        if let Some(found) = found {
            break found;
        }
        assert!(Instant::now() < deadline, "no task ever ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    process::signal(worker, "KILL");

    let record = cluster.wait_for_job(job).await;
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
    let stats = record.stats.clone().unwrap();
    assert!(
        stats.retries() > 0,
        "the killed task was not retried: {stats:?}"
    );
    assert_ids(&cluster, &record, n).await;
    let status = cluster.node_status(index).await;
    assert_eq!(status.workers_respawned, 1);
    assert_eq!(status.workers, 2, "the worker was replaced");
    let after = cluster
        .run(&slow_pipeline(10_000, 0), JobOptions::default())
        .await;
    assert_ids(&cluster, &after, 10_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_node_while_a_shuffle_reduces_still_gives_every_row() {
    // Progress every 50 ms, so the test sees the reduce phase begin.
    let mut cluster = start(3, &["node.progress_interval_ms=50"]).await;
    // A sort: its reduce tasks sort their partitions, the slowest reduce there is. Enough rows
    // that the reduces outlast a 50 ms progress report and the kill: with 2,000,000, reduces
    // that gather warm memory sometimes all finished first (the job ended before the test saw
    // a reduce output, or the killed node had nothing left to lose).
    let n = 4_000_000i64;
    let dataset = Dataset::range(n as u64)
        .unwrap()
        .with_column("k", col("id") % lit(1_009i64))
        .unwrap()
        .with_column("v", col("id") * lit(3i64))
        .unwrap()
        .sort(vec![SortKey::asc("k"), SortKey::desc("v")])
        .unwrap();
    let options = JobOptions {
        cache: CacheMode::NoCache,
        ..JobOptions::default()
    };
    let job = cluster.submit(&dataset, options).await;
    // Wait until the sort has produced its first reduce outputs, but not all of them.
    let deadline = Instant::now() + JOB_TIMEOUT;
    loop {
        let progress = cluster.client().job_progress(job).await.unwrap();
        let sort = progress
            .as_ref()
            .and_then(|progress| progress.operators.iter().find(|op| op.name == "sort"));
        if let Some(sort) = sort
            && sort.blocks_done > 0
        {
            assert!(
                sort.tasks_total.is_none_or(|total| sort.tasks_done < total),
                "the sort finished before the kill: {sort:?}"
            );
            break;
        }
        let status = cluster.state().await.jobs[&job].status.clone();
        assert!(
            !status.is_finished(),
            "the job ended ({status:?}) before its sort reduced: {progress:?}"
        );
        assert!(Instant::now() < deadline, "the sort never reduced");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let record = kill_a_worker_node_and_wait(&mut cluster, job).await;
    let batches = cluster.outputs(&record).await;
    let ids = {
        let mut ids = int_column(&batches, "id");
        ids.sort_unstable();
        ids
    };
    assert_eq!(ids.len() as i64, n, "rows lost or repeated");
    assert!(
        ids.iter()
            .enumerate()
            .all(|(index, id)| *id == index as i64)
    );
    for batch in &batches {
        let ids = int_column(std::slice::from_ref(batch), "id");
        let values = int_column(std::slice::from_ref(batch), "v");
        assert!(ids.iter().zip(&values).all(|(id, v)| *v == id * 3));
    }
    let after = cluster
        .run(&slow_pipeline(10_000, 0), JobOptions::default())
        .await;
    assert_ids(&cluster, &after, 10_000).await;
}
