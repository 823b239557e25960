//! What a Raft message from a peer must look like before protobuf sees it.
//!
//! raft 0.7 decodes with protobuf 2.28, whose parser skips unknown groups by recursion
//! (CVE-2025-53605): a few hundred KiB of nested start-group tags overflow the replica's
//! stack. Switching raft to `prost-codec` is not an option: prost-build 0.11 needs a `protoc`
//! binary a fresh machine lacks, and raft-proto links protobuf 2 either way. So every message
//! is first checked, without recursion, against eraftpb's schema (`Message`, `Entry`,
//! `Snapshot`, `SnapshotMetadata`, `ConfState`, the only types a `Message` holds): no group
//! wire type, no unknown field, no enum value the schema lacks, no length past its enclosing
//! message, nesting no deeper than the schema's and no message over the size cap. Only then
//! is it parsed, and the parsed message must come from a configured replica.

use std::collections::BTreeSet;

use protobuf::Message as _;
use raft::prelude::Message;

/// The deepest nesting eraftpb allows: Message → Snapshot → SnapshotMetadata → ConfState.
const MAX_NESTING: usize = 4;
/// The longest varint protobuf encodes (a 64-bit value in 7-bit groups).
const MAX_VARINT_BYTES: usize = 10;
/// The largest value of `MessageType` and of `EntryType`.
const MAX_MESSAGE_TYPE: u64 = 18;
const MAX_ENTRY_TYPE: u64 = 2;

/// Why a peer's Raft message was refused before it reached Raft.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RaftGuardError {
    #[error("a {size}-byte raft message is over the {max}-byte limit")]
    TooLarge { size: usize, max: usize },
    #[error("group wire type {wire_type} at byte {offset} (groups are not part of eraftpb)")]
    Group { wire_type: u64, offset: usize },
    #[error("invalid wire type {wire_type} at byte {offset}")]
    InvalidWireType { wire_type: u64, offset: usize },
    #[error("field {number} at byte {offset} is not a field of eraftpb.{message}")]
    UnknownField {
        message: &'static str,
        number: u64,
        offset: usize,
    },
    #[error("field {number} of eraftpb.{message} at byte {offset} has wire type {wire_type}")]
    WrongWireType {
        message: &'static str,
        number: u64,
        wire_type: u64,
        offset: usize,
    },
    #[error("enum value {value} at byte {offset} is not one of eraftpb.{message}'s")]
    UnknownEnumValue {
        message: &'static str,
        value: u64,
        offset: usize,
    },
    #[error("malformed varint at byte {offset}")]
    Varint { offset: usize },
    #[error("a length at byte {offset} runs past the end of its message")]
    Truncated { offset: usize },
    #[error("nesting deeper than eraftpb's {MAX_NESTING} levels at byte {offset}")]
    TooDeep { offset: usize },
    #[error("undecodable raft message: {0}")]
    Decode(String),
    #[error("a raft message from {from}, which is not a configured replica ({replicas:?})")]
    NotAReplica { from: u64, replicas: Vec<u64> },
}

/// The replica's check on incoming Raft messages (see the module docs).
#[derive(Debug, Clone)]
pub struct RaftGuard {
    max_message_bytes: usize,
    replicas: BTreeSet<u64>,
}

impl RaftGuard {
    /// Accepts messages up to `max_message_bytes` from the replicas `replicas`.
    pub fn new(max_message_bytes: usize, replicas: impl IntoIterator<Item = u64>) -> Self {
        Self {
            max_message_bytes,
            replicas: replicas.into_iter().collect(),
        }
    }

    /// `bytes` decoded, if they pass the schema check and come from a configured replica.
    pub fn decode(&self, bytes: &[u8]) -> Result<Message, RaftGuardError> {
        if bytes.len() > self.max_message_bytes {
            return Err(RaftGuardError::TooLarge {
                size: bytes.len(),
                max: self.max_message_bytes,
            });
        }
        validate(bytes)?;
        let message = Message::parse_from_bytes(bytes)
            .map_err(|error| RaftGuardError::Decode(error.to_string()))?;
        if !self.replicas.contains(&message.from) {
            return Err(RaftGuardError::NotAReplica {
                from: message.from,
                replicas: self.replicas.iter().copied().collect(),
            });
        }
        Ok(message)
    }
}

/// The eraftpb message types a `Message` contains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Schema {
    Message,
    Entry,
    Snapshot,
    SnapshotMetadata,
    ConfState,
}

/// How a field is encoded.
#[derive(Debug, Clone, Copy)]
enum Field {
    /// An integer or bool: wire type 0.
    Varint,
    /// An enum: wire type 0, at most the largest value the schema names.
    Enum(u64),
    /// `bytes`: wire type 2, opaque.
    Bytes,
    /// A nested message: wire type 2.
    Nested(Schema),
    /// `repeated uint64`: wire type 0 one at a time, or 2 packed.
    RepeatedVarint,
}

