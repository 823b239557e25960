//! Random shuffle: each row goes to a partition drawn from the task's seed, and each reduce
//! task permutes its partition with a seeded Fisher-Yates shuffle, so a seed fixes the order.

use arrow::array::UInt64Array;
use arrow::compute::take_record_batch;
use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::RecordBatch;

use super::columns::{SplitMix64, concat_batches, partition_count, scale, split_rows};
use super::{Exchange, MapTask, ReduceTask, Routing, split_each};
use crate::Result;
use floe_core::plan::SeedChoice;

/// Random partitioning: each row goes to a partition drawn from a PRNG seeded with `seed`, so
/// the split is the same on every run. Returns `n` batches.
pub fn random_partition(batch: &RecordBatch, n: u32, seed: u64) -> Result<Vec<RecordBatch>> {
    let parts = partition_count(n)?;
    let mut random = SplitMix64::new(seed);
    let partitions: Vec<usize> = (0..batch.num_rows())
        .map(|_| scale(random.next_u64(), parts))
        .collect();
    split_rows(batch, &partitions, parts)
}

/// A permutation of the rows of the concatenation of `batches` (Fisher-Yates with a PRNG seeded
/// with `seed`, so the same seed gives the same order).
pub fn permute(batches: &[RecordBatch], schema: &SchemaRef, seed: u64) -> Result<RecordBatch> {
    let all = concat_batches(batches, schema)?;
    let mut random = SplitMix64::new(seed);
    let mut order: Vec<u64> = (0..all.num_rows() as u64).collect();
    for last in (1..order.len()).rev() {
        let other = scale(random.next_u64(), last + 1);
        order.swap(last, other);
    }
    Ok(take_record_batch(&all, &UInt64Array::from(order))?)
}

/// `Operator::RandomShuffle`.
pub struct RandomShuffle {
    pub seed: SeedChoice,
}

impl Exchange for RandomShuffle {
    fn routing(&self) -> Routing<'_> {
        Routing::Random
    }

    fn seed(&self) -> u64 {
        match self.seed {
            SeedChoice::Fixed(seed) => seed.get(),
            SeedChoice::Unresolved => 0,
        }
    }

    fn partition(&self, task: &MapTask<'_>, batches: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        split_each(task, batches, |batch, offset| {
            random_partition(batch, task.partitions, task.seed ^ offset)
        })
    }

    fn reduce(&self, task: ReduceTask<'_>) -> Result<RecordBatch> {
        let schema = task.schema(0)?.clone();
        let seed = task.seed;
        permute(&task.into_batches(), &schema, seed)
    }

    fn key_columns(&self, _input: &Schema) -> Vec<String> {
        Vec::new()
    }
}
