//! Type inference for expressions (the rules are documented on the parent module).

use arrow_schema::{DataType, Schema};

use super::Expr;
use crate::plan::PlanError;

/// The type two numeric operands are computed in, or `None` when one is not numeric.
pub fn arithmetic_type(left: &DataType, right: &DataType) -> Option<DataType> {
    let numeric = |t: &DataType| t.is_integer() || t.is_floating() || *t == DataType::Null;
    if !numeric(left) || !numeric(right) {
        return None;
    }
    Some(if left.is_floating() || right.is_floating() {
        DataType::Float64
    } else if unsigned_or_null(left) && unsigned_or_null(right) {
        DataType::UInt64
    } else {
        DataType::Int64
    })
}

fn unsigned_or_null(t: &DataType) -> bool {
    t.is_unsigned_integer() || *t == DataType::Null
}

/// `Utf8`, `LargeUtf8` or `Utf8View`.
pub fn is_string(t: &DataType) -> bool {
    matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
}

/// A type both values can be compared or merged in (comparison, `coalesce`, `if` branches).
pub fn common_type(left: &DataType, right: &DataType) -> Option<DataType> {
    match (left, right) {
        (DataType::Null, other) | (other, DataType::Null) => Some(other.clone()),
        (l, r) if l == r => Some(l.clone()),
        (l, r) if is_string(l) && is_string(r) => Some(DataType::Utf8),
        (l, r) => arithmetic_type(l, r),
    }
}

/// Types `cast` accepts, as source and target: the scalar types Arrow converts between.
fn castable(t: &DataType) -> bool {
    t.is_integer()
        || t.is_floating()
        || is_string(t)
        || matches!(
            t,
            DataType::Null
                | DataType::Boolean
                | DataType::Date32
                | DataType::Date64
                | DataType::Timestamp(_, _)
                | DataType::Binary
        )
}

/// Integers and floats.
pub fn is_numeric(t: &DataType) -> bool {
    t.is_integer() || t.is_floating()
}

/// Types with a total order that comparisons, sorts and min/max use.
pub fn is_orderable(t: &DataType) -> bool {
    t.is_integer()
        || t.is_floating()
        || is_string(t)
        || t.is_temporal()
        || matches!(t, DataType::Boolean | DataType::Null | DataType::Binary)
}

fn mismatch(operator: &str, expr: &Expr, expected: &str, actual: &DataType) -> PlanError {
    PlanError::TypeMismatch {
        operator: operator.to_owned(),
        expr: expr.to_string(),
        expected: expected.to_owned(),
        actual: actual.to_string(),
    }
}

/// `(type, nullable)` of `expr` over `schema`.
pub(super) fn infer(
    expr: &Expr,
    schema: &Schema,
    operator: &str,
) -> Result<(DataType, bool), PlanError> {
    Inference { schema, operator }.infer(expr)
}

/// Type inference over one schema for one operator's errors. Each kind of expression has its
/// own method, so the recursion carries only that kind's locals on the stack: a debug build's
/// frame of one function holding every arm's locals would be many times larger.
struct Inference<'a> {
    schema: &'a Schema,
    operator: &'a str,
}

