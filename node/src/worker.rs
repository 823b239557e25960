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

use std::cell::Cell;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arrow::datatypes::SchemaRef;
use arrow::error::ArrowError;
use arrow::record_batch::RecordBatch;
use floe_core::TaskId;
use floe_core::plan::task::StageTask;
use floe_core::wire::{FramedStream, WireError, codec};
use floe_objectstore::block::{
    LateBuffers, Packing, StandInPlace, encode_into, encoded_checksum, encoded_len, lay_out_into,
    read_block, read_block_at,
};
use floe_objectstore::{ObjectLocation, ObjectView, StoreClient};
use serde::{Deserialize, Serialize};
use tokio::net::UnixStream;

use floe_api::node_protocol::{Part, TaskKind};
use floe_engine::exchange::gathered::GatheredBlock;
use floe_engine::exchange::scattered::ScatteredRows;
use floe_engine::task::{OutputBlock, Partitions, TaskOutput, run_stage_task};
use floe_engine::udf::Registry;
use floe_engine::udf::process::ProcessEndpoint;

use crate::{Error, Result};

/// Why a task failed in this worker, as the worker reports it to its agent
/// ([`WorkerMessage::Failed`]).
#[derive(Debug)]
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
    pub inputs: Vec<InputPlace>,
    /// The process-UDF children the agent leased for this task, one per UDF it calls.
    pub processes: Vec<ProcessEndpoint>,
}

/// Where one input block is: an object, or one part of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct InputPlace {
    pub location: ObjectLocation,
    /// The block's bytes in the object, when it is one of several packed there.
    pub part: Option<Part>,
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
    /// The task succeeded and every output is written, in order; `written_rows` are the rows
    /// it wrote to a sink.
    Finished {
        outputs: Vec<WrittenOutput>,
        written_rows: u64,
    },
    Failed {
        message: String,
        /// Whether running the task again may succeed.
        transient: bool,
    },
}

/// One output as its worker wrote it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WrittenOutput {
    /// The rows, when the object is a block or holds blocks.
    pub rows: Option<u64>,
    /// The xxh3-64 of its bytes, hashed while they were written; `None` when the worker did
    /// not write it ([`OutputPlace::Present`]) or hashed it part by part.
    pub checksum: Option<u64>,
    /// The blocks packed in it (a map task's partitions), each hashed on its own.
    pub parts: Vec<Part>,
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

/// Freed heap a worker keeps for its next allocations instead of handing it back to the OS:
/// a page written again costs nothing, a fresh one a fault and zeroing (on this VM fresh
/// memory is written at 0.3–0.75 GB/s against 8–12 GB/s reused, DESIGN.md). One task's
/// working set (a block decoded, its keys sorted, its rows gathered) fits, so the next task
/// reuses it; `floe-bench sort` took a quarter less time with it (docs/BENCHMARKS.md).
#[cfg(target_env = "gnu")]
const KEPT_FREE_HEAP: libc::c_int = 256 << 20;
/// Allocations from this size up get a mapping of their own, unmapped when freed; smaller
/// ones come from the heap and are reused. glibc's largest setting (it would otherwise start
/// at 128 KiB and move up only as large blocks are freed).
#[cfg(target_env = "gnu")]
const OWN_MAPPING_FROM: libc::c_int = 32 << 20;

/// Makes glibc's allocator keep freed memory for reuse ([`KEPT_FREE_HEAP`]).
fn keep_freed_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes the allocator's settings; it is called before the worker
    // starts its threads.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, OWN_MAPPING_FROM);
        libc::mallopt(libc::M_TRIM_THRESHOLD, KEPT_FREE_HEAP);
    }
}

/// Runs a worker until its agent closes the socket; UDFs in its tasks come from `udfs`.
pub fn run_worker(options: &WorkerOptions, udfs: Arc<Registry>) -> Result<()> {
    die_with_agent()?;
    keep_freed_heap();
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
    let written_rows = outputs.written_rows();
    if sizes.is_empty() {
        let outputs = Vec::new();
        return Ok(Some(WorkerMessage::Finished {
            outputs,
            written_rows,
        }));
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
        let output = match place {
            OutputPlace::Present => outputs.unwritten(index),
            OutputPlace::Write(location) => client
                .open_unsealed(location)
                .map_err(|error| {
                    WorkerTaskFailure::permanent(format!("cannot map output {index}: {error}"))
                })
                .and_then(|mut object| outputs.write(index, object.as_mut_slice())),
        };
        match output {
            Ok(output) => written.push(output),
            Err(failure) => return Ok(Some(failure.into())),
        }
    }
    Ok(Some(WorkerMessage::Finished {
        outputs: written,
        written_rows,
    }))
}

