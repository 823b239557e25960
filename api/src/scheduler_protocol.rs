//! The RPC service every scheduler replica serves on its address: Raft traffic between
//! replicas, and the requests of clients and nodes. Any replica answers; one that is not the
//! leader answers requests that need the leader with [`SchedulerResponse::NotLeader`].

use std::collections::BTreeMap;

use floe_core::auth::NodeTicket;
use floe_core::job::JobProgress;
use floe_core::wire::Protocol;
use floe_core::{ActorId, JobId, LeaseId, NodeId};
use serde::{Deserialize, Serialize};

use crate::lease::{Lease, LeaseGrants, LeaseStanding, LeaseSummary};
use crate::placement::{PlacementError, PlacementRequest};
use crate::state::{
    CacheIndex, ClusterState, Command, JobRecord, JobSummary, NodeAddresses, NodeDeath, NodeMemory,
    Outcome, Resources,
};

pub struct SchedulerProtocol;

impl Protocol for SchedulerProtocol {
    const NAME: &'static str = "scheduler";
    type Request = SchedulerRequest;
    type Response = SchedulerResponse;
}

/// What a node reports in each heartbeat; kept by the leader as soft state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceUsage {
    pub cpu_millis: u64,
    pub heap_bytes: u64,
    pub object_store_bytes: u64,
    /// Objects whose copy is in spill files now, and objects held in disk-backed fallback
    /// files because memory was full of pinned objects.
    pub spilled_bytes: u64,
    pub fallback_bytes: u64,
    /// Worker processes, and how many of them are running a task.
    pub workers: u32,
    pub workers_busy: u32,
    /// The node's process tree's CPU use over the last interval, in thousandths of its CPUs.
    pub cpu_used_permille: u32,
    /// Counters since the node started, which the dashboard turns into rates: rows its
    /// tasks produced, and object bytes it pulled from other nodes and sent to them.
    pub rows_produced: u64,
    pub network_received_bytes: u64,
    pub network_sent_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SchedulerRequest {
    /// Raft messages from another replica, each protobuf-encoded (raft-rs's own format).
    /// Only accepted from configured replicas that proved the replica secret.
    Raft {
        #[serde(with = "floe_core::wire::bytes::list")]
        messages: Vec<Vec<u8>>,
    },
    /// Registers a node; `replaces` is the id the same agent had before (see
    /// `Command::RegisterNode`).
    RegisterNode {
        addresses: NodeAddresses,
        resources: Resources,
        memory: NodeMemory,
        labels: BTreeMap<String, String>,
        replaces: Option<NodeId>,
    },
    Heartbeat {
        node: NodeId,
        usage: ResourceUsage,
    },
    /// Commits a command through Raft and returns its outcome.
    Propose(Command),
    /// A linearizable read of the whole cluster state (ReadIndex).
    ReadState,
    /// Chooses a node for each request (actors), as a batch so SPREAD spreads within it;
    /// nothing stays reserved. Requests that fit nowhere yet are answered once they fit.
    Place {
        requests: Vec<PlacementRequest>,
    },
    /// `job`'s driver asks for a lease per request, each placed by the placement policy.
    /// Answered once at least one is granted, or after `wait_ms` with what was.
    AcquireLeases {
        job: JobId,
        requests: Vec<PlacementRequest>,
        wait_ms: u64,
    },
    /// `job`'s driver renews the leases it holds (whole, so a new leader can take in those an
    /// earlier one granted); each is answered with its standing.
    RenewLeases {
        job: JobId,
        leases: Vec<Lease>,
    },
    /// `job`'s driver gives leases back.
    ReturnLeases {
        job: JobId,
        leases: Vec<LeaseId>,
    },
    /// The leader's latest heartbeat report from every alive node.
    NodeReports,
    /// A running job's driver reports its progress; the answer says whether to stop.
    ReportProgress {
        job: JobId,
        progress: JobProgress,
    },
    /// The progress the job's driver last reported.
    JobProgress {
        job: JobId,
    },
    /// What every running job's driver last reported, for dashboards.
    AllProgress,
    /// The drivers `node` must run; answered at once if they differ from `known`, else when
    /// one is started on the node or after `wait_ms`, whichever is first. A node watches
    /// this so a job's driver starts without waiting for the next heartbeat.
    WatchDrivers {
        node: NodeId,
        known: Vec<(JobId, u32)>,
        wait_ms: u64,
    },
    /// The job's record, once it has ended or after `wait_ms`, whichever is first; at once
    /// when it has already ended or does not exist.
    WatchJob {
        job: JobId,
        wait_ms: u64,
    },
    /// Node deaths committed after log index `after`; waits up to `wait_ms` for one.
    WatchDeaths {
        after: u64,
        wait_ms: u64,
    },
    Status,
    /// The node hosting `actor`, if it is registered (answered by the leader).
    ActorNode {
        actor: ActorId,
    },
    /// The alive nodes, small: what drivers and clients need instead of the whole state.
    AliveNodes,
    /// The fingerprint cache index, for planning a job.
    CacheIndex,
    /// Summaries of jobs that left the replicated state, newest first, at most `limit` (and
    /// at most 10,000), from the history file of the replica asked (any replica answers).
    JobHistory {
        limit: u32,
    },
}

