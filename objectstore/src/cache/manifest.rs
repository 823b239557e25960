//! The manifest every shard carries in its footer.

use std::fmt;

use arrow::datatypes::Schema;
use floe_core::Fingerprint;
use floe_core::fingerprint::FingerprintInputs;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{CacheError, Result};

/// The footer metadata key holding the manifest (JSON).
pub const MANIFEST_KEY: &str = "floe.cache.manifest";

/// What a shard claims to be; checked against the file whenever the shard is opened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub fingerprint: Fingerprint,
    pub rank: u32,
    pub count: u32,
    pub rows: u64,
    /// Bytes covered by `checksum`: the file from its start to the last record batch.
    pub data_bytes: u64,
    pub checksum: Checksum,
    /// xxh3-64 of each `chunk_bytes`-long piece of the data bytes (the last may be shorter),
    /// so an open can check just the pieces it reads, and check pieces in parallel. Shards
    /// written before chunks existed have none and are checked whole.
    #[serde(default)]
    pub chunk_bytes: u64,
    #[serde(default)]
    pub chunk_checksums: Vec<u64>,
    pub schema: Vec<FieldSummary>,
    /// The lineage the fingerprint was computed from, with one sub-hash per argument: what
    /// `explain_miss` compares against.
    pub inputs: FingerprintInputs,
}

impl Manifest {
    pub(crate) fn to_json(&self) -> Result<String> {
        serde_json::to_string(self).map_err(|error| CacheError::Manifest(error.to_string()))
    }

    pub(crate) fn from_json(json: &str) -> std::result::Result<Self, serde_json::Error> {
        serde_json::from_str(json)
    }
}

/// An xxh3-128 of a shard's data bytes, written as 32 hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checksum(pub u128);

impl fmt::Display for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl Serialize for Checksum {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Checksum {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        u128::from_str_radix(&text, 16)
            .map(Checksum)
            .map_err(serde::de::Error::custom)
    }
}

/// One column of a shard's schema, as recorded in its manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldSummary {
    pub name: String,
    pub data_type: String,
    pub nullable: bool,
}

impl FieldSummary {
    pub fn of(schema: &Schema) -> Vec<Self> {
        schema
            .fields()
            .iter()
            .map(|field| FieldSummary {
                name: field.name().clone(),
                data_type: field.data_type().to_string(),
                nullable: field.is_nullable(),
            })
            .collect()
    }
}
