//! The JSON request and response types of the HTTP API (`docs/HTTP_API.md`). They are the
//! HTTP edge: built from the scheduler's domain types and never travel further in.

use std::collections::BTreeMap;

use floe_core::job::{JobProgress, JobStats};
use serde::{Deserialize, Serialize};

// ---- errors and version ---------------------------------------------------------------

#[derive(Serialize)]
pub(super) struct ErrorBody<'a> {
    pub(super) error: &'a str,
}

#[derive(Serialize)]
pub(super) struct Version {
    pub(super) version: &'static str,
    pub(super) api: u32,
}

// ---- paging ---------------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ListQuery {
    pub(super) state: Option<String>,
    /// Jobs only: also list the jobs that moved to this replica's history.
    pub(super) all: Option<bool>,
    pub(super) offset: Option<usize>,
    pub(super) limit: Option<usize>,
    /// Jobs only: those whose name contains this text.
    pub(super) name: Option<String>,
}

impl ListQuery {
    /// Whether a job called `name` passes the `name` filter (a substring match; a job with
    /// no name passes only when no filter is given).
    pub(super) fn name_matches(&self, name: Option<&str>) -> bool {
        match (&self.name, name) {
            (None, _) => true,
            (Some(wanted), Some(name)) => name.contains(wanted.as_str()),
            (Some(_), None) => false,
        }
    }

    pub(super) fn page(&self, default: usize) -> (usize, usize) {
        (
            self.offset.unwrap_or(0),
            self.limit.unwrap_or(default).clamp(1, 1000),
        )
    }
}

// ---- cluster --------------------------------------------------------------------------

#[derive(Serialize)]
pub(super) struct ReplicaJson {
    pub(super) id: u64,
    pub(super) addr: String,
    pub(super) reachable: bool,
    pub(super) leader: Option<u64>,
    pub(super) term: Option<u64>,
    pub(super) commit: Option<u64>,
    pub(super) applied: Option<u64>,
}

#[derive(Serialize)]
pub(super) struct NodeCounts {
    pub(super) alive: u64,
    pub(super) dead: u64,
}

#[derive(Serialize)]
pub(super) struct StoreTotals {
    pub(super) used_bytes: u64,
    pub(super) capacity_bytes: u64,
}

#[derive(Serialize)]
pub(super) struct ClusterJson {
    pub(super) health: &'static str,
    pub(super) leader: Option<u64>,
    pub(super) as_of_index: u64,
    pub(super) replica_id: u64,
    pub(super) replicas: Vec<ReplicaJson>,
    pub(super) nodes: NodeCounts,
    pub(super) jobs: BTreeMap<&'static str, u64>,
    pub(super) object_store: StoreTotals,
    pub(super) spilled_bytes: u64,
    pub(super) fallback_bytes: u64,
}

// ---- nodes ----------------------------------------------------------------------------

#[derive(Serialize)]
pub(super) struct MemoryJson {
    pub(super) total_bytes: u64,
    pub(super) object_store_bytes: u64,
    pub(super) system_reserve_bytes: u64,
    pub(super) heap_bytes: u64,
}

/// One job's leases on one node.
#[derive(Serialize)]
pub(super) struct LeaseJson {
    /// The job's id on a node's entry, the node's on a job's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) job: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) node: Option<String>,
    pub(super) leases: u32,
    pub(super) recalled: u32,
    pub(super) cpus: f64,
    pub(super) heap_bytes: u64,
}

#[derive(Serialize)]
pub(super) struct UsageJson {
    pub(super) cpu_reserved: f64,
    pub(super) heap_reserved_bytes: u64,
    /// The jobs' leases that make up the reservation.
    pub(super) leases: Vec<LeaseJson>,
    pub(super) heap_used_bytes: u64,
    pub(super) object_store_used_bytes: u64,
    pub(super) spilled_bytes: u64,
    pub(super) fallback_bytes: u64,
    pub(super) workers_busy: u32,
    pub(super) workers: u32,
}

#[derive(Serialize)]
pub(super) struct NodeJson {
    pub(super) id: String,
    pub(super) addr: String,
    pub(super) state: &'static str,
    pub(super) dead_reason: Option<String>,
    pub(super) cpus: f64,
    pub(super) labels: BTreeMap<String, String>,
    pub(super) memory: MemoryJson,
    pub(super) usage: Option<UsageJson>,
    pub(super) heartbeat_age_ms: Option<u64>,
}

