//! The job's placement leases: the per-job local view inside which the driver places its
//! tasks itself, so the scheduler's leader is not in the per-task path.
//!
//! [`LeaseBook`] is what the leader granted the job (`floe_api::lease`): per node, the
//! capacity of its leases and what the job's running tasks use of it, kept in a
//! [`ResourceView`] so that a task is placed by the leader's own policy (SPREAD over the
//! leased nodes, DEFAULT preferring its input's holder, affinity). [`JobLeases`] drives it:
//!
//! - a task that fits a lease is placed at once, with no call; its [`Slot`] gives the room back
//!   when dropped, and a waiting task that fits takes it at once (leases are reused);
//! - tasks that fit nowhere wait, and one acquisition at a time asks the leader for a lease per
//!   waiting task (batched); a lease granted for a task goes to that task. A DEFAULT task whose
//!   input's holder is not leased, and an affinity task whose node is not, ask first too, so a
//!   lease does not pull work away from where the policy would put it; once the leader had no
//!   room for it there, such a task takes any lease the policy allows ([`Reach`]);
//! - in the background, leases are renewed every interval the leader gave; leases beyond what
//!   the last [`LEASE_IDLE`] interval's peak use needed are returned; recalled leases are
//!   returned as soon as the tasks in them end, and revoked ones are forgotten;
//! - [`JobLeases::close`] returns every lease at the job's end (the leader also revokes them
//!   when the job ends, so a driver that dies first leaves nothing held).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use floe_api::lease::{Lease, LeaseDecision, LeaseGrants, LeaseStanding};
use floe_api::placement::{Decision, PlacementRequest, ResourceView, Strategy};
use floe_api::state::Resources;
use floe_core::{JobId, LeaseId, NodeId};
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::{Error, Result};

/// Leases beyond the peak use of the last interval this long are returned: long enough that
/// the gap between one task and the next (or one operator and the next) keeps them, short
/// enough that a job that stopped needing them frees them for others within a second.
pub const LEASE_IDLE: Duration = Duration::from_millis(500);
/// How long one `AcquireLeases` may wait at the leader for room before it is asked again.
const LEASE_WAIT: Duration = Duration::from_secs(5);
/// Requests in one `AcquireLeases`; the rest wait for the next.
const MAX_ASK: usize = 1024;

/// The scheduler calls leases need: what a job's driver (or a benchmark acting as one) uses.
pub trait LeaseService: Send + Sync + 'static {
    /// Asks for a lease per request for `job`, waiting up to `wait` for the first grant.
    fn acquire_leases(
        &self,
        job: JobId,
        requests: Vec<PlacementRequest>,
        wait: Duration,
    ) -> impl Future<Output = Result<LeaseGrants>> + Send;

    /// Renews `leases`; one standing each, in order.
    fn renew_leases(
        &self,
        job: JobId,
        leases: Vec<Lease>,
    ) -> impl Future<Output = Result<Vec<LeaseStanding>>> + Send;

    /// Gives `leases` back.
    fn return_leases(
        &self,
        job: JobId,
        leases: Vec<LeaseId>,
    ) -> impl Future<Output = Result<()>> + Send;
}

fn add(a: Resources, b: Resources) -> Resources {
    Resources {
        cpu_millis: a.cpu_millis.saturating_add(b.cpu_millis),
        heap_bytes: a.heap_bytes.saturating_add(b.heap_bytes),
    }
}

fn sub(a: Resources, b: Resources) -> Resources {
    Resources {
        cpu_millis: a.cpu_millis.saturating_sub(b.cpu_millis),
        heap_bytes: a.heap_bytes.saturating_sub(b.heap_bytes),
    }
}

fn covers(capacity: Resources, need: Resources) -> bool {
    capacity.cpu_millis >= need.cpu_millis && capacity.heap_bytes >= need.heap_bytes
}

fn max(a: Resources, b: Resources) -> Resources {
    Resources {
        cpu_millis: a.cpu_millis.max(b.cpu_millis),
        heap_bytes: a.heap_bytes.max(b.heap_bytes),
    }
}

