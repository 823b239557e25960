//! Rows gathered straight into the block that holds them.
//!
//! A random shuffle's map task permutes each of its parts, and its reduce interleaves its
//! parts: both pick rows, by (batch, row), out of batches they already hold. Gathering the
//! picks into fresh arrays and then encoding those into an object copies every byte twice, the
//! second time from memory the first has just pushed out of the cache, and faults in the fresh
//! arrays' pages besides. A [`GatheredBlock`] gathers once, into the object.
//!
//! The IPC writer lays a block out from a batch: it needs each buffer's length, and it reads
//! only the small buffers (validity bitmaps and byte arrays' offsets) itself. So the batch it
//! is handed, the block's *layout*, has those small buffers real, gathered ahead, and a
//! stand-in of the right length for each large one (fixed-width values, byte arrays' values).
//! The sink the writer copies into asks the block to write each stand-in's real bytes in its
//! place ([`GatheredBlock::write_in_place`]), a piece at a time, so the sink can hash each
//! piece while it is still in the cache. Columns of any other type are gathered ahead, as
//! before, and encoded as they are.
//!
//! **Invariant:** a stand-in never reaches anything but the block's encoder. The layout is
//! handed out only as what to encode ([`GatheredBlock::layout`], for the worker's encoder);
//! [`GatheredBlock::gather`] is the only way to the rows. Every stand-in is a slice of one
//! read-only private mapping of zero pages (reserved once per process, never written, no
//! memory behind it). Zero bytes are a valid value of every type a stand-in stands for, so the
//! layout is a valid batch even if read. Within a block the stand-ins lie one after the other
//! in the mapping, so each one's address names its column, and an address in the mapping that
//! names none of the block's stand-ins exactly (a sliced one) is an error, never zeros. The
//! worker's encoder also counts the stand-ins it had written against the block's
//! ([`GatheredBlock::stand_ins`]): one the IPC writer read itself (were it ever to compress or
//! buffer what it writes) would otherwise go out as zeros, hashed as written.

use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use arrow::array::{Array, ArrayData, ArrayRef, BooleanBufferBuilder, RecordBatch, make_array};
use arrow::buffer::{Buffer, MutableBuffer, NullBuffer};
use arrow::datatypes::{DataType, SchemaRef};

use floe_core::hash::STEP_BYTES;

use super::columns::{interleave_picks, invalid, named_columns, with_row_count};
use crate::Result;

/// Rows picked by (batch, row) out of some batches: `rows` of `all`, so that the blocks of
/// one reordering share one list.
#[derive(Clone)]
pub(crate) struct Picks {
    all: Arc<Vec<(usize, usize)>>,
    rows: Range<usize>,
}

impl Picks {
    pub(crate) fn new(all: Arc<Vec<(usize, usize)>>, rows: Range<usize>) -> Self {
        Self { all, rows }
    }

    fn as_slice(&self) -> &[(usize, usize)] {
        &self.all[self.rows.clone()]
    }
}

/// The batches a reordering picks its rows from, column by column (found by name), shared by
/// all of its blocks.
pub(crate) struct Sources {
    schema: SchemaRef,
    /// Each source batch's rows.
    rows: Vec<usize>,
    /// For each column of `schema`, every source's array and its data.
    columns: Vec<(Vec<ArrayRef>, Vec<ArrayData>)>,
}

impl Sources {
    /// The columns of `schema` in each of `batches`.
    pub(crate) fn new(batches: &[RecordBatch], schema: &SchemaRef) -> Result<Arc<Self>> {
        let columns = schema
            .fields()
            .iter()
            .map(|field| {
                let arrays = named_columns(batches, field.name())?;
                let data = arrays.iter().map(|array| array.to_data()).collect();
                Ok((arrays, data))
            })
            .collect::<Result<_>>()?;
        Ok(Arc::new(Self {
            schema: schema.clone(),
            rows: batches.iter().map(RecordBatch::num_rows).collect(),
            columns,
        }))
    }

