//! The `floe worker` process: connects to its agent's Unix socket, then runs one task at a time.
//!
//! Inputs arrive as [`ObjectLocation`]s the agent pinned; the worker maps them with a
//! [`StoreClient`] and reads them in place (a block's column buffers point into the mapping).
//! Outputs are written straight into the node's store: the worker measures them (a stage
//! task's outputs are its blocks, each encoded as the Arrow IPC file the store's block reader
//! decodes) and tells the agent their sizes; the agent creates the objects and answers where
//! they lie; the worker maps them and writes each in place, hashing it as it goes, then says
//! it is done and the agent seals them. No output byte crosses the socket, and the agent
//! touches none of them. Until it is sealed an object is invisible to readers, and a worker
//! that dies while writing leaves nothing: the agent drops the unsealed objects once the
//! process is gone.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arrow::record_batch::RecordBatch;
use floe_core::TaskId;
use floe_core::plan::task::StageTask;
use floe_core::wire::{FramedStream, WireError, codec};
use floe_objectstore::block::{encode_into, encoded_len, read_block};
use floe_objectstore::{ObjectLocation, ObjectView, StoreClient};
use serde::{Deserialize, Serialize};
use tokio::net::UnixStream;

use floe_api::node_protocol::TaskKind;
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

/// What the agent sends a worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum AgentMessage {
    /// The next task.
    Run(WorkerTask),
    /// Where to write the outputs the worker measured ([`WorkerMessage::Outputs`]), in
    /// order; or why the store has no room for them, which ends the task (the agent fails it).
    Places(Result<Vec<OutputPlace>, String>),
}

/// Where one output goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum OutputPlace {
    /// Into the unsealed object at this location.
    Write(ObjectLocation),
    /// Nowhere: an earlier run of the task left this output in the store (tasks are
    /// deterministic, so its bytes are the same).
    Present,
}

/// What a worker sends its agent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum WorkerMessage {
    /// The first message: which of the agent's worker slots this process fills.
    Hello { slot: u32 },
    /// The task's outputs are ready to be written: each one's exact size, in order. The agent
    /// answers with [`AgentMessage::Places`]. A task without outputs skips this.
    Outputs { sizes: Vec<u64> },
    /// The task succeeded and every output is written, in order.
    Finished { outputs: Vec<WrittenOutput> },
    Failed {
        message: String,
        /// Whether running the task again may succeed.
        transient: bool,
    },
}

/// One output as its worker wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WrittenOutput {
    /// The rows, when the object is a block.
    pub rows: Option<u64>,
    /// The xxh3-64 of its bytes, hashed while they were written; `None` when the worker did
    /// not write it ([`OutputPlace::Present`]).
    pub checksum: Option<u64>,
}

/// Frames on the socket are small (tasks, sizes, places), and reads never wait on a slow peer,
/// so one generous timeout serves every frame once it has started, and the agent's answer with
/// output places (creating objects may first spill others to disk).
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
        let task = match stream.recv(IDLE_WAIT).await {
            Ok(body) => match codec::decode(body, "worker task")? {
                AgentMessage::Run(task) => task,
                AgentMessage::Places(_) => {
                    return Err(Error::Worker("output places arrived with no task".into()));
                }
            },
            Err(WireError::Closed) => return Ok(()),
            Err(error) => return Err(error.into()),
        };
        let reply = match run(&client, registry, &task) {
            Ok(outputs) => write_outputs(&mut stream, &client, &outputs).await?,
            Err(failure) => Some(failure.into()),
        };
        if let Some(reply) = reply {
            send(&mut stream, &reply).await?;
        }
    }
}

