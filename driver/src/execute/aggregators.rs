//! A hash shuffle's aggregator actors, seen from the driver: the slots the executor keeps per
//! shuffle, the cluster calls that place, start, feed and stop the actors, and the executor's
//! handling of their creation, death and replacement.
//!
//! When a hash shuffle (groupby, keyed repartition, join, unique) receives its first input,
//! the driver creates `min(cluster CPUs, 128)` [`HashShuffleAggregator`] actors, placed with
//! SPREAD through the scheduler and recorded in its replicated state; slot `s` of `n` owns the
//! partitions `p` with `p % n == s`. Once the partition count `N` is known, slots at or past
//! `N` own nothing and are stopped, leaving `min(N, CPUs, 128)`. Every map task's shards are
//! pushed to their aggregators as soon as it finishes, and each partition's reduce runs
//! through its aggregator, on the aggregator's node (placed there with hard affinity, so the
//! CPU is reserved as for any task). An aggregator whose node dies is created again on
//! another node under a new id, and only its partitions' shards are pushed again; reduce
//! outputs of other partitions stay as they are.
//!
//! [`HashShuffleAggregator`]: floe_api::node_protocol::ActorKind::HashShuffleAggregator

use std::collections::BTreeSet;
use std::sync::Arc;

use floe_core::job::ActorProgress;
use floe_core::plan::task::StageInput;

use floe_api::placement::{PlacementRequest, Strategy};
use floe_api::state::{Command, Outcome};

use floe_core::{ActorId, JobId, NodeId, ObjectId};

use super::task::{Launch, Recipe};
use super::{Event, Execution, MAX_UNREACHABLE_RETRIES, UNREACHABLE_PAUSE};
use crate::cluster::ClusterAccess;
use crate::{Error, Result};
use floe_api::node_protocol::{
    ActorKind, ActorMessage, ActorReply, ActorSpec, NodeRequest, NodeResponse, Part, PushedShard,
};

/// At most this many aggregators per shuffle (Ray's cap).
pub const MAX_AGGREGATORS: u64 = 128;

/// One aggregator slot: the actor serving it now.
#[derive(Debug, Clone)]
pub struct Slot {
    pub actor: ActorId,
    /// Where it runs; `None` while it is being created.
    pub node: Option<NodeId>,
    /// Map tasks (by sequence number) whose shards this actor was sent.
    pub pushed: BTreeSet<u64>,
    /// Creation attempts that failed in a row.
    pub failed_creations: u32,
    /// No partition is its (the partition count turned out smaller than the slots).
    pub idle: bool,
    /// Calls sent to the current actor (pushes and reduces), for the dashboard.
    pub calls: u64,
    /// Times the slot's actor was created again after one was gone.
    pub restarts: u32,
}

impl Slot {
    fn new() -> Self {
        Self {
            actor: ActorId::random(),
            node: None,
            pushed: BTreeSet::new(),
            failed_creations: 0,
            idle: false,
            calls: 0,
            restarts: 0,
        }
    }

    /// A new actor for this slot, replacing one that is gone or was never created.
    pub fn replace(&mut self) {
        *self = Self {
            failed_creations: self.failed_creations,
            restarts: self.restarts,
            ..Self::new()
        };
    }
}

/// A shuffle's aggregators.
#[derive(Debug, Clone)]
pub struct Aggregators {
    pub slots: Vec<Slot>,
}

impl Aggregators {
    pub fn new(cluster_cpus: u64) -> Self {
        let count = cluster_cpus.clamp(1, MAX_AGGREGATORS) as usize;
        Self {
            slots: (0..count).map(|_| Slot::new()).collect(),
        }
    }

    /// The slot owning `partition`.
    pub fn slot_of(&self, partition: u32) -> usize {
        partition as usize % self.slots.len()
    }

    /// Marks the slots that own none of `partitions` partitions as idle, returning the
    /// actors to stop.
    pub fn keep_for(&mut self, partitions: u32) -> Vec<(ActorId, Option<NodeId>)> {
        let mut stop = Vec::new();
        for (index, slot) in self.slots.iter_mut().enumerate() {
            if index >= partitions as usize && !slot.idle {
                slot.idle = true;
                stop.push((slot.actor, slot.node));
            }
        }
        stop
    }

