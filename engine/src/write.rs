//! Sink kernels: write a task's blocks as Parquet, CSV or NDJSON files.
//!
//! File names are deterministic — `part-<task:05>-<file:05>.<ext>` — so a retried task
//! replaces its own files rather than adding new ones. A task writes every file under a hidden
//! temporary name (`.tmp-part-…`, which readers skip) in the target directory, syncs it, and
//! renames them all only once the whole task succeeded; on any failure the temporaries are
//! removed, so no partial file and no partial set of files is ever visible. Files are cut when
//! the Arrow data written to them passes the target size.
//!
//! With `partition_by`, a task splits each block's rows by those columns' values and writes
//! each partition's rows, without those columns, under its Hive directory
//! (`date=2026-11-30/part-…`, escaped by [`floe_core::plan::partition`]), one open file per
//! partition it has seen.
//!
//! A job's tasks write into a hidden *staging* directory beside the sink's directory
//! ([`staging_directory`]); once every task has succeeded, [`publish`] moves the files in as the
//! sink's [`WriteMode`] says, and [`discard`] removes them when the job fails. Readers skip the
//! staging directory (its name starts with `.`), so a failed or running job is never read.
//!
//! A sink directory may be an object-storage prefix (`s3://bucket/out`, see [`crate::remote`]).
//! A task then writes each file to a local scratch directory and uploads it with a multipart
//! upload, which makes the object appear whole or not at all, under the hidden staging prefix
//! `.out.floe-<token>/` beside the sink's. Publishing copies the staged objects in (object
//! stores have no rename, let alone of a directory): each object appears atomically, but
//! a reader listing the prefix while an `overwrite` publishes may see some new objects beside
//! old ones not yet deleted.

mod direct;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{Array, AsArray, StringArray, UInt32Array};
use arrow::compute::take_record_batch;
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::RecordBatch;
use floe_core::plan::partition::segment;
use floe_core::plan::{Compression, FileFormat, WriteMode, WriteSpec};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;

use self::direct::{DirectFile, Io};
use crate::remote::Object;
use crate::{Error, Result};

/// One format's open file.
enum FormatWriter {
    Parquet(ArrowWriter<DirectFile>),
    Csv(arrow::csv::Writer<DirectFile>),
    Json(arrow::json::LineDelimitedWriter<DirectFile>),
}

impl FormatWriter {
    fn create(spec: &WriteSpec, path: &Path, schema: &SchemaRef, io: Io) -> Result<Self> {
        // A temporary file left by an earlier attempt goes first; then the file is created
        // new, never opened through whatever has the name (a symlink planted there would
        // otherwise send the write out of the sink directory).
        match std::fs::remove_file(path) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::io(path)(error));
            }
            _ => {}
        }
        let file = DirectFile::create_new(path, io).map_err(Error::io(path))?;
        Ok(match &spec.format {
            FileFormat::Parquet => {
                let properties = WriterProperties::builder()
                    .set_compression(codec(spec.compression))
                    .build();
                FormatWriter::Parquet(ArrowWriter::try_new(
                    file,
                    schema.clone(),
                    Some(properties),
                )?)
            }
            FileFormat::Csv(options) => FormatWriter::Csv(
                arrow::csv::WriterBuilder::new()
                    .with_header(options.has_header)
                    .with_delimiter(options.delimiter)
                    .build(file),
            ),
            FileFormat::Json => FormatWriter::Json(arrow::json::LineDelimitedWriter::new(file)),
            // The plan refuses such a sink; a hand-made spec is refused here.
            FileFormat::Text | FileFormat::Binary => {
                return Err(Error::BadFile {
                    path: path.to_owned(),
                    message: format!("{} files can be read, not written", spec.format.name()),
                });
            }
        })
    }

    fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        match self {
            FormatWriter::Parquet(writer) => writer.write(batch)?,
            FormatWriter::Csv(writer) => writer.write(batch)?,
            FormatWriter::Json(writer) => writer.write(batch)?,
        }
        Ok(())
    }

    /// Flushes and syncs the file, so a rename never publishes data still in a buffer.
    fn finish(self, path: &Path) -> Result<()> {
        let file = match self {
            FormatWriter::Parquet(writer) => writer.into_inner()?,
            FormatWriter::Csv(writer) => writer.into_inner(),
            FormatWriter::Json(mut writer) => {
                writer.finish()?;
                writer.into_inner()
            }
        };
        file.finish()
            .and_then(|file| file.sync_all())
            .map_err(Error::io(path))
    }
}

