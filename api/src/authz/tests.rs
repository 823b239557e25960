//! Every (principal, request) pair: the allowed ones pass, every other one is refused.

use std::collections::BTreeMap;
use std::sync::Arc;

use floe_core::auth::{Principal, Scopes};
use floe_core::job::JobStats;
use floe_core::{ActorId, JobId, NodeId, ObjectId, SubmissionId, TaskId};

use super::*;
use crate::node_protocol::ByteRange;
use crate::scheduler_protocol::ResourceUsage;
use crate::state::{
    ActorRecord, CachedShard, JobOutcome, JobRecord, JobStatus, Liveness, NodeAddresses,
    NodeMemory, NodeRecord, Resources,
};

const READ: &str = "read";
const SUBMIT: &str = "submit";
const ADMIN: &str = "admin";
const MEMBER: &str = "member";
/// Node 1 drives job 1; node 2 drives nothing.
const DRIVER: &str = "node1";
const OTHER_NODE: &str = "node2";
const REPLICA: &str = "replica";

fn principals() -> Vec<(&'static str, Principal)> {
    let client = |name: &str, scopes: &str| Principal::Client {
        name: name.to_owned(),
        scopes: Scopes::parse(scopes).unwrap(),
    };
    vec![
        (READ, client("r", "read")),
        (SUBMIT, client("s", "submit")),
        (ADMIN, client("a", "admin")),
        (MEMBER, Principal::Member),
        (DRIVER, Principal::Node(NodeId::new(1))),
        (OTHER_NODE, Principal::Node(NodeId::new(2))),
        (REPLICA, Principal::Replica(1)),
    ]
}

fn node(id: u64) -> NodeRecord {
    NodeRecord {
        id: NodeId::new(id),
        addresses: NodeAddresses::default(),
        resources: Resources::default(),
        memory: NodeMemory::default(),
        labels: BTreeMap::new(),
        liveness: Liveness::Alive,
    }
}

const ACTOR: ActorId = ActorId::new(7);

fn state() -> ClusterState {
    let mut state = ClusterState::default();
    state.nodes.insert(NodeId::new(1), node(1));
    state.nodes.insert(NodeId::new(2), node(2));
    state.jobs.insert(
        JobId::new(1),
        Arc::new(JobRecord {
            id: JobId::new(1),
            submission: SubmissionId::new(1),
            name: None,
            spec: Vec::new(),
            status: JobStatus::Running,
            driver: Some(NodeId::new(1)),
            attempts: 1,
            cancel_requested: false,
            stats: None,
            outputs: Vec::new(),
            submitted_at_ms: 0,
            started_at_ms: Some(0),
            ended_at_ms: None,
            release: None,
        }),
    );
    state.reindex();
    state.actors.insert(
        ACTOR,
        ActorRecord {
            id: ACTOR,
            kind: "HashShuffleAggregator".into(),
            node: NodeId::new(2),
            job: JobId::new(1),
        },
    );
    state
}

fn check(name: &str, allowed: &[&str], decide: impl Fn(&Principal) -> Result<(), Forbidden>) {
    for (label, principal) in principals() {
        let decision = decide(&principal);
        if allowed.contains(&label) {
            assert_eq!(decision, Ok(()), "{name} must be allowed for {label}");
        } else {
            let Err(Forbidden(message)) = decision else {
                panic!("{name} must be refused for {label}");
            };
            assert!(!message.is_empty());
        }
    }
}

fn shard(node: u64) -> CachedShard {
    CachedShard {
        node: NodeId::new(node),
        bytes: 1,
        rows: 1,
    }
}

