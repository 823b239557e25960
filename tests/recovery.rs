//! Restarts after damage, with real processes: a node SIGKILLed with objects in shared memory
//! and on disk, restarted on the same data directory (and a second node refused there); one
//! restarted at its address, which retires its old id at once; and a scheduler replica
//! restarted after its raft log lost its last 100 bytes.

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use floe_api::node_protocol::{NodeRequest, NodeResponse, TaskKind};
use floe_api::node_protocol::{OutputRef, TaskSpec, TestTask};
use floe_api::state::{ClusterState, Command, Liveness, Outcome};
use floe_client::local::{LocalNode, LocalNodeConfig, LocalSchedulers};
use floe_core::config::ByteSize;
use floe_core::wire::WireConfig;
use floe_core::{NodeId, SubmissionId, TaskId};
use floe_testkit::cluster::{TestClusterConfig, start_schedulers};

const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Replicas with a fast Raft tick, and nodes whose object store is 32 MiB, spilling past 80%
/// in files of 1 MiB.
fn config(replicas: u64) -> TestClusterConfig {
    let mut config = TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"));
    config.replicas = replicas;
    config.settings = vec!["scheduler.raft_tick_ms=30".into()];
    config.node_settings = [
        "memory.total=1GiB",
        "memory.object_store_fraction=0.01",
        "memory.object_store_min=32MiB",
        "memory.min_spilling_size=1MiB",
    ]
    .map(str::to_owned)
    .to_vec();
    config.max_frame = Some(ByteSize::mib(64));
    config
}

fn schedulers(dir: &Path, replicas: u64) -> LocalSchedulers {
    start_schedulers(&config(replicas), dir)
}

fn wire() -> WireConfig {
    config(1).wire()
}

fn start_node(dir: &Path, name: &str, schedulers: &LocalSchedulers) -> LocalNode {
    floe_testkit::cluster::start_node(&config(1), dir, &schedulers.addrs(), name, &[])
}

/// Runs a `Fill` task of `bytes` bytes; its output stays in the node's store.
async fn fill(addr: &str, task: u128, bytes: u64) -> OutputRef {
    let spec = TaskSpec {
        task: TaskId::new(task),
        job: floe_core::JobId::new(1),
        kind: TaskKind::Test(TestTask::Fill { bytes, seed: 1 }),
        inputs: Vec::new(),
    };
    match floe_testkit::node::call(addr, &wire(), &NodeRequest::RunTask(spec)).await {
        NodeResponse::Task {
            result: Ok(done), ..
        } => done.outputs[0].clone(),
        other => panic!("unexpected {other:?}"),
    }
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| entries.map(|entry| entry.unwrap().path()).collect())
        .unwrap_or_default();
    files.sort();
    files
}

fn log_of(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default()
}

async fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_segment_spill_files_and_socket_are_removed_by_the_next_node_on_its_directory()
 {
    let dir = tempfile::tempdir().unwrap();
    let schedulers = schedulers(dir.path(), 1);
    schedulers
        .wait_for_leader(Duration::from_secs(30))
        .await
        .unwrap();
    let data_dir = dir.path().join("node");
    let spill_dir = data_dir.join("spill");

    let mut first = start_node(dir.path(), "node", &schedulers);
    first.wait_ready(&wire(), 2, READY_TIMEOUT).await.unwrap();
    // Six 8 MiB objects in a 32 MiB store: the oldest are spilled.
    for task in 0..6 {
        let output = fill(first.addr(), 100 + task, 8 << 20).await;
        assert_eq!(output.size, 8 << 20);
    }
    let store = floe_testkit::node::status(first.addr(), &wire())
        .await
        .store;
    assert!(store.spilled_objects >= 2, "{store:?}");
    let segment = first.segment();
    let socket = first.worker_socket();
    let spilled = files_in(&spill_dir);
    assert!(!spilled.is_empty() && segment.exists() && socket.exists());

    // A second node on the same directory stops at once, naming the directory and the pid
    // of the node holding it, and touches nothing of it.
    let mut second = start_node(dir.path(), "node", &schedulers);
    assert!(!second.wait().unwrap(), "the second node must fail");
    let log = log_of(dir.path(), "node");
    let refusal = format!(
        "data directory {} is in use by another floe node (pid {})",
        data_dir.display(),
        first.pid()
    );
    assert!(log.contains(&refusal), "{log}");
    assert_eq!(files_in(&spill_dir), spilled);
    assert!(segment.exists() && socket.exists());
    assert_eq!(
        floe_testkit::node::status(first.addr(), &wire())
            .await
            .store,
        store
    );

    // SIGKILL leaves it all behind: the segment, the spill files, the socket.
    first.signal("KILL").unwrap();
    assert!(!first.wait().unwrap());
    assert!(segment.exists(), "{} is gone already", segment.display());
    assert_eq!(files_in(&spill_dir), spilled);
    assert!(socket.exists());

    // The next node on the directory removes them, says so, and works.
    let third = start_node(dir.path(), "node", &schedulers);
    third.wait_ready(&wire(), 2, READY_TIMEOUT).await.unwrap();
    assert!(!segment.exists(), "{} leaked", segment.display());
    assert!(!socket.exists(), "{} leaked", socket.display());
    let left: Vec<&PathBuf> = spilled.iter().filter(|path| path.exists()).collect();
    assert!(left.is_empty(), "spill files leaked: {left:?}");
    let log = log_of(dir.path(), "node");
    assert!(
        log.contains("removed what the killed node before this one on the data directory left"),
        "{log}"
    );
    for path in spilled.iter().chain([&segment, &socket]) {
        assert!(
            log.contains(&path.display().to_string()),
            "{path:?} not logged"
        );
    }
    assert!(third.segment().exists());
    let output = fill(third.addr(), 200, 1 << 20).await;
    assert_eq!(output.size, 1 << 20);
    let record = std::fs::read_to_string(data_dir.join("node.lock")).unwrap();
    assert!(
        record.starts_with(&format!("pid={}\n", third.pid())),
        "{record}"
    );
}

