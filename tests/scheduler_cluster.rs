//! The Raft-replicated scheduler as real `floe scheduler` processes on loopback: failover,
//! restart from disk, snapshots for a lagging replica, and heartbeat loss.

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use floe_api::client::{HeartbeatReply, SchedulerClient};
use floe_api::scheduler_protocol::{ResourceUsage, WalWrites};
use floe_api::state::{Command, NodeAddresses, Outcome, Resources};
use floe_client::local::LocalSchedulers;
use floe_core::JobId;
use floe_testkit::cluster::{FAST_ELECTIONS, TestClusterConfig, register_node, start_schedulers};
use floe_testkit::process::floe_command;

const LEADER_TIMEOUT: Duration = Duration::from_secs(15);

/// Three replicas with fast elections and `settings`, in `dir`.
fn cluster(dir: &tempfile::TempDir, settings: &[&str]) -> LocalSchedulers {
    let mut config = TestClusterConfig {
        replicas: 3,
        settings: vec![FAST_ELECTIONS.to_owned()],
        ..TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"))
    };
    config
        .settings
        .extend(settings.iter().map(|setting| (*setting).to_owned()));
    start_schedulers(&config, dir.path())
}

async fn submit(client: &mut SchedulerClient, plan: u32) -> JobId {
    let command = Command::SubmitJob {
        spec: plan.to_be_bytes().to_vec(),
        submission: floe_core::SubmissionId::random(),
        name: None,
    };
    match client.propose(command).await.unwrap() {
        Outcome::JobSubmitted(job) => job,
        other => panic!("unexpected {other:?}"),
    }
}

