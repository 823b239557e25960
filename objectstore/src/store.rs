//! The object store of one node.
//!
//! All objects live in one region of memory of the store's capacity, created when the store
//! opens and kept for its lifetime: a shared-memory segment, or heap memory for tests
//! ([`Backing`]). Objects are ranges of it handed out by an [`Allocator`], so a new object
//! reuses pages an old one already touched instead of faulting in fresh memory. An object is
//! created, written through an [`ObjectWriter`], and sealed; from then on it is immutable, and
//! (in shared memory) any process on the host can map it from its [`ObjectLocation`].
//!
//! Lifetime: an object has reference counts (held by its owner, normally the job driver;
//! [`ObjectStore::add_ref`]/[`ObjectStore::remove_ref`]) and pins (one per live
//! [`ObjectView`]). It is freed once it has no references left, or was
//! [deleted](ObjectStore::delete), and no view pins it.
//!
//! Memory pressure: before an allocation would take the store's memory past
//! `spill_threshold`, the least recently used sealed, unpinned objects are written to spill
//! files (fused until a file holds `min_spilling_size`) and their memory is freed; a later
//! [`ObjectStore::get`] restores them. When nothing can be spilled — everything is pinned or
//! being written — the object is created in a mapped file in the fallback directory instead,
//! and only if that fails too does creation fail with [`Error::ObjectStoreFull`].
//!
//! Spilling runs on the thread that needs the memory, without the store's lock held during
//! disk I/O, so a producer that outruns the disk is slowed down rather than failing.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use floe_core::hash::xxh3_64;
use floe_core::{Config, ObjectId};
use serde::{Deserialize, Serialize};

use crate::alloc::{Allocator, aligned};
use crate::mapping::{FileMapping, HEADER_LEN, Header, SharedSegment, available_space};
use crate::pools::MemoryPools;
use crate::region::{Backing, Region};
use crate::spill::{SpillSlot, write_spill_file};
use crate::view::{ObjectLocation, ObjectSource, ObjectView};
use crate::{Error, Result};

/// What an [`ObjectStore`] needs to open.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    /// Names the shared-memory segment (`/floe-<name>`) and the store's spill and fallback
    /// files; unique among the stores on one host. ASCII letters, digits, `-`, `_` and `.`.
    pub name: String,
    /// Bytes of memory for objects, headers included.
    pub capacity: u64,
    /// Share of `capacity` past which objects are spilled, in (0, 1].
    pub spill_threshold: f64,
    /// Smallest spill file, unless fewer bytes can be spilled.
    pub min_spilling_size: u64,
    pub spill_dir: PathBuf,
    pub fallback_dir: PathBuf,
}

impl StoreConfig {
    /// A node's store: its capacity is the node's object-store pool.
    pub fn for_node(config: &Config, pools: &MemoryPools, name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            capacity: pools.object_store,
            spill_threshold: config.memory.spill_threshold,
            min_spilling_size: config.memory.min_spilling_size.bytes(),
            spill_dir: config.paths.spill_dir(),
            fallback_dir: config.paths.fallback_dir(),
        }
    }

    /// The file of a fallback object, or the store's link to a cache shard served as `object`.
    pub(crate) fn object_file(&self, object: ObjectId) -> PathBuf {
        self.fallback_dir
            .join(format!("{}-{object}.object", self.name))
    }
}

/// A snapshot of the store's use, for the node to report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreStats {
    pub capacity: u64,
    /// Memory allocated to objects, headers included.
    pub used: u64,
    pub objects_in_memory: u64,
    /// Objects some view reads now: they can be neither spilled nor freed.
    pub pinned_bytes: u64,
    pub pinned_objects: u64,
    /// Bytes and objects whose copy is in a spill file now (an object restored to memory keeps
    /// its spilled copy until freed, so evicting it again costs no write).
    pub spilled_bytes: u64,
    pub spilled_objects: u64,
    /// Bytes written to spill files and read back from them since the store opened.
    pub spilled_bytes_total: u64,
    pub restored_bytes_total: u64,
    /// Objects held in disk-backed fallback files now.
    pub fallback_bytes: u64,
    pub fallback_objects: u64,
    /// Objects that are cache shard files served in place now: pages of the page cache, not
    /// of the store.
    pub shard_bytes: u64,
    pub shard_objects: u64,
}

/// Where an object's bytes are now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residence {
    Memory,
    Spilled,
    Fallback,
    /// A cache shard file served in place.
    CacheShard,
}

/// One object as [`ObjectStore::largest`] lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectInfo {
    pub object: ObjectId,
    pub size: u64,
    pub residence: Residence,
    /// Views reading it now.
    pub pins: u64,
}

/// A node's object store, in shared memory (or heap memory, for tests). Cheap to clone; all
/// clones are the same store.
#[derive(Clone, Debug)]
pub struct ObjectStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    config: StoreConfig,
    /// Where objects live unless they are spilled or in fallback files.
    memory: Arc<dyn Region>,
    state: Mutex<State>,
    /// Signalled whenever a spill or restore finishes.
    io_finished: Condvar,
    next_file: AtomicU64,
}

