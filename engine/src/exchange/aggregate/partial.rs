//! Partial aggregation: a groupby's map side aggregates its own rows before the shuffle, so
//! what crosses the network is one row per group and map task rather than every input row;
//! the reduce side then combines the partial rows.
//!
//! Each aggregation becomes partial columns that combine by another aggregation:
//! count → count, combined by sum; sum → (sum, and whether it overflowed), by sum — a partial
//! sum that overflowed makes the group's sum null, as an unpartitioned sum would be;
//! min → min, by min; max → max, by max;
//! mean → (count, sum as Float64), divided at the end; std → (count, sum, sum of squares as
//! Float64), the sample deviation computed at the end. `count_distinct` cannot be combined
//! from partial counts, so a groupby using it shuffles its rows unaggregated
//! ([`supports_partial`]).

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, Float64Array, Int64Array};
use arrow::compute::cast;
use arrow::compute::kernels::numeric::mul;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use floe_core::plan::{AggFunction, Aggregation};

use super::aggregate;
use crate::{Error, Result};

/// Whether every aggregation can be computed from partial aggregates.
pub fn supports_partial(aggregations: &[Aggregation]) -> bool {
    aggregations
        .iter()
        .all(|aggregation| aggregation.function != AggFunction::CountDistinct)
}

fn count_name(index: usize) -> String {
    format!("__partial{index}_count")
}

fn sum_name(index: usize) -> String {
    format!("__partial{index}_sum")
}

fn squares_name(index: usize) -> String {
    format!("__partial{index}_squares")
}

fn overflow_name(index: usize) -> String {
    format!("__partial{index}_overflow")
}

fn value_name(index: usize) -> String {
    format!("__partial{index}_value")
}

/// The float copy of aggregation `index`'s column that mean and std sum.
fn float_name(index: usize) -> String {
    format!("__partial{index}_float")
}

fn square_input_name(index: usize) -> String {
    format!("__partial{index}_square")
}

/// The type a sum of `input` has (as the plan's aggregate schema says).
fn sum_type(input: &DataType) -> DataType {
    if input.is_floating() {
        DataType::Float64
    } else if input.is_unsigned_integer() {
        DataType::UInt64
    } else {
        DataType::Int64
    }
}

fn column_of(aggregation: &Aggregation) -> Result<&str> {
    aggregation.column.as_deref().ok_or_else(|| {
        Error::from(arrow::error::ArrowError::InvalidArgumentError(format!(
            "{} needs a column",
            aggregation.function.name()
        )))
    })
}

/// The partial aggregations and the schema of their output (keys first).
fn partial_plan(
    input: &Schema,
    keys: &[String],
    aggregations: &[Aggregation],
) -> Result<(Vec<Aggregation>, Schema)> {
    let mut partials = Vec::new();
    let mut fields: Vec<Field> = keys
        .iter()
        .map(|key| input.field_with_name(key).cloned())
        .collect::<Result<_, _>>()?;
    let mut push = |aggregation: Aggregation, data_type: DataType, nullable: bool| {
        fields.push(Field::new(&aggregation.alias, data_type, nullable));
        partials.push(aggregation);
    };
    for (index, aggregation) in aggregations.iter().enumerate() {
        match (aggregation.function, aggregation.column.as_deref()) {
            (AggFunction::Count, None) => push(
                Aggregation::count_rows(count_name(index)),
                DataType::Int64,
                false,
            ),
            (AggFunction::Count, Some(column)) => push(
                Aggregation::of(AggFunction::Count, column).alias(count_name(index)),
                DataType::Int64,
                false,
            ),
            (AggFunction::Sum, _) => {
                let column = column_of(aggregation)?;
                let data_type = sum_type(input.field_with_name(column)?.data_type());
                push(
                    Aggregation::of(AggFunction::Count, column).alias(count_name(index)),
                    DataType::Int64,
                    false,
                );
                push(
                    Aggregation::of(AggFunction::Sum, column).alias(sum_name(index)),
                    data_type,
                    true,
                );
            }
            (AggFunction::Min | AggFunction::Max, _) => {
                let column = column_of(aggregation)?;
                let data_type = input.field_with_name(column)?.data_type().clone();
                push(
                    Aggregation::of(aggregation.function, column).alias(value_name(index)),
                    data_type,
                    true,
                );
            }
            (AggFunction::Mean | AggFunction::Std, _) => {
                let float = float_name(index);
                push(
                    Aggregation::of(AggFunction::Count, &float).alias(count_name(index)),
                    DataType::Int64,
                    false,
                );
                push(
                    Aggregation::of(AggFunction::Sum, &float).alias(sum_name(index)),
                    DataType::Float64,
                    true,
                );
                if aggregation.function == AggFunction::Std {
                    push(
                        Aggregation::of(AggFunction::Sum, square_input_name(index))
                            .alias(squares_name(index)),
                        DataType::Float64,
                        true,
                    );
                }
            }
            (AggFunction::CountDistinct, _) => {
                return Err(Error::from(arrow::error::ArrowError::InvalidArgumentError(
                    "count_distinct has no partial aggregate".into(),
                )));
            }
        }
    }
    Ok((partials, Schema::new(fields)))
}

