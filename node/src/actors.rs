//! Actors: long-lived, stateful objects addressable cluster-wide by [`ActorId`].
//!
//! The scheduler places an actor (a `Place` through the usual policy) and records where it
//! lives in its replicated state (`RegisterActor`); the chosen node's agent then hosts it as an
//! actix actor on the agent's actor thread ([`ActorHost`], one actix `System`). A call reaches
//! an actor through any node: the agent that hosts it delivers the message to its mailbox,
//! any other agent looks the actor up in the scheduler's state and forwards the call once, so
//! a stale route ends in [`ActorFailure::Gone`] instead of a loop. An actor's heavy work (a
//! reduce) still runs as a task on the node's worker processes, so nothing an actor computes
//! can take the agent down; the actor itself owns only bookkeeping. An actor dies with its
//! node (the scheduler drops its record when the node's death commits) or when its owner
//! stops it; whoever owns it creates it again elsewhere. A hosted actor the scheduler no
//! longer records (its job ended, or its driver died) is stopped by a periodic sweep.
//!
//! Two kinds exist: the [`JobDriver`], which the scheduler places when it starts a job's
//! driver (`StartDriver` records it), and the [`HashShuffleAggregator`], which a driver places
//! for a hash shuffle. Every actor answers [`ActorMessage::Describe`].

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use actix::{
    Actor, ActorContext, ActorFutureExt, Addr, ArbiterHandle, AsyncContext, Context, Handler,
    Message, WrapFuture,
};
use floe_api::client::SchedulerClient;
use floe_api::state::{DRIVER_ACTOR_KIND, driver_actor};
use floe_core::wire::{RpcClient, WireConfig, within};
use floe_core::{ActorId, JobId, NodeId, ObjectId};
use tokio::runtime::Handle;
use tokio::task::{AbortHandle, JoinHandle};
use tracing::Instrument as _;

use super::transfer::PulledParts;
use super::{Error, Result, Shared};
use floe_api::node_protocol::{
    ActorDescription, ActorFailure, ActorKind, ActorMessage, ActorReply, ActorSpec, InputRef,
    NodeProtocol, NodeRequest, NodeResponse, Part, PushedShard, TaskSpec,
};
use floe_driver::DriverConfig;

/// How long a forwarded reduce may wait for its reply: it runs as long as its task. Other
/// forwarded calls get the configured read timeout, so a push to a node that froze without
/// closing its connections does not hold one for a day.
const FORWARD_REDUCE_TIMEOUT_MS: u64 = 24 * 3600 * 1000;
/// Routes remembered at most; actors come and go with jobs, so the table starts over rather
/// than growing with every actor the node ever routed to.
const MAX_ROUTES: usize = 10_000;

type Reply = std::result::Result<ActorReply, ActorFailure>;

/// The actors this node hosts, and the routes it learned to actors elsewhere.
pub(crate) struct ActorHost {
    system: actix::System,
    arbiter: ArbiterHandle,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    hosted: Mutex<BTreeMap<ActorId, Hosted>>,
    /// Actor → the RPC address of the node hosting it, as last read from the scheduler.
    routes: Mutex<BTreeMap<ActorId, String>>,
    schedulers: Vec<String>,
    /// The configured wire, for the scheduler.
    wire: WireConfig,
    /// The configured wire with a read timeout long enough for a forwarded reduce; shorter
    /// calls are bounded by `wire`'s read timeout around the call.
    forward_wire: WireConfig,
    /// Idle connections for forwarded calls, by address.
    connections: Mutex<BTreeMap<String, Vec<RpcClient<NodeProtocol>>>>,
}

struct Hosted {
    job: JobId,
    actor: HostedActor,
}

#[derive(Clone)]
enum HostedActor {
    Aggregator(Addr<HashShuffleAggregator>),
    /// The driver's task runs on the agent's runtime; the host aborts it when it stops the
    /// actor.
    Driver {
        address: Addr<JobDriver>,
        task: AbortHandle,
    },
}

impl HostedActor {
    fn is_running(&self) -> bool {
        match self {
            HostedActor::Aggregator(address) => address.connected(),
            HostedActor::Driver { address, .. } => address.connected(),
        }
    }

