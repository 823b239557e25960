//! The agent's worker processes.
//!
//! Each worker slot is a task that starts a `floe worker` process, waits for it to connect to
//! the agent's Unix socket, then takes jobs from the one shared queue whenever it is idle — so
//! tasks go to idle workers in arrival order. When the process dies (crash, kill -9, or the
//! memory monitor), the slot answers its job with the reason and starts a new process; nothing
//! a task does can take the agent down with it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use floe_core::TaskId;
use floe_core::config::StorageConfig;
use floe_core::wire::{FramedStream, codec};
use floe_objectstore::ObjectView;
use tokio::net::{UnixListener, UnixStream};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::outputs::TaskOutputs;
use super::worker::{
    AgentMessage, SOCKET_FRAME_TIMEOUT, WorkerMessage, WorkerTask, WrittenOutput, send,
};
use super::{Error, Result};
use floe_api::node_protocol::{RunningTask, TaskDone, TaskFailure, WorkerRef, WorkerStatus};

/// How long a new worker process has to connect and say hello.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// Pause before starting a worker again after a start failed, so a broken binary does not
/// make the agent spin.
const RESPAWN_PAUSE: Duration = Duration::from_secs(1);
/// How long a worker whose socket broke has to exit before it is killed; its exit status is
/// the better failure reason.
const EXIT_GRACE: Duration = Duration::from_secs(2);
/// A running task's reply has no deadline: tasks may run for hours.
const TASK_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

#[derive(Debug, Clone)]
pub(crate) struct PoolOptions {
    /// The `floe` binary to run as `floe worker`.
    pub binary: PathBuf,
    pub socket: PathBuf,
    pub workers: u32,
    pub max_frame: usize,
    /// Where each worker writes its rotated log (`worker-<slot>.log`).
    pub log_dir: PathBuf,
    /// The node's `[storage]` settings; workers get them as `FLOE_STORAGE_*` variables,
    /// never as arguments another user could list.
    pub storage: StorageConfig,
}

pub(crate) type JobResult = Result<TaskDone, TaskFailure>;

/// A task's result and the worker that ran it (none when it never reached one).
pub(crate) struct Ran {
    pub result: JobResult,
    pub worker: Option<WorkerRef>,
}

struct Job {
    task: WorkerTask,
    /// Views of the inputs: they keep the objects pinned while the worker reads them.
    pins: Vec<ObjectView>,
    /// Where the worker writes its outputs.
    outputs: TaskOutputs,
    reply: oneshot::Sender<Ran>,
}

/// Why the agent kills a worker in the middle of a task.
#[derive(Debug)]
enum Kill {
    /// The memory monitor picked it; the reason names the memory figures.
    OutOfMemory(String),
    /// The task's driver cancelled it.
    Cancelled,
}

struct Running {
    task: TaskId,
    worker: WorkerRef,
    kill: Option<oneshot::Sender<Kill>>,
}

struct PoolInner {
    options: PoolOptions,
    jobs: tokio::sync::Mutex<mpsc::Receiver<Job>>,
    /// Slots waiting for their new process to connect.
    pending: Mutex<HashMap<u32, oneshot::Sender<FramedStream<UnixStream>>>>,
    /// Tasks on workers, by start order: the last one is the newest.
    running: Mutex<BTreeMap<u64, Running>>,
    next_start: AtomicU64,
    /// Queued tasks cancelled before a worker took them.
    cancelled: Mutex<BTreeSet<TaskId>>,
    ready: AtomicU32,
    respawned: AtomicU64,
    /// Each slot's connected process, by slot.
    processes: Mutex<BTreeMap<u32, u32>>,
}

