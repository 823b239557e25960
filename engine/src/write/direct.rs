//! A sink's file, written with direct I/O from a buffer the process keeps warm.
//!
//! A buffered write copies every byte into the page cache, and on a VM whose free memory the
//! host has taken back, the kernel faults in each fresh page-cache page on that copy: writing
//! a new 800 MB file took 2.2 s of system time on the benchmark host, against 0.24 s into pages
//! just freed, and that copy was a fifth of a 1 GB sort's CPU. A sink file is synced before it
//! is published and seldom read back at once, so its bytes go from a reused, aligned buffer
//! straight to the disk (`O_DIRECT`): the kernel copies none but the last block's tail. Each
//! write then waits for the disk, while the task's other files and the node's other tasks
//! keep the cores busy.
//!
//! A process lends at most [`WARM_BUFFERS`] such buffers at once, so a task writing hundreds of
//! partition directories holds a few MiB of them: its other files, and files the caller reads
//! back at once (a remote sink's uploads), go through the page cache from small buffers, as do
//! files on a file system that refuses direct I/O.

use std::fs::File;
use std::io::{self, Write};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

/// What direct I/O asks the buffer's address, the file offsets and the lengths to be a
/// multiple of: 4 KiB, the largest logical block size of common disks.
const ALIGN: usize = 4096;

/// The bytes a warm buffer gathers before each write: a direct write of 1 MiB ran at 1.8 GB/s
/// on the benchmark host (256 KiB: 1.1 GB/s).
const WARM_BUFFER_BYTES: usize = 1 << 20;

/// How many warm buffers a process lends at once; it keeps them all once made.
const WARM_BUFFERS: usize = 4;

/// The buffer of a file written through the page cache: what `BufWriter` holds, times eight.
const SMALL_BUFFER_BYTES: usize = 64 << 10;

/// The process's warm buffers.
static POOL: Mutex<Pool> = Mutex::new(Pool {
    lent: 0,
    spares: Vec::new(),
});

struct Pool {
    lent: usize,
    /// Buffers not lent, kept so that their pages stay faulted in: fresh memory costs this VM
    /// 0.3–0.75 GB/s to touch, reused memory 8–12 GB/s.
    spares: Vec<Vec<u8>>,
}

/// The path a file's bytes take to the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Io {
    /// Straight from the buffer (`O_DIRECT`).
    Direct,
    /// Through the page cache.
    PageCache,
}

/// [`WARM_BUFFER_BYTES`] aligned to [`ALIGN`], lent from the spares and given back on drop.
struct WarmBuffer {
    /// Holds the aligned bytes at `start`; a `Vec`'s heap address never moves, so neither do they.
    storage: Vec<u8>,
    start: usize,
}

impl WarmBuffer {
    /// A buffer, unless [`WARM_BUFFERS`] are lent already.
    fn lend() -> Option<Self> {
        let spare = {
            let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
            if pool.lent == WARM_BUFFERS {
                return None;
            }
            pool.lent += 1;
            pool.spares.pop()
        };
        let storage = spare.unwrap_or_else(|| vec![0; WARM_BUFFER_BYTES + ALIGN]);
        let start = storage.as_ptr().align_offset(ALIGN);
        Some(Self { storage, start })
    }

    fn aligned(&self) -> Range<usize> {
        self.start..self.start + WARM_BUFFER_BYTES
    }
}

impl Drop for WarmBuffer {
    fn drop(&mut self) {
        let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
        pool.spares.push(std::mem::take(&mut self.storage));
        pool.lent -= 1;
    }
}

/// Where a file gathers its bytes.
enum Buffer {
    Warm(WarmBuffer),
    Small(Box<[u8]>),
}

impl Buffer {
    fn bytes(&self) -> &[u8] {
        match self {
            Buffer::Warm(warm) => &warm.storage[warm.aligned()],
            Buffer::Small(small) => small,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Buffer::Warm(warm) => {
                let aligned = warm.aligned();
                &mut warm.storage[aligned]
            }
            Buffer::Small(small) => small,
        }
    }
}

/// A new file written a buffer at a time, directly to the disk where it can be.
/// Its bytes are all in the file only once [`DirectFile::finish`] returned: `flush` writes
/// nothing, as a direct write must end on a block boundary.
pub(super) struct DirectFile {
    file: File,
    buffer: Buffer,
    /// The bytes of `buffer` not yet written.
    filled: usize,
    io: Io,
}

