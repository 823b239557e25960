//! Consuming datasets: count, take, iter_batches and materialize, against row-by-row
//! references, and take's early stop observed on real files.
// Test helpers outside #[test] functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};

use arrow::array::{Array, Int64Array};
use arrow::record_batch::RecordBatch;
use floe_client::{
    BatchStream, Dataset, Executor, LocalExecutor, Registry, SortKey, WriteOptions, col, lit,
};
use floe_core::Fingerprint;
use floe_core::plan::LogicalPlan;
use floe_engine::blocks::BlockSizing;

/// The values of Int64 column `name`, in order, over all batches.
fn column(batches: &[RecordBatch], name: &str) -> Vec<i64> {
    batches
        .iter()
        .flat_map(|b| {
            b.column_by_name(name)
                .unwrap()
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .values()
                .to_vec()
        })
        .collect()
}

/// A local executor with tiny blocks, so that streams have many of them.
fn small_blocks() -> Arc<LocalExecutor> {
    Arc::new(LocalExecutor {
        sizing: BlockSizing::new(1, 1 << 20).unwrap(),
        batch_rows: 16,
    })
}

/// ids 0..1000 with id % 7 == 3, and their squares.
fn pipeline() -> (Dataset, Vec<(i64, i64)>) {
    let dataset = Dataset::range(1000)
        .unwrap()
        .with_executor(small_blocks())
        .with_column("square", col("id") * col("id"))
        .unwrap()
        .filter((col("id") % lit(7i64)).eq(lit(3i64)))
        .unwrap();
    let reference = (0..1000i64)
        .filter(|id| id % 7 == 3)
        .map(|id| (id, id * id))
        .collect();
    (dataset, reference)
}

fn rows(batches: &[RecordBatch]) -> Vec<(i64, i64)> {
    column(batches, "id")
        .into_iter()
        .zip(column(batches, "square"))
        .collect()
}

#[test]
fn count_take_and_iter_batches_match_a_row_by_row_reference() {
    let (dataset, reference) = pipeline();
    assert_eq!(dataset.count().unwrap(), reference.len() as u64);

    let batches: Vec<RecordBatch> = dataset
        .iter_batches()
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(rows(&batches), reference);
    // Each 16-row batch of the range became its own block.
    assert!(batches.len() > 50, "{} blocks", batches.len());
    assert!(
        batches
            .iter()
            .all(|b| b.schema().as_ref() == dataset.schema())
    );

    for n in [0, 1, 5, 16, 17, 142, 143, 500] {
        let taken = dataset.take(n).unwrap();
        let expected: Vec<(i64, i64)> = reference.iter().copied().take(n as usize).collect();
        assert_eq!(rows(&taken), expected, "take({n})");
    }
    // take is a plain limit: it does not change the dataset it was called on.
    assert_eq!(dataset.count().unwrap(), reference.len() as u64);
}

/// A union of a dataset with itself plans its input once and reads that stage twice.
#[test]
fn a_self_union_yields_its_input_twice() {
    let (dataset, reference) = pipeline();
    let twice = dataset.union(&dataset).unwrap();
    let mut expected = reference.clone();
    expected.extend(reference.iter().copied());
    assert_eq!(twice.count().unwrap(), expected.len() as u64);
    assert_eq!(rows(&twice.take(10_000).unwrap()), expected);
    let first: Vec<(i64, i64)> = expected.iter().copied().take(200).collect();
    assert_eq!(rows(&twice.take(200).unwrap()), first);
}

#[test]
fn materialize_is_a_source_fingerprinted_by_its_content() {
    let (dataset, reference) = pipeline();
    let materialized = dataset.materialize().unwrap();
    assert_eq!(materialized.schema(), dataset.schema());
    assert!(matches!(
        materialized.plan().operator(),
        floe_core::plan::Operator::FromBatches { .. }
    ));
    // Content, not lineage: the same fingerprint as the same rows given by hand, and not
    // the fingerprint of the plan that computed them.
    let batches: Vec<RecordBatch> = dataset
        .iter_batches()
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let by_hand = Dataset::from_batches(dataset.schema(), &batches).unwrap();
    assert_eq!(materialized.fingerprint(), by_hand.fingerprint());
    assert_ne!(materialized.fingerprint(), dataset.fingerprint());
    assert_eq!(
        materialized.fingerprint(),
        dataset.materialize().unwrap().fingerprint()
    );

    // The materialized rows compute like the original ones, with the same executor.
    assert_eq!(rows(&materialized.take(1000).unwrap()), reference);
    let bigger = materialized
        .filter(col("square").gt(lit(250_000i64)))
        .unwrap();
    let expected: Vec<(i64, i64)> = reference
        .iter()
        .copied()
        .filter(|(_, square)| *square > 250_000)
        .collect();
    assert_eq!(rows(&bigger.take(1000).unwrap()), expected);
    assert!(bigger.iter_batches().unwrap().count() > 1);
}

