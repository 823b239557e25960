//! Process UDFs, the worker's side: a task's conversation with the children the agent leased
//! for it, over the `floe_udf/1` protocol.
//!
//! The agent's `ProcessPools` (in floe-node) lease one child per UDF to a task; the
//! worker gets their [`ProcessEndpoint`]s with the task.
//! A child gets a listening Unix socket as the descriptor named by `FLOE_UDF_FD` (bound by the
//! agent before the child starts, so connecting never races its start-up), its stdout and
//! stderr go to a log file whose tail explains failures, and `PYTHONPATH` leads to
//! `floe_udf.py`, which the agent writes next to the sockets. The worker connects for the
//! length of one task ([`ProcessSessions`]) and exchanges the messages of the `floe_udf/1`
//! protocol (`python/floe/floe_udf.py` and `docs/PROCESS_UDFS.md` describe it).

use std::cell::RefCell;
use std::fs::File;
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::buffer::Buffer;
use arrow::datatypes::Schema;
use arrow::ipc::reader::StreamDecoder;
use arrow::ipc::writer::StreamWriter;
use arrow::record_batch::RecordBatch;
use floe_core::Fingerprint;
use floe_core::plan::{Operator, ProcessUdf};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The Python helper every child can import (`import floe_udf`).
pub const FLOE_UDF_PY: &str = include_str!("../../../python/floe/floe_udf.py");

const PROTOCOL: &[u8] = b"floe_udf/1";
const HELLO: u32 = 1;
const BATCH: u32 = 2;
const RESULT: u32 = 3;
const ERROR: u32 = 4;
/// The largest message a child may send: a result block is at most a few hundred MiB.
const MAX_MESSAGE: u64 = 4 << 30;
/// How much of a child's log a failure quotes.
const LOG_TAIL_BYTES: u64 = 2048;
/// How long a worker waits for a child it killed, or that hung up, to be gone.
const EXIT_WAIT: Duration = Duration::from_secs(2);
/// A child's log is emptied past this size (only its tail is ever quoted), so a chatty UDF
/// cannot fill the disk.
pub const LOG_MAX_BYTES: u64 = 1 << 20;

/// Where a leased child listens; the agent hands it to the worker with the task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessEndpoint {
    pub key: Fingerprint,
    pub pid: u32,
    pub socket: PathBuf,
    /// The child's stdout and stderr.
    pub log: PathBuf,
}

/// The distinct process UDFs among `ops`, ordered by pool key: leases are taken in that
/// order, so two tasks never wait for each other's children.
pub fn process_udfs(ops: &[Operator]) -> Result<Vec<&ProcessUdf>> {
    let mut udfs = Vec::new();
    for op in ops {
        if let Operator::ProcessUdf(udf) = op {
            udfs.push((udf.pool_key()?, udf));
        }
    }
    udfs.sort_by_key(|(key, _)| *key);
    udfs.dedup_by_key(|(key, _)| *key);
    Ok(udfs.into_iter().map(|(_, udf)| udf).collect())
}

pub fn process_error(udf: &ProcessUdf, message: String) -> Error {
    Error::ProcessUdf {
        udf: udf.command_line(),
        message,
    }
}

/// A task's connections to its leased children, opened on first use.
pub struct ProcessSessions<'a> {
    endpoints: &'a [ProcessEndpoint],
    open: RefCell<Vec<Session>>,
}

struct Session {
    endpoint: ProcessEndpoint,
    stream: UnixStream,
}

impl<'a> ProcessSessions<'a> {
    /// Sessions over the children the agent leased for this task (none: process UDFs fail).
    pub fn new(endpoints: &'a [ProcessEndpoint]) -> Self {
        Self {
            endpoints,
            open: RefCell::new(Vec::new()),
        }
    }

    /// Runs `udf` on `batch` in its child: in slices of `batch_size` rows if set, each result
    /// checked against the output schema.
    pub fn call(&self, udf: &ProcessUdf, batch: &RecordBatch) -> Result<RecordBatch> {
        let output = match &udf.output_schema {
            Some(schema) => Arc::new(schema.clone()),
            None => batch.schema(),
        };
        let rows = batch.num_rows();
        // An empty block (a filter upstream removed every row) never bothers the process.
        if rows == 0 {
            return Ok(RecordBatch::new_empty(output));
        }
        let step = udf
            .batch_size
            .and_then(|size| usize::try_from(size).ok())
            .filter(|size| *size > 0 && *size < rows)
            .unwrap_or(rows);
        let mut results = Vec::new();
        let mut offset = 0;
        while offset < rows {
            let length = step.min(rows - offset);
            results.push(self.call_one(udf, &batch.slice(offset, length), &output)?);
            offset += length;
        }
        if results.len() == 1 {
            return Ok(results.remove(0));
        }
        Ok(arrow::compute::concat_batches(&output, &results)?)
    }