/// A job's leases on one node.
#[derive(Debug, Default)]
struct NodeLeases {
    held: BTreeSet<LeaseId>,
    /// What the leases that are not recalled offer: the node's total in the view.
    capacity: Resources,
    /// The most the job's tasks used at once since the last idle check.
    peak: Resources,
}

/// One waiting task's ask to the leader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    /// A lease for the task's whole need.
    Whole(PlacementRequest),
    /// A lease for only the heap the task lacks on a node where the job's leases have its
    /// CPU free: no CPU, pinned to that node by hard affinity.
    Heap(PlacementRequest),
}

impl Ask {
    fn request(&self) -> &PlacementRequest {
        match self {
            Ask::Whole(request) | Ask::Heap(request) => request,
        }
    }
}

/// Which leases a task may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Only where the policy would put it first: a DEFAULT task on its input's holder when the
    /// job holds a lease there (or has no input holder), a soft-affinity task on its node.
    FirstChoice,
    /// Wherever the policy allows (a DEFAULT task anywhere, a soft-affinity task elsewhere
    /// when its node is full): the leader had no room at its first choice.
    Anywhere,
}

/// The leases a job holds and what its tasks use of them: the driver's local view.
#[derive(Debug, Default)]
pub struct LeaseBook {
    view: ResourceView,
    leases: BTreeMap<LeaseId, (Lease, bool)>,
    nodes: BTreeMap<NodeId, NodeLeases>,
}

impl LeaseBook {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.leases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// What the job's tasks use on `node` now.
    pub fn used(&self, node: NodeId) -> Resources {
        self.view.used(node).unwrap_or_default()
    }

    /// What the job's leases that are not recalled offer on `node`.
    pub fn capacity(&self, node: NodeId) -> Resources {
        self.nodes
            .get(&node)
            .map_or_else(Resources::default, |n| n.capacity)
    }

    /// Places `request` in the leases by the placement policy and reserves it there; `None`
    /// when it fits no lease within `reach`.
    pub fn place(&mut self, request: &PlacementRequest, reach: Reach) -> Option<NodeId> {
        let local = self.within_reach(request, reach)?;
        match self.view.place_one(&local) {
            Ok(Decision::Placed(node)) => {
                self.note_peak(node);
                Some(node)
            }
            Ok(Decision::Wait) | Err(_) => None,
        }
    }

    /// `request` as the leases may take it within `reach`; `None` when the policy wants it
    /// on a node the job holds no lease on.
    fn within_reach(&self, request: &PlacementRequest, reach: Reach) -> Option<PlacementRequest> {
        match (request.strategy, reach) {
            (_, Reach::Anywhere) | (Strategy::Spread, _) => Some(request.clone()),
            // Only that node, at first: the leader decides whether another may do instead.
            (Strategy::NodeAffinity { node, .. }, Reach::FirstChoice) => Some(PlacementRequest {
                strategy: Strategy::NodeAffinity { node, soft: false },
                ..request.clone()
            }),
            (Strategy::Default, Reach::FirstChoice) => {
                let holder = request
                    .preferred
                    .iter()
                    .max_by(|(a, a_bytes), (b, b_bytes)| a_bytes.cmp(b_bytes).then(b.cmp(a)))
                    .map(|(node, _)| *node);
                if holder.is_some_and(|holder| !self.nodes.contains_key(&holder)) {
                    return None;
                }
                Some(request.clone())
            }
        }
    }

    /// What to ask the leader for, for each waiting task in order. A task whose CPU the
    /// job's leases have free somewhere within its reach, but not its heap, asks only for the
    /// heap it lacks there: a lease for its whole need could not be granted while the job's
    /// own leases hold that CPU, so it would wait for one of its own tasks to end. Waiters
    /// take the free CPU in turn, so two never count on the same room.
    pub fn asks<'a>(
        &self,
        waiting: impl IntoIterator<Item = (&'a PlacementRequest, Reach, bool)>,
    ) -> Vec<Ask> {
        let mut room = self.view.clone();
        waiting
            .into_iter()
            .map(|(request, reach, heap_asks)| {
                let whole = Ask::Whole(request.clone());
                if !heap_asks || request.memory_hint == 0 {
                    return whole;
                }
                let Some(local) = self.within_reach(request, reach) else {
                    return whole;
                };
                let cpu_only = PlacementRequest {
                    memory_hint: 0,
                    ..local
                };
                let Ok(Decision::Placed(node)) = room.place_one(&cpu_only) else {
                    return whole;
                };
                let (total, used) = (room.total(node), room.used(node));
                let free_heap = total.zip(used).map_or(0, |(total, used)| {
                    total.heap_bytes.saturating_sub(used.heap_bytes)
                });
                let lacking = request.memory_hint.saturating_sub(free_heap);
                room.reserve(
                    node,
                    Resources {
                        cpu_millis: 0,
                        heap_bytes: request.memory_hint.min(free_heap),
                    },
                );
                if lacking == 0 {
                    return whole;
                }
                Ask::Heap(PlacementRequest {
                    cpu_millis: 0,
                    memory_hint: lacking,
                    strategy: Strategy::NodeAffinity { node, soft: false },
                    preferred: Vec::new(),
                    requester: request.requester,
                })
            })
            .collect()
    }

