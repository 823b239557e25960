//! `GET /api/jobs/ID/result`: a succeeded job's held output, read from the nodes that hold
//! it (as a cluster member, block by block) and sent as one Arrow IPC stream
//! (`application/vnd.apache.arrow.stream`) whose batches leave as each block arrives, so the
//! replica holds one block at a time whatever the output's size. `?limit=N` stops after `N`
//! rows; `?format=json` answers the first rows (100 unless `limit` says, at most
//! [`MAX_JSON_ROWS`]) as JSON objects instead, for a quick look.
//!
//! Reading does not release the output: it stays held for its owner. A job that is unknown
//! is a 404, one whose output was released (or streamed to its client and freed as read) a
//! 410, one that has not succeeded a 409, in the API's `{"error": …}` shape. A block that
//! cannot be read after the stream began aborts the response, so the reader sees a stream
//! without its end marker rather than a short result that looks whole.

use std::collections::{BTreeMap, VecDeque};
use std::io::Cursor;
use std::sync::Arc;

use actix_web::http::StatusCode;
use actix_web::web::Bytes;
use actix_web::{HttpResponse, web};
use arrow::datatypes::Schema;
use arrow::ipc::reader::FileReader;
use arrow::ipc::writer::StreamWriter;
use arrow::record_batch::RecordBatch;
use floe_api::node_protocol::NodeProtocol;
use floe_api::state::{JobRecord, JobStatus};
use floe_core::job::{JobSpec, OutputBlock, ResultDelivery};
use floe_core::wire::{RpcClient, WireConfig};
use floe_core::{JobId, NodeId};
use serde::{Deserialize, Serialize};

use super::api::{ApiError, Shared, parse_job_id, unknown_job};

/// The IANA media type of the Arrow IPC streaming format.
const ARROW_STREAM: &str = "application/vnd.apache.arrow.stream";
/// Rows a JSON answer carries when `limit` does not say.
const DEFAULT_JSON_ROWS: u64 = 100;
/// The most rows a JSON answer carries: it is built whole in memory, and is for a look, not
/// for moving data (the Arrow stream is).
const MAX_JSON_ROWS: u64 = 10_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ResultQuery {
    limit: Option<u64>,
    format: Option<ResultFormat>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum ResultFormat {
    Arrow,
    Json,
}

#[derive(Serialize)]
struct ResultJson {
    job: String,
    columns: Vec<String>,
    rows: Vec<serde_json::Value>,
    /// Whether the output has more rows than were sent.
    truncated: bool,
}

pub(super) async fn job_result(
    shared: web::Data<Shared>,
    id: web::Path<String>,
    query: web::Query<ResultQuery>,
) -> Result<HttpResponse, ApiError> {
    let job = parse_job_id(&id)?;
    let state = shared.state();
    let record = state.jobs.get(&job).ok_or_else(|| unknown_job(job))?;
    let schema = readable(job, record)?;
    let holders: BTreeMap<NodeId, String> = state
        .alive_nodes()
        .map(|node| (node.id, node.addresses.rpc.clone()))
        .collect();
    let reader = OutputReader {
        job,
        wire: shared.node_wire().clone(),
        blocks: record.outputs.iter().copied().collect(),
        holders,
        connections: BTreeMap::new(),
        pending: VecDeque::new(),
    };
    match query.format.unwrap_or(ResultFormat::Arrow) {
        ResultFormat::Arrow => match arrow_stream(reader, schema, query.limit).await {
            // A block gone from its node: the release that freed it may have applied since.
            Err(error) if error.status() == StatusCode::BAD_GATEWAY => {
                if let Some(record) = shared.state().jobs.get(&job) {
                    readable(job, record)?;
                }
                Err(error)
            }
            answer => answer,
        },
        ResultFormat::Json => {
            let limit = query.limit.unwrap_or(DEFAULT_JSON_ROWS);
            if limit > MAX_JSON_ROWS {
                return Err(ApiError::bad_request(format!(
                    "limit={limit} is over {MAX_JSON_ROWS} rows for format=json; read more as \
                     the Arrow stream (no format)"
                )));
            }
            json_rows(reader, &schema, limit).await
        }
    }
}

/// The schema of `record`'s output, when it can be read now; why not otherwise.
fn readable(job: JobId, record: &JobRecord) -> Result<Arc<Schema>, ApiError> {
    let conflict = |message: String| ApiError::new(StatusCode::CONFLICT, message);
    match &record.status {
        JobStatus::Succeeded => {}
        JobStatus::Pending | JobStatus::Running => {
            return Err(conflict(format!(
                "job {job} is {}: its result can be read once it has succeeded",
                record.status.name()
            )));
        }
        JobStatus::Failed { message } => {
            return Err(conflict(format!(
                "job {job} failed, it has no result: {message}"
            )));
        }
        JobStatus::Cancelled => {
            return Err(conflict(format!(
                "job {job} was cancelled, it has no result"
            )));
        }
    }
    if let Some(release) = &record.release {
        return Err(ApiError::new(
            StatusCode::GONE,
            format!("job {job}'s result is no longer held: {release}"),
        ));
    }
    let spec = JobSpec::decode(&record.spec).map_err(|error| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("job {job}'s spec does not decode here: {error}"),
        )
    })?;
    if let ResultDelivery::Streamed { .. } = spec.options.result {
        return Err(ApiError::new(
            StatusCode::GONE,
            format!("job {job} streamed its result to its client, which freed it as it read"),
        ));
    }
    Ok(Arc::new(spec.plan.schema().clone()))
}

