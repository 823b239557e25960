//! The logical operators and their arguments.

use std::fmt;
use std::path::PathBuf;

use arrow_schema::Schema;
use serde::{Deserialize, Serialize};

use super::PlanError;
use super::process::ProcessUdf;
use super::udf::{UdfCall, UdfKind, UdfParams};
use crate::expr::Expr;
use crate::fingerprint::{ArgValue, Args, FileStamp, Seed};
use crate::job::OutputBlock;
use crate::{Fingerprint, JobId};

/// The held output of the job that materialized a dataset: the blocks it left in the nodes'
/// object stores, which a job reading it pulls from their holders. The plan names them and
/// never carries their rows, so the rows stay out of the replicated log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MaterializedSource {
    /// The job whose output this is; it owns the blocks.
    pub job: JobId,
    /// That job's output fingerprint, which this source takes as its own.
    pub fingerprint: Fingerprint,
    pub schema: Schema,
    /// The blocks in output order.
    pub blocks: Vec<OutputBlock>,
}

impl MaterializedSource {
    pub fn rows(&self) -> u64 {
        self.blocks.iter().map(|block| block.rows).sum()
    }

    fn describe(&self) -> String {
        format!(
            "materialized job={} blocks={} rows={}",
            self.job,
            self.blocks.len(),
            self.rows()
        )
    }
}

/// How a file is laid out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileFormat {
    Parquet,
    Csv(CsvOptions),
    /// Newline-delimited JSON: one object per line.
    Json,
    /// UTF-8 text, one row per line in one column `text` (read only).
    Text,
    /// Whole files, one row each: columns `path` and `bytes` (read only).
    Binary,
}

impl FileFormat {
    pub fn name(&self) -> &'static str {
        match self {
            FileFormat::Parquet => "parquet",
            FileFormat::Csv(_) => "csv",
            FileFormat::Json => "json",
            FileFormat::Text => "text",
            FileFormat::Binary => "binary",
        }
    }

    /// Whether a sink can write this format (text and binary files are sources only).
    pub fn is_writable(&self) -> bool {
        matches!(
            self,
            FileFormat::Parquet | FileFormat::Csv(_) | FileFormat::Json
        )
    }

    /// The schema every file of a fixed-schema format has (`text`, `binary`), or `None` when
    /// the files say.
    pub fn fixed_schema(&self) -> Option<Schema> {
        use arrow_schema::{DataType, Field};
        match self {
            FileFormat::Text => Some(Schema::new(vec![Field::new("text", DataType::Utf8, false)])),
            FileFormat::Binary => Some(Schema::new(vec![
                Field::new("path", DataType::Utf8, false),
                Field::new("bytes", DataType::Binary, false),
            ])),
            FileFormat::Parquet | FileFormat::Csv(_) | FileFormat::Json => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CsvOptions {
    pub has_header: bool,
    pub delimiter: u8,
}

impl Default for CsvOptions {
    fn default() -> Self {
        Self {
            has_header: true,
            delimiter: b',',
        }
    }
}

/// A read of files. `projection`, `predicate` and `limit` start empty and are filled by the
/// optimizer's pushdown rules; the read kernel applies them (the predicate first by skipping
/// Parquet row groups whose statistics exclude it, then row by row). A predicate on partition
/// columns also drops the files of partitions it rules out from `files`
/// ([`FileScan::prune_partitions`]), so they are never opened and never fingerprinted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileScan {
    pub format: FileFormat,
    /// Sorted by path; the size and modification time are the source's fingerprint.
    pub files: Vec<FileStamp>,
    /// The schema of the files (all of them share it; the reader checks).
    pub file_schema: Schema,
    /// Hive partition columns (`key=value` directories in every file's path), after the
    /// files' columns in the scan's schema.
    pub partitioning: Vec<PartitionColumn>,
    /// Columns to read, in schema order; `None` reads all.
    pub projection: Option<Vec<String>>,
    pub predicate: Option<Expr>,
    pub limit: Option<u64>,
}

impl FileScan {
    /// `files` are sorted: the order they are given in does not matter. A file given twice is
    /// read twice (as Ray and pyarrow do).
    pub fn new(format: FileFormat, mut files: Vec<FileStamp>, file_schema: Schema) -> Self {
        files.sort();
        Self {
            format,
            files,
            file_schema,
            partitioning: Vec::new(),
            projection: None,
            predicate: None,
            limit: None,
        }
    }

    /// Whether this reader can skip data for a predicate itself: Parquet row-group
    /// statistics, and the partitions of any partitioned format.
    pub fn supports_predicate(&self) -> bool {
        self.format == FileFormat::Parquet || !self.partitioning.is_empty()
    }

    /// The files' columns, then the partition columns: every column the scan can output.
    pub fn full_schema(&self) -> Schema {
        let mut fields: Vec<arrow_schema::Field> = self
            .file_schema
            .fields()
            .iter()
            .map(|field| field.as_ref().clone())
            .collect();
        fields.extend(self.partitioning.iter().map(PartitionColumn::field));
        Schema::new(fields)
    }

    /// This scan without the files whose partition values make its predicate false or null
    /// (see [`super::partition::may_match`]).
    pub fn prune_partitions(&self) -> Result<Self, PlanError> {
        let Some(predicate) = &self.predicate else {
            return Ok(self.clone());
        };
        if self.partitioning.is_empty() {
            return Ok(self.clone());
        }
        let mut files = Vec::with_capacity(self.files.len());
        for file in &self.files {
            let values = super::partition::values_of(&file.path, &self.partitioning)?;
            if super::partition::may_match(predicate, &self.partitioning, &values) {
                files.push(file.clone());
            }
        }
        Ok(Self {
            files,
            ..self.clone()
        })
    }
}

/// The type of a Hive partition column's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PartitionType {
    Int64,
    Utf8,
}

