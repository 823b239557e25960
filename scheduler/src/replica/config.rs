//! What a replica is started with: its id, every replica's address (`--peers`), and the
//! scheduler and wire settings.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use floe_core::config::{Config, JobsConfig, NodesConfig, SchedulerConfig};
use floe_core::wire::WireConfig;

use crate::{Error, Result};

/// Parses `1=host:port,2=host:port,…` into replica id → address.
pub fn parse_peers(spec: &str) -> Result<BTreeMap<u64, String>> {
    let mut peers = BTreeMap::new();
    for part in spec
        .split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
    {
        let (id, addr) = part
            .split_once('=')
            .ok_or_else(|| Error::Peers(format!("{part:?} is not id=host:port")))?;
        let id: u64 =
            id.trim().parse().ok().filter(|id| *id > 0).ok_or_else(|| {
                Error::Peers(format!("replica id {id:?} is not a positive integer"))
            })?;
        let addr = addr.trim();
        port_of(addr)?;
        if peers.insert(id, addr.to_owned()).is_some() {
            return Err(Error::Peers(format!("replica id {id} appears twice")));
        }
    }
    if peers.len() % 2 == 0 {
        return Err(Error::Peers(format!(
            "{} replicas given; use an odd number (3 or 5) so a majority survives failures",
            peers.len()
        )));
    }
    Ok(peers)
}
pub(super) fn port_of(addr: &str) -> Result<u16> {
    addr.rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .ok_or_else(|| Error::Peers(format!("{addr:?} is not host:port")))
}

/// Everything a replica needs to start.
#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    pub id: u64,
    /// Every replica's address (its own included); it listens on its own entry's port.
    pub peers: BTreeMap<u64, String>,
    pub bind_host: IpAddr,
    pub scheduler: SchedulerConfig,
    /// How long finished jobs, their outputs and dead nodes are kept.
    pub jobs: JobsConfig,
    pub nodes: NodesConfig,
    /// This replica's history file (`<data_dir>/history.jsonl`); `None` keeps no history.
    pub history: Option<PathBuf>,
    /// Presents this replica's credential, and verifies replicas and node tickets.
    pub wire: WireConfig,
    /// How the leader calls nodes (freeing released outputs): as a cluster member, since
    /// nodes hold no replica secret to verify a replica with.
    pub node_wire: WireConfig,
}

impl ReplicaConfig {
    pub fn new(config: &Config, id: u64, peers: BTreeMap<u64, String>) -> Result<Self> {
        if !peers.contains_key(&id) {
            return Err(Error::Peers(format!(
                "--id {id} is not one of the replicas {:?}",
                peers.keys().collect::<Vec<_>>()
            )));
        }
        Ok(Self {
            id,
            peers,
            bind_host: config.net.bind_host,
            scheduler: config.scheduler.clone(),
            jobs: config.jobs.clone(),
            nodes: config.nodes.clone(),
            history: Some(config.paths.data_dir.join(crate::history::HISTORY_FILE)),
            wire: WireConfig::replica(config, id),
            node_wire: WireConfig::member(config),
        })
    }
}
