//! Named UDFs compiled into the binary.
//!
//! Rust closures cannot be sent to a worker process, so user code that the expression
//! language cannot express is a *named UDF*: a type implementing [`BatchUdf`], registered in a
//! [`Registry`] under a name and a version, with typed parameters. A plan refers to it by
//! `name@version` plus parameter values ([`floe_core::plan::UdfCall`]); the client checks the
//! call against the same registry when the plan is built (the registry is a
//! [`UdfCatalog`]), and a worker looks the code up when it runs the task. A version the
//! registry does not have is an error when the plan is built, never halfway through a job.
//!
//! Bump a UDF's version whenever its output for the same input changes: the version is part
//! of every downstream fingerprint, so cached results of the old code stop matching.
//!
//! # Built-ins
//! - `whitespace_tokenize@1` (`flat_map`): one output row per whitespace-separated token of
//!   the string column `column` (the other columns repeated); rows with no tokens vanish.
//! - `lowercase_normalize@1` (`map_batches`): lowercases `column`, trims it and collapses
//!   runs of whitespace into one space.
//! - `standardize@1` (`map_batches`): replaces the numeric `column` by
//!   `(x - mean) / std` as `Float64`; `std` defaults to 1, and `std = 0` gives null (the
//!   expression language's division-by-zero rule).
//! - `delay@1` (`map_batches`): sleeps `ms` milliseconds (at most 60,000) per batch and
//!   passes it through; a stand-in for an expensive call, used by failure tests and demos.
//!
//! # Adding your own UDF
//! Implement [`BatchUdf`] and register it:
//!
//! ```
//! use std::sync::Arc;
//! use arrow::array::{ArrayRef, Int64Array};
//! use arrow::datatypes::{DataType, Field, Schema};
//! use arrow::record_batch::RecordBatch;
//! use floe_core::plan::{ParamType, PlanError, UdfCall, UdfKind, UdfParams, UdfSignature};
//! use floe_engine::udf::{BatchUdf, Registry};
//!
//! /// Adds a column `row_number`: the position of each row within its block.
//! struct RowNumber;
//!
//! impl BatchUdf for RowNumber {
//!     fn signature(&self) -> UdfSignature {
//!         UdfSignature::new("row_number", 1, UdfKind::RowPreserving)
//!             .param_with_default("offset", ParamType::Int, 0i64, "first number")
//!     }
//!     fn output_schema(&self, _: &UdfParams, input: &Schema, _: &str) -> Result<Schema, PlanError> {
//!         let mut fields: Vec<Field> = input.fields().iter().map(|f| f.as_ref().clone()).collect();
//!         fields.push(Field::new("row_number", DataType::Int64, false));
//!         Ok(Schema::new(fields))
//!     }
//!     fn apply(&self, batch: &RecordBatch, params: &UdfParams, output: &Schema)
//!         -> floe_engine::Result<RecordBatch>
//!     {
//!         let offset = params.int("offset").unwrap_or(0);
//!         let numbers = (0..batch.num_rows() as i64).map(|i| i + offset);
//!         let mut columns = batch.columns().to_vec();
//!         columns.push(Arc::new(Int64Array::from_iter_values(numbers)) as ArrayRef);
//!         Ok(RecordBatch::try_new(Arc::new(output.clone()), columns)?)
//!     }
//! }
//!
//! let mut registry = Registry::with_builtins();
//! registry.register(Arc::new(RowNumber)).unwrap();
//! let input = RecordBatch::try_from_iter([("x", Arc::new(Int64Array::from(vec![7, 8])) as ArrayRef)]).unwrap();
//! let call = UdfCall::new("row_number", 1).with("offset", 10i64);
//! let output = registry.apply(&call, &input).unwrap();
//! assert_eq!(output.column(1).as_ref(), &Int64Array::from(vec![10, 11]));
//! ```
//!
//! To run it on a cluster, the UDF must be compiled into the `floe` binary the cluster runs,
//! and into the client, which validates plans against its registry. A custom `floe` is a
//! `main` that builds `Registry::with_builtins()`, registers its UDFs and calls `floe::run`
//! (`examples/custom_floe.rs`); every role it plays — scheduler, node, the workers a node
//! starts (which run the same program), `submit` — then knows them. A worker whose registry
//! lacks a UDF (a cluster running the stock binary) fails the task with "unknown UDF", which
//! is not retried: the job fails with that message.

