//! `floe-bench map|filter|sort|groupby|shuffle|repartition|rerun|spill|all`: end-to-end
//! workloads on a cluster, each verified, each printed with the floors it is compared with.
//!
//! The data is Parquet generated from a fixed seed and kept under
//! `<paths.data_dir>/bench-data/`, so later runs (and other benches) reuse it:
//! - *events*: `{user_id int64, group int32, value float64, text utf8 of 20–60 chars}`, 10M
//!   rows (`--quick`: 1M), for map, filter, groupby, repartition and rerun;
//! - *records*: 100-byte records `{key int64, payload utf8 of 92 chars}`, 10M rows (1 GB;
//!   `--quick`: 1M), for sort and shuffle; spill uses more of them.
//!
//! While generating, the expected answers are computed here (sums, counts, per-group
//! tallies, key checksums), so every result is checked against an independent computation.
//! Each workload runs on a fresh local cluster of two `floe node`s (or on `--address`), and
//! prints one JSON line: `seconds` (submit to finished, median of the runs), `rows`, `bytes`,
//! `first_run_s` for sort, shuffle and repartition (their first run on the fresh cluster, checked
//! like the others and kept out of `seconds`: it is the first to write gigabytes into the nodes'
//! stores, and the kernel zeroes each page of shared memory the first time it is touched,
//! about a core-second per 1.5 GB here, once in a cluster's life; the read floor below comes
//! after a read that warms the page cache, likewise),
//! `peak_rss_mb` (the cluster's processes' peak resident memory, summed; sort and shuffle
//! also `peak_pss_mb`, the cluster's proportional set size sampled during one more run of the
//! job, untimed, shared pages counted once, and `peak_pss_over_data`), `verified`, and
//! from the same run the floors: `parquet_read_s` (reading the same files with the plain
//! parquet reader, in this process, one thread; like `parquet_read_columns_s`, the median of
//! as many reads as the job's runs) and `memcpy_gb_per_s`. Sort and groupby also
//! print `baseline_s`: the same work done by one process on one thread with the fastest plain
//! code (Arrow's sort indices and `take`; a hash map over the column slices), reading only the
//! columns the job reads, the median of as many runs as the job's. Spill reads every row back, checks it, and prints the read-back
//! rate. A workload whose result is wrong makes the bench fail (exit non-zero).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use arrow::array::{
    Array, ArrowPrimitiveType, Float64Array, Int32Array, Int64Array, PrimitiveArray, RecordBatch,
    StringBuilder,
};
use arrow::compute::{SortColumn, concat_batches, lexsort_to_indices, take_record_batch};
use arrow::datatypes::{DataType, Field, Float64Type, Int64Type, Schema};
use floe_api::node_protocol::{NodeProtocol, NodeRequest, NodeResponse};
use floe_client::{
    AggFunction, Aggregation, CacheMode, Client, Dataset, JobOptions, LocalCluster,
    LocalClusterOptions, ProcessUdf, SortKey, WriteOptions, col, lit,
};
use floe_core::Config;
use floe_core::fingerprint::FileDigest;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::{ArrowWriter, ProjectionMask};
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;

use super::{SplitMix64, median_time, print_figure};

const SEED: u64 = 0x5eed_f10e;
const GROUPS: i32 = 1_000;
const USERS: u64 = 1_000_000;
const REPARTITIONS: u32 = 32;
const PAYLOAD_CHARS: usize = 92;
/// Rows per generated file and per row group.
const FILE_ROWS: u64 = 625_000;
const ROW_GROUP_ROWS: usize = 125_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Workload {
    Map,
    Filter,
    Sort,
    Groupby,
    Shuffle,
    Repartition,
    Rerun,
    Spill,
    Pyudf,
}

impl Workload {
    pub const ALL: [Workload; 9] = [
        Workload::Map,
        Workload::Filter,
        Workload::Sort,
        Workload::Groupby,
        Workload::Shuffle,
        Workload::Repartition,
        Workload::Rerun,
        Workload::Spill,
        Workload::Pyudf,
    ];

    fn name(self) -> &'static str {
        match self {
            Workload::Map => "map",
            Workload::Filter => "filter",
            Workload::Sort => "sort",
            Workload::Groupby => "groupby",
            Workload::Shuffle => "shuffle",
            Workload::Repartition => "repartition",
            Workload::Rerun => "rerun",
            Workload::Spill => "spill",
            Workload::Pyudf => "pyudf",
        }
    }
}

/// How to run a workload.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub quick: bool,
    /// An existing cluster's scheduler replicas; `None` starts a local cluster per workload.
    /// The nodes must see `data_dir` at the same path.
    pub address: Option<Vec<String>>,
    pub token: String,
    pub data_dir: PathBuf,
}

impl RunConfig {
    pub fn new(quick: bool, address: Option<String>, config: &Config) -> Self {
        Self {
            quick,
            address: address.map(|list| list.split(',').map(str::to_owned).collect()),
            token: config.client.token.expose().to_owned(),
            data_dir: config.paths.data_dir.join("bench-data"),
        }
    }

    pub(crate) fn runs(&self) -> usize {
        if self.quick { 1 } else { 3 }
    }

    pub(crate) fn rows(&self) -> u64 {
        if self.quick { 1_000_000 } else { 10_000_000 }
    }
}

// ---- data -----------------------------------------------------------------------------

/// Appends `chars` random lowercase letters to `builder` (`line` is reused scratch).
fn random_text(
    random: &mut SplitMix64,
    builder: &mut StringBuilder,
    chars: usize,
    line: &mut String,
) {
    line.clear();
    for _ in 0..chars {
        line.push(char::from(b'a' + random.below(26) as u8));
    }
    builder.append_value(line.as_str());
}