    /// Reserves `need` on `node` whether or not it fits (a lease granted for that task).
    pub fn take(&mut self, node: NodeId, need: Resources) {
        self.view.reserve(node, need);
        self.note_peak(node);
    }

    /// Gives back what a task used on `node`.
    pub fn free(&mut self, node: NodeId, need: Resources) {
        self.view.release(node, need.cpu_millis, need.heap_bytes);
        self.drop_if_empty(node);
    }

    /// Adds a lease the leader granted.
    pub fn add(&mut self, lease: Lease) {
        if self.leases.insert(lease.id, (lease, false)).is_some() {
            return;
        }
        let node = self.nodes.entry(lease.node).or_default();
        node.held.insert(lease.id);
        node.capacity = add(node.capacity, lease.resources);
        self.view.upsert_node(lease.node, node.capacity);
    }

    /// The leader wants `id` back: nothing new goes in it; it is returned once idle.
    pub fn recall(&mut self, id: LeaseId) {
        let Some((lease, recalled)) = self.leases.get_mut(&id) else {
            return;
        };
        if *recalled {
            return;
        }
        *recalled = true;
        let lease = *lease;
        if let Some(node) = self.nodes.get_mut(&lease.node) {
            node.capacity = sub(node.capacity, lease.resources);
            self.view.upsert_node(lease.node, node.capacity);
        }
    }

    /// Forgets a lease the leader revoked or that is being returned.
    pub fn remove(&mut self, id: LeaseId) -> Option<Lease> {
        let (lease, recalled) = self.leases.remove(&id)?;
        if let Some(node) = self.nodes.get_mut(&lease.node) {
            node.held.remove(&id);
            if !recalled {
                node.capacity = sub(node.capacity, lease.resources);
                self.view.upsert_node(lease.node, node.capacity);
            }
        }
        self.drop_if_empty(lease.node);
        Some(lease)
    }

    /// Forgets every lease on `node`, which died (the leader revoked them with it).
    pub fn forget_node(&mut self, node: NodeId) -> usize {
        let Some(gone) = self.nodes.remove(&node) else {
            return 0;
        };
        for id in &gone.held {
            self.leases.remove(id);
        }
        self.view.remove_node(node);
        gone.held.len()
    }

    /// Recalled leases whose node's use fits in what else the job holds there: returned now.
    pub fn returnable(&mut self) -> Vec<LeaseId> {
        let recalled: Vec<Lease> = self
            .leases
            .values()
            .filter(|(_, recalled)| *recalled)
            .map(|(lease, _)| *lease)
            .collect();
        let mut going = Vec::new();
        for lease in recalled {
            // What the leases left on the node (counting the other recalled ones) would hold.
            let kept_recalled = self
                .nodes
                .get(&lease.node)
                .into_iter()
                .flat_map(|node| &node.held)
                .filter(|id| **id != lease.id)
                .filter_map(|id| self.leases.get(id))
                .filter(|(_, recalled)| *recalled)
                .fold(Resources::default(), |sum, (other, _)| {
                    add(sum, other.resources)
                });
            let left = add(self.capacity(lease.node), kept_recalled);
            if covers(left, self.used(lease.node)) {
                self.remove(lease.id);
                going.push(lease.id);
            }
        }
        going
    }

