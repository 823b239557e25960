//! Sub-allocation of a store segment.
//!
//! First fit in address order: a new object takes the lowest free range that holds it. That
//! keeps the live data packed at the start of the segment, so the pages objects are written to
//! are the ones earlier objects already touched — freshly faulted shared memory runs at a
//! fraction of the speed of warm memory (DESIGN.md, "Memory model"). Freed ranges merge with
//! their free neighbours, so fragmentation never outlives the objects that caused it.

use std::collections::BTreeMap;

/// Every range starts and ends on this boundary: Arrow buffers written with 64-byte IPC
/// alignment then stay 64-byte aligned in memory, which zero-copy decoding requires.
pub const ALIGNMENT: u64 = 64;

/// Rounds `len` up to the allocation granularity; `None` on overflow.
pub fn aligned(len: u64) -> Option<u64> {
    len.checked_next_multiple_of(ALIGNMENT)
}

/// The free ranges of a region of `capacity` bytes.
#[derive(Debug)]
pub struct Allocator {
    capacity: u64,
    /// Free ranges, offset → length. Never two adjacent entries (they are merged).
    free: BTreeMap<u64, u64>,
    used: u64,
}

impl Allocator {
    pub fn new(capacity: u64) -> Self {
        let capacity = capacity - capacity % ALIGNMENT;
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Self {
            capacity,
            free,
            used: 0,
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    /// The offset of a new range of `len` bytes (a multiple of [`ALIGNMENT`]), or `None` when
    /// no free range is large enough.
    pub fn allocate(&mut self, len: u64) -> Option<u64> {
        debug_assert!(len > 0 && len.is_multiple_of(ALIGNMENT));
        let (&offset, &free_len) = self.free.iter().find(|&(_, &free_len)| free_len >= len)?;
        self.free.remove(&offset);
        if free_len > len {
            self.free.insert(offset + len, free_len - len);
        }
        self.used += len;
        Some(offset)
    }

    /// Returns a range that [`allocate`](Self::allocate) handed out.
    pub fn free(&mut self, offset: u64, len: u64) {
        let mut start = offset;
        let mut end = offset + len;
        if let Some((&before, &before_len)) = self.free.range(..offset).next_back()
            && before + before_len == offset
        {
            self.free.remove(&before);
            start = before;
        }
        if let Some(after_len) = self.free.remove(&end) {
            end += after_len;
        }
        self.free.insert(start, end - start);
        self.used -= len;
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn first_fit_reuses_the_lowest_freed_range() {
        let mut allocator = Allocator::new(1024);
        let a = allocator.allocate(128).unwrap();
        let b = allocator.allocate(128).unwrap();
        let c = allocator.allocate(128).unwrap();
        assert_eq!((a, b, c), (0, 128, 256));
        allocator.free(b, 128);
        assert_eq!(allocator.allocate(64), Some(128));
        assert_eq!(allocator.allocate(64), Some(192));
        assert_eq!(allocator.allocate(1024), None);
        assert_eq!(allocator.used(), 384);
    }

    proptest! {
        /// Against a byte-ownership model: ranges never overlap, stay inside the region, and
        /// once everything is freed the region is one free range again.
        #[test]
        fn ranges_never_overlap_and_merge_back(
            steps in proptest::collection::vec((1u64..40, any::<bool>()), 1..200)
        ) {
            let capacity = 64 * 256;
            let mut allocator = Allocator::new(capacity);
            let mut owner = vec![None::<usize>; (capacity / ALIGNMENT) as usize];
            let mut live: Vec<(usize, u64, u64)> = Vec::new();
            for (step, (units, free_one)) in steps.into_iter().enumerate() {
                if free_one && !live.is_empty() {
                    let (_, offset, len) = live.remove(step % live.len());
                    for unit in offset / ALIGNMENT..(offset + len) / ALIGNMENT {
                        owner[unit as usize] = None;
                    }
                    allocator.free(offset, len);
                } else {
                    let len = units * ALIGNMENT;
                    let fits_somewhere = owner
                        .windows(units as usize)
                        .any(|window| window.iter().all(Option::is_none));
                    match allocator.allocate(len) {
                        Some(offset) => {
                            prop_assert!(offset + len <= capacity);
                            for unit in offset / ALIGNMENT..(offset + len) / ALIGNMENT {
                                prop_assert_eq!(owner[unit as usize], None);
                                owner[unit as usize] = Some(step);
                            }
                            live.push((step, offset, len));
                        }
                        None => prop_assert!(!fits_somewhere),
                    }
                }
                let owned = owner.iter().filter(|unit| unit.is_some()).count() as u64;
                prop_assert_eq!(allocator.used(), owned * ALIGNMENT);
            }
            for (_, offset, len) in live {
                allocator.free(offset, len);
            }
            prop_assert_eq!(allocator.used(), 0);
            // Everything merged back into one range: the whole region is allocatable again.
            prop_assert_eq!(allocator.allocate(capacity), Some(0));
        }
    }
}
