//! The physical plan: stages the executor runs as tasks.
//!
//! Each logical node first becomes one stage; then the physical rules rewrite the stage list.
//! [`FuseRowOperators`] folds a chain of row-wise operators (and the read that feeds them) into
//! one stage whose task applies them block by block, so intermediate blocks never reach the
//! object store — Ray's operator fusion.

use std::fmt;

use arrow_schema::Schema;
use serde::{Deserialize, Serialize};

use super::operator::{FileScan, MaterializedSource, Operator, WriteSpec};
use super::{LogicalPlan, describe_schema};
use crate::Fingerprint;

/// The index of a stage in [`PhysicalPlan::stages`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StageId(pub usize);

/// What a stage's tasks do before applying the stage's row-wise operators.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum StageKind {
    Read(FileScan),
    Range {
        n: u64,
    },
    FromBatches {
        schema: Schema,
        #[serde(with = "crate::wire::bytes")]
        ipc: Vec<u8>,
    },
    /// An earlier job's held output: each task takes one of its blocks as its input (pulled
    /// from the holder) and applies the row-wise operators.
    Materialized(MaterializedSource),
    /// Only the row-wise operators, over each input block.
    Map,
    /// Passes the first `n` rows of its input stream (manipulates block references only).
    Limit {
        n: u64,
    },
    /// Sort, aggregate, repartition, shuffle, join or unique (run by the shuffle machinery).
    AllToAll(Operator),
    Union,
    /// Keeps its input's blocks in the cache.
    Cache,
    Write(WriteSpec),
}

impl StageKind {
    pub fn name(&self) -> &'static str {
        match self {
            StageKind::Read(_) => "read",
            StageKind::Range { .. } => "range",
            StageKind::FromBatches { .. } => "from_batches",
            StageKind::Materialized(_) => "materialized",
            StageKind::Map => "map",
            StageKind::Limit { .. } => "limit",
            StageKind::AllToAll(operator) => operator.name(),
            StageKind::Union => "union",
            StageKind::Cache => "cache",
            StageKind::Write(_) => "write",
        }
    }

    pub fn describe(&self) -> String {
        match self {
            StageKind::Read(scan) => Operator::Read(scan.clone()).describe(),
            StageKind::Range { n } => format!("range n={n}"),
            StageKind::FromBatches { ipc, .. } => format!("from_batches bytes={}", ipc.len()),
            StageKind::Materialized(source) => Operator::Materialized(source.clone()).describe(),
            StageKind::Map => "map".to_owned(),
            StageKind::Limit { n } => format!("limit {n}"),
            StageKind::AllToAll(operator) => format!("all_to_all {}", operator.describe()),
            StageKind::Union => "union".to_owned(),
            StageKind::Cache => "cache".to_owned(),
            StageKind::Write(spec) => Operator::Write(spec.clone()).describe(),
        }
    }

    /// Stages whose tasks produce blocks from a source or from each input block alone, and so
    /// can absorb the row-wise operators that follow them.
    fn absorbs_row_ops(&self) -> bool {
        matches!(
            self,
            StageKind::Read(_)
                | StageKind::Range { .. }
                | StageKind::FromBatches { .. }
                | StageKind::Materialized(_)
                | StageKind::Map
        )
    }
}

/// A stage travels to worker processes inside its tasks, so it is serializable.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stage {
    pub kind: StageKind,
    /// Row-wise operators applied, in order, to every block the stage produces.
    pub row_ops: Vec<Operator>,
    pub inputs: Vec<StageId>,
    /// The fingerprint of the stage's output (its last logical operator's).
    pub fingerprint: Fingerprint,
    pub schema: Schema,
}

/// Stages in topological order (inputs before the stages that read them).
#[derive(Debug, Clone, PartialEq)]
pub struct PhysicalPlan {
    pub stages: Vec<Stage>,
    pub output: StageId,
}

/// One rewrite of the physical plan.
pub trait PhysicalRule: Send + Sync {
    fn name(&self) -> &'static str;
    fn apply(&self, plan: PhysicalPlan) -> PhysicalPlan;
}

/// The physical rules, in the order they are applied.
pub fn default_rules() -> Vec<Box<dyn PhysicalRule>> {
    vec![Box::new(FuseRowOperators)]
}

impl PhysicalPlan {
    /// One stage per distinct logical node (equal fingerprint and operator), then
    /// the default physical rules.
    pub fn from_logical(plan: &LogicalPlan) -> Self {
        Self::with_rules(plan, &default_rules())
    }

    pub fn with_rules(plan: &LogicalPlan, rules: &[Box<dyn PhysicalRule>]) -> Self {
        let mut builder = Builder::default();
        let output = builder.add(plan);
        let mut physical = PhysicalPlan {
            stages: builder.stages,
            output,
        };
        for rule in rules {
            physical = rule.apply(physical);
        }
        physical
    }

    pub fn stage(&self, id: StageId) -> &Stage {
        &self.stages[id.0]
    }

