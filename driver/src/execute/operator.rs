//! Each operator's flow: input bundles queued per input, turned into runnable tasks (or
//! passed straight through), finished bundles emitted in order into the consumers' queues,
//! limits stopping what feeds them, and an operator closing once it has produced everything.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use floe_core::ObjectId;
use floe_core::job::OperatorStats;
use floe_core::plan::WriteSpec;
use floe_core::plan::physical::Stage;
use floe_core::plan::task::StageInput;

use super::Execution;
use super::blocks::Bundle;
use super::shuffle::{ShufflePhase, ShuffleState};
use super::task::{Launch, Recipe, compute};
use crate::cluster::ClusterAccess;
use crate::plan::{CacheTarget, MapSource, PlannedOperator, SourceTask, Work};

/// Where an operator is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OperatorPhase {
    /// The job does not run it (it is below a full cache hit).
    Skipped,
    /// Taking input bundles and running tasks.
    Open,
    /// A limit downstream has its rows: queued and finished bundles are dropped, and only
    /// rebuilds (a consumer waits for their blocks) still start.
    Stopped,
    /// It has produced everything and its consumers know it; only rebuilds of its blocks
    /// still run.
    Closed,
}

/// One input of an operator.
pub(super) struct Input {
    /// The operator producing it.
    pub(super) producer: usize,
    /// Bundles the producer emitted that no task has taken yet.
    pub(super) queued: VecDeque<Bundle>,
    /// The producer has closed: no more bundles come.
    pub(super) ended: bool,
}

/// What is known about one task of an operator (by sequence number), across its runs.
#[derive(Debug, Default)]
pub(super) struct TaskHistory {
    /// How its bundle is made, once it has started (for rebuilding the bundle).
    pub(super) recipe: Option<Recipe>,
    /// Runs that failed or lost their output, against the job's retry limit.
    pub(super) failures: u32,
    /// Runs that could not reach their node or the scheduler.
    pub(super) unreachable: u32,
}

/// What a limit has taken from its input so far.
#[derive(Debug, Default)]
pub(super) struct LimitProgress {
    pub(super) rows: u64,
    pub(super) blocks: Vec<ObjectId>,
}

pub(super) struct OperatorState {
    pub(super) name: String,
    pub(super) stage: Arc<Stage>,
    pub(super) work: Work,
    pub(super) phase: OperatorPhase,
    pub(super) inputs: Vec<Input>,
    /// The operators reading this one, each with the input slot it reads it in.
    pub(super) consumers: Vec<(usize, usize)>,
    pub(super) cache: Option<CacheTarget>,
    /// The job's sink, when it is fused into this operator: the tasks making its output write
    /// it.
    pub(super) sink: Option<WriteSpec>,
    /// A shuffle's read fused into its map side: its map tasks read the files themselves.
    pub(super) map_source: Option<Arc<MapSource>>,
    /// Tasks ready to start, in order.
    pub(super) ready: VecDeque<Launch>,
    pub(super) next_seq: u64,
    /// The sequence number of the next bundle to emit; later ones wait in `finished`.
    pub(super) next_emit: u64,
    pub(super) finished: BTreeMap<u64, Bundle>,
    pub(super) history: BTreeMap<u64, TaskHistory>,
    pub(super) running: u64,
    /// Bundles emitted (in order): what a cached non-source operator writes at its end.
    pub(super) emitted: Vec<Bundle>,
    pub(super) limit: LimitProgress,
    /// A shuffle's progress (all-to-all operators only).
    pub(super) shuffle: ShuffleState,
    /// The schemas of the operator's inputs, which all-to-all tasks need.
    pub(super) input_schemas: Arc<Vec<arrow::datatypes::Schema>>,
    pub(super) stats: OperatorStats,
    pub(super) tasks_done: u64,
    pub(super) started: Option<Instant>,
    pub(super) ended: Option<Instant>,
}

