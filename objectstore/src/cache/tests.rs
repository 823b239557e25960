use std::collections::BTreeSet;
use std::fs::{self, File};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arrow::array::{Array, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use floe_core::config::ByteSize;
use floe_core::fingerprint::{
    ArgChange, ArgValue, Args, Difference, FingerprintInputs, SourceDescription,
    TransformDescription,
};

use super::*;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("value", DataType::Float64, false),
        Field::new("name", DataType::Utf8, true),
    ]))
}

/// `rows` rows starting at `start`; `value` = 1.5 × id.
fn batch(start: i64, rows: i64) -> RecordBatch {
    let ids: Vec<i64> = (start..start + rows).collect();
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from(ids.clone())),
            Arc::new(Float64Array::from_iter_values(
                ids.iter().map(|id| *id as f64 * 1.5),
            )),
            Arc::new(StringArray::from_iter(
                ids.iter()
                    .map(|id| (id % 3 != 0).then(|| format!("row-{id}"))),
            )),
        ],
    )
    .unwrap()
}

fn source() -> FingerprintInputs {
    FingerprintInputs::Source(SourceDescription::range(1000))
}

fn map(parent: &FingerprintInputs, factor: f64) -> FingerprintInputs {
    let args = Args::new()
        .arg("expr", "x * factor")
        .arg_with_default("factor", factor, 1.0);
    FingerprintInputs::Transform(
        TransformDescription::new(vec![parent.clone()], "map", 1, &args).unwrap(),
    )
}

fn filter(parent: &FingerprintInputs) -> FingerprintInputs {
    let args = Args::new().arg("predicate", "x > 10");
    FingerprintInputs::Transform(
        TransformDescription::new(vec![parent.clone()], "filter", 2, &args).unwrap(),
    )
}

fn cache_in(dir: &Path, max_bytes: u64) -> Cache {
    Cache::open(CacheConfig {
        dir: dir.to_owned(),
        max_bytes: ByteSize(max_bytes),
        verification: Verification::Checksum,
    })
    .unwrap()
}

fn shard(rank: u32, count: u32) -> ShardIndex {
    ShardIndex::new(rank, count).unwrap()
}

fn write(cache: &Cache, inputs: &FingerprintInputs, index: ShardIndex, rows: i64) -> u64 {
    let outcome = cache
        .write_shard(
            CachePolicy::Reuse,
            inputs,
            index,
            &schema(),
            &[batch(0, rows / 2), batch(rows / 2, rows - rows / 2)],
        )
        .unwrap();
    match outcome {
        WriteOutcome::Written { bytes } => {
            cache.evict_to_cap(Some(inputs.fingerprint())).unwrap();
            bytes
        }
        other => panic!("expected a write, got {other:?}"),
    }
}

fn name(inputs: &FingerprintInputs, index: ShardIndex) -> ShardName {
    ShardName {
        fingerprint: inputs.fingerprint(),
        shard: index,
    }
}

fn set_last_used(cache: &Cache, name: &ShardName, secs: u64) {
    File::options()
        .write(true)
        .open(cache.config().dir.join(name.file_name()))
        .unwrap()
        .set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
        .unwrap();
}

/// A cache in a directory of its own holding one 1000-row shard of `map(source, 2.5)`.
struct OneShard {
    dir: tempfile::TempDir,
    cache: Cache,
    inputs: FingerprintInputs,
    name: ShardName,
    path: PathBuf,
    bytes: u64,
}

fn one_shard() -> OneShard {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache_in(dir.path(), u64::MAX);
    let inputs = map(&source(), 2.5);
    let bytes = write(&cache, &inputs, shard(0, 1), 1000);
    let name = name(&inputs, shard(0, 1));
    let path = dir.path().join(name.file_name());
    OneShard {
        dir,
        cache,
        inputs,
        name,
        path,
        bytes,
    }
}

/// The bytes one shard of `inputs` (rank `index`, 100 rows) takes, measured in a scratch cache.
fn shard_bytes(inputs: &FingerprintInputs, index: ShardIndex) -> u64 {
    let probe = tempfile::tempdir().unwrap();
    write(&cache_in(probe.path(), u64::MAX), inputs, index, 100)
}

