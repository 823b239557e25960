//! Values read back out of a job's result batches.

use arrow::array::{Array, Int64Array};
use arrow::record_batch::RecordBatch;

/// The Int64 column `name` of every batch, in batch order.
pub fn int_column(batches: &[RecordBatch], name: &str) -> Vec<i64> {
    batches
        .iter()
        .flat_map(|batch| {
            let column = batch.column_by_name(name).unwrap();
            let values = column.as_any().downcast_ref::<Int64Array>().unwrap();
            values.values().to_vec()
        })
        .collect()
}
