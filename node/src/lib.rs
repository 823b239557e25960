//! floe-node: the node agent behind `floe node`.
//!
//! It owns the node's shared-memory [`ObjectStore`], registers the node with the scheduler
//! (with the cluster secret; every connection then presents the node's ticket), through a
//! [`SchedulerClient`] that follows the leader across failovers, sends heartbeats with its resource use, serves the node RPC service
//! ([`NodeProtocol`]: tasks, object transfer, actor calls, status), supervises its
//! `floe worker` processes ([`pool`]), hosts actors ([`actors`]) and runs the memory monitor. On SIGTERM it tells the scheduler it is
//! leaving, kills its workers and unlinks its shared memory. It holds a lock on its data
//! directory for its whole life, and at start removes what a killed predecessor on that
//! directory left behind (`data_dir`).

mod actors;
mod data_dir;
pub mod logs;
mod monitor;
mod outputs;
mod pool;
#[cfg(feature = "test-tasks")]
mod test_tasks;
mod transfer;
pub mod udf_pools;
pub mod worker;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use floe_api::authz;
use floe_api::client::{HeartbeatReply, SchedulerClient};
use floe_api::scheduler_protocol::ResourceUsage;
use floe_api::state::{CachedShard, Command, NodeAddresses, NodeMemory, Outcome, Resources};
use floe_core::auth::{ClusterSecret, Credential, Identity};
use floe_core::wire::{
    AttachedReply, Handler, Peer, RemoteError, RemoteErrorKind, RpcServer, WireConfig,
};
use floe_core::{ActorId, Config, Fingerprint, JobId, NodeId, ObjectId, WireError};
use floe_driver::stream::ResultStreams;
use floe_driver::tasks::TaskBoard;
use floe_objectstore::block;
use floe_objectstore::cache::{
    Cache, CacheConfig, CachePolicy, Removed, ShardFile, ShardIndex, ShardName,
};
use floe_objectstore::{MemoryPools, ObjectStore, StoreConfig};
use tokio::task::JoinHandle;
use tracing::Instrument as _;

use self::actors::ActorHost;
use self::data_dir::DataDirLock;
pub use self::data_dir::{Holder, live_holder};
use self::outputs::TaskOutputs;
use self::pool::{PoolOptions, WorkerPool};
use crate::udf_pools::{Lease, PoolsConfig, ProcessPools};
use floe_api::node_protocol::{
    InputRef, LARGEST_OBJECTS, NodeProtocol, NodeRequest, NodeResponse, NodeStatus,
    ObjectResidence, ObjectSummary, OutputRef, Part, ShardLoad, ShardWrite, TaskDone, TaskFailure,
    TaskKind, TaskSpec, WorkerRef,
};
use floe_core::config::AllowedPaths;
use floe_core::plan::physical::StageKind;
use floe_core::plan::task::StageTask;
use floe_core::plan::{Operator, ProcessUdf, UdfCodePolicy};
use floe_driver::DriverConfig;
use floe_engine::udf::process::process_udfs;
use floe_objectstore::Residence;

/// Idle process-UDF children beyond their pool's minimum are stopped after this long.
const UDF_SHRINK_AFTER: Duration = Duration::from_secs(10);
/// A process-UDF pool nobody leased from for this long is stopped entirely.
const UDF_RETIRE_AFTER: Duration = Duration::from_secs(120);
/// How often hosted actors are checked against the scheduler's records.
const ACTOR_SWEEP_INTERVAL: Duration = Duration::from_secs(10);
/// The longest a `NextOutputs` long-poll is held: well under the 30 s read timeout a client
/// waits for an answer with.
const MAX_OUTPUTS_WAIT: Duration = Duration::from_secs(10);
/// Times a cache load checks a shard again after a writer replaced it between the check and the
/// store's link to it: a replacement is a concurrent recompute of the same output, rare, and
/// each leaves a complete shard, so a second look normally finds the file settled.
const SERVE_ATTEMPTS: u32 = 2;

use self::transfer::{PulledParts, Transfers};
use self::worker::{InputPlace, WorkerTask};

/// Everything the agent can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op} failed: {source}")]
    Io {
        op: &'static str,
        source: std::io::Error,
    },
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error(transparent)]
    Store(#[from] floe_objectstore::Error),
    #[error(transparent)]
    Cache(#[from] floe_objectstore::cache::CacheError),
    #[error("scheduler: {0}")]
    Scheduler(#[from] floe_api::Error),
    #[error(
        "data directory {} is in use by another floe node ({}); each node needs its own \
         paths.data_dir",
        dir.display(),
        pid.map_or_else(|| "it has not recorded its pid yet".to_owned(), |pid| format!("pid {pid}"))
    )]
    DataDirInUse { dir: PathBuf, pid: Option<u32> },
    #[error("cannot {action} {}: {source}", path.display())]
    DataDirIo {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{} does not hold a node's record ({problem}); remove it if no node uses this directory",
        path.display()
    )]
    BadLockRecord { path: PathBuf, problem: String },
    #[error("worker: {0}")]
    Worker(String),
    #[error("local node: {0}")]
    LocalNode(String),
    #[error("transferring object {object}: {reason}")]
    Transfer { object: ObjectId, reason: String },
    #[error(
        "object {object} arrived corrupt: its checksum is {actual:016x}, the holder's is \
         {expected:016x}"
    )]
    ChecksumMismatch {
        object: ObjectId,
        expected: u64,
        actual: u64,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What `floe node` is started with besides the configuration.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// Every scheduler replica (`host:port`).
    pub schedulers: Vec<String>,
    /// The `floe` binary, run as `floe worker`.
    pub worker_binary: PathBuf,
}

struct Shared {
    /// The id the scheduler gave this node; 0 until it has registered (ids start at 1).
    node: AtomicU64,
    store: ObjectStore,
    cache: Cache,
    /// The job drivers this node was assigned: job → (attempt, its actor).
    drivers: Mutex<BTreeMap<JobId, (u32, ActorId)>>,
    /// Set once the node has registered (drivers need its id).
    driver_config: OnceLock<Arc<DriverConfig>>,
    pool: Arc<WorkerPool>,
    processes: Arc<ProcessPools>,
    /// `data.allowed_paths`: what a task may read and write.
    allowed: AllowedPaths,
    transfers: Transfers,
    actors: ActorHost,
    /// The job each task output and loaded cache shard here was made for, until it is freed,
    /// so a job's leftovers can be freed without knowing their ids (`FreeJob`).
    made_for: Mutex<BTreeMap<ObjectId, JobId>>,
    tasks_finished: AtomicU64,
    tasks_failed: AtomicU64,
    /// Rows the tasks run here produced, since the node started.
    rows_produced: AtomicU64,
    /// The process tree's CPU use (thousandths of the node's CPUs) and private memory, as the
    /// last heartbeat measured them.
    cpu_used_permille: AtomicU32,
    heap_used_bytes: AtomicU64,
    /// The data directory, whose log files `ReadLogs` reads.
    data_dir: PathBuf,
    /// The task tables of the drivers run here, which `JobTasks` answers from.
    task_board: TaskBoard,
    /// The streamed results of the drivers run here, which `NextOutputs` answers from.
    result_streams: ResultStreams,
    /// Records and forgets this node's cache shards in the index; held for the whole of an
    /// indexing or a clean, so the two never interleave.
    cache_index: tokio::sync::Mutex<SchedulerClient>,
}

