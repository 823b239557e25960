//! Placement: which node runs a task or actor. Pure logic over a [`ResourceView`].
//!
//! The leader keeps the view (node totals from the committed state, reservations as soft
//! state) and calls [`ResourceView::place`] for each batch of requests. Strategies (DESIGN.md,
//! "Scheduler"):
//!
//! - SPREAD: the least utilized node that fits; ties go round-robin, so equal nodes fill evenly.
//! - DEFAULT, Ray's hybrid policy: the preferred node (most input bytes, else the requester)
//!   while its utilization is under [`SPREAD_THRESHOLD`]; else the first node under the
//!   threshold (so work packs node by node); else the least utilized node.
//! - NodeAffinity: hard (that node or nothing) or soft (that node if it fits now, else DEFAULT).
//!
//! Utilization is the larger of a node's CPU share and heap share in use. Memory hints are
//! reserved against the node's heap pool and a request is only placed where it fits now, so a
//! node is never oversubscribed. A request that no alive node could hold even when idle is an
//! error; one that only needs others to finish waits in a [`PlacementQueue`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use floe_core::NodeId;
use floe_core::config::ByteSize;
use serde::{Deserialize, Serialize};

use crate::state::Resources;

/// Nodes below this utilization are packed; at or above it, work spreads out.
pub const SPREAD_THRESHOLD: f64 = 0.5;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Strategy {
    Spread,
    Default,
    NodeAffinity { node: NodeId, soft: bool },
}

/// What one task or actor needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementRequest {
    pub cpu_millis: u64,
    /// Expected peak heap use in bytes; reserved against the node's heap pool.
    pub memory_hint: u64,
    pub strategy: Strategy,
    /// Nodes holding the request's inputs, with how many input bytes each holds.
    pub preferred: Vec<(NodeId, u64)>,
    /// The node asking, used by DEFAULT when no preferred node is known.
    pub requester: Option<NodeId>,
}

impl PlacementRequest {
    /// What the request reserves where it is placed.
    pub fn need(&self) -> Resources {
        Resources {
            cpu_millis: self.cpu_millis,
            heap_bytes: self.memory_hint,
        }
    }
}

/// Why a request can never be placed as asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum PlacementError {
    #[error(
        "the request for {} CPUs and {} of heap fits no alive node even when idle: the most \
         CPUs on one node is {}, the largest heap pool {}",
        cpus(*cpu_millis), ByteSize(*memory_hint), cpus(*largest_cpu_millis), ByteSize(*largest_heap_bytes)
    )]
    Infeasible {
        cpu_millis: u64,
        memory_hint: u64,
        largest_cpu_millis: u64,
        largest_heap_bytes: u64,
    },
    #[error("no alive node to place on")]
    NoNodes,
    #[error("node {node} (hard affinity) is not alive")]
    AffinityNodeGone { node: NodeId },
}

fn cpus(millis: u64) -> String {
    format!("{}.{:03}", millis / 1000, millis % 1000)
}

/// The answer for one request of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    Placed(NodeId),
    /// It fits some node once running work releases resources.
    Wait,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct NodeLoad {
    total: Resources,
    used: Resources,
}

impl NodeLoad {
    fn utilization(&self) -> f64 {
        let share = |used: u64, total: u64| {
            if total == 0 {
                if used == 0 { 0.0 } else { 1.0 }
            } else {
                used as f64 / total as f64
            }
        };
        share(self.used.cpu_millis, self.total.cpu_millis)
            .max(share(self.used.heap_bytes, self.total.heap_bytes))
    }

    /// The utilization as a key that sorts like the number: the bits of a non-negative
    /// float order as the float does.
    fn utilization_key(&self) -> u64 {
        self.utilization().to_bits()
    }

    fn fits_now(&self, need: Resources) -> bool {
        self.used.cpu_millis.saturating_add(need.cpu_millis) <= self.total.cpu_millis
            && self.used.heap_bytes.saturating_add(need.heap_bytes) <= self.total.heap_bytes
    }

    fn fits_when_idle(&self, need: Resources) -> bool {
        need.cpu_millis <= self.total.cpu_millis && need.heap_bytes <= self.total.heap_bytes
    }
}

/// The leader's view of alive nodes: totals and what placements reserved.
#[derive(Debug, Clone, Default)]
pub struct ResourceView {
    nodes: BTreeMap<NodeId, NodeLoad>,
    /// Nodes ordered by utilization (then id), so SPREAD and the least-utilized fallback find
    /// their node without scanning the cluster.
    by_utilization: BTreeSet<(u64, NodeId)>,
    /// The node SPREAD chose last; ties go to the next one after it.
    spread_cursor: Option<NodeId>,
}