/// Parquet's codec for `compression`, at each codec's default level.
fn codec(compression: Compression) -> parquet::basic::Compression {
    use parquet::basic::Compression as Codec;
    match compression {
        Compression::Zstd => Codec::ZSTD(Default::default()),
        Compression::Snappy => Codec::SNAPPY,
        Compression::Lz4 => Codec::LZ4_RAW,
        Compression::Gzip => Codec::GZIP(Default::default()),
        Compression::Uncompressed => Codec::UNCOMPRESSED,
    }
}

/// Refuses a directory that holds visible files (the `error` write mode): a missing or empty
/// one, or one with only hidden names (`.`/`_`, which readers skip), is fine.
pub fn check_empty(directory: &Path) -> Result<()> {
    if let Some(prefix) = Object::sink_of(directory)? {
        return match prefix.list_below()?.first() {
            Some(found) => Err(Error::OutputExists {
                directory: directory.to_owned(),
                example: prefix.relative_name(found)?,
            }),
            None => Ok(()),
        };
    }
    let entries = match std::fs::read_dir(directory) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(Error::io(directory)(error)),
    };
    for entry in entries {
        let entry = entry.map_err(Error::io(directory))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with(['.', '_']) {
            return Err(Error::OutputExists {
                directory: directory.to_owned(),
                example: name,
            });
        }
    }
    Ok(())
}

fn extension(format: &FileFormat) -> &'static str {
    match format {
        FileFormat::Parquet => "parquet",
        FileFormat::Csv(_) => "csv",
        FileFormat::Json => "json",
        FileFormat::Text => "txt",
        FileFormat::Binary => "bin",
    }
}

/// The visible name of file `file` of task `task`.
pub fn file_name(format: &FileFormat, task: usize, file: usize) -> String {
    format!("part-{task:05}-{file:05}.{}", extension(format))
}

/// Temporary files of one task, removed on drop unless published.
struct Pending {
    files: Vec<(PathBuf, PathBuf)>,
    published: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.published {
            for (temporary, _) in &self.files {
                // Best effort: the file may not exist if creating it failed.
                let _ = std::fs::remove_file(temporary);
            }
        }
    }
}

/// The file a partition directory of one task is writing, and how many it has begun.
#[derive(Default)]
struct Slot {
    /// The open writer, the Arrow bytes written to it, and its entry in [`Pending`].
    current: Option<(FormatWriter, u64, usize)>,
    files: usize,
}