#[test]
fn every_command_lists_who_may_propose_it() {
    let state = state();
    let job = JobId::new(1);
    let commands: Vec<(Command, &[&str])> = vec![
        (
            Command::RegisterNode {
                addresses: NodeAddresses::default(),
                resources: Resources::default(),
                memory: NodeMemory::default(),
                labels: BTreeMap::new(),
                replaces: None,
            },
            &[],
        ),
        (
            Command::StartDriver {
                job,
                node: NodeId::new(2),
            },
            &[],
        ),
        (
            Command::MarkNodeDead {
                node: NodeId::new(1),
                reason: "x".into(),
            },
            &[DRIVER],
        ),
        (
            Command::MarkNodeDead {
                node: NodeId::new(2),
                reason: "x".into(),
            },
            &[OTHER_NODE],
        ),
        (
            Command::SubmitJob {
                spec: Vec::new(),
                submission: SubmissionId::new(9),
                name: None,
            },
            &[SUBMIT, ADMIN],
        ),
        (Command::CancelJob { job }, &[SUBMIT, ADMIN]),
        (
            Command::FinishJob {
                job,
                attempt: 1,
                outcome: JobOutcome {
                    status: JobStatus::Succeeded,
                    stats: JobStats::default(),
                    outputs: Vec::new(),
                },
            },
            &[DRIVER],
        ),
        (
            Command::FinishJob {
                job: JobId::new(99),
                attempt: 1,
                outcome: JobOutcome {
                    status: JobStatus::Succeeded,
                    stats: JobStats::default(),
                    outputs: Vec::new(),
                },
            },
            &[],
        ),
        (
            Command::RegisterActor {
                actor: ActorId::new(8),
                kind: "k".into(),
                node: NodeId::new(2),
                job,
            },
            &[DRIVER],
        ),
        (Command::RemoveActor { actor: ACTOR }, &[DRIVER]),
        (
            Command::RemoveActor {
                actor: ActorId::new(99),
            },
            &[DRIVER, OTHER_NODE],
        ),
        (
            Command::RecordCacheShard {
                fingerprint: "f".into(),
                shard_count: 1,
                rank: 0,
                shard: shard(2),
                origin: None,
            },
            &[DRIVER, OTHER_NODE],
        ),
        (
            Command::RecordCacheShard {
                fingerprint: "f".into(),
                shard_count: 1,
                rank: 0,
                shard: shard(1),
                origin: None,
            },
            &[DRIVER],
        ),
        (
            Command::EvictCache {
                fingerprint: "f".into(),
            },
            &[ADMIN, DRIVER],
        ),
    ];
    for (command, allowed) in commands {
        let name = format!("{command:?}");
        check(&name, allowed, |principal| {
            authorize_scheduler(
                principal,
                &SchedulerRequest::Propose(command.clone()),
                &state,
            )
        });
    }
}

#[test]
fn every_request_lists_who_may_send_it() {
    let state = state();
    let readers: &[&str] = &[READ, SUBMIT, ADMIN, DRIVER, OTHER_NODE, REPLICA];
    let requests: Vec<(SchedulerRequest, &[&str])> = vec![
        (SchedulerRequest::Raft { messages: vec![] }, &[REPLICA]),
        (
            SchedulerRequest::RegisterNode {
                addresses: NodeAddresses::default(),
                resources: Resources::default(),
                memory: NodeMemory::default(),
                labels: BTreeMap::new(),
                replaces: None,
            },
            &[MEMBER, DRIVER, OTHER_NODE],
        ),
        // A node registers as the replacement of itself only; a member, restarted with no
        // ticket, as that of any node (`apply` holds it to the node's own address).
        (
            SchedulerRequest::RegisterNode {
                addresses: NodeAddresses::default(),
                resources: Resources::default(),
                memory: NodeMemory::default(),
                labels: BTreeMap::new(),
                replaces: Some(NodeId::new(2)),
            },
            &[MEMBER, OTHER_NODE],
        ),
        (
            SchedulerRequest::Heartbeat {
                node: NodeId::new(2),
                usage: ResourceUsage::default(),
            },
            &[OTHER_NODE],
        ),
        (
            SchedulerRequest::WatchDrivers {
                node: NodeId::new(1),
                known: vec![],
                wait_ms: 0,
            },
            &[DRIVER],
        ),
        (
            SchedulerRequest::Place { requests: vec![] },
            &[DRIVER, OTHER_NODE],
        ),
        (
            SchedulerRequest::AcquireLeases {
                job: JobId::new(1),
                requests: vec![],
                wait_ms: 0,
            },
            &[DRIVER],
        ),
        // No new leases for a job that is not running, not even for its last driver.
        (
            SchedulerRequest::AcquireLeases {
                job: JobId::new(99),
                requests: vec![],
                wait_ms: 0,
            },
            &[],
        ),
        (
            SchedulerRequest::RenewLeases {
                job: JobId::new(1),
                leases: vec![],
            },
            &[DRIVER],
        ),
        (
            SchedulerRequest::ReturnLeases {
                job: JobId::new(1),
                leases: vec![],
            },
            &[DRIVER],
        ),
        // A job that is not running: its late driver is told its leases are revoked.
        (
            SchedulerRequest::RenewLeases {
                job: JobId::new(99),
                leases: vec![],
            },
            &[DRIVER, OTHER_NODE],
        ),
        (
            SchedulerRequest::ReturnLeases {
                job: JobId::new(99),
                leases: vec![],
            },
            &[DRIVER, OTHER_NODE],
        ),
        (
            SchedulerRequest::ReportProgress {
                job: JobId::new(1),
                progress: floe_core::job::JobProgress::default(),
            },
            &[DRIVER],
        ),
        // A job that is not running: its stale driver is told to stop, nothing is recorded.
        (
            SchedulerRequest::ReportProgress {
                job: JobId::new(99),
                progress: floe_core::job::JobProgress::default(),
            },
            &[DRIVER, OTHER_NODE],
        ),
        (
            SchedulerRequest::Status,
            &[READ, SUBMIT, ADMIN, MEMBER, DRIVER, OTHER_NODE, REPLICA],
        ),
        (SchedulerRequest::ReadState, readers),
        (SchedulerRequest::NodeReports, readers),
        (
            SchedulerRequest::JobProgress { job: JobId::new(1) },
            readers,
        ),
        (SchedulerRequest::AllProgress, readers),
        (
            SchedulerRequest::WatchJob {
                job: JobId::new(1),
                wait_ms: 0,
            },
            readers,
        ),
        (
            SchedulerRequest::WatchDeaths {
                after: 0,
                wait_ms: 0,
            },
            readers,
        ),
    ];
    for (request, allowed) in requests {
        let name = format!("{request:?}");
        check(&name, allowed, |principal| {
            authorize_scheduler(principal, &request, &state)
        });
    }
}

