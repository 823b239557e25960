//! The Raft loop's writes to its log, timed. Every commit waits for the leader's write and a
//! follower's, so when commits slow down these say whether the disk did (`floe-bench scale`
//! sets a commit's latency against the replicas' slow writes at the time).

use std::collections::VecDeque;
use std::time::Duration;

use floe_api::scheduler_protocol::{LogWrites, SlowLogWrite};

use super::micros;

/// Counts every write and keeps the latest slow ones, a bounded number of them.
#[derive(Debug, Default)]
pub(super) struct LogWriteTimes {
    writes: u64,
    total: Duration,
    slow: VecDeque<SlowLogWrite>,
}

impl LogWriteTimes {
    /// A write that took `took` and ended at `finished_at_ms` (ms since the Unix epoch).
    pub(super) fn record(&mut self, took: Duration, finished_at_ms: u64) {
        self.writes += 1;
        self.total += took;
        if took < Duration::from_millis(LogWrites::SLOW_MS) {
            return;
        }
        if self.slow.len() == LogWrites::SLOW_KEPT {
            self.slow.pop_front();
        }
        self.slow.push_back(SlowLogWrite {
            took_us: micros(took),
            finished_at_ms,
        });
    }

    pub(super) fn report(&self) -> LogWrites {
        LogWrites {
            writes: self.writes,
            total_us: micros(self.total),
            slow: self.slow.iter().copied().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_every_write_and_keeps_only_the_latest_slow_ones() {
        let mut times = LogWriteTimes::default();
        let slow = Duration::from_millis(LogWrites::SLOW_MS);
        times.record(Duration::from_micros(300), 1);
        times.record(slow - Duration::from_micros(1), 2);
        for at in 0..LogWrites::SLOW_KEPT as u64 + 5 {
            times.record(slow + Duration::from_micros(at), 100 + at);
        }
        let report = times.report();
        let writes = 2 + LogWrites::SLOW_KEPT as u64 + 5;
        assert_eq!(report.writes, writes);
        let fast_us = 300 + LogWrites::SLOW_MS * 1_000 - 1;
        let slow_us: u64 = (0..writes - 2)
            .map(|at| LogWrites::SLOW_MS * 1_000 + at)
            .sum();
        assert_eq!(report.total_us, fast_us + slow_us);
        // The first five slow writes made room for the latest, which stay in order.
        assert_eq!(report.slow.len(), LogWrites::SLOW_KEPT);
        let ended: Vec<u64> = report
            .slow
            .iter()
            .map(|write| write.finished_at_ms)
            .collect();
        let expected: Vec<u64> = (105..105 + LogWrites::SLOW_KEPT as u64).collect();
        assert_eq!(ended, expected);
        assert_eq!(report.slow[0].took_us, LogWrites::SLOW_MS * 1_000 + 5);
    }
}
