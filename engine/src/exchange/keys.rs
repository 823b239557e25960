//! Keys: how exchanges hash, group and order rows by key columns.
//!
//! Keys are compared through Arrow's row format, which orders and equates every type the plan
//! accepts. Before hashing, grouping or joining, key columns are normalized so that values that
//! are equal hash and compare alike whatever their width: integers become `Int64`, floats
//! `Float64` with `-0.0` folded into `0.0` and every NaN into one NaN.

use foldhash::HashMap;
use std::cmp::Reverse;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef};
use arrow::compute::SortOptions;
use arrow::datatypes::{DataType, Float64Type, Int64Type, Schema, UInt64Type};
use arrow::record_batch::RecordBatch;
use arrow::row::{RowConverter, Rows, SortField};
use floe_core::hash::xxh3_64;
use floe_core::plan::SortKey;

use super::columns::{column, invalid, partition_count, primitive, scale, scatter};
use crate::Result;
use crate::eval::safe_cast;

/// Splits `batch` into `n` batches (index = partition) by a hash of the values of `keys`.
///
/// The hash is xxh3 of the normalized key values in Arrow's row format, so it is the same in
/// every process of a cluster running this binary. Null keys hash alike; with no keys every row
/// goes to partition 0. Always returns exactly `n` batches with `batch`'s schema.
pub fn hash_partition(batch: &RecordBatch, keys: &[String], n: u32) -> Result<Vec<RecordBatch>> {
    let parts = partition_count(n)?;
    let partitions = hash_partitions(batch, keys, parts)?;
    scatter(
        std::slice::from_ref(batch),
        batch.schema_ref(),
        &[partitions],
        parts,
    )
}

/// The partition (below `parts`) of each row of `batch`, as [`hash_partition`] routes it.
pub(crate) fn hash_partitions(
    batch: &RecordBatch,
    keys: &[String],
    parts: usize,
) -> Result<Vec<usize>> {
    if keys.is_empty() {
        return Ok(vec![0; batch.num_rows()]);
    }
    let normalized = normalized_columns(batch, keys)?;
    let converter = key_converter(normalized.iter().map(|c| c.data_type()))?;
    let rows = converter.convert_columns(&normalized)?;
    Ok(rows
        .iter()
        .map(|row| scale(xxh3_64(row.as_ref()), parts))
        .collect())
}

/// The type a key column is hashed and compared in.
pub(crate) fn normalized_type(data_type: &DataType) -> DataType {
    if data_type.is_integer() {
        DataType::Int64
    } else if data_type.is_floating() {
        DataType::Float64
    } else {
        data_type.clone()
    }
}

/// `array` as [`normalized_type`] says, keeping every distinct value distinct.
pub(crate) fn normalize_key(array: &ArrayRef) -> Result<ArrayRef> {
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

pub(crate) fn normalized_columns(batch: &RecordBatch, names: &[String]) -> Result<Vec<ArrayRef>> {
    names
        .iter()
        .map(|name| normalize_key(column(batch, name)?))
        .collect()
}

/// A row converter for key equality (and hashing) over columns of `types`.
pub(crate) fn key_converter<'a>(types: impl Iterator<Item = &'a DataType>) -> Result<RowConverter> {
    let fields = types
        .map(|data_type| SortField::new(normalized_type(data_type)))
        .collect();
    Ok(RowConverter::new(fields)?)
}

