//! The all-to-all operators, one file each, behind one trait.
//!
//! An exchange moves rows between blocks: each map task splits its input blocks into one block
//! per partition, and each reduce task turns one partition's blocks (one from every map task)
//! into output rows. [`Exchange`] is what an operator says about itself: how its map side
//! routes rows ([`Routing`]), how many partitions it fixes, how it splits and how it reduces.
//! The driver plans a shuffle's phases from the routing alone (hash routing goes through
//! aggregator actors; range routing samples keys and picks boundaries first), so it never
//! matches on operators.
//!
//! Adding an all-to-all operator: a plan variant in `floe_core::plan::Operator`, a file here
//! with its kernels and its `Exchange`, and its line in [`exchange_for`].
//!
//! - [`aggregate`] (groupby, with partial aggregation), [`join`], [`unique`]: hash routing.
//! - [`repartition`]: hash routing with keys, by position without.
//! - [`random`]: random routing and a seeded permutation.
//! - [`sort`]: range routing and a stable sort of each partition's rows.
//! - [`keys`]: hashing, grouping and ordering by key columns, shared by all of them;
//!   [`columns`]: gathering and splitting rows.

pub mod aggregate;
mod columns;
pub mod gathered;
pub mod join;
pub mod keys;
pub mod random;
pub mod repartition;
pub mod scattered;
pub mod sort;
pub mod unique;

pub use columns::Reordering;

use std::sync::Arc;

use arrow::datatypes::{Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use floe_core::plan::task::StageInput;
use floe_core::plan::{Operator, SortKey};

use crate::blocks::BlockSizing;
use crate::task::{OutputBlock, Partitions, TaskOutput};
use crate::{Error, Result};

/// Rows sampled per output partition for a sort's range boundaries, over all input blocks.
/// A partition's share of the rows varies by about one over the square root of this (10 let
/// one reduce of a sort get 2.5 times the rows of another); the samples cost next to nothing.
pub const SAMPLE_ROWS_PER_PARTITION: u32 = 100;

/// Bytes of a reduce's output rows to a block, or gathered at a time for a sink, when they are
/// a reordering of its input (sorted, permuted). For a sink, the chunk's column buffers stay
/// under half of glibc's 32 MiB own-mapping threshold (`node::worker`), so they come from the
/// worker's kept heap, warm, where one gather of the whole partition (a shuffle's is over 100
/// MB) was mapped anew, page by page, in every task. Blocks are gathered straight into their
/// objects, and this size keeps them as they were.
pub const REORDERED_CHUNK_BYTES: u64 = 16 << 20;

/// How an exchange's map side sends rows to partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing<'a> {
    /// By a hash of key columns: every partition is owned by an aggregator actor, which
    /// collects its shards as map tasks finish.
    Hash,
    /// By sort-key range: the map side first samples the keys and picks boundaries.
    Range(&'a [SortKey]),
    /// To partitions drawn at random from the task's seed.
    Random,
    /// By global row position, into equal consecutive slices.
    Position,
}

/// One map task: which input side its blocks come from and where they lie.
#[derive(Debug, Clone, Copy)]
pub struct MapTask<'a> {
    /// The input (a join's left is 0, its right 1) and that input's schema.
    pub side: usize,
    pub schema: &'a SchemaRef,
    pub partitions: u32,
    /// The blocks are rows `offset..` of the input's `total` rows.
    pub offset: u64,
    pub total: u64,
    pub seed: u64,
    /// A range-routed exchange's boundaries (the sort's), one row per boundary.
    pub boundaries: Option<&'a RecordBatch>,
}

/// One reduce task: a partition's blocks, one list per map task (a join's left map tasks come
/// first, `left` of them).
pub struct ReduceTask<'a> {
    pub inputs: Vec<Vec<RecordBatch>>,
    pub left: usize,
    pub input_schemas: &'a [SchemaRef],
    pub output: &'a SchemaRef,
    pub seed: u64,
}

