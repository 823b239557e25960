//! Read and write kernels on real files.
// Test helpers outside #[test] functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, Float64Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use floe_core::expr::{col, lit};
use floe_core::plan::physical::PhysicalPlan;
use floe_core::plan::task::{FusedSource, SinkPart, StageInput, StageTask};
use floe_core::plan::{
    Compression, CsvOptions, FileFormat, FileScan, LogicalPlan, Operator, SortKey, WriteMode,
    WriteSpec, optimizer::Optimizer,
};
use floe_engine::read::{discover, expand_paths, read_scan};
use floe_engine::task::{TaskOutput, run_stage_task};
use floe_engine::udf::Registry;
use floe_engine::write::{file_name, write_task};

/// `rows` rows: id = i, group = "g{i % 3}", value = i * 0.5.
fn sample(start: i64, rows: i64) -> RecordBatch {
    let ids: Vec<i64> = (start..start + rows).collect();
    RecordBatch::try_from_iter([
        ("id", Arc::new(Int64Array::from(ids.clone())) as ArrayRef),
        (
            "group",
            Arc::new(StringArray::from_iter_values(
                ids.iter().map(|i| format!("g{}", i % 3)),
            )) as ArrayRef,
        ),
        (
            "value",
            Arc::new(Float64Array::from_iter_values(
                ids.iter().map(|i| *i as f64 * 0.5),
            )) as ArrayRef,
        ),
    ])
    .unwrap()
}

/// A Parquet file of 1000 rows in row groups of 100 (ids ascending, so each group's id
/// statistics are [100k, 100k + 99]).
fn write_parquet(path: &Path) {
    floe_testkit::files::write_parquet(path, &sample(0, 1000), Some(100));
}

fn ids(batches: &[RecordBatch]) -> Vec<i64> {
    batches
        .iter()
        .flat_map(|b| {
            b.column_by_name("id")
                .unwrap()
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .values()
                .to_vec()
        })
        .collect()
}

#[test]
fn parquet_pushdown_skips_row_groups_by_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data.parquet");
    write_parquet(&path);
    let scan = discover(FileFormat::Parquet, &[&path]).unwrap();
    assert_eq!(scan.files.len(), 1);
    let plan = LogicalPlan::read(scan)
        .unwrap()
        .filter(col("id").gt_eq(lit(250i64)).and(lit(420i64).gt(col("id"))))
        .unwrap()
        .select(&["id"])
        .unwrap();
    let optimized = Optimizer::default().optimize(&plan).unwrap();
    let mut node = optimized.clone();
    let scan = loop {
        match node.operator() {
            Operator::Read(scan) => break scan.clone(),
            _ => node = node.inputs()[0].clone(),
        }
    };
    assert_eq!(scan.projection, Some(vec!["id".to_owned()]));
    let (batches, stats) = read_scan(&scan, 64).unwrap();
    // Rows 250..420 live in groups 2, 3 and 4; the other 7 of 10 are skipped unread.
    assert_eq!(stats.row_groups, 10);
    assert_eq!(stats.row_groups_pruned, 7);
    assert_eq!(stats.rows_read, 300);
    assert_eq!(ids(&batches), (250..420).collect::<Vec<_>>());
    assert_eq!(batches[0].schema().fields().len(), 1);
    // An equality prunes to one group; a predicate on a column without usable bounds
    // (a string function) prunes nothing but still filters.
    let equal = FileScan {
        predicate: Some(col("id").eq(lit(777i64))),
        ..scan.clone()
    };
    let (batches, stats) = read_scan(&equal, 64).unwrap();
    assert_eq!((stats.row_groups_pruned, ids(&batches)), (9, vec![777]));
    let opaque = FileScan {
        projection: None,
        predicate: Some(col("group").starts_with("g1").and(col("id").lt(lit(10i64)))),
        ..scan.clone()
    };
    let (batches, stats) = read_scan(&opaque, 64).unwrap();
    assert_eq!((stats.row_groups_pruned, ids(&batches)), (9, vec![1, 4, 7]));
    // A limit stops reading early.
    let limited = FileScan {
        predicate: None,
        limit: Some(5),
        ..scan
    };
    let (batches, _) = read_scan(&limited, 64).unwrap();
    assert_eq!(ids(&batches), vec![0, 1, 2, 3, 4]);
}

