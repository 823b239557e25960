//! Expression evaluation over record batches with Arrow's compute kernels.
//!
//! Types follow [`floe_core::expr`]'s inference exactly (so a batch's schema is the plan's),
//! and so do its rules for values without an answer: integer overflow, division or remainder
//! by zero and casts that do not convert are an [`Error::NoAnswer`] naming the expression and
//! the first such value, or null inside [`Expr::NullOnError`].

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, ArrowPrimitiveType, BinaryArray, BooleanArray, Date32Array, Datum,
    Float32Array, Float64Array, Int8Array, Int16Array, Int32Array, Int64Array, PrimitiveArray,
    StringArray, UInt8Array, UInt16Array, UInt32Array, UInt64Array, new_null_array,
};
use arrow::buffer::{BooleanBuffer, NullBuffer};
use arrow::compute::kernels::cmp;
use arrow::compute::kernels::comparison::{contains, regexp_is_match_scalar, starts_with};
use arrow::compute::kernels::substring::substring_by_char;
use arrow::compute::kernels::zip::zip;
use arrow::compute::{
    CastOptions, and_kleene, cast_with_options, filter_record_batch, interleave, is_not_null,
    is_null, not, or_kleene, prep_null_mask_filter,
};
use arrow::datatypes::{DataType, Float64Type, Int64Type, UInt64Type};
use arrow::record_batch::RecordBatch;
use arrow::row::{RowConverter, SortField};
use floe_core::expr::{
    BinaryOp, Expr, Scalar, StringFunction, arithmetic_type, common_type, is_string,
};
use floe_core::hash::xxh3_64;

use crate::{Error, Result};

/// Evaluates `expr` over every row of `batch`, giving an array of `batch.num_rows()` values.
pub fn evaluate(expr: &Expr, batch: &RecordBatch) -> Result<ArrayRef> {
    evaluate_as(expr, batch, OnNoAnswer::Fail)
}

/// What a value without an answer (overflow, division by zero, a cast that does not convert)
/// becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OnNoAnswer {
    /// The task fails, naming the expression and the value.
    Fail,
    /// Null for that row (inside `try`).
    Null,
}

