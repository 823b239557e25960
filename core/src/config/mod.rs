//! One configuration struct for every floe process.
//!
//! Settings are read in three layers, each overriding the one before:
//!
//! 1. a TOML file (`--config FILE`, or the `FLOE_CONFIG` environment variable);
//! 2. `FLOE_<SECTION>_<KEY>` environment variables, e.g. `FLOE_SCHEDULER_RPC_PORT=7701`
//!    sets `scheduler.rpc_port` (every `FLOE_*` variable except `FLOE_CONFIG` must name a
//!    setting, so a typo is an error instead of a silently ignored value); the client's
//!    two settings also have short names, `FLOE_ADDRESS` and `FLOE_TOKEN`;
//! 3. command-line flags: `--set section.key=value`, and the dedicated flags of each command.
//!
//! Every default is in [`Config::default`] and documented on its field; `floe config show`
//! prints the effective result. Values are checked twice: [`Config::validate`] checks what can
//! be checked on paper (fractions, port clashes, limits), and [`Config::preflight`] checks the
//! machine (secrets set, directories writable, ports free) before a service starts.

mod allowed;
mod bytesize;
mod span;
mod tls;

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub use crate::auth::{ClientToken, ClusterSecret, ReplicaSecret, StorageSecret};
pub use allowed::{AllowedPaths, PathNotAllowed};
pub use bytesize::{ByteSize, ByteSizeError};
pub use span::{Span, SpanError};
pub use tls::{TlsConfig, TlsRole};

/// The environment variable that names the config file.
pub const CONFIG_FILE_ENV: &str = "FLOE_CONFIG";
const ENV_PREFIX: &str = "FLOE_";

/// The whole configuration of a floe process.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub cluster: ClusterConfig,
    pub client: ClientConfig,
    pub auth: AuthConfig,
    pub http: HttpAccess,
    pub net: NetConfig,
    pub scheduler: SchedulerConfig,
    pub node: NodeConfig,
    pub paths: PathsConfig,
    pub memory: MemoryConfig,
    pub data: DataConfig,
    pub storage: StorageConfig,
    pub cache: CacheConfig,
    pub timeouts: TimeoutsConfig,
    pub log: LogConfig,
    pub jobs: JobsConfig,
    pub nodes: NodesConfig,
    pub tls: TlsConfig,
}

/// `[cluster]`: what every member of one cluster shares.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// The secret replicas and nodes present to each other; clients never get it. Default:
    /// empty, which servers refuse to start with; set it with `FLOE_CLUSTER_SECRET` rather
    /// than a flag so it stays out of process listings.
    pub secret: ClusterSecret,
}

/// `[client]`: what a client process (the CLI, a program using floe-client) presents.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientConfig {
    /// A token from `floe token create`, usually set as `FLOE_CLIENT_TOKEN` (or its alias
    /// `FLOE_TOKEN`). Default: empty.
    pub token: ClientToken,
    /// Where the cluster is: every scheduler replica, `host:port,host:port,…`, usually set as
    /// `FLOE_ADDRESS` (like `RAY_ADDRESS`); a `--scheduler` flag overrides it. Default: empty.
    pub address: Vec<String>,
}

/// `[auth]`: where servers find the client tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// The tokens file (`name scopes sha256` per line), re-read when it changes; relative to
    /// `paths.data_dir`. Default `tokens`.
    pub tokens_file: PathBuf,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            tokens_file: PathBuf::from("tokens"),
        }
    }
}

/// `[http]`: who may use a replica's REST API.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpAccess {
    /// Serve reads (jobs, nodes, cache, metrics) without a token. Default false: reads need a
    /// token with the `read` scope.
    pub public_reads: bool,
}

/// `[net]`: sockets and framing shared by all services.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NetConfig {
    /// The address services listen on. Default `127.0.0.1`: nothing is reachable from other
    /// hosts until an operator says so.
    pub bind_host: IpAddr,
    /// The largest RPC frame accepted or sent. Default 64MiB (objects move in ~5 MiB chunks).
    pub max_frame: ByteSize,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            bind_host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            max_frame: ByteSize::mib(64),
        }
    }
}

