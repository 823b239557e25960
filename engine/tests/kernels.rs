//! Row-wise kernels, UDFs, tasks and block sizing against independent computations.
// Test helpers outside #[test] functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, Float64Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use floe_core::expr::{col, lit};
use floe_core::plan::optimizer::Optimizer;
use floe_core::plan::physical::{PhysicalPlan, StageKind};
use floe_core::plan::task::StageInput;
use floe_core::plan::{LogicalPlan, PlanError, UdfCall, UdfKind};
use floe_engine::blocks::{BlockSizing, data_bytes};
use floe_engine::task::{TaskContext, decode_ipc, encode_ipc, run_task};
use floe_engine::udf::Registry;
use proptest::prelude::*;

fn context(registry: &Registry) -> TaskContext<'_> {
    TaskContext {
        registry,
        processes: &[],
        sizing: BlockSizing::default(),
        batch_rows: 7,
    }
}

fn people(rows: &[(i64, Option<String>, Option<f64>)]) -> RecordBatch {
    RecordBatch::try_from_iter([
        (
            "id",
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))) as ArrayRef,
        ),
        (
            "name",
            Arc::new(StringArray::from(
                rows.iter().map(|r| r.1.clone()).collect::<Vec<_>>(),
            )) as ArrayRef,
        ),
        (
            "score",
            Arc::new(Float64Array::from(
                rows.iter().map(|r| r.2).collect::<Vec<_>>(),
            )) as ArrayRef,
        ),
    ])
    .unwrap()
}

fn inline_plan(batch: &RecordBatch) -> LogicalPlan {
    let schema = batch.schema().as_ref().clone();
    let ipc = encode_ipc(&schema, std::slice::from_ref(batch)).unwrap();
    LogicalPlan::from_ipc(schema, ipc, batch.num_rows() as u64).unwrap()
}

/// Runs a plan whose stages are all sources, maps and limits, in-process, one task each.
fn run_locally(plan: &LogicalPlan, registry: &Registry) -> Vec<RecordBatch> {
    let physical = PhysicalPlan::from_logical(&Optimizer::default().optimize(plan).unwrap());
    let mut outputs: Vec<Vec<RecordBatch>> = Vec::new();
    for stage in &physical.stages {
        let (input, blocks) = match &stage.kind {
            StageKind::FromBatches { .. } => (StageInput::Inline, Vec::new()),
            StageKind::Range { n } => (StageInput::Range { start: 0, end: *n }, Vec::new()),
            _ => (StageInput::Blocks, outputs[stage.inputs[0].0].clone()),
        };
        outputs.push(run_task(stage, input, blocks, &context(registry)).unwrap());
    }
    outputs.swap_remove(physical.output.0)
}

