//! The driver's one door to the cluster: [`ClusterAccess`], the operations a driver uses on the
//! scheduler (its job, the cache index, the alive nodes and their deaths, commits, actors'
//! placement, its leases through [`LeaseService`], progress) and on the node agents (tasks,
//! actor calls, cache shards, frees). No operation
//! reads the whole replicated state: a driver's tick costs the same however many jobs the
//! cluster has run. [`RpcCluster`] is the real one, over RPC; the executor's tests
//! run against an in-process fake (`fake::FakeCluster`) that runs tasks with the engine's
//! kernels.

#[cfg(test)]
pub(crate) mod fake;
mod rpc;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;

use floe_api::node_protocol::{NodeRequest, NodeResponse};
use floe_api::placement::PlacementRequest;
use floe_api::scheduler_protocol::NodeSummary;
use floe_api::state::{CacheIndex, Command, JobRecord, NodeDeath, Outcome};
use floe_core::job::JobProgress;
use floe_core::{JobId, NodeId, ObjectId};

pub use self::rpc::RpcCluster;
use crate::leases::LeaseService;
use crate::{Error, Result};

/// What a driver needs from the cluster. Methods return `Send` futures so the executor can
/// run them in spawned tasks. Tasks are placed in the job's leases ([`LeaseService`]).
pub trait ClusterAccess: LeaseService + Send + Sync + 'static {
    /// One job's record (`None` when the scheduler does not know it).
    fn read_job(&self, job: JobId) -> impl Future<Output = Result<Option<JobRecord>>> + Send;

    /// The fingerprint cache index, for planning.
    fn cache_index(&self) -> impl Future<Output = Result<CacheIndex>> + Send;

    /// The alive nodes; also refreshes what [`alive_nodes`], [`address`] and [`death_of`]
    /// know.
    ///
    /// [`alive_nodes`]: ClusterAccess::alive_nodes
    /// [`address`]: ClusterAccess::address
    /// [`death_of`]: ClusterAccess::death_of
    fn read_nodes(&self) -> impl Future<Output = Result<Vec<NodeSummary>>> + Send;

    /// Learns the node deaths committed since the last look, without waiting for more, so
    /// tasks waiting on a dead node give up.
    fn learn_deaths(&self) -> impl Future<Output = Result<()>> + Send;

    /// Commits a command to the replicated state.
    fn propose(&self, command: Command) -> impl Future<Output = Result<Outcome>> + Send;

    /// Chooses nodes for a batch of actors at once (so SPREAD spreads within it), one node
    /// per request, in order; nothing stays reserved (an actor's work runs as tasks, in the
    /// job's leases).
    fn place_all(
        &self,
        requests: Vec<PlacementRequest>,
    ) -> impl Future<Output = Result<Vec<NodeId>>> + Send;

    /// Reports a running job's progress; `true` means the job is to stop (it was cancelled).
    fn report_progress(
        &self,
        job: JobId,
        progress: JobProgress,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// The RPC address of `node`; [`Error::NodeGone`] when it is not alive.
    fn address(&self, node: NodeId) -> impl Future<Output = Result<String>> + Send;

    /// The alive nodes, as of the last state read.
    fn alive_nodes(&self) -> Vec<NodeId>;

    /// Returns once `node` is known to be dead (never, if it stays alive).
    fn death_of(&self, node: NodeId) -> impl Future<Output = ()> + Send;

    /// One quick call to the node agent at `addr`.
    fn call_node(
        &self,
        addr: &str,
        request: &NodeRequest,
    ) -> impl Future<Output = Result<NodeResponse>> + Send;

    /// A call to the node agent at `addr` that lasts as long as the task (or actor call) it
    /// runs.
    fn run_task(
        &self,
        addr: &str,
        request: &NodeRequest,
    ) -> impl Future<Output = Result<NodeResponse>> + Send;

    /// Chooses a node for one actor.
    fn place(&self, request: PlacementRequest) -> impl Future<Output = Result<NodeId>> + Send {
        async move {
            let placed = self.place_all(vec![request]).await?;
            placed.into_iter().next().ok_or(Error::PlacementCount {
                asked: 1,
                answered: 0,
            })
        }
    }

    /// Frees objects on the nodes holding them; a node that cannot be reached has lost them
    /// anyway, so failures are only logged.
    fn free(&self, objects: BTreeMap<NodeId, Vec<ObjectId>>) -> impl Future<Output = ()> + Send {
        async move {
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
}

/// The nodes known dead, for tasks waiting on one of them.
struct Deaths(tokio::sync::watch::Sender<BTreeSet<NodeId>>);

impl Deaths {
    fn new() -> Self {
        Self(tokio::sync::watch::Sender::new(BTreeSet::new()))
    }

    /// Learns `deaths`; waiters on any of them return.
    fn learn(&self, deaths: &[NodeDeath]) {
        self.0.send_if_modified(|known| {
            let before = known.len();
            known.extend(deaths.iter().map(|death| death.node));
            known.len() != before
        });
    }

    /// Returns once `node` is known to be dead (never, if it stays alive).
    async fn of(&self, node: NodeId) {
        let mut dead = self.0.subscribe();
        loop {
            if dead.borrow_and_update().contains(&node) {
                return;
            }
            if dead.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}
