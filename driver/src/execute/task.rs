//! One task: how it is (re)made, where it is placed (in the job's leases, with a memory hint
//! from its input's size), running it on a node (or through a hash shuffle's aggregator, or
//! loading a cache shard), and what its result does to its operator: the bundle it made, a
//! retry, or a rebuild of an input lost with its node.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use floe_api::node_protocol::{
    ActorFailure, ActorMessage, ActorReply, InputRef, NodeRequest, NodeResponse, ShardLoad,
    TaskDone, TaskFailure, TaskKind, TaskRecord, TaskRunState, TaskSpec, WorkerRef, output_id,
};
use floe_api::placement::{PlacementRequest, Strategy};
use floe_core::plan::physical::{Stage, StageKind};
use floe_core::plan::task::{FusedSource, SinkPart, StageInput, StageTask};
use floe_core::plan::{FileFormat, WriteSpec};
use floe_core::{ActorId, JobId, NodeId, ObjectId, TaskId};
use floe_engine::udf::process::process_udfs;

use super::aggregators::ReduceRoute;
use super::blocks::{BlockInfo, Bundle};
use super::operator::OperatorPhase;
use super::shuffle::SAMPLE_SEQ;
use super::{Event, Execution, MAX_UNREACHABLE_RETRIES, TASK_CPU_MILLIS, UNREACHABLE_PAUSE};
use crate::DriverConfig;
use crate::cluster::ClusterAccess;
use crate::leases::JobLeases;
use crate::plan::{MapSource, ShardToLoad, Work};
use crate::tasks::RunEnd;

/// Row-wise tasks whose inputs are smaller than this are spread; larger ones go where their
/// input is (Ray Data's rule).
const SPREAD_MAX_INPUT_BYTES: u64 = 50 * 1024 * 1024;

/// How a task's bundle is (re)made.
#[derive(Debug, Clone)]
pub(super) enum Recipe {
    Compute {
        input: StageInput,
        inputs: Vec<ObjectId>,
        /// A shuffle map task's input in the read fused into it (its file), read instead of
        /// input blocks.
        source: Option<StageInput>,
    },
    Load(ShardToLoad),
}

/// A first run of a task that computes `input` from `inputs`.
pub(super) fn compute(seq: u64, input: StageInput, inputs: Vec<ObjectId>) -> Launch {
    Launch::first(
        seq,
        Recipe::Compute {
            input,
            inputs,
            source: None,
        },
    )
}

/// One run of a task of an operator.
#[derive(Debug, Clone)]
pub(super) struct Launch {
    pub(super) seq: u64,
    pub(super) task: TaskId,
    pub(super) recipe: Recipe,
    /// A node to stay away from (the one a previous attempt failed on).
    pub(super) avoid: Option<NodeId>,
    /// Rebuilding a lost bundle rather than producing it the first time.
    pub(super) rebuild: bool,
}

impl Launch {
    /// The first run of task `seq`, under a new task id.
    pub(super) fn first(seq: u64, recipe: Recipe) -> Self {
        Self {
            seq,
            task: TaskId::random(),
            recipe,
            avoid: None,
            rebuild: false,
        }
    }
}

/// Why one run of a task produced no bundle.
pub(super) enum RunFailure {
    /// The task ran and failed.
    Failed(TaskFailure),
    /// The node or the scheduler could not be reached.
    Unreachable(String),
    /// A shard the cache index named is gone (cleaned, evicted or damaged).
    StaleCache(String),
    /// The aggregator a reduce was sent to is gone.
    ActorGone { actor: ActorId, message: String },
}

impl std::fmt::Display for RunFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunFailure::Failed(failure) => write!(f, "{failure}"),
            RunFailure::Unreachable(message) => write!(f, "unreachable: {message}"),
            RunFailure::StaleCache(message) => write!(f, "cache shard gone: {message}"),
            RunFailure::ActorGone { actor, message } => {
                write!(f, "aggregator {actor} gone: {message}")
            }
        }
    }
}

/// Now, in Unix milliseconds.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
        })
}

