//! Expression evaluation against naive row-by-row references.
// Test helpers outside #[test] functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, BooleanArray, Float64Array, Int32Array, Int64Array, StringArray, UInt64Array,
};
use arrow::datatypes::DataType;
use arrow::record_batch::RecordBatch;
use floe_core::expr::{Expr, coalesce, col, hash, lit, null, null_on_error, when};
use floe_engine::eval::evaluate;
use proptest::prelude::*;

fn batch(a: &[Option<i64>], b: &[Option<i64>], s: &[Option<String>]) -> RecordBatch {
    RecordBatch::try_from_iter([
        ("a", Arc::new(Int64Array::from(a.to_vec())) as ArrayRef),
        ("b", Arc::new(Int64Array::from(b.to_vec())) as ArrayRef),
        ("s", Arc::new(StringArray::from(s.to_vec())) as ArrayRef),
    ])
    .unwrap()
}

fn ints(array: &ArrayRef) -> Vec<Option<i64>> {
    array
        .as_any()
        .downcast_ref::<Int64Array>()
        .unwrap()
        .iter()
        .collect()
}

fn floats(array: &ArrayRef) -> Vec<Option<f64>> {
    array
        .as_any()
        .downcast_ref::<Float64Array>()
        .unwrap()
        .iter()
        .collect()
}

fn bools(array: &ArrayRef) -> Vec<Option<bool>> {
    array
        .as_any()
        .downcast_ref::<BooleanArray>()
        .unwrap()
        .iter()
        .collect()
}

fn strings(array: &ArrayRef) -> Vec<Option<String>> {
    array
        .as_any()
        .downcast_ref::<StringArray>()
        .unwrap()
        .iter()
        .map(|s| s.map(str::to_owned))
        .collect()
}

/// Values with many edge cases: zero, ±1, extremes, nulls.
fn int_value() -> impl Strategy<Value = Option<i64>> {
    prop_oneof![
        Just(None),
        Just(Some(0)),
        Just(Some(1)),
        Just(Some(-1)),
        Just(Some(i64::MAX)),
        Just(Some(i64::MIN)),
        any::<i64>().prop_map(Some),
        (-100i64..100).prop_map(Some),
    ]
}

fn text_value() -> impl Strategy<Value = Option<String>> {
    prop_oneof![Just(None), "[a-cA-C é]{0,6}".prop_map(Some)]
}

fn columns() -> impl Strategy<Value = Vec<(Option<i64>, Option<i64>, Option<String>)>> {
    prop::collection::vec((int_value(), int_value(), text_value()), 0..40)
}

fn unzip(rows: &[(Option<i64>, Option<i64>, Option<String>)]) -> RecordBatch {
    let a: Vec<_> = rows.iter().map(|r| r.0).collect();
    let b: Vec<_> = rows.iter().map(|r| r.1).collect();
    let s: Vec<_> = rows.iter().map(|r| r.2.clone()).collect();
    batch(&a, &b, &s)
}

/// A checked integer operation: `None` where floe gives null.
type CheckedOp = fn(i64, i64) -> Option<i64>;

fn kleene_and(a: Option<bool>, b: Option<bool>) -> Option<bool> {
    match (a, b) {
        (Some(false), _) | (_, Some(false)) => Some(false),
        (Some(true), Some(true)) => Some(true),
        _ => None,
    }
}

