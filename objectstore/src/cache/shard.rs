//! One shard file: its name, its atomic write, and its verified zero-copy open.
//!
//! A shard is an Arrow IPC file. Its manifest is JSON in the file footer's custom metadata, and
//! the manifest's checksum covers every byte before the end-of-stream marker (header, schema,
//! dictionaries and record batches). The footer is written last, so the checksum can be
//! computed while the data streams out, and there is exactly one file per shard: a reader can
//! never pair one writer's data with another writer's manifest.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use arrow::array::RecordBatch;
use arrow::buffer::Buffer;
use arrow::datatypes::SchemaRef;
use arrow::ipc::MetadataVersion;
use arrow::ipc::reader::read_footer_length;
use arrow::ipc::root_as_footer;
use arrow::ipc::writer::{FileWriter, IpcWriteOptions};
use floe_core::Fingerprint;
use floe_core::fingerprint::FingerprintInputs;
use xxhash_rust::xxh3::{Xxh3Default, xxh3_64, xxh3_128};

use super::manifest::{Checksum, FieldSummary, MANIFEST_KEY, Manifest};
use super::{CacheError, PinGuard, Result};
use crate::block::{self, Block};

/// Length of the IPC file trailer: footer length (4 bytes) and `ARROW1`.
const TRAILER_LEN: usize = 10;
/// The data bytes are checksummed in pieces this long as well as whole.
pub(crate) const CHUNK_BYTES: u64 = 1 << 20;
/// Temporary files start with this, so they never parse as a shard.
pub(crate) const TEMP_PREFIX: &str = ".tmp-";

/// Which shard of how many: shard files of one fingerprint may exist for several counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ShardIndex {
    pub rank: u32,
    pub count: u32,
}

impl ShardIndex {
    /// Names hold five digits, so counts stop at 99 999 and every shard has one name.
    pub const MAX_COUNT: u32 = 99_999;

    pub fn new(rank: u32, count: u32) -> Result<Self> {
        if count == 0 || count > Self::MAX_COUNT || rank >= count {
            return Err(CacheError::InvalidShard { rank, count });
        }
        Ok(Self { rank, count })
    }
}

/// A shard file's identity, as spelled in its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ShardName {
    pub fingerprint: Fingerprint,
    pub shard: ShardIndex,
}

impl ShardName {
    pub fn file_name(&self) -> String {
        format!(
            "cache-{}_{:05}_of_{:05}.arrow",
            self.fingerprint, self.shard.rank, self.shard.count
        )
    }

    /// The inverse of [`file_name`](Self::file_name); `None` for any other file.
    pub fn parse(file_name: &str) -> Option<Self> {
        let stem = file_name.strip_prefix("cache-")?.strip_suffix(".arrow")?;
        let (fingerprint, rest) = stem.split_once('_')?;
        let (rank, count) = rest.split_once("_of_")?;
        let digits = |text: &str| {
            (text.len() == 5 && text.bytes().all(|b| b.is_ascii_digit()))
                .then(|| text.parse::<u32>().ok())
                .flatten()
        };
        let shard = ShardIndex::new(digits(rank)?, digits(count)?).ok()?;
        Some(Self {
            fingerprint: fingerprint.parse().ok()?,
            shard,
        })
    }
}

/// What a shard write needs besides the data.
pub(crate) struct ShardContents<'a> {
    pub name: ShardName,
    pub inputs: &'a FingerprintInputs,
    pub schema: &'a SchemaRef,
    pub batches: &'a [RecordBatch],
}

