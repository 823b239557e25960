//! `GET /api/jobs/ID/tasks`: the runs of a job's tasks, from the task table its driver keeps
//! on the node that runs it (`NodeRequest::JobTasks`). A running job's driver node is in the
//! cluster state; a finished job's on the node this replica last saw running its driver, or
//! on every alive node when it never saw one (it stays on the driver's node while the job is
//! in the state, unless newer jobs push it out, see `floe_driver::tasks`).

use actix_web::{HttpResponse, web};
use floe_api::node_protocol::{NodeRequest, NodeResponse, TaskTable};
use floe_core::NodeId;
use serde::Serialize;

use super::api::{ApiError, Shared, parse_job_id, unknown_job};
use super::node_calls::call_all;

#[derive(Serialize)]
struct TaskJson {
    task: String,
    operator: String,
    seq: u64,
    attempt: u32,
    state: &'static str,
    node: Option<String>,
    /// The worker process that ran it (its slot on the node, and its pid), once it ended.
    worker: Option<WorkerJson>,
    rows: u64,
    bytes: u64,
    started_ms: u64,
    ended_ms: Option<u64>,
    /// To its end, or to now while it runs.
    duration_ms: u64,
    error: Option<String>,
}

#[derive(Serialize)]
struct WorkerJson {
    slot: u32,
    pid: u32,
}

#[derive(Serialize)]
struct TasksJson {
    job: String,
    /// Whether a node had the job's table: false once its driver's node is gone or the
    /// table was pushed out.
    available: bool,
    /// The node that keeps the table (the driver's).
    driver_node: Option<String>,
    /// The driver attempt whose runs these are.
    attempt: Option<u32>,
    /// Oldest first.
    tasks: Vec<TaskJson>,
    /// Finished runs left out, the oldest, to keep the table bounded.
    dropped: u64,
}

pub(super) async fn job_tasks(
    shared: web::Data<Shared>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let job = parse_job_id(&id)?;
    let state = shared.state();
    let record = state.jobs.get(&job).ok_or_else(|| unknown_job(job))?;
    let driver = record
        .driver
        .or_else(|| shared.monitor().snapshot().driver_seen.get(&job).copied());
    let nodes: Vec<(NodeId, String)> = match driver {
        Some(driver) => state
            .nodes
            .get(&driver)
            .filter(|node| node.is_alive())
            .map(|node| vec![(node.id, node.addresses.rpc.clone())])
            .unwrap_or_default(),
        None => state
            .alive_nodes()
            .map(|node| (node.id, node.addresses.rpc.clone()))
            .collect(),
    };
    let request = NodeRequest::JobTasks { job };
    // The newest attempt's table, where several nodes ran one.
    let found: Option<(NodeId, TaskTable)> = call_all(nodes, shared.node_wire(), &request)
        .await
        .into_iter()
        .filter_map(|(node, answer)| match answer {
            Ok(NodeResponse::Tasks(Some(table))) => Some((node, table)),
            Ok(_) => None,
            Err(error) => {
                tracing::debug!(%node, %error, "a node did not answer for a job's tasks");
                None
            }
        })
        .max_by_key(|(_, table)| table.attempt);
    let now = super::monitor::now_ms();
    let body = match found {
        Some((node, table)) => TasksJson {
            job: job.to_string(),
            available: true,
            driver_node: Some(node.to_string()),
            attempt: Some(table.attempt),
            dropped: table.dropped,
            tasks: table
                .tasks
                .into_iter()
                .map(|task| TaskJson {
                    task: task.task.to_string(),
                    operator: task.operator,
                    seq: task.seq,
                    attempt: task.attempt,
                    state: task.state.name(),
                    node: task.node.map(|node| node.to_string()),
                    worker: task.worker.map(|worker| WorkerJson {
                        slot: worker.slot,
                        pid: worker.pid,
                    }),
                    rows: task.rows,
                    bytes: task.bytes,
                    started_ms: task.started_ms,
                    ended_ms: task.ended_ms,
                    duration_ms: task.ended_ms.unwrap_or(now).saturating_sub(task.started_ms),
                    error: task.error,
                })
                .collect(),
        },
        None => TasksJson {
            job: job.to_string(),
            available: false,
            driver_node: None,
            attempt: None,
            dropped: 0,
            tasks: Vec::new(),
        },
    };
    Ok(HttpResponse::Ok().json(body))
}
