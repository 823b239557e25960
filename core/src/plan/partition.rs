//! Hive partitioning: `key=value` directory names, and deciding from a file's partition
//! values alone whether a predicate can hold for any of its rows.
//!
//! Names and values are escaped as Hive (and pyarrow) do: the characters a path cannot hold
//! or that Hive reserves (`/`, `=`, `%`, `:`, `#`, `?`, `*`, quotes, brackets, controls …)
//! become `%XX`; a null (or empty) value is `__HIVE_DEFAULT_PARTITION__`.
//!
//! Pruning ([`may_match`]) evaluates the predicate in Kleene logic over the partition
//! columns only: anything else (another column, a function) is unknown, so a file is dropped
//! only when the predicate is false or null whatever its other columns hold.

use std::cmp::Ordering;
use std::path::Path;

use super::PlanError;
use super::operator::{PartitionColumn, PartitionType};
use crate::expr::{BinaryOp, Expr, Scalar};

/// The directory name of a null or empty partition value (Hive's).
pub const DEFAULT_PARTITION: &str = "__HIVE_DEFAULT_PARTITION__";

/// Whether Hive escapes `c` in a path segment.
fn escaped(c: char) -> bool {
    matches!(
        c,
        '\u{01}'
            ..='\u{1f}'
                | '"'
                | '#'
                | '%'
                | '\''
                | '*'
                | '/'
                | ':'
                | '='
                | '?'
                | '\\'
                | '\u{7f}'
                | '{'
                | '['
                | ']'
                | '^'
    )
}

