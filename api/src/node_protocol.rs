//! The RPC service every node agent serves on `node.rpc_port`: tasks from drivers, object
//! transfer between nodes, and calls to the actors the node hosts (or routes).

use arrow_schema::Schema;
use floe_core::fingerprint::FingerprintInputs;
use floe_core::hash::xxh3_128;
use floe_core::job::OutputBlock;
use floe_core::plan::task::StageTask;
use floe_core::wire::Protocol;
use floe_core::{ActorId, Fingerprint, JobId, NodeId, ObjectId, TaskId};
use serde::{Deserialize, Serialize};

/// The id of a task's `index`-th output: derived from the task id (as Ray derives return
/// object ids), so a retried task names its outputs the same way.
pub fn output_id(task: TaskId, index: u32) -> ObjectId {
    let mut seed = [0u8; 20];
    seed[..16].copy_from_slice(&task.get().to_le_bytes());
    seed[16..].copy_from_slice(&index.to_le_bytes());
    ObjectId::new(xxh3_128(&seed))
}

pub struct NodeProtocol;

impl Protocol for NodeProtocol {
    const NAME: &'static str = "node";
    type Request = NodeRequest;
    type Response = NodeResponse;
}

/// Object bytes on the wire, encoded as one length-prefixed byte string rather than a
/// sequence of single bytes, so multi-megabyte chunks encode and decode at memcpy speed.
pub use floe_core::wire::bytes::Bytes;

/// What a worker process runs: one task of a plan stage, or (built with the `test-tasks`
/// feature only) a test task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TaskKind {
    /// One task of a plan stage; its input blocks are the task's inputs, in order.
    Stage(Box<StageTask>),
    /// A task tests run to exercise the task path without a plan. A binary
    /// built without the feature has no such variant, so its node refuses one as a request
    /// it cannot decode.
    #[cfg(feature = "test-tasks")]
    Test(TestTask),
}

impl TaskKind {
    /// The stage task, unless this is a test task: lets code that runs only stage tasks say
    /// so the same way whether or not the `test-tasks` feature is on.
    pub fn as_stage(&self) -> Option<&StageTask> {
        match self {
            TaskKind::Stage(task) => Some(task),
            #[cfg(feature = "test-tasks")]
            TaskKind::Test(_) => None,
        }
    }
}

/// The test-only task kinds (feature `test-tasks`), run by the node's workers.
#[cfg(feature = "test-tasks")]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TestTask {
    /// Does nothing for `ms` milliseconds; no outputs.
    Sleep { ms: u64 },
    /// One output: the xxh3-64 of each input's bytes, 8 little-endian bytes per input.
    Hash,
    /// One output of `bytes` bytes where byte `i` is `(i + seed) % 251`.
    Fill { bytes: u64, seed: u64 },
    /// The output of `Fill`, written half, then a pause of `ms` milliseconds, then the rest:
    /// a worker to kill while it writes an object.
    StallMidWrite { bytes: u64, seed: u64, ms: u64 },
    /// Touches `bytes` bytes of the worker's own memory, page by page; no outputs. A task
    /// whose process grows, for the memory monitor.
    Grow { bytes: u64 },
}

/// An input of a task: an object (or one block packed in it), and the node holding it when it
/// is not on the node that runs the task (the agent pulls it first: a whole object into an
/// object of its own, a task's parts held by one node together into one object).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputRef {
    pub object: ObjectId,
    /// The holder's node RPC address (`host:port`).
    pub holder: Option<String>,
    /// The block, when it is one part of the object (a shuffle map task's partition).
    pub part: Option<Part>,
}

/// One block packed in a larger object: a shuffle map task's partition, in the one object the
/// map task wrote for all its partitions. Its bytes start 64-byte aligned in the object, so it
/// decodes in place like an object of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Part {
    /// Where its bytes are in the object.
    pub offset: u64,
    pub len: u64,
    pub rows: u64,
    /// xxh3-64 of its bytes, checked by whoever pulls them.
    pub checksum: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskSpec {
    pub task: TaskId,
    /// The job it works for: its outputs are the job's until freed, and `FreeJob` frees them.
    pub job: JobId,
    pub kind: TaskKind,
    pub inputs: Vec<InputRef>,
}

