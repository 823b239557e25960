//! Node agents as real `floe node` processes (with their `floe worker`s) against a real
//! `floe scheduler` on loopback: tasks on two nodes, object transfer with checksums, worker
//! crashes, the memory monitor, node death and graceful shutdown.

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use floe_api::node_protocol::{
    ActorFailure, ActorKind, ActorMessage, ActorReply, ActorSpec, ByteRange, InputRef,
    NodeProtocol, NodeRequest, NodeResponse, NodeStatus, OutputRef, Part, PushedShard, TaskFailure,
    TaskKind, TaskSpec, TestTask, output_id,
};
use floe_api::placement::{PlacementRequest, Strategy};
use floe_api::state::{ClusterState, Liveness, NodeAddresses, Resources};
use floe_client::local::LocalNode;
use floe_core::config::ByteSize;
use floe_core::hash::xxh3_64;
use floe_core::wire::{RpcClient, WireConfig};
use floe_core::{ActorId, JobId, NodeId, ObjectId, TaskId};
use floe_testkit::cluster::{
    HEARTBEAT_MS, MISSED_HEARTBEATS, READY_TIMEOUT, TestCluster, TestClusterConfig, fast_timing,
    register_node,
};
use floe_testkit::{node, process};

/// One scheduler replica; nodes of two workers with 4 GiB of memory (a 1.2 GiB store) and
/// 128 MiB frames. The memory monitor counts a 512 MiB object twice while a worker fills it (its
/// heap and the store), so 1 GiB would see that task killed.
fn config() -> TestClusterConfig {
    TestClusterConfig {
        settings: fast_timing(),
        node_settings: vec!["memory.total=4GiB".into()],
        max_frame: Some(ByteSize::mib(128)),
        ..TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"))
    }
}

async fn cluster() -> TestCluster {
    TestCluster::start(config(), 0).await
}

fn wire() -> WireConfig {
    config().wire()
}

/// Live `floe worker` processes of `node`, found by the socket path on their command line.
fn workers_of(node: &LocalNode) -> Vec<u32> {
    process::processes_mentioning(&node.worker_socket().display().to_string())
}

/// Waits until `node` has no worker processes left.
fn assert_workers_gone(node: &LocalNode) {
    process::wait_until_none_mention(
        &node.worker_socket().display().to_string(),
        "workers outlived their node",
        Duration::from_secs(5),
    );
}

async fn client(addr: &str) -> RpcClient<NodeProtocol> {
    node::connect(addr, &wire()).await
}

async fn call(addr: &str, request: NodeRequest) -> NodeResponse {
    node::call(addr, &wire(), &request).await
}

/// The first `len` bytes of an object, read as an attached chunk.
async fn read_start(addr: &str, object: ObjectId, len: usize) -> Vec<u8> {
    let mut bytes = vec![0; len];
    let request = NodeRequest::ReadChunk {
        object,
        offset: 0,
        len: len as u64,
    };
    match client(addr)
        .await
        .call_into(&request, &mut bytes)
        .await
        .unwrap()
    {
        NodeResponse::Chunk => {}
        other => panic!("unexpected {other:?}"),
    }
    bytes
}

async fn status(addr: &str) -> NodeStatus {
    node::status(addr, &wire()).await
}

async fn run(
    addr: &str,
    task: u128,
    kind: TaskKind,
    inputs: Vec<InputRef>,
) -> Result<Vec<OutputRef>, TaskFailure> {
    let spec = TaskSpec {
        task: TaskId::new(task),
        job: floe_core::JobId::new(1),
        kind,
        inputs,
    };
    match call(addr, NodeRequest::RunTask(spec)).await {
        NodeResponse::Task { result, worker } => {
            // A task that produced outputs ran in a worker process, which the reply names.
            if result.is_ok() {
                let worker = worker.expect("a successful task names its worker");
                assert!(worker.pid > 0, "{worker:?}");
            }
            result.map(|done| done.outputs)
        }
        other => panic!("unexpected {other:?}"),
    }
}

/// Runs a `Fill` task of `bytes` bytes on the node at `addr` and returns its one output.
async fn fill(addr: &str, task: u128, bytes: usize, seed: u64) -> OutputRef {
    let kind = TaskKind::Test(TestTask::Fill {
        bytes: bytes as u64,
        seed,
    });
    run(addr, task, kind, vec![]).await.unwrap().remove(0)
}

/// The bytes of a `Fill` task, computed here from its documented pattern.
fn fill_pattern(bytes: usize, seed: u64) -> Vec<u8> {
    (0..bytes)
        .map(|i| ((i as u64 + seed) % 251) as u8)
        .collect()
}

