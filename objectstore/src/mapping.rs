//! The operating-system [`Region`]s objects live in — the store's shared-memory segment and
//! fallback objects' mapped files — and the header every object carries in its region.
//!
//! Each object starts with a 64-byte header naming it, so a process that maps an object from a
//! location it was given can check it found the object it asked for (and that the object is
//! sealed) instead of trusting a possibly stale offset. The payload follows the header, so it
//! starts 64-byte aligned.
//!
//! A cache shard file starts with a [`ShardPrefix`] of the same length instead, so the Arrow IPC
//! file after it is laid out in the shard file exactly as an object's payload is in a region:
//! the store serves a shard in place, as an object whose bytes are the file's.

use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use floe_core::ObjectId;
use shared_memory::{Shmem, ShmemConf};

use crate::region::Region;
use crate::view::ObjectSource;
use crate::{Error, Result};

/// Where shared memory lives on Linux; checked for room when a store opens.
const SHM_DIR: &str = "/dev/shm";

/// Bytes before each object's payload.
pub const HEADER_LEN: u64 = 64;
const MAGIC: [u8; 8] = *b"FLOEOBJ1";
const SHARD_MAGIC: [u8; 8] = *b"FLOESHD1";
const SEALED: u64 = 1;

/// What an object header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub object: ObjectId,
    pub len: u64,
    pub sealed: bool,
    /// xxh3-64 of the payload; only spill files fill it in (memory is not checksummed, since
    /// hashing every put would halve its speed).
    pub checksum: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN as usize] {
        let mut bytes = [0u8; HEADER_LEN as usize];
        bytes[0..8].copy_from_slice(&MAGIC);
        bytes[8..24].copy_from_slice(&self.object.get().to_le_bytes());
        bytes[24..32].copy_from_slice(&self.len.to_le_bytes());
        bytes[32..40].copy_from_slice(&u64::from(self.sealed).to_le_bytes());
        bytes[40..48].copy_from_slice(&self.checksum.to_le_bytes());
        bytes
    }

    /// `None` when the bytes are not a header at all.
    pub fn decode(bytes: &[u8; HEADER_LEN as usize]) -> Option<Self> {
        if bytes[0..8] != MAGIC {
            return None;
        }
        let word = |range: std::ops::Range<usize>| {
            let mut buf = [0u8; 8];
            buf.copy_from_slice(&bytes[range]);
            u64::from_le_bytes(buf)
        };
        let mut id = [0u8; 16];
        id.copy_from_slice(&bytes[8..24]);
        Some(Self {
            object: ObjectId::new(u128::from_le_bytes(id)),
            len: word(24..32),
            sealed: word(32..40) == SEALED,
            checksum: word(40..48),
        })
    }
}

/// The 64 bytes before a cache shard's payload (an Arrow IPC file). A shard is complete when
/// its name exists (it is renamed into place), so it needs no sealed flag; it names no object,
/// since the store may serve one shard as several objects, each under a name of its own
/// (`ObjectStore::adopt_shard`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardPrefix {
    /// Payload bytes after the prefix: the file's length less [`HEADER_LEN`].
    pub len: u64,
    /// xxh3-64 of the payload, which a transfer of the object reports without hashing it.
    pub checksum: u64,
}

impl ShardPrefix {
    pub fn encode(&self) -> [u8; HEADER_LEN as usize] {
        let mut bytes = [0u8; HEADER_LEN as usize];
        bytes[0..8].copy_from_slice(&SHARD_MAGIC);
        bytes[8..16].copy_from_slice(&self.len.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.checksum.to_le_bytes());
        bytes
    }

    /// `None` when the bytes are not a shard prefix (a shard written before prefixes existed
    /// starts with Arrow's magic instead).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let bytes: &[u8; HEADER_LEN as usize] =
            bytes.get(..HEADER_LEN as usize)?.try_into().ok()?;
        if bytes[0..8] != SHARD_MAGIC || bytes[24..].iter().any(|byte| *byte != 0) {
            return None;
        }
        let word = |range: std::ops::Range<usize>| {
            let mut buf = [0u8; 8];
            buf.copy_from_slice(&bytes[range]);
            u64::from_le_bytes(buf)
        };
        Some(Self {
            len: word(8..16),
            checksum: word(16..24),
        })
    }
}

