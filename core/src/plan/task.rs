//! What one task of a plan stage runs: the stage and the part of its input this task works
//! on. Drivers build these, node agents carry them, and the engine's task function runs them.

use arrow_schema::Schema;
use serde::{Deserialize, Serialize};

use super::operator::WriteSpec;
use super::physical::Stage;

/// A stage task: the stage (its source or input handling and fused row-wise operators) and
/// what this one task of it works on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageTask {
    pub stage: Stage,
    pub input: StageInput,
    /// The schemas of the stage's inputs (an all-to-all task's blocks may be none at all).
    pub input_schemas: Vec<Schema>,
    /// The job's block size range and reader batch size (performance only).
    pub min_block_bytes: u64,
    pub max_block_bytes: u64,
    pub batch_rows: u32,
    /// A sink fused into the stage: the task writes the rows it makes as this part of the sink
    /// and returns only their count, so they never pass through the object store.
    pub sink: Option<SinkPart>,
    /// A read fused into a shuffle's map side: the task makes its rows by running this
    /// source stage on its own input, then splits them as `input` (a `Partition`) says, so the
    /// read's rows never pass through the object store.
    pub source: Option<FusedSource>,
}

/// The source stage of a map task fused with it, and the part of it the task reads (a read
/// stage's `File`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FusedSource {
    pub stage: Stage,
    pub input: StageInput,
}

/// Part `index` of a sink, written by the task that makes its rows (a sink's parts are
/// numbered in the order of its input, so its files are named in that order).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SinkPart {
    pub spec: WriteSpec,
    pub index: u32,
}

/// What one task of a stage works on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StageInput {
    /// File `index` of a read stage's scan.
    File(u32),
    /// The ids `start..end` of a range stage.
    Range { start: u64, end: u64 },
    /// A from-batches stage's inline rows.
    Inline,
    /// The task's input blocks (map and limit stages).
    Blocks,
    /// The task's input blocks, written as the `index`-th part of a sink.
    Sink { index: u32 },
    /// All-to-all map side: split the input blocks into `partitions` blocks (output i is
    /// partition i). `side` is the join side (0 left, 1 right); the blocks are rows
    /// `offset..` of `total` (for a split without keys); `seed` drives random partitioning.
    Partition {
        partitions: u32,
        side: u8,
        offset: u64,
        total: u64,
        seed: u64,
    },
    /// Sort map side: split the input blocks, rows in input order, at the boundaries (the
    /// last input) into `partitions` blocks; each reduce sorts its partition.
    RangePartition { partitions: u32 },
    /// Sort: up to `rows` sampled sort-key rows of the input blocks, as one block.
    Sample { rows: u32, seed: u64 },
    /// Sort: the range boundaries for `partitions` partitions from the sample blocks.
    Boundaries { partitions: u32 },
    /// All-to-all reduce side: combine partition `partition`'s blocks into the output; for a
    /// join the first `left` inputs are the left side's.
    Reduce {
        partition: u32,
        left: u32,
        seed: u64,
    },
    /// A skewed partition's most frequent key (over its first `left` inputs, the left side's
    /// for a join), as one row: `key` (the values, printed) and `rows`.
    HotKey { left: u32 },
}

impl StageInput {
    /// Whether a task on this input makes rows of its stage's output (a source's, a map's, a
    /// shuffle's reduce), rather than a shuffle's map-side pieces or a sink's files: only such
    /// a task can write a sink fused into its stage.
    pub fn makes_output_rows(&self) -> bool {
        match self {
            StageInput::File(_)
            | StageInput::Range { .. }
            | StageInput::Inline
            | StageInput::Blocks
            | StageInput::Reduce { .. } => true,
            StageInput::Sink { .. }
            | StageInput::Partition { .. }
            | StageInput::RangePartition { .. }
            | StageInput::Sample { .. }
            | StageInput::Boundaries { .. }
            | StageInput::HotKey { .. } => false,
        }
    }
}

impl std::fmt::Display for StageInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StageInput::File(index) => write!(f, "file #{index}"),
            StageInput::Range { start, end } => write!(f, "ids {start}..{end}"),
            StageInput::Inline => f.write_str("inline rows"),
            StageInput::Blocks => f.write_str("input blocks"),
            StageInput::Sink { index } => write!(f, "sink part #{index}"),
            StageInput::Partition { partitions, .. } => {
                write!(f, "a map task into {partitions} partitions")
            }
            StageInput::RangePartition { partitions } => {
                write!(
                    f,
                    "a range-partitioning map task into {partitions} partitions"
                )
            }
            StageInput::Sample { rows, .. } => write!(f, "a sample of {rows} rows"),
            StageInput::Boundaries { partitions } => {
                write!(f, "the boundaries of {partitions} partitions")
            }
            StageInput::Reduce { partition, .. } => {
                write!(f, "the reduce of partition {partition}")
            }
            StageInput::HotKey { .. } => f.write_str("a hot-key count"),
        }
    }
}
