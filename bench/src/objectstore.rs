//! `floe-bench objectstore`: the object store against the machine's own baselines.
//!
//! Figures, each measured in this run (medians of several runs after a warm-up):
//! - `put_gbps` (create + copy in + seal) against `memcpy_gbps` of the same bytes into a warm
//!   buffer, and `get_gbps` (size / latency of a zero-copy get), for 1, 64 and 256 MiB objects;
//! - `get_decode_ms`: get an Arrow block and decode it, for 1, 64 and 256 MiB blocks of
//!   fixed-width columns;
//! - `spill_gbps` (spill a store's worth of objects to one fused file set) against
//!   `disk_write_gbps` (write the same bytes to a plain file), and `restore_gbps` (get them
//!   all back) against `disk_read_gbps` (read the plain file back). Neither side fsyncs: spill
//!   files are scratch data the store never needs after a crash.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use arrow::array::{ArrayRef, Int64Array, RecordBatch};
use floe_core::{Config, ObjectId};
use floe_objectstore::block::{read_block, write_block};
use floe_objectstore::{ObjectStore, StoreConfig};
use serde_json::json;

use super::{gbps, median_time, print_figure};

const MIB: u64 = 1 << 20;
const BENCH: &str = "objectstore";

pub fn run(quick: bool, config: &Config) -> anyhow::Result<()> {
    let runs = if quick { 3 } else { 7 };
    let scratch = Scratch::new(config)?;
    let store = ObjectStore::open(StoreConfig {
        name: format!("bench-{}", std::process::id()),
        capacity: 768 * MIB,
        spill_threshold: 0.8,
        min_spilling_size: config.memory.min_spilling_size.bytes(),
        spill_dir: scratch.0.join("spill"),
        fallback_dir: scratch.0.join("fallback"),
    })?;
    let mut ids = (1u128..).map(ObjectId::new);

    for size in [MIB, 64 * MIB, 256 * MIB] {
        put_get_memcpy(&store, &mut ids, size, runs)?;
    }
    for size in [MIB, 64 * MIB, 256 * MIB] {
        get_decode(&store, &mut ids, size, runs)?;
    }
    let spill_total = if quick { 128 * MIB } else { 512 * MIB };
    spill_restore(&store, &mut ids, &scratch.0, spill_total, runs.min(3))?;
    Ok(())
}

fn put_get_memcpy(
    store: &ObjectStore,
    ids: &mut impl Iterator<Item = ObjectId>,
    size: u64,
    runs: usize,
) -> anyhow::Result<()> {
    let source = pattern(size, 0);
    let mut target = vec![0u8; size as usize];
    // Warm-up: the first put faults the segment's pages in; later puts reuse them, as a
    // long-running store does.
    let warm = ids.next().context("ids")?;
    store.put(warm, &source)?;
    store.delete(warm)?;
    let memcpy = median_time(runs, || {
        let started = Instant::now();
        target.copy_from_slice(&source);
        let elapsed = started.elapsed();
        std::hint::black_box(&target);
        Ok(elapsed)
    })?;
    let mut get = Vec::new();
    let put = median_time(runs, || {
        let object = ids.next().context("ids")?;
        let started = Instant::now();
        store.put(object, &source)?;
        let elapsed = started.elapsed();
        let started = Instant::now();
        let view = store.get(object)?;
        get.push(started.elapsed());
        ensure!(view.as_bytes()[size as usize - 1] == source[size as usize - 1]);
        drop(view);
        store.delete(object)?;
        Ok(elapsed)
    })?;
    get.sort();
    let get = get[get.len() / 2];
    let labels = [("size_mib", json!(size / MIB))];
    print_figure(BENCH, "put_gbps", gbps(size, put), "GB/s", &labels);
    print_figure(BENCH, "memcpy_gbps", gbps(size, memcpy), "GB/s", &labels);
    print_figure(
        BENCH,
        "put_to_memcpy",
        memcpy.as_secs_f64() / put.as_secs_f64(),
        "ratio",
        &labels,
    );
    print_figure(BENCH, "get_gbps", gbps(size, get), "GB/s", &labels);
    print_figure(BENCH, "get_us", micros(get), "us", &labels);
    Ok(())
}

