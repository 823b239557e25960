//! Unique: a hash exchange on the distinct columns; each reduce task keeps the first
//! occurrence of each distinct row of its partition.

use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::RecordBatch;

use super::columns::gather;
use super::keys::{Grouping, hash_partitions};
use super::{Exchange, MapTask, ReduceTask, Reduced, Routing, all_columns, route_scattered};
use crate::Result;
use crate::task::Partitions;

/// Distinct rows over `columns` (all columns when empty) of `batches` (of schema `input`),
/// giving `output` (the projection to `columns`, or the whole row): each distinct row's first
/// occurrence, in input order.
pub fn unique(
    batches: &[RecordBatch],
    input: &SchemaRef,
    columns: &[String],
    output: &SchemaRef,
) -> Result<RecordBatch> {
    let all: Vec<String>;
    let keys = if columns.is_empty() {
        all = input.fields().iter().map(|f| f.name().clone()).collect();
        &all
    } else {
        columns
    };
    let grouping = Grouping::of(batches, input, keys)?;
    gather(batches, output, &grouping.first)
}

/// `Operator::Unique`: distinct over `columns`, or over whole rows when empty.
pub struct Unique<'a> {
    pub columns: &'a [String],
}

impl Unique<'_> {
    fn distinct_columns(&self, input: &Schema) -> Vec<String> {
        if self.columns.is_empty() {
            all_columns(input)
        } else {
            self.columns.to_vec()
        }
    }
}

impl Exchange for Unique<'_> {
    fn routing(&self) -> Routing<'_> {
        Routing::Hash
    }

    fn partition(&self, task: &MapTask<'_>, batches: Vec<RecordBatch>) -> Result<Partitions> {
        let columns = self.distinct_columns(task.schema);
        route_scattered(task, batches, |batch| {
            hash_partitions(batch, &columns, task.partitions as usize)
        })
    }

    fn reduce(&self, task: ReduceTask<'_>) -> Result<Reduced> {
        let input = task.schema(0)?.clone();
        let output = task.output.clone();
        unique(&task.into_batches(), &input, self.columns, &output).map(Reduced::Rows)
    }

    fn key_columns(&self, input: &Schema) -> Vec<String> {
        self.distinct_columns(input)
    }
}