/// The schema of the partial rows (what the reduce side receives): the partial aggregates,
/// then one overflow flag per sum.
pub fn partial_schema(
    input: &Schema,
    keys: &[String],
    aggregations: &[Aggregation],
) -> Result<SchemaRef> {
    let (_, schema) = partial_plan(
        &float_inputs_schema(input, aggregations)?,
        keys,
        aggregations,
    )?;
    let mut fields: Vec<Field> = schema.fields().iter().map(|f| f.as_ref().clone()).collect();
    for (index, aggregation) in aggregations.iter().enumerate() {
        if aggregation.function == AggFunction::Sum {
            fields.push(Field::new(overflow_name(index), DataType::Int64, false));
        }
    }
    Ok(Arc::new(Schema::new(fields)))
}

/// `input` with the columns [`with_float_inputs`] adds.
fn float_inputs_schema(input: &Schema, aggregations: &[Aggregation]) -> Result<Schema> {
    let mut fields: Vec<Field> = input.fields().iter().map(|f| f.as_ref().clone()).collect();
    for (index, aggregation) in aggregations.iter().enumerate() {
        if matches!(aggregation.function, AggFunction::Mean | AggFunction::Std) {
            fields.push(Field::new(float_name(index), DataType::Float64, true));
        }
        if aggregation.function == AggFunction::Std {
            fields.push(Field::new(
                square_input_name(index),
                DataType::Float64,
                true,
            ));
        }
    }
    Ok(Schema::new(fields))
}

/// Adds the float copies (and their squares) that mean and std aggregate.
fn with_float_inputs(batch: &RecordBatch, aggregations: &[Aggregation]) -> Result<RecordBatch> {
    let mut fields: Vec<Field> = batch
        .schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    let mut columns = batch.columns().to_vec();
    for (index, aggregation) in aggregations.iter().enumerate() {
        if !matches!(aggregation.function, AggFunction::Mean | AggFunction::Std) {
            continue;
        }
        let column = column_of(aggregation)?;
        let values = batch.column_by_name(column).ok_or_else(|| {
            Error::from(arrow::error::ArrowError::SchemaError(format!(
                "no column {column}"
            )))
        })?;
        let floats = cast(values, &DataType::Float64)?;
        fields.push(Field::new(float_name(index), DataType::Float64, true));
        columns.push(floats.clone());
        if aggregation.function == AggFunction::Std {
            fields.push(Field::new(
                square_input_name(index),
                DataType::Float64,
                true,
            ));
            columns.push(mul(&floats, &floats)?);
        }
    }
    Ok(RecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        columns,
    )?)
}

/// Aggregates `batches` (of `input`) into partial rows: one per group.
pub fn partial_aggregate(
    batches: &[RecordBatch],
    input: &SchemaRef,
    keys: &[String],
    aggregations: &[Aggregation],
) -> Result<RecordBatch> {
    // Batch by batch: concatenating them first would copy every input byte once more.
    let prepared = batches
        .iter()
        .map(|batch| with_float_inputs(batch, aggregations))
        .collect::<Result<Vec<_>>>()?;
    let prepared_schema = Arc::new(float_inputs_schema(input, aggregations)?);
    let (partials, schema) = partial_plan(&prepared_schema, keys, aggregations)?;
    let partial = aggregate(
        &prepared,
        &prepared_schema,
        keys,
        &partials,
        &Arc::new(schema),
    )?;
    // A sum is null with non-null inputs only when it overflowed; the flag carries that to
    // the reduce side, where a null partial would otherwise just be skipped.
    let mut columns = partial.columns().to_vec();
    for (index, aggregation) in aggregations.iter().enumerate() {
        if aggregation.function != AggFunction::Sum {
            continue;
        }
        let named = |name: String| {
            partial
                .column_by_name(&name)
                .cloned()
                .ok_or_else(|| Error::from(arrow::error::ArrowError::SchemaError(name)))
        };
        let (counts, sums) = (named(count_name(index))?, named(sum_name(index))?);
        let counts = ints(&counts)?;
        let flags = (0..partial.num_rows())
            .map(|row| i64::from(counts.value(row) > 0 && sums.is_null(row)));
        columns.push(Arc::new(Int64Array::from_iter_values(flags)));
    }
    let schema = partial_schema(input, keys, aggregations)?;
    Ok(RecordBatch::try_new(schema, columns)?)
}

