//! One shard file: its name, its atomic write, and its verified zero-copy open.
//!
//! A shard is a 64-byte [`ShardPrefix`] followed by an Arrow IPC file, its *payload*. The
//! payload is laid out exactly as a block object's bytes (`crate::block`): written with 64-byte
//! alignment from a 64-byte boundary of the file, so every buffer lies 64-byte aligned in a
//! mapping of the file, and the store can serve the file in place as an object whose bytes are
//! the payload (`ObjectStore::adopt_shard`). The prefix holds the payload's length and its
//! xxh3-64, the checksum a transfer of that object reports. The manifest is JSON in the IPC
//! footer's custom metadata; its checksum covers every payload byte before the end-of-stream
//! marker (header, schema, dictionaries and record batches), whole and in 1 MiB pieces. The
//! footer is written last, so the checksums are computed while the data streams out, and the
//! prefix after it; there is exactly one file per shard, so a reader can never pair one
//! writer's data with another writer's manifest.
//!
//! Verifying a shard reads all of it. A [`Verdict`] remembers, per shard name, the state of the
//! file that passed (device, inode, length, modification time) with its checksums, so a later
//! use of the unchanged file reads only its prefix and footer. The writer records the verdict
//! of the file it has just written, having hashed the very bytes it wrote.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, Metadata};
use std::io::{BufWriter, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
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
use floe_core::hash::{Xxh3_64, Xxh3_128, xxh3_64, xxh3_128};

use super::manifest::{Checksum, FieldSummary, MANIFEST_KEY, Manifest};
use super::{CacheError, PinGuard, Result};
use crate::block::{self, Block};
use crate::mapping::{HEADER_LEN, ShardPrefix};

/// Length of the IPC file trailer: footer length (4 bytes) and `ARROW1`.
const TRAILER_LEN: usize = 10;
/// Where the payload starts in a shard file.
const PAYLOAD_START: usize = HEADER_LEN as usize;
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

/// A shard [`write`] put in place.
pub(crate) struct Written {
    /// The file's size.
    pub bytes: u64,
    /// The file as written, which needs no reading to be trusted while it stays so.
    pub verdict: Verdict,
}

/// Writes the shard to a temporary file in `dir`, fsyncs it, renames it into place (replacing
/// any earlier file of that name) and fsyncs the directory. Until the rename nothing has the
/// shard's name, so a crash leaves at most a temporary file that lookups ignore.
pub(crate) fn write(dir: &Path, contents: &ShardContents<'_>) -> Result<Written> {
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

    // The alignment of a block object's payload, from a file offset that is a multiple of it.
    let options = IpcWriteOptions::try_new(64, false, MetadataVersion::V5).map_err(arrow)?;
    let mut file = BufWriter::new(temp.as_file());
    // The prefix's room; it is written last, once the payload's checksum is known.
    file.write_all(&[0u8; PAYLOAD_START])
        .map_err(io("write", &temp_path))?;
    let sink = ChecksumWriter::new(file);
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
    let (len, payload_checksum) = sink.payload();
    sink.into_inner()
        .into_inner()
        .map_err(|error| error.into_error())
        .map_err(io("write", &temp_path))?;
    let prefix = ShardPrefix {
        len,
        checksum: payload_checksum,
    };
    temp.as_file()
        .write_all_at(&prefix.encode(), 0)
        .map_err(io("write", &temp_path))?;

    temp.as_file().sync_all().map_err(io("fsync", &temp_path))?;
    let file = temp
        .persist(&path)
        .map_err(|error| error.error)
        .map_err(io("rename a temporary shard to", &path))?;
    // Taken after the last write: the state the verdict holds for.
    let metadata = file.metadata().map_err(io("stat", &path))?;
    File::open(dir)
        .and_then(|directory| directory.sync_all())
        .map_err(io("fsync the cache directory", dir))?;
    Ok(Written {
        bytes: metadata.len(),
        verdict: Verdict {
            file: FileState::of(&metadata),
            checksum,
            payload_checksum,
        },
    })
}

/// Hashes every byte it passes on until told to stop, whole and in [`CHUNK_BYTES`] pieces, so
/// the checksums of the data region are known before the footer (which carries them) is
/// written; and every byte to the end with xxh3-64, the payload's checksum.
struct ChecksumWriter<W> {
    inner: W,
    hasher: Option<Xxh3_128>,
    hashed: u64,
    chunk: Xxh3_64,
    chunks: Vec<u64>,
    payload: Xxh3_64,
    payload_len: u64,
}

impl<W: Write> ChecksumWriter<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            hasher: Some(Xxh3_128::new()),
            hashed: 0,
            chunk: Xxh3_64::new(),
            chunks: Vec::new(),
            payload: Xxh3_64::new(),
            payload_len: 0,
        }
    }

    /// The length and xxh3-64 of everything written so far.
    fn payload(&self) -> (u64, u64) {
        (self.payload_len, self.payload.digest())
    }

    /// Stops hashing; returns the checksum, the number of bytes it covers, and the checksum of
    /// each piece.
    fn finish_checksum(&mut self) -> (Checksum, u64, Vec<u64>) {
        let digest = self.hasher.take().map_or(0, |hasher| hasher.digest());
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
        self.payload.update(&bytes[..written]);
        self.payload_len += written as u64;
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
    /// Everything below, plus the checksums over all the payload: reads the whole file the
    /// first time this `Cache` uses it in its current state. That state (device, inode, length,
    /// modification time) and the checksums are then remembered, so using the unchanged file
    /// again costs no pass over the data: floe never modifies a shard file in place, and a
    /// rewritten shard is a new file that is verified again.
    #[default]
    Checksum,
    /// Prefix, name, manifest, footer, schema and row counts; the data pages are not hashed.
    /// For trusted local disks where opening must cost nothing per byte.
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

/// A shard checked for serving in place: the store maps its file, and the object's bytes are
/// the payload after the prefix (`ObjectStore::adopt_shard`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedShard {
    pub name: ShardName,
    pub path: PathBuf,
    /// The file that was checked, so whoever maps it by name can tell it is still that file.
    pub device: u64,
    pub inode: u64,
    /// The payload's length: the object's size.
    pub len: u64,
    /// The payload's xxh3-64.
    pub checksum: u64,
    pub rows: u64,
}

