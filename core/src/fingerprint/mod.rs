//! Fingerprints: content addresses for every dataset a plan can produce.
//!
//! A [`Fingerprint`] is a 128-bit xxh3 hash shown as 32 lowercase hex digits. Sources hash what
//! they read ([`SourceDescription`]); every transform hashes its parents' fingerprints, its id
//! and version, and its semantic arguments ([`update`], [`TransformDescription`]). Equal
//! fingerprints mean "the same output", so the cache can hand back an earlier result.
//!
//! The byte encoding fed to the hash is written by hand in [`canonical`] rather than by a
//! serializer: every value carries a type tag and every variable-length item a length prefix,
//! floats are hashed by bit pattern and maps are sorted, so the same plan hashes the same way in
//! every process, on every run, and with every future version of our dependencies. The golden
//! tests pin the encoding: changing it changes every fingerprint and must be a deliberate act.

mod args;
mod canonical;
mod inputs;
mod source;
#[cfg(test)]
mod tests;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub use args::{ArgRole, ArgValue, Args, HashedArg, Seed};
pub use inputs::{ArgChange, Difference, FingerprintInputs, TransformDescription};
pub use source::{FileDigest, FileStamp, SourceDescription};

/// A 128-bit xxh3 content address.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Fingerprint(u128);

impl Fingerprint {
    pub const fn new(value: u128) -> Self {
        Self(value)
    }

    pub const fn get(self) -> u128 {
        self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

impl FromStr for Fingerprint {
    type Err = FingerprintError;

    /// Accepts exactly the `Display` form, so every fingerprint has one spelling (it is also a
    /// file name).
    fn from_str(input: &str) -> Result<Self, FingerprintError> {
        let well_formed = input.len() == 32
            && input
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        let error = || FingerprintError::Malformed(input.to_owned());
        if !well_formed {
            return Err(error());
        }
        u128::from_str_radix(input, 16)
            .map(Self)
            .map_err(|_| error())
    }
}

/// Text formats (JSON manifests, TOML) get the hex string people see in file names; binary
/// formats get the bare `u128`.
impl Serialize for Fingerprint {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if serializer.is_human_readable() {
            serializer.collect_str(self)
        } else {
            serializer.serialize_u128(self.0)
        }
    }
}

impl<'de> Deserialize<'de> for Fingerprint {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        if deserializer.is_human_readable() {
            let text = String::deserialize(deserializer)?;
            text.parse().map_err(serde::de::Error::custom)
        } else {
            u128::deserialize(deserializer).map(Self)
        }
    }
}

/// Why a fingerprint could not be computed or parsed.
#[derive(Debug, thiserror::Error)]
pub enum FingerprintError {
    #[error("invalid fingerprint {0:?}: expected 32 lowercase hex digits")]
    Malformed(String),
    #[error("argument {name:?} is declared twice")]
    DuplicateArgument { name: String },
    #[error("cannot read source file {path}: {source}")]
    SourceFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot draw a random seed from the operating system: {0}")]
    Entropy(String),
}

/// The fingerprint of a transform's output: its parents' fingerprints (in order), its id and
/// version, and its semantic arguments sorted by name. Arguments equal to their declared
/// default and performance-only arguments are left out (see [`Args`]).
pub fn update(
    parents: &[Fingerprint],
    transform_id: &str,
    version: u32,
    args: &Args,
) -> Result<Fingerprint, FingerprintError> {
    let hashed = args.hashed()?;
    Ok(inputs::transform_fingerprint(
        parents,
        transform_id,
        version,
        &hashed,
    ))
}
