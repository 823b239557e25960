//! A map task's partitions, split straight into the object that holds them (every exchange
//! that routes rows by key: by hash or, for a sort, by range).
//!
//! Splitting a map task's rows into heap arrays, one set per partition, and then encoding those
//! into the task's object writes every byte twice and reads it twice more. Here the split
//! happens in the object: a counting pass over the routed rows finds each partition's rows,
//! value bytes, offsets and validity; each partition's *layout* (as for a
//! [`super::gathered::GatheredBlock`]: real small buffers, a stand-in of the right length for
//! each values buffer) is encoded into its place in the object with every stand-in's place
//! left unwritten; and then one pass over each column of the input writes every row's value
//! into its partition's place ([`ScatteredRows::write_into`]). Each value is copied once, as
//! the split alone copied it; the worker then hashes each part whole, reading it once more.
//!
//! Columns of other types (booleans, nested and dictionary types, views) are split ahead into
//! arrays of their own, as [`super::columns::scatter`] does, and encoded as they are.
//!
//! **Invariant:** as for a gathered block, a stand-in reaches nothing but the encoder, and
//! [`ScatteredRows::write_into`] takes only the places of exactly its layouts' stand-ins, in
//! the order the encoder meets them, and writes every byte of each.

use std::ops::Range;

use arrow::array::{Array, ArrayData, ArrayRef, OffsetSizeTrait, RecordBatch};
use arrow::buffer::{Buffer, MutableBuffer};
use arrow::datatypes::SchemaRef;

use super::columns::{
    invalid, named_columns, row_counts, scatter, scatter_column, scatter_counted, scatter_nulls,
    whole_partition, with_row_count,
};
use super::gathered::{FillKind, GatheredBlock, laid_out, stand_in, stand_in_space};
use crate::Result;
use crate::task::{OutputBlock, Partitions};

/// Rows routed to partitions, laid out to be split straight into their object.
pub struct ScatteredRows {
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    /// Each row's partition, one list per batch.
    assigned: Vec<Vec<usize>>,
    /// One layout per partition.
    layouts: Vec<RecordBatch>,
    /// The columns whose values are written late, in column order.
    fills: Vec<ScatterFill>,
}

/// One column written late: its kind, its data in each batch, and each partition's stand-in.
struct ScatterFill {
    kind: FillKind,
    data: Vec<ArrayData>,
    /// Where each partition's stand-in lies in the stand-in space; `None` for no values.
    stand_ins: Vec<Option<Range<usize>>>,
}

impl ScatteredRows {
    /// `batches` (of `schema`) routed by `assigned` (each row's partition, below `parts`, one
    /// list per batch): laid out to be split as they are written, or split ahead when there
    /// is no stand-in space, or a lone batch goes whole to one partition (no copy at all).
    pub(crate) fn route(
        batches: Vec<RecordBatch>,
        schema: &SchemaRef,
        assigned: Vec<Vec<usize>>,
        parts: usize,
    ) -> Result<Partitions> {
        let counts = row_counts(&batches, &assigned, parts)?;
        let whole = whole_partition(&batches, &counts).is_some();
        if !whole && let Some((layouts, fills)) = lay_out(&batches, schema, &assigned, &counts)? {
            return Ok(Partitions::Scattered(Self {
                schema: schema.clone(),
                batches,
                assigned,
                layouts,
                fills,
            }));
        }
        let split = scatter_counted(&batches, schema, &assigned, &counts)?;
        Ok(Partitions::Blocks(
            split.into_iter().map(OutputBlock::from).collect(),
        ))
    }

    /// Each partition's batch as the IPC writer sees it: its values buffers are stand-ins,
    /// whose places [`Self::write_into`] fills. Encode them only for that.
    pub fn layouts(&self) -> &[RecordBatch] {
        &self.layouts
    }

    /// Whether `buffer`, as the IPC writer hands it to its sink, is a stand-in.
    pub fn is_stand_in(buffer: &[u8]) -> bool {
        GatheredBlock::is_stand_in(buffer)
    }

