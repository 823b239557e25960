//! Arrow blocks: record batches stored as one Arrow IPC file per object, or several blocks
//! packed into one object at 64-byte aligned offsets ([`Packing`]: a shuffle map task's
//! partitions), each read in place on its own ([`read_block_at`]).
//!
//! Writing serializes straight into the object's shared memory: a first pass over a counting
//! sink measures the encoding (the IPC writer is deterministic), so the object is created at
//! its exact size and no intermediate buffer of the block's size is ever allocated. Buffers are
//! padded to 64 bytes, and objects start 64-byte aligned, so every column buffer of the decoded
//! batches is aligned in place. A batch may stand in for some of its buffers ([`LateBuffers`]):
//! their real bytes are written into the object where the writer reaches them, so rows picked
//! from other blocks are copied once, straight into the object.
//!
//! Reading wraps the object's bytes in an Arrow [`Buffer`] that owns a pin on the object, and
//! decodes with [`FileDecoder`]: column buffers are slices of the mapping, no column data is
//! copied, and the object stays pinned as long as any decoded array is alive. Alignment is
//! required rather than repaired, so a misaligned block is an error instead of a silent copy.
//! Arrays are still validated (for fixed-width columns that costs nothing per row; string
//! offsets and UTF-8 are checked in time proportional to their bytes), because objects come
//! from other processes and a damaged one must not become undefined behaviour.

use std::io::Write;
use std::ops::Range;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::buffer::Buffer;
use arrow::datatypes::SchemaRef;
use arrow::error::ArrowError;
use arrow::ipc::convert::try_fb_to_schema;
use arrow::ipc::reader::{FileDecoder, read_footer_length};
use arrow::ipc::writer::{FileWriter, IpcWriteOptions};
use arrow::ipc::{MetadataVersion, root_as_footer};
use floe_core::ObjectId;
use floe_core::hash::{STEP_BYTES, Xxh3_64};

use crate::alloc::aligned;
use crate::{Error, ObjectStore, ObjectView, Result};

/// Length of the IPC file trailer: footer length (4 bytes) and `ARROW1`.
const TRAILER_LEN: usize = 10;

/// A decoded block: its schema and batches, whose buffers point into the object.
#[derive(Debug, Clone)]
pub struct Block {
    pub schema: SchemaRef,
    pub batches: Vec<RecordBatch>,
}

impl Block {
    pub fn num_rows(&self) -> usize {
        self.batches.iter().map(RecordBatch::num_rows).sum()
    }
}

/// Writes `batches` (all of `schema`) as a sealed object; returns the object's size.
pub fn write_block(
    store: &ObjectStore,
    object: ObjectId,
    schema: &SchemaRef,
    batches: &[RecordBatch],
) -> Result<u64> {
    let arrow_error = |source| Error::Block { object, source };
    let len = encoded_len(schema, batches).map_err(arrow_error)?;
    let mut writer = store.create(object, len)?;
    let checksum =
        encode_into(writer.as_mut_slice(), schema, batches, None).map_err(arrow_error)?;
    writer.seal_with_checksum(checksum)?;
    Ok(len)
}

/// The exact bytes `batches` take as a block. Measuring writes nothing: the IPC writer hands
/// a counting sink the column buffers where they lie (arrow's writer is deterministic, so
/// [`encode_into`] then writes exactly this many).
pub fn encoded_len(schema: &SchemaRef, batches: &[RecordBatch]) -> Result<u64, ArrowError> {
    let mut counter = CountingSink(0);
    encode(&mut counter, schema, batches)?;
    Ok(counter.0)
}

/// Buffers whose bytes are written only as their block is: the batches handed to the encoder
/// hold stand-ins of the right length for them, and the encoder asks for each one's real bytes
/// in its place (a shuffle gathers rows straight into an object this way: see
/// `floe_engine::exchange::gathered`).
pub trait LateBuffers {
    /// Whether `buffer`, as the IPC writer hands it over, is a stand-in.
    fn is_stand_in(&self, buffer: &[u8]) -> bool;

    /// Writes the real bytes of `stand_in` into `dest` (as long), calling `written` with
    /// each piece of them once it is complete, in order.
    fn write_in_place(
        &self,
        stand_in: &[u8],
        dest: &mut [u8],
        written: &mut dyn FnMut(&[u8]),
    ) -> Result<(), ArrowError>;
}

/// Writes `batches` as a block into `dest`, which must be exactly [`encoded_len`] bytes (an
/// object's mapping, usually), and returns the xxh3-64 of what it wrote, hashed as it goes
/// while the bytes are still in the cache. Stand-ins in `batches` are written by `late`.
pub fn encode_into(
    dest: &mut [u8],
    schema: &SchemaRef,
    batches: &[RecordBatch],
    late: Option<&dyn LateBuffers>,
) -> Result<u64, ArrowError> {
    let len = dest.len();
    let mut sink = HashingSink {
        dest,
        written: 0,
        hasher: Xxh3_64::new(),
        late,
    };
    encode(&mut sink, schema, batches)?;
    wrote_all(len, sink.written)?;
    Ok(sink.hasher.digest())
}

