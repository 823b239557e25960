//! The driver's local view of its leases, without a cluster: placing inside leases by the
//! leader's policy, and which leases go back when.

use super::*;
use floe_api::lease::LeaseTable;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn node(id: u64) -> NodeId {
    NodeId::new(id)
}

fn lease(id: u128, on: u64, cpus: u64, heap: u64) -> Lease {
    Lease {
        id: LeaseId::new(id),
        job: JobId::new(1),
        node: node(on),
        resources: Resources {
            cpu_millis: cpus * 1000,
            heap_bytes: heap,
        },
    }
}

fn task(strategy: Strategy) -> PlacementRequest {
    PlacementRequest {
        cpu_millis: 1000,
        memory_hint: 0,
        strategy,
        preferred: Vec::new(),
        requester: None,
    }
}

fn one_cpu(heap: u64) -> Resources {
    Resources {
        cpu_millis: 1000,
        heap_bytes: heap,
    }
}

#[test]
fn tasks_spread_over_the_leases_and_wait_when_every_one_is_full() {
    let mut book = LeaseBook::new();
    book.add(lease(1, 1, 1, 0));
    book.add(lease(2, 2, 1, 0));
    book.add(lease(3, 2, 1, 0));
    let spread = task(Strategy::Spread);
    let mut placed: Vec<u64> = (0..3)
        .map(|_| book.place(&spread, Reach::FirstChoice).unwrap().get())
        .collect();
    placed.sort_unstable();
    assert_eq!(placed, [1, 2, 2]);
    assert_eq!(book.place(&spread, Reach::FirstChoice), None);
    book.free(node(2), one_cpu(0));
    assert_eq!(book.place(&spread, Reach::FirstChoice), Some(node(2)));
    // A memory hint fits only where the leases hold that much heap.
    book.add(lease(4, 1, 1, GIB));
    let mut hinted = task(Strategy::Spread);
    hinted.memory_hint = 2 * GIB;
    assert_eq!(book.place(&hinted, Reach::FirstChoice), None);
    hinted.memory_hint = GIB;
    assert_eq!(book.place(&hinted, Reach::FirstChoice), Some(node(1)));
}

#[test]
fn a_task_the_policy_wants_elsewhere_asks_the_leader_instead_of_using_a_lease() {
    let mut book = LeaseBook::new();
    book.add(lease(1, 1, 4, 0));
    // Its input lies on node 2, which the job holds no lease on.
    let mut local = task(Strategy::Default);
    local.preferred = vec![(node(2), 100), (node(1), 10)];
    assert_eq!(book.place(&local, Reach::FirstChoice), None);
    // Once the leader had no room on node 2, any lease will do.
    assert_eq!(book.place(&local, Reach::Anywhere), Some(node(1)));
    local.preferred = vec![(node(1), 100), (node(2), 10)];
    assert_eq!(book.place(&local, Reach::FirstChoice), Some(node(1)));
    // Affinity, soft or hard, is to that node only here.
    for soft in [true, false] {
        let pinned = task(Strategy::NodeAffinity {
            node: node(2),
            soft,
        });
        assert_eq!(book.place(&pinned, Reach::FirstChoice), None);
    }
    let soft = task(Strategy::NodeAffinity {
        node: node(2),
        soft: true,
    });
    assert_eq!(book.place(&soft, Reach::Anywhere), Some(node(1)));
    let hard = task(Strategy::NodeAffinity {
        node: node(2),
        soft: false,
    });
    assert_eq!(book.place(&hard, Reach::Anywhere), None);
}

#[test]
fn a_recalled_lease_takes_no_new_task_and_goes_back_once_the_node_use_fits_the_rest() {
    let mut book = LeaseBook::new();
    book.add(lease(1, 1, 1, 0));
    book.add(lease(2, 1, 1, 0));
    let spread = task(Strategy::Spread);
    assert_eq!(book.place(&spread, Reach::FirstChoice), Some(node(1)));
    assert_eq!(book.place(&spread, Reach::FirstChoice), Some(node(1)));
    book.recall(LeaseId::new(1));
    // Two tasks run in what is now one lease's capacity: nothing new goes in, nothing goes back.
    assert_eq!(book.capacity(node(1)), one_cpu(0));
    assert!(book.returnable().is_empty());
    book.free(node(1), one_cpu(0));
    assert_eq!(book.place(&spread, Reach::FirstChoice), None);
    assert_eq!(book.returnable(), vec![LeaseId::new(1)]);
    assert_eq!(book.len(), 1);
    // The other lease still holds the running task.
    assert!(book.idle().is_empty());
}

