//! Each operator's flow: input bundles queued per input, turned into runnable tasks (or
//! passed straight through), finished bundles emitted in order into the consumers' queues,
//! limits stopping what feeds them, and an operator closing once it has produced everything.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use floe_core::ObjectId;
use floe_core::TaskId;
use floe_core::job::OperatorStats;
use floe_core::plan::physical::Stage;
use floe_core::plan::task::StageInput;

use super::Execution;
use super::blocks::Bundle;
use super::shuffle::{ShufflePhase, ShuffleState};
use super::task::{Launch, Recipe};
use crate::plan::{CacheTarget, Work};

pub(super) struct OpState {
    pub(super) name: String,
    pub(super) stage: Arc<Stage>,
    pub(super) work: Work,
    pub(super) inputs: Vec<usize>,
    pub(super) consumers: Vec<(usize, usize)>,
    pub(super) cache: Option<CacheTarget>,
    pub(super) needed: bool,
    /// Input bundles not yet taken by a task, per input.
    pub(super) queued: Vec<VecDeque<Bundle>>,
    pub(super) inputs_done: Vec<bool>,
    pub(super) ready: VecDeque<Launch>,
    pub(super) next_seq: u64,
    pub(super) next_emit: u64,
    pub(super) finished: BTreeMap<u64, Bundle>,
    pub(super) recipes: BTreeMap<u64, Recipe>,
    pub(super) attempts: BTreeMap<u64, u32>,
    pub(super) unreachable: BTreeMap<u64, u32>,
    pub(super) running: u64,
    /// Bundles emitted (in order): what a cached non-source operator writes at its end.
    pub(super) emitted: Vec<Bundle>,
    /// A limit downstream has what it needs: launch nothing more.
    pub(super) stopped: bool,
    pub(super) closed: bool,
    /// Rows taken by a limit so far.
    pub(super) limit_rows: u64,
    pub(super) limit_taken: Vec<ObjectId>,
    /// A shuffle's progress (all-to-all operators only).
    pub(super) shuffle: ShuffleState,
    /// The schemas of the operator's inputs, which all-to-all tasks need.
    pub(super) input_schemas: Arc<Vec<arrow::datatypes::Schema>>,
    pub(super) stats: OperatorStats,
    pub(super) tasks_done: u64,
    pub(super) started: Option<Instant>,
    pub(super) ended: Option<Instant>,
}

impl OpState {
    pub(super) fn is_source(&self) -> bool {
        matches!(self.work, Work::Source(_))
    }
}

impl Execution {
    /// Moves queued input bundles into runnable tasks (or straight through, for operators
    /// that run none) and closes operators that have produced everything.
    pub(super) fn advance(&mut self) {
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

    pub(super) fn advance_limit(&mut self, index: usize, n: u64) {
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

    pub(super) fn maybe_close(&mut self, index: usize) {
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
    pub(super) fn launch_eligible(&mut self) {
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

    pub(super) fn out_queue(&self, index: usize) -> usize {
        self.ops[index]
            .consumers
            .iter()
            .map(|(consumer, slot)| self.ops[*consumer].queued[*slot].len())
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
}