    /// The partitions slot `slot` owns among `partitions`.
    pub fn owned(&self, slot: usize, partitions: u32) -> impl Iterator<Item = u32> + use<> {
        let count = self.slots.len() as u32;
        let slot = slot as u32;
        (slot..partitions).step_by(count as usize)
    }

    pub fn count(&self) -> u32 {
        self.slots.len() as u32
    }
}

/// Which actor serves which slot of how many.
#[derive(Debug, Clone, Copy)]
pub struct AggregatorSpec {
    pub actor: ActorId,
    pub slot: u32,
    pub slots: u32,
}

/// Why an aggregator could not be created (its creation is tried again, up to a limit).
#[derive(Debug, thiserror::Error)]
pub enum AggregatorError {
    /// The batch placing every aggregator of a shuffle failed.
    #[error("placing {count} aggregators: {source}")]
    PlaceBatch { count: usize, source: Arc<Error> },
    #[error("placing aggregator {slot}: {source}")]
    Place { slot: u32, source: Error },
    #[error("recording aggregator {slot}: {outcome:?}")]
    Rejected { slot: u32, outcome: Outcome },
    #[error("recording aggregator {slot}: {source}")]
    Record { slot: u32, source: Error },
    #[error("aggregator {slot}'s node {node}: {source}")]
    NodeUnknown {
        slot: u32,
        node: NodeId,
        source: Error,
    },
    #[error("creating aggregator {slot}: unexpected {response:?}")]
    Unexpected {
        slot: u32,
        response: Box<NodeResponse>,
    },
    #[error("creating aggregator {slot} on node {node}: {source}")]
    Create {
        slot: u32,
        node: NodeId,
        source: Error,
    },
}

/// The nodes for `count` new aggregators, placed in one SPREAD batch so they are spread
/// evenly over the alive nodes.
pub async fn place_spread<C: ClusterAccess>(cluster: &C, count: usize) -> Result<Vec<NodeId>> {
    let requests = (0..count).map(|_| book_keeping(Strategy::Spread)).collect();
    cluster.place_all(requests).await
}

/// Places a replacement for slot `slot` on another node than `avoid` where there is one
/// (the slot number spreads several replacements out), then starts it.
pub async fn replace<C: ClusterAccess>(
    cluster: Arc<C>,
    job: JobId,
    spec: AggregatorSpec,
    avoid: Option<NodeId>,
) -> Result<NodeId, AggregatorError> {
    let slot = spec.slot;
    let others: Vec<NodeId> = cluster
        .alive_nodes()
        .into_iter()
        .filter(|node| Some(*node) != avoid)
        .collect();
    let strategy = match others.is_empty() {
        false => Strategy::NodeAffinity {
            node: others[slot as usize % others.len()],
            soft: true,
        },
        true => Strategy::Spread,
    };
    let node = cluster
        .place(book_keeping(strategy))
        .await
        .map_err(|source| AggregatorError::Place { slot, source })?;
    start_on(cluster.as_ref(), job, spec, node).await
}

/// The actor keeps books only; its reduces reserve their CPU as tasks.
fn book_keeping(strategy: Strategy) -> PlacementRequest {
    PlacementRequest {
        cpu_millis: 0,
        memory_hint: 0,
        strategy,
        preferred: Vec::new(),
        requester: None,
    }
}

