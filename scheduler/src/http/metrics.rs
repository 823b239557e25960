//! Prometheus `/metrics`, in the text exposition format: the replicated state as this
//! replica applied it, the leader's soft state from the monitor's snapshot.

use std::fmt::Write as _;

use actix_web::{HttpResponse, web};

use super::api::{Shared, health, job_counts};
use floe_api::state::JobStatus;

/// One metric family: its help and type lines, then its samples.
struct Family<'a> {
    out: &'a mut String,
}

impl<'a> Family<'a> {
    fn new(out: &'a mut String, name: &str, kind: &str, help: &str) -> Self {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        Self { out }
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (index, (key, label)) in labels.iter().enumerate() {
                if index > 0 {
                    self.out.push(',');
                }
                let escaped = label
                    .replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n");
                let _ = write!(self.out, "{key}=\"{escaped}\"");
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }
}

pub(crate) async fn metrics(shared: web::Data<Shared>) -> HttpResponse {
    let snapshot = shared.monitor().snapshot();
    // The replicated state is read fresh, as the JSON API does; soft state is the snapshot's.
    let state = shared.state();
    let mut out = String::new();
    let own = snapshot
        .replicas
        .iter()
        .find(|replica| replica.id == shared.replica_id())
        .and_then(|replica| replica.status.as_ref());

    Family::new(
        &mut out,
        "floe_up",
        "gauge",
        "1 when the cluster has a leader and every part answers, 0.5 when degraded, 0 when down.",
    )
    .sample(
        "floe_up",
        &[],
        match health(&snapshot, &state) {
            "ok" => 1.0,
            "degraded" => 0.5,
            _ => 0.0,
        },
    );
    let term = own.map_or(0, |status| status.term);
    let commit = own.map_or(0, |status| status.commit);
    let leader = own.is_some_and(|status| status.leader == Some(status.id));
    Family::new(
        &mut out,
        "floe_raft_term",
        "gauge",
        "This replica's Raft term.",
    )
    .sample("floe_raft_term", &[], term as f64);
    Family::new(
        &mut out,
        "floe_raft_commit_index",
        "gauge",
        "This replica's Raft commit index.",
    )
    .sample("floe_raft_commit_index", &[], commit as f64);
    Family::new(
        &mut out,
        "floe_raft_applied_index",
        "gauge",
        "The last log index this replica applied.",
    )
    .sample("floe_raft_applied_index", &[], state.applied_index as f64);
    Family::new(
        &mut out,
        "floe_raft_is_leader",
        "gauge",
        "1 when this replica is the Raft leader.",
    )
    .sample("floe_raft_is_leader", &[], if leader { 1.0 } else { 0.0 });

    let alive = state.alive_nodes().count();
    let mut nodes = Family::new(&mut out, "floe_nodes", "gauge", "Nodes by state.");
    nodes.sample("floe_nodes", &[("state", "alive")], alive as f64);
    nodes.sample(
        "floe_nodes",
        &[("state", "dead")],
        (state.nodes.len() - alive) as f64,
    );

    type NodeValue =
        fn(&floe_api::state::NodeRecord, &floe_api::scheduler_protocol::NodeReport) -> f64;
    let per_node: [(&str, &str, NodeValue); 7] = [
        (
            "floe_node_object_store_used_bytes",
            "Bytes of objects in the node's shared-memory store.",
            |_, r| r.usage.object_store_bytes as f64,
        ),
        (
            "floe_node_object_store_capacity_bytes",
            "The node's object-store pool.",
            |n, _| n.memory.object_store_bytes as f64,
        ),
        (
            "floe_node_spilled_bytes",
            "Bytes of objects the node has spilled to disk.",
            |_, r| r.usage.spilled_bytes as f64,
        ),
        (
            "floe_node_heap_reserved_bytes",
            "Heap bytes reserved by jobs' leases (their tasks' memory hints).",
            |_, r| r.reserved.heap_bytes as f64,
        ),
        (
            "floe_node_cpu_reserved",
            "CPUs reserved by jobs' leases.",
            |_, r| r.reserved.cpu_millis as f64 / 1000.0,
        ),
        (
            "floe_node_workers_busy",
            "Worker processes running a task.",
            |_, r| f64::from(r.usage.workers_busy),
        ),
        (
            "floe_node_heartbeat_age_seconds",
            "Seconds since the leader last heard from the node.",
            |_, r| r.age_ms as f64 / 1000.0,
        ),
    ];
    for (name, help, value) in per_node {
        let mut family = Family::new(&mut out, name, "gauge", help);
        for node in state.alive_nodes() {
            if let Some(report) = snapshot.reports.get(&node.id) {
                family.sample(name, &[("node", &node.id.to_string())], value(node, report));
            }
        }
    }

    let mut jobs = Family::new(&mut out, "floe_jobs", "gauge", "Jobs by state.");
    for (name, count) in job_counts(&state) {
        jobs.sample("floe_jobs", &[("state", name)], count as f64);
    }
    let mut rows = Family::new(
        &mut out,
        "floe_job_rows_total",
        "counter",
        "Rows the running job's output operator has produced in its current attempt.",
    );
    for (job, progress) in &snapshot.progress {
        let running = state
            .jobs
            .get(job)
            .is_some_and(|record| record.status == JobStatus::Running);
        if running {
            let done = progress.operators.last().map_or(0, |op| op.rows_done);
            rows.sample(
                "floe_job_rows_total",
                &[("job_id", &job.to_string())],
                done as f64,
            );
        }
    }

    let entries: usize = state.cache.values().map(|by_count| by_count.len()).sum();
    let bytes: u64 = state
        .cache
        .values()
        .flat_map(|by_count| by_count.values())
        .flat_map(|entry| entry.shards.values())
        .map(|shard| shard.bytes)
        .sum();
    Family::new(
        &mut out,
        "floe_cache_entries",
        "gauge",
        "Entries (fingerprint and shard count) in the cluster's cache index.",
    )
    .sample("floe_cache_entries", &[], entries as f64);
    Family::new(
        &mut out,
        "floe_cache_bytes",
        "gauge",
        "Bytes of the shards in the cluster's cache index.",
    )
    .sample("floe_cache_bytes", &[], bytes as f64);

    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(out)
}
