//! The store against real shared memory, real files and a real second process. Everything that
//! does not need a second process also runs on a heap-backed store (`on_every_backing!`).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

#[allow(dead_code)] // each test binary uses a different subset of the helpers
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};

use common::{KIB, MIB, config_in, contents, files_in, on_every_backing, shm_path, store_in};
use floe_core::ObjectId;
use floe_objectstore::{Backing, Error, ObjectLocation, ObjectSource, ObjectStore, StoreClient};

const CHILD_ENV: &str = "FLOE_OBJECTSTORE_TEST_LOCATIONS";
const WRITER_ENV: &str = "FLOE_OBJECTSTORE_TEST_WRITE";
const FULL_SHM_ENV: &str = "FLOE_OBJECTSTORE_TEST_FULL_SHM";

fn id(n: u128) -> ObjectId {
    ObjectId::new(0xf10e_0000_0000_0000_0000_0000_0000_0000 | n)
}

/// Runs test `test` of this binary again in a child process, with the environment `variable`
/// set, checks that it succeeded, and returns the lines of its output that start with one of
/// `prefixes`: what the child reports.
fn child_reports(test: &str, variable: (&str, &str), prefixes: &[&str]) -> Vec<String> {
    let output = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(variable.0, variable.1)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    stdout
        .lines()
        .filter(|line| prefixes.iter().any(|prefix| line.starts_with(prefix)))
        .map(str::to_owned)
        .collect()
}

on_every_backing!(
    references_and_pins_decide_when_an_object_is_freed,
    errors_name_the_object,
    dropping_the_store_removes_its_segment_and_files,
    spill_round_trip_of_three_times_the_capacity,
    a_fused_spill_file_is_removed_when_its_last_object_is_freed,
    a_corrupt_spill_file_is_an_error_never_wrong_data,
    a_store_full_of_pinned_objects_falls_back_to_disk,
    when_fallback_fails_too_the_error_gives_the_sizes,
    concurrent_writers_and_readers_lose_and_tear_nothing,
    spilling_on_request_frees_memory_in_lru_order,
    a_store_reopened_under_a_dead_stores_name_clears_its_leftovers,
    a_recorded_checksum_lasts_as_long_as_its_object,
    the_files_on_disk_are_exactly_those_of_live_objects,
    the_largest_objects_and_the_pinned_ones_are_listed_where_they_lie,
    an_object_deleted_while_it_is_written_keeps_its_range_until_its_writer_goes,
);

/// As the parent: seal objects (one in shared memory, one in a fallback file, one in a heap
/// store's memory) and have a child process — this test binary again — map them by location
/// and report what it read. As the child (the variable set): open each location and print its
/// length and checksum, or why it was refused.
#[test]
fn a_child_process_reads_sealed_objects() {
    if let Ok(json) = std::env::var(CHILD_ENV) {
        let locations: Vec<ObjectLocation> = serde_json::from_str(&json).unwrap();
        let client = StoreClient::new();
        for location in &locations {
            match client.open(location) {
                Ok(view) => println!(
                    "\nread {} {} {:016x}",
                    view.object(),
                    view.len(),
                    floe_core::hash::xxh3_64(view.as_bytes())
                ),
                Err(error) => println!("\nrefused: {error}"),
            }
        }
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 2 * MIB, MIB, Backing::SharedMemory);
    let (small, large) = (id(1), id(2));
    store.put(small, &contents(small, 300 * KIB)).unwrap();
    let in_memory = store.get(small).unwrap();
    // Pinned by `in_memory`, the first object leaves too little room: the second goes to disk.
    store.put(large, &contents(large, 1900 * KIB)).unwrap();
    let on_disk = store.get(large).unwrap();
    assert!(matches!(
        in_memory.location().source,
        ObjectSource::Segment { .. }
    ));
    assert!(matches!(
        on_disk.location().source,
        ObjectSource::File { .. }
    ));
    // A stale location (right place, wrong id) must be refused, not read.
    let mut stale = in_memory.location().clone();
    stale.object = id(99);
    // So must a location in another process's heap.
    let heap_store = store_in(dir.path(), MIB, MIB, Backing::Heap);
    let private = id(3);
    heap_store.put(private, b"private").unwrap();
    let in_heap = heap_store.get(private).unwrap();
    let locations = vec![
        in_memory.location().clone(),
        on_disk.location().clone(),
        stale,
        in_heap.location().clone(),
    ];

    let reads = child_reports(
        "a_child_process_reads_sealed_objects",
        (CHILD_ENV, &serde_json::to_string(&locations).unwrap()),
        &["read ", "refused: "],
    );
    let expected: Vec<String> = [(small, 300 * KIB), (large, 1900 * KIB)]
        .iter()
        .map(|&(object, len)| {
            format!(
                "read {object} {len} {:016x}",
                floe_core::hash::xxh3_64(&contents(object, len))
            )
        })
        .chain([
            format!(
                "refused: location of object {} is stale: found object {small} of {} bytes \
                 (sealed: true) there instead",
                id(99),
                300 * KIB
            ),
            format!(
                "refused: object {private} is in the heap memory of in-memory store {} \
                 (process {}), which other processes cannot map; open the store with shared \
                 memory to share its objects",
                heap_store.config().name,
                std::process::id()
            ),
        ])
        .collect();
    assert_eq!(reads, expected);
}

