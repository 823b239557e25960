//! What every exchange does with columns and batches: look columns up by name, gather and
//! interleave rows, split batches by a partition per row, and draw seeded random numbers.

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, ArrowPrimitiveType, BooleanBufferBuilder, GenericByteArray, OffsetSizeTrait,
    PrimitiveArray, downcast_primitive, new_empty_array, new_null_array,
};
use arrow::buffer::{Buffer, NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow::compute::{concat, interleave};
use arrow::datatypes::{
    ArrowNativeType, BinaryType, ByteArrayType, DataType, LargeBinaryType, LargeUtf8Type,
    SchemaRef, Utf8Type,
};
use arrow::error::ArrowError;
use arrow::record_batch::{RecordBatch, RecordBatchOptions};

use super::gathered::{GatheredBlock, Picks, Sources};
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

/// Rows of `batches` (of `schema`) in a new order, not yet copied: `picks` lists each output
/// row's (batch, row). A sink writes such rows a chunk at a time, so a partition is never held
/// whole twice (its input blocks and a sorted copy) while its files are written.
pub struct Reordering {
    batches: Vec<RecordBatch>,
    schema: SchemaRef,
    picks: Vec<(usize, usize)>,
}

impl Reordering {
    pub(crate) fn new(
        batches: Vec<RecordBatch>,
        schema: SchemaRef,
        picks: Vec<(usize, usize)>,
    ) -> Self {
        Self {
            batches,
            schema,
            picks,
        }
    }

    /// Every row, gathered into one batch.
    pub fn gather_all(&self) -> Result<RecordBatch> {
        gather(&self.batches, &self.schema, &self.picks)
    }

    /// The rows that hold about `bytes` of the input (its bytes per row; all of them when
    /// the input has no bytes).
    pub fn rows_in(&self, bytes: u64) -> usize {
        let input_bytes: u64 = self.batches.iter().map(crate::blocks::data_bytes).sum();
        let input_rows: u64 = self.batches.iter().map(|b| b.num_rows() as u64).sum();
        (u128::from(input_rows) * u128::from(bytes))
            .checked_div(u128::from(input_bytes))
            .map_or(usize::MAX, |rows| {
                usize::try_from(rows).unwrap_or(usize::MAX)
            })
    }

    /// The rows in order, gathered `rows` at a time (at least one per chunk).
    pub fn chunks(&self, rows: usize) -> impl Iterator<Item = Result<RecordBatch>> + '_ {
        self.picks
            .chunks(rows.max(1))
            .map(|picks| gather(&self.batches, &self.schema, picks))
    }

    /// The rows in order, `rows` to a block (at least one), each block gathered only as it is
    /// written; no block for no rows.
    pub(crate) fn blocks(self, rows: usize) -> Result<Vec<GatheredBlock>> {
        let sources = Sources::new(&self.batches, &self.schema)?;
        let total = self.picks.len();
        let picks = Arc::new(self.picks);
        (0..total)
            .step_by(rows.max(1))
            .map(|start| {
                let rows = Picks::new(picks.clone(), start..total.min(start + rows.max(1)));
                GatheredBlock::new(&sources, rows)
            })
            .collect()
    }
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

/// The rows of `batches` (of `schema`) split into `parts` batches: row r of batch b goes to
/// partition `partitions[b][r]`, and each partition keeps the input order.
///
/// One pass over each column writes every row into its partition's buffers. Gathering each
/// partition on its own (`interleave`) read every column once per partition, through a
/// (batch, row) pair per row, which cost a hash shuffle's map side most of its time.
pub(crate) fn scatter(
    batches: &[RecordBatch],
    schema: &SchemaRef,
    partitions: &[Vec<usize>],
    parts: usize,
) -> Result<Vec<RecordBatch>> {
    let counts = row_counts(batches, partitions, parts)?;
    scatter_counted(batches, schema, partitions, &counts)
}

/// The partition a lone batch goes to whole, and that batch, when it does (then it is split
/// with no copy).
pub(crate) fn whole_partition<'a>(
    batches: &'a [RecordBatch],
    counts: &[usize],
) -> Option<(usize, &'a RecordBatch)> {
    let [batch] = batches else {
        return None;
    };
    let whole = counts.iter().position(|&rows| rows == batch.num_rows())?;
    Some((whole, batch))
}