/// `[scheduler]`: a scheduler replica's ports. Port 0 asks the OS for a free port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerConfig {
    /// Internal RPC (nodes, clients, other replicas). Default 7700.
    pub rpc_port: u16,
    /// REST API, dashboard and `/metrics`. Default 7780.
    pub http_port: u16,
    /// The address the HTTP listener binds, apart from `net.bind_host` so the REST API can
    /// stay on loopback while RPC faces the network. Default `127.0.0.1`.
    pub http_bind: IpAddr,
    /// The secret only replicas hold: it authenticates Raft peers and signs node tickets.
    /// Default: empty, which replicas refuse to start with; set `FLOE_SCHEDULER_REPLICA_SECRET`.
    pub replica_secret: ReplicaSecret,
    /// How often nodes send a heartbeat with their resource use. Default 1000.
    pub heartbeat_interval_ms: u64,
    /// Heartbeat periods a node may miss before the leader commits it dead (as Ray's
    /// health-check failure threshold). Default 5.
    pub missed_heartbeats: u32,
    /// One Raft tick. Default 100.
    pub raft_tick_ms: u64,
    /// Ticks without a leader before a follower campaigns; raft-rs randomizes the timeout in
    /// [election_ticks, 2 × election_ticks). Default 10 (1 to 2 seconds).
    pub election_ticks: u32,
    /// Ticks between the leader's heartbeats; must be below `election_ticks`. Default 2.
    pub heartbeat_ticks: u32,
    /// Applied entries past the last snapshot that trigger a new snapshot and log compaction.
    /// Default 10000.
    pub snapshot_entries: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            rpc_port: 7700,
            http_port: 7780,
            http_bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            replica_secret: ReplicaSecret::default(),
            heartbeat_interval_ms: 1_000,
            missed_heartbeats: 5,
            raft_tick_ms: 100,
            election_ticks: 10,
            heartbeat_ticks: 2,
            snapshot_entries: 10_000,
        }
    }
}

impl SchedulerConfig {
    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }

    pub fn raft_tick(&self) -> Duration {
        Duration::from_millis(self.raft_tick_ms)
    }

    /// How long a node may stay silent before it is committed dead.
    pub fn node_timeout(&self) -> Duration {
        self.heartbeat_interval() * self.missed_heartbeats
    }

    /// How long a placement lease lives without a renewal: the node timeout, at most
    /// [`MAX_LEASE_TTL`]. A lease dies with its node anyway; the cap keeps a new leader's
    /// grace period (a fifth of the TTL) short where nodes are given a long timeout.
    pub fn lease_ttl(&self) -> Duration {
        self.node_timeout().min(MAX_LEASE_TTL)
    }
}

/// The longest a placement lease lives without a renewal (see [`SchedulerConfig::lease_ttl`]).
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(10);

/// `[node]`: a node agent's port, worker processes, object transfer and memory monitor. Port 0
/// asks the OS for a free port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// Object transfer and actor messages between nodes. Default 7800.
    pub rpc_port: u16,
    /// `floe worker` processes the agent keeps running; 0 means one per CPU. Default 0.
    pub workers: u32,
    /// Share of the node's memory less its system reserve that the node's processes may use
    /// before the memory monitor kills the newest task's worker, in (0, 1]. Default 0.95.
    pub memory_monitor_threshold: f64,
    /// How often the memory monitor reads the node's processes' memory. Default 250.
    pub memory_monitor_interval_ms: u64,
    /// How often a job driver on this node reports progress to the scheduler (and notices a
    /// cancellation). Default 500.
    pub progress_interval_ms: u64,
    /// Bytes per request when pulling an object from another node. Default 5MiB.
    pub transfer_chunk: ByteSize,
    /// Bytes of chunk requests one pull keeps in flight; at least one chunk. Default 20MiB.
    pub transfer_max_in_flight: ByteSize,
    /// Objects up to this size travel inline in one message instead of in chunks. Default
    /// 100KiB.
    pub transfer_inline_max: ByteSize,
    /// The only commands a process UDF may run on this node (looked up on `PATH`); empty
    /// refuses every process UDF. Default `["python3"]`.
    pub udf_commands: Vec<String>,
    /// Directories a process UDF's script must be under (symlinks and `..` resolved); empty
    /// refuses every process UDF unless `udf_allow_inline`. Default `[]`.
    pub udf_roots: Vec<PathBuf>,
    /// Lets a process UDF run any command line (`python3 -c …`, a script anywhere) that
    /// `udf_commands` allows: for development only. Default false.
    pub udf_allow_inline: bool,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            rpc_port: 7800,
            workers: 0,
            memory_monitor_threshold: 0.95,
            memory_monitor_interval_ms: 250,
            progress_interval_ms: 500,
            transfer_chunk: ByteSize::mib(5),
            transfer_max_in_flight: ByteSize::mib(20),
            transfer_inline_max: ByteSize::kib(100),
            udf_commands: vec!["python3".to_owned()],
            udf_roots: Vec::new(),
            udf_allow_inline: false,
        }
    }
}

impl NodeConfig {
    pub fn memory_monitor_interval(&self) -> Duration {
        Duration::from_millis(self.memory_monitor_interval_ms)
    }

    pub fn progress_interval(&self) -> Duration {
        Duration::from_millis(self.progress_interval_ms)
    }
}

/// `[paths]`: where floe keeps files. Relative paths are resolved against `data_dir`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PathsConfig {
    /// Root of everything floe writes. Default `/tmp/floe` (as Ray uses `/tmp/ray`); production
    /// deployments point it at a real disk.
    pub data_dir: PathBuf,
    /// Objects spilled from the object store. Default `spill`.
    pub spill_dir: PathBuf,
    /// Fingerprint cache shards. Default `cache`.
    pub cache_dir: PathBuf,
    /// Disk-backed objects created when the store is full of pinned objects. Default `fallback`.
    pub fallback_dir: PathBuf,
    /// A scheduler replica's Raft log, hard state and snapshots. Default `raft`.
    pub raft_dir: PathBuf,
}