/// Entries whose shards are all the same size: each manifest hashes one float.
fn equal_sized_entry(factor: f64) -> FingerprintInputs {
    map(&source(), 10.0 + factor)
}

/// The file mapped at `address` in this process, from the kernel's own list of mappings.
fn mapped_file_at(address: usize) -> Option<String> {
    let maps = fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        (start..end)
            .contains(&address)
            .then(|| fields.nth(4).unwrap_or_default().to_owned())
    })
}

#[test]
fn shard_names_round_trip_and_nothing_else_parses() {
    let fingerprint = Fingerprint::new(0xabc);
    let name = ShardName {
        fingerprint,
        shard: shard(3, 10),
    };
    assert_eq!(
        name.file_name(),
        "cache-00000000000000000000000000000abc_00003_of_00010.arrow"
    );
    assert_eq!(ShardName::parse(&name.file_name()), Some(name));
    for other in [
        ".tmp-cache-00000000000000000000000000000abc_00003_of_00010.arrow",
        "cache-00000000000000000000000000000abc_00003_of_00010.arrow.part",
        "cache-00000000000000000000000000000abc_3_of_10.arrow",
        "cache-00000000000000000000000000000abc_00010_of_00010.arrow",
        "cache-00000000000000000000000000000ABC_00003_of_00010.arrow",
        "cache-00000000000000000000000000000abc_00000_of_00000.arrow",
    ] {
        assert_eq!(ShardName::parse(other), None, "{other}");
    }
    assert!(matches!(
        ShardIndex::new(0, 100_000),
        Err(CacheError::InvalidShard { .. })
    ));
}

#[test]
fn a_written_shard_opens_verified_and_mapped_not_copied() {
    let OneShard {
        dir,
        cache,
        inputs,
        name,
        path,
        bytes,
    } = one_shard();
    assert_eq!(fs::metadata(&path).unwrap().len(), bytes);
    // Nothing but the shard is left behind.
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);

    assert_eq!(
        cache
            .lookup(inputs.fingerprint(), 1, CachePolicy::Reuse)
            .unwrap(),
        Lookup::FullHit { count: 1 }
    );
    let hit = cache.open_shard(name).unwrap().expect("a hit");
    assert_eq!(hit.block.batches, vec![batch(0, 500), batch(500, 500)]);

    // The column data lives in a mapping of the shard file, not on the heap.
    let values = hit.block.batches[1].column(1).to_data().buffers()[0].as_ptr() as usize;
    let mapped = mapped_file_at(values).expect("the address is mapped");
    assert!(mapped.ends_with(&name.file_name()), "{mapped}");

    // The manifest says what the file holds; its checksum covers the file up to the footer.
    let manifest = &hit.manifest;
    assert_eq!(manifest.fingerprint, inputs.fingerprint());
    assert_eq!((manifest.rank, manifest.count, manifest.rows), (0, 1, 1000));
    assert_eq!(manifest.inputs, inputs);
    let FingerprintInputs::Transform(description) = &manifest.inputs else {
        panic!("a transform")
    };
    let arg_names: Vec<&str> = description
        .args()
        .iter()
        .map(|arg| arg.name.as_str())
        .collect();
    assert_eq!(arg_names, ["expr", "factor"]);
    // The file is a 64-byte prefix, then the payload: an Arrow IPC file whose buffers are
    // 64-byte aligned in the mapping (the decoder refuses anything else).
    let file = fs::read(&path).unwrap();
    let payload = &file[64..];
    assert!(payload.starts_with(b"ARROW1"));
    let prefix = crate::mapping::ShardPrefix::decode(&file).expect("a shard prefix");
    assert_eq!(prefix.len, payload.len() as u64);
    assert_eq!(prefix.checksum, floe_core::hash::xxh3_64(payload));
    assert!(values.is_multiple_of(64));
    let data = &payload[..usize::try_from(manifest.data_bytes).unwrap()];
    assert_eq!(manifest.checksum, Checksum(floe_core::hash::xxh3_128(data)));
    assert_eq!(
        manifest
            .schema
            .iter()
            .map(|f| f.data_type.as_str())
            .collect::<Vec<_>>(),
        ["Int64", "Float64", "Utf8"]
    );
}

