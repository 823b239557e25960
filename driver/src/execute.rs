//! The streaming executor.
//!
//! Operators exchange ordered streams of bundles (a task's output blocks, by object id). The
//! loop is Ray Data's: each step first applies every finished task (its bundle goes into the
//! operator's reorder buffer and is emitted, in order, into its consumers' input queues), then
//! turns queued input bundles into runnable tasks, then feeds the eligible operator with the
//! smallest out-queue, one task at a time, until none is eligible. An operator is eligible when
//! it has a runnable task, is under its concurrency cap (the cluster's CPUs) and, for a source,
//! the bytes queued between operators are under the job's object-store budget: sources are the
//! only operators that add data, so throttling them bounds what is in flight, and the stores
//! spill what is queued rather than running out.
//!
//! Tasks are placed through the scheduler (SPREAD for reads and small-input maps, DEFAULT with
//! the input holder preferred otherwise), run on the chosen node's workers, and report back on
//! a channel. A failed task is run again (on another node where possible) up to the job's
//! retry limit; a task whose input was lost with its node first rebuilds that input by running
//! the task that produced it again under the same task id, so the rebuilt block keeps its
//! object id (lineage reconstruction).

use floe_core::plan::task::{StageInput, StageTask};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floe_api::placement::{PlacementRequest, Strategy};
use floe_api::state::{CachedShard, Command, JobOutcome, JobStatus};
use floe_core::job::{
    JobOptions, JobProgress, JobStats, OperatorProgress, OperatorStats, OutputBlock,
};
use floe_core::plan::physical::{Stage, StageKind};
use floe_core::plan::{Operator, SeedChoice};
use floe_core::{ActorId, Fingerprint, JobId, NodeId, ObjectId, TaskId};
use tokio::sync::mpsc;

use super::DriverConfig;
use super::aggregators::{self, Aggregators};
use super::cluster::Cluster;
use super::plan::{CacheTarget, Planned, SourceTask, Work};
use floe_api::node_protocol::output_id;
use floe_api::node_protocol::{
    ActorFailure, ActorMessage, ActorReply, InputRef, NodeRequest, NodeResponse, OutputRef,
    ShardLoad, ShardWrite, TaskFailure, TaskKind, TaskSpec,
};
use floe_engine::exchange::SAMPLE_ROWS_PER_PARTITION;
use floe_engine::udf::process::process_udfs;

/// Row-wise tasks whose inputs are smaller than this are spread; larger ones go where their
/// input is (Ray Data's rule).
const SPREAD_MAX_INPUT_BYTES: u64 = 50 * 1024 * 1024;
/// Failures to reach a node or the scheduler (not the task's own failures) are retried this
/// many times, after a pause, before the job fails: a node's death takes a node timeout to
/// commit, and placements keep choosing it until then.
const MAX_UNREACHABLE_RETRIES: u32 = 40;
const UNREACHABLE_PAUSE: Duration = Duration::from_millis(250);
/// How long rebuilding output blocks lost at the end of a job may take before the job fails
/// (a rebuild that can never finish must not keep the job running).
const OUTPUT_REBUILD_TIMEOUT: Duration = Duration::from_secs(600);
/// The CPU one task reserves.
const TASK_CPU_MILLIS: u64 = 1000;
/// Sequence numbers of a shuffle's map-side tasks sit above every reduce partition's (a
/// reduce task's sequence number is its partition, which is its place in the output).
const SAMPLE_SEQ: u64 = 1 << 40;
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
/// Map tasks a shuffle runs per CPU of the cluster (see `Execution::map_groups`).
const MAP_TASKS_PER_CPU: u64 = 2;

/// The blocks of one task, in order.
#[derive(Debug, Clone, Default)]
struct Bundle {
    blocks: Vec<ObjectId>,
}

#[derive(Debug, Clone, Copy)]
struct BlockInfo {
    node: NodeId,
    rows: u64,
    bytes: u64,
}

/// How a task's bundle is (re)made.
#[derive(Debug, Clone)]
enum Recipe {
    Compute {
        input: StageInput,
        inputs: Vec<ObjectId>,
    },
    Load {
        node: NodeId,
        rank: u32,
        count: u32,
    },
}

/// A first run of a task that computes `input` from `inputs`.
fn compute(seq: u64, input: StageInput, inputs: Vec<ObjectId>) -> Launch {
    Launch {
        seq,
        task: TaskId::random(),
        recipe: Recipe::Compute { input, inputs },
        avoid: None,
        rebuild: false,
    }
}

#[derive(Debug, Clone)]
struct Launch {
    seq: u64,
    task: TaskId,
    recipe: Recipe,
    /// A node to stay away from (the one a previous attempt failed on).
    avoid: Option<NodeId>,
    /// Rebuilding a lost bundle rather than producing it the first time.
    rebuild: bool,
}

enum TaskError {
    /// The task ran and failed.
    Failed(TaskFailure),
    /// The node or the scheduler could not be reached.
    Unreachable(String),
    /// A shard the cache index named is gone (cleaned, evicted or damaged).
    StaleCache(String),
    /// The aggregator a reduce was sent to is gone.
    ActorGone { actor: ActorId, message: String },
}

/// How an execution ended.
pub(crate) struct Finished {
    pub outcome: JobOutcome,
    /// Fingerprints whose indexed shards turned out missing: the driver drops them from the
    /// index and plans the job again rather than failing it.
    pub stale_cache: BTreeSet<Fingerprint>,
}

enum Event {
    Task {
        op: usize,
        launch: Launch,
        node: Option<NodeId>,
        result: Result<Vec<OutputRef>, TaskError>,
    },
    CacheWritten {
        op: usize,
        result: Result<(), String>,
    },
    /// A task to run again after a pause.
    Requeue { op: usize, launch: Launch },
    /// An aggregator's creation ended: where it runs, or why it could not be created.
    AggregatorCreated {
        op: usize,
        slot: usize,
        actor: ActorId,
        result: Result<NodeId, String>,
    },
    /// An aggregator whose creation failed is to be tried again, after a pause.
    RetryAggregator {
        op: usize,
        slot: usize,
        actor: ActorId,
    },
}

/// Where a shuffle is: inputs are collected until every input has ended, then (for a sort)
/// sampled and bounded, then partitioned, then reduced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum ShufflePhase {
    #[default]
    Collecting,
    Sampling,
    Bounding,
    Partitioning,
    Reducing,
}

#[derive(Debug, Default)]
struct ShuffleState {
    phase: ShufflePhase,
    /// Input bundles per input (a join's left and right), in order.
    sides: Vec<Vec<Bundle>>,
    partitions: u32,
    samples: BTreeMap<u64, ObjectId>,
    sample_tasks: u64,
    boundaries: Option<ObjectId>,
    /// Map task sequence number → its output blocks, one per partition.
    map_outputs: BTreeMap<u64, Vec<ObjectId>>,
    map_tasks: u64,
    /// How many map tasks read the left input (they come first).
    left_maps: u64,
    /// A skewed partition: its index, its share of the shuffled bytes and its size against
    /// the median partition.
    hot_partition: Option<HotPartition>,
    /// The block naming its most frequent key.
    hot_key_block: Option<ObjectId>,
    /// A hash shuffle's aggregator actors, from its first input until it closes.
    aggregators: Option<Aggregators>,
}

#[derive(Debug, Clone, Copy)]
struct HotPartition {
    partition: u32,
    percent: u64,
    times_median: u64,
}