impl Default for PathsConfig {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from("/tmp/floe"),
            spill_dir: PathBuf::from("spill"),
            cache_dir: PathBuf::from("cache"),
            fallback_dir: PathBuf::from("fallback"),
            raft_dir: PathBuf::from("raft"),
        }
    }
}

impl PathsConfig {
    pub fn spill_dir(&self) -> PathBuf {
        self.data_dir.join(&self.spill_dir)
    }

    pub fn cache_dir(&self) -> PathBuf {
        self.data_dir.join(&self.cache_dir)
    }

    pub fn fallback_dir(&self) -> PathBuf {
        self.data_dir.join(&self.fallback_dir)
    }

    pub fn raft_dir(&self) -> PathBuf {
        self.data_dir.join(&self.raft_dir)
    }
}

/// `[memory]`: how a node divides its memory (DESIGN.md, "Memory model").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemoryConfig {
    /// The node's memory M: `"auto"` (read from the host) or a size such as `"16GiB"`.
    pub total: MemoryTotal,
    /// Share of M given to the shared-memory object store. Default 0.3.
    pub object_store_fraction: f64,
    /// Share of M kept free for the OS and floe's own processes. Default 0.1.
    pub system_reserve_fraction: f64,
    /// Lower bound of the object store. Default 75MiB.
    pub object_store_min: ByteSize,
    /// Upper bound of the object store. Default 200GB.
    pub object_store_max: ByteSize,
    /// Share of the object store in use past which the least recently used unpinned objects
    /// are spilled to `paths.spill_dir`. Default 0.8.
    pub spill_threshold: f64,
    /// Smallest spill file: small objects are fused until a file holds at least this much,
    /// so spilling many small objects does not become many small writes. Default 100MiB.
    pub min_spilling_size: ByteSize,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self {
            total: MemoryTotal::Auto,
            object_store_fraction: 0.3,
            system_reserve_fraction: 0.1,
            object_store_min: ByteSize::mib(75),
            object_store_max: ByteSize(200_000_000_000),
            spill_threshold: 0.8,
            min_spilling_size: ByteSize::mib(100),
        }
    }
}

/// `[storage]`: credentials and endpoints for object-storage URLs (`s3://`, `gs://`,
/// `az://`), over what each cloud's own environment variables say. An empty string (the
/// default) leaves a setting to the environment. The keys are `object_store`'s own names.
/// Secrets never show in `Debug` or `floe config show`, and never enter a plan.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    /// S3's access key id (`AWS_ACCESS_KEY_ID`).
    pub aws_access_key_id: String,
    /// S3's secret access key (`AWS_SECRET_ACCESS_KEY`).
    pub aws_secret_access_key: StorageSecret,
    /// A temporary credential's session token (`AWS_SESSION_TOKEN`).
    pub aws_session_token: StorageSecret,
    /// The region (`AWS_REGION`).
    pub aws_region: String,
    /// An S3-compatible server's URL, e.g. `http://minio:9000` (`AWS_ENDPOINT_URL`).
    pub aws_endpoint: String,
    /// Allow plain HTTP to the endpoint (`AWS_ALLOW_HTTP`). Default false: only `true`
    /// changes anything.
    pub aws_allow_http: bool,
    /// A Google service account's JSON key, inline (`GOOGLE_SERVICE_ACCOUNT_KEY`).
    pub google_service_account_key: StorageSecret,
    /// Azure's storage account (`AZURE_STORAGE_ACCOUNT_NAME`).
    pub azure_storage_account_name: String,
    /// Azure's account key (`AZURE_STORAGE_ACCOUNT_KEY`).
    pub azure_storage_account_key: StorageSecret,
}

impl StorageConfig {
    /// The settings that are set, as `(object_store key, value)` pairs: what a store builder
    /// takes, and what a node passes on to its workers (`FLOE_STORAGE_<KEY>`).
    pub fn options(&self) -> Vec<(&'static str, &str)> {
        let allow_http = if self.aws_allow_http { "true" } else { "" };
        [
            ("aws_access_key_id", self.aws_access_key_id.as_str()),
            ("aws_secret_access_key", self.aws_secret_access_key.expose()),
            ("aws_session_token", self.aws_session_token.expose()),
            ("aws_region", self.aws_region.as_str()),
            ("aws_endpoint", self.aws_endpoint.as_str()),
            ("aws_allow_http", allow_http),
            (
                "google_service_account_key",
                self.google_service_account_key.expose(),
            ),
            (
                "azure_storage_account_name",
                self.azure_storage_account_name.as_str(),
            ),
            (
                "azure_storage_account_key",
                self.azure_storage_account_key.expose(),
            ),
        ]
        .into_iter()
        .filter(|(_, value)| !value.is_empty())
        .collect()
    }

