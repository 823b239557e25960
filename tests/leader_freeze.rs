//! Scheduler replicas that freeze or lose their quorum while jobs run (real processes): a
//! leader stopped with SIGSTOP gets no node declared dead, a node that was declared dead
//! records its cache shards again, and `floe submit --wait` waits through quorum loss.

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use arrow::array::{Array, Int64Array};
use floe_api::state::{CacheEntry, ClusterState};
use floe_client::local::LocalNode;
use floe_client::local::LocalSchedulers;
use floe_client::{Client, Dataset, JobHandle, JobOutput, UdfCall, col, lit};
use floe_core::NodeId;
use floe_testkit::cluster::{TestClusterConfig, start_node, start_schedulers};
use floe_testkit::process::signal;

/// Small blocks, so a range becomes tens of tasks.
const SMALL_BLOCKS: [&str; 2] = ["data.min_block_size=16KiB", "data.max_block_size=64KiB"];

/// Three replicas (with a fast Raft tick) and `nodes` nodes of two workers each.
async fn cluster(dir: &Path, nodes: usize) -> (LocalSchedulers, Vec<LocalNode>) {
    let mut config = TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"));
    config.replicas = 3;
    config.settings = vec!["scheduler.raft_tick_ms=30".into()];
    config.node_settings = SMALL_BLOCKS.map(str::to_owned).to_vec();
    let schedulers = start_schedulers(&config, dir);
    schedulers
        .wait_for_leader(Duration::from_secs(30))
        .await
        .unwrap();
    let mut started = Vec::new();
    for index in 0..nodes {
        let node = start_node(
            &config,
            dir,
            &schedulers.addrs(),
            &format!("node-{index}"),
            &[],
        );
        node.wait_ready(&config.wire(), config.workers, Duration::from_secs(30))
            .await
            .unwrap();
        started.push(node);
    }
    (schedulers, started)
}

async fn state(schedulers: &LocalSchedulers) -> ClusterState {
    schedulers.client().unwrap().read_state().await.unwrap()
}

/// `range(n)` where each block sleeps `ms`: a job that runs for a while.
fn slow_range(n: u64, ms: i64) -> Dataset {
    Dataset::range(n)
        .unwrap()
        .map_batches(UdfCall::new("delay", 1).with("ms", ms))
        .unwrap()
}

/// The `id` column of a job's output, in output order.
async fn output_ids(output: &JobOutput) -> Vec<i64> {
    let mut ids = Vec::new();
    for batch in output.to_arrow().await.unwrap() {
        let column = batch.column(0);
        let column = column.as_any().downcast_ref::<Int64Array>().unwrap();
        assert_eq!(column.null_count(), 0);
        ids.extend_from_slice(column.values());
    }
    ids
}

/// A cached dataset of `n` rows (`twice = 2 × id`).
fn cached_range(n: u64) -> Dataset {
    Dataset::range(n)
        .unwrap()
        .with_column("twice", col("id") * lit(2i64))
        .unwrap()
        .cache()
        .unwrap()
}

/// The cache index as (fingerprint, shard count, rank) → node.
fn shard_nodes(
    cache: &BTreeMap<String, BTreeMap<u32, CacheEntry>>,
) -> Vec<((String, u32, u32), NodeId)> {
    let mut shards = Vec::new();
    for (fingerprint, by_count) in cache {
        for (count, entry) in by_count {
            for (rank, shard) in &entry.shards {
                shards.push(((fingerprint.clone(), *count, *rank), shard.node));
            }
        }
    }
    shards
}

/// Waits until `job`'s driver reports progress, then returns the scheduler leader's id.
async fn leader_once_running(schedulers: &LocalSchedulers, job: &JobHandle) -> u64 {
    while job.progress().await.unwrap().is_none() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    schedulers
        .wait_for_leader(Duration::from_secs(10))
        .await
        .unwrap()
}

