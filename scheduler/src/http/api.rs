//! The JSON endpoints. Reads answer from the monitor's latest snapshot; mutations go to the
//! leader with the caller's own token. [`authenticate`] checks every call's token and scope
//! before a handler runs. The request and response types they use are in `json`.

use std::collections::BTreeMap;
use std::sync::Arc;

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap};
use actix_web::http::{Method, StatusCode};
use actix_web::middleware::Next;
use actix_web::{HttpMessage as _, HttpRequest, HttpResponse, ResponseError, web};
use floe_api::node_protocol::{NodeProtocol, NodeRequest};
use floe_core::auth::{Authenticator, ClientToken, Credential, Principal, Scope};
use floe_core::job::{CacheMode, JobProgress, JobSpec};
use floe_core::wire::{RemoteErrorKind, RpcClient, WireConfig, WireError};
use floe_core::{JobId, NodeId, SubmissionId};
use tokio::sync::watch;

use super::history_index::{HistoryFilter, HistoryIndex};
use super::json::{
    CacheEntryJson, CacheJson, CleanBody, Cleaned, ClusterJson, Deleted, ErrorBody, EventJson,
    EventsJson, EventsQuery, HistoryJson, HistoryQuery, JobDetail, JobItems, JobSummary, LeaseJson,
    ListQuery, MemoryJson, NodeCounts, NodeItems, NodeJson, OptionsJson, OutputJson, Page,
    ProgressJson, ReplicaJson, SampleJson, StatsJson, Stopped, StoreTotals, SubmitBody, Submitted,
    UsageJson, Version,
};
use super::monitor::{Monitor, Snapshot, now_ms};
use super::{HttpConfig, JobSpecParser};
use floe_api::client::SchedulerClient;
use floe_api::state::{
    self as domain, ClusterState, Command, JobRecord, JobStatus, Liveness, NodeRecord, Outcome,
};

/// The largest request body accepted (a job spec is a few kilobytes).
pub(crate) const MAX_BODY_BYTES: usize = 1 << 20;
/// How long a mutation may keep looking for a leader.
const MUTATION_RETRY: std::time::Duration = std::time::Duration::from_secs(10);
const JOB_STATES: [&str; 5] = ["pending", "running", "succeeded", "failed", "cancelled"];
/// How long a mutation waits for this replica to apply it, so a client that reads right
/// after writing (on the same replica) sees its write.
const READ_YOUR_WRITES: std::time::Duration = std::time::Duration::from_secs(3);
/// A node whose last heartbeat is older than this makes the cluster `degraded`.
const LATE_HEARTBEAT_MS: u64 = 5_000;

pub(crate) struct Shared {
    monitor: Arc<Monitor>,
    /// This replica's applied state, fresher than the monitor's snapshot: what the replicated
    /// state says is read from here, the leader's soft state from the snapshot.
    applied_state: watch::Receiver<Arc<ClusterState>>,
    parser: Arc<dyn JobSpecParser>,
    authenticator: Arc<Authenticator>,
    /// `http.public_reads`: reads need no token.
    public_reads: bool,
    replica_id: u64,
    /// Every replica's RPC address: each mutation gets its own client of them, so a slow
    /// one (no leader yet) never queues the others behind it.
    replicas: Vec<String>,
    wire: WireConfig,
    /// How to call nodes: as a cluster member.
    node_wire: WireConfig,
    /// The index of this replica's job history file, listed by `/api/jobs?all=true`.
    job_history: Option<Arc<HistoryIndex>>,
}

impl Shared {
    pub fn new(
        config: &HttpConfig,
        monitor: Arc<Monitor>,
        applied_state: watch::Receiver<Arc<ClusterState>>,
        parser: Arc<dyn JobSpecParser>,
    ) -> Self {
        Self {
            monitor,
            applied_state,
            parser,
            authenticator: Arc::clone(&config.wire.authenticator),
            public_reads: config.public_reads,
            replica_id: config.replica_id,
            replicas: config.peers.values().cloned().collect(),
            wire: config.wire.clone(),
            node_wire: config.node_wire.clone(),
            job_history: config
                .job_history
                .clone()
                .map(|path| Arc::new(HistoryIndex::new(path))),
        }
    }

    /// A client for one mutation, presenting the caller's own token (the leader checks it
    /// again); it finds the leader itself.
    fn leader(&self, caller: &Caller) -> Result<SchedulerClient, ApiError> {
        let wire = self.wire.with_credential(Credential::Client {
            token: caller.token.clone(),
        });
        SchedulerClient::new(self.replicas.clone(), wire)
            .map(|client| client.with_retry_for(MUTATION_RETRY))
            .map_err(ApiError::from_scheduler)
    }

