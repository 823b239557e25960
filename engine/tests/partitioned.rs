//! Hive-partitioned datasets, text and binary files on local disk: what the sink writes is
//! checked against pyarrow's reading of it (needs `python3` with pyarrow, as
//! `tests/process_udf.rs` does) and against folds computed here; reads discover the partition
//! columns, and a filter on them drops directories before any file is opened, and out of the
//! fingerprint.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Int64Array, StringArray};
use arrow::datatypes::{DataType, Int64Type};
use arrow::record_batch::RecordBatch;
use floe_core::expr::{Expr, col, lit};
use floe_core::plan::optimizer::Optimizer;
use floe_core::plan::{
    Compression, FileFormat, FileScan, LogicalPlan, Operator, PartitionColumn, PartitionType,
    WriteMode, WriteSpec,
};
use floe_engine::read::{DiscoverOptions, Partitioning, discover, discover_with, read_scan};
use floe_engine::write::{publish, staging_directory, write_task};

/// The rows `start..start + rows`: `id`, `date` (three days, one of them null and one with
/// characters Hive escapes), `shard` = id % 2 and `value` = id * 3.
fn sample(start: i64, rows: i64) -> RecordBatch {
    let ids: Vec<i64> = (start..start + rows).collect();
    let date = |i: i64| match i % 3 {
        0 => Some("2026-11-30"),
        1 => Some("a/b=c%d"),
        _ => None,
    };
    RecordBatch::try_from_iter([
        ("id", Arc::new(Int64Array::from(ids.clone())) as ArrayRef),
        (
            "date",
            Arc::new(StringArray::from(
                ids.iter().map(|i| date(*i)).collect::<Vec<_>>(),
            )) as ArrayRef,
        ),
        (
            "shard",
            Arc::new(Int64Array::from_iter_values(ids.iter().map(|i| i % 2))) as ArrayRef,
        ),
        (
            "value",
            Arc::new(Int64Array::from_iter_values(ids.iter().map(|i| i * 3))) as ArrayRef,
        ),
    ])
    .unwrap()
}

/// Per `(date, shard)`: rows and the sum of `value`, folded from the input rows.
type Groups = BTreeMap<(Option<String>, i64), (i64, i64)>;

fn groups_of(batches: &[RecordBatch]) -> Groups {
    let mut groups = Groups::new();
    for batch in batches {
        let date = batch.column_by_name("date").unwrap().as_string::<i32>();
        let shard = batch
            .column_by_name("shard")
            .unwrap()
            .as_primitive::<Int64Type>();
        let value = batch
            .column_by_name("value")
            .unwrap()
            .as_primitive::<Int64Type>();
        for row in 0..batch.num_rows() {
            let key = (
                date.is_valid(row).then(|| date.value(row).to_owned()),
                shard.value(row),
            );
            let entry = groups.entry(key).or_default();
            entry.0 += 1;
            entry.1 += value.value(row);
        }
    }
    groups
}

fn sink(directory: &Path, mode: WriteMode) -> WriteSpec {
    WriteSpec {
        format: FileFormat::Parquet,
        directory: directory.to_owned(),
        target_file_size: 1 << 30,
        mode,
        compression: Compression::Zstd,
        partition_by: vec!["date".to_owned(), "shard".to_owned()],
    }
}

/// Runs one sink as a job does: every task writes into the staging directory, then it is
/// published by the sink's mode.
fn write_job(spec: &WriteSpec, token: &str, tasks: &[RecordBatch]) {
    let staging = staging_directory(&spec.directory, token);
    let staged = WriteSpec {
        directory: staging.clone(),
        ..spec.clone()
    };
    for (index, batch) in tasks.iter().enumerate() {
        write_task(&staged, index, batch.schema(), [Ok(batch.clone())]).unwrap();
    }
    publish(spec, &staging, token).unwrap();
}

