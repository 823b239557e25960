//! floe processes on loopback: scheduler replicas ([`LocalSchedulers`]) and node agents
//! ([`LocalNode`]), started from the `floe` binary. They back [`crate::LocalCluster`] and the
//! integration tests and benchmarks.
//!
//! **Invariant:** every process started here is killed when its owner is dropped, even when a
//! test fails half-way, and a node's shared-memory segment goes with it.

mod node;
mod schedulers;

use std::path::PathBuf;

pub use node::{LocalNode, LocalNodeConfig};
pub use schedulers::{LocalSchedulers, LocalSchedulersConfig};

/// Why a local process could not be started, reached or stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Api(#[from] floe_api::Error),
    #[error(transparent)]
    Wire(#[from] floe_core::WireError),
    #[error("local node: {0}")]
    Node(String),
    #[error("local schedulers: {0}")]
    Schedulers(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }
}
