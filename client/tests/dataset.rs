//! The Dataset builder over real files: schemas, validation errors, fingerprints, explain.
// Test helpers outside #[test] functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field};
use arrow::record_batch::RecordBatch;
use floe_client::{
    AggFunction, Aggregation, Dataset, JoinType, SortKey, UdfCall, WriteOptions, col, lit,
};
use floe_core::plan::Operator;

fn write_csv(path: &Path, body: &str) {
    std::fs::write(path, body).unwrap();
}

fn orders(dir: &Path) -> Dataset {
    write_csv(
        &dir.join("orders.csv"),
        "order_id,customer,amount,note\n1,7,10.5,first order\n2,8,3.25,\n3,7,1.0,Again\n",
    );
    Dataset::read_csv(&[dir.join("*.csv")]).unwrap()
}

#[test]
fn every_operation_builds_with_the_expected_schema() {
    let dir = tempfile::tempdir().unwrap();
    let orders = orders(dir.path());
    assert_eq!(
        orders.column_names(),
        vec!["order_id", "customer", "amount", "note"]
    );
    let batch = RecordBatch::try_from_iter([
        (
            "customer",
            Arc::new(Int64Array::from(vec![7, 8])) as ArrayRef,
        ),
        (
            "country",
            Arc::new(StringArray::from(vec!["NZ", "PT"])) as ArrayRef,
        ),
    ])
    .unwrap();
    let customers = Dataset::from_batches(&batch.schema(), &[batch]).unwrap();

    let enriched = orders
        .with_column("taxed", col("amount") * lit(1.15))
        .unwrap()
        .filter(col("amount").gt(lit(2.0)))
        .unwrap()
        .rename(&[("note", "comment")])
        .unwrap()
        .map_batches(UdfCall::new("lowercase_normalize", 1).with("column", "comment"))
        .unwrap()
        .drop(&["order_id"])
        .unwrap()
        .join(&customers, &["customer"], JoinType::Left)
        .unwrap();
    assert_eq!(
        enriched.column_names(),
        vec!["customer", "amount", "comment", "taxed", "country"]
    );
    let summary = enriched
        .groupby(&["country"])
        .agg(vec![
            Aggregation::count_rows("orders"),
            Aggregation::of(AggFunction::Mean, "amount"),
            Aggregation::of(AggFunction::Std, "taxed"),
            Aggregation::of(AggFunction::CountDistinct, "customer"),
        ])
        .unwrap()
        .sort(vec![SortKey::desc("orders").nulls_first(false)])
        .unwrap()
        .limit(10)
        .unwrap();
    assert_eq!(
        summary
            .schema()
            .fields()
            .iter()
            .map(|f| f.data_type().clone())
            .collect::<Vec<_>>(),
        vec![
            DataType::Utf8,
            DataType::Int64,
            DataType::Float64,
            DataType::Float64,
            DataType::Int64
        ]
    );
    let words = orders
        .flat_map(UdfCall::new("whitespace_tokenize", 1).with("column", "note"))
        .unwrap()
        .select(&["note"])
        .unwrap()
        .unique(&["note"])
        .unwrap();
    assert_eq!(
        words.schema().field(0),
        &Field::new("note", DataType::Utf8, false)
    );
    let shuffled = Dataset::range(100)
        .unwrap()
        .repartition(4)
        .unwrap()
        .repartition_by(2, &["id"])
        .unwrap()
        .random_shuffle(Some(3))
        .unwrap()
        .union(&Dataset::range(5).unwrap())
        .unwrap()
        .cache()
        .unwrap();
    assert_eq!(shuffled.column_names(), vec!["id"]);
    let sink = summary
        .write_parquet(dir.path().join("out"), WriteOptions::default())
        .unwrap();
    assert!(matches!(sink.plan().operator(), Operator::Write(_)));
    let json = Dataset::range(3)
        .unwrap()
        .write_json(
            dir.path().join("json"),
            WriteOptions {
                target_file_size: 1 << 20,
                ..WriteOptions::default()
            },
        )
        .unwrap();
    assert_eq!(json.plan().operator().name(), "write_json");
    assert_eq!(
        Dataset::range(3)
            .unwrap()
            .write_csv(dir.path().join("csv"), WriteOptions::default())
            .unwrap()
            .plan()
            .operator()
            .name(),
        "write_csv"
    );
}

#[test]
fn mistakes_fail_on_the_line_that_makes_them() {
    let dir = tempfile::tempdir().unwrap();
    let orders = orders(dir.path());
    let error = orders.filter(col("amont").gt(lit(1.0))).unwrap_err();
    assert_eq!(
        error.to_string(),
        "filter: unknown column \"amont\" (available: order_id Int64, customer Int64, amount \
         Float64, note Utf8)"
    );
    let error = orders.with_column("x", col("note") * lit(2)).unwrap_err();
    assert_eq!(
        error.to_string(),
        "with_column(\"x\"): * in (col(\"note\") * 2i32) needs numeric operands, got Utf8 and Int32"
    );
    let error = orders
        .join(&Dataset::range(3).unwrap(), &["customer"], JoinType::Inner)
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "join(inner): key \"customer\" is missing on the right side (available: id Int64 not null)"
    );
    let error = Dataset::read_parquet(&[dir.path().join("*.parquet")]).unwrap_err();
    assert!(error.to_string().starts_with("no files match"), "{error}");
    let error = Dataset::read(
        floe_client::FileFormat::Csv(Default::default()),
        &[dir.path()],
        Some(&["amount", "missing"]),
    )
    .unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("read_csv: unknown column \"missing\""),
        "{error}"
    );
}