/// What the events data must produce, tallied while it is generated.
#[derive(Debug, Clone, Default)]
pub(crate) struct EventsTruth {
    pub(crate) rows: u64,
    bytes: u64,
    /// Σ (value × 2 + 1).
    pub(crate) map_sum: f64,
    /// Rows with value > 0.5.
    filter_count: u64,
    user_id_sum: i64,
    /// group → (count, Σ value).
    groups: BTreeMap<i32, (i64, f64)>,
}

#[derive(Debug, Clone, Default)]
struct RecordsTruth {
    rows: u64,
    bytes: u64,
    key_sum: i64,
    key_xor: i64,
}

pub(crate) struct Generated<T> {
    pub(crate) files: Vec<PathBuf>,
    pub(crate) truth: T,
}

fn events_schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("user_id", DataType::Int64, false),
        Field::new("group", DataType::Int32, false),
        Field::new("value", DataType::Float64, false),
        Field::new("text", DataType::Utf8, false),
    ]))
}

fn records_schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("key", DataType::Int64, false),
        Field::new("payload", DataType::Utf8, false),
    ]))
}

/// Writes `rows` rows as Parquet files of `FILE_ROWS` rows in `dir`, one batch of
/// `ROW_GROUP_ROWS` at a time from `batch(start, len)`. A complete data set has a `_SUCCESS`
/// file and is reused as it is; the generator still runs to recompute the expected answers
/// (generating is cheap next to the workloads, and the answers are never stored).
fn write_files(
    dir: &Path,
    rows: u64,
    schema: &Arc<Schema>,
    mut batch: impl FnMut(u64) -> anyhow::Result<RecordBatch>,
) -> anyhow::Result<Vec<PathBuf>> {
    let complete = dir.join("_SUCCESS").exists();
    if !complete {
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let properties = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .build();
    let mut files = Vec::new();
    let mut start = 0;
    while start < rows {
        let path = dir.join(format!("part-{:05}.parquet", files.len()));
        let end = (start + FILE_ROWS).min(rows);
        let mut writer = if complete {
            None
        } else {
            let file =
                File::create(&path).with_context(|| format!("creating {}", path.display()))?;
            Some(ArrowWriter::try_new(
                file,
                Arc::clone(schema),
                Some(properties.clone()),
            )?)
        };
        let mut at = start;
        while at < end {
            let len = (end - at).min(ROW_GROUP_ROWS as u64);
            let batch = batch(len)?;
            if let Some(writer) = &mut writer {
                writer.write(&batch)?;
            }
            at += len;
        }
        if let Some(writer) = writer {
            writer.close()?;
        }
        files.push(path);
        start = end;
    }
    if !complete {
        File::create(dir.join("_SUCCESS"))?;
    }
    Ok(files)
}

pub(crate) fn events(config: &RunConfig, rows: u64) -> anyhow::Result<Generated<EventsTruth>> {
    let dir = config.data_dir.join(format!("events-{rows}-{SEED:x}"));
    let schema = events_schema();
    let mut random = SplitMix64(SEED);
    let mut truth = EventsTruth::default();
    let mut line = String::new();
    let files = write_files(&dir, rows, &schema, |len| {
        let mut users = Vec::with_capacity(len as usize);
        let mut groups = Vec::with_capacity(len as usize);
        let mut values = Vec::with_capacity(len as usize);
        let mut texts = StringBuilder::with_capacity(len as usize, len as usize * 40);
        for _ in 0..len {
            let user = random.below(USERS) as i64;
            let group = random.below(GROUPS as u64) as i32;
            let value = random.unit();
            let chars = 20 + random.below(41) as usize;
            random_text(&mut random, &mut texts, chars, &mut line);
            truth.map_sum += value * 2.0 + 1.0;
            truth.filter_count += u64::from(value > 0.5);
            truth.user_id_sum += user;
            let tally = truth.groups.entry(group).or_default();
            tally.0 += 1;
            tally.1 += value;
            truth.bytes += 8 + 4 + 8 + chars as u64;
            users.push(user);
            groups.push(group);
            values.push(value);
        }
        truth.rows += len;
        Ok(RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(users)),
                Arc::new(Int32Array::from(groups)),
                Arc::new(Float64Array::from(values)),
                Arc::new(texts.finish()),
            ],
        )?)
    })?;
    Ok(Generated { files, truth })
}

fn records(config: &RunConfig, rows: u64) -> anyhow::Result<Generated<RecordsTruth>> {
    let dir = config.data_dir.join(format!("records-{rows}-{SEED:x}"));
    let schema = records_schema();
    let mut random = SplitMix64(SEED ^ 0x7265_636f_7264);
    let mut truth = RecordsTruth::default();
    let mut line = String::new();
    let files = write_files(&dir, rows, &schema, |len| {
        let mut keys = Vec::with_capacity(len as usize);
        let mut payloads = StringBuilder::with_capacity(len as usize, len as usize * PAYLOAD_CHARS);
        for _ in 0..len {
            let key = random.next() as i64;
            random_text(&mut random, &mut payloads, PAYLOAD_CHARS, &mut line);
            truth.key_sum = truth.key_sum.wrapping_add(key);
            truth.key_xor ^= key;
            keys.push(key);
        }
        truth.rows += len;
        truth.bytes += len * (8 + PAYLOAD_CHARS as u64);
        Ok(RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(keys)),
                Arc::new(payloads.finish()),
            ],
        )?)
    })?;
    Ok(Generated { files, truth })
}

// ---- floors ---------------------------------------------------------------------------

/// Reads every file with the plain parquet reader, in this process, on one thread.
fn parquet_read(files: &[PathBuf]) -> anyhow::Result<(Duration, Vec<RecordBatch>)> {
    let started = Instant::now();
    let mut batches = Vec::new();
    for path in files {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        for batch in ParquetRecordBatchReaderBuilder::try_new(file)?.build()? {
            batches.push(batch?);
        }
    }
    Ok((started.elapsed(), batches))
}

