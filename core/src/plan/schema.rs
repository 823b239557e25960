//! Schema inference: the output schema of each operator from its inputs' schemas, with the
//! validation errors users see when a pipeline is built.

use arrow_schema::{DataType, Field, Schema};

use super::operator::{AggFunction, Aggregation, FileFormat, JoinType, Operator};
use super::{PlanError, describe_schema};
use crate::expr::{common_type, is_numeric as numeric, is_orderable as orderable};

/// How an operator is named in error messages: its name and main argument.
pub(crate) fn label(operator: &Operator) -> String {
    match operator {
        Operator::WithColumn { name, .. } => format!("with_column({name:?})"),
        Operator::Join { how, .. } => format!("join({})", how.name()),
        Operator::ProcessUdf(udf) => udf.label(),
        other => other.name().to_owned(),
    }
}

/// Whether two schemas have the same columns in the same order: names and types (nullability
/// aside).
pub fn same_columns(left: &Schema, right: &Schema) -> bool {
    left.fields().len() == right.fields().len()
        && left
            .fields()
            .iter()
            .zip(right.fields())
            .all(|(l, r)| l.name() == r.name() && l.data_type() == r.data_type())
}

/// `schema`'s fields, each named as the first `(from, to)` pair that renames it says.
pub fn renamed_fields(schema: &Schema, pairs: &[(String, String)]) -> Vec<Field> {
    schema
        .fields()
        .iter()
        .map(|f| match pairs.iter().find(|(from, _)| from == f.name()) {
            Some((_, to)) => f.as_ref().clone().with_name(to),
            None => f.as_ref().clone(),
        })
        .collect()
}

fn field<'a>(schema: &'a Schema, column: &str, operator: &str) -> Result<&'a Field, PlanError> {
    schema
        .column_with_name(column)
        .map(|(_, field)| field)
        .ok_or_else(|| PlanError::unknown_column(operator, column, schema))
}

fn check_unique_names<'a>(
    names: impl IntoIterator<Item = &'a str>,
    operator: &str,
) -> Result<(), PlanError> {
    let mut seen: Vec<&str> = Vec::new();
    for name in names {
        if seen.contains(&name) {
            return Err(PlanError::DuplicateColumn {
                operator: operator.to_owned(),
                column: name.to_owned(),
            });
        }
        seen.push(name);
    }
    Ok(())
}

fn expect_type(
    ok: bool,
    operator: &str,
    column: &str,
    expected: &str,
    actual: &DataType,
) -> Result<(), PlanError> {
    if ok {
        return Ok(());
    }
    Err(PlanError::TypeMismatch {
        operator: operator.to_owned(),
        expr: format!("col({column:?})"),
        expected: expected.to_owned(),
        actual: actual.to_string(),
    })
}