#[test]
fn a_torn_write_is_never_a_hit() {
    let OneShard {
        dir,
        cache,
        inputs,
        name,
        path,
        ..
    } = one_shard();
    let whole = fs::read(&path).unwrap();
    fs::remove_file(&path).unwrap();

    // A writer that died before its rename leaves only a temporary file: not a shard.
    fs::write(
        dir.path().join(".tmp-crashed.part"),
        &whole[..whole.len() / 2],
    )
    .unwrap();
    assert_eq!(
        cache
            .lookup(inputs.fingerprint(), 1, CachePolicy::Reuse)
            .unwrap(),
        Lookup::Miss
    );
    assert!(cache.shards().unwrap().is_empty());

    // A file cut short under the final name (a disk that lost the tail) fails verification,
    // is removed, and counts as a miss.
    fs::write(&path, &whole[..whole.len() - 100]).unwrap();
    assert!(cache.open_shard(name).unwrap().is_none());
    assert!(!path.exists());

    // So does one flipped bit in the data.
    let mut flipped = whole.clone();
    flipped[whole.len() / 3] ^= 0x10;
    fs::write(&path, &flipped).unwrap();
    assert!(cache.open_shard(name).unwrap().is_none());
    assert!(!path.exists());

    let stats = cache.stats().unwrap();
    assert_eq!((stats.corrupt_removed, stats.hits), (2, 0));
    assert_eq!(stats.misses, 3);
}

#[test]
fn a_failed_write_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache_in(dir.path(), u64::MAX);
    let other_schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
    let error = cache
        .write_shard(
            CachePolicy::Reuse,
            &map(&source(), 2.5),
            shard(0, 1),
            &other_schema,
            &[batch(0, 10)],
        )
        .unwrap_err();
    assert!(
        matches!(error, CacheError::SchemaMismatch { batch: 0, .. }),
        "{error}"
    );
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn a_replaced_file_is_verified_again() {
    let OneShard {
        dir,
        cache,
        name,
        path,
        ..
    } = one_shard();
    // The first open hashes the data and remembers this file.
    assert!(cache.open_shard(name).unwrap().is_some());
    assert!(cache.open_shard(name).unwrap().is_some());

    // A damaged copy renamed over it is a new file: its checksum is checked, not assumed.
    let mut damaged = fs::read(&path).unwrap();
    let middle = damaged.len() / 3;
    damaged[middle] ^= 0x01;
    let staged = dir.path().join(".tmp-damaged.part");
    fs::write(&staged, &damaged).unwrap();
    fs::rename(&staged, &path).unwrap();
    assert!(cache.open_shard(name).unwrap().is_none());
    assert!(!path.exists());
}

#[test]
fn a_shard_whose_manifest_disagrees_with_its_name_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache_in(dir.path(), u64::MAX);
    let a = map(&source(), 2.5);
    let b = map(&source(), 3.0);
    write(&cache, &a, shard(0, 1), 10);
    let impostor = dir.path().join(name(&b, shard(0, 1)).file_name());
    fs::copy(
        dir.path().join(name(&a, shard(0, 1)).file_name()),
        &impostor,
    )
    .unwrap();
    assert!(cache.open_shard(name(&b, shard(0, 1))).unwrap().is_none());
    assert!(!impostor.exists());
    assert!(cache.open_shard(name(&a, shard(0, 1))).unwrap().is_some());
}

#[test]
fn lookup_reports_partial_hits_with_their_missing_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache_in(dir.path(), u64::MAX);
    let inputs = map(&source(), 2.5);
    write(&cache, &inputs, shard(0, 4), 10);
    write(&cache, &inputs, shard(2, 4), 10);
    assert_eq!(
        cache
            .lookup(inputs.fingerprint(), 4, CachePolicy::Reuse)
            .unwrap(),
        Lookup::PartialHit {
            count: 4,
            missing: vec![1, 3]
        }
    );
    // Another fingerprint's shards are not this one's.
    assert_eq!(
        cache
            .lookup(map(&source(), 3.0).fingerprint(), 4, CachePolicy::Reuse)
            .unwrap(),
        Lookup::Miss
    );
}