#[derive(Debug)]
struct State {
    allocator: Allocator,
    objects: HashMap<ObjectId, Entry>,
    /// Sealed objects in memory by last use (a logical clock), oldest first.
    lru: BTreeMap<u64, ObjectId>,
    clock: u64,
    spilled_bytes_total: u64,
    restored_bytes_total: u64,
}

#[derive(Debug)]
struct Entry {
    size: u64,
    sealed: bool,
    /// Header offset in the store's memory.
    memory: Option<u64>,
    /// A fallback object's file, or a cache shard served in place (`adopt_shard`).
    fallback: Option<Arc<FileMapping>>,
    spilled: Option<SpillSlot>,
    refs: u64,
    pins: u64,
    io: Option<Io>,
    /// Its [`ObjectWriter`] is alive: someone (this process, or a worker it handed the
    /// location to) may still write its range, so the range is not freed even if the object
    /// is deleted meanwhile.
    writing: bool,
    deleted: bool,
    last_used: u64,
    /// The payload's xxh3-64 when whoever sealed it knew it, so a transfer need not hash the
    /// object again.
    checksum: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Io {
    Spilling,
    Restoring,
}

/// Where a new or restored object's bytes go.
enum Placement {
    Memory(u64),
    Fallback(Arc<FileMapping>),
}

/// Bytes an object of `size` takes in the store's memory.
fn region_len(object: ObjectId, size: u64) -> Result<u64> {
    aligned(size)
        .and_then(|payload| payload.checked_add(HEADER_LEN))
        .ok_or_else(|| Error::ObjectTooLarge {
            object,
            size,
            capacity: 0,
            disk_available: None,
            problem: "the size overflows a 64-bit offset".into(),
        })
}

impl ObjectStore {
    /// Creates the store's shared-memory segment (`/floe-<name>`) and its spill and fallback
    /// directories.
    pub fn open(config: StoreConfig) -> Result<Self> {
        Self::open_with(config, Backing::SharedMemory)
    }