    /// The secrets shown as `<redacted>`, for `floe config show`.
    fn redacted(&self) -> Self {
        let hide = |secret: &StorageSecret| match secret.is_empty() {
            true => StorageSecret::default(),
            false => StorageSecret::new("<redacted>"),
        };
        Self {
            aws_secret_access_key: hide(&self.aws_secret_access_key),
            aws_session_token: hide(&self.aws_session_token),
            google_service_account_key: hide(&self.google_service_account_key),
            azure_storage_account_key: hide(&self.azure_storage_account_key),
            ..self.clone()
        }
    }
}

/// `[data]`: how Dataset execution cuts data into blocks (DESIGN.md, "Blocks and objects").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Outputs smaller than this are coalesced with their neighbours. Default 1MiB.
    pub min_block_size: ByteSize,
    /// Reads aim for blocks up to this size; an output over 1.5 × this is split. Default 128MiB.
    pub max_block_size: ByteSize,
    /// Absolute directories jobs may read from and write to (inputs, sinks, process-UDF
    /// files), checked by the scheduler when it plans a submitted spec and by every node
    /// before it runs a task; empty allows any path. Default `[]`.
    pub allowed_paths: Vec<PathBuf>,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            min_block_size: ByteSize::mib(1),
            max_block_size: ByteSize::mib(128),
            allowed_paths: Vec::new(),
        }
    }
}

impl DataConfig {
    /// The roots `allowed_paths` names, resolved.
    pub fn allowed(&self) -> AllowedPaths {
        AllowedPaths::under(&self.allowed_paths)
    }
}

/// `[cache]`: the node's fingerprint cache (shards in `paths.cache_dir`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Bytes of shard files the node keeps; past it, writes evict least recently used shards
    /// that are not in use. At least `data.max_block_size`. Default 20GiB: bounded, so a
    /// default install under `/tmp` cannot fill its disk; raise it on a disk of its own.
    /// (To keep nothing, disable caching for the job rather than shrinking the cap.)
    pub max_bytes: ByteSize,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            max_bytes: ByteSize::gib(20),
        }
    }
}

/// `[jobs]`: how long the scheduler keeps what finished jobs leave behind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobsConfig {
    /// How long a succeeded job's output blocks stay in the object stores when its client
    /// neither releases them nor deletes the job. Default 1h.
    pub result_ttl: Span,
    /// Finished jobs kept in the replicated state; older ones move to each replica's history
    /// file. At least 1. Default 1000.
    pub keep_finished: u64,
    /// Finished jobs older than this move to the history whatever their number. Default 7d.
    pub keep_for: Span,
}

impl Default for JobsConfig {
    fn default() -> Self {
        Self {
            result_ttl: Span::hours(1),
            keep_finished: 1_000,
            keep_for: Span::days(7),
        }
    }
}

/// `[nodes]`: how long the scheduler remembers nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodesConfig {
    /// A node committed dead leaves the replicated state (and the dashboard) this long after
    /// its death. Default 1h.
    pub forget_dead_after: Span,
}

impl Default for NodesConfig {
    fn default() -> Self {
        Self {
            forget_dead_after: Span::hours(1),
        }
    }
}

/// A node's total memory: detected, or set by the operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryTotal {
    Auto,
    Fixed(ByteSize),
}

impl Serialize for MemoryTotal {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            MemoryTotal::Auto => serializer.serialize_str("auto"),
            MemoryTotal::Fixed(size) => size.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for MemoryTotal {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Bytes(u64),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Text(text) if text.eq_ignore_ascii_case("auto") => Ok(MemoryTotal::Auto),
            Raw::Text(text) => text
                .parse()
                .map(MemoryTotal::Fixed)
                .map_err(serde::de::Error::custom),
            Raw::Bytes(bytes) => Ok(MemoryTotal::Fixed(ByteSize(bytes))),
        }
    }
}

/// `[timeouts]`, in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutsConfig {
    /// Opening a TCP connection. Default 5000.
    pub connect_ms: u64,
    /// The handshake after connecting; a peer that stalls here is dropped. Default 5000.
    pub handshake_ms: u64,
    /// Receiving one frame once it has started, or a reply to a request. Default 30000.
    pub read_ms: u64,
    /// Sending one frame. Default 30000.
    pub write_ms: u64,
    /// How long a server keeps a connection with no request in flight. Default 300000.
    pub idle_ms: u64,
}

impl Default for TimeoutsConfig {
    fn default() -> Self {
        Self {
            connect_ms: 5_000,
            handshake_ms: 5_000,
            read_ms: 30_000,
            write_ms: 30_000,
            idle_ms: 300_000,
        }
    }
}

impl TimeoutsConfig {
    pub fn connect(&self) -> Duration {
        Duration::from_millis(self.connect_ms)
    }

    pub fn handshake(&self) -> Duration {
        Duration::from_millis(self.handshake_ms)
    }

    pub fn read(&self) -> Duration {
        Duration::from_millis(self.read_ms)
    }

    pub fn write(&self) -> Duration {
        Duration::from_millis(self.write_ms)
    }

    pub fn idle(&self) -> Duration {
        Duration::from_millis(self.idle_ms)
    }
}

