//! Moving objects between nodes.
//!
//! The puller asks the holder for the object's size and checksum; an object up to
//! `node.transfer_inline_max` comes with that answer. A larger one is read in
//! `node.transfer_chunk` pieces over several connections at once, at most
//! `node.transfer_max_in_flight` bytes of requests outstanding, straight into a new object of
//! the local store. The xxh3-64 of the bytes must match the holder's before the object is
//! sealed; a mismatch abandons it. Concurrent pulls of one object share a single transfer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use floe_core::ObjectId;
use floe_core::config::NodeConfig;
use floe_core::wire::{PeerKind, RpcClient, WireConfig};
use floe_objectstore::{ObjectStore, ObjectWriter};
use tokio::sync::OnceCell;
use tokio::task::JoinSet;
use xxhash_rust::xxh3::xxh3_64;

use super::protocol::{Bytes, NodeProtocol, NodeRequest, NodeResponse, ObjectMeta, OutputRef};
use super::{Error, Result};

/// Room a chunk reply needs besides its bytes (request id, enum tags, length prefix).
const REPLY_ENVELOPE: u64 = 4096;

type SharedPull = Arc<OnceCell<Result<OutputRef, String>>>;

pub(crate) struct Transfers {
    store: ObjectStore,
    wire: WireConfig,
    chunk: u64,
    max_in_flight: u64,
    inline_max: u64,
    pulls: Mutex<HashMap<ObjectId, SharedPull>>,
    pulls_started: AtomicU64,
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
            pulls: Mutex::new(HashMap::new()),
            pulls_started: AtomicU64::new(0),
        }
    }

    pub fn pulls_started(&self) -> u64 {
        self.pulls_started.load(Ordering::Relaxed)
    }

    /// The size and checksum of a local object, with its bytes when small.
    pub fn meta(&self, object: ObjectId) -> Result<ObjectMeta> {
        let view = self.store.get(object)?;
        let bytes = view.as_bytes();
        Ok(ObjectMeta {
            size: bytes.len() as u64,
            checksum: xxh3_64(bytes),
            inline: (bytes.len() as u64 <= self.inline_max).then(|| Bytes(bytes.to_vec())),
        })
    }

    pub fn read_chunk(&self, object: ObjectId, offset: u64, len: u64) -> Result<Bytes> {
        let view = self.store.get(object)?;
        let bytes = view.as_bytes();
        let start = usize::try_from(offset)
            .ok()
            .filter(|start| *start <= bytes.len());
        let range = start.and_then(|start| {
            let end = start
                .saturating_add(usize::try_from(len).ok()?)
                .min(bytes.len());
            Some(start..end)
        });
        let range = range.ok_or_else(|| Error::Transfer {
            object,
            reason: format!(
                "offset {offset} lies past the object's {} bytes",
                bytes.len()
            ),
        })?;
        Ok(Bytes(bytes[range].to_vec()))
    }

    /// Makes `object` local, pulling it from `holder` unless it is here already.
    pub async fn pull(&self, object: ObjectId, holder: &str) -> Result<OutputRef> {
        if self.store.contains(object) {
            let meta = self.meta(object)?;
            return Ok(OutputRef {
                object,
                size: meta.size,
                checksum: meta.checksum,
                rows: None,
            });
        }
        let shared = Arc::clone(
            self.pulls
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(object)
                .or_default(),
        );
        let outcome = shared
            .get_or_init(|| async {
                self.pulls_started.fetch_add(1, Ordering::Relaxed);
                self.fetch(object, holder)
                    .await
                    .map_err(|error| error.to_string())
            })
            .await
            .clone();
        {
            let mut pulls = self.pulls.lock().unwrap_or_else(PoisonError::into_inner);
            if pulls
                .get(&object)
                .is_some_and(|current| Arc::ptr_eq(current, &shared))
            {
                pulls.remove(&object);
            }
        }
        outcome.map_err(|reason| Error::Transfer { object, reason })
    }

    async fn fetch(&self, object: ObjectId, holder: &str) -> Result<OutputRef> {
        let mut client =
            RpcClient::<NodeProtocol>::connect(holder, self.wire.clone(), PeerKind::Node).await?;
        let meta = match client.call(&NodeRequest::ObjectMeta { object }).await? {
            NodeResponse::ObjectMeta(meta) => meta,
            other => return Err(unexpected(object, &other)),
        };
        let writer = self.store.create(object, meta.size)?;
        let writer = match meta.inline {
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
                writer
            }
            None => {
                self.fetch_chunks(object, holder, client, meta.size, writer)
                    .await?
            }
        };
        seal_verified(writer, meta.checksum)
    }

    /// Fills `writer` with chunks read over parallel connections.
    async fn fetch_chunks(
        &self,
        object: ObjectId,
        holder: &str,
        first: RpcClient<NodeProtocol>,
        size: u64,
        writer: ObjectWriter,
    ) -> Result<ObjectWriter> {
        let chunks = size.div_ceil(self.chunk);
        let connections = (self.max_in_flight / self.chunk).clamp(1, chunks.max(1));
        let writer = Arc::new(Mutex::new(writer));
        let next_chunk = Arc::new(AtomicU64::new(0));
        let mut readers = JoinSet::new();
        let mut first = Some(first);
        for _ in 0..connections {
            let client = match first.take() {
                Some(client) => client,
                None => RpcClient::connect(holder, self.wire.clone(), PeerKind::Node).await?,
            };
            readers.spawn(read_chunks(
                client,
                object,
                size,
                self.chunk,
                Arc::clone(&next_chunk),
                Arc::clone(&writer),
            ));
        }
        while let Some(joined) = readers.join_next().await {
            joined.map_err(|error| Error::Transfer {
                object,
                reason: format!("a chunk reader failed: {error}"),
            })??;
        }
        Arc::try_unwrap(writer)
            .map(|writer| writer.into_inner().unwrap_or_else(PoisonError::into_inner))
            .map_err(|_| Error::Transfer {
                object,
                reason: "a chunk reader outlived the transfer".into(),
            })
    }
}

