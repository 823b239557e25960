//! Who may send what: one pure decision for every scheduler request, every [`Command`] inside
//! a `Propose`, and every node request, from the verified [`Principal`] and (for requests
//! about a node or a job) the leader's state.
//!
//! Every `match` here is exhaustive, so a new request or command cannot be added without
//! deciding who may send it. The table in docs/SECURITY.md is checked against [`RIGHTS`].
//!
//! Scopes nest: `admin` ⊇ `submit` ⊇ `read`. Members are the holders of the cluster secret:
//! a bare member (a node that has not registered) may only register and ask a replica's
//! status; a registered node acts for itself and for the jobs it drives; replicas exchange
//! Raft messages and read.

use floe_core::NodeId;
use floe_core::auth::{Principal, Scope};

use crate::node_protocol::NodeRequest;
use crate::scheduler_protocol::SchedulerRequest;
use crate::state::{ClusterState, Command};

/// Why a request was refused; the message names the missing right.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Forbidden(pub String);

type Decision = Result<(), Forbidden>;

fn forbid(message: impl Into<String>) -> Decision {
    Err(Forbidden(message.into()))
}

/// A client with `scope`; anyone else is refused with a message naming it.
fn client_with(principal: &Principal, scope: Scope, what: &str) -> Decision {
    match principal {
        Principal::Client { .. } if principal.has_scope(scope) => Ok(()),
        Principal::Client { name, .. } => forbid(format!(
            "token '{name}' lacks scope {scope}, which {what} needs"
        )),
        other => forbid(format!(
            "{what} is for clients with scope {scope}, not {other}"
        )),
    }
}

/// Reads: a client with `read`, a registered node or a replica.
fn reader(principal: &Principal, what: &str) -> Decision {
    match principal {
        Principal::Node(_) | Principal::Replica(_) => Ok(()),
        Principal::Client { .. } => client_with(principal, Scope::Read, what),
        Principal::Member => forbid(format!(
            "{what} needs a registered node, a replica or a read token; an unregistered \
             member may only register"
        )),
    }
}

/// The registered node itself.
fn the_node(principal: &Principal, node: NodeId, what: &str) -> Decision {
    match principal {
        Principal::Node(own) if *own == node => Ok(()),
        Principal::Node(own) => forbid(format!(
            "a node may only report about itself (node {own} sent {what} for node {node})"
        )),
        other => forbid(format!(
            "{what} for node {node} may only come from that node, not {other}"
        )),
    }
}

/// Any registered node (a driver's placements, releases).
fn a_node(principal: &Principal, what: &str) -> Decision {
    match principal {
        Principal::Node(_) => Ok(()),
        other => forbid(format!(
            "{what} may only come from a registered node, not {other}"
        )),
    }
}

/// The node running `job`'s driver now.
fn driver_of(
    principal: &Principal,
    state: &ClusterState,
    job: floe_core::JobId,
    what: &str,
) -> Decision {
    let Principal::Node(node) = principal else {
        return forbid(format!(
            "{what} may only come from the node driving job {job}, not {principal}"
        ));
    };
    let Some(record) = state.jobs.get(&job) else {
        return forbid(format!(
            "there is no job {job}, so node {node} may not send {what}"
        ));
    };
    match record.driver {
        Some(driver) if driver == *node => Ok(()),
        Some(driver) => forbid(format!(
            "node {node} does not drive job {job} (node {driver} does), so it may not send {what}"
        )),
        // A superseded or late driver (its job went back to pending, or ended): the command
        // is let through to be `Rejected` when applied, which changes nothing, so the driver
        // ends as it did before roles existed.
        None => Ok(()),
    }
}

/// The node running `job`'s driver, the job running: what new leases need. (A late driver
/// may still renew and return what it holds through [`driver_of`]; the leader answers
/// that those are revoked.)
fn running_driver_of(
    principal: &Principal,
    state: &ClusterState,
    job: floe_core::JobId,
    what: &str,
) -> Decision {
    if !state.job_is_running(job) {
        return forbid(format!(
            "job {job} is not running, so {principal} may not send {what} for it"
        ));
    }
    driver_of(principal, state, job, what)
}

/// The node driving `job` while it runs; any node once it does not (a driver whose job ended
/// or went back to pending is answered "stop" or "revoked", which changes nothing), so only a
/// running job another node drives is refused.
fn late_driver_of(
    principal: &Principal,
    state: &ClusterState,
    job: floe_core::JobId,
    what: &str,
) -> Decision {
    if state.job_is_running(job) {
        driver_of(principal, state, job, what)
    } else {
        a_node(principal, what)
    }
}

/// Whether `node` drives some running job (drivers record and evict cache shards anywhere).
fn drives_a_job(state: &ClusterState, node: NodeId) -> bool {
    state.drives_a_job(node)
}

