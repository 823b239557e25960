//! Errors found while a plan is built: they name the operator, the column and the types.

use arrow_schema::Schema;

use super::udf::{UdfCall, UdfCatalog};

/// Why a plan is invalid. Types are kept as their display names (the errors are for people).
/// Every message names the operator (with its main argument) so the
/// user can find the offending line of their pipeline.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("{operator}: unknown column {column:?} (available: {available})")]
    UnknownColumn {
        operator: String,
        column: String,
        available: String,
    },
    #[error("{operator}: expected {expected}, but {expr} has type {actual}")]
    TypeMismatch {
        operator: String,
        expr: String,
        expected: String,
        actual: String,
    },
    #[error("{operator}: {op} in {expr} needs {expected}, got {operands}")]
    OperandMismatch {
        operator: String,
        expr: String,
        op: String,
        expected: String,
        operands: String,
    },
    #[error("{operator}: cannot cast {expr} from {from} to {to}")]
    UnsupportedCast {
        operator: String,
        expr: String,
        from: String,
        to: String,
    },
    #[error("{operator}: key {column:?} is missing on the {side} side (available: {available})")]
    MissingJoinKey {
        operator: String,
        column: String,
        side: &'static str,
        available: String,
    },
    /// `left` and `right` read like `"id" is Int64`.
    #[error("{operator}: key types differ: left {left}, right {right}")]
    JoinKeyTypeMismatch {
        operator: String,
        left: String,
        right: String,
    },
    #[error("{operator}: schemas differ: left has {left}, right has {right}")]
    SchemaMismatch {
        operator: String,
        left: String,
        right: String,
    },
    #[error("{operator}: column {column:?} appears more than once")]
    DuplicateColumn { operator: String, column: String },
    #[error("{operator}: {message}")]
    InvalidArgument { operator: String, message: String },
    #[error("{operator}: unknown UDF {name:?}@{version} (registered: {registered})")]
    UnknownUdf {
        operator: String,
        name: String,
        version: u32,
        registered: String,
    },
    #[error(
        "{operator}: the plan holds a random_shuffle without a seed; resolve seeds at submission"
    )]
    UnresolvedSeed { operator: String },
    /// Every walk over a plan (validation, optimizer, encoding, display, drop) goes one level
    /// per step, so a plan's depth is bounded where its nodes are built.
    #[error(
        "{operator}: this step would make the plan {depth} steps deep along its longest path; \
         at most {limit} are allowed (floe_core::plan::MAX_PLAN_DEPTH). Split the job: write \
         an intermediate result and read it back in a second job"
    )]
    PlanTooDeep {
        operator: String,
        depth: u32,
        limit: u32,
    },
    #[error(
        "{operator}: the expression nests {depth} levels deep; at most {limit} are allowed \
         (floe_core::plan::MAX_EXPR_DEPTH). Split it over several with_column steps"
    )]
    ExpressionTooDeep {
        operator: String,
        depth: u32,
        limit: u32,
    },
    #[error(transparent)]
    Fingerprint(#[from] FingerprintErrorText),
}

/// [`crate::FingerprintError`] holds an `io::Error` and is not `Clone`; plan errors keep its text.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct FingerprintErrorText(pub String);

impl From<crate::FingerprintError> for PlanError {
    fn from(error: crate::FingerprintError) -> Self {
        PlanError::Fingerprint(FingerprintErrorText(error.to_string()))
    }
}

impl PlanError {
    pub fn unknown_column(operator: &str, column: &str, schema: &Schema) -> Self {
        PlanError::UnknownColumn {
            operator: operator.to_owned(),
            column: column.to_owned(),
            available: describe_schema(schema),
        }
    }

    /// `call` names no UDF of `catalog`; the message lists the ones it has.
    pub fn unknown_udf(operator: &str, call: &UdfCall, catalog: &dyn UdfCatalog) -> Self {
        PlanError::UnknownUdf {
            operator: operator.to_owned(),
            name: call.name.clone(),
            version: call.version,
            registered: catalog.registered().join(", "),
        }
    }

    pub(crate) fn invalid(operator: &str, message: impl Into<String>) -> Self {
        PlanError::InvalidArgument {
            operator: operator.to_owned(),
            message: message.into(),
        }
    }
}

/// `id Int64, name Utf8` — how schemas appear in error messages and `explain()`.
pub fn describe_schema(schema: &Schema) -> String {
    if schema.fields().is_empty() {
        return "no columns".to_owned();
    }
    schema
        .fields()
        .iter()
        .map(|field| {
            let null = if field.is_nullable() { "" } else { " not null" };
            format!("{} {}{null}", field.name(), field.data_type())
        })
        .collect::<Vec<_>>()
        .join(", ")
}
