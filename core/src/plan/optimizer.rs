//! The optimizer: an ordered list of rules rewriting the logical plan.
//!
//! A rule is a type implementing [`Rule`]; adding an optimization means adding a type and
//! putting it in [`Optimizer::new`]'s list (or passing a custom list). Rules must keep the
//! plan's meaning: every rewritten node is rebuilt through [`LogicalPlan::new`], so a rule that
//! produced an invalid plan fails loudly instead of running it. The optimizer applies the list
//! repeatedly until the plan's fingerprint stops changing (each rule moves operators one step,
//! and the next pass moves them further).
//!
//! Fusing row-wise operators into one stage is a physical concern and lives in
//! [`super::physical::FuseRowOperators`].

use super::operator::{FileScan, Operator};
use super::{Aggregation, LogicalPlan, MAX_EXPR_DEPTH, MAX_PLAN_DEPTH, PlanError};
use crate::expr::Expr;

/// One rewrite of the logical plan.
pub trait Rule: Send + Sync {
    fn name(&self) -> &'static str;
    fn apply(&self, plan: &LogicalPlan) -> Result<LogicalPlan, PlanError>;
}

/// The rules, in the order they are applied.
pub struct Optimizer {
    rules: Vec<Box<dyn Rule>>,
}

/// No plan needs more passes than this: each pass moves every operator at least one step, and
/// no plan has more steps. The bound only guards against two rules undoing each other.
const MAX_PASSES: u32 = MAX_PLAN_DEPTH;

impl Default for Optimizer {
    fn default() -> Self {
        Self::new(vec![
            Box::new(PushFilters),
            Box::new(PushProjections),
            Box::new(PushLimits),
        ])
    }
}

impl Optimizer {
    pub fn new(rules: Vec<Box<dyn Rule>>) -> Self {
        Self { rules }
    }

    pub fn rule_names(&self) -> Vec<&'static str> {
        self.rules.iter().map(|rule| rule.name()).collect()
    }

    pub fn optimize(&self, plan: &LogicalPlan) -> Result<LogicalPlan, PlanError> {
        let mut current = plan.clone();
        for _ in 0..MAX_PASSES {
            let before = current.fingerprint();
            for rule in &self.rules {
                current = rule.apply(&current)?;
            }
            if current.fingerprint() == before {
                break;
            }
        }
        Ok(current)
    }
}

/// `left and right`, unless that would nest deeper than a plan may hold ([`MAX_EXPR_DEPTH`]):
/// merging a long chain of filters would build one ever deeper predicate, so past the limit
/// the filters stay apart.
fn conjunction(left: &Expr, right: &Expr) -> Option<Expr> {
    // `and` is one level above its deeper side.
    (left.depth().max(right.depth()) < MAX_EXPR_DEPTH).then(|| left.clone().and(right.clone()))
}

/// Moves filters towards the data: merges adjacent filters, swaps a filter below projections,
/// renames and unrelated `with_column`s, and hands it to a Parquet read, which skips row groups
/// by their statistics and filters the rest.
pub struct PushFilters;

