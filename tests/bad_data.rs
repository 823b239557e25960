//! Bad input data on a real cluster: Parquet files that are corrupt, truncated, fail their
//! page checksums or disagree on the schema, and a cast that cannot succeed. Each is refused
//! with an error naming the file (or the value), and the cluster then runs a job correctly.
//! Also: every Parquet codec in common use (snappy, zstd, gzip, lz4) reads back exactly.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use floe_client::{
    AggFunction, Aggregation, Client, Dataset, JobOptions, LocalCluster, LocalClusterOptions, col,
};
use floe_testkit::files::{write_parquet, write_parquet_with};
use parquet::basic::{Compression, GzipLevel, ZstdLevel};
use parquet::file::properties::WriterProperties;

const ROWS: i64 = 200_000;

fn write(path: &Path, compression: Compression, ids: &Int64Array) {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("label", DataType::Utf8, false),
    ]));
    let labels = StringArray::from_iter_values(ids.values().iter().map(|id| format!("row-{id}")));
    let batch =
        RecordBatch::try_new(schema, vec![Arc::new(ids.clone()), Arc::new(labels)]).unwrap();
    let properties = WriterProperties::builder()
        .set_compression(compression)
        .set_max_row_group_row_count(Some(50_000))
        .build();
    write_parquet_with(path, &batch, properties);
}

fn ids() -> Int64Array {
    Int64Array::from_iter_values(0..ROWS)
}

/// `sum(id)` of the files, run on the cluster with no retries and no cache.
async fn sum_ids(client: &Client, files: &[PathBuf]) -> Result<i64, String> {
    let dataset = Dataset::read_parquet(files)
        .map_err(|error| error.to_string())?
        .groupby(&[])
        .agg(vec![Aggregation::of(AggFunction::Sum, "id").alias("total")])
        .unwrap();
    let options = JobOptions {
        cache: floe_client::CacheMode::NoCache,
        max_task_retries: 0,
        ..JobOptions::default()
    };
    let handle = client.submit_with(&dataset, options).await.unwrap();
    match handle.wait().await {
        Ok(output) => {
            let batches = output.to_arrow().await.unwrap();
            let batch = batches.iter().find(|b| b.num_rows() > 0).unwrap();
            let totals = batch
                .column_by_name("total")
                .unwrap()
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .clone();
            Ok(totals.value(0))
        }
        Err(_) => Err(handle.error().await.unwrap().unwrap_or_default()),
    }
}