    /// Leases beyond what the peak use since the last call needed, on each node: returned
    /// now. The largest leases are kept first.
    pub fn idle(&mut self) -> Vec<LeaseId> {
        let mut going = Vec::new();
        let nodes: Vec<NodeId> = self.nodes.keys().copied().collect();
        for node in nodes {
            let peak = self
                .nodes
                .get(&node)
                .map_or_else(Resources::default, |n| n.peak);
            let mut held: Vec<Lease> = self.nodes[&node]
                .held
                .iter()
                .filter_map(|id| self.leases.get(id))
                .filter(|(_, recalled)| !*recalled)
                .map(|(lease, _)| *lease)
                .collect();
            held.sort_by_key(|lease| {
                std::cmp::Reverse((lease.resources.cpu_millis, lease.resources.heap_bytes))
            });
            let mut kept = Resources::default();
            for lease in held {
                if covers(kept, peak) {
                    going.push(lease.id);
                } else {
                    kept = add(kept, lease.resources);
                }
            }
            let used = self.used(node);
            if let Some(node) = self.nodes.get_mut(&node) {
                node.peak = used;
            }
        }
        for id in &going {
            self.remove(*id);
        }
        going
    }

    /// Every lease, for a renewal.
    pub fn all(&self) -> Vec<Lease> {
        self.leases.values().map(|(lease, _)| *lease).collect()
    }

    /// Takes every lease out, to return them all.
    pub fn drain(&mut self) -> Vec<LeaseId> {
        let ids: Vec<LeaseId> = self.leases.keys().copied().collect();
        for id in &ids {
            self.remove(*id);
        }
        ids
    }

    fn note_peak(&mut self, node: NodeId) {
        let used = self.used(node);
        if let Some(leases) = self.nodes.get_mut(&node) {
            leases.peak = max(leases.peak, used);
        }
    }

    /// A node with no lease and no task left leaves the view.
    fn drop_if_empty(&mut self, node: NodeId) {
        let empty = self.nodes.get(&node).is_some_and(|n| n.held.is_empty());
        if empty && self.used(node) == Resources::default() {
            self.nodes.remove(&node);
            self.view.remove_node(node);
        }
    }
}

/// Counts of what a job's leases cost the leader, for tests and the benchmark.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LeaseStats {
    /// Tasks placed (in a lease, at once or after waiting).
    pub placed: u64,
    /// `AcquireLeases` calls, and the leases they granted.
    pub asks: u64,
    pub granted: u64,
    /// `RenewLeases` calls.
    pub renewals: u64,
    /// Leases returned (idle, recalled, or at the end), and leases revoked or forgotten.
    pub returned: u64,
    pub revoked: u64,
}

/// A task waiting for room.
struct Waiter<S: LeaseService> {
    id: u64,
    request: PlacementRequest,
    /// Widened once the leader had no room for it.
    reach: Reach,
    /// Whether it may ask for only the heap it lacks: not once the leader refused such an
    /// ask or had no room for it (it asks for its whole need then, as any other task).
    heap_asks: bool,
    reply: oneshot::Sender<Result<Slot<S>>>,
}

struct State<S: LeaseService> {
    book: LeaseBook,
    waiting: VecDeque<Waiter<S>>,
    next_waiter: u64,
    /// The acquisition under way, if any.
    acquiring: Option<JoinHandle<()>>,
    maintenance: Option<JoinHandle<()>>,
    /// How often to renew, as the leader last said; nothing to renew before the first grant.
    renew_every: Option<Duration>,
    closed: bool,
    stats: LeaseStats,
}

impl<S: LeaseService> State<S> {
    /// Takes no more tasks and stops the maintenance. An ask already sent is left to end (its
    /// handle is answered): what it is granted then goes straight back, not lost with it.
    fn close(&mut self) -> Option<JoinHandle<()>> {
        self.closed = true;
        if let Some(maintenance) = self.maintenance.take() {
            maintenance.abort();
        }
        self.acquiring.take()
    }
}

struct Shared<S: LeaseService> {
    service: Arc<S>,
    job: JobId,
    state: Mutex<State<S>>,
    /// Wakes the maintenance when a recalled lease may be returned.
    wake: Notify,
}

