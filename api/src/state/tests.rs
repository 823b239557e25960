use super::*;
use floe_core::job::OperatorStats;

fn register(state: &mut ClusterState, index: u64, rpc: &str) -> NodeId {
    let outcome = state
        .apply(
            index,
            0,
            Command::RegisterNode {
                addresses: NodeAddresses { rpc: rpc.into() },
                resources: Resources {
                    cpu_millis: 4_000,
                    heap_bytes: 1 << 30,
                },
                memory: NodeMemory::default(),
                labels: BTreeMap::new(),
                replaces: None,
            },
        )
        .unwrap();
    match outcome {
        Outcome::NodeRegistered(id) => id,
        other => panic!("unexpected {other:?}"),
    }
}

fn submit_job(n: u8) -> Command {
    Command::SubmitJob {
        spec: vec![n],
        submission: SubmissionId::new(u128::from(n)),
        name: None,
    }
}

fn succeeded() -> JobOutcome {
    JobOutcome {
        status: JobStatus::Succeeded,
        stats: JobStats::default(),
        outputs: Vec::new(),
    }
}

#[test]
fn a_retried_submission_is_one_job() {
    let mut state = ClusterState::default();
    assert_eq!(
        state.apply(1, 0, submit_job(4)),
        Some(Outcome::JobSubmitted(JobId::new(1)))
    );
    assert_eq!(
        state.apply(2, 0, submit_job(4)),
        Some(Outcome::JobSubmitted(JobId::new(1)))
    );
    assert_eq!(
        state.apply(3, 0, submit_job(5)),
        Some(Outcome::JobSubmitted(JobId::new(2)))
    );
    assert_eq!(state.jobs.len(), 2);
}

#[test]
fn only_the_current_driver_attempt_finishes_a_job() {
    let mut state = ClusterState::default();
    let a = register(&mut state, 1, "a:1");
    let b = register(&mut state, 2, "b:1");
    let job = JobId::new(1);
    state.apply(3, 0, submit_job(1));
    state.apply(4, 0, Command::StartDriver { job, node: a });
    // A second start while the first driver runs is refused.
    assert!(matches!(
        state.apply(5, 0, Command::StartDriver { job, node: b }),
        Some(Outcome::Rejected(_))
    ));
    state.apply(
        6,
        0,
        Command::MarkNodeDead {
            node: a,
            reason: "killed".into(),
        },
    );
    // The dead node's drivers left the index with it.
    assert!(state.drivers_on(a).is_empty());
    state.apply(7, 0, Command::StartDriver { job, node: b });
    assert_eq!(state.drivers_on(b), vec![(job, 2)]);
    assert!(state.drives_a_job(b) && !state.drives_a_job(a));
    // What heartbeats are answered from, taken now: later commands leave it as it was.
    let directory = state.node_directory();
    assert_eq!(directory.applied_index, 7);
    assert!(directory.is_alive(b) && !directory.is_alive(a));
    let finish = |attempt| Command::FinishJob {
        job,
        attempt,
        outcome: succeeded(),
    };
    assert!(matches!(
        state.apply(8, 0, finish(1)),
        Some(Outcome::Rejected(_))
    ));
    assert_eq!(state.apply(9, 0, finish(2)), Some(Outcome::Applied));
    assert_eq!(state.jobs[&job].status, JobStatus::Succeeded);
    assert!(state.drivers_on(b).is_empty());
    assert!(state.drivers.is_empty(), "{:?}", state.drivers);
    assert_eq!(directory.drivers_on(b), vec![(job, 2)]);
    assert!(state.node_directory().drivers_on(b).is_empty());
    assert!(matches!(
        state.apply(10, 0, finish(2)),
        Some(Outcome::Rejected(_))
    ));
}

