//! The quickstart pipeline on a local cluster: read → filter → with_column → groupby → sort →
//! write.
//!
//! Run with `cargo build && cargo run -p floe-client --example quickstart` (the example starts
//! the `floe` binary that `cargo build` puts next to it).

use arrow::datatypes::DataType;
use floe_client::{
    AggFunction, Aggregation, Dataset, LocalCluster, LocalClusterOptions, SortKey, WriteOptions,
    col, find_floe_binary, lit,
};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cluster = LocalCluster::start(LocalClusterOptions::new(2, find_floe_binary()?)).await?;
    let client = cluster.connect().await?;

    // Some sales rows as CSV: order id, region, quantity, price.
    let data = cluster.dir().join("sales");
    std::fs::create_dir_all(&data)?;
    let regions = ["north", "south", "east", "west"];
    for file in 0..4u64 {
        let mut text = String::from("order_id,region,quantity,price\n");
        for order in file * 1000..(file + 1) * 1000 {
            let region = regions[(order % 4) as usize];
            text.push_str(&format!(
                "{order},{region},{},{}.5\n",
                order % 9 + 1,
                order % 50
            ));
        }
        std::fs::write(data.join(format!("sales-{file}.csv")), text)?;
    }

    let output = cluster.dir().join("revenue_by_region");
    let pipeline = Dataset::read_csv(&[&data])?
        .filter(col("quantity").gt(lit(2i64)))?
        .with_column(
            "revenue",
            col("price") * col("quantity").cast(DataType::Float64),
        )?
        .groupby(&["region"])
        .agg(vec![
            Aggregation::count_rows("orders"),
            Aggregation::of(AggFunction::Sum, "revenue").alias("revenue"),
        ])?
        .sort(vec![SortKey::desc("revenue")])?
        .write_parquet(&output, WriteOptions::default())?;

    let job = client.submit(&pipeline).await?;
    let result = job.wait().await?;
    println!("job {} done in {} ms", job.id(), result.stats.wall_ms);
    for operator in &result.stats.operators {
        println!(
            "  {:<14} {:>3} tasks {:>8} rows",
            operator.name, operator.tasks, operator.rows
        );
    }
    for file in std::fs::read_dir(&output)? {
        println!("wrote {}", file?.path().display());
    }
    Ok(())
}
