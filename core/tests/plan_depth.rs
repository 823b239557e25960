//! Long plans, fuzzed: chains of 10 to 30,000 steps, built through the plan API and decoded
//! from bytes, are either accepted (and then encode, decode, optimize, plan and print) or
//! refused with an error naming the limit — never a stack overflow. Everything runs on a
//! thread with a 512 KiB stack, a quarter of a tokio worker's: the deepest plan that can be
//! built needs about 450 KiB in a debug build (far less optimized), and a recursive walk that
//! grew with the plan would overflow here at a few hundred steps, loudly.

#![allow(clippy::unwrap_used)]

use arrow_schema::{DataType, Field, Schema};
use floe_core::expr::{Expr, col, lit};
use floe_core::fingerprint::{ArgValue, FileStamp};
use floe_core::job::{JobOptions, JobSpec};
use floe_core::plan::optimizer::Optimizer;
use floe_core::plan::physical::{PhysicalPlan, Stage};
use floe_core::plan::{
    FileFormat, FileScan, LogicalPlan, MAX_EXPR_DEPTH, MAX_PLAN_DEPTH, Operator, PlanError, SortKey,
};
use floe_core::wire::codec;
use floe_core::wire::nesting::MAX_DECODE_NESTING;
use proptest::prelude::*;

const SMALL_STACK: usize = 512 * 1024;

/// Runs `work` on a thread with a small stack; an overflow aborts the test binary.
fn on_small_stack<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .stack_size(SMALL_STACK)
        .spawn(work)
        .unwrap()
        .join()
        .unwrap()
}

/// `id + 1 + 1 …`: an Int64 expression nested `depth` levels.
fn int_expr(depth: u32) -> Expr {
    (0..depth).fold(col("id"), |expr, _| expr + lit(1i64))
}

/// A Boolean predicate nested `depth` levels (at least 1).
fn predicate(depth: u32) -> Expr {
    int_expr(depth - 1).gt(lit(0i64))
}

fn parquet_read(predicate: Option<Expr>) -> LogicalPlan {
    let schema = Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("name", DataType::Utf8, true),
    ]);
    let stamp = FileStamp {
        path: "/data/part-0.parquet".into(),
        size: 100,
        modified_secs: 1_700_000_000,
        modified_nanos: 0,
        version: None,
    };
    let mut scan = FileScan::new(FileFormat::Parquet, vec![stamp], schema);
    scan.predicate = predicate;
    LogicalPlan::read(scan).unwrap()
}

/// Step `index` of a long pipeline: a dozen kinds of step, each keeping the column `id`.
fn step(plan: &LogicalPlan, index: usize, expr_depth: u32) -> Result<LogicalPlan, PlanError> {
    match index % 10 {
        0 => plan.filter(predicate(expr_depth.max(1))),
        1 => plan.with_column(format!("c{}", index % 3), int_expr(expr_depth)),
        2 => plan.sort(vec![SortKey::asc("id")]),
        3 => plan.limit(1_000_000 - index as u64),
        4 => plan.rename(&[("id", "id")]),
        5 => plan.repartition(4, &["id"]),
        6 => plan.random_shuffle(Some(index as u64)),
        7 => plan.unique(&[]),
        8 => plan.cache(),
        _ => plan.filter(col("id").is_not_null()),
    }
}

/// Builds `source` and then `steps` steps, stopping at the first refusal: the plan and,
/// when a step was refused, its index and the error.
fn build(
    source: LogicalPlan,
    steps: usize,
    expr_depth: u32,
) -> (LogicalPlan, Option<(usize, PlanError)>) {
    let mut plan = source;
    for index in 0..steps {
        match step(&plan, index, expr_depth) {
            Ok(next) => plan = next,
            Err(error) => return (plan, Some((index, error))),
        }
    }
    (plan, None)
}

fn options() -> JobOptions {
    JobOptions::default()
}

/// Every pass a job makes over an accepted plan, as the client, the scheduler and the
/// driver make them.
fn exercise(plan: &LogicalPlan) {
    let resolved = plan.resolve_seeds().unwrap();
    resolved.check_resolved().unwrap();
    let bytes = JobSpec {
        plan: resolved.clone(),
        options: options(),
    }
    .encode()
    .unwrap();
    let decoded = JobSpec::decode(&bytes).unwrap().plan;
    assert_eq!(decoded.fingerprint(), resolved.fingerprint());
    assert_eq!(decoded.depth(), resolved.depth());
    assert!(!decoded.display_tree().is_empty());
    assert_eq!(
        decoded.lineage().unwrap().fingerprint(),
        decoded.fingerprint()
    );
    let optimized = Optimizer::default().optimize(&decoded).unwrap();
    assert!(optimized.depth() <= decoded.depth());
    let physical = PhysicalPlan::from_logical(&optimized);
    // Stages travel to workers inside tasks.
    for stage in &physical.stages {
        let back: Stage = codec::decode(&codec::encode(stage).unwrap(), "stage").unwrap();
        assert_eq!(&back, stage);
    }
    assert!(decoded.explain().unwrap().contains("== Physical plan =="));
}