impl ResourceView {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a node, or updates its totals (its reservations are kept).
    pub fn upsert_node(&mut self, node: NodeId, total: Resources) {
        self.update(node, |load| load.total = total);
        if !self.nodes.contains_key(&node) {
            let load = NodeLoad {
                total,
                used: Resources::default(),
            };
            self.by_utilization.insert((load.utilization_key(), node));
            self.nodes.insert(node, load);
        }
    }

    pub fn remove_node(&mut self, node: NodeId) {
        if let Some(load) = self.nodes.remove(&node) {
            self.by_utilization.remove(&(load.utilization_key(), node));
        }
    }

    /// Changes a node's load and keeps the utilization index in step.
    fn update(&mut self, node: NodeId, change: impl FnOnce(&mut NodeLoad)) {
        if let Some(load) = self.nodes.get_mut(&node) {
            self.by_utilization.remove(&(load.utilization_key(), node));
            change(load);
            self.by_utilization.insert((load.utilization_key(), node));
        }
    }

    pub fn contains(&self, node: NodeId) -> bool {
        self.nodes.contains_key(&node)
    }

    /// Reserves `need` on `node` whether or not it fits: for what already runs there (a
    /// lease its driver holds from an earlier leader), which the view must count.
    pub fn reserve(&mut self, node: NodeId, need: Resources) {
        self.update(node, |load| {
            load.used.cpu_millis = load.used.cpu_millis.saturating_add(need.cpu_millis);
            load.used.heap_bytes = load.used.heap_bytes.saturating_add(need.heap_bytes);
        });
    }

    /// What `node` offers in all.
    pub fn total(&self, node: NodeId) -> Option<Resources> {
        self.nodes.get(&node).map(|load| load.total)
    }

    /// Returns what a finished task reserved on `node`.
    pub fn release(&mut self, node: NodeId, cpu_millis: u64, memory_hint: u64) {
        self.update(node, |load| {
            load.used.cpu_millis = load.used.cpu_millis.saturating_sub(cpu_millis);
            load.used.heap_bytes = load.used.heap_bytes.saturating_sub(memory_hint);
        });
    }

    /// What is reserved on `node`.
    pub fn used(&self, node: NodeId) -> Option<Resources> {
        self.nodes.get(&node).map(|load| load.used)
    }

    pub fn utilization(&self, node: NodeId) -> Option<f64> {
        self.nodes.get(&node).map(NodeLoad::utilization)
    }

    /// Places a batch in order; each placement reserves its resources before the next
    /// request is considered.
    pub fn place(
        &mut self,
        requests: &[PlacementRequest],
    ) -> Vec<Result<Decision, PlacementError>> {
        requests
            .iter()
            .map(|request| self.place_one(request))
            .collect()
    }

    pub fn place_one(&mut self, request: &PlacementRequest) -> Result<Decision, PlacementError> {
        let need = request.need();
        let chosen = match request.strategy {
            Strategy::NodeAffinity { node, soft: false } => {
                let Some(load) = self.nodes.get(&node) else {
                    return Err(PlacementError::AffinityNodeGone { node });
                };
                if !load.fits_when_idle(need) {
                    return Err(self.infeasible(request, [load]));
                }
                load.fits_now(need).then_some(node)
            }
            Strategy::NodeAffinity { node, soft: true } => {
                match self.nodes.get(&node).filter(|load| load.fits_now(need)) {
                    Some(_) => Some(node),
                    None => self.choose_default(request),
                }
            }
            Strategy::Default => self.choose_default(request),
            Strategy::Spread => self.choose_spread(need),
        };
        match chosen {
            Some(node) => {
                self.update(node, |load| {
                    load.used.cpu_millis += need.cpu_millis;
                    load.used.heap_bytes += need.heap_bytes;
                });
                if request.strategy == Strategy::Spread {
                    self.spread_cursor = Some(node);
                }
                Ok(Decision::Placed(node))
            }
            None if self.nodes.is_empty() => Err(PlacementError::NoNodes),
            None if self.nodes.values().any(|load| load.fits_when_idle(need)) => Ok(Decision::Wait),
            None => Err(self.infeasible(request, self.nodes.values())),
        }
    }

