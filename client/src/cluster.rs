//! Running datasets on a cluster.
//!
//! [`Client::connect`] takes every scheduler replica's address and a client token; calls go
//! to the Raft leader and follow it across failovers. [`Client::submit`] commits a job and
//! returns a [`JobHandle`]: its status, progress, stats and error, [`JobHandle::wait`] and
//! [`JobHandle::cancel`]. A finished job's [`JobOutput`] streams its result blocks in order,
//! straight from the nodes that hold them, each checked against the holder's checksum. The
//! blocks stay in the cluster until the client lets them go: dropping the last copy of a
//! `JobOutput` (and of its readers) releases them, [`JobOutput::keep`] leaves them held until
//! `jobs.result_ttl` passes or [`JobHandle::release_output`] / [`JobHandle::delete`] is
//! called.
//! [`ClusterExecutor`] plugs a client into [`Dataset`]'s consuming calls (`count`, `take`,
//! `iter_batches`), and [`LocalCluster`] starts a real scheduler and real nodes on loopback.
//!
//! ```no_run
//! use floe_client::{Client, Dataset, col, lit};
//!
//! # async fn run() -> Result<(), floe_client::Error> {
//! let client = Client::connect(&["10.0.0.1:7700", "10.0.0.2:7700", "10.0.0.3:7700"], "token").await?;
//! let evens = Dataset::range(1_000_000)?.filter((col("id") % lit(2i64)).eq(lit(0i64)))?;
//! let job = client.submit(&evens).await?;
//! let output = job.wait().await?;
//! assert_eq!(output.rows(), 500_000);
//! # Ok(())
//! # }
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arrow::ipc::reader::FileReader;
use arrow::record_batch::RecordBatch;
use floe_api::client::SchedulerClient;
use floe_api::fetch::FetchError;
use floe_api::node_protocol::NodeProtocol;
use floe_api::state::{ClusterState, Command, JobRecord, JobStatus, JobSummary, Outcome};
use floe_core::auth::ClientToken;
use floe_core::config::{Config, TlsConfig};
use floe_core::job::{JobOptions, JobProgress, JobSpec, JobStats, OutputBlock};
use floe_core::plan::{LogicalPlan, MaterializedSource, Operator};
use floe_core::wire::{RpcClient, WireConfig};
use floe_core::{JobId, NodeId, SubmissionId};
use tokio::sync::Mutex;

use crate::stream::ResultStream;
use crate::{BatchStream, Dataset, Error, Executor, Registry, Result};

/// How long a waiting handle lets the leader hold its request before it reads the job's
/// progress; the leader answers as soon as the job ends.
const WAIT_SLICE: Duration = Duration::from_millis(500);
/// How long one attempt at one replica may take beyond a long poll's own wait, so a frozen
/// replica costs a waiting client seconds, not the 30 s read timeout.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long [`JobHandle::wait_with`] tries replicas before it reports the scheduler
/// unavailable (and goes on waiting).
const REPORT_UNAVAILABLE_AFTER: Duration = Duration::from_secs(3);
/// How long [`JobHandle::wait`] tries replicas before it gives up: two election timeouts,
/// with margin.
const GIVE_UP_AFTER: Duration = Duration::from_secs(10);
/// The largest frame the client accepts (a chunk plus its envelope).
const MAX_FRAME_MIB: u64 = 64;

/// A job's state as the scheduler's replicated job table has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobState {
    /// Waiting for a driver (at the start, or after the driver's node died).
    Pending,
    Running,
    Succeeded,
    Failed {
        message: String,
    },
    Cancelled,
}

impl JobState {
    pub fn is_finished(&self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed { .. } | JobState::Cancelled
        )
    }

    pub fn name(&self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed { .. } => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
}

impl From<&JobStatus> for JobState {
    fn from(status: &JobStatus) -> Self {
        match status {
            JobStatus::Pending => JobState::Pending,
            JobStatus::Running => JobState::Running,
            JobStatus::Succeeded => JobState::Succeeded,
            JobStatus::Failed { message } => JobState::Failed {
                message: message.clone(),
            },
            JobStatus::Cancelled => JobState::Cancelled,
        }
    }
}

/// One job, as listed by [`Client::jobs`].
#[derive(Debug, Clone, PartialEq)]
pub struct JobInfo {
    pub id: JobId,
    /// What its submitter called it, if anything.
    pub name: Option<String>,
    pub state: JobState,
    /// How many drivers were started for it.
    pub attempts: u32,
    /// The node running its driver, while one does.
    pub driver: Option<NodeId>,
    pub stats: Option<JobStats>,
    /// When it was submitted, its first driver started and it ended, in milliseconds since
    /// the Unix epoch on the scheduler leader's clock.
    pub submitted_at_ms: u64,
    pub started_at_ms: Option<u64>,
    pub ended_at_ms: Option<u64>,
    /// Its plan, when the record's spec decodes (a spec from a newer client may not).
    pub plan: Option<LogicalPlan>,
}

impl JobInfo {
    /// The directory the job writes, when its plan ends in a sink.
    pub fn sink(&self) -> Option<&std::path::Path> {
        match self.plan.as_ref()?.operator() {
            floe_core::plan::Operator::Write(spec) => Some(&spec.directory),
            _ => None,
        }
    }