/// An object a task wrote into its node's store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputRef {
    pub object: ObjectId,
    pub size: u64,
    /// xxh3-64 of the bytes, when they were hashed whole (a shuffle map task's object is
    /// hashed part by part instead: `parts`).
    pub checksum: Option<u64>,
    /// The rows, when the object is a block or holds blocks.
    pub rows: Option<u64>,
    /// The blocks packed in it, in order, when it holds several (a shuffle map task's
    /// partitions: part `i` is partition `i`); empty for a single block.
    pub parts: Vec<Part>,
}

/// What a task that succeeded made: its output objects, in order, and the rows it wrote to a
/// sink (a write task's part, or a sink fused into the task), which lie in files, not objects.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskDone {
    pub outputs: Vec<OutputRef>,
    pub written_rows: u64,
}

impl TaskDone {
    /// The rows the task made: those in its objects and those it wrote.
    pub fn rows(&self) -> u64 {
        let in_objects: u64 = self.outputs.iter().filter_map(|output| output.rows).sum();
        in_objects + self.written_rows
    }
}

/// Why a task failed. The driver retries the retryable ones elsewhere.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum TaskFailure {
    /// The worker process running the task exited or was killed (not by the agent).
    #[error("worker process died: {reason}")]
    WorkerDied { reason: String },
    /// The memory monitor killed the task's worker because the host ran out of memory.
    #[error("out of memory: {reason}")]
    OutOfMemory { reason: String },
    #[error("input {object} is unavailable: {reason}")]
    InputUnavailable { object: ObjectId, reason: String },
    /// The task itself failed; running it again gives the same error.
    #[error("task error: {message}")]
    Error { message: String },
    /// The task failed on something outside floe's kernels (a process UDF's child crashed,
    /// hung or raised); running it again may succeed.
    #[error("task error: {message}")]
    Transient { message: String },
    #[error("the node is shutting down")]
    ShuttingDown,
    /// The driver cancelled the task (its job was cancelled).
    #[error("cancelled")]
    Cancelled,
}

impl TaskFailure {
    /// Whether running the task again (elsewhere) may succeed.
    pub fn retryable(&self) -> bool {
        !matches!(self, TaskFailure::Error { .. } | TaskFailure::Cancelled)
    }
}

/// What an actor is, as created on its node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorSpec {
    pub actor: ActorId,
    /// The job that owns it; the actor ends with the job.
    pub job: JobId,
    pub kind: ActorKind,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ActorKind {
    /// Receives a hash shuffle's map-side shards for the partitions it owns (those whose
    /// number is `slot` modulo `slots`), keeping them in its node's object store, and reduces
    /// each partition on its node.
    HashShuffleAggregator { slot: u32, slots: u32 },
}

impl ActorKind {
    /// The kind's name, as recorded in the scheduler's state.
    pub fn name(&self) -> &'static str {
        match self {
            ActorKind::HashShuffleAggregator { .. } => "HashShuffleAggregator",
        }
    }
}

/// One map-side shard pushed to an aggregator: the partition's part of a map task's object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushedShard {
    pub partition: u32,
    pub object: ObjectId,
    pub part: Part,
    /// Where the shard is, if not on the aggregator's node.
    pub holder: Option<String>,
}

/// A message to an actor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ActorMessage {
    /// Shards for the aggregator's partitions: it pulls them into its node's store now, while
    /// other map tasks still run.
    Push(Vec<PushedShard>),
    /// Reduces one partition on the aggregator's node. The task's inputs are the partition's
    /// shards; those already pushed are read where the aggregator keeps them.
    Reduce { partition: u32, task: TaskSpec },
    /// What the actor is and what it is doing; every actor answers it.
    Describe,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ActorReply {
    /// Bytes the aggregator now holds for its partitions.
    Pushed {
        held_bytes: u64,
    },
    /// What the partition's reduce made, and the worker process that ran it.
    Reduced {
        done: TaskDone,
        worker: Option<WorkerRef>,
    },
    Described(ActorDescription),
}

/// An actor's answer to [`ActorMessage::Describe`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorDescription {
    /// As recorded in the scheduler's state (`HashShuffleAggregator`, `JobDriver`).
    pub kind: String,
    pub job: JobId,
    /// The node hosting it.
    pub node: Option<NodeId>,
    /// One line on its state, for people.
    pub summary: String,
}