#[test]
fn complete_shards_of_another_count_are_reused() {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache_in(dir.path(), u64::MAX);
    let inputs = map(&source(), 2.5);
    let fp = inputs.fingerprint();
    let write_all = |count: u32| {
        (0..count).for_each(|rank| {
            write(&cache, &inputs, shard(rank, count), 4);
        })
    };

    // An incomplete set of another count is not reusable.
    (0..5).for_each(|rank| {
        write(&cache, &inputs, shard(rank, 8), 4);
    });
    assert_eq!(
        cache.lookup(fp, 4, CachePolicy::Reuse).unwrap(),
        Lookup::Miss
    );

    write_all(2);
    write_all(6);
    // Both complete and 2 away from 4: the smaller count wins.
    assert_eq!(
        cache.lookup(fp, 4, CachePolicy::Reuse).unwrap(),
        Lookup::OtherShardCount { count: 2 }
    );
    // Nearest count wins.
    assert_eq!(
        cache.lookup(fp, 5, CachePolicy::Reuse).unwrap(),
        Lookup::OtherShardCount { count: 6 }
    );
    // Fewest missing wins over the requested count's partial set.
    write(&cache, &inputs, shard(0, 3), 4);
    assert_eq!(
        cache.lookup(fp, 3, CachePolicy::Reuse).unwrap(),
        Lookup::OtherShardCount { count: 2 }
    );
    // And the requested count wins once it is complete.
    (1..3).for_each(|rank| {
        write(&cache, &inputs, shard(rank, 3), 4);
    });
    assert_eq!(
        cache.lookup(fp, 3, CachePolicy::Reuse).unwrap(),
        Lookup::FullHit { count: 3 }
    );
    // The chosen set opens.
    let hit = cache
        .open_shard(name(&inputs, shard(1, 6)))
        .unwrap()
        .unwrap();
    assert_eq!(hit.block.num_rows(), 4);
}

#[test]
fn recompute_overwrites_and_disabled_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache_in(dir.path(), u64::MAX);
    let inputs = map(&source(), 2.5);
    let index = shard(0, 1);
    write(&cache, &inputs, index, 10);
    let rewrite = |policy, rows| {
        cache
            .write_shard(policy, &inputs, index, &schema(), &[batch(100, rows)])
            .unwrap()
    };
    assert_eq!(rewrite(CachePolicy::Reuse, 7), WriteOutcome::AlreadyCached);
    assert_eq!(
        cache
            .lookup(inputs.fingerprint(), 1, CachePolicy::Recompute)
            .unwrap(),
        Lookup::Miss
    );
    assert!(matches!(
        rewrite(CachePolicy::Recompute, 7),
        WriteOutcome::Written { .. }
    ));
    let hit = cache.open_shard(name(&inputs, index)).unwrap().unwrap();
    assert_eq!(hit.block.batches, vec![batch(100, 7)]);

    let other = map(&source(), 9.0);
    let outcome = cache
        .write_shard(
            CachePolicy::Disabled,
            &other,
            index,
            &schema(),
            &[batch(0, 5)],
        )
        .unwrap();
    assert_eq!(outcome, WriteOutcome::Disabled);
    assert_eq!(
        cache
            .lookup(inputs.fingerprint(), 1, CachePolicy::Disabled)
            .unwrap(),
        Lookup::Miss
    );
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    assert_eq!(cache.stats().unwrap().bypassed, 2);
}

