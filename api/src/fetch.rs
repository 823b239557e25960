//! Reading one object's bytes from the node that holds it, as a client reads a result block:
//! its metadata, then chunks, each the reply's attachment, checked against the holder's
//! checksum before anyone decodes them. The Rust client and the scheduler's HTTP API both read
//! result blocks this way.

use floe_core::ObjectId;
use floe_core::hash::xxh3_64;
use floe_core::wire::RpcClient;

use crate::node_protocol::{NodeProtocol, NodeRequest, NodeResponse};

/// An object is read in chunks of this size.
pub const READ_CHUNK: u64 = 5 << 20;

/// Why an object's bytes could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The node did not answer, or no longer holds it.
    #[error("{0}")]
    Unavailable(String),
    #[error("its bytes arrived damaged (checksum mismatch)")]
    Damaged,
    #[error("the node answered {0}; are client and cluster the same release?")]
    Unexpected(String),
}

/// The bytes of `object` from the node at the other end of `client`, checksum verified.
pub async fn fetch_object(
    client: &mut RpcClient<NodeProtocol>,
    object: ObjectId,
) -> Result<Vec<u8>, FetchError> {
    let unavailable = |error: floe_core::WireError| FetchError::Unavailable(error.to_string());
    let meta = match client.call(&NodeRequest::ObjectMeta { object }).await {
        Ok(NodeResponse::ObjectMeta(meta)) => meta,
        Ok(other) => return Err(FetchError::Unexpected(format!("{other:?}"))),
        Err(error) => return Err(unavailable(error)),
    };
    let bytes = match meta.inline {
        Some(bytes) => bytes.0,
        None => {
            // The node's word on the size only guides the first allocation, up to a chunk.
            let mut bytes =
                Vec::with_capacity(usize::try_from(meta.size.min(READ_CHUNK)).unwrap_or(0));
            while (bytes.len() as u64) < meta.size {
                let offset = bytes.len() as u64;
                let len = READ_CHUNK.min(meta.size - offset);
                // `len` is at most a chunk.
                bytes.resize(bytes.len() + len as usize, 0);
                let request = NodeRequest::ReadChunk {
                    object,
                    offset,
                    len,
                };
                let piece = &mut bytes[offset as usize..];
                match client.call_into(&request, piece).await {
                    Ok(NodeResponse::Chunk) => {}
                    Ok(other) => return Err(FetchError::Unexpected(format!("{other:?}"))),
                    Err(error) => return Err(unavailable(error)),
                }
            }
            bytes
        }
    };
    if xxh3_64(&bytes) != meta.checksum {
        return Err(FetchError::Damaged);
    }
    Ok(bytes)
}
