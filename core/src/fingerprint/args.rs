//! Transform arguments: typed values, their declared defaults and roles.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::canonical::CanonicalHasher;
use super::{Fingerprint, FingerprintError};

/// One argument value. Each variant is hashed with its own type tag, so `1`, `1u`, `1.0` and
/// `"1"` are four different arguments.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ArgValue {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    /// Compared and hashed by bit pattern: `0.0` and `-0.0` differ, a NaN equals itself.
    Float(#[serde(with = "float_bits")] f64),
    Str(String),
    Bytes(Vec<u8>),
    // Values nest: each level decodes one deeper, bounded by `wire::nesting`.
    List(#[serde(deserialize_with = "crate::wire::nesting::nested_vec")] Vec<ArgValue>),
    /// Sorted by key, so construction order never matters.
    Map(#[serde(deserialize_with = "crate::wire::nesting::nested_map")] BTreeMap<String, ArgValue>),
    /// Another dataset used as an argument (e.g. the right side of a join, or a lookup table).
    Fingerprint(Fingerprint),
}

/// The type tags are part of the pinned encoding (golden tests cover them): never renumber.
mod tag {
    pub const NULL: u8 = 0;
    pub const BOOL: u8 = 1;
    pub const INT: u8 = 2;
    pub const UINT: u8 = 3;
    pub const FLOAT: u8 = 4;
    pub const STR: u8 = 5;
    pub const BYTES: u8 = 6;
    pub const LIST: u8 = 7;
    pub const MAP: u8 = 8;
    pub const FINGERPRINT: u8 = 9;
}

impl ArgValue {
    pub(crate) fn feed(&self, hasher: &mut CanonicalHasher) {
        match self {
            ArgValue::Null => hasher.tag(tag::NULL),
            ArgValue::Bool(value) => {
                hasher.tag(tag::BOOL);
                hasher.tag(u8::from(*value));
            }
            ArgValue::Int(value) => {
                hasher.tag(tag::INT);
                hasher.i64(*value);
            }
            ArgValue::UInt(value) => {
                hasher.tag(tag::UINT);
                hasher.u64(*value);
            }
            ArgValue::Float(value) => {
                hasher.tag(tag::FLOAT);
                hasher.u64(value.to_bits());
            }
            ArgValue::Str(value) => {
                hasher.tag(tag::STR);
                hasher.bytes(value.as_bytes());
            }
            ArgValue::Bytes(value) => {
                hasher.tag(tag::BYTES);
                hasher.bytes(value);
            }
            ArgValue::List(items) => {
                hasher.tag(tag::LIST);
                hasher.len(items.len());
                items.iter().for_each(|item| item.feed(hasher));
            }
            ArgValue::Map(entries) => {
                hasher.tag(tag::MAP);
                hasher.len(entries.len());
                for (key, value) in entries {
                    hasher.bytes(key.as_bytes());
                    value.feed(hasher);
                }
            }
            ArgValue::Fingerprint(fingerprint) => {
                hasher.tag(tag::FINGERPRINT);
                hasher.fingerprint(*fingerprint);
            }
        }
    }
}

/// Equality is "hashes the same": floats compare by bit pattern.
impl PartialEq for ArgValue {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (ArgValue::Null, ArgValue::Null) => true,
            (ArgValue::Bool(a), ArgValue::Bool(b)) => a == b,
            (ArgValue::Int(a), ArgValue::Int(b)) => a == b,
            (ArgValue::UInt(a), ArgValue::UInt(b)) => a == b,
            (ArgValue::Float(a), ArgValue::Float(b)) => a.to_bits() == b.to_bits(),
            (ArgValue::Str(a), ArgValue::Str(b)) => a == b,
            (ArgValue::Bytes(a), ArgValue::Bytes(b)) => a == b,
            (ArgValue::List(a), ArgValue::List(b)) => a == b,
            (ArgValue::Map(a), ArgValue::Map(b)) => a == b,
            (ArgValue::Fingerprint(a), ArgValue::Fingerprint(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for ArgValue {}

impl std::fmt::Display for ArgValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ArgValue::Null => f.write_str("null"),
            ArgValue::Bool(value) => write!(f, "{value}"),
            ArgValue::Int(value) => write!(f, "{value}"),
            ArgValue::UInt(value) => write!(f, "{value}u"),
            ArgValue::Float(value) => write!(f, "{value:?}"),
            ArgValue::Str(value) => write!(f, "{value:?}"),
            ArgValue::Bytes(value) => write!(f, "<{} bytes>", value.len()),
            ArgValue::List(items) => {
                f.write_str("[")?;
                for (index, item) in items.iter().enumerate() {
                    if index > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{item}")?;
                }
                f.write_str("]")
            }
            ArgValue::Map(entries) => {
                f.write_str("{")?;
                for (index, (key, value)) in entries.iter().enumerate() {
                    if index > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{key:?}: {value}")?;
                }
                f.write_str("}")
            }
            ArgValue::Fingerprint(fingerprint) => write!(f, "dataset {fingerprint}"),
        }
    }
}

/// JSON cannot hold NaN or infinities, and a decimal round trip is not guaranteed to be exact,
/// so floats are stored as their bits.
mod float_bits {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u64(value.to_bits())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
        u64::deserialize(deserializer).map(f64::from_bits)
    }
}

macro_rules! arg_value_from {
    ($($source:ty => $variant:ident),* $(,)?) => {
        $(impl From<$source> for ArgValue {
            fn from(value: $source) -> Self {
                ArgValue::$variant(value.into())
            }
        })*
    };
}

arg_value_from!(
    bool => Bool,
    i64 => Int,
    i32 => Int,
    u64 => UInt,
    u32 => UInt,
    f64 => Float,
    String => Str,
    &str => Str,
    Vec<ArgValue> => List,
    BTreeMap<String, ArgValue> => Map,
    Fingerprint => Fingerprint,
);

impl From<Seed> for ArgValue {
    fn from(seed: Seed) -> Self {
        ArgValue::UInt(seed.get())
    }
}

/// Whether an argument can change a transform's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ArgRole {
    /// Changes the output: hashed unless equal to its declared default.
    Semantic,
    /// Only changes how fast the output is produced (parallelism, batch size, block size):
    /// never hashed, so tuning it reuses the cache.
    PerformanceOnly,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct DeclaredArg {
    name: String,
    value: ArgValue,
    default: Option<ArgValue>,
    role: ArgRole,
}

/// A transform's arguments as declared by the operator that owns them.
///
/// ```
/// use floe_core::fingerprint::Args;
/// let args = Args::new()
///     .arg("column", "price")
///     .arg_with_default("factor", 2.0, 1.0)
///     .performance("batch_size", 4096u64);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Args {
    declared: Vec<DeclaredArg>,
}

