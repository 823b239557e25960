//! Streamed results on real processes: a job's output reaches the client while the job still
//! runs, in order and equal to an independent computation; a client that lags holds
//! production (the final operator waits for its acknowledgements); a stream read to its end
//! leaves its job ended (the record says so at once); a client that stops
//! reading cancels the job and leaves no block in any store; a job failing mid-stream ends
//! the stream with its error. And `GET /api/jobs/ID/result`: a held result as an Arrow IPC
//! stream (decoded and compared), a quick look as JSON rows, and the 404, 409 and 410 errors.

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use arrow::array::AsArray;
use arrow::datatypes::Int64Type;
use arrow::record_batch::RecordBatch;
use floe_client::{
    Client, Dataset, Error, JobOptions, ResultDelivery, ResultStream, UdfCall, col, lit,
};
use floe_core::job::CacheMode;
use floe_testkit::batches::int_column;
use floe_testkit::cluster::{TestCluster, TestClusterConfig, fast_timing, runtime};
use floe_testkit::http::{Response, get, get_bytes, try_get_bytes, wait_for};

/// Rows per task of a `range` source (4 reader batches of 8192 rows).
const ROWS_PER_TASK: u64 = 4 * 8192;

async fn start(nodes: usize) -> TestCluster {
    let config = TestClusterConfig {
        settings: fast_timing(),
        ..TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"))
    };
    TestCluster::start(config, nodes).await
}

/// `tasks` tasks of `range`, each slowed by `delay_ms` per batch, with a computed column.
fn slow_range(tasks: u64, delay_ms: i64) -> Dataset {
    Dataset::range(tasks * ROWS_PER_TASK)
        .unwrap()
        .map_batches(UdfCall::new("delay", 1).with("ms", delay_ms))
        .unwrap()
        .with_column("twice", col("id") * lit(2i64))
        .unwrap()
}

fn streamed(buffer_bytes: u64) -> JobOptions {
    JobOptions {
        cache: CacheMode::NoCache,
        result: ResultDelivery::Streamed { buffer_bytes },
        ..JobOptions::default()
    }
}

/// Reads the stream to its end or its first error.
async fn read_all(stream: &mut ResultStream) -> (Vec<RecordBatch>, Option<Error>) {
    let mut batches = Vec::new();
    loop {
        match stream.next_batch().await {
            Ok(Some(batch)) => batches.push(batch),
            Ok(None) => return (batches, None),
            Err(error) => return (batches, Some(error)),
        }
    }
}

