//! The job-spec format: what it builds, and the errors it gives (line and field).

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use floe_client::jobspec::{parse_expr, parse_job_file};
use floe_client::{CacheMode, Dataset, Registry, col, lit, when};

fn builtins() -> Arc<Registry> {
    Arc::new(Registry::with_builtins())
}

#[test]
fn expressions_follow_the_usual_precedence() {
    let parsed = parse_expr("a + b * 2 > 10 and not (c == 'x' or d <= -1.5)").unwrap();
    let expected = (col("a") + col("b") * lit(2i64))
        .gt(lit(10i64))
        .and(!(col("c").eq(lit("x")).or(col("d").lt_eq(-lit(1.5f64)))));
    assert_eq!(parsed.to_string(), expected.to_string());
    let parsed = parse_expr("when(is_null(col('my col')), 0, cast(x, 'float64') % 3)").unwrap();
    let expected = when(
        col("my col").is_null(),
        lit(0i64),
        col("x").cast(arrow::datatypes::DataType::Float64) % lit(3i64),
    );
    assert_eq!(parsed.to_string(), expected.to_string());
    for (bad, problem) in [
        ("a +", "ends too early"),
        ("a b", "after a complete expression"),
        ("frobnicate(a)", "unknown function"),
        ("'open", "unterminated"),
        ("cast(a, 'complex')", "unknown type"),
        ("a $ b", "unexpected character"),
    ] {
        let error = parse_expr(bad).unwrap_err();
        assert!(error.contains(problem), "{bad}: {error}");
    }
}

#[test]
fn a_job_file_builds_the_same_plan_as_the_builder() {
    let file = r#"
[source]
range = 100

[[steps]]
with_column = { name = "k", expr = "id % 5" }

[[steps]]
groupby = ["k"]
agg = ["count(*) as n", "sum(id)"]

[[steps]]
sort = ["n desc nulls last", "k"]

[options]
cache = "none"
retries = 5
"#;
    let parsed = parse_job_file("job.toml", file, builtins()).unwrap();
    let built = Dataset::range(100)
        .unwrap()
        .with_column("k", col("id") % lit(5i64))
        .unwrap()
        .groupby(&["k"])
        .agg(vec![
            floe_client::Aggregation::count_rows("n"),
            floe_client::Aggregation::of(floe_client::AggFunction::Sum, "id"),
        ])
        .unwrap()
        .sort(vec![
            floe_client::SortKey::desc("n").nulls_first(false),
            floe_client::SortKey::asc("k"),
        ])
        .unwrap();
    assert_eq!(parsed.dataset.fingerprint(), built.fingerprint());
    assert_eq!(parsed.options.cache, CacheMode::NoCache);
    assert_eq!(parsed.options.max_task_retries, 5);
}

#[test]
fn errors_name_the_file_line_and_field() {
    let cases = [
        (
            "[source]\nrange = 10\n\n[[steps]]\nfilter = \"idd > 3\"\n",
            "job.toml:4: steps[0].filter",
            "idd",
        ),
        (
            "[source]\nrange = 10\n[[steps]]\nexplode = 1\n",
            "job.toml:3: steps[0].explode",
            "expected one of",
        ),
        (
            "[source]\nrange = -1\n",
            "job.toml:1: source.range",
            "non-negative",
        ),
        (
            "[source]\nrange = 10\n[[steps]]\nsort = [\"id sideways\"]\n",
            "job.toml:3: steps[0].sort",
            "sort key",
        ),
        (
            "[source]\nrange = 10\n[[steps]]\ngroupby = [\"id\"]\nagg = [\"median(id)\"]\n",
            "job.toml:3: steps[0].agg",
            "median",
        ),
        (
            "[source]\nrange = 10\n[options]\ncache = \"sometimes\"\n",
            "job.toml:3: options.cache",
            "reuse",
        ),
        (
            "[source]\nrange = 10\n[sink]\nwrite_parquet = 3\n",
            "job.toml:3: sink.write_parquet",
            "directory",
        ),
        ("[source\n", "job.toml:1: file", ""),
        (
            "[source]\nread_csv = [\"/no/such/dir/*.csv\"]\n",
            "job.toml:1: source.read_csv",
            "No such file",
        ),
    ];
    for (text, location, problem) in cases {
        let error = parse_job_file("job.toml", text, builtins())
            .err()
            .unwrap()
            .to_string();
        assert!(
            error.starts_with(location),
            "{error:?} should start with {location:?}"
        );
        assert!(
            error.contains(problem),
            "{error:?} should mention {problem:?}"
        );
    }
}

