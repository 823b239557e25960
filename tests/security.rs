//! The attack suite: a real scheduler and a real node, attacked the way a client token holder
//! or a node could. Every forbidden action is refused with an error naming the missing right,
//! the replicated state does not change, and a job afterwards returns exactly its rows.
//! docs/SECURITY.md lists the rights these tests try to break.

#![allow(clippy::unwrap_used)]

/// The same attacks on the wire of a TLS cluster: plaintext, strangers' CAs, a secret without
/// a member certificate.
#[path = "security/tls.rs"]
mod tls;

use std::collections::BTreeMap;
use std::sync::OnceLock;

use floe_api::client::SchedulerClient;
use floe_api::node_protocol::{NodeProtocol, NodeRequest, NodeResponse};
use floe_api::scheduler_protocol::{ResourceUsage, SchedulerRequest};
use floe_api::state::{
    CachedShard, ClusterState, Command, JobOutcome, JobStatus, NodeAddresses, NodeMemory, Outcome,
    Resources,
};
use floe_client::{Dataset, col, lit};
use floe_core::auth::{ClientToken, ClusterSecret, Credential, ReplicaSecret, Scopes, TokensFile};
use floe_core::job::{JobOptions, JobStats, OutputBlock};
use floe_core::wire::{RemoteErrorKind, RpcClient, WireConfig, WireError};
use floe_core::{JobId, NodeId, ObjectId, SubmissionId};
use floe_testkit::batches::int_column;
use floe_testkit::cluster::{TestCluster, TestClusterConfig, register_node, runtime};
use floe_testkit::http::{get, post_json};

/// A read token and a submit token, added to the test process's tokens file once (the
/// servers pick them up without a restart).
struct Scoped {
    read: ClientToken,
    submit: ClientToken,
}

fn scoped(config: &TestClusterConfig) -> &'static Scoped {
    static SCOPED: OnceLock<Scoped> = OnceLock::new();
    SCOPED.get_or_init(|| {
        let path = &config.credentials.tokens_file;
        let mut file = TokensFile::load(path).unwrap();
        let scoped = Scoped {
            read: file
                .create("reader", Scopes::parse("read").unwrap())
                .unwrap(),
            submit: file
                .create("submitter", Scopes::parse("submit").unwrap())
                .unwrap(),
        };
        file.save(path).unwrap();
        scoped
    })
}

/// One replica and one node; nodes never miss enough heartbeats to die during a test, so
/// nothing but an attack could change the state.
fn cluster(runtime: &tokio::runtime::Runtime) -> TestCluster {
    let config = TestClusterConfig {
        settings: vec!["scheduler.missed_heartbeats=1000".into()],
        ..TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"))
    };
    runtime.block_on(TestCluster::start(config, 1))
}

/// The state as the leader has it, without the log position (which reads advance).
async fn state(cluster: &TestCluster) -> ClusterState {
    let mut state = cluster.state().await;
    state.applied_index = 0;
    state
}

/// A job that must return exactly the multiples of 7 below 20,000.
async fn assert_a_job_is_exact(cluster: &TestCluster) {
    let dataset = Dataset::range(20_000)
        .unwrap()
        .filter((col("id") % lit(7i64)).eq(lit(0i64)))
        .unwrap();
    let record = cluster.run(&dataset, JobOptions::default()).await;
    let ids = int_column(&cluster.outputs(&record).await, "id");
    let expected: Vec<i64> = (0..20_000).filter(|id| id % 7 == 0).collect();
    assert_eq!(ids, expected);
}

/// A handshake presenting `wire`'s credential must be refused with a message containing
/// `needle`.
async fn assert_handshake_refused(cluster: &TestCluster, wire: WireConfig, needle: &str) {
    let refused = SchedulerClient::new(cluster.schedulers.addrs(), wire)
        .unwrap()
        .read_state()
        .await;
    assert!(
        matches!(&refused, Err(floe_api::Error::Wire(WireError::Refused { message, .. }))
            if message.contains(needle)),
        "{refused:?}"
    );
}

/// `result` must be a refusal of kind `kind` whose message contains `needle`.
fn assert_refused<T: std::fmt::Debug>(
    result: Result<T, floe_api::Error>,
    kind: RemoteErrorKind,
    needle: &str,
) {
    match result {
        Err(floe_api::Error::Wire(WireError::Remote(error))) => {
            assert_eq!(error.kind, kind, "{error}");
            assert!(error.message.contains(needle), "{error}");
        }
        other => panic!("expected a {kind} refusal mentioning {needle:?}, got {other:?}"),
    }
}

