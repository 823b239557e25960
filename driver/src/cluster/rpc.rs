//! The cluster over RPC: the scheduler (leases, actors' placement, commits, progress) and the
//! node agents (tasks, actor calls, cache shards, frees), each behind a small pool of reused
//! connections.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use floe_api::client::SchedulerClient;
use floe_api::lease::{Lease, LeaseGrants, LeaseStanding};
use floe_api::node_protocol::{NodeProtocol, NodeRequest, NodeResponse};
use floe_api::placement::PlacementRequest;
use floe_api::scheduler_protocol::NodeSummary;
use floe_api::state::{CacheIndex, Command, JobRecord, Outcome};
use floe_core::job::JobProgress;
use floe_core::wire::{RpcClient, WireConfig, WireError};
use floe_core::{JobId, LeaseId, NodeId};

use super::{ClusterAccess, Deaths};
use crate::leases::LeaseService;
use crate::{Error, Result};

/// Connections kept per destination; more concurrent calls than this open extra ones.
const POOLED_PER_DESTINATION: usize = 16;
/// How long a driver waits for a task's reply: tasks may legitimately run for hours (a model
/// over a large block), so the configured read timeout, meant for quick calls, does not
/// apply. A node that dies closes the connection, which ends the wait at once.
const TASK_REPLY_TIMEOUT_MS: u64 = 24 * 3600 * 1000;

/// Connections to nodes, by address.
type NodePool = Mutex<BTreeMap<String, Vec<RpcClient<NodeProtocol>>>>;

/// The real cluster, reached through its scheduler replicas and node agents.
pub struct RpcCluster {
    schedulers: Vec<String>,
    wire: WireConfig,
    /// `wire` with the read timeout of [`TASK_REPLY_TIMEOUT_MS`], for `RunTask`.
    task_wire: WireConfig,
    scheduler_pool: Mutex<Vec<SchedulerClient>>,
    /// Scheduler clients for `Place` and `AcquireLeases`, which wait while the cluster is
    /// full: on `task_wire`, so a long wait is not taken for a dead scheduler.
    placement_pool: Mutex<Vec<SchedulerClient>>,
    node_pool: NodePool,
    task_pool: NodePool,
    /// Alive nodes' RPC addresses, as of the last read of the nodes.
    nodes: Mutex<BTreeMap<NodeId, String>>,
    /// Nodes committed dead, as learned from the scheduler: a task waiting on one is given up
    /// even when its connection stays open (a machine that lost power sends no reset).
    dead: Deaths,
    /// The log index up to which deaths are known.
    deaths_known_at: AtomicU64,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RpcCluster {
    pub fn new(schedulers: Vec<String>, wire: WireConfig) -> Self {
        let mut task_wire = wire.clone();
        task_wire.timeouts.read_ms = task_wire.timeouts.read_ms.max(TASK_REPLY_TIMEOUT_MS);
        Self {
            schedulers,
            wire,
            task_wire,
            scheduler_pool: Mutex::new(Vec::new()),
            placement_pool: Mutex::new(Vec::new()),
            node_pool: Mutex::new(BTreeMap::new()),
            task_pool: Mutex::new(BTreeMap::new()),
            nodes: Mutex::new(BTreeMap::new()),
            dead: Deaths::new(),
            deaths_known_at: AtomicU64::new(0),
        }
    }

    fn scheduler_client(&self) -> Result<SchedulerClient> {
        pooled_scheduler_client(&self.scheduler_pool, &self.schedulers, &self.wire)
    }

    fn return_scheduler_client(&self, client: SchedulerClient) {
        return_pooled(&self.scheduler_pool, client);
    }
}

impl ClusterAccess for RpcCluster {
    async fn read_job(&self, job: JobId) -> Result<Option<JobRecord>> {
        let mut client = self.scheduler_client()?;
        let record = client.watch_job(job, Duration::ZERO).await?;
        self.return_scheduler_client(client);
        Ok(record)
    }

    async fn cache_index(&self) -> Result<CacheIndex> {
        let mut client = self.scheduler_client()?;
        let index = client.cache_index().await?;
        self.return_scheduler_client(client);
        Ok(index)
    }

    async fn read_nodes(&self) -> Result<Vec<NodeSummary>> {
        let mut client = self.scheduler_client()?;
        let (as_of, nodes) = client.alive_nodes().await?;
        self.return_scheduler_client(client);
        let alive: BTreeMap<NodeId, String> = nodes
            .iter()
            .map(|node| (node.id, node.rpc.clone()))
            .collect();
        // A node known before and missing now died (or was forgotten, long after dying).
        let gone: Vec<_> = lock(&self.nodes)
            .keys()
            .filter(|node| !alive.contains_key(node))
            .map(|node| floe_api::state::NodeDeath {
                node: *node,
                index: as_of,
                reason: "no longer alive".into(),
            })
            .collect();
        self.dead.learn(&gone);
        *lock(&self.nodes) = alive;
        self.deaths_known_at.fetch_max(as_of, Ordering::Relaxed);
        Ok(nodes)
    }

    async fn learn_deaths(&self) -> Result<()> {
        let after = self.deaths_known_at.load(Ordering::Relaxed);
        let mut client = self.scheduler_client()?;
        let deaths = client.watch_deaths(after, Duration::ZERO).await?;
        self.return_scheduler_client(client);
        if let Some(last) = deaths.iter().map(|death| death.index).max() {
            self.deaths_known_at.fetch_max(last, Ordering::Relaxed);
        }
        {
            let mut nodes = lock(&self.nodes);
            for death in &deaths {
                nodes.remove(&death.node);
            }
        }
        self.dead.learn(&deaths);
        Ok(())
    }

