//! Moving objects between nodes.
//!
//! The puller asks the holder for the object's size and checksum; an object up to
//! `node.transfer_inline_max` comes with that answer. A larger one is read in
//! `node.transfer_chunk` pieces over several connections at once, at most
//! `node.transfer_max_in_flight` bytes of requests outstanding. A chunk goes from the holder's
//! store to its socket and from the puller's socket into the new object without passing
//! through any buffer (it is the reply's attachment). The puller hashes the chunks in order as
//! they arrive; the object's xxh3-64 must match the holder's (which the holder's store usually
//! knows from when the object was sealed) before it is sealed, and a mismatch abandons it.
//! Concurrent pulls of one object share a single transfer.
//!
//! A copy pulled here is shared by everyone who pulled it while it was in flight or in use
//! (tasks, aggregators): each pull counts a use, each user releases its use when done, and
//! the copy is deleted with the last use. A use is counted before the pull returns, so one
//! user finishing can never delete the copy from under another that has not pinned it yet.
//!
//! A chunk of an object in the store's shared-memory segment is sent with `sendfile(2)` from
//! the segment's file, so the holder copies nothing: the kernel hands the segment's pages to
//! the socket. A file-backed object (a fallback object, or a cache shard served in place) is
//! sent from its own file the same way. The RPC server keeps the chunk's view, and so its pin, until the puller has
//! read the reply, so the pages cannot be reused while the kernel still reads them.
//!
//! A node on the same host as the holder (the same boot id) needs no socket for the bytes:
//! it asks where the parts lie in the holder's segment (`LendRanges`; the holder pins them
//! until that connection's next request or its end), opens the segment read-only, checks that
//! the file is the one lent (device and inode), and copies the parts into its new object with
//! `pread`, hashing as it goes. One copy and no TCP stack: on a two-node `floe up` the reduce's
//! pulls cost about a third of the CPU the loopback socket did. Anything else (another host,
//! a spilled part, a segment this process may not open) goes over the socket as above.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::ops::Range;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::Poll;

use floe_core::ObjectId;
use floe_core::config::NodeConfig;
use floe_core::hash::{Xxh3_64, xxh3_64};
use floe_core::wire::{Attachment, FileRange, RpcClient, WireConfig};
use floe_objectstore::block::Packing;
use floe_objectstore::{ObjectSource, ObjectStore, ObjectView, ObjectWriter};
use tokio::sync::OnceCell;
use tokio::sync::mpsc::UnboundedSender;

use super::{Error, Result};
use floe_api::node_protocol::{
    ByteRange, Bytes, Loan, NodeProtocol, NodeRequest, NodeResponse, ObjectMeta, OutputRef, Part,
};

/// Room a chunk reply needs besides its bytes (request id, enum tags, length prefix).
const REPLY_ENVELOPE: u64 = 4096;

/// Where Linux shows the running kernel's boot id, which names the host in a [`Loan`].
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// How many holders found to run elsewhere a node remembers; past it, it forgets them all
/// (each then costs one refused `LendRanges` again).
const MAX_REMOTE_HOLDERS: usize = 4096;

/// How much of a lent part is read with one `pread` and hashed while it is in the cache.
const BORROW_STEP: usize = 256 << 10;

/// The most ranges one `ReadRanges` may ask for. Each pins its object until the reply is sent,
/// so the count bounds what one request makes the holder keep; a puller cuts its requests at
/// this many ranges as it cuts them at a chunk of bytes.
const MAX_RANGES_PER_READ: usize = 4096;

type SharedPull = Arc<OnceCell<Result<OutputRef, String>>>;

/// A pulled object, and whether whoever asked holds a use of a copy pulled here (which it
/// gives back with [`Transfers::release`]) or the object is this node's own.
#[derive(Debug, Clone)]
pub(crate) struct Pulled {
    pub output: OutputRef,
    pub copy_in_use: bool,
}

/// Pulls in flight, and the uses of the copies pulled here; both under one lock.
#[derive(Default)]
struct Copies {
    pulls: HashMap<ObjectId, SharedPull>,
    uses: HashMap<ObjectId, usize>,
}

pub(crate) struct Transfers {
    store: ObjectStore,
    wire: WireConfig,
    chunk: u64,
    max_in_flight: u64,
    inline_max: u64,
    copies: Mutex<Copies>,
    pulls_started: AtomicU64,
    /// Object bytes pulled from other nodes and served to them over sockets since the node
    /// started.
    received_bytes: AtomicU64,
    sent_bytes: AtomicU64,
    /// Object bytes read from the segments of other nodes on this host (no socket), of those
    /// received.
    borrowed_bytes: AtomicU64,
    /// This host's boot id, if it can be read: what a holder's loan must name.
    host: Option<String>,
    /// Holders found to run elsewhere (another host, or a /dev/shm this process does not
    /// share): pulled from over sockets without asking for a loan. Bounded by
    /// [`MAX_REMOTE_HOLDERS`].
    remote_holders: Mutex<std::collections::HashSet<String>>,
    /// The store's segment opened as a file when a chunk from it is first sent or lent (`None`
    /// if that failed: chunks are then sent from memory, and nothing is lent). A store has one
    /// segment for life.
    segment_file: OnceLock<Option<SegmentFile>>,
}

/// The store's segment as a file, with what names it in a [`Loan`].
struct SegmentFile {
    file: Arc<std::fs::File>,
    os_id: String,
    device: u64,
    inode: u64,
}

impl Transfers {
    pub fn new(store: ObjectStore, wire: WireConfig, config: &NodeConfig) -> Self {
        // A chunk must fit in one frame with its envelope.
        let frame_room = (wire.max_frame as u64)
            .saturating_sub(REPLY_ENVELOPE)
            .max(1);
        let chunk = config.transfer_chunk.bytes().min(frame_room);
        Self {
            store,
            wire,
            chunk,
            max_in_flight: config.transfer_max_in_flight.bytes().max(chunk),
            inline_max: config.transfer_inline_max.bytes().min(chunk),
            copies: Mutex::new(Copies::default()),
            pulls_started: AtomicU64::new(0),
            received_bytes: AtomicU64::new(0),
            sent_bytes: AtomicU64::new(0),
            borrowed_bytes: AtomicU64::new(0),
            host: std::fs::read_to_string(BOOT_ID)
                .ok()
                .map(|id| id.trim().to_owned())
                .filter(|id| !id.is_empty()),
            remote_holders: Mutex::new(std::collections::HashSet::new()),
            segment_file: OnceLock::new(),
        }
    }