/// A shared-memory segment: the production store's memory (created by the store, unlinked
/// when it is dropped) or a reader's mapping of it.
pub struct SharedSegment {
    ptr: NonNull<u8>,
    len: usize,
    shmem: Shmem,
    /// What this mapping has populated for writing already (see [`PopulatedGranules`]).
    populated: PopulatedGranules,
}

// SAFETY: the mapping stays valid at the same address until drop, and the segment hands out
// only raw pointers; who may write where is decided by the store (a range is written only by
// the one `ObjectWriter` that allocated it, and read only after it is sealed).
unsafe impl Send for SharedSegment {}
// SAFETY: as above; no method takes `&self` and mutates.
unsafe impl Sync for SharedSegment {}
// A panic cannot leave a segment half-updated: it has no interior mutability.
impl std::panic::RefUnwindSafe for SharedSegment {}

impl std::fmt::Debug for SharedSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedSegment")
            .field("os_id", &self.shmem.get_os_id())
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: `ptr` is the start of the `len`-byte mapping `shmem` owns, zero-filled by the OS when
// created, and mapped at that address until `shmem` is dropped with `self`.
unsafe impl Region for SharedSegment {
    fn base(&self) -> NonNull<u8> {
        self.ptr
    }

    fn len(&self) -> usize {
        self.len
    }

    fn source(&self) -> ObjectSource {
        ObjectSource::Segment {
            os_id: self.shmem.get_os_id().to_owned(),
        }
    }

    /// A kernel older than 5.14, which lacks `MADV_POPULATE_WRITE`, leaves the pages to fault
    /// (and a full /dev/shm to a `SIGBUS`). Whole granules this mapping populated before are
    /// skipped: their pages are still mapped here (see [`PopulatedGranules`]).
    fn populate_for_write(&self, offset: u64, len: u64) -> Result<()> {
        let end = offset
            .checked_add(len)
            .filter(|end| *end <= self.len as u64);
        let Some(end) = end else {
            return Err(self.populate_failed(format!(
                "bytes {offset}..+{len} lie outside the {}-byte segment",
                self.len
            )));
        };
        for run in self.populated.unpopulated(offset..end) {
            self.populate_pages(run, len)?;
        }
        self.populated.mark(offset..end);
        Ok(())
    }

    fn resident_bytes(&self) -> Option<u64> {
        // tmpfs allocates a file's blocks as its pages are first written, and counts them.
        let path = Self::path_of(self.shmem.get_os_id());
        let metadata = std::fs::metadata(path).ok()?;
        Some(std::os::unix::fs::MetadataExt::blocks(&metadata) * 512)
    }
}

impl SharedSegment {
    /// Creates the segment of store `name`, `/floe-<name>`, of `len` bytes, after checking
    /// that /dev/shm has room for it and unlinking a segment of that name left by a dead store
    /// (store names are unique among live stores on a host). It is unlinked when dropped.
    pub fn create_for_store(name: &str, len: usize) -> Result<Self> {
        if let Some(available) = available_space(Path::new(SHM_DIR))
            && available < len as u64
        {
            return Err(Error::SharedMemoryTooSmall {
                capacity: len as u64,
                available,
            });
        }
        let os_id = Self::os_id_of_store(name);
        if Self::unlink(&os_id)? {
            tracing::warn!(
                segment = os_id,
                "removed a shared-memory segment left by a dead store"
            );
        }
        let shmem = ShmemConf::new()
            .os_id(&os_id)
            .size(len)
            .create()
            .map_err(|error| Error::SharedMemory {
                name: os_id.clone(),
                action: "create",
                reason: error.to_string(),
            })?;
        Self::new(shmem, &os_id)
    }

    /// Unlinks the segment a dead store `name` left, if there is one, and returns where it was.
    /// Store names are unique among live stores on a host, so the caller must know the store
    /// is dead.
    pub fn remove_dead_store(name: &str) -> Result<Option<PathBuf>> {
        let os_id = Self::os_id_of_store(name);
        Ok(Self::unlink(&os_id)?.then(|| Self::path_of(&os_id)))
    }

    /// The segment name of store `name`.
    fn os_id_of_store(name: &str) -> String {
        format!("/floe-{name}")
    }

    /// Maps an existing segment created by a store, possibly in another process. Readers only
    /// read through it (the shared_memory crate always maps read-write).
    pub fn open(os_id: &str) -> Result<Self> {
        let shmem = ShmemConf::new()
            .os_id(os_id)
            .open()
            .map_err(|error| Error::SharedMemory {
                name: os_id.to_owned(),
                action: "open",
                reason: error.to_string(),
            })?;
        Self::new(shmem, os_id)
    }

