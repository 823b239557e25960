//! The UDFs every floe binary has.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, Float64Array, StringArray, UInt32Array};
use arrow::compute::take;
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use floe_core::expr::{is_numeric, is_string};
use floe_core::plan::{ParamType, PlanError, UdfKind, UdfParams, UdfSignature};

use super::BatchUdf;
use crate::eval::safe_cast;
use crate::{Error, Result};

pub(super) fn all() -> Vec<Arc<dyn BatchUdf>> {
    vec![
        Arc::new(WhitespaceTokenize),
        Arc::new(LowercaseNormalize),
        Arc::new(Standardize),
        Arc::new(Delay),
    ]
}

fn column_param(params: &UdfParams) -> &str {
    params.str("column").unwrap_or_default()
}

/// The input schema with `column` checked by `accepts` and replaced by `replacement`.
fn replace_field(
    input: &Schema,
    column: &str,
    operator: &str,
    expected: &str,
    accepts: impl Fn(&DataType) -> bool,
    replacement: impl Fn(&Field) -> Field,
) -> Result<Schema, PlanError> {
    let Some((index, field)) = input.column_with_name(column) else {
        return Err(PlanError::unknown_column(operator, column, input));
    };
    if !accepts(field.data_type()) {
        return Err(PlanError::TypeMismatch {
            operator: operator.to_owned(),
            expr: format!("col({column:?})"),
            expected: expected.to_owned(),
            actual: field.data_type().to_string(),
        });
    }
    let mut fields: Vec<Field> = input.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields[index] = replacement(field);
    Ok(Schema::new(fields))
}

/// Column `column` of `batch` as strings; errors name the UDF that asked for it.
fn string_column(udf: &str, batch: &RecordBatch, column: &str) -> Result<StringArray> {
    let array = batch.column_by_name(column).ok_or_else(|| Error::Udf {
        name: udf.to_owned(),
        message: format!("column {column:?} is missing from the batch"),
    })?;
    let array = safe_cast(array, &DataType::Utf8)?;
    array
        .as_any()
        .downcast_ref::<StringArray>()
        .cloned()
        .ok_or_else(|| Error::Udf {
            name: udf.to_owned(),
            message: format!("column {column:?} is not a string column"),
        })
}

fn with_column(
    batch: &RecordBatch,
    output: &Schema,
    column: &str,
    values: ArrayRef,
) -> Result<RecordBatch> {
    let columns = batch
        .schema()
        .fields()
        .iter()
        .zip(batch.columns())
        .map(|(field, array)| {
            if field.name() == column {
                values.clone()
            } else {
                array.clone()
            }
        })
        .collect();
    Ok(RecordBatch::try_new(Arc::new(output.clone()), columns)?)
}

struct WhitespaceTokenize;

impl BatchUdf for WhitespaceTokenize {
    fn signature(&self) -> UdfSignature {
        UdfSignature::new("whitespace_tokenize", 1, UdfKind::RowChanging)
            .doc("one row per whitespace-separated token of a string column")
            .param("column", ParamType::Str, "the string column to split")
    }

    fn output_schema(
        &self,
        params: &UdfParams,
        input: &Schema,
        operator: &str,
    ) -> Result<Schema, PlanError> {
        replace_field(
            input,
            column_param(params),
            operator,
            "a string column",
            is_string,
            |f| Field::new(f.name(), DataType::Utf8, false),
        )
    }

