//! Read kernels: file discovery (with Hive `key=value` partition directories), schema
//! discovery, and Parquet/CSV/NDJSON/text/binary readers that apply a scan's projection,
//! predicate and limit and add each file's partition values as columns.
//!
//! Parquet reads skip whole row groups whose min/max statistics prove that a conjunct of the
//! predicate (`column op literal`, op one of `== < <= > >=`) is false for every row; the rows of
//! the remaining groups are then filtered exactly. [`ReadStats`] counts what was skipped.
//!
//! Every path may also be an object URL (`s3://bucket/key`, see [`crate::remote`]). A remote
//! Parquet file is read by ranges: its footer, then per row group kept only the column chunks
//! of the projected columns; a remote CSV or NDJSON file is fetched whole. CSV and NDJSON files
//! named `*.gz` or `*.zst` are decompressed as they are read.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::array::{Array, ArrayRef, BooleanArray};
use arrow::compute::kernels::cmp;
use arrow::compute::{and_kleene, filter_record_batch};
use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow::error::ArrowError;
use arrow::record_batch::RecordBatch;
use bytes::Bytes;
use floe_core::expr::{BinaryOp, Expr, common_type};
use floe_core::fingerprint::FileStamp;
use floe_core::plan::{FileFormat, FileScan, PartitionColumn, PartitionType};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::statistics::StatisticsConverter;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReader,
    ParquetRecordBatchReaderBuilder,
};
use parquet::file::metadata::RowGroupMetaData;

use crate::eval::{evaluate_predicate, literal_array, safe_cast};
use crate::ops::Limiter;
use crate::remote::{FetchedRanges, Object, Pending};
use crate::{Error, Result};

/// Rows per batch a reader emits before block sizing regroups them; performance only.
pub const DEFAULT_BATCH_ROWS: usize = 8192;

/// How many rows text-format schema inference looks at.
const INFER_ROWS: usize = 1000;

/// What a read did, for tests and the dashboard.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStats {
    pub files: usize,
    pub row_groups: usize,
    pub row_groups_pruned: usize,
    pub rows_read: u64,
    pub rows_out: u64,
    /// Bytes fetched from object storage (0 for local files).
    pub bytes_fetched: u64,
}

impl ReadStats {
    fn add(&mut self, other: ReadStats) {
        self.files += other.files;
        self.row_groups += other.row_groups;
        self.row_groups_pruned += other.row_groups_pruned;
        self.rows_read += other.rows_read;
        self.rows_out += other.rows_out;
        self.bytes_fetched += other.bytes_fetched;
    }
}

/// Expands paths, directories and globs into a sorted list of files.
///
/// A directory stands for every file below it, recursively; a `*` or `?` in the last path
/// component matches names in its directory. Names starting with `.` or `_` are skipped
/// (temporary and marker files, such as an unfinished write's). Each pattern's files are
/// listed once, but a file two patterns name is listed (and read) twice, as Ray and pyarrow do.
pub fn expand_paths<P: AsRef<Path>>(patterns: &[P]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for pattern in patterns {
        let pattern = pattern.as_ref();
        if let Some(url) = floe_core::location::remote_url(pattern) {
            files.extend(
                crate::remote::expand(url)?
                    .into_iter()
                    .map(|stamp| stamp.path),
            );
            continue;
        }
        let name = pattern
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut matched = Vec::new();
        if name.contains(['*', '?']) {
            let parent = pattern.parent().unwrap_or(Path::new("."));
            for entry in read_dir_sorted(parent)? {
                let entry_name = entry
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                if entry.is_file() && !hidden(&entry_name) && wildcard_match(&name, &entry_name) {
                    matched.push(entry);
                }
            }
        } else if pattern.is_dir() {
            collect_dir(pattern, &mut matched)?;
        } else if pattern.is_file() {
            matched.push(pattern.to_owned());
        }
        if matched.is_empty() {
            return Err(Error::NoFiles(pattern.display().to_string()));
        }
        matched.sort();
        matched.dedup();
        files.extend(matched);
    }
    files.sort();
    Ok(files)
}

fn hidden(name: &str) -> bool {
    name.starts_with('.') || name.starts_with('_')
}

fn read_dir_sorted(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut entries = std::fs::read_dir(dir)
        .map_err(Error::io(dir))?
        .map(|entry| entry.map(|e| e.path()).map_err(Error::io(dir)))
        .collect::<Result<Vec<_>>>()?;
    entries.sort();
    Ok(entries)
}

fn collect_dir(dir: &Path, files: &mut Vec<PathBuf>) -> Result<()> {
    for entry in read_dir_sorted(dir)? {
        let name = entry
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if hidden(&name) {
            continue;
        }
        if entry.is_dir() {
            collect_dir(&entry, files)?;
        } else if entry.is_file() {
            files.push(entry);
        }
    }
    Ok(())
}