/// A writer maps its object's pages in ahead, in one call, rather than taking a page fault
/// for each page as it first writes it: the pages hold memory as soon as the object is opened
/// to write, before a byte of it is written. An object made for another process to write has
/// only its header's page mapped in by the store; one the store's process writes, all of them.
#[test]
fn an_object_opened_to_write_holds_its_pages_before_it_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 16 * MIB, MIB, Backing::SharedMemory);
    let writer = store.create_for_another_process(id(1), 8 * MIB).unwrap();
    let resident = || store.resident_bytes().unwrap();
    assert!(resident() < MIB, "{} bytes resident", resident());
    let mut object = StoreClient::new()
        .open_unsealed(&writer.location())
        .unwrap();
    assert!(resident() >= 8 * MIB, "{} bytes resident", resident());
    let bytes = contents(object.object(), 8 * MIB);
    object.as_mut_slice().copy_from_slice(&bytes);
    drop(object);
    writer
        .seal_with_checksum(floe_core::hash::xxh3_64(&bytes))
        .unwrap();
    assert_eq!(store.get(id(1)).unwrap().as_bytes(), &bytes[..]);
    let _own = store.create(id(2), 4 * MIB).unwrap();
    assert!(resident() >= 12 * MIB, "{} bytes resident", resident());
}

/// When a segment's file system has filled up since its store was made, writing an object is
/// refused with an error naming the segment, where the write would have killed the writer
/// with `SIGBUS`: a worker opening an object the store made for it, and the store's own
/// process creating one. The refused object leaves nothing behind: once there is room again,
/// the same object is made, written and read. The child (this test binary again, the variable
/// set) runs in a mount namespace of its own with an 8 MiB tmpfs on /dev/shm, which needs root.
#[test]
fn a_full_dev_shm_refuses_writes_with_an_error_not_a_crash() {
    if std::env::var_os(FULL_SHM_ENV).is_some() {
        // SAFETY: plain syscalls; this process is single-threaded here (one test, one thread).
        unsafe {
            assert_eq!(libc::unshare(libc::CLONE_NEWNS), 0, "unshare");
            let (none, no_data) = (std::ptr::null(), std::ptr::null());
            let root = c"/".as_ptr();
            let flags = libc::MS_REC | libc::MS_PRIVATE;
            assert_eq!(libc::mount(none, root, none, flags, no_data), 0, "private");
            let (shm, tmpfs) = (c"/dev/shm".as_ptr(), c"tmpfs".as_ptr());
            let size = c"size=8m".as_ptr().cast();
            assert_eq!(libc::mount(tmpfs, shm, tmpfs, 0, size), 0, "mount");
        }
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path(), 6 * MIB, MIB, Backing::SharedMemory);
        let for_worker = store.create_for_another_process(id(1), 2 * MIB).unwrap();
        // Another user of /dev/shm takes all but about 1 MiB of it.
        let filler = "/dev/shm/filler";
        std::fs::write(filler, vec![1u8; 7 * MIB as usize]).unwrap();
        let refused = |what: &str, result: Result<(), Error>| match result {
            Ok(()) => println!("\n{what}: done"),
            Err(error) => println!("\n{what}: refused: {error}"),
        };
        let opened = StoreClient::new().open_unsealed(&for_worker.location());
        refused("open", opened.map(drop));
        refused("create", store.create(id(2), 2 * MIB).map(drop));
        std::fs::remove_file(filler).unwrap();
        let mut writer = store.create(id(2), 2 * MIB).unwrap();
        let bytes = contents(id(2), 2 * MIB);
        writer.as_mut_slice().copy_from_slice(&bytes);
        writer.seal().unwrap();
        let read = store.get(id(2)).unwrap().as_bytes() == &bytes[..];
        refused(
            "again",
            read.then_some(()).ok_or(Error::NotFound { object: id(2) }),
        );
        return;
    }
    // SAFETY: `geteuid` only reads the process's credentials.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: mounting a small /dev/shm needs root; CI runs as root");
        return;
    }
    let lines = child_reports(
        "a_full_dev_shm_refuses_writes_with_an_error_not_a_crash",
        (FULL_SHM_ENV, "1"),
        &["open: ", "create: ", "again: "],
    );
    let no_room = |bytes: u64| format!("/dev/shm has no room for a {bytes}-byte write");
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(lines[0].starts_with("open: refused: cannot populate shared memory segment"));
    assert!(lines[0].ends_with(&no_room(2 * MIB)), "{}", lines[0]);
    assert!(lines[1].starts_with("create: refused: cannot populate shared memory segment"));
    assert!(lines[1].ends_with(&no_room(2 * MIB + 64)), "{}", lines[1]);
    assert_eq!(lines[2], "again: done");
}

