//! The test-only task kinds (feature `test-tasks`): what a worker runs for a
//! [`TestTask`], which tests send to exercise the task path without a plan.

use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64;

use floe_api::node_protocol::TestTask;

/// Why a test task failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TestTaskError {
    #[error("{bytes} bytes do not fit in this process's memory")]
    TooLarge { bytes: u64 },
}

/// Runs `task` over the inputs' bytes and returns its outputs' bytes.
pub(crate) fn run(task: &TestTask, inputs: &[&[u8]]) -> Result<Vec<Vec<u8>>, TestTaskError> {
    match task {
        TestTask::Sleep { ms } => {
            std::thread::sleep(Duration::from_millis(*ms));
            Ok(Vec::new())
        }
        TestTask::Hash => Ok(vec![
            inputs
                .iter()
                .flat_map(|input| xxh3_64(input).to_le_bytes())
                .collect(),
        ]),
        TestTask::Fill { bytes, seed } => {
            let len =
                usize::try_from(*bytes).map_err(|_| TestTaskError::TooLarge { bytes: *bytes })?;
            let start = seed % 251;
            Ok(vec![
                (0..len)
                    .map(|i| ((i as u64 % 251 + start) % 251) as u8)
                    .collect(),
            ])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_outputs_each_inputs_checksum() {
        let outputs = run(&TestTask::Hash, &[b"abc", b""]).unwrap();
        let mut expected = xxh3_64(b"abc").to_le_bytes().to_vec();
        expected.extend(xxh3_64(b"").to_le_bytes());
        assert_eq!(outputs, vec![expected]);
    }

    #[test]
    fn fill_follows_its_documented_pattern() {
        let outputs = run(
            &TestTask::Fill {
                bytes: 600,
                seed: 3,
            },
            &[],
        )
        .unwrap();
        assert_eq!(outputs[0].len(), 600);
        assert_eq!(&outputs[0][..3], &[3, 4, 5]);
        assert_eq!(outputs[0][248], 0, "(248 + 3) % 251");
        assert_eq!(outputs[0][599], ((599 + 3) % 251) as u8);
    }
}