#[test]
fn clients_may_only_fetch_results_from_nodes() {
    let members: &[&str] = &[MEMBER, DRIVER, OTHER_NODE, REPLICA];
    let fetchers: &[&str] = &[READ, SUBMIT, ADMIN, MEMBER, DRIVER, OTHER_NODE, REPLICA];
    let object = ObjectId::new(1);
    let requests: Vec<(NodeRequest, &[&str])> = vec![
        (NodeRequest::ObjectMeta { object }, fetchers),
        (
            NodeRequest::ReadChunk {
                object,
                offset: 0,
                len: 1,
            },
            fetchers,
        ),
        (NodeRequest::Status, fetchers),
        (
            NodeRequest::Free {
                objects: vec![object],
            },
            members,
        ),
        (
            NodeRequest::CancelTask {
                task: TaskId::new(1),
            },
            members,
        ),
        (NodeRequest::StopActor { actor: ACTOR }, members),
        // A loan pins objects and names the holder's segment: for nodes, never clients.
        (
            NodeRequest::LendRanges {
                ranges: vec![ByteRange {
                    object,
                    offset: 0,
                    len: 1,
                }],
            },
            members,
        ),
    ];
    for (request, allowed) in requests {
        let name = format!("{request:?}");
        check(&name, allowed, |principal| {
            authorize_node(principal, &request)
        });
    }
}

#[test]
fn refusals_name_the_missing_right() {
    let state = state();
    let reader = Principal::Client {
        name: "ci".into(),
        scopes: Scopes::parse("read").unwrap(),
    };
    let submit = SchedulerRequest::Propose(Command::SubmitJob {
        spec: Vec::new(),
        submission: SubmissionId::new(1),
        name: None,
    });
    assert_eq!(
        authorize_scheduler(&reader, &submit, &state).unwrap_err().0,
        "token 'ci' lacks scope submit, which submitting a job needs"
    );
    let heartbeat = SchedulerRequest::Heartbeat {
        node: NodeId::new(4),
        usage: ResourceUsage::default(),
    };
    assert_eq!(
        authorize_scheduler(&Principal::Node(NodeId::new(3)), &heartbeat, &state)
            .unwrap_err()
            .0,
        "a node may only report about itself (node 3 sent a heartbeat for node 4)"
    );
}

#[test]
fn the_security_guide_lists_every_right() {
    let guide = include_str!("../../../docs/SECURITY.md");
    for (what, who) in RIGHTS {
        let row = format!("| {what} | {who} |");
        assert!(guide.contains(&row), "docs/SECURITY.md lacks the row {row}");
    }
}
