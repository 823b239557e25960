//! Real floe clusters for a test: `floe scheduler` replicas and `floe node`s started from the
//! binary under test, on loopback, with generated secrets and an admin token, in one
//! temporary directory.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use arrow::record_batch::RecordBatch;
use floe_api::client::SchedulerClient;
use floe_api::node_protocol::{
    ActorDescription, ActorMessage, ActorReply, NodeRequest, NodeResponse, NodeStatus,
};
use floe_api::state::{ClusterState, JobRecord, JobStatus, NodeAddresses, NodeMemory, Resources};
use floe_client::Dataset;
use floe_client::local::{
    LocalCredentials, LocalNode, LocalNodeConfig, LocalSchedulers, LocalSchedulersConfig,
};
use floe_core::auth::Credential;
use floe_core::config::{ByteSize, TlsConfig};
use floe_core::job::{JobOptions, JobSpec};
use floe_core::wire::WireConfig;
use floe_core::{ActorId, JobId, NodeId, SubmissionId};
use std::collections::BTreeMap;

use crate::node;

/// Raft ticks of 30 ms: elections after 0.3–0.6 s keep a suite quick.
pub const FAST_ELECTIONS: &str = "scheduler.raft_tick_ms=30";
/// The heartbeat interval of [`fast_timing`].
pub const HEARTBEAT_MS: u64 = 200;
/// The heartbeats a node may miss before it is dead, in [`fast_timing`].
pub const MISSED_HEARTBEATS: u64 = 5;
/// How long a scheduler may take to elect a leader, and a node to get ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a test job may run.
pub const JOB_TIMEOUT: Duration = Duration::from_secs(120);

/// Fast elections, and heartbeats every [`HEARTBEAT_MS`] with a node dead after
/// [`MISSED_HEARTBEATS`] missed ones: for schedulers and nodes alike (nodes pace their
/// heartbeats by the scheduler's settings).
pub fn fast_timing() -> Vec<String> {
    vec![
        FAST_ELECTIONS.into(),
        format!("scheduler.heartbeat_interval_ms={HEARTBEAT_MS}"),
        format!("scheduler.missed_heartbeats={MISSED_HEARTBEATS}"),
    ]
}

/// The runtime a synchronous test drives its cluster with.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// How a test's processes run.
#[derive(Debug, Clone)]
pub struct TestClusterConfig {
    /// The `floe` binary under test (`env!("CARGO_BIN_EXE_floe")` in the test).
    pub binary: PathBuf,
    /// The cluster's secrets and its admin token (generated).
    pub credentials: LocalCredentials,
    /// Scheduler replicas.
    pub replicas: u64,
    /// `section.key=value` settings of every process, scheduler replicas and nodes alike.
    pub settings: Vec<String>,
    /// Settings of the nodes only, after [`Self::settings`].
    pub node_settings: Vec<String>,
    /// Worker processes per node; a node is ready when all of them are connected.
    pub workers: u32,
    /// The nodes' `net.max_frame`, and the test's own connections' (the default when `None`).
    pub max_frame: Option<ByteSize>,
    /// The members' TLS files (see `floe_core::wire::tls::generate_throwaway`); the test's
    /// own connections use the CA alone, as a user's client does. Default empty: plaintext.
    pub tls: TlsConfig,
}

/// The secrets every cluster of this test process shares, in a directory of their own.
static CREDENTIALS: std::sync::OnceLock<LocalCredentials> = std::sync::OnceLock::new();

/// Removes the shared credentials' directory as the test process exits: a static is never
/// dropped, and each test binary run would otherwise leave a tokens file in the temp dir.
extern "C" fn remove_credentials() {
    if let Some(dir) = CREDENTIALS.get().and_then(|c| c.tokens_file.parent()) {
        // Nothing is left to report a failure to.
        let _ = std::fs::remove_dir_all(dir);
    }
}

impl TestClusterConfig {
    /// One scheduler replica, nodes of two workers, default settings, and the secrets every
    /// cluster of this test process shares (so configs built twice agree).
    pub fn new(binary: impl Into<PathBuf>) -> Self {
        let credentials = CREDENTIALS.get_or_init(|| {
            // The tokens file outlives every cluster of the process; it is removed at exit.
            let dir = tempfile::Builder::new()
                .prefix("floe-test-credentials-")
                .tempdir()
                .unwrap()
                .keep();
            // SAFETY: `remove_credentials` is a plain function that neither unwinds nor
            // calls `exit`, as `atexit` asks.
            let registered = unsafe { libc::atexit(remove_credentials) };
            assert_eq!(registered, 0, "atexit refused the credentials' removal");
            LocalCredentials::generate(&dir).unwrap()
        });
        Self {
            binary: binary.into(),
            credentials: credentials.clone(),
            replicas: 1,
            settings: Vec::new(),
            node_settings: Vec::new(),
            workers: 2,
            max_frame: None,
            tls: TlsConfig::default(),
        }
    }

