//! The executor's state machine against the in-process fake cluster: real kernels, real
//! placement and replicated state, injected failures. Every test checks the job's rows
//! against a plain Rust computation.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{Array, Int64Array};
use arrow::record_batch::RecordBatch;
use floe_api::node_protocol::TaskFailure;
use floe_api::placement::Strategy;
use floe_api::state::{Command, JobRecord, JobStatus, Resources};
use floe_core::config::{ClusterSecret, Config, TimeoutsConfig};
use floe_core::expr::{col, lit, when};
use floe_core::job::{CacheMode, JobOptions, JobSpec, OperatorStats};
use floe_core::plan::task::StageInput;
use floe_core::plan::{
    AggFunction, Aggregation, Compression, CsvOptions, DEFAULT_TARGET_FILE_SIZE, FileFormat,
    LogicalPlan, SortKey, WriteMode, WriteSpec,
};
use floe_core::wire::WireConfig;
use floe_core::{ActorId, NodeId, ObjectId};

use crate::DriverConfig;
use crate::cluster::ClusterAccess;
use crate::cluster::fake::{FakeCluster, FakeConfig, Fault, TaskView};

/// The node every test's driver runs on; faults never kill it (the driver would die with it).
const DRIVER_NODE: NodeId = NodeId::new(1);
/// Rows per reader batch: a range task makes `4 × BATCH_ROWS` rows.
const BATCH_ROWS: u32 = 8;
/// A job that takes longer has hung.
const JOB_TIMEOUT: Duration = Duration::from_secs(10);

fn fake(nodes: u64, cpus_per_node: u64) -> Arc<FakeCluster> {
    Arc::new(FakeCluster::new(FakeConfig {
        nodes,
        cpus_per_node,
        store_bytes_per_node: 1 << 30,
    }))
}

fn driver_config() -> Arc<DriverConfig> {
    Arc::new(DriverConfig {
        schedulers: Vec::new(),
        wire: {
            let mut config = Config::default();
            config.cluster.secret = ClusterSecret::new("fake");
            WireConfig {
                max_frame: 1 << 20,
                timeouts: TimeoutsConfig::default(),
                ..WireConfig::member(&config)
            }
        },
        node: DRIVER_NODE,
        min_block_bytes: 1,
        max_block_bytes: 1 << 20,
        batch_rows: BATCH_ROWS,
        progress_interval: Duration::from_millis(10),
        streams: crate::stream::ResultStreams::default(),
        allowed_paths: floe_core::config::AllowedPaths::any(),
        tasks: Default::default(),
    })
}

fn spec(plan: LogicalPlan, cache: CacheMode) -> JobSpec {
    JobSpec {
        plan,
        options: JobOptions {
            cache,
            ..JobOptions::default()
        },
    }
}

/// `range(n)` whose blocks reach the object store before the operators after it: the
/// `cache()` mark keeps the row-wise operators that follow from fusing into the range.
fn stored_range(n: u64) -> LogicalPlan {
    LogicalPlan::range(n).unwrap().cache().unwrap()
}

/// Runs `spec` to its end on `fake` and returns the job's record.
async fn run(fake: &Arc<FakeCluster>, spec: &JobSpec) -> Arc<JobRecord> {
    run_with(fake, spec, driver_config()).await
}

/// [`run`] with a driver configuration of its own.
async fn run_with(
    fake: &Arc<FakeCluster>,
    spec: &JobSpec,
    config: Arc<DriverConfig>,
) -> Arc<JobRecord> {
    let job = fake.submit(spec, DRIVER_NODE);
    tokio::time::timeout(JOB_TIMEOUT, crate::drive(config, Arc::clone(fake), job, 1))
        .await
        .expect("the job ended in time")
        .expect("the driver committed the outcome");
    // Frees the driver spawned and did not wait for.
    tokio::time::sleep(Duration::from_millis(20)).await;
    fake.job(job)
}

fn succeeded(record: &JobRecord) -> &JobRecord {
    assert_eq!(record.status, JobStatus::Succeeded, "{:?}", record.status);
    record
}

fn outputs(record: &JobRecord) -> Vec<ObjectId> {
    record.outputs.iter().map(|output| output.object).collect()
}

/// The ids of a succeeded job's output, in order, as `fake` stores them.
fn output_ids(fake: &FakeCluster, record: &JobRecord) -> Vec<i64> {
    column(&fake.batches(outputs(succeeded(record))), "id")
}

/// Column `name` of `batches`, in order.
fn column(batches: &[RecordBatch], name: &str) -> Vec<i64> {
    batches
        .iter()
        .flat_map(|batch| {
            let array = batch
                .column_by_name(name)
                .unwrap_or_else(|| panic!("no column {name}"));
            let array = arrow::compute::cast(array, &arrow::datatypes::DataType::Int64).unwrap();
            let values = array.as_any().downcast_ref::<Int64Array>().unwrap();
            assert_eq!(values.null_count(), 0);
            values.values().to_vec()
        })
        .collect()
}

fn stats<'a>(record: &'a JobRecord, operator: &str) -> &'a OperatorStats {
    let stats = record.stats.as_ref().expect("the job has stats");
    stats
        .operators
        .iter()
        .find(|stats| floe_core::job::stage_kind(&stats.name) == operator)
        .unwrap_or_else(|| panic!("no operator {operator} in {stats:?}"))
}

/// How many tasks `range(n)` runs (see `plan::range_tasks`).
fn range_task_count(n: u64) -> u64 {
    n.div_ceil(4 * u64::from(BATCH_ROWS))
}

fn is_map(task: &TaskView<'_>) -> bool {
    task.task.stage.kind.name() == "map"
}

/// `source.with_column("double", id * 2)`, whose rows `assert_doubled` checks.
fn doubled(source: LogicalPlan) -> LogicalPlan {
    source.with_column("double", col("id") * lit(2i64)).unwrap()
}

