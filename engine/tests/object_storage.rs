//! Readers and writers against a real S3-compatible server (`s3s-fs` on 127.0.0.1, reached
//! over HTTP with SigV4 through `object_store`), compared with the same files read locally.
//!
//! One test: the server's address and keys reach the client through the process environment,
//! which is set once, before anything else runs.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{ArrayRef, Float64Array, Int64Array, StringArray};
use arrow::record_batch::RecordBatch;
use floe_core::expr::{col, lit};
use floe_core::fingerprint::SourceDescription;
use floe_core::plan::{Compression, CsvOptions, FileFormat, FileScan, WriteMode, WriteSpec};
use floe_engine::read::{discover, expand_paths, read_scan};
use floe_engine::write::{check_empty, publish, staging_directory, write_task};
use floe_testkit::batches::int_column;
use floe_testkit::s3::{S3Server, S3ServerConfig};

const ROWS: i64 = 20_000;

/// 64 hex digits that depend on `i` only and compress poorly, so the `note` column holds most
/// of a file's bytes.
fn noise(i: i64) -> String {
    let mut state = i as u64;
    (0..4)
        .map(|_| {
            // SplitMix64.
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            format!("{:016x}", z ^ (z >> 31))
        })
        .collect()
}

/// id = i, group = "g{i % 7}", value = i * 0.25, note = [`noise`] (most of the bytes).
fn sample(start: i64, rows: i64) -> RecordBatch {
    let ids: Vec<i64> = (start..start + rows).collect();
    RecordBatch::try_from_iter([
        ("id", Arc::new(Int64Array::from(ids.clone())) as ArrayRef),
        (
            "group",
            Arc::new(StringArray::from_iter_values(
                ids.iter().map(|i| format!("g{}", i % 7)),
            )) as ArrayRef,
        ),
        (
            "value",
            Arc::new(Float64Array::from_iter_values(
                ids.iter().map(|i| *i as f64 * 0.25),
            )) as ArrayRef,
        ),
        (
            "note",
            Arc::new(StringArray::from_iter_values(ids.iter().map(|i| noise(*i)))) as ArrayRef,
        ),
    ])
    .unwrap()
}

fn url(path: &str) -> PathBuf {
    PathBuf::from(format!("s3://lake/{path}"))
}

/// Writes a file under `local` (at `key`) and uploads it as object `key`, as another writer
/// would have; returns the local copy.
fn put(server: &S3Server, local: &Path, key: &str, write: impl FnOnce(&Path)) -> PathBuf {
    let path = local.join(key);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    write(&path);
    server.put_file("lake", key, &path);
    path
}

fn with_projection(scan: &FileScan, columns: &[&str]) -> FileScan {
    FileScan {
        projection: Some(columns.iter().map(|c| (*c).to_owned()).collect()),
        ..scan.clone()
    }
}

fn spec(format: FileFormat, directory: PathBuf, mode: WriteMode) -> WriteSpec {
    WriteSpec {
        compression: Compression::default_for(&format),
        partition_by: Vec::new(),
        format,
        directory,
        target_file_size: 1 << 30,
        mode,
    }
}

/// Runs one sink as a job does: tasks write into the staging prefix, then it is published.
fn write_job(spec: &WriteSpec, token: &str, tasks: &[RecordBatch]) -> floe_engine::Result<()> {
    let staging = staging_directory(&spec.directory, token);
    let staged = WriteSpec {
        directory: staging.clone(),
        ..spec.clone()
    };
    for (index, batch) in tasks.iter().enumerate() {
        write_task(&staged, index, batch.schema(), [Ok(batch.clone())])?;
    }
    publish(spec, &staging, token).map(|_| ())
}

