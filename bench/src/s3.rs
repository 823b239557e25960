//! `floe-bench s3`: the same Parquet file read from a local S3-compatible server (`s3s-fs`
//! on 127.0.0.1, through `object_store` with SigV4, as a cluster's nodes read it) and from
//! the local disk, in the same run, with the engine's read kernels in this process.
//!
//! Workloads (each verified against sums computed while the data was generated):
//! - `map`: `value * 2 + 1` over every row, summed (reads one column);
//! - `groupby`: the sum of `value` per `key` (1,000 keys; reads two columns);
//! - `one_column`: the `id` column alone — `bytes_fetched` must be about that column's
//!   compressed bytes (`floe_testkit::files::parquet_column_bytes`), far below `bytes_in_files`.
//!
//! One JSON line per workload: `local_ms`, `s3_ms`, `s3_over_local`, `bytes_fetched`,
//! `bytes_in_files`, `verified`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::ensure;
use arrow::array::{ArrayRef, AsArray, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{Float64Type, Int64Type};
use floe_core::plan::{FileFormat, FileScan};
use floe_engine::read::{ReadStats, discover, read_scan};
use floe_testkit::s3::S3Server;
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;

use super::median_time;

const KEYS: i64 = 1_000;
const ROW_GROUP_ROWS: usize = 1 << 16;
const BATCH_ROWS: usize = 1 << 16;
/// What one footer read may fetch beyond the column chunks: the engine's first tail read is
/// 64 KiB (`remote::FOOTER_GUESS_BYTES`); this file's footer fits in it.
const FOOTER_ALLOWANCE_BYTES: u64 = 64 << 10;

/// id, key = id % 1000, value = (id % 997) / 4 (exact in f64), and a 40-byte payload.
fn batch(start: i64, rows: i64) -> anyhow::Result<RecordBatch> {
    let ids: Vec<i64> = (start..start + rows).collect();
    Ok(RecordBatch::try_from_iter([
        ("id", Arc::new(Int64Array::from(ids.clone())) as ArrayRef),
        (
            "key",
            Arc::new(Int64Array::from_iter_values(ids.iter().map(|i| i % KEYS))) as ArrayRef,
        ),
        (
            "value",
            Arc::new(Float64Array::from_iter_values(
                ids.iter().map(|i| (i % 997) as f64 / 4.0),
            )) as ArrayRef,
        ),
        (
            "payload",
            Arc::new(StringArray::from_iter_values(
                ids.iter().map(|i| format!("{i:020}-payload-{:011}", i * 7)),
            )) as ArrayRef,
        ),
    ])?)
}

fn write(path: &Path, rows: i64) -> anyhow::Result<()> {
    let properties = WriterProperties::builder()
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .build();
    let mut writer = ArrowWriter::try_new(
        std::fs::File::create(path)?,
        batch(0, 1)?.schema(),
        Some(properties),
    )?;
    let mut start = 0;
    while start < rows {
        let n = (rows - start).min(BATCH_ROWS as i64);
        writer.write(&batch(start, n)?)?;
        start += n;
    }
    writer.close()?;
    Ok(())
}

fn projected(scan: &FileScan, columns: &[&str]) -> FileScan {
    FileScan {
        projection: Some(columns.iter().map(|c| (*c).to_owned()).collect()),
        ..scan.clone()
    }
}

/// What a workload computes from its rows; equal on both sides and to the expected value.
#[derive(Debug, PartialEq)]
enum Answer {
    Sum(f64),
    Groups(Vec<(i64, f64)>),
    Ids(i64, i64),
}

fn answer(workload: &str, batches: &[RecordBatch]) -> Answer {
    match workload {
        "map" => Answer::Sum(
            batches
                .iter()
                .flat_map(|b| b.column(0).as_primitive::<Float64Type>().values().to_vec())
                .map(|v| v * 2.0 + 1.0)
                .sum(),
        ),
        "groupby" => {
            let mut groups: HashMap<i64, f64> = HashMap::new();
            for b in batches {
                let keys = b.column(0).as_primitive::<Int64Type>().values();
                let values = b.column(1).as_primitive::<Float64Type>().values();
                for (key, value) in keys.iter().zip(values.iter()) {
                    *groups.entry(*key).or_default() += value;
                }
            }
            let mut groups: Vec<_> = groups.into_iter().collect();
            groups.sort_by_key(|(key, _)| *key);
            Answer::Groups(groups)
        }
        _ => {
            let ids = batches
                .iter()
                .flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec());
            Answer::Ids(ids.clone().count() as i64, ids.sum())
        }
    }
}

