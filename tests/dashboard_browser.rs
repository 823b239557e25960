//! The dashboard in a real browser: a local cluster runs a job, then headless Chromium, driven
//! through chromedriver's WebDriver API, visits every page after it (nodes, one node, the
//! job with its task table, its logs, the overview, jobs, actors, cache, events) and again
//! during a second, long job (a groupby whose input arrives in two waves, so its aggregator
//! actors live, fed, for a while before the reduce); what a page shows is checked against the
//! REST API (task runs with their rows and workers, log lines, cache entries and their
//! cleaning, a node's workers, objects and charts, the running job's driver and aggregators
//! with their calls and restarts), and the browser console must stay free of errors. A
//! screenshot of each page
//! is saved under `target/dashboard-screenshots/`; README's picture (`docs/dashboard.png`) is
//! `job-running.png`.
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
    /// The temp dir of chromedriver and its browsers (profiles, shared-memory files), removed
    /// after the driver is killed: a session killed with it leaves its files there.
    _temp: tempfile::TempDir,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // `_temp` is removed after this, as the fields drop.
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
        let temp = tempfile::Builder::new()
            .prefix("floe-browser-")
            .tempdir()
            .unwrap();
        let child = Command::new(binary)
            .arg(format!("--port={port}"))
            .env("TMPDIR", temp.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let driver = Self {
            child,
            addr: format!("127.0.0.1:{port}"),
            _temp: temp,
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

/// Every page of the dashboard's navigation.
const PAGES: [&str; 7] = [
    "overview", "nodes", "jobs", "actors", "cache", "events", "logs",
];

/// Reads `rest` and the page's `script` until they agree (both change while a job runs).
fn until_page_matches_rest(
    what: &str,
    session: &Session<'_>,
    script: &str,
    rest: impl Fn() -> Option<Vec<Vec<String>>>,
) -> Vec<Vec<String>> {
    wait_for(what, WAIT, || {
        let expected = rest()?;
        let page = session.eval(script);
        if page.is_null() {
            return None;
        }
        (sorted_rows(&page) == expected).then_some(expected)
    })
}

/// A count as the dashboard prints it (`fmtCount`), without its thousands separators.
fn count_text(value: &Value) -> String {
    match value.as_u64() {
        Some(count) => count.to_string(),
        None => "—".to_owned(),
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
             row.children[6].textContent.replaceAll(',', ''), row.children[3].textContent]);",
    );
    let shown = sorted_rows(&shown);
    let mut expected_runs: Vec<Vec<String>> = runs
        .iter()
        .map(|run| {
            // Every run of this job computed in a worker process, which REST names.
            let worker = &run["worker"];
            assert!(worker["pid"].as_u64().unwrap() > 0, "{run}");
            vec![
                run["task"].as_str().unwrap().to_owned(),
                run["state"].as_str().unwrap().to_owned(),
                run["rows"].to_string(),
                format!("w{} (pid {})", worker["slot"], worker["pid"]),
            ]
        })
        .collect();
    expected_runs.sort();
    assert_eq!(shown, expected_runs);
    // The runs' rows add up to the job's output, computed independently above.
    let run_rows: u64 = runs.iter().map(|run| run["rows"].as_u64().unwrap()).sum();
    assert_eq!(
        run_rows,
        (0..50_000).filter(|id| id % 7 == 0).count() as u64
    );
    // The timeline has a lane per worker slot that ran a run.
    let lanes = session.eval(
        "return [...document.querySelectorAll('#task-timeline text')]
             .map(t => t.textContent).filter(t => t.includes(' · w')).length;",
    );
    let slots: std::collections::BTreeSet<(String, u64)> = runs
        .iter()
        .map(|run| {
            (
                run["node"].as_str().unwrap().to_owned(),
                run["worker"]["slot"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(lanes.as_u64().unwrap(), slots.len() as u64);
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
    let charts = session.eval("return document.querySelectorAll('.charts svg.chart').length;");
    assert_eq!(
        charts, 5,
        "tasks, rows/s, spilled, network and store charts"
    );
    visit_every_page(&session, &url, "after");

    // The cache page lists what REST lists, with the job that made each entry; its clean
    // button empties the index, and the entries leave the page.
    let cache_rows = || {
        let cache = get(http, "/api/cache", cluster.token()).json();
        let mut rows: Vec<Vec<String>> = cache["entries"]
            .as_array()?
            .iter()
            .map(|entry| {
                vec![
                    entry["fingerprint"].as_str().unwrap_or_default().to_owned(),
                    entry["job"].as_str().unwrap_or_default().to_owned(),
                ]
            })
            .collect();
        rows.sort();
        Some(rows)
    };
    let page_cache_rows = "if (document.body.dataset.loaded !== 'true') return null;
         return [...document.querySelectorAll('#cache-table tbody tr')]
             .map(row => [row.dataset.fingerprint, row.dataset.job]);";
    session.go(&format!("{url}#/cache"));
    let entries = until_page_matches_rest(
        "the cache page to list REST's entries",
        &session,
        page_cache_rows,
        cache_rows,
    );
    assert!(
        entries.iter().any(|entry| entry[1] == job),
        "the job's output is cached, made by it: {entries:?}"
    );
    let cache_png = session.screenshot("cache.png");
    session.eval(
        "window.confirm = () => true;
         [...document.querySelectorAll('button')].find(b => b.textContent === 'Clean all').click();
         return true;",
    );
    wait_for(
        "the cleaned entries to leave REST and the page",
        WAIT,
        || {
            let rest = cache_rows()?;
            let page = session.eval(page_cache_rows);
            (rest.is_empty() && page.as_array().is_some_and(Vec::is_empty)).then_some(())
        },
    );

    // One node's page: its workers, store, largest objects and charts, as REST says.
    let node = &alive[0];
    session.go(&format!("{url}#/nodes/{node}"));
    let node_rest = |field: &'static str| {
        let detail = get(http, &format!("/api/nodes/{node}"), cluster.token()).json();
        detail["live"][field].as_array().cloned()
    };
    until_page_matches_rest(
        "the node page to show REST's worker slots",
        &session,
        "if (!document.getElementById('node-workers-table')) return null;
         return [...document.querySelectorAll('#node-workers-table tbody tr')]
             .map(row => [row.dataset.slot, row.children[1].textContent]);",
        || {
            let mut rows: Vec<Vec<String>> = node_rest("worker_slots")?
                .iter()
                .map(|slot| vec![slot["slot"].to_string(), slot["pid"].to_string()])
                .collect();
            rows.sort();
            Some(rows)
        },
    );
    let slots = node_rest("worker_slots").unwrap();
    assert_eq!(slots.len(), 2, "two workers a node: {slots:?}");
    until_page_matches_rest(
        "the node page to show REST's largest objects",
        &session,
        "if (document.body.dataset.loaded !== 'true') return null;
         return [...document.querySelectorAll('#node-objects tbody tr')]
             .map(row => [row.dataset.object, row.children[2].textContent]);",
        || {
            let mut rows: Vec<Vec<String>> = node_rest("largest_objects")?
                .iter()
                .map(|object| {
                    vec![
                        object["object"].as_str().unwrap_or_default().to_owned(),
                        object["residence"].as_str().unwrap_or_default().to_owned(),
                    ]
                })
                .collect();
            rows.sort();
            Some(rows)
        },
    );
    let facts = session.wait_for(
        "the node page to show its CPU and pinned memory",
        "const cpu = document.querySelector('#node-cpu dd[data-fact=\"CPU used\"]');
         const pinned = document.querySelector('#node-store dd[data-fact=\"pinned\"]');
         return cpu && pinned ? [cpu.textContent, pinned.textContent] : null;",
    );
    assert!(facts[0].as_str().unwrap().ends_with('%'), "{facts}");
    let node_charts =
        session.eval("return document.querySelectorAll('#node-charts svg.chart').length;");
    assert_eq!(node_charts, 5);
    let history = get(http, &format!("/api/nodes/{node}/history"), cluster.token()).json();
    assert!(
        !history["samples"].as_array().unwrap().is_empty(),
        "{history}"
    );
    let node_png = session.screenshot("node.png");

    // During a running job (a groupby, whose aggregators are actors): every page loads, its
    // page shows running runs, and the actors page its driver and aggregators as REST does.
    // Its input is 6 range tasks of 4 batches of 8,192 rows, each batch held 3 s: two nodes
    // of two workers run 4 of them, whose first outputs start the aggregators after about
    // 12 s; the last 2 keep them listed, waiting for their shards, for 12 s more.
    let spec = "name = \"browser groupby\"\n[source]\nrange = 196608\n[[steps]]\nmap_batches = { udf = \"delay\", \
                version = 1, args = { ms = 3000 } }\n[[steps]]\nwith_column = { name = \"key\", \
                expr = \"id % 100\" }\n[[steps]]\ngroupby = [\"key\"]\nagg = [\"count(*) as n\"]\n";
    let created = post_json(http, "/api/jobs", cluster.token(), &json!({ "job": spec }));
    assert_eq!(created.status, 201, "{}", created.body);
    let long_job = created.json()["job_id"].as_str().unwrap().to_owned();
    session.go(&format!("{url}#/jobs/{long_job}"));
    session.wait_for(
        "the running job's page to show a running task",
        "return document.querySelector('#tasks-table tr[data-state=\"running\"]') ? true : null;",
    );
    let running_png = session.screenshot("job-running.png");
    visit_every_page(&session, &url, "during");
    session.go(&format!("{url}#/actors"));
    let actors_rest = || {
        let actors = get(
            http,
            &format!("/api/actors?job={long_job}"),
            cluster.token(),
        )
        .json();
        let mut rows: Vec<Vec<String>> = actors["actors"]
            .as_array()?
            .iter()
            .map(|actor| {
                vec![
                    actor["id"].as_str().unwrap_or_default().to_owned(),
                    actor["kind"].as_str().unwrap_or_default().to_owned(),
                    count_text(&actor["calls"]),
                    count_text(&actor["restarts"]),
                ]
            })
            .collect();
        rows.sort();
        // An aggregator is listed from its creation; it has a count of calls once it runs.
        let aggregators: Vec<&Vec<String>> = rows
            .iter()
            .filter(|row| row[1] == "HashShuffleAggregator")
            .collect();
        let running =
            !aggregators.is_empty() && aggregators.iter().all(|row| row[2].parse::<u64>().is_ok());
        running.then_some(rows)
    };
    let actors = until_page_matches_rest(
        "the actors page to show the running job's actors and calls as REST does",
        &session,
        &format!(
            "if (document.body.dataset.loaded !== 'true') return null;
             return [...document.querySelectorAll('#actors-table tbody tr')]
                 .filter(row => row.children[2].textContent === '{long_job}')
                 .map(row => [row.dataset.actor, row.children[1].textContent,
                     row.children[5].textContent.replaceAll(',', ''),
                     row.children[6].textContent.replaceAll(',', '')]);"
        ),
        actors_rest,
    );
    let drivers: Vec<&Vec<String>> = actors.iter().filter(|row| row[1] == "JobDriver").collect();
    assert_eq!(drivers.len(), 1, "{actors:?}");
    assert_eq!(
        drivers[0][2..],
        ["—".to_owned(), "0".to_owned()],
        "no calls, first attempt"
    );
    // Every aggregator the page shows has a count of calls (as REST counts them, which the
    // page matched above; they are pushed shards only once every map task ended, a moment
    // before the job does, so the count is not asserted here but in the driver's
    // `progress_counts_every_aggregators_calls_while_the_reduce_runs`), and none had to be
    // created again.
    let aggregators: Vec<&Vec<String>> = actors
        .iter()
        .filter(|row| row[1] == "HashShuffleAggregator")
        .collect();
    assert!(!aggregators.is_empty(), "{actors:?}");
    for row in &aggregators {
        assert!(row[2].parse::<u64>().is_ok(), "{row:?}");
        assert_eq!(row[3], "0", "{row:?}");
    }
    let actors_png = session.screenshot("actors.png");

    // The jobs page filtered by name, typed into its box: the jobs REST finds by that name.
    session.go(&format!("{url}#/jobs"));
    session.wait_for(
        "the jobs page to load",
        "return document.body.dataset.loaded === 'true' && document.getElementById('jobs-name')
             ? true : null;",
    );
    session.eval(
        "const input = document.getElementById('jobs-name');
         input.value = 'groupby';
         input.form.requestSubmit();
         return true;",
    );
    let named = until_page_matches_rest(
        "the jobs page to list the jobs named like 'groupby' as REST does",
        &session,
        "if (document.body.dataset.loaded !== 'true' || !location.hash.includes('name=groupby'))
             return null;
         return [...document.querySelectorAll('#jobs-table tbody tr')]
             .map(row => [row.dataset.jobId, row.children[1].textContent]);",
        || {
            let jobs = get(http, "/api/jobs?all=true&name=groupby", cluster.token()).json();
            let mut rows: Vec<Vec<String>> = jobs["jobs"]
                .as_array()?
                .iter()
                .map(|job| {
                    vec![
                        job["id"].as_str().unwrap_or_default().to_owned(),
                        job["name"].as_str().unwrap_or_default().to_owned(),
                    ]
                })
                .collect();
            rows.sort();
            Some(rows)
        },
    );
    assert_eq!(
        named,
        [vec![long_job.clone(), "browser groupby".to_owned()]],
        "only the named job, not the first one"
    );
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
        cache_png,
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

/// Visits every page of the navigation, each until it has loaded, and saves its screenshot
/// as `<page>-<moment>.png` (`moment`: `after` or `during` a job).
fn visit_every_page(session: &Session<'_>, url: &str, moment: &str) {
    for page in PAGES {
        session.go(&format!("{url}#/{page}"));
        session.wait_for(
            &format!("the {page} page to load ({moment} a job)"),
            "return document.body.dataset.loaded === 'true' ? true : null;",
        );
        session.screenshot(&format!("{page}-{moment}.png"));
    }
}
