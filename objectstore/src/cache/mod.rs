//! The fingerprint cache: operator outputs kept as shard files named by their fingerprint.
//!
//! A shard is `cache-<fp>_<rank:05>_of_<n:05>.arrow` in the node's cache directory. The file
//! is the only record: its name says what it is, its footer manifest says what it holds and
//! what it was computed from, and its modification time is its last use (so LRU order survives
//! restarts and is shared by every process using the directory). Shards are written to a
//! temporary file, fsynced and renamed, so a name only ever points at a complete file; they
//! are verified when opened, and a bad one is removed and reported as a miss. A verified file
//! is remembered in its state (device, inode, length, modification time), so a node serving
//! the same shard again reads only its prefix and footer.
//!
//! Eviction keeps the directory under a size cap, least recently used first, and never
//! removes a shard this process has open (a [`CachedShard`]'s buffers hold a pin). Another
//! process's open shards may be unlinked under it; its mapping stays valid, since a shard
//! file is never modified in place. A shard served as an object ([`Cache::serve_shard`]) is
//! not open here: the store holds it under a name of its own (a hard link), so removing the
//! shard's name takes nothing from the object, whose bytes stay on disk until it is freed.

mod manifest;
mod shard;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use floe_core::config::ByteSize;
use floe_core::fingerprint::{Difference, FingerprintInputs};
use floe_core::{Config, Fingerprint};

pub use manifest::{Checksum, FieldSummary, MANIFEST_KEY, Manifest};
pub use shard::{CachedShard, ServedShard, ShardIndex, ShardName, Verification};

use shard::{ShardContents, TEMP_PREFIX, VerifiedFiles};

/// Temporary files older than this are debris of a crashed writer; younger ones may belong to
/// a write in progress in another process.
const STALE_TEMP_AGE: Duration = Duration::from_secs(3600);

/// What the cache can fail with. A bad shard file is not an error: it is a miss.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write shard {}: {source}", path.display())]
    Arrow {
        path: PathBuf,
        source: arrow::error::ArrowError,
    },
    #[error("batch {batch} does not have the shard's schema: expected {expected}, found {found}")]
    SchemaMismatch {
        batch: usize,
        expected: String,
        found: String,
    },
    #[error("cannot encode a shard manifest: {0}")]
    Manifest(String),
    #[error(
        "shard {rank} of {count} does not exist: ranks run from 0 to count-1, counts from 1 to 99999"
    )]
    InvalidShard { rank: u32, count: u32 },
    #[error("shard {name} has no column {column}: it has {width}")]
    NoColumn {
        name: String,
        column: usize,
        width: usize,
    },
}

pub type Result<T, E = CacheError> = std::result::Result<T, E>;

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CacheError {
    let path = path.to_owned();
    move |source| CacheError::Io {
        action,
        path,
        source,
    }
}

/// Where the cache lives and how it behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    pub dir: PathBuf,
    /// The size cap; writes past it evict least recently used shards.
    pub max_bytes: ByteSize,
    pub verification: Verification,
}

impl CacheConfig {
    /// The node's cache as configured: `paths.cache_dir` capped at `cache.max_bytes`.
    pub fn for_node(config: &Config) -> Self {
        Self {
            dir: config.paths.cache_dir(),
            max_bytes: config.cache.max_bytes,
            verification: Verification::default(),
        }
    }
}

/// How one operator uses the cache (set per job, or per operator).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CachePolicy {
    /// Reuse what is cached; write what is computed.
    #[default]
    Reuse,
    /// Ignore what is cached, compute, and overwrite (HF's `load_from_cache_file=False`).
    Recompute,
    /// Neither read nor write cache files.
    Disabled,
}

impl CachePolicy {
    fn reads(self) -> bool {
        self == CachePolicy::Reuse
    }

    fn writes(self) -> bool {
        self != CachePolicy::Disabled
    }
}

/// The answer to "is this output cached?".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// Every shard of the requested count is there.
    FullHit {
        count: u32,
    },
    /// Some shards of the requested count are there; compute only `missing`.
    PartialHit {
        count: u32,
        missing: Vec<u32>,
    },
    /// A complete set with another shard count is there; read it instead.
    OtherShardCount {
        count: u32,
    },
    Miss,
}

/// What a write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    Written {
        bytes: u64,
    },
    /// The shard was already there and the policy reuses it.
    AlreadyCached,
    /// The policy writes nothing.
    Disabled,
}

