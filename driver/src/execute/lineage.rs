//! Lineage reconstruction: a block lost with its node is made again by running the task that
//! produced it under the same task id, so it keeps its object id; tasks waiting for it run once
//! it is back. Output blocks lost after the job's last task are rebuilt before the job ends.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use floe_api::node_protocol::NodeRequest;
use floe_core::{NodeId, ObjectId};

use super::Execution;
use super::task::Launch;

/// How long rebuilding output blocks lost at the end of a job may take before the job fails
/// (a rebuild that can never finish must not keep the job running).
const OUTPUT_REBUILD_TIMEOUT: Duration = Duration::from_secs(600);

impl Execution {
    /// Runs again the task that produced `object`, under the same task id so the block keeps
    /// its object id.
    pub(super) fn rebuild(&mut self, object: ObjectId) {
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

    /// Rebuilds output blocks whose node died after they were made, so the job never ends
    /// pointing at a dead node.
    pub(super) async fn recover_lost_outputs(&mut self) {
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
}