/// A node SIGKILLed and restarted on its data directory at the same address, well inside the
/// node timeout: its new registration names the old id (from the lock record), and the
/// scheduler marks the old id dead in the same commit. Before, the old id stayed "alive" until
/// its heartbeats were missed, at the address the new node serves under another id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_at_its_address_retires_its_old_id_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(1);
    // Dead only after a minute without heartbeats: far longer than this test.
    config.settings.extend([
        "scheduler.heartbeat_interval_ms=1000".to_owned(),
        "scheduler.missed_heartbeats=60".to_owned(),
    ]);
    let schedulers = start_schedulers(&config, dir.path());
    schedulers.wait_for_leader(READY_TIMEOUT).await.unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let node_config = LocalNodeConfig {
        binary: config.binary.clone(),
        schedulers: schedulers.addrs(),
        dir: dir.path().to_owned(),
        name: "node".into(),
        credentials: config.credentials.clone(),
        settings: config
            .settings
            .iter()
            .chain(&config.node_settings)
            .cloned()
            .collect(),
    };
    let lock_record = || std::fs::read_to_string(dir.path().join("node/node.lock")).unwrap();
    let mut client = schedulers.client().unwrap();

    let mut first = LocalNode::start_on(&node_config, port).unwrap();
    first.wait_ready(&wire(), 2, READY_TIMEOUT).await.unwrap();
    let state = client.read_state().await.unwrap();
    let old = only_alive_node(&state);
    assert_eq!(state.nodes[&old].addresses.rpc, first.addr());
    assert!(
        lock_record().contains(&format!("\nnode={}\n", old.get())),
        "{}",
        lock_record()
    );
    first.signal("KILL").unwrap();
    assert!(!first.wait().unwrap());
    assert!(client.read_state().await.unwrap().nodes[&old].is_alive());

    let second = LocalNode::start_on(&node_config, port).unwrap();
    second.wait_ready(&wire(), 2, READY_TIMEOUT).await.unwrap();
    let state = client.read_state().await.unwrap();
    let new = only_alive_node(&state);
    assert_ne!(new, old);
    assert_eq!(state.nodes[&new].addresses.rpc, second.addr());
    match &state.nodes[&old].liveness {
        Liveness::Dead { reason, .. } => assert_eq!(
            *reason,
            format!(
                "replaced by node {new}, which registered at its address {}",
                second.addr()
            )
        ),
        Liveness::Alive => panic!("node {old} is still alive"),
    }
    assert!(
        lock_record().contains(&format!("\nnode={}\n", new.get())),
        "{}",
        lock_record()
    );
}

/// The one alive node of `state`.
fn only_alive_node(state: &ClusterState) -> NodeId {
    let alive: Vec<NodeId> = state.alive_nodes().map(|node| node.id).collect();
    assert_eq!(alive.len(), 1, "{:?}", state.nodes);
    alive[0]
}

/// Submits `count` jobs whose specs are 300 bytes each (so one raft entry is longer than the
/// 100 bytes cut below) and returns their ids.
async fn submit_jobs(schedulers: &LocalSchedulers, first: u8, count: u8) -> Vec<u64> {
    let mut client = schedulers.client().unwrap();
    let mut ids = Vec::new();
    for n in first..first + count {
        let command = Command::SubmitJob {
            spec: vec![n; 300],
            submission: SubmissionId::random(),
            name: None,
        };
        match client.propose(command).await.unwrap() {
            Outcome::JobSubmitted(job) => ids.push(job.get()),
            other => panic!("unexpected {other:?}"),
        }
    }
    ids
}

