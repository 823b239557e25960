//! Reading objects: views, the locations that name them across processes, and the client a
//! worker process uses to map them.
//!
//! The store hands out an [`ObjectLocation`] with every view; the node sends it to a worker
//! (which holds the view, and so the pin, on the worker's behalf), and the worker's
//! [`StoreClient`] maps the segment or file by name and checks the object header there before
//! exposing a byte. Objects of a heap-backed store ([`Backing::Heap`](crate::Backing)) live in
//! the store process's private memory, so their locations are refused.

use std::collections::HashMap;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use arrow::buffer::Buffer;
use floe_core::ObjectId;
use serde::{Deserialize, Serialize};

use crate::mapping::{FileMapping, HEADER_LEN, SharedSegment};
use crate::region::Region;
use crate::{Error, Result};

/// Where a sealed object's bytes are, as another process on the host can open them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectLocation {
    pub object: ObjectId,
    pub source: ObjectSource,
    /// Offset of the object's header; the payload follows it.
    pub offset: u64,
    /// Payload length.
    pub len: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ObjectSource {
    /// The store's shared-memory segment, by its os id.
    Segment { os_id: String },
    /// A disk-backed fallback object, or a cache shard served in place: a file of its own.
    File { path: PathBuf },
    /// The heap memory of in-memory store `store` in process `pid`
    /// ([`Backing::Heap`](crate::Backing)), which no other process can map.
    Heap { store: String, pid: u32 },
}

impl ObjectLocation {
    /// The offset of the payload's first byte in the segment or file.
    pub fn payload_offset(&self) -> u64 {
        self.offset + HEADER_LEN
    }
}

impl ObjectSource {
    /// Opens the segment or file read-only, for calls that take a descriptor (`sendfile`);
    /// `None` for heap memory, which has no file.
    pub fn open_file(&self) -> Result<Option<std::fs::File>> {
        let path = match self {
            Self::Segment { os_id } => SharedSegment::path_of(os_id),
            Self::File { path } => path.clone(),
            Self::Heap { .. } => return Ok(None),
        };
        std::fs::File::open(&path)
            .map(Some)
            .map_err(crate::mapping::io_error("open an object's file", &path))
    }
}

/// Read-only bytes of a sealed object, mapped in place. Cloning is cheap; the object stays
/// pinned (when the view came from the store) and mapped until the last clone, and the last
/// Arrow buffer made by [`to_buffer`](Self::to_buffer), is dropped.
#[derive(Clone)]
pub struct ObjectView {
    location: ObjectLocation,
    ptr: NonNull<u8>,
    len: usize,
    owner: Arc<dyn arrow::alloc::Allocation>,
}

// SAFETY: the bytes are immutable while the view exists (the object is sealed, and `owner`
// keeps the mapping and the pin alive), so sharing them across threads is sound.
unsafe impl Send for ObjectView {}
// SAFETY: as above.
unsafe impl Sync for ObjectView {}

impl std::fmt::Debug for ObjectView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectView")
            .field("location", &self.location)
            .finish_non_exhaustive()
    }
}

impl ObjectView {
    /// # Safety
    /// `location` must describe a sealed object inside `region`, and `owner` must keep that
    /// range mapped and unchanged for as long as it lives.
    pub(crate) unsafe fn new(
        location: ObjectLocation,
        region: &dyn Region,
        owner: Arc<dyn arrow::alloc::Allocation>,
    ) -> Self {
        // SAFETY: the object, header included, lies inside the region (the caller's promise).
        let ptr = unsafe { region.payload(location.offset) };
        Self {
            len: location.len as usize,
            location,
            ptr,
            owner,
        }
    }

    pub fn object(&self) -> ObjectId {
        self.location.object
    }

