//! Two real processes writing the same cache shard at the same time.
//!
//! The test binary runs itself twice as a child (selected by an environment variable); both
//! children wait for a start file, then rewrite the same shard many times with `Recompute`, so
//! their temporary files, renames and directory fsyncs interleave.

// Test helpers outside `#[test]` functions unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use floe_core::config::ByteSize;
use floe_core::fingerprint::{Args, FingerprintInputs, SourceDescription, TransformDescription};
use floe_objectstore::cache::{
    Cache, CacheConfig, CachePolicy, Lookup, ShardIndex, ShardName, Verification, WriteOutcome,
};

const CHILD_DIR_ENV: &str = "FLOE_CACHE_TEST_CHILD_DIR";
const TEST_NAME: &str = "two_processes_writing_one_fingerprint_leave_one_valid_file";
const ROUNDS: usize = 25;
const ROWS: i64 = 100_000;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]))
}

fn batch() -> RecordBatch {
    RecordBatch::try_new(
        schema(),
        vec![Arc::new(Int64Array::from_iter_values(0..ROWS))],
    )
    .unwrap()
}

fn inputs() -> FingerprintInputs {
    let source = FingerprintInputs::Source(SourceDescription::range(ROWS as u64));
    FingerprintInputs::Transform(
        TransformDescription::new(vec![source], "identity", 1, &Args::new()).unwrap(),
    )
}

fn cache(dir: &Path) -> Cache {
    Cache::open(CacheConfig {
        dir: dir.to_owned(),
        max_bytes: ByteSize::gib(1),
        verification: Verification::Checksum,
    })
    .unwrap()
}

fn child(dir: PathBuf) {
    let start = dir.join("start");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !start.exists() {
        assert!(Instant::now() < deadline, "the parent never said start");
        std::thread::sleep(Duration::from_millis(1));
    }
    let cache = cache(&dir.join("cache"));
    let index = ShardIndex::new(0, 1).unwrap();
    for _ in 0..ROUNDS {
        let outcome = cache
            .write_shard(
                CachePolicy::Recompute,
                &inputs(),
                index,
                &schema(),
                &[batch()],
            )
            .unwrap();
        assert!(matches!(outcome, WriteOutcome::Written { .. }));
    }
}

#[test]
fn two_processes_writing_one_fingerprint_leave_one_valid_file() {
    if let Some(dir) = std::env::var_os(CHILD_DIR_ENV) {
        child(PathBuf::from(dir));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|_| {
            Command::new(&exe)
                .args(["--exact", TEST_NAME, "--test-threads", "1"])
                .env(CHILD_DIR_ENV, dir.path())
                .spawn()
                .unwrap()
        })
        .collect();
    std::fs::write(dir.path().join("start"), b"go").unwrap();
    for mut child in children {
        assert!(child.wait().unwrap().success(), "a writer failed");
    }

    let cache_dir = dir.path().join("cache");
    let files: Vec<String> = std::fs::read_dir(&cache_dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .collect();
    let name = ShardName {
        fingerprint: inputs().fingerprint(),
        shard: ShardIndex::new(0, 1).unwrap(),
    };
    // One shard and no temporary files left behind.
    assert_eq!(files, [name.file_name()]);
    let cache = cache(&cache_dir);
    assert_eq!(
        cache
            .lookup(name.fingerprint, 1, CachePolicy::Reuse)
            .unwrap(),
        Lookup::FullHit { count: 1 }
    );
    let hit = cache
        .open_shard(name)
        .unwrap()
        .expect("the surviving file verifies");
    assert_eq!(hit.block.batches, [batch()]);
}
