//! `GET /api/actors` (the actors the cluster state records) and `GET /api/nodes/ID` (one
//! node's record with what the node itself says now: workers, running tasks, its object
//! store and the actors it hosts, asked of the node on demand).

use actix_web::{HttpResponse, web};
use floe_api::node_protocol::{NodeRequest, NodeResponse, NodeStatus};
use floe_api::state::DRIVER_ACTOR_KIND;
use floe_core::JobId;
use serde::{Deserialize, Serialize};

use super::api::{ApiError, Shared, node_json, parse_job_id, parse_node_id, unknown_node};
use super::json::NodeJson;
use super::node_calls::call_all;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ActorsQuery {
    job: Option<String>,
}

#[derive(Serialize)]
struct ActorJson {
    id: String,
    kind: String,
    job: String,
    node: String,
    /// `alive` while its node is, else `lost` (it goes from the state with its job, or is
    /// created again elsewhere).
    state: &'static str,
    /// For a job driver, the drivers started before this one; not known for other kinds.
    restarts: Option<u32>,
}

#[derive(Serialize)]
struct ActorsJson {
    actors: Vec<ActorJson>,
}

pub(super) async fn actors(
    shared: web::Data<Shared>,
    query: web::Query<ActorsQuery>,
) -> Result<HttpResponse, ApiError> {
    let job: Option<JobId> = query.job.as_deref().map(parse_job_id).transpose()?;
    let state = shared.state();
    let mut actors: Vec<ActorJson> = state
        .actors
        .values()
        .filter(|actor| job.is_none_or(|job| actor.job == job))
        .map(|actor| ActorJson {
            id: actor.id.to_string(),
            kind: actor.kind.clone(),
            job: actor.job.to_string(),
            node: actor.node.to_string(),
            state: if state
                .nodes
                .get(&actor.node)
                .is_some_and(|node| node.is_alive())
            {
                "alive"
            } else {
                "lost"
            },
            restarts: (actor.kind == DRIVER_ACTOR_KIND)
                .then(|| state.jobs.get(&actor.job))
                .flatten()
                .map(|job| job.attempts.saturating_sub(1)),
        })
        .collect();
    actors.sort_by(|a, b| (a.job.len(), &a.job, &a.kind).cmp(&(b.job.len(), &b.job, &b.kind)));
    Ok(HttpResponse::Ok().json(ActorsJson { actors }))
}

#[derive(Serialize)]
struct RunningJson {
    task: String,
    worker_pid: u32,
}

#[derive(Serialize)]
struct StoreJson {
    capacity_bytes: u64,
    used_bytes: u64,
    objects_in_memory: u64,
    spilled_bytes: u64,
    spilled_objects: u64,
    spilled_bytes_total: u64,
    restored_bytes_total: u64,
    fallback_bytes: u64,
    fallback_objects: u64,
}

#[derive(Serialize)]
struct LiveJson {
    workers: u32,
    running: Vec<RunningJson>,
    tasks_finished: u64,
    tasks_failed: u64,
    workers_respawned: u64,
    pulls_started: u64,
    store: StoreJson,
    actors: Vec<String>,
}

#[derive(Serialize)]
struct NodeDetailJson {
    #[serde(flatten)]
    node: NodeJson,
    /// What the node answered now; null when it is dead or did not answer (`live_error`).
    live: Option<LiveJson>,
    live_error: Option<String>,
}

fn live_json(status: NodeStatus) -> LiveJson {
    let store = status.store;
    LiveJson {
        workers: status.workers,
        running: status
            .running
            .into_iter()
            .map(|task| RunningJson {
                task: task.task.to_string(),
                worker_pid: task.worker_pid,
            })
            .collect(),
        tasks_finished: status.tasks_finished,
        tasks_failed: status.tasks_failed,
        workers_respawned: status.workers_respawned,
        pulls_started: status.pulls_started,
        store: StoreJson {
            capacity_bytes: store.capacity,
            used_bytes: store.used,
            objects_in_memory: store.objects_in_memory,
            spilled_bytes: store.spilled_bytes,
            spilled_objects: store.spilled_objects,
            spilled_bytes_total: store.spilled_bytes_total,
            restored_bytes_total: store.restored_bytes_total,
            fallback_bytes: store.fallback_bytes,
            fallback_objects: store.fallback_objects,
        },
        actors: status.actors.iter().map(ToString::to_string).collect(),
    }
}

pub(super) async fn node(
    shared: web::Data<Shared>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let node = parse_node_id(&id)?;
    let snapshot = shared.monitor().snapshot();
    let state = shared.state();
    let record = state.nodes.get(&node).ok_or_else(|| unknown_node(node))?;
    let (live, live_error) = if record.is_alive() {
        let asked = vec![(node, record.addresses.rpc.clone())];
        match call_all(asked, shared.node_wire(), &NodeRequest::Status)
            .await
            .pop()
        {
            Some((_, Ok(NodeResponse::Status(status)))) => (Some(live_json(*status)), None),
            Some((_, Ok(other))) => (None, Some(format!("unexpected answer {other:?}"))),
            Some((_, Err(error))) => (None, Some(error)),
            None => (None, Some("the call ended early".to_owned())),
        }
    } else {
        (None, Some(format!("node {node} is dead")))
    };
    Ok(HttpResponse::Ok().json(NodeDetailJson {
        node: node_json(record, &snapshot),
        live,
        live_error,
    }))
}
