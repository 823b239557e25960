//! The Dataset logical plan: a graph of [`Operator`]s, each node with its output schema and
//! fingerprint, validated as it is built.
//!
//! A [`LogicalPlan`] is an immutable, cheaply cloned handle to a node and (through it) to all
//! of its inputs. Building a node computes its output schema from its inputs' schemas, so an
//! unknown column, a type mismatch or a join key missing on one side is an error at the line
//! of the pipeline that caused it ([`PlanError`] names the operator, the column and the types),
//! never halfway through a job. Building a node also computes its [`Fingerprint`] from its
//! inputs' fingerprints, its operator id and version, and its semantic arguments (see
//! [`crate::fingerprint`]); changing one argument therefore changes that node's fingerprint and
//! every fingerprint downstream of it, and none upstream.
//!
//! Plans go from here to the [`optimizer`] (a list of [`optimizer::Rule`]s rewriting the logical
//! plan), then to the [`physical`] planner, which cuts the plan into stages (fusing row-wise
//! operators) that the node's kernels run. [`LogicalPlan::explain`] prints all three.
//!
//! # Depth
//! Every walk over a plan — schema and fingerprint checks, seed resolution, the optimizer's
//! rules, the physical planner, encoding and decoding, display, and dropping the chain of
//! nodes — goes one level deeper per step. So a plan's depth is bounded where its nodes are
//! built: a node more than [`MAX_PLAN_DEPTH`] steps deep, or holding an expression nested
//! more than [`MAX_EXPR_DEPTH`] levels, is refused by [`LogicalPlan::new`], whether it comes
//! from the builder, a job file, a REST body or the wire. The wire decoder's bound
//! ([`crate::wire::nesting::MAX_DECODE_NESTING`]) is the sum of the two, so every plan that
//! can be built can be decoded.

mod error;
pub mod operator;
pub mod optimizer;
pub mod partition;
pub mod physical;
pub mod process;
mod schema;
pub mod task;
pub mod udf;

#[cfg(test)]
mod tests;

use std::fmt::Write as _;
use std::sync::Arc;

use arrow_schema::Schema;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::Fingerprint;
use crate::expr::Expr;
use crate::fingerprint::{
    FingerprintInputs, Seed, SourceDescription, TransformDescription, update,
};

pub use error::{FingerprintErrorText, PlanError, describe_schema};
pub use operator::{
    AggFunction, Aggregation, Compression, CsvOptions, DEFAULT_TARGET_FILE_SIZE, FileFormat,
    FileScan, JoinType, MaterializedSource, Operator, PartitionColumn, PartitionType, SeedChoice,
    SortKey, WriteMode, WriteSpec,
};
pub use process::{
    Concurrency, InlineCode, ProcessUdf, SCRIPT_OPTIONS, UdfCodePolicy, UdfCodeRefused,
};
pub use schema::{renamed_fields, same_columns};
pub use udf::{ParamSpec, ParamType, UdfCall, UdfCatalog, UdfKind, UdfParams, UdfSignature};

/// The most operators along any path of a plan, from a source to the output, both included:
/// a job file's source, its steps and its sink. Deep enough for any pipeline written by hand,
/// and shallow enough that every recursive pass over a plan stays far inside a thread's stack.
pub const MAX_PLAN_DEPTH: u32 = 64;

/// The deepest expression one step may hold, as [`Expr::depth`] counts (`a + b` is 1 level,
/// `(a + b) * c` 2). Expressions are walked recursively like plans.
pub const MAX_EXPR_DEPTH: u32 = 64;

/// One node of a logical plan and, through its inputs, the whole plan below it.
#[derive(Clone)]
pub struct LogicalPlan(Arc<PlanNode>);

#[derive(Debug, Serialize)]
struct PlanNode {
    operator: Operator,
    inputs: Vec<LogicalPlan>,
    schema: Schema,
    fingerprint: Fingerprint,
    /// Operators along the longest path from a source to this node, both included. Not
    /// encoded: a decoded node is rebuilt by [`LogicalPlan::new`], which computes it.
    #[serde(skip)]
    depth: u32,
}

