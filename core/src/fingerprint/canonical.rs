//! The canonical byte encoding that fingerprints hash.
//!
//! Every hash starts with a domain string naming what is hashed (a transform, a file source, an
//! argument…), so two different kinds of input can never produce the same byte stream. Integers
//! are fixed-width little-endian; byte strings and sequences are prefixed with their length, so
//! `("ab", "c")` and `("a", "bc")` encode differently.

use crate::hash::Xxh3_128;

use super::Fingerprint;

pub(crate) struct CanonicalHasher(Xxh3_128);

impl CanonicalHasher {
    pub(crate) fn new(domain: &str) -> Self {
        let mut hasher = Self(Xxh3_128::new());
        hasher.bytes(domain.as_bytes());
        hasher
    }

    pub(crate) fn tag(&mut self, tag: u8) {
        self.0.update(&[tag]);
    }

    pub(crate) fn u32(&mut self, value: u32) {
        self.0.update(&value.to_le_bytes());
    }

    pub(crate) fn u64(&mut self, value: u64) {
        self.0.update(&value.to_le_bytes());
    }

    pub(crate) fn i64(&mut self, value: i64) {
        self.0.update(&value.to_le_bytes());
    }

    /// A length; `usize` is widened so 32- and 64-bit hosts agree.
    pub(crate) fn len(&mut self, len: usize) {
        self.u64(len as u64);
    }

    pub(crate) fn bytes(&mut self, bytes: &[u8]) {
        self.len(bytes.len());
        self.0.update(bytes);
    }

    /// Part of a byte string whose length was fed first (with [`CanonicalHasher::len`]), so a
    /// large file can be hashed as it is read, to the same hash [`CanonicalHasher::bytes`] gives.
    pub(crate) fn bytes_part(&mut self, part: &[u8]) {
        self.0.update(part);
    }

    pub(crate) fn fingerprint(&mut self, fingerprint: Fingerprint) {
        self.0.update(&fingerprint.get().to_le_bytes());
    }

    pub(crate) fn finish(&self) -> Fingerprint {
        Fingerprint::new(self.0.digest())
    }
}
