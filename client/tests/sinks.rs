//! Sinks and sources as a user meets them: relative paths, write modes, Parquet compression,
//! a path named twice, and strict casts.

#![allow(clippy::unwrap_used)]

use std::path::Path;

use floe_client::{
    Compression, Dataset, Error, FileFormat, WriteMode, WriteOptions, col, null_on_error,
};
use parquet::file::reader::{FileReader, SerializedFileReader};

/// The visible files of `directory`, sorted.
fn visible(directory: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(directory)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| !name.starts_with('.'))
        .collect();
    names.sort();
    names
}

fn rows_in(directory: &Path) -> u64 {
    Dataset::read_parquet(&[directory])
        .unwrap()
        .count()
        .unwrap()
}

fn with_mode(mode: WriteMode) -> WriteOptions {
    WriteOptions {
        mode,
        ..WriteOptions::default()
    }
}

#[test]
fn a_relative_sink_lands_under_the_submitters_working_directory() {
    let submitter = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    std::env::set_current_dir(submitter.path()).unwrap();
    std::fs::write("in.csv", "x\n1\n2\n").unwrap();
    let job = Dataset::read_csv(&["in.csv"])
        .unwrap()
        .write_parquet("out", WriteOptions::default())
        .unwrap();
    // The job runs where the working directory is another (as a node's is).
    std::env::set_current_dir(elsewhere.path()).unwrap();
    job.execute_locally().unwrap();
    assert!(!elsewhere.path().join("out").exists());
    assert_eq!(rows_in(&submitter.path().join("out")), 2);
}

#[test]
fn write_modes_refuse_replace_and_append() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let write = |n: u64, mode: WriteMode| {
        Dataset::range(n)
            .unwrap()
            .write_parquet(&out, with_mode(mode))
    };
    write(150, WriteMode::Error)
        .unwrap()
        .execute_locally()
        .unwrap();
    assert_eq!(rows_in(&out), 150);
    // `error`: refused when the job is submitted…
    let again = write(10, WriteMode::Error).unwrap();
    let refused = again.check_sinks().unwrap_err().to_string();
    assert!(refused.contains("already holds files"), "{refused}");
    assert!(
        write(10, WriteMode::Overwrite)
            .unwrap()
            .check_sinks()
            .is_ok()
    );
    // …and again when it runs, also if the directory filled after submission.
    let error = again.execute_locally().unwrap_err().to_string();
    assert!(error.contains("already holds files"), "{error}");
    let late = dir.path().join("late");
    let job = Dataset::range(5)
        .unwrap()
        .write_parquet(&late, WriteOptions::default())
        .unwrap();
    job.check_sinks().unwrap();
    std::fs::create_dir_all(&late).unwrap();
    std::fs::write(late.join("someone-elses.txt"), "x").unwrap();
    let error = job.execute_locally().unwrap_err().to_string();
    assert!(error.contains("already holds files"), "{error}");
    assert_eq!(visible(&late), vec!["someone-elses.txt"]);

    // `overwrite` with fewer rows: exactly the new rows, and no stale file.
    let before = visible(&out);
    std::fs::write(out.join("part-00099-00000.parquet.stale"), "x").unwrap();
    write(7, WriteMode::Overwrite)
        .unwrap()
        .execute_locally()
        .unwrap();
    assert_eq!(rows_in(&out), 7);
    assert_eq!(visible(&out), before);
    // `append`: both runs' rows, under names of their own.
    let appended = write(3, WriteMode::Append)
        .unwrap()
        .execute_locally()
        .unwrap();
    assert_eq!(rows_in(&out), 10);
    assert_eq!(visible(&out).len(), 2);
    assert!(appended.written[0].starts_with(&out));
    // Nothing staged is left beside the directories.
    let mut beside = visible(dir.path());
    beside.sort();
    assert_eq!(beside, vec!["late", "out"]);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
}

fn codec_of(directory: &Path) -> parquet::basic::Compression {
    let file = std::fs::File::open(directory.join(&visible(directory)[0])).unwrap();
    let reader = SerializedFileReader::new(file).unwrap();
    reader.metadata().row_group(0).column(0).compression()
}

#[test]
fn parquet_is_zstd_by_default_and_takes_a_codec() {
    let dir = tempfile::tempdir().unwrap();
    let data = Dataset::range(1000).unwrap();
    data.write_parquet(dir.path().join("default"), WriteOptions::default())
        .unwrap()
        .execute_locally()
        .unwrap();
    assert!(matches!(
        codec_of(&dir.path().join("default")),
        parquet::basic::Compression::ZSTD(_)
    ));
    let snappy = WriteOptions {
        compression: Some(Compression::Snappy),
        ..WriteOptions::default()
    };
    data.write_parquet(dir.path().join("snappy"), snappy)
        .unwrap()
        .execute_locally()
        .unwrap();
    assert_eq!(
        codec_of(&dir.path().join("snappy")),
        parquet::basic::Compression::SNAPPY
    );
    // The text formats have no codec to choose.
    let error = data
        .write(
            FileFormat::Json,
            dir.path().join("json"),
            WriteOptions {
                compression: Some(Compression::Zstd),
                ..WriteOptions::default()
            },
        )
        .unwrap_err()
        .to_string();
    assert!(error.contains("applies to Parquet only"), "{error}");
}

#[test]
fn a_path_named_twice_is_read_twice() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a.csv");
    std::fs::write(&file, "x\n1\n2\n3\n").unwrap();
    assert_eq!(Dataset::read_csv(&[&file]).unwrap().count().unwrap(), 3);
    assert_eq!(
        Dataset::read_csv(&[&file, &file]).unwrap().count().unwrap(),
        6
    );
    // A directory and a file in it: the file is read through both.
    assert_eq!(
        Dataset::read_csv(&[dir.path(), file.as_path()])
            .unwrap()
            .count()
            .unwrap(),
        6
    );
}

#[test]
fn a_cast_that_does_not_convert_fails_naming_the_value_unless_tried() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("regions.csv");
    std::fs::write(&file, "region\n7\nnorth\n9\n").unwrap();
    let regions = Dataset::read_csv(&[&file]).unwrap();
    let strict = regions
        .with_column("n", col("region").cast(arrow::datatypes::DataType::Int64))
        .unwrap();
    let error = strict.count().unwrap_err();
    assert!(matches!(error, Error::Source(_)), "{error:?}");
    let message = error.to_string();
    assert!(
        message.contains("\"north\" does not convert to Int64"),
        "{message}"
    );
    assert!(message.contains("col(\"region\")"), "{message}");
    let tried = regions
        .with_column(
            "n",
            null_on_error(col("region").cast(arrow::datatypes::DataType::Int64)),
        )
        .unwrap();
    let batches = tried.take(10).unwrap();
    let nulls: usize = batches
        .iter()
        .map(|batch| batch.column_by_name("n").unwrap().null_count())
        .sum();
    assert_eq!(nulls, 1);
}
