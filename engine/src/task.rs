//! One task of a stage: produce or take blocks, apply the stage's fused row-wise operators,
//! and size the output blocks; or, for an all-to-all stage, one map or reduce task of its
//! exchange, whose map side may read its rows from a source fused into it.
//! [`run_stage_task`] is the function a worker process calls for every task; the in-process
//! executor calls [`run_task`] for row-wise stages.

use std::io::Cursor;
use std::sync::Arc;

use arrow::array::Int64Array;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;
use arrow::record_batch::RecordBatch;
use floe_core::plan::WriteSpec;
use floe_core::plan::physical::{Stage, StageKind};
use floe_core::plan::task::{StageInput, StageTask};

use crate::blocks::BlockSizing;
use crate::exchange;
use crate::exchange::gathered::GatheredBlock;
use crate::exchange::scattered::ScatteredRows;
use crate::ops::{Limiter, RowOpContext, apply_row_ops};
use crate::read::read_file;
use crate::udf::Registry;
use crate::udf::process::{ProcessEndpoint, ProcessSessions, process_udfs};
use crate::write::write_task;
use crate::{Error, Result};

/// Everything a task needs besides its stage and input.
#[derive(Clone, Copy)]
pub struct TaskContext<'a> {
    pub registry: &'a Registry,
    /// The process-UDF children the agent leased for this task (none in-process).
    pub processes: &'a [ProcessEndpoint],
    pub sizing: BlockSizing,
    /// Rows per batch that readers and `range` produce before sizing; performance only.
    pub batch_rows: usize,
}

/// What one task made, and how it is stored.
#[derive(Debug)]
pub enum TaskOutput {
    /// Blocks, each an object of its own.
    Blocks(Vec<OutputBlock>),
    /// A shuffle map task's partitions, packed into one object: a shuffle makes one object per
    /// map task, not one per map task and partition, and each reduce reads its partition's part
    /// of every map task's object.
    Partitions(Partitions),
    /// No blocks: the task wrote its rows, this many, as its part of a sink.
    Written { rows: u64 },
}

/// A map task's partitions (index = partition, empty ones included), as it hands them over to
/// be packed into its object.
#[derive(Debug)]
pub enum Partitions {
    /// One block each.
    Blocks(Vec<OutputBlock>),
    /// Rows routed but not yet split: each partition is laid out, and every row is written
    /// into its partition's place in the object in one pass over the input.
    Scattered(ScatteredRows),
}

