//! floe processes on loopback: scheduler replicas ([`LocalSchedulers`]) and node agents
//! ([`LocalNode`]), started from the `floe` binary. They back [`crate::LocalCluster`] and the
//! integration tests and benchmarks.
//!
//! **Invariant:** every process started here is killed when its owner is dropped, even when a
//! test fails half-way, and a node's shared-memory segment goes with it.

mod credentials;
mod node;
mod schedulers;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};

pub use credentials::{ADMIN_TOKEN_NAME, LocalCredentials};
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
    #[error("local credentials: {0}")]
    Credentials(String),
    #[error("no loopback port was free after {0} tries")]
    NoFreePort(usize),
    #[error(
        "{setting}={port}: the port is taken on 127.0.0.1 ({source}); pick another or leave it unset"
    )]
    PortTaken {
        setting: &'static str,
        port: u16,
        source: std::io::Error,
    },
    #[error("{setting}={port}: {processes} processes need ports counting up from it, past 65535")]
    PortRange {
        setting: &'static str,
        port: u16,
        processes: usize,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }
}

/// Which loopback port a local process listens on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LocalPort {
    /// One nothing listens on, picked at start.
    #[default]
    Free,
    /// This one, named by a setting; the `i`-th process of a kind gets `port + i`.
    Fixed { setting: &'static str, port: u16 },
}

impl LocalPort {
    /// The port of the `index`-th of `processes` processes that take ports from `self`: a
    /// fixed one must be free now, or starting is refused naming the setting.
    pub(crate) fn pick(self, index: usize, processes: usize) -> Result<u16> {
        let (setting, first) = match self {
            LocalPort::Free => return free_port(),
            LocalPort::Fixed { setting, port } => (setting, port),
        };
        let port = u16::try_from(index)
            .ok()
            .and_then(|index| first.checked_add(index))
            .ok_or(Error::PortRange {
                setting,
                port: first,
                processes,
            })?;
        std::net::TcpListener::bind(("127.0.0.1", port)).map_err(|source| Error::PortTaken {
            setting,
            port,
            source,
        })?;
        Ok(port)
    }
}

/// The ports of a local cluster's processes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LocalPorts {
    pub scheduler_rpc: LocalPort,
    pub scheduler_http: LocalPort,
    /// The first node's; the others count up from it.
    pub node_rpc: LocalPort,
}

/// How many probes [`free_port`] makes before it gives up.
const PORT_PROBES: usize = 1000;

/// A loopback port that nothing listened on when probed and that this process has not handed
/// out before. The processes started here bind their ports themselves, later: a port released
/// by one probe is often the next probe's, so two processes of one test would otherwise be
/// given the same port and the second would fail to listen.
fn free_port() -> Result<u16> {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    for _ in 0..PORT_PROBES {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|probe| probe.local_addr())
            .map_err(Error::io("binding a probe socket on", "127.0.0.1:0"))?
            .port();
        let mut handed_out = HANDED_OUT.lock().unwrap_or_else(PoisonError::into_inner);
        if handed_out.insert(port) {
            return Ok(port);
        }
    }
    Err(Error::NoFreePort(PORT_PROBES))
}
