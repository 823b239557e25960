//! The JSON API over a synthetic cluster of 1,000 nodes and 10,000 jobs: filters and pages
//! are exact, and every call needs a token with its route's scope.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::Arc;

use actix_web::{App, test as actix_test, web};
use floe_core::auth::{ClientToken, Scopes, TokensFile};
use floe_core::wire::WireConfig;
use floe_core::{JobId, NodeId, SubmissionId};
use serde_json::Value;
use tokio::sync::watch;

use super::monitor::{Monitor, Snapshot};
use super::{HttpConfig, JobSpecParser, RejectedSpec, api};
use floe_api::state::{
    ClusterState, JobRecord, JobStatus, Liveness, NodeAddresses, NodeMemory, NodeRecord, Resources,
};

const NODES: u64 = 1_000;
const JOBS: u64 = 10_000;

struct RefuseAll;

impl JobSpecParser for RefuseAll {
    fn parse(&self, _: &str) -> Result<super::ParsedJob, RejectedSpec> {
        Err(RejectedSpec("refused by the test parser".into()))
    }
}

/// Every 10th node dead; jobs cycle through succeeded, failed, running and pending.
fn big_state() -> ClusterState {
    let mut state = ClusterState::default();
    for id in 1..=NODES {
        let node = NodeId::new(id);
        state.nodes.insert(
            node,
            NodeRecord {
                id: node,
                addresses: NodeAddresses {
                    rpc: format!("10.0.{}.{}:7800", id / 256, id % 256),
                },
                resources: Resources {
                    cpu_millis: 8_000,
                    heap_bytes: 1 << 34,
                },
                memory: NodeMemory {
                    total_bytes: 1 << 35,
                    object_store_bytes: 1 << 33,
                    system_reserve_bytes: 1 << 31,
                },
                labels: BTreeMap::new(),
                liveness: if id % 10 == 0 {
                    Liveness::Dead {
                        index: id,
                        at_ms: 0,
                        reason: "missed 5 heartbeats".into(),
                    }
                } else {
                    Liveness::Alive
                },
            },
        );
    }
    for id in 1..=JOBS {
        let job = JobId::new(id);
        let status = match id % 4 {
            0 => JobStatus::Succeeded,
            1 => JobStatus::Failed {
                message: format!("job {id} <b>failed</b>"),
            },
            2 => JobStatus::Running,
            _ => JobStatus::Pending,
        };
        state.jobs.insert(
            job,
            Arc::new(JobRecord {
                id: job,
                submission: SubmissionId::random(),
                name: (id % 100 == 0).then(|| format!("nightly-{id}")),
                spec: Vec::new(),
                status,
                driver: None,
                attempts: 1,
                cancel_requested: false,
                stats: None,
                outputs: Vec::new(),
                submitted_at_ms: 0,
                started_at_ms: None,
                ended_at_ms: None,
                release: None,
            }),
        );
    }
    // The jobs were set field by field, not applied: derive the counts and indexes.
    state.reindex();
    state
}

/// [`big_state`] cut to nodes 1–2 and jobs 1–3 (ids start at 1), its indexes rebuilt.
fn small_state() -> ClusterState {
    let mut state = big_state();
    state.nodes = state.nodes.take(2);
    state.jobs = state.jobs.take(3);
    state.reindex();
    state
}

/// The tokens of the test tokens file, one per scope.
struct TestTokens {
    data_dir: std::path::PathBuf,
    read: ClientToken,
    submit: ClientToken,
    admin: ClientToken,
}

fn tokens() -> &'static TestTokens {
    static TOKENS: std::sync::OnceLock<TestTokens> = std::sync::OnceLock::new();
    TOKENS.get_or_init(|| {
        let data_dir = tempfile::tempdir().unwrap().keep();
        let mut file = TokensFile::default();
        let mut create = |name, scopes| file.create(name, Scopes::parse(scopes).unwrap()).unwrap();
        let tokens = TestTokens {
            read: create("reader", "read"),
            submit: create("submitter", "submit"),
            admin: create("operator", "admin"),
            data_dir,
        };
        file.save(&tokens.data_dir.join("tokens")).unwrap();
        tokens
    })
}