/// `*` matches any run of characters, `?` exactly one.
pub(crate) fn wildcard_match(pattern: &str, name: &str) -> bool {
    let (pattern, name): (Vec<char>, Vec<char>) =
        (pattern.chars().collect(), name.chars().collect());
    // Classic two-pointer match with backtracking to the last `*`.
    let (mut p, mut n) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        if p < pattern.len() && (pattern[p] == '?' || pattern[p] == name[n]) {
            p += 1;
            n += 1;
        } else if p < pattern.len() && pattern[p] == '*' {
            star = Some((p, n));
            p += 1;
        } else if let Some((star_p, star_n)) = star {
            p = star_p + 1;
            n = star_n + 1;
            star = Some((star_p, star_n + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|c| *c == '*')
}

/// How a read finds Hive partition columns (`key=value` directories below a directory it
/// is given).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Partitioning {
    /// Discover them: a column is `int64` when every value parses as one, else `string`.
    #[default]
    Hive,
    /// These columns, with these types; the directories must name exactly them.
    Declared(Vec<PartitionColumn>),
    /// `key=value` directories are plain directories.
    Ignore,
}

/// How [`discover_with`] reads the paths it is given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiscoverOptions {
    pub partitioning: Partitioning,
}

/// [`discover_with`] with the default options (Hive partitions discovered).
pub fn discover<P: AsRef<Path>>(format: FileFormat, patterns: &[P]) -> Result<FileScan> {
    discover_with(format, patterns, &DiscoverOptions::default())
}

/// Finds the files, stamps them (their fingerprint), finds their Hive partition columns and
/// discovers their schema: every Parquet file's footer must agree; CSV column types are
/// inferred from the first file and every file's header must name the same columns; NDJSON
/// types are inferred from the first file and every other file's inferred types must agree
/// with them (a key missing or all null in a later file is fine: it reads as null). Text and
/// binary files have a fixed schema and are not opened.
pub fn discover_with<P: AsRef<Path>>(
    format: FileFormat,
    patterns: &[P],
    options: &DiscoverOptions,
) -> Result<FileScan> {
    let found = find_files(patterns)?;
    let partitioning = partition_columns(&found, &options.partitioning)?;
    let stamps: Vec<FileStamp> = found.into_iter().map(|found| found.stamp).collect();
    let paths: Vec<PathBuf> = stamps.iter().map(|stamp| stamp.path.clone()).collect();
    let schema = match &format {
        FileFormat::Text | FileFormat::Binary => format
            .fixed_schema()
            .ok_or_else(|| Error::NoFiles(format.name().to_owned()))?,
        FileFormat::Parquet => {
            let mut schema: Option<Schema> = None;
            for stamp in &stamps {
                let path = &stamp.path;
                let file_schema = parquet_schema(stamp)?;
                match &schema {
                    None => schema = Some(file_schema),
                    Some(first) if first.fields() != file_schema.fields() => {
                        return Err(Error::BadFile {
                            path: path.clone(),
                            message: format!(
                                "schema ({}) differs from the first file's ({})",
                                floe_core::plan::describe_schema(&file_schema),
                                floe_core::plan::describe_schema(first)
                            ),
                        });
                    }
                    Some(_) => {}
                }
            }
            schema.ok_or_else(|| Error::NoFiles("parquet".to_owned()))?
        }
        FileFormat::Csv(options) => {
            let format = arrow::csv::reader::Format::default()
                .with_header(options.has_header)
                .with_delimiter(options.delimiter);
            let path = first(&paths)?;
            let mut file = open_text(path)?;
            let (schema, _) = format
                .infer_schema(&mut file, Some(INFER_ROWS))
                .map_err(unreadable_csv(path))?;
            // Types come from the first file, but every header must name the same columns,
            // so a mismatched file fails now rather than halfway through the job.
            for other in &paths[1..] {
                let mut file = open_text(other)?;
                let (header, _) = format
                    .infer_schema(&mut file, Some(1))
                    .map_err(unreadable_csv(other))?;
                let names = |s: &Schema| -> Vec<String> {
                    s.fields().iter().map(|f| f.name().clone()).collect()
                };
                if names(&header) != names(&schema) {
                    return Err(Error::BadFile {
                        path: other.clone(),
                        message: format!(
                            "columns [{}] differ from the first file's [{}]",
                            names(&header).join(", "),
                            names(&schema).join(", ")
                        ),
                    });
                }
            }
            schema
        }
        FileFormat::Json => {
            let path = first(&paths)?;
            let schema = json_schema(path)?;
            // Types come from the first file; every other file's inferred types must agree,
            // so a mismatched file fails now rather than halfway through the job.
            for other in &paths[1..] {
                check_json_schema(path, &schema, other, &json_schema(other)?)?;
            }
            schema
        }
    };
    // Metadata is dropped: plans compare and hash schemas by their fields.
    let mut stamps = stamps;
    stamps.sort();
    Ok(FileScan {
        partitioning,
        ..FileScan::new(format, stamps, Schema::new(schema.fields().clone()))
    })
}