impl<C: ClusterAccess> Execution<C> {
    pub(super) fn start(&mut self, index: usize, launch: Launch) {
        let aggregator = match self.reduce_route(index, &launch) {
            ReduceRoute::Direct => None,
            ReduceRoute::Aggregator { actor, node } => {
                self.count_call(index, actor);
                Some((actor, node))
            }
            ReduceRoute::AggregatorStarting => {
                // Its aggregator is being created: ask again after a pause, the task counted
                // as running meanwhile.
                self.ops[index].running += 1;
                self.running.insert(launch.task);
                let events = self.events_tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(UNREACHABLE_PAUSE).await;
                    let _ = events.send(Event::Requeue { op: index, launch });
                });
                return;
            }
        };
        let op = &mut self.ops[index];
        op.running += 1;
        op.started.get_or_insert_with(Instant::now);
        let history = op.history_of(launch.seq);
        history.recipe = Some(launch.recipe.clone());
        let attempt = history.failures + history.unreachable + 1;
        self.config.tasks.started(
            self.job,
            TaskRecord {
                task: launch.task,
                operator: self.ops[index].name.clone(),
                seq: launch.seq,
                attempt,
                state: TaskRunState::Running,
                node: None,
                worker: None,
                rows: 0,
                bytes: 0,
                started_ms: unix_ms(),
                ended_ms: None,
                error: None,
            },
        );
        self.running.insert(launch.task);
        let inputs: Vec<(ObjectId, Option<BlockInfo>)> = match &launch.recipe {
            Recipe::Compute { inputs, .. } => inputs
                .iter()
                .map(|object| {
                    let info = self.blocks.get(object).or(self.borrowed.get(object));
                    (*object, info.copied())
                })
                .collect(),
            Recipe::Load(_) => Vec::new(),
        };
        let map_source = self.ops[index].map_source.clone();
        let input_bytes = match (&launch.recipe, &map_source) {
            (
                Recipe::Compute {
                    source: Some(input),
                    ..
                },
                Some(map_source),
            ) => input_bytes(&map_source.stage, input, &inputs),
            (Recipe::Compute { input, .. }, _) => {
                input_bytes(&self.ops[index].stage, input, &inputs)
            }
            (Recipe::Load(_), _) => 0,
        };
        let reads_itself = matches!(
            launch.recipe,
            Recipe::Compute {
                source: Some(_),
                ..
            }
        );
        let run = TaskRun {
            cluster: Arc::clone(&self.cluster),
            leases: Arc::clone(&self.leases),
            input_bytes,
            memory_hint_cap: self.limits.memory_hint_cap,
            job: self.job,
            config: Arc::clone(&self.config),
            stage: Arc::clone(&self.ops[index].stage),
            input_schemas: Arc::clone(&self.ops[index].input_schemas),
            sink: sink_part(self.ops[index].sink.as_ref(), &launch),
            map_source,
            strategy: self.strategy(index, &inputs, launch.avoid, reads_itself),
            aggregator,
        };
        let events = self.events_tx.clone();
        tokio::spawn(async move {
            let mut worker = None;
            let (node, result) = run.run(&launch, &inputs, &mut worker).await;
            let _ = events.send(Event::Task {
                op: index,
                launch,
                node,
                worker,
                result,
            });
        });
    }

    /// Where a task goes: away from `avoid` (where it failed), else spread when it reads a
    /// source itself (`reads_itself`, as a read's tasks are) or its input is small, else by
    /// default, near its input.
    fn strategy(
        &self,
        index: usize,
        inputs: &[(ObjectId, Option<BlockInfo>)],
        avoid: Option<NodeId>,
        reads_itself: bool,
    ) -> Strategy {
        if let Some(avoid) = avoid {
            let others: Vec<NodeId> = self
                .cluster
                .alive_nodes()
                .into_iter()
                .filter(|node| *node != avoid)
                .collect();
            if !others.is_empty() {
                let pick = others[self.ops[index].stats.retries as usize % others.len()];
                return Strategy::NodeAffinity {
                    node: pick,
                    soft: true,
                };
            }
        }
        let input_bytes: u64 = inputs
            .iter()
            .filter_map(|(_, info)| info.map(|info| info.bytes))
            .sum();
        match self.ops[index].work {
            _ if reads_itself => Strategy::Spread,
            Work::Source(_) => Strategy::Spread,
            Work::Map if input_bytes < SPREAD_MAX_INPUT_BYTES => Strategy::Spread,
            _ => Strategy::Default,
        }
    }

    /// Records how a run ended in the driver's task table.
    pub(super) fn record_end(
        &self,
        launch: &Launch,
        node: Option<NodeId>,
        worker: Option<WorkerRef>,
        result: &Result<TaskDone, RunFailure>,
    ) {
        let (rows, bytes, error) = match result {
            Ok(done) => (
                done.rows(),
                done.outputs.iter().map(|output| output.size).sum(),
                None,
            ),
            Err(failure) => (0, 0, Some(failure.to_string())),
        };
        self.config.tasks.ended(
            self.job,
            launch.task,
            RunEnd {
                node,
                worker,
                rows,
                bytes,
                ended_ms: unix_ms(),
                error,
            },
        );
    }

    pub(super) fn task_succeeded(
        &mut self,
        index: usize,
        launch: Launch,
        node: NodeId,
        done: TaskDone,
    ) {
        let rows = done.rows();
        let outputs = done.outputs;
        let maker = (index, launch.seq, launch.task);
        let bundle = Bundle {
            blocks: self.record_outputs(maker, node, &outputs, launch.rebuild),
        };
        if launch.rebuild {
            self.ops[index].stats.rebuilt += 1;
            // Tasks wait for a lost block, or for the lost object holding it.
            let made: Vec<ObjectId> = outputs
                .iter()
                .map(|output| output.object)
                .chain(bundle.blocks.iter().copied())
                .collect();
            for (op, waiting) in self.lineage.rebuilt(index, launch.seq, &made) {
                self.requeue(op, waiting);
            }
            return;
        }
        if matches!(self.ops[index].work, Work::AllToAll) && launch.seq >= SAMPLE_SEQ {
            self.map_side_done(index, &launch, bundle.blocks);
            return;
        }
        let op = &mut self.ops[index];
        op.tasks_done += 1;
        if matches!(launch.recipe, Recipe::Compute { .. }) {
            op.stats.tasks += 1;
        }
        op.stats.rows += rows;
        op.stats.bytes += outputs.iter().map(|output| output.size).sum::<u64>();
        op.ended = Some(Instant::now());
        // A source's shard count is known up front: its shards are written as they finish.
        if let (Some(target), Work::Source(tasks), Recipe::Compute { .. }) =
            (&op.cache, &op.work, &launch.recipe)
        {
            let count = u32::try_from(tasks.len()).unwrap_or(u32::MAX);
            let rank = u32::try_from(launch.seq).unwrap_or(u32::MAX);
            let target = target.clone();
            op.stats.cache_misses += 1;
            self.write_shard(index, target, rank, count, node, bundle.blocks.clone());
        }
        match &launch.recipe {
            // A reduce's inputs are its partition's blocks, read by no other task (but the
            // hot-key task, for a skewed partition).
            Recipe::Compute {
                input: StageInput::Reduce { partition, .. },
                inputs,
                ..
            } => {
                let hot = self.ops[index].shuffle.hot_partition;
                if hot.is_some_and(|hot| hot.partition == *partition) {
                    self.hot_reader_done(index, inputs);
                } else {
                    self.free_now(inputs);
                }
            }
            Recipe::Compute { inputs, .. } => self.release_inputs(inputs),
            Recipe::Load(_) => {}
        }
        self.ops[index].finished.insert(launch.seq, bundle);
        self.emit_ready(index);
    }

    pub(super) fn task_failed(
        &mut self,
        index: usize,
        launch: Launch,
        node: Option<NodeId>,
        failure: RunFailure,
    ) {
        let name = self.ops[index].name.clone();
        match failure {
            RunFailure::Failed(TaskFailure::InputUnavailable { object, reason })
                if self.borrowed.contains_key(&object) =>
            {
                let message = format!(
                    "block {object} of the materialized result it reads is gone ({reason}); \
                     materialize the dataset again"
                );
                self.fail(index, message);
            }
            RunFailure::Failed(TaskFailure::InputUnavailable { object, reason }) => {
                tracing::info!(job = %self.job, operator = %name, %object, %reason, "rebuilding a lost input");
                self.rebuild(object);
                self.rebuild_lost_inputs(&launch);
                self.lineage.wait_for(object, index, launch);
            }
            RunFailure::Failed(TaskFailure::Cancelled) => {}
            RunFailure::StaleCache(message) => self.shard_gone(index, launch, message),
            RunFailure::Failed(failure) if failure.retryable() => {
                let retries = self.options.max_task_retries;
                let op = &mut self.ops[index];
                let attempts = &mut op.history_of(launch.seq).failures;
                *attempts += 1;
                if *attempts > retries {
                    let message =
                        format!("a task failed {attempts} times; the last time: {failure}");
                    self.fail(index, message);
                    return;
                }
                op.stats.retries += 1;
                tracing::warn!(job = %self.job, operator = %name, %failure, "retrying a task");
                self.requeue(
                    index,
                    Launch {
                        avoid: node,
                        ..launch
                    },
                );
            }
            RunFailure::Failed(failure) => self.fail(index, failure.to_string()),
            RunFailure::ActorGone { actor, message } => {
                if let Recipe::Compute {
                    input: StageInput::Reduce { partition, .. },
                    ..
                } = &launch.recipe
                    && let Some(pool) = &self.ops[index].shuffle.aggregators
                {
                    let slot = pool.slot_of(*partition);
                    self.replace_aggregator(index, slot, actor, node);
                }
                self.task_failed(index, launch, node, RunFailure::Unreachable(message));
            }
            RunFailure::Unreachable(message) => {
                let op = &mut self.ops[index];
                let tries = &mut op.history_of(launch.seq).unreachable;
                *tries += 1;
                if *tries > MAX_UNREACHABLE_RETRIES {
                    self.fail(index, message);
                    return;
                }
                op.stats.retries += 1;
                tracing::info!(job = %self.job, operator = %name, %message, "unreachable; placing the task again");
                // Queued again after a pause, so a node whose death has not committed yet is
                // not hammered; the operator counts the task as running meanwhile.
                op.running += 1;
                self.running.insert(launch.task);
                let events = self.events_tx.clone();
                let launch = Launch {
                    avoid: node.or(launch.avoid),
                    ..launch
                };
                tokio::spawn(async move {
                    tokio::time::sleep(UNREACHABLE_PAUSE).await;
                    let _ = events.send(Event::Requeue { op: index, launch });
                });
            }
        }
    }

    /// Puts a task back at the front of its operator's queue — unless the operator was
    /// stopped by a limit and the task is not a rebuild some consumer waits for.
    pub(super) fn requeue(&mut self, index: usize, launch: Launch) {
        let op = &mut self.ops[index];
        if op.phase == OperatorPhase::Stopped && !launch.rebuild {
            return;
        }
        op.ready.push_front(launch);
    }
}