/// Combines partial rows (of [`partial_schema`]) into the final `output`.
pub fn final_aggregate(
    partial: &[RecordBatch],
    partial_schema: &SchemaRef,
    keys: &[String],
    aggregations: &[Aggregation],
    output: &SchemaRef,
) -> Result<RecordBatch> {
    // Combining aggregations over the partial columns, each keeping its partial name.
    let combine = |function, name: String| Aggregation::of(function, &name).alias(name);
    let mut combining = Vec::new();
    let mut fields: Vec<Field> = keys
        .iter()
        .map(|key| partial_schema.field_with_name(key).cloned())
        .collect::<Result<_, _>>()?;
    for field in partial_schema.fields().iter().skip(keys.len()) {
        let name = field.name().clone();
        let function = if name.ends_with("_value") {
            // Min or max: the same function again.
            let index: usize = name
                .trim_start_matches("__partial")
                .trim_end_matches("_value")
                .parse()
                .map_err(|_| Error::from(arrow::error::ArrowError::SchemaError(name.clone())))?;
            aggregations
                .get(index)
                .map_or(AggFunction::Min, |aggregation| aggregation.function)
        } else {
            AggFunction::Sum
        };
        let combined_type = match function {
            AggFunction::Sum => sum_type(field.data_type()),
            _ => field.data_type().clone(),
        };
        fields.push(Field::new(&name, combined_type, true));
        combining.push(combine(function, name));
    }
    let combined = aggregate(
        partial,
        partial_schema,
        keys,
        &combining,
        &Arc::new(Schema::new(fields)),
    )?;
    let column = |name: String| -> Result<ArrayRef> {
        combined
            .column_by_name(&name)
            .cloned()
            .ok_or_else(|| Error::from(arrow::error::ArrowError::SchemaError(name)))
    };
    let mut columns: Vec<ArrayRef> = keys
        .iter()
        .map(|key| column(key.clone()))
        .collect::<Result<_>>()?;
    for (index, aggregation) in aggregations.iter().enumerate() {
        columns.push(match aggregation.function {
            AggFunction::Count => {
                // Sums of counts: a group always has some partial count, so never null.
                let counts = column(count_name(index))?;
                let counts = ints(&counts)?;
                Arc::new(Int64Array::from_iter_values(
                    counts.iter().map(|count| count.unwrap_or(0)),
                ))
            }
            AggFunction::Sum => {
                let sums = column(sum_name(index))?;
                let overflowed = column(overflow_name(index))?;
                let overflowed = ints(&overflowed)?;
                // Null where any partial sum overflowed.
                let overflow = arrow::array::BooleanArray::from_iter(
                    overflowed.iter().map(|flag| Some(flag.unwrap_or(0) > 0)),
                );
                arrow::compute::nullif(&sums, &overflow)?
            }
            AggFunction::Min | AggFunction::Max => column(value_name(index))?,
            AggFunction::Mean => {
                let (counts, sums) = (column(count_name(index))?, column(sum_name(index))?);
                let (counts, sums) = (ints(&counts)?, floats(&sums)?);
                Arc::new(
                    counts
                        .iter()
                        .zip(sums.iter())
                        .map(|(count, sum)| match (count, sum) {
                            (Some(count), Some(sum)) if count > 0 => Some(sum / count as f64),
                            _ => None,
                        })
                        .collect::<Float64Array>(),
                )
            }
            AggFunction::Std => {
                let counts = column(count_name(index))?;
                let sums = column(sum_name(index))?;
                let squares = column(squares_name(index))?;
                let (counts, sums, squares) = (ints(&counts)?, floats(&sums)?, floats(&squares)?);
                Arc::new(
                    (0..counts.len())
                        .map(|row| {
                            let n = counts.is_valid(row).then(|| counts.value(row))?;
                            if n < 2 || sums.is_null(row) || squares.is_null(row) {
                                return None;
                            }
                            let (n, sum, squares) = (n as f64, sums.value(row), squares.value(row));
                            let variance = ((squares - sum * sum / n) / (n - 1.0)).max(0.0);
                            Some(variance.sqrt())
                        })
                        .collect::<Float64Array>(),
                )
            }
            AggFunction::CountDistinct => {
                return Err(Error::from(arrow::error::ArrowError::InvalidArgumentError(
                    "count_distinct has no partial aggregate".into(),
                )));
            }
        });
    }
    Ok(RecordBatch::try_new(output.clone(), columns)?)
}

fn ints(array: &ArrayRef) -> Result<&Int64Array> {
    array.as_any().downcast_ref::<Int64Array>().ok_or_else(|| {
        Error::from(arrow::error::ArrowError::SchemaError(
            "expected Int64 partial counts".into(),
        ))
    })
}

fn floats(array: &ArrayRef) -> Result<&Float64Array> {
    array
        .as_any()
        .downcast_ref::<Float64Array>()
        .ok_or_else(|| {
            Error::from(arrow::error::ArrowError::SchemaError(
                "expected Float64 partial sums".into(),
            ))
        })
}
