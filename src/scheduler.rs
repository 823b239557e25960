//! `floe scheduler`: run one replica of the Raft-replicated scheduler, with its HTTP API and
//! dashboard.

use std::sync::Arc;

use anyhow::Context;
use floe_client::jobspec::{PathPolicy, parse_job_file_with};
use floe_core::Config;
use floe_core::config::Service;
use floe_core::job::JobSpec;
use floe_core::plan::UdfCodePolicy;
use floe_engine::udf::Registry;
use floe_scheduler::http::{HttpConfig, HttpServer, JobSpecParser, ParsedJob, RejectedSpec};
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
    /// Check the configuration (secrets, directories, ports, --id and --peers) and exit
    /// without starting.
    #[arg(long)]
    check_config: bool,
}

/// Job specs posted to the REST API, read exactly as `floe submit` reads a file, except that
/// paths must be absolute and under `data.allowed_paths`. A process UDF with inline code is
/// refused here already, unless this replica's `node.udf_allow_inline` allows it (the nodes
/// check again, and check `node.udf_roots`).
struct SubmittedSpecs {
    udfs: Arc<Registry>,
    paths: PathPolicy,
    code: UdfCodePolicy,
}

impl JobSpecParser for SubmittedSpecs {
    fn parse(&self, text: &str) -> Result<ParsedJob, RejectedSpec> {
        let reject = |error: &dyn std::fmt::Display| RejectedSpec(error.to_string());
        let job = parse_job_file_with("job", text, Arc::clone(&self.udfs), &self.paths)
            .map_err(|error| reject(&error))?;
        for udf in job.dataset.plan().process_udfs() {
            self.code
                .check_command_line(udf)
                .map_err(|error| reject(&format!("job: {}: {error}", udf.label())))?;
        }
        let spec = JobSpec {
            plan: job
                .dataset
                .plan()
                .resolve_seeds()
                .map_err(|error| reject(&error))?,
            options: job.options,
        };
        Ok(ParsedJob {
            spec: spec.encode().map_err(|error| reject(&error))?,
            name: job.name,
        })
    }
}

/// What `--check-config` checks: the replica's own address comes from `--peers`.
fn check_config(config: &Config, args: &SchedulerArgs) -> anyhow::Result<()> {
    let peers = parse_peers(&args.peers)?;
    let own = peers
        .get(&args.id)
        .with_context(|| format!("--id {} is not one of the replicas in --peers", args.id))?;
    let port = own
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .with_context(|| format!("{own:?} is not host:port"))?;
    let mut effective = config.clone();
    effective.scheduler.rpc_port = port;
    // Validation again, now with the replica's real RPC port (e.g. against the HTTP port).
    effective
        .validate()
        .context("the configuration does not fit this replica's --peers entry")?;
    effective
        .preflight(Service::Scheduler)
        .context("scheduler preflight failed")?;
    println!(
        "ok: scheduler replica {} can start: raft log in {}, rpc on {}:{port}, http on {}:{}",
        args.id,
        config.paths.raft_dir().display(),
        config.net.bind_host,
        config.net.bind_host,
        config.scheduler.http_port
    );
    Ok(())
}

pub fn run(config: &Config, args: SchedulerArgs, udfs: Arc<Registry>) -> anyhow::Result<()> {
    if args.check_config {
        return check_config(config, &args);
    }
    if config.cluster.secret.is_empty() {
        anyhow::bail!(
            "cluster.secret is empty, and replicas refuse nodes without it; set \
             FLOE_CLUSTER_SECRET to the same long random secret on every replica and node"
        );
    }
    if config.scheduler.replica_secret.is_empty() {
        anyhow::bail!(
            "scheduler.replica_secret is empty, and replicas refuse each other without it; set \
             FLOE_SCHEDULER_REPLICA_SECRET to the same long random secret on every replica \
             (and on no node)"
        );
    }
    let peers = parse_peers(&args.peers)?;
    let voters = peers.keys().copied().collect();
    let http_config = HttpConfig::new(config, args.id, peers.clone());
    let replica_config = ReplicaConfig::new(config, args.id, peers)?;
    let raft_dir = config.paths.raft_dir();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let paths = PathPolicy::submitted(config.data.allowed());
    match config.data.allowed_paths.as_slice() {
        [] => tracing::info!("data.allowed_paths is empty: submitted jobs may name any path"),
        roots => tracing::info!(
            ?roots,
            "submitted jobs may only name paths under data.allowed_paths"
        ),
    }
    runtime.block_on(async {
        let store = DiskLog::open(&raft_dir, voters)
            .with_context(|| format!("cannot open the raft log in {}", raft_dir.display()))?;
        let replica = Replica::start(replica_config, store).await?;
        let http = HttpServer::start(
            http_config,
            replica.applied_state(),
            Arc::new(SubmittedSpecs {
                udfs,
                paths,
                code: UdfCodePolicy::for_node(&config.node),
            }),
        )?;
        tracing::info!(
            replica = args.id,
            addr = %replica.local_addr(),
            http = %http.local_addr(),
            raft_dir = %raft_dir.display(),
            "scheduler replica serving; dashboard at {}://{}/",
            if config.tls.cert.as_os_str().is_empty() {
                "http"
            } else {
                "https"
            },
            http.local_addr()
        );
        replica
            .wait()
            .await
            .context("the replica stopped: its raft log could not be written")
    })
}
