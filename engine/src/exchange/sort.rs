//! Sort: a range-partitioned exchange. The map side samples sort keys, picks `n - 1` range
//! boundaries from the samples and splits its blocks at the boundaries, keeping their row
//! order; each reduce task sorts its partition, so partition `i`'s rows all sort before
//! partition `i + 1`'s. Both sides encode the keys in Arrow's row format and gather every row
//! once; the reduce sorts the rows by their leading bytes as integers (whole rows only break
//! ties).

use std::collections::BTreeSet;

use arrow::array::UInt64Array;
use arrow::compute::take_record_batch;
use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use arrow::row::Row;
use floe_core::plan::SortKey;

use super::columns::{SplitMix64, concat_batches, partition_count, scale, scatter};
use super::keys::{row_prefix, sort_columns, sort_converter, sorted_order};
use super::scattered::ScatteredRows;
use super::{Exchange, MapTask, ReduceTask, Reduced, Reordering, Routing, key_schema};
use crate::task::Partitions;
use crate::{Error, Result};

/// Up to `count` rows of `batch` drawn without replacement with a PRNG seeded with `seed`,
/// projected to the sort key columns (in key order) and kept in `batch`'s row order. Used to
/// pick range boundaries for a sort.
pub fn sample_keys(
    batch: &RecordBatch,
    keys: &[SortKey],
    count: usize,
    seed: u64,
) -> Result<RecordBatch> {
    let indices = keys
        .iter()
        .map(|key| Ok(batch.schema_ref().index_of(&key.column)?))
        .collect::<Result<Vec<_>>>()?;
    let projected = batch.project(&indices)?;
    let rows = batch.num_rows();
    if count >= rows {
        return Ok(projected);
    }
    // Floyd's algorithm: `count` distinct rows in `count` draws, without a row-sized buffer.
    let mut random = SplitMix64::new(seed);
    let mut chosen = BTreeSet::new();
    for candidate in rows - count..rows {
        let drawn = scale(random.next_u64(), candidate + 1) as u64;
        if !chosen.insert(drawn) {
            chosen.insert(candidate as u64);
        }
    }
    let chosen = UInt64Array::from_iter_values(chosen);
    Ok(take_record_batch(&projected, &chosen)?)
}

/// The boundaries of `n` range partitions: sorts all `samples` (the columns of
/// [`sample_keys`]' output, of `sample_schema`) by `keys` and returns, sorted and without
/// repeats, the last sample of each of the first n - 1 equal shares of them — at most n - 1
/// rows. No samples give an empty batch of `sample_schema`.
pub fn range_boundaries(
    samples: &[RecordBatch],
    sample_schema: &SchemaRef,
    keys: &[SortKey],
    n: u32,
) -> Result<RecordBatch> {
    let parts = partition_count(n)?;
    let all = concat_batches(samples, sample_schema)?;
    let converter = sort_converter(sample_schema, keys)?;
    let rows = converter.convert_columns(&sort_columns(&all, keys)?)?;
    let order = sorted_order(&rows);
    let mut picked: Vec<usize> = Vec::new();
    for share in 1..parts {
        // Computed in u128: `share * len` can pass usize::MAX on 32-bit targets.
        let end = (share as u128 * order.len() as u128 / parts as u128) as usize;
        let Some(&candidate) = end.checked_sub(1).and_then(|last| order.get(last)) else {
            continue;
        };
        if picked
            .last()
            .is_none_or(|&previous| rows.row(previous) != rows.row(candidate))
        {
            picked.push(candidate);
        }
    }
    let picked = UInt64Array::from_iter_values(picked.into_iter().map(|i| i as u64));
    Ok(take_record_batch(&all, &picked)?)
}

/// Splits `batch` by `boundaries` into exactly `n` batches, each keeping `batch`'s row order:
/// a row goes to the first partition i (i < min(boundaries.num_rows(), n - 1)) whose boundary
/// sorts at or after the row's key, else to the last partition n - 1. The partitions between
/// the boundaries' and the last stay empty. Every row of partition i sorts at or before every
/// row of partition i + 1.
pub fn range_partition(
    batch: &RecordBatch,
    keys: &[SortKey],
    boundaries: &RecordBatch,
    n: u32,
) -> Result<Vec<RecordBatch>> {
    partition_by_range(
        std::slice::from_ref(batch),
        batch.schema_ref(),
        keys,
        boundaries,
        n,
    )
}

/// The rows of `batches` (of `schema`) stably sorted by `keys`, as one batch: equal keys keep
/// the input order, batch by batch.
pub fn sort_batches(
    batches: &[RecordBatch],
    schema: &SchemaRef,
    keys: &[SortKey],
) -> Result<RecordBatch> {
    sort_order(batches.to_vec(), schema.clone(), keys)?.gather_all()
}