#[derive(Serialize)]
pub(super) struct Page<T> {
    pub(super) total: usize,
    pub(super) offset: usize,
    pub(super) limit: usize,
    #[serde(flatten)]
    pub(super) items: T,
}

#[derive(Serialize)]
pub(super) struct NodeItems {
    pub(super) nodes: Vec<NodeJson>,
}

// ---- jobs -----------------------------------------------------------------------------

#[derive(Serialize)]
pub(super) struct JobSummary {
    pub(super) id: String,
    /// What the submitter called the job (a job file's `name`).
    pub(super) name: Option<String>,
    pub(super) state: &'static str,
    pub(super) attempts: u32,
    pub(super) driver_node: Option<String>,
    pub(super) error: Option<String>,
    pub(super) submission_id: String,
    pub(super) operators: Vec<String>,
    pub(super) wall_ms: Option<u64>,
    pub(super) output_rows: Option<u64>,
    /// Milliseconds since the Unix epoch, as the leader saw them.
    pub(super) submitted_at_ms: u64,
    pub(super) started_at_ms: Option<u64>,
    pub(super) ended_at_ms: Option<u64>,
    /// Why the output is no longer held, once it is not.
    pub(super) output_released: Option<String>,
    /// `"deleted"` or `"pruned"` for a job listed from the history.
    pub(super) removed: Option<&'static str>,
}

#[derive(Serialize)]
pub(super) struct JobItems {
    pub(super) counts: BTreeMap<&'static str, u64>,
    pub(super) jobs: Vec<JobSummary>,
}

#[derive(Serialize)]
pub(super) struct OptionsJson {
    pub(super) cache: &'static str,
    pub(super) max_task_retries: u32,
    pub(super) object_store_budget_permille: u32,
}

#[derive(Serialize)]
pub(super) struct OutputJson {
    pub(super) blocks: usize,
    pub(super) rows: u64,
    pub(super) bytes: u64,
}

#[derive(Serialize)]
pub(super) struct JobDetail {
    #[serde(flatten)]
    pub(super) summary: JobSummary,
    pub(super) cancel_requested: bool,
    pub(super) options: Option<OptionsJson>,
    pub(super) plan: Option<String>,
    pub(super) rows_per_s: Option<f64>,
    pub(super) progress: Option<ProgressJson>,
    pub(super) stats: Option<StatsJson>,
    pub(super) output: Option<OutputJson>,
    /// The job's leases, per node (as of the leader's last report).
    pub(super) leases: Vec<LeaseJson>,
}

#[derive(Serialize)]
pub(super) struct OperatorProgressJson {
    pub(super) name: String,
    pub(super) rows_done: u64,
    pub(super) blocks_done: u64,
    pub(super) bytes_done: u64,
    pub(super) tasks_total: Option<u64>,
    pub(super) tasks_done: u64,
    pub(super) tasks_running: u64,
    pub(super) tasks_queued: u64,
}

#[derive(Serialize)]
pub(super) struct ProgressJson {
    pub(super) attempt: u32,
    pub(super) operators: Vec<OperatorProgressJson>,
}

impl From<&JobProgress> for ProgressJson {
    fn from(progress: &JobProgress) -> Self {
        Self {
            attempt: progress.attempt,
            operators: progress
                .operators
                .iter()
                .map(|op| OperatorProgressJson {
                    name: op.name.clone(),
                    rows_done: op.rows_done,
                    blocks_done: op.blocks_done,
                    bytes_done: op.bytes_done,
                    tasks_total: op.tasks_total,
                    tasks_done: op.tasks_done,
                    tasks_running: op.tasks_running,
                    tasks_queued: op.tasks_queued,
                })
                .collect(),
        }
    }
}

#[derive(Serialize)]
pub(super) struct OperatorStatsJson {
    pub(super) name: String,
    pub(super) fingerprint: Option<String>,
    pub(super) wall_ms: u64,
    pub(super) tasks: u64,
    pub(super) retries: u64,
    pub(super) rebuilt: u64,
    pub(super) rows: u64,
    pub(super) bytes: u64,
    pub(super) cache_hits: u64,
    pub(super) cache_misses: u64,
    pub(super) hot_key: Option<String>,
    pub(super) aggregators: u64,
    pub(super) aggregators_recreated: u64,
}

