//! The expression language: serializable, hashable column expressions.
//!
//! Rust closures cannot travel to worker processes, so a row-wise computation is described as
//! an [`Expr`] tree — columns, typed literals, arithmetic, comparison, boolean logic, null
//! handling, casts, string functions, hashing and `if … then … else` — that the plan
//! type-checks against an Arrow [`Schema`] when it is built and that `floe-node` evaluates with
//! Arrow's compute kernels.
//!
//! # Types
//! - Arithmetic on two integers computes in `Int64` (`UInt64` when both sides are unsigned);
//!   anything involving a float computes in `Float64`.
//! - Comparisons need both sides numeric, both strings, both booleans or both of one temporal
//!   type; numeric sides are compared after the arithmetic promotion above.
//! - `and`, `or`, `not` take booleans and follow SQL's three-valued logic (`false and null` is
//!   `false`, `true or null` is `true`).
//! - A `null` literal fits any type.
//!
//! # Values that have no answer
//! **Strict by default:** integer overflow in `+`, `-`, `*` and unary `-`, division or
//! remainder by zero (integer *and* float), and a cast whose value does not convert (`"abc"` to
//! `Int64`, `300` to `Int8`) fail the task with an error that names the expression and the
//! first value that has no answer; they never wrap around and never become null silently.
//! [`Expr::NullOnError`] (`try(e)`, and its spellings `try_cast`, `try_divide`, … in job files;
//! [`null_on_error`] and [`Expr::try_cast`] in Rust) is the opt-out: inside it, every such value
//! is null for its row instead. Float overflow follows IEEE 754 (`±inf`), because an infinity is
//! a representable float. Arithmetic and casts stay nullable in the inferred schema, so one
//! schema holds whether or not they sit inside `try`.
//!
//! # Hashing
//! [`Expr::to_arg`] turns an expression into a fingerprint [`ArgValue`] tree (each node a list
//! starting with its name), so two expressions hash alike exactly when they are structurally
//! equal.

mod types;

use std::fmt;

use arrow_schema::{DataType, Field, Schema};
use serde::{Deserialize, Serialize};

use crate::fingerprint::ArgValue;
use crate::plan::PlanError;

pub use types::{arithmetic_type, common_type, is_numeric, is_orderable, is_string};

/// A typed literal value.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Scalar {
    /// A null of no particular type: it takes the type of whatever it meets.
    Null,
    Boolean(bool),
    Int8(i8),
    Int16(i16),
    Int32(i32),
    Int64(i64),
    UInt8(u8),
    UInt16(u16),
    UInt32(u32),
    UInt64(u64),
    Float32(f32),
    Float64(f64),
    Utf8(String),
    Binary(Vec<u8>),
    /// Days since the Unix epoch.
    Date32(i32),
}

impl Scalar {
    pub fn data_type(&self) -> DataType {
        match self {
            Scalar::Null => DataType::Null,
            Scalar::Boolean(_) => DataType::Boolean,
            Scalar::Int8(_) => DataType::Int8,
            Scalar::Int16(_) => DataType::Int16,
            Scalar::Int32(_) => DataType::Int32,
            Scalar::Int64(_) => DataType::Int64,
            Scalar::UInt8(_) => DataType::UInt8,
            Scalar::UInt16(_) => DataType::UInt16,
            Scalar::UInt32(_) => DataType::UInt32,
            Scalar::UInt64(_) => DataType::UInt64,
            Scalar::Float32(_) => DataType::Float32,
            Scalar::Float64(_) => DataType::Float64,
            Scalar::Utf8(_) => DataType::Utf8,
            Scalar::Binary(_) => DataType::Binary,
            Scalar::Date32(_) => DataType::Date32,
        }
    }