#[test]
fn cancelling_ends_a_pending_job_and_flags_a_running_one() {
    let mut state = ClusterState::default();
    let a = register(&mut state, 1, "a:1");
    state.apply(2, 0, submit_job(1));
    state.apply(3, 0, submit_job(2));
    let (pending, running) = (JobId::new(1), JobId::new(2));
    state.apply(
        4,
        0,
        Command::StartDriver {
            job: running,
            node: a,
        },
    );
    state.apply(5, 0, Command::CancelJob { job: pending });
    state.apply(6, 0, Command::CancelJob { job: running });
    assert_eq!(state.jobs[&pending].status, JobStatus::Cancelled);
    assert_eq!(state.jobs[&running].status, JobStatus::Running);
    assert!(state.jobs[&running].cancel_requested);
    assert!(matches!(
        state.apply(7, 0, Command::CancelJob { job: pending }),
        Some(Outcome::Rejected(_))
    ));
}

/// A snapshot's encoding copies every chunk of entries unchanged since the last one, encodes
/// the others, and is byte for byte the whole state's encoding, in pieces that tile it.
#[test]
fn an_encoding_copies_the_chunks_unchanged_since_the_last() {
    let mut state = ClusterState::default();
    let a = register(&mut state, 1, "a:1");
    let mut index = 1;
    let mut apply = |state: &mut ClusterState, command| {
        index += 1;
        state.apply(index, 0, command).unwrap()
    };
    let submit = |n: u32| Command::SubmitJob {
        spec: vec![1],
        submission: SubmissionId::new(u128::from(n)),
        name: None,
    };
    for n in 0..1_500 {
        apply(&mut state, submit(n));
    }
    let first = state.encode_reusing(&EncodedState::default()).unwrap();
    assert_tiles_the_encoding(&first, &state);
    assert_eq!(first.reused_bytes(), 0);
    assert!(
        first.pieces().len() > 100,
        "{} pieces",
        first.pieces().len()
    );
    // A job in the middle starts, one more is submitted, the first goes.
    let (middle, first_job) = (JobId::new(750), JobId::new(1));
    apply(
        &mut state,
        Command::StartDriver {
            job: middle,
            node: a,
        },
    );
    apply(&mut state, submit(1_500));
    apply(&mut state, Command::CancelJob { job: first_job });
    apply(&mut state, Command::DeleteJob { job: first_job });
    let second = state.encode_reusing(&first).unwrap();
    assert_tiles_the_encoding(&second, &state);
    let encoded = second.data().len() - second.reused_bytes();
    assert!(
        encoded < second.data().len() / 8,
        "{encoded} of {} bytes encoded again",
        second.data().len()
    );
    // Nothing changed: only the small fields between the maps are encoded again.
    let third = state.encode_reusing(&second).unwrap();
    assert_tiles_the_encoding(&third, &state);
    let encoded = third.data().len() - third.reused_bytes();
    assert!(encoded < 100, "{encoded} bytes encoded again");
    assert_eq!(ClusterState::decode(third.data()).unwrap(), state);
}

/// `encoded` is `state`'s encoding, and its pieces tile it, each named by its bytes' hash.
fn assert_tiles_the_encoding(encoded: &EncodedState, state: &ClusterState) {
    assert_eq!(encoded.data().as_ref(), state.encode().unwrap().as_slice());
    let mut end = 0;
    for piece in encoded.pieces() {
        assert_eq!(piece.start, end);
        assert!(piece.end > piece.start);
        let bytes = &encoded.data()[piece.start..piece.end];
        assert_eq!(piece.hash, floe_core::hash::xxh3_128(bytes));
        end = piece.end;
    }
    assert_eq!(end, encoded.data().len());
}

fn fingerprint(n: u8) -> String {
    format!("{n:032x}")
}

