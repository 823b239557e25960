use std::sync::PoisonError;
use std::time::Duration;

use floe_core::auth::{ClusterSecret, Credential, ReplicaSecret, Scopes, TokensFile};
use floe_core::config::Config;
use floe_core::wire::WireConfig;

use super::*;
use crate::storage::MemoryLog;
use floe_api::client::{HeartbeatReply, SchedulerClient};
use floe_api::placement::{PlacementError, PlacementRequest, Strategy};
use floe_api::scheduler_protocol::{ResourceUsage, WalWrites};
use floe_api::state::{JobOutcome, JobStatus, NodeAddresses, NodeMemory, Resources};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A configuration whose `client.token` is an admin token in the replicas' tokens file.
fn test_config() -> Config {
    let mut config = Config::default();
    config.cluster.secret = ClusterSecret::new("replica-tests");
    config.scheduler.replica_secret = ReplicaSecret::new("replica-tests-replicas");
    let data_dir = tempfile::tempdir().unwrap().keep();
    config.paths.data_dir = data_dir;
    let mut tokens = TokensFile::default();
    config.client.token = tokens
        .create("admin", Scopes::parse("admin").unwrap())
        .unwrap();
    tokens.save(&config.tokens_file()).unwrap();
    config.scheduler.raft_tick_ms = 20;
    config.scheduler.heartbeat_interval_ms = 50;
    config.scheduler.missed_heartbeats = 4;
    config
}

async fn start_cluster(config: &Config, count: u64) -> (Vec<Replica>, SchedulerClient) {
    start_cluster_with_history(config, count, None).await
}

/// Replicas that keep their history files in `history_dir` (`replica-<id>.jsonl`), or none.
async fn start_cluster_with_history(
    config: &Config,
    count: u64,
    history_dir: Option<&std::path::Path>,
) -> (Vec<Replica>, SchedulerClient) {
    let peers: BTreeMap<u64, String> = (1..=count)
        .map(|id| (id, format!("127.0.0.1:{}", free_port())))
        .collect();
    let mut replicas = Vec::new();
    for id in 1..=count {
        let mut replica_config = ReplicaConfig::new(config, id, peers.clone()).unwrap();
        replica_config.history = history_dir.map(|dir| dir.join(format!("replica-{id}.jsonl")));
        let store = MemoryLog::new(peers.keys().copied().collect());
        replicas.push(Replica::start(replica_config, store).await.unwrap());
    }
    let client = SchedulerClient::new(
        peers.values().cloned().collect(),
        WireConfig::client(config),
    )
    .unwrap();
    (replicas, client)
}

/// Registers a node with `replicas` and returns its id and a client that presents its ticket.
async fn register_node(
    config: &Config,
    replicas: &[Replica],
    addresses: NodeAddresses,
    resources: Resources,
) -> (NodeId, SchedulerClient) {
    let (node, wire) = register_node_wire(config, replicas, addresses, resources).await;
    (
        node,
        SchedulerClient::new(addrs_of(replicas), wire).unwrap(),
    )
}

fn addrs_of(replicas: &[Replica]) -> Vec<String> {
    replicas
        .iter()
        .map(|replica| replica.local_addr().to_string())
        .collect()
}

/// Registers a node with `replicas` and returns its id and the wire that presents its ticket.
async fn register_node_wire(
    config: &Config,
    replicas: &[Replica],
    addresses: NodeAddresses,
    resources: Resources,
) -> (NodeId, WireConfig) {
    let member = WireConfig::member(config);
    let mut client = SchedulerClient::new(addrs_of(replicas), member.clone()).unwrap();
    let (node, ticket) = client
        .register_node(
            addresses,
            resources,
            NodeMemory::default(),
            BTreeMap::new(),
            None,
        )
        .await
        .unwrap();
    let as_node = member.with_credential(Credential::Node {
        secret: config.cluster.secret.clone(),
        id: node,
        ticket,
    });
    (node, as_node)
}