fn evaluate_as(expr: &Expr, batch: &RecordBatch, mode: OnNoAnswer) -> Result<ArrayRef> {
    let evaluate = |expr: &Expr, batch: &RecordBatch| evaluate_as(expr, batch, mode);
    let rows = batch.num_rows();
    match expr {
        Expr::Column(name) => batch.column_by_name(name).cloned().ok_or_else(|| {
            Error::from(floe_core::PlanError::UnknownColumn {
                operator: "evaluate".to_owned(),
                column: name.clone(),
                available: floe_core::plan::describe_schema(&batch.schema()),
            })
        }),
        Expr::Literal(value) => Ok(literal_array(value, rows)),
        Expr::Binary { op, left, right } => {
            let both_literal = matches!((&**left, &**right), (Expr::Literal(_), Expr::Literal(_)));
            let fail = (mode == OnNoAnswer::Fail).then_some(expr);
            if (op.is_arithmetic() || op.is_comparison()) && !both_literal {
                let (left, right) = (operand(left, batch, mode)?, operand(right, batch, mode)?);
                return binary_operands(*op, &left, &right, rows, fail);
            }
            let left = evaluate(left, batch)?;
            let right = evaluate(right, batch)?;
            binary(*op, &left, &right, fail)
        }
        Expr::Not(inner) => Ok(Arc::new(not(&as_boolean(&evaluate(inner, batch)?)?)?)),
        Expr::Negate(inner) => {
            let value = evaluate(inner, batch)?;
            let target =
                arithmetic_type(value.data_type(), &DataType::Int64).unwrap_or(DataType::Int64);
            let value = safe_cast(&value, &target)?;
            match target {
                DataType::Float64 => Ok(Arc::new(
                    primitive::<Float64Type>(&value)?.unary::<_, Float64Type>(|x| -x),
                )),
                _ => {
                    let negated = checked_unary::<Int64Type>(primitive(&value)?, i64::checked_neg);
                    if mode == OnNoAnswer::Fail {
                        no_answer_at(&value, &negated)
                            .map_or(Ok(()), |row| Err(overflow(expr, &[(&value, row)])))?;
                    }
                    Ok(Arc::new(negated))
                }
            }
        }
        Expr::IsNull(inner) => Ok(Arc::new(is_null(&evaluate(inner, batch)?)?)),
        Expr::IsNotNull(inner) => Ok(Arc::new(is_not_null(&evaluate(inner, batch)?)?)),
        Expr::Coalesce(items) => {
            let values = items
                .iter()
                .map(|item| evaluate(item, batch))
                .collect::<Result<Vec<_>>>()?;
            let target = values
                .iter()
                .try_fold(DataType::Null, |acc, v| common_type(&acc, v.data_type()))
                .unwrap_or(DataType::Null);
            let mut values = values
                .iter()
                .map(|v| safe_cast(v, &target))
                .collect::<Result<Vec<_>>>()?;
            let mut result = values
                .pop()
                .unwrap_or_else(|| new_null_array(&target, rows));
            while let Some(value) = values.pop() {
                result = zip(&is_not_null(&value)?, &value, &result)?;
            }
            Ok(result)
        }
        Expr::Cast { expr: inner, to } => {
            let value = evaluate(inner, batch)?;
            let cast = safe_cast(&value, to)?;
            if mode == OnNoAnswer::Fail
                && let Some(row) = no_answer_at(&value, &cast)
            {
                return Err(Error::NoAnswer {
                    expr: expr.to_string(),
                    message: format!(
                        "{} does not convert to {to}; try_cast gives null instead",
                        show_value(&value, row)
                    ),
                });
            }
            Ok(cast)
        }
        Expr::NullOnError(inner) => evaluate_as(inner, batch, OnNoAnswer::Null),
        Expr::String { function, expr } => {
            let value = safe_cast(&evaluate(expr, batch)?, &DataType::Utf8)?;
            string_function(function, &value)
        }
        Expr::Hash(items) => {
            let values = items
                .iter()
                .map(|item| evaluate(item, batch))
                .collect::<Result<Vec<_>>>()?;
            hash_rows(&values, rows)
        }
        Expr::IfThenElse {
            condition,
            then,
            otherwise,
        } => {
            // Each branch is evaluated only on the rows it answers for, so
            // `when(b != 0, a / b, null)` never divides by zero.
            let mask = nulls_as_false(&as_boolean(&evaluate(condition, batch)?)?);
            let then = evaluate(then, &rows_of(then, batch, &mask)?)?;
            let otherwise = evaluate(otherwise, &rows_of(otherwise, batch, &not(&mask)?)?)?;
            let target =
                common_type(then.data_type(), otherwise.data_type()).unwrap_or(DataType::Null);
            let (then, otherwise) = (safe_cast(&then, &target)?, safe_cast(&otherwise, &target)?);
            let (mut next_then, mut next_otherwise) = (0, 0);
            let indices: Vec<(usize, usize)> = mask
                .values()
                .iter()
                .map(|selected| {
                    let (side, next) = if selected {
                        (0, &mut next_then)
                    } else {
                        (1, &mut next_otherwise)
                    };
                    *next += 1;
                    (side, *next - 1)
                })
                .collect();
            Ok(interleave(&[then.as_ref(), otherwise.as_ref()], &indices)?)
        }
    }
}

/// The rows of `batch` that `mask` selects, with only the columns `expr` reads.
fn rows_of(expr: &Expr, batch: &RecordBatch, mask: &BooleanArray) -> Result<RecordBatch> {
    let schema = batch.schema();
    let indices: Vec<usize> = expr
        .columns()
        .iter()
        .filter_map(|name| schema.index_of(name).ok())
        .collect();
    let projected = batch.project(&indices)?;
    Ok(filter_record_batch(&projected, mask)?)
}

