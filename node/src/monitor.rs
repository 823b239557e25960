//! The memory monitor, and what the node's processes use.
//!
//! The node's memory is [`MemoryPools::detect`]'s total — the one reading of "this node's
//! memory" the pools are sized from too: `memory.total` when set, else the host's memory or
//! its cgroup limit when lower. Of it, the system reserve is left to the OS and everything
//! else; the node's process tree (the agent, its workers, its UDF children) may use the rest.
//! When the tree's memory passes `node.memory_monitor_threshold` of that rest, the monitor
//! kills the worker of the newest task (the one that loses least work), whose task fails with
//! [`TaskFailure::OutOfMemory`](floe_api::node_protocol::TaskFailure::OutOfMemory) so the
//! driver retries it. So a container's OOM killer, which acts at the cgroup limit, never gets
//! to the agent first.
//!
//! The tree's memory is its processes' private heaps (`RssAnon` of `/proc/<pid>/status`) and
//! the object store's resident pages (counted once, however many processes map them); mapped
//! files (the binary, cache shards being read) do not count, since the kernel can drop them.
//! Both readings cost the same whatever the processes map: the kernel keeps the counters.
//! (`smaps_rollup`'s proportional sizes would walk every page table at every reading: with a
//! few GB of the store mapped by each worker, a fifth of the host's CPU at four readings a
//! second.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use floe_objectstore::{MemoryPools, ObjectStore};

use super::pool::WorkerPool;

/// Freed memory takes 1–2 s to show up as available (DESIGN.md); killing again before then
/// would kill tasks for memory that is already on its way back.
const AFTER_KILL: Duration = Duration::from_secs(2);

/// What a process tree holds in memory, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TreeMemory {
    /// Private memory: the processes' heaps (what tasks and UDFs use).
    pub anonymous: u64,
    /// Shared memory: the object store's pages in use.
    pub shared: u64,
}

impl TreeMemory {
    pub(crate) fn total(&self) -> u64 {
        self.anonymous + self.shared
    }
}

/// The memory of process `root` and all its descendants, with `store`'s pages as the shared
/// part. Processes that exit while they are read are left out.
pub(crate) fn process_tree_memory(root: u32, store: &ObjectStore) -> TreeMemory {
    TreeMemory {
        anonymous: descendants_and_self(root)
            .into_iter()
            .filter_map(anonymous_memory)
            .sum(),
        shared: store.resident_bytes().unwrap_or(0),
    }
}

/// CPU time the process tree of `root` has used, in clock ticks (`utime + stime` of each
/// live process; what exited processes used is gone with them, so a rate from two readings
/// can dip when a worker is replaced).
pub(crate) fn process_tree_cpu_ticks(root: u32) -> u64 {
    descendants_and_self(root)
        .into_iter()
        .filter_map(cpu_ticks_of)
        .sum()
}

/// Clock ticks per second, the unit of `/proc/<pid>/stat`'s CPU times.
pub(crate) fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf reads a constant of the system and has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks)
        .ok()
        .filter(|ticks| *ticks > 0)
        .unwrap_or(100)
}

/// `utime + stime` of `/proc/<pid>/stat`: fields 14 and 15, the 12th and 13th after the
/// command name's closing parenthesis.
fn cpu_ticks_of(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(11);
    let user: u64 = fields.next()?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    Some(user + system)
}

/// `root` and every process below it. Read from each process's threads' `children` files, so
/// a reading costs what the tree holds, not what the host runs: reading every process's parent
/// instead took 10–15 µs a process, which on a host of a few thousand processes is
/// tens of milliseconds a reading, several readings a second. A kernel built without those
/// files (`CONFIG_PROC_CHILDREN`) gets every process's parent read.
fn descendants_and_self(root: u32) -> BTreeSet<u32> {
    static HAS_CHILDREN_FILES: OnceLock<bool> = OnceLock::new();
    if *HAS_CHILDREN_FILES.get_or_init(|| Path::new("/proc/thread-self/children").exists()) {
        walk_children(root)
    } else {
        walk_parents(root)
    }
}

/// [`descendants_and_self`] from `/proc/<pid>/task/<tid>/children`: a child is listed under the
/// thread that started it (or, once that thread has exited, another of its process's), so
/// every thread's file is read. A process that exits while it is read is left out.
fn walk_children(root: u32) -> BTreeSet<u32> {
    let mut tree = BTreeSet::new();
    let mut pending = vec![root];
    while let Some(pid) = pending.pop() {
        if !tree.insert(pid) {
            continue;
        }
        let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for thread in threads.flatten() {
            if let Ok(children) = std::fs::read_to_string(thread.path().join("children")) {
                pending.extend(
                    children
                        .split_ascii_whitespace()
                        .filter_map(|child| child.parse::<u32>().ok()),
                );
            }
        }
    }
    tree
}

/// [`descendants_and_self`] from every process's parent in `/proc`.
fn walk_parents(root: u32) -> BTreeSet<u32> {
    let mut children: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|name| name.parse().ok())
            else {
                continue;
            };
            if let Some(parent) = parent_of(pid) {
                children.entry(parent).or_default().push(pid);
            }
        }
    }
    let mut tree = BTreeSet::new();
    let mut pending = vec![root];
    while let Some(pid) = pending.pop() {
        if tree.insert(pid) {
            pending.extend(children.get(&pid).into_iter().flatten());
        }
    }
    tree
}

/// The parent pid in `/proc/<pid>/stat` (the field after the state, which follows the
/// command name: in parentheses, and it may hold any byte).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// A process's private memory: `RssAnon` of `/proc/<pid>/status`, in bytes.
fn anonymous_memory(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_rss_anon(&status)
}

