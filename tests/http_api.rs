//! The HTTP API of real scheduler processes: the REST job API with and without the token,
//! spec validation, stop, the cache and metrics endpoints, and every replica of a three-
//! replica scheduler serving the same answers and forwarding mutations to the leader.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use floe_client::{LocalCluster, LocalClusterOptions};
use floe_testkit::cluster::{TestClusterConfig, runtime, start_schedulers};
use floe_testkit::http::{Response, get, http_addr, post_json, request, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

/// Waits until `addr` shows `job` in `state`; a replica that has not applied the job yet
/// answers 404 meanwhile.
fn wait_for_state(addr: &str, token: &str, job: &str, state: &str) -> Value {
    wait_for(&format!("job {job} to be {state} on {addr}"), WAIT, || {
        let response = get(addr, &format!("/api/jobs/{job}"), token);
        assert!(matches!(response.status, 200 | 404), "{}", response.body);
        let detail = (response.status == 200).then(|| response.json())?;
        (detail["state"] == state).then_some(detail)
    })
}

fn submit(addr: &str, token: &str, spec: &str) -> Response {
    post_json(addr, "/api/jobs", token, &json!({ "job": spec }))
}

fn error_of(response: &Response) -> String {
    response.json()["error"].as_str().unwrap().to_owned()
}

#[test]
fn rest_api_runs_jobs_with_the_token_and_refuses_without() {
    let runtime = runtime();
    let mut options = LocalClusterOptions::new(2, env!("CARGO_BIN_EXE_floe").into());
    options.workers_per_node = 2;
    let cluster = runtime.block_on(LocalCluster::start(options)).unwrap();
    let addr = http_addr(&cluster);
    let token = cluster.token();

    let version = get(&addr, "/api/version", token).json();
    assert_eq!(version["version"], env!("CARGO_PKG_VERSION"));

    // Without the token, or with a wrong one, nothing is created.
    let spec = "[source]\nrange = 10000\n[[steps]]\nfilter = \"id % 3 == 0\"\n";
    let refused = submit(&addr, "", spec);
    assert_eq!(refused.status, 401, "{}", refused.body);
    assert!(error_of(&refused).contains("token"));
    assert_eq!(submit(&addr, "not-the-token", spec).status, 401);
    let raw_toml = request(
        "POST",
        &addr,
        "/api/jobs",
        &[("Content-Type", "application/toml")],
        spec.as_bytes(),
    );
    assert_eq!(raw_toml.status, 401);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(get(&addr, "/api/jobs", token).json()["total"], 0);

    // With it, the job runs; the result is checked against a count made here.
    let created = submit(&addr, token, spec);
    assert_eq!(created.status, 201, "{}", created.body);
    let job = created.json()["job_id"].as_str().unwrap().to_owned();
    let detail = wait_for_state(&addr, token, &job, "succeeded");
    let expected = (0..10_000).filter(|id| id % 3 == 0).count();
    assert_eq!(detail["output"]["rows"], expected);
    assert_eq!(detail["output_rows"], expected);
    assert!(detail["plan"].as_str().unwrap().contains("range n=10000"));
    assert_eq!(detail["options"]["cache"], "reuse");

    // A TOML body works too, and a repeated submission id is one job.
    let auth = format!("Bearer {token}");
    let toml_job = request(
        "POST",
        &addr,
        "/api/jobs",
        &[
            ("Content-Type", "application/toml"),
            ("Authorization", &auth),
        ],
        b"[source]\nrange = 7\n",
    );
    assert_eq!(toml_job.status, 201, "{}", toml_job.body);
    let submission = json!({"job": "[source]\nrange = 9\n",
                            "submission_id": "00112233445566778899aabbccddeeff"});
    let first = post_json(&addr, "/api/jobs", token, &submission).json();
    let again = post_json(&addr, "/api/jobs", token, &submission).json();
    assert_eq!(first["job_id"], again["job_id"]);

    // Bad specs are refused up front with the line and field.
    let unknown_column = submit(
        &addr,
        token,
        "[source]\nrange = 5\n\n[[steps]]\nfilter = \"nope > 1\"\n",
    );
    assert_eq!(unknown_column.status, 400);
    let message = error_of(&unknown_column);
    assert!(
        message.contains(":4: steps[0].filter") && message.contains("nope"),
        "{message}"
    );
    let relative = submit(&addr, token, "[source]\nread_csv = [\"data/*.csv\"]\n");
    assert_eq!(relative.status, 400);
    assert!(error_of(&relative).contains("absolute"));
    let garbage = request(
        "POST",
        &addr,
        "/api/jobs",
        &[("Authorization", &auth)],
        b"\x00\xff{not json",
    );
    assert_eq!(garbage.status, 400);
    let bad_submission = post_json(
        &addr,
        "/api/jobs",
        token,
        &json!({"job": "[source]\nrange = 1\n", "submission_id": "../etc"}),
    );
    assert_eq!(bad_submission.status, 400);

    // Stop: a long job is cancelled; stopping it again says it has ended.
    let long = submit(
        &addr,
        token,
        "[source]\nrange = 4\n[[steps]]\nmap_batches = { udf = \"delay\", version = 1, args = { ms = 30000 } }\n",
    );
    assert_eq!(long.status, 201, "{}", long.body);
    let long = long.json()["job_id"].as_str().unwrap().to_owned();
    wait_for_state(&addr, token, &long, "running");
    let stop_path = format!("/api/jobs/{long}/stop");
    assert_eq!(post_json(&addr, &stop_path, "", &json!({})).status, 401);
    let stopped = post_json(&addr, &stop_path, token, &json!({}));
    assert_eq!(stopped.status, 200, "{}", stopped.body);
    assert_eq!(stopped.json()["stopped"], true);
    wait_for_state(&addr, token, &long, "cancelled");
    assert_eq!(
        post_json(&addr, &stop_path, token, &json!({})).json()["stopped"],
        false
    );
    assert_eq!(
        post_json(&addr, "/api/jobs/999/stop", token, &json!({})).status,
        404
    );
    assert_eq!(get(&addr, "/api/jobs/999", token).status, 404);
    assert_eq!(get(&addr, "/api/jobs/abc", token).status, 400);

    // Lists, filters and pages.
    let succeeded = get(&addr, "/api/jobs?state=succeeded", token).json();
    assert_eq!(succeeded["counts"]["succeeded"], succeeded["total"]);
    assert!(succeeded["total"].as_u64().unwrap() >= 3);
    let page = get(&addr, "/api/jobs?limit=1&offset=1", token).json();
    assert_eq!(page["jobs"].as_array().unwrap().len(), 1);
    assert_eq!(get(&addr, "/api/jobs?state=bogus", token).status, 400);

    let nodes = get(&addr, "/api/nodes?state=alive", token).json();
    assert_eq!(nodes["total"], 2);
    for node in nodes["nodes"].as_array().unwrap() {
        assert!(node["memory"]["object_store_bytes"].as_u64().unwrap() > 0);
        assert_eq!(node["usage"]["workers"], 2);
    }
    let overview = get(&addr, "/api/cluster", token).json();
    assert_eq!(overview["health"], "ok");
    assert_eq!(overview["nodes"]["alive"], 2);

    let metrics = get(&addr, "/metrics", token).body;
    assert!(
        metrics.contains("floe_nodes{state=\"alive\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("floe_jobs{state=\"cancelled\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("floe_raft_is_leader 1"), "{metrics}");

    let events = get(&addr, "/api/events", token).json();
    let kinds: Vec<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| event["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds.iter().filter(|kind| **kind == "node_joined").count(),
        2
    );
    assert!(kinds.contains(&"job_state"));

    // The cache: entries from the jobs above; cleaning needs the token and empties it.
    let shard_files = || -> Vec<String> {
        ["node-0", "node-1"]
            .iter()
            .flat_map(|node| std::fs::read_dir(cluster.dir().join(node).join("cache")).unwrap())
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("cache-"))
            .collect()
    };
    assert!(!shard_files().is_empty());
    let cache = get(&addr, "/api/cache", token).json();
    assert!(!cache["entries"].as_array().unwrap().is_empty(), "{cache}");
    assert_eq!(
        post_json(&addr, "/api/cache/clean", "", &json!({})).status,
        401
    );
    let cleaned = post_json(&addr, "/api/cache/clean", token, &json!({})).json();
    assert!(cleaned["evicted"].as_u64().unwrap() >= 1);
    wait_for("the cache index to empty", WAIT, || {
        let cache = get(&addr, "/api/cache", token).json();
        cache["entries"]
            .as_array()
            .unwrap()
            .is_empty()
            .then_some(())
    });
    // The files went too (after the index), so a restarted node cannot index them again.
    assert_eq!(shard_files(), Vec::<String>::new());

    let missing = get(&addr, "/api/nothing", token);
    assert_eq!(missing.status, 404);
    assert!(error_of(&missing).contains("no such endpoint"));
}

#[test]
fn every_replica_serves_the_api_and_forwards_mutations() {
    let runtime = runtime();
    let dir = tempfile::tempdir().unwrap();
    let config = TestClusterConfig {
        replicas: 3,
        ..TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"))
    };
    let token = config.token();
    let mut schedulers = start_schedulers(&config, dir.path());
    let leader = runtime.block_on(schedulers.wait_for_leader(WAIT)).unwrap();
    let addrs: Vec<String> = (1..=3)
        .map(|id| schedulers.http_addr(id).unwrap().to_owned())
        .collect();
    let http = |id: u64| addrs[(id - 1) as usize].clone();

    for id in 1..=3 {
        wait_for(&format!("replica {id} to see every replica"), WAIT, || {
            let cluster = get(&http(id), "/api/cluster", token).json();
            let reachable = cluster["replicas"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|replica| replica["reachable"] == true)
                .count();
            (cluster["leader"] == leader && reachable == 3 && cluster["replica_id"] == id)
                .then_some(())
        });
    }

    // Submitted to a follower, stopped through the other: the leader commits both, and
    // every replica shows the result.
    let followers: Vec<u64> = (1..=3).filter(|id| *id != leader).collect();
    let created = submit(&http(followers[0]), token, "[source]\nrange = 100\n");
    assert_eq!(created.status, 201, "{}", created.body);
    let job = created.json()["job_id"].as_str().unwrap().to_owned();
    for id in 1..=3 {
        // No node has joined, so the job waits for a driver.
        wait_for_state(&http(id), token, &job, "pending");
    }
    let stopped = post_json(
        &http(followers[1]),
        &format!("/api/jobs/{job}/stop"),
        token,
        &json!({}),
    );
    assert_eq!(stopped.json()["stopped"], true, "{}", stopped.body);
    for id in 1..=3 {
        wait_for_state(&http(id), token, &job, "cancelled");
    }

    // Kill the leader: the survivors report it unreachable, elect another and say so.
    schedulers.kill(leader).unwrap();
    let survivor = http(followers[0]);
    let new_leader = wait_for("a new leader", WAIT, || {
        let cluster = get(&survivor, "/api/cluster", token).json();
        let unreachable = cluster["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .any(|replica| replica["id"] == leader && replica["reachable"] == false);
        (unreachable
            && cluster["health"] == "degraded"
            && cluster["leader"] != leader
            && cluster["leader"].is_u64())
        .then(|| cluster["leader"].as_u64().unwrap())
    });
    assert!(followers.contains(&new_leader));
    let events = get(&survivor, "/api/events", token).json();
    let changes = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|event| event["kind"] == "leader_changed")
        .count();
    assert!(changes >= 2, "{events}");
}