    fn consumers(&self, id: StageId) -> usize {
        self.stages
            .iter()
            .map(|stage| stage.inputs.iter().filter(|input| **input == id).count())
            .sum()
    }
}

#[derive(Default)]
struct Builder {
    stages: Vec<Stage>,
    /// Nodes already planned, by fingerprint and operator, so a subplan that appears twice
    /// (a self-join, a union of two branches of one read) is computed once. Equal fingerprints
    /// mean equal data; the operator name keeps `cache()` (which shares its input's
    /// fingerprint) a stage of its own.
    planned: Vec<((Fingerprint, &'static str), StageId)>,
}

impl Builder {
    fn add(&mut self, plan: &LogicalPlan) -> StageId {
        let key = (plan.fingerprint(), plan.operator().name());
        if let Some((_, id)) = self.planned.iter().find(|(planned, _)| *planned == key) {
            return *id;
        }
        let inputs: Vec<StageId> = plan.inputs().iter().map(|input| self.add(input)).collect();
        let operator = plan.operator();
        let (kind, row_ops) = match operator {
            Operator::Read(scan) => (StageKind::Read(scan.clone()), Vec::new()),
            Operator::Range { n } => (StageKind::Range { n: *n }, Vec::new()),
            Operator::FromBatches { schema, ipc, .. } => (
                StageKind::FromBatches {
                    schema: schema.clone(),
                    ipc: ipc.clone(),
                },
                Vec::new(),
            ),
            Operator::Materialized(source) => (StageKind::Materialized(source.clone()), Vec::new()),
            Operator::Limit { n } => (StageKind::Limit { n: *n }, Vec::new()),
            Operator::Union => (StageKind::Union, Vec::new()),
            Operator::Cache => (StageKind::Cache, Vec::new()),
            Operator::Write(spec) => (StageKind::Write(spec.clone()), Vec::new()),
            row_wise if row_wise.is_row_wise() => (StageKind::Map, vec![row_wise.clone()]),
            all_to_all => (StageKind::AllToAll(all_to_all.clone()), Vec::new()),
        };
        self.stages.push(Stage {
            kind,
            row_ops,
            inputs,
            fingerprint: plan.fingerprint(),
            schema: plan.schema().clone(),
        });
        let id = StageId(self.stages.len() - 1);
        self.planned.push((key, id));
        id
    }
}

/// Folds a `map` stage into the stage feeding it when that stage produces blocks on its own
/// (a read, a range, inline batches or another map) and nothing else consumes its output.
pub struct FuseRowOperators;

impl PhysicalRule for FuseRowOperators {
    fn name(&self) -> &'static str {
        "fuse_row_operators"
    }

    fn apply(&self, mut plan: PhysicalPlan) -> PhysicalPlan {
        while let Some((producer, map)) = find_fusable(&plan) {
            let absorbed = plan.stages[map.0].clone();
            let target = &mut plan.stages[producer.0];
            target.row_ops.extend(absorbed.row_ops);
            target.fingerprint = absorbed.fingerprint;
            target.schema = absorbed.schema;
            remove_stage(&mut plan, map, producer);
        }
        plan
    }
}

fn find_fusable(plan: &PhysicalPlan) -> Option<(StageId, StageId)> {
    plan.stages.iter().enumerate().find_map(|(index, stage)| {
        let map = StageId(index);
        if stage.kind != StageKind::Map || stage.inputs.len() != 1 {
            return None;
        }
        let producer = stage.inputs[0];
        let fusable = plan.stage(producer).kind.absorbs_row_ops() && plan.consumers(producer) == 1;
        fusable.then_some((producer, map))
    })
}

/// Removes `removed`, pointing its consumers at `replacement` and renumbering later stages.
fn remove_stage(plan: &mut PhysicalPlan, removed: StageId, replacement: StageId) {
    plan.stages.remove(removed.0);
    let renumber = |id: StageId| {
        let id = if id == removed { replacement } else { id };
        if id.0 > removed.0 {
            StageId(id.0 - 1)
        } else {
            id
        }
    };
    for stage in &mut plan.stages {
        for input in &mut stage.inputs {
            *input = renumber(*input);
        }
    }
    plan.output = renumber(plan.output);
}

impl fmt::Display for PhysicalPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, stage) in self.stages.iter().enumerate() {
            let inputs: Vec<String> = stage.inputs.iter().map(|i| i.0.to_string()).collect();
            write!(f, "stage {index}: {}", stage.kind.describe())?;
            if !inputs.is_empty() {
                write!(f, " <- [{}]", inputs.join(", "))?;
            }
            writeln!(
                f,
                " [{}] -> ({})",
                stage.fingerprint,
                describe_schema(&stage.schema)
            )?;
            for op in &stage.row_ops {
                writeln!(f, "    then {}", op.describe())?;
            }
        }
        writeln!(f, "output: stage {}", self.output.0)
    }
}