fn node_with_addr(state: &ClusterState, addr: &str) -> NodeId {
    state
        .nodes
        .values()
        .find(|node| node.addresses.rpc == addr && node.is_alive())
        .unwrap_or_else(|| panic!("no live node at {addr} in {:?}", state.nodes))
        .id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_run_tasks_and_move_objects_with_verified_checksums() {
    let cluster = cluster().await;
    let a = cluster.start_node("a", &[]);
    let b = cluster.start_node("b", &[]);
    let status_a = cluster.wait_ready(&a).await;
    let status_b = cluster.wait_ready(&b).await;
    let (node_a, node_b) = (status_a.node.unwrap(), status_b.node.unwrap());

    // Both registered with the cluster secret, under the ids they report.
    let state = cluster.state().await;
    assert_eq!(node_with_addr(&state, a.addr()), node_a);
    assert_eq!(node_with_addr(&state, b.addr()), node_b);
    assert_eq!(state.nodes[&node_a].resources.cpu_millis % 1000, 0);

    // SPREAD puts tasks on both nodes; each runs its task in a worker process.
    let request = PlacementRequest {
        cpu_millis: 1000,
        memory_hint: 0,
        strategy: Strategy::Spread,
        preferred: Vec::new(),
        requester: None,
    };
    // Placements come from nodes (a job's driver asks); this one has nothing to offer.
    let (_, mut placer) = register_node(
        &cluster.schedulers,
        NodeAddresses::default(),
        Resources::default(),
    )
    .await;
    let placements = placer.place(vec![request.clone(), request]).await.unwrap();
    let placed: Vec<NodeId> = placements.into_iter().map(Result::unwrap).collect();
    let mut expected = vec![node_a, node_b];
    let mut sorted = placed.clone();
    sorted.sort();
    expected.sort();
    assert_eq!(sorted, expected);
    let addr_of = |node: NodeId| {
        if node == node_a { a.addr() } else { b.addr() }
    };
    let mut filled = Vec::new();
    for (index, node) in placed.iter().enumerate() {
        let seed = index as u64 + 7;
        let outputs = run(
            addr_of(*node),
            100 + index as u128,
            TaskKind::Test(TestTask::Fill { bytes: 1000, seed }),
            vec![],
        )
        .await
        .unwrap();
        assert_eq!(outputs.len(), 1);
        assert_eq!(
            outputs[0].checksum,
            Some(xxh3_64(&fill_pattern(1000, seed)))
        );
        filled.push((*node, outputs[0].clone()));
    }
    let status_after_a = status(a.addr()).await;
    let status_after_b = status(b.addr()).await;
    assert_eq!(status_after_a.tasks_finished, 1);
    assert_eq!(status_after_b.tasks_finished, 1);

    // A task on A whose inputs are an object on A and one on B (pulled inline, ≤ 100 KiB):
    // the worker maps both and hashes them.
    let inputs: Vec<InputRef> = filled
        .iter()
        .map(|(node, output)| InputRef {
            object: output.object,
            holder: (*node != node_a).then(|| b.addr().to_owned()),
            part: None,
        })
        .collect();
    let outputs = run(a.addr(), 200, TaskKind::Test(TestTask::Hash), inputs)
        .await
        .unwrap();
    let hashed = read_start(a.addr(), outputs[0].object, 16).await;
    let mut expected_hash = Vec::new();
    for (index, _) in filled.iter().enumerate() {
        expected_hash.extend(xxh3_64(&fill_pattern(1000, index as u64 + 7)).to_le_bytes());
    }
    assert_eq!(hashed, expected_hash);
    assert_eq!(status(a.addr()).await.pulls_started, 1);

    // A 64 MiB object (13 chunks of 5 MiB) moves from A to B; two concurrent pulls of it
    // coalesce into one transfer, and both see the checksum of the bytes computed here.
    let size = 64 << 20;
    let big = fill(a.addr(), 300, size, 11).await;
    let expected_checksum = xxh3_64(&fill_pattern(size, 11));
    assert_eq!(big.checksum, Some(expected_checksum));
    let pull = |object: ObjectId| {
        let b_addr = b.addr().to_owned();
        let holder = a.addr().to_owned();
        tokio::spawn(async move { call(&b_addr, NodeRequest::Pull { object, holder }).await })
    };
    let (first, second) = (pull(big.object), pull(big.object));
    for pulled in [first.await.unwrap(), second.await.unwrap()] {
        assert_eq!(pulled, NodeResponse::Pulled(big.clone()));
    }
    let status_b = status(b.addr()).await;
    assert_eq!(status_b.pulls_started, 1, "concurrent pulls must coalesce");
    // The copy on B holds the same bytes: hash it there in a worker.
    let rehashed = run(
        b.addr(),
        301,
        TaskKind::Test(TestTask::Hash),
        vec![InputRef {
            object: big.object,
            holder: None,
            part: None,
        }],
    )
    .await
    .unwrap()
    .remove(0);
    let bytes = read_start(b.addr(), rehashed.object, 8).await;
    assert_eq!(bytes, expected_checksum.to_le_bytes());

    // Pulling an object no node has fails with a reason naming it.
    let missing = ObjectId::new(42);
    let mut client_b = client(b.addr()).await;
    let error = client_b
        .call(&NodeRequest::Pull {
            object: missing,
            holder: a.addr().to_owned(),
        })
        .await
        .unwrap_err();
    assert!(error.to_string().contains(&missing.to_string()), "{error}");
}

/// The demo's sort lost its boundaries block now and then (`REBUILT 1`): every partition
/// task reads that one block, and of two tasks on one node pulling it together, the first
/// to finish deleted the copy before the second had pinned it. Many tasks on B read one
/// object of A at once, round after round: every one must find it, and the last use must
/// remove B's copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_sharing_a_pulled_input_never_lose_it_to_each_other() {
    let (_cluster, a, b) = two_nodes().await;
    for round in 0..40u64 {
        let input = fill(a.addr(), 10_000 + u128::from(round), 1000, round).await;
        let expected = xxh3_64(&fill_pattern(1000, round)).to_le_bytes();
        let tasks: Vec<_> = (0..12u128)
            .map(|index| {
                let addr = b.addr().to_owned();
                let holder = a.addr().to_owned();
                tokio::spawn(async move {
                    let inputs = vec![InputRef {
                        object: input.object,
                        holder: Some(holder),
                        part: None,
                    }];
                    let task = 1_000_000 + u128::from(round) * 100 + index;
                    run(&addr, task, TaskKind::Test(TestTask::Hash), inputs).await
                })
            })
            .collect();
        for task in tasks {
            let outputs = task
                .await
                .unwrap()
                .unwrap_or_else(|failure| panic!("round {round}: {failure:?}"));
            assert_eq!(read_start(b.addr(), outputs[0].object, 8).await, expected);
        }
        let mut client_b = client(b.addr()).await;
        let copy = client_b
            .call(&NodeRequest::ObjectMeta {
                object: input.object,
            })
            .await;
        assert!(copy.is_err(), "round {round}: B kept its copy: {copy:?}");
    }
}

