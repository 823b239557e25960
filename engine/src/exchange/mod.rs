//! The worker side of all-to-all stages: one task of a shuffle's map side (partition, or for a
//! sort: sample, boundaries, range partition) or reduce side, over the task's input blocks.
//! The kernels are [`crate::exchange::kernels`]'s; this module only routes blocks to them.

use std::sync::Arc;

use arrow::datatypes::{Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use floe_core::plan::Operator;

use floe_core::plan::task::StageInput;
pub mod kernels;
pub mod partial;

use self::kernels::JoinSide;
use crate::{Error, Result};

/// Rows sampled per output partition for a sort's range boundaries, over all input blocks.
pub const SAMPLE_ROWS_PER_PARTITION: u32 = 10;

/// What an all-to-all task produces: for the map side, exactly one batch per partition (index
/// = partition, possibly empty); for the reduce side, the output rows.
pub fn run(
    operator: &Operator,
    output: &SchemaRef,
    input: StageInput,
    input_schemas: &[SchemaRef],
    inputs: Vec<Vec<RecordBatch>>,
) -> Result<Vec<RecordBatch>> {
    let unsupported = || Error::StageInput {
        stage: operator.name().to_owned(),
        input: format!("{input:?}"),
    };
    let first_schema = || input_schemas.first().cloned().ok_or_else(unsupported);
    match input {
        StageInput::Partition {
            partitions,
            side,
            offset,
            total,
            seed,
        } => {
            let schema = input_schemas
                .get(usize::from(side))
                .cloned()
                .ok_or_else(unsupported)?;
            if let Operator::Aggregate { keys, aggregations } = operator
                && partial::supports_partial(aggregations)
            {
                let batches: Vec<RecordBatch> = inputs.into_iter().flatten().collect();
                let partial = partial::partial_aggregate(&batches, &schema, keys, aggregations)?;
                return kernels::hash_partition(&partial, keys, partitions);
            }
            let mut offset = offset;
            let mut parts: Vec<Vec<RecordBatch>> = vec![Vec::new(); partitions as usize];
            for batch in inputs.into_iter().flatten() {
                let rows = batch.num_rows() as u64;
                let split = match operator {
                    Operator::Aggregate { keys, .. } => {
                        kernels::hash_partition(&batch, keys, partitions)?
                    }
                    Operator::Repartition { keys, .. } if !keys.is_empty() => {
                        kernels::hash_partition(&batch, keys, partitions)?
                    }
                    Operator::Repartition { .. } => {
                        kernels::split_by_position(&batch, offset, total, partitions)?
                    }
                    Operator::RandomShuffle { .. } => {
                        kernels::random_partition(&batch, partitions, seed ^ offset)?
                    }
                    Operator::Join {
                        left_keys,
                        right_keys,
                        ..
                    } => {
                        let keys = if side == 0 { left_keys } else { right_keys };
                        kernels::hash_partition(&batch, keys, partitions)?
                    }
                    Operator::Unique { columns } => {
                        let columns = if columns.is_empty() {
                            schema.fields().iter().map(|f| f.name().clone()).collect()
                        } else {
                            columns.clone()
                        };
                        kernels::hash_partition(&batch, &columns, partitions)?
                    }
                    _ => return Err(unsupported()),
                };
                offset += rows;
                for (part, piece) in parts.iter_mut().zip(split) {
                    part.push(piece);
                }
            }
            parts
                .into_iter()
                .map(|pieces| Ok(arrow::compute::concat_batches(&schema, &pieces)?))
                .collect()
        }
        StageInput::Sample { rows, seed } => {
            let Operator::Sort { keys } = operator else {
                return Err(unsupported());
            };
            let schema = first_schema()?;
            let key_schema = key_schema(&schema, keys)?;
            let batches: Vec<RecordBatch> = inputs.into_iter().flatten().collect();
            let all = arrow::compute::concat_batches(&schema, &batches)?;
            let sample = if all.num_rows() == 0 {
                RecordBatch::new_empty(key_schema)
            } else {
                kernels::sample_keys(&all, keys, rows as usize, seed)?
            };
            Ok(vec![sample])
        }
        StageInput::Boundaries { partitions } => {
            let Operator::Sort { keys } = operator else {
                return Err(unsupported());
            };
            let key_schema = key_schema(first_schema()?.as_ref(), keys)?;
            let samples: Vec<RecordBatch> = inputs.into_iter().flatten().collect();
            Ok(vec![kernels::range_boundaries(
                &samples,
                &key_schema,
                keys,
                partitions,
            )?])
        }
        StageInput::RangePartition { partitions } => {
            let Operator::Sort { keys } = operator else {
                return Err(unsupported());
            };
            let schema = first_schema()?;
            let mut inputs = inputs;
            let boundaries = inputs.pop().ok_or_else(unsupported)?;
            let key_schema = key_schema(&schema, keys)?;
            let boundaries = arrow::compute::concat_batches(&key_schema, &boundaries)?;
            let mut parts: Vec<Vec<RecordBatch>> = vec![Vec::new(); partitions as usize];
            for batch in inputs.into_iter().flatten() {
                let split = kernels::range_partition(&batch, keys, &boundaries, partitions)?;
                for (part, piece) in parts.iter_mut().zip(split) {
                    part.push(piece);
                }
            }
            parts
                .iter()
                .map(|pieces| kernels::merge_sorted(pieces, &schema, keys))
                .collect()
        }
        StageInput::Reduce { left, seed, .. } => {
            let left = left as usize;
            let batches = |inputs: Vec<Vec<RecordBatch>>| -> Vec<RecordBatch> {
                inputs.into_iter().flatten().collect()
            };
            let reduced = match operator {
                Operator::Sort { keys } => {
                    kernels::merge_sorted(&batches(inputs), &first_schema()?, keys)?
                }
                Operator::Aggregate { keys, aggregations }
                    if partial::supports_partial(aggregations) =>
                {
                    let schema =
                        partial::partial_schema(first_schema()?.as_ref(), keys, aggregations)?;
                    partial::final_aggregate(&batches(inputs), &schema, keys, aggregations, output)?
                }
                Operator::Aggregate { keys, aggregations } => kernels::aggregate(
                    &batches(inputs),
                    &first_schema()?,
                    keys,
                    aggregations,
                    output,
                )?,
                Operator::Repartition { .. } => {
                    arrow::compute::concat_batches(&first_schema()?, &batches(inputs))?
                }
                Operator::RandomShuffle { .. } => {
                    kernels::permute(&batches(inputs), &first_schema()?, seed)?
                }
                Operator::Join {
                    left_keys,
                    right_keys,
                    how,
                } => {
                    let right_schema = input_schemas.get(1).cloned().ok_or_else(unsupported)?;
                    let mut inputs = inputs;
                    let right = batches(inputs.split_off(left.min(inputs.len())));
                    let left = batches(inputs);
                    kernels::join(
                        JoinSide {
                            batches: &left,
                            schema: &first_schema()?,
                            keys: left_keys,
                        },
                        JoinSide {
                            batches: &right,
                            schema: &right_schema,
                            keys: right_keys,
                        },
                        *how,
                        output,
                    )?
                }
                Operator::Unique { columns } => {
                    kernels::unique(&batches(inputs), &first_schema()?, columns, output)?
                }
                _ => return Err(unsupported()),
            };
            Ok(vec![reduced])
        }
        StageInput::HotKey { left } => {
            let columns: Vec<String> = match operator {
                Operator::Aggregate { keys, .. } | Operator::Repartition { keys, .. } => {
                    keys.clone()
                }
                Operator::Join { left_keys, .. } => left_keys.clone(),
                Operator::Unique { columns } if !columns.is_empty() => columns.clone(),
                Operator::Unique { .. } => first_schema()?
                    .fields()
                    .iter()
                    .map(|field| field.name().clone())
                    .collect(),
                Operator::Sort { keys } => keys.iter().map(|key| key.column.clone()).collect(),
                _ => Vec::new(),
            };
            let mut inputs = inputs;
            inputs.truncate(left as usize);
            let batches: Vec<RecordBatch> = inputs.into_iter().flatten().collect();
            Ok(vec![kernels::most_frequent_key(&batches, &columns)?])
        }
        _ => Err(unsupported()),
    }
}

/// The sort key columns of `schema`, in key order.
fn key_schema(schema: &Schema, keys: &[floe_core::plan::SortKey]) -> Result<SchemaRef> {
    let fields = keys
        .iter()
        .map(|key| {
            schema
                .field_with_name(&key.column)
                .cloned()
                .map_err(Error::from)
        })
        .collect::<Result<Vec<Field>>>()?;
    Ok(Arc::new(Schema::new(fields)))
}