/// Reads an output's blocks in order, one connection per holding node.
struct OutputReader {
    job: JobId,
    wire: WireConfig,
    blocks: VecDeque<OutputBlock>,
    holders: BTreeMap<NodeId, String>,
    connections: BTreeMap<NodeId, RpcClient<NodeProtocol>>,
    /// Batches of the block read last, not yet handed out.
    pending: VecDeque<RecordBatch>,
}

impl OutputReader {
    async fn next_batch(&mut self) -> Result<Option<RecordBatch>, String> {
        loop {
            if let Some(batch) = self.pending.pop_front() {
                return Ok(Some(batch));
            }
            let Some(block) = self.blocks.pop_front() else {
                return Ok(None);
            };
            self.pending = self.read(&block).await?.into();
        }
    }

    async fn read(&mut self, block: &OutputBlock) -> Result<Vec<RecordBatch>, String> {
        let lost = |reason: String| {
            format!(
                "job {}'s result block {} on node {} cannot be read: {reason}",
                self.job, block.object, block.node
            )
        };
        let mut client = match self.connections.remove(&block.node) {
            Some(client) => client,
            None => {
                let addr = self
                    .holders
                    .get(&block.node)
                    .ok_or_else(|| lost("the node is not alive".into()))?;
                RpcClient::connect(addr.clone(), self.wire.clone())
                    .await
                    .map_err(|error| lost(error.to_string()))?
            }
        };
        let bytes = floe_api::fetch::fetch_object(&mut client, block.object)
            .await
            .map_err(|error| lost(error.to_string()))?;
        self.connections.insert(block.node, client);
        FileReader::try_new(Cursor::new(bytes), None)
            .and_then(|reader| reader.collect::<Result<Vec<_>, _>>())
            .map_err(|error| lost(format!("not an Arrow block: {error}")))
    }
}

/// Casts a block's batch onto the plan's schema (a kernel's fields may differ in metadata or
/// nullability; the plan's schema is the contract, as in the Rust client).
fn with_schema(schema: &Arc<Schema>, batch: &RecordBatch) -> Result<RecordBatch, String> {
    RecordBatch::try_new(Arc::clone(schema), batch.columns().to_vec())
        .map_err(|error| format!("a result block does not match the plan's schema: {error}"))
}

/// What the streaming body still has to do.
struct StreamState {
    reader: OutputReader,
    writer: Option<StreamWriter<Vec<u8>>>,
    schema: Arc<Schema>,
    /// Rows still to send.
    remaining: u64,
}