/// A mapped shard file; the decoded buffers own it (and its pin) through an `Arc`.
struct MappedShard {
    _map: memmap2::Mmap,
    _pin: Option<PinGuard>,
}

/// Why a shard on disk is not a usable hit.
pub(crate) struct Invalid(pub String);

/// A file's state on this host, as `fstat` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileState {
    device: u64,
    inode: u64,
    len: u64,
    /// Seconds and nanoseconds. Any write in place changes it; so does the cache's own LRU
    /// clock, which [`VerifiedFiles::touched`] follows.
    modified: (i64, i64),
}

impl FileState {
    pub(crate) fn of(metadata: &Metadata) -> Self {
        Self {
            device: metadata.dev(),
            inode: metadata.ino(),
            len: metadata.len(),
            modified: (metadata.mtime(), metadata.mtime_nsec()),
        }
    }
}

/// That a shard file passed verification: in which state, with which checksums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Verdict {
    file: FileState,
    /// The manifest's checksum of the data bytes.
    checksum: Checksum,
    /// The prefix's checksum of the payload.
    payload_checksum: u64,
}

/// The verdicts on the shard files this `Cache` verified (or wrote), one per shard name: a
/// name's new file replaces its old verdict, and a shard removed through the cache takes its
/// verdict with it, so they never outnumber the names in the directory by much.
#[derive(Debug, Default)]
pub(crate) struct VerifiedFiles(Mutex<BTreeMap<ShardName, Verdict>>);