/// Why an actor call failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ActorFailure {
    /// No node hosts the actor (it was never created, was stopped, or died with its node).
    #[error("actor {actor} is gone: {reason}")]
    Gone { actor: ActorId, reason: String },
    /// The actor's node, or the scheduler that says where it is, did not answer; a later
    /// call may reach it.
    #[error("actor {actor} is unavailable: {reason}")]
    Unavailable { actor: ActorId, reason: String },
    /// The message is not one the actor accepts (e.g. a partition it does not own).
    #[error("actor {actor} refused the message: {reason}")]
    Refused { actor: ActorId, reason: String },
    /// A shard could not be pulled into the aggregator's node.
    #[error("actor {actor} could not pull shard {object}: {reason}")]
    Pull {
        actor: ActorId,
        object: ObjectId,
        reason: String,
    },
    /// The reduce task failed.
    #[error("{0}")]
    Task(TaskFailure),
}

/// A sealed object's size and checksum; small objects come with their bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectMeta {
    pub size: u64,
    /// xxh3-64 of the bytes, checked by the puller on arrival.
    pub checksum: u64,
    /// The bytes, when the object is at most `node.transfer_inline_max`.
    pub inline: Option<Bytes>,
}

/// A task running on the node, for operators and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunningTask {
    pub task: TaskId,
    pub worker_pid: u32,
    pub worker_slot: u32,
}

/// The worker process that ran a task: its slot in its node's pool (a lane of the job
/// page's timeline) and its pid (a slot's process changes when one dies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRef {
    pub slot: u32,
    pub pid: u32,
}

/// One worker slot of a node's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub slot: u32,
    /// Its process, once connected; `None` while one starts.
    pub pid: Option<u32>,
    /// The task it runs now.
    pub task: Option<TaskId>,
}

/// Where an object's bytes are now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ObjectResidence {
    Memory,
    Spilled,
    Fallback,
    /// A cache shard file served in place.
    CacheShard,
}

impl ObjectResidence {
    pub fn name(self) -> &'static str {
        match self {
            ObjectResidence::Memory => "memory",
            ObjectResidence::Spilled => "spilled",
            ObjectResidence::Fallback => "fallback",
            ObjectResidence::CacheShard => "cache shard",
        }
    }
}

/// One object of a node's store, for the largest-objects list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectSummary {
    pub object: ObjectId,
    pub size: u64,
    pub residence: ObjectResidence,
    /// Views reading it now (a pinned object is neither spilled nor freed).
    pub pins: u64,
    /// The job it was made for, when the node knows.
    pub job: Option<JobId>,
}

/// One process-UDF pool of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UdfPoolStatus {
    /// The UDF's command line.
    pub command: String,
    /// Children it keeps warm, and at most.
    pub min: u32,
    pub max: u32,
    /// Children being started now.
    pub starting: u32,
    pub processes: Vec<UdfProcessStatus>,
}

/// One live child of a process-UDF pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UdfProcessStatus {
    pub pid: u32,
    /// Leased to a task now, else idle.
    pub leased: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// `None` until the node has registered with the scheduler.
    pub node: Option<NodeId>,
    /// Worker processes connected and ready (idle or busy).
    pub workers: u32,
    pub running: Vec<RunningTask>,
    pub tasks_finished: u64,
    pub tasks_failed: u64,
    /// Worker processes started again after one died.
    pub workers_respawned: u64,
    /// Pulls that transferred an object (coalesced requests count once).
    pub pulls_started: u64,
    /// Object bytes pulled from the segments of other nodes on this host, read in place
    /// rather than over a socket (`LendRanges`).
    pub borrowed_bytes: u64,
    pub store: StoreUsage,
    /// The actors this node hosts.
    pub actors: Vec<ActorId>,
    /// Every worker slot of the pool.
    pub worker_slots: Vec<WorkerStatus>,
    /// The largest objects in the store, largest first (at most [`LARGEST_OBJECTS`]).
    pub largest_objects: Vec<ObjectSummary>,
    /// The node's process tree's CPU use over the last heartbeat interval, in thousandths
    /// of the node's CPUs (1000 = all of them busy).
    pub cpu_used_permille: u32,
    /// Private memory of the node's process tree (agent, workers, UDF children).
    pub heap_used_bytes: u64,
    pub udf_pools: Vec<UdfPoolStatus>,
}

