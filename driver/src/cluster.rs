//! The driver's view of the cluster: the scheduler (placement, commits, progress) and the node
//! agents (tasks, cache shards, frees), each behind a small pool of reused connections.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, PoisonError};

use floe_api::client::SchedulerClient;
use floe_api::placement::PlacementRequest;
use floe_api::state::{ClusterState, Command, Outcome};
use floe_core::wire::{PeerKind, RpcClient, WireConfig, WireError};
use floe_core::{NodeId, ObjectId};

use super::{Error, Result};
use floe_api::node_protocol::{NodeProtocol, NodeRequest, NodeResponse};

/// Connections kept per destination; more concurrent calls than this open extra ones.
const POOLED_PER_DESTINATION: usize = 16;
/// How long a driver waits for a task's reply: tasks may legitimately run for hours (a model
/// over a large block), so the configured read timeout, meant for quick calls, does not
/// apply. A node that dies closes the connection, which ends the wait at once.
const TASK_REPLY_TIMEOUT_MS: u64 = 24 * 3600 * 1000;

/// Connections to nodes, by address.
type NodePool = Mutex<BTreeMap<String, Vec<RpcClient<NodeProtocol>>>>;

pub(crate) struct Cluster {
    schedulers: Vec<String>,
    wire: WireConfig,
    /// `wire` with the read timeout of [`TASK_REPLY_TIMEOUT_MS`], for `RunTask`.
    task_wire: WireConfig,
    scheduler_pool: Mutex<Vec<SchedulerClient>>,
    /// Scheduler clients for `Place`, which waits while the cluster is full: on `task_wire`,
    /// so a long wait is not taken for a dead scheduler (a retried placement would leave the
    /// first one's reservation granted to nobody).
    placement_pool: Mutex<Vec<SchedulerClient>>,
    node_pool: NodePool,
    task_pool: NodePool,
    /// Alive nodes' RPC addresses, as of the last state read.
    nodes: Mutex<BTreeMap<NodeId, String>>,
    /// Nodes committed dead, as of the last state read: a task waiting on one is given up
    /// even when its connection stays open (a machine that lost power sends no reset).
    dead: tokio::sync::watch::Sender<BTreeSet<NodeId>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Cluster {
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
            dead: tokio::sync::watch::Sender::new(BTreeSet::new()),
        }
    }

    fn scheduler_client(&self) -> Result<SchedulerClient> {
        pooled_scheduler_client(&self.scheduler_pool, &self.schedulers, &self.wire)
    }

    fn return_scheduler_client(&self, client: SchedulerClient) {
        return_pooled(&self.scheduler_pool, client);
    }

    /// A linearizable read of the cluster state; refreshes the alive-node table.
    pub async fn read_state(&self) -> Result<ClusterState> {
        let mut client = self.scheduler_client()?;
        let state = client.read_state().await?;
        self.return_scheduler_client(client);
        *lock(&self.nodes) = state
            .alive_nodes()
            .map(|node| (node.id, node.addresses.rpc.clone()))
            .collect();
        let dead: BTreeSet<NodeId> = state
            .nodes
            .values()
            .filter(|node| !node.is_alive())
            .map(|node| node.id)
            .collect();
        self.dead.send_if_modified(|known| {
            let changed = *known != dead;
            *known = dead;
            changed
        });
        Ok(state)
    }

    pub async fn propose(&self, command: Command) -> Result<Outcome> {
        let mut client = self.scheduler_client()?;
        let outcome = client.propose(command).await?;
        self.return_scheduler_client(client);
        Ok(outcome)
    }

    /// Places one task; waits while the cluster is busy.
    pub async fn place(&self, request: PlacementRequest) -> Result<NodeId> {
        let placed = self.place_all(vec![request]).await?;
        placed.into_iter().next().ok_or(Error::PlacementCount {
            asked: 1,
            answered: 0,
        })
    }

    /// Places a batch at once (so SPREAD spreads within it); waits while the cluster is busy.
    pub async fn place_all(&self, requests: Vec<PlacementRequest>) -> Result<Vec<NodeId>> {
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

    /// Gives back what [`Cluster::place`] reserved on `node` for one task.
    pub async fn release(
        &self,
        node: NodeId,
        cpu_millis: u64,
        memory_hint: u64,
        requester: NodeId,
    ) -> Result<()> {
        let mut client = self.scheduler_client()?;
        client
            .release(node, cpu_millis, memory_hint, Some(requester))
            .await?;
        self.return_scheduler_client(client);
        Ok(())
    }

    /// Reports progress; `true` means stop.
    pub async fn report_progress(
        &self,
        job: floe_core::JobId,
        progress: floe_core::job::JobProgress,
    ) -> Result<bool> {
        let mut client = self.scheduler_client()?;
        let stop = client.report_progress(job, progress).await?;
        self.return_scheduler_client(client);
        Ok(stop)
    }

    /// The RPC address of `node`, reading the state again if the node is new to the driver.
    pub async fn address(&self, node: NodeId) -> Result<String> {
        if let Some(addr) = lock(&self.nodes).get(&node) {
            return Ok(addr.clone());
        }
        self.read_state().await?;
        lock(&self.nodes)
            .get(&node)
            .cloned()
            .ok_or(Error::NodeGone(node))
    }

    /// Returns once `node` is known to be dead (never, if it stays alive).
    pub async fn death_of(&self, node: NodeId) {
        let mut dead = self.dead.subscribe();
        loop {
            if dead.borrow_and_update().contains(&node) {
                return;
            }
            if dead.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    pub fn alive_nodes(&self) -> Vec<NodeId> {
        lock(&self.nodes).keys().copied().collect()
    }

    /// One call to the node agent at `addr`.
    pub async fn call_node(&self, addr: &str, request: &NodeRequest) -> Result<NodeResponse> {
        Ok(call_pooled(&self.node_pool, &self.wire, addr, request).await?)
    }

    /// Runs a task on the node at `addr`, waiting as long as the task runs.
    pub async fn run_task(&self, addr: &str, request: &NodeRequest) -> Result<NodeResponse> {
        Ok(call_pooled(&self.task_pool, &self.task_wire, addr, request).await?)
    }

    /// Frees objects on the nodes holding them; a node that cannot be reached has lost them
    /// anyway, so failures are only logged.
    pub async fn free(&self, objects: BTreeMap<NodeId, Vec<ObjectId>>) {
        for (node, objects) in objects {
            let Ok(addr) = self.address(node).await else {
                continue;
            };
            if let Err(error) = self.call_node(&addr, &NodeRequest::Free { objects }).await {
                tracing::debug!(%node, %error, "freeing objects failed");
            }
        }
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
        None => RpcClient::connect(addr, wire.clone(), PeerKind::Node).await?,
    };
    let response = client.call(request).await?;
    let mut pool = lock(pool);
    let clients = pool.entry(addr.to_owned()).or_default();
    if clients.len() < POOLED_PER_DESTINATION {
        clients.push(client);
    }
    Ok(response)
}

fn pooled_scheduler_client(
    pool: &Mutex<Vec<SchedulerClient>>,
    schedulers: &[String],
    wire: &WireConfig,
) -> Result<SchedulerClient> {
    match lock(pool).pop() {
        Some(client) => Ok(client),
        None => Ok(SchedulerClient::new(
            schedulers.to_vec(),
            wire.clone(),
            PeerKind::Node,
        )?),
    }
}

fn return_pooled(pool: &Mutex<Vec<SchedulerClient>>, client: SchedulerClient) {
    let mut pool = lock(pool);
    if pool.len() < POOLED_PER_DESTINATION {
        pool.push(client);
    }
}