/// GETs `$path` with the read token.
macro_rules! get {
    ($app:expr, $path:expr) => {{ get!($app, $path, Some(tokens().read.expose())) }};
    ($app:expr, $path:expr, $token:expr) => {{
        let mut request = actix_test::TestRequest::get().uri($path);
        if let Some(token) = $token {
            request = request.insert_header(("Authorization", format!("Bearer {token}")));
        }
        let request = request.to_request();
        let response = actix_test::call_service(&$app, request).await;
        let status = response.status().as_u16();
        let body: Value = actix_test::read_body_json(response).await;
        (status, body)
    }};
}

/// The JSON API serving `state` (as this replica's applied state), with a parser that refuses
/// every spec.
macro_rules! api_over {
    ($state:expr) => {{ api_over!($state, config()) }};
    ($state:expr, $config:expr) => {{
        let config = $config;
        let state = Arc::new($state);
        let (_publisher, applied) = watch::channel(Arc::clone(&state));
        let monitor = Arc::new(Monitor::new(&config, state));
        let shared = api::Shared::new(&config, monitor, applied, Arc::new(RefuseAll));
        actix_test::init_service(
            App::new()
                .app_data(web::Data::new(shared))
                .wrap(actix_web::middleware::from_fn(api::authenticate))
                .configure(api::routes),
        )
        .await
    }};
}

fn config() -> HttpConfig {
    let mut cluster = floe_core::Config::default();
    cluster.paths.data_dir = tokens().data_dir.clone();
    HttpConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        replica_id: 1,
        peers: BTreeMap::from([(1, "127.0.0.1:1".to_owned())]),
        wire: WireConfig::replica(&cluster, 1),
        node_wire: WireConfig::member(&cluster),
        public_reads: false,
        refresh: std::time::Duration::from_secs(1),
        job_history: None,
    }
}

