//! Writing cached operators' output as shards: a source's as each task finishes (its shard
//! count is known up front), any other operator's all at its end, each recorded in the
//! replicated cache index once written.

use std::collections::BTreeSet;
use std::sync::Arc;

use floe_api::node_protocol::{NodeRequest, NodeResponse, ShardWrite};
use floe_api::state::{CacheOrigin, CachedShard, Command};
use floe_core::{Fingerprint, NodeId, ObjectId};

use super::task::{Launch, Recipe};
use super::{Event, Execution};
use crate::cluster::ClusterAccess;
use crate::plan::{CacheTarget, Planned, ShardToLoad};

/// A shard the index names on `node` whose file turned out missing or damaged there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct StaleShard {
    pub fingerprint: Fingerprint,
    pub count: u32,
    pub rank: u32,
    pub node: NodeId,
}

/// Before a recompute: drops the old shards of every cached operator the job runs from the
/// index, then removes their files from every alive node, so copies the new shards do not
/// overwrite (another node's, another shard count's) do not stay behind. A node that cannot
/// be reached keeps its copies; they hold the same rows.
pub(crate) async fn remove_old_shards<C: ClusterAccess>(
    cluster: &C,
    planned: &Planned,
) -> crate::Result<()> {
    let fingerprints: BTreeSet<Fingerprint> = planned
        .operators
        .iter()
        .filter(|operator| operator.needed)
        .filter_map(|operator| operator.cache.as_ref())
        .map(|target| target.fingerprint)
        .collect();
    if fingerprints.is_empty() {
        return Ok(());
    }
    for fingerprint in &fingerprints {
        // Rejected when nothing of it is indexed.
        cluster
            .propose(Command::EvictCache {
                fingerprint: fingerprint.to_string(),
            })
            .await?;
    }
    let request = NodeRequest::RemoveCacheShards {
        fingerprints: fingerprints.into_iter().collect(),
    };
    // Asked of the scheduler, not the driver's view of the nodes, which is filled only once
    // the execution starts.
    for node in cluster.read_nodes().await? {
        if let Err(error) = cluster.call_node(&node.rpc, &request).await {
            tracing::warn!(node = %node.id, %error, "cannot remove the old shards of a recomputed output");
        }
    }
    Ok(())
}

impl StaleShard {
    /// Drops it from the index (unless a copy was recorded on another node since).
    pub(crate) fn forget(&self) -> Command {
        Command::ForgetCacheShard {
            fingerprint: self.fingerprint.to_string(),
            shard_count: self.count,
            rank: self.rank,
            node: self.node,
        }
    }
}

/// Why a cache shard was not written or recorded (the job goes on; the shard is computed
/// again next time).
#[derive(Debug, thiserror::Error)]
pub(super) enum CacheWriteError {
    #[error(transparent)]
    Cluster(#[from] crate::Error),
    #[error("unexpected answer {0:?}")]
    Unexpected(Box<NodeResponse>),
}

impl<C: ClusterAccess> Execution<C> {
    /// A load of operator `index` found its shard gone. A source's own shard is dropped from
    /// the index and computed again in its place (the index changes first, so the shard the
    /// task then writes is not the one forgotten); any other is left for the driver to drop
    /// before it plans the job again without it.
    pub(super) fn shard_gone(&mut self, index: usize, launch: Launch, message: String) {
        let Recipe::Load(ShardToLoad {
            node,
            rank,
            count,
            recompute,
        }) = launch.recipe
        else {
            self.fail(index, message);
            return;
        };
        let stale = StaleShard {
            fingerprint: self.ops[index].stage.fingerprint,
            count,
            rank,
            node,
        };
        let Some(input) = recompute else {
            self.stale_cache.insert(stale);
            self.fail(index, message);
            return;
        };
        tracing::warn!(job = %self.job, operator = %self.ops[index].name, %message, "computing a cached shard that is gone");
        let op = &mut self.ops[index];
        op.stats.cache_hits = op.stats.cache_hits.saturating_sub(1);
        let next = super::task::compute(launch.seq, input, Vec::new());
        // Counted as running until it is queued.
        op.running += 1;
        self.running.insert(next.task);
        let cluster = Arc::clone(&self.cluster);
        let events = self.events_tx.clone();
        tokio::spawn(async move {
            if let Err(error) = cluster.propose(stale.forget()).await {
                tracing::warn!(%error, "cannot drop a missing shard from the cache index");
            }
            let _ = events.send(Event::Requeue {
                op: index,
                launch: next,
            });
        });
    }

    /// Writes one shard from blocks on `node` and records it in the replicated index.
    pub(super) fn write_shard(
        &mut self,
        index: usize,
        target: CacheTarget,
        rank: u32,
        count: u32,
        node: NodeId,
        blocks: Vec<ObjectId>,
    ) {
        self.cache_writes += 1;
        let cluster = Arc::clone(&self.cluster);
        let events = self.events_tx.clone();
        let schema = self.ops[index].stage.schema.clone();
        let origin = CacheOrigin {
            job: self.job,
            operator: self.ops[index].name.clone(),
        };
        tokio::spawn(async move {
            let write = ShardWrite {
                lineage: target.lineage,
                rank,
                count,
                blocks: blocks.clone(),
                schema,
                overwrite: target.overwrite,
            };
            let result = async {
                let addr = cluster.address(node).await?;
                let (rows, bytes) = match cluster
                    .call_node(&addr, &NodeRequest::WriteCacheShard(write))
                    .await?
                {
                    NodeResponse::CacheWritten { rows, bytes } => (rows, bytes),
                    other => return Err(CacheWriteError::Unexpected(Box::new(other))),
                };
                cluster
                    .propose(Command::RecordCacheShard {
                        fingerprint: target.fingerprint.to_string(),
                        shard_count: count,
                        rank,
                        shard: CachedShard { node, bytes, rows },
                        origin: Some(origin),
                    })
                    .await?;
                Ok(())
            }
            .await;
            let _ = events.send(Event::CacheWritten {
                op: index,
                blocks,
                result,
            });
        });
    }

    /// A cached operator whose shard count is known only at its end writes all its shards
    /// (its caller leaves out an operator a limit stopped: its output was cut short).
    pub(super) fn write_whole_output_to_cache(&mut self, index: usize) {
        let op = &mut self.ops[index];
        let Some(target) = op.cache.clone() else {
            return;
        };
        if op.is_source() {
            return;
        }
        let bundles = std::mem::take(&mut op.emitted);
        let count = u32::try_from(bundles.len()).unwrap_or(u32::MAX);
        op.stats.cache_misses += u64::from(count);
        for (rank, bundle) in (0u32..).zip(bundles) {
            let node = bundle
                .blocks
                .first()
                .and_then(|block| self.blocks.get(block))
                .map_or(self.config.node, |info| info.node);
            self.write_shard(index, target.clone(), rank, count, node, bundle.blocks);
        }
    }
}