impl PartitionType {
    pub fn name(self) -> &'static str {
        match self {
            PartitionType::Int64 => "int64",
            PartitionType::Utf8 => "string",
        }
    }

    /// Every type, for parsers and their error messages.
    pub const ALL: [PartitionType; 2] = [PartitionType::Int64, PartitionType::Utf8];

    pub fn data_type(self) -> arrow_schema::DataType {
        match self {
            PartitionType::Int64 => arrow_schema::DataType::Int64,
            PartitionType::Utf8 => arrow_schema::DataType::Utf8,
        }
    }
}

/// One Hive partition column: the `name` of `name=value` directories, and its values' type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionColumn {
    pub name: String,
    pub data_type: PartitionType,
}

impl PartitionColumn {
    pub fn new(name: impl Into<String>, data_type: PartitionType) -> Self {
        Self {
            name: name.into(),
            data_type,
        }
    }

    /// Nullable: `__HIVE_DEFAULT_PARTITION__` holds the rows whose value is null.
    pub fn field(&self) -> arrow_schema::Field {
        arrow_schema::Field::new(&self.name, self.data_type.data_type(), true)
    }

    fn to_arg(&self) -> ArgValue {
        ArgValue::List(vec![
            self.name.as_str().into(),
            self.data_type.name().into(),
        ])
    }
}

/// One sort key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SortKey {
    pub column: String,
    pub descending: bool,
    pub nulls_first: bool,
}

impl SortKey {
    /// Ascending with nulls last.
    pub fn asc(column: impl Into<String>) -> Self {
        Self {
            column: column.into(),
            descending: false,
            nulls_first: false,
        }
    }

    /// Descending with nulls first (the mirror of ascending, as in SQL).
    pub fn desc(column: impl Into<String>) -> Self {
        Self {
            column: column.into(),
            descending: true,
            nulls_first: true,
        }
    }

    pub fn nulls_first(mut self, nulls_first: bool) -> Self {
        self.nulls_first = nulls_first;
        self
    }

