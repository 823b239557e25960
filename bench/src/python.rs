//! `floe-bench python [--quick]`: the Python client (`import floe`, the installed package)
//! against the Rust client and pyarrow, in one run, on the map workload's events data
//! (10M rows; `--quick`: 1M) and one local cluster of two nodes.
//!
//! - `iter_batches_ratio`: the same plan (`value`, and `v2 = value * 2 + 1`) streamed to the
//!   client and summed there, by Python's `iter_batches` and by the Rust client's
//!   `Client::stream_with`: Rust's time ÷ Python's (1.0: Python is as fast; target ≥ 0.8).
//! - `map_batches_ratio`: the map workload's sum of `v2` with every block of `value` through
//!   `map_batches(lambda b: b)` (pyarrow format) against the same plan without it, both
//!   submitted from Python: native time ÷ Python function's (target ≥ 0.5).
//! - `to_pandas_ratio`: `to_pandas()` of the numeric columns of every row against
//!   `pyarrow.parquet.read_table(...).to_pandas()` on the same files in the same process:
//!   pyarrow's time ÷ floe's.
//!
//! Python runs as a child process (`python3 -c` with `bench/python_bench.py`) and reports its
//! own timings (median of the runs, from each call to its last row) with the sums and row
//! counts, which are checked here against the data's independent tallies; a wrong one makes
//! the bench exit non-zero. It needs the `floe` package installed for `python3`
//! (`pip install ./python`, a release build for figures) with pyarrow and pandas.

use std::time::Instant;

use anyhow::{Context, ensure};
use arrow::array::Float64Array;
use floe_client::{Dataset, col, lit};
use floe_core::Config;
use serde_json::Value;

use crate::print_figure;
use crate::workloads::{RunConfig, close, events, no_cache, target};

const SCRIPT: &str = include_str!("../python_bench.py");

pub fn run(quick: bool, config: &Config) -> anyhow::Result<()> {
    let run = RunConfig::new(quick, None, config);
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(measure(&run))
}

async fn measure(config: &RunConfig) -> anyhow::Result<()> {
    let data = events(config, config.rows())?;
    let truth = &data.truth;
    let python = python3()?;
    // The nodes run Python functions as inline code with the interpreter on their PATH, as a
    // cluster reached with `floe.connect` names it.
    let settings = vec![
        "node.udf_allow_inline=true".to_owned(),
        "node.udf_commands=python3".to_owned(),
    ];
    let target = target(config, settings).await?;
    let local = target.local.as_ref().context("a local cluster")?;

    let mut rust_times = Vec::new();
    let mut rust_sum = 0.0;
    let mapped = Dataset::read_parquet(&data.files)?
        .select(&["value"])?
        .with_column("v2", col("value") * lit(2.0) + lit(1.0))?;
    for _ in 0..config.runs() {
        let started = Instant::now();
        let mut stream = target.client.stream_with(&mapped, no_cache()).await?;
        rust_sum = 0.0;
        while let Some(batch) = stream.next_batch().await? {
            let v2 = batch
                .column_by_name("v2")
                .and_then(|c| c.as_any().downcast_ref::<Float64Array>())
                .context("no Float64 column v2")?;
            rust_sum += v2.values().iter().sum::<f64>();
        }
        rust_times.push(started.elapsed());
    }
    rust_times.sort();
    let rust_s = rust_times[rust_times.len() / 2].as_secs_f64();

    let files: Vec<String> = data
        .files
        .iter()
        .map(|file| file.display().to_string())
        .collect();
    let argument = serde_json::json!({
        "address": local.addresses().join(","),
        "token": local.token(),
        "files": files,
        "runs": config.runs(),
    });
    // Waited for off the runtime's threads.
    let running = format!("running {}", python.display());
    let child = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&python)
            .arg("-c")
            .arg(SCRIPT)
            .arg(argument.to_string())
            .output()
    })
    .await?
    .context(running)?;
    ensure!(
        child.status.success(),
        "the Python side failed ({}): {}",
        child.status,
        String::from_utf8_lossy(&child.stderr)
    );
    let out: Value = serde_json::from_slice(&child.stdout).with_context(|| {
        format!(
            "the Python side printed {:?}",
            String::from_utf8_lossy(&child.stdout)
        )
    })?;
    let number = |name: &str| -> anyhow::Result<f64> {
        out[name]
            .as_f64()
            .with_context(|| format!("the Python side reported no {name}: {out}"))
    };

    let rows = truth.rows as f64;
    // Σ value, from Σ (value × 2 + 1) = 2 Σ value + rows: tolerant of the rounding between.
    let value_sum = (truth.map_sum - rows) / 2.0;
    let near = |actual: f64, expected: f64| (actual - expected).abs() <= 1e-6 * expected.abs();
    let checks = [
        ("rust iter_batches sum", close(rust_sum, truth.map_sum)),
        (
            "python iter_batches sum",
            close(number("iter_batches_sum")?, truth.map_sum),
        ),
        (
            "python iter_batches rows",
            number("iter_batches_rows")? == rows,
        ),
        (
            "native map total",
            close(number("native_total")?, truth.map_sum),
        ),
        (
            "python map total",
            close(number("python_total")?, truth.map_sum),
        ),
        ("to_pandas rows", number("to_pandas_rows")? == rows),
        (
            "to_pandas value sum",
            near(number("to_pandas_value_sum")?, value_sum),
        ),
        ("pyarrow rows", number("pyarrow_rows")? == rows),
        (
            "pyarrow value sum",
            near(number("pyarrow_value_sum")?, value_sum),
        ),
    ];
    let failed: Vec<&str> = checks
        .iter()
        .filter(|(_, passed)| !passed)
        .map(|(name, _)| *name)
        .collect();
    let verified = failed.is_empty();
    let labels = |more: Vec<(&'static str, Value)>| {
        let mut labels = vec![
            ("rows", truth.rows.into()),
            ("runs", config.runs().into()),
            ("verified", verified.into()),
        ];
        labels.extend(more);
        labels
    };
    let python_s = number("iter_batches_s")?;
    print_figure(
        "python",
        "iter_batches_ratio",
        rust_s / python_s,
        "ratio",
        &labels(vec![
            ("python_s", python_s.into()),
            ("rust_s", rust_s.into()),
            ("target", 0.8.into()),
        ]),
    );
    let (native_s, function_s) = (number("native_map_s")?, number("python_map_s")?);
    print_figure(
        "python",
        "map_batches_ratio",
        native_s / function_s,
        "ratio",
        &labels(vec![
            ("python_function_s", function_s.into()),
            ("native_s", native_s.into()),
            ("target", 0.5.into()),
        ]),
    );
    let (floe_s, pyarrow_s) = (number("to_pandas_s")?, number("pyarrow_s")?);
    print_figure(
        "python",
        "to_pandas_ratio",
        pyarrow_s / floe_s,
        "ratio",
        &labels(vec![
            ("floe_s", floe_s.into()),
            ("pyarrow_s", pyarrow_s.into()),
        ]),
    );
    ensure!(verified, "wrong results from: {}", failed.join(", "));
    Ok(())
}

/// `python3` on the PATH, which the nodes run Python functions with too.
fn python3() -> anyhow::Result<std::path::PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("python3"))
        .find(|candidate| candidate.is_file())
        .context("no python3 on PATH: floe-bench python drives the installed floe package with it")
}
