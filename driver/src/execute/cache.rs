//! Writing cached operators' output as shards: a source's as each task finishes (its shard
//! count is known up front), any other operator's all at its end, each recorded in the
//! replicated cache index once written.

use std::sync::Arc;

use floe_api::node_protocol::{NodeRequest, NodeResponse, ShardWrite};
use floe_api::state::{CachedShard, Command};
use floe_core::{NodeId, ObjectId};

use super::{Event, Execution};
use crate::cluster::ClusterAccess;
use crate::plan::CacheTarget;

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
        tokio::spawn(async move {
            let write = ShardWrite {
                lineage: target.lineage,
                rank,
                count,
                blocks,
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
                    })
                    .await?;
                Ok(())
            }
            .await;
            let _ = events.send(Event::CacheWritten { op: index, result });
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
