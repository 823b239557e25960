//! floe-client: the library pipelines are written with.
//!
//! A [`Dataset`] is a thin, immutable builder over [`floe_core::plan::LogicalPlan`]: every
//! method adds one plan node and returns a new `Dataset`, and every node is validated and
//! fingerprinted as it is added, so a misspelled column or a type mismatch is an error on the
//! line that introduced it:
//!
//! ```
//! use floe_client::{AggFunction, Aggregation, Dataset, SortKey, col, lit};
//!
//! # fn main() -> Result<(), floe_client::Error> {
//! let totals = Dataset::range(1000)?
//!     .with_column("bucket", col("id") % lit(10i64))?
//!     .filter(col("id").gt(lit(100i64)))?
//!     .groupby(&["bucket"])
//!     .agg(vec![Aggregation::count_rows("n"), Aggregation::of(AggFunction::Sum, "id")])?
//!     .sort(vec![SortKey::desc("sum_id")])?;
//! assert_eq!(totals.column_names(), vec!["bucket", "n", "sum_id"]);
//! assert!(Dataset::range(10)?.select(&["idd"]).is_err());
//! # Ok(())
//! # }
//! ```
//!
//! ## Consuming a dataset
//!
//! [`Dataset::count`], [`Dataset::take`], [`Dataset::iter_batches`] and
//! [`Dataset::materialize`] hand the plan (with its random seeds resolved) to the dataset's
//! [`Executor`] and read the blocks it streams back. A dataset carries its executor as a handle,
//! like its UDF registry, so these calls keep their signatures whatever runs the plan: every
//! dataset starts with a [`LocalExecutor`], which runs plans in this process with the node's
//! kernels and refuses all-to-all operators (sort, groupby, joins, …) with an error naming
//! them; the cluster client will provide an executor that submits plans to a cluster, and
//! [`Dataset::with_executor`] switches. The rows come back in the plan's order (files in path
//! order, then rows in file order), every block with exactly [`Dataset::schema`].
//!
//! ```
//! use floe_client::{Dataset, col, lit};
//!
//! # fn main() -> Result<(), floe_client::Error> {
//! let odd = Dataset::range(100)?.filter((col("id") % lit(2i64)).eq(lit(1i64)))?;
//! assert_eq!(odd.count()?, 50);
//! assert_eq!(odd.take(3)?.iter().map(|b| b.num_rows()).sum::<usize>(), 3);
//! # Ok(())
//! # }
//! ```

use std::path::Path;
use std::sync::Arc;

use arrow::datatypes::Schema;
use arrow::record_batch::RecordBatch;
use floe_core::Fingerprint;
use floe_core::plan::optimizer::Optimizer;
use floe_core::plan::physical::PhysicalPlan;
use floe_core::plan::{
    DEFAULT_TARGET_FILE_SIZE, FileScan, LogicalPlan, PlanError, UdfKind, WriteSpec,
};
use floe_engine::blocks::BlockSizing;
use floe_engine::task::TaskContext;
pub use floe_engine::udf::Registry;

pub use floe_engine::local::LocalOutput;

mod cluster;
pub mod jobspec;
pub mod local;
mod stream;
pub use cluster::{
    BlockReader, Client, ClusterExecutor, ClusterInfo, JobHandle, JobInfo, JobOutput, JobState,
    LocalCluster, LocalClusterDir, LocalClusterOptions, NodeInfo, ReplicaInfo, WaitEvent,
    WaitOptions, find_floe_binary,
};
pub use floe_core::job::{
    CacheMode, JobOptions, JobProgress, JobStats, OperatorStats, ResultDelivery,
};
pub use stream::{DEFAULT_STREAM_BUFFER_BYTES, ResultStream};

pub use floe_core::expr::{Expr, coalesce, col, hash, lit, null, null_on_error, when};
pub use floe_core::plan::{
    AggFunction, Aggregation, Compression, Concurrency, CsvOptions, FileFormat, JoinType,
    PartitionColumn, PartitionType, ProcessUdf, SortKey, UdfCall, WriteMode,
};
pub use floe_engine::read::Partitioning;

