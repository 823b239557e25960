//! The all-to-all kernels, run through the same partition-then-reduce flow the distributed
//! executor uses, against naive references over plain vectors and maps.
// Test helpers outside #[test] functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, BooleanArray, Date32Array, Float32Array, Float64Array, Int32Array, Int64Array,
    StringArray, UInt8Array,
};
use arrow::compute::{cast, concat_batches};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::RecordBatch;
use floe_core::hash::xxh3_64;
use floe_core::plan::task::StageInput;
use floe_core::plan::{AggFunction, Aggregation, JoinType, LogicalPlan, SortKey};
use floe_engine::blocks::BlockSizing;
use floe_engine::exchange::aggregate::aggregate;
use floe_engine::exchange::join::{JoinSide, join};
use floe_engine::exchange::keys::{hash_partition, most_frequent_key};
use floe_engine::exchange::random::{interleave, random_partition};
use floe_engine::exchange::repartition::split_by_position;
use floe_engine::exchange::sort::{range_boundaries, range_partition, sample_keys, sort_batches};
use floe_engine::exchange::unique::unique;
use floe_engine::task::TaskOutput;
use proptest::prelude::*;

const CASES: u32 = 64;

fn batch(columns: Vec<(&str, ArrayRef)>) -> RecordBatch {
    RecordBatch::try_from_iter_with_nullable(
        columns.into_iter().map(|(name, array)| (name, array, true)),
    )
    .unwrap()
}

fn int64s(values: impl IntoIterator<Item = Option<i64>>) -> ArrayRef {
    Arc::new(values.into_iter().collect::<Int64Array>())
}

fn int32s(values: impl IntoIterator<Item = Option<i32>>) -> ArrayRef {
    Arc::new(values.into_iter().collect::<Int32Array>())
}

fn float64s(values: impl IntoIterator<Item = Option<f64>>) -> ArrayRef {
    Arc::new(values.into_iter().collect::<Float64Array>())
}

fn strings(values: impl IntoIterator<Item = Option<String>>) -> ArrayRef {
    Arc::new(values.into_iter().collect::<StringArray>())
}

/// `batch` cut into `pieces` consecutive slices (some empty when rows are few).
fn split(batch: &RecordBatch, pieces: usize) -> Vec<RecordBatch> {
    let rows = batch.num_rows();
    (0..pieces)
        .map(|i| {
            let (from, to) = (rows * i / pieces, rows * (i + 1) / pieces);
            batch.slice(from, to - from)
        })
        .collect()
}

fn concat(schema: &SchemaRef, batches: &[RecordBatch]) -> RecordBatch {
    concat_batches(schema, batches).unwrap()
}

/// Column `name` of `batch` cast to Int64, as options.
fn ints(batch: &RecordBatch, name: &str) -> Vec<Option<i64>> {
    let column = cast(batch.column_by_name(name).unwrap(), &DataType::Int64).unwrap();
    let values = column.as_any().downcast_ref::<Int64Array>().unwrap();
    values.iter().collect()
}

/// Column `name` of `batch` cast to Float64, as options.
fn floats(batch: &RecordBatch, name: &str) -> Vec<Option<f64>> {
    let column = cast(batch.column_by_name(name).unwrap(), &DataType::Float64).unwrap();
    let values = column.as_any().downcast_ref::<Float64Array>().unwrap();
    values.iter().collect()
}

fn texts(batch: &RecordBatch, name: &str) -> Vec<Option<String>> {
    let column = batch.column_by_name(name).unwrap();
    let values = column.as_any().downcast_ref::<StringArray>().unwrap();
    values.iter().map(|v| v.map(str::to_owned)).collect()
}

/// Every column of `batch` cast to Int64, row by row.
fn int_rows(batch: &RecordBatch) -> Vec<Vec<Option<i64>>> {
    let columns: Vec<Vec<Option<i64>>> = batch
        .schema()
        .fields()
        .iter()
        .map(|f| ints(batch, f.name()))
        .collect();
    (0..batch.num_rows())
        .map(|row| columns.iter().map(|c| c[row]).collect())
        .collect()
}

/// A plan node with `schema` to derive operators' output schemas from, as the planner does.
fn plan_with(schema: &SchemaRef) -> LogicalPlan {
    LogicalPlan::from_ipc(schema.as_ref().clone(), Vec::new(), 0).unwrap()
}

fn schema_of(plan: &LogicalPlan) -> SchemaRef {
    Arc::new(plan.schema().clone())
}

/// Hash-partitions every batch into `n` partitions; the pieces of each partition, in order.
fn hash_split(batches: &[RecordBatch], keys: &[String], n: u32) -> Vec<Vec<RecordBatch>> {
    let mut parts = vec![Vec::new(); n as usize];
    for batch in batches {
        let pieces = hash_partition(batch, keys, n).unwrap();
        assert_eq!(pieces.len(), n as usize);
        for (part, piece) in parts.iter_mut().zip(pieces) {
            assert_eq!(piece.schema(), batch.schema());
            part.push(piece);
        }
    }
    parts
}

fn names(columns: &[&str]) -> Vec<String> {
    columns.iter().map(|c| (*c).to_owned()).collect()
}

// ---------------------------------------------------------------------------------------------
// aggregate

fn measures() -> Vec<Aggregation> {
    let mut aggregations = vec![Aggregation::count_rows("rows")];
    for column in ["v", "f"] {
        for function in AggFunction::ALL {
            aggregations.push(Aggregation::of(function, column));
        }
    }
    aggregations
}

type MeasureRow = (Option<i64>, Option<i64>, Option<f64>);

fn measure_batch(rows: &[MeasureRow]) -> RecordBatch {
    batch(vec![
        ("k", int64s(rows.iter().map(|r| r.0))),
        ("v", int64s(rows.iter().map(|r| r.1))),
        ("f", float64s(rows.iter().map(|r| r.2))),
    ])
}

/// What each aggregation of [`measures`] gives over `rows`, computed directly.
fn naive_measures(rows: &[&MeasureRow]) -> Vec<Option<f64>> {
    let mut result = vec![Some(rows.len() as f64)];
    let columns: [Vec<f64>; 2] = [
        rows.iter().filter_map(|r| r.1).map(|v| v as f64).collect(),
        rows.iter().filter_map(|r| r.2).collect(),
    ];
    for values in columns {
        let n = values.len();
        let sum: f64 = values.iter().sum();
        let mean = sum / n as f64;
        let squares: f64 = values.iter().map(|v| (v - mean) * (v - mean)).sum();
        let ordered = |a: &f64, b: &f64| a.partial_cmp(b).unwrap();
        let distinct: BTreeSet<u64> = values.iter().map(|v| v.to_bits()).collect();
        let some = |value: f64| (n > 0).then_some(value);
        result.extend([
            Some(n as f64),
            some(sum),
            some(mean),
            values.iter().copied().min_by(ordered),
            values.iter().copied().max_by(ordered),
            (n > 1).then(|| (squares / (n - 1) as f64).sqrt()),
            Some(distinct.len() as f64),
        ]);
    }
    result
}