    /// Opens the store with its memory in `backing`: [`Backing::Heap`] gives a store that
    /// behaves the same in its own process but cannot be read from others.
    pub fn open_with(config: StoreConfig, backing: Backing) -> Result<Self> {
        check_name(&config.name)?;
        let allocator = Allocator::new(config.capacity);
        if allocator.capacity() < HEADER_LEN * 2 {
            return Err(Error::CapacityTooSmall {
                capacity: config.capacity,
            });
        }
        for dir in [&config.spill_dir, &config.fallback_dir] {
            std::fs::create_dir_all(dir).map_err(|source| Error::Io {
                action: "create a directory",
                path: dir.clone(),
                source,
            })?;
        }
        let capacity =
            usize::try_from(allocator.capacity()).map_err(|_| Error::CapacityTooSmall {
                capacity: config.capacity,
            })?;
        remove_leftovers(&config)?;
        let memory = backing.create(&config.name, capacity)?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                memory,
                state: Mutex::new(State {
                    allocator,
                    objects: HashMap::new(),
                    lru: BTreeMap::new(),
                    clock: 0,
                    spilled_bytes_total: 0,
                    restored_bytes_total: 0,
                }),
                io_finished: Condvar::new(),
                next_file: AtomicU64::new(0),
            }),
        })
    }

    pub fn config(&self) -> &StoreConfig {
        &self.inner.config
    }

    /// The shared-memory segment's os id, which readers in other processes open; `None` for a
    /// store in heap memory.
    pub fn segment_name(&self) -> Option<String> {
        match self.inner.memory.source() {
            ObjectSource::Segment { os_id } => Some(os_id),
            ObjectSource::File { .. } | ObjectSource::Heap { .. } => None,
        }
    }

    /// Starts a new object of `size` bytes with one reference, for this process to write. Its
    /// bytes are written through the returned writer and become readable when it is sealed;
    /// dropping the writer unsealed abandons the object. Its pages are mapped in ahead, so a
    /// store whose /dev/shm has filled up since it was made refuses here.
    pub fn create(&self, object: ObjectId, size: u64) -> Result<ObjectWriter> {
        self.create_written_by(object, size, WrittenBy::ThisProcess)
    }

    /// [`Self::create`] for an object another process writes, through its location
    /// ([`StoreClient::open_unsealed`](crate::StoreClient::open_unsealed)), which maps the
    /// pages it writes in itself. Only the header's are mapped in here.
    pub fn create_for_another_process(&self, object: ObjectId, size: u64) -> Result<ObjectWriter> {
        self.create_written_by(object, size, WrittenBy::AnotherProcess)
    }

    fn create_written_by(
        &self,
        object: ObjectId,
        size: u64,
        written_by: WrittenBy,
    ) -> Result<ObjectWriter> {
        let inner = &self.inner;
        let mut state = inner.lock();
        if state.objects.contains_key(&object) {
            return Err(Error::AlreadyExists { object });
        }
        state.objects.insert(
            object,
            Entry {
                size,
                sealed: false,
                memory: None,
                fallback: None,
                spilled: None,
                refs: 1,
                pins: 0,
                io: None,
                writing: true,
                deleted: false,
                last_used: 0,
                checksum: None,
            },
        );
        let (mut state, placed) = inner.place(state, object, size);
        let placement = match placed {
            Ok(placement) => placement,
            Err(error) => {
                state.objects.remove(&object);
                return Err(error);
            }
        };
        let (header_offset, region): (u64, Arc<dyn Region>) = match placement {
            Placement::Memory(offset) => {
                if let Some(entry) = state.objects.get_mut(&object) {
                    entry.memory = Some(offset);
                }
                (offset, Arc::clone(&inner.memory))
            }
            Placement::Fallback(mapping) => {
                if let Some(entry) = state.objects.get_mut(&object) {
                    entry.fallback = Some(Arc::clone(&mapping));
                }
                (0, mapping)
            }
        };
        drop(state);
        // SAFETY: `header_offset + HEADER_LEN + size` lies inside the region (the range was
        // sized by `region_len`).
        let payload = unsafe { region.payload(header_offset) }.as_ptr();
        // Dropped unsealed, as on any error below, it abandons the object and frees its range.
        let writer = ObjectWriter {
            inner: Arc::clone(inner),
            object,
            payload,
            size: size as usize,
            header_offset,
            region,
            sealed: false,
        };
        let populated_len = match written_by {
            WrittenBy::ThisProcess => HEADER_LEN + size,
            WrittenBy::AnotherProcess => HEADER_LEN,
        };
        writer
            .region
            .populate_for_write(header_offset, populated_len)?;
        let header = Header {
            object,
            len: size,
            sealed: false,
            checksum: 0,
        };
        // SAFETY: the range was just allocated to this object and nobody else writes it.
        unsafe { writer.region.write_header(header_offset, &header) };
        Ok(writer)
    }

    /// Creates, writes and seals an object holding `bytes`.
    pub fn put(&self, object: ObjectId, bytes: &[u8]) -> Result<()> {
        let mut writer = self.create(object, bytes.len() as u64)?;
        writer.as_mut_slice().copy_from_slice(bytes);
        writer.seal()
    }

    /// Like [`Self::put`], also hashing `bytes`: returns their xxh3-64, which
    /// [`Self::checksum`] answers from then on.
    pub fn put_checksummed(&self, object: ObjectId, bytes: &[u8]) -> Result<u64> {
        let checksum = xxh3_64(bytes);
        let mut writer = self.create(object, bytes.len() as u64)?;
        writer.as_mut_slice().copy_from_slice(bytes);
        writer.seal_with_checksum(checksum)?;
        Ok(checksum)
    }

    /// Registers `mapping`, whose payload of `size` bytes follows its first [`HEADER_LEN`] and
    /// has the xxh3-64 `checksum`, as the sealed `object` with one reference.
    pub(crate) fn insert_file_object(
        &self,
        object: ObjectId,
        size: u64,
        mapping: Arc<FileMapping>,
        checksum: u64,
    ) -> Result<()> {
        let mut state = self.inner.lock();
        if state.objects.contains_key(&object) {
            return Err(Error::AlreadyExists { object });
        }
        let last_used = state.tick();
        state.objects.insert(
            object,
            Entry {
                size,
                sealed: true,
                memory: None,
                fallback: Some(mapping),
                spilled: None,
                refs: 1,
                pins: 0,
                io: None,
                deleted: false,
                writing: false,
                last_used,
                checksum: Some(checksum),
            },
        );
        Ok(())
    }

    /// The xxh3-64 of a live object's payload, if it was recorded when it was sealed.
    pub fn checksum(&self, object: ObjectId) -> Option<u64> {
        self.inner
            .lock()
            .live_entry(object)
            .ok()
            .and_then(|entry| entry.checksum)
    }

    /// A sealed object's size and xxh3-64: the checksum recorded when it was sealed, else one
    /// computed from its bytes.
    pub fn size_and_checksum(&self, object: ObjectId) -> Result<(u64, u64)> {
        let view = self.get(object)?;
        let checksum = self
            .checksum(object)
            .unwrap_or_else(|| xxh3_64(view.as_bytes()));
        Ok((view.len() as u64, checksum))
    }

    /// A read-only view of a sealed object, restoring it from its spill file if needed. The
    /// object stays pinned in memory (neither spilled nor freed) while the view or any clone
    /// of it, or any Arrow buffer made from it, is alive.
    pub fn get(&self, object: ObjectId) -> Result<ObjectView> {
        let inner = &self.inner;
        let mut state = inner.lock();
        loop {
            let tick = state.tick();
            let Some(entry) = state
                .objects
                .get_mut(&object)
                .filter(|entry| !entry.deleted)
            else {
                return Err(Error::NotFound { object });
            };
            if !entry.sealed {
                return Err(Error::NotSealed { object });
            }
            if entry.io == Some(Io::Restoring) {
                state = inner.wait(state);
                continue;
            }
            let size = entry.size;
            if let Some(offset) = entry.memory {
                entry.pins += 1;
                let previous = std::mem::replace(&mut entry.last_used, tick);
                state.lru.remove(&previous);
                state.lru.insert(tick, object);
                return Ok(inner.view(object, size, offset, None));
            }
            if let Some(mapping) = &entry.fallback {
                entry.pins += 1;
                let mapping = Arc::clone(mapping);
                return Ok(inner.view(object, size, 0, Some(mapping)));
            }
            let Some(slot) = entry.spilled.clone() else {
                return Err(Error::NotFound { object });
            };
            entry.io = Some(Io::Restoring);
            entry.pins += 1;
            return inner.restore(state, object, size, slot);
        }
    }

    /// Spills the least recently used unpinned objects until at least `bytes` of memory are
    /// freed or nothing more can be spilled, as if an allocation needed the room (a node under
    /// memory pressure sheds memory this way). Returns the bytes freed.
    pub fn spill(&self, bytes: u64) -> Result<u64> {
        let mut state = self.inner.lock();
        let before = state.allocator.used();
        loop {
            let freed = before - state.allocator.used().min(before);
            if freed >= bytes {
                return Ok(freed);
            }
            let (next, progress) = self.inner.spill(state, bytes - freed);
            state = next;
            if !progress? {
                return Ok(before - state.allocator.used().min(before));
            }
        }
    }

    /// Adds a reference to an object.
    pub fn add_ref(&self, object: ObjectId) -> Result<()> {
        let mut state = self.inner.lock();
        let entry = state.live_entry(object)?;
        entry.refs += 1;
        Ok(())
    }

    /// Drops a reference; the object is freed when none remain and no view pins it. Returns
    /// the references left.
    pub fn remove_ref(&self, object: ObjectId) -> Result<u64> {
        let mut state = self.inner.lock();
        let entry = state.live_entry(object)?;
        entry.refs = entry.refs.saturating_sub(1);
        let left = entry.refs;
        state.free_if_unused(object);
        Ok(left)
    }

    /// Deletes an object whatever its reference count: it disappears at once for new
    /// [`get`](Self::get)s, and its space is reclaimed when the last view of it is dropped.
    pub fn delete(&self, object: ObjectId) -> Result<()> {
        let mut state = self.inner.lock();
        let entry = state.live_entry(object)?;
        entry.deleted = true;
        state.free_if_unused(object);
        Ok(())
    }

    /// Brings back a deleted object that a view still pins: its bytes are intact (objects are
    /// immutable), so whoever needs the same object again need not write it again, and could
    /// not (the id is taken until the last view goes). Returns whether it did.
    pub fn revive(&self, object: ObjectId) -> bool {
        let mut state = self.inner.lock();
        match state.objects.get_mut(&object) {
            Some(entry) if entry.deleted && entry.sealed => {
                entry.deleted = false;
                entry.refs = entry.refs.max(1);
                true
            }
            _ => false,
        }
    }

    /// Whether a live (not deleted) object with this id exists, sealed or not.
    pub fn contains(&self, object: ObjectId) -> bool {
        self.inner
            .lock()
            .objects
            .get(&object)
            .is_some_and(|entry| !entry.deleted)
    }

    /// The bytes of the store's memory that hold pages now (every page ever written: freed
    /// objects' pages stay for reuse): what the store costs the host, counted once however
    /// many processes map it. `None` for a heap-backed store, whose process's heap counts it.
    pub fn resident_bytes(&self) -> Option<u64> {
        self.inner.memory.resident_bytes()
    }

    pub fn stats(&self) -> StoreStats {
        let state = self.inner.lock();
        let mut stats = StoreStats {
            capacity: state.allocator.capacity(),
            used: state.allocator.used(),
            spilled_bytes_total: state.spilled_bytes_total,
            restored_bytes_total: state.restored_bytes_total,
            ..StoreStats::default()
        };
        for entry in state.objects.values() {
            if entry.memory.is_some() {
                stats.objects_in_memory += 1;
            }
            if entry.pins > 0 {
                stats.pinned_bytes += entry.size;
                stats.pinned_objects += 1;
            }
            if let Some(slot) = &entry.spilled {
                stats.spilled_bytes += slot.len();
                stats.spilled_objects += 1;
            }
            match &entry.fallback {
                Some(mapping) if mapping.is_shard() => {
                    stats.shard_bytes += entry.size;
                    stats.shard_objects += 1;
                }
                Some(_) => {
                    stats.fallback_bytes += entry.size;
                    stats.fallback_objects += 1;
                }
                None => {}
            }
        }
        stats
    }

    /// The `count` largest live objects, largest first (ties by id), for operators.
    pub fn largest(&self, count: usize) -> Vec<ObjectInfo> {
        let state = self.inner.lock();
        // A bounded heap of the largest seen so far: one pass, `count` entries held.
        let mut largest: std::collections::BinaryHeap<std::cmp::Reverse<(u64, ObjectId)>> =
            std::collections::BinaryHeap::with_capacity(count + 1);
        for (object, entry) in &state.objects {
            if entry.deleted || !entry.sealed {
                continue;
            }
            largest.push(std::cmp::Reverse((entry.size, *object)));
            if largest.len() > count {
                largest.pop();
            }
        }
        let mut found: Vec<ObjectInfo> = largest
            .into_iter()
            .filter_map(|std::cmp::Reverse((_, object))| {
                let entry = state.objects.get(&object)?;
                Some(ObjectInfo {
                    object,
                    size: entry.size,
                    residence: match (&entry.memory, &entry.fallback) {
                        (Some(_), _) => Residence::Memory,
                        (None, Some(mapping)) if mapping.is_shard() => Residence::CacheShard,
                        (None, Some(_)) => Residence::Fallback,
                        (None, None) => Residence::Spilled,
                    },
                    pins: entry.pins,
                })
            })
            .collect();
        found.sort_by(|a, b| b.size.cmp(&a.size).then(a.object.cmp(&b.object)));
        found
    }

    /// The spill file holding an object's spilled copy, if it has one.
    pub fn spill_path(&self, object: ObjectId) -> Option<PathBuf> {
        let state = self.inner.lock();
        let slot = state.objects.get(&object)?.spilled.as_ref()?;
        Some(slot.path().to_owned())
    }

    /// Compares the files named for this store in its spill and fallback directories with the
    /// files its live objects hold. They are the same unless a file outlived its objects (or
    /// went missing under them) — or a spill is being written right now, whose file exists
    /// before any object holds it: audit a store at rest.
    pub fn audit_files(&self) -> Result<FileAudit> {
        // Files are removed when their last object goes, which happens under this lock: with
        // it held, the listing and the objects describe one moment.
        let state = self.inner.lock();
        let mut held = BTreeSet::new();
        for entry in state.objects.values() {
            if let Some(slot) = &entry.spilled {
                held.insert(slot.path().to_owned());
            }
            if let Some(mapping) = &entry.fallback {
                held.insert(mapping.path().to_owned());
            }
        }
        let config = &self.inner.config;
        let on_disk = files_of_store(&config.name, &config.spill_dir, &config.fallback_dir)?;
        Ok(FileAudit { held, on_disk })
    }

    /// Removes what a dead store named `config.name` left behind: its shared-memory segment,
    /// and its spill and fallback files in `config`'s directories (a node restarted after
    /// SIGKILL cleans up after its predecessor this way). Returns what it removed. Store names
    /// are unique among live stores on a host, so the caller must know that store is dead.
    pub fn remove_dead_store(config: &StoreConfig) -> Result<Vec<PathBuf>> {
        check_name(&config.name)?;
        let mut removed = remove_leftovers(config)?;
        removed.extend(SharedSegment::remove_dead_store(&config.name)?);
        Ok(removed)
    }
}

