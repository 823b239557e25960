//! The data behind the dashboard's job and log pages, from real processes: a job's task table
//! (kept by its driver's node), and the logs nodes write to rotated files under their data
//! directory, which the REST API reads on demand; no secret or token ever reaches a log file.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use floe_testkit::cluster::{TestCluster, TestClusterConfig, runtime};
use floe_testkit::http::{get, post_json, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

fn lines(body: &Value) -> &Vec<Value> {
    body["lines"].as_array().unwrap()
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path, found: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files_under(&path, found);
        } else {
            found.push(path);
        }
    }
}

#[test]
fn a_jobs_tasks_and_logs_come_from_its_nodes_and_logs_hold_no_secret() {
    let runtime = runtime();
    let config = TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"));
    let cluster = runtime.block_on(TestCluster::start(config, 2));
    let addr = cluster.schedulers.http_addr(1).unwrap().to_owned();
    let token = cluster.config.token().to_owned();

    let spec = "[source]\nrange = 20000\n[[steps]]\nfilter = \"id % 7 == 0\"\n";
    let created = post_json(&addr, "/api/jobs", &token, &json!({ "job": spec }));
    assert_eq!(created.status, 201, "{}", created.body);
    let job = created.json()["job_id"].as_str().unwrap().to_owned();
    wait_for("the job to succeed", WAIT, || {
        let detail = get(&addr, &format!("/api/jobs/{job}"), &token);
        (detail.status == 200 && detail.json()["state"] == "succeeded").then_some(())
    });

    // Its task table: every run succeeded somewhere, and the last operator's runs made the
    // output's rows.
    let detail = get(&addr, &format!("/api/jobs/{job}"), &token).json();
    let tasks = get(&addr, &format!("/api/jobs/{job}/tasks"), &token);
    assert_eq!(tasks.status, 200, "{}", tasks.body);
    let tasks = tasks.json();
    assert_eq!(tasks["available"], true, "{tasks}");
    let runs = tasks["tasks"].as_array().unwrap();
    assert!(!runs.is_empty());
    for run in runs {
        assert_eq!(run["state"], "succeeded", "{run}");
        assert!(run["node"].is_string(), "{run}");
        assert!(run["ended_ms"].as_u64().unwrap() >= run["started_ms"].as_u64().unwrap());
    }
    let operators = detail["stats"]["operators"].as_array().unwrap();
    let last = operators.last().unwrap()["name"].as_str().unwrap();
    let rows: u64 = runs
        .iter()
        .filter(|run| run["operator"] == last)
        .map(|run| run["rows"].as_u64().unwrap())
        .sum();
    assert_eq!(rows, detail["output"]["rows"].as_u64().unwrap(), "{tasks}");
    assert_eq!(get(&addr, "/api/jobs/999/tasks", &token).status, 404);

    // The job's lines: its driver's, from whichever node ran it, each marked with the job.
    let job_logs = wait_for("the driver's last line", WAIT, || {
        let body = get(&addr, &format!("/api/jobs/{job}/logs"), &token).json();
        lines(&body)
            .iter()
            .any(|line| line["text"].as_str().unwrap().contains("driver finished"))
            .then_some(body)
    });
    assert!(job_logs["unreachable"].as_array().unwrap().is_empty());
    let mark = format!("job={job}");
    for line in lines(&job_logs) {
        let text = line["text"].as_str().unwrap();
        assert!(text.contains(&mark), "{text}");
        assert_eq!(line["source"], "agent.log");
    }
    assert!(
        lines(&job_logs)
            .iter()
            .any(|line| line["text"].as_str().unwrap().contains("driver started"))
    );
    // Oldest first.
    let times: Vec<&str> = lines(&job_logs)
        .iter()
        .map(|line| line["time"].as_str().unwrap())
        .collect();
    assert!(times.windows(2).all(|pair| pair[0] <= pair[1]), "{times:?}");

    // Text search (any case) and tail.
    let found = get(
        &addr,
        &format!("/api/jobs/{job}/logs?q=DRIVER%20FINISHED"),
        &token,
    )
    .json();
    assert_eq!(lines(&found).len(), 1, "{found}");
    let driver_node = lines(&found)[0]["node"].as_str().unwrap().to_owned();

    // The driver's node: the same line is in its agent.log on disk.
    let node_logs = get(
        &addr,
        &format!("/api/nodes/{driver_node}/logs?tail=1000"),
        &token,
    );
    assert_eq!(node_logs.status, 200, "{}", node_logs.body);
    let node_logs = node_logs.json();
    let finished = lines(&found)[0]["text"].as_str().unwrap().to_owned();
    assert!(
        lines(&node_logs)
            .iter()
            .any(|line| line["text"].as_str().unwrap() == finished)
    );
    let on_disk: String = (0..2)
        .map(|index| {
            let path = cluster
                .dir
                .path()
                .join(format!("node-{index}/logs/agent.log"));
            std::fs::read_to_string(path).unwrap()
        })
        .collect();
    assert!(on_disk.lines().any(|line| line == finished), "{finished}");
    let tail = get(
        &addr,
        &format!("/api/nodes/{driver_node}/logs?tail=3"),
        &token,
    )
    .json();
    assert_eq!(lines(&tail).len(), 3);
    assert_eq!(
        lines(&tail)[2]["text"],
        lines(&node_logs).last().unwrap()["text"]
    );
    let warnings = get(
        &addr,
        &format!("/api/nodes/{driver_node}/logs?level=warn"),
        &token,
    )
    .json();
    for line in lines(&warnings) {
        assert!(
            matches!(line["level"].as_str(), Some("WARN" | "ERROR")),
            "{line}"
        );
    }
    // Every worker has its own file.
    for index in 0..2 {
        let logs = cluster.dir.path().join(format!("node-{index}/logs"));
        assert!(logs.join("worker-0.log").is_file());
        assert!(logs.join("worker-1.log").is_file());
    }

    // Refused: no token, a bad level or tail, an unknown parameter, job or node.
    assert_eq!(get(&addr, &format!("/api/jobs/{job}/logs"), "").status, 401);
    let path = format!("/api/nodes/{driver_node}/logs");
    assert_eq!(
        get(&addr, &format!("{path}?level=loud"), &token).status,
        400
    );
    assert_eq!(get(&addr, &format!("{path}?tail=0"), &token).status, 400);
    assert_eq!(get(&addr, &format!("{path}?grep=x"), &token).status, 400);
    assert_eq!(get(&addr, "/api/jobs/999/logs", &token).status, 404);
    assert_eq!(get(&addr, "/api/nodes/999/logs", &token).status, 404);

    // No secret and no token in any file under the nodes' directories (logs included).
    let credentials = &cluster.config.credentials;
    let secrets = [
        credentials.cluster_secret.expose().to_owned(),
        credentials.replica_secret.expose().to_owned(),
        token.clone(),
    ];
    let mut files = Vec::new();
    for index in 0..2 {
        files_under(
            &cluster.dir.path().join(format!("node-{index}/logs")),
            &mut files,
        );
    }
    assert!(files.len() >= 3, "{files:?}");
    for file in files {
        let bytes = std::fs::read(&file).unwrap();
        let text = String::from_utf8_lossy(&bytes);
        for secret in &secrets {
            assert!(
                !text.contains(secret.as_str()),
                "{} holds a secret",
                file.display()
            );
        }
    }
}
