//! A set of local `floe scheduler` processes on loopback, for integration
//! tests and benchmarks. Every process is killed when the [`LocalSchedulers`] is dropped, even
//! when a test fails half-way.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use floe_core::config::TlsConfig;
use floe_core::wire::WireConfig;

use floe_api::client::SchedulerClient;
use floe_api::scheduler_protocol::ReplicaStatus;

use super::{Error, LocalCredentials, LocalPort, Result};

/// How to run the cluster.
#[derive(Debug, Clone)]
pub struct LocalSchedulersConfig {
    /// The `floe` binary.
    pub binary: PathBuf,
    pub replicas: u64,
    /// Each replica keeps its data in `dir/replica-<id>` and logs to `dir/replica-<id>.log`.
    pub dir: PathBuf,
    pub credentials: LocalCredentials,
    /// Extra `section.key=value` settings for every replica.
    pub settings: Vec<String>,
    /// The replicas' TLS files; empty runs plaintext on loopback.
    pub tls: TlsConfig,
}

pub struct LocalSchedulers {
    config: LocalSchedulersConfig,
    peers: BTreeMap<u64, String>,
    /// Each replica's HTTP address (API, dashboard, metrics).
    http: BTreeMap<u64, String>,
    children: BTreeMap<u64, Child>,
}

impl LocalSchedulers {
    /// Picks free ports and starts every replica.
    pub fn start(config: LocalSchedulersConfig) -> Result<Self> {
        Self::start_on(config, LocalPort::Free, LocalPort::Free)
    }

    /// Starts every replica on the RPC and HTTP ports given (replica `id` on `port + id - 1`).
    pub fn start_on(
        config: LocalSchedulersConfig,
        rpc: LocalPort,
        http_port: LocalPort,
    ) -> Result<Self> {
        let mut peers = BTreeMap::new();
        let mut http = BTreeMap::new();
        let replicas = usize::try_from(config.replicas).unwrap_or(usize::MAX);
        for (index, id) in (1..=config.replicas).enumerate() {
            peers.insert(id, format!("127.0.0.1:{}", rpc.pick(index, replicas)?));
            http.insert(
                id,
                format!("127.0.0.1:{}", http_port.pick(index, replicas)?),
            );
        }
        let mut cluster = Self {
            config,
            peers,
            http,
            children: BTreeMap::new(),
        };
        for id in 1..=cluster.config.replicas {
            cluster.start_replica(id)?;
        }
        Ok(cluster)
    }

    pub fn peers_spec(&self) -> String {
        self.peers
            .iter()
            .map(|(id, addr)| format!("{id}={addr}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn addrs(&self) -> Vec<String> {
        self.peers.values().cloned().collect()
    }

    pub fn addr(&self, id: u64) -> Option<&str> {
        self.peers.get(&id).map(String::as_str)
    }

    /// Replica `id`'s HTTP address (`host:port`): the REST API, dashboard and `/metrics`.
    pub fn http_addr(&self, id: u64) -> Option<&str> {
        self.http.get(&id).map(String::as_str)
    }

    /// Starts (or restarts) replica `id` on its data directory.
    pub fn start_replica(&mut self, id: u64) -> Result<()> {
        let data_dir = self.config.dir.join(format!("replica-{id}"));
        let log_path = self.config.dir.join(format!("replica-{id}.log"));
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(Error::io("opening", &log_path))?;
        let mut command = Command::new(&self.config.binary);
        command
            .arg("scheduler")
            .arg("--id")
            .arg(id.to_string())
            .arg("--peers")
            .arg(self.peers_spec())
            .arg("--set")
            .arg(format!("paths.data_dir={}", data_dir.display()));
        if let Some(http) = self.http.get(&id).and_then(|addr| addr.rsplit_once(':')) {
            command
                .arg("--set")
                .arg(format!("scheduler.http_port={}", http.1));
        }
        for setting in self
            .config
            .settings
            .iter()
            .chain(&self.config.tls.settings())
        {
            command.arg("--set").arg(setting);
        }
        // Only the settings given here: a FLOE_* variable in the caller's shell must not leak.
        for (name, _) in std::env::vars() {
            if name.starts_with("FLOE_") {
                command.env_remove(name);
            }
        }
        self.config.credentials.pass_to_replica(&mut command);
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let child = command
            .spawn()
            .map_err(Error::io("starting", &self.config.binary))?;
        self.children.insert(id, child);
        Ok(())
    }

    /// Kills replica `id` with SIGKILL, as a crash would.
    pub fn kill(&mut self, id: u64) -> Result<()> {
        if let Some(mut child) = self.children.remove(&id) {
            child
                .kill()
                .and_then(|()| child.wait().map(drop))
                .map_err(Error::io("killing", &self.config.binary))?;
        }
        Ok(())
    }

    pub fn is_running(&self, id: u64) -> bool {
        self.children.contains_key(&id)
    }

    /// The process id of replica `id`, while it runs.
    pub fn pid(&self, id: u64) -> Option<u32> {
        self.children.get(&id).map(Child::id)
    }

    pub fn credentials(&self) -> &LocalCredentials {
        &self.config.credentials
    }

    /// Presents the cluster's admin token.
    pub fn wire(&self) -> WireConfig {
        self.config
            .credentials
            .admin_wire()
            .with_tls(&self.config.tls.client_only())
    }

    pub fn client(&self) -> Result<SchedulerClient> {
        Ok(SchedulerClient::new(self.addrs(), self.wire())?)
    }

    pub async fn status(&self, id: u64) -> Result<ReplicaStatus> {
        let addr = self
            .addr(id)
            .ok_or_else(|| Error::Schedulers(format!("no replica {id}")))?;
        Ok(SchedulerClient::status_of(addr, self.wire()).await?)
    }

    /// Waits until a running replica reports itself leader, and returns its id.
    pub async fn wait_for_leader(&self, timeout: Duration) -> Result<u64> {
        let deadline = Instant::now() + timeout;
        loop {
            for &id in self.children.keys() {
                if let Ok(status) = self.status(id).await
                    && status.leader == Some(id)
                {
                    return Ok(id);
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::Schedulers(format!("no leader within {timeout:?}")));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until replica `id` reports a status that satisfies `done`, and returns it.
    pub async fn wait_for_status(
        &self,
        id: u64,
        timeout: Duration,
        done: impl Fn(&ReplicaStatus) -> bool,
    ) -> Result<ReplicaStatus> {
        let deadline = Instant::now() + timeout;
        let mut last = None;
        loop {
            if let Ok(status) = self.status(id).await {
                if done(&status) {
                    return Ok(status);
                }
                last = Some(status);
            }
            if Instant::now() >= deadline {
                return Err(Error::Schedulers(format!(
                    "replica {id} did not get there within {timeout:?}; last status {last:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for LocalSchedulers {
    fn drop(&mut self) {
        for child in self.children.values_mut() {
            // Best effort: the process may already be gone.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