    /// Commits `command` through the leader as the caller.
    async fn propose_as(&self, caller: &Caller, command: Command) -> Result<Outcome, ApiError> {
        self.leader(caller)?
            .propose(command)
            .await
            .map_err(ApiError::from_scheduler)
    }

    /// How to call nodes: as a cluster member.
    pub fn node_wire(&self) -> &WireConfig {
        &self.node_wire
    }

    pub fn monitor(&self) -> &Monitor {
        &self.monitor
    }

    pub fn replica_id(&self) -> u64 {
        self.replica_id
    }

    pub fn state(&self) -> Arc<ClusterState> {
        Arc::clone(&self.applied_state.borrow())
    }

    /// Waits (a bounded time) until this replica has applied what `applied` looks for.
    async fn wait_applied(&self, applied: impl Fn(&ClusterState) -> bool) {
        let mut state = self.applied_state.clone();
        let _ =
            tokio::time::timeout(READ_YOUR_WRITES, state.wait_for(|state| applied(state))).await;
    }

    /// The caller of a request that needs `scope`: its token must be known and grant it.
    fn authorize(&self, headers: &HeaderMap, scope: Scope) -> Result<Caller, ApiError> {
        let presented = headers
            .get(AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|token| !token.is_empty());
        let Some(presented) = presented else {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                format!(
                    "this call needs a token with scope {scope}: send `Authorization: Bearer \
                     <token>` (tokens come from `floe token create`)"
                ),
            ));
        };
        let token = ClientToken::new(presented);
        let principal = self
            .authenticator
            .verify_token(&token)
            .map_err(|refused| ApiError::new(StatusCode::UNAUTHORIZED, refused.0))?;
        if !principal.has_scope(scope) {
            let name = match &principal {
                Principal::Client { name, .. } => name.as_str(),
                _ => "?",
            };
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                format!("token '{name}' lacks scope {scope}, which this call needs"),
            ));
        }
        Ok(Caller { token })
    }
}

/// The verified caller of a request, for handlers that act in its name.
#[derive(Clone)]
pub(crate) struct Caller {
    token: ClientToken,
}

/// The scope a request needs: reads `read` (none with `http.public_reads`), job changes
/// `submit`, cache cleaning `admin`; the dashboard's own files and `/api/version` (what
/// health checks probe; it says nothing about the cluster) none.
fn required_scope(method: &Method, path: &str, public_reads: bool) -> Option<Scope> {
    let api = path == "/api" || path.starts_with("/api/") || path == "/metrics";
    if !api || (path == "/api/version" && *method == Method::GET) {
        return None;
    }
    if *method == Method::GET || *method == Method::HEAD {
        return (!public_reads).then_some(Scope::Read);
    }
    if path == "/api/cache/clean" {
        Some(Scope::Admin)
    } else {
        Some(Scope::Submit)
    }
}

/// Middleware: refuses a call whose token is missing or unknown (401) or lacks the scope the
/// route needs (403) before its handler runs, and hands handlers the verified [`Caller`].
pub(crate) async fn authenticate(
    request: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody + 'static>>, actix_web::Error> {
    let Some(shared) = request.app_data::<web::Data<Shared>>().cloned() else {
        return Err(actix_web::error::ErrorInternalServerError(
            "the API's state is missing",
        ));
    };
    if let Some(scope) = required_scope(request.method(), request.path(), shared.public_reads) {
        match shared.authorize(request.headers(), scope) {
            Ok(caller) => {
                request.extensions_mut().insert(caller);
            }
            Err(error) => {
                return Ok(request.error_response(error).map_into_right_body());
            }
        }
    }
    next.call(request)
        .await
        .map(ServiceResponse::map_into_left_body)
}

/// An error answered as `{"error": …}` with its status.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub(super) fn status(&self) -> StatusCode {
        self.status
    }

    pub(super) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// A scheduler error: 503 when no leader answered (worth retrying), 403 when the leader
    /// refused the caller's rights, 500 otherwise.
    fn from_scheduler(error: floe_api::Error) -> Self {
        match error {
            floe_api::Error::Wire(WireError::Remote(remote))
                if remote.kind == RemoteErrorKind::Forbidden =>
            {
                Self::new(StatusCode::FORBIDDEN, remote.message)
            }
            floe_api::Error::NoReplica(_) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("no scheduler leader answered; try again shortly: {error}"),
            ),
            error => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the scheduler refused the change: {error}"),
            ),
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        HttpResponse::build(self.status).json(ErrorBody {
            error: &self.message,
        })
    }
}