#[test]
fn object_storage_reads_and_writes_match_local_files() {
    let server = S3Server::start_with(&S3ServerConfig {
        buckets: &["lake"],
        public_buckets: &["web"],
    });
    // SAFETY: the only test of this binary, before it starts any thread of its own.
    unsafe { server.export_env() };
    let scratch = tempfile::tempdir().unwrap();

    // Two Parquet files of four row groups each, a CSV file, and hidden files to skip.
    let local_a = put(&server, scratch.path(), "data/a.parquet", |p| {
        floe_testkit::files::write_parquet(p, &sample(0, ROWS), Some(5_000))
    });
    put(&server, scratch.path(), "data/b.parquet", |p| {
        floe_testkit::files::write_parquet(p, &sample(ROWS, ROWS), Some(5_000))
    });
    put(&server, scratch.path(), "data/_SUCCESS", |p| {
        std::fs::write(p, "").unwrap()
    });
    put(&server, scratch.path(), "data/.staging/c.parquet", |p| {
        std::fs::write(p, "not parquet").unwrap()
    });
    let local_csv = put(&server, scratch.path(), "csv/x.csv", |p| {
        let mut writer = arrow::csv::Writer::new(std::fs::File::create(p).unwrap());
        writer.write(&sample(0, 500)).unwrap();
    });

    // Listing, directories and globs.
    assert_eq!(expand_paths(&[url("data")]).unwrap().len(), 2);
    assert_eq!(expand_paths(&[url("data/*.parquet")]).unwrap().len(), 2);
    assert_eq!(expand_paths(&[url("data/a.parquet")]).unwrap().len(), 1);
    assert!(expand_paths(&[url("data/*.csv")]).is_err());
    assert!(discover(FileFormat::Parquet, &[url("missing/")]).is_err());

    // Parquet: same schema and rows as the local file; a one-column read fetches about that
    // column's bytes, not the file.
    let remote = discover(FileFormat::Parquet, &[url("data/a.parquet")]).unwrap();
    let local = discover(FileFormat::Parquet, &[&local_a]).unwrap();
    assert_eq!(remote.file_schema, local.file_schema);
    let stamp = &remote.files[0];
    assert!(stamp.version.is_some(), "an object's stamp has its ETag");
    let (remote_rows, remote_stats) = read_scan(&with_projection(&remote, &["id"]), 4096).unwrap();
    let (local_rows, local_stats) = read_scan(&with_projection(&local, &["id"]), 4096).unwrap();
    assert_eq!(
        int_column(&remote_rows, "id"),
        int_column(&local_rows, "id")
    );
    assert_eq!(local_stats.bytes_fetched, 0);
    let file_size = std::fs::metadata(&local_a).unwrap().len();
    let id_bytes: u64 = floe_testkit::files::parquet_column_bytes(&local_a, "id");
    assert!(
        remote_stats.bytes_fetched >= id_bytes
            && remote_stats.bytes_fetched < id_bytes + 70_000
            && remote_stats.bytes_fetched < file_size / 2,
        "fetched {} for a column of {id_bytes} in a file of {file_size}",
        remote_stats.bytes_fetched
    );

    // Row groups pruned by statistics are never fetched.
    let filtered = FileScan {
        predicate: Some(col("id").lt(lit(4_000i64))),
        ..with_projection(&remote, &["id", "note"])
    };
    let (rows, stats) = read_scan(&filtered, 4096).unwrap();
    assert_eq!(int_column(&rows, "id"), (0..4_000).collect::<Vec<_>>());
    assert_eq!((stats.row_groups, stats.row_groups_pruned), (4, 3));
    let (_, everything) = read_scan(&with_projection(&remote, &["id", "note"]), 4096).unwrap();
    assert!(
        stats.bytes_fetched * 3 < everything.bytes_fetched,
        "{stats:?} {everything:?}"
    );

    // The whole directory reads as both files, in order.
    let both = discover(FileFormat::Parquet, &[url("data/")]).unwrap();
    let (rows, _) = read_scan(&with_projection(&both, &["id"]), 4096).unwrap();
    assert_eq!(int_column(&rows, "id"), (0..2 * ROWS).collect::<Vec<_>>());

    // CSV: the same rows as the local file.
    let csv = FileFormat::Csv(CsvOptions::default());
    let remote_csv = discover(csv.clone(), &[url("csv/x.csv")]).unwrap();
    let local_csv = discover(csv.clone(), &[&local_csv]).unwrap();
    assert_eq!(remote_csv.file_schema, local_csv.file_schema);
    let (remote_rows, _) = read_scan(&remote_csv, 128).unwrap();
    let (local_rows, _) = read_scan(&local_csv, 128).unwrap();
    assert_eq!(remote_rows, local_rows);

    // Overwriting an object changes its stamp, so the fingerprint; a plan made before
    // refuses to read it.
    let before = SourceDescription::Files(remote.files.clone()).fingerprint();
    put(&server, scratch.path(), "data/a.parquet", |p| {
        floe_testkit::files::write_parquet(p, &sample(7, ROWS), Some(5_000))
    });
    let after = discover(FileFormat::Parquet, &[url("data/a.parquet")]).unwrap();
    assert_ne!(after.files, remote.files);
    assert_ne!(
        SourceDescription::Files(after.files.clone()).fingerprint(),
        before
    );
    let error = read_scan(&remote, 4096).unwrap_err().to_string();
    assert!(
        error.contains("changed after the plan was built"),
        "{error}"
    );

    // Writes: staged under a hidden prefix, published by the write mode.
    let out = url("out");
    let parquet = spec(FileFormat::Parquet, out.clone(), WriteMode::Error);
    write_job(&parquet, "job1", &[sample(0, 100), sample(100, 100)]).unwrap();
    let written = discover(FileFormat::Parquet, &[&out]).unwrap();
    assert_eq!(written.files.len(), 2);
    let (rows, _) = read_scan(&written, 4096).unwrap();
    assert_eq!(int_column(&rows, "id"), (0..200).collect::<Vec<_>>());
    assert!(
        !server.root().join("lake/.out.floe-job1").exists()
            || std::fs::read_dir(server.root().join("lake/.out.floe-job1"))
                .unwrap()
                .next()
                .is_none(),
        "the staging prefix is gone"
    );
    // `error` refuses a prefix that holds objects; nothing is written.
    let refused = write_job(&parquet, "job2", &[sample(500, 10)]).unwrap_err();
    assert!(
        matches!(refused, floe_engine::Error::OutputExists { .. }),
        "{refused}"
    );
    assert!(check_empty(&out).is_err());
    // `append` adds objects under new names.
    let append = spec(FileFormat::Parquet, out.clone(), WriteMode::Append);
    write_job(&append, "job3", &[sample(200, 50)]).unwrap();
    let (rows, _) = read_scan(&discover(FileFormat::Parquet, &[&out]).unwrap(), 4096).unwrap();
    let mut ids = int_column(&rows, "id");
    ids.sort();
    assert_eq!(ids, (0..250).collect::<Vec<_>>());
    // `overwrite` replaces everything that was there.
    let overwrite = spec(FileFormat::Parquet, out.clone(), WriteMode::Overwrite);
    write_job(&overwrite, "job4", &[sample(1_000, 30)]).unwrap();
    let replaced = discover(FileFormat::Parquet, &[&out]).unwrap();
    assert_eq!(replaced.files.len(), 1);
    let (rows, _) = read_scan(&replaced, 4096).unwrap();
    assert_eq!(int_column(&rows, "id"), (1_000..1_030).collect::<Vec<_>>());

    // NDJSON and CSV sinks read back as written; the uploaded bytes are a valid local file.
    for format in [FileFormat::Json, csv] {
        let out = url(&format!("out-{}", format.name()));
        write_job(
            &spec(format.clone(), out.clone(), WriteMode::Error),
            "job5",
            &[sample(0, 40)],
        )
        .unwrap();
        let (rows, _) = read_scan(&discover(format.clone(), &[&out]).unwrap(), 4096).unwrap();
        assert_eq!(int_column(&rows, "id"), (0..40).collect::<Vec<_>>());
    }

    // A URL carrying credentials is refused without echoing them.
    let error = discover(
        FileFormat::Parquet,
        &[PathBuf::from("s3://user:hunter2@lake/data/a.parquet")],
    )
    .unwrap_err()
    .to_string();
    assert!(
        !error.contains("hunter2") && error.contains("credentials"),
        "{error}"
    );

    partitioned_text_and_binary_objects(&server, scratch.path());
    plain_http_reads(&server, scratch.path());
}