/// Counters since this `Cache` was opened, plus the bytes on disk now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Shards opened and verified.
    pub hits: u64,
    /// Lookups that found nothing usable, and shards that failed verification.
    pub misses: u64,
    /// Lookups skipped because the policy recomputes or disables caching.
    pub bypassed: u64,
    pub bytes_written: u64,
    pub evicted_shards: u64,
    pub corrupt_removed: u64,
    /// Bytes of shard files in the directory.
    pub bytes: u64,
}

#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    bypassed: AtomicU64,
    bytes_written: AtomicU64,
    evicted_shards: AtomicU64,
    corrupt_removed: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// Shards this process has open, with how many times.
#[derive(Debug, Default)]
struct Pins(Mutex<BTreeMap<ShardName, usize>>);

impl Pins {
    fn is_pinned(&self, name: &ShardName) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(name)
    }
}

/// Keeps a shard from being evicted while it lives.
struct PinGuard {
    pins: Arc<Pins>,
    name: ShardName,
}

impl PinGuard {
    fn new(pins: &Arc<Pins>, name: ShardName) -> Self {
        *pins
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(name)
            .or_default() += 1;
        Self {
            pins: Arc::clone(pins),
            name,
        }
    }
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        let mut pins = self.pins.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = pins.get_mut(&self.name) {
            *count -= 1;
            if *count == 0 {
                pins.remove(&self.name);
            }
        }
    }
}

/// A shard file found in the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardFile {
    pub name: ShardName,
    pub bytes: u64,
    pub last_used: SystemTime,
}

/// What [`Cache::cleanup`] or eviction removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Removed {
    pub shards: u64,
    pub bytes: u64,
}

/// Why a fingerprint is not cached, in terms a user can act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MissExplanation {
    /// It is cached (at these shard counts): not a miss.
    Cached { counts: Vec<u32> },
    /// Nothing readable is cached at all.
    Empty,
    /// The closest cached entry and what differs from it.
    Nearest {
        fingerprint: Fingerprint,
        differences: Vec<Difference>,
    },
}

impl fmt::Display for MissExplanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MissExplanation::Cached { counts } => write!(f, "cached, with shard counts {counts:?}"),
            MissExplanation::Empty => f.write_str("the cache holds no entries"),
            MissExplanation::Nearest {
                fingerprint,
                differences,
            } => {
                write!(f, "nearest cached entry {fingerprint}:")?;
                for difference in differences {
                    write!(f, "\n  - {difference}")?;
                }
                Ok(())
            }
        }
    }
}

/// A node's fingerprint cache directory.
#[derive(Debug)]
pub struct Cache {
    config: CacheConfig,
    pins: Arc<Pins>,
    verified: VerifiedFiles,
    counters: Counters,
    /// Serializes this process's evictions so two writers do not both delete for one overflow.
    eviction: Mutex<()>,
}

impl Cache {
    /// Opens (creating if needed) the cache directory.
    pub fn open(config: CacheConfig) -> Result<Self> {
        fs::create_dir_all(&config.dir)
            .map_err(io_error("create the cache directory", &config.dir))?;
        Ok(Self {
            config,
            pins: Arc::default(),
            verified: VerifiedFiles::default(),
            counters: Counters::default(),
            eviction: Mutex::new(()),
        })
    }

    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    fn path(&self, name: &ShardName) -> PathBuf {
        self.config.dir.join(name.file_name())
    }

    /// Every shard file in the directory. Temporary files of writes in progress (or of writers
    /// that crashed) are not shards and are never listed.
    pub fn shards(&self) -> Result<Vec<ShardFile>> {
        let dir = &self.config.dir;
        let mut shards = Vec::new();
        for entry in fs::read_dir(dir).map_err(io_error("list", dir))? {
            let entry = entry.map_err(io_error("list", dir))?;
            let Some(name) = entry.file_name().to_str().and_then(ShardName::parse) else {
                continue;
            };
            // A shard removed since the listing is simply not there any more.
            let Ok(metadata) = entry.metadata() else {
                continue;
            };
            shards.push(ShardFile {
                name,
                bytes: metadata.len(),
                last_used: metadata.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            });
        }
        shards.sort_by_key(|shard| shard.name);
        Ok(shards)
    }