type Reply = Result<HttpResponse, ApiError>;

pub(crate) fn routes(config: &mut web::ServiceConfig) {
    // A query string that does not parse is a 400 in the same JSON shape as every error.
    let query = web::QueryConfig::default().error_handler(|error, _| {
        ApiError::bad_request(format!("bad query string: {error}")).into()
    });
    config
        .app_data(query)
        .route("/api/version", web::get().to(version))
        .route("/api/cluster", web::get().to(cluster))
        .route("/api/nodes", web::get().to(nodes))
        .route("/api/nodes/{id}", web::get().to(super::inspect::node))
        .route("/api/actors", web::get().to(super::inspect::actors))
        .route(
            "/api/nodes/{id}/logs",
            web::get().to(super::logs::node_logs),
        )
        .route(
            "/api/nodes/{id}/history",
            web::get().to(super::inspect::node_history),
        )
        .route("/api/jobs", web::get().to(jobs))
        .route("/api/jobs", web::post().to(submit))
        .route("/api/jobs/{id}", web::get().to(job))
        .route("/api/jobs/{id}", web::delete().to(delete_job))
        .route("/api/jobs/{id}/stop", web::post().to(stop))
        .route("/api/jobs/{id}/logs", web::get().to(super::logs::job_logs))
        .route(
            "/api/jobs/{id}/tasks",
            web::get().to(super::tasks::job_tasks),
        )
        .route(
            "/api/jobs/{id}/result",
            web::get().to(super::result::job_result),
        )
        .route("/api/cache", web::get().to(cache))
        .route("/api/cache/clean", web::post().to(clean_cache))
        .route("/api/events", web::get().to(events))
        .route("/api/history", web::get().to(history))
        .route("/metrics", web::get().to(super::metrics::metrics))
        .default_service(web::to(not_found));
}

async fn not_found(request: HttpRequest) -> Reply {
    Err(ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "no such endpoint: {} {}; see docs/HTTP_API.md",
            request.method(),
            request.path()
        ),
    ))
}

async fn version() -> HttpResponse {
    HttpResponse::Ok().json(Version {
        version: env!("CARGO_PKG_VERSION"),
        api: 1,
    })
}

// ---- cluster --------------------------------------------------------------------------

/// `ok`, `degraded` or `down`, as `docs/HTTP_API.md` defines them.
pub(crate) fn health(snapshot: &Snapshot, state: &ClusterState) -> &'static str {
    if snapshot.leader.is_none() {
        return "down";
    }
    let replica_missing = snapshot.replicas.iter().any(|r| r.status.is_none());
    let node_late = state.alive_nodes().any(|node| {
        snapshot
            .reports
            .get(&node.id)
            .is_none_or(|report| report.age_ms > LATE_HEARTBEAT_MS)
    });
    if replica_missing || !snapshot.leader_answered || node_late {
        "degraded"
    } else {
        "ok"
    }
}

/// The jobs in each status, from the counts `apply` keeps (no scan).
pub(crate) fn job_counts(state: &ClusterState) -> BTreeMap<&'static str, u64> {
    state.job_counts.by_name().into_iter().collect()
}

async fn cluster(shared: web::Data<Shared>) -> HttpResponse {
    let snapshot = shared.monitor.snapshot();
    let state = shared.state();
    let alive: Vec<&NodeRecord> = state.alive_nodes().collect();
    let reports = || {
        alive
            .iter()
            .filter_map(|node| snapshot.reports.get(&node.id))
    };
    let body = ClusterJson {
        health: health(&snapshot, &state),
        leader: snapshot.leader,
        as_of_index: state.applied_index,
        replica_id: shared.replica_id,
        replicas: snapshot
            .replicas
            .iter()
            .map(|replica| ReplicaJson {
                id: replica.id,
                addr: replica.addr.clone(),
                reachable: replica.status.is_some(),
                leader: replica.status.as_ref().and_then(|status| status.leader),
                term: replica.status.as_ref().map(|status| status.term),
                commit: replica.status.as_ref().map(|status| status.commit),
                applied: replica.status.as_ref().map(|status| status.applied),
            })
            .collect(),
        nodes: NodeCounts {
            alive: alive.len() as u64,
            dead: (state.nodes.len() - alive.len()) as u64,
        },
        jobs: job_counts(&state),
        object_store: StoreTotals {
            used_bytes: reports().map(|r| r.usage.object_store_bytes).sum(),
            capacity_bytes: alive.iter().map(|n| n.memory.object_store_bytes).sum(),
        },
        spilled_bytes: reports().map(|r| r.usage.spilled_bytes).sum(),
        fallback_bytes: reports().map(|r| r.usage.fallback_bytes).sum(),
    };
    HttpResponse::Ok().json(body)
}

