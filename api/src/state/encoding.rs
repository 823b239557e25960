//! The state's encoding for a snapshot, cut into pieces the next snapshot shares.
//!
//! A snapshot build's cost used to grow with the whole state: every map walked, every byte
//! copied, written and synced, while commits beside it paid for the CPU and the disk queue it
//! took (docs/SCALING.md). Between two snapshots only a small part of a large state changes
//! (new jobs, finished ones, jobs leaving for the history), so the encoding is cut into
//! [`Piece`]s: each map the state grows with is cut into chunks of about
//! [`CHUNK_TARGET_BYTES`] of consecutive entries, and the next encoding finds the chunks whose
//! entries changed with `diff` between the map it encoded and the current one (which skips
//! every subtree the two share), encodes only those again and copies the others' bytes. The
//! snapshot store writes only the pieces it does not hold yet (their xxh3-128 names them).
//!
//! Where a chunk ends depends on its entries alone (a hash of each entry's key decides,
//! [`ends_chunk`]), not on the encodings before: a map's chunks are the same whether it was
//! encoded from scratch or from the last encoding, so a replica restarted on its snapshot
//! store, whose first build has no last encoding, still finds most pieces stored.
//!
//! Invariants:
//! - The pieces tile [`EncodedState::data`], which is byte for byte [`ClusterState::encode`]'s,
//!   and are the same as an encoding from scratch would cut.
//! - A chunk holds the encoding of every entry whose key lies between its `first` key
//!   (inclusive; the map's start for the first chunk) and the next chunk's `first`
//!   (exclusive; the map's end for the last chunk). A chunk none of whose keys were added,
//!   changed or removed therefore still holds exactly those entries' encoding.

use std::ops::Bound;
use std::sync::Arc;

use bytes::Bytes;
use floe_core::hash::{xxh3_64, xxh3_128};
use floe_core::wire::codec;
use floe_core::{ActorId, JobId, NodeId};
use imbl::{OrdMap, OrdSet, ordmap, ordset};
use serde::Serialize;

use super::{ActorRecord, ClusterState, JobRecord, NodeRecord};
use crate::Result;

/// Bytes of entries a chunk holds on average. Smaller chunks mean less written for entries
/// changed here and there (each changed entry rewrites its chunk), more pieces for the store
/// to track: at 100,000 jobs (12 MB) this is about 190 pieces. The tests cut a few entries a
/// chunk, so that their small states have many.
const CHUNK_TARGET_BYTES: usize = if cfg!(test) { 256 } else { 64 << 10 };

/// A chunk that reaches this size ends after its entry whatever [`ends_chunk`] says.
const CHUNK_MAX_BYTES: usize = 8 * CHUNK_TARGET_BYTES;

/// A run of an encoding's bytes, `start..end` in its data, named by their xxh3-128.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub start: usize,
    pub end: usize,
    pub hash: u128,
}

/// A state's encoding and its pieces, kept for the next encoding to share.
#[derive(Default)]
pub struct EncodedState {
    data: Bytes,
    pieces: Vec<Piece>,
    /// How each map was cut; `None` for an encoding that shares nothing (the default).
    chunks: Option<Box<Chunks>>,
    /// Bytes of `data` copied from the last encoding rather than encoded.
    reused_bytes: usize,
}

impl EncodedState {
    /// The whole state's encoding.
    pub fn data(&self) -> &Bytes {
        &self.data
    }

    /// The pieces that tile [`EncodedState::data`], in order.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// Bytes copied from the last encoding rather than encoded.
    pub fn reused_bytes(&self) -> usize {
        self.reused_bytes
    }
}

/// How each map that grows with the state was cut, with the map as it was encoded (an O(1)
/// copy) for the next encoding's `diff`.
struct Chunks {
    nodes: ChunkedMap<OrdMap<NodeId, NodeRecord>>,
    jobs: ChunkedMap<OrdMap<JobId, Arc<JobRecord>>>,
    actors: ChunkedMap<OrdMap<ActorId, ActorRecord>>,
    unfinished: ChunkedMap<OrdSet<JobId>>,
    drivers: ChunkedMap<OrdMap<NodeId, OrdSet<JobId>>>,
    ended: ChunkedMap<OrdSet<(u64, JobId)>>,
    holding_outputs: ChunkedMap<OrdSet<(u64, JobId)>>,
    actors_by_job: ChunkedMap<OrdMap<JobId, OrdSet<ActorId>>>,
}

