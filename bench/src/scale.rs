//! `floe-bench scale`: the control plane at 1,000 nodes and 100,000 jobs.
//!
//! Starts 3 scheduler replicas (real `floe scheduler` processes, Raft on disk, loopback
//! sockets) and simulates N node agents in this process. Each simulated node is a task with
//! its own connection and credential: it registers with the cluster secret like a real agent,
//! presents the node ticket it gets back from then on, and heartbeats every second with its
//! usage. A few node RPC servers answer what the leader sends nodes (`Free`, `FreeJob`,
//! `Status`); every simulated node gives one of them as its address.
//!
//! Jobs are small and complete through the node protocol rather than a real driver: the leader
//! commits a job's `StartDriver` on a node, the node learns it from its next heartbeat, asks
//! the leader for one lease for its one task (`AcquireLeases`, then `ReturnLeases`) and
//! commits `FinishJob` as the driver of that attempt. No worker runs, so what is measured is the
//! control plane alone.
//!
//! Phases: heartbeats alone (the leader's CPU share at N nodes), a pre-fill of
//! `jobs_in_history` jobs through real commits (at most `window` unfinished at a time), a
//! measured window with a steady stream of jobs (commit latency, heartbeat latency, snapshots
//! taken meanwhile), reads of the full state (`state_bytes`, `GET /api/jobs`), and a failover
//! (the leader killed, timed until the new leader commits). Before the failover every GET
//! endpoint of the HTTP API and the dashboard's files are timed on the leader ([`ENDPOINTS`]).
//! Each replica's status gives its WAL writes (count, mean, the slow ones and when), so the
//! slowest commits are set against the slow writes that overlapped them (`wal_writes`): the
//! three replicas share one disk here. Beside the commits, two threads of this process time
//! wakeup round trips ([`WakeupProbe`]): the host's own scheduling tail in the same window. It
//! prints one JSON line with every figure. A lost
//! heartbeat (a node told to register again, or a heartbeat failing outside the failover), a
//! job that never finishes, an
//! endpoint that does not answer 200, job totals that differ from a count of the state, or a
//! node missing after the failover fails the run; a missed target is only reported.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use floe_api::client::{HeartbeatReply, SchedulerClient};
use floe_api::lease::LeaseDecision;
use floe_api::node_protocol::{NodeProtocol, NodeRequest, NodeResponse, NodeStatus};
use floe_api::placement::{PlacementRequest, Strategy};
use floe_api::scheduler_protocol::{ResourceUsage, SnapshotTiming, WalWrites};
use floe_api::state::{
    Command, JobOutcome, JobStatus, NodeAddresses, NodeMemory, Outcome, Resources,
};
use floe_client::local::{LocalCredentials, LocalSchedulers, LocalSchedulersConfig};
use floe_core::auth::Credential;
use floe_core::config::Config;
use floe_core::job::{JobOptions, JobSpec, JobStats};
use floe_core::wire::{Handler, Peer, RemoteError, RemoteErrorKind, RpcServer, WireConfig};
use floe_core::{JobId, NodeId, SubmissionId};
use serde_json::json;
use tokio::task::JoinSet;

use crate::soak::{http_get, millis, percentile, rss_bytes};

const REPLICAS: u64 = 3;
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Node RPC servers the simulated nodes share.
const NODE_SERVERS: usize = 4;
/// Registrations in flight at once.
const CONCURRENCY: usize = 32;
/// Submitters during the pre-fill: enough submissions in flight that the leader batches
/// many into each Ready and fsync.
const PREFILL_SUBMITTERS: u64 = 64;
/// Every this many pre-filled jobs is named, so the name filter of `GET /api/jobs` has
/// something to find.
const NAMED_EVERY: u64 = 100;
const HEARTBEAT: Duration = Duration::from_secs(1);
/// How long a simulated driver waits for its lease: the simulated nodes have room for many
/// jobs' tasks at once, so waiting at all means the leader is behind.
const LEASE_WAIT: Duration = Duration::from_secs(10);
/// Calls per HTTP endpoint; their median is reported.
const API_CALLS: usize = 5;
/// The dashboard's and the API's target: every page and endpoint answers within this.
const API_TARGET_MS: f64 = 300.0;

/// Whom an endpoint's answer needs besides the leader's state.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Asks {
    /// The leader answers from its own state and soft state.
    Leader,
    /// The leader calls nodes (the simulated ones answer): one, or every alive one.
    Nodes,
}

/// Every GET endpoint of docs/HTTP_API.md and the dashboard's files, as timed on the leader:
/// (name in the report, path, whom it asks). The dashboard is one page (`GET /`) whose views
/// (`#/jobs`, `#/nodes/{id}`...) read the JSON endpoints below. In paths, `{job}` is a
/// finished job half-way through the history, `{node}` an alive node, `{far}` an offset near
/// the end of the job list and `{far_node}` one near the end of the node list. A new
/// endpoint is one more row.
const ENDPOINTS: &[(&str, &str, Asks)] = &[
    ("version", "/api/version", Asks::Leader),
    ("cluster", "/api/cluster", Asks::Leader),
    ("jobs", "/api/jobs", Asks::Leader),
    (
        "jobs_far_page",
        "/api/jobs?offset={far}&limit=50",
        Asks::Leader,
    ),
    (
        "jobs_succeeded_far_page",
        "/api/jobs?state=succeeded&offset={far}&limit=50",
        Asks::Leader,
    ),
    ("jobs_pending", "/api/jobs?state=pending", Asks::Leader),
    (
        "jobs_by_name",
        "/api/jobs?name=nightly&limit=100",
        Asks::Leader,
    ),
    (
        "jobs_all_far_page",
        "/api/jobs?all=true&offset={far}&limit=50",
        Asks::Leader,
    ),
    ("job", "/api/jobs/{job}", Asks::Leader),
    ("job_tasks", "/api/jobs/{job}/tasks", Asks::Nodes),
    ("job_logs", "/api/jobs/{job}/logs?tail=100", Asks::Nodes),
    ("nodes", "/api/nodes", Asks::Leader),
    (
        "nodes_far_page",
        "/api/nodes?state=alive&offset={far_node}&limit=50",
        Asks::Leader,
    ),
    ("node", "/api/nodes/{node}", Asks::Nodes),
    ("node_logs", "/api/nodes/{node}/logs?tail=100", Asks::Nodes),
    (
        "node_history",
        "/api/nodes/{node}/history?minutes=60",
        Asks::Leader,
    ),
    ("actors", "/api/actors", Asks::Leader),
    ("cache", "/api/cache", Asks::Leader),
    ("events", "/api/events", Asks::Leader),
    ("history", "/api/history?minutes=60", Asks::Leader),
    ("metrics", "/metrics", Asks::Leader),
    ("dashboard", "/", Asks::Leader),
    ("dashboard_js", "/assets/app.js", Asks::Leader),
    ("dashboard_css", "/assets/style.css", Asks::Leader),
];
/// Linux reports process CPU time in ticks of 1/100 s (USER_HZ) on every architecture.
const TICKS_PER_SECOND: f64 = 100.0;

