//! An in-process cluster for the executor's tests.
//!
//! The scheduler is the real replicated state machine ([`ClusterState::apply`]) and the real
//! placement and lease logic ([`LeaseTable`]) without Raft; the nodes are an in-memory object table
//! (one copy of each block, on the node that made it), cache shard "files" and hosted
//! aggregators. Stage tasks run with the engine's kernels ([`floe_engine::task::run_task`],
//! [`floe_engine::exchange::run`]) as a node's worker would. A test can kill a node (its
//! blocks, shards and actors go with it, and its death commits at once), make tasks fail,
//! lose their inputs' node, or finish late, and read back what was placed, leased, run,
//! pushed, freed and committed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use arrow::record_batch::RecordBatch;
use floe_api::lease::{Lease, LeaseDecision, LeaseGrants, LeaseStanding, LeaseTable};
use floe_api::node_protocol::{
    ActorFailure, ActorKind, ActorMessage, ActorReply, Bytes, NodeRequest, NodeResponse,
    NodeStatus, ObjectMeta, OutputRef, Part, ShardLoad, ShardWrite, StoreUsage, TaskDone,
    TaskFailure, TaskSpec, output_id,
};
use floe_api::placement::{Decision, PlacementRequest};
use floe_api::scheduler_protocol::NodeSummary;
use floe_api::state::{
    CacheIndex, ClusterState, Command, JobOutcome, JobRecord, JobStatus, NodeAddresses, NodeMemory,
    Outcome, Resources,
};
use floe_core::job::{JobProgress, JobSpec};
use floe_core::plan::task::{StageInput, StageTask};
use floe_core::wire::{RemoteError, RemoteErrorKind, WireError};
use floe_core::{ActorId, Fingerprint, JobId, LeaseId, NodeId, ObjectId, SubmissionId, TaskId};
use floe_engine::blocks::data_bytes;
use floe_engine::task::{OutputBlock, TaskOutput, run_stage_task};
use floe_engine::udf::Registry;
use tokio::sync::Notify;

use super::{ClusterAccess, Deaths};
use crate::leases::LeaseService;
use crate::{Error, Result};

const ADDRESS_PREFIX: &str = "fake-node-";
/// Leases live this long unrenewed; drivers renew every tenth of it.
const LEASE_TTL: Duration = Duration::from_secs(1);

/// The cluster's shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FakeConfig {
    pub nodes: u64,
    pub cpus_per_node: u64,
    /// Each node's object store capacity (what the job's budget is a share of).
    pub store_bytes_per_node: u64,
}

/// What a fault does to the task it hits.
#[derive(Debug, Clone)]
pub(crate) enum Fault {
    /// The task fails with this failure.
    Fail(TaskFailure),
    /// The node the task runs on (for a reduce through an aggregator: the aggregator's node)
    /// dies as the task starts.
    KillNode,
    /// The first node other than the task's and `spare` that holds one of its inputs dies
    /// before the task reads it (`spare` is usually the driver's, which a test keeps alive).
    KillInputHolder { spare: NodeId },
    /// The task finishes only after this long.
    Delay(Duration),
}

/// A task about to run, as fault rules see it.
pub(crate) struct TaskView<'a> {
    pub id: TaskId,
    /// The node it runs on.
    pub node: NodeId,
    pub task: &'a StageTask,
    /// Where each input block is (`None`: it is in no store).
    pub input_nodes: Vec<Option<NodeId>>,
    /// The aggregator a reduce runs through.
    pub actor: Option<ActorId>,
}

type TaskMatcher = Box<dyn Fn(&TaskView<'_>) -> bool + Send>;

struct FaultRule {
    matches: TaskMatcher,
    remaining: u32,
    fault: Fault,
}

/// One stage task the fake ran (or failed).
#[derive(Debug, Clone)]
pub(crate) struct RanTask {
    pub task: TaskId,
    pub node: NodeId,
    /// The stage kind's name (`range`, `map`, `all_to_all`, …).
    pub stage: &'static str,
    pub input: StageInput,
    /// Where each input block was when it ran (`None`: in no store).
    pub input_nodes: Vec<Option<NodeId>>,
    pub actor: Option<ActorId>,
    /// The blocks it made (none when it failed).
    pub outputs: Vec<ObjectId>,
    pub failure: Option<TaskFailure>,
}

/// Shards pushed to an aggregator in one call.
#[derive(Debug, Clone)]
pub(crate) struct Push {
    pub actor: ActorId,
    pub partitions: Vec<u32>,
}

/// An aggregator the fake was asked to host.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CreatedActor {
    pub actor: ActorId,
    pub node: NodeId,
    pub slot: u32,
    pub slots: u32,
}

struct StoredBlock {
    node: NodeId,
    /// The job it was made for.
    job: JobId,
    content: Content,
    bytes: u64,
}

/// What an object holds.
enum Content {
    Block(RecordBatch),
    /// A map task's partitions; the fake's part offsets are their indexes.
    Packed(Vec<RecordBatch>),
}

impl StoredBlock {
    /// The block, or its part `part`.
    fn read(&self, part: Option<Part>) -> Option<&RecordBatch> {
        match (&self.content, part) {
            (Content::Block(batch), None) => Some(batch),
            (Content::Packed(batches), Some(part)) => {
                batches.get(usize::try_from(part.offset).ok()?)
            }
            _ => None,
        }
    }