/// Every submitted plan is in the state exactly once.
fn assert_jobs(state: &floe_api::state::ClusterState, plans: impl Iterator<Item = u32>) {
    let mut expected: Vec<Vec<u8>> = plans.map(|plan| plan.to_be_bytes().to_vec()).collect();
    let mut found: Vec<Vec<u8>> = state.jobs.values().map(|job| job.spec.clone()).collect();
    expected.sort();
    found.sort();
    assert_eq!(found, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_elects_a_new_one_that_keeps_committed_state() {
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = cluster(&dir, &[]);
    let old_leader = cluster.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let mut client = cluster.client().unwrap();
    let mut acknowledged = BTreeMap::new();
    for plan in 0..10 {
        acknowledged.insert(submit(&mut client, plan).await, plan);
    }

    cluster.kill(old_leader).unwrap();
    let new_leader = cluster.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    assert_ne!(new_leader, old_leader);
    for plan in 10..15 {
        acknowledged.insert(submit(&mut client, plan).await, plan);
    }
    let state = client.read_state().await.unwrap();
    for (job, plan) in &acknowledged {
        assert_eq!(state.jobs[job].spec, plan.to_be_bytes(), "job {job}");
    }
    assert_eq!(state.jobs.len(), 15);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_restart_restores_state_without_applying_anything_twice() {
    let dir = tempfile::tempdir().unwrap();
    // A snapshot every 8 entries, so the restart needs both the snapshot and the log tail.
    let mut cluster = cluster(&dir, &["scheduler.snapshot_entries=8"]);
    cluster.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let mut client = cluster.client().unwrap();
    for plan in 0..20 {
        submit(&mut client, plan).await;
    }
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let applied = cluster.status(leader).await.unwrap().applied;
    for id in 1..=3 {
        // A snapshot is built off the Raft loop, at the lowest CPU priority: it may land a
        // while after the entries it covers are applied.
        let status = cluster
            .wait_for_status(id, LEADER_TIMEOUT, |status| {
                status.applied >= applied && status.snapshot_index > 0
            })
            .await
            .unwrap_or_else(|error| panic!("replica {id} never took a snapshot: {error}"));
        assert_eq!(status.applied_commands, 20);
        // A snapshot it built (not one a lagging follower installed from the leader, which is
        // one record) is a manifest of pieces, which the restart reads back.
        let built = status.last_snapshot.map(|built| built.index);
        if id != leader && built != Some(status.snapshot_index) {
            continue;
        }
        assert_eq!(built, Some(status.snapshot_index), "the leader's snapshot");
        let raft_dir = dir.path().join(format!("replica-{id}/raft"));
        let piece_files = std::fs::read_dir(&raft_dir)
            .unwrap()
            .filter(|entry| {
                let name = entry.as_ref().unwrap().file_name();
                name.to_string_lossy().starts_with("snapshot.pieces.")
            })
            .count();
        assert!(piece_files > 0, "no piece file in {}", raft_dir.display());
    }

    for id in 1..=3 {
        cluster.kill(id).unwrap();
    }
    for id in 1..=3 {
        cluster.start_replica(id).unwrap();
    }
    cluster.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let mut client = cluster.client().unwrap();
    let state = client.read_state().await.unwrap();
    assert_jobs(&state, 0..20);
    assert_eq!(state.applied_commands, 20, "an entry was applied twice");
    assert_eq!(state.next_job_id, 20);
    // And the restarted cluster keeps numbering where it stopped.
    assert_eq!(submit(&mut client, 20).await, JobId::new(21));
    for id in 1..=3 {
        let status = cluster
            .wait_for_status(id, LEADER_TIMEOUT, |status| status.applied_commands >= 21)
            .await
            .unwrap();
        assert_eq!(status.applied_commands, 21, "replica {id}");
    }
}

/// Each replica counts and times the writes its Raft loop makes to its WAL, and keeps only
/// slow ones, each with a time within the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_times_its_wal_writes() {
    let started_ms = now_ms();
    let dir = tempfile::tempdir().unwrap();
    let cluster = cluster(&dir, &[]);
    cluster.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let mut client = cluster.client().unwrap();
    for plan in 0..10 {
        submit(&mut client, plan).await;
    }
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    for id in 1..=3 {
        let status = cluster
            .wait_for_status(id, LEADER_TIMEOUT, |status| status.applied_commands >= 10)
            .await
            .unwrap();
        let writes = &status.wal_writes;
        // The leader appends each submission on its own: each waited for the one before.
        let least = if id == leader { 10 } else { 1 };
        assert!(writes.writes >= least, "replica {id}: {writes:?}");
        assert!(writes.total_us > 0, "replica {id}: {writes:?}");
        assert!(
            writes.slow.len() as u64 <= writes.slow_writes,
            "replica {id}"
        );
        assert!(writes.slow_writes <= writes.writes, "replica {id}");
        for slow in &writes.slow {
            assert!(
                slow.took_us >= WalWrites::SLOW_MS * 1_000,
                "replica {id}: {slow:?}"
            );
            assert!(
                (started_ms..=now_ms()).contains(&slow.finished_at_ms),
                "replica {id}: {slow:?}"
            );
        }
    }
}

fn now_ms() -> u64 {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    u64::try_from(since_epoch.as_millis()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_replica_catches_up_from_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = cluster(&dir, &["scheduler.snapshot_entries=10"]);
    cluster.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let mut client = cluster.client().unwrap();
    submit(&mut client, 0).await;
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let lagging = (1..=3).find(|id| *id != leader).unwrap();
    cluster.kill(lagging).unwrap();

    for plan in 1..50 {
        submit(&mut client, plan).await;
    }
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let leader_status = cluster.status(leader).await.unwrap();
    assert!(
        leader_status.first_index > 2,
        "the leader compacted its log: {leader_status:?}"
    );

    cluster.start_replica(lagging).unwrap();
    let status = cluster
        .wait_for_status(lagging, LEADER_TIMEOUT, |status| {
            status.applied_commands >= 50
        })
        .await
        .unwrap();
    assert_eq!(status.applied_commands, 50);
    // The entries it missed were compacted away on the leader, so it must have been sent
    // a snapshot; its own log starts after it.
    assert!(
        status.snapshot_index >= leader_status.first_index - 1,
        "{status:?}"
    );
    assert!(status.first_index > 2, "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_stops_heartbeating_is_committed_dead_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = cluster(
        &dir,
        &[
            "scheduler.heartbeat_interval_ms=200",
            "scheduler.missed_heartbeats=5",
        ],
    );
    cluster.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let mut client = cluster.client().unwrap();
    let resources = Resources {
        cpu_millis: 4000,
        heap_bytes: 1 << 30,
    };
    let register = |rpc: &str| (NodeAddresses { rpc: rpc.into() }, resources);
    let (addresses, resources) = register("127.0.0.1:9");
    let (quiet, mut quiet_client) = register_node(&cluster, addresses, resources).await;
    let silent_since = Instant::now();
    let (addresses, resources) = register("127.0.0.1:10");
    let (alive, mut alive_client) = register_node(&cluster, addresses, resources).await;

    // The configured timeout is 5 × 200 ms; the leader checks every 200 ms and the death
    // then needs one commit; allow 2 s for that on a loaded machine. (With 3 × 200 ms, the
    // node that does heartbeat was once declared dead too, when the other tests of this
    // binary kept the machine busy.)
    let timeout = Duration::from_millis(1000);
    let mut deaths = Vec::new();
    while deaths.is_empty() {
        assert_eq!(
            alive_client
                .heartbeat(alive, ResourceUsage::default())
                .await
                .unwrap(),
            HeartbeatReply::Accepted { drivers: vec![] }
        );
        deaths = client
            .watch_deaths(0, Duration::from_millis(100))
            .await
            .unwrap();
        assert!(
            silent_since.elapsed() < timeout + Duration::from_secs(2),
            "no death committed after {:?}",
            silent_since.elapsed()
        );
    }
    let detected = silent_since.elapsed();
    // The leader starts the node's clock when it applies the registration, a moment before
    // this client hears of it.
    assert!(
        detected >= timeout - Duration::from_millis(50),
        "declared dead after only {detected:?}"
    );
    assert_eq!(deaths.len(), 1);
    assert_eq!(deaths[0].node, quiet);
    let state = client.read_state().await.unwrap();
    assert!(!state.nodes[&quiet].is_alive());
    assert!(state.nodes[&alive].is_alive());
    assert_eq!(
        quiet_client
            .heartbeat(quiet, ResourceUsage::default())
            .await
            .unwrap(),
        HeartbeatReply::Rejoin
    );
}

#[test]
fn bad_scheduler_arguments_fail_with_the_reason() {
    let run = |args: &[&str], token: Option<&str>| {
        let mut command = floe_command(env!("CARGO_BIN_EXE_floe"));
        command.arg("scheduler").args(args);
        if let Some(token) = token {
            command
                .env("FLOE_CLUSTER_SECRET", token)
                .env("FLOE_SCHEDULER_REPLICA_SECRET", token);
        }
        let output = command.output().unwrap();
        assert!(!output.status.success(), "{args:?} started");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let peers = "1=127.0.0.1:1,2=127.0.0.1:2,3=127.0.0.1:3";
    let stderr = run(&["--id", "1", "--peers", peers], None);
    assert!(stderr.contains("cluster.secret is empty"), "{stderr}");
    let stderr = run(
        &["--id", "1", "--peers", "1=127.0.0.1:1,2=127.0.0.1:2"],
        Some("t"),
    );
    assert!(stderr.contains("use an odd number"), "{stderr}");
    let stderr = run(&["--id", "4", "--peers", peers], Some("t"));
    assert!(
        stderr.contains("--id 4 is not one of the replicas"),
        "{stderr}"
    );
}

/// A lease is given back once: a second return of it (a retried call, or one that arrives
/// after the lease is gone) must not subtract what other leases reserve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_returned_once_however_often_it_is_returned() {
    use floe_api::lease::LeaseDecision;
    use floe_api::placement::{PlacementRequest, Strategy};

    let dir = tempfile::tempdir().unwrap();
    let cluster = cluster(&dir, &["scheduler.heartbeat_interval_ms=200"]);
    cluster.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let mut admin = cluster.client().unwrap();
    let resources = Resources {
        cpu_millis: 4000,
        heap_bytes: 8 << 30,
    };
    let (node, mut client) = register_node(
        &cluster,
        NodeAddresses {
            rpc: "127.0.0.1:9".into(),
        },
        resources,
    )
    .await;
    // The node drives a job, as leases are only for a job's driver.
    let job = submit(&mut admin, 1).await;
    let deadline = Instant::now() + LEADER_TIMEOUT;
    loop {
        client
            .heartbeat(node, ResourceUsage::default())
            .await
            .unwrap();
        if admin.read_state().await.unwrap().jobs[&job].driver == Some(node) {
            break;
        }
        assert!(Instant::now() < deadline, "the node never drove the job");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let request = |memory_hint: u64| PlacementRequest {
        cpu_millis: 1000,
        memory_hint,
        strategy: Strategy::Default,
        preferred: Vec::new(),
        requester: Some(node),
    };
    let grants = client
        .acquire_leases(
            job,
            vec![request(1 << 30), request(2 << 30)],
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let leases: Vec<_> = grants
        .decisions
        .iter()
        .map(|decision| match decision {
            LeaseDecision::Granted(lease) if lease.node == node => *lease,
            other => panic!("{other:?}"),
        })
        .collect();
    let reserved =
        |reports: BTreeMap<floe_core::NodeId, floe_api::scheduler_protocol::NodeReport>| {
            let report = &reports[&node];
            (report.reserved.cpu_millis, report.reserved.heap_bytes)
        };
    assert_eq!(
        reserved(admin.node_reports().await.unwrap()),
        (2000, 3 << 30)
    );

    // The first lease, returned twice: only once counts.
    for _ in 0..2 {
        client.return_leases(job, vec![leases[0].id]).await.unwrap();
    }
    assert_eq!(
        reserved(admin.node_reports().await.unwrap()),
        (1000, 2 << 30)
    );
    client.return_leases(job, vec![leases[1].id]).await.unwrap();
    assert_eq!(reserved(admin.node_reports().await.unwrap()), (0, 0));
}
