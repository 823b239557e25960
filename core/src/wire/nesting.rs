//! A bound on how deeply a decoded value may nest.
//!
//! Plans and expressions are trees, and serde decodes a tree by recursion: bytes that nest a
//! million levels deep (a few megabytes, under the frame limit) would exhaust a thread's
//! stack and abort the process — a scheduler replica parsing a submission, or a node running
//! a driver. The recursive types (plan nodes, expressions, fingerprint argument values) count
//! their depth while decoding, in a thread-local counter (serde passes no context), and
//! refuse to go past [`MAX_DECODE_NESTING`].

use std::cell::Cell;
use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer};

/// The deepest nesting of plan nodes and expressions, counted together, that a decoder
/// accepts: exactly what a plan may hold ([`crate::plan::MAX_PLAN_DEPTH`] steps, the deepest
/// with an expression of [`crate::plan::MAX_EXPR_DEPTH`] levels), so every plan that can be
/// built decodes, and nothing deeper is walked. Shallow enough that decoding and the
/// recursive passes over the result stay well inside a 2 MiB thread stack.
pub const MAX_DECODE_NESTING: u32 = crate::plan::MAX_PLAN_DEPTH + crate::plan::MAX_EXPR_DEPTH;

thread_local! {
    static NESTING: Cell<u32> = const { Cell::new(0) };
}

/// One level of nesting, held while its contents decode.
pub(crate) struct Nested(());

impl Nested {
    pub(crate) fn enter<E: serde::de::Error>() -> Result<Self, E> {
        NESTING.with(|nesting| {
            let depth = nesting.get();
            if depth >= MAX_DECODE_NESTING {
                return Err(E::custom(format!(
                    "the value nests more than {MAX_DECODE_NESTING} levels deep"
                )));
            }
            nesting.set(depth + 1);
            Ok(Nested(()))
        })
    }
}

impl Drop for Nested {
    fn drop(&mut self) {
        NESTING.with(|nesting| nesting.set(nesting.get().saturating_sub(1)));
    }
}

/// `deserialize_with` for a boxed child of a recursive type.
pub(crate) fn nested_box<'de, D, T>(deserializer: D) -> Result<Box<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    let _level = Nested::enter()?;
    Box::<T>::deserialize(deserializer)
}

/// `deserialize_with` for the children list of a recursive type.
pub(crate) fn nested_vec<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    let _level = Nested::enter()?;
    Vec::<T>::deserialize(deserializer)
}

/// `deserialize_with` for the entries of a recursive map.
pub(crate) fn nested_map<'de, D, T>(deserializer: D) -> Result<BTreeMap<String, T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    let _level = Nested::enter()?;
    BTreeMap::<String, T>::deserialize(deserializer)
}