// ---- nodes ----------------------------------------------------------------------------

pub(super) fn node_json(node: &NodeRecord, snapshot: &Snapshot) -> NodeJson {
    let report = node
        .is_alive()
        .then(|| snapshot.reports.get(&node.id))
        .flatten();
    NodeJson {
        id: node.id.to_string(),
        addr: node.addresses.rpc.clone(),
        state: if node.is_alive() { "alive" } else { "dead" },
        dead_reason: match &node.liveness {
            Liveness::Dead { reason, .. } => Some(reason.clone()),
            Liveness::Alive => None,
        },
        cpus: node.resources.cpu_millis as f64 / 1000.0,
        labels: node.labels.clone(),
        memory: MemoryJson {
            total_bytes: node.memory.total_bytes,
            object_store_bytes: node.memory.object_store_bytes,
            system_reserve_bytes: node.memory.system_reserve_bytes,
            heap_bytes: node.resources.heap_bytes,
        },
        usage: report.map(|report| UsageJson {
            cpu_reserved: report.reserved.cpu_millis as f64 / 1000.0,
            heap_reserved_bytes: report.reserved.heap_bytes,
            leases: report
                .leases
                .iter()
                .map(|summary| LeaseJson {
                    job: Some(summary.job.to_string()),
                    node: None,
                    leases: summary.leases,
                    recalled: summary.recalled,
                    cpus: summary.resources.cpu_millis as f64 / 1000.0,
                    heap_bytes: summary.resources.heap_bytes,
                })
                .collect(),
            heap_used_bytes: report.usage.heap_bytes,
            object_store_used_bytes: report.usage.object_store_bytes,
            spilled_bytes: report.usage.spilled_bytes,
            fallback_bytes: report.usage.fallback_bytes,
            workers_busy: report.usage.workers_busy,
            workers: report.usage.workers,
        }),
        heartbeat_age_ms: report.map(|report| report.age_ms),
    }
}

async fn nodes(shared: web::Data<Shared>, query: web::Query<ListQuery>) -> Reply {
    if query.all.is_some() {
        return Err(ApiError::bad_request(
            "`all` lists jobs from the history; nodes have none",
        ));
    }
    let wanted = match query.state.as_deref() {
        None | Some("" | "all") => None,
        Some(state @ ("alive" | "dead")) => Some(state == "alive"),
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "unknown node state {other:?}; use alive or dead"
            )));
        }
    };
    let snapshot = shared.monitor.snapshot();
    let state = shared.state();
    let (offset, limit) = query.page(100);
    let matching = || {
        state
            .nodes
            .values()
            .filter(|node| wanted.is_none_or(|alive| node.is_alive() == alive))
    };
    let body = Page {
        total: matching().count(),
        offset,
        limit,
        items: NodeItems {
            nodes: matching()
                .skip(offset)
                .take(limit)
                .map(|node| node_json(node, &snapshot))
                .collect(),
        },
    };
    Ok(HttpResponse::Ok().json(body))
}

// ---- jobs -----------------------------------------------------------------------------

fn error_text(status: &JobStatus) -> Option<String> {
    match status {
        JobStatus::Failed { message } => Some(message.clone()),
        _ => None,
    }
}

fn operator_names(job: &JobRecord, progress: Option<&JobProgress>) -> Vec<String> {
    match (&job.stats, progress) {
        (Some(stats), _) => stats.operators.iter().map(|op| op.name.clone()).collect(),
        (None, Some(progress)) => progress
            .operators
            .iter()
            .map(|op| op.name.clone())
            .collect(),
        (None, None) => Vec::new(),
    }
}

/// The rows of the output the job holds; none once it was released.
fn output_rows(job: &JobRecord) -> Option<u64> {
    (job.status == JobStatus::Succeeded && job.release.is_none())
        .then(|| job.outputs.iter().map(|b| b.rows).sum())
}