/// The run's size.
struct Plan {
    nodes: usize,
    history_jobs: u64,
    /// Most jobs submitted and not yet finished during the pre-fill.
    window: u64,
    heartbeat_only: Duration,
    measure: Duration,
    /// Jobs submitted per second during the measured window.
    stream_rate: u64,
    snapshot_entries: u64,
}

impl Plan {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                nodes: 200,
                history_jobs: 5_000,
                window: 1_000,
                heartbeat_only: Duration::from_secs(5),
                measure: Duration::from_secs(10),
                stream_rate: 50,
                snapshot_entries: 1_000,
            }
        } else {
            Self {
                nodes: 1_000,
                history_jobs: 100_000,
                window: 5_000,
                heartbeat_only: Duration::from_secs(10),
                measure: Duration::from_secs(30),
                stream_rate: 100,
                snapshot_entries: 5_000,
            }
        }
    }
}

/// Which command a measured commit carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CommitKind {
    /// A client's `SubmitJob`, from the stream's own runtime.
    Submit,
    /// A driver's `FinishJob`, from the simulated drivers' runtime.
    Finish,
}

/// A commit while measuring: what it carried, when it was sent (ms since the run began) and
/// how long it took (ms).
#[derive(Debug, Clone, Copy)]
struct Commit {
    kind: CommitKind,
    sent_ms: f64,
    latency_ms: f64,
}

/// What the simulated nodes and submitters observed, shared by their tasks.
#[derive(Default)]
struct Observed {
    /// Latencies are kept only while this is set.
    measuring: AtomicBool,
    /// Heartbeat failures are expected only while this is set.
    failing_over: AtomicBool,
    heartbeat_ms: Mutex<Vec<f64>>,
    /// Commits (submissions and finishes) while measuring.
    commits: Mutex<Vec<Commit>>,
    heartbeats: AtomicU64,
    heartbeat_errors: AtomicU64,
    rejoins: AtomicU64,
    submitted: AtomicU64,
    finished: AtomicU64,
    finish_rejected: AtomicU64,
    grants: AtomicU64,
}

impl Observed {
    fn record(list: &Mutex<Vec<f64>>, value: f64) {
        list.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(value);
    }

    fn record_commit(&self, kind: CommitKind, began: Instant, sent: Instant) {
        if self.measuring.load(Ordering::Relaxed) {
            let commit = Commit {
                kind,
                sent_ms: millis(sent.duration_since(began)),
                latency_ms: millis(sent.elapsed()),
            };
            self.commits
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(commit);
        }
    }
}

/// Answers what a leader sends a node; a simulated node holds no objects and runs no tasks.
struct SimulatedNodes;

impl Handler<NodeProtocol> for SimulatedNodes {
    async fn handle(&self, _peer: Peer, request: NodeRequest) -> Result<NodeResponse, RemoteError> {
        match request {
            NodeRequest::Free { .. } | NodeRequest::FreeJob { .. } => Ok(NodeResponse::Freed),
            NodeRequest::CancelTask { .. } => Ok(NodeResponse::Cancelled),
            // No log files, and no driver's task table: real round trips with empty answers.
            NodeRequest::ReadLogs(_) => Ok(NodeResponse::Logs(Vec::new())),
            NodeRequest::JobTasks { .. } => Ok(NodeResponse::Tasks(None)),
            NodeRequest::Status => Ok(NodeResponse::Status(Box::new(NodeStatus {
                node: None,
                workers: 0,
                running: Vec::new(),
                tasks_finished: 0,
                tasks_failed: 0,
                workers_respawned: 0,
                pulls_started: 0,
                borrowed_bytes: 0,
                store: Default::default(),
                actors: Vec::new(),
                worker_slots: Vec::new(),
                largest_objects: Vec::new(),
                cpu_used_permille: 0,
                heap_used_bytes: 0,
                udf_pools: Vec::new(),
            }))),
            other => Err(RemoteError::new(
                RemoteErrorKind::BadRequest,
                format!("a simulated node runs no tasks or actors: {other:?}"),
            )),
        }
    }
}

/// One simulated node agent: its heartbeat connection, and its drivers' connection (as a
/// real agent's drivers have their own), both presenting the node's ticket.
struct SimulatedNode {
    id: NodeId,
    client: SchedulerClient,
    drivers: SchedulerClient,
}

impl SimulatedNode {
    async fn register(
        addrs: Vec<String>,
        wire: WireConfig,
        credentials: &LocalCredentials,
        rpc: String,
    ) -> anyhow::Result<Self> {
        let mut client = SchedulerClient::new(addrs.clone(), wire.clone())?;
        let (id, ticket) = client
            .register_node(
                NodeAddresses { rpc },
                Resources {
                    cpu_millis: 8_000,
                    heap_bytes: 16 << 30,
                },
                NodeMemory {
                    total_bytes: 32 << 30,
                    object_store_bytes: 8 << 30,
                    system_reserve_bytes: 2 << 30,
                },
                BTreeMap::new(),
                None,
            )
            .await?;
        // From now on every connection of this node presents its ticket, as an agent's does.
        wire.identity.set(Credential::Node {
            secret: credentials.cluster_secret.clone(),
            id,
            ticket,
        });
        let drivers = SchedulerClient::new(addrs, wire)?;
        Ok(Self {
            id,
            client,
            drivers,
        })
    }

