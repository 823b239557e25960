"""Hive-partitioned sinks and sources, text and binary files, against pyarrow and plain Python
on a real cluster."""

import gzip

import pyarrow as pa
import pyarrow.dataset as pads

import floe


def _rows(table, *keys):
    return sorted(table.to_pylist(), key=lambda row: tuple(row[k] for k in keys))


def test_partitioned_writes_read_back_in_pyarrow_and_prune_in_floe(cluster, tmp_path):
    table = pa.table({
        "id": list(range(60)),
        "day": ["2026-11-%02d" % (28 + i % 3) for i in range(60)],
        "shard": [i % 2 for i in range(60)],
    })
    floe.from_arrow(table).write_parquet(tmp_path / "out", partition_by=["day", "shard"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "day=2026-11-28", "day=2026-11-29", "day=2026-11-30"]
    assert not any("day" in f.name for f in (tmp_path / "out").rglob("*.parquet"))

    back = pads.dataset(tmp_path / "out", format="parquet", partitioning="hive").to_table()
    assert _rows(back.select(["id", "day", "shard"]), "id") == _rows(table, "id")

    ds = floe.read_parquet(tmp_path / "out")
    assert ds.columns() == ["id", "day", "shard"]
    one_day = ds.filter(floe.col("day") == "2026-11-29")
    assert _rows(one_day.to_arrow(), "id") == [r for r in _rows(table, "id") if r["day"] == "2026-11-29"]
    optimized = one_day.explain().split("== Optimized plan ==")[1].split("== Physical plan ==")[0]
    total = len(list((tmp_path / "out").rglob("*.parquet")))
    kept = len(list((tmp_path / "out" / "day=2026-11-29").rglob("*.parquet")))
    assert kept < total and ("files=%d " % kept) in optimized, optimized

    declared = floe.read_parquet(tmp_path / "out", partitioning={"day": "string", "shard": "string"})
    assert str(declared.schema().field("shard").type) == "string"
    assert floe.read_parquet(tmp_path / "out", partitioning="none").columns() == ["id"]


def test_text_and_binary_files_match_python(cluster, tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo\r\n\nfour")
    with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
        f.write("".join("line %d\n" % i for i in range(500)))
    lines = floe.read_text(tmp_path).to_arrow()
    assert lines.column_names == ["text"]
    assert lines["text"].to_pylist() == ["one", "two", "", "four"] + ["line %d" % i for i in range(500)]

    files = floe.read_binary_files([tmp_path / "a.txt", tmp_path / "b.txt.gz"]).to_arrow()
    found = {row["path"]: row["bytes"] for row in files.to_pylist()}
    assert found == {str((tmp_path / name).resolve()): (tmp_path / name).read_bytes()
                     for name in ("a.txt", "b.txt.gz")}
