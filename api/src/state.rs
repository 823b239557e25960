//! The replicated state machine.
//!
//! Every replica applies the same committed [`Command`]s in the same order to a
//! [`ClusterState`], so `apply` must be deterministic: ordered maps only, no clocks, no
//! randomness, and a command that does not make sense (an unknown job, say) is answered with
//! the same [`Outcome::Rejected`] everywhere rather than failing on some replicas. Time comes
//! only from the log: every entry carries the wall-clock time the leader observed when it
//! proposed it ([`LoggedCommand::at_ms`]), and `apply` reads no other clock.

use std::collections::BTreeMap;
use std::sync::Arc;

use floe_core::job::{JobStats, OutputBlock};
use floe_core::wire::codec;
use floe_core::{ActorId, JobId, NodeId, SubmissionId};
pub use imbl::ordmap::DiffItem;
pub use imbl::{OrdMap, OrdSet};
use serde::{Deserialize, Serialize};

use crate::Result;

/// What a node offers to tasks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    /// Thousandths of a CPU, so fractional requests stay exact.
    pub cpu_millis: u64,
    /// The node's heap pool: memory for tasks' working sets, against which memory hints are
    /// accounted.
    pub heap_bytes: u64,
}

/// Where a node can be reached.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAddresses {
    /// The node agent's RPC address (`host:port`).
    pub rpc: String,
}

/// How a node's memory is split into pools (the object store, the system reserve and the
/// heap, which is [`Resources::heap_bytes`]), for operators; placement only uses the heap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeMemory {
    pub total_bytes: u64,
    pub object_store_bytes: u64,
    pub system_reserve_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Liveness {
    Alive,
    /// Committed dead at log index `index`, at `at_ms` on the leader's clock. A dead node
    /// never comes back under the same id.
    Dead {
        index: u64,
        at_ms: u64,
        reason: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: NodeId,
    pub addresses: NodeAddresses,
    pub resources: Resources,
    pub memory: NodeMemory,
    pub labels: BTreeMap<String, String>,
    pub liveness: Liveness,
}

impl NodeRecord {
    pub fn is_alive(&self) -> bool {
        self.liveness == Liveness::Alive
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobStatus {
    /// Waiting for its driver to be placed (again, after a driver's node died).
    Pending,
    Running,
    Succeeded,
    Failed {
        message: String,
    },
    Cancelled,
}

impl JobStatus {
    /// Whether the job has ended (succeeded, failed or cancelled).
    pub fn is_finished(&self) -> bool {
        matches!(
            self,
            JobStatus::Succeeded | JobStatus::Failed { .. } | JobStatus::Cancelled
        )
    }

    pub fn name(&self) -> &'static str {
        match self {
            JobStatus::Pending => "pending",
            JobStatus::Running => "running",
            JobStatus::Succeeded => "succeeded",
            JobStatus::Failed { .. } => "failed",
            JobStatus::Cancelled => "cancelled",
        }
    }
}

/// How many jobs of the state are in each status; kept by `apply`, so a reader's totals cost
/// no scan of the jobs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobCounts {
    pub pending: u64,
    pub running: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub cancelled: u64,
}

impl JobCounts {
    /// Every status's name ([`JobStatus::name`]) with its count.
    pub fn by_name(&self) -> [(&'static str, u64); 5] {
        [
            ("pending", self.pending),
            ("running", self.running),
            ("succeeded", self.succeeded),
            ("failed", self.failed),
            ("cancelled", self.cancelled),
        ]
    }

    /// The count of the status named `name`, if it names one.
    pub fn named(&self, name: &str) -> Option<u64> {
        self.by_name()
            .into_iter()
            .find(|(status, _)| *status == name)
            .map(|(_, count)| count)
    }

    pub fn total(&self) -> u64 {
        self.by_name().iter().map(|(_, count)| count).sum()
    }

    fn of(&mut self, status: &JobStatus) -> &mut u64 {
        match status {
            JobStatus::Pending => &mut self.pending,
            JobStatus::Running => &mut self.running,
            JobStatus::Succeeded => &mut self.succeeded,
            JobStatus::Failed { .. } => &mut self.failed,
            JobStatus::Cancelled => &mut self.cancelled,
        }
    }

    fn add(&mut self, status: &JobStatus) {
        *self.of(status) += 1;
    }

    fn remove(&mut self, status: &JobStatus) {
        let count = self.of(status);
        *count = count.saturating_sub(1);
    }

    fn moved(&mut self, from: &JobStatus, to: &JobStatus) {
        self.remove(from);
        self.add(to);
    }
}

/// How a driver ended its job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobOutcome {
    /// Succeeded, Failed or Cancelled.
    pub status: JobStatus,
    pub stats: JobStats,
    /// The output blocks, in order, for a job whose output stays in the object stores.
    pub outputs: Vec<OutputBlock>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: JobId,
    pub submission: SubmissionId,
    /// What the submitter called the job (a job file's `name`); kept out of the spec so
    /// renaming a job changes no fingerprint.
    pub name: Option<String>,
    /// The encoded job spec (`floe_core::job::JobSpec`), opaque to the scheduler.
    #[serde(with = "floe_core::wire::bytes")]
    pub spec: Vec<u8>,
    pub status: JobStatus,
    /// The node running the job's driver, while one does.
    pub driver: Option<NodeId>,
    /// How many times a driver was started for this job.
    pub attempts: u32,
    /// A user asked to cancel the running job; its driver stops and finishes it as cancelled.
    pub cancel_requested: bool,
    /// The last driver's stats, once the job has ended.
    pub stats: Option<JobStats>,
    /// The output blocks the job holds for its client; empty once they were released.
    pub outputs: Vec<OutputBlock>,
    /// When the job was submitted, its first driver started and it ended, in milliseconds
    /// since the Unix epoch on the leader's clock.
    pub submitted_at_ms: u64,
    pub started_at_ms: Option<u64>,
    pub ended_at_ms: Option<u64>,
    /// Why and when the output was let go, once it was.
    pub release: Option<OutputRelease>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorRecord {
    pub id: ActorId,
    pub kind: String,
    pub node: NodeId,
    /// The job that owns the actor; its record goes when the job ends.
    pub job: JobId,
}

/// The kind recorded for job drivers, which run as actors.
pub const DRIVER_ACTOR_KIND: &str = "JobDriver";

/// The actor id of attempt `attempt` of `job`'s driver. Derived, not drawn, so every replica
/// applying `StartDriver` records the same id; the top bit keeps it apart from random ids in
/// practice.
pub fn driver_actor(job: JobId, attempt: u32) -> ActorId {
    ActorId::new((1 << 127) | (u128::from(job.get()) << 32) | u128::from(attempt))
}

/// One cached output shard of an operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachedShard {
    pub node: NodeId,
    pub bytes: u64,
    pub rows: u64,
}

/// The shards cached for one (fingerprint, shard count).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheEntry {
    /// Shard rank → where it is.
    pub shards: BTreeMap<u32, CachedShard>,
    /// Which job made the entry; unknown for shards a node found on disk when it joined.
    pub made_by: Option<CacheProvenance>,
}

