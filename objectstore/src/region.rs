//! The memory objects are laid out in, behind one trait.
//!
//! A store keeps all its objects in one [`Region`] for its whole life — a shared-memory segment
//! in production, so any process on the host can map an object from its location, or plain heap
//! memory in tests, which needs no /dev/shm and leaves nothing behind when a test process dies
//! ([`Backing`] picks one). Each disk-backed fallback object is a region of its own, a mapped
//! file. Above this trait — allocation, spill, restore, fallback, pins, views — the store sees
//! only a base address, a length and how a reader reaches the region, so it runs unchanged on
//! either backing. Views and writers keep the raw address they were given, so reading and
//! writing object bytes never goes through the trait.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::alloc::ALIGNMENT;
use crate::mapping::{HEADER_LEN, Header, ShardPrefix, SharedSegment};
use crate::view::ObjectSource;
use crate::{Error, Result};

/// Which memory an [`ObjectStore`](crate::ObjectStore) keeps its objects in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    /// A shared-memory segment, `/floe-<name>`, that other processes on the host map to read
    /// objects in place: what a node's store uses.
    SharedMemory,
    /// Heap memory of the store's own process, for tests: single-process, nothing in /dev/shm.
    /// Its objects' locations cannot be opened by a [`StoreClient`](crate::StoreClient)
    /// (disk-backed fallback objects still can: they are files).
    Heap,
}

impl Backing {
    /// The memory of store `name`: `len` bytes, zeroed, starting [`ALIGNMENT`]-aligned.
    pub(crate) fn create(self, name: &str, len: usize) -> Result<Arc<dyn Region>> {
        Ok(match self {
            Self::SharedMemory => Arc::new(SharedSegment::create_for_store(name, len)?),
            Self::Heap => Arc::new(HeapRegion::new(name, len)?),
        })
    }
}

/// A fixed-size byte region objects are laid out in, each as a header and its payload.
///
/// A region is an Arrow [`Allocation`](arrow::alloc::Allocation), so a reader's mapping can own
/// the Arrow buffers made from the objects in it.
///
/// # Safety
/// [`base`](Self::base) must point to [`len`](Self::len) initialized bytes that stay at that
/// address until the region is dropped, and that nothing but this region's users reach (who
/// writes which range is the store's business: a range is written only by the one writer that
/// allocated it, and read only once it is sealed).
pub(crate) unsafe trait Region: arrow::alloc::Allocation + std::fmt::Debug {
    fn base(&self) -> NonNull<u8>;

    fn len(&self) -> usize;

    /// How a process reaches this region: what [`ObjectLocation`](crate::ObjectLocation)s of
    /// objects in it say, and what a [`StoreClient`](crate::StoreClient) opens.
    fn source(&self) -> ObjectSource;

    /// The bytes of the region that hold memory now: the pages ever written, which stay with
    /// the region for reuse (a segment's pages in `/dev/shm`). `None` for heap memory, which
    /// its process's own heap already counts.
    fn resident_bytes(&self) -> Option<u64> {
        None
    }

    /// Maps in, for writing, the pages of the `len` bytes at `offset`, which the caller is about
    /// to write whole: one call instead of a page fault a page (a fault costs about as much as
    /// writing the page), and a file system with no room left for them is an error here, not a
    /// `SIGBUS` on the write. Nothing to do for the process's own heap, or for a file whose
    /// blocks are reserved.
    fn populate_for_write(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    /// Where the payload of the object whose header is at `header_offset` starts.
    ///
    /// # Safety
    /// `header_offset + HEADER_LEN` must lie inside the region.
    unsafe fn payload(&self, header_offset: u64) -> NonNull<u8> {
        // SAFETY: in bounds by the caller's promise, so the result is non-null as well.
        unsafe { self.base().add((header_offset + HEADER_LEN) as usize) }
    }

    /// Reads the header at `offset`, if the range lies inside the region.
    fn header_at(&self, offset: u64) -> Option<Header> {
        Header::decode(&self.header_bytes_at(offset)?)
    }

    /// Reads the cache shard prefix at `offset`, if there is one inside the region.
    fn shard_prefix_at(&self, offset: u64) -> Option<ShardPrefix> {
        ShardPrefix::decode(&self.header_bytes_at(offset)?)
    }

    /// The [`HEADER_LEN`] bytes at `offset`, if they lie inside the region.
    fn header_bytes_at(&self, offset: u64) -> Option<[u8; HEADER_LEN as usize]> {
        let end = offset.checked_add(HEADER_LEN)?;
        if end > self.len() as u64 {
            return None;
        }
        let mut bytes = [0u8; HEADER_LEN as usize];
        // SAFETY: the range is inside the region (checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base().as_ptr().add(offset as usize),
                bytes.as_mut_ptr(),
                bytes.len(),
            );
        }
        Some(bytes)
    }

    /// Writes `header` at `offset`.
    ///
    /// # Safety
    /// `offset..offset + HEADER_LEN` must be inside the region and owned by the caller.
    unsafe fn write_header(&self, offset: u64, header: &Header) {
        let bytes = header.encode();
        // SAFETY: guaranteed by the caller.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.base().as_ptr().add(offset as usize),
                bytes.len(),
            );
        }
    }
}