/// The read floor: the median of `runs` plain reads of every file, after the read that
/// gave the data (a first read can find the files cold, and one read on a shared machine
/// can be far off, where the job's time is a median too).
fn read_floor(files: &[PathBuf], runs: usize) -> anyhow::Result<Duration> {
    median_time(runs, || Ok(parquet_read(files)?.0))
}

/// Reads only `columns` of every file with the plain parquet reader (the floor for a job
/// whose plan reads only those columns), on one thread.
fn parquet_read_columns(files: &[PathBuf], columns: &[&str]) -> anyhow::Result<Duration> {
    let started = Instant::now();
    std::hint::black_box(read_columns(files, columns)?);
    Ok(started.elapsed())
}

/// `columns` of every file, read with the plain parquet reader on one thread.
fn read_columns(files: &[PathBuf], columns: &[&str]) -> anyhow::Result<Vec<RecordBatch>> {
    let mut batches = Vec::new();
    for path in files {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let builder = ParquetRecordBatchReaderBuilder::try_new(file)?;
        let mask = ProjectionMask::columns(builder.parquet_schema(), columns.iter().copied());
        for batch in builder.with_projection(mask).build()? {
            batches.push(batch?);
        }
    }
    Ok(batches)
}

/// memcpy bandwidth over 256 MiB, the median of three copies.
fn memcpy_gb_per_s() -> anyhow::Result<f64> {
    let size = 256usize << 20;
    let source = vec![7u8; size];
    let mut target = vec![0u8; size];
    let time = median_time(3, || {
        let started = Instant::now();
        target.copy_from_slice(&source);
        std::hint::black_box(&target);
        Ok(started.elapsed())
    })?;
    Ok(super::gbps(size as u64, time))
}

/// The `/proc` directories of every process whose command line names `dir` (a local
/// cluster's scheduler, nodes and workers).
fn cluster_processes(dir: &Path) -> Vec<PathBuf> {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|process| {
            std::fs::read(process.join("cmdline"))
                .is_ok_and(|cmdline| String::from_utf8_lossy(&cmdline).contains(&needle))
        })
        .collect()
}

/// The value in kB of the line starting with `key` in a `/proc` file such as `status`.
fn proc_kib(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(key))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Peak resident memory of the cluster's processes (see [`cluster_processes`]), summed, in
/// MiB. Shared pages (the store's segment) count once per process that touched them.
fn peak_rss_mb(dir: &Path) -> Option<f64> {
    let total_kib: u64 = cluster_processes(dir)
        .iter()
        .filter_map(|process| {
            let status = std::fs::read_to_string(process.join("status")).ok()?;
            proc_kib(&status, "VmHWM:")
        })
        .sum();
    Some(total_kib as f64 / 1024.0)
}

/// Samples the cluster's proportional set size while a workload runs: every process's
/// resident pages with each shared page divided among the processes that map it, so the
/// store's segment counts once, summed over the cluster.
struct PssSampler {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl PssSampler {
    /// How often the sum is taken: reading `smaps_rollup` walks a process's page tables.
    const EVERY: Duration = Duration::from_millis(200);

    fn start(dir: &Path) -> Self {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let dir = dir.to_owned();
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut peak_kib = 0;
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                let kib: u64 = cluster_processes(&dir)
                    .iter()
                    .filter_map(|process| {
                        let rollup = std::fs::read_to_string(process.join("smaps_rollup")).ok()?;
                        proc_kib(&rollup, "Pss:")
                    })
                    .sum();
                peak_kib = peak_kib.max(kib);
                std::thread::sleep(Self::EVERY);
            }
            peak_kib
        });
        Self { stop, thread }
    }

    /// The highest sum sampled, in bytes.
    fn peak_bytes(self) -> anyhow::Result<u64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let kib = self
            .thread
            .join()
            .map_err(|_| anyhow::anyhow!("the PSS sampler panicked"))?;
        Ok(kib * 1024)
    }
}

// ---- running --------------------------------------------------------------------------

/// Where a workload runs: a local cluster started for it, or the given one.
pub(crate) struct Target {
    pub(crate) local: Option<LocalCluster>,
    pub(crate) client: Client,
}

pub(crate) async fn target(
    config: &RunConfig,
    node_settings: Vec<String>,
) -> anyhow::Result<Target> {
    if let Some(address) = &config.address {
        let client = Client::connect(address, &config.token).await?;
        return Ok(Target {
            local: None,
            client,
        });
    }
    let binary = crate::floe_binary()?;
    let mut options = LocalClusterOptions::new(2, binary);
    options.node_settings = node_settings;
    let cluster = LocalCluster::start(options).await?;
    let client = cluster.connect().await?;
    Ok(Target {
        local: Some(cluster),
        client,
    })
}

struct Measured {
    seconds: Duration,
    output: floe_client::JobOutput,
}

/// Runs `dataset` `runs` times and keeps the median time and the last output. Each run's
/// result is released before the next starts, so every run finds the same store: one still
/// holding the last result would hold up to twice the data.
async fn run_job(
    client: &Client,
    dataset: &Dataset,
    options: &JobOptions,
    runs: usize,
) -> anyhow::Result<Measured> {
    let mut times = Vec::new();
    let mut last: Option<floe_client::JobOutput> = None;
    for _ in 0..runs.max(1) {
        if let Some(previous) = last.take() {
            previous.release().await?;
        }
        let started = Instant::now();
        let output = client
            .submit_with(dataset, options.clone())
            .await?
            .wait()
            .await?;
        times.push(started.elapsed());
        last = Some(output);
    }
    times.sort();
    Ok(Measured {
        seconds: times[times.len() / 2],
        output: last.context("no run")?,
    })
}

/// The job of `sort` or `shuffle` over the *records* table, run and checked once per call.
enum RecordsJob {
    /// Sorts by key into Parquet files under `out`, read back to check.
    Sort { dataset: Dataset, out: PathBuf },
    /// random_shuffle; `first_in` is the input's first keys, which the output must not keep.
    Shuffle {
        dataset: Dataset,
        first_in: Vec<i64>,
    },
}

