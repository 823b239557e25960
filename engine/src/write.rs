//! Sink kernels: write a task's blocks as Parquet, CSV or NDJSON files.
//!
//! File names are deterministic — `part-<task:05>-<file:05>.<ext>` — so a retried task
//! replaces its own files rather than adding new ones. A task writes every file under a hidden
//! temporary name (`.tmp-part-…`, which readers skip) in the target directory, syncs it, and
//! renames them all only once the whole task succeeded; on any failure the temporaries are
//! removed, so no partial file and no partial set of files is ever visible. Files are cut when
//! the Arrow data written to them passes the target size.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use floe_core::plan::{FileFormat, WriteSpec};
use parquet::arrow::ArrowWriter;

use crate::{Error, Result};

/// One format's open file.
enum FormatWriter {
    Parquet(ArrowWriter<File>),
    Csv(arrow::csv::Writer<BufWriter<File>>),
    Json(arrow::json::LineDelimitedWriter<BufWriter<File>>),
}

impl FormatWriter {
    fn create(spec: &WriteSpec, path: &Path, schema: &SchemaRef) -> Result<Self> {
        // A temporary file left by an earlier attempt goes first; then the file is created
        // new, never opened through whatever has the name (a symlink planted there would
        // otherwise send the write out of the sink directory).
        match std::fs::remove_file(path) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::io(path)(error));
            }
            _ => {}
        }
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(Error::io(path))?;
        Ok(match &spec.format {
            FileFormat::Parquet => {
                FormatWriter::Parquet(ArrowWriter::try_new(file, schema.clone(), None)?)
            }
            FileFormat::Csv(options) => FormatWriter::Csv(
                arrow::csv::WriterBuilder::new()
                    .with_header(options.has_header)
                    .with_delimiter(options.delimiter)
                    .build(BufWriter::new(file)),
            ),
            FileFormat::Json => {
                FormatWriter::Json(arrow::json::LineDelimitedWriter::new(BufWriter::new(file)))
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
            FormatWriter::Csv(writer) => {
                writer.into_inner().into_inner().map_err(|e| Error::Io {
                    path: path.to_owned(),
                    source: e.into_error(),
                })?
            }
            FormatWriter::Json(mut writer) => {
                writer.finish()?;
                writer.into_inner().into_inner().map_err(|e| Error::Io {
                    path: path.to_owned(),
                    source: e.into_error(),
                })?
            }
        };
        let mut file = file;
        file.flush().map_err(Error::io(path))?;
        file.sync_all().map_err(Error::io(path))
    }
}

fn extension(format: &FileFormat) -> &'static str {
    match format {
        FileFormat::Parquet => "parquet",
        FileFormat::Csv(_) => "csv",
        FileFormat::Json => "json",
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

/// Writes the blocks of task `task` to `spec.directory`; returns the published files.
pub fn write_task(
    spec: &WriteSpec,
    task: usize,
    schema: SchemaRef,
    batches: impl IntoIterator<Item = Result<RecordBatch>>,
) -> Result<Vec<PathBuf>> {
    let directory = &spec.directory;
    std::fs::create_dir_all(directory).map_err(Error::io(directory))?;
    let mut pending = Pending {
        files: Vec::new(),
        published: false,
    };
    let mut current: Option<(FormatWriter, u64)> = None;
    for batch in batches {
        let batch = batch?;
        if current.is_none() {
            let name = file_name(&spec.format, task, pending.files.len());
            let temporary = directory.join(format!(".tmp-{name}"));
            let writer = FormatWriter::create(spec, &temporary, &schema)?;
            pending.files.push((temporary, directory.join(name)));
            current = Some((writer, 0));
        }
        if let Some((writer, written)) = &mut current {
            writer.write(&batch)?;
            *written += batch.get_array_memory_size() as u64;
            if *written >= spec.target_file_size
                && let Some((writer, _)) = current.take()
                && let Some((temporary, _)) = pending.files.last()
            {
                writer.finish(temporary)?;
            }
        }
    }
    if let (Some((writer, _)), Some((temporary, _))) = (current.take(), pending.files.last()) {
        writer.finish(temporary)?;
    }
    for (temporary, visible) in &pending.files {
        std::fs::rename(temporary, visible).map_err(Error::io(visible))?;
    }
    pending.published = true;
    File::open(directory)
        .and_then(|dir| dir.sync_all())
        .map_err(Error::io(directory))?;
    Ok(pending
        .files
        .iter()
        .map(|(_, visible)| visible.clone())
        .collect())
}