impl PoolInner {
    fn running(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Running>> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub(crate) struct WorkerPool {
    inner: Arc<PoolInner>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    slots: Mutex<Vec<JoinHandle<()>>>,
    accept: JoinHandle<()>,
}

struct Worker {
    child: Child,
    slot: u32,
    pid: u32,
    stream: FramedStream<UnixStream>,
}

enum SlotEnd {
    Shutdown,
    WorkerGone,
}

impl WorkerPool {
    /// Listens on the socket and starts every worker slot.
    pub fn start(options: PoolOptions) -> Result<Self> {
        let io = |op| move |source| Error::Io { op, source };
        // A socket file left by a dead agent of the same pid would make bind fail.
        match std::fs::remove_file(&options.socket) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                return Err(io("removing a stale worker socket")(error));
            }
            _ => {}
        }
        let listener =
            UnixListener::bind(&options.socket).map_err(io("binding the worker socket"))?;
        // Only this user's processes may pose as workers.
        std::fs::set_permissions(
            &options.socket,
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .map_err(io("restricting the worker socket"))?;
        let (sender, receiver) = mpsc::channel(1024);
        let inner = Arc::new(PoolInner {
            options,
            jobs: tokio::sync::Mutex::new(receiver),
            pending: Mutex::new(HashMap::new()),
            running: Mutex::new(BTreeMap::new()),
            next_start: AtomicU64::new(0),
            cancelled: Mutex::new(BTreeSet::new()),
            ready: AtomicU32::new(0),
            respawned: AtomicU64::new(0),
            processes: Mutex::new(BTreeMap::new()),
        });
        let accept = tokio::spawn(accept_loop(listener, Arc::clone(&inner)));
        let slots = (0..inner.options.workers)
            .map(|slot| tokio::spawn(run_slot(Arc::clone(&inner), slot)))
            .collect();
        Ok(Self {
            inner,
            jobs: Mutex::new(Some(sender)),
            slots: Mutex::new(slots),
            accept,
        })
    }

    /// Runs a task on the next idle worker, which writes its outputs into `outputs`, and
    /// returns them sealed.
    pub async fn run(&self, task: WorkerTask, pins: Vec<ObjectView>, outputs: TaskOutputs) -> Ran {
        let shutting_down = || Ran {
            result: Err(TaskFailure::ShuttingDown),
            worker: None,
        };
        let sender = self
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some(sender) = sender else {
            return shutting_down();
        };
        let (reply, answer) = oneshot::channel();
        let job = Job {
            task,
            pins,
            outputs,
            reply,
        };
        if sender.send(job).await.is_err() {
            return shutting_down();
        }
        answer.await.unwrap_or_else(|_| shutting_down())
    }

    /// How many worker processes the pool keeps.
    pub fn workers(&self) -> u32 {
        self.inner.options.workers
    }

    pub fn running(&self) -> Vec<RunningTask> {
        self.inner
            .running()
            .values()
            .map(|running| RunningTask {
                task: running.task,
                worker_pid: running.worker.pid,
                worker_slot: running.worker.slot,
            })
            .collect()
    }

    /// Every slot: its process and the task it runs.
    pub fn slots(&self) -> Vec<WorkerStatus> {
        let processes = self
            .inner
            .processes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let running = self.inner.running();
        (0..self.inner.options.workers)
            .map(|slot| WorkerStatus {
                slot,
                pid: processes.get(&slot).copied(),
                task: running
                    .values()
                    .find(|running| running.worker.slot == slot)
                    .map(|running| running.task),
            })
            .collect()
    }

    pub fn ready(&self) -> u32 {
        self.inner.ready.load(Ordering::Relaxed)
    }

    pub fn respawned(&self) -> u64 {
        self.inner.respawned.load(Ordering::Relaxed)
    }

    /// Kills the worker of the most recently started task that is not already being killed;
    /// that task fails with [`TaskFailure::OutOfMemory`] and `reason`.
    pub fn kill_newest(&self, reason: String) -> Option<RunningTask> {
        let mut running = self.inner.running();
        let victim = running
            .values_mut()
            .rev()
            .find(|running| running.kill.is_some())?;
        let kill = victim.kill.take()?;
        // The slot may have just finished the task; then there is nothing to kill.
        kill.send(Kill::OutOfMemory(reason)).ok()?;
        Some(RunningTask {
            task: victim.task,
            worker_pid: victim.worker.pid,
            worker_slot: victim.worker.slot,
        })
    }

    /// Cancels `task`: its worker is killed if it runs, and it fails with
    /// [`TaskFailure::Cancelled`] when a worker would have taken it if it is queued.
    pub fn cancel(&self, task: TaskId) {
        let mut running = self.inner.running();
        if let Some(victim) = running.values_mut().find(|running| running.task == task) {
            if let Some(kill) = victim.kill.take() {
                let _ = kill.send(Kill::Cancelled);
            }
            return;
        }
        drop(running);
        self.inner
            .cancelled
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(task);
    }

    /// Fails queued and running tasks and kills every worker.
    pub async fn shutdown(&self) {
        self.jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let slots = std::mem::take(&mut *self.slots.lock().unwrap_or_else(PoisonError::into_inner));
        for slot in slots {
            // Busy slots too: their tasks end with the node. A slot's worker is killed when the
            // aborted slot drops it (`kill_on_drop`).
            slot.abort();
            let _ = slot.await;
        }
    }
}

/// Also reached when the agent's start is abandoned half-way (a signal, or no scheduler).
impl Drop for WorkerPool {
    fn drop(&mut self) {
        for slot in self
            .slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            slot.abort();
        }
        self.accept.abort();
        if let Err(error) = std::fs::remove_file(&self.inner.options.socket) {
            tracing::warn!(%error, "cannot remove the worker socket");
        }
    }
}

