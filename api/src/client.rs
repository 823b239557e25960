//! A client of the scheduler service that knows every replica.
//!
//! It sends each request to the replica it believes leads, follows `NotLeader` redirects, and
//! on a connection failure or a leadership change tries the other replicas until its retry
//! window closes. Retrying makes proposals at-least-once: a command whose leader died after
//! committing it but before answering may be applied again when sent to the new leader. Job
//! submissions carry a [`SubmissionId`] so that a repeated one finds its first job; the other
//! commands are idempotent or rejected when repeated.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use floe_core::WireError;
use floe_core::auth::NodeTicket;
use floe_core::job::JobProgress;
use floe_core::wire::{RemoteErrorKind, RpcClient, WireConfig, within};
use floe_core::{ActorId, JobId, LeaseId, NodeId, SubmissionId};

use crate::lease::{Lease, LeaseGrants, LeaseStanding};
use crate::placement::{PlacementError, PlacementRequest};
use crate::scheduler_protocol::{
    NodeReport, NodeSummary, ReplicaStatus, ResourceUsage, SchedulerProtocol, SchedulerRequest,
    SchedulerResponse,
};
use crate::state::{
    CacheIndex, ClusterState, Command, JobRecord, JobSummary, NodeAddresses, NodeDeath, NodeMemory,
    Outcome, Resources,
};
use crate::{Error, Result};

/// Pause between attempts when no replica could answer, so failover costs no busy loop.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// What the leader said to a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeartbeatReply {
    /// Taken; the node must be running the drivers of these jobs (and attempts).
    Accepted { drivers: Vec<(JobId, u32)> },
    /// The node was declared dead; it must register again and use its new id.
    Rejoin,
}

pub struct SchedulerClient {
    replicas: Vec<String>,
    wire: WireConfig,
    retry_for: Duration,
    /// How long one attempt at one replica may take beyond what the request itself asks the
    /// leader to hold it; `None` leaves only the connection's own timeouts (a reply may take
    /// `timeouts.read_ms`, 30 s by default).
    attempt_timeout: Option<Duration>,
    /// The replica currently talked to, and the connection to it.
    target: String,
    connection: Option<RpcClient<SchedulerProtocol>>,
}

/// How long the leader may hold `request` before answering by design: a long poll's wait,
/// nothing for the rest, and `None` for a placement, held until the requests fit.
fn held_for(request: &SchedulerRequest) -> Option<Duration> {
    match request {
        SchedulerRequest::WatchDrivers { wait_ms, .. }
        | SchedulerRequest::WatchJob { wait_ms, .. }
        | SchedulerRequest::WatchDeaths { wait_ms, .. }
        | SchedulerRequest::AcquireLeases { wait_ms, .. } => Some(Duration::from_millis(*wait_ms)),
        SchedulerRequest::Place { .. } => None,
        SchedulerRequest::Raft { .. }
        | SchedulerRequest::RegisterNode { .. }
        | SchedulerRequest::Heartbeat { .. }
        | SchedulerRequest::Propose(_)
        | SchedulerRequest::ReadState
        | SchedulerRequest::RenewLeases { .. }
        | SchedulerRequest::ReturnLeases { .. }
        | SchedulerRequest::NodeReports
        | SchedulerRequest::ReportProgress { .. }
        | SchedulerRequest::JobProgress { .. }
        | SchedulerRequest::AllProgress
        | SchedulerRequest::Status
        | SchedulerRequest::ActorNode { .. }
        | SchedulerRequest::AliveNodes
        | SchedulerRequest::CacheIndex
        | SchedulerRequest::JobHistory { .. } => Some(Duration::ZERO),
    }
}

fn unexpected(response: SchedulerResponse) -> Error {
    Error::NoReplica(format!("unexpected response {response:?}"))
}

impl SchedulerClient {
    /// A client of the replicas at `replicas` (`host:port`); it connects on first use.
    pub fn new(replicas: Vec<String>, wire: WireConfig) -> Result<Self> {
        let target = replicas
            .first()
            .cloned()
            .ok_or_else(|| Error::Peers("no scheduler replica address given".into()))?;
        Ok(Self {
            replicas,
            wire,
            retry_for: Duration::from_secs(10),
            attempt_timeout: None,
            target,
            connection: None,
        })
    }

