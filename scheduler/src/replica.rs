//! One scheduler replica.
//!
//! A single task owns the raft-rs `RawNode` and the [`ClusterState`]; everything else talks
//! to it through one channel: Raft messages from other replicas, client and node requests,
//! and transport reports. Each turn of its loop drains whatever is queued (so proposals that
//! arrive together share one Ready and one fsync), ticks Raft on a timer, and handles the
//! Ready in raft-rs's order: send the leader's messages, install a snapshot, append entries
//! and hard state durably, only then send the messages that required persistence, apply
//! committed entries, advance. A failed write ends the loop with the error, which
//! [`Replica::wait`] returns: a replica that cannot persist must not keep voting. A replica
//! whose log lost entries it had acknowledged stays out of elections until the leader has sent
//! them again (the `standing` module says why, and how it tells).
//!
//! Linearizable reads use ReadIndex: a batch of reads gets one read index, and is answered
//! once the state machine has applied up to it. Heartbeats, resource reservations and the
//! placement queue are the leader's soft state; a node's death is committed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floe_core::config::{Config, SchedulerConfig};
use floe_core::job::JobProgress;
use floe_core::wire::{
    Handler, Peer, PeerKind, RemoteError, RemoteErrorKind, RpcClient, RpcServer, WireConfig, codec,
};
use floe_core::{JobId, NodeId};
use protobuf::Message as _;
use raft::prelude::{Entry, EntryType, Message, MessageType, Snapshot};
use raft::{RawNode, ReadOnlyOption, SnapshotStatus, StateRole};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use self::standing::Standing;
use crate::storage::LogStore;
use crate::{Error, Result};
use floe_api::placement::{
    Decision, PlacementError, PlacementQueue, PlacementRequest, ResourceView,
};
use floe_api::scheduler_protocol::{
    LeaderHint, NodeReport, ReplicaStatus, ResourceUsage, SchedulerProtocol, SchedulerRequest,
    SchedulerResponse,
};
use floe_api::state::{ClusterState, Command, JobRecord, JobStatus, NodeDeath, Outcome};

mod standing;

/// The longest a `WatchDeaths` request may wait, so it stays within the client's read timeout.
const MAX_WATCH_WAIT: Duration = Duration::from_secs(10);
/// Inputs handled per loop turn before Raft gets to tick and produce a Ready.
const MAX_INPUTS_PER_TURN: usize = 4096;
/// Largest batch of Raft messages sent to one peer in one RPC.
const MAX_MESSAGES_PER_SEND: usize = 1024;
/// The least time between two copies of the state published for readers such as the HTTP
/// API; a copy costs a clone of the whole state, so it is not made after every entry.
const PUBLISH_INTERVAL: Duration = Duration::from_millis(250);
/// Pause after a failed send to a peer, so a dead peer costs no busy loop.
const PEER_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Parses `1=host:port,2=host:port,…` into replica id → address.
pub fn parse_peers(spec: &str) -> Result<BTreeMap<u64, String>> {
    let mut peers = BTreeMap::new();
    for part in spec
        .split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
    {
        let (id, addr) = part
            .split_once('=')
            .ok_or_else(|| Error::Peers(format!("{part:?} is not id=host:port")))?;
        let id: u64 =
            id.trim().parse().ok().filter(|id| *id > 0).ok_or_else(|| {
                Error::Peers(format!("replica id {id:?} is not a positive integer"))
            })?;
        let addr = addr.trim();
        port_of(addr)?;
        if peers.insert(id, addr.to_owned()).is_some() {
            return Err(Error::Peers(format!("replica id {id} appears twice")));
        }
    }
    if peers.len() % 2 == 0 {
        return Err(Error::Peers(format!(
            "{} replicas given; use an odd number (3 or 5) so a majority survives failures",
            peers.len()
        )));
    }
    Ok(peers)
}

fn port_of(addr: &str) -> Result<u16> {
    addr.rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .ok_or_else(|| Error::Peers(format!("{addr:?} is not host:port")))
}

/// Everything a replica needs to start.
#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    pub id: u64,
    /// Every replica's address (its own included); it listens on its own entry's port.
    pub peers: BTreeMap<u64, String>,
    pub bind_host: IpAddr,
    pub scheduler: SchedulerConfig,
    pub wire: WireConfig,
}

impl ReplicaConfig {
    pub fn new(config: &Config, id: u64, peers: BTreeMap<u64, String>) -> Result<Self> {
        if !peers.contains_key(&id) {
            return Err(Error::Peers(format!(
                "--id {id} is not one of the replicas {:?}",
                peers.keys().collect::<Vec<_>>()
            )));
        }
        Ok(Self {
            id,
            peers,
            bind_host: config.net.bind_host,
            scheduler: config.scheduler.clone(),
            wire: WireConfig::from_config(config),
        })
    }
}

type Reply = oneshot::Sender<Result<SchedulerResponse, RemoteError>>;

enum Input {
    Raft(Vec<Message>),
    Request {
        request: SchedulerRequest,
        reply: Reply,
    },
    Unreachable(u64),
    SnapshotSent {
        peer: u64,
        status: SnapshotStatus,
    },
}

/// A running replica: its RPC server and its Raft loop. Dropping it stops both.
pub struct Replica {
    local_addr: SocketAddr,
    applied_state: watch::Receiver<Arc<ClusterState>>,
    _server: RpcServer,
    /// Taken by [`Replica::wait`]; aborted on drop otherwise.
    raft_loop: Option<JoinHandle<Result<()>>>,
}