    /// Which shards of `fingerprint` are cached. With a complete set in another count, the
    /// candidates are ranked by (fewest missing, count nearest `count`, smallest count); other
    /// counts are only used when complete, since their shards split the rows differently.
    pub fn lookup(
        &self,
        fingerprint: Fingerprint,
        count: u32,
        policy: CachePolicy,
    ) -> Result<Lookup> {
        if !policy.reads() {
            bump(&self.counters.bypassed, 1);
            return Ok(Lookup::Miss);
        }
        let mut present: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        for shard in self.shards()? {
            if shard.name.fingerprint == fingerprint {
                present
                    .entry(shard.name.shard.count)
                    .or_default()
                    .insert(shard.name.shard.rank);
            }
        }
        let best = present
            .iter()
            .map(|(&candidate, ranks)| (candidate, candidate as usize - ranks.len()))
            .filter(|&(candidate, missing)| candidate == count || missing == 0)
            .min_by_key(|&(candidate, missing)| (missing, candidate.abs_diff(count), candidate));
        let lookup = match best {
            None => Lookup::Miss,
            Some((candidate, 0)) if candidate == count => Lookup::FullHit { count },
            Some((candidate, 0)) => Lookup::OtherShardCount { count: candidate },
            Some((_, _)) => {
                let ranks = &present[&count];
                Lookup::PartialHit {
                    count,
                    missing: (0..count).filter(|rank| !ranks.contains(rank)).collect(),
                }
            }
        };
        if lookup == Lookup::Miss {
            bump(&self.counters.misses, 1);
        }
        Ok(lookup)
    }

    /// Opens one shard as a hit: maps it, verifies it and decodes it without copying. A shard
    /// that is missing is `None`; one that fails verification is removed and is `None` too.
    pub fn open_shard(&self, name: ShardName) -> Result<Option<CachedShard>> {
        self.open_columns(name, None)
    }

    /// [`Cache::open_shard`] returning only the columns at `columns` (schema order). A first
    /// checksummed open then checks only the bytes it returns: the schema, the batch headers
    /// and those columns' buffers, piece by piece, in parallel. (The unchecked rest stays
    /// unread, so the shard is not remembered as verified.)
    pub fn open_shard_columns(
        &self,
        name: ShardName,
        columns: &[usize],
    ) -> Result<Option<CachedShard>> {
        self.open_columns(name, Some(columns))
    }

    fn open_columns(
        &self,
        name: ShardName,
        columns: Option<&[usize]>,
    ) -> Result<Option<CachedShard>> {
        let path = self.path(&name);
        if !path.exists() {
            bump(&self.counters.misses, 1);
            return Ok(None);
        }
        // A column the shard does not have is the caller's mistake, not a bad shard: it is
        // answered before the open, which removes shards it finds bad.
        if let Some(columns) = columns
            && let Ok(manifest) = shard::read_manifest_at(&path)
            && let Some(column) = columns.iter().find(|c| **c >= manifest.schema.len())
        {
            return Err(CacheError::NoColumn {
                name: name.file_name(),
                column: *column,
                width: manifest.schema.len(),
            });
        }
        let pin = PinGuard::new(&self.pins, name);
        let opened = shard::open(
            &path,
            name,
            self.config.verification,
            &self.verified,
            pin,
            columns,
        );
        self.hit_or_miss(name, &path, opened)
    }

    /// Checks one shard for serving in place as an object (`ObjectStore::adopt_shard` maps
    /// it): the whole file the first time this `Cache` sees it in its current state (unless it
    /// wrote it), only its prefix and footer after that. A shard that is missing is `None`;
    /// one that fails verification is removed and is `None` too.
    pub fn serve_shard(&self, name: ShardName) -> Result<Option<ServedShard>> {
        let path = self.path(&name);
        if !path.exists() {
            bump(&self.counters.misses, 1);
            return Ok(None);
        }
        let served = shard::serve(&path, name, self.config.verification, &self.verified);
        self.hit_or_miss(name, &path, served)
    }

    /// Counts a verified shard as a hit and advances its LRU clock, or removes a bad one.
    fn hit_or_miss<T>(
        &self,
        name: ShardName,
        path: &Path,
        verified: std::result::Result<T, shard::Invalid>,
    ) -> Result<Option<T>> {
        match verified {
            Ok(hit) => {
                self.touch(name, path);
                bump(&self.counters.hits, 1);
                Ok(Some(hit))
            }
            Err(shard::Invalid(problem)) => {
                tracing::warn!(path = %path.display(), %problem, "removing a bad cache shard");
                bump(&self.counters.misses, 1);
                self.verified.forget(&name);
                match fs::remove_file(path) {
                    Ok(()) => bump(&self.counters.corrupt_removed, 1),
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                    Err(error) => return Err(io_error("remove a bad shard", path)(error)),
                }
                Ok(None)
            }
        }
    }