impl Inference<'_> {
    fn infer(&self, expr: &Expr) -> Result<(DataType, bool), PlanError> {
        match expr {
            Expr::Column(name) => self.column(name),
            Expr::Literal(value) => {
                let data_type = value.data_type();
                let nullable = data_type == DataType::Null;
                Ok((data_type, nullable))
            }
            Expr::Binary { op, left, right } => self.binary(expr, *op, left, right),
            Expr::Not(inner) => self.not(inner),
            Expr::Negate(inner) => self.negate(inner),
            Expr::IsNull(inner) | Expr::IsNotNull(inner) => {
                self.infer(inner)?;
                Ok((DataType::Boolean, false))
            }
            Expr::Coalesce(items) => self.coalesce(items),
            Expr::Cast { expr: inner, to } => self.cast(inner, to),
            Expr::NullOnError(inner) => Ok((self.infer(inner)?.0, true)),
            Expr::String {
                function,
                expr: inner,
            } => self.string(function, inner),
            Expr::Hash(items) => self.hash(items),
            Expr::IfThenElse {
                condition,
                then,
                otherwise,
            } => self.if_then_else(condition, then, otherwise),
        }
    }

    fn mismatch(&self, expr: &Expr, expected: &str, actual: &DataType) -> PlanError {
        mismatch(self.operator, expr, expected, actual)
    }

    fn invalid(&self, message: impl Into<String>) -> PlanError {
        PlanError::InvalidArgument {
            operator: self.operator.to_owned(),
            message: message.into(),
        }
    }

    fn column(&self, name: &str) -> Result<(DataType, bool), PlanError> {
        match self.schema.column_with_name(name) {
            Some((_, field)) => Ok((field.data_type().clone(), field.is_nullable())),
            None => Err(PlanError::unknown_column(self.operator, name, self.schema)),
        }
    }

    fn binary(
        &self,
        expr: &Expr,
        op: super::BinaryOp,
        left: &Expr,
        right: &Expr,
    ) -> Result<(DataType, bool), PlanError> {
        let (left_type, left_null) = self.infer(left)?;
        let (right_type, right_null) = self.infer(right)?;
        let binary_mismatch = |expected: &str| PlanError::OperandMismatch {
            operator: self.operator.to_owned(),
            expr: expr.to_string(),
            op: op.symbol().to_owned(),
            expected: expected.to_owned(),
            operands: format!("{} and {}", type_name(&left_type), type_name(&right_type)),
        };
        if op.is_arithmetic() {
            let result = arithmetic_type(&left_type, &right_type)
                .ok_or_else(|| binary_mismatch("numeric operands"))?;
            // Overflow and division by zero give null, so arithmetic is always nullable.
            Ok((result, true))
        } else if op.is_comparison() {
            let comparable = common_type(&left_type, &right_type)
                .filter(is_orderable)
                .is_some();
            if !comparable {
                return Err(binary_mismatch("operands of one comparable type"));
            }
            Ok((DataType::Boolean, left_null || right_null))
        } else {
            let boolean = |t: &DataType| matches!(t, DataType::Boolean | DataType::Null);
            if !boolean(&left_type) || !boolean(&right_type) {
                return Err(binary_mismatch("Boolean operands"));
            }
            Ok((DataType::Boolean, left_null || right_null))
        }
    }

    fn not(&self, inner: &Expr) -> Result<(DataType, bool), PlanError> {
        let (data_type, nullable) = self.infer(inner)?;
        if !matches!(data_type, DataType::Boolean | DataType::Null) {
            return Err(self.mismatch(inner, "Boolean for not", &data_type));
        }
        Ok((DataType::Boolean, nullable))
    }

    fn negate(&self, inner: &Expr) -> Result<(DataType, bool), PlanError> {
        let (data_type, _) = self.infer(inner)?;
        if data_type.is_unsigned_integer() || arithmetic_type(&data_type, &data_type).is_none() {
            return Err(self.mismatch(inner, "a signed numeric type for negation", &data_type));
        }
        let result = arithmetic_type(&data_type, &DataType::Int64).unwrap_or(DataType::Int64);
        Ok((result, true))
    }

    fn coalesce(&self, items: &[Expr]) -> Result<(DataType, bool), PlanError> {
        let Some(first) = items.first() else {
            return Err(self.invalid("coalesce needs at least one argument"));
        };
        let (mut data_type, mut nullable) = self.infer(first)?;
        for item in &items[1..] {
            let (item_type, item_null) = self.infer(item)?;
            data_type = common_type(&data_type, &item_type).ok_or_else(|| {
                self.mismatch(
                    item,
                    &format!("a type compatible with {}", type_name(&data_type)),
                    &item_type,
                )
            })?;
            // Non-null as soon as one argument can never be null.
            nullable &= item_null;
        }
        Ok((data_type, nullable))
    }

    fn cast(&self, inner: &Expr, to: &DataType) -> Result<(DataType, bool), PlanError> {
        let (from, _) = self.infer(inner)?;
        if !castable(&from) || !castable(to) {
            return Err(PlanError::UnsupportedCast {
                operator: self.operator.to_owned(),
                expr: inner.to_string(),
                from: from.to_string(),
                to: to.to_string(),
            });
        }
        // A value that does not fit the target becomes null.
        Ok((to.clone(), true))
    }

    fn string(
        &self,
        function: &super::StringFunction,
        inner: &Expr,
    ) -> Result<(DataType, bool), PlanError> {
        let (data_type, nullable) = self.infer(inner)?;
        if !is_string(&data_type) && data_type != DataType::Null {
            return Err(self.mismatch(inner, &format!("Utf8 for {}", function.name()), &data_type));
        }
        if let super::StringFunction::RegexMatch(pattern) = function {
            regex::Regex::new(pattern).map_err(|error| {
                self.invalid(format!("invalid regular expression {pattern:?}: {error}"))
            })?;
        }
        Ok((function.output_type(), nullable))
    }

    fn hash(&self, items: &[Expr]) -> Result<(DataType, bool), PlanError> {
        if items.is_empty() {
            return Err(self.invalid("hash needs at least one argument"));
        }
        for item in items {
            self.infer(item)?;
        }
        Ok((DataType::UInt64, false))
    }

    fn if_then_else(
        &self,
        condition: &Expr,
        then: &Expr,
        otherwise: &Expr,
    ) -> Result<(DataType, bool), PlanError> {
        let (condition_type, _) = self.infer(condition)?;
        if !matches!(condition_type, DataType::Boolean | DataType::Null) {
            return Err(self.mismatch(condition, "Boolean for the if condition", &condition_type));
        }
        let (then_type, then_null) = self.infer(then)?;
        let (else_type, else_null) = self.infer(otherwise)?;
        let data_type = common_type(&then_type, &else_type).ok_or_else(|| {
            self.mismatch(
                otherwise,
                &format!("the then-branch's type {}", type_name(&then_type)),
                &else_type,
            )
        })?;
        Ok((data_type, then_null || else_null))
    }
}

/// How a type is named in error messages.
pub(crate) fn type_name(data_type: &DataType) -> String {
    format!("{data_type}")
}
