//! A `floe node` process on loopback, for integration tests and benchmarks. The process is
//! killed, and a shared-memory segment it left behind is removed, when the [`LocalNode`] is
//! dropped — even when a test fails half-way.

use std::fs::OpenOptions;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use floe_core::wire::{RpcClient, WireConfig};

use floe_api::node_protocol::{NodeProtocol, NodeRequest, NodeResponse, NodeStatus};

use super::{Error, LocalCredentials, Result, free_port};

/// How to run the node.
#[derive(Debug, Clone)]
pub struct LocalNodeConfig {
    /// The `floe` binary.
    pub binary: PathBuf,
    /// The scheduler replicas (`host:port`).
    pub schedulers: Vec<String>,
    /// The node keeps its files in `dir/<name>` and logs to `dir/<name>.log`.
    pub dir: PathBuf,
    pub name: String,
    pub credentials: LocalCredentials,
    /// Extra `section.key=value` settings.
    pub settings: Vec<String>,
}

pub struct LocalNode {
    child: Option<Child>,
    pid: u32,
    addr: String,
    data_dir: PathBuf,
    log: PathBuf,
}

impl LocalNode {
    /// Starts `floe node` on a free loopback port.
    pub fn start(config: &LocalNodeConfig) -> Result<Self> {
        Self::start_on(config, free_port()?)
    }

    /// Starts `floe node` on loopback port `port`.
    pub fn start_on(config: &LocalNodeConfig, port: u16) -> Result<Self> {
        let data_dir = config.dir.join(&config.name);
        std::fs::create_dir_all(&data_dir)
            .map_err(Error::io("creating the node's directory", &data_dir))?;
        let log = config.dir.join(format!("{}.log", config.name));
        let log_file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(Error::io("opening the node's log", &log))?;
        let mut command = Command::new(&config.binary);
        command
            .arg("node")
            .arg("--scheduler")
            .arg(config.schedulers.join(","))
            .arg("--set")
            .arg(format!("node.rpc_port={port}"))
            .arg("--set")
            .arg(format!("paths.data_dir={}", data_dir.display()));
        for setting in &config.settings {
            command.arg("--set").arg(setting);
        }
        // Only the settings given here: a FLOE_* variable in the caller's shell must not leak.
        for (name, _) in std::env::vars() {
            if name.starts_with("FLOE_") {
                command.env_remove(name);
            }
        }
        config.credentials.pass_to_node(&mut command);
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .map_err(Error::io("starting floe node from", &config.binary))?;
        Ok(Self {
            pid: child.id(),
            child: Some(child),
            addr: format!("127.0.0.1:{port}"),
            data_dir,
            log,
        })
    }

    /// The node's RPC address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The node's shared-memory segment as it appears in /dev/shm.
    pub fn segment(&self) -> PathBuf {
        PathBuf::from(format!("/dev/shm/floe-node-{}", self.pid))
    }

    /// The Unix socket its workers connect to.
    pub fn worker_socket(&self) -> PathBuf {
        self.data_dir.join(format!("node-{}.sock", self.pid))
    }

    /// Sends a signal (`"TERM"`, `"KILL"`, …) with kill(1).
    pub fn signal(&self, signal: &str) -> Result<()> {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid.to_string())
            .status()
            .map_err(Error::io("running", "kill"))?;
        if status.success() {
            Ok(())
        } else {
            Err(Error::Node(format!("kill -{signal} {} failed", self.pid)))
        }
    }

    /// Waits for the process to exit; `true` when it exited successfully.
    pub fn wait(&mut self) -> Result<bool> {
        match self.child.take() {
            Some(mut child) => Ok(child
                .wait()
                .map_err(Error::io("waiting for floe node at", &self.data_dir))?
                .success()),
            None => Ok(false),
        }
    }

    /// Waits until the node has registered and at least one worker is connected.
    pub async fn wait_registered(
        &self,
        wire: &WireConfig,
        timeout: Duration,
    ) -> Result<NodeStatus> {
        self.wait_until(wire, timeout, |status| status.workers > 0)
            .await
    }

    /// Waits until the node has registered and `workers` workers are connected.
    pub async fn wait_ready(
        &self,
        wire: &WireConfig,
        workers: u32,
        timeout: Duration,
    ) -> Result<NodeStatus> {
        self.wait_until(wire, timeout, |status| status.workers == workers)
            .await
    }

    /// Waits until the node has registered and its status satisfies `ready`.
    async fn wait_until(
        &self,
        wire: &WireConfig,
        timeout: Duration,
        ready: impl Fn(&NodeStatus) -> bool,
    ) -> Result<NodeStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(mut client) =
                RpcClient::<NodeProtocol>::connect(&self.addr, wire.clone()).await
                && let Ok(NodeResponse::Status(status)) = client.call(&NodeRequest::Status).await
                && status.node.is_some()
                && ready(&status)
            {
                return Ok(*status);
            }
            if Instant::now() >= deadline {
                return Err(Error::Node(format!(
                    "node {} did not get ready within {timeout:?}; see {}",
                    self.addr,
                    self.log.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for LocalNode {
    fn drop(&mut self) {
        // A failing test shows what the node said.
        if std::thread::panicking()
            && let Ok(log) = std::fs::read_to_string(&self.log)
        {
            eprintln!("--- {} ---\n{log}", self.log.display());
        }
        if let Some(mut child) = self.child.take() {
            // Best effort: the process may already be gone.
            let _ = child.kill();
            let _ = child.wait();
        }
        // A node killed with SIGKILL leaves its segment behind.
        let _ = std::fs::remove_file(self.segment());
    }
}
