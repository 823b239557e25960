//! Random shuffle: each row goes to a partition drawn from the task's seed, each map task
//! puts each of its parts in a random order of its own (seeded Fisher-Yates), and each reduce
//! interleaves its partition's parts at random, reading each part in its order. A part is
//! permuted on its own, a few megabytes at a time that stay in the cache, as the map task's
//! object is written; the reduce then reads its parts front to back instead of gathering
//! every row from anywhere in the partition. The result is
//! a uniformly random order of the partition: every interleaving is as likely as any other,
//! and so is every order of each part. A seed fixes the order.

use std::sync::Arc;

use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::RecordBatch;

use super::columns::{SplitMix64, partition_count, scale, scatter};
use super::gathered::{GatheredBlock, Picks, Sources};
use super::{Exchange, MapTask, ReduceTask, Reduced, Reordering, Routing, route_each};
use crate::Result;
use crate::task::{OutputBlock, Partitions};
use floe_core::plan::SeedChoice;

/// A map task's random partitioning of one block: each row goes to a partition drawn from a
/// PRNG seeded with `seed`, and each partition's rows are put in a random order drawn from
/// `seed` too, so the split is the same on every run. Returns `n` batches.
pub fn random_partition(batch: &RecordBatch, n: u32, seed: u64) -> Result<Vec<RecordBatch>> {
    let parts = partition_count(n)?;
    let split = scatter(
        std::slice::from_ref(batch),
        batch.schema_ref(),
        &[random_partitions(batch.num_rows(), parts, seed)],
        parts,
    )?;
    permute_parts(split, seed)?
        .into_iter()
        .map(|part| part.gather())
        .collect()
}

/// Each of a map task's `parts` in a random order of its own (seeded Fisher-Yates), drawn
/// from `seed`, gathered only as the part is written into the map task's object.
fn permute_parts(parts: Vec<RecordBatch>, seed: u64) -> Result<Vec<GatheredBlock>> {
    // Apart from the partitions' stream, which is seeded with `seed` and row offsets.
    let mut seeds = SplitMix64::new(seed.rotate_left(32) ^ PART_ORDER_SEED);
    parts
        .into_iter()
        .map(|part| {
            let mut order: Vec<(usize, usize)> = (0..part.num_rows()).map(|row| (0, row)).collect();
            fisher_yates(&mut order, seeds.next_u64());
            let rows = order.len();
            let sources = Sources::new(std::slice::from_ref(&part), part.schema_ref())?;
            GatheredBlock::new(&sources, Picks::new(Arc::new(order), 0..rows))
        })
        .collect()
}

/// Mixed into a map task's seed for the orders of its parts.
const PART_ORDER_SEED: u64 = 0x5851_F42D_4C95_7F2D;

/// The partition (below `parts`) of each of `rows` rows, as [`random_partition`] draws it.
fn random_partitions(rows: usize, parts: usize, seed: u64) -> Vec<usize> {
    let mut random = SplitMix64::new(seed);
    (0..rows).map(|_| scale(random.next_u64(), parts)).collect()
}

/// Puts `items` in a uniformly random order (Fisher-Yates) drawn from a PRNG seeded with
/// `seed`, so the same seed gives the same order.
fn fisher_yates<T>(items: &mut [T], seed: u64) {
    let mut random = SplitMix64::new(seed);
    for last in (1..items.len()).rev() {
        let other = scale(random.next_u64(), last + 1);
        items.swap(last, other);
    }
}

/// A reduce's order of its partition: the rows of `batches` interleaved at random (drawn from
/// a PRNG seeded with `seed`, so the same seed gives the same order), each batch read in its
/// own order. When each batch's rows are in a uniformly random order of their own, as a map
/// task leaves its parts, every order of all the rows is equally likely.
pub fn interleave(batches: &[RecordBatch], schema: &SchemaRef, seed: u64) -> Result<RecordBatch> {
    interleaving(batches.to_vec(), schema.clone(), seed).gather_all()
}

/// The order [`interleave`] gathers the rows in: each output row's batch is drawn by a
/// Fisher-Yates shuffle of the batch numbers (one per row), and takes that batch's next row.
fn interleaving(batches: Vec<RecordBatch>, schema: SchemaRef, seed: u64) -> Reordering {
    let mut sources: Vec<usize> = batches
        .iter()
        .enumerate()
        .flat_map(|(index, batch)| std::iter::repeat_n(index, batch.num_rows()))
        .collect();
    fisher_yates(&mut sources, seed);
    let mut next = vec![0; batches.len()];
    let order = sources
        .into_iter()
        .map(|index| {
            let row = next[index];
            next[index] += 1;
            (index, row)
        })
        .collect();
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

    fn partition(&self, task: &MapTask<'_>, batches: Vec<RecordBatch>) -> Result<Partitions> {
        let parts = partition_count(task.partitions)?;
        let split = route_each(task, &batches, |batch, offset| {
            Ok(random_partitions(
                batch.num_rows(),
                parts,
                task.seed ^ offset,
            ))
        })?;
        // The input is split: freed now, so the task holds one copy of its rows (the parts,
        // permuted only as they are written) and their orders.
        drop(batches);
        Ok(Partitions::Blocks(
            permute_parts(split, task.seed)?
                .into_iter()
                .map(OutputBlock::Gathered)
                .collect(),
        ))
    }

    fn reduce(&self, task: ReduceTask<'_>) -> Result<Reduced> {
        let schema = task.schema(0)?.clone();
        let seed = task.seed;
        Ok(Reduced::Reordered(interleaving(
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

    /// Every order of four rows (two map tasks' blocks of two, into one partition) comes out
    /// about equally often over many seeds, each row whole: the map tasks' orders of their
    /// parts and the reduce's interleaving make every order equally likely.
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
            let parts: Vec<RecordBatch> = blocks
                .iter()
                .zip([seed, !seed])
                .flat_map(|(block, map_seed)| random_partition(block, 1, map_seed).unwrap())
                .collect();
            let permuted = interleave(&parts, &schema, seed.rotate_left(7)).unwrap();
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
