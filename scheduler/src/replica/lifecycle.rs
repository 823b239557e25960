//! The leader's housekeeping on each health tick: it expires outputs held past
//! `jobs.result_ttl`, moves finished jobs past `jobs.keep_finished` / `jobs.keep_for` to the
//! history, forgets nodes dead for `nodes.forget_dead_after`, and frees released outputs on
//! the nodes that hold them. Each decision is a command stamped with the leader's clock, which
//! every replica checks again as it applies it; the summaries of removed jobs go to each
//! replica's history file as it applies the removal.
//!
//! The state is also held to half of `net.max_frame`: a follower that fell behind is sent the
//! whole state in one Raft message, and `ReadState` answers it in one frame, so a state past
//! the frame limit would leave that follower behind for good. When a snapshot measures the
//! state past the budget, finished jobs go to the history early, oldest first, until it fits
//! (`finished_that_fit`); a warning names the settings to change.

use std::collections::BTreeMap;
use std::time::Instant;

use floe_api::node_protocol::{NodeProtocol, NodeRequest, NodeResponse};
use floe_api::state::{Command, JobSummary};
use floe_core::wire::{RpcClient, WireConfig};
use floe_core::{JobId, NodeId, ObjectId};
use tokio::sync::mpsc;

use super::{Input, RaftLoop, now_ms};
use crate::storage::LogStore;

impl<S: LogStore> RaftLoop<S> {
    pub(super) fn tidy(&mut self) {
        let now = now_ms();
        let ttl_ms = self.jobs_config.result_ttl.as_millis();
        let expired = self.state.outputs_due_to_expire(ttl_ms, now);
        if !expired.is_empty() {
            self.propose(
                Command::ExpireJobOutputs {
                    jobs: expired,
                    ttl_ms,
                },
                None,
            );
        }
        let keep = self
            .jobs_config
            .keep_finished
            .min(self.finished_that_fit.unwrap_or(u64::MAX));
        let old = self
            .state
            .jobs_due_for_history(keep, self.jobs_config.keep_for.as_millis(), now);
        if !old.is_empty() {
            self.propose(Command::PruneJobs { jobs: old }, None);
        }
        let dead_for_ms = self.nodes_config.forget_dead_after.as_millis();
        let forgotten = self.state.nodes_due_to_forget(dead_for_ms, now);
        if !forgotten.is_empty() {
            self.propose(
                Command::ForgetNodes {
                    nodes: forgotten,
                    dead_for_ms,
                },
                None,
            );
        }
        self.free_released_outputs();
    }

    /// Sets how many finished jobs fit the state's budget, from a snapshot of `bytes` holding
    /// `jobs` jobs, `finished` of them finished; says so when that is fewer than
    /// `jobs.keep_finished`.
    pub(super) fn bound_finished_jobs(&mut self, bytes: u64, jobs: u64, finished: u64) {
        let budget = self.max_frame / 2;
        let fit = finished_that_fit(bytes, jobs, finished, budget);
        if fit < self.jobs_config.keep_finished {
            tracing::warn!(
                replica = self.id,
                snapshot_bytes = bytes,
                budget,
                kept = fit,
                keep_finished = self.jobs_config.keep_finished,
                "the state nears net.max_frame (a snapshot must fit in one frame): finished \
                 jobs past the kept count go to the history; raise net.max_frame or lower \
                 jobs.keep_finished"
            );
        }
        self.finished_that_fit = Some(fit);
    }

