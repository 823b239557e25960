//! Planning a job: logical plan → optimized plan → physical stages → the driver's operators,
//! with the cache decisions made against the replicated cache index.
//!
//! Every operator produces an ordered stream of *bundles* (the blocks of one task, or one
//! cache shard). A cached operator stores bundle `r` of `n` as shard `r` of `n` of its
//! fingerprint. By default the final output (a sink's input when the output is a sink),
//! `.cache()` marks and all-to-all outputs (one shard per reduce partition) are cached; a `.cache()` mark moves onto the operator that produces its input (they share a
//! fingerprint). Lookups walk down from the output: an operator whose shards are all cached
//! (in any shard count) becomes a source of cache loads and nothing below it runs; a source
//! operator with some of its shards cached loads those and computes only the missing ones.
//! Without caching, a sink that is the output is fused into the operator feeding it
//! ([`fuse_sink`]).

use floe_core::plan::task::StageInput;
use std::collections::BTreeMap;

use floe_api::state::{CacheEntry, CacheIndex};
use floe_core::Fingerprint;
use floe_core::NodeId;
use floe_core::fingerprint::FingerprintInputs;
use floe_core::job::{CacheMode, JobSpec, OutputBlock};
use floe_core::plan::optimizer::Optimizer;
use floe_core::plan::physical::{PhysicalPlan, Stage, StageKind};
use floe_core::plan::{FileScan, LogicalPlan, PlanError, SortKey, WriteSpec};

use floe_engine::exchange::{Routing, exchange_for};
use floe_engine::udf::process::process_udfs;

use super::DriverConfig;

/// Range sources are cut into tasks of at least this many reader batches.
const RANGE_BATCHES_PER_TASK: u64 = 4;
/// At most this many tasks for one range source.
const RANGE_MAX_TASKS: u64 = 256;
/// A read of more files than this is not fused into a shuffle's map side: each file would be a
/// map task of its own, with a part for every partition.
const MAX_FUSED_MAP_TASKS: usize = 64;

/// One task of a source operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SourceTask {
    Compute(StageInput),
    Load(ShardToLoad),
    /// One block of an earlier job's held output, taken as the task's input where it is (the
    /// job reading it never frees it: it belongs to that output).
    Borrow(OutputBlock),
}

/// Shard `rank` of `count` of an operator's fingerprint, cached on `node`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ShardToLoad {
    pub node: NodeId,
    pub rank: u32,
    pub count: u32,
    /// The source task that computes the same rows (the shard is one of a source's own, in
    /// its own count): a load that finds the shard gone runs it instead.
    pub recompute: Option<StageInput>,
}

#[derive(Debug, Clone)]
pub(crate) enum Work {
    /// Tasks known before anything runs: one bundle each, in order.
    Source(Vec<SourceTask>),
    /// One task per input bundle.
    Map,
    /// One task over the first input bundles that cover `n` rows.
    Limit(u64),
    /// Input 0's bundles, then input 1's, as they are.
    Union,
    /// Its input's bundles as they are (a `.cache()` mark, once moved onto its producer).
    PassThrough,
    /// One write task per input bundle.
    Sink,
    /// A shuffle: once every input has ended, partition tasks over the input bundles (for a
    /// sort, after sampling the keys for range boundaries), then one reduce task per partition.
    AllToAll,
}

/// A read fused into a shuffle's map side ([`fuse_source`]): the read's stage, and the input
/// of each of its tasks, which are the shuffle's map tasks.
#[derive(Debug, Clone)]
pub(crate) struct MapSource {
    pub stage: Stage,
    pub tasks: Vec<StageInput>,
    /// For a sort: the read narrowed to the sort keys' columns, which its sample tasks read
    /// (a file each) before its map tasks read the whole rows.
    pub keys_only: Option<Stage>,
}

/// Where a cached operator's shards go.
#[derive(Debug, Clone)]
pub(crate) struct CacheTarget {
    pub lineage: FingerprintInputs,
    pub fingerprint: Fingerprint,
    /// Recompute mode: overwrite shards that are there.
    pub overwrite: bool,
}

/// One operator as planned: its stage, how it runs and what the cache gives it.
#[derive(Debug, Clone)]
pub(crate) struct PlannedOperator {
    pub name: String,
    pub stage: Stage,
    pub work: Work,
    /// Operator indices this one reads, in input order.
    pub inputs: Vec<usize>,
    pub cache: Option<CacheTarget>,
    /// Shards found in the cache (loaded instead of computed).
    pub cache_hits: u64,
    /// Whether the job runs it (an operator below a full cache hit does not).
    pub needed: bool,
    /// The job's sink, fused into this operator (see [`fuse_sink`]): the tasks that make its
    /// output rows write them there.
    pub sink: Option<WriteSpec>,
    /// A shuffle's read, fused into its map side (see [`fuse_source`]).
    pub map_source: Option<MapSource>,
}