#[test]
fn leases_beyond_the_last_intervals_peak_go_back_and_the_peak_starts_again() {
    let mut book = LeaseBook::new();
    for id in 1..=4 {
        book.add(lease(id, 1, 1, 0));
    }
    let spread = task(Strategy::Spread);
    for _ in 0..3 {
        book.place(&spread, Reach::FirstChoice).unwrap();
    }
    book.free(node(1), one_cpu(0));
    book.free(node(1), one_cpu(0));
    // Three ran at once this interval: the fourth lease goes back.
    assert_eq!(book.idle().len(), 1);
    assert_eq!(book.len(), 3);
    // The next interval's peak is the one task still running: two more go back.
    assert_eq!(book.idle().len(), 2);
    // It ran during the next interval too, so its lease stays for one more.
    book.free(node(1), one_cpu(0));
    assert!(book.idle().is_empty());
    assert_eq!(book.idle().len(), 1);
    assert!(book.is_empty());
    assert_eq!(book.used(node(1)), Resources::default());
}

#[test]
fn a_dead_nodes_leases_are_forgotten_and_its_tasks_freeing_late_change_nothing() {
    let mut book = LeaseBook::new();
    book.add(lease(1, 1, 1, 0));
    book.add(lease(2, 2, 1, 0));
    let spread = task(Strategy::Spread);
    let first = book.place(&spread, Reach::FirstChoice).unwrap();
    assert_eq!(book.forget_node(first), 1);
    book.free(first, one_cpu(0));
    assert_eq!(book.len(), 1);
    let others: Vec<NodeId> = book.all().iter().map(|lease| lease.node).collect();
    assert!(!others.contains(&first));
    assert_ne!(book.place(&spread, Reach::FirstChoice), Some(first));
    assert_eq!(book.drain().len(), 1);
    assert!(book.is_empty());
}

/// A leader that answers an ask only once the test lets it, granting one lease per request,
/// and records what comes back.
#[derive(Default)]
struct GatedLeader {
    gate: Notify,
    asked: Notify,
    returned: Mutex<Vec<LeaseId>>,
}

impl LeaseService for GatedLeader {
    async fn acquire_leases(
        &self,
        job: JobId,
        requests: Vec<PlacementRequest>,
        _wait: Duration,
    ) -> Result<LeaseGrants> {
        self.asked.notify_one();
        self.gate.notified().await;
        let decisions = (0..requests.len())
            .map(|index| {
                let mut granted = lease(100 + index as u128, 1, 1, 0);
                granted.job = job;
                LeaseDecision::Granted(granted)
            })
            .collect();
        Ok(LeaseGrants {
            decisions,
            renew_ms: 1_000,
        })
    }

    async fn renew_leases(&self, _job: JobId, leases: Vec<Lease>) -> Result<Vec<LeaseStanding>> {
        Ok(leases.iter().map(|_| LeaseStanding::Held).collect())
    }

    async fn return_leases(&self, _job: JobId, leases: Vec<LeaseId>) -> Result<()> {
        self.returned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(leases);
        Ok(())
    }
}

#[tokio::test]
async fn a_lease_granted_to_an_ask_out_at_close_goes_back_before_close_returns() {
    let leader = Arc::new(GatedLeader::default());
    let leases = Arc::new(JobLeases::new(Arc::clone(&leader), JobId::new(1)));
    let placing = tokio::spawn({
        let leases = Arc::clone(&leases);
        async move { leases.place(task(Strategy::Spread)).await.map(|_| ()) }
    });
    leader.asked.notified().await;
    let closing = tokio::spawn({
        let leases = Arc::clone(&leases);
        async move { leases.close().await }
    });
    // The waiting task is refused at once; close waits for the ask still out.
    assert!(matches!(placing.await.unwrap(), Err(Error::LeasesClosed)));
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!closing.is_finished());
    leader.gate.notify_one();
    closing.await.unwrap();
    let returned = leader
        .returned
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    assert_eq!(returned, [LeaseId::new(100)]);
    assert_eq!(leases.stats().returned, 1);
}

