//! Runs a physical plan in this process, stage after stage, with the same task function a
//! worker runs. It covers sources, fused row-wise stages, limits, unions, caches (as a pass-
//! through: there is no cache store in-process) and sinks; all-to-all stages need the shuffle
//! executor and are refused with an error naming the operator.

use std::path::PathBuf;
use std::sync::Arc;

use arrow::record_batch::RecordBatch;
use floe_core::plan::physical::{PhysicalPlan, StageKind};

use crate::task::{TaskContext, TaskInput, run_task};
use crate::write::write_task;
use crate::{Error, Result};

/// What running a plan produced.
#[derive(Debug, Default)]
pub struct LocalOutput {
    /// The output stage's blocks (empty for a sink).
    pub batches: Vec<RecordBatch>,
    /// The files the sinks published, in order.
    pub written: Vec<PathBuf>,
}

/// Runs every stage of `plan` in topological order; each stage's tasks run one after another.
pub fn execute(plan: &PhysicalPlan, context: &TaskContext) -> Result<LocalOutput> {
    let mut outputs: Vec<Vec<RecordBatch>> = Vec::with_capacity(plan.stages.len());
    let mut written = Vec::new();
    for stage in &plan.stages {
        let input = |index: usize| -> Vec<RecordBatch> {
            stage
                .inputs
                .get(index)
                .map(|id| outputs[id.0].clone())
                .unwrap_or_default()
        };
        let blocks = match &stage.kind {
            StageKind::Read(scan) => {
                let mut blocks = Vec::new();
                // One task per file, as the cluster would schedule them.
                for index in 0..scan.files.len() {
                    blocks.extend(run_task(stage, TaskInput::File(index), context)?);
                }
                blocks
            }
            StageKind::Range { n } => {
                run_task(stage, TaskInput::Range { start: 0, end: *n }, context)?
            }
            StageKind::FromBatches { .. } => run_task(stage, TaskInput::Inline, context)?,
            StageKind::Map | StageKind::Limit { .. } => {
                run_task(stage, TaskInput::Blocks(input(0)), context)?
            }
            StageKind::Union => {
                let mut blocks = input(0);
                blocks.extend(input(1));
                blocks
            }
            StageKind::Cache => input(0),
            StageKind::Write(spec) => {
                let schema = Arc::new(stage.schema.clone());
                written.extend(write_task(spec, 0, schema, input(0).into_iter().map(Ok))?);
                Vec::new()
            }
            StageKind::AllToAll(operator) => {
                return Err(Error::NotRowWise {
                    operator: operator.name(),
                });
            }
        };
        outputs.push(blocks);
    }
    let batches = outputs.swap_remove(plan.output.0);
    Ok(LocalOutput { batches, written })
}