/// Evaluates a predicate to a selection mask where null counts as false.
pub fn evaluate_predicate(predicate: &Expr, batch: &RecordBatch) -> Result<BooleanArray> {
    let value = evaluate(predicate, batch)?;
    Ok(nulls_as_false(&as_boolean(&value)?))
}

/// A mask where null is false (Arrow's helper expects a null buffer to exist).
fn nulls_as_false(mask: &BooleanArray) -> BooleanArray {
    if mask.null_count() == 0 {
        mask.clone()
    } else {
        prep_null_mask_filter(mask)
    }
}

/// The first row where `input` has a value and `output` has none: a value without an answer.
fn no_answer_at(input: &dyn Array, output: &dyn Array) -> Option<usize> {
    if output.null_count() == input.null_count() {
        return None;
    }
    (0..output.len()).find(|row| output.is_null(*row) && input.is_valid(*row))
}

/// One value of `array` as the error shows it (strings quoted).
fn show_value(array: &ArrayRef, row: usize) -> String {
    let text = arrow::util::display::array_value_to_string(array, row)
        .unwrap_or_else(|_| "a value".to_owned());
    if is_string(array.data_type()) {
        format!("{text:?}")
    } else {
        text
    }
}

/// The error for integer overflow in `expr`, with the operands' values at their rows.
fn overflow(expr: &Expr, operands: &[(&ArrayRef, usize)]) -> Error {
    let values: Vec<String> = operands
        .iter()
        .map(|(array, row)| show_value(array, *row))
        .collect();
    Error::NoAnswer {
        expr: expr.to_string(),
        message: format!(
            "integer overflow at ({}); try(…) gives null instead",
            values.join(", ")
        ),
    }
}

/// A value that does not fit the target type becomes null (used where the conversion cannot
/// fail: type promotion, or inside `try`).
pub fn safe_cast(array: &ArrayRef, to: &DataType) -> Result<ArrayRef> {
    if array.data_type() == to {
        return Ok(array.clone());
    }
    let options = CastOptions {
        safe: true,
        ..CastOptions::default()
    };
    Ok(cast_with_options(array, to, &options)?)
}

fn as_boolean(array: &ArrayRef) -> Result<BooleanArray> {
    let array = safe_cast(array, &DataType::Boolean)?;
    array
        .as_any()
        .downcast_ref::<BooleanArray>()
        .cloned()
        .ok_or_else(|| type_error("Boolean", array.data_type()))
}

fn type_error(expected: &str, actual: &DataType) -> Error {
    Error::Arrow(arrow::error::ArrowError::InvalidArgumentError(format!(
        "expected {expected}, got {actual}"
    )))
}

fn primitive<T: ArrowPrimitiveType>(array: &ArrayRef) -> Result<&PrimitiveArray<T>> {
    array
        .as_any()
        .downcast_ref::<PrimitiveArray<T>>()
        .ok_or_else(|| type_error(&T::DATA_TYPE.to_string(), array.data_type()))
}

