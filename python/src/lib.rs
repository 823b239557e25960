//! floe's Python bindings: the native module `floe._floe` of the `floe` package.
//!
//! Plans are built, validated and fingerprinted by [`floe_client::Dataset`]: the Python layer
//! (`python/floe/`) only names things as Ray Data does and calls these classes. Results cross
//! to pyarrow through the Arrow C stream interface, block by block, without a copy; Arrow data
//! given to `from_arrow` crosses the same way in the other direction.

use std::sync::{Arc, Mutex};

use arrow::datatypes::{Schema, SchemaRef};
use arrow::error::ArrowError;
use arrow::ffi::FFI_ArrowSchema;
use arrow::ffi_stream::{FFI_ArrowArrayStream, RecordBatchStreamReader};
use arrow::record_batch::{RecordBatch, RecordBatchReader};
use floe_client::{
    AggFunction, Aggregation, BlockReader, CacheMode, Client, Concurrency, Dataset, Expr,
    FileFormat, JobHandle, JobOptions, JobOutput, JoinType, LocalCluster, LocalClusterOptions,
    PartitionColumn, PartitionType, Partitioning, ProcessUdf, ReadOptions, ResultStream, SortKey,
    WriteMode, WriteOptions,
};
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pyclass::CompareOp;
use pyo3::types::{PyBool, PyFloat, PyInt, PyString};

pyo3::create_exception!(
    _floe,
    FloeError,
    PyException,
    "An error from floe: building a plan, reaching the cluster or running a job."
);
pyo3::create_exception!(
    _floe,
    PlanError,
    FloeError,
    "The pipeline is invalid: an unknown column, a type mismatch, a bad argument."
);
pyo3::create_exception!(
    _floe,
    JobError,
    FloeError,
    "A job failed; a Python function's failure carries its traceback in the message."
);

/// The Python exception for a client error, with the message the CLI prints.
fn raise(error: floe_client::Error) -> PyErr {
    let message = error.to_string();
    match error {
        floe_client::Error::Plan(_) => PlanError::new_err(message),
        floe_client::Error::JobFailed { .. } | floe_client::Error::JobCancelled(_) => {
            JobError::new_err(message)
        }
        _ => FloeError::new_err(message),
    }
}

fn arrow_error(error: ArrowError) -> PyErr {
    FloeError::new_err(error.to_string())
}

/// An expression over a dataset's columns; Python's operators build it.
#[pyclass(module = "floe._floe", name = "Expr", frozen)]
#[derive(Clone)]
struct PyExpr(Expr);

/// An expression, a column reference's operand or a Python literal as an expression.
fn expr_of(value: &Bound<'_, PyAny>) -> PyResult<Expr> {
    if let Ok(expr) = value.downcast::<PyExpr>() {
        return Ok(expr.get().0.clone());
    }
    if value.is_none() {
        return Ok(floe_client::null());
    }
    if let Ok(flag) = value.downcast::<PyBool>() {
        return Ok(floe_client::lit(flag.is_true()));
    }
    if value.is_instance_of::<PyInt>() {
        return Ok(floe_client::lit(value.extract::<i64>()?));
    }
    if value.is_instance_of::<PyFloat>() {
        return Ok(floe_client::lit(value.extract::<f64>()?));
    }
    if let Ok(text) = value.downcast::<PyString>() {
        return Ok(floe_client::lit(text.to_str()?));
    }
    Err(PyTypeError::new_err(format!(
        "cannot use a {} in an expression: use floe.col(name), or a bool, int, float, str or None",
        value.get_type().name()?
    )))
}