    /// An error unless every pick names a row of a source.
    fn check(&self, picks: &[(usize, usize)]) -> Result<()> {
        let inside =
            |&(batch, row): &(usize, usize)| self.rows.get(batch).is_some_and(|&rows| row < rows);
        if picks.iter().all(inside) {
            Ok(())
        } else {
            Err(no_such_row())
        }
    }
}

/// One output object's rows, picked out of other batches and gathered only as the object is
/// written (see the module's doc).
pub struct GatheredBlock {
    /// The block as the IPC writer sees it: real small buffers, stand-ins for the rest.
    layout: RecordBatch,
    fills: Vec<Fill>,
    sources: Arc<Sources>,
    picks: Picks,
}

impl GatheredBlock {
    /// The rows at `picks` of `sources`, as a block of the sources' schema.
    pub(crate) fn new(sources: &Arc<Sources>, picks: Picks) -> Result<Self> {
        sources.check(picks.as_slice())?;
        let rows = picks.as_slice().len();
        let mut fills = Vec::new();
        // Where the next stand-in starts in the stand-in space.
        let mut next_at = 0;
        let columns = sources
            .schema
            .fields()
            .iter()
            .zip(&sources.columns)
            .enumerate()
            .map(|(column, (field, (arrays, data)))| {
                let Some(kind) = FillKind::of(field.data_type(), arrays) else {
                    return interleave_picks(arrays, field.data_type(), picks.as_slice());
                };
                let nulls = gathered_nulls(data, picks.as_slice())?;
                let (offsets, len) = kind.layout(data, picks.as_slice())?;
                let fill = Fill {
                    at: next_at,
                    len,
                    column,
                    kind,
                };
                let values = match stand_in(next_at, len) {
                    Some(stand_in) => {
                        // Each stand-in starts aligned, as arrow requires of its values.
                        next_at = (next_at + len).next_multiple_of(64);
                        fills.push(fill);
                        stand_in
                    }
                    // No room or no rows: gathered ahead into a buffer of its own.
                    None => fill.gather(sources, picks.as_slice())?,
                };
                // The offsets come from `FillKind::layout`; the values are the gathered ones,
                // copied from valid arrays, or a stand-in.
                Ok(laid_out(field.data_type(), rows, nulls, offsets, values))
            })
            .collect::<Result<Vec<ArrayRef>>>()?;
        Ok(Self {
            layout: with_row_count(&sources.schema, columns, rows)?,
            fills,
            sources: sources.clone(),
            picks,
        })
    }

    /// How many stand-ins the layout holds: an encoder must have had each one written.
    pub fn stand_ins(&self) -> usize {
        self.fills.len()
    }

    pub fn num_rows(&self) -> usize {
        self.layout.num_rows()
    }

    /// The batch to hand the IPC writer: its gathered buffers are stand-ins, whose bytes
    /// [`Self::write_in_place`] writes. Encode it only with that hook.
    pub fn layout(&self) -> &RecordBatch {
        &self.layout
    }

    /// Whether `buffer`, as the IPC writer hands it to its sink, is a stand-in of some block.
    pub fn is_stand_in(buffer: &[u8]) -> bool {
        stand_in_space().is_some_and(|space| space.holds(buffer.as_ptr()))
    }

    /// Writes the real bytes of `stand_in`, one of this block's stand-ins, into `dest` (as
    /// long), a piece of about 8 KiB at a time, calling `written` with each piece once it is
    /// complete.
    pub fn write_in_place(
        &self,
        stand_in: &[u8],
        dest: &mut [u8],
        written: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        let fill = stand_in_space()
            .and_then(|space| {
                self.fills.iter().find(|fill| {
                    space.at(fill.at) == stand_in.as_ptr() && fill.len == stand_in.len()
                })
            })
            .ok_or_else(|| {
                invalid("the IPC writer was handed a stand-in that is none of its block's")
            })?;
        if dest.len() != fill.len {
            return Err(invalid(
                "a stand-in's bytes and their place differ in length",
            ));
        }
        fill.write(&self.sources, self.picks.as_slice(), dest, written)
    }