impl RecordsJob {
    /// Runs the job once: its time from submit to end, and whether its result is right.
    async fn run(&self, client: &Client, truth: &RecordsTruth) -> anyhow::Result<(Duration, bool)> {
        match self {
            RecordsJob::Sort { dataset, out } => {
                if out.exists() {
                    std::fs::remove_dir_all(out)?;
                }
                let measured = run_job(client, dataset, &no_cache(), 1).await?;
                Ok((measured.seconds, verify_sorted_files(out, truth)?))
            }
            RecordsJob::Shuffle { dataset, first_in } => {
                let measured = run_job(client, dataset, &no_cache(), 1).await?;
                let batches = measured.output.to_arrow().await?;
                let checksums = key_checksums(&batches)?;
                // A permutation: the same keys, in another order than the input's.
                let first_out: Vec<i64> = batches
                    .iter()
                    .flat_map(|b| {
                        int64s(b, "key")
                            .map(|k| k.values().to_vec())
                            .unwrap_or_default()
                    })
                    .take(100)
                    .collect();
                let verified = checksums == (truth.rows, truth.key_sum, truth.key_xor)
                    && *first_in != first_out;
                Ok((measured.seconds, verified))
            }
        }
    }

    fn clean_up(&self) {
        if let RecordsJob::Sort { out, .. } = self {
            std::fs::remove_dir_all(out).ok();
        }
    }
}

pub(crate) fn no_cache() -> JobOptions {
    JobOptions {
        cache: CacheMode::NoCache,
        ..JobOptions::default()
    }
}

/// The first row's value of `column` in a one-row result (a global aggregate).
fn first_value<T: ArrowPrimitiveType>(
    batches: &[RecordBatch],
    column: &str,
) -> anyhow::Result<T::Native> {
    let batch = batches
        .iter()
        .find(|b| b.num_rows() > 0)
        .context("no result row")?;
    let values = batch
        .column_by_name(column)
        .and_then(|c| c.as_any().downcast_ref::<PrimitiveArray<T>>())
        .with_context(|| format!("no {} column {column}", T::DATA_TYPE))?;
    Ok(values.value(0))
}

pub(crate) fn close(actual: f64, expected: f64) -> bool {
    (actual - expected).abs() <= 1e-9 * expected.abs().max(1.0)
}

fn int64s<'a>(batch: &'a RecordBatch, column: &str) -> anyhow::Result<&'a Int64Array> {
    batch
        .column_by_name(column)
        .and_then(|c| c.as_any().downcast_ref::<Int64Array>())
        .with_context(|| format!("no Int64 column {column}"))
}

/// Whether a repartition's result holds every row of the events: their count and the sum of
/// their `user_id`s.
fn all_rows_kept(batches: &[RecordBatch], truth: &EventsTruth) -> anyhow::Result<bool> {
    let mut count = 0u64;
    let mut sum = 0i64;
    for batch in batches {
        count += batch.num_rows() as u64;
        sum += int64s(batch, "user_id")?.values().iter().sum::<i64>();
    }
    Ok(count == truth.rows && sum == truth.user_id_sum)
}

/// Row count, wrapping sum and xor of the `key` column: equal for any permutation.
fn key_checksums(batches: &[RecordBatch]) -> anyhow::Result<(u64, i64, i64)> {
    let (mut rows, mut sum, mut xor) = (0u64, 0i64, 0i64);
    for batch in batches {
        for key in int64s(batch, "key")?.values() {
            rows += 1;
            sum = sum.wrapping_add(*key);
            xor ^= key;
        }
    }
    Ok((rows, sum, xor))
}

fn map_dataset(files: &[PathBuf]) -> anyhow::Result<Dataset> {
    Ok(Dataset::read_parquet(files)?
        .with_column("v2", col("value") * lit(2.0) + lit(1.0))?
        .groupby(&[])
        .agg(vec![Aggregation::of(AggFunction::Sum, "v2").alias("total")])?)
}

/// The identity Python UDF the `pyudf` workload runs.
const IDENTITY_UDF: &str = "import floe_udf\n\n\n@floe_udf.batch\ndef identity(batch):\n    return batch\n\n\nif __name__ == \"__main__\":\n    floe_udf.serve()\n";

/// [`map_dataset`] with every block of the used column sent through an identity Python UDF
/// (the column is selected first, as the native plan's projection pushdown does for itself).
fn pyudf_dataset(files: &[PathBuf], data_dir: &Path) -> anyhow::Result<Dataset> {
    let script = data_dir.join("identity_udf.py");
    std::fs::write(&script, IDENTITY_UDF)
        .with_context(|| format!("cannot write {}", script.display()))?;
    // Run by the path pinned (symlinks resolved): a node runs only a script the plan pins.
    let digest = FileDigest::of(&script)?;
    let script_arg = digest
        .path
        .to_str()
        .context("the data directory is not UTF-8")?
        .to_owned();
    let udf = ProcessUdf::new("python3", &[&script_arg]).pinned(digest);
    Ok(Dataset::read_parquet(files)?
        .select(&["value"])?
        .map_batches_process(udf)?
        .with_column("v2", col("value") * lit(2.0) + lit(1.0))?
        .groupby(&[])
        .agg(vec![Aggregation::of(AggFunction::Sum, "v2").alias("total")])?)
}