/// One connection's share of a transfer: claims the next chunk until none are left.
async fn read_chunks(
    mut client: RpcClient<NodeProtocol>,
    object: ObjectId,
    size: u64,
    chunk: u64,
    next_chunk: Arc<AtomicU64>,
    writer: Arc<Mutex<ObjectWriter>>,
) -> Result<()> {
    loop {
        let offset = next_chunk.fetch_add(1, Ordering::Relaxed) * chunk;
        if offset >= size {
            return Ok(());
        }
        let len = chunk.min(size - offset);
        let request = NodeRequest::ReadChunk {
            object,
            offset,
            len,
        };
        let bytes = match client.call(&request).await? {
            NodeResponse::Chunk(Bytes(bytes)) => bytes,
            other => return Err(unexpected(object, &other)),
        };
        if bytes.len() as u64 != len {
            return Err(Error::Transfer {
                object,
                reason: format!("asked for {len} bytes at {offset}, got {}", bytes.len()),
            });
        }
        // `offset + len <= size`, the writer's length, which fits in usize.
        let start = offset as usize;
        let mut writer = writer.lock().unwrap_or_else(PoisonError::into_inner);
        writer.as_mut_slice()[start..start + bytes.len()].copy_from_slice(&bytes);
    }
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
    writer.seal()?;
    Ok(OutputRef {
        object,
        size,
        checksum,
        rows: None,
    })
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
    use floe_core::config::{ClusterToken, Config};
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
        config.cluster.token = ClusterToken::new("unit");
        config.node.transfer_inline_max = floe_core::config::ByteSize(8);
        Transfers::new(store, WireConfig::from_config(&config), &config.node)
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
        assert_eq!((sealed.size, sealed.checksum), (4, xxh3_64(b"abcd")));
        assert_eq!(store.get(object).unwrap().as_bytes(), b"abcd");
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

        assert_eq!(transfers.read_chunk(large, 3, 4).unwrap().0, b"3456");
        assert_eq!(transfers.read_chunk(large, 8, 100).unwrap().0, b"89");
        assert!(transfers.read_chunk(large, 11, 1).is_err());
        assert!(matches!(
            transfers.meta(ObjectId::new(3)),
            Err(Error::Store(floe_objectstore::Error::NotFound { .. }))
        ));
    }
}
