//! Placement on the leader: actors' `Place` batches (nodes chosen, nothing held afterwards),
//! and jobs' leases (`floe_api::lease`): `AcquireLeases` asks that wait for room and recall
//! leases from jobs holding more, renewals, returns and expiry. Tasks are placed by their
//! drivers inside their leases, so no request here is per task.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{RaftLoop, Reply};
use crate::storage::LogStore;
use floe_api::lease::{Lease, LeaseDecision, LeaseGrants, LeaseStanding};
use floe_api::placement::{PlacementError, PlacementRequest};
use floe_api::scheduler_protocol::SchedulerResponse;
use floe_api::state::JobStatus;
use floe_core::wire::{RemoteError, RemoteErrorKind};
use floe_core::{JobId, LeaseId, NodeId};

/// Most leases one request may ask for, renew or return: a driver asks for what its runnable
/// tasks need, far fewer; the bound keeps one request from holding the Raft loop for long.
pub(super) const MAX_LEASES_PER_REQUEST: usize = 4096;
/// The longest an `AcquireLeases` waits for room, so it stays within the caller's timeouts.
const MAX_LEASE_WAIT: Duration = Duration::from_secs(10);

/// One `Place` request being answered: some requests placed, some waiting in the queue.
pub(super) struct PlaceBatch {
    pub(super) results: Vec<Option<Result<NodeId, PlacementError>>>,
    pub(super) pending: usize,
    pub(super) reply: Reply,
}

/// One `AcquireLeases` waiting for room.
pub(super) struct LeaseAsk {
    job: JobId,
    driver: NodeId,
    requests: Vec<PlacementRequest>,
    /// One per request; `None` while it waits.
    decisions: Vec<Option<LeaseDecision>>,
    /// The lease each waiting request recalled from a job holding more, while it is held.
    recalls: Vec<Option<LeaseId>>,
    deadline: Instant,
    reply: Reply,
}

impl LeaseAsk {
    fn granted_any(&self) -> bool {
        self.decisions
            .iter()
            .any(|decision| matches!(decision, Some(LeaseDecision::Granted(_))))
    }

    fn waiting(&self) -> bool {
        self.decisions.iter().any(Option::is_none)
    }
}

/// Asks waiting for room, in arrival order.
pub(super) type LeaseAsks = VecDeque<LeaseAsk>;

fn too_many(count: usize) -> RemoteError {
    RemoteError::new(
        RemoteErrorKind::BadRequest,
        format!("{count} leases in one request; at most {MAX_LEASES_PER_REQUEST}"),
    )
}

impl<S: LogStore> RaftLoop<S> {
    pub(super) fn place(&mut self, requests: Vec<PlacementRequest>, reply: Reply) {
        let decisions = self.leases.choose(&requests);
        let mut batch = PlaceBatch {
            results: Vec::with_capacity(requests.len()),
            pending: 0,
            reply,
        };
        self.next_batch += 1;
        for (slot, (decision, request)) in decisions.into_iter().zip(requests).enumerate() {
            match decision {
                Ok(floe_api::placement::Decision::Placed(node)) => {
                    batch.results.push(Some(Ok(node)));
                }
                Ok(floe_api::placement::Decision::Wait) => {
                    batch.results.push(None);
                    batch.pending += 1;
                    self.queue.push(request, (self.next_batch, slot));
                }
                Err(error) => batch.results.push(Some(Err(error))),
            }
        }
        self.batches.insert(self.next_batch, batch);
        self.finish_batch(self.next_batch);
    }

    /// Retries what waits for room: `Place` batches, then lease asks, in arrival order.
    pub(super) fn retry_waiting(&mut self) {
        if !self.queue.is_empty() {
            let leases = &mut self.leases;
            for ((batch_id, slot), result) in self.queue.retry(|request| leases.choose_one(request))
            {
                let Some(batch) = self.batches.get_mut(&batch_id) else {
                    continue;
                };
                batch.results[slot] = Some(result);
                batch.pending -= 1;
                self.finish_batch(batch_id);
            }
        }
        self.retry_lease_asks(Instant::now());
    }

    pub(super) fn finish_batch(&mut self, batch_id: u64) {
        if self
            .batches
            .get(&batch_id)
            .is_none_or(|batch| batch.pending > 0)
        {
            return;
        }
        let Some(batch) = self.batches.remove(&batch_id) else {
            return;
        };
        let results = batch.results.into_iter().flatten().collect();
        // A caller that gave up waiting loses nothing: a placement holds nothing.
        let _ = batch.reply.send(Ok(SchedulerResponse::Placements(results)));
    }

    /// Whether `driver` runs `job`'s driver now, the job running.
    fn drives(&self, job: JobId, driver: NodeId) -> bool {
        self.state.jobs.get(&job).is_some_and(|record| {
            record.status == JobStatus::Running && record.driver == Some(driver)
        })
    }

    pub(super) fn acquire_leases(
        &mut self,
        driver: NodeId,
        job: JobId,
        requests: Vec<PlacementRequest>,
        wait_ms: u64,
        reply: Reply,
    ) {
        if requests.len() > MAX_LEASES_PER_REQUEST {
            let _ = reply.send(Err(too_many(requests.len())));
            return;
        }
        let now = Instant::now();
        let count = requests.len();
        let ask = LeaseAsk {
            job,
            driver,
            requests,
            decisions: vec![None; count],
            recalls: vec![None; count],
            deadline: now + Duration::from_millis(wait_ms).min(MAX_LEASE_WAIT),
            reply,
        };
        if let Some(ask) = self.try_ask(ask, now) {
            self.lease_asks.push_back(ask);
        }
    }

