//! One scheduler replica.
//!
//! A single loop owns the raft-rs `RawNode` and the [`ClusterState`], on a thread of its own
//! (a current-thread runtime): the WAL's `fsync` then blocks nothing else, and a proposal or
//! a peer's acknowledgement wakes it at once instead of waiting its turn behind the RPC
//! front's tasks. The network work it starts (peer senders, calls to nodes) runs on the
//! replica's runtime. Everything else talks to it through one channel: Raft messages from
//! other replicas, client and node requests, and transport reports. Each turn of its loop
//! drains whatever is queued (so proposals that arrive together share one Ready and one
//! fsync), ticks Raft on a timer, and handles the Ready in raft-rs's order: send the
//! leader's messages, install a snapshot, append entries and hard state durably, only then
//! send the messages that required persistence, apply committed entries, advance. A failed
//! write ends the loop with the error, which [`Replica::wait`] returns: a replica that cannot
//! persist must not keep voting. A replica whose log lost entries it had acknowledged stays
//! out of elections until the leader has sent them again (the `standing` module says why,
//! and how it tells).
//!
//! Linearizable reads use ReadIndex: a batch of reads gets one read index, and is answered
//! once the state machine has applied up to it. Heartbeats, jobs' placement leases and the
//! placement queue are the leader's soft state; a node's death is committed. Heartbeats do
//! not enter the loop at all: the RPC front answers them (the `heartbeats` module says how).
//!
//! The files by concern: this one starts the replica and runs the loop (ticks, Ready handling,
//! proposals, apply, role changes, compaction); `service` is the RPC front and the loop's
//! answers to requests; `heartbeats` the soft state heartbeats are recorded in and answered
//! from; `placement` places actors and grants jobs' leases; `health`
//! decides node deaths and places job drivers; `lifecycle` lets go of what finished jobs and
//! dead nodes leave behind; `transport` carries Raft messages to peers; `config` is what a
//! replica starts with; `standing` decides whether it may vote; `raft_guard` checks a peer's
//! Raft message before protobuf parses it; `wal_writes` times the loop's WAL writes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use floe_core::auth::Principal;
use floe_core::config::{JobsConfig, NodesConfig, SchedulerConfig};
use floe_core::job::JobProgress;
use floe_core::wire::{RemoteError, RemoteErrorKind, RpcServer, codec};
use floe_core::{JobId, NodeId};
use raft::prelude::{Entry, EntryType, Message, Snapshot};
use raft::{GetEntriesContext, RawNode, ReadOnlyOption, SnapshotStatus, StateRole};
use tokio::sync::{broadcast, mpsc, oneshot, watch};

use self::config::port_of;
use self::heartbeats::{Beats, Directory};
use self::placement::{LeaseAsks, PlaceBatch};
use self::raft_guard::RaftGuard;
use self::service::Service;
use self::standing::Standing;
use self::transport::spawn_peer_sender;
use self::wal_writes::WalWriteTimes;
use crate::history::HistoryWriter;
use crate::storage::{LogStore, Persisted, SnapshotPiece};
use crate::{Error, Result};
use floe_api::lease::LeaseTable;
use floe_api::placement::PlacementQueue;
use floe_api::scheduler_protocol::{
    SchedulerProtocol, SchedulerRequest, SchedulerResponse, SnapshotTiming,
};
use floe_api::state::{
    ClusterState, Command, EncodedState, Liveness, LoggedCommand, NodeDeath, Outcome,
};
use floe_core::wire::WireConfig;

mod config;
mod health;
mod heartbeats;
mod lifecycle;
mod placement;
mod raft_guard;
mod service;
mod standing;
mod transport;
mod wal_writes;

pub use self::config::{ReplicaConfig, parse_peers};