    /// How long it ran (or has run, until `now_ms`) since its first driver started.
    pub fn duration_ms(&self, now_ms: u64) -> Option<u64> {
        let started = self.started_at_ms?;
        Some(self.ended_at_ms.unwrap_or(now_ms).saturating_sub(started))
    }
}

impl From<&JobRecord> for JobInfo {
    fn from(record: &JobRecord) -> Self {
        Self {
            id: record.id,
            name: record.name.clone(),
            state: JobState::from(&record.status),
            attempts: record.attempts,
            driver: record.driver,
            stats: record.stats.clone(),
            submitted_at_ms: record.submitted_at_ms,
            started_at_ms: record.started_at_ms,
            ended_at_ms: record.ended_at_ms,
            plan: JobSpec::decode(&record.spec).ok().map(|spec| spec.plan),
        }
    }
}

/// One node, as listed by [`Client::nodes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub id: NodeId,
    /// The node agent's RPC address.
    pub address: String,
    pub alive: bool,
    /// Why it was declared dead, if it was.
    pub death: Option<String>,
    pub cpus: u64,
    pub heap_bytes: u64,
}

/// The scheduler replicas' view of the cluster, as [`Client::cluster`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterInfo {
    /// Each replica's address and its Raft view (`None` when it did not answer).
    pub replicas: Vec<(String, Option<ReplicaInfo>)>,
    pub nodes: Vec<NodeInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaInfo {
    pub id: u64,
    pub leader: Option<u64>,
    pub term: u64,
    pub commit: u64,
}

pub(crate) struct Inner {
    pub(crate) replicas: Vec<String>,
    pub(crate) wire: WireConfig,
    pub(crate) scheduler: Mutex<SchedulerClient>,
    /// The runtime the client was connected on, where a dropped output's release (or a
    /// dropped stream's cancel) is sent.
    pub(crate) runtime: tokio::runtime::Handle,
}

impl Inner {
    async fn state(&self) -> Result<ClusterState> {
        Ok(self.scheduler.lock().await.read_state().await?)
    }

    pub(crate) async fn job(&self, job: JobId) -> Result<JobRecord> {
        self.scheduler
            .lock()
            .await
            .watch_job(job, Duration::ZERO)
            .await?
            .ok_or(Error::UnknownJob(job))
    }

    /// Commits `command` about `job`; a rejection is [`Error::Refused`] with its reason.
    pub(crate) async fn propose_for(&self, job: JobId, command: Command) -> Result<Outcome> {
        match self.scheduler.lock().await.propose(command).await? {
            Outcome::Rejected(reason) => Err(Error::Refused { job, reason }),
            outcome => Ok(outcome),
        }
    }

    /// Why `job`'s result blocks can no longer be read, when the job let them go.
    async fn why_released(&self, job: JobId) -> Option<Error> {
        let reason = match self.job(job).await {
            Ok(record) => record.release?.to_string(),
            Err(Error::UnknownJob(_)) => "the job was deleted, or moved to the history \
                                          (jobs.keep_finished / jobs.keep_for), and its output \
                                          freed"
                .to_owned(),
            Err(_) => return None,
        };
        Some(Error::ResultReleased { job, reason })
    }
}