/// Writes the shard to a temporary file in `dir`, fsyncs it, renames it into place (replacing
/// any earlier file of that name) and fsyncs the directory. Until the rename nothing has the
/// shard's name, so a crash leaves at most a temporary file that lookups ignore. Returns the
/// file's size.
pub(crate) fn write(dir: &Path, contents: &ShardContents<'_>) -> Result<u64> {
    // The IPC writer does not check this, and a mismatch would make a file that fails to
    // decode (or decodes wrongly) on every open.
    if let Some(index) = contents
        .batches
        .iter()
        .position(|batch| batch.schema().fields() != contents.schema.fields())
    {
        return Err(CacheError::SchemaMismatch {
            batch: index,
            expected: contents.schema.to_string(),
            found: contents.batches[index].schema().to_string(),
        });
    }
    let path = dir.join(contents.name.file_name());
    let io = |action: &'static str, path: &Path| {
        let path = path.to_owned();
        move |source| CacheError::Io {
            action,
            path,
            source,
        }
    };
    let temp = tempfile::Builder::new()
        .prefix(TEMP_PREFIX)
        .suffix(".part")
        .tempfile_in(dir)
        .map_err(io("create a temporary shard in", dir))?;
    let temp_path = temp.path().to_owned();
    let arrow = |source| CacheError::Arrow {
        path: temp_path.clone(),
        source,
    };

    let options = IpcWriteOptions::try_new(64, false, MetadataVersion::V5).map_err(arrow)?;
    let sink = ChecksumWriter::new(BufWriter::new(temp.as_file()));
    let mut writer =
        FileWriter::try_new_with_options(sink, contents.schema, options).map_err(arrow)?;
    for batch in contents.batches {
        writer.write(batch).map_err(arrow)?;
    }
    let (checksum, data_bytes, chunk_checksums) = writer.get_mut().finish_checksum();
    let manifest = Manifest {
        fingerprint: contents.name.fingerprint,
        rank: contents.name.shard.rank,
        count: contents.name.shard.count,
        rows: contents.batches.iter().map(|b| b.num_rows() as u64).sum(),
        data_bytes,
        checksum,
        chunk_bytes: CHUNK_BYTES,
        chunk_checksums,
        schema: FieldSummary::of(contents.schema),
        inputs: contents.inputs.clone(),
    };
    writer.write_metadata(MANIFEST_KEY, manifest.to_json()?);
    writer.finish().map_err(arrow)?;
    let sink = writer.into_inner().map_err(arrow)?;
    sink.into_inner()
        .into_inner()
        .map_err(|error| error.into_error())
        .map_err(io("write", &temp_path))?;

    temp.as_file().sync_all().map_err(io("fsync", &temp_path))?;
    let size = temp
        .as_file()
        .metadata()
        .map_err(io("stat", &temp_path))?
        .len();
    temp.persist(&path)
        .map_err(|error| error.error)
        .map_err(io("rename a temporary shard to", &path))?;
    File::open(dir)
        .and_then(|directory| directory.sync_all())
        .map_err(io("fsync the cache directory", dir))?;
    Ok(size)
}

/// Hashes every byte it passes on until told to stop, whole and in [`CHUNK_BYTES`] pieces, so
/// the checksums of the data region are known before the footer (which carries them) is
/// written.
struct ChecksumWriter<W> {
    inner: W,
    hasher: Option<Xxh3Default>,
    hashed: u64,
    chunk: Xxh3Default,
    chunks: Vec<u64>,
}

impl<W: Write> ChecksumWriter<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            hasher: Some(Xxh3Default::new()),
            hashed: 0,
            chunk: Xxh3Default::new(),
            chunks: Vec::new(),
        }
    }

    /// Stops hashing; returns the checksum, the number of bytes it covers, and the checksum of
    /// each piece.
    fn finish_checksum(&mut self) -> (Checksum, u64, Vec<u64>) {
        let digest = self.hasher.take().map_or(0, |hasher| hasher.digest128());
        if !self.hashed.is_multiple_of(CHUNK_BYTES) {
            self.chunks.push(self.chunk.digest());
        }
        (
            Checksum(digest),
            self.hashed,
            std::mem::take(&mut self.chunks),
        )
    }

    fn into_inner(self) -> W {
        self.inner
    }
}

