//! The optimizer never changes a result: random pipelines over a multi-row-group Parquet file
//! give the same rows with and without its rules (which push filters, projections and limits
//! into the read and fuse the rest).
// Test helpers outside #[test] functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, StringArray};
use arrow::compute::concat_batches;
use arrow::record_batch::RecordBatch;
use floe_core::expr::{col, lit};
use floe_core::plan::optimizer::Optimizer;
use floe_core::plan::physical::PhysicalPlan;
use floe_core::plan::{FileFormat, LogicalPlan};
use floe_engine::blocks::BlockSizing;
use floe_engine::local::execute;
use floe_engine::read::discover;
use floe_engine::task::TaskContext;
use floe_engine::udf::Registry;
use proptest::prelude::*;

fn write_input(path: &Path) {
    let rows = 300i64;
    let batch = RecordBatch::try_from_iter([
        (
            "a",
            Arc::new(Int64Array::from_iter_values(0..rows)) as ArrayRef,
        ),
        (
            "b",
            Arc::new(Int64Array::from_iter_values(
                (0..rows).map(|i| (i * 37) % 101),
            )) as ArrayRef,
        ),
        (
            "s",
            Arc::new(StringArray::from_iter_values(
                (0..rows).map(|i| format!("s{}", i % 7)),
            )) as ArrayRef,
        ),
    ])
    .unwrap();
    floe_testkit::files::write_parquet(path, &batch, Some(32));
}

/// One pipeline step, interpreted against the columns present when it is applied; a step the
/// builder rejects (it names a column that is gone) is skipped.
#[derive(Debug, Clone)]
enum Step {
    Filter { column: usize, threshold: i64 },
    Add { left: usize, right: usize },
    Select { keep_mask: u8 },
    Drop { column: usize },
    Rename { column: usize },
    Limit { n: u64 },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0usize..6, -10i64..310).prop_map(|(column, threshold)| Step::Filter { column, threshold }),
        (0usize..6, 0usize..6).prop_map(|(left, right)| Step::Add { left, right }),
        any::<u8>().prop_map(|keep_mask| Step::Select { keep_mask }),
        (0usize..6).prop_map(|column| Step::Drop { column }),
        (0usize..6).prop_map(|column| Step::Rename { column }),
        (0u64..400).prop_map(|n| Step::Limit { n }),
    ]
}

fn build(source: &LogicalPlan, steps: &[Step]) -> LogicalPlan {
    let mut plan = source.clone();
    for (index, step) in steps.iter().enumerate() {
        let names: Vec<String> = plan
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        let name = |i: usize| names[i % names.len()].clone();
        let next = match step {
            Step::Filter { column, threshold } => {
                plan.filter(col(name(*column)).gt_eq(lit(*threshold)))
            }
            Step::Add { left, right } => {
                plan.with_column(format!("c{index}"), col(name(*left)) + col(name(*right)))
            }
            Step::Select { keep_mask } => {
                let keep: Vec<&str> = names
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| keep_mask & (1 << (i % 8)) != 0)
                    .map(|(_, n)| n.as_str())
                    .collect();
                plan.select(&keep)
            }
            Step::Drop { column } => plan.drop_columns(&[&name(*column)]),
            Step::Rename { column } => {
                let from = name(*column);
                plan.rename(&[(&from, &format!("{from}_{index}"))])
            }
            Step::Limit { n } => plan.limit(*n),
        };
        // Invalid steps (unknown column, strings added, nothing selected) are the builder's
        // business; the property is about valid plans.
        if let Ok(next) = next
            && !next.schema().fields().is_empty()
        {
            plan = next;
        }
    }
    plan
}

fn run(plan: &LogicalPlan, registry: &Registry) -> RecordBatch {
    let context = TaskContext {
        registry,
        processes: &[],
        sizing: BlockSizing::default(),
        batch_rows: 50,
    };
    let output = execute(&PhysicalPlan::from_logical(plan), &context).unwrap();
    let schema = Arc::new(plan.schema().clone());
    let batches: Vec<RecordBatch> = output
        .batches
        .into_iter()
        .map(|b| RecordBatch::try_new(schema.clone(), b.columns().to_vec()).unwrap())
        .collect();
    concat_batches(&schema, &batches).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn optimized_plans_compute_the_same_rows(steps in prop::collection::vec(step(), 1..7)) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("input.parquet");
        write_input(&path);
        let source = LogicalPlan::read(discover(FileFormat::Parquet, &[&path]).unwrap()).unwrap();
        let plan = build(&source, &steps);
        let optimized = Optimizer::default().optimize(&plan).unwrap();
        prop_assert_eq!(optimized.schema(), plan.schema());
        let registry = Registry::empty();
        let expected = run(&plan, &registry);
        let actual = run(&optimized, &registry);
        prop_assert_eq!(actual, expected, "{}", optimized.display_tree());
    }
}

/// The property above is not vacuous: a typical pipeline is rewritten (filter, projection and
/// limit all move into the read) and still computes the same rows.
#[test]
fn a_rewritten_pipeline_computes_the_same_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("input.parquet");
    write_input(&path);
    let source = LogicalPlan::read(discover(FileFormat::Parquet, &[&path]).unwrap()).unwrap();
    let steps = [
        Step::Add { left: 0, right: 1 },
        Step::Filter {
            column: 0,
            threshold: 100,
        },
        Step::Select { keep_mask: 0b1001 },
        Step::Limit { n: 25 },
    ];
    let plan = build(&source, &steps);
    let optimized = Optimizer::default().optimize(&plan).unwrap();
    assert_ne!(optimized.fingerprint(), plan.fingerprint());
    let text = optimized.display_tree();
    assert!(
        text.contains("projection=[a, b] predicate=(col(\"a\") >= 100) limit=25"),
        "{text}"
    );
    let registry = Registry::empty();
    let result = run(&optimized, &registry);
    assert_eq!(result, run(&plan, &registry));
    assert_eq!(result.num_rows(), 25);
}