    /// The rows, gathered into a batch of their own.
    pub fn gather(&self) -> Result<RecordBatch> {
        let mut columns = self.layout.columns().to_vec();
        for fill in &self.fills {
            let data = columns[fill.column].to_data();
            let mut buffers = data.buffers().to_vec();
            let last = buffers.len() - 1;
            buffers[last] = fill.gather(&self.sources, self.picks.as_slice())?;
            // Checked in full: the values are real now, UTF-8 included.
            columns[fill.column] = make_array(data.into_builder().buffers(buffers).build()?);
        }
        with_row_count(self.layout.schema_ref(), columns, self.layout.num_rows())
    }
}

impl std::fmt::Debug for GatheredBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatheredBlock")
            .field("rows", &self.num_rows())
            .field("stand_ins", &self.fills.len())
            .finish()
    }
}

/// How a column's values are gathered.
#[derive(Clone, Copy)]
pub(crate) enum FillKind {
    /// Fixed-width values of this many bytes.
    Fixed(usize),
    /// Variable-length values behind 32-bit offsets (`Utf8`, `Binary`).
    Bytes,
    /// Variable-length values behind 64-bit offsets (`LargeUtf8`, `LargeBinary`).
    LargeBytes,
}

impl FillKind {
    /// The kind for a column of `data_type` whose arrays are `values`; `None` for a type
    /// gathered ahead (booleans, nested and dictionary types, views) or arrays of another type.
    pub(crate) fn of(data_type: &DataType, values: &[ArrayRef]) -> Option<Self> {
        if values.iter().any(|array| array.data_type() != data_type) {
            return None;
        }
        match data_type {
            DataType::Utf8 | DataType::Binary => Some(Self::Bytes),
            DataType::LargeUtf8 | DataType::LargeBinary => Some(Self::LargeBytes),
            other => other
                .primitive_width()
                .filter(|width| [1, 2, 4, 8, 16, 32].contains(width))
                .map(Self::Fixed),
        }
    }

    /// The gathered column's offsets buffer (byte arrays only) and its values' length.
    fn layout(
        self,
        data: &[ArrayData],
        picks: &[(usize, usize)],
    ) -> Result<(Option<Buffer>, usize)> {
        match self {
            Self::Fixed(width) => picks
                .len()
                .checked_mul(width)
                .map(|len| (None, len))
                .ok_or_else(|| invalid("a gathered column overflows memory")),
            Self::Bytes => offsets::<i32>(data, picks),
            Self::LargeBytes => offsets::<i64>(data, picks),
        }
    }
}

/// The offsets of the values at `picks`, one after the other from 0, and their total length.
fn offsets<O: arrow::array::OffsetSizeTrait>(
    data: &[ArrayData],
    picks: &[(usize, usize)],
) -> Result<(Option<Buffer>, usize)> {
    let sources: Vec<&[O]> = data.iter().map(|data| data.buffer::<O>(0)).collect();
    let mut offsets = Vec::with_capacity(picks.len() + 1);
    let mut end = O::zero();
    offsets.push(end);
    for &(batch, row) in picks {
        let (start, stop) = value_range(&sources, batch, row)?;
        end = stop
            .checked_sub(start)
            .and_then(O::from_usize)
            .and_then(|len| end.checked_add(&len))
            .ok_or_else(|| invalid("a gathered column's values overflow its offsets"))?;
        offsets.push(end);
    }
    Ok((Some(Buffer::from_vec(offsets)), end.as_usize()))
}