#[test]
fn a_death_drops_what_lived_on_the_node_and_requeues_its_drivers() {
    let mut state = ClusterState::default();
    let a = register(&mut state, 1, "a:1");
    let b = register(&mut state, 2, "b:1");
    assert_eq!((a.get(), b.get()), (1, 2));
    assert_eq!(
        state.apply(3, 0, submit_job(7)),
        Some(Outcome::JobSubmitted(JobId::new(1)))
    );
    let job = JobId::new(1);
    state.apply(4, 0, Command::StartDriver { job, node: a });
    let actor_a = ActorId::new(10);
    let actor_b = ActorId::new(11);
    for (index, actor, node) in [(5, actor_a, a), (6, actor_b, b)] {
        state.apply(
            index,
            0,
            Command::RegisterActor {
                actor,
                kind: "HashShuffleAggregator".into(),
                node,
                job,
            },
        );
    }
    for (index, rank, node) in [(7, 0, a), (8, 1, b)] {
        state.apply(index, 0, record_shard_of_two(rank, node));
    }
    state.apply(
        9,
        0,
        Command::MarkNodeDead {
            node: a,
            reason: "missed 5 heartbeats".into(),
        },
    );

    assert!(!state.nodes[&a].is_alive());
    // The driver on `a` died: its actor record went with the node, and the actor it placed
    // on `b` went with the driver.
    assert!(state.actors.is_empty(), "{:?}", state.actors);
    let shards = &state.cache[&fingerprint(1)][&2].shards;
    assert_eq!(shards.keys().copied().collect::<Vec<_>>(), [1]);
    let job = &state.jobs[&job];
    assert_eq!(
        (job.status.clone(), job.driver, job.attempts),
        (JobStatus::Pending, None, 1)
    );
    assert_eq!(
        state.deaths_after(0),
        vec![NodeDeath {
            node: a,
            index: 9,
            reason: "missed 5 heartbeats".into()
        }]
    );
    assert!(state.deaths_after(9).is_empty());
    // Nothing new may be placed on a dead node, and it can only come back as a new node.
    assert!(matches!(
        state.apply(
            10,
            0,
            Command::StartDriver {
                job: JobId::new(1),
                node: a
            }
        ),
        Some(Outcome::Rejected(_))
    ));
    assert_eq!(register(&mut state, 11, "a:1").get(), 3);
}

/// A registration naming the node it replaces, at `rpc`.
fn replacement(rpc: &str, replaces: NodeId) -> Command {
    Command::RegisterNode {
        addresses: NodeAddresses { rpc: rpc.into() },
        resources: Resources::default(),
        memory: NodeMemory::default(),
        labels: BTreeMap::new(),
        replaces: Some(replaces),
    }
}

#[test]
fn a_registration_retires_the_live_node_it_replaces_at_its_address_only() {
    let mut state = ClusterState::default();
    let a = register(&mut state, 1, "a:1");
    let b = register(&mut state, 2, "b:1");
    state.apply(3, 0, submit_job(7));
    let job = JobId::new(1);
    state.apply(4, 0, Command::StartDriver { job, node: a });

    // `a` restarted on its data directory at its address: the new id and `a`'s death are one
    // commit, and `a`'s driver is queued again as after any death.
    let c = match state.apply(5, 70, replacement("a:1", a)) {
        Some(Outcome::NodeRegistered(c)) => c,
        other => panic!("unexpected {other:?}"),
    };
    assert_eq!(c.get(), 3);
    assert!(state.nodes[&c].is_alive());
    assert_eq!(
        state.nodes[&a].liveness,
        Liveness::Dead {
            index: 5,
            at_ms: 70,
            reason: "replaced by node 3, which registered at its address a:1".into()
        }
    );
    assert_eq!(state.deaths_after(4).len(), 1);
    let record = &state.jobs[&job];
    assert_eq!(
        (record.status.clone(), record.driver),
        (JobStatus::Pending, None)
    );

    // A claim on a live node at another address is refused and changes nothing: no node
    // retires another one by naming it.
    let before = state.clone();
    let refused = state.apply(6, 0, replacement("c:1", b));
    assert_eq!(
        refused,
        Some(Outcome::Rejected(
            "node 2 is alive at b:1, not at c:1: a node replaces only its own predecessor at \
             its address"
                .into()
        ))
    );
    assert_eq!(state.nodes, before.nodes);
    assert!(state.nodes[&b].is_alive());

    // Naming a node dead already, or one the state never had, only registers.
    for (index, named) in [(7, a), (8, NodeId::new(99))] {
        assert!(matches!(
            state.apply(index, 0, replacement("a:1", named)),
            Some(Outcome::NodeRegistered(_))
        ));
    }
    assert!(state.nodes[&c].is_alive() && state.nodes[&b].is_alive());
    assert_eq!(state.deaths_after(5), vec![]);
}