    /// How long a call keeps trying replicas before it fails. Default 10 s (two election
    /// timeouts, with margin).
    pub fn with_retry_for(mut self, retry_for: Duration) -> Self {
        self.retry_for = retry_for;
        self
    }

    /// Bounds each attempt at one replica (connecting included) by `attempt_timeout` plus
    /// the request's own long-poll wait, then moves on to the next replica. A replica that is
    /// frozen (SIGSTOP, a stalled VM) accepts connections in its kernel but never answers;
    /// without this bound a call sits on it until the read timeout. `Place`, which the leader
    /// holds until the requests fit, is not bounded.
    pub fn with_attempt_timeout(mut self, attempt_timeout: Duration) -> Self {
        self.attempt_timeout = Some(attempt_timeout);
        self
    }

    fn switch_to(&mut self, addr: String) {
        if addr != self.target {
            self.target = addr;
            self.connection = None;
        }
    }

    fn rotate(&mut self) {
        let position = self.replicas.iter().position(|addr| *addr == self.target);
        let next = position.map_or(0, |position| (position + 1) % self.replicas.len());
        self.switch_to(self.replicas[next].clone());
    }

    /// One attempt at the current replica, bounded as [`Self::with_attempt_timeout`] says.
    async fn call_target(
        &mut self,
        request: &SchedulerRequest,
    ) -> Result<SchedulerResponse, WireError> {
        let limit = self
            .attempt_timeout
            .zip(held_for(request))
            .map(|(attempt, held)| attempt + held);
        let Some(limit) = limit else {
            return self.call_target_unbounded(request).await;
        };
        let result = within(
            limit,
            "waiting for a scheduler replica",
            self.call_target_unbounded(request),
        )
        .await
        .and_then(|result| result);
        if matches!(result, Err(WireError::Timeout { .. })) {
            // The reply may still come on this connection; it must not answer a later call.
            self.connection = None;
        }
        result
    }

    async fn call_target_unbounded(
        &mut self,
        request: &SchedulerRequest,
    ) -> Result<SchedulerResponse, WireError> {
        let connection = match &mut self.connection {
            Some(connection) => connection,
            None => self
                .connection
                .insert(RpcClient::connect(self.target.clone(), self.wire.clone()).await?),
        };
        let result = connection.call(request).await;
        if matches!(&result, Err(error) if !matches!(error, WireError::Remote(_))) {
            self.connection = None;
        }
        result
    }