fn get_decode(
    store: &ObjectStore,
    ids: &mut impl Iterator<Item = ObjectId>,
    size: u64,
    runs: usize,
) -> anyhow::Result<()> {
    const COLUMNS: u64 = 4;
    let rows = (size / 8 / COLUMNS) as i64;
    let columns: Vec<(String, ArrayRef)> = (0..COLUMNS as i64)
        .map(|column| {
            let values = Int64Array::from_iter_values((0..rows).map(|row| row * 4 + column));
            (format!("c{column}"), Arc::new(values) as ArrayRef)
        })
        .collect();
    let batch = RecordBatch::try_from_iter(columns)?;
    let object = ids.next().context("ids")?;
    let stored = write_block(store, object, &batch.schema(), std::slice::from_ref(&batch))?;
    let decode = median_time(runs, || {
        let started = Instant::now();
        let block = read_block(&store.get(object)?)?;
        let elapsed = started.elapsed();
        ensure!(block.num_rows() == rows as usize);
        Ok(elapsed)
    })?;
    store.delete(object)?;
    let labels = [
        ("size_mib", json!(size / MIB)),
        ("stored_bytes", json!(stored)),
    ];
    print_figure(BENCH, "get_decode_ms", millis(decode), "ms", &labels);
    Ok(())
}

fn spill_restore(
    store: &ObjectStore,
    ids: &mut impl Iterator<Item = ObjectId>,
    scratch: &Path,
    total: u64,
    runs: usize,
) -> anyhow::Result<()> {
    const OBJECT: u64 = 16 * MIB;
    let count = total / OBJECT;
    // Distinct bytes per object, so neither side reads from a cache-resident source.
    let mut data: Vec<Vec<u8>> = (0..count).map(|n| pattern(OBJECT, n)).collect();
    let mut spill = Vec::new();
    let mut restore = Vec::new();
    for _ in 0..runs {
        let objects: Vec<ObjectId> = ids.take(count as usize).collect();
        for (&object, bytes) in objects.iter().zip(&data) {
            store.put(object, bytes)?;
        }
        let before = store.stats();
        let started = Instant::now();
        store.spill(u64::MAX)?;
        spill.push(started.elapsed());
        let after = store.stats();
        ensure!(
            after.spilled_bytes_total - before.spilled_bytes_total == total,
            "spilled {} bytes, expected {total}",
            after.spilled_bytes_total - before.spilled_bytes_total
        );
        let started = Instant::now();
        for &object in &objects {
            let view = store.get(object)?;
            ensure!(view.len() as u64 == OBJECT);
        }
        restore.push(started.elapsed());
        for (&object, bytes) in objects.iter().zip(&data) {
            ensure!(
                store.get(object)?.as_bytes() == &bytes[..],
                "restored bytes differ"
            );
            store.delete(object)?;
        }
    }
    spill.sort();
    restore.sort();
    let (spill, restore) = (spill[spill.len() / 2], restore[restore.len() / 2]);

    // The same bytes written to and read back from one plain file, object by object.
    let path = scratch.join("plain-file");
    let mut write = Vec::new();
    let mut read = Vec::new();
    for _ in 0..runs {
        let started = Instant::now();
        let mut file = std::fs::File::create(&path)?;
        for bytes in &data {
            file.write_all(bytes)?;
        }
        drop(file);
        write.push(started.elapsed());
        let started = Instant::now();
        let file = std::fs::File::open(&path)?;
        for (index, bytes) in data.iter_mut().enumerate() {
            file.read_exact_at(bytes, index as u64 * OBJECT)?;
        }
        read.push(started.elapsed());
        std::fs::remove_file(&path)?;
    }
    write.sort();
    read.sort();
    let (write, read) = (write[write.len() / 2], read[read.len() / 2]);
    let labels = [("total_mib", json!(total / MIB))];
    print_figure(BENCH, "spill_gbps", gbps(total, spill), "GB/s", &labels);
    print_figure(
        BENCH,
        "disk_write_gbps",
        gbps(total, write),
        "GB/s",
        &labels,
    );
    print_figure(
        BENCH,
        "spill_to_disk_write",
        write.as_secs_f64() / spill.as_secs_f64(),
        "ratio",
        &labels,
    );
    print_figure(BENCH, "restore_gbps", gbps(total, restore), "GB/s", &labels);
    print_figure(BENCH, "disk_read_gbps", gbps(total, read), "GB/s", &labels);
    Ok(())
}

/// Non-constant bytes, different for each `seed`, so nothing can shortcut the copies.
fn pattern(size: u64, seed: u64) -> Vec<u8> {
    (0..size).map(|i| ((i + seed) * 31 % 251) as u8).collect()
}

fn millis(time: Duration) -> f64 {
    time.as_secs_f64() * 1e3
}

fn micros(time: Duration) -> f64 {
    time.as_secs_f64() * 1e6
}

/// A directory under the node's data directory, removed when the bench ends.
struct Scratch(PathBuf);

impl Scratch {
    fn new(config: &Config) -> anyhow::Result<Self> {
        let path = config
            .paths
            .data_dir
            .join(format!("bench-objectstore-{}", std::process::id()));
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Self(path))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