/// A connection to a cluster's schedulers. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl Client {
    /// Connects to the cluster whose scheduler replicas are at `replicas` (`host:port`) and
    /// checks that one answers to this client token (it needs at least the `read` scope;
    /// submitting needs `submit`).
    pub async fn connect(replicas: &[impl AsRef<str>], token: &str) -> Result<Self> {
        Self::connect_with(replicas, token, &TlsConfig::default()).await
    }

    /// Connects like [`Client::connect`] over TLS, verifying every scheduler's and node's
    /// certificate against the CA certificate(s) in the PEM file `ca`.
    pub async fn connect_tls(
        replicas: &[impl AsRef<str>],
        token: &str,
        ca: &std::path::Path,
    ) -> Result<Self> {
        let tls = TlsConfig {
            ca: ca.to_owned(),
            ..TlsConfig::default()
        };
        Self::connect_with(replicas, token, &tls).await
    }

    /// Connects as [`Client::connect`] does, over TLS when `tls` names a CA (only the CA is
    /// used: a client presents no certificate), in plaintext when it is empty.
    pub async fn connect_with(
        replicas: &[impl AsRef<str>],
        token: &str,
        tls: &TlsConfig,
    ) -> Result<Self> {
        let replicas: Vec<String> = replicas.iter().map(|r| r.as_ref().to_owned()).collect();
        let mut config = Config::default();
        config.client.token = ClientToken::new(token);
        config.tls = tls.client_only();
        config.net.max_frame = floe_core::config::ByteSize::mib(MAX_FRAME_MIB);
        let wire = WireConfig::client(&config);
        let mut scheduler = SchedulerClient::new(replicas.clone(), wire.clone())?
            .with_attempt_timeout(ATTEMPT_TIMEOUT);
        // A small question the leader answers, proving the address and the token.
        scheduler
            .alive_nodes()
            .await
            .map_err(|error| Error::Connect {
                replicas: replicas.join(","),
                reason: error.to_string(),
            })?;
        Ok(Self {
            inner: Arc::new(Inner {
                replicas,
                wire,
                scheduler: Mutex::new(scheduler),
                runtime: tokio::runtime::Handle::current(),
            }),
        })
    }

    /// Submits `dataset` with the default options (cache reused, 3 task retries).
    pub async fn submit(&self, dataset: &Dataset) -> Result<JobHandle> {
        self.submit_with(dataset, JobOptions::default()).await
    }

    /// Submits `dataset`; its random seeds are drawn now, so a resubmitted handle reruns the
    /// same plan. A submission retried after a lost reply is committed once.
    pub async fn submit_with(&self, dataset: &Dataset, options: JobOptions) -> Result<JobHandle> {
        self.submit_plan(dataset.plan(), options, None).await
    }

    /// Submits `dataset` as [`Client::submit_with`] does, under `name`: `floe jobs`, the REST
    /// API and the dashboard show it, and `floe jobs --name` finds the job by it. The name is
    /// not part of the plan, so it changes no fingerprint.
    pub async fn submit_named(
        &self,
        name: &str,
        dataset: &Dataset,
        options: JobOptions,
    ) -> Result<JobHandle> {
        self.submit_plan(dataset.plan(), options, Some(name.to_owned()))
            .await
    }

    pub(crate) async fn submit_plan(
        &self,
        plan: &LogicalPlan,
        options: JobOptions,
        name: Option<String>,
    ) -> Result<JobHandle> {
        crate::check_sinks(plan)?;
        for job in materialized_jobs(plan) {
            if let Some(released) = self.inner.why_released(job).await {
                return Err(released);
            }
        }
        let spec = JobSpec {
            plan: plan.resolve_seeds()?,
            options,
        };
        let bytes = spec.encode()?;
        let job = self
            .inner
            .scheduler
            .lock()
            .await
            .submit_job(bytes, SubmissionId::random(), name)
            .await?;
        Ok(self.job(job))
    }

    /// Submits `dataset` with `options`, its output streamed to the returned reader as the
    /// job produces it (with the default buffer unless `options.result` names one). The job
    /// ends once every block is read; dropping the stream before that cancels it.
    pub async fn stream_with(
        &self,
        dataset: &Dataset,
        options: JobOptions,
    ) -> Result<ResultStream> {
        self.submit_streamed(dataset.plan(), &options).await
    }

    pub(crate) async fn submit_streamed(
        &self,
        plan: &LogicalPlan,
        options: &JobOptions,
    ) -> Result<ResultStream> {
        let job = self
            .submit_plan(plan, crate::stream::streamed(options), None)
            .await?;
        Ok(ResultStream::new(Arc::clone(&self.inner), job.id))
    }

    /// A handle on a job submitted earlier (by anyone).
    pub fn job(&self, job: JobId) -> JobHandle {
        JobHandle {
            inner: Arc::clone(&self.inner),
            id: job,
        }
    }

    /// Every job the cluster knows, oldest first.
    pub async fn jobs(&self) -> Result<Vec<JobInfo>> {
        Ok(self
            .inner
            .state()
            .await?
            .jobs
            .values()
            .map(|record| JobInfo::from(record.as_ref()))
            .collect())
    }

    /// Up to `limit` jobs that left the scheduler's state (deleted, or past
    /// `jobs.keep_finished` / `jobs.keep_for`), newest first, from one replica's history.
    pub async fn job_history(&self, limit: u32) -> Result<Vec<JobSummary>> {
        Ok(self.inner.scheduler.lock().await.job_history(limit).await?)
    }

    /// The replicated fingerprint-cache index: every cached output, its shards and which job
    /// made it.
    pub async fn cache_index(&self) -> Result<floe_api::state::CacheIndex> {
        Ok(self.inner.state().await?.cache)
    }

    /// Every node the scheduler remembers, alive or dead (dead ones are forgotten after
    /// `nodes.forget_dead_after`).
    pub async fn nodes(&self) -> Result<Vec<NodeInfo>> {
        Ok(nodes_of(&self.inner.state().await?))
    }

    /// The replicas' Raft status and the nodes.
    pub async fn cluster(&self) -> Result<ClusterInfo> {
        let mut replicas = Vec::new();
        for addr in &self.inner.replicas {
            let status = SchedulerClient::status_of(addr, self.inner.wire.clone())
                .await
                .ok()
                .map(|status| ReplicaInfo {
                    id: status.id,
                    leader: status.leader,
                    term: status.term,
                    commit: status.commit,
                });
            replicas.push((addr.clone(), status));
        }
        Ok(ClusterInfo {
            replicas,
            nodes: self.nodes().await?,
        })
    }
}

fn nodes_of(state: &ClusterState) -> Vec<NodeInfo> {
    state
        .nodes
        .values()
        .map(|node| NodeInfo {
            id: node.id,
            address: node.addresses.rpc.clone(),
            alive: node.is_alive(),
            death: match &node.liveness {
                floe_api::state::Liveness::Alive => None,
                floe_api::state::Liveness::Dead { reason, .. } => Some(reason.clone()),
            },
            cpus: node.resources.cpu_millis / 1000,
            heap_bytes: node.resources.heap_bytes,
        })
        .collect()
}

/// The jobs whose held outputs `plan` reads through materialized sources; a walk with a
/// stack, so any depth is safe.
fn materialized_jobs(plan: &LogicalPlan) -> BTreeSet<JobId> {
    let mut jobs = BTreeSet::new();
    let mut pending = vec![plan];
    while let Some(node) = pending.pop() {
        if let Operator::Materialized(source) = node.operator() {
            jobs.insert(source.job);
        }
        pending.extend(node.inputs());
    }
    jobs
}