    /// Object bytes read from the segments of other nodes on this host, of those received.
    pub fn borrowed_bytes(&self) -> u64 {
        self.borrowed_bytes.load(Ordering::Relaxed)
    }

    pub fn pulls_started(&self) -> u64 {
        self.pulls_started.load(Ordering::Relaxed)
    }

    /// Object bytes received from other nodes and sent to them over sockets (clients' reads
    /// included; not those read from segments on this host).
    pub fn network_bytes(&self) -> (u64, u64) {
        (
            self.received_bytes.load(Ordering::Relaxed),
            self.sent_bytes.load(Ordering::Relaxed),
        )
    }

    /// The size and checksum of a local object, with its bytes when small.
    pub fn meta(&self, object: ObjectId) -> Result<ObjectMeta> {
        let view = self.store.get(object)?;
        let bytes = view.as_bytes();
        let inline = bytes.len() as u64 <= self.inline_max;
        if inline {
            self.sent_bytes
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        Ok(ObjectMeta {
            size: bytes.len() as u64,
            checksum: self
                .store
                .checksum(object)
                .unwrap_or_else(|| xxh3_64(bytes)),
            inline: inline.then(|| Bytes(bytes.to_vec())),
        })
    }

    /// A chunk of a local object as an attachment that keeps the object pinned until the
    /// puller has read it (the RPC server holds it until the connection's next request or its
    /// end).
    pub fn read_chunk(&self, object: ObjectId, offset: u64, len: u64) -> Result<Attachment> {
        let view = self.store.get(object)?;
        let size = view.len();
        let start = usize::try_from(offset).ok().filter(|start| *start <= size);
        let range = start.and_then(|start| {
            let end = start.saturating_add(usize::try_from(len).ok()?).min(size);
            Some(start..end)
        });
        let range = range.ok_or_else(|| Error::Transfer {
            object,
            reason: format!("offset {offset} lies past the object's {size} bytes"),
        })?;
        self.sent_bytes
            .fetch_add(range.len() as u64, Ordering::Relaxed);
        let file = self.source_file(&view.location().source);
        Ok(attach(view, range, file))
    }

    /// The file `source` is, to send chunks from: the store's segment (opened once), or the
    /// object's own file — a fallback object's, or a cache shard served in place — opened for
    /// the chunk (an open costs microseconds; a chunk, milliseconds). `None` for heap memory,
    /// or a file that cannot be opened: the chunk is then sent from the mapping.
    fn source_file(&self, source: &ObjectSource) -> Option<Arc<std::fs::File>> {
        match source {
            ObjectSource::Segment { os_id } => {
                self.segment_file(os_id).map(|segment| segment.file.clone())
            }
            ObjectSource::File { .. } => source.open_file().ok().flatten().map(Arc::new),
            ObjectSource::Heap { .. } => None,
        }
    }

    /// The store's segment, `os_id`, opened when first asked for.
    fn segment_file(&self, os_id: &str) -> Option<&SegmentFile> {
        self.segment_file
            .get_or_init(|| {
                let source = ObjectSource::Segment {
                    os_id: os_id.to_owned(),
                };
                let file = match source.open_file() {
                    Ok(file) => file?,
                    Err(error) => {
                        tracing::warn!(%error, "sending chunks from memory: cannot open the segment");
                        return None;
                    }
                };
                let metadata = file.metadata().ok()?;
                Some(SegmentFile {
                    file: Arc::new(file),
                    os_id: os_id.to_owned(),
                    device: metadata.dev(),
                    inode: metadata.ino(),
                })
            })
            .as_ref()
    }

    /// Byte ranges of local objects, one after the other, as one attachment that keeps the
    /// objects pinned until the puller has read it. Each range must lie inside its object
    /// (an empty one only asks whether the object is here); together they must fit in a
    /// frame with the reply, and be at most [`MAX_RANGES_PER_READ`].
    pub fn read_ranges(&self, ranges: &[ByteRange]) -> Result<Attachment> {
        let total = self.total_within_frame(ranges)?;
        check_count(ranges)?;
        // An object's own file is opened once, however many of its ranges are asked for.
        let mut files: HashMap<ObjectId, Option<Arc<std::fs::File>>> = HashMap::new();
        let mut attachment: Option<Attachment> = None;
        for range in ranges {
            let (view, bytes) = self.view_of(range)?;
            let file = files
                .entry(range.object)
                .or_insert_with(|| self.source_file(&view.location().source))
                .clone();
            let part = attach(view, bytes, file);
            attachment = Some(match attachment {
                Some(attachment) => attachment.then(part),
                None => part,
            });
        }
        self.sent_bytes.fetch_add(total, Ordering::Relaxed);
        Ok(attachment.unwrap_or_else(|| Attachment::new(Vec::new())))
    }

    /// Where `ranges` of local objects lie in this node's segment, for a node on the same host
    /// to read them itself, and an attachment that keeps the objects pinned until that node's
    /// next request or the connection's end. At most as many ranges as
    /// [`Self::read_ranges`] (each pins its object), of any length (no frame carries them);
    /// refused unless every range's object lies in the segment.
    pub fn lend_ranges(&self, ranges: &[ByteRange]) -> Result<(Loan, Attachment)> {
        check_count(ranges)?;
        let refused = |object: ObjectId, reason: &str| Error::Transfer {
            object,
            reason: format!("cannot lend it: {reason}"),
        };
        let first = ranges
            .first()
            .map_or(ObjectId::new(0), |range| range.object);
        let host = self
            .host
            .clone()
            .ok_or_else(|| refused(first, "this node cannot read its host's boot id"))?;
        let mut views = Vec::with_capacity(ranges.len());
        let mut offsets = Vec::with_capacity(ranges.len());
        for range in ranges {
            let (view, bytes) = self.view_of(range)?;
            if !matches!(view.location().source, ObjectSource::Segment { .. }) {
                return Err(refused(
                    range.object,
                    "it is not in the store's segment (spilled, or in a file of its own)",
                ));
            }
            offsets.push(view.location().payload_offset() + bytes.start as u64);
            views.push(view);
        }
        let Some(view) = views.first() else {
            return Err(refused(first, "no range was asked for"));
        };
        let segment = match &view.location().source {
            ObjectSource::Segment { os_id } => self.segment_file(os_id),
            _ => None,
        }
        .ok_or_else(|| refused(first, "the segment cannot be opened"))?;
        let loan = Loan {
            host,
            segment: segment.os_id.clone(),
            device: segment.device,
            inode: segment.inode,
            offsets,
        };
        Ok((loan, Attachment::holding(views)))
    }

    /// The total length of `ranges` if a reply's frame holds it.
    fn total_within_frame(&self, ranges: &[ByteRange]) -> Result<u64> {
        let frame = (self.wire.max_frame as u64).saturating_sub(REPLY_ENVELOPE);
        ranges
            .iter()
            .try_fold(0u64, |total, range| total.checked_add(range.len))
            .filter(|total| *total <= frame)
            .ok_or_else(|| {
                refused_request(
                    ranges,
                    format!(
                        "{} ranges ask for more than the {frame} bytes a reply's frame holds",
                        ranges.len()
                    ),
                )
            })
    }

    /// `range`'s object, pinned, and the range's bytes in it, which must lie inside it.
    fn view_of(&self, range: &ByteRange) -> Result<(ObjectView, Range<usize>)> {
        let view = self.store.get(range.object)?;
        let size = view.len() as u64;
        let bytes = range
            .offset
            .checked_add(range.len)
            .filter(|end| *end <= size)
            .map(|end| range.offset as usize..end as usize)
            .ok_or_else(|| Error::Transfer {
                object: range.object,
                reason: format!(
                    "bytes {}..+{} lie outside the object's {size} bytes",
                    range.offset, range.len
                ),
            })?;
        Ok((view, bytes))
    }

    /// Pulls `parts` (each a part of an object on `holder`) here into one new object, each at
    /// an aligned offset, with `ReadRanges` requests of up to a chunk each over parallel
    /// connections: a reduce's blocks held by one node take one object and a few requests,
    /// however many map tasks made them. Each part's xxh3 is checked as it arrives, in order;
    /// a mismatch abandons the object.
    pub async fn pull_parts(
        &self,
        holder: &str,
        parts: &[(ObjectId, Part)],
    ) -> Result<PulledParts> {
        let first = parts
            .first()
            .map_or(ObjectId::new(0), |(object, _)| *object);
        let lens: Vec<u64> = parts.iter().map(|(_, part)| part.len).collect();
        let packing = Packing::of(&lens).ok_or_else(|| Error::Transfer {
            object: first,
            reason: "the parts' sizes overflow an object".into(),
        })?;
        let copy = ObjectId::random();
        let mut writer = self.create_off_runtime(copy, packing.len).await?;
        let local: Vec<Part> = parts
            .iter()
            .zip(&packing.parts)
            .map(|((_, part), &(offset, _))| Part { offset, ..*part })
            .collect();
        self.fetch_parts(holder, parts, &packing, writer.as_mut_slice())
            .await?;
        writer.seal()?;
        Ok(PulledParts {
            object: copy,
            parts: local,
            owner: Some(self.store.clone()),
        })
    }

    /// Reads `parts` into their places in `dest` (as `packing` lays them out) and checks each:
    /// from the holder's segment when it runs on this host, else over sockets.
    async fn fetch_parts(
        &self,
        holder: &str,
        parts: &[(ObjectId, Part)],
        packing: &Packing,
        dest: &mut [u8],
    ) -> Result<()> {
        let mut places = part_places(packing, dest);
        let total: u64 = parts.iter().map(|(_, part)| part.len).sum();
        let hashers = match self.borrow_parts(holder, parts, &mut places).await {
            Some(hashers) => {
                self.borrowed_bytes.fetch_add(total, Ordering::Relaxed);
                hashers
            }
            None => {
                let hashers = self.read_parts(holder, parts, places).await?;
                self.received_bytes.fetch_add(total, Ordering::Relaxed);
                hashers
            }
        };
        for (hasher, (object, part)) in hashers.iter().zip(parts) {
            let actual = hasher.digest();
            if actual != part.checksum {
                return Err(Error::ChecksumMismatch {
                    object: *object,
                    expected: part.checksum,
                    actual,
                });
            }
        }
        Ok(())
    }

    /// Reads `parts` from `holder`'s segment into `places` when `holder` runs on this host:
    /// one `LendRanges` request, then a `pread` of each part, hashed as it goes, while the
    /// connection keeps the loan. `None` when it cannot (another host, a part not in the
    /// segment, a segment this process may not open or that is not the one lent, any error):
    /// the caller reads over sockets, which also tells why if the holder lacks a part.
    async fn borrow_parts(
        &self,
        holder: &str,
        parts: &[(ObjectId, Part)],
        places: &mut [&mut [u8]],
    ) -> Option<Vec<Xxh3_64>> {
        let host = self.host.as_deref()?;
        if parts.len() > MAX_RANGES_PER_READ || self.remote_holders().contains(holder) {
            return None;
        }
        let ranges = parts
            .iter()
            .map(|(object, part)| ByteRange {
                object: *object,
                offset: part.offset,
                len: part.len,
            })
            .collect();
        let mut client = RpcClient::<NodeProtocol>::connect(holder, self.wire.clone())
            .await
            .ok()?;
        let loan = match client.call(&NodeRequest::LendRanges { ranges }).await {
            Ok(NodeResponse::Lent(loan)) if loan.offsets.len() == parts.len() => loan,
            // A part spilled or in a file: this pull goes over sockets, the next may not.
            _ => return None,
        };
        let segment = match open_lent_segment(host, &loan) {
            Ok(segment) => segment,
            Err(reason) => {
                tracing::debug!(holder, reason, "the holder's segment is not readable here");
                self.remember_remote(holder);
                return None;
            }
        };
        let hashers = run_blocking(|| read_lent(&segment, &loan.offsets, places));
        // Ends the loan: the holder unpins the parts.
        drop(client);
        match hashers {
            Ok(hashers) => Some(hashers),
            Err(error) => {
                tracing::debug!(holder, %error, "reading the holder's segment failed");
                None
            }
        }
    }

    fn remote_holders(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.remote_holders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Remembers that `holder` runs elsewhere, forgetting every other first when there are
    /// [`MAX_REMOTE_HOLDERS`].
    fn remember_remote(&self, holder: &str) {
        let mut remote = self.remote_holders();
        if remote.len() >= MAX_REMOTE_HOLDERS {
            remote.clear();
        }
        remote.insert(holder.to_owned());
    }

    /// Reads `parts` into `places` over sockets: requests of about a chunk each, over parallel
    /// connections, hashed in order as they arrive.
    async fn read_parts(
        &self,
        holder: &str,
        parts: &[(ObjectId, Part)],
        places: Vec<&mut [u8]>,
    ) -> Result<Vec<Xxh3_64>> {
        // Each part's destination, cut into pieces of at most a chunk, in order.
        let chunk = self.chunk as usize;
        let mut pieces: Vec<Piece<'_>> = Vec::new();
        for (index, ((object, part), mut bytes)) in parts.iter().zip(places).enumerate() {
            let mut from = part.offset;
            while !bytes.is_empty() {
                let (piece, after) = bytes.split_at_mut(bytes.len().min(chunk));
                let piece_len = piece.len() as u64;
                pieces.push(Piece {
                    part: index,
                    range: ByteRange {
                        object: *object,
                        offset: from,
                        len: piece_len,
                    },
                    dest: piece,
                });
                from += piece_len;
                bytes = after;
            }
        }
        // Pieces grouped into requests of about a chunk each (and at most as many ranges as a
        // holder answers).
        let mut groups: Vec<Vec<Piece<'_>>> = Vec::new();
        let mut current_len = 0;
        for piece in pieces {
            let full = groups.last().is_none_or(|group| {
                current_len + piece.dest.len() > chunk || group.len() == MAX_RANGES_PER_READ
            });
            current_len = if full { 0 } else { current_len } + piece.dest.len();
            match groups.last_mut() {
                Some(group) if !full => group.push(piece),
                _ => groups.push(vec![piece]),
            }
        }
        let requests: Vec<Request<'_, usize>> = groups
            .into_iter()
            .filter_map(|group| {
                let object = group.first()?.range.object;
                let ranges = group.iter().map(|piece| piece.range).collect();
                let pieces = group
                    .into_iter()
                    .map(|piece| (piece.part, piece.dest))
                    .collect();
                Some(Request {
                    object,
                    ask: NodeRequest::ReadRanges { ranges },
                    pieces,
                })
            })
            .collect();
        let connections =
            ((self.max_in_flight / self.chunk) as usize).clamp(1, requests.len().max(1));
        let mut clients = Vec::with_capacity(connections);
        for _ in 0..connections {
            clients.push(RpcClient::connect(holder, self.wire.clone()).await?);
        }
        let mut hashers: Vec<Xxh3_64> = parts.iter().map(|_| Xxh3_64::new()).collect();
        read_in_order(clients, requests, |part, bytes| hashers[part].update(bytes)).await?;
        Ok(hashers)
    }

    /// The first of `objects` that `holder` no longer has, asked with an empty range of each
    /// (nothing is read or hashed); all of them when it does not answer at all. `None`: it
    /// has every one.
    pub async fn first_missing(&self, holder: &str, objects: &[ObjectId]) -> Option<ObjectId> {
        let Ok(mut client) = RpcClient::<NodeProtocol>::connect(holder, self.wire.clone()).await
        else {
            return objects.first().copied();
        };
        for &object in objects {
            let request = NodeRequest::ReadRanges {
                ranges: vec![ByteRange {
                    object,
                    offset: 0,
                    len: 0,
                }],
            };
            match client.call_into_parts(&request, &mut []).await {
                Ok(NodeResponse::Chunk) => {}
                _ => return Some(object),
            }
        }
        None
    }

    fn local(&self, object: ObjectId, copy_in_use: bool) -> Result<Pulled> {
        let meta = self.meta(object)?;
        let output = OutputRef {
            object,
            size: meta.size,
            checksum: Some(meta.checksum),
            rows: None,
            parts: Vec::new(),
        };
        Ok(Pulled {
            output,
            copy_in_use,
        })
    }

    fn copies(&self) -> std::sync::MutexGuard<'_, Copies> {
        self.copies.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gives back one use of each of these pulled copies; a copy goes with its last use (or
    /// when the last reader lets go of it, if one still reads it).
    pub fn release(&self, objects: &[ObjectId]) {
        let mut copies = self.copies();
        for object in objects {
            let Some(uses) = copies.uses.get_mut(object) else {
                continue;
            };
            *uses -= 1;
            if *uses > 0 {
                continue;
            }
            copies.uses.remove(object);
            // Under the lock: a pull that finds the copy here counts its use first.
            match self.store.delete(*object) {
                Ok(()) | Err(floe_objectstore::Error::NotFound { .. }) => {}
                Err(error) => tracing::warn!(%object, %error, "cannot delete a pulled copy"),
            }
        }
    }

    /// Makes a copy pulled here this node's own: no release deletes it, only a `Free`.
    pub fn keep(&self, object: ObjectId) {
        self.copies().uses.remove(&object);
    }

    /// Makes `object` local, pulling it from `holder` unless it is here already. A pull of an
    /// object whose transfer is under way joins that transfer (the object exists, unsealed,
    /// until the transfer ends).
    pub async fn pull(&self, object: ObjectId, holder: &str) -> Result<Pulled> {
        let shared = {
            let mut guard = self.copies();
            let copies = &mut *guard;
            match copies.pulls.get(&object) {
                Some(in_flight) => {
                    *copies.uses.entry(object).or_default() += 1;
                    Arc::clone(in_flight)
                }
                // A copy pulled here that others use: one more use.
                None if self.store.contains(object) && copies.uses.contains_key(&object) => {
                    *copies.uses.entry(object).or_default() += 1;
                    drop(guard);
                    return self.local_use(object);
                }
                // This node's own (sealed, or being written by a task of this node).
                None if self.store.contains(object) => {
                    drop(guard);
                    return self.local(object, false);
                }
                // Deleted with its last use while something still reads it: revived, it is
                // this caller's copy.
                None if self.store.revive(object) => {
                    *copies.uses.entry(object).or_default() += 1;
                    drop(guard);
                    return self.local_use(object);
                }
                // Added to, not set: callers of a pull that just failed may not have given
                // their uses back yet.
                None => {
                    *copies.uses.entry(object).or_default() += 1;
                    Arc::clone(copies.pulls.entry(object).or_default())
                }
            }
        };
        let outcome = shared
            .get_or_init(|| async {
                self.pulls_started.fetch_add(1, Ordering::Relaxed);
                let fetched = self.fetch(object, holder).await;
                if let Ok(output) = &fetched {
                    self.received_bytes
                        .fetch_add(output.size, Ordering::Relaxed);
                }
                fetched.map_err(|error| error.to_string())
            })
            .await
            .clone();
        {
            let mut copies = self.copies();
            if copies
                .pulls
                .get(&object)
                .is_some_and(|current| Arc::ptr_eq(current, &shared))
            {
                copies.pulls.remove(&object);
            }
        }
        match outcome {
            Ok(output) => Ok(Pulled {
                output,
                copy_in_use: true,
            }),
            Err(reason) => {
                self.release(&[object]);
                Err(Error::Transfer { object, reason })
            }
        }
    }

    /// A use counted of a copy here; given back if the copy cannot be read.
    fn local_use(&self, object: ObjectId) -> Result<Pulled> {
        self.local(object, true)
            .inspect_err(|_| self.release(&[object]))
    }

    /// Creates `object` for this agent to write, on a blocking thread: mapping in a large
    /// object's pages takes milliseconds, which would stall the runtime's other tasks.
    async fn create_off_runtime(&self, object: ObjectId, size: u64) -> Result<ObjectWriter> {
        let store = self.store.clone();
        let created = tokio::task::spawn_blocking(move || store.create(object, size)).await;
        let created = created.map_err(|error| Error::Transfer {
            object,
            reason: format!("creating its copy stopped: {error}"),
        })?;
        Ok(created?)
    }

    async fn fetch(&self, object: ObjectId, holder: &str) -> Result<OutputRef> {
        let mut client = RpcClient::<NodeProtocol>::connect(holder, self.wire.clone()).await?;
        let meta = match client.call(&NodeRequest::ObjectMeta { object }).await? {
            NodeResponse::ObjectMeta(meta) => meta,
            other => return Err(unexpected(object, &other)),
        };
        let writer = self.create_off_runtime(object, meta.size).await?;
        match meta.inline {
            Some(Bytes(bytes)) => {
                let mut writer = writer;
                if bytes.len() as u64 != meta.size {
                    return Err(Error::Transfer {
                        object,
                        reason: format!(
                            "{} inline bytes for an object of {} bytes",
                            bytes.len(),
                            meta.size
                        ),
                    });
                }
                writer.as_mut_slice().copy_from_slice(&bytes);
                seal_verified(writer, meta.checksum)
            }
            None => {
                let writer = self
                    .fetch_chunks(object, holder, client, &meta, writer)
                    .await?;
                writer.seal_with_checksum(meta.checksum)?;
                Ok(OutputRef {
                    object,
                    size: meta.size,
                    checksum: Some(meta.checksum),
                    rows: None,
                    parts: Vec::new(),
                })
            }
        }
    }

    /// Fills `writer` with chunks read over parallel connections, each taking the next chunk
    /// when it is free, and checks the whole object against `meta.checksum`: the chunks are
    /// hashed in order as they arrive, while they are still in the cache.
    async fn fetch_chunks(
        &self,
        object: ObjectId,
        holder: &str,
        first: RpcClient<NodeProtocol>,
        meta: &ObjectMeta,
        mut writer: ObjectWriter,
    ) -> Result<ObjectWriter> {
        let chunks = meta.size.div_ceil(self.chunk).max(1);
        let connections = (self.max_in_flight / self.chunk).clamp(1, chunks);
        let mut clients = vec![first];
        for _ in 1..connections {
            clients.push(RpcClient::connect(holder, self.wire.clone()).await?);
        }
        // `chunk` is at most a frame's size, which fits in usize.
        let chunk = self.chunk as usize;
        let requests = writer
            .as_mut_slice()
            .chunks_mut(chunk)
            .enumerate()
            .map(|(index, piece)| Request {
                object,
                ask: NodeRequest::ReadChunk {
                    object,
                    offset: (index * chunk) as u64,
                    len: piece.len() as u64,
                },
                pieces: vec![((), piece)],
            })
            .collect();
        let mut hasher = Xxh3_64::new();
        read_in_order(clients, requests, |(), bytes| hasher.update(bytes)).await?;
        let actual = hasher.digest();
        if actual != meta.checksum {
            // Dropping the unsealed writer abandons the object.
            return Err(Error::ChecksumMismatch {
                object,
                expected: meta.checksum,
                actual,
            });
        }
        Ok(writer)
    }
}

/// A pinned object's bytes in `range`, sent as an attachment.
struct ViewRange {
    view: ObjectView,
    range: Range<usize>,
}

impl AsRef<[u8]> for ViewRange {
    fn as_ref(&self) -> &[u8] {
        &self.view.as_bytes()[self.range.clone()]
    }
}

/// Parts of objects on another node, pulled into one object here ([`Transfers::pull_parts`]).
/// The object is this node's own and nobody else knows of it: it is deleted when this is
/// dropped (readers that still hold it keep its bytes until they let go), unless [`keep`]
/// hands it to an owner that deletes it later.
///
/// [`keep`]: PulledParts::keep
#[derive(Debug)]
pub(crate) struct PulledParts {
    object: ObjectId,
    parts: Vec<Part>,
    /// The store to delete the object from, while this owns it.
    owner: Option<ObjectStore>,
}

impl PulledParts {
    /// The object the parts were pulled into.
    pub fn object(&self) -> ObjectId {
        self.object
    }

    /// Where each part lies in the object, in the order they were asked for.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// Hands the object to the caller, who deletes it from now on.
    pub fn keep(mut self) -> ObjectId {
        self.owner = None;
        self.object
    }
}

impl Drop for PulledParts {
    fn drop(&mut self) {
        let Some(store) = &self.owner else {
            return;
        };
        match store.delete(self.object) {
            Ok(()) | Err(floe_objectstore::Error::NotFound { .. }) => {}
            Err(error) => {
                tracing::warn!(object = %self.object, %error, "cannot delete pulled parts");
            }
        }
    }
}

/// One piece of a part being pulled: where it comes from and where it goes.
struct Piece<'a> {
    part: usize,
    range: ByteRange,
    dest: &'a mut [u8],
}

/// One request of a pull: what it asks the holder for, and where each piece of the reply's
/// attachment goes (with what the checker needs to know of it), in order.
struct Request<'a, T> {
    /// The object it names first, for errors.
    object: ObjectId,
    ask: NodeRequest,
    pieces: Vec<(T, &'a mut [u8])>,
}

/// Reads `requests` over `clients` — each connection takes the next request when it is free,
/// so a slow one holds up only the request it is reading — straight into their places, and
/// hands every piece to `check` in request order (each as soon as those before it are in).
async fn read_in_order<T>(
    clients: Vec<RpcClient<NodeProtocol>>,
    requests: Vec<Request<'_, T>>,
    mut check: impl FnMut(T, &[u8]),
) -> Result<()> {
    let queue = Mutex::new(requests.into_iter().enumerate().collect::<VecDeque<_>>());
    let (arrived, mut arrivals) = tokio::sync::mpsc::unbounded_channel();
    let readers: Vec<_> = clients
        .into_iter()
        .map(|client| read_requests(client, &queue, arrived.clone()))
        .collect();
    drop(arrived);
    let in_order = async {
        let mut waiting = BTreeMap::new();
        let mut next = 0;
        while let Some((index, request)) = arrivals.recv().await {
            waiting.insert(index, request);
            while let Some(request) = waiting.remove(&next) {
                let Request { pieces, .. } = request;
                for (tag, bytes) in pieces {
                    check(tag, bytes);
                }
                next += 1;
            }
        }
        Ok(())
    };
    tokio::try_join!(join_all(readers), in_order)?;
    Ok(())
}

/// One connection's part of [`read_in_order`]: takes the next request until none is left and
/// reads its reply into the request's pieces, then hands it on to be checked.
async fn read_requests<'a, T>(
    mut client: RpcClient<NodeProtocol>,
    queue: &Mutex<VecDeque<(usize, Request<'a, T>)>>,
    arrived: UnboundedSender<(usize, Request<'a, T>)>,
) -> Result<()> {
    loop {
        let next = queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front();
        let Some((index, mut request)) = next else {
            return Ok(());
        };
        let mut dests: Vec<&mut [u8]> = request
            .pieces
            .iter_mut()
            .map(|(_, dest)| &mut **dest)
            .collect();
        match client.call_into_parts(&request.ask, &mut dests).await? {
            NodeResponse::Chunk => {}
            other => return Err(unexpected(request.object, &other)),
        }
        drop(dests);
        // The receiver only stops early when the transfer has failed anyway.
        let _ = arrived.send((index, request));
    }
}

/// Runs `futures` concurrently on the current task until all succeed or one fails. (A
/// `JoinSet` would need `'static` futures; these borrow disjoint parts of one object.)
async fn join_all<F: Future<Output = Result<()>>>(
    futures: impl IntoIterator<Item = F>,
) -> Result<()> {
    let mut pending: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    std::future::poll_fn(|cx| {
        let mut index = 0;
        while index < pending.len() {
            match pending[index].as_mut().poll(cx) {
                Poll::Ready(Ok(())) => {
                    drop(pending.swap_remove(index));
                }
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => index += 1,
            }
        }
        if pending.is_empty() {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    })
    .await
}

fn seal_verified(mut writer: ObjectWriter, expected: u64) -> Result<OutputRef> {
    let object = writer.object();
    let bytes = writer.as_mut_slice();
    let size = bytes.len() as u64;
    let checksum = xxh3_64(bytes);
    if checksum != expected {
        // Dropping the unsealed writer abandons the object.
        return Err(Error::ChecksumMismatch {
            object,
            expected,
            actual: checksum,
        });
    }
    writer.seal_with_checksum(checksum)?;
    Ok(OutputRef {
        object,
        size,
        checksum: Some(checksum),
        rows: None,
        parts: Vec::new(),
    })
}

/// `range` of a pinned object's bytes as an attachment: sent with `sendfile` from `file` (the
/// object's source file, see [`Transfers::source_file`]) when there is one.
/// An error unless one request may ask for this many ranges: at most
/// [`MAX_RANGES_PER_READ`].
fn check_count(ranges: &[ByteRange]) -> Result<()> {
    if ranges.len() > MAX_RANGES_PER_READ {
        return Err(refused_request(
            ranges,
            format!(
                "{} ranges are more than the {MAX_RANGES_PER_READ} one request may ask for",
                ranges.len()
            ),
        ));
    }
    Ok(())
}

/// A request for `ranges` refused for `reason`, named by its first range's object.
fn refused_request(ranges: &[ByteRange], reason: String) -> Error {
    Error::Transfer {
        object: ranges
            .first()
            .map_or(ObjectId::new(0), |range| range.object),
        reason,
    }
}

/// `dest` cut into each part's place as `packing` lays them out, the padding before each
/// zeroed.
fn part_places<'a>(packing: &Packing, mut dest: &'a mut [u8]) -> Vec<&'a mut [u8]> {
    let mut places = Vec::with_capacity(packing.parts.len());
    let mut at = 0u64;
    for &(offset, len) in &packing.parts {
        let (padding, tail) = dest.split_at_mut((offset - at) as usize);
        padding.fill(0);
        let (place, tail) = tail.split_at_mut(len as usize);
        places.push(place);
        dest = tail;
        at = offset + len;
    }
    places
}

/// The segment a loan names, opened read-only, if it is the one lent: on this host, named as
/// a store's segment is, with the device and inode numbers the holder gave.
fn open_lent_segment(host: &str, loan: &Loan) -> Result<std::fs::File, String> {
    if loan.host != host {
        return Err(format!("the holder runs on host {}, not here", loan.host));
    }
    // Only a store's segment, never a path the holder chose.
    let named_as_a_segment = loan
        .segment
        .strip_prefix("/floe-")
        .is_some_and(|name| !name.is_empty() && !name.contains('/') && !name.contains('\0'));
    if !named_as_a_segment {
        return Err(format!("{:?} is not a store's segment", loan.segment));
    }
    let source = ObjectSource::Segment {
        os_id: loan.segment.clone(),
    };
    let file = source
        .open_file()
        .map_err(|error| error.to_string())?
        .ok_or("the segment has no file")?;
    let metadata = file.metadata().map_err(|error| error.to_string())?;
    if (metadata.dev(), metadata.ino()) != (loan.device, loan.inode) {
        return Err(format!(
            "{} here is another file than the holder's segment",
            loan.segment
        ));
    }
    Ok(file)
}

/// Copies each part from `segment` at its lent offset into its place, [`BORROW_STEP`] at a
/// time, hashing each step while it is in the cache.
fn read_lent(
    segment: &std::fs::File,
    offsets: &[u64],
    places: &mut [&mut [u8]],
) -> std::io::Result<Vec<Xxh3_64>> {
    places
        .iter_mut()
        .zip(offsets)
        .map(|(place, &offset)| {
            let mut hasher = Xxh3_64::new();
            let mut at = offset;
            for step in place.chunks_mut(BORROW_STEP) {
                segment.read_exact_at(step, at)?;
                hasher.update(step);
                at += step.len() as u64;
            }
            Ok(hasher)
        })
        .collect()
}

/// Runs `work`, which blocks on system calls for milliseconds, where the runtime lets other
/// tasks move on meanwhile: on a multi-threaded runtime its thread hands its tasks to
/// another; elsewhere it runs in place.
fn run_blocking<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|handle| handle.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

fn attach(view: ObjectView, range: Range<usize>, file: Option<Arc<std::fs::File>>) -> Attachment {
    let offset = view.location().payload_offset() + range.start as u64;
    let attachment = Attachment::new(ViewRange { view, range });
    match file {
        Some(file) => attachment.in_file(FileRange { file, offset }),
        None => attachment,
    }
}

fn unexpected(object: ObjectId, response: &NodeResponse) -> Error {
    let shown = format!("{response:?}");
    Error::Transfer {
        object,
        reason: format!(
            "unexpected reply {}",
            shown.chars().take(120).collect::<String>()
        ),
    }
}

#[cfg(test)]
mod tests {
    use floe_core::config::{ByteSize, ClusterSecret, Config};
    use floe_objectstore::{Backing, StoreConfig};

    use super::*;

    fn transfers(dir: &std::path::Path) -> Transfers {
        let store = ObjectStore::open_with(
            StoreConfig {
                name: "transfer-unit".into(),
                capacity: 1 << 20,
                spill_threshold: 1.0,
                min_spilling_size: 1 << 20,
                spill_dir: dir.join("spill"),
                fallback_dir: dir.join("fallback"),
            },
            Backing::Heap,
        )
        .unwrap();
        let mut config = Config::default();
        config.cluster.secret = ClusterSecret::new("unit");
        config.node.transfer_inline_max = floe_core::config::ByteSize(8);
        Transfers::new(store, WireConfig::member(&config), &config.node)
    }

    fn range(object: ObjectId, offset: u64, len: u64) -> ByteRange {
        ByteRange {
            object,
            offset,
            len,
        }
    }

    /// A store in shared memory (a segment in /dev/shm), named for this test process.
    fn shared_transfers(dir: &std::path::Path, name: &str) -> Transfers {
        let store = ObjectStore::open(StoreConfig {
            name: format!("{name}-{}", std::process::id()),
            capacity: 4 << 20,
            spill_threshold: 1.0,
            min_spilling_size: 1 << 20,
            spill_dir: dir.join("spill"),
            fallback_dir: dir.join("fallback"),
        })
        .unwrap();
        let mut config = Config::default();
        config.cluster.secret = ClusterSecret::new("unit");
        config.net.max_frame = ByteSize::mib(1);
        Transfers::new(store, WireConfig::member(&config), &config.node)
    }

    #[test]
    fn a_loan_names_where_the_ranges_lie_in_the_segment_and_pins_them() {
        let dir = tempfile::tempdir().unwrap();
        let transfers = shared_transfers(dir.path(), "lend-unit");
        let Some(host) = transfers.host.clone() else {
            panic!("{BOOT_ID} cannot be read: loans are never made on this host");
        };
        let (first, second) = (ObjectId::new(1), ObjectId::new(2));
        transfers.store.put(first, b"0123456789").unwrap();
        transfers.store.put(second, b"abcdef").unwrap();
        let (loan, pins) = transfers
            .lend_ranges(&[range(first, 2, 3), range(second, 1, 4)])
            .unwrap();
        assert_eq!(loan.host, host);
        // Read as a borrower does: the segment, checked, at the lent offsets.
        let segment = open_lent_segment(&host, &loan).unwrap();
        let (mut three, mut four) = ([0u8; 3], [0u8; 4]);
        let hashers = read_lent(&segment, &loan.offsets, &mut [&mut three, &mut four]).unwrap();
        assert_eq!((&three, &four), (b"234", b"bcde"));
        assert_eq!(hashers[1].digest(), xxh3_64(b"bcde"));
        // Deleted while lent, the object's bytes stay where the loan says until it ends.
        transfers.store.delete(first).unwrap();
        let used = transfers.store.stats().used;
        drop(pins);
        assert!(transfers.store.stats().used < used, "the loan kept its pin");

        // Refused, never a path the holder chose: another host, another file by the
        // segment's name, or a name that is not a segment's.
        let refusals = [
            (
                Loan {
                    host: "another host".into(),
                    ..loan.clone()
                },
                "not here",
            ),
            (
                Loan {
                    inode: loan.inode + 1,
                    ..loan.clone()
                },
                "another file",
            ),
            (
                Loan {
                    segment: "/etc/passwd".into(),
                    ..loan.clone()
                },
                "not a store's segment",
            ),
            (
                Loan {
                    segment: "/floe-../x".into(),
                    ..loan.clone()
                },
                "not a store's segment",
            ),
            (
                Loan {
                    segment: "/floe-".into(),
                    ..loan.clone()
                },
                "not a store's segment",
            ),
        ];
        for (refused, reason) in refusals {
            let error = open_lent_segment(&host, &refused).unwrap_err();
            assert!(error.contains(reason), "{refused:?}: {error}");
        }
        // A loan past the segment's end is not read.
        assert!(read_lent(&segment, &[u64::MAX - 2], &mut [&mut three]).is_err());

        // No frame carries lent bytes: a range past a frame is lent, not read.
        let large = ObjectId::new(3);
        let bytes: Vec<u8> = (0..2 << 20).map(|i| (i % 251) as u8).collect();
        transfers.store.put(large, &bytes).unwrap();
        let whole = [range(large, 0, 2 << 20)];
        assert!(matches!(
            transfers.read_ranges(&whole),
            Err(Error::Transfer { .. })
        ));
        let (loan, _pins) = transfers.lend_ranges(&whole).unwrap();
        let mut read = vec![0u8; 2 << 20];
        read_lent(&segment, &loan.offsets, &mut [&mut read]).unwrap();
        assert!(read == bytes, "not the object's bytes");
        assert!(
            transfers
                .lend_ranges(&vec![range(large, 0, 1); MAX_RANGES_PER_READ + 1])
                .is_err()
        );
    }

    #[test]
    fn an_object_outside_a_segment_is_not_lent() {
        let dir = tempfile::tempdir().unwrap();
        let transfers = transfers(dir.path());
        let object = ObjectId::new(1);
        transfers.store.put(object, b"in the heap").unwrap();
        let Err(Error::Transfer { reason, .. }) = transfers.lend_ranges(&[range(object, 0, 3)])
        else {
            panic!("a heap object was lent");
        };
        assert!(
            reason.contains("cannot lend") && reason.contains("not in the store's segment"),
            "{reason}"
        );
        assert!(transfers.lend_ranges(&[]).is_err(), "nothing to lend");
    }

    #[test]
    fn a_checksum_mismatch_abandons_the_object_and_a_match_seals_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = transfers(dir.path()).store;
        let object = ObjectId::new(7);
        let mut writer = store.create(object, 4).unwrap();
        writer.as_mut_slice().copy_from_slice(b"abcd");
        let error = seal_verified(writer, xxh3_64(b"abce")).unwrap_err();
        assert!(
            matches!(error, Error::ChecksumMismatch { object: o, .. } if o == object),
            "{error}"
        );
        assert!(!store.contains(object), "a corrupt object must not stay");

        let mut writer = store.create(object, 4).unwrap();
        writer.as_mut_slice().copy_from_slice(b"abcd");
        let sealed = seal_verified(writer, xxh3_64(b"abcd")).unwrap();
        assert_eq!((sealed.size, sealed.checksum), (4, Some(xxh3_64(b"abcd"))));
        assert_eq!(store.get(object).unwrap().as_bytes(), b"abcd");
    }

    #[test]
    fn pulled_parts_are_deleted_when_dropped_unless_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = transfers(dir.path()).store;
        let pulled = |object| {
            store.put(object, b"parts").unwrap();
            PulledParts {
                object,
                parts: Vec::new(),
                owner: Some(store.clone()),
            }
        };
        let (dropped, read_while_dropped, kept) =
            (ObjectId::new(1), ObjectId::new(2), ObjectId::new(3));
        drop(pulled(dropped));
        assert!(!store.contains(dropped));
        // A reader still holding the object keeps its bytes until it lets go.
        let copy = pulled(read_while_dropped);
        let view = store.get(read_while_dropped).unwrap();
        drop(copy);
        assert_eq!(view.as_bytes(), b"parts");
        drop(view);
        assert!(!store.contains(read_while_dropped));
        assert_eq!(pulled(kept).keep(), kept);
        assert!(store.contains(kept));
    }

