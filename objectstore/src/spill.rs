//! Spill files: sealed objects written out of memory, several fused into one file.
//!
//! A spill file is a sequence of `header | payload` records. The header is the object header of
//! [`crate::mapping`] with the payload's xxh3-64 filled in; the store also keeps each record's
//! offset and checksum in memory, and restoring checks both, so a damaged file is an error and
//! never wrong data. The file is removed when the last object in it is freed (its last
//! [`SpillSlot`] is dropped) — spill files do not outlive the store process.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use floe_core::ObjectId;
use floe_core::hash::Xxh3_64;

use crate::mapping::{HEADER_LEN, Header, create_new_file, disk_error, io_error};
use crate::{Error, Result};

/// Payloads are hashed and copied in pieces this size, so each piece is still in cache when
/// the second pass over it runs.
const CHUNK: usize = 4 << 20;

/// One spill file; removed from disk when dropped.
#[derive(Debug)]
pub struct SpillFile {
    path: PathBuf,
    file: File,
}

impl Drop for SpillFile {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), %error, "cannot remove a spill file");
        }
    }
}

/// Where one object's spilled copy is.
#[derive(Debug, Clone)]
pub struct SpillSlot {
    file: Arc<SpillFile>,
    /// Offset of the record's header.
    offset: u64,
    len: u64,
    checksum: u64,
}

impl SpillSlot {
    pub fn path(&self) -> &Path {
        &self.file.path
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    /// Reads the object back into `destination` (exactly its length), checking the record
    /// header and the payload checksum.
    pub fn restore_into(&self, object: ObjectId, destination: &mut [u8]) -> Result<()> {
        let corrupt = |problem: String| Error::CorruptSpill {
            object,
            path: self.file.path.clone(),
            offset: self.offset,
            problem,
        };
        let io = io_error("read a spill file", &self.file.path);
        let mut header = [0u8; HEADER_LEN as usize];
        self.file
            .file
            .read_exact_at(&mut header, self.offset)
            .map_err(|error| {
                if error.kind() == std::io::ErrorKind::UnexpectedEof {
                    corrupt("the file is shorter than its index says".into())
                } else {
                    io(error)
                }
            })?;
        let expected = Header {
            object,
            len: self.len,
            sealed: true,
            checksum: self.checksum,
        };
        match Header::decode(&header) {
            Some(found) if found == expected => {}
            Some(found) => {
                return Err(corrupt(format!(
                    "record header says object {} of {} bytes with checksum {:016x}, expected \
                     {} bytes with checksum {:016x}",
                    found.object, found.len, found.checksum, self.len, self.checksum
                )));
            }
            None => return Err(corrupt("no record header at the indexed offset".into())),
        }
        let mut hasher = Xxh3_64::new();
        let mut position = self.offset + HEADER_LEN;
        for chunk in destination.chunks_mut(CHUNK) {
            self.file
                .file
                .read_exact_at(chunk, position)
                .map_err(|error| {
                    if error.kind() == std::io::ErrorKind::UnexpectedEof {
                        corrupt("the file ends inside the object".into())
                    } else {
                        io(error)
                    }
                })?;
            hasher.update(chunk);
            position += chunk.len() as u64;
        }
        let actual = hasher.digest();
        if actual != self.checksum {
            return Err(corrupt(format!(
                "payload checksum {actual:016x} does not match {:016x}",
                self.checksum
            )));
        }
        Ok(())
    }
}

/// Writes `objects` (id and payload) into a new spill file at `path`, returning where each
/// landed, in order. On error the partial file is removed.
pub fn write_spill_file(path: &Path, objects: &[(ObjectId, &[u8])]) -> Result<Vec<SpillSlot>> {
    let file = create_new_file(path, "create a spill file")?;
    // From here the file is removed on every exit path unless a slot keeps it.
    let file = Arc::new(SpillFile {
        path: path.to_owned(),
        file,
    });
    let total: u64 = objects
        .iter()
        .map(|(_, payload)| HEADER_LEN + payload.len() as u64)
        .sum();
    let write_error = disk_error("write a spill file", path, total);
    let mut writer = BufWriter::with_capacity(1 << 20, &file.file);
    let mut records = Vec::with_capacity(objects.len());
    let mut offset = 0u64;
    for &(object, payload) in objects {
        // The header carries the checksum, which is known only after the payload went by: write
        // a placeholder now and the real header once the buffered bytes are on their way.
        writer
            .write_all(&[0u8; HEADER_LEN as usize])
            .map_err(&write_error)?;
        let mut hasher = Xxh3_64::new();
        for chunk in payload.chunks(CHUNK) {
            hasher.update(chunk);
            writer.write_all(chunk).map_err(&write_error)?;
        }
        let header = Header {
            object,
            len: payload.len() as u64,
            sealed: true,
            checksum: hasher.digest(),
        };
        records.push((offset, header));
        offset += HEADER_LEN + payload.len() as u64;
    }
    writer.flush().map_err(&write_error)?;
    drop(writer);
    let mut slots = Vec::with_capacity(records.len());
    for (offset, header) in records {
        file.file
            .write_all_at(&header.encode(), offset)
            .map_err(&write_error)?;
        slots.push(SpillSlot {
            file: Arc::clone(&file),
            offset,
            len: header.len,
            checksum: header.checksum,
        });
    }
    Ok(slots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_records_restore_and_the_file_goes_with_the_last_slot() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fused.spill");
        let a: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let b = vec![7u8; 3];
        let slots = write_spill_file(
            &path,
            &[(ObjectId::new(1), &a[..]), (ObjectId::new(2), &b[..])],
        )
        .unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            2 * HEADER_LEN + 10_003
        );
        let mut back = vec![0u8; 3];
        slots[1].restore_into(ObjectId::new(2), &mut back).unwrap();
        assert_eq!(back, b);
        // Asking for the wrong object at a slot is caught by the header.
        let error = slots[1]
            .restore_into(ObjectId::new(9), &mut back)
            .unwrap_err();
        assert!(matches!(error, Error::CorruptSpill { .. }), "{error}");
        let mut iter = slots.into_iter();
        let first = iter.next().unwrap();
        drop(iter);
        assert!(path.exists());
        let mut back = vec![0u8; a.len()];
        first.restore_into(ObjectId::new(1), &mut back).unwrap();
        assert_eq!(back, a);
        drop(first);
        assert!(!path.exists());
    }
}