impl OperatorState {
    /// A planned operator before it runs; a source's tasks are ready at once.
    pub(super) fn new(operator: PlannedOperator) -> Self {
        let stats = OperatorStats {
            name: operator.name.clone(),
            fingerprint: Some(operator.stage.fingerprint),
            cache_hits: operator.cache_hits,
            ..OperatorStats::default()
        };
        let mut ready = VecDeque::new();
        if let Work::Source(tasks) = &operator.work {
            for (seq, task) in (0u64..).zip(tasks) {
                let recipe = match *task {
                    SourceTask::Compute(input) => Recipe::Compute {
                        input,
                        inputs: Vec::new(),
                        source: None,
                    },
                    SourceTask::Load(shard) => Recipe::Load(shard),
                    SourceTask::Borrow(block) => Recipe::Compute {
                        input: StageInput::Blocks,
                        inputs: vec![block.object],
                        source: None,
                    },
                };
                ready.push_back(Launch::first(seq, recipe));
            }
        }
        let inputs = operator
            .inputs
            .iter()
            .map(|&producer| Input {
                producer,
                queued: VecDeque::new(),
                ended: false,
            })
            .collect::<Vec<_>>();
        Self {
            name: operator.name,
            stage: Arc::new(operator.stage),
            phase: if operator.needed {
                OperatorPhase::Open
            } else {
                OperatorPhase::Skipped
            },
            // A fused read is the shuffle's one input side.
            shuffle: ShuffleState::new(
                inputs.len().max(usize::from(operator.map_source.is_some())),
            ),
            inputs,
            consumers: Vec::new(),
            cache: operator.cache,
            sink: operator.sink,
            map_source: operator.map_source.map(Arc::new),
            next_seq: ready.len() as u64,
            ready,
            work: operator.work,
            next_emit: 0,
            finished: BTreeMap::new(),
            history: BTreeMap::new(),
            running: 0,
            emitted: Vec::new(),
            limit: LimitProgress::default(),
            input_schemas: Arc::new(Vec::new()),
            stats,
            tasks_done: 0,
            started: None,
            ended: None,
        }
    }

    pub(super) fn is_source(&self) -> bool {
        matches!(self.work, Work::Source(_))
    }

    /// Whether every input's producer has closed.
    pub(super) fn inputs_ended(&self) -> bool {
        self.inputs.iter().all(|input| input.ended)
    }

    /// Whether `launch` may start now: an open operator starts anything, a stopped or closed
    /// one only rebuilds.
    fn starts(&self, launch: &Launch) -> bool {
        match self.phase {
            OperatorPhase::Open => true,
            OperatorPhase::Stopped | OperatorPhase::Closed => launch.rebuild,
            OperatorPhase::Skipped => false,
        }
    }

    /// The history of task `seq`.
    pub(super) fn history_of(&mut self, seq: u64) -> &mut TaskHistory {
        self.history.entry(seq).or_default()
    }
}