#[test]
fn csv_and_ndjson_read_with_projection_from_directories_and_globs() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("a.csv"),
        "id,name,score\n1,ann,2.5\n2,bob,\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("b.csv"), "id,name,score\n3,cy,1.0\n").unwrap();
    std::fs::write(dir.path().join("_SUCCESS"), "").unwrap();
    std::fs::write(dir.path().join(".tmp-part.csv"), "garbage").unwrap();
    std::fs::write(
        dir.path().join("rows.json"),
        "{\"id\": 1, \"tags\": \"x\", \"extra\": true}\n{\"id\": 2, \"tags\": null}\n",
    )
    .unwrap();
    let csv_glob = dir.path().join("*.csv");
    assert_eq!(expand_paths(&[&csv_glob]).unwrap().len(), 2);
    // Hidden and underscore files are skipped in directories.
    assert_eq!(expand_paths(&[dir.path()]).unwrap().len(), 3);
    assert!(expand_paths(&[dir.path().join("*.parquet")]).is_err());

    let scan = discover(FileFormat::Csv(CsvOptions::default()), &[&csv_glob]).unwrap();
    assert_eq!(
        scan.file_schema,
        Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("name", DataType::Utf8, true),
            Field::new("score", DataType::Float64, true),
        ])
    );
    let projected = FileScan {
        projection: Some(vec!["score".to_owned(), "id".to_owned()]),
        ..scan
    };
    let (batches, stats) = read_scan(&projected, 1024).unwrap();
    assert_eq!(stats.files, 2);
    assert_eq!(ids(&batches), vec![1, 2, 3]);
    let scores: Vec<Option<f64>> = batches
        .iter()
        .flat_map(|b| {
            b.column(1)
                .as_any()
                .downcast_ref::<Float64Array>()
                .unwrap()
                .iter()
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(scores, vec![Some(2.5), None, Some(1.0)]);
    assert_eq!(batches[0].schema().field(0).name(), "id");

    let json = discover(FileFormat::Json, &[dir.path().join("rows.json")]).unwrap();
    let json = FileScan {
        projection: Some(vec!["id".to_owned(), "tags".to_owned()]),
        ..json
    };
    let (batches, _) = read_scan(&json, 1024).unwrap();
    assert_eq!(ids(&batches), vec![1, 2]);
    assert_eq!(batches[0].num_columns(), 2);
    assert_eq!(batches[0].column(1).null_count(), 1);
}

/// A limit stops the reader itself: the rows after it are never decoded, and files after the
/// one that reached it are never opened.
#[test]
fn a_limit_stops_decoding_early() {
    let dir = tempfile::tempdir().unwrap();
    write_parquet(&dir.path().join("a.parquet"));
    write_parquet(&dir.path().join("b.parquet"));
    let scan = discover(FileFormat::Parquet, &[dir.path()]).unwrap();
    let (_, everything) = read_scan(&scan, 50).unwrap();
    assert_eq!((everything.files, everything.rows_read), (2, 2000));

    let limited = FileScan {
        limit: Some(150),
        ..scan.clone()
    };
    let (batches, stats) = read_scan(&limited, 50).unwrap();
    assert_eq!(ids(&batches), (0..150).collect::<Vec<_>>());
    // Three batches of 50 rows from the first file's first two row groups, nothing more.
    assert_eq!((stats.files, stats.rows_read), (1, 150));

    // With a predicate, the limit counts matching rows: groups 0..5 are skipped by their
    // statistics and one batch of group 5 already holds the 30 rows.
    let filtered = FileScan {
        predicate: Some(col("id").gt_eq(lit(500i64))),
        limit: Some(30),
        ..scan
    };
    let (batches, stats) = read_scan(&filtered, 50).unwrap();
    assert_eq!(ids(&batches), (500..530).collect::<Vec<_>>());
    assert_eq!(
        (stats.files, stats.row_groups_pruned, stats.rows_read),
        (1, 5, 50)
    );
}

/// Every NDJSON file's inferred types are checked against the first file's when the scan is
/// built; the error names both files, the column and the types.
#[test]
fn mismatched_ndjson_files_are_refused_when_the_plan_is_built() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.json");
    std::fs::write(&a, "{\"id\": 1, \"score\": 1.5, \"tag\": \"x\"}\n").unwrap();
    // A later file may lack a key or hold only nulls in it: those read as nulls.
    std::fs::write(dir.path().join("b.json"), "{\"id\": 2, \"tag\": null}\n").unwrap();
    let scan = discover(FileFormat::Json, &[dir.path().join("*.json")]).unwrap();
    assert_eq!(
        scan.file_schema,
        Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("score", DataType::Float64, true),
            Field::new("tag", DataType::Utf8, true),
        ])
    );
    let (batches, _) = read_scan(&scan, 64).unwrap();
    assert_eq!(ids(&batches), vec![1, 2]);
    assert_eq!(
        batches
            .iter()
            .map(|b| b.column(1).null_count())
            .sum::<usize>(),
        1
    );

    let c = dir.path().join("c.json");
    std::fs::write(&c, "{\"id\": 3, \"score\": \"high\"}\n").unwrap();
    let error = discover(FileFormat::Json, &[dir.path().join("*.json")]).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "{}: column `score` is Utf8 here but Float64 in the first file {}",
            c.display(),
            a.display()
        )
    );

    std::fs::write(&c, "{\"id\": 3, \"rank\": 7}\n").unwrap();
    let error = discover(FileFormat::Json, &[dir.path().join("*.json")]).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "{}: column `rank` (Int64) is not in the first file {}, whose columns are \
             [id Int64, score Float64, tag Utf8]",
            c.display(),
            a.display()
        )
    );
}

