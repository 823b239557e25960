//! `floe-bench transfer` and `floe-bench tasks`: node agents as real `floe node` processes
//! (with their `floe worker`s) against one `floe scheduler`, on loopback.
//!
//! - `transfer_gbps`: one object pulled by node B from node A (chunks over parallel
//!   connections, checksum verified on arrival, written into B's store), against `tcp_gbps`,
//!   the same number of bytes copied through one loopback TCP connection in the same run;
//! - `transfer_tls_gbps`: the same pull between two nodes of a second cluster that runs TLS
//!   (a throwaway CA, mutual TLS between the nodes), its runs interleaved with the plaintext
//!   ones, and `tls_to_plaintext`, the ratio of the two;
//! - `empty_tasks_per_s`: tasks that do nothing, sent by concurrent clients to one node and run
//!   by its worker processes (RPC to the agent, Unix socket to a worker and back);
//! - `leased_tasks_per_s_per_node`: the same tasks placed as a job's driver places them, in
//!   leases the scheduler's leader granted the bench's job (`floe_driver::leases`, the driver's
//!   own code), each asking a sixteenth of a CPU so 32 run at once; and
//!   `leased_cpu_tasks_per_s_per_node` with a whole CPU each, as the driver's tasks ask (two at
//!   once on two CPUs). The leader must reserve nothing on the node after each run, or the
//!   bench fails.
//!
//! Both send real stage tasks, as a job's driver does: the object is one block made by a
//! range stage, and an empty task is a range stage over no ids. (The test-only task kinds
//! stay out of the binary the benchmarks start.) Each figure is the median of several runs
//! (one with `--quick`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use floe_api::client::SchedulerClient;
use floe_api::lease::{Lease, LeaseGrants, LeaseStanding};
use floe_api::node_protocol::{
    NodeProtocol, NodeRequest, NodeResponse, OutputRef, TaskKind, TaskSpec,
};
use floe_api::placement::{PlacementRequest, Strategy};
use floe_api::scheduler_protocol::ResourceUsage;
use floe_api::state::{
    Command, JobOutcome, JobStatus, NodeAddresses, NodeMemory, Outcome, Resources,
};
use floe_client::local::{LocalCredentials, LocalNode, LocalNodeConfig};
use floe_client::local::{LocalSchedulers, LocalSchedulersConfig};
use floe_core::TaskId;
use floe_core::auth::Credential;
use floe_core::config::{Config, TlsConfig};
use floe_core::job::{JobOptions, JobSpec, JobStats};
use floe_core::plan::LogicalPlan;
use floe_core::plan::physical::PhysicalPlan;
use floe_core::plan::task::{StageInput, StageTask};
use floe_core::wire::{RpcClient, WireConfig};
use floe_core::{JobId, LeaseId, NodeId, SubmissionId};
use floe_driver::leases::{JobLeases, LeaseService, LeaseStats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{gbps, print_figure};

const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Frames large enough for a task to return the whole transferred object in one reply.
const MAX_FRAME: &str = "net.max_frame=1GiB";
/// Client connections sending empty tasks at once.
const TASK_CLIENTS: usize = 32;

/// How a bench cluster's processes talk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Plaintext,
    /// TLS with a throwaway CA generated in the bench's directory.
    Tls,
}

/// The scheduler, the nodes and their directory, removed when dropped.
struct Bench {
    dir: PathBuf,
    credentials: LocalCredentials,
    /// The members' TLS files; empty for plaintext.
    tls: TlsConfig,
    cluster: LocalSchedulers,
    nodes: Vec<LocalNode>,
}

