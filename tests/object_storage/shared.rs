//! What the object-storage cluster tests share: data, a cluster's jobs against the server,
//! and the check that its keys show up in no REST answer, job record or log.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{ArrayRef, Float64Array, Int64Array, StringArray};
use arrow::record_batch::RecordBatch;
use floe_client::{AggFunction, Aggregation, Client, Dataset, SortKey, WriteOptions};
use floe_testkit::batches::int_column;
use floe_testkit::cluster::{READY_TIMEOUT, TestCluster, TestClusterConfig, runtime};
use floe_testkit::s3::{ACCESS_KEY, S3Server, SECRET_KEY};

const FILES: i64 = 3;
const ROWS_PER_FILE: i64 = 4_000;

/// id, key = id % 5, value = id * 2 (as a float, exact in f64).
fn rows(start: i64, count: i64) -> RecordBatch {
    let ids: Vec<i64> = (start..start + count).collect();
    RecordBatch::try_from_iter([
        ("id", Arc::new(Int64Array::from(ids.clone())) as ArrayRef),
        (
            "key",
            Arc::new(Int64Array::from_iter_values(ids.iter().map(|i| i % 5))) as ArrayRef,
        ),
        (
            "label",
            Arc::new(StringArray::from_iter_values(
                ids.iter().map(|i| format!("row-{i}")),
            )) as ArrayRef,
        ),
        (
            "value",
            Arc::new(Float64Array::from_iter_values(
                ids.iter().map(|i| (*i * 2) as f64),
            )) as ArrayRef,
        ),
    ])
    .unwrap()
}

/// Writes a file under `local` and uploads it as object `key`, as another writer would have.
fn put(server: &S3Server, local: &Path, key: &str, write: impl FnOnce(&Path)) {
    let path = local.join(key);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    write(&path);
    server.put_file("lake", key, &path);
}

/// Every file under `dir`, recursively.
fn files_below(dir: &Path) -> Vec<PathBuf> {
    let mut pending = vec![dir.to_owned()];
    let mut files = Vec::new();
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files
}