/// Three CSV files of 100 rows each; the third is rewritten after the dataset is built, so
/// reading it fails: whatever succeeds never opened it.
#[test]
fn take_and_iter_batches_stop_reading_at_what_they_need() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, ids: std::ops::Range<i64>| {
        let mut body = String::from("id,half\n");
        for id in ids {
            body.push_str(&format!("{id},{}\n", id / 2));
        }
        std::fs::write(dir.path().join(name), body).unwrap();
    };
    write("a.csv", 0..100);
    write("b.csv", 100..200);
    write("c.csv", 200..300);
    let dataset = Dataset::read_csv(&[dir.path().join("*.csv")])
        .unwrap()
        .with_executor(small_blocks())
        .filter((col("id") % lit(2i64)).eq(lit(0i64)))
        .unwrap();
    assert_eq!(dataset.count().unwrap(), 150);
    write("c.csv", 200..301);

    let error = dataset.count().unwrap_err().to_string();
    assert!(
        error.contains("c.csv: the file changed after the plan was built"),
        "{error}"
    );
    // 60 even ids: all 50 of a.csv and 10 of b.csv; c.csv is never opened.
    let taken = dataset.take(60).unwrap();
    assert_eq!(
        column(&taken, "id"),
        (0..120).step_by(2).collect::<Vec<_>>()
    );
    assert_eq!(
        column(&taken, "half"),
        (0..120).step_by(2).map(|id| id / 2).collect::<Vec<_>>()
    );

    // The stream yields a.csv's and b.csv's blocks before it reaches c.csv and fails.
    let mut stream = dataset.iter_batches().unwrap();
    let mut ids = Vec::new();
    let error = loop {
        match stream.next().unwrap() {
            Ok(block) => ids.extend(column(&[block], "id")),
            Err(error) => break error.to_string(),
        }
    };
    assert_eq!(ids, (0..200).step_by(2).collect::<Vec<_>>());
    assert!(error.contains("c.csv"), "{error}");
    assert!(stream.next().is_none(), "the stream ends at its error");
}

/// Records the plans it is given and runs them locally: what a cluster client's executor
/// would receive.
#[derive(Default)]
struct Recording {
    plans: Mutex<Vec<Fingerprint>>,
    local: LocalExecutor,
}

impl Executor for Recording {
    fn execute<'a>(
        &'a self,
        plan: &LogicalPlan,
        udfs: &'a Registry,
    ) -> floe_client::Result<BatchStream<'a>> {
        self.plans.lock().unwrap().push(plan.fingerprint());
        self.local.execute(plan, udfs)
    }
}

#[test]
fn consuming_calls_run_on_the_dataset_s_executor() {
    let recording = Arc::new(Recording::default());
    let dataset = Dataset::range(10)
        .unwrap()
        .with_executor(recording.clone())
        .with_column("double", col("id") * lit(2i64))
        .unwrap();
    assert_eq!(column(&dataset.take(3).unwrap(), "double"), vec![0, 2, 4]);
    assert_eq!(dataset.count().unwrap(), 10);
    // The executor gets the plan as built (limit included); optimizing is its job.
    assert_eq!(
        *recording.plans.lock().unwrap(),
        vec![
            dataset.limit(3).unwrap().fingerprint(),
            dataset.fingerprint()
        ]
    );

    // The local executor refuses shuffles before running anything.
    let sorted = dataset.sort(vec![SortKey::desc("id")]).unwrap();
    let error = sorted.count().unwrap_err();
    assert_eq!(
        error.to_string(),
        "sort is not a row-wise operator; the shuffle executor runs it"
    );
    assert_eq!(recording.plans.lock().unwrap().len(), 3);
}

#[test]
fn consuming_a_sink_writes_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let sink = Dataset::range(25)
        .unwrap()
        .write_csv(&out, WriteOptions::default())
        .unwrap();
    assert!(!out.exists());
    assert_eq!(sink.count().unwrap(), 0);
    let back = Dataset::read_csv(&[&out]).unwrap();
    assert_eq!(
        column(&back.take(100).unwrap(), "id"),
        (0..25).collect::<Vec<_>>()
    );
}
