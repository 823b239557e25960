//! The `floe worker` process: connects to its agent's Unix socket, then runs one task at a time.
//!
//! Inputs arrive as [`ObjectLocation`]s the agent pinned; the worker maps them with a
//! [`StoreClient`] and reads them in place (a block's column buffers point into the mapping).
//! Outputs go back over the socket and the agent writes them into the store (the store's
//! writers live in the agent's process); a stage task's outputs are its blocks, each encoded
//! as the Arrow IPC file the store's block reader decodes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arrow::record_batch::RecordBatch;
use floe_core::TaskId;
use floe_core::plan::task::StageTask;
use floe_core::wire::{FramedStream, WireError, codec};
use floe_objectstore::block::{encode_block, read_block};
use floe_objectstore::{ObjectLocation, ObjectView, StoreClient};
use serde::{Deserialize, Serialize};
use tokio::net::UnixStream;

use floe_api::node_protocol::{Bytes, TaskKind};
use floe_engine::task::run_stage_task;
use floe_engine::udf::Registry;
use floe_engine::udf::process::ProcessEndpoint;

use crate::{Error, Result};

/// Why a task failed in this worker, as the worker reports it to its agent
/// ([`WorkerMessage::Failed`]).
struct WorkerTaskFailure {
    message: String,
    /// Whether running the task again may succeed.
    transient: bool,
}

impl WorkerTaskFailure {
    /// A failure that running the task again would repeat.
    fn permanent(reason: impl std::fmt::Display) -> Self {
        Self {
            message: reason.to_string(),
            transient: false,
        }
    }
}

impl From<floe_engine::Error> for WorkerTaskFailure {
    fn from(error: floe_engine::Error) -> Self {
        Self {
            transient: error.is_transient(),
            message: error.to_string(),
        }
    }
}

#[cfg(feature = "test-tasks")]
impl From<crate::test_tasks::TestTaskError> for WorkerTaskFailure {
    fn from(error: crate::test_tasks::TestTaskError) -> Self {
        Self::permanent(error)
    }
}

/// A task as the agent hands it to a worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct WorkerTask {
    pub task: TaskId,
    pub kind: TaskKind,
    pub inputs: Vec<ObjectLocation>,
    /// The process-UDF children the agent leased for this task, one per UDF it calls.
    pub processes: Vec<ProcessEndpoint>,
}

/// What a worker sends its agent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum WorkerMessage {
    /// The first message: which of the agent's worker slots this process fills.
    Hello {
        slot: u32,
    },
    /// The task's next output object: `len` bytes follow in [`WorkerMessage::Chunk`]s, so no
    /// frame is larger than a chunk however large the task's outputs are.
    Output {
        len: u64,
        rows: Option<u64>,
    },
    Chunk(Bytes),
    /// The task succeeded; every output has been sent.
    Finished,
    Failed {
        message: String,
        /// Whether running the task again may succeed.
        transient: bool,
    },
}

/// The largest chunk of an output in one frame.
pub(crate) const OUTPUT_CHUNK: usize = 4 << 20;

/// One object a task produced.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct WorkerOutput {
    pub bytes: Bytes,
    /// The rows, when the object is a block.
    pub rows: Option<u64>,
}

/// Sockets carry frames as large as a task's output; reads never wait on a slow peer, so one
/// generous timeout serves every frame once it has started.
pub(crate) const SOCKET_FRAME_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a worker waits, idle, for its next task: forever in practice (the agent closing
/// the socket ends the wait).
const IDLE_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// How to start a worker process.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub socket: PathBuf,
    pub slot: u32,
    /// The largest frame on the socket (the agent's `net.max_frame`).
    pub max_frame: usize,
}

/// Runs a worker until its agent closes the socket; UDFs in its tasks come from `udfs`.
pub fn run_worker(options: &WorkerOptions, udfs: Arc<Registry>) -> Result<()> {
    die_with_agent()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| Error::Io {
            op: "starting the worker's runtime",
            source,
        })?;
    runtime.block_on(serve(options, &udfs))
}

