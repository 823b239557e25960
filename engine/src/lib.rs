//! floe-engine: everything that turns Arrow blocks into blocks. It runs inside worker
//! processes and, for plans without all-to-all operators, inside the client's process.
//!
//! - [`eval`]: evaluates [`floe_core::expr::Expr`] over a record batch with Arrow's compute
//!   kernels, following the expression module's null-on-unrepresentable rule.
//! - [`read`]: finds files (paths, directories, globs) and their Hive partitions, discovers
//!   their schema, and reads Parquet (projection, row-group pruning by statistics, predicate,
//!   limit), CSV, NDJSON, text and binary files.
//! - [`ops`]: the row-wise operators (`with_column`, `select`, `drop`, `rename`, `filter`,
//!   UDFs) and the streaming limit.
//! - [`udf`]: the registry of named UDFs compiled into this binary, the built-ins, and the
//!   worker's side of process UDFs.
//! - [`write`]: Parquet/CSV/NDJSON sinks (Hive-partitioned with `partition_by`) with
//!   deterministic file names, cut at a target size,
//!   written to temporary files and renamed only when the whole task succeeded.
//! - [`task`]: one task of a stage — its source or input blocks, its fused row-wise
//!   operators, then block sizing — plus `range` batches and the IPC bytes of `from_batches`.
//! - [`local`]: runs a physical plan's non-shuffle stages in this process, stage by stage,
//!   with the same task function.
//! - [`blocks`]: block sizing — splitting oversized outputs, coalescing tiny ones.
//! - [`exchange`]: the all-to-all operators — partitioning, sort, aggregate (with partial
//!   aggregation), join, unique, repartition and random shuffle.
//!
//! - [`remote`]: object storage (`s3://`, `gs://`, `az://`, `http(s)://`) for the readers and
//!   writers: listing, ranged reads, multipart uploads.
//!
//! **Invariant:** no RPC, no shared memory, and no async runtime in a kernel's signature: a
//! kernel is a function from blocks to blocks, so it runs the same in a worker, in a test and
//! in the client. (Object-storage calls run on [`remote`]'s private runtime and the kernel
//! waits for them.)

pub mod blocks;
pub mod eval;
pub mod exchange;
pub mod local;
pub mod ops;
pub mod read;
pub mod remote;
pub mod task;
pub mod udf;
pub mod write;

use std::path::PathBuf;

use arrow::error::ArrowError;
use floe_core::PlanError;
use parquet::errors::ParquetError;

/// Every error a kernel can return.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Arrow(#[from] ArrowError),
    #[error(transparent)]
    Parquet(#[from] ParquetError),
    /// Boxed: plan errors carry types and texts, and kernels' results should stay small.
    #[error(transparent)]
    Plan(Box<PlanError>),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    BadFile { path: PathBuf, message: String },
    /// A value has no answer in strict evaluation (overflow, division by zero, a cast that does
    /// not convert); `expr` is the expression, `message` the value and the `try` alternative.
    #[error("{expr}: {message}")]
    NoAnswer { expr: String, message: String },
    #[error(
        "{directory} already holds files ({example}, …); write with mode \"overwrite\" to \
         replace them or \"append\" to add to them, or choose another directory"
    )]
    OutputExists { directory: PathBuf, example: String },
    #[error("no files match {0}")]
    NoFiles(String),
    /// An object-storage URL that cannot be used (bad syntax, unsupported scheme).
    #[error("{url}: {message}")]
    Remote { url: String, message: String },
    /// An object-storage request failed. Boxed: the store's errors are large.
    #[error("{url}: {source}")]
    RemoteStore {
        url: String,
        source: Box<object_store::Error>,
    },
    #[error("UDF {name}: {message}")]
    Udf { name: String, message: String },
    #[error("an exchange task is missing {missing}")]
    ExchangeInput { missing: &'static str },
    #[error("a {stage} stage cannot run on {input}")]
    StageInput { stage: String, input: String },
    #[error("a {stage} task on {input} cannot take its rows from a fused {fused} stage: {reason}")]
    FusedSource {
        stage: String,
        input: String,
        fused: String,
        reason: &'static str,
    },
    #[error("a {stage} task on {input} makes no output rows to write to a sink")]
    SinkWithoutRows { stage: String, input: String },
    #[error("a scan of {0} files has more than a stage can number ({max})", max = u32::MAX)]
    TooManyFiles(usize),
    #[error("range bound {0} does not fit in Int64")]
    RangeOverflow(u64),
    #[error("{operator} is not a row-wise operator; the shuffle executor runs it")]
    NotRowWise { operator: &'static str },
    #[error(
        "job {job}'s materialized result lives in its cluster's object stores; run plans that \
         read it on that cluster"
    )]
    MaterializedElsewhere { job: floe_core::JobId },
    /// A process UDF's child failed, hung or could not start; running the task again may work.
    #[error("process UDF `{udf}`: {message}")]
    ProcessUdf { udf: String, message: String },
    /// The node will not run this process UDF (command not allowed, script changed).
    #[error("process UDF `{udf}`: {message}")]
    ProcessUdfRefused { udf: String, message: String },
    /// The child broke the `floe_udf/1` protocol (it is not a floe_udf script, or it sent
    /// something that is not Arrow IPC).
    #[error("process UDF `{udf}`: {message}")]
    ProcessUdfProtocol { udf: String, message: String },
    #[error("process UDF `{udf}` returned {got}, but its output schema is {expected}")]
    ProcessUdfOutput {
        udf: String,
        expected: String,
        got: String,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<PlanError> for Error {
    fn from(error: PlanError) -> Self {
        Error::Plan(Box::new(error))
    }
}

impl Error {
    /// Whether running the task again may succeed: a process UDF's child can crash, hang or
    /// fail on something outside floe. Every other kernel error repeats.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::ProcessUdf { .. })
    }

    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
    }
}
