//! Newtype identifiers.
//!
//! Ids the scheduler hands out in sequence (nodes, jobs) are `u64`s shown in decimal. Ids that
//! many processes mint independently (tasks, objects, actors) are 128-bit values shown as 32
//! lowercase hex digits, so they can be created without coordination and still never collide
//! in practice. `Display` and `FromStr` round-trip exactly.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// An id string that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind} {input:?}: expected {expected}")]
pub struct IdError {
    pub kind: &'static str,
    pub input: String,
    pub expected: &'static str,
}

macro_rules! sequential_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(u64);

        impl $name {
            pub const fn new(value: u64) -> Self {
                Self(value)
            }

            pub const fn get(self) -> u64 {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }

        impl FromStr for $name {
            type Err = IdError;

            fn from_str(input: &str) -> Result<Self, IdError> {
                // `u64::from_str` accepts a leading '+', which Display never writes.
                if input.starts_with('+') {
                    return Err(IdError { kind: $kind, input: input.to_owned(), expected: "a decimal number" });
                }
                input.parse().map(Self).map_err(|_| IdError {
                    kind: $kind,
                    input: input.to_owned(),
                    expected: "a decimal number",
                })
            }
        }
    };
}

/// 128 random bits from the OS. Ids need uniqueness, not secrecy, so if the OS source fails
/// the bits come from hashing the clock, the pid and a process-wide counter instead.
fn random_u128() -> u128 {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_ok() {
        return u128::from_le_bytes(bytes);
    }
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos());
    let count = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut seed = Vec::with_capacity(28);
    seed.extend(nanos.to_le_bytes());
    seed.extend(std::process::id().to_le_bytes());
    seed.extend(count.to_le_bytes());
    crate::hash::xxh3_128(&seed)
}

macro_rules! unique_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(u128);

        impl $name {
            pub const fn new(value: u128) -> Self {
                Self(value)
            }

            pub const fn get(self) -> u128 {
                self.0
            }

            /// A fresh id, unique without coordination.
            pub fn random() -> Self {
                Self(random_u128())
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:032x}", self.0)
            }
        }

        impl FromStr for $name {
            type Err = IdError;

            fn from_str(input: &str) -> Result<Self, IdError> {
                let well_formed = input.len() == 32
                    && input.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
                let error = || IdError {
                    kind: $kind,
                    input: input.to_owned(),
                    expected: "32 lowercase hex digits",
                };
                if !well_formed {
                    return Err(error());
                }
                u128::from_str_radix(input, 16).map(Self).map_err(|_| error())
            }
        }
    };
}

sequential_id!(
    /// A node agent, numbered by the scheduler when it registers.
    NodeId,
    "node id"
);
sequential_id!(
    /// A submitted job, numbered by the scheduler when it is committed.
    JobId,
    "job id"
);
unique_id!(
    /// One task. Its retries and lineage rebuilds run under the same id, so the outputs (whose
    /// ids derive from it) keep their object ids.
    TaskId,
    "task id"
);
unique_id!(
    /// An immutable object (usually an Arrow block) in some node's object store.
    ObjectId,
    "object id"
);
unique_id!(
    /// A client's name for one submission, so a submission retried after a lost reply is
    /// committed once.
    SubmissionId,
    "submission id"
);
unique_id!(
    /// A long-lived actor (job driver, shuffle aggregator), addressable cluster-wide.
    ActorId,
    "actor id"
);
unique_id!(
    /// A resource lease the scheduler's leader granted a job's driver on one node. Random, so
    /// a lease keeps its id across a leader change (its driver names it to the new leader).
    LeaseId,
    "lease id"
);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn sequential_ids_round_trip(value: u64) {
            let id = NodeId::new(value);
            prop_assert_eq!(id.to_string().parse::<NodeId>(), Ok(id));
            let id = JobId::new(value);
            prop_assert_eq!(id.to_string().parse::<JobId>(), Ok(id));
        }

        #[test]
        fn unique_ids_round_trip(value: u128) {
            let id = ObjectId::new(value);
            let shown = id.to_string();
            prop_assert_eq!(shown.len(), 32);
            prop_assert_eq!(shown.parse::<ObjectId>(), Ok(id));
            prop_assert_eq!(TaskId::new(value).to_string().parse::<TaskId>(), Ok(TaskId::new(value)));
            prop_assert_eq!(ActorId::new(value).to_string().parse::<ActorId>(), Ok(ActorId::new(value)));
        }

        #[test]
        fn arbitrary_text_never_panics(text in ".{0,40}") {
            let _ = text.parse::<NodeId>();
            let _ = text.parse::<ActorId>();
        }
    }

    #[test]
    fn display_is_fixed() {
        assert_eq!(NodeId::new(42).to_string(), "42");
        assert_eq!(
            ObjectId::new(0xabc).to_string(),
            "00000000000000000000000000000abc"
        );
    }

    #[test]
    fn malformed_ids_are_rejected_with_their_kind() {
        let error = "+5".parse::<JobId>().unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid job id \"+5\": expected a decimal number"
        );
        // Uppercase, short, long and non-hex forms are all refused, so each id has one spelling.
        for bad in [
            "00000000000000000000000000000ABC",
            "abc",
            &"0".repeat(33),
            &"g".repeat(32),
        ] {
            let error = bad.parse::<ObjectId>().unwrap_err();
            assert_eq!(error.kind, "object id");
            assert_eq!(error.expected, "32 lowercase hex digits");
        }
    }
}