impl ReduceTask<'_> {
    /// The schema of input `side`.
    fn schema(&self, side: usize) -> Result<&SchemaRef> {
        self.input_schemas.get(side).ok_or(Error::ExchangeInput {
            missing: "an input schema",
        })
    }

    /// Every block of the partition, in map-task order.
    fn into_batches(self) -> Vec<RecordBatch> {
        self.inputs.into_iter().flatten().collect()
    }
}

/// An all-to-all operator's map and reduce sides.
pub trait Exchange {
    fn routing(&self) -> Routing<'_>;

    /// The partition count the operator itself fixes (a repartition's count, one for a
    /// global aggregate); `None` lets the driver choose from the input's size.
    fn fixed_partitions(&self) -> Option<u32> {
        None
    }

    /// The seed of random routing and permutation (0 for exchanges that draw nothing).
    fn seed(&self) -> u64 {
        0
    }

    /// Splits a map task's blocks into exactly `task.partitions` partitions.
    fn partition(&self, task: &MapTask<'_>, batches: Vec<RecordBatch>) -> Result<Partitions>;

    /// One partition's output rows.
    fn reduce(&self, task: ReduceTask<'_>) -> Result<Reduced>;

    /// The columns whose most frequent value explains a skewed partition (of `input`).
    fn key_columns(&self, input: &Schema) -> Vec<String>;
}

/// One partition's output rows, as a reduce task makes them.
pub enum Reduced {
    /// Rows made anew (aggregates, joined or distinct rows).
    Rows(RecordBatch),
    /// The partition's input rows in a new order (sorted, permuted), not yet gathered.
    Reordered(Reordering),
    /// The partition's input parts, in map-task order, as they are (a repartition moves rows
    /// and makes none): they go into the output objects one after the other, never
    /// concatenated first, so each row is copied once, into the store.
    Parts(Vec<RecordBatch>),
}

impl Reduced {
    /// The rows in order, gathered about `bytes` at a time when they are still to be
    /// gathered; no batch for no rows (as a reduce's empty output makes no block).
    pub fn chunks(&self, bytes: u64) -> Box<dyn Iterator<Item = Result<RecordBatch>> + '_> {
        match self {
            Reduced::Rows(batch) if batch.num_rows() == 0 => Box::new(std::iter::empty()),
            Reduced::Rows(batch) => Box::new(std::iter::once(Ok(batch.clone()))),
            Reduced::Reordered(reordering) => {
                Box::new(reordering.chunks(reordering.rows_in(bytes)))
            }
            Reduced::Parts(parts) => Box::new(
                parts
                    .iter()
                    .filter(|part| part.num_rows() > 0)
                    .map(|part| Ok(part.clone())),
            ),
        }
    }

    /// The rows as output blocks sized by `sizing`, one object each: rows made are sized
    /// like any task's output; reordered rows are cut into blocks of about
    /// `REORDERED_CHUNK_BYTES` (within the sizing's range), each gathered only as its object
    /// is written; parts are grouped, as many to a block as fit under the maximum
    /// ([`BlockSizing::group`]).
    pub fn into_blocks(self, sizing: &BlockSizing) -> Result<Vec<OutputBlock>> {
        match self {
            Reduced::Rows(batch) if batch.num_rows() == 0 => Ok(Vec::new()),
            Reduced::Rows(batch) => Ok(output_blocks(sizing.rebalance(vec![batch])?)),
            Reduced::Reordered(reordering) => {
                let bytes = REORDERED_CHUNK_BYTES.clamp(sizing.min_bytes(), sizing.max_bytes());
                let rows = reordering.rows_in(bytes);
                Ok(reordering
                    .blocks(rows)?
                    .into_iter()
                    .map(OutputBlock::Gathered)
                    .collect())
            }
            Reduced::Parts(parts) => {
                let pieces = parts
                    .into_iter()
                    .filter(|part| part.num_rows() > 0)
                    .flat_map(|part| sizing.split(part));
                Ok(sizing
                    .group(pieces)
                    .into_iter()
                    .map(OutputBlock::Batches)
                    .collect())
            }
        }
    }
}

/// A block of each batch.
pub(crate) fn output_blocks(batches: Vec<RecordBatch>) -> Vec<OutputBlock> {
    batches.into_iter().map(OutputBlock::from).collect()
}

/// A partition of each batch.
pub(crate) fn partition_blocks(batches: Vec<RecordBatch>) -> Partitions {
    Partitions::Blocks(output_blocks(batches))
}

/// The exchange of an all-to-all operator; `None` for any other operator.
pub fn exchange_for(operator: &Operator) -> Option<Box<dyn Exchange + '_>> {
    Some(match operator {
        Operator::Sort { keys } => Box::new(sort::Sort { keys }),
        Operator::Aggregate { keys, aggregations } => {
            Box::new(aggregate::Aggregate { keys, aggregations })
        }
        Operator::Repartition { partitions, keys } => Box::new(repartition::Repartition {
            partitions: *partitions,
            keys,
        }),
        Operator::RandomShuffle { seed } => Box::new(random::RandomShuffle { seed: *seed }),
        Operator::Join {
            left_keys,
            right_keys,
            how,
        } => Box::new(join::Join {
            left_keys,
            right_keys,
            how: *how,
        }),
        Operator::Unique { columns } => Box::new(unique::Unique { columns }),
        _ => return None,
    })
}