/// Asks the agent for room for `outputs`, writes them, and returns the task's last message:
/// none when the agent had no room (it has failed the task already).
async fn write_outputs(
    stream: &mut FramedStream<UnixStream>,
    client: &StoreClient,
    outputs: &Outputs,
) -> Result<Option<WorkerMessage>> {
    let sizes = outputs.sizes();
    if sizes.is_empty() {
        let outputs = Vec::new();
        return Ok(Some(WorkerMessage::Finished { outputs }));
    }
    let count = sizes.len();
    send(stream, &WorkerMessage::Outputs { sizes }).await?;
    let answer = stream.recv(SOCKET_FRAME_TIMEOUT).await?;
    let places = match codec::decode(answer, "output places")? {
        AgentMessage::Places(Ok(places)) if places.len() == count => places,
        AgentMessage::Places(Ok(places)) => {
            return Err(Error::Worker(format!(
                "the agent gave {} places for {count} outputs",
                places.len()
            )));
        }
        AgentMessage::Places(Err(_)) => return Ok(None),
        AgentMessage::Run(_) => {
            return Err(Error::Worker("a task arrived while outputs waited".into()));
        }
    };
    let mut written = Vec::with_capacity(count);
    for (index, place) in places.iter().enumerate() {
        let checksum = match place {
            OutputPlace::Present => None,
            OutputPlace::Write(location) => {
                let wrote = client
                    .open_unsealed(location)
                    .map_err(|error| {
                        WorkerTaskFailure::permanent(format!("cannot map output {index}: {error}"))
                    })
                    .and_then(|mut object| outputs.write(index, object.as_mut_slice()));
                match wrote {
                    Ok(checksum) => Some(checksum),
                    Err(failure) => return Ok(Some(failure.into())),
                }
            }
        };
        written.push(WrittenOutput {
            rows: outputs.rows(index),
            checksum,
        });
    }
    Ok(Some(WorkerMessage::Finished { outputs: written }))
}

impl From<WorkerTaskFailure> for WorkerMessage {
    fn from(WorkerTaskFailure { message, transient }: WorkerTaskFailure) -> Self {
        WorkerMessage::Failed { message, transient }
    }
}

/// A task's outputs, made and measured, waiting for the agent to say where they go.
enum Outputs {
    /// Blocks, each with its encoded size.
    Blocks(Vec<(RecordBatch, u64)>),
    #[cfg(feature = "test-tasks")]
    Test(crate::test_tasks::TestOutputs),
}

impl Outputs {
    fn blocks(batches: Vec<RecordBatch>) -> Result<Self, WorkerTaskFailure> {
        batches
            .into_iter()
            .map(|batch| {
                let len = encoded_len(&batch.schema(), std::slice::from_ref(&batch))
                    .map_err(cannot_encode)?;
                Ok((batch, len))
            })
            .collect::<Result<_, _>>()
            .map(Outputs::Blocks)
    }

    fn sizes(&self) -> Vec<u64> {
        match self {
            Outputs::Blocks(blocks) => blocks.iter().map(|(_, len)| *len).collect(),
            #[cfg(feature = "test-tasks")]
            Outputs::Test(outputs) => outputs.sizes(),
        }
    }

    fn rows(&self, index: usize) -> Option<u64> {
        match self {
            Outputs::Blocks(blocks) => blocks.get(index).map(|(batch, _)| batch.num_rows() as u64),
            #[cfg(feature = "test-tasks")]
            Outputs::Test(_) => None,
        }
    }

    /// Writes output `index` into `dest` (exactly its size) and returns its xxh3-64.
    fn write(&self, index: usize, dest: &mut [u8]) -> Result<u64, WorkerTaskFailure> {
        match self {
            Outputs::Blocks(blocks) => {
                let (batch, _) = blocks
                    .get(index)
                    .ok_or_else(|| WorkerTaskFailure::permanent(format!("no output {index}")))?;
                encode_into(dest, &batch.schema(), std::slice::from_ref(batch))
                    .map_err(cannot_encode)
            }
            #[cfg(feature = "test-tasks")]
            Outputs::Test(outputs) => Ok(outputs.write(dest)),
        }
    }
}

fn cannot_encode(error: arrow::error::ArrowError) -> WorkerTaskFailure {
    WorkerTaskFailure::permanent(format!("cannot encode an output block: {error}"))
}

fn run(
    client: &StoreClient,
    registry: &Registry,
    task: &WorkerTask,
) -> Result<Outputs, WorkerTaskFailure> {
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
            Ok(Outputs::Test(crate::test_tasks::run(test_task, &inputs)?))
        }
    }
}

/// Runs one stage task over its input blocks; each output batch becomes one block.
fn run_stage(
    task: &StageTask,
    views: &[ObjectView],
    registry: &Registry,
    processes: &[ProcessEndpoint],
) -> Result<Outputs, WorkerTaskFailure> {
    let mut per_input = Vec::with_capacity(views.len());
    for view in views {
        let block = read_block(view).map_err(|error| {
            WorkerTaskFailure::permanent(format!("cannot decode an input: {error}"))
        })?;
        per_input.push(block.batches);
    }
    Outputs::blocks(run_stage_task(task, per_input, registry, processes)?)
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