/// [`scatter`] with the rows `partitions` sends to each partition already counted
/// ([`row_counts`]).
pub(crate) fn scatter_counted(
    batches: &[RecordBatch],
    schema: &SchemaRef,
    partitions: &[Vec<usize>],
    counts: &[usize],
) -> Result<Vec<RecordBatch>> {
    let parts = counts.len();
    if let Some((whole, batch)) = whole_partition(batches, counts) {
        // One block going whole to one partition: no copy.
        return Ok((0..parts)
            .map(|partition| {
                if partition == whole {
                    batch.clone()
                } else {
                    batch.slice(0, 0)
                }
            })
            .collect());
    }
    let mut columns: Vec<Vec<ArrayRef>> = vec![Vec::with_capacity(schema.fields().len()); parts];
    for field in schema.fields() {
        let values = named_columns(batches, field.name())?;
        let split = scatter_column(&values, field.data_type(), partitions, counts)?;
        for (partition, array) in columns.iter_mut().zip(split) {
            partition.push(array);
        }
    }
    columns
        .into_iter()
        .zip(counts.iter().copied())
        .map(|(columns, rows)| with_row_count(schema, columns, rows))
        .collect()
}

/// How many rows `partitions` (each row's partition, one list per batch) sends to each of
/// `parts` partitions; an error unless it names one partition below `parts` for every row.
pub(crate) fn row_counts(
    batches: &[RecordBatch],
    partitions: &[Vec<usize>],
    parts: usize,
) -> Result<Vec<usize>> {
    if partitions.len() != batches.len() {
        return Err(invalid("a partition list per batch is needed"));
    }
    let mut counts = vec![0usize; parts];
    for (batch, assigned) in batches.iter().zip(partitions) {
        if assigned.len() != batch.num_rows() {
            return Err(invalid(format!(
                "{} partitions for a batch of {} rows",
                assigned.len(),
                batch.num_rows()
            )));
        }
        for &partition in assigned {
            *counts
                .get_mut(partition)
                .ok_or_else(|| invalid(format!("no partition {partition} of {parts}")))? += 1;
        }
    }
    Ok(counts)
}

/// One column of [`scatter`]: `values` (one array per batch) split by `partitions`, into
/// arrays of `counts` rows.
pub(crate) fn scatter_column(
    values: &[ArrayRef],
    data_type: &DataType,
    partitions: &[Vec<usize>],
    counts: &[usize],
) -> Result<Vec<ArrayRef>> {
    macro_rules! primitive_helper {
        ($t:ty, $values:ident, $partitions:ident, $counts:ident, $data_type:ident) => {
            scatter_primitive::<$t>($values, $partitions, $counts, $data_type)
        };
    }
    downcast_primitive! {
        data_type => (primitive_helper, values, partitions, counts, data_type),
        DataType::Utf8 => scatter_bytes::<Utf8Type>(values, partitions, counts),
        DataType::LargeUtf8 => scatter_bytes::<LargeUtf8Type>(values, partitions, counts),
        DataType::Binary => scatter_bytes::<BinaryType>(values, partitions, counts),
        DataType::LargeBinary => scatter_bytes::<LargeBinaryType>(values, partitions, counts),
        _ => {
            // Other types (booleans, views, nested, dictionaries) are rare in shuffles: each
            // partition is gathered on its own.
            let mut picks: Vec<Vec<(usize, usize)>> =
                counts.iter().map(|&rows| Vec::with_capacity(rows)).collect();
            for (array, assigned) in partitions.iter().enumerate() {
                for (row, &partition) in assigned.iter().enumerate() {
                    picks[partition].push((array, row));
                }
            }
            picks
                .iter()
                .map(|picks| interleave_picks(values, data_type, picks))
                .collect()
        }
    }
}

fn scatter_primitive<T: ArrowPrimitiveType>(
    values: &[ArrayRef],
    partitions: &[Vec<usize>],
    counts: &[usize],
    data_type: &DataType,
) -> Result<Vec<ArrayRef>> {
    let mut split: Vec<Vec<T::Native>> = counts
        .iter()
        .map(|&rows| Vec::with_capacity(rows))
        .collect();
    for (array, assigned) in values.iter().zip(partitions) {
        for (value, &partition) in primitive::<T>(array)?.values().iter().zip(assigned) {
            split[partition].push(*value);
        }
    }
    Ok(split
        .into_iter()
        .zip(scatter_nulls(values, partitions, counts))
        .map(|(split, nulls)| {
            let array = PrimitiveArray::<T>::new(ScalarBuffer::from(split), nulls)
                .with_data_type(data_type.clone());
            Arc::new(array) as ArrayRef
        })
        .collect())
}