/// Every error building a dataset or running it can return.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pipeline is invalid (unknown column, type mismatch, missing join key, …).
    #[error(transparent)]
    Plan(#[from] Box<PlanError>),
    /// Files could not be found or their schema could not be read.
    #[error(transparent)]
    Source(#[from] floe_engine::Error),
    #[error(
        "cannot reach the cluster at {replicas}: {reason}; check the addresses, that the \
         schedulers run, and the cluster token"
    )]
    Connect { replicas: String, reason: String },
    #[error("the scheduler did not answer: {0}; the cluster may be electing a leader, retry")]
    Scheduler(#[from] floe_api::Error),
    #[error(transparent)]
    Wire(#[from] floe_core::WireError),
    #[error(
        "there is no job {0} in the scheduler's state: it never existed, or it was deleted or \
         moved to the history (`floe jobs --all` lists those)"
    )]
    UnknownJob(floe_core::JobId),
    #[error("job {job} failed: {message}")]
    JobFailed {
        job: floe_core::JobId,
        message: String,
    },
    #[error(
        "gave up waiting for job {job} after {after:?}; it may still run (`floe job {job}` shows it)"
    )]
    WaitTimedOut {
        job: floe_core::JobId,
        after: std::time::Duration,
    },
    #[error(
        "job {job}'s result stream broke off: {reason}; run the job again (cached stages are reused)"
    )]
    StreamInterrupted {
        job: floe_core::JobId,
        reason: String,
    },
    #[error("job {0} was cancelled")]
    JobCancelled(floe_core::JobId),
    #[error("job {job} cannot be cancelled: {reason}")]
    CannotCancel {
        job: floe_core::JobId,
        reason: String,
    },
    #[error(
        "result block {object} on node {node} cannot be read: {reason}; run the job again \
         (cached stages are reused)"
    )]
    BlockLost {
        object: floe_core::ObjectId,
        node: floe_core::NodeId,
        reason: String,
    },
    #[error(
        "job {job}'s result is no longer held: {reason}; run the job again (cached stages are \
         reused)"
    )]
    ResultReleased {
        job: floe_core::JobId,
        reason: String,
    },
    #[error("job {job}: {reason}")]
    Refused {
        job: floe_core::JobId,
        reason: String,
    },
    #[error(
        "the cluster answered something unexpected: {0}; are client and cluster the same release?"
    )]
    Unexpected(String),
    #[error("cannot start the client's runtime: {0}")]
    Runtime(std::io::Error),
    #[error("local cluster: {0}")]
    LocalCluster(String),
    #[error(transparent)]
    LocalProcess(#[from] local::Error),
}