#[test]
fn actors_belong_to_a_running_job_and_end_with_it() {
    let mut state = ClusterState::default();
    let node = register(&mut state, 1, "a:1");
    state.apply(2, 0, submit_job(1));
    let job = JobId::new(1);
    let actor = ActorId::new(5);
    let register_actor = Command::RegisterActor {
        actor,
        kind: "HashShuffleAggregator".into(),
        node,
        job,
    };
    assert!(
        matches!(state.apply(3, 0, register_actor.clone()), Some(Outcome::Rejected(reason)) if reason.contains("not running")),
        "a pending job has no driver to own actors"
    );
    state.apply(4, 0, Command::StartDriver { job, node });
    // The driver is an actor too, recorded where the scheduler placed it.
    let driver = &state.actors[&driver_actor(job, 1)];
    assert_eq!(
        (driver.kind.as_str(), driver.node, driver.job),
        (DRIVER_ACTOR_KIND, node, job)
    );
    assert_eq!(state.apply(5, 0, register_actor), Some(Outcome::Applied));
    assert_eq!(state.actors[&actor].job, job);
    let finish = Command::FinishJob {
        job,
        attempt: 1,
        outcome: succeeded(),
    };
    assert_eq!(state.apply(6, 0, finish), Some(Outcome::Applied));
    assert!(state.actors.is_empty(), "the job's actors end with it");
}

/// Cache hits are counted as a job's end is applied, from the shards its stats say each
/// operator loaded, so every replica (and a restarted one, from its snapshot and log) shows
/// the same counts; they go with the fingerprint's last shard.
#[test]
fn cache_hits_are_replicated_with_the_jobs_that_made_them_and_go_with_the_entry() {
    let mut state = ClusterState::default();
    let node = register(&mut state, 1, "a:1");
    state.apply(2, 1_000, record_shard_of_two(0, node));
    state.apply(3, 1_500, record_shard_of_two(1, node));
    assert_eq!(
        state.cache_use[&fingerprint(1)],
        CacheUse {
            hits: 0,
            last_used_ms: 1_500
        }
    );
    let loaded = |hits, fingerprint: &str| OperatorStats {
        name: "range".into(),
        fingerprint: Some(fingerprint.parse().unwrap()),
        cache_hits: hits,
        ..OperatorStats::default()
    };
    for (job, index, at_ms) in [(1u8, 4, 2_000), (2, 7, 3_000)] {
        state.apply(index, at_ms, submit_job(job));
        let id = JobId::new(u64::from(job));
        state.apply(index + 1, at_ms, Command::StartDriver { job: id, node });
        let outcome = JobOutcome {
            stats: JobStats {
                // A fingerprint the index does not hold counts nothing.
                operators: vec![loaded(2, &fingerprint(1)), loaded(5, &fingerprint(9))],
                ..JobStats::default()
            },
            ..succeeded()
        };
        let finish = Command::FinishJob {
            job: id,
            attempt: 1,
            outcome,
        };
        assert_eq!(
            state.apply(index + 2, at_ms, finish),
            Some(Outcome::Applied)
        );
    }
    assert_eq!(
        state.cache_use[&fingerprint(1)],
        CacheUse {
            hits: 4,
            last_used_ms: 3_000
        }
    );
    assert!(!state.cache_use.contains_key(&fingerprint(9)));
    let decoded = ClusterState::decode(&state.encode().unwrap()).unwrap();
    assert_eq!(decoded.cache_use, state.cache_use);
    let forget = |rank| Command::ForgetCacheShard {
        fingerprint: fingerprint(1),
        shard_count: 2,
        rank,
        node,
    };
    state.apply(10, 4_000, forget(0));
    assert!(state.cache_use.contains_key(&fingerprint(1)));
    state.apply(11, 4_000, forget(1));
    assert!(state.cache_use.is_empty(), "{:?}", state.cache_use);
}

