//! Block sizing: keep blocks between a minimum and a maximum byte size.
//!
//! Small blocks cost per-object overhead (scheduling, metadata, shuffle fan-out); big blocks
//! cost memory and delay streaming. An output over 1.5 × the maximum is split into pieces near
//! the maximum (rows are never split); consecutive outputs under the minimum are coalesced
//! before they are shuffled or stored.

use arrow::compute::concat_batches;
use arrow::record_batch::RecordBatch;

use crate::{Error, Result};

const MIB: u64 = 1 << 20;

/// The target block size range (1–128 MiB by default, like Ray Data; `[data]` in the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizing {
    min_bytes: u64,
    max_bytes: u64,
}

impl Default for BlockSizing {
    fn default() -> Self {
        Self {
            min_bytes: MIB,
            max_bytes: 128 * MIB,
        }
    }
}

impl BlockSizing {
    /// `min_bytes ≤ max_bytes`, both positive.
    pub fn new(min_bytes: u64, max_bytes: u64) -> Result<Self> {
        if min_bytes == 0 || min_bytes > max_bytes {
            return Err(Error::from(floe_core::PlanError::InvalidArgument {
                operator: "block sizing".to_owned(),
                message: format!(
                    "needs 0 < min ≤ max, got min {min_bytes} and max {max_bytes} bytes"
                ),
            }));
        }
        Ok(Self {
            min_bytes,
            max_bytes,
        })
    }

    /// The sizes set in the `[data]` section of the configuration.
    pub fn from_config(config: &floe_core::config::DataConfig) -> Result<Self> {
        Self::new(config.min_block_size.bytes(), config.max_block_size.bytes())
    }

    pub fn min_bytes(&self) -> u64 {
        self.min_bytes
    }

    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Splits `batch` into row ranges near the maximum if it is over 1.5 × the maximum.
    /// Slices share the batch's buffers; the object store encodes only each slice's rows.
    pub fn split(&self, batch: RecordBatch) -> Vec<RecordBatch> {
        let bytes = data_bytes(&batch);
        let rows = batch.num_rows();
        if rows <= 1 || bytes * 2 <= self.max_bytes * 3 {
            return vec![batch];
        }
        let pieces = bytes.div_ceil(self.max_bytes).max(2);
        let rows_per_piece = (rows as u64).div_ceil(pieces).max(1) as usize;
        (0..rows)
            .step_by(rows_per_piece)
            .map(|start| batch.slice(start, rows_per_piece.min(rows - start)))
            .collect()
    }

    /// Concatenates runs of consecutive batches until each output reaches the minimum (the
    /// last one may stay under it), never building one over the maximum from several inputs.
    pub fn coalesce(&self, batches: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        let mut output = Vec::new();
        let mut run: Vec<RecordBatch> = Vec::new();
        let mut run_bytes = 0;
        for batch in batches {
            let bytes = data_bytes(&batch);
            if !run.is_empty() && run_bytes + bytes > self.max_bytes {
                output.push(concat_run(&mut run)?);
                run_bytes = 0;
            }
            run_bytes += bytes;
            run.push(batch);
            if run_bytes >= self.min_bytes {
                output.push(concat_run(&mut run)?);
                run_bytes = 0;
            }
        }
        if !run.is_empty() {
            output.push(concat_run(&mut run)?);
        }
        Ok(output)
    }

    /// Groups consecutive batches into blocks, as many to a block as fit under the maximum (a
    /// batch over it on its own), without concatenating them: an object holds its block's
    /// batches one after the other.
    pub fn group(&self, batches: impl IntoIterator<Item = RecordBatch>) -> Vec<Vec<RecordBatch>> {
        let mut blocks = Vec::new();
        let mut run: Vec<RecordBatch> = Vec::new();
        let mut run_bytes = 0;
        for batch in batches {
            let bytes = data_bytes(&batch);
            if !run.is_empty() && run_bytes + bytes > self.max_bytes {
                blocks.push(std::mem::take(&mut run));
                run_bytes = 0;
            }
            run_bytes += bytes;
            run.push(batch);
        }
        if !run.is_empty() {
            blocks.push(run);
        }
        blocks
    }

    /// Both: coalesce tiny batches, then split oversized ones.
    pub fn rebalance(&self, batches: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        Ok(self
            .coalesce(batches)?
            .into_iter()
            .flat_map(|batch| self.split(batch))
            .collect())
    }
}

fn concat_run(run: &mut Vec<RecordBatch>) -> Result<RecordBatch> {
    let batches = std::mem::take(run);
    match batches.as_slice() {
        [] => Err(Error::from(floe_core::PlanError::InvalidArgument {
            operator: "block sizing".to_owned(),
            message: "cannot concatenate zero batches".to_owned(),
        })),
        [single] => Ok(single.clone()),
        [first, ..] => Ok(concat_batches(&first.schema(), &batches)?),
    }
}

/// The bytes of the rows a batch holds (a slice counts only its rows, not the buffers it
/// shares with its parent).
pub fn data_bytes(batch: &RecordBatch) -> u64 {
    batch
        .columns()
        .iter()
        .map(|column| {
            let data = column.to_data();
            data.get_slice_memory_size()
                .unwrap_or_else(|_| column.get_array_memory_size()) as u64
        })
        .sum()
}