/// The job's operators in topological order; the last one needed is the output.
pub(crate) struct Planned {
    pub operators: Vec<PlannedOperator>,
    pub output: usize,
}

/// Why a job cannot be planned; the job fails with it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PlanningError {
    #[error("the plan cannot be optimized: {0}")]
    Optimize(#[source] Box<PlanError>),
    #[error("a read of more than 2^32 files")]
    TooManyFiles,
    #[error("cannot describe {operator}: {source}")]
    Lineage {
        operator: String,
        source: Box<PlanError>,
    },
}

/// What progress and stats call `stage`: its kind, then each row-wise operator fused into it
/// (`read→filter→with_column`, `map→map_batches`), so the time a fused UDF takes shows under
/// a name that says so.
fn stage_name(stage: &Stage) -> String {
    std::iter::once(stage.kind.name())
        .chain(stage.row_ops.iter().map(|operator| operator.name()))
        .collect::<Vec<_>>()
        .join(&floe_core::job::FUSED_SEPARATOR.to_string())
}

/// Plans `spec` against the cache index.
pub(crate) fn plan(
    spec: &JobSpec,
    cache: &CacheIndex,
    config: &DriverConfig,
) -> Result<Planned, PlanningError> {
    let optimized = Optimizer::default()
        .optimize(&spec.plan)
        .map_err(|error| PlanningError::Optimize(Box::new(error)))?;
    let physical = PhysicalPlan::from_logical(&optimized);
    let mut logical = BTreeMap::new();
    collect_nodes(&optimized, &mut logical);
    let mut operators = Vec::with_capacity(physical.stages.len());
    for stage in &physical.stages {
        let work = match &stage.kind {
            StageKind::Read(scan) => Work::Source(
                (0..scan.files.len())
                    .map(|file| {
                        u32::try_from(file).map(|file| SourceTask::Compute(StageInput::File(file)))
                    })
                    .collect::<Result<_, _>>()
                    .map_err(|_| PlanningError::TooManyFiles)?,
            ),
            StageKind::Range { n } => Work::Source(range_tasks(*n, config.batch_rows)),
            StageKind::FromBatches { .. } => {
                Work::Source(vec![SourceTask::Compute(StageInput::Inline)])
            }
            StageKind::Materialized(source) => Work::Source(
                source
                    .blocks
                    .iter()
                    .map(|block| SourceTask::Borrow(*block))
                    .collect(),
            ),
            StageKind::Map => Work::Map,
            StageKind::Limit { n } => Work::Limit(*n),
            StageKind::Union => Work::Union,
            StageKind::Cache => Work::PassThrough,
            StageKind::Write(_) => Work::Sink,
            StageKind::AllToAll(_) => Work::AllToAll,
        };
        operators.push(PlannedOperator {
            name: stage_name(stage),
            stage: stage.clone(),
            work,
            inputs: stage.inputs.iter().map(|input| input.0).collect(),
            cache: None,
            cache_hits: 0,
            needed: false,
            sink: None,
            map_source: None,
        });
    }
    let mut output = physical.output.0;
    if spec.options.cache == CacheMode::NoCache {
        output = fuse_sink(&mut operators, output);
    } else {
        // A sink's files are not cache shards; what it writes is, so that adding a sink to a
        // pipeline whose result is cached loads that result instead of computing it again.
        let mut cached = Vec::new();
        if matches!(operators[output].work, Work::Sink) {
            cached.extend(operators[output].inputs.iter().copied());
        } else {
            cached.push(output);
        }
        cached.extend(
            (0..operators.len()).filter(|index| matches!(operators[*index].work, Work::AllToAll)),
        );
        for operator in &operators {
            if matches!(operator.stage.kind, StageKind::Cache) {
                // The mark's producer has the same fingerprint; caching there lets a source
                // producer serve partial hits.
                cached.extend(operator.inputs.first().copied());
            }
        }
        for index in cached {
            let operator = &mut operators[index];
            let Some(node) = logical.get(&operator.stage.fingerprint) else {
                continue;
            };
            let lineage = node.lineage().map_err(|source| PlanningError::Lineage {
                operator: operator.name.clone(),
                source: Box::new(source),
            })?;
            operator.cache = Some(CacheTarget {
                lineage,
                fingerprint: operator.stage.fingerprint,
                overwrite: spec.options.cache == CacheMode::Recompute,
            });
        }
    }
    fuse_sources(&mut operators, &mut output);
    mark_needed(
        &mut operators,
        output,
        cache,
        spec.options.cache == CacheMode::Reuse,
    );
    Ok(Planned { operators, output })
}