/// A submitted job.
#[derive(Clone)]
pub struct JobHandle {
    inner: Arc<Inner>,
    id: JobId,
}

impl JobHandle {
    pub fn id(&self) -> JobId {
        self.id
    }

    pub async fn state(&self) -> Result<JobState> {
        Ok(JobState::from(&self.inner.job(self.id).await?.status))
    }

    /// What the job's driver last reported, while it runs.
    pub async fn progress(&self) -> Result<Option<JobProgress>> {
        Ok(self
            .inner
            .scheduler
            .lock()
            .await
            .job_progress(self.id)
            .await?)
    }

    /// The stats, once the job has ended.
    pub async fn stats(&self) -> Result<Option<JobStats>> {
        Ok(self.inner.job(self.id).await?.stats)
    }

    /// Why the job failed, if it did.
    pub async fn error(&self) -> Result<Option<String>> {
        Ok(match self.inner.job(self.id).await?.status {
            JobStatus::Failed { message } => Some(message),
            _ => None,
        })
    }

    /// Cancels the job: a pending one ends at once, a running one when its driver notices
    /// (within a second), freeing its objects.
    pub async fn cancel(&self) -> Result<()> {
        let command = Command::CancelJob { job: self.id };
        match self.inner.scheduler.lock().await.propose(command).await? {
            Outcome::Applied => Ok(()),
            Outcome::Rejected(reason) => Err(Error::CannotCancel {
                job: self.id,
                reason,
            }),
            other => Err(Error::Unexpected(format!("{other:?}"))),
        }
    }

    /// Lets the cluster free the job's result blocks now (what dropping its [`JobOutput`]
    /// does in the background).
    pub async fn release_output(&self) -> Result<()> {
        self.inner
            .propose_for(self.id, Command::ReleaseJobOutput { job: self.id })
            .await
            .map(drop)
    }

    /// Deletes the ended job: its result blocks are freed and it leaves the job list (its
    /// summary stays in the history).
    pub async fn delete(&self) -> Result<()> {
        self.inner
            .propose_for(self.id, Command::DeleteJob { job: self.id })
            .await
            .map(drop)
    }

    /// Waits for the job to end; its output when it succeeded.
    pub async fn wait(&self) -> Result<JobOutput> {
        self.wait_with_progress(|_| {}).await
    }

    /// [`JobHandle::wait`], calling `on_progress` with each progress report while it runs.
    /// Keeps waiting across scheduler leader changes, but gives up when no replica answers
    /// for the client's retry window (10 s); [`JobHandle::wait_with`] waits through that too.
    pub async fn wait_with_progress(
        &self,
        mut on_progress: impl FnMut(&JobProgress),
    ) -> Result<JobOutput> {
        let on_event = |event: WaitEvent<'_>| match event {
            WaitEvent::Progress(progress) => {
                on_progress(progress);
                Ok(())
            }
            WaitEvent::SchedulerUnavailable(error) => Err(error),
        };
        self.wait_loop(GIVE_UP_AFTER, on_event).await
    }

    /// Waits for the job to end, calling `on_event` with each progress report and each time
    /// no scheduler replica could answer (no leader, no quorum). `on_event` decides whether
    /// to go on after the latter: returning the error ends the wait with it. Only
    /// `options.timeout` ends a wait that `on_event` lets go on.
    pub async fn wait_with(
        &self,
        options: WaitOptions,
        on_event: impl FnMut(WaitEvent<'_>) -> Result<()>,
    ) -> Result<JobOutput> {
        let waiting = self.wait_loop(REPORT_UNAVAILABLE_AFTER, on_event);
        match options.timeout {
            None => waiting.await,
            Some(after) => {
                tokio::time::timeout(after, waiting)
                    .await
                    .map_err(|_| Error::WaitTimedOut {
                        job: self.id,
                        after,
                    })?
            }
        }
    }

    /// Waits, reporting the scheduler unavailable after `report_after` without an answer.
    async fn wait_loop(
        &self,
        report_after: Duration,
        mut on_event: impl FnMut(WaitEvent<'_>) -> Result<()>,
    ) -> Result<JobOutput> {
        // Its own connection: a long wait must not hold up other calls on this client.
        let mut waiter =
            SchedulerClient::new(self.inner.replicas.clone(), self.inner.wire.clone())?
                .with_attempt_timeout(ATTEMPT_TIMEOUT)
                .with_retry_for(report_after);
        loop {
            let record = match waiter.watch_job(self.id, WAIT_SLICE).await {
                Ok(record) => record.ok_or(Error::UnknownJob(self.id))?,
                Err(error @ floe_api::Error::NoReplica(_)) => {
                    on_event(WaitEvent::SchedulerUnavailable(error.into()))?;
                    continue;
                }
                Err(error) => return Err(error.into()),
            };
            match record.status {
                JobStatus::Succeeded => {
                    if let Some(release) = record.release {
                        return Err(Error::ResultReleased {
                            job: self.id,
                            reason: release.to_string(),
                        });
                    }
                    return Ok(JobOutput {
                        inner: Arc::clone(&self.inner),
                        job: self.id,
                        stats: record.stats.unwrap_or_default(),
                        lease: Arc::new(OutputLease {
                            inner: Arc::clone(&self.inner),
                            job: self.id,
                            held: AtomicBool::new(!record.outputs.is_empty()),
                        }),
                        blocks: record.outputs,
                    });
                }
                JobStatus::Failed { message } => {
                    return Err(Error::JobFailed {
                        job: self.id,
                        message,
                    });
                }
                JobStatus::Cancelled => return Err(Error::JobCancelled(self.id)),
                JobStatus::Pending | JobStatus::Running => {}
            }
            match waiter.job_progress(self.id).await {
                Ok(Some(progress)) => on_event(WaitEvent::Progress(&progress))?,
                Ok(None) => {}
                Err(error @ floe_api::Error::NoReplica(_)) => {
                    on_event(WaitEvent::SchedulerUnavailable(error.into()))?;
                }
                Err(error) => return Err(error.into()),
            }
        }
    }
}

/// How [`JobHandle::wait_with`] waits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WaitOptions {
    /// Give up after this long; `None` waits while the job may still end.
    pub timeout: Option<Duration>,
}