/// Records slot `slot`'s actor on `node` in the scheduler's state and has the node host it.
pub async fn start_on<C: ClusterAccess>(
    cluster: &C,
    job: JobId,
    spec: AggregatorSpec,
    node: NodeId,
) -> Result<NodeId, AggregatorError> {
    let AggregatorSpec { actor, slot, slots } = spec;
    let kind = ActorKind::HashShuffleAggregator { slot, slots };
    let register = Command::RegisterActor {
        actor,
        kind: kind.name().to_owned(),
        node,
        job,
    };
    match cluster.propose(register).await {
        Ok(Outcome::Applied) => {}
        Ok(outcome) => return Err(AggregatorError::Rejected { slot, outcome }),
        Err(source) => return Err(AggregatorError::Record { slot, source }),
    }
    let addr = cluster
        .address(node)
        .await
        .map_err(|source| AggregatorError::NodeUnknown { slot, node, source })?;
    let create = NodeRequest::CreateActor(ActorSpec { actor, job, kind });
    match cluster.call_node(&addr, &create).await {
        Ok(NodeResponse::ActorCreated) => Ok(node),
        Ok(other) => Err(AggregatorError::Unexpected {
            slot,
            response: Box::new(other),
        }),
        Err(source) => Err(AggregatorError::Create { slot, node, source }),
    }
}

/// One shard to push: a partition's part of a map task's object, and the node holding it.
#[derive(Debug, Clone, Copy)]
pub struct Shard {
    pub partition: u32,
    pub object: ObjectId,
    pub part: Part,
    pub holder: NodeId,
}

/// Sends `shards` to `actor` on `actor_node`, through the driver's own node, which routes the
/// call. A failed push only costs the reduce a pull.
pub async fn push<C: ClusterAccess>(
    cluster: Arc<C>,
    via: NodeId,
    actor: ActorId,
    actor_node: NodeId,
    shards: Vec<Shard>,
) {
    let mut pushed = Vec::with_capacity(shards.len());
    for shard in shards {
        let holder = if shard.holder == actor_node {
            None
        } else {
            match cluster.address(shard.holder).await {
                Ok(addr) => Some(addr),
                // Lost with its node: the reduce has it rebuilt.
                Err(_) => continue,
            }
        };
        pushed.push(PushedShard {
            partition: shard.partition,
            object: shard.object,
            part: shard.part,
            holder,
        });
    }
    let request = NodeRequest::CallActor {
        actor,
        message: ActorMessage::Push(pushed),
        forwarded: false,
    };
    let addr = match cluster.address(via).await {
        Ok(addr) => addr,
        Err(error) => {
            tracing::debug!(%actor, %error, "cannot push shards: the driver's node is unknown");
            return;
        }
    };
    // The routing node gives up on a forwarded push after its read timeout; once the
    // aggregator's node's death commits, the wait ends sooner.
    let reply = tokio::select! {
        reply = cluster.run_task(&addr, &request) => reply,
        () = cluster.death_of(actor_node) => {
            tracing::debug!(%actor, %actor_node, "an aggregator's node died during a push");
            return;
        }
    };
    match reply {
        Ok(NodeResponse::Actor(Ok(ActorReply::Pushed { held_bytes }))) => {
            tracing::debug!(%actor, held_bytes, "pushed shards to an aggregator");
        }
        Ok(other) => tracing::debug!(%actor, ?other, "an aggregator did not take its shards"),
        Err(error) => tracing::debug!(%actor, %error, "pushing shards failed"),
    }
}

/// Stops actors and drops their records (best effort: an actor on a dead node is gone
/// already, and the job's end drops every record it still has).
pub async fn stop<C: ClusterAccess>(cluster: Arc<C>, actors: Vec<(ActorId, NodeId)>) {
    for (actor, node) in actors {
        if let Err(error) = cluster.propose(Command::RemoveActor { actor }).await {
            tracing::debug!(%actor, %error, "cannot drop an aggregator's record");
        }
        if let Ok(addr) = cluster.address(node).await
            && let Err(error) = cluster
                .call_node(&addr, &NodeRequest::StopActor { actor })
                .await
        {
            tracing::debug!(%actor, %node, %error, "cannot stop an aggregator");
        }
    }
}

/// Where a task goes: a hash shuffle's reduce through its partition's aggregator.
pub(super) enum ReduceRoute {
    /// Placed and run like any task.
    Direct,
    /// Through `actor`, on its node.
    Aggregator { actor: ActorId, node: NodeId },
    /// The partition's aggregator is being created: the task waits.
    AggregatorStarting,
}