    fn to_arg(&self) -> ArgValue {
        let value = match self {
            Scalar::Null => ArgValue::Null,
            Scalar::Boolean(v) => ArgValue::Bool(*v),
            Scalar::Int8(v) => ArgValue::Int((*v).into()),
            Scalar::Int16(v) => ArgValue::Int((*v).into()),
            Scalar::Int32(v) => ArgValue::Int((*v).into()),
            Scalar::Int64(v) => ArgValue::Int(*v),
            Scalar::UInt8(v) => ArgValue::UInt((*v).into()),
            Scalar::UInt16(v) => ArgValue::UInt((*v).into()),
            Scalar::UInt32(v) => ArgValue::UInt((*v).into()),
            Scalar::UInt64(v) => ArgValue::UInt(*v),
            Scalar::Float32(v) => ArgValue::Float((*v).into()),
            Scalar::Float64(v) => ArgValue::Float(*v),
            Scalar::Utf8(v) => ArgValue::Str(v.clone()),
            Scalar::Binary(v) => ArgValue::Bytes(v.clone()),
            Scalar::Date32(v) => ArgValue::Int((*v).into()),
        };
        // The type is hashed beside the value: `lit(1i32)` and `lit(1i64)` differ.
        ArgValue::List(vec![type_arg(&self.data_type()), value])
    }
}

/// Equality is "hashes the same": floats compare by bit pattern.
impl PartialEq for Scalar {
    fn eq(&self, other: &Self) -> bool {
        self.to_arg() == other.to_arg()
    }
}

impl Eq for Scalar {}

impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::Null => f.write_str("null"),
            Scalar::Boolean(v) => write!(f, "{v}"),
            Scalar::Int8(v) => write!(f, "{v}i8"),
            Scalar::Int16(v) => write!(f, "{v}i16"),
            Scalar::Int32(v) => write!(f, "{v}i32"),
            Scalar::Int64(v) => write!(f, "{v}"),
            Scalar::UInt8(v) => write!(f, "{v}u8"),
            Scalar::UInt16(v) => write!(f, "{v}u16"),
            Scalar::UInt32(v) => write!(f, "{v}u32"),
            Scalar::UInt64(v) => write!(f, "{v}u64"),
            Scalar::Float32(v) => write!(f, "{v:?}f32"),
            Scalar::Float64(v) => write!(f, "{v:?}"),
            Scalar::Utf8(v) => write!(f, "{v:?}"),
            Scalar::Binary(v) => write!(f, "<{} bytes>", v.len()),
            Scalar::Date32(v) => write!(f, "date32({v})"),
        }
    }
}

macro_rules! scalar_from {
    ($($source:ty => $variant:ident),* $(,)?) => {
        $(impl From<$source> for Scalar {
            fn from(value: $source) -> Self {
                Scalar::$variant(value.into())
            }
        })*
    };
}

scalar_from!(
    bool => Boolean,
    i8 => Int8,
    i16 => Int16,
    i32 => Int32,
    i64 => Int64,
    u8 => UInt8,
    u16 => UInt16,
    u32 => UInt32,
    u64 => UInt64,
    f32 => Float32,
    f64 => Float64,
    String => Utf8,
    &str => Utf8,
    Vec<u8> => Binary,
);

