//! `floe-bench soak`: a cluster that runs thousands of jobs must give back what each one took.
//!
//! Starts 3 scheduler replicas and 2 nodes (real `floe` processes) with small object stores
//! (so held results spill) and a low `jobs.keep_finished` (so the run passes it), then runs
//! jobs one after the other in blocks, mixed by their index modulo 10:
//! - 0–2 `kept`: a result kept in the cluster, fetched, checked, held to the end of the block
//!   (so the stores fill and spill), then released;
//! - 3 `sink`: the same rows written as Parquet (mode overwrite) into one of a few temporary
//!   directories, their row count checked on disk;
//! - 4–5 `cached`: one of a few cached datasets, re-run (served from the cache after its first
//!   run), fetched, checked and released;
//! - 6 `failed`: a strict cast of text to int64 over a CSV file holding a non-number;
//! - 7 `cancelled`: a large job cancelled right after its submission;
//! - 8 `deleted`: a small job whose output is kept, then the job deleted;
//! - 9 `grouped`: a sum per group, fetched, checked and released.
//!
//! After each block it prints one JSON line of what the cluster holds (see [`BlockFigures`]),
//! and at the end a summary of the targets. A wrong result or a job ending otherwise than its
//! kind expects fails the run; a missed target is only reported.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Int64Type};
use floe_api::node_protocol::{NodeProtocol, NodeRequest, NodeResponse, StoreUsage};
use floe_client::local::{
    LocalCredentials, LocalNode, LocalNodeConfig, LocalSchedulers, LocalSchedulersConfig,
};
use floe_client::{
    AggFunction, Aggregation, Client, Dataset, Error as ClientError, JobHandle, JobOutput,
    WriteMode, WriteOptions, col, lit,
};
use floe_core::config::Config;
use floe_core::wire::RpcClient;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const READY_TIMEOUT: Duration = Duration::from_secs(60);
const REPLICAS: u64 = 3;
const NODES: usize = 2;
const WORKERS: u32 = 2;
/// Rows of a kept, sink or grouped job: 16 bytes a row (`id`, `y`) of output.
const ROWS: u64 = 400_000;
/// Rows of a cached dataset, and of a deleted job.
const SMALL_ROWS: u64 = 50_000;
/// Rows of a cancelled job: more than it can compute before the cancel arrives.
const CANCELLED_ROWS: u64 = 200_000_000;
/// Distinct cached datasets (each run once cold, then from the cache).
const CACHED_VARIANTS: u64 = 4;
/// Distinct sink directories the writes overwrite.
const SINKS: u64 = 4;
/// Groups of a grouped job.
const GROUPS: i64 = 10;
/// How long a block waits for released results to be freed before it measures.
const SETTLE: Duration = Duration::from_secs(5);
/// `GET /api/jobs` calls per block; their median is reported.
const API_CALLS: usize = 5;

/// The run's size.
struct Plan {
    jobs: u64,
    block: u64,
    keep_finished: u64,
    /// `scheduler.snapshot_entries`: low enough that the run compacts the log several times.
    snapshot_entries: u64,
}

impl Plan {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                jobs: 300,
                block: 50,
                keep_finished: 200,
                snapshot_entries: 1_000,
            }
        } else {
            Self {
                jobs: 3_000,
                block: 500,
                keep_finished: 1_000,
                snapshot_entries: 10_000,
            }
        }
    }
}

/// What job `index` of the run does (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobKind {
    Kept,
    Sink,
    Cached,
    Failed,
    Cancelled,
    Deleted,
    Grouped,
}

impl JobKind {
    fn of(index: u64) -> Self {
        match index % 10 {
            0..=2 => Self::Kept,
            3 => Self::Sink,
            4 | 5 => Self::Cached,
            6 => Self::Failed,
            7 => Self::Cancelled,
            8 => Self::Deleted,
            _ => Self::Grouped,
        }
    }
}