#[test]
fn a_task_lacking_only_heap_where_its_cpu_is_leased_asks_for_that_heap_alone() {
    let mut book = LeaseBook::new();
    book.add(lease(1, 1, 2, 600 * MIB));
    let mut hinted = task(Strategy::Default);
    hinted.memory_hint = 300 * MIB;
    assert_eq!(book.place(&hinted, Reach::FirstChoice), Some(node(1)));
    let mut bigger = hinted.clone();
    bigger.memory_hint = 400 * MIB;
    assert_eq!(book.place(&bigger, Reach::FirstChoice), None);
    let heap_only = |lacking: u64| {
        Ask::Heap(PlacementRequest {
            cpu_millis: 0,
            memory_hint: lacking,
            strategy: Strategy::NodeAffinity {
                node: node(1),
                soft: false,
            },
            preferred: Vec::new(),
            requester: None,
        })
    };
    // One CPU is free with 300 MiB: the first waiter asks for its last 100 MiB; the second
    // finds no CPU left and asks for all of its need; one that may no longer ask for heap
    // alone asks for its whole need too.
    let asks = book.asks([
        (&bigger, Reach::FirstChoice, true),
        (&bigger, Reach::FirstChoice, true),
        (&bigger, Reach::FirstChoice, false),
    ]);
    assert_eq!(
        asks,
        [
            heap_only(100 * MIB),
            Ask::Whole(bigger.clone()),
            Ask::Whole(bigger.clone())
        ]
    );
    // Asking changed nothing; once granted, the heap makes room for the task.
    assert_eq!(book.place(&bigger, Reach::FirstChoice), None);
    book.add(Lease {
        resources: Resources {
            cpu_millis: 0,
            heap_bytes: 100 * MIB,
        },
        ..lease(2, 1, 0, 0)
    });
    assert_eq!(book.place(&bigger, Reach::FirstChoice), Some(node(1)));
    // With no CPU free anywhere, nothing but the whole need can be asked for.
    assert_eq!(
        book.asks([(&bigger, Reach::FirstChoice, true)]),
        [Ask::Whole(bigger.clone())]
    );
}

/// A leader with one node of two CPUs and plenty of heap, granting from the leader's own
/// `LeaseTable`: what fits at once, `NotNow` otherwise. It records every request.
struct OneNodeLeader {
    table: Mutex<LeaseTable>,
    asked: Mutex<Vec<PlacementRequest>>,
}

/// The node the one-node leader's leases are on, which also runs the driver.
const LEADER_NODE: u64 = 1;

impl OneNodeLeader {
    fn new() -> Self {
        let mut table = LeaseTable::new(Duration::from_secs(60), std::time::Instant::now());
        table.upsert_node(
            node(LEADER_NODE),
            Resources {
                cpu_millis: 2000,
                heap_bytes: 8 * GIB,
            },
        );
        Self {
            table: Mutex::new(table),
            asked: Mutex::new(Vec::new()),
        }
    }
}

impl LeaseService for OneNodeLeader {
    async fn acquire_leases(
        &self,
        job: JobId,
        requests: Vec<PlacementRequest>,
        _wait: Duration,
    ) -> Result<LeaseGrants> {
        // An answer without a pause would let an asking loop hold the test's one thread.
        tokio::task::yield_now().await;
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let now = std::time::Instant::now();
        let decisions = requests
            .iter()
            .map(
                |request| match table.grant(job, node(LEADER_NODE), request, now) {
                    Ok(Some(lease)) => LeaseDecision::Granted(lease),
                    Ok(None) => LeaseDecision::NotNow,
                    Err(error) => LeaseDecision::Refused(error),
                },
            )
            .collect();
        self.asked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(requests);
        Ok(LeaseGrants {
            decisions,
            renew_ms: 60_000,
        })
    }

    async fn renew_leases(&self, _job: JobId, leases: Vec<Lease>) -> Result<Vec<LeaseStanding>> {
        Ok(leases.iter().map(|_| LeaseStanding::Held).collect())
    }

    async fn return_leases(&self, job: JobId, leases: Vec<LeaseId>) -> Result<()> {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        for id in leases {
            table.give_back(job, node(LEADER_NODE), id);
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_task_needing_more_heap_than_its_leases_hold_starts_beside_the_running_one() {
    let leader = Arc::new(OneNodeLeader::new());
    let leases = JobLeases::new(Arc::clone(&leader), JobId::new(1));
    let with_hint = |hint: u64| PlacementRequest {
        memory_hint: hint,
        ..task(Strategy::Default)
    };
    let first = leases.place(with_hint(300 * MIB)).await.unwrap();
    let second = leases.place(with_hint(300 * MIB)).await.unwrap();
    drop(second);
    // The job's leases hold both CPUs and 600 MiB, one task runs in them: a 400 MiB task
    // gets the missing 100 MiB and starts now, not when the running task ends.
    let bigger = tokio::time::timeout(Duration::from_secs(5), leases.place(with_hint(400 * MIB)))
        .await
        .expect("placed while the first task still runs")
        .unwrap();
    assert_eq!(bigger.node(), node(1));
    let asked = leader
        .asked
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let last = asked.last().unwrap();
    assert_eq!((last.cpu_millis, last.memory_hint), (0, 100 * MIB));
    drop((first, bigger));
    leases.close().await;
}