    /// Heartbeats every second until `stop`, handing the drivers each heartbeat names to the
    /// node's driver task on `drivers` (see [`DRIVERS_THREAD`]), so a burst of jobs never
    /// delays a heartbeat.
    async fn run(
        self,
        drivers: tokio::runtime::Handle,
        observed: Arc<Observed>,
        began: Instant,
        stop: Arc<AtomicBool>,
    ) {
        let Self {
            id,
            mut client,
            drivers: driver_client,
        } = self;
        let (assign, assigned) = tokio::sync::mpsc::unbounded_channel();
        let observer = Arc::clone(&observed);
        let driving = drivers.spawn(drive(id, driver_client, assigned, observer, began));
        // Spread the nodes over the second, as independently started agents are.
        let offset = Duration::from_millis(id.get() * 7919 % 1000);
        tokio::time::sleep(offset).await;
        let mut ticks = tokio::time::interval(HEARTBEAT);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let usage = ResourceUsage {
            cpu_millis: 0,
            heap_bytes: 64 << 20,
            object_store_bytes: 0,
            spilled_bytes: 0,
            fallback_bytes: 0,
            workers: 4,
            workers_busy: 0,
            ..ResourceUsage::default()
        };
        while !stop.load(Ordering::Relaxed) {
            ticks.tick().await;
            let sent = Instant::now();
            match client.heartbeat(id, usage).await {
                Ok(HeartbeatReply::Accepted { drivers }) => {
                    observed.heartbeats.fetch_add(1, Ordering::Relaxed);
                    if observed.measuring.load(Ordering::Relaxed) {
                        Observed::record(&observed.heartbeat_ms, millis(sent.elapsed()));
                    }
                    if assign.send(drivers).is_err() {
                        break;
                    }
                }
                Ok(HeartbeatReply::Rejoin) => {
                    observed.rejoins.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(error) => {
                    if !observed.failing_over.load(Ordering::Relaxed) {
                        observed.heartbeat_errors.fetch_add(1, Ordering::Relaxed);
                        warn(&format!("node {id} heartbeat: {error}"));
                    }
                }
            }
        }
        driving.abort();
    }
}

/// A node's driver task: runs each (job, attempt) a heartbeat names once.
async fn drive(
    node: NodeId,
    mut client: SchedulerClient,
    mut assigned: tokio::sync::mpsc::UnboundedReceiver<Vec<(JobId, u32)>>,
    observed: Arc<Observed>,
    began: Instant,
) {
    // Drivers already run; a heartbeat that raced the last FinishJob names one again.
    let mut done = std::collections::BTreeSet::new();
    while let Some(drivers) = assigned.recv().await {
        for (job, attempt) in drivers {
            if !done.insert((job, attempt)) {
                continue;
            }
            if let Err(error) = run_driver(node, &mut client, job, attempt, &observed, began).await
            {
                warn(&format!("node {node}: job {job}: {error:#}"));
            }
        }
    }
}

/// What a driver of a one-task job asks of the leader: one lease, its return, and the job's
/// end.
async fn run_driver(
    node: NodeId,
    client: &mut SchedulerClient,
    job: JobId,
    attempt: u32,
    observed: &Observed,
    began: Instant,
) -> anyhow::Result<()> {
    const CPU: u64 = 100;
    let request = PlacementRequest {
        cpu_millis: CPU,
        memory_hint: 0,
        strategy: Strategy::Default,
        preferred: Vec::new(),
        requester: Some(node),
    };
    let grants = client
        .acquire_leases(job, vec![request], LEASE_WAIT)
        .await?;
    for decision in grants.decisions {
        match decision {
            LeaseDecision::Granted(lease) => {
                observed.grants.fetch_add(1, Ordering::Relaxed);
                client.return_leases(job, vec![lease.id]).await?;
            }
            LeaseDecision::NotNow => {
                anyhow::bail!("no room for one task's lease within {LEASE_WAIT:?}")
            }
            LeaseDecision::Refused(error) => return Err(error.into()),
        }
    }
    let outcome = JobOutcome {
        status: JobStatus::Succeeded,
        stats: JobStats {
            attempt,
            ..JobStats::default()
        },
        outputs: Vec::new(),
    };
    let sent = Instant::now();
    let answer = client
        .propose(Command::FinishJob {
            job,
            attempt,
            outcome,
        })
        .await?;
    observed.record_commit(CommitKind::Finish, began, sent);
    match answer {
        Outcome::Applied => observed.finished.fetch_add(1, Ordering::Relaxed),
        _ => observed.finish_rejected.fetch_add(1, Ordering::Relaxed),
    };
    Ok(())
}

/// The bench prints JSON on stdout; its own diagnostics go to stderr.
fn warn(message: &str) {
    eprintln!("scale: {message}");
}

/// A process's user + system CPU time, in seconds, from `/proc/<pid>/stat`.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("cannot read /proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at field 3 (state);
    // utime and stime are fields 14 and 15.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("no command name in /proc/<pid>/stat")?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |index: usize| -> anyhow::Result<f64> {
        Ok(fields
            .get(index)
            .context("/proc/<pid>/stat is short")?
            .parse::<f64>()?)
    };
    Ok((ticks(11)? + ticks(12)?) / TICKS_PER_SECOND)
}

/// Adds every replica's last snapshot to `snapshots`, by (replica, index).
async fn record_snapshots(
    cluster: &LocalSchedulers,
    snapshots: &mut BTreeMap<(u64, u64), SnapshotTiming>,
) -> anyhow::Result<()> {
    for replica in 1..=REPLICAS {
        if let Some(timing) = cluster.status(replica).await?.last_snapshot {
            snapshots.insert((replica, timing.index), timing);
        }
    }
    Ok(())
}

/// Every replica's WAL writes since it started, by replica.
async fn wal_writes_of(cluster: &LocalSchedulers) -> anyhow::Result<BTreeMap<u64, WalWrites>> {
    let mut writes = BTreeMap::new();
    for replica in 1..=REPLICAS {
        writes.insert(replica, cluster.status(replica).await?.wal_writes);
    }
    Ok(writes)
}

/// The leader's CPU share (of one core) over `window`.
async fn leader_cpu_share(pid: u32, window: Duration) -> anyhow::Result<f64> {
    let before = cpu_seconds(pid)?;
    let started = Instant::now();
    tokio::time::sleep(window).await;
    Ok((cpu_seconds(pid)? - before) / started.elapsed().as_secs_f64())
}

fn small_job_spec() -> anyhow::Result<Vec<u8>> {
    let plan = floe_client::Dataset::range(10)?.plan().resolve_seeds()?;
    Ok(JobSpec {
        plan,
        options: JobOptions::default(),
    }
    .encode()?)
}

