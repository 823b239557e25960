//! The blocks a job has made: where each is, and freeing each once no task reads it again
//! (or, for what the job keeps, at its end).
//!
//! A block is usually an object of its own. A shuffle map task writes all its partitions into
//! one object instead; each partition is then a block of its own here (under an id derived
//! from the object's), pointing at its part of the object, and the object is freed when the
//! last of its blocks is. Only this module and the task's inputs (`task.rs`, which names the
//! object and the part to the node) see the difference.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use floe_api::node_protocol::{OutputRef, Part};
use floe_core::hash::xxh3_128;
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
    /// The object the block is a part of, when it is not an object of its own.
    pub(super) packed: Option<Packed>,
}

/// Where a block packed in a larger object lies.
#[derive(Debug, Clone, Copy)]
pub(super) struct Packed {
    pub(super) object: ObjectId,
    pub(super) part: Part,
}

/// An object holding several blocks.
#[derive(Debug, Clone, Copy)]
pub(super) struct Container {
    node: NodeId,
    /// Its blocks not yet freed; it is freed with the last.
    blocks_left: usize,
}

impl BlockInfo {
    /// A block that is an object of its own.
    pub(super) fn whole(node: NodeId, rows: u64, bytes: u64) -> Self {
        Self {
            node,
            rows,
            bytes,
            packed: None,
        }
    }
}

/// The id of block `index` packed in `object`: derived from the object's, so a rebuilt map
/// task's blocks keep their ids.
fn packed_block_id(object: ObjectId, index: usize) -> ObjectId {
    let mut seed = [0u8; 32];
    seed[..16].copy_from_slice(&object.get().to_le_bytes());
    seed[16..24].copy_from_slice(&(index as u64).to_le_bytes());
    seed[24..].copy_from_slice(b"packed\0\0");
    ObjectId::new(xxh3_128(&seed))
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
    /// Records the outputs task `seq` (task id `task`) of operator `op` made on `node`, and
    /// returns its blocks, in order: one per output, or one per part of a packed output. A
    /// `rebuild` made them before: blocks freed since are not wanted again unless a rebuild
    /// was asked for them (a task that read them must run again), the others are now on
    /// `node`. Every object and block is recorded in the lineage.
    pub(super) fn record_outputs(
        &mut self,
        (op, seq, task): (usize, u64, floe_core::TaskId),
        node: NodeId,
        outputs: &[OutputRef],
        rebuild: bool,
    ) -> Vec<ObjectId> {
        let mut blocks = Vec::with_capacity(outputs.len());
        for output in outputs {
            self.lineage.record(output.object, op, seq, task);
            if output.parts.is_empty() {
                let info = BlockInfo::whole(node, output.rows.unwrap_or(0), output.size);
                self.blocks.insert(output.object, info);
                blocks.push(output.object);
                continue;
            }
            let mut live = 0;
            for (index, part) in output.parts.iter().enumerate() {
                let block = packed_block_id(output.object, index);
                self.lineage.record(block, op, seq, task);
                blocks.push(block);
                if rebuild
                    && !self.blocks.contains_key(&block)
                    && !self.lineage.is_rebuilding(block)
                {
                    continue;
                }
                live += 1;
                let info = BlockInfo {
                    node,
                    rows: part.rows,
                    bytes: part.len,
                    packed: Some(Packed {
                        object: output.object,
                        part: *part,
                    }),
                };
                self.blocks.insert(block, info);
            }
            if live == 0 {
                // Rebuilt with none of its blocks wanted any more.
                self.containers.remove(&output.object);
                let free = BTreeMap::from([(node, vec![output.object])]);
                let cluster = Arc::clone(&self.cluster);
                tokio::spawn(async move { cluster.free(free).await });
                continue;
            }
            let container = Container {
                node,
                blocks_left: live,
            };
            self.containers.insert(output.object, container);
        }
        blocks
    }

    /// The node an object is on: a block's, or an object holding blocks.
    pub(super) fn node_of(&self, object: ObjectId) -> Option<NodeId> {
        self.blocks
            .get(&object)
            .map(|info| info.node)
            .or_else(|| self.containers.get(&object).map(|container| container.node))
    }

    /// Forgets a block; returns the object to free, with its node: the block's own, or the
    /// object it is packed in once that object's last block is forgotten.
    fn forget(&mut self, block: ObjectId) -> Option<(NodeId, ObjectId)> {
        let info = self.blocks.remove(&block)?;
        let Some(packed) = info.packed else {
            return Some((info.node, block));
        };
        let container = self.containers.get_mut(&packed.object)?;
        container.blocks_left = container.blocks_left.saturating_sub(1);
        if container.blocks_left > 0 {
            return None;
        }
        let node = container.node;
        self.containers.remove(&packed.object);
        Some((node, packed.object))
    }

    /// Frees blocks no task will read again.
    pub(super) fn free_now(&mut self, objects: &[ObjectId]) {
        let mut free: BTreeMap<NodeId, Vec<ObjectId>> = BTreeMap::new();
        for object in objects {
            if let Some((node, object)) = self.forget(*object) {
                free.entry(node).or_default().push(object);
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
            if let Some((node, object)) = self.forget(*object) {
                free.entry(node).or_default().push(object);
            }
        }
        if !free.is_empty() {
            let cluster = Arc::clone(&self.cluster);
            tokio::spawn(async move { cluster.free(free).await });
        }
    }

    pub(super) async fn free_all_except(&mut self, keep: &BTreeSet<ObjectId>) {
        let mut free: BTreeMap<NodeId, BTreeSet<ObjectId>> = BTreeMap::new();
        for (object, info) in &self.blocks {
            if !keep.contains(object) {
                let object = info.packed.map_or(*object, |packed| packed.object);
                free.entry(info.node).or_default().insert(object);
            }
        }
        let free = free
            .into_iter()
            .map(|(node, objects)| (node, objects.into_iter().collect()))
            .collect();
        self.cluster.free(free).await;
    }
}