struct ChunkedMap<C: Collection> {
    encoded: C,
    /// In key order; see the module's second invariant.
    chunks: Vec<Chunk<C::Key>>,
}

struct Chunk<K> {
    first: K,
    piece: Piece,
}

impl ClusterState {
    /// Encodes the state, copying from `last` the bytes of every chunk none of whose entries
    /// changed since; the result's [`EncodedState::data`] is the same bytes as
    /// [`ClusterState::encode`]'s.
    pub fn encode_reusing(&self, last: &EncodedState) -> Result<EncodedState> {
        // Taken apart without `..`, so a field added to the state fails to compile here until
        // it is encoded (or, like `submissions`, named as not encoded). Fields reordered, or
        // given serde attributes, compile still: the tests, which compare with `encode`,
        // catch those.
        let ClusterState {
            applied_index,
            applied_commands,
            next_node_id,
            next_job_id,
            nodes,
            jobs,
            submissions: _,
            actors,
            cache,
            unfinished,
            drivers,
            outputs_to_free,
            job_counts,
            ended,
            holding_outputs,
            actors_by_job,
            cache_use,
        } = self;
        let previous = last.chunks.as_deref();
        // Room for the last encoding and an eighth more: a buffer grown by doubling instead
        // touches about twice the state's size of new memory, copying it on the way.
        let capacity = last.data.len() + last.data.len() / 8;
        let mut encoder = Encoder::new(&last.data, capacity);
        encoder.value(applied_index)?;
        encoder.value(applied_commands)?;
        encoder.value(next_node_id)?;
        encoder.value(next_job_id)?;
        let nodes = encoder.map(nodes, previous.map(|chunks| &chunks.nodes))?;
        let jobs = encoder.map(jobs, previous.map(|chunks| &chunks.jobs))?;
        let actors = encoder.map(actors, previous.map(|chunks| &chunks.actors))?;
        encoder.value(cache)?;
        let unfinished = encoder.map(unfinished, previous.map(|chunks| &chunks.unfinished))?;
        let drivers = encoder.map(drivers, previous.map(|chunks| &chunks.drivers))?;
        encoder.value(outputs_to_free)?;
        encoder.value(job_counts)?;
        let ended = encoder.map(ended, previous.map(|chunks| &chunks.ended))?;
        let holding_outputs = encoder.map(
            holding_outputs,
            previous.map(|chunks| &chunks.holding_outputs),
        )?;
        let actors_by_job =
            encoder.map(actors_by_job, previous.map(|chunks| &chunks.actors_by_job))?;
        encoder.value(cache_use)?;
        let (data, pieces, reused_bytes) = encoder.finish();
        Ok(EncodedState {
            data,
            pieces,
            chunks: Some(Box::new(Chunks {
                nodes,
                jobs,
                actors,
                unfinished,
                drivers,
                ended,
                holding_outputs,
                actors_by_job,
            })),
            reused_bytes,
        })
    }
}

/// Writes an encoding and cuts it into pieces: the bytes between two chunks are one piece.
struct Encoder<'a> {
    out: Vec<u8>,
    pieces: Vec<Piece>,
    /// Where the bytes not yet in a piece start.
    loose_from: usize,
    last: &'a [u8],
    reused_bytes: usize,
}

impl<'a> Encoder<'a> {
    fn new(last: &'a [u8], capacity: usize) -> Self {
        Self {
            out: Vec::with_capacity(capacity),
            pieces: Vec::new(),
            loose_from: 0,
            last,
            reused_bytes: 0,
        }
    }

