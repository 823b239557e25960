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
//! Tasks are placed by the driver itself inside the job's leases ([`crate::leases`]: SPREAD
//! for reads and small-input maps, DEFAULT with the input holder preferred otherwise, each
//! with a memory hint from its input's size), run on the chosen node's workers, and report
//! back on a channel. A failed task is run again (on another node where possible) up to the job's
//! retry limit; a task whose input was lost with its node first rebuilds that input by running
//! the task that produced it again under the same task id, so the rebuilt block keeps its
//! object id (lineage reconstruction).
//!
//! This module owns the loop, its events and the job's end; the concerns it drives live in
//! the submodules: [`operator`] (each operator's flow of bundles), [`task`] (launching one
//! task and handling its result), [`shuffle`] and [`aggregators`] (all-to-all operators),
//! [`lineage`] (rebuilding lost blocks), [`blocks`] (freeing what no task reads again),
//! [`budget`] (backpressure) and [`cache`] (writing shards).

mod aggregators;
mod blocks;
mod budget;
mod cache;
mod lineage;
mod operator;
mod shuffle;
mod streaming;
mod task;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floe_api::state::{JobOutcome, JobStatus};
use floe_core::job::{
    JobOptions, JobProgress, JobStats, OperatorProgress, OperatorStats, OutputBlock, ResultDelivery,
};
use floe_core::{ActorId, JobId, NodeId, ObjectId, TaskId};
use tokio::sync::mpsc;

use crate::DriverConfig;
use crate::cluster::ClusterAccess;
use crate::leases::JobLeases;
use crate::plan::{Planned, SourceTask, Work};
use crate::stream::StreamHandle;
use floe_api::node_protocol::{NodeRequest, TaskDone, WorkerRef};

use self::aggregators::AggregatorError;
use self::blocks::{BlockInfo, Container};
use self::budget::Limits;
use self::cache::CacheWriteError;
pub(crate) use self::cache::{StaleShard, remove_old_shards};
use self::lineage::Lineage;
use self::operator::{OperatorPhase, OperatorState};
use self::streaming::OutputStream;
use self::task::{Launch, RunFailure};

/// Failures to reach a node or the scheduler (not the task's own failures) are retried this
/// many times, after a pause, before the job fails: a node's death takes a node timeout to
/// commit, and placements keep choosing it until then.
const MAX_UNREACHABLE_RETRIES: u32 = 40;
const UNREACHABLE_PAUSE: Duration = Duration::from_millis(250);
/// The CPU one task reserves.
const TASK_CPU_MILLIS: u64 = 1000;

/// How an execution ended.
pub(crate) struct Finished {
    pub outcome: JobOutcome,
    /// Indexed shards that turned out missing and that the job could not compute in their
    /// place: the driver drops them from the index and plans the job again rather than
    /// failing it.
    pub stale_cache: BTreeSet<StaleShard>,
}

/// What the spawned work of an execution reports back to its loop.
enum Event {
    /// One run of a task ended.
    Task {
        op: usize,
        launch: Launch,
        node: Option<NodeId>,
        worker: Option<WorkerRef>,
        result: Result<TaskDone, RunFailure>,
    },
    /// A cache shard of operator `op` was written from `blocks` and recorded, or not.
    CacheWritten {
        op: usize,
        blocks: Vec<ObjectId>,
        result: Result<(), CacheWriteError>,
    },
    /// A task to run again after a pause.
    Requeue { op: usize, launch: Launch },
    /// An aggregator's creation ended: where it runs, or why it could not be created.
    AggregatorCreated {
        op: usize,
        slot: usize,
        actor: ActorId,
        result: Result<NodeId, AggregatorError>,
    },
    /// An aggregator whose creation failed is to be tried again, after a pause.
    RetryAggregator {
        op: usize,
        slot: usize,
        actor: ActorId,
    },
}