impl Replica {
    /// Binds the replica's address and starts its Raft loop on `store` (a reopened
    /// [`DiskLog`](crate::storage::DiskLog) resumes from where it stopped).
    pub async fn start<S: LogStore>(config: ReplicaConfig, store: S) -> Result<Self> {
        let own = config
            .peers
            .get(&config.id)
            .ok_or_else(|| Error::Peers(format!("no address for replica {}", config.id)))?;
        let bind = SocketAddr::new(config.bind_host, port_of(own)?);
        let (inputs, receiver) = mpsc::channel(MAX_INPUTS_PER_TURN * 4);
        let notices = Notices::new();
        let raft_loop = RaftLoop::new(&config, store, inputs.clone(), notices.clone())?;
        let applied_state = raft_loop.published.subscribe();
        let service = Arc::new(Service { inputs, notices });
        let server = RpcServer::bind::<SchedulerProtocol, _>(bind, service, config.wire).await?;
        let raft_loop = tokio::spawn(raft_loop.run(receiver));
        Ok(Self {
            local_addr: server.local_addr(),
            applied_state,
            _server: server,
            raft_loop: Some(raft_loop),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// This replica's applied state, republished at most every 250 ms while it changes. It
    /// lags the leader by the replication delay: for dashboards, not for decisions.
    pub fn applied_state(&self) -> watch::Receiver<Arc<ClusterState>> {
        self.applied_state.clone()
    }

    /// Resolves when the Raft loop stops, which only a fatal error (a failed write) causes.
    pub async fn wait(mut self) -> Result<()> {
        let Some(raft_loop) = self.raft_loop.take() else {
            return Ok(());
        };
        match raft_loop.await {
            Ok(result) => result,
            Err(error) => Err(Error::RaftTaskPanicked(error.to_string())),
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        // The loop owns the peer senders, so their tasks end with it.
        if let Some(raft_loop) = self.raft_loop.take() {
            raft_loop.abort();
        }
    }
}

/// What the Raft loop announces as it applies commands, for requests that wait on them.
#[derive(Clone)]
struct Notices {
    deaths: broadcast::Sender<NodeDeath>,
    /// The node each committed `StartDriver` names, for nodes watching for their drivers.
    drivers_started: broadcast::Sender<NodeId>,
    /// Jobs that ended (finished or cancelled), for clients waiting on them.
    jobs_ended: broadcast::Sender<JobId>,
}

impl Notices {
    fn new() -> Self {
        Self {
            deaths: broadcast::channel(1024).0,
            drivers_started: broadcast::channel(1024).0,
            jobs_ended: broadcast::channel(1024).0,
        }
    }
}

struct Service {
    inputs: mpsc::Sender<Input>,
    notices: Notices,
}

fn stopped() -> RemoteError {
    RemoteError::new(RemoteErrorKind::Unavailable, "the replica is shutting down")
}

impl Service {
    async fn ask(&self, request: SchedulerRequest) -> Result<SchedulerResponse, RemoteError> {
        let (reply, answer) = oneshot::channel();
        self.inputs
            .send(Input::Request { request, reply })
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

impl Handler<SchedulerProtocol> for Service {
    async fn handle(
        &self,
        peer: Peer,
        request: SchedulerRequest,
    ) -> Result<SchedulerResponse, RemoteError> {
        match request {
            SchedulerRequest::Raft { messages } => {
                if peer.kind != PeerKind::Scheduler {
                    return Err(RemoteError::new(
                        RemoteErrorKind::BadRequest,
                        format!(
                            "raft messages are only accepted from replicas, not {:?}",
                            peer.kind
                        ),
                    ));
                }
                let messages = messages
                    .iter()
                    .map(|bytes| Message::parse_from_bytes(bytes))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|error| {
                        RemoteError::new(
                            RemoteErrorKind::BadRequest,
                            format!("undecodable raft message: {error}"),
                        )
                    })?;
                self.inputs
                    .send(Input::Raft(messages))
                    .await
                    .map_err(|_| stopped())?;
                Ok(SchedulerResponse::RaftAccepted)
            }
            SchedulerRequest::WatchDeaths { after, wait_ms } => {
                // Subscribe before reading, so a death committed in between is not missed.
                let mut published = self.notices.deaths.subscribe();
                let known = self
                    .ask(SchedulerRequest::WatchDeaths { after, wait_ms })
                    .await?;
                if !matches!(&known, SchedulerResponse::Deaths(deaths) if deaths.is_empty()) {
                    return Ok(known);
                }
                let wait = Duration::from_millis(wait_ms).min(MAX_WATCH_WAIT);
                let next = tokio::time::timeout(wait, async {
                    loop {
                        match published.recv().await {
                            Ok(death) if death.index > after => return Ok(vec![death]),
                            Ok(_) => {}
                            // Missed some: the state has them all.
                            Err(broadcast::error::RecvError::Lagged(_)) => {
                                return self
                                    .ask(SchedulerRequest::WatchDeaths { after, wait_ms })
                                    .await
                                    .map(|response| match response {
                                        SchedulerResponse::Deaths(deaths) => deaths,
                                        _ => Vec::new(),
                                    });
                            }
                            Err(broadcast::error::RecvError::Closed) => return Err(stopped()),
                        }
                    }
                })
                .await;
                match next {
                    Ok(deaths) => Ok(SchedulerResponse::Deaths(deaths?)),
                    Err(_) => Ok(SchedulerResponse::Deaths(Vec::new())),
                }
            }
            SchedulerRequest::WatchJob { job, wait_ms } => {
                // Subscribe before reading, so an end committed in between is not missed.
                let mut ended = self.notices.jobs_ended.subscribe();
                let request = SchedulerRequest::WatchJob { job, wait_ms };
                let current = self.ask(request.clone()).await?;
                let running = matches!(&current, SchedulerResponse::Job(Some(record)) if !record.status.is_finished());
                if !running {
                    return Ok(current);
                }
                until_announced(&mut ended, job, wait_ms).await;
                self.ask(request).await
            }
            SchedulerRequest::WatchDrivers {
                node,
                known,
                wait_ms,
            } => {
                // Subscribe before reading, so a driver started in between is not missed.
                let mut started = self.notices.drivers_started.subscribe();
                let request = SchedulerRequest::WatchDrivers {
                    node,
                    known: known.clone(),
                    wait_ms,
                };
                let current = self.ask(request.clone()).await?;
                if !matches!(&current, SchedulerResponse::HeartbeatAccepted { drivers } if *drivers == known)
                {
                    return Ok(current);
                }
                until_announced(&mut started, node, wait_ms).await;
                self.ask(request).await
            }
            request => self.ask(request).await,
        }
    }
}

/// Waits until `announcements` carries `wanted`, at most `wait_ms` (capped by
/// [`MAX_WATCH_WAIT`]). Missed announcements or a closed channel end the wait too: the caller
/// reads the state again either way.
async fn until_announced<T: Clone + PartialEq>(
    announcements: &mut broadcast::Receiver<T>,
    wanted: T,
    wait_ms: u64,
) {
    let wait = Duration::from_millis(wait_ms).min(MAX_WATCH_WAIT);
    let _ = tokio::time::timeout(wait, async {
        while let Ok(announced) = announcements.recv().await {
            if announced == wanted {
                return;
            }
        }
    })
    .await;
}

/// One `Place` request being answered: some requests placed, some waiting in the queue.
struct PlaceBatch {
    results: Vec<Option<Result<NodeId, PlacementError>>>,
    pending: usize,
    reply: Reply,
    /// What was reserved for this batch, returned if the caller is gone when it completes.
    reserved: Vec<Reservation>,
}

/// One placement's reservation, and the node that asked for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reservation {
    node: NodeId,
    cpu_millis: u64,
    memory_hint: u64,
    requester: Option<NodeId>,
}

struct RaftLoop<S: LogStore> {
    id: u64,
    peers: BTreeMap<u64, String>,
    config: SchedulerConfig,
    raw: RawNode<S>,
    /// Whether this replica may vote and campaign (see the `standing` module).
    standing: Standing,
    state: ClusterState,
    senders: BTreeMap<u64, mpsc::UnboundedSender<Message>>,
    notices: Notices,
    was_leader: bool,
    /// Proposals awaiting their commit, keyed by (term proposed in, sequence number); the term
    /// keeps keys unique across restarts, since a restarted replica only leads in a later term.
    proposals: BTreeMap<(u64, u64), Reply>,
    next_proposal: u64,
    reads_unissued: Vec<Reply>,
    reads_issued: BTreeMap<u64, Vec<Reply>>,
    /// Reads whose read index is known, waiting for the state machine to catch up to it.
    reads_ready: Vec<(u64, Vec<Reply>)>,
    next_read: u64,
    view: ResourceView,
    queue: PlacementQueue<(u64, usize, PlacementRequest)>,
    batches: BTreeMap<u64, PlaceBatch>,
    next_batch: u64,
    last_seen: BTreeMap<NodeId, Instant>,
    /// When the health check last ran: a gap of half a node timeout means this replica
    /// itself was stalled (frozen, starved), so the nodes' silence in that gap is not theirs.
    last_health_check: Instant,
    usage: BTreeMap<NodeId, ResourceUsage>,
    /// Nodes whose death has been proposed and not yet applied.
    dying: BTreeSet<NodeId>,
    /// Reservations not yet released, by the node that asked for them: a requester that dies
    /// (a job driver's node) never releases its own, so its death does.
    leases: BTreeMap<NodeId, Vec<Reservation>>,
    /// Pending jobs whose `StartDriver` was proposed, and when; proposed again if it has not
    /// applied after a node timeout (the proposal can be lost with a leader change).
    drivers_proposed: BTreeMap<JobId, Instant>,
    /// What running jobs' drivers last reported (soft state, like heartbeats).
    progress: BTreeMap<JobId, JobProgress>,
    /// A job was submitted since drivers were last placed; place them without waiting for
    /// the health tick.
    jobs_submitted: bool,
    published: watch::Sender<Arc<ClusterState>>,
    last_published: Instant,
}

impl<S: LogStore> RaftLoop<S> {
    fn new(
        config: &ReplicaConfig,
        store: S,
        inputs: mpsc::Sender<Input>,
        notices: Notices,
    ) -> Result<Self> {
        let snapshot = store.latest_snapshot();
        let state = if snapshot.get_metadata().index == 0 {
            ClusterState::default()
        } else {
            ClusterState::decode(&snapshot.data)?
        };
        let raft_config = raft::Config {
            id: config.id,
            election_tick: config.scheduler.election_ticks as usize,
            heartbeat_tick: config.scheduler.heartbeat_ticks as usize,
            // Entries up to the snapshot are in `state`; raft-rs must not hand them out again.
            applied: state.applied_index,
            max_size_per_msg: 1 << 20,
            max_inflight_msgs: 256,
            check_quorum: true,
            pre_vote: true,
            read_only_option: ReadOnlyOption::Safe,
            ..raft::Config::default()
        };
        raft_config.validate()?;
        let standing = Standing::at_start(config.id, store.lost_tail());
        let raw = RawNode::new(&raft_config, store, &crate::logging::raft_logger(config.id))?;
        let senders = config
            .peers
            .iter()
            .filter(|(id, _)| **id != config.id)
            .map(|(id, addr)| {
                let sender =
                    spawn_peer_sender(*id, addr.clone(), config.wire.clone(), inputs.clone());
                (*id, sender)
            })
            .collect();
        let state_copy = state.clone();
        let mut view = ResourceView::new();
        for node in state.alive_nodes() {
            view.upsert_node(node.id, node.resources);
        }
        tracing::info!(
            replica = config.id,
            applied = state.applied_index,
            "raft replica starting"
        );
        Ok(Self {
            id: config.id,
            peers: config.peers.clone(),
            config: config.scheduler.clone(),
            raw,
            standing,
            state,
            senders,
            notices,
            was_leader: false,
            proposals: BTreeMap::new(),
            next_proposal: 0,
            reads_unissued: Vec::new(),
            reads_issued: BTreeMap::new(),
            reads_ready: Vec::new(),
            next_read: 0,
            view,
            queue: PlacementQueue::default(),
            batches: BTreeMap::new(),
            next_batch: 0,
            last_seen: BTreeMap::new(),
            last_health_check: Instant::now(),
            usage: BTreeMap::new(),
            dying: BTreeSet::new(),
            leases: BTreeMap::new(),
            drivers_proposed: BTreeMap::new(),
            progress: BTreeMap::new(),
            jobs_submitted: false,
            published: watch::Sender::new(Arc::new(state_copy)),
            last_published: Instant::now(),
        })
    }

    async fn run(mut self, mut inputs: mpsc::Receiver<Input>) -> Result<()> {
        let mut tick = tokio::time::interval(Duration::from_millis(self.config.raft_tick_ms));
        let mut health = tokio::time::interval(self.config.heartbeat_interval());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                input = inputs.recv() => {
                    let Some(input) = input else { return Ok(()) };
                    self.handle(input);
                    for _ in 1..MAX_INPUTS_PER_TURN {
                        match inputs.try_recv() {
                            Ok(input) => self.handle(input),
                            Err(_) => break,
                        }
                    }
                }
                // A replica out of elections does not let its election timer run.
                _ = tick.tick() => if self.standing.may_campaign() {
                    self.raw.tick();
                },
                _ = health.tick() => self.check_health(),
            }
            self.issue_reads();
            if let Err(error) = self.on_ready() {
                tracing::error!(replica = self.id, %error, "cannot persist the raft log; stopping");
                return Err(error);
            }
            let durable_last = self.raw.store().last_index()?;
            self.standing
                .settle(self.id, self.raw.raft.raft_log.committed, durable_last);
            if std::mem::take(&mut self.jobs_submitted) && self.is_leader() {
                self.place_drivers(Instant::now(), self.config.node_timeout());
            }
            self.publish_state();
        }
    }

    /// Publishes a copy of the state if it changed and the last copy is old enough; the tick
    /// keeps the loop turning, so the last change is published within a tick or two.
    fn publish_state(&mut self) {
        if self.published.borrow().applied_index == self.state.applied_index
            || self.last_published.elapsed() < PUBLISH_INTERVAL
        {
            return;
        }
        self.published.send_replace(Arc::new(self.state.clone()));
        self.last_published = Instant::now();
    }

    fn is_leader(&self) -> bool {
        self.raw.raft.state == StateRole::Leader
    }

    fn leader_hint(&self) -> Option<LeaderHint> {
        let leader = self.raw.raft.leader_id;
        self.peers.get(&leader).map(|addr| LeaderHint {
            id: leader,
            addr: addr.clone(),
        })
    }

    fn not_leader(&self) -> SchedulerResponse {
        SchedulerResponse::NotLeader {
            leader: self.leader_hint(),
        }
    }

    fn handle(&mut self, input: Input) {
        match input {
            Input::Raft(messages) => {
                for message in messages {
                    let last_index = self.raw.raft.raft_log.last_index();
                    let Some(message) = self.standing.screen(self.id, message, last_index) else {
                        continue;
                    };
                    if let Err(error) = self.raw.step(message) {
                        tracing::debug!(replica = self.id, %error, "raft message ignored");
                    }
                }
                let election_timeout = self.config.raft_tick() * self.config.election_ticks;
                if self.standing.nudge_due(Instant::now(), election_timeout) {
                    // Forwarded to the leader; an empty entry applies as nothing.
                    if let Err(error) = self.raw.propose(Vec::new(), Vec::new()) {
                        tracing::debug!(replica = self.id, %error, "no leader to nudge yet");
                    }
                }
            }
            Input::Unreachable(peer) => self.raw.report_unreachable(peer),
            Input::SnapshotSent { peer, status } => self.raw.report_snapshot(peer, status),
            Input::Request { request, reply } => self.handle_request(request, reply),
        }
    }

    fn handle_request(&mut self, request: SchedulerRequest, reply: Reply) {
        match request {
            SchedulerRequest::Status => {
                let status = self.status();
                let _ = reply.send(Ok(SchedulerResponse::Status(status)));
            }
            SchedulerRequest::WatchDeaths { after, .. } => {
                let deaths = self.state.deaths_after(after);
                let _ = reply.send(Ok(SchedulerResponse::Deaths(deaths)));
            }
            _ if !self.is_leader() => {
                let _ = reply.send(Ok(self.not_leader()));
            }
            SchedulerRequest::RegisterNode {
                addresses,
                resources,
                memory,
                labels,
            } => self.propose(
                Command::RegisterNode {
                    addresses,
                    resources,
                    memory,
                    labels,
                },
                Some(reply),
            ),
            SchedulerRequest::Propose(command) => self.propose(command, Some(reply)),
            SchedulerRequest::Heartbeat { node, usage } => {
                let response = if self.state.nodes.get(&node).is_some_and(|n| n.is_alive()) {
                    self.last_seen.insert(node, Instant::now());
                    self.usage.insert(node, usage);
                    SchedulerResponse::HeartbeatAccepted {
                        drivers: self.state.drivers_on(node),
                    }
                } else {
                    SchedulerResponse::Rejoin
                };
                let _ = reply.send(Ok(response));
            }
            SchedulerRequest::WatchJob { job, .. } => {
                let record = self
                    .state
                    .jobs
                    .get(&job)
                    .map(|record| Box::new(JobRecord::clone(record)));
                let _ = reply.send(Ok(SchedulerResponse::Job(record)));
            }
            SchedulerRequest::WatchDrivers { node, .. } => {
                let response = if self.state.nodes.get(&node).is_some_and(|n| n.is_alive()) {
                    SchedulerResponse::HeartbeatAccepted {
                        drivers: self.state.drivers_on(node),
                    }
                } else {
                    SchedulerResponse::Rejoin
                };
                let _ = reply.send(Ok(response));
            }
            SchedulerRequest::ReadState => self.reads_unissued.push(reply),
            SchedulerRequest::NodeReports => {
                let now = Instant::now();
                let reports = self
                    .usage
                    .iter()
                    .filter_map(|(node, usage)| {
                        let seen = self.last_seen.get(node)?;
                        let age = now.duration_since(*seen).as_millis();
                        Some((
                            *node,
                            NodeReport {
                                usage: *usage,
                                reserved: self.view.used(*node).unwrap_or_default(),
                                age_ms: u64::try_from(age).unwrap_or(u64::MAX),
                            },
                        ))
                    })
                    .collect();
                let _ = reply.send(Ok(SchedulerResponse::NodeReports(reports)));
            }
            SchedulerRequest::ReportProgress { job, progress } => {
                let response = match self.state.jobs.get(&job) {
                    Some(record) if record.status == JobStatus::Running => {
                        let cancel = record.cancel_requested;
                        self.progress.insert(job, progress);
                        SchedulerResponse::ProgressAccepted { cancel }
                    }
                    // The job ended or was never here: the driver should stop.
                    _ => SchedulerResponse::ProgressAccepted { cancel: true },
                };
                let _ = reply.send(Ok(response));
            }
            SchedulerRequest::JobProgress { job } => {
                let progress = self.progress.get(&job).cloned();
                let _ = reply.send(Ok(SchedulerResponse::Progress(progress)));
            }
            SchedulerRequest::AllProgress => {
                let progress = self.progress.clone();
                let _ = reply.send(Ok(SchedulerResponse::AllProgress(progress)));
            }
            SchedulerRequest::Place { requests } => self.place(requests, reply),
            SchedulerRequest::Release {
                node,
                cpu_millis,
                memory_hint,
                requester,
            } => {
                self.release(Reservation {
                    node,
                    cpu_millis,
                    memory_hint,
                    requester,
                });
                self.retry_waiting();
                let _ = reply.send(Ok(SchedulerResponse::Released));
            }
            SchedulerRequest::Raft { .. } => {
                let _ = reply.send(Err(RemoteError::new(
                    RemoteErrorKind::BadRequest,
                    "raft messages go through the transport",
                )));
            }
        }
    }

    fn status(&self) -> ReplicaStatus {
        let leader = self.raw.raft.leader_id;
        let store = self.raw.store();
        ReplicaStatus {
            id: self.id,
            leader: (leader != 0).then_some(leader),
            term: self.raw.raft.term,
            commit: self.raw.raft.raft_log.committed,
            applied: self.state.applied_index,
            applied_commands: self.state.applied_commands,
            first_index: store.first_index().unwrap_or(0),
            snapshot_index: store.latest_snapshot().get_metadata().index,
        }
    }

    fn propose(&mut self, command: Command, reply: Option<Reply>) {
        let data = match codec::encode(&command) {
            Ok(data) => data,
            Err(error) => {
                if let Some(reply) = reply {
                    let _ = reply.send(Err(RemoteError::new(
                        RemoteErrorKind::Internal,
                        error.to_string(),
                    )));
                }
                return;
            }
        };
        let term = self.raw.raft.term;
        let context = match &reply {
            Some(_) => {
                self.next_proposal += 1;
                let mut context = term.to_be_bytes().to_vec();
                context.extend_from_slice(&self.next_proposal.to_be_bytes());
                context
            }
            None => Vec::new(),
        };
        match self.raw.propose(context, data) {
            Ok(()) => {
                if let Some(reply) = reply {
                    self.proposals.insert((term, self.next_proposal), reply);
                }
            }
            Err(error) => {
                if let Some(reply) = reply {
                    let _ = reply.send(Err(RemoteError::new(
                        RemoteErrorKind::Unavailable,
                        format!("the proposal was dropped: {error}"),
                    )));
                }
            }
        }
    }

    fn place(&mut self, requests: Vec<PlacementRequest>, reply: Reply) {
        let decisions = self.view.place(&requests);
        let mut batch = PlaceBatch {
            results: Vec::with_capacity(requests.len()),
            pending: 0,
            reply,
            reserved: Vec::new(),
        };
        self.next_batch += 1;
        for (slot, (decision, request)) in decisions.into_iter().zip(requests).enumerate() {
            match decision {
                Ok(Decision::Placed(node)) => {
                    batch.reserved.push(Reservation {
                        node,
                        cpu_millis: request.cpu_millis,
                        memory_hint: request.memory_hint,
                        requester: request.requester,
                    });
                    batch.results.push(Some(Ok(node)));
                }
                Ok(Decision::Wait) => {
                    batch.results.push(None);
                    batch.pending += 1;
                    self.queue
                        .push(request.clone(), (self.next_batch, slot, request));
                }
                Err(error) => batch.results.push(Some(Err(error))),
            }
        }
        self.batches.insert(self.next_batch, batch);
        self.finish_batch(self.next_batch);
    }

    fn retry_waiting(&mut self) {
        if self.queue.is_empty() {
            return;
        }
        for ((batch_id, slot, request), result) in self.queue.retry(&mut self.view) {
            let Some(batch) = self.batches.get_mut(&batch_id) else {
                continue;
            };
            if let Ok(node) = &result {
                batch.reserved.push(Reservation {
                    node: *node,
                    cpu_millis: request.cpu_millis,
                    memory_hint: request.memory_hint,
                    requester: request.requester,
                });
            }
            batch.results[slot] = Some(result);
            batch.pending -= 1;
            self.finish_batch(batch_id);
        }
    }

    fn finish_batch(&mut self, batch_id: u64) {
        if self
            .batches
            .get(&batch_id)
            .is_none_or(|batch| batch.pending > 0)
        {
            return;
        }
        let Some(batch) = self.batches.remove(&batch_id) else {
            return;
        };
        let results = batch.results.into_iter().flatten().collect();
        if batch
            .reply
            .send(Ok(SchedulerResponse::Placements(results)))
            .is_err()
        {
            // The caller gave up waiting; nothing will run on what was reserved for it.
            for reservation in batch.reserved {
                self.view.release(
                    reservation.node,
                    reservation.cpu_millis,
                    reservation.memory_hint,
                );
            }
            self.retry_waiting();
            return;
        }
        for reservation in batch.reserved {
            if let Some(requester) = reservation.requester {
                self.leases.entry(requester).or_default().push(reservation);
            }
        }
    }

    /// Gives back what a placed task reserved. A requester's reservation is given back once,
    /// while this leader still holds its lease: after a leader change (the view is rebuilt
    /// without it) or the requester's death (its leases went with it), a late release must not
    /// subtract what other tasks reserved.
    fn release(&mut self, reservation: Reservation) {
        if let Some(requester) = reservation.requester {
            let Some(leases) = self.leases.get_mut(&requester) else {
                return;
            };
            let Some(position) = leases.iter().position(|lease| *lease == reservation) else {
                return;
            };
            leases.swap_remove(position);
        }
        self.view.release(
            reservation.node,
            reservation.cpu_millis,
            reservation.memory_hint,
        );
    }

    fn issue_reads(&mut self) {
        if self.reads_unissued.is_empty() || !self.is_leader() {
            return;
        }
        // raft-rs ignores a read index until the leader has committed an entry of its term.
        let log = &self.raw.raft.raft_log;
        if log.term(log.committed).ok() != Some(self.raw.raft.term) {
            return;
        }
        self.next_read += 1;
        self.raw.read_index(self.next_read.to_be_bytes().to_vec());
        let batch = std::mem::take(&mut self.reads_unissued);
        self.reads_issued.insert(self.next_read, batch);
    }

    fn send(&mut self, messages: Vec<Message>) {
        for message in messages {
            match self.senders.get(&message.to) {
                Some(sender) => {
                    // The sender only stops with the runtime; Raft retransmits anything lost.
                    let _ = sender.send(message);
                }
                None => tracing::warn!(to = message.to, "raft message for an unknown replica"),
            }
        }
    }

    fn on_ready(&mut self) -> Result<()> {
        if !self.raw.has_ready() {
            self.serve_reads();
            return Ok(());
        }
        let mut ready = self.raw.ready();
        // A leader may send before persisting (Raft thesis 10.2.1); these are those messages.
        let messages = ready.take_messages();
        self.send(messages);
        if !ready.snapshot().is_empty() {
            let snapshot = ready.snapshot().clone();
            self.raw.mut_store().apply_snapshot(snapshot.clone())?;
            self.restore(&snapshot)?;
        }
        self.raw.mut_store().persist(ready.entries(), ready.hs())?;
        // Votes and follower acknowledgements promise what is now on disk, and no earlier.
        let persisted = ready.take_persisted_messages();
        self.send(persisted);
        for read in ready.take_read_states() {
            let Some(id) = read
                .request_ctx
                .first_chunk::<8>()
                .map(|id| u64::from_be_bytes(*id))
            else {
                continue;
            };
            if let Some(replies) = self.reads_issued.remove(&id) {
                self.reads_ready.push((read.index, replies));
            }
        }
        let committed = ready.take_committed_entries();
        self.apply(committed);
        let mut light = self.raw.advance(ready);
        let messages = light.take_messages();
        self.send(messages);
        let committed = light.take_committed_entries();
        self.apply(committed);
        self.raw.advance_apply();
        self.on_role_change();
        self.serve_reads();
        self.maybe_compact()
    }

    fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        let before = self.state.applied_index;
        self.state = ClusterState::decode(&snapshot.data)?;
        tracing::info!(
            replica = self.id,
            index = self.state.applied_index,
            "installed a snapshot from the leader"
        );
        self.rebuild_view();
        for death in self.state.deaths_after(before) {
            let _ = self.notices.deaths.send(death);
        }
        Ok(())
    }

    fn rebuild_view(&mut self) {
        self.view = ResourceView::new();
        for node in self.state.alive_nodes() {
            self.view.upsert_node(node.id, node.resources);
        }
    }

    fn apply(&mut self, entries: Vec<Entry>) {
        for entry in entries {
            if entry.data.is_empty() || entry.get_entry_type() != EntryType::EntryNormal {
                // Empty entries mark a new leader's term; membership is fixed at bootstrap.
                self.state.skip(entry.index);
                continue;
            }
            let command: Command = match codec::decode(&entry.data, "raft command") {
                Ok(command) => command,
                Err(error) => {
                    // Every replica decodes the same bytes the same way, so skipping is
                    // deterministic; it can only come from a release with another codec.
                    tracing::error!(index = entry.index, %error, "skipping an undecodable entry");
                    self.state.skip(entry.index);
                    continue;
                }
            };
            let effect = match &command {
                Command::RegisterNode { resources, .. } => Effect::Registered(*resources),
                Command::MarkNodeDead { node, .. } => Effect::Died(*node),
                Command::SubmitJob { .. } => Effect::Submitted,
                Command::StartDriver { job, node } => Effect::DriverStarted(*job, *node),
                Command::FinishJob { job, .. } => Effect::JobEnded(*job),
                Command::CancelJob { job } => Effect::JobCancelled(*job),
                _ => Effect::None,
            };
            let Some(outcome) = self.state.apply(entry.index, command) else {
                continue;
            };
            match (effect, &outcome) {
                (Effect::Registered(resources), Outcome::NodeRegistered(node)) => {
                    self.view.upsert_node(*node, resources);
                    self.retry_waiting();
                }
                (Effect::Died(node), Outcome::Applied) => {
                    self.dying.remove(&node);
                    for lease in self.leases.remove(&node).unwrap_or_default() {
                        self.view
                            .release(lease.node, lease.cpu_millis, lease.memory_hint);
                    }
                    self.last_seen.remove(&node);
                    self.usage.remove(&node);
                    self.view.remove_node(node);
                    self.retry_waiting();
                    if let Some(death) = self.state.deaths_after(entry.index - 1).pop() {
                        tracing::warn!(node = %death.node, reason = %death.reason, "node committed dead");
                        let _ = self.notices.deaths.send(death);
                    }
                }
                (Effect::Died(node), _) => {
                    self.dying.remove(&node);
                }
                (Effect::Submitted, _) => self.jobs_submitted = true,
                (Effect::DriverStarted(job, node), outcome) => {
                    self.drivers_proposed.remove(&job);
                    if *outcome == Outcome::Applied {
                        // No one listening is fine: the node's heartbeat carries it too.
                        let _ = self.notices.drivers_started.send(node);
                    }
                }
                (Effect::JobEnded(job), Outcome::Applied) => {
                    self.progress.remove(&job);
                    let _ = self.notices.jobs_ended.send(job);
                }
                // A pending job ends at once; a running one when its driver finishes it.
                (Effect::JobCancelled(job), Outcome::Applied)
                    if self
                        .state
                        .jobs
                        .get(&job)
                        .is_some_and(|j| j.status.is_finished()) =>
                {
                    let _ = self.notices.jobs_ended.send(job);
                }
                _ => {}
            }
            if let Some(seq) = entry.context.get(8..16).and_then(|seq| seq.try_into().ok()) {
                let key = (entry.term, u64::from_be_bytes(seq));
                if let Some(reply) = self.proposals.remove(&key) {
                    let _ = reply.send(Ok(SchedulerResponse::Committed(outcome)));
                }
            }
        }
    }

    fn serve_reads(&mut self) {
        let applied = self.state.applied_index;
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.reads_ready)
            .into_iter()
            .partition(|(index, _)| *index <= applied);
        self.reads_ready = waiting;
        for (_, replies) in ready {
            for reply in replies {
                let _ = reply.send(Ok(SchedulerResponse::State(Box::new(self.state.clone()))));
            }
        }
    }

