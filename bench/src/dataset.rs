//! `floe-bench dataset`: the row-wise kernels of a Dataset stage, in-process.
//!
//! Measures, in one run:
//! - `expr_mrows_per_s`: a fused stage `with_column("y", a * 3 + b)` then `filter(y > t)`
//!   through the expression kernels (checked arithmetic, comparison, filter), in
//!   millions of input rows per second;
//! - `expr_reference_mrows_per_s`: the same computation as a hand-written loop over the
//!   columns' slices (checked arithmetic, one pass), the floor the kernels are measured against;
//! - `parquet_pruned_ms` and `parquet_full_ms`: reading one Parquet file of 64 row groups with
//!   a predicate that selects one group, with and without handing the predicate to the reader
//!   (which skips row groups by their statistics); `pruned_row_groups` counts what was skipped.
//!
//! Times are medians of several runs; the kernels' output is checked against the reference.

use std::fs::File;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use arrow::array::{ArrayRef, AsArray, Int64Array, RecordBatch};
use arrow::datatypes::Int64Type;
use floe_core::expr::{col, lit};
use floe_core::plan::{FileFormat, FileScan, Operator};
use floe_engine::ops::{RowOpContext, apply_row_ops};
use floe_engine::read::{discover, read_scan};
use floe_engine::udf::Registry;
use floe_engine::udf::process::ProcessSessions;
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;

use super::{median_time, print_figure};

const BATCH_ROWS: usize = 1 << 16;
const ROW_GROUPS: usize = 64;
/// Keeps about half the rows.
const THRESHOLD: i64 = 1 << 30;

/// `a` and `b` from a SplitMix64 generator, in `0..2^30`.
fn batches(rows: usize) -> anyhow::Result<Vec<RecordBatch>> {
    let mut random = super::SplitMix64(0x5eed);
    let mut next = move || (random.next() >> 34) as i64;
    (0..rows.div_ceil(BATCH_ROWS))
        .map(|index| {
            let len = BATCH_ROWS.min(rows - index * BATCH_ROWS);
            let a: Int64Array = (0..len).map(|_| next()).collect();
            let b: Int64Array = (0..len).map(|_| next()).collect();
            Ok(RecordBatch::try_from_iter([
                ("a", Arc::new(a) as ArrayRef),
                ("b", Arc::new(b) as ArrayRef),
            ])?)
        })
        .collect()
}

/// The stage's work written by hand: `y = a * 3 + b` (checked), keep rows with `y > t`.
fn reference(batches: &[RecordBatch]) -> anyhow::Result<Vec<i64>> {
    let mut kept = Vec::new();
    for batch in batches {
        let a = batch.column(0).as_primitive::<Int64Type>().values();
        let b = batch.column(1).as_primitive::<Int64Type>().values();
        for (a, b) in a.iter().zip(b.iter()) {
            if let Some(y) = a.checked_mul(3).and_then(|x| x.checked_add(*b))
                && y > THRESHOLD
            {
                kept.push(y);
            }
        }
    }
    Ok(kept)
}

pub fn run(quick: bool) -> anyhow::Result<()> {
    let rows = if quick { 1 << 20 } else { 1 << 24 };
    let runs = if quick { 3 } else { 5 };
    let input = batches(rows)?;
    let ops = vec![
        Operator::WithColumn {
            name: "y".into(),
            expr: col("a") * lit(3i64) + col("b"),
        },
        Operator::Filter {
            predicate: col("y").gt(lit(THRESHOLD)),
        },
    ];
    let registry = Registry::empty();
    let sessions = ProcessSessions::new(&[]);
    let context = RowOpContext {
        registry: &registry,
        processes: &sessions,
    };

    let mut kernel_output = Vec::new();
    let kernels = median_time(runs, || {
        let started = Instant::now();
        kernel_output = input
            .iter()
            .map(|batch| apply_row_ops(batch.clone(), &ops, context))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(started.elapsed())
    })?;
    let mut expected = Vec::new();
    let by_hand = median_time(runs, || {
        let started = Instant::now();
        expected = reference(&input)?;
        Ok(started.elapsed())
    })?;
    let actual: Vec<i64> = kernel_output
        .iter()
        .flat_map(|b| b.column(2).as_primitive::<Int64Type>().values().to_vec())
        .collect();
    ensure!(actual == expected, "kernels and reference disagree");
    let mrows = |time: Duration| rows as f64 / time.as_secs_f64() / 1e6;
    let labels = [("rows", serde_json::Value::from(rows))];
    print_figure(
        "dataset",
        "expr_mrows_per_s",
        mrows(kernels),
        "Mrows/s",
        &labels,
    );
    print_figure(
        "dataset",
        "expr_reference_mrows_per_s",
        mrows(by_hand),
        "Mrows/s",
        &labels,
    );
    print_figure(
        "dataset",
        "expr_to_reference",
        kernels.as_secs_f64() / by_hand.as_secs_f64(),
        "ratio",
        &labels,
    );

    // Parquet: `a` rewritten as the row number so each row group holds one range of it.
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench.parquet");
    let group_rows = rows / ROW_GROUPS;
    let properties = WriterProperties::builder()
        .set_max_row_group_row_count(Some(group_rows))
        .build();
    let schema = input[0].schema();
    let mut writer = ArrowWriter::try_new(File::create(&path)?, schema.clone(), Some(properties))?;
    let mut offset = 0i64;
    for batch in &input {
        let len = batch.num_rows() as i64;
        let ids = Int64Array::from_iter_values(offset..offset + len);
        offset += len;
        writer.write(&RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(ids), batch.column(1).clone()],
        )?)?;
    }
    writer.close()?;
    let scan = discover(FileFormat::Parquet, &[&path]).context("discovering the bench file")?;
    let predicate = col("a").lt(lit(group_rows as i64));
    let pruned_scan = FileScan {
        predicate: Some(predicate.clone()),
        ..scan.clone()
    };
    let mut pruned_groups = 0;
    let pruned = median_time(runs, || {
        let started = Instant::now();
        let (batches, stats) = read_scan(&pruned_scan, BATCH_ROWS)?;
        pruned_groups = stats.row_groups_pruned;
        ensure!(batches.iter().map(|b| b.num_rows()).sum::<usize>() == group_rows);
        Ok(started.elapsed())
    })?;
    let full = median_time(runs, || {
        let started = Instant::now();
        let (batches, _) = read_scan(&scan, BATCH_ROWS)?;
        let kept: usize = batches
            .iter()
            .map(|batch| {
                let mask = floe_engine::eval::evaluate_predicate(&predicate, batch)?;
                Ok::<_, floe_engine::Error>(mask.true_count())
            })
            .sum::<Result<usize, _>>()?;
        ensure!(kept == group_rows);
        Ok(started.elapsed())
    })?;
    let labels = [
        ("rows", serde_json::Value::from(rows)),
        ("row_groups", serde_json::Value::from(ROW_GROUPS)),
    ];
    print_figure(
        "dataset",
        "parquet_pruned_ms",
        pruned.as_secs_f64() * 1e3,
        "ms",
        &labels,
    );
    print_figure(
        "dataset",
        "parquet_full_ms",
        full.as_secs_f64() * 1e3,
        "ms",
        &labels,
    );
    print_figure(
        "dataset",
        "pruned_row_groups",
        pruned_groups as f64,
        "row groups",
        &labels,
    );
    Ok(())
}