fn parse_rss_anon(status: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let value = line.strip_prefix("RssAnon:")?;
        let kib: u64 = value.trim().strip_suffix("kB")?.trim().parse().ok()?;
        Some(kib * 1024)
    })
}

/// The memory monitor's limit: `threshold` of what the node's memory leaves besides the
/// system reserve.
fn limit(pools: &MemoryPools, threshold: f64) -> u64 {
    (pools.total.saturating_sub(pools.system_reserve) as f64 * threshold) as u64
}

pub(crate) async fn run_monitor(
    pool: Arc<WorkerPool>,
    store: ObjectStore,
    pools: MemoryPools,
    threshold: f64,
    interval: Duration,
) {
    let limit = limit(&pools, threshold);
    let agent = std::process::id();
    let mut ticks = tokio::time::interval(interval);
    // A late tick is not made up with a burst: one reading per interval is enough.
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let store = store.clone();
        let reading = tokio::task::spawn_blocking(move || process_tree_memory(agent, &store));
        let Ok(used) = reading.await else {
            continue;
        };
        let used = used.total();
        if used <= limit {
            continue;
        }
        let reason = format!(
            "the node's processes use {used} bytes, past the node.memory_monitor_threshold of \
             {:.1}% of the {} bytes its memory ({} bytes) leaves besides the system reserve; \
             the newest task was killed",
            threshold * 100.0,
            pools.total.saturating_sub(pools.system_reserve),
            pools.total,
        );
        if let Some(victim) = pool.kill_newest(reason) {
            tracing::warn!(
                task = %victim.task,
                pid = victim.worker_pid,
                used,
                limit,
                "memory monitor killed the newest task's worker"
            );
            tokio::time::sleep(AFTER_KILL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use floe_core::config::MemoryConfig;

    use super::*;

    #[test]
    fn a_status_gives_the_private_memory() {
        let status = "Name:\tfloe\nVmRSS:\t  9000 kB\nRssAnon:\t  1200 kB\nRssFile:\t  100 kB\n\
                      RssShmem:\t  7700 kB\n";
        assert_eq!(parse_rss_anon(status), Some(1200 * 1024));
        assert_eq!(parse_rss_anon("Name:\tfloe\n"), None);
    }

    #[test]
    fn the_tree_holds_this_process_and_its_children_and_counts_their_heaps() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let me = std::process::id();
        let tree = descendants_and_self(me);
        assert!(tree.contains(&me) && tree.contains(&child.id()), "{tree:?}");
        assert!(!tree.contains(&1));
        // 64 MiB touched here shows in the tree's heap.
        let dir = tempfile::tempdir().unwrap();
        let store = ObjectStore::open_with(
            floe_objectstore::StoreConfig {
                name: format!("monitor-unit-{me}"),
                capacity: 64 << 20,
                spill_threshold: 1.0,
                min_spilling_size: 1 << 20,
                spill_dir: dir.path().join("spill"),
                fallback_dir: dir.path().join("fallback"),
            },
            floe_objectstore::Backing::SharedMemory,
        )
        .unwrap();
        let before = process_tree_memory(me, &store);
        let held = vec![1u8; 64 << 20];
        let after = process_tree_memory(me, &store);
        assert!(
            after.anonymous >= before.anonymous + (60 << 20),
            "{before:?} → {after:?}"
        );
        drop(held);
        // 16 MiB written into the store's segment shows as its shared memory, once.
        store
            .put(floe_core::ObjectId::new(1), &vec![7u8; 16 << 20])
            .unwrap();
        let stored = process_tree_memory(me, &store);
        assert!(
            stored.shared >= before.shared + (16 << 20) && stored.shared <= 64 << 20,
            "{before:?} → {stored:?}"
        );
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn both_walks_find_a_grandchild_started_by_another_thread() {
        // The shell (a child of a thread that then exits) starts the grandchild.
        let mut child = std::thread::spawn(|| {
            std::process::Command::new("sh")
                .args(["-c", "sleep 30 & echo $!; wait"])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .join()
        .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let grandchild: u32 = line.trim().parse().unwrap();
        let tree = descendants_and_self(std::process::id());
        assert!(
            tree.contains(&child.id()) && tree.contains(&grandchild),
            "{tree:?} lacks {} or {grandchild}",
            child.id()
        );
        // The shell's subtree alone: other tests start and end children of this process.
        let subtree = BTreeSet::from([child.id(), grandchild]);
        assert_eq!(walk_children(child.id()), subtree);
        assert_eq!(walk_parents(child.id()), subtree);
        std::process::Command::new("kill")
            .arg(grandchild.to_string())
            .status()
            .unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn a_busy_child_adds_its_cpu_time_to_the_tree() {
        let me = std::process::id();
        let before = process_tree_cpu_ticks(me);
        let mut busy = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        // A fifth of a second of CPU, however long a loaded machine takes to give it.
        let wanted = clock_ticks_per_second() / 5;
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        let child = loop {
            let child = cpu_ticks_of(busy.id()).unwrap();
            if child >= wanted || std::time::Instant::now() > deadline {
                break child;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        // Read after the child: the tree holds at least what the child had used then.
        let during = process_tree_cpu_ticks(me);
        busy.kill().unwrap();
        busy.wait().unwrap();
        assert!(child >= wanted, "the child used {child} ticks");
        assert!(during >= before + child, "{before} + {child} > {during}");
    }

    #[test]
    fn the_limit_is_the_threshold_of_what_the_reserve_leaves() {
        let pools = MemoryPools::split(1 << 30, &MemoryConfig::default()).unwrap();
        let rest = (1u64 << 30) - pools.system_reserve;
        assert_eq!(limit(&pools, 1.0), rest);
        assert_eq!(limit(&pools, 0.5), rest / 2);
    }
}