/// What [`ObjectStore::audit_files`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileAudit {
    /// Spill and fallback files that the store's live objects hold.
    pub held: BTreeSet<PathBuf>,
    /// Files named for the store in its spill and fallback directories.
    pub on_disk: BTreeSet<PathBuf>,
}

impl FileAudit {
    /// Files on disk that no live object holds: space nothing will ever free.
    pub fn stray(&self) -> Vec<&PathBuf> {
        self.on_disk.difference(&self.held).collect()
    }

    /// Files live objects hold that are gone from disk.
    pub fn missing(&self) -> Vec<&PathBuf> {
        self.held.difference(&self.on_disk).collect()
    }
}

fn check_name(name: &str) -> Result<()> {
    let name_ok = !name.is_empty()
        && name.len() <= 200
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if name_ok {
        Ok(())
    } else {
        Err(Error::InvalidStoreName {
            name: name.to_owned(),
        })
    }
}

/// The files of store `name`: `<name>-<number>.spill` in `spill_dir` and
/// `<name>-<object id>.object` in `fallback_dir`, and not another store's files whose name
/// merely starts with this one's. A directory that does not exist holds none.
fn files_of_store(name: &str, spill_dir: &Path, fallback_dir: &Path) -> Result<BTreeSet<PathBuf>> {
    let prefix = format!("{name}-");
    let mut files = BTreeSet::new();
    for (dir, suffix) in [(spill_dir, ".spill"), (fallback_dir, ".object")] {
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(Error::Io {
                    action: "list a directory",
                    path: dir.to_owned(),
                    source,
                });
            }
        };
        for entry in entries {
            let entry = entry.map_err(|source| Error::Io {
                action: "list a directory",
                path: dir.to_owned(),
                source,
            })?;
            let file_name = entry.file_name();
            let Some(middle) = file_name
                .to_str()
                .and_then(|file_name| file_name.strip_prefix(&prefix))
                .and_then(|rest| rest.strip_suffix(suffix))
            else {
                continue;
            };
            let ours = match suffix {
                ".spill" => !middle.is_empty() && middle.bytes().all(|b| b.is_ascii_digit()),
                _ => middle.parse::<ObjectId>().is_ok(),
            };
            if ours {
                files.insert(entry.path());
            }
        }
    }
    Ok(files)
}