fn column<'a, T: 'static>(batches: &'a [RecordBatch], name: &str) -> Vec<&'a T> {
    batches
        .iter()
        .map(|b| {
            b.column_by_name(name)
                .unwrap()
                .as_any()
                .downcast_ref::<T>()
                .unwrap()
        })
        .collect()
}

type Row = (i64, Option<String>, Option<f64>);

fn rows_strategy() -> impl Strategy<Value = Vec<Row>> {
    prop::collection::vec(
        (
            -50i64..50,
            prop::option::of("[a-z ]{0,5}"),
            prop::option::of(-10.0f64..10.0),
        ),
        0..30,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// with_column, filter, rename, drop, select, a map_batches UDF and limit, fused into one
    /// stage and run as tasks, against the same pipeline computed row by row.
    #[test]
    fn fused_row_pipeline_matches_row_by_row_reference(rows in rows_strategy(), limit in 0u64..20) {
        let registry = Registry::with_builtins();
        let plan = inline_plan(&people(&rows))
            .with_column("double", col("id") * lit(2i64))
            .unwrap()
            .filter(col("double").gt(lit(-20i64)).and(col("name").is_not_null()))
            .unwrap()
            .rename(&[("name", "label")])
            .unwrap()
            .drop_columns(&["id"])
            .unwrap()
            .udf(
                UdfCall::new("standardize", 1).with("column", "score").with("mean", 1.0).with("std", 2.0),
                UdfKind::RowPreserving,
                None,
                &registry,
            )
            .unwrap()
            .select(&["label", "score", "double"])
            .unwrap()
            .limit(limit)
            .unwrap();
        let physical = PhysicalPlan::from_logical(&Optimizer::default().optimize(&plan).unwrap());
        // The limit moves below the row-preserving operators (not below the filter), which
        // leaves two fused stages around it.
        let shape: Vec<(&str, usize)> = physical
            .stages
            .iter()
            .map(|s| (s.kind.name(), s.row_ops.len()))
            .collect();
        prop_assert_eq!(shape, vec![("from_batches", 2), ("limit", 0), ("map", 4)], "{}", physical);

        let expected: Vec<(Option<String>, Option<f64>, i64)> = rows
            .iter()
            .filter(|(id, name, _)| id * 2 > -20 && name.is_some())
            .map(|(id, name, score)| (name.clone(), score.map(|s| (s - 1.0) / 2.0), id * 2))
            .take(limit as usize)
            .collect();
        let batches = run_locally(&plan, &registry);
        let mut actual = Vec::new();
        for batch in &batches {
            let schema = batch.schema();
            prop_assert_eq!(schema.as_ref(), plan.schema());
        }
        for ((labels, scores), doubles) in column::<StringArray>(&batches, "label")
            .into_iter()
            .zip(column::<Float64Array>(&batches, "score"))
            .zip(column::<Int64Array>(&batches, "double"))
        {
            for i in 0..labels.len() {
                actual.push((
                    labels.is_valid(i).then(|| labels.value(i).to_owned()),
                    scores.is_valid(i).then(|| scores.value(i)),
                    doubles.value(i),
                ));
            }
        }
        prop_assert_eq!(actual, expected);
    }
}

#[test]
fn range_stage_produces_ids_in_batches() {
    let registry = Registry::empty();
    let plan = LogicalPlan::range(20)
        .unwrap()
        .filter((col("id") % lit(3i64)).eq(lit(0i64)))
        .unwrap();
    let batches = run_locally(&plan, &registry);
    let ids: Vec<i64> = column::<Int64Array>(&batches, "id")
        .iter()
        .flat_map(|a| a.values().to_vec())
        .collect();
    assert_eq!(ids, vec![0, 3, 6, 9, 12, 15, 18]);
    // Batches of 7 rows were produced, then coalesced into one block (all under 1 MiB).
    assert_eq!(batches.len(), 1);
}

#[test]
fn builtin_udfs_compute_what_their_docs_say() {
    let registry = Registry::with_builtins();
    let batch = people(&[
        (1, Some("  Hello   World ".into()), Some(3.0)),
        (2, None, None),
        (3, Some("ONE".into()), Some(1.0)),
        (4, Some("   ".into()), Some(5.0)),
    ]);
    let tokens = registry
        .apply(
            &UdfCall::new("whitespace_tokenize", 1).with("column", "name"),
            &batch,
        )
        .unwrap();
    let names: Vec<&str> = tokens
        .column(1)
        .as_any()
        .downcast_ref::<StringArray>()
        .unwrap()
        .iter()
        .map(|s| s.unwrap())
        .collect();
    let ids = tokens
        .column(0)
        .as_any()
        .downcast_ref::<Int64Array>()
        .unwrap();
    assert_eq!(names, vec!["Hello", "World", "ONE"]);
    assert_eq!(ids.values().to_vec(), vec![1, 1, 3]);

    let normalized = registry
        .apply(
            &UdfCall::new("lowercase_normalize", 1).with("column", "name"),
            &batch,
        )
        .unwrap();
    let names: Vec<Option<&str>> = normalized
        .column(1)
        .as_any()
        .downcast_ref::<StringArray>()
        .unwrap()
        .iter()
        .collect();
    assert_eq!(
        names,
        vec![Some("hello world"), None, Some("one"), Some("")]
    );

    let flat = registry
        .apply(
            &UdfCall::new("standardize", 1)
                .with("column", "score")
                .with("mean", 3.0)
                .with("std", 0.0),
            &batch,
        )
        .unwrap();
    assert_eq!(flat.column(2).null_count(), 4, "std = 0 gives null");
    let scaled = registry
        .apply(
            &UdfCall::new("standardize", 1)
                .with("column", "score")
                .with("mean", 3.0),
            &batch,
        )
        .unwrap();
    let values: Vec<Option<f64>> = scaled
        .column(2)
        .as_any()
        .downcast_ref::<Float64Array>()
        .unwrap()
        .iter()
        .collect();
    assert_eq!(values, vec![Some(0.0), None, Some(-2.0), Some(2.0)]);
}

#[test]
fn udf_calls_are_validated_when_the_plan_is_built() {
    let registry = Registry::with_builtins();
    let plan = inline_plan(&people(&[(1, None, None)]));
    let error = |result: Result<LogicalPlan, PlanError>| result.unwrap_err().to_string();
    assert_eq!(
        error(
            plan.udf(
                UdfCall::new("standardize", 1)
                    .with("column", "name")
                    .with("mean", 0.0),
                UdfKind::RowPreserving,
                None,
                &registry
            )
        ),
        "map_batches(standardize): expected a numeric column, but col(\"name\") has type Utf8"
    );
    assert_eq!(
        error(plan.udf(
            UdfCall::new("lowercase_normalize", 2).with("column", "name"),
            UdfKind::RowPreserving,
            None,
            &registry
        )),
        "map_batches(lowercase_normalize): unknown UDF \"lowercase_normalize\"@2 (registered: \
         whitespace_tokenize@1, lowercase_normalize@1, standardize@1, delay@1)"
    );
    let tokenized = plan
        .udf(
            UdfCall::new("whitespace_tokenize", 1).with("column", "name"),
            UdfKind::RowChanging,
            None,
            &registry,
        )
        .unwrap();
    assert_eq!(tokenized.operator().name(), "flat_map");
    // A worker binary re-checks the plan against its own registry.
    tokenized.check_udfs(&registry).unwrap();
    assert!(tokenized.check_udfs(&Registry::empty()).is_err());
    assert_eq!(
        tokenized.schema().field(1),
        &Field::new("name", DataType::Utf8, false)
    );
}

#[test]
fn a_limit_stage_passes_the_first_rows_of_its_stream() {
    let registry = Registry::empty();
    let blocks: Vec<RecordBatch> = (0..3)
        .map(|i| people(&[(i * 2, None, None), (i * 2 + 1, None, None)]))
        .collect();
    let plan = inline_plan(&blocks[0]).limit(3).unwrap();
    let physical = PhysicalPlan::from_logical(&plan);
    let limit = &physical.stages[1];
    assert_eq!(limit.kind, StageKind::Limit { n: 3 });
    let output = run_task(limit, StageInput::Blocks, blocks, &context(&registry)).unwrap();
    let ids: Vec<i64> = column::<Int64Array>(&output, "id")
        .iter()
        .flat_map(|a| a.values().to_vec())
        .collect();
    assert_eq!(ids, vec![0, 1, 2]);
    let error = run_task(limit, StageInput::Inline, Vec::new(), &context(&registry)).unwrap_err();
    assert_eq!(error.to_string(), "a limit stage cannot run on inline rows");
}

fn ints(rows: i64) -> RecordBatch {
    RecordBatch::try_from_iter([(
        "v",
        Arc::new(Int64Array::from_iter_values(0..rows)) as ArrayRef,
    )])
    .unwrap()
}

#[test]
fn grouped_batches_fill_blocks_up_to_the_maximum_without_a_copy() {
    let sizing = BlockSizing::new(100, 1000).unwrap();
    // 40, 400, 480 and 160 bytes: the first three fit 1000 (920); the fourth starts a block.
    let batches = vec![ints(5), ints(50), ints(60), ints(20)];
    let buffers: Vec<*const u8> = batches
        .iter()
        .map(|batch| batch.column(0).to_data().buffers()[0].as_ptr())
        .collect();
    let blocks = sizing.group(batches);
    let rows: Vec<Vec<usize>> = blocks
        .iter()
        .map(|block| block.iter().map(RecordBatch::num_rows).collect())
        .collect();
    assert_eq!(rows, vec![vec![5, 50, 60], vec![20]]);
    // The batches are the inputs themselves, not copies.
    let grouped: Vec<*const u8> = blocks
        .iter()
        .flatten()
        .map(|batch| batch.column(0).to_data().buffers()[0].as_ptr())
        .collect();
    assert_eq!(grouped, buffers);
    // A batch over the maximum is a block of its own; nothing makes no block.
    let rows: Vec<usize> = sizing
        .group(vec![ints(200), ints(5)])
        .iter()
        .map(Vec::len)
        .collect();
    assert_eq!(rows, vec![1, 1]);
    assert!(sizing.group(Vec::new()).is_empty());
}

#[test]
fn oversized_blocks_split_and_tiny_ones_coalesce() {
    // 8 bytes per row: 1000 rows are 8000 bytes.
    assert_eq!(data_bytes(&ints(1000)), 8000);
    assert_eq!(data_bytes(&ints(1000).slice(0, 10)), 80);
    let sizing = BlockSizing::new(100, 1000).unwrap();
    // 1500 bytes is exactly 1.5 × max: not split. 1508 is over: split into 2 pieces.
    assert_eq!(sizing.split(ints(187)).len(), 1);
    let pieces = sizing.split(ints(189));
    assert_eq!(
        pieces.iter().map(RecordBatch::num_rows).collect::<Vec<_>>(),
        vec![95, 94]
    );
    // 8000 bytes → 8 pieces of 125 rows, all rows kept in order.
    let pieces = sizing.split(ints(1000));
    assert_eq!(pieces.len(), 8);
    let values: Vec<i64> = pieces
        .iter()
        .flat_map(|p| {
            p.column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .values()
                .to_vec()
        })
        .collect();
    assert_eq!(values, (0..1000).collect::<Vec<_>>());
    // 5-row (40-byte) batches coalesce in threes (120 ≥ 100); the last run stays small.
    let coalesced = sizing.coalesce((0..7).map(|_| ints(5)).collect()).unwrap();
    assert_eq!(
        coalesced
            .iter()
            .map(RecordBatch::num_rows)
            .collect::<Vec<_>>(),
        vec![15, 15, 5]
    );
    // A batch that would push a run over the maximum starts a new run.
    let coalesced = sizing.coalesce(vec![ints(5), ints(121), ints(5)]).unwrap();
    assert_eq!(
        coalesced
            .iter()
            .map(RecordBatch::num_rows)
            .collect::<Vec<_>>(),
        vec![5, 121, 5]
    );
    // Reaching the maximum exactly is allowed.
    let coalesced = sizing.coalesce(vec![ints(5), ints(120)]).unwrap();
    assert_eq!(
        coalesced
            .iter()
            .map(RecordBatch::num_rows)
            .collect::<Vec<_>>(),
        vec![125]
    );
    let config = floe_core::config::ConfigLoader::new()
        .set("data.min_block_size=2KiB")
        .unwrap()
        .set("data.max_block_size=4MiB")
        .unwrap()
        .load()
        .unwrap();
    let configured = BlockSizing::from_config(&config.data).unwrap();
    assert_eq!(
        (configured.min_bytes(), configured.max_bytes()),
        (2048, 4 << 20)
    );
    assert_eq!(
        BlockSizing::from_config(&Default::default()).unwrap(),
        BlockSizing::default()
    );
    let error = floe_core::config::ConfigLoader::new()
        .set("data.min_block_size=8MiB")
        .unwrap()
        .set("data.max_block_size=4MiB")
        .unwrap()
        .load()
        .unwrap_err();
    assert!(error.to_string().contains("data.min_block_size"), "{error}");
    assert!(BlockSizing::new(0, 10).is_err());
    assert!(BlockSizing::new(11, 10).is_err());
}

#[test]
fn inline_batches_round_trip_through_ipc() {
    let batch = people(&[(1, Some("a".into()), Some(0.5)), (2, None, None)]);
    let schema = Schema::new(batch.schema().fields().clone());
    let bytes = encode_ipc(&schema, &[batch.clone(), batch.clone()]).unwrap();
    let decoded = decode_ipc(&bytes).unwrap();
    assert_eq!(decoded, vec![batch.clone(), batch]);
}