impl<S: LeaseService> Shared<S> {
    fn lock(&self) -> MutexGuard<'_, State<S>> {
        // The critical sections leave the book consistent at every step.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A task's room in one of the job's leases; dropping it gives the room back.
pub struct Slot<S: LeaseService> {
    /// `None` once disarmed: the room was given back under the lock already.
    shared: Option<Arc<Shared<S>>>,
    node: NodeId,
    need: Resources,
}

impl<S: LeaseService> Slot<S> {
    fn new(shared: &Arc<Shared<S>>, node: NodeId, need: Resources) -> Self {
        Self {
            shared: Some(Arc::clone(shared)),
            node,
            need,
        }
    }

    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The slot's room, for a caller that gives it back itself (it holds the lock, which
    /// dropping the slot would take again).
    fn disarm(mut self) -> (NodeId, Resources) {
        self.shared = None;
        (self.node, self.need)
    }
}

impl<S: LeaseService> Drop for Slot<S> {
    fn drop(&mut self) {
        let Some(shared) = self.shared.take() else {
            return;
        };
        let mut state = shared.lock();
        state.book.free(self.node, self.need);
        serve_waiting(&shared, &mut state);
        if state.book.leases.values().any(|(_, recalled)| *recalled) {
            shared.wake.notify_one();
        }
    }
}

/// Hands `node` to `waiter`; a waiter that is gone gives it back at once.
fn give<S: LeaseService>(
    shared: &Arc<Shared<S>>,
    state: &mut State<S>,
    waiter: Waiter<S>,
    node: NodeId,
) {
    let slot = Slot::new(shared, node, waiter.request.need());
    match waiter.reply.send(Ok(slot)) {
        Ok(()) => state.stats.placed += 1,
        Err(Ok(slot)) => {
            let (node, need) = slot.disarm();
            state.book.free(node, need);
        }
        Err(Err(_)) => {}
    }
}

/// Places every waiting task that now fits a lease, in arrival order.
fn serve_waiting<S: LeaseService>(shared: &Arc<Shared<S>>, state: &mut State<S>) {
    let mut index = 0;
    while index < state.waiting.len() {
        let waiter = &state.waiting[index];
        match state.book.place(&waiter.request, waiter.reach) {
            Some(node) => {
                if let Some(waiter) = state.waiting.remove(index) {
                    give(shared, state, waiter, node);
                }
            }
            None => index += 1,
        }
    }
}

/// A job's leases, shared by its task runs.
pub struct JobLeases<S: LeaseService> {
    shared: Arc<Shared<S>>,
}

impl<S: LeaseService> JobLeases<S> {
    /// Starts keeping `job`'s leases (renewing and returning them in the background).
    pub fn new(service: Arc<S>, job: JobId) -> Self {
        let shared = Arc::new(Shared {
            service,
            job,
            state: Mutex::new(State {
                book: LeaseBook::new(),
                waiting: VecDeque::new(),
                next_waiter: 0,
                acquiring: None,
                maintenance: None,
                renew_every: None,
                closed: false,
                stats: LeaseStats::default(),
            }),
            wake: Notify::new(),
        });
        let maintenance = tokio::spawn(maintain(Arc::clone(&shared)));
        shared.lock().maintenance = Some(maintenance);
        Self { shared }
    }

    /// Room for one task by `request`'s strategy: at once in a lease that fits, else after
    /// the leader granted one (or a running task freed room).
    pub async fn place(&self, request: PlacementRequest) -> Result<Slot<S>> {
        let answer = {
            let mut state = self.shared.lock();
            if state.closed {
                return Err(Error::LeasesClosed);
            }
            if let Some(node) = state.book.place(&request, Reach::FirstChoice) {
                state.stats.placed += 1;
                return Ok(Slot::new(&self.shared, node, request.need()));
            }
            let (reply, answer) = oneshot::channel();
            state.next_waiter += 1;
            let id = state.next_waiter;
            state.waiting.push_back(Waiter {
                id,
                request,
                reach: Reach::FirstChoice,
                heap_asks: true,
                reply,
            });
            if state.acquiring.is_none() {
                state.acquiring = Some(tokio::spawn(acquire(Arc::clone(&self.shared))));
            }
            answer
        };
        answer.await.map_err(|_| Error::LeasesClosed)?
    }

