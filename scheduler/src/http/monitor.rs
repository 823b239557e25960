//! What the HTTP API answers from: a snapshot of the cluster refreshed once per interval,
//! the events seen between snapshots, and a short history of samples for the charts.
//!
//! The snapshot combines three sources: this replica's applied state (published by its
//! Raft loop, so it is available even when there is no leader), the leader's soft state
//! (heartbeat reports, drivers' progress) and every replica's Raft status. Events are found
//! by comparing consecutive snapshots, so they are what this replica saw since it started.
//! The comparison walks only what changed: two copies of the state share every subtree of
//! their maps that no command touched in between, and `OrdMap::diff` skips those, so a
//! refresh costs the jobs and nodes that changed, not the 100,000 in the history.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use floe_core::job::JobProgress;
use floe_core::{JobId, NodeId};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::HttpConfig;
use floe_api::client::SchedulerClient;
use floe_api::scheduler_protocol::{NodeReport, ReplicaStatus, ResourceUsage};
use floe_api::state::{ClusterState, DiffItem, JobStatus, Liveness, OrdMap};

/// Events kept for `/api/events`; older ones are dropped.
const MAX_EVENTS: usize = 1000;
/// History samples kept for the charts (an hour at one per second).
const MAX_SAMPLES: usize = 3600;
/// How long one replica's status or one call to the leader may take before the snapshot is
/// taken without it.
const CALL_TIMEOUT: Duration = Duration::from_millis(800);
/// One node chart point per this long: an hour of them for 1,000 nodes is 360,000 small
/// samples (about 12 MB), where one a second would be ten times that.
pub(crate) const NODE_SAMPLE_MS: u64 = 10_000;
/// Node chart points kept per node (an hour).
const MAX_NODE_SAMPLES: usize = 360;
/// A job whose output rows have not grown for this long shows 0 rows/s.
const ROWS_STALE_MS: u64 = 5_000;

/// One replica as this replica sees it; `status` is None when it did not answer.
#[derive(Debug, Clone)]
pub(crate) struct ReplicaView {
    pub id: u64,
    pub addr: String,
    pub status: Option<ReplicaStatus>,
}