fn collect_nodes(plan: &LogicalPlan, nodes: &mut BTreeMap<Fingerprint, LogicalPlan>) {
    // A `.cache()` node shares its input's fingerprint; either describes the data.
    nodes
        .entry(plan.fingerprint())
        .or_insert_with(|| plan.clone());
    for input in plan.inputs() {
        collect_nodes(input, nodes);
    }
}

/// Fuses the sink that is the job's output into the operator feeding it, when that operator
/// runs a task per output bundle (a source, a map or a shuffle's reduces) and nothing else
/// reads it: each of those tasks then writes the rows it made as its part of the sink, so they
/// never pass through the object store — Ray fuses a write into the map before it. Only
/// without caching: a cached operator's output must be blocks, for its shards. Returns the
/// output operator.
fn fuse_sink(operators: &mut Vec<PlannedOperator>, output: usize) -> usize {
    let sink = &operators[output];
    let (StageKind::Write(spec), &[producer]) = (&sink.stage.kind, sink.inputs.as_slice()) else {
        return output;
    };
    let readers = operators
        .iter()
        .filter(|operator| operator.inputs.contains(&producer))
        .count();
    let runs_a_task_per_bundle = matches!(
        operators[producer].work,
        Work::Source(_) | Work::Map | Work::AllToAll
    );
    // The sink is removed from the list, which must not renumber any other operator.
    if output + 1 != operators.len() || readers != 1 || !runs_a_task_per_bundle {
        return output;
    }
    let spec = spec.clone();
    operators.pop();
    let fused = &mut operators[producer];
    fused.name = format!("{}{}write", fused.name, floe_core::job::FUSED_SEPARATOR);
    fused.sink = Some(spec);
    producer
}

/// Fuses each read that only a hash or random shuffle reads into that shuffle's map side
/// ([`fuse_source`]), and renumbers the operators after the reads it removes.
fn fuse_sources(operators: &mut Vec<PlannedOperator>, output: &mut usize) {
    let mut index = 0;
    while index < operators.len() {
        match fuse_source(operators, index) {
            Some(removed) => {
                operators.remove(removed);
                for operator in operators.iter_mut() {
                    for input in &mut operator.inputs {
                        if *input > removed {
                            *input -= 1;
                        }
                    }
                }
                if *output > removed {
                    *output -= 1;
                }
                // The shuffle moved down one place, and it is fused now.
            }
            None => index += 1,
        }
    }
}

/// Fuses the read feeding shuffle `index` into the shuffle's map side when nothing else reads
/// it, nothing caches it, and the shuffle splits rows without counting them first (by key
/// hash, at random, or by sort-key range, one input): each of the read's tasks then splits
/// the rows it reads into the shuffle's partitions itself, so they are never written to the
/// object store as the read's blocks and read back by a map task (Ray fuses a read into the
/// map before a shuffle the same way). A sort's sample tasks read only the key columns of a
/// file each ([`keys_only`]), so a sort is fused only when its read is a plain one. A read of
/// many files keeps its own operator, so the map tasks can take several files' blocks each.
/// Returns the read's index, to be removed.
fn fuse_source(operators: &mut [PlannedOperator], index: usize) -> Option<usize> {
    let shuffle = &operators[index];
    let (Work::AllToAll, StageKind::AllToAll(operator), &[producer], None) = (
        &shuffle.work,
        &shuffle.stage.kind,
        shuffle.inputs.as_slice(),
        &shuffle.map_source,
    ) else {
        return None;
    };
    let read = &operators[producer];
    let (splits_as_it_reads, keys_only) = match exchange_for(operator)?.routing() {
        Routing::Hash | Routing::Random => (true, None),
        Routing::Range(keys) => match keys_only(&read.stage, keys) {
            Some(stage) => (true, Some(stage)),
            None => (false, None),
        },
        Routing::Position => (false, None),
    };
    let readers = operators
        .iter()
        .filter(|operator| operator.inputs.contains(&producer))
        .count();
    let Work::Source(tasks) = &read.work else {
        return None;
    };
    let files: Vec<StageInput> = tasks
        .iter()
        .map(|task| match task {
            SourceTask::Compute(input @ StageInput::File(_)) => Some(*input),
            _ => None,
        })
        .collect::<Option<_>>()?;
    let fusable = splits_as_it_reads
        && readers == 1
        && matches!(read.stage.kind, StageKind::Read(_))
        && read.cache.is_none()
        && files.len() <= MAX_FUSED_MAP_TASKS
        // The agent leases process-UDF children for a task's own stage only.
        && process_udfs(&read.stage.row_ops).is_ok_and(|udfs| udfs.is_empty());
    if !fusable {
        return None;
    }
    let map_source = MapSource {
        stage: read.stage.clone(),
        tasks: files,
        keys_only,
    };
    let name = format!(
        "{}{}{}",
        read.name,
        floe_core::job::FUSED_SEPARATOR,
        shuffle.name
    );
    let shuffle = &mut operators[index];
    shuffle.name = name;
    shuffle.inputs.clear();
    shuffle.map_source = Some(map_source);
    Some(producer)
}

