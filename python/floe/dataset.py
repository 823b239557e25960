"""`floe.Dataset`: Ray Data's names over floe's plans.

Every transform adds one node to the Rust plan (validated and fingerprinted there) and
returns a new Dataset; consumers submit the plan to the session's cluster and read the result
blocks as pyarrow batches.
"""

import base64
import builtins
import json

import cloudpickle
import pyarrow as pa

from . import _floe, context, floe_udf
from ._fingerprint import code_identity

BATCH_FORMATS = ("pyarrow", "pandas", "numpy")
# The inline code a node runs for a Python function; the function follows as arguments.
_RUNNER = "import floe_udf; floe_udf.serve_pickled()"
# One argument may hold at most 128 KiB on Linux; the payload is cut into chunks below that.
_CHUNK = 100_000
# Rows flat_map calls its function on, in the client, to learn its output schema.
_SAMPLE_ROWS = 16


def read_parquet(paths, *, columns=None, partitioning="hive"):
    """Parquet files: each path a file, a directory or a glob in its last component.

    `partitioning`: "hive" finds `key=value` directories below a directory and adds their
    columns (int64 when every value is an integer, else string), "none" does not, or a dict
    {column: "int64" | "string"} declares them. A filter on them skips whole directories."""
    return Dataset(_floe.Dataset.read("parquet", _paths(paths), columns,
                                      _partitioning(partitioning)))


def read_csv(paths, *, columns=None, partitioning="hive"):
    """CSV files with a header row."""
    return Dataset(_floe.Dataset.read("csv", _paths(paths), columns,
                                      _partitioning(partitioning)))


def read_json(paths, *, columns=None, partitioning="hive"):
    """Newline-delimited JSON files."""
    return Dataset(_floe.Dataset.read("json", _paths(paths), columns,
                                      _partitioning(partitioning)))


def read_text(paths, *, partitioning="hive"):
    """UTF-8 text files, one row per line in a column `text`."""
    return Dataset(_floe.Dataset.read("text", _paths(paths), None, _partitioning(partitioning)))


def read_binary_files(paths, *, partitioning="hive"):
    """Whole files, one row each: `path` and `bytes`."""
    return Dataset(_floe.Dataset.read("binary", _paths(paths), None,
                                      _partitioning(partitioning)))


def _partitioning(partitioning):
    if isinstance(partitioning, dict):
        return list(partitioning.items())
    return partitioning


def range(n):
    """The integers 0..n in an int64 column `id`."""
    return Dataset(_floe.Dataset.range(n))


def from_arrow(table):
    """A pyarrow Table, RecordBatch or RecordBatchReader, sent inline with the plan (keep it
    small: it travels with every job built on it)."""
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if isinstance(table, pa.Table):
        table = table.to_reader()
    return Dataset(_floe.Dataset.from_reader(table))


def from_pandas(df):
    return from_arrow(pa.Table.from_pandas(df, preserve_index=False))


def from_items(items):
    """A list of dicts (one per row)."""
    return from_arrow(pa.Table.from_pylist(list(items)))


def _paths(paths):
    return [str(paths)] if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__") else [str(p) for p in paths]


def _columns(columns):
    return [columns] if isinstance(columns, str) else list(columns)