impl VerifiedFiles {
    fn verdicts(&self) -> std::sync::MutexGuard<'_, BTreeMap<ShardName, Verdict>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn holds(&self, name: &ShardName, verdict: &Verdict) -> bool {
        self.verdicts().get(name) == Some(verdict)
    }

    pub(crate) fn record(&self, name: ShardName, verdict: Verdict) {
        self.verdicts().insert(name, verdict);
    }

    pub(crate) fn forget(&self, name: &ShardName) {
        self.verdicts().remove(name);
    }

    /// The cache moved the file's modification time (its LRU clock) from `before` to
    /// `after`: a verdict on the file in state `before` holds for `after`. (Had the file
    /// changed in between, `before` is not the state the verdict names, and it is left to
    /// fail.)
    pub(crate) fn touched(&self, name: &ShardName, before: FileState, after: FileState) {
        if let Some(verdict) = self.verdicts().get_mut(name)
            && verdict.file == before
        {
            verdict.file = after;
        }
    }
}

/// A shard file mapped, its prefix and manifest read and checked against its name.
struct Mapped {
    state: FileState,
    map: memmap2::Mmap,
    prefix: ShardPrefix,
    manifest: Manifest,
    /// Where the checksummed data bytes end, in the payload.
    data_end: usize,
}

impl Mapped {
    fn payload(&self) -> &[u8] {
        &self.map[PAYLOAD_START..]
    }

    fn verdict(&self) -> Verdict {
        Verdict {
            file: self.state,
            checksum: self.manifest.checksum,
            payload_checksum: self.prefix.checksum,
        }
    }
}

/// Maps the shard at `path` and checks what its prefix and manifest say against its length
/// and `name`, reading no more than the first and last pages.
fn map_checked(path: &Path, name: ShardName) -> std::result::Result<Mapped, Invalid> {
    let file = File::open(path).map_err(|error| Invalid(format!("cannot open: {error}")))?;
    // The state comes from the handle, so it is the file that gets mapped even if the name
    // is replaced meanwhile.
    let metadata = file
        .metadata()
        .map_err(|error| Invalid(format!("cannot stat: {error}")))?;
    let len = metadata.len();
    if len < (PAYLOAD_START + TRAILER_LEN) as u64 {
        return Err(Invalid(format!("only {len} bytes long")));
    }
    // SAFETY: shard files are immutable once renamed into place: writers only ever replace a
    // name with a new file, and eviction unlinks, which leaves existing mappings intact.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|error| Invalid(format!("cannot map: {error}")))?;
    let prefix = ShardPrefix::decode(&map).ok_or_else(|| {
        Invalid(if map.starts_with(b"ARROW1") {
            "it has no shard prefix: an older floe wrote it, so it is computed again".into()
        } else {
            "it has no shard prefix".into()
        })
    })?;
    if prefix.len != len - PAYLOAD_START as u64 {
        return Err(Invalid(format!(
            "its prefix claims {} payload bytes, the file holds {}",
            prefix.len,
            len - PAYLOAD_START as u64
        )));
    }
    let payload = &map[PAYLOAD_START..];
    let manifest = read_manifest(payload)?;
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
        .filter(|end| *end <= payload.len())
        .ok_or_else(|| {
            Invalid(format!(
                "the manifest claims {} data bytes",
                manifest.data_bytes
            ))
        })?;
    Ok(Mapped {
        state: FileState::of(&metadata),
        map,
        prefix,
        manifest,
        data_end,
    })
}

/// Checks every byte: the data bytes against the manifest's checksums, and the whole payload
/// against the prefix's.
fn check_checksums(mapped: &Mapped) -> std::result::Result<(), Invalid> {
    let payload = mapped.payload();
    let data = &payload[..mapped.data_end];
    match Chunks::of(&mapped.manifest, mapped.data_end) {
        Some(chunks) => chunks.verify(data, 0..chunks.checksums.len())?,
        None => {
            let actual = Checksum(xxh3_128(data));
            if actual != mapped.manifest.checksum {
                return Err(Invalid(format!(
                    "checksum {actual} does not match the manifest's {}",
                    mapped.manifest.checksum
                )));
            }
        }
    }
    let actual = xxh3_64(payload);
    if actual != mapped.prefix.checksum {
        return Err(Invalid(format!(
            "its payload's checksum {actual:016x} does not match its prefix's {:016x}",
            mapped.prefix.checksum
        )));
    }
    Ok(())
}

