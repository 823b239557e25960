//! The built-in task kinds a worker runs without a plan, for tests and benchmarks.

use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64;

use floe_api::node_protocol::TaskKind;

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
}
