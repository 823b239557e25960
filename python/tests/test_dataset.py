"""Every Dataset method against an independent pyarrow/pandas computation, on a real cluster."""

import json

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv
import pyarrow.json
import pyarrow.parquet as pq
import pytest

import floe


def _sorted(table, *keys):
    return table.sort_by([(key, "ascending") for key in keys])


def test_range_with_column_and_filter_match_pyarrow(cluster):
    ds = floe.range(1000).with_column("v", floe.col("id") * 2 + 1).filter(floe.col("v") % 3 == 0)
    rows = [{"id": i, "v": i * 2 + 1} for i in range(1000) if (i * 2 + 1) % 3 == 0]
    expected = pa.Table.from_pylist(rows, schema=pa.schema([("id", pa.int64(), False), ("v", pa.int64())]))
    got = ds.to_arrow()
    assert got.to_pylist() == expected.to_pylist()
    assert ds.count() == expected.num_rows
    assert ds.columns() == ["id", "v"]
    assert ds.schema().field("v").type == pa.int64()


def test_float_expressions_with_python_operators(cluster):
    table = pa.table({"v": [0.1, 0.3, 0.7, 1.2, -2.0]})
    ds = floe.from_arrow(table).filter(floe.col("v") * 2 + 1 > 1.5)
    expected = [v for v in table.column("v").to_pylist() if v * 2 + 1 > 1.5]
    assert ds.to_arrow().column("v").to_pylist() == expected
    both = floe.from_arrow(table).filter((floe.col("v") > 0) & ~(floe.col("v") > 1))
    assert both.to_arrow().column("v").to_pylist() == [0.1, 0.3, 0.7]
    with pytest.raises(TypeError, match="no truth value"):
        bool(floe.col("v") > 0)


def test_sources_from_items_pandas_arrow(cluster):
    items = [{"k": "a", "v": 1}, {"k": "b", "v": 2}, {"k": "a", "v": 3}]
    assert floe.from_items(items).take_all() == items
    df = pd.DataFrame(items)
    pd.testing.assert_frame_equal(floe.from_pandas(df).to_pandas(), df)
    table = pa.table({"x": [1.5, None, 2.5]})
    assert floe.from_arrow(table).to_arrow().equals(table)
    assert floe.from_arrow(table.to_batches()[0]).count() == 3


def test_file_sources_match_pyarrow_readers(cluster, tmp_path):
    table = pa.table({"id": list(range(100)), "name": ["n%d" % i for i in range(100)]})
    pq.write_table(table, tmp_path / "a.parquet")
    pa.csv.write_csv(table, tmp_path / "a.csv")
    (tmp_path / "a.json").write_text("".join(json.dumps(row) + "\n" for row in table.to_pylist()))
    assert floe.read_parquet(tmp_path / "a.parquet").to_arrow().equals(pq.read_table(tmp_path / "a.parquet"))
    assert floe.read_csv(str(tmp_path / "a.csv")).to_arrow().to_pylist() == pa.csv.read_csv(tmp_path / "a.csv").to_pylist()
    assert floe.read_json([tmp_path / "a.json"]).to_arrow().to_pylist() == pa.json.read_json(tmp_path / "a.json").to_pylist()
    assert floe.read_parquet(tmp_path / "a.parquet", columns=["name"]).columns() == ["name"]


def test_column_transforms(cluster):
    ds = floe.range(10).with_column("a", floe.col("id") + 1).with_column("b", floe.lit("x"))
    assert ds.select_columns(["b", "id"]).columns() == ["b", "id"]
    assert ds.drop_columns("a").columns() == ["id", "b"]
    renamed = ds.rename_columns({"a": "alpha"})
    assert renamed.columns() == ["id", "alpha", "b"]
    assert renamed.take(3) == [{"id": i, "alpha": i + 1, "b": "x"} for i in range(3)]


def test_groupby_aggregate_matches_pandas(cluster):
    df = pd.DataFrame({"k": [i % 7 for i in range(500)], "v": [float(i) for i in range(500)]})
    got = (floe.from_pandas(df).groupby("k")
           .aggregate(floe.Sum("v"), floe.Count(), floe.Mean("v", alias_name="avg"), floe.Max("v"))
           .sort("k").to_pandas())
    grouped = df.groupby("k")["v"]
    assert got["k"].tolist() == sorted(df["k"].unique().tolist())
    assert got[got.columns[1]].tolist() == grouped.sum().tolist()
    assert got["count"].tolist() == grouped.count().tolist()
    assert got["avg"].tolist() == pytest.approx(grouped.mean().tolist())
    assert got[got.columns[4]].tolist() == grouped.max().tolist()