    /// Sends `request` to the leader (or any replica, for requests any replica answers).
    pub async fn call(&mut self, request: &SchedulerRequest) -> Result<SchedulerResponse> {
        let deadline = Instant::now() + self.retry_for;
        let mut last_problem;
        loop {
            match self.call_target(request).await {
                Ok(SchedulerResponse::NotLeader { leader: Some(hint) })
                    if hint.addr != self.target =>
                {
                    self.switch_to(hint.addr);
                    last_problem = "redirected".to_owned();
                }
                Ok(SchedulerResponse::NotLeader { .. }) => {
                    last_problem = format!("{} knows no leader", self.target);
                    self.rotate();
                }
                Ok(response) => return Ok(response),
                Err(WireError::Remote(error)) if error.kind == RemoteErrorKind::Unavailable => {
                    last_problem = format!("{}: {error}", self.target);
                    self.rotate();
                }
                Err(WireError::Remote(error)) => return Err(Error::Wire(error.into())),
                // Every replica has the same secrets, release and CA: asking another cannot help.
                Err(error) if error.is_misconfiguration() => return Err(Error::Wire(error)),
                Err(error) => {
                    last_problem = format!("{}: {error}", self.target);
                    self.rotate();
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::NoReplica(format!(
                    "gave up after {:?}; last problem: {last_problem}",
                    self.retry_for
                )));
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }

    /// Commits `command` and returns its outcome.
    pub async fn propose(&mut self, command: Command) -> Result<Outcome> {
        match self.call(&SchedulerRequest::Propose(command)).await? {
            SchedulerResponse::Committed(outcome) => Ok(outcome),
            other => Err(unexpected(other)),
        }
    }

    /// A linearizable read of the cluster state.
    pub async fn read_state(&mut self) -> Result<ClusterState> {
        match self.call(&SchedulerRequest::ReadState).await? {
            SchedulerResponse::State(mut state) => {
                state.index_submissions();
                Ok(*state)
            }
            other => Err(unexpected(other)),
        }
    }

    /// Registers a node; `replaces` is the id the same agent had before, if any (see
    /// `Command::RegisterNode`).
    pub async fn register_node(
        &mut self,
        addresses: NodeAddresses,
        resources: Resources,
        memory: NodeMemory,
        labels: BTreeMap<String, String>,
        replaces: Option<NodeId>,
    ) -> Result<(NodeId, NodeTicket)> {
        let request = SchedulerRequest::RegisterNode {
            addresses,
            resources,
            memory,
            labels,
            replaces,
        };
        match self.call(&request).await? {
            SchedulerResponse::NodeRegistered { node, ticket } => Ok((node, ticket)),
            SchedulerResponse::Committed(Outcome::Rejected(reason)) => {
                Err(Error::RegistrationRefused(reason))
            }
            other => Err(unexpected(other)),
        }
    }

    pub async fn heartbeat(
        &mut self,
        node: NodeId,
        usage: ResourceUsage,
    ) -> Result<HeartbeatReply> {
        match self
            .call(&SchedulerRequest::Heartbeat { node, usage })
            .await?
        {
            SchedulerResponse::HeartbeatAccepted { drivers } => {
                Ok(HeartbeatReply::Accepted { drivers })
            }
            SchedulerResponse::Rejoin => Ok(HeartbeatReply::Rejoin),
            other => Err(unexpected(other)),
        }
    }

    /// The job's record once it has ended, or as it is after `wait`; None for no such job.
    pub async fn watch_job(&mut self, job: JobId, wait: Duration) -> Result<Option<JobRecord>> {
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        match self
            .call(&SchedulerRequest::WatchJob { job, wait_ms })
            .await?
        {
            SchedulerResponse::Job(record) => Ok(record.map(|record| *record)),
            other => Err(unexpected(other)),
        }
    }

    /// The drivers `node` must run, once they differ from `known` or `wait` has passed.
    pub async fn watch_drivers(
        &mut self,
        node: NodeId,
        known: Vec<(JobId, u32)>,
        wait: Duration,
    ) -> Result<HeartbeatReply> {
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        let request = SchedulerRequest::WatchDrivers {
            node,
            known,
            wait_ms,
        };
        match self.call(&request).await? {
            SchedulerResponse::HeartbeatAccepted { drivers } => {
                Ok(HeartbeatReply::Accepted { drivers })
            }
            SchedulerResponse::Rejoin => Ok(HeartbeatReply::Rejoin),
            other => Err(unexpected(other)),
        }
    }

    /// Commits a job, called `name` if given; a retried submission with the same id returns
    /// the same job.
    pub async fn submit_job(
        &mut self,
        spec: Vec<u8>,
        submission: SubmissionId,
        name: Option<String>,
    ) -> Result<JobId> {
        match self
            .propose(Command::SubmitJob {
                spec,
                submission,
                name,
            })
            .await?
        {
            Outcome::JobSubmitted(job) => Ok(job),
            other => Err(Error::NoReplica(format!("unexpected outcome {other:?}"))),
        }
    }

    /// Reports a running job's progress; `true` means the driver must stop (the job was
    /// cancelled or has ended).
    pub async fn report_progress(&mut self, job: JobId, progress: JobProgress) -> Result<bool> {
        match self
            .call(&SchedulerRequest::ReportProgress { job, progress })
            .await?
        {
            SchedulerResponse::ProgressAccepted { cancel } => Ok(cancel),
            other => Err(unexpected(other)),
        }
    }

    /// What the job's driver last reported, if it is running.
    pub async fn job_progress(&mut self, job: JobId) -> Result<Option<JobProgress>> {
        match self.call(&SchedulerRequest::JobProgress { job }).await? {
            SchedulerResponse::Progress(progress) => Ok(progress),
            other => Err(unexpected(other)),
        }
    }

    /// The progress every running job's driver last reported.
    pub async fn all_progress(&mut self) -> Result<BTreeMap<JobId, JobProgress>> {
        match self.call(&SchedulerRequest::AllProgress).await? {
            SchedulerResponse::AllProgress(progress) => Ok(progress),
            other => Err(unexpected(other)),
        }
    }

    /// The leader's latest heartbeat report from every alive node.
    pub async fn node_reports(&mut self) -> Result<BTreeMap<NodeId, NodeReport>> {
        match self.call(&SchedulerRequest::NodeReports).await? {
            SchedulerResponse::NodeReports(reports) => Ok(reports),
            other => Err(unexpected(other)),
        }
    }

    /// Places a batch; requests that fit only later are answered once they are placed.
    pub async fn place(
        &mut self,
        requests: Vec<PlacementRequest>,
    ) -> Result<Vec<Result<NodeId, PlacementError>>> {
        match self.call(&SchedulerRequest::Place { requests }).await? {
            SchedulerResponse::Placements(placements) => Ok(placements),
            other => Err(unexpected(other)),
        }
    }

    /// Asks for a lease per request for `job` (as its driver), waiting up to `wait` for the
    /// first to be granted.
    pub async fn acquire_leases(
        &mut self,
        job: JobId,
        requests: Vec<PlacementRequest>,
        wait: Duration,
    ) -> Result<LeaseGrants> {
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        let request = SchedulerRequest::AcquireLeases {
            job,
            requests,
            wait_ms,
        };
        match self.call(&request).await? {
            SchedulerResponse::Leases(grants) => Ok(grants),
            other => Err(unexpected(other)),
        }
    }

    /// Renews `job`'s leases (as its driver); one standing per lease, in order.
    pub async fn renew_leases(
        &mut self,
        job: JobId,
        leases: Vec<Lease>,
    ) -> Result<Vec<LeaseStanding>> {
        match self
            .call(&SchedulerRequest::RenewLeases { job, leases })
            .await?
        {
            SchedulerResponse::LeasesRenewed(standings) => Ok(standings),
            other => Err(unexpected(other)),
        }
    }

    /// Gives `job`'s leases back (as its driver).
    pub async fn return_leases(&mut self, job: JobId, leases: Vec<LeaseId>) -> Result<()> {
        match self
            .call(&SchedulerRequest::ReturnLeases { job, leases })
            .await?
        {
            SchedulerResponse::LeasesReturned => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Node deaths committed after log index `after`, waiting up to `wait` for the next one.
    pub async fn watch_deaths(&mut self, after: u64, wait: Duration) -> Result<Vec<NodeDeath>> {
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        match self
            .call(&SchedulerRequest::WatchDeaths { after, wait_ms })
            .await?
        {
            SchedulerResponse::Deaths(deaths) => Ok(deaths),
            other => Err(unexpected(other)),
        }
    }

    /// The node hosting `actor`, if the scheduler knows the actor.
    pub async fn actor_node(&mut self, actor: ActorId) -> Result<Option<NodeSummary>> {
        match self.call(&SchedulerRequest::ActorNode { actor }).await? {
            SchedulerResponse::ActorNode(node) => Ok(node),
            other => Err(unexpected(other)),
        }
    }

    /// The alive nodes, and the log index they are as of (for [`Self::watch_deaths`]).
    pub async fn alive_nodes(&mut self) -> Result<(u64, Vec<NodeSummary>)> {
        match self.call(&SchedulerRequest::AliveNodes).await? {
            SchedulerResponse::AliveNodes { as_of, nodes } => Ok((as_of, nodes)),
            other => Err(unexpected(other)),
        }
    }

    /// The fingerprint cache index.
    pub async fn cache_index(&mut self) -> Result<CacheIndex> {
        match self.call(&SchedulerRequest::CacheIndex).await? {
            SchedulerResponse::CacheIndex(index) => Ok(index),
            other => Err(unexpected(other)),
        }
    }

    /// Up to `limit` summaries of jobs that left the state, newest first.
    pub async fn job_history(&mut self, limit: u32) -> Result<Vec<JobSummary>> {
        match self.call(&SchedulerRequest::JobHistory { limit }).await? {
            SchedulerResponse::History(summaries) => Ok(summaries),
            other => Err(unexpected(other)),
        }
    }

    /// The Raft status of the replica at `addr` itself (no redirect).
    pub async fn status_of(addr: &str, wire: WireConfig) -> Result<ReplicaStatus> {
        let mut client = RpcClient::<SchedulerProtocol>::connect(addr, wire).await?;
        match client.call(&SchedulerRequest::Status).await? {
            SchedulerResponse::Status(status) => Ok(status),
            other => Err(unexpected(other)),
        }
    }
}
