use proptest::prelude::{prop_assert_eq, proptest};
use proptest::strategy::Strategy as _;

use super::*;
use crate::placement::Strategy;

const TTL: Duration = Duration::from_secs(5);
const GIB: u64 = 1 << 30;
const DRIVER: NodeId = NodeId::new(100);

fn node(id: u64) -> NodeId {
    NodeId::new(id)
}

fn job(id: u64) -> JobId {
    JobId::new(id)
}

fn cpus(cpus: u64, heap: u64) -> Resources {
    Resources {
        cpu_millis: cpus * 1000,
        heap_bytes: heap,
    }
}

fn table(nodes: u64, cpus_each: u64, now: Instant) -> LeaseTable {
    let mut table = LeaseTable::new(TTL, now);
    for id in 1..=nodes {
        table.upsert_node(node(id), cpus(cpus_each, 4 * GIB));
    }
    table
}

fn request(strategy: Strategy) -> PlacementRequest {
    PlacementRequest {
        cpu_millis: 1000,
        memory_hint: 0,
        strategy,
        preferred: Vec::new(),
        requester: None,
    }
}

fn reserved(table: &LeaseTable, id: u64) -> Resources {
    table
        .view()
        .used(node(id))
        .expect("the node is in the view")
}

/// The sum of the leases on each node, computed from the leases themselves.
fn sums(table: &LeaseTable, nodes: u64) -> Vec<Resources> {
    (1..=nodes)
        .map(|id| {
            let mut sum = Resources::default();
            for summary in table.on_node(node(id)) {
                sum.cpu_millis += summary.resources.cpu_millis;
                sum.heap_bytes += summary.resources.heap_bytes;
            }
            sum
        })
        .collect()
}

#[test]
fn a_grant_reserves_its_request_where_the_policy_puts_it_and_a_return_gives_it_back() {
    let now = Instant::now();
    let mut table = table(2, 2, now);
    let mut hinted = request(Strategy::Spread);
    hinted.memory_hint = GIB;
    let first = table.grant(job(1), DRIVER, &hinted, now).unwrap().unwrap();
    let second = table.grant(job(1), DRIVER, &hinted, now).unwrap().unwrap();
    // SPREAD: one on each node, each reserving one CPU and its hint.
    assert_ne!(first.node, second.node);
    assert_eq!(first.resources, cpus(1, GIB));
    assert_eq!(reserved(&table, 1), cpus(1, GIB));
    assert_eq!(reserved(&table, 2), cpus(1, GIB));
    // Another job cannot return it; its own driver can, once.
    assert!(!table.give_back(job(2), DRIVER, first.id));
    assert!(!table.give_back(job(1), node(7), first.id));
    assert!(table.give_back(job(1), DRIVER, first.id));
    assert!(!table.give_back(job(1), DRIVER, first.id));
    assert_eq!(reserved(&table, first.node.get()), Resources::default());
    assert_eq!(table.of_job(job(1)), vec![second]);
}

#[test]
fn a_request_that_fits_nowhere_now_waits_and_one_that_never_fits_is_refused() {
    let now = Instant::now();
    let mut table = table(1, 2, now);
    let one = request(Strategy::Default);
    assert!(table.grant(job(1), DRIVER, &one, now).unwrap().is_some());
    assert!(table.grant(job(1), DRIVER, &one, now).unwrap().is_some());
    assert_eq!(table.grant(job(1), DRIVER, &one, now), Ok(None));
    let mut huge = one.clone();
    huge.cpu_millis = 3000;
    assert!(matches!(
        table.grant(job(1), DRIVER, &huge, now),
        Err(PlacementError::Infeasible { .. })
    ));
}

#[test]
fn renewed_leases_live_on_and_unrenewed_ones_expire_after_their_ttl() {
    let start = Instant::now();
    let mut table = table(1, 4, start);
    let kept = table
        .grant(job(1), DRIVER, &request(Strategy::Spread), start)
        .unwrap()
        .unwrap();
    let dropped = table
        .grant(job(1), DRIVER, &request(Strategy::Spread), start)
        .unwrap()
        .unwrap();
    let later = start + TTL / 2;
    assert_eq!(
        table.renew(job(1), DRIVER, &kept, later),
        LeaseStanding::Held
    );
    // Only its driver renews it, and only as it was granted.
    assert_eq!(
        table.renew(job(1), node(7), &kept, later),
        LeaseStanding::Revoked
    );
    let inflated = Lease {
        resources: cpus(4, 0),
        ..kept
    };
    assert_eq!(
        table.renew(job(1), DRIVER, &inflated, later),
        LeaseStanding::Revoked
    );
    assert_eq!(table.expire(start + TTL), vec![dropped]);
    assert!(table.holds(kept.id) && !table.holds(dropped.id));
    assert_eq!(reserved(&table, 1), cpus(1, 0));
    // Without re-assertion (no leader change), an expired lease stays gone.
    assert_eq!(
        table.renew(job(1), DRIVER, &dropped, later),
        LeaseStanding::Revoked
    );
    assert_eq!(table.expire(later + TTL), vec![kept]);
    assert_eq!(reserved(&table, 1), Resources::default());
}