/// Removes the spill and fallback files a previous store of the same name left when its
/// process died, and returns them. Store names are unique among live stores on a host, so
/// anything under this name belongs to a dead one.
fn remove_leftovers(config: &StoreConfig) -> Result<Vec<PathBuf>> {
    let files = files_of_store(&config.name, &config.spill_dir, &config.fallback_dir)?;
    for path in &files {
        tracing::warn!(path = %path.display(), "removing a file left by a dead store");
        std::fs::remove_file(path).map_err(|source| Error::Io {
            action: "remove a leftover file",
            path: path.clone(),
            source,
        })?;
    }
    Ok(files.into_iter().collect())
}

impl State {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn live_entry(&mut self, object: ObjectId) -> Result<&mut Entry> {
        self.objects
            .get_mut(&object)
            .filter(|entry| !entry.deleted)
            .ok_or(Error::NotFound { object })
    }

    /// Frees memory held by `object`'s in-memory copy.
    fn evict(&mut self, object: ObjectId) {
        let Some(entry) = self.objects.get_mut(&object) else {
            return;
        };
        if let Some(offset) = entry.memory.take() {
            let last_used = entry.last_used;
            let size = entry.size;
            self.lru.remove(&last_used);
            if let Ok(len) = region_len(object, size) {
                self.allocator.free(offset, len);
            }
        }
    }