/// Kills the leader and one other replica: no quorum is left. Returns the two ids.
fn kill_quorum(schedulers: &mut LocalSchedulers, leader: u64) -> [u64; 2] {
    let other = (1..=3).find(|id| *id != leader).unwrap();
    schedulers.kill(leader).unwrap();
    schedulers.kill(other).unwrap();
    [leader, other]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_gets_no_node_declared_dead_and_the_job_completes() {
    let dir = tempfile::tempdir().unwrap();
    let (schedulers, nodes) = cluster(dir.path(), 2).await;
    let token = schedulers.credentials().admin_token.expose().to_owned();
    let token = token.as_str();
    let client = Client::connect(&schedulers.addrs(), token).await.unwrap();

    // A cached result, to check the cache index survives the freeze.
    let cached = client.submit(&cached_range(100_000)).await.unwrap();
    cached.wait().await.unwrap();
    let cache_before = state(&schedulers).await.cache;
    assert!(!cache_before.is_empty());

    // About 25 blocks of 2 s on 4 workers: the job runs through the whole freeze.
    let n = 200_000i64;
    let job = client.submit(&slow_range(n as u64, 2_000)).await.unwrap();
    let leader = leader_once_running(&schedulers, &job).await;
    let pid = schedulers.pid(leader).unwrap();
    // Frozen for well over the node timeout (5 heartbeats of 1 s).
    signal(pid, "STOP");
    tokio::time::sleep(Duration::from_secs(13)).await;
    signal(pid, "CONT");

    let output = job.wait().await.unwrap();
    assert_eq!(output_ids(&output).await, (0..n).collect::<Vec<_>>());
    assert_eq!(output.stats.attempt, 1, "the driver was started again");
    let after = state(&schedulers).await;
    // No node was committed dead: still the two first registrations, both alive.
    assert_eq!(after.nodes.len(), 2, "{:?}", after.nodes);
    assert!(
        after.nodes.values().all(|node| node.is_alive()),
        "{:?}",
        after.nodes
    );
    // Every shard indexed before is still indexed on its node (the slow job cached its own
    // output besides).
    let indexed = shard_nodes(&after.cache);
    for shard in shard_nodes(&cache_before) {
        assert!(
            indexed.contains(&shard),
            "{shard:?} left the index: {indexed:?}"
        );
    }
    drop(nodes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_declared_dead_records_its_cache_shards_again_when_it_returns() {
    let dir = tempfile::tempdir().unwrap();
    let (schedulers, nodes) = cluster(dir.path(), 2).await;
    let token = schedulers.credentials().admin_token.expose().to_owned();
    let token = token.as_str();
    let client = Client::connect(&schedulers.addrs(), token).await.unwrap();
    let n = 100_000u64;
    client
        .submit(&cached_range(n))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    let first = state(&schedulers).await;
    let original: Vec<NodeId> = first.nodes.keys().copied().collect();
    let before = shard_nodes(&first.cache);
    assert!(!before.is_empty());
    // The node holding the first shard; both nodes know their ids.
    let holder = before[0].1;
    let mut frozen = None;
    for node in &nodes {
        let status = node
            .wait_registered(
                &schedulers.credentials().member_wire(),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        if status.node == Some(holder) {
            frozen = Some(node);
        }
    }
    let frozen = frozen.unwrap();
    let held: Vec<_> = before
        .iter()
        .filter(|(_, node)| *node == holder)
        .map(|(shard, _)| shard.clone())
        .collect();

    // Frozen past the node timeout: its death commits and its shards leave the index.
    signal(frozen.pid(), "STOP");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = state(&schedulers).await;
        if !now.nodes[&holder].is_alive() {
            assert!(
                shard_nodes(&now.cache)
                    .iter()
                    .all(|(_, node)| *node != holder)
            );
            break;
        }
        assert!(Instant::now() < deadline, "node {holder} never died");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    signal(frozen.pid(), "CONT");

    // It registers again under a new id and records the same shards under it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let returned = loop {
        let now = state(&schedulers).await;
        let shards = shard_nodes(&now.cache);
        if let Some(new) = now
            .nodes
            .values()
            .find(|node| node.is_alive() && !original.contains(&node.id))
            .map(|node| node.id)
            && held
                .iter()
                .all(|shard| shards.iter().any(|(s, node)| s == shard && *node == new))
        {
            break new;
        }
        assert!(
            Instant::now() < deadline,
            "the returned node's shards {held:?} are not indexed: {shards:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_ne!(returned, holder);
    // The same dataset is read from the cache, with every row right.
    let again = client
        .submit(&cached_range(n))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(output_ids(&again).await, (0..n as i64).collect::<Vec<_>>());
    let hits: u64 = again.stats.operators.iter().map(|op| op.cache_hits).sum();
    assert!(hits >= held.len() as u64, "{:?}", again.stats);
    drop(nodes);
}

/// `floe submit FILE --wait ARGS…` against `schedulers`, started in the background.
fn submit_and_wait(
    schedulers: &LocalSchedulers,
    token: &str,
    file: &Path,
    args: &[&str],
) -> std::process::Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_floe"));
    for (name, _) in std::env::vars() {
        if name.starts_with("FLOE_") {
            command.env_remove(name);
        }
    }
    command
        .arg("submit")
        .arg(file)
        .arg("--wait")
        .args(args)
        .arg("--scheduler")
        .arg(schedulers.addrs().join(","))
        .env("FLOE_CLIENT_TOKEN", token)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Reads the child's stdout until a line containing `wanted`; the reader for the rest.
fn read_until(child: &mut std::process::Child) -> impl FnMut(&str) -> Vec<String> + use<> {
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    move |wanted| {
        let mut seen = Vec::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            let found = line.contains(wanted);
            seen.push(line);
            if found {
                return seen;
            }
        }
        panic!("{wanted:?} never printed: {seen:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_wait_survives_quorum_loss_and_gives_up_only_on_its_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let (mut schedulers, nodes) = cluster(dir.path(), 2).await;
    let token = schedulers.credentials().admin_token.expose().to_owned();
    let token = token.as_str();
    let job_file = dir.path().join("slow.toml");
    // About 25 blocks of 1.5 s on 4 workers.
    std::fs::write(
        &job_file,
        "[source]\nrange = 200000\n[[steps]]\nmap_batches = { udf = \"delay\", version = 1, args = { ms = 1500 } }\n",
    )
    .unwrap();

    // A malformed timeout is refused before anything is submitted.
    let refused = submit_and_wait(&schedulers, token, &job_file, &["--timeout", "2"])
        .wait_with_output()
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("has no unit"), "{stderr}");

    let mut waiting = submit_and_wait(&schedulers, token, &job_file, &[]);
    let mut stdout = read_until(&mut waiting);
    stdout("job 1 submitted");
    let client = Client::connect(&schedulers.addrs(), token).await.unwrap();
    let job = client.job(floe_core::JobId::new(1));
    // Two of three replicas (the leader among them) gone for longer than a client's
    // 10 s retry window: no quorum, no leader.
    let leader = leader_once_running(&schedulers, &job).await;
    let killed = kill_quorum(&mut schedulers, leader);
    tokio::time::sleep(Duration::from_secs(12)).await;
    for id in killed {
        schedulers.start_replica(id).unwrap();
    }

    let lines = stdout("succeeded");
    let output = waiting.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{lines:?}\n{stderr}");
    assert!(
        lines
            .iter()
            .any(|line| line == "job 1 succeeded: 200000 rows"),
        "{lines:?}"
    );
    assert!(
        stderr.contains("no scheduler leader; still waiting for job 1"),
        "{stderr}"
    );

    // With --timeout, the wait gives up on time (not at a retry window) and says why.
    let started = Instant::now();
    let mut bounded = submit_and_wait(&schedulers, token, &job_file, &["--timeout", "2s"]);
    read_until(&mut bounded)("job 2 submitted");
    let leader = schedulers
        .wait_for_leader(Duration::from_secs(10))
        .await
        .unwrap();
    kill_quorum(&mut schedulers, leader);
    let output = bounded.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("gave up waiting for job 2 after 2s"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    drop(nodes);
}
