//! All-to-all operators: input bundles collected until every input has ended, then (for a
//! sort) sampled and bounded, partitioned by map tasks, and reduced one task per partition; a
//! partition far larger than the median is reported with its most frequent key.

use std::collections::BTreeMap;

use floe_api::node_protocol::{NodeRequest, NodeResponse};
use floe_core::plan::physical::StageKind;
use floe_core::plan::task::StageInput;
use floe_core::{NodeId, ObjectId};
use floe_engine::exchange::{Exchange, Routing, SAMPLE_ROWS_PER_PARTITION, exchange_for};

use super::Execution;
use super::aggregators::Aggregators;
use super::blocks::Bundle;
use super::task::{Launch, Recipe, compute, input_bytes};
use crate::cluster::ClusterAccess;
use crate::plan::MapSource;

/// Sequence numbers of a shuffle's map-side tasks sit above every reduce partition's (a
/// reduce task's sequence number is its partition, which is its place in the output).
pub(super) const SAMPLE_SEQ: u64 = 1 << 40;
const BOUNDARIES_SEQ: u64 = 2 << 40;
const PARTITION_SEQ: u64 = 3 << 40;
const HOT_KEY_SEQ: u64 = 4 << 40;

/// A shuffle partition this many times the median partition (and at least
/// [`HOT_PARTITION_MIN_BYTES`]) is skewed: its most frequent key goes into the stats.
const HOT_PARTITION_FACTOR: u64 = 4;
const HOT_PARTITION_MIN_BYTES: u64 = 1 << 20;

/// A shuffle without a partition count from the user gets one partition per input bundle,
/// up to this many.
const MAX_DEFAULT_PARTITIONS: usize = 200;

/// Map tasks a shuffle runs per CPU of the cluster (see `Execution::map_groups`). Four, so a
/// read of a few files per CPU maps each file's blocks in a task of their own: such a task
/// runs where its blocks lie, pulls nothing, and frees about as much store as it writes
/// (with two per CPU, a sort of sixteen files on four CPUs pulled half its input across nodes
/// and its map outputs lay past the freed reads, making a third of its peak memory). A sort's
/// sample tasks are grouped the same way, node by node.
const MAP_TASKS_PER_CPU: u64 = 4;

/// Where a shuffle is: inputs are collected until every input has ended, then (for a sort)
/// sampled and bounded, then partitioned, then reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ShufflePhase {
    Collecting,
    Sampling,
    Bounding,
    Partitioning,
    Reducing,
}

#[derive(Debug)]
pub(super) struct ShuffleState {
    pub(super) phase: ShufflePhase,
    /// Input bundles per input (a join's left and right), in order.
    pub(super) sides: Vec<Vec<Bundle>>,
    pub(super) partitions: u32,
    pub(super) samples: BTreeMap<u64, ObjectId>,
    pub(super) sample_tasks: u64,
    pub(super) boundaries: Option<ObjectId>,
    /// Map task sequence number → its output blocks, one per partition.
    pub(super) map_outputs: BTreeMap<u64, Vec<ObjectId>>,
    pub(super) map_tasks: u64,
    /// How many map tasks read the left input (they come first).
    pub(super) left_maps: u64,
    /// A skewed partition: its index, its share of the shuffled bytes and its size against
    /// the median partition.
    pub(super) hot_partition: Option<HotPartition>,
    /// The block naming its most frequent key.
    pub(super) hot_key_block: Option<ObjectId>,
    /// The skewed partition's blocks are read by its reduce and by the hot-key task: how many
    /// of the two have not finished (its blocks are freed when both have).
    pub(super) hot_readers_left: u8,
    /// A hash shuffle's aggregator actors, from its first input until it closes.
    pub(super) aggregators: Option<Aggregators>,
}

impl ShuffleState {
    /// A shuffle of `inputs` inputs that has seen nothing yet.
    pub(super) fn new(inputs: usize) -> Self {
        Self {
            phase: ShufflePhase::Collecting,
            sides: vec![Vec::new(); inputs],
            partitions: 0,
            samples: BTreeMap::new(),
            sample_tasks: 0,
            boundaries: None,
            map_outputs: BTreeMap::new(),
            map_tasks: 0,
            left_maps: 0,
            hot_partition: None,
            hot_key_block: None,
            hot_readers_left: 0,
            aggregators: None,
        }
    }
}

