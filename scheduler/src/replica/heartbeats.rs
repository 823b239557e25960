//! Heartbeats, answered off the Raft loop.
//!
//! A heartbeat commits nothing: it proves a node alive to the leader, reports the node's usage
//! and is answered with the drivers the node should run. So the RPC front answers it, and the
//! driver watches, itself: from the [`Directory`] the Raft loop republishes after every turn
//! that changed what it says (an O(1) copy: the state's maps are persistent), and into the
//! [`Beats`] book shared with the loop, an O(1) hash update under a lock held for that long.
//! The loop hears of a node only on its first heartbeat to this leader (to add it to the
//! resource view), and reads the book on the health tick (who fell silent), to rank nodes
//! for drivers and for `NodeReports`. A heartbeat never waits on a log write.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use floe_api::scheduler_protocol::{LeaderHint, ResourceUsage, SchedulerResponse};
use floe_api::state::NodeDirectory;
use floe_core::NodeId;

use super::RaftLoop;
use crate::storage::LogStore;

/// What the RPC front answers heartbeats and driver watches from, as of the loop's last turn.
#[derive(Debug, Clone, Default)]
pub(super) struct Directory {
    /// The term this replica leads in, or `None` when it does not lead: only the leader
    /// answers heartbeats.
    pub(super) leading: Option<u64>,
    /// Where callers should go instead, when this replica does not lead.
    pub(super) leader: Option<LeaderHint>,
    pub(super) nodes: NodeDirectory,
}

/// The leader's book of heartbeats (soft state: it starts afresh with every term led).
#[derive(Debug, Default)]
pub(super) struct Beats {
    book: Mutex<Book>,
}

#[derive(Debug, Default)]
pub(super) struct Book {
    /// The term whose heartbeats this book holds; `None` while the replica does not lead.
    leading: Option<u64>,
    /// When each node last heartbeated, or when the health check first looked for it (a node
    /// first seen gets a full timeout from then).
    pub(super) last_seen: HashMap<NodeId, Instant>,
    /// Each node's last reported usage; a node is in it once it has heartbeated to this
    /// replica as leader, and only then do drivers and tasks go to it.
    pub(super) usage: HashMap<NodeId, ResourceUsage>,
}

/// What recording one heartbeat found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Heard {
    /// The node's first heartbeat to this leader.
    First,
    Again,
    /// Answered from a directory of a term the book has left: not recorded (the node's next
    /// heartbeat, to whoever leads, counts).
    Stale,
}

impl Beats {
    /// Records a heartbeat from `node`, answered as leader of `term`.
    pub(super) fn heard(&self, term: u64, node: NodeId, usage: ResourceUsage) -> Heard {
        let mut book = self.lock();
        if book.leading != Some(term) {
            return Heard::Stale;
        }
        book.last_seen.insert(node, Instant::now());
        match book.usage.insert(node, usage) {
            None => Heard::First,
            Some(_) => Heard::Again,
        }
    }

    /// The loop's access to the book; the front waits meanwhile, so keep it short.
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        // Every write is a single map operation: a panic leaves the book consistent.
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Book {
    /// Starts the book afresh for the term this replica now leads in, or for none.
    pub(super) fn restart(&mut self, leading: Option<u64>) {
        self.leading = leading;
        self.last_seen.clear();
        self.usage.clear();
    }

    /// Whether `node` has heartbeated to this leader.
    pub(super) fn heard_from(&self, node: NodeId) -> bool {
        self.usage.contains_key(&node)
    }

    pub(super) fn forget(&mut self, node: NodeId) {
        self.last_seen.remove(&node);
        self.usage.remove(&node);
    }
}

impl<S: LogStore> RaftLoop<S> {
    /// Republishes the directory when what it says changed (the applied state, this
    /// replica's role or the leader it knows of), then announces the drivers started this
    /// turn and answers the commands applied, so a driver watch woken by one finds it in the
    /// directory, and a node's heartbeat right after its registration finds it alive.
    pub(super) fn publish_directory(&mut self) {
        let leading = self.is_leader().then_some(self.raw.raft.term);
        let leader = self.leader_hint();
        let current = self.directory.borrow().clone();
        if current.nodes.applied_index != self.state.applied_index
            || current.leading != leading
            || current.leader != leader
        {
            self.directory.send_replace(Arc::new(Directory {
                leading,
                leader,
                nodes: self.state.node_directory(),
            }));
        }
        for node in self.unannounced_drivers.drain(..) {
            // No one listening is fine: the node's heartbeat carries it too.
            let _ = self.notices.drivers_started.send(node);
        }
        for (reply, outcome) in self.unsent_replies.drain(..) {
            let _ = reply.send(Ok(SchedulerResponse::Committed(outcome)));
        }
    }

    /// A node's first heartbeat to this leader, recorded by the front: the node joins the
    /// resource view (and may take what waited for room). Dropped if the node died or this
    /// replica's term changed since.
    pub(super) fn first_heard(&mut self, node: NodeId) {
        if !self.beats.lock().heard_from(node) {
            return;
        }
        if let Some(record) = self.state.nodes.get(&node).filter(|n| n.is_alive()) {
            self.leases.upsert_node(node, record.resources);
            self.retry_waiting();
        }
    }
}