/// A row converter whose byte order is the sort order of `keys` (columns of `schema`).
pub(crate) fn sort_converter(schema: &Schema, keys: &[SortKey]) -> Result<RowConverter> {
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

pub(crate) fn sort_columns(batch: &RecordBatch, keys: &[SortKey]) -> Result<Vec<ArrayRef>> {
    keys.iter()
        .map(|key| column(batch, &key.column).cloned())
        .collect()
}

/// The row indices of `rows` in sorted order; equal rows keep their order.
pub(crate) fn sorted_order(rows: &Rows) -> Vec<usize> {
    let mut keyed: Vec<(u128, usize)> = (0..rows.num_rows())
        .map(|index| (row_prefix(rows.row(index).as_ref()), index))
        .collect();
    let width = keyed.first().map_or(0, |_| rows.row(0).as_ref().len());
    let whole = width <= PREFIX_BYTES
        && (0..rows.num_rows()).all(|index| rows.row(index).as_ref().len() == width);
    if whole {
        // Every row is its prefix: integer compares alone give the rows' order, and the
        // index breaks ties as a stable sort would.
        keyed.sort_unstable();
    } else {
        keyed.sort_unstable_by(|&(a, i), &(b, j)| {
            a.cmp(&b)
                .then_with(|| rows.row(i).cmp(&rows.row(j)))
                .then(i.cmp(&j))
        });
    }
    keyed.into_iter().map(|(_, index)| index).collect()
}

/// How many of a row's leading bytes [`row_prefix`] keeps.
const PREFIX_BYTES: usize = 16;

/// A row's first [`PREFIX_BYTES`] bytes as a big-endian integer (zero-padded): prefixes
/// compare as the rows' leading bytes do, so rows whose prefixes differ compare the same way.
pub(crate) fn row_prefix(row: &[u8]) -> u128 {
    let mut prefix = [0u8; PREFIX_BYTES];
    let len = row.len().min(PREFIX_BYTES);
    prefix[..len].copy_from_slice(&row[..len]);
    u128::from_be_bytes(prefix)
}

/// The rows of a set of batches numbered by their distinct key values.
pub(crate) struct Grouping {
    /// Each row's group; groups are numbered in order of first appearance.
    pub(crate) ids: GroupIds,
    /// The (batch, row) where each group first appears.
    pub(crate) first: Vec<(usize, usize)>,
}

impl Grouping {
    /// Groups by the normalized values of `keys` (columns of `input`); with no keys, all rows
    /// are one group.
    pub(crate) fn of(batches: &[RecordBatch], input: &Schema, keys: &[String]) -> Result<Self> {
        if keys.is_empty() {
            let first = batches
                .iter()
                .position(|batch| batch.num_rows() > 0)
                .map(|batch| (batch, 0));
            return Ok(Self {
                ids: GroupIds::One,
                first: first.into_iter().collect(),
            });
        }
        let types = keys
            .iter()
            .map(|key| Ok(input.field_with_name(key)?.data_type()))
            .collect::<Result<Vec<_>>>()?;
        match keys {
            [key] if normalized_type(types[0]) == DataType::Int64 => {
                Self::of_integers(batches, key)
            }
            _ => Self::of_encoded(batches, &types, keys),
        }
    }

    /// Groups by the keys' rows encoded by the key converter: any key columns.
    fn of_encoded(batches: &[RecordBatch], types: &[&DataType], keys: &[String]) -> Result<Self> {
        let converter = key_converter(types.iter().copied())?;
        let encoded = batches
            .iter()
            .map(|batch| Ok(converter.convert_columns(&normalized_columns(batch, keys)?)?))
            .collect::<Result<Vec<Rows>>>()?;
        let mut numbering = Numbering::default();
        let ids = encoded
            .iter()
            .enumerate()
            .map(|(batch, rows)| {
                (0..rows.num_rows())
                    .map(|row| numbering.id(rows.row(row).data(), (batch, row)))
                    .collect()
            })
            .collect();
        Ok(numbering.grouping(ids))
    }

    /// Groups by one integer key (normalized to Int64) by its values: no row encoding, and
    /// nulls are a group of their own.
    fn of_integers(batches: &[RecordBatch], key: &str) -> Result<Self> {
        let mut numbering = Numbering::default();
        let mut ids = Vec::with_capacity(batches.len());
        for (batch, record) in batches.iter().enumerate() {
            let normalized = normalize_key(column(record, key)?)?;
            let values = primitive::<Int64Type>(&normalized)?;
            let batch_ids = (0..values.len())
                .map(|row| {
                    let value = values.is_valid(row).then(|| values.value(row));
                    numbering.id(value, (batch, row))
                })
                .collect();
            ids.push(batch_ids);
        }
        Ok(numbering.grouping(ids))
    }
}

/// Distinct keys numbered in order of first appearance.
struct Numbering<K> {
    // Every row's key is hashed: foldhash (seeded per process) rather than SipHash.
    numbers: HashMap<K, usize>,
    /// The (batch, row) where each group first appears.
    first: Vec<(usize, usize)>,
}

impl<K> Default for Numbering<K> {
    fn default() -> Self {
        Self {
            numbers: HashMap::default(),
            first: Vec::new(),
        }
    }
}

impl<K: std::hash::Hash + Eq> Numbering<K> {
    /// The group of `key`, seen at `at`: a new one if it was not seen before.
    fn id(&mut self, key: K, at: (usize, usize)) -> usize {
        *self.numbers.entry(key).or_insert_with(|| {
            self.first.push(at);
            self.first.len() - 1
        })
    }

    /// The grouping whose rows got `ids`.
    fn grouping(self, ids: Vec<Vec<usize>>) -> Grouping {
        Grouping {
            ids: GroupIds::PerRow(ids),
            first: self.first,
        }
    }
}

/// Each row's group.
pub(crate) enum GroupIds {
    /// No keys: every row is in group 0 (nothing is stored per row).
    One,
    /// Each row's group, batch by batch.
    PerRow(Vec<Vec<usize>>),
}

impl GroupIds {
    /// Calls `visit(row, group)` for each of the `rows` rows of batch `batch`.
    #[inline]
    pub(crate) fn for_each(&self, batch: usize, rows: usize, mut visit: impl FnMut(usize, usize)) {
        match self {
            Self::One => (0..rows).for_each(|row| visit(row, 0)),
            Self::PerRow(ids) => ids[batch]
                .iter()
                .enumerate()
                .for_each(|(row, &id)| visit(row, id)),
        }
    }
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
    let mut counts: HashMap<Vec<u8>, (i64, usize, usize)> = HashMap::default();
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

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, StringArray};

    use super::*;

    #[test]
    fn an_integer_key_groups_its_rows_as_the_encoded_rows_do() {
        let int32 = |values: Vec<Option<i32>>| -> ArrayRef {
            Arc::new(arrow::array::Int32Array::from(values))
        };
        let uint64 = |values: Vec<Option<u64>>| -> ArrayRef {
            Arc::new(arrow::array::UInt64Array::from(values))
        };
        for batches in [
            vec![
                int32(vec![Some(3), None, Some(-1), Some(3)]),
                int32(vec![None, Some(-1), Some(7)]),
            ],
            vec![
                uint64(vec![Some(u64::MAX), Some(0), None]),
                uint64(vec![Some(0), Some(u64::MAX), Some(1 << 63)]),
            ],
        ] {
            let schema = Arc::new(Schema::new(vec![arrow::datatypes::Field::new(
                "k",
                batches[0].data_type().clone(),
                true,
            )]));
            let batches: Vec<RecordBatch> = batches
                .into_iter()
                .map(|column| RecordBatch::try_new(schema.clone(), vec![column]).unwrap())
                .collect();
            let keys = ["k".to_owned()];
            let fast = Grouping::of(&batches, &schema, &keys).unwrap();
            // The general path: rows encoded by the key converter.
            let encoded =
                Grouping::of_encoded(&batches, &[schema.field(0).data_type()], &keys).unwrap();
            let (GroupIds::PerRow(ids), GroupIds::PerRow(want_ids)) = (fast.ids, encoded.ids)
            else {
                panic!("a keyed grouping numbers every row");
            };
            let want_first = encoded.first;
            assert_eq!(ids, want_ids);
            assert_eq!(fast.first, want_first);
        }
    }

    /// `sorted_order` against a stable sort comparing whole rows.
    fn check(columns: Vec<ArrayRef>, options: SortOptions) {
        let fields = columns
            .iter()
            .map(|column| SortField::new_with_options(column.data_type().clone(), options))
            .collect();
        let rows = RowConverter::new(fields)
            .unwrap()
            .convert_columns(&columns)
            .unwrap();
        let mut want: Vec<usize> = (0..rows.num_rows()).collect();
        want.sort_by(|&a, &b| rows.row(a).cmp(&rows.row(b)));
        assert_eq!(sorted_order(&rows), want);
    }

    #[test]
    fn rows_sort_by_their_prefixes_as_whole_rows_do_and_ties_keep_their_order() {
        let mut random = super::super::columns::SplitMix64::new(11);
        let mut draw = |n: u64| (random.next_u64() % n) as i64;
        // Rows of one width within the prefix: integers, with many repeats and nulls.
        let ints: Vec<Option<i64>> = (0..5_000)
            .map(|_| (draw(10) > 0).then(|| draw(50) - 25))
            .collect();
        // Wider rows: two integer keys (18 bytes).
        let pairs: Vec<i64> = (0..5_000).map(|_| draw(7)).collect();
        // Rows of varying width: strings sharing long prefixes, and empty ones.
        let texts: Vec<Option<String>> = (0..5_000)
            .map(|_| match draw(8) {
                0 => None,
                1 => Some(String::new()),
                n => Some(format!("{}{}", "p".repeat(15 + n as usize), draw(30))),
            })
            .collect();
        for options in [
            SortOptions::default(),
            SortOptions {
                descending: true,
                nulls_first: false,
            },
        ] {
            check(vec![Arc::new(Int64Array::from(ints.clone()))], options);
            check(
                vec![
                    Arc::new(Int64Array::from(pairs.clone())),
                    Arc::new(Int64Array::from(ints.clone())),
                ],
                options,
            );
            check(vec![Arc::new(StringArray::from(texts.clone()))], options);
        }
        check(
            vec![Arc::new(Int64Array::from(Vec::<i64>::new()))],
            SortOptions::default(),
        );
    }
}
