//! Backpressure: the job's object-store budget and concurrency cap, sized from the alive
//! nodes, and the bytes queued between operators that sources are throttled against.

use floe_api::node_protocol::{NodeRequest, NodeResponse, StoreUsage};
use floe_api::scheduler_protocol::NodeSummary;

use super::task::Recipe;
use super::{Execution, TASK_CPU_MILLIS};
use crate::cluster::ClusterAccess;
use crate::plan::Work;

/// Nodes whose status one sweep asks at once.
const STATUS_READS_AT_ONCE: usize = 16;

/// What the job may have in flight.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Bytes queued between operators at which sources stop launching.
    pub(super) budget_bytes: u64,
    /// Tasks one operator runs at once: the cluster's CPUs.
    pub(super) concurrency_cap: u64,
    /// The largest heap pool of one node: a task's memory hint is capped to it, so a task
    /// with a huge input takes a whole node rather than fitting none.
    pub(super) memory_hint_cap: u64,
}

impl Default for Limits {
    /// Before the cluster is read: nothing queued is allowed, one task at a time.
    fn default() -> Self {
        Self {
            budget_bytes: 0,
            concurrency_cap: 1,
            memory_hint_cap: 0,
        }
    }
}

impl Limits {
    /// Whether `queued` bytes are at or over the budget (an empty budget admits one bundle).
    pub(super) fn over_budget(&self, queued: u64) -> bool {
        queued >= self.budget_bytes.max(1)
    }
}

impl<C: ClusterAccess> Execution<C> {
    /// The in-flight budget and the concurrency cap, from the alive nodes' stores and CPUs.
    /// Returns the bytes those stores have spilled since they opened, which the job's own
    /// spill is counted from: one read of the nodes serves both.
    pub(super) async fn size_budget_and_count_spill(&mut self) -> crate::Result<u64> {
        let nodes = self.cluster.read_nodes().await?;
        let cpus: u64 = nodes
            .iter()
            .map(|node| node.resources.cpu_millis / TASK_CPU_MILLIS)
            .sum();
        self.limits.concurrency_cap = cpus.max(1);
        self.limits.memory_hint_cap = nodes
            .iter()
            .map(|node| node.resources.heap_bytes)
            .max()
            .unwrap_or(0);
        let stores = self.stores(&nodes).await;
        let capacity: u64 = stores.iter().map(|store| store.capacity).sum();
        self.limits.budget_bytes =
            (capacity / 1000).saturating_mul(u64::from(self.options.object_store_budget_permille));
        Ok(stores.iter().map(|store| store.spilled_bytes_total).sum())
    }

    /// Bytes the alive nodes' stores have spilled since they opened.
    pub(super) async fn spilled_bytes(&self) -> u64 {
        let Ok(nodes) = self.cluster.read_nodes().await else {
            return 0;
        };
        self.stores(&nodes)
            .await
            .iter()
            .map(|store| store.spilled_bytes_total)
            .sum()
    }

    /// The object stores of `nodes`, as those that answer report them. Up to
    /// [`STATUS_READS_AT_ONCE`] nodes are asked at once, so a job's start and end cost one
    /// round trip per that many nodes, not one per node.
    async fn stores(&self, nodes: &[NodeSummary]) -> Vec<StoreUsage> {
        let mut stores = Vec::with_capacity(nodes.len());
        for some in nodes.chunks(STATUS_READS_AT_ONCE) {
            let asked = some
                .iter()
                .map(|node| self.cluster.call_node(&node.rpc, &NodeRequest::Status));
            for answer in futures::future::join_all(asked).await {
                if let Ok(NodeResponse::Status(status)) = answer {
                    stores.push(status.store);
                }
            }
        }
        stores
    }

    /// Bytes of bundles queued between operators: in their input queues and in tasks that
    /// have taken them but not started.
    pub(super) fn queued_bytes(&self) -> u64 {
        // A union's queue holds finished data waiting for the inputs before it, and a
        // shuffle collects its whole input before its tasks run: counting either could
        // throttle the very source it waits for.
        self.ops
            .iter()
            .filter(|op| !matches!(op.work, Work::Union | Work::AllToAll))
            .flat_map(|op| {
                let queued = op.inputs.iter().flat_map(|input| &input.queued);
                let unstarted = op.ready.iter().filter_map(|launch| match &launch.recipe {
                    Recipe::Compute { inputs, .. } => Some(inputs),
                    Recipe::Load(_) => None,
                });
                queued
                    .flat_map(|bundle| &bundle.blocks)
                    .chain(unstarted.flatten())
            })
            .filter_map(|block| self.blocks.get(block))
            .map(|info| info.bytes)
            .sum()
    }
}