    fn block(&self) -> Option<&RecordBatch> {
        self.read(None)
    }
}

struct HostedAggregator {
    node: NodeId,
    /// Copies of the shards pushed to it (by object and part offset), which outlive their
    /// holders (as pulled shards do).
    held: BTreeMap<(ObjectId, u64), RecordBatch>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct ShardKey {
    node: NodeId,
    fingerprint: Fingerprint,
    count: u32,
    rank: u32,
}

/// What the fake saw, for tests to assert on.
#[derive(Debug, Default)]
struct History {
    tasks: Vec<RanTask>,
    /// Actors' placements.
    placements: Vec<(PlacementRequest, NodeId)>,
    /// `AcquireLeases` calls, with the request each lease was granted for.
    lease_asks: u64,
    lease_grants: Vec<(PlacementRequest, Lease)>,
    lease_renewals: u64,
    leases_returned: u64,
    pushes: Vec<Push>,
    actors: Vec<CreatedActor>,
    freed: Vec<ObjectId>,
    commands: Vec<(Command, Outcome)>,
    progress: Vec<JobProgress>,
    reads: SchedulerReads,
    /// `Status` calls to nodes.
    node_statuses: u64,
}

/// How often the driver asked the scheduler for each thing, and the most records one
/// answer carried.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SchedulerReads {
    pub jobs: u64,
    pub cache_indexes: u64,
    pub node_lists: u64,
    pub death_checks: u64,
    pub largest_answer: usize,
}

struct Inner {
    state: ClusterState,
    log_index: u64,
    leases: LeaseTable,
    config: FakeConfig,
    blocks: BTreeMap<ObjectId, StoredBlock>,
    stored_bytes: u64,
    max_stored_bytes: u64,
    shards: BTreeMap<ShardKey, RecordBatch>,
    aggregators: BTreeMap<ActorId, HostedAggregator>,
    faults: Vec<FaultRule>,
    history: History,
}

impl Inner {
    fn commit(&mut self, command: Command) -> Outcome {
        self.log_index += 1;
        let outcome = self
            .state
            .apply(self.log_index, 0, command.clone())
            .unwrap_or_else(|| Outcome::Rejected("applied twice".into()));
        // As on the leader: a job's end revokes its leases.
        if let (Command::FinishJob { job, .. }, Outcome::Applied) = (&command, &outcome) {
            self.leases.revoke_job(*job);
        }
        self.history.commands.push((command, outcome.clone()));
        outcome
    }

    fn is_alive(&self, node: NodeId) -> bool {
        self.state
            .nodes
            .get(&node)
            .is_some_and(|node| node.is_alive())
    }

    fn store(
        &mut self,
        object: ObjectId,
        node: NodeId,
        job: JobId,
        batch: RecordBatch,
    ) -> OutputRef {
        let bytes = data_bytes(&batch);
        let rows = batch.num_rows() as u64;
        self.keep(object, node, job, Content::Block(batch), bytes);
        OutputRef {
            object,
            size: bytes,
            checksum: None,
            rows: Some(rows),
            parts: Vec::new(),
        }
    }

    /// Stores a map task's partitions as one object, as a node does.
    fn store_packed(
        &mut self,
        object: ObjectId,
        node: NodeId,
        job: JobId,
        batches: Vec<RecordBatch>,
    ) -> OutputRef {
        let parts: Vec<Part> = (0u64..)
            .zip(&batches)
            .map(|(index, batch)| Part {
                offset: index,
                len: data_bytes(batch),
                rows: batch.num_rows() as u64,
                checksum: 0,
            })
            .collect();
        let bytes = parts.iter().map(|part| part.len).sum();
        let rows = parts.iter().map(|part| part.rows).sum();
        self.keep(object, node, job, Content::Packed(batches), bytes);
        OutputRef {
            object,
            size: bytes,
            checksum: None,
            rows: Some(rows),
            parts,
        }
    }

    fn keep(&mut self, object: ObjectId, node: NodeId, job: JobId, content: Content, bytes: u64) {
        self.discard(object);
        self.blocks.insert(
            object,
            StoredBlock {
                node,
                job,
                content,
                bytes,
            },
        );
        self.stored_bytes += bytes;
        self.max_stored_bytes = self.max_stored_bytes.max(self.stored_bytes);
    }

    fn discard(&mut self, object: ObjectId) {
        if let Some(block) = self.blocks.remove(&object) {
            self.stored_bytes -= block.bytes;
        }
    }

    fn kill(&mut self, node: NodeId) {
        if !self.is_alive(node) {
            return;
        }
        self.commit(Command::MarkNodeDead {
            node,
            reason: "killed by the test".into(),
        });
        // As on the leader: the leases on it, and those its drivers held, are revoked.
        self.leases.remove_node(node);
        self.leases.revoke_driver(node);
        let lost: Vec<ObjectId> = self
            .blocks
            .iter()
            .filter(|(_, block)| block.node == node)
            .map(|(object, _)| *object)
            .collect();
        for object in lost {
            self.discard(object);
        }
        self.shards.retain(|key, _| key.node != node);
        self.aggregators.retain(|_, hosted| hosted.node != node);
    }

