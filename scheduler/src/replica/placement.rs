//! Task placement on the leader: `Place` batches answered from the resource view, requests
//! that do not fit yet waiting in the placement queue, and the reservations (leases) placed
//! tasks hold until they are released or their requester dies.

use super::{RaftLoop, Reply};
use crate::storage::LogStore;
use floe_api::placement::{Decision, PlacementError, PlacementRequest};
use floe_api::scheduler_protocol::SchedulerResponse;
use floe_core::NodeId;

/// One `Place` request being answered: some requests placed, some waiting in the queue.
pub(super) struct PlaceBatch {
    pub(super) results: Vec<Option<Result<NodeId, PlacementError>>>,
    pub(super) pending: usize,
    pub(super) reply: Reply,
    /// What was reserved for this batch, returned if the caller is gone when it completes.
    pub(super) reserved: Vec<Reservation>,
}

/// One placement's reservation, and the node that asked for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Reservation {
    pub(super) node: NodeId,
    pub(super) cpu_millis: u64,
    pub(super) memory_hint: u64,
    pub(super) requester: Option<NodeId>,
}

impl<S: LogStore> RaftLoop<S> {
    pub(super) fn place(&mut self, requests: Vec<PlacementRequest>, reply: Reply) {
        let decisions = self.view.place(&requests);
        let mut batch = PlaceBatch {
            results: Vec::with_capacity(requests.len()),
            pending: 0,
            reply,
            reserved: Vec::new(),
        };
        self.next_batch += 1;
        for (slot, (decision, request)) in decisions.into_iter().zip(requests).enumerate() {
            match decision {
                Ok(Decision::Placed(node)) => {
                    batch.reserved.push(Reservation {
                        node,
                        cpu_millis: request.cpu_millis,
                        memory_hint: request.memory_hint,
                        requester: request.requester,
                    });
                    batch.results.push(Some(Ok(node)));
                }
                Ok(Decision::Wait) => {
                    batch.results.push(None);
                    batch.pending += 1;
                    self.queue
                        .push(request.clone(), (self.next_batch, slot, request));
                }
                Err(error) => batch.results.push(Some(Err(error))),
            }
        }
        self.batches.insert(self.next_batch, batch);
        self.finish_batch(self.next_batch);
    }

    pub(super) fn retry_waiting(&mut self) {
        if self.queue.is_empty() {
            return;
        }
        for ((batch_id, slot, request), result) in self.queue.retry(&mut self.view) {
            let Some(batch) = self.batches.get_mut(&batch_id) else {
                continue;
            };
            if let Ok(node) = &result {
                batch.reserved.push(Reservation {
                    node: *node,
                    cpu_millis: request.cpu_millis,
                    memory_hint: request.memory_hint,
                    requester: request.requester,
                });
            }
            batch.results[slot] = Some(result);
            batch.pending -= 1;
            self.finish_batch(batch_id);
        }
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
        if batch
            .reply
            .send(Ok(SchedulerResponse::Placements(results)))
            .is_err()
        {
            // The caller gave up waiting; nothing will run on what was reserved for it.
            for reservation in batch.reserved {
                self.view.release(
                    reservation.node,
                    reservation.cpu_millis,
                    reservation.memory_hint,
                );
            }
            self.retry_waiting();
            return;
        }
        for reservation in batch.reserved {
            if let Some(requester) = reservation.requester {
                self.leases.entry(requester).or_default().push(reservation);
            }
        }
    }

    /// Gives back what a placed task reserved. A requester's reservation is given back once,
    /// while this leader still holds its lease: after a leader change (the view is rebuilt
    /// without it) or the requester's death (its leases went with it), a late release must not
    /// subtract what other tasks reserved.
    pub(super) fn release(&mut self, reservation: Reservation) {
        if let Some(requester) = reservation.requester {
            let Some(leases) = self.leases.get_mut(&requester) else {
                return;
            };
            let Some(position) = leases.iter().position(|lease| *lease == reservation) else {
                return;
            };
            leases.swap_remove(position);
        }
        self.view.release(
            reservation.node,
            reservation.cpu_millis,
            reservation.memory_hint,
        );
    }
}