    /// Grants what fits of `ask`'s waiting requests; answers it if anything was granted (or
    /// nothing waits, or its wait is over, or its driver no longer drives the job), else
    /// recalls leases for what waits and gives the ask back to wait on.
    fn try_ask(&mut self, mut ask: LeaseAsk, now: Instant) -> Option<LeaseAsk> {
        if !self.drives(ask.job, ask.driver) {
            self.answer_ask(ask);
            return None;
        }
        for (slot, request) in ask.requests.iter().enumerate() {
            if ask.decisions[slot].is_some() {
                continue;
            }
            match self.leases.grant(ask.job, ask.driver, request, now) {
                Ok(Some(lease)) => ask.decisions[slot] = Some(LeaseDecision::Granted(lease)),
                Ok(None) => {}
                Err(error) => ask.decisions[slot] = Some(LeaseDecision::Refused(error)),
            }
        }
        if ask.granted_any() || !ask.waiting() || now >= ask.deadline {
            self.answer_ask(ask);
            return None;
        }
        for (slot, request) in ask.requests.iter().enumerate() {
            let recalled = ask.recalls[slot].is_some_and(|id| self.leases.holds(id));
            if ask.decisions[slot].is_none() && !recalled {
                ask.recalls[slot] = self.leases.recall_for(ask.job, request, now);
                if let Some(id) = ask.recalls[slot] {
                    tracing::debug!(job = %ask.job, lease = %id, "recalled a lease for a waiting job");
                }
            }
        }
        Some(ask)
    }

    fn answer_ask(&mut self, ask: LeaseAsk) {
        let decisions: Vec<LeaseDecision> = ask
            .decisions
            .into_iter()
            .map(|decision| decision.unwrap_or(LeaseDecision::NotNow))
            .collect();
        let granted: Vec<LeaseId> = decisions
            .iter()
            .filter_map(|decision| match decision {
                LeaseDecision::Granted(lease) => Some(lease.id),
                _ => None,
            })
            .collect();
        let grants = LeaseGrants {
            decisions,
            renew_ms: u64::try_from(self.leases.renew_interval().as_millis()).unwrap_or(u64::MAX),
        };
        if ask
            .reply
            .send(Ok(SchedulerResponse::Leases(grants)))
            .is_err()
        {
            // The driver gave up waiting: nothing will run in what was granted to it.
            for id in granted {
                self.leases.give_back(ask.job, ask.driver, id);
            }
        }
    }

    /// Retries the waiting asks, those of jobs holding the least CPU first (in arrival order
    /// among equals), so that what is freed goes to the job with the smallest share.
    fn retry_lease_asks(&mut self, now: Instant) {
        let mut asks: Vec<LeaseAsk> = std::mem::take(&mut self.lease_asks).into();
        asks.sort_by_cached_key(|ask| self.leases.holding(ask.job).cpu_millis);
        for ask in asks {
            if let Some(ask) = self.try_ask(ask, now) {
                self.lease_asks.push_back(ask);
            }
        }
    }

    pub(super) fn renew_leases(
        &mut self,
        driver: NodeId,
        job: JobId,
        leases: Vec<Lease>,
        reply: Reply,
    ) {
        if leases.len() > MAX_LEASES_PER_REQUEST {
            let _ = reply.send(Err(too_many(leases.len())));
            return;
        }
        let now = Instant::now();
        let drives = self.drives(job, driver);
        let standings = leases
            .iter()
            .map(|lease| {
                let alive = self
                    .state
                    .nodes
                    .get(&lease.node)
                    .is_some_and(|node| node.is_alive());
                if drives && alive && lease.job == job {
                    self.leases.renew(job, driver, lease, now)
                } else {
                    LeaseStanding::Revoked
                }
            })
            .collect();
        let _ = reply.send(Ok(SchedulerResponse::LeasesRenewed(standings)));
    }

    pub(super) fn return_leases(
        &mut self,
        driver: NodeId,
        job: JobId,
        leases: Vec<LeaseId>,
        reply: Reply,
    ) {
        if leases.len() > MAX_LEASES_PER_REQUEST {
            let _ = reply.send(Err(too_many(leases.len())));
            return;
        }
        for id in leases {
            self.leases.give_back(job, driver, id);
        }
        let _ = reply.send(Ok(SchedulerResponse::LeasesReturned));
        self.retry_waiting();
    }

    /// Revokes leases nobody renewed within their TTL; asks whose wait is over are answered
    /// by the retry.
    pub(super) fn expire_leases(&mut self, now: Instant) {
        let expired = self.leases.expire(now);
        if !expired.is_empty() {
            tracing::info!(count = expired.len(), "leases expired without renewal");
        }
        self.retry_waiting();
    }

    /// A job ended: its leases go back, and what waited for them may be granted.
    pub(super) fn job_ended(&mut self, job: JobId) {
        if !self.leases.revoke_job(job).is_empty() {
            self.retry_waiting();
        }
    }

    /// Answers every waiting lease ask with `response` (the leader changed).
    pub(super) fn drop_lease_asks(&mut self, response: &SchedulerResponse) {
        for ask in std::mem::take(&mut self.lease_asks) {
            let _ = ask.reply.send(Ok(response.clone()));
        }
    }
}