fn assert_close(actual: &[Option<f64>], expected: &[Option<f64>], context: &str) {
    assert_eq!(actual.len(), expected.len(), "{context}");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        match (a, e) {
            (Some(a), Some(e)) => {
                let tolerance = 1e-9 * a.abs().max(e.abs()).max(1.0);
                assert!(
                    (a - e).abs() <= tolerance,
                    "{context}, aggregation {i}: {a} != {e}"
                );
            }
            _ => assert_eq!(a, e, "{context}, aggregation {i}"),
        }
    }
}

fn measure_row_strategy() -> impl Strategy<Value = MeasureRow> {
    (
        proptest::option::weighted(0.8, 0_i64..4),
        proptest::option::weighted(0.8, -50_i64..50),
        proptest::option::weighted(0.8, (-40_i32..40).prop_map(|x| f64::from(x) * 0.5)),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Hash partitioning by the key then aggregating each partition gives every group once,
    /// with every aggregate as computed directly; with no keys, one row over everything.
    #[test]
    fn aggregate_matches_a_naive_group_by(
        rows in proptest::collection::vec(measure_row_strategy(), 0..60),
        pieces in 1_usize..5,
    ) {
        let input = measure_batch(&rows);
        let schema = input.schema();
        let aggregations = measures();
        let output = schema_of(&plan_with(&schema).aggregate(&["k"], aggregations.clone()).unwrap());
        let keys = names(&["k"]);
        let mut groups: BTreeMap<Option<i64>, Vec<&MeasureRow>> = BTreeMap::new();
        for row in &rows {
            groups.entry(row.0).or_default().push(row);
        }

        let mut seen = BTreeSet::new();
        for part in hash_split(&split(&input, pieces), &keys, 3) {
            let result = aggregate(&part, &schema, &keys, &aggregations, &output).unwrap();
            prop_assert_eq!(result.schema(), output.clone());
            let measured: Vec<Vec<Option<f64>>> = aggregations
                .iter()
                .map(|a| floats(&result, &a.alias))
                .collect();
            for (row, key) in ints(&result, "k").into_iter().enumerate() {
                prop_assert!(seen.insert(key), "group {:?} in two partitions", key);
                let actual: Vec<Option<f64>> = measured.iter().map(|m| m[row]).collect();
                assert_close(&actual, &naive_measures(&groups[&key]), &format!("group {key:?}"));
            }
        }
        prop_assert_eq!(seen, groups.keys().copied().collect::<BTreeSet<_>>());

        let global = schema_of(&plan_with(&schema).aggregate(&[], aggregations.clone()).unwrap());
        let result = aggregate(&split(&input, pieces), &schema, &[], &aggregations, &global).unwrap();
        prop_assert_eq!(result.num_rows(), 1);
        let actual: Vec<Option<f64>> =
            aggregations.iter().map(|a| floats(&result, &a.alias)[0]).collect();
        let all: Vec<&MeasureRow> = rows.iter().collect();
        assert_close(&actual, &naive_measures(&all), "no keys");
    }
}

#[test]
fn aggregate_without_keys_over_no_input_is_one_row_of_zero_counts_and_nulls() {
    let schema = measure_batch(&[]).schema();
    let aggregations = measures();
    let output = schema_of(
        &plan_with(&schema)
            .aggregate(&[], aggregations.clone())
            .unwrap(),
    );
    let result = aggregate(&[], &schema, &[], &aggregations, &output).unwrap();
    assert_eq!(result.num_rows(), 1);
    let values: Vec<Option<f64>> = aggregations
        .iter()
        .map(|a| floats(&result, &a.alias)[0])
        .collect();
    assert_close(&values, &naive_measures(&[]), "empty input");
    let keyed = schema_of(
        &plan_with(&schema)
            .aggregate(&["k"], aggregations.clone())
            .unwrap(),
    );
    let result = aggregate(&[], &schema, &names(&["k"]), &aggregations, &keyed).unwrap();
    assert_eq!(result.num_rows(), 0);
    assert_eq!(result.schema(), keyed);
}

#[test]
fn aggregate_puts_all_rows_of_one_key_or_of_null_keys_in_one_group() {
    let aggregations = measures();
    for key in [Some(7), None] {
        let rows: Vec<MeasureRow> = (0..50)
            .map(|i| (key, Some(i), Some(f64::from(i as i32) / 4.0)))
            .collect();
        let input = measure_batch(&rows);
        let schema = input.schema();
        let output = schema_of(
            &plan_with(&schema)
                .aggregate(&["k"], aggregations.clone())
                .unwrap(),
        );
        let parts = hash_split(&split(&input, 4), &names(&["k"]), 4);
        let non_empty: Vec<&Vec<RecordBatch>> = parts
            .iter()
            .filter(|part| part.iter().any(|b| b.num_rows() > 0))
            .collect();
        assert_eq!(non_empty.len(), 1, "key {key:?}");
        let result = aggregate(
            non_empty[0],
            &schema,
            &names(&["k"]),
            &aggregations,
            &output,
        )
        .unwrap();
        assert_eq!(ints(&result, "k"), vec![key]);
        let values: Vec<Option<f64>> = aggregations
            .iter()
            .map(|a| floats(&result, &a.alias)[0])
            .collect();
        let all: Vec<&MeasureRow> = rows.iter().collect();
        assert_close(&values, &naive_measures(&all), "skewed");
    }
}

#[test]
fn aggregate_of_a_single_row_has_a_null_deviation() {
    let input = measure_batch(&[(Some(1), Some(5), Some(2.5))]);
    let schema = input.schema();
    let aggregations = measures();
    let output = schema_of(
        &plan_with(&schema)
            .aggregate(&["k"], aggregations.clone())
            .unwrap(),
    );
    let result = aggregate(&[input], &schema, &names(&["k"]), &aggregations, &output).unwrap();
    assert_eq!(result.num_rows(), 1);
    assert_eq!(floats(&result, "std_v"), vec![None]);
    assert_eq!(floats(&result, "sum_v"), vec![Some(5.0)]);
    assert_eq!(floats(&result, "min_f"), vec![Some(2.5)]);
}

#[test]
fn aggregate_sums_that_overflow_are_null_and_types_follow_the_schema() {
    let input = batch(vec![
        ("k", int64s([Some(1), Some(1), Some(2), Some(2)])),
        (
            "v",
            int64s([Some(i64::MAX), Some(1), Some(i64::MAX), Some(-1)]),
        ),
        (
            "u",
            Arc::new(UInt8Array::from(vec![200, 100, 1, 2])) as ArrayRef,
        ),
        (
            "s",
            strings(["b", "a", "c", "d"].map(|s| Some(s.to_owned()))),
        ),
        (
            "flag",
            Arc::new(BooleanArray::from(vec![
                Some(true),
                Some(false),
                None,
                None,
            ])) as ArrayRef,
        ),
        (
            "day",
            Arc::new(Date32Array::from(vec![Some(10), Some(3), None, Some(-4)])) as ArrayRef,
        ),
    ]);
    let schema = input.schema();
    let aggregations = vec![
        Aggregation::of(AggFunction::Sum, "v"),
        Aggregation::of(AggFunction::Sum, "u"),
        Aggregation::of(AggFunction::Min, "s"),
        Aggregation::of(AggFunction::Max, "s"),
        Aggregation::of(AggFunction::Min, "flag"),
        Aggregation::of(AggFunction::Max, "flag"),
        Aggregation::of(AggFunction::Min, "day"),
        Aggregation::of(AggFunction::Max, "day"),
    ];
    let output = schema_of(
        &plan_with(&schema)
            .aggregate(&["k"], aggregations.clone())
            .unwrap(),
    );
    let result = aggregate(
        &split(&input, 3),
        &schema,
        &names(&["k"]),
        &aggregations,
        &output,
    )
    .unwrap();
    assert_eq!(result.schema(), output);
    assert_eq!(ints(&result, "k"), vec![Some(1), Some(2)]);
    assert_eq!(ints(&result, "sum_v"), vec![None, Some(i64::MAX - 1)]);
    assert_eq!(ints(&result, "sum_u"), vec![Some(300), Some(3)]);
    let text = |name| texts(&result, name);
    assert_eq!(
        text("min_s"),
        vec![Some("a".to_owned()), Some("c".to_owned())]
    );
    assert_eq!(
        text("max_s"),
        vec![Some("b".to_owned()), Some("d".to_owned())]
    );
    let flags = |name: &str| {
        let column = result.column_by_name(name).unwrap();
        let values = column.as_any().downcast_ref::<BooleanArray>().unwrap();
        values.iter().collect::<Vec<_>>()
    };
    assert_eq!(flags("min_flag"), vec![Some(false), None]);
    assert_eq!(flags("max_flag"), vec![Some(true), None]);
    assert_eq!(ints(&result, "min_day"), vec![Some(3), Some(-4)]);
    assert_eq!(ints(&result, "max_day"), vec![Some(10), Some(-4)]);
}

// ---------------------------------------------------------------------------------------------
// sort

type SortRow = (Option<i64>, Option<String>, i64);

fn compare_nullable<T: Ord>(a: &Option<T>, b: &Option<T>, key: &SortKey) -> Ordering {
    match (a, b) {
        (None, None) => Ordering::Equal,
        (None, Some(_)) if key.nulls_first => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (Some(_), None) if key.nulls_first => Ordering::Greater,
        (Some(_), None) => Ordering::Less,
        (Some(a), Some(b)) if key.descending => b.cmp(a),
        (Some(a), Some(b)) => a.cmp(b),
    }
}

fn sort_key_strategy(column: &'static str) -> impl Strategy<Value = SortKey> {
    (any::<bool>(), any::<bool>()).prop_map(move |(descending, nulls_first)| SortKey {
        column: column.to_owned(),
        descending,
        nulls_first,
    })
}

fn sort_batch(rows: &[SortRow]) -> RecordBatch {
    batch(vec![
        ("a", int64s(rows.iter().map(|r| r.0))),
        ("b", strings(rows.iter().map(|r| r.1.clone()))),
        ("id", int64s(rows.iter().map(|r| Some(r.2)))),
    ])
}

fn sort_rows_of(batch: &RecordBatch) -> Vec<SortRow> {
    let (a, b, id) = (ints(batch, "a"), texts(batch, "b"), ints(batch, "id"));
    (0..batch.num_rows())
        .map(|i| (a[i], b[i].clone(), id[i].unwrap()))
        .collect()
}

/// The distributed sort in one process: sample each block, pick boundaries, range-partition
/// each block, sort each partition's pieces, and concatenate the partitions in order.
fn distributed_sort(
    blocks: &[RecordBatch],
    schema: &SchemaRef,
    keys: &[SortKey],
    sample: usize,
    n: u32,
) -> Vec<RecordBatch> {
    let samples: Vec<RecordBatch> = blocks
        .iter()
        .enumerate()
        .map(|(i, block)| sample_keys(block, keys, sample, i as u64).unwrap())
        .collect();
    let sample_schema = Arc::new(schema.project(&[0, 1]).unwrap());
    let boundaries = range_boundaries(&samples, &sample_schema, keys, n).unwrap();
    assert!(boundaries.num_rows() < n as usize);
    let mut parts = vec![Vec::new(); n as usize];
    for block in blocks {
        let pieces = range_partition(block, keys, &boundaries, n).unwrap();
        assert_eq!(pieces.len(), n as usize);
        for (part, piece) in parts.iter_mut().zip(pieces) {
            part.push(piece);
        }
    }
    parts
        .iter()
        .map(|pieces| sort_batches(pieces, schema, keys).unwrap())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Sample, boundaries, range partition and sort give the input stably sorted by both
    /// keys, whatever their directions and null placement.
    #[test]
    fn distributed_sort_matches_a_stable_sort(
        keys in proptest::collection::vec((
            proptest::option::weighted(0.8, 0_i64..5),
            proptest::option::weighted(0.8, proptest::sample::select(vec!["x", "y", "zz", ""])),
        ), 0..80),
        first in sort_key_strategy("a"),
        second in sort_key_strategy("b"),
        pieces in 1_usize..5,
        sample in 1_usize..12,
        n in 1_u32..6,
    ) {
        let rows: Vec<SortRow> = keys
            .into_iter()
            .enumerate()
            .map(|(id, (a, b))| (a, b.map(str::to_owned), id as i64))
            .collect();
        let input = sort_batch(&rows);
        let schema = input.schema();
        let keys = vec![first.clone(), second.clone()];
        let parts = distributed_sort(&split(&input, pieces), &schema, &keys, sample, n);

        let mut expected = rows.clone();
        expected.sort_by(|x, y| {
            compare_nullable(&x.0, &y.0, &first).then_with(|| compare_nullable(&x.1, &y.1, &second))
        });
        let actual: Vec<SortRow> = parts.iter().flat_map(sort_rows_of).collect();
        prop_assert_eq!(actual, expected);
    }
}

/// A row of the three-key sort: (a, b, c, id).
type ThreeKeyRow = (Option<i64>, Option<String>, Option<i32>, i64);

fn three_key_batch(rows: &[ThreeKeyRow]) -> RecordBatch {
    batch(vec![
        ("a", int64s(rows.iter().map(|r| r.0))),
        ("b", strings(rows.iter().map(|r| r.1.clone()))),
        ("c", int32s(rows.iter().map(|r| r.2))),
        ("id", int64s(rows.iter().map(|r| Some(r.3)))),
    ])
}

/// The whole sort through `exchange::run`, phase by phase as the executor runs it: a sample
/// and the boundaries, a range-partitioning map task per group of blocks, and a reduce task
/// per partition over every map task's piece.
fn sort_through_the_exchange(
    map_tasks: &[Vec<RecordBatch>],
    keys: &[SortKey],
    partitions: u32,
) -> Vec<RecordBatch> {
    let operator = floe_core::plan::Operator::Sort {
        keys: keys.to_vec(),
    };
    let schema = map_tasks[0][0].schema();
    let schemas = [schema.clone()];
    let samples: Vec<RecordBatch> = map_tasks
        .iter()
        .enumerate()
        .flat_map(|(i, blocks)| {
            let input = StageInput::Sample {
                rows: 7,
                seed: i as u64,
            };
            blocks_of(
                floe_engine::exchange::run(&operator, input, &schemas, vec![blocks.clone()])
                    .unwrap(),
            )
        })
        .collect();
    let input = StageInput::Boundaries { partitions };
    let boundaries =
        blocks_of(floe_engine::exchange::run(&operator, input, &schemas, vec![samples]).unwrap());
    let pieces: Vec<Vec<RecordBatch>> = map_tasks
        .iter()
        .map(|blocks| {
            let input = StageInput::RangePartition { partitions };
            let inputs = vec![blocks.clone(), boundaries.clone()];
            // The map side's partitions are packed into one object.
            let TaskOutput::Partitions(pieces) =
                floe_engine::exchange::run(&operator, input, &schemas, inputs).unwrap()
            else {
                panic!("a map task's output is not its partitions");
            };
            assert_eq!(pieces.len(), partitions as usize);
            pieces
                .into_batches()
                .unwrap()
                .into_iter()
                .map(|mut batches| {
                    assert_eq!(batches.len(), 1, "a partition is one block of one batch");
                    batches.pop().unwrap()
                })
                .collect()
        })
        .collect();
    (0..partitions as usize)
        .flat_map(|partition| {
            let input = StageInput::Reduce {
                partition: partition as u32,
                left: 0,
                seed: 0,
            };
            let inputs = pieces.iter().map(|p| vec![p[partition].clone()]).collect();
            floe_engine::exchange::reduce(&operator, &schema, input, &schemas, inputs)
                .unwrap()
                .into_blocks(&BlockSizing::default())
                .unwrap()
                .into_iter()
                .flat_map(|block| block.into_batches().unwrap())
        })
        .collect()
}

/// The batches of a task that makes blocks (not partitions).
fn blocks_of(output: TaskOutput) -> Vec<RecordBatch> {
    match output {
        TaskOutput::Blocks(blocks) => blocks
            .into_iter()
            .flat_map(|block| block.into_batches().unwrap())
            .collect(),
        other => panic!("expected blocks, got {other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// The sort exchange, map and reduce sides, against an independent stable sort of the same
    /// rows by three keys (with nulls, each ascending or descending, nulls first or last), with
    /// map tasks of several blocks each.
    #[test]
    fn sort_exchange_matches_an_independent_stable_sort(
        values in proptest::collection::vec((
            proptest::option::weighted(0.8, -3_i64..3),
            proptest::option::weighted(0.8, proptest::sample::select(vec!["p", "q", "qq", ""])),
            proptest::option::weighted(0.8, -20_i32..20),
        ), 1..200),
        first in sort_key_strategy("a"),
        second in sort_key_strategy("b"),
        third in sort_key_strategy("c"),
        map_tasks in 1_usize..4,
        blocks in 1_usize..4,
        partitions in 1_u32..6,
    ) {
        let rows: Vec<ThreeKeyRow> = values
            .into_iter()
            .enumerate()
            .map(|(id, (a, b, c))| (a, b.map(str::to_owned), c, id as i64))
            .collect();
        let input = three_key_batch(&rows);
        let map_tasks: Vec<Vec<RecordBatch>> = split(&input, map_tasks)
            .iter()
            .map(|task| split(task, blocks))
            .filter(|blocks| blocks.iter().any(|b| b.num_rows() > 0))
            .collect();
        let keys = vec![first.clone(), second.clone(), third.clone()];
        let output = sort_through_the_exchange(&map_tasks, &keys, partitions);

        let mut expected = rows.clone();
        expected.sort_by(|x, y| {
            compare_nullable(&x.0, &y.0, &first)
                .then_with(|| compare_nullable(&x.1, &y.1, &second))
                .then_with(|| compare_nullable(&x.2, &y.2, &third))
        });
        let expected_ids: Vec<Option<i64>> = expected.iter().map(|r| Some(r.3)).collect();
        let actual_ids: Vec<Option<i64>> = output.iter().flat_map(|b| ints(b, "id")).collect();
        prop_assert_eq!(actual_ids, expected_ids);
    }
}

#[test]
fn sort_of_one_repeated_key_fills_one_partition() {
    let rows: Vec<SortRow> = (0..40).map(|i| (Some(3), None, i)).collect();
    let input = sort_batch(&rows);
    let schema = input.schema();
    let keys = vec![SortKey::asc("a"), SortKey::desc("b")];
    let parts = distributed_sort(&split(&input, 3), &schema, &keys, 10, 4);
    let sizes: Vec<usize> = parts.iter().map(RecordBatch::num_rows).collect();
    assert_eq!(sizes.iter().filter(|&&s| s > 0).count(), 1, "{sizes:?}");
    let actual: Vec<SortRow> = parts.iter().flat_map(sort_rows_of).collect();
    assert_eq!(actual, rows);
}

#[test]
fn sort_kernels_handle_empty_input_and_a_single_row() {
    let schema = sort_batch(&[]).schema();
    let keys = vec![SortKey::asc("a"), SortKey::asc("b")];
    let sample_schema = Arc::new(schema.project(&[0, 1]).unwrap());
    let boundaries = range_boundaries(&[], &sample_schema, &keys, 4).unwrap();
    assert_eq!(boundaries.num_rows(), 0);
    assert_eq!(boundaries.schema(), sample_schema);
    let empty = RecordBatch::new_empty(schema.clone());
    assert_eq!(sample_keys(&empty, &keys, 5, 1).unwrap().num_rows(), 0);
    let pieces = range_partition(&empty, &keys, &boundaries, 4).unwrap();
    assert_eq!(pieces.len(), 4);
    assert!(pieces.iter().all(|p| p.num_rows() == 0));
    let merged = sort_batches(&[], &schema, &keys).unwrap();
    assert_eq!(merged.num_rows(), 0);
    assert_eq!(merged.schema(), schema);

    let one = sort_batch(&[(None, Some("x".to_owned()), 0)]);
    let parts = distributed_sort(std::slice::from_ref(&one), &schema, &keys, 3, 3);
    let sizes: Vec<usize> = parts.iter().map(RecordBatch::num_rows).collect();
    assert_eq!(sizes.iter().sum::<usize>(), 1);
    let actual: Vec<SortRow> = parts.iter().flat_map(sort_rows_of).collect();
    assert_eq!(actual, sort_rows_of(&one));
}

#[test]
fn range_partition_sends_rows_past_the_boundaries_to_the_last_partition() {
    let input = sort_batch(&(0..10).map(|i| (Some(9 - i), None, i)).collect::<Vec<_>>());
    let keys = vec![SortKey::asc("a")];
    let boundaries = batch(vec![("a", int64s([Some(2), Some(5)]))]);
    let pieces = range_partition(&input, &keys, &boundaries, 5).unwrap();
    let values: Vec<Vec<Option<i64>>> = pieces.iter().map(|p| ints(p, "a")).collect();
    // Each partition keeps the input's (descending) order: the reduce sorts.
    let expected: Vec<Vec<Option<i64>>> = vec![
        (0..=2).rev().map(Some).collect(),
        (3..=5).rev().map(Some).collect(),
        vec![],
        vec![],
        (6..=9).rev().map(Some).collect(),
    ];
    assert_eq!(values, expected);
}

#[test]
fn sample_keys_draws_distinct_rows_of_the_key_columns_the_same_way_for_a_seed() {
    let input = sort_batch(&(0..100).map(|i| (Some(i), None, i)).collect::<Vec<_>>());
    let keys = vec![SortKey::desc("a"), SortKey::asc("id")];
    let sample = sample_keys(&input, &keys, 10, 42).unwrap();
    let fields: Vec<&str> = sample
        .schema_ref()
        .fields()
        .iter()
        .map(|f| f.name().as_str())
        .collect();
    assert_eq!(fields, ["a", "id"]);
    assert_eq!(sample.num_rows(), 10);
    let drawn: BTreeSet<Option<i64>> = ints(&sample, "a").into_iter().collect();
    assert_eq!(drawn.len(), 10);
    assert_eq!(sample, sample_keys(&input, &keys, 10, 42).unwrap());
    assert_ne!(sample, sample_keys(&input, &keys, 10, 43).unwrap());
    assert_eq!(sample_keys(&input, &keys, 500, 1).unwrap().num_rows(), 100);
}

// ---------------------------------------------------------------------------------------------
// join

const JOIN_TYPES: [JoinType; 6] = [
    JoinType::Inner,
    JoinType::Left,
    JoinType::Right,
    JoinType::Full,
    JoinType::Semi,
    JoinType::Anti,
];

/// A join side's row: its key and an id (a column named `lv` on both sides, so the right one
/// comes out as `lv_right`).
type JoinRow = (Option<i64>, i64);

/// The output rows of a join, as [key, left id, right id] (or [key, left id] for semi and
/// anti), by nested loops.
fn naive_join(left: &[JoinRow], right: &[JoinRow], how: JoinType) -> Vec<Vec<Option<i64>>> {
    let matches = |l: &JoinRow, r: &JoinRow| l.0.is_some() && l.0 == r.0;
    let mut rows = Vec::new();
    for l in left {
        let matched: Vec<&JoinRow> = right.iter().filter(|r| matches(l, r)).collect();
        match how {
            JoinType::Semi if !matched.is_empty() => rows.push(vec![l.0, Some(l.1)]),
            JoinType::Anti if matched.is_empty() => rows.push(vec![l.0, Some(l.1)]),
            JoinType::Semi | JoinType::Anti => {}
            _ => {
                for r in &matched {
                    rows.push(vec![l.0, Some(l.1), Some(r.1)]);
                }
                if matched.is_empty() && matches!(how, JoinType::Left | JoinType::Full) {
                    rows.push(vec![l.0, Some(l.1), None]);
                }
            }
        }
    }
    if matches!(how, JoinType::Right | JoinType::Full) {
        for r in right {
            if !left.iter().any(|l| matches(l, r)) {
                rows.push(vec![r.0, None, Some(r.1)]);
            }
        }
    }
    rows.sort();
    rows
}

/// The left side keys its rows with an Int32 `k`, the right side with an Int64 `rk`.
fn join_sides(left: &[JoinRow], right: &[JoinRow]) -> (RecordBatch, RecordBatch) {
    let left = batch(vec![
        ("k", int32s(left.iter().map(|r| r.0.map(|k| k as i32)))),
        ("lv", int64s(left.iter().map(|r| Some(r.1)))),
    ]);
    let right = batch(vec![
        ("lv", int64s(right.iter().map(|r| Some(r.1)))),
        ("rk", int64s(right.iter().map(|r| r.0))),
    ]);
    (left, right)
}

/// Hash-partitions both sides into `n` partitions and joins each partition.
fn distributed_join(
    left: &RecordBatch,
    right: &RecordBatch,
    pieces: usize,
    n: u32,
    how: JoinType,
) -> Vec<Vec<Option<i64>>> {
    let (left_schema, right_schema) = (left.schema(), right.schema());
    let output = schema_of(
        &plan_with(&left_schema)
            .join(&plan_with(&right_schema), &["k"], &["rk"], how)
            .unwrap(),
    );
    let (left_keys, right_keys) = (names(&["k"]), names(&["rk"]));
    let left_parts = hash_split(&split(left, pieces), &left_keys, n);
    let right_parts = hash_split(&split(right, pieces), &right_keys, n);
    let mut rows = Vec::new();
    for (l, r) in left_parts.iter().zip(&right_parts) {
        let result = join(
            JoinSide {
                batches: l,
                schema: &left_schema,
                keys: &left_keys,
            },
            JoinSide {
                batches: r,
                schema: &right_schema,
                keys: &right_keys,
            },
            how,
            &output,
        )
        .unwrap();
        assert_eq!(result.schema(), output);
        rows.extend(int_rows(&result));
    }
    rows.sort();
    rows
}

fn join_row_strategy(size: usize) -> impl Strategy<Value = Vec<JoinRow>> {
    proptest::collection::vec(proptest::option::weighted(0.8, 0_i64..5), 0..size).prop_map(|keys| {
        keys.into_iter()
            .enumerate()
            .map(|(id, key)| (key, id as i64))
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Every join type, through hash partitioning of both sides (Int32 keys on the left,
    /// Int64 on the right), gives the nested-loop join's rows.
    #[test]
    fn distributed_join_matches_a_nested_loop_join(
        left in join_row_strategy(30),
        right in join_row_strategy(30),
        pieces in 1_usize..4,
        how in proptest::sample::select(JOIN_TYPES.to_vec()),
    ) {
        let (left_batch, right_batch) = join_sides(&left, &right);
        prop_assert_eq!(
            distributed_join(&left_batch, &right_batch, pieces, 3, how),
            naive_join(&left, &right, how)
        );
    }
}

#[test]
fn join_of_null_keys_matches_nothing_and_empty_sides_join() {
    let left: Vec<JoinRow> = (0..5).map(|i| (None, i)).collect();
    let right: Vec<JoinRow> = (0..3).map(|i| (None, i)).collect();
    let (left_batch, right_batch) = join_sides(&left, &right);
    for how in JOIN_TYPES {
        let expected = naive_join(&left, &right, how);
        assert_eq!(
            distributed_join(&left_batch, &right_batch, 2, 3, how),
            expected,
            "{how:?}"
        );
        let (empty_left, empty_right) = join_sides(&[], &[]);
        assert_eq!(
            distributed_join(&empty_left, &right_batch, 1, 2, how),
            naive_join(&[], &right, how)
        );
        assert_eq!(
            distributed_join(&left_batch, &empty_right, 1, 2, how),
            naive_join(&left, &[], how)
        );
    }
}

#[test]
fn join_of_one_key_everywhere_is_a_cross_product() {
    let left: Vec<JoinRow> = (0..6).map(|i| (Some(1), i)).collect();
    let right: Vec<JoinRow> = (0..7).map(|i| (Some(1), i)).collect();
    let (left_batch, right_batch) = join_sides(&left, &right);
    for how in JOIN_TYPES {
        let rows = distributed_join(&left_batch, &right_batch, 3, 4, how);
        assert_eq!(rows, naive_join(&left, &right, how), "{how:?}");
    }
    assert_eq!(
        distributed_join(&left_batch, &right_batch, 3, 4, JoinType::Inner).len(),
        42
    );
}

#[test]
fn right_join_rows_without_a_match_carry_the_right_key_in_the_left_type() {
    let (left, right) = join_sides(&[(Some(1), 0)], &[(Some(1), 10), (Some(4), 11)]);
    let output = schema_of(
        &plan_with(&left.schema())
            .join(&plan_with(&right.schema()), &["k"], &["rk"], JoinType::Full)
            .unwrap(),
    );
    let (left_keys, right_keys) = (names(&["k"]), names(&["rk"]));
    let result = join(
        JoinSide {
            batches: std::slice::from_ref(&left),
            schema: &left.schema(),
            keys: &left_keys,
        },
        JoinSide {
            batches: std::slice::from_ref(&right),
            schema: &right.schema(),
            keys: &right_keys,
        },
        JoinType::Full,
        &output,
    )
    .unwrap();
    assert_eq!(result.schema().field(0).data_type(), &DataType::Int32);
    assert_eq!(
        int_rows(&result),
        vec![
            vec![Some(1), Some(0), Some(10)],
            vec![Some(4), None, Some(11)]
        ]
    );
}

// ---------------------------------------------------------------------------------------------
// unique

type UniqueRow = (Option<i64>, Option<i64>, i64);

fn unique_batch(rows: &[UniqueRow]) -> RecordBatch {
    batch(vec![
        ("a", int64s(rows.iter().map(|r| r.0))),
        ("b", int64s(rows.iter().map(|r| r.1))),
        ("c", int64s(rows.iter().map(|r| Some(r.2)))),
    ])
}

/// The distinct projections of `rows` to `columns` (all when empty), in first-seen order.
fn naive_distinct(rows: &[UniqueRow], columns: &[&str]) -> Vec<Vec<Option<i64>>> {
    let mut seen = BTreeSet::new();
    let mut distinct = Vec::new();
    for row in rows {
        let value = |name: &str| match name {
            "a" => row.0,
            "b" => row.1,
            _ => Some(row.2),
        };
        let projected: Vec<Option<i64>> = if columns.is_empty() {
            ["a", "b", "c"].map(value).to_vec()
        } else {
            columns.iter().map(|c| value(c)).collect()
        };
        if seen.insert(projected.clone()) {
            distinct.push(projected);
        }
    }
    distinct
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Unique through hash partitioning gives each distinct row exactly once; over one
    /// partition it keeps first occurrences in input order.
    #[test]
    fn unique_matches_a_naive_distinct(
        rows in proptest::collection::vec((
            proptest::option::weighted(0.8, 0_i64..3),
            proptest::option::weighted(0.8, 0_i64..3),
            0_i64..2,
        ), 0..60),
        pieces in 1_usize..4,
        all_columns in any::<bool>(),
    ) {
        let columns: &[&str] = if all_columns { &[] } else { &["b", "a"] };
        let input = unique_batch(&rows);
        let schema = input.schema();
        let output = schema_of(&plan_with(&schema).unique(columns).unwrap());
        let hashed = if all_columns { names(&["a", "b", "c"]) } else { names(columns) };
        let mut actual = Vec::new();
        for part in hash_split(&split(&input, pieces), &hashed, 3) {
            let result = unique(&part, &schema, &names(columns), &output).unwrap();
            prop_assert_eq!(result.schema(), output.clone());
            actual.extend(int_rows(&result));
        }
        let expected = naive_distinct(&rows, columns);
        actual.sort();
        let mut sorted = expected.clone();
        sorted.sort();
        prop_assert_eq!(actual, sorted);

        let whole = unique(&split(&input, pieces), &schema, &names(columns), &output).unwrap();
        prop_assert_eq!(int_rows(&whole), expected);
    }
}

#[test]
fn unique_treats_signed_zeros_and_nans_as_one_value_each() {
    let values = [
        Some(0.0),
        Some(-0.0),
        Some(f64::NAN),
        Some(-f64::NAN),
        None,
        None,
    ];
    let input = batch(vec![("x", float64s(values))]);
    let schema = input.schema();
    let result = unique(&[input], &schema, &[], &schema).unwrap();
    let distinct = floats(&result, "x");
    assert_eq!(distinct.len(), 3);
    assert_eq!(distinct[0], Some(0.0));
    assert!(distinct[1].unwrap().is_nan());
    assert_eq!(distinct[2], None);
    assert_eq!(unique(&[], &schema, &[], &schema).unwrap().num_rows(), 0);
}

// ---------------------------------------------------------------------------------------------
// random shuffle

/// Random partitioning of each block (seeded per block, each part in an order of its own, as
/// the executor does), then each partition's parts interleaved: the ids in output order.
fn shuffled_ids(blocks: &[RecordBatch], n: u32, seed: u64) -> Vec<i64> {
    let schema = blocks[0].schema();
    let mut parts = vec![Vec::new(); n as usize];
    let mut offset = 0;
    for block in blocks {
        let pieces = random_partition(block, n, seed ^ offset).unwrap();
        assert_eq!(pieces.len(), n as usize);
        for (part, piece) in parts.iter_mut().zip(pieces) {
            part.push(piece);
        }
        offset += block.num_rows() as u64;
    }
    parts
        .iter()
        .flat_map(|pieces| {
            let permuted = interleave(pieces, &schema, seed).unwrap();
            assert_eq!(permuted.schema(), schema);
            ints(&permuted, "id").into_iter().map(Option::unwrap)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// A random shuffle is a permutation of its input, the same for the same seed and (for
    /// enough rows) a different one for another seed.
    #[test]
    fn random_shuffle_is_a_seeded_permutation(
        len in 0_usize..80,
        pieces in 1_usize..4,
        n in 1_u32..5,
        seed in any::<u64>(),
    ) {
        let input = batch(vec![
            ("id", int64s((0..len as i64).map(Some))),
            ("name", strings((0..len).map(|i| Some(format!("row {i}"))))),
        ]);
        let blocks = split(&input, pieces);
        let shuffled = shuffled_ids(&blocks, n, seed);
        let mut sorted = shuffled.clone();
        sorted.sort_unstable();
        prop_assert_eq!(sorted, (0..len as i64).collect::<Vec<_>>());
        prop_assert_eq!(&shuffled, &shuffled_ids(&blocks, n, seed));
        if len >= 20 {
            prop_assert_ne!(&shuffled, &shuffled_ids(&blocks, n, seed.wrapping_add(1)));
        }
    }
}

#[test]
fn shuffle_kernels_handle_empty_input_and_a_single_row() {
    let empty = batch(vec![("id", int64s([]))]);
    let schema = empty.schema();
    let pieces = random_partition(&empty, 3, 7).unwrap();
    assert_eq!(pieces.len(), 3);
    assert!(
        pieces
            .iter()
            .all(|p| p.num_rows() == 0 && p.schema() == schema)
    );
    assert_eq!(interleave(&[], &schema, 7).unwrap().num_rows(), 0);
    let one = batch(vec![("id", int64s([Some(5)]))]);
    assert_eq!(shuffled_ids(&[one], 4, 9), vec![5]);
}

// ---------------------------------------------------------------------------------------------
// repartition

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Splitting by position over blocks with running offsets gives partitions whose sizes
    /// differ from total / n by less than one, and that concatenate back to the input.
    #[test]
    fn split_by_position_makes_equal_partitions_in_order(
        sizes in proptest::collection::vec(0_usize..30, 1..6),
        n in 1_u32..8,
    ) {
        let total: usize = sizes.iter().sum();
        let input = batch(vec![("id", int64s((0..total as i64).map(Some)))]);
        let schema = input.schema();
        let mut parts = vec![Vec::new(); n as usize];
        let mut offset = 0;
        for size in &sizes {
            let block = input.slice(offset, *size);
            let pieces = split_by_position(&block, offset as u64, total as u64, n).unwrap();
            prop_assert_eq!(pieces.len(), n as usize);
            for (part, piece) in parts.iter_mut().zip(pieces) {
                part.push(piece);
            }
            offset += size;
        }
        let parts: Vec<RecordBatch> = parts.iter().map(|p| concat(&schema, p)).collect();
        let share = total as f64 / f64::from(n);
        for part in &parts {
            prop_assert!((part.num_rows() as f64 - share).abs() < 1.0, "{} rows, share {share}", part.num_rows());
        }
        prop_assert_eq!(concat(&schema, &parts), input);
    }

    /// Hash partitioning sends every key to exactly one partition, across blocks, keeps every
    /// row, and places a key the same whatever the width of its integer type.
    #[test]
    fn hash_partition_places_each_key_in_one_partition(
        keys in proptest::collection::vec(proptest::option::weighted(0.9, -20_i64..20), 0..80),
        pieces in 1_usize..4,
        n in 1_u32..6,
    ) {
        let wide = batch(vec![
            ("k", int64s(keys.iter().copied())),
            ("id", int64s((0..keys.len() as i64).map(Some))),
        ]);
        let narrow = batch(vec![
            ("k", int32s(keys.iter().map(|k| k.map(|k| k as i32)))),
            ("id", int64s((0..keys.len() as i64).map(Some))),
        ]);
        let placement = |input: &RecordBatch| {
            let mut partition_of: HashMap<i64, usize> = HashMap::new();
            let mut partitions_of: BTreeMap<Option<i64>, BTreeSet<usize>> = BTreeMap::new();
            for (p, part) in hash_split(&split(input, pieces), &names(&["k"]), n).iter().enumerate() {
                for piece in part {
                    for (k, id) in ints(piece, "k").into_iter().zip(ints(piece, "id")) {
                        assert!(partition_of.insert(id.unwrap(), p).is_none());
                        partitions_of.entry(k).or_default().insert(p);
                    }
                }
            }
            (partition_of, partitions_of)
        };
        let (rows, keys_placed) = placement(&wide);
        prop_assert_eq!(rows.len(), keys.len());
        prop_assert!(keys_placed.values().all(|p| p.len() == 1), "{:?}", keys_placed);
        prop_assert_eq!(placement(&narrow).0, rows);
    }
}

/// Arrow's row encoding of a non-null Int64 (what the partition hash is taken over): a
/// validity byte, then the value big-endian with its sign bit flipped. Nulls are a zero byte
/// and zeroed value bytes.
fn encoded_int64(value: Option<i64>) -> Vec<u8> {
    match value {
        Some(v) => {
            let mut bytes = vec![1];
            bytes.extend(((v as u64) ^ (1 << 63)).to_be_bytes());
            bytes
        }
        None => vec![0; 9],
    }
}

#[test]
fn hash_partition_is_xxh3_of_the_canonical_key_encoding() {
    let keys = [
        Some(0_i64),
        Some(1),
        Some(-1),
        Some(1 << 40),
        None,
        Some(i64::MIN),
    ];
    let n = 7_u32;
    let expected: Vec<usize> = keys
        .iter()
        .map(|k| ((u128::from(xxh3_64(&encoded_int64(*k))) * u128::from(n)) >> 64) as usize)
        .collect();
    let input = batch(vec![
        ("k", int64s(keys)),
        ("id", int64s((0..keys.len() as i64).map(Some))),
    ]);
    let mut actual = vec![usize::MAX; keys.len()];
    for (p, piece) in hash_partition(&input, &names(&["k"]), n)
        .unwrap()
        .iter()
        .enumerate()
    {
        for id in ints(piece, "id") {
            actual[id.unwrap() as usize] = p;
        }
    }
    assert_eq!(actual, expected);
}

#[test]
fn hash_partition_normalizes_integer_and_float_widths() {
    let n = 16;
    let place = |column: ArrayRef| -> Vec<usize> {
        let rows = column.len();
        let input = batch(vec![
            ("k", column),
            ("id", int64s((0..rows as i64).map(Some))),
        ]);
        let mut placed = vec![usize::MAX; rows];
        for (p, piece) in hash_partition(&input, &names(&["k"]), n)
            .unwrap()
            .iter()
            .enumerate()
        {
            for id in ints(piece, "id") {
                placed[id.unwrap() as usize] = p;
            }
        }
        placed
    };
    let small = [Some(0_u8), Some(3), None, Some(200), Some(17)];
    let wide = place(int64s(small.map(|v| v.map(i64::from))));
    assert_eq!(place(Arc::new(UInt8Array::from(small.to_vec()))), wide);
    assert_eq!(place(int32s(small.map(|v| v.map(i32::from)))), wide);

    let fractions = [
        Some(0.5_f32),
        Some(-2.25),
        None,
        Some(0.0),
        Some(-0.0),
        Some(f32::NAN),
    ];
    let doubles = place(float64s(fractions.map(|v| v.map(f64::from))));
    assert_eq!(
        place(Arc::new(Float32Array::from(fractions.to_vec()))),
        doubles
    );
    assert_eq!(doubles[3], doubles[4], "0.0 and -0.0 are one value");
}

#[test]
fn hash_partition_returns_every_partition_even_when_empty() {
    let input = batch(vec![("k", int64s([Some(1), Some(1), None, None]))]);
    for keys in [names(&["k"]), Vec::new()] {
        let pieces = hash_partition(&input, &keys, 5).unwrap();
        assert_eq!(pieces.len(), 5);
        assert_eq!(pieces.iter().map(RecordBatch::num_rows).sum::<usize>(), 4);
        assert!(pieces.iter().all(|p| p.schema() == input.schema()));
        assert!(pieces.iter().filter(|p| p.num_rows() > 0).count() <= 2);
    }
    assert_eq!(hash_partition(&input, &[], 5).unwrap()[0].num_rows(), 4);
    let empty = input.slice(0, 0);
    let pieces = hash_partition(&empty, &names(&["k"]), 3).unwrap();
    assert_eq!(pieces.len(), 3);
    assert!(pieces.iter().all(|p| p.num_rows() == 0));
    let pieces = split_by_position(&empty, 0, 0, 3).unwrap();
    assert_eq!(pieces.len(), 3);
}

#[test]
fn partitioning_into_no_partitions_or_past_the_dataset_is_an_error() {
    let input = batch(vec![("k", int64s([Some(1), Some(2)]))]);
    assert!(hash_partition(&input, &names(&["k"]), 0).is_err());
    assert!(random_partition(&input, 0, 1).is_err());
    assert!(split_by_position(&input, 0, 2, 0).is_err());
    assert!(split_by_position(&input, 1, 2, 2).is_err());
    assert!(hash_partition(&input, &names(&["missing"]), 2).is_err());
}

#[test]
fn the_most_frequent_key_is_named_with_its_count() {
    use arrow::array::{Array, Int64Array, StringArray};
    let keys = |values: Vec<Option<i64>>, names: Vec<&str>| {
        RecordBatch::try_from_iter([
            ("k", Arc::new(Int64Array::from(values)) as ArrayRef),
            ("s", Arc::new(StringArray::from(names)) as ArrayRef),
        ])
        .unwrap()
    };
    let batches = [
        keys(vec![Some(1), None, Some(2)], vec!["a", "b", "a"]),
        keys(vec![None, Some(2), None], vec!["b", "a", "b"]),
    ];
    let top = most_frequent_key(&batches, &names(&["k", "s"])).unwrap();
    let key = top.column_by_name("key").unwrap();
    let key = key.as_any().downcast_ref::<StringArray>().unwrap();
    let rows = top.column_by_name("rows").unwrap();
    let rows = rows.as_any().downcast_ref::<Int64Array>().unwrap();
    assert_eq!((key.value(0), rows.value(0)), ("k=null, s=b", 3));
    // A tie goes to the key seen first.
    let top = most_frequent_key(&batches, &names(&["s"])).unwrap();
    let key = top.column_by_name("key").unwrap();
    let key = key.as_any().downcast_ref::<StringArray>().unwrap();
    assert_eq!(key.value(0), "s=a");
    assert_eq!(
        most_frequent_key(&[], &names(&["k"])).unwrap().num_rows(),
        0
    );
}