impl<W: Write> Write for ChecksumWriter<W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(bytes)?;
        if let Some(hasher) = &mut self.hasher {
            let mut rest = &bytes[..written];
            hasher.update(rest);
            while !rest.is_empty() {
                let room = CHUNK_BYTES - self.hashed % CHUNK_BYTES;
                let take = rest.len().min(usize::try_from(room).unwrap_or(usize::MAX));
                self.chunk.update(&rest[..take]);
                self.hashed += take as u64;
                rest = &rest[take..];
                if self.hashed.is_multiple_of(CHUNK_BYTES) {
                    self.chunks.push(self.chunk.digest());
                    self.chunk.reset();
                }
            }
        }
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// How much of a shard to check when it is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verification {
    /// Everything below, plus the checksum over all the data: reads the whole file the first
    /// time this `Cache` opens it. The file (device, inode, length) and its checksum are then
    /// remembered, so reopening it costs no pass over the data: floe never modifies a shard
    /// file in place, and a rewritten shard is a new file that is verified again.
    #[default]
    Checksum,
    /// Name, manifest, footer, schema and row counts; the data pages are not touched until
    /// they are read. For trusted local disks where opening must cost nothing per byte.
    Structure,
}

/// A shard opened as a hit: batches whose buffers point into the mapped file.
#[derive(Debug, Clone)]
pub struct CachedShard {
    pub name: ShardName,
    pub path: PathBuf,
    pub manifest: Manifest,
    pub block: Block,
}

/// A mapped shard file; the decoded buffers own it (and its pin) through an `Arc`.
struct MappedShard {
    _map: memmap2::Mmap,
    _pin: PinGuard,
}

/// Why a shard on disk is not a usable hit.
pub(crate) struct Invalid(pub String);

/// A file's identity on this host, with the checksum its manifest claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct VerifiedFile {
    device: u64,
    inode: u64,
    len: u64,
    checksum: u128,
}

/// The shard files whose checksums this process has verified.
#[derive(Debug, Default)]
pub(crate) struct VerifiedFiles(Mutex<BTreeSet<VerifiedFile>>);

impl VerifiedFiles {
    fn contains(&self, file: &VerifiedFile) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(file)
    }

    fn insert(&self, file: VerifiedFile) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(file);
    }
}

