//! Where jobs' outputs, finished jobs and dead nodes end: the commands that let them go
//! (release, expiry, deletion, pruning, forgetting) and the leader's questions about what is
//! due. Each command carries the ids the leader (or a client) chose, and `apply` checks every
//! one against the state and the entry's time, so a stale or forged choice is rejected the
//! same way on every replica.

use std::fmt;
use std::sync::Arc;

use floe_core::job::JobStats;
use floe_core::{JobId, NodeId, SubmissionId};
use serde::{Deserialize, Serialize};

use super::{ClusterState, JobRecord, JobStatus, Liveness, Outcome};

/// Most jobs or nodes one housekeeping command names, so no entry grows with the backlog.
pub const MAX_PER_COMMAND: usize = 256;

/// Why a job's output was let go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReleaseReason {
    /// The client said it was done with it (`ReleaseJobOutput`).
    Client,
    /// Nobody released it within `jobs.result_ttl`.
    Expired { ttl_ms: u64 },
    /// The job was deleted.
    Deleted,
    /// The job left the state (`jobs.keep_finished`, `jobs.keep_for`) with its output held.
    Pruned,
}

/// When and why a job's output was let go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputRelease {
    pub reason: ReleaseReason,
    /// Milliseconds since the Unix epoch on the leader's clock.
    pub at_ms: u64,
}

impl fmt::Display for OutputRelease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = utc_time(self.at_ms);
        match self.reason {
            ReleaseReason::Client => write!(f, "released by the client at {at}"),
            ReleaseReason::Expired { ttl_ms } => write!(
                f,
                "expired at {at}, {} after the job ended (jobs.result_ttl)",
                floe_core::config::Span::millis(ttl_ms)
            ),
            ReleaseReason::Deleted => write!(f, "deleted with the job at {at}"),
            ReleaseReason::Pruned => write!(
                f,
                "freed at {at} when the job moved to the history (jobs.keep_finished / jobs.keep_for)"
            ),
        }
    }
}

/// How a job left the replicated state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Removal {
    Deleted,
    Pruned,
}

/// What the history keeps of a job that left the state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSummary {
    pub id: JobId,
    pub submission: SubmissionId,
    /// Absent from the lines written before jobs had names.
    #[serde(default)]
    pub name: Option<String>,
    pub status: JobStatus,
    pub attempts: u32,
    pub submitted_at_ms: u64,
    pub started_at_ms: Option<u64>,
    pub ended_at_ms: Option<u64>,
    pub stats: Option<JobStats>,
    pub release: Option<OutputRelease>,
    pub removal: Removal,
    pub removed_at_ms: u64,
}

impl JobSummary {
    fn of(record: &JobRecord, removal: Removal, removed_at_ms: u64) -> Self {
        Self {
            id: record.id,
            submission: record.submission,
            name: record.name.clone(),
            status: record.status.clone(),
            attempts: record.attempts,
            submitted_at_ms: record.submitted_at_ms,
            started_at_ms: record.started_at_ms,
            ended_at_ms: record.ended_at_ms,
            stats: record.stats.clone(),
            release: record.release,
            removal,
            removed_at_ms,
        }
    }
}

