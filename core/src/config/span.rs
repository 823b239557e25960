//! Lengths of time in configuration: `"1h"`, `"7d"`, `"30s"`, `"250ms"`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A length of time, written in config files as an integer with a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Span(Duration);

/// Largest first, so `Display` picks the unit that gives the shortest number.
const UNITS: [(&str, u64); 5] = [
    ("d", 86_400_000),
    ("h", 3_600_000),
    ("m", 60_000),
    ("s", 1_000),
    ("ms", 1),
];

impl Span {
    pub const fn millis(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }

    pub const fn hours(hours: u64) -> Self {
        Self::millis(hours * 3_600_000)
    }

    pub const fn days(days: u64) -> Self {
        Self::millis(days * 86_400_000)
    }

    pub const fn duration(self) -> Duration {
        self.0
    }

    /// Whole milliseconds, saturating.
    pub fn as_millis(self) -> u64 {
        u64::try_from(self.0.as_millis()).unwrap_or(u64::MAX)
    }
}

impl fmt::Display for Span {
    /// In the largest unit that divides the value exactly, so `FromStr` reads it back losslessly.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.as_millis();
        let (name, size) = UNITS
            .iter()
            .find(|(_, size)| ms != 0 && ms.is_multiple_of(*size))
            .copied()
            .unwrap_or(("s", 1_000));
        write!(f, "{}{name}", ms / size)
    }
}

/// A length of time that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{input:?} is not a length of time: write an integer with a unit (ms, s, m, h, d), e.g. \"1h\""
)]
pub struct SpanError {
    pub input: String,
}

impl FromStr for Span {
    type Err = SpanError;

    fn from_str(input: &str) -> Result<Self, SpanError> {
        let error = || SpanError {
            input: input.to_owned(),
        };
        let (number, unit) = super::bytesize::number_and_unit(input).ok_or_else(error)?;
        let size = UNITS
            .iter()
            .find(|(name, _)| *name == unit)
            .map(|(_, size)| *size)
            .ok_or_else(error)?;
        number.checked_mul(size).map(Span::millis).ok_or_else(error)
    }
}

impl Serialize for Span {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Span {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_round_trips() {
        assert_eq!("1h".parse(), Ok(Span::hours(1)));
        assert_eq!("7d".parse(), Ok(Span::days(7)));
        assert_eq!("250ms".parse(), Ok(Span::millis(250)));
        assert_eq!("90m".parse(), Ok(Span::millis(90 * 60_000)));
        for text in ["1h", "7d", "250ms", "90m", "45s", "0s"] {
            let span: Span = text.parse().unwrap();
            assert_eq!(span.to_string(), text);
        }
    }

    #[test]
    fn refuses_what_is_not_a_span() {
        for text in [
            "",
            "1",
            "h",
            "1 week",
            "-1s",
            "1.5h",
            "99999999999999999999d",
        ] {
            assert!(text.parse::<Span>().is_err(), "{text:?} parsed");
        }
    }
}