pub(crate) struct Execution<C: ClusterAccess> {
    config: Arc<DriverConfig>,
    cluster: Arc<C>,
    /// Where the job's tasks are placed; returned at the job's end.
    leases: Arc<JobLeases<C>>,
    job: JobId,
    attempt: u32,
    options: JobOptions,
    ops: Vec<OperatorState>,
    output: usize,
    blocks: BTreeMap<ObjectId, BlockInfo>,
    /// Objects holding several of the blocks (shuffle map tasks' outputs).
    containers: BTreeMap<ObjectId, Container>,
    /// Blocks of earlier jobs' held outputs that materialized sources read: never freed by
    /// this job, and never rebuilt (their lineage is another job's).
    borrowed: BTreeMap<ObjectId, BlockInfo>,
    lineage: Lineage,
    /// Consumers yet to take each emitted block; it is freed when none is left.
    refs: BTreeMap<ObjectId, usize>,
    /// Blocks the job keeps to its end: the output's, and cached operators' until their
    /// shards are written.
    pinned: BTreeSet<ObjectId>,
    running: BTreeSet<TaskId>,
    cache_writes: u64,
    events_tx: mpsc::UnboundedSender<Event>,
    events: mpsc::UnboundedReceiver<Event>,
    outputs: Vec<ObjectId>,
    failure: Option<String>,
    stale_cache: BTreeSet<StaleShard>,
    limits: Limits,
    /// The client's stream of the output, when the job streams it.
    stream: Option<OutputStream>,
}

impl<C: ClusterAccess> Execution<C> {
    pub fn new(
        config: Arc<DriverConfig>,
        cluster: Arc<C>,
        job: JobId,
        attempt: u32,
        options: JobOptions,
        planned: Planned,
        stream: Option<StreamHandle>,
    ) -> Self {
        let mut ops: Vec<OperatorState> = planned
            .operators
            .into_iter()
            .map(OperatorState::new)
            .collect();
        for index in 0..ops.len() {
            let producers: Vec<usize> = ops[index]
                .inputs
                .iter()
                .map(|input| input.producer)
                .collect();
            let schemas = match &ops[index].map_source {
                Some(source) => vec![source.stage.schema.clone()],
                None => producers
                    .iter()
                    .map(|producer| ops[*producer].stage.schema.clone())
                    .collect(),
            };
            ops[index].input_schemas = Arc::new(schemas);
            if ops[index].phase == OperatorPhase::Skipped {
                continue;
            }
            for (slot, producer) in producers.into_iter().enumerate() {
                ops[producer].consumers.push((index, slot));
            }
        }
        let borrowed = ops
            .iter()
            .filter(|op| op.phase != OperatorPhase::Skipped)
            .filter_map(|op| match &op.work {
                Work::Source(tasks) => Some(tasks),
                _ => None,
            })
            .flatten()
            .filter_map(|task| match task {
                SourceTask::Borrow(block) => Some((
                    block.object,
                    BlockInfo::whole(block.node, block.rows, block.bytes),
                )),
                _ => None,
            })
            .collect();
        let (events_tx, events) = mpsc::unbounded_channel();
        config.tasks.start_job(job, attempt);
        let stream = match (stream, options.result) {
            (Some(handle), ResultDelivery::Streamed { buffer_bytes }) => {
                Some(OutputStream::new(handle, buffer_bytes))
            }
            _ => None,
        };
        Self {
            config,
            leases: Arc::new(JobLeases::new(Arc::clone(&cluster), job)),
            cluster,
            job,
            attempt,
            options,
            ops,
            output: planned.output,
            blocks: BTreeMap::new(),
            containers: BTreeMap::new(),
            borrowed,
            lineage: Lineage::default(),
            refs: BTreeMap::new(),
            pinned: BTreeSet::new(),
            running: BTreeSet::new(),
            cache_writes: 0,
            events_tx,
            events,
            outputs: Vec::new(),
            failure: None,
            stale_cache: BTreeSet::new(),
            limits: Limits::default(),
            stream,
        }
    }