impl Partitions {
    /// How many partitions there are.
    pub fn len(&self) -> usize {
        match self {
            Partitions::Blocks(blocks) => blocks.len(),
            Partitions::Scattered(rows) => rows.layouts().len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each partition's rows, as batches, split or gathered if they are still to be.
    pub fn into_batches(self) -> Result<Vec<Vec<RecordBatch>>> {
        match self {
            Partitions::Blocks(blocks) => {
                blocks.into_iter().map(OutputBlock::into_batches).collect()
            }
            Partitions::Scattered(rows) => {
                Ok(rows.split()?.into_iter().map(|part| vec![part]).collect())
            }
        }
    }
}

/// One output block's rows, as a task hands them over to be written.
#[derive(Debug)]
pub enum OutputBlock {
    /// These batches, one after the other (one, unless a reduce keeps its input parts as
    /// they are: [`exchange::Reduced::Parts`]).
    Batches(Vec<RecordBatch>),
    /// Rows picked out of the task's input, gathered only as the block is written.
    Gathered(GatheredBlock),
}

impl OutputBlock {
    pub fn num_rows(&self) -> usize {
        match self {
            OutputBlock::Batches(batches) => batches.iter().map(RecordBatch::num_rows).sum(),
            OutputBlock::Gathered(block) => block.num_rows(),
        }
    }

    /// The batches to hand the IPC writer, stand-ins included: encode them with
    /// [`GatheredBlock::write_in_place`] as the hook for a gathered block's stand-ins.
    pub fn encoded_batches(&self) -> &[RecordBatch] {
        match self {
            OutputBlock::Batches(batches) => batches,
            OutputBlock::Gathered(block) => std::slice::from_ref(block.layout()),
        }
    }

    /// The rows as batches, gathered if they are still to be.
    pub fn into_batches(self) -> Result<Vec<RecordBatch>> {
        match self {
            OutputBlock::Batches(batches) => Ok(batches),
            OutputBlock::Gathered(block) => Ok(vec![block.gather()?]),
        }
    }
}

impl From<RecordBatch> for OutputBlock {
    fn from(batch: RecordBatch) -> Self {
        OutputBlock::Batches(vec![batch])
    }
}

/// Runs one stage task over its input blocks (one list per input object), with the block sizes
/// and batch rows the task names, as a worker does: an all-to-all task through its operator's
/// exchange, a sink's part written where its stage says ([`TaskOutput::Written`]), any other
/// through [`run_task`]. A task with a fused sink writes the rows it made as its part of that
/// sink and returns how many it wrote; a map task with a fused source splits the rows it reads
/// from that source instead of input blocks.
pub fn run_stage_task(
    task: &StageTask,
    inputs: Vec<Vec<RecordBatch>>,
    registry: &Registry,
    processes: &[ProcessEndpoint],
) -> Result<TaskOutput> {
    let context = &TaskContext {
        registry,
        processes,
        sizing: BlockSizing::new(task.min_block_bytes, task.max_block_bytes)?,
        batch_rows: task.batch_rows.max(1) as usize,
    };
    let stage = &task.stage;
    if task.sink.is_some() && !task.input.makes_output_rows() {
        return Err(Error::SinkWithoutRows {
            stage: stage.kind.name().to_owned(),
            input: task.input.to_string(),
        });
    }
    let inputs = match &task.source {
        None => inputs,
        Some(source) => {
            let refuse = |reason| Error::FusedSource {
                stage: stage.kind.name().to_owned(),
                input: task.input.to_string(),
                fused: source.stage.kind.name().to_owned(),
                reason,
            };
            // Input objects besides the rows it reads: a sort's map task has its boundaries.
            let besides = match (&stage.kind, task.input) {
                (
                    StageKind::AllToAll(_),
                    StageInput::Partition { .. } | StageInput::Sample { .. },
                ) => 0,
                (StageKind::AllToAll(_), StageInput::RangePartition { .. }) => 1,
                _ => return Err(refuse("only a shuffle's map side reads a fused source")),
            };
            if inputs.len() != besides {
                return Err(refuse("it takes no input blocks but a sort's boundaries"));
            }
            // The agent leases process-UDF children for the task's own stage only.
            if !process_udfs(&source.stage.row_ops)?.is_empty() {
                return Err(refuse("a fused source calls no process UDFs"));
            }
            let rows = make_rows(&source.stage, source.input, Vec::new(), context)?;
            std::iter::once(rows).chain(inputs).collect()
        }
    };
    let output = match (&stage.kind, task.input) {
        (StageKind::AllToAll(operator), input) => {
            let schemas: Vec<_> = task.input_schemas.iter().cloned().map(Arc::new).collect();
            let output = Arc::new(stage.schema.clone());
            if matches!(input, StageInput::Reduce { .. }) {
                let reduced = exchange::reduce(operator, &output, input, &schemas, inputs)?;
                if let Some(sink) = &task.sink {
                    // Written a chunk at a time: a sorted or permuted partition goes into its
                    // files without a whole sorted copy beside its input blocks.
                    let chunks = reduced.chunks(exchange::REORDERED_CHUNK_BYTES);
                    return write_part(&sink.spec, sink.index, output, chunks);
                }
                // A reduce output is cut to the block size range like any other.
                Ok(TaskOutput::Blocks(reduced.into_blocks(&context.sizing)?))
            } else {
                exchange::run(operator, input, &schemas, inputs)
            }
        }
        (StageKind::Write(spec), StageInput::Sink { index }) => {
            let schema = Arc::new(stage.schema.clone());
            let blocks = inputs.into_iter().flatten().map(Ok);
            return write_part(spec, index, schema, blocks);
        }
        (_, input) => run_task(
            stage,
            input,
            inputs.into_iter().flatten().collect(),
            context,
        )
        .map(|batches| TaskOutput::Blocks(batches.into_iter().map(OutputBlock::from).collect())),
    }?;
    let Some(sink) = &task.sink else {
        return Ok(output);
    };
    match output {
        TaskOutput::Blocks(blocks) => {
            let schema = Arc::new(stage.schema.clone());
            let mut batches = Vec::new();
            for block in blocks {
                batches.extend(block.into_batches()?);
            }
            write_part(&sink.spec, sink.index, schema, batches.into_iter().map(Ok))
        }
        // Refused above: no task making output rows makes partitions, and only a sink writes.
        TaskOutput::Partitions(_) | TaskOutput::Written { .. } => Err(Error::SinkWithoutRows {
            stage: stage.kind.name().to_owned(),
            input: task.input.to_string(),
        }),
    }
}

/// Writes `batches` (of `schema`) as part `index` of the sink `spec`; the task's output is the
/// rows written.
fn write_part(
    spec: &WriteSpec,
    index: u32,
    schema: SchemaRef,
    batches: impl IntoIterator<Item = Result<RecordBatch>>,
) -> Result<TaskOutput> {
    let mut rows = 0u64;
    let counted = batches.into_iter().inspect(|batch| {
        if let Ok(batch) = batch {
            rows += batch.num_rows() as u64;
        }
    });
    write_task(spec, index as usize, schema, counted)?;
    Ok(TaskOutput::Written { rows })
}

/// Runs one task of a row-wise `stage` on `input` (its `blocks` for map and limit stages) and
/// returns its output blocks.
pub fn run_task(
    stage: &Stage,
    input: StageInput,
    blocks: Vec<RecordBatch>,
    context: &TaskContext,
) -> Result<Vec<RecordBatch>> {
    context
        .sizing
        .rebalance(make_rows(stage, input, blocks, context)?)
}

/// The non-empty batches a task of a row-wise `stage` makes on `input`, as they come (not
/// yet sized into blocks: a shuffle's map side splits them at once).
fn make_rows(
    stage: &Stage,
    input: StageInput,
    blocks: Vec<RecordBatch>,
    context: &TaskContext,
) -> Result<Vec<RecordBatch>> {
    let batches = match (&stage.kind, input) {
        (StageKind::Read(scan), StageInput::File(index)) => {
            read_file(scan, index as usize, context.batch_rows)?.0
        }
        (StageKind::Range { n }, StageInput::Range { start, end }) => {
            range_batches(start, end.min(*n), context.batch_rows)?
        }
        (StageKind::FromBatches { ipc, .. }, StageInput::Inline) => decode_ipc(ipc)?,
        (StageKind::Map | StageKind::Materialized(_), StageInput::Blocks) => blocks,
        (StageKind::Limit { n }, StageInput::Blocks) => {
            let mut limiter = Limiter::new(*n);
            blocks
                .into_iter()
                .map_while(|block| limiter.admit(block))
                .collect()
        }
        (kind, input) => {
            return Err(Error::StageInput {
                stage: kind.name().to_owned(),
                input: input.to_string(),
            });
        }
    };
    let sessions = ProcessSessions::new(context.processes);
    let row_context = RowOpContext {
        registry: context.registry,
        processes: &sessions,
    };
    let transformed = batches
        .into_iter()
        .map(|batch| apply_row_ops(batch, &stage.row_ops, row_context))
        .collect::<Result<Vec<_>>>()?;
    Ok(transformed
        .into_iter()
        .filter(|b| b.num_rows() > 0)
        .collect())
}

/// The ids `start..end` as `Int64` batches of at most `batch_rows` rows.
pub fn range_batches(start: u64, end: u64, batch_rows: usize) -> Result<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
    let to_i64 = |v: u64| i64::try_from(v).map_err(|_| Error::RangeOverflow(v));
    let (start, end) = (to_i64(start)?, to_i64(end)?);
    let step = i64::try_from(batch_rows.max(1)).unwrap_or(i64::MAX);
    let mut batches = Vec::new();
    let mut low = start;
    while low < end {
        let high = low.saturating_add(step).min(end);
        let ids = Int64Array::from_iter_values(low..high);
        batches.push(RecordBatch::try_new(schema.clone(), vec![Arc::new(ids)])?);
        low = high;
    }
    Ok(batches)
}

/// Encodes batches as one Arrow IPC stream (how `from_batches` carries rows in a plan).
pub fn encode_ipc(schema: &Schema, batches: &[RecordBatch]) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    let mut writer = StreamWriter::try_new(&mut bytes, schema)?;
    for batch in batches {
        writer.write(batch)?;
    }
    writer.finish()?;
    drop(writer);
    Ok(bytes)
}

/// Decodes what [`encode_ipc`] wrote.
pub fn decode_ipc(bytes: &[u8]) -> Result<Vec<RecordBatch>> {
    let reader = StreamReader::try_new(Cursor::new(bytes), None)?;
    Ok(reader.collect::<Result<Vec<_>, _>>()?)
}
