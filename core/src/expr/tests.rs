use arrow_schema::{DataType, Field, Schema};

use super::*;

fn schema() -> Schema {
    Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("small", DataType::Int32, false),
        Field::new("count", DataType::UInt32, false),
        Field::new("price", DataType::Float64, true),
        Field::new("name", DataType::Utf8, true),
        Field::new("flag", DataType::Boolean, false),
        Field::new("day", DataType::Date32, true),
    ])
}

fn infer(expr: &Expr) -> Result<Field, PlanError> {
    expr.to_field(&schema(), "with_column(\"x\")", "x")
}

fn field(data_type: DataType, nullable: bool) -> Field {
    Field::new("x", data_type, nullable)
}

#[test]
fn arithmetic_promotes_and_is_nullable() {
    assert_eq!(
        infer(&(col("small") + col("id"))).unwrap(),
        field(DataType::Int64, true)
    );
    assert_eq!(
        infer(&(col("count") * lit(2u32))).unwrap(),
        field(DataType::UInt64, true)
    );
    assert_eq!(
        infer(&(col("count") - col("small"))).unwrap(),
        field(DataType::Int64, true)
    );
    assert_eq!(
        infer(&(col("id") / col("price"))).unwrap(),
        field(DataType::Float64, true)
    );
    assert_eq!(
        infer(&(-col("small"))).unwrap(),
        field(DataType::Int64, true)
    );
}

#[test]
fn comparison_boolean_and_null_handling_types() {
    assert_eq!(
        infer(&col("id").gt(lit(3))).unwrap(),
        field(DataType::Boolean, false)
    );
    assert_eq!(
        infer(&col("name").eq(lit("a")).and(col("flag"))).unwrap(),
        field(DataType::Boolean, true)
    );
    assert_eq!(
        infer(&col("price").is_null()).unwrap(),
        field(DataType::Boolean, false)
    );
    // Non-null as soon as one argument can never be null.
    assert_eq!(
        infer(&coalesce([col("price"), col("id")])).unwrap(),
        field(DataType::Float64, false)
    );
    assert_eq!(
        infer(&coalesce([col("name"), null()])).unwrap(),
        field(DataType::Utf8, true)
    );
    assert_eq!(
        infer(&when(col("flag"), col("id"), lit(0.5))).unwrap(),
        field(DataType::Float64, false)
    );
    assert_eq!(
        infer(&hash([col("id"), col("name")])).unwrap(),
        field(DataType::UInt64, false)
    );
}

#[test]
fn string_functions_and_casts_type_check() {
    assert_eq!(
        infer(&col("name").lower()).unwrap(),
        field(DataType::Utf8, true)
    );
    assert_eq!(
        infer(&col("name").length()).unwrap(),
        field(DataType::Int64, true)
    );
    assert_eq!(
        infer(&col("name").regex_match("^a+$")).unwrap(),
        field(DataType::Boolean, true)
    );
    assert_eq!(
        infer(&col("name").substring(1, Some(2))).unwrap(),
        field(DataType::Utf8, true)
    );
    assert_eq!(
        infer(&col("name").cast(DataType::Int64)).unwrap(),
        field(DataType::Int64, true)
    );
}

#[test]
fn errors_name_operator_expression_and_types() {
    let error = infer(&(col("name") + lit(1))).unwrap_err();
    assert_eq!(
        error.to_string(),
        "with_column(\"x\"): + in (col(\"name\") + 1i32) needs numeric operands, got Utf8 and Int32"
    );
    let error = infer(&col("price").lower()).unwrap_err();
    assert_eq!(
        error.to_string(),
        "with_column(\"x\"): expected Utf8 for lower, but col(\"price\") has type Float64"
    );
    let error = infer(&col("nme").upper()).unwrap_err();
    assert_eq!(
        error.to_string(),
        "with_column(\"x\"): unknown column \"nme\" (available: id Int64 not null, small Int32 not \
         null, count UInt32 not null, price Float64, name Utf8, flag Boolean not null, day Date32)"
    );
    let error = infer(&col("id").and(col("flag"))).unwrap_err();
    assert_eq!(
        error.to_string(),
        "with_column(\"x\"): and in (col(\"id\") and col(\"flag\")) needs Boolean operands, got Int64 and Boolean"
    );
    let error = infer(&col("name").lt(col("id"))).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("needs operands of one comparable type, got Utf8 and Int64")
    );
    let error = infer(&col("name").regex_match("(")).unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("with_column(\"x\"): invalid regular expression \"(\"")
    );
    let error = infer(&when(col("id"), lit(1), lit(2))).unwrap_err();
    assert_eq!(
        error.to_string(),
        "with_column(\"x\"): expected Boolean for the if condition, but col(\"id\") has type Int64"
    );
    let error = infer(
        &col("flag").cast(DataType::List(std::sync::Arc::new(Field::new(
            "item",
            DataType::Int64,
            true,
        )))),
    )
    .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("cannot cast col(\"flag\") from Boolean to List")
    );
}

#[test]
fn hash_args_distinguish_structure_and_literal_types() {
    let exprs = [
        col("a") + lit(1),
        col("a") + lit(1i64),
        col("a") - lit(1),
        lit(1) + col("a"),
        col("b") + lit(1),
        col("a").contains("x"),
        col("a").starts_with("x"),
        col("a").substring(0, None),
        col("a").substring(0, Some(0)),
        lit(0.0),
        lit(-0.0),
    ];
    for (i, a) in exprs.iter().enumerate() {
        for (j, b) in exprs.iter().enumerate() {
            assert_eq!(i == j, a.to_arg() == b.to_arg(), "{a} vs {b}");
        }
    }
    assert_eq!((col("a") + lit(1)).to_arg(), (col("a") + lit(1)).to_arg());
}

#[test]
fn columns_and_renaming() {
    let expr = when(col("a").gt(col("b")), col("a") + col("c"), col("b"));
    assert_eq!(expr.columns(), vec!["a", "b", "c"]);
    let renamed = expr.map_columns(&|name| format!("{name}2"));
    assert_eq!(renamed.columns(), vec!["a2", "b2", "c2"]);
    let predicate = col("a").gt(lit(1)).and(col("b").lt(lit(2)).and(col("c")));
    assert_eq!(predicate.conjuncts().len(), 3);
}

#[test]
fn expressions_round_trip_through_the_wire_codec() {
    let expr = when(
        col("name").regex_match("^x").or(col("price").is_null()),
        col("price").cast(DataType::Int32),
        coalesce([lit(1.5f32).cast(DataType::Int32), null()]),
    );
    let bytes = crate::wire::codec::encode(&expr).unwrap();
    let decoded: Expr = crate::wire::codec::decode(&bytes, "expr").unwrap();
    assert_eq!(decoded, expr);
}
