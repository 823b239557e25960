//! Groupby-aggregate: a hash exchange on the group keys. Where every aggregation has a
//! partial form ([`partial`]), each map task aggregates its own blocks first, so the shuffle
//! carries one row per group and map task; the reduce side combines the partials.

pub mod partial;

use std::cmp::Ordering;
use std::collections::HashSet;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, ArrowPrimitiveType, Float64Array, Int64Array, PrimitiveArray};
use arrow::datatypes::{DataType, Float64Type, Int64Type, Schema, SchemaRef, UInt64Type};
use arrow::error::ArrowError;
use arrow::record_batch::RecordBatch;
use arrow::row::{RowConverter, Rows, SortField};
use floe_core::plan::{AggFunction, Aggregation};

use super::columns::{
    interleave_or_null, interleave_picks, is_null, named_columns, primitive, with_row_count,
};
use super::keys::{
    GroupIds, Grouping, hash_partition, hash_partitions, key_converter, normalize_key,
};
use super::{Exchange, MapTask, ReduceTask, Reduced, Routing, partition_blocks, route_scattered};
use crate::Result;
use crate::eval::safe_cast;
use crate::task::Partitions;

/// Groups all rows of `batches` (of schema `input`) by `keys` and computes `aggregations`,
/// giving exactly `output`: the keys (each group's first row's values), then one column per
/// aggregation.
///
/// Count without a column counts rows, with one its non-null values; Sum is Int64, UInt64 or
/// Float64 (an integer sum that does not fit is null); Mean is Float64; Min/Max keep the
/// column's type and follow the sort order (NaN above every number); Std is the sample
/// standard deviation (null below two values); CountDistinct counts distinct non-null values.
/// Every aggregate but Count ignores nulls and is null for a group without values. Null keys
/// form a group of their own. Groups come in order of first appearance; with no keys there is
/// exactly one row, even for no input.
pub fn aggregate(
    batches: &[RecordBatch],
    input: &SchemaRef,
    keys: &[String],
    aggregations: &[Aggregation],
    output: &SchemaRef,
) -> Result<RecordBatch> {
    let grouping = Grouping::of(batches, input, keys)?;
    let groups = if keys.is_empty() {
        1
    } else {
        grouping.first.len()
    };
    let mut columns = Vec::with_capacity(keys.len() + aggregations.len());
    for key in keys {
        let values = named_columns(batches, key)?;
        let data_type = input.field_with_name(key)?.data_type();
        columns.push(interleave_picks(&values, data_type, &grouping.first)?);
    }
    for aggregation in aggregations {
        columns.push(aggregate_column(
            batches,
            input,
            aggregation,
            &grouping.ids,
            groups,
        )?);
    }
    with_row_count(output, columns, groups)
}