/// As the parent: create objects (one in shared memory, one in a fallback file) and hand
/// their locations to a child process — this test binary again — which maps them writable and
/// fills them in, as a worker writes a task's outputs; then seal them and read them back. A
/// sealed object's location and a stale one are refused to the writer. As the child (the
/// variable set): write each location's object, or print why it was refused.
#[test]
fn a_child_process_writes_objects_the_store_then_seals() {
    if let Ok(json) = std::env::var(WRITER_ENV) {
        let locations: Vec<ObjectLocation> = serde_json::from_str(&json).unwrap();
        let client = StoreClient::new();
        for location in &locations {
            match client.open_unsealed(location) {
                Ok(mut object) => {
                    let bytes = contents(object.object(), location.len);
                    object.as_mut_slice().copy_from_slice(&bytes);
                    println!("\nwrote {}", object.object());
                }
                Err(error) => println!("\nrefused: {error}"),
            }
        }
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 2 * MIB, MIB, Backing::SharedMemory);
    let (small, large, sealed) = (id(1), id(2), id(3));
    store.put(sealed, b"sealed").unwrap();
    let sealed_view = store.get(sealed).unwrap();
    let in_memory = store.create(small, 300 * KIB).unwrap();
    // The first writer's range is taken while it lives: the second object goes to disk.
    let on_disk = store.create(large, 1900 * KIB).unwrap();
    assert!(matches!(
        in_memory.location().source,
        ObjectSource::Segment { .. }
    ));
    assert!(matches!(
        on_disk.location().source,
        ObjectSource::File { .. }
    ));
    let mut stale = in_memory.location();
    stale.object = id(99);
    let locations = vec![
        in_memory.location(),
        on_disk.location(),
        sealed_view.location().clone(),
        stale,
    ];
    let lines = child_reports(
        "a_child_process_writes_objects_the_store_then_seals",
        (WRITER_ENV, &serde_json::to_string(&locations).unwrap()),
        &["wrote ", "refused: "],
    );
    assert_eq!(
        lines,
        [
            format!("wrote {small}"),
            format!("wrote {large}"),
            format!(
                "refused: location of object {sealed} is stale: found object {sealed} of 6 \
                 bytes (sealed: true) there instead"
            ),
            format!(
                "refused: location of object {} is stale: found object {small} of {} bytes \
                 (sealed: false) there instead",
                id(99),
                300 * KIB
            ),
        ]
    );
    // Nobody reads an object before it is sealed; once sealed it holds the child's bytes.
    assert!(matches!(store.get(small), Err(Error::NotSealed { .. })));
    for (writer, len) in [(in_memory, 300 * KIB), (on_disk, 1900 * KIB)] {
        let object = writer.object();
        let checksum = floe_core::hash::xxh3_64(&contents(object, len));
        writer.seal_with_checksum(checksum).unwrap();
        assert_eq!(
            store.get(object).unwrap().as_bytes(),
            &contents(object, len)[..]
        );
        assert_eq!(store.checksum(object), Some(checksum));
    }
}

fn an_object_deleted_while_it_is_written_keeps_its_range_until_its_writer_goes(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 4 * MIB, MIB, backing);
    let object = id(1);
    let mut writer = store.create(object, MIB).unwrap();
    let used = store.stats().used;
    store.delete(object).unwrap();
    assert!(!store.contains(object));
    // Someone may still write the range: it is not handed out again while the writer lives.
    assert_eq!(store.stats().used, used);
    let other = id(2);
    store.put(other, &contents(other, MIB)).unwrap();
    writer.as_mut_slice().fill(0xaa);
    assert_eq!(
        store.get(other).unwrap().as_bytes(),
        &contents(other, MIB)[..],
        "a write to the deleted object's range reached another object"
    );
    // A deleted object is never sealed; its writer's end frees the range.
    assert!(matches!(writer.seal(), Err(Error::NotFound { .. })));
    store.delete(other).unwrap();
    assert_eq!(store.stats().used, 0);
    assert!(matches!(store.get(object), Err(Error::NotFound { .. })));
}