/// Splits every block with `split(block, offset of its first row)` and concatenates each
/// partition's pieces: the map side of splits into slices, which copy nothing themselves.
pub(crate) fn split_each(
    task: &MapTask<'_>,
    batches: Vec<RecordBatch>,
    mut split: impl FnMut(&RecordBatch, u64) -> Result<Vec<RecordBatch>>,
) -> Result<Vec<RecordBatch>> {
    let mut offset = task.offset;
    let mut parts: Vec<Vec<RecordBatch>> = vec![Vec::new(); task.partitions as usize];
    for batch in batches {
        let pieces = split(&batch, offset)?;
        offset += batch.num_rows() as u64;
        for (part, piece) in parts.iter_mut().zip(pieces) {
            part.push(piece);
        }
    }
    parts
        .into_iter()
        .map(|pieces| Ok(arrow::compute::concat_batches(task.schema, &pieces)?))
        .collect()
}

/// Sends every row of `batches` to the partition `assign(block, offset of its first row)` names
/// for it (one partition per row, each below `task.partitions`) and gathers each partition's
/// rows in input order: the usual map side, one block per partition, every row copied once.
pub(crate) fn route_each(
    task: &MapTask<'_>,
    batches: &[RecordBatch],
    mut assign: impl FnMut(&RecordBatch, u64) -> Result<Vec<usize>>,
) -> Result<Vec<RecordBatch>> {
    let parts = columns::partition_count(task.partitions)?;
    let mut offset = task.offset;
    let assigned = batches
        .iter()
        .map(|batch| {
            let assigned = assign(batch, offset);
            offset += batch.num_rows() as u64;
            assigned
        })
        .collect::<Result<Vec<_>>>()?;
    columns::scatter(batches, task.schema, &assigned, parts)
}

/// [`route_each`] without row offsets, the rows split only as they are written into the map
/// task's object ([`scattered`]): `assign(block)` names each row's partition.
pub(crate) fn route_scattered(
    task: &MapTask<'_>,
    batches: Vec<RecordBatch>,
    assign: impl FnMut(&RecordBatch) -> Result<Vec<usize>>,
) -> Result<Partitions> {
    let parts = columns::partition_count(task.partitions)?;
    let assigned = batches.iter().map(assign).collect::<Result<Vec<_>>>()?;
    scattered::ScatteredRows::route(batches, task.schema, assigned, parts)
}

/// Every column name of `schema`, in order.
pub(crate) fn all_columns(schema: &Schema) -> Vec<String> {
    schema.fields().iter().map(|f| f.name().clone()).collect()
}