/// Inputs handled per loop turn before Raft gets to tick and produce a Ready.
const MAX_INPUTS_PER_TURN: usize = 4096;
/// The least time between two copies of the state published for readers such as the HTTP
/// API. A copy is O(1) (the state's maps are persistent), but each one makes the next writes
/// copy the paths they touch, so it is not made after every entry.
const PUBLISH_INTERVAL: Duration = Duration::from_millis(250);

type Reply = oneshot::Sender<Result<SchedulerResponse, RemoteError>>;

enum Input {
    Raft(Vec<Message>),
    Request {
        /// Who sent it, as the handshake verified; the loop authorizes against its state.
        principal: Principal,
        request: SchedulerRequest,
        reply: Reply,
    },
    /// A command of the leader's own housekeeping (a task it spawned reporting back): no peer
    /// sent it, so there is nobody to authorize.
    Housekeeping(Command),
    /// A node's first heartbeat to this leader, recorded by the RPC front.
    Heard(NodeId),
    Unreachable(u64),
    SnapshotSent {
        peer: u64,
        status: SnapshotStatus,
    },
    /// A snapshot built off the Raft loop (see [`RaftLoop::maybe_compact`]), and what it was
    /// built from.
    SnapshotBuilt(Box<Result<BuiltSnapshot>>, Box<SnapshotSource>),
}

/// What a snapshot is built from, copied on the Raft loop: the state, the committed entries
/// after it and the last snapshot's encoding. The builder hands it back rather than
/// dropping it: it is the last owner of the nodes and records the loop has replaced since,
/// and freeing memory another thread allocated takes that thread's allocator lock, which a
/// `SCHED_IDLE` builder preempted in the middle of a free would hold until a core is idle,
/// stalling the loop's next allocation.
type SnapshotSource = (ClusterState, Vec<Entry>, EncodedState);

/// A snapshot whose file is written, ready for the log to drop the entries it covers.
struct BuiltSnapshot {
    snapshot: Snapshot,
    timing: SnapshotTiming,
    /// The snapshot's encoding in pieces, for the next build to share.
    encoded: EncodedState,
    /// The jobs in the snapshot, and how many of them had finished.
    jobs: u64,
    finished_jobs: u64,
}

/// Whether a snapshot is being built off the Raft loop; one at a time.
enum SnapshotBuild {
    Idle,
    Running,
    Built(Box<Result<BuiltSnapshot>>),
}

/// A running replica: its RPC server and its Raft loop. Dropping it stops both.
pub struct Replica {
    local_addr: SocketAddr,
    applied_state: watch::Receiver<Arc<ClusterState>>,
    _server: RpcServer,
    raft_thread: RaftThread,
}

/// The Raft loop's thread, as its owner holds it.
struct RaftThread {
    /// Dropped to stop the loop, which selects on the other end; no message is ever sent.
    _stop: oneshot::Sender<()>,
    /// How the loop ended: its error, or a panic's message.
    ended: oneshot::Receiver<Result<()>>,
}