    pub async fn run(mut self) -> Finished {
        let spilled_before = match self.size_budget_and_count_spill().await {
            Ok(spilled) => spilled,
            Err(error) => {
                self.failure = Some(format!("cannot read the cluster's resources: {error}"));
                0
            }
        };
        // The first report comes one interval in: the start has just read the nodes, and a
        // job that ends sooner has nothing to report. A cancel, seen on a tick, is still seen
        // at most one interval after it is asked for.
        let period = self.config.progress_interval;
        let mut progress = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
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
                () = streaming::next_ack(&mut self.stream) => self.stream_acked(),
                _ = progress.tick() => {
                    self.check_stream_abandoned();
                    // Learns of nodes committed dead, for tasks waiting on them.
                    match self.cluster.learn_deaths().await {
                        Ok(()) => self.replace_dead_aggregators(),
                        Err(error) => tracing::warn!(job = %self.job, %error, "cannot learn of node deaths"),
                    }
                    match self.cluster.report_progress(self.job, self.progress()).await {
                        Ok(true) => cancelled = true,
                        Ok(false) => {}
                        Err(error) => tracing::warn!(job = %self.job, %error, "progress report failed"),
                    }
                }
            }
        }
        // A streamed output was read and freed as it went: there is nothing to recover.
        let held = self.stream.is_none();
        if self.failure.is_some() || cancelled {
            self.cancel_running().await;
        } else if held {
            self.recover_lost_outputs().await;
        }
        for index in 0..self.ops.len() {
            self.stop_aggregators(index);
        }
        self.drain().await;
        self.leases.close().await;
        let status = match (&self.failure, cancelled) {
            (Some(message), _) => JobStatus::Failed {
                message: message.clone(),
            },
            (None, true) => JobStatus::Cancelled,
            (None, false) => JobStatus::Succeeded,
        };
        let keep: BTreeSet<ObjectId> = if status == JobStatus::Succeeded && held {
            self.outputs.iter().copied().collect()
        } else {
            BTreeSet::new()
        };
        self.describe_hot_keys().await;
        self.free_all_except(&keep).await;
        let spilled_after = self.spilled_bytes().await;
        let outputs = if status == JobStatus::Succeeded && held {
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

    fn finished(&self) -> bool {
        self.cache_writes == 0
            && self.stream_drained()
            && self.running.is_empty()
            && self
                .ops
                .iter()
                .all(|op| matches!(op.phase, OperatorPhase::Skipped | OperatorPhase::Closed))
    }

    fn apply(&mut self, event: Event) {
        match event {
            Event::Requeue { op, launch } => {
                self.ops[op].running -= 1;
                self.running.remove(&launch.task);
                self.requeue(op, launch);
            }
            Event::CacheWritten { op, blocks, result } => {
                self.cache_writes -= 1;
                self.stream_cache_written(&blocks);
                if let Err(error) = result {
                    tracing::warn!(job = %self.job, operator = %self.ops[op].name, %error, "a cache shard was not written");
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
                worker,
                result,
            } => {
                self.running.remove(&launch.task);
                self.ops[op].running -= 1;
                self.record_end(&launch, node, worker, &result);
                match result {
                    Ok(done) => match node {
                        Some(node) => self.task_succeeded(op, launch, node, done),
                        None => self.fail(op, "a task reported no node".into()),
                    },
                    Err(error) => self.task_failed(op, launch, node, error),
                }
            }
        }
    }

    fn fail(&mut self, index: usize, message: String) {
        if self.failure.is_none() {
            self.failure = Some(format!("{}: {message}", self.ops[index].name));
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
                    ..
                })) => {
                    self.running.remove(&launch.task);
                    self.ops[op].running = self.ops[op].running.saturating_sub(1);
                    // Outputs of tasks that finished anyway are freed with the rest.
                    if let (Ok(done), Some(node)) = (result, node) {
                        for output in done.outputs {
                            let info =
                                BlockInfo::whole(node, output.rows.unwrap_or(0), output.size);
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

    fn output_blocks(&self) -> Vec<OutputBlock> {
        self.outputs
            .iter()
            .filter_map(|object| Some(self.blocks.get(object)?.output_block(*object)))
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
                        _ if op.phase == OperatorPhase::Closed => Some(op.tasks_done),
                        _ => None,
                    },
                    tasks_done: op.tasks_done,
                    tasks_running: op.running,
                    tasks_queued: op.ready.len() as u64,
                })
                .collect(),
            actors: self.actor_progress(),
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