fn forbidden<T: std::fmt::Debug>(result: Result<T, floe_api::Error>, needle: &str) {
    assert_refused(result, RemoteErrorKind::Forbidden, needle);
}

fn client_with(cluster: &TestCluster, token: &ClientToken) -> SchedulerClient {
    let wire = cluster.admin_wire().with_credential(Credential::Client {
        token: token.clone(),
    });
    SchedulerClient::new(cluster.schedulers.addrs(), wire).unwrap()
}

fn finish(job: JobId, attempt: u32) -> Command {
    Command::FinishJob {
        job,
        attempt,
        outcome: JobOutcome {
            status: JobStatus::Succeeded,
            stats: JobStats::default(),
            // Forged outputs: an object nobody wrote, on the real node.
            outputs: vec![OutputBlock {
                node: NodeId::new(1),
                object: ObjectId::new(42),
                rows: 1_000_000,
                bytes: 8,
            }],
        },
    }
}

#[test]
fn a_client_token_cannot_propose_internal_commands() {
    let runtime = runtime();
    let cluster = cluster(&runtime);
    let scoped = scoped(&cluster.config);
    runtime.block_on(async {
        assert_a_job_is_exact(&cluster).await;
        let before = state(&cluster).await;
        let job = *before.jobs.keys().next().unwrap();
        let node = *before.nodes.keys().next().unwrap();
        let internal = [
            Command::MarkNodeDead {
                node,
                reason: "forged".into(),
            },
            finish(job, 1),
            Command::RecordCacheShard {
                fingerprint: "0".repeat(32),
                shard_count: 1,
                rank: 0,
                shard: CachedShard {
                    node,
                    bytes: 1,
                    rows: 1,
                },
                origin: None,
            },
            Command::RegisterNode {
                addresses: NodeAddresses {
                    rpc: "203.0.113.1:7800".into(),
                },
                resources: Resources::default(),
                memory: NodeMemory::default(),
                labels: BTreeMap::new(),
                replaces: None,
            },
            Command::StartDriver { job, node },
            Command::RegisterActor {
                actor: floe_core::ActorId::new(9),
                kind: "HashShuffleAggregator".into(),
                node,
                job,
            },
        ];
        // Not even an admin token may propose what only nodes and the leader propose.
        let mut admin = cluster.client();
        let mut submitter = client_with(&cluster, &scoped.submit);
        for command in internal {
            let name = format!("{command:?}");
            let refused = admin.propose(command.clone()).await;
            assert!(refused.is_err(), "admin proposed {name}");
            forbidden(refused, "");
            forbidden(submitter.propose(command).await, "");
        }
        // Scopes: a read token may not submit or cancel; a submit token may not evict.
        let mut reader = client_with(&cluster, &scoped.read);
        forbidden(
            reader
                .submit_job(vec![1], SubmissionId::random(), None)
                .await,
            "token 'reader' lacks scope submit",
        );
        forbidden(
            reader.propose(Command::CancelJob { job }).await,
            "token 'reader' lacks scope submit",
        );
        forbidden(
            submitter
                .propose(Command::EvictCache {
                    fingerprint: "0".repeat(32),
                })
                .await,
            "token 'submitter' lacks scope admin",
        );
        // Requests only nodes make.
        forbidden(
            admin.heartbeat(node, ResourceUsage::default()).await,
            "may only come from that node",
        );
        forbidden(admin.place(Vec::new()).await, "registered node");
        forbidden(
            admin
                .call(&SchedulerRequest::Raft {
                    messages: vec![vec![0xff; 64]],
                })
                .await,
            "only accepted from replicas",
        );
        assert_eq!(
            state(&cluster).await,
            before,
            "a refused command changed the state"
        );
        assert_a_job_is_exact(&cluster).await;
    });
}