#[test]
fn fingerprints_follow_files_and_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let build = |threshold: f64| {
        Dataset::read_csv(&[dir.path().join("orders.csv")])
            .unwrap()
            .filter(col("amount").gt(lit(threshold)))
            .unwrap()
    };
    orders(dir.path());
    let first = build(2.0);
    assert_eq!(first.fingerprint(), build(2.0).fingerprint());
    assert_ne!(first.fingerprint(), build(3.0).fingerprint());
    // Changing the file (its size) changes every fingerprint built on it.
    write_csv(
        &dir.path().join("orders.csv"),
        "order_id,customer,amount,note\n1,7,10.5,first order\n",
    );
    assert_ne!(first.fingerprint(), build(2.0).fingerprint());
    // Unseeded shuffles are resolved at submission: each resolution differs.
    let unseeded = Dataset::range(10).unwrap().random_shuffle(None).unwrap();
    let a = unseeded.plan().resolve_seeds().unwrap();
    let b = unseeded.plan().resolve_seeds().unwrap();
    assert_ne!(a.fingerprint(), b.fingerprint());
}

#[test]
fn explain_shows_pushdown_into_the_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("values.csv");
    write_csv(&path, "a,b,c\n1,2.5,x\n");
    let dataset = Dataset::read_csv(&[&path])
        .unwrap()
        .select(&["a", "b"])
        .unwrap()
        .limit(1)
        .unwrap();
    let text = dataset.explain().unwrap();
    let optimized = &text[text.find("== Optimized plan ==").unwrap()..];
    assert!(
        optimized.contains("read_csv files=1 projection=[a, b] limit=1"),
        "{text}"
    );
}

/// Reads CSV, transforms, writes Parquet, reads it back: every step checked against a
/// row-by-row computation of the same pipeline.
#[test]
fn a_pipeline_runs_in_process_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let mut csv = String::from("id,word,amount\n");
    let mut expected = Vec::new();
    for i in 0..200i64 {
        let word = if i % 4 == 0 {
            "Apple Pie".to_owned()
        } else {
            format!("w{i}")
        };
        let amount = i as f64 / 4.0;
        csv.push_str(&format!("{i},{word},{amount}\n"));
        if amount >= 10.0 && word.contains("Apple") {
            expected.push((i, word.to_lowercase(), amount * 2.0 + 1.0));
        }
    }
    write_csv(&dir.path().join("input.csv"), &csv);
    let out = dir.path().join("out");
    let written = Dataset::read_csv(&[dir.path().join("input.csv")])
        .unwrap()
        .filter(
            col("amount")
                .gt_eq(lit(10.0))
                .and(col("word").contains("Apple")),
        )
        .unwrap()
        .map_batches(UdfCall::new("lowercase_normalize", 1).with("column", "word"))
        .unwrap()
        .with_column("score", col("amount") * lit(2i64) + lit(1))
        .unwrap()
        .drop(&["amount"])
        .unwrap()
        .write_parquet(&out, WriteOptions::default())
        .unwrap()
        .execute_locally()
        .unwrap();
    assert_eq!(written.written, vec![out.join("part-00000-00000.parquet")]);

    let back = Dataset::read_parquet(&[&out]).unwrap();
    assert_eq!(back.column_names(), vec!["id", "word", "score"]);
    let batches = back.limit(1000).unwrap().execute_locally().unwrap().batches;
    let mut actual = Vec::new();
    for batch in &batches {
        let ids = batch
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        let words = batch
            .column(1)
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap();
        let scores = batch
            .column(2)
            .as_any()
            .downcast_ref::<arrow::array::Float64Array>()
            .unwrap();
        for row in 0..batch.num_rows() {
            actual.push((
                ids.value(row),
                words.value(row).to_owned(),
                scores.value(row),
            ));
        }
    }
    assert_eq!(actual, expected);
    assert_eq!(actual.len(), 40);

    // Shuffles need a cluster: refused with the operator's name.
    let error = Dataset::range(5)
        .unwrap()
        .sort(vec![SortKey::asc("id")])
        .unwrap()
        .execute_locally()
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "sort is not a row-wise operator; the shuffle executor runs it"
    );
}

#[test]
fn a_process_udf_needs_a_cluster_and_says_so() {
    let udf = floe_client::ProcessUdf::new("python3", &["/srv/udf.py"]);
    let dataset = Dataset::range(10)
        .unwrap()
        .map_batches_process(udf)
        .unwrap();
    assert_eq!(dataset.schema().fields().len(), 1, "the input's schema");
    let error = dataset.count().unwrap_err().to_string();
    assert!(
        error.contains("process UDFs run on a cluster's nodes"),
        "{error}"
    );
}