#[test]
fn changed_files_and_mismatched_parquet_schemas_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data.parquet");
    write_parquet(&path);
    let other = dir.path().join("other.parquet");
    let batch =
        RecordBatch::try_from_iter([("id", Arc::new(StringArray::from(vec!["x"])) as ArrayRef)])
            .unwrap();
    floe_testkit::files::write_parquet(&other, &batch, None);
    let error = discover(FileFormat::Parquet, &[&path, &other]).unwrap_err();
    assert!(
        error.to_string().contains("differs from the first file's"),
        "{error}"
    );

    std::fs::write(dir.path().join("a.csv"), "id,name\n1,x\n").unwrap();
    std::fs::write(dir.path().join("b.csv"), "id,title\n2,y\n").unwrap();
    let error = discover(
        FileFormat::Csv(CsvOptions::default()),
        &[dir.path().join("*.csv")],
    )
    .unwrap_err();
    assert!(
        error
            .to_string()
            .ends_with("b.csv: columns [id, title] differ from the first file's [id, name]"),
        "{error}"
    );

    let scan = discover(FileFormat::Parquet, &[&path]).unwrap();
    std::fs::write(&path, b"not parquet any more").unwrap();
    let error = read_scan(&scan, 64).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("changed after the plan was built"),
        "{error}"
    );
}

fn spec(format: FileFormat, dir: &Path, target: u64) -> WriteSpec {
    WriteSpec {
        compression: Compression::default_for(&format),
        partition_by: Vec::new(),
        format,
        directory: dir.to_owned(),
        target_file_size: target,
        mode: WriteMode::Error,
    }
}

#[test]
fn writes_are_deterministic_cut_at_the_target_size_and_read_back() {
    for format in [
        FileFormat::Parquet,
        FileFormat::Csv(CsvOptions::default()),
        FileFormat::Json,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let batches: Vec<RecordBatch> = (0..4).map(|i| sample(i * 10, 10)).collect();
        let one_batch = batches[0].get_array_memory_size() as u64;
        // Each file passes the target after two batches.
        let written = write_task(
            &spec(format.clone(), &out, one_batch * 2),
            3,
            batches[0].schema(),
            batches.iter().cloned().map(Ok),
        )
        .unwrap();
        let ext = format.name();
        let names: Vec<String> = written
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            vec![
                format!("part-00003-00000.{ext}"),
                format!("part-00003-00001.{ext}")
            ]
        );
        let mut listing: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        listing.sort();
        assert_eq!(listing, names, "no temporary files remain");
        let scan = discover(format, &[&out]).unwrap();
        let (read, _) = read_scan(&scan, 1024).unwrap();
        assert_eq!(ids(&read), (0..40).collect::<Vec<_>>());
    }
}

#[test]
fn a_failed_write_leaves_no_visible_files() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let batches = vec![
        Ok(sample(0, 10)),
        Ok(sample(10, 10)),
        Err(floe_engine::Error::NoFiles(
            "simulated upstream failure".to_owned(),
        )),
    ];
    let error = write_task(
        &spec(FileFormat::Parquet, &out, 1),
        0,
        sample(0, 1).schema(),
        batches,
    )
    .unwrap_err();
    assert!(error.to_string().contains("simulated upstream failure"));
    let leftovers: Vec<_> = std::fs::read_dir(&out).unwrap().collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_symlink_planted_at_a_temporary_name_is_replaced_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let victim = dir.path().join("victim.txt");
    std::fs::write(&victim, "keep me").unwrap();
    let temporary = out.join(format!(".tmp-{}", file_name(&FileFormat::Json, 0, 0)));
    std::os::unix::fs::symlink(&victim, &temporary).unwrap();

    let written = write_task(
        &spec(FileFormat::Json, &out, 1 << 20),
        0,
        sample(0, 1).schema(),
        vec![Ok(sample(0, 10))],
    )
    .unwrap();
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");
    assert_eq!(written.len(), 1);
    assert!(
        !std::fs::symlink_metadata(&written[0])
            .unwrap()
            .file_type()
            .is_symlink()
    );
}

