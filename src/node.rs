//! `floe node` (the node agent) and `floe worker` (its worker processes, started by the agent).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use floe_core::Config;
use floe_core::config::Service;
use floe_engine::udf::Registry;
use floe_node::worker::{WorkerOptions, run_worker};
use floe_node::{AgentOptions, NodeAgent, Termination};

#[derive(Debug, clap::Args)]
pub struct NodeArgs {
    /// Every scheduler replica, as host:port,host:port,… The node follows the leader among them.
    #[arg(
        long,
        value_name = "HOST:PORT,…",
        value_delimiter = ',',
        required = true
    )]
    scheduler: Vec<String>,
    /// Check the configuration (token, directories, port, scheduler addresses) and exit
    /// without starting.
    #[arg(long)]
    check_config: bool,
}

#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    /// The agent's worker socket.
    #[arg(long)]
    socket: PathBuf,
    /// Which of the agent's worker slots this process fills.
    #[arg(long)]
    slot: u32,
    /// The largest frame on the socket, in bytes.
    #[arg(long)]
    max_frame: usize,
    /// The agent's log directory, where this worker writes `worker-<slot>.log`.
    #[arg(long)]
    log_dir: PathBuf,
}

/// Where a process logs besides stderr: a rotated file under the node's data directory.
pub struct LogFile {
    pub dir: PathBuf,
    pub name: String,
}

impl NodeArgs {
    /// The agent's log file; none for `--check-config`, which only checks.
    pub fn log_file(&self, config: &Config) -> Option<LogFile> {
        (!self.check_config).then(|| LogFile {
            dir: config.paths.data_dir.join(floe_node::logs::LOG_DIR),
            name: floe_node::logs::AGENT_LOG.to_owned(),
        })
    }
}

impl WorkerArgs {
    pub fn log_file(&self) -> LogFile {
        LogFile {
            dir: self.log_dir.clone(),
            name: floe_node::logs::worker_log(self.slot),
        }
    }
}

/// What `--check-config` checks, besides the preflight: every scheduler address is host:port.
fn check_config(config: &Config, args: &NodeArgs) -> anyhow::Result<()> {
    for addr in &args.scheduler {
        addr.rsplit_once(':')
            .and_then(|(host, port)| (!host.is_empty()).then_some(port))
            .and_then(|port| port.parse::<u16>().ok())
            .with_context(|| format!("--scheduler {addr:?} is not host:port"))?;
    }
    config
        .preflight(Service::Node)
        .context("node preflight failed")?;
    println!(
        "ok: node can start: data in {}, rpc on {}:{}, {} scheduler replica(s)",
        config.paths.data_dir.display(),
        config.net.bind_host,
        config.node.rpc_port,
        args.scheduler.len()
    );
    Ok(())
}

pub fn run(config: &Config, args: NodeArgs) -> anyhow::Result<()> {
    if args.check_config {
        return check_config(config, &args);
    }
    if config.cluster.secret.is_empty() {
        anyhow::bail!(
            "cluster.secret is empty, and the scheduler refuses nodes without it; set \
             FLOE_CLUSTER_SECRET to the cluster's secret"
        );
    }
    let worker_binary =
        std::env::current_exe().context("cannot find this executable to start workers")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let options = AgentOptions {
            schedulers: args.scheduler,
            worker_binary,
        };
        let mut termination = Termination::install()?;
        // A signal during start-up (e.g. while no scheduler answers yet) abandons the start;
        // dropping it kills the workers and unlinks the store's shared memory.
        let agent = tokio::select! {
            agent = NodeAgent::start(config, options) => agent?,
            signal = termination.recv() => {
                tracing::info!(signal, "stopping before the node registered");
                return Ok(());
            }
        };
        let signal = termination.recv().await;
        tracing::info!(signal, "shutting down");
        agent.shutdown(signal).await?;
        anyhow::Ok(())
    })
}

pub fn run_worker_process(args: WorkerArgs, udfs: Arc<Registry>) -> anyhow::Result<()> {
    run_worker(
        &WorkerOptions {
            socket: args.socket,
            slot: args.slot,
            max_frame: args.max_frame,
        },
        udfs,
    )?;
    Ok(())
}