/// One aggregation's output column over `groups` groups.
pub(crate) fn aggregate_column(
    batches: &[RecordBatch],
    input: &Schema,
    aggregation: &Aggregation,
    ids: &GroupIds,
    groups: usize,
) -> Result<ArrayRef> {
    let Some(name) = &aggregation.column else {
        let mut counts = vec![0_i64; groups];
        for (batch, rows) in batches.iter().map(RecordBatch::num_rows).enumerate() {
            match ids {
                GroupIds::One => counts[0] += rows as i64,
                GroupIds::PerRow(_) => ids.for_each(batch, rows, |_, id| counts[id] += 1),
            }
        }
        return Ok(Arc::new(Int64Array::from(counts)));
    };
    let values = named_columns(batches, name)?;
    let data_type = input.field_with_name(name)?.data_type();
    Ok(match aggregation.function {
        AggFunction::Count => {
            let mut counts = vec![0_i64; groups];
            for (batch, array) in values.iter().enumerate() {
                let nulls = array.logical_nulls();
                match ids {
                    GroupIds::One => {
                        let null_count = nulls.as_ref().map_or(0, |nulls| nulls.null_count());
                        counts[0] += (array.len() - null_count) as i64;
                    }
                    GroupIds::PerRow(_) => ids.for_each(batch, array.len(), |row, id| {
                        if !is_null(nulls.as_ref(), row) {
                            counts[id] += 1;
                        }
                    }),
                }
            }
            Arc::new(Int64Array::from(counts))
        }
        AggFunction::Sum if data_type.is_floating() && matches!(ids, GroupIds::One) => {
            let mut total: Option<f64> = None;
            for array in &values {
                let cast = safe_cast(array, &DataType::Float64)?;
                if let Some(sum) = arrow::compute::sum(primitive::<Float64Type>(&cast)?) {
                    *total.get_or_insert(0.0) += sum;
                }
            }
            Arc::new(Float64Array::from(vec![total]))
        }
        AggFunction::Sum if data_type.is_floating() => {
            let mut sums: Vec<Option<f64>> = vec![None; groups];
            for_each_value::<Float64Type>(&values, ids, |id, value| {
                *sums[id].get_or_insert(0.0) += value;
            })?;
            Arc::new(Float64Array::from(sums))
        }
        AggFunction::Sum if data_type.is_unsigned_integer() => {
            Arc::new(integer_sum::<UInt64Type>(&values, ids, groups)?)
        }
        AggFunction::Sum => Arc::new(integer_sum::<Int64Type>(&values, ids, groups)?),
        AggFunction::Mean => {
            let mut totals = vec![(0.0_f64, 0_u64); groups];
            for_each_value::<Float64Type>(&values, ids, |id, value| {
                totals[id].0 += value;
                totals[id].1 += 1;
            })?;
            let means: Float64Array = totals
                .into_iter()
                .map(|(sum, count)| (count > 0).then(|| sum / count as f64))
                .collect();
            Arc::new(means)
        }
        AggFunction::Std => {
            // Welford's running mean and sum of squared deviations: stable where the
            // difference of sums of squares would cancel.
            let mut states = vec![(0_u64, 0.0_f64, 0.0_f64); groups];
            for_each_value::<Float64Type>(&values, ids, |id, value| {
                let (count, mean, squares) = &mut states[id];
                *count += 1;
                let delta = value - *mean;
                *mean += delta / *count as f64;
                *squares += delta * (value - *mean);
            })?;
            let deviations: Float64Array = states
                .into_iter()
                .map(|(count, _, squares)| {
                    (count > 1).then(|| (squares / (count - 1) as f64).sqrt())
                })
                .collect();
            Arc::new(deviations)
        }
        AggFunction::Min => extreme(&values, data_type, ids, groups, Ordering::Less)?,
        AggFunction::Max => extreme(&values, data_type, ids, groups, Ordering::Greater)?,
        AggFunction::CountDistinct => {
            let converter = key_converter(std::iter::once(data_type))?;
            let encoded = values
                .iter()
                .map(|array| Ok(converter.convert_columns(&[normalize_key(array)?])?))
                .collect::<Result<Vec<Rows>>>()?;
            let mut seen: HashSet<(usize, &[u8])> = HashSet::new();
            let mut counts = vec![0_i64; groups];
            for (batch, (array, rows)) in values.iter().zip(&encoded).enumerate() {
                let nulls = array.logical_nulls();
                ids.for_each(batch, array.len(), |row, id| {
                    if !is_null(nulls.as_ref(), row) && seen.insert((id, rows.row(row).data())) {
                        counts[id] += 1;
                    }
                });
            }
            Arc::new(Int64Array::from(counts))
        }
    })
}

/// Calls `visit(group, value)` for every non-null value of `values` cast to `T`.
pub(crate) fn for_each_value<T: ArrowPrimitiveType>(
    values: &[ArrayRef],
    ids: &GroupIds,
    mut visit: impl FnMut(usize, T::Native),
) -> Result<()> {
    for (batch, array) in values.iter().enumerate() {
        let cast = safe_cast(array, &T::DATA_TYPE)?;
        let typed = primitive::<T>(&cast)?;
        match (ids, typed.nulls()) {
            (GroupIds::One, None) => typed.values().iter().for_each(|value| visit(0, *value)),
            _ => ids.for_each(batch, typed.len(), |row, id| {
                if typed.is_valid(row) {
                    visit(id, typed.value(row));
                }
            }),
        }
    }
    Ok(())
}