fn expected(workload: &str, rows: i64) -> Answer {
    let values = || (0..rows).map(|i| (i % 997) as f64 / 4.0);
    match workload {
        "map" => Answer::Sum(values().map(|v| v * 2.0 + 1.0).sum()),
        "groupby" => {
            let mut groups = vec![0.0; KEYS as usize];
            for (i, v) in values().enumerate() {
                groups[i % KEYS as usize] += v;
            }
            Answer::Groups(
                groups
                    .into_iter()
                    .enumerate()
                    .map(|(k, v)| (k as i64, v))
                    .collect(),
            )
        }
        _ => Answer::Ids(rows, (0..rows).sum()),
    }
}

fn timed(scan: &FileScan) -> anyhow::Result<(Duration, Vec<RecordBatch>, ReadStats)> {
    let start = Instant::now();
    let (batches, stats) = read_scan(scan, BATCH_ROWS)?;
    Ok((start.elapsed(), batches, stats))
}

pub fn run(quick: bool) -> anyhow::Result<()> {
    let rows: i64 = if quick { 500_000 } else { 5_000_000 };
    let runs = if quick { 3 } else { 5 };
    let server = S3Server::start(&["bench"]);
    // SAFETY: set before this process starts any thread that reads the environment (the
    // server's runtime does not); the object-store client reads it next.
    unsafe { server.export_env() };
    let local = tempfile::tempdir()?;
    let local_file = local.path().join("events.parquet");
    write(&local_file, rows)?;
    server.put_file("bench", "events.parquet", &local_file);
    let bytes_in_files = std::fs::metadata(&local_file)?.len();

    let local_scan = discover(FileFormat::Parquet, &[&local_file])?;
    let s3_scan = discover(FileFormat::Parquet, &["s3://bench/events.parquet"])?;
    ensure!(
        local_scan.file_schema == s3_scan.file_schema,
        "schemas differ"
    );

    for (workload, columns) in [
        ("map", &["value"][..]),
        ("groupby", &["key", "value"][..]),
        ("one_column", &["id"][..]),
    ] {
        let want = expected(workload, rows);
        let mut verified = true;
        let mut fetched = 0;
        let local_time = median_time(runs, || {
            let (time, batches, _) = timed(&projected(&local_scan, columns))?;
            verified &= answer(workload, &batches) == want;
            Ok(time)
        })?;
        let s3_time = median_time(runs, || {
            let (time, batches, stats) = timed(&projected(&s3_scan, columns))?;
            verified &= answer(workload, &batches) == want;
            fetched = stats.bytes_fetched;
            Ok(time)
        })?;
        let columns_bytes = columns
            .iter()
            .map(|c| floe_testkit::files::parquet_column_bytes(&local_file, c))
            .sum::<u64>();
        // Projection must show: the columns' chunks, plus the footer (one tail read, a
        // second when the footer is longer), and nothing else of the file.
        verified &= fetched >= columns_bytes
            && fetched <= columns_bytes + 2 * FOOTER_ALLOWANCE_BYTES
            && fetched < bytes_in_files;
        let line = serde_json::json!({
            "bench": "s3",
            "workload": workload,
            "rows": rows,
            "local_ms": local_time.as_secs_f64() * 1e3,
            "s3_ms": s3_time.as_secs_f64() * 1e3,
            "s3_over_local": s3_time.as_secs_f64() / local_time.as_secs_f64(),
            "bytes_fetched": fetched,
            "column_bytes": columns_bytes,
            "bytes_in_files": bytes_in_files,
            "verified": verified,
        });
        println!("{line}");
        ensure!(
            verified,
            "{workload}: a result differs from the expected one, or {fetched} bytes fetched \
             is not the {columns_bytes} bytes of its columns plus the footer"
        );
    }
    Ok(())
}
