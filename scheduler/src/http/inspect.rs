//! `GET /api/actors` (the actors the cluster state records, with the calls and restarts
//! their drivers last reported), `GET /api/nodes/ID` (one node's record with what the node
//! itself says now: workers, running tasks, CPU and heap, its object store and largest
//! objects, UDF pools and the actors it hosts, asked of the node on demand) and
//! `GET /api/nodes/ID/history` (its chart points of the last hour, from the monitor).

use actix_web::{HttpResponse, web};
use floe_api::node_protocol::{NodeRequest, NodeResponse, NodeStatus};
use floe_api::state::DRIVER_ACTOR_KIND;
use floe_core::JobId;
use serde::{Deserialize, Serialize};

use super::api::{
    ApiError, Shared, history_minutes, node_json, parse_job_id, parse_node_id, unknown_node,
};
use super::json::{HistoryQuery, NodeJson};
use super::node_calls::call_all;
use floe_api::state as domain;

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
    /// For a job driver, the drivers started before this one; for an aggregator, the times
    /// its slot's actor was created again after one was gone (as its driver last reported).
    restarts: Option<u32>,
    /// Calls its driver sent it (an aggregator's pushes and reduces); null for drivers, which
    /// take none, and before the first progress report.
    calls: Option<u64>,
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
    let snapshot = shared.monitor().snapshot();
    let reported = |actor: &domain::ActorRecord| {
        snapshot
            .progress
            .get(&actor.job)
            .and_then(|progress| progress.actors.iter().find(|a| a.actor == actor.id))
    };
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
            restarts: if actor.kind == DRIVER_ACTOR_KIND {
                state
                    .jobs
                    .get(&actor.job)
                    .map(|job| job.attempts.saturating_sub(1))
            } else {
                reported(actor).map(|progress| progress.restarts)
            },
            calls: reported(actor).map(|progress| progress.calls),
        })
        .collect();
    actors.sort_by(|a, b| (a.job.len(), &a.job, &a.kind).cmp(&(b.job.len(), &b.job, &b.kind)));
    Ok(HttpResponse::Ok().json(ActorsJson { actors }))
}

#[derive(Serialize)]
struct RunningJson {
    task: String,
    worker_pid: u32,
    worker_slot: u32,
}

#[derive(Serialize)]
struct WorkerSlotJson {
    slot: u32,
    pid: Option<u32>,
    /// The task it runs now; null when idle.
    task: Option<String>,
}

#[derive(Serialize)]
struct ObjectJson {
    object: String,
    size_bytes: u64,
    /// `memory`, `spilled` or `fallback`.
    residence: &'static str,
    pins: u64,
    job: Option<String>,
}

#[derive(Serialize)]
struct UdfProcessJson {
    pid: u32,
    /// `leased` (to a task) or `idle`.
    state: &'static str,
}

#[derive(Serialize)]
struct UdfPoolJson {
    command: String,
    min: u32,
    max: u32,
    starting: u32,
    processes: Vec<UdfProcessJson>,
}

#[derive(Serialize)]
struct StoreJson {
    capacity_bytes: u64,
    used_bytes: u64,
    objects_in_memory: u64,
    pinned_bytes: u64,
    pinned_objects: u64,
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
    /// Object bytes pulled from other nodes on this host by reading their segments.
    borrowed_bytes: u64,
    /// The node's process tree's CPU use, as a share of its CPUs (0 to 1).
    cpu_utilization: f64,
    heap_used_bytes: u64,
    store: StoreJson,
    /// Largest first.
    largest_objects: Vec<ObjectJson>,
    worker_slots: Vec<WorkerSlotJson>,
    udf_pools: Vec<UdfPoolJson>,
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
                worker_slot: task.worker_slot,
            })
            .collect(),
        cpu_utilization: f64::from(status.cpu_used_permille) / 1000.0,
        heap_used_bytes: status.heap_used_bytes,
        largest_objects: status
            .largest_objects
            .iter()
            .map(|object| ObjectJson {
                object: object.object.to_string(),
                size_bytes: object.size,
                residence: object.residence.name(),
                pins: object.pins,
                job: object.job.map(|job| job.to_string()),
            })
            .collect(),
        worker_slots: status
            .worker_slots
            .iter()
            .map(|slot| WorkerSlotJson {
                slot: slot.slot,
                pid: slot.pid,
                task: slot.task.map(|task| task.to_string()),
            })
            .collect(),
        udf_pools: status
            .udf_pools
            .into_iter()
            .map(|pool| UdfPoolJson {
                command: pool.command,
                min: pool.min,
                max: pool.max,
                starting: pool.starting,
                processes: pool
                    .processes
                    .iter()
                    .map(|process| UdfProcessJson {
                        pid: process.pid,
                        state: if process.leased { "leased" } else { "idle" },
                    })
                    .collect(),
            })
            .collect(),
        tasks_finished: status.tasks_finished,
        tasks_failed: status.tasks_failed,
        workers_respawned: status.workers_respawned,
        pulls_started: status.pulls_started,
        borrowed_bytes: status.borrowed_bytes,
        store: StoreJson {
            capacity_bytes: store.capacity,
            used_bytes: store.used,
            objects_in_memory: store.objects_in_memory,
            pinned_bytes: store.pinned_bytes,
            pinned_objects: store.pinned_objects,
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

#[derive(Serialize)]
struct NodeSampleJson {
    time_ms: u64,
    tasks_running: u32,
    rows_per_s: f64,
    spilled_bytes: u64,
    network_bytes_per_s: f64,
    cpu_utilization: f64,
}

#[derive(Serialize)]
struct NodeHistoryJson {
    node: String,
    /// One point per this many milliseconds.
    interval_ms: u64,
    samples: Vec<NodeSampleJson>,
}

/// `GET /api/nodes/ID/history?minutes=N`: the node's chart points of the last `minutes`
/// (1 to 60, default 60), oldest first.
pub(super) async fn node_history(
    shared: web::Data<Shared>,
    id: web::Path<String>,
    query: web::Query<HistoryQuery>,
) -> Result<HttpResponse, ApiError> {
    let node = parse_node_id(&id)?;
    let minutes = history_minutes(query.minutes.unwrap_or(60))?;
    if !shared.state().nodes.contains_key(&node) {
        return Err(unknown_node(node));
    }
    let since = super::monitor::now_ms().saturating_sub(minutes * 60_000);
    let samples = shared
        .monitor()
        .node_history(node)
        .into_iter()
        .filter(|sample| sample.time_ms >= since)
        .map(|sample| NodeSampleJson {
            time_ms: sample.time_ms,
            tasks_running: sample.tasks_running,
            rows_per_s: f64::from(sample.rows_per_s),
            spilled_bytes: sample.spilled_bytes,
            network_bytes_per_s: f64::from(sample.network_bytes_per_s),
            cpu_utilization: f64::from(sample.cpu_used_permille) / 1000.0,
        })
        .collect();
    Ok(HttpResponse::Ok().json(NodeHistoryJson {
        node: node.to_string(),
        interval_ms: super::monitor::NODE_SAMPLE_MS,
        samples,
    }))
}