impl From<PlanError> for Error {
    fn from(error: PlanError) -> Self {
        Error::Plan(Box::new(error))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A dataset: a validated, fingerprinted logical plan, the UDF registry it is checked against
/// (the built-ins unless [`Dataset::with_udfs`] says otherwise), and the executor its consuming
/// calls run it on (a [`LocalExecutor`] unless [`Dataset::with_executor`] says otherwise).
#[derive(Clone)]
pub struct Dataset {
    plan: LogicalPlan,
    udfs: Arc<Registry>,
    /// The holds on the materialized results the plan reads (see [`Executor::materialize`]);
    /// declared before the executor so they are let go while its runtime still runs.
    owners: Vec<ResultOwner>,
    executor: Arc<dyn Executor>,
}

/// A hold on rows an executor keeps outside the plan (a cluster job's output): they stay
/// while any clone of it lives.
pub type ResultOwner = Arc<dyn std::any::Any + Send + Sync>;

/// The blocks of a running plan, in order; an error ends the stream.
pub type BatchStream<'a> = Box<dyn Iterator<Item = Result<RecordBatch>> + 'a>;

/// Runs a dataset's plan for its consuming calls ([`Dataset::count`], [`Dataset::take`],
/// [`Dataset::iter_batches`], [`Dataset::materialize`]).
///
/// An implementation receives the logical plan as the user built it, with its random seeds
/// resolved; it optimizes and plans it itself (a cluster does that on its driver). It should
/// produce blocks as the stream is pulled rather than all at once, so that a consumer that
/// stops early (a `take`) stops the work.
pub trait Executor: Send + Sync {
    /// Starts running `plan`, whose UDF calls were checked against `udfs`, and streams its
    /// output blocks.
    fn execute<'a>(&'a self, plan: &LogicalPlan, udfs: &'a Registry) -> Result<BatchStream<'a>>;

    /// Computes `dataset` and returns a source over its rows (see [`Dataset::materialize`]).
    /// By default the rows are collected here and travel inline with the plans built on them;
    /// an executor that can keep them where they were computed returns a source naming them,
    /// with its hold on them ([`Dataset::owned_by`]).
    fn materialize(&self, dataset: &Dataset) -> Result<Dataset> {
        let blocks: Vec<RecordBatch> = dataset.iter_batches()?.collect::<Result<_>>()?;
        let materialized = Dataset::from_batches(dataset.schema(), &blocks)?;
        Ok(dataset.then(materialized.plan))
    }
}

/// Runs plans in this process with the node's kernels ([`floe_engine::local`]): one task at a
/// time, each when its blocks are pulled, so a stream that is dropped or limited leaves later
/// files unread. All-to-all operators need a cluster's shuffle and are refused before any task
/// runs; `cache()` passes its input through (there is no cache store in-process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalExecutor {
    /// The block size range outputs are coalesced and split into.
    pub sizing: BlockSizing,
    /// Rows per batch that readers and `range` produce before sizing.
    pub batch_rows: usize,
}

impl Default for LocalExecutor {
    fn default() -> Self {
        Self {
            sizing: BlockSizing::default(),
            batch_rows: floe_engine::read::DEFAULT_BATCH_ROWS,
        }
    }
}

impl LocalExecutor {
    fn context<'a>(&self, udfs: &'a Registry) -> TaskContext<'a> {
        TaskContext {
            registry: udfs,
            processes: &[],
            sizing: self.sizing,
            batch_rows: self.batch_rows,
        }
    }

    /// Runs `plan` to the end: its output blocks and the files its sinks wrote.
    pub fn run(&self, plan: &LogicalPlan, udfs: &Registry) -> Result<LocalOutput> {
        Ok(floe_engine::local::execute(
            &physical_plan(plan)?,
            &self.context(udfs),
        )?)
    }
}

impl Executor for LocalExecutor {
    fn execute<'a>(&'a self, plan: &LogicalPlan, udfs: &'a Registry) -> Result<BatchStream<'a>> {
        let blocks = floe_engine::local::stream(&physical_plan(plan)?, self.context(udfs))?;
        Ok(Box::new(blocks.map(|block| block.map_err(Error::from))))
    }
}

/// The optimized physical plan of `plan`.
fn physical_plan(plan: &LogicalPlan) -> Result<PhysicalPlan> {
    let optimized = Optimizer::default().optimize(plan)?;
    Ok(PhysicalPlan::from_logical(&optimized))
}

impl std::fmt::Debug for Dataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.plan.display_tree())
    }
}

/// Options of a file sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteOptions {
    /// Files are cut near this many bytes.
    pub target_file_size: u64,
    /// What to do with files already in the directory; by default a directory that holds any
    /// is refused.
    pub mode: WriteMode,
    /// Parquet's codec; `None` is the format's default (zstd for Parquet, and the text formats
    /// are always uncompressed).
    pub compression: Option<Compression>,
    /// Hive partitioning: rows go to `col=value/…` directories by these columns' values (in
    /// this order), and the files hold the other columns. Empty: no directories.
    pub partition_by: Vec<String>,
}

impl Default for WriteOptions {
    fn default() -> Self {
        Self {
            target_file_size: DEFAULT_TARGET_FILE_SIZE,
            mode: WriteMode::Error,
            compression: None,
            partition_by: Vec::new(),
        }
    }
}

/// Options of a file source.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadOptions {
    /// The columns to read; `None` reads all.
    pub columns: Option<Vec<String>>,
    /// How Hive partition directories (`key=value`) below a directory read become columns;
    /// by default they are discovered.
    pub partitioning: Partitioning,
}

