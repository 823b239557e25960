//! Placement leases: resources on a node that the leader grants a job's driver, inside which
//! the driver places its tasks itself, so the leader is not in the per-task path.
//!
//! A [`Lease`] reserves CPU and heap on one node for one job. The leader's [`LeaseTable`]
//! holds every lease and keeps them in its [`ResourceView`], so what a node shows reserved is
//! exactly the sum of the leases on it. A lease's life:
//!
//! - **granted** for a placement request, on the node the placement policy chooses (SPREAD,
//!   DEFAULT, affinity; see [`crate::placement`]), with the request's CPU and memory hint;
//! - **renewed** by its driver every [`LeaseTable::renew_interval`]; one not renewed for its
//!   TTL **expires** (a grant whose reply was lost, a driver that hangs);
//! - **returned** by its driver when it has been idle, or at the job's end;
//! - **revoked** when its node dies, its job ends, or its driver's node dies (a dead driver
//!   leaves no node looking full);
//! - **recalled** when another job waits for room and this job holds more: the driver places
//!   nothing new in it and returns it once the tasks in it end ([`LeaseTable::recall_for`]), so
//!   jobs that run at once share the cluster instead of the first one keeping every slot.
//!
//! Leases are the leader's soft state, never log entries. A new leader starts with none and
//! grants nothing for a grace period ([`GRACE_RENEWALS`] renewal intervals) while drivers
//! re-assert the leases they hold (a renewal carries the whole lease, so an unknown one is
//! taken in, within one TTL of the leader change). After that, a lease the leader does not
//! know is revoked: it expired, was returned or was revoked, and must not come back.
//!
//! Pure logic with the time passed in, like placement.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use floe_core::{JobId, LeaseId, NodeId};
use serde::{Deserialize, Serialize};

use crate::placement::{Decision, PlacementError, PlacementRequest, ResourceView};
use crate::state::Resources;

/// A driver renews its leases every `1 / RENEWALS_PER_TTL` of their TTL: a lease outlives
/// nine lost renewals, and a new leader hears of every lease within a tenth of a TTL.
pub const RENEWALS_PER_TTL: u32 = 10;
/// Renewal intervals a new leader grants nothing for, so drivers re-assert what an earlier
/// leader granted before the same resources could be granted twice: two, for a renewal that
/// was under way at the change.
pub const GRACE_RENEWALS: u32 = 2;

/// Resources on one node reserved for one job, which its driver places tasks inside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub id: LeaseId,
    pub job: JobId,
    /// The node whose resources it reserves.
    pub node: NodeId,
    pub resources: Resources,
}

/// The answer for one request of an `AcquireLeases`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseDecision {
    Granted(Lease),
    /// Nothing fitted within the wait; ask again.
    NotNow,
    /// No alive node could ever hold it as asked.
    Refused(PlacementError),
}

/// The answer to an `AcquireLeases`: one decision per request, in order, and how often the
/// driver must renew what it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrants {
    pub decisions: Vec<LeaseDecision>,
    pub renew_ms: u64,
}

/// Where a lease stands after its renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseStanding {
    Held,
    /// Still held, but wanted back: place nothing new in it and return it once it is idle.
    Recalled,
    /// Gone (its node died, its job ended, it expired or was returned): forget it.
    Revoked,
}

/// One job's leases on one node, for reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseSummary {
    pub job: JobId,
    pub leases: u32,
    /// How many of them are recalled.
    pub recalled: u32,
    /// What they reserve together.
    pub resources: Resources,
}

#[derive(Debug, Clone)]
struct Held {
    lease: Lease,
    /// The node running the job's driver, which alone may renew or return it.
    driver: NodeId,
    /// Grant order, so a recall takes the oldest lease (bounding how long one is reused).
    order: u64,
    expires: Instant,
    recalled: bool,
}

/// The leader's leases and the resource view they reserve in.
///
/// **Invariant:** for every node in the view, what the view has reserved is the sum of the
/// leases on that node.
#[derive(Debug)]
pub struct LeaseTable {
    view: ResourceView,
    leases: BTreeMap<LeaseId, Held>,
    by_node: BTreeMap<NodeId, BTreeSet<LeaseId>>,
    by_job: BTreeMap<JobId, BTreeSet<LeaseId>>,
    by_driver: BTreeMap<NodeId, BTreeSet<LeaseId>>,
    ttl: Duration,
    next_order: u64,
    /// Before this, nothing is granted (a new leader's grace period).
    grants_open_at: Instant,
    /// Until this, a renewal of an unknown lease takes it in (it was an earlier leader's).
    reassert_until: Instant,
}

impl LeaseTable {
    /// A table that grants at once and takes in no unknown lease: for a cluster whose
    /// leadership never changes (an in-process fake).
    pub fn new(ttl: Duration, now: Instant) -> Self {
        Self {
            view: ResourceView::new(),
            leases: BTreeMap::new(),
            by_node: BTreeMap::new(),
            by_job: BTreeMap::new(),
            by_driver: BTreeMap::new(),
            ttl,
            next_order: 0,
            grants_open_at: now,
            reassert_until: now,
        }
    }