/// One workload's line.
struct Report {
    workload: Workload,
    rows: u64,
    bytes: u64,
    seconds: Duration,
    verified: bool,
    parquet_read: Duration,
    memcpy: f64,
    peak_rss_mb: Option<f64>,
    extra: Vec<(&'static str, serde_json::Value)>,
}

impl Report {
    fn print(self) {
        let seconds = self.seconds.as_secs_f64();
        let read = self.parquet_read.as_secs_f64();
        let mut labels = vec![
            ("workload", self.workload.name().into()),
            ("rows", self.rows.into()),
            ("bytes", self.bytes.into()),
            ("seconds", seconds.into()),
            (
                "peak_rss_mb",
                self.peak_rss_mb.map_or(serde_json::Value::Null, Into::into),
            ),
            ("verified", self.verified.into()),
            ("parquet_read_s", read.into()),
            ("vs_parquet_read", (seconds / read).into()),
            ("memcpy_gb_per_s", self.memcpy.into()),
        ];
        labels.extend(self.extra);
        print_figure(self.workload.name(), "seconds", seconds, "s", &labels);
    }
}

pub fn run(workloads: &[Workload], config: &RunConfig) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    let mut unverified = Vec::new();
    for workload in workloads {
        let report = runtime
            .block_on(run_one(*workload, config))
            .with_context(|| format!("bench {}", workload.name()))?;
        if !report.verified {
            unverified.push(workload.name());
        }
        report.print();
    }
    ensure_verified(&unverified)
}

/// Fails (so the bench exits non-zero) when any workload's result was wrong.
fn ensure_verified(unverified: &[&str]) -> anyhow::Result<()> {
    ensure!(
        unverified.is_empty(),
        "wrong results from: {}",
        unverified.join(", ")
    );
    Ok(())
}

async fn run_one(workload: Workload, config: &RunConfig) -> anyhow::Result<Report> {
    let rows = config.rows();
    let runs = config.runs();
    let memcpy = memcpy_gb_per_s()?;
    match workload {
        Workload::Map
        | Workload::Filter
        | Workload::Groupby
        | Workload::Repartition
        | Workload::Rerun
        | Workload::Pyudf => {
            let data = events(config, rows)?;
            let (_, plain) = parquet_read(&data.files)?;
            let parquet_read = read_floor(&data.files, runs)?;
            // The plan reads only the columns it uses; so does this floor.
            let used: &[&str] = match workload {
                Workload::Groupby => &["group", "value"],
                Workload::Repartition | Workload::Rerun => &["user_id", "group", "value", "text"],
                _ => &["value"],
            };
            let columns_read = median_time(runs, || parquet_read_columns(&data.files, used))?;
            // The UDF's script is written into the data directory: the local nodes run scripts
            // from there (a remote cluster's nodes need it in their own `node.udf_roots`).
            let settings = match workload {
                Workload::Pyudf => vec![format!(
                    "node.udf_roots={}",
                    std::fs::canonicalize(&config.data_dir)?.display()
                )],
                _ => Vec::new(),
            };
            let target = target(config, settings).await?;
            let truth = &data.truth;
            let mut extra = Vec::new();
            let (seconds, verified) = match workload {
                Workload::Map => {
                    let measured = run_job(
                        &target.client,
                        &map_dataset(&data.files)?,
                        &no_cache(),
                        runs,
                    )
                    .await?;
                    let total =
                        first_value::<Float64Type>(&measured.output.to_arrow().await?, "total")?;
                    (measured.seconds, close(total, truth.map_sum))
                }
                Workload::Filter => {
                    let dataset = Dataset::read_parquet(&data.files)?
                        .filter(col("value").gt(lit(0.5)))?
                        .groupby(&[])
                        .agg(vec![Aggregation::count_rows("n")])?;
                    let measured = run_job(&target.client, &dataset, &no_cache(), runs).await?;
                    let n = first_value::<Int64Type>(&measured.output.to_arrow().await?, "n")?;
                    (measured.seconds, n as u64 == truth.filter_count)
                }
                Workload::Groupby => {
                    let aggregations = vec![
                        Aggregation::count_rows("n"),
                        Aggregation::of(AggFunction::Sum, "value").alias("sum"),
                        Aggregation::of(AggFunction::Mean, "value").alias("mean"),
                    ];
                    let dataset = Dataset::read_parquet(&data.files)?
                        .groupby(&["group"])
                        .agg(aggregations)?;
                    let measured = run_job(&target.client, &dataset, &no_cache(), runs).await?;
                    let verified = verify_groups(&measured.output.to_arrow().await?, truth)?;
                    let baseline = median_time(runs, || groupby_baseline(&data.files, truth))?;
                    extra.push(("baseline_s", baseline.as_secs_f64().into()));
                    extra.push((
                        "vs_baseline",
                        (measured.seconds.as_secs_f64() / baseline.as_secs_f64()).into(),
                    ));
                    (measured.seconds, verified)
                }
                Workload::Repartition => {
                    let dataset = Dataset::read_parquet(&data.files)?
                        .repartition_by(REPARTITIONS, &["user_id"])?;
                    // The first run on a fresh cluster, apart (see the module's doc).
                    let first = run_job(&target.client, &dataset, &no_cache(), 1).await?;
                    extra.push(("first_run_s", first.seconds.as_secs_f64().into()));
                    let first_right = all_rows_kept(&first.output.to_arrow().await?, truth)?;
                    first.output.release().await?;
                    let measured = run_job(&target.client, &dataset, &no_cache(), runs).await?;
                    let right = all_rows_kept(&measured.output.to_arrow().await?, truth)?;
                    (measured.seconds, first_right && right)
                }
                Workload::Pyudf => {
                    // Both paths warm up once; the UDF's first run also starts its processes
                    // (Python and pyarrow's import), reported apart as `udf_first_run_s`.
                    run_job(&target.client, &map_dataset(&data.files)?, &no_cache(), 1).await?;
                    let through_udf = pyudf_dataset(&data.files, &config.data_dir)?;
                    let first = run_job(&target.client, &through_udf, &no_cache(), 1).await?;
                    extra.push(("udf_first_run_s", first.seconds.as_secs_f64().into()));
                    let native = run_job(
                        &target.client,
                        &map_dataset(&data.files)?,
                        &no_cache(),
                        runs,
                    )
                    .await?;
                    let measured = run_job(&target.client, &through_udf, &no_cache(), runs).await?;
                    let native_total =
                        first_value::<Float64Type>(&native.output.to_arrow().await?, "total")?;
                    let udf_total =
                        first_value::<Float64Type>(&measured.output.to_arrow().await?, "total")?;
                    let rows = truth.rows as f64;
                    let udf_rows_per_s = rows / measured.seconds.as_secs_f64();
                    let native_rows_per_s = rows / native.seconds.as_secs_f64();
                    extra.push(("udf_rows_per_s", udf_rows_per_s.into()));
                    extra.push(("native_rows_per_s", native_rows_per_s.into()));
                    extra.push((
                        "udf_over_native",
                        (udf_rows_per_s / native_rows_per_s).into(),
                    ));
                    let verified =
                        close(native_total, truth.map_sum) && close(udf_total, truth.map_sum);
                    (measured.seconds, verified)
                }
                _ => rerun(&target, &data.files, truth, runs, &mut extra).await?,
            };
            drop(plain);
            let columns_s = columns_read.as_secs_f64();
            extra.push(("parquet_read_columns_s", columns_s.into()));
            extra.push((
                "vs_parquet_read_columns",
                (seconds.as_secs_f64() / columns_s).into(),
            ));
            Ok(Report {
                workload,
                rows: truth.rows,
                bytes: truth.bytes,
                seconds,
                verified,
                parquet_read,
                memcpy,
                peak_rss_mb: target.local.as_ref().and_then(|c| peak_rss_mb(c.dir())),
                extra,
            })
        }
        Workload::Sort | Workload::Shuffle => {
            let data = records(config, rows)?;
            let (_, plain) = parquet_read(&data.files)?;
            let parquet_read = read_floor(&data.files, runs)?;
            let target = target(config, Vec::new()).await?;
            let truth = &data.truth;
            let mut extra = Vec::new();
            let job = if workload == Workload::Sort {
                let out = config
                    .data_dir
                    .join(format!("sorted-{}", std::process::id()));
                let dataset = Dataset::read_parquet(&data.files)?
                    .sort(vec![SortKey::asc("key")])?
                    .write_parquet(&out, WriteOptions::default())?;
                RecordsJob::Sort { dataset, out }
            } else {
                let dataset = Dataset::read_parquet(&data.files)?.random_shuffle(Some(7))?;
                let first_in = int64s(&plain[0], "key")?.values()[..100].to_vec();
                RecordsJob::Shuffle { dataset, first_in }
            };
            // The first run on a fresh cluster, apart (see the module's doc).
            let (first, mut verified) = job.run(&target.client, truth).await?;
            extra.push(("first_run_s", first.as_secs_f64().into()));
            let mut times = Vec::new();
            for _ in 0..runs {
                let (time, right) = job.run(&target.client, truth).await?;
                times.push(time);
                verified &= right;
            }
            times.sort();
            let seconds = times[times.len() / 2];
            if let RecordsJob::Sort { .. } = job {
                let baseline = median_time(runs, || sort_baseline(&data.files))?;
                extra.push(("baseline_s", baseline.as_secs_f64().into()));
                extra.push((
                    "vs_baseline",
                    (seconds.as_secs_f64() / baseline.as_secs_f64()).into(),
                ));
            }
            if let Some(cluster) = &target.local {
                // Peak memory in a run of its own: sampling walks every process's page
                // tables, which takes a third of a core and would slow the timed runs.
                let pss = PssSampler::start(cluster.dir());
                let (_, right) = job.run(&target.client, truth).await?;
                verified &= right;
                let peak = pss.peak_bytes()?;
                extra.push(("peak_pss_mb", (peak as f64 / (1 << 20) as f64).into()));
                extra.push((
                    "peak_pss_over_data",
                    (peak as f64 / truth.bytes as f64).into(),
                ));
            }
            job.clean_up();
            Ok(Report {
                workload,
                rows: truth.rows,
                bytes: truth.bytes,
                seconds,
                verified,
                parquet_read,
                memcpy,
                peak_rss_mb: target.local.as_ref().and_then(|c| peak_rss_mb(c.dir())),
                extra,
            })
        }
        Workload::Spill => spill(config, memcpy).await,
    }
}