pub(crate) fn output_schema(operator: &Operator, inputs: &[&Schema]) -> Result<Schema, PlanError> {
    let name = label(operator);
    let name = name.as_str();
    let expected_inputs = match operator {
        Operator::Read(_)
        | Operator::Range { .. }
        | Operator::FromBatches { .. }
        | Operator::Materialized(_) => 0,
        Operator::Join { .. } | Operator::Union => 2,
        _ => 1,
    };
    if inputs.len() != expected_inputs {
        return Err(PlanError::invalid(
            name,
            format!("takes {expected_inputs} inputs, got {}", inputs.len()),
        ));
    }
    match operator {
        Operator::Read(scan) => {
            // A partitioned scan may have had every file pruned; it then reads nothing.
            if scan.files.is_empty() && scan.partitioning.is_empty() {
                return Err(PlanError::invalid(name, "no input files"));
            }
            if let Some(fixed) = scan.format.fixed_schema()
                && fixed.fields() != scan.file_schema.fields()
            {
                return Err(PlanError::invalid(
                    name,
                    format!(
                        "{} files have the schema ({}), not ({})",
                        scan.format.name(),
                        describe_schema(&fixed),
                        describe_schema(&scan.file_schema)
                    ),
                ));
            }
            for column in &scan.partitioning {
                if scan.file_schema.field_with_name(&column.name).is_ok() {
                    return Err(PlanError::invalid(
                        name,
                        format!(
                            "partition column `{}` is also a column of the files; Hive                              partitioning keeps it out of them",
                            column.name
                        ),
                    ));
                }
            }
            check_unique_names(scan.partitioning.iter().map(|c| c.name.as_str()), name)?;
            let full = scan.full_schema();
            let schema = match &scan.projection {
                None => full,
                Some(columns) => {
                    for column in columns {
                        field(&full, column, name)?;
                    }
                    check_unique_names(columns.iter().map(String::as_str), name)?;
                    // Schema order, whatever order the projection lists.
                    let fields: Vec<Field> = full
                        .fields()
                        .iter()
                        .filter(|f| columns.contains(f.name()))
                        .map(|f| f.as_ref().clone())
                        .collect();
                    Schema::new(fields)
                }
            };
            if let Some(predicate) = &scan.predicate {
                check_predicate(predicate, &schema, name)?;
            }
            Ok(schema)
        }
        Operator::Range { n } => {
            // The ids are Int64: past i64::MAX they could not be represented.
            if i64::try_from(*n).is_err() {
                return Err(PlanError::invalid(
                    name,
                    format!("range({n}) exceeds the largest Int64, {}", i64::MAX),
                ));
            }
            Ok(Schema::new(vec![Field::new("id", DataType::Int64, false)]))
        }
        Operator::FromBatches { schema, .. } => Ok(Schema::new(schema.fields().clone())),
        Operator::Materialized(source) => Ok(Schema::new(source.schema.fields().clone())),
        Operator::WithColumn { name: column, expr } => {
            let input = inputs[0];
            let new_field = expr.to_field(input, name, column)?;
            let mut fields: Vec<Field> =
                input.fields().iter().map(|f| f.as_ref().clone()).collect();
            match fields.iter().position(|f| f.name() == column) {
                Some(index) => fields[index] = new_field,
                None => fields.push(new_field),
            }
            Ok(Schema::new(fields))
        }
        Operator::Select { columns } => {
            let input = inputs[0];
            check_unique_names(columns.iter().map(String::as_str), name)?;
            let fields = columns
                .iter()
                .map(|c| field(input, c, name).cloned())
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Schema::new(fields))
        }
        Operator::Drop { columns } => {
            let input = inputs[0];
            for column in columns {
                field(input, column, name)?;
            }
            let fields: Vec<Field> = input
                .fields()
                .iter()
                .filter(|f| !columns.contains(f.name()))
                .map(|f| f.as_ref().clone())
                .collect();
            Ok(Schema::new(fields))
        }
        Operator::Rename { pairs } => {
            let input = inputs[0];
            for (from, _) in pairs {
                field(input, from, name)?;
            }
            let fields = renamed_fields(input, pairs);
            check_unique_names(fields.iter().map(|f| f.name().as_str()), name)?;
            Ok(Schema::new(fields))
        }
        Operator::Filter { predicate } => {
            check_predicate(predicate, inputs[0], name)?;
            Ok(inputs[0].clone())
        }
        Operator::Udf { output_schema, .. } => Ok(output_schema.clone()),
        Operator::ProcessUdf(udf) => {
            udf.validate()?;
            match &udf.output_schema {
                Some(schema) => {
                    check_unique_names(schema.fields().iter().map(|f| f.name().as_str()), name)?;
                    Ok(schema.clone())
                }
                None => Ok(inputs[0].clone()),
            }
        }
        Operator::Limit { .. } | Operator::Cache | Operator::RandomShuffle { .. } => {
            Ok(inputs[0].clone())
        }
        Operator::Write(spec) => {
            if spec.target_file_size == 0 {
                return Err(PlanError::invalid(
                    name,
                    "target_file_size must be positive",
                ));
            }
            if !spec.directory.is_absolute() && !crate::location::is_remote(&spec.directory) {
                return Err(PlanError::invalid(
                    name,
                    format!(
                        "the directory {} is relative; a node would resolve it against its own \
                         working directory, so resolve it where the job is built",
                        spec.directory.display()
                    ),
                ));
            }
            if spec.format != FileFormat::Parquet
                && spec.compression != super::operator::Compression::Uncompressed
            {
                return Err(PlanError::invalid(
                    name,
                    format!(
                        "compression {} applies to Parquet only; CSV and JSON are written \
                         uncompressed",
                        spec.compression.name()
                    ),
                ));
            }
            if !spec.format.is_writable() {
                return Err(PlanError::invalid(
                    name,
                    format!("{} files can be read, not written", spec.format.name()),
                ));
            }
            check_partition_by(&spec.partition_by, inputs[0], name)?;
            Ok(inputs[0].clone())
        }
        Operator::Sort { keys } => {
            if keys.is_empty() {
                return Err(PlanError::invalid(name, "needs at least one key"));
            }
            for key in keys {
                let f = field(inputs[0], &key.column, name)?;
                expect_type(
                    orderable(f.data_type()),
                    name,
                    &key.column,
                    "an orderable type",
                    f.data_type(),
                )?;
            }
            Ok(inputs[0].clone())
        }
        Operator::Aggregate { keys, aggregations } => {
            aggregate_schema(inputs[0], keys, aggregations, name)
        }
        Operator::Repartition { partitions, keys } => {
            if *partitions == 0 || *partitions > MAX_PARTITIONS {
                return Err(PlanError::invalid(
                    name,
                    format!("needs 1 to {MAX_PARTITIONS} partitions, got {partitions}"),
                ));
            }
            for key in keys {
                field(inputs[0], key, name)?;
            }
            Ok(inputs[0].clone())
        }
        Operator::Join {
            left_keys,
            right_keys,
            how,
        } => join_schema(inputs[0], inputs[1], left_keys, right_keys, *how, name),
        Operator::Union => {
            let (left, right) = (inputs[0], inputs[1]);
            if !same_columns(left, right) {
                return Err(PlanError::SchemaMismatch {
                    operator: name.to_owned(),
                    left: super::describe_schema(left),
                    right: super::describe_schema(right),
                });
            }
            let fields: Vec<Field> = left
                .fields()
                .iter()
                .zip(right.fields())
                .map(|(l, r)| {
                    let nullable = l.is_nullable() || r.is_nullable();
                    l.as_ref().clone().with_nullable(nullable)
                })
                .collect();
            Ok(Schema::new(fields))
        }
        Operator::Unique { columns } => {
            if columns.is_empty() {
                return Ok(inputs[0].clone());
            }
            check_unique_names(columns.iter().map(String::as_str), name)?;
            let fields = columns
                .iter()
                .map(|c| field(inputs[0], c, name).cloned())
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Schema::new(fields))
        }
    }
}