impl Shared {
    fn node(&self) -> Option<NodeId> {
        Some(self.node.load(Ordering::Relaxed))
            .filter(|id| *id != 0)
            .map(NodeId::new)
    }

    /// Runs a task; its outcome, and the worker that ran it if it reached one.
    async fn run_task(&self, spec: TaskSpec) -> (Result<TaskDone, TaskFailure>, Option<WorkerRef>) {
        // Its lines carry `job=ID` for `/api/jobs/ID/logs`.
        let span = tracing::info_span!("task", job = %spec.job, task = %spec.task);
        let mut worker = None;
        let result = self
            .run_task_inner(spec, &mut worker)
            .instrument(span)
            .await;
        match &result {
            Ok(done) => {
                self.tasks_finished.fetch_add(1, Ordering::Relaxed);
                self.rows_produced.fetch_add(done.rows(), Ordering::Relaxed);
            }
            Err(_) => {
                self.tasks_failed.fetch_add(1, Ordering::Relaxed);
            }
        }
        (result, worker)
    }

    async fn run_task_inner(
        &self,
        spec: TaskSpec,
        worker: &mut Option<WorkerRef>,
    ) -> Result<TaskDone, TaskFailure> {
        let mut pulled = Vec::new();
        let result = self.run_with_inputs(spec, &mut pulled, worker).await;
        // This task's uses of copies pulled from other nodes (their owners free the
        // originals).
        self.transfers.release(&pulled);
        result
    }

    /// Deletes objects from this node's store: outputs nobody will learn of. One a running
    /// task still reads goes when that task lets go of it.
    fn delete_local(&self, objects: &[ObjectId]) {
        let mut made_for = self.made_for.lock().unwrap_or_else(PoisonError::into_inner);
        for object in objects {
            made_for.remove(object);
            match self.store.delete(*object) {
                Ok(()) | Err(floe_objectstore::Error::NotFound { .. }) => {}
                Err(error) => tracing::warn!(%object, %error, "cannot delete an object"),
            }
        }
    }

    async fn run_with_inputs(
        &self,
        spec: TaskSpec,
        pulled: &mut Vec<ObjectId>,
        worker: &mut Option<WorkerRef>,
    ) -> Result<TaskDone, TaskFailure> {
        // The objects this task pulls parts into are its own: deleted when it returns.
        let (copied, _part_copies) = self.pull_parts(&spec.inputs).await?;
        let mut pins = Vec::with_capacity(spec.inputs.len());
        let mut parts = Vec::with_capacity(spec.inputs.len());
        for (index, input) in spec.inputs.iter().enumerate() {
            let unavailable = |error: Error| TaskFailure::InputUnavailable {
                object: input.object,
                reason: error.to_string(),
            };
            if let Some(&(copy, part)) = copied.get(&index) {
                let view = self
                    .store
                    .get(copy)
                    .map_err(|error| unavailable(error.into()))?;
                pins.push(view);
                parts.push(Some(part));
                continue;
            }
            if let Some(holder) = &input.holder {
                let copy = self
                    .transfers
                    .pull(input.object, holder)
                    .await
                    .map_err(unavailable)?;
                if copy.copy_in_use {
                    pulled.push(input.object);
                }
            }
            pins.push(
                self.store
                    .get(input.object)
                    .map_err(|error| unavailable(error.into()))?,
            );
            parts.push(input.part);
        }
        let job = spec.job;
        let mut leases = match &spec.kind {
            TaskKind::Stage(stage) => {
                check_paths(&self.allowed, stage)?;
                self.lease_processes(stage).await?
            }
            #[cfg(feature = "test-tasks")]
            TaskKind::Test(_) => Vec::new(),
        };
        let task = WorkerTask {
            task: spec.task,
            kind: spec.kind,
            inputs: pins
                .iter()
                .zip(parts)
                .map(|(view, part)| InputPlace {
                    location: view.location().clone(),
                    part,
                })
                .collect(),
            processes: leases
                .iter()
                .map(|lease| lease.endpoint().clone())
                .collect(),
        };
        let outputs = TaskOutputs::new(self.store.clone(), spec.task);
        let ran = self.pool.run(task, pins, outputs).await;
        *worker = ran.worker;
        let outputs = ran.result;
        if outputs.is_err() {
            // No child of a failed task is leased again: a killed worker's children may still
            // be busy with the batch (or be what used the memory), and a child that crashed
            // may not be reaped yet when a retry, placed at once in the job's lease, asks for
            // one. Each attempt gets a new process.
            leases.iter_mut().for_each(Lease::discard);
        }
        if !leases.is_empty() {
            // Giving a child back may reap it; keep that off the async threads.
            tokio::task::spawn_blocking(move || drop(leases));
        }
        let done = outputs?;
        self.made(job, done.outputs.iter().map(|output| output.object));
        Ok(done)
    }

    /// Pulls the inputs that are parts of objects on other nodes, those of one holder together
    /// into one object here. Returns where each of those inputs (by index) now lies, and the
    /// objects pulled into (each goes when its `PulledParts` is dropped).
    async fn pull_parts(
        &self,
        inputs: &[InputRef],
    ) -> Result<(BTreeMap<usize, (ObjectId, Part)>, Vec<PulledParts>), TaskFailure> {
        let mut by_holder: BTreeMap<&str, Vec<(usize, ObjectId, Part)>> = BTreeMap::new();
        for (index, input) in inputs.iter().enumerate() {
            if let (Some(holder), Some(part)) = (&input.holder, input.part) {
                by_holder
                    .entry(holder.as_str())
                    .or_default()
                    .push((index, input.object, part));
            }
        }
        let mut copied = BTreeMap::new();
        let mut part_copies = Vec::new();
        for (holder, wanted) in by_holder {
            let parts: Vec<(ObjectId, Part)> = wanted
                .iter()
                .map(|&(_, object, part)| (object, part))
                .collect();
            match self.transfers.pull_parts(holder, &parts).await {
                Ok(pulled) => {
                    for ((index, _, _), part) in wanted.iter().zip(pulled.parts()) {
                        copied.insert(*index, (pulled.object(), *part));
                    }
                    part_copies.push(pulled);
                }
                Err(error) => return Err(self.part_pull_failure(holder, &parts, error).await),
            }
        }
        Ok((copied, part_copies))
    }