/// How many of a store's largest objects a `Status` answer lists.
pub const LARGEST_OBJECTS: usize = 20;

/// One cache shard to write from objects in this node's store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardWrite {
    /// The lineage of the output (its fingerprint names the shard).
    pub lineage: FingerprintInputs,
    pub rank: u32,
    pub count: u32,
    /// The shard's blocks, in order; all local.
    pub blocks: Vec<ObjectId>,
    /// The blocks' schema (a shard of no blocks still records it).
    pub schema: Schema,
    /// Overwrite a shard that is already there.
    pub overwrite: bool,
}

/// A cache shard served by this node's store as one block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardLoad {
    /// The job the loaded block belongs to (see [`TaskSpec::job`]).
    pub job: JobId,
    pub fingerprint: Fingerprint,
    pub rank: u32,
    pub count: u32,
    /// The block's object id.
    pub object: ObjectId,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum NodeRequest {
    /// Runs a task on an idle worker of this node, pulling remote inputs first.
    RunTask(TaskSpec),
    /// Size and checksum of a local object (its bytes too when small).
    ObjectMeta {
        object: ObjectId,
    },
    /// Bytes `offset..offset + len` of a local object (cut at its end), sent as the reply's
    /// attachment: call it with `RpcClient::call_into`.
    ReadChunk {
        object: ObjectId,
        offset: u64,
        len: u64,
    },
    /// Byte ranges of local objects (each inside its object, else the request is refused; an
    /// empty one asks whether the object is here), sent one after the other as the reply's
    /// attachment: call it with `RpcClient::call_into_parts`. How a node pulls many blocks
    /// packed in other nodes' objects with few requests. A holder answers a bounded
    /// number of ranges (its `MAX_RANGES_PER_READ`) and a frame of bytes per request.
    ReadRanges {
        ranges: Vec<ByteRange>,
    },
    /// Where byte ranges of local objects lie in this node's shared-memory segment, for a node
    /// on the same host to read them itself instead of over a socket. The objects stay pinned
    /// until the connection's next request or its end. At most as many ranges as `ReadRanges`,
    /// of any length (no frame carries them). Refused unless every object is in the segment
    /// (not spilled, nor in a file of its own).
    LendRanges {
        ranges: Vec<ByteRange>,
    },
    /// Makes this node pull `object` from the node at `holder`.
    Pull {
        object: ObjectId,
        holder: String,
    },
    /// Deletes local objects (their owner no longer needs them).
    Free {
        objects: Vec<ObjectId>,
    },
    /// Stops a running or queued task; it fails with [`TaskFailure::Cancelled`].
    CancelTask {
        task: TaskId,
    },
    /// Writes one cache shard from local blocks; answers its rows and bytes on disk.
    WriteCacheShard(ShardWrite),
    /// Serves one cache shard as a block: the shard file itself, mapped, is the object (nothing
    /// is copied into the store's memory); `None` when the shard is gone or failed
    /// verification.
    LoadCacheShard(ShardLoad),
    /// Starts hosting an actor the scheduler placed here.
    CreateActor(ActorSpec),
    /// Delivers a message to an actor, wherever it is: a node that does not host it forwards
    /// the call (once) to the node the scheduler's state names.
    CallActor {
        actor: ActorId,
        message: ActorMessage,
        /// Set on a call one node already forwarded, so a stale route never loops.
        forwarded: bool,
    },
    /// Stops hosting an actor; its state (shards it pulled) is dropped.
    StopActor {
        actor: ActorId,
    },
    Status,
    /// Removes every cache shard file of these fingerprints from this node's cache directory
    /// (whoever asks has already dropped them from the index).
    RemoveCacheShards {
        fingerprints: Vec<Fingerprint>,
    },
    /// `floe cache clean` on this node's host: drops the shards from the index first, then
    /// removes their files; all of them, or the least recently used beyond `keep_bytes`.
    CleanCache {
        keep_bytes: Option<u64>,
    },
    /// Deletes every local object made for `job` (task outputs, loaded cache shards) except
    /// `keep`: what earlier driver attempts left when their node died.
    FreeJob {
        job: JobId,
        keep: Vec<ObjectId>,
    },
    /// The newest lines of this node's log files (agent, workers, process UDFs) that match.
    ReadLogs(LogQuery),
    /// The task table of `job`'s driver, if it ran (or runs) on this node.
    JobTasks {
        job: JobId,
    },
    /// A long-poll on a streamed job's output, sent to the node running its driver: the
    /// client has read (and so acknowledges) the first `from` output blocks, and asks for
    /// the next ones, waiting up to `wait_ms` for one or for the stream's end.
    NextOutputs {
        job: JobId,
        attempt: u32,
        from: u64,
        wait_ms: u64,
    },
}