    async fn send(&self, message: ActorMessage) -> std::result::Result<Reply, actix::MailboxError> {
        match self {
            HostedActor::Aggregator(address) => address.send(Call(message)).await,
            HostedActor::Driver { address, .. } => address.send(Call(message)).await,
        }
    }

    fn stop(&self) {
        if let HostedActor::Driver { task, .. } = self {
            task.abort();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ActorHost {
    /// Starts the actor thread (an actix `System` with its arbiter).
    pub fn start(schedulers: Vec<String>, wire: &WireConfig) -> Result<Self> {
        let (started, handles) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("floe-actors".into())
            .spawn(move || {
                let runner = actix::System::new();
                let _ = started.send((actix::System::current(), actix::Arbiter::current()));
                if let Err(error) = runner.run() {
                    tracing::error!(%error, "the actor system stopped with an error");
                }
            })
            .map_err(|source| Error::Io {
                op: "starting the actor thread",
                source,
            })?;
        let (system, arbiter) = handles
            .recv()
            .map_err(|_| Error::Worker("the actor thread exited before starting".into()))?;
        let mut forward_wire = wire.clone();
        forward_wire.timeouts.read_ms =
            forward_wire.timeouts.read_ms.max(FORWARD_REDUCE_TIMEOUT_MS);
        Ok(Self {
            system,
            arbiter,
            thread: Mutex::new(Some(thread)),
            hosted: Mutex::new(BTreeMap::new()),
            routes: Mutex::new(BTreeMap::new()),
            schedulers,
            wire: wire.clone(),
            forward_wire,
            connections: Mutex::new(BTreeMap::new()),
        })
    }

    /// The actors hosted here.
    pub fn hosted(&self) -> Vec<ActorId> {
        lock(&self.hosted).keys().copied().collect()
    }

    /// Starts hosting `spec`'s actor. Creating one that is already here is a no-op, so a
    /// retried creation is harmless.
    pub fn create(&self, spec: ActorSpec, shared: &Arc<Shared>) {
        let mut hosted = lock(&self.hosted);
        if hosted.contains_key(&spec.actor) {
            return;
        }
        let ActorKind::HashShuffleAggregator { slot, slots } = spec.kind;
        let aggregator = HashShuffleAggregator {
            actor: spec.actor,
            job: spec.job,
            slot,
            slots: slots.max(1),
            held: BTreeMap::new(),
            copies: BTreeMap::new(),
            reduced: BTreeSet::new(),
            node: shared.node(),
            shared: Arc::downgrade(shared),
            runtime: Handle::current(),
        };
        let address = HashShuffleAggregator::start_in_arbiter(&self.arbiter, |_| aggregator);
        tracing::info!(actor = %spec.actor, job = %spec.job, "hosting a hash-shuffle aggregator");
        hosted.insert(
            spec.actor,
            Hosted {
                job: spec.job,
                actor: HostedActor::Aggregator(address),
            },
        );
    }

    /// Starts attempt `attempt` of `job`'s driver as the actor the scheduler recorded when it
    /// placed the driver here, replacing a finished one under that id.
    pub fn start_driver(&self, job: JobId, attempt: u32, config: Arc<DriverConfig>) -> ActorId {
        let actor = driver_actor(job, attempt);
        let node = config.node;
        // Every line the driver logs carries `job=ID`, which is how `/api/jobs/ID/logs`
        // finds it in the agent's log.
        let span = tracing::info_span!("driver", job = %job, attempt);
        let task = Handle::current().spawn(
            async move {
                if let Err(error) = floe_driver::run_driver(config, job, attempt).await {
                    tracing::error!(%error, "the job driver stopped");
                }
            }
            .instrument(span),
        );
        let abort = task.abort_handle();
        let state = JobDriver {
            actor,
            job,
            attempt,
            node,
            task: Some(task),
        };
        let address = JobDriver::start_in_arbiter(&self.arbiter, |_| state);
        let replaced = lock(&self.hosted).insert(
            actor,
            Hosted {
                job,
                actor: HostedActor::Driver {
                    address,
                    task: abort,
                },
            },
        );
        if let Some(replaced) = replaced {
            replaced.actor.stop();
        }
        actor
    }

    /// Whether `actor` is hosted here and has not stopped (a driver stops when its job ends).
    pub fn is_running(&self, actor: ActorId) -> bool {
        lock(&self.hosted)
            .get(&actor)
            .is_some_and(|hosted| hosted.actor.is_running())
    }

    /// Stops hosting an actor: a driver's task is aborted, an aggregator drops what it holds
    /// once its last message is handled.
    pub fn stop(&self, actor: ActorId) {
        if let Some(hosted) = lock(&self.hosted).remove(&actor) {
            hosted.actor.stop();
            tracing::info!(%actor, job = %hosted.job, "stopped an actor");
        }
    }

    /// Stops the hosted actors the scheduler no longer records: their job ended or their
    /// driver died, and nobody will stop them otherwise. Asks about each hosted actor, never
    /// for the whole state.
    pub async fn stop_unrecorded(&self) {
        // Only actors hosted before the questions: one created meanwhile may not be recorded yet.
        let hosted: Vec<ActorId> = lock(&self.hosted).keys().copied().collect();
        if hosted.is_empty() {
            return;
        }
        let mut scheduler = match self.scheduler() {
            Ok(scheduler) => scheduler,
            Err(error) => {
                tracing::debug!(%error, "cannot reach the scheduler to sweep actors");
                return;
            }
        };
        for actor in hosted {
            match scheduler.actor_node(actor).await {
                Ok(Some(_)) => {}
                Ok(None) => self.stop(actor),
                Err(error) => {
                    tracing::debug!(%error, "cannot ask the scheduler to sweep actors");
                    return;
                }
            }
        }
    }

    fn scheduler(&self) -> std::result::Result<SchedulerClient, floe_api::Error> {
        SchedulerClient::new(self.schedulers.clone(), self.wire.clone())
    }

    /// Delivers `message` to `actor`, here or (unless `forwarded`) on the node hosting it.
    pub async fn call(&self, actor: ActorId, message: ActorMessage, forwarded: bool) -> Reply {
        let local = lock(&self.hosted)
            .get(&actor)
            .map(|hosted| hosted.actor.clone());
        if let Some(local) = local {
            return local.send(message).await.unwrap_or_else(|error| {
                Err(ActorFailure::Gone {
                    actor,
                    reason: format!("its mailbox closed: {error}"),
                })
            });
        }
        if forwarded {
            return Err(ActorFailure::Gone {
                actor,
                reason: "the node the call was forwarded to does not host it".into(),
            });
        }
        let addr = self.route(actor).await?;
        let request = NodeRequest::CallActor {
            actor,
            message,
            forwarded: true,
        };
        match self.forward(&addr, &request).await {
            Ok(NodeResponse::Actor(reply)) => {
                if matches!(reply, Err(ActorFailure::Gone { .. })) {
                    lock(&self.routes).remove(&actor);
                }
                reply
            }
            Ok(other) => Err(ActorFailure::Gone {
                actor,
                reason: format!("its node answered {other:?}"),
            }),
            // The node may be restarting or dying: whoever called decides, from the node's
            // fate in the scheduler's state, whether the actor is gone.
            Err(error) => {
                lock(&self.routes).remove(&actor);
                Err(ActorFailure::Unavailable {
                    actor,
                    reason: format!("its node {addr} did not answer: {error}"),
                })
            }
        }
    }

    /// Sends a forwarded call over a pooled connection to `addr`. A connection whose call
    /// timed out is dropped, not pooled: its reply may still come.
    async fn forward(
        &self,
        addr: &str,
        request: &NodeRequest,
    ) -> std::result::Result<NodeResponse, floe_core::WireError> {
        let limit = match request {
            NodeRequest::CallActor {
                message: ActorMessage::Reduce { .. },
                ..
            } => self.forward_wire.timeouts.read(),
            _ => self.wire.timeouts.read(),
        };
        let idle = lock(&self.connections).get_mut(addr).and_then(Vec::pop);
        let mut client = match idle {
            Some(client) => client,
            None => RpcClient::<NodeProtocol>::connect(addr, self.forward_wire.clone()).await?,
        };
        let reply = within(
            limit,
            "waiting for a forwarded actor call",
            client.call(request),
        )
        .await??;
        let mut connections = lock(&self.connections);
        if connections.len() >= MAX_ROUTES {
            connections.clear();
        }
        connections.entry(addr.to_owned()).or_default().push(client);
        Ok(reply)
    }

    /// The address of the node hosting `actor`, from the cache or the scheduler.
    async fn route(&self, actor: ActorId) -> std::result::Result<String, ActorFailure> {
        if let Some(addr) = lock(&self.routes).get(&actor) {
            return Ok(addr.clone());
        }
        let unavailable = |error: floe_api::Error| ActorFailure::Unavailable {
            actor,
            reason: format!("cannot ask the scheduler where it is: {error}"),
        };
        let addr = self
            .scheduler()
            .map_err(unavailable)?
            .actor_node(actor)
            .await
            .map_err(unavailable)?
            .map(|node| node.rpc)
            .ok_or_else(|| ActorFailure::Gone {
                actor,
                reason: "the scheduler has no record of it on an alive node".into(),
            })?;
        let mut routes = lock(&self.routes);
        if routes.len() >= MAX_ROUTES {
            routes.clear();
        }
        routes.insert(actor, addr.clone());
        Ok(addr)
    }

    /// Stops every actor and the actor thread.
    pub fn shutdown(&self) {
        for (_, hosted) in std::mem::take(&mut *lock(&self.hosted)) {
            hosted.actor.stop();
        }
        self.system.stop();
        if let Some(thread) = lock(&self.thread).take()
            && thread.join().is_err()
        {
            tracing::warn!("the actor thread panicked");
        }
    }
}

impl Drop for ActorHost {
    /// An agent that failed to start, or was dropped without [`ActorHost::shutdown`], does not
    /// leave its actor thread running.
    fn drop(&mut self) {
        self.system.stop();
    }
}

/// Every message an actor accepts, with its reply.
struct Call(ActorMessage);

impl Message for Call {
    type Result = Reply;
}

/// One shard an aggregator holds: a partition's part of a map task's object.
#[derive(Debug, Clone, Copy)]
struct Held {
    bytes: u64,
    /// Where the aggregator pulled it (an object of its own, holding the parts it pulled from
    /// one node in one push, and where the part lies in it); `None` when the map task's object
    /// is on this node, whose owner frees it.
    copy: Option<(ObjectId, Part)>,
}

/// A shard by the map task's object and its place in it.
type ShardKey = (ObjectId, u64);

/// Owns a set of a hash shuffle's partitions. Map tasks' shards for them are pushed here as
/// each map task finishes, so the bytes cross the network while other map tasks still run: the
/// shards one push names on one node are pulled together into one object of the node's store
/// (which spills it under pressure: the aggregator's heap holds only ids). It reduces each
/// partition on its node's workers when the driver asks, reading the shards it pulled where
/// it keeps them. A pulled object is deleted once every partition with a shard in it is
/// reduced, or when the aggregator stops.
pub(crate) struct HashShuffleAggregator {
    actor: ActorId,
    job: JobId,
    node: Option<NodeId>,
    /// It owns the partitions whose number is `slot` modulo `slots`.
    slot: u32,
    slots: u32,
    held: BTreeMap<u32, BTreeMap<ShardKey, Held>>,
    /// Objects it pulled shards into, with the shards of unreduced partitions in each.
    copies: BTreeMap<ObjectId, usize>,
    /// Partitions already reduced: a push that arrives for one afterwards is dropped.
    reduced: BTreeSet<u32>,
    /// Weak, so the agent's state is not kept alive by its own actors.
    shared: Weak<Shared>,
    /// The agent's runtime, where pulls and tasks run (the actor thread only keeps books).
    runtime: Handle,
}

impl Actor for HashShuffleAggregator {
    type Context = Context<Self>;

    fn stopped(&mut self, _: &mut Self::Context) {
        let held = std::mem::take(&mut self.held);
        self.drop_pulled(held.into_values().flat_map(BTreeMap::into_values));
    }
}

impl Handler<Call> for HashShuffleAggregator {
    type Result = actix::ResponseActFuture<Self, Reply>;

    fn handle(&mut self, Call(message): Call, _: &mut Self::Context) -> Self::Result {
        let partition = match &message {
            ActorMessage::Push(shards) => shards
                .iter()
                .map(|shard| shard.partition)
                .find(|partition| !self.owns(*partition)),
            ActorMessage::Reduce { partition, .. } => {
                Some(*partition).filter(|partition| !self.owns(*partition))
            }
            ActorMessage::Describe => None,
        };
        if let Some(partition) = partition {
            let refused = Err(ActorFailure::Refused {
                actor: self.actor,
                reason: format!("partition {partition} is not one of its partitions"),
            });
            return Box::pin(actix::fut::ready(refused));
        }
        match message {
            ActorMessage::Push(shards) => self.push(shards),
            ActorMessage::Reduce { partition, task } => self.reduce(partition, task),
            ActorMessage::Describe => {
                let description = ActorReply::Described(self.describe());
                Box::pin(actix::fut::ready(Ok(description)))
            }
        }
    }
}

impl HashShuffleAggregator {
    fn owns(&self, partition: u32) -> bool {
        partition % self.slots == self.slot
    }

    fn describe(&self) -> ActorDescription {
        let shards: usize = self.held.values().map(BTreeMap::len).sum();
        let kind = ActorKind::HashShuffleAggregator {
            slot: self.slot,
            slots: self.slots,
        };
        ActorDescription {
            kind: kind.name().to_owned(),
            job: self.job,
            node: self.node,
            summary: format!(
                "owns the partitions {} modulo {}; holds {shards} shards, {} bytes",
                self.slot,
                self.slots,
                self.held_bytes()
            ),
        }
    }

    /// Starts `work` on the agent's runtime with the agent's shared state, or says why it
    /// cannot: the agent is going away.
    fn spawn_on_agent<T, F>(
        &self,
        work: impl FnOnce(Arc<Shared>) -> F,
    ) -> std::result::Result<JoinHandle<T>, ActorFailure>
    where
        F: std::future::Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let shared = self.shared.upgrade().ok_or(ActorFailure::Gone {
            actor: self.actor,
            reason: "its node is shutting down".into(),
        })?;
        Ok(self.runtime.spawn(work(shared)))
    }

    fn push(&mut self, shards: Vec<PushedShard>) -> actix::ResponseActFuture<Self, Reply> {
        let actor = self.actor;
        let pulls = match self
            .spawn_on_agent(move |shared| async move { pull_shards(&shared, actor, shards).await })
        {
            Ok(pulls) => pulls,
            Err(failure) => return Box::pin(actix::fut::ready(Err(failure))),
        };
        let work = async move {
            pulls.await.unwrap_or_else(|error| {
                let failure = ActorFailure::Gone {
                    actor,
                    reason: format!("its pull task failed: {error}"),
                };
                (Vec::new(), Some(failure), Vec::new())
            })
        };
        Box::pin(
            work.into_actor(self)
                .map(|(arrived, failure, pulled), act, _| {
                    let mut late = Vec::new();
                    for (partition, key, held) in arrived {
                        if let Some((copy, _)) = held.copy {
                            *act.copies.entry(copy).or_default() += 1;
                        }
                        // Pushed after its partition was reduced (a push and a reduce run
                        // concurrently), or pushed twice: nothing will read this copy.
                        if act.reduced.contains(&partition) {
                            late.push(held);
                            continue;
                        }
                        let entry = act.held.entry(partition).or_default();
                        match entry.get(&key) {
                            Some(before) if before.copy.is_some() || held.copy.is_none() => {
                                late.push(held);
                            }
                            _ => {
                                if let Some(before) = entry.insert(key, held) {
                                    late.push(before);
                                }
                            }
                        }
                    }
                    // The aggregator owns the copies now (and deletes them); had it stopped
                    // before the push finished, dropping `pulled` would have.
                    for copy in pulled {
                        copy.keep();
                    }
                    act.drop_pulled(late);
                    match failure {
                        Some(failure) => Err(failure),
                        None => Ok(ActorReply::Pushed {
                            held_bytes: act.held_bytes(),
                        }),
                    }
                }),
        )
    }

    fn reduce(&mut self, partition: u32, task: TaskSpec) -> actix::ResponseActFuture<Self, Reply> {
        let actor = self.actor;
        let task = self.read_held(partition, task);
        // Inputs still being pushed are pulled again by the task itself: a part pull shares
        // nothing with a push under way, so a reduce that overtakes its push pulls those
        // bytes twice.
        let run = match self.spawn_on_agent(|shared| async move { shared.run_task(task).await }) {
            Ok(run) => run,
            Err(failure) => return Box::pin(actix::fut::ready(Err(failure))),
        };
        let work = async move {
            run.await.unwrap_or_else(|error| {
                let failure = floe_api::node_protocol::TaskFailure::WorkerDied {
                    reason: format!("actor {actor}'s reduce task failed: {error}"),
                };
                (Err(failure), None)
            })
        };
        Box::pin(work.into_actor(self).map(move |(result, worker), act, _| {
            let done = result.map_err(ActorFailure::Task)?;
            act.reduced.insert(partition);
            let held = act.held.remove(&partition).unwrap_or_default();
            act.drop_pulled(held.into_values());
            Ok(ActorReply::Reduced { done, worker })
        }))
    }

    /// `task` reading the shards of `partition` this aggregator pulled where it keeps them;
    /// those it does not hold yet (a push still under way) the task pulls itself.
    fn read_held(&self, partition: u32, mut task: TaskSpec) -> TaskSpec {
        let Some(held) = self.held.get(&partition) else {
            return task;
        };
        for input in &mut task.inputs {
            let Some(part) = input.part else {
                continue;
            };
            if let Some((copy, local)) = held
                .get(&(input.object, part.offset))
                .and_then(|held| held.copy)
            {
                *input = InputRef {
                    object: copy,
                    holder: None,
                    part: Some(local),
                };
            }
        }
        task
    }

    /// Lets go of `held` shards: an object this aggregator pulled shards into is deleted with
    /// its last shard; shards on this node's own objects stay for their owner to free.
    fn drop_pulled(&mut self, held: impl IntoIterator<Item = Held>) {
        let mut unused = Vec::new();
        for (copy, _) in held.into_iter().filter_map(|held| held.copy) {
            let Some(users) = self.copies.get_mut(&copy) else {
                continue;
            };
            *users -= 1;
            if *users == 0 {
                self.copies.remove(&copy);
                unused.push(copy);
            }
        }
        if let Some(shared) = self.shared.upgrade() {
            shared.delete_local(&unused);
        }
    }

    fn held_bytes(&self) -> u64 {
        self.held
            .values()
            .flat_map(BTreeMap::values)
            .map(|held| held.bytes)
            .sum()
    }
}

/// Pulls the shards not on this node yet, those held by one node together into one object.
/// Returns what arrived (partition, shard, where it is held), the first failure (the
/// shards of the other nodes are still tried; the driver's reduce pulls whatever is missing
/// anyway), and the objects pulled into, deleted if dropped before the aggregator keeps them.
async fn pull_shards(
    shared: &Arc<Shared>,
    actor: ActorId,
    shards: Vec<PushedShard>,
) -> (
    Vec<(u32, ShardKey, Held)>,
    Option<ActorFailure>,
    Vec<PulledParts>,
) {
    let mut copies = Vec::new();
    let mut arrived = Vec::with_capacity(shards.len());
    let mut by_holder: BTreeMap<String, Vec<PushedShard>> = BTreeMap::new();
    for shard in shards {
        match &shard.holder {
            Some(holder) => by_holder.entry(holder.clone()).or_default().push(shard),
            None => arrived.push((
                shard.partition,
                (shard.object, shard.part.offset),
                Held {
                    bytes: shard.part.len,
                    copy: None,
                },
            )),
        }
    }
    let mut failure = None;
    for (holder, shards) in by_holder {
        let parts: Vec<(ObjectId, Part)> = shards
            .iter()
            .map(|shard| (shard.object, shard.part))
            .collect();
        match shared.transfers.pull_parts(&holder, &parts).await {
            Ok(pulled) => {
                for (shard, local) in shards.iter().zip(pulled.parts()) {
                    arrived.push((
                        shard.partition,
                        (shard.object, shard.part.offset),
                        Held {
                            bytes: shard.part.len,
                            copy: Some((pulled.object(), *local)),
                        },
                    ));
                }
                copies.push(pulled);
            }
            Err(error) => {
                failure.get_or_insert(ActorFailure::Pull {
                    actor,
                    object: parts
                        .first()
                        .map_or(ObjectId::new(0), |(object, _)| *object),
                    reason: error.to_string(),
                });
            }
        }
    }
    (arrived, failure, copies)
}

/// A job's driver, as an actor: the driver itself runs as a task on the agent's runtime (it is
/// mostly waiting on the network); the actor makes it addressable, answers for it, and stops
/// when the driver's task ends.
pub(crate) struct JobDriver {
    actor: ActorId,
    job: JobId,
    attempt: u32,
    node: NodeId,
    task: Option<JoinHandle<()>>,
}

impl Actor for JobDriver {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        if let Some(task) = self.task.take() {
            ctx.spawn(task.into_actor(self).map(|_, _, ctx| ctx.stop()));
        }
    }
}

impl Handler<Call> for JobDriver {
    type Result = Reply;