impl<C: ClusterAccess> Execution<C> {
    /// How task `launch` of operator `index` runs.
    pub(super) fn reduce_route(&self, index: usize, launch: &Launch) -> ReduceRoute {
        let (
            Recipe::Compute {
                input: StageInput::Reduce { partition, .. },
                ..
            },
            Some(pool),
        ) = (&launch.recipe, &self.ops[index].shuffle.aggregators)
        else {
            return ReduceRoute::Direct;
        };
        let slot = &pool.slots[pool.slot_of(*partition)];
        match slot.node {
            // A reduce that failed on the aggregator's node (its worker died or ran out of
            // memory) runs again elsewhere as a plain task, which pulls its shards.
            Some(node) if launch.avoid == Some(node) => ReduceRoute::Direct,
            Some(node) => ReduceRoute::Aggregator {
                actor: slot.actor,
                node,
            },
            None => ReduceRoute::AggregatorStarting,
        }
    }

    /// Creates a hash shuffle's aggregators (see [`aggregators`]).
    pub(super) fn start_aggregators(&mut self, index: usize) {
        let pool = Aggregators::new(self.limits.concurrency_cap);
        let op = &mut self.ops[index];
        op.stats.aggregators += pool.slots.len() as u64;
        let count = pool.count();
        let actors: Vec<ActorId> = pool.slots.iter().map(|slot| slot.actor).collect();
        let actors_count = actors.len();
        op.shuffle.aggregators = Some(pool);
        let cluster = Arc::clone(&self.cluster);
        let events = self.events_tx.clone();
        let job = self.job;
        tokio::spawn(async move {
            let placed = place_spread(cluster.as_ref(), actors.len())
                .await
                .map_err(Arc::new);
            let mut starts = tokio::task::JoinSet::new();
            for (slot, actor) in actors.into_iter().enumerate() {
                let spec = AggregatorSpec {
                    actor,
                    slot: u32::try_from(slot).unwrap_or(u32::MAX),
                    slots: count,
                };
                let cluster = Arc::clone(&cluster);
                let node = match &placed {
                    Ok(nodes) => Ok(nodes[slot]),
                    Err(source) => Err(AggregatorError::PlaceBatch {
                        count: actors_count,
                        source: Arc::clone(source),
                    }),
                };
                let events = events.clone();
                starts.spawn(async move {
                    let result = match node {
                        Ok(node) => start_on(cluster.as_ref(), job, spec, node).await,
                        Err(error) => Err(error),
                    };
                    let _ = events.send(Event::AggregatorCreated {
                        op: index,
                        slot,
                        actor,
                        result,
                    });
                });
            }
            while starts.join_next().await.is_some() {}
        });
    }

    fn create_aggregator(
        &self,
        index: usize,
        slot: usize,
        actor: ActorId,
        count: u32,
        avoid: Option<NodeId>,
    ) {
        let cluster = Arc::clone(&self.cluster);
        let events = self.events_tx.clone();
        let job = self.job;
        let spec = AggregatorSpec {
            actor,
            slot: u32::try_from(slot).unwrap_or(u32::MAX),
            slots: count,
        };
        tokio::spawn(async move {
            let result = replace(cluster, job, spec, avoid).await;
            let _ = events.send(Event::AggregatorCreated {
                op: index,
                slot,
                actor,
                result,
            });
        });
    }

    /// A new actor for slot `slot`, whose actor died (with its node, or on its own); its
    /// partitions' shards are pushed to the new one once it runs.
    pub(super) fn replace_aggregator(
        &mut self,
        index: usize,
        slot: usize,
        gone: ActorId,
        avoid: Option<NodeId>,
    ) {
        let op = &mut self.ops[index];
        let Some(pool) = &mut op.shuffle.aggregators else {
            return;
        };
        let count = pool.count();
        // Only the slot's current actor: a late answer from one already replaced says
        // nothing about its successor.
        let Some(entry) = pool.slots.get_mut(slot).filter(|entry| entry.actor == gone) else {
            return;
        };
        if entry.idle || entry.node.is_none() {
            return;
        }
        tracing::warn!(job = %self.job, operator = %op.name, slot, actor = %entry.actor, ?avoid, "an aggregator is gone; creating it again");
        let old_node = entry.node;
        entry.replace();
        entry.restarts += 1;
        let actor = entry.actor;
        op.stats.aggregators += 1;
        op.stats.aggregators_recreated += 1;
        self.create_aggregator(index, slot, actor, count, avoid);
        // Stopped and unrecorded, in case it still lives and holds shards.
        self.stop_actors(vec![(gone, old_node)]);
    }

