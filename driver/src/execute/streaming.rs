//! A streamed result seen from the executor: output bundles published as they are emitted,
//! acknowledged blocks freed, and the final operator held while the client lags.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use floe_core::job::OutputBlock;
use floe_core::{NodeId, ObjectId};
use tokio::sync::watch;

use super::Execution;
use crate::cluster::ClusterAccess;
use crate::stream::StreamHandle;

/// How long a stream with unread blocks may go without a client asking before the job is
/// failed as abandoned: a client that crashed sends no goodbye, and its job would otherwise
/// hold its buffer and a driver forever. Generous, because a reader may spend minutes on one
/// batch; a client that stops reading on purpose cancels the job at once.
const ABANDONED_AFTER: Duration = Duration::from_secs(600);

/// The executor's books on the stream of its output.
pub(super) struct OutputStream {
    handle: StreamHandle,
    /// Unacknowledged output bytes at which the final operator stops starting tasks.
    buffer_bytes: u64,
    acks: watch::Receiver<u64>,
    /// Output blocks (indexes into `outputs`) the client has acknowledged.
    acked: usize,
    unacked_bytes: u64,
    /// Acknowledged blocks kept until their cache shard is written.
    awaiting_cache: BTreeSet<ObjectId>,
}

impl OutputStream {
    pub(super) fn new(handle: StreamHandle, buffer_bytes: u64) -> Self {
        Self {
            acks: handle.watch_acks(),
            handle,
            buffer_bytes,
            acked: 0,
            unacked_bytes: 0,
            awaiting_cache: BTreeSet::new(),
        }
    }
}

/// Waits for the client's next acknowledgement; never, without a stream.
pub(super) async fn next_ack(stream: &mut Option<OutputStream>) {
    let Some(stream) = stream else {
        return std::future::pending().await;
    };
    if stream.acks.changed().await.is_err() {
        // The publisher lives as long as the driver: no more acknowledgements come.
        std::future::pending::<()>().await;
    }
}

impl<C: ClusterAccess> Execution<C> {
    /// Hands newly emitted output blocks to the client.
    pub(super) fn publish_outputs(&mut self, blocks: &[ObjectId]) {
        let Some(stream) = &mut self.stream else {
            return;
        };
        let published: Vec<OutputBlock> = blocks
            .iter()
            .filter_map(|object| Some(self.blocks.get(object)?.output_block(*object)))
            .collect();
        stream.unacked_bytes += published.iter().map(|block| block.bytes).sum::<u64>();
        stream.handle.publish(published);
    }

    /// Frees the output blocks the client has acknowledged since the last look, except those
    /// a cache shard still has to be written from.
    pub(super) fn stream_acked(&mut self) {
        let Some(stream) = &mut self.stream else {
            return;
        };
        let acked = usize::try_from(stream.handle.acked())
            .unwrap_or(usize::MAX)
            .min(self.outputs.len());
        let mut free: BTreeMap<NodeId, Vec<ObjectId>> = BTreeMap::new();
        for object in &self.outputs[stream.acked.min(acked)..acked] {
            let Some(info) = self.blocks.get(object) else {
                continue;
            };
            stream.unacked_bytes = stream.unacked_bytes.saturating_sub(info.bytes);
            if self.pinned.contains(object) {
                stream.awaiting_cache.insert(*object);
            } else if let Some(info) = self.blocks.remove(object) {
                free.entry(info.node).or_default().push(*object);
            }
        }
        stream.acked = stream.acked.max(acked);
        if !free.is_empty() {
            let cluster = Arc::clone(&self.cluster);
            tokio::spawn(async move { cluster.free(free).await });
        }
    }

    /// A cache write from `blocks` ended: acknowledged ones waiting for it go now.
    pub(super) fn stream_cache_written(&mut self, blocks: &[ObjectId]) {
        let Some(stream) = &mut self.stream else {
            return;
        };
        let done: Vec<ObjectId> = blocks
            .iter()
            .filter(|object| stream.awaiting_cache.remove(object))
            .copied()
            .collect();
        for object in &done {
            self.pinned.remove(object);
        }
        self.free_now(&done);
    }

    /// Whether the client lags by the job's buffer, so the final operator waits.
    pub(super) fn stream_full(&self) -> bool {
        self.stream
            .as_ref()
            .is_some_and(|stream| stream.unacked_bytes >= stream.buffer_bytes.max(1))
    }

    /// Whether the client has acknowledged every output block published (always, without a
    /// stream).
    pub(super) fn stream_drained(&self) -> bool {
        self.stream
            .as_ref()
            .is_none_or(|stream| stream.acked >= self.outputs.len())
    }

    /// Fails the job when its unread blocks have waited for a client past [`ABANDONED_AFTER`].
    pub(super) fn check_stream_abandoned(&mut self) {
        let Some(stream) = &self.stream else {
            return;
        };
        let idle = stream.handle.idle();
        if stream.acked < self.outputs.len() && idle > ABANDONED_AFTER {
            self.failure.get_or_insert_with(|| {
                format!(
                    "the result stream was abandoned: no client read it for {} s",
                    idle.as_secs()
                )
            });
        }
    }
}