    /// How the test talks to nodes, as a cluster member (with the cluster secret), with
    /// frames up to [`Self::max_frame`].
    pub fn wire(&self) -> WireConfig {
        self.sized(self.credentials.member_wire().with_tls(&self.tls))
    }

    /// How the test talks to the schedulers, as a client with the admin token.
    pub fn admin_wire(&self) -> WireConfig {
        self.sized(
            self.credentials
                .admin_wire()
                .with_tls(&self.tls.client_only()),
        )
    }

    fn sized(&self, mut wire: WireConfig) -> WireConfig {
        if let Some(max_frame) = self.max_frame {
            wire.max_frame = usize::try_from(max_frame.bytes()).unwrap_or(usize::MAX);
        }
        wire
    }

    /// The admin client token.
    pub fn token(&self) -> &str {
        self.credentials.admin_token.expose()
    }
}

/// Registers a node that is no process with `schedulers`, as a node agent would (with the
/// cluster secret), and returns its id and a client presenting its ticket.
pub async fn register_node(
    schedulers: &LocalSchedulers,
    addresses: NodeAddresses,
    resources: Resources,
) -> (NodeId, SchedulerClient) {
    let credentials = schedulers.credentials();
    let member = credentials.member_wire();
    let mut client = SchedulerClient::new(schedulers.addrs(), member.clone()).unwrap();
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
        secret: credentials.cluster_secret.clone(),
        id: node,
        ticket,
    });
    (
        node,
        SchedulerClient::new(schedulers.addrs(), as_node).unwrap(),
    )
}

/// Starts the scheduler replicas in `dir`, without waiting for a leader.
pub fn start_schedulers(config: &TestClusterConfig, dir: &Path) -> LocalSchedulers {
    LocalSchedulers::start(LocalSchedulersConfig {
        binary: config.binary.clone(),
        replicas: config.replicas,
        dir: dir.to_owned(),
        credentials: config.credentials.clone(),
        settings: config.settings.clone(),
        tls: config.tls.clone(),
    })
    .unwrap()
}

/// Starts node `name` in `dir` against `schedulers`, with `settings` after the configured
/// ones, without waiting for it to be ready.
pub fn start_node(
    config: &TestClusterConfig,
    dir: &Path,
    schedulers: &[String],
    name: &str,
    settings: &[&str],
) -> LocalNode {
    let mut all = vec![format!("node.workers={}", config.workers)];
    if let Some(max_frame) = config.max_frame {
        all.push(format!("net.max_frame={max_frame}"));
    }
    all.extend(config.tls.settings());
    all.extend(config.settings.iter().cloned());
    all.extend(config.node_settings.iter().cloned());
    all.extend(settings.iter().map(|setting| (*setting).to_owned()));
    LocalNode::start(&LocalNodeConfig {
        binary: config.binary.clone(),
        schedulers: schedulers.to_vec(),
        dir: dir.to_owned(),
        name: name.into(),
        credentials: config.credentials.clone(),
        settings: all,
    })
    .unwrap()
}

/// Scheduler replicas and nodes; everything is killed and removed when it drops (fields drop
/// in order: the processes before their directory, so a failing test shows their logs).
pub struct TestCluster {
    /// The nodes [`TestCluster::start`] started, `node-<index>`; a killed one is taken out.
    pub nodes: Vec<Option<LocalNode>>,
    pub schedulers: LocalSchedulers,
    pub config: TestClusterConfig,
    pub dir: tempfile::TempDir,
}

impl TestCluster {
    /// Starts the schedulers, waits for a leader, then starts `nodes` nodes one by one and
    /// waits for each to be ready.
    pub async fn start(config: TestClusterConfig, nodes: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let schedulers = start_schedulers(&config, dir.path());
        schedulers.wait_for_leader(READY_TIMEOUT).await.unwrap();
        let mut cluster = Self {
            nodes: Vec::new(),
            schedulers,
            config,
            dir,
        };
        for index in 0..nodes {
            let node = cluster.start_node(&format!("node-{index}"), &[]);
            cluster.wait_ready(&node).await;
            cluster.nodes.push(Some(node));
        }
        cluster
    }

    /// Starts one more node, `name`, with `settings` besides the configured ones; the test
    /// owns it and waits for it with [`Self::wait_ready`].
    pub fn start_node(&self, name: &str, settings: &[&str]) -> LocalNode {
        let schedulers = self.schedulers.addrs();
        start_node(&self.config, self.dir.path(), &schedulers, name, settings)
    }

    /// Waits until `node` has registered and all its workers are connected.
    pub async fn wait_ready(&self, node: &LocalNode) -> NodeStatus {
        node.wait_ready(&self.wire(), self.config.workers, READY_TIMEOUT)
            .await
            .unwrap()
    }

