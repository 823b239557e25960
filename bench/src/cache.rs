//! `floe-bench cache`: what a cache hit saves.
//!
//! Builds a dataset (~1 GiB, `--quick` ~64 MiB) of seeded random columns `a`, `b` and
//! `c = a * 3 + b` (two arithmetic kernels), stores it as cached shards in the node's cache
//! directory, then measures, in one run:
//! - `open_hit_ms`: look the fingerprint up, open column `c` of every shard as a verified hit
//!   (the checksums of every piece it reads included) and sum it;
//! - `open_hit_whole_ms`: the same opening whole shards, every byte's checksum checked;
//! - `open_hit_structure_ms`: whole shards with structural verification only;
//! - `open_hit_warm_ms`: the same in a process that has opened (and verified) the shards
//!   before, as a long-lived node agent would;
//! - `recompute_ms`: produce the same column from its synthetic source (generator and kernels)
//!   and sum it; the generator costs under a nanosecond per byte, so this is a floor on what a
//!   miss costs;
//! - `recompute_csv_ms`: what a pipeline re-running from input files redoes on a miss: read
//!   the same `id, a, b` columns from CSV files with the node's read kernel, compute `c` with
//!   the same kernels and sum it. The CSV files (one per shard) are written once under
//!   `paths.data_dir` and reused by later runs; delete them to reclaim the space;
//! - `fingerprint_us`: fingerprint a 20-operator plan.
//!
//! Times are medians of several runs; every hit's sum, and the CSV recompute's, is checked to
//! be bit-identical to the synthetic recompute's.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};

use super::{median_time, print_figure};
use arrow::array::{Array, ArrayRef, AsArray, Float64Array, Int64Array, RecordBatch};
use arrow::compute::kernels::numeric::{add, mul};
use arrow::datatypes::{DataType, Field, Float64Type, Schema, SchemaRef};
use floe_core::Config;
use floe_core::config::ByteSize;
use floe_core::fingerprint::{
    Args, FingerprintInputs, Seed, SourceDescription, TransformDescription,
};
use floe_core::plan::{CsvOptions, FileFormat, FileScan};
use floe_engine::read::{discover, read_file};
use floe_objectstore::cache::{
    Cache, CacheConfig, CachePolicy, Lookup, ShardIndex, ShardName, Verification,
};

const SHARDS: u32 = 16;
const ROWS_PER_BATCH: u64 = 1 << 18;
/// Four 8-byte columns.
const BYTES_PER_ROW: u64 = 32;
const SEED: u64 = 0x5eed;

