//! The RPC front: the [`Handler`] clients, nodes and other replicas call, which turns Raft
//! traffic and requests into inputs for the Raft loop, answers heartbeats itself (see the
//! `heartbeats` module) and holds the watches (deaths, jobs, drivers) open until the loop
//! announces a change; and the loop's side of each request — answered from the state,
//! proposed, or redirected to the leader when this replica is not it.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use floe_core::NodeId;
use floe_core::auth::{Authenticator, Principal};
use floe_core::wire::{Handler, Peer, RemoteError, RemoteErrorKind};
use raft::prelude::Message;
use tokio::sync::{broadcast, mpsc, oneshot, watch};

use super::heartbeats::{Beats, Directory, Heard};
use super::raft_guard::RaftGuard;
use super::{Input, Notices, RaftLoop, Reply};
use crate::storage::LogStore;
use floe_api::authz;
use floe_api::scheduler_protocol::{
    LeaderHint, NodeReport, NodeSummary, ReplicaStatus, ResourceUsage, SchedulerProtocol,
    SchedulerRequest, SchedulerResponse,
};
use floe_api::state::{ClusterState, Command, JobRecord, JobStatus, Outcome};

/// Most history entries one `JobHistory` answer carries, so it fits a frame.
const MAX_HISTORY_PAGE: u32 = 10_000;

/// The longest a `WatchDeaths` request may wait, so it stays within the client's read timeout.
const MAX_WATCH_WAIT: Duration = Duration::from_secs(10);

pub(super) struct Service {
    pub(super) inputs: mpsc::Sender<Input>,
    pub(super) notices: Notices,
    pub(super) raft_guard: RaftGuard,
    /// The configured replica ids: the only peers whose Raft messages are decoded.
    pub(super) replicas: BTreeSet<u64>,
    /// Issues the tickets registered nodes present from then on.
    pub(super) authenticator: Arc<Authenticator>,
    /// This replica's history file, read for `JobHistory`.
    pub(super) history: Option<PathBuf>,
    /// What heartbeats and driver watches are answered from, and recorded in.
    pub(super) directory: watch::Receiver<Arc<Directory>>,
    pub(super) beats: Arc<Beats>,
}

fn stopped() -> RemoteError {
    RemoteError::new(RemoteErrorKind::Unavailable, "the replica is shutting down")
}

fn forbidden(principal: &Principal, refusal: authz::Forbidden) -> RemoteError {
    tracing::warn!(%principal, %refusal, "refused a request");
    RemoteError::new(RemoteErrorKind::Forbidden, refusal.0)
}

impl Service {
    async fn ask(
        &self,
        principal: &Principal,
        request: SchedulerRequest,
    ) -> Result<SchedulerResponse, RemoteError> {
        let (reply, answer) = oneshot::channel();
        self.inputs
            .send(Input::Request {
                principal: principal.clone(),
                request,
                reply,
            })
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }

    /// A heartbeat's or a driver watch's answer for `node`, from the loop's last directory:
    /// the drivers it should run, `Rejoin` if it is not alive, or where the leader is. With
    /// the term this replica answered as leader of.
    fn node_drivers(
        &self,
        principal: &Principal,
        request: &SchedulerRequest,
        node: floe_core::NodeId,
    ) -> Result<(SchedulerResponse, Option<u64>), RemoteError> {
        // Only the node itself may ask, which depends on no state.
        authz::authorize_scheduler(principal, request, &ClusterState::default())
            .map_err(|refusal| forbidden(principal, refusal))?;
        let directory = Arc::clone(&self.directory.borrow());
        let Some(term) = directory.leading else {
            let leader = directory.leader.clone();
            return Ok((SchedulerResponse::NotLeader { leader }, None));
        };
        let response = if directory.nodes.is_alive(node) {
            SchedulerResponse::HeartbeatAccepted {
                drivers: directory.nodes.drivers_on(node),
            }
        } else {
            SchedulerResponse::Rejoin
        };
        Ok((response, Some(term)))
    }

    /// Refuses Raft messages from anyone but a configured replica that proved the replica
    /// secret, before a byte of them reaches raft-rs's decoder; and messages that claim to
    /// come from another replica than the one that sent them.
    fn raft_messages(
        &self,
        principal: &Principal,
        messages: &[Vec<u8>],
    ) -> Result<Vec<Message>, RemoteError> {
        let request = SchedulerRequest::Raft {
            messages: Vec::new(),
        };
        authz::authorize_scheduler(principal, &request, &ClusterState::default())
            .map_err(|refusal| forbidden(principal, refusal))?;
        let Principal::Replica(sender) = principal else {
            return Err(forbidden(
                principal,
                authz::Forbidden("raft messages come only from replicas".into()),
            ));
        };
        if !self.replicas.contains(sender) {
            return Err(forbidden(
                principal,
                authz::Forbidden(format!(
                    "replica {sender} is not one of the configured replicas {:?}",
                    self.replicas
                )),
            ));
        }
        // Checked before protobuf parses it (CVE-2025-53605), see `raft_guard`.
        let messages = messages
            .iter()
            .map(|bytes| self.raft_guard.decode(bytes))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| RemoteError::new(RemoteErrorKind::BadRequest, error.to_string()))?;
        if let Some(message) = messages.iter().find(|message| message.from != *sender) {
            return Err(forbidden(
                principal,
                authz::Forbidden(format!(
                    "replica {sender} sent a raft message from replica {}",
                    message.from
                )),
            ));
        }
        Ok(messages)
    }
}