/// Bytes `offset..offset + len` of an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ByteRange {
    pub object: ObjectId,
    pub offset: u64,
    pub len: u64,
}

/// Where the ranges a `LendRanges` asked for lie on the holder's host: all in its store's
/// shared-memory segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Loan {
    /// The host's boot id (`/proc/sys/kernel/random/boot_id`): the segment's name means this
    /// segment only to a process under the same running kernel.
    pub host: String,
    /// The segment's name (`/floe-<store>`), and its file's device and inode numbers: a file
    /// by that name with other numbers (another mount of /dev/shm) is not this segment.
    pub segment: String,
    pub device: u64,
    pub inode: u64,
    /// For each range asked for, in order, the offset of its first byte in the segment.
    pub offsets: Vec<u64>,
}

/// The next blocks of a streamed job's output, in output order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamedOutputs {
    /// The index of `blocks[0]` in the job's output (the `from` asked for).
    pub from: u64,
    pub blocks: Vec<OutputBlock>,
    /// How the stream ended, once it has: a complete output after its last block, a failure
    /// at once (blocks not yet read are freed).
    pub end: Option<StreamEnd>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StreamEnd {
    Complete,
    Failed { message: String },
    Cancelled,
}

/// The runs of a job's tasks, as the driver saw them: kept by the node that hosts the driver.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskTable {
    /// The driver attempt that made it (a new attempt starts a new table).
    pub attempt: u32,
    /// Oldest first.
    pub tasks: Vec<TaskRecord>,
    /// Finished runs left out (the oldest) to keep the table bounded.
    pub dropped: u64,
}

/// One run of one task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub task: TaskId,
    pub operator: String,
    /// The task's index within its operator.
    pub seq: u64,
    /// 1 for the first run of the task, 2 for its first retry, …
    pub attempt: u32,
    pub state: TaskRunState,
    /// Where it runs, once placed (a cache load's, once it has ended).
    pub node: Option<NodeId>,
    /// The worker process that ran it, once it has ended (cache loads run in none).
    pub worker: Option<WorkerRef>,
    pub rows: u64,
    pub bytes: u64,
    /// Unix milliseconds on the driver's node.
    pub started_ms: u64,
    pub ended_ms: Option<u64>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskRunState {
    Running,
    Succeeded,
    Failed,
}

impl TaskRunState {
    pub fn name(self) -> &'static str {
        match self {
            TaskRunState::Running => "running",
            TaskRunState::Succeeded => "succeeded",
            TaskRunState::Failed => "failed",
        }
    }
}

/// Which log lines a [`NodeRequest::ReadLogs`] wants.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogQuery {
    /// Only lines about this job (its driver's and its tasks' lines, which carry `job=ID`).
    pub job: Option<JobId>,
    /// At most this many lines, the newest.
    pub tail: u32,
    /// Only lines containing this text (case-insensitive).
    pub text: Option<String>,
    /// Only lines at this level or more severe.
    pub level: Option<LogLevel>,
}

/// A log line's severity, least severe first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

impl LogLevel {
    pub const ALL: [LogLevel; 5] = [
        LogLevel::Trace,
        LogLevel::Debug,
        LogLevel::Info,
        LogLevel::Warn,
        LogLevel::Error,
    ];

    /// The name logs print (`INFO`) and queries use in lower case (`info`).
    pub fn name(self) -> &'static str {
        match self {
            LogLevel::Trace => "TRACE",
            LogLevel::Debug => "DEBUG",
            LogLevel::Info => "INFO",
            LogLevel::Warn => "WARN",
            LogLevel::Error => "ERROR",
        }
    }

    /// Parses a level name in any case.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|level| level.name().eq_ignore_ascii_case(text))
    }
}