impl From<WorkerTaskFailure> for WorkerMessage {
    fn from(WorkerTaskFailure { message, transient }: WorkerTaskFailure) -> Self {
        WorkerMessage::Failed { message, transient }
    }
}

/// A task's outputs, made and measured, waiting for the agent to say where they go.
enum Outputs {
    /// Blocks, each an object of its own, with its encoded size.
    Blocks(Vec<(OutputBlock, u64)>),
    /// A map task's partitions, packed into one object as `packing` lays them out.
    Packed {
        blocks: Vec<OutputBlock>,
        packing: Packing,
    },
    /// A map task's partitions, split only as they are written into one object, which
    /// `packing` lays out (each part is a partition's layout as encoded).
    Scattered {
        rows: ScatteredRows,
        packing: Packing,
    },
    /// No objects: the task wrote this many rows to a sink.
    Written { rows: u64 },
    #[cfg(feature = "test-tasks")]
    Test(crate::test_tasks::TestOutputs),
}

impl Outputs {
    fn new(output: TaskOutput) -> Result<Self, WorkerTaskFailure> {
        match output {
            TaskOutput::Blocks(blocks) => blocks
                .into_iter()
                .map(|block| {
                    let len = Encoding::of(&block)?.len()?;
                    Ok((block, len))
                })
                .collect::<Result<_, _>>()
                .map(Outputs::Blocks),
            TaskOutput::Partitions(Partitions::Blocks(blocks)) => {
                let lens = blocks
                    .iter()
                    .map(|block| Encoding::of(block)?.len())
                    .collect::<Result<Vec<u64>, _>>()?;
                let packing = packing_of(&lens)?;
                Ok(Outputs::Packed { blocks, packing })
            }
            TaskOutput::Partitions(Partitions::Scattered(rows)) => {
                let lens = rows
                    .layouts()
                    .iter()
                    .map(|layout| {
                        encoded_len(layout.schema_ref(), std::slice::from_ref(layout))
                            .map_err(cannot_encode)
                    })
                    .collect::<Result<Vec<u64>, _>>()?;
                let packing = packing_of(&lens)?;
                Ok(Outputs::Scattered { rows, packing })
            }
            TaskOutput::Written { rows } => Ok(Outputs::Written { rows }),
        }
    }

    /// The rows the task wrote to a sink rather than into objects.
    fn written_rows(&self) -> u64 {
        match self {
            Outputs::Written { rows } => *rows,
            _ => 0,
        }
    }

    fn sizes(&self) -> Vec<u64> {
        match self {
            Outputs::Blocks(blocks) => blocks.iter().map(|(_, len)| *len).collect(),
            Outputs::Packed { packing, .. } | Outputs::Scattered { packing, .. } => {
                vec![packing.len]
            }
            Outputs::Written { .. } => Vec::new(),
            #[cfg(feature = "test-tasks")]
            Outputs::Test(outputs) => outputs.sizes(),
        }
    }

    /// Output `index` as the agent learns of it when an earlier run left it in the store: a
    /// packed output's parts are hashed as if written (the bytes are the same).
    fn unwritten(&self, index: usize) -> Result<WrittenOutput, WorkerTaskFailure> {
        let (rows, parts) = match self {
            Outputs::Blocks(blocks) => (
                blocks.get(index).map(|(block, _)| block.num_rows() as u64),
                Vec::new(),
            ),
            Outputs::Packed { blocks, packing } => {
                let parts = blocks
                    .iter()
                    .zip(&packing.parts)
                    .map(|(block, &(offset, len))| {
                        Ok(Part {
                            offset,
                            len,
                            rows: block.num_rows() as u64,
                            checksum: Encoding::of(block)?.checksum()?,
                        })
                    })
                    .collect::<Result<Vec<Part>, WorkerTaskFailure>>()?;
                (Some(rows(blocks)), parts)
            }
            Outputs::Scattered { rows, packing } => {
                // Split into memory of its own, as large as the object, only to hash the parts
                // (as rare as a retried task whose earlier output survived).
                let mut scratch = vec![0; packing.len as usize];
                let parts = write_scattered(rows, packing, &mut scratch)?;
                (Some(parts.iter().map(|part| part.rows).sum()), parts)
            }
            Outputs::Written { .. } => return Err(no_output(index)),
            #[cfg(feature = "test-tasks")]
            Outputs::Test(_) => (None, Vec::new()),
        };
        Ok(WrittenOutput {
            rows,
            checksum: None,
            parts,
        })
    }