/// The read `stage` narrowed to the columns of the sort `keys`, for the sort's sample tasks:
/// `None` unless the stage is a plain read (no row-wise operators, predicate or limit) whose
/// columns include every key.
fn keys_only(stage: &Stage, keys: &[SortKey]) -> Option<Stage> {
    let StageKind::Read(scan) = &stage.kind else {
        return None;
    };
    if !stage.row_ops.is_empty() || scan.predicate.is_some() || scan.limit.is_some() {
        return None;
    }
    // In schema order, as a scan's projection is.
    let columns: Vec<String> = stage
        .schema
        .fields()
        .iter()
        .map(|field| field.name().clone())
        .filter(|name| keys.iter().any(|key| key.column == *name))
        .collect();
    if keys.iter().any(|key| !columns.contains(&key.column)) {
        return None;
    }
    let narrowed = FileScan {
        projection: Some(columns),
        ..scan.clone()
    };
    let schema = LogicalPlan::read(narrowed.clone()).ok()?.schema().clone();
    Some(Stage {
        kind: StageKind::Read(narrowed),
        schema,
        ..stage.clone()
    })
}

/// `range(n)` cut into tasks by `n` alone, so equal plans cut equally.
fn range_tasks(n: u64, batch_rows: u32) -> Vec<SourceTask> {
    let per_task = u64::from(batch_rows.max(1)) * RANGE_BATCHES_PER_TASK;
    let tasks = n.div_ceil(per_task).clamp(1, RANGE_MAX_TASKS);
    let per_task = n.div_ceil(tasks).max(1);
    (0..tasks)
        .map(|task| {
            let start = (task * per_task).min(n);
            let end = ((task + 1) * per_task).min(n);
            SourceTask::Compute(StageInput::Range { start, end })
        })
        .collect()
}

/// Walks down from `output` marking the operators the job runs, turning cached operators
/// into cache loads when `reuse` allows.
fn mark_needed(operators: &mut [PlannedOperator], output: usize, cache: &CacheIndex, reuse: bool) {
    let mut stack = vec![output];
    while let Some(index) = stack.pop() {
        let operator = &mut operators[index];
        if operator.needed {
            continue;
        }
        operator.needed = true;
        if let (Some(target), true) = (&operator.cache, reuse) {
            let entries = cache
                .get(&target.fingerprint.to_string())
                .cloned()
                .unwrap_or_default();
            if let Some((count, entry)) = complete_entry(&entries, source_count(operator)) {
                operator.cache_hits = u64::from(count);
                let own = match &operator.work {
                    Work::Source(tasks) if tasks.len() == count as usize => tasks.clone(),
                    _ => Vec::new(),
                };
                operator.work = Work::Source(
                    entry
                        .shards
                        .iter()
                        .map(|(rank, shard)| {
                            let recompute = match own.get(*rank as usize) {
                                Some(SourceTask::Compute(input)) => Some(*input),
                                _ => None,
                            };
                            SourceTask::Load(ShardToLoad {
                                node: shard.node,
                                rank: *rank,
                                count,
                                recompute,
                            })
                        })
                        .collect(),
                );
                operator.inputs.clear();
                continue;
            }
            if let Work::Source(tasks) = &mut operator.work {
                let count = u32::try_from(tasks.len()).unwrap_or(u32::MAX);
                let present = entries.get(&count).map(|entry| &entry.shards);
                for (rank, task) in (0..count).zip(tasks.iter_mut()) {
                    if let (Some(shard), SourceTask::Compute(input)) =
                        (present.and_then(|shards| shards.get(&rank)), *task)
                    {
                        *task = SourceTask::Load(ShardToLoad {
                            node: shard.node,
                            rank,
                            count,
                            recompute: Some(input),
                        });
                        operator.cache_hits += 1;
                    }
                }
            }
        }
        stack.extend(operator.inputs.iter().copied());
    }
}

/// The shard count of a source operator's output (one shard per task), if it is one.
fn source_count(operator: &PlannedOperator) -> Option<u32> {
    match &operator.work {
        Work::Source(tasks) => u32::try_from(tasks.len()).ok(),
        _ => None,
    }
}

/// A complete set of shards, preferring the count `wanted`, then the nearest.
fn complete_entry(
    entries: &BTreeMap<u32, CacheEntry>,
    wanted: Option<u32>,
) -> Option<(u32, CacheEntry)> {
    entries
        .iter()
        .filter(|(count, entry)| entry.shards.len() == **count as usize && **count > 0)
        .min_by_key(|(count, _)| wanted.map_or(0, |wanted| count.abs_diff(wanted)))
        .map(|(count, entry)| (*count, entry.clone()))
}