#[test]
fn an_entry_is_never_applied_twice() {
    let mut state = ClusterState::default();
    register(&mut state, 5, "a:1");
    let before = state.clone();
    assert_eq!(state.apply(5, 0, submit_job(0)), None);
    assert_eq!(state.apply(3, 0, submit_job(0)), None);
    assert_eq!(state, before);
    state.skip(6);
    assert_eq!(state.apply(6, 0, submit_job(0)), None);
    assert_eq!(state.applied_commands, 1);
}

#[test]
fn the_snapshot_round_trips_and_is_deterministic() {
    let build = || {
        let mut state = ClusterState::default();
        let node = register(&mut state, 1, "a:1");
        for (index, n) in (2..40).zip(0u8..) {
            state.apply(
                index,
                0,
                Command::RecordCacheShard {
                    fingerprint: fingerprint(n % 7),
                    shard_count: 4,
                    rank: u32::from(n % 4),
                    shard: CachedShard {
                        node,
                        bytes: u64::from(n),
                        rows: 1,
                    },
                    origin: None,
                },
            );
        }
        state
    };
    let bytes = build().encode().unwrap();
    assert_eq!(bytes, build().encode().unwrap());
    assert_eq!(ClusterState::decode(&bytes).unwrap(), build());
    assert!(ClusterState::decode(&bytes[..bytes.len() - 1]).is_err());
}

#[test]
fn invalid_commands_are_rejected_without_changing_the_state() {
    let mut state = ClusterState::default();
    let node = register(&mut state, 1, "a:1");
    let before_counts = (state.jobs.len(), state.cache.len());
    let rejected = [
        Command::FinishJob {
            job: JobId::new(9),
            attempt: 1,
            outcome: succeeded(),
        },
        Command::CancelJob { job: JobId::new(9) },
        Command::RecordCacheShard {
            fingerprint: fingerprint(1),
            shard_count: 2,
            rank: 2,
            shard: CachedShard {
                node,
                bytes: 1,
                rows: 1,
            },
            origin: None,
        },
        Command::MarkNodeDead {
            node: NodeId::new(42),
            reason: String::new(),
        },
    ];
    for (index, command) in (2..).zip(rejected) {
        assert!(matches!(
            state.apply(index, 0, command),
            Some(Outcome::Rejected(_))
        ));
    }
    assert_eq!((state.jobs.len(), state.cache.len()), before_counts);
}

#[test]
fn a_driver_declared_gone_cannot_end_its_pending_job() {
    let mut state = ClusterState::default();
    let a = register(&mut state, 1, "a:1");
    register(&mut state, 2, "b:1");
    let job = JobId::new(1);
    state.apply(3, 0, submit_job(1));
    state.apply(4, 0, Command::StartDriver { job, node: a });
    state.apply(
        5,
        0,
        Command::MarkNodeDead {
            node: a,
            reason: "late heartbeats".into(),
        },
    );
    // The old driver still reaches the scheduler and reports an outcome for attempt 1.
    let late = Command::FinishJob {
        job,
        attempt: 1,
        outcome: JobOutcome {
            status: JobStatus::Cancelled,
            stats: JobStats::default(),
            outputs: Vec::new(),
        },
    };
    assert!(matches!(
        state.apply(6, 0, late),
        Some(Outcome::Rejected(_))
    ));
    assert_eq!(state.jobs[&job].status, JobStatus::Pending);
}