class Dataset:
    """A lazy, immutable pipeline. Nothing runs until a consumer (`count`, `take`,
    `to_arrow`, `iter_batches`, `write_*`, …) is called."""

    def __init__(self, plan, random_steps=()):
        self._plan = plan
        # (step, reason) for each Python function whose fingerprint had to be random.
        self._random_steps = tuple(random_steps)
        self._last_job = None

    def _then(self, plan, random_step=None):
        steps = self._random_steps + ((random_step,) if random_step else ())
        return Dataset(plan, steps)

    def __repr__(self):
        return "Dataset(columns=%s)" % self.columns()

    # ---- transforms -------------------------------------------------------------------

    def filter(self, expr):
        """Rows where `expr` (e.g. `floe.col("v") > 0.5`) is true."""
        return self._then(self._plan.filter(expr))

    def with_column(self, name, expr):
        return self._then(self._plan.with_column(name, expr))

    def select_columns(self, cols):
        return self._then(self._plan.select_columns(_columns(cols)))

    def drop_columns(self, cols):
        return self._then(self._plan.drop_columns(_columns(cols)))

    def rename_columns(self, names):
        """`{"old": "new", …}`."""
        return self._then(self._plan.rename_columns(list(dict(names).items())))

    def map_batches(self, fn, *, batch_format="pyarrow", batch_size=None, concurrency=None,
                    fn_constructor_args=(), fn_constructor_kwargs=None, output_schema=None):
        """Runs `fn` over batches on the nodes, in pooled Python processes.

        `fn` is a function of a batch, or a callable class constructed once per process (with
        `fn_constructor_args`/`fn_constructor_kwargs`) whose instance is called per batch.
        A batch is a `pyarrow.RecordBatch`, a pandas DataFrame or a dict of numpy arrays
        (`batch_format`); the result a pyarrow Table/RecordBatch, a DataFrame or a dict of
        columns. `output_schema` (a `pyarrow.Schema`) is inferred by calling `fn` here on an
        empty batch when not given. `concurrency` is processes per node: `n` or `(min, max)`.
        """
        if batch_format not in BATCH_FORMATS:
            raise ValueError("batch_format must be one of %s, got %r" % (", ".join(BATCH_FORMATS), batch_format))
        is_class = isinstance(fn, type)
        kwargs = dict(fn_constructor_kwargs or {})
        args = tuple(fn_constructor_args)
        if not is_class and (args or kwargs):
            raise ValueError("fn_constructor_args are for a callable class, and fn is a function")
        if output_schema is None:
            output_schema = self._infer_schema(fn, is_class, args, kwargs, batch_format)
        spec = {"function": fn, "is_class": is_class, "args": args, "kwargs": kwargs,
                "batch_format": batch_format, "schema": output_schema}
        identity, reason = code_identity("map_batches", batch_format, fn, args, kwargs, output_schema)
        return self._inline(spec, fn, identity, reason, _concurrency(concurrency, is_class),
                            batch_size, output_schema, "map_batches")

    def flat_map(self, fn, *, output_schema=None):
        """`fn(row: dict) -> list of dicts`, each a row of the output."""
        if output_schema is None:
            output_schema = self._infer_flat_schema(fn)
        spec = {"function": _flattened(fn, output_schema), "is_class": False, "args": (),
                "kwargs": {}, "batch_format": "pyarrow", "schema": output_schema}
        identity, reason = code_identity("flat_map", fn, output_schema)
        return self._inline(spec, fn, identity, reason, (1, 0), None, output_schema, "flat_map")

    def _inline(self, spec, fn, identity, reason, concurrency, batch_size, output_schema, step):
        payload = base64.b64encode(_pickle(spec, fn)).decode("ascii")
        chunks = [payload[i:i + _CHUNK] for i in builtins.range(0, len(payload), _CHUNK)]
        context.session()
        plan = self._plan.map_inline_process(
            context.python_command(), ["-c", _RUNNER, *chunks], identity, concurrency,
            batch_size, output_schema)
        name = getattr(fn, "__qualname__", type(fn).__name__)
        return self._then(plan, ("%s(%s)" % (step, name), reason) if reason else None)

    def _infer_schema(self, fn, is_class, args, kwargs, batch_format):
        """`fn`'s output schema: called here on an empty batch of the input schema."""
        empty = pa.RecordBatch.from_pylist([], schema=self.schema())
        try:
            callable_ = fn(*args, **kwargs) if is_class else fn
            result = callable_(floe_udf._to_format(empty, batch_format))
            return floe_udf._from_format(result, None).schema
        except Exception as error:
            raise _floe.PlanError(
                "cannot infer the output schema of %s by calling it on an empty batch (%s: %s); "
                "pass output_schema=pyarrow.schema([...])"
                % (getattr(fn, "__qualname__", fn), type(error).__name__, error)) from error

    def _infer_flat_schema(self, fn):
        """`fn`'s output schema: called here on the dataset's first rows (a small job) until
        it returns some."""
        try:
            for row in self.take(_SAMPLE_ROWS):
                rows = list(fn(row))
                if rows:
                    return pa.Table.from_pylist(rows).schema
        except Exception as error:
            raise _floe.PlanError(
                "cannot infer the output schema of %s by calling it on the first rows (%s: %s); "
                "pass output_schema=pyarrow.schema([...])"
                % (getattr(fn, "__qualname__", fn), type(error).__name__, error)) from error
        raise _floe.PlanError(
            "cannot infer the output schema of %s: it returned no rows for the first %d; pass "
            "output_schema=pyarrow.schema([...])" % (getattr(fn, "__qualname__", fn), _SAMPLE_ROWS))

    def groupby(self, key):
        """Groups by a column or columns; finish with `.aggregate(floe.Sum("v"), …)`."""
        return GroupedData(self, _columns(key))

    def sort(self, key, descending=False):
        keys = _columns(key)
        order = descending if isinstance(descending, (list, tuple)) else [descending] * len(keys)
        return self._then(self._plan.sort(list(zip(keys, order))))

    def random_shuffle(self, *, seed=None):
        return self._then(self._plan.random_shuffle(seed))

    def repartition(self, num_blocks, *, keys=None):
        return self._then(self._plan.repartition(num_blocks, _columns(keys or [])))

    def join(self, other, on, how="inner", *, right_on=None):
        """Joins rows with equal keys; `how` is inner, left, right, full, semi or anti."""
        left = _columns(on)
        return self._then(self._plan.join(other._plan, left, _columns(right_on) if right_on else left, how))

    def union(self, *others):
        plan = self._plan
        for other in others:
            plan = plan.union(other._plan)
        return self._then(plan, None)

    def unique(self, columns=()):
        """Distinct rows of `columns` (all columns when empty), as a dataset."""
        return self._then(self._plan.unique(_columns(columns)))

    def limit(self, n):
        return self._then(self._plan.limit(n))

    def cache(self):
        """Keeps this dataset in the cluster's cache when it is computed."""
        return self._then(self._plan.cache())

    # ---- consumers --------------------------------------------------------------------

    def _run(self, plan=None):
        job = context.session().run(plan or self._plan, context.cache_enabled())
        self._last_job = job
        return job

    def _stream(self):
        """The result's schema and its batches, which arrive as the job produces them."""
        job = context.session().stream(self._plan, context.cache_enabled())
        self._last_job = job
        reader = job.reader()
        return reader.schema, _raising(job, reader)

    def count(self):
        return self._run().rows

    def schema(self):
        return self._plan.schema()

    def columns(self):
        return self.schema().names

    def fingerprint(self):
        return self._plan.fingerprint()

    def to_arrow(self):
        schema, batches = self._stream()
        return pa.Table.from_batches(list(batches), schema=schema)

    def to_pandas(self):
        return self.to_arrow().to_pandas()

    def take(self, limit=20):
        """The first `limit` rows as dicts."""
        return self.limit(limit).take_all()

    def take_all(self):
        return self.to_arrow().to_pylist()

    def show(self, limit=20):
        for row in self.take(limit):
            print(row)

    def iter_batches(self, *, batch_size=None, batch_format="pyarrow"):
        """Batches of `batch_size` rows (the result blocks as they are when None), as pyarrow
        RecordBatches, pandas DataFrames or dicts of numpy arrays. The result streams: the
        first batch comes as soon as the job has made it, the cluster pauses the job while
        this loop lags, and leaving the loop early cancels the job."""
        if batch_format not in BATCH_FORMATS:
            raise ValueError("batch_format must be one of %s, got %r" % (", ".join(BATCH_FORMATS), batch_format))
        for batch in _rebatch(self._stream()[1], batch_size):
            yield floe_udf._to_format(batch, batch_format)

    def materialize(self):
        """Computes the dataset; the result is a dataset over its rows (held in this process
        and sent inline with the plans built on it)."""
        materialized = from_arrow(self.to_arrow())
        materialized._last_job = self._last_job
        return materialized

    def stats(self):
        """The last run's stats: per operator, rows, tasks, cache hits and time."""
        if self._last_job is None:
            return "This dataset has not run yet: stats() describes its last run."
        stats = json.loads(self._last_job.stats_json())
        lines = ["job %s: %d ms, %d bytes spilled" % (self._last_job.id, stats["wall_ms"], stats["spilled_bytes"])]
        for operator in stats["operators"]:
            lines.append("  " + ", ".join("%s=%s" % item for item in operator.items()))
        return "\n".join(lines)

    def explain(self):
        """The logical, optimized and physical plans, and which steps the cache never serves."""
        text = self._plan.explain()
        for step, reason in self._random_steps:
            text += ("\nfingerprint of %s is random, so it and the steps after it are never "
                     "served from the cache: %s" % (step, reason))
        return text

    def write_parquet(self, path, *, mode="error", partition_by=None):
        """Writes files into directory `path`; `mode` is error (refuse a directory with files),
        overwrite or append. `partition_by` columns become Hive directories
        (`date=2026-11-30/part-….parquet`) and leave the files."""
        self._run(self._plan.write("parquet", str(path), mode, partition_by))

    def write_csv(self, path, *, mode="error", partition_by=None):
        self._run(self._plan.write("csv", str(path), mode, partition_by))

    def write_json(self, path, *, mode="error", partition_by=None):
        self._run(self._plan.write("json", str(path), mode, partition_by))