/// The most partitions a repartition may ask for: each is a task and, on the map side, one
/// block per map task, so more would only cost.
pub const MAX_PARTITIONS: u32 = 1 << 16;

fn check_predicate(
    predicate: &crate::expr::Expr,
    schema: &Schema,
    operator: &str,
) -> Result<(), PlanError> {
    let data_type = predicate.data_type(schema, operator)?;
    if !matches!(data_type, DataType::Boolean | DataType::Null) {
        return Err(PlanError::TypeMismatch {
            operator: operator.to_owned(),
            expr: predicate.to_string(),
            expected: "a Boolean predicate".to_owned(),
            actual: data_type.to_string(),
        });
    }
    Ok(())
}

fn aggregate_schema(
    input: &Schema,
    keys: &[String],
    aggregations: &[Aggregation],
    name: &str,
) -> Result<Schema, PlanError> {
    let mut fields = Vec::new();
    for key in keys {
        fields.push(field(input, key, name)?.clone());
    }
    for aggregation in aggregations {
        let column_field = match &aggregation.column {
            Some(column) => Some(field(input, column, name)?),
            None if aggregation.function == AggFunction::Count => None,
            None => {
                return Err(PlanError::invalid(
                    name,
                    format!("{} needs a column", aggregation.function.name()),
                ));
            }
        };
        let output = match (aggregation.function, column_field) {
            (AggFunction::Count | AggFunction::CountDistinct, _) => {
                Field::new(&aggregation.alias, DataType::Int64, false)
            }
            (function, Some(f)) => {
                let data_type = f.data_type();
                let column = f.name();
                let what = format!("a numeric column for {}", function.name());
                let output_type = match function {
                    AggFunction::Sum => {
                        expect_type(numeric(data_type), name, column, &what, data_type)?;
                        if data_type.is_floating() {
                            DataType::Float64
                        } else if data_type.is_unsigned_integer() {
                            DataType::UInt64
                        } else {
                            DataType::Int64
                        }
                    }
                    AggFunction::Mean | AggFunction::Std => {
                        expect_type(numeric(data_type), name, column, &what, data_type)?;
                        DataType::Float64
                    }
                    _ => {
                        let what = format!("an orderable column for {}", function.name());
                        expect_type(orderable(data_type), name, column, &what, data_type)?;
                        data_type.clone()
                    }
                };
                // Empty groups never exist, but all-null inputs (and std of one value) do.
                Field::new(&aggregation.alias, output_type, true)
            }
            (_, None) => {
                return Err(PlanError::invalid(name, "aggregation without a column"));
            }
        };
        fields.push(output);
    }
    if fields.is_empty() {
        return Err(PlanError::invalid(name, "needs keys or aggregations"));
    }
    check_unique_names(fields.iter().map(|f| f.name().as_str()), name)?;
    Ok(Schema::new(fields))
}

