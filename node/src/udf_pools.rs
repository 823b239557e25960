//! Process-UDF pools on a node: long-lived child processes that run a UDF, leased to the
//! worker that runs a task.
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
//! `floe_udf.py`, which the agent writes next to the sockets. The worker's side of the
//! conversation is [`floe_engine::udf::process`].
//!
//! A child inherits nothing of the node's environment: it gets `PATH`, `PYTHONPATH` and
//! `FLOE_UDF_FD`, and the variables the UDF declares. It starts only if its command is in
//! `node.udf_commands` and its code is a pinned script under `node.udf_roots`
//! ([`UdfCodePolicy`]).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, mpsc};
use std::time::{Duration, Instant};

use floe_api::node_protocol::{UdfPoolStatus, UdfProcessStatus};
use floe_core::Fingerprint;
use floe_core::fingerprint::{FileDigest, FileStamp};
use floe_core::plan::{ProcessUdf, UdfCodePolicy};

use floe_engine::udf::process::{FLOE_UDF_PY, LOG_MAX_BYTES, ProcessEndpoint, process_error};
use floe_engine::{Error, Result};

/// The child's `PATH` when the node has none.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

fn io_error(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}

/// How a node runs process UDFs.
#[derive(Debug, Clone)]
pub struct PoolsConfig {
    /// Sockets, logs and `floe_udf.py` live here; it is the pools' own and removed with them.
    pub runtime_dir: PathBuf,
    /// The only commands children may run (`node.udf_commands`).
    pub allowed_commands: Vec<String>,
    /// Where their code may come from (`node.udf_roots`, `node.udf_allow_inline`).
    pub code: UdfCodePolicy,
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
    fn pid(&self) -> u32 {
        self.process.id()
    }

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
    /// The pids of the children on lease.
    leased: BTreeSet<u32>,
    starting: u32,
    min: u32,
    max: u32,
    /// The UDF's command line, for status.
    command: String,
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
        std::fs::create_dir_all(&python).map_err(io_error(&python))?;
        let module = python.join("floe_udf.py");
        std::fs::write(&module, FLOE_UDF_PY).map_err(io_error(&module))?;
        let (spawner, requests) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("floe-udf-spawner".into())
            .spawn(move || {
                // Ends when the pools (the only sender) are dropped.
                for mut request in requests {
                    let _ = request.reply.send(request.command.spawn());
                }
            })
            .map_err(io_error(&config.runtime_dir))?;
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
        self.config
            .code
            .check(udf)
            .map_err(|refused| Error::ProcessUdfRefused {
                udf: udf.command_line(),
                message: refused.to_string(),
            })?;
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
                leased: BTreeSet::new(),
                starting: 0,
                min: 0,
                max,
                command: udf.command_line(),
                last_lease: Instant::now(),
            });
            pool.min = udf.concurrency.min.min(max);
            pool.max = max;
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
                pool.leased.insert(child.pid());
                drop(state);
                exited.into_iter().for_each(ChildProcess::stop);
                return Ok(self.lease_of(key, child));
            }
            let live = pool.leased.len() as u32 + pool.starting;
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
                        if let Ok(child) = &leased {
                            pool.leased.insert(child.pid());
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
            let busy = state.pools.get(&key).is_some_and(|pool| {
                pool.idle.is_empty() && pool.leased.len() as u32 + pool.starting >= max
            });
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
                pool.leased.remove(&child.pid());
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
                let retire = pool.leased.is_empty()
                    && pool.starting == 0
                    && now.duration_since(pool.last_lease) >= self.config.retire_after;
                let mut live = pool.leased.len() as u32 + pool.starting + kept.len() as u32;
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
                !(retire || (pool.idle.is_empty() && pool.leased.is_empty() && pool.starting == 0))
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
            .map(|(key, pool)| (*key, (pool.leased.len() + pool.idle.len()) as u32))
            .collect()
    }

    /// Every pool with its live children, for the node's status.
    pub fn status(&self) -> Vec<UdfPoolStatus> {
        self.state()
            .pools
            .values()
            .map(|pool| UdfPoolStatus {
                command: pool.command.clone(),
                min: pool.min,
                max: pool.max,
                starting: pool.starting,
                processes: pool
                    .leased
                    .iter()
                    .map(|pid| UdfProcessStatus {
                        pid: *pid,
                        leased: true,
                    })
                    .chain(pool.idle.iter().map(|(child, _)| UdfProcessStatus {
                        pid: child.pid(),
                        leased: false,
                    }))
                    .collect(),
            })
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
            .map_err(io_error(&log))?;
        let log_copy = log_file.try_clone().map_err(|error| {
            remove_files();
            io_error(&log)(error)
        })?;
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).map_err(|error| {
            remove_files();
            io_error(&socket)(error)
        })?;
        let mut python_path = OsString::from(dir.join("python"));
        if let Some(existing) = std::env::var_os("PYTHONPATH") {
            python_path.push(":");
            python_path.push(existing);
        }
        let listen_fd = listener.as_raw_fd();
        let mut command = Command::new(&udf.command);
        // Nothing of the node's environment (its cluster token above all) reaches the child:
        // only what finds the program and floe_udf, and what the UDF declares (which cannot
        // name these, `ProcessUdf::validate`).
        command
            .args(&udf.args)
            .env_clear()
            .envs(&udf.env)
            .env(
                "PATH",
                std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into()),
            )
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