impl Bench {
    async fn start(config: &Config, part: &str, transport: Transport) -> anyhow::Result<Self> {
        let dir = config
            .paths
            .data_dir
            .join(format!("bench-{part}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let tls = match transport {
            Transport::Plaintext => TlsConfig::default(),
            Transport::Tls => floe_core::wire::tls::generate_throwaway(&dir, &[])?,
        };
        let credentials = LocalCredentials::generate(&dir)?;
        let cluster = LocalSchedulers::start(LocalSchedulersConfig {
            binary: crate::floe_binary()?,
            replicas: 1,
            dir: dir.clone(),
            credentials: credentials.clone(),
            settings: Vec::new(),
            tls: tls.clone(),
        })?;
        cluster.wait_for_leader(READY_TIMEOUT).await?;
        Ok(Self {
            dir,
            credentials,
            tls,
            cluster,
            nodes: Vec::new(),
        })
    }

    /// Talks to the nodes as a cluster member, with frames up to 1 GiB.
    fn wire(&self) -> WireConfig {
        let mut config = self.credentials.config();
        config.net.max_frame = floe_core::config::ByteSize::gib(1);
        WireConfig::member(&config).with_tls(&self.tls)
    }

    async fn add_node(&mut self, workers: u32, settings: &[&str]) -> anyhow::Result<String> {
        let mut all = vec![format!("node.workers={workers}"), MAX_FRAME.to_owned()];
        all.extend(self.tls.settings());
        all.extend(settings.iter().map(|setting| (*setting).to_owned()));
        let node = LocalNode::start(&LocalNodeConfig {
            binary: crate::floe_binary()?,
            schedulers: self.cluster.addrs(),
            dir: self.dir.clone(),
            name: format!("node-{}", self.nodes.len()),
            credentials: self.credentials.clone(),
            settings: all,
        })?;
        node.wait_ready(&self.wire(), workers, READY_TIMEOUT)
            .await?;
        let addr = node.addr().to_owned();
        self.nodes.push(node);
        Ok(addr)
    }

    async fn call(&self, addr: &str, request: &NodeRequest) -> anyhow::Result<NodeResponse> {
        let mut client = RpcClient::<NodeProtocol>::connect(addr, self.wire()).await?;
        Ok(client.call(request).await?)
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        self.nodes.clear();
        // Best effort: a leftover directory is visible and harmless.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A task of the range stage over `rows` ids that makes them one block (none for 0 rows):
/// `8 × rows` bytes of Int64 ids.
fn range_task(task: TaskId, rows: u64) -> anyhow::Result<TaskSpec> {
    let plan = PhysicalPlan::from_logical(&LogicalPlan::range(rows)?);
    let stage = plan.stage(plan.output).clone();
    let bytes = rows.saturating_mul(8).max(1);
    Ok(TaskSpec {
        task,
        job: floe_core::JobId::new(1),
        kind: TaskKind::Stage(Box::new(StageTask {
            stage,
            input: StageInput::Range {
                start: 0,
                end: rows,
            },
            input_schemas: Vec::new(),
            // One block: neither coalesced with nothing nor split.
            min_block_bytes: bytes,
            max_block_bytes: bytes,
            batch_rows: u32::try_from(rows.max(1)).context("too many rows for one batch")?,
            sink: None,
            source: None,
        })),
        inputs: Vec::new(),
    })
}

pub fn run_transfer(quick: bool, config: &Config) -> anyhow::Result<()> {
    let (size, runs) = if quick { (64 << 20, 1) } else { (256 << 20, 5) };
    runtime()?.block_on(measure_transfer(config, size, runs))
}

/// Two nodes of one bench cluster, the first holding an object for the second to pull.
struct TransferPair {
    bench: Bench,
    holder: String,
    puller: String,
    object: OutputRef,
}

impl TransferPair {
    async fn start(
        config: &Config,
        part: &str,
        transport: Transport,
        size: u64,
    ) -> anyhow::Result<Self> {
        let mut bench = Bench::start(config, part, transport).await?;
        // Stores of 30% of 4 GiB hold the object with room to spare.
        let memory = ["memory.total=4GiB"];
        let holder = bench.add_node(1, &memory).await?;
        let puller = bench.add_node(1, &memory).await?;
        let spec = range_task(TaskId::new(1), size / 8)?;
        let object = match bench.call(&holder, &NodeRequest::RunTask(spec)).await? {
            NodeResponse::Task {
                result: Ok(done), ..
            } => match done.outputs.as_slice() {
                [object] => object.clone(),
                other => anyhow::bail!("the range task made {} blocks, not one", other.len()),
            },
            other => anyhow::bail!("cannot create the object: {other:?}"),
        };
        Ok(Self {
            bench,
            holder,
            puller,
            object,
        })
    }

    /// Pulls the object once and frees the copy; returns the pull's rate in GB/s.
    async fn pull(&self) -> anyhow::Result<f64> {
        let size = self.object.size;
        let start = Instant::now();
        let pull = NodeRequest::Pull {
            object: self.object.object,
            holder: self.holder.clone(),
        };
        match self.bench.call(&self.puller, &pull).await? {
            // The copy's size and checksum are the block's (a pull does not know its rows).
            NodeResponse::Pulled(pulled)
                if (pulled.object, pulled.size, pulled.checksum)
                    == (self.object.object, self.object.size, self.object.checksum) => {}
            other => anyhow::bail!("the pull returned {other:?}, expected {:?}", self.object),
        }
        let rate = gbps(size, start.elapsed());
        let free = NodeRequest::Free {
            objects: vec![self.object.object],
        };
        self.bench.call(&self.puller, &free).await?;
        Ok(rate)
    }
}

async fn measure_transfer(config: &Config, size: u64, runs: usize) -> anyhow::Result<()> {
    let plaintext = TransferPair::start(config, "transfer", Transport::Plaintext, size).await?;
    let tls = TransferPair::start(config, "transfer-tls", Transport::Tls, size).await?;
    // The block's bytes: its ids and the Arrow IPC framing around them.
    let size = plaintext.object.size;
    let mut transfer = Vec::new();
    let mut transfer_tls = Vec::new();
    let mut tcp = Vec::new();
    // Interleaved, so a noisy neighbour slows both kinds alike.
    for _ in 0..runs {
        transfer.push(plaintext.pull().await?);
        transfer_tls.push(tls.pull().await?);
        tcp.push(gbps(size, tcp_copy(size).await?));
    }
    let labels = [("bytes", size.into()), ("chunk", "5MiB".into())];
    let transfer = median(&mut transfer);
    let transfer_tls = median(&mut transfer_tls);
    let tcp = median(&mut tcp);
    print_figure("transfer", "transfer_gbps", transfer, "GB/s", &labels);
    print_figure("transfer", "tcp_gbps", tcp, "GB/s", &labels);
    print_figure(
        "transfer",
        "transfer_to_tcp",
        transfer / tcp,
        "ratio",
        &labels,
    );
    print_figure(
        "transfer",
        "transfer_tls_gbps",
        transfer_tls,
        "GB/s",
        &labels,
    );
    print_figure(
        "transfer",
        "tls_to_plaintext",
        transfer_tls / transfer,
        "ratio",
        &labels,
    );
    Ok(())
}

/// Copies `size` bytes through one loopback TCP connection, 5 MiB per write.
async fn tcp_copy(size: u64) -> anyhow::Result<Duration> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let reader = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await?;
        let mut buffer = vec![0u8; 5 << 20];
        let mut received = 0u64;
        loop {
            let read = socket.read(&mut buffer).await?;
            if read == 0 {
                return anyhow::Ok(received);
            }
            received += read as u64;
        }
    });
    let chunk = vec![1u8; 5 << 20];
    let start = Instant::now();
    let mut socket = tokio::net::TcpStream::connect(addr).await?;
    let mut sent = 0u64;
    while sent < size {
        let len = (size - sent).min(chunk.len() as u64) as usize;
        socket.write_all(&chunk[..len]).await?;
        sent += len as u64;
    }
    socket.shutdown().await?;
    let received = reader.await??;
    let elapsed = start.elapsed();
    anyhow::ensure!(received == size, "received {received} of {size} bytes");
    Ok(elapsed)
}

