//! Named UDFs as the plan sees them: a call (name, version, parameters) checked against a
//! signature from a catalog.
//!
//! The code of a UDF lives in the node binary (`floe_engine::udf::Registry`), because Rust code
//! cannot be shipped; the plan only names it. A catalog answers the two questions a plan needs
//! when it is built: does this call match a registered signature, and what schema does it
//! produce? A version the catalog does not know is an error then, not when a worker runs.

use std::collections::BTreeMap;
use std::fmt;

use arrow_schema::Schema;
use serde::{Deserialize, Serialize};

use super::PlanError;
use crate::fingerprint::ArgValue;

/// The type of one UDF parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ParamType {
    Bool,
    Int,
    Float,
    Str,
}

impl ParamType {
    fn accepts(self, value: &ArgValue) -> bool {
        matches!(
            (self, value),
            (ParamType::Bool, ArgValue::Bool(_))
                | (ParamType::Int, ArgValue::Int(_))
                | (ParamType::Float, ArgValue::Float(_))
                | (ParamType::Str, ArgValue::Str(_))
        )
    }
}

/// One declared parameter; a parameter with a default may be left out of a call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSpec {
    pub name: String,
    pub param_type: ParamType,
    pub default: Option<ArgValue>,
    pub doc: String,
}

/// Whether a UDF keeps one output row per input row (`map_batches`) or may change the row
/// count (`flat_map`). Limits are only pushed below row-preserving UDFs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UdfKind {
    RowPreserving,
    RowChanging,
}

/// What a registered UDF promises: its name, version, kind and parameters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UdfSignature {
    pub name: String,
    /// Bump it whenever the output for the same input changes: old cache entries then miss.
    pub version: u32,
    pub kind: UdfKind,
    pub params: Vec<ParamSpec>,
    pub doc: String,
}

impl UdfSignature {
    pub fn new(name: impl Into<String>, version: u32, kind: UdfKind) -> Self {
        Self {
            name: name.into(),
            version,
            kind,
            params: Vec::new(),
            doc: String::new(),
        }
    }

    pub fn doc(mut self, doc: impl Into<String>) -> Self {
        self.doc = doc.into();
        self
    }

    /// A parameter the caller must give.
    pub fn param(self, name: &str, param_type: ParamType, doc: &str) -> Self {
        self.push_param(name, param_type, None, doc)
    }

    /// A parameter with a default.
    pub fn param_with_default(
        self,
        name: &str,
        param_type: ParamType,
        default: impl Into<ArgValue>,
        doc: &str,
    ) -> Self {
        self.push_param(name, param_type, Some(default.into()), doc)
    }

    fn push_param(
        mut self,
        name: &str,
        param_type: ParamType,
        default: Option<ArgValue>,
        doc: &str,
    ) -> Self {
        self.params.push(ParamSpec {
            name: name.to_owned(),
            param_type,
            default,
            doc: doc.to_owned(),
        });
        self
    }

    /// Checks `call` against this signature and returns its parameters with defaults filled
    /// in: unknown names, missing required parameters and wrongly typed values are errors.
    pub fn bind(&self, call: &UdfCall, operator: &str) -> Result<UdfParams, PlanError> {
        if let Some(unknown) = call
            .params
            .keys()
            .find(|name| !self.params.iter().any(|p| &p.name == *name))
        {
            return Err(PlanError::invalid(
                operator,
                format!("{} has no parameter {unknown:?}", self.label()),
            ));
        }
        let mut bound = BTreeMap::new();
        for spec in &self.params {
            let value = match (call.params.get(&spec.name), &spec.default) {
                (Some(value), _) => value.clone(),
                (None, Some(default)) => default.clone(),
                (None, None) => {
                    return Err(PlanError::invalid(
                        operator,
                        format!("{} needs parameter {:?}", self.label(), spec.name),
                    ));
                }
            };
            if !spec.param_type.accepts(&value) {
                return Err(PlanError::invalid(
                    operator,
                    format!(
                        "{} parameter {:?} must be {:?}, got {value}",
                        self.label(),
                        spec.name,
                        spec.param_type
                    ),
                ));
            }
            bound.insert(spec.name.clone(), value);
        }
        Ok(UdfParams(bound))
    }

    fn label(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }
}

/// A call of a named UDF as written in a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UdfCall {
    pub name: String,
    pub version: u32,
    /// Sorted by name (no `HashMap` in plan types: the order must be canonical).
    pub params: BTreeMap<String, ArgValue>,
}

impl UdfCall {
    pub fn new(name: impl Into<String>, version: u32) -> Self {
        Self {
            name: name.into(),
            version,
            params: BTreeMap::new(),
        }
    }

    pub fn with(mut self, name: impl Into<String>, value: impl Into<ArgValue>) -> Self {
        self.params.insert(name.into(), value.into());
        self
    }
}

impl fmt::Display for UdfCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}(", self.name, self.version)?;
        for (index, (name, value)) in self.params.iter().enumerate() {
            if index > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{name}={value}")?;
        }
        f.write_str(")")
    }
}

/// A call's parameters after [`UdfSignature::bind`]: every declared parameter present and typed.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct UdfParams(BTreeMap<String, ArgValue>);

impl UdfParams {
    /// The parameters as one fingerprint argument (a map sorted by name).
    pub fn to_arg(&self) -> ArgValue {
        ArgValue::Map(self.0.clone())
    }

    pub fn get(&self, name: &str) -> Option<&ArgValue> {
        self.0.get(name)
    }

    pub fn str(&self, name: &str) -> Option<&str> {
        match self.0.get(name) {
            Some(ArgValue::Str(value)) => Some(value),
            _ => None,
        }
    }

    pub fn float(&self, name: &str) -> Option<f64> {
        match self.0.get(name) {
            Some(ArgValue::Float(value)) => Some(*value),
            _ => None,
        }
    }

    pub fn int(&self, name: &str) -> Option<i64> {
        match self.0.get(name) {
            Some(ArgValue::Int(value)) => Some(*value),
            _ => None,
        }
    }

    pub fn bool(&self, name: &str) -> Option<bool> {
        match self.0.get(name) {
            Some(ArgValue::Bool(value)) => Some(*value),
            _ => None,
        }
    }
}

/// What the plan needs to know about the UDFs a binary has: implemented by the node's
/// registry, so the client validates against the same code the workers run.
pub trait UdfCatalog {
    /// The signature registered under exactly `name` and `version`.
    fn signature(&self, name: &str, version: u32) -> Option<&UdfSignature>;

    /// Every registered `name@version`, for error messages.
    fn registered(&self) -> Vec<String>;

    /// The schema `call` produces from rows of `input` (called after `bind` succeeded).
    fn output_schema(
        &self,
        call: &UdfCall,
        params: &UdfParams,
        input: &Schema,
        operator: &str,
    ) -> Result<Schema, PlanError>;
}

/// A UDF call checked against a catalog, with the schema it produces.
pub(crate) fn resolve(
    catalog: &dyn UdfCatalog,
    call: &UdfCall,
    input: &Schema,
    operator: &str,
) -> Result<(UdfKind, UdfParams, Schema), PlanError> {
    let signature = catalog
        .signature(&call.name, call.version)
        .ok_or_else(|| PlanError::unknown_udf(operator, call, catalog))?;
    let params = signature.bind(call, operator)?;
    let schema = catalog.output_schema(call, &params, input, operator)?;
    Ok((signature.kind, params, schema))
}