#[pymethods]
impl PyExpr {
    fn __add__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(self.0.clone() + expr_of(other)?))
    }
    fn __radd__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(expr_of(other)? + self.0.clone()))
    }
    fn __sub__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(self.0.clone() - expr_of(other)?))
    }
    fn __rsub__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(expr_of(other)? - self.0.clone()))
    }
    fn __mul__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(self.0.clone() * expr_of(other)?))
    }
    fn __rmul__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(expr_of(other)? * self.0.clone()))
    }
    fn __truediv__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(self.0.clone() / expr_of(other)?))
    }
    fn __rtruediv__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(expr_of(other)? / self.0.clone()))
    }
    fn __mod__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(self.0.clone() % expr_of(other)?))
    }
    fn __rmod__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(expr_of(other)? % self.0.clone()))
    }
    fn __neg__(&self) -> Self {
        Self(-self.0.clone())
    }
    fn __invert__(&self) -> Self {
        Self(!self.0.clone())
    }
    fn __and__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(self.0.clone().and(expr_of(other)?)))
    }
    fn __rand__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(expr_of(other)?.and(self.0.clone())))
    }
    fn __or__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(self.0.clone().or(expr_of(other)?)))
    }
    fn __ror__(&self, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self(expr_of(other)?.or(self.0.clone())))
    }
    fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> PyResult<Self> {
        let left = self.0.clone();
        let right = expr_of(other)?;
        Ok(Self(match op {
            CompareOp::Lt => left.lt(right),
            CompareOp::Le => left.lt_eq(right),
            CompareOp::Eq => left.eq(right),
            CompareOp::Ne => left.not_eq(right),
            CompareOp::Gt => left.gt(right),
            CompareOp::Ge => left.gt_eq(right),
        }))
    }
    /// `and`, `or`, `not` and `if` would ask an expression for a truth value it does not have.
    fn __bool__(&self) -> PyResult<bool> {
        Err(PyTypeError::new_err(
            "a floe expression has no truth value: combine conditions with &, | and ~ (not \
             and/or/not), and parenthesize comparisons",
        ))
    }
    fn is_null(&self) -> Self {
        Self(self.0.clone().is_null())
    }
    fn is_not_null(&self) -> Self {
        Self(self.0.clone().is_not_null())
    }
    fn contains(&self, pattern: String) -> Self {
        Self(self.0.clone().contains(pattern))
    }
    fn starts_with(&self, prefix: String) -> Self {
        Self(self.0.clone().starts_with(prefix))
    }
    fn lower(&self) -> Self {
        Self(self.0.clone().lower())
    }
    fn upper(&self) -> Self {
        Self(self.0.clone().upper())
    }
    fn length(&self) -> Self {
        Self(self.0.clone().length())
    }
    fn __repr__(&self) -> String {
        self.0.to_string()
    }
}

#[pyfunction]
fn col(name: String) -> PyExpr {
    PyExpr(floe_client::col(name))
}

#[pyfunction]
fn lit(value: &Bound<'_, PyAny>) -> PyResult<PyExpr> {
    Ok(PyExpr(expr_of(value)?))
}

/// Hands a Rust stream of batches to pyarrow as a `pyarrow.RecordBatchReader`: the C stream
/// moves into pyarrow, and each batch's buffers are shared, not copied.
fn export_reader(
    py: Python<'_>,
    reader: Box<dyn RecordBatchReader + Send>,
) -> PyResult<Bound<'_, PyAny>> {
    let mut stream = Box::new(FFI_ArrowArrayStream::new(reader));
    let address = std::ptr::addr_of_mut!(*stream) as usize;
    // pyarrow moves the stream out (its release becomes null), so dropping the box after it
    // frees only the struct's memory.
    py.import("pyarrow")?
        .getattr("RecordBatchReader")?
        .call_method1("_import_from_c", (address,))
}

fn export_schema<'py>(py: Python<'py>, schema: &Schema) -> PyResult<Bound<'py, PyAny>> {
    let mut ffi = Box::new(FFI_ArrowSchema::try_from(schema).map_err(arrow_error)?);
    let address = std::ptr::addr_of_mut!(*ffi) as usize;
    py.import("pyarrow")?
        .getattr("Schema")?
        .call_method1("_import_from_c", (address,))
}