/// A scheduler and two ready nodes, `a` and `b`.
async fn two_nodes() -> (TestCluster, LocalNode, LocalNode) {
    let cluster = cluster().await;
    let a = cluster.start_node("a", &[]);
    let b = cluster.start_node("b", &[]);
    cluster.wait_ready(&a).await;
    cluster.wait_ready(&b).await;
    (cluster, a, b)
}

async fn call_actor(
    addr: &str,
    actor: ActorId,
    message: ActorMessage,
    forwarded: bool,
) -> Result<ActorReply, ActorFailure> {
    let request = NodeRequest::CallActor {
        actor,
        message,
        forwarded,
    };
    match call(addr, request).await {
        NodeResponse::Actor(reply) => reply,
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aggregator_pulls_pushed_shards_into_its_store_and_drops_them_when_stopped() {
    let (_cluster, a, b) = two_nodes().await;
    // Shards are parts of map tasks' objects: two parts of one object on B (larger than a
    // chunk together, so they move in several requests) and one of an object on A.
    let remote = fill(b.addr(), 1, 12 << 20, 3).await;
    let local = fill(a.addr(), 2, 1_000, 4).await;
    let remote_bytes = fill_pattern(12 << 20, 3);
    let part_of = |bytes: &[u8], offset: usize, len: usize| Part {
        offset: offset as u64,
        len: len as u64,
        rows: 0,
        checksum: xxh3_64(&bytes[offset..offset + len]),
    };
    let (first, second) = (
        part_of(&remote_bytes, 0, 6 << 20),
        part_of(&remote_bytes, 7 << 20, 5 << 20),
    );
    let own = part_of(&fill_pattern(1_000, 4), 0, 1_000);
    let objects_on_a = || async { status(a.addr()).await.store.objects_in_memory };
    assert_eq!(objects_on_a().await, 1);

    let actor = ActorId::new(77);
    let spec = ActorSpec {
        actor,
        job: JobId::new(1),
        kind: ActorKind::HashShuffleAggregator { slot: 0, slots: 2 },
    };
    assert_eq!(
        call(a.addr(), NodeRequest::CreateActor(spec)).await,
        NodeResponse::ActorCreated
    );
    assert_eq!(status(a.addr()).await.actors, [actor]);

    // Partitions 0, 2 and 4 are slot 0's: B's two parts are pulled into one object of A's.
    let shard = |partition, object, part, holder: Option<&str>| PushedShard {
        partition,
        object,
        part,
        holder: holder.map(str::to_owned),
    };
    let shards = vec![
        shard(0, remote.object, first, Some(b.addr())),
        shard(2, remote.object, second, Some(b.addr())),
        shard(4, local.object, own, None),
    ];
    let reply = call_actor(a.addr(), actor, ActorMessage::Push(shards), false).await;
    let held = first.len + second.len + own.len;
    assert_eq!(reply, Ok(ActorReply::Pushed { held_bytes: held }));
    assert_eq!(objects_on_a().await, 2, "one object for both of B's parts");
    let described = call_actor(a.addr(), actor, ActorMessage::Describe, false).await;
    assert!(
        matches!(&described, Ok(ActorReply::Described(description))
            if description.kind == "HashShuffleAggregator"
                && description.summary.contains(&format!("holds 3 shards, {held} bytes"))),
        "{described:?}"
    );

    // A part whose bytes do not match its checksum is refused, and leaves nothing behind.
    let corrupt = Part {
        checksum: first.checksum ^ 1,
        ..first
    };
    let reply = call_actor(
        a.addr(),
        actor,
        ActorMessage::Push(vec![shard(6, remote.object, corrupt, Some(b.addr()))]),
        false,
    )
    .await;
    assert!(
        matches!(&reply, Err(ActorFailure::Pull { reason, .. }) if reason.contains("checksum")),
        "{reply:?}"
    );
    assert_eq!(objects_on_a().await, 2);

    // Partition 1 is slot 1's.
    let refused = shard(1, local.object, own, None);
    let reply = call_actor(a.addr(), actor, ActorMessage::Push(vec![refused]), false).await;
    assert!(
        matches!(reply, Err(ActorFailure::Refused { .. })),
        "{reply:?}"
    );

    // B does not host it: a forwarded call ends there, a direct one finds no record to
    // route by (the scheduler only records actors of running jobs, placed by their driver).
    let reply = call_actor(b.addr(), actor, ActorMessage::Push(Vec::new()), true).await;
    assert!(
        matches!(&reply, Err(ActorFailure::Gone { reason, .. }) if reason.contains("does not host")),
        "{reply:?}"
    );
    let reply = call_actor(b.addr(), actor, ActorMessage::Push(Vec::new()), false).await;
    assert!(
        matches!(&reply, Err(ActorFailure::Gone { reason, .. }) if reason.contains("no record")),
        "{reply:?}"
    );

    // Stopped, it drops the object it pulled into, but not A's own object nor B's.
    assert_eq!(
        call(a.addr(), NodeRequest::StopActor { actor }).await,
        NodeResponse::ActorStopped
    );
    assert!(status(a.addr()).await.actors.is_empty());
    let deadline = Instant::now() + Duration::from_secs(10);
    while objects_on_a().await > 1 {
        assert!(
            Instant::now() < deadline,
            "the pulled copy was never dropped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let meta = |object| NodeRequest::ObjectMeta { object };
    assert!(
        client(a.addr())
            .await
            .call(&meta(local.object))
            .await
            .is_ok()
    );
    assert!(
        client(b.addr())
            .await
            .call(&meta(remote.object))
            .await
            .is_ok()
    );
}

/// A task's inputs that are parts of objects on another node (a reduce's partitions of map
/// tasks' objects) come over together into one object, checked part by part, which goes when
/// the task ends; a part that does not match its checksum fails the task as a lost input.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tasks_parts_on_another_node_come_together_into_one_object_it_deletes() {
    let (_cluster, a, b) = two_nodes().await;
    let (first, second) = (
        fill(b.addr(), 1, 9 << 20, 1).await,
        fill(b.addr(), 2, 4_000, 2).await,
    );
    let (first_bytes, second_bytes) = (fill_pattern(9 << 20, 1), fill_pattern(4_000, 2));
    let part = |object: &OutputRef, bytes: &[u8], offset: usize, len: usize| InputRef {
        object: object.object,
        holder: Some(b.addr().to_owned()),
        part: Some(Part {
            offset: offset as u64,
            len: len as u64,
            rows: 0,
            checksum: xxh3_64(&bytes[offset..offset + len]),
        }),
    };
    let inputs = vec![
        part(&first, &first_bytes, 100, 6 << 20),
        part(&second, &second_bytes, 64, 1_000),
        part(&first, &first_bytes, 7 << 20, 2 << 20),
    ];
    let expected: Vec<u8> = [
        &first_bytes[100..100 + (6 << 20)],
        &second_bytes[64..1_064],
        &first_bytes[7 << 20..9 << 20],
    ]
    .iter()
    .flat_map(|bytes| xxh3_64(bytes).to_le_bytes())
    .collect();
    let before = status(a.addr()).await.store.objects_in_memory;
    let hashed = run(a.addr(), 3, TaskKind::Test(TestTask::Hash), inputs.clone())
        .await
        .unwrap()
        .remove(0);
    assert_eq!(read_start(a.addr(), hashed.object, 24).await, expected);
    // Only the task's output stayed: the object the parts came into went with the task.
    assert_eq!(status(a.addr()).await.store.objects_in_memory, before + 1);
    assert_eq!(
        status(a.addr()).await.pulls_started,
        0,
        "no whole object moved"
    );
    // Both nodes run on this host: the parts were read from `b`'s segment, not a socket.
    assert_eq!(
        status(a.addr()).await.borrowed_bytes,
        (6 << 20) + 1_000 + (2 << 20)
    );

    // A part that arrives corrupt names its own object as lost, not the first one pulled.
    let mut corrupt = inputs.clone();
    if let Some(part) = &mut corrupt[1].part {
        part.checksum ^= 1;
    }
    let failure = run(a.addr(), 4, TaskKind::Test(TestTask::Hash), corrupt)
        .await
        .unwrap_err();
    assert!(
        matches!(&failure, TaskFailure::InputUnavailable { object, reason }
            if *object == second.object && reason.contains("checksum")),
        "{failure:?}"
    );
    assert_eq!(status(a.addr()).await.store.objects_in_memory, before + 1);

    // A part of an object the holder no longer has names that object.
    let gone = ObjectId::new(0x60_4e);
    let mut missing = inputs;
    missing[2].object = gone;
    let failure = run(a.addr(), 5, TaskKind::Test(TestTask::Hash), missing)
        .await
        .unwrap_err();
    assert!(
        matches!(&failure, TaskFailure::InputUnavailable { object, .. } if *object == gone),
        "{failure:?}"
    );
    assert_eq!(status(a.addr()).await.store.objects_in_memory, before + 1);
}

/// A loan keeps what it lends pinned for as long as the borrower's connection lasts: freed
/// meanwhile, the object's bytes stay in the holder's segment where the loan says, and the
/// connection's end lets them go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loan_pins_its_ranges_until_the_borrowers_connection_ends() {
    use std::os::unix::fs::FileExt;

    let (_cluster, _a, b) = two_nodes().await;
    let lent = fill(b.addr(), 1, 4 << 20, 7).await;
    let bytes = fill_pattern(4 << 20, 7);
    let mut borrower = client(b.addr()).await;
    let request = NodeRequest::LendRanges {
        ranges: vec![ByteRange {
            object: lent.object,
            offset: 1_000,
            len: 3 << 20,
        }],
    };
    let loan = match borrower.call(&request).await.unwrap() {
        NodeResponse::Lent(loan) => loan,
        other => panic!("unexpected {other:?}"),
    };
    let used = status(b.addr()).await.store.used;
    assert!(matches!(
        call(
            b.addr(),
            NodeRequest::Free {
                objects: vec![lent.object]
            }
        )
        .await,
        NodeResponse::Freed
    ));
    let segment = std::fs::File::open(format!("/dev/shm{}", loan.segment)).unwrap();
    let mut read = vec![0u8; 3 << 20];
    segment.read_exact_at(&mut read, loan.offsets[0]).unwrap();
    assert!(
        read == bytes[1_000..1_000 + (3 << 20)],
        "the lent bytes changed"
    );
    assert_eq!(status(b.addr()).await.store.used, used, "freed while lent");

    drop(borrower);
    let deadline = Instant::now() + Duration::from_secs(10);
    while status(b.addr()).await.store.used + (4 << 20) > used {
        assert!(
            Instant::now() < deadline,
            "the loan outlived its connection"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_512_mib_object_moves_between_nodes_with_its_checksum_verified() {
    let (_cluster, a, b) = two_nodes().await;
    let size = 512usize << 20;
    let expected = xxh3_64(&fill_pattern(size, 5));
    let object = fill(a.addr(), 1, size, 5).await;
    assert_eq!(
        (object.size, object.checksum),
        (size as u64, Some(expected))
    );
    let pull = NodeRequest::Pull {
        object: object.object,
        holder: a.addr().to_owned(),
    };
    assert_eq!(
        call(b.addr(), pull).await,
        NodeResponse::Pulled(object.clone())
    );
    assert_eq!(status(b.addr()).await.pulls_started, 1);
    // B's copy, hashed there by a worker that maps it: the same bytes.
    let hashed = run(
        b.addr(),
        2,
        TaskKind::Test(TestTask::Hash),
        vec![InputRef {
            object: object.object,
            holder: None,
            part: None,
        }],
    )
    .await
    .unwrap()
    .remove(0);
    assert_eq!(
        read_start(b.addr(), hashed.object, 8).await,
        expected.to_le_bytes()
    );
}

/// The worker writes its output into the store's shared memory itself: the agent, which
/// only creates and seals the object, never touches its pages (its resident shared memory
/// does not grow with the output), and readers get the worker's bytes and checksum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_writes_its_output_in_place_and_the_agent_touches_none_of_it() {
    let cluster = cluster().await;
    let node = cluster.start_node("n", &[]);
    cluster.wait_ready(&node).await;
    let agent_before = process::resident_shared_bytes(node.pid());
    let bytes = 64 << 20;
    let spec = TaskSpec {
        task: TaskId::new(11),
        job: JobId::new(1),
        kind: TaskKind::Test(TestTask::Fill { bytes, seed: 9 }),
        inputs: Vec::new(),
    };
    let (outputs, worker) = match call(node.addr(), NodeRequest::RunTask(spec)).await {
        NodeResponse::Task { result, worker } => (result.unwrap().outputs, worker.unwrap()),
        other => panic!("unexpected {other:?}"),
    };
    let pattern = fill_pattern(bytes as usize, 9);
    assert_eq!(outputs[0].size, bytes);
    assert_eq!(outputs[0].checksum, Some(xxh3_64(&pattern)));
    let agent_grew = process::resident_shared_bytes(node.pid()).saturating_sub(agent_before);
    assert!(
        agent_grew < 4 << 20,
        "the agent touched {agent_grew} bytes of shared memory for a {bytes}-byte output"
    );
    let worker_shared = process::resident_shared_bytes(worker.pid);
    assert!(
        worker_shared >= bytes,
        "the worker has only {worker_shared} bytes of shared memory resident"
    );
    // Read back (from the segment, by sendfile) and checked against the worker's hash.
    assert_eq!(
        read_start(node.addr(), outputs[0].object, 4096).await,
        pattern[..4096]
    );
    match call(
        node.addr(),
        NodeRequest::ObjectMeta {
            object: outputs[0].object,
        },
    )
    .await
    {
        NodeResponse::ObjectMeta(meta) => {
            assert_eq!((meta.size, meta.checksum), (bytes, xxh3_64(&pattern)));
        }
        other => panic!("unexpected {other:?}"),
    }
}

/// A worker SIGKILLed halfway through writing its output leaves no object and no allocation
/// behind (the store is empty again), and the task run again (same id, as the driver retries
/// it) writes the whole output.
/// An output larger than the whole store is created in a fallback file, which the worker maps
/// and writes in place like the segment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_output_larger_than_the_store_is_written_by_its_worker_into_a_fallback_file() {
    let cluster = cluster().await;
    let node = cluster.start_node("small", &["memory.total=256MiB"]);
    let ready = cluster.wait_ready(&node).await;
    let bytes: u64 = 128 << 20;
    assert!(bytes > ready.store.capacity, "{:?}", ready.store);
    let output = fill(node.addr(), 3, bytes as usize, 2).await;
    let pattern = fill_pattern(bytes as usize, 2);
    assert_eq!(
        (output.size, output.checksum),
        (bytes, Some(xxh3_64(&pattern)))
    );
    let store = status(node.addr()).await.store;
    assert_eq!((store.fallback_objects, store.fallback_bytes), (1, bytes));
    assert_eq!(
        read_start(node.addr(), output.object, 4096).await,
        pattern[..4096]
    );
    call(
        node.addr(),
        NodeRequest::Free {
            objects: vec![output.object],
        },
    )
    .await;
    assert_eq!(status(node.addr()).await.store.fallback_objects, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_while_writing_leaves_nothing_and_its_task_runs_again() {
    let cluster = cluster().await;
    let node = cluster.start_node("n", &[]);
    cluster.wait_ready(&node).await;
    let bytes: u64 = 32 << 20;
    let task = TaskId::new(7);
    let kind = TaskKind::Test(TestTask::StallMidWrite {
        bytes,
        seed: 5,
        ms: 3_000,
    });
    let addr = node.addr().to_owned();
    let first = {
        let kind = kind.clone();
        tokio::spawn(async move { run(&addr, task.get(), kind, vec![]).await })
    };
    let object = output_id(task, 0);
    let deadline = Instant::now() + READY_TIMEOUT;
    let victim = loop {
        let status = status(node.addr()).await;
        if let Some(running) = status.running.first()
            && status.store.used >= bytes
        {
            break running.worker_pid;
        }
        assert!(Instant::now() < deadline, "the output was never created");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Created, being written: not readable by anyone.
    let meta = node::connect(node.addr(), &wire())
        .await
        .call(&NodeRequest::ObjectMeta { object })
        .await;
    assert!(meta.is_err(), "an unsealed output was visible: {meta:?}");
    process::signal(victim, "KILL");
    let failure = first.await.unwrap().unwrap_err();
    assert_eq!(
        failure,
        TaskFailure::WorkerDied {
            reason: "killed by signal 9 (SIGKILL)".into()
        }
    );
    let store = status(node.addr()).await.store;
    assert_eq!(
        (store.used, store.objects_in_memory, store.pinned_objects),
        (0, 0, 0),
        "the killed task left something in the store: {store:?}"
    );

    let outputs = run(node.addr(), task.get(), kind, vec![]).await.unwrap();
    let pattern = fill_pattern(bytes as usize, 5);
    assert_eq!(outputs[0].object, object);
    assert_eq!(
        (outputs[0].size, outputs[0].checksum),
        (bytes, Some(xxh3_64(&pattern)))
    );
    assert_eq!(read_start(node.addr(), object, 4096).await, pattern[..4096]);
    call(
        node.addr(),
        NodeRequest::Free {
            objects: vec![object],
        },
    )
    .await;
    assert_eq!(status(node.addr()).await.store.used, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_fails_its_task_and_is_respawned() {
    let cluster = cluster().await;
    let node = cluster.start_node("n", &[]);
    cluster.wait_ready(&node).await;

    let addr = node.addr().to_owned();
    let sleep = TaskKind::Test(TestTask::Sleep { ms: 60_000 });
    let long = tokio::spawn(async move { run(&addr, 1, sleep, vec![]).await });
    let deadline = Instant::now() + READY_TIMEOUT;
    let victim = loop {
        if let Some(running) = status(node.addr()).await.running.first() {
            break *running;
        }
        assert!(Instant::now() < deadline, "the task never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(victim.task, TaskId::new(1));
    process::signal(victim.worker_pid, "KILL");

    let failure = long.await.unwrap().unwrap_err();
    assert_eq!(
        failure,
        TaskFailure::WorkerDied {
            reason: "killed by signal 9 (SIGKILL)".into()
        }
    );
    assert!(failure.retryable());
    // The next task runs, and the slot gets a new worker process.
    let outputs = run(
        node.addr(),
        2,
        TaskKind::Test(TestTask::Fill { bytes: 10, seed: 0 }),
        vec![],
    )
    .await
    .unwrap();
    assert_eq!(outputs[0].checksum, Some(xxh3_64(&fill_pattern(10, 0))));
    let after = cluster.wait_ready(&node).await;
    assert_eq!(after.workers_respawned, 1);
    assert_eq!((after.tasks_finished, after.tasks_failed), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_monitor_kills_the_newest_task_with_an_out_of_memory_reason() {
    let cluster = cluster().await;
    // Any node's processes are past 1% of 256 MiB, so the monitor acts on the first running
    // task.
    let node = cluster.start_node(
        "n",
        &[
            "memory.total=256MiB",
            "node.memory_monitor_threshold=0.01",
            "node.memory_monitor_interval_ms=50",
        ],
    );
    cluster.wait_ready(&node).await;
    let sleep = TaskKind::Test(TestTask::Sleep { ms: 60_000 });
    let failure = run(node.addr(), 1, sleep, vec![]).await.unwrap_err();
    match &failure {
        TaskFailure::OutOfMemory { reason } => {
            assert!(
                reason.contains("node.memory_monitor_threshold of 1.0%"),
                "{reason}"
            );
        }
        other => panic!("expected an out-of-memory failure, got {other:?}"),
    }
    assert!(failure.retryable());
    // The agent itself is unharmed and replaces the worker.
    let after = cluster.wait_ready(&node).await;
    assert_eq!(after.workers_respawned, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_given_less_memory_than_the_host_kills_a_growing_task_before_its_processes_pass_it()
{
    let cluster = cluster().await;
    let total: u64 = 256 << 20;
    let node = cluster.start_node(
        "small",
        &["memory.total=256MiB", "node.memory_monitor_interval_ms=20"],
    );
    cluster.wait_ready(&node).await;
    // The task touches 512 MiB of its own memory, page by page: twice what the node may use,
    // well within the host.
    let grow = TaskKind::Test(TestTask::Grow { bytes: 512 << 20 });
    let failure = run(node.addr(), 1, grow, vec![]).await.unwrap_err();
    let TaskFailure::OutOfMemory { reason } = &failure else {
        panic!("expected an out-of-memory failure, got {failure:?}");
    };
    // What the node's processes used when the monitor acted: past 95% of what the 10%
    // system reserve leaves, and still below the node's memory.
    let used: u64 = reason
        .strip_prefix("the node's processes use ")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|used| used.parse().ok())
        .unwrap_or_else(|| panic!("no usage in {reason:?}"));
    let limit = ((total - total / 10) as f64 * 0.95) as u64;
    assert!(used > limit && used < total, "{used} of {total}: {reason}");
    let after = cluster.wait_ready(&node).await;
    assert_eq!(after.workers_respawned, 1);
}

/// Writes an executable script at `path` that runs the `floe` binary under test in a mount
/// namespace of its own with a tmpfs of `size` on /dev/shm, which the node and its workers
/// share and nothing else sees; `None`, after saying so loudly, when this host cannot (it
/// needs root, `unshare` and `mount`, which CI has).
fn floe_with_own_dev_shm(path: &std::path::Path, size: &str) -> Option<std::path::PathBuf> {
    let mount = format!("mount -t tmpfs -o size={size} tmpfs /dev/shm");
    let probe = std::process::Command::new("unshare")
        .args(["--mount", "sh", "-c", &mount])
        .output();
    if !probe.as_ref().is_ok_and(|output| output.status.success()) {
        eprintln!(
            "SKIPPED: cannot mount a small /dev/shm in a mount namespace (needs root, unshare \
             and mount; CI has them): {probe:?}"
        );
        return None;
    }
    let script = format!(
        "#!/bin/sh\nexec unshare --mount sh -c '{mount} && exec \"$0\" \"$@\"' {} \"$@\"\n",
        env!("CARGO_BIN_EXE_floe")
    );
    std::fs::write(path, script).unwrap();
    let mut permissions = std::fs::metadata(path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o755);
    std::fs::set_permissions(path, permissions).unwrap();
    Some(path.to_owned())
}

/// Takes all but `left` bytes of the /dev/shm that the process `pid` sees, with a file of its
/// own there.
fn fill_dev_shm_of(pid: u32, left: u64) {
    let fill = format!(
        "free=$(( $(stat -f -c '%a * %S' /dev/shm) )); fallocate -l $((free - {left})) \
         /dev/shm/ballast"
    );
    let status = std::process::Command::new("nsenter")
        .args(["--target", &pid.to_string(), "--mount", "sh", "-c", &fill])
        .status()
        .unwrap();
    assert!(
        status.success(),
        "cannot fill the node's /dev/shm: {status}"
    );
}

/// A /dev/shm that fills up after a node started fails the tasks that needed the room, saying
/// why, and the node carries on: neither a worker mapping its output nor the node making a
/// pulled copy dies of `SIGBUS`. The node's store (75 MiB, `memory.object_store_min`) starts
/// on a 96 MiB tmpfs of its own, which another file then fills to all but 8 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_dev_shm_is_full_fails_the_tasks_that_need_room_and_carries_on() {
    let scripts = tempfile::tempdir().unwrap();
    let Some(binary) = floe_with_own_dev_shm(&scripts.path().join("floe"), "96m") else {
        return;
    };
    let cluster = cluster().await;
    let small_config = TestClusterConfig { binary, ..config() };
    let small = floe_testkit::cluster::start_node(
        &small_config,
        cluster.dir.path(),
        &cluster.schedulers.addrs(),
        "small-shm",
        &["memory.total=1GiB", "memory.object_store_fraction=0.05"],
    );
    let holder = cluster.start_node("holder", &[]);
    cluster.wait_ready(&small).await;
    cluster.wait_ready(&holder).await;
    fill_dev_shm_of(small.pid(), 8 << 20);

    // A worker opening a 32 MiB output to write it.
    let fill_32 = TaskKind::Test(TestTask::Fill {
        bytes: 32 << 20,
        seed: 1,
    });
    let failure = run(small.addr(), 1, fill_32, vec![]).await.unwrap_err();
    assert!(
        matches!(&failure, TaskFailure::Error { message } if message.contains("/dev/shm has no room")),
        "{failure:?}"
    );

    // The node making its copy of a 32 MiB object held by another node.
    let held = fill(holder.addr(), 2, 32 << 20, 2).await;
    let input = InputRef {
        object: held.object,
        holder: Some(holder.addr().to_owned()),
        part: None,
    };
    let failure = run(small.addr(), 3, TaskKind::Test(TestTask::Hash), vec![input])
        .await
        .unwrap_err();
    assert!(
        matches!(&failure, TaskFailure::InputUnavailable { reason, .. } if reason.contains("/dev/shm has no room")),
        "{failure:?}"
    );

    // The node and all its workers are still there, and a task that fits runs.
    let after = cluster.wait_ready(&small).await;
    assert_eq!(after.workers_respawned, 0, "a worker died: {after:?}");
    let fitting = fill(small.addr(), 4, 1 << 20, 4).await;
    let bytes = read_start(small.addr(), fitting.object, 1 << 20).await;
    assert!(
        bytes == fill_pattern(1 << 20, 4),
        "the object's bytes differ"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_leaves_cleanly_and_kill_9_is_committed_dead_in_time() {
    let cluster = cluster().await;
    let mut leaving = cluster.start_node("leaving", &[]);
    let crashing = cluster.start_node("crashing", &[]);
    let leaving_id = cluster.wait_ready(&leaving).await.node.unwrap();
    let crashing_id = cluster.wait_ready(&crashing).await.node.unwrap();
    assert!(leaving.segment().exists());
    assert_eq!(workers_of(&leaving).len(), 2);
    assert_eq!(workers_of(&crashing).len(), 2);
    assert!(leaving.worker_socket().exists());

    // SIGTERM: the node says it is leaving, kills its workers and unlinks its shared memory.
    leaving.signal("TERM").unwrap();
    assert!(
        leaving.wait().unwrap(),
        "floe node should exit successfully on SIGTERM"
    );
    assert!(
        !leaving.segment().exists(),
        "{} left behind",
        leaving.segment().display()
    );
    assert!(!leaving.worker_socket().exists());
    assert_workers_gone(&leaving);
    let leftovers: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|entry| entry.ok())
        .filter(|entry| {
            entry
                .file_name()
                .to_string_lossy()
                .contains(&format!("node-{}", leaving.pid()))
        })
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    match &cluster.state().await.nodes[&leaving_id].liveness {
        Liveness::Dead { reason, .. } => assert!(reason.contains("SIGTERM"), "{reason}"),
        Liveness::Alive => panic!("the scheduler was not told"),
    }

    // kill -9 while a task runs: no goodbye; the scheduler commits the death after missed
    // heartbeats.
    let addr = crashing.addr().to_owned();
    tokio::spawn(async move {
        let spec = TaskSpec {
            task: TaskId::new(9),
            job: floe_core::JobId::new(1),
            kind: TaskKind::Test(TestTask::Sleep { ms: 60_000 }),
            inputs: Vec::new(),
        };
        // The node dies under this call; its failure is expected.
        let _ = client(&addr).await.call(&NodeRequest::RunTask(spec)).await;
    });
    let deadline = Instant::now() + READY_TIMEOUT;
    while status(crashing.addr()).await.running.is_empty() {
        assert!(Instant::now() < deadline, "the task never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let killed_at = Instant::now();
    crashing.signal("KILL").unwrap();
    let health_timeout = Duration::from_millis(HEARTBEAT_MS * MISSED_HEARTBEATS);
    let deadline = killed_at + health_timeout * 3;
    loop {
        if let Liveness::Dead { reason, .. } = &cluster.state().await.nodes[&crashing_id].liveness {
            assert!(reason.contains("missed"), "{reason}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "death not committed within {:?}",
            health_timeout * 3
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = killed_at.elapsed();
    // Its workers die with it, even one busy with a task.
    assert_workers_gone(&crashing);
    // The last heartbeat may have gone out up to one interval before the kill.
    let earliest = health_timeout - Duration::from_millis(HEARTBEAT_MS);
    assert!(
        elapsed >= earliest,
        "committed after {elapsed:?}, before the health timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_follows_the_leader_through_a_failover() {
    let three_replicas = TestClusterConfig {
        replicas: 3,
        ..config()
    };
    let mut cluster = TestCluster::start(three_replicas, 0).await;
    let old_leader = cluster
        .schedulers
        .wait_for_leader(READY_TIMEOUT)
        .await
        .unwrap();
    let node = cluster.start_node("n", &[]);
    let id = cluster.wait_ready(&node).await.node.unwrap();

    cluster.schedulers.kill(old_leader).unwrap();
    let new_leader = cluster
        .schedulers
        .wait_for_leader(READY_TIMEOUT)
        .await
        .unwrap();
    assert_ne!(new_leader, old_leader);
    // A node that stopped heartbeating would be committed dead by the new leader after one
    // health timeout; this one keeps going to whichever replica leads.
    let health_timeout = Duration::from_millis(HEARTBEAT_MS * MISSED_HEARTBEATS);
    tokio::time::sleep(health_timeout * 3).await;
    let state = cluster.state().await;
    assert!(state.nodes[&id].is_alive(), "{:?}", state.nodes[&id]);
    assert_eq!(
        state.nodes.len(),
        1,
        "the node must not have registered again"
    );
    let status = status(node.addr()).await;
    assert_eq!(status.node, Some(id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_no_scheduler_answers_still_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens there: registration keeps retrying.
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let mut node = floe_testkit::cluster::start_node(&config(), dir.path(), &[nowhere], "n", &[]);
    let deadline = Instant::now() + READY_TIMEOUT;
    while !(node.segment().exists() && workers_of(&node).len() == 2) {
        assert!(Instant::now() < deadline, "the node never opened its store");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.signal("TERM").unwrap();
    assert!(
        node.wait().unwrap(),
        "floe node should exit successfully on SIGTERM"
    );
    assert!(!node.segment().exists());
    assert!(!node.worker_socket().exists());
    assert_workers_gone(&node);
}