fn job_summary(job: &JobRecord, snapshot: &Snapshot) -> JobSummary {
    JobSummary {
        id: job.id.to_string(),
        name: job.name.clone(),
        state: job.status.name(),
        attempts: job.attempts,
        driver_node: job.driver.map(|node| node.to_string()),
        error: error_text(&job.status),
        submission_id: job.submission.to_string(),
        operators: operator_names(job, snapshot.progress.get(&job.id)),
        wall_ms: job.stats.as_ref().map(|stats| stats.wall_ms),
        output_rows: output_rows(job),
        submitted_at_ms: job.submitted_at_ms,
        started_at_ms: job.started_at_ms,
        ended_at_ms: job.ended_at_ms,
        output_released: job.release.map(|release| release.to_string()),
        removed: None,
    }
}

/// A job listed from the history.
fn history_summary(job: &domain::JobSummary) -> JobSummary {
    JobSummary {
        id: job.id.to_string(),
        name: job.name.clone(),
        state: job.status.name(),
        attempts: job.attempts,
        driver_node: None,
        error: error_text(&job.status),
        submission_id: job.submission.to_string(),
        operators: job
            .stats
            .iter()
            .flat_map(|stats| &stats.operators)
            .map(|op| op.name.clone())
            .collect(),
        wall_ms: job.stats.as_ref().map(|stats| stats.wall_ms),
        output_rows: None,
        submitted_at_ms: job.submitted_at_ms,
        started_at_ms: job.started_at_ms,
        ended_at_ms: job.ended_at_ms,
        output_released: job.release.map(|release| release.to_string()),
        removed: Some(match job.removal {
            domain::Removal::Deleted => "deleted",
            domain::Removal::Pruned => "pruned",
        }),
    }
}

async fn jobs(shared: web::Data<Shared>, query: web::Query<ListQuery>) -> Reply {
    let wanted = match query.state.as_deref() {
        None | Some("" | "all") => None,
        Some(state) if JOB_STATES.contains(&state) => Some(state),
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "unknown job state {other:?}; use one of {}",
                JOB_STATES.join(", ")
            )));
        }
    };
    let snapshot = shared.monitor.snapshot();
    let state = shared.state();
    let (offset, limit) = query.page(50);
    let matching = || {
        state
            .jobs
            .values()
            .rev()
            .filter(|job| wanted.is_none_or(|state| job.status.name() == state))
            .filter(|job| query.name_matches(job.name.as_deref()))
    };
    // The counts `apply` keeps give the total; only a name filter needs a scan.
    let mut total = match (&query.name, wanted) {
        (None, None) => state.job_counts.total() as usize,
        (None, Some(wanted)) => state.job_counts.named(wanted).unwrap_or(0) as usize,
        (Some(_), _) => matching().count(),
    };
    let mut jobs: Vec<JobSummary> = matching()
        .skip(offset)
        .take(limit)
        .map(|job| job_summary(job, &snapshot))
        .collect();
    // The history follows the live jobs, newest first, each job once; its index counts and
    // picks the page, and only the lines shown are read.
    if query.all == Some(true)
        && let Some(history) = shared.job_history.clone()
    {
        let skip = offset.saturating_sub(total);
        let take = limit - jobs.len();
        let live = Arc::clone(&state);
        let wanted = wanted.map(str::to_owned);
        let name = query.name.clone();
        let page = web::block(move || {
            let filter = HistoryFilter {
                state: wanted.as_deref(),
                name: name.as_deref(),
            };
            history.page(filter, |job| live.jobs.contains_key(&job), skip, take)
        })
        .await
        .map_err(|error| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?
        .map_err(|error| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?;
        jobs.extend(page.jobs.iter().map(history_summary));
        total += page.total;
    }
    let body = Page {
        total,
        offset,
        limit,
        items: JobItems {
            counts: job_counts(&state),
            jobs,
        },
    };
    Ok(HttpResponse::Ok().json(body))
}

pub(super) fn parse_job_id(text: &str) -> Result<JobId, ApiError> {
    text.parse()
        .map_err(|_| ApiError::bad_request(format!("{text:?} is not a job id (a number)")))
}

pub(super) fn parse_node_id(text: &str) -> Result<NodeId, ApiError> {
    text.parse()
        .map_err(|_| ApiError::bad_request(format!("{text:?} is not a node id (a number)")))
}

pub(super) fn unknown_node(node: NodeId) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("there is no node {node}"))
}

pub(super) fn unknown_job(job: JobId) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("there is no job {job}"))
}