/// Materializes three times the cluster's object-store memory: the output stays in the
/// stores, which must spill to hold it.
async fn spill(config: &RunConfig, memcpy: f64) -> anyhow::Result<Report> {
    let store_mib: u64 = if config.quick { 75 } else { 160 };
    let nodes = 2;
    let wanted_bytes = 3 * nodes * (store_mib << 20);
    let rows = wanted_bytes.div_ceil(8 + PAYLOAD_CHARS as u64);
    let data = records(config, rows)?;
    let (parquet_read, _) = parquet_read(&data.files)?;
    let settings = vec![
        format!("memory.object_store_max={store_mib}MiB"),
        format!("memory.object_store_min={store_mib}MiB"),
    ];
    let target = target(config, settings).await?;
    let dataset =
        Dataset::read_parquet(&data.files)?.with_column("key2", col("key") + lit(1i64))?;
    let measured = run_job(&target.client, &dataset, &no_cache(), 1).await?;
    let spilled = measured.output.stats.spilled_bytes;
    // Every row back, the spilled ones restored from disk, and checked.
    let started = Instant::now();
    let batches = measured.output.to_arrow().await?;
    let restore = started.elapsed();
    let read_back: u64 = batches.iter().map(floe_engine::blocks::data_bytes).sum();
    let mut shifted = true;
    for batch in &batches {
        let (keys, keys2) = (int64s(batch, "key")?, int64s(batch, "key2")?);
        shifted &= keys
            .values()
            .iter()
            .zip(keys2.values())
            .all(|(key, key2)| key.wrapping_add(1) == *key2);
    }
    let truth = &data.truth;
    let verified = measured.output.rows() == truth.rows
        && spilled > 0
        && shifted
        && key_checksums(&batches)? == (truth.rows, truth.key_sum, truth.key_xor);
    Ok(Report {
        workload: Workload::Spill,
        rows: data.truth.rows,
        bytes: data.truth.bytes,
        seconds: measured.seconds,
        verified,
        parquet_read,
        memcpy,
        peak_rss_mb: target.local.as_ref().and_then(|c| peak_rss_mb(c.dir())),
        extra: vec![
            ("spilled_bytes", spilled.into()),
            ("read_back_bytes", read_back.into()),
            ("restore_s", restore.as_secs_f64().into()),
            ("restore_gb_per_s", super::gbps(read_back, restore).into()),
            ("object_store_bytes", (nodes * (store_mib << 20)).into()),
        ],
    })
}

