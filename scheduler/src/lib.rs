//! floe-scheduler: the Raft-replicated control plane of a floe cluster.
//!
//! - [`storage`]: the Raft log behind the [`storage::LogStore`] trait — in memory for tests,
//!   or durable on disk (a checksummed WAL, hard state and snapshots).
//! - [`replica`]: one scheduler replica — the task that owns the `RawNode` and applies
//!   [`floe_api::state::Command`]s to the replicated state, the transport between replicas,
//!   health checks, and the RPC service clients and nodes call.
//! - [`http`]: the REST job API, the dashboard and its JSON API, and Prometheus metrics.
//!
//! The state machine, placement and the protocol types live in floe-api, which every other
//! process links; this crate adds what only a replica needs (raft, the log, actix-web).

pub mod history;
pub mod http;
pub mod logging;
pub mod replica;
pub mod storage;

use std::path::PathBuf;

use floe_core::WireError;

/// Every error floe-scheduler can return.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is corrupt at byte {offset}: {reason}", path.display())]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    /// A write that would break the log's shape (a gap, or an overwrite of compacted entries).
    #[error("raft log invariant broken: {0}")]
    LogInvariant(String),
    #[error(
        "{} is in use by another replica (its lock is held); each replica needs its own \
         paths.data_dir",
        path.display()
    )]
    LogInUse { path: PathBuf },
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    #[error("cannot decode a raft {what}: {message}")]
    Protobuf { what: &'static str, message: String },
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("invalid --peers: {0}")]
    Peers(String),
    #[error("cannot start the raft thread: {0}")]
    RaftThreadStart(#[source] std::io::Error),
    #[error("the raft thread panicked: {0}")]
    RaftThreadPanicked(String),
    #[error("no scheduler replica answered: {0}")]
    NoReplica(String),
    #[error(transparent)]
    Placement(#[from] floe_api::placement::PlacementError),
    #[error(transparent)]
    Api(#[from] floe_api::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }
}