impl Rule for PushFilters {
    fn name(&self) -> &'static str {
        "push_filters"
    }

    fn apply(&self, plan: &LogicalPlan) -> Result<LogicalPlan, PlanError> {
        plan.transform_up(&|node| {
            let Operator::Filter { predicate } = node.operator() else {
                return Ok(node);
            };
            let child = &node.inputs()[0];
            let filter_over = |plan: &LogicalPlan, predicate: Expr| {
                LogicalPlan::new(Operator::Filter { predicate }, vec![plan.clone()])
            };
            match child.operator() {
                Operator::Read(scan) if scan.supports_predicate() && scan.limit.is_none() => {
                    let merged = match &scan.predicate {
                        None => Some(predicate.clone()),
                        Some(pushed) => conjunction(pushed, predicate),
                    };
                    match merged {
                        // Partitions the predicate rules out leave the scan here, before any
                        // file is opened, and so leave its fingerprint too.
                        Some(merged) => LogicalPlan::read(
                            FileScan {
                                predicate: Some(merged),
                                ..scan.clone()
                            }
                            .prune_partitions()?,
                        ),
                        None => Ok(node),
                    }
                }
                Operator::Filter { predicate: inner } => match conjunction(inner, predicate) {
                    Some(merged) => filter_over(&child.inputs()[0], merged),
                    None => Ok(node),
                },
                Operator::Select { .. } | Operator::Drop { .. } | Operator::Sort { .. } => {
                    child.with_inputs(vec![filter_over(&child.inputs()[0], predicate.clone())?])
                }
                Operator::Rename { pairs } => {
                    let back = |name: &str| {
                        pairs
                            .iter()
                            .find(|(_, to)| to == name)
                            .map_or_else(|| name.to_owned(), |(from, _)| from.clone())
                    };
                    let below = filter_over(&child.inputs()[0], predicate.map_columns(&back))?;
                    child.with_inputs(vec![below])
                }
                Operator::WithColumn { name, .. }
                    if !predicate.columns().contains(&name.as_str()) =>
                {
                    child.with_inputs(vec![filter_over(&child.inputs()[0], predicate.clone())?])
                }
                _ => Ok(node),
            }
        })
    }
}

/// Narrows reads to the columns the rest of the plan uses (every format's reader skips the
/// others), and drops `drop`/`rename` entries for columns no longer read.
pub struct PushProjections;

impl Rule for PushProjections {
    fn name(&self) -> &'static str {
        "push_projections"
    }

    fn apply(&self, plan: &LogicalPlan) -> Result<LogicalPlan, PlanError> {
        prune(plan, None)
    }
}

