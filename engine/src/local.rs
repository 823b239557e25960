//! Runs a physical plan in this process with the same task function a worker runs. It covers
//! sources, fused row-wise stages, limits, unions, caches (as a pass-through: there is no
//! cache store in-process) and sinks; all-to-all stages need the shuffle executor and are
//! refused, before any task runs, with an error naming the operator.
//!
//! The output is a pull-based stream: each stage is an iterator over its input's blocks, and a
//! task runs only when its blocks are pulled. A read runs one task per file, so a consumer
//! that stops early — a limit, or a caller dropping [`stream`]'s iterator — leaves the later
//! files unopened. A stage read by several consumers (a self-union) runs to completion first
//! and its blocks are shared.

use std::cell::RefCell;
use std::iter;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;

use arrow::record_batch::RecordBatch;
use floe_core::plan::physical::{PhysicalPlan, Stage, StageId, StageKind};
use floe_core::plan::{WriteMode, WriteSpec};

use floe_core::plan::task::StageInput;

use crate::task::{TaskContext, run_task};
use crate::write::{check_empty, discard, publish, staging_directory, write_task};
use crate::{Error, Result};

/// What running a plan produced.
#[derive(Debug, Default)]
pub struct LocalOutput {
    /// The output stage's blocks (empty for a sink).
    pub batches: Vec<RecordBatch>,
    /// The files the sinks published, in order.
    pub written: Vec<PathBuf>,
}

/// A stream of blocks; [`stream`]'s ends at its first error.
pub type Blocks<'a> = Box<dyn Iterator<Item = Result<RecordBatch>> + 'a>;

/// Runs `plan` to the end: its output blocks and the files its sinks wrote.
pub fn execute(plan: &PhysicalPlan, context: &TaskContext) -> Result<LocalOutput> {
    let written = Rc::new(RefCell::new(Vec::new()));
    let batches = open_plan(plan, *context, &written)?.collect::<Result<Vec<_>>>()?;
    let written = std::mem::take(&mut *written.borrow_mut());
    Ok(LocalOutput { batches, written })
}

/// Streams the output blocks of `plan`; tasks run as the stream is pulled (see the module
/// docs). Sinks in the plan write their files when the stream is drained.
pub fn stream<'a>(plan: &PhysicalPlan, context: TaskContext<'a>) -> Result<Blocks<'a>> {
    open_plan(plan, context, &Rc::new(RefCell::new(Vec::new())))
}

fn open_plan<'a>(
    plan: &PhysicalPlan,
    context: TaskContext<'a>,
    written: &Rc<RefCell<Vec<PathBuf>>>,
) -> Result<Blocks<'a>> {
    // Stages are in topological order, so a shared stage's inputs are computed before it.
    let mut shared: Vec<Option<Vec<RecordBatch>>> = vec![None; plan.stages.len()];
    for index in 0..plan.stages.len() {
        let consumers = plan
            .stages
            .iter()
            .flat_map(|stage| &stage.inputs)
            .filter(|input| input.0 == index)
            .count();
        if consumers > 1 {
            let blocks = open(plan, StageId(index), context, &shared, written)?
                .collect::<Result<Vec<_>>>()?;
            shared[index] = Some(blocks);
        }
    }
    let mut failed = false;
    let output = open(plan, plan.output, context, &shared, written)?;
    Ok(Box::new(output.map_while(move |block| {
        // The stream ends at its first error rather than running the tasks after it.
        if failed {
            return None;
        }
        failed = block.is_err();
        Some(block)
    })))
}