/// Writes the blocks of task `task` to `spec.directory`; returns the published files. With
/// `spec.partition_by`, each block's rows are split by those columns' values into Hive
/// directories (`col=value/…`), each with its own files, which leave those columns out.
pub fn write_task(
    spec: &WriteSpec,
    task: usize,
    schema: SchemaRef,
    batches: impl IntoIterator<Item = Result<RecordBatch>>,
) -> Result<Vec<PathBuf>> {
    let remote = Object::sink_of(&spec.directory)?;
    // A remote sink's files are written here first, then uploaded.
    let scratch = match &remote {
        Some(_) => Some(
            tempfile::Builder::new()
                .prefix(".floe-upload-")
                .tempdir()
                .map_err(Error::io(std::env::temp_dir()))?,
        ),
        None => None,
    };
    let directory = match &scratch {
        Some(scratch) => scratch.path(),
        None => &spec.directory,
    };
    // An upload reads each scratch file back at once, from the page cache if it is there.
    let io = match scratch {
        Some(_) => Io::PageCache,
        None => Io::Direct,
    };
    std::fs::create_dir_all(directory).map_err(Error::io(directory))?;
    let mut pending = Pending {
        files: Vec::new(),
        published: false,
    };
    let partitions = Partitions::new(spec, &schema)?;
    // Ordered by directory, so files are closed in the same order every run.
    let mut slots: BTreeMap<String, Slot> = BTreeMap::new();
    for batch in batches {
        for (relative, rows) in partitions.split(&batch?)? {
            let slot = slots.entry(relative.clone()).or_default();
            if slot.current.is_none() {
                let within = directory.join(&relative);
                std::fs::create_dir_all(&within).map_err(Error::io(&within))?;
                let name = file_name(&spec.format, task, slot.files);
                let temporary = within.join(format!(".tmp-{name}"));
                let writer = FormatWriter::create(spec, &temporary, &partitions.file_schema, io)?;
                pending.files.push((temporary, within.join(name)));
                slot.files += 1;
                slot.current = Some((writer, 0, pending.files.len() - 1));
            }
            if let Some((writer, written, _)) = &mut slot.current {
                writer.write(&rows)?;
                *written += rows.get_array_memory_size() as u64;
                if *written >= spec.target_file_size
                    && let Some((writer, _, entry)) = slot.current.take()
                {
                    writer.finish(&pending.files[entry].0)?;
                }
            }
        }
    }
    for slot in slots.into_values() {
        if let Some((writer, _, entry)) = slot.current {
            writer.finish(&pending.files[entry].0)?;
        }
    }
    if let Some(prefix) = remote {
        let mut uploaded = Vec::with_capacity(pending.files.len());
        for (temporary, visible) in &pending.files {
            let name = visible
                .strip_prefix(directory)
                .map(|name| name.to_string_lossy().into_owned())
                .unwrap_or_default();
            let object = prefix.join(&name);
            object.upload(temporary)?;
            uploaded.push(object.path());
        }
        return Ok(uploaded);
    }
    for (temporary, visible) in &pending.files {
        std::fs::rename(temporary, visible).map_err(Error::io(visible))?;
    }
    pending.published = true;
    let mut synced: Vec<&Path> = pending
        .files
        .iter()
        .filter_map(|(_, visible)| visible.parent())
        .collect();
    synced.push(directory);
    synced.sort();
    synced.dedup();
    for within in synced {
        sync_directory(within)?;
    }
    Ok(pending
        .files
        .iter()
        .map(|(_, visible)| visible.clone())
        .collect())
}

/// How a sink's rows are split into Hive partition directories.
struct Partitions {
    /// The indices of the partition columns in the input, in `partition_by` order.
    keys: Vec<(usize, String)>,
    /// The indices of the columns the files hold.
    kept: Vec<usize>,
    file_schema: SchemaRef,
}

impl Partitions {
    fn new(spec: &WriteSpec, schema: &SchemaRef) -> Result<Self> {
        let keys = spec
            .partition_by
            .iter()
            .map(|name| Ok((schema.index_of(name)?, name.clone())))
            .collect::<Result<Vec<_>>>()?;
        let kept: Vec<usize> = (0..schema.fields().len())
            .filter(|index| !keys.iter().any(|(key, _)| key == index))
            .collect();
        Ok(Self {
            file_schema: Arc::new(schema.project(&kept)?),
            keys,
            kept,
        })
    }

    /// `batch`'s rows by partition directory (`""` without partitioning), without the
    /// partition columns.
    fn split(&self, batch: &RecordBatch) -> Result<Vec<(String, RecordBatch)>> {
        if self.keys.is_empty() {
            return Ok(vec![(String::new(), batch.clone())]);
        }
        let values = self
            .keys
            .iter()
            .map(|(index, _)| {
                let text = arrow::compute::cast(batch.column(*index), &DataType::Utf8)?;
                Ok(text.as_string::<i32>().clone())
            })
            .collect::<Result<Vec<StringArray>>>()?;
        let mut rows: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for row in 0..batch.num_rows() {
            let directory = self
                .keys
                .iter()
                .zip(&values)
                .map(|((_, name), values)| {
                    segment(name, values.is_valid(row).then(|| values.value(row)))
                })
                .collect::<Vec<_>>()
                .join("/");
            let row = u32::try_from(row).map_err(|_| Error::BadFile {
                path: PathBuf::from(&directory),
                message: "a block of more than 2^32 rows cannot be partitioned".to_owned(),
            })?;
            rows.entry(directory).or_default().push(row);
        }
        let kept = batch.project(&self.kept)?;
        rows.into_iter()
            .map(|(directory, indices)| {
                let taken = take_record_batch(&kept, &UInt32Array::from(indices))?;
                Ok((directory, taken))
            })
            .collect()
    }
}