    /// Gaining leadership starts soft state afresh; losing it fails everything that needed
    /// the leader, so callers retry at the new one.
    fn on_role_change(&mut self) {
        let leader = self.is_leader();
        if leader == self.was_leader {
            return;
        }
        self.was_leader = leader;
        tracing::info!(
            replica = self.id,
            leader,
            term = self.raw.raft.term,
            "raft role changed"
        );
        self.last_seen.clear();
        self.usage.clear();
        self.dying.clear();
        self.leases.clear();
        self.drivers_proposed.clear();
        self.progress.clear();
        self.rebuild_view();
        if leader {
            return;
        }
        for (_, reply) in std::mem::take(&mut self.proposals) {
            let _ = reply.send(Err(RemoteError::new(
                RemoteErrorKind::Unavailable,
                "leadership changed before the command committed; it may or may not have been \
                 applied",
            )));
        }
        let hint = self.not_leader();
        let reads = std::mem::take(&mut self.reads_unissued)
            .into_iter()
            .chain(
                std::mem::take(&mut self.reads_issued)
                    .into_values()
                    .flatten(),
            )
            .chain(
                std::mem::take(&mut self.reads_ready)
                    .into_iter()
                    .flat_map(|(_, r)| r),
            );
        for reply in reads {
            let _ = reply.send(Ok(hint.clone()));
        }
        self.queue = PlacementQueue::default();
        for (_, batch) in std::mem::take(&mut self.batches) {
            let _ = batch.reply.send(Ok(hint.clone()));
        }
    }