    async fn propose(&self, command: Command) -> Result<Outcome> {
        let mut client = self.scheduler_client()?;
        let outcome = client.propose(command).await?;
        self.return_scheduler_client(client);
        Ok(outcome)
    }

    async fn place_all(&self, requests: Vec<PlacementRequest>) -> Result<Vec<NodeId>> {
        let count = requests.len();
        let mut client =
            pooled_scheduler_client(&self.placement_pool, &self.schedulers, &self.task_wire)?;
        let placed = client.place(requests).await?;
        return_pooled(&self.placement_pool, client);
        if placed.len() != count {
            return Err(Error::PlacementCount {
                asked: count,
                answered: placed.len(),
            });
        }
        placed
            .into_iter()
            .map(|placed| placed.map_err(Error::Placement))
            .collect()
    }

    async fn report_progress(&self, job: JobId, progress: JobProgress) -> Result<bool> {
        let mut client = self.scheduler_client()?;
        let stop = client.report_progress(job, progress).await?;
        self.return_scheduler_client(client);
        Ok(stop)
    }

    /// Reads the alive nodes again if the node is new to the driver.
    async fn address(&self, node: NodeId) -> Result<String> {
        if let Some(addr) = lock(&self.nodes).get(&node) {
            return Ok(addr.clone());
        }
        self.read_nodes().await?;
        lock(&self.nodes)
            .get(&node)
            .cloned()
            .ok_or(Error::NodeGone(node))
    }

    fn alive_nodes(&self) -> Vec<NodeId> {
        lock(&self.nodes).keys().copied().collect()
    }

    async fn death_of(&self, node: NodeId) {
        self.dead.of(node).await;
    }

    async fn call_node(&self, addr: &str, request: &NodeRequest) -> Result<NodeResponse> {
        Ok(call_pooled(&self.node_pool, &self.wire, addr, request).await?)
    }

    async fn run_task(&self, addr: &str, request: &NodeRequest) -> Result<NodeResponse> {
        Ok(call_pooled(&self.task_pool, &self.task_wire, addr, request).await?)
    }
}

impl LeaseService for RpcCluster {
    async fn acquire_leases(
        &self,
        job: JobId,
        requests: Vec<PlacementRequest>,
        wait: Duration,
    ) -> Result<LeaseGrants> {
        let count = requests.len();
        let mut client =
            pooled_scheduler_client(&self.placement_pool, &self.schedulers, &self.task_wire)?;
        let grants = client.acquire_leases(job, requests, wait).await?;
        return_pooled(&self.placement_pool, client);
        if grants.decisions.len() != count {
            return Err(Error::LeaseCount {
                asked: count,
                answered: grants.decisions.len(),
            });
        }
        Ok(grants)
    }

    async fn renew_leases(&self, job: JobId, leases: Vec<Lease>) -> Result<Vec<LeaseStanding>> {
        let count = leases.len();
        let mut client = self.scheduler_client()?;
        let standings = client.renew_leases(job, leases).await?;
        self.return_scheduler_client(client);
        if standings.len() != count {
            return Err(Error::LeaseCount {
                asked: count,
                answered: standings.len(),
            });
        }
        Ok(standings)
    }

    async fn return_leases(&self, job: JobId, leases: Vec<LeaseId>) -> Result<()> {
        let mut client = self.scheduler_client()?;
        client.return_leases(job, leases).await?;
        self.return_scheduler_client(client);
        Ok(())
    }
}

/// One call through a connection from `pool` (opening one if none is idle), which goes back
/// to the pool after a clean reply.
async fn call_pooled(
    pool: &NodePool,
    wire: &WireConfig,
    addr: &str,
    request: &NodeRequest,
) -> Result<NodeResponse, WireError> {
    let pooled = lock(pool).get_mut(addr).and_then(|clients| clients.pop());
    let mut client = match pooled {
        Some(client) => client,
        None => RpcClient::connect(addr, wire.clone()).await?,
    };
    let response = client.call(request).await?;
    let mut pool = lock(pool);
    let clients = pool.entry(addr.to_owned()).or_default();
    if clients.len() < POOLED_PER_DESTINATION {
        clients.push(client);
    }
    Ok(response)
}

/// How long one scheduler call may wait at one replica (beyond a long poll's own wait)
/// before trying the next: a frozen leader must not hold the driver for the read timeout.
const SCHEDULER_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

fn pooled_scheduler_client(
    pool: &Mutex<Vec<SchedulerClient>>,
    schedulers: &[String],
    wire: &WireConfig,
) -> Result<SchedulerClient> {
    match lock(pool).pop() {
        Some(client) => Ok(client),
        None => Ok(SchedulerClient::new(schedulers.to_vec(), wire.clone())?
            .with_attempt_timeout(SCHEDULER_ATTEMPT_TIMEOUT)),
    }
}

fn return_pooled(pool: &Mutex<Vec<SchedulerClient>>, client: SchedulerClient) {
    let mut pool = lock(pool);
    if pool.len() < POOLED_PER_DESTINATION {
        pool.push(client);
    }
}
