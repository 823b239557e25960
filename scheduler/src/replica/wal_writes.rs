//! The Raft loop's writes to its WAL, timed. Every commit waits for the leader's write and a
//! follower's, so when commits slow down these say whether the disk did (`floe-bench scale`
//! sets its slowest commits against the replicas' slow writes at the time).

use std::collections::VecDeque;
use std::time::Duration;

use floe_api::scheduler_protocol::{SlowWalWrite, WalWrites};

use super::micros;

/// Counts every write and keeps the latest slow ones, a bounded number of them.
#[derive(Debug, Default)]
pub(super) struct WalWriteTimes {
    writes: u64,
    total: Duration,
    slow_writes: u64,
    slow: VecDeque<SlowWalWrite>,
}

impl WalWriteTimes {
    /// A write that took `took` and ended at `finished_at_ms` (ms since the Unix epoch).
    pub(super) fn record(&mut self, took: Duration, finished_at_ms: u64) {
        self.writes += 1;
        self.total += took;
        if took < Duration::from_millis(WalWrites::SLOW_MS) {
            return;
        }
        self.slow_writes += 1;
        if self.slow.len() == WalWrites::SLOW_KEPT {
            self.slow.pop_front();
        }
        self.slow.push_back(SlowWalWrite {
            took_us: micros(took),
            finished_at_ms,
        });
    }

    pub(super) fn report(&self) -> WalWrites {
        WalWrites {
            writes: self.writes,
            total_us: micros(self.total),
            slow_writes: self.slow_writes,
            slow: self.slow.iter().copied().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_every_write_and_keeps_only_the_latest_slow_ones() {
        let mut times = WalWriteTimes::default();
        let slow = Duration::from_millis(WalWrites::SLOW_MS);
        times.record(Duration::from_micros(300), 1);
        times.record(slow - Duration::from_micros(1), 2);
        let slow_writes = WalWrites::SLOW_KEPT as u64 + 5;
        for at in 0..slow_writes {
            times.record(slow + Duration::from_micros(at), 100 + at);
        }
        let report = times.report();
        assert_eq!(report.writes, 2 + slow_writes);
        assert_eq!(report.slow_writes, slow_writes);
        let fast_us = 300 + WalWrites::SLOW_MS * 1_000 - 1;
        let slow_us: u64 = (0..slow_writes)
            .map(|at| WalWrites::SLOW_MS * 1_000 + at)
            .sum();
        assert_eq!(report.total_us, fast_us + slow_us);
        // The first five slow writes made room for the latest, which stay in order.
        assert_eq!(report.slow.len(), WalWrites::SLOW_KEPT);
        let ended: Vec<u64> = report
            .slow
            .iter()
            .map(|write| write.finished_at_ms)
            .collect();
        let expected: Vec<u64> = (105..105 + WalWrites::SLOW_KEPT as u64).collect();
        assert_eq!(ended, expected);
        assert_eq!(report.slow[0].took_us, WalWrites::SLOW_MS * 1_000 + 5);
    }
}
