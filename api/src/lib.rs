//! floe-api: what the processes of a floe cluster say to each other, and the data they share.
//!
//! - [`scheduler_protocol`]: the RPC service every scheduler replica serves to clients, nodes
//!   and drivers.
//! - [`node_protocol`]: the RPC service every node agent serves: tasks, object transfer,
//!   actor calls, status.
//! - [`state`]: the replicated cluster state (nodes, jobs, actors, the cache index) and the
//!   [`state::Command`]s that change it. The scheduler replicates it; everyone else reads it.
//! - [`placement`]: pure placement logic over that state (SPREAD, DEFAULT, affinity, memory
//!   hints).
//! - [`lease`]: placement leases, resources the leader grants a job's driver to place its
//!   tasks in, and the leader's table of them.
//! - [`authz`]: who may send each request and propose each command (one exhaustive,
//!   pure decision per message, against the verified principal and the leader's state).
//! - [`client`]: [`client::SchedulerClient`], which knows every replica and follows the leader.
//! - [`fetch`]: reading an object's bytes from its holder, checksum verified.
//!
//! **Invariant:** this crate depends on floe-core, serde and tokio only: no raft, no actix, no
//! Arrow compute, so every program that talks to a cluster can link it cheaply.

pub mod authz;
pub mod client;
pub mod fetch;
pub mod lease;
pub mod node_protocol;
pub mod placement;
pub mod scheduler_protocol;
pub mod state;

use floe_core::WireError;

/// Every error floe-api can return.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("invalid --peers: {0}")]
    Peers(String),
    #[error("no scheduler replica answered: {0}")]
    NoReplica(String),
    #[error("the scheduler refused the node's registration: {0}")]
    RegistrationRefused(String),
    #[error(transparent)]
    Placement(#[from] placement::PlacementError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