    /// The leader commits the death of every node silent for longer than the node timeout.
    /// A node first seen now (new registration, or this replica just became leader) gets a
    /// full timeout from now: death needs silence to the current leader. So does every node
    /// after this replica stalled for over half a node timeout (SIGSTOP, a paused VM): it
    /// could not hear anyone then, and it may not even be the leader any more.
    fn check_health(&mut self) {
        let now = Instant::now();
        let stalled = now.duration_since(self.last_health_check) > self.config.node_timeout() / 2;
        self.last_health_check = now;
        if !self.is_leader() {
            return;
        }
        if stalled {
            tracing::warn!(
                replica = self.id,
                "this replica was stalled; every node gets a full timeout from now"
            );
            self.last_seen.clear();
        }
        let timeout = self.config.node_timeout();
        let mut silent = Vec::new();
        for node in self.state.alive_nodes() {
            let last = *self.last_seen.entry(node.id).or_insert(now);
            if now.duration_since(last) > timeout && !self.dying.contains(&node.id) {
                silent.push(node.id);
            }
        }
        for node in silent {
            self.dying.insert(node);
            let reason = format!(
                "missed {} heartbeats ({} ms without one)",
                self.config.missed_heartbeats,
                timeout.as_millis()
            );
            tracing::warn!(%node, %reason, "proposing node death");
            self.propose(Command::MarkNodeDead { node, reason }, None);
        }
        self.place_drivers(now, timeout);
    }