/// The canonical spelling of a type inside fingerprints and plan text. Arrow's `Debug` form is
/// used because it is the complete description (units, time zones, nested fields).
pub(crate) fn type_arg(data_type: &DataType) -> ArgValue {
    ArgValue::Str(format!("{data_type:?}"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BinaryOp {
    Add,
    Subtract,
    Multiply,
    Divide,
    Remainder,
    Eq,
    NotEq,
    Lt,
    LtEq,
    Gt,
    GtEq,
    And,
    Or,
}

impl BinaryOp {
    pub fn symbol(self) -> &'static str {
        match self {
            BinaryOp::Add => "+",
            BinaryOp::Subtract => "-",
            BinaryOp::Multiply => "*",
            BinaryOp::Divide => "/",
            BinaryOp::Remainder => "%",
            BinaryOp::Eq => "==",
            BinaryOp::NotEq => "!=",
            BinaryOp::Lt => "<",
            BinaryOp::LtEq => "<=",
            BinaryOp::Gt => ">",
            BinaryOp::GtEq => ">=",
            BinaryOp::And => "and",
            BinaryOp::Or => "or",
        }
    }

    pub fn is_arithmetic(self) -> bool {
        matches!(
            self,
            BinaryOp::Add
                | BinaryOp::Subtract
                | BinaryOp::Multiply
                | BinaryOp::Divide
                | BinaryOp::Remainder
        )
    }

    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinaryOp::Eq
                | BinaryOp::NotEq
                | BinaryOp::Lt
                | BinaryOp::LtEq
                | BinaryOp::Gt
                | BinaryOp::GtEq
        )
    }

    /// `a op b` ⇔ `b flipped(op) a`, used to normalize `lit < col` for statistics pruning.
    pub fn flipped(self) -> Self {
        match self {
            BinaryOp::Lt => BinaryOp::Gt,
            BinaryOp::LtEq => BinaryOp::GtEq,
            BinaryOp::Gt => BinaryOp::Lt,
            BinaryOp::GtEq => BinaryOp::LtEq,
            other => other,
        }
    }
}

/// Functions of one string argument (patterns are literals, checked when the plan is built).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StringFunction {
    Contains(String),
    StartsWith(String),
    Lower,
    Upper,
    /// Length in Unicode scalar values (not bytes), as `Int64`.
    Length,
    /// Characters from `start` (0-based; negative counts from the end), at most `length` of them.
    Substring {
        start: i64,
        length: Option<u64>,
    },
    /// Whether the string matches the regular expression anywhere (`regex` crate syntax).
    RegexMatch(String),
}

impl StringFunction {
    fn name(&self) -> &'static str {
        match self {
            StringFunction::Contains(_) => "contains",
            StringFunction::StartsWith(_) => "starts_with",
            StringFunction::Lower => "lower",
            StringFunction::Upper => "upper",
            StringFunction::Length => "length",
            StringFunction::Substring { .. } => "substring",
            StringFunction::RegexMatch(_) => "regex_match",
        }
    }

    fn args(&self) -> Vec<ArgValue> {
        match self {
            StringFunction::Contains(pattern)
            | StringFunction::StartsWith(pattern)
            | StringFunction::RegexMatch(pattern) => vec![ArgValue::Str(pattern.clone())],
            StringFunction::Lower | StringFunction::Upper | StringFunction::Length => Vec::new(),
            StringFunction::Substring { start, length } => vec![
                ArgValue::Int(*start),
                length.map_or(ArgValue::Null, ArgValue::UInt),
            ],
        }
    }

    /// The result type for a string input.
    pub fn output_type(&self) -> DataType {
        match self {
            StringFunction::Contains(_)
            | StringFunction::StartsWith(_)
            | StringFunction::RegexMatch(_) => DataType::Boolean,
            StringFunction::Lower | StringFunction::Upper | StringFunction::Substring { .. } => {
                DataType::Utf8
            }
            StringFunction::Length => DataType::Int64,
        }
    }
}