/// The part of an operator's fused `sink` that `launch` writes: a task making the operator's
/// output rows writes them as the part numbered by its place in the output; a shuffle's
/// map-side tasks write nothing.
fn sink_part(sink: Option<&WriteSpec>, launch: &Launch) -> Option<SinkPart> {
    let spec = sink?;
    // Cache loads never run with a fused sink: it is fused only when nothing is cached.
    let Recipe::Compute { input, .. } = &launch.recipe else {
        return None;
    };
    input.makes_output_rows().then(|| SinkPart {
        spec: spec.clone(),
        index: u32::try_from(launch.seq).unwrap_or(u32::MAX),
    })
}

/// How many bytes a Parquet file's rows are taken to fill decoded, per byte of the file,
/// before they are read: a columnar file holds them encoded and compressed (a file of
/// repeated values decodes to ten times its size and more). Rows of text formats take about
/// their own bytes.
const PARQUET_BYTES_PER_FILE_BYTE: u64 = 4;

/// The bytes a task reads: its input blocks, else the rows of the file it reads (as decoded:
/// [`PARQUET_BYTES_PER_FILE_BYTE`]), or its ids or inline rows. Its memory hint, since the
/// task's working set grows with what it reads (decoded batches, the output it builds).
pub(super) fn input_bytes(
    stage: &Stage,
    input: &StageInput,
    inputs: &[(ObjectId, Option<BlockInfo>)],
) -> u64 {
    /// One `Int64` id of a range stage.
    const ID_BYTES: u64 = 8;
    let blocks: u64 = inputs
        .iter()
        .filter_map(|(_, info)| info.map(|info| info.bytes))
        .sum();
    let source = match (&stage.kind, input) {
        (StageKind::Read(scan), StageInput::File(index)) => {
            let per_file_byte = match scan.format {
                FileFormat::Parquet => PARQUET_BYTES_PER_FILE_BYTE,
                _ => 1,
            };
            let file = scan.files.get(*index as usize);
            file.map_or(0, |file| file.size.saturating_mul(per_file_byte))
        }
        (_, StageInput::Range { start, end }) => {
            end.saturating_sub(*start).saturating_mul(ID_BYTES)
        }
        (StageKind::FromBatches { ipc, .. }, StageInput::Inline) => ipc.len() as u64,
        _ => 0,
    };
    blocks.saturating_add(source)
}