    pub(super) fn aggregator_created(
        &mut self,
        index: usize,
        slot: usize,
        actor: ActorId,
        result: Result<NodeId, AggregatorError>,
    ) {
        let current = self.ops[index]
            .shuffle
            .aggregators
            .as_ref()
            .and_then(|pool| pool.slots.get(slot))
            .filter(|entry| entry.actor == actor)
            .map(|entry| entry.idle);
        let Some(idle) = current else {
            // Superseded (or the shuffle is over): this actor is not wanted.
            if let Ok(node) = result {
                self.stop_actors(vec![(actor, Some(node))]);
            }
            return;
        };
        match result {
            Ok(node) if idle => self.stop_actors(vec![(actor, Some(node))]),
            Ok(node) => {
                if let Some(entry) = self.slot_mut(index, slot) {
                    entry.node = Some(node);
                    entry.failed_creations = 0;
                }
                let seqs: Vec<u64> = self.ops[index]
                    .shuffle
                    .map_outputs
                    .keys()
                    .copied()
                    .collect();
                self.push_to(index, slot, &seqs);
            }
            Err(error) => {
                let Some(entry) = self.slot_mut(index, slot) else {
                    return;
                };
                entry.failed_creations += 1;
                if entry.failed_creations > MAX_UNREACHABLE_RETRIES {
                    self.fail(index, format!("cannot create an aggregator: {error}"));
                    return;
                }
                tracing::info!(job = %self.job, slot, %error, "creating an aggregator failed; trying again");
                let events = self.events_tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(UNREACHABLE_PAUSE).await;
                    let _ = events.send(Event::RetryAggregator {
                        op: index,
                        slot,
                        actor,
                    });
                });
            }
        }
    }

    pub(super) fn retry_aggregator(&mut self, index: usize, slot: usize, actor: ActorId) {
        let Some(pool) = &mut self.ops[index].shuffle.aggregators else {
            return;
        };
        let count = pool.count();
        let Some(entry) = pool
            .slots
            .get_mut(slot)
            .filter(|entry| entry.actor == actor)
        else {
            return;
        };
        // A fresh id: the failed attempt may have been recorded before it failed.
        entry.replace();
        let actor = entry.actor;
        self.ops[index].stats.aggregators += 1;
        self.create_aggregator(index, slot, actor, count, None);
    }

    /// Counts a call (a reduce) sent to `actor`, one of operator `index`'s aggregators.
    pub(super) fn count_call(&mut self, index: usize, actor: ActorId) {
        let slot = self.ops[index]
            .shuffle
            .aggregators
            .as_mut()
            .and_then(|pool| pool.slots.iter_mut().find(|slot| slot.actor == actor));
        if let Some(slot) = slot {
            slot.calls += 1;
        }
    }

    /// Every running aggregator of the job, for its progress report.
    pub(super) fn actor_progress(&self) -> Vec<ActorProgress> {
        self.ops
            .iter()
            .filter_map(|op| op.shuffle.aggregators.as_ref())
            .flat_map(|pool| &pool.slots)
            .filter(|slot| !slot.idle && slot.node.is_some())
            .map(|slot| ActorProgress {
                actor: slot.actor,
                calls: slot.calls,
                restarts: slot.restarts,
            })
            .collect()
    }

    fn slot_mut(&mut self, index: usize, slot: usize) -> Option<&mut Slot> {
        self.ops[index]
            .shuffle
            .aggregators
            .as_mut()
            .and_then(|pool| pool.slots.get_mut(slot))
    }

    /// Pushes the shards of map tasks `seqs` that slot `slot` owns to its actor, if it runs.
    pub(super) fn push_to(&mut self, index: usize, slot: usize, seqs: &[u64]) {
        let shuffle = &self.ops[index].shuffle;
        let partitions = shuffle.partitions;
        let Some(pool) = &shuffle.aggregators else {
            return;
        };
        let Some(entry) = pool.slots.get(slot).filter(|entry| !entry.idle) else {
            return;
        };
        let Some(node) = entry.node else {
            return;
        };
        let mut shards = Vec::new();
        let mut pushed = Vec::new();
        for seq in seqs {
            let Some(outputs) = shuffle.map_outputs.get(seq) else {
                continue;
            };
            if entry.pushed.contains(seq) {
                continue;
            }
            pushed.push(*seq);
            for partition in pool.owned(slot, partitions) {
                let Some(object) = outputs.get(partition as usize) else {
                    continue;
                };
                // Map outputs are packed: each shard is its map task's object's part.
                if let Some((info, packed)) = self
                    .blocks
                    .get(object)
                    .and_then(|info| Some((info, info.packed?)))
                {
                    shards.push(Shard {
                        partition,
                        object: packed.object,
                        part: packed.part,
                        holder: info.node,
                    });
                }
            }
        }
        let actor = entry.actor;
        let sends = !shards.is_empty();
        if let Some(entry) = self.slot_mut(index, slot) {
            entry.pushed.extend(pushed);
            entry.calls += u64::from(sends);
        }
        if !sends {
            return;
        }
        let cluster = Arc::clone(&self.cluster);
        let via = self.config.node;
        tokio::spawn(push(cluster, via, actor, node, shards));
    }

    /// Aggregators on nodes the scheduler has declared dead are created again elsewhere.
    pub(super) fn replace_dead_aggregators(&mut self) {
        let alive: BTreeSet<NodeId> = self.cluster.alive_nodes().into_iter().collect();
        for index in 0..self.ops.len() {
            let dead: Vec<(usize, ActorId, NodeId)> = self.ops[index]
                .shuffle
                .aggregators
                .iter()
                .flat_map(|pool| pool.slots.iter().enumerate())
                .filter_map(|(slot, entry)| Some((slot, entry.actor, entry.node?)))
                .filter(|(_, _, node)| !alive.contains(node))
                .collect();
            for (slot, actor, node) in dead {
                self.replace_aggregator(index, slot, actor, Some(node));
            }
        }
    }

    /// Stops a shuffle's aggregators once it no longer needs them; a later rebuild of one of
    /// its partitions runs as a plain task.
    pub(super) fn stop_aggregators(&mut self, index: usize) {
        let Some(pool) = self.ops[index].shuffle.aggregators.take() else {
            return;
        };
        let actors = pool
            .slots
            .into_iter()
            .filter(|slot| !slot.idle)
            .map(|slot| (slot.actor, slot.node))
            .collect();
        self.stop_actors(actors);
    }

    pub(super) fn stop_actors(&self, actors: Vec<(ActorId, Option<NodeId>)>) {
        let actors: Vec<(ActorId, NodeId)> = actors
            .into_iter()
            .filter_map(|(actor, node)| Some((actor, node?)))
            .collect();
        if !actors.is_empty() {
            tokio::spawn(stop(Arc::clone(&self.cluster), actors));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_own_partitions_round_robin_and_idle_slots_are_stopped() {
        let mut pool = Aggregators::new(4);
        assert_eq!(pool.count(), 4);
        assert_eq!(pool.owned(1, 10).collect::<Vec<_>>(), [1, 5, 9]);
        assert_eq!(pool.owned(3, 3).count(), 0);
        assert!((0..10).all(|partition| {
            pool.owned(pool.slot_of(partition), 10)
                .any(|owned| owned == partition)
        }));
        // Three partitions: the fourth slot owns none and is stopped, once.
        let stopped = pool.keep_for(3);
        assert_eq!(stopped, [(pool.slots[3].actor, None)]);
        assert!(pool.keep_for(3).is_empty());
        assert!(pool.slots[3].idle && !pool.slots[2].idle);
    }

    #[test]
    fn aggregators_are_capped() {
        assert_eq!(Aggregators::new(1_000).count() as u64, MAX_AGGREGATORS);
        assert_eq!(Aggregators::new(0).count(), 1);
    }
}