/// The stable order of the rows of `batches` by `keys`, not yet gathered.
fn sort_order(
    batches: Vec<RecordBatch>,
    schema: SchemaRef,
    keys: &[SortKey],
) -> Result<Reordering> {
    let converter = sort_converter(&schema, keys)?;
    let total = batches.iter().map(RecordBatch::num_rows).sum();
    let mut encoded = converter.empty_rows(total, 0);
    let mut starts = Vec::with_capacity(batches.len());
    for batch in &batches {
        starts.push(encoded.num_rows());
        converter.append(&mut encoded, &sort_columns(batch, keys)?)?;
    }
    let order: Vec<(usize, usize)> = sorted_order(&encoded)
        .into_iter()
        .map(|position| {
            // The last batch starting at or before the position holds it (empty batches
            // share their start with the next).
            let batch = starts.partition_point(|&start| start <= position) - 1;
            (batch, position - starts[batch])
        })
        .collect();
    Ok(Reordering::new(batches, schema, order))
}

/// `Operator::Sort`.
pub struct Sort<'a> {
    pub keys: &'a [SortKey],
}

impl Exchange for Sort<'_> {
    fn routing(&self) -> Routing<'_> {
        Routing::Range(self.keys)
    }

    fn partition(&self, task: &MapTask<'_>, batches: Vec<RecordBatch>) -> Result<Partitions> {
        let boundaries = task.boundaries.ok_or(Error::ExchangeInput {
            missing: "the sort's range boundaries",
        })?;
        let parts = partition_count(task.partitions)?;
        let assigned = range_partitions(&batches, task.schema, self.keys, boundaries, parts)?;
        ScatteredRows::route(batches, task.schema, assigned, parts)
    }

    fn reduce(&self, task: ReduceTask<'_>) -> Result<Reduced> {
        let schema = task.schema(0)?.clone();
        sort_order(task.into_batches(), schema, self.keys).map(Reduced::Reordered)
    }

    fn key_columns(&self, _input: &Schema) -> Vec<String> {
        self.keys.iter().map(|key| key.column.clone()).collect()
    }
}

/// Up to `rows` sort-key rows sampled from all of `batches` (of `schema`), as one block of the
/// key columns.
pub fn sample(
    batches: &[RecordBatch],
    schema: &SchemaRef,
    keys: &[SortKey],
    rows: u32,
    seed: u64,
) -> Result<RecordBatch> {
    // Only the key columns are joined: copying whole blocks to draw a few keys cost a sort
    // more than its boundaries are worth.
    let key_schema = key_schema(schema, keys)?;
    let all = concat_batches(batches, &key_schema)?;
    if all.num_rows() == 0 {
        return Ok(RecordBatch::new_empty(key_schema));
    }
    sample_keys(&all, keys, rows as usize, seed)
}

/// Splits `batches` (of `schema`) at `boundaries` into `partitions` blocks, as
/// [`range_partition`] splits one batch; each block keeps the input order, batch by batch.
///
/// The map side does not sort: each reduce sorts its partition anyway, and a stable sort of
/// pieces that kept their input order gives equal keys the order of the whole input.
pub fn partition_by_range(
    batches: &[RecordBatch],
    schema: &SchemaRef,
    keys: &[SortKey],
    boundaries: &RecordBatch,
    partitions: u32,
) -> Result<Vec<RecordBatch>> {
    let parts = partition_count(partitions)?;
    let assigned = range_partitions(batches, schema, keys, boundaries, parts)?;
    scatter(batches, schema, &assigned, parts)
}

/// The partition (below `parts`) of each row of `batches`, one list per batch, as
/// [`partition_by_range`] routes it.
fn range_partitions(
    batches: &[RecordBatch],
    schema: &SchemaRef,
    keys: &[SortKey],
    boundaries: &RecordBatch,
    parts: usize,
) -> Result<Vec<Vec<usize>>> {
    let converter = sort_converter(schema, keys)?;
    let bounds = converter.convert_columns(boundaries.columns())?;
    // Each bound with its prefix, which decides most comparisons without a call to `memcmp`
    // (about 4 per row: that call was the map side's largest cost besides its copies).
    let bounds: Vec<(u128, Row<'_>)> = bounds
        .iter()
        .take(parts - 1)
        .map(|bound| (row_prefix(bound.as_ref()), bound))
        .collect();
    let assign = |batch: &RecordBatch| -> Result<Vec<usize>> {
        let rows = converter.convert_columns(&sort_columns(batch, keys)?)?;
        Ok(rows
            .iter()
            .map(|key| {
                let prefix = row_prefix(key.as_ref());
                let below = bounds.partition_point(|(bound_prefix, bound)| {
                    bound_prefix
                        .cmp(&prefix)
                        .then_with(|| bound.cmp(&key))
                        .is_lt()
                });
                if below < bounds.len() {
                    below
                } else {
                    parts - 1
                }
            })
            .collect())
    };
    batches.iter().map(assign).collect()
}