/// The cluster, its directory and the inputs the jobs read; removed when dropped.
struct Soak {
    dir: PathBuf,
    credentials: LocalCredentials,
    cluster: LocalSchedulers,
    nodes: Vec<LocalNode>,
    client: Client,
    /// A CSV file whose column `v` holds a value that is not a number.
    bad_csv: PathBuf,
}

impl Soak {
    async fn start(config: &Config, plan: &Plan) -> anyhow::Result<Self> {
        let dir = config
            .paths
            .data_dir
            .join(format!("bench-soak-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let credentials = LocalCredentials::generate(&dir)?;
        let cluster = LocalSchedulers::start(LocalSchedulersConfig {
            binary: crate::floe_binary()?,
            replicas: REPLICAS,
            dir: dir.clone(),
            credentials: credentials.clone(),
            settings: vec![
                format!("jobs.keep_finished={}", plan.keep_finished),
                format!("scheduler.snapshot_entries={}", plan.snapshot_entries),
            ],
            tls: floe_core::config::TlsConfig::default(),
        })?;
        cluster.wait_for_leader(READY_TIMEOUT).await?;
        let mut nodes = Vec::new();
        for index in 0..NODES {
            let node = LocalNode::start(&LocalNodeConfig {
                binary: crate::floe_binary()?,
                schedulers: cluster.addrs(),
                dir: dir.clone(),
                name: format!("node-{index}"),
                credentials: credentials.clone(),
                // Stores far smaller than what a block holds, so results spill.
                settings: vec![
                    format!("node.workers={WORKERS}"),
                    "memory.object_store_min=16MiB".to_owned(),
                    "memory.object_store_max=24MiB".to_owned(),
                ],
            })?;
            node.wait_ready(&credentials.member_wire(), WORKERS, READY_TIMEOUT)
                .await?;
            nodes.push(node);
        }
        let client = Client::connect(&cluster.addrs(), credentials.admin_token.expose()).await?;
        let bad_csv = dir.join("bad.csv");
        std::fs::write(&bad_csv, "id,v\n1,10\n2,20\n3,not a number\n")
            .with_context(|| format!("cannot write {}", bad_csv.display()))?;
        Ok(Self {
            dir,
            credentials,
            cluster,
            nodes,
            client,
            bad_csv,
        })
    }

    /// Runs job `index` of the run to its end, checking it ended as its kind expects.
    async fn run_job(&self, index: u64, held: &mut Vec<JobOutput>) -> anyhow::Result<()> {
        match JobKind::of(index) {
            JobKind::Kept => {
                let output = self.submit(&mapped(ROWS)?).await?.wait().await?;
                check_mapped(&output, ROWS).await?;
                held.push(output);
            }
            JobKind::Sink => {
                let sink = self.dir.join(format!("sink-{}", index % SINKS));
                let options = WriteOptions {
                    mode: WriteMode::Overwrite,
                    ..WriteOptions::default()
                };
                let job = mapped(ROWS)?.write_parquet(&sink, options)?;
                drop(self.submit(&job).await?.wait().await?);
                let rows = parquet_rows(&sink)?;
                ensure!(
                    rows == ROWS,
                    "job {index} wrote {rows} rows to {}, not {ROWS}",
                    sink.display()
                );
            }
            JobKind::Cached => {
                let rows = SMALL_ROWS + index % CACHED_VARIANTS;
                let output = self.submit(&mapped(rows)?.cache()?).await?.wait().await?;
                check_mapped(&output, rows).await?;
                output.release().await?;
            }
            JobKind::Failed => {
                let job = Dataset::read_csv(&[&self.bad_csv])?
                    .with_column("n", col("v").cast(DataType::Int64))?;
                match self.submit(&job).await?.wait().await {
                    Err(ClientError::JobFailed { .. }) => {}
                    Err(error) => return Err(error.into()),
                    Ok(_) => bail!("job {index} cast text to int64 and succeeded"),
                }
            }
            JobKind::Cancelled => {
                let handle = self.submit(&mapped(CANCELLED_ROWS)?).await?;
                handle.cancel().await?;
                match handle.wait().await {
                    Err(ClientError::JobCancelled(_)) => {}
                    Err(error) => return Err(error.into()),
                    Ok(_) => bail!("job {index} was cancelled and succeeded"),
                }
            }
            JobKind::Deleted => {
                let handle = self.submit(&mapped(SMALL_ROWS)?).await?;
                let output = handle.wait().await?;
                ensure!(output.rows() == SMALL_ROWS, "job {index}: wrong row count");
                output.keep();
                handle.delete().await?;
            }
            JobKind::Grouped => {
                let job = mapped(ROWS)?
                    .with_column("k", col("id") % lit(GROUPS))?
                    .groupby(&["k"])
                    .agg(vec![Aggregation::of(AggFunction::Sum, "y")])?;
                let output = self.submit(&job).await?.wait().await?;
                let batches = output.to_arrow().await?;
                let groups: usize = batches.iter().map(RecordBatch::num_rows).sum();
                ensure!(
                    groups == GROUPS as usize,
                    "job {index}: {groups} groups, not {GROUPS}"
                );
                let sum = sum_column(&batches, "sum_y")?;
                ensure!(
                    sum == mapped_sum(ROWS),
                    "job {index}: grouped sum {sum}, expected {}",
                    mapped_sum(ROWS)
                );
                output.release().await?;
            }
        }
        Ok(())
    }

    async fn submit(&self, dataset: &Dataset) -> anyhow::Result<JobHandle> {
        Ok(self.client.submit(dataset).await?)
    }

    /// The nodes' object stores, summed.
    async fn store_usage(&self) -> anyhow::Result<StoreUsage> {
        let mut total = StoreUsage::default();
        for node in &self.nodes {
            let mut client =
                RpcClient::<NodeProtocol>::connect(node.addr(), self.credentials.member_wire())
                    .await?;
            let store = match client.call(&NodeRequest::Status).await? {
                NodeResponse::Status(status) => status.store,
                other => bail!("node {} answered Status with {other:?}", node.addr()),
            };
            total.used += store.used;
            total.objects_in_memory += store.objects_in_memory;
            total.spilled_bytes += store.spilled_bytes;
            total.spilled_objects += store.spilled_objects;
            total.fallback_bytes += store.fallback_bytes;
        }
        Ok(total)
    }

    /// Waits up to [`SETTLE`] for the stores to hold nothing, and returns their use.
    async fn settled_usage(&self) -> anyhow::Result<StoreUsage> {
        let deadline = Instant::now() + SETTLE;
        loop {
            let usage = self.store_usage().await?;
            let held = usage.objects_in_memory + usage.spilled_objects;
            if held == 0 || Instant::now() >= deadline {
                return Ok(usage);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn measure(
        &self,
        block: u64,
        jobs: u64,
        latencies: &mut [f64],
    ) -> anyhow::Result<BlockFigures> {
        let usage = self.settled_usage().await?;
        // `LocalNode` keeps node `name`'s data under `dir/<name>`.
        let spill_bytes = (0..self.nodes.len())
            .map(|index| dir_bytes(&self.dir.join(format!("node-{index}")).join("spill")))
            .sum();
        let leader = self.cluster.wait_for_leader(READY_TIMEOUT).await?;
        let mut raft_dir_bytes = 0;
        let mut snapshot_bytes = 0;
        for id in 1..=REPLICAS {
            let raft = self.dir.join(format!("replica-{id}")).join("raft");
            raft_dir_bytes = raft_dir_bytes.max(dir_bytes(&raft));
            snapshot_bytes = snapshot_bytes.max(file_bytes(&raft.join("snapshot")));
        }
        let applied_index = self.cluster.status(leader).await?.applied;
        let state = self.cluster.client()?.read_state().await?;
        let state_bytes = state.encode()?.len() as u64;
        let leader_rss_bytes = self.cluster.pid(leader).map_or(0, rss_bytes);
        let node_rss_bytes = self.nodes.iter().map(|node| rss_bytes(node.pid())).sum();
        let http = self
            .cluster
            .http_addr(leader)
            .context("the leader has no HTTP address")?
            .to_owned();
        let mut api = Vec::new();
        for _ in 0..API_CALLS {
            api.push(get_api_jobs(&http, self.credentials.admin_token.expose()).await?);
        }
        Ok(BlockFigures {
            block,
            jobs,
            shm_used_bytes: usage.used,
            objects_in_memory: usage.objects_in_memory,
            store_spilled_bytes: usage.spilled_bytes,
            spilled_objects: usage.spilled_objects,
            spill_bytes,
            fallback_bytes: usage.fallback_bytes,
            raft_dir_bytes,
            snapshot_bytes,
            applied_index,
            state_bytes,
            state_jobs: state.jobs.len() as u64,
            leader_rss_bytes,
            node_rss_bytes,
            job_p50_ms: percentile(latencies, 0.5),
            job_p99_ms: percentile(latencies, 0.99),
            api_jobs_ms: percentile(&mut api, 0.5),
        })
    }
}

impl Drop for Soak {
    fn drop(&mut self) {
        self.nodes.clear();
        // Best effort: a leftover directory is visible and harmless.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `id` and `y = 3 * id + 1` over `rows` ids.
fn mapped(rows: u64) -> anyhow::Result<Dataset> {
    Ok(Dataset::range(rows)?.with_column("y", col("id") * lit(3i64) + lit(1i64))?)
}

/// The sum of `y` over `rows` ids, computed here.
fn mapped_sum(rows: u64) -> i64 {
    let rows = rows as i64;
    3 * (rows * (rows - 1) / 2) + rows
}

async fn check_mapped(output: &JobOutput, rows: u64) -> anyhow::Result<()> {
    let batches = output.to_arrow().await?;
    let fetched: u64 = batches.iter().map(|batch| batch.num_rows() as u64).sum();
    ensure!(
        fetched == rows,
        "job {} returned {fetched} rows, not {rows}",
        output.job
    );
    let sum = sum_column(&batches, "y")?;
    ensure!(
        sum == mapped_sum(rows),
        "job {} summed to {sum}, expected {}",
        output.job,
        mapped_sum(rows)
    );
    Ok(())
}

fn sum_column(batches: &[RecordBatch], name: &str) -> anyhow::Result<i64> {
    let mut sum = 0i64;
    for batch in batches {
        let column = batch
            .column_by_name(name)
            .with_context(|| format!("no column {name} in the result"))?;
        let values = column
            .as_primitive_opt::<Int64Type>()
            .with_context(|| format!("column {name} is {}, not int64", column.data_type()))?;
        ensure!(values.null_count() == 0, "column {name} holds nulls");
        sum += values.values().iter().sum::<i64>();
    }
    Ok(sum)
}

/// Rows in the Parquet files of `dir`, from their footers.
fn parquet_rows(dir: &Path) -> anyhow::Result<u64> {
    let mut rows = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "parquet") {
            let file = std::fs::File::open(&path)?;
            let reader = parquet::file::reader::SerializedFileReader::new(file)?;
            use parquet::file::reader::FileReader;
            rows += reader.metadata().file_metadata().num_rows() as u64;
        }
    }
    Ok(rows)
}

/// Bytes of the files under `dir` (0 when it does not exist), walked without recursion.
fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut pending = vec![dir.to_owned()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            match entry.metadata() {
                Ok(meta) if meta.is_dir() => pending.push(entry.path()),
                Ok(meta) => total += meta.len(),
                Err(_) => {}
            }
        }
    }
    total
}

fn file_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |meta| meta.len())
}

/// A process's resident memory, from `/proc/<pid>/status` (0 where it cannot be read).
pub(crate) fn rss_bytes(pid: u32) -> u64 {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return 0;
    };
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kib| kib * 1024)
}