/// A column expression. Build it with [`col`], [`lit`] and the methods below.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Expr {
    Column(String),
    Literal(Scalar),
    // Every child decodes one level deeper, so no input can nest past the decoder's bound
    // (`wire::nesting`).
    Binary {
        op: BinaryOp,
        #[serde(deserialize_with = "crate::wire::nesting::nested_box")]
        left: Box<Expr>,
        #[serde(deserialize_with = "crate::wire::nesting::nested_box")]
        right: Box<Expr>,
    },
    Not(#[serde(deserialize_with = "crate::wire::nesting::nested_box")] Box<Expr>),
    Negate(#[serde(deserialize_with = "crate::wire::nesting::nested_box")] Box<Expr>),
    IsNull(#[serde(deserialize_with = "crate::wire::nesting::nested_box")] Box<Expr>),
    IsNotNull(#[serde(deserialize_with = "crate::wire::nesting::nested_box")] Box<Expr>),
    /// The first non-null argument.
    Coalesce(#[serde(deserialize_with = "crate::wire::nesting::nested_vec")] Vec<Expr>),
    Cast {
        #[serde(deserialize_with = "crate::wire::nesting::nested_box")]
        expr: Box<Expr>,
        to: DataType,
    },
    String {
        function: StringFunction,
        #[serde(deserialize_with = "crate::wire::nesting::nested_box")]
        expr: Box<Expr>,
    },
    /// A 64-bit xxh3 hash of the arguments' values, row by row (`UInt64`, never null).
    Hash(#[serde(deserialize_with = "crate::wire::nesting::nested_vec")] Vec<Expr>),
    /// The inner expression's values, except that every value inside it that has no answer
    /// (overflow, division by zero, a cast that does not convert) is null rather than an error.
    NullOnError(#[serde(deserialize_with = "crate::wire::nesting::nested_box")] Box<Expr>),
    /// `then` where `condition` is true, `otherwise` where it is false or null.
    IfThenElse {
        #[serde(deserialize_with = "crate::wire::nesting::nested_box")]
        condition: Box<Expr>,
        #[serde(deserialize_with = "crate::wire::nesting::nested_box")]
        then: Box<Expr>,
        #[serde(deserialize_with = "crate::wire::nesting::nested_box")]
        otherwise: Box<Expr>,
    },
}

/// A reference to the column `name`.
pub fn col(name: impl Into<String>) -> Expr {
    Expr::Column(name.into())
}

/// A literal; the Rust type picks the Arrow type (`lit(1)` is `Int32`, `lit(1i64)` is `Int64`).
pub fn lit(value: impl Into<Scalar>) -> Expr {
    Expr::Literal(value.into())
}

/// The untyped null literal.
pub fn null() -> Expr {
    Expr::Literal(Scalar::Null)
}

/// The first non-null value among `exprs`.
pub fn coalesce(exprs: impl IntoIterator<Item = Expr>) -> Expr {
    Expr::Coalesce(exprs.into_iter().collect())
}

/// A 64-bit hash of the values of `exprs` in each row.
pub fn hash(exprs: impl IntoIterator<Item = Expr>) -> Expr {
    Expr::Hash(exprs.into_iter().collect())
}

/// `expr`, with null for every value inside it that has no answer instead of an error (SQL's
/// `TRY_CAST` / `try_divide`, generalized): `null_on_error(col("a") / col("b"))`.
pub fn null_on_error(expr: Expr) -> Expr {
    Expr::NullOnError(Box::new(expr))
}

/// `then` where `condition` holds, else `otherwise`.
pub fn when(condition: Expr, then: Expr, otherwise: Expr) -> Expr {
    Expr::IfThenElse {
        condition: Box::new(condition),
        then: Box::new(then),
        otherwise: Box::new(otherwise),
    }
}

impl Expr {
    fn binary(self, op: BinaryOp, right: Expr) -> Expr {
        Expr::Binary {
            op,
            left: Box::new(self),
            right: Box::new(right),
        }
    }

    fn string(self, function: StringFunction) -> Expr {
        Expr::String {
            function,
            expr: Box::new(self),
        }
    }

    pub fn eq(self, right: Expr) -> Expr {
        self.binary(BinaryOp::Eq, right)
    }
    pub fn not_eq(self, right: Expr) -> Expr {
        self.binary(BinaryOp::NotEq, right)
    }
    pub fn lt(self, right: Expr) -> Expr {
        self.binary(BinaryOp::Lt, right)
    }
    pub fn lt_eq(self, right: Expr) -> Expr {
        self.binary(BinaryOp::LtEq, right)
    }
    pub fn gt(self, right: Expr) -> Expr {
        self.binary(BinaryOp::Gt, right)
    }
    pub fn gt_eq(self, right: Expr) -> Expr {
        self.binary(BinaryOp::GtEq, right)
    }
    pub fn and(self, right: Expr) -> Expr {
        self.binary(BinaryOp::And, right)
    }
    pub fn or(self, right: Expr) -> Expr {
        self.binary(BinaryOp::Or, right)
    }
    pub fn is_null(self) -> Expr {
        Expr::IsNull(Box::new(self))
    }
    pub fn is_not_null(self) -> Expr {
        Expr::IsNotNull(Box::new(self))
    }
    pub fn cast(self, to: DataType) -> Expr {
        Expr::Cast {
            expr: Box::new(self),
            to,
        }
    }
    /// A cast whose values that do not convert are null (the default [`Expr::cast`] fails).
    pub fn try_cast(self, to: DataType) -> Expr {
        null_on_error(self.cast(to))
    }
    pub fn contains(self, pattern: impl Into<String>) -> Expr {
        self.string(StringFunction::Contains(pattern.into()))
    }
    pub fn starts_with(self, prefix: impl Into<String>) -> Expr {
        self.string(StringFunction::StartsWith(prefix.into()))
    }
    pub fn lower(self) -> Expr {
        self.string(StringFunction::Lower)
    }
    pub fn upper(self) -> Expr {
        self.string(StringFunction::Upper)
    }
    pub fn length(self) -> Expr {
        self.string(StringFunction::Length)
    }
    pub fn substring(self, start: i64, length: Option<u64>) -> Expr {
        self.string(StringFunction::Substring { start, length })
    }
    pub fn regex_match(self, pattern: impl Into<String>) -> Expr {
        self.string(StringFunction::RegexMatch(pattern.into()))
    }

    /// How many levels the expression nests, counted as the wire decoder counts them: a column
    /// or a literal is 0, any other node one more than its deepest argument. A plan refuses
    /// an expression deeper than [`crate::plan::MAX_EXPR_DEPTH`]; this walk uses no recursion,
    /// so measuring any expression is safe.
    pub fn depth(&self) -> u32 {
        let mut deepest = 0;
        let mut pending = vec![(self, 0u32)];
        while let Some((expr, depth)) = pending.pop() {
            let children = expr.arguments();
            // A node with arguments, even an empty list of them (`coalesce()`), decodes them
            // one level deeper.
            let own = match expr {
                Expr::Column(_) | Expr::Literal(_) => depth,
                _ => depth + 1,
            };
            deepest = deepest.max(own);
            pending.extend(children.into_iter().map(|child| (child, depth + 1)));
        }
        deepest
    }

    /// The expressions this one applies to, in order.
    fn arguments(&self) -> Vec<&Expr> {
        match self {
            Expr::Column(_) | Expr::Literal(_) => Vec::new(),
            Expr::Binary { left, right, .. } => vec![&**left, &**right],
            Expr::Not(inner)
            | Expr::Negate(inner)
            | Expr::IsNull(inner)
            | Expr::IsNotNull(inner)
            | Expr::Cast { expr: inner, .. }
            | Expr::NullOnError(inner)
            | Expr::String { expr: inner, .. } => vec![&**inner],
            Expr::Coalesce(items) | Expr::Hash(items) => items.iter().collect(),
            Expr::IfThenElse {
                condition,
                then,
                otherwise,
            } => vec![&**condition, &**then, &**otherwise],
        }
    }

    /// Every column name the expression reads, in first-use order, without repeats.
    pub fn columns(&self) -> Vec<&str> {
        let mut names = Vec::new();
        self.visit_columns(&mut |name| {
            if !names.contains(&name) {
                names.push(name);
            }
        });
        names
    }

    fn visit_columns<'a>(&'a self, visit: &mut impl FnMut(&'a str)) {
        match self {
            Expr::Column(name) => visit(name),
            Expr::Literal(_) => {}
            Expr::Binary { left, right, .. } => {
                left.visit_columns(visit);
                right.visit_columns(visit);
            }
            Expr::Not(inner)
            | Expr::Negate(inner)
            | Expr::IsNull(inner)
            | Expr::IsNotNull(inner)
            | Expr::Cast { expr: inner, .. }
            | Expr::NullOnError(inner)
            | Expr::String { expr: inner, .. } => inner.visit_columns(visit),
            Expr::Coalesce(items) | Expr::Hash(items) => {
                items.iter().for_each(|item| item.visit_columns(visit))
            }
            Expr::IfThenElse {
                condition,
                then,
                otherwise,
            } => {
                condition.visit_columns(visit);
                then.visit_columns(visit);
                otherwise.visit_columns(visit);
            }
        }
    }

    /// The same expression with every column renamed by `rename` (used to move expressions
    /// across `rename` operators).
    pub fn map_columns(&self, rename: &impl Fn(&str) -> String) -> Expr {
        let map = |inner: &Expr| Box::new(inner.map_columns(rename));
        match self {
            Expr::Column(name) => Expr::Column(rename(name)),
            Expr::Literal(value) => Expr::Literal(value.clone()),
            Expr::Binary { op, left, right } => Expr::Binary {
                op: *op,
                left: map(left),
                right: map(right),
            },
            Expr::Not(inner) => Expr::Not(map(inner)),
            Expr::Negate(inner) => Expr::Negate(map(inner)),
            Expr::IsNull(inner) => Expr::IsNull(map(inner)),
            Expr::IsNotNull(inner) => Expr::IsNotNull(map(inner)),
            Expr::NullOnError(inner) => Expr::NullOnError(map(inner)),
            Expr::Coalesce(items) => {
                Expr::Coalesce(items.iter().map(|i| i.map_columns(rename)).collect())
            }
            Expr::Hash(items) => Expr::Hash(items.iter().map(|i| i.map_columns(rename)).collect()),
            Expr::Cast { expr, to } => Expr::Cast {
                expr: map(expr),
                to: to.clone(),
            },
            Expr::String { function, expr } => Expr::String {
                function: function.clone(),
                expr: map(expr),
            },
            Expr::IfThenElse {
                condition,
                then,
                otherwise,
            } => Expr::IfThenElse {
                condition: map(condition),
                then: map(then),
                otherwise: map(otherwise),
            },
        }
    }

    /// The conjuncts of a predicate: `a and (b and c)` → `[a, b, c]`.
    pub fn conjuncts(&self) -> Vec<&Expr> {
        match self {
            Expr::Binary {
                op: BinaryOp::And,
                left,
                right,
            } => {
                let mut parts = left.conjuncts();
                parts.extend(right.conjuncts());
                parts
            }
            other => vec![other],
        }
    }

    /// The type and nullability of the expression's result over rows of `schema`, or the error
    /// that names `operator`, the offending sub-expression and the types involved.
    pub fn to_field(
        &self,
        schema: &Schema,
        operator: &str,
        name: &str,
    ) -> Result<Field, PlanError> {
        let (data_type, nullable) = types::infer(self, schema, operator)?;
        Ok(Field::new(name, data_type, nullable))
    }

    /// Only the result type; see [`Expr::to_field`].
    pub fn data_type(&self, schema: &Schema, operator: &str) -> Result<DataType, PlanError> {
        types::infer(self, schema, operator).map(|(data_type, _)| data_type)
    }

    /// The expression as a fingerprint argument: a list per node, its name first.
    pub fn to_arg(&self) -> ArgValue {
        let node = |name: &str, mut rest: Vec<ArgValue>| {
            rest.insert(0, ArgValue::Str(name.to_owned()));
            ArgValue::List(rest)
        };
        match self {
            Expr::Column(name) => node("col", vec![ArgValue::Str(name.clone())]),
            Expr::Literal(value) => node("lit", vec![value.to_arg()]),
            // Arithmetic, negation and casts became strict in version 2: a cached result
            // computed under the old null-on-failure rule must not answer for them.
            Expr::Binary { op, left, right } => node(
                if op.is_arithmetic() {
                    "binary.v2"
                } else {
                    "binary"
                },
                vec![
                    ArgValue::Str(op.symbol().to_owned()),
                    left.to_arg(),
                    right.to_arg(),
                ],
            ),
            Expr::Not(inner) => node("not", vec![inner.to_arg()]),
            Expr::Negate(inner) => node("negate.v2", vec![inner.to_arg()]),
            Expr::NullOnError(inner) => node("try", vec![inner.to_arg()]),
            Expr::IsNull(inner) => node("is_null", vec![inner.to_arg()]),
            Expr::IsNotNull(inner) => node("is_not_null", vec![inner.to_arg()]),
            Expr::Coalesce(items) => node("coalesce", items.iter().map(Expr::to_arg).collect()),
            Expr::Hash(items) => node("hash", items.iter().map(Expr::to_arg).collect()),
            Expr::Cast { expr, to } => node("cast.v2", vec![expr.to_arg(), type_arg(to)]),
            Expr::String { function, expr } => {
                let mut args = vec![expr.to_arg()];
                args.extend(function.args());
                node(function.name(), args)
            }
            Expr::IfThenElse {
                condition,
                then,
                otherwise,
            } => node(
                "if",
                vec![condition.to_arg(), then.to_arg(), otherwise.to_arg()],
            ),
        }
    }
}

macro_rules! arithmetic_operator {
    ($($trait:ident :: $method:ident => $op:ident),* $(,)?) => {
        $(impl std::ops::$trait for Expr {
            type Output = Expr;
            fn $method(self, right: Expr) -> Expr {
                self.binary(BinaryOp::$op, right)
            }
        })*
    };
}

arithmetic_operator!(
    Add::add => Add,
    Sub::sub => Subtract,
    Mul::mul => Multiply,
    Div::div => Divide,
    Rem::rem => Remainder,
);

impl std::ops::Not for Expr {
    type Output = Expr;
    fn not(self) -> Expr {
        Expr::Not(Box::new(self))
    }
}

impl std::ops::Neg for Expr {
    type Output = Expr;
    fn neg(self) -> Expr {
        Expr::Negate(Box::new(self))
    }
}

fn write_list(f: &mut fmt::Formatter<'_>, items: &[Expr]) -> fmt::Result {
    for (index, item) in items.iter().enumerate() {
        if index > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{item}")?;
    }
    Ok(())
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Column(name) => write!(f, "col({name:?})"),
            Expr::Literal(value) => write!(f, "{value}"),
            Expr::Binary { op, left, right } => write!(f, "({left} {} {right})", op.symbol()),
            Expr::Not(inner) => write!(f, "not({inner})"),
            Expr::Negate(inner) => write!(f, "-({inner})"),
            Expr::IsNull(inner) => write!(f, "is_null({inner})"),
            Expr::IsNotNull(inner) => write!(f, "is_not_null({inner})"),
            Expr::NullOnError(inner) => write!(f, "try({inner})"),
            Expr::Coalesce(items) => {
                f.write_str("coalesce(")?;
                write_list(f, items)?;
                f.write_str(")")
            }
            Expr::Hash(items) => {
                f.write_str("hash(")?;
                write_list(f, items)?;
                f.write_str(")")
            }
            Expr::Cast { expr, to } => write!(f, "cast({expr} as {to:?})"),
            Expr::String { function, expr } => match function {
                StringFunction::Contains(p)
                | StringFunction::StartsWith(p)
                | StringFunction::RegexMatch(p) => write!(f, "{}({expr}, {p:?})", function.name()),
                StringFunction::Substring { start, length } => match length {
                    Some(length) => write!(f, "substring({expr}, {start}, {length})"),
                    None => write!(f, "substring({expr}, {start})"),
                },
                _ => write!(f, "{}({expr})", function.name()),
            },
            Expr::IfThenElse {
                condition,
                then,
                otherwise,
            } => write!(f, "if({condition}, {then}, {otherwise})"),
        }
    }
}

#[cfg(test)]
mod tests;