    /// Sends `Free` for every released output to the alive nodes holding it, at most once
    /// per node timeout per job; the nodes that answer are committed as freed. A dead node's
    /// copies are dropped from the list when its death applies.
    fn free_released_outputs(&mut self) {
        let now = Instant::now();
        let retry_after = self.config.node_timeout();
        let to_free = &self.state.outputs_to_free;
        self.freeing.retain(|job, _| to_free.contains_key(job));
        for (job, blocks) in to_free {
            if self
                .freeing
                .get(job)
                .is_some_and(|since| now.duration_since(*since) < retry_after)
            {
                continue;
            }
            let mut by_node: BTreeMap<NodeId, (String, Vec<ObjectId>)> = BTreeMap::new();
            for block in blocks {
                let Some(node) = self.state.nodes.get(&block.node) else {
                    continue;
                };
                by_node
                    .entry(node.id)
                    .or_insert_with(|| (node.addresses.rpc.clone(), Vec::new()))
                    .1
                    .push(block.object);
            }
            self.freeing.insert(*job, now);
            self.runtime.spawn(free_on_nodes(
                *job,
                by_node,
                self.node_wire.clone(),
                self.inputs.clone(),
            ));
        }
    }

    /// Appends summaries of jobs that left the state to this replica's history. A failed
    /// write loses them from this replica's file only (the others have them), so it is
    /// logged rather than stopping the replica.
    pub(super) fn record_history(&mut self, summaries: &[JobSummary]) {
        let Some(history) = &mut self.history else {
            return;
        };
        if let Err(error) = history.append(summaries) {
            tracing::error!(replica = self.id, %error, count = summaries.len(), "cannot append to the job history");
        }
    }
}

/// Frees `job`'s blocks on each node, then commits which nodes answered.
async fn free_on_nodes(
    job: JobId,
    by_node: BTreeMap<NodeId, (String, Vec<ObjectId>)>,
    wire: WireConfig,
    inputs: mpsc::Sender<Input>,
) {
    let mut freed = Vec::new();
    for (node, (addr, objects)) in by_node {
        let call = async {
            let mut client = RpcClient::<NodeProtocol>::connect(addr, wire.clone()).await?;
            client.call(&NodeRequest::Free { objects }).await
        };
        match call.await {
            Ok(NodeResponse::Freed) => freed.push(node),
            Ok(other) => tracing::warn!(%job, %node, ?other, "unexpected answer to Free"),
            Err(error) => {
                tracing::debug!(%job, %node, %error, "freeing a released output failed; will retry")
            }
        }
    }
    if freed.is_empty() {
        return;
    }
    tracing::info!(%job, nodes = ?freed, "released output freed");
    // Nobody waits for the outcome: a lost commit is retried after a node timeout.
    let command = Command::OutputsFreed { job, nodes: freed };
    let _ = inputs.send(Input::Housekeeping(command)).await;
}

/// How many finished jobs the state can hold and stay within `budget` bytes, from a snapshot
/// of `bytes` that held `jobs` jobs, `finished` of them finished: as many more as the room
/// left holds, or as many fewer as the excess weighs, at the snapshot's bytes per job. Every
/// job is taken to weigh that average, which overstates a job (nodes and the cache index weigh
/// in too), so a cut falls short rather than past the need, and the next snapshot cuts again.
fn finished_that_fit(bytes: u64, jobs: u64, finished: u64, budget: u64) -> u64 {
    let per_job = bytes.div_ceil(jobs.max(1)).max(1);
    if bytes <= budget {
        finished.saturating_add((budget - bytes) / per_job)
    } else {
        finished.saturating_sub((bytes - budget).div_ceil(per_job))
    }
}

#[cfg(test)]
mod tests {
    use super::finished_that_fit;

    #[test]
    fn the_jobs_that_fit_grow_with_the_room_left_and_shrink_with_the_excess() {
        // 1,000 jobs of 100 bytes, 800 finished.
        assert_eq!(finished_that_fit(100_000, 1_000, 800, 150_000), 1_300);
        assert_eq!(finished_that_fit(100_000, 1_000, 800, 100_000), 800);
        assert_eq!(finished_that_fit(100_000, 1_000, 800, 60_000), 400);
        // More excess than the finished jobs weigh: all of them go, and no further.
        assert_eq!(finished_that_fit(100_000, 1_000, 800, 1_000), 0);
        // An empty state fits whatever it may hold.
        assert_eq!(finished_that_fit(0, 0, 0, 1_000), 1_000);
    }
}
