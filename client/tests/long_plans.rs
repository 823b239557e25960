//! Long pipelines through the Dataset builder and the job-file reader: 10 to 30,000 steps
//! are accepted (and then run, explain and encode) or refused at the step that passes
//! `MAX_PLAN_DEPTH`, naming the limit — never a stack overflow. Each case runs on a thread
//! with a 512 KiB stack, a quarter of a tokio worker's, so a walk that grew with the plan
//! would overflow here, loudly, long before it could in a real process.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use floe_client::jobspec::{PathPolicy, parse_job_file_with};
use floe_client::{Dataset, Registry, col, lit};
use floe_core::config::AllowedPaths;
use floe_core::job::{JobOptions, JobSpec};
use floe_core::plan::{MAX_EXPR_DEPTH, MAX_PLAN_DEPTH};

const SMALL_STACK: usize = 512 * 1024;
/// A tokio worker's stack, and the default of any thread Rust starts.
const WORKER_STACK: usize = 2 << 20;

fn on_small_stack<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    on_stack(SMALL_STACK, work)
}

fn on_stack<T: Send + 'static>(size: usize, work: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .stack_size(size)
        .spawn(work)
        .unwrap()
        .join()
        .unwrap()
}

/// The refusal every too-long pipeline gets, wherever it was built.
fn assert_refused_at_the_limit(message: &str) {
    assert!(
        message.contains(&format!(
            "this step would make the plan {} steps deep",
            MAX_PLAN_DEPTH + 1
        )) && message.contains(&format!("at most {MAX_PLAN_DEPTH} are allowed")),
        "{message}"
    );
}

/// Encodes and decodes `dataset`'s plan as a submission does, and explains it.
fn round_trip(dataset: &Dataset) {
    let spec = JobSpec {
        plan: dataset.plan().resolve_seeds().unwrap(),
        options: JobOptions::default(),
    };
    let decoded = JobSpec::decode(&spec.encode().unwrap()).unwrap();
    assert_eq!(decoded.plan.fingerprint(), spec.plan.fingerprint());
    assert!(dataset.explain().unwrap().contains("== Physical plan =="));
}

#[test]
fn builder_chains_are_accepted_up_to_the_limit_and_refused_past_it() {
    for steps in [10usize, 1_000, 5_000, 30_000] {
        on_small_stack(move || {
            let mut dataset = Dataset::range(1_000).unwrap();
            for index in 0..steps {
                let next = if index % 2 == 0 {
                    dataset.filter(col("id").gt(lit(index as i64)))
                } else {
                    dataset.with_column("doubled", col("id") * lit(2i64))
                };
                match next {
                    Ok(next) => dataset = next,
                    Err(error) => {
                        // The source is the first operator: step index 63 is the 65th.
                        assert_eq!(index, MAX_PLAN_DEPTH as usize - 1, "{steps}: {error}");
                        assert_refused_at_the_limit(&error.to_string());
                        break;
                    }
                }
            }
            round_trip(&dataset);
        });
    }
}

#[test]
fn the_deepest_pipeline_runs_locally() {
    // Every step a filter that keeps rows 10 and up: the answer is known.
    let dataset = (1..MAX_PLAN_DEPTH).fold(Dataset::range(100).unwrap(), |dataset, _| {
        dataset.filter(col("id").gt_eq(lit(10i64))).unwrap()
    });
    assert_eq!(dataset.plan().depth(), MAX_PLAN_DEPTH);
    // The local executor (floe-engine) needs about 700 KiB for it in a debug build.
    let count = on_stack(WORKER_STACK, move || dataset.count().unwrap());
    assert_eq!(count, 90);
}

fn job_file(steps: usize, step: &str) -> String {
    let mut text = String::from("[source]\nrange = 1000\n");
    for _ in 0..steps {
        text.push_str("[[steps]]\n");
        text.push_str(step);
        text.push('\n');
    }
    text
}

fn parse(text: String) -> Result<floe_client::jobspec::JobFile, String> {
    on_small_stack(move || {
        parse_job_file_with(
            "/srv/jobs/long.toml",
            &text,
            Arc::new(Registry::with_builtins()),
            &PathPolicy::submitted(AllowedPaths::any()),
        )
        .map_err(|error| error.to_string())
    })
}

#[test]
fn job_files_of_10_to_30000_steps_are_accepted_or_refused_at_the_limit() {
    for steps in [10usize, 63, 64, 1_000, 5_000, 30_000] {
        let text = job_file(steps, "filter = \"id % 3 != 1\"");
        match parse(text) {
            Ok(job) => {
                assert!(
                    steps < MAX_PLAN_DEPTH as usize,
                    "{steps} steps were accepted"
                );
                assert_eq!(job.dataset.plan().depth() as usize, steps + 1);
                on_small_stack(move || round_trip(&job.dataset));
            }
            Err(message) => {
                assert!(steps >= MAX_PLAN_DEPTH as usize, "{steps}: {message}");
                // The error names the file, the line and the step that passed the limit.
                let line = 3 + 2 * (MAX_PLAN_DEPTH as usize - 1);
                let at = format!(
                    "/srv/jobs/long.toml:{line}: steps[{}].filter: ",
                    MAX_PLAN_DEPTH - 1
                );
                assert!(message.starts_with(&at), "{message}");
                assert_refused_at_the_limit(&message);
            }
        }
    }
}

#[test]
fn a_sink_counts_as_a_step() {
    let mut text = job_file(MAX_PLAN_DEPTH as usize - 1, "limit = 10");
    text.push_str("[sink]\nwrite_parquet = \"/tmp/never-written\"\n");
    let message = parse(text).err().unwrap();
    assert!(message.contains(": sink.write_parquet: "), "{message}");
    assert_refused_at_the_limit(&message);
}

#[test]
fn expressions_deeper_than_a_plan_holds_are_refused_by_step() {
    // `id + 1 + 1 …` nests one level per `+`, within the reader's token bound.
    let chain = |terms: u32| {
        let sum = vec!["1"; terms as usize].join(" + ");
        format!("with_column = {{ name = \"x\", expr = \"id + {sum}\" }}")
    };
    assert!(parse(job_file(1, &chain(MAX_EXPR_DEPTH))).is_ok());
    let message = parse(job_file(1, &chain(MAX_EXPR_DEPTH + 1)))
        .err()
        .unwrap();
    assert!(
        message.starts_with("/srv/jobs/long.toml:3: steps[0].with_column: ")
            && message.contains(&format!(
                "nests {} levels deep; at most {MAX_EXPR_DEPTH} are allowed",
                MAX_EXPR_DEPTH + 1
            )),
        "{message}"
    );
}