/// Heap memory standing in for a store's segment ([`Backing::Heap`]).
#[derive(Debug)]
pub struct HeapRegion {
    ptr: NonNull<u8>,
    layout: Layout,
    store: String,
}

// SAFETY: the allocation is owned by the region and freed only on drop; like a segment, it
// hands out raw pointers only, and the store decides who writes where.
unsafe impl Send for HeapRegion {}
// SAFETY: as above; no method takes `&self` and mutates.
unsafe impl Sync for HeapRegion {}
// A panic cannot leave a region half-updated: it has no interior mutability.
impl std::panic::RefUnwindSafe for HeapRegion {}

impl HeapRegion {
    /// `len` zeroed bytes for store `store`. Zeroed rather than uninitialized because writers
    /// hand out the bytes as `&mut [u8]`, which must not cover uninitialized memory — and a
    /// shared-memory segment starts zeroed too.
    pub fn new(store: &str, len: usize) -> Result<Self> {
        let failed = || Error::HeapMemory {
            store: store.to_owned(),
            len: len as u64,
        };
        // Aligned like the objects in it, so an object's payload is as aligned in heap memory
        // as in a page-aligned segment, which zero-copy Arrow decoding relies on.
        let layout = Layout::from_size_align(len, ALIGNMENT as usize)
            .ok()
            .filter(|layout| layout.size() > 0)
            .ok_or_else(failed)?;
        // SAFETY: the layout has a non-zero size (checked above).
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or_else(failed)?;
        Ok(Self {
            ptr,
            layout,
            store: store.to_owned(),
        })
    }
}

// SAFETY: `ptr` is a live allocation of `layout.size()` zeroed bytes, freed only on drop.
unsafe impl Region for HeapRegion {
    fn base(&self) -> NonNull<u8> {
        self.ptr
    }

    fn len(&self) -> usize {
        self.layout.size()
    }

    fn source(&self) -> ObjectSource {
        ObjectSource::Heap {
            store: self.store.clone(),
            pid: std::process::id(),
        }
    }
}

impl Drop for HeapRegion {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout, and freed only here.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

#[cfg(test)]
mod tests {
    use floe_core::ObjectId;

    use super::*;

    #[test]
    fn heap_memory_is_zeroed_aligned_and_holds_headers() {
        let region = Backing::Heap.create("unit", 4096).unwrap();
        assert_eq!(region.len(), 4096);
        assert!(
            region
                .base()
                .as_ptr()
                .addr()
                .is_multiple_of(ALIGNMENT as usize)
        );
        // SAFETY: the region is 4096 bytes long and nobody else holds it.
        let bytes = unsafe { std::slice::from_raw_parts(region.base().as_ptr(), region.len()) };
        assert!(bytes.iter().all(|&byte| byte == 0));
        let header = Header {
            object: ObjectId::new(77),
            len: 100,
            sealed: true,
            checksum: 0,
        };
        assert_eq!(region.header_at(128), None);
        // SAFETY: in bounds, and this test owns the whole region.
        unsafe { region.write_header(128, &header) };
        assert_eq!(region.header_at(128), Some(header));
        // A header that would run past the end is not read.
        assert_eq!(region.header_at(4096 - HEADER_LEN + 1), None);
        assert_eq!(
            region.source(),
            ObjectSource::Heap {
                store: "unit".into(),
                pid: std::process::id()
            }
        );
    }

    #[test]
    fn an_impossible_heap_region_is_an_error_naming_the_store() {
        for len in [0, usize::MAX] {
            let error = HeapRegion::new("big", len).unwrap_err();
            assert!(
                matches!(&error, Error::HeapMemory { store, .. } if store == "big"),
                "{error}"
            );
        }
    }
}