struct OpState {
    name: String,
    stage: Arc<Stage>,
    work: Work,
    inputs: Vec<usize>,
    consumers: Vec<(usize, usize)>,
    cache: Option<CacheTarget>,
    needed: bool,
    /// Input bundles not yet taken by a task, per input.
    queued: Vec<VecDeque<Bundle>>,
    inputs_done: Vec<bool>,
    ready: VecDeque<Launch>,
    next_seq: u64,
    next_emit: u64,
    finished: BTreeMap<u64, Bundle>,
    recipes: BTreeMap<u64, Recipe>,
    attempts: BTreeMap<u64, u32>,
    unreachable: BTreeMap<u64, u32>,
    running: u64,
    /// Bundles emitted (in order): what a cached non-source operator writes at its end.
    emitted: Vec<Bundle>,
    /// A limit downstream has what it needs: launch nothing more.
    stopped: bool,
    closed: bool,
    /// Rows taken by a limit so far.
    limit_rows: u64,
    limit_taken: Vec<ObjectId>,
    /// A shuffle's progress (all-to-all operators only).
    shuffle: ShuffleState,
    /// The schemas of the operator's inputs, which all-to-all tasks need.
    input_schemas: Arc<Vec<arrow::datatypes::Schema>>,
    stats: OperatorStats,
    tasks_done: u64,
    started: Option<Instant>,
    ended: Option<Instant>,
}

impl OpState {
    fn is_source(&self) -> bool {
        matches!(self.work, Work::Source(_))
    }
}

pub(crate) struct Execution {
    config: Arc<DriverConfig>,
    cluster: Arc<Cluster>,
    job: JobId,
    attempt: u32,
    options: JobOptions,
    ops: Vec<OpState>,
    output: usize,
    blocks: BTreeMap<ObjectId, BlockInfo>,
    /// Which operator, task sequence number and task id made each block (for rebuilding it).
    lineage: BTreeMap<ObjectId, (usize, u64, TaskId)>,
    /// Consumers yet to take each emitted block; it is freed when none is left.
    refs: BTreeMap<ObjectId, usize>,
    /// Blocks the job keeps to its end: the output's, and cached operators' until their
    /// shards are written.
    pinned: BTreeSet<ObjectId>,
    /// Tasks waiting for a lost input to be rebuilt.
    waiting: BTreeMap<ObjectId, Vec<(usize, Launch)>>,
    /// Blocks being rebuilt, and the tasks (operator, sequence number) rebuilding them.
    rebuilding: BTreeSet<ObjectId>,
    rebuilding_tasks: BTreeSet<(usize, u64)>,
    running: BTreeSet<TaskId>,
    cache_writes: u64,
    events_tx: mpsc::UnboundedSender<Event>,
    events: mpsc::UnboundedReceiver<Event>,
    outputs: Vec<ObjectId>,
    failure: Option<String>,
    stale_cache: BTreeSet<Fingerprint>,
    budget_bytes: u64,
    concurrency_cap: u64,
}

impl Execution {
    pub fn new(
        config: Arc<DriverConfig>,
        cluster: Arc<Cluster>,
        job: JobId,
        attempt: u32,
        options: JobOptions,
        planned: Planned,
    ) -> Self {
        let mut ops: Vec<OpState> = planned
            .operators
            .into_iter()
            .map(|operator| {
                let inputs = operator.inputs.clone();
                let stats = OperatorStats {
                    name: operator.name.clone(),
                    fingerprint: Some(operator.stage.fingerprint),
                    cache_hits: operator.cache_hits,
                    ..OperatorStats::default()
                };
                OpState {
                    name: operator.name,
                    stage: Arc::new(operator.stage),
                    work: operator.work,
                    queued: vec![VecDeque::new(); inputs.len()],
                    inputs_done: vec![false; inputs.len()],
                    inputs,
                    consumers: Vec::new(),
                    cache: operator.cache,
                    needed: operator.needed,
                    ready: VecDeque::new(),
                    next_seq: 0,
                    next_emit: 0,
                    finished: BTreeMap::new(),
                    recipes: BTreeMap::new(),
                    attempts: BTreeMap::new(),
                    unreachable: BTreeMap::new(),
                    running: 0,
                    emitted: Vec::new(),
                    stopped: false,
                    closed: false,
                    limit_rows: 0,
                    limit_taken: Vec::new(),
                    shuffle: ShuffleState::default(),
                    input_schemas: Arc::new(Vec::new()),
                    stats,
                    tasks_done: 0,
                    started: None,
                    ended: None,
                }
            })
            .collect();
        for index in 0..ops.len() {
            let schemas = ops[index]
                .inputs
                .iter()
                .map(|input| ops[*input].stage.schema.clone())
                .collect();
            ops[index].input_schemas = Arc::new(schemas);
            ops[index].shuffle.sides = vec![Vec::new(); ops[index].inputs.len()];
            if !ops[index].needed {
                continue;
            }
            for (slot, input) in ops[index].inputs.clone().into_iter().enumerate() {
                ops[input].consumers.push((index, slot));
            }
        }
        for op in &mut ops {
            if let Work::Source(tasks) = &op.work {
                for (seq, task) in (0u64..).zip(tasks.iter()) {
                    let recipe = match *task {
                        SourceTask::Compute(input) => Recipe::Compute {
                            input,
                            inputs: Vec::new(),
                        },
                        SourceTask::Load { node, rank, count } => {
                            Recipe::Load { node, rank, count }
                        }
                    };
                    op.ready.push_back(Launch {
                        seq,
                        task: TaskId::random(),
                        recipe,
                        avoid: None,
                        rebuild: false,
                    });
                }
                op.next_seq = tasks.len() as u64;
            }
        }
        let (events_tx, events) = mpsc::unbounded_channel();
        Self {
            config,
            cluster,
            job,
            attempt,
            options,
            ops,
            output: planned.output,
            blocks: BTreeMap::new(),
            lineage: BTreeMap::new(),
            refs: BTreeMap::new(),
            pinned: BTreeSet::new(),
            waiting: BTreeMap::new(),
            rebuilding: BTreeSet::new(),
            rebuilding_tasks: BTreeSet::new(),
            running: BTreeSet::new(),
            cache_writes: 0,
            events_tx,
            events,
            outputs: Vec::new(),
            failure: None,
            stale_cache: BTreeSet::new(),
            budget_bytes: 0,
            concurrency_cap: 1,
        }
    }

    pub async fn run(mut self) -> Finished {
        let spilled_before = self.spilled_bytes().await;
        if let Err(error) = self.size_budget().await {
            self.failure = Some(format!("cannot read the cluster's resources: {error}"));
        }
        let mut progress = tokio::time::interval(self.config.progress_interval);
        progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut cancelled = false;
        loop {
            while let Ok(event) = self.events.try_recv() {
                self.apply(event);
            }
            if self.failure.is_some() || cancelled {
                break;
            }
            self.advance();
            if self.finished() {
                break;
            }
            self.launch_eligible();
            tokio::select! {
                event = self.events.recv() => {
                    if let Some(event) = event {
                        self.apply(event);
                    }
                }
                _ = progress.tick() => {
                    // Also learns of nodes committed dead, for tasks waiting on them.
                    match self.cluster.read_state().await {
                        Ok(_) => self.replace_dead_aggregators(),
                        Err(error) => tracing::warn!(job = %self.job, %error, "cannot read the cluster state"),
                    }
                    match self.cluster.report_progress(self.job, self.progress()).await {
                        Ok(true) => cancelled = true,
                        Ok(false) => {}
                        Err(error) => tracing::warn!(job = %self.job, %error, "progress report failed"),
                    }
                }
            }
        }
        if self.failure.is_some() || cancelled {
            self.cancel_running().await;
        } else {
            self.recover_lost_outputs().await;
        }
        for index in 0..self.ops.len() {
            self.stop_aggregators(index);
        }
        self.drain().await;
        let status = match (&self.failure, cancelled) {
            (Some(message), _) => JobStatus::Failed {
                message: message.clone(),
            },
            (None, true) => JobStatus::Cancelled,
            (None, false) => JobStatus::Succeeded,
        };
        let keep: BTreeSet<ObjectId> = if status == JobStatus::Succeeded {
            self.outputs.iter().copied().collect()
        } else {
            BTreeSet::new()
        };
        self.describe_hot_keys().await;
        self.free_all_except(&keep).await;
        let spilled_after = self.spilled_bytes().await;
        let outputs = if status == JobStatus::Succeeded {
            self.output_blocks()
        } else {
            Vec::new()
        };
        let outcome = JobOutcome {
            status,
            stats: JobStats {
                attempt: self.attempt,
                wall_ms: 0,
                spilled_bytes: spilled_after.saturating_sub(spilled_before),
                operators: self.operator_stats(),
            },
            outputs,
        };
        Finished {
            outcome,
            stale_cache: self.stale_cache,
        }
    }