pub fn run_tasks(quick: bool, config: &Config) -> anyhow::Result<()> {
    let (tasks, runs) = if quick { (2_000, 1) } else { (20_000, 3) };
    runtime()?.block_on(measure_tasks(config, tasks, runs))
}

/// What each leased empty task asks for: a sixteenth of a CPU, so that 32 run at once on the
/// node's two, as the direct figure's 32 clients do. A real driver's task asks a whole CPU
/// ([`WHOLE_TASK_CPU_MILLIS`]), which the second leased figure uses.
const LIGHT_TASK_CPU_MILLIS: u64 = 1000 / 16;
const WHOLE_TASK_CPU_MILLIS: u64 = 1000;
/// The target for tasks placed in leases, per node (issue #26).
const LEASED_TASKS_TARGET_PER_S: f64 = 20_000.0;

async fn measure_tasks(config: &Config, tasks: usize, runs: usize) -> anyhow::Result<()> {
    let mut bench = Bench::start(config, "tasks", Transport::Plaintext).await?;
    // The bench drives a job before the node joins, so the leader picks it as the driver (it
    // offers nothing to lease, so every lease is on the node).
    let driver = Arc::new(BenchDriver::start(&bench).await?);
    let cpus = std::thread::available_parallelism().map_or(1, |cpus| cpus.get());
    let workers = u32::try_from(cpus).unwrap_or(1);
    let node_addr = bench.add_node(workers, &[]).await?;
    let node = driver.node_at(&node_addr).await?;
    let mut direct = Vec::new();
    let mut light = Vec::new();
    let mut whole = Vec::new();
    let mut stats = Vec::new();
    for run in 0..runs {
        direct.push(direct_run(&bench, &node_addr, tasks, run).await?);
        for (cpu_millis, rates) in [
            (LIGHT_TASK_CPU_MILLIS, &mut light),
            (WHOLE_TASK_CPU_MILLIS, &mut whole),
        ] {
            let (rate, run_stats) =
                leased_run(&bench, &driver, node, &node_addr, tasks, cpu_millis, run).await?;
            rates.push(rate);
            stats.push(run_stats);
        }
        driver.nothing_left_on(node).await?;
    }
    driver.finish().await?;
    let direct = median(&mut direct);
    let light = median(&mut light);
    let granted: u64 = stats.iter().map(|stats| stats.granted).sum();
    let asks: u64 = stats.iter().map(|stats| stats.asks).sum();
    let placed: u64 = stats.iter().map(|stats| stats.placed).sum();
    let renewals: u64 = stats.iter().map(|stats| stats.renewals).sum();
    let returned: u64 = stats.iter().map(|stats| stats.returned).sum();
    print_figure(
        "tasks",
        "empty_tasks_per_s",
        direct,
        "1/s",
        &[
            ("workers", workers.into()),
            ("clients", TASK_CLIENTS.into()),
        ],
    );
    print_figure(
        "tasks",
        "leased_tasks_per_s_per_node",
        light,
        "1/s",
        &[
            ("nodes", 1.into()),
            ("workers", workers.into()),
            ("task_cpu_millis", LIGHT_TASK_CPU_MILLIS.into()),
            ("target", LEASED_TASKS_TARGET_PER_S.into()),
            ("met", (light >= LEASED_TASKS_TARGET_PER_S).into()),
        ],
    );
    print_figure(
        "tasks",
        "leased_cpu_tasks_per_s_per_node",
        median(&mut whole),
        "1/s",
        &[
            ("nodes", 1.into()),
            ("workers", workers.into()),
            ("task_cpu_millis", WHOLE_TASK_CPU_MILLIS.into()),
        ],
    );
    print_figure("tasks", "leased_to_direct", light / direct, "ratio", &[]);
    // What the leader was asked, over every leased run: a handful of calls, not one per task.
    print_figure(
        "tasks",
        "leader_calls_per_task",
        asks as f64 / placed.max(1) as f64,
        "ratio",
        &[
            ("tasks", placed.into()),
            ("lease_asks", asks.into()),
            ("leases_granted", granted.into()),
            ("renewals", renewals.into()),
            ("leases_returned", returned.into()),
        ],
    );
    Ok(())
}

