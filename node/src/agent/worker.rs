//! The `floe worker` process: connects to its agent's Unix socket, then runs one task at a time.
//!
//! Inputs arrive as [`ObjectLocation`]s the agent pinned; the worker maps them with a
//! [`StoreClient`] and reads them in place. Outputs go back over the socket and the agent
//! writes them into the store (the store's writers live in the agent's process).

use std::path::PathBuf;
use std::time::Duration;

use floe_core::TaskId;
use floe_core::wire::{FramedStream, WireError, codec};
use floe_objectstore::{ObjectLocation, StoreClient};
use serde::{Deserialize, Serialize};
use tokio::net::UnixStream;

use super::protocol::{Bytes, TaskKind};
use super::tasks::execute;
use super::{Error, Result};

/// A task as the agent hands it to a worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct WorkerTask {
    pub task: TaskId,
    pub kind: TaskKind,
    pub inputs: Vec<ObjectLocation>,
}

/// What a worker sends its agent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum WorkerMessage {
    /// The first message: which of the agent's worker slots this process fills.
    Hello {
        slot: u32,
    },
    Finished {
        outputs: Vec<Bytes>,
    },
    Failed {
        message: String,
    },
}

/// Sockets carry frames as large as a task's output; reads never wait on a slow peer, so one
/// generous timeout serves every frame once it has started.
pub(crate) const SOCKET_FRAME_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a worker waits, idle, for its next task: forever in practice (the agent closing
/// the socket ends the wait).
const IDLE_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// How to start a worker process.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub socket: PathBuf,
    pub slot: u32,
    /// The largest frame on the socket (the agent's `net.max_frame`).
    pub max_frame: usize,
}

/// Runs a worker until its agent closes the socket.
pub fn run_worker(options: &WorkerOptions) -> Result<()> {
    die_with_agent()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| Error::Io {
            op: "starting the worker's runtime",
            source,
        })?;
    runtime.block_on(serve(options))
}

/// Asks the kernel to kill this process when the agent dies: a busy worker would otherwise
/// outlive a killed agent (it notices the closed socket only between tasks) and keep its
/// memory and CPU.
fn die_with_agent() -> Result<()> {
    let agent = std::os::unix::process::parent_id();
    // SAFETY: prctl with integer arguments only changes this process's death signal.
    let status = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    if status != 0 {
        return Err(Error::Io {
            op: "setting the worker's parent-death signal",
            source: std::io::Error::last_os_error(),
        });
    }
    // The agent may have died before the call; then no signal will ever come.
    if std::os::unix::process::parent_id() != agent {
        return Err(Error::Worker(
            "the agent exited while the worker started".into(),
        ));
    }
    Ok(())
}

async fn serve(options: &WorkerOptions) -> Result<()> {
    let socket = UnixStream::connect(&options.socket)
        .await
        .map_err(|source| Error::Io {
            op: "connecting to the agent's worker socket",
            source,
        })?;
    let mut stream = FramedStream::new(
        socket,
        options.max_frame,
        SOCKET_FRAME_TIMEOUT,
        SOCKET_FRAME_TIMEOUT,
    );
    send(&mut stream, &WorkerMessage::Hello { slot: options.slot }).await?;
    let client = StoreClient::new();
    loop {
        let task: WorkerTask = match stream.recv(IDLE_WAIT).await {
            Ok(body) => codec::decode(body, "worker task")?,
            Err(WireError::Closed) => return Ok(()),
            Err(error) => return Err(error.into()),
        };
        let reply = match run(&client, &task) {
            Ok(outputs) => WorkerMessage::Finished {
                outputs: outputs.into_iter().map(Bytes).collect(),
            },
            Err(message) => WorkerMessage::Failed { message },
        };
        send(&mut stream, &reply).await?;
    }
}

fn run(client: &StoreClient, task: &WorkerTask) -> Result<Vec<Vec<u8>>, String> {
    let views = task
        .inputs
        .iter()
        .map(|location| client.open(location))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| format!("cannot map an input: {error}"))?;
    let inputs: Vec<&[u8]> = views.iter().map(|view| view.as_bytes()).collect();
    execute(&task.kind, &inputs)
}

pub(crate) async fn send<T: Serialize>(
    stream: &mut FramedStream<UnixStream>,
    message: &T,
) -> Result<()> {
    stream
        .send_with(|out| codec::encode_into(message, out))
        .await?;
    Ok(())
}