    fn new(shmem: Shmem, os_id: &str) -> Result<Self> {
        Ok(Self {
            ptr: non_null(shmem.as_ptr(), os_id)?,
            len: shmem.len(),
            populated: PopulatedGranules::new(shmem.len() as u64),
            shmem,
        })
    }

    fn populate_failed(&self, reason: String) -> Error {
        Error::SharedMemory {
            name: self.shmem.get_os_id().to_owned(),
            action: "populate",
            reason,
        }
    }

    /// Populates the pages of `range` (inside the mapping) for writing, in one call; `write_len`
    /// is the whole write's length, which an error names.
    fn populate_pages(&self, range: Range<u64>, write_len: u64) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        // SAFETY: `sysconf` only reads the process's constants.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let start = self.ptr.as_ptr() as usize + range.start as usize;
        let first = start & !(page - 1);
        // SAFETY: the range lies in the mapping (the caller checked). Populating faults pages
        // in and changes no byte, neither the range's nor those of the header and neighbours
        // that share its end pages.
        let status = unsafe {
            libc::madvise(
                first as *mut libc::c_void,
                start + (range.end - range.start) as usize - first,
                libc::MADV_POPULATE_WRITE,
            )
        };
        let error = std::io::Error::last_os_error();
        match error.raw_os_error() {
            _ if status == 0 => Ok(()),
            Some(libc::EINVAL) => Ok(()),
            // What a write would have died of, with `SIGBUS`.
            Some(libc::EFAULT) => {
                Err(self
                    .populate_failed(format!("/dev/shm has no room for a {write_len}-byte write")))
            }
            _ => Err(self.populate_failed(error.to_string())),
        }
    }

    /// Where Linux shows segment `os_id` (`/floe-x` is `/dev/shm/floe-x`).
    pub fn path_of(os_id: &str) -> PathBuf {
        Path::new(SHM_DIR).join(os_id.trim_start_matches('/'))
    }

    /// Unlinks segment `os_id` if it exists; returns whether it did.
    fn unlink(os_id: &str) -> Result<bool> {
        let name = std::ffi::CString::new(os_id).map_err(|_| Error::SharedMemory {
            name: os_id.to_owned(),
            action: "unlink",
            reason: "the name contains a NUL byte".into(),
        })?;
        // SAFETY: plain syscall with a valid C string.
        if unsafe { libc::shm_unlink(name.as_ptr()) } == 0 {
            return Ok(true);
        }
        let error = std::io::Error::last_os_error();
        if error.kind() == std::io::ErrorKind::NotFound {
            Ok(false)
        } else {
            Err(Error::SharedMemory {
                name: os_id.to_owned(),
                action: "unlink",
                reason: error.to_string(),
            })
        }
    }
}

/// The granules of a segment one mapping has populated for writing whole.
///
/// `MADV_POPULATE_WRITE` walks every page of its range even when all are mapped already,
/// which took 5% of a random shuffle's CPU once every worker had written all over its
/// store's segment. A granule populated once stays populated in this mapping, so it is
/// populated once.
///
/// **Invariant:** nothing releases a segment's pages while it exists (no hole is punched,
/// nothing is `MADV_REMOVE`d): its file keeps every page ever written, and each mapping
/// keeps the page-table entries it populated. A page swapped out and back in is faulted in
/// again on its next write, which needs no room in /dev/shm (its block was never freed), so
/// it cannot raise the `SIGBUS` populating guards against.
#[derive(Debug)]
struct PopulatedGranules {
    /// One bit per granule of the segment. Read and set `Relaxed`: a bit only saves a call,
    /// and the page tables it speaks of are the process's, whichever thread populated them.
    bits: Box<[AtomicU64]>,
}

impl PopulatedGranules {
    /// 64 KiB: a range's partial granules at its ends are populated every time, sixteen pages
    /// at most each; a small object's pages are populated as before.
    const GRANULE: u64 = 64 << 10;