fn references_and_pins_decide_when_an_object_is_freed(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 4 * MIB, MIB, backing);
    let object = id(1);
    store.put(object, &contents(object, 100 * KIB)).unwrap();
    let used = store.stats().used;
    assert_eq!(used, 64 + 100 * KIB);
    store.add_ref(object).unwrap();
    let view = store.get(object).unwrap();
    assert_eq!(store.remove_ref(object).unwrap(), 1);
    assert_eq!(store.remove_ref(object).unwrap(), 0);
    // No references left, but the view still pins it: readable, and its memory still used.
    assert_eq!(store.stats().used, used);
    assert_eq!(view.as_bytes(), &contents(object, 100 * KIB)[..]);
    drop(view);
    assert_eq!(store.stats().used, 0);
    assert!(matches!(
        store.get(object),
        Err(Error::NotFound { object: o }) if o == object
    ));

    // Delete ignores references, and hides the object at once even while it is pinned.
    let other = id(2);
    store.put(other, b"payload").unwrap();
    store.add_ref(other).unwrap();
    let view = store.get(other).unwrap();
    store.delete(other).unwrap();
    assert!(!store.contains(other));
    assert!(store.get(other).is_err());
    assert_eq!(view.as_bytes(), b"payload");
    // While pinned its id stays taken; reviving it makes it readable again.
    assert!(matches!(
        store.put(other, b"payload"),
        Err(Error::AlreadyExists { .. })
    ));
    assert!(store.revive(other));
    assert_eq!(store.get(other).unwrap().as_bytes(), b"payload");
    store.delete(other).unwrap();
    drop(view);
    assert_eq!(store.stats().used, 0);
    assert!(!store.revive(other), "nothing pins it: it is gone for good");
}

fn the_largest_objects_and_the_pinned_ones_are_listed_where_they_lie(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 4 * MIB, MIB, backing);
    let sizes: BTreeMap<ObjectId, u64> = (1..=6).map(|n| (id(n), n as u64 * 100 * KIB)).collect();
    for (object, size) in &sizes {
        store.put(*object, &contents(*object, *size)).unwrap();
    }
    let pinned = store.get(id(2)).unwrap();
    // Spilled: everything unpinned goes to disk; the pinned one stays in memory.
    assert!(store.spill(4 * MIB).unwrap() > 0);
    let largest = store.largest(3);
    let mut expected: Vec<(ObjectId, u64)> = sizes.iter().map(|(o, s)| (*o, *s)).collect();
    expected.sort_by_key(|&(_, size)| std::cmp::Reverse(size));
    let listed: Vec<(ObjectId, u64)> = largest.iter().map(|o| (o.object, o.size)).collect();
    assert_eq!(listed, expected[..3]);
    assert!(
        largest
            .iter()
            .all(|o| o.residence == floe_objectstore::Residence::Spilled && o.pins == 0),
        "{largest:?}"
    );
    let all = store.largest(100);
    assert_eq!(all.len(), sizes.len());
    let two = all.iter().find(|o| o.object == id(2)).unwrap();
    assert_eq!(
        (two.residence, two.pins),
        (floe_objectstore::Residence::Memory, 1)
    );
    let stats = store.stats();
    assert_eq!((stats.pinned_objects, stats.pinned_bytes), (1, 200 * KIB));
    drop(pinned);
    assert_eq!(store.stats().pinned_objects, 0);
    store.delete(id(6)).unwrap();
    assert_eq!(
        store.largest(1)[0].object,
        id(5),
        "a deleted object is not listed"
    );
}

fn a_recorded_checksum_lasts_as_long_as_its_object(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 4 * MIB, MIB, backing);
    let (hashed, plain) = (id(1), id(2));
    let bytes = contents(hashed, 2 * MIB);
    let checksum = store.put_checksummed(hashed, &bytes).unwrap();
    assert_eq!(checksum, floe_core::hash::xxh3_64(&bytes));
    store.put(plain, &contents(plain, KIB)).unwrap();
    assert_eq!(store.checksum(hashed), Some(checksum));
    assert_eq!(store.checksum(plain), None, "nobody hashed it");

    // Spilled and restored, the object keeps its checksum.
    assert!(store.spill(4 * MIB).unwrap() > 0);
    assert!(store.stats().spilled_bytes > 0);
    assert_eq!(store.get(hashed).unwrap().as_bytes(), &bytes[..]);
    assert_eq!(store.checksum(hashed), Some(checksum));

    // A new object under the same id starts without one.
    store.delete(hashed).unwrap();
    assert_eq!(store.checksum(hashed), None);
    store.put(hashed, b"other bytes").unwrap();
    assert_eq!(store.checksum(hashed), None);
}

fn errors_name_the_object(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), MIB, MIB, backing);
    let object = id(7);
    let missing = store.get(object).unwrap_err().to_string();
    assert_eq!(missing, format!("object {object} not found"));
    let writer = store.create(object, 10).unwrap();
    let unsealed = store.get(object).unwrap_err().to_string();
    assert!(unsealed.contains("not sealed"), "{unsealed}");
    let twice = store.create(object, 10).unwrap_err().to_string();
    assert_eq!(twice, format!("object {object} already exists"));
    // An abandoned writer frees its space and its id.
    drop(writer);
    assert_eq!(store.stats().used, 0);
    store.put(object, b"0123456789").unwrap();
}