/// The `rerun` job: the whole events table with one computed column, as the result.
fn table_dataset(files: &[PathBuf]) -> anyhow::Result<Dataset> {
    Ok(Dataset::read_parquet(files)?.with_column("v2", col("value") * lit(2.0) + lit(1.0))?)
}

/// One run of the table job, timed from its submission.
struct TableRun {
    /// Until the job ended with its output held.
    finished: Duration,
    /// Until the client had read every row.
    read: Duration,
    rows: u64,
    /// Σ v2 in the output's order, so two runs that return the same rows agree to the bit.
    sum: f64,
    /// Cache hits and tasks run, over the operators.
    cache_hits: u64,
    tasks: u64,
    /// The nodes' store memory in use when the job had ended, and after the read (on a local
    /// cluster).
    store_used: Option<(u64, u64)>,
    output: floe_client::JobOutput,
}

async fn run_table(
    client: &Client,
    stores: Option<&Stores>,
    dataset: &Dataset,
    options: JobOptions,
) -> anyhow::Result<TableRun> {
    let started = Instant::now();
    let output = client.submit_with(dataset, options).await?.wait().await?;
    let finished = started.elapsed();
    let ended = match stores {
        Some(stores) => Some(stores.used().await?),
        None => None,
    };
    let (mut rows, mut sum) = (0u64, 0.0f64);
    let mut reader = output.stream();
    while let Some(batch) = reader.next_batch().await? {
        let v2 = batch
            .column_by_name("v2")
            .and_then(|c| c.as_any().downcast_ref::<Float64Array>())
            .context("no Float64 column v2")?;
        rows += batch.num_rows() as u64;
        sum += v2.values().iter().sum::<f64>();
    }
    let read = started.elapsed();
    let store_used = match (stores, ended) {
        (Some(stores), Some(ended)) => Some((ended, stores.used().await?)),
        _ => None,
    };
    let stats = &output.stats.operators;
    Ok(TableRun {
        finished,
        read,
        rows,
        sum,
        cache_hits: stats.iter().map(|op| op.cache_hits).sum(),
        tasks: stats.iter().map(|op| op.tasks).sum(),
        store_used,
        output,
    })
}

/// A local cluster's object stores, asked over the nodes' RPC port as the client (a `read`
/// token may ask a node for its `Status`).
struct Stores {
    nodes: Vec<String>,
    wire: floe_core::wire::WireConfig,
}

impl Stores {
    fn of(target: &Target) -> Option<Self> {
        let local = target.local.as_ref()?;
        let mut config = Config::default();
        config.client.token = floe_core::auth::ClientToken::new(local.token());
        Some(Self {
            nodes: local.node_addresses(),
            wire: floe_core::wire::WireConfig::client(&config),
        })
    }

    /// Bytes of store memory in use, summed over the nodes.
    async fn used(&self) -> anyhow::Result<u64> {
        let mut used = 0;
        for node in &self.nodes {
            let mut client =
                floe_core::wire::RpcClient::<NodeProtocol>::connect(node, self.wire.clone())
                    .await?;
            match client.call(&NodeRequest::Status).await? {
                NodeResponse::Status(status) => used += status.store.used,
                other => anyhow::bail!("node {node} answered Status with {other:?}"),
            }
        }
        Ok(used)
    }

