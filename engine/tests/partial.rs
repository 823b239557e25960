//! Partial aggregation equals aggregating every row at once, however the rows are split.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, Float64Array, Int64Array, RecordBatch};
use arrow::compute::{SortColumn, lexsort_to_indices, take_record_batch};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use floe_core::plan::{AggFunction, Aggregation, LogicalPlan};
use floe_engine::exchange::aggregate::aggregate;
use floe_engine::exchange::aggregate::partial::{
    final_aggregate, partial_aggregate, partial_schema,
};
use proptest::prelude::*;

fn input_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, true),
        Field::new("i", DataType::Int64, true),
        Field::new("f", DataType::Float64, true),
    ]))
}

fn aggregations() -> Vec<Aggregation> {
    let mut all = vec![Aggregation::count_rows("rows")];
    for function in [
        AggFunction::Count,
        AggFunction::Sum,
        AggFunction::Min,
        AggFunction::Max,
        AggFunction::Mean,
        AggFunction::Std,
    ] {
        all.push(Aggregation::of(function, "i"));
        all.push(Aggregation::of(function, "f"));
    }
    all
}

fn output_schema(keys: &[&str]) -> SchemaRef {
    let plan = LogicalPlan::from_ipc(input_schema().as_ref().clone(), Vec::new(), 0).unwrap();
    let aggregated = plan.aggregate(keys, aggregations()).unwrap();
    Arc::new(aggregated.schema().clone())
}

type Row = (Option<i64>, Option<i64>, Option<f64>);

fn batch(rows: &[Row]) -> RecordBatch {
    let columns: Vec<ArrayRef> = vec![
        Arc::new(rows.iter().map(|r| r.0).collect::<Int64Array>()),
        Arc::new(rows.iter().map(|r| r.1).collect::<Int64Array>()),
        Arc::new(rows.iter().map(|r| r.2).collect::<Float64Array>()),
    ];
    RecordBatch::try_new(input_schema(), columns).unwrap()
}

/// Both results sorted by key, so they compare row by row.
fn sorted(batch: &RecordBatch) -> RecordBatch {
    if batch.num_columns() == 0 || batch.schema().field(0).name() != "k" {
        return batch.clone();
    }
    let indices = lexsort_to_indices(
        &[SortColumn {
            values: batch.column(0).clone(),
            options: None,
        }],
        None,
    )
    .unwrap();
    take_record_batch(batch, &indices).unwrap()
}

fn assert_close(partial: &RecordBatch, whole: &RecordBatch) {
    assert_eq!(partial.schema(), whole.schema());
    assert_eq!(partial.num_rows(), whole.num_rows());
    for (index, field) in whole.schema().fields().iter().enumerate() {
        let (got, want) = (partial.column(index), whole.column(index));
        if field.data_type() == &DataType::Float64 {
            let got = got.as_any().downcast_ref::<Float64Array>().unwrap();
            let want = want.as_any().downcast_ref::<Float64Array>().unwrap();
            for row in 0..want.len() {
                assert_eq!(
                    got.is_null(row),
                    want.is_null(row),
                    "{} row {row}",
                    field.name()
                );
                if want.is_valid(row) {
                    let (a, b) = (got.value(row), want.value(row));
                    assert!(
                        (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                        "{} row {row}: {a} vs {b}",
                        field.name()
                    );
                }
            }
        } else {
            assert_eq!(got.as_ref(), want.as_ref(), "{}", field.name());
        }
    }
}

/// Aggregates `pieces` partially, then combines, against aggregating them all at once.
fn check(pieces: &[Vec<Row>], keys: &[&str]) {
    let keys_owned: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
    let output = output_schema(keys);
    let batches: Vec<RecordBatch> = pieces.iter().map(|rows| batch(rows)).collect();
    let whole = aggregate(
        &batches,
        &input_schema(),
        &keys_owned,
        &aggregations(),
        &output,
    )
    .unwrap();
    let partials: Vec<RecordBatch> = batches
        .iter()
        .map(|piece| {
            partial_aggregate(
                std::slice::from_ref(piece),
                &input_schema(),
                &keys_owned,
                &aggregations(),
            )
            .unwrap()
        })
        .collect();
    let schema = partial_schema(&input_schema(), &keys_owned, &aggregations()).unwrap();
    let combined =
        final_aggregate(&partials, &schema, &keys_owned, &aggregations(), &output).unwrap();
    assert_close(&sorted(&combined), &sorted(&whole));
}

fn row() -> impl Strategy<Value = Row> {
    (
        proptest::option::weighted(0.9, 0..6i64),
        proptest::option::weighted(0.8, -1_000..1_000i64),
        proptest::option::weighted(0.8, -1e3..1e3f64),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn partial_then_final_equals_one_aggregate(
        pieces in proptest::collection::vec(proptest::collection::vec(row(), 0..40), 1..5),
    ) {
        check(&pieces, &["k"]);
        check(&pieces, &[]);
    }
}

#[test]
fn an_overflowing_partial_sum_makes_the_group_sum_null() {
    let big = Some(i64::MAX - 1);
    // Each piece alone overflows in one group; the other group is fine.
    let pieces = vec![
        vec![
            (Some(1), big, None),
            (Some(1), big, None),
            (Some(2), Some(5), None),
        ],
        vec![(Some(1), Some(-3), None), (Some(2), Some(7), None)],
    ];
    check(&pieces, &["k"]);
    let output = output_schema(&["k"]);
    let keys = vec!["k".to_owned()];
    let partials: Vec<RecordBatch> = pieces
        .iter()
        .map(|rows| {
            partial_aggregate(&[batch(rows)], &input_schema(), &keys, &aggregations()).unwrap()
        })
        .collect();
    let schema = partial_schema(&input_schema(), &keys, &aggregations()).unwrap();
    let combined =
        sorted(&final_aggregate(&partials, &schema, &keys, &aggregations(), &output).unwrap());
    let sums = combined.column_by_name("sum_i").unwrap();
    let sums = sums.as_any().downcast_ref::<Int64Array>().unwrap();
    assert!(sums.is_null(0), "the overflowing group");
    assert_eq!(sums.value(1), 12);
}