fn import_schema(schema: &Bound<'_, PyAny>) -> PyResult<Schema> {
    let mut ffi = Box::new(FFI_ArrowSchema::empty());
    let address = std::ptr::addr_of_mut!(*ffi) as usize;
    schema.call_method1("_export_to_c", (address,))?;
    Schema::try_from(ffi.as_ref()).map_err(arrow_error)
}

/// A dataset: a validated, fingerprinted plan ([`floe_client::Dataset`]).
#[pyclass(module = "floe._floe", name = "Dataset", frozen)]
struct PyDataset(Dataset);

fn strs(items: &[String]) -> Vec<&str> {
    items.iter().map(String::as_str).collect()
}

fn file_format(name: &str) -> PyResult<FileFormat> {
    match name {
        "parquet" => Ok(FileFormat::Parquet),
        "csv" => Ok(FileFormat::Csv(floe_client::CsvOptions::default())),
        "json" => Ok(FileFormat::Json),
        "text" => Ok(FileFormat::Text),
        "binary" => Ok(FileFormat::Binary),
        other => Err(PyValueError::new_err(format!(
            "unknown file format {other:?}: parquet, csv, json, text or binary"
        ))),
    }
}

fn named<T: Copy>(
    what: &str,
    value: &str,
    all: &[T],
    name: impl Fn(T) -> &'static str,
) -> PyResult<T> {
    all.iter()
        .copied()
        .find(|item| name(*item) == value)
        .ok_or_else(|| {
            let names: Vec<&str> = all.iter().map(|item| name(*item)).collect();
            PyValueError::new_err(format!(
                "unknown {what} {value:?}: one of {}",
                names.join(", ")
            ))
        })
}

#[pymethods]
impl PyDataset {
    /// `partitioning`: `"hive"` (discover `key=value` directories), `"none"`, or a list of
    /// `(column, type)` pairs, the type `"int64"` or `"string"`.
    #[staticmethod]
    #[pyo3(signature = (format, paths, columns=None, partitioning=None))]
    fn read(
        format: &str,
        paths: Vec<String>,
        columns: Option<Vec<String>>,
        partitioning: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let partitioning = match partitioning {
            None => Partitioning::Hive,
            Some(given) => match given.extract::<String>() {
                Ok(text) if text == "hive" => Partitioning::Hive,
                Ok(text) if text == "none" => Partitioning::Ignore,
                Ok(text) => {
                    return Err(PyValueError::new_err(format!(
                        "unknown partitioning {text:?}: \"hive\", \"none\" or (column, type) pairs"
                    )));
                }
                Err(_) => Partitioning::Declared(
                    given
                        .extract::<Vec<(String, String)>>()?
                        .into_iter()
                        .map(|(name, data_type)| {
                            let data_type = named(
                                "partition type",
                                &data_type,
                                &PartitionType::ALL,
                                PartitionType::name,
                            )?;
                            Ok(PartitionColumn::new(name, data_type))
                        })
                        .collect::<PyResult<Vec<_>>>()?,
                ),
            },
        };
        let options = ReadOptions {
            columns,
            partitioning,
        };
        Dataset::read_with(file_format(format)?, &paths, &options)
            .map(Self)
            .map_err(raise)
    }

    #[staticmethod]
    fn range(n: u64) -> PyResult<Self> {
        Dataset::range(n).map(Self).map_err(raise)
    }

    /// The rows of a `pyarrow.RecordBatchReader`, sent inline with the plan.
    #[staticmethod]
    fn from_reader(reader: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut stream = Box::new(FFI_ArrowArrayStream::empty());
        let address = std::ptr::addr_of_mut!(*stream) as usize;
        reader.call_method1("_export_to_c", (address,))?;
        let reader = RecordBatchStreamReader::try_new(*stream).map_err(arrow_error)?;
        let schema = reader.schema();
        let batches = reader
            .collect::<Result<Vec<RecordBatch>, ArrowError>>()
            .map_err(arrow_error)?;
        Dataset::from_batches(&schema, &batches)
            .map(Self)
            .map_err(raise)
    }