/// Every visible file below `root`, relative to it.
fn files_below(root: &Path) -> Vec<String> {
    floe_engine::read::expand_paths(&[root])
        .unwrap()
        .iter()
        .map(|path| {
            path.strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

/// The read of `plan` after the optimizer's rules (the plan is a read under row-wise steps).
fn optimized_scan(plan: &LogicalPlan) -> FileScan {
    let mut node = Optimizer::default().optimize(plan).unwrap();
    loop {
        if let Operator::Read(scan) = node.operator() {
            return scan.clone();
        }
        node = node.inputs()[0].clone();
    }
}

fn filtered(scan: &FileScan, predicate: Expr) -> LogicalPlan {
    LogicalPlan::read(scan.clone())
        .unwrap()
        .filter(predicate)
        .unwrap()
}

/// `(date, shard) -> (rows, sum(value))` as pyarrow reads the Hive dataset at `root`.
fn pyarrow_groups(root: &Path) -> Groups {
    let script = r#"
import json, sys
import pyarrow.dataset as ds
table = ds.dataset(sys.argv[1], format="parquet", partitioning="hive").to_table()
assert table.schema.field("shard").type == "int32" or str(table.schema.field("shard").type).startswith("int"), table.schema
out = {}
for date, shard, value in zip(table["date"].to_pylist(), table["shard"].to_pylist(), table["value"].to_pylist()):
    key = json.dumps([date, shard])
    rows, total = out.get(key, (0, 0))
    out[key] = (rows + 1, total + value)
print(json.dumps(out))
"#;
    let output = Command::new("python3")
        .args(["-c", script])
        .arg(root)
        .output()
        .expect("python3 runs");
    assert!(
        output.status.success(),
        "pyarrow failed to read the dataset (is pyarrow installed?): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let parsed: BTreeMap<String, (i64, i64)> = serde_json::from_slice(&output.stdout).unwrap();
    parsed
        .into_iter()
        .map(|(key, counts)| {
            let (date, shard): (Option<String>, i64) = serde_json::from_str(&key).unwrap();
            ((date, shard), counts)
        })
        .collect()
}

#[test]
fn a_partitioned_sink_writes_hive_directories_that_pyarrow_and_floe_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("events");
    let tasks = [sample(0, 600), sample(600, 400)];
    write_job(&sink(&root, WriteMode::Error), "job1", &tasks);

    // Two tasks, three dates, two shards: one file per task and directory, escaped as Hive
    // escapes, the null date in the default partition.
    let mut expected = Vec::new();
    for date in ["2026-11-30", "__HIVE_DEFAULT_PARTITION__", "a%2Fb%3Dc%25d"] {
        for shard in 0..2 {
            for task in 0..2 {
                expected.push(format!(
                    "date={date}/shard={shard}/part-{task:05}-00000.parquet"
                ));
            }
        }
    }
    expected.sort();
    assert_eq!(files_below(&root), expected);

    // The files hold the other columns only.
    let one = std::fs::File::open(root.join(&expected[0])).unwrap();
    let footer = parquet::file::serialized_reader::SerializedFileReader::new(one).unwrap();
    let names: Vec<String> = parquet::file::reader::FileReader::metadata(&footer)
        .file_metadata()
        .schema_descr()
        .columns()
        .iter()
        .map(|column| column.name().to_owned())
        .collect();
    assert_eq!(names, ["id", "value"]);

    let truth = groups_of(&tasks);
    assert_eq!(truth.len(), 6);
    assert_eq!(pyarrow_groups(&root), truth);

    // floe discovers the columns: `shard` parses as integers everywhere, `date` does not.
    let scan = discover(FileFormat::Parquet, &[&root]).unwrap();
    assert_eq!(
        scan.partitioning,
        [
            PartitionColumn::new("date", PartitionType::Utf8),
            PartitionColumn::new("shard", PartitionType::Int64),
        ]
    );
    let plan = LogicalPlan::read(scan.clone()).unwrap();
    let names: Vec<&str> = plan
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().as_str())
        .collect();
    assert_eq!(names, ["id", "value", "date", "shard"]);
    let (batches, stats) = read_scan(&scan, 8192).unwrap();
    assert_eq!(stats.files, 12);
    assert_eq!(groups_of(&batches), truth);

    // Declared types win; a directory name the declaration lacks is refused.
    let declared = discover_with(
        FileFormat::Parquet,
        &[&root],
        &DiscoverOptions {
            partitioning: Partitioning::Declared(vec![
                PartitionColumn::new("date", PartitionType::Utf8),
                PartitionColumn::new("shard", PartitionType::Utf8),
            ]),
        },
    )
    .unwrap();
    let shard = declared
        .full_schema()
        .field_with_name("shard")
        .unwrap()
        .clone();
    assert_eq!(shard.data_type(), &DataType::Utf8);
    let error = discover_with(
        FileFormat::Parquet,
        &[&root],
        &DiscoverOptions {
            partitioning: Partitioning::Declared(vec![PartitionColumn::new(
                "date",
                PartitionType::Utf8,
            )]),
        },
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("not the declared [date]"), "{error}");
    // Ignored: the directories are plain directories again.
    let ignored = discover_with(
        FileFormat::Parquet,
        &[&root],
        &DiscoverOptions {
            partitioning: Partitioning::Ignore,
        },
    )
    .unwrap();
    assert!(ignored.partitioning.is_empty());

    // Append adds a file per directory under the job's name; overwrite replaces them all.
    write_job(&sink(&root, WriteMode::Append), "job2", &tasks[1..]);
    let files = files_below(&root);
    assert_eq!(files.len(), 18);
    assert!(files.contains(&"date=2026-11-30/shard=0/part-job2-00000-00000.parquet".to_owned()));
    let (batches, _) = read_scan(&discover(FileFormat::Parquet, &[&root]).unwrap(), 8192).unwrap();
    let doubled = groups_of(&[tasks[0].clone(), tasks[1].clone(), tasks[1].clone()]);
    assert_eq!(groups_of(&batches), doubled);
    write_job(&sink(&root, WriteMode::Overwrite), "job3", &tasks[..1]);
    assert_eq!(files_below(&root).len(), 6);
    assert_eq!(pyarrow_groups(&root), groups_of(&tasks[..1]));
}

#[test]
fn a_filter_on_partition_columns_prunes_directories_from_the_read_and_its_fingerprint() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("events");
    let tasks = [sample(0, 900)];
    write_job(&sink(&root, WriteMode::Error), "job1", &tasks);
    let scan = discover(FileFormat::Parquet, &[&root]).unwrap();
    assert_eq!(scan.files.len(), 6);

    let day = col("date").eq(lit("2026-11-30"));
    let pruned = optimized_scan(&filtered(&scan, day.clone()));
    assert_eq!(pruned.files.len(), 2);
    assert!(
        pruned
            .files
            .iter()
            .all(|f| f.path.to_string_lossy().contains("/date=2026-11-30/"))
    );
    let (batches, stats) = read_scan(&pruned, 8192).unwrap();
    // Only the kept directory's files are opened.
    assert_eq!(stats.files, 2);
    let ids: Vec<i64> = floe_testkit::batches::int_column(&batches, "id");
    let mut expected: Vec<i64> = (0..900).filter(|i| i % 3 == 0).collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    expected.sort_unstable();
    assert_eq!(sorted, expected);

    // Null partitions, integer comparisons, a conjunct on a file column (which prunes nothing
    // but still filters rows), and an `or` that keeps both of its sides.
    let cases: [(Expr, usize, i64); 4] = [
        (col("date").is_null(), 2, 300),
        (col("shard").eq(lit(1)).and(col("id").lt(lit(30))), 3, 15),
        (col("id").lt(lit(30)), 6, 30),
        (
            col("date").eq(lit("a/b=c%d")).or(col("shard").gt(lit(0))),
            4,
            (0..900).filter(|i| i % 3 == 1 || i % 2 == 1).count() as i64,
        ),
    ];
    for (predicate, files, rows) in cases {
        let pruned = optimized_scan(&filtered(&scan, predicate.clone()));
        assert_eq!(pruned.files.len(), files, "{predicate}");
        let (batches, stats) = read_scan(&pruned, 8192).unwrap();
        assert_eq!(stats.files, files, "{predicate}");
        let read: usize = batches.iter().map(RecordBatch::num_rows).sum();
        assert_eq!(read as i64, rows, "{predicate}");
    }
    // Every partition ruled out: nothing is opened, nothing is read.
    let none = optimized_scan(&filtered(&scan, col("shard").gt(lit(5))));
    assert!(none.files.is_empty());
    assert_eq!(read_scan(&none, 8192).unwrap().0.len(), 0);

    // The fingerprint covers the files read: rewriting a pruned partition's file leaves it,
    // rewriting a kept one changes it.
    let fingerprint = |scan: &FileScan| {
        Optimizer::default()
            .optimize(&filtered(scan, day.clone()))
            .unwrap()
            .fingerprint()
    };
    let before = fingerprint(&scan);
    let rewrite = |relative: &str| {
        let path = root.join(relative);
        let batches = floe_testkit::files::read_parquet_dir(path.parent().unwrap());
        // A different size as well as a later time, so the stamp surely changes.
        let more = arrow::compute::concat_batches(&batches[0].schema(), [&batches[0], &batches[0]])
            .unwrap();
        floe_testkit::files::write_parquet(&path, &more, None);
    };
    rewrite("date=__HIVE_DEFAULT_PARTITION__/shard=0/part-00000-00000.parquet");
    let rediscovered = discover(FileFormat::Parquet, &[&root]).unwrap();
    assert_ne!(
        LogicalPlan::read(rediscovered.clone())
            .unwrap()
            .fingerprint(),
        LogicalPlan::read(scan.clone()).unwrap().fingerprint()
    );
    assert_eq!(fingerprint(&rediscovered), before);
    rewrite("date=2026-11-30/shard=1/part-00000-00000.parquet");
    let rediscovered = discover(FileFormat::Parquet, &[&root]).unwrap();
    assert_ne!(fingerprint(&rediscovered), before);
}

#[test]
fn directories_of_different_keys_and_bad_values_are_refused_when_discovered() {
    let dir = tempfile::tempdir().unwrap();
    let batch = sample(0, 10).project(&[0, 3]).unwrap();
    let put = |relative: &str| {
        let path = dir.path().join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        floe_testkit::files::write_parquet(&path, &batch, None);
    };
    put("a/x=1/f.parquet");
    put("a/y=2/f.parquet");
    let error = discover(FileFormat::Parquet, &[dir.path().join("a")])
        .unwrap_err()
        .to_string();
    assert!(error.contains("partition directories name [y]"), "{error}");
    put("b/x=1/f.parquet");
    put("b/x=two/f.parquet");
    let scan = discover(FileFormat::Parquet, &[dir.path().join("b")]).unwrap();
    assert_eq!(
        scan.partitioning,
        [PartitionColumn::new("x", PartitionType::Utf8)]
    );
    let error = discover_with(
        FileFormat::Parquet,
        &[dir.path().join("b")],
        &DiscoverOptions {
            partitioning: Partitioning::Declared(vec![PartitionColumn::new(
                "x",
                PartitionType::Int64,
            )]),
        },
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("`two` of `x` is not an int64"), "{error}");
    // A partition column the files hold too is refused by the plan.
    put("c/id=1/f.parquet");
    let error = Box::new(
        LogicalPlan::read(discover(FileFormat::Parquet, &[dir.path().join("c")]).unwrap())
            .unwrap_err(),
    )
    .to_string();
    assert!(error.contains("also a column of the files"), "{error}");
}

#[test]
fn text_and_binary_files_read_one_row_per_line_and_per_file() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("a.txt");
    std::fs::write(&plain, "first line\r\n\nthird line\nno newline at the end").unwrap();
    let gzipped = dir.path().join("b.txt.gz");
    let mut encoder =
        flate2::write::GzEncoder::new(std::fs::File::create(&gzipped).unwrap(), Default::default());
    for i in 0..20_000 {
        writeln!(encoder, "line {i}").unwrap();
    }
    encoder.finish().unwrap();

    let scan = discover(FileFormat::Text, &[dir.path()]).unwrap();
    let (batches, stats) = read_scan(&scan, 8192).unwrap();
    assert_eq!(stats.files, 2);
    let lines: Vec<String> = batches
        .iter()
        .flat_map(|batch| {
            let text = batch.column_by_name("text").unwrap().as_string::<i32>();
            (0..text.len())
                .map(|i| text.value(i).to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    let mut expected: Vec<String> = ["first line", "", "third line", "no newline at the end"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    expected.extend((0..20_000).map(|i| format!("line {i}")));
    assert_eq!(lines, expected);
    // A limit stops reading; a predicate filters lines.
    let limited = FileScan {
        limit: Some(3),
        ..scan.clone()
    };
    assert_eq!(read_scan(&limited, 8192).unwrap().1.rows_out, 3);
    let filtered = FileScan {
        predicate: Some(col("text").eq(lit("line 7"))),
        ..scan.clone()
    };
    assert_eq!(read_scan(&filtered, 8192).unwrap().1.rows_out, 1);

    let not_utf8 = dir.path().join("bad").join("c.txt");
    std::fs::create_dir_all(not_utf8.parent().unwrap()).unwrap();
    std::fs::write(&not_utf8, b"ok\n\xff\xfe\n").unwrap();
    let error = read_scan(&discover(FileFormat::Text, &[&not_utf8]).unwrap(), 8192)
        .unwrap_err()
        .to_string();
    assert!(error.contains("line 2"), "{error}");

    let scan = discover(FileFormat::Binary, &[dir.path()]).unwrap();
    let (batches, _) = read_scan(&scan, 8192).unwrap();
    let mut found = BTreeMap::new();
    for batch in &batches {
        let paths = batch.column_by_name("path").unwrap().as_string::<i32>();
        let bytes = batch.column_by_name("bytes").unwrap().as_binary::<i32>();
        for row in 0..batch.num_rows() {
            found.insert(PathBuf::from(paths.value(row)), bytes.value(row).to_vec());
        }
    }
    let expected: BTreeMap<PathBuf, Vec<u8>> = [&plain, &gzipped, &not_utf8]
        .iter()
        .map(|path| {
            (
                std::fs::canonicalize(path).unwrap(),
                std::fs::read(path).unwrap(),
            )
        })
        .collect();
    assert_eq!(found, expected);
    // Text and binary files are sources only.
    let write = LogicalPlan::read(scan).unwrap().write(WriteSpec {
        format: FileFormat::Text,
        directory: dir.path().join("out"),
        target_file_size: 1 << 20,
        mode: WriteMode::Error,
        compression: Compression::Uncompressed,
        partition_by: Vec::new(),
    });
    assert!(write.is_err());
}