    /// Waits (at most 30 s) until the stores hold no memory: a released output is freed on the
    /// leader's next housekeeping tick, and each run starts from the same state.
    async fn wait_empty(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let used = self.used().await?;
            if used == 0 {
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "the stores still hold {used} bytes 30 s after the outputs were released"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `rerun`: the table job returns every row of the events table (10M rows, about 690 MB of
/// cache shards), cold (`recompute`: computed, its output written to the nodes' caches) and
/// warm (served from the cache), alternated `runs` times on one cluster, each output
/// released and the stores empty before the next run. Each run is timed to the job's end
/// (output held) and to the client having read every row; the figure is the warm median to
/// the job's end. Verified: every run returns every row with Σ v2 matching the truth, a warm
/// run to the bit of the cold one before it, runs no task, and (on a local cluster) takes no
/// byte of store memory, before the read or after it.
async fn rerun(
    target: &Target,
    files: &[PathBuf],
    truth: &EventsTruth,
    runs: usize,
    extra: &mut Vec<(&'static str, serde_json::Value)>,
) -> anyhow::Result<(Duration, bool)> {
    let dataset = table_dataset(files)?;
    let stores = Stores::of(target);
    let recompute = JobOptions {
        cache: CacheMode::Recompute,
        ..JobOptions::default()
    };
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    let mut verified = true;
    let mut warm_store_used = stores.as_ref().map(|_| 0);
    let mut output_bytes = 0;
    for _ in 0..runs.max(1) {
        let computed =
            run_table(&target.client, stores.as_ref(), &dataset, recompute.clone()).await?;
        verified &= computed.rows == truth.rows && close(computed.sum, truth.map_sum);
        computed.output.release().await?;
        if let Some(stores) = &stores {
            stores.wait_empty().await?;
        }
        let served = run_table(
            &target.client,
            stores.as_ref(),
            &dataset,
            JobOptions::default(),
        )
        .await?;
        verified &= served.rows == truth.rows
            && served.sum.to_bits() == computed.sum.to_bits()
            && served.cache_hits > 0
            && served.tasks == 0;
        if let (Some(most), Some((ended, read))) = (&mut warm_store_used, served.store_used) {
            *most = (*most).max(ended).max(read);
        }
        output_bytes = served.output.bytes();
        served.output.release().await?;
        if let Some(stores) = &stores {
            stores.wait_empty().await?;
        }
        cold.push((computed.finished, computed.read));
        warm.push((served.finished, served.read));
    }
    verified &= warm_store_used.is_none_or(|bytes| bytes == 0);
    let median = |runs: &[(Duration, Duration)], pick: fn(&(Duration, Duration)) -> Duration| {
        let mut times: Vec<Duration> = runs.iter().map(pick).collect();
        times.sort();
        times[times.len() / 2]
    };
    let (cold_s, warm_s) = (median(&cold, |r| r.0), median(&warm, |r| r.0));
    let (cold_read_s, warm_read_s) = (median(&cold, |r| r.1), median(&warm, |r| r.1));
    let ratio = |warm: Duration, cold: Duration| warm.as_secs_f64() / cold.as_secs_f64();
    extra.push(("cold_s", cold_s.as_secs_f64().into()));
    extra.push(("warm_s", warm_s.as_secs_f64().into()));
    extra.push(("warm_over_cold", ratio(warm_s, cold_s).into()));
    extra.push(("cold_read_s", cold_read_s.as_secs_f64().into()));
    extra.push(("warm_read_s", warm_read_s.as_secs_f64().into()));
    extra.push((
        "warm_read_over_cold_read",
        ratio(warm_read_s, cold_read_s).into(),
    ));
    extra.push(("output_bytes", output_bytes.into()));
    extra.push((
        "warm_store_used_bytes",
        warm_store_used.map_or(serde_json::Value::Null, Into::into),
    ));
    Ok((warm_s, verified))
}

fn verify_groups(batches: &[RecordBatch], truth: &EventsTruth) -> anyhow::Result<bool> {
    let mut seen = 0;
    for batch in batches {
        let groups = batch
            .column_by_name("group")
            .and_then(|c| c.as_any().downcast_ref::<Int32Array>())
            .context("no Int32 group column")?;
        let counts = int64s(batch, "n")?;
        let sums = batch
            .column_by_name("sum")
            .and_then(|c| c.as_any().downcast_ref::<Float64Array>())
            .context("no sum column")?;
        for row in 0..batch.num_rows() {
            let Some((count, sum)) = truth.groups.get(&groups.value(row)) else {
                return Ok(false);
            };
            if counts.value(row) != *count || !close(sums.value(row), *sum) {
                return Ok(false);
            }
            seen += 1;
        }
    }
    Ok(seen == truth.groups.len())
}

/// Reads the sort's output files back in name order: every key present once, in order.
fn verify_sorted_files(dir: &Path, truth: &RecordsTruth) -> anyhow::Result<bool> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "parquet"))
        .collect();
    files.sort();
    let (_, batches) = parquet_read(&files)?;
    let mut previous = i64::MIN;
    for batch in &batches {
        for key in int64s(batch, "key")?.values() {
            if *key < previous {
                return Ok(false);
            }
            previous = *key;
        }
    }
    Ok(key_checksums(&batches)? == (truth.rows, truth.key_sum, truth.key_xor))
}

/// One process, one thread: read the files (all columns, as the job does), sort everything
/// with Arrow's sort indices and one `take`, and write it as Parquet like the job (whose
/// default codec is zstd at its default level).
fn sort_baseline(files: &[PathBuf]) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let (_, batches) = parquet_read(files)?;
    let schema = records_schema();
    let all = concat_batches(&schema, &batches)?;
    let key = all.column_by_name("key").context("no key column")?;
    let indices = lexsort_to_indices(
        &[SortColumn {
            values: Arc::clone(key),
            options: None,
        }],
        None,
    )?;
    let sorted = take_record_batch(&all, &indices)?;
    let out = tempfile::tempfile()?;
    let properties = WriterProperties::builder()
        .set_compression(Compression::ZSTD(Default::default()))
        .build();
    let mut writer = ArrowWriter::try_new(out, schema, Some(properties))?;
    writer.write(&sorted)?;
    writer.close()?;
    let elapsed = started.elapsed();
    ensure!(
        int64s(&sorted, "key")?.values().is_sorted(),
        "the sort baseline's output is not sorted"
    );
    Ok(elapsed)
}

/// One process, one thread: read only the columns the job reads (`group`, `value`) and
/// aggregate them with a plain hash map over the column slices, checked against the truth.
fn groupby_baseline(files: &[PathBuf], truth: &EventsTruth) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut groups: HashMap<i32, (i64, f64)> = HashMap::with_capacity(GROUPS as usize);
    for batch in read_columns(files, &["group", "value"])? {
        let keys = batch
            .column_by_name("group")
            .and_then(|c| c.as_any().downcast_ref::<Int32Array>())
            .context("no Int32 group column")?;
        let values = batch
            .column_by_name("value")
            .and_then(|c| c.as_any().downcast_ref::<Float64Array>())
            .context("no Float64 value column")?;
        for (key, value) in keys.values().iter().zip(values.values()) {
            let tally = groups.entry(*key).or_default();
            tally.0 += 1;
            tally.1 += value;
        }
    }
    // The job computes the mean too.
    let means: Vec<f64> = groups.values().map(|(n, sum)| sum / *n as f64).collect();
    let elapsed = started.elapsed();
    std::hint::black_box(means);
    ensure!(
        groups.len() == truth.groups.len()
            && truth.groups.iter().all(|(key, (n, sum))| groups
                .get(key)
                .is_some_and(|(count, total)| count == n && close(*total, *sum))),
        "the groupby baseline disagrees with the truth"
    );
    Ok(elapsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_result_fails_the_bench() {
        assert!(ensure_verified(&[]).is_ok());
        let error = ensure_verified(&["sort", "groupby"]).unwrap_err();
        assert_eq!(error.to_string(), "wrong results from: sort, groupby");
    }
}