impl Handler<SchedulerProtocol> for Service {
    async fn handle(
        &self,
        peer: Peer,
        request: SchedulerRequest,
    ) -> Result<SchedulerResponse, RemoteError> {
        let principal = &peer.principal;
        match request {
            SchedulerRequest::Raft { messages } => {
                let messages = self.raft_messages(principal, &messages)?;
                self.inputs
                    .send(Input::Raft(messages))
                    .await
                    .map_err(|_| stopped())?;
                Ok(SchedulerResponse::RaftAccepted)
            }
            SchedulerRequest::WatchDeaths { after, wait_ms } => {
                // Subscribe before reading, so a death committed in between is not missed.
                let mut published = self.notices.deaths.subscribe();
                let known = self
                    .ask(principal, SchedulerRequest::WatchDeaths { after, wait_ms })
                    .await?;
                if !matches!(&known, SchedulerResponse::Deaths(deaths) if deaths.is_empty()) {
                    return Ok(known);
                }
                let wait = Duration::from_millis(wait_ms).min(MAX_WATCH_WAIT);
                let next = tokio::time::timeout(wait, async {
                    loop {
                        match published.recv().await {
                            Ok(death) if death.index > after => return Ok(vec![death]),
                            Ok(_) => {}
                            // Missed some: the state has them all.
                            Err(broadcast::error::RecvError::Lagged(_)) => {
                                return self
                                    .ask(
                                        principal,
                                        SchedulerRequest::WatchDeaths { after, wait_ms },
                                    )
                                    .await
                                    .map(|response| match response {
                                        SchedulerResponse::Deaths(deaths) => deaths,
                                        _ => Vec::new(),
                                    });
                            }
                            Err(broadcast::error::RecvError::Closed) => return Err(stopped()),
                        }
                    }
                })
                .await;
                match next {
                    Ok(deaths) => Ok(SchedulerResponse::Deaths(deaths?)),
                    Err(_) => Ok(SchedulerResponse::Deaths(Vec::new())),
                }
            }
            SchedulerRequest::WatchJob { job, wait_ms } => {
                // Subscribe before reading, so an end committed in between is not missed.
                let mut ended = self.notices.jobs_ended.subscribe();
                let request = SchedulerRequest::WatchJob { job, wait_ms };
                let current = self.ask(principal, request.clone()).await?;
                let running = matches!(&current, SchedulerResponse::Job(Some(record)) if !record.status.is_finished());
                // A zero wait is a plain read (a driver reading its job, say): one read answers it.
                if !running || wait_ms == 0 {
                    return Ok(current);
                }
                until_announced(&mut ended, job, wait_ms).await;
                self.ask(principal, request).await
            }
            SchedulerRequest::Heartbeat { node, usage } => {
                let request = SchedulerRequest::Heartbeat { node, usage };
                let (response, term) = self.node_drivers(principal, &request, node)?;
                if let (SchedulerResponse::HeartbeatAccepted { .. }, Some(term)) = (&response, term)
                    && self.beats.heard(term, node, usage) == Heard::First
                {
                    self.inputs
                        .send(Input::Heard(node))
                        .await
                        .map_err(|_| stopped())?;
                }
                Ok(response)
            }
            SchedulerRequest::WatchDrivers {
                node,
                known,
                wait_ms,
            } => {
                // Subscribe before reading, so a driver started in between is not missed.
                let mut started = self.notices.drivers_started.subscribe();
                let request = SchedulerRequest::WatchDrivers {
                    node,
                    known: known.clone(),
                    wait_ms,
                };
                let (current, _) = self.node_drivers(principal, &request, node)?;
                if !matches!(&current, SchedulerResponse::HeartbeatAccepted { drivers } if *drivers == known)
                {
                    return Ok(current);
                }
                // Announced once the directory says so (`publish_directory`).
                until_announced(&mut started, node, wait_ms).await;
                Ok(self.node_drivers(principal, &request, node)?.0)
            }
            request @ SchedulerRequest::RegisterNode { .. } => {
                match self.ask(principal, request).await? {
                    SchedulerResponse::Committed(Outcome::NodeRegistered(node)) => {
                        let ticket = self.authenticator.issue_ticket(node).ok_or_else(|| {
                            RemoteError::new(
                                RemoteErrorKind::Internal,
                                "this replica has no replica secret to issue node tickets",
                            )
                        })?;
                        Ok(SchedulerResponse::NodeRegistered { node, ticket })
                    }
                    other => Ok(other),
                }
            }
            SchedulerRequest::JobHistory { limit } => {
                // Answered here, from this replica's file, so checked here; reads depend on no
                // state.
                let request = SchedulerRequest::JobHistory { limit };
                authz::authorize_scheduler(principal, &request, &ClusterState::default())
                    .map_err(|refusal| forbidden(principal, refusal))?;
                let Some(path) = self.history.clone() else {
                    return Ok(SchedulerResponse::History(Vec::new()));
                };
                let limit = usize::try_from(limit.min(MAX_HISTORY_PAGE)).unwrap_or(usize::MAX);
                let read =
                    tokio::task::spawn_blocking(move || crate::history::read_newest(&path, limit))
                        .await
                        .map_err(|error| {
                            RemoteError::new(RemoteErrorKind::Internal, error.to_string())
                        })?;
                read.map(SchedulerResponse::History)
                    .map_err(|error| RemoteError::new(RemoteErrorKind::Internal, error.to_string()))
            }
            request => self.ask(principal, request).await,
        }
    }
}