/// A stand-in's place in the bytes [`lay_out_into`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StandInPlace {
    /// The stand-in's address, which names it to whoever made it.
    pub stand_in: usize,
    pub place: Range<usize>,
}

/// Writes `batches` as a block into `dest`, which must be exactly [`encoded_len`] bytes, but
/// leaves the place of every buffer `is_stand_in` names as it was, and returns those places in
/// order, for the caller to fill (a map task splits its rows straight into them: see
/// `floe_engine::exchange::scattered`). It hashes nothing: the block is whole only once the
/// caller has filled them.
pub fn lay_out_into(
    dest: &mut [u8],
    schema: &SchemaRef,
    batches: &[RecordBatch],
    is_stand_in: &dyn Fn(&[u8]) -> bool,
) -> Result<Vec<StandInPlace>, ArrowError> {
    let len = dest.len();
    let mut sink = PlacingSink {
        dest,
        written: 0,
        is_stand_in,
        places: Vec::new(),
    };
    encode(&mut sink, schema, batches)?;
    wrote_all(len, sink.written)?;
    Ok(sink.places)
}

/// The xxh3-64 of the bytes [`encode_into`] would write, without writing them anywhere (for
/// a block someone else already stored).
pub fn encoded_checksum(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    late: Option<&dyn LateBuffers>,
) -> Result<u64, ArrowError> {
    let mut sink = HashingCounter {
        hasher: Xxh3_64::new(),
        late,
        scratch: Vec::new(),
    };
    encode(&mut sink, schema, batches)?;
    Ok(sink.hasher.digest())
}

/// Where blocks packed into one object lie: each starts 64-byte aligned, so each decodes in
/// place like an object of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packing {
    /// `(offset, len)` of each block in the object, in order.
    pub parts: Vec<(u64, u64)>,
    /// The object's size.
    pub len: u64,
}

impl Packing {
    /// Lays out blocks of `lens` bytes one after the other, each at the next aligned offset;
    /// `None` if the sizes overflow.
    pub fn of(lens: &[u64]) -> Option<Self> {
        let mut parts = Vec::with_capacity(lens.len());
        let mut end = 0u64;
        for &len in lens {
            let offset = aligned(end)?;
            parts.push((offset, len));
            end = offset.checked_add(len)?;
        }
        Some(Self { parts, len: end })
    }

    /// Each part's bytes in `object` (at least [`Self::len`] bytes), in order, with the padding
    /// between parts zeroed so that the object's bytes do not depend on what its memory held.
    pub fn split_mut<'a>(&self, object: &'a mut [u8]) -> Vec<&'a mut [u8]> {
        let mut parts = Vec::with_capacity(self.parts.len());
        let mut rest = object;
        let mut end = 0;
        for &(offset, len) in &self.parts {
            let (padding, tail) = rest.split_at_mut(offset as usize - end);
            padding.fill(0);
            let (part, tail) = tail.split_at_mut(len as usize);
            parts.push(part);
            rest = tail;
            end = (offset + len) as usize;
        }
        parts
    }
}

/// Decodes the block in `view` without copying column data.
pub fn read_block(view: &ObjectView) -> Result<Block> {
    let object = view.object();
    decode(&view.to_buffer()).map_err(|source| Error::Block { object, source })
}

/// Decodes the block packed at bytes `offset..offset + len` of `view` (see [`Packing`])
/// without copying column data.
pub fn read_block_at(view: &ObjectView, offset: u64, len: u64) -> Result<Block> {
    let object = view.object();
    let range = usize::try_from(offset)
        .ok()
        .zip(usize::try_from(len).ok())
        .filter(|(start, len)| start.checked_add(*len).is_some_and(|end| end <= view.len()));
    let Some((start, len)) = range else {
        let problem = format!(
            "bytes {offset}..+{len} lie outside the object's {} bytes",
            view.len()
        );
        return Err(Error::Block {
            object,
            source: ArrowError::IpcError(problem),
        });
    };
    decode(&view.to_buffer().slice_with_length(start, len))
        .map_err(|source| Error::Block { object, source })
}

/// Uncompressed and straight into `sink`: arrow's writer then hands the sink each buffer as
/// it lies, so a [`LateBuffers`] stand-in reaches the sink, never the writer's own reads.
fn encode<W: Write>(
    sink: W,
    schema: &SchemaRef,
    batches: &[RecordBatch],
) -> Result<(), ArrowError> {
    let options = IpcWriteOptions::try_new(64, false, MetadataVersion::V5)?;
    let mut writer = FileWriter::try_new_with_options(sink, schema, options)?;
    for batch in batches {
        writer.write(batch)?;
    }
    writer.finish()
}