    /// Removes `object` and releases everything it holds, if it is no longer wanted and
    /// nothing is using it.
    fn free_if_unused(&mut self, object: ObjectId) {
        let unused = self.objects.get(&object).is_some_and(|entry| {
            (entry.deleted || entry.refs == 0)
                && entry.pins == 0
                && entry.io.is_none()
                && !entry.writing
        });
        if unused {
            self.evict(object);
            // Dropping the entry drops its fallback mapping (removing the file) and its spill
            // slot (removing the spill file with its last slot).
            self.objects.remove(&object);
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the bookkeeping as it was between two complete
        // updates (every update is a few field writes with no early exit), so keep going.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn wait<'a>(&self, state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.io_finished
            .wait(state)
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn view(
        self: &Arc<Self>,
        object: ObjectId,
        size: u64,
        header_offset: u64,
        fallback: Option<Arc<FileMapping>>,
    ) -> ObjectView {
        let region: Arc<dyn Region> = match &fallback {
            Some(mapping) => Arc::clone(mapping) as _,
            None => Arc::clone(&self.memory),
        };
        let pin = Arc::new(Pin {
            inner: Arc::clone(self),
            object,
            _fallback: fallback,
        });
        let location = ObjectLocation {
            object,
            source: region.source(),
            offset: header_offset,
            len: size,
        };
        // SAFETY: the object is sealed and pinned by `pin`, so its range stays allocated and
        // unchanged for as long as the view (which owns `pin`) lives.
        unsafe { ObjectView::new(location, region.as_ref(), pin) }
    }

    /// Finds room for `need` bytes of a new or restored object: memory, after spilling what it
    /// takes to stay under the threshold; or a fallback file when memory cannot be had.
    fn place<'a>(
        &'a self,
        mut state: MutexGuard<'a, State>,
        object: ObjectId,
        size: u64,
    ) -> (MutexGuard<'a, State>, Result<Placement>) {
        let need = match region_len(object, size) {
            Ok(need) => need,
            Err(error) => return (state, Err(error)),
        };
        let capacity = state.allocator.capacity();
        let threshold = (capacity as f64 * self.config.spill_threshold) as u64;
        let mut spill_error = None;
        // An object larger than the store's memory can only go to a fallback file.
        if need <= capacity {
            loop {
                let over = (state.allocator.used() + need).saturating_sub(threshold);
                if over > 0 && spill_error.is_none() {
                    let (next, progress) = self.spill(state, over);
                    state = next;
                    match progress {
                        Ok(true) => continue,
                        Ok(false) => {}
                        Err(error) => spill_error = Some(error),
                    }
                }
                if let Some(offset) = state.allocator.allocate(need) {
                    return (state, Ok(Placement::Memory(offset)));
                }
                if spill_error.is_none() {
                    let (next, progress) = self.spill(state, need);
                    state = next;
                    match progress {
                        Ok(true) => continue,
                        Ok(false) => {}
                        Err(error) => spill_error = Some(error),
                    }
                }
                // Another thread may be spilling right now; its memory is about to come free.
                let spilling = state
                    .objects
                    .values()
                    .any(|entry| entry.io == Some(Io::Spilling));
                if !spilling {
                    break;
                }
                state = self.wait(state);
            }
        }
        let used = state.allocator.used();
        drop(state);
        let path = self.config.object_file(object);
        let created = FileMapping::create(&path, need);
        let state = self.lock();
        let placement = match created {
            Ok(mapping) => Ok(Placement::Fallback(Arc::new(mapping))),
            Err(fallback_error) if need > capacity => Err(Error::ObjectTooLarge {
                object,
                size,
                capacity,
                disk_available: available_space(&self.config.fallback_dir),
                problem: fallback_error.to_string(),
            }),
            Err(fallback_error) => Err(Error::ObjectStoreFull {
                object,
                size,
                capacity,
                used,
                spill_problem: spill_error.map(|error| error.to_string()),
                fallback_problem: fallback_error.to_string(),
            }),
        };
        (state, placement)
    }

    /// Frees at least `wanted` bytes of memory if it can, spilling the least recently used
    /// sealed, unpinned objects (fused into one file of at least `min_spilling_size`, or what
    /// there is). Objects that already have a spilled copy are just evicted. Returns whether any
    /// memory was freed.
    fn spill<'a>(
        &'a self,
        mut state: MutexGuard<'a, State>,
        wanted: u64,
    ) -> (MutexGuard<'a, State>, Result<bool>) {
        let mut freed = 0u64;
        let mut batch: Vec<(ObjectId, u64, u64)> = Vec::new();
        let mut batch_bytes = 0u64;
        let candidates: Vec<ObjectId> = state.lru.values().copied().collect();
        for object in candidates {
            let enough = freed + batch_bytes >= wanted
                && (batch.is_empty() || batch_bytes >= self.config.min_spilling_size);
            if enough {
                break;
            }
            let Some(entry) = state.objects.get_mut(&object) else {
                continue;
            };
            let Some(offset) = entry.memory else {
                continue;
            };
            if entry.pins > 0 || entry.io.is_some() || !entry.sealed {
                continue;
            }
            let region = region_len(object, entry.size).unwrap_or(0);
            if entry.spilled.is_some() {
                state.evict(object);
                freed += region;
            } else {
                entry.io = Some(Io::Spilling);
                batch.push((object, offset, entry.size));
                batch_bytes += region;
            }
        }
        if batch.is_empty() {
            return (state, Ok(freed > 0));
        }
        drop(state);

        let number = self.next_file.fetch_add(1, Ordering::Relaxed);
        let path = self
            .config
            .spill_dir
            .join(format!("{}-{number:06}.spill", self.config.name));
        let base = self.memory.base().as_ptr();
        let payloads: Vec<(ObjectId, &[u8])> = batch
            .iter()
            .map(|&(object, offset, size)| {
                // SAFETY: the object is sealed and marked `Spilling`, which keeps its range
                // allocated and unchanged until the mark is cleared below.
                let bytes = unsafe {
                    std::slice::from_raw_parts(
                        base.add((offset + HEADER_LEN) as usize),
                        size as usize,
                    )
                };
                (object, bytes)
            })
            .collect();
        let written = write_spill_file(&path, &payloads);

        let mut state = self.lock();
        let result = match written {
            Ok(slots) => {
                for ((object, _, size), slot) in batch.iter().zip(slots) {
                    state.spilled_bytes_total += size;
                    let Some(entry) = state.objects.get_mut(object) else {
                        continue;
                    };
                    entry.io = None;
                    entry.spilled = Some(slot);
                    // A reader that pinned the object meanwhile keeps the memory copy alive.
                    if entry.pins == 0 {
                        state.evict(*object);
                        freed += region_len(*object, *size).unwrap_or(0);
                    }
                    state.free_if_unused(*object);
                }
                Ok(freed > 0)
            }
            Err(error) => {
                for (object, _, _) in &batch {
                    if let Some(entry) = state.objects.get_mut(object) {
                        entry.io = None;
                    }
                    state.free_if_unused(*object);
                }
                tracing::warn!(%error, "spilling failed");
                Err(error)
            }
        };
        self.io_finished.notify_all();
        (state, result)
    }