/// A Hive-partitioned sink on the server, read back with its partitions discovered; a filter
/// on them fetches only the kept directories' objects. Text and binary objects read as the
/// same files do locally.
fn partitioned_text_and_binary_objects(server: &S3Server, local: &Path) {
    let out = url("events");
    let partitioned = WriteSpec {
        partition_by: vec!["group".to_owned()],
        ..spec(FileFormat::Parquet, out.clone(), WriteMode::Error)
    };
    write_job(&partitioned, "job6", &[sample(0, 700), sample(700, 700)]).unwrap();
    // Seven groups, two tasks: one object per task and directory, without the `group` column.
    let mut keys: Vec<String> = std::fs::read_dir(server.object_path("lake", "events"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    keys.sort();
    let expected: Vec<String> = (0..7).map(|g| format!("group=g{g}")).collect();
    assert_eq!(keys, expected);
    let scan = discover(FileFormat::Parquet, &[&out]).unwrap();
    assert_eq!(scan.files.len(), 14);
    assert!(scan.file_schema.field_with_name("group").is_err());
    let (rows, _) = read_scan(&scan, 4096).unwrap();
    let mut ids = int_column(&rows, "id");
    ids.sort();
    assert_eq!(ids, (0..1_400).collect::<Vec<_>>());

    let plan = floe_core::plan::LogicalPlan::read(scan.clone())
        .unwrap()
        .filter(col("group").eq(lit("g3")))
        .unwrap();
    let optimized = floe_core::plan::optimizer::Optimizer::default()
        .optimize(&plan)
        .unwrap();
    let floe_core::plan::Operator::Read(pruned) = optimized.operator() else {
        panic!("the filter moves into the read: {optimized:?}");
    };
    assert_eq!(pruned.files.len(), 2);
    let (rows, stats) = read_scan(pruned, 4096).unwrap();
    assert_eq!(stats.files, 2);
    let mut ids = int_column(&rows, "id");
    ids.sort();
    assert_eq!(ids, (0..1_400).filter(|i| i % 7 == 3).collect::<Vec<_>>());
    let kept: u64 = pruned.files.iter().map(|stamp| stamp.size).sum();
    let everything: u64 = scan.files.iter().map(|stamp| stamp.size).sum();
    // Objects this small are fetched whole with their footer, then their column chunks
    // again: at most twice the kept objects, and nothing of the pruned ones.
    assert!(
        stats.bytes_fetched >= kept && stats.bytes_fetched <= 2 * kept && kept * 5 < everything,
        "fetched {} of the kept {kept} bytes, of {everything} in all",
        stats.bytes_fetched
    );

    // Text (a gzipped object too) and binary objects.
    let lines: String = (0..3_000).map(|i| format!("line {i}\n")).collect();
    put(server, local, "text/a.txt", |p| {
        std::fs::write(p, &lines).unwrap()
    });
    put(server, local, "text/b.txt.gz", |p| {
        let mut encoder = flate2::write::GzEncoder::new(
            std::fs::File::create(p).unwrap(),
            flate2::Compression::default(),
        );
        std::io::Write::write_all(&mut encoder, b"zipped\nlines\n").unwrap();
        encoder.finish().unwrap();
    });
    let (remote_rows, remote_stats) =
        read_scan(&discover(FileFormat::Text, &[url("text/")]).unwrap(), 4096).unwrap();
    let (local_rows, _) = read_scan(
        &discover(FileFormat::Text, &[local.join("text")]).unwrap(),
        4096,
    )
    .unwrap();
    assert_eq!(remote_rows, local_rows);
    assert_eq!(remote_stats.rows_out, 3_002);
    let (remote_files, _) = read_scan(
        &discover(FileFormat::Binary, &[url("text/")]).unwrap(),
        4096,
    )
    .unwrap();
    let bytes: Vec<Vec<u8>> = remote_files
        .iter()
        .flat_map(|batch| {
            let column = batch.column_by_name("bytes").unwrap();
            let column = arrow::array::AsArray::as_binary::<i32>(column);
            column
                .iter()
                .map(|b| b.unwrap().to_vec())
                .collect::<Vec<_>>()
        })
        .collect();
    let expected: Vec<Vec<u8>> = ["a.txt", "b.txt.gz"]
        .iter()
        .map(|name| std::fs::read(local.join("text").join(name)).unwrap())
        .collect();
    assert_eq!(bytes, expected);
    let paths =
        arrow::array::AsArray::as_string::<i32>(remote_files[0].column_by_name("path").unwrap())
            .value(0)
            .to_owned();
    assert_eq!(paths, "s3://lake/text/a.txt");
}

/// `http://` URLs: the same server serves its public bucket's objects unsigned, as any HTTP
/// server serves files (HEAD, ranged GET). Every reader reads them as the local files; a
/// Parquet read fetches only the projected column's ranges. Plain HTTP is read-only: a sink
/// there is refused before anything is written.
fn plain_http_reads(server: &S3Server, local: &Path) {
    let http = |key: &str| PathBuf::from(format!("{}/web/{key}", server.endpoint()));
    for key in ["data/a.parquet", "csv/x.csv", "text/a.txt", "text/b.txt.gz"] {
        server.put_file("web", key, &local.join(key));
    }

    let local_parquet = local.join("data/a.parquet");
    let remote = discover(FileFormat::Parquet, &[http("data/a.parquet")]).unwrap();
    let local_scan = discover(FileFormat::Parquet, &[&local_parquet]).unwrap();
    assert_eq!(remote.file_schema, local_scan.file_schema);
    assert!(
        remote.files[0].version.is_some(),
        "an HTTP object's stamp has its ETag"
    );
    let (rows, stats) = read_scan(&with_projection(&remote, &["id"]), 4096).unwrap();
    let (local_rows, _) = read_scan(&with_projection(&local_scan, &["id"]), 4096).unwrap();
    assert_eq!(int_column(&rows, "id"), int_column(&local_rows, "id"));
    let id_bytes = floe_testkit::files::parquet_column_bytes(&local_parquet, "id");
    assert!(
        stats.bytes_fetched >= id_bytes && stats.bytes_fetched < id_bytes + 70_000,
        "fetched {} over HTTP for a column of {id_bytes}",
        stats.bytes_fetched
    );

    let csv = FileFormat::Csv(CsvOptions::default());
    let (rows, _) = read_scan(&discover(csv.clone(), &[http("csv/x.csv")]).unwrap(), 128).unwrap();
    let (local_rows, _) =
        read_scan(&discover(csv, &[local.join("csv/x.csv")]).unwrap(), 128).unwrap();
    assert_eq!(rows, local_rows);

    for key in ["text/a.txt", "text/b.txt.gz"] {
        let (rows, _) =
            read_scan(&discover(FileFormat::Text, &[http(key)]).unwrap(), 4096).unwrap();
        let (local_rows, _) = read_scan(
            &discover(FileFormat::Text, &[local.join(key)]).unwrap(),
            4096,
        )
        .unwrap();
        assert_eq!(rows, local_rows, "{key}");
        let (files, _) =
            read_scan(&discover(FileFormat::Binary, &[http(key)]).unwrap(), 4096).unwrap();
        let bytes =
            arrow::array::AsArray::as_binary::<i32>(files[0].column_by_name("bytes").unwrap())
                .value(0)
                .to_vec();
        assert_eq!(bytes, std::fs::read(local.join(key)).unwrap(), "{key}");
    }

    // The public bucket is no way around the signature: an unsigned read of the other fails.
    let unsigned = PathBuf::from(format!("{}/lake/data/a.parquet", server.endpoint()));
    assert!(discover(FileFormat::Parquet, &[unsigned]).is_err());

    // A sink on plain HTTP is refused, and nothing reaches the server.
    let sink = spec(FileFormat::Parquet, http("out"), WriteMode::Overwrite);
    let error = write_job(&sink, "job8", &[sample(0, 10)])
        .unwrap_err()
        .to_string();
    assert!(error.contains("read-only"), "{error}");
    assert!(check_empty(&http("out")).is_err());
    assert!(!server.object_path("web", "out").exists());
    assert!(!server.root().join("web/.out.floe-job8").exists());
}
