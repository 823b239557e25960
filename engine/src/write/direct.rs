//! A sink's file, written with direct I/O from a buffer the process keeps warm.
//!
//! A buffered write copies every byte into the page cache, and on a VM whose free memory the
//! host has taken back, the kernel faults in each fresh page-cache page on that copy: writing
//! a new 800 MB file took 2.2 s of system time on the benchmark host, against 0.24 s into pages
//! just freed, and that copy was a fifth of a 1 GB sort's CPU. A sink file is synced before it
//! is published and seldom read back at once, so its bytes go from a reused, aligned buffer
//! straight to the disk (`O_DIRECT`), and the kernel copies none of them. Where the file system
//! refuses direct I/O, the file is written through the page cache, a buffer at a time.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

/// What direct I/O asks the buffer's address, the file offsets and the lengths to be a
/// multiple of: 4 KiB, the largest logical block size of common disks.
const ALIGN: usize = 4096;

/// The bytes gathered before each write: a direct write of 1 MiB ran at 1.8 GB/s on the
/// benchmark host (256 KiB: 1.1 GB/s), and a task keeps one buffer per open file.
pub(super) const BUFFER_BYTES: usize = 1 << 20;

/// How many free buffers the process keeps for its next files.
const SPARE_BUFFERS: usize = 4;

/// Free buffers, kept so that their pages stay faulted in: fresh memory costs this VM 0.3–0.75
/// GB/s to touch, reused memory 8–12 GB/s.
static SPARES: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// [`BUFFER_BYTES`] aligned to [`ALIGN`], taken from the spares and given back when dropped.
struct WarmBuffer {
    /// Holds the aligned bytes at `start`; a `Vec`'s heap address never moves, so neither do they.
    storage: Vec<u8>,
    start: usize,
}

impl WarmBuffer {
    fn take() -> Self {
        let spare = SPARES.lock().unwrap_or_else(PoisonError::into_inner).pop();
        let storage = spare.unwrap_or_else(|| vec![0; BUFFER_BYTES + ALIGN]);
        let start = storage.as_ptr().align_offset(ALIGN);
        Self { storage, start }
    }

    fn bytes(&self) -> &[u8] {
        &self.storage[self.start..self.start + BUFFER_BYTES]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + BUFFER_BYTES]
    }
}

impl Drop for WarmBuffer {
    fn drop(&mut self) {
        let mut spares = SPARES.lock().unwrap_or_else(PoisonError::into_inner);
        if spares.len() < SPARE_BUFFERS {
            spares.push(std::mem::take(&mut self.storage));
        }
    }
}

/// A new file written a buffer at a time, directly to the disk where its file system allows.
/// Its bytes are all in the file only once [`DirectFile::finish`] returned: `flush` writes
/// nothing, as a direct write must end on a block boundary.
pub(super) struct DirectFile {
    file: File,
    buffer: WarmBuffer,
    /// The bytes of `buffer` not yet written.
    filled: usize,
    /// Whether the file is open with `O_DIRECT`.
    direct: bool,
}

impl DirectFile {
    /// Creates the file at `path`, which must not exist: it is never opened through a name
    /// that is already there (a symlink planted there would send the write elsewhere).
    pub(super) fn create_new(path: &Path) -> io::Result<Self> {
        let file = File::options().write(true).create_new(true).open(path)?;
        let mut created = Self {
            file,
            buffer: WarmBuffer::take(),
            filled: 0,
            direct: false,
        };
        // A file system without direct I/O (tmpfs before Linux 6.6, some FUSE ones) refuses
        // the flag; the file is then written through the page cache.
        created.direct = created.set_direct(true).is_ok();
        Ok(created)
    }

    /// Whether the file is being written directly to the disk.
    #[cfg(test)]
    pub(super) fn is_direct(&self) -> bool {
        self.direct
    }