/// One line of a node's log file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLine {
    /// The file's name without rotation suffix: `agent.log`, `worker-0.log`, `udf-child-3.log`.
    pub source: String,
    /// When it was logged (RFC 3339, as the line says; a line without a time has its
    /// predecessor's, or none), which orders lines from several sources.
    pub time: Option<String>,
    pub level: Option<LogLevel>,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeResponse {
    /// The task was cancelled (or had already ended).
    Cancelled,
    /// A shard written: its rows and its file's bytes.
    CacheWritten {
        rows: u64,
        bytes: u64,
    },
    CacheLoaded(Option<OutputRef>),
    /// A task's outcome, and the worker process that ran it (none when it never reached
    /// one: cancelled while queued, an input that could not be pulled).
    Task {
        result: Result<TaskDone, TaskFailure>,
        worker: Option<WorkerRef>,
    },
    ObjectMeta(ObjectMeta),
    /// The bytes asked for (a chunk, or ranges) follow as the reply's attachment.
    Chunk,
    Lent(Loan),
    /// The object is in this node's store, checksum verified.
    Pulled(OutputRef),
    Freed,
    ActorCreated,
    Actor(Result<ActorReply, ActorFailure>),
    ActorStopped,
    Status(Box<NodeStatus>),
    /// Cache shard files removed: how many and their bytes.
    CacheRemoved {
        shards: u64,
        bytes: u64,
    },
    /// The log lines asked for, oldest first.
    Logs(Vec<LogLine>),
    /// The job's task table; none when its driver never ran here (or it was let go).
    Tasks(Option<TaskTable>),
    /// The next blocks of a streamed output; none when this node runs no driver streaming
    /// that attempt of the job (it ended, or never ran here).
    Outputs(Option<StreamedOutputs>),
}

/// A snapshot of a node's object store use, as the node reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreUsage {
    pub capacity: u64,
    /// Memory allocated to objects, headers included.
    pub used: u64,
    pub objects_in_memory: u64,
    /// Objects some view reads now, which can be neither spilled nor freed.
    pub pinned_bytes: u64,
    pub pinned_objects: u64,
    /// Bytes and objects whose copy is in a spill file now.
    pub spilled_bytes: u64,
    pub spilled_objects: u64,
    /// Bytes written to spill files and read back from them since the store opened.
    pub spilled_bytes_total: u64,
    pub restored_bytes_total: u64,
    /// Objects held in disk-backed fallback files now.
    pub fallback_bytes: u64,
    pub fallback_objects: u64,
    /// Cache shard files served in place as objects now (the page cache's memory, not the
    /// store's).
    pub shard_bytes: u64,
    pub shard_objects: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_ids_differ_by_task_and_index_and_are_stable() {
        let a = TaskId::new(1);
        let b = TaskId::new(2);
        assert_eq!(output_id(a, 0), output_id(a, 0));
        assert_ne!(output_id(a, 0), output_id(a, 1));
        assert_ne!(output_id(a, 0), output_id(b, 0));
    }

    /// `TaskKind::Test(TestTask::Sleep { ms: 0 })` on the wire: variant 1, variant 0, 0 ms.
    const SLEEP_TASK: &[u8] = &[1, 0, 0];

    #[cfg(feature = "test-tasks")]
    #[test]
    fn a_test_task_is_encoded_as_the_bytes_a_production_build_refuses() {
        let sleep = TaskKind::Test(TestTask::Sleep { ms: 0 });
        assert_eq!(floe_core::wire::codec::encode(&sleep).unwrap(), SLEEP_TASK);
    }

    /// Built without the feature, as the production `floe` is, the protocol has no test task:
    /// a node refuses one as a request it cannot decode.
    #[cfg(not(feature = "test-tasks"))]
    #[test]
    fn without_the_feature_a_test_task_does_not_decode() {
        let error = floe_core::wire::codec::decode::<TaskKind>(SLEEP_TASK, "a task kind")
            .expect_err("a test task decoded without the test-tasks feature");
        assert!(error.to_string().contains("variant index"), "{error}");
    }
}