/// Empty tasks sent straight to the node by `TASK_CLIENTS` clients; tasks per second.
async fn direct_run(bench: &Bench, node: &str, tasks: usize, run: usize) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for client in 0..TASK_CLIENTS {
        let mut connection = RpcClient::<NodeProtocol>::connect(node, bench.wire()).await?;
        let share = tasks / TASK_CLIENTS + usize::from(client < tasks % TASK_CLIENTS);
        clients.spawn(async move {
            for index in 0..share {
                let spec = range_task(task_id(0, run, client, index), 0)?;
                run_empty(&mut connection, spec).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(joined) = clients.join_next().await {
        joined??;
    }
    Ok(tasks as f64 / start.elapsed().as_secs_f64())
}

/// Empty tasks placed as a job's driver places them, in leases the leader grants the bench's
/// job (asking `cpu_millis` each), each sent to the node its slot is on; tasks per second and
/// what the leases cost.
async fn leased_run(
    bench: &Bench,
    driver: &Arc<BenchDriver>,
    node: NodeId,
    node_addr: &str,
    tasks: usize,
    cpu_millis: u64,
    run: usize,
) -> anyhow::Result<(f64, LeaseStats)> {
    let leases = Arc::new(JobLeases::new(Arc::clone(driver), driver.job));
    let start = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for client in 0..TASK_CLIENTS {
        let mut connection = RpcClient::<NodeProtocol>::connect(node_addr, bench.wire()).await?;
        let share = tasks / TASK_CLIENTS + usize::from(client < tasks % TASK_CLIENTS);
        let leases = Arc::clone(&leases);
        let requester = driver.node;
        clients.spawn(async move {
            for index in 0..share {
                let request = PlacementRequest {
                    cpu_millis,
                    memory_hint: 0,
                    strategy: Strategy::Spread,
                    preferred: Vec::new(),
                    requester: Some(requester),
                };
                let slot = leases.place(request).await?;
                anyhow::ensure!(
                    slot.node() == node,
                    "a task was placed on node {}, which offers nothing",
                    slot.node()
                );
                let kind = 1 + usize::from(cpu_millis == WHOLE_TASK_CPU_MILLIS);
                let spec = range_task(task_id(kind, run, client, index), 0)?;
                run_empty(&mut connection, spec).await?;
                drop(slot);
            }
            anyhow::Ok(())
        });
    }
    while let Some(joined) = clients.join_next().await {
        joined??;
    }
    let rate = tasks as f64 / start.elapsed().as_secs_f64();
    let stats = leases.stats();
    anyhow::ensure!(
        stats.placed == tasks as u64,
        "{} of {tasks} tasks were placed",
        stats.placed
    );
    leases.close().await;
    Ok((rate, stats))
}

/// A task id unique to (figure, run, client, index).
fn task_id(kind: usize, run: usize, client: usize, index: usize) -> TaskId {
    TaskId::new(
        ((kind as u128) << 96) | ((run as u128) << 64) | ((client as u128) << 32) | index as u128,
    )
}

async fn run_empty(connection: &mut RpcClient<NodeProtocol>, spec: TaskSpec) -> anyhow::Result<()> {
    match connection.call(&NodeRequest::RunTask(spec)).await? {
        NodeResponse::Task {
            result: Ok(done), ..
        } if done.outputs.is_empty() => Ok(()),
        other => anyhow::bail!("an empty task failed: {other:?}"),
    }
}

/// The bench acting as one job's driver: a node registered with nothing to lease, kept alive
/// by its heartbeats, which the leader chose to drive the job. It asks for, renews and
/// returns leases with that node's ticket, as a driver's node does.
struct BenchDriver {
    node: NodeId,
    job: JobId,
    addrs: Vec<String>,
    /// Presents the driver node's ticket.
    wire: WireConfig,
    pool: std::sync::Mutex<Vec<SchedulerClient>>,
    heartbeat: tokio::task::JoinHandle<()>,
}

impl BenchDriver {
    async fn start(bench: &Bench) -> anyhow::Result<Self> {
        let addrs = bench.cluster.addrs();
        let config = bench.credentials.config();
        let wire = WireConfig::member(&config).with_tls(&bench.tls);
        let mut member = SchedulerClient::new(addrs.clone(), wire.clone())?;
        let (node, ticket) = member
            .register_node(
                NodeAddresses::default(),
                Resources::default(),
                NodeMemory::default(),
                BTreeMap::new(),
                None,
            )
            .await?;
        wire.identity.set(Credential::Node {
            secret: bench.credentials.cluster_secret.clone(),
            id: node,
            ticket,
        });
        let mut beat = SchedulerClient::new(addrs.clone(), wire.clone())?;
        let heartbeat = tokio::spawn(async move {
            loop {
                // A missed one is made up by the next; the node timeout is five of them.
                let _ = beat.heartbeat(node, ResourceUsage::default()).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        let mut client = SchedulerClient::new(addrs.clone(), WireConfig::client(&config))?;
        let spec = JobSpec {
            plan: floe_client::Dataset::range(1)?.plan().resolve_seeds()?,
            options: JobOptions::default(),
        }
        .encode()?;
        let job = client
            .submit_job(spec, SubmissionId::random(), Some("bench-tasks".into()))
            .await?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let record = client.watch_job(job, Duration::ZERO).await?;
            match record {
                Some(record) if record.driver == Some(node) => break,
                Some(record) if record.driver.is_some() => {
                    anyhow::bail!(
                        "job {job} is driven by node {:?}, not the bench",
                        record.driver
                    )
                }
                _ => {}
            }
            anyhow::ensure!(Instant::now() < deadline, "job {job} got no driver");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(Self {
            node,
            job,
            addrs,
            wire,
            pool: std::sync::Mutex::new(Vec::new()),
            heartbeat,
        })
    }

    fn client(&self) -> floe_driver::Result<SchedulerClient> {
        let pooled = self
            .pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop();
        match pooled {
            Some(client) => Ok(client),
            None => Ok(SchedulerClient::new(self.addrs.clone(), self.wire.clone())?),
        }
    }

    fn give_back(&self, client: SchedulerClient) {
        self.pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(client);
    }

    /// The id of the node at `addr`, once the leader has heard from it (only then does it
    /// lease anything there).
    async fn node_at(&self, addr: &str) -> anyhow::Result<NodeId> {
        let mut client = self.client()?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let (_, nodes) = client.alive_nodes().await?;
            if let Some(node) = nodes.iter().find(|node| node.rpc == addr) {
                let reports = client.node_reports().await?;
                if reports.contains_key(&node.id) {
                    return Ok(node.id);
                }
            }
            anyhow::ensure!(Instant::now() < deadline, "the node at {addr} never joined");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Checks that the leader reserves nothing on `node` once the job's leases are returned.
    async fn nothing_left_on(&self, node: NodeId) -> anyhow::Result<()> {
        let mut client = self.client()?;
        let report = client
            .node_reports()
            .await?
            .remove(&node)
            .context("the node has no report")?;
        anyhow::ensure!(
            report.reserved == Resources::default() && report.leases.is_empty(),
            "the leader still reserves {:?} on node {node} ({:?})",
            report.reserved,
            report.leases
        );
        self.give_back(client);
        Ok(())
    }

    /// Ends the job as its driver would.
    async fn finish(&self) -> anyhow::Result<()> {
        let mut client = self.client()?;
        let outcome = JobOutcome {
            status: JobStatus::Succeeded,
            stats: JobStats {
                attempt: 1,
                ..JobStats::default()
            },
            outputs: Vec::new(),
        };
        let finish = Command::FinishJob {
            job: self.job,
            attempt: 1,
            outcome,
        };
        match client.propose(finish).await? {
            Outcome::Applied => Ok(()),
            other => anyhow::bail!("the bench's job did not finish: {other:?}"),
        }
    }
}

impl Drop for BenchDriver {
    fn drop(&mut self) {
        self.heartbeat.abort();
    }
}

impl LeaseService for BenchDriver {
    async fn acquire_leases(
        &self,
        job: JobId,
        requests: Vec<PlacementRequest>,
        wait: Duration,
    ) -> floe_driver::Result<LeaseGrants> {
        let mut client = self.client()?;
        let grants = client.acquire_leases(job, requests, wait).await?;
        self.give_back(client);
        Ok(grants)
    }

    async fn renew_leases(
        &self,
        job: JobId,
        leases: Vec<Lease>,
    ) -> floe_driver::Result<Vec<LeaseStanding>> {
        let mut client = self.client()?;
        let standings = client.renew_leases(job, leases).await?;
        self.give_back(client);
        Ok(standings)
    }

    async fn return_leases(&self, job: JobId, leases: Vec<LeaseId>) -> floe_driver::Result<()> {
        let mut client = self.client()?;
        client.return_leases(job, leases).await?;
        self.give_back(client);
        Ok(())
    }
}