#[actix_web::test]
async fn pages_and_filters_stay_exact_at_ten_thousand_jobs_and_a_thousand_nodes() {
    let app = api_over!(big_state());

    let (status, all) = get!(app, "/api/jobs");
    assert_eq!(status, 200);
    assert_eq!(all["total"], JOBS);
    assert_eq!(all["limit"], 50);
    let ids: Vec<&str> = all["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|job| job["id"].as_str().unwrap())
        .collect();
    let newest: Vec<String> = (JOBS - 49..=JOBS).rev().map(|id| id.to_string()).collect();
    assert_eq!(ids, newest, "newest first");
    for state in ["succeeded", "failed", "running", "pending"] {
        assert_eq!(all["counts"][state], JOBS / 4);
    }

    // The last page of failed jobs: ids ≡ 1 (mod 4), newest first, offset 2,450 of 2,500.
    let (_, failed) = get!(app, "/api/jobs?state=failed&offset=2450&limit=100");
    assert_eq!(failed["total"], JOBS / 4);
    let jobs = failed["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 50);
    let expected: Vec<u64> = (1..=JOBS)
        .rev()
        .filter(|id| id % 4 == 1)
        .skip(2450)
        .collect();
    let got: Vec<u64> = jobs
        .iter()
        .map(|job| job["id"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(got, expected);
    assert_eq!(
        jobs[0]["error"],
        format!("job {} <b>failed</b>", expected[0])
    );

    // `name` filters by substring; jobs without a name never match.
    let (_, named) = get!(app, "/api/jobs?name=ly-1&limit=1000");
    let expected: Vec<String> = (1..=JOBS)
        .rev()
        .filter(|id| id % 100 == 0 && format!("nightly-{id}").contains("ly-1"))
        .map(|id| format!("nightly-{id}"))
        .collect();
    assert_eq!(named["total"], expected.len());
    let names: Vec<&str> = named["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|job| job["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, expected);
    assert_eq!(all["jobs"][0]["name"], "nightly-10000");
    assert!(all["jobs"][1]["name"].is_null(), "{}", all["jobs"][1]);

    let (_, page) = get!(app, "/api/jobs?limit=5000");
    assert_eq!(
        page["jobs"].as_array().unwrap().len(),
        1000,
        "limit is capped"
    );

    let (_, dead) = get!(app, "/api/nodes?state=dead&limit=1000");
    assert_eq!(dead["total"], NODES / 10);
    assert!(
        dead["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|node| node["state"] == "dead" && node["usage"].is_null())
    );
    let (_, alive) = get!(app, "/api/nodes?state=alive&offset=850");
    assert_eq!(alive["total"], NODES - NODES / 10);
    assert_eq!(alive["nodes"].as_array().unwrap().len(), 50);
    assert_eq!(alive["nodes"][49]["id"], "999");

    let (status, _) = get!(app, "/api/nodes?state=zombie");
    assert_eq!(status, 400);
    let (status, job) = get!(app, "/api/jobs/4");
    assert_eq!((status, &job["state"]), (200, &Value::from("succeeded")));
    assert!(job["plan"].is_null(), "an undecodable spec shows no plan");
    let (status, _) = get!(app, "/api/jobs/10001");
    assert_eq!(status, 404);
}

#[actix_web::test]
async fn every_call_needs_a_token_with_its_scope_and_bad_specs_name_their_error() {
    let app = api_over!(ClusterState::default());
    let tokens = tokens();
    let post = |path: &str, token: Option<&str>| {
        let mut request = actix_test::TestRequest::post()
            .uri(path)
            .insert_header(("Content-Type", "application/toml"))
            .set_payload("[source]\nrange = 3\n");
        if let Some(token) = token {
            request = request.insert_header(("Authorization", format!("Bearer {token}")));
        }
        request.to_request()
    };
    let longer = format!("{}x", tokens.admin.expose());
    let unknown = [None, Some("wrong"), Some(longer.as_str()), Some("")];
    for path in ["/api/jobs", "/api/jobs/1/stop", "/api/cache/clean"] {
        for token in unknown {
            let response = actix_test::call_service(&app, post(path, token)).await;
            assert_eq!(response.status().as_u16(), 401, "{path} with {token:?}");
        }
        // A read token is known but may not change anything.
        let response = actix_test::call_service(&app, post(path, Some(tokens.read.expose()))).await;
        assert_eq!(
            response.status().as_u16(),
            403,
            "{path} with the read token"
        );
        let body: Value = actix_test::read_body_json(response).await;
        assert!(
            body["error"]
                .as_str()
                .unwrap()
                .contains("token 'reader' lacks scope"),
            "{body}"
        );
    }
    let response =
        actix_test::call_service(&app, post("/api/cache/clean", Some(tokens.submit.expose())))
            .await;
    assert_eq!(response.status().as_u16(), 403, "cleaning needs admin");
    for path in [
        "/api/jobs",
        "/api/cluster",
        "/api/nodes",
        "/api/cache",
        "/metrics",
    ] {
        for token in unknown {
            let (status, _) = get!(app, path, token);
            assert_eq!(status, 401, "GET {path} with {token:?}");
        }
    }
    let (status, _) = get!(app, "/api/jobs", Some(tokens.read.expose()));
    assert_eq!(status, 200);
    // Health checks probe the version without a token; it says nothing about the cluster.
    let (status, _) = get!(app, "/api/version", None::<&str>);
    assert_eq!(status, 200);
    // With a submit token the request reaches the parser, whose error comes back as a 400.
    let response =
        actix_test::call_service(&app, post("/api/jobs", Some(tokens.submit.expose()))).await;
    assert_eq!(response.status().as_u16(), 400);
    let body: Value = actix_test::read_body_json(response).await;
    assert_eq!(body["error"], "refused by the test parser");
    // Cleaning an empty cache with the admin token asks the leader nothing.
    let clean = actix_test::TestRequest::post()
        .uri("/api/cache/clean")
        .insert_header(("Authorization", format!("Bearer {}", tokens.admin.expose())))
        .to_request();
    let response = actix_test::call_service(&app, clean).await;
    assert_eq!(response.status().as_u16(), 200);
}

#[actix_web::test]
async fn public_reads_need_no_token_but_changes_still_do() {
    let mut open = config();
    open.public_reads = true;
    let app = api_over!(ClusterState::default(), open);
    let (status, _) = get!(app, "/api/jobs", None::<&str>);
    assert_eq!(status, 200);
    let request = actix_test::TestRequest::post()
        .uri("/api/jobs/1/stop")
        .to_request();
    let response = actix_test::call_service(&app, request).await;
    assert_eq!(response.status().as_u16(), 401);
}

fn snapshot_of(state: ClusterState, leader: Option<u64>, time_ms: u64) -> Snapshot {
    Snapshot {
        time_ms,
        baseline: false,
        state: Arc::new(state),
        replicas: Vec::new(),
        leader,
        leader_answered: true,
        reports: BTreeMap::new(),
        progress: BTreeMap::new(),
        rows_per_s: BTreeMap::new(),
        row_marks: BTreeMap::new(),
        driver_seen: floe_api::state::OrdMap::new(),
    }
}

#[test]
fn rates_hold_between_reports_and_each_node_gets_a_point_every_ten_seconds() {
    use floe_api::scheduler_protocol::{NodeReport, ResourceUsage};
    use floe_core::job::{JobProgress, OperatorProgress};
    let config = config();
    let state = small_state();
    let monitor = Monitor::new(&config, Arc::new(state.clone()));
    let job = JobId::new(3);
    let node = NodeId::new(1);
    // The driver reports 1,000 more output rows every 2 s; the node has made 500 rows and
    // received 4 KiB more every second.
    for second in 0..=30u64 {
        let mut next = snapshot_of(state.clone(), Some(1), 1_000_000 + second * 1000);
        let rows_done = 1000 * (second / 2);
        next.progress.insert(
            job,
            JobProgress {
                attempt: 1,
                operators: vec![OperatorProgress {
                    rows_done,
                    ..OperatorProgress::default()
                }],
                actors: Vec::new(),
            },
        );
        let usage = ResourceUsage {
            rows_produced: 500 * second,
            network_received_bytes: 4096 * second,
            workers_busy: 2,
            spilled_bytes: 7,
            cpu_used_permille: 250,
            ..ResourceUsage::default()
        };
        next.reports.insert(
            node,
            NodeReport {
                usage,
                reserved: Resources::default(),
                leases: Vec::new(),
                age_ms: 0,
            },
        );
        monitor.advance(next);
        // The first rate is taken from when the job was first seen (the first snapshot is the
        // baseline), so it runs from the second change on.
        if second >= 5 {
            // 1,000 rows per 2 s, even in the seconds no new report came.
            let rate = monitor.snapshot().rows_per_s[&job];
            assert!((rate - 500.0).abs() < 1e-6, "second {second}: {rate}");
        }
    }
    let last = *monitor.history().last().unwrap();
    assert!((last.task_rows_per_s - 500.0).abs() < 1e-6, "{last:?}");
    assert!((last.network_bytes_per_s - 4096.0).abs() < 1e-6, "{last:?}");
    // A point when the node is first heard of, then one per 10 s: at 0, 10, 20 and 30 s.
    let points = monitor.node_history(node);
    let times: Vec<u64> = points.iter().map(|p| p.time_ms - 1_000_000).collect();
    assert_eq!(times, [0, 10_000, 20_000, 30_000]);
    let point = points[3];
    assert_eq!((point.tasks_running, point.spilled_bytes), (2, 7));
    assert_eq!(point.cpu_used_permille, 250);
    assert!((f64::from(point.rows_per_s) - 500.0).abs() < 1e-3);
    assert!((f64::from(point.network_bytes_per_s) - 4096.0).abs() < 1e-3);
    // A job whose rows stop growing falls to 0 after a while.
    for second in 31..=40u64 {
        let mut next = snapshot_of(state.clone(), Some(1), 1_000_000 + second * 1000);
        next.progress
            .insert(job, monitor.snapshot().progress[&job].clone());
        monitor.advance(next);
    }
    assert_eq!(monitor.snapshot().rows_per_s[&job], 0.0);
    // A node that leaves the state takes its points with it.
    let mut gone = state.clone();
    gone.nodes.remove(&node);
    monitor.advance(snapshot_of(gone, Some(1), 1_100_000));
    assert!(monitor.node_history(node).is_empty());
}

#[test]
fn events_are_the_differences_between_snapshots_after_the_baseline() {
    let config = config();
    let state = small_state();
    let monitor = Monitor::new(&config, Arc::new(state.clone()));

    // What was already there at start-up is not news; a leader appearing is.
    monitor.advance(snapshot_of(state.clone(), Some(1), 1_000));
    let first = monitor.events_after(0);
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].kind.name(), "leader_changed");
    assert_eq!(first[0].message, "replica 1 is the leader (term 0)");

    let node = |id| NodeId::new(id);
    let mut next = state.clone();
    if let Some(record) = next.nodes.get_mut(&node(1)) {
        record.liveness = Liveness::Dead {
            index: 9,
            at_ms: 0,
            reason: "missed 5 heartbeats".into(),
        };
    }
    let mut joined = next.nodes[&node(2)].clone();
    joined.id = node(3);
    next.nodes.insert(node(3), joined);
    if let Some(job) = next.jobs.get_mut(&JobId::new(3)).map(Arc::make_mut) {
        job.status = JobStatus::Running;
    }
    monitor.advance(snapshot_of(next.clone(), Some(1), 2_000));
    monitor.advance(snapshot_of(next, None, 3_000));

    let events: Vec<(String, String)> = monitor
        .events_after(first[0].seq)
        .into_iter()
        .map(|event| (event.kind.name().to_owned(), event.message))
        .collect();
    let expected = [
        (
            "node_dead",
            "node 1 (10.0.0.1:7800) died: missed 5 heartbeats",
        ),
        ("node_joined", "node 3 joined from 10.0.0.2:7800"),
        ("job_state", "job 3 running"),
        ("leader_changed", "no replica is leader"),
    ];
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|(kind, message)| ((*kind).to_owned(), (*message).to_owned()))
        .collect();
    assert_eq!(events, expected);
    assert_eq!(monitor.history().len(), 3);
}

#[test]
fn a_job_that_passes_several_states_between_refreshes_gets_an_event_for_each() {
    let config = config();
    let mut state = big_state();
    state.jobs = state.jobs.take(1);
    state.reindex();
    let monitor = Monitor::new(&config, Arc::new(state.clone()));
    monitor.advance(snapshot_of(state.clone(), Some(1), 1_000));
    let after = monitor.events_after(0).last().map_or(0, |event| event.seq);

    // Job 20 appears already succeeded; job 21 already running; job 22 was cancelled while
    // pending (it never started).
    let template = state.jobs.values().next().unwrap().as_ref().clone();
    let mut next = state.clone();
    for (id, status, started) in [
        (20, JobStatus::Succeeded, Some(5)),
        (21, JobStatus::Running, Some(5)),
        (22, JobStatus::Cancelled, None),
    ] {
        let mut job = template.clone();
        job.id = JobId::new(id);
        job.status = status;
        job.started_at_ms = started;
        next.jobs.insert(job.id, Arc::new(job));
    }
    monitor.advance(snapshot_of(next, Some(1), 2_000));
    let messages: Vec<String> = monitor
        .events_after(after)
        .into_iter()
        .map(|event| event.message)
        .collect();
    assert_eq!(
        messages,
        [
            "job 20 pending",
            "job 20 running",
            "job 20 succeeded",
            "job 21 pending",
            "job 21 running",
            "job 22 pending",
            "job 22 cancelled",
        ]
    );
}

#[actix_web::test]
async fn the_history_keeps_an_hour_and_thins_long_spans_to_six_hundred_points() {
    let config = config();
    let state = Arc::new(ClusterState::default());
    let (_publisher, applied) = watch::channel(Arc::clone(&state));
    let monitor = Arc::new(Monitor::new(&config, Arc::clone(&state)));
    let now = super::monitor::now_ms();
    // An hour and a bit of samples, one a second; the oldest fall out of the ring.
    for second in (0..3700u64).rev() {
        monitor.advance(snapshot_of(
            ClusterState::default(),
            Some(1),
            now - second * 1000,
        ));
    }
    assert_eq!(monitor.history().len(), 3600);
    let shared = api::Shared::new(&config, monitor, applied, Arc::new(RefuseAll));
    let app = actix_test::init_service(
        App::new()
            .app_data(web::Data::new(shared))
            .wrap(actix_web::middleware::from_fn(api::authenticate))
            .configure(api::routes),
    )
    .await;

    let (status, hour) = get!(app, "/api/history?minutes=60");
    assert_eq!(status, 200);
    let samples = hour["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 600);
    assert_eq!(hour["interval_ms"], 6000);
    assert_eq!(
        samples.last().unwrap()["time_ms"],
        now,
        "the newest is kept"
    );
    let (_, recent) = get!(app, "/api/history");
    let samples = recent["samples"].as_array().unwrap();
    assert!((590..=601).contains(&samples.len()), "{}", samples.len());
    assert_eq!(recent["interval_ms"], 1000);
    assert!(
        samples
            .iter()
            .all(|s| s["time_ms"].as_u64().unwrap() + 600_000 >= now)
    );
    for bad in ["minutes=0", "minutes=61", "span=1"] {
        let (status, _) = get!(app, &format!("/api/history?{bad}"));
        assert_eq!(status, 400, "{bad}");
    }
}

#[actix_web::test]
async fn actors_list_what_the_state_records_with_a_drivers_restarts() {
    let mut state = small_state();
    if let Some(job) = state.jobs.get_mut(&JobId::new(3)).map(Arc::make_mut) {
        job.attempts = 3;
    }
    for (actor, kind, job, node) in [
        (10, floe_api::state::DRIVER_ACTOR_KIND, 3, 1),
        (11, "HashShuffleAggregator", 3, 2),
        (12, "HashShuffleAggregator", 2, 1),
    ] {
        let id = floe_core::ActorId::new(actor);
        state.actors.insert(
            id,
            floe_api::state::ActorRecord {
                id,
                kind: kind.into(),
                node: NodeId::new(node),
                job: JobId::new(job),
            },
        );
    }
    let app = api_over!(state);
    let (status, all) = get!(app, "/api/actors");
    assert_eq!(status, 200);
    let actors = all["actors"].as_array().unwrap();
    assert_eq!(actors.len(), 3);
    let (_, of_job) = get!(app, "/api/actors?job=3");
    let actors = of_job["actors"].as_array().unwrap();
    assert_eq!(actors.len(), 2);
    let driver = actors.iter().find(|a| a["kind"] == "JobDriver").unwrap();
    assert_eq!(driver["restarts"], 2);
    assert_eq!(driver["node"], "1");
    let aggregator = actors.iter().find(|a| a["kind"] != "JobDriver").unwrap();
    assert!(aggregator["restarts"].is_null());
    for bad in ["/api/actors?job=x", "/api/actors?node=1"] {
        let (status, _) = get!(app, bad);
        assert_eq!(status, 400, "{bad}");
    }
    let (status, _) = get!(app, "/api/nodes/77");
    assert_eq!(status, 404);
}