/// Whether the right key paired with `left_key` can give that key column a null: it is
/// nullable, or of another type whose values may not fit the left key's (a cast that does
/// not fit is null).
fn right_key_may_be_null(
    left_keys: &[String],
    right_keys: &[String],
    left_key: &Field,
    right: &Schema,
) -> bool {
    left_keys
        .iter()
        .zip(right_keys)
        .filter(|(left, _)| *left == left_key.name())
        .any(|(_, right_key)| {
            right
                .field_with_name(right_key)
                .is_ok_and(|field| field.is_nullable() || field.data_type() != left_key.data_type())
        })
}

fn join_schema(
    left: &Schema,
    right: &Schema,
    left_keys: &[String],
    right_keys: &[String],
    how: JoinType,
    name: &str,
) -> Result<Schema, PlanError> {
    if left_keys.is_empty() || left_keys.len() != right_keys.len() {
        return Err(PlanError::invalid(
            name,
            format!(
                "needs the same non-zero number of keys on both sides, got {} and {}",
                left_keys.len(),
                right_keys.len()
            ),
        ));
    }
    for (left_key, right_key) in left_keys.iter().zip(right_keys) {
        let missing = |column: &str, side, schema: &Schema| PlanError::MissingJoinKey {
            operator: name.to_owned(),
            column: column.to_owned(),
            side,
            available: super::describe_schema(schema),
        };
        let (_, l) = left
            .column_with_name(left_key)
            .ok_or_else(|| missing(left_key, "left", left))?;
        let (_, r) = right
            .column_with_name(right_key)
            .ok_or_else(|| missing(right_key, "right", right))?;
        let compatible = l.data_type() == r.data_type()
            || (numeric(l.data_type())
                && numeric(r.data_type())
                && l.data_type().is_integer() == r.data_type().is_integer()
                && common_type(l.data_type(), r.data_type()).is_some());
        if !compatible {
            return Err(PlanError::JoinKeyTypeMismatch {
                operator: name.to_owned(),
                left: format!("{left_key:?} is {}", l.data_type()),
                right: format!("{right_key:?} is {}", r.data_type()),
            });
        }
    }
    if matches!(how, JoinType::Semi | JoinType::Anti) {
        return Ok(left.clone());
    }
    // Left columns, then the right side's non-key columns; a right name that collides with a
    // left one gets the suffix `_right`. Keys appear once (for right and full joins they hold
    // whichever side matched).
    let left_nullable = matches!(how, JoinType::Right | JoinType::Full);
    let right_nullable = matches!(how, JoinType::Left | JoinType::Full);
    let mut fields: Vec<Field> = left
        .fields()
        .iter()
        .map(|f| {
            // A key of a right-only row holds the right key, which may be null.
            let is_key = left_keys.contains(f.name());
            let right_key_nullable =
                is_key && left_nullable && right_key_may_be_null(left_keys, right_keys, f, right);
            let nullable = f.is_nullable() || (left_nullable && !is_key) || right_key_nullable;
            f.as_ref().clone().with_nullable(nullable)
        })
        .collect();
    for f in right.fields() {
        if right_keys.contains(f.name()) {
            continue;
        }
        let mut output = f.as_ref().clone();
        if left.column_with_name(f.name()).is_some() {
            output = output.with_name(format!("{}_right", f.name()));
        }
        let nullable = f.is_nullable() || right_nullable;
        fields.push(output.with_nullable(nullable));
    }
    check_unique_names(fields.iter().map(|f| f.name().as_str()), name)?;
    Ok(Schema::new(fields))
}

/// Partition columns must exist, be named once, have a type whose values make directory
/// names (integers, strings, booleans, dates), and leave at least one column for the files.
fn check_partition_by(columns: &[String], input: &Schema, name: &str) -> Result<(), PlanError> {
    check_unique_names(columns.iter().map(String::as_str), name)?;
    for column in columns {
        let f = field(input, column, name)?;
        expect_type(
            f.data_type().is_integer()
                || matches!(
                    f.data_type(),
                    DataType::Utf8
                        | DataType::LargeUtf8
                        | DataType::Utf8View
                        | DataType::Boolean
                        | DataType::Date32
                ),
            name,
            column,
            "an integer, string, boolean or date32 partition column",
            f.data_type(),
        )?;
    }
    if !columns.is_empty() && columns.len() == input.fields().len() {
        return Err(PlanError::invalid(
            name,
            "partition_by names every column; the files would hold none",
        ));
    }
    Ok(())
}
