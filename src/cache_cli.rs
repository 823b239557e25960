//! `floe cache ls | explain | clean`: the fingerprint cache directory of the node on this host
//! (`paths.cache_dir`, from the same configuration the node runs with).
//!
//! While a node runs on this host's data directory, `clean` asks that node to do it: the node
//! drops the shards from the scheduler's replicated index first and only then removes their
//! files, so no job is planned against a removed shard. With no node running, the files are
//! removed here (a stopped node's shards are not in the index; it records what is left when it
//! starts). A shard that goes missing anyway (deleted by hand) costs the job that finds it a
//! recomputation, never the job.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::SystemTime;

use anyhow::Context;
use clap::Subcommand;
use floe_api::node_protocol::{NodeProtocol, NodeRequest, NodeResponse};
use floe_core::Config;
use floe_core::Fingerprint;
use floe_core::config::ByteSize;
use floe_core::plan::optimizer::Optimizer;
use floe_core::plan::{LogicalPlan, Operator};
use floe_core::wire::{RpcClient, WireConfig};
use floe_engine::udf::Registry;

use crate::cli::{human_bytes, human_duration, now_ms};
use floe_objectstore::cache::{Cache, CacheConfig, MissExplanation};

#[derive(Debug, Subcommand)]
pub enum CacheCommand {
    /// Every cached output: with a cluster address (`FLOE_ADDRESS` or `--scheduler`), the
    /// cluster's index with the job and operator that made each entry, its size, shards per
    /// node and age; without one, this host's cache directory.
    Ls {
        #[command(flatten)]
        cluster: crate::cli::ClusterArgs,
    },
    /// Whether a fingerprint, or a job file's output, is cached here; if not, what differs
    /// from the nearest cached entry.
    Explain {
        /// A fingerprint (32 hex digits) or a job file.
        target: String,
    },
    /// Remove cached shards: all of them, or the least recently used down to a size.
    Clean {
        /// Keep the most recently used shards that fit in this size (e.g. 10GiB).
        #[arg(long)]
        max_size: Option<ByteSize>,
    },
}

pub fn run(config: &Config, command: &CacheCommand, udfs: Arc<Registry>) -> anyhow::Result<()> {
    let settings = CacheConfig::for_node(config);
    let dir = settings.dir.clone();
    let open = |settings: CacheConfig| {
        Cache::open(settings).with_context(|| format!("cannot open the cache in {}", dir.display()))
    };
    match command {
        CacheCommand::Ls { cluster }
            if !cluster.schedulers.is_empty() || !config.client.address.is_empty() =>
        {
            crate::block_on(list_cluster_cache(config, cluster))?;
        }
        CacheCommand::Ls { .. } => {
            let cache = open(settings)?;
            let mut outputs: BTreeMap<(Fingerprint, u32), (u32, u64, SystemTime)> = BTreeMap::new();
            for shard in cache.shards()? {
                let key = (shard.name.fingerprint, shard.name.shard.count);
                let entry = outputs.entry(key).or_insert((0, 0, SystemTime::UNIX_EPOCH));
                entry.0 += 1;
                entry.1 += shard.bytes;
                entry.2 = entry.2.max(shard.last_used);
            }
            println!("cache directory {}", dir.display());
            println!(
                "{:<34} {:>9} {:>14} {:>12}",
                "FINGERPRINT", "SHARDS", "BYTES", "IDLE_S"
            );
            for ((fingerprint, count), (present, bytes, last_used)) in outputs {
                let idle = SystemTime::now()
                    .duration_since(last_used)
                    .map_or(0, |idle| idle.as_secs());
                println!(
                    "{fingerprint:<34} {:>9} {bytes:>14} {idle:>12}",
                    format!("{present}/{count}")
                );
            }
        }
        CacheCommand::Explain { target } => {
            let cache = open(settings)?;
            if let Ok(fingerprint) = target.parse::<Fingerprint>() {
                let counts: BTreeSet<u32> = cache
                    .shards()?
                    .into_iter()
                    .filter(|shard| shard.name.fingerprint == fingerprint)
                    .map(|shard| shard.name.shard.count)
                    .collect();
                if counts.is_empty() {
                    println!("{fingerprint}: not cached in {}", dir.display());
                } else {
                    println!("{fingerprint}: cached, with shard counts {counts:?}");
                }
                return Ok(());
            }
            let text = std::fs::read_to_string(target).with_context(|| {
                format!("{target} is neither a fingerprint nor a readable job file")
            })?;
            let job = floe_client::jobspec::parse_job_file(target, &text, udfs)?;
            // Jobs cache under the optimized plan's fingerprints.
            let optimized = Optimizer::default().optimize(&job.dataset.plan().resolve_seeds()?)?;
            let output = match (optimized.operator(), optimized.inputs()) {
                // A sink's files are no cache entry: what a run reuses is the sink's input.
                (Operator::Write(spec), [input]) => {
                    println!(
                        "{target}: writes {} (files, not cached); a run reuses what it writes                          from the cache",
                        spec.directory.display()
                    );
                    input
                }
                _ => &optimized,
            };
            let lineage = output.lineage()?;
            println!(
                "{target}: output {} ({})",
                lineage.fingerprint(),
                output.operator().name()
            );
            let explanation = cache.explain_miss(&lineage)?;
            println!("{explanation}");
            if !matches!(explanation, MissExplanation::Cached { .. }) {
                print!("{}", upstream_misses(&cache, output)?);
            }
        }
        CacheCommand::Clean { max_size } => {
            if let Some(node) = floe_node::live_holder(&config.paths.data_dir)? {
                let keep_bytes = max_size.map(|size| size.bytes());
                let (shards, bytes) =
                    crate::block_on(clean_through_node(config, node, keep_bytes))?;
                println!(
                    "removed {shards} shards ({bytes} bytes) from {} through the node running \
                     on it (the cache index was updated first)",
                    dir.display()
                );
                return Ok(());
            }
            let before = open(settings.clone())?.stats()?.bytes;
            let removed = match max_size {
                Some(size) => open(CacheConfig {
                    max_bytes: *size,
                    ..settings
                })?
                .evict_to_cap(None)?,
                None => open(settings)?.cleanup(&BTreeSet::new())?,
            };
            println!(
                "removed {} shards ({} of {} bytes) from {}",
                removed.shards,
                removed.bytes,
                before,
                dir.display()
            );
        }
    }
    Ok(())
}