fn assert_doubled(fake: &FakeCluster, record: &JobRecord, n: i64) {
    let batches = fake.batches(outputs(record));
    assert_eq!(column(&batches, "id"), (0..n).collect::<Vec<_>>());
    assert_eq!(
        column(&batches, "double"),
        (0..n).map(|id| id * 2).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn a_job_yields_exactly_its_rows_and_frees_every_intermediate_block() {
    let fake = fake(2, 2);
    let record = run(&fake, &spec(doubled(stored_range(400)), CacheMode::NoCache)).await;
    assert_doubled(&fake, succeeded(&record), 400);
    // The range's blocks were freed once the map had read them; only the output is left.
    let outputs: BTreeSet<ObjectId> = outputs(&record).into_iter().collect();
    assert_eq!(fake.stored_objects(), outputs);
    let tasks = fake.tasks();
    let range_tasks: Vec<_> = tasks.iter().filter(|task| task.stage == "range").collect();
    assert_eq!(range_tasks.len() as u64, range_task_count(400));
    let freed: BTreeSet<ObjectId> = fake.freed().into_iter().collect();
    for task in range_tasks {
        assert!(task.outputs.iter().all(|object| freed.contains(object)));
    }
    assert!(freed.is_disjoint(&outputs));
    // Sources and maps of small blocks spread over the nodes, in leases the tasks reuse.
    let grants = fake.lease_grants();
    assert!(
        grants.len() < tasks.len(),
        "{} leases for {} tasks",
        grants.len(),
        tasks.len()
    );
    assert!(
        grants
            .iter()
            .all(|(request, _)| request.strategy == Strategy::Spread)
    );
    let nodes: BTreeSet<NodeId> = tasks.iter().map(|task| task.node).collect();
    assert_eq!(nodes.len(), 2);
    assert_no_leases_left(&fake, 2);
}

/// Every lease of the job was returned: the scheduler holds none and reserves nothing.
fn assert_no_leases_left(fake: &FakeCluster, nodes: u64) {
    assert_eq!(fake.leases_held(), 0);
    for node in 1..=nodes {
        if let Some(reserved) = fake.reserved(NodeId::new(node)) {
            assert_eq!(reserved, Resources::default(), "node {node}");
        }
    }
}

#[tokio::test]
async fn tasks_run_in_leases_that_are_reused_and_all_returned_when_the_job_ends() {
    let fake = fake(2, 2);
    let n = 64 * 4 * u64::from(BATCH_ROWS);
    let record = run(&fake, &spec(doubled(stored_range(n)), CacheMode::NoCache)).await;
    assert_doubled(&fake, succeeded(&record), i64::try_from(n).unwrap());
    let tasks = fake.tasks().len();
    let grants = fake.lease_grants();
    let (asks, _, returned) = fake.lease_calls();
    // 128 tasks ran in a handful of leases (4 CPUs), asked for in a handful of calls: the
    // scheduler was not asked per task.
    assert_eq!(tasks, 128);
    assert!(
        grants.len() <= 16,
        "{} leases for {tasks} tasks",
        grants.len()
    );
    assert!(asks <= 16, "{asks} asks for {tasks} tasks");
    // At most the 4 CPUs were leased at once, and every lease was given back by the driver
    // (idle, or at the job's end) rather than revoked by it.
    assert!(
        grants
            .iter()
            .all(|(_, lease)| lease.resources.cpu_millis == 1000)
    );
    assert_eq!(returned, grants.len() as u64);
    assert_no_leases_left(&fake, 2);
    // Every task's memory hint is the size of what it reads, and its lease holds that much.
    assert!(grants.iter().all(|(request, lease)| request.memory_hint > 0
        && lease.resources.heap_bytes == request.memory_hint));
}

#[tokio::test]
async fn a_lease_revoked_with_its_node_moves_its_tasks_to_the_other_nodes() {
    let fake = fake(3, 2);
    let doomed = NodeId::new(2);
    // The first map on node 2 finds its node dying under it (the rule matches once, so the
    // first task it matches is the one that died).
    let killed = Arc::new(std::sync::Mutex::new(None));
    let seen = Arc::clone(&killed);
    fake.on_tasks(
        1,
        move |task| {
            let hit = is_map(task) && task.node == doomed;
            if hit {
                seen.lock().unwrap().get_or_insert(task.id);
            }
            hit
        },
        Fault::KillNode,
    );
    let n = 32 * 4 * u64::from(BATCH_ROWS);
    let record = run(&fake, &spec(doubled(stored_range(n)), CacheMode::NoCache)).await;
    assert_doubled(&fake, succeeded(&record), i64::try_from(n).unwrap());
    let killed = killed.lock().unwrap().expect("a map ran on node 2");
    // The task that died with the node's lease ran again, on another node.
    let reruns: Vec<_> = fake
        .tasks()
        .into_iter()
        .filter(|task| task.task == killed)
        .collect();
    assert_eq!(reruns.len(), 1);
    assert_ne!(reruns[0].node, doomed);
    assert!(reruns[0].failure.is_none());
    // The job had leases there; they went with the node, and the rest went back at the end.
    assert!(
        fake.lease_grants()
            .iter()
            .any(|(_, lease)| lease.node == doomed)
    );
    assert_eq!(fake.reserved(doomed), None);
    assert_no_leases_left(&fake, 3);
}

#[tokio::test]
async fn two_jobs_at_once_share_the_cluster_and_the_later_one_is_not_starved() {
    let fake = fake(1, 2);
    // Every map takes a while, so the first job keeps both CPUs busy for over a second.
    fake.on_tasks(u32::MAX, is_map, Fault::Delay(Duration::from_millis(40)));
    let long = spec(
        doubled(stored_range(48 * 4 * u64::from(BATCH_ROWS))),
        CacheMode::NoCache,
    );
    let short = spec(
        doubled(stored_range(2 * 4 * u64::from(BATCH_ROWS))),
        CacheMode::NoCache,
    );
    let first = fake.submit(&long, DRIVER_NODE);
    let first_run = tokio::spawn(crate::drive(driver_config(), Arc::clone(&fake), first, 1));
    // The first job holds both CPUs before the second arrives.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let held: Vec<_> = fake
        .lease_grants()
        .iter()
        .map(|(_, lease)| lease.job)
        .collect();
    assert!(held.iter().all(|job| *job == first) && !held.is_empty());
    let second = fake.submit(&short, DRIVER_NODE);
    tokio::time::timeout(
        JOB_TIMEOUT,
        crate::drive(driver_config(), Arc::clone(&fake), second, 1),
    )
    .await
    .expect("the second job ended in time")
    .expect("the second driver committed its outcome");
    // The second job got a lease recalled from the first, and finished while the first runs.
    assert!(
        !first_run.is_finished(),
        "the second job waited for the first to end"
    );
    assert_doubled(
        &fake,
        succeeded(&fake.job(second)),
        2 * 4 * i64::from(BATCH_ROWS),
    );
    assert!(
        fake.lease_grants()
            .iter()
            .any(|(_, lease)| lease.job == second)
    );
    tokio::time::timeout(JOB_TIMEOUT, first_run)
        .await
        .expect("the first job ended in time")
        .unwrap()
        .unwrap();
    assert_doubled(
        &fake,
        succeeded(&fake.job(first)),
        48 * 4 * i64::from(BATCH_ROWS),
    );
    assert_no_leases_left(&fake, 1);
}

#[tokio::test]
async fn a_task_failing_transiently_runs_again_elsewhere_and_the_job_succeeds() {
    let fake = fake(2, 2);
    let flaky = TaskFailure::Transient {
        message: "the model server hiccuped".into(),
    };
    fake.on_tasks(2, is_map, Fault::Fail(flaky.clone()));
    let record = run(&fake, &spec(doubled(stored_range(200)), CacheMode::NoCache)).await;
    assert_doubled(&fake, succeeded(&record), 200);
    assert_eq!(stats(&record, "map").retries, 2);
    let tasks = fake.tasks();
    let failed: Vec<_> = tasks
        .iter()
        .filter(|task| task.failure.as_ref() == Some(&flaky))
        .collect();
    assert_eq!(failed.len(), 2);
    for failure in failed {
        // The same task (same id, so the same output ids), on the other node.
        let rerun = tasks
            .iter()
            .find(|task| task.task == failure.task && task.failure.is_none())
            .expect("the failed task ran again");
        assert_ne!(rerun.node, failure.node);
    }
    assert_eq!(fake.stored_objects().len(), record.outputs.len());
}

#[tokio::test]
async fn a_task_failing_past_the_retry_limit_fails_the_job_with_its_message() {
    let fake = fake(2, 2);
    let broken = TaskFailure::Transient {
        message: "the disk is on fire".into(),
    };
    fake.on_tasks(u32::MAX, is_map, Fault::Fail(broken));
    let mut spec = spec(doubled(stored_range(200)), CacheMode::NoCache);
    spec.options.max_task_retries = 2;
    let record = run(&fake, &spec).await;
    let JobStatus::Failed { message } = &record.status else {
        panic!("the job did not fail: {:?}", record.status);
    };
    assert_eq!(
        message,
        "map→with_column: a task failed 3 times; the last time: task error: the disk is on fire"
    );
    assert!(record.outputs.is_empty());
    // A failed job keeps nothing.
    assert_eq!(fake.stored_objects(), BTreeSet::new());
}

#[tokio::test]
async fn an_input_lost_with_its_node_is_rebuilt_under_the_same_task_id() {
    let fake = fake(3, 2);
    // The first map whose input is on a third node loses that node as it starts.
    fake.on_tasks(
        1,
        |task| {
            is_map(task)
                && task
                    .input_nodes
                    .iter()
                    .flatten()
                    .any(|node| *node != task.node && *node != DRIVER_NODE)
        },
        Fault::KillInputHolder { spare: DRIVER_NODE },
    );
    let record = run(&fake, &spec(doubled(stored_range(400)), CacheMode::NoCache)).await;
    assert_doubled(&fake, succeeded(&record), 400);
    assert!(stats(&record, "range").rebuilt >= 1);
    let tasks = fake.tasks();
    let lost = lost_input(&tasks).expect("a map lost its input");
    // The range task that made the lost block ran twice under one task id: the rebuilt
    // block has the lost block's object id.
    let mut runs_by_task: BTreeMap<_, Vec<NodeId>> = BTreeMap::new();
    for task in tasks.iter().filter(|task| task.stage == "range") {
        runs_by_task.entry(task.task).or_default().push(task.node);
    }
    let maker = tasks
        .iter()
        .find(|task| task.outputs.contains(&lost))
        .expect("a range task made the lost block");
    let runs = &runs_by_task[&maker.task];
    assert_eq!(runs.len(), 2, "ran on {runs:?}");
    assert_ne!(runs[0], runs[1]);
    let remade = tasks
        .iter()
        .filter(|task| task.task == maker.task)
        .all(|task| task.outputs.contains(&lost));
    assert!(remade, "the rebuilt block has another object id");
    let outputs: BTreeSet<ObjectId> = outputs(&record).into_iter().collect();
    assert_eq!(fake.stored_objects(), outputs);
}

/// Runs a sum of 320 ids over 7 keys with tiny target blocks: a partition per input bundle,
/// so several aggregators.
async fn run_small_groupby(fake: &Arc<FakeCluster>) -> Arc<JobRecord> {
    let plan = LogicalPlan::range(320)
        .unwrap()
        .with_column("k", col("id") % lit(7i64))
        .unwrap()
        .aggregate(&["k"], vec![Aggregation::of(AggFunction::Sum, "id")])
        .unwrap();
    run_with(fake, &spec(plan, CacheMode::NoCache), blocks_of(64)).await
}

/// The test driver's configuration with target blocks of `max_block_bytes` (64 bytes give a
/// shuffle a partition per input bundle).
fn blocks_of(max_block_bytes: u64) -> Arc<DriverConfig> {
    Arc::new(DriverConfig {
        max_block_bytes,
        ..(*driver_config()).clone()
    })
}

/// Each `k` of an aggregate's output with its `sum_id`.
fn sums_by_k(batches: &[RecordBatch]) -> BTreeMap<i64, i64> {
    column(batches, "k")
        .into_iter()
        .zip(column(batches, "sum_id"))
        .collect()
}

/// The sum of the `ids` of each `id % modulus`: what [`sums_by_k`] must read.
fn sums_of(ids: impl Iterator<Item = i64>, modulus: i64) -> BTreeMap<i64, i64> {
    let mut sums = BTreeMap::new();
    for id in ids {
        *sums.entry(id % modulus).or_default() += id;
    }
    sums
}

#[tokio::test]
async fn a_dead_aggregators_partitions_alone_are_pushed_to_its_replacement() {
    let fake = fake(3, 2);
    // The first reduce through an aggregator on another node than the driver's kills it.
    fake.on_tasks(
        1,
        |task| task.actor.is_some() && task.node != DRIVER_NODE,
        Fault::KillNode,
    );
    let record = run_small_groupby(&fake).await;
    succeeded(&record);
    let batches = fake.batches(outputs(&record));
    assert_eq!(sums_by_k(&batches), sums_of(0..320, 7));
    let aggregate = stats(&record, "aggregate");
    assert!(aggregate.aggregators_recreated >= 1, "{aggregate:?}");
    // Every replacement was pushed only the partitions its slot owns.
    let created = fake.created_actors();
    // Aggregators were placed (first and replacements) reserving nothing: their reduces run
    // as tasks, in the job's leases.
    let placed = fake.placements();
    assert_eq!(placed.len(), created.len());
    assert!(
        placed
            .iter()
            .all(|(request, _)| request.cpu_millis == 0 && request.memory_hint == 0)
    );
    let slots = created[0].slots;
    let replacements: Vec<_> = created.iter().skip(slots as usize).collect();
    assert!(!replacements.is_empty());
    let alive = fake.alive_nodes();
    assert_eq!(alive.len(), 2);
    assert!(replacements.iter().all(|actor| alive.contains(&actor.node)));
    let pushes = fake.pushes();
    let mut pushed_to_replacements = 0;
    for replacement in &replacements {
        for push in pushes.iter().filter(|push| push.actor == replacement.actor) {
            pushed_to_replacements += push.partitions.len();
            assert!(
                push.partitions
                    .iter()
                    .all(|partition| partition % slots == replacement.slot),
                "slot {} of {slots} was pushed {:?}",
                replacement.slot,
                push.partitions
            );
        }
    }
    assert!(pushed_to_replacements > 0);
    // Partitions of the aggregators that lived were reduced once, through them.
    let replaced: BTreeSet<u32> = replacements.iter().map(|actor| actor.slot).collect();
    let mut reduced: BTreeMap<u32, Vec<bool>> = BTreeMap::new();
    for task in fake.tasks() {
        if let (StageInput::Reduce { partition, .. }, None) = (task.input, &task.failure) {
            reduced
                .entry(partition)
                .or_default()
                .push(task.actor.is_some());
        }
    }
    for (partition, runs) in reduced {
        if !replaced.contains(&(partition % slots)) {
            assert_eq!(runs, [true], "partition {partition}'s reduces");
        }
    }
    let outputs: BTreeSet<ObjectId> = outputs(&record).into_iter().collect();
    assert_eq!(fake.stored_objects(), outputs);
}

#[tokio::test]
async fn sources_are_throttled_while_queued_bytes_exceed_the_budget() {
    // 1 KiB of budget: the stores hold 1 MiB in all and the job may keep a thousandth.
    let fake = Arc::new(FakeCluster::new(FakeConfig {
        nodes: 2,
        cpus_per_node: 1,
        store_bytes_per_node: 512_000,
    }));
    fake.on_tasks(u32::MAX, is_map, Fault::Delay(Duration::from_millis(3)));
    // 64 range tasks of 32 ids (256 bytes each); the map keeps one row in 64.
    let n = 64 * 4 * u64::from(BATCH_ROWS);
    let plan = stored_range(n)
        .filter((col("id") % lit(64i64)).eq(lit(0i64)))
        .unwrap();
    let mut spec = spec(plan, CacheMode::NoCache);
    spec.options.object_store_budget_permille = 1;
    let record = run(&fake, &spec).await;
    let batches = fake.batches(outputs(succeeded(&record)));
    let n = i64::try_from(n).unwrap();
    assert_eq!(
        column(&batches, "id"),
        (0..n).filter(|id| id % 64 == 0).collect::<Vec<_>>()
    );
    // Unthrottled, the range (whose tasks finish at once) would store all 16 KiB before the
    // slow maps read it. Throttled: the budget, plus a block per running source and per
    // running map, plus the small outputs.
    let block = 256;
    let outputs = 32 * 8;
    let bound = 1024 + 2 * block + 2 * block + outputs;
    assert!(
        fake.max_stored_bytes() <= bound,
        "{} bytes were stored at once, over {bound}",
        fake.max_stored_bytes()
    );
}

#[tokio::test]
async fn a_planned_cache_hit_loads_shards_instead_of_running_the_source() {
    let fake = fake(2, 2);
    // The map fuses into the range, whose output is cached shard by shard.
    let plan = doubled(LogicalPlan::range(200).unwrap());
    let first = run(&fake, &spec(plan.clone(), CacheMode::Reuse)).await;
    assert_doubled(&fake, succeeded(&first), 200);
    let range_runs = |fake: &FakeCluster| {
        fake.tasks()
            .iter()
            .filter(|task| task.stage == "range")
            .count()
    };
    let computed = range_runs(&fake);
    let shards = range_task_count(200);
    assert_eq!(computed as u64, shards);
    assert_eq!(stats(&first, "range").cache_misses, shards);

    let second = run(&fake, &spec(plan, CacheMode::Reuse)).await;
    assert_doubled(&fake, succeeded(&second), 200);
    assert_eq!(range_runs(&fake), computed, "the range ran again");
    assert_eq!(stats(&second, "range").cache_hits, shards);
    assert_eq!(stats(&second, "range").tasks, 0);
}

/// The `ForgetCacheShard` commands `fake` applied, as (rank, count).
fn forgotten(fake: &FakeCluster) -> Vec<(u32, u32)> {
    fake.commands()
        .iter()
        .filter_map(|(command, outcome)| match command {
            Command::ForgetCacheShard {
                rank, shard_count, ..
            } if *outcome == floe_api::state::Outcome::Applied => Some((*rank, *shard_count)),
            _ => None,
        })
        .collect()
}

fn range_runs(fake: &FakeCluster) -> usize {
    fake.tasks()
        .iter()
        .filter(|task| task.stage == "range" && task.failure.is_none())
        .count()
}

#[tokio::test]
async fn a_missing_source_shard_is_dropped_from_the_index_and_computed_in_its_place() {
    let fake = fake(2, 2);
    // The map fuses into the range, whose output is cached shard by shard.
    let plan = doubled(LogicalPlan::range(200).unwrap());
    let first = run(&fake, &spec(plan.clone(), CacheMode::Reuse)).await;
    succeeded(&first);
    let computed = range_runs(&fake);
    let shards = range_task_count(200);
    // The index still names shard 1; its file is gone.
    fake.delete_cache_rank(1);
    let record = run(&fake, &spec(plan.clone(), CacheMode::Reuse)).await;
    assert_doubled(&fake, succeeded(&record), 200);
    assert_eq!(forgotten(&fake), vec![(1, shards as u32)]);
    // Only the missing shard ran, in the same plan.
    assert_eq!(range_runs(&fake), computed + 1);
    assert_eq!(stats(&record, "range").tasks, 1);
    assert_eq!(stats(&record, "range").cache_hits, shards - 1);
    // It was written and indexed again: the next run computes nothing.
    let again = run(&fake, &spec(plan, CacheMode::Reuse)).await;
    assert_doubled(&fake, succeeded(&again), 200);
    assert_eq!(range_runs(&fake), computed + 1);
}

#[tokio::test]
async fn a_missing_shuffle_shard_makes_the_driver_forget_it_and_plan_again() {
    let fake = fake(2, 2);
    let sorted = |source: LogicalPlan| {
        source
            .sort(vec![floe_core::plan::SortKey::asc("id")])
            .unwrap()
    };
    let plan = sorted(doubled(LogicalPlan::range(200).unwrap()));
    let first = run(&fake, &spec(plan.clone(), CacheMode::Reuse)).await;
    succeeded(&first);
    let computed = range_runs(&fake);
    // Every file is gone (a `cache clean` the index did not hear of): the sort's output is
    // found missing, then the range's shards, which are computed in place.
    fake.delete_cache_files();
    let record = run(&fake, &spec(plan, CacheMode::Reuse)).await;
    assert_doubled(&fake, succeeded(&record), 200);
    assert!(!forgotten(&fake).is_empty());
    assert_eq!(range_runs(&fake), computed + range_task_count(200) as usize);
}

#[tokio::test]
async fn a_recompute_replaces_the_old_shards_instead_of_adding_to_them() {
    let fake = fake(3, 1);
    let plan = doubled(LogicalPlan::range(200).unwrap());
    let first = run(&fake, &spec(plan.clone(), CacheMode::Reuse)).await;
    succeeded(&first);
    let shards = range_task_count(200) as usize;
    assert_eq!(fake.cache_files(), shards);
    for _ in 0..3 {
        let record = run(&fake, &spec(plan.clone(), CacheMode::Recompute)).await;
        assert_doubled(&fake, succeeded(&record), 200);
        // Placement spreads the shards differently each time; old copies elsewhere go.
        assert_eq!(fake.cache_files(), shards);
    }
    let cache = fake.cache_index().await.unwrap();
    let entries: usize = cache
        .values()
        .flat_map(|by_count| by_count.values())
        .map(|entry| entry.shards.len())
        .sum();
    assert_eq!(entries, shards);
}

#[tokio::test]
async fn a_driver_reads_what_it_needs_however_many_jobs_the_cluster_ran() {
    let fake = fake(3, 2);
    fake.add_finished_jobs(20_000);
    // Slow tasks keep the job running for many progress ticks (10 ms each).
    fake.on_tasks(2, |_| true, Fault::Delay(Duration::from_millis(150)));
    let plan = stored_range(u64::from(BATCH_ROWS) * 16)
        .filter(col("id").gt(lit(3i64)))
        .unwrap();
    let record = run(&fake, &spec(plan, CacheMode::NoCache)).await;
    succeeded(&record);
    let reads = fake.scheduler_reads();
    // Each tick asks only for deaths since the last one; the job is read once, the cache
    // index not at all (the job does not use the cache), the nodes three times (the budget
    // and spill count at the start, the outputs' holders and the spill count at the end).
    assert!(reads.death_checks >= 5, "{reads:?}");
    assert_eq!(reads.jobs, 1, "{reads:?}");
    assert_eq!(reads.cache_indexes, 0, "{reads:?}");
    assert_eq!(reads.node_lists, 3, "{reads:?}");
    // No answer carried more than the three nodes: the 20,000 finished jobs were never read.
    assert!(reads.largest_answer <= 3, "{reads:?}");
}

#[tokio::test]
async fn a_job_shorter_than_a_progress_interval_reads_the_cluster_only_to_start_and_end() {
    let fake = fake(3, 2);
    let mut config = (*driver_config()).clone();
    config.progress_interval = Duration::from_secs(3600);
    let plan = LogicalPlan::range(10).unwrap();
    let record = run_with(&fake, &spec(plan, CacheMode::NoCache), Arc::new(config)).await;
    assert_eq!(output_ids(&fake, &record), (0..10).collect::<Vec<_>>());
    let reads = fake.scheduler_reads();
    // No progress tick came: nothing reported, no deaths asked for.
    assert!(fake.progress_reports().is_empty());
    assert_eq!(reads.death_checks, 0, "{reads:?}");
    assert_eq!(reads.jobs, 1, "{reads:?}");
    assert_eq!(reads.cache_indexes, 0, "{reads:?}");
    // The nodes are read to size the budget (which also counts the spill so far), to check
    // the output's holder, and to count the spill at the end.
    assert_eq!(reads.node_lists, 3, "{reads:?}");
    // Each of the three nodes is asked for its status once at each end, and the output's one
    // holder once more.
    assert_eq!(fake.node_statuses(), 3 + 1 + 3);
}

#[tokio::test]
async fn a_job_that_reuses_the_cache_reads_its_index_and_others_do_not() {
    let fake = fake(2, 2);
    let plan = doubled(LogicalPlan::range(64).unwrap());
    for (cache, index_reads) in [
        (CacheMode::NoCache, 0),
        (CacheMode::Recompute, 0),
        (CacheMode::Reuse, 1),
    ] {
        let before = fake.scheduler_reads().cache_indexes;
        let record = run(&fake, &spec(plan.clone(), cache)).await;
        assert_doubled(&fake, succeeded(&record), 64);
        let reads = fake.scheduler_reads();
        assert_eq!(
            reads.cache_indexes - before,
            index_reads,
            "{cache:?}: {reads:?}"
        );
    }
}

#[tokio::test]
async fn a_later_attempt_frees_what_the_dead_attempt_left_on_the_other_nodes() {
    let fake = fake(3, 2);
    let plan = stored_range(u64::from(BATCH_ROWS) * 8);
    let job = fake.submit(&spec(plan, CacheMode::NoCache), NodeId::new(2));
    // Attempt 1 made blocks on nodes 1 and 3, then its driver died with node 2.
    let orphans = [ObjectId::new(7), ObjectId::new(8)];
    fake.store_block(job, DRIVER_NODE, orphans[0]);
    fake.store_block(job, NodeId::new(3), orphans[1]);
    let other_job = ObjectId::new(9);
    fake.store_block(floe_core::JobId::new(99), NodeId::new(3), other_job);
    fake.restart_driver(job, NodeId::new(2), DRIVER_NODE);
    tokio::time::timeout(
        JOB_TIMEOUT,
        crate::drive(driver_config(), Arc::clone(&fake), job, 2),
    )
    .await
    .expect("the job ended in time")
    .expect("the driver committed the outcome");
    let record = fake.job(job);
    succeeded(&record);
    let stored = fake.stored_objects();
    assert!(
        orphans.iter().all(|object| !stored.contains(object)),
        "{stored:?}"
    );
    assert!(stored.contains(&other_job), "another job's block was freed");
    assert!(
        outputs(&record)
            .iter()
            .all(|object| stored.contains(object))
    );
}

/// `plan` written as Parquet into `directory` with `mode`.
fn written(plan: LogicalPlan, directory: &std::path::Path, mode: WriteMode) -> LogicalPlan {
    plan.write(WriteSpec {
        format: FileFormat::Parquet,
        directory: directory.to_owned(),
        target_file_size: DEFAULT_TARGET_FILE_SIZE,
        mode,
        compression: Compression::Zstd,
        partition_by: Vec::new(),
    })
    .unwrap()
}

/// The visible files of `directory` and the rows in them.
fn files_and_rows(directory: &std::path::Path) -> (Vec<String>, usize) {
    let mut names: Vec<String> = std::fs::read_dir(directory)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let rows = names
        .iter()
        .map(|name| {
            let file = std::fs::File::open(directory.join(name)).unwrap();
            let reader =
                parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
                    .unwrap()
                    .build()
                    .unwrap();
            reader.map(|batch| batch.unwrap().num_rows()).sum::<usize>()
        })
        .sum();
    (names, rows)
}

#[tokio::test]
async fn adding_a_sink_to_a_cached_pipeline_loads_its_result() {
    let fake = fake(2, 2);
    let plan = doubled(LogicalPlan::range(200).unwrap());
    succeeded(&*run(&fake, &spec(plan.clone(), CacheMode::Reuse)).await);
    let computed = fake.tasks().len();
    let out = tempfile::tempdir().unwrap();
    let target = out.path().join("doubled");
    let sunk = written(plan, &target, WriteMode::Error);
    let record = run(&fake, &spec(sunk, CacheMode::Reuse)).await;
    succeeded(&record);
    let ran_range = fake.tasks()[computed..]
        .iter()
        .filter(|task| task.stage == "range")
        .count();
    assert_eq!(ran_range, 0, "the range ran again under the sink");
    assert_eq!(stats(&record, "range").cache_hits, range_task_count(200));
    assert_eq!(files_and_rows(&target).1, 200);
}

#[tokio::test]
async fn write_modes_refuse_replace_or_add_to_an_earlier_output() {
    let fake = fake(2, 2);
    let out = tempfile::tempdir().unwrap();
    let target = out.path().join("out");
    let job = |n: u64, mode: WriteMode| {
        spec(
            written(LogicalPlan::range(n).unwrap(), &target, mode),
            CacheMode::NoCache,
        )
    };
    succeeded(&*run(&fake, &job(200, WriteMode::Error)).await);
    let (first_files, rows) = files_and_rows(&target);
    assert_eq!(rows, 200);
    assert_eq!(first_files.len() as u64, range_task_count(200));

    // `error`: refused, and the directory is as it was.
    let refused = run(&fake, &job(10, WriteMode::Error)).await;
    let JobStatus::Failed { message } = &refused.status else {
        panic!("not refused: {:?}", refused.status);
    };
    assert!(message.contains("already holds files"), "{message}");
    assert_eq!(files_and_rows(&target), (first_files.clone(), 200));

    // `overwrite` with fewer partitions: exactly the new rows, no stale file.
    succeeded(&*run(&fake, &job(10, WriteMode::Overwrite)).await);
    let (files, rows) = files_and_rows(&target);
    assert_eq!((files.len(), rows), (1, 10), "{files:?}");

    // `append`: both runs' rows, under new names.
    succeeded(&*run(&fake, &job(20, WriteMode::Append)).await);
    let (files, rows) = files_and_rows(&target);
    assert_eq!((files.len(), rows), (2, 30), "{files:?}");
    // Nothing staged is left beside the directory.
    let beside: Vec<_> = std::fs::read_dir(out.path()).unwrap().collect();
    assert_eq!(beside.len(), 1);
}

#[tokio::test]
async fn six_rows_sort_in_one_partition_and_write_one_file() {
    let fake = fake(2, 2);
    let out = tempfile::tempdir().unwrap();
    let target = out.path().join("sorted");
    // Six rows in three stored bundles.
    let rows = LogicalPlan::range(6)
        .unwrap()
        .repartition(3, &[])
        .unwrap()
        .sort(vec![SortKey::desc("id")])
        .unwrap();
    let record = run(
        &fake,
        &spec(written(rows, &target, WriteMode::Error), CacheMode::NoCache),
    )
    .await;
    succeeded(&record);
    let reduces = fake
        .tasks()
        .iter()
        .filter(|task| task.stage == "sort" && matches!(task.input, StageInput::Reduce { .. }))
        .count();
    assert_eq!(reduces, 1);
    let (files, rows) = files_and_rows(&target);
    assert_eq!((files.len(), rows), (1, 6), "{files:?}");
}

/// The ids in the Parquet files of `directory`, in file-name order.
fn written_ids(directory: &std::path::Path) -> Vec<i64> {
    let (names, _) = files_and_rows(directory);
    let mut ids = Vec::new();
    for name in names {
        let file = std::fs::File::open(directory.join(name)).unwrap();
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
            .unwrap()
            .build()
            .unwrap();
        let batches: Vec<RecordBatch> = reader.map(Result::unwrap).collect();
        ids.extend(column(&batches, "id"));
    }
    ids
}

#[tokio::test]
async fn without_caching_a_sorts_reduces_write_the_sink_and_store_no_rows() {
    let fake = fake(2, 2);
    let n = 500;
    let out = tempfile::tempdir().unwrap();
    let target = out.path().join("sorted");
    let (plan, config) = shuffled_sort(n);
    let sunk = written(plan.clone(), &target, WriteMode::Error);
    let record = run_with(&fake, &spec(sunk, CacheMode::NoCache), config.clone()).await;
    let stats = succeeded(&record).stats.as_ref().unwrap();
    let fused = stats
        .operators
        .iter()
        .find(|op| op.name == "sort→write")
        .unwrap_or_else(|| panic!("no fused operator: {stats:?}"));
    // Its rows are the rows its tasks wrote: none came back as blocks.
    assert_eq!(fused.rows, n);
    let tasks = fake.tasks();
    assert!(
        !tasks.iter().any(|task| task.stage == "write"),
        "a write task ran"
    );
    let reduces: Vec<_> = tasks
        .iter()
        .filter(|task| matches!(task.input, StageInput::Reduce { .. }))
        .collect();
    assert!(reduces.len() > 1, "one partition: {}", reduces.len());
    assert!(reduces.iter().all(|task| task.outputs.is_empty()));
    // One file per reduce, named in partition order: read in name order, the rows are sorted.
    assert_eq!(written_ids(&target), expected_sort(n as i64));
    assert!(outputs(&record).is_empty());

    // Cached, the sort's output is kept as blocks (its shards) and the sink runs apart.
    let cached_target = out.path().join("cached");
    let sunk = written(plan, &cached_target, WriteMode::Error);
    let before = fake.tasks().len();
    let record = run_with(&fake, &spec(sunk, CacheMode::Reuse), config).await;
    let stats = succeeded(&record).stats.as_ref().unwrap();
    let write = stats.operators.iter().find(|op| op.name == "write");
    assert_eq!(write.map(|op| op.rows), Some(n), "{stats:?}");
    assert!(
        fake.tasks()[before..]
            .iter()
            .any(|task| task.stage == "write")
    );
    assert_eq!(written_ids(&cached_target), expected_sort(n as i64));
}

#[tokio::test]
async fn a_sink_outside_the_allowed_paths_is_refused_before_any_task() {
    let fake = fake(1, 2);
    let allowed = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let config = Arc::new(DriverConfig {
        allowed_paths: floe_core::config::AllowedPaths::under(&[allowed.path().to_owned()]),
        ..(*driver_config()).clone()
    });
    let target = elsewhere.path().join("out");
    let plan = written(
        LogicalPlan::range(10).unwrap(),
        &target,
        WriteMode::Overwrite,
    );
    let record = run_with(&fake, &spec(plan, CacheMode::NoCache), config).await;
    let JobStatus::Failed { message } = &record.status else {
        panic!("not refused: {:?}", record.status);
    };
    assert!(message.contains("outside data.allowed_paths"), "{message}");
    assert!(fake.tasks().is_empty());
    assert!(!target.exists());
}

#[tokio::test]
async fn progress_counts_rows_as_tasks_finish_under_the_fused_name() {
    let fake = fake(1, 1);
    // Slow tasks, one at a time: several progress ticks (10 ms each) fall between two ends.
    fake.on_tasks(u32::MAX, |_| true, Fault::Delay(Duration::from_millis(15)));
    let n = 16 * 4 * u64::from(BATCH_ROWS);
    let plan = LogicalPlan::range(n)
        .unwrap()
        .filter(col("id").gt_eq(lit(0i64)))
        .unwrap();
    let record = run(&fake, &spec(doubled(plan), CacheMode::NoCache)).await;
    let stats = succeeded(&record).stats.as_ref().unwrap();
    assert_eq!(stats.operators.len(), 1, "{stats:?}");
    let name = &stats.operators[0].name;
    assert_eq!(name, "range→filter→with_column", "fused steps are named");
    assert_eq!(stats.operators[0].rows, n);

    let reports: Vec<_> = fake
        .progress_reports()
        .into_iter()
        .map(|progress| progress.operators[0].clone())
        .collect();
    assert!(reports.iter().all(|operator| &operator.name == name));
    // Each finished range task made 4 × BATCH_ROWS rows; a report counts them as they finish.
    for operator in &reports {
        assert_eq!(
            operator.rows_done,
            operator.tasks_done * 4 * u64::from(BATCH_ROWS),
            "{operator:?}"
        );
    }
    assert!(
        reports
            .iter()
            .any(|operator| operator.rows_done > 0 && operator.rows_done < n),
        "no report while the job ran: {reports:?}"
    );
}

#[tokio::test]
async fn progress_counts_every_aggregators_calls_while_the_reduce_runs() {
    let fake = fake(2, 2);
    // Slow reduces: several progress ticks (10 ms each) fall inside them.
    fake.on_tasks(
        u32::MAX,
        |task| task.actor.is_some(),
        Fault::Delay(Duration::from_millis(30)),
    );
    let record = run_small_groupby(&fake).await;
    succeeded(&record);
    let created: BTreeSet<ActorId> = fake
        .created_actors()
        .iter()
        .map(|actor| actor.actor)
        .collect();
    assert!(created.len() > 1, "{created:?}");
    let reports = fake.progress_reports();
    // Each report lists only the job's aggregators; one taken while the reduces ran lists
    // every one that owns partitions, each counted at least the push of its shards.
    assert!(reports.iter().all(|progress| {
        progress
            .actors
            .iter()
            .all(|actor| created.contains(&actor.actor))
    }));
    assert!(
        reports.iter().any(|progress| {
            progress.actors.len() > 1
                && progress
                    .actors
                    .iter()
                    .all(|actor| actor.calls >= 1 && actor.restarts == 0)
        }),
        "{:?}",
        reports
            .iter()
            .map(|progress| &progress.actors)
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn a_streamed_output_is_held_back_while_unread_and_freed_as_it_is_acknowledged() {
    let fake = fake(2, 2);
    let config = driver_config();
    let n = 40 * 4 * u64::from(BATCH_ROWS);
    let spec = JobSpec {
        plan: LogicalPlan::range(n).unwrap(),
        options: JobOptions {
            cache: CacheMode::NoCache,
            // One unacknowledged block stops the output operator.
            result: floe_core::job::ResultDelivery::Streamed { buffer_bytes: 1 },
            ..JobOptions::default()
        },
    };
    let job = fake.submit(&spec, DRIVER_NODE);
    let driver = tokio::spawn(crate::drive(Arc::clone(&config), Arc::clone(&fake), job, 1));
    let wait = Duration::from_millis(200);
    let mut ids = Vec::new();
    let mut from = 0u64;
    let mut most_unread = 0usize;
    loop {
        let Some(answer) = config.streams.next(job, 1, from, wait).await.unwrap() else {
            // The driver has not opened its stream yet.
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        // Unread outputs still stored: bounded by what was running when the buffer filled.
        let stored = fake.stored_objects();
        most_unread = most_unread.max(
            answer
                .blocks
                .iter()
                .filter(|b| stored.contains(&b.object))
                .count(),
        );
        for block in &answer.blocks {
            ids.extend(column(&fake.batches([block.object]), "id"));
        }
        from += answer.blocks.len() as u64;
        if answer.end.is_some() {
            assert_eq!(
                answer.end,
                Some(floe_api::node_protocol::StreamEnd::Complete)
            );
            break;
        }
    }
    tokio::time::timeout(JOB_TIMEOUT, driver)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(ids, (0..i64::try_from(n).unwrap()).collect::<Vec<_>>());
    // Four CPUs: at most the tasks running when the buffer filled, and the one that filled
    // it, each of 4 blocks (one per reader batch), out of 160.
    assert!(
        most_unread <= 5 * 4,
        "{most_unread} blocks waited unread at once"
    );
    let record = succeeded(&fake.job(job)).clone();
    assert!(record.outputs.is_empty(), "{:?}", record.outputs);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        fake.stored_objects().is_empty(),
        "{:?}",
        fake.stored_objects()
    );
    assert!(config.streams.is_empty());
}

/// `range(n)` sorted by `k = (id * 7919) % 1009` descending, then `id`, with blocks small
/// enough that the sort runs several map tasks and partitions.
fn shuffled_sort(n: u64) -> (LogicalPlan, Arc<DriverConfig>) {
    let plan = stored_range(n)
        .with_column("k", (col("id") * lit(7919i64)) % lit(1009i64))
        .unwrap()
        .sort(vec![SortKey::desc("k"), SortKey::asc("id")])
        .unwrap();
    let config = Arc::new(DriverConfig {
        max_block_bytes: 256,
        ..(*driver_config()).clone()
    });
    (plan, config)
}

/// The rows of [`shuffled_sort`], computed here.
fn expected_sort(n: i64) -> Vec<i64> {
    let mut ids: Vec<i64> = (0..n).collect();
    ids.sort_by_key(|id| (std::cmp::Reverse((id * 7919) % 1009), *id));
    ids
}

/// Runs [`shuffled_sort`] of `n` rows uncached, and checks that it succeeds with every row in
/// [`expected_sort`]'s order.
async fn run_exact_sort(fake: &Arc<FakeCluster>, n: u64) -> Arc<JobRecord> {
    let (plan, config) = shuffled_sort(n);
    let record = run_with(fake, &spec(plan, CacheMode::NoCache), config).await;
    succeeded(&record);
    let batches = fake.batches(outputs(&record));
    assert_eq!(column(&batches, "id"), expected_sort(n as i64));
    record
}

fn is_map_side(task: &crate::cluster::fake::RanTask) -> bool {
    matches!(
        task.input,
        StageInput::RangePartition { .. } | StageInput::Partition { .. }
    )
}

#[tokio::test]
async fn a_sort_samples_each_nodes_blocks_where_they_lie() {
    let fake = fake(2, 2);
    run_exact_sort(&fake, 600).await;
    let tasks = fake.tasks();
    let samples: Vec<_> = tasks
        .iter()
        .filter(|task| matches!(task.input, StageInput::Sample { .. }))
        .collect();
    let sampled_nodes: BTreeSet<NodeId> = samples
        .iter()
        .flat_map(|task| task.input_nodes.iter().flatten().copied())
        .collect();
    assert_eq!(sampled_nodes.len(), 2, "the blocks lay on both nodes");
    for sample in samples {
        // Every input on one node, which placement prefers: placed there, the task pulls
        // nothing to be sampled.
        let nodes: BTreeSet<Option<NodeId>> = sample.input_nodes.iter().copied().collect();
        assert!(nodes.len() == 1 && !nodes.contains(&None), "{sample:?}");
    }
}

/// With at most four input bundles per CPU, each map task takes one bundle and runs where it
/// lies: a shuffle's map side pulls nothing.
#[tokio::test]
async fn a_shuffle_of_a_few_bundles_per_cpu_maps_each_bundle_where_it_lies() {
    // Sixteen range tasks (four bundles per CPU), spread over both nodes.
    let n = 16 * 4 * u64::from(BATCH_ROWS);
    let shuffles = [
        (
            "random_shuffle",
            stored_range(n).random_shuffle(Some(3)).unwrap(),
        ),
        (
            "sort",
            stored_range(n).sort(vec![SortKey::desc("id")]).unwrap(),
        ),
    ];
    for (name, plan) in shuffles {
        let fake = fake(2, 2);
        let record = run(&fake, &spec(plan, CacheMode::NoCache)).await;
        succeeded(&record);
        let mut ids = column(&fake.batches(outputs(&record)), "id");
        if name == "random_shuffle" {
            ids.sort_unstable();
            assert_eq!(ids, (0..n as i64).collect::<Vec<_>>(), "{name}");
        } else {
            assert_eq!(ids, (0..n as i64).rev().collect::<Vec<_>>(), "{name}");
        }
        let tasks = fake.tasks();
        let maps: Vec<_> = tasks.iter().filter(|task| is_map_side(task)).collect();
        assert_eq!(maps.len(), 16, "{name}");
        let mut nodes = BTreeSet::new();
        for map in maps {
            // A sort's map task also reads the boundaries, its last input, from wherever
            // they were made.
            let bundle = match map.input {
                StageInput::RangePartition { .. } => &map.input_nodes[..map.input_nodes.len() - 1],
                _ => &map.input_nodes[..],
            };
            assert!(
                !bundle.is_empty() && bundle.iter().all(|node| *node == Some(map.node)),
                "{name}: {map:?}"
            );
            nodes.insert(map.node);
        }
        assert_eq!(nodes.len(), 2, "{name}: the bundles lay on both nodes");
    }
}

#[tokio::test]
async fn a_shuffle_makes_one_object_per_map_task_freed_once_every_partition_was_read() {
    let fake = fake(2, 2);
    let record = run_exact_sort(&fake, 600).await;
    let tasks = fake.tasks();
    let maps: Vec<_> = tasks.iter().filter(|task| is_map_side(task)).collect();
    let reduces = tasks
        .iter()
        .filter(|task| matches!(task.input, StageInput::Reduce { .. }))
        .count();
    assert!(
        maps.len() > 1 && reduces > 1,
        "{} maps, {reduces} reduces",
        maps.len()
    );
    // One object per map task, however many partitions it split its rows into.
    assert!(maps.iter().all(|task| task.outputs.len() == 1));
    // Each freed once, after the last reduce read its part: only the output is left.
    let freed = fake.freed();
    for map in &maps {
        let times = freed
            .iter()
            .filter(|object| **object == map.outputs[0])
            .count();
        assert_eq!(times, 1, "a map task's object was freed {times} times");
    }
    let outputs: BTreeSet<ObjectId> = outputs(&record).into_iter().collect();
    assert_eq!(fake.stored_objects(), outputs);
}

#[tokio::test]
async fn a_skewed_shuffles_map_objects_are_freed_once_read_not_at_the_jobs_end() {
    let fake = fake(2, 2);
    // Every map takes a while, so the maps after the sort run on well after its last reduce.
    fake.on_tasks(u32::MAX, is_map, Fault::Delay(Duration::from_millis(40)));
    let n: i64 = 200_000;
    // k = id for one row in ten, else 0: sorted by k alone, one partition holds nine rows in
    // ten (over 1 MiB, many times the median), which its reduce and the hot-key task read.
    let plan = stored_range(n as u64)
        .with_column(
            "k",
            when((col("id") % lit(10i64)).eq(lit(9i64)), col("id"), lit(0i64)),
        )
        .unwrap()
        .sort(vec![SortKey::asc("k")])
        .unwrap()
        .cache()
        .unwrap()
        .with_column("double", col("id") * lit(2i64))
        .unwrap();
    let config = Arc::new(DriverConfig {
        max_block_bytes: 64 << 10,
        ..(*driver_config()).clone()
    });
    let job = fake.submit(&spec(plan, CacheMode::NoCache), DRIVER_NODE);
    let driver = tokio::spawn(crate::drive(Arc::clone(&config), Arc::clone(&fake), job, 1));
    // The maps that had finished when the last map object was freed.
    let mut maps_finished_at_free = None;
    while !driver.is_finished() {
        let tasks = fake.tasks();
        let map_objects: Vec<ObjectId> = tasks
            .iter()
            .filter(|task| is_map_side(task))
            .flat_map(|task| task.outputs.iter().copied())
            .collect();
        let stored = fake.stored_objects();
        let reduced = tasks
            .iter()
            .any(|task| matches!(task.input, StageInput::Reduce { .. }));
        if reduced && map_objects.iter().all(|object| !stored.contains(object)) {
            maps_finished_at_free = Some(tasks.iter().filter(|task| task.stage == "map").count());
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tokio::time::timeout(JOB_TIMEOUT, driver)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let record = fake.job(job);
    succeeded(&record);
    assert!(
        stats(&record, "sort").hot_key.is_some(),
        "the sort found no skewed partition: {:?}",
        stats(&record, "sort")
    );
    let batches = fake.batches(outputs(&record));
    let mut want: Vec<(i64, i64)> = (0..n)
        .map(|id| (if id % 10 == 9 { id } else { 0 }, id))
        .collect();
    want.sort_unstable();
    let mut got: Vec<(i64, i64)> = column(&batches, "k")
        .into_iter()
        .zip(column(&batches, "id"))
        .collect();
    let keys: Vec<i64> = got.iter().map(|(k, _)| *k).collect();
    assert!(keys.is_sorted(), "the rows are not in key order");
    got.sort_unstable();
    assert_eq!(got, want);
    assert_eq!(
        column(&batches, "double"),
        column(&batches, "id")
            .iter()
            .map(|id| id * 2)
            .collect::<Vec<_>>()
    );
    // The map objects went while maps after the sort were still to finish.
    let maps = fake
        .tasks()
        .iter()
        .filter(|task| task.stage == "map")
        .count();
    let at_free =
        maps_finished_at_free.expect("the map objects were never freed while the job ran");
    assert!(at_free < maps, "freed after {at_free} of {maps} maps");
    let outputs: BTreeSet<ObjectId> = outputs(&record).into_iter().collect();
    assert_eq!(fake.stored_objects(), outputs);
}

#[tokio::test]
async fn a_map_object_lost_with_its_node_is_rebuilt_and_the_sort_stays_exact() {
    let fake = fake(3, 2);
    lose_a_map_object_to_a_reduce(&fake, |task| {
        matches!(task.task.input, StageInput::RangePartition { .. })
    });
    let record = run_exact_sort(&fake, 600).await;
    assert!(
        stats(&record, "sort").rebuilt >= 1,
        "{:?}",
        stats(&record, "sort")
    );
    // The rebuilt map task ran under its task id again, so its object kept its id.
    let tasks = fake.tasks();
    assert!(
        makers_of_the_lost_input(&tasks).len() >= 2,
        "the lost object was not made again"
    );
    let outputs: BTreeSet<ObjectId> = outputs(&record).into_iter().collect();
    assert_eq!(fake.stored_objects(), outputs);
}

/// Map tasks for which `is_map` holds take a while, so they run side by side, in leases on
/// every node (tasks that end at once could all run in the two CPUs of one node's lease); the
/// first reduce that reads a map task's object on a third node loses that node.
fn lose_a_map_object_to_a_reduce(
    fake: &FakeCluster,
    is_map: impl Fn(&TaskView<'_>) -> bool + Send + 'static,
) {
    fake.on_tasks(u32::MAX, is_map, Fault::Delay(Duration::from_millis(20)));
    fake.on_tasks(
        1,
        |task| {
            matches!(task.task.input, StageInput::Reduce { .. })
                && task
                    .input_nodes
                    .iter()
                    .flatten()
                    .any(|node| *node != task.node && *node != DRIVER_NODE)
        },
        Fault::KillInputHolder { spare: DRIVER_NODE },
    );
}

/// The runs of the map task that made the input a reduce found lost.
fn makers_of_the_lost_input(
    tasks: &[crate::cluster::fake::RanTask],
) -> Vec<&crate::cluster::fake::RanTask> {
    let lost = lost_input(tasks).expect("a reduce lost an input");
    tasks
        .iter()
        .filter(|task| is_map_side(task) && task.outputs.contains(&lost))
        .collect()
}

#[tokio::test]
async fn a_reduce_output_lost_after_its_inputs_were_freed_is_rebuilt_from_rebuilt_maps() {
    let fake = fake(3, 2);
    // A late reduce on a node other than the driver's kills that node: the reduces that
    // finished there lost their outputs, and the map objects they read were freed.
    fake.on_tasks(
        1,
        |task| {
            matches!(task.task.input, StageInput::Reduce { partition, .. } if partition >= 8)
                && task.node != DRIVER_NODE
        },
        Fault::KillNode,
    );
    // Slow reduces fill the driver's node, so the others take some.
    fake.on_tasks(
        u32::MAX,
        |task| matches!(task.task.input, StageInput::Reduce { .. }),
        Fault::Delay(Duration::from_millis(30)),
    );
    let record = run_exact_sort(&fake, 600).await;
    // Some reduce ran again after its first run had succeeded, and some map ran again for it.
    let tasks = fake.tasks();
    let reduces_done: Vec<u32> = tasks
        .iter()
        .filter(|task| task.failure.is_none())
        .filter_map(|task| match task.input {
            StageInput::Reduce { partition, .. } => Some(partition),
            _ => None,
        })
        .collect();
    for task in &tasks {
        eprintln!(
            "{} {:?} {:?} out={}",
            task.node,
            task.input,
            task.failure,
            task.outputs.len()
        );
    }
    let unique: BTreeSet<u32> = reduces_done.iter().copied().collect();
    assert!(
        unique.len() < reduces_done.len(),
        "no reduce output was rebuilt"
    );
    assert!(
        stats(&record, "sort").rebuilt >= 2,
        "{:?}",
        stats(&record, "sort")
    );
    let outputs: BTreeSet<ObjectId> = outputs(&record).into_iter().collect();
    assert_eq!(fake.stored_objects(), outputs);
}

/// What a job's shuffle made: its map tasks, the partitions each split its rows into, and the
/// objects its map tasks made.
struct ShuffleCounts {
    maps: usize,
    partitions: usize,
    map_objects: usize,
}

fn shuffle_counts(fake: &FakeCluster) -> ShuffleCounts {
    let tasks = fake.tasks();
    let maps: Vec<_> = tasks.iter().filter(|task| is_map_side(task)).collect();
    let partitions = maps
        .iter()
        .map(|task| match task.input {
            StageInput::Partition { partitions, .. }
            | StageInput::RangePartition { partitions } => partitions as usize,
            _ => 0,
        })
        .max()
        .unwrap_or(0);
    ShuffleCounts {
        maps: maps.len(),
        partitions,
        map_objects: maps.iter().map(|task| task.outputs.len()).sum(),
    }
}

#[tokio::test]
async fn every_shuffle_makes_objects_in_proportion_to_its_tasks_not_maps_times_partitions() {
    let n: i64 = 2_000;
    let small = Arc::new(DriverConfig {
        max_block_bytes: 512,
        ..(*driver_config()).clone()
    });
    let keyed = || {
        stored_range(n as u64)
            .with_column("k", col("id") % lit(13i64))
            .unwrap()
    };
    let shuffles = [
        ("hash repartition", keyed().repartition(8, &["k"]).unwrap()),
        ("random_shuffle", keyed().random_shuffle(Some(7)).unwrap()),
        (
            "sort",
            keyed()
                .sort(vec![SortKey::asc("k"), SortKey::desc("id")])
                .unwrap(),
        ),
        (
            "groupby",
            keyed()
                .aggregate(&["k"], vec![Aggregation::of(AggFunction::Sum, "id")])
                .unwrap(),
        ),
    ];
    for (name, plan) in shuffles {
        let fake = fake(2, 2);
        let record = run_with(&fake, &spec(plan, CacheMode::NoCache), Arc::clone(&small)).await;
        succeeded(&record);
        let batches = fake.batches(outputs(&record));
        // Checked against the rows computed here.
        match name {
            "groupby" => {
                assert_eq!(sums_by_k(&batches), sums_of(0..n, 13), "{name}");
            }
            "sort" => {
                let mut want: Vec<i64> = (0..n).collect();
                want.sort_by_key(|id| (id % 13, std::cmp::Reverse(*id)));
                assert_eq!(column(&batches, "id"), want, "{name}");
            }
            _ => {
                let mut got = column(&batches, "id");
                got.sort_unstable();
                assert_eq!(got, (0..n).collect::<Vec<_>>(), "{name}");
            }
        }
        let counts = shuffle_counts(&fake);
        assert!(
            counts.maps > 2 && counts.partitions > 2,
            "{name}: {} maps into {} partitions",
            counts.maps,
            counts.partitions
        );
        // The map side made one object per map task, not one per map task and partition.
        assert_eq!(counts.map_objects, counts.maps, "{name}");
        // A hash shuffle pushes each map task's shards in one call per aggregator.
        let pushes = fake.pushes().len();
        let aggregators = fake.created_actors().len();
        assert!(
            pushes <= counts.maps * aggregators.max(1),
            "{name}: {pushes} pushes"
        );
        // Each map task's object is freed once, and only the output is left.
        let freed = fake.freed();
        for map in fake.tasks().iter().filter(|task| is_map_side(task)) {
            let times = freed
                .iter()
                .filter(|object| **object == map.outputs[0])
                .count();
            assert_eq!(
                times, 1,
                "{name}: a map task's object was freed {times} times"
            );
        }
        let outputs: BTreeSet<ObjectId> = outputs(&record).into_iter().collect();
        assert_eq!(fake.stored_objects(), outputs, "{name}");
    }
}

/// The object the first task that lost an input found missing.
fn lost_input(tasks: &[crate::cluster::fake::RanTask]) -> Option<ObjectId> {
    tasks.iter().find_map(|task| match &task.failure {
        Some(TaskFailure::InputUnavailable { object, .. }) => Some(*object),
        _ => None,
    })
}

/// The names of the operators the job ran, in order.
fn operator_names(record: &JobRecord) -> Vec<&str> {
    let stats = record.stats.as_ref().expect("the job has stats");
    stats.operators.iter().map(|op| op.name.as_str()).collect()
}

/// A read of `files` Parquet files of `rows_per_file` rows each, written into `dir`: `id`
/// counts up across the files.
fn read_of_files(dir: &std::path::Path, files: i64, rows_per_file: i64) -> LogicalPlan {
    let paths: Vec<_> = (0..files)
        .map(|file| {
            let ids =
                Int64Array::from_iter_values(file * rows_per_file..(file + 1) * rows_per_file);
            let batch = RecordBatch::try_from_iter([("id", Arc::new(ids) as _)]).unwrap();
            let path = dir.join(format!("part-{file:02}.parquet"));
            let out = std::fs::File::create(&path).unwrap();
            let mut writer =
                parquet::arrow::ArrowWriter::try_new(out, batch.schema(), None).unwrap();
            writer.write(&batch).unwrap();
            writer.close().unwrap();
            path
        })
        .collect();
    LogicalPlan::read(floe_engine::read::discover(FileFormat::Parquet, &paths).unwrap()).unwrap()
}

/// A random shuffle, seeded with `seed`, of a read of `files` files (see [`read_of_files`]).
fn shuffled_files(dir: &std::path::Path, files: i64, rows: i64, seed: u64) -> LogicalPlan {
    let read = read_of_files(dir, files, rows);
    read.random_shuffle(Some(seed)).unwrap()
}

#[tokio::test]
async fn a_read_only_a_shuffle_reads_is_split_by_its_own_tasks_as_they_read() {
    let dir = tempfile::tempdir().unwrap();
    let (files, rows) = (5, 40);
    let plan = shuffled_files(dir.path(), files, rows, 9);
    let fake = fake(2, 2);
    let record = run(&fake, &spec(plan, CacheMode::NoCache)).await;
    let mut ids = output_ids(&fake, &record);
    assert_ne!(ids, (0..files * rows).collect::<Vec<_>>(), "not shuffled");
    ids.sort_unstable();
    assert_eq!(ids, (0..files * rows).collect::<Vec<_>>());
    // One operator: each map task read its file and split the rows it read.
    assert_eq!(operator_names(&record), ["read→random_shuffle"]);
    let tasks = fake.tasks();
    assert!(tasks.iter().all(|task| task.stage != "read"), "{tasks:?}");
    let maps: Vec<_> = tasks.iter().filter(|task| is_map_side(task)).collect();
    assert_eq!(maps.len(), files as usize);
    assert!(
        maps.iter()
            .all(|map| map.input_nodes.is_empty() && map.outputs.len() == 1)
    );
    // 200 rows in five small files fill one partition, as they would unfused.
    assert_eq!(reduces(&tasks), 1);
    let outputs: BTreeSet<ObjectId> = outputs(&record).into_iter().collect();
    assert_eq!(fake.stored_objects(), outputs);
}

/// The reduce tasks among `tasks`.
fn reduces(tasks: &[crate::cluster::fake::RanTask]) -> usize {
    tasks
        .iter()
        .filter(|task| matches!(task.input, StageInput::Reduce { .. }))
        .count()
}

/// A read with a predicate and a row-wise operator fused into an aggregate's map tasks: each
/// map task filters and extends its file's rows before it splits them, and the aggregators
/// get every group.
#[tokio::test]
async fn a_fused_read_applies_its_row_operators_before_an_aggregate_splits_its_rows() {
    let dir = tempfile::tempdir().unwrap();
    let (files, rows) = (4, 50);
    let plan = read_of_files(dir.path(), files, rows)
        .filter((col("id") % lit(3i64)).not_eq(lit(0i64)))
        .unwrap()
        .with_column("k", col("id") % lit(4i64))
        .unwrap()
        .aggregate(&["k"], vec![Aggregation::of(AggFunction::Sum, "id")])
        .unwrap();
    let fake = fake(2, 2);
    let record = run_with(&fake, &spec(plan, CacheMode::NoCache), blocks_of(64)).await;
    // The filter went into the read as its predicate.
    assert_eq!(operator_names(&record), ["read→with_column→aggregate"]);
    let batches = fake.batches(outputs(succeeded(&record)));
    let kept = (0..files * rows).filter(|id| id % 3 != 0);
    assert_eq!(sums_by_k(&batches), sums_of(kept, 4));
    let maps: Vec<_> = fake.tasks().into_iter().filter(is_map_side).collect();
    assert_eq!(maps.len(), files as usize);
    assert!(maps.iter().all(|map| map.input_nodes.is_empty()));
}

/// A read task's memory hint is what its file's rows are taken to fill decoded: four times a
/// Parquet file's size (it holds them compressed), a CSV file's own size.
#[tokio::test]
async fn a_read_tasks_memory_hint_is_its_files_rows_as_decoded() {
    let dir = tempfile::tempdir().unwrap();
    let parquet = read_of_files(dir.path(), 1, 40);
    let parquet_bytes = std::fs::metadata(dir.path().join("part-00.parquet"))
        .unwrap()
        .len();
    let csv_path = dir.path().join("rows.csv");
    let lines: String = (0..40).map(|id| format!("{id}\n")).collect();
    std::fs::write(&csv_path, format!("id\n{lines}")).unwrap();
    let csv_bytes = std::fs::metadata(&csv_path).unwrap().len();
    let csv = floe_engine::read::discover(FileFormat::Csv(CsvOptions::default()), &[&csv_path]);
    let csv = LogicalPlan::read(csv.unwrap()).unwrap();
    for (plan, hint) in [(parquet, 4 * parquet_bytes), (csv, csv_bytes)] {
        let fake = fake(1, 2);
        let record = run(&fake, &spec(plan, CacheMode::NoCache)).await;
        let ids = output_ids(&fake, &record);
        assert_eq!(ids, (0..40).collect::<Vec<_>>());
        let hints: Vec<u64> = fake
            .lease_grants()
            .iter()
            .map(|(request, _)| request.memory_hint)
            .collect();
        assert_eq!(hints, vec![hint]);
    }
}

/// A fused read's rows are not read when its shuffle's partitions are counted: they are
/// taken to fill four times its Parquet files' sizes, and the rule gives at most one
/// partition per file.
#[tokio::test]
async fn a_fused_reads_partitions_are_counted_from_its_files_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let (files, rows) = (5, 40);
    let plan = shuffled_files(dir.path(), files, rows, 9);
    let bytes: u64 = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|entry| entry.unwrap().metadata().unwrap().len())
        .sum();
    // Four times the files' bytes, a partition per block of it, at most one per file.
    for (max_block_bytes, expected) in [(bytes * 4, 1), (bytes, 4), (bytes / 2, 5), (64, 5)] {
        let fake = fake(2, 2);
        let config = blocks_of(max_block_bytes);
        let record = run_with(&fake, &spec(plan.clone(), CacheMode::NoCache), config).await;
        let mut ids = output_ids(&fake, &record);
        ids.sort_unstable();
        assert_eq!(ids, (0..files * rows).collect::<Vec<_>>());
        assert_eq!(
            reduces(&fake.tasks()),
            expected,
            "blocks of {max_block_bytes} bytes, files of {bytes} bytes in all"
        );
    }
}

/// A fused shuffle's or sort's map object lost with its node: the map task that made it
/// reads its file and splits it again, under its task id (so the object keeps its id), into
/// the same parts in the same orders, so the output is the one a run without a fault gives,
/// row for row.
#[tokio::test]
async fn a_fused_map_object_lost_with_its_node_is_read_and_split_again() {
    let (files, rows) = (6, 40);
    let (shuffle_dir, sort_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sorted = read_of_files(sort_dir.path(), files, rows)
        .sort(vec![SortKey::desc("id")])
        .unwrap();
    let shuffled = shuffled_files(shuffle_dir.path(), files, rows, 4);
    // A shuffle's map task reads no block; a sort's reads its boundaries.
    for (plan, blocks_read) in [(shuffled, 0), (sorted, 1)] {
        let clean = fake(3, 2);
        let record = run(&clean, &spec(plan.clone(), CacheMode::NoCache)).await;
        let expected = output_ids(&clean, &record);
        let fake = fake(3, 2);
        lose_a_map_object_to_a_reduce(&fake, |task| task.task.source.is_some());
        let record = run(&fake, &spec(plan, CacheMode::NoCache)).await;
        let ids = output_ids(&fake, &record);
        assert_eq!(ids, expected);
        let mut sorted = ids;
        sorted.sort_unstable();
        assert_eq!(sorted, (0..files * rows).collect::<Vec<_>>());
        let read = stats(&record, "read");
        assert!(read.rebuilt >= 1, "{read:?}");
        let tasks = fake.tasks();
        let makers = makers_of_the_lost_input(&tasks);
        assert_eq!(makers.len(), 2, "the lost object was not made again");
        assert!(
            makers
                .iter()
                .all(|map| map.input_nodes.len() == blocks_read)
        );
        let outputs: BTreeSet<ObjectId> = outputs(&record).into_iter().collect();
        assert_eq!(fake.stored_objects(), outputs);
    }
}

/// A fused shuffle's output is cached like any shuffle's: run again, the job loads its
/// shards and gives the same rows in the same order, and no task reads a file or splits rows.
#[tokio::test]
async fn a_cached_fused_shuffle_is_loaded_again_without_reading_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let (files, rows) = (4, 40);
    let plan = shuffled_files(dir.path(), files, rows, 3);
    let fake = fake(2, 2);
    let first = run(&fake, &spec(plan.clone(), CacheMode::Reuse)).await;
    assert_eq!(operator_names(&first), ["read→random_shuffle"]);
    let expected = output_ids(&fake, &first);
    let ran = fake.tasks().len();
    let second = run(&fake, &spec(plan, CacheMode::Reuse)).await;
    let ids = output_ids(&fake, &second);
    assert_eq!(ids, expected);
    let tasks = fake.tasks();
    let again: Vec<_> = tasks[ran..]
        .iter()
        .filter(|task| is_map_side(task) || matches!(task.input, StageInput::Reduce { .. }))
        .collect();
    assert!(again.is_empty(), "the shuffle ran again: {again:?}");
    let loaded = stats(&second, "read");
    assert!(
        loaded.cache_hits > 0 && loaded.cache_misses == 0,
        "{loaded:?}"
    );
}

/// The columns each fused sample task `fake` runs reads, in name order, one list per task.
fn sampled_columns(fake: &FakeCluster) -> Arc<std::sync::Mutex<Vec<Vec<String>>>> {
    let sampled: Arc<std::sync::Mutex<Vec<Vec<String>>>> = Arc::default();
    let seen = Arc::clone(&sampled);
    fake.on_tasks(
        u32::MAX,
        move |task| {
            if let (StageInput::Sample { .. }, Some(source)) = (task.task.input, &task.task.source)
            {
                let fields = source.stage.schema.fields().iter();
                let mut columns: Vec<String> = fields.map(|f| f.name().clone()).collect();
                columns.sort();
                seen.lock().unwrap().push(columns);
            }
            false
        },
        Fault::Delay(Duration::ZERO),
    );
    sampled
}

/// `partitions` Hive partitions `k=0`, `k=1`, … under `dir`, each one Parquet file of `rows`
/// ids (partition k holds ids k·rows up to (k+1)·rows) and their doubles, `twice`; discovered.
fn hive_files(dir: &std::path::Path, partitions: i64, rows: i64) -> floe_core::plan::FileScan {
    for k in 0..partitions {
        let partition = dir.join(format!("k={k}"));
        std::fs::create_dir(&partition).unwrap();
        let ids = Int64Array::from_iter_values(k * rows..(k + 1) * rows);
        let twice = Int64Array::from_iter_values((k * rows..(k + 1) * rows).map(|id| 2 * id));
        let batch = RecordBatch::try_from_iter([
            ("id", Arc::new(ids) as _),
            ("twice", Arc::new(twice) as _),
        ])
        .unwrap();
        let out = std::fs::File::create(partition.join("part.parquet")).unwrap();
        let mut writer = parquet::arrow::ArrowWriter::try_new(out, batch.schema(), None).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    }
    floe_engine::read::discover(FileFormat::Parquet, &[dir]).unwrap()
}

/// A fused sort by a Hive partition key and a file column: its sample tasks read only the
/// keys of each file (the partition key from the file's path), and the output is in order.
#[tokio::test]
async fn a_fused_sort_by_a_hive_key_and_a_file_column_samples_both_keys() {
    let dir = tempfile::tempdir().unwrap();
    let (partitions, rows) = (4, 30);
    let plan = LogicalPlan::read(hive_files(dir.path(), partitions, rows))
        .unwrap()
        .sort(vec![SortKey::desc("k"), SortKey::asc("id")])
        .unwrap();
    let fake = fake(2, 2);
    let sampled = sampled_columns(&fake);
    let record = run_with(&fake, &spec(plan, CacheMode::NoCache), blocks_of(256)).await;
    assert_eq!(operator_names(&record), ["read→sort"]);
    let batches = fake.batches(outputs(succeeded(&record)));
    let rows_out: Vec<(i64, i64, i64)> = column(&batches, "k")
        .into_iter()
        .zip(column(&batches, "id"))
        .zip(column(&batches, "twice"))
        .map(|((k, id), twice)| (k, id, twice))
        .collect();
    let expected: Vec<(i64, i64, i64)> = (0..partitions)
        .rev()
        .flat_map(|k| (k * rows..(k + 1) * rows).map(move |id| (k, id, 2 * id)))
        .collect();
    assert_eq!(rows_out, expected);
    let keys = vec!["id".to_owned(), "k".to_owned()];
    assert_eq!(*sampled.lock().unwrap(), vec![keys; partitions as usize]);
}

/// A fused shuffle whose read keeps no file (its predicate rules out every Hive partition)
/// runs no map task and succeeds with no rows.
#[tokio::test]
async fn a_fused_shuffle_over_a_read_of_no_files_gives_no_rows() {
    let dir = tempfile::tempdir().unwrap();
    let scan = hive_files(dir.path(), 2, 10);
    assert_eq!(scan.files.len(), 2);
    let plan = LogicalPlan::read(scan)
        .unwrap()
        .filter(col("k").eq(lit(7i64)))
        .unwrap()
        .random_shuffle(Some(1))
        .unwrap();
    let fake = fake(2, 2);
    let record = run(&fake, &spec(plan, CacheMode::NoCache)).await;
    let batches = fake.batches(outputs(succeeded(&record)));
    assert_eq!(batches.iter().map(RecordBatch::num_rows).sum::<usize>(), 0);
    assert_eq!(operator_names(&record), ["read→random_shuffle"]);
    let tasks = fake.tasks();
    assert!(tasks.iter().all(|task| !is_map_side(task)), "{tasks:?}");
}

/// The names of the operators `plan` runs with `cache`.
fn planned_names(plan: LogicalPlan, cache: CacheMode) -> Vec<String> {
    let planned =
        crate::plan::plan(&spec(plan, cache), &Default::default(), &driver_config()).unwrap();
    planned
        .operators
        .into_iter()
        .map(|operator| operator.name)
        .collect()
}

/// A read of `files` files that are never opened (planning only stamps them).
fn read_of_stamps(files: usize) -> LogicalPlan {
    let stamps = (0..files)
        .map(|file| floe_core::fingerprint::FileStamp {
            path: format!("/data/part-{file:03}.parquet").into(),
            size: 1 << 20,
            modified_secs: 0,
            modified_nanos: 0,
            version: None,
        })
        .collect();
    let schema = arrow::datatypes::Schema::new(vec![
        arrow::datatypes::Field::new("id", arrow::datatypes::DataType::Int64, false),
        arrow::datatypes::Field::new("k", arrow::datatypes::DataType::Int64, false),
    ]);
    let scan = floe_core::plan::FileScan::new(FileFormat::Parquet, stamps, schema);
    LogicalPlan::read(scan).unwrap()
}

#[test]
fn only_a_read_that_one_shuffle_alone_reads_is_fused_into_its_map_side() {
    let read = read_of_stamps(4);
    let sum = || vec![Aggregation::of(AggFunction::Sum, "id")];
    let none = CacheMode::NoCache;
    let fused = [
        (
            read.random_shuffle(Some(1)).unwrap(),
            none,
            "read→random_shuffle",
        ),
        (
            read.repartition(3, &["k"]).unwrap(),
            none,
            "read→repartition",
        ),
        (
            read.aggregate(&["k"], sum()).unwrap(),
            none,
            "read→aggregate",
        ),
        // Caching keeps the shuffle's output, not the read's.
        (
            read.unique(&["k"]).unwrap(),
            CacheMode::Reuse,
            "read→unique",
        ),
        (
            read.sort(vec![SortKey::desc("k")]).unwrap(),
            none,
            "read→sort",
        ),
    ];
    for (plan, cache, name) in fused {
        assert_eq!(planned_names(plan, cache), [name]);
    }
    let apart = [
        // A split by position counts the rows first; a sort's samples read only the keys of
        // a plain read.
        (
            read.with_column("j", col("k") + lit(1i64))
                .unwrap()
                .sort(vec![SortKey::asc("j")])
                .unwrap(),
            none,
            vec!["read→with_column", "sort"],
        ),
        (
            read.repartition(3, &[]).unwrap(),
            none,
            vec!["read", "repartition"],
        ),
        // The read is read twice, or cached for later jobs.
        (
            read.union(&read).unwrap().random_shuffle(Some(1)).unwrap(),
            none,
            vec!["read", "union", "random_shuffle"],
        ),
        (
            read.cache().unwrap().random_shuffle(Some(1)).unwrap(),
            CacheMode::Reuse,
            vec!["read", "cache", "random_shuffle"],
        ),
        // Each of 65 files would be a map task with a part for every partition.
        (
            read_of_stamps(65).random_shuffle(Some(1)).unwrap(),
            none,
            vec!["read", "random_shuffle"],
        ),
    ];
    for (plan, cache, names) in apart {
        assert_eq!(planned_names(plan, cache), names);
    }
}

#[tokio::test]
async fn a_sort_fused_with_its_read_samples_the_keys_of_each_file_then_splits_its_rows() {
    let dir = tempfile::tempdir().unwrap();
    let (files, rows) = (4, 50);
    let plan = read_of_files(dir.path(), files, rows)
        .sort(vec![SortKey::desc("id")])
        .unwrap();
    let fake = fake(2, 2);
    let sampled = sampled_columns(&fake);
    let record = run(&fake, &spec(plan, CacheMode::NoCache)).await;
    let ids = output_ids(&fake, &record);
    assert_eq!(ids, (0..files * rows).rev().collect::<Vec<_>>());
    assert_eq!(operator_names(&record), ["read→sort"]);
    assert_eq!(
        *sampled.lock().unwrap(),
        vec![vec!["id".to_owned()]; files as usize]
    );
    let tasks = fake.tasks();
    let maps: Vec<_> = tasks.iter().filter(|task| is_map_side(task)).collect();
    assert_eq!(maps.len(), files as usize);
    // A map task's one input block is the boundaries: it read its rows from its file.
    assert!(maps.iter().all(|map| map.input_nodes.len() == 1));
    let outputs: BTreeSet<ObjectId> = outputs(&record).into_iter().collect();
    assert_eq!(fake.stored_objects(), outputs);
}
