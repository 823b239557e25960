//! Cache shards served in place: a hit is the shard file itself, mapped, as an object of the
//! store (`ObjectStore::adopt_shard`), against real shared memory, real files and a real second
//! process reading the object as a worker does. What needs no second process also runs on a
//! heap-backed store (`on_every_backing!`): a served shard is a file either way.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

#[allow(dead_code)] // each test binary uses a different subset of the helpers
mod common;

use std::fs;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use arrow::array::{Array, AsArray, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use common::{MIB, config_in, files_in, on_every_backing, store_in};
use floe_core::ObjectId;
use floe_core::config::ByteSize;
use floe_core::fingerprint::{Args, FingerprintInputs, SourceDescription, TransformDescription};
use floe_core::hash::xxh3_64;
use floe_objectstore::block::read_block;
use floe_objectstore::cache::{
    Cache, CacheConfig, CachePolicy, ServedShard, ShardIndex, ShardName, Verification,
};
use floe_objectstore::{
    Adoption, Backing, Error, ObjectLocation, ObjectSource, ObjectStore, StoreClient,
};

const CHILD_ENV: &str = "FLOE_SERVED_SHARD_TEST_LOCATION";

on_every_backing!(
    a_hit_is_the_shard_file_mapped_with_no_byte_in_the_segment,
    the_mapping_and_the_link_go_when_the_object_is_released,
    a_shard_replaced_after_its_check_is_not_adopted,
    a_shard_the_store_cannot_link_is_copied_into_the_segment,
    a_dead_stores_links_are_removed_by_its_successor,
);
const ROWS: i64 = 200_000;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("name", DataType::Utf8, false),
    ]))
}

/// `id` from `start`, and a name that makes rows of uneven width.
fn batch(start: i64, rows: i64) -> RecordBatch {
    let ids: Vec<i64> = (start..start + rows).collect();
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from(ids.clone())),
            Arc::new(StringArray::from_iter_values(
                ids.iter().map(|id| format!("row-{}", id * 7)),
            )),
        ],
    )
    .unwrap()
}

fn inputs() -> FingerprintInputs {
    let source = FingerprintInputs::Source(SourceDescription::range(ROWS as u64));
    FingerprintInputs::Transform(
        TransformDescription::new(vec![source], "served", 1, &Args::new()).unwrap(),
    )
}

fn name() -> ShardName {
    ShardName {
        fingerprint: inputs().fingerprint(),
        shard: ShardIndex::new(0, 1).unwrap(),
    }
}

fn open_cache(dir: &Path) -> Cache {
    Cache::open(CacheConfig {
        dir: dir.to_owned(),
        max_bytes: ByteSize::gib(1),
        verification: Verification::Checksum,
    })
    .unwrap()
}

/// A cache under `dir`/cache holding one shard of `ROWS` rows, in three batches.
fn cache_with_a_shard(dir: &Path) -> (Cache, PathBuf) {
    let cache = open_cache(&dir.join("cache"));
    let third = ROWS / 3;
    cache
        .write_shard(
            CachePolicy::Reuse,
            &inputs(),
            name().shard,
            &schema(),
            &[
                batch(0, third),
                batch(third, third),
                batch(2 * third, ROWS - 2 * third),
            ],
        )
        .unwrap();
    let path = dir.join("cache").join(name().file_name());
    (cache, path)
}

/// Rows and Σ id of a block object, decoded without copying, checking every buffer is a
/// 64-byte aligned address inside `view`'s bytes.
fn rows_and_sum(view: &floe_objectstore::ObjectView) -> (i64, i64) {
    let bytes = view.as_bytes().as_ptr_range();
    let block = read_block(view).unwrap();
    let (mut rows, mut sum) = (0, 0);
    for batch in &block.batches {
        for column in batch.columns() {
            for buffer in column.to_data().buffers() {
                let start = buffer.as_ptr();
                assert!(
                    bytes.contains(&start),
                    "a buffer was copied out of the object"
                );
                assert!(start.addr().is_multiple_of(64), "a misaligned buffer");
            }
        }
        rows += batch.num_rows() as i64;
        sum += batch
            .column(0)
            .as_primitive::<Int64Type>()
            .values()
            .iter()
            .sum::<i64>();
        let names = batch.column(1).as_string::<i32>();
        assert_eq!(names.len(), batch.num_rows());
    }
    (rows, sum)
}

fn expected() -> (i64, i64) {
    (ROWS, (0..ROWS).sum())
}

/// The files mapped into this process whose path ends with `path`'s file name.
/// This process's mappings of the file at `path`, by its whole path: the tests run in
/// parallel in one process, and their shards share file names.
fn mappings_of(path: &Path) -> usize {
    let path = path.to_string_lossy().into_owned();
    fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|line| line.ends_with(&path))
        .count()
}

fn id(n: u128) -> ObjectId {
    ObjectId::new(0x5e7e_0000_0000_0000_0000_0000_0000_0000 | n)
}