/// Which job and operator wrote a cached output, as a driver records its shards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheOrigin {
    pub job: JobId,
    /// The operator's name in the job's stats (`read→filter`).
    pub operator: String,
}

/// A [`CacheOrigin`] and when its first shard was recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheProvenance {
    pub origin: CacheOrigin,
    /// Milliseconds since the Unix epoch, on the clock of the leader that logged the record.
    pub created_at_ms: u64,
}

/// The fingerprint cache index: fingerprint (32 hex digits) → shard count → shards.
pub type CacheIndex = BTreeMap<String, BTreeMap<u32, CacheEntry>>;

/// How a fingerprint's cached shards were used, replicated so it survives a replica's
/// restart: counted when a job's end is applied (its stats name the shards each operator
/// loaded), so it costs no command of its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheUse {
    /// Shards served to jobs, over every job that ended while the fingerprint was indexed.
    pub hits: u64,
    /// When a shard was last written or served, in milliseconds since the Unix epoch on the
    /// clock of the leader that logged it.
    pub last_used_ms: u64,
}

/// A committed node death, as published to subscribers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeDeath {
    pub node: NodeId,
    /// The log index that committed the death; subscribers resume after it.
    pub index: u64,
    pub reason: String,
}

/// What a Raft log entry holds: a command and the time the leader proposed it at, which is
/// the only clock `apply` knows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoggedCommand {
    /// Milliseconds since the Unix epoch on the proposing leader's clock.
    pub at_ms: u64,
    pub command: Command,
}