/// What an all-to-all task other than a reduce produces: for the map side, exactly one batch
/// per partition (index = partition, possibly empty), packed into one object; for the sample,
/// boundaries and hot-key tasks, one block. A reduce's rows come from [`reduce`].
pub fn run(
    operator: &Operator,
    input: StageInput,
    input_schemas: &[SchemaRef],
    inputs: Vec<Vec<RecordBatch>>,
) -> Result<TaskOutput> {
    let unsupported = || Error::StageInput {
        stage: operator.name().to_owned(),
        input: input.to_string(),
    };
    let exchange = exchange_for(operator).ok_or_else(unsupported)?;
    let first_schema = || input_schemas.first().cloned().ok_or_else(unsupported);
    let sort_keys = || match exchange.routing() {
        Routing::Range(keys) => Ok(keys),
        _ => Err(unsupported()),
    };
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
                .ok_or_else(unsupported)?;
            let task = MapTask {
                side: usize::from(side),
                schema,
                partitions,
                offset,
                total,
                seed,
                boundaries: None,
            };
            exchange
                .partition(&task, inputs.into_iter().flatten().collect())
                .map(TaskOutput::Partitions)
        }
        StageInput::Sample { rows, seed } => {
            let keys = sort_keys()?;
            let batches: Vec<RecordBatch> = inputs.into_iter().flatten().collect();
            Ok(TaskOutput::Blocks(vec![OutputBlock::from(sort::sample(
                &batches,
                &first_schema()?,
                keys,
                rows,
                seed,
            )?)]))
        }
        StageInput::Boundaries { partitions } => {
            let keys = sort_keys()?;
            let key_schema = key_schema(first_schema()?.as_ref(), keys)?;
            let samples: Vec<RecordBatch> = inputs.into_iter().flatten().collect();
            Ok(TaskOutput::Blocks(vec![OutputBlock::from(
                sort::range_boundaries(&samples, &key_schema, keys, partitions)?,
            )]))
        }
        StageInput::RangePartition { partitions } => {
            let keys = sort_keys()?;
            let schema = first_schema()?;
            let mut inputs = inputs;
            let boundaries = inputs.pop().ok_or_else(unsupported)?;
            let key_schema = key_schema(&schema, keys)?;
            let boundaries = arrow::compute::concat_batches(&key_schema, &boundaries)?;
            let task = MapTask {
                side: 0,
                schema: &schema,
                partitions,
                offset: 0,
                total: 0,
                seed: 0,
                boundaries: Some(&boundaries),
            };
            exchange
                .partition(&task, inputs.into_iter().flatten().collect())
                .map(TaskOutput::Partitions)
        }
        StageInput::HotKey { left } => {
            let columns = exchange.key_columns(first_schema()?.as_ref());
            let mut inputs = inputs;
            inputs.truncate(left as usize);
            let batches: Vec<RecordBatch> = inputs.into_iter().flatten().collect();
            Ok(TaskOutput::Blocks(vec![OutputBlock::from(
                keys::most_frequent_key(&batches, &columns)?,
            )]))
        }
        _ => Err(unsupported()),
    }
}

/// A reduce task's output rows, not yet gathered when the exchange only reorders its input:
/// sized into blocks ([`Reduced::into_blocks`]), or written to a sink a chunk at a time.
pub fn reduce(
    operator: &Operator,
    output: &SchemaRef,
    input: StageInput,
    input_schemas: &[SchemaRef],
    inputs: Vec<Vec<RecordBatch>>,
) -> Result<Reduced> {
    let unsupported = || Error::StageInput {
        stage: operator.name().to_owned(),
        input: input.to_string(),
    };
    let (Some(exchange), StageInput::Reduce { left, seed, .. }) = (exchange_for(operator), input)
    else {
        return Err(unsupported());
    };
    exchange.reduce(ReduceTask {
        inputs,
        left: left as usize,
        input_schemas,
        output,
        seed,
    })
}