    fn value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        Ok(codec::encode_into(value, &mut self.out)?)
    }

    /// Ends a piece at the end of the output, unless it would be empty.
    fn cut(&mut self) -> Option<Piece> {
        let (start, end) = (self.loose_from, self.out.len());
        if start == end {
            return None;
        }
        let piece = Piece {
            start,
            end,
            hash: xxh3_128(&self.out[start..end]),
        };
        self.pieces.push(piece);
        self.loose_from = end;
        Some(piece)
    }

    fn finish(mut self) -> (Bytes, Vec<Piece>, usize) {
        self.cut();
        (Bytes::from(self.out), self.pieces, self.reused_bytes)
    }

    /// Copies a piece of the last encoding.
    fn copy(&mut self, piece: Piece) -> Piece {
        self.cut();
        let start = self.out.len();
        self.out
            .extend_from_slice(&self.last[piece.start..piece.end]);
        let copied = Piece {
            start,
            end: self.out.len(),
            hash: piece.hash,
        };
        self.pieces.push(copied);
        self.loose_from = copied.end;
        self.reused_bytes += copied.end - copied.start;
        copied
    }

    /// Encodes `map` (its length, then its entries in chunks), copying from the last
    /// encoding each chunk of `last` none of whose entries changed.
    fn map<C: Collection>(
        &mut self,
        map: &C,
        last: Option<&ChunkedMap<C>>,
    ) -> Result<ChunkedMap<C>> {
        codec::encode_len(map.entries(), &mut self.out)?;
        let mut chunks = Vec::new();
        let Some(last) = last.filter(|last| !last.chunks.is_empty()) else {
            self.encode_range(map, Bound::Unbounded, Bound::Unbounded, &mut chunks)?;
            return Ok(ChunkedMap {
                encoded: map.clone(),
                chunks,
            });
        };
        let mut changed = vec![false; last.chunks.len()];
        map.changes(&last.encoded, &mut |key| {
            let covering = last.chunks.partition_point(|chunk| chunk.first <= *key);
            changed[covering.saturating_sub(1)] = true;
        });
        let mut index = 0;
        while index < last.chunks.len() {
            let chunk = &last.chunks[index];
            if !changed[index] {
                let piece = self.copy(chunk.piece);
                chunks.push(Chunk {
                    first: chunk.first.clone(),
                    piece,
                });
                index += 1;
                continue;
            }
            // A run of changed chunks is encoded again as one range from its first chunk's
            // start. Where the range ends with no chunk ended, the chunk after it joins the
            // run: its entries would have been in the same chunk from scratch.
            let mut cutter = ChunkCutter::new(self, &mut chunks);
            let mut from = match index {
                0 => Bound::Unbounded,
                _ => Bound::Included(&chunk.first),
            };
            let mut end = index;
            loop {
                end += changed[end..]
                    .iter()
                    .position(|changed| !changed)
                    .unwrap_or(changed.len() - end);
                let to = last
                    .chunks
                    .get(end)
                    .map_or(Bound::Unbounded, |next| Bound::Excluded(&next.first));
                map.encode_range(from, to, &mut cutter)?;
                if !cutter.is_open() || end == last.chunks.len() {
                    break;
                }
                from = Bound::Included(&last.chunks[end].first);
                end += 1;
            }
            cutter.close();
            index = end;
        }
        Ok(ChunkedMap {
            encoded: map.clone(),
            chunks,
        })
    }

    fn encode_range<C: Collection>(
        &mut self,
        map: &C,
        from: Bound<&C::Key>,
        to: Bound<&C::Key>,
        chunks: &mut Vec<Chunk<C::Key>>,
    ) -> Result<()> {
        let mut cutter = ChunkCutter::new(self, chunks);
        map.encode_range(from, to, &mut cutter)?;
        cutter.close();
        Ok(())
    }
}

/// Cuts a range of entries into chunks of about [`CHUNK_TARGET_BYTES`].
struct ChunkCutter<'e, 'a, K> {
    encoder: &'e mut Encoder<'a>,
    chunks: &'e mut Vec<Chunk<K>>,
    /// The open chunk's first key.
    open: Option<K>,
}

impl<'e, 'a, K: Clone> ChunkCutter<'e, 'a, K> {
    fn new(encoder: &'e mut Encoder<'a>, chunks: &'e mut Vec<Chunk<K>>) -> Self {
        Self {
            encoder,
            chunks,
            open: None,
        }
    }

    fn is_open(&self) -> bool {
        self.open.is_some()
    }