/// May `principal` send `request` to a scheduler replica, given the leader's `state`?
pub fn authorize_scheduler(
    principal: &Principal,
    request: &SchedulerRequest,
    state: &ClusterState,
) -> Decision {
    match request {
        SchedulerRequest::Raft { .. } => match principal {
            Principal::Replica(_) => Ok(()),
            other => forbid(format!(
                "raft messages are only accepted from replicas, not {other}"
            )),
        },
        SchedulerRequest::RegisterNode { replaces, .. } => match (principal, replaces) {
            // A member's claim to replace a node holds only at that node's own address, which
            // `apply` checks.
            (Principal::Member, _) => Ok(()),
            (Principal::Node(own), Some(old)) if own != old => forbid(format!(
                "a node may only replace itself (node {own} registered as the replacement of \
                 node {old})"
            )),
            (Principal::Node(_), _) => Ok(()),
            (other, _) => forbid(format!(
                "only cluster members (the cluster secret) may register a node, not {other}"
            )),
        },
        SchedulerRequest::Heartbeat { node, .. } => the_node(principal, *node, "a heartbeat"),
        SchedulerRequest::WatchDrivers { node, .. } => the_node(principal, *node, "a driver watch"),
        SchedulerRequest::Propose(command) => authorize_command(principal, command, state),
        SchedulerRequest::Place { .. } => a_node(principal, "a placement"),
        SchedulerRequest::AcquireLeases { job, .. } => {
            running_driver_of(principal, state, *job, "a lease request")
        }
        SchedulerRequest::RenewLeases { job, .. } => {
            late_driver_of(principal, state, *job, "a lease renewal")
        }
        SchedulerRequest::ReturnLeases { job, .. } => {
            late_driver_of(principal, state, *job, "a lease return")
        }
        SchedulerRequest::ReportProgress { job, .. } => {
            late_driver_of(principal, state, *job, "a progress report")
        }
        SchedulerRequest::Status => match principal {
            Principal::Member => Ok(()),
            other => reader(other, "a replica's status"),
        },
        SchedulerRequest::ReadState => reader(principal, "reading the cluster state"),
        SchedulerRequest::NodeReports => reader(principal, "reading node reports"),
        SchedulerRequest::JobProgress { .. } => reader(principal, "reading a job's progress"),
        SchedulerRequest::AllProgress => reader(principal, "reading progress"),
        SchedulerRequest::WatchJob { .. } => reader(principal, "watching a job"),
        SchedulerRequest::WatchDeaths { .. } => reader(principal, "watching node deaths"),
        SchedulerRequest::AliveNodes => reader(principal, "listing the alive nodes"),
        SchedulerRequest::JobHistory { .. } => reader(principal, "reading the job history"),
        SchedulerRequest::ActorNode { .. } => a_node(principal, "looking up an actor's node"),
        SchedulerRequest::CacheIndex => a_node(principal, "reading the cache index"),
    }
}

/// May `principal` propose `command`? Commands the leader makes itself (a node's death
/// after missed heartbeats, starting a driver) never come through here.
pub fn authorize_command(
    principal: &Principal,
    command: &Command,
    state: &ClusterState,
) -> Decision {
    match command {
        Command::RegisterNode { .. } => forbid(
            "RegisterNode cannot be proposed; a node registers with the RegisterNode request",
        ),
        Command::StartDriver { .. } => {
            forbid("StartDriver cannot be proposed; only the leader starts drivers")
        }
        Command::MarkNodeDead { node, .. } => match principal {
            Principal::Node(own) if own == node => Ok(()),
            Principal::Node(own) => forbid(format!(
                "a node may only declare itself gone (node {own} proposed the death of node {node})"
            )),
            other => forbid(format!(
                "only node {node} itself may declare it gone, not {other}; the leader commits \
                 deaths after missed heartbeats"
            )),
        },
        Command::SubmitJob { .. } => client_with(principal, Scope::Submit, "submitting a job"),
        Command::CancelJob { .. } => client_with(principal, Scope::Submit, "cancelling a job"),
        Command::FinishJob { job, .. } => driver_of(principal, state, *job, "FinishJob"),
        Command::RegisterActor { job, .. } => driver_of(principal, state, *job, "RegisterActor"),
        Command::RemoveActor { actor } => match state.actors.get(actor) {
            Some(record) => driver_of(principal, state, record.job, "RemoveActor"),
            // Nothing to remove: the command is rejected when applied, and changes nothing.
            None => a_node(principal, "RemoveActor"),
        },
        Command::RecordCacheShard { shard, .. } => match principal {
            Principal::Node(node) if *node == shard.node || drives_a_job(state, *node) => Ok(()),
            Principal::Node(node) => forbid(format!(
                "node {node} may only record shards it holds or that a job it drives wrote \
                 (the shard is on node {})",
                shard.node
            )),
            other => forbid(format!(
                "RecordCacheShard may only come from a node, not {other}"
            )),
        },
        Command::ForgetCacheShard { node: holder, .. } => match principal {
            Principal::Node(node) if node == holder || drives_a_job(state, *node) => Ok(()),
            Principal::Node(node) => forbid(format!(
                "node {node} may only forget shards it holds or that a job it drives found                  missing (the shard is on node {holder})"
            )),
            other => forbid(format!(
                "ForgetCacheShard may only come from a node, not {other}"
            )),
        },
        Command::ReleaseJobOutput { .. } => {
            client_with(principal, Scope::Submit, "releasing a job's result")
        }
        Command::DeleteJob { .. } => client_with(principal, Scope::Submit, "deleting a job"),
        Command::ExpireJobOutputs { .. }
        | Command::OutputsFreed { .. }
        | Command::PruneJobs { .. }
        | Command::ForgetNodes { .. } => forbid(
            "ExpireJobOutputs, OutputsFreed, PruneJobs and ForgetNodes cannot be proposed; only \
             the leader's housekeeping makes them",
        ),
        Command::EvictCache { .. } => match principal {
            Principal::Node(node) if drives_a_job(state, *node) => Ok(()),
            Principal::Node(node) => forbid(format!(
                "node {node} drives no job, so it may not evict cache entries"
            )),
            other => client_with(other, Scope::Admin, "evicting cache entries"),
        },
    }
}