impl DirectFile {
    /// Creates the file at `path`, which must not exist: it is never opened through a name
    /// that is already there (a symlink planted there would send the write elsewhere). Its
    /// bytes take the path `wanted` when a warm buffer is free and the file system allows.
    pub(super) fn create_new(path: &Path, wanted: Io) -> io::Result<Self> {
        let file = File::options().write(true).create_new(true).open(path)?;
        let warm = match wanted {
            Io::Direct => WarmBuffer::lend(),
            Io::PageCache => None,
        };
        let buffer = match warm {
            Some(warm) => Buffer::Warm(warm),
            None => Buffer::Small(vec![0; SMALL_BUFFER_BYTES].into_boxed_slice()),
        };
        let mut created = Self {
            file,
            buffer,
            filled: 0,
            io: Io::PageCache,
        };
        if let Buffer::Warm(_) = created.buffer {
            // A file system without direct I/O (tmpfs before Linux 6.6, some FUSE ones)
            // refuses the flag; the file then goes through the page cache.
            let _refused = created.set_io(Io::Direct);
        }
        Ok(created)
    }

    /// The path the file's bytes take now.
    #[cfg(test)]
    fn io(&self) -> Io {
        self.io
    }

    /// Writes what is buffered and returns the file, whose bytes may still have to be synced.
    pub(super) fn finish(mut self) -> io::Result<File> {
        let whole_blocks = match self.io {
            Io::Direct => self.filled / ALIGN * ALIGN,
            Io::PageCache => self.filled,
        };
        self.write_out(whole_blocks)?;
        if self.filled > 0 {
            // The tail is shorter than a block: it goes through the page cache.
            self.set_io(Io::PageCache)?;
            self.write_out(self.filled)?;
        }
        Ok(self.file)
    }

    /// Writes the first `len` buffered bytes and moves the rest to the front, also when the
    /// write fails part-way: what reached the file never leaves the buffer a second time.
    fn write_out(&mut self, len: usize) -> io::Result<()> {
        let mut written = 0;
        let result = self.write_prefix(len, &mut written);
        self.buffer.bytes_mut().copy_within(written..self.filled, 0);
        self.filled -= written;
        result
    }

    /// Writes buffered bytes from `*written` up to `len`, counting them in `*written`.
    fn write_prefix(&mut self, len: usize, written: &mut usize) -> io::Result<()> {
        while *written < len {
            match self.file.write(&self.buffer.bytes()[*written..len]) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "the file took no more bytes",
                    ));
                }
                Ok(n) => *written += n,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                // A disk with stricter alignment than `ALIGN`, or a short direct write that
                // left the offset between blocks: the rest goes through the page cache.
                Err(error)
                    if self.io == Io::Direct && error.raw_os_error() == Some(libc::EINVAL) =>
                {
                    self.set_io(Io::PageCache)?;
                }
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    fn set_io(&mut self, io: Io) -> io::Result<()> {
        set_status_flag(&self.file, libc::O_DIRECT, io == Io::Direct)?;
        self.io = io;
        Ok(())
    }
}