    #[test]
    fn small_objects_go_inline_and_chunks_stay_inside_the_object() {
        let dir = tempfile::tempdir().unwrap();
        let transfers = transfers(dir.path());
        let (small, large) = (ObjectId::new(1), ObjectId::new(2));
        transfers.store.put(small, b"12345678").unwrap();
        transfers.store.put(large, b"0123456789").unwrap();

        let meta = transfers.meta(small).unwrap();
        assert_eq!(meta.inline, Some(Bytes(b"12345678".to_vec())));
        assert_eq!(meta.checksum, xxh3_64(b"12345678"));
        let meta = transfers.meta(large).unwrap();
        assert_eq!((meta.size, meta.inline), (10, None));

        let bytes =
            |attachment: Attachment| attachment.parts().flatten().copied().collect::<Vec<u8>>();
        assert_eq!(bytes(transfers.read_chunk(large, 3, 4).unwrap()), b"3456");
        assert_eq!(bytes(transfers.read_chunk(large, 8, 100).unwrap()), b"89");
        assert!(transfers.read_chunk(large, 11, 1).is_err());
        assert!(matches!(
            transfers.meta(ObjectId::new(3)),
            Err(Error::Store(floe_objectstore::Error::NotFound { .. }))
        ));
    }

    #[test]
    fn ranges_are_answered_only_inside_their_objects_and_within_the_bounds_of_a_request() {
        let dir = tempfile::tempdir().unwrap();
        let transfers = transfers(dir.path());
        let (first, second) = (ObjectId::new(1), ObjectId::new(2));
        transfers.store.put(first, b"0123456789").unwrap();
        transfers.store.put(second, b"abcdef").unwrap();
        let bytes =
            |attachment: Attachment| attachment.parts().flatten().copied().collect::<Vec<u8>>();

        let read = transfers
            .read_ranges(&[range(first, 2, 3), range(second, 0, 2), range(first, 9, 1)])
            .unwrap();
        assert_eq!(bytes(read), b"234ab9");
        // An empty range only asks whether the object is here.
        assert!(bytes(transfers.read_ranges(&[range(second, 0, 0)]).unwrap()).is_empty());
        assert!(matches!(
            transfers.read_ranges(&[range(ObjectId::new(3), 0, 0)]),
            Err(Error::Store(floe_objectstore::Error::NotFound { .. }))
        ));
        // Past the end, overflowing, more than a frame, or too many ranges: refused whole.
        for ranges in [
            vec![range(first, 8, 3)],
            vec![range(first, u64::MAX, 2)],
            vec![range(first, 0, u64::MAX), range(second, 0, 2)],
            vec![range(first, 0, transfers.wire.max_frame as u64)],
            vec![range(first, 0, 1); MAX_RANGES_PER_READ + 1],
        ] {
            let refused = transfers.read_ranges(&ranges);
            assert!(
                matches!(refused, Err(Error::Transfer { .. })),
                "{} ranges were answered",
                ranges.len()
            );
        }
        assert!(
            transfers
                .read_ranges(&vec![range(first, 0, 1); MAX_RANGES_PER_READ])
                .is_ok()
        );
    }
}