/// What [`JobHandle::wait_with`] reports while the job has not ended.
#[derive(Debug)]
pub enum WaitEvent<'a> {
    Progress(&'a JobProgress),
    /// No scheduler replica answered for a while (a leader election, or no quorum); the
    /// wait goes on unless the callback returns this error.
    SchedulerUnavailable(Error),
}

/// A finished job's output: its stats and its result blocks, which stay in the nodes' object
/// stores until released. Dropping the last copy of it (and of every [`BlockReader`] streamed
/// from it) releases them in the background; [`JobOutput::release`] does so now and
/// [`JobOutput::keep`] not at all (the cluster frees them after `jobs.result_ttl`).
#[derive(Clone)]
pub struct JobOutput {
    inner: Arc<Inner>,
    pub job: JobId,
    pub stats: JobStats,
    pub blocks: Vec<OutputBlock>,
    lease: Arc<OutputLease>,
}

/// The client's hold on a job's output blocks, shared by the output and its readers.
struct OutputLease {
    inner: Arc<Inner>,
    job: JobId,
    /// Whether dropping the lease still releases the blocks.
    held: AtomicBool,
}

impl Drop for OutputLease {
    fn drop(&mut self) {
        if !self.held.load(Ordering::Acquire) {
            return;
        }
        let inner = Arc::clone(&self.inner);
        let job = self.job;
        // A lost release (the program exits first) is caught by `jobs.result_ttl`.
        self.inner.runtime.spawn(async move {
            if let Err(error) = inner
                .propose_for(job, Command::ReleaseJobOutput { job })
                .await
            {
                tracing::debug!(%job, %error, "releasing the job's output failed");
            }
        });
    }
}

impl JobOutput {
    /// Releases the result blocks now: the cluster frees them, and later reads fail with
    /// [`Error::ResultReleased`].
    pub async fn release(self) -> Result<()> {
        if !self.lease.held.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        self.inner
            .propose_for(self.job, Command::ReleaseJobOutput { job: self.job })
            .await
            .map(drop)
    }

    /// Keeps the result blocks held after this output is dropped, for whoever reads the job
    /// later (`floe job ID`, another process); the cluster frees them after `jobs.result_ttl`
    /// unless released or deleted sooner.
    pub fn keep(&self) {
        self.lease.held.store(false, Ordering::Release);
    }

    /// Rows in the output, from the blocks' metadata (nothing is fetched).
    pub fn rows(&self) -> u64 {
        self.blocks.iter().map(|block| block.rows).sum()
    }

    /// Bytes of Arrow data in the output, from the blocks' metadata.
    pub fn bytes(&self) -> u64 {
        self.blocks.iter().map(|block| block.bytes).sum()
    }

    /// The result blocks in order, fetched one at a time as the stream is pulled.
    pub fn stream(&self) -> BlockReader {
        BlockReader {
            inner: Arc::clone(&self.inner),
            lease: Arc::clone(&self.lease),
            blocks: self.blocks.clone(),
            next: 0,
            holders: Holders::default(),
            pending: Vec::new(),
        }
    }

    /// Every result block.
    pub async fn to_arrow(&self) -> Result<Vec<RecordBatch>> {
        let mut reader = self.stream();
        let mut batches = Vec::new();
        while let Some(batch) = reader.next_batch().await? {
            batches.push(batch);
        }
        Ok(batches)
    }

    /// The first `n` rows (fetching only the blocks that hold them).
    pub async fn take(&self, n: u64) -> Result<Vec<RecordBatch>> {
        let mut reader = self.stream();
        let mut batches = Vec::new();
        let mut rows = 0u64;
        while rows < n {
            let Some(batch) = reader.next_batch().await? else {
                break;
            };
            let wanted = usize::try_from(n - rows).unwrap_or(usize::MAX);
            let batch = batch.slice(0, batch.num_rows().min(wanted));
            rows += batch.num_rows() as u64;
            batches.push(batch);
        }
        Ok(batches)
    }
}

/// Reads a job's result blocks in order from the nodes that hold them.
pub struct BlockReader {
    inner: Arc<Inner>,
    /// Keeps the blocks held while they are read.
    lease: Arc<OutputLease>,
    blocks: Vec<OutputBlock>,
    next: usize,
    holders: Holders,
    /// Batches of the current block not yet returned, last first.
    pending: Vec<RecordBatch>,
}