/// The store's own name for a shard it serves as `object`: where a fallback object's file
/// would be.
fn link_of(store: &ObjectStore, object: ObjectId) -> PathBuf {
    store
        .config()
        .fallback_dir
        .join(format!("{}-{object}.object", store.config().name))
}

fn serve(cache: &Cache) -> ServedShard {
    cache.serve_shard(name()).unwrap().expect("a hit")
}

fn a_hit_is_the_shard_file_mapped_with_no_byte_in_the_segment(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let (cache, path) = cache_with_a_shard(dir.path());
    let store = store_in(dir.path(), 16 * MIB, MIB, backing);
    let object = id(1);
    let served = serve(&cache);
    assert_eq!(served.rows, ROWS as u64);
    assert_eq!(
        store.adopt_shard(object, &served).unwrap(),
        Adoption::Mapped
    );

    // Nothing was copied into the segment: the object is the shard file's payload.
    let stats = store.stats();
    assert_eq!((stats.used, stats.objects_in_memory), (0, 0));
    assert_eq!((stats.shard_objects, stats.shard_bytes), (1, served.len));
    assert_eq!((stats.fallback_objects, stats.spilled_objects), (0, 0));
    let view = store.get(object).unwrap();
    let link = link_of(&store, object);
    assert_eq!(
        view.location(),
        &ObjectLocation {
            object,
            source: ObjectSource::File { path: link.clone() },
            offset: 0,
            len: served.len,
        }
    );
    // The store's name for the object is the shard's file (a hard link, not a copy).
    let (shard_file, linked) = (fs::metadata(&path).unwrap(), fs::metadata(&link).unwrap());
    assert_eq!(
        (linked.dev(), linked.ino()),
        (shard_file.dev(), shard_file.ino())
    );
    let on_disk = fs::read(&path).unwrap();
    assert_eq!(view.as_bytes(), &on_disk[64..]);
    assert_eq!(store.checksum(object), Some(xxh3_64(&on_disk[64..])));
    assert_eq!(served.checksum, xxh3_64(&on_disk[64..]));
    assert_eq!(rows_and_sum(&view), expected());

    // A reader that is handed the location maps the same file and decodes in place.
    let reader = StoreClient::new().open(view.location()).unwrap();
    assert_eq!(rows_and_sum(&reader), expected());
    assert_eq!(store.stats().used, 0);
}

fn the_mapping_and_the_link_go_when_the_object_is_released(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let (cache, path) = cache_with_a_shard(dir.path());
    let store = store_in(dir.path(), 16 * MIB, MIB, backing);
    let object = id(2);
    store.adopt_shard(object, &serve(&cache)).unwrap();
    let link = link_of(&store, object);
    // The cache's own check mapped the shard only while it checked it.
    assert_eq!(mappings_of(&path), 0);
    assert_eq!(mappings_of(&link), 1);

    let view = store.get(object).unwrap();
    let audit = store.audit_files().unwrap();
    assert_eq!(audit.held, [link.clone()].into());
    assert!(audit.stray().is_empty() && audit.missing().is_empty());
    // Freed (as a node's `Free` does) while read: the view keeps it mapped and linked.
    store.delete(object).unwrap();
    assert!(!store.contains(object));
    assert!(link.exists());
    assert_eq!(rows_and_sum(&view), expected());
    drop(view);
    assert_eq!(mappings_of(&link), 0);
    assert!(!link.exists());
    assert!(files_in(&store.config().fallback_dir).is_empty());
    let stats = store.stats();
    assert_eq!(
        (stats.shard_objects, stats.shard_bytes, stats.used),
        (0, 0, 0)
    );
    // The shard stays in the cache.
    assert!(path.exists());
    assert_eq!(serve(&cache).rows, ROWS as u64);
}