/// A change to the cluster state, proposed through Raft.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Registers a node under a new id. `replaces` names the id the same agent had before
    /// (told to rejoin, or restarted on its data directory at the same address): if that node
    /// is still alive at the same RPC address, it is marked dead in the same commit.
    RegisterNode {
        addresses: NodeAddresses,
        resources: Resources,
        memory: NodeMemory,
        labels: BTreeMap<String, String>,
        replaces: Option<NodeId>,
    },
    MarkNodeDead {
        node: NodeId,
        reason: String,
    },
    SubmitJob {
        #[serde(with = "floe_core::wire::bytes")]
        spec: Vec<u8>,
        submission: SubmissionId,
        /// The job's name, if the submitter gave one.
        name: Option<String>,
    },
    /// Starts a driver for `job` on `node` (counting an attempt).
    StartDriver {
        job: JobId,
        node: NodeId,
    },
    /// Ends `job`; only the driver of the current attempt may.
    FinishJob {
        job: JobId,
        attempt: u32,
        outcome: JobOutcome,
    },
    /// Cancels a pending job at once, or asks a running job's driver to stop.
    CancelJob {
        job: JobId,
    },
    /// Records where a running job's actor lives (the node its placement chose).
    RegisterActor {
        actor: ActorId,
        kind: String,
        node: NodeId,
        job: JobId,
    },
    RemoveActor {
        actor: ActorId,
    },
    RecordCacheShard {
        fingerprint: String,
        shard_count: u32,
        rank: u32,
        shard: CachedShard,
        /// The job and operator that wrote it; `None` for a shard a node found on disk.
        origin: Option<CacheOrigin>,
    },
    EvictCache {
        fingerprint: String,
    },
    /// Drops one shard from the index if it is still recorded on `node` (its file is gone, or
    /// is about to be removed): a copy recorded since on another node stays.
    ForgetCacheShard {
        fingerprint: String,
        shard_count: u32,
        rank: u32,
        node: NodeId,
    },
    /// The client is done with a succeeded job's output: its blocks are freed.
    ReleaseJobOutput {
        job: JobId,
    },
    /// Removes a finished job: its output is freed and its summary goes to the history.
    DeleteJob {
        job: JobId,
    },
    /// The leader frees outputs held for longer than `ttl_ms` after their job ended.
    ExpireJobOutputs {
        jobs: Vec<JobId>,
        ttl_ms: u64,
    },
    /// The leader freed `job`'s released output blocks on `nodes` (they answered `Free`).
    OutputsFreed {
        job: JobId,
        nodes: Vec<NodeId>,
    },
    /// The leader moves finished jobs out of the state into the replicas' histories.
    PruneJobs {
        jobs: Vec<JobId>,
    },
    /// The leader forgets nodes dead for at least `dead_for_ms`.
    ForgetNodes {
        nodes: Vec<NodeId>,
        dead_for_ms: u64,
    },
}

/// The result of applying one command, returned to whoever proposed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    NodeRegistered(NodeId),
    JobSubmitted(JobId),
    Applied,
    /// The command was valid to propose but does not apply to the current state.
    Rejected(String),
    /// Jobs left the state (`DeleteJob`, `PruneJobs`); each replica appends these summaries
    /// to its history.
    JobsRemoved(Vec<JobSummary>),
}