    /// The in-flight budget and the concurrency cap, from the alive nodes' stores and CPUs.
    async fn size_budget(&mut self) -> super::Result<()> {
        let state = self.cluster.read_state().await?;
        let cpus: u64 = state
            .alive_nodes()
            .map(|node| node.resources.cpu_millis / TASK_CPU_MILLIS)
            .sum();
        self.concurrency_cap = cpus.max(1);
        let mut capacity = 0u64;
        for node in state.alive_nodes() {
            if let Ok(NodeResponse::Status(status)) = self
                .cluster
                .call_node(&node.addresses.rpc, &NodeRequest::Status)
                .await
            {
                capacity += status.store.capacity;
            }
        }
        self.budget_bytes =
            (capacity / 1000).saturating_mul(u64::from(self.options.object_store_budget_permille));
        Ok(())
    }

    async fn spilled_bytes(&self) -> u64 {
        let mut total = 0;
        let Ok(state) = self.cluster.read_state().await else {
            return 0;
        };
        for node in state.alive_nodes() {
            if let Ok(NodeResponse::Status(status)) = self
                .cluster
                .call_node(&node.addresses.rpc, &NodeRequest::Status)
                .await
            {
                total += status.store.spilled_bytes_total;
            }
        }
        total
    }

    fn finished(&self) -> bool {
        self.cache_writes == 0
            && self.running.is_empty()
            && self.ops.iter().all(|op| !op.needed || op.closed)
    }

    /// Bytes of bundles queued between operators.
    fn queued_bytes(&self) -> u64 {
        // A union's queue holds finished data waiting for the inputs before it; counting it
        // could throttle the very source the union waits for.
        self.ops
            .iter()
            .filter(|op| !matches!(op.work, Work::Union))
            .flat_map(|op| op.queued.iter().flatten())
            .flat_map(|bundle| &bundle.blocks)
            .filter_map(|block| self.blocks.get(block))
            .map(|info| info.bytes)
            .sum()
    }

    /// Moves queued input bundles into runnable tasks (or straight through, for operators
    /// that run none) and closes operators that have produced everything.
    fn advance(&mut self) {
        for index in 0..self.ops.len() {
            if !self.ops[index].needed || self.ops[index].closed {
                continue;
            }
            if self.ops[index].stopped {
                // A limit downstream has its rows: what is queued or finished is not needed.
                let op = &mut self.ops[index];
                op.queued.iter_mut().for_each(VecDeque::clear);
                if op.running == 0 {
                    op.finished.clear();
                }
                self.maybe_close(index);
                continue;
            }
            match self.ops[index].work.clone() {
                Work::Source(_) => {}
                Work::Map | Work::Sink => {
                    let sink = matches!(self.ops[index].work, Work::Sink);
                    while let Some(bundle) = self.ops[index].queued[0].pop_front() {
                        let op = &mut self.ops[index];
                        let seq = op.next_seq;
                        op.next_seq += 1;
                        let input = if sink {
                            let index = u32::try_from(seq).unwrap_or(u32::MAX);
                            StageInput::Sink { index }
                        } else {
                            StageInput::Blocks
                        };
                        op.ready.push_back(Launch {
                            seq,
                            task: TaskId::random(),
                            recipe: Recipe::Compute {
                                input,
                                inputs: bundle.blocks,
                            },
                            avoid: None,
                            rebuild: false,
                        });
                    }
                }
                Work::Limit(n) => self.advance_limit(index, n),
                Work::AllToAll => self.advance_shuffle(index),
                Work::Union | Work::PassThrough => {
                    // Input 0's bundles first; a later input's wait until those before it end.
                    let inputs = self.ops[index].inputs.len();
                    for slot in 0..inputs {
                        while let Some(bundle) = self.ops[index].queued[slot].pop_front() {
                            // Taken without a task: this operator's reference passes on to its
                            // consumers when it emits the bundle.
                            for block in &bundle.blocks {
                                if let Some(refs) = self.refs.get_mut(block) {
                                    *refs = refs.saturating_sub(1);
                                }
                            }
                            let op = &mut self.ops[index];
                            let seq = op.next_seq;
                            op.next_seq += 1;
                            op.finished.insert(seq, bundle);
                        }
                        if !self.ops[index].inputs_done[slot] {
                            break;
                        }
                    }
                    self.emit_ready(index);
                }
            }
            self.maybe_close(index);
        }
    }

    fn advance_limit(&mut self, index: usize, n: u64) {
        let op = &mut self.ops[index];
        if op.next_seq > 0 {
            // Bundles that arrive after the limit has its rows are not needed.
            op.queued[0].clear();
            return;
        }
        while op.limit_rows < n {
            let Some(bundle) = op.queued[0].pop_front() else {
                break;
            };
            for block in bundle.blocks {
                op.limit_rows += self.blocks.get(&block).map_or(0, |info| info.rows);
                op.limit_taken.push(block);
            }
        }
        if op.limit_rows >= n || op.inputs_done[0] {
            op.next_seq = 1;
            op.ready.push_back(Launch {
                seq: 0,
                task: TaskId::random(),
                recipe: Recipe::Compute {
                    input: StageInput::Blocks,
                    inputs: std::mem::take(&mut op.limit_taken),
                },
                avoid: None,
                rebuild: false,
            });
            // Upstream stops, the limit having its rows — except an operator another
            // running consumer still reads (a subplan shared with a union or a join).
            let mut upstream = self.ops[index].inputs.clone();
            while let Some(input) = upstream.pop() {
                let unread = self.ops[input]
                    .consumers
                    .iter()
                    .all(|(consumer, _)| *consumer == index || self.ops[*consumer].stopped);
                let producer = &mut self.ops[input];
                if unread && !producer.stopped {
                    producer.stopped = true;
                    // A rebuild still runs: some consumer is waiting for its block.
                    producer.ready.retain(|launch| launch.rebuild);
                    upstream.extend(producer.inputs.iter().copied());
                }
            }
        }
    }

    fn maybe_close(&mut self, index: usize) {
        let op = &self.ops[index];
        let inputs_drained = op.queued.iter().all(VecDeque::is_empty)
            && (op.inputs_done.iter().all(|done| *done) || op.stopped || op.is_source());
        let limit_waiting = matches!(op.work, Work::Limit(_)) && op.next_seq == 0 && !op.stopped;
        let shuffle_waiting = matches!(op.work, Work::AllToAll)
            && op.shuffle.phase != ShufflePhase::Reducing
            && !op.stopped;
        if op.closed
            || !inputs_drained
            || limit_waiting
            || shuffle_waiting
            || !op.ready.is_empty()
            || op.running > 0
            || !op.finished.is_empty()
            || self
                .waiting
                .values()
                .flatten()
                .any(|(waiting, _)| *waiting == index)
        {
            return;
        }
        self.stop_aggregators(index);
        let op = &mut self.ops[index];
        op.closed = true;
        op.ended.get_or_insert_with(Instant::now);
        for (consumer, slot) in op.consumers.clone() {
            self.ops[consumer].inputs_done[slot] = true;
        }
        self.write_whole_output_to_cache(index);
    }

    /// Launches tasks while some operator is eligible, smallest out-queue first.
    fn launch_eligible(&mut self) {
        loop {
            let over_budget = self.queued_bytes() >= self.budget_bytes.max(1);
            let chosen = (0..self.ops.len())
                .filter(|&index| {
                    let op = &self.ops[index];
                    let rebuild_first = op.ready.front().is_some_and(|launch| launch.rebuild);
                    op.needed
                        && (!op.stopped || rebuild_first)
                        && !op.ready.is_empty()
                        && op.running < self.concurrency_cap
                        && !(op.is_source() && over_budget)
                })
                .min_by_key(|&index| self.out_queue(index));
            let Some(index) = chosen else {
                return;
            };
            let Some(launch) = self.ops[index].ready.pop_front() else {
                return;
            };
            self.start(index, launch);
        }
    }

