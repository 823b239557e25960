//! The dashboard in a real browser: a local cluster runs a job, then headless Chromium, driven
//! through chromedriver's WebDriver API, visits every page after it (nodes, one node, the
//! job with its task table, its logs, the overview, jobs, actors, cache, events) and, during a
//! second, long job, its page and the actors page; what a page shows is checked against the
//! REST API, and the browser console must stay free of errors. A screenshot of each page is
//! saved under `target/dashboard-screenshots/`.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`.ci/run` installs them). Set
//! `FLOE_CHROMEDRIVER` / `FLOE_CHROMIUM` to use other paths.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use floe_client::{Dataset, LocalCluster, LocalClusterOptions, col, lit};
use floe_testkit::http::{get, post_json, request, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

/// chromedriver on a free loopback port; killed on drop, even when the test fails.
struct Driver {
    child: Child,
    addr: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn executable(variable: &str, default: &str) -> String {
    let path = std::env::var(variable).unwrap_or_else(|_| default.to_owned());
    assert!(
        std::path::Path::new(&path).exists(),
        "{path} is missing: install Debian's chromium and chromium-driver (as .ci/run does), \
         or set {variable}"
    );
    path
}

impl Driver {
    fn start() -> Self {
        let binary = executable("FLOE_CHROMEDRIVER", "/usr/bin/chromedriver");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(binary)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let driver = Self {
            child,
            addr: format!("127.0.0.1:{port}"),
        };
        wait_for("chromedriver to listen", WAIT, || {
            std::net::TcpStream::connect(&driver.addr).ok()
        });
        driver
    }

    fn call(&self, method: &str, path: &str, body: &Value) -> Value {
        let payload = body.to_string();
        let response = request(
            method,
            &self.addr,
            path,
            &[("Content-Type", "application/json")],
            if method == "GET" {
                b""
            } else {
                payload.as_bytes()
            },
        );
        assert_eq!(
            response.status, 200,
            "webdriver {method} {path}: {}",
            response.body
        );
        response.json()["value"].clone()
    }

    fn session(&self) -> Session<'_> {
        // Debian's /usr/bin/chromium is a shell wrapper that chromedriver cannot drive.
        let chromium = executable("FLOE_CHROMIUM", "/usr/lib/chromium/chromium");
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:loggingPrefs": {"browser": "ALL"},
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1400,1000"]
            }
        }}});
        let created = self.call("POST", "/session", &capabilities);
        Session {
            driver: self,
            id: created["sessionId"].as_str().unwrap().to_owned(),
        }
    }
}

/// A browser session; closed on drop.
struct Session<'a> {
    driver: &'a Driver,
    id: String,
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        let path = format!("/session/{}", self.id);
        let _ = request("DELETE", &self.driver.addr, &path, &[], b"");
    }
}

impl Session<'_> {
    fn go(&self, url: &str) {
        self.driver.call(
            "POST",
            &format!("/session/{}/url", self.id),
            &json!({ "url": url }),
        );
    }

    /// Runs `script` (a function body) in the page and returns its value.
    fn eval(&self, script: &str) -> Value {
        self.driver.call(
            "POST",
            &format!("/session/{}/execute/sync", self.id),
            &json!({ "script": script, "args": [] }),
        )
    }

    /// Polls `script` until it returns something other than null or false.
    fn wait_for(&self, what: &str, script: &str) -> Value {
        wait_for(what, WAIT, || {
            let value = self.eval(script);
            (!value.is_null() && value != false).then_some(value)
        })
    }

    /// The console's error entries since the last call (reading the log empties it).
    fn console_errors(&self) -> Vec<String> {
        let entries = self.driver.call(
            "POST",
            &format!("/session/{}/se/log", self.id),
            &json!({ "type": "browser" }),
        );
        entries
            .as_array()
            .unwrap()
            .iter()
            .filter(|entry| entry["level"] == "SEVERE")
            .map(|entry| entry["message"].as_str().unwrap_or_default().to_owned())
            .collect()
    }

    fn screenshot(&self, name: &str) -> PathBuf {
        let encoded = self.driver.call(
            "GET",
            &format!("/session/{}/screenshot", self.id),
            &Value::Null,
        );
        let png = base64::engine::general_purpose::STANDARD
            .decode(encoded.as_str().unwrap())
            .unwrap();
        assert!(png.starts_with(b"\x89PNG"), "the screenshot is not a PNG");
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .parent()
            .unwrap()
            .join("dashboard-screenshots");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, png).unwrap();
        path
    }
}

