//! Helpers shared by the object store's integration tests.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use floe_core::ObjectId;
use floe_objectstore::{Backing, ObjectStore, StoreConfig};

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;

/// Defines each named test — a `fn(Backing)` in the enclosing module — once per backing, as
/// `on_shared_memory::<name>` and `on_heap::<name>`, so the store behaves the same in both.
macro_rules! on_every_backing {
    ($($test:ident),+ $(,)?) => {
        mod on_shared_memory {
            $(
                #[test]
                fn $test() {
                    super::$test(floe_objectstore::Backing::SharedMemory);
                }
            )+
        }
        mod on_heap {
            $(
                #[test]
                fn $test() {
                    super::$test(floe_objectstore::Backing::Heap);
                }
            )+
        }
    };
}
pub(crate) use on_every_backing;

/// A store in `backing` with its own name and directories under `dir`.
pub fn store_in(
    dir: &Path,
    capacity: u64,
    min_spilling_size: u64,
    backing: Backing,
) -> ObjectStore {
    ObjectStore::open_with(config_in(dir, capacity, min_spilling_size), backing).unwrap()
}

pub fn config_in(dir: &Path, capacity: u64, min_spilling_size: u64) -> StoreConfig {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    StoreConfig {
        name: format!(
            "test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ),
        capacity,
        spill_threshold: 0.8,
        min_spilling_size,
        spill_dir: dir.join("spill"),
        fallback_dir: dir.join("fallback"),
    }
}

/// Deterministic, id-dependent contents, so a torn or swapped object never compares equal.
pub fn contents(object: ObjectId, len: u64) -> Vec<u8> {
    let mut state = object.get() as u64 ^ 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

pub fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| entries.map(|entry| entry.unwrap().path()).collect())
        .unwrap_or_default();
    files.sort();
    files
}

/// The store's segment as it appears on the host; `None` for a store in heap memory.
pub fn shm_path(store: &ObjectStore) -> Option<PathBuf> {
    store
        .segment_name()
        .map(|os_id| PathBuf::from(format!("/dev/shm{os_id}")))
}
