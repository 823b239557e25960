//! Jobs' placement leases through real replicas over RPC: grants, waits, renewals, returns,
//! expiry, recalls between jobs, revocation at a job's end, and a leader change.

use tokio::task::JoinHandle;

use super::*;
use floe_api::lease::{Lease, LeaseDecision, LeaseGrants, LeaseStanding};
use floe_core::JobId;

/// Leases live one node timeout (under `MAX_LEASE_TTL`): heartbeats every 20 ms, 25 missed, so
/// 500 ms.
fn lease_config() -> Config {
    let mut config = test_config();
    config.scheduler.heartbeat_interval_ms = 20;
    config.scheduler.missed_heartbeats = 25;
    config
}

fn ttl(config: &Config) -> Duration {
    config.scheduler.lease_ttl()
}

/// Replicas, a worker node with 2 CPUs, and a node with nothing to lease that drives `jobs`.
struct Driving {
    replicas: Vec<Replica>,
    client: SchedulerClient,
    worker: NodeId,
    driver_wire: WireConfig,
    jobs: Vec<JobId>,
    beating: Vec<JoinHandle<()>>,
}

impl Drop for Driving {
    fn drop(&mut self) {
        for beat in &self.beating {
            beat.abort();
        }
    }
}

/// Heartbeats for `node` until aborted, following the leader.
fn keep_alive(replicas: &[Replica], node: NodeId, wire: WireConfig) -> JoinHandle<()> {
    let mut client = SchedulerClient::new(addrs_of(replicas), wire).unwrap();
    tokio::spawn(async move {
        loop {
            let _ = client.heartbeat(node, ResourceUsage::default()).await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
}

async fn driving(config: &Config, replica_count: u64, job_count: usize) -> Driving {
    let (replicas, mut client) = start_cluster(config, replica_count).await;
    let (driver, driver_wire) =
        register_node_wire(config, &replicas, NodeAddresses::default(), resources(0, 0)).await;
    let mut beating = vec![keep_alive(&replicas, driver, driver_wire.clone())];
    // The driver's node is the only one heard from, so it drives every job.
    let mut jobs = Vec::new();
    for n in 0..job_count {
        let job = client
            .submit_job(vec![n as u8], floe_core::SubmissionId::random(), None)
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while client.read_state().await.unwrap().jobs[&job].driver != Some(driver) {
            assert!(Instant::now() < deadline, "job {job} got no driver");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        jobs.push(job);
    }
    let (worker, worker_wire) = register_node_wire(
        config,
        &replicas,
        NodeAddresses::default(),
        resources(2, 1 << 30),
    )
    .await;
    beating.push(keep_alive(&replicas, worker, worker_wire));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !client.node_reports().await.unwrap().contains_key(&worker) {
        assert!(Instant::now() < deadline, "the worker never heartbeated");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Driving {
        replicas,
        client,
        worker,
        driver_wire,
        jobs,
        beating,
    }
}

impl Driving {
    /// A client speaking as the driver's node.
    fn as_driver(&self) -> SchedulerClient {
        SchedulerClient::new(addrs_of(&self.replicas), self.driver_wire.clone()).unwrap()
    }

    async fn reserved(&mut self) -> Resources {
        self.client.node_reports().await.unwrap()[&self.worker].reserved
    }
}

fn one_cpu() -> PlacementRequest {
    PlacementRequest {
        cpu_millis: 1000,
        memory_hint: 0,
        strategy: Strategy::Spread,
        preferred: Vec::new(),
        requester: None,
    }
}

fn granted(grants: &LeaseGrants) -> Vec<Lease> {
    grants
        .decisions
        .iter()
        .filter_map(|decision| match decision {
            LeaseDecision::Granted(lease) => Some(*lease),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_is_granted_leases_renews_and_returns_them_and_unrenewed_ones_expire() {
    let config = lease_config();
    let mut cluster = driving(&config, 1, 1).await;
    let job = cluster.jobs[0];
    let mut driver = cluster.as_driver();
    let grants = driver
        .acquire_leases(job, vec![one_cpu(); 2], Duration::from_secs(5))
        .await
        .unwrap();
    let leases = granted(&grants);
    assert_eq!(leases.len(), 2);
    assert!(leases.iter().all(|lease| lease.node == cluster.worker
        && lease.job == job
        && lease.resources == resources(1, 0)));
    assert_eq!(
        Duration::from_millis(grants.renew_ms),
        ttl(&config) / floe_api::lease::RENEWALS_PER_TTL
    );
    let report = cluster.client.node_reports().await.unwrap()[&cluster.worker].clone();
    assert_eq!(report.reserved, resources(2, 0));
    assert_eq!(report.leases.len(), 1);
    assert_eq!((report.leases[0].job, report.leases[0].leases), (job, 2));

    // The worker is full: a third waits its whole wait, then is told to ask again.
    let asked = Instant::now();
    let grants = driver
        .acquire_leases(job, vec![one_cpu()], Duration::from_millis(150))
        .await
        .unwrap();
    assert_eq!(grants.decisions, vec![LeaseDecision::NotNow]);
    assert!(asked.elapsed() >= Duration::from_millis(140));
    // Asking for more than a node has is refused at once.
    let mut huge = one_cpu();
    huge.cpu_millis = 3000;
    let grants = driver
        .acquire_leases(job, vec![huge], Duration::from_secs(5))
        .await
        .unwrap();
    assert!(matches!(
        grants.decisions.as_slice(),
        [LeaseDecision::Refused(PlacementError::Infeasible { .. })]
    ));

    assert_eq!(
        driver.renew_leases(job, leases.clone()).await.unwrap(),
        vec![LeaseStanding::Held; 2]
    );
    driver.return_leases(job, vec![leases[0].id]).await.unwrap();
    assert_eq!(cluster.reserved().await, resources(1, 0));
    // The other is never renewed again: it expires after its TTL.
    tokio::time::sleep(ttl(&config) * 2).await;
    assert_eq!(cluster.reserved().await, Resources::default());
    assert_eq!(
        driver.renew_leases(job, vec![leases[1]]).await.unwrap(),
        vec![LeaseStanding::Revoked]
    );
    // Another node may not return or renew the driver's leases.
    let (other, other_wire) = register_node_wire(
        &config,
        &cluster.replicas,
        NodeAddresses::default(),
        resources(0, 0),
    )
    .await;
    let mut other_client = SchedulerClient::new(addrs_of(&cluster.replicas), other_wire).unwrap();
    let refused = other_client
        .acquire_leases(job, vec![one_cpu()], Duration::ZERO)
        .await;
    assert!(
        refused.is_err(),
        "node {other} was granted job {job}'s lease"
    );
    assert!(other_client.renew_leases(job, leases).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_job_gets_a_lease_recalled_from_the_job_holding_every_cpu() {
    let config = lease_config();
    let mut cluster = driving(&config, 1, 2).await;
    let (hog, waiter) = (cluster.jobs[0], cluster.jobs[1]);
    let mut driver = cluster.as_driver();
    let held = granted(
        &driver
            .acquire_leases(hog, vec![one_cpu(); 2], Duration::from_secs(5))
            .await
            .unwrap(),
    );
    assert_eq!(held.len(), 2);
    let mut waiting_driver = cluster.as_driver();
    let waiting = tokio::spawn(async move {
        waiting_driver
            .acquire_leases(waiter, vec![one_cpu()], Duration::from_secs(5))
            .await
    });
    // The hog keeps renewing, and learns which lease is wanted back.
    let deadline = Instant::now() + Duration::from_secs(5);
    let recalled = loop {
        let standings = driver.renew_leases(hog, held.clone()).await.unwrap();
        if let Some(at) = standings
            .iter()
            .position(|standing| *standing == LeaseStanding::Recalled)
        {
            assert_eq!(
                standings
                    .iter()
                    .filter(|s| **s == LeaseStanding::Held)
                    .count(),
                1
            );
            break held[at];
        }
        assert!(Instant::now() < deadline, "nothing was recalled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // A recalled lease stays reserved until its driver returns it.
    assert!(!waiting.is_finished());
    assert_eq!(cluster.reserved().await, resources(2, 0));
    driver.return_leases(hog, vec![recalled.id]).await.unwrap();
    let grants = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiting job got nothing")
        .unwrap()
        .unwrap();
    let given = granted(&grants);
    assert_eq!(given.len(), 1);
    assert_eq!(given[0].job, waiter);
    // One CPU each now: nothing more is recalled for either.
    let report = cluster.client.node_reports().await.unwrap()[&cluster.worker].clone();
    assert_eq!(report.reserved, resources(2, 0));
    let per_job: Vec<(JobId, u32, u32)> = report
        .leases
        .iter()
        .map(|summary| (summary.job, summary.leases, summary.recalled))
        .collect();
    assert_eq!(per_job, vec![(hog, 1, 0), (waiter, 1, 0)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_end_revokes_its_leases() {
    let config = lease_config();
    let mut cluster = driving(&config, 1, 1).await;
    let job = cluster.jobs[0];
    let mut driver = cluster.as_driver();
    let leases = granted(
        &driver
            .acquire_leases(job, vec![one_cpu(); 2], Duration::from_secs(5))
            .await
            .unwrap(),
    );
    assert_eq!(cluster.reserved().await, resources(2, 0));
    let finish = Command::FinishJob {
        job,
        attempt: 1,
        outcome: JobOutcome {
            status: JobStatus::Succeeded,
            stats: floe_core::job::JobStats::default(),
            outputs: Vec::new(),
        },
    };
    assert_eq!(driver.propose(finish).await.unwrap(), Outcome::Applied);
    assert_eq!(cluster.reserved().await, Resources::default());
    assert_eq!(
        driver.renew_leases(job, leases).await.unwrap(),
        vec![LeaseStanding::Revoked; 2]
    );
    // And an ended job gets no new lease.
    assert!(
        driver
            .acquire_leases(job, vec![one_cpu()], Duration::ZERO)
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_counts_the_leases_drivers_reassert_once() {
    let config = lease_config();
    let mut cluster = driving(&config, 3, 1).await;
    let job = cluster.jobs[0];
    let mut driver = cluster.as_driver();
    let held = granted(
        &driver
            .acquire_leases(job, vec![one_cpu()], Duration::from_secs(5))
            .await
            .unwrap(),
    );
    assert_eq!(held.len(), 1);
    assert_eq!(cluster.reserved().await, resources(1, 0));

    let wire = WireConfig::client(&config);
    let leader = SchedulerClient::status_of(&cluster.replicas[0].local_addr().to_string(), wire)
        .await
        .unwrap()
        .leader
        .expect("a leader");
    let old_leader = cluster.replicas.remove(leader as usize - 1);
    drop(old_leader);

    // The driver keeps renewing, which re-asserts the lease to whoever leads now; the worker
    // joins the new leader's view with its next heartbeat.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let standings = driver.renew_leases(job, held.clone()).await.unwrap();
        assert_eq!(standings, vec![LeaseStanding::Held]);
        let reports = cluster.client.node_reports().await.unwrap();
        if let Some(report) = reports.get(&cluster.worker)
            && report.reserved == resources(1, 0)
        {
            assert_eq!(report.leases.len(), 1);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the new leader never counted the lease"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let new_leader = SchedulerClient::status_of(
        &cluster.replicas[0].local_addr().to_string(),
        WireConfig::client(&config),
    )
    .await
    .unwrap()
    .leader;
    assert_ne!(new_leader, Some(leader));

    // Two more are asked for, and only the one CPU left is granted: the re-asserted lease is
    // counted once, and not forgotten.
    let grants = driver
        .acquire_leases(job, vec![one_cpu(); 2], Duration::from_secs(5))
        .await
        .unwrap();
    let more = granted(&grants);
    assert_eq!(more.len(), 1);
    assert_eq!(grants.decisions[1], LeaseDecision::NotNow);
    assert_eq!(cluster.reserved().await, resources(2, 0));
    let all: Vec<_> = held.iter().chain(&more).map(|lease| lease.id).collect();
    driver.return_leases(job, all).await.unwrap();
    assert_eq!(cluster.reserved().await, Resources::default());
}