/// Maps and verifies the shard at `path`. `Ok(Err(_))` is a bad file (a miss), `Err(_)` a
/// failure to even look at it.
pub(crate) fn open(
    path: &Path,
    name: ShardName,
    verification: Verification,
    verified: &VerifiedFiles,
    pin: PinGuard,
    columns: Option<&[usize]>,
) -> std::result::Result<CachedShard, Invalid> {
    let file = File::open(path).map_err(|error| Invalid(format!("cannot open: {error}")))?;
    // The identity comes from the handle, so it is the file that gets mapped even if the
    // name is replaced meanwhile.
    let metadata = file
        .metadata()
        .map_err(|error| Invalid(format!("cannot stat: {error}")))?;
    let len = metadata.len();
    if len < TRAILER_LEN as u64 {
        return Err(Invalid(format!("only {len} bytes long")));
    }
    // SAFETY: shard files are immutable once renamed into place: writers only ever replace a
    // name with a new file, and eviction unlinks, which leaves existing mappings intact.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|error| Invalid(format!("cannot map: {error}")))?;
    let manifest = read_manifest(&map)?;
    if manifest.fingerprint != name.fingerprint
        || manifest.rank != name.shard.rank
        || manifest.count != name.shard.count
    {
        return Err(Invalid(format!(
            "its manifest describes {} shard {} of {}",
            manifest.fingerprint, manifest.rank, manifest.count
        )));
    }
    if manifest.inputs.fingerprint() != name.fingerprint {
        return Err(Invalid(
            "its recorded lineage does not hash to its fingerprint".into(),
        ));
    }
    let data_end = usize::try_from(manifest.data_bytes)
        .ok()
        .filter(|end| *end <= map.len())
        .ok_or_else(|| {
            Invalid(format!(
                "the manifest claims {} data bytes",
                manifest.data_bytes
            ))
        })?;
    let identity = VerifiedFile {
        device: metadata.dev(),
        inode: metadata.ino(),
        len,
        checksum: manifest.checksum.0,
    };
    let unchecked = verification == Verification::Checksum && !verified.contains(&identity);
    let chunks = Chunks::of(&manifest, data_end);
    // A projected open of a chunked shard checks only what it returns, once it is decoded;
    // every other open checks all the data first.
    let check_later = unchecked && columns.is_some() && chunks.is_some();
    if unchecked && !check_later {
        match &chunks {
            Some(chunks) => chunks.verify(&map[..data_end], 0..chunks.checksums.len())?,
            None => {
                let actual = Checksum(xxh3_128(&map[..data_end]));
                if actual != manifest.checksum {
                    return Err(Invalid(format!(
                        "checksum {actual} does not match the manifest's {}",
                        manifest.checksum
                    )));
                }
            }
        }
    }
    // The footer's record-batch headers, for a projected check (read before the map moves).
    let headers = if check_later {
        message_headers(&map)?
    } else {
        Vec::new()
    };

    let ptr = NonNull::new(map.as_ptr().cast_mut())
        .ok_or_else(|| Invalid("mapped at a null address".into()))?;
    let base = map.as_ptr() as usize;
    let map_len = map.len();
    let owner = Arc::new(MappedShard {
        _map: map,
        _pin: pin,
    });
    // SAFETY: `owner` keeps the mapping alive, and the file is immutable (see above), for as
    // long as any buffer sliced from this one lives.
    let buffer = unsafe { Buffer::from_custom_allocation(ptr, map_len, owner) };
    let block = block::decode(&buffer).map_err(|error| Invalid(format!("{error}")))?;
    if let Some(end) = block_end(&buffer)?
        && end > data_end
    {
        return Err(Invalid(
            "record batches lie outside the checksummed data".into(),
        ));
    }
    let rows = block.num_rows() as u64;
    if rows != manifest.rows {
        return Err(Invalid(format!(
            "it holds {rows} rows, its manifest says {}",
            manifest.rows
        )));
    }
    if FieldSummary::of(&block.schema) != manifest.schema {
        return Err(Invalid("its schema differs from its manifest's".into()));
    }
    let block = match columns {
        Some(columns) => project(block, columns)?,
        None => block,
    };
    match (&chunks, check_later) {
        (Some(chunks), true) => {
            // The schema message, every record batch's header, and the buffers returned.
            let mut needed = BTreeSet::new();
            needed.extend(chunks.covering(0, headers.first().map_or(data_end, |h| h.0)));
            for (start, len) in &headers {
                needed.extend(chunks.covering(*start, *len));
            }
            let mut outside = false;
            for batch in &block.batches {
                for column in batch.columns() {
                    for range in buffer_ranges(&column.to_data(), base, data_end) {
                        match range {
                            Some((start, len)) => needed.extend(chunks.covering(start, len)),
                            None => outside = true,
                        }
                    }
                }
            }
            // A buffer that is not in the data bytes cannot be matched to pieces: check all.
            if outside {
                needed.extend(0..chunks.checksums.len());
            }
            chunks.verify(data_bytes_of(&buffer, data_end), needed)?;
        }
        _ if verification == Verification::Checksum => verified.insert(identity),
        _ => {}
    }
    Ok(CachedShard {
        name,
        path: path.to_owned(),
        manifest,
        block,
    })
}

/// The data bytes of a mapped shard, borrowed from the buffer that owns the mapping.
fn data_bytes_of(buffer: &Buffer, data_end: usize) -> &[u8] {
    &buffer.as_slice()[..data_end]
}