/// A [`PlanNode`] as it arrives, before it is rebuilt. The boxes decode like their contents
/// but keep this frame small while the inputs below decode (one frame per step).
#[derive(Deserialize)]
struct ReceivedNode {
    operator: Box<Operator>,
    inputs: Vec<LogicalPlan>,
    /// Recomputed, never trusted.
    #[serde(rename = "schema")]
    _schema: Box<Schema>,
    #[serde(rename = "fingerprint")]
    _fingerprint: Fingerprint,
}

impl std::fmt::Debug for LogicalPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.display_tree())
    }
}

impl Serialize for LogicalPlan {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

/// A received plan is rebuilt node by node, so its schemas and fingerprints are recomputed
/// by this binary rather than trusted.
impl<'de> Deserialize<'de> for LogicalPlan {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let level = crate::wire::nesting::Nested::enter()?;
        let node = ReceivedNode::deserialize(deserializer)?;
        drop(level);
        LogicalPlan::new(*node.operator, node.inputs).map_err(serde::de::Error::custom)
    }
}

impl PartialEq for LogicalPlan {
    /// Plans are equal when they compute the same thing: equal fingerprints.
    fn eq(&self, other: &Self) -> bool {
        self.fingerprint() == other.fingerprint()
    }
}

impl LogicalPlan {
    /// A node applying `operator` to `inputs`: checks the plan's depth and the operator's
    /// expressions against [`MAX_PLAN_DEPTH`] and [`MAX_EXPR_DEPTH`] (before anything walks
    /// them), the inputs' schemas, infers the output schema and computes the fingerprint.
    pub fn new(operator: Operator, inputs: Vec<LogicalPlan>) -> Result<Self, PlanError> {
        let depth = 1 + inputs.iter().map(LogicalPlan::depth).max().unwrap_or(0);
        if depth > MAX_PLAN_DEPTH {
            return Err(PlanError::PlanTooDeep {
                operator: schema::label(&operator),
                depth,
                limit: MAX_PLAN_DEPTH,
            });
        }
        for expr in operator.expressions() {
            let expr_depth = expr.depth();
            if expr_depth > MAX_EXPR_DEPTH {
                return Err(PlanError::ExpressionTooDeep {
                    operator: schema::label(&operator),
                    depth: expr_depth,
                    limit: MAX_EXPR_DEPTH,
                });
            }
        }
        let input_schemas: Vec<&Schema> = inputs.iter().map(LogicalPlan::schema).collect();
        let schema = schema::output_schema(&operator, &input_schemas)?;
        let fingerprint = match source_description(&operator) {
            Some(source) => match &operator {
                // A read's projection, pushed predicate and limit are a transform of its files.
                Operator::Read(_) => update(
                    &[source.fingerprint()],
                    operator.name(),
                    operator.version(),
                    &operator.args(),
                )?,
                _ => source.fingerprint(),
            },
            // `cache()` marks an output to keep; the data is its input's.
            None if matches!(operator, Operator::Cache) => inputs[0].fingerprint(),
            None => {
                let parents: Vec<Fingerprint> = inputs.iter().map(|i| i.fingerprint()).collect();
                update(
                    &parents,
                    operator.name(),
                    operator.version(),
                    &operator.args(),
                )?
            }
        };
        Ok(Self(Arc::new(PlanNode {
            operator,
            inputs,
            schema,
            fingerprint,
            depth,
        })))
    }

    /// Reads files. `files` must be non-empty; `file_schema` is what the files hold (the node
    /// crate's readers discover it).
    pub fn read(scan: FileScan) -> Result<Self, PlanError> {
        Self::new(Operator::Read(scan), Vec::new())
    }

    /// The integers `0..n` in an `Int64` column `id`.
    pub fn range(n: u64) -> Result<Self, PlanError> {
        Self::new(Operator::Range { n }, Vec::new())
    }

    /// Rows given inline as Arrow IPC stream bytes with this schema.
    pub fn from_ipc(schema: Schema, ipc: Vec<u8>, rows: u64) -> Result<Self, PlanError> {
        Self::new(Operator::FromBatches { schema, ipc, rows }, Vec::new())
    }