    fn out_queue(&self, index: usize) -> usize {
        self.ops[index]
            .consumers
            .iter()
            .map(|(consumer, slot)| self.ops[*consumer].queued[*slot].len())
            .sum()
    }

    fn start(&mut self, index: usize, launch: Launch) {
        let aggregator = match self.aggregator_for(index, &launch) {
            Ok(aggregator) => aggregator,
            Err(()) => {
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
        op.recipes.insert(launch.seq, launch.recipe.clone());
        self.running.insert(launch.task);
        let inputs: Vec<(ObjectId, Option<BlockInfo>)> = match &launch.recipe {
            Recipe::Compute { inputs, .. } => inputs
                .iter()
                .map(|object| (*object, self.blocks.get(object).copied()))
                .collect(),
            Recipe::Load { .. } => Vec::new(),
        };
        let context = TaskContext {
            cluster: Arc::clone(&self.cluster),
            config: Arc::clone(&self.config),
            stage: Arc::clone(&self.ops[index].stage),
            input_schemas: Arc::clone(&self.ops[index].input_schemas),
            strategy: self.strategy(index, &inputs, launch.avoid),
            aggregator,
        };
        let events = self.events_tx.clone();
        tokio::spawn(async move {
            let (node, result) = context.run(&launch, &inputs).await;
            let _ = events.send(Event::Task {
                op: index,
                launch,
                node,
                result,
            });
        });
    }

    /// The aggregator a hash shuffle's reduce goes through: `Ok(None)` for any other task,
    /// `Err` while the partition's aggregator is being created.
    fn aggregator_for(
        &self,
        index: usize,
        launch: &Launch,
    ) -> Result<Option<(ActorId, NodeId)>, ()> {
        let (
            Recipe::Compute {
                input: StageInput::Reduce { partition, .. },
                ..
            },
            Some(pool),
        ) = (&launch.recipe, &self.ops[index].shuffle.aggregators)
        else {
            return Ok(None);
        };
        let slot = &pool.slots[pool.slot_of(*partition)];
        match slot.node {
            // A reduce that failed on the aggregator's node (its worker died or ran out of
            // memory) runs again elsewhere as a plain task, which pulls its shards.
            Some(node) if launch.avoid == Some(node) => Ok(None),
            Some(node) => Ok(Some((slot.actor, node))),
            None => Err(()),
        }
    }

    fn strategy(
        &self,
        index: usize,
        inputs: &[(ObjectId, Option<BlockInfo>)],
        avoid: Option<NodeId>,
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
            Work::Source(_) => Strategy::Spread,
            Work::Map if input_bytes < SPREAD_MAX_INPUT_BYTES => Strategy::Spread,
            _ => Strategy::Default,
        }
    }

    fn apply(&mut self, event: Event) {
        match event {
            Event::Requeue { op, launch } => {
                self.ops[op].running -= 1;
                self.running.remove(&launch.task);
                self.requeue(op, launch);
            }
            Event::CacheWritten { op, result } => {
                self.cache_writes -= 1;
                if let Err(message) = result {
                    tracing::warn!(job = %self.job, operator = %self.ops[op].name, %message, "a cache shard was not written");
                }
            }
            Event::AggregatorCreated {
                op,
                slot,
                actor,
                result,
            } => self.aggregator_created(op, slot, actor, result),
            Event::RetryAggregator { op, slot, actor } => self.retry_aggregator(op, slot, actor),
            Event::Task {
                op,
                launch,
                node,
                result,
            } => {
                self.running.remove(&launch.task);
                self.ops[op].running -= 1;
                match result {
                    Ok(outputs) => match node {
                        Some(node) => self.task_succeeded(op, launch, node, outputs),
                        None => self.fail(op, "a task reported no node".into()),
                    },
                    Err(error) => self.task_failed(op, launch, node, error),
                }
            }
        }
    }

    fn task_succeeded(
        &mut self,
        index: usize,
        launch: Launch,
        node: NodeId,
        outputs: Vec<OutputRef>,
    ) {
        let mut bundle = Bundle::default();
        for output in &outputs {
            self.blocks.insert(
                output.object,
                BlockInfo {
                    node,
                    rows: output.rows.unwrap_or(0),
                    bytes: output.size,
                },
            );
            self.lineage
                .insert(output.object, (index, launch.seq, launch.task));
            bundle.blocks.push(output.object);
        }
        if launch.rebuild {
            self.rebuilding_tasks.remove(&(index, launch.seq));
            self.ops[index].stats.rebuilt += 1;
            for object in &bundle.blocks {
                self.rebuilding.remove(object);
                for (op, waiting) in self.waiting.remove(object).unwrap_or_default() {
                    self.requeue(op, waiting);
                }
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
        op.stats.rows += outputs.iter().filter_map(|output| output.rows).sum::<u64>();
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
            // hot-key task, for a skewed partition: those wait for the job's end).
            Recipe::Compute {
                input: StageInput::Reduce { partition, .. },
                inputs,
            } => {
                let hot = self.ops[index].shuffle.hot_partition;
                if hot.is_none_or(|hot| hot.partition != *partition) {
                    self.free_now(inputs);
                }
            }
            Recipe::Compute { inputs, .. } => self.release_inputs(inputs),
            Recipe::Load { .. } => {}
        }
        self.ops[index].finished.insert(launch.seq, bundle);
        self.emit_ready(index);
    }

    fn task_failed(
        &mut self,
        index: usize,
        launch: Launch,
        node: Option<NodeId>,
        error: TaskError,
    ) {
        let name = self.ops[index].name.clone();
        match error {
            TaskError::Failed(TaskFailure::InputUnavailable { object, reason }) => {
                tracing::info!(job = %self.job, operator = %name, %object, %reason, "rebuilding a lost input");
                self.rebuild(object);
                self.waiting
                    .entry(object)
                    .or_default()
                    .push((index, launch));
            }
            TaskError::Failed(TaskFailure::Cancelled) => {}
            TaskError::StaleCache(message) => {
                self.stale_cache.insert(self.ops[index].stage.fingerprint);
                self.fail(index, message);
            }
            TaskError::Failed(failure) if failure.retryable() => {
                let retries = self.options.max_task_retries;
                let op = &mut self.ops[index];
                let attempts = op.attempts.entry(launch.seq).or_insert(0);
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
            TaskError::Failed(failure) => self.fail(index, failure.to_string()),
            TaskError::ActorGone { actor, message } => {
                if let Recipe::Compute {
                    input: StageInput::Reduce { partition, .. },
                    ..
                } = &launch.recipe
                    && let Some(pool) = &self.ops[index].shuffle.aggregators
                {
                    let slot = pool.slot_of(*partition);
                    self.replace_aggregator(index, slot, actor, node);
                }
                self.task_failed(index, launch, node, TaskError::Unreachable(message));
            }
            TaskError::Unreachable(message) => {
                let op = &mut self.ops[index];
                let tries = op.unreachable.entry(launch.seq).or_insert(0);
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
    fn requeue(&mut self, index: usize, launch: Launch) {
        let op = &mut self.ops[index];
        if op.stopped && !launch.rebuild {
            return;
        }
        op.ready.push_front(launch);
    }

    fn fail(&mut self, index: usize, message: String) {
        if self.failure.is_none() {
            self.failure = Some(format!("{}: {message}", self.ops[index].name));
        }
    }

    /// Runs again the task that produced `object`, under the same task id so the block keeps
    /// its object id.
    fn rebuild(&mut self, object: ObjectId) {
        if self.rebuilding.contains(&object) {
            return;
        }
        let Some(&(op, seq, task)) = self.lineage.get(&object) else {
            self.failure = Some(format!(
                "block {object} was lost and its lineage is unknown"
            ));
            return;
        };
        let Some(recipe) = self.ops[op].recipes.get(&seq).cloned() else {
            self.failure = Some(format!("block {object} was lost and its task is unknown"));
            return;
        };
        self.rebuilding.insert(object);
        // One task made several blocks: the first lost one starts its rebuild.
        if !self.rebuilding_tasks.insert((op, seq)) {
            return;
        }
        let retries = self.options.max_task_retries;
        let state = &mut self.ops[op];
        let attempts = state.attempts.entry(seq).or_insert(0);
        *attempts += 1;
        if *attempts > retries + 1 {
            self.failure = Some(format!(
                "{}: block {object} was lost too many times",
                state.name
            ));
            return;
        }
        let avoid = self.blocks.get(&object).map(|info| info.node);
        self.start(
            op,
            Launch {
                seq,
                task,
                recipe,
                avoid,
                rebuild: true,
            },
        );
    }

    /// Emits the operator's finished bundles that are next in order.
    fn emit_ready(&mut self, index: usize) {
        loop {
            let op = &mut self.ops[index];
            let Some(bundle) = op.finished.remove(&op.next_emit) else {
                return;
            };
            op.next_emit += 1;
            if op.cache.is_some() && !op.is_source() {
                op.emitted.push(bundle.clone());
            }
            if index == self.output {
                self.outputs.extend(bundle.blocks.iter().copied());
            }
            let consumers = self.ops[index].consumers.clone();
            let pin = index == self.output || self.ops[index].cache.is_some();
            for block in &bundle.blocks {
                // Added, not set: a union re-emits blocks it took from its input.
                *self.refs.entry(*block).or_insert(0) += consumers.len();
                if pin {
                    self.pinned.insert(*block);
                }
            }
            for (consumer, slot) in consumers {
                self.ops[consumer].queued[slot].push_back(bundle.clone());
            }
        }
    }

    /// Moves a shuffle forward: collects input bundles, and starts each phase's tasks once the
    /// previous phase is complete.
    fn advance_shuffle(&mut self, index: usize) {
        let op = &mut self.ops[index];
        for slot in 0..op.queued.len() {
            while let Some(bundle) = op.queued[slot].pop_front() {
                op.shuffle.sides[slot].push(bundle);
            }
        }
        let StageKind::AllToAll(operator) = &op.stage.kind else {
            return;
        };
        let operator = operator.clone();
        let has_input = op.shuffle.sides.iter().any(|side| !side.is_empty())
            || op.inputs_done.iter().all(|done| *done);
        if op.shuffle.phase == ShufflePhase::Collecting
            && op.shuffle.aggregators.is_none()
            && has_input
            && aggregators::is_hash_shuffle(&operator)
        {
            self.start_aggregators(index);
        }
        let op = &mut self.ops[index];
        match op.shuffle.phase {
            ShufflePhase::Collecting => {
                if !op.inputs_done.iter().all(|done| *done) {
                    return;
                }
                let bundles: usize = op.shuffle.sides.iter().map(Vec::len).sum();
                op.shuffle.partitions = match &operator {
                    Operator::Repartition { partitions, .. } => *partitions,
                    Operator::Aggregate { keys, .. } if keys.is_empty() => 1,
                    _ => u32::try_from(bundles.clamp(1, MAX_DEFAULT_PARTITIONS)).unwrap_or(1),
                };
                let partitions = op.shuffle.partitions;
                let idle = op
                    .shuffle
                    .aggregators
                    .as_mut()
                    .map(|pool| pool.keep_for(partitions))
                    .unwrap_or_default();
                self.stop_actors(idle);
                if matches!(operator, Operator::Sort { .. }) && bundles > 0 {
                    self.start_sampling(index);
                } else {
                    self.start_partitioning(index, &operator);
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
                    self.start_partitioning(index, &operator);
                }
            }
            ShufflePhase::Partitioning => {
                if op.shuffle.map_outputs.len() as u64 == op.shuffle.map_tasks {
                    self.start_reducing(index, &operator);
                }
            }
            ShufflePhase::Reducing => {}
        }
    }

    /// A shuffle side's bundles, merged in order into groups that each become one map task:
    /// a few map tasks per CPU, so each writes one block per partition for many bundles
    /// rather than every bundle writing one per partition (a 256-bundle, 200-partition
    /// shuffle would otherwise make 51,200 tiny objects).
    fn map_groups(&self, bundles: &[Bundle]) -> Vec<Bundle> {
        let groups = (self.concurrency_cap * MAP_TASKS_PER_CPU).max(1) as usize;
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

    fn start_sampling(&mut self, index: usize) {
        let groups = self.map_groups(&self.ops[index].shuffle.sides[0]);
        let shuffle = &mut self.ops[index].shuffle;
        let total = u64::from(shuffle.partitions) * u64::from(SAMPLE_ROWS_PER_PARTITION);
        let per_group = total.div_ceil(groups.len().max(1) as u64).max(1);
        let rows = u32::try_from(per_group).unwrap_or(u32::MAX);
        let launches: Vec<Launch> = (0u64..)
            .zip(&groups)
            .map(|(i, bundle)| {
                let input = StageInput::Sample { rows, seed: i };
                compute(SAMPLE_SEQ + i, input, bundle.blocks.clone())
            })
            .collect();
        shuffle.sample_tasks = launches.len() as u64;
        shuffle.phase = ShufflePhase::Sampling;
        self.ops[index].ready.extend(launches);
    }

    fn start_partitioning(&mut self, index: usize, operator: &Operator) {
        let seed = match operator {
            Operator::RandomShuffle {
                seed: SeedChoice::Fixed(seed),
            } => seed.get(),
            _ => 0,
        };
        let mut launches = Vec::new();
        let shuffle = &self.ops[index].shuffle;
        let mut left_maps = 0;
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
                let seq = PARTITION_SEQ + launches.len() as u64;
                let mut inputs = bundle.blocks.clone();
                let input = match (operator, shuffle.boundaries) {
                    (Operator::Sort { .. }, Some(boundaries)) => {
                        inputs.push(boundaries);
                        StageInput::RangePartition {
                            partitions: shuffle.partitions,
                        }
                    }
                    _ => StageInput::Partition {
                        partitions: shuffle.partitions,
                        side: u8::try_from(side).unwrap_or(u8::MAX),
                        offset,
                        total,
                        seed: seed ^ (seq - PARTITION_SEQ).rotate_left(32),
                    },
                };
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
            self.start_reducing(index, operator);
        }
    }

    fn start_reducing(&mut self, index: usize, operator: &Operator) {
        let seed = match operator {
            Operator::RandomShuffle {
                seed: SeedChoice::Fixed(seed),
            } => seed.get(),
            _ => 0,
        };
        let hot = self.hot_partition(index);
        let op = &mut self.ops[index];
        let shuffle = &mut op.shuffle;
        shuffle.phase = ShufflePhase::Reducing;
        let left = u32::try_from(shuffle.left_maps).unwrap_or(u32::MAX);
        if let Some(hot) = hot {
            shuffle.hot_partition = Some(hot);
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
    async fn describe_hot_keys(&mut self) {
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

    async fn read_hot_key(&self, block: ObjectId, node: NodeId) -> Result<String, String> {
        let addr = self
            .cluster
            .address(node)
            .await
            .map_err(|error| error.to_string())?;
        let meta = match self
            .cluster
            .call_node(&addr, &NodeRequest::ObjectMeta { object: block })
            .await
        {
            Ok(NodeResponse::ObjectMeta(meta)) => meta,
            Ok(other) => return Err(format!("unexpected answer {other:?}")),
            Err(error) => return Err(error.to_string()),
        };
        let bytes = meta.inline.ok_or("the hot-key block is not small")?.0;
        let reader = arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(bytes), None)
            .map_err(|error| error.to_string())?;
        for batch in reader {
            let batch = batch.map_err(|error| error.to_string())?;
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
        Err("the hot-key block is empty".into())
    }

    /// A shuffle's sample, boundaries or partition task finished: its outputs feed the next
    /// phase rather than the operator's output.
    fn map_side_done(&mut self, index: usize, launch: &Launch, outputs: Vec<ObjectId>) {
        let op = &mut self.ops[index];
        op.tasks_done += 1;
        op.stats.tasks += 1;
        let shuffle = &mut op.shuffle;
        if launch.seq >= HOT_KEY_SEQ {
            shuffle.hot_key_block = outputs.first().copied();
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

    /// Creates a hash shuffle's aggregators (see [`aggregators`]).
    fn start_aggregators(&mut self, index: usize) {
        let pool = Aggregators::new(self.concurrency_cap);
        let op = &mut self.ops[index];
        op.stats.aggregators += pool.slots.len() as u64;
        let count = pool.count();
        let actors: Vec<ActorId> = pool.slots.iter().map(|slot| slot.actor).collect();
        op.shuffle.aggregators = Some(pool);
        let cluster = Arc::clone(&self.cluster);
        let events = self.events_tx.clone();
        let job = self.job;
        tokio::spawn(async move {
            let placed = aggregators::place_spread(&cluster, actors.len()).await;
            let mut starts = tokio::task::JoinSet::new();
            for (slot, actor) in actors.into_iter().enumerate() {
                let spec = (actor, u32::try_from(slot).unwrap_or(u32::MAX), count);
                let cluster = Arc::clone(&cluster);
                let node = placed
                    .as_ref()
                    .map(|nodes| nodes[slot])
                    .map_err(Clone::clone);
                let events = events.clone();
                starts.spawn(async move {
                    let result = match node {
                        Ok(node) => aggregators::start_on(&cluster, job, spec, node).await,
                        Err(message) => Err(message),
                    };
                    let _ = events.send(Event::AggregatorCreated {
                        op: index,
                        slot,
                        actor,
                        result,
                    });
                });
            }
            while starts.join_next().await.is_some() {}
        });
    }

    fn create_aggregator(
        &self,
        index: usize,
        slot: usize,
        actor: ActorId,
        count: u32,
        avoid: Option<NodeId>,
    ) {
        let cluster = Arc::clone(&self.cluster);
        let events = self.events_tx.clone();
        let job = self.job;
        let spec = (actor, u32::try_from(slot).unwrap_or(u32::MAX), count);
        tokio::spawn(async move {
            let result = aggregators::replace(cluster, job, spec, avoid).await;
            let _ = events.send(Event::AggregatorCreated {
                op: index,
                slot,
                actor,
                result,
            });
        });
    }

    /// A new actor for slot `slot`, whose actor died (with its node, or on its own); its
    /// partitions' shards are pushed to the new one once it runs.
    fn replace_aggregator(
        &mut self,
        index: usize,
        slot: usize,
        gone: ActorId,
        avoid: Option<NodeId>,
    ) {
        let op = &mut self.ops[index];
        let Some(pool) = &mut op.shuffle.aggregators else {
            return;
        };
        let count = pool.count();
        // Only the slot's current actor: a late answer from one already replaced says
        // nothing about its successor.
        let Some(entry) = pool.slots.get_mut(slot).filter(|entry| entry.actor == gone) else {
            return;
        };
        if entry.idle || entry.node.is_none() {
            return;
        }
        tracing::warn!(job = %self.job, operator = %op.name, slot, actor = %entry.actor, ?avoid, "an aggregator is gone; creating it again");
        let old_node = entry.node;
        entry.replace();
        let actor = entry.actor;
        op.stats.aggregators += 1;
        op.stats.aggregators_recreated += 1;
        self.create_aggregator(index, slot, actor, count, avoid);
        // Stopped and unrecorded, in case it still lives and holds shards.
        self.stop_actors(vec![(gone, old_node)]);
    }

    fn aggregator_created(
        &mut self,
        index: usize,
        slot: usize,
        actor: ActorId,
        result: Result<NodeId, String>,
    ) {
        let current = self.ops[index]
            .shuffle
            .aggregators
            .as_ref()
            .and_then(|pool| pool.slots.get(slot))
            .filter(|entry| entry.actor == actor)
            .map(|entry| entry.idle);
        let Some(idle) = current else {
            // Superseded (or the shuffle is over): this actor is not wanted.
            if let Ok(node) = result {
                self.stop_actors(vec![(actor, Some(node))]);
            }
            return;
        };
        match result {
            Ok(node) if idle => self.stop_actors(vec![(actor, Some(node))]),
            Ok(node) => {
                if let Some(entry) = self.slot_mut(index, slot) {
                    entry.node = Some(node);
                    entry.failed_creations = 0;
                }
                let seqs: Vec<u64> = self.ops[index]
                    .shuffle
                    .map_outputs
                    .keys()
                    .copied()
                    .collect();
                self.push_to(index, slot, &seqs);
            }
            Err(message) => {
                let Some(entry) = self.slot_mut(index, slot) else {
                    return;
                };
                entry.failed_creations += 1;
                if entry.failed_creations > MAX_UNREACHABLE_RETRIES {
                    self.fail(index, format!("cannot create an aggregator: {message}"));
                    return;
                }
                tracing::info!(job = %self.job, slot, %message, "creating an aggregator failed; trying again");
                let events = self.events_tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(UNREACHABLE_PAUSE).await;
                    let _ = events.send(Event::RetryAggregator {
                        op: index,
                        slot,
                        actor,
                    });
                });
            }
        }
    }

    fn retry_aggregator(&mut self, index: usize, slot: usize, actor: ActorId) {
        let Some(pool) = &mut self.ops[index].shuffle.aggregators else {
            return;
        };
        let count = pool.count();
        let Some(entry) = pool
            .slots
            .get_mut(slot)
            .filter(|entry| entry.actor == actor)
        else {
            return;
        };
        // A fresh id: the failed attempt may have been recorded before it failed.
        entry.replace();
        let actor = entry.actor;
        self.ops[index].stats.aggregators += 1;
        self.create_aggregator(index, slot, actor, count, None);
    }

    fn slot_mut(&mut self, index: usize, slot: usize) -> Option<&mut aggregators::Slot> {
        self.ops[index]
            .shuffle
            .aggregators
            .as_mut()
            .and_then(|pool| pool.slots.get_mut(slot))
    }

    /// Pushes the shards of map tasks `seqs` that slot `slot` owns to its actor, if it runs.
    fn push_to(&mut self, index: usize, slot: usize, seqs: &[u64]) {
        let shuffle = &self.ops[index].shuffle;
        let partitions = shuffle.partitions;
        let Some(pool) = &shuffle.aggregators else {
            return;
        };
        let Some(entry) = pool.slots.get(slot).filter(|entry| !entry.idle) else {
            return;
        };
        let Some(node) = entry.node else {
            return;
        };
        let mut shards = Vec::new();
        let mut pushed = Vec::new();
        for seq in seqs {
            let Some(outputs) = shuffle.map_outputs.get(seq) else {
                continue;
            };
            if entry.pushed.contains(seq) {
                continue;
            }
            pushed.push(*seq);
            for partition in pool.owned(slot, partitions) {
                let Some(object) = outputs.get(partition as usize) else {
                    continue;
                };
                if let Some(info) = self.blocks.get(object) {
                    shards.push((partition, *object, info.node));
                }
            }
        }
        let actor = entry.actor;
        if let Some(entry) = self.slot_mut(index, slot) {
            entry.pushed.extend(pushed);
        }
        if shards.is_empty() {
            return;
        }
        let cluster = Arc::clone(&self.cluster);
        let via = self.config.node;
        tokio::spawn(aggregators::push(cluster, via, actor, node, shards));
    }

    /// Aggregators on nodes the scheduler has declared dead are created again elsewhere.
    fn replace_dead_aggregators(&mut self) {
        let alive: BTreeSet<NodeId> = self.cluster.alive_nodes().into_iter().collect();
        for index in 0..self.ops.len() {
            let dead: Vec<(usize, ActorId, NodeId)> = self.ops[index]
                .shuffle
                .aggregators
                .iter()
                .flat_map(|pool| pool.slots.iter().enumerate())
                .filter_map(|(slot, entry)| Some((slot, entry.actor, entry.node?)))
                .filter(|(_, _, node)| !alive.contains(node))
                .collect();
            for (slot, actor, node) in dead {
                self.replace_aggregator(index, slot, actor, Some(node));
            }
        }
    }

    /// Stops a shuffle's aggregators once it no longer needs them; a later rebuild of one of
    /// its partitions runs as a plain task.
    fn stop_aggregators(&mut self, index: usize) {
        let Some(pool) = self.ops[index].shuffle.aggregators.take() else {
            return;
        };
        let actors = pool
            .slots
            .into_iter()
            .filter(|slot| !slot.idle)
            .map(|slot| (slot.actor, slot.node))
            .collect();
        self.stop_actors(actors);
    }

    fn stop_actors(&self, actors: Vec<(ActorId, Option<NodeId>)>) {
        let actors: Vec<(ActorId, NodeId)> = actors
            .into_iter()
            .filter_map(|(actor, node)| Some((actor, node?)))
            .collect();
        if !actors.is_empty() {
            tokio::spawn(aggregators::stop(Arc::clone(&self.cluster), actors));
        }
    }

    /// Frees blocks no task will read again.
    fn free_now(&mut self, objects: &[ObjectId]) {
        let mut free: BTreeMap<NodeId, Vec<ObjectId>> = BTreeMap::new();
        for object in objects {
            if let Some(info) = self.blocks.remove(object) {
                free.entry(info.node).or_default().push(*object);
            }
        }
        if !free.is_empty() {
            let cluster = Arc::clone(&self.cluster);
            tokio::spawn(async move { cluster.free(free).await });
        }
    }

    /// A task consumed `inputs`: free each block its last consumer has taken, unless the job
    /// keeps it (cached operators' blocks wait for their shards to be written; the output
    /// stays for the client).
    fn release_inputs(&mut self, inputs: &[ObjectId]) {
        let mut free: BTreeMap<NodeId, Vec<ObjectId>> = BTreeMap::new();
        for object in inputs {
            let Some(refs) = self.refs.get_mut(object) else {
                continue;
            };
            *refs = refs.saturating_sub(1);
            if *refs > 0 {
                continue;
            }
            self.refs.remove(object);
            if self.pinned.contains(object) {
                continue;
            }
            if let Some(info) = self.blocks.remove(object) {
                free.entry(info.node).or_default().push(*object);
            }
        }
        if !free.is_empty() {
            let cluster = Arc::clone(&self.cluster);
            tokio::spawn(async move { cluster.free(free).await });
        }
    }

    /// Writes one shard from blocks on `node` and records it in the replicated index.
    fn write_shard(
        &mut self,
        index: usize,
        target: CacheTarget,
        rank: u32,
        count: u32,
        node: NodeId,
        blocks: Vec<ObjectId>,
    ) {
        self.cache_writes += 1;
        let cluster = Arc::clone(&self.cluster);
        let events = self.events_tx.clone();
        let schema = self.ops[index].stage.schema.clone();
        tokio::spawn(async move {
            let write = ShardWrite {
                lineage: target.lineage,
                rank,
                count,
                blocks,
                schema,
                overwrite: target.overwrite,
            };
            let result = async {
                let addr = cluster.address(node).await.map_err(|e| e.to_string())?;
                let (rows, bytes) = match cluster
                    .call_node(&addr, &NodeRequest::WriteCacheShard(write))
                    .await
                    .map_err(|e| e.to_string())?
                {
                    NodeResponse::CacheWritten { rows, bytes } => (rows, bytes),
                    other => return Err(format!("unexpected answer {other:?}")),
                };
                cluster
                    .propose(Command::RecordCacheShard {
                        fingerprint: target.fingerprint.to_string(),
                        shard_count: count,
                        rank,
                        shard: CachedShard { node, bytes, rows },
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(())
            }
            .await;
            let _ = events.send(Event::CacheWritten { op: index, result });
        });
    }

    /// A cached operator whose shard count is known only at its end writes all its shards.
    fn write_whole_output_to_cache(&mut self, index: usize) {
        let op = &mut self.ops[index];
        let Some(target) = op.cache.clone() else {
            return;
        };
        if op.is_source() || op.stopped {
            return;
        }
        let bundles = std::mem::take(&mut op.emitted);
        let count = u32::try_from(bundles.len()).unwrap_or(u32::MAX);
        op.stats.cache_misses += u64::from(count);
        for (rank, bundle) in (0u32..).zip(bundles) {
            let node = bundle
                .blocks
                .first()
                .and_then(|block| self.blocks.get(block))
                .map_or(self.config.node, |info| info.node);
            self.write_shard(index, target.clone(), rank, count, node, bundle.blocks);
        }
    }

    /// Rebuilds output blocks whose node died after they were made, so the job never ends
    /// pointing at a dead node.
    async fn recover_lost_outputs(&mut self) {
        loop {
            if let Err(error) = self.cluster.read_state().await {
                tracing::warn!(job = %self.job, %error, "cannot check the output blocks' nodes");
                return;
            }
            // A node whose death has not committed yet is caught by asking it directly.
            let mut alive = BTreeSet::new();
            let holders: BTreeSet<NodeId> = self
                .outputs
                .iter()
                .filter_map(|object| self.blocks.get(object).map(|info| info.node))
                .collect();
            for node in holders {
                let Ok(addr) = self.cluster.address(node).await else {
                    continue;
                };
                if self
                    .cluster
                    .call_node(&addr, &NodeRequest::Status)
                    .await
                    .is_ok()
                {
                    alive.insert(node);
                }
            }
            let lost: Vec<ObjectId> = self
                .outputs
                .iter()
                .filter(|object| {
                    self.blocks
                        .get(object)
                        .is_some_and(|info| !alive.contains(&info.node))
                })
                .copied()
                .collect();
            if lost.is_empty() || self.failure.is_some() {
                return;
            }
            for object in lost {
                self.rebuild(object);
            }
            let deadline = Instant::now() + OUTPUT_REBUILD_TIMEOUT;
            while !self.rebuilding.is_empty() && self.failure.is_none() {
                let remaining = deadline.saturating_duration_since(Instant::now());
                match tokio::time::timeout(remaining, self.events.recv()).await {
                    Ok(Some(event)) => self.apply(event),
                    Ok(None) => return,
                    Err(_) => {
                        self.failure = Some(format!(
                            "output blocks lost with their node were not rebuilt within {} s",
                            OUTPUT_REBUILD_TIMEOUT.as_secs()
                        ));
                        return;
                    }
                }
                self.launch_eligible();
            }
        }
    }

    /// Asks every node to stop this job's running tasks.
    async fn cancel_running(&mut self) {
        let tasks: Vec<TaskId> = self.running.iter().copied().collect();
        for node in self.cluster.alive_nodes() {
            let Ok(addr) = self.cluster.address(node).await else {
                continue;
            };
            for task in &tasks {
                let _ = self
                    .cluster
                    .call_node(&addr, &NodeRequest::CancelTask { task: *task })
                    .await;
            }
        }
    }

    /// Waits for running tasks and cache writes to report (bounded, so a stuck node cannot
    /// keep a failed job from ending).
    async fn drain(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.running.is_empty() || self.cache_writes > 0 {
            let remaining = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(remaining, self.events.recv()).await {
                Ok(Some(Event::Task {
                    op,
                    launch,
                    node,
                    result,
                })) => {
                    self.running.remove(&launch.task);
                    self.ops[op].running = self.ops[op].running.saturating_sub(1);
                    // Outputs of tasks that finished anyway are freed with the rest.
                    if let (Ok(outputs), Some(node)) = (result, node) {
                        for output in outputs {
                            let info = BlockInfo {
                                node,
                                rows: output.rows.unwrap_or(0),
                                bytes: output.size,
                            };
                            self.blocks.insert(output.object, info);
                        }
                    }
                }
                Ok(Some(Event::Requeue { op, launch })) => {
                    self.running.remove(&launch.task);
                    self.ops[op].running = self.ops[op].running.saturating_sub(1);
                }
                Ok(Some(Event::CacheWritten { .. })) => self.cache_writes -= 1,
                Ok(Some(Event::AggregatorCreated {
                    result: Ok(node),
                    actor,
                    ..
                })) => self.stop_actors(vec![(actor, Some(node))]),
                Ok(Some(Event::AggregatorCreated { .. } | Event::RetryAggregator { .. })) => {}
                Ok(None) | Err(_) => return,
            }
        }
    }

    async fn free_all_except(&mut self, keep: &BTreeSet<ObjectId>) {
        let mut free: BTreeMap<NodeId, Vec<ObjectId>> = BTreeMap::new();
        for (object, info) in &self.blocks {
            if !keep.contains(object) {
                free.entry(info.node).or_default().push(*object);
            }
        }
        self.cluster.free(free).await;
    }

    fn output_blocks(&self) -> Vec<OutputBlock> {
        self.outputs
            .iter()
            .filter_map(|object| {
                let info = self.blocks.get(object)?;
                Some(OutputBlock {
                    object: *object,
                    node: info.node,
                    rows: info.rows,
                    bytes: info.bytes,
                })
            })
            .collect()
    }

    fn progress(&self) -> JobProgress {
        JobProgress {
            attempt: self.attempt,
            operators: self
                .ops
                .iter()
                .map(|op| OperatorProgress {
                    name: op.name.clone(),
                    rows_done: op.stats.rows,
                    blocks_done: op.next_emit,
                    bytes_done: op.stats.bytes,
                    tasks_total: match &op.work {
                        Work::Source(tasks) => Some(tasks.len() as u64),
                        _ if op.closed => Some(op.tasks_done),
                        _ => None,
                    },
                    tasks_done: op.tasks_done,
                    tasks_running: op.running,
                    tasks_queued: op.ready.len() as u64,
                })
                .collect(),
        }
    }

    fn operator_stats(&self) -> Vec<OperatorStats> {
        self.ops
            .iter()
            .map(|op| {
                let wall = match (op.started, op.ended) {
                    (Some(started), Some(ended)) => ended.saturating_duration_since(started),
                    _ => Duration::ZERO,
                };
                OperatorStats {
                    wall_ms: u64::try_from(wall.as_millis()).unwrap_or(u64::MAX),
                    ..op.stats.clone()
                }
            })
            .collect()
    }
}

/// What a spawned task needs from the execution.
struct TaskContext {
    cluster: Arc<Cluster>,
    config: Arc<DriverConfig>,
    stage: Arc<Stage>,
    input_schemas: Arc<Vec<arrow::datatypes::Schema>>,
    strategy: Strategy,
    /// A hash shuffle's reduce runs through the partition's aggregator, on its node.
    aggregator: Option<(ActorId, NodeId)>,
}

impl TaskContext {
    /// Runs one task where the scheduler places it (or loads a shard where it is cached).
    async fn run(
        &self,
        launch: &Launch,
        inputs: &[(ObjectId, Option<BlockInfo>)],
    ) -> (Option<NodeId>, Result<Vec<OutputRef>, TaskError>) {
        let unreachable = |error: &dyn std::fmt::Display| TaskError::Unreachable(error.to_string());
        match &launch.recipe {
            Recipe::Load { node, rank, count } => {
                let addr = match self.cluster.address(*node).await {
                    Ok(addr) => addr,
                    Err(error) => {
                        let message = format!("cached shard {rank} of {count} is gone: {error}");
                        return (Some(*node), Err(TaskError::StaleCache(message)));
                    }
                };
                let load = ShardLoad {
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
                    Ok(NodeResponse::CacheLoaded(Some(output))) => Ok(vec![output]),
                    Ok(NodeResponse::CacheLoaded(None)) => Err(TaskError::StaleCache(format!(
                        "cached shard {rank} of {count} of {} is missing or damaged on node {node}",
                        self.stage.fingerprint
                    ))),
                    Ok(other) => Err(unreachable(&format!("unexpected answer {other:?}"))),
                    Err(error) => Err(unreachable(&error)),
                };
                (Some(*node), result)
            }
            Recipe::Compute {
                input,
                inputs: objects,
            } => {
                let mut preferred: BTreeMap<NodeId, u64> = BTreeMap::new();
                for (_, info) in inputs {
                    if let Some(info) = info {
                        *preferred.entry(info.node).or_default() += info.bytes;
                    }
                }
                // A process UDF's children need their memory on the node that runs them.
                let memory_hint = match process_udfs(&self.stage.row_ops) {
                    Ok(udfs) => udfs.iter().map(|udf| udf.memory).sum(),
                    Err(error) => {
                        let message = error.to_string();
                        return (None, Err(TaskError::Failed(TaskFailure::Error { message })));
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
                let node = match self.cluster.place(request).await {
                    Ok(node) => node,
                    Err(error) => return (None, Err(unreachable(&error))),
                };
                let result = self
                    .run_on(node, launch.task, *input, objects, inputs)
                    .await;
                if let Err(error) = self
                    .cluster
                    .release(node, TASK_CPU_MILLIS, memory_hint, self.config.node)
                    .await
                {
                    tracing::debug!(%node, %error, "releasing a task's reservation failed");
                }
                (Some(node), result)
            }
        }
    }

    async fn run_on(
        &self,
        node: NodeId,
        task: TaskId,
        input: StageInput,
        objects: &[ObjectId],
        inputs: &[(ObjectId, Option<BlockInfo>)],
    ) -> Result<Vec<OutputRef>, TaskError> {
        let addr = self
            .cluster
            .address(node)
            .await
            .map_err(|error| TaskError::Unreachable(error.to_string()))?;
        let mut refs = Vec::with_capacity(objects.len());
        for (object, info) in inputs {
            let holder = match info {
                Some(info) if info.node != node => {
                    Some(self.cluster.address(info.node).await.map_err(|_| {
                        TaskError::Failed(TaskFailure::InputUnavailable {
                            object: *object,
                            reason: format!("its node {} is gone", info.node),
                        })
                    })?)
                }
                _ => None,
            };
            refs.push(InputRef {
                object: *object,
                holder,
            });
        }
        let spec = TaskSpec {
            task,
            kind: TaskKind::Stage(Box::new(StageTask {
                stage: (*self.stage).clone(),
                input,
                input_schemas: (*self.input_schemas).clone(),
                min_block_bytes: self.config.min_block_bytes,
                max_block_bytes: self.config.max_block_bytes,
                batch_rows: self.config.batch_rows,
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
                    .map_err(|error| TaskError::Unreachable(error.to_string()))?;
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
                return Err(TaskError::Unreachable(format!("node {node} was declared dead")));
            }
        };
        match reply {
            Ok(
                NodeResponse::Task(Ok(outputs))
                | NodeResponse::Actor(Ok(ActorReply::Reduced(outputs))),
            ) => Ok(outputs),
            Ok(
                NodeResponse::Task(Err(failure))
                | NodeResponse::Actor(Err(ActorFailure::Task(failure))),
            ) => Err(TaskError::Failed(failure)),
            Ok(NodeResponse::Actor(Err(ActorFailure::Gone { actor, reason }))) => {
                Err(TaskError::ActorGone {
                    actor,
                    message: reason,
                })
            }
            // The aggregator refusing its own partition is a bug: no retry makes it right.
            Ok(NodeResponse::Actor(Err(refused @ ActorFailure::Refused { .. }))) => {
                Err(TaskError::Failed(TaskFailure::Error {
                    message: refused.to_string(),
                }))
            }
            Ok(NodeResponse::Actor(Err(failure))) => {
                Err(TaskError::Unreachable(failure.to_string()))
            }
            Ok(other) => Err(TaskError::Unreachable(format!(
                "unexpected answer {other:?}"
            ))),
            Err(error) => Err(TaskError::Unreachable(format!("node {node}: {error}"))),
        }
    }
}