/// The cluster at one moment.
#[derive(Debug, Clone)]
pub(crate) struct Snapshot {
    pub time_ms: u64,
    /// Made before this replica had applied everything it knew committed (at start-up, while
    /// it replays its log): what differs from it is the replay, not news, so the next
    /// snapshot yields no node or job events.
    pub baseline: bool,
    pub state: Arc<ClusterState>,
    pub replicas: Vec<ReplicaView>,
    /// The leader the replicas agree on in the highest term, if any.
    pub leader: Option<u64>,
    /// Whether the leader's soft state below could be read this time.
    pub leader_answered: bool,
    pub reports: BTreeMap<NodeId, NodeReport>,
    pub progress: BTreeMap<JobId, JobProgress>,
    /// Running jobs' output rows per second, between the last two reports that changed them.
    pub rows_per_s: BTreeMap<JobId, f64>,
    /// Each running job's output rows and when they last changed, for `rows_per_s`.
    pub row_marks: BTreeMap<JobId, (u64, u64)>,
    /// The last node seen running each job's driver, which keeps its task table after the
    /// job ends; for jobs still in the state. Persistent, so carrying it to the next
    /// snapshot is O(1).
    pub driver_seen: OrdMap<JobId, NodeId>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventKind {
    NodeJoined,
    NodeDead,
    LeaderChanged,
    JobState,
}

impl EventKind {
    pub fn name(self) -> &'static str {
        match self {
            EventKind::NodeJoined => "node_joined",
            EventKind::NodeDead => "node_dead",
            EventKind::LeaderChanged => "leader_changed",
            EventKind::JobState => "job_state",
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub seq: u64,
    pub time_ms: u64,
    pub kind: EventKind,
    pub node: Option<NodeId>,
    pub job: Option<JobId>,
    pub message: String,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    pub time_ms: u64,
    pub object_store_used_bytes: u64,
    pub spilled_bytes: u64,
    pub rows_per_s: f64,
    pub running_jobs: u64,
    /// Tasks the running jobs' drivers last reported running.
    pub tasks_running: u64,
    /// Rows all tasks produced per second, and object bytes the nodes received from each
    /// other per second, as the nodes count them.
    pub task_rows_per_s: f64,
    pub network_bytes_per_s: f64,
}

/// One node's chart point: what it did over the [`NODE_SAMPLE_MS`] before `time_ms`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NodeSample {
    pub time_ms: u64,
    pub tasks_running: u32,
    pub rows_per_s: f32,
    pub spilled_bytes: u64,
    pub network_bytes_per_s: f32,
    pub cpu_used_permille: u32,
}

/// A node's chart points, the counters the next point's rates start from, and its last few
/// reports, over which the cluster's chart takes its rates (heartbeats and snapshots both
/// come once a second, so two consecutive snapshots often hold the same report).
struct NodeHistory {
    samples: VecDeque<NodeSample>,
    mark: (u64, ResourceUsage),
    recent: VecDeque<(u64, ResourceUsage)>,
}

/// Reports a node's cluster-chart rates are taken over.
const RECENT_REPORTS: usize = 5;

struct Log {
    events: VecDeque<Event>,
    next_seq: u64,
    samples: VecDeque<Sample>,
    /// Alive nodes' chart points; a node's go when it leaves the state.
    nodes: BTreeMap<NodeId, NodeHistory>,
}

pub(crate) struct Monitor {
    refresh: Duration,
    snapshot: RwLock<Arc<Snapshot>>,
    log: Mutex<Log>,
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

impl Monitor {
    /// A monitor whose first snapshot is `state` alone; nothing in it counts as an event.
    pub fn new(config: &HttpConfig, state: Arc<ClusterState>) -> Self {
        let snapshot = Snapshot {
            time_ms: now_ms(),
            baseline: true,
            state,
            replicas: config
                .peers
                .iter()
                .map(|(id, addr)| ReplicaView {
                    id: *id,
                    addr: addr.clone(),
                    status: None,
                })
                .collect(),
            leader: None,
            leader_answered: false,
            reports: BTreeMap::new(),
            progress: BTreeMap::new(),
            rows_per_s: BTreeMap::new(),
            row_marks: BTreeMap::new(),
            driver_seen: OrdMap::new(),
        };
        Self {
            refresh: config.refresh,
            snapshot: RwLock::new(Arc::new(snapshot)),
            log: Mutex::new(Log {
                events: VecDeque::new(),
                next_seq: 1,
                samples: VecDeque::new(),
                nodes: BTreeMap::new(),
            }),
        }
    }

    pub fn refresh_ms(&self) -> u64 {
        u64::try_from(self.refresh.as_millis()).unwrap_or(u64::MAX)
    }