    fn infeasible<'a>(
        &self,
        request: &PlacementRequest,
        nodes: impl IntoIterator<Item = &'a NodeLoad>,
    ) -> PlacementError {
        let (mut largest_cpu_millis, mut largest_heap_bytes) = (0, 0);
        for load in nodes {
            largest_cpu_millis = largest_cpu_millis.max(load.total.cpu_millis);
            largest_heap_bytes = largest_heap_bytes.max(load.total.heap_bytes);
        }
        PlacementError::Infeasible {
            cpu_millis: request.cpu_millis,
            memory_hint: request.memory_hint,
            largest_cpu_millis,
            largest_heap_bytes,
        }
    }

    fn choose_default(&self, request: &PlacementRequest) -> Option<NodeId> {
        let need = request.need();
        // The preferred node holds the most input bytes (ties: the lower id); only alive
        // nodes count.
        let preferred = request
            .preferred
            .iter()
            .filter(|(node, _)| self.nodes.contains_key(node))
            .max_by(|(a, a_bytes), (b, b_bytes)| a_bytes.cmp(b_bytes).then(b.cmp(a)))
            .map(|(node, _)| *node)
            .or(request.requester);
        if let Some(node) = preferred
            && let Some(load) = self.nodes.get(&node)
            && load.fits_now(need)
            && load.utilization() < SPREAD_THRESHOLD
        {
            return Some(node);
        }
        let fitting = || self.nodes.iter().filter(|(_, load)| load.fits_now(need));
        if let Some((node, _)) = fitting().find(|(_, load)| load.utilization() < SPREAD_THRESHOLD) {
            return Some(*node);
        }
        self.by_utilization
            .iter()
            .map(|(_, node)| *node)
            .find(|node| self.nodes.get(node).is_some_and(|load| load.fits_now(need)))
    }

    fn choose_spread(&self, need: Resources) -> Option<NodeId> {
        let fits = |node: &NodeId| self.nodes.get(node).is_some_and(|load| load.fits_now(need));
        let cursor = self.spread_cursor.map_or(0, NodeId::get);
        // A request that reserves nothing (an actor that only keeps books) loads no node:
        // balancing by utilization would send every one to the idlest node, so such requests
        // simply take turns over all nodes.
        if need.cpu_millis == 0 && need.heap_bytes == 0 {
            let after = self.nodes.range(NodeId::new(cursor.saturating_add(1))..);
            let up_to = self.nodes.range(..=NodeId::new(cursor));
            return after
                .chain(up_to)
                .map(|(node, _)| *node)
                .find(|node| fits(node));
        }
        // Walk the utilization levels from the lowest; within a level, start after the node
        // chosen last so equal candidates take turns.
        let mut level = self.by_utilization.first().map(|(key, _)| *key);
        while let Some(key) = level {
            let after = self
                .by_utilization
                .range((key, NodeId::new(cursor.saturating_add(1)))..=(key, NodeId::new(u64::MAX)));
            let up_to = self
                .by_utilization
                .range((key, NodeId::new(0))..=(key, NodeId::new(cursor)));
            if let Some((_, node)) = after.chain(up_to).find(|(_, node)| fits(node)) {
                return Some(*node);
            }
            level = key.checked_add(1).and_then(|next| {
                self.by_utilization
                    .range((next, NodeId::new(0))..)
                    .next()
                    .map(|(key, _)| *key)
            });
        }
        None
    }
}

/// Requests that wait for resources, in arrival order, each with whatever `T` the caller
/// needs to answer it (a reply channel). They are retried when resources are released or a
/// node joins — never by polling.
#[derive(Debug)]
pub struct PlacementQueue<T> {
    waiting: VecDeque<(PlacementRequest, T)>,
}

impl<T> Default for PlacementQueue<T> {
    fn default() -> Self {
        Self {
            waiting: VecDeque::new(),
        }
    }
}

impl<T> PlacementQueue<T> {
    pub fn push(&mut self, request: PlacementRequest, waiter: T) {
        self.waiting.push_back((request, waiter));
    }

    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Retries every waiting request in order with `place`. Returns the ones that were placed
    /// or became infeasible (e.g. their only big node died); the rest keep waiting, in order.
    pub fn retry(
        &mut self,
        mut place: impl FnMut(&PlacementRequest) -> Result<Decision, PlacementError>,
    ) -> Vec<(T, Result<NodeId, PlacementError>)> {
        let mut settled = Vec::new();
        for (request, waiter) in std::mem::take(&mut self.waiting) {
            match place(&request) {
                Ok(Decision::Placed(node)) => settled.push((waiter, Ok(node))),
                Ok(Decision::Wait) => self.waiting.push_back((request, waiter)),
                Err(error) => settled.push((waiter, Err(error))),
            }
        }
        settled
    }
}

#[cfg(test)]
mod tests;