/// One run of a task, spawned off the execution with what it needs: places it in the job's
/// leases, runs it on its node (or through its aggregator, or loads its cache shard) and
/// answers what it made.
struct TaskRun<C: ClusterAccess> {
    cluster: Arc<C>,
    leases: Arc<JobLeases<C>>,
    /// What the task reads, and the most heap a hint may ask of one node.
    input_bytes: u64,
    memory_hint_cap: u64,
    job: JobId,
    config: Arc<DriverConfig>,
    stage: Arc<Stage>,
    input_schemas: Arc<Vec<arrow::datatypes::Schema>>,
    /// The part of the operator's fused sink this task writes.
    sink: Option<SinkPart>,
    /// The read fused into the operator's map side, whose file a map task reads.
    map_source: Option<Arc<MapSource>>,
    strategy: Strategy,
    /// A hash shuffle's reduce runs through the partition's aggregator, on its node.
    aggregator: Option<(ActorId, NodeId)>,
}

impl<C: ClusterAccess> TaskRun<C> {
    /// Runs one task where the scheduler places it (or loads a shard where it is cached);
    /// `worker` is set to the worker process that ran it, once one did.
    async fn run(
        &self,
        launch: &Launch,
        inputs: &[(ObjectId, Option<BlockInfo>)],
        worker: &mut Option<WorkerRef>,
    ) -> (Option<NodeId>, Result<TaskDone, RunFailure>) {
        let unreachable =
            |error: &dyn std::fmt::Display| RunFailure::Unreachable(error.to_string());
        match &launch.recipe {
            Recipe::Load(ShardToLoad {
                node, rank, count, ..
            }) => {
                let addr = match self.cluster.address(*node).await {
                    Ok(addr) => addr,
                    Err(error) => {
                        let message = format!("cached shard {rank} of {count} is gone: {error}");
                        return (Some(*node), Err(RunFailure::StaleCache(message)));
                    }
                };
                let load = ShardLoad {
                    job: self.job,
                    fingerprint: self.stage.fingerprint,
                    rank: *rank,
                    count: *count,
                    object: output_id(launch.task, 0),
                };
                let result = match self
                    .cluster
                    .call_node(&addr, &NodeRequest::LoadCacheShard(load))
                    .await
                {
                    Ok(NodeResponse::CacheLoaded(Some(output))) => Ok(TaskDone {
                        outputs: vec![output],
                        written_rows: 0,
                    }),
                    Ok(NodeResponse::CacheLoaded(None)) => Err(RunFailure::StaleCache(format!(
                        "cached shard {rank} of {count} of {} is missing or damaged on node {node}",
                        self.stage.fingerprint
                    ))),
                    Ok(other) => Err(unreachable(&format!("unexpected answer {other:?}"))),
                    Err(error) => Err(unreachable(&error)),
                };
                (Some(*node), result)
            }
            Recipe::Compute { input, source, .. } => {
                let mut preferred: BTreeMap<NodeId, u64> = BTreeMap::new();
                for (_, info) in inputs {
                    if let Some(info) = info {
                        *preferred.entry(info.node).or_default() += info.bytes;
                    }
                }
                // A process UDF's children need their memory on the node that runs them, and
                // the task's working set grows with its input (capped so that some node can
                // always hold it).
                let memory_hint = match process_udfs(&self.stage.row_ops) {
                    Ok(udfs) => {
                        let children: u64 = udfs.iter().map(|udf| udf.memory).sum();
                        let room = self.memory_hint_cap.saturating_sub(children);
                        children.saturating_add(self.input_bytes.min(room))
                    }
                    Err(error) => {
                        let message = error.to_string();
                        return (
                            None,
                            Err(RunFailure::Failed(TaskFailure::Error { message })),
                        );
                    }
                };
                let strategy = match self.aggregator {
                    Some((_, node)) => Strategy::NodeAffinity { node, soft: false },
                    None => self.strategy,
                };
                let request = PlacementRequest {
                    cpu_millis: TASK_CPU_MILLIS,
                    memory_hint,
                    strategy,
                    preferred: preferred.into_iter().collect(),
                    requester: Some(self.config.node),
                };
                // A request no alive node can hold is asked again for a while, like an
                // unreachable node (the one big enough may be restarting), then fails the job
                // with the placement's reason.
                let slot = match self.leases.place(request).await {
                    Ok(slot) => slot,
                    Err(error) => return (None, Err(unreachable(&error))),
                };
                let node = slot.node();
                self.config.tasks.placed(self.job, launch.task, node);
                let fused = source
                    .zip(self.map_source.as_ref())
                    .map(|(file, map_source)| FusedSource {
                        // A sort's sample task reads only the keys.
                        stage: match (input, &map_source.keys_only) {
                            (StageInput::Sample { .. }, Some(keys)) => keys.clone(),
                            _ => map_source.stage.clone(),
                        },
                        input: file,
                    });
                let result = self
                    .run_on(node, launch.task, *input, fused, inputs, worker)
                    .await;
                // The room goes to the next task at once.
                drop(slot);
                (Some(node), result)
            }
        }
    }