/// Where value `row` of source `batch` lies in that source's values.
fn value_range<O: arrow::array::OffsetSizeTrait>(
    sources: &[&[O]],
    batch: usize,
    row: usize,
) -> Result<(usize, usize)> {
    let offsets = sources
        .get(batch)
        .and_then(|offsets| offsets.get(row..=row.checked_add(1)?))
        .ok_or_else(no_such_row)?;
    Ok((offsets[0].as_usize(), offsets[1].as_usize()))
}

/// A column of `rows` values of `data_type` as a layout holds it: `offsets` (byte arrays only)
/// start at 0, rise with each value's length and end at the length of `values`, and fixed-width
/// `values` are `rows` wide; the values are real ones, copied from valid arrays, or a
/// stand-in, whose zero bytes are a valid value of every such type (and valid UTF-8).
pub(crate) fn laid_out(
    data_type: &DataType,
    rows: usize,
    nulls: Option<NullBuffer>,
    offsets: Option<Buffer>,
    values: Buffer,
) -> ArrayRef {
    let builder = ArrayData::builder(data_type.clone())
        .len(rows)
        .nulls(nulls)
        .buffers(offsets.into_iter().chain([values]).collect());
    // SAFETY: as the callers promise above: the offsets are in order and within the values,
    // and every value is valid for its type.
    make_array(unsafe { builder.build_unchecked() })
}

/// The gathered column's validity: `None` when no picked row is null.
fn gathered_nulls(data: &[ArrayData], picks: &[(usize, usize)]) -> Result<Option<NullBuffer>> {
    if data.iter().all(|data| data.null_count() == 0) {
        return Ok(None);
    }
    let mut valid = BooleanBufferBuilder::new(picks.len());
    for &(batch, row) in picks {
        let source = data
            .get(batch)
            .filter(|data| row < data.len())
            .ok_or_else(no_such_row)?;
        valid.append(source.is_valid(row));
    }
    Ok(Some(NullBuffer::new(valid.finish())).filter(|nulls| nulls.null_count() > 0))
}

/// One stand-in's column: where it lies and how its values are gathered (from the block's
/// sources and picks).
struct Fill {
    /// Where the stand-in starts in the stand-in space, and its length.
    at: usize,
    len: usize,
    /// The column's index in the block.
    column: usize,
    kind: FillKind,
}

impl Fill {
    /// The real bytes, in a buffer of their own (aligned, as arrow requires of values).
    fn gather(&self, sources: &Sources, picks: &[(usize, usize)]) -> Result<Buffer> {
        let mut bytes = MutableBuffer::from_len_zeroed(self.len);
        self.write(sources, picks, &mut bytes, &mut |_| {})?;
        Ok(bytes.into())
    }

    fn write(
        &self,
        sources: &Sources,
        picks: &[(usize, usize)],
        dest: &mut [u8],
        written: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        // The column of each source batch.
        let data = &sources.columns[self.column].1;
        match self.kind {
            FillKind::Fixed(1) => write_fixed::<1>(data, picks, dest, written),
            FillKind::Fixed(2) => write_fixed::<2>(data, picks, dest, written),
            FillKind::Fixed(4) => write_fixed::<4>(data, picks, dest, written),
            FillKind::Fixed(8) => write_fixed::<8>(data, picks, dest, written),
            FillKind::Fixed(16) => write_fixed::<16>(data, picks, dest, written),
            FillKind::Fixed(32) => write_fixed::<32>(data, picks, dest, written),
            FillKind::Fixed(_) => Err(invalid("a fixed-width type of an unknown width")),
            FillKind::Bytes => write_bytes::<i32>(data, picks, dest, written),
            FillKind::LargeBytes => write_bytes::<i64>(data, picks, dest, written),
        }
    }
}