def test_sort_shuffle_repartition_unique_union_join_limit_cache(cluster):
    df = pd.DataFrame({"k": [3, 1, 2, 1, 3], "v": [10, 20, 30, 40, 50]})
    ds = floe.from_pandas(df)
    assert ds.sort("v", descending=True).to_pandas()["v"].tolist() == sorted(df["v"], reverse=True)
    assert sorted(ds.random_shuffle(seed=7).to_pandas()["v"]) == sorted(df["v"])
    assert ds.repartition(3).count() == 5
    assert ds.repartition(2, keys=["k"]).count() == 5
    assert sorted(ds.unique("k").to_pandas()["k"]) == sorted(df["k"].unique())
    assert ds.union(ds).count() == 10
    names = floe.from_items([{"k": 1, "name": "one"}, {"k": 2, "name": "two"}])
    joined = _sorted(ds.join(names, "k").to_arrow(), "v").to_pandas()
    expected = df.merge(pd.DataFrame({"k": [1, 2], "name": ["one", "two"]}), on="k").sort_values("v")
    assert joined["v"].tolist() == expected["v"].tolist()
    assert joined["name"].tolist() == expected["name"].tolist()
    assert ds.limit(2).count() == 2
    assert ds.cache().sort("v").to_pandas()["v"].tolist() == sorted(df["v"])


def test_consumers(cluster, capsys):
    ds = floe.range(100).with_column("sq", floe.col("id") * floe.col("id"))
    rows = [{"id": i, "sq": i * i} for i in range(100)]
    assert ds.take(5) == rows[:5]
    assert ds.take_all() == rows
    ds.show(2)
    assert capsys.readouterr().out.splitlines() == [str(rows[0]), str(rows[1])]
    batches = list(ds.iter_batches(batch_size=30))
    assert [b.num_rows for b in batches] == [30, 30, 30, 10]
    assert pa.Table.from_batches(batches).to_pylist() == rows
    frames = list(ds.iter_batches(batch_size=50, batch_format="pandas"))
    assert pd.concat(frames)["sq"].tolist() == [r["sq"] for r in rows]
    arrays = list(ds.iter_batches(batch_format="numpy"))
    assert sum(len(a["id"]) for a in arrays) == 100
    materialized = ds.materialize()
    assert materialized.take_all() == rows
    assert "job " in materialized.stats() and "rows=" in materialized.stats()
    assert "range" in ds.explain().lower()


def test_writes_match_pyarrow_and_honour_mode(cluster, tmp_path):
    ds = floe.range(50).with_column("half", floe.col("id") / 2)
    expected = ds.to_arrow()
    ds.write_parquet(tmp_path / "pq")
    assert _sorted(pq.read_table(tmp_path / "pq"), "id").equals(expected)
    with pytest.raises(floe.FloeError):
        ds.write_parquet(tmp_path / "pq")
    ds.write_parquet(tmp_path / "pq", mode="overwrite")
    assert pq.read_table(tmp_path / "pq").num_rows == 50
    ds.write_csv(tmp_path / "csv")
    csv_files = sorted((tmp_path / "csv").iterdir())
    assert sum(pa.csv.read_csv(f).num_rows for f in csv_files) == 50
    ds.write_json(tmp_path / "json")
    lines = [json.loads(line) for f in sorted((tmp_path / "json").iterdir()) for line in f.read_text().splitlines()]
    assert sorted(row["id"] for row in lines) == list(range(50))


def test_plan_errors_raise_with_the_clis_message(cluster):
    with pytest.raises(floe.PlanError, match="idd"):
        floe.range(10).select_columns(["idd"])
    with pytest.raises(floe.PlanError):
        floe.range(10).filter(floe.col("nope") > 1)
    with pytest.raises(ValueError, match="join type"):
        floe.range(3).join(floe.range(3), "id", how="sideways")


def test_connect_needs_an_address_and_a_token(monkeypatch):
    for name in ("FLOE_ADDRESS", "FLOE_TOKEN", "FLOE_CLIENT_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(floe.FloeError, match="FLOE_ADDRESS"):
        floe.connect()
    monkeypatch.setenv("FLOE_ADDRESS", "127.0.0.1:7700")
    with pytest.raises(floe.FloeError, match="FLOE_TOKEN"):
        floe.connect()
