//! How a node divides its memory (DESIGN.md, "Memory model").
//!
//! The node's memory M is the host's total memory (or its cgroup limit, when that is lower —
//! a container must not size itself from the host), unless `memory.total` fixes it. The
//! object store gets `object_store_fraction` of M clamped to
//! `[object_store_min, object_store_max]`, the system reserve gets `system_reserve_fraction`
//! of M, and the heap — the schedulable `memory` resource — is what remains.

use floe_core::config::{MemoryConfig, MemoryTotal};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// A node's memory split into its three pools, in bytes. `object_store + system_reserve + heap
/// == total` always holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPools {
    /// The node's memory M.
    pub total: u64,
    /// The shared-memory object store's capacity.
    pub object_store: u64,
    /// Kept free for the OS and floe's own processes.
    pub system_reserve: u64,
    /// The schedulable `memory` resource: what tasks and actors may hint they use.
    pub heap: u64,
}

impl MemoryPools {
    /// The pools of this host: `memory.total`, or the detected memory when it is `"auto"`.
    pub fn detect(config: &MemoryConfig) -> Result<Self> {
        Self::split(Self::host_total(config)?, config)
    }

    /// `memory.total`, or the detected memory (the cgroup's limit when lower) when it is
    /// `"auto"`.
    pub fn host_total(config: &MemoryConfig) -> Result<u64> {
        match config.total {
            MemoryTotal::Fixed(size) => Ok(size.bytes()),
            MemoryTotal::Auto => detected_total_memory(),
        }
    }

    /// The pools of a node with `total` bytes of memory.
    pub fn split(total: u64, config: &MemoryConfig) -> Result<Self> {
        let min = config.object_store_min.bytes();
        let max = config.object_store_max.bytes();
        let object_store = fraction_of(total, config.object_store_fraction).clamp(min, max);
        let system_reserve = fraction_of(total, config.system_reserve_fraction);
        let heap = total
            .checked_sub(object_store)
            .and_then(|rest| rest.checked_sub(system_reserve))
            .filter(|heap| *heap > 0)
            .ok_or(Error::NotEnoughMemory {
                total,
                object_store,
                system_reserve,
            })?;
        Ok(Self {
            total,
            object_store,
            system_reserve,
            heap,
        })
    }
}

/// `value × fraction`, rounded down. Fractions are validated to lie in [0, 1), so the product
/// never exceeds `value`.
fn fraction_of(value: u64, fraction: f64) -> u64 {
    (value as f64 * fraction) as u64
}

fn detected_total_memory() -> Result<u64> {
    let mut system = sysinfo::System::new().map_err(|error| Error::MemoryDetection {
        reason: error.to_string(),
    })?;
    system.refresh_memory();
    let host = system.total_memory();
    let limit = system
        .cgroup_limits()
        .map(|limits| limits.total_memory)
        .filter(|limit| *limit > 0);
    let total = limit.map_or(host, |limit| limit.min(host));
    if total == 0 {
        return Err(Error::MemoryDetection {
            reason: "the host reports 0 bytes of memory; set memory.total".into(),
        });
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use floe_core::config::ByteSize;

    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn default_split_of_a_16_gib_node() {
        let pools = MemoryPools::split(16 * GIB, &MemoryConfig::default()).unwrap();
        assert_eq!(pools.object_store, (16.0 * GIB as f64 * 0.3) as u64);
        assert_eq!(pools.system_reserve, (16.0 * GIB as f64 * 0.1) as u64);
        assert_eq!(
            pools.object_store + pools.system_reserve + pools.heap,
            pools.total
        );
    }

    #[test]
    fn the_store_is_clamped_to_its_bounds() {
        let config = MemoryConfig::default();
        // 30% of 200 MiB is 60 MiB, under the 75 MiB floor.
        let small = MemoryPools::split(200 << 20, &config).unwrap();
        assert_eq!(small.object_store, 75 << 20);
        assert_eq!(small.heap, (200 << 20) - (75 << 20) - (20 << 20));
        // 30% of 1 TB is 300 GB, over the 200 GB ceiling.
        let large = MemoryPools::split(1_000_000_000_000, &config).unwrap();
        assert_eq!(large.object_store, 200_000_000_000);
        assert_eq!(
            large.heap,
            1_000_000_000_000 - 200_000_000_000 - 100_000_000_000
        );
    }

    #[test]
    fn a_node_too_small_for_the_store_is_an_error_with_the_numbers() {
        let error = MemoryPools::split(80 << 20, &MemoryConfig::default()).unwrap_err();
        let text = error.to_string();
        assert!(text.contains("83886080"), "{text}");
        assert!(text.contains("78643200"), "{text}");
    }

    #[test]
    fn a_fixed_total_overrides_detection() {
        let config = MemoryConfig {
            total: MemoryTotal::Fixed(ByteSize::gib(8)),
            ..MemoryConfig::default()
        };
        assert_eq!(MemoryPools::detect(&config).unwrap().total, 8 * GIB);
    }

    #[test]
    fn detection_matches_proc_meminfo_or_a_lower_cgroup_limit() {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
        let kib: u64 = meminfo
            .lines()
            .find_map(|line| line.strip_prefix("MemTotal:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        let detected = MemoryPools::detect(&MemoryConfig::default()).unwrap();
        assert!(detected.total <= kib * 1024);
        assert!(detected.total > 0);
    }
}