    /// What a failed pull of `parts` from `holder` makes of the task: the object that arrived
    /// corrupt, or the first the holder no longer has, is lost (the driver rebuilds it); when
    /// every object is still there the failure was here or on the way (this store full, a
    /// connection cut), and the task is retried as it is.
    async fn part_pull_failure(
        &self,
        holder: &str,
        parts: &[(ObjectId, Part)],
        error: Error,
    ) -> TaskFailure {
        let reason = error.to_string();
        let lost = match error {
            Error::ChecksumMismatch { object, .. } => Some(object),
            _ => {
                let objects: Vec<ObjectId> = parts.iter().map(|(object, _)| *object).collect();
                self.transfers.first_missing(holder, &objects).await
            }
        };
        match lost {
            Some(object) => TaskFailure::InputUnavailable { object, reason },
            None => TaskFailure::Transient { message: reason },
        }
    }

    /// Records that `objects` were made for `job`.
    fn made(&self, job: JobId, objects: impl IntoIterator<Item = ObjectId>) {
        let mut made_for = self.made_for.lock().unwrap_or_else(PoisonError::into_inner);
        for object in objects {
            made_for.insert(object, job);
        }
    }

    /// Deletes every object made for `job` except `keep`.
    fn free_job(&self, job: JobId, keep: &[ObjectId]) {
        let leftovers: Vec<ObjectId> = self
            .made_for
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(object, owner)| **owner == job && !keep.contains(object))
            .map(|(object, _)| *object)
            .collect();
        if !leftovers.is_empty() {
            tracing::info!(%job, objects = leftovers.len(), "freeing what earlier attempts of the job left");
        }
        self.delete_local(&leftovers);
    }

    /// One child per process UDF the task calls, leased in pool-key order (so two tasks never
    /// wait on each other) on a blocking thread: a lease waits while its pool is busy, and
    /// leases already taken when a later one fails are given back there too.
    async fn lease_processes(&self, stage: &StageTask) -> Result<Vec<Lease>, TaskFailure> {
        let udfs: Vec<ProcessUdf> = process_udfs(&stage.stage.row_ops)
            .map_err(|error| TaskFailure::Error {
                message: error.to_string(),
            })?
            .into_iter()
            .cloned()
            .collect();
        if udfs.is_empty() {
            return Ok(Vec::new());
        }
        let pools = Arc::clone(&self.processes);
        let leased = tokio::task::spawn_blocking(move || {
            udfs.iter()
                .map(|udf| pools.lease(udf))
                .collect::<floe_engine::Result<Vec<Lease>>>()
        })
        .await
        .map_err(|error| TaskFailure::Transient {
            message: format!("leasing a process UDF child failed: {error}"),
        })?;
        leased.map_err(|error| {
            let message = error.to_string();
            if error.is_transient() {
                TaskFailure::Transient { message }
            } else {
                TaskFailure::Error { message }
            }
        })
    }

    /// Writes one cache shard from local blocks.
    fn write_cache_shard(&self, write: &ShardWrite) -> Result<(u64, u64)> {
        let mut batches = Vec::new();
        for object in &write.blocks {
            let view = self.store.get(*object)?;
            batches.extend(block::read_block(&view)?.batches);
        }
        let rows = batches.iter().map(|batch| batch.num_rows() as u64).sum();
        let shard = ShardIndex::new(write.rank, write.count)?;
        let policy = if write.overwrite {
            CachePolicy::Recompute
        } else {
            CachePolicy::Reuse
        };
        let schema = Arc::new(write.schema.clone());
        // Evicted by the caller, which tells the index first.
        self.cache
            .write_shard(policy, &write.lineage, shard, &schema, &batches)?;
        let name = ShardName {
            fingerprint: write.lineage.fingerprint(),
            shard,
        };
        let path = self.cache.config().dir.join(name.file_name());
        let bytes = std::fs::metadata(&path)
            .map_err(|source| Error::Io {
                op: "reading a cache shard's size",
                source,
            })?
            .len();
        Ok((rows, bytes))
    }

    /// Serves one cache shard as one block: the store maps the shard file in place, so nothing
    /// is copied and the block takes none of the store's memory (`ObjectStore::adopt_shard`).
    /// `None` when the shard is gone or failed verification.
    fn load_cache_shard(&self, load: &ShardLoad) -> Result<Option<OutputRef>> {
        let shard = ShardIndex::new(load.rank, load.count)?;
        let name = ShardName {
            fingerprint: load.fingerprint,
            shard,
        };
        let mut attempts = 0;
        let served = loop {
            let Some(served) = self.cache.serve_shard(name)? else {
                return Ok(None);
            };
            // Loaded again under the same id (a rebuild): a copy still here is the same shard.
            if self.store.contains(load.object) || self.store.revive(load.object) {
                let (size, checksum) = self.store.size_and_checksum(load.object)?;
                self.made(load.job, [load.object]);
                return Ok(Some(OutputRef {
                    object: load.object,
                    size,
                    checksum: Some(checksum),
                    rows: Some(served.rows),
                    parts: Vec::new(),
                }));
            }
            match self.store.adopt_shard(load.object, &served) {
                Ok(_) => break served,
                // A writer renamed a new file over the shard between the check and the link:
                // check the new one.
                Err(floe_objectstore::Error::ShardChanged { .. }) if attempts < SERVE_ATTEMPTS => {
                    attempts += 1;
                }
                Err(error) => return Err(error.into()),
            }
        };
        self.made(load.job, [load.object]);
        Ok(Some(OutputRef {
            object: load.object,
            size: served.len,
            checksum: Some(served.checksum),
            rows: Some(served.rows),
            parts: Vec::new(),
        }))
    }

    /// `floe cache clean`: drops the shards to remove from the index first (so no job is
    /// planned against them), then removes their files, and stale temporary files with them.
    async fn clean_cache(
        self: &Arc<Self>,
        keep_bytes: Option<u64>,
    ) -> Result<Removed, RemoteError> {
        let mut client = self.cache_index.lock().await;
        let shared = Arc::clone(self);
        let doomed = blocking(move || {
            Ok(match keep_bytes {
                Some(keep) => shared.cache.least_recently_used_beyond(keep)?,
                None => shared.cache.shards()?,
            })
        })
        .await?;
        self.forget_shards(&mut client, &doomed).await?;
        let shared = Arc::clone(self);
        blocking(move || {
            let removed = shared.cache.remove_files(&doomed)?;
            shared.cache.remove_stale_temps()?;
            Ok(removed)
        })
        .await
    }

    /// Evicts least recently used shards down to `cache.max_bytes` after `writing` stored a
    /// shard, sparing `writing`'s: drops them from the index first, then removes their files,
    /// so no job is planned against an evicted shard.
    async fn evict_over_cap(self: &Arc<Self>, writing: Fingerprint) -> Result<(), RemoteError> {
        let mut client = self.cache_index.lock().await;
        let shared = Arc::clone(self);
        let doomed = blocking(move || Ok(shared.cache.over_cap(Some(writing))?)).await?;
        if doomed.is_empty() {
            return Ok(());
        }
        self.forget_shards(&mut client, &doomed).await?;
        let shared = Arc::clone(self);
        blocking(move || Ok(shared.cache.remove_evicted(&doomed)?))
            .await
            .map(drop)
    }

    /// Drops `shards` of this node from the cache index (before their files go).
    async fn forget_shards(
        &self,
        client: &mut SchedulerClient,
        shards: &[ShardFile],
    ) -> Result<(), RemoteError> {
        let Some(node) = self.node() else {
            return Ok(());
        };
        for shard in shards {
            let command = Command::ForgetCacheShard {
                fingerprint: shard.name.fingerprint.to_string(),
                shard_count: shard.name.shard.count,
                rank: shard.name.shard.rank,
                node,
            };
            // Rejected: not indexed (never recorded, or forgotten already).
            client
                .propose(command)
                .await
                .map_err(|error| remote(error.into()))?;
        }
        Ok(())
    }

    /// Runs the drivers the scheduler assigned to this node and stops the others.
    fn sync_drivers(self: &Arc<Self>, assigned: &[(JobId, u32)]) {
        let (Some(config), Some(node)) = (self.driver_config.get(), self.node()) else {
            return;
        };
        // The node id changes when the node registers again; drivers use the current one.
        let config = Arc::new(DriverConfig {
            node,
            ..(**config).clone()
        });
        let mut drivers = self.drivers.lock().unwrap_or_else(PoisonError::into_inner);
        drivers.retain(|job, (attempt, actor)| {
            let keep = assigned.contains(&(*job, *attempt));
            if !keep {
                self.actors.stop(*actor);
            }
            keep
        });
        for &(job, attempt) in assigned {
            // A driver that ended while its job is still assigned here (it could not commit
            // the outcome) runs again.
            let running = drivers.get(&job).is_some_and(|(running, actor)| {
                *running == attempt && self.actors.is_running(*actor)
            });
            if running {
                continue;
            }
            let actor = self.actors.start_driver(job, attempt, Arc::clone(&config));
            drivers.insert(job, (attempt, actor));
        }
    }

    fn status(&self) -> NodeStatus {
        NodeStatus {
            node: self.node(),
            workers: self.pool.ready(),
            running: self.pool.running(),
            tasks_finished: self.tasks_finished.load(Ordering::Relaxed),
            tasks_failed: self.tasks_failed.load(Ordering::Relaxed),
            workers_respawned: self.pool.respawned(),
            pulls_started: self.transfers.pulls_started(),
            borrowed_bytes: self.transfers.borrowed_bytes(),
            store: store_usage(self.store.stats()),
            actors: self.actors.hosted(),
            worker_slots: self.pool.slots(),
            largest_objects: self.largest_objects(),
            cpu_used_permille: self.cpu_used_permille.load(Ordering::Relaxed),
            heap_used_bytes: self.heap_used_bytes.load(Ordering::Relaxed),
            udf_pools: self.processes.status(),
        }
    }

    /// The store's largest objects, with the job each was made for.
    fn largest_objects(&self) -> Vec<ObjectSummary> {
        let largest = self.store.largest(LARGEST_OBJECTS);
        let made_for = self.made_for.lock().unwrap_or_else(PoisonError::into_inner);
        largest
            .into_iter()
            .map(|info| ObjectSummary {
                object: info.object,
                size: info.size,
                residence: match info.residence {
                    Residence::Memory => ObjectResidence::Memory,
                    Residence::Spilled => ObjectResidence::Spilled,
                    Residence::Fallback => ObjectResidence::Fallback,
                    Residence::CacheShard => ObjectResidence::CacheShard,
                },
                pins: info.pins,
                job: made_for.get(&info.object).copied(),
            })
            .collect()
    }
}

