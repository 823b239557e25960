//! The fingerprint cache: the same pipeline twice, then with one argument changed.
//!
//! Run with `cargo build && cargo run -p floe-client --example cache_demo`. The second run
//! computes nothing (its output is loaded from the cache); the third recomputes only what is
//! downstream of the changed argument.

use floe_client::{
    Dataset, LocalCluster, LocalClusterOptions, UdfCall, col, find_floe_binary, lit,
};

fn pipeline(mean: f64) -> Result<Dataset, floe_client::Error> {
    Dataset::range(200_000)?
        .with_column("x", col("id") * lit(3i64))?
        .cache()?
        .map_batches(
            UdfCall::new("standardize", 1)
                .with("column", "x")
                .with("mean", mean),
        )
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cluster = LocalCluster::start(LocalClusterOptions::new(2, find_floe_binary()?)).await?;
    let client = cluster.connect().await?;
    for (run, mean) in [
        ("first run", 1.0),
        ("same again", 1.0),
        ("mean changed", 5.0),
    ] {
        let output = client.submit(&pipeline(mean)?).await?.wait().await?;
        println!(
            "{run:<13} {:>3} tasks computed, {:>3} shards from the cache, {} ms",
            output.stats.compute_tasks(),
            output.stats.cache_hits(),
            output.stats.wall_ms
        );
    }
    Ok(())
}