/// Waits until `announcements` carries `wanted`, at most `wait_ms` (capped by
/// [`MAX_WATCH_WAIT`]). Missed announcements or a closed channel end the wait too: the caller
/// reads the state again either way.
async fn until_announced<T: Clone + PartialEq>(
    announcements: &mut broadcast::Receiver<T>,
    wanted: T,
    wait_ms: u64,
) {
    let wait = Duration::from_millis(wait_ms).min(MAX_WATCH_WAIT);
    let _ = tokio::time::timeout(wait, async {
        while let Ok(announced) = announcements.recv().await {
            if announced == wanted {
                return;
            }
        }
    })
    .await;
}

fn refuse_not_a_node(reply: Reply) {
    let _ = reply.send(Err(RemoteError::new(
        RemoteErrorKind::Forbidden,
        "leases are for the node driving the job",
    )));
}

impl<S: LogStore> RaftLoop<S> {
    pub(super) fn leader_hint(&self) -> Option<LeaderHint> {
        let leader = self.raw.raft.leader_id;
        self.peers.get(&leader).map(|addr| LeaderHint {
            id: leader,
            addr: addr.clone(),
        })
    }

    pub(super) fn not_leader(&self) -> SchedulerResponse {
        SchedulerResponse::NotLeader {
            leader: self.leader_hint(),
        }
    }