impl<C: ClusterAccess> Execution<C> {
    /// Moves queued input bundles into runnable tasks (or straight through, for operators
    /// that run none) and closes operators that have produced everything.
    pub(super) fn advance(&mut self) {
        for index in 0..self.ops.len() {
            match self.ops[index].phase {
                OperatorPhase::Skipped | OperatorPhase::Closed => continue,
                OperatorPhase::Stopped => {
                    // A limit downstream has its rows: what is queued or finished is not
                    // needed.
                    let op = &mut self.ops[index];
                    op.inputs.iter_mut().for_each(|input| input.queued.clear());
                    if op.running == 0 {
                        op.finished.clear();
                    }
                    self.maybe_close(index);
                    continue;
                }
                OperatorPhase::Open => {}
            }
            match self.ops[index].work.clone() {
                Work::Source(_) => {}
                Work::Map | Work::Sink => {
                    let sink = matches!(self.ops[index].work, Work::Sink);
                    while let Some(bundle) = self.ops[index].inputs[0].queued.pop_front() {
                        let op = &mut self.ops[index];
                        let seq = op.next_seq;
                        op.next_seq += 1;
                        let input = if sink {
                            let index = u32::try_from(seq).unwrap_or(u32::MAX);
                            StageInput::Sink { index }
                        } else {
                            StageInput::Blocks
                        };
                        op.ready.push_back(compute(seq, input, bundle.blocks));
                    }
                }
                Work::Limit(n) => self.advance_limit(index, n),
                Work::AllToAll => self.advance_shuffle(index),
                Work::Union | Work::PassThrough => {
                    // Input 0's bundles first; a later input's wait until those before it end.
                    for slot in 0..self.ops[index].inputs.len() {
                        while let Some(bundle) = self.ops[index].inputs[slot].queued.pop_front() {
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
                        if !self.ops[index].inputs[slot].ended {
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
            op.inputs[0].queued.clear();
            return;
        }
        while op.limit.rows < n {
            let Some(bundle) = op.inputs[0].queued.pop_front() else {
                break;
            };
            for block in bundle.blocks {
                op.limit.rows += self.blocks.get(&block).map_or(0, |info| info.rows);
                op.limit.blocks.push(block);
            }
        }
        if op.limit.rows >= n || op.inputs[0].ended {
            op.next_seq = 1;
            let taken = std::mem::take(&mut op.limit.blocks);
            op.ready.push_back(compute(0, StageInput::Blocks, taken));
            self.stop_upstream(index);
        }
    }

    /// Stops what feeds limit `index`, which has its rows — except an operator another
    /// running consumer still reads (a subplan shared with a union or a join).
    fn stop_upstream(&mut self, index: usize) {
        let mut upstream: Vec<usize> = self.ops[index]
            .inputs
            .iter()
            .map(|input| input.producer)
            .collect();
        while let Some(producer) = upstream.pop() {
            let unread = self.ops[producer].consumers.iter().all(|(consumer, _)| {
                *consumer == index || self.ops[*consumer].phase != OperatorPhase::Open
            });
            let op = &mut self.ops[producer];
            if unread && op.phase == OperatorPhase::Open {
                op.phase = OperatorPhase::Stopped;
                // A rebuild still runs: some consumer is waiting for its block.
                op.ready.retain(|launch| launch.rebuild);
                upstream.extend(op.inputs.iter().map(|input| input.producer));
            }
        }
    }

    /// Closes operator `index` if it has produced everything it will.
    fn maybe_close(&mut self, index: usize) {
        let op = &self.ops[index];
        let stopped = op.phase == OperatorPhase::Stopped;
        let inputs_drained = op.inputs.iter().all(|input| input.queued.is_empty())
            && (op.inputs_ended() || stopped || op.is_source());
        let limit_waiting = matches!(op.work, Work::Limit(_)) && op.next_seq == 0 && !stopped;
        let shuffle_waiting = matches!(op.work, Work::AllToAll)
            && op.shuffle.phase != ShufflePhase::Reducing
            && !stopped;
        if op.phase == OperatorPhase::Closed
            || !inputs_drained
            || limit_waiting
            || shuffle_waiting
            || !op.ready.is_empty()
            || op.running > 0
            || !op.finished.is_empty()
            || self.lineage.has_waiting(index)
        {
            return;
        }
        self.stop_aggregators(index);
        let op = &mut self.ops[index];
        op.phase = OperatorPhase::Closed;
        op.ended.get_or_insert_with(Instant::now);
        for (consumer, slot) in op.consumers.clone() {
            self.ops[consumer].inputs[slot].ended = true;
        }
        // A stopped operator's output was cut short: it is not the output its
        // fingerprint names.
        if !stopped {
            self.write_whole_output_to_cache(index);
        }
    }

    /// Launches tasks while some operator is eligible, smallest out-queue first.
    pub(super) fn launch_eligible(&mut self) {
        loop {
            let over_budget = self.limits.over_budget(self.queued_bytes());
            // The client lags: the final operator waits (rebuilds still run).
            let stream_full = self.stream_full();
            let chosen = (0..self.ops.len())
                .filter(|&index| {
                    let op = &self.ops[index];
                    op.ready.front().is_some_and(|launch| {
                        op.starts(launch)
                            && !(index == self.output && stream_full && !launch.rebuild)
                    }) && op.running < self.limits.concurrency_cap
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
            .map(|(consumer, slot)| self.ops[*consumer].inputs[*slot].queued.len())
            .sum()
    }

    /// Emits the operator's finished bundles that are next in order.
    pub(super) fn emit_ready(&mut self, index: usize) {
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
                self.publish_outputs(&bundle.blocks);
            }
            let consumers = self.ops[index].consumers.clone();
            // A streamed output is the client's to acknowledge, not the job's to keep.
            let held_output = index == self.output && self.stream.is_none();
            let pin = held_output || self.ops[index].cache.is_some();
            for block in &bundle.blocks {
                // Added, not set: a union re-emits blocks it took from its input.
                *self.refs.entry(*block).or_insert(0) += consumers.len();
                if pin {
                    self.pinned.insert(*block);
                }
            }
            for (consumer, slot) in consumers {
                self.ops[consumer].inputs[slot]
                    .queued
                    .push_back(bundle.clone());
            }
        }
    }
}