    /// The held output of an earlier job, read from the nodes that hold it.
    pub fn materialized(source: MaterializedSource) -> Result<Self, PlanError> {
        Self::new(Operator::Materialized(source), Vec::new())
    }

    fn then(&self, operator: Operator) -> Result<Self, PlanError> {
        Self::new(operator, vec![self.clone()])
    }

    pub fn with_column(&self, name: impl Into<String>, expr: Expr) -> Result<Self, PlanError> {
        self.then(Operator::WithColumn {
            name: name.into(),
            expr,
        })
    }

    pub fn select(&self, columns: &[&str]) -> Result<Self, PlanError> {
        self.then(Operator::Select {
            columns: owned(columns),
        })
    }

    pub fn drop_columns(&self, columns: &[&str]) -> Result<Self, PlanError> {
        self.then(Operator::Drop {
            columns: owned(columns),
        })
    }

    pub fn rename(&self, pairs: &[(&str, &str)]) -> Result<Self, PlanError> {
        self.then(Operator::Rename {
            pairs: pairs
                .iter()
                .map(|(from, to)| ((*from).to_owned(), (*to).to_owned()))
                .collect(),
        })
    }

    pub fn filter(&self, predicate: Expr) -> Result<Self, PlanError> {
        self.then(Operator::Filter { predicate })
    }

    /// Applies the named UDF, checked against `catalog`. Whether this is a `map_batches` or a
    /// `flat_map` comes from the UDF's signature; `expected` makes the caller's intent checked.
    pub fn udf(
        &self,
        call: UdfCall,
        expected: UdfKind,
        batch_size: Option<u64>,
        catalog: &dyn UdfCatalog,
    ) -> Result<Self, PlanError> {
        let operator = match expected {
            UdfKind::RowPreserving => "map_batches",
            UdfKind::RowChanging => "flat_map",
        };
        let operator = format!("{operator}({})", call.name);
        let (kind, params, output_schema) = udf::resolve(catalog, &call, self.schema(), &operator)?;
        if kind == UdfKind::RowChanging && expected == UdfKind::RowPreserving {
            return Err(PlanError::invalid(
                &operator,
                "this UDF may change the row count: use flat_map",
            ));
        }
        self.then(Operator::Udf {
            call,
            params,
            kind,
            output_schema,
            batch_size,
        })
    }

    /// Runs `udf`, a long-lived child process, over every batch (see [`process`]).
    pub fn process_udf(&self, udf: ProcessUdf) -> Result<Self, PlanError> {
        self.then(Operator::ProcessUdf(udf))
    }

    pub fn limit(&self, n: u64) -> Result<Self, PlanError> {
        self.then(Operator::Limit { n })
    }

    pub fn sort(&self, keys: Vec<SortKey>) -> Result<Self, PlanError> {
        self.then(Operator::Sort { keys })
    }

    pub fn aggregate(
        &self,
        keys: &[&str],
        aggregations: Vec<Aggregation>,
    ) -> Result<Self, PlanError> {
        self.then(Operator::Aggregate {
            keys: owned(keys),
            aggregations,
        })
    }

    pub fn repartition(&self, partitions: u32, keys: &[&str]) -> Result<Self, PlanError> {
        self.then(Operator::Repartition {
            partitions,
            keys: owned(keys),
        })
    }

    /// Shuffles rows randomly. Without a seed, one is drawn at submission
    /// ([`LogicalPlan::resolve_seeds`]), so two unseeded runs never share a cache entry.
    pub fn random_shuffle(&self, seed: Option<u64>) -> Result<Self, PlanError> {
        self.then(Operator::RandomShuffle {
            seed: seed.map_or(SeedChoice::Unresolved, |s| SeedChoice::Fixed(Seed::new(s))),
        })
    }

