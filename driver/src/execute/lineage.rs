//! Lineage reconstruction: a block lost with its node is made again by running the task that
//! produced it under the same task id, so it keeps its object id; tasks waiting for it run once
//! it is back. Output blocks lost after the job's last task are rebuilt before the job ends.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use floe_api::node_protocol::NodeRequest;
use floe_core::{NodeId, ObjectId, TaskId};

use super::Execution;
use super::task::{Launch, Recipe};
use crate::cluster::ClusterAccess;

/// How long rebuilding output blocks lost at the end of a job may take before the job fails
/// (a rebuild that can never finish must not keep the job running).
const OUTPUT_REBUILD_TIMEOUT: Duration = Duration::from_secs(600);

/// The task that made a block: its operator, sequence number and task id.
#[derive(Debug, Clone, Copy)]
struct Maker {
    op: usize,
    seq: u64,
    task: TaskId,
}

/// What rebuilding lost blocks needs to know.
#[derive(Debug, Default)]
pub(super) struct Lineage {
    made_by: BTreeMap<ObjectId, Maker>,
    /// Tasks (operator, launch) waiting for a lost input to be rebuilt.
    waiting: BTreeMap<ObjectId, Vec<(usize, Launch)>>,
    /// Blocks being rebuilt, and the tasks (operator, sequence number) rebuilding them.
    rebuilding: BTreeSet<ObjectId>,
    rebuilding_tasks: BTreeSet<(usize, u64)>,
}

impl Lineage {
    /// Records that task `task`, number `seq` of operator `op`, made `object`.
    pub(super) fn record(&mut self, object: ObjectId, op: usize, seq: u64, task: TaskId) {
        self.made_by.insert(object, Maker { op, seq, task });
    }

    /// Task `launch` of operator `op` runs again once `object` is rebuilt.
    pub(super) fn wait_for(&mut self, object: ObjectId, op: usize, launch: Launch) {
        self.waiting.entry(object).or_default().push((op, launch));
    }

    /// Whether a task of operator `op` waits for a rebuild.
    pub(super) fn has_waiting(&self, op: usize) -> bool {
        self.waiting
            .values()
            .flatten()
            .any(|(waiting, _)| *waiting == op)
    }

    /// Whether a rebuild of `object` was asked for and has not finished.
    pub(super) fn is_rebuilding(&self, object: ObjectId) -> bool {
        self.rebuilding.contains(&object)
    }

    /// Task `seq` of operator `op` made `objects` again: the tasks waiting for them.
    pub(super) fn rebuilt(
        &mut self,
        op: usize,
        seq: u64,
        objects: &[ObjectId],
    ) -> Vec<(usize, Launch)> {
        self.rebuilding_tasks.remove(&(op, seq));
        let mut ready = Vec::new();
        for object in objects {
            self.rebuilding.remove(object);
            ready.extend(self.waiting.remove(object).unwrap_or_default());
        }
        ready
    }
}

impl<C: ClusterAccess> Execution<C> {
    /// Runs again the task that produced `object`, under the same task id so the block keeps
    /// its object id.
    pub(super) fn rebuild(&mut self, object: ObjectId) {
        if self.lineage.rebuilding.contains(&object) {
            return;
        }
        let Some(&Maker { op, seq, task }) = self.lineage.made_by.get(&object) else {
            self.failure = Some(format!(
                "block {object} was lost and its lineage is unknown"
            ));
            return;
        };
        let recipe = self.ops[op]
            .history
            .get(&seq)
            .and_then(|history| history.recipe.clone());
        let Some(recipe) = recipe else {
            self.failure = Some(format!("block {object} was lost and its task is unknown"));
            return;
        };
        self.lineage.rebuilding.insert(object);
        // One task made several blocks: the first lost one starts its rebuild.
        if !self.lineage.rebuilding_tasks.insert((op, seq)) {
            return;
        }
        let retries = self.options.max_task_retries;
        let state = &mut self.ops[op];
        let attempts = &mut state.history_of(seq).failures;
        *attempts += 1;
        if *attempts > retries + 1 {
            self.failure = Some(format!(
                "{}: block {object} was lost too many times",
                state.name
            ));
            return;
        }
        let avoid = self.node_of(object);
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

    /// Rebuilds the inputs of `launch` that are freed or on nodes known dead: a task that
    /// found one input lost would otherwise find the others one failed run at a time. (A
    /// freed input is read again when a task whose output was lost runs again.)
    pub(super) fn rebuild_lost_inputs(&mut self, launch: &Launch) {
        let Recipe::Compute { inputs, .. } = &launch.recipe else {
            return;
        };
        let alive: BTreeSet<NodeId> = self.cluster.alive_nodes().into_iter().collect();
        let lost: Vec<ObjectId> = inputs
            .iter()
            .filter(|block| !self.borrowed.contains_key(block))
            .filter(|block| {
                self.node_of(**block)
                    .is_none_or(|node| !alive.contains(&node))
            })
            .copied()
            .collect();
        for block in lost {
            self.rebuild(block);
        }
    }

    /// Rebuilds output blocks whose node died after they were made, so the job never ends
    /// pointing at a dead node.
    pub(super) async fn recover_lost_outputs(&mut self) {
        loop {
            if let Err(error) = self.cluster.read_nodes().await {
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
            while !self.lineage.rebuilding.is_empty() && self.failure.is_none() {
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
}