    fn new(len: u64) -> Self {
        let granules = len.div_ceil(Self::GRANULE);
        Self {
            bits: (0..granules.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    fn is_marked(&self, granule: u64) -> bool {
        self.bits
            .get((granule / 64) as usize)
            .is_some_and(|word| word.load(Ordering::Relaxed) & (1 << (granule % 64)) != 0)
    }

    /// The parts of `range` still to populate, in order, adjacent parts merged: all of it but
    /// the whole granules marked populated.
    fn unpopulated(&self, range: Range<u64>) -> Vec<Range<u64>> {
        let mut runs: Vec<Range<u64>> = Vec::new();
        let mut at = range.start;
        while at < range.end {
            let granule = at / Self::GRANULE;
            let granule_end = ((granule + 1) * Self::GRANULE).min(range.end);
            let whole = at == granule * Self::GRANULE && granule_end - at == Self::GRANULE;
            if !(whole && self.is_marked(granule)) {
                match runs.last_mut() {
                    Some(run) if run.end == at => run.end = granule_end,
                    _ => runs.push(at..granule_end),
                }
            }
            at = granule_end;
        }
        runs
    }

    /// Records that every page of `range` is populated: marks the whole granules it covers.
    fn mark(&self, range: Range<u64>) {
        let first = range.start.div_ceil(Self::GRANULE);
        let end = range.end / Self::GRANULE;
        for granule in first..end {
            if let Some(word) = self.bits.get((granule / 64) as usize) {
                word.fetch_or(1 << (granule % 64), Ordering::Relaxed);
            }
        }
    }
}

/// A mapped file holding one disk-backed fallback object.
pub struct FileMapping {
    ptr: NonNull<u8>,
    len: usize,
    path: PathBuf,
    map: FileMap,
}

enum FileMap {
    /// Created by the store: writable, and the file is removed when the mapping goes.
    Owned { _map: memmap2::MmapMut },
    /// A cache shard under a name the store gave it for one object (a hard link): read-only,
    /// and that name is removed when the mapping goes. The shard's own name is the cache's.
    Linked { _map: memmap2::Mmap },
    /// Opened by a reader.
    Reader { _map: memmap2::Mmap },
    /// Opened by the process the store handed the unsealed object to, to write it.
    Writer { _map: memmap2::MmapMut },
}

// SAFETY: as for `SharedSegment`: the mapping stays put until drop and only raw pointers are
// handed out, with writes confined to the object's one writer before it is sealed.
unsafe impl Send for FileMapping {}
// SAFETY: as above; no method takes `&self` and mutates.
unsafe impl Sync for FileMapping {}
// A panic cannot leave a mapping half-updated: it has no interior mutability.
impl std::panic::RefUnwindSafe for FileMapping {}

impl std::fmt::Debug for FileMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileMapping")
            .field("path", &self.path)
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: `ptr` is the start of the `len`-byte mapping `map` owns, of a file that is created
// with its blocks reserved (read back as zeroes) and never truncated while it is mapped, or of
// a cache shard, which is never modified in place at all.
unsafe impl Region for FileMapping {
    fn base(&self) -> NonNull<u8> {
        self.ptr
    }

    fn len(&self) -> usize {
        self.len
    }

    fn source(&self) -> ObjectSource {
        ObjectSource::File {
            path: self.path.clone(),
        }
    }
}

impl FileMapping {
    /// Creates file `path` of `len` bytes with its blocks reserved up front, and maps it. The
    /// reservation turns a full disk into an error here; a sparse file would instead fault
    /// (SIGBUS) on the first write that finds no free block.
    pub fn create(path: &Path, len: u64) -> Result<Self> {
        let file = create_new_file(path, "create a fallback file")?;
        let removing = |error: Error| {
            let _ = std::fs::remove_file(path);
            error
        };
        reserve(&file, len)
            .map_err(disk_error(
                "reserve disk space for a fallback file",
                path,
                len,
            ))
            .map_err(removing)?;
        // SAFETY: the file was just created by this process (create_new) and is only resized
        // by it; readers map it read-only.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }
            .map_err(io_error("map a fallback file", path))
            .map_err(removing)?;
        Ok(Self {
            ptr: non_null(map.as_mut_ptr(), &path.display().to_string())?,
            len: map.len(),
            path: path.to_owned(),
            map: FileMap::Owned { _map: map },
        })
    }

    /// Maps `file`, opened from `path`, the store's own name (a hard link) for a cache shard
    /// it serves as an object. The name is removed when the mapping is dropped; if this
    /// fails, the caller still owns it.
    pub fn linked(path: &Path, file: &File) -> Result<Self> {
        // SAFETY: a cache shard is never modified in place (writers rename a new file over a
        // name, eviction unlinks one), and `path` is a name only the store uses.
        let map = unsafe { memmap2::Mmap::map(file) }
            .map_err(io_error("map a cache shard linked as", path))?;
        Ok(Self {
            ptr: non_null(map.as_ptr().cast_mut(), &path.display().to_string())?,
            len: map.len(),
            path: path.to_owned(),
            map: FileMap::Linked { _map: map },
        })
    }

    /// The mapped file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this maps a cache shard served in place (not a fallback object's own file).
    pub fn is_shard(&self) -> bool {
        matches!(self.map, FileMap::Linked { .. })
    }

    /// Maps a fallback object's file read-only.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(io_error("open a fallback file", path))?;
        // SAFETY: fallback files are written only by the store, before the object is sealed,
        // and never truncated while it exists.
        let map =
            unsafe { memmap2::Mmap::map(&file) }.map_err(io_error("map a fallback file", path))?;
        Ok(Self {
            ptr: non_null(map.as_ptr().cast_mut(), &path.display().to_string())?,
            len: map.len(),
            path: path.to_owned(),
            map: FileMap::Reader { _map: map },
        })
    }
}

impl FileMapping {
    /// Maps a fallback object's file writable, for the one process its store handed the
    /// unsealed object to (the file stays the store's: it is not removed on drop).
    pub fn open_writable(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io_error("open a fallback file", path))?;
        // SAFETY: the store created the file with its length reserved and never truncates it
        // while the object exists; until the object is sealed only this process writes it.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }
            .map_err(io_error("map a fallback file", path))?;
        Ok(Self {
            ptr: non_null(map.as_mut_ptr(), &path.display().to_string())?,
            len: map.len(),
            path: path.to_owned(),
            map: FileMap::Writer { _map: map },
        })
    }
}

impl Drop for FileMapping {
    fn drop(&mut self) {
        if let FileMap::Owned { .. } | FileMap::Linked { .. } = &self.map
            && let Err(error) = std::fs::remove_file(&self.path)
        {
            tracing::warn!(path = %self.path.display(), %error, "cannot remove an object's file");
        }
    }
}

fn non_null(ptr: *mut u8, name: &str) -> Result<NonNull<u8>> {
    NonNull::new(ptr).ok_or_else(|| Error::SharedMemory {
        name: name.to_owned(),
        action: "map",
        reason: "the mapping has a null address".into(),
    })
}

fn reserve(file: &File, len: u64) -> std::io::Result<()> {
    let len = libc::off_t::try_from(len)
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::FileTooLarge))?;
    // SAFETY: plain syscall on a file descriptor this function borrows.
    let status = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
    if status == 0 {
        Ok(())
    } else {
        Err(std::io::Error::from_raw_os_error(status))
    }
}