    /// Sets a shard's modification time, the LRU clock, to now, and lets its verdict follow.
    /// Failing only makes the shard an earlier eviction candidate (or verified once more).
    fn touch(&self, name: ShardName, path: &Path) {
        let Ok(file) = fs::File::open(path) else {
            return;
        };
        let Ok(before) = file.metadata() else {
            return;
        };
        if file.set_modified(SystemTime::now()).is_ok()
            && let Ok(after) = file.metadata()
        {
            self.verified.touched(
                &name,
                shard::FileState::of(&before),
                shard::FileState::of(&after),
            );
        }
    }

    /// Stores one computed shard of the output described by `inputs`. Two writers of the same
    /// shard (in any processes) both succeed; the last rename wins and both files were
    /// complete, so the survivor is valid. It does not evict: the caller brings the directory
    /// back under the cap, with [`Cache::evict_to_cap`], or with [`Cache::over_cap`] then
    /// [`Cache::remove_evicted`] when an index must hear of the removals first.
    pub fn write_shard(
        &self,
        policy: CachePolicy,
        inputs: &FingerprintInputs,
        shard: ShardIndex,
        schema: &SchemaRef,
        batches: &[RecordBatch],
    ) -> Result<WriteOutcome> {
        if !policy.writes() {
            return Ok(WriteOutcome::Disabled);
        }
        let name = ShardName {
            fingerprint: inputs.fingerprint(),
            shard,
        };
        if policy.reads() && self.path(&name).exists() {
            return Ok(WriteOutcome::AlreadyCached);
        }
        let written = shard::write(
            &self.config.dir,
            &ShardContents {
                name,
                inputs,
                schema,
                batches,
            },
        )?;
        self.verified.record(name, written.verdict);
        bump(&self.counters.bytes_written, written.bytes);
        Ok(WriteOutcome::Written {
            bytes: written.bytes,
        })
    }

    /// Removes least recently used shards until the directory is within the cap, skipping
    /// shards this process has open and the shards of `writing` (an output being written
    /// shard by shard must not lose its first shards to its last). If only those are left,
    /// the cap is exceeded rather than pulling data from under a reader.
    pub fn evict_to_cap(&self, writing: Option<Fingerprint>) -> Result<Removed> {
        let _one_at_a_time = self.eviction.lock().unwrap_or_else(PoisonError::into_inner);
        let cap = self.config.max_bytes.bytes();
        let (over, left) = self.beyond(cap, writing)?;
        let removed = self.remove_files(&over)?;
        bump(&self.counters.evicted_shards, removed.shards);
        if left > cap {
            tracing::warn!(
                total = left,
                cap,
                "cache over its size cap: the remaining shards are in use"
            );
        }
        Ok(removed)
    }

    /// The least recently used shards eviction would remove to bring the directory within
    /// the cap (sparing open shards and `writing`'s), without removing them.
    pub fn over_cap(&self, writing: Option<Fingerprint>) -> Result<Vec<ShardFile>> {
        Ok(self.beyond(self.config.max_bytes.bytes(), writing)?.0)
    }

    /// Removes shards [`Cache::over_cap`] chose, counted as evicted.
    pub fn remove_evicted(&self, shards: &[ShardFile]) -> Result<Removed> {
        let _one_at_a_time = self.eviction.lock().unwrap_or_else(PoisonError::into_inner);
        let removed = self.remove_files(shards)?;
        bump(&self.counters.evicted_shards, removed.shards);
        Ok(removed)
    }

    /// The least recently used shards to remove so that the rest fit in `keep_bytes` (shards
    /// open here are kept), without removing them: whoever removes them may first have to
    /// tell the index.
    pub fn least_recently_used_beyond(&self, keep_bytes: u64) -> Result<Vec<ShardFile>> {
        Ok(self.beyond(keep_bytes, None)?.0)
    }

    /// The shards to remove to fit in `cap` (sparing open shards and `writing`'s), and the
    /// bytes left after removing them.
    fn beyond(&self, cap: u64, writing: Option<Fingerprint>) -> Result<(Vec<ShardFile>, u64)> {
        let mut shards = self.shards()?;
        let mut total: u64 = shards.iter().map(|shard| shard.bytes).sum();
        let mut over = Vec::new();
        shards.sort_by_key(|shard| (shard.last_used, shard.name));
        for shard in shards {
            if total <= cap {
                break;
            }
            if Some(shard.name.fingerprint) == writing || self.pins.is_pinned(&shard.name) {
                continue;
            }
            total -= shard.bytes;
            over.push(shard);
        }
        Ok((over, total))
    }

    /// Every shard file of these fingerprints, open or not.
    pub fn shards_of(&self, fingerprints: &BTreeSet<Fingerprint>) -> Result<Vec<ShardFile>> {
        let mut shards = self.shards()?;
        shards.retain(|shard| fingerprints.contains(&shard.name.fingerprint));
        Ok(shards)
    }