    fn filter(&self, predicate: &PyExpr) -> PyResult<Self> {
        self.0.filter(predicate.0.clone()).map(Self).map_err(raise)
    }

    fn with_column(&self, name: &str, expr: &Bound<'_, PyAny>) -> PyResult<Self> {
        self.0
            .with_column(name, expr_of(expr)?)
            .map(Self)
            .map_err(raise)
    }

    fn select_columns(&self, columns: Vec<String>) -> PyResult<Self> {
        self.0.select(&strs(&columns)).map(Self).map_err(raise)
    }

    fn drop_columns(&self, columns: Vec<String>) -> PyResult<Self> {
        self.0.drop(&strs(&columns)).map(Self).map_err(raise)
    }

    fn rename_columns(&self, pairs: Vec<(String, String)>) -> PyResult<Self> {
        let pairs: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(from, to)| (from.as_str(), to.as_str()))
            .collect();
        self.0.rename(&pairs).map(Self).map_err(raise)
    }

    /// A process UDF whose code is inline (a serialized Python function), fingerprinted by
    /// `code_identity`.
    #[pyo3(signature = (command, args, code_identity, concurrency, batch_size=None, output_schema=None))]
    fn map_inline_process(
        &self,
        command: String,
        args: Vec<String>,
        code_identity: String,
        concurrency: (u32, u32),
        batch_size: Option<u64>,
        output_schema: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut udf = ProcessUdf::new(command, &strs(&args))
            .concurrency(Concurrency::new(concurrency.0, concurrency.1))
            .code_identity(code_identity);
        if let Some(rows) = batch_size {
            udf = udf.batch_size(rows);
        }
        if let Some(schema) = output_schema {
            udf = udf.output_schema(import_schema(schema)?);
        }
        self.0.map_batches_process(udf).map(Self).map_err(raise)
    }

    /// `aggregations` are `(function, column or None, alias or None)`.
    fn aggregate(
        &self,
        keys: Vec<String>,
        aggregations: Vec<(String, Option<String>, Option<String>)>,
    ) -> PyResult<Self> {
        let mut built = Vec::new();
        for (function, column, alias) in aggregations {
            let function = named(
                "aggregation",
                &function,
                &AggFunction::ALL,
                AggFunction::name,
            )?;
            let aggregation = match column {
                Some(column) => Aggregation::of(function, column),
                None if function == AggFunction::Count => Aggregation::count_rows("count"),
                None => {
                    return Err(PyValueError::new_err(format!(
                        "{} needs a column",
                        function.name()
                    )));
                }
            };
            built.push(match alias {
                Some(alias) => aggregation.alias(alias),
                None => aggregation,
            });
        }
        self.0
            .groupby(&strs(&keys))
            .agg(built)
            .map(Self)
            .map_err(raise)
    }

    /// `keys` are `(column, descending)`.
    fn sort(&self, keys: Vec<(String, bool)>) -> PyResult<Self> {
        let keys = keys
            .into_iter()
            .map(|(column, descending)| {
                if descending {
                    SortKey::desc(column)
                } else {
                    SortKey::asc(column)
                }
            })
            .collect();
        self.0.sort(keys).map(Self).map_err(raise)
    }

    #[pyo3(signature = (seed=None))]
    fn random_shuffle(&self, seed: Option<u64>) -> PyResult<Self> {
        self.0.random_shuffle(seed).map(Self).map_err(raise)
    }

    fn repartition(&self, n: u32, keys: Vec<String>) -> PyResult<Self> {
        self.0
            .repartition_by(n, &strs(&keys))
            .map(Self)
            .map_err(raise)
    }

    fn join(
        &self,
        other: &PyDataset,
        left_keys: Vec<String>,
        right_keys: Vec<String>,
        how: &str,
    ) -> PyResult<Self> {
        let how = named("join type", how, &JoinType::ALL, JoinType::name)?;
        self.0
            .join_on(&other.0, &strs(&left_keys), &strs(&right_keys), how)
            .map(Self)
            .map_err(raise)
    }

    fn union(&self, other: &PyDataset) -> PyResult<Self> {
        self.0.union(&other.0).map(Self).map_err(raise)
    }

    fn unique(&self, columns: Vec<String>) -> PyResult<Self> {
        self.0.unique(&strs(&columns)).map(Self).map_err(raise)
    }

    fn limit(&self, n: u64) -> PyResult<Self> {
        self.0.limit(n).map(Self).map_err(raise)
    }

    fn cache(&self) -> PyResult<Self> {
        self.0.cache().map(Self).map_err(raise)
    }

    #[pyo3(signature = (format, path, mode, partition_by=None))]
    fn write(
        &self,
        format: &str,
        path: String,
        mode: &str,
        partition_by: Option<Vec<String>>,
    ) -> PyResult<Self> {
        let options = WriteOptions {
            mode: named("write mode", mode, &WriteMode::ALL, WriteMode::name)?,
            partition_by: partition_by.unwrap_or_default(),
            ..WriteOptions::default()
        };
        self.0
            .write(file_format(format)?, path, options)
            .map(Self)
            .map_err(raise)
    }

    fn schema<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        export_schema(py, self.0.schema())
    }

    fn fingerprint(&self) -> String {
        self.0.fingerprint().to_string()
    }

    fn explain(&self) -> PyResult<String> {
        self.0.explain().map_err(raise)
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.0)
    }
}

