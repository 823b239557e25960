//! Whether a replica may take part in elections: not while it is missing entries it had
//! acknowledged.
//!
//! Raft's safety rests on a voter never forgetting an entry it acknowledged: the leader counts
//! that acknowledgement toward a quorum, and every later election needs a vote from that
//! quorum, which only goes to a candidate holding the entry. A replica whose disk lost the end
//! of its log breaks that promise. Seen from raft-rs it also crashes: the leader's heartbeat
//! tells it to commit up to an entry it no longer has (`to_commit … is out of range`), and its
//! own hard state may record a commit index past its last entry (`hs.commit … is out of
//! range`), on every start.
//!
//! The ways out considered:
//! - *Lower the commit index to the last entry and carry on.* It starts, but it votes with a
//!   log missing entries a quorum counted it for; a candidate missing them too could win with
//!   its vote, and committed entries would be gone from the cluster.
//! - *Empty the log and wait for the leader's snapshot.* An empty log still votes (for
//!   anyone), throws away good entries, and raft-rs sends a snapshot only once the leader has
//!   compacted.
//! - *Lower the commit index, and stay out of elections until the leader has sent the lost
//!   entries again* — chosen. The replica neither campaigns nor answers vote requests, so any
//!   leader elected meanwhile won with a quorum of other replicas, which shares a replica that
//!   still holds every lost committed entry with the quorum that committed it. It keeps
//!   appending what the leader sends (acknowledging only what it then holds) and serves
//!   everything a follower serves. Once its log holds the leader's entries up to the highest
//!   index it is known to have lost, and they are durable, it votes again. Commit indexes are
//!   knowledge, never promises: lowering one is always safe.
//!
//! What proves a loss: a hard state recording a commit past the last entry
//! ([`LostTail::lost_committed_entries`]), or a heartbeat whose commit index is past the last
//! entry — the leader sends `min(its commit, what this replica acknowledged)`, so that is an
//! acknowledgement the log no longer backs. A record cut short without such proof looks
//! exactly like a write a crash interrupted, which was never acknowledged, and is treated as
//! one (see `storage::LostTail`); so is a loss from a replica that led when it stopped (the
//! new leader never counted its acknowledgements).
//!
//! Catching up: the leader's progress still says this replica holds the lost entries, and
//! raft-rs ignores rejections at or below that; it probes back to the real end of the log only
//! after it sent something newer. So the rejoining replica has the leader append an empty
//! entry now and then (a proposal raft-rs forwards), rather than wait for the next command.

use std::time::{Duration, Instant};

use raft::prelude::{Message, MessageType};

use crate::storage::LostTail;

/// A replica's standing in elections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Standing {
    Voter,
    /// It lost acknowledged entries up to `until` and stays out of elections until its log
    /// holds the leader's entries up to there.
    Rejoining {
        until: u64,
        /// When it last had the leader append an empty entry.
        nudged: Option<Instant>,
    },
}

impl Standing {
    /// The standing of replica `id` whose log was opened with `lost` missing from its end.
    pub(super) fn at_start(id: u64, lost: Option<LostTail>) -> Self {
        let Some(lost) = lost else {
            return Self::Voter;
        };
        if lost.lost_committed_entries() {
            tracing::error!(
                replica = id,
                last_index = lost.last_index,
                recorded_commit = lost.recorded_commit,
                dropped_bytes = lost.dropped_bytes,
                "this replica lost raft log entries it had acknowledged (its log ends at {}, \
                 its hard state says {} were committed); it will not vote or campaign until \
                 the leader has sent them again",
                lost.last_index,
                lost.recorded_commit
            );
            return Self::Rejoining {
                until: lost.recorded_commit,
                nudged: None,
            };
        }
        tracing::warn!(
            replica = id,
            last_index = lost.last_index,
            dropped_bytes = lost.dropped_bytes,
            "the raft log ended in a record cut short, taken for a write a crash interrupted \
             (never acknowledged); if the disk lost bytes it had reported written, the leader's \
             next heartbeat will say so"
        );
        Self::Voter
    }

    /// Whether the replica may start an election when its timer runs out.
    pub(super) fn may_campaign(&self) -> bool {
        matches!(self, Self::Voter)
    }