/// A literal repeated `rows` times.
pub fn literal_array(value: &Scalar, rows: usize) -> ArrayRef {
    match value {
        Scalar::Null => new_null_array(&DataType::Null, rows),
        Scalar::Boolean(v) => Arc::new(BooleanArray::from(vec![*v; rows])),
        Scalar::Int8(v) => Arc::new(Int8Array::from_value(*v, rows)),
        Scalar::Int16(v) => Arc::new(Int16Array::from_value(*v, rows)),
        Scalar::Int32(v) => Arc::new(Int32Array::from_value(*v, rows)),
        Scalar::Int64(v) => Arc::new(Int64Array::from_value(*v, rows)),
        Scalar::UInt8(v) => Arc::new(UInt8Array::from_value(*v, rows)),
        Scalar::UInt16(v) => Arc::new(UInt16Array::from_value(*v, rows)),
        Scalar::UInt32(v) => Arc::new(UInt32Array::from_value(*v, rows)),
        Scalar::UInt64(v) => Arc::new(UInt64Array::from_value(*v, rows)),
        Scalar::Float32(v) => Arc::new(Float32Array::from_value(*v, rows)),
        Scalar::Float64(v) => Arc::new(Float64Array::from_value(*v, rows)),
        Scalar::Utf8(v) => Arc::new(StringArray::from_iter_values(std::iter::repeat_n(v, rows))),
        Scalar::Binary(v) => Arc::new(BinaryArray::from_iter_values(std::iter::repeat_n(v, rows))),
        Scalar::Date32(v) => Arc::new(Date32Array::from_value(*v, rows)),
    }
}

/// One side of an arithmetic or comparison operator: an array with a value per row, or a
/// literal kept as a one-element array, so a constant is never repeated row by row (arrow's
/// comparison kernels take it as a `Scalar` datum).
struct Operand {
    values: ArrayRef,
    scalar: bool,
}

impl Operand {
    fn cast(&self, to: &DataType) -> Result<Operand> {
        Ok(Operand {
            values: safe_cast(&self.values, to)?,
            scalar: self.scalar,
        })
    }
}

fn operand(expr: &Expr, batch: &RecordBatch, mode: OnNoAnswer) -> Result<Operand> {
    Ok(match expr {
        Expr::Literal(value) => Operand {
            values: literal_array(value, 1),
            scalar: true,
        },
        other => Operand {
            values: evaluate_as(other, batch, mode)?,
            scalar: false,
        },
    })
}

/// `op` on each pair of values (a scalar side repeats its one value); null where an input is
/// null or `op` has no answer. One pass over the value slices; validity bits are packed 64 at
/// a time. Also the first row where `op` had no answer for two values, if any.
fn checked_binary<T: ArrowPrimitiveType>(
    (left, left_scalar): (&PrimitiveArray<T>, bool),
    (right, right_scalar): (&PrimitiveArray<T>, bool),
    rows: usize,
    op: impl Fn(T::Native, T::Native) -> Option<T::Native>,
) -> (PrimitiveArray<T>, Option<usize>) {
    if (left_scalar && left.is_null(0)) || (right_scalar && right.is_null(0)) {
        return (PrimitiveArray::new_null(rows), None);
    }
    let (a, b) = (left.values(), right.values());
    let at =
        |values: &[T::Native], scalar: bool, index: usize| values[if scalar { 0 } else { index }];
    let mut values = Vec::with_capacity(rows);
    // `collect_bool` calls the closure for 0, 1, … in order, so `values` lines up.
    let answered = BooleanBuffer::collect_bool(rows, |index| {
        let result = op(at(a, left_scalar, index), at(b, right_scalar, index));
        values.push(result.unwrap_or_default());
        result.is_some()
    });
    let row_nulls = |array: &'_ PrimitiveArray<T>, scalar: bool| {
        if scalar { None } else { array.nulls().cloned() }
    };
    let inputs_valid = NullBuffer::union(
        row_nulls(left, left_scalar).as_ref(),
        row_nulls(right, right_scalar).as_ref(),
    );
    let unanswered = (answered.count_set_bits() < rows)
        .then(|| {
            (0..rows).find(|row| {
                !answered.value(*row) && inputs_valid.as_ref().is_none_or(|v| v.is_valid(*row))
            })
        })
        .flatten();
    let valid = NullBuffer::union(Some(&NullBuffer::new(answered)), inputs_valid.as_ref());
    (PrimitiveArray::new(values.into(), valid), unanswered)
}