/// A connection to a cluster, and the local cluster it started, if any.
#[pyclass(module = "floe._floe", name = "Session", frozen)]
struct PySession {
    runtime: Arc<tokio::runtime::Runtime>,
    client: Client,
    addresses: Vec<String>,
    /// The cluster `floe.init()` started; taken (and so stopped) by `shutdown`.
    local: Mutex<Option<LocalCluster>>,
    dashboard_url: Option<String>,
}

fn runtime() -> PyResult<Arc<tokio::runtime::Runtime>> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map(Arc::new)
        .map_err(|error| raise(floe_client::Error::Runtime(error)))
}

#[pymethods]
impl PySession {
    #[staticmethod]
    fn connect(py: Python<'_>, addresses: Vec<String>, token: String) -> PyResult<Self> {
        let runtime = runtime()?;
        let client = py
            .allow_threads(|| runtime.block_on(Client::connect(&addresses, &token)))
            .map_err(raise)?;
        Ok(Self {
            runtime,
            client,
            addresses,
            local: Mutex::new(None),
            dashboard_url: None,
        })
    }

    /// Starts a scheduler and `nodes` nodes of `binary` on loopback with `node_settings`.
    #[staticmethod]
    fn start_local(
        py: Python<'_>,
        binary: String,
        nodes: usize,
        workers_per_node: u32,
        node_settings: Vec<String>,
    ) -> PyResult<Self> {
        let runtime = runtime()?;
        let options = LocalClusterOptions {
            workers_per_node,
            node_settings,
            ..LocalClusterOptions::new(nodes, binary.into())
        };
        let (cluster, client) = py
            .allow_threads(|| {
                runtime.block_on(async {
                    let cluster = LocalCluster::start(options).await?;
                    let client = cluster.connect().await?;
                    Ok::<_, floe_client::Error>((cluster, client))
                })
            })
            .map_err(raise)?;
        Ok(Self {
            runtime,
            client,
            addresses: cluster.addresses(),
            dashboard_url: Some(cluster.dashboard_url()),
            local: Mutex::new(Some(cluster)),
        })
    }

    #[getter]
    fn addresses(&self) -> Vec<String> {
        self.addresses.clone()
    }

    /// The local cluster's admin token (`None` for a cluster this session connected to).
    #[getter]
    fn token(&self) -> PyResult<Option<String>> {
        Ok(self.lock_local()?.as_ref().map(|c| c.token().to_owned()))
    }

