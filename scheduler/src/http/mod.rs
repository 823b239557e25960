//! The HTTP side of a replica: the REST job API, the JSON API behind the dashboard, the
//! dashboard's embedded assets and Prometheus `/metrics` (see `docs/HTTP_API.md`).
//!
//! It runs on its own thread with actix-web's runtime, apart from the Raft loop, so a slow
//! HTTP client can never delay a heartbeat. Requests never wait on Raft for reads: a
//! monitor task refreshes a [`monitor::Snapshot`] once per interval (this replica's applied
//! state, the leader's soft state, every replica's Raft status) and handlers answer from
//! the latest one, so a page costs the same at 10,000 jobs whether one admin looks or ten.
//! Every call under `/api` and `/metrics` needs a client token with the route's scope
//! (reads `read` unless `http.public_reads`, job changes `submit`, cache cleaning `admin`);
//! mutations go to the leader through a [`SchedulerClient`] presenting the caller's own token.

mod api;
mod assets;
mod history_index;
mod inspect;
mod json;
mod logs;
mod metrics;
mod monitor;
mod node_calls;
mod result;
mod tasks;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::ServerHandle;
use actix_web::{App, web};
use floe_core::config::Config;
use floe_core::wire::WireConfig;
use tokio::sync::watch;

use crate::{Error, Result};
use floe_api::state::ClusterState;

/// Turns the text of a job-spec file into an encoded `floe_core::job::JobSpec`. The binary
/// supplies it, because parsing a spec needs the UDF catalog and the client's spec format,
/// which this crate does not depend on.
pub trait JobSpecParser: Send + Sync + 'static {
    fn parse(&self, text: &str) -> std::result::Result<ParsedJob, RejectedSpec>;
}

/// A job file, ready to submit.
#[derive(Debug, Clone)]
pub struct ParsedJob {
    /// The encoded `floe_core::job::JobSpec`.
    pub spec: Vec<u8>,
    /// The file's `name`, if it gives one.
    pub name: Option<String>,
}

/// Why a submitted job spec was refused: the message names the line and field.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct RejectedSpec(pub String);

/// Where and how to serve.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    pub bind: SocketAddr,
    /// This replica's id, shown on every page.
    pub replica_id: u64,
    /// Every replica's RPC address, for their Raft status and for mutations (which go to
    /// the leader).
    pub peers: BTreeMap<u64, String>,
    /// This replica's credential (for the leader's soft state and replicas' status) and the
    /// authenticator that checks callers' tokens.
    pub wire: WireConfig,
    /// How the API calls nodes (removing cleaned cache shards): as a cluster member.
    pub node_wire: WireConfig,
    /// `http.public_reads`: reads need no token.
    pub public_reads: bool,
    /// How often the monitor refreshes its snapshot (one history sample each time).
    pub refresh: Duration,
    /// This replica's job history file, listed by `/api/jobs?all=true`.
    pub job_history: Option<std::path::PathBuf>,
}

impl HttpConfig {
    /// The configuration of replica `replica_id` from the node's `Config`.
    pub fn new(config: &Config, replica_id: u64, peers: BTreeMap<u64, String>) -> Self {
        Self {
            bind: SocketAddr::new(config.scheduler.http_bind, config.scheduler.http_port),
            replica_id,
            peers,
            wire: WireConfig::replica(config, replica_id),
            node_wire: WireConfig::member(config),
            public_reads: config.http.public_reads,
            refresh: Duration::from_secs(1),
            job_history: Some(config.paths.data_dir.join(crate::history::HISTORY_FILE)),
        }
    }
}

/// A running HTTP server. Dropping it stops the server and its thread.
pub struct HttpServer {
    local_addr: SocketAddr,
    handle: ServerHandle,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HttpServer {
    /// Binds `config.bind` (so a taken port fails here, not later) and starts serving.
    pub fn start(
        config: HttpConfig,
        applied_state: watch::Receiver<Arc<ClusterState>>,
        parser: Arc<dyn JobSpecParser>,
    ) -> Result<Self> {
        floe_core::wire::tls::check_bind(config.bind, &config.wire.tls)?;
        // Checked before the thread starts, so an unusable certificate fails the start.
        let tls = match config.wire.tls.context()? {
            Some(context) => context.http_server(),
            None => None,
        };
        let listener = std::net::TcpListener::bind(config.bind)
            .map_err(Error::io("binding the HTTP port", config.bind.to_string()))?;
        let local_addr = listener
            .local_addr()
            .map_err(Error::io("reading the address of", config.bind.to_string()))?;
        let (handle_sender, handle_receiver) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("floe-http".into())
            .spawn(move || {
                serve(
                    config,
                    applied_state,
                    parser,
                    Listener {
                        socket: listener,
                        tls,
                    },
                    handle_sender,
                )
            })
            .map_err(Error::io(
                "starting the HTTP thread for",
                local_addr.to_string(),
            ))?;
        let handle = handle_receiver
            .recv()
            .map_err(|_| {
                Error::io("starting the HTTP server on", local_addr.to_string())(
                    std::io::Error::other("its thread ended before it served"),
                )
            })?
            .map_err(Error::io("serving HTTP on", local_addr.to_string()))?;
        Ok(Self {
            local_addr,
            handle,
            thread: Some(thread),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        // `stop` only asks; the thread ends once the server future returns.
        drop(self.handle.stop(false));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The bound socket, and the TLS configuration to serve HTTPS with, if any.
struct Listener {
    socket: std::net::TcpListener,
    tls: Option<rustls::ServerConfig>,
}

fn serve(
    config: HttpConfig,
    applied_state: watch::Receiver<Arc<ClusterState>>,
    parser: Arc<dyn JobSpecParser>,
    listener: Listener,
    started: std::sync::mpsc::Sender<std::io::Result<ServerHandle>>,
) {
    let system = actix_web::rt::System::new();
    system.block_on(async move {
        let monitor = Arc::new(monitor::Monitor::new(
            &config,
            applied_state.borrow().clone(),
        ));
        let refresher = actix_web::rt::spawn(monitor::run(
            Arc::clone(&monitor),
            config.clone(),
            applied_state.clone(),
        ));
        let shared = web::Data::new(api::Shared::new(&config, monitor, applied_state, parser));
        let server = actix_web::HttpServer::new(move || {
            App::new()
                .app_data(shared.clone())
                .wrap(actix_web::middleware::from_fn(api::authenticate))
                .configure(api::routes)
                .configure(assets::routes)
        })
        // One worker: every handler answers from memory, and the cluster's cores are for
        // tasks.
        .workers(1)
        .disable_signals();
        let server = match listener.tls {
            Some(tls) => server.listen_rustls_0_23(listener.socket, tls),
            None => server.listen(listener.socket),
        };
        let server = match server {
            Ok(server) => server.run(),
            Err(error) => {
                let _ = started.send(Err(error));
                return;
            }
        };
        let _ = started.send(Ok(server.handle()));
        if let Err(error) = server.await {
            tracing::error!(%error, "the HTTP server stopped");
        }
        refresher.abort();
    });
}