/// The hidden directory beside `target` where a job's files wait until it succeeds; `token`
/// names the job (and its attempt), so concurrent jobs never share one.
pub fn staging_directory(target: &Path, token: &str) -> PathBuf {
    if let Some(url) = floe_core::location::remote_url(target) {
        let url = url.trim_end_matches('/');
        return PathBuf::from(match url.rsplit_once('/') {
            Some((parent, name)) if !parent.ends_with(":/") => {
                format!("{parent}/.{name}.floe-{token}")
            }
            // A whole bucket: the (hidden) staging prefix goes inside it.
            _ => format!("{url}/.output.floe-{token}"),
        });
    }
    let name = target
        .file_name()
        .map_or_else(|| "output".to_owned(), |n| n.to_string_lossy().into_owned());
    target
        .parent()
        .unwrap_or(Path::new("/"))
        .join(format!(".{name}.floe-{token}"))
}

/// Moves the files staged in `staging` into `spec.directory` as `spec.mode` says, and returns
/// them where they now are:
/// - `error`: refused if the directory holds visible files by now; else the staged directory
///   becomes the directory (one rename when there was none).
/// - `overwrite`: the old directory is renamed aside, the staged one renamed into its place,
///   and only then the old files are removed.
/// - `append`: each file is linked in under a name with `token` in it (`part-<token>-…`),
///   which fails rather than replace a file that has the name.
pub fn publish(spec: &WriteSpec, staging: &Path, token: &str) -> Result<Vec<PathBuf>> {
    if let (Some(target), Some(staged)) = (Object::sink_of(&spec.directory)?, Object::of(staging)?)
    {
        return publish_remote(spec, &target, &staged, token);
    }
    let target = &spec.directory;
    if !staging.exists() {
        // No task wrote anything (an empty input): the sink is an empty directory.
        std::fs::create_dir_all(staging).map_err(Error::io(staging))?;
    }
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent).map_err(Error::io(parent))?;
    }
    let staged = staged_files(staging)?;
    let published = match spec.mode {
        WriteMode::Error => {
            check_empty(target)?;
            match std::fs::remove_dir(target) {
                // Only an empty directory can be removed: hidden files keep it, and the
                // files are then moved in one by one.
                Ok(()) => rename_directory(staging, target, &staged)?,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                    rename_directory(staging, target, &staged)?
                }
                Err(_) => move_files(staging, target, &staged, None)?,
            }
        }
        WriteMode::Overwrite => {
            let old = staging_directory(target, &format!("{token}-old"));
            let had_old = match std::fs::rename(target, &old) {
                Ok(()) => true,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => false,
                Err(error) => return Err(Error::io(target)(error)),
            };
            let published = rename_directory(staging, target, &staged)?;
            if had_old {
                std::fs::remove_dir_all(&old).map_err(Error::io(&old))?;
            }
            published
        }
        WriteMode::Append => {
            std::fs::create_dir_all(target).map_err(Error::io(target))?;
            move_files(staging, target, &staged, Some(token))?
        }
    };
    discard(staging);
    sync_directory(target)?;
    Ok(published)
}

/// Removes a staging directory and whatever is in it; best effort, since it is hidden and a
/// later attempt uses its own.
pub fn discard(staging: &Path) {
    match Object::of(staging) {
        Ok(Some(prefix)) => {
            let _ = prefix.delete_below();
        }
        Ok(None) => {
            let _ = std::fs::remove_dir_all(staging);
        }
        Err(_) => {}
    }
}