    #[getter]
    fn dashboard_url(&self) -> Option<String> {
        self.dashboard_url.clone()
    }

    /// Stops the local cluster this session started (nothing for a connected one).
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let cluster = self.lock_local()?.take();
        py.allow_threads(|| drop(cluster));
        Ok(())
    }

    /// Submits `dataset` and waits for the job to end.
    #[pyo3(signature = (dataset, cache=true))]
    fn run(&self, py: Python<'_>, dataset: &PyDataset, cache: bool) -> PyResult<PyJob> {
        let options = job_options(cache);
        let output = py
            .allow_threads(|| {
                self.runtime.block_on(async {
                    let job = self.client.submit_with(&dataset.0, options).await?;
                    job.wait().await
                })
            })
            .map_err(raise)?;
        Ok(PyJob {
            output,
            runtime: Arc::clone(&self.runtime),
            schema: Arc::new(dataset.0.schema().clone()),
        })
    }

    /// Submits `dataset` with its result streamed to this session as the job produces it.
    #[pyo3(signature = (dataset, cache=true))]
    fn stream(&self, py: Python<'_>, dataset: &PyDataset, cache: bool) -> PyResult<PyStream> {
        let options = job_options(cache);
        let stream = py
            .allow_threads(|| {
                self.runtime
                    .block_on(self.client.stream_with(&dataset.0, options))
            })
            .map_err(raise)?;
        Ok(PyStream {
            job: self.client.job(stream.job()),
            stream: Mutex::new(Some(stream)),
            failure: Arc::new(Mutex::new(None)),
            runtime: Arc::clone(&self.runtime),
            schema: Arc::new(dataset.0.schema().clone()),
        })
    }
}

fn job_options(cache: bool) -> JobOptions {
    JobOptions {
        cache: if cache {
            CacheMode::Reuse
        } else {
            CacheMode::NoCache
        },
        ..JobOptions::default()
    }
}

impl PySession {
    fn lock_local(&self) -> PyResult<std::sync::MutexGuard<'_, Option<LocalCluster>>> {
        self.local
            .lock()
            .map_err(|_| FloeError::new_err("the session's local cluster lock is poisoned"))
    }
}

/// A finished job: its stats, and its result blocks held on the nodes until it is dropped.
#[pyclass(module = "floe._floe", name = "Job", frozen)]
struct PyJob {
    output: JobOutput,
    runtime: Arc<tokio::runtime::Runtime>,
    schema: SchemaRef,
}

#[pymethods]
impl PyJob {
    #[getter]
    fn id(&self) -> String {
        self.output.job.to_string()
    }

    /// Rows in the result, from the blocks' metadata.
    #[getter]
    fn rows(&self) -> u64 {
        self.output.rows()
    }

    /// The job's stats as JSON (per-operator rows, tasks, cache hits, times).
    fn stats_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.output.stats)
            .map_err(|error| FloeError::new_err(error.to_string()))
    }

    /// The result blocks as a `pyarrow.RecordBatchReader`, fetched from the nodes as it is read.
    fn reader<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let reader = ResultReader {
            blocks: Blocks::Held(self.output.stream()),
            runtime: Arc::clone(&self.runtime),
            schema: Arc::clone(&self.schema),
            ended: false,
            failure: None,
        };
        export_reader(py, Box::new(reader))
    }
}

/// A job whose result streams to the session: read once, as the job produces it. Dropping
/// its reader before the end cancels the job.
#[pyclass(module = "floe._floe", name = "Stream", frozen)]
struct PyStream {
    job: JobHandle,
    /// Until `reader` takes it.
    stream: Mutex<Option<ResultStream>>,
    /// The error that ended the stream, kept for `raise_failure`: pyarrow sees only its text.
    failure: Arc<Mutex<Option<floe_client::Error>>>,
    runtime: Arc<tokio::runtime::Runtime>,
    schema: SchemaRef,
}