fn dropping_the_store_removes_its_segment_and_files(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), MIB, 256 * KIB, backing);
    let segment = shm_path(&store);
    assert_eq!(segment.is_some(), backing == Backing::SharedMemory);
    assert!(segment.as_ref().is_none_or(|segment| segment.exists()));
    for n in 0..8 {
        store.put(id(n), &contents(id(n), 200 * KIB)).unwrap();
    }
    assert!(!files_in(&dir.path().join("spill")).is_empty());
    let view = store.get(id(7)).unwrap();
    drop(store);
    // A live view keeps the mapping (and the pin) valid after the last store handle goes.
    assert_eq!(view.as_bytes(), &contents(id(7), 200 * KIB)[..]);
    drop(view);
    assert!(segment.is_none_or(|segment| !segment.exists()));
    assert!(files_in(&dir.path().join("spill")).is_empty());
}

fn spill_round_trip_of_three_times_the_capacity(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let capacity = 4 * MIB;
    let store = store_in(dir.path(), capacity, MIB, backing);
    let mut written = BTreeMap::new();
    let mut total = 0;
    let mut n = 0;
    while total < 3 * capacity {
        let object = id(n);
        // Sizes from a few bytes to 700 KiB, so fused files mix small and large objects.
        let len = (n as u64 * 7919 * 37) % (700 * KIB) + 3;
        store.put(object, &contents(object, len)).unwrap();
        written.insert(object, len);
        total += len;
        n += 1;
        let stats = store.stats();
        assert!(stats.used <= capacity);
    }
    let stats = store.stats();
    assert!(
        stats.spilled_objects > 0 && stats.spilled_bytes > 2 * capacity,
        "{stats:?}"
    );
    assert_eq!(stats.fallback_objects, 0);
    assert!(stats.used <= (capacity as f64 * 0.8) as u64 + 700 * KIB + 64);
    for (&object, &len) in &written {
        let view = store.get(object).unwrap();
        assert_eq!(view.as_bytes(), &contents(object, len)[..], "{object}");
    }
    let stats = store.stats();
    assert!(stats.restored_bytes_total > 2 * capacity, "{stats:?}");
    assert_eq!(stats.fallback_objects, 0);
}

fn a_fused_spill_file_is_removed_when_its_last_object_is_freed(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let capacity = 4 * MIB;
    let min_spilling_size = MIB;
    let store = store_in(dir.path(), capacity, min_spilling_size, backing);
    // 40 objects of 100 KiB: the first to be spilled are fused, about ten to a file.
    for n in 0..40 {
        store.put(id(n), &contents(id(n), 100 * KIB)).unwrap();
    }
    let first_file = store.spill_path(id(0)).unwrap();
    let fused: Vec<ObjectId> = (0..40)
        .map(id)
        .filter(|&object| store.spill_path(object).as_ref() == Some(&first_file))
        .collect();
    assert!(fused.len() > 1, "{fused:?}");
    let file_len = std::fs::metadata(&first_file).unwrap().len();
    assert!(file_len >= min_spilling_size, "{file_len}");
    assert_eq!(file_len, fused.len() as u64 * (64 + 100 * KIB));

    let (last, rest) = fused.split_last().unwrap();
    for &object in rest {
        store.delete(object).unwrap();
    }
    assert!(first_file.exists());
    // Restoring does not drop the spilled copy, so the file is still needed.
    drop(store.get(*last).unwrap());
    assert!(first_file.exists());
    store.delete(*last).unwrap();
    assert!(!first_file.exists());
}

fn a_corrupt_spill_file_is_an_error_never_wrong_data(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 2 * MIB, 256 * KIB, backing);
    for n in 0..8 {
        store.put(id(n), &contents(id(n), 300 * KIB)).unwrap();
    }
    let path = store.spill_path(id(0)).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    // Flip one bit in the middle of the first object's payload.
    bytes[64 + 150 * KIB as usize] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    for _ in 0..2 {
        let error = store.get(id(0)).unwrap_err();
        assert!(
            matches!(&error, Error::CorruptSpill { object, .. } if *object == id(0)),
            "{error}"
        );
        assert!(error.to_string().contains("checksum"), "{error}");
    }
    // A truncated file is caught too.
    let other = (1..8)
        .map(id)
        .find(|&object| store.spill_path(object).is_some_and(|p| p != path))
        .unwrap();
    let other_path = store.spill_path(other).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&other_path)
        .unwrap()
        .set_len(10)
        .unwrap();
    let error = store.get(other).unwrap_err();
    assert!(matches!(error, Error::CorruptSpill { .. }), "{error}");
    // The failed restores gave their memory back.
    let stats = store.stats();
    assert!(stats.used <= 2 * MIB, "{stats:?}");
}