/// `[log]`. The filter comes from `RUST_LOG` (default `info`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `"text"` for people (default) or `"json"`, one object per line, for machines.
    pub format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Which long-running service a host check is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Scheduler,
    Node,
}

/// Where a setting came from, so an error can point at it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    File(PathBuf),
    Env(String),
    Flag,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File(path) => write!(f, "config file {}", path.display()),
            Origin::Env(name) => write!(f, "environment variable {name}"),
            Origin::Flag => f.write_str("command-line flag"),
        }
    }
}

/// Why a configuration could not be loaded or is not usable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {}: {source}", path.display())]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {}: {message}", path.display())]
    ParseFile { path: PathBuf, message: String },
    #[error("{origin}: unknown setting {key:?}; known settings: {known}")]
    UnknownKey {
        origin: Origin,
        key: String,
        known: String,
    },
    #[error("{origin}: bad value {value:?} for {key}: {reason}")]
    BadValue {
        origin: Origin,
        key: String,
        value: String,
        reason: String,
    },
    #[error("{origin}: expected section.key=value, got {input:?}")]
    BadAssignment { origin: Origin, input: String },
    #[error("invalid setting {key}: {reason}")]
    Invalid { key: &'static str, reason: String },
    #[error("{key} = {}: {problem}", path.display())]
    Directory {
        key: &'static str,
        path: PathBuf,
        problem: String,
    },
    #[error("{key}: cannot listen on {addr}: {source} (is another floe process using it?)")]
    PortUnavailable {
        key: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Tls(#[from] crate::wire::TlsError),
    #[error("cannot represent the configuration as TOML: {0}")]
    Render(String),
}

/// One `section.key = value` assignment from the environment or the command line.
#[derive(Debug, Clone)]
struct Assignment {
    key: String,
    value: String,
    origin: Origin,
}

/// Builds a [`Config`] from its three layers; see the module documentation.
#[derive(Debug, Clone, Default)]
pub struct ConfigLoader {
    file: Option<PathBuf>,
    env: Vec<Assignment>,
    flags: Vec<Assignment>,
}

impl ConfigLoader {
    pub fn new() -> Self {
        Self::default()
    }

    /// Layer 1: the TOML file.
    pub fn file(mut self, path: impl Into<PathBuf>) -> Self {
        self.file = Some(path.into());
        self
    }

    /// Layer 2: every `FLOE_*` variable except `FLOE_CONFIG`; other variables are ignored.
    /// Pass `std::env::vars()`.
    pub fn env(mut self, vars: impl IntoIterator<Item = (String, String)>) -> Self {
        let mut settings: Vec<(String, String)> = vars
            .into_iter()
            .filter(|(name, _)| name.starts_with(ENV_PREFIX) && name != CONFIG_FILE_ENV)
            .collect();
        // The environment has no order of its own; sort so errors are reproducible, aliases
        // first so the full names override them.
        settings.sort_by(|(a, _), (b, _)| {
            (env_alias(a).is_none(), a).cmp(&(env_alias(b).is_none(), b))
        });
        for (name, value) in settings {
            let key = env_name_to_key(&name);
            self.env.push(Assignment {
                key,
                value,
                origin: Origin::Env(name),
            });
        }
        self
    }

    /// Layer 3: a `section.key=value` flag.
    pub fn set(mut self, assignment: &str) -> Result<Self, ConfigError> {
        let Some((key, value)) = assignment.split_once('=') else {
            return Err(ConfigError::BadAssignment {
                origin: Origin::Flag,
                input: assignment.to_owned(),
            });
        };
        self.flags.push(Assignment {
            key: key.trim().to_owned(),
            value: value.to_owned(),
            origin: Origin::Flag,
        });
        Ok(self)
    }

    pub fn load(self) -> Result<Config, ConfigError> {
        let base = match &self.file {
            Some(path) => read_file(path)?,
            None => Config::default(),
        };
        let mut table = base.to_table()?;
        let mut config = base;
        // Layers apply in precedence order, whatever order the builder was called in.
        for assignment in self.env.iter().chain(&self.flags) {
            config = apply(&mut table, assignment)?;
        }
        config.validate()?;
        Ok(config)
    }
}

fn read_file(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|error| ConfigError::ParseFile {
        path: path.to_owned(),
        message: error.to_string(),
    })
}

/// Short environment names for the client's settings, as other tools spell them
/// (`RAY_ADDRESS`): each is applied before the variables that spell the key in full, so
/// `FLOE_CLIENT_TOKEN` wins over `FLOE_TOKEN` when both are set.
const ENV_ALIASES: [(&str, &str); 2] = [
    ("FLOE_ADDRESS", "client.address"),
    ("FLOE_TOKEN", "client.token"),
];

fn env_alias(name: &str) -> Option<&'static str> {
    ENV_ALIASES
        .iter()
        .find(|(alias, _)| *alias == name)
        .map(|(_, key)| *key)
}