    fn handle(&mut self, Call(message): Call, _: &mut Self::Context) -> Reply {
        match message {
            ActorMessage::Describe => Ok(ActorReply::Described(ActorDescription {
                kind: DRIVER_ACTOR_KIND.to_owned(),
                job: self.job,
                node: Some(self.node),
                summary: format!("runs attempt {} of job {}", self.attempt, self.job),
            })),
            ActorMessage::Push(_) | ActorMessage::Reduce { .. } => Err(ActorFailure::Refused {
                actor: self.actor,
                reason: "a job driver takes no shards".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use floe_core::TaskId;
    use floe_core::config::{ClusterSecret, Config, TimeoutsConfig};
    use floe_core::wire::rpc::{Handler as RpcHandler, Peer, RemoteError};
    use floe_core::wire::{RpcServer, WireError};

    use super::*;
    use floe_api::node_protocol::{TaskKind, TestTask};

    /// A node that takes calls and never answers them, as one that froze with its
    /// connections open does.
    struct Frozen;

    impl RpcHandler<NodeProtocol> for Frozen {
        async fn handle(
            &self,
            _peer: Peer,
            _request: NodeRequest,
        ) -> std::result::Result<NodeResponse, RemoteError> {
            std::future::pending().await
        }
    }

    fn wire(read_ms: u64) -> WireConfig {
        {
            let mut config = Config::default();
            config.cluster.secret = ClusterSecret::new("actors-test");
            WireConfig {
                max_frame: 1 << 20,
                timeouts: TimeoutsConfig {
                    connect_ms: 2_000,
                    handshake_ms: 2_000,
                    read_ms,
                    write_ms: 2_000,
                    idle_ms: 10_000,
                },
                ..WireConfig::member(&config)
            }
        }
    }

    fn call(message: ActorMessage) -> NodeRequest {
        NodeRequest::CallActor {
            actor: ActorId::new(1),
            message,
            forwarded: true,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_forwarded_push_times_out_at_the_read_timeout_but_a_reduce_waits_for_its_task() {
        let wire = wire(300);
        let server = RpcServer::bind::<NodeProtocol, _>(
            "127.0.0.1:0".parse().expect("a socket address"),
            Arc::new(Frozen),
            wire.clone(),
        )
        .await
        .expect("binding the frozen node");
        let addr = server.local_addr().to_string();
        let host = ActorHost::start(Vec::new(), &wire).expect("starting the actor host");

        let push = call(ActorMessage::Push(Vec::new()));
        let pushed = tokio::time::timeout(Duration::from_secs(5), host.forward(&addr, &push))
            .await
            .expect("a forwarded push waited past the read timeout");
        assert!(
            matches!(pushed, Err(WireError::Timeout { .. })),
            "{pushed:?}"
        );
        // Its reply may still come: the connection is not pooled for the next call.
        assert!(lock(&host.connections).get(&addr).is_none_or(Vec::is_empty));

        let reduce = call(ActorMessage::Reduce {
            partition: 0,
            task: TaskSpec {
                task: TaskId::new(1),
                job: floe_core::JobId::new(1),
                kind: TaskKind::Test(TestTask::Sleep { ms: 0 }),
                inputs: Vec::new(),
            },
        });
        let waited =
            tokio::time::timeout(Duration::from_secs(2), host.forward(&addr, &reduce)).await;
        assert!(
            waited.is_err(),
            "a forwarded reduce stopped waiting: {waited:?}"
        );
    }
}