/// Everything the replicas agree on. Cloned for snapshots, linearizable reads and the copy
/// the HTTP API reads: the maps that grow with jobs and nodes are persistent B-trees
/// ([`OrdMap`], [`OrdSet`]), so a clone is O(1) and a later write copies one path of the
/// tree, never the whole map. They iterate in key order like `BTreeMap`, and encode the same.
///
/// `submissions`, `unfinished`, `drivers`, `job_counts`, `ended` and `holding_outputs` are
/// indexes derived from `jobs`, and `actors_by_job` from `actors`, kept by `apply` (and by
/// [`ClusterState::reindex`] for a state built by hand); of them only `submissions` is left
/// out of the encoding and rebuilt by a decode.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterState {
    /// The last log index applied; saved with the state so a restart never applies an entry
    /// twice.
    pub applied_index: u64,
    /// How many commands were applied in total (a cross-check that nothing ran twice).
    pub applied_commands: u64,
    pub next_node_id: u64,
    pub next_job_id: u64,
    pub nodes: OrdMap<NodeId, NodeRecord>,
    /// Shared records, so the path a write copies holds pointers rather than specs and
    /// outputs; `apply` copies a record on write.
    pub jobs: OrdMap<JobId, Arc<JobRecord>>,
    /// Which job each submission became, so a retried submission finds its job. Derived from
    /// the jobs and not encoded: its keys are random, so the jobs submitted between two
    /// snapshots would change every chunk of it (`state/encoding.rs`). Every decode rebuilds
    /// it ([`ClusterState::decode`], [`crate::client::SchedulerClient::read_state`]).
    #[serde(skip)]
    pub submissions: OrdMap<SubmissionId, JobId>,
    pub actors: OrdMap<ActorId, ActorRecord>,
    /// Bounded by the cached fingerprints, not by jobs; a plain map.
    pub cache: CacheIndex,
    /// Jobs not yet ended (pending or running), so the leader's driver loop and heartbeats
    /// never scan the finished ones.
    pub unfinished: OrdSet<JobId>,
    /// Running jobs by the node running their driver, so a heartbeat finds its node's
    /// drivers without scanning the unfinished jobs.
    pub drivers: OrdMap<NodeId, OrdSet<JobId>>,
    /// Released output blocks that some alive node may still hold; the leader sends their
    /// nodes `Free` and commits `OutputsFreed` when they answer. Bounded by the outputs
    /// awaiting `Free`, not by jobs; a plain map.
    pub outputs_to_free: BTreeMap<JobId, Vec<OutputBlock>>,
    /// The jobs in each status.
    pub job_counts: JobCounts,
    /// Finished jobs by (when they ended, id), so the jobs due for the history are a prefix
    /// rather than a scan.
    pub ended: OrdSet<(u64, JobId)>,
    /// Succeeded jobs still holding output blocks nobody let go, by (when they ended, id), so
    /// the outputs due to expire are a prefix rather than a scan.
    pub holding_outputs: OrdSet<(u64, JobId)>,
    /// Each job's actors, so a job's end removes its own without a scan of every actor.
    pub actors_by_job: OrdMap<JobId, OrdSet<ActorId>>,
    /// How each indexed fingerprint was used; an entry goes with the fingerprint's last shard.
    /// Bounded by the cache index; a plain map.
    pub cache_use: BTreeMap<String, CacheUse>,
}

impl ClusterState {
    pub fn encode(&self) -> Result<Vec<u8>> {
        Ok(codec::encode(self)?)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut state: Self = codec::decode(bytes, "cluster state snapshot")?;
        state.index_submissions();
        Ok(state)
    }

    /// Rebuilds `submissions`, which is not encoded, from the jobs.
    pub fn index_submissions(&mut self) {
        self.submissions = self
            .jobs
            .values()
            .map(|job| (job.submission, job.id))
            .collect();
    }

    /// Records that the entry at `index` was applied without a command (an empty entry a new
    /// leader appends).
    pub fn skip(&mut self, index: u64) {
        self.applied_index = self.applied_index.max(index);
    }

    /// Applies the command committed at `index`, proposed at `at_ms` on the leader's clock.
    /// Returns `None` when `index` was already applied, which only a bug could cause and which
    /// must never change the state.
    pub fn apply(&mut self, index: u64, at_ms: u64, command: Command) -> Option<Outcome> {
        if index <= self.applied_index {
            tracing::error!(
                index,
                applied = self.applied_index,
                "refusing to apply a log entry twice"
            );
            return None;
        }
        self.applied_index = index;
        self.applied_commands += 1;
        Some(self.apply_command(index, at_ms, command))
    }

