//! `floe-bench raft`: the replicated scheduler as three `floe scheduler` processes on
//! loopback, with the default Raft timing.
//!
//! - `commits_per_s`: `SubmitJob` commands committed per second by 64 concurrent clients (the
//!   leader batches whatever is queued into one append and one fsync);
//! - `commit_p50_ms` / `commit_p99_ms`: latency of one commit under that load, as a client
//!   sees it (request, replication to a majority, fsync, apply, reply);
//! - `failover_ms`: from SIGKILL of the leader to the first commit acknowledged by the new one.
//!
//! Each figure is the median of several runs (one with `--quick`).

use std::time::{Duration, Instant};

use anyhow::Context;
use floe_api::client::SchedulerClient;
use floe_api::state::{Command, Outcome};
use floe_client::local::{LocalCredentials, LocalSchedulers, LocalSchedulersConfig};
use floe_core::Config;

use super::print_figure;

const CLIENTS: usize = 64;
const LEADER_TIMEOUT: Duration = Duration::from_secs(30);

struct Scale {
    runs: usize,
    commits_per_run: usize,
    failovers: usize,
}

pub fn run(quick: bool, config: &Config) -> anyhow::Result<()> {
    let scale = if quick {
        Scale {
            runs: 1,
            commits_per_run: 2_000,
            failovers: 1,
        }
    } else {
        Scale {
            runs: 5,
            commits_per_run: 20_000,
            failovers: 5,
        }
    };
    let dir = config
        .paths
        .data_dir
        .join(format!("bench-raft-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let result = runtime.block_on(measure(&scale, &dir));
    // Best effort: a leftover directory is visible and harmless.
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn measure(scale: &Scale, dir: &std::path::Path) -> anyhow::Result<()> {
    let mut cluster = LocalSchedulers::start(LocalSchedulersConfig {
        binary: crate::floe_binary()?,
        replicas: 3,
        dir: dir.to_owned(),
        credentials: LocalCredentials::generate(dir)?,
        settings: Vec::new(),
        tls: floe_core::config::TlsConfig::default(),
    })?;
    cluster.wait_for_leader(LEADER_TIMEOUT).await?;
    let labels = [("replicas", 3.into()), ("clients", CLIENTS.into())];

    let mut rates = Vec::new();
    let mut p50s = Vec::new();
    let mut p99s = Vec::new();
    for _ in 0..scale.runs {
        let (rate, mut latencies) = commit_load(&cluster, scale.commits_per_run).await?;
        latencies.sort();
        rates.push(rate);
        p50s.push(percentile_ms(&latencies, 0.50));
        p99s.push(percentile_ms(&latencies, 0.99));
    }
    print_figure("raft", "commits_per_s", median(&mut rates), "1/s", &labels);
    print_figure("raft", "commit_p50_ms", median(&mut p50s), "ms", &labels);
    print_figure("raft", "commit_p99_ms", median(&mut p99s), "ms", &labels);

    let mut failovers = Vec::new();
    for _ in 0..scale.failovers {
        failovers.push(failover(&mut cluster).await?);
    }
    print_figure(
        "raft",
        "failover_ms",
        median(&mut failovers),
        "ms",
        &[("replicas", 3.into()), ("timing", "default".into())],
    );
    Ok(())
}

async fn propose_job(client: &mut SchedulerClient) -> anyhow::Result<()> {
    let command = Command::SubmitJob {
        spec: vec![0xab; 64],
        submission: floe_core::SubmissionId::random(),
        name: None,
    };
    match client.propose(command).await? {
        Outcome::JobSubmitted(_) => Ok(()),
        other => anyhow::bail!("unexpected outcome {other:?}"),
    }
}

/// Commits `commits` jobs from [`CLIENTS`] concurrent clients; returns commits per second and
/// every commit's latency.
async fn commit_load(
    cluster: &LocalSchedulers,
    commits: usize,
) -> anyhow::Result<(f64, Vec<Duration>)> {
    let per_client = commits.div_ceil(CLIENTS);
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let mut client = cluster.client()?;
        // Connect (and find the leader) before the clock starts.
        propose_job(&mut client).await?;
        clients.push(client);
    }
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for mut client in clients {
        tasks.spawn(async move {
            let mut latencies = Vec::with_capacity(per_client);
            for _ in 0..per_client {
                let sent = Instant::now();
                propose_job(&mut client).await?;
                latencies.push(sent.elapsed());
            }
            anyhow::Ok(latencies)
        });
    }
    let mut latencies = Vec::with_capacity(per_client * CLIENTS);
    while let Some(joined) = tasks.join_next().await {
        latencies.extend(joined.context("a client task panicked")??);
    }
    let elapsed = started.elapsed();
    Ok((latencies.len() as f64 / elapsed.as_secs_f64(), latencies))
}

/// Kills the leader and times the first commit acknowledged after it; then restarts the
/// killed replica and waits until it has caught up, ready for the next run.
async fn failover(cluster: &mut LocalSchedulers) -> anyhow::Result<f64> {
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await?;
    let mut client = cluster.client()?.with_retry_for(LEADER_TIMEOUT);
    propose_job(&mut client).await?;
    cluster.kill(leader)?;
    let killed = Instant::now();
    propose_job(&mut client).await?;
    let failover = killed.elapsed();
    cluster.start_replica(leader)?;
    let new_leader = cluster.wait_for_leader(LEADER_TIMEOUT).await?;
    let commit = cluster.status(new_leader).await?.commit;
    cluster
        .wait_for_status(leader, LEADER_TIMEOUT, |status| status.applied >= commit)
        .await?;
    Ok(failover.as_secs_f64() * 1e3)
}

fn percentile_ms(sorted: &[Duration], quantile: f64) -> f64 {
    let last = sorted.len().saturating_sub(1);
    let index = ((last as f64) * quantile).round() as usize;
    sorted
        .get(index.min(last))
        .map_or(0.0, |latency| latency.as_secs_f64() * 1e3)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}