impl BlockReader {
    /// Blocks read so far (the batches [`BlockReader::next_batch`] returns come from the
    /// last of them).
    pub fn blocks_read(&self) -> u64 {
        self.next as u64
    }

    /// The next batch, or `None` after the last block.
    pub async fn next_batch(&mut self) -> Result<Option<RecordBatch>> {
        loop {
            if let Some(batch) = self.pending.pop() {
                return Ok(Some(batch));
            }
            let Some(block) = self.blocks.get(self.next).copied() else {
                self.holders.close();
                return Ok(None);
            };
            self.next += 1;
            let mut batches = self.fetch(&block).await?;
            batches.reverse();
            self.pending = batches;
        }
    }

    async fn fetch(&mut self, block: &OutputBlock) -> Result<Vec<RecordBatch>> {
        let fetched = self.holders.fetch(&self.inner, block).await;
        if matches!(fetched, Err(Error::BlockLost { .. }))
            && let Some(released) = self.inner.why_released(self.lease.job).await
        {
            return Err(released);
        }
        fetched
    }
}

/// Reads result blocks from the nodes holding them, with one connection per node kept
/// between blocks.
#[derive(Default)]
pub(crate) struct Holders {
    addresses: BTreeMap<NodeId, String>,
    connections: BTreeMap<NodeId, RpcClient<NodeProtocol>>,
}

impl Holders {
    /// The node at which `node`'s RPC server listens, asking the scheduler for nodes it does
    /// not know yet.
    pub(crate) async fn address(&mut self, inner: &Inner, node: NodeId) -> Result<Option<String>> {
        if !self.addresses.contains_key(&node) {
            let (_, nodes) = inner.scheduler.lock().await.alive_nodes().await?;
            self.addresses = nodes.into_iter().map(|node| (node.id, node.rpc)).collect();
        }
        Ok(self.addresses.get(&node).cloned())
    }

    /// Closes the connections kept: a node keeps the last chunk it sent on a connection
    /// pinned until the next request on it, which would delay freeing that block.
    pub(crate) fn close(&mut self) {
        self.connections.clear();
    }

    /// Fetches `block`, checks it against the holder's checksum and decodes it.
    pub(crate) async fn fetch(
        &mut self,
        inner: &Inner,
        block: &OutputBlock,
    ) -> Result<Vec<RecordBatch>> {
        let lost = |reason: String| block_lost(block, reason);
        let mut client = match self.connections.remove(&block.node) {
            Some(client) => client,
            None => {
                let addr = self
                    .address(inner, block.node)
                    .await?
                    .ok_or_else(|| lost("the node is unknown to the scheduler".into()))?;
                RpcClient::<NodeProtocol>::connect(&addr, inner.wire.clone())
                    .await
                    .map_err(|error| lost(error.to_string()))?
            }
        };
        let batches = Self::read(&mut client, block).await?;
        // Kept only after a clean read: a failed one may have left the connection mid-reply.
        self.connections.insert(block.node, client);
        Ok(batches)
    }

    async fn read(
        client: &mut RpcClient<NodeProtocol>,
        block: &OutputBlock,
    ) -> Result<Vec<RecordBatch>> {
        let lost = |reason: String| block_lost(block, reason);
        let bytes = floe_api::fetch::fetch_object(client, block.object)
            .await
            .map_err(|error| match error {
                FetchError::Unexpected(answer) => Error::Unexpected(answer),
                error => lost(error.to_string()),
            })?;
        let reader = FileReader::try_new(Cursor::new(bytes), None)
            .map_err(|error| lost(format!("not an Arrow block: {error}")))?;
        reader
            .map(|batch| batch.map_err(|error| lost(format!("not an Arrow block: {error}"))))
            .collect()
    }
}

/// Runs a [`Dataset`]'s consuming calls on a cluster: each call submits a job, waits for it
/// and streams its result blocks. It owns a runtime for that, so call it from synchronous
/// code (not from inside an async task).
pub struct ClusterExecutor {
    client: Client,
    runtime: tokio::runtime::Runtime,
    options: JobOptions,
}

impl ClusterExecutor {
    /// Connects like [`Client::connect`].
    pub fn connect(replicas: &[impl AsRef<str>], token: &str) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(Error::Runtime)?;
        let client = runtime.block_on(Client::connect(replicas, token))?;
        Ok(Self {
            client,
            runtime,
            options: JobOptions::default(),
        })
    }

    /// The job options every submission uses.
    pub fn with_options(mut self, options: JobOptions) -> Self {
        self.options = options;
        self
    }

    pub fn client(&self) -> &Client {
        &self.client
    }
}

impl Executor for ClusterExecutor {
    fn execute<'a>(&'a self, plan: &LogicalPlan, _udfs: &'a Registry) -> Result<BatchStream<'a>> {
        let mut stream = self
            .runtime
            .block_on(self.client.submit_streamed(plan, &self.options))?;
        let mut failed = false;
        Ok(Box::new(std::iter::from_fn(move || {
            if failed {
                return None;
            }
            let next = self.runtime.block_on(stream.next_batch()).transpose();
            failed = matches!(next, Some(Err(_)));
            next
        })))
    }