async fn job(shared: web::Data<Shared>, id: web::Path<String>) -> Reply {
    let job_id = parse_job_id(&id)?;
    let snapshot = shared.monitor.snapshot();
    let state = shared.state();
    let record = state.jobs.get(&job_id).ok_or_else(|| unknown_job(job_id))?;
    // The spec is kept as the client encoded it; one that does not decode still shows the
    // job's state, without its plan.
    let spec = JobSpec::decode(&record.spec).ok();
    let body = JobDetail {
        summary: job_summary(record, &snapshot),
        cancel_requested: record.cancel_requested,
        options: spec.as_ref().map(|spec| OptionsJson {
            cache: match spec.options.cache {
                CacheMode::Reuse => "reuse",
                CacheMode::Recompute => "recompute",
                CacheMode::NoCache => "none",
            },
            max_task_retries: spec.options.max_task_retries,
            object_store_budget_permille: spec.options.object_store_budget_permille,
        }),
        plan: spec.as_ref().map(|spec| spec.plan.display_tree()),
        rows_per_s: snapshot.rows_per_s.get(&job_id).copied(),
        progress: snapshot.progress.get(&job_id).map(ProgressJson::from),
        stats: record.stats.as_ref().map(StatsJson::from),
        output: (record.status == JobStatus::Succeeded && !record.outputs.is_empty()).then(|| {
            OutputJson {
                blocks: record.outputs.len(),
                rows: record.outputs.iter().map(|b| b.rows).sum(),
                bytes: record.outputs.iter().map(|b| b.bytes).sum(),
            }
        }),
        leases: snapshot
            .reports
            .iter()
            .flat_map(|(node, report)| {
                report
                    .leases
                    .iter()
                    .filter(|summary| summary.job == job_id)
                    .map(|summary| LeaseJson {
                        job: None,
                        node: Some(node.to_string()),
                        leases: summary.leases,
                        recalled: summary.recalled,
                        cpus: summary.resources.cpu_millis as f64 / 1000.0,
                        heap_bytes: summary.resources.heap_bytes,
                    })
            })
            .collect(),
    };
    Ok(HttpResponse::Ok().json(body))
}

/// Reads a request body of at most [`MAX_BODY_BYTES`].
async fn read_body(payload: web::Payload) -> Result<web::Bytes, ApiError> {
    payload
        .to_bytes_limited(MAX_BODY_BYTES)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is over {MAX_BODY_BYTES} bytes; a job spec is a few kilobytes"),
            )
        })?
        .map_err(|error| ApiError::bad_request(format!("reading the body: {error}")))
}

async fn submit(
    shared: web::Data<Shared>,
    caller: web::ReqData<Caller>,
    request: HttpRequest,
    payload: web::Payload,
) -> Reply {
    let body = read_body(payload).await?;
    let content_type = request
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("");
    let text = std::str::from_utf8(&body)
        .map_err(|_| ApiError::bad_request("the request body is not UTF-8 text"))?;
    let (spec_text, submission) = if content_type.starts_with("application/toml") {
        (text.to_owned(), None)
    } else {
        let parsed: SubmitBody = serde_json::from_str(text).map_err(|error| {
            ApiError::bad_request(format!(
                "expected {{\"job\": \"<job-spec TOML>\", \"submission_id\": optional}} \
                 or a TOML body with Content-Type: application/toml: {error}"
            ))
        })?;
        (parsed.job, parsed.submission_id)
    };
    let submission = match submission {
        Some(text) => text
            .parse::<SubmissionId>()
            .map_err(|error| ApiError::bad_request(format!("submission_id {text:?}: {error}")))?,
        None => SubmissionId::random(),
    };
    // Parsing lists and opens the input files (their fingerprints need sizes, times and
    // schemas), which can take a while; it runs off the server's one worker thread.
    let parser = Arc::clone(&shared.parser);
    let parsed = web::block(move || parser.parse(&spec_text))
        .await
        .map_err(|error| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?
        .map_err(|rejected| ApiError::bad_request(rejected.0))?;
    let job = shared
        .leader(&caller)?
        .submit_job(parsed.spec, submission, parsed.name)
        .await
        .map_err(ApiError::from_scheduler)?;
    shared
        .wait_applied(|state| state.jobs.contains_key(&job))
        .await;
    Ok(HttpResponse::Created().json(Submitted {
        job_id: job.to_string(),
        submission_id: submission.to_string(),
    }))
}

async fn stop(
    shared: web::Data<Shared>,
    caller: web::ReqData<Caller>,
    id: web::Path<String>,
) -> Reply {
    let job = parse_job_id(&id)?;
    // The leader decides, not the snapshot, which may lag a fresh submission.
    let outcome = shared
        .propose_as(&caller, Command::CancelJob { job })
        .await?;
    if outcome == Outcome::Applied {
        shared
            .wait_applied(|state| {
                state
                    .jobs
                    .get(&job)
                    .is_some_and(|record| record.cancel_requested || record.status.is_finished())
            })
            .await;
    }
    let body = match outcome {
        Outcome::Rejected(_) if !shared.state().jobs.contains_key(&job) => {
            return Err(unknown_job(job));
        }
        Outcome::Rejected(reason) => Stopped {
            stopped: false,
            message: reason,
        },
        _ => Stopped {
            stopped: true,
            message: format!("job {job} is cancelled, or its driver was asked to stop"),
        },
    };
    Ok(HttpResponse::Ok().json(body))
}

async fn delete_job(
    shared: web::Data<Shared>,
    caller: web::ReqData<Caller>,
    id: web::Path<String>,
) -> Reply {
    let job = parse_job_id(&id)?;
    let outcome = shared
        .propose_as(&caller, Command::DeleteJob { job })
        .await?;
    match outcome {
        Outcome::JobsRemoved(_) => {
            shared
                .wait_applied(|state| !state.jobs.contains_key(&job))
                .await;
            Ok(HttpResponse::Ok().json(Deleted {
                deleted: true,
                message: format!(
                    "job {job} is deleted; its output is being freed and its summary is in the \
                     history"
                ),
            }))
        }
        Outcome::Rejected(_) if !shared.state().jobs.contains_key(&job) => Err(unknown_job(job)),
        Outcome::Rejected(reason) => Err(ApiError::new(StatusCode::CONFLICT, reason)),
        other => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("unexpected outcome {other:?}"),
        )),
    }
}