struct Service(Arc<Shared>);

/// Runs file work (cache shards: reads, writes, fsyncs) off the async threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T, RemoteError> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result.map_err(remote),
        Err(error) => Err(RemoteError::new(
            RemoteErrorKind::Internal,
            format!("the work panicked or was cancelled: {error}"),
        )),
    }
}

fn remote(error: Error) -> RemoteError {
    let kind = match &error {
        Error::Store(floe_objectstore::Error::NotFound { .. }) => RemoteErrorKind::NotFound,
        _ => RemoteErrorKind::Internal,
    };
    RemoteError::new(kind, error.to_string())
}

impl Handler<NodeProtocol> for Service {
    async fn handle_attached(
        &self,
        peer: Peer,
        request: NodeRequest,
    ) -> AttachedReply<NodeResponse> {
        if let Err(refusal) = authz::authorize_node(&peer.principal, &request) {
            tracing::warn!(principal = %peer.principal, %refusal, "refused a request");
            let refused = RemoteError::new(RemoteErrorKind::Forbidden, refusal.0);
            return (Err(refused), None);
        }
        match request {
            NodeRequest::ReadChunk {
                object,
                offset,
                len,
            } => match self.0.transfers.read_chunk(object, offset, len) {
                Ok(chunk) => (Ok(NodeResponse::Chunk), Some(chunk)),
                Err(error) => (Err(remote(error)), None),
            },
            NodeRequest::ReadRanges { ranges } => match self.0.transfers.read_ranges(&ranges) {
                Ok(bytes) => (Ok(NodeResponse::Chunk), Some(bytes)),
                Err(error) => (Err(remote(error)), None),
            },
            NodeRequest::LendRanges { ranges } => match self.0.transfers.lend_ranges(&ranges) {
                Ok((loan, pins)) => (Ok(NodeResponse::Lent(loan)), Some(pins)),
                Err(error) => (Err(remote(error)), None),
            },
            other => (self.handle(peer, other).await, None),
        }
    }

