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
//! Submitting a dataset to a cluster (`Client::submit`) and the consuming calls that need one
//! (`count`, `take`, `iter_batches`, `materialize`) belong to the client-submission work; this
//! crate builds, validates, fingerprints and explains plans, and
//! [`Dataset::execute_locally`] runs plans without all-to-all operators in-process.

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
use floe_node::blocks::BlockSizing;
use floe_node::task::TaskContext;
use floe_node::udf::Registry;

pub use floe_node::local::LocalOutput;

pub use floe_core::expr::{Expr, coalesce, col, hash, lit, null, when};
pub use floe_core::plan::{
    AggFunction, Aggregation, CsvOptions, FileFormat, JoinType, SortKey, UdfCall,
};

/// Every error building a dataset can return.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pipeline is invalid (unknown column, type mismatch, missing join key, …).
    #[error(transparent)]
    Plan(#[from] Box<PlanError>),
    /// Files could not be found or their schema could not be read.
    #[error(transparent)]
    Source(#[from] floe_node::Error),
}

impl From<PlanError> for Error {
    fn from(error: PlanError) -> Self {
        Error::Plan(Box::new(error))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A dataset: a validated, fingerprinted logical plan and the UDF registry it is checked
/// against (the built-ins unless [`Dataset::with_udfs`] says otherwise).
#[derive(Clone)]
pub struct Dataset {
    plan: LogicalPlan,
    udfs: Arc<Registry>,
}

impl std::fmt::Debug for Dataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.plan.display_tree())
    }
}

/// Options of a file sink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOptions {
    /// Files are cut near this many bytes.
    pub target_file_size: u64,
}

impl Default for WriteOptions {
    fn default() -> Self {
        Self {
            target_file_size: DEFAULT_TARGET_FILE_SIZE,
        }
    }
}

impl Dataset {
    fn source(plan: LogicalPlan) -> Self {
        Self {
            plan,
            udfs: Arc::new(Registry::with_builtins()),
        }
    }

    fn then(&self, plan: LogicalPlan) -> Self {
        Self {
            plan,
            udfs: self.udfs.clone(),
        }
    }

    /// Reads files of `format`: each path may be a file, a directory (all files below it)
    /// or a glob in its last component (`data/*.parquet`). `columns` limits the columns read.
    pub fn read<P: AsRef<Path>>(
        format: FileFormat,
        paths: &[P],
        columns: Option<&[&str]>,
    ) -> Result<Self> {
        let scan = floe_node::read::discover(format, paths)?;
        let scan = FileScan {
            projection: columns.map(|c| c.iter().map(|s| (*s).to_owned()).collect()),
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

    /// The integers `0..n` in an `Int64` column `id`.
    pub fn range(n: u64) -> Result<Self> {
        Ok(Self::source(LogicalPlan::range(n)?))
    }

    /// Rows held by the client, sent inline with the plan (keep them small).
    pub fn from_batches(schema: &Schema, batches: &[RecordBatch]) -> Result<Self> {
        let ipc = floe_node::task::encode_ipc(schema, batches)?;
        let rows = batches.iter().map(|b| b.num_rows() as u64).sum();
        let schema = Schema::new(schema.fields().clone());
        Ok(Self::source(LogicalPlan::from_ipc(schema, ipc, rows)?))
    }

    /// Checks UDF calls against `udfs` (your registry with your own UDFs) from here on.
    pub fn with_udfs(mut self, udfs: Arc<Registry>) -> Self {
        self.udfs = udfs;
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
        Ok(self.then(self.plan.join(&other.plan, left_keys, right_keys, how)?))
    }

    pub fn union(&self, other: &Dataset) -> Result<Self> {
        Ok(self.then(self.plan.union(&other.plan)?))
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

    /// Writes files of `format` into `directory` (created if missing).
    pub fn write(
        &self,
        format: FileFormat,
        directory: impl AsRef<Path>,
        options: WriteOptions,
    ) -> Result<Self> {
        Ok(self.then(self.plan.write(WriteSpec {
            format,
            directory: directory.as_ref().to_owned(),
            target_file_size: options.target_file_size,
        })?))
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

    /// Optimizes the plan and runs it in this process with the node's kernels: the output
    /// blocks, and the files any sink wrote. All-to-all operators (sort, groupby, joins, …)
    /// need a cluster's shuffle and are refused here with an error naming them.
    pub fn execute_locally(&self) -> Result<LocalOutput> {
        let plan = self.plan.resolve_seeds()?;
        let optimized = Optimizer::default().optimize(&plan)?;
        let physical = PhysicalPlan::from_logical(&optimized);
        let context = TaskContext {
            registry: self.udfs.as_ref(),
            sizing: BlockSizing::default(),
            batch_rows: floe_node::read::DEFAULT_BATCH_ROWS,
        };
        Ok(floe_node::local::execute(&physical, &context)?)
    }
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