    fn to_arg(&self) -> ArgValue {
        ArgValue::List(vec![
            self.column.as_str().into(),
            self.descending.into(),
            self.nulls_first.into(),
        ])
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AggFunction {
    /// Rows (with no column) or non-null values of a column.
    Count,
    Sum,
    Mean,
    Min,
    Max,
    /// Sample standard deviation (divides by n − 1; null for fewer than two values).
    Std,
    CountDistinct,
}

impl AggFunction {
    pub fn name(self) -> &'static str {
        match self {
            AggFunction::Count => "count",
            AggFunction::Sum => "sum",
            AggFunction::Mean => "mean",
            AggFunction::Min => "min",
            AggFunction::Max => "max",
            AggFunction::Std => "std",
            AggFunction::CountDistinct => "count_distinct",
        }
    }

    /// Every function, for parsers and their error messages.
    pub const ALL: [AggFunction; 7] = [
        AggFunction::Count,
        AggFunction::Sum,
        AggFunction::Mean,
        AggFunction::Min,
        AggFunction::Max,
        AggFunction::Std,
        AggFunction::CountDistinct,
    ];
}

/// One aggregate output column: `function(column) as alias`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Aggregation {
    pub function: AggFunction,
    /// `None` only for `count`, which then counts rows.
    pub column: Option<String>,
    pub alias: String,
}

impl Aggregation {
    /// `count(*)`.
    pub fn count_rows(alias: impl Into<String>) -> Self {
        Self {
            function: AggFunction::Count,
            column: None,
            alias: alias.into(),
        }
    }

    /// `function(column)`, named `function_column` (e.g. `sum_price`).
    pub fn of(function: AggFunction, column: impl Into<String>) -> Self {
        let column = column.into();
        Self {
            alias: format!("{}_{column}", function.name()),
            function,
            column: Some(column),
        }
    }

    pub fn alias(mut self, alias: impl Into<String>) -> Self {
        self.alias = alias.into();
        self
    }

    fn to_arg(&self) -> ArgValue {
        ArgValue::List(vec![
            self.function.name().into(),
            self.column
                .as_deref()
                .map_or(ArgValue::Null, ArgValue::from),
            self.alias.as_str().into(),
        ])
    }
}

impl fmt::Display for Aggregation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let column = self.column.as_deref().unwrap_or("*");
        write!(f, "{}({column}) as {}", self.function.name(), self.alias)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum JoinType {
    Inner,
    Left,
    Right,
    Full,
    /// Left rows that have a match, left columns only.
    Semi,
    /// Left rows that have no match, left columns only.
    Anti,
}

impl JoinType {
    pub fn name(self) -> &'static str {
        match self {
            JoinType::Inner => "inner",
            JoinType::Left => "left",
            JoinType::Right => "right",
            JoinType::Full => "full",
            JoinType::Semi => "semi",
            JoinType::Anti => "anti",
        }
    }

    /// Every join type, for parsers and their error messages.
    pub const ALL: [JoinType; 6] = [
        JoinType::Inner,
        JoinType::Left,
        JoinType::Right,
        JoinType::Full,
        JoinType::Semi,
        JoinType::Anti,
    ];
}

/// A random shuffle's seed: chosen by the user, or drawn once at submission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SeedChoice {
    /// To be drawn by [`super::LogicalPlan::resolve_seeds`] when the job is submitted.
    Unresolved,
    Fixed(Seed),
}

/// Where and how a sink writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteSpec {
    pub format: FileFormat,
    /// An absolute path: a relative one would mean whichever directory a node runs in, so the
    /// client resolves it against its own working directory and the plan refuses it.
    pub directory: PathBuf,
    /// Files are cut once they pass this many bytes (of Arrow data), so sizes land near it.
    pub target_file_size: u64,
    /// What happens to files already in `directory`.
    pub mode: WriteMode,
    /// The codec inside Parquet files; CSV and NDJSON are written uncompressed.
    pub compression: Compression,
    /// Hive partitioning: rows go to `col=value/…` directories by these columns' values, in
    /// this order, and the files hold the other columns only. Empty: no directories.
    pub partition_by: Vec<String>,
}

/// What a sink does with a directory that already holds files (Spark's and Ray's save modes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum WriteMode {
    /// Refuse a directory that holds visible files: when the job is built, where the client
    /// can see it, and again before the output is published.
    #[default]
    Error,
    /// Replace the directory's contents: the new files are written beside it and swapped in by
    /// renames once all of them are complete, so the old ones vanish only then.
    Overwrite,
    /// Add files next to the existing ones, under names unique to the job.
    Append,
}