/// May `principal` send `request` to a node agent? Members everything; clients with `read`
/// only what fetching a result takes.
pub fn authorize_node(principal: &Principal, request: &NodeRequest) -> Decision {
    if principal.is_member() {
        return Ok(());
    }
    match request {
        NodeRequest::ObjectMeta { .. }
        | NodeRequest::ReadChunk { .. }
        | NodeRequest::NextOutputs { .. }
        | NodeRequest::Status => client_with(principal, Scope::Read, "fetching results"),
        NodeRequest::CleanCache { .. } => {
            client_with(principal, Scope::Admin, "cleaning a node's cache")
        }
        NodeRequest::RunTask(_)
        | NodeRequest::ReadRanges { .. }
        | NodeRequest::LendRanges { .. }
        | NodeRequest::Pull { .. }
        | NodeRequest::Free { .. }
        | NodeRequest::CancelTask { .. }
        | NodeRequest::WriteCacheShard(_)
        | NodeRequest::LoadCacheShard(_)
        | NodeRequest::CreateActor(_)
        | NodeRequest::CallActor { .. }
        | NodeRequest::StopActor { .. }
        | NodeRequest::RemoveCacheShards { .. }
        | NodeRequest::FreeJob { .. }
        // Logs are read through the HTTP API, which calls as a member and checks the
        // caller's `read` token itself.
        | NodeRequest::ReadLogs(_)
        | NodeRequest::JobTasks { .. } => forbid(format!(
            "only cluster members may send this request to a node, not {principal}"
        )),
    }
}

/// Who may send each request and command, as docs/SECURITY.md shows it; a test checks that
/// this summary agrees with the functions above.
pub const RIGHTS: &[(&str, &str)] = &[
    ("Raft", "replicas"),
    (
        "RegisterNode (request)",
        "members; nodes, replacing only themselves",
    ),
    ("Heartbeat", "the node itself"),
    ("WatchDrivers", "the node itself"),
    ("Place", "registered nodes"),
    ("AcquireLeases", "the node driving the job, while it runs"),
    (
        "RenewLeases, ReturnLeases",
        "the node driving the job (any node, for a job that is not running: told they are revoked)",
    ),
    (
        "ReportProgress",
        "the node driving the job (any node, for a job that is not running: told to stop)",
    ),
    ("Status", "members, nodes, replicas, read"),
    (
        "ReadState, NodeReports, JobProgress, AllProgress, WatchJob, WatchDeaths, AliveNodes, \
         JobHistory",
        "nodes, replicas, read",
    ),
    ("ActorNode, CacheIndex", "registered nodes"),
    ("Propose(RegisterNode)", "nobody (use the request)"),
    ("Propose(StartDriver)", "nobody (the leader itself)"),
    ("Propose(MarkNodeDead)", "the node itself (leaving)"),
    (
        "Propose(SubmitJob), Propose(CancelJob), Propose(ReleaseJobOutput), Propose(DeleteJob)",
        "submit",
    ),
    (
        "Propose(ExpireJobOutputs), Propose(OutputsFreed), Propose(PruneJobs), Propose(ForgetNodes)",
        "nobody (the leader's housekeeping)",
    ),
    (
        "Propose(FinishJob), Propose(RegisterActor), Propose(RemoveActor)",
        "the node driving the job",
    ),
    (
        "Propose(RecordCacheShard)",
        "the node holding the shard, or a node driving a job",
    ),
    (
        "Propose(ForgetCacheShard)",
        "the node holding the shard, or a node driving a job",
    ),
    ("Propose(EvictCache)", "admin, or a node driving a job"),
    (
        "node: ObjectMeta, ReadChunk, NextOutputs, Status",
        "members, read",
    ),
    ("node: CleanCache", "members, admin"),
    ("node: every other request", "members"),
];

#[cfg(test)]
mod tests;
