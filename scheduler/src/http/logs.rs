//! `GET /api/nodes/ID/logs` and `GET /api/jobs/ID/logs`: log lines fetched on demand from
//! the nodes' log files (`NodeRequest::ReadLogs`), calling them as a cluster member. The
//! caller's `read` token was checked before the handler runs; the nodes never see it.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, web};
use floe_api::node_protocol::{LogLevel, LogLine, LogQuery, NodeRequest, NodeResponse};
use floe_core::wire::WireConfig;
use floe_core::{JobId, NodeId};
use serde::{Deserialize, Serialize};

use super::api::{ApiError, Shared, parse_job_id, parse_node_id, unknown_job, unknown_node};
use super::node_calls::call_all;

/// Lines answered when `tail` is not given, and the most `tail` may ask for.
const DEFAULT_TAIL: u32 = 200;
const MAX_TAIL: u32 = 5_000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LogsQuery {
    tail: Option<u32>,
    /// Only lines containing this text (case-insensitive).
    q: Option<String>,
    /// Only lines at this level or more severe: trace, debug, info, warn, error.
    level: Option<String>,
}

#[derive(Serialize)]
struct LineJson {
    node: String,
    source: String,
    time: Option<String>,
    level: Option<&'static str>,
    text: String,
}

#[derive(Serialize)]
struct Unreachable {
    node: String,
    error: String,
}

#[derive(Serialize)]
struct LogsJson {
    /// Oldest first.
    lines: Vec<LineJson>,
    /// Nodes asked that did not answer.
    unreachable: Vec<Unreachable>,
}

impl LogsQuery {
    fn to_query(&self, job: Option<JobId>) -> Result<LogQuery, ApiError> {
        let tail = self.tail.unwrap_or(DEFAULT_TAIL);
        if tail == 0 || tail > MAX_TAIL {
            return Err(ApiError::bad_request(format!(
                "tail must be 1 to {MAX_TAIL}, not {tail}"
            )));
        }
        let level = match self.level.as_deref() {
            None | Some("") => None,
            Some(text) => Some(LogLevel::parse(text).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "unknown level {text:?}; use trace, debug, info, warn or error"
                ))
            })?),
        };
        Ok(LogQuery {
            job,
            tail,
            text: self.q.clone().filter(|text| !text.is_empty()),
            level,
        })
    }
}

pub(super) async fn node_logs(
    shared: web::Data<Shared>,
    id: web::Path<String>,
    query: web::Query<LogsQuery>,
) -> Result<HttpResponse, ApiError> {
    let node = parse_node_id(&id)?;
    let query = query.to_query(None)?;
    let state = shared.state();
    let record = state.nodes.get(&node).ok_or_else(|| unknown_node(node))?;
    if !record.is_alive() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("node {node} is dead: its logs are on its host's disk only"),
        ));
    }
    let addr = record.addresses.rpc.clone();
    let tail = query.tail;
    let answer = read_from(vec![(node, addr)], shared.node_wire(), query, tail).await;
    if let Some(failure) = answer.unreachable.first() {
        return Err(ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!("node {node} did not answer: {}", failure.error),
        ));
    }
    Ok(HttpResponse::Ok().json(answer))
}

pub(super) async fn job_logs(
    shared: web::Data<Shared>,
    id: web::Path<String>,
    query: web::Query<LogsQuery>,
) -> Result<HttpResponse, ApiError> {
    let job = parse_job_id(&id)?;
    let query = query.to_query(Some(job))?;
    let state = shared.state();
    if !state.jobs.contains_key(&job) {
        return Err(unknown_job(job));
    }
    // A job's driver and tasks may have run on any node, so every alive one is asked.
    let nodes = state
        .alive_nodes()
        .map(|node| (node.id, node.addresses.rpc.clone()))
        .collect();
    let tail = query.tail;
    Ok(HttpResponse::Ok().json(read_from(nodes, shared.node_wire(), query, tail).await))
}

/// Asks `nodes` at once for their lines matching `query`, and merges the answers by time.
async fn read_from(
    nodes: Vec<(NodeId, String)>,
    wire: &WireConfig,
    query: LogQuery,
    tail: u32,
) -> LogsJson {
    let request = NodeRequest::ReadLogs(query);
    let mut lines: Vec<(NodeId, LogLine)> = Vec::new();
    let mut unreachable = Vec::new();
    for (node, answer) in call_all(nodes, wire, &request).await {
        match answer {
            Ok(NodeResponse::Logs(answer)) => {
                lines.extend(answer.into_iter().map(|line| (node, line)));
            }
            Ok(other) => unreachable.push(Unreachable {
                node: node.to_string(),
                error: format!("unexpected answer {other:?}"),
            }),
            Err(error) => unreachable.push(Unreachable {
                node: node.to_string(),
                error,
            }),
        }
    }
    // Stable, and by node first, so each node's lines without a time keep their order.
    lines.sort_by_key(|(node, _)| *node);
    lines.sort_by(|a, b| a.1.time.cmp(&b.1.time));
    if lines.len() > tail as usize {
        lines.drain(..lines.len() - tail as usize);
    }
    unreachable.sort_by(|a, b| a.node.cmp(&b.node));
    LogsJson {
        lines: lines
            .into_iter()
            .map(|(node, line)| LineJson {
                node: node.to_string(),
                source: line.source,
                time: line.time,
                level: line.level.map(LogLevel::name),
                text: line.text,
            })
            .collect(),
        unreachable,
    }
}