/// Maps an I/O error on `path` to [`Error::DiskFull`] when the disk is full (naming the bytes
/// needed and free), else to [`Error::Io`].
pub fn disk_error<'a>(
    action: &'static str,
    path: &'a Path,
    needed: u64,
) -> impl Fn(std::io::Error) -> Error + 'a {
    move |source| {
        if source.raw_os_error() == Some(libc::ENOSPC) {
            Error::DiskFull {
                path: path.to_owned(),
                needed,
                available: path.parent().and_then(available_space),
            }
        } else {
            io_error(action, path)(source)
        }
    }
}

/// Maps an I/O error doing `action` on `path` to [`Error::Io`].
pub fn io_error<'a>(action: &'static str, path: &'a Path) -> impl Fn(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        action,
        path: path.to_owned(),
        source,
    }
}

/// Creates `path` for reading and writing; fails if it exists, so a file is never shared by
/// two writers.
pub fn create_new_file(path: &Path, action: &'static str) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(io_error(action, path))
}

/// Free bytes on the file system holding `path`, or `None` if it cannot be asked.
pub fn available_space(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c_path` is a valid C string and `stat` is a properly sized out-parameter.
    let status = unsafe { libc::statvfs(c_path.as_ptr(), stat.as_mut_ptr()) };
    if status != 0 {
        return None;
    }
    // SAFETY: statvfs succeeded, so it filled the struct in.
    let stat = unsafe { stat.assume_init() };
    Some(stat.f_bavail.saturating_mul(stat.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_is_reported_with_the_bytes_needed_and_free() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("object");
        let full =
            disk_error("write", &path, 12_345)(std::io::Error::from_raw_os_error(libc::ENOSPC));
        let free = available_space(dir.path()).unwrap();
        match &full {
            Error::DiskFull {
                needed, available, ..
            } => {
                assert_eq!(*needed, 12_345);
                // Free space moves with other writers; it is the same file system's figure.
                assert!(available.is_some_and(|bytes| bytes.abs_diff(free) < 1 << 30));
            }
            other => panic!("expected DiskFull, got {other}"),
        }
        assert!(full.to_string().contains("needs 12345 bytes"), "{full}");
        let other = disk_error("write", &path, 1)(std::io::Error::from_raw_os_error(libc::EIO));
        assert!(matches!(other, Error::Io { .. }), "{other}");
    }

    /// A range is populated but for the whole granules populated before; its partial
    /// granules at either end are populated every time.
    #[test]
    fn only_granules_not_populated_before_are_populated() {
        const G: u64 = PopulatedGranules::GRANULE;
        let granules = PopulatedGranules::new(200 * G + 5);
        assert_eq!(granules.unpopulated(10..3 * G + 7), vec![10..3 * G + 7]);
        granules.mark(10..3 * G + 7);
        // Granules 1 and 2 are whole in that range; 0 and 3 are not.
        assert!(!granules.is_marked(0) && granules.is_marked(1) && granules.is_marked(2));
        assert!(!granules.is_marked(3));
        assert_eq!(
            granules.unpopulated(10..3 * G + 7),
            vec![10..G, 3 * G..3 * G + 7]
        );
        assert_eq!(granules.unpopulated(G..3 * G), Vec::<Range<u64>>::new());
        assert_eq!(granules.unpopulated(G + 1..2 * G), vec![G + 1..2 * G]);
        assert_eq!(granules.unpopulated(0..5 * G), vec![0..G, 3 * G..5 * G]);
        // A range inside one granule is populated whole, however often it comes.
        granules.mark(G + 1..2 * G - 1);
        assert_eq!(
            granules.unpopulated(G + 1..2 * G - 1),
            vec![G + 1..2 * G - 1]
        );
        assert!(granules.unpopulated(G..G).is_empty());
        // The segment's last granule is short: it is never whole, and never marked.
        granules.mark(0..200 * G + 5);
        assert!(granules.is_marked(199) && !granules.is_marked(200));
        assert_eq!(
            granules.unpopulated(0..200 * G + 5),
            vec![200 * G..200 * G + 5]
        );
    }

    /// Writing into pages populated by an earlier object's populate: a second object in the
    /// same granules is written and read whole, and the segment's file holds its pages once.
    #[test]
    fn a_range_populated_before_is_written_again_without_populating() {
        const G: u64 = PopulatedGranules::GRANULE;
        let name = format!("populate-test-{}", std::process::id());
        let segment = SharedSegment::create_for_store(&name, (8 * G) as usize).unwrap();
        segment.populate_for_write(0, 8 * G).unwrap();
        assert!((0..8).all(|granule| segment.populated.is_marked(granule)));
        assert!(segment.resident_bytes().unwrap() >= 8 * G);
        let reader = SharedSegment::open(segment.shmem.get_os_id()).unwrap();
        assert!(
            !reader.populated.is_marked(0),
            "marks are the mapping's own"
        );
        segment.populate_for_write(G + 3, 4 * G).unwrap();
        // SAFETY: the range lies inside the mapping, and nothing else writes it.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                segment.ptr.as_ptr().add((G + 3) as usize),
                4 * G as usize,
            )
        };
        bytes
            .iter_mut()
            .enumerate()
            .for_each(|(at, byte)| *byte = at as u8);
        // SAFETY: as above, read through the other mapping of the same file.
        let read = unsafe {
            std::slice::from_raw_parts(reader.ptr.as_ptr().add((G + 3) as usize), 4 * G as usize)
        };
        assert!(read.iter().enumerate().all(|(at, byte)| *byte == at as u8));
        assert_eq!(segment.resident_bytes().unwrap(), 8 * G);
        let outside = segment.populate_for_write(7 * G, G + 1).unwrap_err();
        assert!(outside.to_string().contains("lie outside"), "{outside}");
    }

    #[test]
    fn headers_round_trip_and_reject_garbage() {
        let header = Header {
            object: ObjectId::new(0x1234_5678_9abc_def0_1122_3344_5566_7788),
            len: 987_654,
            sealed: true,
            checksum: 42,
        };
        assert_eq!(Header::decode(&header.encode()), Some(header));
        assert_eq!(Header::decode(&[0u8; HEADER_LEN as usize]), None);
    }
}