impl WriteMode {
    pub fn name(self) -> &'static str {
        match self {
            WriteMode::Error => "error",
            WriteMode::Overwrite => "overwrite",
            WriteMode::Append => "append",
        }
    }

    /// Every mode, for parsers and their error messages.
    pub const ALL: [WriteMode; 3] = [WriteMode::Error, WriteMode::Overwrite, WriteMode::Append];
}

/// A Parquet column codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Compression {
    /// zstd at level 3 (Parquet's default for Polars and DuckDB): small files, fast reads.
    Zstd,
    Snappy,
    Lz4,
    Gzip,
    Uncompressed,
}

impl Compression {
    pub fn name(self) -> &'static str {
        match self {
            Compression::Zstd => "zstd",
            Compression::Snappy => "snappy",
            Compression::Lz4 => "lz4",
            Compression::Gzip => "gzip",
            Compression::Uncompressed => "none",
        }
    }

    /// Every codec, for parsers and their error messages.
    pub const ALL: [Compression; 5] = [
        Compression::Zstd,
        Compression::Snappy,
        Compression::Lz4,
        Compression::Gzip,
        Compression::Uncompressed,
    ];

    /// The codec a sink of `format` uses unless told otherwise: zstd for Parquet, none for the
    /// text formats.
    pub fn default_for(format: &FileFormat) -> Self {
        match format {
            FileFormat::Parquet => Compression::Zstd,
            FileFormat::Csv(_) | FileFormat::Json | FileFormat::Text | FileFormat::Binary => {
                Compression::Uncompressed
            }
        }
    }
}

/// The default target size of written files: 128 MiB, like the maximum block size.
pub const DEFAULT_TARGET_FILE_SIZE: u64 = 128 << 20;

/// A logical operator: *what* to compute, never how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Operator {
    Read(FileScan),
    /// The integers `0..n` in one `Int64` column `id`.
    Range {
        n: u64,
    },
    /// Rows the client supplied, as Arrow IPC stream bytes (decoded by the node).
    FromBatches {
        schema: Schema,
        #[serde(with = "crate::wire::bytes")]
        ipc: Vec<u8>,
        rows: u64,
    },
    /// The output of an earlier job, held in the nodes' object stores (what
    /// `Dataset::materialize` makes on a cluster).
    Materialized(MaterializedSource),
    WithColumn {
        name: String,
        expr: Expr,
    },
    Select {
        columns: Vec<String>,
    },
    Drop {
        columns: Vec<String>,
    },
    Rename {
        /// `(from, to)` pairs in the order given.
        pairs: Vec<(String, String)>,
    },
    Filter {
        predicate: Expr,
    },
    /// A named UDF over whole batches (`map_batches`, or `flat_map` when it changes the row
    /// count; `kind` comes from the UDF's signature).
    Udf {
        call: UdfCall,
        params: UdfParams,
        kind: UdfKind,
        output_schema: Schema,
        /// Rows per call; performance only, never hashed.
        batch_size: Option<u64>,
    },
    /// `map_batches` by a long-lived child process (see [`super::process`]); it may change
    /// the row count.
    ProcessUdf(ProcessUdf),
    Limit {
        n: u64,
    },
    Sort {
        keys: Vec<SortKey>,
    },
    Aggregate {
        keys: Vec<String>,
        aggregations: Vec<Aggregation>,
    },
    Repartition {
        partitions: u32,
        /// Empty: split into equal-sized partitions; else hash-partition on these columns.
        keys: Vec<String>,
    },
    RandomShuffle {
        seed: SeedChoice,
    },
    Join {
        left_keys: Vec<String>,
        right_keys: Vec<String>,
        how: JoinType,
    },
    Union,
    /// Distinct rows of `columns` (all columns when empty).
    Unique {
        columns: Vec<String>,
    },
    /// Keep this output in the cache; the data (and so the fingerprint) is the input's.
    Cache,
    Write(WriteSpec),
}