    /// Writes every partition's values into `object`, where the encoder put the layouts'
    /// stand-ins: `places` holds each stand-in's address and its place in `object`, in the
    /// order the encoder met them (the partitions' layouts one after the other, each column
    /// by column). An error, with nothing written, unless they name exactly the layouts'
    /// stand-ins, in order, each as long as its stand-in and none overlapping another or
    /// lying outside `object` (where in its part the encoder put each one, only the encoder
    /// knows). Once it returns, every byte of every place is written; the errors it can give
    /// after it has begun writing are broken invariants (input that changed under it).
    pub fn write_into(&self, object: &mut [u8], places: &[(usize, Range<usize>)]) -> Result<()> {
        let space = stand_in_space().ok_or_else(|| invalid("stand-ins without their space"))?;
        let parts = self.layouts.len();
        let mut dests: Vec<Vec<&mut [u8]>> = self
            .fills
            .iter()
            .map(|_| (0..parts).map(|_| <&mut [u8]>::default()).collect())
            .collect();
        let expected = (0..parts).flat_map(|partition| {
            self.fills
                .iter()
                .enumerate()
                .filter_map(move |(fill, late)| {
                    let at = late.stand_ins[partition].clone()?;
                    Some((fill, partition, at))
                })
        });
        let mut places = places.iter();
        let mut rest: &mut [u8] = object;
        // Where `rest` starts in the object.
        let mut cut = 0;
        for (fill, partition, at) in expected {
            let (address, place) = places.next().ok_or_else(|| {
                invalid("the encoder placed fewer stand-ins than the layouts hold")
            })?;
            let fits = *address == space.at(at.start) as usize
                && place.len() == at.len()
                && place.start >= cut
                && place.end - cut <= rest.len();
            if !fits {
                return Err(invalid(
                    "a place is not the layouts' next stand-in, or overlaps another, or lies outside the object",
                ));
            }
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(place.start - cut);
            let (dest, tail) = tail.split_at_mut(place.len());
            dests[fill][partition] = dest;
            rest = tail;
            cut = place.end;
        }
        if places.next().is_some() {
            return Err(invalid(
                "the encoder placed more stand-ins than the layouts hold",
            ));
        }
        for (fill, dests) in self.fills.iter().zip(dests) {
            match fill.kind {
                FillKind::Fixed(1) => scatter_fixed::<1>(&fill.data, &self.assigned, dests)?,
                FillKind::Fixed(2) => scatter_fixed::<2>(&fill.data, &self.assigned, dests)?,
                FillKind::Fixed(4) => scatter_fixed::<4>(&fill.data, &self.assigned, dests)?,
                FillKind::Fixed(8) => scatter_fixed::<8>(&fill.data, &self.assigned, dests)?,
                FillKind::Fixed(16) => scatter_fixed::<16>(&fill.data, &self.assigned, dests)?,
                FillKind::Fixed(32) => scatter_fixed::<32>(&fill.data, &self.assigned, dests)?,
                FillKind::Fixed(_) => {
                    return Err(invalid("a fixed-width type of an unknown width"));
                }
                FillKind::Bytes => scatter_values::<i32>(&fill.data, &self.assigned, dests)?,
                FillKind::LargeBytes => scatter_values::<i64>(&fill.data, &self.assigned, dests)?,
            }
        }
        Ok(())
    }

    /// The partitions' rows, split into batches of their own.
    pub fn split(&self) -> Result<Vec<RecordBatch>> {
        scatter(
            &self.batches,
            &self.schema,
            &self.assigned,
            self.layouts.len(),
        )
    }
}

impl std::fmt::Debug for ScatteredRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScatteredRows")
            .field("partitions", &self.layouts.len())
            .field("late_columns", &self.fills.len())
            .finish()
    }
}

/// Each partition's layout and the columns written late, for `batches` routed by `assigned`
/// into partitions of `counts` rows; `None` when the stand-in space is missing or full.
fn lay_out(
    batches: &[RecordBatch],
    schema: &SchemaRef,
    assigned: &[Vec<usize>],
    counts: &[usize],
) -> Result<Option<(Vec<RecordBatch>, Vec<ScatterFill>)>> {
    if stand_in_space().is_none() {
        return Ok(None);
    }
    let mut columns: Vec<Vec<ArrayRef>> =
        vec![Vec::with_capacity(schema.fields().len()); counts.len()];
    let mut fills = Vec::new();
    // Where the next stand-in starts in the stand-in space.
    let mut next_at = 0;
    for field in schema.fields() {
        let arrays = named_columns(batches, field.name())?;
        let Some(kind) = FillKind::of(field.data_type(), &arrays) else {
            let split = scatter_column(&arrays, field.data_type(), assigned, counts)?;
            for (partition, array) in columns.iter_mut().zip(split) {
                partition.push(array);
            }
            continue;
        };
        let data: Vec<ArrayData> = arrays.iter().map(|array| array.to_data()).collect();
        let nulls = scatter_nulls(&arrays, assigned, counts);
        let offsets = match kind {
            FillKind::Fixed(width) => fixed_lens(counts, width)?,
            FillKind::Bytes => scatter_offsets::<i32>(&data, assigned, counts)?,
            FillKind::LargeBytes => scatter_offsets::<i64>(&data, assigned, counts)?,
        };
        let mut stand_ins = Vec::with_capacity(counts.len());
        for (partition, ((offsets, len), nulls)) in offsets.into_iter().zip(nulls).enumerate() {
            let values = if len == 0 {
                stand_ins.push(None);
                MutableBuffer::new(0).into()
            } else {
                let Some(values) = stand_in(next_at, len) else {
                    return Ok(None);
                };
                stand_ins.push(Some(next_at..next_at + len));
                // Each stand-in starts aligned, as arrow requires of its values.
                next_at = (next_at + len).next_multiple_of(64);
                values
            };
            columns[partition].push(laid_out(
                field.data_type(),
                counts[partition],
                nulls,
                offsets,
                values,
            ));
        }
        fills.push(ScatterFill {
            kind,
            data,
            stand_ins,
        });
    }
    let layouts = columns
        .into_iter()
        .zip(counts)
        .map(|(columns, &rows)| with_row_count(schema, columns, rows))
        .collect::<Result<_>>()?;
    Ok(Some((layouts, fills)))
}