#[test]
fn a_process_udf_step_pins_its_script_and_checks_its_fields() {
    use floe_client::jobspec::{PathPolicy, parse_job_file_with};
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("udf.py");
    std::fs::write(&script, "print('hi')\n").unwrap();
    let spec =
        |fields: &str| format!("[source]\nrange = 10\n[[steps]]\nmap_batches = {{ {fields} }}\n");
    let script_arg = script.to_str().unwrap();

    let parsed = parse_job_file(
        "job.toml",
        &spec(&format!(
            "command = \"python3\", args = [{script_arg:?}, \"--fast\"], output = [\"id int64\", \"label utf8\"], concurrency = [1, 3], memory = \"1GiB\", timeout_s = 5"
        )),
        builtins(),
    )
    .unwrap();
    let plan = parsed.dataset.plan();
    let floe_core::plan::Operator::ProcessUdf(udf) = plan.operator() else {
        panic!("not a process UDF: {plan:?}");
    };
    // The script argument is pinned by content, and passed as its absolute path.
    assert_eq!(udf.files.len(), 1);
    assert_eq!(udf.files[0].path, std::fs::canonicalize(&script).unwrap());
    assert_eq!(udf.args[0], udf.files[0].path.to_str().unwrap());
    assert_eq!(udf.args[1], "--fast");
    assert_eq!(udf.concurrency, floe_client::Concurrency::new(1, 3));
    assert_eq!(udf.memory, 1 << 30);
    assert_eq!(udf.timeout_ms, 5000);
    let names: Vec<&String> = plan.schema().fields().iter().map(|f| f.name()).collect();
    assert_eq!(names, ["id", "label"]);

    let cases = [
        ("command = \"python3\", colour = 1", "map_batches.colour"),
        (
            "command = \"python3\", concurrency = [3]",
            "map_batches.concurrency",
        ),
        (
            "command = \"python3\", output = [\"id\"]",
            "map_batches.output",
        ),
        (
            "command = \"python3\", output = [\"id decimal\"]",
            "map_batches.output",
        ),
        (
            "command = \"python3\", files = [\"/no/such/udf.py\"]",
            "map_batches.files",
        ),
        (
            "command = \"python3\", memory = \"lots\"",
            "map_batches.memory",
        ),
        ("command = \"\"", "map_batches"),
    ];
    for (fields, field) in cases {
        let error = parse_job_file("job.toml", &spec(fields), builtins())
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains(field), "{fields}: {error}");
    }

    // Over the network only absolute paths are accepted, for arguments that are files too.
    let relative = std::env::current_dir()
        .unwrap()
        .join("relative_udf_for_test.py");
    std::fs::write(&relative, "").unwrap();
    let refused = parse_job_file_with(
        "job.toml",
        &spec("command = \"python3\", args = [\"relative_udf_for_test.py\"]"),
        builtins(),
        &PathPolicy::submitted(floe_core::config::AllowedPaths::any()),
    )
    .err()
    .map(|error| error.to_string());
    std::fs::remove_file(&relative).unwrap();
    let refused = refused.unwrap();
    assert!(refused.contains("map_batches.args"), "{refused}");
}

#[test]
fn paths_outside_the_allowed_roots_are_refused_before_anything_is_opened() {
    use floe_client::jobspec::{PathPolicy, parse_job_file_with};
    use floe_core::config::AllowedPaths;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("data");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("a.csv"), "x\n1\n").unwrap();
    std::fs::write(dir.path().join("secret.csv"), "password\nhunter2\n").unwrap();
    std::os::unix::fs::symlink(dir.path().join("secret.csv"), root.join("sneaky.csv")).unwrap();
    let policy = PathPolicy::submitted(AllowedPaths::under(std::slice::from_ref(&root)));
    let parse = |text: String| parse_job_file_with("job", &text, builtins(), &policy);

    let inside = format!(
        "[source]\nread_csv = [{:?}]\n",
        root.join("a.csv").to_str().unwrap()
    );
    assert!(parse(inside).is_ok());
    let cases = [
        format!(
            "[source]\nread_csv = [{:?}]\n",
            dir.path().join("secret.csv").to_str().unwrap()
        ),
        format!(
            "[source]\nread_csv = [{:?}]\n",
            root.join("../secret.csv").to_str().unwrap()
        ),
        // A glob inside the root that matches a symlink leading out of it.
        format!(
            "[source]\nread_csv = [{:?}]\n",
            root.join("*.csv").to_str().unwrap()
        ),
        format!(
            "[source]\nrange = 3\n[sink]\nwrite_csv = {:?}\n",
            root.join("out/../../escaped").to_str().unwrap()
        ),
    ];
    for text in cases {
        let error = parse(text.clone()).err().unwrap().to_string();
        assert!(
            error.contains("outside data.allowed_paths"),
            "{text}: {error}"
        );
        assert!(
            !error.contains("hunter2") && !error.contains("password"),
            "{error}"
        );
    }
}