#[test]
fn eviction_keeps_the_cache_under_its_cap_and_spares_open_shards() {
    let dir = tempfile::tempdir().unwrap();
    let entry = equal_sized_entry;
    let one = shard_bytes(&entry(0.0), shard(0, 1));
    // Room for three shards of this size, not four.
    let cap = one * 3 + one / 2;
    let cache = cache_in(dir.path(), cap);
    let entries: Vec<FingerprintInputs> = (1..=3).map(|i| entry(f64::from(i))).collect();
    for (age, inputs) in entries.iter().enumerate() {
        assert_eq!(write(&cache, inputs, shard(0, 1), 100), one);
        set_last_used(&cache, &name(inputs, shard(0, 1)), 1_000 + age as u64);
    }
    assert_eq!(cache.stats().unwrap().bytes, 3 * one);

    // The least recently used shard is open: it stays, the next oldest goes.
    let open = cache
        .open_shard(name(&entries[0], shard(0, 1)))
        .unwrap()
        .unwrap();
    set_last_used(&cache, &name(&entries[0], shard(0, 1)), 500);
    let fourth = entry(4.0);
    write(&cache, &fourth, shard(0, 1), 100);
    let left: BTreeSet<Fingerprint> = cache
        .shards()
        .unwrap()
        .iter()
        .map(|s| s.name.fingerprint)
        .collect();
    let expected: BTreeSet<Fingerprint> = [&entries[0], &entries[2], &fourth]
        .iter()
        .map(|inputs| inputs.fingerprint())
        .collect();
    assert_eq!(left, expected);
    assert!(cache.stats().unwrap().bytes <= cap);

    // Opening a shard makes it the most recently used.
    drop(
        cache
            .open_shard(name(&entries[2], shard(0, 1)))
            .unwrap()
            .unwrap(),
    );
    // Once closed, the oldest shard can go; the one just used stays.
    drop(open);
    write(&cache, &entry(5.0), shard(0, 1), 100);
    let left: BTreeSet<Fingerprint> = cache
        .shards()
        .unwrap()
        .iter()
        .map(|s| s.name.fingerprint)
        .collect();
    assert!(!left.contains(&entries[0].fingerprint()));
    assert!(left.contains(&entries[2].fingerprint()));
    assert_eq!(cache.stats().unwrap().evicted_shards, 2);
    assert!(cache.stats().unwrap().bytes <= cap);
}

#[test]
fn an_output_being_written_does_not_evict_its_own_shards() {
    let dir = tempfile::tempdir().unwrap();
    let one = shard_bytes(&map(&source(), 7.0), shard(0, 4));
    let cache = cache_in(dir.path(), one * 2 + one / 2);
    let old = map(&source(), 8.0);
    write(&cache, &old, shard(0, 4), 100);
    set_last_used(&cache, &name(&old, shard(0, 4)), 1_000);
    let output = map(&source(), 9.0);
    for rank in 0..3 {
        write(&cache, &output, shard(rank, 4), 100);
        set_last_used(
            &cache,
            &name(&output, shard(rank, 4)),
            2_000 + u64::from(rank),
        );
    }
    // The older entry went first; then the cap gave way to the output's own shards.
    let left: Vec<ShardName> = cache.shards().unwrap().iter().map(|s| s.name).collect();
    assert_eq!(
        left,
        (0..3)
            .map(|rank| name(&output, shard(rank, 4)))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        cache
            .lookup(output.fingerprint(), 4, CachePolicy::Reuse)
            .unwrap(),
        Lookup::PartialHit {
            count: 4,
            missing: vec![3]
        }
    );
}

#[test]
fn a_pinned_cache_exceeds_its_cap_rather_than_evicting() {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache_in(dir.path(), 1);
    let a = map(&source(), 1.0);
    write(&cache, &a, shard(0, 1), 10);
    let open = cache.open_shard(name(&a, shard(0, 1))).unwrap().unwrap();
    let b = map(&source(), 2.0);
    write(&cache, &b, shard(0, 1), 10);
    // `b` was just written and `a` is open: both stay.
    assert_eq!(cache.shards().unwrap().len(), 2);
    // The batches alone keep the pin: dropping the rest of the hit does not release it.
    let batches = open.block.batches.clone();
    drop(open);
    assert_eq!(cache.evict_to_cap(None).unwrap().shards, 1);
    assert_eq!(cache.shards().unwrap()[0].name.fingerprint, a.fingerprint());
    drop(batches);
    assert_eq!(cache.evict_to_cap(None).unwrap().shards, 1);
    assert!(cache.shards().unwrap().is_empty());
}

#[test]
fn cleanup_keeps_live_fingerprints_and_removes_crash_debris() {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache_in(dir.path(), u64::MAX);
    let live = map(&source(), 1.0);
    let dead = map(&source(), 2.0);
    write(&cache, &live, shard(0, 2), 10);
    write(&cache, &live, shard(1, 2), 10);
    let dead_bytes = write(&cache, &dead, shard(0, 1), 10);
    let old_temp = dir.path().join(".tmp-old.part");
    let new_temp = dir.path().join(".tmp-new.part");
    fs::write(&old_temp, b"partial").unwrap();
    fs::write(&new_temp, b"partial").unwrap();
    File::options()
        .write(true)
        .open(&old_temp)
        .unwrap()
        .set_modified(SystemTime::now() - Duration::from_secs(7200))
        .unwrap();

    let removed = cache
        .cleanup(&BTreeSet::from([live.fingerprint()]))
        .unwrap();
    assert_eq!(
        removed,
        Removed {
            shards: 1,
            bytes: dead_bytes
        }
    );
    let left: Vec<ShardName> = cache.shards().unwrap().iter().map(|s| s.name).collect();
    assert_eq!(left, [name(&live, shard(0, 2)), name(&live, shard(1, 2))]);
    assert!(!old_temp.exists());
    assert!(
        new_temp.exists(),
        "a young temporary file may be a write in progress"
    );
}