impl Args {
    pub fn new() -> Self {
        Self::default()
    }

    /// An argument without a default: always hashed.
    pub fn arg(self, name: impl Into<String>, value: impl Into<ArgValue>) -> Self {
        self.declare(name.into(), value.into(), None, ArgRole::Semantic)
    }

    /// An argument hashed only when it differs from `default`, so spelling out a default
    /// (HF's `batched=False`) keeps the same fingerprint as leaving it out.
    pub fn arg_with_default(
        self,
        name: impl Into<String>,
        value: impl Into<ArgValue>,
        default: impl Into<ArgValue>,
    ) -> Self {
        self.declare(
            name.into(),
            value.into(),
            Some(default.into()),
            ArgRole::Semantic,
        )
    }

    /// A performance-only argument: carried for the executor, never hashed.
    pub fn performance(self, name: impl Into<String>, value: impl Into<ArgValue>) -> Self {
        self.declare(name.into(), value.into(), None, ArgRole::PerformanceOnly)
    }

    /// The seed of a randomized transform, always hashed under the name `seed`.
    pub fn seed(self, seed: Seed) -> Self {
        self.arg("seed", seed)
    }

    fn declare(
        mut self,
        name: String,
        value: ArgValue,
        default: Option<ArgValue>,
        role: ArgRole,
    ) -> Self {
        self.declared.push(DeclaredArg {
            name,
            value,
            default,
            role,
        });
        self
    }

    /// The value of an argument, whatever its role.
    pub fn get(&self, name: &str) -> Option<&ArgValue> {
        self.declared
            .iter()
            .find(|arg| arg.name == name)
            .map(|arg| &arg.value)
    }

    /// The arguments that enter the fingerprint, sorted by name, each with its sub-hash.
    pub fn hashed(&self) -> Result<Vec<HashedArg>, FingerprintError> {
        let mut sorted: Vec<&DeclaredArg> = self.declared.iter().collect();
        sorted.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(pair) = sorted.windows(2).find(|pair| pair[0].name == pair[1].name) {
            return Err(FingerprintError::DuplicateArgument {
                name: pair[0].name.clone(),
            });
        }
        Ok(sorted
            .into_iter()
            .filter(|arg| arg.role == ArgRole::Semantic)
            .filter(|arg| arg.default.as_ref() != Some(&arg.value))
            .map(|arg| HashedArg::new(arg.name.clone(), arg.value.clone()))
            .collect())
    }
}

/// An argument that enters a fingerprint, with its own hash so a cache miss can name the
/// argument that changed without storing or comparing whole values. Not serialized on its
/// own: a lineage stores names and values and recomputes the hashes when decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashedArg {
    pub name: String,
    pub value: ArgValue,
    pub hash: Fingerprint,
}

impl HashedArg {
    pub fn new(name: String, value: ArgValue) -> Self {
        let mut hasher = CanonicalHasher::new("floe.fingerprint.arg.v1");
        hasher.bytes(name.as_bytes());
        value.feed(&mut hasher);
        let hash = hasher.finish();
        Self { name, value, hash }
    }
}

/// The seed of a randomized transform (`random_shuffle`, random split).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Seed(u64);

impl Seed {
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    pub const fn get(self) -> u64 {
        self.0
    }

    /// The user's seed, or a fresh one from the operating system. Called once at submission
    /// and stored in the plan: two unseeded submissions then never share a cache entry, while
    /// re-running the submitted plan (a retry, a restarted driver) reuses its own.
    pub fn resolve(requested: Option<u64>) -> Result<Self, FingerprintError> {
        match requested {
            Some(seed) => Ok(Self(seed)),
            None => getrandom::u64()
                .map(Self)
                .map_err(|error| FingerprintError::Entropy(error.to_string())),
        }
    }
}