fn kleene_or(a: Option<bool>, b: Option<bool>) -> Option<bool> {
    match (a, b) {
        (Some(true), _) | (_, Some(true)) => Some(true),
        (Some(false), Some(false)) => Some(false),
        _ => None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Integer arithmetic: overflow and division by zero fail, or give null inside `try`, as
    /// documented.
    #[test]
    fn integer_arithmetic_matches_checked_reference(rows in columns()) {
        let batch = unzip(&rows);
        let cases: Vec<(Expr, CheckedOp)> = vec![
            (col("a") + col("b"), i64::checked_add),
            (col("a") - col("b"), i64::checked_sub),
            (col("a") * col("b"), i64::checked_mul),
            (col("a") / col("b"), i64::checked_div),
            (col("a") % col("b"), i64::checked_rem),
        ];
        for (expr, reference) in cases {
            let expected: Vec<Option<i64>> = rows
                .iter()
                .map(|(a, b, _)| match (a, b) {
                    (Some(a), Some(b)) => reference(*a, *b),
                    _ => None,
                })
                .collect();
            let no_answer = rows.iter().any(|(a, b, _)| {
                matches!((a, b), (Some(a), Some(b)) if reference(*a, *b).is_none())
            });
            let strict = evaluate(&expr, &batch);
            prop_assert_eq!(strict.is_err(), no_answer, "{}", expr);
            if let Ok(strict) = strict {
                prop_assert_eq!(ints(&strict), expected.clone(), "{}", expr);
            }
            let lenient = null_on_error(expr.clone());
            prop_assert_eq!(ints(&evaluate(&lenient, &batch).unwrap()), expected, "{}", expr);
        }
        // A literal on either side is kept as a scalar, not repeated: same results.
        let minus: Vec<Option<i64>> = rows.iter().map(|(a, _, _)| a.and_then(|a| 7i64.checked_sub(a))).collect();
        prop_assert_eq!(ints(&evaluate(&null_on_error(lit(7i64) - col("a")), &batch).unwrap()), minus);
        let times: Vec<Option<i64>> = rows.iter().map(|(a, _, _)| a.and_then(|a| a.checked_mul(3))).collect();
        prop_assert_eq!(ints(&evaluate(&null_on_error(col("a") * lit(3i32)), &batch).unwrap()), times);
        let by_zero = evaluate(&null_on_error(col("a") / lit(0i64)), &batch).unwrap();
        prop_assert_eq!(by_zero.null_count(), rows.len());
        let plus_null = evaluate(&(col("a") + floe_core::expr::null()), &batch).unwrap();
        prop_assert_eq!(plus_null.null_count(), rows.len());
        prop_assert_eq!(plus_null.len(), rows.len());
        let above: Vec<Option<bool>> = rows.iter().map(|(a, _, _)| Some(5 > (*a)?)).collect();
        prop_assert_eq!(bools(&evaluate(&lit(5i64).gt(col("a")), &batch).unwrap()), above);
        let negated: Vec<Option<i64>> = rows.iter().map(|(a, _, _)| a.and_then(i64::checked_neg)).collect();
        prop_assert_eq!(ints(&evaluate(&null_on_error(-col("a")), &batch).unwrap()), negated);
        let min_present = rows.iter().any(|(a, _, _)| *a == Some(i64::MIN));
        prop_assert_eq!(evaluate(&(-col("a")), &batch).is_err(), min_present);
    }

    #[test]
    fn comparisons_and_boolean_logic_match_reference(rows in columns()) {
        let batch = unzip(&rows);
        let lt: Vec<Option<bool>> = rows
            .iter()
            .map(|(a, b, _)| Some((*a)? < (*b)?))
            .collect();
        prop_assert_eq!(bools(&evaluate(&col("a").lt(col("b")), &batch).unwrap()), lt.clone());
        let positive: Vec<Option<bool>> = rows.iter().map(|(a, _, _)| Some((*a)? > 0)).collect();
        let and: Vec<Option<bool>> = lt.iter().zip(&positive).map(|(x, y)| kleene_and(*x, *y)).collect();
        let or: Vec<Option<bool>> = lt.iter().zip(&positive).map(|(x, y)| kleene_or(*x, *y)).collect();
        let lt_expr = col("a").lt(col("b"));
        let pos_expr = col("a").gt(lit(0i64));
        prop_assert_eq!(bools(&evaluate(&lt_expr.clone().and(pos_expr.clone()), &batch).unwrap()), and);
        prop_assert_eq!(bools(&evaluate(&lt_expr.clone().or(pos_expr), &batch).unwrap()), or);
        let not: Vec<Option<bool>> = lt.iter().map(|x| x.map(|x| !x)).collect();
        prop_assert_eq!(bools(&evaluate(&!lt_expr, &batch).unwrap()), not);
        // Mixed Int64/Int32 literal comparison promotes to Int64.
        let eq_small: Vec<Option<bool>> = rows.iter().map(|(a, _, _)| Some((*a)? == 1)).collect();
        prop_assert_eq!(bools(&evaluate(&col("a").eq(lit(1i32)), &batch).unwrap()), eq_small);
    }

    #[test]
    fn null_handling_and_conditionals_match_reference(rows in columns()) {
        let batch = unzip(&rows);
        let is_null: Vec<Option<bool>> = rows.iter().map(|(a, _, _)| Some(a.is_none())).collect();
        prop_assert_eq!(bools(&evaluate(&col("a").is_null(), &batch).unwrap()), is_null);
        let coalesced: Vec<Option<i64>> = rows.iter().map(|(a, b, _)| a.or(*b).or(Some(-7))).collect();
        prop_assert_eq!(
            ints(&evaluate(&coalesce([col("a"), col("b"), lit(-7i64)]), &batch).unwrap()),
            coalesced
        );
        // A null condition takes the else branch.
        let chosen: Vec<Option<i64>> = rows
            .iter()
            .map(|(a, b, _)| if a.is_some_and(|a| a > 0) { *a } else { *b })
            .collect();
        prop_assert_eq!(
            ints(&evaluate(&when(col("a").gt(lit(0i64)), col("a"), col("b")), &batch).unwrap()),
            chosen
        );
    }

    #[test]
    fn string_functions_match_reference(rows in columns()) {
        let batch = unzip(&rows);
        let texts: Vec<Option<&str>> = rows.iter().map(|r| r.2.as_deref()).collect();
        let map_str = |f: &dyn Fn(&str) -> String| -> Vec<Option<String>> {
            texts.iter().map(|t| t.map(f)).collect()
        };
        let map_bool = |f: &dyn Fn(&str) -> bool| -> Vec<Option<bool>> {
            texts.iter().map(|t| t.map(f)).collect()
        };
        prop_assert_eq!(strings(&evaluate(&col("s").lower(), &batch).unwrap()), map_str(&|t| t.to_lowercase()));
        prop_assert_eq!(strings(&evaluate(&col("s").upper(), &batch).unwrap()), map_str(&|t| t.to_uppercase()));
        prop_assert_eq!(
            strings(&evaluate(&col("s").substring(1, Some(2)), &batch).unwrap()),
            map_str(&|t| t.chars().skip(1).take(2).collect())
        );
        prop_assert_eq!(
            ints(&evaluate(&col("s").length(), &batch).unwrap()),
            texts.iter().map(|t| t.map(|t| t.chars().count() as i64)).collect::<Vec<_>>()
        );
        prop_assert_eq!(bools(&evaluate(&col("s").contains("b"), &batch).unwrap()), map_bool(&|t| t.contains('b')));
        prop_assert_eq!(bools(&evaluate(&col("s").starts_with("a"), &batch).unwrap()), map_bool(&|t| t.starts_with('a')));
        prop_assert_eq!(
            bools(&evaluate(&col("s").regex_match("^[ab]+$"), &batch).unwrap()),
            map_bool(&|t| !t.is_empty() && t.chars().all(|c| c == 'a' || c == 'b'))
        );
    }

    /// Equal rows hash equal; different rows (here) hash differently.
    #[test]
    fn hash_agrees_with_row_equality(rows in columns()) {
        let batch = unzip(&rows);
        let hashes = evaluate(&hash([col("a"), col("s")]), &batch).unwrap();
        let hashes: Vec<u64> = hashes.as_any().downcast_ref::<UInt64Array>().unwrap().values().to_vec();
        for i in 0..rows.len() {
            for j in 0..rows.len() {
                let same = rows[i].0 == rows[j].0 && rows[i].2 == rows[j].2;
                prop_assert_eq!(same, hashes[i] == hashes[j]);
            }
        }
    }
}

#[test]
fn when_evaluates_each_branch_only_on_its_rows() {
    let batch = RecordBatch::try_from_iter([
        (
            "a",
            Arc::new(Int64Array::from(vec![Some(6), Some(5), None, Some(9)])) as ArrayRef,
        ),
        (
            "b",
            Arc::new(Int64Array::from(vec![Some(3), Some(0), Some(1), Some(0)])) as ArrayRef,
        ),
    ])
    .unwrap();
    let guarded = when(col("b").not_eq(lit(0i64)), col("a") / col("b"), lit(-1i64));
    assert_eq!(
        ints(&evaluate(&guarded, &batch).unwrap()),
        vec![Some(2), Some(-1), None, Some(-1)]
    );
    // Unguarded, the same division fails on the first zero.
    assert!(evaluate(&(col("a") / col("b")), &batch).is_err());
}

#[test]
fn float_division_by_zero_fails_or_is_null_and_overflow_is_infinite() {
    let batch = RecordBatch::try_from_iter([
        (
            "x",
            Arc::new(Float64Array::from(vec![
                Some(1.0),
                Some(1e308),
                None,
                Some(-3.0),
            ])) as ArrayRef,
        ),
        (
            "y",
            Arc::new(Float64Array::from(vec![
                Some(0.0),
                Some(10.0),
                Some(1.0),
                Some(2.0),
            ])) as ArrayRef,
        ),
    ])
    .unwrap();
    assert_eq!(
        floats(&evaluate(&null_on_error(col("x") / col("y")), &batch).unwrap()),
        vec![None, Some(1e307), None, Some(-1.5)]
    );
    let error = evaluate(&(col("x") / col("y")), &batch)
        .unwrap_err()
        .to_string();
    assert!(error.contains("division by zero (1.0 / 0)"), "{error}");
    assert!(error.contains("(col(\"x\") / col(\"y\"))"), "{error}");
    assert_eq!(
        floats(&evaluate(&(col("x") * col("y")), &batch).unwrap()),
        vec![Some(0.0), Some(f64::INFINITY), None, Some(-6.0)]
    );
    assert_eq!(
        floats(&evaluate(&null_on_error(col("x") % col("y")), &batch).unwrap()),
        vec![None, Some(1e308 % 10.0), None, Some(-1.0)]
    );
}

#[test]
fn casts_that_do_not_fit_fail_or_are_null_with_try_cast() {
    let batch = RecordBatch::try_from_iter([
        (
            "s",
            Arc::new(StringArray::from(vec![
                Some("12"),
                Some("abc"),
                None,
                Some("300"),
            ])) as ArrayRef,
        ),
        (
            "i",
            Arc::new(Int32Array::from(vec![
                Some(1),
                Some(-129),
                Some(5),
                Some(127),
            ])) as ArrayRef,
        ),
    ])
    .unwrap();
    assert_eq!(
        ints(&evaluate(&col("s").try_cast(DataType::Int64), &batch).unwrap()),
        vec![Some(12), None, None, Some(300)]
    );
    // Strict: the first value that does not convert is named, with its column.
    let error = evaluate(&col("s").cast(DataType::Int64), &batch)
        .unwrap_err()
        .to_string();
    assert_eq!(
        error,
        "cast(col(\"s\") as Int64): \"abc\" does not convert to Int64; try_cast gives null \
         instead"
    );
    let error = evaluate(&col("i").cast(DataType::Int8), &batch)
        .unwrap_err()
        .to_string();
    assert!(error.contains("-129 does not convert to Int8"), "{error}");
    // A null is not a failure: it converts to null.
    let present = RecordBatch::try_from_iter([(
        "s",
        Arc::new(StringArray::from(vec![Some("7"), None])) as ArrayRef,
    )])
    .unwrap();
    assert_eq!(
        ints(&evaluate(&col("s").cast(DataType::Int64), &present).unwrap()),
        vec![Some(7), None]
    );
    let small = evaluate(&col("i").try_cast(DataType::Int8), &batch).unwrap();
    let small: Vec<Option<i8>> = small
        .as_any()
        .downcast_ref::<arrow::array::Int8Array>()
        .unwrap()
        .iter()
        .collect();
    assert_eq!(small, vec![Some(1), None, Some(5), Some(127)]);
    // Mixed integer and float arithmetic computes in Float64.
    assert_eq!(
        floats(&evaluate(&(col("i") + lit(0.5)), &batch).unwrap()),
        vec![Some(1.5), Some(-128.5), Some(5.5), Some(127.5)]
    );
    // Two literals are evaluated row by row like anything else.
    assert_eq!(
        ints(&evaluate(&(lit(40i64) + lit(2i64)), &batch).unwrap()),
        vec![Some(42); 4]
    );
    // The untyped null literal takes the other side's type.
    assert_eq!(
        ints(&evaluate(&coalesce([null(), col("i").cast(DataType::Int64)]), &batch).unwrap()),
        vec![Some(1), Some(-129), Some(5), Some(127)]
    );
}
