//! Row-wise operator kernels: what a fused map stage does to each block.

use std::sync::Arc;

use arrow::compute::filter_record_batch;
use arrow::datatypes::{Field, Schema};
use arrow::record_batch::RecordBatch;
use floe_core::plan::{Operator, renamed_fields};

use crate::eval::{evaluate, evaluate_predicate, safe_cast};
use crate::udf::Registry;
use crate::udf::process::ProcessSessions;
use crate::{Error, Result};

/// What row-wise operators call out to: the named UDFs of this binary and the task's
/// process-UDF children.
#[derive(Clone, Copy)]
pub struct RowOpContext<'a> {
    pub registry: &'a Registry,
    pub processes: &'a ProcessSessions<'a>,
}

/// Applies `ops` in order to `batch` (a fused stage's row-wise operators).
pub fn apply_row_ops(
    batch: RecordBatch,
    ops: &[Operator],
    context: RowOpContext,
) -> Result<RecordBatch> {
    ops.iter()
        .try_fold(batch, |batch, op| apply_row_op(&batch, op, context))
}

fn columns_named(batch: &RecordBatch, names: &[String]) -> Result<RecordBatch> {
    let indices = names
        .iter()
        .map(|name| Ok(batch.schema().index_of(name)?))
        .collect::<Result<Vec<_>>>()?;
    Ok(batch.project(&indices)?)
}

/// One row-wise operator over one batch.
pub fn apply_row_op(
    batch: &RecordBatch,
    op: &Operator,
    context: RowOpContext,
) -> Result<RecordBatch> {
    match op {
        Operator::WithColumn { name, expr } => {
            let schema = batch.schema();
            let field = expr.to_field(&schema, "with_column", name)?;
            let values = safe_cast(&evaluate(expr, batch)?, field.data_type())?;
            let mut fields: Vec<Field> =
                schema.fields().iter().map(|f| f.as_ref().clone()).collect();
            let mut columns = batch.columns().to_vec();
            match fields.iter().position(|f| f.name() == name) {
                Some(index) => {
                    fields[index] = field;
                    columns[index] = values;
                }
                None => {
                    fields.push(field);
                    columns.push(values);
                }
            }
            Ok(RecordBatch::try_new(
                Arc::new(Schema::new(fields)),
                columns,
            )?)
        }
        Operator::Select { columns } => columns_named(batch, columns),
        Operator::Drop { columns } => {
            let keep: Vec<String> = batch
                .schema()
                .fields()
                .iter()
                .map(|f| f.name().clone())
                .filter(|name| !columns.contains(name))
                .collect();
            columns_named(batch, &keep)
        }
        Operator::Rename { pairs } => {
            let fields = renamed_fields(&batch.schema(), pairs);
            Ok(RecordBatch::try_new(
                Arc::new(Schema::new(fields)),
                batch.columns().to_vec(),
            )?)
        }
        Operator::Filter { predicate } => {
            let mask = evaluate_predicate(predicate, batch)?;
            Ok(filter_record_batch(batch, &mask)?)
        }
        Operator::Udf { call, .. } => context.registry.apply(call, batch),
        Operator::ProcessUdf(udf) => context.processes.call(udf, batch),
        other => Err(Error::NotRowWise {
            operator: other.name(),
        }),
    }
}

/// The streaming part of `limit(n)`: passes the first `n` rows of a stream of batches.
#[derive(Debug, Clone, Copy)]
pub struct Limiter {
    remaining: u64,
}

impl Limiter {
    pub fn new(n: u64) -> Self {
        Self { remaining: n }
    }

    /// The part of `batch` still within the limit (`None` once the limit is reached).
    pub fn admit(&mut self, batch: RecordBatch) -> Option<RecordBatch> {
        if self.remaining == 0 {
            return None;
        }
        let rows = batch.num_rows() as u64;
        if rows <= self.remaining {
            self.remaining -= rows;
            return Some(batch);
        }
        // `remaining < rows`, and `rows` came from a usize.
        let take = self.remaining as usize;
        self.remaining = 0;
        Some(batch.slice(0, take))
    }

    pub fn is_done(&self) -> bool {
        self.remaining == 0
    }
}