    fn apply_command(&mut self, index: u64, at_ms: u64, command: Command) -> Outcome {
        match command {
            Command::RegisterNode {
                addresses,
                resources,
                memory,
                labels,
                replaces,
            } => {
                let id = NodeId::new(self.next_node_id + 1);
                if let Some(old) = replaces {
                    match self.nodes.get(&old) {
                        Some(record) if record.is_alive() && record.addresses != addresses => {
                            return Outcome::Rejected(format!(
                                "node {old} is alive at {}, not at {}: a node replaces only \
                                 its own predecessor at its address",
                                record.addresses.rpc, addresses.rpc
                            ));
                        }
                        Some(record) if record.is_alive() => {
                            let reason = format!(
                                "replaced by node {id}, which registered at its address {}",
                                addresses.rpc
                            );
                            self.mark_dead(index, at_ms, old, reason);
                        }
                        // Dead already, or gone from the state: nothing is left to retire.
                        _ => {}
                    }
                }
                self.next_node_id += 1;
                self.nodes.insert(
                    id,
                    NodeRecord {
                        id,
                        addresses,
                        resources,
                        memory,
                        labels,
                        liveness: Liveness::Alive,
                    },
                );
                Outcome::NodeRegistered(id)
            }
            Command::MarkNodeDead { node, reason } => self.mark_dead(index, at_ms, node, reason),
            Command::SubmitJob {
                spec,
                submission,
                name,
            } => {
                // A client that lost the reply submits again with the same id: same job.
                if let Some(existing) = self.submissions.get(&submission) {
                    return Outcome::JobSubmitted(*existing);
                }
                self.next_job_id += 1;
                let id = JobId::new(self.next_job_id);
                self.submissions.insert(submission, id);
                self.unfinished.insert(id);
                self.job_counts.add(&JobStatus::Pending);
                self.jobs.insert(
                    id,
                    Arc::new(JobRecord {
                        id,
                        submission,
                        name,
                        spec,
                        status: JobStatus::Pending,
                        driver: None,
                        attempts: 0,
                        cancel_requested: false,
                        stats: None,
                        outputs: Vec::new(),
                        submitted_at_ms: at_ms,
                        started_at_ms: None,
                        ended_at_ms: None,
                        release: None,
                    }),
                );
                Outcome::JobSubmitted(id)
            }
            Command::StartDriver { job, node } => {
                if !self.nodes.get(&node).is_some_and(NodeRecord::is_alive) {
                    return Outcome::Rejected(format!("node {node} is not alive"));
                }
                let Some(record) = self.jobs.get_mut(&job).map(Arc::make_mut) else {
                    return Outcome::Rejected(format!("no job {job}"));
                };
                if record.status != JobStatus::Pending {
                    return Outcome::Rejected(format!(
                        "job {job} is {}, not pending",
                        record.status.name()
                    ));
                }
                record.driver = Some(node);
                self.drivers.entry(node).or_default().insert(job);
                self.job_counts
                    .moved(&JobStatus::Pending, &JobStatus::Running);
                record.status = JobStatus::Running;
                record.attempts += 1;
                record.started_at_ms.get_or_insert(at_ms);
                let actor = driver_actor(job, record.attempts);
                self.add_actor(ActorRecord {
                    id: actor,
                    kind: DRIVER_ACTOR_KIND.to_owned(),
                    node,
                    job,
                });
                Outcome::Applied
            }
            Command::FinishJob {
                job,
                attempt,
                outcome,
            } => {
                let Some(record) = self.jobs.get_mut(&job).map(Arc::make_mut) else {
                    return Outcome::Rejected(format!("no job {job}"));
                };
                if record.status.is_finished() {
                    return Outcome::Rejected(format!("job {job} has already ended"));
                }
                // A pending job's driver was declared gone; its late outcome must not end the
                // job before the next driver runs it.
                if record.status != JobStatus::Running {
                    return Outcome::Rejected(format!(
                        "job {job} has no running driver (it is {})",
                        record.status.name()
                    ));
                }
                if attempt != record.attempts {
                    return Outcome::Rejected(format!(
                        "driver attempt {attempt} of job {job} was superseded by attempt {}",
                        record.attempts
                    ));
                }
                if !outcome.status.is_finished() {
                    return Outcome::Rejected(format!(
                        "a job cannot finish as {}",
                        outcome.status.name()
                    ));
                }
                self.job_counts.moved(&record.status, &outcome.status);
                record.status = outcome.status;
                for operator in &outcome.stats.operators {
                    if let Some(fingerprint) = operator.fingerprint
                        && operator.cache_hits > 0
                        && let Some(used) = self.cache_use.get_mut(&fingerprint.to_string())
                    {
                        used.hits += operator.cache_hits;
                        used.last_used_ms = at_ms;
                    }
                }
                record.stats = Some(outcome.stats);
                record.outputs = outcome.outputs;
                if let Some(node) = record.driver.take() {
                    remove_driver(&mut self.drivers, node, job);
                }
                record.ended_at_ms = Some(at_ms);
                if record.status == JobStatus::Succeeded && !record.outputs.is_empty() {
                    self.holding_outputs.insert((at_ms, job));
                }
                self.ended.insert((at_ms, job));
                self.unfinished.remove(&job);
                self.remove_job_actors(job);
                Outcome::Applied
            }
            Command::CancelJob { job } => {
                let Some(record) = self.jobs.get_mut(&job).map(Arc::make_mut) else {
                    return Outcome::Rejected(format!("no job {job}"));
                };
                match record.status {
                    JobStatus::Pending => {
                        self.job_counts
                            .moved(&JobStatus::Pending, &JobStatus::Cancelled);
                        record.status = JobStatus::Cancelled;
                        record.ended_at_ms = Some(at_ms);
                        self.ended.insert((at_ms, job));
                        self.unfinished.remove(&job);
                    }
                    JobStatus::Running => record.cancel_requested = true,
                    _ => return Outcome::Rejected(format!("job {job} has already ended")),
                }
                Outcome::Applied
            }
            Command::RegisterActor {
                actor,
                kind,
                node,
                job,
            } => {
                if !self.nodes.get(&node).is_some_and(NodeRecord::is_alive) {
                    return Outcome::Rejected(format!("node {node} is not alive"));
                }
                if !self.job_is_running(job) {
                    return Outcome::Rejected(format!("job {job} is not running"));
                }
                self.add_actor(ActorRecord {
                    id: actor,
                    kind,
                    node,
                    job,
                });
                Outcome::Applied
            }
            Command::RemoveActor { actor } => match self.remove_actor(actor) {
                Some(_) => Outcome::Applied,
                None => Outcome::Rejected(format!("no actor {actor}")),
            },
            Command::RecordCacheShard {
                fingerprint,
                shard_count,
                rank,
                shard,
                origin,
            } => {
                if rank >= shard_count {
                    return Outcome::Rejected(format!(
                        "shard rank {rank} is not below the shard count {shard_count}"
                    ));
                }
                if !self
                    .nodes
                    .get(&shard.node)
                    .is_some_and(NodeRecord::is_alive)
                {
                    return Outcome::Rejected(format!("node {} is not alive", shard.node));
                }
                self.cache_use
                    .entry(fingerprint.clone())
                    .or_default()
                    .last_used_ms = at_ms;
                let entry = self
                    .cache
                    .entry(fingerprint)
                    .or_default()
                    .entry(shard_count)
                    .or_default();
                entry.shards.insert(rank, shard);
                // A job's first shard dates the entry; a later job writing it again (a
                // recompute) makes it anew.
                if let Some(origin) = origin
                    && entry
                        .made_by
                        .as_ref()
                        .is_none_or(|made| made.origin.job != origin.job)
                {
                    entry.made_by = Some(CacheProvenance {
                        origin,
                        created_at_ms: at_ms,
                    });
                }
                Outcome::Applied
            }
            Command::EvictCache { fingerprint } => match self.cache.remove(&fingerprint) {
                Some(_) => {
                    self.cache_use.remove(&fingerprint);
                    Outcome::Applied
                }
                None => Outcome::Rejected(format!("no cache entry {fingerprint}")),
            },
            Command::ForgetCacheShard {
                fingerprint,
                shard_count,
                rank,
                node,
            } => self.forget_shard(&fingerprint, shard_count, rank, node),
            Command::ReleaseJobOutput { job } => self.release_output(job, at_ms),
            Command::DeleteJob { job } => self.delete_job(job, at_ms),
            Command::ExpireJobOutputs { jobs, ttl_ms } => self.expire_outputs(&jobs, ttl_ms, at_ms),
            Command::OutputsFreed { job, nodes } => self.outputs_freed(job, &nodes),
            Command::PruneJobs { jobs } => self.prune_jobs(&jobs, at_ms),
            Command::ForgetNodes { nodes, dead_for_ms } => {
                self.forget_nodes(&nodes, dead_for_ms, at_ms)
            }
        }
    }

