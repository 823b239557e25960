//! The job-spec file `floe submit` reads: a pipeline in TOML for users who do not write Rust.
//!
//! ```toml
//! [source]
//! read_csv = ["data/*.csv"]          # or read_parquet / read_json / read_text /
//!                                    # read_binary_files = [paths], or range = 1000
//!
//! [[steps]]
//! filter = "quantity > 2 and region != 'north'"
//!
//! [[steps]]
//! with_column = { name = "revenue", expr = "price * cast(quantity, 'float64')" }
//!
//! [[steps]]
//! groupby = ["region"]
//! agg = ["count(*) as orders", "sum(revenue) as revenue", "mean(price)"]
//!
//! [[steps]]
//! sort = ["revenue desc"]
//!
//! [sink]                             # optional: without it the result stays in the cluster
//! write_parquet = "out/revenue"      # or write_csv / write_json
//!
//! [options]                          # optional
//! cache = "reuse"                    # "reuse", "recompute" or "none"
//! retries = 3
//! ```
//!
//! The whole language — every table, step, aggregate, function, type and option, with an
//! example each — is documented in `docs/JOBSPEC.md`, whose examples a test parses with
//! [`check_job_file`]. Every table refuses a key it does not know — a misspelled `aggs` is an
//! error that suggests `agg`, never a silently different job. A plan is at most
//! [`floe_core::plan::MAX_PLAN_DEPTH`] operators deep and an expression at most
//! [`floe_core::plan::MAX_EXPR_DEPTH`] levels. Relative paths are resolved against the working
//! directory (that of `floe submit`) before the plan is built, and a spec that came over the
//! network must name absolute ones ([`PathRule`]).
//!
//! The whole file is checked before anything is submitted: every error names the job file,
//! the line and the field (`job.toml:7: steps[2].agg: …`), and the plan is built (so unknown
//! columns and type mismatches are caught too). A data file that cannot be read is named too.

use std::collections::BTreeMap;
use std::fmt;

use arrow::datatypes::{DataType, Field, Schema};
use floe_core::config::{AllowedPaths, ByteSize};
use floe_core::expr::{Expr, coalesce, col, hash, lit, null, null_on_error, when};
use floe_core::fingerprint::ArgValue;
use floe_core::fingerprint::FileDigest;
use floe_core::job::{CacheMode, JobOptions};
use floe_core::plan::{
    AggFunction, Aggregation, Compression, Concurrency, CsvOptions, FileFormat, JoinType,
    PartitionColumn, PartitionType, ProcessUdf, SortKey, UdfCall, UdfKind, WriteMode,
};
use serde::Deserialize;
use toml::Spanned;

use std::sync::Arc;

use crate::{Dataset, Partitioning, ReadOptions, Registry, WriteOptions};

/// A job-spec error: where, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: {field}: {message}")]
pub struct JobSpecError {
    pub file: String,
    pub line: usize,
    pub field: String,
    pub message: String,
}

/// A parsed job spec: the dataset to run, its options and its name.
pub struct JobFile {
    pub dataset: Dataset,
    pub options: JobOptions,
    /// The file's `name`, if it gives one.
    pub name: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpec {
    name: Option<Spanned<String>>,
    source: Spanned<toml::Table>,
    /// Named sources that `join` and `union` steps refer to.
    #[serde(default)]
    sources: BTreeMap<String, Spanned<toml::Table>>,
    #[serde(default)]
    steps: Vec<Spanned<toml::Table>>,
    sink: Option<Spanned<toml::Table>>,
    options: Option<Spanned<toml::Table>>,
}

/// How a job spec may spell paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathRule {
    /// Relative paths are resolved against the working directory (`floe submit`).
    RelativeToWorkingDir,
    /// Only absolute paths: the spec came over the network, and a path relative to the
    /// server's working directory would mean nothing to its sender.
    AbsoluteOnly,
}

/// Which paths a job spec may name: how they are spelled, and where they may lead
/// (`data.allowed_paths`, checked before any file is opened).
#[derive(Debug, Clone)]
pub struct PathPolicy {
    pub rule: PathRule,
    pub allowed: AllowedPaths,
}

impl PathPolicy {
    /// `floe submit`: relative paths, anywhere.
    pub fn local() -> Self {
        Self {
            rule: PathRule::RelativeToWorkingDir,
            allowed: AllowedPaths::any(),
        }
    }

    /// A spec that came over the network: absolute paths under `allowed`.
    pub fn submitted(allowed: AllowedPaths) -> Self {
        Self {
            rule: PathRule::AbsoluteOnly,
            allowed,
        }
    }
}

/// Reads a job spec; `file` names it in errors, and UDF steps are checked against `udfs`.
/// Relative paths are resolved against the working directory.
pub fn parse_job_file(
    file: &str,
    text: &str,
    udfs: Arc<Registry>,
) -> Result<JobFile, JobSpecError> {
    parse_job_file_with(file, text, udfs, &PathPolicy::local())
}

/// [`parse_job_file`] with a choice of which paths are allowed.
pub fn parse_job_file_with(
    file: &str,
    text: &str,
    udfs: Arc<Registry>,
    paths: &PathPolicy,
) -> Result<JobFile, JobSpecError> {
    let (parsed, locate) = parse_spec(file, text, paths)?;
    let at = |place: &Place, error: FieldError| locate(place, error);
    let build_source = |source: &Source, place: &Place| {
        source
            .build(paths)
            .map(|dataset| dataset.with_udfs(Arc::clone(&udfs)))
            .map_err(|error| at(place, error))
    };
    let mut named = BTreeMap::new();
    for (name, (source, place)) in &parsed.sources {
        named.insert(name.clone(), build_source(source, place)?);
    }
    let (source, place) = &parsed.source;
    let mut dataset = build_source(source, place)?;
    for (step, place) in &parsed.steps {
        dataset = step
            .apply(dataset, &named)
            .map_err(|error| at(place, error))?;
    }
    if let Some((sink, place)) = &parsed.sink {
        dataset = sink.apply(dataset).map_err(|error| at(place, error))?;
    }
    Ok(JobFile {
        dataset,
        options: parsed.options,
        name: parsed.name,
    })
}

/// Checks everything in a job spec that does not need its data: the TOML, every table's keys,
/// step names, expressions, aggregations, sort keys, types, sink and job options, and that
/// `join` and `union` name sources the file defines. Files are not opened, so a spec whose
/// data is elsewhere (an example in the docs) can still be checked; a column a step names is
/// checked only when the job is built ([`parse_job_file`]).
pub fn check_job_file(file: &str, text: &str) -> Result<(), JobSpecError> {
    let policy = PathPolicy::local();
    parse_spec(file, text, &policy).map(|_| ())
}

/// Where in the file a part of the spec was: its offset and its field path.
struct Place {
    offset: usize,
    field: String,
}

/// A job spec with every table parsed, before any file is opened.
struct ParsedSpec {
    source: (Source, Place),
    sources: BTreeMap<String, (Source, Place)>,
    steps: Vec<(Step, Place)>,
    sink: Option<(Sink, Place)>,
    options: JobOptions,
    name: Option<String>,
}

/// Turns a place and an error inside it into the error the user sees.
type Locate<'a> = Box<dyn Fn(&Place, FieldError) -> JobSpecError + 'a>;