    /// Writes what is buffered and returns the file, whose bytes may still have to be synced.
    pub(super) fn finish(mut self) -> io::Result<File> {
        let whole_blocks = if self.direct {
            self.filled / ALIGN * ALIGN
        } else {
            self.filled
        };
        self.write_out(whole_blocks)?;
        if self.filled > 0 {
            // The tail is shorter than a block: it goes through the page cache.
            self.set_direct(false)?;
            self.write_out(self.filled)?;
        }
        Ok(self.file)
    }

    /// Writes the first `len` buffered bytes and moves the rest to the front.
    fn write_out(&mut self, len: usize) -> io::Result<()> {
        let mut written = 0;
        while written < len {
            match self.file.write(&self.buffer.bytes()[written..len]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => written += n,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                // A disk with stricter alignment than `ALIGN`, or a short direct write that
                // left the offset between blocks: the rest goes through the page cache.
                Err(error) if self.direct && error.raw_os_error() == Some(libc::EINVAL) => {
                    self.set_direct(false)?;
                }
                Err(error) => return Err(error),
            }
        }
        self.buffer.bytes_mut().copy_within(len..self.filled, 0);
        self.filled -= len;
        Ok(())
    }

    fn set_direct(&mut self, direct: bool) -> io::Result<()> {
        let fd = self.file.as_raw_fd();
        // SAFETY: the descriptor is this file's own and open for both calls, which read and
        // set its status flags only.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        let flags = if direct {
            flags | libc::O_DIRECT
        } else {
            flags & !libc::O_DIRECT
        };
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd, libc::F_SETFL, flags) } < 0 {
            return Err(io::Error::last_os_error());
        }
        self.direct = direct;
        Ok(())
    }
}

impl Write for DirectFile {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        // A full buffer is written before more is taken, so an error takes no bytes.
        if self.filled == BUFFER_BYTES {
            self.write_out(BUFFER_BYTES)?;
        }
        let n = bytes.len().min(BUFFER_BYTES - self.filled);
        self.buffer.bytes_mut()[self.filled..self.filled + n].copy_from_slice(&bytes[..n]);
        self.filled += n;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::{ALIGN, BUFFER_BYTES, DirectFile};

    /// Pieces of awkward sizes: a byte, a block and a byte, several buffers and a byte, and so
    /// on, numbered on from `from` bytes.
    fn pieces(from: usize) -> Vec<Vec<u8>> {
        let mut offset = from;
        [1, ALIGN + 1, 3 * BUFFER_BYTES + 1, BUFFER_BYTES - 2, 7]
            .into_iter()
            .map(|len| {
                let piece = (offset..offset + len).map(|i| (i % 251) as u8).collect();
                offset += len;
                piece
            })
            .collect()
    }

    #[test]
    fn a_direct_file_keeps_every_byte() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("out");
        let mut file = DirectFile::create_new(&path).unwrap();
        // The tests' temporary directory lies on a disk file system wherever they run.
        assert!(file.is_direct(), "{} refused O_DIRECT", path.display());
        for piece in pieces(0) {
            file.write_all(&piece).unwrap();
        }
        assert!(file.is_direct(), "a direct write was refused");
        file.finish().unwrap().sync_all().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), pieces(0).concat());
    }

    #[test]
    fn a_refused_direct_write_goes_through_the_page_cache() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("out");
        let mut file = DirectFile::create_new(&path).unwrap();
        // One byte written through the page cache leaves the offset between blocks, where
        // the disk refuses the next direct write.
        file.set_direct(false).unwrap();
        file.write_all(&[0]).unwrap();
        file.write_out(1).unwrap();
        file.set_direct(true).unwrap();
        for piece in pieces(1) {
            file.write_all(&piece).unwrap();
        }
        assert!(!file.is_direct(), "the misaligned direct write was taken");
        file.finish().unwrap().sync_all().unwrap();
        let mut expected = vec![0];
        expected.extend(pieces(1).concat());
        assert_eq!(std::fs::read(&path).unwrap(), expected);
    }

    #[test]
    fn an_existing_name_is_never_opened() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("taken");
        std::fs::write(&path, b"old").unwrap();
        let error = DirectFile::create_new(&path).err().unwrap();
        assert_eq!(error.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
    }
}