/// `FLOE_SCHEDULER_RPC_PORT` → `scheduler.rpc_port`. Section names are single words, so the
/// first underscore after the prefix separates section from key.
fn env_name_to_key(name: &str) -> String {
    if let Some(key) = env_alias(name) {
        return key.to_owned();
    }
    let rest = name.trim_start_matches(ENV_PREFIX).to_ascii_lowercase();
    match rest.split_once('_') {
        Some((section, key)) => format!("{section}.{key}"),
        None => rest,
    }
}

/// Sets one key in `table`, typed like the value it replaces, and re-reads the whole config so
/// that a bad value is reported against the assignment that introduced it.
fn apply(table: &mut toml::Table, assignment: &Assignment) -> Result<Config, ConfigError> {
    let unknown = |table: &toml::Table| ConfigError::UnknownKey {
        origin: assignment.origin.clone(),
        key: assignment.key.clone(),
        known: known_keys(table, &assignment.key).join(", "),
    };
    let bad_value = |reason: String| ConfigError::BadValue {
        origin: assignment.origin.clone(),
        key: assignment.key.clone(),
        value: assignment.value.clone(),
        reason,
    };
    let Some((section_name, field)) = assignment.key.split_once('.') else {
        return Err(unknown(table));
    };
    let current = table
        .get(section_name)
        .and_then(toml::Value::as_table)
        .and_then(|section| section.get(field));
    let Some(current) = current else {
        return Err(unknown(table));
    };
    let raw = assignment.value.trim();
    let value = match current {
        toml::Value::Integer(_) => raw
            .parse()
            .map(toml::Value::Integer)
            .map_err(|_| bad_value("expected an integer".into()))?,
        toml::Value::Float(_) => raw
            .parse()
            .map(toml::Value::Float)
            .map_err(|_| bad_value("expected a number".into()))?,
        toml::Value::Boolean(_) => raw
            .parse()
            .map(toml::Value::Boolean)
            .map_err(|_| bad_value("expected true or false".into()))?,
        // Lists are written comma-separated: `FLOE_NODE_UDF_COMMANDS=python3,python3.12`.
        toml::Value::Array(_) => toml::Value::Array(
            raw.split(',')
                .map(str::trim)
                .filter(|item| !item.is_empty())
                .map(|item| toml::Value::String(item.to_owned()))
                .collect(),
        ),
        _ => toml::Value::String(assignment.value.clone()),
    };
    if let Some(section) = table
        .get_mut(section_name)
        .and_then(toml::Value::as_table_mut)
    {
        section.insert(field.to_owned(), value);
    }
    Config::deserialize(toml::Value::Table(table.clone()))
        .map_err(|error| bad_value(error.message().to_owned()))
}

/// The settings to suggest for an unknown `key`: those of its section when the section
/// exists, else every setting.
fn known_keys(table: &toml::Table, key: &str) -> Vec<String> {
    let wanted_section = key.split_once('.').map_or(key, |(section, _)| section);
    let section_exists = table.contains_key(wanted_section);
    table
        .iter()
        .filter(|(section, _)| !section_exists || section.as_str() == wanted_section)
        .filter_map(|(section, value)| Some((section, value.as_table()?)))
        .flat_map(|(section, fields)| fields.keys().map(move |field| format!("{section}.{field}")))
        .collect()
}

impl Config {
    /// Where the client tokens are: `auth.tokens_file` under `paths.data_dir`.
    pub fn tokens_file(&self) -> PathBuf {
        self.paths.data_dir.join(&self.auth.tokens_file)
    }

    fn to_table(&self) -> Result<toml::Table, ConfigError> {
        toml::Table::try_from(self).map_err(|error| ConfigError::Render(error.to_string()))
    }

    /// The effective configuration as TOML, with every secret replaced by `<redacted>`.
    pub fn to_toml_redacted(&self) -> Result<String, ConfigError> {
        let mut shown = self.clone();
        if !shown.cluster.secret.is_empty() {
            shown.cluster.secret = ClusterSecret::new("<redacted>");
        }
        if !shown.scheduler.replica_secret.is_empty() {
            shown.scheduler.replica_secret = ReplicaSecret::new("<redacted>");
        }
        if !shown.client.token.is_empty() {
            shown.client.token = ClientToken::new("<redacted>");
        }
        shown.storage = shown.storage.redacted();
        toml::to_string(&shown).map_err(|error| ConfigError::Render(error.to_string()))
    }