#[test]
fn stats_count_hits_misses_and_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache_in(dir.path(), u64::MAX);
    let inputs = map(&source(), 1.0);
    assert_eq!(
        cache
            .lookup(inputs.fingerprint(), 1, CachePolicy::Reuse)
            .unwrap(),
        Lookup::Miss
    );
    let bytes = write(&cache, &inputs, shard(0, 1), 10);
    cache
        .open_shard(name(&inputs, shard(0, 1)))
        .unwrap()
        .unwrap();
    cache
        .open_shard(name(&inputs, shard(0, 1)))
        .unwrap()
        .unwrap();
    assert!(
        cache
            .open_shard(name(&inputs, shard(0, 2)))
            .unwrap()
            .is_none()
    );
    let stats = cache.stats().unwrap();
    assert_eq!((stats.hits, stats.misses), (2, 2));
    assert_eq!((stats.bytes, stats.bytes_written), (bytes, bytes));
}

#[test]
fn explain_miss_names_the_argument_or_parent_that_changed() {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache_in(dir.path(), u64::MAX);
    assert_eq!(
        cache.explain_miss(&source()).unwrap(),
        MissExplanation::Empty
    );

    let cached = filter(&map(&source(), 2.5));
    write(&cache, &cached, shard(0, 1), 10);
    // A different operation over the same input is further away than the cached filter.
    let sort = FingerprintInputs::Transform(
        TransformDescription::new(
            vec![map(&source(), 2.5)],
            "sort",
            1,
            &Args::new().arg("key", "x"),
        )
        .unwrap(),
    );
    write(&cache, &sort, shard(0, 1), 10);

    assert_eq!(
        cache.explain_miss(&cached).unwrap(),
        MissExplanation::Cached { counts: vec![1] }
    );
    let requested = filter(&map(&source(), 3.0));
    let explanation = cache.explain_miss(&requested).unwrap();
    assert_eq!(
        explanation,
        MissExplanation::Nearest {
            fingerprint: cached.fingerprint(),
            differences: vec![Difference::Parent {
                transform: "filter@2".into(),
                index: 0,
                differences: vec![Difference::Argument {
                    transform: "map@1".into(),
                    name: "factor".into(),
                    change: ArgChange::Changed {
                        requested: ArgValue::Float(3.0),
                        stored: ArgValue::Float(2.5),
                    },
                }],
            }],
        }
    );
    assert!(
        explanation
            .to_string()
            .contains("argument `factor` of map@1 is 3.0")
    );

    let longer = FingerprintInputs::Source(SourceDescription::range(2000));
    let explanation = cache.explain_miss(&filter(&map(&longer, 2.5))).unwrap();
    let MissExplanation::Nearest { differences, .. } = explanation else {
        panic!("a nearest entry")
    };
    assert!(
        differences[0]
            .to_string()
            .ends_with("range(2000) where the cached entry read range(1000)"),
        "{}",
        differences[0]
    );
}

#[test]
fn a_node_cache_takes_its_directory_and_cap_from_the_config() {
    let data_dir = tempfile::tempdir().unwrap();
    let entry = equal_sized_entry;
    let one = shard_bytes(&entry(0.0), shard(0, 1));
    // Room for two shards, not three; the cap comes from the environment, as an operator
    // would set it.
    let cap = one * 2 + one / 2;
    let config = floe_core::config::ConfigLoader::new()
        .env([("FLOE_CACHE_MAX_BYTES".to_owned(), cap.to_string())])
        .set(&format!("paths.data_dir={}", data_dir.path().display()))
        .unwrap()
        .set("data.min_block_size=1")
        .unwrap()
        .set(&format!("data.max_block_size={one}"))
        .unwrap()
        .load()
        .unwrap();
    let cache = Cache::open(CacheConfig::for_node(&config)).unwrap();
    assert_eq!(cache.config().dir, data_dir.path().join("cache"));
    assert_eq!(cache.config().max_bytes, ByteSize(cap));

    for factor in 1..=3 {
        assert_eq!(
            write(&cache, &entry(f64::from(factor)), shard(0, 1), 100),
            one
        );
    }
    let stats = cache.stats().unwrap();
    assert_eq!((stats.evicted_shards, stats.bytes), (1, 2 * one));
    let files = fs::read_dir(data_dir.path().join("cache")).unwrap().count();
    assert_eq!(files, 2);
}

