//! Your own `floe` binary, with your own UDFs on the cluster.
//!
//! UDFs are Rust code compiled into the binaries that run them. This program is the whole
//! `floe` command line plus one more UDF, `square@1`; run the cluster's schedulers and nodes
//! (and so their workers) with it, and build datasets in your client with the same registry
//! (`Dataset::with_udfs(Arc::new(registry()))`) so that plans using it validate.
//!
//! Build with `cargo build --example custom_floe`, then use
//! `target/debug/examples/custom_floe` wherever you would use `floe`.

use std::sync::Arc;

use arrow::array::{Array, Float64Array};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use floe::Registry;
use floe_core::plan::{ParamType, PlanError, UdfKind, UdfParams, UdfSignature};
use floe_engine::udf::BatchUdf;

/// Replaces a numeric column by its square, as `Float64`.
struct Square;

impl BatchUdf for Square {
    fn signature(&self) -> UdfSignature {
        UdfSignature::new("square", 1, UdfKind::RowPreserving)
            .doc("x * x as Float64")
            .param("column", ParamType::Str, "the numeric column to square")
    }

    fn output_schema(
        &self,
        params: &UdfParams,
        input: &Schema,
        operator: &str,
    ) -> Result<Schema, PlanError> {
        let column = params.str("column").unwrap_or_default();
        let Some((index, _)) = input.column_with_name(column) else {
            return Err(PlanError::unknown_column(operator, column, input));
        };
        let mut fields: Vec<Field> = input.fields().iter().map(|f| f.as_ref().clone()).collect();
        fields[index] = Field::new(column, DataType::Float64, true);
        Ok(Schema::new(fields))
    }

    fn apply(
        &self,
        batch: &RecordBatch,
        params: &UdfParams,
        output: &Schema,
    ) -> floe_engine::Result<RecordBatch> {
        let column = params.str("column").unwrap_or_default();
        let udf_error = |message: String| floe_engine::Error::Udf {
            name: "square".to_owned(),
            message,
        };
        let (index, _) = batch
            .schema()
            .column_with_name(column)
            .ok_or_else(|| udf_error(format!("column {column:?} is missing")))?;
        let values = arrow::compute::cast(batch.column(index), &DataType::Float64)?;
        let values = values
            .as_any()
            .downcast_ref::<Float64Array>()
            .ok_or_else(|| udf_error(format!("column {column:?} is not numeric")))?;
        let squared: Float64Array = values.iter().map(|v| v.map(|v| v * v)).collect();
        let mut columns = batch.columns().to_vec();
        columns[index] = Arc::new(squared);
        Ok(RecordBatch::try_new(Arc::new(output.clone()), columns)?)
    }
}

/// The built-in UDFs and `square@1`.
fn registry() -> Registry {
    let mut registry = Registry::with_builtins();
    if let Err(error) = registry.register(Arc::new(Square)) {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
    registry
}

fn main() -> std::process::ExitCode {
    floe::run(registry())
}