#[test]
fn gzip_and_zstd_csv_and_json_read_as_the_plain_files() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let batch = sample(0, 300);
    for (format, plain_name) in [
        (FileFormat::Csv(CsvOptions::default()), "data.csv"),
        (FileFormat::Json, "data.json"),
    ] {
        let plain = dir.path().join(plain_name);
        let mut bytes = Vec::new();
        match &format {
            FileFormat::Json => {
                let mut writer = arrow::json::LineDelimitedWriter::new(&mut bytes);
                writer.write(&batch).unwrap();
                writer.finish().unwrap();
            }
            _ => arrow::csv::Writer::new(&mut bytes).write(&batch).unwrap(),
        }
        std::fs::write(&plain, &bytes).unwrap();
        let gzip = dir.path().join(format!("{plain_name}.gz"));
        let mut encoder = flate2::write::GzEncoder::new(
            std::fs::File::create(&gzip).unwrap(),
            Default::default(),
        );
        encoder.write_all(&bytes).unwrap();
        encoder.finish().unwrap();
        let zstd = dir.path().join(format!("{plain_name}.zst"));
        std::fs::write(&zstd, zstd::encode_all(bytes.as_slice(), 3).unwrap()).unwrap();

        let (expected, _) = read_scan(&discover(format.clone(), &[&plain]).unwrap(), 64).unwrap();
        for compressed in [&gzip, &zstd] {
            let scan = discover(format.clone(), &[compressed]).unwrap();
            let (rows, _) = read_scan(&scan, 64).unwrap();
            assert_eq!(rows, expected, "{}", compressed.display());
        }
    }
}

/// A task of `plan`'s output stage on `input`, writing what it makes as part 4 of a Parquet
/// sink in `dir`.
fn task_writing(plan: &LogicalPlan, input: StageInput, dir: &Path) -> StageTask {
    let physical = PhysicalPlan::from_logical(plan);
    let stage = physical.stage(physical.output).clone();
    let input_schemas = stage
        .inputs
        .iter()
        .map(|input| physical.stage(*input).schema.clone())
        .collect();
    StageTask {
        stage,
        input,
        input_schemas,
        min_block_bytes: 1,
        max_block_bytes: 1 << 20,
        batch_rows: 16,
        sink: Some(SinkPart {
            spec: spec(FileFormat::Parquet, dir, 1 << 30),
            index: 4,
        }),
        source: None,
    }
}

#[test]
fn a_task_with_a_fused_sink_writes_its_rows_as_its_part_and_returns_their_count() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let plan = LogicalPlan::range(100).unwrap();
    let task = task_writing(&plan, StageInput::Range { start: 10, end: 50 }, &out);
    let registry = Registry::with_builtins();
    let output = run_stage_task(&task, Vec::new(), &registry, &[]).unwrap();
    assert!(
        matches!(output, TaskOutput::Written { rows: 40 }),
        "{output:?}"
    );
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["part-00004-00000.parquet".to_owned()]);
    let (read, _) = read_scan(&discover(FileFormat::Parquet, &[&out]).unwrap(), 1024).unwrap();
    assert_eq!(ids(&read), (10..50).collect::<Vec<_>>());

    // A shuffle's map side makes partitions for the reduces, not rows of the output: it is
    // refused a sink, and writes nothing.
    let elsewhere = dir.path().join("map");
    let shuffled = plan.repartition(2, &["id"]).unwrap();
    let map = task_writing(
        &shuffled,
        StageInput::Partition {
            partitions: 2,
            side: 0,
            offset: 0,
            total: 10,
            seed: 0,
        },
        &elsewhere,
    );
    let blocks = floe_engine::task::range_batches(0, 10, 16).unwrap();
    let refused = run_stage_task(&map, vec![blocks], &registry, &[]).unwrap_err();
    assert!(refused.to_string().contains("no output rows"), "{refused}");
    assert!(!elsewhere.exists());
}

