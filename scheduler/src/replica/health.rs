//! The leader's health tick: committing the death of nodes that stopped heartbeating, and
//! the driver loop that starts a driver for every pending job.

use std::time::{Duration, Instant};

use super::RaftLoop;
use crate::storage::LogStore;
use floe_api::state::{Command, JobStatus};
use floe_core::{JobId, NodeId};

impl<S: LogStore> RaftLoop<S> {
    /// The leader commits the death of every node silent for longer than the node timeout.
    /// A node first seen now (new registration, or this replica just became leader) gets a
    /// full timeout from now: death needs silence to the current leader. So does every node
    /// after this replica stalled for over half a node timeout (SIGSTOP, a paused VM): it
    /// could not hear anyone then, and it may not even be the leader any more.
    pub(super) fn check_health(&mut self) {
        let now = Instant::now();
        let stalled = now.duration_since(self.last_health_check) > self.config.node_timeout() / 2;
        self.last_health_check = now;
        if !self.is_leader() {
            return;
        }
        let timeout = self.config.node_timeout();
        let mut silent = Vec::new();
        {
            let mut beats = self.beats.lock();
            if stalled {
                tracing::warn!(
                    replica = self.id,
                    "this replica was stalled; every node gets a full timeout from now"
                );
                beats.last_seen.clear();
            }
            for node in self.state.alive_nodes() {
                let last = *beats.last_seen.entry(node.id).or_insert(now);
                if now.duration_since(last) > timeout && !self.dying.contains(&node.id) {
                    silent.push(node.id);
                }
            }
        }
        for node in silent {
            self.dying.insert(node);
            let reason = format!(
                "missed {} heartbeats ({} ms without one)",
                self.config.missed_heartbeats,
                timeout.as_millis()
            );
            tracing::warn!(%node, %reason, "proposing node death");
            self.propose(Command::MarkNodeDead { node, reason }, None);
        }
        self.expire_leases(now);
        self.place_drivers(now, timeout);
        self.tidy();
    }

    /// Starts a driver for every pending job on the least utilized alive node that has
    /// heartbeated to this leader (drivers are light; the work they start runs in the leases
    /// they are granted). Only unfinished jobs are looked at, through the state's index.
    pub(super) fn place_drivers(&mut self, now: Instant, retry_after: Duration) {
        let pending: Vec<JobId> = self
            .state
            .unfinished_jobs()
            .filter(|job| job.status == JobStatus::Pending)
            .map(|job| job.id)
            .collect();
        let mut placed = 0usize;
        let mut candidates: Vec<(f64, NodeId)> = Vec::new();
        for job in pending {
            if self
                .drivers_proposed
                .get(&job)
                .is_some_and(|proposed| now.duration_since(*proposed) < retry_after)
            {
                continue;
            }
            // Ranked once per call rather than once per job, so a burst of submissions costs
            // one pass over the nodes; the jobs go round the nodes least utilized first.
            if candidates.is_empty() {
                let beats = self.beats.lock();
                candidates = self
                    .state
                    .alive_nodes()
                    .filter(|node| !self.dying.contains(&node.id) && beats.heard_from(node.id))
                    .map(|node| {
                        let load = self.leases.view().utilization(node.id).unwrap_or(f64::MAX);
                        (load, node.id)
                    })
                    .collect();
                if candidates.is_empty() {
                    return;
                }
                candidates.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
            let node = candidates[placed % candidates.len()].1;
            placed += 1;
            // Debug, not info: at info the leader's log would grow by a line a job.
            tracing::debug!(%job, %node, "placing a job driver");
            self.drivers_proposed.insert(job, now);
            self.propose(Command::StartDriver { job, node }, None);
        }
    }
}