#[test]
fn leases_are_revoked_with_their_node_their_job_or_their_drivers_node() {
    let now = Instant::now();
    let mut table = table(3, 4, now);
    let spread = request(Strategy::Spread);
    let other_driver = node(101);
    let a: Vec<Lease> = (0..3)
        .map(|_| table.grant(job(1), DRIVER, &spread, now).unwrap().unwrap())
        .collect();
    let b: Vec<Lease> = (0..3)
        .map(|_| {
            table
                .grant(job(2), other_driver, &spread, now)
                .unwrap()
                .unwrap()
        })
        .collect();
    let on_3: Vec<Lease> = a
        .iter()
        .chain(&b)
        .filter(|l| l.node == node(3))
        .copied()
        .collect();
    let mut gone = table.remove_node(node(3));
    gone.sort_by_key(|lease| lease.id);
    let mut expected = on_3.clone();
    expected.sort_by_key(|lease| lease.id);
    assert_eq!(gone, expected);
    assert_eq!(table.revoke_job(job(1)).len(), 2);
    assert_eq!(table.revoke_driver(other_driver).len(), 2);
    assert!(table.is_empty());
    assert_eq!(reserved(&table, 1), Resources::default());
    assert_eq!(reserved(&table, 2), Resources::default());
}

#[test]
fn a_new_leader_grants_nothing_until_drivers_reasserted_what_they_hold() {
    let start = Instant::now();
    let mut old = table(1, 2, start);
    let held = old
        .grant(job(1), DRIVER, &request(Strategy::Spread), start)
        .unwrap()
        .unwrap();
    // The new leader's view is empty until the node heartbeats to it.
    let mut new = LeaseTable::new_leader(TTL, start);
    let grace = new.renew_interval() * GRACE_RENEWALS;
    assert_eq!(
        new.grant(job(2), DRIVER, &request(Strategy::Spread), start),
        Ok(None)
    );
    // The driver re-asserts before the node's first heartbeat: the node joins with it reserved.
    assert_eq!(new.renew(job(1), DRIVER, &held, start), LeaseStanding::Held);
    new.upsert_node(node(1), cpus(2, 4 * GIB));
    assert_eq!(reserved(&new, 1), cpus(1, 0));
    // A second renewal is a renewal, not a second reservation.
    assert_eq!(new.renew(job(1), DRIVER, &held, start), LeaseStanding::Held);
    assert_eq!(reserved(&new, 1), cpus(1, 0));
    // After the grace, the free CPU is granted, and only it.
    let after = start + grace;
    let granted = new
        .grant(job(2), node(101), &request(Strategy::Spread), after)
        .unwrap();
    assert!(granted.is_some());
    assert_eq!(
        new.grant(job(2), node(101), &request(Strategy::Spread), after),
        Ok(None)
    );
    assert_eq!(reserved(&new, 1), cpus(2, 0));
    // Past one TTL, an unknown lease is not taken in any more.
    let stale = Lease {
        id: LeaseId::random(),
        ..held
    };
    assert_eq!(
        new.renew(job(1), DRIVER, &stale, start + TTL),
        LeaseStanding::Revoked
    );
    assert_eq!(reserved(&new, 1), cpus(2, 0));
}

#[test]
fn a_waiting_job_recalls_the_oldest_leases_of_the_job_holding_more_until_they_are_even() {
    let now = Instant::now();
    let mut table = table(2, 2, now);
    let spread = request(Strategy::Spread);
    let hog: Vec<Lease> = (0..4)
        .map(|_| table.grant(job(1), DRIVER, &spread, now).unwrap().unwrap())
        .collect();
    assert_eq!(table.grant(job(2), node(101), &spread, now), Ok(None));
    // Job 2 holds nothing and job 1 all four CPUs: job 1's oldest lease is recalled.
    assert_eq!(table.recall_for(job(2), &spread, now), Some(hog[0].id));
    assert_eq!(
        table.renew(job(1), DRIVER, &hog[0], now),
        LeaseStanding::Recalled
    );
    assert_eq!(
        table.renew(job(1), DRIVER, &hog[1], now),
        LeaseStanding::Held
    );
    // A recalled lease stays reserved until its driver returns it.
    assert_eq!(table.grant(job(2), node(101), &spread, now), Ok(None));
    assert!(table.give_back(job(1), DRIVER, hog[0].id));
    assert!(
        table
            .grant(job(2), node(101), &spread, now)
            .unwrap()
            .is_some()
    );
    // 3 against 1: one more is recalled; at 2 against 2, nothing.
    assert_eq!(table.recall_for(job(2), &spread, now), Some(hog[1].id));
    assert!(table.give_back(job(1), DRIVER, hog[1].id));
    assert!(
        table
            .grant(job(2), node(101), &spread, now)
            .unwrap()
            .is_some()
    );
    assert_eq!(table.recall_for(job(2), &spread, now), None);
    assert_eq!(table.recall_for(job(1), &spread, now), None);
}