    async fn handle(&self, _peer: Peer, request: NodeRequest) -> Result<NodeResponse, RemoteError> {
        let shared = &self.0;
        match request {
            NodeRequest::RunTask(spec) => {
                let (result, worker) = shared.run_task(spec).await;
                Ok(NodeResponse::Task { result, worker })
            }
            NodeRequest::ObjectMeta { object } => Ok(NodeResponse::ObjectMeta(
                shared.transfers.meta(object).map_err(remote)?,
            )),
            NodeRequest::ReadChunk { object, .. } => Err(RemoteError::new(
                RemoteErrorKind::Internal,
                format!("chunks of {object} are answered with an attachment"),
            )),
            NodeRequest::ReadRanges { .. } | NodeRequest::LendRanges { .. } => {
                Err(RemoteError::new(
                    RemoteErrorKind::Internal,
                    "ranges are answered with an attachment",
                ))
            }
            NodeRequest::Pull { object, holder } => {
                let pulled = shared
                    .transfers
                    .pull(object, &holder)
                    .await
                    .map_err(remote)?;
                // Asked for by name: it stays until a `Free`.
                shared.transfers.keep(object);
                Ok(NodeResponse::Pulled(pulled.output))
            }
            NodeRequest::FreeJob { job, keep } => {
                shared.free_job(job, &keep);
                Ok(NodeResponse::Freed)
            }
            NodeRequest::Free { objects } => {
                let mut made_for = shared
                    .made_for
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                for object in &objects {
                    made_for.remove(object);
                }
                drop(made_for);
                for object in objects {
                    match shared.store.delete(object) {
                        Ok(()) | Err(floe_objectstore::Error::NotFound { .. }) => {}
                        Err(error) => return Err(remote(error.into())),
                    }
                }
                Ok(NodeResponse::Freed)
            }
            NodeRequest::Status => Ok(NodeResponse::Status(Box::new(shared.status()))),
            NodeRequest::CancelTask { task } => {
                shared.pool.cancel(task);
                Ok(NodeResponse::Cancelled)
            }
            NodeRequest::WriteCacheShard(write) => {
                let writer = Arc::clone(shared);
                let writing = write.lineage.fingerprint();
                let (rows, bytes) = blocking(move || writer.write_cache_shard(&write)).await?;
                // The shard is written whether or not eviction works out.
                if let Err(error) = shared.evict_over_cap(writing).await {
                    tracing::warn!(%error, "cannot evict cache shards over the cap");
                }
                Ok(NodeResponse::CacheWritten { rows, bytes })
            }
            NodeRequest::LoadCacheShard(load) => {
                let shared = Arc::clone(shared);
                let loaded = blocking(move || shared.load_cache_shard(&load)).await?;
                Ok(NodeResponse::CacheLoaded(loaded))
            }
            NodeRequest::CreateActor(spec) => {
                shared.actors.create(spec, shared);
                Ok(NodeResponse::ActorCreated)
            }
            NodeRequest::CallActor {
                actor,
                message,
                forwarded,
            } => Ok(NodeResponse::Actor(
                shared.actors.call(actor, message, forwarded).await,
            )),
            NodeRequest::StopActor { actor } => {
                shared.actors.stop(actor);
                Ok(NodeResponse::ActorStopped)
            }
            NodeRequest::RemoveCacheShards { fingerprints } => {
                let shared = Arc::clone(shared);
                let removed = blocking(move || {
                    let shards = shared
                        .cache
                        .shards_of(&fingerprints.into_iter().collect())?;
                    Ok(shared.cache.remove_files(&shards)?)
                })
                .await?;
                Ok(cache_removed(removed))
            }
            NodeRequest::CleanCache { keep_bytes } => {
                shared.clean_cache(keep_bytes).await.map(cache_removed)
            }
            NodeRequest::JobTasks { job } => Ok(NodeResponse::Tasks(shared.task_board.table(job))),
            NodeRequest::NextOutputs {
                job,
                attempt,
                from,
                wait_ms,
            } => {
                // Bounded below the client's read timeout, so a poll never times out there.
                let wait = Duration::from_millis(wait_ms).min(MAX_OUTPUTS_WAIT);
                let next = shared.result_streams.next(job, attempt, from, wait).await;
                next.map(NodeResponse::Outputs)
                    .map_err(|message| RemoteError::new(RemoteErrorKind::BadRequest, message))
            }
            NodeRequest::ReadLogs(query) => {
                let data_dir = shared.data_dir.clone();
                let lines = blocking(move || logs::read_logs(&data_dir, &query)).await?;
                Ok(NodeResponse::Logs(lines))
            }
        }
    }
}

/// A running node agent.
pub struct NodeAgent {
    shared: Arc<Shared>,
    server: RpcServer,
    background: Vec<JoinHandle<()>>,
    schedulers: Vec<String>,
    wire: WireConfig,
    /// Held for the agent's life: no other node may use its data directory meanwhile.
    data_dir_lock: DataDirLock,
}