/// The sort key columns of `schema`, in key order.
pub(crate) fn key_schema(schema: &Schema, keys: &[SortKey]) -> Result<SchemaRef> {
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

#[cfg(test)]
mod tests {
    use floe_core::plan::{AggFunction, Aggregation, JoinType, SeedChoice};

    use super::*;

    fn assert_routes(operator: &Operator, routing: Routing<'_>, fixed: Option<u32>) {
        let exchange = exchange_for(operator).expect("an all-to-all operator");
        assert_eq!(exchange.routing(), routing, "{}", operator.name());
        assert_eq!(exchange.fixed_partitions(), fixed, "{}", operator.name());
    }

    #[test]
    fn each_operator_says_how_it_routes_and_what_it_fixes() {
        let keys = vec!["k".to_owned()];
        let grouped = Operator::Aggregate {
            keys: keys.clone(),
            aggregations: vec![Aggregation::of(AggFunction::Sum, "v")],
        };
        assert_routes(&grouped, Routing::Hash, None);
        let global = Operator::Aggregate {
            keys: Vec::new(),
            aggregations: vec![Aggregation::count_rows("n")],
        };
        assert_routes(&global, Routing::Hash, Some(1));
        let join = Operator::Join {
            left_keys: keys.clone(),
            right_keys: keys.clone(),
            how: JoinType::Inner,
        };
        assert_routes(&join, Routing::Hash, None);
        let unique = Operator::Unique {
            columns: Vec::new(),
        };
        assert_routes(&unique, Routing::Hash, None);
        let keyed = Operator::Repartition {
            partitions: 4,
            keys: keys.clone(),
        };
        assert_routes(&keyed, Routing::Hash, Some(4));
        let unkeyed = Operator::Repartition {
            partitions: 4,
            keys: Vec::new(),
        };
        assert_routes(&unkeyed, Routing::Position, Some(4));
        let sort_keys = vec![SortKey::asc("k")];
        let sort = Operator::Sort {
            keys: sort_keys.clone(),
        };
        assert_routes(&sort, Routing::Range(&sort_keys), None);
        let random = Operator::RandomShuffle {
            seed: SeedChoice::Unresolved,
        };
        assert_routes(&random, Routing::Random, None);
    }

    #[test]
    fn row_wise_operators_have_no_exchange() {
        let select = Operator::Select {
            columns: vec!["k".to_owned()],
        };
        assert!(exchange_for(&select).is_none());
    }

    /// A repartition's reduce moves each map task's part into its output as it is: the
    /// parts' own buffers, in map-task order, as many to a block as fit under the maximum,
    /// so a row is copied once (into the store) and the partition is never concatenated.
    #[test]
    fn a_repartitions_reduce_keeps_its_parts_in_blocks_under_the_maximum() {
        use arrow::array::{Array, Int64Array};
        use arrow::datatypes::DataType;

        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        let part = |values: std::ops::Range<i64>| {
            let array = Int64Array::from_iter_values(values);
            RecordBatch::try_new(schema.clone(), vec![Arc::new(array)]).unwrap()
        };
        // Four map tasks' parts of 800, 0, 800 and 1,600 bytes.
        let parts = vec![part(0..100), part(0..0), part(100..200), part(200..400)];
        let buffers: Vec<*const u8> = parts
            .iter()
            .filter(|part| part.num_rows() > 0)
            .map(|part| part.column(0).to_data().buffers()[0].as_ptr())
            .collect();
        let operator = Operator::Repartition {
            partitions: 4,
            keys: vec!["v".to_owned()],
        };
        let input = StageInput::Reduce {
            partition: 0,
            left: 0,
            seed: 0,
        };
        let inputs = parts.into_iter().map(|part| vec![part]).collect();
        let reduced = reduce(
            &operator,
            &schema,
            input,
            std::slice::from_ref(&schema),
            inputs,
        )
        .unwrap();
        let blocks = reduced
            .into_blocks(&BlockSizing::new(1, 2_000).unwrap())
            .unwrap();
        let blocks: Vec<Vec<RecordBatch>> = blocks
            .into_iter()
            .map(|block| match block {
                OutputBlock::Batches(batches) => batches,
                OutputBlock::Gathered(block) => panic!("parts are kept, not gathered: {block:?}"),
            })
            .collect();
        let rows: Vec<Vec<usize>> = blocks
            .iter()
            .map(|block| block.iter().map(RecordBatch::num_rows).collect())
            .collect();
        // 800 + 800 fit 2,000 bytes; the 1,600-byte part starts a block of its own.
        assert_eq!(rows, vec![vec![100, 100], vec![200]]);
        let batches: Vec<&RecordBatch> = blocks.iter().flatten().collect();
        let moved: Vec<*const u8> = batches
            .iter()
            .map(|batch| batch.column(0).to_data().buffers()[0].as_ptr())
            .collect();
        assert_eq!(moved, buffers);
        let values: Vec<i64> = batches
            .iter()
            .flat_map(|batch| {
                let values = batch.column(0).as_any().downcast_ref::<Int64Array>();
                values.unwrap().values().to_vec()
            })
            .collect();
        assert_eq!(values, (0..400).collect::<Vec<_>>());
        assert!(batches.iter().all(|batch| batch.schema() == schema));
    }

    /// A permuted partition larger than a block is gathered into several blocks of about
    /// `REORDERED_CHUNK_BYTES`, which hold the permutation's rows in its order.
    #[test]
    fn a_reordered_partition_is_gathered_into_blocks_under_the_mapping_threshold() {
        use arrow::array::{Array, Int64Array, StringArray};
        use arrow::datatypes::DataType;

        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("payload", DataType::Utf8, false),
        ]));
        // Two map tasks' pieces, 40 MB of rows in all.
        let piece = |ids: std::ops::Range<i64>| {
            let payloads =
                StringArray::from_iter_values(ids.clone().map(|id| format!("{id:0>92}")));
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(Int64Array::from_iter_values(ids)),
                    Arc::new(payloads),
                ],
            )
            .unwrap()
        };
        let pieces = vec![piece(0..200_000), piece(200_000..400_000)];
        // The reduce's seed is the task's; the operator's is the map side's.
        let operator = Operator::RandomShuffle {
            seed: SeedChoice::Unresolved,
        };
        let input = StageInput::Reduce {
            partition: 0,
            left: 0,
            seed: 17,
        };
        let inputs = pieces.iter().map(|piece| vec![piece.clone()]).collect();
        let blocks = reduce(
            &operator,
            &schema,
            input,
            std::slice::from_ref(&schema),
            inputs,
        )
        .unwrap()
        .into_blocks(&BlockSizing::default())
        .unwrap();
        let blocks: Vec<RecordBatch> = blocks
            .into_iter()
            .map(|block| {
                assert!(matches!(block, OutputBlock::Gathered(_)), "{block:?}");
                let mut batches = block.into_batches().unwrap();
                assert_eq!(batches.len(), 1);
                batches.pop().unwrap()
            })
            .collect();
        assert!(blocks.len() >= 2, "{} blocks", blocks.len());
        for block in &blocks {
            let bytes = crate::blocks::data_bytes(block);
            assert!(
                bytes <= REORDERED_CHUNK_BYTES + 200,
                "a block of {bytes} bytes"
            );
        }
        let ids = |batches: &[RecordBatch]| -> Vec<i64> {
            batches
                .iter()
                .flat_map(|batch| {
                    let ids = batch
                        .column(0)
                        .as_any()
                        .downcast_ref::<Int64Array>()
                        .unwrap();
                    ids.values().to_vec()
                })
                .collect()
        };
        let whole = random::interleave(&pieces, &schema, 17).unwrap();
        assert_eq!(ids(&blocks), ids(std::slice::from_ref(&whole)));
        assert_eq!(blocks.iter().map(|b| b.num_rows()).sum::<usize>(), 400_000);
        assert!(blocks.iter().all(|b| b.column(1).null_count() == 0));
    }
}
