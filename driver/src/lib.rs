//! The job driver: runs one submitted job across the cluster.
//!
//! The scheduler's leader places a driver for every pending job on a node (a `StartDriver`
//! commit); the node learns it from its heartbeat reply and runs [`run_driver`] as a task of
//! its agent. The driver reads the job spec from the replicated job table, optimizes and plans
//! it ([`plan`]: physical operators, fingerprints, cache decisions against the replicated
//! cache index), runs the streaming executor ([`execute`]), and commits `FinishJob` with the
//! job's stats and output blocks. A driver whose node dies is started again elsewhere with the
//! next attempt number; the new driver plans afresh, so every stage that was cached before the
//! death is loaded rather than recomputed. Only the current attempt's `FinishJob` is accepted.
//!
//! The driver reaches the cluster only through [`cluster::ClusterAccess`]: [`run_driver`]
//! uses the RPC implementation, and [`drive`] runs a job against any other (the executor's
//! tests use an in-process fake).

pub mod cluster;
mod execute;
pub mod leases;
mod plan;
mod sinks;
pub mod stream;
pub mod tasks;

use std::sync::Arc;
use std::time::{Duration, Instant};

use floe_api::node_protocol::{NodeRequest, StreamEnd};
use floe_api::state::{CacheIndex, Command, JobOutcome, JobStatus, Outcome};
use floe_core::config::AllowedPaths;
use floe_core::job::{CacheMode, JobSpec, JobStats, ResultDelivery};
use floe_core::wire::WireConfig;
use floe_core::{JobId, NodeId};

use self::cluster::{ClusterAccess, RpcCluster};