pub fn run(quick: bool, config: &Config) -> anyhow::Result<()> {
    let target = if quick {
        ByteSize::mib(64)
    } else {
        ByteSize::gib(1)
    };
    // The benchmark's shards live in a directory of their own under the node's cache
    // directory, under the node's cap, which must hold them all or hits would be evicted.
    ensure!(
        config.cache.max_bytes.bytes() >= target.bytes() * 2,
        "cache.max_bytes = {} cannot hold the {target} benchmark dataset; set it to at least {}",
        config.cache.max_bytes,
        ByteSize(target.bytes() * 2)
    );
    let rows_per_shard = target.bytes() / BYTES_PER_ROW / u64::from(SHARDS);
    let dir = ScratchDir(
        config
            .paths
            .cache_dir()
            .join(format!("bench-{}", std::process::id())),
    );
    let dataset = dataset_inputs(rows_per_shard * u64::from(SHARDS))?;
    let fingerprint = dataset.fingerprint();

    let cache = open_cache(config, &dir.0, Verification::Checksum)?;
    let started = Instant::now();
    let mut stored_bytes = 0;
    for rank in 0..SHARDS {
        let batches = shard_batches(rank, rows_per_shard)?;
        let outcome = cache.write_shard(
            CachePolicy::Recompute,
            &dataset,
            ShardIndex::new(rank, SHARDS)?,
            &schema(),
            &batches,
        )?;
        if let floe_objectstore::cache::WriteOutcome::Written { bytes } = outcome {
            stored_bytes += bytes;
        }
    }
    let write_ms = millis(started.elapsed());
    let csv = CsvSource::prepare(config, rows_per_shard)?;

    let mut expected = 0.0;
    let recompute = median_time(3, || {
        let started = Instant::now();
        expected = recompute_sum(rows_per_shard)?;
        Ok(started.elapsed())
    })?;
    let recompute_csv = median_time(3, || {
        let started = Instant::now();
        let sum = recompute_csv_sum(&csv.scan)?;
        let elapsed = started.elapsed();
        ensure!(
            sum.to_bits() == expected.to_bits(),
            "the sum {sum} over the CSV files in {} differs from the generator's {expected}; \
             delete the directory to regenerate them",
            csv.dir.display()
        );
        Ok(elapsed)
    })?;
    let check = |sum: f64| {
        ensure!(
            sum.to_bits() == expected.to_bits(),
            "the cached sum {sum} differs from the recomputed {expected}"
        );
        Ok(())
    };
    // A process opening the shards for the first time (a new driver): a fresh `Cache`.
    let cold = |verification, opened| {
        median_time(5, || {
            let started = Instant::now();
            let cache = open_cache(config, &dir.0, verification)?;
            let sum = open_hit_sum(&cache, fingerprint, opened)?;
            let elapsed = started.elapsed();
            check(sum)?;
            Ok(elapsed)
        })
    };
    let open_hit = cold(Verification::Checksum, Opened::ColumnC)?;
    let open_hit_whole = cold(Verification::Checksum, Opened::WholeShards)?;
    let open_hit_structure = cold(Verification::Structure, Opened::WholeShards)?;
    // A long-lived process (a node agent) keeps its `Cache`, which remembers the files whose
    // checksums it has verified.
    let warm_cache = open_cache(config, &dir.0, Verification::Checksum)?;
    check(open_hit_sum(&warm_cache, fingerprint, Opened::WholeShards)?)?;
    let open_hit_warm = median_time(5, || {
        let started = Instant::now();
        let sum = open_hit_sum(&warm_cache, fingerprint, Opened::WholeShards)?;
        let elapsed = started.elapsed();
        check(sum)?;
        Ok(elapsed)
    })?;
    let fingerprint_time = median_time(201, || {
        let started = Instant::now();
        fingerprint_plan(20)?;
        Ok(started.elapsed())
    })?;

    let figure = |name: &str, value: f64, unit: &str| print_figure("cache", name, value, unit, &[]);
    figure("dataset_bytes", stored_bytes as f64, "bytes");
    figure("shards", f64::from(SHARDS), "count");
    figure("write_ms", write_ms, "ms");
    figure("open_hit_ms", millis(open_hit), "ms");
    figure("open_hit_whole_ms", millis(open_hit_whole), "ms");
    figure("open_hit_structure_ms", millis(open_hit_structure), "ms");
    figure("open_hit_warm_ms", millis(open_hit_warm), "ms");
    figure("recompute_ms", millis(recompute), "ms");
    print_figure(
        "cache",
        "csv_source_bytes",
        csv.bytes as f64,
        "bytes",
        &[("reused", csv.reused.into())],
    );
    figure("recompute_csv_ms", millis(recompute_csv), "ms");
    let ratio = |hit: Duration, recompute: Duration| hit.as_secs_f64() / recompute.as_secs_f64();
    figure("open_hit_to_recompute", ratio(open_hit, recompute), "ratio");
    figure(
        "open_hit_warm_to_recompute",
        ratio(open_hit_warm, recompute),
        "ratio",
    );
    figure(
        "open_hit_to_recompute_csv",
        ratio(open_hit, recompute_csv),
        "ratio",
    );
    figure(
        "open_hit_whole_to_recompute_csv",
        ratio(open_hit_whole, recompute_csv),
        "ratio",
    );
    figure(
        "open_hit_structure_to_recompute_csv",
        ratio(open_hit_structure, recompute_csv),
        "ratio",
    );
    figure(
        "open_hit_warm_to_recompute_csv",
        ratio(open_hit_warm, recompute_csv),
        "ratio",
    );
    figure("fingerprint_us", fingerprint_time.as_secs_f64() * 1e6, "us");
    Ok(())
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

/// Removes the benchmark's cache directory however the run ends.
struct ScratchDir(PathBuf);

impl Drop for ScratchDir {
    fn drop(&mut self) {
        // Best effort: a leftover directory is visible and harmless.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn open_cache(config: &Config, dir: &Path, verification: Verification) -> anyhow::Result<Cache> {
    Ok(Cache::open(CacheConfig {
        dir: dir.to_owned(),
        verification,
        ..CacheConfig::for_node(config)
    })?)
}

fn schema() -> SchemaRef {
    Arc::new(Schema::new(
        ["id", "a", "b", "c"]
            .iter()
            .map(|name| {
                let data_type = if *name == "id" {
                    DataType::Int64
                } else {
                    DataType::Float64
                };
                Field::new(*name, data_type, false)
            })
            .collect::<Vec<_>>(),
    ))
}

/// The lineage of the benchmark dataset: range → seeded uniform columns → map.
fn dataset_inputs(rows: u64) -> anyhow::Result<FingerprintInputs> {
    let source = FingerprintInputs::Source(SourceDescription::range(rows));
    let random = TransformDescription::new(
        vec![source],
        "random_uniform",
        1,
        &Args::new().arg("columns", "a,b").seed(Seed::new(SEED)),
    )?;
    let map = TransformDescription::new(
        vec![FingerprintInputs::Transform(random)],
        "map",
        1,
        &Args::new()
            .arg("expr", "c = a * 3 + b")
            .performance("batch_size", ROWS_PER_BATCH),
    )?;
    Ok(FingerprintInputs::Transform(map))
}

/// Rows `start..start + rows` of the dataset, computed from scratch.
fn generate(start: u64, rows: u64) -> anyhow::Result<RecordBatch> {
    let mut rng = super::SplitMix64(SEED ^ start.wrapping_mul(0x2545_f491_4f6c_dd1d));
    let rows = usize::try_from(rows)?;
    let a = Float64Array::from_iter_values((0..rows).map(|_| rng.unit()));
    let b = Float64Array::from_iter_values((0..rows).map(|_| rng.unit()));
    let c = derive_c(&a, &b)?;
    let first = i64::try_from(start)?;
    let id = Int64Array::from_iter_values(first..first + i64::try_from(rows)?);
    Ok(RecordBatch::try_new(
        schema(),
        vec![Arc::new(id), Arc::new(a), Arc::new(b), c],
    )?)
}

/// The map of the dataset's lineage: `c = a * 3 + b`.
fn derive_c(a: &Float64Array, b: &Float64Array) -> anyhow::Result<ArrayRef> {
    let scaled = mul(a, &Float64Array::new_scalar(3.0))?;
    Ok(add(&scaled, b)?)
}

fn shard_batches(rank: u32, rows_per_shard: u64) -> anyhow::Result<Vec<RecordBatch>> {
    let first = u64::from(rank) * rows_per_shard;
    (0..rows_per_shard.div_ceil(ROWS_PER_BATCH))
        .map(|index| {
            let start = first + index * ROWS_PER_BATCH;
            generate(start, ROWS_PER_BATCH.min(first + rows_per_shard - start))
        })
        .collect()
}

fn sum_c(batches: &[RecordBatch]) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for batch in batches {
        let column = batch
            .column_by_name("c")
            .context("column c is missing")?
            .as_primitive_opt::<Float64Type>()
            .context("column c is not Float64")?;
        ensure!(column.null_count() == 0, "column c has nulls");
        total += arrow::compute::sum(column).unwrap_or(0.0);
    }
    Ok(total)
}

/// What a miss costs: every shard computed from its source, then summed.
fn recompute_sum(rows_per_shard: u64) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for rank in 0..SHARDS {
        total += sum_c(&shard_batches(rank, rows_per_shard)?)?;
    }
    Ok(total)
}