class GroupedData:
    def __init__(self, dataset, keys):
        self._dataset = dataset
        self._keys = keys

    def aggregate(self, *aggs):
        plan = self._dataset._plan.aggregate(self._keys, [agg._spec() for agg in aggs])
        return self._dataset._then(plan)


def _concurrency(concurrency, is_class):
    if concurrency is None:
        return (1, 0)
    if isinstance(concurrency, int):
        return (concurrency, concurrency) if is_class else (1, concurrency)
    low, high = concurrency
    return (low, high)


def _flattened(fn, schema):
    """`fn(row) -> rows` as a batch function with output `schema`."""
    def flat_map_batch(batch):
        rows = [out for row in batch.to_pylist() for out in fn(row)]
        return pa.Table.from_pylist(rows, schema=schema)
    return flat_map_batch


def _pickle(spec, fn):
    """cloudpickle of `spec`, with `fn`'s own module pickled by value (a node cannot import a
    user's script or notebook); installed packages stay references."""
    module = getattr(fn, "__module__", None)
    register = module not in (None, "__main__") and not _installed(module)
    if register:
        cloudpickle.register_pickle_by_value(__import__("sys").modules[module])
    try:
        return cloudpickle.dumps(spec)
    finally:
        if register:
            cloudpickle.unregister_pickle_by_value(__import__("sys").modules[module])


def _installed(module_name):
    import sys
    import sysconfig
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None) or ""
    roots = {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib")}
    return module is None or not path or any(path.startswith(root) for root in roots)


def _raising(job, reader):
    """The reader's batches; an error that ends the stream is raised as floe raises it
    (`JobError` for a failed job), not as pyarrow's text of it."""
    try:
        yield from reader
    except Exception:
        job.raise_failure()
        raise


def _rebatch(reader, batch_size):
    if batch_size is None:
        yield from reader
        return
    pending, rows = [], 0
    for batch in reader:
        pending.append(batch)
        rows += batch.num_rows
        while rows >= batch_size:
            table = pa.Table.from_batches(pending).combine_chunks()
            yield table.slice(0, batch_size).to_batches()[0]
            rest = table.slice(batch_size)
            pending, rows = rest.to_batches(), rest.num_rows
    if rows:
        yield pa.Table.from_batches(pending).combine_chunks().to_batches()[0]
