//! Placement leases on real multi-process clusters: a node SIGKILLed while it holds a job's
//! lease, and jobs running at once. Results are checked against independent computations, and
//! every node's reservations must be back to zero once the jobs ended.

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use floe_api::state::{JobRecord, JobStatus, Resources};
use floe_client::{Dataset, UdfCall, col, lit};
use floe_core::config::ByteSize;
use floe_core::job::JobOptions;
use floe_core::{JobId, NodeId};
use floe_testkit::batches::int_column;
use floe_testkit::cluster::{JOB_TIMEOUT, TestCluster, TestClusterConfig, fast_timing};

/// A scheduler and `nodes` nodes of two workers each.
async fn start(nodes: usize) -> TestCluster {
    let config = TestClusterConfig {
        settings: fast_timing(),
        node_settings: vec![
            "data.min_block_size=64KiB".into(),
            "data.max_block_size=8MiB".into(),
        ],
        max_frame: Some(ByteSize::mib(128)),
        ..TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"))
    };
    TestCluster::start(config, nodes).await
}

/// `range(n)` with `double = id * 2`, through a map that sleeps `delay_ms` per block, so
/// tasks are running (and leases held) for a while.
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

/// The job succeeded with ids `0..n` in order, each with its double.
async fn assert_exact(cluster: &TestCluster, record: &JobRecord, n: i64) {
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
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

/// Each alive node's leases, by job, as the leader reports them.
async fn leases_by_node(cluster: &TestCluster) -> BTreeMap<NodeId, (Resources, BTreeSet<JobId>)> {
    cluster
        .client()
        .node_reports()
        .await
        .unwrap()
        .into_iter()
        .map(|(node, report)| {
            let jobs = report.leases.iter().map(|summary| summary.job).collect();
            (node, (report.reserved, jobs))
        })
        .collect()
}

/// Every alive node's reservation is back to zero (the leader answers from its own view, so
/// no wait is needed once the jobs ended; a little is allowed for the last returns).
async fn assert_nothing_reserved(cluster: &TestCluster) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let leases = leases_by_node(cluster).await;
        let held: Vec<_> = leases
            .iter()
            .filter(|(_, (reserved, jobs))| *reserved != Resources::default() || !jobs.is_empty())
            .collect();
        if held.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "reservations left after the jobs: {held:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_it_holds_a_lease_leaves_exact_answers_and_no_reservation() {
    let mut cluster = start(3).await;
    let n = 400_000;
    let job = cluster
        .submit(&slow_pipeline(n as u64, 150), JobOptions::default())
        .await;
    let driver = loop {
        if let Some(driver) = cluster.state().await.jobs[&job].driver {
            break driver;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Wait until a node other than the driver's holds a lease of the job, then kill it.
    let deadline = Instant::now() + JOB_TIMEOUT;
    let victim = loop {
        let leased = leases_by_node(&cluster)
            .await
            .into_iter()
            .find(|(node, (reserved, jobs))| {
                *node != driver && jobs.contains(&job) && reserved.cpu_millis > 0
            });
        if let Some((node, _)) = leased {
            break node;
        }
        assert!(
            Instant::now() < deadline,
            "no other node ever held a lease of job {job}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let index = cluster.index_of(victim).await;
    cluster.kill_node(index);
    let record = cluster.wait_for_job(job).await;
    assert_exact(&cluster, &record, n).await;
    let stats = record.stats.clone().unwrap();
    assert_eq!(stats.attempt, 1, "the driver should not have restarted");
    assert!(
        !cluster.state().await.nodes[&victim].is_alive(),
        "the killed node was not committed dead"
    );
    assert!(!leases_by_node(&cluster).await.contains_key(&victim));
    assert_nothing_reserved(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_running_at_once_all_hold_leases_and_finish_with_exact_answers() {
    let cluster = start(2).await;
    let sizes = [300_000u64, 200_000, 100_000];
    let mut jobs = Vec::new();
    for n in sizes {
        jobs.push(
            cluster
                .submit(&slow_pipeline(n, 100), JobOptions::default())
                .await,
        );
    }
    // Watch the leases while the jobs run: every job holds some at one moment or another,
    // and at some moment two jobs hold leases at once (none keeps the cluster to itself).
    let mut leased: BTreeSet<JobId> = BTreeSet::new();
    let mut shared = false;
    let deadline = Instant::now() + JOB_TIMEOUT;
    loop {
        let state = cluster.state().await;
        if jobs.iter().all(|job| state.jobs[job].status.is_finished()) {
            break;
        }
        let holding: BTreeSet<JobId> = leases_by_node(&cluster)
            .await
            .into_values()
            .flat_map(|(_, jobs)| jobs)
            .collect();
        shared |= holding.len() >= 2;
        leased.extend(holding);
        assert!(Instant::now() < deadline, "the jobs did not end in time");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    for (job, n) in jobs.iter().zip(sizes) {
        let record = cluster.wait_for_job(*job).await;
        assert_exact(&cluster, &record, n as i64).await;
    }
    assert_eq!(leased, jobs.iter().copied().collect::<BTreeSet<_>>());
    assert!(shared, "the jobs never held leases at the same time");
    assert_nothing_reserved(&cluster).await;
}