    /// Joins `self` (left) with `right` on equal keys (`left_keys[i] == right_keys[i]`).
    pub fn join(
        &self,
        right: &LogicalPlan,
        left_keys: &[&str],
        right_keys: &[&str],
        how: JoinType,
    ) -> Result<Self, PlanError> {
        Self::new(
            Operator::Join {
                left_keys: owned(left_keys),
                right_keys: owned(right_keys),
                how,
            },
            vec![self.clone(), right.clone()],
        )
    }

    pub fn union(&self, other: &LogicalPlan) -> Result<Self, PlanError> {
        Self::new(Operator::Union, vec![self.clone(), other.clone()])
    }

    pub fn unique(&self, columns: &[&str]) -> Result<Self, PlanError> {
        self.then(Operator::Unique {
            columns: owned(columns),
        })
    }

    pub fn cache(&self) -> Result<Self, PlanError> {
        self.then(Operator::Cache)
    }

    pub fn write(&self, spec: WriteSpec) -> Result<Self, PlanError> {
        self.then(Operator::Write(spec))
    }

    pub fn operator(&self) -> &Operator {
        &self.0.operator
    }

    pub fn inputs(&self) -> &[LogicalPlan] {
        &self.0.inputs
    }

    pub fn schema(&self) -> &Schema {
        &self.0.schema
    }

    pub fn fingerprint(&self) -> Fingerprint {
        self.0.fingerprint
    }

    /// Operators along the longest path from a source to this node, both included (at most
    /// [`MAX_PLAN_DEPTH`]).
    pub fn depth(&self) -> u32 {
        self.0.depth
    }

    /// The same operator over new inputs (used by optimizer rules).
    pub fn with_inputs(&self, inputs: Vec<LogicalPlan>) -> Result<Self, PlanError> {
        Self::new(self.operator().clone(), inputs)
    }

    /// Whether two handles are the very same node (shared subplans in a DAG).
    pub fn same_node(&self, other: &LogicalPlan) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The lineage behind this node's fingerprint, for explaining cache misses.
    pub fn lineage(&self) -> Result<FingerprintInputs, PlanError> {
        let operator = self.operator();
        if let Some(source) = source_description(operator) {
            return Ok(match operator {
                Operator::Read(_) => FingerprintInputs::Transform(TransformDescription::new(
                    vec![FingerprintInputs::Source(source)],
                    operator.name(),
                    operator.version(),
                    &operator.args(),
                )?),
                _ => FingerprintInputs::Source(source),
            });
        }
        if matches!(operator, Operator::Cache) {
            return self.inputs()[0].lineage();
        }
        let parents = self
            .inputs()
            .iter()
            .map(LogicalPlan::lineage)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(FingerprintInputs::Transform(TransformDescription::new(
            parents,
            operator.name(),
            operator.version(),
            &operator.args(),
        )?))
    }

    /// Rewrites the plan bottom-up with `rewrite`, rebuilding (and revalidating) every node
    /// above a changed one. It recurses once per step, at most [`MAX_PLAN_DEPTH`] deep.
    /// Shared subplans are rewritten once per path.
    pub fn transform_up(
        &self,
        rewrite: &impl Fn(LogicalPlan) -> Result<LogicalPlan, PlanError>,
    ) -> Result<LogicalPlan, PlanError> {
        let inputs = self
            .inputs()
            .iter()
            .map(|input| input.transform_up(rewrite))
            .collect::<Result<Vec<_>, _>>()?;
        let unchanged = inputs
            .iter()
            .zip(self.inputs())
            .all(|(new, old)| new.same_node(old));
        let node = if unchanged {
            self.clone()
        } else {
            self.with_inputs(inputs)?
        };
        rewrite(node)
    }

    /// Draws a seed for every `random_shuffle` that has none. Called once at submission; the
    /// resolved plan is what is stored and re-run, so retries reuse their own seeds.
    pub fn resolve_seeds(&self) -> Result<LogicalPlan, PlanError> {
        self.transform_up(&|node| match node.operator() {
            Operator::RandomShuffle {
                seed: SeedChoice::Unresolved,
            } => Self::new(
                Operator::RandomShuffle {
                    seed: SeedChoice::Fixed(Seed::resolve(None)?),
                },
                node.inputs().to_vec(),
            ),
            _ => Ok(node),
        })
    }