async fn submit(
    client: &mut SchedulerClient,
    spec: &[u8],
    name: Option<String>,
    observed: &Observed,
    began: Instant,
) -> anyhow::Result<()> {
    let sent = Instant::now();
    client
        .submit_job(spec.to_vec(), SubmissionId::random(), name)
        .await?;
    observed.record_commit(CommitKind::Submit, began, sent);
    observed.submitted.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// The thread of the runtime the simulated nodes' drivers run on. A real driver runs in its
/// node agent's process, beside one heartbeat loop; on this process's runtime, which
/// simulates every node, a `FinishJob`'s reply would wait its turn behind a thousand
/// heartbeat tasks, and that wait is the bench's, not the leader's.
const DRIVERS_THREAD: &str = "simulated-drivers";

/// The thread of the runtime the stream's clients run on, as a client's own process would:
/// on the simulation's runtime a commit's reply waited its turn behind the nodes' tasks.
const CLIENTS_THREAD: &str = "stream-clients";

/// Clients submitting jobs during the measured window.
const STREAM_CLIENTS: u64 = 8;

/// The measured window's stream of jobs: each of `clients` (not connected yet: a client
/// connects on its first call, on the runtime that makes it) submits a job every `every`,
/// the clients spread evenly over the period, until `stop`.
struct StreamJobs {
    clients: Vec<SchedulerClient>,
    every: Duration,
    spec: Arc<[u8]>,
    observed: Arc<Observed>,
    began: Instant,
    stop: Arc<AtomicBool>,
}

impl StreamJobs {
    /// Connects every client with a job of its own, says so on `connected`, and streams once
    /// `start` comes (not at all if the bench drops it).
    async fn run(
        self,
        connected: tokio::sync::oneshot::Sender<()>,
        start: tokio::sync::oneshot::Receiver<()>,
    ) -> anyhow::Result<()> {
        let mut clients = self.clients;
        for client in &mut clients {
            submit(client, &self.spec, None, &self.observed, self.began).await?;
        }
        // The bench waits on the other end; gone, it has failed already.
        let _ = connected.send(());
        if start.await.is_err() {
            return Ok(());
        }
        let mut stream = JoinSet::new();
        let starting = tokio::time::Instant::now();
        let count = u32::try_from(clients.len()).unwrap_or(u32::MAX);
        for (place, mut client) in (0..count).zip(clients) {
            let (spec, observed) = (Arc::clone(&self.spec), Arc::clone(&self.observed));
            let (stop, every, began) = (Arc::clone(&self.stop), self.every, self.began);
            // Independent clients do not submit in step: each starts its own fraction of a
            // period later, so the leader sees a steady stream rather than bursts of eight.
            let first = starting + every * place / count;
            stream.spawn(async move {
                let mut ticks = tokio::time::interval_at(first, every);
                while !stop.load(Ordering::Relaxed) {
                    ticks.tick().await;
                    submit(&mut client, &spec, None, &observed, began).await?;
                }
                anyhow::Ok(())
            });
        }
        while let Some(joined) = stream.join_next().await {
            joined??;
        }
        Ok(())
    }
}

/// Waits until every submitted job has finished (or `timeout` passes).
async fn until_finished(observed: &Observed, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let submitted = observed.submitted.load(Ordering::Relaxed);
        let finished = observed.finished.load(Ordering::Relaxed);
        if finished >= submitted {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{} of {submitted} jobs unfinished after {timeout:?}",
            submitted - finished
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Pause between two round trips of [`WakeupProbe`]: about 15,000 trips in the measured
/// window, for a fraction of a percent of a core.
const PROBE_EVERY: Duration = Duration::from_millis(2);

/// The host's own wakeup tail, measured beside the commits: two threads of this process
/// bounce a byte over a socket pair, each round trip two wakeups. A commit is about ten
/// wakeups across four processes, so when the commits' tail and this one move together the
/// tail is the host's (on this VM, a woken thread that may not preempt waits for a 4 ms
/// tick), and a commit tail with a quiet probe is the scheduler's.
struct WakeupProbe {
    stop: StopOnDrop,
    prober: std::thread::JoinHandle<std::io::Result<Vec<f64>>>,
    echo: std::thread::JoinHandle<std::io::Result<()>>,
}

/// Raises its flag when dropped: a probe dropped unfinished (a run that failed) stops, and its
/// threads end on their own (the prober's loop, then the echo at the prober's socket's end).
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

impl WakeupProbe {
    fn start() -> anyhow::Result<Self> {
        use std::io::{Read, Write};
        let (mut near, mut far) =
            std::os::unix::net::UnixStream::pair().context("cannot make the probe's sockets")?;
        let echo = std::thread::Builder::new()
            .name("wakeup-echo".into())
            .spawn(move || {
                let mut byte = [0u8; 1];
                // Ends when the prober drops its end.
                while far.read(&mut byte)? == 1 {
                    far.write_all(&byte)?;
                }
                Ok(())
            })
            .context("cannot start the probe's echo")?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let prober = std::thread::Builder::new()
            .name("wakeup-probe".into())
            .spawn(move || {
                let mut trips = Vec::new();
                let mut byte = [0u8; 1];
                while !stopping.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    near.write_all(&byte)?;
                    near.read_exact(&mut byte)?;
                    trips.push(millis(sent.elapsed()));
                    std::thread::sleep(PROBE_EVERY);
                }
                Ok(trips)
            })
            .context("cannot start the probe")?;
        Ok(Self {
            stop: StopOnDrop(stop),
            prober,
            echo,
        })
    }

    /// Stops the probe; its round trips as JSON (count, p50, p99, longest, in ms).
    fn finish(self) -> anyhow::Result<serde_json::Value> {
        let Self { stop, prober, echo } = self;
        drop(stop);
        let joined = |what: &str| anyhow::anyhow!("the probe's {what} thread panicked");
        let mut trips = prober.join().map_err(|_| joined("prober"))??;
        echo.join().map_err(|_| joined("echo"))??;
        Ok(json!({
            "trips": trips.len(),
            "p50_ms": round3(percentile(&mut trips, 0.5)),
            "p99_ms": round3(percentile(&mut trips, 0.99)),
            "max_ms": round3(percentile(&mut trips, 1.0)),
        }))
    }
}

pub fn run(
    quick: bool,
    nodes: Option<usize>,
    jobs: Option<u64>,
    config: &Config,
) -> anyhow::Result<()> {
    let mut plan = Plan::new(quick);
    plan.nodes = nodes.unwrap_or(plan.nodes);
    plan.history_jobs = jobs.unwrap_or(plan.history_jobs);
    let dir = config
        .paths
        .data_dir
        .join(format!("bench-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let apart = Apart {
        drivers: runtime_of_its_own(DRIVERS_THREAD)?,
        clients: runtime_of_its_own(CLIENTS_THREAD)?,
    };
    let result = runtime.block_on(scale(&plan, &dir, &apart));
    runtime.shutdown_timeout(Duration::from_secs(1));
    apart.drivers.shutdown_timeout(Duration::from_secs(1));
    apart.clients.shutdown_timeout(Duration::from_secs(1));
    // Best effort: a leftover directory is visible and harmless.
    let _ = std::fs::remove_dir_all(&dir);
    let line = result?;
    println!("{line}");
    let correct = line["correct"].as_bool().unwrap_or(false);
    ensure!(correct, "the run was not correct: {}", line["correctness"]);
    Ok(())
}

/// The runtimes apart from the simulation's, each a thread of its own (see
/// [`DRIVERS_THREAD`] and [`CLIENTS_THREAD`]).
struct Apart {
    drivers: tokio::runtime::Runtime,
    clients: tokio::runtime::Runtime,
}

/// A runtime of one thread named `name`.
fn runtime_of_its_own(name: &str) -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(name)
        .enable_all()
        .build()
        .with_context(|| format!("cannot start the runtime {name}"))
}

async fn scale(
    plan: &Plan,
    dir: &std::path::Path,
    apart: &Apart,
) -> anyhow::Result<serde_json::Value> {
    let began = Instant::now();
    let credentials = LocalCredentials::generate(dir)?;
    let mut cluster = LocalSchedulers::start(LocalSchedulersConfig {
        binary: crate::floe_binary()?,
        replicas: REPLICAS,
        dir: dir.to_owned(),
        credentials: credentials.clone(),
        settings: vec![
            // Every job of the run stays in the replicated state: that is the state measured.
            format!("jobs.keep_finished={}", plan.history_jobs * 2),
            format!("scheduler.snapshot_entries={}", plan.snapshot_entries),
        ],
        tls: floe_core::config::TlsConfig::default(),
    })?;
    cluster.wait_for_leader(READY_TIMEOUT).await?;
    let addrs = cluster.addrs();

    let mut servers = Vec::new();
    for _ in 0..NODE_SERVERS {
        let bind: SocketAddr = "127.0.0.1:0".parse()?;
        servers.push(
            RpcServer::bind::<NodeProtocol, _>(
                bind,
                Arc::new(SimulatedNodes),
                credentials.member_wire(),
            )
            .await?,
        );
    }
    let server_addrs: Vec<String> = servers
        .iter()
        .map(|server| server.local_addr().to_string())
        .collect();

    // Register every node, CONCURRENCY at a time; each heartbeats as soon as it has
    // registered, as an agent does (a node silent for a node timeout is committed dead).
    let observed = Arc::new(Observed::default());
    let stop = Arc::new(AtomicBool::new(false));
    let registering = Instant::now();
    let mut nodes = Vec::new();
    let mut pending = JoinSet::new();
    for index in 0..plan.nodes {
        if pending.len() >= CONCURRENCY
            && let Some(joined) = pending.join_next().await
        {
            nodes.push(joined??);
        }
        let addrs = addrs.clone();
        let credentials = credentials.clone();
        let rpc = server_addrs[index % NODE_SERVERS].clone();
        let observed = Arc::clone(&observed);
        let stop = Arc::clone(&stop);
        let drivers = apart.drivers.handle().clone();
        pending.spawn(async move {
            let node = SimulatedNode::register(addrs, credentials.member_wire(), &credentials, rpc)
                .await?;
            anyhow::Ok(tokio::spawn(node.run(drivers, observed, began, stop)))
        });
    }
    while let Some(joined) = pending.join_next().await {
        nodes.push(joined??);
    }
    let register_ms = millis(registering.elapsed());
    let mut admin = cluster.client()?.with_retry_for(READY_TIMEOUT);
    let deadline = Instant::now() + READY_TIMEOUT;
    while admin.node_reports().await?.len() < plan.nodes {
        ensure!(
            Instant::now() < deadline,
            "not every node heartbeated to the leader"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let leader = cluster.wait_for_leader(READY_TIMEOUT).await?;
    let leader_pid = cluster.pid(leader).context("the leader has no process")?;

    // Heartbeats alone.
    observed.measuring.store(true, Ordering::Relaxed);
    let heartbeat_cpu_share = leader_cpu_share(leader_pid, plan.heartbeat_only).await?;
    observed.measuring.store(false, Ordering::Relaxed);
    let heartbeat_only_p99 = percentile(
        &mut observed
            .heartbeat_ms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
            .collect::<Vec<_>>(),
        0.99,
    );

    // Pre-fill the history through real commits.
    let spec: Arc<[u8]> = small_job_spec()?.into();
    let prefilling = Instant::now();
    let per_submitter = plan.history_jobs.div_ceil(PREFILL_SUBMITTERS);
    let mut submitters = JoinSet::new();
    for submitter in 0..PREFILL_SUBMITTERS {
        let mut client = cluster.client()?.with_retry_for(READY_TIMEOUT);
        let observed = Arc::clone(&observed);
        let spec = Arc::clone(&spec);
        let window = plan.window;
        submitters.spawn(async move {
            for n in 0..per_submitter {
                while observed.submitted.load(Ordering::Relaxed)
                    >= observed.finished.load(Ordering::Relaxed) + window
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let index = n * PREFILL_SUBMITTERS + submitter;
                let name = index
                    .is_multiple_of(NAMED_EVERY)
                    .then(|| format!("nightly-{index}"));
                submit(&mut client, &spec, name, &observed, began).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(joined) = submitters.join_next().await {
        joined??;
    }
    until_finished(&observed, READY_TIMEOUT).await?;
    let prefill = prefilling.elapsed();
    let prefilled = observed.finished.load(Ordering::Relaxed);

    // The stream's clients run on a runtime of their own (see `CLIENTS_THREAD`). Each connects
    // to the leader with a job of its own before the window (a client connects on its first
    // call, and is redirected when it asked a follower, which is no commit's latency).
    let stream_stop = Arc::new(AtomicBool::new(false));
    let (connected, stream_connected) = tokio::sync::oneshot::channel();
    let (start_stream, started) = tokio::sync::oneshot::channel();
    let stream = {
        let clients = (0..STREAM_CLIENTS)
            .map(|_| Ok(cluster.client()?.with_retry_for(READY_TIMEOUT)))
            .collect::<anyhow::Result<_>>()?;
        let jobs = StreamJobs {
            clients,
            every: Duration::from_secs_f64(STREAM_CLIENTS as f64 / plan.stream_rate as f64),
            spec: Arc::clone(&spec),
            observed: Arc::clone(&observed),
            began,
            stop: Arc::clone(&stream_stop),
        };
        apart.clients.spawn(jobs.run(connected, started))
    };
    stream_connected
        .await
        .context("the stream's clients did not connect")?;
    until_finished(&observed, READY_TIMEOUT).await?;

    // The measured window: a steady stream of jobs. Each replica's WAL writes are read at
    // its edges, so their figures cover the window alone.
    let window_from_ms = millis(began.elapsed());
    let wal_before = wal_writes_of(&cluster).await?;
    observed.measuring.store(true, Ordering::Relaxed);
    let grants_before = observed.grants.load(Ordering::Relaxed);
    let finished_before = observed.finished.load(Ordering::Relaxed);
    // Gone only if the stream failed, which awaiting it below reports.
    let _ = start_stream.send(());
    // Every replica's snapshots, by (replica, index): a follower's build slows the commits
    // it is part of the quorum of as much as the leader's.
    let mut snapshots: BTreeMap<(u64, u64), SnapshotTiming> = BTreeMap::new();
    let probe = WakeupProbe::start()?;
    let measuring = Instant::now();
    let cpu_before = cpu_seconds(leader_pid)?;
    while measuring.elapsed() < plan.measure {
        record_snapshots(&cluster, &mut snapshots).await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let measured = measuring.elapsed();
    let stream_cpu_share = (cpu_seconds(leader_pid)? - cpu_before) / measured.as_secs_f64();
    let host_wakeups = probe.finish()?;
    stream_stop.store(true, Ordering::Relaxed);
    stream.await??;
    observed.measuring.store(false, Ordering::Relaxed);
    let wal_after = wal_writes_of(&cluster).await?;
    let window_to_ms = millis(began.elapsed());
    let grants_per_s =
        (observed.grants.load(Ordering::Relaxed) - grants_before) as f64 / measured.as_secs_f64();
    let jobs_per_s = (observed.finished.load(Ordering::Relaxed) - finished_before) as f64
        / measured.as_secs_f64();
    until_finished(&observed, READY_TIMEOUT).await?;
    record_snapshots(&cluster, &mut snapshots).await?;

    let mut heartbeat_ms: Vec<f64> = observed
        .heartbeat_ms
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let commits: Vec<Commit> = observed
        .commits
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let mut commit_ms: Vec<f64> = commits.iter().map(|commit| commit.latency_ms).collect();
    // Snapshots built within the window, on the bench's clock (same host, same wall clock).
    let since_epoch = |at_ms: u64| {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |since| since.as_secs_f64() * 1e3);
        millis(began.elapsed()) - (now_ms - at_ms as f64)
    };
    // Each build's replica and span.
    let windows: Vec<(u64, f64, f64)> = snapshots
        .iter()
        .map(|((replica, _), timing)| {
            (
                *replica,
                since_epoch(timing.started_at_ms),
                since_epoch(timing.finished_at_ms),
            )
        })
        .collect();
    let builds_overlapping = |commit: &Commit| {
        let (sent, done) = (commit.sent_ms, commit.sent_ms + commit.latency_ms);
        windows
            .iter()
            .filter(move |(_, start, end)| sent <= *end && done >= *start)
    };
    let (during, outside): (Vec<Commit>, Vec<Commit>) = commits
        .iter()
        .partition(|commit| builds_overlapping(commit).next().is_some());
    let latencies = |commits: &[Commit], kind: Option<CommitKind>| -> Vec<f64> {
        commits
            .iter()
            .filter(|commit| kind.is_none_or(|kind| commit.kind == kind))
            .map(|commit| commit.latency_ms)
            .collect()
    };
    let longest = |latencies: &[f64]| latencies.iter().copied().reduce(f64::max);
    // Whether a snapshot adds latency, as against the disk's own tail: the commits that
    // overlapped a build against those that did not.
    let quantile = |mut latencies: Vec<f64>, fraction: f64| {
        (!latencies.is_empty()).then(|| round(percentile(&mut latencies, fraction)))
    };
    let snapshot_stall_ms = longest(&latencies(&during, None));
    let commit_max_outside_snapshots_ms = longest(&latencies(&outside, None)).map(round);
    let commit_p99_during_snapshots_ms = quantile(latencies(&during, None), 0.99);
    let commit_p99_outside_snapshots_ms = quantile(latencies(&outside, None), 0.99);
    // Each command apart: a submission comes from a client's runtime, a finish from a
    // driver's, so a tail that only one of them has is the bench's, not the leader's.
    let by_kind = |kind: CommitKind| {
        let all = latencies(&commits, Some(kind));
        json!({
            "commits": all.len(),
            "p50_ms": quantile(all.clone(), 0.5),
            "p99_ms": quantile(all, 0.99),
            "snapshot_stall_ms": longest(&latencies(&during, Some(kind))).map(round),
            "max_outside_snapshots_ms": longest(&latencies(&outside, Some(kind))).map(round),
        })
    };
    let commits_by_kind = json!({
        "submit": by_kind(CommitKind::Submit),
        "finish": by_kind(CommitKind::Finish),
    });
    // Each replica's slow WAL writes on the bench's clock, as (start, end): a commit waits
    // for the leader's write and a follower's, so a slow commit that overlapped slow writes
    // on two replicas waited on the disk.
    let slow_writes: BTreeMap<u64, Vec<(f64, f64)>> = wal_after
        .iter()
        .map(|(replica, writes)| {
            let spans = writes
                .slow
                .iter()
                .map(|write| {
                    let end = since_epoch(write.finished_at_ms);
                    (end - write.took_us as f64 / 1e3, end)
                })
                .collect();
            (*replica, spans)
        })
        .collect();
    // How long each of `spans` took that overlapped `from..=to`.
    let overlapping = |spans: &[(f64, f64)], from: f64, to: f64| -> Vec<f64> {
        spans
            .iter()
            .filter(|(start, end)| *end >= from && *start <= to)
            .map(|(start, end)| end - start)
            .collect()
    };
    // The window's writes: the counts' difference, and the slow ones kept that fall in it
    // (`slow_kept` below `slow` means the oldest of them were let go).
    let per_replica_figures: serde_json::Map<String, serde_json::Value> = wal_after
        .iter()
        .map(|(replica, after)| {
            let before = &wal_before[replica];
            let writes = after.writes.saturating_sub(before.writes);
            let total_us = after.total_us.saturating_sub(before.total_us);
            let kept = overlapping(&slow_writes[replica], window_from_ms, window_to_ms);
            let figures = json!({
                "writes": writes,
                "mean_ms": (writes > 0).then(|| round3(total_us as f64 / writes as f64 / 1e3)),
                "slow": after.slow_writes.saturating_sub(before.slow_writes),
                "slow_kept": kept.len(),
                "longest_kept_ms": longest(&kept).map(round),
            });
            (replica.to_string(), figures)
        })
        .collect();
    // The longest of a replica's slow writes that overlapped `commit`, per replica.
    let writes_during = |commit: &Commit| -> serde_json::Value {
        let (from, to) = (commit.sent_ms, commit.sent_ms + commit.latency_ms);
        let per_replica: serde_json::Map<String, serde_json::Value> = slow_writes
            .iter()
            .map(|(replica, spans)| {
                let took = overlapping(spans, from, to);
                (replica.to_string(), json!(longest(&took).map(round)))
            })
            .collect();
        // Where in each build it overlapped the commit was sent, so a tail that sits in
        // one phase of the builds (encoding first, the files last) points at that phase.
        let builds: Vec<serde_json::Value> = builds_overlapping(commit)
            .map(|(replica, start, end)| {
                json!({
                    "replica": replica,
                    "sent_after_start_ms": round(commit.sent_ms - start),
                    "build_ms": round(end - start),
                })
            })
            .collect();
        json!({
            "ms": round(commit.latency_ms),
            "kind": format!("{:?}", commit.kind).to_lowercase(),
            "slow_wal_writes_ms": per_replica,
            "builds": builds,
        })
    };
    let slowest = |commits: &[Commit]| {
        commits
            .iter()
            .max_by(|a, b| a.latency_ms.total_cmp(&b.latency_ms))
            .map(writes_during)
    };
    let wal_figures = json!({
        "leader": leader,
        "replicas": per_replica_figures,
        "slowest_commit_during_snapshots": slowest(&during),
        "slowest_commit_outside_snapshots": slowest(&outside),
    });
    let largest = snapshots
        .values()
        .max_by_key(|timing| timing.index)
        .copied();

    // The whole state, and the REST job list, at this size.
    let state = admin.read_state().await?;
    let state_bytes = state.encode()?.len();
    let jobs_in_state = state.jobs.len();
    let alive_before = state.alive_nodes().count();
    let http = cluster
        .http_addr(leader)
        .context("the leader has no HTTP address")?
        .to_owned();
    let mut failures = Vec::new();
    let token = credentials.admin_token.expose();
    failures.extend(check_job_totals(&http, token, &state).await?);
    let middle_job = state
        .ended
        .iter()
        .nth(state.ended.len() / 2)
        .map(|(_, job)| *job)
        .context("no finished job in the state")?;
    let alive_node = state
        .alive_nodes()
        .next()
        .map(|node| node.id)
        .context("no alive node in the state")?;
    let fill = |path: &str| {
        path.replace("{job}", &middle_job.to_string())
            .replace("{node}", &alive_node.to_string())
            .replace("{far}", &jobs_in_state.saturating_sub(50).to_string())
            .replace("{far_node}", &alive_before.saturating_sub(50).to_string())
    };
    let mut endpoints = serde_json::Map::new();
    let mut slowest: BTreeMap<bool, (f64, &str)> = BTreeMap::new();
    for (name, path, asks) in ENDPOINTS {
        let path = fill(path);
        let mut times = Vec::new();
        for _ in 0..API_CALLS {
            let answer = http_get(&http, &path, token).await?;
            if answer.status != 200 {
                failures.push(format!(
                    "GET {path} answered {}: {}",
                    answer.status,
                    answer.body_start()
                ));
            }
            times.push(answer.ms);
        }
        let median = percentile(&mut times, 0.5);
        endpoints.insert((*name).to_owned(), json!(round(median)));
        let worst = slowest.entry(*asks == Asks::Nodes).or_insert((0.0, name));
        if median >= worst.0 {
            *worst = (median, name);
        }
    }
    let api_jobs_ms = endpoints["jobs"].as_f64().unwrap_or(f64::NAN);
    let (api_max_ms, api_slowest) = slowest.get(&false).copied().unwrap_or((0.0, ""));
    let (api_nodes_max_ms, api_nodes_slowest) = slowest.get(&true).copied().unwrap_or((0.0, ""));
    let leader_rss = rss_bytes(leader_pid);

    // Failover at this size.
    observed.failing_over.store(true, Ordering::Relaxed);
    let mut probe = cluster.client()?.with_retry_for(READY_TIMEOUT);
    submit(&mut probe, &spec, None, &observed, began).await?;
    cluster.kill(leader)?;
    let killed = Instant::now();
    submit(&mut probe, &spec, None, &observed, began).await?;
    let failover_ms = millis(killed.elapsed());
    // Every node must reach the new leader before it would declare it dead.
    tokio::time::sleep(Duration::from_secs(7)).await;
    observed.failing_over.store(false, Ordering::Relaxed);
    until_finished(&observed, READY_TIMEOUT).await?;
    let after = probe.read_state().await?;
    let alive_after = after.alive_nodes().count();
    let reports_after = probe.node_reports().await?.len();

    stop.store(true, Ordering::Relaxed);
    for node in nodes {
        node.abort();
    }
    drop(servers);

    let rejoins = observed.rejoins.load(Ordering::Relaxed);
    let heartbeat_errors = observed.heartbeat_errors.load(Ordering::Relaxed);
    let finish_rejected = observed.finish_rejected.load(Ordering::Relaxed);
    if rejoins > 0 {
        failures.push(format!(
            "{rejoins} nodes were declared dead and told to rejoin"
        ));
    }
    if heartbeat_errors > 0 {
        failures.push(format!(
            "{heartbeat_errors} heartbeats failed outside the failover"
        ));
    }
    if finish_rejected > 0 {
        failures.push(format!(
            "{finish_rejected} FinishJob commands were rejected"
        ));
    }
    for (what, count) in [
        ("alive before the failover", alive_before),
        ("alive after the failover", alive_after),
        ("heartbeating to the new leader", reports_after),
    ] {
        if count != plan.nodes {
            failures.push(format!("{count} of {} nodes {what}", plan.nodes));
        }
    }
    let heartbeat_p99_ms = percentile(&mut heartbeat_ms, 0.99);
    let commit_p99_ms = percentile(&mut commit_ms, 0.99);
    let snapshot_build_ms = largest.map(|timing| timing.build_ms);
    let builds_cpu_ms: Vec<serde_json::Value> = snapshots
        .iter()
        .map(|((replica, index), timing)| {
            json!({
                "replica": replica,
                "index": index,
                "cpu_ms": timing.build_cpu_ms,
                "build_ms": timing.build_ms,
                "written_bytes": timing.written_bytes,
            })
        })
        .collect();
    let on_loop_ms = |micros: fn(&SnapshotTiming) -> u64| {
        snapshots
            .values()
            .map(|timing| micros(timing) as f64 / 1e3)
            .reduce(f64::max)
    };
    let targets = json!({
        "heartbeat_cpu_share_le_0_25": heartbeat_cpu_share <= 0.25,
        "commit_p99_le_20ms": commit_p99_ms <= 20.0,
        "failover_le_3s": failover_ms <= 3_000.0,
        "snapshot_build_le_1s": snapshot_build_ms.map(|ms| ms <= 1_000),
        "snapshot_stall_le_5ms": snapshot_stall_ms.map(|ms| ms <= 5.0),
        "api_max_le_300ms": api_max_ms <= API_TARGET_MS,
        "api_nodes_max_le_300ms": api_nodes_max_ms <= API_TARGET_MS,
    });
    Ok(json!({
        "bench": "scale",
        "nodes": plan.nodes,
        "jobs_in_history": prefilled,
        "jobs_in_state": jobs_in_state,
        "register_ms": round(register_ms),
        "prefill_s": round(prefill.as_secs_f64()),
        "prefill_jobs_per_s": round(prefilled as f64 / prefill.as_secs_f64()),
        "leader_cpu_share": round3(heartbeat_cpu_share),
        "leader_cpu_share_with_jobs": round3(stream_cpu_share),
        "heartbeat_only_p99_ms": round(heartbeat_only_p99),
        "heartbeat_p99_ms": round(heartbeat_p99_ms),
        "heartbeats": observed.heartbeats.load(Ordering::Relaxed),
        "commit_p50_ms": round(percentile(&mut commit_ms, 0.5)),
        "commit_p99_ms": round(commit_p99_ms),
        "commit_max_ms": round(percentile(&mut commit_ms, 1.0)),
        "commits_measured": commit_ms.len(),
        "jobs_per_s": round(jobs_per_s),
        "grants_per_s": round(grants_per_s),
        "snapshots_in_window": snapshots.len(),
        "snapshot_index": largest.map(|timing| timing.index),
        "snapshot_bytes": largest.map(|timing| timing.bytes),
        "snapshot_build_ms": snapshot_build_ms,
        "snapshot_build_cpu_ms": largest.map(|timing| timing.build_cpu_ms),
        "snapshot_build_cpu_ms_all": builds_cpu_ms,
        "snapshot_reused_bytes": largest.map(|timing| timing.reused_bytes),
        "snapshot_written_bytes": largest.map(|timing| timing.written_bytes),
        "snapshot_copy_max_ms": on_loop_ms(|timing| timing.copy_us),
        "snapshot_keep_max_ms": on_loop_ms(|timing| timing.keep_us),
        "snapshot_stall_ms": snapshot_stall_ms.map(round),
        "commit_p99_during_snapshots_ms": commit_p99_during_snapshots_ms,
        "commit_p99_outside_snapshots_ms": commit_p99_outside_snapshots_ms,
        "commit_max_outside_snapshots_ms": commit_max_outside_snapshots_ms,
        "commits_by_kind": commits_by_kind,
        "host_wakeup_round_trip": host_wakeups,
        "wal_writes": wal_figures,
        "state_bytes": state_bytes,
        "leader_rss_bytes": leader_rss,
        "api_jobs_ms": round(api_jobs_ms),
        "api_max_ms": round(api_max_ms),
        "api_slowest": api_slowest,
        "api_nodes_max_ms": round(api_nodes_max_ms),
        "api_nodes_slowest": api_nodes_slowest,
        "api_ms": endpoints,
        "failover_ms": round(failover_ms),
        "targets_met": targets,
        "correct": failures.is_empty(),
        "correctness": failures,
    }))
}

/// `GET /api/jobs` totals and per-status counts (kept by `apply`) against a count of the
/// jobs in `state` (read through `ReadState`): what differs, if anything. The HTTP API reads
/// the copy its replica publishes every 250 ms, so it is first awaited at `state`'s index.
async fn check_job_totals(
    http: &str,
    token: &str,
    state: &floe_api::state::ClusterState,
) -> anyhow::Result<Vec<String>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answer = http_get(http, "/api/cluster", token).await?;
        let cluster: serde_json::Value =
            serde_json::from_slice(&answer.body).context("GET /api/cluster: not JSON")?;
        let as_of = cluster["as_of_index"].as_u64().unwrap_or(0);
        if as_of >= state.applied_index {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the HTTP API's state stayed at index {as_of}, behind {}",
            state.applied_index
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let answer = http_get(http, "/api/jobs?limit=1", token).await?;
    ensure!(
        answer.status == 200,
        "GET /api/jobs answered {}: {}",
        answer.status,
        answer.body_start()
    );
    let body: serde_json::Value =
        serde_json::from_slice(&answer.body).context("GET /api/jobs: not JSON")?;
    let mut counted: BTreeMap<&str, u64> = BTreeMap::new();
    for job in state.jobs.values() {
        *counted.entry(job.status.name()).or_default() += 1;
    }
    let mut wrong = Vec::new();
    if body["total"].as_u64() != Some(state.jobs.len() as u64) {
        wrong.push(format!(
            "GET /api/jobs total {} for {} jobs in the state",
            body["total"],
            state.jobs.len()
        ));
    }
    for status in ["pending", "running", "succeeded", "failed", "cancelled"] {
        let expected = counted.get(status).copied().unwrap_or(0);
        if body["counts"][status].as_u64() != Some(expected) {
            wrong.push(format!(
                "GET /api/jobs counts {status} as {}, the state holds {expected}",
                body["counts"][status]
            ));
        }
    }
    Ok(wrong)
}

fn round(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

fn round3(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_used_some_cpu() {
        let spin = Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(50) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        assert!(cpu_seconds(std::process::id()).unwrap() > 0.0);
    }

    #[test]
    fn the_wakeup_probe_times_round_trips_until_it_is_finished() {
        let probe = WakeupProbe::start().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let figures = probe.finish().unwrap();
        // One trip every 2 ms at most, and at least a few in 200 ms however busy the host.
        let trips = figures["trips"].as_u64().unwrap();
        assert!((5..=101).contains(&trips), "{figures}");
        let (p50, p99, max) = (
            figures["p50_ms"].as_f64().unwrap(),
            figures["p99_ms"].as_f64().unwrap(),
            figures["max_ms"].as_f64().unwrap(),
        );
        assert!(
            0.0 <= p50 && p50 <= p99 && p99 <= max && max < 200.0,
            "{figures}"
        );
    }
}