    pub fn snapshot(&self) -> Arc<Snapshot> {
        match self.snapshot.read() {
            Ok(snapshot) => Arc::clone(&snapshot),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Events with a sequence number above `after`, oldest first.
    pub fn events_after(&self, after: u64) -> Vec<Event> {
        self.log()
            .events
            .iter()
            .filter(|event| event.seq > after)
            .cloned()
            .collect()
    }

    pub fn history(&self) -> Vec<Sample> {
        self.log().samples.iter().copied().collect()
    }

    /// `node`'s chart points, oldest first; none for a node this replica never heard of.
    pub fn node_history(&self, node: NodeId) -> Vec<NodeSample> {
        self.log()
            .nodes
            .get(&node)
            .map(|history| history.samples.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Installs `next`, recording the events between the current snapshot and it.
    pub(super) fn advance(&self, mut next: Snapshot) {
        let previous = self.snapshot();
        let changes = changes(&previous, &mut next);
        let mut sample = sample(&next);
        {
            let mut log = self.log();
            (sample.task_rows_per_s, sample.network_bytes_per_s) =
                record_node_samples(&mut log.nodes, &next);
            for (kind, node, job, message) in changes {
                let seq = log.next_seq;
                log.next_seq += 1;
                log.events.push_back(Event {
                    seq,
                    time_ms: next.time_ms,
                    kind,
                    node,
                    job,
                    message,
                });
                if log.events.len() > MAX_EVENTS {
                    log.events.pop_front();
                }
            }
            log.samples.push_back(sample);
            if log.samples.len() > MAX_SAMPLES {
                log.samples.pop_front();
            }
        }
        let mut current = match self.snapshot.write() {
            Ok(current) => current,
            Err(poisoned) => poisoned.into_inner(),
        };
        *current = Arc::new(next);
    }
}

type Change = (EventKind, Option<NodeId>, Option<JobId>, String);

/// Adds a chart point for every alive node whose last one is [`NODE_SAMPLE_MS`] old (a node
/// first heard of gets one at once), and drops the points of nodes gone from the state.
/// Returns the alive nodes' rows produced and network bytes received per second, summed.
fn record_node_samples(nodes: &mut BTreeMap<NodeId, NodeHistory>, next: &Snapshot) -> (f64, f64) {
    nodes.retain(|node, _| next.state.nodes.get(node).is_some_and(|n| n.is_alive()));
    let mut cluster = (0.0, 0.0);
    for (node, report) in &next.reports {
        if !next.state.nodes.get(node).is_some_and(|n| n.is_alive()) {
            continue;
        }
        let usage = report.usage;
        if let Some(history) = nodes.get_mut(node) {
            history.recent.push_back((next.time_ms, usage));
            if history.recent.len() > RECENT_REPORTS {
                history.recent.pop_front();
            }
            if let (Some((from_ms, from)), Some((to_ms, to))) =
                (history.recent.front(), history.recent.back())
            {
                let (rows, bytes) = rates(from, to, to_ms - from_ms);
                cluster.0 += rows;
                cluster.1 += bytes;
            }
        }
        let point = |rows_per_s: f64, network_bytes_per_s: f64| NodeSample {
            time_ms: next.time_ms,
            tasks_running: usage.workers_busy,
            rows_per_s: rows_per_s as f32,
            spilled_bytes: usage.spilled_bytes,
            network_bytes_per_s: network_bytes_per_s as f32,
            cpu_used_permille: usage.cpu_used_permille,
        };
        match nodes.get_mut(node) {
            None => {
                nodes.insert(
                    *node,
                    NodeHistory {
                        samples: VecDeque::from([point(0.0, 0.0)]),
                        mark: (next.time_ms, usage),
                        recent: VecDeque::from([(next.time_ms, usage)]),
                    },
                );
            }
            Some(history) if next.time_ms >= history.mark.0 + NODE_SAMPLE_MS => {
                let (rows, bytes) = rates(&history.mark.1, &usage, next.time_ms - history.mark.0);
                history.samples.push_back(point(rows, bytes));
                if history.samples.len() > MAX_NODE_SAMPLES {
                    history.samples.pop_front();
                }
                history.mark = (next.time_ms, usage);
            }
            Some(_) => {}
        }
    }
    cluster
}

/// Rows produced and network bytes received per second between two reports of a node
/// `elapsed_ms` apart (a node restarted under the same id counts from zero again: 0).
fn rates(before: &ResourceUsage, after: &ResourceUsage, elapsed_ms: u64) -> (f64, f64) {
    if elapsed_ms == 0 {
        return (0.0, 0.0);
    }
    let per_s = |delta: u64| delta as f64 * 1000.0 / elapsed_ms as f64;
    (
        per_s(after.rows_produced.saturating_sub(before.rows_produced)),
        per_s(
            after
                .network_received_bytes
                .saturating_sub(before.network_received_bytes),
        ),
    )
}

/// The events between two snapshots, from the nodes and jobs that differ between them; also
/// carries forward what `next` derives from the previous one (rates, drivers seen).
fn changes(previous: &Snapshot, next: &mut Snapshot) -> Vec<Change> {
    let mut found = Vec::new();
    if previous.leader != next.leader {
        let message = match next.leader {
            Some(leader) => {
                let term = next
                    .replicas
                    .iter()
                    .find(|replica| replica.id == leader)
                    .and_then(|replica| replica.status.as_ref())
                    .map_or(0, |status| status.term);
                format!("replica {leader} is the leader (term {term})")
            }
            None => "no replica is leader".to_owned(),
        };
        found.push((EventKind::LeaderChanged, None, None, message));
    }
    if previous.baseline {
        return found;
    }
    for (id, node, before) in previous
        .state
        .nodes
        .diff(&next.state.nodes)
        .filter_map(|item| match item {
            DiffItem::Add(id, node) => Some((id, node, None)),
            DiffItem::Update {
                old: (_, before),
                new: (id, node),
            } => Some((id, node, Some(before))),
            // Forgotten dead nodes say nothing new.
            DiffItem::Remove(..) => None,
        })
    {
        match (&node.liveness, before.map(|node| &node.liveness)) {
            (Liveness::Alive, None) => found.push((
                EventKind::NodeJoined,
                Some(*id),
                None,
                format!("node {id} joined from {}", node.addresses.rpc),
            )),
            (Liveness::Dead { reason, .. }, None | Some(Liveness::Alive)) => found.push((
                EventKind::NodeDead,
                Some(*id),
                None,
                format!("node {id} ({}) died: {reason}", node.addresses.rpc),
            )),
            _ => {}
        }
    }
    for item in previous.state.jobs.diff(&next.state.jobs) {
        let (id, job, before) = match item {
            DiffItem::Add(id, job) => (id, job, None),
            DiffItem::Update {
                old: (_, before),
                new: (id, job),
            } => (id, job, Some(&before.status)),
            DiffItem::Remove(id, _) => {
                next.driver_seen.remove(id);
                continue;
            }
        };
        if let Some(driver) = job.driver {
            next.driver_seen.insert(*id, driver);
        }
        if before == Some(&job.status) {
            continue;
        }
        // A refresh can span several transitions (a short job is submitted, runs and ends
        // within one): the ones it skipped are told first, in order.
        if before.is_none() && job.status != JobStatus::Pending {
            found.push((
                EventKind::JobState,
                None,
                Some(*id),
                format!("job {id} pending"),
            ));
        }
        if job.started_at_ms.is_some()
            && job.status != JobStatus::Running
            && matches!(before, None | Some(JobStatus::Pending))
        {
            found.push((
                EventKind::JobState,
                None,
                Some(*id),
                format!("job {id} running"),
            ));
        }
        let message = match &job.status {
            JobStatus::Failed { message } => format!("job {id} failed: {message}"),
            status => format!("job {id} {}", status.name()),
        };
        found.push((EventKind::JobState, None, Some(*id), message));
    }
    // Drivers report every `node.progress_interval_ms`, not once per snapshot: a rate is
    // taken between two reports that changed the rows, and held until the next one, so it
    // does not read 0 between reports.
    for (job, progress) in &next.progress {
        let rows = progress.operators.last().map_or(0, |op| op.rows_done);
        let mark =
            previous.row_marks.get(job).copied().filter(|_| {
                previous.progress.get(job).map(|p| p.attempt) == Some(progress.attempt)
            });
        let (rate, mark) = match mark {
            Some((since_ms, before)) if rows > before && next.time_ms > since_ms => {
                let elapsed_s = (next.time_ms - since_ms) as f64 / 1000.0;
                ((rows - before) as f64 / elapsed_s, (next.time_ms, rows))
            }
            Some((since_ms, before)) if next.time_ms.saturating_sub(since_ms) < ROWS_STALE_MS => {
                let held = previous.rows_per_s.get(job).copied().unwrap_or(0.0);
                (held, (since_ms, before))
            }
            Some((_, before)) => (0.0, (next.time_ms, before)),
            None => (0.0, (next.time_ms, rows)),
        };
        next.rows_per_s.insert(*job, rate);
        next.row_marks.insert(*job, mark);
    }
    found
}

fn sample(snapshot: &Snapshot) -> Sample {
    let alive = |node: &NodeId| {
        snapshot
            .state
            .nodes
            .get(node)
            .is_some_and(|record| record.is_alive())
    };
    let reports = || {
        snapshot
            .reports
            .iter()
            .filter(|(node, _)| alive(node))
            .map(|(_, report)| report)
    };
    Sample {
        time_ms: snapshot.time_ms,
        object_store_used_bytes: reports().map(|r| r.usage.object_store_bytes).sum(),
        spilled_bytes: reports().map(|r| r.usage.spilled_bytes).sum(),
        rows_per_s: snapshot
            .rows_per_s
            .values()
            .fold(0.0, |sum, rate| sum + rate),
        running_jobs: snapshot.state.job_counts.running,
        tasks_running: snapshot
            .progress
            .values()
            .flat_map(|progress| &progress.operators)
            .map(|operator| operator.tasks_running)
            .sum(),
        // Set by `record_node_samples`, which keeps the nodes' recent reports.
        task_rows_per_s: 0.0,
        network_bytes_per_s: 0.0,
    }
}

/// Refreshes the monitor's snapshot every `config.refresh` until the server stops.
pub(crate) async fn run(
    monitor: Arc<Monitor>,
    config: HttpConfig,
    applied_state: watch::Receiver<Arc<ClusterState>>,
) {
    let addrs: Vec<String> = config.peers.values().cloned().collect();
    let mut leader = match SchedulerClient::new(addrs, config.wire.clone()) {
        Ok(client) => client.with_retry_for(CALL_TIMEOUT),
        Err(error) => {
            tracing::error!(%error, "the HTTP monitor has no scheduler to read from");
            return;
        }
    };
    let mut tick = tokio::time::interval(config.refresh);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let started = Instant::now();
        let state = applied_state.borrow().clone();
        let replicas = replica_statuses(&config).await;
        let leader_id = agreed_leader(&replicas);
        let previous = monitor.snapshot();

        // After a restart the replica replays its log; until it has applied what it knows is
        // committed, differences are the replay, not news.
        let own = replicas
            .iter()
            .find(|replica| replica.id == config.replica_id)
            .and_then(|replica| replica.status.as_ref());
        let caught_up = own.is_some_and(|status| state.applied_index >= status.commit);
        let mut next = Snapshot {
            time_ms: now_ms(),
            baseline: previous.baseline && !caught_up,
            state,
            replicas,
            leader: leader_id,
            leader_answered: false,
            reports: BTreeMap::new(),
            progress: BTreeMap::new(),
            rows_per_s: BTreeMap::new(),
            row_marks: BTreeMap::new(),
            driver_seen: previous.driver_seen.clone(),
        };
        if leader_id.is_some() {
            read_leader(&mut leader, &mut next).await;
        }
        monitor.advance(next);
        tracing::trace!(took = ?started.elapsed(), "dashboard snapshot");
    }
}

async fn replica_statuses(config: &HttpConfig) -> Vec<ReplicaView> {
    let mut calls = JoinSet::new();
    for (id, addr) in &config.peers {
        let (id, addr, wire) = (*id, addr.clone(), config.wire.clone());
        calls.spawn(async move {
            let status =
                tokio::time::timeout(CALL_TIMEOUT, SchedulerClient::status_of(&addr, wire)).await;
            ReplicaView {
                id,
                addr,
                status: status.ok().and_then(std::result::Result::ok),
            }
        });
    }
    let mut replicas = Vec::with_capacity(config.peers.len());
    while let Some(view) = calls.join_next().await {
        if let Ok(view) = view {
            replicas.push(view);
        }
    }
    replicas.sort_by_key(|replica| replica.id);
    replicas
}

/// The leader named by the replicas in the highest term any of them reports.
fn agreed_leader(replicas: &[ReplicaView]) -> Option<u64> {
    replicas
        .iter()
        .filter_map(|replica| replica.status.as_ref())
        .filter(|status| status.leader.is_some())
        .max_by_key(|status| status.term)
        .and_then(|status| status.leader)
}

/// Reads the leader's soft state into `next`: heartbeat reports and the progress of every
/// running job, two calls in all. A leader that does not answer leaves them empty.
async fn read_leader(client: &mut SchedulerClient, next: &mut Snapshot) {
    let Ok(Ok(reports)) = tokio::time::timeout(CALL_TIMEOUT, client.node_reports()).await else {
        return;
    };
    let Ok(Ok(progress)) = tokio::time::timeout(CALL_TIMEOUT, client.all_progress()).await else {
        return;
    };
    next.reports = reports;
    next.progress = progress;
    next.leader_answered = true;
}