/// Asks the kernel to kill this process when the agent dies: a busy worker would otherwise
/// outlive a killed agent (it notices the closed socket only between tasks) and keep its
/// memory and CPU.
fn die_with_agent() -> Result<()> {
    let agent = std::os::unix::process::parent_id();
    // SAFETY: prctl with integer arguments only changes this process's death signal.
    let status = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    if status != 0 {
        return Err(Error::Io {
            op: "setting the worker's parent-death signal",
            source: std::io::Error::last_os_error(),
        });
    }
    // The agent may have died before the call; then no signal will ever come.
    if std::os::unix::process::parent_id() != agent {
        return Err(Error::Worker(
            "the agent exited while the worker started".into(),
        ));
    }
    Ok(())
}

async fn serve(options: &WorkerOptions, registry: &Registry) -> Result<()> {
    let socket = UnixStream::connect(&options.socket)
        .await
        .map_err(|source| Error::Io {
            op: "connecting to the agent's worker socket",
            source,
        })?;
    let mut stream = FramedStream::new(
        socket,
        options.max_frame,
        SOCKET_FRAME_TIMEOUT,
        SOCKET_FRAME_TIMEOUT,
    );
    send(&mut stream, &WorkerMessage::Hello { slot: options.slot }).await?;
    let client = StoreClient::new();
    loop {
        let task: WorkerTask = match stream.recv(IDLE_WAIT).await {
            Ok(body) => codec::decode(body, "worker task")?,
            Err(WireError::Closed) => return Ok(()),
            Err(error) => return Err(error.into()),
        };
        match run(&client, registry, &task) {
            Ok(outputs) => {
                for output in outputs {
                    let len = output.bytes.0.len() as u64;
                    let rows = output.rows;
                    send(&mut stream, &WorkerMessage::Output { len, rows }).await?;
                    for chunk in output.bytes.0.chunks(OUTPUT_CHUNK) {
                        send(&mut stream, &WorkerMessage::Chunk(Bytes(chunk.to_vec()))).await?;
                    }
                }
                send(&mut stream, &WorkerMessage::Finished).await?;
            }
            Err(WorkerTaskFailure { message, transient }) => {
                send(&mut stream, &WorkerMessage::Failed { message, transient }).await?;
            }
        }
    }
}

fn run(
    client: &StoreClient,
    registry: &Registry,
    task: &WorkerTask,
) -> Result<Vec<WorkerOutput>, WorkerTaskFailure> {
    let views = task
        .inputs
        .iter()
        .map(|location| client.open(location))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| WorkerTaskFailure::permanent(format!("cannot map an input: {error}")))?;
    match &task.kind {
        TaskKind::Stage(stage_task) => run_stage(stage_task, &views, registry, &task.processes),
        #[cfg(feature = "test-tasks")]
        TaskKind::Test(test_task) => {
            let inputs: Vec<&[u8]> = views.iter().map(|view| view.as_bytes()).collect();
            Ok(crate::test_tasks::run(test_task, &inputs)?
                .into_iter()
                .map(|bytes| WorkerOutput {
                    bytes: Bytes(bytes),
                    rows: None,
                })
                .collect())
        }
    }
}

/// Runs one stage task over its input blocks; each output batch becomes one block.
fn run_stage(
    task: &StageTask,
    views: &[ObjectView],
    registry: &Registry,
    processes: &[ProcessEndpoint],
) -> Result<Vec<WorkerOutput>, WorkerTaskFailure> {
    let mut per_input = Vec::with_capacity(views.len());
    for view in views {
        let block = read_block(view).map_err(|error| {
            WorkerTaskFailure::permanent(format!("cannot decode an input: {error}"))
        })?;
        per_input.push(block.batches);
    }
    let batches = run_stage_task(task, per_input, registry, processes)?;
    encode_outputs(&batches)
}

/// Each batch as one output block.
fn encode_outputs(batches: &[RecordBatch]) -> Result<Vec<WorkerOutput>, WorkerTaskFailure> {
    batches
        .iter()
        .map(|batch| {
            let bytes =
                encode_block(&batch.schema(), std::slice::from_ref(batch)).map_err(|error| {
                    WorkerTaskFailure::permanent(format!("cannot encode an output block: {error}"))
                })?;
            Ok(WorkerOutput {
                bytes: Bytes(bytes),
                rows: Some(batch.num_rows() as u64),
            })
        })
        .collect()
}

pub(crate) async fn send<T: Serialize>(
    stream: &mut FramedStream<UnixStream>,
    message: &T,
) -> Result<()> {
    stream
        .send_with(|out| codec::encode_into(message, out))
        .await?;
    Ok(())
}