/// As the parent: serve a shard, clean the cache, and have a child process — this test binary
/// again — map the object from its location as a worker does. As the child (the variable
/// set): print the rows and Σ id it decodes there.
#[test]
fn cleaning_the_cache_under_a_served_shard_takes_nothing_from_it() {
    if let Ok(json) = std::env::var(CHILD_ENV) {
        let location: ObjectLocation = serde_json::from_str(&json).unwrap();
        let view = StoreClient::new().open(&location).unwrap();
        let (rows, sum) = rows_and_sum(&view);
        println!("\nread {rows} {sum}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (cache, path) = cache_with_a_shard(dir.path());
    let store = store_in(dir.path(), 16 * MIB, MIB, Backing::SharedMemory);
    let object = id(3);
    store.adopt_shard(object, &serve(&cache)).unwrap();
    let location = store.get(object).unwrap().location().clone();

    // `floe cache clean`: every shard file goes, the served one included.
    let removed = cache.remove_files(&cache.shards().unwrap()).unwrap();
    assert_eq!(removed.shards, 1);
    assert!(!path.exists());
    assert!(cache.serve_shard(name()).unwrap().is_none());

    // The object lives on its own name: read here, and mapped afresh by another process (a
    // worker started after the clean), every row is there.
    assert_eq!(rows_and_sum(&store.get(object).unwrap()), expected());
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "cleaning_the_cache_under_a_served_shard_takes_nothing_from_it",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, serde_json::to_string(&location).unwrap())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let (rows, sum) = expected();
    assert!(
        stdout
            .lines()
            .any(|line| line == format!("read {rows} {sum}")),
        "stdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );

    // Freed: its link goes, and with it the last name of the shard's data.
    store.remove_ref(object).unwrap();
    assert!(files_in(&store.config().fallback_dir).is_empty());
    assert!(files_in(&dir.path().join("cache")).is_empty());
}

fn a_shard_replaced_after_its_check_is_not_adopted(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let (cache, path) = cache_with_a_shard(dir.path());
    let store = store_in(dir.path(), 16 * MIB, MIB, backing);
    let served = serve(&cache);
    // Another writer renames a new file over the name.
    let staged = dir.path().join("cache").join(".tmp-other.part");
    fs::copy(&path, &staged).unwrap();
    fs::rename(&staged, &path).unwrap();
    let object = id(4);
    let error = store.adopt_shard(object, &served).unwrap_err();
    assert!(matches!(error, Error::ShardChanged { .. }), "{error}");
    assert!(!store.contains(object));
    assert!(files_in(&store.config().fallback_dir).is_empty());
    // Checked again, the new file is served.
    let again = serve(&cache);
    assert_ne!(again.inode, served.inode);
    store.adopt_shard(object, &again).unwrap();
    assert_eq!(rows_and_sum(&store.get(object).unwrap()), expected());
}

fn a_shard_the_store_cannot_link_is_copied_into_the_segment(backing: Backing) {
    // The fallback directory on another file system than the cache: /dev/shm is a tmpfs.
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let dir = tempfile::tempdir().unwrap();
    if fs::metadata(shm.path()).unwrap().dev() == fs::metadata(dir.path()).unwrap().dev() {
        panic!("this test needs /dev/shm on another file system than the temporary directory");
    }
    let (cache, _) = cache_with_a_shard(dir.path());
    let mut config = config_in(dir.path(), 16 * MIB, MIB);
    config.fallback_dir = shm.path().join("fallback");
    let store = ObjectStore::open_with(config, backing).unwrap();
    let served = serve(&cache);
    let object = id(5);
    assert_eq!(
        store.adopt_shard(object, &served).unwrap(),
        Adoption::Copied
    );
    let stats = store.stats();
    assert!(stats.used >= served.len, "{stats:?}");
    assert_eq!(stats.shard_objects, 0);
    let view = store.get(object).unwrap();
    assert!(!matches!(view.location().source, ObjectSource::File { .. }));
    assert_eq!(store.checksum(object), Some(xxh3_64(view.as_bytes())));
    assert_eq!(rows_and_sum(&view), expected());
}

#[test]
fn a_damaged_shard_is_a_miss_and_removed_and_an_unchanged_one_is_read_once() {
    let dir = tempfile::tempdir().unwrap();
    let (cache, path) = cache_with_a_shard(dir.path());
    // Written here, so trusted as written: serving it reads its prefix and footer only.
    let served = serve(&cache);
    let store = store_in(dir.path(), 16 * MIB, MIB, Backing::SharedMemory);
    store.adopt_shard(id(6), &served).unwrap();

    // A node that starts afresh (a new `Cache` on the directory) reads a shard whole the first
    // time; one damaged byte makes it a miss, and the shard is removed.
    let whole = fs::read(&path).unwrap();
    let at = whole.len() / 2;
    let file = fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.write_all_at(&[whole[at] ^ 0x04], at as u64).unwrap();
    drop(file);
    let restarted = open_cache(&dir.path().join("cache"));
    assert!(restarted.serve_shard(name()).unwrap().is_none());
    assert!(!path.exists());
    let stats = restarted.stats().unwrap();
    assert_eq!((stats.corrupt_removed, stats.hits), (1, 0));
    // The object adopted before the damage keeps its link, to the damaged data: a reader's
    // check against the recorded checksum is what finds that (`StoreClient` readers decode
    // and validate; transfers are checked end to end).
    let view = store.get(id(6)).unwrap();
    assert_ne!(xxh3_64(view.as_bytes()), store.checksum(id(6)).unwrap());
}

fn a_dead_stores_links_are_removed_by_its_successor(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let (cache, path) = cache_with_a_shard(dir.path());
    let store = store_in(dir.path(), 16 * MIB, MIB, backing);
    let object = id(7);
    store.adopt_shard(object, &serve(&cache)).unwrap();
    let link = link_of(&store, object);
    // What a store started under a dead store's name removes first (a node restarted after
    // SIGKILL): its links go like its fallback files, and the shard stays in the cache.
    let removed = ObjectStore::remove_dead_store(store.config()).unwrap();
    assert!(removed.contains(&link), "{removed:?}");
    assert!(!link.exists());
    assert!(path.exists());
    drop(store);
    assert!(files_in(&dir.path().join("fallback")).is_empty());
}
