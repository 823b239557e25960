//! The RPC service every node agent serves on `node.rpc_port`: tasks from drivers, and object
//! transfer between nodes.

use floe_core::wire::Protocol;
use floe_core::{NodeId, ObjectId, TaskId};
use floe_objectstore::StoreStats;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub struct NodeProtocol;

impl Protocol for NodeProtocol {
    const NAME: &'static str = "node";
    type Request = NodeRequest;
    type Response = NodeResponse;
}

/// Object bytes on the wire, encoded as one length-prefixed byte string rather than a
/// sequence of single bytes, so multi-megabyte chunks encode and decode at memcpy speed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bytes(pub Vec<u8>);

impl Serialize for Bytes {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BytesVisitor;
        impl serde::de::Visitor<'_> for BytesVisitor {
            type Value = Bytes;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a byte string")
            }
            fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<Bytes, E> {
                Ok(Bytes(bytes.to_vec()))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, bytes: Vec<u8>) -> Result<Bytes, E> {
                Ok(Bytes(bytes))
            }
        }
        deserializer.deserialize_byte_buf(BytesVisitor)
    }
}

/// A built-in task a worker process can run. Plan stages are not serializable yet, so the
/// agent runs these; they exercise every path a stage task takes (zero-copy inputs, outputs
/// written into the store, long runs that can be killed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskKind {
    /// Does nothing for `ms` milliseconds; no outputs.
    Sleep { ms: u64 },
    /// One output: the xxh3-64 of each input's bytes, 8 little-endian bytes per input.
    Hash,
    /// One output of `bytes` bytes where byte `i` is `(i + seed) % 251`.
    Fill { bytes: u64, seed: u64 },
}

/// An input of a task: an object, and the node holding it when it is not on the node that runs
/// the task (the agent pulls it first).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputRef {
    pub object: ObjectId,
    /// The holder's node RPC address (`host:port`).
    pub holder: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSpec {
    pub task: TaskId,
    pub kind: TaskKind,
    pub inputs: Vec<InputRef>,
}

/// An object a task wrote into its node's store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputRef {
    pub object: ObjectId,
    pub size: u64,
    /// xxh3-64 of the bytes.
    pub checksum: u64,
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
    #[error("the node is shutting down")]
    ShuttingDown,
}

impl TaskFailure {
    /// Whether running the task again (elsewhere) may succeed.
    pub fn retryable(&self) -> bool {
        !matches!(self, TaskFailure::Error { .. })
    }
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
    pub store: StoreStats,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeRequest {
    /// Runs a task on an idle worker of this node, pulling remote inputs first.
    RunTask(TaskSpec),
    /// Size and checksum of a local object (its bytes too when small).
    ObjectMeta {
        object: ObjectId,
    },
    /// Bytes `offset..offset + len` of a local object.
    ReadChunk {
        object: ObjectId,
        offset: u64,
        len: u64,
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
    Status,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeResponse {
    Task(Result<Vec<OutputRef>, TaskFailure>),
    ObjectMeta(ObjectMeta),
    Chunk(Bytes),
    /// The object is in this node's store, checksum verified.
    Pulled(OutputRef),
    Freed,
    Status(Box<NodeStatus>),
}