/// Copies `WIDTH` bytes a row: one move each, no call.
fn write_fixed<const WIDTH: usize>(
    data: &[ArrayData],
    picks: &[(usize, usize)],
    dest: &mut [u8],
    written: &mut dyn FnMut(&[u8]),
) -> Result<()> {
    let sources: Vec<&[[u8; WIDTH]]> = data
        .iter()
        .map(|data| {
            let (values, _) = data.buffers()[0].as_slice().as_chunks::<WIDTH>();
            values
                .get(data.offset()..data.offset() + data.len())
                .ok_or_else(|| invalid("a source's values are shorter than its rows"))
        })
        .collect::<Result<_>>()?;
    let (places, rest) = dest.as_chunks_mut::<WIDTH>();
    if places.len() != picks.len() || !rest.is_empty() {
        return Err(invalid("a fixed-width stand-in is not its rows' width"));
    }
    let rows_per_piece = (STEP_BYTES / WIDTH).max(1);
    for (places, picks) in places
        .chunks_mut(rows_per_piece)
        .zip(picks.chunks(rows_per_piece))
    {
        for (place, &(batch, row)) in places.iter_mut().zip(picks) {
            *place = *sources
                .get(batch)
                .and_then(|values| values.get(row))
                .ok_or_else(no_such_row)?;
        }
        written(places.as_flattened());
    }
    Ok(())
}

/// Copies each value's bytes to where the gathered offsets put it.
fn write_bytes<O: arrow::array::OffsetSizeTrait>(
    data: &[ArrayData],
    picks: &[(usize, usize)],
    dest: &mut [u8],
    written: &mut dyn FnMut(&[u8]),
) -> Result<()> {
    let offsets: Vec<&[O]> = data.iter().map(|data| data.buffer::<O>(0)).collect();
    let values: Vec<&[u8]> = data
        .iter()
        .map(|data| data.buffers()[1].as_slice())
        .collect();
    let mut end = 0;
    let mut reported = 0;
    for (index, &(batch, row)) in picks.iter().enumerate() {
        // Offsets twice as far ahead: prefetching a value reads where it starts.
        if let Some(&(batch, row)) = picks.get(index + 2 * PREFETCH_AHEAD) {
            prefetch_offset(&offsets, batch, row);
        }
        if let Some(&(batch, row)) = picks.get(index + PREFETCH_AHEAD) {
            prefetch_value(&offsets, &values, batch, row);
        }
        let (start, stop) = value_range(&offsets, batch, row)?;
        let value = values[batch]
            .get(start..stop)
            .ok_or_else(|| invalid("a source's offsets lie outside its values"))?;
        let place = dest
            .get_mut(end..end + value.len())
            .ok_or_else(|| invalid("a byte-array stand-in is shorter than its values"))?;
        place.copy_from_slice(value);
        end += value.len();
        if end - reported >= STEP_BYTES {
            written(&dest[reported..end]);
            reported = end;
        }
    }
    if end != dest.len() {
        return Err(invalid("a byte-array stand-in is longer than its values"));
    }
    if end > reported {
        written(&dest[reported..end]);
    }
    Ok(())
}

/// How many picks ahead a byte-array gather asks the CPU for the value it will copy (and
/// twice that for the value's offsets). A random pick misses the cache, and each copy takes a
/// few nanoseconds: this many copies cover most of a miss, and the lines asked for are still
/// cached when their turn comes. Measured on 92-byte strings picked at random from 3–56 MB:
/// 12–35 ns a value without, 11–28 ns with.
const PREFETCH_AHEAD: usize = 8;

/// Asks the CPU to start loading the cache line at `address` into the cache. A hint: it
/// changes no result, and an address outside any mapping is ignored.
#[inline(always)]
fn prefetch<T>(address: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and never faults, whatever the
    // address; SSE, which it needs, is part of every x86_64 target.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(address.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = address;
}

/// Prefetches the offsets of value `row` of source `batch` (its start and, but for one value
/// in 8 or 16, its end, on the same line).
#[inline(always)]
fn prefetch_offset<O>(offsets: &[&[O]], batch: usize, row: usize) {
    if let Some(offsets) = offsets.get(batch) {
        prefetch(offsets.as_ptr().wrapping_add(row));
    }
}