fn a_store_full_of_pinned_objects_falls_back_to_disk(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let capacity = MIB;
    let store = store_in(dir.path(), capacity, 256 * KIB, backing);
    let pinned: Vec<_> = (0..3)
        .map(|n| {
            store.put(id(n), &contents(id(n), 300 * KIB)).unwrap();
            store.get(id(n)).unwrap()
        })
        .collect();
    let object = id(10);
    store.put(object, &contents(object, 300 * KIB)).unwrap();
    let stats = store.stats();
    assert_eq!(stats.fallback_objects, 1);
    assert_eq!(stats.fallback_bytes, 300 * KIB);
    let fallback_files = files_in(&dir.path().join("fallback"));
    assert_eq!(fallback_files.len(), 1);
    let view = store.get(object).unwrap();
    assert_eq!(view.as_bytes(), &contents(object, 300 * KIB)[..]);
    assert!(matches!(view.location().source, ObjectSource::File { .. }));
    drop(view);
    store.delete(object).unwrap();
    assert!(files_in(&dir.path().join("fallback")).is_empty());

    // An object larger than the whole store goes straight to disk.
    let huge = id(11);
    store.put(huge, &contents(huge, 3 * MIB)).unwrap();
    assert_eq!(
        store.get(huge).unwrap().as_bytes(),
        &contents(huge, 3 * MIB)[..]
    );
    drop(pinned);
}

fn when_fallback_fails_too_the_error_gives_the_sizes(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let config = config_in(dir.path(), MIB, 256 * KIB);
    let fallback_dir = config.fallback_dir.clone();
    let store = ObjectStore::open_with(config, backing).unwrap();
    // A file where the fallback directory should be: creating fallback files fails.
    std::fs::remove_dir(&fallback_dir).unwrap();
    std::fs::write(&fallback_dir, b"not a directory").unwrap();
    let _pinned: Vec<_> = (0..3)
        .map(|n| {
            store.put(id(n), &contents(id(n), 300 * KIB)).unwrap();
            store.get(id(n)).unwrap()
        })
        .collect();
    let object = id(10);
    let error = store.put(object, &contents(object, 300 * KIB)).unwrap_err();
    let text = error.to_string();
    assert!(matches!(error, Error::ObjectStoreFull { .. }), "{text}");
    let used = 3 * (64 + 300 * KIB);
    for needle in [
        object.to_string(),
        (300 * KIB).to_string(),
        used.to_string(),
        MIB.to_string(),
    ] {
        assert!(text.contains(&needle), "{needle} missing from: {text}");
    }
    let error = store.put(id(11), &contents(id(11), 2 * MIB)).unwrap_err();
    assert!(
        matches!(error, Error::ObjectTooLarge { size, capacity, .. } if size == 2 * MIB && capacity == MIB),
        "{error}"
    );
    // The failed creations left nothing behind.
    assert!(!store.contains(object));
    assert_eq!(store.stats().used, used);
}

fn concurrent_writers_and_readers_lose_and_tear_nothing(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 2 * MIB, 256 * KIB, backing);
    let sealed: Arc<Mutex<Vec<(ObjectId, u64)>>> = Arc::default();
    std::thread::scope(|scope| {
        for writer in 0..3u128 {
            let store = store.clone();
            let sealed = Arc::clone(&sealed);
            scope.spawn(move || {
                for n in 0..40u128 {
                    let object = id(writer << 32 | n);
                    let len = ((n as u64 * 131 + writer as u64 * 977) * 613) % (150 * KIB) + 1;
                    store.put(object, &contents(object, len)).unwrap();
                    sealed.lock().unwrap().push((object, len));
                }
            });
        }
        for reader in 0..3usize {
            let store = store.clone();
            let sealed = Arc::clone(&sealed);
            scope.spawn(move || {
                for round in 0..150usize {
                    let pick = {
                        let sealed = sealed.lock().unwrap();
                        (!sealed.is_empty()).then(|| sealed[(round * 7 + reader) % sealed.len()])
                    };
                    if let Some((object, len)) = pick {
                        let view = store.get(object).unwrap();
                        assert_eq!(view.as_bytes(), &contents(object, len)[..], "{object}");
                    }
                }
            });
        }
    });
    let sealed = sealed.lock().unwrap();
    assert_eq!(sealed.len(), 120);
    for &(object, len) in sealed.iter() {
        assert_eq!(
            store.get(object).unwrap().as_bytes(),
            &contents(object, len)[..]
        );
    }
    let stats = store.stats();
    assert!(stats.spilled_objects > 0, "{stats:?}");
}