pub(crate) fn decode(buffer: &Buffer) -> Result<Block, ArrowError> {
    let bad = |what: &str| ArrowError::IpcError(format!("not an Arrow IPC file: {what}"));
    let trailer_start = buffer
        .len()
        .checked_sub(TRAILER_LEN)
        .ok_or_else(|| bad("shorter than the trailer"))?;
    let mut trailer = [0u8; TRAILER_LEN];
    trailer.copy_from_slice(&buffer[trailer_start..]);
    let footer_len = read_footer_length(trailer)?;
    let footer_start = trailer_start
        .checked_sub(footer_len)
        .ok_or_else(|| bad("footer longer than the file"))?;
    let footer = root_as_footer(&buffer[footer_start..trailer_start])
        .map_err(|error| bad(&format!("unreadable footer: {error}")))?;
    let schema = Arc::new(try_fb_to_schema(
        footer.schema().ok_or_else(|| bad("no schema"))?,
    )?);
    let mut decoder =
        FileDecoder::new(Arc::clone(&schema), footer.version()).with_require_alignment(true);
    let slice = |block: &arrow::ipc::Block| -> Result<Buffer, ArrowError> {
        let start = usize::try_from(block.offset()).map_err(|_| bad("negative offset"))?;
        let len = usize::try_from(block.metaDataLength())
            .ok()
            .zip(usize::try_from(block.bodyLength()).ok())
            .and_then(|(meta, body)| meta.checked_add(body))
            .ok_or_else(|| bad("negative length"))?;
        if start.checked_add(len).is_none_or(|end| end > footer_start) {
            return Err(bad("a message lies outside the file"));
        }
        Ok(buffer.slice_with_length(start, len))
    };
    for block in footer.dictionaries().iter().flatten() {
        decoder.read_dictionary(block, &slice(block)?)?;
    }
    let mut batches = Vec::new();
    for block in footer.recordBatches().iter().flatten() {
        if let Some(batch) = decoder.read_record_batch(block, &slice(block)?)? {
            batches.push(batch);
        }
    }
    Ok(Block { schema, batches })
}

/// An error unless an encoding measured at `len` bytes wrote exactly that many.
fn wrote_all(len: usize, written: usize) -> Result<(), ArrowError> {
    if written == len {
        Ok(())
    } else {
        Err(ArrowError::IpcError(format!(
            "the encoding measured {len} bytes but wrote {written}"
        )))
    }
}

/// Where a write of `len` bytes ends in a slice of `capacity` bytes that holds `written`; an
/// error if it would run past the slice.
fn end_of_write(written: usize, len: usize, capacity: usize) -> std::io::Result<usize> {
    written
        .checked_add(len)
        .filter(|end| *end <= capacity)
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::WriteZero))
}

/// Writes into a slice, hashing what it writes.
struct HashingSink<'a> {
    dest: &'a mut [u8],
    written: usize,
    hasher: Xxh3_64,
    late: Option<&'a dyn LateBuffers>,
}

impl Write for HashingSink<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let end = end_of_write(self.written, bytes.len(), self.dest.len())?;
        let dest = &mut self.dest[self.written..end];
        if let Some(late) = self.late.filter(|late| late.is_stand_in(bytes)) {
            let hasher = &mut self.hasher;
            late.write_in_place(bytes, dest, &mut |piece| hasher.update(piece))
                .map_err(std::io::Error::other)?;
        } else {
            // A step at a time, so the hash reads what the copy just brought into the L1
            // cache: the IPC writer hands over whole column buffers of megabytes, and hashing
            // one after copying it would read it from memory a second time.
            for (to, from) in dest.chunks_mut(STEP_BYTES).zip(bytes.chunks(STEP_BYTES)) {
                to.copy_from_slice(from);
                self.hasher.update(from);
            }
        }
        self.written = end;
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Writes into a slice, but for stand-ins, whose places it notes.
struct PlacingSink<'a> {
    dest: &'a mut [u8],
    written: usize,
    is_stand_in: &'a dyn Fn(&[u8]) -> bool,
    places: Vec<StandInPlace>,
}

impl Write for PlacingSink<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let end = end_of_write(self.written, bytes.len(), self.dest.len())?;
        if (self.is_stand_in)(bytes) {
            self.places.push(StandInPlace {
                stand_in: bytes.as_ptr() as usize,
                place: self.written..end,
            });
        } else {
            self.dest[self.written..end].copy_from_slice(bytes);
        }
        self.written = end;
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Hashes the bytes written to it and keeps none (a stand-in's real bytes pass through one
/// scratch buffer).
struct HashingCounter<'a> {
    hasher: Xxh3_64,
    late: Option<&'a dyn LateBuffers>,
    scratch: Vec<u8>,
}

impl Write for HashingCounter<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if let Some(late) = self.late.filter(|late| late.is_stand_in(bytes)) {
            self.scratch.resize(bytes.len(), 0);
            let hasher = &mut self.hasher;
            late.write_in_place(bytes, &mut self.scratch, &mut |piece| hasher.update(piece))
                .map_err(std::io::Error::other)?;
        } else {
            self.hasher.update(bytes);
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Counts the bytes written to it and keeps none.
struct CountingSink(u64);

impl Write for CountingSink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0 += bytes.len() as u64;
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
