//! floe-core: the pieces every other floe crate agrees on.
//!
//! - [`ids`]: newtype identifiers for nodes, jobs, tasks, objects and actors.
//! - [`auth`]: credentials (cluster secret, replica secret, node tickets, scoped client
//!   tokens), how servers verify them, and the verified `Principal`.
//! - [`config`]: the one [`Config`](config::Config) struct, loaded from a TOML file, then
//!   `FLOE_*` environment variables, then command-line overrides.
//! - [`expr`]: the expression language (columns, literals, arithmetic, comparison, strings,
//!   casts, null handling) with type inference against an Arrow schema.
//! - [`job`]: a submitted job (plan and options), its progress, stats and output blocks.
//! - [`plan`]: the Dataset logical plan, its optimizer rules and the physical stages.
//! - [`hash`]: xxh3, the one hash of checksums, object names, fingerprints and partitions.
//! - [`fingerprint`]: 128-bit content addresses of sources and transforms, and the lineage
//!   kept beside them so a cache miss can be explained.
//! - [`wire`]: the internal RPC protocol — framing, handshake, the bincode codec and a typed
//!   request/response helper. It is the only module that encodes bytes for the network.

pub mod auth;
pub mod config;
pub mod expr;
pub mod fingerprint;
pub mod hash;
pub mod ids;
pub mod job;
pub mod location;
pub mod plan;
pub mod wire;

pub use config::{Config, ConfigError};
pub use fingerprint::{Fingerprint, FingerprintError};
pub use ids::{ActorId, IdError, JobId, LeaseId, NodeId, ObjectId, SubmissionId, TaskId};
pub use plan::PlanError;
pub use wire::WireError;

/// Every error floe-core can return.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Fingerprint(#[from] FingerprintError),
    #[error(transparent)]
    Id(#[from] IdError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Wire(#[from] WireError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
