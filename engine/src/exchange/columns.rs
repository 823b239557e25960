//! What every exchange does with columns and batches: look columns up by name, gather and
//! interleave rows, split a batch by a partition per row, and draw seeded random numbers.

use arrow::array::{
    Array, ArrayRef, ArrowPrimitiveType, PrimitiveArray, UInt64Array, new_empty_array,
    new_null_array,
};
use arrow::buffer::NullBuffer;
use arrow::compute::{concat, interleave, take_record_batch};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::error::ArrowError;
use arrow::record_batch::{RecordBatch, RecordBatchOptions};

use crate::{Error, Result};

pub(crate) fn invalid(message: impl Into<String>) -> Error {
    Error::Arrow(ArrowError::InvalidArgumentError(message.into()))
}

pub(crate) fn partition_count(n: u32) -> Result<usize> {
    if n == 0 {
        return Err(invalid("a shuffle needs at least one partition"));
    }
    Ok(n as usize)
}

/// Maps a uniformly distributed `value` onto `0..n` (Lemire's multiply-shift, which uses the
/// value's high bits and needs no division).
pub(crate) fn scale(value: u64, n: usize) -> usize {
    ((u128::from(value) * n as u128) >> 64) as usize
}

/// SplitMix64: a tiny generator whose stream depends on nothing but the seed, so every
/// process and run draws the same numbers.
pub(crate) struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Row `r` of `batch` goes to partition `partitions[r]` (each below `parts`).
pub(crate) fn split_rows(
    batch: &RecordBatch,
    partitions: &[usize],
    parts: usize,
) -> Result<Vec<RecordBatch>> {
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

pub(crate) fn column<'a>(batch: &'a RecordBatch, name: &str) -> Result<&'a ArrayRef> {
    let index = batch.schema_ref().index_of(name)?;
    Ok(batch.column(index))
}

/// The column `name` of each batch.
pub(crate) fn named_columns(batches: &[RecordBatch], name: &str) -> Result<Vec<ArrayRef>> {
    batches
        .iter()
        .map(|batch| column(batch, name).cloned())
        .collect()
}

pub(crate) fn with_row_count(
    schema: &SchemaRef,
    columns: Vec<ArrayRef>,
    rows: usize,
) -> Result<RecordBatch> {
    let options = RecordBatchOptions::new().with_row_count(Some(rows));
    Ok(RecordBatch::try_new_with_options(
        schema.clone(),
        columns,
        &options,
    )?)
}

/// The rows at `picks` (batch, row) of `batches`, as a batch of `schema`, whose columns are
/// found by name.
pub(crate) fn gather(
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
pub(crate) fn concat_batches(batches: &[RecordBatch], schema: &SchemaRef) -> Result<RecordBatch> {
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
pub(crate) fn interleave_picks(
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
pub(crate) fn interleave_or_null(
    mut values: Vec<ArrayRef>,
    data_type: &DataType,
    picks: impl Iterator<Item = Option<(usize, usize)>>,
) -> Result<ArrayRef> {
    let null = (values.len(), 0);
    values.push(new_null_array(data_type, 1));
    let picks: Vec<(usize, usize)> = picks.map(|pick| pick.unwrap_or(null)).collect();
    interleave_picks(&values, data_type, &picks)
}

pub(crate) fn primitive<T: ArrowPrimitiveType>(array: &ArrayRef) -> Result<&PrimitiveArray<T>> {
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

/// Whether row `row` is null in `nulls` (a missing buffer has no nulls).
pub(crate) fn is_null(nulls: Option<&NullBuffer>, row: usize) -> bool {
    nulls.is_some_and(|nulls| nulls.is_null(row))
}