impl Dataset {
    fn source(plan: LogicalPlan) -> Self {
        Self {
            plan,
            udfs: Arc::new(Registry::with_builtins()),
            owners: Vec::new(),
            executor: Arc::new(LocalExecutor::default()),
        }
    }

    fn then(&self, plan: LogicalPlan) -> Self {
        Self {
            plan,
            udfs: self.udfs.clone(),
            owners: self.owners.clone(),
            executor: self.executor.clone(),
        }
    }

    /// [`Dataset::then`] for a plan that reads `other` too: it holds what both read.
    fn then_with(&self, other: &Dataset, plan: LogicalPlan) -> Self {
        let mut next = self.then(plan);
        next.owners.extend(other.owners.iter().cloned());
        next
    }

    /// This dataset with `plan` as its plan, holding `owner` besides what it held: how an
    /// [`Executor::materialize`] hands back a source over rows it keeps elsewhere. Dropping
    /// the last dataset built from it lets `owner` go.
    pub fn owned_by(&self, plan: LogicalPlan, owner: ResultOwner) -> Self {
        let mut next = self.then(plan);
        next.owners.push(owner);
        next
    }

    /// Reads files of `format`: each path may be a file, a directory (all files below it)
    /// or a glob in its last component (`data/*.parquet`). `columns` limits the columns read.
    pub fn read<P: AsRef<Path>>(
        format: FileFormat,
        paths: &[P],
        columns: Option<&[&str]>,
    ) -> Result<Self> {
        let options = ReadOptions {
            columns: columns.map(|c| c.iter().map(|s| (*s).to_owned()).collect()),
            ..ReadOptions::default()
        };
        Self::read_with(format, paths, &options)
    }

    /// [`Dataset::read`] with every option: the columns, and how Hive partition directories
    /// below a directory (`date=2026-11-30/…`) become columns. A filter on partition columns
    /// drops whole directories before any of their files is opened.
    pub fn read_with<P: AsRef<Path>>(
        format: FileFormat,
        paths: &[P],
        options: &ReadOptions,
    ) -> Result<Self> {
        let discovery = floe_engine::read::DiscoverOptions {
            partitioning: options.partitioning.clone(),
        };
        let scan = floe_engine::read::discover_with(format, paths, &discovery)?;
        let scan = FileScan {
            projection: options.columns.clone(),
            ..scan
        };
        Ok(Self::source(LogicalPlan::read(scan)?))
    }

    pub fn read_parquet<P: AsRef<Path>>(paths: &[P]) -> Result<Self> {
        Self::read(FileFormat::Parquet, paths, None)
    }

    /// CSV with a header row and commas; see [`Dataset::read`] for other options.
    pub fn read_csv<P: AsRef<Path>>(paths: &[P]) -> Result<Self> {
        Self::read(FileFormat::Csv(CsvOptions::default()), paths, None)
    }

    /// Newline-delimited JSON.
    pub fn read_json<P: AsRef<Path>>(paths: &[P]) -> Result<Self> {
        Self::read(FileFormat::Json, paths, None)
    }

    /// UTF-8 text files, one row per line (without its `\n` or `\r\n`) in a column `text`;
    /// `*.gz` and `*.zst` files are decompressed.
    pub fn read_text<P: AsRef<Path>>(paths: &[P]) -> Result<Self> {
        Self::read(FileFormat::Text, paths, None)
    }

    /// Whole files, one row each: `path` (as the plan names the file: absolute, or its URL)
    /// and `bytes`.
    pub fn read_binary_files<P: AsRef<Path>>(paths: &[P]) -> Result<Self> {
        Self::read(FileFormat::Binary, paths, None)
    }

    /// The integers `0..n` in an `Int64` column `id`.
    pub fn range(n: u64) -> Result<Self> {
        Ok(Self::source(LogicalPlan::range(n)?))
    }

