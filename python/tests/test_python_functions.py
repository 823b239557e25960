"""Python functions in map_batches/flat_map run on the nodes' pooled Python processes."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import floe


def test_map_batches_pyarrow_pandas_numpy_match_local_computation(cluster):
    ds = floe.range(1000).with_column("x", floe.col("id") * 1.5)
    expected = [i * 1.5 * 2 + 1 for i in range(1000)]

    def arrow_fn(batch):
        return batch.set_column(1, "x", pc.add(pc.multiply(batch.column("x"), 2), 1))

    def pandas_fn(df):
        df["x"] = df["x"] * 2 + 1
        return df

    def numpy_fn(arrays):
        return {"id": arrays["id"], "x": arrays["x"] * 2 + 1}

    for fn, fmt in ((arrow_fn, "pyarrow"), (pandas_fn, "pandas"), (numpy_fn, "numpy")):
        got = ds.map_batches(fn, batch_format=fmt, batch_size=128).sort("id").to_arrow()
        assert got.column("x").to_pylist() == pytest.approx(expected), fmt
        assert got.schema.names == ["id", "x"]


def test_map_batches_may_change_the_schema_and_flat_map_the_row_count(cluster):
    ds = floe.range(20)
    labelled = ds.map_batches(
        lambda b: pa.table({"id": b.column("id"), "label": pc.cast(b.column("id"), pa.string())}))
    assert labelled.schema().field("label").type == pa.string()
    assert sorted(labelled.take_all(), key=lambda r: r["id"]) == [{"id": i, "label": str(i)} for i in range(20)]
    repeated = ds.flat_map(lambda row: [{"id": row["id"], "copy": c} for c in range(row["id"] % 3)])
    expected = sum(i % 3 for i in range(20))
    assert repeated.count() == expected
    assert repeated.columns() == ["id", "copy"]


class CountingModel:
    """Constructed once per process: each construction appends the process id to `log`."""

    def __init__(self, log, offset):
        self.offset = offset
        with open(log, "a") as out:
            out.write("%d\n" % os.getpid())

    def __call__(self, batch):
        pids = pa.array([os.getpid()] * batch.num_rows, pa.int64())
        shifted = pc.add(batch.column("id"), self.offset)
        return pa.table({"id": shifted, "pid": pids})


def test_a_callable_class_is_constructed_once_per_process(cluster, tmp_path):
    log = tmp_path / "constructions"
    ds = floe.range(2000).repartition(8).map_batches(
        CountingModel, fn_constructor_args=(str(log), 100), concurrency=2, batch_size=50,
        output_schema=pa.schema([("id", pa.int64()), ("pid", pa.int64())]))
    table = ds.to_arrow()
    assert sorted(table.column("id").to_pylist()) == list(range(100, 2100))
    served_by = set(table.column("pid").to_pylist())
    constructed = [int(line) for line in log.read_text().split()]
    # 2000 rows in 40 calls, yet each process that served any constructed the model once.
    assert sorted(constructed) == sorted(set(constructed)), constructed
    assert served_by <= set(constructed)
    assert 1 <= len(served_by) <= 2


def test_an_exception_comes_back_with_its_traceback(cluster):
    def explode(batch):
        raise ValueError("the batch had %d rows" % batch.num_rows)

    ds = floe.range(10).map_batches(explode, output_schema=pa.schema([("id", pa.int64())]))
    with pytest.raises(floe.JobError) as raised:
        ds.count()
    message = str(raised.value)
    assert "Traceback" in message
    assert "ValueError: the batch had" in message
    assert "explode" in message


def test_an_unhashable_function_is_never_served_from_the_cache_and_explain_says_so(cluster):
    # A bare object has no content to hash (it pickles, but its identity is its address).
    sentinel = object()

    def guarded(batch):
        assert sentinel is not None
        return batch

    first = floe.range(10).map_batches(guarded)
    second = floe.range(10).map_batches(guarded)
    assert first.fingerprint() != second.fingerprint()
    assert "random" in first.explain() and "map_batches(" in first.explain()
    assert first.count() == 10


_SCRIPT = """
import json, floe
import pyarrow.compute as pc

def scale(batch):
    return batch.set_column(0, "id", pc.multiply(batch.column("id"), FACTOR))

floe.connect()
ds = floe.range(300).map_batches(scale)
total = sum(ds.to_pandas()["id"])
stats = json.loads(ds._last_job.stats_json())
print(json.dumps({"total": int(total), "cache_hits": sum(o["cache_hits"] for o in stats["operators"])}))
"""


def _run_script(cluster, factor):
    env = dict(os.environ, FLOE_ADDRESS=",".join(cluster.addresses), FLOE_TOKEN=cluster.token,
               FLOE_PYTHON=sys.executable)
    program = textwrap.dedent(_SCRIPT).replace("FACTOR", str(factor))
    out = subprocess.run([sys.executable, "-c", program], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_rerun_in_a_new_process_hits_the_cache_and_an_edit_misses_it(cluster):
    first = _run_script(cluster, 3)
    assert first["total"] == 3 * sum(range(300))
    again = _run_script(cluster, 3)
    assert again["total"] == first["total"]
    assert again["cache_hits"] > 0, again
    edited = _run_script(cluster, 4)
    assert edited["total"] == 4 * sum(range(300))
    assert edited["cache_hits"] == 0, edited


def test_iter_batches_streams_the_first_batch_while_the_rest_of_the_job_waits(cluster, tmp_path):
    # Every task after the first waits for `go`, which only this loop creates once it holds
    # a batch: the first batch can only arrive while the job is still running.
    go = tmp_path / "go"
    rows_per_task = 4 * 8192
    total = 4 * rows_per_task

    def held_back(batch):
        import pathlib
        import time

        if batch.num_rows and batch.column("id")[0].as_py() >= rows_per_task:
            deadline = time.monotonic() + 120
            while not pathlib.Path(go).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return batch

    ds = floe.range(total).map_batches(held_back).with_column("twice", floe.col("id") * 2)
    batches = ds.iter_batches(batch_format="pyarrow")
    first = next(batches)
    assert not go.exists()
    assert first.column("id")[0].as_py() == 0
    go.touch()
    rest = list(batches)
    table = pa.Table.from_batches([first, *rest])
    assert table.column("id").to_pylist() == list(range(total))
    assert table.column("twice").to_pylist() == [i * 2 for i in range(total)]


def test_a_job_failing_mid_stream_raises_its_error_from_the_loop(cluster):
    def fail_late(batch):
        if batch.num_rows and batch.column("id")[0].as_py() >= 3 * 8192:
            raise RuntimeError("late failure at %d" % batch.column("id")[0].as_py())
        return batch

    ds = floe.range(8 * 8192).map_batches(fail_late)
    with pytest.raises(floe.JobError) as raised:
        for _ in ds.iter_batches():
            pass
    assert "late failure at" in str(raised.value)