async fn accept_loop(listener: UnixListener, inner: Arc<PoolInner>) {
    loop {
        let socket = match listener.accept().await {
            Ok((socket, _)) => socket,
            Err(error) => {
                tracing::warn!(%error, "accepting a worker connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let inner = Arc::clone(&inner);
        tokio::spawn(async move {
            let mut stream = FramedStream::new(
                socket,
                inner.options.max_frame,
                SOCKET_FRAME_TIMEOUT,
                SOCKET_FRAME_TIMEOUT,
            );
            let hello = match stream.recv(CONNECT_TIMEOUT).await {
                Ok(body) => codec::decode::<WorkerMessage>(body, "worker hello"),
                Err(error) => Err(error),
            };
            match hello {
                Ok(WorkerMessage::Hello { slot }) => {
                    let waiting = inner
                        .pending
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .remove(&slot);
                    match waiting {
                        Some(waiting) => {
                            let _ = waiting.send(stream);
                        }
                        None => tracing::warn!(slot, "a worker connected for a slot not starting"),
                    }
                }
                Ok(other) => tracing::warn!(?other, "a worker connection did not start with hello"),
                Err(error) => tracing::warn!(%error, "a worker connection failed its hello"),
            }
        });
    }
}

async fn run_slot(inner: Arc<PoolInner>, slot: u32) {
    loop {
        let mut worker = match spawn(&inner, slot).await {
            Ok(worker) => worker,
            Err(error) => {
                tracing::error!(slot, %error, "cannot start a worker process");
                tokio::time::sleep(RESPAWN_PAUSE).await;
                continue;
            }
        };
        tracing::debug!(slot, pid = worker.pid, "worker ready");
        inner.ready.fetch_add(1, Ordering::Relaxed);
        inner
            .processes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(slot, worker.pid);
        let end = serve_jobs(&inner, &mut worker).await;
        inner
            .processes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&slot);
        inner.ready.fetch_sub(1, Ordering::Relaxed);
        match end {
            SlotEnd::Shutdown => {
                stop(&mut worker.child).await;
                return;
            }
            SlotEnd::WorkerGone => {
                inner.respawned.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

async fn spawn(inner: &PoolInner, slot: u32) -> Result<Worker> {
    let (connected, connection) = oneshot::channel();
    inner
        .pending
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(slot, connected);
    let options = &inner.options;
    let mut child =
        Command::new(&options.binary)
            .arg("worker")
            .arg("--socket")
            .arg(&options.socket)
            .arg("--slot")
            .arg(slot.to_string())
            .arg("--max-frame")
            .arg(options.max_frame.to_string())
            .arg("--log-dir")
            .arg(&options.log_dir)
            .envs(
                options.storage.options().into_iter().map(|(key, value)| {
                    (format!("FLOE_STORAGE_{}", key.to_ascii_uppercase()), value)
                }),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            // Dropping the slot (shutdown, or the agent's runtime ending) must not orphan it.
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| Error::Io {
                op: "starting a worker process",
                source,
            })?;
    let pid = child.id().unwrap_or_default();
    tokio::select! {
        stream = connection => match stream {
            Ok(stream) => Ok(Worker {
                child,
                slot,
                pid,
                stream,
            }),
            Err(_) => Err(Error::Worker(format!("worker {pid} lost its connection slot"))),
        },
        status = child.wait() => Err(Error::Worker(format!(
            "worker {pid} exited before connecting: {}",
            status.map_or_else(|error| error.to_string(), describe_exit)
        ))),
        () = tokio::time::sleep(CONNECT_TIMEOUT) => Err(Error::Worker(format!(
            "worker {pid} did not connect within {CONNECT_TIMEOUT:?}"
        ))),
    }
}

async fn serve_jobs(inner: &PoolInner, worker: &mut Worker) -> SlotEnd {
    loop {
        let job = {
            let mut jobs = inner.jobs.lock().await;
            tokio::select! {
                job = jobs.recv() => match job {
                    Some(job) => job,
                    None => return SlotEnd::Shutdown,
                },
                status = worker.child.wait() => {
                    let reason = status.map_or_else(|error| error.to_string(), describe_exit);
                    tracing::warn!(pid = worker.pid, %reason, "an idle worker died");
                    return SlotEnd::WorkerGone;
                }
            }
        };
        let cancelled = inner
            .cancelled
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&job.task.task);
        if cancelled {
            let _ = job.reply.send(Ran {
                result: Err(TaskFailure::Cancelled),
                worker: None,
            });
            continue;
        }
        let start = inner.next_start.fetch_add(1, Ordering::Relaxed);
        let (kill, killed) = oneshot::channel();
        inner.running().insert(
            start,
            Running {
                task: job.task.task,
                worker: WorkerRef {
                    slot: worker.slot,
                    pid: worker.pid,
                },
                kill: Some(kill),
            },
        );
        let task = job.task.task;
        let (result, end) = run_job(worker, job.task, job.outputs, killed).await;
        inner.running().remove(&start);
        drop(job.pins);
        if let Err(failure) = &result {
            tracing::warn!(%task, pid = worker.pid, %failure, "task failed");
        }
        // The requester may have gone away; the task's outcome no longer matters then.
        let _ = job.reply.send(Ran {
            result,
            worker: Some(WorkerRef {
                slot: worker.slot,
                pid: worker.pid,
            }),
        });
        if let Some(end) = end {
            return end;
        }
    }
}

/// Runs one task; a `Some` end means the worker is gone and must be replaced. Its outputs'
/// writers are dropped (on failure) only once the worker no longer writes: it said it is done,
/// or it was waited for dead.
async fn run_job(
    worker: &mut Worker,
    task: WorkerTask,
    mut outputs: TaskOutputs,
    killed: oneshot::Receiver<Kill>,
) -> (JobResult, Option<SlotEnd>) {
    let sent = send(&mut worker.stream, &AgentMessage::Run(task)).await;
    let reply = match sent {
        Err(error) => Err(error.to_string()),
        Ok(()) => {
            tokio::select! {
                reply = receive_reply(&mut worker.stream, &mut outputs) => reply,
                status = worker.child.wait() => {
                    let reason = status.map_or_else(|error| error.to_string(), describe_exit);
                    return (Err(TaskFailure::WorkerDied { reason }), Some(SlotEnd::WorkerGone));
                }
                kill = killed => {
                    stop(&mut worker.child).await;
                    let failure = match kill {
                        Ok(Kill::Cancelled) => TaskFailure::Cancelled,
                        Ok(Kill::OutOfMemory(reason)) => TaskFailure::OutOfMemory { reason },
                        Err(_) => TaskFailure::OutOfMemory {
                            reason: "killed by the memory monitor".into(),
                        },
                    };
                    return (Err(failure), Some(SlotEnd::WorkerGone));
                }
            }
        }
    };
    match reply {
        Ok(WorkerReply::Finished {
            outputs: written,
            written_rows,
        }) => {
            let done = outputs.seal(&written).map(|outputs| TaskDone {
                outputs,
                written_rows,
            });
            (done, None)
        }
        Ok(WorkerReply::Failed(failure)) => (Err(failure), None),
        Ok(WorkerReply::Confused(what)) => {
            stop(&mut worker.child).await;
            let reason = format!("the worker broke the protocol: {what}");
            (
                Err(TaskFailure::WorkerDied { reason }),
                Some(SlotEnd::WorkerGone),
            )
        }
        // A broken socket usually means the process died: its exit status says why.
        Err(socket_error) => {
            let reason = match tokio::time::timeout(EXIT_GRACE, worker.child.wait()).await {
                Ok(status) => status.map_or_else(|error| error.to_string(), describe_exit),
                Err(_) => {
                    stop(&mut worker.child).await;
                    format!("its socket failed ({socket_error}) and it was killed")
                }
            };
            (
                Err(TaskFailure::WorkerDied { reason }),
                Some(SlotEnd::WorkerGone),
            )
        }
    }
}

/// How a worker answered a task.
enum WorkerReply {
    /// Every output written, in order, and the rows written to a sink.
    Finished {
        outputs: Vec<WrittenOutput>,
        written_rows: u64,
    },
    /// The task failed (in the worker, or for want of room in the store); the worker writes
    /// nothing more.
    Failed(TaskFailure),
    /// A message that makes no sense here; the worker is replaced.
    Confused(String),
}

/// Serves a running task's worker up to its end: makes room in the store for its outputs when
/// it asks. A socket error is `Err`.
async fn receive_reply(
    stream: &mut FramedStream<UnixStream>,
    outputs: &mut TaskOutputs,
) -> Result<WorkerReply, String> {
    let mut placed = false;
    loop {
        let body = stream
            .recv(TASK_WAIT)
            .await
            .map_err(|error| error.to_string())?;
        let message = codec::decode::<WorkerMessage>(body, "worker reply")
            .map_err(|error| error.to_string())?;
        match message {
            WorkerMessage::Outputs { sizes } if !placed => {
                placed = true;
                match outputs.make_room(&sizes) {
                    Ok(places) => send(stream, &AgentMessage::Places(Ok(places)))
                        .await
                        .map_err(|error| error.to_string())?,
                    // Without room the task is over: the worker goes back to waiting for the
                    // next.
                    Err(failure) => {
                        send(stream, &AgentMessage::Places(Err(failure.to_string())))
                            .await
                            .map_err(|error| error.to_string())?;
                        return Ok(WorkerReply::Failed(failure));
                    }
                }
            }
            WorkerMessage::Outputs { .. } => {
                return Ok(WorkerReply::Confused("a second output request".into()));
            }
            WorkerMessage::Finished {
                outputs,
                written_rows,
            } => {
                return Ok(WorkerReply::Finished {
                    outputs,
                    written_rows,
                });
            }
            WorkerMessage::Failed { message, transient } => {
                let failure = if transient {
                    TaskFailure::Transient { message }
                } else {
                    TaskFailure::Error { message }
                };
                return Ok(WorkerReply::Failed(failure));
            }
            WorkerMessage::Hello { .. } => {
                return Ok(WorkerReply::Confused("a second hello".into()));
            }
        }
    }
}

async fn stop(child: &mut Child) {
    if let Err(error) = child.start_kill() {
        tracing::debug!(%error, "the worker had already exited");
    }
    let _ = child.wait().await;
}

fn describe_exit(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (_, Some(9)) => "killed by signal 9 (SIGKILL)".to_owned(),
        (_, Some(signal)) => format!("killed by signal {signal}"),
        (Some(code), _) => format!("exited with status {code}"),
        (None, None) => status.to_string(),
    }
}