    fn forget_shard(&mut self, fingerprint: &str, count: u32, rank: u32, node: NodeId) -> Outcome {
        let Some(by_count) = self.cache.get_mut(fingerprint) else {
            return Outcome::Rejected(format!("no cache entry {fingerprint}"));
        };
        let Some(entry) = by_count.get_mut(&count) else {
            return Outcome::Rejected(format!("no {count}-shard entry of {fingerprint}"));
        };
        if entry
            .shards
            .get(&rank)
            .is_none_or(|shard| shard.node != node)
        {
            return Outcome::Rejected(format!(
                "shard {rank} of {count} of {fingerprint} is not recorded on node {node}"
            ));
        }
        entry.shards.remove(&rank);
        if entry.shards.is_empty() {
            by_count.remove(&count);
        }
        if by_count.is_empty() {
            self.cache.remove(fingerprint);
            self.cache_use.remove(fingerprint);
        }
        Outcome::Applied
    }

    /// A dead node's actors and cached shards are gone with it; a job whose driver ran there
    /// goes back to pending so the leader starts its driver elsewhere.
    fn mark_dead(&mut self, index: u64, at_ms: u64, node: NodeId, reason: String) -> Outcome {
        let Some(record) = self.nodes.get_mut(&node) else {
            return Outcome::Rejected(format!("no node {node}"));
        };
        if !record.is_alive() {
            return Outcome::Rejected(format!("node {node} is already dead"));
        }
        record.liveness = Liveness::Dead {
            index,
            at_ms,
            reason,
        };
        // A node's death is rare; its actors are found by a scan.
        let hosted: Vec<ActorId> = self
            .actors
            .values()
            .filter(|actor| actor.node == node)
            .map(|actor| actor.id)
            .collect();
        for actor in hosted {
            self.remove_actor(actor);
        }
        for by_count in self.cache.values_mut() {
            for entry in by_count.values_mut() {
                entry.shards.retain(|_, shard| shard.node != node);
            }
            by_count.retain(|_, entry| !entry.shards.is_empty());
        }
        self.cache.retain(|_, by_count| !by_count.is_empty());
        let cache = &self.cache;
        self.cache_use
            .retain(|fingerprint, _| cache.contains_key(fingerprint));
        // Its copies of released outputs went with it.
        for blocks in self.outputs_to_free.values_mut() {
            blocks.retain(|block| block.node != node);
        }
        self.outputs_to_free.retain(|_, blocks| !blocks.is_empty());
        let orphaned = self.drivers.remove(&node).unwrap_or_default();
        for id in &orphaned {
            if let Some(job) = self.jobs.get_mut(id) {
                let job = Arc::make_mut(job);
                job.driver = None;
                self.job_counts.moved(&job.status, &JobStatus::Pending);
                job.status = JobStatus::Pending;
            }
        }
        // A dead driver's actors had nobody left to talk to them; the next attempt makes its
        // own.
        for job in &orphaned {
            self.remove_job_actors(*job);
        }
        Outcome::Applied
    }