/// Why a driver could not run its job to an outcome (the job's own failures are outcomes).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("scheduler: {0}")]
    Scheduler(#[from] floe_api::Error),
    #[error(transparent)]
    Wire(#[from] floe_core::WireError),
    #[error("cannot place a task: {0}")]
    Placement(#[from] floe_api::placement::PlacementError),
    #[error("cannot place a task: asked for {asked} placements, the scheduler answered {answered}")]
    PlacementCount { asked: usize, answered: usize },
    #[error("node {0} is not alive")]
    NodeGone(NodeId),
    #[error("job {0} is not in the scheduler's job table")]
    UnknownJob(JobId),
    #[error("the scheduler answered for {answered} of the {asked} leases asked about")]
    LeaseCount { asked: usize, answered: usize },
    #[error("cannot place a task: asking the scheduler for leases: {0}")]
    LeaseAsk(Arc<Error>),
    #[error("cannot place a task: the job's leases were closed as it ends")]
    LeasesClosed,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What every driver on a node shares.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    pub schedulers: Vec<String>,
    pub wire: WireConfig,
    /// The node the driver runs on (the requester for DEFAULT placement).
    pub node: NodeId,
    pub min_block_bytes: u64,
    pub max_block_bytes: u64,
    pub batch_rows: u32,
    /// How often progress goes to the scheduler (and cancellation is noticed).
    pub progress_interval: Duration,
    /// `data.allowed_paths`: where sinks may publish their files.
    pub allowed_paths: AllowedPaths,
    /// Where the driver records its task runs, which its node serves to the dashboard.
    pub tasks: tasks::TaskBoard,
    /// Where a driver streaming its result publishes it, which its node serves to clients.
    pub streams: stream::ResultStreams,
}

/// Runs attempt `attempt` of `job` to its end and commits the outcome. Errors mean the outcome
/// could not be committed (the scheduler is unreachable, or the attempt was superseded); the
/// scheduler then starts another driver if the job is still running.
pub async fn run_driver(config: Arc<DriverConfig>, job: JobId, attempt: u32) -> Result<()> {
    let cluster = Arc::new(RpcCluster::new(
        config.schedulers.clone(),
        config.wire.clone(),
    ));
    drive(config, cluster, job, attempt).await
}

/// [`run_driver`] against any cluster.
pub async fn drive<C: ClusterAccess>(
    config: Arc<DriverConfig>,
    cluster: Arc<C>,
    job: JobId,
    attempt: u32,
) -> Result<()> {
    let started = Instant::now();
    let record = cluster.read_job(job).await?.ok_or(Error::UnknownJob(job))?;
    if record.status != JobStatus::Running || record.attempts != attempt {
        // Ended meanwhile, or superseded by a later attempt: nothing to run.
        return Ok(());
    }
    tracing::info!(%job, attempt, node = %config.node, "driver started");
    if attempt > 1 {
        free_earlier_attempts(cluster.as_ref(), job).await;
    }
    // Owned here, so the stream ends (and leaves the node) when the driver does.
    let mut publisher = None;
    let mut outcome = match JobSpec::decode(&record.spec) {
        Err(error) => failed(attempt, format!("the job spec is invalid: {error}")),
        Ok(spec) => {
            if let ResultDelivery::Streamed { .. } = spec.options.result {
                publisher = Some(config.streams.open(job, attempt));
            }
            let stream = publisher.as_ref().map(stream::StreamPublisher::handle);
            plan_and_run(&config, &cluster, job, attempt, &spec, stream).await?
        }
    };
    if let Some(publisher) = &publisher {
        publisher.end(match &outcome.status {
            JobStatus::Failed { message } => StreamEnd::Failed {
                message: message.clone(),
            },
            JobStatus::Cancelled => StreamEnd::Cancelled,
            JobStatus::Succeeded | JobStatus::Pending | JobStatus::Running => StreamEnd::Complete,
        });
    }
    outcome.stats.wall_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    tracing::info!(%job, attempt, status = outcome.status.name(), "driver finished");
    match cluster
        .propose(Command::FinishJob {
            job,
            attempt,
            outcome,
        })
        .await?
    {
        Outcome::Applied => Ok(()),
        other => {
            tracing::warn!(%job, attempt, ?other, "the job's outcome was not accepted");
            Ok(())
        }
    }
}

/// How many times one attempt plans its job: each plan after the first drops at least one
/// missing shard from the index, so this bounds a cache that keeps vanishing under the job.
const MAX_PLANS: usize = 8;

/// Plans and runs the job. If cache shards the index named turn out to be gone (and the job
/// could not simply compute them in their place), they are dropped from the index and the job
/// is planned and run again without them, so a cleaned or damaged cache costs a
/// recomputation, never the job. A recompute first removes the old shards of what it
/// recomputes, from the index and then from every node's disk.
async fn plan_and_run<C: ClusterAccess>(
    config: &Arc<DriverConfig>,
    cluster: &Arc<C>,
    job: JobId,
    attempt: u32,
    spec: &JobSpec,
    stream: Option<stream::StreamHandle>,
) -> Result<JobOutcome> {
    let mut plans = 0;
    loop {
        plans += 1;
        // Only reusing reads the index: a job that recomputes or skips the cache plans
        // without it.
        let cache = if spec.options.cache == CacheMode::Reuse {
            cluster.cache_index().await?
        } else {
            CacheIndex::default()
        };
        let mut operators = match plan::plan(spec, &cache, config) {
            Ok(operators) => operators,
            Err(error) => return Ok(failed(attempt, error.to_string())),
        };
        if plans == 1 && spec.options.cache == CacheMode::Recompute {
            execute::remove_old_shards(cluster.as_ref(), &operators).await?;
        }
        let started_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_millis());
        let staged = match sinks::stage_sinks(
            &mut operators,
            &config.allowed_paths,
            job,
            attempt,
            started_ms,
        ) {
            Ok(staged) => staged,
            Err(error) => return Ok(failed(attempt, error.to_string())),
        };
        let run = execute::Execution::new(
            Arc::clone(config),
            Arc::clone(cluster),
            job,
            attempt,
            spec.options.clone(),
            operators,
            stream.clone(),
        );
        let mut finished = run.run().await;
        let again = !finished.stale_cache.is_empty() && plans < MAX_PLANS;
        // A second plan would stream its output again from the start.
        if again && stream.as_ref().is_some_and(|stream| stream.published() > 0) {
            sinks::discard(&staged);
            return Ok(failed(
                attempt,
                "cached shards vanished after part of the result was streamed; run the job again"
                    .into(),
            ));
        }
        if finished.outcome.status != JobStatus::Succeeded || again {
            sinks::discard(&staged);
        } else if let Err(error) = sinks::publish(&staged) {
            finished.outcome.status = JobStatus::Failed {
                message: format!("cannot publish the output: {error}"),
            };
        }
        if !again {
            return Ok(finished.outcome);
        }
        for stale in finished.stale_cache {
            tracing::warn!(%job, fingerprint = %stale.fingerprint, rank = stale.rank, count = stale.count, node = %stale.node, "a cached shard is gone; planning again without it");
            cluster.propose(stale.forget()).await?;
        }
    }
}

/// Frees what earlier attempts of `job` left on the alive nodes: their driver died with its
/// node, and nobody else knows their blocks. This attempt has made nothing yet, so nothing is
/// kept; a node that does not answer is logged and left (its blocks stay until it restarts).
async fn free_earlier_attempts<C: ClusterAccess>(cluster: &C, job: JobId) {
    let nodes = match cluster.read_nodes().await {
        Ok(nodes) => nodes,
        Err(error) => {
            tracing::warn!(%job, %error, "cannot list the nodes to free earlier attempts' blocks");
            return;
        }
    };
    let request = NodeRequest::FreeJob {
        job,
        keep: Vec::new(),
    };
    for node in nodes {
        if let Err(error) = cluster.call_node(&node.rpc, &request).await {
            tracing::warn!(%job, node = %node.id, %error, "cannot free earlier attempts' blocks");
        }
    }
}

fn failed(attempt: u32, message: String) -> JobOutcome {
    JobOutcome {
        status: JobStatus::Failed { message },
        stats: JobStats {
            attempt,
            ..JobStats::default()
        },
        outputs: Vec::new(),
    }
}