/// Why a shuffle's hot key could not be read (it is then left out of the stats).
#[derive(Debug, thiserror::Error)]
enum HotKeyError {
    #[error(transparent)]
    Cluster(#[from] crate::Error),
    #[error("unexpected answer {0:?}")]
    Unexpected(Box<NodeResponse>),
    #[error("the hot-key block is not small")]
    NotInline,
    #[error(transparent)]
    Arrow(#[from] arrow::error::ArrowError),
    #[error("the hot-key block is empty")]
    Empty,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct HotPartition {
    pub(super) partition: u32,
    pub(super) percent: u64,
    pub(super) times_median: u64,
}

/// Ray's rule for a shuffle the user gave no partition count: one partition per target block
/// of input bytes (`data.max_block_size`), at least one, and at most one per input bundle
/// (the parallelism the input already has) and [`MAX_DEFAULT_PARTITIONS`], so six rows sort
/// in one partition however many files they came from.
fn default_partitions(bundles: usize, bytes: u64, target_block_bytes: u64) -> u32 {
    let by_size = usize::try_from(bytes.div_ceil(target_block_bytes.max(1))).unwrap_or(usize::MAX);
    let most = bundles.clamp(1, MAX_DEFAULT_PARTITIONS);
    u32::try_from(by_size.clamp(1, most)).unwrap_or(1)
}

/// What a fused read's rows are taken to fill, before they are read: its tasks' input bytes
/// (for Parquet files, a multiple of their sizes). Were it the files' sizes, a compressed read
/// would get a single reduce; one partition per file, the most the rule gives, gave many tiny
/// partitions to a read of many small files.
fn fused_read_bytes(source: &MapSource) -> u64 {
    source
        .tasks
        .iter()
        .map(|file| input_bytes(&source.stage, file, &[]))
        .fold(0, u64::saturating_add)
}

impl<C: ClusterAccess> Execution<C> {
    /// Moves a shuffle forward: collects input bundles, and starts each phase's tasks once the
    /// previous phase is complete.
    pub(super) fn advance_shuffle(&mut self, index: usize) {
        let op = &mut self.ops[index];
        for (input, side) in op.inputs.iter_mut().zip(&mut op.shuffle.sides) {
            side.extend(input.queued.drain(..));
        }
        let StageKind::AllToAll(operator) = &op.stage.kind else {
            return;
        };
        let operator = operator.clone();
        let Some(exchange) = exchange_for(&operator) else {
            return;
        };
        let has_input = op.shuffle.sides.iter().any(|side| !side.is_empty()) || op.inputs_ended();
        if op.shuffle.phase == ShufflePhase::Collecting
            && op.shuffle.aggregators.is_none()
            && has_input
            && exchange.routing() == Routing::Hash
        {
            self.start_aggregators(index);
        }
        let op = &mut self.ops[index];
        match op.shuffle.phase {
            ShufflePhase::Collecting => {
                if !op.inputs_ended() {
                    return;
                }
                // A fused read's bundles are its files, whose rows are not read yet.
                let (bundles, bytes) = match &op.map_source {
                    Some(source) => (source.tasks.len(), fused_read_bytes(source)),
                    None => (
                        op.shuffle.sides.iter().map(Vec::len).sum(),
                        op.shuffle
                            .sides
                            .iter()
                            .flatten()
                            .flat_map(|bundle| &bundle.blocks)
                            .filter_map(|block| self.blocks.get(block))
                            .map(|info| info.bytes)
                            .sum(),
                    ),
                };
                let target = self.config.max_block_bytes;
                op.shuffle.partitions = exchange
                    .fixed_partitions()
                    .unwrap_or_else(|| default_partitions(bundles, bytes, target));
                let partitions = op.shuffle.partitions;
                let idle = op
                    .shuffle
                    .aggregators
                    .as_mut()
                    .map(|pool| pool.keep_for(partitions))
                    .unwrap_or_default();
                self.stop_actors(idle);
                if matches!(exchange.routing(), Routing::Range(_)) && bundles > 0 {
                    self.start_sampling(index);
                } else {
                    self.start_partitioning(index, &*exchange);
                }
            }
            ShufflePhase::Sampling => {
                if op.shuffle.samples.len() as u64 == op.shuffle.sample_tasks {
                    let samples = op.shuffle.samples.values().copied().collect();
                    let partitions = op.shuffle.partitions;
                    op.shuffle.phase = ShufflePhase::Bounding;
                    op.ready.push_back(compute(
                        BOUNDARIES_SEQ,
                        StageInput::Boundaries { partitions },
                        samples,
                    ));
                }
            }
            ShufflePhase::Bounding => {
                if op.shuffle.boundaries.is_some() {
                    self.start_partitioning(index, &*exchange);
                }
            }
            ShufflePhase::Partitioning => {
                if op.shuffle.map_outputs.len() as u64 == op.shuffle.map_tasks {
                    self.start_reducing(index, &*exchange);
                }
            }
            ShufflePhase::Reducing => {}
        }
    }

    /// A shuffle side's bundles, merged in order into groups that each become one map task:
    /// a few map tasks per CPU, so each splits many bundles at once rather than every bundle
    /// making its own map object and parts (a 256-bundle, 200-partition shuffle would
    /// otherwise make 51,200 tiny parts), and a few bundles go one to a task.
    fn map_groups(&self, bundles: &[Bundle]) -> Vec<Bundle> {
        let groups = (self.limits.concurrency_cap * MAP_TASKS_PER_CPU).max(1) as usize;
        let per_group = bundles.len().div_ceil(groups).max(1);
        bundles
            .chunks(per_group)
            .map(|chunk| Bundle {
                blocks: chunk
                    .iter()
                    .flat_map(|bundle| bundle.blocks.clone())
                    .collect(),
            })
            .collect()
    }

    /// The bundles a sort samples, grouped as `map_groups` does but each group from the
    /// blocks of one node: a sample task reads whole blocks for a few keys, so a group that
    /// spanned nodes pulled a block across for nothing. Unlike the map tasks' groups, these
    /// need not keep the input order: which rows are sampled moves the boundaries, never the
    /// sorted result.
    fn sample_groups(&self, bundles: &[Bundle]) -> Vec<Bundle> {
        let mut by_node: BTreeMap<Option<NodeId>, Vec<Bundle>> = BTreeMap::new();
        for bundle in bundles {
            let node = bundle
                .blocks
                .first()
                .and_then(|block| self.blocks.get(block))
                .map(|info| info.node);
            by_node.entry(node).or_default().push(bundle.clone());
        }
        by_node
            .values()
            .flat_map(|bundles| self.map_groups(bundles))
            .collect()
    }

    fn start_sampling(&mut self, index: usize) {
        // What each sample task reads: a file's keys of a fused read, else a group of input
        // bundles from one node.
        let groups: Vec<(Option<StageInput>, Vec<ObjectId>)> = match &self.ops[index].map_source {
            Some(source) => source
                .tasks
                .iter()
                .map(|file| (Some(*file), Vec::new()))
                .collect(),
            None => self
                .sample_groups(&self.ops[index].shuffle.sides[0])
                .into_iter()
                .map(|bundle| (None, bundle.blocks))
                .collect(),
        };
        let shuffle = &self.ops[index].shuffle;
        let total = u64::from(shuffle.partitions) * u64::from(SAMPLE_ROWS_PER_PARTITION);
        let per_group = total.div_ceil(groups.len().max(1) as u64).max(1);
        let rows = u32::try_from(per_group).unwrap_or(u32::MAX);
        let launches: Vec<Launch> = (0u64..)
            .zip(groups)
            .map(|(i, (source, inputs))| {
                let recipe = Recipe::Compute {
                    input: StageInput::Sample { rows, seed: i },
                    inputs,
                    source,
                };
                Launch::first(SAMPLE_SEQ + i, recipe)
            })
            .collect();
        let shuffle = &mut self.ops[index].shuffle;
        shuffle.sample_tasks = launches.len() as u64;
        shuffle.phase = ShufflePhase::Sampling;
        self.ops[index].ready.extend(launches);
    }

    fn start_partitioning(&mut self, index: usize, exchange: &dyn Exchange) {
        let seed = exchange.seed();
        let ranged = matches!(exchange.routing(), Routing::Range(_));
        let mut launches = Vec::new();
        let shuffle = &self.ops[index].shuffle;
        let mut left_maps = 0;
        // Map task `task`'s split of its side's rows `offset..` of `total`, and the block it
        // reads besides its rows (a sort's boundaries).
        let split = |task: u64, side: u8, offset: u64, total: u64| match shuffle.boundaries {
            Some(boundaries) if ranged => (
                StageInput::RangePartition {
                    partitions: shuffle.partitions,
                },
                Some(boundaries),
            ),
            _ => (
                StageInput::Partition {
                    partitions: shuffle.partitions,
                    side,
                    offset,
                    total,
                    seed: seed ^ task.rotate_left(32),
                },
                None,
            ),
        };
        if let Some(source) = &self.ops[index].map_source {
            // Each of the fused read's tasks is a map task; a split by row position needs
            // the rows' places, so it is never fused.
            for (task, file) in (0u64..).zip(&source.tasks) {
                let (input, boundaries) = split(task, 0, 0, 0);
                let recipe = Recipe::Compute {
                    input,
                    inputs: boundaries.into_iter().collect(),
                    source: Some(*file),
                };
                launches.push(Launch::first(PARTITION_SEQ + task, recipe));
            }
        }
        for (side, bundles) in shuffle.sides.iter().enumerate() {
            let bundles = self.map_groups(bundles);
            let rows = |bundle: &Bundle| -> u64 {
                bundle
                    .blocks
                    .iter()
                    .filter_map(|block| self.blocks.get(block))
                    .map(|info| info.rows)
                    .sum()
            };
            let total: u64 = bundles.iter().map(rows).sum();
            let mut offset = 0;
            for bundle in &bundles {
                let task = launches.len() as u64;
                let side = u8::try_from(side).unwrap_or(u8::MAX);
                let (input, boundaries) = split(task, side, offset, total);
                let mut inputs = bundle.blocks.clone();
                inputs.extend(boundaries);
                let seq = PARTITION_SEQ + task;
                offset += rows(bundle);
                launches.push(compute(seq, input, inputs));
            }
            if side == 0 {
                left_maps = launches.len() as u64;
            }
        }
        let op = &mut self.ops[index];
        op.shuffle.map_tasks = launches.len() as u64;
        op.shuffle.left_maps = left_maps;
        op.shuffle.phase = ShufflePhase::Partitioning;
        op.ready.extend(launches);
        if op.shuffle.map_tasks == 0 {
            self.start_reducing(index, exchange);
        }
    }

    fn start_reducing(&mut self, index: usize, exchange: &dyn Exchange) {
        let seed = exchange.seed();
        let hot = self.hot_partition(index);
        let op = &mut self.ops[index];
        let shuffle = &mut op.shuffle;
        shuffle.phase = ShufflePhase::Reducing;
        let left = u32::try_from(shuffle.left_maps).unwrap_or(u32::MAX);
        if let Some(hot) = hot {
            shuffle.hot_partition = Some(hot);
            shuffle.hot_readers_left = 2;
            let inputs = shuffle
                .map_outputs
                .values()
                .filter_map(|outputs| outputs.get(hot.partition as usize).copied())
                .collect();
            op.ready
                .push_back(compute(HOT_KEY_SEQ, StageInput::HotKey { left }, inputs));
        }
        for partition in 0..shuffle.partitions {
            let inputs = shuffle
                .map_outputs
                .values()
                .filter_map(|outputs| outputs.get(partition as usize).copied())
                .collect();
            let input = StageInput::Reduce {
                partition,
                left,
                seed: seed ^ u64::from(partition).rotate_left(17),
            };
            op.ready
                .push_back(compute(u64::from(partition), input, inputs));
        }
        op.next_seq = u64::from(shuffle.partitions);
    }

    /// The partition far larger than the median one, if there is one.
    fn hot_partition(&self, index: usize) -> Option<HotPartition> {
        let shuffle = &self.ops[index].shuffle;
        let sizes: Vec<u64> = (0..shuffle.partitions as usize)
            .map(|partition| {
                shuffle
                    .map_outputs
                    .values()
                    .filter_map(|outputs| outputs.get(partition))
                    .filter_map(|block| self.blocks.get(block))
                    .map(|info| info.bytes)
                    .sum()
            })
            .collect();
        if sizes.len() < 2 {
            return None;
        }
        let mut sorted = sizes.clone();
        sorted.sort_unstable();
        let median = sorted[sorted.len() / 2].max(1);
        let total: u64 = sizes.iter().sum();
        let (partition, largest) = sizes
            .iter()
            .copied()
            .enumerate()
            .max_by_key(|(_, size)| *size)?;
        let skewed = largest >= HOT_PARTITION_MIN_BYTES
            && largest >= median.saturating_mul(HOT_PARTITION_FACTOR);
        skewed.then(|| HotPartition {
            partition: u32::try_from(partition).unwrap_or(u32::MAX),
            percent: largest * 100 / total.max(1),
            times_median: largest / median,
        })
    }

    /// Fetches the hot keys found by shuffles into their operators' stats.
    pub(super) async fn describe_hot_keys(&mut self) {
        for index in 0..self.ops.len() {
            let shuffle = &self.ops[index].shuffle;
            let (Some(hot), Some(block)) = (shuffle.hot_partition, shuffle.hot_key_block) else {
                continue;
            };
            let Some(info) = self.blocks.get(&block).copied() else {
                continue;
            };
            let key = match self.read_hot_key(block, info.node).await {
                Ok(key) => key,
                Err(error) => {
                    tracing::warn!(job = %self.job, %error, "cannot read a shuffle's hot key");
                    continue;
                }
            };
            self.ops[index].stats.hot_key = Some(format!(
                "partition {} holds {}% of the shuffled bytes ({}× the median partition); its \
                 most frequent key is {key}",
                hot.partition, hot.percent, hot.times_median
            ));
        }
    }

    /// The most frequent key named in hot-key block `block` on `node`, and its rows.
    async fn read_hot_key(&self, block: ObjectId, node: NodeId) -> Result<String, HotKeyError> {
        let addr = self.cluster.address(node).await?;
        let meta = match self
            .cluster
            .call_node(&addr, &NodeRequest::ObjectMeta { object: block })
            .await?
        {
            NodeResponse::ObjectMeta(meta) => meta,
            other => return Err(HotKeyError::Unexpected(Box::new(other))),
        };
        let bytes = meta.inline.ok_or(HotKeyError::NotInline)?.0;
        let reader = arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(bytes), None)?;
        for batch in reader {
            let batch = batch?;
            let (Some(keys), Some(rows)) =
                (batch.column_by_name("key"), batch.column_by_name("rows"))
            else {
                continue;
            };
            let keys = keys.as_any().downcast_ref::<arrow::array::StringArray>();
            let rows = rows.as_any().downcast_ref::<arrow::array::Int64Array>();
            if let (Some(keys), Some(rows)) = (keys, rows)
                && !arrow::array::Array::is_empty(keys)
            {
                return Ok(format!("{} ({} rows)", keys.value(0), rows.value(0)));
            }
        }
        Err(HotKeyError::Empty)
    }

    /// The skewed partition's reduce or its hot-key task finished reading `inputs` (the
    /// partition's blocks): they are freed once both have.
    pub(super) fn hot_reader_done(&mut self, index: usize, inputs: &[ObjectId]) {
        let left = &mut self.ops[index].shuffle.hot_readers_left;
        *left = left.saturating_sub(1);
        if *left == 0 {
            self.free_now(inputs);
        }
    }

    /// A shuffle's sample, boundaries or partition task finished: its outputs feed the next
    /// phase rather than the operator's output.
    pub(super) fn map_side_done(&mut self, index: usize, launch: &Launch, outputs: Vec<ObjectId>) {
        let op = &mut self.ops[index];
        op.tasks_done += 1;
        op.stats.tasks += 1;
        let shuffle = &mut op.shuffle;
        if launch.seq >= HOT_KEY_SEQ {
            shuffle.hot_key_block = outputs.first().copied();
            if let Recipe::Compute { inputs, .. } = &launch.recipe {
                self.hot_reader_done(index, inputs);
            }
        } else if launch.seq >= PARTITION_SEQ {
            shuffle.map_outputs.insert(launch.seq, outputs);
            if let Recipe::Compute { inputs, .. } = &launch.recipe {
                self.release_inputs(inputs);
            }
            let slots = self.ops[index]
                .shuffle
                .aggregators
                .as_ref()
                .map_or(0, |pool| pool.slots.len());
            for slot in 0..slots {
                self.push_to(index, slot, &[launch.seq]);
            }
        } else if launch.seq >= BOUNDARIES_SEQ {
            shuffle.boundaries = outputs.first().copied();
        } else if let Some(sample) = outputs.first() {
            shuffle.samples.insert(launch.seq, *sample);
        }
    }
}