/// A sort's or a random shuffle's reduce with a fused sink writes its partition through the
/// chunked gather: the file holds the rows in the order the whole-partition kernels give
/// (`a_reordered_partition_is_gathered_into_blocks_under_the_mapping_threshold` crosses
/// chunks with the same gather).
#[test]
fn a_reordering_reduce_writes_its_sink_in_the_order_of_the_whole_partition() {
    let rows = 150_000i64;
    let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
    // A permutation of 0..rows in three blocks, one per map task.
    let blocks: Vec<RecordBatch> = (0..3)
        .map(|block| {
            let ids = (block * rows / 3..(block + 1) * rows / 3).map(|i| i * 7919 % rows);
            RecordBatch::try_new(
                schema.clone(),
                vec![Arc::new(Int64Array::from_iter_values(ids))],
            )
            .unwrap()
        })
        .collect();
    let registry = Registry::with_builtins();
    let dir = tempfile::tempdir().unwrap();
    let range = LogicalPlan::range(rows as u64).unwrap();
    let reduce = StageInput::Reduce {
        partition: 0,
        left: 0,
        seed: 99,
    };
    let permuted = floe_engine::exchange::random::interleave(&blocks, &schema, 99).unwrap();
    for (name, plan, expected) in [
        (
            "sorted",
            range.sort(vec![SortKey::asc("id")]).unwrap(),
            (0..rows).collect::<Vec<_>>(),
        ),
        (
            "shuffled",
            range.random_shuffle(Some(5)).unwrap(),
            ids(std::slice::from_ref(&permuted)),
        ),
    ] {
        let out = dir.path().join(name);
        let task = task_writing(&plan, reduce, &out);
        let inputs = blocks.iter().map(|block| vec![block.clone()]).collect();
        let output = run_stage_task(&task, inputs, &registry, &[]).unwrap();
        assert!(
            matches!(output, TaskOutput::Written { rows: written } if written == rows as u64),
            "{name}: {output:?}"
        );
        let (read, _) = read_scan(&discover(FileFormat::Parquet, &[&out]).unwrap(), 4096).unwrap();
        assert_eq!(ids(&read), expected, "{name}");
    }
    // The permutation is not the identity, so the shuffled check compares an order.
    assert_ne!(ids(&[permuted]), ids(&blocks));
}

/// A random shuffle's map task over a file of `sample(0, 1000)`, read by the task itself.
fn map_task_reading(path: &Path, input: StageInput) -> StageTask {
    let scan = discover(FileFormat::Parquet, &[path]).unwrap();
    let plan = LogicalPlan::read(scan)
        .unwrap()
        .random_shuffle(Some(3))
        .unwrap();
    let physical = PhysicalPlan::from_logical(&plan);
    let shuffle = physical.stage(physical.output).clone();
    let read = physical.stage(shuffle.inputs[0]).clone();
    StageTask {
        input_schemas: vec![read.schema.clone()],
        stage: shuffle,
        input,
        min_block_bytes: 1,
        max_block_bytes: 1 << 20,
        batch_rows: 64,
        sink: None,
        source: Some(FusedSource {
            stage: read,
            input: StageInput::File(0),
        }),
    }
}

#[test]
fn a_map_task_with_a_fused_read_splits_the_rows_it_reads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.parquet");
    write_parquet(&path);
    let registry = Registry::with_builtins();
    let split = StageInput::Partition {
        partitions: 3,
        side: 0,
        offset: 0,
        total: 0,
        seed: 11,
    };
    let task = map_task_reading(&path, split);
    let TaskOutput::Partitions(parts) = run_stage_task(&task, Vec::new(), &registry, &[]).unwrap()
    else {
        panic!("a map task makes partitions");
    };
    assert_eq!(parts.len(), 3);
    let parts: Vec<RecordBatch> = parts
        .into_batches()
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    assert!(parts.iter().all(|part| part.num_rows() > 0));
    let mut ids: Vec<i64> = parts
        .iter()
        .flat_map(|part| {
            let ids = part.column_by_name("id").unwrap();
            ids.as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .values()
                .to_vec()
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..1000).collect::<Vec<_>>());

    // Only a map side reads a fused source, and from nothing else.
    let reduce = StageInput::Reduce {
        partition: 0,
        left: 1,
        seed: 11,
    };
    let refused = run_stage_task(&map_task_reading(&path, reduce), Vec::new(), &registry, &[]);
    let message = refused.unwrap_err().to_string();
    assert!(
        message.contains("only a shuffle's map side reads a fused source"),
        "{message}"
    );
    let blocks = vec![vec![sample(0, 3)]];
    let refused = run_stage_task(&task, blocks, &registry, &[])
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("it takes no input blocks but a sort's boundaries"),
        "{refused}"
    );
}