    fn call_one(
        &self,
        udf: &ProcessUdf,
        batch: &RecordBatch,
        output: &Arc<Schema>,
    ) -> Result<RecordBatch> {
        let key = udf.pool_key()?;
        let mut open = self.open.borrow_mut();
        let index = match open.iter().position(|s| s.endpoint.key == key) {
            Some(index) => index,
            None => {
                let endpoint = self
                    .endpoints
                    .iter()
                    .find(|e| e.key == key)
                    .ok_or_else(|| Error::ProcessUdfRefused {
                        udf: udf.command_line(),
                        message: "process UDFs run on a cluster's nodes (floe up, LocalCluster); \
                                  this executor has no child process for it"
                            .to_owned(),
                    })?;
                open.push(Session::connect(udf, endpoint.clone())?);
                open.len() - 1
            }
        };
        let session = &mut open[index];
        match session.exchange(udf, batch) {
            Ok(result) => check_output(udf, result, output),
            Err(failure) => {
                let session = open.remove(index);
                Err(session.fail(udf, failure))
            }
        }
    }
}

/// Why a conversation with a child broke.
enum Failure {
    TimedOut(&'static str),
    HungUp(&'static str),
    Raised(String),
    Protocol(String),
    Io(std::io::Error),
}

impl Session {
    fn connect(udf: &ProcessUdf, endpoint: ProcessEndpoint) -> Result<Self> {
        let stream = match UnixStream::connect(&endpoint.socket) {
            Ok(stream) => stream,
            Err(error) => {
                let message = format!("cannot connect to the UDF process: {error}");
                return Err(process_error(udf, with_log_tail(message, &endpoint)));
            }
        };
        let mut session = Self { endpoint, stream };
        let timeout = Some(Duration::from_millis(udf.timeout_ms));
        let configured = session
            .stream
            .set_read_timeout(timeout)
            .and_then(|()| session.stream.set_write_timeout(timeout));
        let hello = match configured {
            Ok(()) => session.read_message("start-up"),
            Err(error) => Err(Failure::Io(error)),
        };
        let not_greeted = |what: String| {
            Failure::Protocol(format!(
                "the process did not greet with {} ({what}): is it a floe_udf script calling \
                 floe_udf.serve()?",
                String::from_utf8_lossy(PROTOCOL),
            ))
        };
        match hello {
            Ok((HELLO, payload)) if payload == PROTOCOL => Ok(session),
            Ok((kind, payload)) => {
                let failure = not_greeted(format!("got message {kind}, {} bytes", payload.len()));
                Err(session.fail(udf, failure))
            }
            Err(Failure::Protocol(what)) => Err(session.fail(udf, not_greeted(what))),
            Err(failure) => Err(session.fail(udf, failure)),
        }
    }

    fn exchange(&mut self, udf: &ProcessUdf, batch: &RecordBatch) -> Result<RecordBatch, Failure> {
        let mut payload = Vec::new();
        let encoded = StreamWriter::try_new(&mut payload, &batch.schema())
            .and_then(|mut writer| {
                writer.write(batch)?;
                writer.finish()
            })
            .map_err(|error| Failure::Protocol(format!("cannot encode the batch: {error}")));
        encoded?;
        self.write_message(BATCH, &payload)?;
        match self.read_message("a batch")? {
            (RESULT, bytes) => decode_result(bytes),
            (ERROR, text) => Err(Failure::Raised(String::from_utf8_lossy(&text).into_owned())),
            (kind, _) => Err(Failure::Protocol(format!(
                "unexpected message kind {kind} from {}",
                udf.command_line()
            ))),
        }
    }

    fn write_message(&mut self, kind: u32, payload: &[u8]) -> Result<(), Failure> {
        let mut header = [0u8; 12];
        header[..4].copy_from_slice(&kind.to_le_bytes());
        header[4..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        self.stream
            .write_all(&header)
            .and_then(|()| self.stream.write_all(payload))
            .map_err(|error| io_failure(error, "sending a batch"))
    }

    fn read_message(&mut self, waiting_for: &'static str) -> Result<(u32, Vec<u8>), Failure> {
        let mut header = [0u8; 12];
        self.stream
            .read_exact(&mut header)
            .map_err(|error| io_failure(error, waiting_for))?;
        let kind = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        let mut length = [0u8; 8];
        length.copy_from_slice(&header[4..]);
        let length = u64::from_le_bytes(length);
        if length > MAX_MESSAGE {
            return Err(Failure::Protocol(format!(
                "a {length}-byte message is over the {MAX_MESSAGE}-byte limit"
            )));
        }
        let length = usize::try_from(length)
            .map_err(|_| Failure::Protocol(format!("a {length}-byte message is too long")))?;
        let mut payload = vec![0u8; length];
        self.stream
            .read_exact(&mut payload)
            .map_err(|error| io_failure(error, waiting_for))?;
        Ok((kind, payload))
    }

    /// Turns a broken conversation into the task's error, killing a child that hung.
    fn fail(self, udf: &ProcessUdf, failure: Failure) -> Error {
        let pid = self.endpoint.pid;
        let message = match failure {
            Failure::TimedOut(waiting_for) => {
                kill_and_wait(pid);
                format!(
                    "the process (pid {pid}) did not answer {waiting_for} within {} ms and was \
                     killed",
                    udf.timeout_ms
                )
            }
            Failure::HungUp(waiting_for) => {
                let ending = wait_for_exit(pid).map_or_else(
                    || "hung up".to_owned(),
                    |status| format!("exited ({status})"),
                );
                format!(
                    "the process (pid {pid}) {ending} while the worker waited for {waiting_for}"
                )
            }
            Failure::Raised(traceback) => {
                return process_error(udf, format!("the UDF raised an error:\n{traceback}"));
            }
            Failure::Protocol(message) => {
                // A process that does not speak the protocol would not on a retry either.
                kill_and_wait(pid);
                return Error::ProcessUdfProtocol {
                    udf: udf.command_line(),
                    message: with_log_tail(message, &self.endpoint),
                };
            }
            Failure::Io(error) => format!("talking to the process (pid {pid}): {error}"),
        };
        process_error(udf, with_log_tail(message, &self.endpoint))
    }
}

/// Decodes a result stream; its column buffers point into the received bytes (no copy), and
/// several batches are joined into one.
fn decode_result(bytes: Vec<u8>) -> Result<RecordBatch, Failure> {
    let not_ipc = |error: arrow::error::ArrowError| {
        Failure::Protocol(format!("the result is not an Arrow IPC stream: {error}"))
    };
    let mut buffer = Buffer::from_vec(bytes);
    let mut decoder = StreamDecoder::new();
    let mut batches = Vec::new();
    while !buffer.is_empty() {
        if let Some(batch) = decoder.decode(&mut buffer).map_err(not_ipc)? {
            batches.push(batch);
        }
    }
    decoder.finish().map_err(not_ipc)?;
    let schema = decoder
        .schema()
        .ok_or_else(|| Failure::Protocol("the result stream has no schema".to_owned()))?;
    match batches.len() {
        1 => Ok(batches.remove(0)),
        _ => arrow::compute::concat_batches(&schema, &batches)
            .map_err(|e| Failure::Protocol(format!("cannot join the result's batches: {e}"))),
    }
}

fn io_failure(error: std::io::Error, waiting_for: &'static str) -> Failure {
    match error.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => Failure::TimedOut(waiting_for),
        ErrorKind::UnexpectedEof | ErrorKind::BrokenPipe | ErrorKind::ConnectionReset => {
            Failure::HungUp(waiting_for)
        }
        _ => Failure::Io(error),
    }
}

/// `result` with the declared output schema, or an error naming the difference.
fn check_output(
    udf: &ProcessUdf,
    result: RecordBatch,
    output: &Arc<Schema>,
) -> Result<RecordBatch> {
    let got = result.schema();
    let wrong = || Error::ProcessUdfOutput {
        udf: udf.command_line(),
        expected: floe_core::plan::describe_schema(output),
        got: floe_core::plan::describe_schema(&got),
    };
    if !floe_core::plan::same_columns(&got, output) {
        return Err(wrong());
    }
    // Nullability is the declared schema's; a null in a non-null column is still an error.
    RecordBatch::try_new(Arc::clone(output), result.columns().to_vec()).map_err(|_| wrong())
}

/// `message` followed by the last lines the child wrote.
fn with_log_tail(message: String, endpoint: &ProcessEndpoint) -> String {
    match log_tail(endpoint) {
        Some(tail) if !tail.trim().is_empty() => {
            format!("{message}\n--- stderr tail ---\n{}", tail.trim_end())
        }
        _ => message,
    }
}

fn log_tail(endpoint: &ProcessEndpoint) -> Option<String> {
    let mut file = File::open(&endpoint.log).ok()?;
    let length = file.metadata().ok()?.len();
    file.seek(SeekFrom::Start(length.saturating_sub(LOG_TAIL_BYTES)))
        .ok()?;
    let mut tail = Vec::new();
    file.read_to_end(&mut tail).ok()?;
    Some(String::from_utf8_lossy(&tail).into_owned())
}

/// Kills a hung child and waits until it is gone, so the agent sees it exited when the lease
/// comes back and never hands it out again.
fn kill_and_wait(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: kill with integer arguments; the pid is a child the agent leased us and has
        // not reaped (it reaps only children that are not leased).
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
    let _ = wait_for_exit(pid);
}

/// Waits until the process is a zombie (its parent, the agent, has not reaped it yet) or gone,
/// and describes how it ended when the kernel still knows.
fn wait_for_exit(pid: u32) -> Option<String> {
    let deadline = Instant::now() + EXIT_WAIT;
    while Instant::now() < deadline {
        let stat = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => stat,
            Err(_) => return None,
        };
        // Fields after the command name (which may hold spaces) start after the last ')'.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        if fields.first() == Some(&"Z") {
            // Field 52 of /proc/pid/stat is the wait status; `fields` starts at field 3.
            return fields
                .get(49)
                .and_then(|code| code.parse::<i32>().ok())
                .map(describe_wait_status);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

fn describe_wait_status(status: i32) -> String {
    let signal = status & 0x7f;
    if signal == 0 {
        format!("exit code {}", (status >> 8) & 0xff)
    } else {
        format!("killed by signal {signal}")
    }
}