/// `at_ms` as `YYYY-MM-DD HH:MM:SS UTC`.
pub fn utc_time(at_ms: u64) -> String {
    let secs = at_ms / 1000;
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (H. Hinnant's algorithm, for non-negative days).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

impl ClusterState {
    /// Marks `job`'s output let go and queues its blocks for freeing.
    fn let_go(&mut self, job: JobId, reason: ReleaseReason, at_ms: u64) {
        let Some(record) = self.jobs.get_mut(&job).map(Arc::make_mut) else {
            return;
        };
        if record.release.is_some() || record.status != JobStatus::Succeeded {
            return;
        }
        record.release = Some(OutputRelease { reason, at_ms });
        if let Some(ended) = record.ended_at_ms {
            self.holding_outputs.remove(&(ended, job));
        }
        let blocks = std::mem::take(&mut record.outputs);
        if !blocks.is_empty() {
            self.outputs_to_free.entry(job).or_default().extend(blocks);
        }
    }

    fn finished_record(&self, job: JobId) -> Result<&JobRecord, Outcome> {
        let record = self
            .jobs
            .get(&job)
            .ok_or_else(|| Outcome::Rejected(format!("no job {job}")))?;
        if !record.status.is_finished() {
            return Err(Outcome::Rejected(format!(
                "job {job} is {}; cancel it first",
                record.status.name()
            )));
        }
        Ok(record)
    }

    pub(super) fn release_output(&mut self, job: JobId, at_ms: u64) -> Outcome {
        let Some(record) = self.jobs.get(&job) else {
            return Outcome::Rejected(format!("no job {job}"));
        };
        if record.status != JobStatus::Succeeded {
            return Outcome::Rejected(format!(
                "job {job} is {}; only a succeeded job holds an output",
                record.status.name()
            ));
        }
        if let Some(release) = &record.release {
            return Outcome::Rejected(format!("job {job}'s output was already {release}"));
        }
        self.let_go(job, ReleaseReason::Client, at_ms);
        Outcome::Applied
    }

    pub(super) fn delete_job(&mut self, job: JobId, at_ms: u64) -> Outcome {
        if let Err(rejected) = self.finished_record(job) {
            return rejected;
        }
        self.let_go(job, ReleaseReason::Deleted, at_ms);
        Outcome::JobsRemoved(vec![self.remove_job(job, Removal::Deleted, at_ms)])
    }

    pub(super) fn expire_outputs(&mut self, jobs: &[JobId], ttl_ms: u64, at_ms: u64) -> Outcome {
        if jobs.len() > MAX_PER_COMMAND {
            return Outcome::Rejected(format!("more than {MAX_PER_COMMAND} jobs in one command"));
        }
        for job in jobs {
            let Some(record) = self.jobs.get(job) else {
                return Outcome::Rejected(format!("no job {job}"));
            };
            let due = record
                .ended_at_ms
                .is_some_and(|ended| ended.saturating_add(ttl_ms) <= at_ms);
            if record.status != JobStatus::Succeeded || !due {
                return Outcome::Rejected(format!(
                    "job {job}'s output is not due to expire (it is {})",
                    record.status.name()
                ));
            }
        }
        for job in jobs {
            self.let_go(*job, ReleaseReason::Expired { ttl_ms }, at_ms);
        }
        Outcome::Applied
    }

    pub(super) fn outputs_freed(&mut self, job: JobId, nodes: &[NodeId]) -> Outcome {
        let Some(blocks) = self.outputs_to_free.get_mut(&job) else {
            return Outcome::Rejected(format!("job {job} has no output left to free"));
        };
        blocks.retain(|block| !nodes.contains(&block.node));
        if blocks.is_empty() {
            self.outputs_to_free.remove(&job);
        }
        Outcome::Applied
    }

    pub(super) fn prune_jobs(&mut self, jobs: &[JobId], at_ms: u64) -> Outcome {
        if jobs.len() > MAX_PER_COMMAND {
            return Outcome::Rejected(format!("more than {MAX_PER_COMMAND} jobs in one command"));
        }
        for job in jobs {
            if let Err(rejected) = self.finished_record(*job) {
                return rejected;
            }
        }
        let mut removed = Vec::with_capacity(jobs.len());
        for job in jobs {
            // A job named twice is removed once.
            if self.jobs.contains_key(job) {
                self.let_go(*job, ReleaseReason::Pruned, at_ms);
                removed.push(self.remove_job(*job, Removal::Pruned, at_ms));
            }
        }
        Outcome::JobsRemoved(removed)
    }

    fn remove_job(&mut self, job: JobId, removal: Removal, at_ms: u64) -> JobSummary {
        let record = self.jobs.remove(&job).expect("checked by the caller");
        self.submissions.remove(&record.submission);
        self.job_counts.remove(&record.status);
        if let Some(ended) = record.ended_at_ms {
            self.ended.remove(&(ended, job));
            self.holding_outputs.remove(&(ended, job));
        }
        JobSummary::of(&record, removal, at_ms)
    }

    pub(super) fn forget_nodes(
        &mut self,
        nodes: &[NodeId],
        dead_for_ms: u64,
        at_ms: u64,
    ) -> Outcome {
        if nodes.len() > MAX_PER_COMMAND {
            return Outcome::Rejected(format!("more than {MAX_PER_COMMAND} nodes in one command"));
        }
        for node in nodes {
            let due = match self.nodes.get(node).map(|record| &record.liveness) {
                None => return Outcome::Rejected(format!("no node {node}")),
                Some(Liveness::Alive) => false,
                Some(Liveness::Dead { at_ms: died, .. }) => {
                    died.saturating_add(dead_for_ms) <= at_ms
                }
            };
            if !due {
                return Outcome::Rejected(format!(
                    "node {node} has not been dead for {}",
                    floe_core::config::Span::millis(dead_for_ms)
                ));
            }
        }
        for node in nodes {
            self.nodes.remove(node);
        }
        Outcome::Applied
    }

    /// Succeeded jobs whose output blocks have been held for `ttl_ms` after they ended, at
    /// `now_ms` (a job without blocks holds nothing to expire), those that ended first first.
    /// Read from the `holding_outputs` index: the due ones are a prefix of it.
    pub fn outputs_due_to_expire(&self, ttl_ms: u64, now_ms: u64) -> Vec<JobId> {
        self.holding_outputs
            .iter()
            .take_while(|(ended, _)| ended.saturating_add(ttl_ms) <= now_ms)
            .map(|(_, job)| *job)
            .take(MAX_PER_COMMAND)
            .collect()
    }

    /// Finished jobs to move to the history at `now_ms`: the earliest ended beyond
    /// `keep_finished`, and those that ended `keep_for_ms` ago or earlier. Read from the
    /// `ended` index, ordered by end: both kinds are a prefix of it, so the cost is the
    /// number of jobs due, not the number of jobs.
    pub fn jobs_due_for_history(
        &self,
        keep_finished: u64,
        keep_for_ms: u64,
        now_ms: u64,
    ) -> Vec<JobId> {
        let mut excess = (self.ended.len() as u64).saturating_sub(keep_finished);
        self.ended
            .iter()
            .take_while(|(ended, _)| {
                let old = ended.saturating_add(keep_for_ms) <= now_ms;
                let beyond = excess > 0;
                excess = excess.saturating_sub(1);
                beyond || old
            })
            .map(|(_, job)| *job)
            .take(MAX_PER_COMMAND)
            .collect()
    }

    /// Dead nodes that died `dead_for_ms` before `now_ms` or earlier.
    pub fn nodes_due_to_forget(&self, dead_for_ms: u64, now_ms: u64) -> Vec<NodeId> {
        self.nodes
            .values()
            .filter(|node| match node.liveness {
                Liveness::Alive => false,
                Liveness::Dead { at_ms, .. } => at_ms.saturating_add(dead_for_ms) <= now_ms,
            })
            .map(|node| node.id)
            .take(MAX_PER_COMMAND)
            .collect()
    }
}

#[cfg(test)]
mod tests;
