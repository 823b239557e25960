//! The test-only task kinds (feature `test-tasks`): what a worker runs for a
//! [`TestTask`], which tests send to exercise the task path without a plan.

use std::time::Duration;

use floe_core::hash::xxh3_64;

use floe_api::node_protocol::TestTask;

/// Pages (4 KiB) a `Grow` task touches between two pauses of a millisecond: one MiB.
const GROW_PAGES_BETWEEN_PAUSES: usize = 256;

/// Why a test task failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TestTaskError {
    #[error("{bytes} bytes do not fit in this process's memory")]
    TooLarge { bytes: u64 },
}

/// A test task's outputs, written where the agent says like a stage task's.
#[derive(Debug)]
pub(crate) enum TestOutputs {
    None,
    /// One output of these bytes.
    Bytes(Vec<u8>),
    /// One output of `len` bytes of the fill pattern, computed in place; a pause of `stall`
    /// halfway through the writing, when set.
    Fill {
        len: usize,
        seed: u64,
        stall: Option<Duration>,
    },
}

impl TestOutputs {
    pub(crate) fn sizes(&self) -> Vec<u64> {
        match self {
            TestOutputs::None => Vec::new(),
            TestOutputs::Bytes(bytes) => vec![bytes.len() as u64],
            TestOutputs::Fill { len, .. } => vec![*len as u64],
        }
    }

    /// Writes the one output into `dest`, exactly its size, and returns its xxh3-64.
    pub(crate) fn write(&self, dest: &mut [u8]) -> u64 {
        match self {
            TestOutputs::None => {}
            TestOutputs::Bytes(bytes) => dest.copy_from_slice(bytes),
            TestOutputs::Fill { seed, stall, .. } => {
                let half = dest.len() / 2;
                fill(&mut dest[..half], 0, *seed);
                if let Some(stall) = stall {
                    std::thread::sleep(*stall);
                }
                fill(&mut dest[half..], half, *seed);
            }
        }
        xxh3_64(dest)
    }
}

/// Byte `i` of `dest` is byte `start + i` of the fill pattern: `(i + seed) % 251`.
fn fill(dest: &mut [u8], start: usize, seed: u64) {
    let seed = seed % 251;
    for (i, byte) in (start..).zip(dest.iter_mut()) {
        *byte = ((i as u64 % 251 + seed) % 251) as u8;
    }
}

/// Runs `task` over the inputs' bytes and returns its outputs, to be written.
pub(crate) fn run(task: &TestTask, inputs: &[&[u8]]) -> Result<TestOutputs, TestTaskError> {
    let length = |bytes: u64| usize::try_from(bytes).map_err(|_| TestTaskError::TooLarge { bytes });
    match task {
        TestTask::Sleep { ms } => {
            std::thread::sleep(Duration::from_millis(*ms));
            Ok(TestOutputs::None)
        }
        TestTask::Hash => Ok(TestOutputs::Bytes(
            inputs
                .iter()
                .flat_map(|input| xxh3_64(input).to_le_bytes())
                .collect(),
        )),
        TestTask::Fill { bytes, seed } => Ok(TestOutputs::Fill {
            len: length(*bytes)?,
            seed: *seed,
            stall: None,
        }),
        TestTask::Grow { bytes } => {
            let mut memory = vec![0u8; length(*bytes)?];
            // Written, so every page is resident; read back, so the writes are not elided. A
            // pause after each MiB keeps the growth near 1 GiB/s however fast the host faults
            // pages in, so a memory monitor sampling every 20 ms sees it before it runs far.
            for (index, page) in memory.chunks_mut(4096).enumerate() {
                page[0] = 1;
                if index % GROW_PAGES_BETWEEN_PAUSES == GROW_PAGES_BETWEEN_PAUSES - 1 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            let touched: usize = memory
                .iter()
                .step_by(4096)
                .map(|byte| usize::from(*byte))
                .sum();
            std::hint::black_box(touched);
            Ok(TestOutputs::None)
        }
        TestTask::StallMidWrite { bytes, seed, ms } => Ok(TestOutputs::Fill {
            len: length(*bytes)?,
            seed: *seed,
            stall: Some(Duration::from_millis(*ms)),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(outputs: &TestOutputs) -> Vec<u8> {
        let mut bytes = vec![0; outputs.sizes()[0] as usize];
        let checksum = outputs.write(&mut bytes);
        assert_eq!(checksum, xxh3_64(&bytes));
        bytes
    }

    #[test]
    fn hash_outputs_each_inputs_checksum() {
        let outputs = run(&TestTask::Hash, &[b"abc", b""]).unwrap();
        let mut expected = xxh3_64(b"abc").to_le_bytes().to_vec();
        expected.extend(xxh3_64(b"").to_le_bytes());
        assert_eq!(written(&outputs), expected);
    }

    #[test]
    fn fill_follows_its_documented_pattern_stalled_or_not() {
        let fill = TestTask::Fill {
            bytes: 600,
            seed: 3,
        };
        let bytes = written(&run(&fill, &[]).unwrap());
        assert_eq!(bytes.len(), 600);
        assert_eq!(&bytes[..3], &[3, 4, 5]);
        assert_eq!(bytes[248], 0, "(248 + 3) % 251");
        assert_eq!(bytes[599], ((599 + 3) % 251) as u8);
        let stalled = TestTask::StallMidWrite {
            bytes: 600,
            seed: 3,
            ms: 1,
        };
        assert_eq!(written(&run(&stalled, &[]).unwrap()), bytes);
    }

    #[test]
    fn a_sleep_has_no_outputs() {
        let outputs = run(&TestTask::Sleep { ms: 0 }, &[]).unwrap();
        assert!(outputs.sizes().is_empty());
    }
}