/// The dataset's input columns `id, a, b` as CSV files, one per shard, in a directory named
/// by everything that determines their contents, so later runs reuse them.
struct CsvSource {
    dir: PathBuf,
    scan: FileScan,
    bytes: u64,
    /// Whether the files were there already.
    reused: bool,
}

impl CsvSource {
    fn prepare(config: &Config, rows_per_shard: u64) -> anyhow::Result<Self> {
        let dir = config.paths.data_dir.join(format!(
            "bench-cache-csv-{SHARDS}x{rows_per_shard}-seed-{SEED:x}"
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut reused = true;
        for rank in 0..SHARDS {
            let path = dir.join(format!("part-{rank:05}.csv"));
            if path.exists() {
                continue;
            }
            reused = false;
            // Written under a hidden name (the read kernel skips those) and renamed when
            // complete, so an interrupted run never leaves a short file to be reused.
            let temp = dir.join(format!(".part-{rank:05}.csv.{}", std::process::id()));
            let file =
                File::create(&temp).with_context(|| format!("creating {}", temp.display()))?;
            let mut writer = arrow::csv::WriterBuilder::new()
                .with_header(true)
                .build(std::io::BufWriter::new(file));
            for batch in shard_batches(rank, rows_per_shard)? {
                // `c` is what the benchmark computes; the source holds only the inputs.
                writer.write(&batch.project(&[0, 1, 2])?)?;
            }
            writer
                .into_inner()
                .into_inner()
                .map_err(std::io::IntoInnerError::into_error)?
                .sync_all()?;
            std::fs::rename(&temp, &path)
                .with_context(|| format!("renaming {} to {}", temp.display(), path.display()))?;
        }
        let scan = discover(FileFormat::Csv(CsvOptions::default()), &[&dir])?;
        let columns: Vec<(&str, &DataType)> = scan
            .file_schema
            .fields()
            .iter()
            .map(|field| (field.name().as_str(), field.data_type()))
            .collect();
        ensure!(
            columns
                == [
                    ("id", &DataType::Int64),
                    ("a", &DataType::Float64),
                    ("b", &DataType::Float64)
                ],
            "the CSV files in {} have columns {columns:?}; delete the directory to regenerate them",
            dir.display()
        );
        ensure!(
            scan.files.len() == SHARDS as usize,
            "{} holds {} CSV files, expected {SHARDS}; delete the directory to regenerate them",
            dir.display(),
            scan.files.len()
        );
        let bytes = scan.files.iter().map(|stamp| stamp.size).sum();
        Ok(Self {
            dir,
            scan,
            bytes,
            reused,
        })
    }
}

/// What a miss costs a pipeline that starts from files: read every CSV file, compute `c` and
/// sum it. Each file is one shard read in batches of `ROWS_PER_BATCH` rows, the batches the
/// shards were written in, so the floating-point sum adds the same values in the same order.
fn recompute_csv_sum(scan: &FileScan) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for index in 0..scan.files.len() {
        let (batches, _) = read_file(scan, index, usize::try_from(ROWS_PER_BATCH)?)?;
        let derived = batches
            .iter()
            .map(|batch| {
                let column = |name: &str| {
                    batch
                        .column_by_name(name)
                        .and_then(|column| column.as_primitive_opt::<Float64Type>())
                        .with_context(|| format!("column {name} is missing or not Float64"))
                };
                let c = derive_c(column("a")?, column("b")?)?;
                Ok(RecordBatch::try_from_iter([("c", c)])?)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        // Summed per shard first, as `recompute_sum` does.
        total += sum_c(&derived)?;
    }
    Ok(total)
}

/// What an open of a hit returns.
#[derive(Debug, Clone, Copy)]
enum Opened {
    /// Column `c` only: the pieces holding it are checked.
    ColumnC,
    /// Every column: every byte is checked.
    WholeShards,
}

/// Column `c`'s position in the shards' schema (`id, a, b, c`).
const COLUMN_C: usize = 3;

/// What a hit costs: look up, open (map and verify) every shard, and sum column `c`.
fn open_hit_sum(
    cache: &Cache,
    fingerprint: floe_core::Fingerprint,
    opened: Opened,
) -> anyhow::Result<f64> {
    let lookup = cache.lookup(fingerprint, SHARDS, CachePolicy::Reuse)?;
    if lookup != (Lookup::FullHit { count: SHARDS }) {
        bail!("expected a full hit, got {lookup:?}");
    }
    let mut total = 0.0;
    for rank in 0..SHARDS {
        let name = ShardName {
            fingerprint,
            shard: ShardIndex::new(rank, SHARDS)?,
        };
        let shard = match opened {
            Opened::ColumnC => cache.open_shard_columns(name, &[COLUMN_C])?,
            Opened::WholeShards => cache.open_shard(name)?,
        }
        .with_context(|| format!("shard {rank} failed verification"))?;
        total += sum_c(&shard.block.batches)?;
    }
    Ok(total)
}

/// Builds and fingerprints a plan of `operators` transforms over a file-free source.
fn fingerprint_plan(operators: usize) -> anyhow::Result<FingerprintInputs> {
    let mut plan = FingerprintInputs::Source(SourceDescription::range(1_000_000));
    for index in 0..operators {
        let args = Args::new()
            .arg("expr", format!("col_{index} * 2 + 1"))
            .arg_with_default("factor", 1.5 + index as f64, 1.0)
            .arg_with_default("keep_nulls", false, false)
            .performance("batch_size", 4096u64);
        plan =
            FingerprintInputs::Transform(TransformDescription::new(vec![plan], "map", 1, &args)?);
    }
    Ok(plan)
}