/// `block` with only the columns at `columns`.
fn project(block: Block, columns: &[usize]) -> std::result::Result<Block, Invalid> {
    let width = block.schema.fields().len();
    if let Some(missing) = columns.iter().find(|index| **index >= width) {
        return Err(Invalid(format!(
            "it has no column {missing} (it has {width})"
        )));
    }
    let schema = Arc::new(
        block
            .schema
            .project(columns)
            .map_err(|error| Invalid(error.to_string()))?,
    );
    let batches = block
        .batches
        .iter()
        .map(|batch| batch.project(columns))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|error| Invalid(error.to_string()))?;
    Ok(Block { schema, batches })
}

/// Where the buffers of `data` (nulls, values, offsets, children) lie in the mapping that
/// starts at `base`, as `(offset, length)`, or `None` for a buffer outside the data bytes.
fn buffer_ranges(
    data: &arrow::array::ArrayData,
    base: usize,
    data_end: usize,
) -> Vec<Option<(usize, usize)>> {
    let mut ranges = Vec::new();
    let mut pending = vec![data.clone()];
    while let Some(data) = pending.pop() {
        let nulls = data.nulls().map(|nulls| nulls.inner().inner().clone());
        for buffer in data.buffers().iter().cloned().chain(nulls) {
            if buffer.is_empty() {
                continue;
            }
            let start = (buffer.as_ptr() as usize).wrapping_sub(base);
            let inside = start < data_end && buffer.len() <= data_end - start;
            ranges.push(inside.then_some((start, buffer.len())));
        }
        pending.extend(data.child_data().iter().cloned());
    }
    ranges
}

/// Each record batch's and dictionary's header message in the file, as `(offset, length)`,
/// in file order.
fn message_headers(bytes: &[u8]) -> std::result::Result<Vec<(usize, usize)>, Invalid> {
    let mut headers: Vec<(usize, usize)> = footer_blocks(bytes)?
        .into_iter()
        .map(|block| (block.start, block.header))
        .collect();
    headers.sort_unstable();
    Ok(headers)
}

/// A shard's per-piece checksums.
struct Chunks<'a> {
    bytes: usize,
    checksums: &'a [u64],
}

impl<'a> Chunks<'a> {
    /// The manifest's pieces, when it has them and they cover exactly `data_end` bytes.
    fn of(manifest: &'a Manifest, data_end: usize) -> Option<Self> {
        let bytes = usize::try_from(manifest.chunk_bytes)
            .ok()
            .filter(|b| *b > 0)?;
        (manifest.chunk_checksums.len() == data_end.div_ceil(bytes)).then_some(Self {
            bytes,
            checksums: &manifest.chunk_checksums,
        })
    }

    /// The pieces that hold any of `len` bytes from `start`.
    fn covering(&self, start: usize, len: usize) -> std::ops::Range<usize> {
        if len == 0 {
            return 0..0;
        }
        let last = (start + len - 1) / self.bytes;
        (start / self.bytes)..(last + 1).min(self.checksums.len())
    }