    /// Reads a spilled object back. The caller has marked it `Restoring` and pinned it for the
    /// view this returns.
    fn restore<'a>(
        self: &'a Arc<Self>,
        state: MutexGuard<'a, State>,
        object: ObjectId,
        size: u64,
        slot: SpillSlot,
    ) -> Result<ObjectView> {
        let (state, placed) = self.place(state, object, size);
        let placement = match placed {
            Ok(placement) => placement,
            Err(error) => {
                self.finish_restore_failed(state, object);
                return Err(error);
            }
        };
        drop(state);
        let (region, header_offset): (Arc<dyn Region>, u64) = match &placement {
            Placement::Memory(offset) => (Arc::clone(&self.memory), *offset),
            Placement::Fallback(mapping) => (Arc::clone(mapping) as _, 0),
        };
        let restored = region
            .populate_for_write(header_offset, HEADER_LEN + size)
            .and_then(|()| {
                // SAFETY: the range was just allocated for this restore and nobody else can
                // reach it until the entry points at it below.
                let destination = unsafe {
                    std::slice::from_raw_parts_mut(
                        region.payload(header_offset).as_ptr(),
                        size as usize,
                    )
                };
                slot.restore_into(object, destination)
            });
        let mut state = self.lock();
        if let Err(error) = restored {
            if let Placement::Memory(offset) = placement
                && let Ok(len) = region_len(object, size)
            {
                state.allocator.free(offset, len);
            }
            self.finish_restore_failed(state, object);
            return Err(error);
        }
        let header = Header {
            object,
            len: size,
            sealed: true,
            checksum: 0,
        };
        // SAFETY: as for `destination`.
        unsafe { region.write_header(header_offset, &header) };
        state.restored_bytes_total += size;
        let tick = state.tick();
        let mut fallback = None;
        if let Some(entry) = state.objects.get_mut(&object) {
            entry.io = None;
            match placement {
                Placement::Memory(offset) => {
                    entry.memory = Some(offset);
                    entry.last_used = tick;
                    state.lru.insert(tick, object);
                }
                Placement::Fallback(mapping) => {
                    entry.fallback = Some(Arc::clone(&mapping));
                    fallback = Some(mapping);
                }
            }
        }
        drop(state);
        self.io_finished.notify_all();
        Ok(self.view(object, size, header_offset, fallback))
    }

    fn finish_restore_failed(&self, mut state: MutexGuard<'_, State>, object: ObjectId) {
        if let Some(entry) = state.objects.get_mut(&object) {
            entry.io = None;
            entry.pins -= 1;
        }
        state.free_if_unused(object);
        drop(state);
        self.io_finished.notify_all();
    }

    fn unpin(&self, object: ObjectId) {
        let mut state = self.lock();
        if let Some(entry) = state.objects.get_mut(&object) {
            entry.pins = entry.pins.saturating_sub(1);
        }
        state.free_if_unused(object);
    }
}

/// Keeps an object pinned; shared by a view, its clones and Arrow buffers made from it.
#[derive(Debug)]
pub(crate) struct Pin {
    inner: Arc<Inner>,
    object: ObjectId,
    _fallback: Option<Arc<FileMapping>>,
}

