//! Cache shards served in place: objects whose bytes are a shard file's payload.
//!
//! A cache hit is not copied into the store's memory. The store gives the shard file a second
//! name of its own — the name a fallback object with that id would have,
//! `<fallback_dir>/<store>-<object>.object`, as a hard link — maps it read-only and registers a
//! sealed object backed by that mapping, as a fallback object is. So `get` hands out views of
//! the mapping, and readers get an ordinary file [`ObjectLocation`](crate::ObjectLocation):
//! workers map the file, transfers send from it with `sendfile`. The shard's payload starts 64
//! bytes into the file, where an object's payload starts after its header, and is laid out
//! with 64-byte alignment, so decoding it needs no copy either.
//!
//! The link belongs to the object. The cache may evict, clean or replace the shard's own name
//! meanwhile; the file's data stays on disk while the link exists, and the link (with the
//! mapping) goes when the object is freed. A store that dies leaves its links for its successor
//! to remove, like its fallback files. The mapping takes none of the store's memory: its pages
//! are the page cache's, read when a reader touches them.
//!
//! Where no link can be made (the fallback and cache directories on different file systems, or
//! a file system without hard links) the payload is copied into the store instead.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use floe_core::ObjectId;

use crate::cache::ServedShard;
use crate::mapping::{FileMapping, HEADER_LEN, ShardPrefix, io_error};
use crate::region::Region;
use crate::{Error, ObjectStore, Result};

/// How [`ObjectStore::adopt_shard`] made the object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adoption {
    /// The shard file is the object's bytes, under the store's own link to it.
    Mapped,
    /// No link could be made: the payload was copied into the store.
    Copied,
}

impl ObjectStore {
    /// Makes `object`, with one reference, of the payload of a shard the cache checked
    /// ([`Cache::serve_shard`](crate::cache::Cache::serve_shard)), without copying it where the
    /// store can link the file. The file must still be the one checked (its device and inode),
    /// else [`Error::ShardChanged`].
    pub fn adopt_shard(&self, object: ObjectId, shard: &ServedShard) -> Result<Adoption> {
        let link = self.config().object_file(object);
        match std::fs::hard_link(&shard.path, &link) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(Error::AlreadyExists { object });
            }
            Err(error) => {
                tracing::warn!(
                    shard = %shard.path.display(),
                    link = %link.display(),
                    %error,
                    "cannot link a cache shard into the fallback directory; copying it into the store"
                );
                self.copy_shard(object, shard)?;
                return Ok(Adoption::Copied);
            }
        }
        let unclaimed = Unclaimed(&link);
        let file = File::open(&link).map_err(io_error("open a linked cache shard", &link))?;
        same_file(&file, shard, &link)?;
        let mapping = FileMapping::linked(&link, &file)?;
        // From here the mapping removes the link when it goes.
        std::mem::forget(unclaimed);
        expect_prefix(mapping.shard_prefix_at(0), mapping.len(), shard)?;
        self.insert_file_object(object, shard.len, Arc::new(mapping), shard.checksum)?;
        Ok(Adoption::Mapped)
    }

    /// Copies the payload of `shard` into a new object.
    fn copy_shard(&self, object: ObjectId, shard: &ServedShard) -> Result<()> {
        let file = File::open(&shard.path).map_err(io_error("open a cache shard", &shard.path))?;
        same_file(&file, shard, &shard.path)?;
        // SAFETY: a cache shard is never modified in place (see `FileMapping::linked`).
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(io_error("map a cache shard", &shard.path))?;
        let prefix = map.get(..HEADER_LEN as usize).and_then(ShardPrefix::decode);
        expect_prefix(prefix, map.len(), shard)?;
        let mut writer = self.create(object, shard.len)?;
        writer
            .as_mut_slice()
            .copy_from_slice(&map[HEADER_LEN as usize..]);
        writer.seal_with_checksum(shard.checksum)
    }
}

/// A link made for an object that has not reached its mapping yet: removed if it never does.
struct Unclaimed<'a>(&'a Path);

impl Drop for Unclaimed<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

/// Fails unless `file`, opened from `path`, is the file `shard` was checked as.
fn same_file(file: &File, shard: &ServedShard, path: &Path) -> Result<()> {
    let metadata = file
        .metadata()
        .map_err(io_error("stat a cache shard", path))?;
    if (metadata.dev(), metadata.ino()) == (shard.device, shard.inode) {
        Ok(())
    } else {
        Err(Error::ShardChanged {
            path: shard.path.clone(),
        })
    }
}

/// Fails unless a file of `file_len` bytes starting with `prefix` holds the payload `shard`
/// was checked with.
fn expect_prefix(prefix: Option<ShardPrefix>, file_len: usize, shard: &ServedShard) -> Result<()> {
    let expected = ShardPrefix {
        len: shard.len,
        checksum: shard.checksum,
    };
    if prefix == Some(expected) && file_len as u64 == HEADER_LEN + shard.len {
        Ok(())
    } else {
        Err(Error::ShardChanged {
            path: shard.path.clone(),
        })
    }
}