#[derive(Serialize)]
pub(super) struct StatsJson {
    pub(super) attempt: u32,
    pub(super) wall_ms: u64,
    pub(super) spilled_bytes: u64,
    pub(super) operators: Vec<OperatorStatsJson>,
}

impl From<&JobStats> for StatsJson {
    fn from(stats: &JobStats) -> Self {
        Self {
            attempt: stats.attempt,
            wall_ms: stats.wall_ms,
            spilled_bytes: stats.spilled_bytes,
            operators: stats
                .operators
                .iter()
                .map(|op| OperatorStatsJson {
                    name: op.name.clone(),
                    fingerprint: op.fingerprint.map(|fp| fp.to_string()),
                    wall_ms: op.wall_ms,
                    tasks: op.tasks,
                    retries: op.retries,
                    rebuilt: op.rebuilt,
                    rows: op.rows,
                    bytes: op.bytes,
                    cache_hits: op.cache_hits,
                    cache_misses: op.cache_misses,
                    hot_key: op.hot_key.clone(),
                    aggregators: op.aggregators,
                    aggregators_recreated: op.aggregators_recreated,
                })
                .collect(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SubmitBody {
    pub(super) job: String,
    pub(super) submission_id: Option<String>,
}

#[derive(Serialize)]
pub(super) struct Submitted {
    pub(super) job_id: String,
    pub(super) submission_id: String,
}

#[derive(Serialize)]
pub(super) struct Stopped {
    pub(super) stopped: bool,
    pub(super) message: String,
}

#[derive(Serialize)]
pub(super) struct Deleted {
    pub(super) deleted: bool,
    pub(super) message: String,
}

// ---- cache ----------------------------------------------------------------------------

#[derive(Serialize)]
pub(super) struct CacheEntryJson {
    pub(super) fingerprint: String,
    pub(super) shard_count: u32,
    pub(super) shards_present: usize,
    pub(super) complete: bool,
    pub(super) rows: u64,
    pub(super) bytes: u64,
    pub(super) nodes: Vec<String>,
    /// Node id → how many of the entry's shards it holds.
    pub(super) shards_per_node: BTreeMap<String, u64>,
    pub(super) last_used_ms: Option<u64>,
    /// Shards served from the entry by jobs that succeeded while this replica watched.
    pub(super) hits: u64,
    /// The job and operator that made the entry, and when (ms since the Unix epoch); null
    /// for shards a node found on disk when it joined.
    pub(super) job: Option<String>,
    pub(super) operator: Option<String>,
    pub(super) created_at_ms: Option<u64>,
}

#[derive(Serialize)]
pub(super) struct CacheJson {
    pub(super) total_bytes: u64,
    pub(super) entries: Vec<CacheEntryJson>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CleanBody {
    pub(super) fingerprint: Option<String>,
}

#[derive(Serialize)]
pub(super) struct Cleaned {
    pub(super) evicted: usize,
}

// ---- events and history ---------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EventsQuery {
    pub(super) after: Option<u64>,
}

#[derive(Serialize)]
pub(super) struct EventJson {
    pub(super) seq: u64,
    pub(super) time_ms: u64,
    pub(super) kind: &'static str,
    pub(super) node: Option<String>,
    pub(super) job: Option<String>,
    pub(super) message: String,
}

#[derive(Serialize)]
pub(super) struct EventsJson {
    pub(super) events: Vec<EventJson>,
}

#[derive(Serialize)]
pub(super) struct SampleJson {
    pub(super) time_ms: u64,
    pub(super) object_store_used_bytes: u64,
    pub(super) spilled_bytes: u64,
    pub(super) rows_per_s: f64,
    pub(super) running_jobs: u64,
    pub(super) tasks_running: u64,
    pub(super) task_rows_per_s: f64,
    pub(super) network_bytes_per_s: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct HistoryQuery {
    /// How far back, 1 to 60 minutes (default 10).
    pub(super) minutes: Option<u64>,
}

#[derive(Serialize)]
pub(super) struct HistoryJson {
    pub(super) interval_ms: u64,
    pub(super) now_ms: u64,
    pub(super) samples: Vec<SampleJson>,
}
