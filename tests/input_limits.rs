//! Hostile or mistaken input against real processes (issue #31): a job of thousands of steps,
//! posted to every scheduler replica's REST API or given to `floe submit`, is refused with an
//! error naming the limit — it used to overflow a replica's stack and abort it — and every
//! replica then goes on serving jobs. Misspelled keys in a job file are refused the same way
//! instead of running a different job.

#![allow(clippy::unwrap_used)]

use std::process::Output;
use std::time::Duration;

use floe_client::local::{LocalCredentials, LocalSchedulers, LocalSchedulersConfig};
use floe_client::{LocalCluster, LocalClusterOptions};
use floe_core::plan::MAX_PLAN_DEPTH;
use floe_testkit::cluster::runtime;
use floe_testkit::http::{Response, get, http_addr, post_json, request, wait_for};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

/// A job file of `steps` filter steps over a range: about 30 bytes a step.
fn long_job(steps: usize) -> String {
    let mut text = String::from("[source]\nrange = 1000\n");
    for _ in 0..steps {
        text.push_str("[[steps]]\nfilter = \"id % 3 != 1\"\n");
    }
    text
}

/// What every refusal of a too-long job says: the step that passed the limit, and the limit.
fn assert_names_the_limit(message: &str) {
    assert!(
        message.contains(&format!("steps[{}].filter", MAX_PLAN_DEPTH - 1))
            && message.contains(&format!("at most {MAX_PLAN_DEPTH} are allowed")),
        "{message}"
    );
}

fn error_of(response: &Response) -> String {
    response.json()["error"].as_str().unwrap().to_owned()
}

fn submit(addr: &str, token: &str, spec: &str) -> Response {
    post_json(addr, "/api/jobs", token, &json!({ "job": spec }))
}

/// Runs the CLI against `cluster`.
fn floe(cluster: &LocalCluster, args: &[&str]) -> Output {
    floe_testkit::process::run_floe_against(env!("CARGO_BIN_EXE_floe"), cluster, args)
}

/// `floe` failed with an error of its own: exit code 1, not a signal (a stack overflow aborts).
fn stderr_of_failure(output: &Output) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        output.status.code(),
        Some(1),
        "{:?}: {stderr}",
        output.status
    );
    stderr
}

#[test]
fn a_long_job_posted_to_every_replica_is_refused_and_every_replica_stays_up() {
    let runtime = runtime();
    let dir = tempfile::tempdir().unwrap();
    let schedulers = LocalSchedulers::start(LocalSchedulersConfig {
        binary: env!("CARGO_BIN_EXE_floe").into(),
        replicas: 3,
        dir: dir.path().to_owned(),
        credentials: LocalCredentials::generate(dir.path()).unwrap(),
        settings: Vec::new(),
        tls: floe_core::config::TlsConfig::default(),
    })
    .unwrap();
    let token = schedulers.credentials().admin_token.expose();
    runtime.block_on(schedulers.wait_for_leader(WAIT)).unwrap();
    let addrs: Vec<String> = (1..=3)
        .map(|id| schedulers.http_addr(id).unwrap().to_owned())
        .collect();

    // 5,000 steps (150 KB, under the body limit): the spec that aborted a replica.
    let spec = long_job(5_000);
    for addr in &addrs {
        let refused = submit(addr, token, &spec);
        assert_eq!(refused.status, 400, "{addr}: {}", refused.body);
        assert_names_the_limit(&error_of(&refused));
        let auth = format!("Bearer {token}");
        let as_toml = request(
            "POST",
            addr,
            "/api/jobs",
            &[
                ("Content-Type", "application/toml"),
                ("Authorization", &auth),
            ],
            spec.as_bytes(),
        );
        assert_eq!(as_toml.status, 400, "{addr}: {}", as_toml.body);
        assert_names_the_limit(&error_of(&as_toml));
    }
    // Every replica is alive, answers, and takes the next job.
    for (index, addr) in addrs.iter().enumerate() {
        let id = index as u64 + 1;
        assert!(schedulers.is_running(id), "replica {id} died");
        assert_eq!(get(addr, "/api/version", token).status, 200);
        let created = submit(addr, token, "[source]\nrange = 10\n");
        assert_eq!(created.status, 201, "{addr}: {}", created.body);
    }
    wait_for("the three jobs on every replica", WAIT, || {
        addrs
            .iter()
            .all(|addr| get(addr, "/api/jobs", token).json()["total"] == 3)
            .then_some(())
    });
}

#[test]
fn long_and_misspelled_jobs_are_refused_by_rest_and_floe_submit_and_the_next_job_runs() {
    let runtime = runtime();
    let mut options = LocalClusterOptions::new(1, env!("CARGO_BIN_EXE_floe").into());
    options.workers_per_node = 1;
    let cluster = runtime.block_on(LocalCluster::start(options)).unwrap();
    let addr = http_addr(&cluster);
    let token = cluster.token();
    let dir = tempfile::tempdir().unwrap();

    // `floe submit` refuses 5,000 and 30,000 steps (it aborted on the latter), naming the file.
    for steps in [5_000, 30_000] {
        let file = dir.path().join(format!("long-{steps}.toml"));
        std::fs::write(&file, long_job(steps)).unwrap();
        let stderr = stderr_of_failure(&floe(&cluster, &["submit", file.to_str().unwrap()]));
        assert!(stderr.contains(&file.display().to_string()), "{stderr}");
        assert_names_the_limit(&stderr);
    }

    // A misspelled key is refused, not run as another job.
    let misspelled = "[source]\nrange = 100\n[[steps]]\nwith_column = { name = \"g\", expr = \"id % 4\" }\n[[steps]]\ngroupby = [\"g\"]\naggs = [\"count(*) as n\"]\n";
    let refused = submit(&addr, token, misspelled);
    assert_eq!(refused.status, 400, "{}", refused.body);
    let message = error_of(&refused);
    assert!(
        message.contains("steps[1].aggs")
            && message.contains("unknown key `aggs` in a groupby step (did you mean `agg`?)"),
        "{message}"
    );
    let file = dir.path().join("misspelled.toml");
    std::fs::write(&file, misspelled).unwrap();
    let stderr = stderr_of_failure(&floe(&cluster, &["submit", file.to_str().unwrap()]));
    assert!(
        stderr.contains(&format!("{}:5: steps[1].aggs", file.display())),
        "{stderr}"
    );

    // The replica is still up and runs the next job: the corrected one, to the right answer.
    let corrected = misspelled.replace("aggs", "agg");
    let created = submit(&addr, token, &corrected);
    assert_eq!(created.status, 201, "{}", created.body);
    let job = created.json()["job_id"].as_str().unwrap().to_owned();
    let detail = wait_for(&format!("job {job} to succeed"), WAIT, || {
        let detail = get(&addr, &format!("/api/jobs/{job}"), token).json();
        assert_ne!(detail["state"], "failed", "{detail}");
        (detail["state"] == "succeeded").then_some(detail)
    });
    assert_eq!(detail["output"]["rows"], 4, "{detail}");
    assert_eq!(get(&addr, "/api/jobs", token).json()["total"], 1);
}
