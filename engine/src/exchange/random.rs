//! Random shuffle: each row goes to a partition drawn from the task's seed, and each reduce
//! task permutes its partition with a seeded Fisher-Yates shuffle, so a seed fixes the order.

use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::RecordBatch;

use super::columns::{SplitMix64, partition_count, scale, scatter};
use super::{Exchange, MapTask, ReduceTask, Reduced, Reordering, Routing, route_each};
use crate::Result;
use floe_core::plan::SeedChoice;

/// Random partitioning: each row goes to a partition drawn from a PRNG seeded with `seed`, so
/// the split is the same on every run. Returns `n` batches.
pub fn random_partition(batch: &RecordBatch, n: u32, seed: u64) -> Result<Vec<RecordBatch>> {
    let parts = partition_count(n)?;
    scatter(
        std::slice::from_ref(batch),
        batch.schema_ref(),
        &[random_partitions(batch.num_rows(), parts, seed)],
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
    permutation(batches.to_vec(), schema.clone(), seed).gather_all()
}

/// The order [`permute`] gathers the rows in.
fn permutation(batches: Vec<RecordBatch>, schema: SchemaRef, seed: u64) -> Reordering {
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
    Reordering::new(batches, schema, order)
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

    fn reduce(&self, task: ReduceTask<'_>) -> Result<Reduced> {
        let schema = task.schema(0)?.clone();
        let seed = task.seed;
        Ok(Reduced::Reordered(permutation(
            task.into_batches(),
            schema,
            seed,
        )))
    }

    fn key_columns(&self, _input: &Schema) -> Vec<String> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use arrow::array::{Array, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};

    use super::*;

    /// Every order of four rows (in two blocks) comes out about equally often over many seeds,
    /// each row whole.
    #[test]
    fn every_order_of_the_rows_is_about_equally_likely() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, false),
        ]));
        let block = |ids: [i64; 2]| {
            let names = StringArray::from_iter_values(ids.iter().map(|id| format!("row {id}")));
            RecordBatch::try_new(
                schema.clone(),
                vec![Arc::new(Int64Array::from(ids.to_vec())), Arc::new(names)],
            )
            .unwrap()
        };
        let blocks = [block([0, 1]), block([2, 3])];
        const DRAWS: u64 = 24 * 200;
        let mut seen: BTreeMap<Vec<i64>, u64> = BTreeMap::new();
        for seed in 0..DRAWS {
            let permuted = permute(&blocks, &schema, seed).unwrap();
            let ids = permuted
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            let names = permuted
                .column(1)
                .as_any()
                .downcast_ref::<StringArray>()
                .unwrap();
            for row in 0..ids.len() {
                assert_eq!(names.value(row), format!("row {}", ids.value(row)));
            }
            *seen.entry(ids.values().to_vec()).or_default() += 1;
        }
        assert_eq!(seen.len(), 24, "{seen:?}");
        // 200 expected per order, with a standard deviation of 14: ±60 is over four.
        for (order, count) in &seen {
            assert!((140..=260).contains(count), "{order:?} drawn {count} times");
        }
    }
}