fn parse_spec<'a>(
    file: &'a str,
    text: &'a str,
    paths: &PathPolicy,
) -> Result<(ParsedSpec, Locate<'a>), JobSpecError> {
    let line_of = move |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
    let at = move |offset: usize, field: &str, message: String| JobSpecError {
        file: file.to_owned(),
        line: line_of(offset),
        field: field.to_owned(),
        message,
    };
    let raw: RawSpec = toml::from_str(text).map_err(|error| {
        let offset = error.span().map_or(0, |span| span.start);
        match unknown_table(text) {
            Some((key, message)) => at(offset, &key, message),
            None => at(offset, "file", error.message().to_owned()),
        }
    })?;
    // `field` is empty when the error is about the whole table.
    let locate: Locate<'a> = Box::new(move |place: &Place, (field, message): FieldError| {
        let field = if field.is_empty() {
            place.field.clone()
        } else {
            format!("{}.{field}", place.field)
        };
        at(place.offset, &field, message)
    });
    let place = |offset: usize, field: String| Place { offset, field };
    let mut sources = BTreeMap::new();
    for (name, table) in &raw.sources {
        let here = place(table.span().start, format!("sources.{name}"));
        let source = Source::parse(table.get_ref(), paths).map_err(|e| locate(&here, e))?;
        sources.insert(name.clone(), (source, here));
    }
    let here = place(raw.source.span().start, "source".to_owned());
    let source = (
        Source::parse(raw.source.get_ref(), paths).map_err(|e| locate(&here, e))?,
        here,
    );
    let source_names: Vec<&str> = raw.sources.keys().map(String::as_str).collect();
    let mut steps = Vec::with_capacity(raw.steps.len());
    for (index, step) in raw.steps.iter().enumerate() {
        let here = place(step.span().start, format!("steps[{index}]"));
        let parsed =
            Step::parse(step.get_ref(), paths, &source_names).map_err(|e| locate(&here, e))?;
        steps.push((parsed, here));
    }
    let sink = match &raw.sink {
        Some(sink) => {
            let here = place(sink.span().start, "sink".to_owned());
            let parsed = Sink::parse(sink.get_ref(), paths).map_err(|e| locate(&here, e))?;
            Some((parsed, here))
        }
        None => None,
    };
    let options = match &raw.options {
        Some(options) => {
            let here = place(options.span().start, "options".to_owned());
            job_options(options.get_ref()).map_err(|e| locate(&here, e))?
        }
        None => JobOptions::default(),
    };
    if let Some(name) = &raw.name
        && name.get_ref().trim().is_empty()
    {
        let here = place(name.span().start, "name".to_owned());
        return Err(locate(
            &here,
            field_error("", "a job's name cannot be empty"),
        ));
    }
    Ok((
        ParsedSpec {
            source,
            sources,
            steps,
            sink,
            options,
            name: raw.name.map(Spanned::into_inner),
        },
        locate,
    ))
}

/// A field name and what is wrong with it.
type FieldError = (String, String);

fn field_error(field: &str, message: impl std::fmt::Display) -> FieldError {
    (field.to_owned(), message.to_string())
}

/// The top-level keys and tables a job file has.
const TABLES: [&str; 6] = ["name", "source", "sources", "steps", "sink", "options"];

/// When `text` has a top-level table the format does not know: its name, and a message that
/// suggests the nearest known one (TOML's own message only lists them).
fn unknown_table(text: &str) -> Option<(String, String)> {
    let table: toml::Table = toml::from_str(text).ok()?;
    let key = table.keys().find(|key| !TABLES.contains(&key.as_str()))?;
    let message = format!(
        "unknown table `{key}`{}; a job file has {}",
        did_you_mean(key, &TABLES),
        TABLES.join(", ")
    );
    Some((key.clone(), message))
}

/// The edits that turn `a` into `b`: insertions, deletions, substitutions and swaps of two
/// neighbouring characters (the commonest typo: `rnage`).
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // distance[i][j]: between the first i characters of `a` and the first j of `b`.
    let mut distance = vec![vec![0; b.len() + 1]; a.len() + 1];
    for (i, row) in distance.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in distance[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let substitution = distance[i - 1][j - 1] + usize::from(a[i - 1] != b[j - 1]);
            let mut best = substitution
                .min(distance[i - 1][j] + 1)
                .min(distance[i][j - 1] + 1);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(distance[i - 2][j - 2] + 1);
            }
            distance[i][j] = best;
        }
    }
    distance[a.len()][b.len()]
}

/// ` (did you mean `agg`?)` when one of `known` is a small edit away from `key` (at most one
/// edit per three characters, and at least one), else nothing.
fn did_you_mean(key: &str, known: &[&str]) -> String {
    let allowed = (key.chars().count() / 3).max(1);
    known
        .iter()
        .map(|candidate| (edit_distance(key, candidate), *candidate))
        .filter(|(distance, _)| *distance <= allowed)
        .min_by_key(|(distance, _)| *distance)
        .map_or_else(String::new, |(_, nearest)| {
            format!(" (did you mean `{nearest}`?)")
        })
}