    /// Rows held by the client, sent inline with the plan (keep them small).
    pub fn from_batches(schema: &Schema, batches: &[RecordBatch]) -> Result<Self> {
        let ipc = floe_engine::task::encode_ipc(schema, batches)?;
        let rows = batches.iter().map(|b| b.num_rows() as u64).sum();
        let schema = Schema::new(schema.fields().clone());
        Ok(Self::source(LogicalPlan::from_ipc(schema, ipc, rows)?))
    }

    /// Checks UDF calls against `udfs` (your registry with your own UDFs) from here on.
    pub fn with_udfs(mut self, udfs: Arc<Registry>) -> Self {
        self.udfs = udfs;
        self
    }

    /// Runs this dataset's consuming calls, and those of the datasets built from it, on
    /// `executor`. It does not change the plan or its fingerprint.
    pub fn with_executor(mut self, executor: Arc<dyn Executor>) -> Self {
        self.executor = executor;
        self
    }

    pub fn with_column(&self, name: &str, expr: Expr) -> Result<Self> {
        Ok(self.then(self.plan.with_column(name, expr)?))
    }

    pub fn select(&self, columns: &[&str]) -> Result<Self> {
        Ok(self.then(self.plan.select(columns)?))
    }

    pub fn drop(&self, columns: &[&str]) -> Result<Self> {
        Ok(self.then(self.plan.drop_columns(columns)?))
    }

    /// Renames columns: `(from, to)` pairs.
    pub fn rename(&self, pairs: &[(&str, &str)]) -> Result<Self> {
        Ok(self.then(self.plan.rename(pairs)?))
    }

    pub fn filter(&self, predicate: Expr) -> Result<Self> {
        Ok(self.then(self.plan.filter(predicate)?))
    }

    /// Applies a registered UDF that keeps one row per row.
    pub fn map_batches(&self, call: UdfCall) -> Result<Self> {
        self.udf(call, UdfKind::RowPreserving, None)
    }

    /// [`Dataset::map_batches`] with the rows per call (performance only: not hashed).
    pub fn map_batches_sized(&self, call: UdfCall, batch_size: u64) -> Result<Self> {
        self.udf(call, UdfKind::RowPreserving, Some(batch_size))
    }

    /// Applies a registered UDF that may change the row count.
    pub fn flat_map(&self, call: UdfCall) -> Result<Self> {
        self.udf(call, UdfKind::RowChanging, None)
    }

    /// Runs a process UDF over every batch: a long-lived child process per node (a Python
    /// script using `floe_udf`, see `docs/PROCESS_UDFS.md`) that may keep state between
    /// batches. Runs on a cluster only.
    pub fn map_batches_process(&self, udf: ProcessUdf) -> Result<Self> {
        Ok(self.then(self.plan.process_udf(udf)?))
    }

    fn udf(&self, call: UdfCall, kind: UdfKind, batch_size: Option<u64>) -> Result<Self> {
        Ok(self.then(self.plan.udf(call, kind, batch_size, self.udfs.as_ref())?))
    }

    pub fn limit(&self, n: u64) -> Result<Self> {
        Ok(self.then(self.plan.limit(n)?))
    }

    /// Sorts by keys ([`SortKey::asc`], [`SortKey::desc`], with nulls first or last).
    pub fn sort(&self, keys: Vec<SortKey>) -> Result<Self> {
        Ok(self.then(self.plan.sort(keys)?))
    }

    /// Groups by `keys`; finish with [`Grouped::agg`].
    pub fn groupby(&self, keys: &[&str]) -> Grouped {
        Grouped {
            dataset: self.clone(),
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        }
    }

    /// `n` partitions of about equal size.
    pub fn repartition(&self, n: u32) -> Result<Self> {
        Ok(self.then(self.plan.repartition(n, &[])?))
    }

    /// `n` partitions, rows with equal `keys` in the same one.
    pub fn repartition_by(&self, n: u32, keys: &[&str]) -> Result<Self> {
        Ok(self.then(self.plan.repartition(n, keys)?))
    }

    /// Shuffles rows; without a seed one is drawn when the job is submitted.
    pub fn random_shuffle(&self, seed: Option<u64>) -> Result<Self> {
        Ok(self.then(self.plan.random_shuffle(seed)?))
    }