    /// Fails if a seed is still unresolved (a driver refuses such a plan).
    pub fn check_resolved(&self) -> Result<(), PlanError> {
        if let Operator::RandomShuffle {
            seed: SeedChoice::Unresolved,
        } = self.operator()
        {
            return Err(PlanError::UnresolvedSeed {
                operator: "random_shuffle".to_owned(),
            });
        }
        self.inputs()
            .iter()
            .try_for_each(LogicalPlan::check_resolved)
    }

    /// Checks every UDF call against `catalog` (this binary's registry): its `name@version`
    /// must exist, and the parameters and output schema the plan recorded when it was built
    /// must be what this catalog computes. A driver runs it on a received plan, so a client
    /// built with a different version of a UDF is refused at submission, not mid-job.
    pub fn check_udfs(&self, catalog: &dyn UdfCatalog) -> Result<(), PlanError> {
        if let Operator::Udf {
            call,
            params,
            kind,
            output_schema,
            ..
        } = self.operator()
        {
            let operator = format!("{}({})", self.operator().name(), call.name);
            let (found_kind, found_params, found_schema) =
                udf::resolve(catalog, call, self.inputs()[0].schema(), &operator)?;
            if found_kind != *kind || found_params != *params || found_schema != *output_schema {
                return Err(PlanError::invalid(
                    &operator,
                    format!(
                        "{}@{} differs between the client and this binary (kind, parameters \
                         or output schema); rebuild them from the same sources",
                        call.name, call.version
                    ),
                ));
            }
        }
        self.inputs()
            .iter()
            .try_for_each(|input| input.check_udfs(catalog))
    }

    /// Every process UDF the plan calls, found without recursion.
    pub fn process_udfs(&self) -> Vec<&ProcessUdf> {
        let mut udfs = Vec::new();
        let mut pending = vec![self];
        while let Some(plan) = pending.pop() {
            if let Operator::ProcessUdf(udf) = plan.operator() {
                udfs.push(udf);
            }
            pending.extend(plan.inputs());
        }
        udfs
    }

    /// The plan as an indented tree, one node per line with its fingerprint and schema.
    pub fn display_tree(&self) -> String {
        let mut out = String::new();
        self.write_tree(&mut out, 0);
        out
    }

    fn write_tree(&self, out: &mut String, depth: usize) {
        let _ = writeln!(
            out,
            "{:indent$}{} [{}] -> ({})",
            "",
            self.operator().describe(),
            self.fingerprint(),
            describe_schema(self.schema()),
            indent = depth * 2
        );
        for input in self.inputs() {
            input.write_tree(out, depth + 1);
        }
    }

    /// The logical plan, the plan after the optimizer's rules, and the physical stages.
    pub fn explain(&self) -> Result<String, PlanError> {
        let optimized = optimizer::Optimizer::default().optimize(self)?;
        let physical = physical::PhysicalPlan::from_logical(&optimized);
        Ok(format!(
            "== Logical plan ==\n{}\n== Optimized plan ==\n{}\n== Physical plan ==\n{}",
            self.display_tree(),
            optimized.display_tree(),
            physical
        ))
    }
}

fn owned(columns: &[&str]) -> Vec<String> {
    columns.iter().map(|c| (*c).to_owned()).collect()
}

fn source_description(operator: &Operator) -> Option<SourceDescription> {
    match operator {
        Operator::Read(scan) => {
            // The fields are public, so a scan built by hand may be unsorted. A file listed
            // twice is read twice, so it is hashed twice.
            let mut files = scan.files.clone();
            files.sort();
            Some(SourceDescription::Files(files))
        }
        Operator::Range { n } => Some(SourceDescription::range(*n)),
        Operator::FromBatches { ipc, .. } => Some(SourceDescription::in_memory(ipc)),
        Operator::Materialized(source) => Some(SourceDescription::Materialized {
            job: source.job,
            fingerprint: source.fingerprint,
        }),
        _ => None,
    }
}