/// `a, b, c` with each name quoted.
fn quoted(names: &[&str]) -> String {
    names
        .iter()
        .map(|name| format!("`{name}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Refuses every key of `table` that is not in `known`. `prefix` leads the field path of the
/// error, `what` names the table in its message.
fn refuse_unknown_keys(
    table: &toml::Table,
    known: &[&str],
    prefix: &str,
    what: &str,
) -> Result<(), FieldError> {
    let Some(key) = table.keys().find(|key| !known.contains(&key.as_str())) else {
        return Ok(());
    };
    let field = if prefix.is_empty() {
        key.clone()
    } else {
        format!("{prefix}.{key}")
    };
    Err(field_error(
        &field,
        format!(
            "unknown key `{key}` in {what}{}; it takes {}",
            did_you_mean(key, known),
            quoted(known)
        ),
    ))
}

/// A kind of source, step or sink: the key that names it, and the other keys its table may
/// hold.
struct Kind {
    name: &'static str,
    with: &'static [&'static str],
}

const fn kind(name: &'static str) -> Kind {
    Kind { name, with: &[] }
}

/// The one key of `table` that says which kind of `what` (source, step, sink) it is, with its
/// value, once every other key is known to belong to that kind: nothing in the table is
/// ignored.
fn kind_of<'a>(
    table: &'a toml::Table,
    kinds: &[Kind],
    what: &str,
) -> Result<(&'static str, &'a toml::Value), FieldError> {
    let names: Vec<&str> = kinds.iter().map(|kind| kind.name).collect();
    let owner = |key: &str| kinds.iter().find(|kind| kind.with.contains(&key));
    let mut named = kinds
        .iter()
        .filter_map(|kind| table.get(kind.name).map(|value| (kind, value)));
    let Some((found, value)) = named.next() else {
        // No kind is named: most likely its name is misspelled.
        return Err(
            match table.keys().find(|key| owner(key.as_str()).is_none()) {
                Some(key) => field_error(
                    key,
                    format!(
                        "unknown {what} `{key}`{}; a {what} is one of {}",
                        did_you_mean(key, &names),
                        quoted(&names)
                    ),
                ),
                None => match table.keys().next() {
                    Some(key) => field_error(
                        key,
                        format!(
                            "`{key}` belongs to a {} {what}, but this table names no {what}; \
                             a {what} is one of {}",
                            owner(key).map_or("", |kind| kind.name),
                            quoted(&names)
                        ),
                    ),
                    None => field_error(
                        "",
                        format!("an empty {what}: expected one of {}", quoted(&names)),
                    ),
                },
            },
        );
    };
    if let Some((other, _)) = named.next() {
        return Err(field_error(
            other.name,
            format!(
                "`{}` and `{}` cannot be in one {what}; give each its own table",
                found.name, other.name
            ),
        ));
    }
    let known: Vec<&str> = std::iter::once(found.name)
        .chain(found.with.iter().copied())
        .collect();
    if let Some(key) = table.keys().find(|key| !known.contains(&key.as_str())) {
        let elsewhere = owner(key)
            .map(|kind| format!(" (`{key}` belongs to a {} {what})", kind.name))
            .unwrap_or_default();
        return Err(field_error(
            key,
            format!(
                "unknown key `{key}` in a {} {what}{}; a {} {what} takes {}{elsewhere}",
                found.name,
                did_you_mean(key, &known),
                found.name,
                quoted(&known)
            ),
        ));
    }
    Ok((found.name, value))
}

fn strings(field: &str, value: &toml::Value) -> Result<Vec<String>, FieldError> {
    let items = match value {
        toml::Value::String(item) => return Ok(vec![item.clone()]),
        toml::Value::Array(items) => items,
        other => {
            return Err(field_error(
                field,
                format!("expected a list of strings, got {other}"),
            ));
        }
    };
    items
        .iter()
        .map(|item| match item {
            toml::Value::String(item) => Ok(item.clone()),
            other => Err(field_error(
                field,
                format!("expected a string, got {other}"),
            )),
        })
        .collect()
}

fn integer(field: &str, value: &toml::Value) -> Result<u64, FieldError> {
    value
        .as_integer()
        .and_then(|n| u64::try_from(n).ok())
        .ok_or_else(|| {
            field_error(
                field,
                format!("expected a non-negative integer, got {value}"),
            )
        })
}

/// Refuses a relative `path` where the policy wants absolute ones, and a path outside the
/// allowed roots.
fn check_path(field: &str, path: &str, policy: &PathPolicy) -> Result<(), FieldError> {
    let given = std::path::Path::new(path);
    if floe_core::location::is_remote(given) {
        // An object URL is absolute by nature; only the allowlist applies.
        return policy
            .allowed
            .check(given)
            .map_err(|error| field_error(field, error));
    }
    if policy.rule == PathRule::AbsoluteOnly && !given.is_absolute() {
        return Err(field_error(
            field,
            format!("{path:?} is relative; a submitted job must name absolute paths"),
        ));
    }
    if policy.allowed.is_restricted() {
        let absolute = std::path::absolute(given)
            .map_err(|error| field_error(field, format!("{path}: {error}")))?;
        policy
            .allowed
            .check(&absolute)
            .map_err(|error| field_error(field, error))?;
    }
    Ok(())
}

/// The kinds of source; file sources also take `partitioning`.
const SOURCES: [Kind; 6] = [
    Kind {
        name: "read_csv",
        with: &["partitioning"],
    },
    Kind {
        name: "read_parquet",
        with: &["partitioning"],
    },
    Kind {
        name: "read_json",
        with: &["partitioning"],
    },
    Kind {
        name: "read_text",
        with: &["partitioning"],
    },
    Kind {
        name: "read_binary_files",
        with: &["partitioning"],
    },
    kind("range"),
];

/// A source as the file spells it.
enum Source {
    Range(u64),
    Read {
        kind: &'static str,
        format: FileFormat,
        paths: Vec<String>,
        partitioning: Partitioning,
    },
}

/// `partitioning = "hive"` (discover, the default), `"none"`, or a table of declared
/// columns and their types (`{ date = "string", year = "int64" }`).
fn partitioning(value: Option<&toml::Value>) -> Result<Partitioning, FieldError> {
    let types: Vec<&str> = PartitionType::ALL.iter().map(|t| t.name()).collect();
    match value {
        None => Ok(Partitioning::Hive),
        Some(toml::Value::String(text)) if text == "hive" => Ok(Partitioning::Hive),
        Some(toml::Value::String(text)) if text == "none" => Ok(Partitioning::Ignore),
        Some(toml::Value::Table(columns)) => columns
            .iter()
            .map(|(name, data_type)| {
                let text = data_type.as_str().unwrap_or_default();
                PartitionType::ALL
                    .into_iter()
                    .find(|t| t.name() == text)
                    .map(|t| PartitionColumn::new(name.clone(), t))
                    .ok_or_else(|| {
                        field_error(
                            "partitioning",
                            format!(
                                "unknown partition type {data_type} for `{name}`{}; it is one of {}",
                                did_you_mean(text, &types),
                                quoted(&types)
                            ),
                        )
                    })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Partitioning::Declared),
        Some(other) => Err(field_error(
            "partitioning",
            format!(
                "expected \"hive\", \"none\" or a table of column types, got {other}"
            ),
        )),
    }
}

impl Source {
    fn parse(table: &toml::Table, policy: &PathPolicy) -> Result<Self, FieldError> {
        let (kind, value) = kind_of(table, &SOURCES, "source")?;
        if kind == "range" {
            return Ok(Source::Range(integer(kind, value)?));
        }
        let paths = strings(kind, value)?;
        for path in &paths {
            check_path(kind, path, policy)?;
        }
        let format = match kind {
            "read_csv" => FileFormat::Csv(CsvOptions::default()),
            "read_parquet" => FileFormat::Parquet,
            "read_text" => FileFormat::Text,
            "read_binary_files" => FileFormat::Binary,
            _ => FileFormat::Json,
        };
        Ok(Source::Read {
            kind,
            format,
            paths,
            partitioning: partitioning(table.get("partitioning"))?,
        })
    }

    /// The dataset: files are found and their schema read here. Relative paths are resolved
    /// against the working directory.
    fn build(&self, policy: &PathPolicy) -> Result<Dataset, FieldError> {
        let (kind, format, paths, partitioning) = match self {
            Source::Range(n) => return Dataset::range(*n).map_err(|e| field_error("range", e)),
            Source::Read {
                kind,
                format,
                paths,
                partitioning,
            } => (*kind, format, paths, partitioning),
        };
        let check_files = |files: &[&std::path::Path]| {
            files
                .iter()
                .try_for_each(|file| check_path(kind, &file.to_string_lossy(), policy))
        };
        if policy.allowed.is_restricted() {
            // Every file a pattern or directory expands to is checked before any is
            // opened: a symlink inside an allowed directory may lead out of it.
            let files =
                floe_engine::read::expand_paths(paths).map_err(|error| field_error(kind, error))?;
            check_files(&files.iter().map(|file| file.as_path()).collect::<Vec<_>>())?;
        }
        let options = ReadOptions {
            columns: None,
            partitioning: partitioning.clone(),
        };
        let dataset = Dataset::read_with(format.clone(), paths, &options)
            .map_err(|error| field_error(kind, error))?;
        if policy.allowed.is_restricted()
            && let floe_core::plan::Operator::Read(scan) = dataset.plan().operator()
        {
            // The directories are listed again to find partitions: what they hold now is
            // what the job reads, so it is checked too.
            check_files(
                &scan
                    .files
                    .iter()
                    .map(|stamp| stamp.path.as_path())
                    .collect::<Vec<_>>(),
            )?;
        }
        Ok(dataset)
    }
}

/// The kinds of step, and the keys each takes beside its name.
const STEPS: [Kind; 16] = [
    kind("filter"),
    kind("with_column"),
    kind("select"),
    kind("drop"),
    kind("rename"),
    kind("limit"),
    Kind {
        name: "groupby",
        with: &["agg"],
    },
    kind("sort"),
    kind("unique"),
    Kind {
        name: "repartition",
        with: &["keys"],
    },
    kind("random_shuffle"),
    kind("cache"),
    kind("map_batches"),
    kind("flat_map"),
    kind("join"),
    kind("union"),
];

/// The keys of a `with_column` table.
const WITH_COLUMN_KEYS: [&str; 2] = ["name", "expr"];
/// The keys of a call of a registered UDF (`map_batches` or `flat_map`).
const UDF_CALL_KEYS: [&str; 3] = ["udf", "version", "args"];
/// The keys of a `join` table.
const JOIN_KEYS: [&str; 5] = ["with", "on", "left_on", "right_on", "how"];
/// Join types, by the name a job file gives them.
const JOIN_TYPES: [(&str, JoinType); 6] = [
    ("inner", JoinType::Inner),
    ("left", JoinType::Left),
    ("right", JoinType::Right),
    ("full", JoinType::Full),
    ("semi", JoinType::Semi),
    ("anti", JoinType::Anti),
];

/// One step, parsed: everything the file says, before any data is looked at.
enum Step {
    Filter(Expr),
    WithColumn {
        name: String,
        expr: Expr,
    },
    Select(Vec<String>),
    Drop(Vec<String>),
    Unique(Vec<String>),
    Rename(Vec<(String, String)>),
    Limit(u64),
    GroupBy {
        keys: Vec<String>,
        aggregations: Vec<Aggregation>,
    },
    Sort(Vec<SortKey>),
    Repartition {
        partitions: u32,
        keys: Option<Vec<String>>,
    },
    RandomShuffle(u64),
    Cache(bool),
    Process(ProcessUdf),
    Udf {
        call: UdfCall,
        kind: UdfKind,
    },
    Join {
        with: String,
        left_on: Vec<String>,
        right_on: Vec<String>,
        how: JoinType,
    },
    Union(Vec<String>),
}

/// A named source a `join` or `union` step refers to, or an error that lists them.
fn source_name(field: &str, name: &str, known: &[&str]) -> Result<String, FieldError> {
    if known.contains(&name) {
        return Ok(name.to_owned());
    }
    let defined = if known.is_empty() {
        "the file defines none (add a `[sources.NAME]` table)".to_owned()
    } else {
        format!("the file defines {}", quoted(known))
    };
    Err(field_error(
        field,
        format!(
            "no source named `{name}`{}; {defined}",
            did_you_mean(name, known)
        ),
    ))
}

impl Step {
    fn parse(
        table: &toml::Table,
        policy: &PathPolicy,
        sources: &[&str],
    ) -> Result<Self, FieldError> {
        let (op, value) = kind_of(table, &STEPS, "step")?;
        let names = |field: &str, value: &toml::Value| strings(field, value);
        let expression = |field: &str, text: &str| {
            parse_expr(text).map_err(|message| field_error(field, message))
        };
        Ok(match op {
            "filter" => {
                let text = value
                    .as_str()
                    .ok_or_else(|| field_error(op, "expected an expression string"))?;
                Step::Filter(expression(op, text)?)
            }
            "with_column" => {
                let spec = value
                    .as_table()
                    .ok_or_else(|| field_error(op, "expected { name = .., expr = .. }"))?;
                refuse_unknown_keys(spec, &WITH_COLUMN_KEYS, op, "with_column")?;
                let name = spec
                    .get("name")
                    .and_then(|v| v.as_str())
                    .ok_or_else(|| field_error("with_column.name", "missing"))?;
                let text = spec
                    .get("expr")
                    .and_then(|v| v.as_str())
                    .ok_or_else(|| field_error("with_column.expr", "missing"))?;
                Step::WithColumn {
                    name: name.to_owned(),
                    expr: expression("with_column.expr", text)?,
                }
            }
            "select" => Step::Select(names(op, value)?),
            "drop" => Step::Drop(names(op, value)?),
            "unique" => Step::Unique(names(op, value)?),
            "rename" => {
                let spec = value
                    .as_table()
                    .ok_or_else(|| field_error(op, "expected { old = \"new\" }"))?;
                let pairs = spec
                    .iter()
                    .map(|(from, to)| {
                        to.as_str()
                            .map(|to| (from.clone(), to.to_owned()))
                            .ok_or_else(|| {
                                field_error(&format!("rename.{from}"), "expected a string")
                            })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Step::Rename(pairs)
            }
            "limit" => Step::Limit(integer(op, value)?),
            "groupby" => {
                let aggregations = match table.get("agg") {
                    Some(agg) => strings("agg", agg)?
                        .iter()
                        .map(|text| parse_aggregation(text).map_err(|m| field_error("agg", m)))
                        .collect::<Result<Vec<_>, _>>()?,
                    None => Vec::new(),
                };
                Step::GroupBy {
                    keys: names(op, value)?,
                    aggregations,
                }
            }
            "sort" => Step::Sort(
                names(op, value)?
                    .iter()
                    .map(|text| parse_sort_key(text).map_err(|m| field_error(op, m)))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            "repartition" => Step::Repartition {
                partitions: u32::try_from(integer(op, value)?)
                    .map_err(|_| field_error(op, "too many partitions"))?,
                keys: table
                    .get("keys")
                    .map(|keys| names("keys", keys))
                    .transpose()?,
            },
            "random_shuffle" => Step::RandomShuffle(integer(op, value)?),
            "cache" => Step::Cache(
                value
                    .as_bool()
                    .ok_or_else(|| field_error(op, "expected true or false"))?,
            ),
            "map_batches" if value.get("command").is_some() => {
                let spec = value
                    .as_table()
                    .ok_or_else(|| field_error(op, "expected { command = .., args = [..] }"))?;
                Step::Process(process_udf(spec, policy)?)
            }
            "join" => {
                let spec = value.as_table().ok_or_else(|| {
                    field_error(
                        op,
                        "expected { with = \"NAME\", on = [..], how = \"inner\" }",
                    )
                })?;
                refuse_unknown_keys(spec, &JOIN_KEYS, op, "a join")?;
                let with = spec
                    .get("with")
                    .and_then(|v| v.as_str())
                    .ok_or_else(|| field_error("join.with", "missing: the name of a source"))?;
                let keys = |key: &str| {
                    spec.get(key)
                        .map(|value| strings(&format!("join.{key}"), value))
                        .transpose()
                };
                let (left_on, right_on) = match (keys("on")?, keys("left_on")?, keys("right_on")?) {
                    (Some(on), None, None) => (on.clone(), on),
                    (None, Some(left), Some(right)) => (left, right),
                    _ => {
                        return Err(field_error(
                            op,
                            "give `on` (columns named alike on both sides), or both `left_on` \
                             and `right_on`",
                        ));
                    }
                };
                let how = match spec.get("how") {
                    None => JoinType::Inner,
                    Some(how) => {
                        let how = how.as_str().unwrap_or_default();
                        let names: Vec<&str> = JOIN_TYPES.iter().map(|(name, _)| *name).collect();
                        JOIN_TYPES
                            .iter()
                            .find(|(name, _)| *name == how)
                            .map(|(_, join)| *join)
                            .ok_or_else(|| {
                                field_error(
                                    "join.how",
                                    format!(
                                        "unknown join type {how:?}{}; it is one of {}",
                                        did_you_mean(how, &names),
                                        quoted(&names)
                                    ),
                                )
                            })?
                    }
                };
                Step::Join {
                    with: source_name("join.with", with, sources)?,
                    left_on,
                    right_on,
                    how,
                }
            }
            "union" => Step::Union(
                names(op, value)?
                    .iter()
                    .map(|name| source_name(op, name, sources))
                    .collect::<Result<_, _>>()?,
            ),
            _ => {
                let spec = value.as_table().ok_or_else(|| {
                    field_error(op, "expected { udf = .., version = .., args = { .. } }")
                })?;
                if op == "map_batches" && spec.get("udf").is_none() {
                    // Neither `udf` nor `command`: one of them may be misspelled.
                    let either: Vec<&str> = UDF_CALL_KEYS
                        .iter()
                        .chain(&PROCESS_UDF_KEYS)
                        .copied()
                        .collect();
                    refuse_unknown_keys(spec, &either, op, "map_batches")?;
                }
                refuse_unknown_keys(spec, &UDF_CALL_KEYS, op, &format!("a {op} UDF call"))?;
                let name = spec
                    .get("udf")
                    .and_then(|v| v.as_str())
                    .ok_or_else(|| field_error(&format!("{op}.udf"), "missing"))?;
                let version = spec
                    .get("version")
                    .and_then(|v| v.as_integer())
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(|| {
                        field_error(&format!("{op}.version"), "missing or not a version number")
                    })?;
                let mut call = UdfCall::new(name, version);
                if let Some(args) = spec.get("args") {
                    let args = args
                        .as_table()
                        .ok_or_else(|| field_error(&format!("{op}.args"), "expected a table"))?;
                    for (arg, value) in args {
                        call = call.with(
                            arg.as_str(),
                            arg_value(value)
                                .map_err(|m| field_error(&format!("{op}.args.{arg}"), m))?,
                        );
                    }
                }
                let kind = if op == "map_batches" {
                    UdfKind::RowPreserving
                } else {
                    UdfKind::RowChanging
                };
                Step::Udf { call, kind }
            }
        })
    }

    /// The step's name, as the file spells it (errors building it name it).
    fn name(&self) -> &'static str {
        match self {
            Step::Filter(_) => "filter",
            Step::WithColumn { .. } => "with_column",
            Step::Select(_) => "select",
            Step::Drop(_) => "drop",
            Step::Unique(_) => "unique",
            Step::Rename(_) => "rename",
            Step::Limit(_) => "limit",
            Step::GroupBy { .. } => "groupby",
            Step::Sort(_) => "sort",
            Step::Repartition { .. } => "repartition",
            Step::RandomShuffle(_) => "random_shuffle",
            Step::Cache(_) => "cache",
            Step::Process(_)
            | Step::Udf {
                kind: UdfKind::RowPreserving,
                ..
            } => "map_batches",
            Step::Udf { .. } => "flat_map",
            Step::Join { .. } => "join",
            Step::Union(_) => "union",
        }
    }

    /// `dataset` with this step added; `named` holds the `[sources.NAME]` datasets.
    fn apply(
        &self,
        dataset: Dataset,
        named: &BTreeMap<String, Dataset>,
    ) -> Result<Dataset, FieldError> {
        let built = match self {
            Step::Filter(predicate) => dataset.filter(predicate.clone()),
            Step::WithColumn { name, expr } => dataset.with_column(name, expr.clone()),
            Step::Select(columns) => dataset.select(&as_strs(columns)),
            Step::Drop(columns) => dataset.drop(&as_strs(columns)),
            Step::Unique(columns) => dataset.unique(&as_strs(columns)),
            Step::Rename(pairs) => {
                let pairs: Vec<(&str, &str)> = pairs
                    .iter()
                    .map(|(from, to)| (from.as_str(), to.as_str()))
                    .collect();
                dataset.rename(&pairs)
            }
            Step::Limit(n) => dataset.limit(*n),
            Step::GroupBy { keys, aggregations } => {
                dataset.groupby(&as_strs(keys)).agg(aggregations.clone())
            }
            Step::Sort(keys) => dataset.sort(keys.clone()),
            Step::Repartition { partitions, keys } => match keys {
                Some(keys) => dataset.repartition_by(*partitions, &as_strs(keys)),
                None => dataset.repartition(*partitions),
            },
            Step::RandomShuffle(seed) => dataset.random_shuffle(Some(*seed)),
            Step::Cache(true) => dataset.cache(),
            Step::Cache(false) => Ok(dataset),
            Step::Process(udf) => dataset.map_batches_process(udf.clone()),
            Step::Udf {
                call,
                kind: UdfKind::RowPreserving,
            } => dataset.map_batches(call.clone()),
            Step::Udf { call, .. } => dataset.flat_map(call.clone()),
            Step::Join {
                with,
                left_on,
                right_on,
                how,
            } => dataset.join_on(&named[with], &as_strs(left_on), &as_strs(right_on), *how),
            Step::Union(names) => names
                .iter()
                .try_fold(dataset, |dataset, name| dataset.union(&named[name])),
        };
        built.map_err(|error| field_error(self.name(), error))
    }
}

/// Borrowed names, as the dataset's methods take them.
fn as_strs(items: &[String]) -> Vec<&str> {
    items.iter().map(String::as_str).collect()
}

/// A `map_batches = { command = .., .. }` step: a process UDF.
fn process_udf(spec: &toml::Table, policy: &PathPolicy) -> Result<ProcessUdf, FieldError> {
    let field = |name: &str| format!("map_batches.{name}");
    refuse_unknown_keys(spec, &PROCESS_UDF_KEYS, "map_batches", "a process UDF")?;
    let command = spec
        .get("command")
        .and_then(|v| v.as_str())
        .ok_or_else(|| field_error(&field("command"), "expected a string"))?;
    let args = match spec.get("args") {
        Some(args) => strings(&field("args"), args)?,
        None => Vec::new(),
    };
    // Without `files`, every argument that names a file is one, and is passed as the absolute
    // path that was hashed: the node then runs exactly the file the fingerprint pinned, and
    // editing it invalidates the cache without the user listing it twice.
    let listed = match spec.get("files") {
        Some(files) => Some(strings(&field("files"), files)?),
        None => None,
    };
    // Each file is checked and hashed once; an argument naming one is passed as the path
    // its digest resolved.
    let pin = |name: &str, path: &str| {
        check_path(&field(name), path, policy)?;
        FileDigest::of(std::path::Path::new(path)).map_err(|error| field_error(&field(name), error))
    };
    let mut digests = Vec::new();
    let mut resolved_args = Vec::with_capacity(args.len());
    for file in listed.iter().flatten() {
        digests.push(pin("files", file)?);
    }
    for arg in &args {
        let path = std::path::Path::new(arg);
        if listed.is_none() && path.is_file() {
            let digest = pin("args", arg)?;
            resolved_args.push(digest.path.to_string_lossy().into_owned());
            digests.push(digest);
            continue;
        }
        // An argument naming a listed file is passed as the path pinned, so the node can tell
        // the script it runs is one the plan pins.
        let listed_as = std::fs::canonicalize(path)
            .ok()
            .and_then(|resolved| digests.iter().find(|digest| digest.path == resolved));
        match listed_as {
            Some(digest) => resolved_args.push(digest.path.to_string_lossy().into_owned()),
            None => resolved_args.push(arg.clone()),
        }
    }
    let arg_refs: Vec<&str> = resolved_args.iter().map(String::as_str).collect();
    let mut udf = digests
        .into_iter()
        .fold(ProcessUdf::new(command, &arg_refs), ProcessUdf::pinned);
    if let Some(output) = spec.get("output") {
        let fields = strings(&field("output"), output)?
            .iter()
            .map(|column| {
                let (name, type_name) = column
                    .trim()
                    .rsplit_once(char::is_whitespace)
                    .ok_or_else(|| format!("{column:?}: expected \"name type\""))?;
                Ok(Field::new(name.trim(), data_type(type_name)?, true))
            })
            .collect::<Result<Vec<_>, String>>()
            .map_err(|message| field_error(&field("output"), message))?;
        udf = udf.output_schema(Schema::new(fields));
    }
    if let Some(concurrency) = spec.get("concurrency") {
        let bounds = concurrency
            .as_array()
            .filter(|items| items.len() == 2)
            .and_then(|items| {
                let bound = |v: &toml::Value| v.as_integer().and_then(|n| u32::try_from(n).ok());
                Some(Concurrency::new(bound(&items[0])?, bound(&items[1])?))
            })
            .ok_or_else(|| field_error(&field("concurrency"), "expected [min, max]"))?;
        udf = udf.concurrency(bounds);
    }
    if let Some(memory) = spec.get("memory") {
        let bytes = match memory {
            toml::Value::String(text) => text
                .parse::<ByteSize>()
                .map(|size| size.bytes())
                .map_err(|error| field_error(&field("memory"), error))?,
            other => integer(&field("memory"), other)?,
        };
        udf = udf.memory(bytes);
    }
    if let Some(timeout) = spec.get("timeout_s") {
        let seconds = integer(&field("timeout_s"), timeout)?;
        udf = udf.timeout_ms(seconds.saturating_mul(1000));
    }
    if let Some(batch_size) = spec.get("batch_size") {
        udf = udf.batch_size(integer(&field("batch_size"), batch_size)?);
    }
    if let Some(env) = spec.get("env") {
        let env = env
            .as_table()
            .ok_or_else(|| field_error(&field("env"), "expected a table of strings"))?;
        for (key, value) in env {
            let value = value
                .as_str()
                .ok_or_else(|| field_error(&field(&format!("env.{key}")), "expected a string"))?;
            udf = udf.env(key.as_str(), value);
        }
    }
    Ok(udf)
}

const PROCESS_UDF_KEYS: [&str; 9] = [
    "command",
    "args",
    "files",
    "output",
    "concurrency",
    "memory",
    "timeout_s",
    "batch_size",
    "env",
];

fn arg_value(value: &toml::Value) -> Result<ArgValue, String> {
    Ok(match value {
        toml::Value::String(s) => s.as_str().into(),
        toml::Value::Integer(n) => (*n).into(),
        toml::Value::Float(x) => (*x).into(),
        toml::Value::Boolean(b) => (*b).into(),
        toml::Value::Array(items) => items
            .iter()
            .map(arg_value)
            .collect::<Result<Vec<_>, _>>()?
            .into(),
        toml::Value::Table(table) => table
            .iter()
            .map(|(k, v)| Ok((k.clone(), arg_value(v)?)))
            .collect::<Result<BTreeMap<_, _>, String>>()?
            .into(),
        toml::Value::Datetime(_) => return Err("dates are not UDF arguments".to_owned()),
    })
}

/// The kinds of sink; each also takes [`SINK_KEYS`].
const SINKS: [Kind; 3] = [
    Kind {
        name: "write_parquet",
        with: &SINK_KEYS,
    },
    Kind {
        name: "write_csv",
        with: &SINK_KEYS,
    },
    Kind {
        name: "write_json",
        with: &SINK_KEYS,
    },
];

/// The keys a sink takes beside its kind.
const SINK_KEYS: [&str; 4] = ["mode", "compression", "target_file_size", "partition_by"];

/// A sink as the file spells it.
struct Sink {
    format: FileFormat,
    directory: String,
    options: WriteOptions,
}

impl Sink {
    fn parse(table: &toml::Table, policy: &PathPolicy) -> Result<Self, FieldError> {
        let (kind, value) = kind_of(table, &SINKS, "sink")?;
        let directory = value
            .as_str()
            .ok_or_else(|| field_error(kind, "expected a directory"))?;
        check_path(kind, directory, policy)?;
        let mut options = WriteOptions::default();
        if let Some(mode) = table.get("mode") {
            let text = mode.as_str().unwrap_or_default();
            let names: Vec<&str> = WriteMode::ALL.iter().map(|mode| mode.name()).collect();
            options.mode = WriteMode::ALL
                .into_iter()
                .find(|mode| mode.name() == text)
                .ok_or_else(|| {
                    field_error(
                        "mode",
                        format!(
                            "unknown write mode {mode}{}; it is one of {}",
                            did_you_mean(text, &names),
                            quoted(&names)
                        ),
                    )
                })?;
        }
        if let Some(compression) = table.get("compression") {
            let text = compression.as_str().unwrap_or_default();
            let names: Vec<&str> = Compression::ALL.iter().map(|c| c.name()).collect();
            options.compression = Some(
                Compression::ALL
                    .into_iter()
                    .find(|codec| codec.name() == text)
                    .ok_or_else(|| {
                        field_error(
                            "compression",
                            format!(
                                "unknown compression {compression}{}; it is one of {}",
                                did_you_mean(text, &names),
                                quoted(&names)
                            ),
                        )
                    })?,
            );
        }
        if let Some(size) = table.get("target_file_size") {
            options.target_file_size = match size {
                toml::Value::String(text) => text
                    .parse::<ByteSize>()
                    .map(|size| size.bytes())
                    .map_err(|error| field_error("target_file_size", error))?,
                other => integer("target_file_size", other)?,
            };
        }
        if let Some(columns) = table.get("partition_by") {
            options.partition_by = strings("partition_by", columns)?;
        }
        let format = match kind {
            "write_parquet" => FileFormat::Parquet,
            "write_csv" => FileFormat::Csv(CsvOptions::default()),
            _ => FileFormat::Json,
        };
        Ok(Sink {
            format,
            directory: directory.to_owned(),
            options,
        })
    }

    /// `dataset` written out; a relative directory is resolved against the working directory.
    fn apply(&self, dataset: Dataset) -> Result<Dataset, FieldError> {
        dataset
            .write(self.format.clone(), &self.directory, self.options.clone())
            .map_err(|error| field_error(sink_kind(&self.format), error))
    }
}

fn sink_kind(format: &FileFormat) -> &'static str {
    match format {
        FileFormat::Parquet => "write_parquet",
        FileFormat::Csv(_) => "write_csv",
        FileFormat::Json => "write_json",
        // Sinks of these formats are refused when the plan is built.
        FileFormat::Text => "write_text",
        FileFormat::Binary => "write_binary_files",
    }
}

/// The keys of `[options]`.
const OPTION_KEYS: [&str; 2] = ["cache", "retries"];

fn job_options(table: &toml::Table) -> Result<JobOptions, FieldError> {
    refuse_unknown_keys(table, &OPTION_KEYS, "", "[options]")?;
    let mut options = JobOptions::default();
    if let Some(value) = table.get("cache") {
        options.cache = match value.as_str() {
            Some("reuse") => CacheMode::Reuse,
            Some("recompute") => CacheMode::Recompute,
            Some("none") => CacheMode::NoCache,
            _ => {
                return Err(field_error(
                    "cache",
                    "expected \"reuse\", \"recompute\" or \"none\"",
                ));
            }
        }
    }
    if let Some(value) = table.get("retries") {
        options.max_task_retries = u32::try_from(integer("retries", value)?)
            .map_err(|_| field_error("retries", "too many retries"))?;
    }
    Ok(options)
}

/// `"column"` or `"column desc"` / `"column asc"`, optionally `nulls first|last`.
fn parse_sort_key(text: &str) -> Result<SortKey, String> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let (column, rest) = words.split_first().ok_or("an empty sort key")?;
    let mut key = SortKey::asc(*column);
    let mut rest = rest.iter();
    while let Some(word) = rest.next() {
        match (*word, rest.clone().next()) {
            ("asc", _) => key = SortKey::asc(*column),
            ("desc", _) => key = SortKey::desc(*column),
            ("nulls", Some(&"first")) => {
                key = key.nulls_first(true);
                rest.next();
            }
            ("nulls", Some(&"last")) => {
                key = key.nulls_first(false);
                rest.next();
            }
            _ => {
                return Err(format!(
                    "cannot read sort key {text:?}: expected `column [asc|desc] [nulls first|last]`"
                ));
            }
        }
    }
    Ok(key)
}

/// `"function(column) [as alias]"`, or `"count(*) [as alias]"`.
fn parse_aggregation(text: &str) -> Result<Aggregation, String> {
    let bad =
        || format!("cannot read aggregation {text:?}: expected `function(column) [as alias]`");
    let (call, alias) = match text.split_once(" as ") {
        Some((call, alias)) => (call.trim(), Some(alias.trim())),
        None => (text.trim(), None),
    };
    let (function, rest) = call.split_once('(').ok_or_else(bad)?;
    let column = rest.strip_suffix(')').ok_or_else(bad)?.trim();
    let function = match function.trim() {
        "count" => AggFunction::Count,
        "sum" => AggFunction::Sum,
        "mean" | "avg" => AggFunction::Mean,
        "min" => AggFunction::Min,
        "max" => AggFunction::Max,
        "std" => AggFunction::Std,
        "count_distinct" => AggFunction::CountDistinct,
        other => return Err(format!("unknown aggregate function {other:?}")),
    };
    let aggregation = match (function, column) {
        (AggFunction::Count, "*") => Aggregation::count_rows(alias.unwrap_or("count")),
        (_, "*") | (_, "") => return Err(bad()),
        (function, column) => Aggregation::of(function, column),
    };
    Ok(match alias {
        Some(alias) => aggregation.alias(alias),
        None => aggregation,
    })
}

/// An expression that cannot be read: where (1-based, in characters) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("column {column}: {message}")]
pub struct ExprError {
    pub column: usize,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    Str(String),
    Int(i64),
    Float(f64),
    Symbol(&'static str),
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Token::Ident(word) => write!(f, "`{word}`"),
            Token::Str(text) => write!(f, "'{text}'"),
            Token::Int(n) => write!(f, "{n}"),
            Token::Float(x) => write!(f, "{x}"),
            Token::Symbol(symbol) => write!(f, "`{symbol}`"),
        }
    }
}

/// The tokens of `text`, each with the column it starts at.
fn tokenize(text: &str) -> Result<Vec<(Token, usize)>, ExprError> {
    let error = |at: usize, message: String| ExprError {
        column: at + 1,
        message,
    };
    const SYMBOLS: [&str; 15] = [
        "==", "!=", "<=", ">=", "<", ">", "+", "-", "*", "/", "%", "(", ")", ",", "=",
    ];
    let mut tokens = Vec::new();
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let column = i + 1;
        if c.is_whitespace() {
            i += 1;
            continue;
        } else if c == '\'' || c == '"' {
            let end = chars[i + 1..]
                .iter()
                .position(|d| *d == c)
                .ok_or_else(|| error(i, "an unterminated string".to_owned()))?;
            tokens.push((
                Token::Str(chars[i + 1..i + 1 + end].iter().collect()),
                column,
            ));
            i += end + 2;
        } else if c.is_ascii_digit() {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_digit() || chars[i] == '.' || chars[i] == '_')
            {
                i += 1;
            }
            let number: String = chars[start..i].iter().filter(|d| **d != '_').collect();
            let bad = |_| error(start, format!("bad number {number}"));
            let token = if number.contains('.') {
                Token::Float(number.parse().map_err(bad)?)
            } else {
                Token::Int(
                    number
                        .parse()
                        .map_err(|_| error(start, format!("bad number {number}")))?,
                )
            };
            tokens.push((token, column));
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            tokens.push((Token::Ident(chars[start..i].iter().collect()), column));
        } else {
            let rest: String = chars[i..chars.len().min(i + 2)].iter().collect();
            let symbol = SYMBOLS
                .iter()
                .find(|symbol| rest.starts_with(**symbol))
                .ok_or_else(|| error(i, format!("unexpected character {c:?}")))?;
            tokens.push((Token::Symbol(symbol), column));
            i += symbol.len();
        }
    }
    Ok(tokens)
}

