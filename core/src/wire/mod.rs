//! floe's internal RPC protocol.
//!
//! Layers, bottom up: [`codec`] (the only place bytes are encoded, with [`bytes`] for byte
//! fields), [`frame`] (length-prefixed frames with a limit checked before allocation, and
//! timeouts), [`handshake`] (protocol version and credential) and [`rpc`] (typed
//! request/response over a handshaken connection).

pub mod bytes;
pub mod codec;
pub mod depth;
pub mod frame;
pub mod handshake;
pub mod nesting;
pub mod rpc;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use frame::FramedStream;
pub use handshake::{PROTOCOL_VERSION, Refusal};
pub use rpc::{
    AttachedReply, Attachment, FileRange, Handler, Peer, Protocol, RemoteError, RemoteErrorKind,
    RpcClient, RpcServer,
};
pub use tls::{TlsContext, TlsError, WireTls};

use crate::auth::{Authenticator, Credential, Identity};
use crate::config::{Config, TimeoutsConfig};

/// What a connection needs to know, taken from [`Config`]: the credential this process
/// presents, and how its servers verify the credentials of others.
#[derive(Debug, Clone)]
pub struct WireConfig {
    pub identity: Identity,
    pub authenticator: Arc<Authenticator>,
    pub max_frame: usize,
    pub timeouts: TimeoutsConfig,
    pub tls: WireTls,
}

impl WireConfig {
    /// A cluster member (a node, or a replica's clients of nodes): presents the cluster secret.
    pub fn member(config: &Config) -> Self {
        Self::presenting(
            config,
            Credential::Member {
                secret: config.cluster.secret.clone(),
            },
        )
    }

    /// A client: presents `client.token`.
    pub fn client(config: &Config) -> Self {
        Self::presenting(
            config,
            Credential::Client {
                token: config.client.token.clone(),
            },
        )
    }

    /// Scheduler replica `id`: presents the replica secret, and verifies replicas and node
    /// tickets.
    pub fn replica(config: &Config, id: u64) -> Self {
        Self::presenting(
            config,
            Credential::Replica {
                id,
                secret: config.scheduler.replica_secret.clone(),
            },
        )
    }

    fn presenting(config: &Config, credential: Credential) -> Self {
        let replica_secret = Some(config.scheduler.replica_secret.clone());
        Self {
            identity: Identity::new(credential),
            authenticator: Arc::new(Authenticator::new(
                config.cluster.secret.clone(),
                replica_secret,
                config.tokens_file(),
            )),
            // `Config::validate` caps the frame at 1 GiB, which fits every target's usize.
            max_frame: usize::try_from(config.net.max_frame.bytes()).unwrap_or(usize::MAX),
            timeouts: config.timeouts.clone(),
            tls: WireTls::from_config(&config.tls),
        }
    }

    /// The same settings over the TLS files `tls` (plaintext when they are empty).
    pub fn with_tls(self, tls: &crate::config::TlsConfig) -> Self {
        Self {
            tls: WireTls::from_config(tls),
            ..self
        }
    }

    /// The same settings presenting another credential (its own identity, not shared).
    pub fn with_credential(&self, credential: Credential) -> Self {
        Self {
            identity: Identity::new(credential),
            ..self.clone()
        }
    }
}

/// Awaits `work` for at most `limit`; past it, fails with [`WireError::Timeout`] naming `op`.
pub async fn within<T>(
    limit: Duration,
    op: &'static str,
    work: impl std::future::Future<Output = T>,
) -> Result<T, WireError> {
    tokio::time::timeout(limit, work)
        .await
        .map_err(|_| WireError::Timeout { op, after: limit })
}

impl WireError {
    /// True when the error comes from this process's or the cluster's configuration (token,
    /// release, TLS files and certificates), so another replica would answer the same.
    pub fn is_misconfiguration(&self) -> bool {
        matches!(
            self,
            WireError::Refused { .. }
                | WireError::NoCredential
                | WireError::Tls(_)
                | WireError::Certificate { .. }
                | WireError::ServerNotTls { .. }
        )
    }
}

/// A failure of the connection or of the peer's protocol. After any variant but `Remote` the
/// connection is dropped.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{op} failed: {source}")]
    Io {
        op: &'static str,
        source: std::io::Error,
    },
    #[error("{op} timed out after {after:?}")]
    Timeout { op: &'static str, after: Duration },
    #[error("the peer closed the connection")]
    Closed,
    #[error("the connection closed in the middle of a {expected}-byte frame")]
    Truncated { expected: usize },
    #[error("frame of {len} bytes exceeds the {max}-byte limit (net.max_frame)")]
    FrameTooLarge { len: u64, max: u64 },
    #[error("cannot encode a message: {0}")]
    Encode(String),
    #[error("cannot decode the {what}: {message}")]
    Decode { what: &'static str, message: String },
    #[error("not a floe peer: {0}")]
    NotFloe(String),
    #[error("{message}")]
    Refused { reason: Refusal, message: String },
    #[error("reply to request {got} arrived while waiting for request {expected}")]
    IdMismatch { expected: u64, got: u64 },
    #[error(
        "this process has no credential: set cluster.secret (FLOE_CLUSTER_SECRET) on replicas \
         and nodes, client.token (FLOE_CLIENT_TOKEN) on clients"
    )]
    NoCredential,
    #[error("{0}")]
    Tls(Arc<TlsError>),
    #[error("TLS handshake with {addr} failed: {source}")]
    TlsHandshake {
        addr: String,
        source: std::io::Error,
    },
    #[error(
        "TLS handshake with {addr} failed: {source} (is tls.ca the CA that signed the \
         cluster's certificates, and does the certificate name this host?)"
    )]
    Certificate { addr: String, source: rustls::Error },
    #[error(
        "{addr} does not speak TLS: is the server running without [tls]? (plaintext is \
         served only on loopback)"
    )]
    ServerNotTls { addr: String },
    #[error(
        "refusing to serve plaintext on {addr}, which is not a loopback address: set tls.ca, \
         tls.cert and tls.key"
    )]
    PlaintextOffLoopback { addr: SocketAddr },
    #[error("remote error: {0}")]
    Remote(#[from] RemoteError),
}