    /// Forgets the leases on `node`, which died: the leader revoked them with it.
    pub fn forget_node(&self, node: NodeId) {
        let mut state = self.shared.lock();
        let forgotten = state.book.forget_node(node);
        state.stats.revoked += forgotten as u64;
    }

    pub fn stats(&self) -> LeaseStats {
        self.shared.lock().stats
    }

    /// Ends the job's leases: waiting tasks are refused, background work stops and every
    /// lease is returned, those an ask under way is granted too (it is waited for, up to its
    /// wait at the leader).
    pub async fn close(&self) {
        let (waiters, leases, acquiring) = {
            let mut state = self.shared.lock();
            let acquiring = state.close();
            let waiters: Vec<Waiter<S>> = state.waiting.drain(..).collect();
            let leases = state.book.drain();
            state.stats.returned += leases.len() as u64;
            (waiters, leases, acquiring)
        };
        for waiter in waiters {
            let _ = waiter.reply.send(Err(Error::LeasesClosed));
        }
        return_leases(&self.shared, leases).await;
        // An ask under way ends within its wait at the leader, and gives back what it got.
        if let Some(acquiring) = acquiring {
            let _ = acquiring.await;
        }
    }
}

/// Returns `leases` to the leader; a failure only logs, since the job's end revokes them on
/// the leader anyway.
async fn return_leases<S: LeaseService>(shared: &Shared<S>, leases: Vec<LeaseId>) {
    if leases.is_empty() {
        return;
    }
    if let Err(error) = shared.service.return_leases(shared.job, leases).await {
        tracing::warn!(job = %shared.job, %error, "returning the job's leases failed");
    }
}

impl<S: LeaseService> Drop for JobLeases<S> {
    fn drop(&mut self) {
        // An ask under way finishes on its own and gives back what it got.
        drop(self.shared.lock().close());
    }
}

/// Asks the leader for leases for the waiting tasks, batch after batch, until none waits.
async fn acquire<S: LeaseService>(shared: Arc<Shared<S>>) {
    loop {
        let (ids, asks): (Vec<u64>, Vec<Ask>) = {
            let mut state = shared.lock();
            if state.waiting.is_empty() || state.closed {
                state.acquiring = None;
                return;
            }
            state.stats.asks += 1;
            let waiting = state.waiting.iter().take(MAX_ASK);
            let ids = waiting.clone().map(|waiter| waiter.id).collect();
            let asks = state
                .book
                .asks(waiting.map(|waiter| (&waiter.request, waiter.reach, waiter.heap_asks)));
            (ids, asks)
        };
        let requests = asks.iter().map(|ask| ask.request().clone()).collect();
        let answer = shared
            .service
            .acquire_leases(shared.job, requests, LEASE_WAIT)
            .await;
        if let Some(late) = settle(&shared, ids, &asks, answer) {
            return_leases(&shared, late).await;
            return;
        }
    }
}

/// Hands an ask's answer to the tasks that wait for it. Once the leases are closed, what it
/// was granted is answered instead, for the caller to give back: no task will use it.
fn settle<S: LeaseService>(
    shared: &Arc<Shared<S>>,
    ids: Vec<u64>,
    asks: &[Ask],
    answer: Result<LeaseGrants>,
) -> Option<Vec<LeaseId>> {
    let mut state = shared.lock();
    if state.closed {
        // Closed while the ask was out: no task will use what it was granted.
        let granted: Vec<LeaseId> = answer
            .iter()
            .flat_map(|grants| &grants.decisions)
            .filter_map(|decision| match decision {
                LeaseDecision::Granted(lease) => Some(lease.id),
                LeaseDecision::Refused(_) | LeaseDecision::NotNow => None,
            })
            .collect();
        state.stats.granted += granted.len() as u64;
        state.stats.returned += granted.len() as u64;
        return Some(granted);
    }
    match answer {
        Ok(grants) => {
            state.renew_every = Some(Duration::from_millis(grants.renew_ms.max(1)));
            for ((id, ask), decision) in ids.into_iter().zip(asks).zip(grants.decisions) {
                let position = state.waiting.iter().position(|waiter| waiter.id == id);
                if let Ask::Heap(_) = ask {
                    match decision {
                        // The task takes the room like any waiter, below: its CPU may have
                        // gone to another task meanwhile, and then it waits on.
                        LeaseDecision::Granted(lease) => {
                            state.stats.granted += 1;
                            state.book.add(lease);
                        }
                        LeaseDecision::Refused(_) | LeaseDecision::NotNow => {
                            if let Some(waiter) = position.and_then(|at| state.waiting.get_mut(at))
                            {
                                waiter.heap_asks = false;
                            }
                        }
                    }
                    continue;
                }
                match decision {
                    LeaseDecision::Granted(lease) => {
                        state.stats.granted += 1;
                        state.book.add(lease);
                        // The lease was placed for this task: it goes there, unless the
                        // task found room meanwhile.
                        if let Some(waiter) = position.and_then(|at| state.waiting.remove(at)) {
                            state.book.take(lease.node, waiter.request.need());
                            give(shared, &mut state, waiter, lease.node);
                        }
                    }
                    LeaseDecision::Refused(error) => {
                        if let Some(waiter) = position.and_then(|at| state.waiting.remove(at)) {
                            let _ = waiter.reply.send(Err(Error::Placement(error)));
                        }
                    }
                    LeaseDecision::NotNow => {
                        if let Some(waiter) = position.and_then(|at| state.waiting.get_mut(at)) {
                            waiter.reach = Reach::Anywhere;
                        }
                    }
                }
            }
            serve_waiting(shared, &mut state);
        }
        Err(error) => {
            // The tasks asked for fail as unreachable and are launched again after a pause.
            let error = Arc::new(error);
            for id in ids {
                if let Some(at) = state.waiting.iter().position(|waiter| waiter.id == id)
                    && let Some(waiter) = state.waiting.remove(at)
                {
                    let _ = waiter.reply.send(Err(Error::LeaseAsk(Arc::clone(&error))));
                }
            }
        }
    }
    None
}

/// Renews the leases, returns idle and recalled ones and forgets revoked ones, until the job
/// ends.
async fn maintain<S: LeaseService>(shared: Arc<Shared<S>>) {
    let mut last_renewal = Instant::now();
    let mut last_idle_check = Instant::now();
    loop {
        let renew_every = shared.lock().renew_every;
        let idle_at = last_idle_check + LEASE_IDLE;
        let renew_at = renew_every.map(|every| last_renewal + every);
        let until = renew_at.map_or(idle_at, |renew_at| renew_at.min(idle_at));
        tokio::select! {
            () = tokio::time::sleep_until(until) => {}
            () = shared.wake.notified() => {}
        }
        let now = Instant::now();
        let going = {
            let mut state = shared.lock();
            let mut going = state.book.returnable();
            if now >= idle_at {
                going.extend(state.book.idle());
                last_idle_check = now;
            }
            state.stats.returned += going.len() as u64;
            going
        };
        if !going.is_empty()
            && let Err(error) = shared.service.return_leases(shared.job, going).await
        {
            // Unrenewed from now on, they expire on the leader.
            tracing::warn!(job = %shared.job, %error, "returning leases failed");
        }
        if renew_at.is_none_or(|renew_at| now < renew_at) {
            continue;
        }
        last_renewal = now;
        let leases = {
            let mut state = shared.lock();
            let leases = state.book.all();
            if !leases.is_empty() {
                state.stats.renewals += 1;
            }
            leases
        };
        if leases.is_empty() {
            continue;
        }
        match shared
            .service
            .renew_leases(shared.job, leases.clone())
            .await
        {
            Ok(standings) => {
                let mut state = shared.lock();
                for (lease, standing) in leases.iter().zip(standings) {
                    match standing {
                        LeaseStanding::Held => {}
                        LeaseStanding::Recalled => state.book.recall(lease.id),
                        LeaseStanding::Revoked => {
                            if state.book.remove(lease.id).is_some() {
                                state.stats.revoked += 1;
                            }
                        }
                    }
                }
                if state.book.leases.values().any(|(_, recalled)| *recalled) {
                    shared.wake.notify_one();
                }
            }
            Err(error) => {
                tracing::warn!(job = %shared.job, %error, "renewing leases failed");
            }
        }
    }
}

#[cfg(test)]
mod tests;