    /// The table of a replica that became leader at `now`: it grants nothing during the grace
    /// period, and takes in the leases drivers re-assert for one TTL.
    pub fn new_leader(ttl: Duration, now: Instant) -> Self {
        let mut table = Self::new(ttl, now);
        table.grants_open_at = now + table.renew_interval() * GRACE_RENEWALS;
        table.reassert_until = now + ttl;
        table
    }

    /// How often drivers renew their leases.
    pub fn renew_interval(&self) -> Duration {
        self.ttl / RENEWALS_PER_TTL
    }

    pub fn view(&self) -> &ResourceView {
        &self.view
    }

    pub fn len(&self) -> usize {
        self.leases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// Adds a node to the view, or updates its totals. A node new to the view has the leases
    /// already held on it reserved (leases re-asserted before its first heartbeat here).
    pub fn upsert_node(&mut self, node: NodeId, total: Resources) {
        let new = !self.view.contains(node);
        self.view.upsert_node(node, total);
        if new {
            for id in self.by_node.get(&node).into_iter().flatten() {
                if let Some(held) = self.leases.get(id) {
                    self.view.reserve(node, held.lease.resources);
                }
            }
        }
    }

    /// Takes a dead node out of the view; the leases on it go with it.
    pub fn remove_node(&mut self, node: NodeId) -> Vec<Lease> {
        let gone = self.remove_all(self.by_node.get(&node).cloned().unwrap_or_default());
        self.view.remove_node(node);
        gone
    }

    /// Chooses nodes for a batch that holds nothing afterwards (actors that only keep books):
    /// placed together, so SPREAD spreads within the batch, and released at once.
    pub fn choose(
        &mut self,
        requests: &[PlacementRequest],
    ) -> Vec<Result<Decision, PlacementError>> {
        let decisions = self.view.place(requests);
        for (decision, request) in decisions.iter().zip(requests) {
            if let Ok(Decision::Placed(node)) = decision {
                self.view
                    .release(*node, request.cpu_millis, request.memory_hint);
            }
        }
        decisions
    }

    /// [`Self::choose`] for one request.
    pub fn choose_one(&mut self, request: &PlacementRequest) -> Result<Decision, PlacementError> {
        let decision = self.view.place_one(request)?;
        if let Decision::Placed(node) = decision {
            self.view
                .release(node, request.cpu_millis, request.memory_hint);
        }
        Ok(decision)
    }

    /// Grants `job`'s driver on `driver` a lease for `request` where the placement policy
    /// puts it; `None` while it fits nowhere now (or during a new leader's grace period).
    pub fn grant(
        &mut self,
        job: JobId,
        driver: NodeId,
        request: &PlacementRequest,
        now: Instant,
    ) -> Result<Option<Lease>, PlacementError> {
        if now < self.grants_open_at {
            return Ok(None);
        }
        match self.view.place_one(request)? {
            Decision::Wait => Ok(None),
            Decision::Placed(node) => {
                let lease = Lease {
                    id: LeaseId::random(),
                    job,
                    node,
                    resources: request.need(),
                };
                self.insert(lease, driver, now);
                Ok(Some(lease))
            }
        }
    }

    /// Renews `lease` for `job`'s driver on `driver`. A lease this leader does not know is
    /// taken in while re-assertion is open (it was granted by an earlier leader), and revoked
    /// after. The caller checks that the job runs with this driver and the node is alive.
    pub fn renew(
        &mut self,
        job: JobId,
        driver: NodeId,
        lease: &Lease,
        now: Instant,
    ) -> LeaseStanding {
        match self.leases.get_mut(&lease.id) {
            Some(held) if held.lease == *lease && held.driver == driver => {
                held.expires = now + self.ttl;
                if held.recalled {
                    LeaseStanding::Recalled
                } else {
                    LeaseStanding::Held
                }
            }
            Some(_) => LeaseStanding::Revoked,
            None if lease.job == job && now < self.reassert_until => {
                self.insert(*lease, driver, now);
                self.view.reserve(lease.node, lease.resources);
                LeaseStanding::Held
            }
            None => LeaseStanding::Revoked,
        }
    }

    /// Takes back a lease `job`'s driver on `driver` returns; `false` if it holds no such
    /// lease (already revoked, or another's).
    pub fn give_back(&mut self, job: JobId, driver: NodeId, id: LeaseId) -> bool {
        let owned = self
            .leases
            .get(&id)
            .is_some_and(|held| held.lease.job == job && held.driver == driver);
        if owned {
            self.remove(id);
        }
        owned
    }

    /// Revokes every lease of a job that ended.
    pub fn revoke_job(&mut self, job: JobId) -> Vec<Lease> {
        self.remove_all(self.by_job.get(&job).cloned().unwrap_or_default())
    }

    /// Revokes every lease whose driver ran on `node`, which died.
    pub fn revoke_driver(&mut self, node: NodeId) -> Vec<Lease> {
        self.remove_all(self.by_driver.get(&node).cloned().unwrap_or_default())
    }

    /// Revokes every lease not renewed within its TTL.
    pub fn expire(&mut self, now: Instant) -> Vec<Lease> {
        let expired: BTreeSet<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, held)| held.expires <= now)
            .map(|(id, _)| *id)
            .collect();
        self.remove_all(expired)
    }

    /// Recalls one lease for `job`'s waiting `request`, from the job holding the most CPU,
    /// if it would still hold at least as much as `job` once the lease went to `job`. The
    /// oldest lease of that job on a node that could hold the request is recalled, so leases
    /// are not reused forever while others wait; `None` if no job holds more than its share.
    /// Nothing is recalled during a new leader's grace period, while its table is not yet
    /// complete.
    pub fn recall_for(
        &mut self,
        job: JobId,
        request: &PlacementRequest,
        now: Instant,
    ) -> Option<LeaseId> {
        if now < self.grants_open_at {
            return None;
        }
        let mine = self.holding(job).cpu_millis;
        let (most, victim) = self
            .by_job
            .keys()
            .filter(|other| **other != job)
            .map(|other| (self.holding(*other).cpu_millis, *other))
            .max()?;
        let need = request.need();
        let useful = |held: &Held| match request.strategy {
            crate::placement::Strategy::NodeAffinity { node, soft: false } => {
                held.lease.node == node
            }
            _ => self.view.total(held.lease.node).is_some_and(|total| {
                need.cpu_millis <= total.cpu_millis && need.heap_bytes <= total.heap_bytes
            }),
        };
        let id = self
            .by_job
            .get(&victim)?
            .iter()
            .filter_map(|id| self.leases.get(id))
            .filter(|held| !held.recalled && held.lease.resources.cpu_millis > 0 && useful(held))
            .filter(|held| {
                most.saturating_sub(held.lease.resources.cpu_millis) >= mine + need.cpu_millis
            })
            .min_by_key(|held| held.order)
            .map(|held| held.lease.id)?;
        if let Some(held) = self.leases.get_mut(&id) {
            held.recalled = true;
        }
        Some(id)
    }

    /// What `job`'s leases that are not recalled reserve.
    pub fn holding(&self, job: JobId) -> Resources {
        let mut sum = Resources::default();
        for held in self
            .by_job
            .get(&job)
            .into_iter()
            .flatten()
            .filter_map(|id| self.leases.get(id))
            .filter(|held| !held.recalled)
        {
            sum.cpu_millis += held.lease.resources.cpu_millis;
            sum.heap_bytes += held.lease.resources.heap_bytes;
        }
        sum
    }

    /// Whether the table holds lease `id`.
    pub fn holds(&self, id: LeaseId) -> bool {
        self.leases.contains_key(&id)
    }

    /// The leases of `job`.
    pub fn of_job(&self, job: JobId) -> Vec<Lease> {
        self.by_job
            .get(&job)
            .into_iter()
            .flatten()
            .filter_map(|id| self.leases.get(id))
            .map(|held| held.lease)
            .collect()
    }

    /// Each job's leases on `node`.
    pub fn on_node(&self, node: NodeId) -> Vec<LeaseSummary> {
        let mut jobs: BTreeMap<JobId, LeaseSummary> = BTreeMap::new();
        for held in self
            .by_node
            .get(&node)
            .into_iter()
            .flatten()
            .filter_map(|id| self.leases.get(id))
        {
            let summary = jobs.entry(held.lease.job).or_insert(LeaseSummary {
                job: held.lease.job,
                leases: 0,
                recalled: 0,
                resources: Resources::default(),
            });
            summary.leases += 1;
            summary.recalled += u32::from(held.recalled);
            summary.resources.cpu_millis += held.lease.resources.cpu_millis;
            summary.resources.heap_bytes += held.lease.resources.heap_bytes;
        }
        jobs.into_values().collect()
    }

    /// Records a lease whose resources the caller reserves (a grant already did).
    fn insert(&mut self, lease: Lease, driver: NodeId, now: Instant) {
        self.next_order += 1;
        self.leases.insert(
            lease.id,
            Held {
                lease,
                driver,
                order: self.next_order,
                expires: now + self.ttl,
                recalled: false,
            },
        );
        self.by_node.entry(lease.node).or_default().insert(lease.id);
        self.by_job.entry(lease.job).or_default().insert(lease.id);
        self.by_driver.entry(driver).or_default().insert(lease.id);
    }

    fn remove_all(&mut self, ids: BTreeSet<LeaseId>) -> Vec<Lease> {
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// Forgets a lease and returns what it reserved.
    fn remove(&mut self, id: LeaseId) -> Option<Lease> {
        let held = self.leases.remove(&id)?;
        let lease = held.lease;
        unindex(&mut self.by_node, lease.node, id);
        unindex(&mut self.by_job, lease.job, id);
        unindex(&mut self.by_driver, held.driver, id);
        self.view.release(
            lease.node,
            lease.resources.cpu_millis,
            lease.resources.heap_bytes,
        );
        Some(lease)
    }
}

fn unindex<K: Ord>(index: &mut BTreeMap<K, BTreeSet<LeaseId>>, key: K, id: LeaseId) {
    if let Some(ids) = index.get_mut(&key) {
        ids.remove(&id);
        if ids.is_empty() {
            index.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests;