fn checked_unary<T: ArrowPrimitiveType>(
    value: &PrimitiveArray<T>,
    op: impl Fn(T::Native) -> Option<T::Native>,
) -> PrimitiveArray<T> {
    value.iter().map(|v| v.and_then(&op)).collect()
}

macro_rules! integer_arithmetic {
    ($op:expr, $left:expr, $right:expr, $rows:expr, $type:ty) => {{
        let l = (primitive::<$type>(&$left.values)?, $left.scalar);
        let r = (primitive::<$type>(&$right.values)?, $right.scalar);
        let (result, unanswered) = match $op {
            BinaryOp::Add => checked_binary(l, r, $rows, |a, b| a.checked_add(b)),
            BinaryOp::Subtract => checked_binary(l, r, $rows, |a, b| a.checked_sub(b)),
            BinaryOp::Multiply => checked_binary(l, r, $rows, |a, b| a.checked_mul(b)),
            BinaryOp::Divide => checked_binary(l, r, $rows, |a, b| a.checked_div(b)),
            _ => checked_binary(l, r, $rows, |a, b| a.checked_rem(b)),
        };
        (Arc::new(result) as ArrayRef, unanswered)
    }};
}

/// Arithmetic; with `fail` (the expression, in strict mode) a value without an answer is an
/// error naming it, else null.
fn arithmetic(
    op: BinaryOp,
    left: &Operand,
    right: &Operand,
    rows: usize,
    fail: Option<&Expr>,
) -> Result<ArrayRef> {
    let (left_type, right_type) = (left.values.data_type(), right.values.data_type());
    let target = arithmetic_type(left_type, right_type)
        .ok_or_else(|| type_error("numeric operands", left_type))?;
    let (left, right) = (left.cast(&target)?, right.cast(&target)?);
    let (result, unanswered) = match target {
        DataType::Float64 => {
            let l = (primitive::<Float64Type>(&left.values)?, left.scalar);
            let r = (primitive::<Float64Type>(&right.values)?, right.scalar);
            let (result, unanswered) = match op {
                BinaryOp::Add => checked_binary(l, r, rows, |a, b| Some(a + b)),
                BinaryOp::Subtract => checked_binary(l, r, rows, |a, b| Some(a - b)),
                BinaryOp::Multiply => checked_binary(l, r, rows, |a, b| Some(a * b)),
                BinaryOp::Divide => checked_binary(l, r, rows, |a, b| (b != 0.0).then(|| a / b)),
                _ => checked_binary(l, r, rows, |a, b| (b != 0.0).then(|| a % b)),
            };
            (Arc::new(result) as ArrayRef, unanswered)
        }
        DataType::UInt64 => integer_arithmetic!(op, left, right, rows, UInt64Type),
        _ => integer_arithmetic!(op, left, right, rows, Int64Type),
    };
    if let (Some(expr), Some(row)) = (fail, unanswered) {
        let at = |operand: &Operand| if operand.scalar { 0 } else { row };
        let operands = [(&left.values, at(&left)), (&right.values, at(&right))];
        return Err(match op {
            BinaryOp::Divide | BinaryOp::Remainder => Error::NoAnswer {
                expr: expr.to_string(),
                message: format!(
                    "division by zero ({} {} 0); try(…) gives null instead",
                    show_value(operands[0].0, operands[0].1),
                    op.symbol()
                ),
            },
            _ => overflow(expr, &operands),
        });
    }
    Ok(result)
}