fn spilling_on_request_frees_memory_in_lru_order(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 4 * MIB, 256 * KIB, backing);
    for n in 0..6 {
        store.put(id(n), &contents(id(n), 256 * KIB)).unwrap();
    }
    // Touch the oldest so it becomes the most recently used.
    drop(store.get(id(0)).unwrap());
    let freed = store.spill(600 * KIB).unwrap();
    // Whole objects go, fused to at least 256 KiB per file: three of them cover 600 KiB.
    assert_eq!(freed, 3 * (64 + 256 * KIB));
    let spilled: Vec<u128> = (0..6)
        .filter(|&n| store.spill_path(id(n)).is_some())
        .collect();
    assert_eq!(spilled, [1, 2, 3]);
    // Asking for more than there is frees everything unpinned and says how much.
    let pinned = store.get(id(5)).unwrap();
    let freed = store.spill(u64::MAX).unwrap();
    assert_eq!(freed, 2 * (64 + 256 * KIB));
    assert_eq!(store.stats().used, 64 + 256 * KIB);
    assert_eq!(pinned.as_bytes(), &contents(id(5), 256 * KIB)[..]);
}

/// What a crashed store of `config`'s name leaves: its segment, a spill file and a fallback
/// file — next to a file of another store whose name starts with this one's.
struct Remains {
    os_id: String,
    segment: PathBuf,
    spill: PathBuf,
    fallback: PathBuf,
    neighbour: PathBuf,
}

fn plant_remains(config: &floe_objectstore::StoreConfig) -> Remains {
    std::fs::create_dir_all(&config.spill_dir).unwrap();
    std::fs::create_dir_all(&config.fallback_dir).unwrap();
    let os_id = format!("/floe-{}", config.name);
    let mut segment = shared_memory::ShmemConf::new()
        .os_id(&os_id)
        .size(4096)
        .create()
        .unwrap();
    segment.set_owner(false);
    drop(segment);
    let remains = Remains {
        segment: PathBuf::from(format!("/dev/shm{os_id}")),
        os_id,
        spill: config
            .spill_dir
            .join(format!("{}-000003.spill", config.name)),
        fallback: config
            .fallback_dir
            .join(format!("{}-{}.object", config.name, id(5))),
        neighbour: config
            .spill_dir
            .join(format!("{}-2-000001.spill", config.name)),
    };
    for path in [&remains.spill, &remains.fallback, &remains.neighbour] {
        std::fs::write(path, b"left over").unwrap();
    }
    remains
}

fn a_store_reopened_under_a_dead_stores_name_clears_its_leftovers(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let config = config_in(dir.path(), MIB, 256 * KIB);
    let Remains {
        os_id,
        segment: segment_path,
        spill,
        fallback,
        neighbour,
    } = plant_remains(&config);
    let store = ObjectStore::open_with(config, backing).unwrap();
    assert!(!spill.exists() && !fallback.exists());
    assert!(neighbour.exists());
    store.put(id(1), b"fresh").unwrap();
    assert_eq!(store.get(id(1)).unwrap().as_bytes(), b"fresh");
    match backing {
        // The dead store's segment was unlinked: the new one of that name is the store's own.
        Backing::SharedMemory => {
            let ours = shared_memory::ShmemConf::new()
                .os_id(&os_id)
                .open()
                .unwrap();
            assert_eq!(ours.len() as u64, store.stats().capacity);
        }
        // A heap store keeps out of /dev/shm altogether, leftovers included.
        Backing::Heap => {
            assert!(segment_path.exists());
            let mut leftover = shared_memory::ShmemConf::new()
                .os_id(&os_id)
                .open()
                .unwrap();
            leftover.set_owner(true);
            drop(leftover);
            assert!(!segment_path.exists());
        }
    }
}