/// The blocks of stage `id` as a lazy stream over its inputs' streams.
fn open<'a>(
    plan: &PhysicalPlan,
    id: StageId,
    context: TaskContext<'a>,
    shared: &[Option<Vec<RecordBatch>>],
    written: &Rc<RefCell<Vec<PathBuf>>>,
) -> Result<Blocks<'a>> {
    if let Some(blocks) = &shared[id.0] {
        return Ok(Box::new(blocks.clone().into_iter().map(Ok)));
    }
    let stage = plan.stage(id).clone();
    let input = |index: usize| -> Result<Blocks<'a>> {
        match stage.inputs.get(index) {
            Some(input) => open(plan, *input, context, shared, written),
            None => Ok(Box::new(iter::empty())),
        }
    };
    Ok(match &stage.kind {
        StageKind::Read(scan) => {
            // One task per file, as the cluster would schedule them.
            let count = scan.files.len();
            let files = 0..u32::try_from(count).map_err(|_| Error::TooManyFiles(count))?;
            tasks(stage, files.map(StageInput::File), context)
        }
        StageKind::Range { n } => {
            let range = StageInput::Range { start: 0, end: *n };
            tasks(stage, iter::once(range), context)
        }
        StageKind::FromBatches { .. } => tasks(stage, iter::once(StageInput::Inline), context),
        StageKind::Map => {
            // One task per input block, as the cluster runs a map stage over a stream.
            let mut upstream = input(0)?;
            Box::new(
                iter::from_fn(move || {
                    upstream.next().map(|block| {
                        block.and_then(|block| {
                            run_task(&stage, StageInput::Blocks, vec![block], &context)
                        })
                    })
                })
                .flat_map(flatten),
            )
        }
        StageKind::Limit { n } => {
            let (n, mut upstream) = (*n, input(0)?);
            once_task(move || {
                // Pull only until the limit is covered: the stages below stop there.
                let mut pulled = Vec::new();
                let mut rows = 0u64;
                while rows < n {
                    let Some(block) = upstream.next() else { break };
                    let block = block?;
                    rows += block.num_rows() as u64;
                    pulled.push(block);
                }
                run_task(&stage, StageInput::Blocks, pulled, &context)
            })
        }
        StageKind::Union => Box::new(input(0)?.chain(input(1)?)),
        StageKind::Cache => input(0)?,
        StageKind::Write(spec) => {
            let (spec, upstream, written) = (spec.clone(), input(0)?, written.clone());
            let schema = Arc::new(stage.schema.clone());
            once_task(move || {
                if spec.mode == WriteMode::Error {
                    check_empty(&spec.directory)?;
                }
                // Unique to this run: the process and the time it started writing.
                let token = format!(
                    "local-{}-{}",
                    std::process::id(),
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |since| since.as_nanos())
                );
                let staging = staging_directory(&spec.directory, &token);
                let staged = WriteSpec {
                    directory: staging.clone(),
                    ..spec.clone()
                };
                let files = write_task(&staged, 0, schema, upstream)
                    .and_then(|_| publish(&spec, &staging, &token));
                if files.is_err() {
                    discard(&staging);
                }
                written.borrow_mut().extend(files?);
                Ok(Vec::new())
            })
        }
        StageKind::Materialized(source) => {
            return Err(Error::MaterializedElsewhere { job: source.job });
        }
        StageKind::AllToAll(operator) => {
            return Err(Error::NotRowWise {
                operator: operator.name(),
            });
        }
    })
}

/// Runs `stage` on each input in turn, as its blocks are pulled.
fn tasks<'a>(
    stage: Stage,
    inputs: impl Iterator<Item = StageInput> + 'a,
    context: TaskContext<'a>,
) -> Blocks<'a> {
    Box::new(inputs.flat_map(move |input| flatten(run_task(&stage, input, Vec::new(), &context))))
}

/// One task, run when its first block is pulled.
fn once_task<'a>(task: impl FnOnce() -> Result<Vec<RecordBatch>> + 'a) -> Blocks<'a> {
    Box::new(iter::once_with(task).flat_map(flatten))
}

/// A task's blocks, or its error, as stream items.
fn flatten(result: Result<Vec<RecordBatch>>) -> impl Iterator<Item = Result<RecordBatch>> {
    let (blocks, error) = match result {
        Ok(blocks) => (blocks, None),
        Err(error) => (Vec::new(), Some(error)),
    };
    blocks.into_iter().map(Ok).chain(error.map(Err))
}