#[test]
fn forgetting_a_shard_drops_only_that_shard_and_only_where_it_is_recorded() {
    let mut state = ClusterState::default();
    let a = register(&mut state, 1, "a:1");
    let b = register(&mut state, 2, "b:1");
    for (index, rank, node) in [(3, 0, a), (4, 1, b)] {
        state.apply(index, 0, record_shard_of_two(rank, node));
    }
    let forget = |rank, node| Command::ForgetCacheShard {
        fingerprint: fingerprint(1),
        shard_count: 2,
        rank,
        node,
    };
    // Recorded on `a`, not `b`: a copy recorded elsewhere since is not dropped.
    assert!(matches!(
        state.apply(5, 0, forget(0, b)),
        Some(Outcome::Rejected(_))
    ));
    assert_eq!(state.apply(6, 0, forget(0, a)), Some(Outcome::Applied));
    let shards = &state.cache[&fingerprint(1)][&2].shards;
    assert_eq!(shards.keys().copied().collect::<Vec<_>>(), vec![1]);
    // The last shard takes its entry and its fingerprint with it.
    assert_eq!(state.apply(7, 0, forget(1, b)), Some(Outcome::Applied));
    assert!(state.cache.is_empty());
    assert!(matches!(
        state.apply(8, 0, forget(1, b)),
        Some(Outcome::Rejected(_))
    ));
}

/// Records shard `rank` of 2 of `fingerprint(1)` on `node`.
fn record_shard_of_two(rank: u32, node: NodeId) -> Command {
    record_shard_made_by(rank, node, None)
}

/// [`record_shard_of_two`], written by `origin`.
fn record_shard_made_by(rank: u32, node: NodeId, origin: Option<CacheOrigin>) -> Command {
    Command::RecordCacheShard {
        fingerprint: fingerprint(1),
        shard_count: 2,
        rank,
        shard: CachedShard {
            node,
            bytes: 100,
            rows: 10,
        },
        origin,
    }
}

#[test]
fn a_cache_entry_records_the_job_and_operator_that_made_it_at_the_log_time() {
    let mut state = ClusterState::default();
    let node = register(&mut state, 1, "a:1");
    let made_by = |job: u64| CacheOrigin {
        job: JobId::new(job),
        operator: "read→filter".to_owned(),
    };
    let record = |rank: u32, origin: Option<CacheOrigin>| record_shard_made_by(rank, node, origin);
    let provenance = |state: &ClusterState| state.cache[&fingerprint(1)][&2].made_by.clone();
    state.apply(2, 1_000, record(0, Some(made_by(7))));
    let first = Some(CacheProvenance {
        origin: made_by(7),
        created_at_ms: 1_000,
    });
    assert_eq!(provenance(&state), first);
    // The same job's next shard, and a node re-indexing what it found on disk, keep it.
    state.apply(3, 2_000, record(1, Some(made_by(7))));
    state.apply(4, 3_000, record(1, None));
    assert_eq!(provenance(&state), first);
    // Another job writing the entry again makes it anew.
    state.apply(5, 4_000, record(0, Some(made_by(9))));
    assert_eq!(
        provenance(&state),
        Some(CacheProvenance {
            origin: made_by(9),
            created_at_ms: 4_000,
        })
    );
}