    /// Checks the pieces at `indices` of `data`, spread over the CPUs (on this thread when
    /// there are few, or when no thread can be started).
    fn verify(
        &self,
        data: &[u8],
        indices: impl IntoIterator<Item = usize>,
    ) -> std::result::Result<(), Invalid> {
        let indices: Vec<usize> = indices.into_iter().collect();
        let check = |part: &[usize]| {
            part.iter()
                .find(|index| {
                    let start = **index * self.bytes;
                    let end = (start + self.bytes).min(data.len());
                    xxh3_64(&data[start..end]) != self.checksums[**index]
                })
                .copied()
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let bad = if threads == 1 || indices.len() < 8 {
            check(&indices)
        } else {
            let per_thread = indices.len().div_ceil(threads);
            std::thread::scope(|scope| {
                let mut inline = Vec::new();
                let mut workers = Vec::new();
                for part in indices.chunks(per_thread) {
                    match std::thread::Builder::new().spawn_scoped(scope, move || check(part)) {
                        Ok(worker) => workers.push(worker),
                        Err(_) => inline.push(check(part)),
                    }
                }
                let mut found: Vec<Option<usize>> = workers
                    .into_iter()
                    .map(|worker| {
                        worker
                            .join()
                            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
                    })
                    .collect();
                found.extend(inline);
                found.into_iter().flatten().next()
            })
        };
        match bad {
            Some(index) => Err(Invalid(format!(
                "piece {index} of its data does not match the manifest's checksum"
            ))),
            None => Ok(()),
        }
    }
}

/// The footer of the IPC file in `bytes`, and where it starts.
fn footer(bytes: &[u8]) -> std::result::Result<(arrow::ipc::Footer<'_>, usize), Invalid> {
    let bad = |what: String| Invalid(format!("not an Arrow IPC file: {what}"));
    let trailer_start = bytes
        .len()
        .checked_sub(TRAILER_LEN)
        .ok_or_else(|| bad("shorter than the trailer".into()))?;
    let mut trailer = [0u8; TRAILER_LEN];
    trailer.copy_from_slice(&bytes[trailer_start..]);
    let footer_len = read_footer_length(trailer).map_err(|error| bad(error.to_string()))?;
    let footer_start = trailer_start
        .checked_sub(footer_len)
        .ok_or_else(|| bad("footer longer than the file".into()))?;
    let footer = root_as_footer(&bytes[footer_start..trailer_start])
        .map_err(|error| bad(format!("unreadable footer: {error}")))?;
    Ok((footer, footer_start))
}

/// One message the footer points at: where it starts, its header's and its body's lengths.
struct FooterBlock {
    start: usize,
    header: usize,
    body: usize,
}

/// Every record batch and dictionary message the footer points at.
fn footer_blocks(bytes: &[u8]) -> std::result::Result<Vec<FooterBlock>, Invalid> {
    let (footer, _) = footer(bytes)?;
    footer
        .recordBatches()
        .iter()
        .flatten()
        .chain(footer.dictionaries().iter().flatten())
        .map(|block| {
            Some(FooterBlock {
                start: usize::try_from(block.offset()).ok()?,
                header: usize::try_from(block.metaDataLength()).ok()?,
                body: usize::try_from(block.bodyLength()).ok()?,
            })
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| Invalid("a footer block has a negative offset or length".into()))
}

/// The end of the last message the footer points at, if it points at any.
fn block_end(bytes: &[u8]) -> std::result::Result<Option<usize>, Invalid> {
    Ok(footer_blocks(bytes)?
        .iter()
        .filter_map(|block| {
            block
                .start
                .checked_add(block.header)?
                .checked_add(block.body)
        })
        .max())
}

/// Reads the manifest from a shard's footer without touching its data pages.
pub(crate) fn read_manifest(bytes: &[u8]) -> std::result::Result<Manifest, Invalid> {
    let (footer, _) = footer(bytes)?;
    let json = footer
        .custom_metadata()
        .into_iter()
        .flatten()
        .find(|entry| entry.key() == Some(MANIFEST_KEY))
        .and_then(|entry| entry.value())
        .ok_or_else(|| Invalid("no manifest in the footer".into()))?;
    Manifest::from_json(json).map_err(|error| Invalid(format!("unreadable manifest: {error}")))
}

/// Reads just the manifest of the shard at `path` (maps the file; reads the footer only).
pub(crate) fn read_manifest_at(path: &Path) -> std::result::Result<Manifest, Invalid> {
    let file = File::open(path).map_err(|error| Invalid(format!("cannot open: {error}")))?;
    // SAFETY: as in `open`: shard files are never modified in place.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|error| Invalid(format!("cannot map: {error}")))?;
    read_manifest(&map)
}