fn the_files_on_disk_are_exactly_those_of_live_objects(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 2 * MIB, 256 * KIB, backing);
    let spill_dir = dir.path().join("spill");
    let fallback_dir = dir.path().join("fallback");
    let on_disk = || -> BTreeSet<PathBuf> {
        files_in(&spill_dir)
            .into_iter()
            .chain(files_in(&fallback_dir))
            .collect()
    };
    let spill_files_of = |objects: &[ObjectId]| -> BTreeSet<PathBuf> {
        objects
            .iter()
            .filter_map(|&object| store.spill_path(object))
            .collect()
    };
    // 16 objects of 200 KiB in 2 MiB: most are spilled, fused about two to a file.
    let objects: Vec<ObjectId> = (0..16).map(id).collect();
    for &object in &objects {
        store.put(object, &contents(object, 200 * KIB)).unwrap();
    }
    // With the last three pinned, a 1.5 MiB object fits nowhere in memory: a fallback file.
    let pins: Vec<_> = objects[13..]
        .iter()
        .map(|&object| store.get(object).unwrap())
        .collect();
    let big = id(100);
    store.put(big, &contents(big, 1536 * KIB)).unwrap();
    assert_eq!(store.stats().fallback_objects, 1);
    let fallback = files_in(&fallback_dir);
    assert_eq!(fallback.len(), 1);

    let audit = store.audit_files().unwrap();
    let spilled = spill_files_of(&objects);
    assert!(spilled.len() > 2, "{spilled:?}");
    let mut expected = spilled.clone();
    expected.extend(fallback.iter().cloned());
    assert_eq!(audit.held, expected);
    assert_eq!(audit.on_disk, on_disk());
    assert!(
        audit.stray().is_empty() && audit.missing().is_empty(),
        "{audit:?}"
    );

    // Free the older half (the first spilled) and the fallback object: a file goes with its
    // last object, so what is left on disk is exactly what the survivors hold.
    let (freed, survivors) = objects.split_at(8);
    for &object in freed {
        assert_eq!(store.remove_ref(object).unwrap(), 0);
    }
    store.remove_ref(big).unwrap();
    let audit = store.audit_files().unwrap();
    assert_eq!(audit.held, spill_files_of(survivors));
    assert_eq!(audit.on_disk, on_disk());
    assert!(
        audit.stray().is_empty() && audit.missing().is_empty(),
        "{audit:?}"
    );
    assert!(
        audit.on_disk.len() < spilled.len(),
        "{audit:?} vs {spilled:?}"
    );
    assert!(files_in(&fallback_dir).is_empty());

    // A file no object holds is reported, and so is a held file that went missing.
    let stray = spill_dir.join(format!("{}-999999.spill", store.config().name));
    std::fs::write(&stray, b"nobody's").unwrap();
    let gone = audit.held.iter().next().unwrap().clone();
    std::fs::remove_file(&gone).unwrap();
    let audit = store.audit_files().unwrap();
    assert_eq!(audit.stray(), [&stray]);
    assert_eq!(audit.missing(), [&gone]);

    drop(pins);
    for &object in survivors {
        store.remove_ref(object).unwrap();
    }
    let audit = store.audit_files().unwrap();
    assert!(audit.held.is_empty(), "{audit:?}");
    assert_eq!(audit.on_disk, BTreeSet::from([stray]));
}

/// What a SIGKILLed node's store leaves — its segment, spill and fallback files — is removed
/// by name, and nothing of another store's.
#[test]
fn a_dead_stores_segment_and_files_are_removed_by_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let config = config_in(dir.path(), MIB, 256 * KIB);
    let Remains {
        segment: segment_path,
        spill,
        fallback,
        neighbour,
        ..
    } = plant_remains(&config);
    let removed: BTreeSet<PathBuf> = ObjectStore::remove_dead_store(&config)
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(
        removed,
        BTreeSet::from([segment_path.clone(), spill.clone(), fallback.clone()])
    );
    assert!(!segment_path.exists() && !spill.exists() && !fallback.exists());
    assert!(neighbour.exists());
    // Nothing left: nothing removed. Missing directories hold nothing either.
    assert!(ObjectStore::remove_dead_store(&config).unwrap().is_empty());
    let elsewhere = config_in(&dir.path().join("never-created"), MIB, KIB);
    assert!(
        ObjectStore::remove_dead_store(&elsewhere)
            .unwrap()
            .is_empty()
    );
    let mut bad = config.clone();
    bad.name = "../escape".into();
    let error = ObjectStore::remove_dead_store(&bad).unwrap_err();
    assert!(matches!(error, Error::InvalidStoreName { .. }), "{error}");
}

#[test]
fn a_heap_store_stays_out_of_shared_memory_and_clients_refuse_its_objects() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), MIB, 256 * KIB, Backing::Heap);
    let name = store.config().name.clone();
    assert_eq!(store.segment_name(), None);
    let in_shm: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|file| file.contains(&name))
        .collect();
    assert!(in_shm.is_empty(), "{in_shm:?}");

    let object = id(1);
    store.put(object, &contents(object, 300 * KIB)).unwrap();
    let view = store.get(object).unwrap();
    assert_eq!(
        view.location().source,
        ObjectSource::Heap {
            store: name.clone(),
            pid: std::process::id()
        }
    );
    let client = StoreClient::new();
    let error = client.open(view.location()).unwrap_err();
    assert!(
        matches!(&error, Error::NotShared { object: o, store, .. } if *o == object && *store == name),
        "{error}"
    );

    // A fallback object of a heap store is a file all the same, which any process can map.
    let _pinned: Vec<_> = (2..4)
        .map(|n| {
            store.put(id(n), &contents(id(n), 300 * KIB)).unwrap();
            store.get(id(n)).unwrap()
        })
        .collect();
    let on_disk = id(10);
    store.put(on_disk, &contents(on_disk, 300 * KIB)).unwrap();
    let pinned = store.get(on_disk).unwrap();
    assert!(matches!(
        pinned.location().source,
        ObjectSource::File { .. }
    ));
    let read = client.open(pinned.location()).unwrap();
    assert_ne!(read.as_bytes().as_ptr(), pinned.as_bytes().as_ptr());
    assert_eq!(read.as_bytes(), &contents(on_disk, 300 * KIB)[..]);
}