/// Prefetches the lines holding the first 128 bytes of value `row` of source `batch` (a value
/// longer than that reads on in order, which the CPU's own prefetcher follows). A pick outside
/// the sources prefetches nothing: the copy reports it.
#[inline(always)]
fn prefetch_value<O: arrow::array::OffsetSizeTrait>(
    offsets: &[&[O]],
    values: &[&[u8]],
    batch: usize,
    row: usize,
) {
    const LINE: usize = 64;
    let (Some(values), Ok((start, stop))) = (values.get(batch), value_range(offsets, batch, row))
    else {
        return;
    };
    let first = values.as_ptr().wrapping_add(start);
    let end = first.wrapping_add(stop.saturating_sub(start).min(2 * LINE));
    let mut line = first.wrapping_sub(first as usize % LINE);
    while line < end {
        prefetch(line);
        line = line.wrapping_add(LINE);
    }
}

/// Address space for stand-ins: 64 GiB of it, and no memory.
const STAND_IN_SPACE: usize = 1 << 36;

/// The read-only mapping of zero pages every stand-in is a slice of (see the module's doc).
/// Reserved once, the first time a block is gathered, and kept for the process's life.
pub(crate) struct StandInSpace {
    base: usize,
    /// Every stand-in's owner, which frees nothing: the space outlives them all.
    owner: Arc<Never>,
}

impl StandInSpace {
    pub(crate) fn at(&self, offset: usize) -> *const u8 {
        (self.base + offset) as *const u8
    }

    fn holds(&self, address: *const u8) -> bool {
        (self.base..self.base + STAND_IN_SPACE).contains(&(address as usize))
    }
}

/// Owns nothing.
struct Never;

pub(crate) fn stand_in_space() -> Option<&'static StandInSpace> {
    static SPACE: OnceLock<Option<StandInSpace>> = OnceLock::new();
    SPACE
        .get_or_init(|| {
            // SAFETY: a fresh private anonymous mapping, read-only: no memory is committed
            // (MAP_NORESERVE), and reads see the shared zero page. It is never unmapped.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    STAND_IN_SPACE,
                    libc::PROT_READ,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                tracing::warn!(
                    error = %std::io::Error::last_os_error(),
                    "cannot reserve address space for stand-ins; gathering and splitting rows ahead instead"
                );
                return None;
            }
            Some(StandInSpace {
                base: base as usize,
                owner: Arc::new(Never),
            })
        })
        .as_ref()
}

/// A stand-in of `len` bytes at `at` in the stand-in space; `None` if it would not fit, there
/// is no space, or there are no bytes to stand in for (an empty buffer reaches no sink).
pub(crate) fn stand_in(at: usize, len: usize) -> Option<Buffer> {
    let space = stand_in_space()?;
    if len == 0 || at.checked_add(len)? > STAND_IN_SPACE {
        return None;
    }
    let start = NonNull::new(space.at(at).cast_mut())?;
    // SAFETY: `at..at + len` lies inside the mapping, which is readable and never unmapped.
    Some(unsafe { Buffer::from_custom_allocation(start, len, space.owner.clone()) })
}