fn scatter_bytes<T: ByteArrayType>(
    values: &[ArrayRef],
    partitions: &[Vec<usize>],
    counts: &[usize],
) -> Result<Vec<ArrayRef>> {
    let arrays = values
        .iter()
        .map(|array| {
            array
                .as_any()
                .downcast_ref::<GenericByteArray<T>>()
                .ok_or_else(|| {
                    invalid(format!(
                        "expected {}, got {}",
                        T::DATA_TYPE,
                        array.data_type()
                    ))
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut bytes = vec![0usize; counts.len()];
    for (array, assigned) in arrays.iter().zip(partitions) {
        for (ends, &partition) in array.value_offsets().windows(2).zip(assigned) {
            bytes[partition] += ends[1].as_usize() - ends[0].as_usize();
        }
    }
    let mut split: Vec<(Vec<T::Offset>, Vec<u8>)> = counts
        .iter()
        .zip(&bytes)
        .map(|(&rows, &bytes)| {
            let mut offsets = Vec::with_capacity(rows + 1);
            offsets.push(T::Offset::usize_as(0));
            (offsets, Vec::with_capacity(bytes))
        })
        .collect();
    for (array, assigned) in arrays.iter().zip(partitions) {
        let data = array.value_data();
        for (ends, &partition) in array.value_offsets().windows(2).zip(assigned) {
            let (offsets, values) = &mut split[partition];
            values.extend_from_slice(&data[ends[0].as_usize()..ends[1].as_usize()]);
            offsets.push(T::Offset::from_usize(values.len()).ok_or_else(|| {
                invalid(format!(
                    "a partition holds over {} bytes of {}",
                    T::Offset::MAX_OFFSET,
                    T::DATA_TYPE
                ))
            })?);
        }
    }
    Ok(split
        .into_iter()
        .zip(scatter_nulls(values, partitions, counts))
        .map(|((offsets, values), nulls)| {
            let offsets = OffsetBuffer::new(ScalarBuffer::from(offsets));
            // SAFETY: every value is a whole value of an array of type `T`, copied byte for
            // byte (so valid UTF-8 when `T` is a string type), and the offsets were pushed
            // as each value's end, so they are in order and within `values`.
            let array = unsafe {
                GenericByteArray::<T>::new_unchecked(offsets, Buffer::from_vec(values), nulls)
            };
            Arc::new(array) as ArrayRef
        })
        .collect())
}

/// The validity of [`scatter`]'s partitions of `values`: `None` for a partition without nulls.
pub(crate) fn scatter_nulls(
    values: &[ArrayRef],
    partitions: &[Vec<usize>],
    counts: &[usize],
) -> Vec<Option<NullBuffer>> {
    if values.iter().all(|array| array.null_count() == 0) {
        return vec![None; counts.len()];
    }
    let mut valid: Vec<BooleanBufferBuilder> = counts
        .iter()
        .map(|&rows| BooleanBufferBuilder::new(rows))
        .collect();
    for (array, assigned) in values.iter().zip(partitions) {
        for (row, &partition) in assigned.iter().enumerate() {
            valid[partition].append(array.is_valid(row));
        }
    }
    valid
        .into_iter()
        .map(|mut valid| {
            Some(NullBuffer::new(valid.finish())).filter(|nulls| nulls.null_count() > 0)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use arrow::array::{
        BooleanArray, Decimal128Array, Float64Array, Int64Array, LargeBinaryArray, StringArray,
        TimestampMillisecondArray, UInt64Array,
    };
    use arrow::compute::take_record_batch;
    use arrow::datatypes::{Field, Schema};

    use super::*;

    /// `rows` rows of every kind of column [`scatter`] treats apart (nulls in some), starting
    /// at `start`.
    fn mixed(schema: &SchemaRef, start: i64, rows: i64) -> RecordBatch {
        let ids = start..start + rows;
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from_iter(
                ids.clone().map(|i| (i % 7 != 0).then_some(i)),
            )),
            Arc::new(Float64Array::from_iter_values(
                ids.clone().map(|i| i as f64 / 4.0),
            )),
            Arc::new(StringArray::from_iter(
                ids.clone()
                    .map(|i| (i % 5 != 0).then(|| "é".repeat((i % 9) as usize))),
            )),
            Arc::new(LargeBinaryArray::from_iter_values(
                ids.clone().map(|i| i.to_le_bytes()),
            )),
            Arc::new(BooleanArray::from_iter(
                ids.clone().map(|i| (i % 3 != 0).then_some(i % 2 == 0)),
            )),
            Arc::new(
                TimestampMillisecondArray::from_iter_values(ids.clone())
                    .with_timezone("Europe/Paris"),
            ),
            Arc::new(
                Decimal128Array::from_iter_values(ids.map(i128::from))
                    .with_precision_and_scale(12, 2)
                    .unwrap(),
            ),
        ];
        RecordBatch::try_new(schema.clone(), columns).unwrap()
    }

    fn mixed_schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("int", DataType::Int64, true),
            Field::new("float", DataType::Float64, false),
            Field::new("text", DataType::Utf8, true),
            Field::new("bytes", DataType::LargeBinary, false),
            Field::new("flag", DataType::Boolean, true),
            Field::new(
                "at",
                DataType::Timestamp(
                    arrow::datatypes::TimeUnit::Millisecond,
                    Some("Europe/Paris".into()),
                ),
                false,
            ),
            Field::new("amount", DataType::Decimal128(12, 2), false),
        ]))
    }

    #[test]
    fn scattered_partitions_equal_each_partitions_rows_taken_in_input_order() {
        let schema = mixed_schema();
        let batches = vec![
            mixed(&schema, 0, 40),
            mixed(&schema, 40, 0),
            mixed(&schema, 40, 23),
        ];
        let parts = 5;
        let mut random = SplitMix64::new(11);
        let partitions: Vec<Vec<usize>> = batches
            .iter()
            .map(|batch| {
                (0..batch.num_rows())
                    .map(|_| scale(random.next_u64(), parts))
                    .collect()
            })
            .collect();
        let split = scatter(&batches, &schema, &partitions, parts).unwrap();
        assert_eq!(split.len(), parts);
        for (partition, got) in split.iter().enumerate() {
            // The independent answer: arrow's `take` of the partition's rows of each batch,
            // concatenated in batch order.
            let pieces: Vec<RecordBatch> = batches
                .iter()
                .zip(&partitions)
                .map(|(batch, assigned)| {
                    let rows: Vec<u64> = (0..assigned.len())
                        .filter(|&row| assigned[row] == partition)
                        .map(|row| row as u64)
                        .collect();
                    take_record_batch(batch, &UInt64Array::from(rows)).unwrap()
                })
                .collect();
            let expected = arrow::compute::concat_batches(&schema, &pieces).unwrap();
            assert_eq!(got, &expected, "partition {partition}");
        }
        let rows: usize = split.iter().map(RecordBatch::num_rows).sum();
        assert_eq!(rows, 63);
    }

    #[test]
    fn a_batch_going_whole_to_one_partition_is_not_copied_and_bad_partitions_are_refused() {
        let schema = mixed_schema();
        let batch = mixed(&schema, 0, 10);
        let split = scatter(std::slice::from_ref(&batch), &schema, &[vec![2; 10]], 3).unwrap();
        assert_eq!(
            split[2].column(2).to_data().buffers()[1].as_ptr(),
            batch.column(2).to_data().buffers()[1].as_ptr()
        );
        assert_eq!((split[0].num_rows(), split[1].num_rows()), (0, 0));

        let refused = scatter(std::slice::from_ref(&batch), &schema, &[vec![3; 10]], 3);
        assert!(
            refused
                .unwrap_err()
                .to_string()
                .contains("no partition 3 of 3")
        );
        let short = scatter(std::slice::from_ref(&batch), &schema, &[vec![0; 9]], 3);
        assert!(
            short
                .unwrap_err()
                .to_string()
                .contains("9 partitions for a batch of 10 rows")
        );
    }

    /// A reordering gathered a chunk at a time gives the rows of the whole gather, in order,
    /// in chunks of at most the size asked for.
    #[test]
    fn a_reordering_gathers_in_chunks_what_it_gathers_whole() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
        ]));
        let block = |ids: std::ops::Range<i64>| {
            let names = StringArray::from_iter(
                ids.clone()
                    .map(|id| (id % 3 != 0).then(|| format!("row {id}"))),
            );
            RecordBatch::try_new(
                schema.clone(),
                vec![Arc::new(Int64Array::from_iter_values(ids)), Arc::new(names)],
            )
            .unwrap()
        };
        let batches = vec![block(0..40), block(40..100)];
        // Every row once, in an order that hops between the blocks (37 is prime to 100).
        let picks: Vec<(usize, usize)> = (0..100)
            .map(|i| match (i * 37) % 100 {
                row @ 0..40 => (0, row),
                row => (1, row - 40),
            })
            .collect();
        let reordering = Reordering::new(batches, schema.clone(), picks);
        let whole = reordering.gather_all().unwrap();
        assert_eq!(whole.num_rows(), 100);
        for size in [1, 7, 33, 100, 1000] {
            let chunks: Vec<RecordBatch> = reordering.chunks(size).map(Result::unwrap).collect();
            assert_eq!(chunks.len(), 100usize.div_ceil(size), "chunks of {size}");
            assert!(chunks.iter().all(|chunk| chunk.num_rows() <= size));
            let joined = concat_batches(&chunks, &schema).unwrap();
            assert_eq!(joined, whole, "chunks of {size}");
        }
    }
}
