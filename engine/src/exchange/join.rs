//! Join: a hash exchange of both sides on their keys; each reduce task joins one partition's
//! left and right rows (a hash join on the right side).

use std::collections::HashMap;

use arrow::array::Array;
use arrow::buffer::NullBuffer;
use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use arrow::row::{RowConverter, Rows};
use floe_core::expr::common_type;
use floe_core::plan::JoinType;

use super::columns::{
    column, interleave_or_null, interleave_picks, invalid, is_null, named_columns, with_row_count,
};
use super::keys::{hash_partitions, key_converter, normalize_key};
use super::{Exchange, MapTask, ReduceTask, Reduced, Routing, route_scattered};
use crate::Result;
use crate::eval::safe_cast;
use crate::task::Partitions;

/// One side of a join: its rows, their schema (needed when there are no rows) and its keys.
#[derive(Debug, Clone, Copy)]
pub struct JoinSide<'a> {
    pub batches: &'a [RecordBatch],
    pub schema: &'a SchemaRef,
    pub keys: &'a [String],
}

/// Joins all rows of `left` with all rows of `right` (a hash join on the right side), giving
/// exactly `output`: the left columns, then the right non-key columns (for semi and anti
/// joins, the left columns only), with SQL semantics for every [`JoinType`].
///
/// Each key pair is compared in the two types' common type (so an Int32 key joins an Int64
/// one); null keys never match. In right and full joins the key columns of right-only rows
/// hold the right keys cast to the left keys' types. Output rows follow the left input, with
/// right-only rows last in right input order.
pub fn join(
    left: JoinSide<'_>,
    right: JoinSide<'_>,
    how: JoinType,
    output: &SchemaRef,
) -> Result<RecordBatch> {
    let JoinSide {
        batches: left,
        schema: left_schema,
        keys: left_keys,
    } = left;
    let JoinSide {
        batches: right,
        schema: right_schema,
        keys: right_keys,
    } = right;
    if left_keys.is_empty() || left_keys.len() != right_keys.len() {
        return Err(invalid(format!(
            "a join needs the same non-zero number of keys on both sides, got {} and {}",
            left_keys.len(),
            right_keys.len()
        )));
    }
    let key_types = left_keys
        .iter()
        .zip(right_keys)
        .map(|(left_key, right_key)| {
            let left_type = left_schema.field_with_name(left_key)?.data_type();
            let right_type = right_schema.field_with_name(right_key)?.data_type();
            common_type(left_type, right_type).ok_or_else(|| {
                invalid(format!(
                    "join keys {left_key:?} ({left_type}) and {right_key:?} ({right_type}) \
                     have no common type"
                ))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let converter = key_converter(key_types.iter())?;
    let left_side = JoinKeys::encode(left, left_keys, &key_types, &converter)?;
    let right_side = JoinKeys::encode(right, right_keys, &key_types, &converter)?;
    let pairs = join_pairs(&left_side, &right_side, how);
    if pairs.is_empty() {
        return Ok(RecordBatch::new_empty(output.clone()));
    }
    let mut columns = Vec::with_capacity(output.fields().len());
    for field in left_schema.fields() {
        let values = named_columns(left, field.name())?;
        let key = left_keys.iter().position(|key| key == field.name());
        let column = match key {
            Some(key) if matches!(how, JoinType::Right | JoinType::Full) => {
                let mut sources = values;
                for batch in right {
                    sources.push(safe_cast(
                        column(batch, &right_keys[key])?,
                        field.data_type(),
                    )?);
                }
                let picks: Vec<(usize, usize)> = pairs
                    .iter()
                    .map(|pair| match *pair {
                        Pair::Both(row, _) | Pair::LeftOnly(row) => row,
                        Pair::RightOnly((batch, row)) => (left.len() + batch, row),
                    })
                    .collect();
                interleave_picks(&sources, field.data_type(), &picks)?
            }
            _ => interleave_or_null(values, field.data_type(), pairs.iter().map(Pair::left))?,
        };
        columns.push(column);
    }
    if !matches!(how, JoinType::Semi | JoinType::Anti) {
        for field in right_schema.fields() {
            if right_keys.contains(field.name()) {
                continue;
            }
            let values = named_columns(right, field.name())?;
            columns.push(interleave_or_null(
                values,
                field.data_type(),
                pairs.iter().map(Pair::right),
            )?);
        }
    }
    with_row_count(output, columns, pairs.len())
}

/// One side's join keys: each batch's keys in the pair's common type, row-encoded.
pub(crate) struct JoinKeys {
    rows: Vec<Rows>,
    /// Per batch, which rows have no null key (a null key never matches).
    valid: Vec<Option<NullBuffer>>,
}

impl JoinKeys {
    fn encode(
        batches: &[RecordBatch],
        keys: &[String],
        key_types: &[DataType],
        converter: &RowConverter,
    ) -> Result<Self> {
        let mut rows = Vec::with_capacity(batches.len());
        let mut valid = Vec::with_capacity(batches.len());
        for batch in batches {
            let columns = keys
                .iter()
                .zip(key_types)
                .map(|(key, key_type)| normalize_key(&safe_cast(column(batch, key)?, key_type)?))
                .collect::<Result<Vec<_>>>()?;
            let nulls: Vec<Option<NullBuffer>> =
                columns.iter().map(|c| c.logical_nulls()).collect();
            valid.push(NullBuffer::union_many(nulls.iter().map(Option::as_ref)));
            rows.push(converter.convert_columns(&columns)?);
        }
        Ok(Self { rows, valid })
    }

    /// The encoded key of each row that can match, as (batch, row, key).
    fn matchable(&self) -> impl Iterator<Item = (usize, usize, &[u8])> {
        self.rows
            .iter()
            .zip(&self.valid)
            .enumerate()
            .flat_map(|(batch, (rows, valid))| {
                rows.iter()
                    .enumerate()
                    .filter(move |(row, _)| !is_null(valid.as_ref(), *row))
                    .map(move |(row, key)| (batch, row, key.data()))
            })
    }
}

/// One output row of a join: the (batch, row) of its left and right input rows.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Pair {
    Both((usize, usize), (usize, usize)),
    LeftOnly((usize, usize)),
    RightOnly((usize, usize)),
}

impl Pair {
    fn left(&self) -> Option<(usize, usize)> {
        match *self {
            Pair::Both(left, _) | Pair::LeftOnly(left) => Some(left),
            Pair::RightOnly(_) => None,
        }
    }

    fn right(&self) -> Option<(usize, usize)> {
        match *self {
            Pair::Both(_, right) | Pair::RightOnly(right) => Some(right),
            Pair::LeftOnly(_) => None,
        }
    }
}

/// The output rows of a join: left rows in order with their matches, then (for right and
/// full joins) the unmatched right rows in order.
pub(crate) fn join_pairs(left: &JoinKeys, right: &JoinKeys, how: JoinType) -> Vec<Pair> {
    let mut table: HashMap<&[u8], Vec<(usize, usize)>> = HashMap::new();
    for (batch, row, key) in right.matchable() {
        table.entry(key).or_default().push((batch, row));
    }
    let mut matched: Vec<Vec<bool>> = right
        .rows
        .iter()
        .map(|rows| vec![false; rows.num_rows()])
        .collect();
    let mut pairs = Vec::new();
    for (batch, rows) in left.rows.iter().enumerate() {
        for (row, key) in rows.iter().enumerate() {
            let here = (batch, row);
            // Rows with a null key are not in the table, so a null key finds no match.
            match (how, table.get(key.data())) {
                (JoinType::Semi, Some(_)) | (JoinType::Anti, None) => {
                    pairs.push(Pair::LeftOnly(here));
                }
                (JoinType::Semi | JoinType::Anti, _) => {}
                (_, Some(matches)) => {
                    for &there in matches {
                        matched[there.0][there.1] = true;
                        pairs.push(Pair::Both(here, there));
                    }
                }
                (JoinType::Left | JoinType::Full, None) => pairs.push(Pair::LeftOnly(here)),
                (JoinType::Inner | JoinType::Right, None) => {}
            }
        }
    }
    if matches!(how, JoinType::Right | JoinType::Full) {
        for (batch, rows) in matched.iter().enumerate() {
            for (row, &was_matched) in rows.iter().enumerate() {
                if !was_matched {
                    pairs.push(Pair::RightOnly((batch, row)));
                }
            }
        }
    }
    pairs
}

/// `Operator::Join`.
pub struct Join<'a> {
    pub left_keys: &'a [String],
    pub right_keys: &'a [String],
    pub how: JoinType,
}

impl Exchange for Join<'_> {
    fn routing(&self) -> Routing<'_> {
        Routing::Hash
    }

    fn partition(&self, task: &MapTask<'_>, batches: Vec<RecordBatch>) -> Result<Partitions> {
        let keys = if task.side == 0 {
            self.left_keys
        } else {
            self.right_keys
        };
        route_scattered(task, batches, |batch| {
            hash_partitions(batch, keys, task.partitions as usize)
        })
    }

    fn reduce(&self, task: ReduceTask<'_>) -> Result<Reduced> {
        let left_schema = task.schema(0)?.clone();
        let right_schema = task.schema(1)?.clone();
        let output = task.output.clone();
        let mut inputs = task.inputs;
        let right: Vec<RecordBatch> = inputs
            .split_off(task.left.min(inputs.len()))
            .into_iter()
            .flatten()
            .collect();
        let left: Vec<RecordBatch> = inputs.into_iter().flatten().collect();
        join(
            JoinSide {
                batches: &left,
                schema: &left_schema,
                keys: self.left_keys,
            },
            JoinSide {
                batches: &right,
                schema: &right_schema,
                keys: self.right_keys,
            },
            self.how,
            &output,
        )
        .map(Reduced::Rows)
    }

    fn key_columns(&self, _input: &Schema) -> Vec<String> {
        self.left_keys.to_vec()
    }
}
