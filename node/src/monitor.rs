//! The memory monitor: when the host's memory in use passes `node.memory_monitor_threshold`,
//! it kills the worker of the newest task (the one that loses least work), whose task fails
//! with [`TaskFailure::OutOfMemory`](floe_api::node_protocol::TaskFailure::OutOfMemory) so the driver
//! retries it.

use std::sync::Arc;
use std::time::Duration;

use super::pool::WorkerPool;

/// Freed memory takes 1–2 s to show up as available (DESIGN.md); killing again before then
/// would kill tasks for memory that is already on its way back.
const AFTER_KILL: Duration = Duration::from_secs(2);

/// The host's memory, read once per tick of an interval.
pub(crate) struct HostMemory {
    system: sysinfo::System,
    ticks: tokio::time::Interval,
}

impl HostMemory {
    pub(crate) fn new(system: sysinfo::System, interval: Duration) -> Self {
        let mut ticks = tokio::time::interval(interval);
        // A late tick is not made up with a burst: one reading per interval is enough.
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Self { system, ticks }
    }

    /// Waits for the next tick, then returns the host's memory in use and in total, in bytes.
    pub(crate) async fn next(&mut self) -> (u64, u64) {
        self.ticks.tick().await;
        self.system.refresh_memory();
        let total = self.system.total_memory();
        (total.saturating_sub(self.system.available_memory()), total)
    }
}

pub(crate) async fn run_monitor(
    pool: Arc<WorkerPool>,
    system: sysinfo::System,
    threshold: f64,
    interval: Duration,
) {
    let mut memory = HostMemory::new(system, interval);
    loop {
        let (used, total) = memory.next().await;
        if total == 0 {
            continue;
        }
        let share = used as f64 / total as f64;
        if share <= threshold {
            continue;
        }
        let reason = format!(
            "host memory {:.1}% in use ({used} of {total} bytes) is past the \
             node.memory_monitor_threshold of {:.1}%; the newest task was killed",
            share * 100.0,
            threshold * 100.0
        );
        if let Some(victim) = pool.kill_newest(reason) {
            tracing::warn!(
                task = %victim.task,
                pid = victim.worker_pid,
                used,
                total,
                "memory monitor killed the newest task's worker"
            );
            tokio::time::sleep(AFTER_KILL).await;
        }
    }
}