impl RaftThread {
    /// Runs `raft_loop` on a thread of its own until it fails or the returned handle drops.
    fn start<S: LogStore>(
        id: u64,
        raft_loop: RaftLoop<S>,
        inputs: mpsc::Receiver<Input>,
    ) -> Result<Self> {
        let (stop, stopped) = oneshot::channel();
        let (report, ended) = oneshot::channel();
        let run = move || {
            let run = std::panic::AssertUnwindSafe(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(Error::RaftThreadStart)?
                    .block_on(raft_loop.run(inputs, stopped))
            });
            let result = std::panic::catch_unwind(run).unwrap_or_else(|panic| {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|message| (*message).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "no message".to_owned());
                Err(Error::RaftThreadPanicked(message))
            });
            // Nobody waits on a replica that was dropped.
            let _ = report.send(result);
        };
        std::thread::Builder::new()
            .name(format!("raft-{id}"))
            .spawn(run)
            .map_err(Error::RaftThreadStart)?;
        Ok(Self { _stop: stop, ended })
    }
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
        let raft_loop = RaftLoop::new(
            &config,
            store,
            inputs.clone(),
            notices.clone(),
            tokio::runtime::Handle::current(),
        )?;
        let applied_state = raft_loop.published.subscribe();
        let directory = raft_loop.directory.subscribe();
        let beats = Arc::clone(&raft_loop.beats);
        let raft_guard = RaftGuard::new(config.wire.max_frame, config.peers.keys().copied());
        let service = Arc::new(Service {
            inputs,
            notices,
            raft_guard,
            replicas: config.peers.keys().copied().collect(),
            authenticator: Arc::clone(&config.wire.authenticator),
            history: config.history.clone(),
            directory,
            beats,
        });
        let server = RpcServer::bind::<SchedulerProtocol, _>(bind, service, config.wire).await?;
        let raft_thread = RaftThread::start(config.id, raft_loop, receiver)?;
        Ok(Self {
            local_addr: server.local_addr(),
            applied_state,
            _server: server,
            raft_thread,
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
    pub async fn wait(self) -> Result<()> {
        // The rest of `self`, the stop sender with it, lives until this returns.
        let ended = self.raft_thread.ended.await;
        // The thread reports even a panic; no report means it never ran to its end.
        ended.unwrap_or_else(|_| Err(Error::RaftThreadPanicked("no report".to_owned())))
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

struct RaftLoop<S: LogStore> {
    id: u64,
    peers: BTreeMap<u64, String>,
    config: SchedulerConfig,
    jobs_config: JobsConfig,
    nodes_config: NodesConfig,
    /// How the leader calls nodes.
    node_wire: WireConfig,
    /// Where the loop's own requests (commits after freeing outputs on nodes) come back in.
    inputs: mpsc::Sender<Input>,
    /// The replica's runtime, for the work the loop starts and does not wait on (calls to
    /// nodes, freeing a replaced log): the loop's own thread runs only the loop.
    runtime: tokio::runtime::Handle,
    history: Option<HistoryWriter>,
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
    /// Jobs' leases and the resource view they reserve in (soft state, see `floe_api::lease`).
    leases: LeaseTable,
    /// `AcquireLeases` asks waiting for room.
    lease_asks: LeaseAsks,
    /// `Place` requests waiting for room, by (batch, slot).
    queue: PlacementQueue<(u64, usize)>,
    batches: BTreeMap<u64, PlaceBatch>,
    next_batch: u64,
    /// Heartbeats, recorded by the RPC front (see the `heartbeats` module).
    beats: Arc<Beats>,
    /// What the RPC front answers heartbeats from, republished after every Ready that
    /// changed it.
    directory: watch::Sender<Arc<Directory>>,
    /// Nodes named by `StartDriver`s applied this turn, announced once the directory that
    /// holds them is published.
    unannounced_drivers: Vec<NodeId>,
    /// The answers to commands applied this turn, sent once the directory that holds their
    /// effects is published: a node that registers and heartbeats at once is found alive.
    unsent_replies: Vec<(Reply, Outcome)>,
    /// When the health check last ran: a gap of half a node timeout means this replica
    /// itself was stalled (frozen, starved), so the nodes' silence in that gap is not theirs.
    last_health_check: Instant,
    /// Nodes whose death has been proposed and not yet applied.
    dying: BTreeSet<NodeId>,
    /// Pending jobs whose `StartDriver` was proposed, and when; proposed again if it has not
    /// applied after a node timeout (the proposal can be lost with a leader change).
    drivers_proposed: BTreeMap<JobId, Instant>,
    /// What running jobs' drivers last reported (soft state, like heartbeats).
    progress: BTreeMap<JobId, JobProgress>,
    /// Released outputs whose `Free` calls are under way, and since when; tried again after a
    /// node timeout.
    freeing: BTreeMap<JobId, Instant>,
    /// A job was submitted since drivers were last placed; place them without waiting for
    /// the health tick.
    jobs_submitted: bool,
    published: watch::Sender<Arc<ClusterState>>,
    last_published: Instant,
    snapshot_schedule: SnapshotSchedule,
    snapshot_build: SnapshotBuild,
    last_snapshot: Option<SnapshotTiming>,
    /// The last snapshot's encoding, whose unchanged pieces the next build copies rather
    /// than encodes; with the builder while one runs.
    encoded: EncodedState,
    wal_writes: WalWriteTimes,
    /// `net.max_frame`: a snapshot sent to a follower and a `ReadState` answer must fit in one
    /// frame, so the state is held to half of it (see `lifecycle::finished_that_fit`).
    max_frame: u64,
    /// How many finished jobs the state can hold within that budget, as the last snapshot
    /// measured it; the housekeeping keeps no more, whatever `jobs.keep_finished` says.
    finished_that_fit: Option<u64>,
}

impl<S: LogStore> RaftLoop<S> {
    fn new(
        config: &ReplicaConfig,
        store: S,
        inputs: mpsc::Sender<Input>,
        notices: Notices,
        runtime: tokio::runtime::Handle,
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
        // Empty until nodes heartbeat to this replica as leader (see `rebuild_view`).
        let leases = LeaseTable::new(config.scheduler.lease_ttl(), Instant::now());
        tracing::info!(
            replica = config.id,
            applied = state.applied_index,
            "raft replica starting"
        );
        Ok(Self {
            id: config.id,
            peers: config.peers.clone(),
            config: config.scheduler.clone(),
            jobs_config: config.jobs.clone(),
            nodes_config: config.nodes.clone(),
            node_wire: config.node_wire.clone(),
            inputs: inputs.clone(),
            runtime,
            history: config.history.clone().map(HistoryWriter::new),
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
            leases,
            lease_asks: LeaseAsks::new(),
            queue: PlacementQueue::default(),
            batches: BTreeMap::new(),
            next_batch: 0,
            beats: Arc::new(Beats::default()),
            directory: watch::Sender::new(Arc::new(Directory::default())),
            unannounced_drivers: Vec::new(),
            unsent_replies: Vec::new(),
            last_health_check: Instant::now(),
            dying: BTreeSet::new(),
            drivers_proposed: BTreeMap::new(),
            progress: BTreeMap::new(),
            freeing: BTreeMap::new(),
            jobs_submitted: false,
            published: watch::Sender::new(Arc::new(state_copy)),
            last_published: Instant::now(),
            snapshot_schedule: SnapshotSchedule::new(
                config.scheduler.snapshot_entries,
                config.id,
                &config.peers,
            ),
            snapshot_build: SnapshotBuild::Idle,
            last_snapshot: None,
            encoded: EncodedState::default(),
            wal_writes: WalWriteTimes::default(),
            max_frame: u64::try_from(config.wire.max_frame).unwrap_or(u64::MAX),
            finished_that_fit: None,
        })
    }

    /// Turns until `stop`'s sender drops (the replica was dropped) or a write fails.
    async fn run(
        mut self,
        mut inputs: mpsc::Receiver<Input>,
        mut stop: oneshot::Receiver<()>,
    ) -> Result<()> {
        let mut tick = tokio::time::interval(Duration::from_millis(self.config.raft_tick_ms));
        let mut health = tokio::time::interval(self.config.heartbeat_interval());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = &mut stop => return Ok(()),
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
            Input::Housekeeping(command) => {
                // A leader that lost its term drops it; the next leader's housekeeping redoes it.
                if self.is_leader() {
                    self.propose(command, None);
                }
            }
            Input::Heard(node) => self.first_heard(node),
            Input::Unreachable(peer) => self.raw.report_unreachable(peer),
            Input::SnapshotSent { peer, status } => self.raw.report_snapshot(peer, status),
            Input::SnapshotBuilt(built, source) => {
                self.runtime.spawn_blocking(move || drop(source));
                self.snapshot_build = SnapshotBuild::Built(built);
            }
            Input::Request {
                principal,
                request,
                reply,
            } => self.handle_request(&principal, request, reply),
        }
    }

    /// Proposes `command` stamped with this leader's clock, the only time `apply` sees.
    fn propose(&mut self, command: Command, reply: Option<Reply>) {
        let logged = LoggedCommand {
            at_ms: now_ms(),
            command,
        };
        let data = match codec::encode(&logged) {
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
            return self.maybe_compact();
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
        // Blocks this loop's own thread only (see the module docs).
        let write_started = Instant::now();
        if self.raw.mut_store().persist(ready.entries(), ready.hs())? == Persisted::Written {
            self.wal_writes.record(write_started.elapsed(), now_ms());
        }
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
        // Everything the directory holds changes only in a Ready (the applied state, and the
        // role and leader, which raft-rs reports as its soft state), so it is published here
        // alone: the commands just applied are answered before a built snapshot is kept (its
        // WAL swap would hold every answer of the turn) and before the rest of the turn.
        self.publish_directory();
        self.maybe_compact()
    }

    fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        let before = self.state.applied_index;
        let replaced = std::mem::replace(&mut self.state, ClusterState::decode(&snapshot.data)?);
        // The new state shares no structure with the last encoding, whose `diff` would walk
        // every entry: both go, freed off the loop (a whole state's worth of frees), and the
        // next build encodes from scratch.
        let stale = std::mem::take(&mut self.encoded);
        self.runtime.spawn_blocking(move || drop((replaced, stale)));
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

    /// The view holds the alive nodes this replica has heard from since it became leader: a
    /// node the restored state calls alive may have died while no leader listened (a
    /// scheduler restarted on an old data directory), and placing work there would wait out
    /// its node timeout. A node joins the view with its first heartbeat here. Leases start
    /// afresh: a new leader takes in those its drivers re-assert (see `floe_api::lease`).
    fn rebuild_view(&mut self) {
        let ttl = self.config.lease_ttl();
        self.leases = if self.is_leader() {
            LeaseTable::new_leader(ttl, Instant::now())
        } else {
            LeaseTable::new(ttl, Instant::now())
        };
        let beats = self.beats.lock();
        for node in self.state.alive_nodes() {
            if beats.heard_from(node.id) {
                self.leases.upsert_node(node.id, node.resources);
            }
        }
    }

    /// What follows `node`'s death, committed at log `index`: its leases, and those of the
    /// drivers it ran, go with it, and the death is announced.
    fn node_died(&mut self, node: NodeId, index: u64) {
        self.dying.remove(&node);
        self.leases.remove_node(node);
        self.leases.revoke_driver(node);
        self.beats.lock().forget(node);
        self.retry_waiting();
        if let Some(death) = self.state.deaths_after(index - 1).pop() {
            tracing::warn!(node = %death.node, reason = %death.reason, "node committed dead");
            let _ = self.notices.deaths.send(death);
        }
    }

    fn apply(&mut self, entries: Vec<Entry>) {
        for entry in entries {
            if entry.data.is_empty() || entry.get_entry_type() != EntryType::EntryNormal {
                // Empty entries mark a new leader's term; membership is fixed at bootstrap.
                self.state.skip(entry.index);
                continue;
            }
            let LoggedCommand { at_ms, command } = match codec::decode(&entry.data, "raft command")
            {
                Ok(logged) => logged,
                Err(error) => {
                    // Every replica decodes the same bytes the same way, so skipping is
                    // deterministic; it can only come from a release with another codec.
                    tracing::error!(index = entry.index, %error, "skipping an undecodable entry");
                    self.state.skip(entry.index);
                    continue;
                }
            };
            let effect = match &command {
                Command::RegisterNode {
                    resources,
                    replaces,
                    ..
                } => Effect::Registered(*resources, *replaces),
                Command::MarkNodeDead { node, .. } => Effect::Died(*node),
                Command::SubmitJob { .. } => Effect::Submitted,
                Command::StartDriver { job, node } => Effect::DriverStarted(*job, *node),
                Command::FinishJob { job, .. } => Effect::JobEnded(*job),
                Command::CancelJob { job } => Effect::JobCancelled(*job),
                _ => Effect::None,
            };
            let Some(outcome) = self.state.apply(entry.index, at_ms, command) else {
                continue;
            };
            if let Outcome::JobsRemoved(summaries) = &outcome {
                self.record_history(summaries);
            }
            match (effect, &outcome) {
                (Effect::Registered(resources, replaces), Outcome::NodeRegistered(node)) => {
                    // The node it replaces, if it was alive, died in the same command.
                    if let Some(old) = replaces
                        && self.state.nodes.get(&old).is_some_and(|record| {
                            matches!(record.liveness, Liveness::Dead { index, .. } if index == entry.index)
                        })
                    {
                        self.node_died(old, entry.index);
                    }
                    self.leases.upsert_node(*node, resources);
                    self.retry_waiting();
                }
                (Effect::Died(node), Outcome::Applied) => self.node_died(node, entry.index),
                (Effect::Died(node), _) => {
                    self.dying.remove(&node);
                }
                (Effect::Submitted, _) => self.jobs_submitted = true,
                (Effect::DriverStarted(job, node), outcome) => {
                    self.drivers_proposed.remove(&job);
                    if *outcome == Outcome::Applied {
                        self.unannounced_drivers.push(node);
                    }
                }
                (Effect::JobEnded(job), Outcome::Applied) => {
                    self.progress.remove(&job);
                    self.job_ended(job);
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
                    self.job_ended(job);
                    let _ = self.notices.jobs_ended.send(job);
                }
                _ => {}
            }
            if let Some(seq) = entry.context.get(8..16).and_then(|seq| seq.try_into().ok()) {
                let key = (entry.term, u64::from_be_bytes(seq));
                if let Some(reply) = self.proposals.remove(&key) {
                    self.unsent_replies.push((reply, outcome));
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
        self.beats
            .lock()
            .restart(leader.then_some(self.raw.raft.term));
        self.dying.clear();
        self.drivers_proposed.clear();
        self.progress.clear();
        self.freeing.clear();
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
        self.drop_lease_asks(&hint);
    }

    /// Keeps a snapshot built off the Raft loop, and starts the next one when one is due
    /// ([`SnapshotSchedule`]). Only the copy of the state (O(1): its maps are
    /// persistent) and setting the covered entries aside run here (they and the replaced
    /// snapshot are freed on a blocking thread); the encoding, the
    /// snapshot file and the start of the next WAL, which grow with the state, are written
    /// and fsynced on a thread of lowered priority, and the log moves to that WAL
    /// with its next write's own fsync (`DiskLog::persist`), so keeping a snapshot makes no
    /// fsync on this task.
    fn maybe_compact(&mut self) -> Result<()> {
        match std::mem::replace(&mut self.snapshot_build, SnapshotBuild::Idle) {
            SnapshotBuild::Running => {
                self.snapshot_build = SnapshotBuild::Running;
                return Ok(());
            }
            SnapshotBuild::Built(built) => {
                let BuiltSnapshot {
                    snapshot,
                    mut timing,
                    encoded,
                    jobs,
                    finished_jobs,
                } = (*built)?;
                let keep_started = Instant::now();
                let compacted = self.raw.mut_store().compact(snapshot)?;
                timing.keep_us = micros(keep_started.elapsed());
                self.runtime.spawn_blocking(move || drop(compacted));
                timing.finished_at_ms = now_ms();
                tracing::info!(
                    replica = self.id,
                    index = timing.index,
                    bytes = timing.bytes,
                    copy_us = timing.copy_us,
                    build_ms = timing.build_ms,
                    build_cpu_ms = timing.build_cpu_ms,
                    keep_us = timing.keep_us,
                    reused_bytes = timing.reused_bytes,
                    written_bytes = timing.written_bytes,
                    "snapshot taken, log compacted"
                );
                self.last_snapshot = Some(timing);
                self.encoded = encoded;
                self.bound_finished_jobs(timing.bytes, jobs, finished_jobs);
            }
            SnapshotBuild::Idle => {}
        }
        let applied = self.state.applied_index;
        let snapshot_index = self.raw.store().latest_snapshot().get_metadata().index;
        if !self.snapshot_schedule.due(applied, snapshot_index) {
            return Ok(());
        }
        let started_at_ms = now_ms();
        let copy_started = Instant::now();
        let state = self.state.clone();
        let copy_us = micros(copy_started.elapsed());
        let counts = &state.job_counts;
        let jobs = counts.total();
        let finished_jobs = jobs - counts.pending - counts.running;
        let mut snapshot = Snapshot::default();
        let meta = snapshot.mut_metadata();
        meta.index = applied;
        meta.term = self.raw.raft.raft_log.term(applied)?;
        meta.set_conf_state(self.raw.store().initial_state()?.conf_state);
        // The committed entries after the snapshot start the next WAL (see `SnapshotWriter`).
        let store = self.raw.store();
        let committed = self.raw.raft.raft_log.committed.min(store.last_index()?);
        let entries = store.entries(
            applied + 1,
            committed.max(applied) + 1,
            None,
            GetEntriesContext::empty(false),
        )?;
        let writer = store.snapshot_writer();
        let inputs = self.inputs.clone();
        // A build that fails leaves none, and the next one encodes everything. (A thread that
        // cannot be started drops `build`, and with it this, on the loop: rare enough.)
        let last_encoded = std::mem::take(&mut self.encoded);
        let build = move || {
            lower_own_priority();
            let build_started = Instant::now();
            let cpu_started = thread_cpu_time();
            let encoded = state.encode_reusing(&last_encoded);
            let built = encoded.map_err(Error::from).and_then(|encoded| {
                let data = encoded.data();
                snapshot.data = data.clone();
                let pieces: Vec<SnapshotPiece> = encoded
                    .pieces()
                    .iter()
                    .map(|piece| SnapshotPiece {
                        bytes: &data[piece.start..piece.end],
                        hash: piece.hash,
                    })
                    .collect();
                let prepared = writer.prepare(&snapshot, &pieces, &entries)?;
                Ok(BuiltSnapshot {
                    timing: SnapshotTiming {
                        index: applied,
                        bytes: data.len() as u64,
                        copy_us,
                        build_ms: millis(build_started.elapsed()),
                        build_cpu_ms: millis(thread_cpu_time().saturating_sub(cpu_started)),
                        reused_bytes: encoded.reused_bytes() as u64,
                        written_bytes: prepared.written_bytes,
                        keep_us: 0,
                        started_at_ms,
                        finished_at_ms: 0,
                    },
                    snapshot,
                    encoded,
                    jobs,
                    finished_jobs,
                })
            });
            // The loop is gone only when the replica stops; the snapshot goes with it.
            let _ = inputs.blocking_send(Input::SnapshotBuilt(
                Box::new(built),
                Box::new((state, entries, last_encoded)),
            ));
        };
        // A thread of its own rather than the runtime's blocking pool, since it lowers its
        // priority for good; one per snapshot, so its cost is nothing beside the build.
        match std::thread::Builder::new()
            .name(format!("snapshot-{}", self.id))
            .spawn(build)
        {
            Ok(_) => self.snapshot_build = SnapshotBuild::Running,
            // Tried again after the next applied entries.
            Err(error) => tracing::warn!(replica = self.id, %error, "cannot start a snapshot"),
        }
        Ok(())
    }
}

/// When a replica builds its snapshots: one every `every` applied entries, at the indexes
/// `k · every + offset`, the offset spreading the replicas evenly by their place among the
/// voters. Replicas then encode and write their snapshots at different times, so a commit's
/// quorum always has a replica not building one: the builds share the machine's cores and
/// the disk the WAL's `fsync` waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SnapshotSchedule {
    every: u64,
    offset: u64,
}

impl SnapshotSchedule {
    /// The schedule of replica `id` among `voters` with a snapshot every `every` entries.
    fn new(every: u64, id: u64, voters: &BTreeMap<u64, String>) -> Self {
        let every = every.max(1);
        let place = voters.keys().take_while(|voter| **voter != id).count() as u64;
        let offset = every * place / (voters.len() as u64).max(1);
        Self { every, offset }
    }

    /// Whether a snapshot is due at `applied`, the last being at `snapshot_index`: a
    /// snapshot point lies after the one and at or before the other.
    fn due(self, applied: u64, snapshot_index: u64) -> bool {
        // The points at or below `index`, plus one (`offset < every` keeps this unsigned).
        let points = |index: u64| (index + self.every - self.offset) / self.every;
        points(applied) > points(snapshot_index)
    }
}

/// The snapshot builder's CPU scheduling policy: `SCHED_IDLE` runs only on a core no other
/// thread wants, and a thread that wakes preempts it at once. A nice value is
/// weaker on Linux's EEVDF scheduler: a woken thread may wait out the niced builder's
/// slice, and a commit wakes several threads in turn (RPC front, Raft loop, peer senders, a
/// follower's). In `floe-bench scale` the commits overlapping a build had a p99 of 4.5–6.8 ms
/// against 5.9–11.0 ms at nice +10 (three alternated runs each), builds no slower.
const SNAPSHOT_POLICY: libc::c_int = libc::SCHED_IDLE;

/// The snapshot builder's I/O priority: the idle class, whose requests a block scheduler that
/// keeps classes apart (`mq-deadline`, `bfq`) sends to the disk only when no other request
/// waits, so the WAL's writes and `fsync`s, which every commit waits on, go first.
const SNAPSHOT_IOPRIO: libc::c_int = IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT;

// From linux/ioprio.h, which the libc crate does not carry.
const IOPRIO_WHO_PROCESS: libc::c_int = 1;
const IOPRIO_CLASS_IDLE: libc::c_int = 3;
const IOPRIO_CLASS_SHIFT: libc::c_int = 13;

/// Puts the calling thread in the [`SNAPSHOT_POLICY`] and its I/O priority in
/// [`SNAPSHOT_IOPRIO`] (on Linux both belong to a thread, and both calls change the caller's).
/// Best effort: a build at the normal priorities is still correct, only less kind to commits.
fn lower_own_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: a system call on the calling thread's own policy (`pid` 0); `param` outlives it.
    if unsafe { libc::sched_setscheduler(0, SNAPSHOT_POLICY, &param) } == -1 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "the snapshot builder's CPU policy may not be lowered"
        );
    }
    // SAFETY: a system call on the calling thread's own I/O priority; `who` 0 is the calling
    // thread and no memory is passed.
    let set =
        unsafe { libc::syscall(libc::SYS_ioprio_set, IOPRIO_WHO_PROCESS, 0, SNAPSHOT_IOPRIO) };
    if set == -1 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "the snapshot builder's I/O priority may not be lowered"
        );
    }
}

/// The calling thread's CPU time so far; zero where the clock cannot be read (Linux always
/// has it), which makes a build's CPU time read zero.
fn thread_cpu_time() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec that outlives the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) } == -1 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "this thread's CPU time cannot be read"
        );
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(now.tv_sec).unwrap_or(0),
        u32::try_from(now.tv_nsec).unwrap_or(0),
    )
}

fn millis(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
}

fn micros(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX)
}

/// Milliseconds since the Unix epoch on this replica's clock.
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

enum Effect {
    /// A node registered, replacing the named one, if any.
    Registered(floe_api::state::Resources, Option<NodeId>),
    Died(NodeId),
    Submitted,
    DriverStarted(JobId, NodeId),
    JobEnded(JobId),
    JobCancelled(JobId),
    None,
}

#[cfg(test)]
mod tests;
