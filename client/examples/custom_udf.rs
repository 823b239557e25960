//! Registering your own UDF and using it in a pipeline.
//!
//! Run with `cargo run -p floe-client --example custom_udf`.
//!
//! A UDF is Rust code compiled into the binaries that run it, so the same registration goes
//! into two places: the client (which validates plans against the registry and, with the local
//! executor, runs them, as here) and the `floe` binary the nodes run (whose workers will look
//! the code up by `name@version`). This example does the first half and runs the plan
//! in-process; `examples/custom_floe.rs` (in the root package) is the second half: a `floe`
//! binary with an extra UDF, whose nodes and workers run it on a cluster.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, Float64Array};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use floe_client::{Dataset, UdfCall, col, lit};
use floe_core::plan::{ParamType, PlanError, UdfKind, UdfParams, UdfSignature};
use floe_engine::udf::{BatchUdf, Registry};

/// Clamps a numeric column into `[low, high]`, as `Float64`.
struct Clip;

impl BatchUdf for Clip {
    fn signature(&self) -> UdfSignature {
        UdfSignature::new("clip", 1, UdfKind::RowPreserving)
            .doc("clamp a numeric column into [low, high]")
            .param("column", ParamType::Str, "the column to clamp")
            .param_with_default("low", ParamType::Float, 0.0, "lower bound")
            .param_with_default("high", ParamType::Float, 1.0, "upper bound")
    }

    fn output_schema(
        &self,
        params: &UdfParams,
        input: &Schema,
        operator: &str,
    ) -> Result<Schema, PlanError> {
        let column = params.str("column").unwrap_or_default();
        let Some((index, field)) = input.column_with_name(column) else {
            return Err(PlanError::UnknownColumn {
                operator: operator.to_owned(),
                column: column.to_owned(),
                available: floe_core::plan::describe_schema(input),
            });
        };
        let mut fields: Vec<Field> = input.fields().iter().map(|f| f.as_ref().clone()).collect();
        fields[index] = Field::new(column, DataType::Float64, field.is_nullable());
        Ok(Schema::new(fields))
    }

    fn apply(
        &self,
        batch: &RecordBatch,
        params: &UdfParams,
        output: &Schema,
    ) -> floe_engine::Result<RecordBatch> {
        let column = params.str("column").unwrap_or_default();
        let (low, high) = (
            params.float("low").unwrap_or(0.0),
            params.float("high").unwrap_or(1.0),
        );
        let index = batch.schema().index_of(column)?;
        let values = arrow::compute::cast(batch.column(index), &DataType::Float64)?;
        let values = values
            .as_any()
            .downcast_ref::<Float64Array>()
            .ok_or_else(|| floe_engine::Error::Udf {
                name: "clip".to_owned(),
                message: format!("{column} is not numeric"),
            })?;
        let clipped: Float64Array = values
            .iter()
            .map(|v| v.map(|v| v.clamp(low, high)))
            .collect();
        let mut columns = batch.columns().to_vec();
        columns[index] = Arc::new(clipped) as ArrayRef;
        Ok(RecordBatch::try_new(Arc::new(output.clone()), columns)?)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut registry = Registry::with_builtins();
    registry.register(Arc::new(Clip))?;

    let dataset = Dataset::range(10)?
        .with_udfs(Arc::new(registry))
        .with_column("x", col("id").cast(DataType::Float64) / lit(4.0))?
        .map_batches(
            UdfCall::new("clip", 1)
                .with("column", "x")
                .with("high", 2.0),
        )?
        .filter(col("x").gt(lit(0.5)))?;
    println!("{}", dataset.explain()?);
    for batch in dataset.execute_locally()?.batches {
        let ids = batch.column(0);
        let xs = batch.column(1);
        for row in 0..batch.num_rows() {
            println!(
                "id={:?} x={:?}",
                arrow::util::display::array_value_to_string(ids, row)?,
                arrow::util::display::array_value_to_string(xs, row)?
            );
        }
    }
    // A dataset checked against the built-ins only does not know `clip`: an error when the
    // plan is built.
    if let Err(error) = Dataset::range(3)?.map_batches(UdfCall::new("clip", 1).with("column", "id"))
    {
        println!("without the registration: {error}");
    }
    Ok(())
}
