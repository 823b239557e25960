//! The blocks a job has made: where each is, and freeing each once no task reads it again
//! (or, for what the job keeps, at its end).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use floe_core::job::OutputBlock;
use floe_core::{NodeId, ObjectId};

use super::Execution;
use crate::cluster::ClusterAccess;

/// The blocks of one task, in order.
#[derive(Debug, Clone, Default)]
pub(super) struct Bundle {
    pub(super) blocks: Vec<ObjectId>,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct BlockInfo {
    pub(super) node: NodeId,
    pub(super) rows: u64,
    pub(super) bytes: u64,
}

impl BlockInfo {
    /// The block as a job's output names it.
    pub(super) fn output_block(&self, object: ObjectId) -> OutputBlock {
        OutputBlock {
            object,
            node: self.node,
            rows: self.rows,
            bytes: self.bytes,
        }
    }
}

impl<C: ClusterAccess> Execution<C> {
    /// Frees blocks no task will read again.
    pub(super) fn free_now(&mut self, objects: &[ObjectId]) {
        let mut free: BTreeMap<NodeId, Vec<ObjectId>> = BTreeMap::new();
        for object in objects {
            if let Some(info) = self.blocks.remove(object) {
                free.entry(info.node).or_default().push(*object);
            }
        }
        if !free.is_empty() {
            let cluster = Arc::clone(&self.cluster);
            tokio::spawn(async move { cluster.free(free).await });
        }
    }

    /// A task consumed `inputs`: free each block its last consumer has taken, unless the job
    /// keeps it (cached operators' blocks wait for their shards to be written; the output
    /// stays for the client).
    pub(super) fn release_inputs(&mut self, inputs: &[ObjectId]) {
        let mut free: BTreeMap<NodeId, Vec<ObjectId>> = BTreeMap::new();
        for object in inputs {
            let Some(refs) = self.refs.get_mut(object) else {
                continue;
            };
            *refs = refs.saturating_sub(1);
            if *refs > 0 {
                continue;
            }
            self.refs.remove(object);
            if self.pinned.contains(object) {
                continue;
            }
            if let Some(info) = self.blocks.remove(object) {
                free.entry(info.node).or_default().push(*object);
            }
        }
        if !free.is_empty() {
            let cluster = Arc::clone(&self.cluster);
            tokio::spawn(async move { cluster.free(free).await });
        }
    }

    pub(super) async fn free_all_except(&mut self, keep: &BTreeSet<ObjectId>) {
        let mut free: BTreeMap<NodeId, Vec<ObjectId>> = BTreeMap::new();
        for (object, info) in &self.blocks {
            if !keep.contains(object) {
                free.entry(info.node).or_default().push(*object);
            }
        }
        self.cluster.free(free).await;
    }
}