/// Sets or clears one of `file`'s status flags (`O_DIRECT`, `O_NONBLOCK`, …).
fn set_status_flag(file: &File, flag: libc::c_int, on: bool) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: the descriptor is `file`'s own and open for both calls, which read and set its
    // status flags only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    let flags = if on { flags | flag } else { flags & !flag };
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl Write for DirectFile {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        // A full buffer is written before more is taken, so an error takes no bytes.
        let capacity = self.buffer.bytes().len();
        if self.filled == capacity {
            self.write_out(capacity)?;
        }
        let n = bytes.len().min(capacity - self.filled);
        self.buffer.bytes_mut()[self.filled..self.filled + n].copy_from_slice(&bytes[..n]);
        self.filled += n;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// These tests need their temporary directory on a disk file system that takes direct I/O
/// and refuses a direct write at an offset between blocks (ext4 and XFS do; CI's is ext4).
#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::path::PathBuf;
    use std::sync::{Mutex, MutexGuard, PoisonError};

    use super::{
        ALIGN, Buffer, DirectFile, Io, WARM_BUFFER_BYTES, WARM_BUFFERS, WarmBuffer, set_status_flag,
    };

    /// The tests lend the process's warm buffers, so they run one at a time.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    /// A temporary directory, and this test's turn with the warm buffers.
    struct Scratch {
        _turn: MutexGuard<'static, ()>,
        directory: tempfile::TempDir,
    }

    impl Scratch {
        fn new() -> Self {
            Self {
                _turn: ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner),
                directory: tempfile::tempdir().unwrap(),
            }
        }

        fn path(&self, name: &str) -> PathBuf {
            self.directory.path().join(name)
        }
    }

    /// Pieces of awkward sizes: a byte, a block and a byte, several buffers and a byte, and so
    /// on, numbered on from `from` bytes.
    fn pieces(from: usize) -> Vec<Vec<u8>> {
        let mut offset = from;
        [
            1,
            ALIGN + 1,
            3 * WARM_BUFFER_BYTES + 1,
            WARM_BUFFER_BYTES - 2,
            7,
        ]
        .into_iter()
        .map(|len| {
            let piece = (offset..offset + len).map(|i| (i % 251) as u8).collect();
            offset += len;
            piece
        })
        .collect()
    }

    fn write_pieces(file: &mut DirectFile) {
        for piece in pieces(0) {
            file.write_all(&piece).unwrap();
        }
    }

    #[test]
    fn a_direct_file_keeps_every_byte() {
        let scratch = Scratch::new();
        let path = scratch.path("out");
        let mut file = DirectFile::create_new(&path, Io::Direct).unwrap();
        assert_eq!(file.io(), Io::Direct, "{} refused O_DIRECT", path.display());
        write_pieces(&mut file);
        assert_eq!(file.io(), Io::Direct, "a direct write was refused");
        file.finish().unwrap().sync_all().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), pieces(0).concat());
    }

    #[test]
    fn a_refused_direct_write_goes_through_the_page_cache() {
        let scratch = Scratch::new();
        let path = scratch.path("out");
        let mut file = DirectFile::create_new(&path, Io::Direct).unwrap();
        // One byte written through the page cache leaves the offset between blocks, where
        // the disk refuses the next direct write.
        file.set_io(Io::PageCache).unwrap();
        file.write_all(&[0]).unwrap();
        file.write_out(1).unwrap();
        file.set_io(Io::Direct).unwrap();
        for piece in pieces(1) {
            file.write_all(&piece).unwrap();
        }
        assert_eq!(
            file.io(),
            Io::PageCache,
            "the misaligned direct write was taken"
        );
        file.finish().unwrap().sync_all().unwrap();
        let mut expected = vec![0];
        expected.extend(pieces(1).concat());
        assert_eq!(std::fs::read(&path).unwrap(), expected);
    }

    #[test]
    fn files_past_the_warm_buffers_go_through_the_page_cache_and_the_buffers_come_back() {
        let scratch = Scratch::new();
        let paths: Vec<_> = (0..=WARM_BUFFERS)
            .map(|n| scratch.path(&format!("out-{n}")))
            .collect();
        let mut files: Vec<DirectFile> = paths
            .iter()
            .map(|path| DirectFile::create_new(path, Io::Direct).unwrap())
            .collect();
        let ios: Vec<Io> = files.iter().map(DirectFile::io).collect();
        let mut expected = vec![Io::Direct; WARM_BUFFERS];
        expected.push(Io::PageCache);
        assert_eq!(ios, expected);
        assert!(matches!(files[WARM_BUFFERS].buffer, Buffer::Small(_)));
        for file in &mut files {
            write_pieces(file);
        }
        for file in files {
            file.finish().unwrap().sync_all().unwrap();
        }
        for path in &paths {
            assert_eq!(std::fs::read(path).unwrap(), pieces(0).concat());
        }
        // Every buffer is back: as many files as before get one again.
        let again: Vec<WarmBuffer> = (0..WARM_BUFFERS)
            .map(|_| WarmBuffer::lend().expect("a warm buffer was not given back"))
            .collect();
        assert!(WarmBuffer::lend().is_none());
        drop(again);
    }

    #[test]
    fn a_file_asked_to_use_the_page_cache_keeps_every_byte() {
        let scratch = Scratch::new();
        let path = scratch.path("out");
        let mut file = DirectFile::create_new(&path, Io::PageCache).unwrap();
        assert_eq!(file.io(), Io::PageCache);
        assert!(matches!(file.buffer, Buffer::Small(_)));
        write_pieces(&mut file);
        file.finish().unwrap().sync_all().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), pieces(0).concat());
    }

    #[test]
    fn bytes_written_before_a_failure_are_not_written_again() {
        let _scratch = Scratch::new();
        // A pipe that refuses to wait takes its capacity (64 KiB) of a 1 MiB write, then fails.
        let (mut reader, writer) = std::io::pipe().unwrap();
        let pipe = std::fs::File::from(std::os::fd::OwnedFd::from(writer));
        set_status_flag(&pipe, libc::O_NONBLOCK, true).unwrap();
        let mut file = DirectFile {
            file: pipe,
            buffer: Buffer::Warm(WarmBuffer::lend().unwrap()),
            filled: 0,
            io: Io::PageCache,
        };
        let bytes: Vec<u8> = (0..WARM_BUFFER_BYTES).map(|i| (i % 251) as u8).collect();
        file.write_all(&bytes).unwrap();
        let error = file.write_out(WARM_BUFFER_BYTES).unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::WouldBlock);
        assert!(file.filled < WARM_BUFFER_BYTES, "the pipe took nothing");
        let reading = std::thread::spawn(move || {
            let mut read = Vec::new();
            reader.read_to_end(&mut read).unwrap();
            read
        });
        set_status_flag(&file.file, libc::O_NONBLOCK, false).unwrap();
        drop(file.finish().unwrap());
        assert!(
            reading.join().unwrap() == bytes,
            "bytes were lost or written twice"
        );
    }
}