fn resources(cpus: u64, heap: u64) -> Resources {
    Resources {
        cpu_millis: cpus * 1000,
        heap_bytes: heap,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proposals_commit_on_every_replica_and_reads_see_them() {
    let config = test_config();
    let (replicas, mut client) = start_cluster(&config, 3).await;
    let mut submitted = Vec::new();
    for n in 0..20u8 {
        match client
            .propose(Command::SubmitJob {
                spec: vec![n],
                submission: floe_core::SubmissionId::random(),
                name: None,
            })
            .await
            .unwrap()
        {
            Outcome::JobSubmitted(job) => submitted.push(job.get()),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(submitted, (1..=20).collect::<Vec<_>>());
    let state = client.read_state().await.unwrap();
    assert_eq!(state.jobs.len(), 20);
    assert_eq!(state.jobs[&floe_core::JobId::new(7)].spec, vec![6]);

    // Every replica applies the same commands exactly once.
    let wire = WireConfig::client(&config);
    for replica in &replicas {
        let addr = replica.local_addr().to_string();
        let mut applied = 0;
        for _ in 0..100 {
            applied = SchedulerClient::status_of(&addr, wire.clone())
                .await
                .unwrap()
                .applied_commands;
            if applied == 20 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(applied, 20, "replica at {addr}");
    }
}

/// A committed command is answered only once the directory heartbeats are answered from
/// holds its effect: a node that registers and heartbeats at once is found alive, not told to
/// rejoin. (CI once saw a node register again 2 ms after it registered.) The loop's turn is
/// driven by hand, step by step, so the check is of the order, not of a race.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commands_answer_waits_for_the_directory_that_holds_its_effect() {
    let config = test_config();
    let peers: BTreeMap<u64, String> = [(1, format!("127.0.0.1:{}", free_port()))].into();
    let replica_config = ReplicaConfig::new(&config, 1, peers).unwrap();
    let (inputs, _unread) = mpsc::channel(16);
    let mut raft_loop = RaftLoop::new(
        &replica_config,
        MemoryLog::new(vec![1]),
        inputs,
        Notices::new(),
        tokio::runtime::Handle::current(),
    )
    .unwrap();
    raft_loop.raw.campaign().unwrap();
    for _ in 0..10 {
        if raft_loop.was_leader {
            break;
        }
        raft_loop.on_ready().unwrap();
    }
    assert!(raft_loop.was_leader, "a single voter leads at once");
    let directory = raft_loop.directory.subscribe();

    let (reply, mut answer) = oneshot::channel();
    raft_loop.handle(Input::Request {
        principal: Principal::Member,
        request: SchedulerRequest::RegisterNode {
            addresses: NodeAddresses {
                rpc: "127.0.0.1:1".into(),
            },
            resources: resources(4, 1 << 30),
            memory: NodeMemory::default(),
            labels: BTreeMap::new(),
            replaces: None,
        },
        reply,
    });
    // `on_ready`'s steps up to the apply: a single voter commits what it persisted.
    let mut ready = raft_loop.raw.ready();
    raft_loop
        .raw
        .mut_store()
        .persist(ready.entries(), ready.hs())
        .unwrap();
    let mut committed = ready.take_committed_entries();
    let mut light = raft_loop.raw.advance(ready);
    committed.extend(light.take_committed_entries());
    raft_loop.apply(committed);
    raft_loop.raw.advance_apply();
    let node = *raft_loop
        .state
        .nodes
        .keys()
        .next()
        .expect("the registration applied");
    assert!(!directory.borrow().nodes.is_alive(node));
    assert!(
        answer.try_recv().is_err(),
        "answered before the directory holds the node"
    );

    raft_loop.publish_directory();
    assert!(directory.borrow().nodes.is_alive(node));
    assert!(
        matches!(
            answer.try_recv(),
            Ok(Ok(SchedulerResponse::Committed(Outcome::NodeRegistered(id)))) if id == node
        ),
        "answered once it does"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_node_is_committed_dead_and_must_rejoin() {
    let config = test_config();
    let (replicas, mut client) = start_cluster(&config, 3).await;
    let addresses = NodeAddresses {
        rpc: "127.0.0.1:1".into(),
    };
    let (quiet, mut quiet_client) =
        register_node(&config, &replicas, addresses.clone(), resources(4, 1 << 30)).await;
    let started = Instant::now();
    let (chatty, mut chatty_client) =
        register_node(&config, &replicas, addresses.clone(), resources(4, 1 << 30)).await;
    let timeout = config.scheduler.node_timeout();
    let usage = ResourceUsage {
        cpu_millis: 1500,
        heap_bytes: 1 << 20,
        object_store_bytes: 7,
        spilled_bytes: 3,
        fallback_bytes: 1,
        workers: 4,
        workers_busy: 2,
        ..ResourceUsage::default()
    };
    let mut deaths = Vec::new();
    while deaths.is_empty() {
        assert_eq!(
            chatty_client.heartbeat(chatty, usage).await.unwrap(),
            HeartbeatReply::Accepted { drivers: vec![] }
        );
        deaths = client
            .watch_deaths(0, config.scheduler.heartbeat_interval())
            .await
            .unwrap();
        assert!(started.elapsed() < timeout * 10, "no death committed");
    }
    assert_eq!(deaths.len(), 1);
    assert_eq!(deaths[0].node, quiet);
    assert!(
        deaths[0].reason.contains("missed 4 heartbeats"),
        "{}",
        deaths[0].reason
    );
    // Not before the timeout, which the leader started when it applied the registration, a
    // moment before `started`.
    assert!(started.elapsed() >= timeout - Duration::from_millis(50));
    // The leader keeps the last report of the node that heartbeats, and nothing of the other.
    let reports = client.node_reports().await.unwrap();
    assert_eq!(reports.keys().copied().collect::<Vec<_>>(), [chatty]);
    assert_eq!(reports[&chatty].usage, usage);
    assert!(reports[&chatty].age_ms < 2 * config.scheduler.heartbeat_interval_ms);
    assert_eq!(
        quiet_client
            .heartbeat(quiet, ResourceUsage::default())
            .await
            .unwrap(),
        HeartbeatReply::Rejoin
    );
    // A node registers again under its old ticket, as the replacement of its dead id: the
    // live node at the same address, which it does not name, stays.
    let (again, _) = quiet_client
        .register_node(
            addresses,
            resources(4, 1 << 30),
            NodeMemory::default(),
            BTreeMap::new(),
            Some(quiet),
        )
        .await
        .unwrap();
    assert!(again > chatty);
    let state = client.read_state().await.unwrap();
    assert!(!state.nodes[&quiet].is_alive());
    assert!(state.nodes[&chatty].is_alive() && state.nodes[&again].is_alive());

    // A live node that registers as its own replacement (an agent told to rejoin by mistake)
    // dies in that commit, as any death: announced, its report and leases gone, its
    // heartbeats answered with a rejoin.
    let (replacement, _) = chatty_client
        .register_node(
            state.nodes[&chatty].addresses.clone(),
            resources(4, 1 << 30),
            NodeMemory::default(),
            BTreeMap::new(),
            Some(chatty),
        )
        .await
        .unwrap();
    let announced = client
        .watch_deaths(deaths[0].index, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(announced.len(), 1, "{announced:?}");
    assert_eq!(announced[0].node, chatty);
    assert_eq!(
        announced[0].reason,
        format!("replaced by node {replacement}, which registered at its address 127.0.0.1:1")
    );
    assert!(!client.node_reports().await.unwrap().contains_key(&chatty));
    assert_eq!(
        chatty_client.heartbeat(chatty, usage).await.unwrap(),
        HeartbeatReply::Rejoin
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_chooses_a_node_and_holds_nothing() {
    let mut config = test_config();
    // Keep the node alive without heartbeats for the length of the test.
    config.scheduler.heartbeat_interval_ms = 10_000;
    let (replicas, _) = start_cluster(&config, 1).await;
    let (node, mut client) = register_node(
        &config,
        &replicas,
        NodeAddresses::default(),
        resources(2, 1 << 30),
    )
    .await;
    let request = PlacementRequest {
        cpu_millis: 2000,
        memory_hint: 1 << 29,
        strategy: Strategy::Default,
        preferred: Vec::new(),
        requester: None,
    };
    client
        .heartbeat(node, ResourceUsage::default())
        .await
        .unwrap();
    // Actors' placements reserve nothing: the same whole-node request is placed again.
    for _ in 0..3 {
        assert_eq!(
            client.place(vec![request.clone()]).await.unwrap(),
            vec![Ok(node)]
        );
    }
    assert_eq!(
        client.node_reports().await.unwrap()[&node].reserved,
        Resources::default()
    );
    let mut too_big = request.clone();
    too_big.cpu_millis = 3000;
    assert!(matches!(
        client.place(vec![too_big]).await.unwrap().as_slice(),
        [Err(PlacementError::Infeasible {
            cpu_millis: 3000,
            largest_cpu_millis: 2000,
            ..
        })]
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drivers_are_placed_on_live_nodes_and_a_dead_drivers_leases_are_revoked() {
    let mut config = test_config();
    // The nodes here send no heartbeats; only the explicit death below may kill one.
    config.scheduler.missed_heartbeats = 200;
    let (replicas, mut client) = start_cluster(&config, 1).await;
    let register = |rpc: &str| (NodeAddresses { rpc: rpc.into() }, resources(1, 1 << 30));
    let (addresses, total) = register("a:1");
    let (worker, worker_client) = register_node(&config, &replicas, addresses, total).await;
    let (addresses, total) = register("b:1");
    let (driver, driver_client) = register_node(&config, &replicas, addresses, total).await;
    let mut nodes = BTreeMap::from([(worker, worker_client), (driver, driver_client)]);
    let job = client
        .submit_job(vec![1], floe_core::SubmissionId::random(), None)
        .await
        .unwrap();
    // Registered but not heard from since: no driver goes to them (a restored state may call
    // a node alive that died while no leader listened).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(client.read_state().await.unwrap().jobs[&job].driver, None);
    for (node, own) in nodes.iter_mut() {
        own.heartbeat(*node, ResourceUsage::default())
            .await
            .unwrap();
    }
    // The leader places the driver on its own; the node hears of it in its heartbeat.
    let deadline = Instant::now() + Duration::from_secs(5);
    let placed_on = loop {
        let state = client.read_state().await.unwrap();
        if let Some(node) = state.jobs[&job].driver {
            break node;
        }
        assert!(Instant::now() < deadline, "no driver was placed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let HeartbeatReply::Accepted { drivers } = nodes
        .get_mut(&placed_on)
        .unwrap()
        .heartbeat(placed_on, ResourceUsage::default())
        .await
        .unwrap()
    else {
        panic!("the driver's node was told to rejoin");
    };
    assert_eq!(drivers, vec![(job, 1)]);

    // The driver leases the only CPU of the other node, then its node dies without
    // returning it.
    let other = if placed_on == worker { driver } else { worker };
    let request = PlacementRequest {
        cpu_millis: 1000,
        memory_hint: 0,
        strategy: Strategy::NodeAffinity {
            node: other,
            soft: false,
        },
        preferred: Vec::new(),
        requester: Some(placed_on),
    };
    let mut driver_client = nodes.remove(&placed_on).unwrap();
    let grants = driver_client
        .acquire_leases(job, vec![request], Duration::from_secs(5))
        .await
        .unwrap();
    assert!(matches!(
        grants.decisions.as_slice(),
        [floe_api::lease::LeaseDecision::Granted(lease)] if lease.node == other
    ));
    assert_eq!(
        client.node_reports().await.unwrap()[&other].reserved,
        resources(1, 0)
    );
    // The driver's node leaves, as a node that stops declares itself gone.
    let outcome = driver_client
        .propose(Command::MarkNodeDead {
            node: placed_on,
            reason: "killed".into(),
        })
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Applied);
    let report = &client.node_reports().await.unwrap()[&other];
    assert_eq!(
        report.reserved,
        Resources::default(),
        "the dead driver's lease stayed"
    );
    assert!(report.leases.is_empty());
    drop(replicas);
}

#[test]
fn peers_parse_and_bad_specs_say_why() {
    let peers = parse_peers("1=127.0.0.1:7701, 2=host-b:7702,3=[::1]:7703").unwrap();
    assert_eq!(
        peers.into_iter().collect::<Vec<_>>(),
        vec![
            (1, "127.0.0.1:7701".to_owned()),
            (2, "host-b:7702".to_owned()),
            (3, "[::1]:7703".to_owned())
        ]
    );
    for (spec, problem) in [
        ("1=a:1,2=b:2", "odd number"),
        ("1=a:1,1=b:2,3=c:3", "appears twice"),
        ("0=a:1", "positive integer"),
        ("1=a", "not host:port"),
        ("1:a:1", "not id=host:port"),
    ] {
        let error = parse_peers(spec).unwrap_err().to_string();
        assert!(error.contains(problem), "{spec}: {error}");
    }
    let config = test_config();
    let peers = parse_peers("1=a:1").unwrap();
    let error = ReplicaConfig::new(&config, 2, peers)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("--id 2 is not one of the replicas"),
        "{error}"
    );
}

/// A log whose writes start failing once `fail` is set, as a full or broken disk would, and
/// wait while the test holds `stall`, as a slow disk would (`stalled` says one waits).
/// `writers` names the threads its writes came from.
struct FaultyLog {
    inner: MemoryLog,
    fail: Arc<std::sync::atomic::AtomicBool>,
    stall: Arc<std::sync::Mutex<()>>,
    stalled: Arc<std::sync::atomic::AtomicBool>,
    writers: Arc<std::sync::Mutex<BTreeSet<String>>>,
}

impl FaultyLog {
    fn new(voters: Vec<u64>) -> Self {
        Self {
            inner: MemoryLog::new(voters),
            fail: Arc::default(),
            stall: Arc::default(),
            stalled: Arc::default(),
            writers: Arc::default(),
        }
    }
}

impl raft::Storage for FaultyLog {
    fn initial_state(&self) -> raft::Result<raft::RaftState> {
        self.inner.initial_state()
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        context: raft::GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        self.inner.entries(low, high, max_size, context)
    }

    fn term(&self, index: u64) -> raft::Result<u64> {
        self.inner.term(index)
    }

    fn first_index(&self) -> raft::Result<u64> {
        self.inner.first_index()
    }

    fn last_index(&self) -> raft::Result<u64> {
        self.inner.last_index()
    }

    fn snapshot(&self, request_index: u64, to: u64) -> raft::Result<Snapshot> {
        self.inner.snapshot(request_index, to)
    }
}

impl LogStore for FaultyLog {
    fn persist(
        &mut self,
        entries: &[Entry],
        hard_state: Option<&raft::prelude::HardState>,
    ) -> Result<Persisted> {
        if entries.is_empty() && hard_state.is_none() {
            // Nothing reaches the disk, so nothing waits on it.
            return self.inner.persist(entries, hard_state);
        }
        let thread = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_owned();
        self.writers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(thread);
        self.stalled
            .store(true, std::sync::atomic::Ordering::SeqCst);
        drop(self.stall.lock().unwrap_or_else(PoisonError::into_inner));
        self.stalled
            .store(false, std::sync::atomic::Ordering::SeqCst);
        if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Error::Io {
                op: "appending to",
                path: "wal".into(),
                source: std::io::Error::other("disk full"),
            });
        }
        self.inner.persist(entries, hard_state)
    }

    fn apply_snapshot(&mut self, snapshot: Snapshot) -> Result<()> {
        self.inner.apply_snapshot(snapshot)
    }

    fn compact(&mut self, snapshot: Snapshot) -> Result<crate::storage::Compacted> {
        self.inner.compact(snapshot)
    }

    fn latest_snapshot(&self) -> &Snapshot {
        self.inner.latest_snapshot()
    }

    fn lost_tail(&self) -> Option<crate::storage::LostTail> {
        self.inner.lost_tail()
    }
}

/// A single replica on `store`, and a client of it that retries for `retry`.
async fn start_alone(
    config: &Config,
    store: FaultyLog,
    retry: Duration,
) -> (Replica, SchedulerClient) {
    let peers: BTreeMap<u64, String> = [(1, format!("127.0.0.1:{}", free_port()))].into();
    let replica = Replica::start(ReplicaConfig::new(config, 1, peers.clone()).unwrap(), store)
        .await
        .unwrap();
    let client = SchedulerClient::new(
        peers.values().cloned().collect(),
        WireConfig::client(config),
    )
    .unwrap()
    .with_retry_for(retry);
    (replica, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_stops_the_replica_with_the_error() {
    let config = test_config();
    let store = FaultyLog::new(vec![1]);
    let fail = Arc::clone(&store.fail);
    let (replica, mut client) = start_alone(&config, store, Duration::from_secs(1)).await;
    client
        .propose(Command::SubmitJob {
            spec: vec![1],
            submission: floe_core::SubmissionId::random(),
            name: None,
        })
        .await
        .unwrap();

    fail.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(
        client
            .propose(Command::SubmitJob {
                spec: vec![2],
                submission: floe_core::SubmissionId::random(),
                name: None,
            })
            .await
            .is_err()
    );
    let stopped = tokio::time::timeout(Duration::from_secs(5), replica.wait())
        .await
        .expect("the replica stops");
    assert!(
        matches!(&stopped, Err(Error::Io { source, .. }) if source.to_string() == "disk full"),
        "{stopped:?}"
    );
}

/// Heartbeats commit nothing, and are answered without the Raft loop: a leader whose disk
/// holds up every write still hears its nodes, so none is declared dead for its disk.
#[allow(
    clippy::await_holding_lock,
    reason = "the held lock is the stalled disk: the log's writes wait on it while the test goes on"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn a_heartbeat_is_answered_while_the_raft_loop_waits_on_its_disk() {
    let config = test_config();
    let peers: BTreeMap<u64, String> = [(1, format!("127.0.0.1:{}", free_port()))].into();
    let store = FaultyLog::new(vec![1]);
    let (stall, stalled) = (Arc::clone(&store.stall), Arc::clone(&store.stalled));
    let replica = Replica::start(ReplicaConfig::new(&config, 1, peers).unwrap(), store)
        .await
        .unwrap();
    let replicas = [replica];
    let (node, mut node_client) = register_node(
        &config,
        &replicas,
        NodeAddresses {
            rpc: "127.0.0.1:1".into(),
        },
        resources(4, 1 << 30),
    )
    .await;
    let mut client = SchedulerClient::new(addrs_of(&replicas), WireConfig::client(&config))
        .unwrap()
        .with_retry_for(Duration::from_secs(30));
    client
        .propose(Command::SubmitJob {
            spec: vec![1],
            submission: floe_core::SubmissionId::random(),
            name: None,
        })
        .await
        .unwrap();
    // The job's driver goes to the node once it has heartbeated.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let reply = node_client
            .heartbeat(node, ResourceUsage::default())
            .await
            .unwrap();
        if matches!(&reply, HeartbeatReply::Accepted { drivers } if drivers.len() == 1) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{reply:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let held = stall.lock().unwrap();
    let submitting = tokio::spawn(async move {
        client
            .propose(Command::SubmitJob {
                spec: vec![2],
                submission: floe_core::SubmissionId::random(),
                name: None,
            })
            .await
    });
    while !stalled.load(std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for _ in 0..3 {
        let reply = tokio::time::timeout(
            Duration::from_secs(10),
            node_client.heartbeat(node, ResourceUsage::default()),
        )
        .await
        .expect("a heartbeat does not wait for the raft loop")
        .unwrap();
        assert!(
            matches!(&reply, HeartbeatReply::Accepted { drivers } if drivers.len() == 1),
            "{reply:?}"
        );
    }
    assert!(
        stalled.load(std::sync::atomic::Ordering::SeqCst),
        "the write was still held up"
    );
    drop(held);
    assert!(matches!(
        submitting.await.unwrap().unwrap(),
        Outcome::JobSubmitted(_)
    ));
}

/// A write the disk holds up is counted as slow and kept with how long it took and when it
/// ended, in the replica's status.
#[allow(
    clippy::await_holding_lock,
    reason = "the held lock is the stalled disk: the log's writes wait on it while the test goes on"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_wal_write_is_reported_with_how_long_it_took_and_when() {
    let config = test_config();
    let store = FaultyLog::new(vec![1]);
    let (stall, stalled) = (Arc::clone(&store.stall), Arc::clone(&store.stalled));
    let (replica, mut client) = start_alone(&config, store, Duration::from_secs(30)).await;
    let submit = |spec: u8| Command::SubmitJob {
        spec: vec![spec],
        submission: floe_core::SubmissionId::random(),
        name: None,
    };
    client.propose(submit(1)).await.unwrap();
    let addr = replica.local_addr().to_string();
    let status = || SchedulerClient::status_of(&addr, WireConfig::client(&config));
    let before = status().await.unwrap().wal_writes;
    assert!(before.writes > 0, "{before:?}");

    let held = stall.lock().unwrap();
    let stalled_from_ms = now_ms();
    let submitting = tokio::spawn(async move { client.propose(submit(2)).await });
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !stalled.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(std::time::Instant::now() < deadline, "the write never came");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let held_for = Duration::from_millis(3 * WalWrites::SLOW_MS);
    tokio::time::sleep(held_for).await;
    drop(held);
    assert!(matches!(
        submitting.await.unwrap().unwrap(),
        Outcome::JobSubmitted(_)
    ));
    let after = status().await.unwrap().wal_writes;
    let until_ms = now_ms();

    assert!(after.writes > before.writes, "{after:?}");
    assert!(
        after.total_us >= before.total_us + micros(held_for),
        "{after:?}"
    );
    assert!(after.slow_writes > before.slow_writes, "{after:?}");
    let held_up = after
        .slow
        .iter()
        .find(|write| write.took_us >= micros(held_for))
        .unwrap_or_else(|| panic!("no slow write of the held length: {after:?}"));
    // It ended after the stall, not when it began.
    let ended_from_ms = stalled_from_ms + 3 * WalWrites::SLOW_MS;
    assert!(
        (ended_from_ms..=until_ms).contains(&held_up.finished_at_ms),
        "{held_up:?} not within {ended_from_ms}..={until_ms}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_replica_stops_serving() {
    let config = test_config();
    let (mut replicas, mut client) = start_cluster(&config, 1).await;
    client
        .propose(Command::SubmitJob {
            spec: vec![],
            submission: floe_core::SubmissionId::random(),
            name: None,
        })
        .await
        .unwrap();
    let addr = replicas[0].local_addr().to_string();
    replicas.clear();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        SchedulerClient::status_of(&addr, WireConfig::client(&config))
            .await
            .is_err()
    );
}

/// The Raft loop writes the log on a thread of its own, never on the runtime's, and owns it:
/// dropping the replica ends the thread, which frees the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_raft_loop_writes_on_its_own_thread_which_ends_with_the_replica() {
    let config = test_config();
    let store = FaultyLog::new(vec![1]);
    let (owned, writers) = (Arc::clone(&store.fail), Arc::clone(&store.writers));
    let (replica, mut client) = start_alone(&config, store, Duration::from_secs(10)).await;
    client
        .submit_job(vec![1], floe_core::SubmissionId::random(), None)
        .await
        .unwrap();
    assert_eq!(
        *writers.lock().unwrap(),
        BTreeSet::from(["raft-1".to_owned()])
    );
    assert!(Arc::strong_count(&owned) > 1, "the loop holds the log");

    drop(replica);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while Arc::strong_count(&owned) > 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the raft thread still holds the log 5 s after the replica was dropped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// CVE-2025-53605's shape (nested start groups) and a message from a peer id that is not a
/// replica, sent as Raft traffic by a peer that passed the handshake as a scheduler: each is
/// refused with the rule it breaks, and the replica goes on committing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_raft_messages_are_refused_and_the_replica_keeps_serving() {
    use floe_core::wire::RpcClient;
    use protobuf::Message as _;

    let config = test_config();
    let (replicas, mut client) = start_cluster(&config, 1).await;
    let addr = replicas[0].local_addr().to_string();
    let mut peer = RpcClient::<SchedulerProtocol>::connect(&addr, WireConfig::replica(&config, 1))
        .await
        .unwrap();
    let stranger = Message {
        from: 9,
        to: 1,
        ..Message::default()
    };
    let cases = [
        (vec![0x0b; 100_000], "group wire type 3"),
        (
            stranger.write_to_bytes().unwrap(),
            "a raft message from 9, which is not a configured replica",
        ),
    ];
    for (bytes, expected) in cases {
        let refused = peer
            .call(&SchedulerRequest::Raft {
                messages: vec![bytes],
            })
            .await
            .unwrap_err();
        match refused {
            floe_core::WireError::Remote(error) => {
                assert_eq!(error.kind, RemoteErrorKind::BadRequest, "{error}");
                assert!(error.message.contains(expected), "{error}");
            }
            other => panic!("expected a refusal, got {other}"),
        }
    }
    let outcome = client
        .propose(Command::SubmitJob {
            spec: vec![1],
            submission: floe_core::SubmissionId::random(),
            name: None,
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::JobSubmitted(_)), "{outcome:?}");
}

/// Raft messages are decoded only from a configured replica that proved the replica secret,
/// and only when they say they come from that replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_messages_come_only_from_configured_replicas_as_themselves() {
    use protobuf::Message as _;

    let config = test_config();
    // Two configured replicas, so replica 2's id passes the raft guard's peer check and only
    // the sender check can refuse replica 1 passing off its message.
    let (replicas, _) = start_cluster(&config, 2).await;
    let addrs = vec![replicas[0].local_addr().to_string()];
    let message = Message {
        from: 2,
        to: 1,
        ..Message::default()
    };
    let encoded = message.write_to_bytes().unwrap();
    let send = |wire: WireConfig, messages: Vec<Vec<u8>>| {
        let addrs = addrs.clone();
        async move {
            SchedulerClient::new(addrs, wire)
                .unwrap()
                .call(&SchedulerRequest::Raft { messages })
                .await
        }
    };
    let refusal = |result: floe_api::Result<SchedulerResponse>| match result {
        Err(floe_api::Error::Wire(floe_core::WireError::Remote(error))) => {
            assert_eq!(error.kind, RemoteErrorKind::Forbidden, "{error}");
            error.message
        }
        other => panic!("not refused: {other:?}"),
    };
    // Replica 7 knows the secret but is not among the peers.
    let stranger = WireConfig::replica(&config, 7);
    let message_7 = refusal(send(stranger, vec![encoded.clone()]).await);
    assert!(
        message_7.contains("replica 7 is not one of the configured replicas"),
        "{message_7}"
    );
    // Replica 1 passing off a message as replica 2's.
    let impostor = WireConfig::replica(&config, 1);
    let message_1 = refusal(send(impostor, vec![encoded]).await);
    assert!(
        message_1.contains("replica 1 sent a raft message from replica 2"),
        "{message_1}"
    );
    // A node never reaches the decoder, even with bytes that are no message at all.
    let member = WireConfig::member(&config);
    let message_m = refusal(send(member, vec![vec![0xff; 32]]).await);
    assert!(
        message_m.contains("only accepted from replicas"),
        "{message_m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_prunes_finished_jobs_and_every_replica_keeps_their_history() {
    let mut config = test_config();
    config.jobs.keep_finished = 1;
    let dir = tempfile::tempdir().unwrap();
    let (replicas, mut client) = start_cluster_with_history(&config, 3, Some(dir.path())).await;
    let (node, node_wire) = register_node_wire(
        &config,
        &replicas,
        NodeAddresses {
            // Nothing listens here: freeing the pruned outputs is tried and retried.
            rpc: format!("127.0.0.1:{}", free_port()),
        },
        resources(4, 1 << 30),
    )
    .await;
    let addrs = addrs_of(&replicas);
    let beating = tokio::spawn({
        let mut client = SchedulerClient::new(addrs.clone(), node_wire.clone()).unwrap();
        async move {
            loop {
                let _ = client.heartbeat(node, ResourceUsage::default()).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let mut driver = SchedulerClient::new(addrs.clone(), node_wire).unwrap();
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut jobs = Vec::new();
    for n in 0..3u8 {
        let job = client
            .submit_job(vec![n], floe_core::SubmissionId::random(), None)
            .await
            .unwrap();
        // The leader starts its driver on the one node.
        let deadline = Instant::now() + Duration::from_secs(5);
        while client
            .watch_job(job, Duration::ZERO)
            .await
            .unwrap()
            .unwrap()
            .status
            != JobStatus::Running
        {
            assert!(Instant::now() < deadline, "job {job} never started");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let outcome = JobOutcome {
            status: JobStatus::Succeeded,
            stats: floe_core::job::JobStats::default(),
            outputs: vec![floe_core::job::OutputBlock {
                object: floe_core::ObjectId::new(u128::from(n) + 1),
                node,
                rows: 1,
                bytes: 8,
            }],
        };
        let finish = Command::FinishJob {
            job,
            attempt: 1,
            outcome,
        };
        assert_eq!(driver.propose(finish).await.unwrap(), Outcome::Applied);
        jobs.push(job);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    let state = loop {
        let state = client.read_state().await.unwrap();
        if state.jobs.len() == 1 {
            break state;
        }
        assert!(Instant::now() < deadline, "{} jobs left", state.jobs.len());
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let kept = &state.jobs[&jobs[2]];
    assert!(
        kept.submitted_at_ms >= before,
        "the leader's clock stamps the submission"
    );
    assert!(kept.ended_at_ms >= kept.started_at_ms && kept.started_at_ms.is_some());
    // The pruned jobs' outputs wait for their node to answer `Free`.
    assert_eq!(
        state.outputs_to_free.keys().copied().collect::<Vec<_>>(),
        jobs[..2]
    );
    // Each replica wrote the summaries as it applied the prune, and answers from its own file.
    for addr in &addrs {
        let mut own =
            SchedulerClient::new(vec![addr.clone()], WireConfig::client(&config)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let history = loop {
            let history = own.job_history(10).await.unwrap();
            if history.len() == 2 || Instant::now() >= deadline {
                break history;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let ids: Vec<_> = history.iter().map(|summary| summary.id).collect();
        assert_eq!(ids, vec![jobs[1], jobs[0]], "replica at {addr}");
        assert!(history.iter().all(
            |summary| summary.removal == floe_api::state::Removal::Pruned
                && summary.release.unwrap().reason == floe_api::state::ReleaseReason::Pruned
        ));
        assert_eq!(own.job_history(1).await.unwrap().len(), 1);
    }
    beating.abort();
    drop(replicas);
}

/// A state past half of `net.max_frame` could no longer be sent to a follower that fell
/// behind (one Raft message), nor read through `ReadState`: once a snapshot measures it past
/// that budget, the leader moves the oldest finished jobs to the history, whatever
/// `jobs.keep_finished` says, and the state fits again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_nearing_the_frame_limit_sends_its_oldest_finished_jobs_to_the_history() {
    let mut config = test_config();
    config.net.max_frame = floe_core::config::ByteSize::mib(1);
    config.jobs.keep_finished = 100_000;
    config.scheduler.snapshot_entries = 20;
    let (replicas, mut client) = start_cluster(&config, 1).await;
    let budget = config.net.max_frame.bytes() / 2;
    // 120 cancelled jobs of 16 KiB each: about 1.9 MiB of state, with no node needed.
    let mut jobs = Vec::new();
    for n in 0..120u32 {
        let spec = n.to_le_bytes().repeat(4096);
        let job = client
            .submit_job(spec, floe_core::SubmissionId::random(), None)
            .await
            .unwrap();
        assert_eq!(
            client.propose(Command::CancelJob { job }).await.unwrap(),
            Outcome::Applied
        );
        jobs.push(job);
    }
    let mut applied = replicas[0].applied_state();
    let deadline = Instant::now() + Duration::from_secs(20);
    let newest = jobs[jobs.len() - 1];
    let state = loop {
        // The published state lags the applied one by up to a publishing interval: one from
        // before the last submissions can fit the budget without any pruning of them.
        let state = Arc::clone(&applied.borrow_and_update());
        let bytes = state.encode().unwrap().len() as u64;
        if bytes <= budget && state.jobs.contains_key(&newest) {
            break state;
        }
        assert!(
            Instant::now() < deadline,
            "{bytes} bytes of state, {} jobs",
            state.jobs.len()
        );
        let _ = tokio::time::timeout(Duration::from_millis(200), applied.changed()).await;
    };
    // The newest stay, the oldest went, and what stays is most of what fits.
    let kept: Vec<JobId> = state.jobs.keys().copied().collect();
    assert!(
        kept.len() >= 16 && kept.len() < jobs.len(),
        "{}",
        kept.len()
    );
    assert_eq!(kept, jobs[jobs.len() - kept.len()..]);
    // Small enough to be read in one frame again.
    let read = client.read_state().await.unwrap();
    assert!(read.jobs.len() <= kept.len());
}

/// A replica's next snapshot copies the pieces of its encoding unchanged since its last one
/// instead of encoding them again: its status says how many bytes it copied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_next_snapshot_copies_the_pieces_unchanged_since_its_last() {
    let mut config = test_config();
    config.scheduler.snapshot_entries = 10;
    let (replicas, mut client) = start_cluster(&config, 1).await;
    let addr = replicas[0].local_addr().to_string();
    let wire = WireConfig::client(&config);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut submitted = 0u64;
    loop {
        for _ in 0..10 {
            client
                .submit_job(vec![1], floe_core::SubmissionId::random(), None)
                .await
                .unwrap();
            submitted += 1;
        }
        let status = SchedulerClient::status_of(&addr, wire.clone())
            .await
            .unwrap();
        if let Some(snapshot) = status.last_snapshot
            && snapshot.reused_bytes > 0
        {
            // Not the jobs submitted since the snapshot before.
            assert!(
                snapshot.reused_bytes < snapshot.bytes,
                "{snapshot:?} after {submitted} jobs"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no snapshot copied a piece: {:?}",
            status.last_snapshot
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

mod leases;

/// Each replica builds one snapshot every `every` entries, at its own points: the three
/// replicas' points are a third of the interval apart, so no two build at once.
#[test]
fn replicas_build_their_snapshots_at_points_a_third_of_the_interval_apart() {
    let voters: BTreeMap<u64, String> = (1..=3).map(|id| (id, format!("r{id}"))).collect();
    let every = 300;
    let mut points_of = Vec::new();
    for id in 1..=3 {
        let schedule = SnapshotSchedule::new(every, id, &voters);
        // Applied one entry at a time, a snapshot taken as soon as one is due.
        let mut snapshot_index = 0;
        let mut points = Vec::new();
        for applied in 1..=3_000 {
            if schedule.due(applied, snapshot_index) {
                snapshot_index = applied;
                points.push(applied);
            }
        }
        points_of.push(points);
    }
    let expected = |offset: u64| -> Vec<u64> {
        (0..=10)
            .map(|k| k * every + offset)
            .filter(|point| (1..=3_000).contains(point))
            .collect()
    };
    assert_eq!(points_of, [expected(0), expected(100), expected(200)]);

    // A snapshot taken late (or installed from the leader) moves the next to the next point,
    // never closer than the schedule's.
    let schedule = SnapshotSchedule::new(every, 2, &voters);
    assert!(!schedule.due(399, 105));
    assert!(schedule.due(400, 105));
    assert!(!schedule.due(699, 400));
    assert!(schedule.due(700, 400));
    // A single replica, and an interval of 0 (taken as 1), still snapshot.
    let alone: BTreeMap<u64, String> = [(7, "r7".to_owned())].into();
    assert!(SnapshotSchedule::new(10, 7, &alone).due(10, 0));
    assert!(SnapshotSchedule::new(0, 7, &alone).due(1, 0));
}

/// The snapshot builder runs below its creator's CPU and I/O priorities, and lowering them
/// leaves every other thread's alone (on Linux both are a thread's).
#[test]
fn the_snapshot_builder_lowers_only_its_own_priority() {
    fn own_priorities() -> (libc::c_int, libc::c_long) {
        // SAFETY: reads the calling thread's priorities; no memory is passed.
        unsafe {
            (
                libc::sched_getscheduler(0),
                libc::syscall(libc::SYS_ioprio_get, IOPRIO_WHO_PROCESS, 0),
            )
        }
    }
    let before = own_priorities();
    let (inherited, lowered) = std::thread::spawn(|| {
        let inherited = own_priorities();
        lower_own_priority();
        (inherited, own_priorities())
    })
    .join()
    .unwrap();
    assert_eq!(inherited, before);
    assert_eq!(lowered.0, SNAPSHOT_POLICY);
    assert_ne!(before.0, lowered.0);
    assert_eq!(lowered.1, libc::c_long::from(SNAPSHOT_IOPRIO));
    assert_ne!(before.1, lowered.1);
    assert_eq!(own_priorities(), before);
}

/// The builder's CPU time counts its own work and not its waits nor other threads': a
/// thread that spins until its clock shows 20 ms, beside another thread spinning, took at
/// least that long in wall time (its clock counts no other thread), and a sleep of 200 ms
/// then adds next to nothing.
#[test]
fn a_threads_cpu_time_counts_its_work_and_not_its_waits() {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let neighbour = std::thread::spawn({
        let stop = Arc::clone(&stop);
        move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        }
    });
    let wall = Instant::now();
    let started = thread_cpu_time();
    let mut turns = 0u64;
    while thread_cpu_time().saturating_sub(started) < Duration::from_millis(20) {
        turns = std::hint::black_box(turns + 1);
        assert!(
            wall.elapsed() < Duration::from_secs(10),
            "the clock did not move"
        );
    }
    let spun = thread_cpu_time().saturating_sub(started);
    assert!(spun <= wall.elapsed(), "{spun:?} in {:?}", wall.elapsed());
    std::thread::sleep(Duration::from_millis(200));
    let slept = thread_cpu_time().saturating_sub(started) - spun;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    neighbour.join().unwrap();
    assert!(slept < Duration::from_millis(5), "{slept:?}");
}
