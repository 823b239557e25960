//! What a worker process does with a task, and how its outputs are named.

use std::time::Duration;

use floe_core::{ObjectId, TaskId};
use xxhash_rust::xxh3::{xxh3_64, xxh3_128};

use super::protocol::TaskKind;

/// The id of a task's `index`-th output: derived from the task id (as Ray derives return
/// object ids), so a retried task names its outputs the same way.
pub fn output_id(task: TaskId, index: u32) -> ObjectId {
    let mut seed = [0u8; 20];
    seed[..16].copy_from_slice(&task.get().to_le_bytes());
    seed[16..].copy_from_slice(&index.to_le_bytes());
    ObjectId::new(xxh3_128(&seed))
}

/// Runs `kind` over the inputs' bytes and returns its outputs' bytes.
pub fn execute(kind: &TaskKind, inputs: &[&[u8]]) -> Result<Vec<Vec<u8>>, String> {
    match kind {
        TaskKind::Stage(_) => Err("a stage task is not a built-in task".to_owned()),
        TaskKind::Sleep { ms } => {
            std::thread::sleep(Duration::from_millis(*ms));
            Ok(Vec::new())
        }
        TaskKind::Hash => Ok(vec![
            inputs
                .iter()
                .flat_map(|input| xxh3_64(input).to_le_bytes())
                .collect(),
        ]),
        TaskKind::Fill { bytes, seed } => {
            let len = usize::try_from(*bytes)
                .map_err(|_| format!("{bytes} bytes do not fit in this process's memory"))?;
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
        let outputs = execute(&TaskKind::Hash, &[b"abc", b""]).unwrap();
        let mut expected = xxh3_64(b"abc").to_le_bytes().to_vec();
        expected.extend(xxh3_64(b"").to_le_bytes());
        assert_eq!(outputs, vec![expected]);
    }

    #[test]
    fn fill_follows_its_documented_pattern() {
        let outputs = execute(
            &TaskKind::Fill {
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

    #[test]
    fn output_ids_differ_by_task_and_index_and_are_stable() {
        let a = TaskId::new(1);
        let b = TaskId::new(2);
        assert_eq!(output_id(a, 0), output_id(a, 0));
        assert_ne!(output_id(a, 0), output_id(a, 1));
        assert_ne!(output_id(a, 0), output_id(b, 0));
    }
}
