//! One task of a stage: produce or take blocks, apply the stage's fused row-wise operators,
//! and size the output blocks. This is the function a worker process calls for every
//! non-all-to-all stage; here it runs in-process.

use std::io::Cursor;
use std::sync::Arc;

use arrow::array::Int64Array;
use arrow::datatypes::{DataType, Field, Schema};
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;
use arrow::record_batch::RecordBatch;
use floe_core::plan::physical::{Stage, StageKind};

use crate::blocks::BlockSizing;
use crate::ops::{Limiter, RowOpContext, apply_row_ops};
use crate::read::read_file;
use crate::udf::Registry;
use crate::udf::process::{ProcessEndpoint, ProcessSessions};
use crate::{Error, Result};

/// What one task of a stage works on.
#[derive(Debug, Clone)]
pub enum TaskInput {
    /// File `index` of a read stage's scan.
    File(usize),
    /// The ids `start..end` of a range stage.
    Range { start: u64, end: u64 },
    /// All of a from-batches stage's inline rows.
    Inline,
    /// Blocks produced by the stage's input (map, limit and write stages).
    Blocks(Vec<RecordBatch>),
}

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

/// Runs one task of `stage` and returns its output blocks.
pub fn run_task(
    stage: &Stage,
    input: TaskInput,
    context: &TaskContext,
) -> Result<Vec<RecordBatch>> {
    let batches = match (&stage.kind, input) {
        (StageKind::Read(scan), TaskInput::File(index)) => {
            read_file(scan, index, context.batch_rows)?.0
        }
        (StageKind::Range { n }, TaskInput::Range { start, end }) => {
            range_batches(start, end.min(*n), context.batch_rows)?
        }
        (StageKind::FromBatches { ipc, .. }, TaskInput::Inline) => decode_ipc(ipc)?,
        (StageKind::Map, TaskInput::Blocks(blocks)) => blocks,
        (StageKind::Limit { n }, TaskInput::Blocks(blocks)) => {
            let mut limiter = Limiter::new(*n);
            blocks
                .into_iter()
                .map_while(|block| limiter.admit(block))
                .collect()
        }
        (kind, input) => {
            let input = match input {
                TaskInput::File(index) => format!("file #{index}"),
                TaskInput::Range { start, end } => format!("ids {start}..{end}"),
                TaskInput::Inline => "inline rows".to_owned(),
                TaskInput::Blocks(blocks) => format!("{} blocks", blocks.len()),
            };
            return Err(Error::StageInput {
                stage: kind.name().to_owned(),
                input,
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
    let non_empty = transformed
        .into_iter()
        .filter(|b| b.num_rows() > 0)
        .collect();
    context.sizing.rebalance(non_empty)
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