// ---- cache ----------------------------------------------------------------------------

async fn cache(shared: web::Data<Shared>) -> HttpResponse {
    let state = shared.state();
    let mut entries = Vec::new();
    for (fingerprint, by_count) in &state.cache {
        for (shard_count, entry) in by_count {
            let mut shards_per_node: BTreeMap<NodeId, u64> = BTreeMap::new();
            for shard in entry.shards.values() {
                *shards_per_node.entry(shard.node).or_default() += 1;
            }
            let made_by = entry.made_by.as_ref();
            entries.push(CacheEntryJson {
                fingerprint: fingerprint.clone(),
                shard_count: *shard_count,
                shards_present: entry.shards.len(),
                complete: entry.shards.len() == *shard_count as usize,
                rows: entry.shards.values().map(|s| s.rows).sum(),
                bytes: entry.shards.values().map(|s| s.bytes).sum(),
                nodes: shards_per_node.keys().map(ToString::to_string).collect(),
                shards_per_node: shards_per_node
                    .iter()
                    .map(|(node, shards)| (node.to_string(), *shards))
                    .collect(),
                last_used_ms: state
                    .cache_use
                    .get(fingerprint)
                    .map(|used| used.last_used_ms),
                hits: state.cache_use.get(fingerprint).map_or(0, |used| used.hits),
                job: made_by.map(|made| made.origin.job.to_string()),
                operator: made_by.map(|made| made.origin.operator.clone()),
                created_at_ms: made_by.map(|made| made.created_at_ms),
            });
        }
    }
    HttpResponse::Ok().json(CacheJson {
        total_bytes: entries.iter().map(|entry| entry.bytes).sum(),
        entries,
    })
}

async fn clean_cache(
    shared: web::Data<Shared>,
    caller: web::ReqData<Caller>,
    payload: web::Payload,
) -> Reply {
    let body = read_body(payload).await?;
    let clean: CleanBody = if body.is_empty() {
        CleanBody { fingerprint: None }
    } else {
        serde_json::from_slice(&body).map_err(|error| {
            ApiError::bad_request(format!(
                "expected {{\"fingerprint\": \"<32 hex digits>\"}} or {{}}: {error}"
            ))
        })?
    };
    let fingerprints: Vec<String> = match clean.fingerprint {
        Some(fingerprint) => {
            fingerprint
                .parse::<floe_core::Fingerprint>()
                .map_err(|error| {
                    ApiError::bad_request(format!("fingerprint {fingerprint:?}: {error}"))
                })?;
            vec![fingerprint]
        }
        None => shared.state().cache.keys().cloned().collect(),
    };
    // One entry per (fingerprint, shard count), as `/api/cache` lists them.
    let entries = |fingerprint: &str| {
        shared
            .state()
            .cache
            .get(fingerprint)
            .map_or(0, BTreeMap::len)
    };
    let mut client = shared.leader(&caller)?;
    let mut evicted = Vec::new();
    for fingerprint in fingerprints {
        let count = entries(&fingerprint);
        let command = Command::EvictCache {
            fingerprint: fingerprint.clone(),
        };
        match client.propose(command).await {
            Ok(Outcome::Applied) => evicted.push((fingerprint, count)),
            Ok(_) => {}
            Err(error) => {
                let done: usize = evicted.iter().map(|(_, count)| count).sum();
                let mut failure = ApiError::from_scheduler(error);
                failure.message =
                    format!("{} (evicted {done} entries before that)", failure.message);
                return Err(failure);
            }
        }
    }
    shared
        .wait_applied(|state| evicted.iter().all(|(fp, _)| !state.cache.contains_key(fp)))
        .await;
    // Out of the index first, so no job is planned against them; then off the disks, so no
    // node records them again when it restarts.
    let fingerprints = evicted
        .iter()
        .filter_map(|(fingerprint, _)| fingerprint.parse().ok())
        .collect();
    remove_shard_files(&shared, fingerprints).await;
    let evicted = evicted.iter().map(|(_, count)| count).sum();
    Ok(HttpResponse::Ok().json(Cleaned { evicted }))
}

