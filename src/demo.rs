//! `floe demo`: the README's main command. Starts a local cluster (a scheduler and two nodes,
//! real processes on loopback), generates sample sales data, runs the quickstart pipeline —
//! read → filter → with_column → groupby → sort — with progress bars, prints the result and
//! the per-operator stats, then writes the result as Parquet in a second job that is served
//! from the fingerprint cache.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use arrow::datatypes::DataType;
use clap::Args;
use floe_client::{
    AggFunction, Aggregation, Dataset, LocalCluster, LocalClusterOptions, SortKey, WaitOptions,
    WriteOptions, col, lit,
};

use crate::cli::{format_batches, print_local_cluster, print_stats, wait_with_bars};

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Sales rows to generate.
    #[arg(long, default_value_t = 400_000)]
    pub rows: u64,
    /// Keep the cluster running after the demo, until Ctrl-C.
    #[arg(long)]
    pub serve: bool,
}

const REGIONS: [&str; 6] = ["north", "south", "east", "west", "central", "islands"];
const FILES: u64 = 8;

pub async fn run(args: &DemoArgs) -> anyhow::Result<()> {
    println!("starting a local cluster: 1 scheduler, 2 nodes ...");
    let binary = std::env::current_exe().context("cannot find the floe binary")?;
    let cluster = LocalCluster::start(LocalClusterOptions::new(2, binary)).await?;
    print_local_cluster(&cluster);
    let client = cluster.connect().await?;

    let data = cluster.dir().join("sales");
    generate_sales(&data, args.rows)?;
    println!(
        "\ngenerated {} sales rows in {} CSV files under {}",
        args.rows,
        FILES,
        data.display()
    );

    let quickstart = Dataset::read_csv(&[&data])?
        .filter(col("quantity").gt(lit(2i64)))?
        .with_column(
            "revenue",
            col("price") * col("quantity").cast(DataType::Float64),
        )?
        .groupby(&["region"])
        .agg(vec![
            Aggregation::count_rows("orders"),
            Aggregation::of(AggFunction::Sum, "revenue").alias("revenue"),
            Aggregation::of(AggFunction::Mean, "price").alias("avg_price"),
        ])?
        .sort(vec![SortKey::desc("revenue")])?;
    println!("\nthe pipeline:\n{}", quickstart.explain()?);

    println!("job 1: revenue by region");
    let job = client.submit(&quickstart).await?;
    let output = wait_with_bars(&job, WaitOptions::default()).await?;
    println!("\nresult ({} rows):", output.rows());
    print!("{}", format_batches(&output.take(10).await?)?);
    print_stats(&output.stats);

    let out_dir = cluster.dir().join("revenue_by_region");
    let written = quickstart.write_parquet(&out_dir, WriteOptions::default())?;
    println!("\njob 2: the same pipeline, written as Parquet (its upstream is cached)");
    let job = client.submit(&written).await?;
    let output = wait_with_bars(&job, WaitOptions::default()).await?;
    print_stats(&output.stats);
    let computed: u64 = output
        .stats
        .operators
        .iter()
        .filter(|operator| !operator.name.starts_with("write"))
        .map(|operator| operator.tasks)
        .sum();
    println!(
        "job 2 loaded {} cached shards and computed {computed} tasks before the write; files in {} \
         (removed with the local cluster when the demo ends; --serve keeps them)",
        output.stats.cache_hits(),
        out_dir.display()
    );
    println!("\ndashboard: {}", cluster.dashboard_url());
    if args.serve {
        println!("serving the dashboard; press Ctrl-C to stop");
        floe_node::Termination::install()?.recv().await;
    }
    Ok(())
}

/// Sales rows in `FILES` CSV files: `order_id,region,quantity,price`, from a fixed seed so
/// every run generates the same data (and so the same fingerprints).
fn generate_sales(dir: &Path, rows: u64) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut state = 0x5eed_u64;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let per_file = rows.div_ceil(FILES);
    for file in 0..FILES {
        let mut text = String::from("order_id,region,quantity,price\n");
        for order in file * per_file..((file + 1) * per_file).min(rows) {
            let region = REGIONS[(next() % REGIONS.len() as u64) as usize];
            let quantity = next() % 10 + 1;
            let cents = next() % 10_000 + 100;
            writeln!(
                text,
                "{order},{region},{quantity},{}.{:02}",
                cents / 100,
                cents % 100
            )?;
        }
        let path = dir.join(format!("sales-{file:02}.csv"));
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
