//! `floe-bench <part> [--quick]`: measurements of one part of floe, printed as JSON lines.
//!
//! A binary of its own, so the production `floe` carries neither the benchmarks nor their
//! dependencies. The parts that run a cluster start the `floe` binary next to this one: build
//! both with `cargo build --release -p floe -p floe-bench`. They send it stage tasks only, so
//! building them together adds no test-only task kind to that `floe`.
//!
//! Every figure is one line, `{"bench": <part>, "figure": <name>, "value": <number>,
//! "unit": <unit>, ...labels}`, and every figure of one run is measured in that run, so ratios
//! between them (a store's put against a plain memcpy on the same machine, at the same moment)
//! are meaningful. `--quick` runs a smaller version for CI and smoke tests. Figures for
//! docs/BENCHMARKS.md come from `--release` builds.
//!
//! Each part is a module with a `run` function and a variant of [`Bench`].

// `bench scale` prints one JSON object of about 60 figures; `json!` recurses once per token.
#![recursion_limit = "256"]

mod cache;
mod dataset;
mod node;
mod objectstore;
mod placement;
mod python;
mod raft;
mod s3;
mod scale;
mod soak;
mod workloads;

use std::time::Duration;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use floe_core::Config;
use floe_core::config::ConfigLoader;
use workloads::Workload;

