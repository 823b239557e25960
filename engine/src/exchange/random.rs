//! Random shuffle: each row goes to a partition drawn from the task's seed, and each reduce
//! task permutes its partition with a seeded Fisher-Yates shuffle, so a seed fixes the order.

use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::RecordBatch;

use super::columns::{SplitMix64, gather, partition_count, scale, split_rows};
use super::{Exchange, MapTask, ReduceTask, Routing, route_each};
use crate::Result;
use floe_core::plan::SeedChoice;

/// Random partitioning: each row goes to a partition drawn from a PRNG seeded with `seed`, so
/// the split is the same on every run. Returns `n` batches.
pub fn random_partition(batch: &RecordBatch, n: u32, seed: u64) -> Result<Vec<RecordBatch>> {
    let parts = partition_count(n)?;
    split_rows(
        batch,
        &random_partitions(batch.num_rows(), parts, seed),
        parts,
    )
}

/// The partition (below `parts`) of each of `rows` rows, as [`random_partition`] draws it.
fn random_partitions(rows: usize, parts: usize, seed: u64) -> Vec<usize> {
    let mut random = SplitMix64::new(seed);
    (0..rows).map(|_| scale(random.next_u64(), parts)).collect()
}

/// A permutation of the rows of the concatenation of `batches` (Fisher-Yates with a PRNG seeded
/// with `seed`, so the same seed gives the same order). The permutation is drawn over (block,
/// row) positions and the rows are gathered once, without concatenating the blocks first.
pub fn permute(batches: &[RecordBatch], schema: &SchemaRef, seed: u64) -> Result<RecordBatch> {
    let mut random = SplitMix64::new(seed);
    let mut order: Vec<(usize, usize)> = batches
        .iter()
        .enumerate()
        .flat_map(|(index, batch)| (0..batch.num_rows()).map(move |row| (index, row)))
        .collect();
    for last in (1..order.len()).rev() {
        let other = scale(random.next_u64(), last + 1);
        order.swap(last, other);
    }
    gather(batches, schema, &order)
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
        let parts = partition_count(task.partitions)?;
        route_each(task, &batches, |batch, offset| {
            Ok(random_partitions(
                batch.num_rows(),
                parts,
                task.seed ^ offset,
            ))
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