/// [`publish`] for an object-storage sink: the staged objects are copied in (each appears
/// whole), then the staging prefix is deleted.
fn publish_remote(
    spec: &WriteSpec,
    target: &Object,
    staging: &Object,
    token: &str,
) -> Result<Vec<PathBuf>> {
    let staged = staging
        .list_below()?
        .iter()
        .map(|stamp| staging.relative_name(stamp))
        .collect::<Result<Vec<_>>>()?;
    let old = match spec.mode {
        WriteMode::Error => {
            check_empty(&spec.directory)?;
            Vec::new()
        }
        WriteMode::Overwrite => target
            .list_below()?
            .iter()
            .map(|stamp| target.relative_name(stamp))
            .collect::<Result<Vec<_>>>()?,
        WriteMode::Append => Vec::new(),
    };
    let mut published = Vec::with_capacity(staged.len());
    for name in &staged {
        let visible = match spec.mode {
            WriteMode::Append => appended_name(name, token),
            WriteMode::Error | WriteMode::Overwrite => name.clone(),
        };
        let to = target.join(&visible);
        staging.join(name).copy_to(&to)?;
        published.push(to.path());
    }
    // Old objects go only once every new one is in, and not those just replaced.
    for name in old.iter().filter(|name| !staged.contains(name)) {
        target.join(name).delete()?;
    }
    staging.delete_below()?;
    Ok(published)
}

/// `part-…` becomes `part-<token>-…` (in the last segment), as local appends name files.
fn appended_name(name: &str, token: &str) -> String {
    let (directory, file) = match name.rsplit_once('/') {
        Some((directory, file)) => (Some(directory), file),
        None => (None, name),
    };
    let file = match file.strip_prefix("part-") {
        Some(rest) => format!("part-{token}-{rest}"),
        None => file.to_owned(),
    };
    match directory {
        Some(directory) => format!("{directory}/{file}"),
        None => file,
    }
}

/// The visible files a job staged, as paths relative to `staging` (inside Hive partition
/// directories too), sorted.
fn staged_files(staging: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    // Partition directories nest as deep as `partition_by` is long; a stack, not recursion.
    let mut directories = vec![(staging.to_owned(), String::new())];
    while let Some((directory, relative)) = directories.pop() {
        for entry in std::fs::read_dir(&directory).map_err(Error::io(&directory))? {
            let entry = entry.map_err(Error::io(&directory))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(['.', '_']) {
                continue;
            }
            let name = match relative.is_empty() {
                true => name,
                false => format!("{relative}/{name}"),
            };
            if entry.file_type().map_err(Error::io(entry.path()))?.is_dir() {
                directories.push((entry.path(), name));
            } else {
                names.push(name);
            }
        }
    }
    names.sort();
    Ok(names)
}

fn rename_directory(staging: &Path, target: &Path, staged: &[String]) -> Result<Vec<PathBuf>> {
    std::fs::rename(staging, target).map_err(Error::io(target))?;
    Ok(staged.iter().map(|name| target.join(name)).collect())
}

/// Moves each staged file into `target` without replacing anything (a hard link fails when
/// the name exists), renamed `part-<token>-…` when a token is given.
fn move_files(
    staging: &Path,
    target: &Path,
    staged: &[String],
    token: Option<&str>,
) -> Result<Vec<PathBuf>> {
    let mut published = Vec::with_capacity(staged.len());
    for name in staged {
        let visible = match token {
            Some(token) => appended_name(name, token),
            None => name.clone(),
        };
        let (from, to) = (staging.join(name), target.join(visible));
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(Error::io(parent))?;
        }
        std::fs::hard_link(&from, &to).map_err(Error::io(&to))?;
        std::fs::remove_file(&from).map_err(Error::io(&from))?;
        published.push(to);
    }
    let mut directories: Vec<&Path> = published.iter().filter_map(|to| to.parent()).collect();
    directories.sort();
    directories.dedup();
    for directory in directories {
        sync_directory(directory)?;
    }
    Ok(published)
}

fn sync_directory(directory: &Path) -> Result<()> {
    File::open(directory)
        .and_then(|dir| dir.sync_all())
        .map_err(Error::io(directory))
}