/// Flips bytes between 20% and 70% of the file: inside the data pages, away from the footer.
fn corrupt(from: &Path, to: &Path) {
    let mut bytes = std::fs::read(from).unwrap();
    let (start, end) = (bytes.len() / 5, bytes.len() * 7 / 10);
    for index in (start..end).step_by(4099) {
        bytes[index] ^= 0x5a;
    }
    std::fs::write(to, bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_parquet_is_refused_naming_the_file_and_the_cluster_keeps_serving() {
    let cluster = LocalCluster::start(LocalClusterOptions::new(
        1,
        env!("CARGO_BIN_EXE_floe").into(),
    ))
    .await
    .unwrap();
    let client = cluster.connect().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let expected: i64 = (0..ROWS).sum();

    // Every common codec reads back exactly.
    let codecs = [
        ("snappy", Compression::SNAPPY),
        ("zstd", Compression::ZSTD(ZstdLevel::default())),
        ("gzip", Compression::GZIP(GzipLevel::default())),
        ("lz4", Compression::LZ4_RAW),
    ];
    for (name, compression) in codecs {
        let file = path(&format!("{name}.parquet"));
        write(&file, compression, &ids());
        assert_eq!(sum_ids(&client, &[file]).await, Ok(expected), "{name}");
    }

    // Corrupt data pages fail the job; the error names the file.
    corrupt(&path("snappy.parquet"), &path("corrupt.parquet"));
    let error = sum_ids(&client, &[path("corrupt.parquet")])
        .await
        .unwrap_err();
    assert!(
        error.contains(path("corrupt.parquet").to_str().unwrap()),
        "{error}"
    );

    // A truncated file, and files whose schemas differ, are refused when the plan is built,
    // before anything is submitted.
    let whole = std::fs::read(path("snappy.parquet")).unwrap();
    std::fs::write(path("truncated.parquet"), &whole[..whole.len() / 2]).unwrap();
    let error = sum_ids(&client, &[path("truncated.parquet")])
        .await
        .unwrap_err();
    assert!(error.contains("truncated.parquet"), "{error}");
    let text_ids = Arc::new(Schema::new(vec![Field::new("id", DataType::Utf8, false)]));
    let batch =
        RecordBatch::try_new(text_ids, vec![Arc::new(StringArray::from(vec!["a", "b"]))]).unwrap();
    write_parquet(&path("text.parquet"), &batch, None);
    let error = sum_ids(&client, &[path("snappy.parquet"), path("text.parquet")])
        .await
        .unwrap_err();
    assert!(
        error.contains("text.parquet") && error.contains("differs from the first file's"),
        "{error}"
    );

    // A cast between types that never convert is refused while the plan is built, naming
    // both types; a value that does not fit its target becomes null, on the cluster too.
    let list = DataType::List(Arc::new(Field::new("item", DataType::Int64, true)));
    let bad_cast = Dataset::read_parquet(&[path("snappy.parquet")])
        .unwrap()
        .with_column("listed", col("label").cast(list));
    let error = bad_cast.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        error.contains("cannot cast col(\"label\") from Utf8 to List"),
        "{error:?}"
    );
    // A strict cast of text that is no number fails the job, naming the value; `try_cast`
    // makes it null instead.
    let unparsable = Dataset::read_parquet(&[path("snappy.parquet")])
        .unwrap()
        .with_column("number", col("label").cast(DataType::Int64))
        .unwrap();
    let failed = client.submit(&unparsable).await.unwrap().wait().await;
    let error = failed.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        error.contains("cast(col(\"label\") as Int64): \"row-0\" does not convert to Int64"),
        "{error}"
    );
    let tried = Dataset::read_parquet(&[path("snappy.parquet")])
        .unwrap()
        .with_column("number", col("label").try_cast(DataType::Int64))
        .unwrap()
        .filter(col("number").is_not_null())
        .unwrap();
    assert_eq!(
        client
            .submit(&tried)
            .await
            .unwrap()
            .wait()
            .await
            .unwrap()
            .rows(),
        0
    );

    // Nothing above harmed the cluster: every node is alive, and a job is exact.
    assert!(client.nodes().await.unwrap().iter().all(|node| node.alive));
    assert_eq!(
        sum_ids(&client, &[path("zstd.parquet")]).await,
        Ok(expected)
    );
    drop(cluster);
}

/// Page checksums (written by parquet-mr, Spark and pyarrow's `write_page_checksum`) are
/// verified: an uncompressed page whose bytes changed is an error, never silently wrong sums.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_that_fails_its_checksum_fails_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("checksummed.parquet");
    let script = format!(
        "import pyarrow as pa, pyarrow.parquet as pq\n\
         t = pa.table({{'id': pa.array(range({ROWS}), pa.int64())}})\n\
         pq.write_table(t, {:?}, compression='none', use_dictionary=False, write_page_checksum=True)\n",
        good.to_str().unwrap()
    );
    let status = std::process::Command::new("python3")
        .args(["-c", &script])
        .status()
        .unwrap();
    assert!(status.success(), "python3 with pyarrow is needed");
    let cluster = LocalCluster::start(LocalClusterOptions::new(
        1,
        env!("CARGO_BIN_EXE_floe").into(),
    ))
    .await
    .unwrap();
    let client = cluster.connect().await.unwrap();
    let expected: i64 = (0..ROWS).sum();
    assert_eq!(
        sum_ids(&client, std::slice::from_ref(&good)).await,
        Ok(expected)
    );

    // Uncompressed plain Int64 values: without the checksum this would just be another sum.
    let bad = dir.path().join("flipped.parquet");
    corrupt(&good, &bad);
    let error = sum_ids(&client, std::slice::from_ref(&bad))
        .await
        .unwrap_err();
    assert!(error.contains(bad.to_str().unwrap()), "{error}");
    assert!(
        error.to_lowercase().contains("checksum") || error.contains("crc"),
        "{error}"
    );
}