mod builtins;
pub mod process;

use std::sync::Arc;

use arrow::datatypes::Schema;
use arrow::record_batch::RecordBatch;
use floe_core::plan::{PlanError, UdfCall, UdfCatalog, UdfParams, UdfSignature};

use crate::{Error, Result};

/// The code of one named UDF.
pub trait BatchUdf: Send + Sync {
    /// Name, version, kind and parameters.
    fn signature(&self) -> UdfSignature;

    /// The schema produced from rows of `input`; an error here is a plan validation error,
    /// so it should name `operator` and the column (see [`PlanError`]).
    fn output_schema(
        &self,
        params: &UdfParams,
        input: &Schema,
        operator: &str,
    ) -> Result<Schema, PlanError>;

    /// Transforms one batch. `output` is what [`BatchUdf::output_schema`] returned.
    fn apply(
        &self,
        batch: &RecordBatch,
        params: &UdfParams,
        output: &Schema,
    ) -> Result<RecordBatch>;
}

struct Registered {
    signature: UdfSignature,
    code: Arc<dyn BatchUdf>,
}

/// The UDFs this binary can run, by `name@version`. A `Vec`, not a map: registries are small
/// and the listing order (registration order) is stable for error messages.
#[derive(Default)]
pub struct Registry {
    udfs: Vec<Registered>,
}

impl Registry {
    /// A registry with no UDFs.
    pub fn empty() -> Self {
        Self::default()
    }

    /// The built-in UDFs (see the module docs).
    pub fn with_builtins() -> Self {
        let mut registry = Self::empty();
        for udf in builtins::all() {
            // The built-ins have distinct names, so registering them cannot collide.
            let signature = udf.signature();
            registry.udfs.push(Registered {
                signature,
                code: udf,
            });
        }
        registry
    }

    /// Adds a UDF; a second UDF with the same name and version is refused.
    pub fn register(&mut self, udf: Arc<dyn BatchUdf>) -> Result<()> {
        let signature = udf.signature();
        if self.signature(&signature.name, signature.version).is_some() {
            return Err(Error::Udf {
                name: format!("{}@{}", signature.name, signature.version),
                message: "is already registered".to_owned(),
            });
        }
        self.udfs.push(Registered {
            signature,
            code: udf,
        });
        Ok(())
    }

    fn find(&self, name: &str, version: u32) -> Option<&Registered> {
        self.udfs
            .iter()
            .find(|u| u.signature.name == name && u.signature.version == version)
    }

    fn find_call(&self, call: &UdfCall, operator: &str) -> Result<&Registered, PlanError> {
        self.find(&call.name, call.version)
            .ok_or_else(|| PlanError::unknown_udf(operator, call, self))
    }

    /// Runs `call` on one batch: binds its parameters, computes its output schema and applies
    /// the code.
    pub fn apply(&self, call: &UdfCall, batch: &RecordBatch) -> Result<RecordBatch> {
        let operator = format!("udf({})", call.name);
        let registered = self.find_call(call, &operator)?;
        let params = registered.signature.bind(call, &operator)?;
        let output = registered
            .code
            .output_schema(&params, &batch.schema(), &operator)?;
        registered.code.apply(batch, &params, &output)
    }
}

impl UdfCatalog for Registry {
    fn signature(&self, name: &str, version: u32) -> Option<&UdfSignature> {
        self.find(name, version).map(|u| &u.signature)
    }

    fn registered(&self) -> Vec<String> {
        self.udfs
            .iter()
            .map(|u| format!("{}@{}", u.signature.name, u.signature.version))
            .collect()
    }

    fn output_schema(
        &self,
        call: &UdfCall,
        params: &UdfParams,
        input: &Schema,
        operator: &str,
    ) -> Result<Schema, PlanError> {
        let registered = self.find_call(call, operator)?;
        registered.code.output_schema(params, input, operator)
    }
}