/// The most tokens one expression may have. Long chains (`a + b + …`) build deep trees, so
/// the length is bounded as well as the nesting, before any tree is built; the plan then
/// refuses an expression deeper than `floe_core::plan::MAX_EXPR_DEPTH`.
const MAX_EXPR_TOKENS: usize = 200;
/// The deepest nesting of parentheses, calls, `not` and unary minus.
const MAX_EXPR_NESTING: usize = 64;

/// Parses one expression (see the module docs for the language); an error names the column
/// where reading stopped.
pub fn parse_expr(text: &str) -> Result<Expr, ExprError> {
    let (tokens, columns): (Vec<Token>, Vec<usize>) = tokenize(text)?.into_iter().unzip();
    if tokens.len() > MAX_EXPR_TOKENS {
        return Err(ExprError {
            column: 1,
            message: format!(
                "the expression has {} tokens; at most {MAX_EXPR_TOKENS} are allowed",
                tokens.len()
            ),
        });
    }
    let mut parser = Parser {
        tokens,
        columns,
        end: text.chars().count() + 1,
        at: 0,
        depth: 0,
    };
    let expr = parser.or()?;
    match parser.tokens.get(parser.at) {
        None => Ok(expr),
        Some(token) => Err(parser.error(
            parser.at,
            format!("unexpected {token} after a complete expression"),
        )),
    }
}