    /// Joins on columns with the same names on both sides.
    pub fn join(&self, other: &Dataset, on: &[&str], how: JoinType) -> Result<Self> {
        self.join_on(other, on, on, how)
    }

    /// Joins on `left_keys[i] == right_keys[i]`.
    pub fn join_on(
        &self,
        other: &Dataset,
        left_keys: &[&str],
        right_keys: &[&str],
        how: JoinType,
    ) -> Result<Self> {
        let plan = self.plan.join(&other.plan, left_keys, right_keys, how)?;
        Ok(self.then_with(other, plan))
    }

    pub fn union(&self, other: &Dataset) -> Result<Self> {
        Ok(self.then_with(other, self.plan.union(&other.plan)?))
    }

    /// Distinct rows of `columns` (all columns when empty).
    pub fn unique(&self, columns: &[&str]) -> Result<Self> {
        Ok(self.then(self.plan.unique(columns)?))
    }

    /// Keeps this dataset in the cluster's cache when it is computed.
    pub fn cache(&self) -> Result<Self> {
        Ok(self.then(self.plan.cache()?))
    }

    pub fn write_parquet(
        &self,
        directory: impl AsRef<Path>,
        options: WriteOptions,
    ) -> Result<Self> {
        self.write(FileFormat::Parquet, directory, options)
    }

    pub fn write_csv(&self, directory: impl AsRef<Path>, options: WriteOptions) -> Result<Self> {
        self.write(FileFormat::Csv(CsvOptions::default()), directory, options)
    }

    /// Newline-delimited JSON.
    pub fn write_json(&self, directory: impl AsRef<Path>, options: WriteOptions) -> Result<Self> {
        self.write(FileFormat::Json, directory, options)
    }

    /// Writes files of `format` into `directory` (created if missing). A relative directory
    /// is resolved against this process's working directory now, never a node's. Under
    /// [`WriteMode::Error`] (the default) a directory that already holds files is refused when
    /// the job is submitted ([`Dataset::check_sinks`]) and again before the output is
    /// published.
    pub fn write(
        &self,
        format: FileFormat,
        directory: impl AsRef<Path>,
        options: WriteOptions,
    ) -> Result<Self> {
        let directory = if floe_core::location::is_remote(directory.as_ref()) {
            directory.as_ref().to_owned()
        } else {
            std::path::absolute(directory.as_ref()).map_err(|source| floe_engine::Error::Io {
                path: directory.as_ref().to_owned(),
                source,
            })?
        };
        let compression = options
            .compression
            .unwrap_or_else(|| Compression::default_for(&format));
        Ok(self.then(self.plan.write(WriteSpec {
            format,
            directory,
            target_file_size: options.target_file_size,
            mode: options.mode,
            compression,
            partition_by: options.partition_by,
        })?))
    }

    /// Refuses the plan if a sink in [`WriteMode::Error`] would write into a directory that
    /// already holds files, as far as this process can see it (the job checks again before it
    /// publishes anything). [`Client::submit`] calls it.
    pub fn check_sinks(&self) -> Result<()> {
        check_sinks(&self.plan)
    }

    pub fn schema(&self) -> &Schema {
        self.plan.schema()
    }

    pub fn column_names(&self) -> Vec<&str> {
        self.schema()
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect()
    }

    pub fn fingerprint(&self) -> Fingerprint {
        self.plan.fingerprint()
    }

    pub fn plan(&self) -> &LogicalPlan {
        &self.plan
    }

    /// The logical, optimized and physical plans.
    pub fn explain(&self) -> Result<String> {
        Ok(self.plan.explain()?)
    }

    /// Optimizes the plan and runs it in this process with the node's kernels, whatever the
    /// dataset's executor: the output blocks, and the files any sink wrote. All-to-all
    /// operators (sort, groupby, joins, …) need a cluster's shuffle and are refused here with an
    /// error naming them.
    pub fn execute_locally(&self) -> Result<LocalOutput> {
        LocalExecutor::default().run(&self.plan.resolve_seeds()?, &self.udfs)
    }

