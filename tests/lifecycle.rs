//! Lifecycle across real processes: a node that restarts (or rejoins under a new id) finds its
//! cache shards again and the next run uses them, and a node killed while it served shards as
//! held blocks leaves links its successor removes; shard files deleted behind the index's back
//! cost a recomputation, never the job; a recompute replaces the old shard files rather than
//! adding to them; a scheduler restarted on its old data directory sends work only to nodes
//! that heartbeat to it.

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use floe_api::state::{ClusterState, JobStatus};
use floe_client::{Dataset, SortKey, col, lit};
use floe_core::NodeId;
use floe_core::job::{CacheMode, JobOptions, JobStats, OperatorStats};
use floe_testkit::batches::int_column;
use floe_testkit::cluster::{READY_TIMEOUT, TestCluster, TestClusterConfig, fast_timing};

const ROWS: i64 = 40_000;

/// A scheduler and `nodes` nodes with fast heartbeats, and `settings` for all of them.
async fn start(nodes: usize, settings: &[&str]) -> TestCluster {
    let mut all = fast_timing();
    all.extend(settings.iter().map(|setting| (*setting).to_owned()));
    let config = TestClusterConfig {
        settings: all,
        ..TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"))
    };
    TestCluster::start(config, nodes).await
}

/// `range(ROWS)` with `double = id × 2`, its shards cached one per range task.
fn doubled() -> Dataset {
    Dataset::range(ROWS as u64)
        .unwrap()
        .with_column("double", col("id") * lit(2i64))
        .unwrap()
        .cache()
        .unwrap()
}

/// Runs `dataset` to success and checks every row is there, once, in order.
async fn run_exact(cluster: &TestCluster, dataset: &Dataset) -> JobStats {
    let record = cluster.run(dataset, JobOptions::default()).await;
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
    let batches = cluster.outputs(&record).await;
    let ids = int_column(&batches, "id");
    assert_eq!(ids, (0..ROWS).collect::<Vec<_>>(), "rows lost or repeated");
    let doubled = int_column(&batches, "double");
    assert!(doubled.iter().zip(&ids).all(|(d, id)| *d == id * 2));
    record.stats.unwrap()
}

fn operator<'a>(stats: &'a JobStats, name: &str) -> &'a OperatorStats {
    stats
        .operators
        .iter()
        .find(|operator| floe_core::job::stage_kind(&operator.name) == name)
        .unwrap_or_else(|| panic!("no {name} operator in {stats:?}"))
}

fn cache_dir(cluster: &TestCluster, node: usize) -> PathBuf {
    cluster
        .dir
        .path()
        .join(format!("node-{node}"))
        .join("cache")
}

/// The shard files in `dir`, sorted.
fn shard_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            path.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("cache-")
        })
        .collect();
    files.sort();
    files
}

/// Shards the index records on `node`.
fn indexed_on(state: &ClusterState, node: NodeId) -> usize {
    state
        .cache
        .values()
        .flat_map(|by_count| by_count.values())
        .flat_map(|entry| entry.shards.values())
        .filter(|shard| shard.node == node)
        .count()
}