#[pymethods]
impl PyStream {
    #[getter]
    fn id(&self) -> String {
        self.job.id().to_string()
    }

    /// The result as a `pyarrow.RecordBatchReader` whose batches arrive as the job makes them.
    fn reader<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let stream = self
            .stream
            .lock()
            .map_err(|_| FloeError::new_err("the stream's lock is poisoned"))?
            .take()
            .ok_or_else(|| FloeError::new_err("a streamed result can be read only once"))?;
        let reader = ResultReader {
            blocks: Blocks::Streamed(stream),
            runtime: Arc::clone(&self.runtime),
            schema: Arc::clone(&self.schema),
            ended: false,
            failure: Some(Arc::clone(&self.failure)),
        };
        export_reader(py, Box::new(reader))
    }

    /// Raises the error that ended the stream as its own exception (`JobError` for a failed
    /// or cancelled job), if one did; pyarrow's reader raised only its text.
    fn raise_failure(&self) -> PyResult<()> {
        let failure = self
            .failure
            .lock()
            .map_err(|_| FloeError::new_err("the stream's lock is poisoned"))?
            .take();
        failure.map_or(Ok(()), |error| Err(raise(error)))
    }

    /// The job's stats as JSON, once it has ended (a streamed job ends when its result has
    /// been read to the end).
    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        let stats = py
            .allow_threads(|| self.runtime.block_on(self.job.stats()))
            .map_err(raise)?
            .ok_or_else(|| {
                FloeError::new_err(format!(
                    "job {} has not ended: a streamed job ends once its result is read to the end",
                    self.job.id()
                ))
            })?;
        serde_json::to_string(&stats).map_err(|error| FloeError::new_err(error.to_string()))
    }
}

/// Where a reader's batches come from.
enum Blocks {
    /// A finished job's held output.
    Held(BlockReader),
    /// A running job's streamed output.
    Streamed(ResultStream),
}

impl Blocks {
    async fn next_batch(&mut self) -> floe_client::Result<Option<RecordBatch>> {
        match self {
            Blocks::Held(reader) => reader.next_batch().await,
            Blocks::Streamed(stream) => stream.next_batch().await,
        }
    }
}

/// A job's result blocks as an Arrow reader, each block with the plan's schema.
struct ResultReader {
    blocks: Blocks,
    runtime: Arc<tokio::runtime::Runtime>,
    schema: SchemaRef,
    ended: bool,
    /// Where the error that ends the stream is kept, when someone asks for it.
    failure: Option<Arc<Mutex<Option<floe_client::Error>>>>,
}

impl Iterator for ResultReader {
    type Item = Result<RecordBatch, ArrowError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.ended {
            return None;
        }
        let next = match self.runtime.block_on(self.blocks.next_batch()) {
            Ok(Some(batch)) => RecordBatch::try_new(self.schema.clone(), batch.columns().to_vec()),
            Ok(None) => {
                self.ended = true;
                return None;
            }
            Err(error) => {
                let text = ArrowError::ExternalError(error.to_string().into());
                if let Some(Ok(mut slot)) = self.failure.as_ref().map(|slot| slot.lock()) {
                    *slot = Some(error);
                }
                Err(text)
            }
        };
        self.ended = next.is_err();
        Some(next)
    }
}

impl RecordBatchReader for ResultReader {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }
}

#[pymodule]
fn _floe(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyExpr>()?;
    m.add_class::<PyDataset>()?;
    m.add_class::<PySession>()?;
    m.add_class::<PyJob>()?;
    m.add_class::<PyStream>()?;
    m.add_function(wrap_pyfunction!(col, m)?)?;
    m.add_function(wrap_pyfunction!(lit, m)?)?;
    m.add("FloeError", m.py().get_type::<FloeError>())?;
    m.add("PlanError", m.py().get_type::<PlanError>())?;
    m.add("JobError", m.py().get_type::<JobError>())?;
    Ok(())
}
