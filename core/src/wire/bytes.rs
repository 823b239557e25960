//! Byte fields as one byte string: `#[serde(with = "floe_core::wire::bytes")]` on a `Vec<u8>`,
//! and [`list`] on a `Vec<Vec<u8>>`.
//!
//! serde sees a bare `Vec<u8>` as a sequence of `u8`s, so the codec writes and reads it one
//! byte at a time, a call per byte: a job spec in every `SubmitJob` entry and in every job of
//! a snapshot, and every Raft message between replicas. As a byte string it is one length and
//! one copy. bincode lays both out the same way (the length as a varint, then the bytes), so
//! the bytes on disk and on the wire do not change: a log or snapshot written before reads
//! the same. A self-describing format (JSON) writes a byte string as an array of numbers, as it
//! did the sequence, and that array reads back too.

use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_bytes(bytes)
}

pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
    deserializer.deserialize_byte_buf(ByteBufVisitor)
}

/// Bytes as a value of their own (object chunks on the wire, a list's items), encoded as
/// [`serialize`] writes a byte field.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bytes(#[serde(with = "crate::wire::bytes")] pub Vec<u8>);

/// A list of byte strings, each as [`serialize`] writes one.
pub mod list {
    use super::*;

    pub fn serialize<S: Serializer>(items: &[Vec<u8>], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(items.iter().map(|item| ByteStr(item)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Vec<Vec<u8>>, D::Error> {
        deserializer.deserialize_seq(ListVisitor)
    }

    struct ByteStr<'a>(&'a [u8]);

    impl Serialize for ByteStr<'_> {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            serializer.serialize_bytes(self.0)
        }
    }

    struct ListVisitor;

    impl<'de> Visitor<'de> for ListVisitor {
        type Value = Vec<Vec<u8>>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of byte strings")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            let items: Vec<Bytes> = collect(seq)?;
            Ok(items.into_iter().map(|Bytes(item)| item).collect())
        }
    }
}

/// Every element of `seq`. A claimed length preallocates no more than 4,096 of them; the rest
/// grow as they come, so a peer's claim allocates nothing it does not send.
fn collect<'de, T: Deserialize<'de>, A: SeqAccess<'de>>(mut seq: A) -> Result<Vec<T>, A::Error> {
    let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
    while let Some(item) = seq.next_element()? {
        items.push(item);
    }
    Ok(items)
}

struct ByteBufVisitor;

impl<'de> Visitor<'de> for ByteBufVisitor {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a byte string")
    }

    fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<Vec<u8>, E> {
        Ok(bytes.to_vec())
    }

    fn visit_byte_buf<E: serde::de::Error>(self, bytes: Vec<u8>) -> Result<Vec<u8>, E> {
        Ok(bytes)
    }

    /// JSON's form of a byte string: an array of numbers.
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Vec<u8>, A::Error> {
        collect(seq)
    }
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    use crate::wire::codec;

    /// The serde default: a sequence of single bytes.
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct AsSequence {
        head: u32,
        bytes: Vec<u8>,
        lists: Vec<Vec<u8>>,
        tail: Option<u64>,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct AsString {
        head: u32,
        #[serde(with = "super")]
        bytes: Vec<u8>,
        #[serde(with = "super::list")]
        lists: Vec<Vec<u8>>,
        tail: Option<u64>,
    }

    fn both(len: usize) -> (AsSequence, AsString) {
        let bytes: Vec<u8> = (0..len).map(|at| (at * 7 + 3) as u8).collect();
        let lists = vec![Vec::new(), bytes.clone(), vec![0xff; 251]];
        (
            AsSequence {
                head: 300,
                bytes: bytes.clone(),
                lists: lists.clone(),
                tail: Some(u64::MAX),
            },
            AsString {
                head: 300,
                bytes,
                lists,
                tail: Some(u64::MAX),
            },
        )
    }

    /// Lengths around the varint's one-byte and two-byte limits, and a long one.
    const LENGTHS: [usize; 7] = [0, 1, 250, 251, 252, 65_536, 1 << 20];

    #[test]
    fn a_byte_string_encodes_to_the_bytes_of_the_sequence_and_each_reads_the_other() {
        for len in LENGTHS {
            let (sequence, string) = both(len);
            let old = codec::encode(&sequence).unwrap();
            let new = codec::encode(&string).unwrap();
            assert_eq!(old, new, "length {len}");
            assert_eq!(codec::decode::<AsString>(&old, "test").unwrap(), string);
            assert_eq!(codec::decode::<AsSequence>(&new, "test").unwrap(), sequence);
        }
    }

    #[test]
    fn a_byte_string_cut_short_is_refused() {
        let (_, string) = both(300);
        let encoded = codec::encode(&string).unwrap();
        for cut in [1, 2, 100, encoded.len() - 1] {
            assert!(codec::decode::<AsString>(&encoded[..cut], "test").is_err());
        }
    }

    #[test]
    fn json_writes_a_byte_string_as_the_array_it_wrote_before_and_reads_it_back() {
        let (sequence, string) = both(300);
        let old = serde_json::to_string(&sequence).unwrap();
        let new = serde_json::to_string(&string).unwrap();
        assert_eq!(old, new);
        assert_eq!(serde_json::from_str::<AsString>(&old).unwrap(), string);
        assert!(
            serde_json::from_str::<AsString>(r#"{"head":1,"bytes":[256],"lists":[],"tail":null}"#)
                .is_err()
        );
    }
}