    /// Looks at a message before raft-rs steps it; `None` drops it. While rejoining, vote
    /// requests and election hand-overs are dropped. A heartbeat committing past
    /// `last_index` proves acknowledged entries were lost: it starts (or extends) rejoining,
    /// and its commit index is lowered to `last_index`, which this log shares with the
    /// leader's (it is a prefix of what this replica acknowledged to that leader).
    pub(super) fn screen(
        &mut self,
        id: u64,
        mut message: Message,
        last_index: u64,
    ) -> Option<Message> {
        match message.get_msg_type() {
            MessageType::MsgRequestVote
            | MessageType::MsgRequestPreVote
            | MessageType::MsgTimeoutNow
                if !self.may_campaign() =>
            {
                tracing::debug!(
                    replica = id,
                    from = message.from,
                    kind = ?message.get_msg_type(),
                    "not taking part in elections while rejoining"
                );
                None
            }
            MessageType::MsgHeartbeat if message.commit > last_index => {
                let acknowledged = message.commit;
                match self {
                    Self::Voter => {
                        tracing::error!(
                            replica = id,
                            leader = message.from,
                            acknowledged,
                            last_index,
                            "this replica lost raft log entries it had acknowledged (the \
                             leader counts it as holding entry {acknowledged}, its log ends at \
                             {last_index}); it will not vote or campaign until the leader has \
                             sent them again"
                        );
                        *self = Self::Rejoining {
                            until: acknowledged,
                            nudged: None,
                        };
                    }
                    Self::Rejoining { until, .. } => *until = (*until).max(acknowledged),
                }
                message.commit = last_index;
                Some(message)
            }
            _ => Some(message),
        }
    }

    /// Whether to have the leader append an empty entry now: while rejoining, at most once
    /// per `every`.
    pub(super) fn nudge_due(&mut self, now: Instant, every: Duration) -> bool {
        let Self::Rejoining { nudged, .. } = self else {
            return false;
        };
        if nudged.is_some_and(|at| now.duration_since(at) < every) {
            return false;
        }
        *nudged = Some(now);
        true
    }

    /// Votes again once the log holds, durably, the leader's entries up to the lost index:
    /// `committed` (what the leader confirmed this log shares with it) and `durable_last`
    /// (what is on disk) both reach it.
    pub(super) fn settle(&mut self, id: u64, committed: u64, durable_last: u64) {
        if let Self::Rejoining { until, .. } = *self
            && committed >= until
            && durable_last >= until
        {
            tracing::info!(
                replica = id,
                index = until,
                committed,
                "this replica holds the leader's entries up to the ones it had lost; it votes \
                 again"
            );
            *self = Self::Voter;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(kind: MessageType, commit: u64) -> Message {
        let mut message = Message::default();
        message.set_msg_type(kind);
        message.from = 2;
        message.commit = commit;
        message
    }

    fn lost(last_index: u64, recorded_commit: u64) -> Option<LostTail> {
        Some(LostTail {
            dropped_bytes: 100,
            last_index,
            recorded_commit,
        })
    }

    #[test]
    fn only_a_proven_loss_takes_a_replica_out_of_elections() {
        assert_eq!(Standing::at_start(1, None), Standing::Voter);
        // A torn record with the commit still inside the log: a crash mid-write.
        assert_eq!(Standing::at_start(1, lost(10, 9)), Standing::Voter);
        assert_eq!(
            Standing::at_start(1, lost(10, 12)),
            Standing::Rejoining {
                until: 12,
                nudged: None
            }
        );
    }

    #[test]
    fn a_heartbeat_past_the_log_starts_rejoining_and_is_lowered() {
        let mut standing = Standing::Voter;
        let vote = message(MessageType::MsgRequestVote, 0);
        assert!(standing.screen(1, vote.clone(), 10).is_some());
        let within = standing
            .screen(1, message(MessageType::MsgHeartbeat, 10), 10)
            .unwrap();
        assert_eq!((within.commit, standing), (10, Standing::Voter));

        let lowered = standing
            .screen(1, message(MessageType::MsgHeartbeat, 11), 10)
            .unwrap();
        assert_eq!(lowered.commit, 10);
        assert!(!standing.may_campaign());
        for kind in [
            MessageType::MsgRequestVote,
            MessageType::MsgRequestPreVote,
            MessageType::MsgTimeoutNow,
        ] {
            assert!(
                standing.screen(1, message(kind, 0), 10).is_none(),
                "{kind:?}"
            );
        }
        // Appends, and the responses a leader gets, still pass.
        assert!(
            standing
                .screen(1, message(MessageType::MsgAppend, 11), 10)
                .is_some()
        );
        // A later heartbeat can only raise the index to reach.
        standing.screen(1, message(MessageType::MsgHeartbeat, 14), 12);
        standing.screen(1, message(MessageType::MsgHeartbeat, 13), 12);
        assert!(matches!(standing, Standing::Rejoining { until: 14, .. }));

        // Committed but not yet on disk, or on disk but not confirmed: still rejoining.
        standing.settle(1, 14, 13);
        standing.settle(1, 13, 14);
        assert!(!standing.may_campaign());
        standing.settle(1, 14, 14);
        assert_eq!(standing, Standing::Voter);
    }

    #[test]
    fn nudges_are_spaced_out_and_only_while_rejoining() {
        let start = Instant::now();
        let every = Duration::from_secs(1);
        assert!(!Standing::Voter.nudge_due(start, every));
        let mut standing = Standing::Rejoining {
            until: 5,
            nudged: None,
        };
        assert!(standing.nudge_due(start, every));
        assert!(!standing.nudge_due(start + every / 2, every));
        assert!(standing.nudge_due(start + every, every));
    }
}