/// One `GET /api/jobs` on `addr` with `token`; its time in milliseconds.
pub(crate) async fn get_api_jobs(addr: &str, token: &str) -> anyhow::Result<f64> {
    let answer = http_get(addr, "/api/jobs", token).await?;
    ensure!(
        answer.status == 200,
        "GET /api/jobs answered {}: {}",
        answer.status,
        answer.body_start()
    );
    Ok(answer.ms)
}

/// What one HTTP GET answered, and how long the whole exchange took.
pub(crate) struct HttpAnswer {
    pub ms: f64,
    pub status: u16,
    /// Everything after the headers (the server closes the connection after one answer).
    pub body: Vec<u8>,
}

impl HttpAnswer {
    /// The start of the body, for an error message.
    pub fn body_start(&self) -> String {
        String::from_utf8_lossy(&self.body[..self.body.len().min(200)]).into_owned()
    }
}

/// One `GET path` on `addr` with `token`, over a fresh connection (`Connection: close`), timed
/// from the connect to the last byte.
pub(crate) async fn http_get(addr: &str, path: &str, token: &str) -> anyhow::Result<HttpAnswer> {
    let started = Instant::now();
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         Connection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let ms = millis(started.elapsed());
    let status = response
        .get(9..12)
        .and_then(|code| std::str::from_utf8(code).ok())
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("GET {path}: no HTTP status line"))?;
    let body_at = response
        .windows(4)
        .position(|window| window == b"\r\n\r\n")
        .map_or(response.len(), |at| at + 4);
    Ok(HttpAnswer {
        ms,
        status,
        body: response.split_off(body_at),
    })
}

