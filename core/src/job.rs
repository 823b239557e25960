//! What a job is on the wire and in the scheduler's table: the submitted spec (a logical plan
//! and its options), the progress a driver reports while it runs, and the stats and output
//! blocks it commits when it ends. The scheduler stores the spec as opaque bytes and these
//! types as they are; only the driver interprets them.

use serde::{Deserialize, Serialize};

use crate::plan::LogicalPlan;
use crate::wire::codec;
use crate::{ActorId, Fingerprint, NodeId, ObjectId, WireError};

/// How a job uses the fingerprint cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum CacheMode {
    /// Reuse cached outputs and cache what the planner caches by default.
    #[default]
    Reuse,
    /// Compute everything and overwrite the cached outputs.
    Recompute,
    /// Neither read nor write the cache.
    NoCache,
}

/// How a job hands its output blocks to the client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResultDelivery {
    /// The job ends when its output is complete; the blocks stay held for the client until
    /// it releases them (or `jobs.result_ttl` passes), and `FinishJob` lists them.
    #[default]
    Held,
    /// The driver's node hands each output block to the client as the job produces it
    /// (`NextOutputs`, a long-poll that also acknowledges what the client has read), and
    /// the driver frees each block once acknowledged. Production of the final operator
    /// pauses while more than `buffer_bytes` of output wait unacknowledged; the job ends
    /// only when the client has acknowledged every block, so it holds nothing afterwards.
    Streamed { buffer_bytes: u64 },
}

/// Per-job settings besides the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobOptions {
    pub cache: CacheMode,
    /// Held for the client, or streamed to it.
    pub result: ResultDelivery,
    /// How many times a failed task is run again before the job fails.
    pub max_task_retries: u32,
    /// The share of the cluster's object-store memory the job may keep in flight, in
    /// thousandths (500 = half).
    pub object_store_budget_permille: u32,
}

impl Default for JobOptions {
    fn default() -> Self {
        Self {
            cache: CacheMode::Reuse,
            result: ResultDelivery::Held,
            max_task_retries: 3,
            object_store_budget_permille: 500,
        }
    }
}

/// A submitted job: the logical plan (random seeds resolved) and its options.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobSpec {
    pub plan: LogicalPlan,
    pub options: JobOptions,
}

impl JobSpec {
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        codec::encode(self)
    }

    /// Decodes and revalidates a spec (the plan is rebuilt node by node).
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        codec::decode(bytes, "job spec")
    }
}

/// What separates a stage's kind from the row-wise operators fused into it in an operator's
/// name: `read→filter→with_column`.
pub const FUSED_SEPARATOR: char = '→';

/// The stage kind an operator's name starts with: `read` for `read→filter`.
pub fn stage_kind(name: &str) -> &str {
    name.split(FUSED_SEPARATOR).next().unwrap_or(name)
}

/// One operator's progress while a job runs, reported by its driver as soft state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorProgress {
    pub name: String,
    pub rows_done: u64,
    pub blocks_done: u64,
    pub bytes_done: u64,
    /// Tasks the operator will run in total, when known.
    pub tasks_total: Option<u64>,
    pub tasks_done: u64,
    pub tasks_running: u64,
    pub tasks_queued: u64,
}

/// A running job's progress, one entry per operator in plan order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobProgress {
    /// Which driver attempt reported it (1 for the first driver).
    pub attempt: u32,
    pub operators: Vec<OperatorProgress>,
    /// The job's actors other than its driver (hash shuffles' aggregators) that run now.
    pub actors: Vec<ActorProgress>,
}

/// What the driver has asked of one of its actors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorProgress {
    pub actor: ActorId,
    /// Calls sent to it (pushes of shards and reduces).
    pub calls: u64,
    /// Times its slot's actor was created again after one was gone.
    pub restarts: u32,
}

/// What one operator did, once the job has ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorStats {
    pub name: String,
    pub fingerprint: Option<Fingerprint>,
    pub wall_ms: u64,
    /// Tasks that computed blocks (not counting cache loads).
    pub tasks: u64,
    /// Task runs that failed and were run again.
    pub retries: u64,
    /// Tasks run again to rebuild blocks lost with a node.
    pub rebuilt: u64,
    /// Rows the operator made: in its output blocks, or written to a sink by its tasks.
    pub rows: u64,
    pub bytes: u64,
    /// Shards served from the cache.
    pub cache_hits: u64,
    /// Shards looked up in the cache and computed.
    pub cache_misses: u64,
    /// For a shuffle with a partition far larger than the others: that partition's most
    /// frequent key and its share of the partition.
    pub hot_key: Option<String>,
    /// For a hash shuffle: the aggregator actors it created (retried creations included),
    /// and how many of those replaced one that was gone (with its node, or answering `Gone`).
    pub aggregators: u64,
    pub aggregators_recreated: u64,
}

/// The stats of a job's last driver attempt.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobStats {
    pub attempt: u32,
    pub wall_ms: u64,
    /// Bytes the cluster's object stores spilled to disk while the job ran (spilling is a
    /// store's decision, not an operator's, so it is counted per job).
    pub spilled_bytes: u64,
    pub operators: Vec<OperatorStats>,
}

impl JobStats {
    /// Tasks that computed blocks, over every operator.
    pub fn compute_tasks(&self) -> u64 {
        self.operators.iter().map(|operator| operator.tasks).sum()
    }

    pub fn retries(&self) -> u64 {
        self.operators.iter().map(|operator| operator.retries).sum()
    }

    pub fn cache_hits(&self) -> u64 {
        self.operators
            .iter()
            .map(|operator| operator.cache_hits)
            .sum()
    }
}

/// One block of a finished job's output, in output order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputBlock {
    pub object: ObjectId,
    /// The node whose object store holds it.
    pub node: NodeId,
    pub rows: u64,
    pub bytes: u64,
}