fn no_such_row() -> crate::Error {
    invalid("a gathered block picks a row that none of its sources holds")
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::Arc;

    use arrow::array::{
        ArrayRef, BooleanArray, Date32Array, Decimal128Array, Int8Array, Int32Array, Int64Array,
        LargeBinaryArray, RecordBatch, StringArray,
    };
    use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
    use arrow::ipc::writer::FileWriter;

    use super::{GatheredBlock, Picks, Sources};
    use crate::exchange::columns::{SplitMix64, gather, scale};

    /// Two sources of every kind of column: fixed widths of 1, 4, 8 and 16 bytes, strings and
    /// large binaries with nulls, and booleans (gathered ahead); the second source is a slice,
    /// so its arrays start past their buffers' first values.
    fn sources() -> (SchemaRef, Vec<RecordBatch>) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("i8", DataType::Int8, false),
            Field::new("i32", DataType::Int32, true),
            Field::new("i64", DataType::Int64, true),
            Field::new("date", DataType::Date32, false),
            Field::new("dec", DataType::Decimal128(20, 2), false),
            Field::new("text", DataType::Utf8, true),
            Field::new("bytes", DataType::LargeBinary, true),
            Field::new("flag", DataType::Boolean, true),
        ]));
        let batch = |n: i64| {
            let columns: Vec<ArrayRef> = vec![
                Arc::new(Int8Array::from_iter_values((0..n).map(|i| (i % 100) as i8))),
                Arc::new(Int32Array::from_iter(
                    (0..n).map(|i| (i % 7 != 0).then_some(i as i32 * 3)),
                )),
                Arc::new(Int64Array::from_iter(
                    (0..n).map(|i| (i % 5 != 1).then_some(i)),
                )),
                Arc::new(Date32Array::from_iter_values((0..n).map(|i| i as i32))),
                Arc::new(
                    Decimal128Array::from_iter_values((0..n).map(|i| i128::from(i) * 1_000_003))
                        .with_precision_and_scale(20, 2)
                        .unwrap(),
                ),
                Arc::new(StringArray::from_iter((0..n).map(|i| {
                    (i % 11 != 3).then(|| "é".repeat((i % 40) as usize) + &i.to_string())
                }))),
                Arc::new(LargeBinaryArray::from_iter((0..n).map(|i| {
                    (i % 13 != 2).then(|| vec![i as u8; (i % 300) as usize])
                }))),
                Arc::new(BooleanArray::from_iter(
                    (0..n).map(|i| (i % 3 != 0).then_some(i % 2 == 0)),
                )),
            ];
            RecordBatch::try_new(schema.clone(), columns).unwrap()
        };
        let sources = vec![batch(3_000), batch(5_000).slice(1_234, 2_500)];
        (schema, sources)
    }

    fn random_picks(sources: &[RecordBatch], rows: usize, seed: u64) -> Vec<(usize, usize)> {
        let mut random = SplitMix64::new(seed);
        (0..rows)
            .map(|_| {
                let batch = scale(random.next_u64(), sources.len());
                (batch, scale(random.next_u64(), sources[batch].num_rows()))
            })
            .collect()
    }

    /// Encodes a block's layout as the object store does, each stand-in's bytes written in
    /// place; returns the file and the pieces `write_in_place` reported, in order.
    struct Sink<'a> {
        block: &'a GatheredBlock,
        file: Vec<u8>,
        reported: Vec<u8>,
    }

    impl Write for Sink<'_> {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            let start = self.file.len();
            self.file.resize(start + bytes.len(), 0xAA);
            if GatheredBlock::is_stand_in(bytes) {
                let reported = &mut self.reported;
                self.block
                    .write_in_place(bytes, &mut self.file[start..], &mut |piece| {
                        reported.extend_from_slice(piece)
                    })
                    .map_err(std::io::Error::other)?;
            } else {
                self.file[start..].copy_from_slice(bytes);
            }
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn encode(schema: &SchemaRef, batch: &RecordBatch, sink: impl Write) {
        let mut writer = FileWriter::try_new(sink, schema).unwrap();
        writer.write(batch).unwrap();
        writer.finish().unwrap();
    }

    /// A gathered block encodes to exactly the bytes of its rows gathered first (arrow's own
    /// `interleave`, then arrow's writer), and its rows equal those rows.
    #[test]
    fn a_gathered_block_encodes_to_the_bytes_of_its_rows_gathered_first() {
        let (schema, sources) = sources();
        let shared = Sources::new(&sources, &schema).unwrap();
        for (rows, seed) in [(0, 1), (1, 2), (7, 3), (4_000, 4), (20_000, 5)] {
            let picks = random_picks(&sources, rows, seed);
            let expected = gather(&sources, &schema, &picks).unwrap();
            let block = GatheredBlock::new(&shared, Picks::new(Arc::new(picks), 0..rows)).unwrap();
            assert_eq!(block.gather().unwrap(), expected, "{rows} rows");

            let mut plain = Vec::new();
            encode(&schema, &expected, &mut plain);
            let mut sink = Sink {
                block: &block,
                file: Vec::new(),
                reported: Vec::new(),
            };
            encode(&schema, block.layout(), &mut sink);
            assert!(sink.file == plain, "{rows} rows: the encodings differ");
            // Every stand-in's bytes were reported, once and in order: the values of the
            // fixed-width and byte-array columns, one after the other.
            let fills: usize = block.fills.iter().map(|fill| fill.len).sum();
            assert_eq!(sink.reported.len(), fills, "{rows} rows");
            if rows > 1 {
                let stand_ins = block.stand_ins();
                assert_eq!(stand_ins, 7, "every column but the booleans stands in");
            }
        }
    }

    /// Rows from a part of a list of picks, as a reduce cuts its reordering into blocks.
    #[test]
    fn a_block_holds_only_its_own_range_of_the_picks() {
        let (schema, sources) = sources();
        let shared = Sources::new(&sources, &schema).unwrap();
        let picks = random_picks(&sources, 900, 9);
        let all = Arc::new(picks.clone());
        let block = GatheredBlock::new(&shared, Picks::new(all, 300..650)).unwrap();
        let expected = gather(&sources, &schema, &picks[300..650]).unwrap();
        assert_eq!(block.gather().unwrap(), expected);
    }

    /// A stand-in handed over sliced, or of another length than its place, is refused: its
    /// place is never left holding zeros.
    #[test]
    fn a_stand_in_that_is_not_the_blocks_own_is_refused() {
        let (schema, sources) = sources();
        let shared = Sources::new(&sources, &schema).unwrap();
        let picks = Arc::new(random_picks(&sources, 500, 11));
        let block = GatheredBlock::new(&shared, Picks::new(picks.clone(), 0..500)).unwrap();
        let values = block.layout().column(2).to_data().buffers()[0].clone();
        assert!(GatheredBlock::is_stand_in(&values));
        let write = |stand_in: &[u8], len: usize| {
            let mut place = vec![0; len];
            block
                .write_in_place(stand_in, &mut place, &mut |_| {})
                .map(|()| place)
        };
        let place = write(&values, values.len()).unwrap();
        assert!(place.iter().any(|byte| *byte != 0));
        assert!(write(&values[8..], values.len() - 8).is_err());
        assert!(write(&values, values.len() - 1).is_err());
        // A block of one row fewer lays its stand-ins out at the same addresses, shorter.
        let other = GatheredBlock::new(&shared, Picks::new(picks, 0..499)).unwrap();
        let theirs = other.layout().column(2).to_data().buffers()[0].clone();
        assert!(write(&theirs, theirs.len()).is_err());
        // An ordinary buffer is no stand-in.
        assert!(!GatheredBlock::is_stand_in(&place));
    }

    /// A pick past a source's rows is an error, not a panic: with every column type, and with
    /// fixed-width columns without nulls alone, which read no offsets or nulls to notice it.
    #[test]
    fn a_pick_outside_the_sources_is_an_error() {
        let (schema, sources) = sources();
        let fixed = Arc::new(schema.project(&[0, 3, 4]).unwrap());
        let projected: Vec<RecordBatch> = sources
            .iter()
            .map(|batch| batch.project(&[0, 3, 4]).unwrap())
            .collect();
        for (schema, sources) in [(&schema, &sources), (&fixed, &projected)] {
            let shared = Sources::new(sources, schema).unwrap();
            for pick in [(2, 0), (1, 2_500), (0, 3_000)] {
                let picks = Arc::new(vec![(0, 1), pick]);
                assert!(GatheredBlock::new(&shared, Picks::new(picks, 0..2)).is_err());
            }
        }
    }
}