pub(crate) fn millis(time: Duration) -> f64 {
    time.as_secs_f64() * 1000.0
}

/// The `fraction` percentile of `values` (nearest rank); 0 for none.
pub(crate) fn percentile(values: &mut [f64], fraction: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((values.len() as f64 * fraction).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// What the cluster holds after a block, settled.
#[derive(Debug, Clone, Copy)]
struct BlockFigures {
    block: u64,
    /// Jobs run so far.
    jobs: u64,
    /// The nodes' object stores in use, summed.
    shm_used_bytes: u64,
    objects_in_memory: u64,
    /// What the stores count as spilled, against what is on disk (`spill_bytes`).
    store_spilled_bytes: u64,
    spilled_objects: u64,
    /// Files under the nodes' spill directories, summed.
    spill_bytes: u64,
    /// Objects in disk-backed fallback files, summed over the nodes.
    fallback_bytes: u64,
    /// The largest replica's raft directory.
    raft_dir_bytes: u64,
    /// The largest replica's snapshot file.
    snapshot_bytes: u64,
    /// The leader's last applied log index: log entries the run has made.
    applied_index: u64,
    /// The encoded replicated state, read from the leader.
    state_bytes: u64,
    /// Jobs in the replicated state.
    state_jobs: u64,
    leader_rss_bytes: u64,
    /// The node agents' resident memory, summed (their workers not included).
    node_rss_bytes: u64,
    job_p50_ms: f64,
    job_p99_ms: f64,
    api_jobs_ms: f64,
}

impl BlockFigures {
    fn json(&self) -> serde_json::Value {
        json!({
            "bench": "soak",
            "block": self.block,
            "jobs": self.jobs,
            "shm_used_bytes": self.shm_used_bytes,
            "objects_in_memory": self.objects_in_memory,
            "store_spilled_bytes": self.store_spilled_bytes,
            "spilled_objects": self.spilled_objects,
            "spill_bytes": self.spill_bytes,
            "fallback_bytes": self.fallback_bytes,
            "raft_dir_bytes": self.raft_dir_bytes,
            "snapshot_bytes": self.snapshot_bytes,
            "applied_index": self.applied_index,
            "state_bytes": self.state_bytes,
            "state_jobs": self.state_jobs,
            "leader_rss_bytes": self.leader_rss_bytes,
            "node_rss_bytes": self.node_rss_bytes,
            "job_p50_ms": round(self.job_p50_ms),
            "job_p99_ms": round(self.job_p99_ms),
            "api_jobs_ms": round(self.api_jobs_ms),
        })
    }
}

fn round(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

/// Whether `value` is within 5% of `before` (or both at most 1 MiB: an empty store's
/// bookkeeping, not a leak).
fn within_5_percent(value: u64, before: u64) -> bool {
    const NOISE: u64 = 1 << 20;
    (value <= NOISE && before <= NOISE) || value as f64 <= before as f64 * 1.05
}

/// The summary line: each target, what it compares and whether it was met.
fn summary(blocks: &[BlockFigures], plan: &Plan) -> serde_json::Value {
    let returns = |figure: fn(&BlockFigures) -> u64| {
        blocks
            .windows(2)
            .all(|pair| within_5_percent(figure(&pair[1]), figure(&pair[0])))
    };
    // "Flat": the last block at most 1.1× the first block whose state holds keep_finished
    // jobs (deleted jobs leave at once, so the state reaches it after more jobs than that).
    let reached = blocks
        .iter()
        .position(|block| block.state_jobs >= plan.keep_finished)
        .unwrap_or(blocks.len().saturating_sub(1));
    let flat = |figure: fn(&BlockFigures) -> u64| match (blocks.get(reached), blocks.last()) {
        (Some(first), Some(last)) => figure(last) as f64 <= figure(first) as f64 * 1.1,
        _ => false,
    };
    // The raft directory is a sawtooth (the log grows, then a snapshot compacts it): flat
    // means the last block sets no new high, at most 1.1× the largest seen up to `reached`.
    let raft_flat = match (blocks.get(..=reached), blocks.last()) {
        (Some(before), Some(last)) => {
            let peak = before
                .iter()
                .map(|block| block.raft_dir_bytes)
                .max()
                .unwrap_or(0);
            last.raft_dir_bytes as f64 <= peak as f64 * 1.1
        }
        _ => false,
    };
    let p99 = match (blocks.first(), blocks.last()) {
        (Some(first), Some(last)) => last.job_p99_ms <= first.job_p99_ms * 1.2,
        _ => false,
    };
    json!({
        "bench": "soak",
        "summary": true,
        "jobs": plan.jobs,
        "keep_finished": plan.keep_finished,
        "snapshot_entries": plan.snapshot_entries,
        "keep_finished_reached_at_block": blocks.get(reached).map(|block| block.block),
        "flat_means": "state: last block <= 1.1 x the block where keep_finished was reached; \
                       raft dir: last block <= 1.1 x the largest up to that block",
        "targets_met": {
            "shm_within_5pct_of_block_before": returns(|block| block.shm_used_bytes),
            "spill_within_5pct_of_block_before": returns(|block| block.spill_bytes + block.fallback_bytes),
            "raft_dir_flat": raft_flat,
            "state_bytes_flat": flat(|block| block.state_bytes),
            "last_p99_within_1_2x_first": p99,
        },
    })
}

pub fn run(quick: bool, config: &Config) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(soak(config, &Plan::new(quick)))
}

async fn soak(config: &Config, plan: &Plan) -> anyhow::Result<()> {
    let soak = Soak::start(config, plan).await?;
    let mut blocks = Vec::new();
    let mut index = 0;
    while index < plan.jobs {
        let end = (index + plan.block).min(plan.jobs);
        let mut latencies = Vec::new();
        let mut held = Vec::new();
        while index < end {
            let started = Instant::now();
            soak.run_job(index, &mut held)
                .await
                .with_context(|| format!("job {index} ({:?})", JobKind::of(index)))?;
            latencies.push(millis(started.elapsed()));
            index += 1;
        }
        for output in held {
            output.release().await?;
        }
        let figures = soak
            .measure(blocks.len() as u64 + 1, index, &mut latencies)
            .await?;
        println!("{}", figures.json());
        blocks.push(figures);
    }
    println!("{}", summary(&blocks, plan));
    Ok(())
}