    /// The first fault rule matching `view`, used up once.
    fn fault_for(&mut self, view: &TaskView<'_>) -> Option<Fault> {
        let rule = self
            .faults
            .iter_mut()
            .find(|rule| rule.remaining > 0 && (rule.matches)(view))?;
        rule.remaining -= 1;
        Some(rule.fault.clone())
    }
}

/// How running a task on a node ended.
enum Ran {
    Finished(std::result::Result<TaskDone, TaskFailure>),
    /// The node died under it.
    NodeDied,
}

pub(crate) struct FakeCluster {
    inner: Mutex<Inner>,
    registry: Registry,
    /// Woken when a lease is given back or revoked, for asks waiting on a full cluster.
    released: Notify,
    dead: Deaths,
}

impl FakeCluster {
    pub(crate) fn new(config: FakeConfig) -> Self {
        let mut inner = Inner {
            state: ClusterState::default(),
            log_index: 0,
            leases: LeaseTable::new(LEASE_TTL, Instant::now()),
            config,
            blocks: BTreeMap::new(),
            stored_bytes: 0,
            max_stored_bytes: 0,
            shards: BTreeMap::new(),
            aggregators: BTreeMap::new(),
            faults: Vec::new(),
            history: History::default(),
        };
        let resources = Resources {
            cpu_millis: config.cpus_per_node * 1000,
            heap_bytes: 1 << 30,
        };
        for number in 1..=config.nodes {
            let registered = inner.commit(Command::RegisterNode {
                addresses: NodeAddresses {
                    rpc: format!("{ADDRESS_PREFIX}{number}"),
                },
                resources,
                memory: NodeMemory::default(),
                labels: BTreeMap::new(),
                replaces: None,
            });
            assert_eq!(registered, Outcome::NodeRegistered(NodeId::new(number)));
            inner.leases.upsert_node(NodeId::new(number), resources);
        }
        Self {
            inner: Mutex::new(inner),
            registry: Registry::with_builtins(),
            released: Notify::new(),
            dead: Deaths::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Submits `spec` and starts its first driver on `driver`: the job is running, attempt 1.
    pub(crate) fn submit(&self, spec: &JobSpec, driver: NodeId) -> JobId {
        let mut inner = self.lock();
        let spec = spec.encode().expect("the job spec encodes");
        let Outcome::JobSubmitted(job) = inner.commit(Command::SubmitJob {
            spec,
            submission: SubmissionId::random(),
            name: None,
        }) else {
            panic!("the job was not submitted");
        };
        assert_eq!(
            inner.commit(Command::StartDriver { job, node: driver }),
            Outcome::Applied
        );
        job
    }

    /// Adds `count` jobs that already ended, as a long-running cluster has in its state.
    pub(crate) fn add_finished_jobs(&self, count: u64) {
        let mut inner = self.lock();
        for _ in 0..count {
            let Outcome::JobSubmitted(job) = inner.commit(Command::SubmitJob {
                spec: vec![0; 64],
                submission: SubmissionId::random(),
                name: None,
            }) else {
                panic!("the job was not submitted");
            };
            inner.commit(Command::StartDriver {
                job,
                node: NodeId::new(1),
            });
            inner.commit(Command::FinishJob {
                job,
                attempt: 1,
                outcome: JobOutcome {
                    status: JobStatus::Succeeded,
                    stats: Default::default(),
                    outputs: Vec::new(),
                },
            });
        }
        // Only the commands the driver sends are of interest.
        inner.history.commands.clear();
    }

    /// Puts a block made for `job` on `node`, as an earlier attempt's task would have.
    pub(crate) fn store_block(&self, job: JobId, node: NodeId, object: ObjectId) {
        let batch = RecordBatch::new_empty(Arc::new(arrow::datatypes::Schema::empty()));
        self.lock().store(object, node, job, batch);
    }

    /// Starts attempt 2 of `job`, whose first driver ran on `first`: that node dies (taking its
    /// blocks), and the next driver starts on `driver`.
    pub(crate) fn restart_driver(&self, job: JobId, first: NodeId, driver: NodeId) {
        self.kill_node(first);
        let outcome = self
            .lock()
            .commit(Command::StartDriver { job, node: driver });
        assert_eq!(outcome, Outcome::Applied);
    }

    /// What the driver asked the scheduler.
    pub(crate) fn scheduler_reads(&self) -> SchedulerReads {
        self.lock().history.reads
    }

    /// How many `Status` calls nodes answered.
    pub(crate) fn node_statuses(&self) -> u64 {
        self.lock().history.node_statuses
    }

    /// The job's record in the replicated state.
    pub(crate) fn job(&self, job: JobId) -> Arc<JobRecord> {
        Arc::clone(&self.lock().state.jobs[&job])
    }

    /// Kills `node`: its blocks, cache shards and aggregators are gone and its death is
    /// committed.
    pub(crate) fn kill_node(&self, node: NodeId) {
        let state = {
            let mut inner = self.lock();
            inner.kill(node);
            inner.state.clone()
        };
        // Tasks waiting on the node learn of its death at once.
        self.dead.learn(&state.deaths_after(0));
        self.released.notify_waiters();
    }

    /// The next `times` tasks for which `matches` holds suffer `fault`.
    pub(crate) fn on_tasks(
        &self,
        times: u32,
        matches: impl Fn(&TaskView<'_>) -> bool + Send + 'static,
        fault: Fault,
    ) {
        self.lock().faults.push(FaultRule {
            matches: Box::new(matches),
            remaining: times,
            fault,
        });
    }

    /// Deletes every cache shard file, leaving the cache index as it is.
    pub(crate) fn delete_cache_files(&self) {
        self.lock().shards.clear();
    }

    /// Deletes the cache shard files of rank `rank` (of any count, on any node), leaving the
    /// cache index as it is.
    pub(crate) fn delete_cache_rank(&self, rank: u32) {
        self.lock().shards.retain(|key, _| key.rank != rank);
    }

    /// How many cache shard files the nodes hold.
    pub(crate) fn cache_files(&self) -> usize {
        self.lock().shards.len()
    }

    /// The blocks in the object stores.
    pub(crate) fn stored_objects(&self) -> BTreeSet<ObjectId> {
        self.lock().blocks.keys().copied().collect()
    }

    /// The most bytes the object stores held at once.
    pub(crate) fn max_stored_bytes(&self) -> u64 {
        self.lock().max_stored_bytes
    }

    /// The rows of `objects`, in order; panics on a block that is in no store.
    pub(crate) fn batches(&self, objects: impl IntoIterator<Item = ObjectId>) -> Vec<RecordBatch> {
        let inner = self.lock();
        objects
            .into_iter()
            .filter_map(|object| inner.blocks[&object].block().cloned())
            .collect()
    }

    pub(crate) fn tasks(&self) -> Vec<RanTask> {
        self.lock().history.tasks.clone()
    }

    /// Actors' placements.
    pub(crate) fn placements(&self) -> Vec<(PlacementRequest, NodeId)> {
        self.lock().history.placements.clone()
    }

    /// The leases granted, with the request each was granted for.
    pub(crate) fn lease_grants(&self) -> Vec<(PlacementRequest, Lease)> {
        self.lock().history.lease_grants.clone()
    }

    /// `AcquireLeases` calls, `RenewLeases` calls and leases returned by drivers.
    pub(crate) fn lease_calls(&self) -> (u64, u64, u64) {
        let history = &self.lock().history;
        (
            history.lease_asks,
            history.lease_renewals,
            history.leases_returned,
        )
    }

    /// The leases the scheduler holds now.
    pub(crate) fn leases_held(&self) -> usize {
        self.lock().leases.len()
    }

    /// What the leases on `node` reserve now (`None` for a dead node).
    pub(crate) fn reserved(&self, node: NodeId) -> Option<Resources> {
        self.lock().leases.view().used(node)
    }

    pub(crate) fn pushes(&self) -> Vec<Push> {
        self.lock().history.pushes.clone()
    }

    pub(crate) fn created_actors(&self) -> Vec<CreatedActor> {
        self.lock().history.actors.clone()
    }

    pub(crate) fn freed(&self) -> Vec<ObjectId> {
        self.lock().history.freed.clone()
    }

    /// The progress the driver reported, in order.
    pub(crate) fn progress_reports(&self) -> Vec<JobProgress> {
        self.lock().history.progress.clone()
    }

    /// The commands committed, with their outcomes, in order.
    pub(crate) fn commands(&self) -> Vec<(Command, Outcome)> {
        self.lock().history.commands.clone()
    }

    /// The node at `addr`, if it is one of the fake's and alive.
    fn alive_node_at(&self, addr: &str) -> Result<NodeId> {
        let node = addr
            .strip_prefix(ADDRESS_PREFIX)
            .and_then(|number| number.parse().ok())
            .map(NodeId::new)
            .filter(|node| self.lock().is_alive(*node));
        node.ok_or_else(|| {
            Error::Wire(WireError::Connect {
                addr: addr.to_owned(),
                source: std::io::ErrorKind::ConnectionRefused.into(),
            })
        })
    }

    async fn handle(&self, node: NodeId, request: &NodeRequest) -> Result<NodeResponse> {
        let response = match request {
            NodeRequest::Status => {
                self.lock().history.node_statuses += 1;
                self.status(node)
            }
            NodeRequest::Free { objects } => {
                let mut inner = self.lock();
                for object in objects {
                    if inner
                        .blocks
                        .get(object)
                        .is_some_and(|block| block.node == node)
                    {
                        inner.discard(*object);
                        inner.history.freed.push(*object);
                    }
                }
                NodeResponse::Freed
            }
            NodeRequest::FreeJob { job, keep } => {
                let mut inner = self.lock();
                let leftovers: Vec<ObjectId> = inner
                    .blocks
                    .iter()
                    .filter(|(object, block)| {
                        block.node == node && block.job == *job && !keep.contains(object)
                    })
                    .map(|(object, _)| *object)
                    .collect();
                for object in leftovers {
                    inner.discard(object);
                    inner.history.freed.push(object);
                }
                NodeResponse::Freed
            }
            NodeRequest::ObjectMeta { object } => self.object_meta(node, *object)?,
            NodeRequest::CancelTask { .. } => NodeResponse::Cancelled,
            NodeRequest::WriteCacheShard(write) => self.write_shard(node, write)?,
            NodeRequest::LoadCacheShard(load) => self.load_shard(node, load),
            NodeRequest::CreateActor(spec) => {
                let ActorKind::HashShuffleAggregator { slot, slots } = spec.kind;
                let mut inner = self.lock();
                inner.aggregators.insert(
                    spec.actor,
                    HostedAggregator {
                        node,
                        held: BTreeMap::new(),
                    },
                );
                inner.history.actors.push(CreatedActor {
                    actor: spec.actor,
                    node,
                    slot,
                    slots,
                });
                NodeResponse::ActorCreated
            }
            NodeRequest::StopActor { actor } => {
                self.lock().aggregators.remove(actor);
                NodeResponse::ActorStopped
            }
            NodeRequest::RunTask(spec) => match self.run(node, spec, None).await {
                // In-process: no worker process runs it.
                Ran::Finished(result) => NodeResponse::Task {
                    result,
                    worker: None,
                },
                Ran::NodeDied => return Err(Error::Wire(WireError::Closed)),
            },
            NodeRequest::CallActor { actor, message, .. } => {
                NodeResponse::Actor(self.call_actor(*actor, message).await)
            }
            NodeRequest::RemoveCacheShards { fingerprints } => {
                let mut inner = self.lock();
                let before = inner.shards.len();
                inner
                    .shards
                    .retain(|key, _| key.node != node || !fingerprints.contains(&key.fingerprint));
                NodeResponse::CacheRemoved {
                    shards: (before - inner.shards.len()) as u64,
                    bytes: 0,
                }
            }
            // The fake keeps the bytes: it serves no fetch that would load them again.
            NodeRequest::ReadChunk { .. }
            | NodeRequest::ReadRanges { .. }
            | NodeRequest::LendRanges { .. }
            | NodeRequest::Pull { .. }
            | NodeRequest::CleanCache { .. }
            | NodeRequest::ReadLogs(_)
            | NodeRequest::NextOutputs { .. }
            | NodeRequest::JobTasks { .. } => {
                return Err(refused(format!(
                    "the fake cluster does not serve {request:?}"
                )));
            }
        };
        Ok(response)
    }

    fn status(&self, node: NodeId) -> NodeResponse {
        let inner = self.lock();
        let used = inner
            .blocks
            .values()
            .filter(|block| block.node == node)
            .map(|block| block.bytes)
            .sum();
        NodeResponse::Status(Box::new(NodeStatus {
            node: Some(node),
            workers: u32::try_from(inner.config.cpus_per_node).unwrap_or(u32::MAX),
            running: Vec::new(),
            tasks_finished: 0,
            tasks_failed: 0,
            workers_respawned: 0,
            pulls_started: 0,
            borrowed_bytes: 0,
            store: StoreUsage {
                capacity: inner.config.store_bytes_per_node,
                used,
                ..StoreUsage::default()
            },
            actors: Vec::new(),
            worker_slots: Vec::new(),
            largest_objects: Vec::new(),
            cpu_used_permille: 0,
            heap_used_bytes: 0,
            udf_pools: Vec::new(),
        }))
    }

    /// A block's bytes as the node stores them: one Arrow IPC file.
    fn object_meta(&self, node: NodeId, object: ObjectId) -> Result<NodeResponse> {
        let inner = self.lock();
        let block = inner
            .blocks
            .get(&object)
            .filter(|block| block.node == node)
            .and_then(StoredBlock::block)
            .ok_or_else(|| refused(format!("no block {object} on node {node}")))?;
        let mut bytes = Vec::new();
        let mut writer = arrow::ipc::writer::FileWriter::try_new(&mut bytes, block.schema_ref())
            .map_err(|error| refused(error.to_string()))?;
        writer
            .write(block)
            .and_then(|()| writer.finish())
            .map_err(|error| refused(error.to_string()))?;
        drop(writer);
        Ok(NodeResponse::ObjectMeta(ObjectMeta {
            size: bytes.len() as u64,
            checksum: 0,
            inline: Some(Bytes(bytes)),
        }))
    }

    fn write_shard(&self, node: NodeId, write: &ShardWrite) -> Result<NodeResponse> {
        let mut inner = self.lock();
        let mut batches = Vec::with_capacity(write.blocks.len());
        for object in &write.blocks {
            let block = inner
                .blocks
                .get(object)
                .filter(|block| block.node == node)
                .and_then(StoredBlock::block)
                .ok_or_else(|| refused(format!("shard block {object} is not on node {node}")))?;
            batches.push(block.clone());
        }
        let schema = Arc::new(write.schema.clone());
        let shard = arrow::compute::concat_batches(&schema, &batches)
            .map_err(|error| refused(error.to_string()))?;
        let (rows, bytes) = (shard.num_rows() as u64, data_bytes(&shard));
        let key = ShardKey {
            node,
            fingerprint: write.lineage.fingerprint(),
            count: write.count,
            rank: write.rank,
        };
        if write.overwrite || !inner.shards.contains_key(&key) {
            inner.shards.insert(key, shard);
        }
        Ok(NodeResponse::CacheWritten { rows, bytes })
    }

    fn load_shard(&self, node: NodeId, load: &ShardLoad) -> NodeResponse {
        let mut inner = self.lock();
        let key = ShardKey {
            node,
            fingerprint: load.fingerprint,
            count: load.count,
            rank: load.rank,
        };
        let Some(shard) = inner.shards.get(&key).cloned() else {
            return NodeResponse::CacheLoaded(None);
        };
        NodeResponse::CacheLoaded(Some(inner.store(load.object, node, load.job, shard)))
    }

    async fn call_actor(
        &self,
        actor: ActorId,
        message: &ActorMessage,
    ) -> std::result::Result<ActorReply, ActorFailure> {
        let gone = || ActorFailure::Gone {
            actor,
            reason: "no node hosts it".into(),
        };
        match message {
            ActorMessage::Push(shards) => {
                let mut inner = self.lock();
                let copies: Vec<((ObjectId, u64), RecordBatch)> = shards
                    .iter()
                    .filter_map(|shard| {
                        let block = inner.blocks.get(&shard.object)?.read(Some(shard.part))?;
                        Some(((shard.object, shard.part.offset), block.clone()))
                    })
                    .collect();
                let hosted = inner.aggregators.get_mut(&actor).ok_or_else(gone)?;
                hosted.held.extend(copies);
                let held_bytes = hosted.held.values().map(data_bytes).sum();
                inner.history.pushes.push(Push {
                    actor,
                    partitions: shards.iter().map(|shard| shard.partition).collect(),
                });
                Ok(ActorReply::Pushed { held_bytes })
            }
            ActorMessage::Reduce { task, .. } => {
                let node = self
                    .lock()
                    .aggregators
                    .get(&actor)
                    .map(|hosted| hosted.node)
                    .ok_or_else(gone)?;
                match self.run(node, task, Some(actor)).await {
                    Ran::Finished(Ok(done)) => Ok(ActorReply::Reduced { done, worker: None }),
                    Ran::Finished(Err(failure)) => Err(ActorFailure::Task(failure)),
                    Ran::NodeDied => Err(gone()),
                }
            }
            ActorMessage::Describe => Err(ActorFailure::Refused {
                actor,
                reason: "the fake cluster's aggregators describe nothing".into(),
            }),
        }
    }

    /// Runs a stage task on `node` (through `actor`, for a reduce sent to an aggregator).
    async fn run(&self, node: NodeId, spec: &TaskSpec, actor: Option<ActorId>) -> Ran {
        let Some(task) = spec.kind.as_stage() else {
            return Ran::Finished(Err(TaskFailure::Error {
                message: "the fake cluster runs stage tasks only".into(),
            }));
        };
        let objects: Vec<ObjectId> = spec.inputs.iter().map(|input| input.object).collect();
        let fault = {
            let mut inner = self.lock();
            let view = TaskView {
                id: spec.task,
                node,
                task,
                input_nodes: objects
                    .iter()
                    .map(|object| inner.blocks.get(object).map(|block| block.node))
                    .collect(),
                actor,
            };
            let fault = inner.fault_for(&view);
            let victim = match &fault {
                Some(Fault::KillNode) => Some(node),
                Some(Fault::KillInputHolder { spare }) => view
                    .input_nodes
                    .iter()
                    .flatten()
                    .copied()
                    .find(|held| *held != node && held != spare),
                _ => None,
            };
            (fault, victim, view.input_nodes)
        };
        let (fault, victim, input_nodes) = fault;
        if let Some(victim) = victim {
            self.kill_node(victim);
        }
        match fault {
            Some(Fault::Fail(failure)) => {
                return self.record(node, spec, task, actor, input_nodes, Err(failure));
            }
            Some(Fault::KillNode) => return Ran::NodeDied,
            Some(Fault::Delay(pause)) => tokio::time::sleep(pause).await,
            Some(Fault::KillInputHolder { .. }) | None => {}
        }
        let inputs = {
            let inner = self.lock();
            if !inner.is_alive(node) {
                return Ran::NodeDied;
            }
            // A reduce through an aggregator reads the shards pushed to it where it keeps them.
            let held = actor.and_then(|actor| inner.aggregators.get(&actor));
            spec.inputs
                .iter()
                .map(|input| {
                    let shard = input.part.map(|part| (input.object, part.offset));
                    held.zip(shard)
                        .and_then(|(hosted, shard)| hosted.held.get(&shard))
                        .or_else(|| inner.blocks.get(&input.object)?.read(input.part))
                        .map(|batch| vec![batch.clone()])
                        .ok_or(input.object)
                })
                .collect::<std::result::Result<Vec<_>, ObjectId>>()
        };
        let inputs = match inputs {
            Ok(inputs) => inputs,
            Err(object) => {
                let failure = TaskFailure::InputUnavailable {
                    object,
                    reason: "it is in no store".into(),
                };
                return self.record(node, spec, task, actor, input_nodes, Err(failure));
            }
        };
        let result = run_stage_task(task, inputs, &self.registry, &[])
            .and_then(FakeOutput::of)
            .map_err(|error| TaskFailure::Error {
                message: error.to_string(),
            });
        let outputs = {
            let mut inner = self.lock();
            if !inner.is_alive(node) {
                return Ran::NodeDied;
            }
            result.map(|output| match output {
                FakeOutput::Blocks(blocks) => TaskDone {
                    outputs: (0u32..)
                        .zip(blocks)
                        .map(|(index, batches)| {
                            // The fake keeps a block as one batch; a node keeps its batches.
                            let batch =
                                arrow::compute::concat_batches(&batches[0].schema(), &batches)
                                    .expect("a block's batches share their schema");
                            inner.store(output_id(spec.task, index), node, spec.job, batch)
                        })
                        .collect(),
                    written_rows: 0,
                },
                FakeOutput::Partitions(batches) => TaskDone {
                    outputs: vec![inner.store_packed(
                        output_id(spec.task, 0),
                        node,
                        spec.job,
                        batches,
                    )],
                    written_rows: 0,
                },
                FakeOutput::Written { rows } => TaskDone {
                    outputs: Vec::new(),
                    written_rows: rows,
                },
            })
        };
        self.record(node, spec, task, actor, input_nodes, outputs)
    }

    fn record(
        &self,
        node: NodeId,
        spec: &TaskSpec,
        task: &StageTask,
        actor: Option<ActorId>,
        input_nodes: Vec<Option<NodeId>>,
        result: std::result::Result<TaskDone, TaskFailure>,
    ) -> Ran {
        self.lock().history.tasks.push(RanTask {
            task: spec.task,
            node,
            stage: task.stage.kind.name(),
            input: task.input,
            input_nodes,
            actor,
            outputs: result
                .iter()
                .flat_map(|done| &done.outputs)
                .map(|output| output.object)
                .collect(),
            failure: result.as_ref().err().cloned(),
        });
        Ran::Finished(result)
    }
}

/// A task's output as the fake keeps it: every block gathered into batches.
enum FakeOutput {
    Blocks(Vec<Vec<RecordBatch>>),
    Partitions(Vec<RecordBatch>),
    Written { rows: u64 },
}

impl FakeOutput {
    fn of(output: TaskOutput) -> floe_engine::Result<Self> {
        Ok(match output {
            TaskOutput::Blocks(blocks) => FakeOutput::Blocks(
                blocks
                    .into_iter()
                    .map(OutputBlock::into_batches)
                    .collect::<floe_engine::Result<_>>()?,
            ),
            TaskOutput::Partitions(partitions) => FakeOutput::Partitions(
                partitions
                    .into_batches()?
                    .into_iter()
                    .map(|batches| {
                        let schema = batches.first().map(RecordBatch::schema).ok_or_else(|| {
                            arrow::error::ArrowError::InvalidArgumentError(
                                "a partition of no batches".to_owned(),
                            )
                        })?;
                        Ok(arrow::compute::concat_batches(&schema, &batches)?)
                    })
                    .collect::<floe_engine::Result<_>>()?,
            ),
            TaskOutput::Written { rows } => FakeOutput::Written { rows },
        })
    }
}

/// An error the node answered instead of a response.
fn refused(message: String) -> Error {
    Error::Wire(WireError::Remote(RemoteError::new(
        RemoteErrorKind::BadRequest,
        message,
    )))
}

impl ClusterAccess for FakeCluster {
    async fn read_job(&self, job: JobId) -> Result<Option<JobRecord>> {
        let mut inner = self.lock();
        let record = inner.state.jobs.get(&job).map(|record| (**record).clone());
        let reads = &mut inner.history.reads;
        reads.jobs += 1;
        reads.largest_answer = reads.largest_answer.max(1);
        Ok(record)
    }

    async fn cache_index(&self) -> Result<CacheIndex> {
        let mut inner = self.lock();
        let index = inner.state.cache.clone();
        let reads = &mut inner.history.reads;
        reads.cache_indexes += 1;
        reads.largest_answer = reads.largest_answer.max(index.len());
        Ok(index)
    }

    async fn read_nodes(&self) -> Result<Vec<NodeSummary>> {
        let mut inner = self.lock();
        let nodes: Vec<NodeSummary> = inner
            .state
            .alive_nodes()
            .map(|node| NodeSummary {
                id: node.id,
                rpc: node.addresses.rpc.clone(),
                resources: node.resources,
            })
            .collect();
        let reads = &mut inner.history.reads;
        reads.node_lists += 1;
        reads.largest_answer = reads.largest_answer.max(nodes.len());
        Ok(nodes)
    }

    async fn learn_deaths(&self) -> Result<()> {
        let deaths = {
            let mut inner = self.lock();
            let deaths = inner.state.deaths_after(0);
            let reads = &mut inner.history.reads;
            reads.death_checks += 1;
            reads.largest_answer = reads.largest_answer.max(deaths.len());
            deaths
        };
        self.dead.learn(&deaths);
        Ok(())
    }

    async fn propose(&self, command: Command) -> Result<Outcome> {
        let outcome = self.lock().commit(command);
        self.released.notify_waiters();
        Ok(outcome)
    }

    async fn place_all(&self, requests: Vec<PlacementRequest>) -> Result<Vec<NodeId>> {
        let mut placed = Vec::with_capacity(requests.len());
        for request in requests {
            loop {
                let released = self.released.notified();
                tokio::pin!(released);
                released.as_mut().enable();
                let decision = {
                    let mut inner = self.lock();
                    let decision = inner.leases.choose_one(&request)?;
                    if let Decision::Placed(node) = decision {
                        inner.history.placements.push((request.clone(), node));
                    }
                    decision
                };
                match decision {
                    Decision::Placed(node) => {
                        placed.push(node);
                        break;
                    }
                    Decision::Wait => released.await,
                }
            }
        }
        Ok(placed)
    }

    async fn report_progress(&self, job: JobId, progress: JobProgress) -> Result<bool> {
        let mut inner = self.lock();
        inner.history.progress.push(progress);
        let record = inner.state.jobs.get(&job).ok_or(Error::UnknownJob(job))?;
        Ok(record.cancel_requested || record.status != JobStatus::Running)
    }

    async fn address(&self, node: NodeId) -> Result<String> {
        let inner = self.lock();
        match inner.state.nodes.get(&node) {
            Some(record) if record.is_alive() => Ok(record.addresses.rpc.clone()),
            _ => Err(Error::NodeGone(node)),
        }
    }

    fn alive_nodes(&self) -> Vec<NodeId> {
        self.lock()
            .state
            .alive_nodes()
            .map(|node| node.id)
            .collect()
    }

    async fn death_of(&self, node: NodeId) {
        self.dead.of(node).await;
    }

    async fn call_node(&self, addr: &str, request: &NodeRequest) -> Result<NodeResponse> {
        let node = self.alive_node_at(addr)?;
        self.handle(node, request).await
    }

    async fn run_task(&self, addr: &str, request: &NodeRequest) -> Result<NodeResponse> {
        let node = self.alive_node_at(addr)?;
        self.handle(node, request).await
    }
}

/// The leader's side of leases, with the replica's rules: only the job's running driver is
/// granted any; an ask that fits nothing waits for a return or a revocation (recalling leases
/// from a job holding more), up to its wait.
impl LeaseService for FakeCluster {
    async fn acquire_leases(
        &self,
        job: JobId,
        requests: Vec<PlacementRequest>,
        wait: Duration,
    ) -> Result<LeaseGrants> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut recalled: Vec<Option<LeaseId>> = vec![None; requests.len()];
        self.lock().history.lease_asks += 1;
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            let decisions = {
                let mut inner = self.lock();
                let driver = match inner.state.jobs.get(&job) {
                    Some(record) if record.status == JobStatus::Running => record.driver,
                    _ => None,
                };
                let Some(driver) = driver else {
                    return Err(refused(format!("job {job} is not running")));
                };
                let now = Instant::now();
                inner.leases.expire(now);
                let mut decisions = Vec::with_capacity(requests.len());
                for request in &requests {
                    decisions.push(match inner.leases.grant(job, driver, request, now) {
                        Ok(Some(lease)) => {
                            inner.history.lease_grants.push((request.clone(), lease));
                            LeaseDecision::Granted(lease)
                        }
                        Ok(None) => LeaseDecision::NotNow,
                        Err(error) => LeaseDecision::Refused(error),
                    });
                }
                let granted = decisions
                    .iter()
                    .any(|decision| matches!(decision, LeaseDecision::Granted(_)));
                if !granted {
                    for (slot, request) in requests.iter().enumerate() {
                        let waiting = decisions[slot] == LeaseDecision::NotNow;
                        let live = recalled[slot].is_some_and(|id| inner.leases.holds(id));
                        if waiting && !live {
                            recalled[slot] = inner.leases.recall_for(job, request, now);
                        }
                    }
                }
                decisions
            };
            let settled = decisions
                .iter()
                .all(|decision| *decision != LeaseDecision::NotNow);
            let granted = decisions
                .iter()
                .any(|decision| matches!(decision, LeaseDecision::Granted(_)));
            if granted || settled || tokio::time::Instant::now() >= deadline {
                return Ok(LeaseGrants {
                    decisions,
                    renew_ms: u64::try_from(
                        (LEASE_TTL / floe_api::lease::RENEWALS_PER_TTL).as_millis(),
                    )
                    .unwrap_or(u64::MAX),
                });
            }
            tokio::select! {
                () = released => {}
                () = tokio::time::sleep_until(deadline) => {}
            }
        }
    }

    async fn renew_leases(&self, job: JobId, leases: Vec<Lease>) -> Result<Vec<LeaseStanding>> {
        let mut inner = self.lock();
        inner.history.lease_renewals += 1;
        let driver = inner.state.jobs.get(&job).and_then(|record| record.driver);
        let now = Instant::now();
        Ok(leases
            .iter()
            .map(|lease| match driver {
                Some(driver) if inner.is_alive(lease.node) && lease.job == job => {
                    inner.leases.renew(job, driver, lease, now)
                }
                _ => LeaseStanding::Revoked,
            })
            .collect())
    }

    async fn return_leases(&self, job: JobId, leases: Vec<LeaseId>) -> Result<()> {
        {
            let mut inner = self.lock();
            let driver = inner.state.jobs.get(&job).and_then(|record| record.driver);
            for id in leases {
                if let Some(driver) = driver
                    && inner.leases.give_back(job, driver, id)
                {
                    inner.history.leases_returned += 1;
                }
            }
        }
        self.released.notify_waiters();
        Ok(())
    }
}