    /// Removes these shard files. One open in this process stays readable through its
    /// mapping (a shard file is never modified in place); one already gone is not counted.
    pub fn remove_files(&self, shards: &[ShardFile]) -> Result<Removed> {
        let mut removed = Removed::default();
        for shard in shards {
            if self.remove(shard)? {
                removed.shards += 1;
                removed.bytes += shard.bytes;
            }
        }
        Ok(removed)
    }

    /// Removes every shard whose fingerprint is not in `keep` (and is not open here), and
    /// temporary files left by crashed writers.
    pub fn cleanup(&self, keep: &BTreeSet<Fingerprint>) -> Result<Removed> {
        let mut doomed = self.shards()?;
        doomed.retain(|shard| {
            !keep.contains(&shard.name.fingerprint) && !self.pins.is_pinned(&shard.name)
        });
        let removed = self.remove_files(&doomed)?;
        self.remove_stale_temps()?;
        Ok(removed)
    }

    /// Removes temporary files left by crashed writers (old enough not to be a write in
    /// progress).
    pub fn remove_stale_temps(&self) -> Result<()> {
        let dir = &self.config.dir;
        let now = SystemTime::now();
        for entry in fs::read_dir(dir).map_err(io_error("list", dir))? {
            let entry = entry.map_err(io_error("list", dir))?;
            let is_temp = entry
                .file_name()
                .to_str()
                .is_some_and(|name| name.starts_with(TEMP_PREFIX));
            let stale = entry
                .metadata()
                .and_then(|metadata| metadata.modified())
                .is_ok_and(|modified| {
                    now.duration_since(modified)
                        .is_ok_and(|age| age > STALE_TEMP_AGE)
                });
            if is_temp && stale {
                match fs::remove_file(entry.path()) {
                    Ok(()) => {}
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                    Err(error) => return Err(io_error("remove", &entry.path())(error)),
                }
            }
        }
        Ok(())
    }

    /// Removes a shard file; `false` if someone else already did.
    fn remove(&self, shard: &ShardFile) -> Result<bool> {
        self.verified.forget(&shard.name);
        let path = self.path(&shard.name);
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(error) => Err(io_error("remove", &path)(error)),
        }
    }

    pub fn stats(&self) -> Result<CacheStats> {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        Ok(CacheStats {
            hits: load(&self.counters.hits),
            misses: load(&self.counters.misses),
            bypassed: load(&self.counters.bypassed),
            bytes_written: load(&self.counters.bytes_written),
            evicted_shards: load(&self.counters.evicted_shards),
            corrupt_removed: load(&self.counters.corrupt_removed),
            bytes: self.shards()?.iter().map(|shard| shard.bytes).sum(),
        })
    }

    /// Why `inputs` would miss: compares its lineage with the manifest of every cached
    /// fingerprint and reports what differs from the nearest one (fewest differing arguments,
    /// versions, parents and sources, compared recursively through the lineage).
    pub fn explain_miss(&self, inputs: &FingerprintInputs) -> Result<MissExplanation> {
        let wanted = inputs.fingerprint();
        let mut by_fingerprint: BTreeMap<Fingerprint, Vec<ShardName>> = BTreeMap::new();
        for shard in self.shards()? {
            by_fingerprint
                .entry(shard.name.fingerprint)
                .or_default()
                .push(shard.name);
        }
        if let Some(names) = by_fingerprint.get(&wanted) {
            let counts: BTreeSet<u32> = names.iter().map(|name| name.shard.count).collect();
            return Ok(MissExplanation::Cached {
                counts: counts.into_iter().collect(),
            });
        }
        let mut nearest: Option<(u64, Fingerprint, Vec<Difference>)> = None;
        for (fingerprint, names) in by_fingerprint {
            // Every shard of a fingerprint carries the same lineage; the first readable one
            // speaks for all.
            let Some(manifest) = names
                .iter()
                .find_map(|name| shard::read_manifest_at(&self.path(name)).ok())
            else {
                continue;
            };
            let differences = inputs.differences(&manifest.inputs);
            let distance = inputs.distance(&manifest.inputs);
            if nearest.as_ref().is_none_or(|(best, _, _)| distance < *best) {
                nearest = Some((distance, fingerprint, differences));
            }
        }
        Ok(match nearest {
            None => MissExplanation::Empty,
            Some((_, fingerprint, differences)) => MissExplanation::Nearest {
                fingerprint,
                differences,
            },
        })
    }
}
