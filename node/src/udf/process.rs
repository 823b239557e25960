//! Process UDFs on a node: pools of long-lived child processes, and a worker's conversation
//! with one of them.
//!
//! The agent keeps one [`ProcessPools`]. A pool per UDF (keyed by
//! [`ProcessUdf::pool_key`]: the command line and the files' contents) holds the children
//! running it; each child is an actor whose state (a loaded model) outlives any one batch.
//! Before a stage task that calls process UDFs goes to a worker, the agent leases one child
//! per UDF ([`ProcessPools::lease`]): an idle child if there is one, a new one while the pool
//! is below its maximum, else it waits for a child to come back. Children idle past
//! [`PoolsConfig::shrink_after`] are stopped down to the pool's minimum, and a pool unused for
//! [`PoolsConfig::retire_after`] is stopped entirely.
//!
//! A child gets a listening Unix socket as the descriptor named by `FLOE_UDF_FD` (bound by the
//! agent before the child starts, so connecting never races its start-up), its stdout and
//! stderr go to a log file whose tail explains failures, and `PYTHONPATH` leads to
//! `floe_udf.py`, which the agent writes next to the sockets. The worker connects for the
//! length of one task ([`ProcessSessions`]) and exchanges the messages of the `floe_udf/1`
//! protocol (`python/floe_udf.py` and `docs/PROCESS_UDFS.md` describe it).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, mpsc};
use std::time::{Duration, Instant};

use arrow::buffer::Buffer;
use arrow::datatypes::Schema;
use arrow::ipc::reader::StreamDecoder;
use arrow::ipc::writer::StreamWriter;
use arrow::record_batch::RecordBatch;
use floe_core::Fingerprint;
use floe_core::fingerprint::{FileDigest, FileStamp};
use floe_core::plan::{Operator, ProcessUdf};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The Python helper every child can import (`import floe_udf`).
pub const FLOE_UDF_PY: &str = include_str!("../../../python/floe_udf.py");

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
const LOG_MAX_BYTES: u64 = 1 << 20;

/// Where a leased child listens; the agent hands it to the worker with the task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessEndpoint {
    pub key: Fingerprint,
    pub pid: u32,
    pub socket: PathBuf,
    /// The child's stdout and stderr.
    pub log: PathBuf,
}

/// How a node runs process UDFs.
#[derive(Debug, Clone)]
pub struct PoolsConfig {
    /// Sockets, logs and `floe_udf.py` live here; it is the pools' own and removed with them.
    pub runtime_dir: PathBuf,
    /// The only commands children may run (`node.udf_commands`).
    pub allowed_commands: Vec<String>,
    /// A pool's maximum when the UDF leaves it at 0: the node's CPUs.
    pub default_max: u32,
    /// Idle children beyond a pool's minimum are stopped after this long.
    pub shrink_after: Duration,
    /// A pool nobody leased from for this long is stopped entirely.
    pub retire_after: Duration,
}

struct ChildProcess {
    process: Child,
    endpoint: ProcessEndpoint,
}

impl ChildProcess {
    fn has_exited(&mut self) -> bool {
        !matches!(self.process.try_wait(), Ok(None))
    }

    /// Empties the log once it passes [`LOG_MAX_BYTES`]; the child appends, so it goes on
    /// writing at the new end.
    fn trim_log(&self) {
        if std::fs::metadata(&self.endpoint.log).is_ok_and(|m| m.len() > LOG_MAX_BYTES)
            && let Ok(file) = OpenOptions::new().write(true).open(&self.endpoint.log)
        {
            let _ = file.set_len(0);
        }
    }

    /// Kills the child and removes its files.
    fn stop(mut self) {
        if !self.has_exited() {
            let _ = self.process.kill();
            let _ = self.process.wait();
        }
        let _ = std::fs::remove_file(&self.endpoint.socket);
        let _ = std::fs::remove_file(&self.endpoint.log);
    }
}

struct Pool {
    idle: Vec<(ChildProcess, Instant)>,
    leased: u32,
    starting: u32,
    min: u32,
    last_lease: Instant,
}

#[derive(Default)]
struct PoolsState {
    pools: BTreeMap<Fingerprint, Pool>,
    closed: bool,
}