    /// Runs the dataset as a job and keeps its output where it is, owned by the returned
    /// dataset; an empty output travels inline (there is nothing to hold).
    fn materialize(&self, dataset: &Dataset) -> Result<Dataset> {
        let plan = dataset.plan().resolve_seeds()?;
        let output = self.runtime.block_on(async {
            let job = self
                .client
                .submit_plan(&plan, self.options.clone(), None)
                .await?;
            job.wait().await
        })?;
        if output.blocks.is_empty() {
            let empty = Dataset::from_batches(dataset.schema(), &[])?;
            return Ok(dataset.then(empty.plan().clone()));
        }
        let source = MaterializedSource {
            job: output.job,
            fingerprint: plan.fingerprint(),
            schema: dataset.schema().clone(),
            blocks: output.blocks.clone(),
        };
        Ok(dataset.owned_by(LogicalPlan::materialized(source)?, Arc::new(output)))
    }
}

/// How [`LocalCluster::start`] runs its processes.
#[derive(Debug, Clone)]
pub struct LocalClusterOptions {
    pub nodes: usize,
    /// The `floe` binary. [`find_floe_binary`] finds the one built next to the running
    /// program.
    pub binary: PathBuf,
    /// Worker processes per node (0: one per CPU).
    pub workers_per_node: u32,
    /// Extra `section.key=value` settings for every node.
    pub node_settings: Vec<String>,
    /// Run every connection (RPC and HTTP) over TLS, with a throwaway CA generated in the
    /// cluster's directory. Default off: plaintext on loopback.
    pub tls: bool,
    /// The ports the scheduler and the nodes listen on.
    pub ports: crate::local::LocalPorts,
}

impl LocalClusterOptions {
    /// `nodes` nodes of the `binary`, one worker per CPU, default settings.
    pub fn new(nodes: usize, binary: PathBuf) -> Self {
        Self {
            nodes,
            binary,
            workers_per_node: 0,
            node_settings: Vec::new(),
            tls: false,
            ports: crate::local::LocalPorts::default(),
        }
    }
}

/// The file with the local cluster's admin token, in its directory.
const TOKEN_FILE: &str = "token";
/// Where a local cluster that runs TLS keeps its throwaway CA and member certificate.
const TLS_DIR: &str = "tls";

/// Writes `token` to a new file only its owner can read (mode 0600 from the start, so it is
/// never readable by others, not even briefly).
fn write_token_file(path: &std::path::Path, token: &str) -> Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let failed = |source: std::io::Error| {
        Error::LocalCluster(format!(
            "cannot write the token file {}: {source}",
            path.display()
        ))
    };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(failed)?;
    file.write_all(token.as_bytes()).map_err(failed)?;
    file.sync_all().map_err(failed)
}

/// Where a [`LocalCluster`] keeps its files and logs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LocalClusterDir {
    /// A new temporary directory, removed when the cluster is dropped.
    #[default]
    Temporary,
    /// This directory, created if missing and kept when the cluster is dropped, so the
    /// nodes' caches (in `node-<i>/`) serve the next cluster started in it. The scheduler's
    /// state, secrets and token are of one run and are made anew each time.
    Kept(PathBuf),
}

/// A [`LocalCluster`]'s directory, as held while it runs.
enum HeldDir {
    Temporary(tempfile::TempDir),
    Kept(PathBuf),
}

impl HeldDir {
    fn create(dir: &LocalClusterDir) -> Result<Self> {
        let failed = |path: &std::path::Path, action: &str, source: std::io::Error| {
            Error::LocalCluster(format!("cannot {action} {}: {source}", path.display()))
        };
        match dir {
            LocalClusterDir::Temporary => tempfile::Builder::new()
                .prefix("floe-local-")
                .tempdir()
                .map(Self::Temporary)
                .map_err(|source| failed(&std::env::temp_dir(), "create a directory in", source)),
            LocalClusterDir::Kept(path) => {
                std::fs::create_dir_all(path).map_err(|e| failed(path, "create", e))?;
                // The last run's replicas and token belong to secrets that are gone.
                for entry in std::fs::read_dir(path).map_err(|e| failed(path, "read", e))? {
                    let entry = entry.map_err(|e| failed(path, "read", e))?;
                    let name = entry.file_name();
                    let name = name.to_string_lossy();
                    let stale = entry.path();
                    if name.starts_with("replica-") && stale.is_dir() {
                        std::fs::remove_dir_all(&stale).map_err(|e| failed(&stale, "remove", e))?;
                    } else if name == TOKEN_FILE {
                        std::fs::remove_file(&stale).map_err(|e| failed(&stale, "remove", e))?;
                    }
                }
                Ok(Self::Kept(path.clone()))
            }
        }
    }

    fn path(&self) -> &std::path::Path {
        match self {
            Self::Temporary(dir) => dir.path(),
            Self::Kept(path) => path,
        }
    }
}

impl Drop for HeldDir {
    fn drop(&mut self) {
        // The admin token dies with the cluster; a kept directory must not keep it readable.
        if let Self::Kept(path) = self {
            let token = path.join(TOKEN_FILE);
            if let Err(error) = std::fs::remove_file(&token) {
                tracing::warn!(path = %token.display(), %error, "cannot remove the token file");
            }
        }
    }
}