    /// Encodes an entry with `encode_key` and then `encode_value`, and ends the chunk after
    /// it where [`ends_chunk`] says, or where the chunk reached [`CHUNK_MAX_BYTES`].
    fn entry(
        &mut self,
        key: &K,
        encode_key: impl FnOnce(&mut Vec<u8>) -> Result<()>,
        encode_value: impl FnOnce(&mut Vec<u8>) -> Result<()>,
    ) -> Result<()> {
        if self.open.is_none() {
            // The bytes before the chunk (a length, small fields) are a piece of their own.
            self.encoder.cut();
            self.open = Some(key.clone());
        }
        let out = &mut self.encoder.out;
        let start = out.len();
        encode_key(out)?;
        let key_hash = xxh3_64(&out[start..]);
        encode_value(out)?;
        let chunk_len = out.len() - self.encoder.loose_from;
        if ends_chunk(key_hash, out.len() - start) || chunk_len >= CHUNK_MAX_BYTES {
            self.close();
        }
        Ok(())
    }

    fn close(&mut self) {
        if let Some(first) = self.open.take()
            && let Some(piece) = self.encoder.cut()
        {
            self.chunks.push(Chunk { first, piece });
        }
    }
}

/// Whether a chunk ends after an entry of `len` bytes whose key's encoding hashes to
/// `key_hash`: with a probability of `len` in [`CHUNK_TARGET_BYTES`], so that chunks hold
/// about that many bytes whatever the size of their entries.
fn ends_chunk(key_hash: u64, len: usize) -> bool {
    u128::from(key_hash) * (CHUNK_TARGET_BYTES as u128) < (len as u128) << 64
}

/// A persistent map or set whose encoding is a length and then its entries in key order.
trait Collection: Clone {
    type Key: Ord + Clone;

    fn entries(&self) -> usize;

    /// Calls `changed` with the key of every entry added, changed or removed since `last`.
    fn changes(&self, last: &Self, changed: &mut dyn FnMut(&Self::Key));

    /// Encodes the entries whose keys lie between `from` and `to`, in key order.
    fn encode_range(
        &self,
        from: Bound<&Self::Key>,
        to: Bound<&Self::Key>,
        cutter: &mut ChunkCutter<'_, '_, Self::Key>,
    ) -> Result<()>;
}

impl<K, V> Collection for OrdMap<K, V>
where
    K: Ord + Clone + Serialize,
    V: Clone + Eq + Serialize,
{
    type Key = K;

    fn entries(&self) -> usize {
        self.len()
    }

    fn changes(&self, last: &Self, changed: &mut dyn FnMut(&K)) {
        for item in last.diff(self) {
            match item {
                ordmap::DiffItem::Add(key, _)
                | ordmap::DiffItem::Remove(key, _)
                | ordmap::DiffItem::Update { new: (key, _), .. } => changed(key),
            }
        }
    }

    fn encode_range(
        &self,
        from: Bound<&K>,
        to: Bound<&K>,
        cutter: &mut ChunkCutter<'_, '_, K>,
    ) -> Result<()> {
        for (key, value) in self.range::<_, K>((from, to)) {
            cutter.entry(
                key,
                |out| Ok(codec::encode_into(key, out)?),
                |out| Ok(codec::encode_into(value, out)?),
            )?;
        }
        Ok(())
    }
}

impl<A> Collection for OrdSet<A>
where
    A: Ord + Clone + Serialize,
{
    type Key = A;

    fn entries(&self) -> usize {
        self.len()
    }

    fn changes(&self, last: &Self, changed: &mut dyn FnMut(&A)) {
        for item in last.diff(self) {
            match item {
                ordset::DiffItem::Add(key) | ordset::DiffItem::Remove(key) => changed(key),
            }
        }
    }

    fn encode_range(
        &self,
        from: Bound<&A>,
        to: Bound<&A>,
        cutter: &mut ChunkCutter<'_, '_, A>,
    ) -> Result<()> {
        for key in self.range::<_, A>((from, to)) {
            cutter.entry(key, |out| Ok(codec::encode_into(key, out)?), |_| Ok(()))?;
        }
        Ok(())
    }
}
