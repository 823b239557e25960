//! The guard against the CVE's payload and other malformed bytes, and a seeded fuzzer of the
//! whole path (guard, then protobuf) that `cargo fuzz` would otherwise be.

use std::time::{Duration, Instant};

use protobuf::Message as _;
use raft::prelude::{ConfState, Entry, EntryType, Message, MessageType, Snapshot};

use super::{RaftGuard, RaftGuardError};

const REPLICAS: [u64; 3] = [1, 2, 3];
const MAX_BYTES: usize = 1 << 20;

fn guard() -> RaftGuard {
    RaftGuard::new(MAX_BYTES, REPLICAS)
}

/// xorshift64*: deterministic, so a failing case is reproducible from its index.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound.max(1)
    }

    fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }

    fn bytes(&mut self, max_len: usize) -> Vec<u8> {
        let len = self.index(max_len + 1);
        (0..len).map(|_| self.next() as u8).collect()
    }

    fn small_or_large(&mut self) -> u64 {
        match self.below(3) {
            0 => self.below(4),
            1 => self.below(1 << 20),
            _ => self.next(),
        }
    }
}

fn message_type(value: u64) -> MessageType {
    use MessageType::*;
    [
        MsgHup,
        MsgBeat,
        MsgPropose,
        MsgAppend,
        MsgAppendResponse,
        MsgRequestVote,
        MsgRequestVoteResponse,
        MsgSnapshot,
        MsgHeartbeat,
        MsgHeartbeatResponse,
        MsgUnreachable,
        MsgSnapStatus,
        MsgCheckQuorum,
        MsgTransferLeader,
        MsgTimeoutNow,
        MsgReadIndex,
        MsgReadIndexResp,
        MsgRequestPreVote,
        MsgRequestPreVoteResponse,
    ][value as usize % 19]
}

/// A message using every field of every type a `Message` holds, with random values.
fn random_message(rng: &mut Rng) -> Message {
    let mut message = Message {
        msg_type: message_type(rng.next()),
        to: REPLICAS[rng.index(3)],
        from: REPLICAS[rng.index(3)],
        term: rng.small_or_large(),
        log_term: rng.small_or_large(),
        index: rng.small_or_large(),
        commit: rng.small_or_large(),
        commit_term: rng.small_or_large(),
        request_snapshot: rng.small_or_large(),
        reject: rng.below(2) == 1,
        reject_hint: rng.small_or_large(),
        context: rng.bytes(8).into(),
        deprecated_priority: rng.small_or_large(),
        priority: rng.small_or_large() as i64,
        ..Message::default()
    };
    for _ in 0..rng.below(4) {
        message.entries.push(Entry {
            entry_type: [
                EntryType::EntryNormal,
                EntryType::EntryConfChange,
                EntryType::EntryConfChangeV2,
            ][rng.index(3)],
            term: rng.small_or_large(),
            index: rng.small_or_large(),
            data: rng.bytes(24).into(),
            context: rng.bytes(4).into(),
            sync_log: rng.below(2) == 1,
            ..Entry::default()
        });
    }
    if rng.below(2) == 1 {
        let mut snapshot = Snapshot {
            data: rng.bytes(32).into(),
            ..Snapshot::default()
        };
        let metadata = snapshot.mut_metadata();
        metadata.index = rng.small_or_large();
        metadata.term = rng.small_or_large();
        let ids = |rng: &mut Rng| (0..rng.below(4)).map(|_| rng.small_or_large()).collect();
        metadata.set_conf_state(ConfState {
            voters: ids(rng),
            learners: ids(rng),
            voters_outgoing: ids(rng),
            learners_next: ids(rng),
            auto_leave: rng.below(2) == 1,
            ..ConfState::default()
        });
        message.set_snapshot(snapshot);
    }
    message
}

fn encode(message: &Message) -> Vec<u8> {
    message.write_to_bytes().expect("a message encodes")
}

/// A valid encoding damaged one of several ways.
fn mutate(rng: &mut Rng, mut bytes: Vec<u8>, other: &[u8]) -> Vec<u8> {
    for _ in 0..=rng.below(3) {
        match rng.below(6) {
            0 if !bytes.is_empty() => {
                let at = rng.index(bytes.len());
                bytes[at] ^= 1 << rng.below(8);
            }
            1 => bytes.truncate(rng.index(bytes.len() + 1)),
            2 => {
                // Splice: a prefix of this encoding and a suffix of another.
                let keep = rng.index(bytes.len() + 1);
                let from = rng.index(other.len() + 1);
                bytes.truncate(keep);
                bytes.extend_from_slice(&other[from..]);
            }
            3 => {
                let at = rng.index(bytes.len() + 1);
                bytes.insert(at, rng.next() as u8);
            }
            4 if !bytes.is_empty() => {
                let at = rng.index(bytes.len());
                bytes.remove(at);
            }
            _ => {
                let at = rng.index(bytes.len() + 1);
                bytes.splice(at..at, rng.bytes(6));
            }
        }
    }
    bytes
}

/// `depth` start-group tags of field `field`, after `prefix`: the shape of CVE-2025-53605.
fn group_nest(prefix: &[u8], field: u64, depth: usize) -> Vec<u8> {
    let mut tag = Vec::new();
    let mut value = (field << 3) | 3;
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            tag.push(byte);
            break;
        }
        tag.push(byte | 0x80);
    }
    let mut bytes = prefix.to_vec();
    for _ in 0..depth {
        bytes.extend_from_slice(&tag);
    }
    bytes
}