/// A page's table rows, read as arrays of strings, sorted.
fn sorted_rows(rows: &Value) -> Vec<Vec<String>> {
    let mut rows: Vec<Vec<String>> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|cell| cell.as_str().unwrap().to_owned())
                .collect()
        })
        .collect();
    rows.sort();
    rows
}

#[test]
fn dashboard_shows_every_alive_node_and_the_finished_job() {
    let runtime = floe_testkit::cluster::runtime();
    let mut options = LocalClusterOptions::new(2, env!("CARGO_BIN_EXE_floe").into());
    options.workers_per_node = 2;
    let cluster = runtime.block_on(LocalCluster::start(options)).unwrap();
    let url = cluster.dashboard_url();
    let http = url.trim_start_matches("http://").trim_end_matches('/');

    let job = runtime.block_on(async {
        let client = cluster.connect().await.unwrap();
        let dataset = Dataset::range(50_000)
            .unwrap()
            .filter((col("id") % lit(7i64)).eq(lit(0i64)))
            .unwrap();
        let job = client.submit(&dataset).await.unwrap();
        let output = job.wait().await.unwrap();
        assert_eq!(
            output.rows(),
            (0..50_000).filter(|id| id % 7 == 0).count() as u64
        );
        job.id().to_string()
    });
    // The node ids the API reports alive: what the page must list. The API serves the
    // replica's applied state, republished every 250 ms, so it may trail the job by that.
    let mut alive: Vec<String> = wait_for("the API to list both nodes", WAIT, || {
        let nodes = get(http, "/api/nodes?state=alive", cluster.token()).json()["nodes"].clone();
        let ids: Vec<String> = nodes
            .as_array()?
            .iter()
            .filter_map(|node| Some(node["id"].as_str()?.to_owned()))
            .collect();
        (ids.len() == 2).then_some(ids)
    });
    alive.sort();

    let driver = Driver::start();
    let session = driver.session();
    // Reads need a token: set it in the tab as the "token" link would.
    session.go(&url);
    session.eval(&format!(
        "sessionStorage.setItem('floe-token', {}); return true;",
        json!(cluster.token())
    ));
    // The first load, before the token, was refused: not the pages' fault.
    let _ = session.console_errors();

    session.go(&format!("{url}#/nodes"));
    let listed = session.wait_for(
        "the Nodes page to list both nodes",
        "const rows = [...document.querySelectorAll('#nodes-table tr[data-node-id]')];
         if (document.body.dataset.loaded !== 'true' || rows.length < 2) return null;
         return rows.map(row => [row.dataset.nodeId, row.dataset.state]);",
    );
    let listed = sorted_rows(&listed);
    let expected: Vec<Vec<String>> = alive
        .iter()
        .map(|id| vec![id.clone(), "alive".to_owned()])
        .collect();
    assert_eq!(listed, expected);
    let nodes_png = session.screenshot("nodes.png");

    session.go(&format!("{url}#/jobs/{job}"));
    let state = session.wait_for(
        "the job page to show the job finished",
        "const state = document.getElementById('job-state');
         return state && state.textContent === 'succeeded' ? state.textContent : null;",
    );
    assert_eq!(state, "succeeded");
    let operators = session.eval("return document.querySelectorAll('.operator').length;");
    assert!(
        operators.as_u64().unwrap() >= 1,
        "no operator boxes: {operators}"
    );
    // The task table shows what the REST API says: the same runs, the same rows.
    let tasks = get(http, &format!("/api/jobs/{job}/tasks"), cluster.token()).json();
    let runs = tasks["tasks"].as_array().unwrap();
    assert!(!runs.is_empty(), "{tasks}");
    let shown = session.wait_for(
        "the job page to show its task table",
        "const rows = [...document.querySelectorAll('#tasks-table tbody tr')];
         if (rows.length === 0 || !document.getElementById('task-timeline')) return null;
         return rows.map(row => [row.dataset.task, row.dataset.state,
             row.children[5].textContent.replaceAll(',', '')]);",
    );
    let shown = sorted_rows(&shown);
    let mut expected_runs: Vec<Vec<String>> = runs
        .iter()
        .map(|run| {
            vec![
                run["task"].as_str().unwrap().to_owned(),
                run["state"].as_str().unwrap().to_owned(),
                run["rows"].to_string(),
            ]
        })
        .collect();
    expected_runs.sort();
    assert_eq!(shown, expected_runs);
    let job_png = session.screenshot("job.png");

    // The job's log lines: the page shows what the REST API answers (the lines of a finished
    // job can still grow by a clean-up line, so both are read until they agree).
    session.go(&format!("{url}#/logs?job={job}"));
    wait_for("the log page to show the job's lines", WAIT, || {
        let rest = get(http, &format!("/api/jobs/{job}/logs"), cluster.token()).json();
        let rest: Vec<String> = rest["lines"]
            .as_array()?
            .iter()
            .filter_map(|line| Some(line["text"].as_str()?.to_owned()))
            .collect();
        let page = session.eval(
            "if (document.body.dataset.loaded !== 'true') return null;
             return [...document.querySelectorAll('#logs-table tbody tr')]
                 .map(row => row.lastChild.textContent);",
        );
        let page: Vec<String> = page
            .as_array()?
            .iter()
            .filter_map(|text| Some(text.as_str()?.to_owned()))
            .collect();
        (!rest.is_empty() && page == rest).then_some(())
    });
    let logs_png = session.screenshot("logs.png");

    session.go(&format!("{url}#/overview"));
    session.wait_for(
        "the overview to report the cluster healthy",
        "const health = document.getElementById('health');
         return document.body.dataset.loaded === 'true' && health
             && health.textContent.trim() === 'ok' ? true : null;",
    );
    let overview_png = session.screenshot("overview.png");
    for page in ["jobs", "cache", "events", "actors", "logs"] {
        session.go(&format!("{url}#/{page}"));
        session.wait_for(
            &format!("the {page} page to load"),
            "return document.body.dataset.loaded === 'true' ? true : null;",
        );
    }
    // One node's page: its live store and workers, as `GET /api/nodes/ID` says.
    let node = &alive[0];
    let detail = get(http, &format!("/api/nodes/{node}"), cluster.token()).json();
    let workers = detail["live"]["workers"].as_u64().unwrap();
    session.go(&format!("{url}#/nodes/{node}"));
    let shown = session.wait_for(
        "the node page to show its workers and store",
        "const workers = document.getElementById('node-workers');
         const store = document.getElementById('node-store');
         return workers && store ? workers.textContent : null;",
    );
    assert!(
        shown
            .as_str()
            .unwrap()
            .starts_with(&format!("{workers} workers ready")),
        "{shown}"
    );
    let node_png = session.screenshot("node.png");

    // During a running job: its page shows running runs, and the actors page its driver.
    let spec = "[source]\nrange = 4000000000\n[[steps]]\nfilter = \"id % 7 == 0\"\n";
    let created = post_json(http, "/api/jobs", cluster.token(), &json!({ "job": spec }));
    assert_eq!(created.status, 201, "{}", created.body);
    let long_job = created.json()["job_id"].as_str().unwrap().to_owned();
    session.go(&format!("{url}#/jobs/{long_job}"));
    session.wait_for(
        "the running job's page to show a running task",
        "return document.querySelector('#tasks-table tr[data-state=\"running\"]') ? true : null;",
    );
    let running_png = session.screenshot("job-running.png");
    session.go(&format!("{url}#/actors"));
    let drivers = session.wait_for(
        "the actors page to list the running job's driver",
        &format!(
            "const rows = [...document.querySelectorAll('#actors-table tbody tr')]
                 .filter(row => row.children[2].textContent === '{long_job}'
                     && row.children[1].textContent === 'JobDriver');
             return rows.length ? rows.length : null;"
        ),
    );
    assert_eq!(drivers, 1);
    let actors_png = session.screenshot("actors.png");
    let stopped = post_json(
        http,
        &format!("/api/jobs/{long_job}/stop"),
        cluster.token(),
        &json!({}),
    );
    assert_eq!(stopped.status, 200, "{}", stopped.body);

    let errors = session.console_errors();
    assert!(errors.is_empty(), "the console has errors: {errors:?}");
    for png in [
        nodes_png,
        job_png,
        logs_png,
        overview_png,
        node_png,
        running_png,
        actors_png,
    ] {
        assert!(
            std::fs::metadata(&png).unwrap().len() > 10_000,
            "{png:?} is blank"
        );
    }
}
