//! The one place that turns messages into bytes and back.
//!
//! bincode 1.3.3 is pinned (DESIGN.md) with one fixed option set: little-endian, variable-length
//! integers, trailing bytes rejected, and a byte limit equal to the input on decode. A string
//! or byte buffer is allocated only once its bytes are known to be in the input; a sequence's
//! claimed length may make serde preallocate, but serde caps that at 1 MiB, which is why the
//! frame limit (`net.max_frame`) is at least 1 MiB: no input makes a decoder allocate more
//! than the frame limit in one piece. Every value decodes through [`super::depth::Depth`], so no
//! input nests deeper than [`MAX_SERDE_DEPTH`] levels, whatever its types. Swapping the codec
//! means changing only this file, and keeping the layout [`encode_len`] describes.

use bincode::Options;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::WireError;
use super::depth::{Bounded, MAX_SERDE_DEPTH};

fn options() -> impl Options {
    bincode::DefaultOptions::new()
        .with_little_endian()
        .with_varint_encoding()
        .reject_trailing_bytes()
}

/// Appends the encoding of `value` to `out`, so callers can reuse one buffer per connection.
pub fn encode_into<T: Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> Result<(), WireError> {
    options()
        .serialize_into(out, value)
        .map_err(|error| WireError::Encode(error.to_string()))
}

/// Appends the length prefix of a map or sequence of `len` entries.
///
/// A struct encodes as its fields' encodings one after another, and a map as this prefix
/// followed by each key's encoding and then its value's. `floe_api`'s snapshot encoder
/// relies on both to copy the unchanged job records' bytes from the last snapshot; its test
/// compares the result with [`encode`]'s.
pub fn encode_len(len: usize, out: &mut Vec<u8>) -> Result<(), WireError> {
    encode_into(&(len as u64), out)
}

pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::new();
    encode_into(value, &mut out)?;
    Ok(out)
}

/// Decodes exactly one value that must fill `bytes`; `what` names it in the error.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], what: &'static str) -> Result<T, WireError> {
    decode_within(bytes, what, MAX_SERDE_DEPTH)
}

/// [`decode`] with `max_depth` levels of serde nesting allowed instead of [`MAX_SERDE_DEPTH`].
pub(crate) fn decode_within<T: DeserializeOwned>(
    bytes: &[u8],
    what: &'static str,
    max_depth: u32,
) -> Result<T, WireError> {
    options()
        .with_limit(bytes.len() as u64)
        .deserialize_seed(Bounded::<T>::new(max_depth), bytes)
        .map_err(|error| WireError::Decode {
            what,
            message: error.to_string(),
        })
}