#[test]
fn the_cve_payload_is_refused_before_protobuf_sees_it() {
    // 100k nested start groups of an unknown field: protobuf 2.28 recurses once per level.
    for field in [1, 7, 99, 1 << 20] {
        let payload = group_nest(&[], field, 100_000);
        let error = RaftGuard::new(usize::MAX, REPLICAS)
            .decode(&payload)
            .unwrap_err();
        assert!(
            matches!(
                error,
                RaftGuardError::Group {
                    wire_type: 3,
                    offset: 0
                } | RaftGuardError::UnknownField { offset: 0, .. }
            ),
            "field {field}: {error}"
        );
    }
    // Behind a valid prefix, and inside a nested entry, it is still refused.
    let valid = encode(&random_message(&mut Rng(7)));
    let error = guard()
        .decode(&group_nest(&valid, 99, 100_000))
        .unwrap_err();
    assert!(matches!(
        error,
        RaftGuardError::Group { .. } | RaftGuardError::UnknownField { .. }
    ));
    let mut inside_entry = vec![0x3a, 0x0a]; // field 7 (entries), 10 bytes
    inside_entry.extend(group_nest(&[], 2, 10));
    assert!(matches!(
        guard().decode(&inside_entry).unwrap_err(),
        RaftGuardError::Group {
            wire_type: 3,
            offset: 2
        }
    ));
}

#[test]
fn a_valid_message_from_a_replica_decodes_and_others_are_refused() {
    let mut message = random_message(&mut Rng(11));
    message.from = 2;
    assert_eq!(guard().decode(&encode(&message)).unwrap(), message);
    message.from = 9;
    assert_eq!(
        guard().decode(&encode(&message)).unwrap_err(),
        RaftGuardError::NotAReplica {
            from: 9,
            replicas: REPLICAS.to_vec()
        }
    );
}

#[test]
fn malformed_bytes_are_refused_with_the_rule_they_break() {
    let from_one = [0x18, 0x01]; // from = 1
    let cases: [(&[u8], RaftGuardError); 8] = [
        (
            &[0x18, 0x01, 0xf8, 0x07, 0x00], // field 127, varint
            RaftGuardError::UnknownField {
                message: "Message",
                number: 127,
                offset: 2,
            },
        ),
        (
            &[0x18, 0x01, 0x11, 0, 0, 0, 0, 0, 0, 0, 0], // to as fixed64
            RaftGuardError::WrongWireType {
                message: "Message",
                number: 2,
                wire_type: 1,
                offset: 2,
            },
        ),
        (
            &[0x18, 0x01, 0x08, 0x13], // msg_type 19
            RaftGuardError::UnknownEnumValue {
                message: "MessageType",
                value: 19,
                offset: 2,
            },
        ),
        (
            &[0x18, 0x01, 0x62, 0x05, 0x00], // context of 5 bytes, 1 present
            RaftGuardError::Truncated { offset: 3 },
        ),
        (
            // An entry whose `data` runs past the entry's end (but not the buffer's).
            &[
                0x18, 0x01, 0x3a, 0x04, 0x10, 0x01, 0x22, 0x05, 0, 0, 0, 0, 0,
            ],
            RaftGuardError::Truncated { offset: 7 },
        ),
        (
            &[
                0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,
            ],
            RaftGuardError::Varint { offset: 1 },
        ),
        (
            &[0x18, 0x01, 0x1c],
            RaftGuardError::Group {
                wire_type: 4,
                offset: 2,
            },
        ),
        (
            &[0x18, 0x01, 0x1e],
            RaftGuardError::InvalidWireType {
                wire_type: 6,
                offset: 2,
            },
        ),
    ];
    assert_eq!(guard().decode(&from_one).unwrap().from, 1);
    for (bytes, expected) in cases {
        assert_eq!(guard().decode(bytes).unwrap_err(), expected, "{bytes:02x?}");
    }
    let large = encode(&Message {
        from: 1,
        context: vec![0; 100].into(),
        ..Message::default()
    });
    assert_eq!(
        RaftGuard::new(64, REPLICAS).decode(&large).unwrap_err(),
        RaftGuardError::TooLarge {
            size: large.len(),
            max: 64
        }
    );
}

/// Feeds random bytes, damaged valid encodings and deep group nests through the guard and
/// protobuf: nothing panics or overflows the stack, and whatever is accepted encodes to bytes
/// that are accepted again and decode to the same message.
#[test]
fn fuzz_the_raft_message_path() {
    const CASES: u64 = 120_000;
    let started = Instant::now();
    let guard = guard();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut previous = encode(&random_message(&mut rng));
    let (mut accepted, mut refused_by_protobuf) = (0u64, 0u64);
    for case in 0..CASES {
        let valid = encode(&random_message(&mut rng));
        let input = match case % 100 {
            0 => {
                let depth = 1 + rng.index(100_000);
                let prefix = &valid[..rng.index(valid.len() + 1)];
                group_nest(prefix, rng.below(20), depth)
            }
            1..=30 => rng.bytes(48),
            31..=40 => valid.clone(),
            _ => mutate(&mut rng, valid.clone(), &previous),
        };
        previous = valid;
        match guard.decode(&input) {
            Ok(message) => {
                accepted += 1;
                let again = encode(&message);
                assert_eq!(
                    guard.decode(&again).as_ref(),
                    Ok(&message),
                    "case {case}: {input:02x?}"
                );
            }
            Err(RaftGuardError::Decode(_)) => refused_by_protobuf += 1,
            Err(_) => {}
        }
    }
    // Every valid encoding passes, and some damaged ones do too (a flipped value bit).
    assert!(accepted > CASES / 10, "only {accepted} accepted");
    // The guard is stricter than protobuf: whatever it lets through, protobuf reads.
    assert_eq!(refused_by_protobuf, 0);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "fuzzing took {:?}",
        started.elapsed()
    );
}