/// A node's pools of process-UDF children (see the module docs).
pub struct ProcessPools {
    config: PoolsConfig,
    state: Mutex<PoolsState>,
    returned: Condvar,
    next_child: AtomicU64,
    /// Children are forked by one long-lived thread: their parent-death signal fires when the
    /// *thread* that forked them ends, and the threads leases run on come and go.
    spawner: Mutex<mpsc::Sender<SpawnRequest>>,
    /// Files whose content matched a plan's digest, by the size and modification time they had
    /// then: a child started again does not hash a large model again.
    verified: Mutex<BTreeMap<PathBuf, (FileStamp, Fingerprint)>>,
}

struct SpawnRequest {
    command: Command,
    reply: mpsc::Sender<std::io::Result<Child>>,
}

/// One leased child; dropping the lease gives it back (or stops it if it exited or was
/// discarded).
pub struct Lease {
    pools: Arc<ProcessPools>,
    key: Fingerprint,
    endpoint: ProcessEndpoint,
    child: Option<ChildProcess>,
    discard: bool,
}

impl Lease {
    pub fn endpoint(&self) -> &ProcessEndpoint {
        &self.endpoint
    }

    /// Stops the child instead of giving it back: its worker was killed mid-task, so it may
    /// still be busy with (or be the cause of) that task's batch.
    pub fn discard(&mut self) {
        self.discard = true;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(child) = self.child.take() {
            self.pools.give_back(self.key, child, self.discard);
        }
    }
}

impl ProcessPools {
    /// Creates the runtime directory and writes `floe_udf.py` into it.
    pub fn new(config: PoolsConfig) -> Result<Self> {
        let python = config.runtime_dir.join("python");
        std::fs::create_dir_all(&python).map_err(Error::io(&python))?;
        let module = python.join("floe_udf.py");
        std::fs::write(&module, FLOE_UDF_PY).map_err(Error::io(&module))?;
        let (spawner, requests) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("floe-udf-spawner".into())
            .spawn(move || {
                // Ends when the pools (the only sender) are dropped.
                for mut request in requests {
                    let _ = request.reply.send(request.command.spawn());
                }
            })
            .map_err(Error::io(&config.runtime_dir))?;
        Ok(Self {
            config,
            state: Mutex::new(PoolsState::default()),
            returned: Condvar::new(),
            next_child: AtomicU64::new(0),
            spawner: Mutex::new(spawner),
            verified: Mutex::new(BTreeMap::new()),
        })
    }