/// The offset of the first occurrence of `needle` in `haystack`.
fn find(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
        .expect("the bytes are in the file")
}

#[test]
fn a_projected_open_checks_exactly_the_pieces_it_returns() {
    let dir = tempfile::tempdir().unwrap();
    let inputs = map(&source(), 4.0);
    let rows = 600_000;
    write(&cache_in(dir.path(), u64::MAX), &inputs, shard(0, 1), rows);
    let name = name(&inputs, shard(0, 1));
    let path = dir.path().join(name.file_name());
    let whole = fs::read(&path).unwrap();

    // Every piece of the data bytes has its own checksum in the manifest.
    let manifest = shard::read_manifest_at(&path).ok().unwrap();
    let data = &whole[64..64 + usize::try_from(manifest.data_bytes).unwrap()];
    let pieces: Vec<u64> = data
        .chunks(usize::try_from(manifest.chunk_bytes).unwrap())
        .map(floe_core::hash::xxh3_64)
        .collect();
    assert!(pieces.len() > 8, "{} pieces", pieces.len());
    assert_eq!(manifest.chunk_checksums, pieces);

    // Only the asked-for column comes back, mapped from the file, with its values.
    let hit = cache_in(dir.path(), u64::MAX)
        .open_shard_columns(name, &[1])
        .unwrap()
        .expect("a hit");
    let values: Vec<f64> = hit
        .block
        .batches
        .iter()
        .flat_map(|batch| {
            assert_eq!(batch.num_columns(), 1);
            let column = batch
                .column(0)
                .as_any()
                .downcast_ref::<Float64Array>()
                .unwrap();
            column.values().to_vec()
        })
        .collect();
    assert_eq!(values.len(), rows as usize);
    assert!(
        values
            .iter()
            .enumerate()
            .all(|(id, v)| *v == id as f64 * 1.5)
    );
    let address = hit.block.batches[0].column(0).to_data().buffers()[0].as_ptr() as usize;
    assert!(
        mapped_file_at(address)
            .unwrap()
            .ends_with(&name.file_name())
    );
    drop(hit);

    // A damaged byte in a column it does not return does not fail it; a whole open finds it
    // and removes the shard.
    let mut damaged = whole.clone();
    damaged[find(&whole, b"row-599998")] ^= 0x20;
    fs::write(&path, &damaged).unwrap();
    let cache = cache_in(dir.path(), u64::MAX);
    assert!(cache.open_shard_columns(name, &[1]).unwrap().is_some());
    assert!(cache.open_shard(name).unwrap().is_none());
    assert!(!path.exists());

    // A damaged byte in the column it returns fails it, and the shard goes.
    let mut damaged = whole.clone();
    damaged[find(&whole, &(599_998.0f64 * 1.5).to_le_bytes())] ^= 0x01;
    fs::write(&path, &damaged).unwrap();
    let cache = cache_in(dir.path(), u64::MAX);
    assert!(cache.open_shard_columns(name, &[1]).unwrap().is_none());
    assert!(!path.exists());

    // Asking for a column the shard lacks is an error, and the shard stays.
    fs::write(&path, &whole).unwrap();
    let error = cache.open_shard_columns(name, &[3]).unwrap_err();
    assert!(
        error.to_string().contains("has no column 3: it has 3"),
        "{error}"
    );
    assert!(path.exists());
}