#[test]
fn a_node_acts_only_for_itself_and_never_as_a_replica() {
    let runtime = runtime();
    let cluster = cluster(&runtime);
    runtime.block_on(async {
        let resources = Resources::default();
        let at = |rpc: &str| NodeAddresses { rpc: rpc.into() };
        let (a, mut node_a) =
            register_node(&cluster.schedulers, at("127.0.0.1:9"), resources).await;
        let (b, mut node_b) =
            register_node(&cluster.schedulers, at("127.0.0.1:10"), resources).await;
        assert_a_job_is_exact(&cluster).await;
        let before = state(&cluster).await;
        let job = *before.jobs.keys().next().unwrap();

        forbidden(
            node_a.heartbeat(b, ResourceUsage::default()).await,
            &format!(
                "a node may only report about itself (node {a} sent a heartbeat for node {b})"
            ),
        );
        forbidden(
            node_a
                .propose(Command::MarkNodeDead {
                    node: b,
                    reason: "forged".into(),
                })
                .await,
            &format!("node {a} proposed the death of node {b}"),
        );
        // The job has ended, so node A's FinishJob is a stale driver's: it passes authorization
        // and `apply` rejects it, changing nothing (checked below). A job another node drives
        // is refused outright: `api/src/authz/tests.rs`.
        let stale = node_a.propose(finish(job, 1)).await.unwrap();
        assert!(matches!(stale, Outcome::Rejected(_)), "{stale:?}");
        forbidden(
            node_a
                .propose(Command::RecordCacheShard {
                    fingerprint: "0".repeat(32),
                    shard_count: 1,
                    rank: 0,
                    shard: CachedShard {
                        node: b,
                        bytes: 1,
                        rows: 1,
                    },
                    origin: None,
                })
                .await,
            "may only record shards it holds",
        );
        forbidden(
            node_a
                .watch_drivers(b, Vec::new(), std::time::Duration::ZERO)
                .await,
            "a driver watch",
        );
        forbidden(
            node_a
                .call(&SchedulerRequest::Raft {
                    messages: vec![vec![0xff; 64]],
                })
                .await,
            &format!("raft messages are only accepted from replicas, not node {a}"),
        );

        // A member that has not registered may only register.
        let member = cluster.config.wire();
        let mut bare = SchedulerClient::new(cluster.schedulers.addrs(), member.clone()).unwrap();
        forbidden(bare.read_state().await, "may only register");
        forbidden(
            bare.heartbeat(a, ResourceUsage::default()).await,
            "may only come from that node",
        );

        // Credentials a node cannot have: the replica secret, another node's ticket.
        let secret = cluster.config.credentials.cluster_secret.clone();
        let claims_replica = member.with_credential(Credential::Replica {
            id: 1,
            secret: ReplicaSecret::new(secret.expose()),
        });
        assert_handshake_refused(&cluster, claims_replica, "wrong replica secret").await;
        let wrong_secret = member.with_credential(Credential::Member {
            secret: ClusterSecret::new("guessed"),
        });
        assert_handshake_refused(&cluster, wrong_secret, "wrong cluster secret").await;
        // A third node registers; its valid ticket is then passed off as B's.
        let (c, mut node_c) =
            register_node(&cluster.schedulers, at("127.0.0.1:11"), resources).await;
        let ticket_of_c = {
            let mut relisted =
                SchedulerClient::new(cluster.schedulers.addrs(), member.clone()).unwrap();
            // Registering again under the member credential returns a fresh id and ticket;
            // that node leaves at once, through its own ticket.
            let (extra, ticket) = relisted
                .register_node(
                    at("127.0.0.1:12"),
                    resources,
                    NodeMemory::default(),
                    BTreeMap::new(),
                    None,
                )
                .await
                .unwrap();
            let as_extra = member.with_credential(Credential::Node {
                secret: secret.clone(),
                id: extra,
                ticket: ticket.clone(),
            });
            let left = SchedulerClient::new(cluster.schedulers.addrs(), as_extra)
                .unwrap()
                .propose(Command::MarkNodeDead {
                    node: extra,
                    reason: "test node leaves".into(),
                })
                .await
                .unwrap();
            assert_eq!(left, floe_api::state::Outcome::Applied);
            ticket
        };
        let after_registering = state(&cluster).await;
        let forged_ticket = member.with_credential(Credential::Node {
            secret,
            id: b,
            ticket: ticket_of_c,
        });
        let refused = SchedulerClient::new(cluster.schedulers.addrs(), forged_ticket)
            .unwrap()
            .heartbeat(b, ResourceUsage::default())
            .await;
        assert!(
            matches!(&refused, Err(floe_api::Error::Wire(WireError::Refused { message, .. }))
                if message.contains("invalid ticket")),
            "{refused:?}"
        );
        assert_eq!(
            state(&cluster).await,
            after_registering,
            "a refused request changed the state"
        );
        assert_eq!(
            after_registering.nodes.len(),
            before.nodes.len() + 2,
            "only the registrations changed anything"
        );

        // What a node may do about itself still works: it leaves.
        for (node, client) in [(a, &mut node_a), (b, &mut node_b), (c, &mut node_c)] {
            let left = client
                .propose(Command::MarkNodeDead {
                    node,
                    reason: "test node leaves".into(),
                })
                .await
                .unwrap();
            assert_eq!(left, floe_api::state::Outcome::Applied);
        }
        assert_a_job_is_exact(&cluster).await;
    });
}