/// One step of a random history: which command, with small ids so that most of them hit
/// something (and some are rejected, which must change nothing).
#[derive(Debug, Clone)]
enum Step {
    Register,
    Submit(u8),
    Start { job: u64, node: u64 },
    Finish { job: u64, status: u8, blocks: bool },
    Cancel(u64),
    Die(u64),
    Release(u64),
    Delete(u64),
    Prune { keep: u64, keep_for_ms: u64 },
    Expire { ttl_ms: u64 },
    Actor { actor: u8, job: u64, node: u64 },
    RemoveActor(u8),
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        1 => Just(Step::Register),
        4 => any::<u8>().prop_map(Step::Submit),
        4 => (1..40u64, 1..6u64).prop_map(|(job, node)| Step::Start { job, node }),
        4 => (1..40u64, 0..3u8, any::<bool>())
            .prop_map(|(job, status, blocks)| Step::Finish { job, status, blocks }),
        1 => (1..40u64).prop_map(Step::Cancel),
        1 => (1..6u64).prop_map(Step::Die),
        1 => (1..40u64).prop_map(Step::Release),
        1 => (1..40u64).prop_map(Step::Delete),
        1 => (0..10u64, 0..200u64).prop_map(|(keep, keep_for_ms)| Step::Prune { keep, keep_for_ms }),
        1 => (0..200u64).prop_map(|ttl_ms| Step::Expire { ttl_ms }),
        2 => (0..8u8, 1..40u64, 1..6u64)
            .prop_map(|(actor, job, node)| Step::Actor { actor, job, node }),
        1 => (0..8u8).prop_map(Step::RemoveActor),
    ]
}

/// The command `step` stands for in `state` at `at_ms`: the leader's own housekeeping asks
/// the state what is due, as the replica does.
fn command_of(step: &Step, state: &ClusterState, at_ms: u64) -> Command {
    match *step {
        Step::Register => Command::RegisterNode {
            addresses: NodeAddresses {
                rpc: format!("n:{at_ms}"),
            },
            resources: Resources::default(),
            memory: NodeMemory::default(),
            labels: BTreeMap::new(),
            replaces: None,
        },
        Step::Submit(n) => submit_job(n),
        Step::Start { job, node } => Command::StartDriver {
            job: JobId::new(job),
            node: NodeId::new(node),
        },
        Step::Finish {
            job,
            status,
            blocks,
        } => {
            let id = JobId::new(job);
            let attempt = state.jobs.get(&id).map_or(1, |record| record.attempts);
            let node = state
                .jobs
                .get(&id)
                .and_then(|record| record.driver)
                .unwrap_or(NodeId::new(1));
            let outputs = if blocks {
                vec![OutputBlock {
                    object: floe_core::ObjectId::new(u128::from(job)),
                    node,
                    rows: 1,
                    bytes: 8,
                }]
            } else {
                Vec::new()
            };
            Command::FinishJob {
                job: id,
                attempt,
                outcome: JobOutcome {
                    status: match status {
                        0 => JobStatus::Succeeded,
                        1 => JobStatus::Failed {
                            message: "boom".into(),
                        },
                        _ => JobStatus::Cancelled,
                    },
                    stats: JobStats::default(),
                    outputs,
                },
            }
        }
        Step::Cancel(job) => Command::CancelJob {
            job: JobId::new(job),
        },
        Step::Die(node) => Command::MarkNodeDead {
            node: NodeId::new(node),
            reason: "test".into(),
        },
        Step::Release(job) => Command::ReleaseJobOutput {
            job: JobId::new(job),
        },
        Step::Delete(job) => Command::DeleteJob {
            job: JobId::new(job),
        },
        Step::Prune { keep, keep_for_ms } => Command::PruneJobs {
            jobs: state.jobs_due_for_history(keep, keep_for_ms, at_ms),
        },
        Step::Expire { ttl_ms } => Command::ExpireJobOutputs {
            jobs: state.outputs_due_to_expire(ttl_ms, at_ms),
            ttl_ms,
        },
        // Few actor ids, so that one is registered again, for another job too.
        Step::Actor { actor, job, node } => Command::RegisterActor {
            actor: ActorId::new(u128::from(actor)),
            kind: "HashShuffleAggregator".into(),
            node: NodeId::new(node),
            job: JobId::new(job),
        },
        Step::RemoveActor(actor) => Command::RemoveActor {
            actor: ActorId::new(u128::from(actor)),
        },
    }
}

