//! Repartition: into a fixed number of partitions, by a hash of keys when it has keys, else
//! into equal consecutive slices by global row position (so order is kept).

use arrow::datatypes::Schema;
use arrow::record_batch::RecordBatch;

use super::columns::{invalid, partition_count, with_row_count};
use super::keys::hash_partitions;
use super::{
    Exchange, MapTask, ReduceTask, Reduced, Routing, partition_blocks, route_scattered, split_each,
};
use crate::Result;
use crate::task::Partitions;

/// Equal-sized split without keys: `batch` holds the global rows `offset..offset+rows` of a
/// dataset of `total` rows; global row r goes to partition floor(r * n / total). Returns `n`
/// batches, each a slice of `batch` (so order is kept).
pub fn split_by_position(
    batch: &RecordBatch,
    offset: u64,
    total: u64,
    n: u32,
) -> Result<Vec<RecordBatch>> {
    partition_count(n)?;
    let rows = batch.num_rows() as u64;
    let end = offset
        .checked_add(rows)
        .filter(|end| *end <= total)
        .ok_or_else(|| {
            invalid(format!(
                "{rows} rows at offset {offset} do not fit in a dataset of {total} rows"
            ))
        })?;
    // floor(r * n / total) >= p exactly when r >= ceil(p * total / n), which is at most
    // `total` and so fits in a u64.
    let first_row = |partition: u64| -> u64 {
        (u128::from(partition) * u128::from(total)).div_ceil(u128::from(n)) as u64
    };
    Ok((0..u64::from(n))
        .map(|partition| {
            let from = first_row(partition).clamp(offset, end);
            let to = first_row(partition + 1).clamp(offset, end);
            // Both lie within `offset..=end`, a range of `batch.num_rows()` rows.
            batch.slice((from - offset) as usize, (to - from) as usize)
        })
        .collect())
}

/// `Operator::Repartition`: into `partitions`, by `keys` when there are any.
pub struct Repartition<'a> {
    pub partitions: u32,
    pub keys: &'a [String],
}

impl Exchange for Repartition<'_> {
    fn routing(&self) -> Routing<'_> {
        if self.keys.is_empty() {
            Routing::Position
        } else {
            Routing::Hash
        }
    }

    fn fixed_partitions(&self) -> Option<u32> {
        Some(self.partitions)
    }

    fn partition(&self, task: &MapTask<'_>, batches: Vec<RecordBatch>) -> Result<Partitions> {
        if self.keys.is_empty() {
            return split_each(task, batches, |batch, offset| {
                split_by_position(batch, offset, task.total, task.partitions)
            })
            .map(partition_blocks);
        }
        route_scattered(task, batches, |batch| {
            hash_partitions(batch, self.keys, task.partitions as usize)
        })
    }

    fn reduce(&self, task: ReduceTask<'_>) -> Result<Reduced> {
        let schema = task.schema(0)?.clone();
        task.into_batches()
            .into_iter()
            .map(|part| with_row_count(&schema, part.columns().to_vec(), part.num_rows()))
            .collect::<Result<_>>()
            .map(Reduced::Parts)
    }

    fn key_columns(&self, _input: &Schema) -> Vec<String> {
        self.keys.to_vec()
    }
}
