//! The single-process kernels of the all-to-all operators: how a map task splits its block
//! into partitions (by key hash, by position, at random, or by sort-key range) and how a reduce
//! task turns the blocks of one partition into its output (group and aggregate, merge sorted
//! runs, join, distinct rows, permute).
//!
//! Keys are compared through Arrow's row format, which orders and equates every type the plan
//! accepts. Before hashing, grouping or joining, key columns are normalized so that values that
//! are equal hash and compare alike whatever their width: integers become `Int64`, floats
//! `Float64` with `-0.0` folded into `0.0` and every NaN into one NaN.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, ArrowPrimitiveType, Float64Array, Int64Array, PrimitiveArray, UInt64Array,
    new_empty_array, new_null_array,
};
use arrow::buffer::NullBuffer;
use arrow::compute::{SortOptions, concat, interleave, take_record_batch};
use arrow::datatypes::{DataType, Float64Type, Int64Type, Schema, SchemaRef, UInt64Type};
use arrow::error::ArrowError;
use arrow::record_batch::{RecordBatch, RecordBatchOptions};
use arrow::row::{RowConverter, Rows, SortField};
use floe_core::expr::common_type;
use floe_core::plan::{AggFunction, Aggregation, JoinType, SortKey};
use xxhash_rust::xxh3::xxh3_64;

use crate::eval::safe_cast;
use crate::{Error, Result};

/// Splits `batch` into `n` batches (index = partition) by a hash of the values of `keys`.
///
/// The hash is xxh3 of the normalized key values in Arrow's row format, so it is the same in
/// every process of a cluster running this binary. Null keys hash alike; with no keys every row
/// goes to partition 0. Always returns exactly `n` batches with `batch`'s schema.
pub fn hash_partition(batch: &RecordBatch, keys: &[String], n: u32) -> Result<Vec<RecordBatch>> {
    let parts = partition_count(n)?;
    if keys.is_empty() {
        return split_rows(batch, &vec![0; batch.num_rows()], parts);
    }
    let normalized = normalized_columns(batch, keys)?;
    let converter = key_converter(normalized.iter().map(|c| c.data_type()))?;
    let rows = converter.convert_columns(&normalized)?;
    let partitions: Vec<usize> = rows
        .iter()
        .map(|row| scale(xxh3_64(row.as_ref()), parts))
        .collect();
    split_rows(batch, &partitions, parts)
}

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

/// Sorts `batch` by `keys` (stably) and splits it by `boundaries` into exactly `n` sorted
/// batches: a row goes to the first partition i (i < min(boundaries.num_rows(), n - 1)) whose
/// boundary sorts at or after the row's key, else to the last partition n - 1. The partitions
/// between the boundaries' and the last stay empty. Partition i's rows all sort at or before
/// partition i + 1's.
pub fn range_partition(
    batch: &RecordBatch,
    keys: &[SortKey],
    boundaries: &RecordBatch,
    n: u32,
) -> Result<Vec<RecordBatch>> {
    let parts = partition_count(n)?;
    let converter = sort_converter(batch.schema_ref(), keys)?;
    let rows = converter.convert_columns(&sort_columns(batch, keys)?)?;
    let bounds = converter.convert_columns(boundaries.columns())?;
    let order = sorted_order(&rows);
    let sorted = take_record_batch(
        batch,
        &UInt64Array::from_iter_values(order.iter().map(|&i| i as u64)),
    )?;
    let mut cuts = vec![0];
    for bound in bounds.iter().take(parts - 1) {
        let previous = cuts.last().copied().unwrap_or(0);
        let end = order.partition_point(|&i| rows.row(i) <= bound);
        cuts.push(end.max(previous));
    }
    let last_cut = cuts.last().copied().unwrap_or(0);
    cuts.resize(parts, last_cut);
    cuts.push(order.len());
    Ok(cuts
        .windows(2)
        .map(|cut| sorted.slice(cut[0], cut[1] - cut[0]))
        .collect())
}