    pub fn location(&self) -> &ObjectLocation {
        &self.location
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: see `new`: the range is mapped, sealed and unchanged while `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes as an Arrow buffer pointing into the mapping (no copy); the buffer keeps the
    /// object pinned and mapped.
    pub fn to_buffer(&self) -> Buffer {
        // SAFETY: `owner` keeps the range valid and immutable for the buffer's lifetime.
        unsafe { Buffer::from_custom_allocation(self.ptr, self.len, Arc::clone(&self.owner)) }
    }
}

/// Opens objects of the stores on this host by location, from any process. Mapped segments
/// are cached, so opening many objects of one store maps its segment once.
#[derive(Debug, Default)]
pub struct StoreClient {
    segments: Mutex<HashMap<String, Arc<SharedSegment>>>,
}

impl StoreClient {
    pub fn new() -> Self {
        Self::default()
    }

    /// A view of the object at `location`, after checking that the header there names this
    /// object, with this length, sealed. The caller must hold a pin on the object in the
    /// store (the node holds one per worker request) for as long as it uses the view.
    ///
    /// A location in a heap-backed store's memory is refused with [`Error::NotShared`].
    pub fn open(&self, location: &ObjectLocation) -> Result<ObjectView> {
        let region = self.region(location, Access::Read)?;
        check_header(region.as_ref(), location, true)?;
        let owner: Arc<dyn arrow::alloc::Allocation> = Arc::clone(&region) as _;
        // SAFETY: the header check shows a sealed object of this length in range; the caller's
        // pin keeps it there, and `owner` keeps the mapping alive.
        Ok(unsafe { ObjectView::new(location.clone(), region.as_ref(), owner) })
    }

    /// The bytes of the object being written at `location` (its header names it, with this
    /// length, not sealed), mapped writable. The store's owner handed the location out with
    /// the object's [`ObjectWriter`](crate::ObjectWriter) alive, which keeps the range this
    /// object's; it seals the object once this process says it is done, and this process
    /// writes nothing after that. The object is about to be written whole, so its pages are
    /// mapped in now, in one call, instead of faulting in one at a time.
    pub fn open_unsealed(&self, location: &ObjectLocation) -> Result<UnsealedObject> {
        let region = self.region(location, Access::Write)?;
        check_header(region.as_ref(), location, false)?;
        region.populate_for_write(location.offset + HEADER_LEN, location.len)?;
        // SAFETY: the header check shows the object's range inside the region.
        let ptr = unsafe { region.payload(location.offset) };
        Ok(UnsealedObject {
            object: location.object,
            ptr,
            len: location.len as usize,
            _region: region,
        })
    }

    /// The segment or file `location` lies in, mapped (segments once per client).
    fn region(&self, location: &ObjectLocation, access: Access) -> Result<Arc<dyn Region>> {
        Ok(match &location.source {
            ObjectSource::Segment { os_id } => {
                let mut segments = self
                    .segments
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                match segments.get(os_id) {
                    Some(segment) => Arc::clone(segment) as _,
                    None => {
                        let segment = Arc::new(SharedSegment::open(os_id)?);
                        segments.insert(os_id.clone(), Arc::clone(&segment));
                        segment
                    }
                }
            }
            ObjectSource::File { path } => match access {
                Access::Read => Arc::new(FileMapping::open(path)?),
                Access::Write => Arc::new(FileMapping::open_writable(path)?),
            },
            ObjectSource::Heap { store, pid } => {
                return Err(Error::NotShared {
                    object: location.object,
                    store: store.clone(),
                    pid: *pid,
                });
            }
        })
    }
}

/// Whether a location is opened to read a sealed object or to write an unsealed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    Read,
    Write,
}

/// Checks that the header at `location` names its object, with its length, and that the
/// object is sealed (or, to be written, not yet).
fn check_header(region: &dyn Region, location: &ObjectLocation, sealed: bool) -> Result<()> {
    let stale = |reason: String| Error::StaleLocation {
        object: location.object,
        reason,
    };
    let end = location
        .offset
        .checked_add(HEADER_LEN)
        .and_then(|start| start.checked_add(location.len))
        .ok_or_else(|| stale("offset and length overflow".into()))?;
    if end > region.len() as u64 {
        return Err(stale(format!(
            "bytes {}..{end} lie outside the {}-byte mapping",
            location.offset,
            region.len()
        )));
    }
    match region.header_at(location.offset) {
        Some(header)
            if header.object == location.object
                && header.len == location.len
                && header.sealed == sealed =>
        {
            Ok(())
        }
        Some(header) => Err(stale(format!(
            "found object {} of {} bytes (sealed: {}) there instead",
            header.object, header.len, header.sealed
        ))),
        // A cache shard served in place: the file is the store's own name for this object (so
        // it is the object named), and a shard is complete, so sealed, once it has a name.
        None if sealed && matches!(location.source, ObjectSource::File { .. }) => {
            match region.shard_prefix_at(location.offset) {
                Some(prefix) if prefix.len == location.len => Ok(()),
                Some(prefix) => Err(stale(format!(
                    "found a cache shard of {} bytes there instead",
                    prefix.len
                ))),
                None => Err(stale("no object header at that offset".into())),
            }
        }
        None => Err(stale("no object header at that offset".into())),
    }
}

/// An object being written, mapped in the process that writes it (see
/// [`StoreClient::open_unsealed`]).
pub struct UnsealedObject {
    object: ObjectId,
    ptr: NonNull<u8>,
    len: usize,
    /// Keeps the mapping alive.
    _region: Arc<dyn Region>,
}

impl std::fmt::Debug for UnsealedObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnsealedObject")
            .field("object", &self.object)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl UnsealedObject {
    pub fn object(&self) -> ObjectId {
        self.object
    }

    /// The object's bytes to fill in; they start 64-byte aligned.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the range lies inside the mapping `_region` keeps alive, and the store's
        // owner lets only this process write it until it is sealed (see `open_unsealed`).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}
