//! Memory that objects live in — a shared-memory segment or a mapped file — and the header
//! every object carries in it.
//!
//! Each object starts with a 64-byte header naming it, so a process that maps an object from a
//! location it was given can check it found the object it asked for (and that the object is
//! sealed) instead of trusting a possibly stale offset. The payload follows the header, so it
//! starts 64-byte aligned.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use floe_core::ObjectId;
use shared_memory::{Shmem, ShmemConf};

use crate::{Error, Result};

/// Bytes before each object's payload.
pub const HEADER_LEN: u64 = 64;
const MAGIC: [u8; 8] = *b"FLOEOBJ1";
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

/// A mapped region: a shared-memory segment (created by the store, or opened by a reader) or
/// a file (a fallback object).
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

enum Backing {
    Shared(Shmem),
    /// Created by the store: writable, and the file is removed when the mapping goes.
    OwnedFile {
        _map: memmap2::MmapMut,
        path: PathBuf,
    },
    /// Opened by a reader.
    File {
        _map: memmap2::Mmap,
        path: PathBuf,
    },
}

// SAFETY: the mapping stays valid at the same address until drop, and `Mapping` hands out only
// raw pointers; who may write where is decided by the store (a range is written only by the one
// `ObjectWriter` that allocated it, and read only after it is sealed).
unsafe impl Send for Mapping {}
// SAFETY: as above; no method takes `&self` and mutates.
unsafe impl Sync for Mapping {}
// A panic cannot leave a `Mapping` half-updated: it has no interior mutability.
impl std::panic::RefUnwindSafe for Mapping {}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("name", &self.name())
            .field("len", &self.len)
            .finish()
    }
}

impl Mapping {
    /// Creates shared-memory segment `os_id` of `len` bytes; it is unlinked when this mapping
    /// is dropped.
    pub fn create_shared(os_id: &str, len: usize) -> Result<Self> {
        let shmem = ShmemConf::new()
            .os_id(os_id)
            .size(len)
            .create()
            .map_err(|error| Error::SharedMemory {
                name: os_id.to_owned(),
                action: "create",
                reason: error.to_string(),
            })?;
        Ok(Self {
            ptr: non_null(shmem.as_ptr(), os_id)?,
            len: shmem.len(),
            backing: Backing::Shared(shmem),
        })
    }

    /// Unlinks segment `os_id` if it exists; returns whether it did.
    pub fn unlink_shared(os_id: &str) -> Result<bool> {
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

    /// Maps an existing segment created by a store, possibly in another process. Readers only
    /// read through it (the shared_memory crate always maps read-write).
    pub fn open_shared(os_id: &str) -> Result<Self> {
        let shmem = ShmemConf::new()
            .os_id(os_id)
            .open()
            .map_err(|error| Error::SharedMemory {
                name: os_id.to_owned(),
                action: "open",
                reason: error.to_string(),
            })?;
        Ok(Self {
            ptr: non_null(shmem.as_ptr(), os_id)?,
            len: shmem.len(),
            backing: Backing::Shared(shmem),
        })
    }

    /// Creates file `path` of `len` bytes with its blocks reserved up front, and maps it. The
    /// reservation turns a full disk into an error here; a sparse file would instead fault
    /// (SIGBUS) on the first write that finds no free block.
    pub fn create_file(path: &Path, len: u64) -> Result<Self> {
        let io = |action: &'static str| {
            move |source: std::io::Error| Error::Io {
                action,
                path: path.to_owned(),
                source,
            }
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(io("create a fallback file"))?;
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
            .map_err(io("map a fallback file"))
            .map_err(removing)?;
        Ok(Self {
            ptr: non_null(map.as_mut_ptr(), &path.display().to_string())?,
            len: map.len(),
            backing: Backing::OwnedFile {
                _map: map,
                path: path.to_owned(),
            },
        })
    }

    /// Maps a fallback object's file read-only.
    pub fn open_file(path: &Path) -> Result<Self> {
        let io = |action: &'static str| {
            move |source: std::io::Error| Error::Io {
                action,
                path: path.to_owned(),
                source,
            }
        };
        let file = File::open(path).map_err(io("open a fallback file"))?;
        // SAFETY: fallback files are written only by the store, before the object is sealed,
        // and never truncated while it exists.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io("map a fallback file"))?;
        Ok(Self {
            ptr: non_null(map.as_ptr().cast_mut(), &path.display().to_string())?,
            len: map.len(),
            backing: Backing::File {
                _map: map,
                path: path.to_owned(),
            },
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Where the payload of the object whose header is at `header_offset` starts.
    ///
    /// # Safety
    /// `header_offset + HEADER_LEN` must lie inside the mapping.
    pub unsafe fn payload(&self, header_offset: u64) -> NonNull<u8> {
        // SAFETY: in bounds by the caller's promise, so the result is non-null as well.
        unsafe { self.ptr.add((header_offset + HEADER_LEN) as usize) }
    }

    /// The shared-memory os id or the file path, as a reader would open it.
    pub fn name(&self) -> String {
        match &self.backing {
            Backing::Shared(shmem) => shmem.get_os_id().to_owned(),
            Backing::OwnedFile { path, .. } | Backing::File { path, .. } => {
                path.display().to_string()
            }
        }
    }

    /// Reads the header at `offset`, if the range lies inside the mapping.
    pub fn header_at(&self, offset: u64) -> Option<Header> {
        let end = offset.checked_add(HEADER_LEN)?;
        if end > self.len as u64 {
            return None;
        }
        let mut bytes = [0u8; HEADER_LEN as usize];
        // SAFETY: the range is inside the mapping (checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset as usize),
                bytes.as_mut_ptr(),
                bytes.len(),
            );
        }
        Header::decode(&bytes)
    }

    /// Writes `header` at `offset`.
    ///
    /// # Safety
    /// `offset..offset + HEADER_LEN` must be inside the mapping and owned by the caller.
    pub unsafe fn write_header(&self, offset: u64, header: &Header) {
        let bytes = header.encode();
        // SAFETY: guaranteed by the caller.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.ptr.as_ptr().add(offset as usize),
                bytes.len(),
            );
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Backing::OwnedFile { path, .. } = &self.backing
            && let Err(error) = std::fs::remove_file(path)
        {
            tracing::warn!(path = %path.display(), %error, "cannot remove a fallback file");
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
            Error::Io {
                action,
                path: path.to_owned(),
                source,
            }
        }
    }
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
