"""floe from Python: Ray Data's API over a floe cluster.

    import floe

    floe.init()                                   # a local cluster, stopped at exit
    ds = floe.range(1000).with_column("v", floe.col("id") * 2 + 1)
    ds = ds.filter(floe.col("v") > 10).map_batches(lambda batch: batch)
    print(ds.groupby("bucket").aggregate(floe.Sum("v"), floe.Count()).to_pandas())

Plans are built, validated and fingerprinted in Rust (`floe._floe`, over the floe-client
crate); results reach pyarrow through the Arrow C stream interface without a copy.
"""

from ._floe import Expr, FloeError, JobError, PlanError, col, lit
from .aggregate import AggregateFn, Count, Max, Mean, Min, Std, Sum
from .context import connect, init, is_initialized, shutdown
from .dataset import (
    Dataset,
    from_arrow,
    from_items,
    from_pandas,
    range,
    read_binary_files,
    read_csv,
    read_json,
    read_parquet,
    read_text,
)

__all__ = [
    "AggregateFn", "Count", "Dataset", "Expr", "FloeError", "JobError", "Max", "Mean", "Min",
    "PlanError", "Std", "Sum", "col", "connect", "from_arrow", "from_items", "from_pandas",
    "init", "is_initialized", "lit", "range", "read_binary_files", "read_csv", "read_json",
    "read_parquet", "read_text", "shutdown",
]
