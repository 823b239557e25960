"""The Python side of `floe-bench python`: run by the bench as `python3 -c`, with a JSON
argument (cluster address, token, Parquet files, runs). Times the Python client's calls on
the bench's cluster and prints one JSON line with the median times and the values the bench
checks against its own computation. Each timing starts at the call and ends when the last
row is in this process."""

import json
import statistics
import sys
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import floe


def median_time(runs, work):
    """The median time of `runs` calls of `work`, and the last call's result."""
    times, result = [], None
    for _ in range(runs):
        started = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def main():
    args = json.loads(sys.argv[1])
    # Without the cache, as the Rust side runs: every run computes.
    floe.connect(args["address"], token=args["token"], cache=False)
    files, runs = args["files"], args["runs"]
    events = floe.read_parquet(files)
    out = {}

    # Streaming the map workload's rows to Python.
    mapped = events.select_columns(["value"]).with_column("v2", floe.col("value") * 2.0 + 1.0)

    def stream_sum():
        total, rows = 0.0, 0
        for batch in mapped.iter_batches(batch_format="pyarrow"):
            total += pc.sum(batch.column("v2")).as_py() or 0.0
            rows += batch.num_rows
        return total, rows

    out["iter_batches_s"], (out["iter_batches_sum"], out["iter_batches_rows"]) = median_time(
        runs, stream_sum)

    # The map workload natively, and through an identity Python function.
    def total(dataset):
        rows = dataset.with_column("v2", floe.col("value") * 2.0 + 1.0) \
            .groupby([]).aggregate(floe.Sum("v2", alias_name="total")).take_all()
        return rows[0]["total"]

    values = events.select_columns(["value"])
    identity = values.map_batches(lambda batch: batch, batch_format="pyarrow")
    # Warm-ups: the first Python run starts the nodes' Python processes.
    total(values)
    total(identity)
    out["native_map_s"], out["native_total"] = median_time(runs, lambda: total(values))
    out["python_map_s"], out["python_total"] = median_time(runs, lambda: total(identity))

    # A whole table to pandas, against pyarrow reading the same files.
    columns = ["user_id", "group", "value"]

    def value_sum(frame):
        return float(frame["value"].sum()), len(frame)

    out["to_pandas_s"], (out["to_pandas_value_sum"], out["to_pandas_rows"]) = median_time(
        runs, lambda: value_sum(events.select_columns(columns).to_pandas()))
    out["pyarrow_s"], (out["pyarrow_value_sum"], out["pyarrow_rows"]) = median_time(
        runs, lambda: value_sum(pq.read_table(files, columns=columns).to_pandas()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