    /// Starts a driver for every pending job on the least utilized alive node (drivers are
    /// light; the work they start is placed task by task).
    fn place_drivers(&mut self, now: Instant, retry_after: Duration) {
        let pending: Vec<JobId> = self
            .state
            .jobs
            .values()
            .filter(|job| job.status == JobStatus::Pending)
            .map(|job| job.id)
            .collect();
        for job in pending {
            if self
                .drivers_proposed
                .get(&job)
                .is_some_and(|proposed| now.duration_since(*proposed) < retry_after)
            {
                continue;
            }
            let Some(node) = self
                .state
                .alive_nodes()
                .filter(|node| !self.dying.contains(&node.id))
                .min_by(|a, b| {
                    let load = |id| self.view.utilization(id).unwrap_or(f64::MAX);
                    load(a.id).total_cmp(&load(b.id))
                })
                .map(|node| node.id)
            else {
                return;
            };
            tracing::info!(%job, %node, "placing a job driver");
            self.drivers_proposed.insert(job, now);
            self.propose(Command::StartDriver { job, node }, None);
        }
    }

    fn maybe_compact(&mut self) -> Result<()> {
        let applied = self.state.applied_index;
        let snapshot_index = self.raw.store().latest_snapshot().get_metadata().index;
        if applied < snapshot_index + self.config.snapshot_entries {
            return Ok(());
        }
        let mut snapshot = Snapshot {
            data: self.state.encode()?.into(),
            ..Snapshot::default()
        };
        let meta = snapshot.mut_metadata();
        meta.index = applied;
        meta.term = self.raw.raft.raft_log.term(applied)?;
        meta.set_conf_state(self.raw.store().initial_state()?.conf_state);
        self.raw.mut_store().compact(snapshot)?;
        tracing::info!(
            replica = self.id,
            index = applied,
            "snapshot taken, log compacted"
        );
        Ok(())
    }
}