/// Decodes the payload in `buffer` without copying, and checks that its batches lie in the
/// checksummed data and hold the manifest's rows and schema.
fn decode_checked(
    buffer: &Buffer,
    manifest: &Manifest,
    data_end: usize,
) -> std::result::Result<Block, Invalid> {
    let block = block::decode(buffer).map_err(|error| Invalid(format!("{error}")))?;
    if let Some(end) = block_end(buffer)?
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
    Ok(block)
}

/// Checks the shard at `path` for serving in place: everything a whole [`open`] checks, the
/// first time this `Cache` sees the file in its current state (not after it wrote it: it
/// hashed what it wrote), then only its prefix and footer.
pub(crate) fn serve(
    path: &Path,
    name: ShardName,
    verification: Verification,
    verified: &VerifiedFiles,
) -> std::result::Result<ServedShard, Invalid> {
    let mapped = map_checked(path, name)?;
    let verdict = mapped.verdict();
    let known = verified.holds(&name, &verdict);
    if !known && verification == Verification::Checksum {
        check_checksums(&mapped)?;
    }
    let Mapped {
        state,
        map,
        prefix,
        manifest,
        data_end,
    } = mapped;
    if !known {
        let buffer = payload_buffer(map, None)?;
        decode_checked(&buffer, &manifest, data_end)?;
        verified.record(name, verdict);
    }
    Ok(ServedShard {
        name,
        path: path.to_owned(),
        device: state.device,
        inode: state.inode,
        len: prefix.len,
        checksum: prefix.checksum,
        rows: manifest.rows,
    })
}

/// The payload of `map` as an Arrow buffer that owns the mapping (and `pin`, if any).
fn payload_buffer(
    map: memmap2::Mmap,
    pin: Option<PinGuard>,
) -> std::result::Result<Buffer, Invalid> {
    let ptr = NonNull::new(map.as_ptr().cast_mut())
        .ok_or_else(|| Invalid("mapped at a null address".into()))?;
    let len = map.len();
    let owner = Arc::new(MappedShard {
        _map: map,
        _pin: pin,
    });
    // SAFETY: `owner` keeps the mapping alive, and the file is immutable (see `map_checked`),
    // for as long as any buffer sliced from this one lives.
    let whole = unsafe { Buffer::from_custom_allocation(ptr, len, owner) };
    Ok(whole.slice(PAYLOAD_START))
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
    let mapped = map_checked(path, name)?;
    let verdict = mapped.verdict();
    let unchecked = verification == Verification::Checksum && !verified.holds(&name, &verdict);
    let data_end = mapped.data_end;
    let chunks_known = Chunks::of(&mapped.manifest, data_end).is_some();
    // A projected open of a chunked shard checks only what it returns, once it is decoded;
    // every other open checks all the data first.
    let check_later = unchecked && columns.is_some() && chunks_known;
    if unchecked && !check_later {
        check_checksums(&mapped)?;
    }
    // The footer's record-batch headers, for a projected check (read before the map moves).
    let headers = if check_later {
        message_headers(mapped.payload())?
    } else {
        Vec::new()
    };
    let Mapped { map, manifest, .. } = mapped;
    let buffer = payload_buffer(map, Some(pin))?;
    let base = buffer.as_ptr() as usize;
    let block = decode_checked(&buffer, &manifest, data_end)?;
    let block = match columns {
        Some(columns) => project(block, columns)?,
        None => block,
    };
    match (Chunks::of(&manifest, data_end), check_later) {
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
        _ if verification == Verification::Checksum => verified.record(name, verdict),
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