    pub(super) fn handle_request(
        &mut self,
        principal: &Principal,
        request: SchedulerRequest,
        reply: Reply,
    ) {
        let answered_anywhere = matches!(
            request,
            SchedulerRequest::Status | SchedulerRequest::WatchDeaths { .. }
        );
        // `was_leader`: a replica that just won its election answers as leader only once
        // `on_role_change` has set up the leader's soft state (leases, heartbeats) at the end
        // of the turn; before that its tables are a follower's.
        let leading = self.is_leader() && self.was_leader;
        if !answered_anywhere && !leading {
            let _ = reply.send(Ok(self.not_leader()));
            return;
        }
        // Checked against the leader's state (what a node drives, which job an actor
        // belongs to); the two requests any replica answers depend on no state.
        if let Err(refusal) = authz::authorize_scheduler(principal, &request, &self.state) {
            let _ = reply.send(Err(forbidden(principal, refusal)));
            return;
        }
        match request {
            SchedulerRequest::Status => {
                let status = self.status();
                let _ = reply.send(Ok(SchedulerResponse::Status(status)));
            }
            SchedulerRequest::WatchDeaths { after, .. } => {
                let deaths = self.state.deaths_after(after);
                let _ = reply.send(Ok(SchedulerResponse::Deaths(deaths)));
            }
            SchedulerRequest::RegisterNode {
                addresses,
                resources,
                memory,
                labels,
                replaces,
            } => self.propose(
                Command::RegisterNode {
                    addresses,
                    resources,
                    memory,
                    labels,
                    replaces,
                },
                Some(reply),
            ),
            SchedulerRequest::Propose(command) => self.propose(command, Some(reply)),
            SchedulerRequest::WatchJob { job, .. } => {
                let record = self
                    .state
                    .jobs
                    .get(&job)
                    .map(|record| Box::new(JobRecord::clone(record)));
                let _ = reply.send(Ok(SchedulerResponse::Job(record)));
            }
            SchedulerRequest::ReadState => self.reads_unissued.push(reply),
            SchedulerRequest::NodeReports => {
                let now = Instant::now();
                // Copied out under the book's lock, which every heartbeat takes: the leases
                // are looked up after it is released.
                let heard: Vec<(NodeId, ResourceUsage, Instant)> = {
                    let beats = self.beats.lock();
                    beats
                        .usage
                        .iter()
                        .filter_map(|(node, usage)| {
                            Some((*node, *usage, *beats.last_seen.get(node)?))
                        })
                        .collect()
                };
                let reports = heard
                    .into_iter()
                    .map(|(node, usage, seen)| {
                        let age = now.duration_since(seen).as_millis();
                        (
                            node,
                            NodeReport {
                                usage,
                                reserved: self.leases.view().used(node).unwrap_or_default(),
                                leases: self.leases.on_node(node),
                                age_ms: u64::try_from(age).unwrap_or(u64::MAX),
                            },
                        )
                    })
                    .collect();
                let _ = reply.send(Ok(SchedulerResponse::NodeReports(reports)));
            }
            SchedulerRequest::ReportProgress { job, progress } => {
                let response = match self.state.jobs.get(&job) {
                    Some(record) if record.status == JobStatus::Running => {
                        let cancel = record.cancel_requested;
                        self.progress.insert(job, progress);
                        SchedulerResponse::ProgressAccepted { cancel }
                    }
                    // The job ended or was never here: the driver should stop.
                    _ => SchedulerResponse::ProgressAccepted { cancel: true },
                };
                let _ = reply.send(Ok(response));
            }
            SchedulerRequest::JobProgress { job } => {
                let progress = self.progress.get(&job).cloned();
                let _ = reply.send(Ok(SchedulerResponse::Progress(progress)));
            }
            SchedulerRequest::AllProgress => {
                let progress = self.progress.clone();
                let _ = reply.send(Ok(SchedulerResponse::AllProgress(progress)));
            }
            SchedulerRequest::Place { requests } => self.place(requests, reply),
            // Authorization let only registered nodes through; the node is the driver.
            SchedulerRequest::AcquireLeases {
                job,
                requests,
                wait_ms,
            } => match principal {
                Principal::Node(driver) => {
                    self.acquire_leases(*driver, job, requests, wait_ms, reply);
                }
                _ => refuse_not_a_node(reply),
            },
            SchedulerRequest::RenewLeases { job, leases } => match principal {
                Principal::Node(driver) => self.renew_leases(*driver, job, leases, reply),
                _ => refuse_not_a_node(reply),
            },
            SchedulerRequest::ReturnLeases { job, leases } => match principal {
                Principal::Node(driver) => self.return_leases(*driver, job, leases, reply),
                _ => refuse_not_a_node(reply),
            },
            SchedulerRequest::ActorNode { actor } => {
                let node = self
                    .state
                    .actors
                    .get(&actor)
                    .and_then(|actor| self.node_summary(actor.node));
                let _ = reply.send(Ok(SchedulerResponse::ActorNode(node)));
            }
            SchedulerRequest::AliveNodes => {
                let nodes = self
                    .state
                    .alive_nodes()
                    .filter_map(|node| self.node_summary(node.id))
                    .collect();
                let _ = reply.send(Ok(SchedulerResponse::AliveNodes {
                    as_of: self.state.applied_index,
                    nodes,
                }));
            }
            SchedulerRequest::CacheIndex => {
                let index = self.state.cache.clone();
                let _ = reply.send(Ok(SchedulerResponse::CacheIndex(index)));
            }
            SchedulerRequest::Raft { .. }
            | SchedulerRequest::JobHistory { .. }
            | SchedulerRequest::Heartbeat { .. }
            | SchedulerRequest::WatchDrivers { .. } => {
                let _ = reply.send(Err(RemoteError::new(
                    RemoteErrorKind::BadRequest,
                    "raft messages, history reads and heartbeats are not the raft loop's to \
                     answer",
                )));
            }
        }
    }

    /// An alive node's address and resources.
    fn node_summary(&self, node: floe_core::NodeId) -> Option<NodeSummary> {
        let record = self.state.nodes.get(&node).filter(|node| node.is_alive())?;
        Some(NodeSummary {
            id: record.id,
            rpc: record.addresses.rpc.clone(),
            resources: record.resources,
        })
    }

    pub(super) fn status(&self) -> ReplicaStatus {
        let leader = self.raw.raft.leader_id;
        let store = self.raw.store();
        ReplicaStatus {
            id: self.id,
            leader: (leader != 0).then_some(leader),
            term: self.raw.raft.term,
            commit: self.raw.raft.raft_log.committed,
            applied: self.state.applied_index,
            applied_commands: self.state.applied_commands,
            first_index: store.first_index().unwrap_or(0),
            snapshot_index: store.latest_snapshot().get_metadata().index,
            last_snapshot: self.last_snapshot,
            wal_writes: self.wal_writes.report(),
        }
    }
}