    /// Runs the plan on the dataset's executor and streams its output blocks, each with
    /// exactly [`Dataset::schema`]. With the [`LocalExecutor`] a task runs when its blocks are
    /// pulled, one file of a read at a time; dropping the stream stops the work. An error
    /// (a file changed since the plan was built, a failing UDF) is the stream's last item.
    pub fn iter_batches(&self) -> Result<BatchStream<'_>> {
        let schema = Arc::new(self.schema().clone());
        let blocks = self
            .executor
            .execute(&self.plan.resolve_seeds()?, &self.udfs)?;
        // A kernel's fields may differ from the plan's in metadata or nullability; the plan's
        // schema is the contract.
        Ok(Box::new(blocks.map(move |block| {
            let block = block?;
            RecordBatch::try_new(schema.clone(), block.columns().to_vec())
                .map_err(|e| Error::Source(e.into()))
        })))
    }

    /// The number of rows. Runs the whole plan (a sink writes its files and counts 0 rows).
    pub fn count(&self) -> Result<u64> {
        self.iter_batches()?
            .try_fold(0, |rows, block| Ok(rows + block?.num_rows() as u64))
    }

    /// The first `n` rows, in blocks. This runs `limit(n)`, so the optimizer pushes the limit
    /// towards the source (into reads and `range`) and the work stops once `n` rows exist:
    /// later row groups are not decoded and later files are not opened.
    pub fn take(&self, n: u64) -> Result<Vec<RecordBatch>> {
        let limited = self.limit(n)?;
        limited.iter_batches()?.collect()
    }

    /// Computes the dataset and returns a dataset over the computed rows, with this
    /// dataset's UDF registry and executor.
    ///
    /// On a cluster ([`ClusterExecutor`]) the rows stay where the materializing job left
    /// them: the new dataset is a source naming that job's held output blocks (their ids,
    /// holders, schema and row counts, never their rows, so no plan and no replicated log
    /// carries them), read from their holders by every job built on it. The dataset and its
    /// clones own that output: dropping the last of them releases it, and a job submitted
    /// after the output was let go anyway (`jobs.result_ttl`, `floe job delete`) fails with
    /// [`Error::ResultReleased`]. Its fingerprint is the materializing job's output
    /// fingerprint, so cached results computed from it are found again.
    ///
    /// With the [`LocalExecutor`] the result is a new source exactly as if its rows had been
    /// given to [`Dataset::from_batches`]: held in this process, travelling inline with any
    /// plan built on them (keep them small), fingerprinted by their content. Content is what
    /// the rows are: a plan whose output is not a function of its fingerprint (a file
    /// rewritten with the same size and time, a nondeterministic UDF) cannot give the copy a
    /// wrong identity. The cost is that a cached result of `dataset.filter(..)` is not found
    /// for `dataset.materialize().filter(..)`; `cache()` keeps lineage for that.
    pub fn materialize(&self) -> Result<Self> {
        self.executor.materialize(self)
    }
}

/// [`Dataset::check_sinks`] over any plan; a walk with a stack, so any depth is safe.
pub(crate) fn check_sinks(plan: &LogicalPlan) -> Result<()> {
    let mut pending = vec![plan];
    while let Some(node) = pending.pop() {
        if let floe_core::plan::Operator::Write(spec) = node.operator()
            && spec.mode == WriteMode::Error
        {
            floe_engine::write::check_empty(&spec.directory)?;
        }
        pending.extend(node.inputs());
    }
    Ok(())
}

/// A dataset grouped by keys, waiting for its aggregations.
pub struct Grouped {
    dataset: Dataset,
    keys: Vec<String>,
}

impl Grouped {
    /// One output row per group: the keys, then each aggregation.
    pub fn agg(&self, aggregations: Vec<Aggregation>) -> Result<Dataset> {
        let keys: Vec<&str> = self.keys.iter().map(String::as_str).collect();
        Ok(self
            .dataset
            .then(self.dataset.plan.aggregate(&keys, aggregations)?))
    }
}
