//! A real cluster over TLS: three scheduler replicas (Raft between them over mutual TLS) and
//! two nodes (registration, tasks, and object transfer between them), a job with exact rows,
//! the REST API over HTTPS, and the clients TLS refuses.

use std::time::{Duration, Instant};

use floe_api::client::SchedulerClient;
use floe_client::{Client, Dataset, SortKey};
use floe_core::config::TlsConfig;
use floe_core::job::JobOptions;
use floe_core::wire::tls::generate_throwaway;
use floe_testkit::batches::int_column;
use floe_testkit::cluster::{FAST_ELECTIONS, TestCluster, TestClusterConfig};
use floe_testkit::http::{get_tls, wait_for};

/// Refusals must come from the handshake, well before the client's retry window (or a
/// connect timeout) would end the attempt.
const PROMPT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_runs_a_job_serves_https_and_refuses_plaintext_and_strangers() {
    let certificates = tempfile::tempdir().unwrap();
    let tls = generate_throwaway(certificates.path(), &[]).unwrap();
    let config = TestClusterConfig {
        replicas: 3,
        settings: vec![FAST_ELECTIONS.into(), "data.max_block_size=1MiB".into()],
        tls: tls.clone(),
        ..TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"))
    };
    let cluster = TestCluster::start(config, 2).await;
    let token = cluster.config.token().to_owned();

    // A sort moves every block between the two nodes: transfers go over TLS too.
    let n = 300_000i64;
    let dataset = Dataset::range(n as u64)
        .unwrap()
        .repartition(8)
        .unwrap()
        .sort(vec![SortKey::desc("id")])
        .unwrap();
    let record = cluster.run(&dataset, JobOptions::default()).await;
    let ids = int_column(&cluster.outputs(&record).await, "id");
    assert_eq!(ids, (0..n).rev().collect::<Vec<_>>());

    // HTTPS, verified against the CA; the monitor reached every replica over RPC.
    let http = cluster.schedulers.http_addr(1).unwrap().to_owned();
    let (ca, read_token) = (tls.ca.clone(), token.clone());
    // The HTTP server's view refreshes once a second: wait until it has seen the job end.
    let status = tokio::task::spawn_blocking(move || {
        wait_for("the job's end over HTTPS", Duration::from_secs(30), || {
            let response = get_tls(&http, "/api/cluster", &read_token, &ca).unwrap();
            assert_eq!(response.status, 200, "{}", response.body);
            let status = response.json();
            (status["jobs"]["succeeded"] == 1).then_some(status)
        })
    })
    .await
    .unwrap();
    assert_eq!(status["nodes"]["alive"], 2, "{status}");

    // A plaintext client is told TLS is required.
    let addrs = cluster.schedulers.addrs();
    let started = Instant::now();
    let plaintext = Client::connect(&addrs, &token).await.err().unwrap();
    assert!(
        plaintext.to_string().contains("requires TLS"),
        "{plaintext}"
    );
    assert!(started.elapsed() < PROMPT, "{:?}", started.elapsed());

    // A client trusting another CA refuses the servers' certificates.
    let strangers = tempfile::tempdir().unwrap();
    let other: TlsConfig = generate_throwaway(strangers.path(), &[]).unwrap();
    let started = Instant::now();
    let wrong_ca = Client::connect_tls(&addrs, &token, &other.ca)
        .await
        .err()
        .unwrap();
    assert!(
        wrong_ca.to_string().contains("invalid peer certificate"),
        "{wrong_ca}"
    );
    assert!(started.elapsed() < PROMPT, "{:?}", started.elapsed());

    // Someone who learned the cluster secret but holds no member certificate is no member:
    // the replicas refuse the secret without the certificate.
    let secret_alone = cluster
        .config
        .credentials
        .member_wire()
        .with_tls(&tls.client_only());
    let mut impostor = SchedulerClient::new(addrs.clone(), secret_alone).unwrap();
    let refused = impostor.alive_nodes().await.err().unwrap();
    assert!(
        refused.to_string().contains("presented no certificate"),
        "{refused}"
    );

    // Nothing of that changed the cluster: a second job is exact too.
    let again = Dataset::range(1_000).unwrap();
    let record = cluster.run(&again, JobOptions::default()).await;
    let ids = int_column(&cluster.outputs(&record).await, "id");
    assert_eq!(ids, (0..1_000).collect::<Vec<_>>());
}