/// Merges batches that are each sorted by `keys` into one sorted batch of `schema` (a k-way
/// merge; equal keys keep the input order, batch by batch).
pub fn merge_sorted(
    batches: &[RecordBatch],
    schema: &SchemaRef,
    keys: &[SortKey],
) -> Result<RecordBatch> {
    let converter = sort_converter(schema, keys)?;
    let runs = batches
        .iter()
        .map(|batch| Ok(converter.convert_columns(&sort_columns(batch, keys)?)?))
        .collect::<Result<Vec<Rows>>>()?;
    // Ties are broken by (run, row), which makes the merge stable.
    let mut heads = BinaryHeap::new();
    for (run, rows) in runs.iter().enumerate() {
        if rows.num_rows() > 0 {
            heads.push(Reverse((rows.row(0), run, 0)));
        }
    }
    let mut picks = Vec::with_capacity(runs.iter().map(Rows::num_rows).sum());
    while let Some(Reverse((_, run, row))) = heads.pop() {
        picks.push((run, row));
        let next = row + 1;
        if next < runs[run].num_rows() {
            heads.push(Reverse((runs[run].row(next), run, next)));
        }
    }
    gather(batches, schema, &picks)
}

/// Groups all rows of `batches` (of schema `input`) by `keys` and computes `aggregations`,
/// giving exactly `output`: the keys (each group's first row's values), then one column per
/// aggregation.
///
/// Count without a column counts rows, with one its non-null values; Sum is Int64, UInt64 or
/// Float64 (an integer sum that does not fit is null); Mean is Float64; Min/Max keep the
/// column's type and follow the sort order (NaN above every number); Std is the sample
/// standard deviation (null below two values); CountDistinct counts distinct non-null values.
/// Every aggregate but Count ignores nulls and is null for a group without values. Null keys
/// form a group of their own. Groups come in order of first appearance; with no keys there is
/// exactly one row, even for no input.
pub fn aggregate(
    batches: &[RecordBatch],
    input: &SchemaRef,
    keys: &[String],
    aggregations: &[Aggregation],
    output: &SchemaRef,
) -> Result<RecordBatch> {
    let grouping = Grouping::of(batches, input, keys)?;
    let groups = if keys.is_empty() {
        1
    } else {
        grouping.first.len()
    };
    let mut columns = Vec::with_capacity(keys.len() + aggregations.len());
    for key in keys {
        let values = named_columns(batches, key)?;
        let data_type = input.field_with_name(key)?.data_type();
        columns.push(interleave_picks(&values, data_type, &grouping.first)?);
    }
    for aggregation in aggregations {
        columns.push(aggregate_column(
            batches,
            input,
            aggregation,
            &grouping.ids,
            groups,
        )?);
    }
    with_row_count(output, columns, groups)
}

/// One side of a join: its rows, their schema (needed when there are no rows) and its keys.
#[derive(Debug, Clone, Copy)]
pub struct JoinSide<'a> {
    pub batches: &'a [RecordBatch],
    pub schema: &'a SchemaRef,
    pub keys: &'a [String],
}