impl Schema {
    fn name(self) -> &'static str {
        match self {
            Schema::Message => "Message",
            Schema::Entry => "Entry",
            Schema::Snapshot => "Snapshot",
            Schema::SnapshotMetadata => "SnapshotMetadata",
            Schema::ConfState => "ConfState",
        }
    }

    /// The field numbered `number`, as `eraftpb.proto` (raft-proto 0.7) declares it.
    fn field(self, number: u64) -> Option<Field> {
        use Field::{Bytes, Enum, Nested, RepeatedVarint, Varint};
        Some(match (self, number) {
            (Schema::Message, 1) => Enum(MAX_MESSAGE_TYPE),
            (Schema::Message, 2..=6 | 8 | 10 | 11 | 13..=16) => Varint,
            (Schema::Message, 7) => Nested(Schema::Entry),
            (Schema::Message, 9) => Nested(Schema::Snapshot),
            (Schema::Message, 12) => Bytes,
            (Schema::Entry, 1) => Enum(MAX_ENTRY_TYPE),
            (Schema::Entry, 2 | 3 | 5) => Varint,
            (Schema::Entry, 4 | 6) => Bytes,
            (Schema::Snapshot, 1) => Bytes,
            (Schema::Snapshot, 2) => Nested(Schema::SnapshotMetadata),
            (Schema::SnapshotMetadata, 1) => Nested(Schema::ConfState),
            (Schema::SnapshotMetadata, 2 | 3) => Varint,
            (Schema::ConfState, 1..=4) => RepeatedVarint,
            (Schema::ConfState, 5) => Varint,
            _ => return None,
        })
    }
}

/// Checks `bytes` is an eraftpb `Message` in the subset of the wire format protobuf's
/// generated code reads without ever skipping a field. Iterative: the open messages are an
/// explicit stack bounded by the schema's depth.
fn validate(bytes: &[u8]) -> Result<(), RaftGuardError> {
    // (the message being read, the offset where it ends)
    let mut open: Vec<(Schema, usize)> = Vec::with_capacity(MAX_NESTING);
    open.push((Schema::Message, bytes.len()));
    let mut position = 0;
    while let Some(&(schema, end)) = open.last() {
        if position == end {
            open.pop();
            continue;
        }
        let offset = position;
        let tag = read_varint(bytes, &mut position, end)?;
        let (number, wire_type) = (tag >> 3, tag & 7);
        match wire_type {
            0 | 1 | 2 | 5 => {}
            3 | 4 => return Err(RaftGuardError::Group { wire_type, offset }),
            _ => return Err(RaftGuardError::InvalidWireType { wire_type, offset }),
        }
        let field = schema.field(number).ok_or(RaftGuardError::UnknownField {
            message: schema.name(),
            number,
            offset,
        })?;
        match (field, wire_type) {
            (Field::Varint | Field::RepeatedVarint, 0) => {
                read_varint(bytes, &mut position, end)?;
            }
            (Field::Enum(max), 0) => {
                let value = read_varint(bytes, &mut position, end)?;
                if value > max {
                    let message = match schema {
                        Schema::Message => "MessageType",
                        _ => "EntryType",
                    };
                    return Err(RaftGuardError::UnknownEnumValue {
                        message,
                        value,
                        offset,
                    });
                }
            }
            (Field::Bytes, 2) => {
                position = read_length(bytes, &mut position, end)?;
            }
            (Field::RepeatedVarint, 2) => {
                let packed_end = read_length(bytes, &mut position, end)?;
                while position < packed_end {
                    read_varint(bytes, &mut position, packed_end)?;
                }
            }
            (Field::Nested(inner), 2) => {
                let inner_end = read_length(bytes, &mut position, end)?;
                if open.len() == MAX_NESTING {
                    return Err(RaftGuardError::TooDeep { offset });
                }
                open.push((inner, inner_end));
            }
            _ => {
                return Err(RaftGuardError::WrongWireType {
                    message: schema.name(),
                    number,
                    wire_type,
                    offset,
                });
            }
        }
    }
    Ok(())
}

/// Reads a varint that ends before `end`: at most ten bytes, the tenth holding only the
/// 64th bit.
fn read_varint(bytes: &[u8], position: &mut usize, end: usize) -> Result<u64, RaftGuardError> {
    let offset = *position;
    let mut value = 0u64;
    for index in 0..MAX_VARINT_BYTES {
        let Some(&byte) = bytes.get(offset + index).filter(|_| offset + index < end) else {
            return Err(RaftGuardError::Varint { offset });
        };
        if index == MAX_VARINT_BYTES - 1 && byte > 1 {
            return Err(RaftGuardError::Varint { offset });
        }
        value |= u64::from(byte & 0x7f) << (7 * index);
        if byte & 0x80 == 0 {
            *position = offset + index + 1;
            return Ok(value);
        }
    }
    Err(RaftGuardError::Varint { offset })
}

/// Reads a length prefix and returns where the bytes it covers end, within `end`.
fn read_length(bytes: &[u8], position: &mut usize, end: usize) -> Result<usize, RaftGuardError> {
    let offset = *position;
    let length = read_varint(bytes, position, end)?;
    usize::try_from(length)
        .ok()
        .and_then(|length| position.checked_add(length))
        .filter(|stop| *stop <= end)
        .ok_or(RaftGuardError::Truncated { offset })
}

#[cfg(test)]
mod tests;