/// Asks every alive node to remove its shard files of `fingerprints`. A node that cannot be
/// reached keeps them: they are out of the index, and a job never reads an unindexed shard.
async fn remove_shard_files(shared: &Shared, fingerprints: Vec<floe_core::Fingerprint>) {
    if fingerprints.is_empty() {
        return;
    }
    let request = NodeRequest::RemoveCacheShards { fingerprints };
    let nodes: Vec<(NodeId, String)> = shared
        .state()
        .alive_nodes()
        .map(|node| (node.id, node.addresses.rpc.clone()))
        .collect();
    for (node, addr) in nodes {
        let removed = async {
            let mut client: RpcClient<NodeProtocol> =
                RpcClient::connect(addr, shared.node_wire.clone()).await?;
            client.call(&request).await
        }
        .await;
        if let Err(error) = removed {
            tracing::warn!(%node, %error, "cannot remove cleaned cache shards from a node");
        }
    }
}

// ---- events and history ---------------------------------------------------------------

async fn events(shared: web::Data<Shared>, query: web::Query<EventsQuery>) -> HttpResponse {
    let events = shared
        .monitor
        .events_after(query.after.unwrap_or(0))
        .into_iter()
        .map(|event| EventJson {
            seq: event.seq,
            time_ms: event.time_ms,
            kind: event.kind.name(),
            node: event.node.map(|node| node.to_string()),
            job: event.job.map(|job| job.to_string()),
            message: event.message,
        })
        .collect();
    HttpResponse::Ok().json(EventsJson { events })
}

/// Points a history answer holds at most: a longer span is thinned to every k-th sample.
const MAX_HISTORY_POINTS: usize = 600;

/// Checks a chart span: 1 to 60 minutes (the monitor keeps an hour).
pub(super) fn history_minutes(minutes: u64) -> Result<u64, ApiError> {
    if (1..=60).contains(&minutes) {
        Ok(minutes)
    } else {
        Err(ApiError::bad_request(format!(
            "minutes must be 1 to 60, not {minutes}"
        )))
    }
}

async fn history(shared: web::Data<Shared>, query: web::Query<HistoryQuery>) -> Reply {
    let minutes = history_minutes(query.minutes.unwrap_or(10))?;
    let now = now_ms();
    let since = now.saturating_sub(minutes * 60_000);
    let recent: Vec<_> = shared
        .monitor
        .history()
        .into_iter()
        .filter(|sample| sample.time_ms >= since)
        .collect();
    let step = recent.len().div_ceil(MAX_HISTORY_POINTS).max(1);
    // Thinned from the newest back, so the latest sample is always in.
    let mut samples: Vec<SampleJson> = recent
        .iter()
        .rev()
        .step_by(step)
        .map(|sample| SampleJson {
            time_ms: sample.time_ms,
            object_store_used_bytes: sample.object_store_used_bytes,
            spilled_bytes: sample.spilled_bytes,
            rows_per_s: sample.rows_per_s,
            running_jobs: sample.running_jobs,
            tasks_running: sample.tasks_running,
            task_rows_per_s: sample.task_rows_per_s,
            network_bytes_per_s: sample.network_bytes_per_s,
        })
        .collect();
    samples.reverse();
    Ok(HttpResponse::Ok().json(HistoryJson {
        interval_ms: shared.monitor.refresh_ms() * step as u64,
        now_ms: now,
        samples,
    }))
}
