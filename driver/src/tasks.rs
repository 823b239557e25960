//! The task tables of the drivers a node hosts, for the dashboard's job page
//! (`NodeRequest::JobTasks`).
//!
//! They live in the memory of the node that runs the driver, never in the scheduler's
//! replicated state: a table holds at most [`MAX_TASKS`] runs (the oldest finished ones go
//! first), and a board at most [`MAX_JOBS`] jobs' tables. A finished job's table is kept
//! while the job is in the scheduler's state, so its page can show it: the node hosting the
//! board [`forget`](TaskBoard::forget)s it once the job was pruned or deleted (its sweep asks
//! the scheduler every 10 s), or newer jobs push it out first; a node's restart loses them all.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use floe_api::node_protocol::{TaskRecord, TaskRunState, TaskTable, WorkerRef};
use floe_core::{JobId, NodeId, TaskId};

/// The most task runs one job's table keeps.
pub const MAX_TASKS: usize = 10_000;
/// The most jobs whose tables one node keeps.
pub const MAX_JOBS: usize = 64;

/// The task tables of a node's drivers; clones share them.
#[derive(Debug, Clone, Default)]
pub struct TaskBoard {
    inner: Arc<Mutex<Board>>,
}

#[derive(Debug, Default)]
struct Board {
    tables: BTreeMap<JobId, Table>,
    /// Jobs in the order their tables were started, oldest first.
    order: VecDeque<JobId>,
}

#[derive(Debug, Default)]
struct Table {
    attempt: u32,
    tasks: VecDeque<TaskRecord>,
    dropped: u64,
}

/// How one run ended.
pub struct RunEnd {
    pub node: Option<NodeId>,
    pub worker: Option<WorkerRef>,
    pub rows: u64,
    pub bytes: u64,
    pub ended_ms: u64,
    pub error: Option<String>,
}

impl Board {
    /// The record of run `task` of `job` while it runs.
    fn running(&mut self, job: JobId, task: TaskId) -> Option<&mut TaskRecord> {
        self.tables
            .get_mut(&job)?
            .tasks
            .iter_mut()
            .rev()
            .find(|record| record.task == task && record.state == TaskRunState::Running)
    }
}

impl TaskBoard {
    fn lock(&self) -> MutexGuard<'_, Board> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts attempt `attempt`'s table of `job`, replacing an earlier attempt's.
    pub fn start_job(&self, job: JobId, attempt: u32) {
        let mut board = self.lock();
        board.order.retain(|known| *known != job);
        board.order.push_back(job);
        board.tables.insert(
            job,
            Table {
                attempt,
                ..Table::default()
            },
        );
        while board.order.len() > MAX_JOBS {
            if let Some(oldest) = board.order.pop_front() {
                board.tables.remove(&oldest);
            }
        }
    }

    /// Records a run that started.
    pub fn started(&self, job: JobId, record: TaskRecord) {
        let mut board = self.lock();
        let Some(table) = board.tables.get_mut(&job) else {
            return;
        };
        if table.tasks.len() >= MAX_TASKS {
            // The oldest finished run goes; running ones stay, as the page shows them.
            match table
                .tasks
                .iter()
                .position(|task| task.state != TaskRunState::Running)
            {
                Some(at) => {
                    table.tasks.remove(at);
                    table.dropped += 1;
                }
                None => {
                    table.dropped += 1;
                    return;
                }
            }
        }
        table.tasks.push_back(record);
    }

    /// Records where run `task` was placed, before it ends.
    pub fn placed(&self, job: JobId, task: TaskId, node: NodeId) {
        if let Some(record) = self.lock().running(job, task) {
            record.node = Some(node);
        }
    }

    /// Records how run `task` ended.
    pub fn ended(&self, job: JobId, task: TaskId, end: RunEnd) {
        let mut board = self.lock();
        let Some(record) = board.running(job, task) else {
            return;
        };
        record.state = if end.error.is_none() {
            TaskRunState::Succeeded
        } else {
            TaskRunState::Failed
        };
        record.node = end.node.or(record.node);
        record.worker = end.worker;
        record.rows = end.rows;
        record.bytes = end.bytes;
        record.ended_ms = Some(end.ended_ms);
        record.error = end.error;
    }

    /// The jobs that have a table here, oldest first.
    pub fn jobs(&self) -> Vec<JobId> {
        self.lock().order.iter().copied().collect()
    }