    /// Writes output `index` into `dest` (exactly its size), hashing it as it goes.
    fn write(&self, index: usize, dest: &mut [u8]) -> Result<WrittenOutput, WorkerTaskFailure> {
        match self {
            Outputs::Blocks(blocks) => {
                let (block, _) = blocks.get(index).ok_or_else(|| no_output(index))?;
                Ok(WrittenOutput {
                    rows: Some(block.num_rows() as u64),
                    checksum: Some(Encoding::of(block)?.write(dest)?),
                    parts: Vec::new(),
                })
            }
            Outputs::Packed { blocks, packing } => {
                let mut parts = Vec::with_capacity(blocks.len());
                let places = packing.split_mut(dest);
                for ((block, &(offset, len)), place) in
                    blocks.iter().zip(&packing.parts).zip(places)
                {
                    parts.push(Part {
                        offset,
                        len,
                        rows: block.num_rows() as u64,
                        checksum: Encoding::of(block)?.write(place)?,
                    });
                }
                Ok(WrittenOutput {
                    rows: Some(rows(blocks)),
                    checksum: None,
                    parts,
                })
            }
            Outputs::Scattered { rows, packing } => {
                let parts = write_scattered(rows, packing, dest)?;
                Ok(WrittenOutput {
                    rows: Some(parts.iter().map(|part| part.rows).sum()),
                    checksum: None,
                    parts,
                })
            }
            Outputs::Written { .. } => Err(no_output(index)),
            #[cfg(feature = "test-tasks")]
            Outputs::Test(outputs) => Ok(WrittenOutput {
                rows: None,
                checksum: Some(outputs.write(dest)),
                parts: Vec::new(),
            }),
        }
    }
}

fn packing_of(lens: &[u64]) -> Result<Packing, WorkerTaskFailure> {
    Packing::of(lens)
        .ok_or_else(|| WorkerTaskFailure::permanent("a map task's partitions overflow an object"))
}

/// Writes a map task's scattered partitions into `dest` (`packing.len` bytes): each layout
/// into its part, then every row into its partition's place; each part is hashed once it is
/// whole.
fn write_scattered(
    rows: &ScatteredRows,
    packing: &Packing,
    dest: &mut [u8],
) -> Result<Vec<Part>, WorkerTaskFailure> {
    let places = lay_out_parts(rows, packing, dest)?;
    rows.write_into(dest, &places).map_err(|error| {
        WorkerTaskFailure::permanent(format!("cannot split a map task's rows: {error}"))
    })?;
    Ok(rows
        .layouts()
        .iter()
        .zip(&packing.parts)
        .map(|(layout, &(offset, len))| Part {
            offset,
            len,
            rows: layout.num_rows() as u64,
            checksum: floe_core::hash::xxh3_64(&dest[offset as usize..(offset + len) as usize]),
        })
        .collect())
}

/// Encodes each partition's layout into its part of `dest` (`packing.len` bytes, the padding
/// between parts zeroed) and returns where its stand-ins lie in `dest`, in order.
fn lay_out_parts(
    rows: &ScatteredRows,
    packing: &Packing,
    dest: &mut [u8],
) -> Result<Vec<(usize, Range<usize>)>, WorkerTaskFailure> {
    let mut places = Vec::new();
    let parts = packing.split_mut(dest);
    for ((layout, &(offset, _)), part) in rows.layouts().iter().zip(&packing.parts).zip(parts) {
        let start = offset as usize;
        let placed = lay_out_into(
            part,
            layout.schema_ref(),
            std::slice::from_ref(layout),
            &ScatteredRows::is_stand_in,
        )
        .map_err(cannot_encode)?;
        places.extend(placed.into_iter().map(|StandInPlace { stand_in, place }| {
            (stand_in, start + place.start..start + place.end)
        }));
    }
    Ok(places)
}