/// The source operator's tasks done and in total, from the driver's latest report.
async fn source_tasks(client: &Client, stream: &ResultStream) -> (u64, u64) {
    let job = client.job(stream.job());
    loop {
        if let Some(progress) = job.progress().await.unwrap() {
            let source = &progress.operators[0];
            return (source.tasks_done, source.tasks_total.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until no node's store holds an object, in memory or spilled.
async fn wait_until_stores_empty(cluster: &TestCluster, nodes: usize, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut held = Vec::new();
        for index in 0..nodes {
            let store = cluster.node_status(index).await.store;
            held.push((store.used, store.spilled_bytes, store.objects_in_memory));
        }
        if held.iter().all(|held| *held == (0, 0, 0)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the stores still hold {held:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_result_arrives_while_the_job_runs_and_a_lagging_reader_holds_production() {
    let cluster = start(2).await;
    let client = cluster.connect().await;
    let tasks = 16;
    // A one-byte buffer: one unacknowledged block stops the final operator.
    let mut stream = client
        .stream_with(&slow_range(tasks, 20), streamed(1))
        .await
        .unwrap();
    let first = stream.next_batch().await.unwrap().unwrap();
    // The reader lags: what runs finishes, but nothing more of the final operator starts.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (done, total) = source_tasks(&client, &stream).await;
    assert_eq!(total, tasks);
    assert!(
        done <= tasks / 2,
        "{done} of {total} tasks ran while the reader held one unacknowledged block"
    );
    let (mut batches, error) = read_all(&mut stream).await;
    assert!(error.is_none(), "{error:?}");
    batches.insert(0, first);
    // In order, every row once, each with the column computed independently here.
    let n = i64::try_from(tasks * ROWS_PER_TASK).unwrap();
    assert_eq!(int_column(&batches, "id"), (0..n).collect::<Vec<_>>());
    assert_eq!(
        int_column(&batches, "twice"),
        (0..n).map(|id| id * 2).collect::<Vec<_>>()
    );
    assert!(stream.blocks_read() >= tasks);
    // The job ends once every block is read, holding nothing: each was freed as acknowledged.
    let output = client.job(stream.job()).wait().await.unwrap();
    assert!(output.blocks.is_empty(), "{:?}", output.blocks);
    wait_until_stores_empty(&cluster, 2, "after the stream was read to its end").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stops_mid_stream_cancels_the_job_and_no_block_stays_held() {
    let cluster = start(2).await;
    let client = cluster.connect().await;
    let mut stream = client
        .stream_with(&slow_range(12, 20), streamed(4 << 20))
        .await
        .unwrap();
    let first = stream.next_batch().await.unwrap().unwrap();
    assert_eq!(first.column(0).as_primitive::<Int64Type>().value(0), 0);
    let job = client.job(stream.job());
    drop(stream);
    match job.wait().await {
        Err(Error::JobCancelled(cancelled)) => assert_eq!(cancelled, job.id()),
        other => panic!(
            "the abandoned job should be cancelled, got {:?}",
            other.err()
        ),
    }
    wait_until_stores_empty(&cluster, 2, "after the reader dropped its stream").await;
    // The cluster serves the next stream.
    let mut next = client
        .stream_with(&slow_range(2, 0), streamed(4 << 20))
        .await
        .unwrap();
    let (batches, error) = read_all(&mut next).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(int_column(&batches, "id").len() as u64, 2 * ROWS_PER_TASK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_read_to_its_end_leaves_its_job_ended() {
    let cluster = start(1).await;
    let client = cluster.connect().await;
    // The driver says the output is complete just before it commits the job's success: a
    // small job, read at once after its end, finds that window if the stream does not wait.
    for n in 1..=20i64 {
        let mut stream = client
            .stream_with(&Dataset::range(n as u64).unwrap(), streamed(64 << 20))
            .await
            .unwrap();
        let (batches, error) = read_all(&mut stream).await;
        assert!(error.is_none(), "{error:?}");
        assert_eq!(int_column(&batches, "id"), (0..n).collect::<Vec<_>>());
        let job = client.job(stream.job());
        let stats = job.stats().await.unwrap();
        assert!(
            stats.is_some(),
            "job {} has not ended after its stream",
            stream.job()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_failing_mid_stream_ends_the_stream_with_its_error() {
    let cluster = start(1).await;
    let client = cluster.connect().await;
    // Division by zero at row 200,000, in the seventh of eight tasks.
    let failing = slow_range(8, 20)
        .with_column("q", col("id") / (col("id") - lit(200_000i64)))
        .unwrap();
    let mut stream = client
        .stream_with(&failing, streamed(64 << 20))
        .await
        .unwrap();
    let (batches, error) = read_all(&mut stream).await;
    let Some(Error::JobFailed { job, message }) = error else {
        panic!("the stream should end with the job's failure, got {error:?}");
    };
    assert_eq!(job, stream.job());
    assert!(message.contains("zero"), "{message}");
    // What arrived before the failure is the output's beginning, in order.
    let ids = int_column(&batches, "id");
    assert_eq!(ids, (0..ids.len() as i64).collect::<Vec<_>>());
    assert!(ids.len() < 200_000);
    // The stream stays ended, and the failed job holds nothing.
    assert!(stream.next_batch().await.unwrap().is_none());
    wait_until_stores_empty(&cluster, 1, "after the job failed mid-stream").await;
}

#[test]
fn the_rest_api_serves_a_held_result_as_an_arrow_stream_and_as_json_rows() {
    let runtime = runtime();
    let cluster = runtime.block_on(start(2));
    let addr = cluster.schedulers.http_addr(1).unwrap().to_owned();
    let token = cluster.config.token().to_owned();
    let client = runtime.block_on(cluster.connect());
    let n = 100_000i64;
    let dataset = Dataset::range(n as u64)
        .unwrap()
        .with_column("twice", col("id") * lit(2i64))
        .unwrap();
    let options = JobOptions {
        cache: CacheMode::NoCache,
        ..JobOptions::default()
    };
    let (job, output) = runtime.block_on(async {
        let job = client.submit_with(&dataset, options).await.unwrap();
        let output = job.wait().await.unwrap();
        output.keep();
        (job, output)
    });
    assert!(output.blocks.len() > 1, "{:?}", output.blocks);
    let path = format!("/api/jobs/{}/result", job.id());

    // The replica's HTTP side answers from its applied state, which may lag a moment: the
    // job unknown (404), then running (409).
    let whole = wait_for(
        "the job's end to reach the HTTP API",
        Duration::from_secs(30),
        || {
            let response = get_bytes(&addr, &path, &token);
            (!matches!(response.status, 404 | 409)).then_some(response)
        },
    );
    assert_eq!(
        whole.status,
        200,
        "{}",
        String::from_utf8_lossy(&whole.body)
    );
    assert_eq!(
        whole.content_type.as_deref(),
        Some("application/vnd.apache.arrow.stream")
    );
    let batches = decode_stream(&whole.body);
    assert_eq!(int_column(&batches, "id"), (0..n).collect::<Vec<_>>());
    assert_eq!(
        int_column(&batches, "twice"),
        (0..n).map(|id| id * 2).collect::<Vec<_>>()
    );
    let limited = decode_stream(&get_bytes(&addr, &format!("{path}?limit=10"), &token).body);
    assert_eq!(int_column(&limited, "id"), (0..10).collect::<Vec<_>>());

    let look = get(&addr, &format!("{path}?format=json&limit=3"), &token);
    assert_eq!(look.status, 200, "{}", look.body);
    let look = look.json();
    assert_eq!(look["columns"], serde_json::json!(["id", "twice"]));
    assert_eq!(
        look["rows"],
        serde_json::json!([{"id": 0, "twice": 0}, {"id": 1, "twice": 2}, {"id": 2, "twice": 4}])
    );
    assert_eq!(look["truncated"], true);

    // Reads need the token; bad queries, unknown jobs and released results are refused in
    // the API's JSON error shape.
    assert_eq!(get(&addr, &path, "").status, 401);
    let refused = get(&addr, &format!("{path}?format=xml"), &token);
    assert_eq!(refused.status, 400, "{}", refused.body);
    let refused = get(&addr, &format!("{path}?offset=3"), &token);
    assert_eq!(refused.status, 400, "{}", refused.body);
    let unknown = get(&addr, "/api/jobs/999/result", &token);
    assert_eq!(unknown.status, 404);
    assert!(unknown.json()["error"].as_str().unwrap().contains("999"));
    runtime.block_on(job.release_output()).unwrap();
    // Served (200), or a block already freed while the replica has not applied the release
    // (502, or a 200 stream cut short when a later block is freed under it), until it has.
    let released = wait_for("the release to apply", Duration::from_secs(30), || {
        let response = try_get_bytes(&addr, &path, &token).ok()?;
        (!matches!(response.status, 200 | 502)).then(|| Response {
            status: response.status,
            body: String::from_utf8_lossy(&response.body).into_owned(),
        })
    });
    assert_eq!(released.status, 410, "{}", released.body);
    assert!(
        released.json()["error"]
            .as_str()
            .unwrap()
            .contains("no longer held")
    );

    // A streamed job's result was freed as its reader read it.
    let streamed_job = runtime.block_on(async {
        let mut stream = client
            .stream_with(&dataset, streamed(64 << 20))
            .await
            .unwrap();
        let (_, error) = read_all(&mut stream).await;
        assert!(error.is_none(), "{error:?}");
        let job = client.job(stream.job());
        job.wait().await.unwrap();
        job.id()
    });
    // Unknown (404) or running (409) until the replica's HTTP side applied its end.
    let gone = wait_for(
        "the streamed job's end to reach the HTTP API",
        Duration::from_secs(30),
        || {
            let response = get(&addr, &format!("/api/jobs/{streamed_job}/result"), &token);
            (!matches!(response.status, 404 | 409)).then_some(response)
        },
    );
    assert_eq!(gone.status, 410, "{}", gone.body);
}

fn decode_stream(body: &[u8]) -> Vec<RecordBatch> {
    arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(body), None)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}