/// `text` with Hive's reserved characters percent-encoded.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if escaped(c) {
            out.push_str(&format!("%{:02X}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}

/// Decodes every `%XX` of `text`; the bytes must be UTF-8.
pub fn unescape(text: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] == b'%' {
            let hex = bytes
                .get(at + 1..at + 3)
                .and_then(|hex| std::str::from_utf8(hex).ok())
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                .ok_or_else(|| format!("`{text}` has a `%` not followed by two hex digits"))?;
            out.push(hex);
            at += 3;
        } else {
            out.push(bytes[at]);
            at += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("`{text}` decodes to bytes that are not UTF-8"))
}

/// The directory name of `name` = `value` (`None`: null).
pub fn segment(name: &str, value: Option<&str>) -> String {
    match value {
        Some(value) if !value.is_empty() => format!("{}={}", escape(name), escape(value)),
        _ => format!("{}={DEFAULT_PARTITION}", escape(name)),
    }
}

/// A directory name's `(name, value)`, decoded, if it is `name=value` (`None`: null).
pub fn parse_segment(segment: &str) -> Option<Result<(String, Option<String>), String>> {
    let (name, value) = segment.split_once('=')?;
    if name.is_empty() {
        return None;
    }
    Some((|| {
        let name = unescape(name)?;
        let value = match value {
            DEFAULT_PARTITION => None,
            value => Some(unescape(value)?),
        };
        Ok((name, value))
    })())
}

/// The `key=value` directories of `path` (every segment but the file name), decoded, in
/// path order.
pub fn segments_of(path: &Path) -> Result<Vec<(String, Option<String>)>, String> {
    let text = path.to_string_lossy();
    let mut parts: Vec<&str> = text.split('/').collect();
    parts.pop();
    parts.into_iter().filter_map(parse_segment).collect()
}

/// A partition value read as `data_type`.
pub fn typed_value(
    column: &str,
    value: Option<&str>,
    data_type: PartitionType,
) -> Result<Scalar, String> {
    match (value, data_type) {
        (None, _) => Ok(Scalar::Null),
        (Some(text), PartitionType::Int64) => text.parse().map(Scalar::Int64).map_err(|_| {
            format!("partition value `{text}` of `{column}` is not an int64; declare it a string")
        }),
        (Some(text), PartitionType::Utf8) => Ok(Scalar::Utf8(text.to_owned())),
    }
}

/// The values of `columns` in `path`, typed; the innermost `column=…` directory names each.
pub fn values_of(path: &Path, columns: &[PartitionColumn]) -> Result<Vec<Scalar>, PlanError> {
    let invalid = |message: String| {
        PlanError::invalid("partitioning", format!("{}: {message}", path.display()))
    };
    let segments = segments_of(path).map_err(invalid)?;
    columns
        .iter()
        .map(|column| {
            let (_, value) = segments
                .iter()
                .rev()
                .find(|(name, _)| *name == column.name)
                .ok_or_else(|| invalid(format!("no `{}=…` directory in the path", column.name)))?;
            typed_value(&column.name, value.as_deref(), column.data_type).map_err(invalid)
        })
        .collect()
}

/// What the pruner knows of an expression over one file's partition values.
enum Known {
    /// The value, the same for every row of the file (`Scalar::Null` for null).
    Value(Scalar),
    /// False or null, whichever: true for no row (`unknown and null`).
    NotTrue,
    /// Depends on a column the file holds, or on something the pruner does not evaluate.
    Unknown,
}

/// Whether `predicate` may be true for some row of a file whose partition columns
/// `columns` hold `values`: false only when it is false or null for every row.
pub fn may_match(predicate: &Expr, columns: &[PartitionColumn], values: &[Scalar]) -> bool {
    !matches!(
        evaluate(predicate, columns, values),
        Known::Value(Scalar::Boolean(false) | Scalar::Null) | Known::NotTrue
    )
}

/// Recursion is bounded by the plan's expression depth (`MAX_EXPR_DEPTH`).
fn evaluate(expr: &Expr, columns: &[PartitionColumn], values: &[Scalar]) -> Known {
    match expr {
        Expr::Column(name) => match columns.iter().position(|column| column.name == *name) {
            Some(index) => Known::Value(values[index].clone()),
            None => Known::Unknown,
        },
        Expr::Literal(value) => Known::Value(value.clone()),
        Expr::Binary { op, left, right } => {
            let (left, right) = (
                evaluate(left, columns, values),
                evaluate(right, columns, values),
            );
            match op {
                BinaryOp::And => kleene_and(left, right),
                BinaryOp::Or => kleene_not(kleene_and(kleene_not(left), kleene_not(right))),
                op if op.is_comparison() => match (left, right) {
                    (Known::Value(left), Known::Value(right)) => compare(*op, &left, &right),
                    _ => Known::Unknown,
                },
                _ => Known::Unknown,
            }
        }
        Expr::Not(inner) => kleene_not(evaluate(inner, columns, values)),
        Expr::IsNull(inner) => match evaluate(inner, columns, values) {
            Known::Value(value) => Known::Value(Scalar::Boolean(value == Scalar::Null)),
            Known::NotTrue | Known::Unknown => Known::Unknown,
        },
        Expr::IsNotNull(inner) => match evaluate(inner, columns, values) {
            Known::Value(value) => Known::Value(Scalar::Boolean(value != Scalar::Null)),
            Known::NotTrue | Known::Unknown => Known::Unknown,
        },
        _ => Known::Unknown,
    }
}

fn kleene_not(known: Known) -> Known {
    match known {
        Known::Value(Scalar::Boolean(value)) => Known::Value(Scalar::Boolean(!value)),
        Known::Value(Scalar::Null) => Known::Value(Scalar::Null),
        _ => Known::Unknown,
    }
}

fn kleene_and(left: Known, right: Known) -> Known {
    let boolean = |known: &Known| match known {
        Known::Value(Scalar::Boolean(value)) => Some(Some(*value)),
        Known::Value(Scalar::Null) => Some(None),
        _ => None,
    };
    let not_true = |known: &Known| matches!(known, Known::NotTrue);
    match (boolean(&left), boolean(&right)) {
        (Some(Some(false)), _) | (_, Some(Some(false))) => Known::Value(Scalar::Boolean(false)),
        (Some(Some(true)), Some(Some(true))) => Known::Value(Scalar::Boolean(true)),
        (Some(_), Some(_)) => Known::Value(Scalar::Null),
        // A null or not-true side leaves the whole false or null, whatever the other is.
        (Some(None), _) | (_, Some(None)) => Known::NotTrue,
        _ if not_true(&left) || not_true(&right) => Known::NotTrue,
        _ => Known::Unknown,
    }
}

/// `left op right` for the value kinds partitions hold (integers, strings) against literals;
/// anything else is unknown.
fn compare(op: BinaryOp, left: &Scalar, right: &Scalar) -> Known {
    if *left == Scalar::Null || *right == Scalar::Null {
        return Known::Value(Scalar::Null);
    }
    let ordering = match (integer(left), integer(right), left, right) {
        (Some(a), Some(b), _, _) => a.cmp(&b),
        (_, _, Scalar::Utf8(a), Scalar::Utf8(b)) => a.cmp(b),
        _ => match (float(left), float(right)) {
            (Some(a), Some(b)) => match a.partial_cmp(&b) {
                Some(ordering) => ordering,
                None => return Known::Unknown,
            },
            _ => return Known::Unknown,
        },
    };
    let holds = match op {
        BinaryOp::Eq => ordering == Ordering::Equal,
        BinaryOp::NotEq => ordering != Ordering::Equal,
        BinaryOp::Lt => ordering == Ordering::Less,
        BinaryOp::LtEq => ordering != Ordering::Greater,
        BinaryOp::Gt => ordering == Ordering::Greater,
        BinaryOp::GtEq => ordering != Ordering::Less,
        _ => return Known::Unknown,
    };
    Known::Value(Scalar::Boolean(holds))
}

fn integer(value: &Scalar) -> Option<i128> {
    Some(match value {
        Scalar::Int8(v) => i128::from(*v),
        Scalar::Int16(v) => i128::from(*v),
        Scalar::Int32(v) => i128::from(*v),
        Scalar::Int64(v) => i128::from(*v),
        Scalar::UInt8(v) => i128::from(*v),
        Scalar::UInt16(v) => i128::from(*v),
        Scalar::UInt32(v) => i128::from(*v),
        Scalar::UInt64(v) => i128::from(*v),
        _ => return None,
    })
}

fn float(value: &Scalar) -> Option<f64> {
    match value {
        Scalar::Float32(v) => Some(f64::from(*v)),
        Scalar::Float64(v) => Some(*v),
        // Integers beyond 2^53 lose precision here, but only against a float literal, where
        // the row-by-row comparison casts the same way.
        other => integer(other).map(|v| v as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::expr::{col, lit};

    #[test]
    fn escaping_round_trips_reserved_characters_as_hive_writes_them() {
        let value = "a/b=c%d:e f#?*[x]^\u{1}";
        let escaped = escape(value);
        assert_eq!(escaped, "a%2Fb%3Dc%25d%3Ae f%23%3F%2A%5Bx%5D%5E%01");
        assert_eq!(unescape(&escaped).as_deref(), Ok(value));
        assert_eq!(segment("date", None), "date=__HIVE_DEFAULT_PARTITION__");
        assert_eq!(segment("date", Some("")), "date=__HIVE_DEFAULT_PARTITION__");
        assert!(unescape("%zz").is_err());
        assert!(unescape("%ff").is_err());
    }

    #[test]
    fn a_file_is_pruned_only_when_its_values_make_the_predicate_false_or_null() {
        let columns = [
            PartitionColumn::new("year", PartitionType::Int64),
            PartitionColumn::new("city", PartitionType::Utf8),
        ];
        let file = [Scalar::Int64(2026), Scalar::Utf8("Oslo".to_owned())];
        let nulls = [Scalar::Null, Scalar::Null];
        let cases = [
            (col("year").eq(lit(2026)), true, false),
            (col("year").gt(lit(2026)), false, false),
            (col("year").lt_eq(lit(2026.5)), true, false),
            (col("city").eq(lit("Rome")), false, false),
            (
                col("city").eq(lit("Rome")).or(col("year").eq(lit(2026))),
                true,
                false,
            ),
            // An unknown column keeps the file unless the known part decides.
            (col("price").gt(lit(3)), true, true),
            (
                col("price").gt(lit(3)).and(col("year").eq(lit(1999))),
                false,
                false,
            ),
            (
                col("price").gt(lit(3)).or(col("year").eq(lit(1999))),
                true,
                true,
            ),
            (col("year").is_null(), false, true),
            (!col("year").not_eq(lit(2026)), true, false),
        ];
        for (predicate, on_file, on_nulls) in cases {
            assert_eq!(
                may_match(&predicate, &columns, &file),
                on_file,
                "{predicate}"
            );
            assert_eq!(
                may_match(&predicate, &columns, &nulls),
                on_nulls,
                "{predicate} on nulls"
            );
        }
    }

    #[test]
    fn values_come_from_the_innermost_directory_of_each_name() {
        let columns = [PartitionColumn::new("d", PartitionType::Utf8)];
        let values = values_of(Path::new("/x/d=old/y/d=a%2Fb/part-0.parquet"), &columns);
        assert_eq!(values.ok(), Some(vec![Scalar::Utf8("a/b".to_owned())]));
        assert!(values_of(Path::new("/x/part-0.parquet"), &columns).is_err());
        let ints = [PartitionColumn::new("d", PartitionType::Int64)];
        assert!(values_of(Path::new("/x/d=seven/f"), &ints).is_err());
    }
}