#[test]
fn a_recall_for_a_hard_affinity_request_takes_a_lease_on_that_node() {
    let now = Instant::now();
    let mut table = table(2, 2, now);
    let spread = request(Strategy::Spread);
    let hog: Vec<Lease> = (0..4)
        .map(|_| table.grant(job(1), DRIVER, &spread, now).unwrap().unwrap())
        .collect();
    let pinned = request(Strategy::NodeAffinity {
        node: node(2),
        soft: false,
    });
    let recalled = table.recall_for(job(2), &pinned, now).unwrap();
    let lease = hog.iter().find(|lease| lease.id == recalled).unwrap();
    assert_eq!(lease.node, node(2));
}

/// One step of a random history of the leader's lease table.
#[derive(Debug, Clone)]
enum Step {
    Grant { job: u64, cpus: u64, heap: u64 },
    Renew { lease: usize },
    Return { lease: usize },
    Recall { job: u64 },
    Expire,
    Later,
    KillNode { node: u64 },
    RejoinNode { node: u64 },
    EndJob { job: u64 },
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    proptest::prop_oneof![
        (1..4u64, 0..3u64, 0..3u64).prop_map(|(job, cpus, heap)| Step::Grant { job, cpus, heap }),
        (0..32usize).prop_map(|lease| Step::Renew { lease }),
        (0..32usize).prop_map(|lease| Step::Return { lease }),
        (1..4u64).prop_map(|job| Step::Recall { job }),
        proptest::strategy::Just(Step::Expire),
        proptest::strategy::Just(Step::Later),
        (1..4u64).prop_map(|node| Step::KillNode { node }),
        (1..4u64).prop_map(|node| Step::RejoinNode { node }),
        (1..4u64).prop_map(|job| Step::EndJob { job }),
    ]
}

proptest! {
    /// Whatever happens, each node's reservation is the sum of its leases, and nothing is left
    /// reserved once every job ended.
    #[test]
    fn reservations_always_equal_the_leases_and_end_at_zero(
        steps in proptest::collection::vec(step(), 1..80)
    ) {
        const NODES: u64 = 3;
        let start = Instant::now();
        let mut now = start;
        let mut table = LeaseTable::new_leader(TTL, start);
        for id in 1..=NODES {
            table.upsert_node(node(id), cpus(4, 4 * GIB));
        }
        let mut granted: Vec<Lease> = Vec::new();
        for step in steps {
            match step {
                Step::Grant { job: id, cpus: c, heap } => {
                    let mut asked = request(Strategy::Spread);
                    asked.cpu_millis = c * 1000;
                    asked.memory_hint = heap * GIB;
                    if let Ok(Some(lease)) = table.grant(job(id), DRIVER, &asked, now) {
                        granted.push(lease);
                    }
                }
                Step::Renew { lease } => {
                    if let Some(lease) = granted.get(lease) {
                        table.renew(lease.job, DRIVER, lease, now);
                    }
                }
                Step::Return { lease } => {
                    if let Some(lease) = granted.get(lease) {
                        table.give_back(lease.job, DRIVER, lease.id);
                    }
                }
                Step::Recall { job: id } => {
                    table.recall_for(job(id), &request(Strategy::Spread), now);
                }
                Step::Expire => {
                    table.expire(now);
                }
                Step::Later => now += TTL / 3,
                Step::KillNode { node: id } => {
                    table.remove_node(node(id));
                }
                Step::RejoinNode { node: id } => table.upsert_node(node(id), cpus(4, 4 * GIB)),
                Step::EndJob { job: id } => {
                    table.revoke_job(job(id));
                }
            }
            for id in 1..=NODES {
                if let Some(used) = table.view().used(node(id)) {
                    prop_assert_eq!(used, sums(&table, NODES)[id as usize - 1]);
                }
            }
        }
        for id in 1..4 {
            table.revoke_job(job(id));
        }
        prop_assert_eq!(table.len(), 0);
        for id in 1..=NODES {
            if let Some(used) = table.view().used(node(id)) {
                prop_assert_eq!(used, Resources::default());
            }
        }
    }
}