/// A fixed-width column's values' length in each partition (and no offsets).
fn fixed_lens(counts: &[usize], width: usize) -> Result<Vec<(Option<Buffer>, usize)>> {
    counts
        .iter()
        .map(|rows| {
            rows.checked_mul(width)
                .map(|len| (None, len))
                .ok_or_else(|| invalid("a partition's column overflows memory"))
        })
        .collect()
}

/// A byte-array column's offsets in each partition, from 0, and its values' length.
fn scatter_offsets<O: OffsetSizeTrait>(
    data: &[ArrayData],
    assigned: &[Vec<usize>],
    counts: &[usize],
) -> Result<Vec<(Option<Buffer>, usize)>> {
    let mut offsets: Vec<Vec<O>> = counts
        .iter()
        .map(|&rows| {
            let mut offsets = Vec::with_capacity(rows + 1);
            offsets.push(O::zero());
            offsets
        })
        .collect();
    let mut ends = vec![0usize; counts.len()];
    for (data, assigned) in data.iter().zip(assigned) {
        for (value, &partition) in data.buffer::<O>(0).windows(2).zip(assigned) {
            let end = &mut ends[partition];
            *end += value[1].as_usize() - value[0].as_usize();
            let offset = O::from_usize(*end).ok_or_else(|| {
                invalid(format!(
                    "a partition holds over {} bytes of a column",
                    O::MAX_OFFSET
                ))
            })?;
            offsets[partition].push(offset);
        }
    }
    Ok(offsets
        .into_iter()
        .zip(ends)
        .map(|(offsets, len)| (Some(Buffer::from_vec(offsets)), len))
        .collect())
}

/// Copies `WIDTH` bytes a row into its partition's place: one move each, no call.
fn scatter_fixed<const WIDTH: usize>(
    data: &[ArrayData],
    assigned: &[Vec<usize>],
    dests: Vec<&mut [u8]>,
) -> Result<()> {
    let mut places = dests
        .into_iter()
        .map(|dest| match dest.as_chunks_mut::<WIDTH>() {
            (places, []) => Ok(places),
            _ => Err(invalid("a fixed-width stand-in is not its rows' width")),
        })
        .collect::<Result<Vec<_>>>()?;
    let mut next = vec![0usize; places.len()];
    for (data, assigned) in data.iter().zip(assigned) {
        let (values, _) = data.buffers()[0].as_slice().as_chunks::<WIDTH>();
        let values = values
            .get(data.offset()..data.offset() + data.len())
            .ok_or_else(|| invalid("a column's values are shorter than its rows"))?;
        for (value, &partition) in values.iter().zip(assigned) {
            let row = &mut next[partition];
            *places[partition]
                .get_mut(*row)
                .ok_or_else(|| invalid("a fixed-width stand-in is shorter than its rows"))? =
                *value;
            *row += 1;
        }
    }
    full(&next, places.iter().map(|places| places.len()))
}

/// Copies each value's bytes to the end of its partition's values so far.
fn scatter_values<O: OffsetSizeTrait>(
    data: &[ArrayData],
    assigned: &[Vec<usize>],
    mut dests: Vec<&mut [u8]>,
) -> Result<()> {
    let mut next = vec![0usize; dests.len()];
    for (data, assigned) in data.iter().zip(assigned) {
        let values = data.buffers()[1].as_slice();
        for (ends, &partition) in data.buffer::<O>(0).windows(2).zip(assigned) {
            let value = values
                .get(ends[0].as_usize()..ends[1].as_usize())
                .ok_or_else(|| invalid("a column's offsets lie outside its values"))?;
            let end = &mut next[partition];
            dests[partition]
                .get_mut(*end..*end + value.len())
                .ok_or_else(|| invalid("a byte-array stand-in is shorter than its values"))?
                .copy_from_slice(value);
            *end += value.len();
        }
    }
    full(&next, dests.iter().map(|dest| dest.len()))
}

/// An error unless every place was written to its end.
fn full(written: &[usize], lens: impl Iterator<Item = usize>) -> Result<()> {
    if written.iter().copied().eq(lens) {
        Ok(())
    } else {
        Err(invalid("a stand-in is longer than its values"))
    }
}