    /// Deaths committed after log index `after`, oldest first.
    pub fn deaths_after(&self, after: u64) -> Vec<NodeDeath> {
        let mut deaths: Vec<NodeDeath> = self
            .nodes
            .values()
            .filter_map(|node| match &node.liveness {
                Liveness::Dead { index, reason, .. } if *index > after => Some(NodeDeath {
                    node: node.id,
                    index: *index,
                    reason: reason.clone(),
                }),
                _ => None,
            })
            .collect();
        deaths.sort_by_key(|death| death.index);
        deaths
    }

    /// Running jobs whose driver is on `node`, with their attempt numbers.
    pub fn drivers_on(&self, node: NodeId) -> Vec<(JobId, u32)> {
        drivers_on(&self.drivers, &self.jobs, node)
    }

    /// The nodes and who drives what, for answering heartbeats off the Raft loop; O(1).
    pub fn node_directory(&self) -> NodeDirectory {
        NodeDirectory {
            applied_index: self.applied_index,
            nodes: self.nodes.clone(),
            drivers: self.drivers.clone(),
            jobs: self.jobs.clone(),
        }
    }

    /// Whether `job` is known and running.
    pub fn job_is_running(&self, job: JobId) -> bool {
        self.jobs
            .get(&job)
            .is_some_and(|record| record.status == JobStatus::Running)
    }

    /// Whether `node` runs any job's driver.
    pub fn drives_a_job(&self, node: NodeId) -> bool {
        self.drivers.contains_key(&node)
    }

    /// The jobs not yet ended, through the index (never a scan of every job).
    pub fn unfinished_jobs(&self) -> impl Iterator<Item = &JobRecord> {
        self.unfinished
            .iter()
            .filter_map(|id| self.jobs.get(id).map(Arc::as_ref))
    }

    pub fn alive_nodes(&self) -> impl Iterator<Item = &NodeRecord> {
        self.nodes.values().filter(|node| node.is_alive())
    }