    /// Checks everything that does not need the machine.
    fn validate_node(&self) -> Result<(), ConfigError> {
        let node = &self.node;
        let threshold = node.memory_monitor_threshold;
        if !(threshold.is_finite() && threshold > 0.0 && threshold <= 1.0) {
            return Err(ConfigError::Invalid {
                key: "node.memory_monitor_threshold",
                reason: format!("{threshold} is not a share in (0, 1]"),
            });
        }
        if node.memory_monitor_interval_ms == 0 {
            return Err(ConfigError::Invalid {
                key: "node.memory_monitor_interval_ms",
                reason: "must be at least 1".into(),
            });
        }
        if node.progress_interval_ms == 0 {
            return Err(ConfigError::Invalid {
                key: "node.progress_interval_ms",
                reason: "must be at least 1".into(),
            });
        }
        // A chunk larger than net.max_frame allows is cut down to fit by the agent, so the two
        // settings need not be changed together.
        let chunk = node.transfer_chunk;
        if chunk.bytes() == 0 {
            return Err(ConfigError::Invalid {
                key: "node.transfer_chunk",
                reason: "must be at least 1 byte".into(),
            });
        }
        if node.transfer_max_in_flight < chunk {
            return Err(ConfigError::Invalid {
                key: "node.transfer_max_in_flight",
                reason: format!(
                    "{} is less than one node.transfer_chunk ({chunk})",
                    node.transfer_max_in_flight
                ),
            });
        }
        if node.transfer_inline_max > chunk {
            return Err(ConfigError::Invalid {
                key: "node.transfer_inline_max",
                reason: format!(
                    "{} is larger than node.transfer_chunk ({chunk})",
                    node.transfer_inline_max
                ),
            });
        }
        if let Some(root) = node.udf_roots.iter().find(|root| !root.is_absolute()) {
            return Err(ConfigError::Invalid {
                key: "node.udf_roots",
                reason: format!("{} is not an absolute directory", root.display()),
            });
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(root) = self.data.allowed_paths.iter().find(|root| {
            (!root.is_absolute() && !crate::location::is_remote(root))
                || root
                    .components()
                    .any(|c| c == std::path::Component::ParentDir)
        }) {
            return Err(ConfigError::Invalid {
                key: "data.allowed_paths",
                reason: format!("{} must be absolute, without ..", root.display()),
            });
        }
        let memory = &self.memory;
        check_fraction("memory.object_store_fraction", memory.object_store_fraction)?;
        check_fraction(
            "memory.system_reserve_fraction",
            memory.system_reserve_fraction,
        )?;
        let reserved = memory.object_store_fraction + memory.system_reserve_fraction;
        if reserved >= 1.0 {
            return Err(ConfigError::Invalid {
                key: "memory.object_store_fraction",
                reason: format!(
                    "object_store_fraction {} + system_reserve_fraction {} = {reserved} leaves \
                     no heap for tasks; the two must sum to less than 1",
                    memory.object_store_fraction, memory.system_reserve_fraction
                ),
            });
        }
        if memory.object_store_min > memory.object_store_max {
            return Err(ConfigError::Invalid {
                key: "memory.object_store_min",
                reason: format!(
                    "object_store_min {} is larger than object_store_max {}",
                    memory.object_store_min, memory.object_store_max
                ),
            });
        }
        if let MemoryTotal::Fixed(total) = memory.total
            && total < memory.object_store_min
        {
            return Err(ConfigError::Invalid {
                key: "memory.total",
                reason: format!(
                    "{total} is less than the object store's minimum {}",
                    memory.object_store_min
                ),
            });
        }
        // A threshold of 0 would spill every object as soon as it is sealed; above 1 would never
        // spill before allocations start failing.
        if !(memory.spill_threshold.is_finite()
            && memory.spill_threshold > 0.0
            && memory.spill_threshold <= 1.0)
        {
            return Err(ConfigError::Invalid {
                key: "memory.spill_threshold",
                reason: format!(
                    "{} is not a share of the object store in (0, 1]",
                    memory.spill_threshold
                ),
            });
        }
        if memory.min_spilling_size.bytes() == 0 {
            return Err(ConfigError::Invalid {
                key: "memory.min_spilling_size",
                reason: "must be at least 1 byte".into(),
            });
        }
        let data = &self.data;
        if data.min_block_size.bytes() == 0 || data.min_block_size > data.max_block_size {
            return Err(ConfigError::Invalid {
                key: "data.min_block_size",
                reason: format!(
                    "{} must be at least 1 byte and at most data.max_block_size {}",
                    data.min_block_size, data.max_block_size
                ),
            });
        }
        // Below one block, each output written would evict the one before it, so a pipeline
        // could never reuse anything.
        if self.cache.max_bytes < data.max_block_size {
            return Err(ConfigError::Invalid {
                key: "cache.max_bytes",
                reason: format!(
                    "{} is less than one block (data.max_block_size {}); to cache nothing, \
                     disable caching instead",
                    self.cache.max_bytes, data.max_block_size
                ),
            });
        }
        let frame = self.net.max_frame;
        // The floor is serde's cap on one decoder preallocation (1 MiB), so no input can make
        // a decoder allocate more than the frame limit in one piece.
        if frame < ByteSize::mib(1) || frame > ByteSize::gib(1) {
            return Err(ConfigError::Invalid {
                key: "net.max_frame",
                reason: format!("{frame} is outside the supported range 1MiB..=1GiB"),
            });
        }
        self.validate_node()?;
        if self.jobs.keep_finished == 0 {
            return Err(ConfigError::Invalid {
                key: "jobs.keep_finished",
                reason: "must be at least 1".into(),
            });
        }
        let scheduler = &self.scheduler;
        if scheduler.rpc_port != 0 && scheduler.rpc_port == scheduler.http_port {
            return Err(ConfigError::Invalid {
                key: "scheduler.http_port",
                reason: format!(
                    "{} is also scheduler.rpc_port; the two need different ports",
                    scheduler.http_port
                ),
            });
        }
        for (key, value) in [
            (
                "scheduler.heartbeat_interval_ms",
                scheduler.heartbeat_interval_ms,
            ),
            (
                "scheduler.missed_heartbeats",
                u64::from(scheduler.missed_heartbeats),
            ),
            ("scheduler.raft_tick_ms", scheduler.raft_tick_ms),
            (
                "scheduler.heartbeat_ticks",
                u64::from(scheduler.heartbeat_ticks),
            ),
            ("scheduler.snapshot_entries", scheduler.snapshot_entries),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid {
                    key,
                    reason: "must be at least 1".into(),
                });
            }
        }
        if scheduler.election_ticks <= scheduler.heartbeat_ticks {
            return Err(ConfigError::Invalid {
                key: "scheduler.election_ticks",
                reason: format!(
                    "{} must be larger than scheduler.heartbeat_ticks ({}), or followers would \
                     campaign against a healthy leader",
                    scheduler.election_ticks, scheduler.heartbeat_ticks
                ),
            });
        }
        let timeouts = &self.timeouts;
        for (key, value) in [
            ("timeouts.connect_ms", timeouts.connect_ms),
            ("timeouts.handshake_ms", timeouts.handshake_ms),
            ("timeouts.read_ms", timeouts.read_ms),
            ("timeouts.write_ms", timeouts.write_ms),
            ("timeouts.idle_ms", timeouts.idle_ms),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid {
                    key,
                    reason: "must be at least 1 millisecond".into(),
                });
            }
        }
        if self.paths.data_dir.as_os_str().is_empty() {
            return Err(ConfigError::Invalid {
                key: "paths.data_dir",
                reason: "must not be empty".into(),
            });
        }
        self.tls.role()?;
        Ok(())
    }

    /// Checks that `service` can start here: its secrets are set, its directories exist
    /// (they are created) and are writable, it serves TLS unless it listens on loopback only
    /// (and the TLS files load), and its ports are free on `net.bind_host`.
    pub fn preflight(&self, service: Service) -> Result<(), ConfigError> {
        if self.cluster.secret.is_empty() {
            return Err(ConfigError::Invalid {
                key: "cluster.secret",
                reason: "is empty, and servers refuse members without it; set \
                         FLOE_CLUSTER_SECRET to a long random secret"
                    .into(),
            });
        }
        if service == Service::Scheduler && self.scheduler.replica_secret.is_empty() {
            return Err(ConfigError::Invalid {
                key: "scheduler.replica_secret",
                reason: "is empty, and replicas refuse each other without it; set \
                         FLOE_SCHEDULER_REPLICA_SECRET to a long random secret (the same on \
                         every replica, never on nodes)"
                    .into(),
            });
        }
        let paths = &self.paths;
        let directories = match service {
            Service::Scheduler => vec![
                ("paths.data_dir", paths.data_dir.clone()),
                ("paths.raft_dir", paths.raft_dir()),
            ],
            Service::Node => vec![
                ("paths.data_dir", paths.data_dir.clone()),
                ("paths.spill_dir", paths.spill_dir()),
                ("paths.cache_dir", paths.cache_dir()),
                ("paths.fallback_dir", paths.fallback_dir()),
            ],
        };
        for (key, path) in directories {
            check_writable_dir(key, &path)?;
        }
        self.tls.check_server(self.net.bind_host)?;
        crate::wire::TlsContext::load(self.tls.role()?)?;
        let ports = match service {
            Service::Scheduler => vec![
                ("scheduler.rpc_port", self.scheduler.rpc_port),
                ("scheduler.http_port", self.scheduler.http_port),
            ],
            Service::Node => vec![("node.rpc_port", self.node.rpc_port)],
        };
        for (key, port) in ports {
            let host = match key {
                "scheduler.http_port" => self.scheduler.http_bind,
                _ => self.net.bind_host,
            };
            let addr = SocketAddr::new(host, port);
            TcpListener::bind(addr).map_err(|source| ConfigError::PortUnavailable {
                key,
                addr,
                source,
            })?;
        }
        Ok(())
    }
}

fn check_fraction(key: &'static str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            key,
            reason: format!("{value} is not a fraction in [0, 1)"),
        })
    }
}

fn check_writable_dir(key: &'static str, path: &Path) -> Result<(), ConfigError> {
    let problem = |action: &str, error: std::io::Error| ConfigError::Directory {
        key,
        path: path.to_owned(),
        problem: format!("{action}: {error}"),
    };
    std::fs::create_dir_all(path).map_err(|error| problem("cannot create the directory", error))?;
    let probe = path.join(format!(".floe-write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"probe")
        .map_err(|error| problem("the directory is not writable", error))?;
    std::fs::remove_file(&probe).map_err(|error| problem("cannot remove a probe file", error))
}

#[cfg(test)]
mod tests;