fn comparison(op: BinaryOp, left: &Operand, right: &Operand) -> Result<ArrayRef> {
    let (left_type, right_type) = (left.values.data_type(), right.values.data_type());
    let target = common_type(left_type, right_type)
        .ok_or_else(|| type_error("comparable operands", right_type))?;
    let (left, right) = (left.cast(&target)?, right.cast(&target)?);
    let (left_scalar, right_scalar);
    let l: &dyn Datum = if left.scalar {
        left_scalar = arrow::array::Scalar::new(left.values.clone());
        &left_scalar
    } else {
        &left.values
    };
    let r: &dyn Datum = if right.scalar {
        right_scalar = arrow::array::Scalar::new(right.values.clone());
        &right_scalar
    } else {
        &right.values
    };
    let result = match op {
        BinaryOp::Eq => cmp::eq(l, r)?,
        BinaryOp::NotEq => cmp::neq(l, r)?,
        BinaryOp::Lt => cmp::lt(l, r)?,
        BinaryOp::LtEq => cmp::lt_eq(l, r)?,
        BinaryOp::Gt => cmp::gt(l, r)?,
        _ => cmp::gt_eq(l, r)?,
    };
    Ok(Arc::new(result))
}

/// Arithmetic and comparisons, where one side may be a literal (not both).
fn binary_operands(
    op: BinaryOp,
    left: &Operand,
    right: &Operand,
    rows: usize,
    fail: Option<&Expr>,
) -> Result<ArrayRef> {
    if op.is_arithmetic() {
        arithmetic(op, left, right, rows, fail)
    } else {
        comparison(op, left, right)
    }
}

/// Any binary operator over two full arrays (boolean logic, or two literals).
fn binary(
    op: BinaryOp,
    left: &ArrayRef,
    right: &ArrayRef,
    fail: Option<&Expr>,
) -> Result<ArrayRef> {
    if op.is_arithmetic() || op.is_comparison() {
        let operand = |values: &ArrayRef| Operand {
            values: values.clone(),
            scalar: false,
        };
        return binary_operands(op, &operand(left), &operand(right), left.len(), fail);
    }
    let (l, r) = (as_boolean(left)?, as_boolean(right)?);
    Ok(Arc::new(match op {
        BinaryOp::And => and_kleene(&l, &r)?,
        _ => or_kleene(&l, &r)?,
    }))
}

fn string_function(function: &StringFunction, value: &ArrayRef) -> Result<ArrayRef> {
    let strings = value
        .as_any()
        .downcast_ref::<StringArray>()
        .ok_or_else(|| type_error("Utf8", value.data_type()))?;
    let pattern = |text: &str| arrow::array::Scalar::new(StringArray::from(vec![text]));
    Ok(match function {
        StringFunction::Contains(needle) => Arc::new(contains(strings, &pattern(needle))?),
        StringFunction::StartsWith(prefix) => Arc::new(starts_with(strings, &pattern(prefix))?),
        StringFunction::RegexMatch(regex) => {
            Arc::new(regexp_is_match_scalar(strings, regex, None)?)
        }
        StringFunction::Lower => Arc::new(
            strings
                .iter()
                .map(|s| s.map(str::to_lowercase))
                .collect::<StringArray>(),
        ),
        StringFunction::Upper => Arc::new(
            strings
                .iter()
                .map(|s| s.map(str::to_uppercase))
                .collect::<StringArray>(),
        ),
        StringFunction::Length => Arc::new(
            strings
                .iter()
                .map(|s| s.map(|s| s.chars().count() as i64))
                .collect::<Int64Array>(),
        ),
        StringFunction::Substring { start, length } => {
            Arc::new(substring_by_char(strings, *start, *length)?)
        }
    })
}

/// xxh3-64 of each row's values in Arrow's row format, which encodes every value (and null)
/// unambiguously, so rows hash alike exactly when their values and types are equal.
fn hash_rows(values: &[ArrayRef], rows: usize) -> Result<ArrayRef> {
    let fields = values
        .iter()
        .map(|v| SortField::new(v.data_type().clone()))
        .collect();
    let converter = RowConverter::new(fields)?;
    let encoded = converter.convert_columns(values)?;
    let hashes: UInt64Array = (0..rows)
        .map(|i| xxh3_64(encoded.row(i).as_ref()))
        .collect();
    Ok(Arc::new(hashes))
}