/// Runs jobs that read and write `server` on a cluster whose processes also take
/// `settings`, checks their results, and greps every REST answer, job record and log for the
/// server's keys.
pub fn a_cluster_reads_and_writes_s3_and_never_shows_the_keys(
    server: &S3Server,
    settings: &[String],
) {
    let local = tempfile::tempdir().unwrap();
    for file in 0..FILES {
        put(
            server,
            local.path(),
            &format!("allowed/in/part-{file}.parquet"),
            |p| {
                floe_testkit::files::write_parquet(
                    p,
                    &rows(file * ROWS_PER_FILE, ROWS_PER_FILE),
                    Some(1_000),
                )
            },
        );
    }
    put(server, local.path(), "allowed/csv/data.csv", |p| {
        let mut writer = arrow::csv::Writer::new(std::fs::File::create(p).unwrap());
        writer.write(&rows(0, 900)).unwrap();
    });
    put(server, local.path(), "secret/x.parquet", |p| {
        floe_testkit::files::write_parquet(p, &rows(0, 10), None)
    });

    let runtime = runtime();
    let config = TestClusterConfig {
        settings: [
            vec!["data.allowed_paths=s3://lake/allowed".to_owned()],
            settings.to_vec(),
        ]
        .concat(),
        ..TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"))
    };
    let cluster = runtime.block_on(TestCluster::start(config, 2));
    let token = cluster.config.token().to_owned();
    let all_ids: Vec<i64> = (0..FILES * ROWS_PER_FILE).collect();

    runtime.block_on(async {
        let client = Client::connect(&cluster.schedulers.addrs(), &token)
            .await
            .unwrap();

        // A groupby over the Parquet objects: count and sums per key, computed here too.
        let grouped = Dataset::read_parquet(&["s3://lake/allowed/in/"])
            .unwrap()
            .groupby(&["key"])
            .agg(vec![
                Aggregation::count_rows("n"),
                Aggregation::of(AggFunction::Sum, "id"),
            ])
            .unwrap()
            .sort(vec![SortKey::asc("key")])
            .unwrap();
        let output = client.submit(&grouped).await.unwrap().wait().await.unwrap();
        let batches = output.to_arrow().await.unwrap();
        assert_eq!(int_column(&batches, "key"), vec![0, 1, 2, 3, 4]);
        let expected_n: Vec<i64> = (0..5)
            .map(|k| all_ids.iter().filter(|i| *i % 5 == k).count() as i64)
            .collect();
        let expected_sum: Vec<i64> = (0..5)
            .map(|k| all_ids.iter().filter(|i| *i % 5 == k).sum())
            .collect();
        assert_eq!(int_column(&batches, "n"), expected_n);
        let sum_column = batches[0].schema().field(2).name().clone();
        assert_eq!(int_column(&batches, &sum_column), expected_sum);

        // A map over the CSV object written to S3 as Parquet by the nodes, read back from the
        // server's disk with no floe code involved.
        let written = Dataset::read_csv(&["s3://lake/allowed/csv/data.csv"])
            .unwrap()
            .filter(floe_client::col("key").eq(floe_client::lit(3i64)))
            .unwrap()
            .write_parquet("s3://lake/allowed/out", WriteOptions::default())
            .unwrap();
        client.submit(&written).await.unwrap().wait().await.unwrap();
        let out = server.object_path("lake", "allowed/out");
        let visible: Vec<PathBuf> = files_below(&out)
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
            .collect();
        assert!(!visible.is_empty());
        let mut ids: Vec<i64> = visible
            .iter()
            .flat_map(|p| {
                let file = std::fs::File::open(p).unwrap();
                parquet::arrow::arrow_reader::ParquetRecordBatchReader::try_new(file, 1024)
                    .unwrap()
                    .map(Result::unwrap)
                    .collect::<Vec<_>>()
            })
            .flat_map(|b| int_column(&[b], "id"))
            .collect();
        ids.sort();
        assert_eq!(ids, (0..900).filter(|i| i % 5 == 3).collect::<Vec<_>>());
        let staging_left: Vec<_> = std::fs::read_dir(server.object_path("lake", "allowed"))
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
            .filter(|e| !files_below(&e.path()).is_empty())
            .collect();
        assert!(staging_left.is_empty(), "{staging_left:?}");

        // A read outside the allowed prefix is refused.
        let outside = Dataset::read_parquet(&["s3://lake/secret/x.parquet"]).unwrap();
        let handle = client.submit(&outside).await.unwrap();
        assert!(handle.wait().await.is_err());
        let error = handle.error().await.unwrap().unwrap_or_default();
        assert!(error.contains("outside data.allowed_paths"), "{error}");
    });

    // The keys are in no REST answer, no job record and no log.
    let http = cluster.schedulers.http_addr(1).unwrap().to_owned();
    // The REST view follows the replicated state; wait until it shows the three jobs ended.
    let jobs = floe_testkit::http::wait_for("the jobs in REST", READY_TIMEOUT, || {
        let jobs = floe_testkit::http::get(&http, "/api/jobs", &token);
        let ended = jobs.json()["jobs"].as_array().is_some_and(|jobs| {
            jobs.len() == 3 && jobs.iter().all(|j| j["ended_at_ms"].is_number())
        });
        ended.then_some(jobs)
    });
    let mut texts = vec![jobs.body];
    for id in 1..=3 {
        let job = floe_testkit::http::get(&http, &format!("/api/jobs/{id}"), &token);
        assert_eq!(job.status, 200, "{}", job.body);
        texts.push(job.body);
    }
    for file in files_below(cluster.dir.path()) {
        if let Ok(bytes) = std::fs::read(&file) {
            texts.push(String::from_utf8_lossy(&bytes).into_owned());
        }
    }
    for text in &texts {
        assert!(
            !text.contains(SECRET_KEY),
            "the secret key leaked: {text:.2000}"
        );
        assert!(
            !text.contains(ACCESS_KEY),
            "the access key leaked: {text:.2000}"
        );
    }
}