    /// Node `index` of [`Self::nodes`]; it must not have been killed.
    pub fn node(&self, index: usize) -> &LocalNode {
        self.nodes[index].as_ref().unwrap()
    }

    /// kill -9 of node `index`, once it is gone; it leaves [`Self::nodes`].
    pub fn kill_node(&mut self, index: usize) {
        let mut node = self.nodes[index].take().unwrap();
        node.signal("KILL").unwrap();
        node.wait().unwrap();
    }

    /// Talks to nodes as a cluster member.
    pub fn wire(&self) -> WireConfig {
        self.config.wire()
    }

    /// Talks to the schedulers with the admin token.
    pub fn admin_wire(&self) -> WireConfig {
        self.config.admin_wire()
    }

    pub fn client(&self) -> SchedulerClient {
        self.schedulers.client().unwrap()
    }

    pub async fn state(&self) -> ClusterState {
        self.client().read_state().await.unwrap()
    }

    /// Cache shards the replicated index lists, over every fingerprint and shard count.
    pub async fn indexed_shards(&self) -> usize {
        self.state()
            .await
            .cache
            .values()
            .flat_map(|by_count| by_count.values())
            .map(|entry| entry.shards.len())
            .sum()
    }

    pub async fn node_status(&self, index: usize) -> NodeStatus {
        node::status(self.node(index).addr(), &self.wire()).await
    }

    /// The index in [`Self::nodes`] of the node the scheduler numbered `id`.
    pub async fn index_of(&self, id: NodeId) -> usize {
        for index in 0..self.nodes.len() {
            if self.nodes[index].is_some() && self.node_status(index).await.node == Some(id) {
                return index;
            }
        }
        panic!("no running node is {id}");
    }

    /// Asks node `index` to describe `actor`, wherever it runs.
    pub async fn describe(&self, index: usize, actor: ActorId) -> ActorDescription {
        let request = NodeRequest::CallActor {
            actor,
            message: ActorMessage::Describe,
            forwarded: false,
        };
        match node::call(self.node(index).addr(), &self.wire(), &request).await {
            NodeResponse::Actor(Ok(ActorReply::Described(description))) => description,
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Waits until no node hosts an actor (stopping them is asynchronous).
    pub async fn wait_for_no_actors(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        for index in 0..self.nodes.len() {
            if self.nodes[index].is_none() {
                continue;
            }
            loop {
                let actors = self.node_status(index).await.actors;
                if actors.is_empty() {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "node {index} still hosts {actors:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    /// Submits `dataset` straight to the scheduler (no client library in between).
    pub async fn submit(&self, dataset: &Dataset, options: JobOptions) -> JobId {
        let spec = JobSpec {
            plan: dataset.plan().resolve_seeds().unwrap(),
            options,
        };
        self.client()
            .submit_job(spec.encode().unwrap(), SubmissionId::random(), None)
            .await
            .unwrap()
    }

    /// Waits for `job` to end and returns its record.
    pub async fn wait_for_job(&self, job: JobId) -> JobRecord {
        let deadline = Instant::now() + JOB_TIMEOUT;
        loop {
            let record = JobRecord::clone(&self.state().await.jobs[&job]);
            if record.status.is_finished() {
                return record;
            }
            assert!(
                Instant::now() < deadline,
                "job {job} did not end: {record:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Submits `dataset` and waits for it to succeed.
    pub async fn run(&self, dataset: &Dataset, options: JobOptions) -> JobRecord {
        let job = self.submit(dataset, options).await;
        let record = self.wait_for_job(job).await;
        assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
        record
    }

    /// The job's output rows, fetched from the nodes holding its blocks.
    pub async fn outputs(&self, record: &JobRecord) -> Vec<RecordBatch> {
        self.outputs_with(self.config.token(), record).await
    }

    /// The job's output rows, fetched with client token `token`. The result stays held, so a
    /// test may read it again and no release lands in the state while the test compares it.
    pub async fn outputs_with(&self, token: &str, record: &JobRecord) -> Vec<RecordBatch> {
        let output = self
            .connect_as(token)
            .await
            .job(record.id)
            .wait()
            .await
            .unwrap();
        output.keep();
        output.to_arrow().await.unwrap()
    }

    /// A client library connection to the cluster.
    /// A client library connection to the cluster (over TLS, with the CA alone, when the
    /// cluster runs TLS).
    pub async fn connect(&self) -> floe_client::Client {
        self.connect_as(self.config.token()).await
    }

    /// A client library connection presenting client token `token`.
    pub async fn connect_as(&self, token: &str) -> floe_client::Client {
        floe_client::Client::connect_with(&self.schedulers.addrs(), token, &self.config.tls)
            .await
            .unwrap()
    }
}