fn union_names(
    mut names: Vec<String>,
    more: impl IntoIterator<Item = impl Into<String>>,
) -> Vec<String> {
    for name in more {
        let name = name.into();
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// Rebuilds `plan` so that it still produces at least the columns in `required` (all of them
/// when `None`), reading as few columns as possible.
fn prune(plan: &LogicalPlan, required: Option<Vec<String>>) -> Result<LogicalPlan, PlanError> {
    let operator = plan.operator();
    let output_names = || -> Vec<String> {
        plan.schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect()
    };
    let needed = || required.clone().unwrap_or_else(output_names);
    let child_required: Vec<Option<Vec<String>>> = match operator {
        Operator::Read(scan) => {
            let Some(required) = required else {
                return Ok(plan.clone());
            };
            let predicate_columns = scan
                .predicate
                .as_ref()
                .map(|p| {
                    p.columns()
                        .into_iter()
                        .map(str::to_owned)
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default();
            let wanted = union_names(required, predicate_columns);
            let projection: Vec<String> = output_names()
                .into_iter()
                .filter(|name| wanted.contains(name))
                .collect();
            if projection.len() == plan.schema().fields().len() {
                return Ok(plan.clone());
            }
            return LogicalPlan::read(FileScan {
                projection: Some(projection),
                ..scan.clone()
            });
        }
        Operator::Select { columns } => vec![Some(columns.clone())],
        Operator::Drop { .. } | Operator::Limit { .. } | Operator::RandomShuffle { .. } => {
            vec![Some(needed())]
        }
        Operator::Rename { pairs } => {
            let back = needed()
                .into_iter()
                .map(|name| {
                    pairs
                        .iter()
                        .find(|(_, to)| *to == name)
                        .map_or(name, |(from, _)| from.clone())
                })
                .collect();
            vec![Some(back)]
        }
        Operator::WithColumn { name, expr } => {
            let others: Vec<String> = needed().into_iter().filter(|n| n != name).collect();
            vec![Some(union_names(others, expr.columns()))]
        }
        Operator::Filter { predicate } => vec![Some(union_names(needed(), predicate.columns()))],
        Operator::Sort { keys } => vec![Some(union_names(
            needed(),
            keys.iter().map(|k| k.column.clone()),
        ))],
        Operator::Repartition { keys, .. } => vec![Some(union_names(needed(), keys.clone()))],
        Operator::Aggregate { keys, aggregations } => {
            vec![Some(aggregate_reads(keys, aggregations))]
        }
        Operator::Unique { columns } if !columns.is_empty() => vec![Some(columns.clone())],
        // Everything else needs all of its inputs' columns: UDFs may read any, joins and
        // unions need matching sides, caches and sinks keep whole rows.
        _ => plan.inputs().iter().map(|_| None).collect(),
    };
    let mut inputs = plan
        .inputs()
        .iter()
        .zip(child_required)
        .map(|(input, required)| prune(input, required))
        .collect::<Result<Vec<_>, _>>()?;
    if let Operator::Aggregate { keys, aggregations } = operator {
        inputs[0] = narrowed(&inputs[0], &aggregate_reads(keys, aggregations))?;
    }
    if inputs
        .iter()
        .zip(plan.inputs())
        .all(|(a, b)| a.same_node(b))
    {
        return Ok(plan.clone());
    }
    let available = |name: &String| inputs[0].schema().column_with_name(name).is_some();
    // Entries for columns the narrowed input no longer has are dropped with them.
    let operator = match operator {
        Operator::Drop { columns } => Operator::Drop {
            columns: columns.iter().filter(|c| available(c)).cloned().collect(),
        },
        Operator::Rename { pairs } => Operator::Rename {
            pairs: pairs
                .iter()
                .filter(|(from, _)| available(from))
                .cloned()
                .collect(),
        },
        other => other.clone(),
    };
    match &operator {
        Operator::Drop { columns } if columns.is_empty() => Ok(inputs[0].clone()),
        Operator::Rename { pairs } if pairs.is_empty() => Ok(inputs[0].clone()),
        _ => LogicalPlan::new(operator, inputs),
    }
}

/// The columns an aggregate reads: its keys and its aggregations' columns.
fn aggregate_reads(keys: &[String], aggregations: &[Aggregation]) -> Vec<String> {
    union_names(
        keys.to_vec(),
        aggregations.iter().filter_map(|a| a.column.clone()),
    )
}

/// `input` with only the columns in `used`, in its own order: an aggregate's input blocks
/// cross the shuffle, so columns made on the way (`with_column`) that the aggregate does not
/// read are dropped in the stage that made them rather than stored and moved.
fn narrowed(input: &LogicalPlan, used: &[String]) -> Result<LogicalPlan, PlanError> {
    let columns: Vec<&str> = input
        .schema()
        .fields()
        .iter()
        .map(|field| field.name().as_str())
        .filter(|name| used.iter().any(|used| used == name))
        .collect();
    if columns.len() == input.schema().fields().len() || columns.is_empty() {
        return Ok(input.clone());
    }
    input.select(&columns)
}

/// Moves limits towards the data: merges adjacent limits, swaps a limit below operators that
/// keep one row per row, turns `range(n).limit(m)` into `range(min(n, m))`, and hands the
/// limit to reads (each read task stops early; the limit above still cuts the total).
pub struct PushLimits;

impl Rule for PushLimits {
    fn name(&self) -> &'static str {
        "push_limits"
    }

    fn apply(&self, plan: &LogicalPlan) -> Result<LogicalPlan, PlanError> {
        plan.transform_up(&|node| {
            let Operator::Limit { n } = node.operator() else {
                return Ok(node);
            };
            let n = *n;
            let child = &node.inputs()[0];
            match child.operator() {
                Operator::Limit { n: inner } => child.inputs()[0].limit(n.min(*inner)),
                Operator::Range { n: rows } => LogicalPlan::range(n.min(*rows)),
                Operator::Read(scan) if scan.limit.is_none_or(|limit| limit > n) => {
                    let read = LogicalPlan::read(FileScan {
                        limit: Some(n),
                        ..scan.clone()
                    })?;
                    read.limit(n)
                }
                operator if operator.preserves_rows() => {
                    child.with_inputs(vec![child.inputs()[0].limit(n)?])
                }
                _ => Ok(node),
            }
        })
    }
}