impl Operator {
    /// The transform id hashed into fingerprints and shown by `explain()`.
    pub fn name(&self) -> &'static str {
        match self {
            Operator::Read(scan) => match scan.format {
                FileFormat::Parquet => "read_parquet",
                FileFormat::Csv(_) => "read_csv",
                FileFormat::Json => "read_json",
                FileFormat::Text => "read_text",
                FileFormat::Binary => "read_binary_files",
            },
            Operator::Range { .. } => "range",
            Operator::FromBatches { .. } => "from_batches",
            Operator::Materialized(_) => "materialized",
            Operator::WithColumn { .. } => "with_column",
            Operator::Select { .. } => "select",
            Operator::Drop { .. } => "drop",
            Operator::Rename { .. } => "rename",
            Operator::Filter { .. } => "filter",
            Operator::Udf { kind, .. } => match kind {
                UdfKind::RowPreserving => "map_batches",
                UdfKind::RowChanging => "flat_map",
            },
            Operator::ProcessUdf(_) => "map_batches_process",
            Operator::Limit { .. } => "limit",
            Operator::Sort { .. } => "sort",
            Operator::Aggregate { .. } => "aggregate",
            Operator::Repartition { .. } => "repartition",
            Operator::RandomShuffle { .. } => "random_shuffle",
            Operator::Join { .. } => "join",
            Operator::Union => "union",
            Operator::Unique { .. } => "unique",
            Operator::Cache => "cache",
            Operator::Write(spec) => match spec.format {
                FileFormat::Parquet => "write_parquet",
                FileFormat::Csv(_) => "write_csv",
                FileFormat::Json => "write_json",
                // Refused when the plan is built (`FileFormat::is_writable`).
                FileFormat::Text => "write_text",
                FileFormat::Binary => "write_binary_files",
            },
        }
    }

    /// The version of this operator's semantics; bump it when its output changes for the same
    /// input and arguments, so older cache entries stop matching.
    pub fn version(&self) -> u32 {
        1
    }

    /// The expressions the operator evaluates; a plan bounds their depth
    /// ([`super::MAX_EXPR_DEPTH`]). Every variant is listed, so a new operator that holds an
    /// expression cannot slip past that check.
    pub fn expressions(&self) -> Vec<&Expr> {
        match self {
            Operator::Read(scan) => scan.predicate.iter().collect(),
            Operator::WithColumn { expr, .. } => vec![expr],
            Operator::Filter { predicate } => vec![predicate],
            Operator::Range { .. }
            | Operator::FromBatches { .. }
            | Operator::Materialized(_)
            | Operator::Select { .. }
            | Operator::Drop { .. }
            | Operator::Rename { .. }
            | Operator::Udf { .. }
            | Operator::ProcessUdf(_)
            | Operator::Limit { .. }
            | Operator::Sort { .. }
            | Operator::Aggregate { .. }
            | Operator::Repartition { .. }
            | Operator::RandomShuffle { .. }
            | Operator::Join { .. }
            | Operator::Union
            | Operator::Unique { .. }
            | Operator::Cache
            | Operator::Write(_) => Vec::new(),
        }
    }

    /// Row-wise operators work on each block alone and can be fused into one task.
    pub fn is_row_wise(&self) -> bool {
        matches!(
            self,
            Operator::WithColumn { .. }
                | Operator::Select { .. }
                | Operator::Drop { .. }
                | Operator::Rename { .. }
                | Operator::Filter { .. }
                | Operator::Udf { .. }
                | Operator::ProcessUdf(_)
        )
    }

    /// Row-wise operators that emit exactly one row per input row (a limit commutes with them).
    pub fn preserves_rows(&self) -> bool {
        match self {
            Operator::Filter { .. } | Operator::ProcessUdf(_) => false,
            Operator::Udf { kind, .. } => *kind == UdfKind::RowPreserving,
            other => other.is_row_wise(),
        }
    }

    /// All-to-all operators need every input block before emitting (the shuffle issue runs them).
    pub fn is_all_to_all(&self) -> bool {
        matches!(
            self,
            Operator::Sort { .. }
                | Operator::Aggregate { .. }
                | Operator::Repartition { .. }
                | Operator::RandomShuffle { .. }
                | Operator::Join { .. }
                | Operator::Unique { .. }
        )
    }

    /// The semantic arguments (and performance-only ones, which are never hashed).
    pub fn args(&self) -> Args {
        let strings =
            |items: &[String]| ArgValue::List(items.iter().map(|s| s.as_str().into()).collect());
        let option = |value: Option<ArgValue>| value.unwrap_or(ArgValue::Null);
        match self {
            Operator::Read(scan) => {
                let mut args = Args::new()
                    .arg_with_default(
                        "projection",
                        option(scan.projection.as_deref().map(strings)),
                        ArgValue::Null,
                    )
                    .arg_with_default(
                        "predicate",
                        option(scan.predicate.as_ref().map(Expr::to_arg)),
                        ArgValue::Null,
                    )
                    .arg_with_default(
                        "limit",
                        option(scan.limit.map(ArgValue::from)),
                        ArgValue::Null,
                    )
                    .arg_with_default(
                        "partitioning",
                        ArgValue::List(
                            scan.partitioning
                                .iter()
                                .map(PartitionColumn::to_arg)
                                .collect(),
                        ),
                        ArgValue::List(Vec::new()),
                    );
                if let FileFormat::Csv(options) = &scan.format {
                    args = args
                        .arg_with_default("has_header", options.has_header, true)
                        .arg_with_default(
                            "delimiter",
                            u32::from(options.delimiter),
                            u32::from(b','),
                        );
                }
                args
            }
            Operator::Range { .. } | Operator::FromBatches { .. } | Operator::Materialized(_) => {
                Args::new()
            }
            Operator::WithColumn { name, expr } => Args::new()
                .arg("name", name.as_str())
                .arg("expr", expr.to_arg()),
            Operator::Select { columns } | Operator::Drop { columns } => {
                Args::new().arg("columns", strings(columns))
            }
            Operator::Rename { pairs } => Args::new().arg(
                "pairs",
                ArgValue::List(
                    pairs
                        .iter()
                        .map(|(from, to)| {
                            ArgValue::List(vec![from.as_str().into(), to.as_str().into()])
                        })
                        .collect(),
                ),
            ),
            Operator::Filter { predicate } => Args::new().arg("predicate", predicate.to_arg()),
            Operator::Udf {
                call,
                params,
                batch_size,
                ..
            } => {
                // The UDF's name and version are arguments so that a cache miss can say which
                // UDF changed; `params` has every declared parameter, defaults filled in, so
                // spelling out a default hashes like leaving it out.
                let mut args = Args::new()
                    .arg("udf", call.name.as_str())
                    .arg("udf_version", call.version)
                    .arg("params", params.to_arg());
                if let Some(batch_size) = batch_size {
                    args = args.performance("batch_size", *batch_size);
                }
                args
            }
            Operator::ProcessUdf(udf) => udf.args(),
            Operator::Limit { n } => Args::new().arg("n", *n),
            Operator::Sort { keys } => Args::new().arg(
                "keys",
                ArgValue::List(keys.iter().map(SortKey::to_arg).collect()),
            ),
            Operator::Aggregate { keys, aggregations } => {
                Args::new().arg("keys", strings(keys)).arg(
                    "aggregations",
                    ArgValue::List(aggregations.iter().map(Aggregation::to_arg).collect()),
                )
            }
            Operator::Repartition { partitions, keys } => Args::new()
                .arg("partitions", *partitions)
                .arg_with_default("keys", strings(keys), ArgValue::List(Vec::new())),
            Operator::RandomShuffle { seed } => match seed {
                SeedChoice::Fixed(seed) => Args::new().seed(*seed),
                SeedChoice::Unresolved => Args::new().arg("seed", ArgValue::Null),
            },
            Operator::Join {
                left_keys,
                right_keys,
                how,
            } => Args::new()
                .arg("left_keys", strings(left_keys))
                .arg("right_keys", strings(right_keys))
                .arg("how", how.name()),
            Operator::Union | Operator::Cache => Args::new(),
            Operator::Unique { columns } => Args::new().arg("columns", strings(columns)),
            Operator::Write(spec) => {
                // The codec changes the files' bytes, not the rows they hold.
                let mut args = Args::new()
                    .arg("directory", spec.directory.to_string_lossy().into_owned())
                    .arg("target_file_size", spec.target_file_size)
                    .arg_with_default("mode", spec.mode.name(), WriteMode::Error.name())
                    .arg_with_default(
                        "partition_by",
                        strings(&spec.partition_by),
                        ArgValue::List(Vec::new()),
                    )
                    .performance("compression", spec.compression.name());
                if let FileFormat::Csv(options) = &spec.format {
                    args = args
                        .arg_with_default("has_header", options.has_header, true)
                        .arg_with_default(
                            "delimiter",
                            u32::from(options.delimiter),
                            u32::from(b','),
                        );
                }
                args
            }
        }
    }

    /// One line describing the operator and its arguments, for `explain()`.
    pub fn describe(&self) -> String {
        let list = |items: &[String]| items.join(", ");
        match self {
            Operator::Read(scan) => {
                let mut text = format!("{} files={}", self.name(), scan.files.len());
                if let Some(projection) = &scan.projection {
                    text.push_str(&format!(" projection=[{}]", list(projection)));
                }
                if let Some(predicate) = &scan.predicate {
                    text.push_str(&format!(" predicate={predicate}"));
                }
                if let Some(limit) = scan.limit {
                    text.push_str(&format!(" limit={limit}"));
                }
                if !scan.partitioning.is_empty() {
                    let columns: Vec<String> = scan
                        .partitioning
                        .iter()
                        .map(|column| format!("{}: {}", column.name, column.data_type.name()))
                        .collect();
                    text.push_str(&format!(" partitioning=[{}]", columns.join(", ")));
                }
                text
            }
            Operator::Range { n } => format!("range n={n}"),
            Operator::FromBatches { rows, ipc, .. } => {
                format!("from_batches rows={rows} bytes={}", ipc.len())
            }
            Operator::Materialized(source) => source.describe(),
            Operator::WithColumn { name, expr } => format!("with_column {name}={expr}"),
            Operator::Select { columns } => format!("select [{}]", list(columns)),
            Operator::Drop { columns } => format!("drop [{}]", list(columns)),
            Operator::Rename { pairs } => {
                let pairs: Vec<String> = pairs.iter().map(|(a, b)| format!("{a}->{b}")).collect();
                format!("rename [{}]", pairs.join(", "))
            }
            Operator::Filter { predicate } => format!("filter {predicate}"),
            Operator::Udf { call, .. } => format!("{} {call}", self.name()),
            Operator::ProcessUdf(udf) => format!("{} {}", self.name(), udf.command_line()),
            Operator::Limit { n } => format!("limit {n}"),
            Operator::Sort { keys } => {
                let keys: Vec<String> = keys
                    .iter()
                    .map(|k| {
                        let order = if k.descending { "desc" } else { "asc" };
                        let nulls = if k.nulls_first { "first" } else { "last" };
                        format!("{} {order} nulls {nulls}", k.column)
                    })
                    .collect();
                format!("sort [{}]", keys.join(", "))
            }
            Operator::Aggregate { keys, aggregations } => {
                let aggs: Vec<String> = aggregations.iter().map(ToString::to_string).collect();
                format!("groupby [{}] agg [{}]", list(keys), aggs.join(", "))
            }
            Operator::Repartition { partitions, keys } if keys.is_empty() => {
                format!("repartition {partitions}")
            }
            Operator::Repartition { partitions, keys } => {
                format!("repartition {partitions} by [{}]", list(keys))
            }
            Operator::RandomShuffle { seed } => match seed {
                SeedChoice::Fixed(seed) => format!("random_shuffle seed={}", seed.get()),
                SeedChoice::Unresolved => "random_shuffle seed=<at submission>".to_owned(),
            },
            Operator::Join {
                left_keys,
                right_keys,
                how,
            } => format!(
                "join {} on [{}] = [{}]",
                how.name(),
                list(left_keys),
                list(right_keys)
            ),
            Operator::Union => "union".to_owned(),
            Operator::Unique { columns } => format!("unique [{}]", list(columns)),
            Operator::Cache => "cache".to_owned(),
            Operator::Write(spec) => {
                let mut text = format!(
                    "{} {} mode={} compression={} target_file_size={}",
                    self.name(),
                    spec.directory.display(),
                    spec.mode.name(),
                    spec.compression.name(),
                    spec.target_file_size
                );
                if !spec.partition_by.is_empty() {
                    text.push_str(&format!(" partition_by=[{}]", list(&spec.partition_by)));
                }
                text
            }
        }
    }
}