impl NodeAgent {
    /// Opens the store, starts the workers and the RPC service, and registers with the
    /// scheduler.
    pub async fn start(config: &Config, options: AgentOptions) -> Result<Self> {
        let wire = WireConfig::member(config);
        let pools = MemoryPools::detect(&config.memory)?;
        let pid = std::process::id();
        let data_dir = &config.paths.data_dir;
        std::fs::create_dir_all(data_dir).map_err(|source| Error::Io {
            op: "creating the data directory",
            source,
        })?;
        // Store names must be unique among live stores on the host; pids are.
        let store_config = StoreConfig::for_node(config, &pools, format!("node-{pid}"));
        let holder = Holder {
            pid,
            store: store_config.name.clone(),
            socket: format!("node-{pid}.sock"),
            rpc: None,
            node: None,
        };
        // Before anything of this node exists: a second node on the directory stops here.
        let data_dir_lock = DataDirLock::claim(data_dir, &holder, &store_config)?;
        let store = ObjectStore::open(store_config)?;
        let cpus = std::thread::available_parallelism().map_or(1, |cpus| cpus.get());
        let cpus = u32::try_from(cpus).unwrap_or(u32::MAX);
        let workers = match config.node.workers {
            0 => cpus,
            workers => workers,
        };
        let pool = Arc::new(WorkerPool::start(PoolOptions {
            binary: options.worker_binary.clone(),
            socket: data_dir.join(&holder.socket),
            workers,
            max_frame: wire.max_frame,
            log_dir: data_dir.join(logs::LOG_DIR),
            storage: config.storage.clone(),
        })?);
        let cache = Cache::open(CacheConfig::for_node(config))?;
        remove_stale_udf_dirs(data_dir);
        let processes = Arc::new(
            ProcessPools::new(PoolsConfig {
                runtime_dir: data_dir.join(format!("udf-{pid}")),
                allowed_commands: config.node.udf_commands.clone(),
                code: UdfCodePolicy::for_node(&config.node),
                default_max: cpus,
                shrink_after: UDF_SHRINK_AFTER,
                retire_after: UDF_RETIRE_AFTER,
            })
            .map_err(|error| Error::Worker(format!("preparing process UDFs: {error}")))?,
        );
        let attempt_timeout = config.scheduler.node_timeout() / 4;
        let scheduler_client = || {
            SchedulerClient::new(options.schedulers.clone(), wire.clone())
                .map(|client| client.with_attempt_timeout(attempt_timeout))
        };
        let shared = Arc::new(Shared {
            cache_index: tokio::sync::Mutex::new(scheduler_client()?),
            node: AtomicU64::new(0),
            transfers: Transfers::new(store.clone(), wire.clone(), &config.node),
            actors: ActorHost::start(options.schedulers.clone(), &wire)?,
            store,
            cache,
            drivers: Mutex::new(BTreeMap::new()),
            driver_config: OnceLock::new(),
            pool: Arc::clone(&pool),
            processes: Arc::clone(&processes),
            allowed: config.data.allowed(),
            made_for: Mutex::new(BTreeMap::new()),
            tasks_finished: AtomicU64::new(0),
            tasks_failed: AtomicU64::new(0),
            rows_produced: AtomicU64::new(0),
            cpu_used_permille: AtomicU32::new(0),
            heap_used_bytes: AtomicU64::new(0),
            data_dir: data_dir.clone(),
            task_board: TaskBoard::default(),
            result_streams: ResultStreams::default(),
        });
        let bind = SocketAddr::new(config.net.bind_host, config.node.rpc_port);
        let server = RpcServer::bind::<NodeProtocol, _>(
            bind,
            Arc::new(Service(Arc::clone(&shared))),
            wire.clone(),
        )
        .await?;
        let holder = Holder {
            rpc: Some(server.local_addr().to_string()),
            ..holder
        };
        data_dir_lock.record(&holder)?;
        // A killed predecessor at this very address may still count as alive: this node
        // registers as its replacement. At another address it is left to its heartbeat
        // timeout (nothing answers there).
        let replaces = data_dir_lock
            .predecessor()
            .filter(|predecessor| predecessor.rpc == holder.rpc)
            .and_then(|predecessor| predecessor.node);
        let registration = Registration {
            identity: wire.identity.clone(),
            secret: config.cluster.secret.clone(),
            addresses: NodeAddresses {
                rpc: server.local_addr().to_string(),
            },
            resources: Resources {
                cpu_millis: u64::from(cpus) * 1000,
                heap_bytes: pools.heap,
            },
            memory: NodeMemory {
                total_bytes: pools.total,
                object_store_bytes: pools.object_store,
                system_reserve_bytes: pools.system_reserve,
            },
            data_dir: data_dir.clone(),
            holder,
        };
        let mut client = scheduler_client()?;
        let node = registration.register(&mut client, replaces).await?;
        shared.node.store(node.get(), Ordering::Relaxed);
        let batch_rows = u32::try_from(floe_engine::read::DEFAULT_BATCH_ROWS).unwrap_or(u32::MAX);
        let _ = shared.driver_config.set(Arc::new(DriverConfig {
            schedulers: options.schedulers.clone(),
            wire: wire.clone(),
            node,
            min_block_bytes: config.data.min_block_size.bytes(),
            max_block_bytes: config.data.max_block_size.bytes(),
            batch_rows,
            progress_interval: config.node.progress_interval(),
            allowed_paths: config.data.allowed(),
            tasks: shared.task_board.clone(),
            streams: shared.result_streams.clone(),
        }));
        tracing::info!(%node, addr = %server.local_addr(), workers, "node registered");
        // Said at start-up, so a roots list emptied by mistake (an unset variable in a unit
        // file) is visible in the log.
        match config.data.allowed_paths.as_slice() {
            [] => tracing::info!("data.allowed_paths is empty: tasks may use any path"),
            roots => tracing::info!(?roots, "tasks may only use paths under data.allowed_paths"),
        }
        let background = vec![
            tokio::spawn(watch_drivers(Arc::clone(&shared), scheduler_client()?)),
            tokio::spawn(heartbeats(
                Arc::clone(&shared),
                client,
                registration,
                config.scheduler.heartbeat_interval(),
            )),
            tokio::spawn(reap_processes(processes)),
            tokio::spawn(sweep_actors(Arc::clone(&shared), scheduler_client()?)),
            tokio::spawn(monitor::run_monitor(
                pool,
                shared.store.clone(),
                pools,
                config.node.memory_monitor_threshold,
                config.node.memory_monitor_interval(),
            )),
        ];
        Ok(Self {
            shared,
            server,
            background,
            schedulers: options.schedulers,
            wire,
            data_dir_lock,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The id the scheduler gave this node (it changes if the node had to register again).
    pub fn node(&self) -> Option<NodeId> {
        self.shared.node()
    }

    /// Leaves the cluster: stops serving, tells the scheduler this node is gone (so its death
    /// is committed now rather than after missed heartbeats), kills the workers and unlinks the
    /// store's shared memory when the last handle drops.
    pub async fn shutdown(self, reason: &str) -> Result<()> {
        let Self {
            shared,
            server,
            background,
            schedulers,
            wire,
            data_dir_lock,
        } = self;
        server.shutdown();
        for task in background {
            task.abort();
        }
        // Stops the drivers too. Actors hold the shared state: stopping them lets the store's
        // last handle go below.
        shared.actors.shutdown();
        shared.pool.shutdown().await;
        let processes = Arc::clone(&shared.processes);
        let _ = tokio::task::spawn_blocking(move || processes.shutdown()).await;
        let told = match shared.node() {
            Some(node) => {
                let mut client =
                    SchedulerClient::new(schedulers, wire)?.with_retry_for(Duration::from_secs(5));
                let command = Command::MarkNodeDead {
                    node,
                    reason: format!("node left: {reason}"),
                };
                client.propose(command).await.map(|_| node)
            }
            None => Err(floe_api::Error::NoReplica(
                "the node had not registered yet".into(),
            )),
        };
        // Dropping the last handle of the store unlinks its segment; the directory is free
        // for another node only after that.
        drop(shared);
        drop(data_dir_lock);
        let node = told?;
        tracing::info!(%node, "node left the cluster");
        Ok(())
    }
}

/// What the node registers with; kept to register again after the scheduler declared the
/// node dead (e.g. after a network partition).
struct Registration {
    /// Shared by every connection of the node (its drivers' included): registering makes it
    /// present the node's ticket from then on.
    identity: Identity,
    secret: ClusterSecret,
    addresses: NodeAddresses,
    resources: Resources,
    memory: NodeMemory,
    data_dir: PathBuf,
    /// The data directory's lock record, to which each registration adds the node's id.
    holder: Holder,
}

impl Registration {
    /// Registers the node; `replaces` is the id this agent had before (see
    /// `Command::RegisterNode`), which the scheduler retires if it is still alive. The new id
    /// goes into the data directory's lock record, for the next node there to replace.
    async fn register(
        &self,
        client: &mut SchedulerClient,
        replaces: Option<NodeId>,
    ) -> Result<NodeId> {
        let (node, ticket) = client
            .register_node(
                self.addresses.clone(),
                self.resources,
                self.memory,
                BTreeMap::new(),
                replaces,
            )
            .await?;
        self.identity.set(Credential::Node {
            secret: self.secret.clone(),
            id: node,
            ticket,
        });
        let holder = Holder {
            node: Some(node),
            ..self.holder.clone()
        };
        if let Err(error) = data_dir::record_in(&self.data_dir, &holder) {
            // Only a restart within the node timeout needs it, to retire this id at once.
            tracing::warn!(%node, %error, "cannot record the node's id in its data directory");
        }
        Ok(node)
    }
}

/// How long one `WatchDrivers` call may wait at the leader: well inside the RPC timeout.
const DRIVER_WATCH_WAIT: Duration = Duration::from_secs(5);

/// Starts the drivers the scheduler assigns to this node as soon as it commits them (the
/// heartbeat carries the same list, later; both go through `sync_drivers`).
async fn watch_drivers(shared: Arc<Shared>, mut client: SchedulerClient) {
    let mut known = Vec::new();
    loop {
        let Some(node) = shared.node() else {
            tokio::time::sleep(DRIVER_WATCH_WAIT).await;
            continue;
        };
        match client
            .watch_drivers(node, known.clone(), DRIVER_WATCH_WAIT)
            .await
        {
            Ok(HeartbeatReply::Accepted { drivers }) => {
                shared.sync_drivers(&drivers);
                known = drivers;
            }
            // The heartbeat loop registers the node again; wait for its new id.
            Ok(HeartbeatReply::Rejoin) => tokio::time::sleep(Duration::from_secs(1)).await,
            Err(error) => {
                tracing::debug!(%error, "watching for drivers failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// Refuses a stage task that would read or write outside `data.allowed_paths`: its input
/// files (a fused source's too), its sink directory, its process UDFs' files. The scheduler checks submitted specs
/// too, but a plan can also come from a client library, so the node checks every task.
fn check_paths(allowed: &AllowedPaths, task: &StageTask) -> Result<(), TaskFailure> {
    if !allowed.is_restricted() {
        return Ok(());
    }
    let mut paths: Vec<&std::path::Path> = Vec::new();
    let fused = task.source.iter().map(|source| &source.stage);
    for stage in std::iter::once(&task.stage).chain(fused) {
        match &stage.kind {
            StageKind::Read(scan) => {
                paths.extend(scan.files.iter().map(|file| file.path.as_path()))
            }
            StageKind::Write(spec) => paths.push(spec.directory.as_path()),
            _ => {}
        }
        for op in &stage.row_ops {
            if let Operator::ProcessUdf(udf) = op {
                paths.extend(udf.files.iter().map(|file| file.path.as_path()));
            }
        }
    }
    paths.extend(task.sink.iter().map(|sink| sink.spec.directory.as_path()));
    for path in paths {
        allowed.check(path).map_err(|error| TaskFailure::Error {
            message: error.to_string(),
        })?;
    }
    Ok(())
}

/// Removes the process-UDF directories (`udf-<pid>`) of agents that died without cleaning up.
fn remove_stale_udf_dirs(data_dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(data_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|name| name.strip_prefix("udf-"))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Stops, now and then, hosted actors whose job ended or whose driver died, and drops the
/// task tables of jobs that left the scheduler's state (pruned or deleted).
async fn sweep_actors(shared: Arc<Shared>, mut client: SchedulerClient) {
    let mut ticks = tokio::time::interval(ACTOR_SWEEP_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        shared.actors.stop_unrecorded().await;
        forget_removed_task_tables(&shared, &mut client).await;
    }
}

/// Drops the task table of every job whose driver no longer runs here and that the
/// scheduler no longer records: one small read per such table (at most `MAX_JOBS`).
async fn forget_removed_task_tables(shared: &Shared, client: &mut SchedulerClient) {
    let driving: BTreeSet<JobId> = shared
        .drivers
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .keys()
        .copied()
        .collect();
    for job in shared.task_board.jobs() {
        if driving.contains(&job) {
            continue;
        }
        match client.watch_job(job, Duration::ZERO).await {
            Ok(None) => {
                tracing::debug!(%job, "the job left the state; its task table goes");
                shared.task_board.forget(job);
            }
            Ok(Some(_)) => {}
            Err(error) => {
                tracing::debug!(%job, %error, "cannot ask whether a job is still recorded");
                return;
            }
        }
    }
}

/// Stops process-UDF children that exited or idled out, once a second.
async fn reap_processes(processes: Arc<ProcessPools>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let processes = Arc::clone(&processes);
        let _ = tokio::task::spawn_blocking(move || processes.reap()).await;
    }
}

/// Sends a heartbeat every `interval`, and registers the node again when the scheduler
/// declared it dead. After each registration (the first included) the node records the cache
/// shards in its directory under its id, so shards written before a restart or a declared
/// death are found again.
async fn heartbeats(
    shared: Arc<Shared>,
    mut client: SchedulerClient,
    registration: Registration,
    interval: Duration,
) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let agent = std::process::id();
    let ticks_per_second = monitor::clock_ticks_per_second();
    // Utilization is of the CPUs the node offers (`node.cpus`, else the host's).
    let cpus = (registration.resources.cpu_millis as f64 / 1000.0).max(1.0);
    let mut last_cpu: Option<(std::time::Instant, u64)> = None;
    // Dropped with this task (on shutdown), which aborts an indexing still running.
    let mut indexing = tokio::task::JoinSet::new();
    if let Some(node) = shared.node() {
        indexing.spawn(index_cache(Arc::clone(&shared), node));
    }
    loop {
        ticks.tick().await;
        let store = shared.store.clone();
        let (tree, cpu_ticks) = tokio::task::spawn_blocking(move || {
            (
                monitor::process_tree_memory(agent, &store),
                monitor::process_tree_cpu_ticks(agent),
            )
        })
        .await
        .unwrap_or_default();
        let now = std::time::Instant::now();
        // Busy CPU time since the last tick over the wall time all the node's CPUs had.
        let cpu_used_permille = match last_cpu {
            Some((then, ticks)) => {
                let busy_s = cpu_ticks.saturating_sub(ticks) as f64 / ticks_per_second as f64;
                let offered_s = now.duration_since(then).as_secs_f64() * cpus;
                if offered_s > 0.0 {
                    ((busy_s / offered_s) * 1000.0).clamp(0.0, 1000.0) as u32
                } else {
                    0
                }
            }
            None => 0,
        };
        last_cpu = Some((now, cpu_ticks));
        shared
            .cpu_used_permille
            .store(cpu_used_permille, Ordering::Relaxed);
        shared
            .heap_used_bytes
            .store(tree.anonymous, Ordering::Relaxed);
        let store = shared.store.stats();
        let running = shared.pool.running().len();
        let (network_received_bytes, network_sent_bytes) = shared.transfers.network_bytes();
        let usage = ResourceUsage {
            cpu_millis: running as u64 * 1000,
            // What tasks use: the private memory of the agent, its workers and UDF children.
            heap_bytes: tree.anonymous,
            object_store_bytes: store.used,
            spilled_bytes: store.spilled_bytes,
            fallback_bytes: store.fallback_bytes,
            workers: shared.pool.workers(),
            workers_busy: u32::try_from(running).unwrap_or(u32::MAX),
            cpu_used_permille,
            rows_produced: shared.rows_produced.load(Ordering::Relaxed),
            network_received_bytes,
            network_sent_bytes,
        };
        tracing::debug!(?usage, "heartbeat");
        let Some(node) = shared.node() else {
            continue;
        };
        match client.heartbeat(node, usage).await {
            Ok(HeartbeatReply::Accepted { drivers }) => shared.sync_drivers(&drivers),
            Ok(HeartbeatReply::Rejoin) => {
                match registration.register(&mut client, Some(node)).await {
                    Ok(new) => {
                        tracing::warn!(old = %node, %new, "the scheduler declared this node dead; registered again");
                        shared.node.store(new.get(), Ordering::Relaxed);
                        // Replacing the set aborts an indexing under the old id.
                        indexing = tokio::task::JoinSet::new();
                        indexing.spawn(index_cache(Arc::clone(&shared), new));
                    }
                    Err(error) => tracing::error!(%error, "cannot register again"),
                }
            }
            Err(error) => tracing::warn!(%node, %error, "heartbeat failed"),
        }
    }
}

/// Records every valid shard in the node's cache directory as held by `node`. Each shard is
/// opened without its columns (its structure and manifest are checked, not its data);
/// one that fails is removed by the cache and skipped.
async fn index_cache(shared: Arc<Shared>, node: NodeId) {
    let mut client = shared.cache_index.lock().await;
    let cache = Arc::clone(&shared);
    let found = blocking(move || {
        let mut found = Vec::new();
        for file in cache.cache.shards()? {
            if let Some(opened) = cache.cache.open_shard_columns(file.name, &[])? {
                found.push((file.name, file.bytes, opened.manifest.rows));
            }
        }
        Ok(found)
    })
    .await;
    let found = match found {
        Ok(found) => found,
        Err(error) => {
            tracing::error!(%error, "cannot list the cache directory; its shards stay unindexed");
            return;
        }
    };
    let mut recorded = 0_usize;
    for (name, bytes, rows) in found {
        let command = Command::RecordCacheShard {
            fingerprint: name.fingerprint.to_string(),
            shard_count: name.shard.count,
            rank: name.shard.rank,
            shard: CachedShard { node, bytes, rows },
            origin: None,
        };
        match client.propose(command).await {
            Ok(Outcome::Applied) => recorded += 1,
            // Declared dead again meanwhile: the next registration indexes afresh.
            Ok(outcome) => {
                tracing::warn!(%node, ?outcome, "stopped recording cache shards");
                return;
            }
            Err(error) => {
                tracing::error!(%node, %error, "cannot record a cache shard; stopped");
                return;
            }
        }
    }
    if recorded > 0 {
        tracing::info!(%node, shards = recorded, "recorded the cache shards found on disk");
    }
}

/// SIGTERM and SIGINT, caught from the moment this is installed (so a signal that arrives
/// while the agent starts is not fatal).
pub struct Termination {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl Termination {
    pub fn install() -> Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        let io = |source| Error::Io {
            op: "installing a signal handler",
            source,
        };
        Ok(Self {
            terminate: signal(SignalKind::terminate()).map_err(io)?,
            interrupt: signal(SignalKind::interrupt()).map_err(io)?,
        })
    }

    /// Waits for the next signal and names it.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
        }
    }
}

fn cache_removed(removed: Removed) -> NodeResponse {
    NodeResponse::CacheRemoved {
        shards: removed.shards,
        bytes: removed.bytes,
    }
}

/// The store's figures as the node protocol reports them.
fn store_usage(stats: floe_objectstore::StoreStats) -> floe_api::node_protocol::StoreUsage {
    floe_api::node_protocol::StoreUsage {
        capacity: stats.capacity,
        used: stats.used,
        objects_in_memory: stats.objects_in_memory,
        pinned_bytes: stats.pinned_bytes,
        pinned_objects: stats.pinned_objects,
        spilled_bytes: stats.spilled_bytes,
        spilled_objects: stats.spilled_objects,
        spilled_bytes_total: stats.spilled_bytes_total,
        restored_bytes_total: stats.restored_bytes_total,
        fallback_bytes: stats.fallback_bytes,
        fallback_objects: stats.fallback_objects,
        shard_bytes: stats.shard_bytes,
        shard_objects: stats.shard_objects,
    }
}

#[cfg(test)]
mod tests {
    use arrow::datatypes::{DataType, Field, Schema};
    use floe_core::config::AllowedPaths;
    use floe_core::fingerprint::FileStamp;
    use floe_core::plan::physical::PhysicalPlan;
    use floe_core::plan::task::{FusedSource, SinkPart, StageInput, StageTask};
    use floe_core::plan::{
        Compression, DEFAULT_TARGET_FILE_SIZE, FileFormat, FileScan, LogicalPlan, WriteMode,
        WriteSpec,
    };

    use super::check_paths;

    /// A range task whose rows are written, by the task itself, into `directory`.
    fn range_task_writing_to(directory: &std::path::Path) -> StageTask {
        let plan = PhysicalPlan::from_logical(&LogicalPlan::range(10).unwrap());
        StageTask {
            stage: plan.stage(plan.output).clone(),
            input: StageInput::Range { start: 0, end: 10 },
            input_schemas: Vec::new(),
            min_block_bytes: 1,
            max_block_bytes: 1 << 20,
            batch_rows: 10,
            sink: Some(SinkPart {
                spec: WriteSpec {
                    format: FileFormat::Parquet,
                    directory: directory.to_owned(),
                    target_file_size: DEFAULT_TARGET_FILE_SIZE,
                    mode: WriteMode::Overwrite,
                    compression: Compression::Zstd,
                    partition_by: Vec::new(),
                },
                index: 0,
            }),
            source: None,
        }
    }

    /// A random shuffle's map task whose rows come from `file`, read by the task itself.
    fn shuffle_map_task_reading(file: &std::path::Path) -> StageTask {
        let schema = Schema::new(vec![Field::new("id", DataType::Int64, false)]);
        let stamp = FileStamp {
            path: file.to_owned(),
            size: 1,
            modified_secs: 0,
            modified_nanos: 0,
            version: None,
        };
        let read = LogicalPlan::read(FileScan::new(FileFormat::Parquet, vec![stamp], schema));
        let plan = PhysicalPlan::from_logical(&read.unwrap().random_shuffle(Some(1)).unwrap());
        let shuffle = plan.stage(plan.output).clone();
        let source = plan.stage(shuffle.inputs[0]).clone();
        StageTask {
            input_schemas: vec![source.schema.clone()],
            stage: shuffle,
            input: StageInput::Partition {
                partitions: 2,
                side: 0,
                offset: 0,
                total: 0,
                seed: 1,
            },
            min_block_bytes: 1,
            max_block_bytes: 1 << 20,
            batch_rows: 10,
            sink: None,
            source: Some(FusedSource {
                stage: source,
                input: StageInput::File(0),
            }),
        }
    }

    #[test]
    fn a_source_fused_into_a_task_is_checked_against_the_allowed_paths() {
        let allowed = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let paths = AllowedPaths::under(&[allowed.path().to_owned()]);
        let outside = shuffle_map_task_reading(&elsewhere.path().join("in.parquet"));
        let refused = check_paths(&paths, &outside).unwrap_err().to_string();
        assert!(refused.contains("outside data.allowed_paths"), "{refused}");
        let inside = shuffle_map_task_reading(&allowed.path().join("in.parquet"));
        check_paths(&paths, &inside).unwrap();
    }

    #[test]
    fn a_sink_fused_into_a_task_is_checked_against_the_allowed_paths() {
        let allowed = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let paths = AllowedPaths::under(&[allowed.path().to_owned()]);
        let outside = range_task_writing_to(&elsewhere.path().join("out"));
        let refused = check_paths(&paths, &outside).unwrap_err().to_string();
        assert!(refused.contains("outside data.allowed_paths"), "{refused}");
        let inside = range_task_writing_to(&allowed.path().join("out"));
        check_paths(&paths, &inside).unwrap();
    }
}