/// The ids of the jobs replica `id`'s own applied state lists, from its HTTP API.
fn jobs_on(schedulers: &LocalSchedulers, id: u64) -> Vec<String> {
    let addr = schedulers.http_addr(id).unwrap().to_owned();
    let body = floe_testkit::http::get(
        &addr,
        "/api/jobs?limit=1000",
        schedulers.credentials().admin_token.expose(),
    )
    .json();
    let mut ids: Vec<String> = body["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|job| job["id"].as_str().unwrap().to_owned())
        .collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_raft_log_lost_its_last_100_bytes_rejoins_and_catches_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut schedulers = schedulers(dir.path(), 3);
    let leader = schedulers
        .wait_for_leader(Duration::from_secs(30))
        .await
        .unwrap();
    // All three must be up: the test needs the third replica's vote at the end.
    for id in 1..=3 {
        schedulers
            .wait_for_status(id, READY_TIMEOUT, |status| status.leader == Some(leader))
            .await
            .unwrap();
    }
    let before = submit_jobs(&schedulers, 0, 20).await;
    assert_eq!(before, (1..=20).collect::<Vec<_>>());
    let follower = (1..=3).find(|id| *id != leader).unwrap();
    let applied = schedulers.status(leader).await.unwrap().applied;
    schedulers
        .wait_for_status(follower, READY_TIMEOUT, |status| {
            status.commit >= applied && status.applied >= applied
        })
        .await
        .unwrap();

    // The follower acknowledged every entry; its disk now loses the last 100 bytes of them.
    schedulers.kill(follower).unwrap();
    let wal = dir
        .path()
        .join(format!("replica-{follower}"))
        .join("raft")
        .join("wal");
    let len = std::fs::metadata(&wal).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&wal).unwrap();
    file.set_len(len - 100).unwrap();
    drop(file);
    schedulers.start_replica(follower).unwrap();
    let pid = schedulers.pid(follower).unwrap();
    let log_name = format!("replica-{follower}");
    wait_until("the replica says it lost entries", READY_TIMEOUT, || {
        log_of(dir.path(), &log_name).contains("lost raft log entries it had acknowledged")
    })
    .await;

    // The cluster keeps serving meanwhile, and the replica catches up: its state is the
    // leader's, in its status and in what its own HTTP API lists.
    let after = submit_jobs(&schedulers, 20, 10).await;
    assert_eq!(after, (21..=30).collect::<Vec<_>>());
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let leading = schedulers.status(leader).await.unwrap();
        let rejoined = schedulers.status(follower).await;
        if let Ok(rejoined) = &rejoined
            && (rejoined.applied, rejoined.applied_commands, rejoined.commit)
                == (leading.applied, leading.applied_commands, leading.commit)
            && jobs_on(&schedulers, follower).len() == 30
            && jobs_on(&schedulers, follower) == jobs_on(&schedulers, leader)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "replica {follower} did not catch up: {rejoined:?} vs leader {leading:?}\n{}",
            log_of(dir.path(), &log_name)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_until("the replica votes again", READY_TIMEOUT, || {
        log_of(dir.path(), &log_name).contains("it votes again")
    })
    .await;
    // One process all along: it never crashed.
    assert!(
        floe_testkit::process::is_running(pid),
        "replica {follower} (pid {pid}) died"
    );
    assert_eq!(schedulers.pid(follower), Some(pid));
    let log = log_of(dir.path(), &log_name);
    assert!(
        !log.contains("panicked") && !log.contains("out of range"),
        "{log}"
    );

    // It votes again: with the old leader gone, it and the third replica elect a leader,
    // which has every job — none was lost with the bytes.
    schedulers.kill(leader).unwrap();
    let new_leader = schedulers
        .wait_for_leader(Duration::from_secs(30))
        .await
        .unwrap_or_else(|error| {
            let logs: Vec<String> = (1..=3)
                .map(|id| log_of(dir.path(), &format!("replica-{id}")))
                .collect();
            panic!("{error}\n{}", logs.join("\n-----\n"))
        });
    assert_ne!(new_leader, leader);
    let state = schedulers.client().unwrap().read_state().await.unwrap();
    let jobs: Vec<u64> = state.jobs.keys().map(|job| job.get()).collect();
    assert_eq!(jobs, (1..=30).collect::<Vec<_>>());
    for (index, job) in state.jobs.values().enumerate() {
        assert_eq!(job.spec, vec![index as u8; 300], "job {}", job.id);
    }
}