fn rows(blocks: &[OutputBlock]) -> u64 {
    blocks.iter().map(|block| block.num_rows() as u64).sum()
}

/// One output block as the IPC encoder takes it: its schema, the batches to encode, and, for
/// rows gathered as they are written, the block that writes its stand-ins.
struct Encoding<'a> {
    block: &'a OutputBlock,
    schema: SchemaRef,
}

impl<'a> Encoding<'a> {
    /// The engine makes no block without a batch.
    fn of(block: &'a OutputBlock) -> Result<Self, WorkerTaskFailure> {
        let schema = block
            .encoded_batches()
            .first()
            .map(RecordBatch::schema)
            .ok_or_else(|| WorkerTaskFailure::permanent("a task made a block of no batches"))?;
        Ok(Self { block, schema })
    }

    fn len(&self) -> Result<u64, WorkerTaskFailure> {
        encoded_len(&self.schema, self.block.encoded_batches()).map_err(cannot_encode)
    }

    fn checksum(&self) -> Result<u64, WorkerTaskFailure> {
        self.encode(|batches, hook| encoded_checksum(&self.schema, batches, hook))
    }

    /// Writes the block into `dest` (exactly [`Self::len`] bytes); returns its checksum.
    fn write(&self, dest: &mut [u8]) -> Result<u64, WorkerTaskFailure> {
        self.encode(|batches, hook| encode_into(dest, &self.schema, batches, hook))
    }

    /// Runs `encode` over the block's batches with the hook for a gathered block's stand-ins
    /// (none for a block of batches), then checks that it wrote every stand-in.
    fn encode(
        &self,
        encode: impl FnOnce(&[RecordBatch], Option<&dyn LateBuffers>) -> Result<u64, ArrowError>,
    ) -> Result<u64, WorkerTaskFailure> {
        let late = match self.block {
            OutputBlock::Gathered(block) => Some(Late {
                block,
                served: Cell::new(0),
            }),
            OutputBlock::Batches(_) => None,
        };
        let hook = late.as_ref().map(|late| late as &dyn LateBuffers);
        let checksum = encode(self.block.encoded_batches(), hook).map_err(cannot_encode)?;
        late.map_or(Ok(()), |late| late.check())?;
        Ok(checksum)
    }
}

/// A gathered block's stand-ins as the encoder meets them, counted: every one must have been
/// written in its place, or its zeros would go out hashed as if they were the rows (were the
/// IPC writer ever to read a buffer itself, to compress or buffer it).
struct Late<'a> {
    block: &'a GatheredBlock,
    served: Cell<usize>,
}

impl Late<'_> {
    fn check(&self) -> Result<(), WorkerTaskFailure> {
        let expected = self.block.stand_ins();
        if self.served.get() == expected {
            Ok(())
        } else {
            Err(WorkerTaskFailure::permanent(format!(
                "the encoder wrote {} of a gathered block's {expected} stand-ins",
                self.served.get()
            )))
        }
    }
}

impl LateBuffers for Late<'_> {
    fn is_stand_in(&self, buffer: &[u8]) -> bool {
        GatheredBlock::is_stand_in(buffer)
    }

    fn write_in_place(
        &self,
        stand_in: &[u8],
        dest: &mut [u8],
        written: &mut dyn FnMut(&[u8]),
    ) -> Result<(), ArrowError> {
        self.block
            .write_in_place(stand_in, dest, written)
            .map_err(|error| ArrowError::ExternalError(Box::new(error)))?;
        self.served.set(self.served.get() + 1);
        Ok(())
    }
}

fn no_output(index: usize) -> WorkerTaskFailure {
    WorkerTaskFailure::permanent(format!("no output {index}"))
}

