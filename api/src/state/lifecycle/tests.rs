use std::collections::BTreeMap;

use floe_core::job::OutputBlock;
use floe_core::{ObjectId, SubmissionId};

use super::super::{Command, JobOutcome, NodeAddresses, NodeMemory, Resources};
use super::*;

const HOUR: u64 = 3_600_000;

/// A state with nodes `a` and `b` and the applied-index counter of a test log.
struct Log {
    state: ClusterState,
    index: u64,
}

impl Log {
    fn new() -> Self {
        Self {
            state: ClusterState::default(),
            index: 0,
        }
    }

    fn apply(&mut self, at_ms: u64, command: Command) -> Outcome {
        self.index += 1;
        self.state.apply(self.index, at_ms, command).unwrap()
    }

    fn register(&mut self, rpc: &str) -> NodeId {
        let command = Command::RegisterNode {
            addresses: NodeAddresses { rpc: rpc.into() },
            resources: Resources {
                cpu_millis: 1_000,
                heap_bytes: 1 << 30,
            },
            memory: NodeMemory::default(),
            labels: BTreeMap::new(),
            replaces: None,
        };
        match self.apply(0, command) {
            Outcome::NodeRegistered(node) => node,
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Submits at `at_ms`, starts on `node`, ends with `status` at `ended_ms` holding one block
    /// per node of `blocks_on`.
    fn run_job(
        &mut self,
        n: u8,
        at_ms: u64,
        node: NodeId,
        status: JobStatus,
        ended_ms: u64,
        blocks_on: &[NodeId],
    ) -> JobId {
        let job = match self.apply(
            at_ms,
            Command::SubmitJob {
                spec: vec![n],
                submission: SubmissionId::new(u128::from(n)),
                name: Some(format!("job {n}")),
            },
        ) {
            Outcome::JobSubmitted(job) => job,
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(
            self.apply(at_ms + 1, Command::StartDriver { job, node }),
            Outcome::Applied
        );
        let outputs = blocks_on
            .iter()
            .enumerate()
            .map(|(i, node)| OutputBlock {
                object: ObjectId::new(u128::from(n) << 8 | i as u128),
                node: *node,
                rows: 1,
                bytes: 8,
            })
            .collect();
        let outcome = JobOutcome {
            status,
            stats: JobStats::default(),
            outputs,
        };
        assert_eq!(
            self.apply(
                ended_ms,
                Command::FinishJob {
                    job,
                    attempt: 1,
                    outcome
                }
            ),
            Outcome::Applied
        );
        job
    }

    fn unchanged_by(&mut self, at_ms: u64, command: Command) -> String {
        let before = self.state.clone();
        let outcome = self.apply(at_ms, command);
        let mut after = self.state.clone();
        after.applied_index = before.applied_index;
        after.applied_commands = before.applied_commands;
        assert_eq!(after, before, "a rejected command changed the state");
        match outcome {
            Outcome::Rejected(reason) => reason,
            other => panic!("expected a rejection, got {other:?}"),
        }
    }
}

#[test]
fn a_job_records_the_leaders_times() {
    let mut log = Log::new();
    let a = log.register("a:1");
    let job = log.run_job(1, 1_000, a, JobStatus::Succeeded, 5_000, &[a]);
    let record = &log.state.jobs[&job];
    assert_eq!(record.submitted_at_ms, 1_000);
    assert_eq!(record.started_at_ms, Some(1_001));
    assert_eq!(record.ended_at_ms, Some(5_000));
    assert!(log.state.unfinished.is_empty());
}

#[test]
fn releasing_an_output_queues_its_blocks_for_freeing_once() {
    let mut log = Log::new();
    let (a, b) = (log.register("a:1"), log.register("b:1"));
    let job = log.run_job(1, 0, a, JobStatus::Succeeded, 10, &[a, b]);
    assert_eq!(
        log.apply(20, Command::ReleaseJobOutput { job }),
        Outcome::Applied
    );
    let record = &log.state.jobs[&job];
    assert!(record.outputs.is_empty());
    assert_eq!(
        record.release,
        Some(OutputRelease {
            reason: ReleaseReason::Client,
            at_ms: 20
        })
    );
    assert_eq!(log.state.outputs_to_free[&job].len(), 2);
    let again = log.unchanged_by(30, Command::ReleaseJobOutput { job });
    assert!(
        again.contains("released by the client at 1970-01-01 00:00:00 UTC"),
        "{again}"
    );
    // One node answered; then the other died, taking its copy with it.
    assert_eq!(
        log.apply(
            40,
            Command::OutputsFreed {
                job,
                nodes: vec![a]
            }
        ),
        Outcome::Applied
    );
    assert_eq!(log.state.outputs_to_free[&job].len(), 1);
    log.apply(
        50,
        Command::MarkNodeDead {
            node: b,
            reason: "gone".into(),
        },
    );
    assert!(log.state.outputs_to_free.is_empty());
    log.unchanged_by(
        60,
        Command::OutputsFreed {
            job,
            nodes: vec![b],
        },
    );
}

#[test]
fn only_a_succeeded_job_has_an_output_to_release() {
    let mut log = Log::new();
    let a = log.register("a:1");
    let failed = JobStatus::Failed {
        message: "no".into(),
    };
    let job = log.run_job(1, 0, a, failed, 10, &[]);
    let reason = log.unchanged_by(20, Command::ReleaseJobOutput { job });
    assert!(reason.contains("failed"), "{reason}");
    log.unchanged_by(
        20,
        Command::ReleaseJobOutput {
            job: JobId::new(99),
        },
    );
}

#[test]
fn outputs_expire_only_after_the_ttl_on_the_entrys_clock() {
    let mut log = Log::new();
    let a = log.register("a:1");
    let job = log.run_job(1, 0, a, JobStatus::Succeeded, HOUR, &[a]);
    assert!(
        log.state
            .outputs_due_to_expire(HOUR, 2 * HOUR - 1)
            .is_empty()
    );
    let early = log.unchanged_by(
        2 * HOUR - 1,
        Command::ExpireJobOutputs {
            jobs: vec![job],
            ttl_ms: HOUR,
        },
    );
    assert!(early.contains("not due"), "{early}");
    assert_eq!(log.state.outputs_due_to_expire(HOUR, 2 * HOUR), vec![job]);
    assert_eq!(
        log.apply(
            2 * HOUR,
            Command::ExpireJobOutputs {
                jobs: vec![job],
                ttl_ms: HOUR
            }
        ),
        Outcome::Applied
    );
    let release = log.state.jobs[&job].release.unwrap();
    assert_eq!(release.reason, ReleaseReason::Expired { ttl_ms: HOUR });
    assert!(
        release.to_string().contains("1h after the job ended"),
        "{release}"
    );
    assert!(log.state.outputs_due_to_expire(HOUR, 3 * HOUR).is_empty());
    // Expiring an output already let go changes nothing.
    assert_eq!(
        log.apply(
            3 * HOUR,
            Command::ExpireJobOutputs {
                jobs: vec![job],
                ttl_ms: HOUR
            }
        ),
        Outcome::Applied
    );
    assert_eq!(log.state.jobs[&job].release, Some(release));
}

#[test]
fn deleting_a_job_frees_its_output_and_summarizes_it() {
    let mut log = Log::new();
    let a = log.register("a:1");
    let job = log.run_job(1, 0, a, JobStatus::Succeeded, 10, &[a]);
    let Outcome::JobsRemoved(summaries) = log.apply(20, Command::DeleteJob { job }) else {
        panic!("not removed");
    };
    assert_eq!(summaries.len(), 1);
    assert_eq!(summaries[0].id, job);
    assert_eq!(
        summaries[0].name.as_deref(),
        Some("job 1"),
        "the history keeps the job's name"
    );
    assert_eq!(summaries[0].removal, Removal::Deleted);
    assert_eq!(summaries[0].release.unwrap().reason, ReleaseReason::Deleted);
    assert!(log.state.jobs.is_empty());
    assert!(log.state.submissions.is_empty());
    assert_eq!(log.state.outputs_to_free[&job].len(), 1);
    log.unchanged_by(30, Command::DeleteJob { job });
}

#[test]
fn a_running_job_cannot_be_deleted_or_pruned() {
    let mut log = Log::new();
    let a = log.register("a:1");
    log.apply(
        0,
        Command::SubmitJob {
            spec: vec![1],
            submission: SubmissionId::new(1),
            name: None,
        },
    );
    let job = JobId::new(1);
    let reason = log.unchanged_by(1, Command::DeleteJob { job });
    assert!(reason.contains("cancel it first"), "{reason}");
    log.apply(2, Command::StartDriver { job, node: a });
    log.unchanged_by(3, Command::PruneJobs { jobs: vec![job] });
    assert!(log.state.jobs_due_for_history(0, 0, u64::MAX).is_empty());
}

#[test]
fn pruning_keeps_the_newest_finished_jobs_and_drops_old_ones() {
    let mut log = Log::new();
    let a = log.register("a:1");
    let jobs: Vec<JobId> = (1..=6)
        .map(|n| log.run_job(n, 0, a, JobStatus::Succeeded, u64::from(n) * HOUR, &[a]))
        .collect();
    // Keep 4: the two oldest go; kept for 3 h at 8 h: jobs ended at 5 h or earlier go too.
    assert_eq!(
        log.state.jobs_due_for_history(4, u64::MAX, 8 * HOUR),
        jobs[..2]
    );
    assert_eq!(
        log.state.jobs_due_for_history(10, 3 * HOUR, 8 * HOUR),
        jobs[..5]
    );
    let due = log.state.jobs_due_for_history(4, u64::MAX, 8 * HOUR);
    let Outcome::JobsRemoved(summaries) = log.apply(8 * HOUR, Command::PruneJobs { jobs: due })
    else {
        panic!("not pruned");
    };
    assert_eq!(summaries.len(), 2);
    assert!(summaries.iter().all(
        |s| s.removal == Removal::Pruned && s.release.unwrap().reason == ReleaseReason::Pruned
    ));
    assert_eq!(log.state.jobs.len(), 4);
    assert_eq!(log.state.submissions.len(), 4);
    assert_eq!(log.state.outputs_to_free.len(), 2);
    assert!(
        log.state
            .jobs_due_for_history(4, u64::MAX, 8 * HOUR)
            .is_empty()
    );
    // Naming a job twice removes it once; naming a gone one is refused.
    log.unchanged_by(
        9 * HOUR,
        Command::PruneJobs {
            jobs: jobs[..1].to_vec(),
        },
    );
    let Outcome::JobsRemoved(once) = log.apply(
        9 * HOUR,
        Command::PruneJobs {
            jobs: vec![jobs[2], jobs[2]],
        },
    ) else {
        panic!("not pruned");
    };
    assert_eq!(once.len(), 1);
}

#[test]
fn dead_nodes_are_forgotten_after_the_delay_only() {
    let mut log = Log::new();
    let (a, b) = (log.register("a:1"), log.register("b:1"));
    log.apply(
        HOUR,
        Command::MarkNodeDead {
            node: a,
            reason: "gone".into(),
        },
    );
    assert!(log.state.nodes_due_to_forget(HOUR, 2 * HOUR - 1).is_empty());
    assert_eq!(log.state.nodes_due_to_forget(HOUR, 2 * HOUR), vec![a]);
    log.unchanged_by(
        2 * HOUR - 1,
        Command::ForgetNodes {
            nodes: vec![a],
            dead_for_ms: HOUR,
        },
    );
    let alive = log.unchanged_by(
        9 * HOUR,
        Command::ForgetNodes {
            nodes: vec![b],
            dead_for_ms: HOUR,
        },
    );
    assert!(alive.contains("has not been dead"), "{alive}");
    assert_eq!(
        log.apply(
            2 * HOUR,
            Command::ForgetNodes {
                nodes: vec![a],
                dead_for_ms: HOUR
            }
        ),
        Outcome::Applied
    );
    assert_eq!(log.state.nodes.keys().copied().collect::<Vec<_>>(), vec![b]);
    // Ids are never handed out again.
    assert_ne!(log.register("c:1"), a);
}

#[test]
fn oversized_housekeeping_commands_are_refused() {
    let mut log = Log::new();
    let many: Vec<JobId> = (1..=MAX_PER_COMMAND as u64 + 1).map(JobId::new).collect();
    log.unchanged_by(0, Command::PruneJobs { jobs: many.clone() });
    log.unchanged_by(
        0,
        Command::ExpireJobOutputs {
            jobs: many,
            ttl_ms: 0,
        },
    );
}

#[test]
fn utc_times_are_civil_dates() {
    assert_eq!(utc_time(0), "1970-01-01 00:00:00 UTC");
    assert_eq!(utc_time(951_782_400_000), "2000-02-29 00:00:00 UTC");
    assert_eq!(
        utc_time(1_796_083_200_000 + 3_723_000),
        "2026-12-01 01:02:03 UTC"
    );
}
