//! Byte quantities in configuration: `"75MiB"`, `"200GB"`, or a plain integer of bytes.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A number of bytes, written in config files with an optional unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

/// Largest first, so `Display` picks the unit that gives the shortest number.
const UNITS: [(&str, u64); 9] = [
    ("TiB", 1 << 40),
    ("TB", 1_000_000_000_000),
    ("GiB", 1 << 30),
    ("GB", 1_000_000_000),
    ("MiB", 1 << 20),
    ("MB", 1_000_000),
    ("KiB", 1 << 10),
    ("KB", 1_000),
    ("B", 1),
];

impl ByteSize {
    pub const fn kib(n: u64) -> Self {
        Self(n << 10)
    }

    pub const fn mib(n: u64) -> Self {
        Self(n << 20)
    }

    pub const fn gib(n: u64) -> Self {
        Self(n << 30)
    }

    pub const fn bytes(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ByteSize {
    /// In the largest unit that divides the value exactly, so `FromStr` reads it back losslessly.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = UNITS
            .iter()
            .filter(|(_, size)| *size > 1)
            .find(|(_, size)| self.0 != 0 && self.0.is_multiple_of(*size));
        match unit {
            Some((name, size)) => write!(f, "{}{name}", self.0 / size),
            None => write!(f, "{}B", self.0),
        }
    }
}

/// A byte quantity that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{input:?} is not a byte size: write an integer with an optional unit \
     (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. \"512MiB\""
)]
pub struct ByteSizeError {
    pub input: String,
}

impl FromStr for ByteSize {
    type Err = ByteSizeError;

    fn from_str(input: &str) -> Result<Self, ByteSizeError> {
        let error = || ByteSizeError {
            input: input.to_owned(),
        };
        let (number, unit) = number_and_unit(input).ok_or_else(error)?;
        let multiplier = if unit.is_empty() {
            1
        } else {
            UNITS
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(unit))
                .map(|(_, size)| *size)
                .ok_or_else(error)?
        };
        number
            .checked_mul(multiplier)
            .map(ByteSize)
            .ok_or_else(error)
    }
}

/// `" 512 MiB "` → `(512, "MiB")`: a whole number and what follows it, trimmed; `None`
/// without a leading number.
pub(super) fn number_and_unit(input: &str) -> Option<(u64, &str)> {
    let trimmed = input.trim();
    let digits_end = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(digits_end);
    Some((number.parse().ok()?, unit.trim()))
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ByteSize;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte size such as 512MiB, or an integer number of bytes")
            }

            fn visit_u64<E: serde::de::Error>(self, value: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(value))
            }

            fn visit_i64<E: serde::de::Error>(self, value: i64) -> Result<ByteSize, E> {
                u64::try_from(value)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("a byte size cannot be negative ({value})")))
            }

            fn visit_str<E: serde::de::Error>(self, value: &str) -> Result<ByteSize, E> {
                value.parse().map_err(E::custom)
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_units() {
        assert_eq!("75MiB".parse(), Ok(ByteSize(75 << 20)));
        assert_eq!("200GB".parse(), Ok(ByteSize(200_000_000_000)));
        assert_eq!("4096".parse(), Ok(ByteSize(4096)));
        assert_eq!(" 2 kib ".parse(), Ok(ByteSize(2048)));
        assert!("12XB".parse::<ByteSize>().is_err());
        assert!("-1".parse::<ByteSize>().is_err());
        assert!(
            "99999999999TiB".parse::<ByteSize>().is_err(),
            "overflow is an error"
        );
    }

    #[test]
    fn displays_the_largest_exact_unit() {
        assert_eq!(ByteSize::mib(100).to_string(), "100MiB");
        assert_eq!(ByteSize(200_000_000_000).to_string(), "200GB");
        assert_eq!(ByteSize(1023).to_string(), "1023B");
        assert_eq!(ByteSize(0).to_string(), "0B");
    }

    proptest! {
        #[test]
        fn display_round_trips(value: u64) {
            prop_assert_eq!(ByteSize(value).to_string().parse(), Ok(ByteSize(value)));
        }
    }
}