    /// Drops `job`'s table: the job has left the scheduler's state.
    pub fn forget(&self, job: JobId) {
        let mut board = self.lock();
        board.tables.remove(&job);
        board.order.retain(|known| *known != job);
    }

    /// `job`'s table, if a driver of it ran here and it was not pushed out.
    pub fn table(&self, job: JobId) -> Option<TaskTable> {
        let board = self.lock();
        let table = board.tables.get(&job)?;
        Some(TaskTable {
            attempt: table.attempt,
            tasks: table.tasks.iter().cloned().collect(),
            dropped: table.dropped,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(task: u64, started_ms: u64) -> TaskRecord {
        TaskRecord {
            task: TaskId::new(u128::from(task)),
            operator: "map".into(),
            seq: task,
            attempt: 1,
            state: TaskRunState::Running,
            node: None,
            worker: None,
            rows: 0,
            bytes: 0,
            started_ms,
            ended_ms: None,
            error: None,
        }
    }

    #[test]
    fn a_run_is_recorded_from_start_to_end() {
        let board = TaskBoard::default();
        let job = JobId::new(1);
        board.start_job(job, 2);
        board.started(job, run(1, 100));
        board.started(job, run(2, 110));
        board.placed(job, TaskId::new(2), NodeId::new(4));
        assert_eq!(
            board.table(job).unwrap().tasks[1].node,
            Some(NodeId::new(4))
        );
        board.ended(
            job,
            TaskId::new(1),
            RunEnd {
                node: Some(NodeId::new(3)),
                worker: Some(WorkerRef { slot: 1, pid: 77 }),
                rows: 10,
                bytes: 80,
                ended_ms: 150,
                error: None,
            },
        );
        board.ended(
            job,
            TaskId::new(2),
            RunEnd {
                node: None,
                worker: None,
                rows: 0,
                bytes: 0,
                ended_ms: 160,
                error: Some("boom".into()),
            },
        );
        let table = board.table(job).unwrap();
        assert_eq!(table.attempt, 2);
        assert_eq!(table.tasks[0].state, TaskRunState::Succeeded);
        assert_eq!(table.tasks[0].node, Some(NodeId::new(3)));
        assert_eq!(table.tasks[0].worker, Some(WorkerRef { slot: 1, pid: 77 }));
        assert_eq!(table.tasks[0].rows, 10);
        assert_eq!(table.tasks[1].state, TaskRunState::Failed);
        assert_eq!(
            table.tasks[1].node,
            Some(NodeId::new(4)),
            "where it was placed"
        );
        assert_eq!(table.tasks[1].error.as_deref(), Some("boom"));
        assert!(board.table(JobId::new(2)).is_none());
    }

    #[test]
    fn a_forgotten_table_is_gone_and_makes_room() {
        let board = TaskBoard::default();
        for job in 1..=3 {
            board.start_job(JobId::new(job), 1);
        }
        board.forget(JobId::new(2));
        assert!(board.table(JobId::new(2)).is_none());
        assert_eq!(board.jobs(), vec![JobId::new(1), JobId::new(3)]);
        // A forgotten job no longer counts against the bound.
        for job in 4..=(MAX_JOBS as u64 + 1) {
            board.start_job(JobId::new(job), 1);
        }
        assert!(board.table(JobId::new(1)).is_some());
        assert_eq!(board.jobs().len(), MAX_JOBS);
    }

    #[test]
    fn tables_and_boards_stay_bounded() {
        let board = TaskBoard::default();
        let job = JobId::new(1);
        board.start_job(job, 1);
        for task in 0..(MAX_TASKS as u64 + 5) {
            board.started(job, run(task, task));
            if task > 0 {
                board.ended(
                    job,
                    TaskId::new(u128::from(task)),
                    RunEnd {
                        node: None,
                        worker: None,
                        rows: 1,
                        bytes: 1,
                        ended_ms: task,
                        error: None,
                    },
                );
            }
        }
        let table = board.table(job).unwrap();
        assert_eq!(table.tasks.len(), MAX_TASKS);
        assert_eq!(table.dropped, 5);
        // The one running run (task 0) stayed.
        assert_eq!(table.tasks[0].state, TaskRunState::Running);
        for other in 2..=(MAX_JOBS as u64 + 1) {
            board.start_job(JobId::new(other), 1);
        }
        assert!(board.table(job).is_none(), "the oldest job's table went");
        assert!(board.table(JobId::new(2)).is_some());
    }
}