impl StreamState {
    /// The next piece of the body; `None` once the end marker went.
    async fn next_piece(&mut self) -> Option<Result<Bytes, String>> {
        let writer = self.writer.as_mut()?;
        let batch = if self.remaining == 0 {
            None
        } else {
            match self.reader.next_batch().await {
                Ok(batch) => batch,
                Err(error) => return Some(Err(error)),
            }
        };
        let written = match batch {
            Some(batch) => {
                let rows = usize::try_from(self.remaining).unwrap_or(usize::MAX);
                let batch = batch.slice(0, batch.num_rows().min(rows));
                self.remaining -= batch.num_rows() as u64;
                with_schema(&self.schema, &batch)
                    .and_then(|batch| writer.write(&batch).map_err(|error| error.to_string()))
            }
            None => {
                let mut writer = self.writer.take()?;
                let finished = writer.finish().map_err(|error| error.to_string());
                return Some(finished.map(|()| Bytes::from(std::mem::take(writer.get_mut()))));
            }
        };
        Some(written.map(|()| Bytes::from(std::mem::take(writer.get_mut()))))
    }
}

async fn arrow_stream(
    mut reader: OutputReader,
    schema: Arc<Schema>,
    limit: Option<u64>,
) -> Result<HttpResponse, ApiError> {
    let job = reader.job;
    // Read before the answer starts, so a result that cannot be read at all is an error
    // with its reason rather than a cut stream.
    let first = reader
        .next_batch()
        .await
        .map_err(|error| ApiError::new(StatusCode::BAD_GATEWAY, error))?;
    if let Some(first) = first {
        reader.pending.push_front(first);
    }
    // The schema message goes first, so an empty result is still a valid stream.
    let writer = StreamWriter::try_new(Vec::new(), &schema).map_err(|error| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot write job {job}'s schema as Arrow: {error}"),
        )
    })?;
    let state = StreamState {
        reader,
        writer: Some(writer),
        schema,
        remaining: limit.unwrap_or(u64::MAX),
    };
    let body = futures::stream::unfold(state, move |mut state| async move {
        let piece = state.next_piece().await?;
        let piece = piece.map_err(|error| {
            tracing::warn!(%job, %error, "a job's result stream was cut short");
            actix_web::error::ErrorInternalServerError(error)
        });
        Some((piece, state))
    });
    Ok(HttpResponse::Ok()
        .content_type(ARROW_STREAM)
        .streaming(body))
}

async fn json_rows(
    mut reader: OutputReader,
    schema: &Arc<Schema>,
    limit: u64,
) -> Result<HttpResponse, ApiError> {
    let job = reader.job;
    let failed = |message: String| ApiError::new(StatusCode::BAD_GATEWAY, message);
    let total: u64 = reader.blocks.iter().map(|block| block.rows).sum();
    let mut writer = arrow::json::ArrayWriter::new(Vec::new());
    let mut rows = 0u64;
    while rows < limit {
        let Some(batch) = reader.next_batch().await.map_err(failed)? else {
            break;
        };
        let wanted = usize::try_from(limit - rows).unwrap_or(usize::MAX);
        let batch =
            with_schema(schema, &batch.slice(0, batch.num_rows().min(wanted))).map_err(failed)?;
        rows += batch.num_rows() as u64;
        writer
            .write(&batch)
            .map_err(|error| failed(format!("cannot write job {job}'s rows as JSON: {error}")))?;
    }
    writer
        .finish()
        .map_err(|error| failed(format!("cannot write job {job}'s rows as JSON: {error}")))?;
    let text = writer.into_inner();
    // An empty writer writes nothing, not `[]`.
    let rows: Vec<serde_json::Value> = if text.is_empty() {
        Vec::new()
    } else {
        serde_json::from_slice(&text)
            .map_err(|error| failed(format!("cannot read back job {job}'s JSON rows: {error}")))?
    };
    Ok(HttpResponse::Ok().json(ResultJson {
        job: job.to_string(),
        columns: schema.fields().iter().map(|f| f.name().clone()).collect(),
        rows,
        truncated: total > limit,
    }))
}
