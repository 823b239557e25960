//! The memory monitor: when the host's memory in use passes `node.memory_monitor_threshold`,
//! it kills the worker of the newest task (the one that loses least work), whose task fails
//! with [`TaskFailure::OutOfMemory`](super::protocol::TaskFailure::OutOfMemory) so the driver
//! retries it.

use std::sync::Arc;
use std::time::Duration;

use super::pool::WorkerPool;

/// Freed memory takes 1–2 s to show up as available (DESIGN.md); killing again before then
/// would kill tasks for memory that is already on its way back.
const AFTER_KILL: Duration = Duration::from_secs(2);

pub(crate) async fn run_monitor(
    pool: Arc<WorkerPool>,
    mut system: sysinfo::System,
    threshold: f64,
    interval: Duration,
) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        system.refresh_memory();
        let total = system.total_memory();
        if total == 0 {
            continue;
        }
        let used = total.saturating_sub(system.available_memory());
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