fn cannot_encode(error: ArrowError) -> WorkerTaskFailure {
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
        .map(|input| client.open(&input.location))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| WorkerTaskFailure::permanent(format!("cannot map an input: {error}")))?;
    match &task.kind {
        TaskKind::Stage(stage_task) => {
            run_stage(stage_task, &task.inputs, &views, registry, &task.processes)
        }
        #[cfg(feature = "test-tasks")]
        TaskKind::Test(test_task) => {
            let inputs = task
                .inputs
                .iter()
                .zip(&views)
                .map(|(input, view)| match input.part {
                    Some(part) => usize::try_from(part.offset)
                        .ok()
                        .zip(usize::try_from(part.offset + part.len).ok())
                        .and_then(|(start, end)| view.as_bytes().get(start..end))
                        .ok_or_else(|| {
                            WorkerTaskFailure::permanent("a part lies outside its object")
                        }),
                    None => Ok(view.as_bytes()),
                })
                .collect::<Result<Vec<&[u8]>, _>>()?;
            Ok(Outputs::Test(crate::test_tasks::run(test_task, &inputs)?))
        }
    }
}

/// Runs one stage task over its input blocks (`views` of the objects `inputs` name).
fn run_stage(
    task: &StageTask,
    inputs: &[InputPlace],
    views: &[ObjectView],
    registry: &Registry,
    processes: &[ProcessEndpoint],
) -> Result<Outputs, WorkerTaskFailure> {
    let mut per_input = Vec::with_capacity(views.len());
    for (input, view) in inputs.iter().zip(views) {
        let block = match input.part {
            Some(part) => read_block_at(view, part.offset, part.len),
            None => read_block(view),
        };
        let block = block.map_err(|error| {
            WorkerTaskFailure::permanent(format!("cannot decode an input: {error}"))
        })?;
        per_input.push(block.batches);
    }
    Outputs::new(run_stage_task(task, per_input, registry, processes)?)
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{
        ArrayRef, BooleanArray, Decimal128Array, Float32Array, Float64Array, Int8Array, Int64Array,
        LargeBinaryArray, StringArray,
    };
    use arrow::compute::cast;
    use arrow::datatypes::{DataType, Field, Schema};
    use floe_core::plan::task::StageInput;
    use floe_core::plan::{Operator, SeedChoice};
    use floe_engine::blocks::BlockSizing;

    use super::*;

    /// A random shuffle's reduce output: one gathered block of 5,000 rows out of two parts.
    fn gathered_block() -> OutputBlock {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("payload", DataType::Utf8, true),
        ]));
        let part = |ids: std::ops::Range<i64>| {
            let payloads = ids
                .clone()
                .map(|id| (id % 9 != 0).then(|| format!("row {id}")));
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(Int64Array::from_iter_values(ids)),
                    Arc::new(StringArray::from_iter(payloads)),
                ],
            )
            .unwrap()
        };
        // A permutation of both parts, under 16 MiB: one block.
        let reduced = floe_engine::exchange::reduce(
            &Operator::RandomShuffle {
                seed: SeedChoice::Unresolved,
            },
            &schema,
            StageInput::Reduce {
                partition: 0,
                left: 0,
                seed: 3,
            },
            std::slice::from_ref(&schema),
            vec![vec![part(0..2_000)], vec![part(2_000..5_000)]],
        );
        let mut blocks = reduced
            .unwrap()
            .into_blocks(&BlockSizing::default())
            .unwrap();
        assert_eq!(blocks.len(), 1);
        blocks.pop().unwrap()
    }

    /// The worker writes a gathered block as the bytes of its rows gathered first, and its
    /// checksum is the hash of those bytes, written or only hashed.
    #[test]
    fn a_gathered_block_is_written_as_its_gathered_rows() {
        let block = gathered_block();
        assert!(matches!(block, OutputBlock::Gathered(_)));
        let encoding = Encoding::of(&block).unwrap();
        let mut dest = vec![0; encoding.len().unwrap() as usize];
        let checksum = encoding.write(&mut dest).unwrap();

        let rows = match &block {
            OutputBlock::Gathered(gathered) => gathered.gather().unwrap(),
            OutputBlock::Batches(_) => unreachable!(),
        };
        let mut expected = vec![0; dest.len()];
        encode_into(
            &mut expected,
            &rows.schema(),
            std::slice::from_ref(&rows),
            None,
        )
        .unwrap();
        assert!(
            dest == expected,
            "the written block is not its gathered rows"
        );
        assert_eq!(checksum, floe_core::hash::xxh3_64(&expected));
        assert_eq!(encoding.checksum().unwrap(), checksum);
    }

    /// A stand-in the encoder did not have written in its place is an error, not zeros
    /// hashed as rows: here the block is encoded without the hook, as a writer that read its
    /// buffers itself would encode it.
    #[test]
    fn a_stand_in_left_unwritten_fails_the_block() {
        let block = gathered_block();
        let encoding = Encoding::of(&block).unwrap();
        let mut dest = vec![0; encoding.len().unwrap() as usize];
        let error = encoding
            .encode(|batches, _hook| encode_into(&mut dest, &encoding.schema, batches, None))
            .unwrap_err();
        assert!(error.message.contains("stand-ins"), "{}", error.message);
    }

    /// Columns of every type the split writes late, one after the other.
    const LATE_COLUMNS: usize = 8;

    /// A hash repartition's map output: 20,000 rows of every width and kind of column the split
    /// writes late or ahead (nulls in some), in two batches, the second sliced, routed by a key
    /// of 6 values (one null) into 7 partitions, so at least one is empty.
    fn scattered_rows() -> ScatteredRows {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("small", DataType::Int8, false),
            Field::new("half", DataType::Float16, false),
            Field::new("x", DataType::Float64, false),
            Field::new("d", DataType::Decimal128(20, 2), true),
            Field::new("wide", DataType::Decimal256(40, 0), false),
            Field::new("s", DataType::Utf8, true),
            Field::new("blob", DataType::LargeBinary, false),
            Field::new("flag", DataType::Boolean, true),
        ]));
        let batch = |ids: std::ops::Range<i64>| {
            let columns: Vec<ArrayRef> = vec![
                Arc::new(Int64Array::from_iter(
                    ids.clone().map(|i| (i % 11 != 0).then_some(i % 5)),
                )),
                Arc::new(Int8Array::from_iter_values(ids.clone().map(|i| i as i8))),
                cast(
                    &Float32Array::from_iter_values(ids.clone().map(|i| i as f32)),
                    &DataType::Float16,
                )
                .unwrap(),
                Arc::new(Float64Array::from_iter_values(
                    ids.clone().map(|i| i as f64 / 3.0),
                )),
                Arc::new(
                    Decimal128Array::from_iter(
                        ids.clone()
                            .map(|i| (i % 5 != 0).then_some(i128::from(i) * 7)),
                    )
                    .with_precision_and_scale(20, 2)
                    .unwrap(),
                ),
                cast(
                    &Int64Array::from_iter_values(ids.clone().map(|i| i * 1_000_003)),
                    &DataType::Decimal256(40, 0),
                )
                .unwrap(),
                Arc::new(StringArray::from_iter(
                    ids.clone()
                        .map(|i| (i % 7 != 0).then(|| "é".repeat((i % 13) as usize))),
                )),
                Arc::new(LargeBinaryArray::from_iter_values(
                    ids.clone().map(|i| vec![i as u8; (i % 4) as usize]),
                )),
                Arc::new(BooleanArray::from_iter(
                    ids.map(|i| (i % 3 != 0).then_some(i % 2 == 0)),
                )),
            ];
            RecordBatch::try_new(schema.clone(), columns).unwrap()
        };
        let input = vec![batch(0..8_000), batch(7_000..20_000).slice(1_000, 12_000)];
        let operator = Operator::Repartition {
            partitions: 7,
            keys: vec!["k".to_owned()],
        };
        let split = StageInput::Partition {
            partitions: 7,
            side: 0,
            offset: 0,
            total: 0,
            seed: 0,
        };
        let output = floe_engine::exchange::run(
            &operator,
            split,
            std::slice::from_ref(&schema),
            vec![input],
        )
        .unwrap();
        let TaskOutput::Partitions(Partitions::Scattered(rows)) = output else {
            panic!("a hash repartition's map output is not scattered: {output:?}");
        };
        rows
    }

    /// A map task's scattered partitions are written as the bytes of its rows split first and
    /// then packed, and each part's checksum is the hash of those bytes, whether written into
    /// the object or, for an object already there, into memory of its own.
    #[test]
    fn scattered_partitions_are_written_as_their_rows_split_first() {
        let rows = scattered_rows();
        let split = rows.split().unwrap();
        // Each row's id, from its `x`: the input holds ids 0..20,000 once each.
        let mut ids: Vec<i64> = split
            .iter()
            .flat_map(|part| {
                let xs = part.column(3).as_any().downcast_ref::<Float64Array>();
                let xs = xs.unwrap().values().to_vec();
                xs.into_iter().map(|x| (x * 3.0).round() as i64)
            })
            .collect();
        ids.sort_unstable();
        assert_eq!(
            ids,
            (0..20_000).collect::<Vec<_>>(),
            "the split lost or made rows"
        );
        assert!(split.iter().any(|part| part.num_rows() == 0));

        let outputs = Outputs::new(TaskOutput::Partitions(Partitions::Scattered(rows))).unwrap();
        assert!(matches!(outputs, Outputs::Scattered { .. }));
        let size = outputs.sizes()[0] as usize;
        // Memory that held something else: every byte must be written.
        let mut dest = vec![0xa5; size];
        let written = outputs.write(0, &mut dest).unwrap();

        let lens: Vec<u64> = split
            .iter()
            .map(|part| encoded_len(part.schema_ref(), std::slice::from_ref(part)).unwrap())
            .collect();
        let packing = Packing::of(&lens).unwrap();
        assert_eq!(packing.len as usize, size);
        let mut expected = vec![0; size];
        for (part, &(offset, len)) in split.iter().zip(&packing.parts) {
            let place = &mut expected[offset as usize..(offset + len) as usize];
            encode_into(place, part.schema_ref(), std::slice::from_ref(part), None).unwrap();
        }
        assert!(dest == expected, "the written object is not its split rows");
        assert_eq!(written.parts.len(), 7);
        for ((part, &(offset, len)), rows) in written.parts.iter().zip(&packing.parts).zip(&split) {
            assert_eq!((part.offset, part.len), (offset, len));
            assert_eq!(part.rows, rows.num_rows() as u64);
            let bytes = &expected[offset as usize..(offset + len) as usize];
            assert_eq!(part.checksum, floe_core::hash::xxh3_64(bytes));
        }
        assert_eq!(written.rows, Some(20_000));
        assert_eq!(outputs.unwritten(0).unwrap().parts, written.parts);
    }

    /// The rows are written only into exactly the places of the layouts' stand-ins, in the
    /// order the encoder met them: any other list is an error, and nothing is written.
    #[test]
    fn scattered_rows_refuse_places_that_are_not_their_stand_ins() {
        let rows = scattered_rows();
        let outputs = Outputs::new(TaskOutput::Partitions(Partitions::Scattered(rows))).unwrap();
        let Outputs::Scattered { rows, packing } = &outputs else {
            unreachable!();
        };
        let mut dest = vec![0; packing.len as usize];
        let places = lay_out_parts(rows, packing, &mut dest).unwrap();
        // The booleans are split ahead, and an empty partition has no values to stand in for.
        let filled = rows.layouts().iter().filter(|layout| layout.num_rows() > 0);
        assert_eq!(places.len(), LATE_COLUMNS * filled.count());
        let laid_out = dest.clone();
        // The first partition's `k` and `x`: as long as each other.
        let mut swapped = places.clone();
        swapped.swap(0, 3);
        assert_eq!(swapped[0].1.len(), swapped[3].1.len());
        let mut misnamed = places.clone();
        misnamed[0].0 = places[3].0;
        let mut shifted = places.clone();
        let len = shifted[5].1.len();
        shifted[5].1 = shifted[4].1.end - 1..shifted[4].1.end - 1 + len;
        let mut overlapping = places.clone();
        overlapping[21].1 = overlapping[20].1.clone();
        let refused = [
            ("one missing", places[..places.len() - 1].to_vec()),
            (
                "one too many",
                [places.clone(), vec![places[0].clone()]].concat(),
            ),
            ("two of one length swapped", swapped),
            ("one moved into the one before it", shifted),
            ("one naming another stand-in of its length", misnamed),
            ("two overlapping", overlapping),
            ("none", Vec::new()),
        ];
        for (case, places) in refused {
            let error = rows.write_into(&mut dest, &places);
            assert!(error.is_err(), "{case}: accepted");
            assert!(dest == laid_out, "{case}: written before it was refused");
        }
        let too_short = places.last().unwrap().1.end - 1;
        assert!(rows.write_into(&mut dest[..too_short], &places).is_err());
        assert!(dest == laid_out);
        rows.write_into(&mut dest, &places).unwrap();
    }
}