fn assert_too_deep(refused: Option<(usize, PlanError)>, steps: usize) {
    let (index, error) = refused.unwrap_or_else(|| panic!("{steps} steps were accepted"));
    // The source is the first operator, so step index MAX_PLAN_DEPTH - 1 is one too many.
    assert_eq!(index, MAX_PLAN_DEPTH as usize - 1, "{error}");
    assert!(
        matches!(error, PlanError::PlanTooDeep { depth, limit, .. }
            if depth == MAX_PLAN_DEPTH + 1 && limit == MAX_PLAN_DEPTH),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains(&format!("at most {MAX_PLAN_DEPTH} are allowed")),
        "{message}"
    );
}

#[test]
fn chains_of_10_to_30000_steps_are_accepted_or_refused_at_the_limit() {
    on_small_stack(|| {
        for steps in [10, 63, 64, 1_000, 5_000, 30_000] {
            let (plan, refused) = build(LogicalPlan::range(1_000).unwrap(), steps, 3);
            if steps < MAX_PLAN_DEPTH as usize {
                assert!(refused.is_none(), "{steps}: {refused:?}");
                assert_eq!(plan.depth() as usize, steps + 1);
                exercise(&plan);
            } else {
                assert_too_deep(refused, steps);
                // What was built up to the limit is a whole plan that still works.
                assert_eq!(plan.depth(), MAX_PLAN_DEPTH);
                exercise(&plan);
            }
        }
    });
}

#[test]
fn the_deepest_plan_that_can_be_built_decodes_optimizes_and_plans() {
    on_small_stack(|| {
        // The source, the farthest node from the root, holds the deepest expression: that is
        // the longest path the decoder walks.
        let source = parquet_read(Some(predicate(MAX_EXPR_DEPTH)));
        let mut plan = source;
        for index in 1..MAX_PLAN_DEPTH {
            plan = if index % 2 == 0 {
                plan.filter(predicate(MAX_EXPR_DEPTH)).unwrap()
            } else {
                plan.with_column("deep", int_expr(MAX_EXPR_DEPTH)).unwrap()
            };
        }
        assert_eq!(plan.depth(), MAX_PLAN_DEPTH);
        exercise(&plan);
        // The optimizer merges filters only while the merged predicate fits; every
        // expression it leaves is within the limit.
        let optimized = Optimizer::default().optimize(&plan).unwrap();
        let mut pending = vec![optimized];
        while let Some(node) = pending.pop() {
            for expr in node.operator().expressions() {
                assert!(expr.depth() <= MAX_EXPR_DEPTH, "{}", node.operator().name());
            }
            pending.extend(node.inputs().iter().cloned());
        }
        // One step more is refused.
        let error = plan.limit(1).unwrap_err();
        assert!(matches!(error, PlanError::PlanTooDeep { .. }), "{error}");
    });
}

#[test]
fn a_long_chain_of_filters_merges_into_the_read_as_far_as_the_limit_allows() {
    on_small_stack(|| {
        let mut shallow = parquet_read(None);
        for bound in 0..i64::from(MAX_PLAN_DEPTH) - 1 {
            shallow = shallow.filter(col("id").gt(lit(bound))).unwrap();
        }
        let optimized = Optimizer::default().optimize(&shallow).unwrap();
        // 63 one-level predicates nest 63 levels once joined by `and`: all of them fit.
        assert_eq!(optimized.depth(), 1, "{}", optimized.display_tree());
        let Operator::Read(scan) = optimized.operator() else {
            panic!("{}", optimized.display_tree());
        };
        assert_eq!(scan.predicate.as_ref().unwrap().depth(), 63);

        // 40 predicates of 30 levels would nest 69 levels joined: some stay apart.
        let mut deep = parquet_read(None);
        for _ in 0..40 {
            deep = deep.filter(predicate(30)).unwrap();
        }
        let optimized = Optimizer::default().optimize(&deep).unwrap();
        assert!(optimized.depth() > 1, "{}", optimized.display_tree());
        exercise(&optimized);
    });
}

#[test]
fn expressions_deeper_than_the_limit_are_refused_before_they_are_walked() {
    on_small_stack(|| {
        let range = LogicalPlan::range(10).unwrap();
        assert!(range.filter(predicate(MAX_EXPR_DEPTH)).is_ok());
        for depth in [MAX_EXPR_DEPTH + 1, 500] {
            for error in [
                range.filter(predicate(depth)).unwrap_err(),
                range.with_column("x", int_expr(depth)).unwrap_err(),
            ] {
                assert!(
                    matches!(error, PlanError::ExpressionTooDeep { depth: found, limit, .. }
                        if found == depth && limit == MAX_EXPR_DEPTH),
                    "{error:?}"
                );
                assert!(
                    error.to_string().contains("at most 64 are allowed"),
                    "{error}"
                );
            }
        }
        let scan_error = LogicalPlan::read({
            let Operator::Read(mut scan) = parquet_read(None).operator().clone() else {
                unreachable!()
            };
            scan.predicate = Some(predicate(MAX_EXPR_DEPTH + 1));
            scan
        })
        .unwrap_err();
        assert!(
            matches!(scan_error, PlanError::ExpressionTooDeep { .. }),
            "{scan_error}"
        );
        // Measuring depth does not recurse: an expression far deeper than any stack holds.
        let huge = int_expr(200_000);
        assert_eq!(huge.depth(), 200_000);
        // Dropping it would recurse (a `Box` chain); the test leaks it instead.
        std::mem::forget(huge);
    });
}