#[test]
fn a_client_token_may_only_fetch_results_from_a_node() {
    let runtime = runtime();
    let cluster = cluster(&runtime);
    let scoped = scoped(&cluster.config);
    runtime.block_on(async {
        let node = cluster.node(0).addr().to_owned();
        let reader = cluster.admin_wire().with_credential(Credential::Client {
            token: scoped.read.clone(),
        });
        let mut client = RpcClient::<NodeProtocol>::connect(node.clone(), reader)
            .await
            .unwrap();
        assert!(matches!(
            client.call(&NodeRequest::Status).await.unwrap(),
            NodeResponse::Status(_)
        ));
        for request in [
            NodeRequest::Free {
                objects: vec![ObjectId::new(1)],
            },
            NodeRequest::CancelTask {
                task: floe_core::TaskId::new(1),
            },
        ] {
            match client.call(&request).await {
                Err(WireError::Remote(error)) => {
                    assert_eq!(error.kind, RemoteErrorKind::Forbidden, "{error}");
                    assert!(error.message.contains("only cluster members"), "{error}");
                }
                other => panic!("{request:?} was not refused: {other:?}"),
            }
        }
        let unknown = cluster.admin_wire().with_credential(Credential::Client {
            token: ClientToken::new("floe_not-a-token"),
        });
        let refused = RpcClient::<NodeProtocol>::connect(node, unknown).await;
        assert!(
            matches!(&refused, Err(WireError::Refused { message, .. }) if message.contains("unknown client token")),
            "{:?}",
            refused.err()
        );
        // The read token fetches a job's result through the client library.
        let dataset = Dataset::range(1_000).unwrap();
        let record = cluster.run(&dataset, JobOptions::default()).await;
        let output = cluster.outputs_with(scoped.read.expose(), &record).await;
        assert_eq!(int_column(&output, "id"), (0..1_000).collect::<Vec<i64>>());
    });
}

#[test]
fn rest_calls_need_a_token_with_their_scope() {
    let runtime = runtime();
    let cluster = cluster(&runtime);
    let scoped = scoped(&cluster.config);
    let http = cluster.schedulers.http_addr(1).unwrap().to_owned();
    let (read, submit) = (scoped.read.expose(), scoped.submit.expose());
    let before = runtime.block_on(state(&cluster));
    for token in ["", "floe_wrong"] {
        for path in [
            "/api/jobs",
            "/api/nodes",
            "/api/cluster",
            "/api/cache",
            "/metrics",
        ] {
            assert_eq!(
                get(&http, path, token).status,
                401,
                "GET {path} with {token:?}"
            );
        }
    }
    assert_eq!(get(&http, "/api/jobs", read).status, 200);
    let spec = serde_json::json!({"job": "[source]\nrange = 1000\n"});
    for token in ["", "floe_wrong"] {
        assert_eq!(post_json(&http, "/api/jobs", token, &spec).status, 401);
    }
    let refused = post_json(&http, "/api/jobs", read, &spec);
    assert_eq!(refused.status, 403, "{}", refused.body);
    assert!(
        refused.body.contains("token 'reader' lacks scope submit"),
        "{}",
        refused.body
    );
    assert_eq!(
        post_json(&http, "/api/jobs/1/stop", read, &serde_json::json!({})).status,
        403
    );
    assert_eq!(
        post_json(&http, "/api/cache/clean", submit, &serde_json::json!({})).status,
        403
    );
    assert_eq!(
        runtime.block_on(state(&cluster)),
        before,
        "a refused call changed the state"
    );

    let created = post_json(&http, "/api/jobs", submit, &spec);
    assert_eq!(created.status, 201, "{}", created.body);
    let job: JobId = created.json()["job_id"].as_str().unwrap().parse().unwrap();
    runtime.block_on(async {
        let record = cluster.wait_for_job(job).await;
        assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
        let ids = int_column(&cluster.outputs(&record).await, "id");
        assert_eq!(ids, (0..1_000).collect::<Vec<i64>>());
    });
}