    async fn run_on(
        &self,
        node: NodeId,
        task: TaskId,
        input: StageInput,
        source: Option<FusedSource>,
        inputs: &[(ObjectId, Option<BlockInfo>)],
        worker: &mut Option<WorkerRef>,
    ) -> Result<TaskDone, RunFailure> {
        let addr = self
            .cluster
            .address(node)
            .await
            .map_err(|error| RunFailure::Unreachable(error.to_string()))?;
        let mut refs = Vec::with_capacity(inputs.len());
        for (block, info) in inputs {
            // A block packed in a larger object is that object's part.
            let (object, part) = match info.and_then(|info| info.packed) {
                Some(packed) => (packed.object, Some(packed.part)),
                None => (*block, None),
            };
            let holder = match info {
                Some(info) if info.node != node => {
                    Some(self.cluster.address(info.node).await.map_err(|_| {
                        RunFailure::Failed(TaskFailure::InputUnavailable {
                            object,
                            reason: format!("its node {} is gone", info.node),
                        })
                    })?)
                }
                _ => None,
            };
            refs.push(InputRef {
                object,
                holder,
                part,
            });
        }
        let spec = TaskSpec {
            task,
            job: self.job,
            kind: TaskKind::Stage(Box::new(StageTask {
                stage: (*self.stage).clone(),
                input,
                input_schemas: (*self.input_schemas).clone(),
                min_block_bytes: self.config.min_block_bytes,
                max_block_bytes: self.config.max_block_bytes,
                batch_rows: self.config.batch_rows,
                sink: self.sink.clone(),
                source,
            })),
            inputs: refs,
        };
        // A reduce goes to its aggregator through the driver's own node, which routes it.
        let (addr, request) = match (self.aggregator, input) {
            (Some((actor, _)), StageInput::Reduce { partition, .. }) => {
                let via = self
                    .cluster
                    .address(self.config.node)
                    .await
                    .map_err(|error| RunFailure::Unreachable(error.to_string()))?;
                let message = ActorMessage::Reduce {
                    partition,
                    task: spec,
                };
                let request = NodeRequest::CallActor {
                    actor,
                    message,
                    forwarded: false,
                };
                (via, request)
            }
            _ => (addr, NodeRequest::RunTask(spec)),
        };
        let reply = tokio::select! {
            reply = self.cluster.run_task(&addr, &request) => reply,
            () = self.cluster.death_of(node) => {
                // Its leases went with it.
                self.leases.forget_node(node);
                return Err(RunFailure::Unreachable(format!("node {node} was declared dead")));
            }
        };
        match reply {
            Ok(NodeResponse::Task {
                result,
                worker: ran,
            }) => {
                *worker = ran;
                result.map_err(RunFailure::Failed)
            }
            Ok(NodeResponse::Actor(Ok(ActorReply::Reduced { done, worker: ran }))) => {
                *worker = ran;
                Ok(done)
            }
            Ok(NodeResponse::Actor(Err(ActorFailure::Task(failure)))) => {
                Err(RunFailure::Failed(failure))
            }
            Ok(NodeResponse::Actor(Err(ActorFailure::Gone { actor, reason }))) => {
                Err(RunFailure::ActorGone {
                    actor,
                    message: reason,
                })
            }
            // The aggregator refusing its own partition is a bug: no retry makes it right.
            Ok(NodeResponse::Actor(Err(refused @ ActorFailure::Refused { .. }))) => {
                Err(RunFailure::Failed(TaskFailure::Error {
                    message: refused.to_string(),
                }))
            }
            Ok(NodeResponse::Actor(Err(failure))) => {
                Err(RunFailure::Unreachable(failure.to_string()))
            }
            Ok(other) => Err(RunFailure::Unreachable(format!(
                "unexpected answer {other:?}"
            ))),
            Err(error) => Err(RunFailure::Unreachable(format!("node {node}: {error}"))),
        }
    }
}