/// A function of an expression and a string literal (`cast`, `contains`, `starts_with`).
type StringFunction = fn(Expr, String) -> Result<Expr, String>;

struct Parser {
    tokens: Vec<Token>,
    /// The column each token starts at.
    columns: Vec<usize>,
    /// The column just past the text.
    end: usize,
    at: usize,
    /// How deeply the parser has recursed, bounded so no input can exhaust the stack.
    depth: usize,
}

impl Parser {
    /// An error at token `index` (the end of the text past the last token).
    fn error(&self, index: usize, message: String) -> ExprError {
        ExprError {
            column: self.columns.get(index).copied().unwrap_or(self.end),
            message,
        }
    }

    /// Runs `parse` one level deeper, refusing input nested past [`MAX_EXPR_NESTING`].
    fn nested(
        &mut self,
        parse: impl FnOnce(&mut Self) -> Result<Expr, ExprError>,
    ) -> Result<Expr, ExprError> {
        if self.depth >= MAX_EXPR_NESTING {
            return Err(self.error(
                self.at,
                format!("the expression is nested more than {MAX_EXPR_NESTING} levels deep"),
            ));
        }
        self.depth += 1;
        let parsed = parse(self);
        self.depth -= 1;
        parsed
    }

    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    fn eat_symbol(&mut self, symbol: &'static str) -> bool {
        if self.peek() == Some(&Token::Symbol(symbol)) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn eat_word(&mut self, word: &str) -> bool {
        if matches!(self.peek(), Some(Token::Ident(ident)) if ident.eq_ignore_ascii_case(word)) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, symbol: &'static str) -> Result<(), ExprError> {
        if self.eat_symbol(symbol) {
            return Ok(());
        }
        let got = self
            .peek()
            .map_or_else(|| "the end".to_owned(), Token::to_string);
        Err(self.error(self.at, format!("expected `{symbol}`, got {got}")))
    }

    fn or(&mut self) -> Result<Expr, ExprError> {
        let mut left = self.and()?;
        while self.eat_word("or") {
            left = left.or(self.and()?);
        }
        Ok(left)
    }

    fn and(&mut self) -> Result<Expr, ExprError> {
        let mut left = self.not()?;
        while self.eat_word("and") {
            left = left.and(self.not()?);
        }
        Ok(left)
    }

    fn not(&mut self) -> Result<Expr, ExprError> {
        if self.eat_word("not") {
            return Ok(!self.nested(Self::not)?);
        }
        self.comparison()
    }

    fn comparison(&mut self) -> Result<Expr, ExprError> {
        let left = self.additive()?;
        for (symbol, build) in [
            ("==", Expr::eq as fn(Expr, Expr) -> Expr),
            ("!=", Expr::not_eq),
            ("<=", Expr::lt_eq),
            (">=", Expr::gt_eq),
            ("<", Expr::lt),
            (">", Expr::gt),
        ] {
            if self.eat_symbol(symbol) {
                return Ok(build(left, self.additive()?));
            }
        }
        Ok(left)
    }

    fn additive(&mut self) -> Result<Expr, ExprError> {
        let mut left = self.multiplicative()?;
        loop {
            if self.eat_symbol("+") {
                left = left + self.multiplicative()?;
            } else if self.eat_symbol("-") {
                left = left - self.multiplicative()?;
            } else {
                return Ok(left);
            }
        }
    }

    fn multiplicative(&mut self) -> Result<Expr, ExprError> {
        let mut left = self.unary()?;
        loop {
            if self.eat_symbol("*") {
                left = left * self.unary()?;
            } else if self.eat_symbol("/") {
                left = left / self.unary()?;
            } else if self.eat_symbol("%") {
                left = left % self.unary()?;
            } else {
                return Ok(left);
            }
        }
    }

    fn unary(&mut self) -> Result<Expr, ExprError> {
        if self.eat_symbol("-") {
            return Ok(-self.nested(Self::unary)?);
        }
        self.primary()
    }

    fn primary(&mut self) -> Result<Expr, ExprError> {
        let token = self
            .peek()
            .cloned()
            .ok_or_else(|| self.error(self.at, "the expression ends too early".to_owned()))?;
        let here = self.at;
        self.at += 1;
        match token {
            Token::Int(n) => Ok(lit(n)),
            Token::Float(x) => Ok(lit(x)),
            Token::Str(s) => Ok(lit(s.as_str())),
            Token::Symbol("(") => {
                let inner = self.nested(Self::or)?;
                self.expect(")")?;
                Ok(inner)
            }
            Token::Symbol(symbol) => Err(self.error(here, format!("unexpected `{symbol}`"))),
            Token::Ident(word) => match word.to_ascii_lowercase().as_str() {
                "true" => Ok(lit(true)),
                "false" => Ok(lit(false)),
                "null" => Ok(null()),
                _ if self.eat_symbol("(") => self.nested(|parser| parser.call(&word, here)),
                _ => Ok(col(word)),
            },
        }
    }

    /// The call of `function`, whose name is token `at`; its own errors point at the name.
    fn call(&mut self, function: &str, at: usize) -> Result<Expr, ExprError> {
        let mut args = Vec::new();
        if !self.eat_symbol(")") {
            loop {
                args.push(self.or()?);
                if self.eat_symbol(")") {
                    break;
                }
                self.expect(",")?;
            }
        }
        build_call(function, args).map_err(|message| self.error(at, message))
    }
}

/// A function applied to its parsed arguments.
fn build_call(function: &str, args: Vec<Expr>) -> Result<Expr, String> {
    {
        let name = function.to_ascii_lowercase();
        let string_arg = |expr: Expr| match expr {
            Expr::Literal(floe_core::expr::Scalar::Utf8(s)) => Ok(s),
            other => Err(format!("{function} needs a string literal, got {other}")),
        };
        let unary: Option<fn(Expr) -> Expr> = match name.as_str() {
            "is_null" => Some(Expr::is_null),
            "is_not_null" => Some(Expr::is_not_null),
            "lower" => Some(Expr::lower),
            "upper" => Some(Expr::upper),
            "length" => Some(Expr::length),
            _ => None,
        };
        let with_string: Option<StringFunction> = match name.as_str() {
            "cast" => Some(|value, name| Ok(value.cast(data_type(&name)?))),
            "try_cast" => Some(|value, name| Ok(value.try_cast(data_type(&name)?))),
            "contains" => Some(|value, pattern| Ok(value.contains(pattern))),
            "starts_with" => Some(|value, prefix| Ok(value.starts_with(prefix))),
            "regex_match" => Some(|value, pattern| Ok(value.regex_match(pattern))),
            _ => None,
        };
        let arity = |n: usize| -> Result<std::vec::IntoIter<Expr>, String> {
            if args.len() == n {
                Ok(args.clone().into_iter())
            } else {
                Err(format!(
                    "{function} takes {n} arguments, got {}",
                    args.len()
                ))
            }
        };
        let missing = || format!("{function}: missing an argument");
        let try_arithmetic: Option<fn(Expr, Expr) -> Expr> = match name.as_str() {
            "try_add" => Some(|a, b| a + b),
            "try_subtract" => Some(|a, b| a - b),
            "try_multiply" => Some(|a, b| a * b),
            "try_divide" => Some(|a, b| a / b),
            "try_remainder" => Some(|a, b| a % b),
            _ => None,
        };
        if let Some(build) = try_arithmetic {
            let mut args = arity(2)?;
            let left = args.next().ok_or_else(missing)?;
            return Ok(null_on_error(build(left, args.next().ok_or_else(missing)?)));
        }
        if let Some(build) = unary {
            let mut args = arity(1)?;
            return Ok(build(args.next().ok_or_else(missing)?));
        }
        if let Some(build) = with_string {
            let mut args = arity(2)?;
            let value = args.next().ok_or_else(missing)?;
            return build(value, string_arg(args.next().ok_or_else(missing)?)?);
        }
        match name.as_str() {
            "col" => {
                let mut args = arity(1)?;
                Ok(col(string_arg(args.next().ok_or_else(missing)?)?))
            }
            "when" => {
                let mut args = arity(3)?;
                let mut next = || args.next().ok_or_else(missing);
                Ok(when(next()?, next()?, next()?))
            }
            "try" => {
                let mut args = arity(1)?;
                Ok(null_on_error(args.next().ok_or_else(missing)?))
            }
            "coalesce" => Ok(coalesce(args)),
            "hash" => Ok(hash(args)),
            "substring" => {
                let integer = |expr: Option<Expr>| match expr {
                    Some(Expr::Literal(floe_core::expr::Scalar::Int64(n))) => Ok(n),
                    Some(Expr::Negate(inner)) => match *inner {
                        Expr::Literal(floe_core::expr::Scalar::Int64(n)) => Ok(-n),
                        other => Err(format!("substring needs integer literals, got -{other}")),
                    },
                    Some(other) => Err(format!("substring needs integer literals, got {other}")),
                    None => Err(missing()),
                };
                if !(2..=3).contains(&args.len()) {
                    return Err(format!(
                        "substring takes 2 or 3 arguments (text, start[, length]), got {}",
                        args.len()
                    ));
                }
                let mut args = args.into_iter();
                let value = args.next().ok_or_else(missing)?;
                let start = integer(args.next())?;
                let length = match args.next() {
                    Some(length) => Some(
                        u64::try_from(integer(Some(length))?)
                            .map_err(|_| "substring: a negative length".to_owned())?,
                    ),
                    None => None,
                };
                Ok(value.substring(start, length))
            }
            other => Err(format!("unknown function {other:?}")),
        }
    }
}

fn data_type(name: &str) -> Result<DataType, String> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "bool" | "boolean" => DataType::Boolean,
        "int32" => DataType::Int32,
        "int64" | "int" => DataType::Int64,
        "float32" => DataType::Float32,
        "float64" | "float" | "double" => DataType::Float64,
        "string" | "utf8" => DataType::Utf8,
        "date32" | "date" => DataType::Date32,
        other => {
            return Err(format!(
                "unknown type {other:?} (bool, int32, int64, float32, float64, string, date32)"
            ));
        }
    })
}