enum Effect {
    Registered(floe_api::state::Resources),
    Died(NodeId),
    Submitted,
    DriverStarted(JobId, NodeId),
    JobEnded(JobId),
    JobCancelled(JobId),
    None,
}

/// Starts the task that carries Raft messages to one peer, batching whatever is queued into
/// one RPC. Failures are reported to Raft (which retransmits) and paced by a short pause.
fn spawn_peer_sender(
    peer: u64,
    addr: String,
    wire: WireConfig,
    inputs: mpsc::Sender<Input>,
) -> mpsc::UnboundedSender<Message> {
    let (sender, mut queue) = mpsc::unbounded_channel::<Message>();
    tokio::spawn(async move {
        let mut client: Option<RpcClient<SchedulerProtocol>> = None;
        while let Some(first) = queue.recv().await {
            let mut batch = vec![first];
            while batch.len() < MAX_MESSAGES_PER_SEND {
                match queue.try_recv() {
                    Ok(message) => batch.push(message),
                    Err(_) => break,
                }
            }
            let has_snapshot = batch
                .iter()
                .any(|message| message.get_msg_type() == MessageType::MsgSnapshot);
            let sent = send_batch(&mut client, &addr, &wire, &batch).await;
            if has_snapshot {
                let status = if sent.is_ok() {
                    SnapshotStatus::Finish
                } else {
                    SnapshotStatus::Failure
                };
                if inputs
                    .send(Input::SnapshotSent { peer, status })
                    .await
                    .is_err()
                {
                    return;
                }
            }
            if let Err(error) = sent {
                tracing::debug!(peer, %addr, %error, "cannot reach replica");
                client = None;
                if inputs.send(Input::Unreachable(peer)).await.is_err() {
                    return;
                }
                tokio::time::sleep(PEER_RETRY_PAUSE).await;
                // What queued up meanwhile is stale; Raft resends what still matters, but it
                // must hear that a snapshot was dropped or it would wait for it forever.
                let mut dropped_snapshot = false;
                while let Ok(message) = queue.try_recv() {
                    dropped_snapshot |= message.get_msg_type() == MessageType::MsgSnapshot;
                }
                if dropped_snapshot {
                    let status = SnapshotStatus::Failure;
                    if inputs
                        .send(Input::SnapshotSent { peer, status })
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
    });
    sender
}

async fn send_batch(
    client: &mut Option<RpcClient<SchedulerProtocol>>,
    addr: &str,
    wire: &WireConfig,
    batch: &[Message],
) -> Result<()> {
    let messages = batch
        .iter()
        .map(|message| {
            message.write_to_bytes().map_err(|error| Error::Protobuf {
                what: "message",
                message: error.to_string(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let connected = match client {
        Some(client) => client,
        None => client.insert(RpcClient::connect(addr, wire.clone(), PeerKind::Scheduler).await?),
    };
    connected.call(&SchedulerRequest::Raft { messages }).await?;
    Ok(())
}

#[cfg(test)]
mod tests;