impl Drop for Pin {
    fn drop(&mut self) {
        self.inner.unpin(self.object);
    }
}

/// Writes a new object's bytes. Seal it to make it readable; dropping it unsealed abandons the
/// object and frees its space.
#[derive(Debug)]
pub struct ObjectWriter {
    inner: Arc<Inner>,
    object: ObjectId,
    payload: *mut u8,
    size: usize,
    header_offset: u64,
    region: Arc<dyn Region>,
    sealed: bool,
}

// SAFETY: the writer is the only handle to its range until it is sealed; moving it to another
// thread moves that exclusive access along.
unsafe impl Send for ObjectWriter {}

impl ObjectWriter {
    pub fn object(&self) -> ObjectId {
        self.object
    }

    /// Where the object lies, for one other process on the host to fill it in through
    /// [`StoreClient::open_unsealed`](crate::StoreClient::open_unsealed). Its range stays this
    /// object's while the writer lives (even if the object is deleted meanwhile), so drop or
    /// seal the writer only once that process has stopped writing: it said it is done, or it
    /// is dead.
    pub fn location(&self) -> ObjectLocation {
        ObjectLocation {
            object: self.object,
            source: self.region.source(),
            offset: self.header_offset,
            len: self.size as u64,
        }
    }

    /// The object's bytes, to fill in before sealing. They start 64-byte aligned.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the range is allocated to this object, inside a live region (held by
        // `self.region`), and this writer is its only handle until sealed.
        unsafe { std::slice::from_raw_parts_mut(self.payload, self.size) }
    }

    /// Makes the object immutable and readable by [`ObjectStore::get`] and other processes.
    pub fn seal(self) -> Result<()> {
        self.seal_recording(None)
    }

    /// Seals the object, recording `checksum` (the caller's xxh3-64 of the bytes written) for
    /// [`ObjectStore::checksum`].
    pub fn seal_with_checksum(self, checksum: u64) -> Result<()> {
        self.seal_recording(Some(checksum))
    }

    fn seal_recording(mut self, checksum: Option<u64>) -> Result<()> {
        let mut state = self.inner.lock();
        let tick = state.tick();
        // An object deleted while it was written is not sealed: the writer's drop frees it.
        let entry = state.live_entry(self.object)?;
        let header = Header {
            object: self.object,
            len: self.size as u64,
            sealed: true,
            checksum: 0,
        };
        // SAFETY: the header range belongs to this object and only this writer writes it.
        unsafe { self.region.write_header(self.header_offset, &header) };
        entry.writing = false;
        entry.sealed = true;
        entry.last_used = tick;
        entry.checksum = checksum;
        if entry.memory.is_some() {
            state.lru.insert(tick, self.object);
        }
        self.sealed = true;
        Ok(())
    }
}

/// Which process writes a new object's bytes: the store's maps all its pages in ahead.
#[derive(Debug, Clone, Copy)]
enum WrittenBy {
    ThisProcess,
    AnotherProcess,
}

impl Drop for ObjectWriter {
    fn drop(&mut self) {
        if !self.sealed {
            let mut state = self.inner.lock();
            if let Some(entry) = state.objects.get_mut(&self.object) {
                entry.writing = false;
                entry.deleted = true;
            }
            state.free_if_unused(self.object);
        }
    }
}

#[cfg(test)]
mod tests {
    use floe_core::config::ConfigLoader;

    use super::*;

    #[test]
    fn a_node_store_takes_its_capacity_from_the_pool_and_the_rest_from_config() {
        let config = ConfigLoader::new()
            .set("paths.data_dir=/srv/floe")
            .unwrap()
            .set("memory.spill_threshold=0.6")
            .unwrap()
            .set("memory.min_spilling_size=8MiB")
            .unwrap()
            .load()
            .unwrap();
        let pools = MemoryPools::split(16 << 30, &config.memory).unwrap();
        let store = StoreConfig::for_node(&config, &pools, "node-3");
        assert_eq!(store.capacity, pools.object_store);
        assert_eq!(store.spill_threshold, 0.6);
        assert_eq!(store.min_spilling_size, 8 << 20);
        assert_eq!(store.spill_dir, PathBuf::from("/srv/floe/spill"));
        assert_eq!(store.fallback_dir, PathBuf::from("/srv/floe/fallback"));
        assert_eq!(store.name, "node-3");
    }

    #[test]
    fn bad_names_and_tiny_capacities_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let config = |name: &str, capacity| StoreConfig {
            name: name.into(),
            capacity,
            spill_threshold: 0.8,
            min_spilling_size: 1 << 20,
            spill_dir: dir.path().join("spill"),
            fallback_dir: dir.path().join("fallback"),
        };
        for backing in [Backing::SharedMemory, Backing::Heap] {
            for name in ["", "a/b", "with space", &"x".repeat(201)] {
                let error = ObjectStore::open_with(config(name, 1 << 20), backing).unwrap_err();
                assert!(matches!(error, Error::InvalidStoreName { .. }), "{error}");
            }
            let error = ObjectStore::open_with(config("tiny", 100), backing).unwrap_err();
            assert!(
                matches!(error, Error::CapacityTooSmall { capacity: 100 }),
                "{error}"
            );
        }
    }
}