/// What the housekeeping indexes are for, computed by scanning every job: the jobs due for
/// the history and the outputs due to expire, in the order the old scans gave (by end).
fn due_by_scan(state: &ClusterState, at_ms: u64) -> (Vec<JobId>, Vec<JobId>) {
    let mut finished: Vec<(u64, JobId)> = state
        .jobs
        .values()
        .filter(|job| job.status.is_finished())
        .map(|job| (job.ended_at_ms.unwrap(), job.id))
        .collect();
    finished.sort();
    let old: Vec<JobId> = finished
        .iter()
        .take_while(|(ended, _)| ended + 50 <= at_ms)
        .map(|(_, job)| *job)
        .collect();
    let mut holding: Vec<(u64, JobId)> = state
        .jobs
        .values()
        .filter(|job| job.status == JobStatus::Succeeded && job.release.is_none())
        .filter(|job| !job.outputs.is_empty())
        .map(|job| (job.ended_at_ms.unwrap(), job.id))
        .collect();
    holding.sort();
    let expiring = holding
        .iter()
        .take_while(|(ended, _)| ended + 50 <= at_ms)
        .map(|(_, job)| *job)
        .collect();
    (old, expiring)
}

proptest::proptest! {
    /// After any history of commands, the indexes `apply` keeps (counts, unfinished,
    /// drivers, ended, holding outputs, actors by job) equal the ones computed from the jobs
    /// and actors alone; no actor outlives its job's run; a copy
    /// taken earlier is untouched by the later writes (the maps share structure); an
    /// encoding that copies the last one's unchanged chunks is the whole state's, cut as one
    /// from scratch, even from a state decoded meanwhile; and the snapshot
    /// round-trips.
    #[test]
    fn the_indexes_apply_keeps_equal_a_scan_of_the_jobs(
        steps in proptest::collection::vec(step(), 1..120)
    ) {
        let mut state = ClusterState::default();
        let mut copies = Vec::new();
        let mut encoded = EncodedState::default();
        for (index, step) in steps.iter().enumerate() {
            let at_ms = index as u64 * 10;
            let command = command_of(step, &state, at_ms);
            if index % 16 == 0 {
                copies.push((state.clone(), state.encode().unwrap()));
            }
            state.apply(index as u64 + 1, at_ms, command).unwrap();
            let mut scanned = state.clone();
            scanned.reindex();
            proptest::prop_assert_eq!(&scanned, &state);
            for actor in state.actors.values() {
                proptest::prop_assert!(state.jobs[&actor.job].status == JobStatus::Running);
            }
            let mut counted = BTreeMap::new();
            for job in state.jobs.values() {
                *counted.entry(job.status.name()).or_insert(0u64) += 1;
            }
            for (name, count) in state.job_counts.by_name() {
                proptest::prop_assert_eq!(counted.get(name).copied().unwrap_or(0), count);
            }
            proptest::prop_assert_eq!(state.job_counts.total(), state.jobs.len() as u64);
            let (old, expiring) = due_by_scan(&state, at_ms);
            proptest::prop_assert_eq!(state.jobs_due_for_history(u64::MAX, 50, at_ms), old);
            proptest::prop_assert_eq!(state.outputs_due_to_expire(50, at_ms), expiring);
            if index % 4 == 0 {
                encoded = state.encode_reusing(&encoded).unwrap();
                assert_tiles_the_encoding(&encoded, &state);
                // Cut where an encoding from scratch cuts.
                let scratch = state.encode_reusing(&EncodedState::default()).unwrap();
                proptest::prop_assert_eq!(encoded.pieces(), scratch.pieces());
            }
            if index % 16 == 7 {
                // A state that shares no structure with the last encoding's (a snapshot
                // installed meanwhile) is still encoded right from it.
                state = ClusterState::decode(&state.encode().unwrap()).unwrap();
            }
        }
        for (copy, encoded) in copies {
            proptest::prop_assert_eq!(copy.encode().unwrap(), encoded);
        }
        let decoded = ClusterState::decode(&state.encode().unwrap()).unwrap();
        proptest::prop_assert_eq!(decoded, state);
    }
}
