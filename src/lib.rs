//! The `floe` executable: every role of a floe cluster is a subcommand of this one binary.
//!
//! The binary is [`run`] with the built-in UDFs. A program that needs its own UDFs on the
//! cluster builds its own `floe`: a `main` that registers them and calls [`run`]; every role
//! (scheduler, node, the workers a node starts — which run that same program) then has them.
//! See `examples/custom_floe.rs`.

mod cache_cli;
mod cli;
mod demo;
mod logging;
mod node;
mod scheduler;
mod token_cli;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use floe_core::config::{ConfigLoader, Service};
pub use floe_engine::udf::Registry;

/// floe: a distributed data-processing cluster.
///
/// Settings come from a TOML file (--config or FLOE_CONFIG), then FLOE_<SECTION>_<KEY>
/// environment variables, then --set flags, each layer overriding the one before.
/// `floe config show` prints the result. Logs go to stderr, filtered by RUST_LOG
/// (default: info); a node and its workers also write them to rotated files under
/// DATA_DIR/logs.
#[derive(Debug, Parser)]
#[command(name = "floe", version)]
struct Cli {
    /// A TOML config file.
    #[arg(long, global = true, env = "FLOE_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Override one setting, e.g. --set scheduler.rpc_port=7701. Repeatable.
    #[arg(long = "set", global = true, value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Log as human-readable text or as JSON lines (log.format).
    #[arg(long, global = true, value_enum)]
    log_format: Option<LogFormatArg>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormatArg {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Inspect and check the configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Run one replica of the Raft-replicated scheduler.
    Scheduler(scheduler::SchedulerArgs),
    /// Run this machine's node agent: object store, worker processes, object transfer.
    Node(node::NodeArgs),
    /// A node agent's worker process (started by `floe node`, not by hand).
    #[command(hide = true)]
    Worker(node::WorkerArgs),
    /// Start a local cluster, run the quickstart pipeline on generated data, print the result
    /// and the stats, then run it again from the cache.
    Demo(demo::DemoArgs),
    /// Run a local cluster (a scheduler and nodes on loopback) in the foreground.
    Up(cli::UpArgs),
    /// The scheduler replicas (leader, term) and how many nodes are alive.
    Status(cli::ClusterArgs),
    /// Every node, alive or dead.
    Nodes(cli::ClusterArgs),
    /// Every job in the scheduler's state with its state; `--all` adds the jobs that moved to
    /// the history.
    Jobs(cli::JobsArgs),
    /// One job: state, progress, stats and error; `floe job delete ID` deletes an ended job
    /// and frees its result.
    Job(cli::JobCommandArgs),
    /// Cancel a job.
    Cancel(cli::JobArgs),
    /// Validate and submit a job-spec file.
    Submit(cli::SubmitArgs),
    /// The fingerprint cache of the node on this host.
    #[command(subcommand)]
    Cache(cache_cli::CacheCommand),
    /// Create, list and revoke client tokens (the tokens file, auth.tokens_file).
    #[command(subcommand)]
    Token(token_cli::TokenCommand),
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Print the effective configuration as TOML (every secret is redacted).
    Show,
    /// Check that a service could start here: settings valid, secrets set, directories
    /// writable, ports free.
    Check {
        /// The services to check (default: all).
        #[arg(long = "service", value_enum)]
        services: Vec<ServiceArg>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ServiceArg {
    Scheduler,
    Node,
}

impl From<ServiceArg> for Service {
    fn from(service: ServiceArg) -> Self {
        match service {
            ServiceArg::Scheduler => Service::Scheduler,
            ServiceArg::Node => Service::Node,
        }
    }
}

/// Parses the command line and runs the subcommand, with `udfs` as the registry workers run
/// UDFs from (and the client commands validate job files against).
pub fn run(udfs: Registry) -> ExitCode {
    let cli = Cli::parse();
    match run_cli(cli, Arc::new(udfs)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if error.is::<cli::StdoutClosed>() => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run_cli(cli: Cli, udfs: Arc<Registry>) -> anyhow::Result<()> {
    let mut loader = ConfigLoader::new().env(std::env::vars());
    if let Some(path) = &cli.config {
        loader = loader.file(path);
    }
    for assignment in &cli.set {
        loader = loader.set(assignment)?;
    }
    if let Some(format) = cli.log_format {
        let name = match format {
            LogFormatArg::Text => "text",
            LogFormatArg::Json => "json",
        };
        loader = loader.set(&format!("log.format={name}"))?;
    }
    let config = loader.load()?;
    let log_file = match &cli.command {
        Command::Node(args) => args.log_file(&config),
        Command::Worker(args) => Some(args.log_file()),
        _ => None,
    };
    let _log = logging::init(config.log.format, log_file)?;
    tracing::debug!(?config, "configuration loaded");
    // Every process that may touch object storage (clients list and read footers, drivers
    // publish sinks, workers read and write) builds its stores with these settings.
    floe_engine::remote::configure(&config.storage);

    let prints_for_a_pipe = matches!(
        cli.command,
        Command::Config(_)
            | Command::Status(_)
            | Command::Nodes(_)
            | Command::Jobs(_)
            | Command::Job(_)
            | Command::Cache(_)
            | Command::Token(_)
    );
    if prints_for_a_pipe {
        end_quietly_when_stdout_closes();
    }
    match cli.command {
        Command::Config(ConfigCommand::Show) => {
            print!("{}", config.to_toml_redacted()?);
        }
        Command::Config(ConfigCommand::Check { services }) => {
            let services = if services.is_empty() {
                vec![ServiceArg::Scheduler, ServiceArg::Node]
            } else {
                services
            };
            for service in services {
                config
                    .preflight(service.into())
                    .with_context(|| format!("{service:?} preflight failed"))?;
                println!("ok: {service:?} can start with this configuration");
            }
        }
        Command::Scheduler(args) => scheduler::run(&config, args, udfs)?,
        Command::Node(args) => node::run(&config, args)?,
        Command::Worker(args) => node::run_worker_process(args, udfs)?,
        Command::Demo(args) => block_on(demo::run(&args))?,
        Command::Up(args) => block_on(cli::up(&config, &args))?,
        Command::Status(cluster) => block_on(cli::status(&config, &cluster))?,
        Command::Nodes(cluster) => block_on(cli::nodes(&config, &cluster))?,
        Command::Jobs(args) => block_on(cli::jobs(&config, &args))?,
        Command::Job(args) => match (args.action, args.job) {
            (Some(cli::JobAction::Delete(args)), _) => block_on(cli::delete_job(&config, &args))?,
            (None, Some(job)) => block_on(cli::job(&config, job, args.rows, &args.cluster))?,
            (None, None) => anyhow::bail!("name a job: `floe job ID` or `floe job delete ID`"),
        },
        Command::Cancel(args) => block_on(cli::cancel(&config, &args))?,
        Command::Submit(args) => block_on(cli::submit(&config, &args, udfs))?,
        Command::Cache(command) => cache_cli::run(&config, &command, udfs)?,
        Command::Token(command) => token_cli::run(&config, &command)?,
    }
    Ok(())
}

/// Runs a client command on a small runtime.
fn block_on<T>(work: impl std::future::Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the runtime")?
        .block_on(work)
}

/// Restores the default action of SIGPIPE, which Rust ignores, so `floe jobs | head -1` ends
/// quietly when `head` exits instead of panicking on the failed write. Only for commands
/// whose output is a listing: servers must never be killed by a peer closing a pipe.
fn end_quietly_when_stdout_closes() {
    // SAFETY: setting a signal's disposition to its default is async-signal-safe and touches
    // no Rust state.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