/// One file a read was given, and the `key=value` directories between the directory (or
/// prefix) named and the file.
struct Found {
    stamp: FileStamp,
    partitions: Vec<(String, Option<String>)>,
}

/// Every file the patterns name, stamped (their fingerprint): local files are stat'ed, objects
/// stamped from their listing.
fn find_files<P: AsRef<Path>>(patterns: &[P]) -> Result<Vec<Found>> {
    let mut found = Vec::new();
    for pattern in patterns {
        let pattern = pattern.as_ref();
        // Partition directories are those below a directory or prefix the read names.
        let (stamps, root) = match floe_core::location::remote_url(pattern) {
            Some(url) => (
                crate::remote::expand(url)?,
                // A glob or an object is no prefix of what it expands to.
                Some(format!("{}/", url.trim_end_matches('/'))),
            ),
            None => {
                let stamps = expand_paths(&[pattern])?
                    .iter()
                    .map(|path| {
                        FileStamp::of(path).map_err(|e| Error::BadFile {
                            path: path.clone(),
                            message: e.to_string(),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                // Stamps hold canonical paths, so the directory is made canonical too.
                let root = match pattern.is_dir() {
                    true => Some(format!(
                        "{}/",
                        std::fs::canonicalize(pattern)
                            .map_err(Error::io(pattern))?
                            .to_string_lossy()
                            .trim_end_matches('/')
                    )),
                    false => None,
                };
                (stamps, root)
            }
        };
        for stamp in stamps {
            let path = stamp.path.to_string_lossy().into_owned();
            let relative = root.as_deref().and_then(|root| path.strip_prefix(root));
            let partitions = match relative {
                Some(relative) => floe_core::plan::partition::segments_of(Path::new(relative))
                    .map_err(|message| Error::BadFile {
                        path: stamp.path.clone(),
                        message,
                    })?,
                None => Vec::new(),
            };
            found.push(Found { stamp, partitions });
        }
    }
    Ok(found)
}

/// The partition columns of `found` as `partitioning` says: every file must sit in
/// directories naming the same keys in the same order.
fn partition_columns(found: &[Found], partitioning: &Partitioning) -> Result<Vec<PartitionColumn>> {
    if *partitioning == Partitioning::Ignore {
        return Ok(Vec::new());
    }
    let keys = |file: &Found| -> Vec<String> {
        file.partitions.iter().map(|(key, _)| key.clone()).collect()
    };
    let Some(first) = found.first() else {
        return Ok(Vec::new());
    };
    let names = keys(first);
    for file in found {
        if keys(file) != names {
            return Err(Error::BadFile {
                path: file.stamp.path.clone(),
                message: format!(
                    "its partition directories name [{}], but {}'s name [{}]",
                    keys(file).join(", "),
                    first.stamp.path.display(),
                    names.join(", ")
                ),
            });
        }
    }
    let columns = match partitioning {
        Partitioning::Declared(columns) => {
            let mut declared: Vec<&str> = columns.iter().map(|c| c.name.as_str()).collect();
            let mut named: Vec<&str> = names.iter().map(String::as_str).collect();
            declared.sort_unstable();
            named.sort_unstable();
            if declared != named {
                return Err(Error::BadFile {
                    path: first.stamp.path.clone(),
                    message: format!(
                        "its partition directories name [{}], not the declared [{}]",
                        names.join(", "),
                        columns
                            .iter()
                            .map(|c| c.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
            columns.clone()
        }
        _ => names
            .iter()
            .enumerate()
            .map(|(index, name)| {
                let integers = found.iter().all(|file| {
                    file.partitions[index]
                        .1
                        .as_deref()
                        .is_none_or(|value| value.parse::<i64>().is_ok())
                });
                let any_value = found.iter().any(|file| file.partitions[index].1.is_some());
                let data_type = match integers && any_value {
                    true => PartitionType::Int64,
                    false => PartitionType::Utf8,
                };
                PartitionColumn::new(name.clone(), data_type)
            })
            .collect(),
    };
    // Every value must read as its column's type, so a bad one fails now, not mid-job.
    for file in found {
        for column in &columns {
            let value = file
                .partitions
                .iter()
                .rev()
                .find(|(key, _)| *key == column.name)
                .and_then(|(_, value)| value.as_deref());
            floe_core::plan::partition::typed_value(&column.name, value, column.data_type)
                .map_err(|message| Error::BadFile {
                    path: file.stamp.path.clone(),
                    message,
                })?;
        }
    }
    Ok(columns)
}

/// A text file's bytes, local or remote (fetched whole).
fn open_text(path: &Path) -> Result<Box<dyn BufRead + Send>> {
    counted_text(path, &AtomicU64::new(0))
}

fn json_schema(path: &Path) -> Result<Schema> {
    let (schema, _) = arrow::json::reader::infer_json_schema(open_text(path)?, Some(INFER_ROWS))
        .map_err(|e| Error::BadFile {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
    Ok(schema)
}

/// Checks the schema inferred from NDJSON file `other` against the one inferred from the
/// `first` file, which the plan uses for every file. A key the first file lacks is refused
/// (the reader would drop it silently), and so is a key whose values have another type.
/// A key `other` lacks, or whose sampled values are all null (type `Null`), is accepted: the
/// reader yields nulls for it. Only the first rows are sampled, so a value of another type
/// further into a file still fails when that file is read.
fn check_json_schema(first: &Path, schema: &Schema, other: &Path, found: &Schema) -> Result<()> {
    for field in found.fields() {
        let message = match schema.field_with_name(field.name()) {
            Err(_) => format!(
                "column `{}` ({}) is not in the first file {}, whose columns are [{}]",
                field.name(),
                field.data_type(),
                first.display(),
                floe_core::plan::describe_schema(schema)
            ),
            Ok(expected)
                if field.data_type() != expected.data_type()
                    && *field.data_type() != DataType::Null =>
            {
                format!(
                    "column `{}` is {} here but {} in the first file {}",
                    field.name(),
                    field.data_type(),
                    expected.data_type(),
                    first.display()
                )
            }
            Ok(_) => continue,
        };
        return Err(Error::BadFile {
            path: other.to_owned(),
            message,
        });
    }
    Ok(())
}

fn first(paths: &[PathBuf]) -> Result<&PathBuf> {
    paths
        .first()
        .ok_or_else(|| Error::NoFiles("(no paths)".to_owned()))
}

fn parquet_schema(stamp: &FileStamp) -> Result<Schema> {
    let (metadata, _) = parquet_metadata(stamp)?;
    Ok(Schema::new(metadata.schema().fields().clone()))
}

/// A Parquet file's footer, and what reading it fetched from object storage.
fn parquet_metadata(stamp: &FileStamp) -> Result<(ArrowReaderMetadata, u64)> {
    let path = &stamp.path;
    let bad_file = |e: parquet::errors::ParquetError| Error::BadFile {
        path: path.clone(),
        message: e.to_string(),
    };
    match Object::of(path)? {
        Some(object) => {
            let (tail, fetched) = crate::remote::parquet_footer(&object, stamp.size)?;
            let metadata =
                ArrowReaderMetadata::load(&tail, ArrowReaderOptions::new()).map_err(bad_file)?;
            Ok((metadata, fetched))
        }
        None => {
            let file = File::open(path).map_err(Error::io(path))?;
            let metadata =
                ArrowReaderMetadata::load(&file, ArrowReaderOptions::new()).map_err(bad_file)?;
            Ok((metadata, 0))
        }
    }
}

/// Row groups of a remote Parquet object whose column chunks are fetched ahead of the one
/// being decoded, so the network and the decoding overlap: a ranged GET costs a round trip
/// and more, where decoding a row group from memory takes about as long. Bounds the memory
/// held to this many row groups' projected chunks beyond the current one.
const ROW_GROUPS_AHEAD: usize = 2;

/// Reads row groups `keep` of remote Parquet object `object`: per row group, one concurrent
/// fetch of the column chunks `mask` selects, started [`ROW_GROUPS_AHEAD`] row groups before
/// it is decoded from memory. `fetched` counts the bytes.
struct RemoteRowGroups {
    object: Object,
    size: u64,
    metadata: ArrowReaderMetadata,
    mask: ProjectionMask,
    batch_rows: usize,
    fetched: Arc<AtomicU64>,
    /// Row groups whose fetch has not started, in order.
    waiting: std::vec::IntoIter<usize>,
    /// Row groups whose fetch has started, in order.
    started: VecDeque<RowGroupFetch>,
    current: Option<ParquetRecordBatchReader>,
}

/// A row group's column chunks on their way.
struct RowGroupFetch {
    row_group: usize,
    /// The byte ranges asked for, in the order `pending` gives them.
    ranges: Vec<Range<u64>>,
    pending: Pending<Vec<Bytes>>,
}

impl RemoteRowGroups {
    fn new(
        object: Object,
        size: u64,
        metadata: ArrowReaderMetadata,
        keep: Vec<usize>,
        mask: ProjectionMask,
        batch_rows: usize,
        fetched: Arc<AtomicU64>,
    ) -> Self {
        Self {
            object,
            size,
            metadata,
            mask,
            batch_rows,
            fetched,
            waiting: keep.into_iter(),
            started: VecDeque::new(),
            current: None,
        }
    }

    /// Starts fetches until [`ROW_GROUPS_AHEAD`] + 1 are under way (or none are left).
    fn start_fetches(&mut self) -> Result<()> {
        while self.started.len() <= ROW_GROUPS_AHEAD {
            let Some(row_group) = self.waiting.next() else {
                break;
            };
            let ranges: Vec<_> = self
                .metadata
                .metadata()
                .row_group(row_group)
                .columns()
                .iter()
                .enumerate()
                .filter(|(leaf, _)| self.mask.leaf_included(*leaf))
                .map(|(_, chunk)| {
                    let (start, length) = chunk.byte_range();
                    start..start + length
                })
                .collect();
            let pending = self
                .object
                .start_get_ranges(ranges.clone(), self.fetched.clone())?;
            self.started.push_back(RowGroupFetch {
                row_group,
                ranges,
                pending,
            });
        }
        Ok(())
    }

    /// The decoder of the next row group, once its chunks have arrived; `None` after the last.
    fn open_next(&mut self) -> Result<Option<ParquetRecordBatchReader>> {
        self.start_fetches()?;
        let Some(RowGroupFetch {
            row_group,
            ranges,
            pending,
        }) = self.started.pop_front()
        else {
            return Ok(None);
        };
        self.start_fetches()?;
        let bytes = pending.wait()?;
        let held = FetchedRanges::new(
            self.size,
            ranges.iter().map(|r| r.start).zip(bytes).collect(),
        );
        Ok(Some(
            ParquetRecordBatchReaderBuilder::new_with_metadata(held, self.metadata.clone())
                .with_row_groups(vec![row_group])
                .with_projection(self.mask.clone())
                .with_batch_size(self.batch_rows)
                .build()?,
        ))
    }
}

impl Iterator for RemoteRowGroups {
    type Item = Result<RecordBatch, ArrowError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(batch) = self.current.as_mut().and_then(Iterator::next) {
                return Some(batch);
            }
            match self.open_next() {
                Ok(Some(reader)) => self.current = Some(reader),
                Ok(None) => return None,
                Err(error) => {
                    // The caller stops at the first error; nothing more is fetched.
                    self.waiting = Vec::new().into_iter();
                    self.started.clear();
                    self.current = None;
                    return Some(Err(ArrowError::ExternalError(Box::new(error))));
                }
            }
        }
    }
}

/// The columns a scan outputs (its projection, or all), in schema order: the files'
/// columns, then the partition columns.
fn output_schema(scan: &FileScan) -> Schema {
    let full = scan.full_schema();
    match &scan.projection {
        None => full,
        Some(columns) => Schema::new(
            full.fields()
                .iter()
                .filter(|f| columns.contains(f.name()))
                .cloned()
                .collect::<Vec<_>>(),
        ),
    }
}

/// The output columns the files hold (the others are partition columns).
fn file_output_schema(scan: &FileScan) -> Schema {
    Schema::new(
        output_schema(scan)
            .fields()
            .iter()
            .filter(|f| scan.file_schema.field_with_name(f.name()).is_ok())
            .cloned()
            .collect::<Vec<_>>(),
    )
}

fn projection_indices(scan: &FileScan, file_schema: &Schema) -> Result<Vec<usize>> {
    file_output_schema(scan)
        .fields()
        .iter()
        .map(|f| Ok(file_schema.index_of(f.name())?))
        .collect()
}

/// Reads every file of `scan` in order, applying the projection, predicate and limit.
pub fn read_scan(scan: &FileScan, batch_rows: usize) -> Result<(Vec<RecordBatch>, ReadStats)> {
    let mut batches = Vec::new();
    let mut stats = ReadStats::default();
    let mut limiter = scan.limit.map(Limiter::new);
    for index in 0..scan.files.len() {
        if limiter.as_ref().is_some_and(Limiter::is_done) {
            break;
        }
        let (file_batches, file_stats) = read_file(scan, index, batch_rows)?;
        stats.add(file_stats);
        for batch in file_batches {
            match &mut limiter {
                Some(limiter) => batches.extend(limiter.admit(batch)),
                None => batches.push(batch),
            }
        }
    }
    stats.rows_out = batches.iter().map(|b| b.num_rows() as u64).sum();
    Ok((batches, stats))
}

/// Reads file `index` of `scan` (one read task): projection, predicate, then the limit.
pub fn read_file(
    scan: &FileScan,
    index: usize,
    batch_rows: usize,
) -> Result<(Vec<RecordBatch>, ReadStats)> {
    let stamp = scan
        .files
        .get(index)
        .ok_or_else(|| Error::NoFiles(format!("file #{index}")))?;
    let path = &stamp.path;
    let bad_file = |message: String| Error::BadFile {
        path: path.clone(),
        message,
    };
    check_unchanged(stamp)?;
    let mut stats = ReadStats {
        files: 1,
        ..ReadStats::default()
    };
    let output = Arc::new(output_schema(scan));
    let from_file = Arc::new(file_output_schema(scan));
    let partition_values = floe_core::plan::partition::values_of(path, &scan.partitioning)?;
    let fetched = Arc::new(AtomicU64::new(0));
    // Batches are decoded as the loop below pulls them, so once the limit is reached the rest
    // of the file (its later Parquet row groups) is never decoded.
    let raw: Box<dyn Iterator<Item = Result<RecordBatch, arrow::error::ArrowError>>> = match &scan
        .format
    {
        FileFormat::Parquet => {
            let (metadata, footer_bytes) = parquet_metadata(stamp)?;
            fetched.fetch_add(footer_bytes, Ordering::Relaxed);
            let file_schema = metadata.schema().clone();
            let row_groups = metadata.metadata().row_groups();
            stats.row_groups = row_groups.len();
            let keep = match &scan.predicate {
                Some(predicate) => prune_row_groups(
                    predicate,
                    &file_schema,
                    metadata.parquet_schema(),
                    row_groups,
                )?,
                None => (0..row_groups.len()).collect(),
            };
            stats.row_groups_pruned = row_groups.len() - keep.len();
            let mask = ProjectionMask::roots(
                metadata.parquet_schema(),
                projection_indices(scan, &file_schema)?,
            );
            match Object::of(path)? {
                Some(object) => Box::new(RemoteRowGroups::new(
                    object,
                    stamp.size,
                    metadata,
                    keep,
                    mask,
                    batch_rows,
                    fetched.clone(),
                )),
                None => {
                    let file = File::open(path).map_err(Error::io(path))?;
                    let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(file, metadata)
                        .with_row_groups(keep)
                        .with_projection(mask)
                        .with_batch_size(batch_rows)
                        .build()
                        .map_err(|e| bad_file(e.to_string()))?;
                    Box::new(reader)
                }
            }
        }
        FileFormat::Csv(options) => {
            let file = counted_text(path, &fetched)?;
            let reader = arrow::csv::ReaderBuilder::new(Arc::new(scan.file_schema.clone()))
                .with_header(options.has_header)
                .with_delimiter(options.delimiter)
                .with_projection(projection_indices(scan, &scan.file_schema)?)
                .with_batch_size(batch_rows)
                .build(file)
                .map_err(|e| bad_file(e.to_string()))?;
            Box::new(reader)
        }
        FileFormat::Json => {
            let file = counted_text(path, &fetched)?;
            // Fields outside the projected schema are ignored by the JSON reader.
            let reader = arrow::json::ReaderBuilder::new(from_file.clone())
                .with_batch_size(batch_rows)
                .build(file)
                .map_err(|e| bad_file(e.to_string()))?;
            Box::new(reader)
        }
        FileFormat::Text => Box::new(text_lines(
            counted_text(path, &fetched)?,
            from_file.clone(),
            batch_rows,
        )),
        FileFormat::Binary => Box::new(std::iter::once(whole_file(stamp, &from_file, &fetched))),
    };
    let mut limiter = scan.limit.map(Limiter::new);
    let mut batches = Vec::new();
    for batch in raw {
        let batch = batch.map_err(|e| bad_file(e.to_string()))?;
        stats.rows_read += batch.num_rows() as u64;
        // Readers may return the file's own field metadata; the plan's schema is canonical.
        let batch = with_partition_columns(&batch, &output, scan, &partition_values)
            .map_err(|e| bad_file(e.to_string()))?;
        let batch = match &scan.predicate {
            Some(predicate) => {
                filter_record_batch(&batch, &evaluate_predicate(predicate, &batch)?)?
            }
            None => batch,
        };
        let batch = match &mut limiter {
            Some(limiter) => match limiter.admit(batch) {
                Some(batch) => batch,
                None => break,
            },
            None => batch,
        };
        if batch.num_rows() > 0 {
            batches.push(batch);
        }
        if limiter.as_ref().is_some_and(Limiter::is_done) {
            break;
        }
    }
    stats.rows_out = batches.iter().map(|b| b.num_rows() as u64).sum();
    stats.bytes_fetched = fetched.load(Ordering::Relaxed);
    Ok((batches, stats))
}

/// `batch` (the output columns a file holds) with the partition columns added: one value
/// per file, repeated, in the output's order.
fn with_partition_columns(
    batch: &RecordBatch,
    output: &SchemaRef,
    scan: &FileScan,
    values: &[floe_core::expr::Scalar],
) -> Result<RecordBatch, ArrowError> {
    let rows = batch.num_rows();
    let mut from_file = batch.columns().iter();
    let columns = output
        .fields()
        .iter()
        .map(|field| {
            match scan
                .partitioning
                .iter()
                .position(|c| c.name == *field.name())
            {
                Some(index) => safe_cast(&literal_array(&values[index], rows), field.data_type())
                    .map_err(|e| ArrowError::ExternalError(Box::new(e))),
                None => from_file.next().cloned().ok_or_else(|| {
                    ArrowError::SchemaError(format!("the file gave no column `{}`", field.name()))
                }),
            }
        })
        .collect::<Result<Vec<ArrayRef>, ArrowError>>()?;
    RecordBatch::try_new_with_options(
        output.clone(),
        columns,
        &arrow::record_batch::RecordBatchOptions::new().with_row_count(Some(rows)),
    )
}

/// A text file's lines, `batch_rows` at a time, as the `text` column (or, when it is not
/// projected, rows without columns). A line ends at `\n` or `\r\n`, which are dropped; a
/// last line without one is a line too.
fn text_lines(
    reader: Box<dyn BufRead + Send>,
    schema: SchemaRef,
    batch_rows: usize,
) -> impl Iterator<Item = Result<RecordBatch, ArrowError>> {
    let mut lines = reader.lines().enumerate();
    std::iter::from_fn(move || {
        let mut batch = arrow::array::StringBuilder::new();
        let mut rows = 0;
        for (number, line) in lines.by_ref() {
            match line {
                Ok(line) => batch.append_value(line),
                Err(error) => {
                    return Some(Err(ArrowError::ParseError(format!(
                        "line {}: {error}",
                        number + 1
                    ))));
                }
            }
            rows += 1;
            if rows == batch_rows {
                break;
            }
        }
        if rows == 0 {
            return None;
        }
        let columns: Vec<ArrayRef> = match schema.fields().is_empty() {
            true => Vec::new(),
            false => vec![Arc::new(batch.finish())],
        };
        Some(RecordBatch::try_new_with_options(
            schema.clone(),
            columns,
            &arrow::record_batch::RecordBatchOptions::new().with_row_count(Some(rows)),
        ))
    })
}

/// A binary file as one row: its path, and its bytes unless they are not projected (then
/// the file is not read).
fn whole_file(
    stamp: &FileStamp,
    schema: &SchemaRef,
    fetched: &AtomicU64,
) -> Result<RecordBatch, ArrowError> {
    let path = &stamp.path;
    let columns = schema
        .fields()
        .iter()
        .map(|field| -> Result<ArrayRef> {
            Ok(match field.name().as_str() {
                "path" => Arc::new(arrow::array::StringArray::from(vec![
                    path.to_string_lossy().into_owned(),
                ])),
                _ => {
                    let bytes = match Object::of(path)? {
                        Some(object) => {
                            let bytes = object.get()?;
                            fetched.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                            bytes.to_vec()
                        }
                        None => std::fs::read(path).map_err(Error::io(path))?,
                    };
                    Arc::new(arrow::array::BinaryArray::from(vec![bytes.as_slice()]))
                }
            })
        })
        .collect::<Result<Vec<_>>>()
        .map_err(|e| ArrowError::ExternalError(Box::new(e)))?;
    RecordBatch::try_new_with_options(
        schema.clone(),
        columns,
        &arrow::record_batch::RecordBatchOptions::new().with_row_count(Some(1)),
    )
}

/// [`open_text`], counting a remote file's bytes into `fetched`.
fn counted_text(path: &Path, fetched: &AtomicU64) -> Result<Box<dyn BufRead + Send>> {
    use bytes::Buf;
    let raw: Box<dyn BufRead + Send> = match Object::of(path)? {
        Some(object) => {
            let bytes = object.get()?;
            fetched.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            Box::new(bytes.reader())
        }
        None => Box::new(BufReader::new(File::open(path).map_err(Error::io(path))?)),
    };
    decompressed(path, raw)
}

/// A text file compressed as its name says — `.gz` (gzip, several members allowed) or `.zst`
/// (zstd) — read decompressed; any other name is read as it is.
fn decompressed(path: &Path, raw: Box<dyn BufRead + Send>) -> Result<Box<dyn BufRead + Send>> {
    Ok(match path.extension().and_then(|e| e.to_str()) {
        Some("gz") => Box::new(BufReader::new(flate2::bufread::MultiGzDecoder::new(raw))),
        Some("zst") => Box::new(BufReader::new(
            zstd::stream::read::Decoder::with_buffer(raw).map_err(Error::io(path))?,
        )),
        _ => raw,
    })
}

/// A file that changed since the plan was built would silently break the fingerprint's
/// promise ("same stamp, same data"), so a task refuses it.
fn check_unchanged(stamp: &FileStamp) -> Result<()> {
    let now = match Object::of(&stamp.path)? {
        Some(object) => object.stamp()?.ok_or_else(|| Error::BadFile {
            path: stamp.path.clone(),
            message: "the object is gone; submit the pipeline again".to_owned(),
        })?,
        None => FileStamp::of(&stamp.path).map_err(|e| Error::BadFile {
            path: stamp.path.clone(),
            message: e.to_string(),
        })?,
    };
    if now != *stamp {
        return Err(Error::BadFile {
            path: stamp.path.clone(),
            message: "the file changed after the plan was built; submit the pipeline again"
                .to_owned(),
        });
    }
    Ok(())
}

/// The indices of the row groups whose statistics do not rule the predicate out.
fn prune_row_groups(
    predicate: &Expr,
    file_schema: &SchemaRef,
    parquet_schema: &parquet::schema::types::SchemaDescriptor,
    row_groups: &[RowGroupMetaData],
) -> Result<Vec<usize>> {
    let mut may_match: Vec<bool> = vec![true; row_groups.len()];
    for conjunct in predicate.conjuncts() {
        let Some((column, op, literal)) = column_vs_literal(conjunct) else {
            continue;
        };
        let Ok(converter) = StatisticsConverter::try_new(column, file_schema, parquet_schema)
        else {
            continue;
        };
        let (Ok(mins), Ok(maxes)) = (
            converter.row_group_mins(row_groups.iter()),
            converter.row_group_maxes(row_groups.iter()),
        ) else {
            continue;
        };
        let Some(verdict) = conjunct_may_match(op, &mins, &maxes, literal)? else {
            continue;
        };
        for (index, keep) in may_match.iter_mut().enumerate() {
            // Missing statistics (null) prove nothing.
            if verdict.is_valid(index) && !verdict.value(index) {
                *keep = false;
            }
        }
    }
    Ok(may_match
        .iter()
        .enumerate()
        .filter_map(|(index, keep)| keep.then_some(index))
        .collect())
}

/// `col op lit` or `lit op col`, normalized to `col op lit`.
fn column_vs_literal(expr: &Expr) -> Option<(&str, BinaryOp, &floe_core::expr::Scalar)> {
    let Expr::Binary { op, left, right } = expr else {
        return None;
    };
    if !op.is_comparison() || *op == BinaryOp::NotEq {
        return None;
    }
    match (left.as_ref(), right.as_ref()) {
        (Expr::Column(column), Expr::Literal(value)) => Some((column, *op, value)),
        (Expr::Literal(value), Expr::Column(column)) => Some((column, op.flipped(), value)),
        _ => None,
    }
}

/// Per row group: can `column op literal` hold for some value in `[min, max]`? Both sides are
/// compared in the type expressions compare them in; the casts are monotonic, so the bounds
/// stay bounds.
fn conjunct_may_match(
    op: BinaryOp,
    mins: &ArrayRef,
    maxes: &ArrayRef,
    literal: &floe_core::expr::Scalar,
) -> Result<Option<BooleanArray>> {
    let literal = literal_array(literal, 1);
    let Some(target) = common_type(mins.data_type(), literal.data_type()) else {
        return Ok(None);
    };
    if target == DataType::Null {
        return Ok(None);
    }
    let (mins, maxes) = (safe_cast(mins, &target)?, safe_cast(maxes, &target)?);
    let literal = safe_cast(&literal, &target)?;
    if literal.is_null(0) {
        return Ok(None);
    }
    let value = arrow::array::Scalar::new(literal);
    let verdict = match op {
        BinaryOp::Gt => cmp::gt(&maxes, &value)?,
        BinaryOp::GtEq => cmp::gt_eq(&maxes, &value)?,
        BinaryOp::Lt => cmp::lt(&mins, &value)?,
        BinaryOp::LtEq => cmp::lt_eq(&mins, &value)?,
        BinaryOp::Eq => and_kleene(&cmp::lt_eq(&mins, &value)?, &cmp::gt_eq(&maxes, &value)?)?,
        _ => return Ok(None),
    };
    Ok(Some(verdict))
}

/// Arrow's CSV inference errors say what is wrong but not in which file.
fn unreadable_csv(path: &Path) -> impl FnOnce(ArrowError) -> Error {
    let path = path.to_owned();
    move |error| Error::BadFile {
        path,
        message: format!("cannot read it as CSV: {error}"),
    }
}

#[cfg(test)]
mod tests {
    use super::wildcard_match;

    #[test]
    fn wildcards_match_like_a_shell() {
        assert!(wildcard_match("*.parquet", "part-00001.parquet"));
        assert!(wildcard_match("part-?????.csv", "part-00001.csv"));
        assert!(wildcard_match("a*b*c", "axxbyyc"));
        assert!(!wildcard_match("*.parquet", "part.csv"));
        assert!(!wildcard_match("a?c", "ac"));
        assert!(wildcard_match("*", ""));
    }
}