/// Each operator below `output` whose result is not cached here, down to the first cached
/// one on every path: where a run starts computing.
fn upstream_misses(cache: &Cache, output: &LogicalPlan) -> anyhow::Result<String> {
    let cached: BTreeSet<Fingerprint> = cache
        .shards()?
        .into_iter()
        .map(|shard| shard.name.fingerprint)
        .collect();
    let mut text = String::from("upstream:\n");
    let mut pending: Vec<(usize, &LogicalPlan)> = vec![(1, output)];
    while let Some((depth, plan)) = pending.pop() {
        let fingerprint = plan.fingerprint();
        let found = cached.contains(&fingerprint);
        writeln!(
            text,
            "{:indent$}{} {fingerprint}: {}",
            "",
            plan.operator().name(),
            if found {
                "cached: a run starts from here"
            } else {
                "not cached"
            },
            indent = depth * 2
        )?;
        if !found {
            pending.extend(plan.inputs().iter().rev().map(|input| (depth + 1, input)));
        }
    }
    Ok(text)
}

/// `floe cache ls` against the cluster: one line per cached output, newest first.
async fn list_cluster_cache(
    config: &Config,
    cluster: &crate::cli::ClusterArgs,
) -> anyhow::Result<()> {
    let client = cluster.connect(config).await?;
    let index = client.cache_index().await?;
    let mut lines = Vec::new();
    for (fingerprint, by_count) in &index {
        for (count, entry) in by_count {
            let mut per_node: BTreeMap<floe_core::NodeId, u32> = BTreeMap::new();
            for shard in entry.shards.values() {
                *per_node.entry(shard.node).or_default() += 1;
            }
            let nodes: Vec<String> = per_node
                .iter()
                .map(|(node, shards)| format!("{node}:{shards}"))
                .collect();
            let made = entry.made_by.as_ref();
            let age = made.map_or_else(
                || "-".to_owned(),
                |made| human_duration(now_ms().saturating_sub(made.created_at_ms)),
            );
            let job = made.map_or_else(|| "-".to_owned(), |made| made.origin.job.to_string());
            let operator = made.map_or("(found on disk)", |made| made.origin.operator.as_str());
            let line = format!(
                "{fingerprint:<34} {:>9} {:>10} {:<12} {age:>8} {job:<5} {operator}",
                format!("{}/{count}", entry.shards.len()),
                human_bytes(entry.shards.values().map(|shard| shard.bytes).sum()),
                nodes.join(","),
            );
            lines.push((made.map(|made| made.created_at_ms), line));
        }
    }
    lines.sort_by_key(|(created, _)| std::cmp::Reverse(*created));
    println!(
        "{:<34} {:>9} {:>10} {:<12} {:>8} {:<5} OPERATOR",
        "FINGERPRINT", "SHARDS", "BYTES", "NODE:SHARDS", "AGE", "JOB"
    );
    for (_, line) in lines {
        println!("{line}");
    }
    Ok(())
}

/// Asks the live node `node` to clean its cache; answers the shards and bytes it removed.
async fn clean_through_node(
    config: &Config,
    node: floe_node::Holder,
    keep_bytes: Option<u64>,
) -> anyhow::Result<(u64, u64)> {
    let Some(addr) = node.rpc else {
        anyhow::bail!(
            "the node on {} (pid {}) is still starting; run the clean again once it serves",
            config.paths.data_dir.display(),
            node.pid
        );
    };
    // Run on the node's host: with the node's own config (its cluster secret), or with an
    // admin client token.
    let wire = if config.client.token.is_empty() {
        WireConfig::member(config)
    } else {
        WireConfig::client(config)
    };
    let mut client: RpcClient<NodeProtocol> = RpcClient::connect(addr.clone(), wire)
        .await
        .with_context(|| format!("cannot reach the node at {addr}"))?;
    match client
        .call(&NodeRequest::CleanCache { keep_bytes })
        .await
        .with_context(|| format!("the node at {addr} could not clean its cache"))?
    {
        NodeResponse::CacheRemoved { shards, bytes } => Ok((shards, bytes)),
        other => anyhow::bail!("the node at {addr} answered {other:?} to a cache clean"),
    }
}
