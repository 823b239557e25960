//! floe-objectstore: a node's memory pools and its shared-memory object store.
//!
//! - [`MemoryPools`]: how the node's memory splits into object store, system reserve and heap.
//! - [`ObjectStore`]: immutable objects in one long-lived region of memory, with reference
//!   counts, pins, spilling to disk past a threshold, transparent restore, and disk-backed
//!   fallback allocation when memory is full of pinned objects.
//! - [`Backing`]: what that region is. [`ObjectStore::open`] uses a shared-memory segment (what
//!   a node runs on); [`ObjectStore::open_with`]`(config, Backing::Heap)` puts the same store
//!   in the process's heap, for tests that need no /dev/shm and no second process. The store
//!   reaches its memory through one internal trait, `Region` (base address, length, how a
//!   reader reaches it), so everything but cross-process reading behaves the same on both.
//! - [`ObjectView`] / [`StoreClient`]: zero-copy read access, in the store's process or in any
//!   other process on the host that is given an object's [`ObjectLocation`] (shared-memory
//!   and fallback-file locations only: heap memory is private to the store's process).
//! - [`block`]: Arrow record batches as IPC objects, decoded without copying column data.
//! - [`cache`]: the fingerprint cache: operator outputs as verified shard files, reused by
//!   fingerprint, with LRU eviction under a size cap and explanations for misses.
//!   [`ObjectStore::adopt_shard`] serves a shard as an object in place: the object's bytes
//!   are the shard file's, mapped, not copied.

mod adopt;
mod alloc;
pub mod block;
pub mod cache;
mod mapping;
mod pools;
mod region;
mod spill;
mod store;
mod view;

use std::path::PathBuf;

use floe_core::ObjectId;

pub use adopt::Adoption;
pub use pools::MemoryPools;
pub use region::Backing;
pub use store::{
    FileAudit, ObjectInfo, ObjectStore, ObjectWriter, Residence, StoreConfig, StoreStats,
};
pub use view::{ObjectLocation, ObjectSource, ObjectView, StoreClient, UnsealedObject};

/// Everything the object store can fail with. Messages name the object and the sizes involved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "a node with {total} bytes of memory cannot hold an object store of {object_store} bytes \
         and a system reserve of {system_reserve} bytes and still have heap left; set \
         memory.total or lower memory.object_store_min"
    )]
    NotEnoughMemory {
        total: u64,
        object_store: u64,
        system_reserve: u64,
    },
    #[error("cannot detect the host's memory: {reason}")]
    MemoryDetection { reason: String },
    #[error(
        "store name {name:?} is not usable: use 1 to 200 ASCII letters, digits, '-', '_' or '.'"
    )]
    InvalidStoreName { name: String },
    #[error("an object store of {capacity} bytes is too small to hold any object")]
    CapacityTooSmall { capacity: u64 },
    #[error(
        "an object store of {capacity} bytes does not fit in /dev/shm, which has {available} \
         bytes free; enlarge /dev/shm (e.g. docker --shm-size) or lower memory.object_store_fraction"
    )]
    SharedMemoryTooSmall { capacity: u64, available: u64 },
    #[error("cannot {action} shared memory segment {name}: {reason}")]
    SharedMemory {
        name: String,
        action: &'static str,
        reason: String,
    },
    #[error("cannot allocate {len} bytes of heap memory for in-memory store {store}")]
    HeapMemory { store: String, len: u64 },
    #[error(
        "object {object} is in the heap memory of in-memory store {store} (process {pid}), which \
         other processes cannot map; open the store with shared memory to share its objects"
    )]
    NotShared {
        object: ObjectId,
        store: String,
        pid: u32,
    },
    #[error("object {object} already exists")]
    AlreadyExists { object: ObjectId },
    #[error("object {object} not found")]
    NotFound { object: ObjectId },
    #[error("object {object} is still being written (not sealed)")]
    NotSealed { object: ObjectId },
    #[error(
        "object {object} of {size} bytes is larger than the object store ({capacity} bytes) and \
         could not be put on disk either ({} bytes free there): {problem}",
        disk_available.map_or_else(|| "unknown".to_owned(), |free| free.to_string())
    )]
    ObjectTooLarge {
        object: ObjectId,
        size: u64,
        capacity: u64,
        disk_available: Option<u64>,
        problem: String,
    },
    #[error(
        "object store full: cannot create object {object} of {size} bytes with {used} of \
         {capacity} bytes in use by objects that cannot be spilled{}; fallback to disk failed: \
         {fallback_problem}",
        spill_problem.as_ref().map(|problem| format!(" (spilling failed: {problem})")).unwrap_or_default()
    )]
    ObjectStoreFull {
        object: ObjectId,
        size: u64,
        capacity: u64,
        used: u64,
        spill_problem: Option<String>,
        fallback_problem: String,
    },
    #[error(
        "disk full: {} needs {needed} bytes but its file system has {} bytes free",
        path.display(),
        available.map_or_else(|| "an unknown number of".to_owned(), |free| free.to_string())
    )]
    DiskFull {
        path: PathBuf,
        needed: u64,
        available: Option<u64>,
    },
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "spill file {} is corrupt at byte {offset}, where object {object} was spilled: {problem}",
        path.display()
    )]
    CorruptSpill {
        object: ObjectId,
        path: PathBuf,
        offset: u64,
        problem: String,
    },
    #[error(
        "cache shard {} changed after it was checked (another writer replaced it); check it again",
        path.display()
    )]
    ShardChanged { path: PathBuf },
    #[error("location of object {object} is stale: {reason}")]
    StaleLocation { object: ObjectId, reason: String },
    #[error(transparent)]
    Cache(#[from] cache::CacheError),
    #[error("object {object} is not a valid Arrow block: {source}")]
    Block {
        object: ObjectId,
        source: arrow::error::ArrowError,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