    /// Records `actor` and indexes it under its job.
    fn add_actor(&mut self, actor: ActorRecord) {
        let (id, job) = (actor.id, actor.job);
        if let Some(replaced) = self.actors.insert(id, actor)
            && replaced.job != job
        {
            self.unindex_actor(&replaced);
        }
        self.actors_by_job.entry(job).or_default().insert(id);
    }

    fn remove_actor(&mut self, actor: ActorId) -> Option<ActorRecord> {
        let removed = self.actors.remove(&actor)?;
        self.unindex_actor(&removed);
        Some(removed)
    }

    fn unindex_actor(&mut self, actor: &ActorRecord) {
        if let Some(actors) = self.actors_by_job.get_mut(&actor.job) {
            actors.remove(&actor.id);
            if actors.is_empty() {
                self.actors_by_job.remove(&actor.job);
            }
        }
    }

    /// Removes `job`'s actors, through the index.
    fn remove_job_actors(&mut self, job: JobId) {
        for actor in self.actors_by_job.remove(&job).unwrap_or_default() {
            self.actors.remove(&actor);
        }
    }

    /// Recomputes the indexes derived from `jobs` (`submissions`, `unfinished`, `drivers`,
    /// `job_counts`, `ended`, `holding_outputs`) and from `actors` (`actors_by_job`), for a state whose
    /// jobs and actors were set field by field rather than applied (test fixtures); `apply`
    /// keeps them without it.
    pub fn reindex(&mut self) {
        self.index_submissions();
        self.unfinished = OrdSet::new();
        self.drivers = OrdMap::new();
        self.job_counts = JobCounts::default();
        self.ended = OrdSet::new();
        self.holding_outputs = OrdSet::new();
        self.actors_by_job = OrdMap::new();
        for actor in self.actors.values() {
            self.actors_by_job
                .entry(actor.job)
                .or_default()
                .insert(actor.id);
        }
        for job in self.jobs.values() {
            self.job_counts.add(&job.status);
            if !job.status.is_finished() {
                self.unfinished.insert(job.id);
            }
            if let Some(node) = job.driver {
                self.drivers.entry(node).or_default().insert(job.id);
            }
            if let (true, Some(ended)) = (job.status.is_finished(), job.ended_at_ms) {
                self.ended.insert((ended, job.id));
                if job.status == JobStatus::Succeeded
                    && job.release.is_none()
                    && !job.outputs.is_empty()
                {
                    self.holding_outputs.insert((ended, job.id));
                }
            }
        }
    }
}

/// The part of a [`ClusterState`] a node's heartbeat is answered from: which nodes are alive
/// and which drivers each runs. Its maps share structure with the state's, so taking one is
/// O(1) however many jobs and nodes there are.
#[derive(Debug, Clone, Default)]
pub struct NodeDirectory {
    pub applied_index: u64,
    nodes: OrdMap<NodeId, NodeRecord>,
    drivers: OrdMap<NodeId, OrdSet<JobId>>,
    jobs: OrdMap<JobId, Arc<JobRecord>>,
}

impl NodeDirectory {
    pub fn is_alive(&self, node: NodeId) -> bool {
        self.nodes.get(&node).is_some_and(NodeRecord::is_alive)
    }

    /// Running jobs whose driver is on `node`, with their attempt numbers.
    pub fn drivers_on(&self, node: NodeId) -> Vec<(JobId, u32)> {
        drivers_on(&self.drivers, &self.jobs, node)
    }
}

fn drivers_on(
    drivers: &OrdMap<NodeId, OrdSet<JobId>>,
    jobs: &OrdMap<JobId, Arc<JobRecord>>,
    node: NodeId,
) -> Vec<(JobId, u32)> {
    drivers
        .get(&node)
        .into_iter()
        .flatten()
        .filter_map(|id| jobs.get(id))
        .map(|job| (job.id, job.attempts))
        .collect()
}

/// Forgets that `node` runs `job`'s driver; a node running none leaves the index.
fn remove_driver(drivers: &mut OrdMap<NodeId, OrdSet<JobId>>, node: NodeId, job: JobId) {
    if let Some(jobs) = drivers.get_mut(&node) {
        jobs.remove(&job);
        if jobs.is_empty() {
            drivers.remove(&node);
        }
    }
}

mod encoding;
mod lifecycle;
#[cfg(test)]
mod tests;

pub use self::encoding::{EncodedState, Piece};
pub use self::lifecycle::{
    JobSummary, MAX_PER_COMMAND, OutputRelease, ReleaseReason, Removal, utc_time,
};