/// An alive node: where to reach it and what it offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSummary {
    pub id: NodeId,
    /// The node agent's RPC address.
    pub rpc: String,
    pub resources: Resources,
}

/// A node's last heartbeat as the leader saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    pub usage: ResourceUsage,
    /// What the leases on the node reserve now.
    pub reserved: Resources,
    /// Each job's leases on the node.
    pub leases: Vec<LeaseSummary>,
    /// Milliseconds since that heartbeat arrived.
    pub age_ms: u64,
}

/// Where the leader is, so a client can go straight there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderHint {
    pub id: u64,
    pub addr: String,
}

/// One replica's view of Raft, for operators and tests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaStatus {
    pub id: u64,
    pub leader: Option<u64>,
    pub term: u64,
    pub commit: u64,
    pub applied: u64,
    /// How many commands this replica's state machine has applied since the cluster began.
    pub applied_commands: u64,
    /// The first log index still in the log (everything before is in the snapshot).
    pub first_index: u64,
    pub snapshot_index: u64,
    /// The last snapshot this replica built of its own state since it started.
    pub last_snapshot: Option<SnapshotTiming>,
    /// Its Raft loop's writes to its WAL since it started.
    pub wal_writes: WalWrites,
}

/// A replica's writes to its Raft log's WAL since it started: each Ready's entries and hard
/// state, appended and fsynced on the Raft loop (the first after a kept snapshot also moves
/// the log to the next WAL); a snapshot installed from the leader is not counted. Every
/// commit waits for the leader's write and a follower's, so the slow ones say when a commit's
/// latency was the disk's.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WalWrites {
    pub writes: u64,
    /// All of them together, for the mean.
    pub total_us: u64,
    /// How many took at least [`WalWrites::SLOW_MS`], kept in `slow` or not.
    pub slow_writes: u64,
    /// The latest of those, oldest first; at most [`WalWrites::SLOW_KEPT`].
    pub slow: Vec<SlowWalWrite>,
}

impl WalWrites {
    /// A write this long is slow: several times a quiet disk's fdatasync.
    pub const SLOW_MS: u64 = 10;
    /// Slow writes kept: a minute or more of a disk that stalls every few seconds.
    pub const SLOW_KEPT: usize = 256;
}

/// One slow WAL write: how long it took and when it ended, in milliseconds since the Unix
/// epoch on the replica's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlowWalWrite {
    pub took_us: u64,
    pub finished_at_ms: u64,
}

/// How a replica built a snapshot of its state: a copy on the Raft loop, the encoding and
/// the fsynced file off it, then dropping the covered log entries on it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotTiming {
    pub index: u64,
    /// The encoded state.
    pub bytes: u64,
    /// Copying the state, on the Raft loop.
    pub copy_us: u64,
    /// Encoding the copy and writing the snapshot file, off the Raft loop.
    pub build_ms: u64,
    /// The builder's CPU time: what commits pay for while it runs, whatever its priority,
    /// where `build_ms` also counts its waits for a core.
    pub build_cpu_ms: u64,
    /// Bytes of the encoding the build copied from the last snapshot instead of encoding.
    pub reused_bytes: u64,
    /// Bytes the build wrote to new piece files: the pieces no earlier snapshot had stored.
    pub written_bytes: u64,
    /// Dropping the covered entries, on the Raft loop (the log files are written off it).
    pub keep_us: u64,
    /// When the copy was taken and when the snapshot was kept, in milliseconds since the
    /// Unix epoch on the replica's clock.
    pub started_at_ms: u64,
    pub finished_at_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SchedulerResponse {
    /// This replica is not the leader; `leader` is who is, when known.
    NotLeader {
        leader: Option<LeaderHint>,
    },
    RaftAccepted,
    Committed(Outcome),
    /// The answer to `RegisterNode`: the node's id and the ticket it presents from now on.
    NodeRegistered {
        node: NodeId,
        ticket: NodeTicket,
    },
    /// The heartbeat was taken (or a `WatchDrivers` answered); `drivers` are the running jobs
    /// (and attempts) whose drivers the node must be running.
    HeartbeatAccepted {
        drivers: Vec<(JobId, u32)>,
    },
    /// `cancel`: the job was cancelled or has ended; its driver stops.
    ProgressAccepted {
        cancel: bool,
    },
    Progress(Option<JobProgress>),
    AllProgress(BTreeMap<JobId, JobProgress>),
    Job(Option<Box<JobRecord>>),
    /// The node was committed dead and must register again, as a new node.
    Rejoin,
    State(Box<ClusterState>),
    Placements(Vec<Result<NodeId, PlacementError>>),
    Leases(LeaseGrants),
    /// Each renewed lease's standing, in the order asked.
    LeasesRenewed(Vec<LeaseStanding>),
    LeasesReturned,
    NodeReports(BTreeMap<NodeId, NodeReport>),
    Deaths(Vec<NodeDeath>),
    Status(ReplicaStatus),
    ActorNode(Option<NodeSummary>),
    /// The alive nodes as of log index `as_of`; deaths after it come from `WatchDeaths`.
    AliveNodes {
        as_of: u64,
        nodes: Vec<NodeSummary>,
    },
    CacheIndex(CacheIndex),
    History(Vec<JobSummary>),
}
