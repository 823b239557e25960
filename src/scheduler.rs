//! `floe scheduler`: run one replica of the Raft-replicated scheduler.

use anyhow::Context;
use floe_core::Config;
use floe_scheduler::replica::{Replica, ReplicaConfig, parse_peers};
use floe_scheduler::storage::DiskLog;

#[derive(Debug, clap::Args)]
pub struct SchedulerArgs {
    /// This replica's id: one of the ids in --peers.
    #[arg(long)]
    id: u64,
    /// Every replica of the cluster, this one included, as id=host:port,… (3 or 5 of them).
    /// This replica listens on its own entry's port, on net.bind_host.
    #[arg(long, value_name = "ID=HOST:PORT,…")]
    peers: String,
}

pub fn run(config: &Config, args: SchedulerArgs) -> anyhow::Result<()> {
    if config.cluster.token.is_empty() {
        anyhow::bail!(
            "cluster.token is empty, and replicas refuse connections without one; set \
             FLOE_CLUSTER_TOKEN to the same long random secret on every process"
        );
    }
    let peers = parse_peers(&args.peers)?;
    let voters = peers.keys().copied().collect();
    let replica_config = ReplicaConfig::new(config, args.id, peers)?;
    let raft_dir = config.paths.raft_dir();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let store = DiskLog::open(&raft_dir, voters)
            .with_context(|| format!("cannot open the raft log in {}", raft_dir.display()))?;
        let replica = Replica::start(replica_config, store).await?;
        tracing::info!(
            replica = args.id,
            addr = %replica.local_addr(),
            raft_dir = %raft_dir.display(),
            "scheduler replica serving"
        );
        replica
            .wait()
            .await
            .context("the replica stopped: its raft log could not be written")
    })
}