/// Waits until the only alive node has `shards` shards indexed, and answers its id.
async fn wait_for_indexed(cluster: &TestCluster, shards: usize, besides: NodeId) -> NodeId {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let state = cluster.state().await;
        let alive: Vec<NodeId> = state.alive_nodes().map(|node| node.id).collect();
        if let [node] = alive.as_slice()
            && *node != besides
            && indexed_on(&state, *node) == shards
        {
            return *node;
        }
        assert!(
            Instant::now() < deadline,
            "the node's {shards} shards were not indexed again: alive {alive:?}, cache {:?}",
            state.cache
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_restarts_or_rejoins_indexes_its_shards_again_and_the_rerun_computes_nothing() {
    let mut cluster = start(1, &[]).await;
    let first = run_exact(&cluster, &doubled()).await;
    assert!(first.compute_tasks() > 0);
    let shards = shard_files(&cache_dir(&cluster, 0)).len();
    assert!(shards > 0);
    let old = cluster.node_status(0).await.node.unwrap();

    // Killed and started again on the same directory: a new id, the same shards.
    cluster.kill_node(0);
    let node = cluster.start_node("node-0", &[]);
    cluster.wait_ready(&node).await;
    cluster.nodes[0] = Some(node);
    let restarted = wait_for_indexed(&cluster, shards, old).await;
    let again = run_exact(&cluster, &doubled()).await;
    assert_eq!(again.compute_tasks(), 0, "{again:?}");
    assert!(again.cache_hits() > 0, "{again:?}");

    // Frozen past its heartbeats: declared dead, it registers again under a new id.
    cluster.node(0).signal("STOP").unwrap();
    let deadline = Instant::now() + READY_TIMEOUT;
    while cluster.state().await.nodes[&restarted].is_alive() {
        assert!(
            Instant::now() < deadline,
            "the frozen node was not declared dead"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.node(0).signal("CONT").unwrap();
    wait_for_indexed(&cluster, shards, restarted).await;
    let rejoined = run_exact(&cluster, &doubled()).await;
    assert_eq!(rejoined.compute_tasks(), 0, "{rejoined:?}");
}

/// The files in `dir`, sorted (none if it does not exist).
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| entries.map(|entry| entry.unwrap().path()).collect())
        .unwrap_or_default();
    files.sort();
    files
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_links_to_the_shards_it_served_are_removed_by_the_next_node() {
    use std::os::unix::fs::MetadataExt;
    let mut cluster = start(1, &[]).await;
    run_exact(&cluster, &doubled()).await;
    let shards = shard_files(&cache_dir(&cluster, 0));
    assert!(!shards.is_empty());
    // Served from the cache and held: each block is the store's link to its shard file.
    let served = run_exact(&cluster, &doubled()).await;
    assert_eq!(served.compute_tasks(), 0, "{served:?}");
    let fallback = cluster.dir.path().join("node-0").join("fallback");
    let links = files(&fallback);
    let inodes = |paths: &[PathBuf]| -> Vec<u64> {
        let mut inodes: Vec<u64> = paths
            .iter()
            .map(|path| std::fs::metadata(path).unwrap().ino())
            .collect();
        inodes.sort_unstable();
        inodes
    };
    assert_eq!(inodes(&links), inodes(&shards));
    let old = cluster.node_status(0).await.node.unwrap();

    // kill -9 leaves the links; the next node on the directory removes them with the rest of
    // its predecessor's files, and keeps the shards.
    cluster.kill_node(0);
    assert!(links.iter().all(|link| link.exists()));
    let node = cluster.start_node("node-0", &[]);
    cluster.wait_ready(&node).await;
    cluster.nodes[0] = Some(node);
    assert_eq!(files(&fallback), Vec::<PathBuf>::new(), "links leaked");
    assert_eq!(shard_files(&cache_dir(&cluster, 0)), shards);
    wait_for_indexed(&cluster, shards.len(), old).await;
    let again = run_exact(&cluster, &doubled()).await;
    assert_eq!(again.compute_tasks(), 0, "{again:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_files_deleted_behind_the_index_cost_a_recomputation_not_the_job() {
    let cluster = start(1, &[]).await;
    let dir = cache_dir(&cluster, 0);
    let first = run_exact(&cluster, &doubled()).await;
    let range_tasks = operator(&first, "range").tasks;
    let files = shard_files(&dir);
    assert_eq!(files.len() as u64, range_tasks);

    // One shard gone: it alone is computed again, in the same run.
    std::fs::remove_file(&files[1]).unwrap();
    let partial = run_exact(&cluster, &doubled()).await;
    assert_eq!(operator(&partial, "range").tasks, 1, "{partial:?}");
    assert_eq!(operator(&partial, "range").cache_hits, range_tasks - 1);
    assert_eq!(shard_files(&dir).len() as u64, range_tasks);

    // Everything gone under a sort: its output and its input are found missing in turn.
    let sorted = doubled().sort(vec![SortKey::asc("id")]).unwrap();
    run_exact(&cluster, &sorted).await;
    for file in shard_files(&dir) {
        std::fs::remove_file(file).unwrap();
    }
    let rerun = run_exact(&cluster, &sorted).await;
    assert_eq!(operator(&rerun, "range").tasks, range_tasks, "{rerun:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_scheduler_sends_drivers_only_to_nodes_that_heartbeat_to_it() {
    // A node timeout of 5 s: long enough that the dead node is still alive in the restored
    // state when the job is submitted.
    let mut cluster = start(2, &["scheduler.missed_heartbeats=25"]).await;
    let dead = cluster.node_status(0).await.node.unwrap();
    let live = cluster.node_status(1).await.node.unwrap();
    assert!(
        dead < live,
        "the dead node is the one an idle cluster would pick first"
    );
    // The scheduler goes first, so no one commits the node's death.
    cluster.schedulers.kill(1).unwrap();
    cluster.kill_node(0);
    cluster.schedulers.start_replica(1).unwrap();
    cluster
        .schedulers
        .wait_for_leader(READY_TIMEOUT)
        .await
        .unwrap();
    assert!(cluster.state().await.nodes[&dead].is_alive());

    let started = Instant::now();
    let record = cluster.run(&doubled(), JobOptions::default()).await;
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
    assert_eq!(
        record.attempts, 1,
        "a driver went to the dead node: {record:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the job waited for the dead node's timeout: {:?}",
        started.elapsed()
    );
    let batches = cluster.outputs(&record).await;
    assert_eq!(int_column(&batches, "id"), (0..ROWS).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recompute_leaves_one_file_per_shard_across_the_nodes() {
    let cluster = start(2, &[]).await;
    let files =
        || shard_files(&cache_dir(&cluster, 0)).len() + shard_files(&cache_dir(&cluster, 1)).len();
    let first = run_exact(&cluster, &doubled()).await;
    let shards = operator(&first, "range").tasks as usize;
    assert_eq!(files(), shards);
    let recompute = JobOptions {
        cache: CacheMode::Recompute,
        ..JobOptions::default()
    };
    for _ in 0..3 {
        let record = cluster.run(&doubled(), recompute.clone()).await;
        assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
        // Placement spreads the shards differently each time: the old copies go.
        assert_eq!(files(), shards);
    }
    assert_eq!(cluster.indexed_shards().await, shards);
}