/// Measure a part of floe; prints one JSON line per figure.
///
/// Settings come as for `floe`: a TOML file (--config or FLOE_CONFIG), then FLOE_<SECTION>_<KEY>
/// environment variables, then --set flags.
#[derive(Debug, Parser)]
#[command(name = "floe-bench", version)]
struct Cli {
    /// A TOML config file.
    #[arg(long, global = true, env = "FLOE_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Override one setting, e.g. --set paths.data_dir=/tmp/floe. Repeatable.
    #[arg(long = "set", global = true, value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    #[command(subcommand)]
    bench: Bench,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = load_config(&cli).and_then(|config| run(cli.bench, &config));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn load_config(cli: &Cli) -> anyhow::Result<Config> {
    let mut loader = ConfigLoader::new().env(std::env::vars());
    if let Some(path) = &cli.config {
        loader = loader.file(path);
    }
    for assignment in &cli.set {
        loader = loader.set(assignment)?;
    }
    Ok(loader.load()?)
}

/// The `floe` binary the benchmarks start clusters from: the one next to this executable.
fn floe_binary() -> anyhow::Result<PathBuf> {
    Ok(floe_client::find_floe_binary()?)
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Fingerprint cache: opening a cached result against recomputing it.
    Cache {
        /// A smaller run that finishes in seconds.
        #[arg(long)]
        quick: bool,
    },
    /// Dataset kernels: a fused with_column + filter stage against a hand-written loop, and a
    /// Parquet read that skips row groups by statistics against a full scan.
    Dataset {
        /// A smaller run that finishes in seconds.
        #[arg(long)]
        quick: bool,
    },
    /// Object store: put/get against memcpy, zero-copy block decoding, spill and restore
    /// against plain file I/O.
    Objectstore {
        /// A smaller run that finishes in seconds.
        #[arg(long)]
        quick: bool,
    },
    /// Scheduler: commits per second and commit latency of three replicas on loopback, and
    /// the time to fail over after the leader is killed.
    Raft {
        /// A smaller run that finishes in seconds.
        #[arg(long)]
        quick: bool,
    },
    /// Placement decisions per second against 1,000 simulated nodes.
    Placement {
        /// A smaller run that finishes in seconds.
        #[arg(long)]
        quick: bool,
    },
    /// Object transfer between two `floe node`s against a raw loopback TCP copy.
    Transfer {
        /// A smaller run that finishes in seconds.
        #[arg(long)]
        quick: bool,
    },
    /// Object storage: map and groupby reads of one Parquet file from a local S3 server
    /// against the local file, and the bytes a one-column read fetches.
    S3 {
        /// A smaller run that finishes in seconds.
        #[arg(long)]
        quick: bool,
    },
    /// Empty tasks per second run by one `floe node`'s worker processes.
    Tasks {
        /// A smaller run that finishes in seconds.
        #[arg(long)]
        quick: bool,
    },
    /// End-to-end: add value*2+1 to 10M event rows read from Parquet, and sum it.
    Map(WorkloadArgs),
    /// End-to-end: keep the event rows with value > 0.5, and count them.
    Filter(WorkloadArgs),
    /// End-to-end: sort 10M 100-byte records (1 GB) by key and write them as Parquet.
    Sort(WorkloadArgs),
    /// End-to-end: group 10M event rows into 1,000 groups (count, sum, mean).
    Groupby(WorkloadArgs),
    /// End-to-end: random_shuffle of the 1 GB of records.
    Shuffle(WorkloadArgs),
    /// End-to-end: hash-repartition the events by user_id into 32.
    Repartition(WorkloadArgs),
    /// End-to-end: the map pipeline cold, then again served from the cache.
    Rerun(WorkloadArgs),
    /// End-to-end: materialize 3× the cluster's object-store memory.
    Spill(WorkloadArgs),
    /// End-to-end: the map pipeline through an identity Python UDF (`python3` with pyarrow)
    /// and natively, in the same run.
    Pyudf(WorkloadArgs),
    /// Python client: `iter_batches` against the Rust client, `map_batches(lambda b: b)`
    /// against the native expression and `to_pandas()` against pyarrow, on the map data.
    Python {
        /// 1M rows instead of 10M, one run each.
        #[arg(long)]
        quick: bool,
    },
    /// Lifecycle: thousands of mixed jobs on 3 replicas and 2 nodes; after each block, what
    /// the cluster still holds (memory, spill, raft log, state, RSS) and the job latencies.
    Soak {
        /// 300 jobs in blocks of 50 instead of 3,000 in blocks of 500.
        #[arg(long)]
        quick: bool,
    },
    /// Control plane: 3 replicas, 1,000 simulated nodes heartbeating and 100,000 jobs
    /// committed; leader CPU, heartbeat and commit latency, snapshots, failover.
    Scale {
        /// 200 nodes and 5,000 jobs instead of 1,000 and 100,000.
        #[arg(long)]
        quick: bool,
        /// Simulate this many nodes instead.
        #[arg(long)]
        nodes: Option<usize>,
        /// Pre-fill this many jobs instead.
        #[arg(long)]
        jobs: Option<u64>,
    },
    /// Every end-to-end workload, one after the other.
    All(WorkloadArgs),
}

/// The options every end-to-end workload takes.
#[derive(Debug, clap::Args)]
struct WorkloadArgs {
    /// A smaller run (1M rows) that finishes in seconds to a minute.
    #[arg(long)]
    quick: bool,
    /// Run on this cluster (its scheduler replicas, host:port,…) instead of a local one; its
    /// nodes must see paths.data_dir at the same path, where the data is generated.
    #[arg(long, value_name = "HOST:PORT,…")]
    address: Option<String>,
}

fn workloads(
    which: &[workloads::Workload],
    args: WorkloadArgs,
    config: &Config,
) -> anyhow::Result<()> {
    workloads::run(
        which,
        &workloads::RunConfig::new(args.quick, args.address, config),
    )
}

fn run(which: Bench, config: &Config) -> anyhow::Result<()> {
    match which {
        Bench::Raft { quick } => raft::run(quick, config),
        Bench::Placement { quick } => placement::run(quick),
        Bench::Transfer { quick } => node::run_transfer(quick, config),
        Bench::Tasks { quick } => node::run_tasks(quick, config),
        Bench::Cache { quick } => cache::run(quick, config),
        Bench::Dataset { quick } => dataset::run(quick),
        Bench::Objectstore { quick } => objectstore::run(quick, config),
        Bench::S3 { quick } => s3::run(quick),
        Bench::Map(args) => workloads(&[Workload::Map], args, config),
        Bench::Filter(args) => workloads(&[Workload::Filter], args, config),
        Bench::Sort(args) => workloads(&[Workload::Sort], args, config),
        Bench::Groupby(args) => workloads(&[Workload::Groupby], args, config),
        Bench::Shuffle(args) => workloads(&[Workload::Shuffle], args, config),
        Bench::Repartition(args) => workloads(&[Workload::Repartition], args, config),
        Bench::Rerun(args) => workloads(&[Workload::Rerun], args, config),
        Bench::Spill(args) => workloads(&[Workload::Spill], args, config),
        Bench::Pyudf(args) => workloads(&[Workload::Pyudf], args, config),
        Bench::Python { quick } => python::run(quick, config),
        Bench::Soak { quick } => soak::run(quick, config),
        Bench::Scale { quick, nodes, jobs } => scale::run(quick, nodes, jobs, config),
        Bench::All(args) => workloads(&Workload::ALL, args, config),
    }
}

/// Prints one figure as a JSON line.
fn print_figure(
    bench: &str,
    figure: &str,
    value: f64,
    unit: &str,
    labels: &[(&str, serde_json::Value)],
) {
    let mut line = serde_json::Map::new();
    line.insert("bench".into(), bench.into());
    line.insert("figure".into(), figure.into());
    line.insert("value".into(), value.into());
    line.insert("unit".into(), unit.into());
    for (name, label) in labels {
        line.insert((*name).into(), label.clone());
    }
    println!("{}", serde_json::Value::Object(line));
}

/// The median of `runs` timings of `work` (at least one run).
fn median_time(
    runs: usize,
    mut work: impl FnMut() -> anyhow::Result<Duration>,
) -> anyhow::Result<Duration> {
    let mut times = (0..runs.max(1))
        .map(|_| work())
        .collect::<anyhow::Result<Vec<_>>>()?;
    times.sort();
    Ok(times[times.len() / 2])
}

/// SplitMix64: the benches' seeded generator, whose stream depends only on its seed, so
/// every run generates the same data.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Below `n` (by remainder: the bias is irrelevant to benchmark data).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Bytes per second in GB/s (10^9 bytes).
fn gbps(bytes: u64, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64() / 1e9
}