/// Per-group sums in `T` (Int64 or UInt64), null where a sum does not fit. Summed in i128, so
/// the result does not depend on the order of the values.
pub(crate) fn integer_sum<T: ArrowPrimitiveType>(
    values: &[ArrayRef],
    ids: &GroupIds,
    groups: usize,
) -> Result<PrimitiveArray<T>>
where
    T::Native: Into<i128> + TryFrom<i128>,
{
    let mut sums: Vec<Option<i128>> = vec![None; groups];
    for_each_value::<T>(values, ids, |id, value| {
        let sum = sums[id].get_or_insert(0);
        *sum = sum.saturating_add(value.into());
    })?;
    Ok(sums
        .into_iter()
        .map(|sum| sum.and_then(|sum| T::Native::try_from(sum).ok()))
        .collect())
}

/// Per-group minimum (`keep` = Less) or maximum (Greater) in the column's sort order; the
/// first of equal values wins.
pub(crate) fn extreme(
    values: &[ArrayRef],
    data_type: &DataType,
    ids: &GroupIds,
    groups: usize,
    keep: Ordering,
) -> Result<ArrayRef> {
    let converter = RowConverter::new(vec![SortField::new(data_type.clone())])?;
    let encoded = values
        .iter()
        .map(|array| converter.convert_columns(std::slice::from_ref(array)))
        .collect::<Result<Vec<Rows>, ArrowError>>()?;
    let mut best: Vec<Option<(usize, usize)>> = vec![None; groups];
    for (batch, array) in values.iter().enumerate() {
        let nulls = array.logical_nulls();
        ids.for_each(batch, array.len(), |row, id| {
            if is_null(nulls.as_ref(), row) {
                return;
            }
            let better = best[id].is_none_or(|(best_batch, best_row)| {
                encoded[batch]
                    .row(row)
                    .cmp(&encoded[best_batch].row(best_row))
                    == keep
            });
            if better {
                best[id] = Some((batch, row));
            }
        });
    }
    interleave_or_null(values.to_vec(), data_type, best.into_iter())
}

/// `Operator::Aggregate`.
pub struct Aggregate<'a> {
    pub keys: &'a [String],
    pub aggregations: &'a [Aggregation],
}

impl Exchange for Aggregate<'_> {
    fn routing(&self) -> Routing<'_> {
        Routing::Hash
    }

    fn fixed_partitions(&self) -> Option<u32> {
        self.keys.is_empty().then_some(1)
    }

    fn partition(&self, task: &MapTask<'_>, batches: Vec<RecordBatch>) -> Result<Partitions> {
        if partial::supports_partial(self.aggregations) {
            let partial =
                partial::partial_aggregate(&batches, task.schema, self.keys, self.aggregations)?;
            return hash_partition(&partial, self.keys, task.partitions).map(partition_blocks);
        }
        route_scattered(task, batches, |batch| {
            hash_partitions(batch, self.keys, task.partitions as usize)
        })
    }

    fn reduce(&self, task: ReduceTask<'_>) -> Result<Reduced> {
        let input = task.schema(0)?.clone();
        let output = task.output.clone();
        let batches = task.into_batches();
        if partial::supports_partial(self.aggregations) {
            let schema = partial::partial_schema(&input, self.keys, self.aggregations)?;
            return partial::final_aggregate(
                &batches,
                &schema,
                self.keys,
                self.aggregations,
                &output,
            )
            .map(Reduced::Rows);
        }
        aggregate(&batches, &input, self.keys, self.aggregations, &output).map(Reduced::Rows)
    }

    fn key_columns(&self, _input: &Schema) -> Vec<String> {
        self.keys.to_vec()
    }
}