    fn apply(
        &self,
        batch: &RecordBatch,
        params: &UdfParams,
        output: &Schema,
    ) -> Result<RecordBatch> {
        let column = column_param(params);
        let strings = string_column("whitespace_tokenize", batch, column)?;
        let mut source_rows: Vec<u32> = Vec::new();
        let mut tokens: Vec<&str> = Vec::new();
        for (row, text) in strings.iter().enumerate() {
            for token in text.unwrap_or_default().split_whitespace() {
                let row = u32::try_from(row).map_err(|_| Error::Udf {
                    name: "whitespace_tokenize".to_owned(),
                    message: "batch has more than 2^32 rows".to_owned(),
                })?;
                source_rows.push(row);
                tokens.push(token);
            }
        }
        let indices = UInt32Array::from(source_rows);
        let token_array: ArrayRef = Arc::new(StringArray::from(tokens));
        let columns = batch
            .schema()
            .fields()
            .iter()
            .zip(batch.columns())
            .map(|(field, array)| {
                if field.name() == column {
                    Ok(token_array.clone())
                } else {
                    Ok(take(array.as_ref(), &indices, None)?)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RecordBatch::try_new(Arc::new(output.clone()), columns)?)
    }
}

struct LowercaseNormalize;

impl BatchUdf for LowercaseNormalize {
    fn signature(&self) -> UdfSignature {
        UdfSignature::new("lowercase_normalize", 1, UdfKind::RowPreserving)
            .doc("lowercase, trim and collapse whitespace runs to one space")
            .param("column", ParamType::Str, "the string column to normalize")
    }

    fn output_schema(
        &self,
        params: &UdfParams,
        input: &Schema,
        operator: &str,
    ) -> Result<Schema, PlanError> {
        replace_field(
            input,
            column_param(params),
            operator,
            "a string column",
            is_string,
            |f| Field::new(f.name(), DataType::Utf8, f.is_nullable()),
        )
    }

    fn apply(
        &self,
        batch: &RecordBatch,
        params: &UdfParams,
        output: &Schema,
    ) -> Result<RecordBatch> {
        let column = column_param(params);
        let strings = string_column("lowercase_normalize", batch, column)?;
        let normalized: StringArray = strings
            .iter()
            .map(|text| {
                text.map(|text| {
                    text.split_whitespace()
                        .map(str::to_lowercase)
                        .collect::<Vec<_>>()
                        .join(" ")
                })
            })
            .collect();
        with_column(batch, output, column, Arc::new(normalized))
    }
}

struct Standardize;

impl BatchUdf for Standardize {
    fn signature(&self) -> UdfSignature {
        UdfSignature::new("standardize", 1, UdfKind::RowPreserving)
            .doc("(x - mean) / std as Float64; std = 0 gives null")
            .param(
                "column",
                ParamType::Str,
                "the numeric column to standardize",
            )
            .param("mean", ParamType::Float, "the value subtracted")
            .param_with_default("std", ParamType::Float, 1.0, "the divisor")
    }

    fn output_schema(
        &self,
        params: &UdfParams,
        input: &Schema,
        operator: &str,
    ) -> Result<Schema, PlanError> {
        replace_field(
            input,
            column_param(params),
            operator,
            "a numeric column",
            is_numeric,
            |f| Field::new(f.name(), DataType::Float64, true),
        )
    }

    fn apply(
        &self,
        batch: &RecordBatch,
        params: &UdfParams,
        output: &Schema,
    ) -> Result<RecordBatch> {
        let column = column_param(params);
        let mean = params.float("mean").unwrap_or(0.0);
        let std = params.float("std").unwrap_or(1.0);
        let array = batch.column_by_name(column).ok_or_else(|| Error::Udf {
            name: "standardize".to_owned(),
            message: format!("column {column:?} missing from the batch"),
        })?;
        let values = safe_cast(array, &DataType::Float64)?;
        let values = values
            .as_any()
            .downcast_ref::<Float64Array>()
            .ok_or_else(|| Error::Udf {
                name: "standardize".to_owned(),
                message: format!("column {column:?} is not numeric"),
            })?;
        let standardized: Float64Array = values
            .iter()
            .map(|v| v.and_then(|v| (std != 0.0).then(|| (v - mean) / std)))
            .collect();
        with_column(batch, output, column, Arc::new(standardized))
    }
}

/// Passes batches through unchanged after sleeping: a stand-in for an expensive model or API
/// call, for demos, benchmarks of scheduling overhead and failure tests that need a task to be
/// running when a process is killed.
struct Delay;

/// The longest sleep one call may ask for, so a typo cannot park a worker for days.
const MAX_DELAY_MS: i64 = 60_000;

impl BatchUdf for Delay {
    fn signature(&self) -> UdfSignature {
        UdfSignature::new("delay", 1, UdfKind::RowPreserving)
            .doc("sleeps `ms` milliseconds per batch, then passes it through unchanged")
            .param(
                "ms",
                ParamType::Int,
                "milliseconds to sleep per batch (at most 60000)",
            )
    }

    fn output_schema(
        &self,
        params: &UdfParams,
        input: &Schema,
        operator: &str,
    ) -> Result<Schema, PlanError> {
        let ms = params.int("ms").unwrap_or_default();
        if !(0..=MAX_DELAY_MS).contains(&ms) {
            return Err(PlanError::InvalidArgument {
                operator: operator.to_owned(),
                message: format!("delay ms must be 0..={MAX_DELAY_MS}, got {ms}"),
            });
        }
        Ok(input.clone())
    }

    fn apply(
        &self,
        batch: &RecordBatch,
        params: &UdfParams,
        _output: &Schema,
    ) -> Result<RecordBatch> {
        let ms = params.int("ms").unwrap_or_default().clamp(0, MAX_DELAY_MS);
        std::thread::sleep(std::time::Duration::from_millis(ms.unsigned_abs()));
        Ok(batch.clone())
    }
}