/// A real scheduler and real nodes on loopback, in a directory of their own, with generated
/// secrets and an admin token. Dropping it kills every process and removes the nodes' shared
/// memory, and a [temporary](LocalClusterDir::Temporary) directory.
pub struct LocalCluster {
    nodes: Vec<crate::local::LocalNode>,
    scheduler: crate::local::LocalSchedulers,
    credentials: crate::local::LocalCredentials,
    /// The members' TLS files; empty when the cluster runs plaintext.
    tls: TlsConfig,
    dir: HeldDir,
}

impl LocalCluster {
    /// Starts a cluster in a temporary directory.
    pub async fn start(options: LocalClusterOptions) -> Result<Self> {
        Self::start_in(options, &LocalClusterDir::Temporary).await
    }

    /// Starts a cluster in `dir`.
    pub async fn start_in(options: LocalClusterOptions, dir: &LocalClusterDir) -> Result<Self> {
        let dir = HeldDir::create(dir)?;
        let credentials = crate::local::LocalCredentials::generate(dir.path())?;
        write_token_file(
            &dir.path().join(TOKEN_FILE),
            credentials.admin_token.expose(),
        )?;
        // A new throwaway CA on every start, also in a kept directory: its key was never saved.
        let tls = if options.tls {
            let tls_dir = dir.path().join(TLS_DIR);
            std::fs::create_dir_all(&tls_dir).map_err(|source| {
                Error::LocalCluster(format!("cannot create {}: {source}", tls_dir.display()))
            })?;
            floe_core::wire::tls::generate_throwaway(&tls_dir, &[]).map_err(|error| {
                Error::LocalCluster(format!("cannot make its certificates: {error}"))
            })?
        } else {
            TlsConfig::default()
        };
        let scheduler = crate::local::LocalSchedulers::start_on(
            crate::local::LocalSchedulersConfig {
                binary: options.binary.clone(),
                replicas: 1,
                dir: dir.path().to_owned(),
                credentials: credentials.clone(),
                settings: Vec::new(),
                tls: tls.clone(),
            },
            options.ports.scheduler_rpc,
            options.ports.scheduler_http,
        )?;
        scheduler.wait_for_leader(Duration::from_secs(30)).await?;
        let wire = credentials.admin_wire().with_tls(&tls.client_only());
        let mut nodes = Vec::new();
        for index in 0..options.nodes {
            let mut settings = vec![format!("node.workers={}", options.workers_per_node)];
            settings.extend(tls.settings());
            settings.extend(options.node_settings.iter().cloned());
            let port = options.ports.node_rpc.pick(index, options.nodes)?;
            let node = crate::local::LocalNode::start_on(
                &crate::local::LocalNodeConfig {
                    binary: options.binary.clone(),
                    schedulers: scheduler.addrs(),
                    dir: dir.path().to_owned(),
                    name: format!("node-{index}"),
                    credentials: credentials.clone(),
                    settings,
                },
                port,
            )?;
            let status = node.wait_registered(&wire, Duration::from_secs(60)).await?;
            tracing::debug!(?status.node, "local node ready");
            nodes.push(node);
        }
        Ok(Self {
            nodes,
            scheduler,
            credentials,
            tls,
            dir,
        })
    }

    /// The scheduler replicas' addresses.
    pub fn addresses(&self) -> Vec<String> {
        self.scheduler.addrs()
    }

    /// The dashboard (and REST API) of the local cluster's scheduler: `http://host:port/`,
    /// or `https://` when it runs TLS.
    pub fn dashboard_url(&self) -> String {
        let scheme = if self.ca_file().is_some() {
            "https"
        } else {
            "http"
        };
        self.scheduler
            .http_addr(1)
            .map_or_else(String::new, |addr| format!("{scheme}://{addr}/"))
    }

    /// The CA certificate clients verify the cluster with, when it runs TLS.
    pub fn ca_file(&self) -> Option<&std::path::Path> {
        Some(self.tls.ca.as_path()).filter(|ca| !ca.as_os_str().is_empty())
    }

    /// The cluster's admin client token.
    pub fn token(&self) -> &str {
        self.credentials.admin_token.expose()
    }

    /// The file holding the admin token (mode 0600), valid while the cluster runs.
    pub fn token_file(&self) -> PathBuf {
        self.dir.path().join(TOKEN_FILE)
    }

    /// The nodes' RPC addresses.
    pub fn node_addresses(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|node| node.addr().to_owned())
            .collect()
    }

    /// Where the processes keep their files and logs.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    pub async fn connect(&self) -> Result<Client> {
        Client::connect_with(&self.addresses(), self.token(), &self.tls).await
    }
}

/// The `floe` binary beside the running program (or one directory up, for examples and
/// tests that cargo builds into subdirectories of the target directory).
pub fn find_floe_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe().map_err(Error::Runtime)?;
    let mut candidates = Vec::new();
    if exe.file_stem().is_some_and(|stem| stem == "floe") {
        candidates.push(exe.clone());
    }
    for dir in exe.ancestors().skip(1).take(2) {
        candidates.push(dir.join("floe"));
    }
    candidates
        .into_iter()
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| {
            Error::LocalCluster(format!(
                "no floe binary next to {}; build it first with `cargo build --release` (or \
                 `cargo build`), or give LocalClusterOptions::binary",
                exe.display()
            ))
        })
}

/// `block` could not be read from its holder, for `reason`.
fn block_lost(block: &OutputBlock, reason: String) -> Error {
    Error::BlockLost {
        object: block.object,
        node: block.node,
        reason,
    }
}