    fn state(&self) -> MutexGuard<'_, PoolsState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A child running `udf`, waiting while the pool is at its maximum and busy.
    pub fn lease(self: &Arc<Self>, udf: &ProcessUdf) -> Result<Lease> {
        if !self.config.allowed_commands.contains(&udf.command) {
            return Err(Error::ProcessUdfRefused {
                udf: udf.command_line(),
                message: format!(
                    "this node only runs the commands in node.udf_commands ({})",
                    self.config.allowed_commands.join(", ")
                ),
            });
        }
        let key = udf.pool_key()?;
        let max = match udf.concurrency.max {
            0 => self.config.default_max.max(1),
            max => max,
        };
        let mut state = self.state();
        loop {
            if state.closed {
                return Err(process_error(udf, "the node is shutting down".to_owned()));
            }
            let pool = state.pools.entry(key).or_insert_with(|| Pool {
                idle: Vec::new(),
                leased: 0,
                starting: 0,
                min: 0,
                last_lease: Instant::now(),
            });
            pool.min = udf.concurrency.min.min(max);
            pool.last_lease = Instant::now();
            let mut exited = Vec::new();
            let mut found = None;
            while let Some((mut child, _)) = pool.idle.pop() {
                if child.has_exited() {
                    exited.push(child);
                } else {
                    found = Some(child);
                    break;
                }
            }
            if let Some(child) = found {
                pool.leased += 1;
                drop(state);
                exited.into_iter().for_each(ChildProcess::stop);
                return Ok(self.lease_of(key, child));
            }
            let live = pool.leased + pool.starting;
            if live < max {
                // A new pool starts the children it keeps warm along with the one leased now.
                let extra = pool.min.saturating_sub(live + 1);
                pool.starting += 1 + extra;
                drop(state);
                exited.into_iter().for_each(ChildProcess::stop);
                let leased = self.spawn(udf, key);
                let warm: Vec<ChildProcess> = (0..extra)
                    .filter_map(|_| self.spawn(udf, key).ok())
                    .collect();
                let mut stopped = Vec::new();
                state = self.state();
                let closed = state.closed;
                match state.pools.get_mut(&key) {
                    Some(pool) if !closed => {
                        pool.starting -= 1 + extra;
                        pool.idle
                            .extend(warm.into_iter().map(|child| (child, Instant::now())));
                        if leased.is_ok() {
                            pool.leased += 1;
                        }
                    }
                    _ => stopped.extend(warm),
                }
                drop(state);
                self.returned.notify_all();
                let leased = leased?;
                if closed {
                    stopped.push(leased);
                    stopped.into_iter().for_each(ChildProcess::stop);
                    return Err(process_error(udf, "the node is shutting down".to_owned()));
                }
                stopped.into_iter().for_each(ChildProcess::stop);
                return Ok(self.lease_of(key, leased));
            }
            drop(state);
            exited.into_iter().for_each(ChildProcess::stop);
            state = self.state();
            // Re-checked before waiting: a child given back meanwhile has already notified.
            let busy = state
                .pools
                .get(&key)
                .is_some_and(|pool| pool.idle.is_empty() && pool.leased + pool.starting >= max);
            if busy && !state.closed {
                state = self
                    .returned
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
    }

    fn lease_of(self: &Arc<Self>, key: Fingerprint, child: ChildProcess) -> Lease {
        Lease {
            pools: Arc::clone(self),
            key,
            endpoint: child.endpoint.clone(),
            child: Some(child),
            discard: false,
        }
    }

    fn give_back(&self, key: Fingerprint, mut child: ChildProcess, discard: bool) {
        let mut state = self.state();
        let closed = state.closed;
        let stop = match state.pools.get_mut(&key) {
            Some(pool) => {
                pool.leased = pool.leased.saturating_sub(1);
                if closed || discard || child.has_exited() {
                    Some(child)
                } else {
                    child.trim_log();
                    pool.idle.push((child, Instant::now()));
                    None
                }
            }
            None => Some(child),
        };
        drop(state);
        self.returned.notify_all();
        if let Some(child) = stop {
            child.stop();
        }
    }

    /// Stops children that exited, idle children past the pools' minimums, and pools nobody
    /// used lately; the agent calls it every second.
    pub fn reap(&self) {
        let now = Instant::now();
        let mut stopped = Vec::new();
        {
            let mut state = self.state();
            state.pools.retain(|_, pool| {
                let mut kept = Vec::with_capacity(pool.idle.len());
                for (mut child, since) in pool.idle.drain(..) {
                    if child.has_exited() {
                        stopped.push(child);
                    } else {
                        kept.push((child, since));
                    }
                }
                // Oldest-idle first, so the children stopped are the ones used least lately.
                kept.sort_by_key(|(_, since)| *since);
                let retire = pool.leased == 0
                    && pool.starting == 0
                    && now.duration_since(pool.last_lease) >= self.config.retire_after;
                let mut live = pool.leased + pool.starting + kept.len() as u32;
                for (child, since) in kept {
                    let expired = now.duration_since(since) >= self.config.shrink_after;
                    if retire || (expired && live > pool.min) {
                        live -= 1;
                        stopped.push(child);
                    } else {
                        child.trim_log();
                        pool.idle.push((child, since));
                    }
                }
                !(retire || (pool.idle.is_empty() && pool.leased == 0 && pool.starting == 0))
            });
        }
        for child in stopped {
            child.stop();
        }
    }

    /// Children alive per pool (idle and leased), for status and tests.
    pub fn sizes(&self) -> Vec<(Fingerprint, u32)> {
        self.state()
            .pools
            .iter()
            .map(|(key, pool)| (*key, pool.leased + pool.idle.len() as u32))
            .collect()
    }

    /// Stops every idle child; leased ones are stopped when given back.
    pub fn shutdown(&self) {
        let stopped: Vec<ChildProcess> = {
            let mut state = self.state();
            state.closed = true;
            state
                .pools
                .values_mut()
                .flat_map(|pool| pool.idle.drain(..).map(|(child, _)| child))
                .collect()
        };
        for child in stopped {
            child.stop();
        }
        self.returned.notify_all();
    }

    /// Checks that every file still has the content the plan pinned (hashing again only a file
    /// whose size or modification time moved since it last matched).
    fn verify_files(&self, udf: &ProcessUdf) -> Result<()> {
        let refused = |message: String| Error::ProcessUdfRefused {
            udf: udf.command_line(),
            message,
        };
        for file in &udf.files {
            let stamp = FileStamp::of(&file.path).map_err(|error| refused(error.to_string()))?;
            let known = self
                .verified
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&file.path)
                .is_some_and(|(seen, content)| *seen == stamp && *content == file.content);
            if known {
                continue;
            }
            let now = FileDigest::of(&file.path).map_err(|error| refused(error.to_string()))?;
            if now.content != file.content {
                return Err(refused(format!(
                    "{} changed since the job was submitted; submit the job again",
                    file.path.display()
                )));
            }
            self.verified
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(file.path.clone(), (stamp, file.content));
        }
        Ok(())
    }

    fn spawn(&self, udf: &ProcessUdf, key: Fingerprint) -> Result<ChildProcess> {
        self.verify_files(udf)?;
        let number = self.next_child.fetch_add(1, Ordering::Relaxed);
        let dir = &self.config.runtime_dir;
        let socket = dir.join(format!("child-{number}.sock"));
        let log = dir.join(format!("child-{number}.log"));
        let remove_files = || {
            let _ = std::fs::remove_file(&socket);
            let _ = std::fs::remove_file(&log);
        };
        let log_file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(Error::io(&log))?;
        let log_copy = log_file.try_clone().map_err(|error| {
            remove_files();
            Error::io(&log)(error)
        })?;
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).map_err(|error| {
            remove_files();
            Error::io(&socket)(error)
        })?;
        let mut python_path = OsString::from(dir.join("python"));
        if let Some(existing) = std::env::var_os("PYTHONPATH") {
            python_path.push(":");
            python_path.push(existing);
        }
        let listen_fd = listener.as_raw_fd();
        let mut command = Command::new(&udf.command);
        command
            .args(&udf.args)
            .env("FLOE_UDF_FD", "3")
            .env("PYTHONPATH", python_path)
            .stdin(Stdio::null())
            .stdout(log_copy)
            .stderr(log_file);
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe calls (dup2, fcntl, prctl) on integers.
        unsafe {
            command.pre_exec(move || {
                if listen_fd == 3 {
                    let flags = libc::fcntl(3, libc::F_GETFD);
                    if flags < 0 || libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::dup2(listen_fd, 3) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // A child must not outlive its node.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let spawned = self.spawn_on_spawner(command);
        // The child has its own copy of the listening socket now.
        drop(listener);
        let process = spawned.map_err(|error| {
            remove_files();
            process_error(udf, format!("cannot start {:?}: {error}", udf.command))
        })?;
        tracing::info!(udf = %udf.command_line(), pid = process.id(), "process UDF started");
        Ok(ChildProcess {
            endpoint: ProcessEndpoint {
                key,
                pid: process.id(),
                socket,
                log,
            },
            process,
        })
    }

    fn spawn_on_spawner(&self, command: Command) -> std::io::Result<Child> {
        let (reply, answer) = mpsc::channel();
        let sent = self
            .spawner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(SpawnRequest { command, reply });
        let gone = || std::io::Error::other("the process spawner thread is gone");
        sent.map_err(|_| gone())?;
        answer.recv().map_err(|_| gone())?
    }
}

impl Drop for ProcessPools {
    /// Runs when the last lease is gone too, so nothing uses the runtime directory any more.
    fn drop(&mut self) {
        self.shutdown();
        let _ = std::fs::remove_dir_all(&self.config.runtime_dir);
    }
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

fn process_error(udf: &ProcessUdf, message: String) -> Error {
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