/// Joins all rows of `left` with all rows of `right` (a hash join on the right side), giving
/// exactly `output`: the left columns, then the right non-key columns (for semi and anti
/// joins, the left columns only), with SQL semantics for every [`JoinType`].
///
/// Each key pair is compared in the two types' common type (so an Int32 key joins an Int64
/// one); null keys never match. In right and full joins the key columns of right-only rows
/// hold the right keys cast to the left keys' types. Output rows follow the left input, with
/// right-only rows last in right input order.
pub fn join(
    left: JoinSide<'_>,
    right: JoinSide<'_>,
    how: JoinType,
    output: &SchemaRef,
) -> Result<RecordBatch> {
    let JoinSide {
        batches: left,
        schema: left_schema,
        keys: left_keys,
    } = left;
    let JoinSide {
        batches: right,
        schema: right_schema,
        keys: right_keys,
    } = right;
    if left_keys.is_empty() || left_keys.len() != right_keys.len() {
        return Err(invalid(format!(
            "a join needs the same non-zero number of keys on both sides, got {} and {}",
            left_keys.len(),
            right_keys.len()
        )));
    }
    let key_types = left_keys
        .iter()
        .zip(right_keys)
        .map(|(left_key, right_key)| {
            let left_type = left_schema.field_with_name(left_key)?.data_type();
            let right_type = right_schema.field_with_name(right_key)?.data_type();
            common_type(left_type, right_type).ok_or_else(|| {
                invalid(format!(
                    "join keys {left_key:?} ({left_type}) and {right_key:?} ({right_type}) \
                     have no common type"
                ))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let converter = key_converter(key_types.iter())?;
    let left_side = JoinKeys::encode(left, left_keys, &key_types, &converter)?;
    let right_side = JoinKeys::encode(right, right_keys, &key_types, &converter)?;
    let pairs = join_pairs(&left_side, &right_side, how);
    if pairs.is_empty() {
        return Ok(RecordBatch::new_empty(output.clone()));
    }
    let mut columns = Vec::with_capacity(output.fields().len());
    for field in left_schema.fields() {
        let values = named_columns(left, field.name())?;
        let key = left_keys.iter().position(|key| key == field.name());
        let column = match key {
            Some(key) if matches!(how, JoinType::Right | JoinType::Full) => {
                let mut sources = values;
                for batch in right {
                    sources.push(safe_cast(
                        column(batch, &right_keys[key])?,
                        field.data_type(),
                    )?);
                }
                let picks: Vec<(usize, usize)> = pairs
                    .iter()
                    .map(|pair| match *pair {
                        Pair::Both(row, _) | Pair::LeftOnly(row) => row,
                        Pair::RightOnly((batch, row)) => (left.len() + batch, row),
                    })
                    .collect();
                interleave_picks(&sources, field.data_type(), &picks)?
            }
            _ => interleave_or_null(values, field.data_type(), pairs.iter().map(Pair::left))?,
        };
        columns.push(column);
    }
    if !matches!(how, JoinType::Semi | JoinType::Anti) {
        for field in right_schema.fields() {
            if right_keys.contains(field.name()) {
                continue;
            }
            let values = named_columns(right, field.name())?;
            columns.push(interleave_or_null(
                values,
                field.data_type(),
                pairs.iter().map(Pair::right),
            )?);
        }
    }
    with_row_count(output, columns, pairs.len())
}

/// Distinct rows over `columns` (all columns when empty) of `batches` (of schema `input`),
/// giving `output` (the projection to `columns`, or the whole row): each distinct row's first
/// occurrence, in input order.
pub fn unique(
    batches: &[RecordBatch],
    input: &SchemaRef,
    columns: &[String],
    output: &SchemaRef,
) -> Result<RecordBatch> {
    let all: Vec<String>;
    let keys = if columns.is_empty() {
        all = input.fields().iter().map(|f| f.name().clone()).collect();
        &all
    } else {
        columns
    };
    let grouping = Grouping::of(batches, input, keys)?;
    gather(batches, output, &grouping.first)
}

fn invalid(message: impl Into<String>) -> Error {
    Error::Arrow(ArrowError::InvalidArgumentError(message.into()))
}

fn partition_count(n: u32) -> Result<usize> {
    if n == 0 {
        return Err(invalid("a shuffle needs at least one partition"));
    }
    Ok(n as usize)
}

/// Maps a uniformly distributed `value` onto `0..n` (Lemire's multiply-shift, which uses the
/// value's high bits and needs no division).
fn scale(value: u64, n: usize) -> usize {
    ((u128::from(value) * n as u128) >> 64) as usize
}

/// SplitMix64: a tiny generator whose stream depends on nothing but the seed, so every
/// process and run draws the same numbers.
struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Row `r` of `batch` goes to partition `partitions[r]` (each below `parts`).
fn split_rows(batch: &RecordBatch, partitions: &[usize], parts: usize) -> Result<Vec<RecordBatch>> {
    let mut rows: Vec<Vec<u64>> = vec![Vec::new(); parts];
    for (row, &partition) in partitions.iter().enumerate() {
        rows[partition].push(row as u64);
    }
    rows.into_iter()
        .map(|rows| {
            if rows.len() == batch.num_rows() {
                // Every row (or none, of an empty batch): no copy.
                return Ok(batch.clone());
            }
            Ok(take_record_batch(batch, &UInt64Array::from(rows))?)
        })
        .collect()
}

fn column<'a>(batch: &'a RecordBatch, name: &str) -> Result<&'a ArrayRef> {
    let index = batch.schema_ref().index_of(name)?;
    Ok(batch.column(index))
}

/// The column `name` of each batch.
fn named_columns(batches: &[RecordBatch], name: &str) -> Result<Vec<ArrayRef>> {
    batches
        .iter()
        .map(|batch| column(batch, name).cloned())
        .collect()
}

fn with_row_count(schema: &SchemaRef, columns: Vec<ArrayRef>, rows: usize) -> Result<RecordBatch> {
    let options = RecordBatchOptions::new().with_row_count(Some(rows));
    Ok(RecordBatch::try_new_with_options(
        schema.clone(),
        columns,
        &options,
    )?)
}

/// The rows at `picks` (batch, row) of `batches`, as a batch of `schema`, whose columns are
/// found by name.
fn gather(
    batches: &[RecordBatch],
    schema: &SchemaRef,
    picks: &[(usize, usize)],
) -> Result<RecordBatch> {
    let columns = schema
        .fields()
        .iter()
        .map(|field| {
            interleave_picks(
                &named_columns(batches, field.name())?,
                field.data_type(),
                picks,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    with_row_count(schema, columns, picks.len())
}

/// All rows of `batches`, one after the other, as one batch of `schema`.
fn concat_batches(batches: &[RecordBatch], schema: &SchemaRef) -> Result<RecordBatch> {
    let columns = schema
        .fields()
        .iter()
        .map(|field| {
            let values = named_columns(batches, field.name())?;
            if values.is_empty() {
                return Ok(new_empty_array(field.data_type()));
            }
            let values: Vec<&dyn Array> = values.iter().map(AsRef::as_ref).collect();
            Ok(concat(&values)?)
        })
        .collect::<Result<Vec<_>>>()?;
    with_row_count(
        schema,
        columns,
        batches.iter().map(RecordBatch::num_rows).sum(),
    )
}

/// The values at `picks` (array, row) of `values`.
fn interleave_picks(
    values: &[ArrayRef],
    data_type: &DataType,
    picks: &[(usize, usize)],
) -> Result<ArrayRef> {
    if picks.is_empty() {
        return Ok(new_empty_array(data_type));
    }
    let values: Vec<&dyn Array> = values.iter().map(AsRef::as_ref).collect();
    Ok(interleave(&values, picks)?)
}

/// Like [`interleave_picks`], with null where a pick is `None`.
fn interleave_or_null(
    mut values: Vec<ArrayRef>,
    data_type: &DataType,
    picks: impl Iterator<Item = Option<(usize, usize)>>,
) -> Result<ArrayRef> {
    let null = (values.len(), 0);
    values.push(new_null_array(data_type, 1));
    let picks: Vec<(usize, usize)> = picks.map(|pick| pick.unwrap_or(null)).collect();
    interleave_picks(&values, data_type, &picks)
}

fn primitive<T: ArrowPrimitiveType>(array: &ArrayRef) -> Result<&PrimitiveArray<T>> {
    array
        .as_any()
        .downcast_ref::<PrimitiveArray<T>>()
        .ok_or_else(|| {
            invalid(format!(
                "expected {}, got {}",
                T::DATA_TYPE,
                array.data_type()
            ))
        })
}

/// The type a key column is hashed and compared in.
fn normalized_type(data_type: &DataType) -> DataType {
    if data_type.is_integer() {
        DataType::Int64
    } else if data_type.is_floating() {
        DataType::Float64
    } else {
        data_type.clone()
    }
}

/// `array` as [`normalized_type`] says, keeping every distinct value distinct.
fn normalize_key(array: &ArrayRef) -> Result<ArrayRef> {
    let data_type = array.data_type();
    if *data_type == DataType::UInt64 {
        // Reinterpreting the bits keeps distinct values distinct; a value past i64::MAX
        // equals no signed one, so sharing a hash with a negative number only costs balance.
        let values = primitive::<UInt64Type>(array)?;
        return Ok(Arc::new(values.unary::<_, Int64Type>(|v| v as i64)));
    }
    if data_type.is_floating() {
        let values = safe_cast(array, &DataType::Float64)?;
        let values = primitive::<Float64Type>(&values)?;
        return Ok(Arc::new(values.unary::<_, Float64Type>(|v| {
            if v == 0.0 {
                0.0
            } else if v.is_nan() {
                f64::NAN
            } else {
                v
            }
        })));
    }
    safe_cast(array, &normalized_type(data_type))
}

fn normalized_columns(batch: &RecordBatch, names: &[String]) -> Result<Vec<ArrayRef>> {
    names
        .iter()
        .map(|name| normalize_key(column(batch, name)?))
        .collect()
}

/// A row converter for key equality (and hashing) over columns of `types`.
fn key_converter<'a>(types: impl Iterator<Item = &'a DataType>) -> Result<RowConverter> {
    let fields = types
        .map(|data_type| SortField::new(normalized_type(data_type)))
        .collect();
    Ok(RowConverter::new(fields)?)
}

/// A row converter whose byte order is the sort order of `keys` (columns of `schema`).
fn sort_converter(schema: &Schema, keys: &[SortKey]) -> Result<RowConverter> {
    if keys.is_empty() {
        return Err(invalid("a sort needs at least one key"));
    }
    let fields = keys
        .iter()
        .map(|key| {
            let options = SortOptions {
                descending: key.descending,
                nulls_first: key.nulls_first,
            };
            let data_type = schema.field_with_name(&key.column)?.data_type().clone();
            Ok(SortField::new_with_options(data_type, options))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(RowConverter::new(fields)?)
}

fn sort_columns(batch: &RecordBatch, keys: &[SortKey]) -> Result<Vec<ArrayRef>> {
    keys.iter()
        .map(|key| column(batch, &key.column).cloned())
        .collect()
}

/// The row indices of `rows` in sorted order; equal rows keep their order.
fn sorted_order(rows: &Rows) -> Vec<usize> {
    let mut order: Vec<usize> = (0..rows.num_rows()).collect();
    order.sort_by(|&a, &b| rows.row(a).cmp(&rows.row(b)));
    order
}

/// Whether row `row` is null in `nulls` (a missing buffer has no nulls).
fn is_null(nulls: Option<&NullBuffer>, row: usize) -> bool {
    nulls.is_some_and(|nulls| nulls.is_null(row))
}

/// The rows of a set of batches numbered by their distinct key values.
struct Grouping {
    /// Each row's group, batch by batch; groups are numbered in order of first appearance.
    ids: Vec<Vec<usize>>,
    /// The (batch, row) where each group first appears.
    first: Vec<(usize, usize)>,
}

impl Grouping {
    /// Groups by the normalized values of `keys` (columns of `input`); with no keys, all rows
    /// are one group.
    fn of(batches: &[RecordBatch], input: &Schema, keys: &[String]) -> Result<Self> {
        if keys.is_empty() {
            let first = batches
                .iter()
                .position(|batch| batch.num_rows() > 0)
                .map(|batch| (batch, 0));
            return Ok(Self {
                ids: batches.iter().map(|b| vec![0; b.num_rows()]).collect(),
                first: first.into_iter().collect(),
            });
        }
        let types = keys
            .iter()
            .map(|key| Ok(input.field_with_name(key)?.data_type()))
            .collect::<Result<Vec<_>>>()?;
        let converter = key_converter(types.into_iter())?;
        let encoded = batches
            .iter()
            .map(|batch| Ok(converter.convert_columns(&normalized_columns(batch, keys)?)?))
            .collect::<Result<Vec<Rows>>>()?;
        let mut numbers: HashMap<&[u8], usize> = HashMap::new();
        let mut first = Vec::new();
        let mut ids = Vec::with_capacity(encoded.len());
        for (batch, rows) in encoded.iter().enumerate() {
            let mut batch_ids = Vec::with_capacity(rows.num_rows());
            for (row, key) in rows.iter().enumerate() {
                let id = *numbers.entry(key.data()).or_insert_with(|| {
                    first.push((batch, row));
                    first.len() - 1
                });
                batch_ids.push(id);
            }
            ids.push(batch_ids);
        }
        Ok(Self { ids, first })
    }
}

/// One aggregation's output column over `groups` groups.
fn aggregate_column(
    batches: &[RecordBatch],
    input: &Schema,
    aggregation: &Aggregation,
    ids: &[Vec<usize>],
    groups: usize,
) -> Result<ArrayRef> {
    let Some(name) = &aggregation.column else {
        let mut counts = vec![0_i64; groups];
        for &id in ids.iter().flatten() {
            counts[id] += 1;
        }
        return Ok(Arc::new(Int64Array::from(counts)));
    };
    let values = named_columns(batches, name)?;
    let data_type = input.field_with_name(name)?.data_type();
    Ok(match aggregation.function {
        AggFunction::Count => {
            let mut counts = vec![0_i64; groups];
            for (array, ids) in values.iter().zip(ids) {
                let nulls = array.logical_nulls();
                for (row, &id) in ids.iter().enumerate() {
                    if !is_null(nulls.as_ref(), row) {
                        counts[id] += 1;
                    }
                }
            }
            Arc::new(Int64Array::from(counts))
        }
        AggFunction::Sum if data_type.is_floating() => {
            let mut sums: Vec<Option<f64>> = vec![None; groups];
            for_each_value::<Float64Type>(&values, ids, |id, value| {
                *sums[id].get_or_insert(0.0) += value;
            })?;
            Arc::new(Float64Array::from(sums))
        }
        AggFunction::Sum if data_type.is_unsigned_integer() => {
            Arc::new(integer_sum::<UInt64Type>(&values, ids, groups)?)
        }
        AggFunction::Sum => Arc::new(integer_sum::<Int64Type>(&values, ids, groups)?),
        AggFunction::Mean => {
            let mut totals = vec![(0.0_f64, 0_u64); groups];
            for_each_value::<Float64Type>(&values, ids, |id, value| {
                totals[id].0 += value;
                totals[id].1 += 1;
            })?;
            let means: Float64Array = totals
                .into_iter()
                .map(|(sum, count)| (count > 0).then(|| sum / count as f64))
                .collect();
            Arc::new(means)
        }
        AggFunction::Std => {
            // Welford's running mean and sum of squared deviations: stable where the
            // difference of sums of squares would cancel.
            let mut states = vec![(0_u64, 0.0_f64, 0.0_f64); groups];
            for_each_value::<Float64Type>(&values, ids, |id, value| {
                let (count, mean, squares) = &mut states[id];
                *count += 1;
                let delta = value - *mean;
                *mean += delta / *count as f64;
                *squares += delta * (value - *mean);
            })?;
            let deviations: Float64Array = states
                .into_iter()
                .map(|(count, _, squares)| {
                    (count > 1).then(|| (squares / (count - 1) as f64).sqrt())
                })
                .collect();
            Arc::new(deviations)
        }
        AggFunction::Min => extreme(&values, data_type, ids, groups, Ordering::Less)?,
        AggFunction::Max => extreme(&values, data_type, ids, groups, Ordering::Greater)?,
        AggFunction::CountDistinct => {
            let converter = key_converter(std::iter::once(data_type))?;
            let encoded = values
                .iter()
                .map(|array| Ok(converter.convert_columns(&[normalize_key(array)?])?))
                .collect::<Result<Vec<Rows>>>()?;
            let mut seen: HashSet<(usize, &[u8])> = HashSet::new();
            let mut counts = vec![0_i64; groups];
            for ((array, rows), ids) in values.iter().zip(&encoded).zip(ids) {
                let nulls = array.logical_nulls();
                for (row, &id) in ids.iter().enumerate() {
                    if !is_null(nulls.as_ref(), row) && seen.insert((id, rows.row(row).data())) {
                        counts[id] += 1;
                    }
                }
            }
            Arc::new(Int64Array::from(counts))
        }
    })
}

/// Calls `visit(group, value)` for every non-null value of `values` cast to `T`.
fn for_each_value<T: ArrowPrimitiveType>(
    values: &[ArrayRef],
    ids: &[Vec<usize>],
    mut visit: impl FnMut(usize, T::Native),
) -> Result<()> {
    for (array, ids) in values.iter().zip(ids) {
        let cast = safe_cast(array, &T::DATA_TYPE)?;
        for (&id, value) in ids.iter().zip(primitive::<T>(&cast)?.iter()) {
            if let Some(value) = value {
                visit(id, value);
            }
        }
    }
    Ok(())
}

/// Per-group sums in `T` (Int64 or UInt64), null where a sum does not fit. Summed in i128, so
/// the result does not depend on the order of the values.
fn integer_sum<T: ArrowPrimitiveType>(
    values: &[ArrayRef],
    ids: &[Vec<usize>],
    groups: usize,
) -> Result<PrimitiveArray<T>>
where
    T::Native: Into<i128> + TryFrom<i128>,
{
    let mut sums: Vec<Option<i128>> = vec![None; groups];
    for_each_value::<T>(values, ids, |id, value| {
        let sum = sums[id].get_or_insert(0);
        *sum = sum.saturating_add(value.into());
    })?;
    Ok(sums
        .into_iter()
        .map(|sum| sum.and_then(|sum| T::Native::try_from(sum).ok()))
        .collect())
}

/// Per-group minimum (`keep` = Less) or maximum (Greater) in the column's sort order; the
/// first of equal values wins.
fn extreme(
    values: &[ArrayRef],
    data_type: &DataType,
    ids: &[Vec<usize>],
    groups: usize,
    keep: Ordering,
) -> Result<ArrayRef> {
    let converter = RowConverter::new(vec![SortField::new(data_type.clone())])?;
    let encoded = values
        .iter()
        .map(|array| converter.convert_columns(std::slice::from_ref(array)))
        .collect::<Result<Vec<Rows>, ArrowError>>()?;
    let mut best: Vec<Option<(usize, usize)>> = vec![None; groups];
    for (batch, (array, ids)) in values.iter().zip(ids).enumerate() {
        let nulls = array.logical_nulls();
        for (row, &id) in ids.iter().enumerate() {
            if is_null(nulls.as_ref(), row) {
                continue;
            }
            let better = best[id].is_none_or(|(best_batch, best_row)| {
                encoded[batch]
                    .row(row)
                    .cmp(&encoded[best_batch].row(best_row))
                    == keep
            });
            if better {
                best[id] = Some((batch, row));
            }
        }
    }
    interleave_or_null(values.to_vec(), data_type, best.into_iter())
}

/// One side's join keys: each batch's keys in the pair's common type, row-encoded.
struct JoinKeys {
    rows: Vec<Rows>,
    /// Per batch, which rows have no null key (a null key never matches).
    valid: Vec<Option<NullBuffer>>,
}

impl JoinKeys {
    fn encode(
        batches: &[RecordBatch],
        keys: &[String],
        key_types: &[DataType],
        converter: &RowConverter,
    ) -> Result<Self> {
        let mut rows = Vec::with_capacity(batches.len());
        let mut valid = Vec::with_capacity(batches.len());
        for batch in batches {
            let columns = keys
                .iter()
                .zip(key_types)
                .map(|(key, key_type)| normalize_key(&safe_cast(column(batch, key)?, key_type)?))
                .collect::<Result<Vec<_>>>()?;
            let nulls: Vec<Option<NullBuffer>> =
                columns.iter().map(|c| c.logical_nulls()).collect();
            valid.push(NullBuffer::union_many(nulls.iter().map(Option::as_ref)));
            rows.push(converter.convert_columns(&columns)?);
        }
        Ok(Self { rows, valid })
    }

    /// The encoded key of each row that can match, as (batch, row, key).
    fn matchable(&self) -> impl Iterator<Item = (usize, usize, &[u8])> {
        self.rows
            .iter()
            .zip(&self.valid)
            .enumerate()
            .flat_map(|(batch, (rows, valid))| {
                rows.iter()
                    .enumerate()
                    .filter(move |(row, _)| !is_null(valid.as_ref(), *row))
                    .map(move |(row, key)| (batch, row, key.data()))
            })
    }
}

/// One output row of a join: the (batch, row) of its left and right input rows.
#[derive(Debug, Clone, Copy)]
enum Pair {
    Both((usize, usize), (usize, usize)),
    LeftOnly((usize, usize)),
    RightOnly((usize, usize)),
}

impl Pair {
    fn left(&self) -> Option<(usize, usize)> {
        match *self {
            Pair::Both(left, _) | Pair::LeftOnly(left) => Some(left),
            Pair::RightOnly(_) => None,
        }
    }

    fn right(&self) -> Option<(usize, usize)> {
        match *self {
            Pair::Both(_, right) | Pair::RightOnly(right) => Some(right),
            Pair::LeftOnly(_) => None,
        }
    }
}

/// The output rows of a join: left rows in order with their matches, then (for right and
/// full joins) the unmatched right rows in order.
fn join_pairs(left: &JoinKeys, right: &JoinKeys, how: JoinType) -> Vec<Pair> {
    let mut table: HashMap<&[u8], Vec<(usize, usize)>> = HashMap::new();
    for (batch, row, key) in right.matchable() {
        table.entry(key).or_default().push((batch, row));
    }
    let mut matched: Vec<Vec<bool>> = right
        .rows
        .iter()
        .map(|rows| vec![false; rows.num_rows()])
        .collect();
    let mut pairs = Vec::new();
    for (batch, rows) in left.rows.iter().enumerate() {
        for (row, key) in rows.iter().enumerate() {
            let here = (batch, row);
            // Rows with a null key are not in the table, so a null key finds no match.
            match (how, table.get(key.data())) {
                (JoinType::Semi, Some(_)) | (JoinType::Anti, None) => {
                    pairs.push(Pair::LeftOnly(here));
                }
                (JoinType::Semi | JoinType::Anti, _) => {}
                (_, Some(matches)) => {
                    for &there in matches {
                        matched[there.0][there.1] = true;
                        pairs.push(Pair::Both(here, there));
                    }
                }
                (JoinType::Left | JoinType::Full, None) => pairs.push(Pair::LeftOnly(here)),
                (JoinType::Inner | JoinType::Right, None) => {}
            }
        }
    }
    if matches!(how, JoinType::Right | JoinType::Full) {
        for (batch, rows) in matched.iter().enumerate() {
            for (row, &was_matched) in rows.iter().enumerate() {
                if !was_matched {
                    pairs.push(Pair::RightOnly((batch, row)));
                }
            }
        }
    }
    pairs
}

/// The most frequent value of `columns` over `batches`, as one row: `key` (each column's
/// value, printed as `column=value`) and `rows` (how many rows carry it). No rows (or no
/// columns) give an empty batch.
pub fn most_frequent_key(batches: &[RecordBatch], columns: &[String]) -> Result<RecordBatch> {
    let schema = Arc::new(Schema::new(vec![
        arrow::datatypes::Field::new("key", DataType::Utf8, false),
        arrow::datatypes::Field::new("rows", DataType::Int64, false),
    ]));
    let Some(first) = batches.first() else {
        return Ok(RecordBatch::new_empty(schema));
    };
    if columns.is_empty() {
        return Ok(RecordBatch::new_empty(schema));
    }
    let types = columns
        .iter()
        .map(|name| Ok(column(first, name)?.data_type().clone()))
        .collect::<Result<Vec<_>>>()?;
    let converter = RowConverter::new(types.into_iter().map(SortField::new).collect())?;
    // Row bytes → (rows seen, where the first one is).
    let mut counts: HashMap<Vec<u8>, (i64, usize, usize)> = HashMap::new();
    for (batch_index, batch) in batches.iter().enumerate() {
        let keys = columns
            .iter()
            .map(|name| column(batch, name).cloned())
            .collect::<Result<Vec<_>>>()?;
        let rows = converter.convert_columns(&keys)?;
        for (row_index, row) in rows.iter().enumerate() {
            counts
                .entry(row.as_ref().to_vec())
                .or_insert((0, batch_index, row_index))
                .0 += 1;
        }
    }
    let Some((count, batch_index, row_index)) =
        counts
            .into_values()
            .max_by_key(|(count, batch_index, row_index)| {
                (*count, Reverse((*batch_index, *row_index)))
            })
    else {
        return Ok(RecordBatch::new_empty(schema));
    };
    let batch = &batches[batch_index];
    let options = arrow::util::display::FormatOptions::default().with_null("null");
    let mut printed = Vec::with_capacity(columns.len());
    for name in columns {
        let values = column(batch, name)?;
        let formatter = arrow::util::display::ArrayFormatter::try_new(values.as_ref(), &options)?;
        printed.push(format!("{name}={}", formatter.value(row_index)));
    }
    Ok(RecordBatch::try_new(
        schema,
        vec![
            Arc::new(arrow::array::StringArray::from(vec![printed.join(", ")])),
            Arc::new(arrow::array::Int64Array::from(vec![count])),
        ],
    )?)
}