#[test]
fn shards_to_remove_are_picked_without_removing_them_then_removed() {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache_in(dir.path(), u64::MAX);
    let one = shard_bytes(&equal_sized_entry(1.0), shard(0, 1));
    let entries: Vec<FingerprintInputs> =
        (1..=3).map(|i| equal_sized_entry(f64::from(i))).collect();
    for (age, inputs) in entries.iter().enumerate() {
        write(&cache, inputs, shard(0, 1), 100);
        set_last_used(&cache, &name(inputs, shard(0, 1)), 1_000 + age as u64);
    }
    // Room for two: the least recently used one is picked, and nothing is removed yet.
    let picked = cache.least_recently_used_beyond(2 * one).unwrap();
    let picked_names: Vec<ShardName> = picked.iter().map(|shard| shard.name).collect();
    assert_eq!(picked_names, vec![name(&entries[0], shard(0, 1))]);
    assert_eq!(cache.shards().unwrap().len(), 3);
    assert!(
        cache
            .least_recently_used_beyond(3 * one)
            .unwrap()
            .is_empty()
    );

    let of_third: BTreeSet<Fingerprint> = [entries[2].fingerprint()].into();
    let third = cache.shards_of(&of_third).unwrap();
    assert_eq!(third.len(), 1);
    let removed = cache
        .remove_files(&[picked, third.clone()].concat())
        .unwrap();
    assert_eq!((removed.shards, removed.bytes), (2, 2 * one));
    let left: Vec<ShardName> = cache.shards().unwrap().iter().map(|s| s.name).collect();
    assert_eq!(left, vec![name(&entries[1], shard(0, 1))]);
    // Gone already: not counted again.
    assert_eq!(cache.remove_files(&third).unwrap().shards, 0);
}

#[test]
fn a_served_shard_is_read_whole_once_per_state_of_its_file() {
    let OneShard {
        dir: _dir,
        cache,
        name,
        path,
        ..
    } = one_shard();
    // Written by this cache, which hashed what it wrote: serving it reads the prefix and the
    // footer, and the object's checksum is the prefix's.
    let served = cache.serve_shard(name).unwrap().expect("a hit");
    let file = fs::read(&path).unwrap();
    assert_eq!(served.len, file.len() as u64 - 64);
    assert_eq!(served.checksum, floe_core::hash::xxh3_64(&file[64..]));
    assert_eq!(served.rows, 1000);
    let metadata = fs::metadata(&path).unwrap();
    assert_eq!(
        (served.device, served.inode),
        (
            std::os::unix::fs::MetadataExt::dev(&metadata),
            std::os::unix::fs::MetadataExt::ino(&metadata)
        )
    );

    // What the verdict trusts: a byte changed in place with the file's state put back as it
    // was (same inode, length and modification time) is not looked for. (That state is the
    // one after the hit above advanced the LRU clock: the verdict followed the cache's own
    // touch, or this serve would read the file again.)
    let verified_at = metadata.modified().unwrap();
    let at = file.len() / 3;
    let writable = File::options().write(true).open(&path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&writable, &[file[at] ^ 0x08], at as u64).unwrap();
    writable.set_modified(verified_at).unwrap();
    drop(writable);
    assert!(cache.serve_shard(name).unwrap().is_some());

    // Any change of that state — here the modification time, which a write in place sets —
    // makes the next use read the file whole: the damage is found and the shard removed.
    set_last_used(&cache, &name, 1_000);
    assert!(cache.serve_shard(name).unwrap().is_none());
    assert!(!path.exists());
    assert_eq!(cache.stats().unwrap().corrupt_removed, 1);
}

#[test]
fn a_shard_written_before_prefixes_is_a_miss_and_removed() {
    let OneShard {
        dir,
        inputs,
        name,
        path,
        ..
    } = one_shard();
    // The older layout: the Arrow IPC file from the file's first byte, no prefix.
    let whole = fs::read(&path).unwrap();
    fs::write(&path, &whole[64..]).unwrap();
    let cache = cache_in(dir.path(), u64::MAX);
    assert_eq!(
        cache
            .lookup(inputs.fingerprint(), 1, CachePolicy::Reuse)
            .unwrap(),
        Lookup::FullHit { count: 1 }
    );
    assert!(cache.serve_shard(name).unwrap().is_none());
    assert!(!path.exists());
    fs::write(&path, &whole[64..]).unwrap();
    assert!(cache.open_shard_columns(name, &[]).unwrap().is_none());
    assert!(!path.exists());
    assert_eq!(cache.stats().unwrap().corrupt_removed, 2);
}