/// The bytes of a job spec whose plan is `range(10)` under `filters` filter steps, made by
/// hand: no plan that deep can be built to encode it.
fn chain_bytes(filters: usize) -> Vec<u8> {
    let leaf = LogicalPlan::range(10).unwrap();
    let filter = Operator::Filter {
        predicate: col("id").gt(lit(1i64)),
    };
    let mut node_head = codec::encode(&filter).unwrap();
    node_head.extend(codec::encode(&1u64).unwrap()); // one input
    let mut node_tail = codec::encode(leaf.schema()).unwrap();
    node_tail.extend(codec::encode(&leaf.fingerprint()).unwrap());
    let mut bytes = node_head.repeat(filters);
    bytes.extend(codec::encode(&leaf).unwrap());
    bytes.extend(node_tail.repeat(filters));
    bytes.extend(codec::encode(&options()).unwrap());
    bytes
}

#[test]
fn long_chains_on_the_wire_decode_or_are_refused() {
    on_small_stack(|| {
        // The hand-made bytes decode to the plan the builder makes: the decoder rebuilds
        // every node, so the schemas and fingerprints recorded in the bytes are not trusted.
        let built = (0..9).fold(LogicalPlan::range(10).unwrap(), |plan, _| {
            plan.filter(col("id").gt(lit(1i64))).unwrap()
        });
        let decoded = JobSpec::decode(&chain_bytes(9)).unwrap().plan;
        assert_eq!(decoded.fingerprint(), built.fingerprint());

        for filters in [9, 63, 64, 100, 127, 128, 1_000, 5_000, 30_000] {
            let result = JobSpec::decode(&chain_bytes(filters));
            if filters < MAX_PLAN_DEPTH as usize {
                assert_eq!(result.unwrap().plan.depth() as usize, filters + 1);
                continue;
            }
            let message = result.unwrap_err().to_string();
            let refused_by_plan = message.contains(&format!("at most {MAX_PLAN_DEPTH}"));
            let refused_by_decoder =
                message.contains(&format!("more than {MAX_DECODE_NESTING} levels deep"));
            assert!(
                if filters < MAX_DECODE_NESTING as usize {
                    refused_by_plan
                } else {
                    refused_by_decoder
                },
                "{filters}: {message}"
            );
        }
    });
}

#[test]
fn deeply_nested_argument_values_are_refused_by_the_decoder() {
    on_small_stack(|| {
        let list = codec::encode(&ArgValue::List(vec![ArgValue::Null])).unwrap();
        let (open, null) = list.split_at(list.len() - 1);
        for levels in [10usize, 100_000] {
            let mut bytes = open.repeat(levels);
            bytes.extend_from_slice(null);
            let decoded = codec::decode::<ArgValue>(&bytes, "argument");
            if levels <= MAX_DECODE_NESTING as usize {
                assert!(decoded.is_ok(), "{levels}: {decoded:?}");
            } else {
                let message = decoded.unwrap_err().to_string();
                assert!(message.contains("levels deep"), "{message}");
            }
        }
    });
}

/// A random pipeline: up to 200 steps of random kinds, with expressions up to 80 deep.
fn pipeline() -> impl Strategy<Value = (Vec<(u8, u32)>, bool)> {
    (
        prop::collection::vec((any::<u8>(), 0u32..80), 0..200),
        any::<bool>(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the steps, building succeeds exactly while the plan and each expression fit,
    /// and whatever was built survives every pass on a small stack.
    #[test]
    fn random_long_pipelines_fit_or_are_refused((steps, parquet) in pipeline()) {
        let outcome = on_small_stack(move || {
            let mut plan = if parquet { parquet_read(None) } else { LogicalPlan::range(100).unwrap() };
            let mut refusal = None;
            for (kind, expr_depth) in steps {
                match step(&plan, usize::from(kind), expr_depth) {
                    Ok(next) => plan = next,
                    Err(error) => {
                        refusal = Some((plan.depth(), expr_depth, error));
                        break;
                    }
                }
            }
            exercise(&plan);
            refusal
        });
        if let Some((depth, expr_depth, error)) = outcome {
            match error {
                PlanError::PlanTooDeep { .. } => prop_assert_eq!(depth, MAX_PLAN_DEPTH),
                PlanError::ExpressionTooDeep { depth: found, .. } => {
                    prop_assert!(found > MAX_EXPR_DEPTH && found <= expr_depth + 1);
                }
                other => prop_assert!(false, "unexpected refusal: {other}"),
            }
        }
    }
}
