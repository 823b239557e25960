//! The job-spec format: what it builds, and the errors it gives (line and field).

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use floe_client::jobspec::{parse_expr, parse_job_file};
use floe_client::{
    CacheMode, Dataset, JoinType, Registry, WriteMode, col, lit, null_on_error, when,
};

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
    for (bad, problem, column) in [
        ("a +", "ends too early", 4),
        ("a b", "after a complete expression", 3),
        ("x + frobnicate(a)", "unknown function", 5),
        ("'open", "unterminated", 1),
        ("cast(a, 'complex')", "unknown type", 1),
        ("a $ b", "unexpected character", 3),
        ("(a + 1", "expected `)`, got the end", 7),
    ] {
        let error = parse_expr(bad).unwrap_err();
        assert!(error.message.contains(problem), "{bad}: {error}");
        assert_eq!(error.column, column, "{bad}: {error}");
        assert!(error.to_string().starts_with(&format!("column {column}: ")));
    }
    // The `try` forms: null instead of an error.
    let tried = parse_expr("try_cast(region, 'int64') + try_divide(a, b)").unwrap();
    let expected = col("region").try_cast(arrow::datatypes::DataType::Int64)
        + null_on_error(col("a") / col("b"));
    assert_eq!(tried.to_string(), expected.to_string());
    assert_eq!(
        parse_expr("try(a * b - 1)").unwrap().to_string(),
        null_on_error(col("a") * col("b") - lit(1i64)).to_string()
    );
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
            "unknown step `explode`; a step is one of `filter`",
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
            "command = \"python3\", args = [{script_arg:?}, \"--fast\"], output = [\"id int64\", \"label utf8\"], concurrency = [1, 3], memory = \"1GiB\", timeout_s = 5, env = {{ MODEL = \"small\" }}"
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
    assert_eq!(udf.env.get("MODEL").map(String::as_str), Some("small"));
    assert_eq!(udf.env.len(), 1);
    let names: Vec<&String> = plan.schema().fields().iter().map(|f| f.name()).collect();
    assert_eq!(names, ["id", "label"]);

    // With `files` listed, an argument naming one of them (here through `..`) is passed as the
    // path pinned, so a node sees that the script it runs is pinned.
    let roundabout = dir
        .path()
        .join("..")
        .join(dir.path().file_name().unwrap())
        .join("udf.py");
    let roundabout = roundabout.to_str().unwrap();
    let listed = parse_job_file(
        "job.toml",
        &spec(&format!(
            "command = \"python3\", args = [{roundabout:?}], files = [{roundabout:?}]"
        )),
        builtins(),
    )
    .unwrap();
    let floe_core::plan::Operator::ProcessUdf(listed) = listed.dataset.plan().operator().clone()
    else {
        panic!("not a process UDF");
    };
    assert_eq!(listed.args, [udf.files[0].path.to_str().unwrap()]);
    assert_eq!(listed.script().unwrap().path, udf.files[0].path);

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
        ("command = \"python3\", env = [\"A\"]", "map_batches.env"),
        (
            "command = \"python3\", env = { A = 1 }",
            "map_batches.env.A",
        ),
        (
            "command = \"python3\", env = { FLOE_CLUSTER_TOKEN = \"x\" }",
            "map_batches",
        ),
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

/// Parses `text` as the job file `file`, expecting an error; returns its text.
fn refusal(file: &str, text: &str) -> String {
    match parse_job_file(file, text, builtins()) {
        Ok(_) => panic!("{file} was accepted:\n{text}"),
        Err(error) => error.to_string(),
    }
}

#[test]
fn unknown_keys_are_refused_everywhere_with_the_nearest_known_key() {
    let range = "[source]\nrange = 10\n";
    // (the file's text, where the error points, what it must say)
    let cases = [
        // The issue's cases: each ran a silently different job.
        (
            format!("{range}[[steps]]\ngroupby = [\"id\"]\naggs = [\"count(*)\"]\n"),
            "/srv/jobs/daily.toml:3: steps[0].aggs: ",
            "unknown key `aggs` in a groupby step (did you mean `agg`?); \
             a groupby step takes `groupby`, `agg`",
        ),
        (
            format!("{range}[[steps]]\nrepartition = 8\nkey = [\"id\"]\n"),
            "/srv/jobs/daily.toml:3: steps[0].key: ",
            "unknown key `key` in a repartition step (did you mean `keys`?)",
        ),
        (
            format!(
                "{range}[[steps]]\nwith_column = {{ name = \"x\", expr = \"id\", typ = \"int\" }}\n"
            ),
            "/srv/jobs/daily.toml:3: steps[0].with_column.typ: ",
            "unknown key `typ` in with_column; it takes `name`, `expr`",
        ),
        (
            format!("{range}[[steps]]\nwith_column = {{ name = \"x\", exp = \"id\" }}\n"),
            "steps[0].with_column.exp: ",
            "(did you mean `expr`?)",
        ),
        // A misspelled step name is reported as such, not against another key.
        (
            format!("{range}[[steps]]\ngropuby = [\"id\"]\nagg = [\"count(*)\"]\n"),
            "/srv/jobs/daily.toml:3: steps[0].gropuby: ",
            "unknown step `gropuby` (did you mean `groupby`?); a step is one of `filter`",
        ),
        (
            format!("{range}[[steps]]\nagg = [\"count(*)\"]\n"),
            "steps[0].agg: ",
            "`agg` belongs to a groupby step, but this table names no step",
        ),
        (
            format!("{range}[[steps]]\n[[steps]]\nlimit = 1\n"),
            "/srv/jobs/daily.toml:3: steps[0]: ",
            "an empty step",
        ),
        (
            format!("{range}[[steps]]\nfilter = \"id > 1\"\nagg = [\"count(*)\"]\n"),
            "steps[0].agg: ",
            "a filter step takes `filter` (`agg` belongs to a groupby step)",
        ),
        (
            format!("{range}[[steps]]\nfilter = \"id > 1\"\nlimit = 3\n"),
            "steps[0].limit: ",
            "`filter` and `limit` cannot be in one step",
        ),
        // Registered and process UDFs.
        (
            format!("{range}[[steps]]\nmap_batches = {{ udf = \"x\", version = 1, arg = {{}} }}\n"),
            "steps[0].map_batches.arg: ",
            "unknown key `arg` in a map_batches UDF call (did you mean `args`?)",
        ),
        (
            format!("{range}[[steps]]\nmap_batches = {{ comand = \"python3\" }}\n"),
            "steps[0].map_batches.comand: ",
            "(did you mean `command`?)",
        ),
        (
            format!("{range}[[steps]]\nmap_batches = {{ command = \"python3\", timeout = 5 }}\n"),
            "steps[0].map_batches.timeout: ",
            "unknown key `timeout` in a process UDF (did you mean `timeout_s`?)",
        ),
        // Source, sink, options and the file's own tables.
        (
            format!("{range}header = true\n"),
            "/srv/jobs/daily.toml:1: source.header: ",
            "unknown key `header` in a range source; a range source takes `range`",
        ),
        (
            "[source]\nrnage = 10\n".to_owned(),
            "source.rnage: ",
            "unknown source `rnage` (did you mean `range`?)",
        ),
        (
            format!("{range}[sink]\nwrite_parquet = \"/tmp/out\"\nmodes = \"overwrite\"\n"),
            "sink.modes: ",
            "unknown key `modes` in a write_parquet sink (did you mean `mode`?)",
        ),
        (
            format!("{range}[sink]\nwrite_parket = \"/tmp/out\"\n"),
            "sink.write_parket: ",
            "unknown sink `write_parket` (did you mean `write_parquet`?)",
        ),
        (
            format!("{range}[options]\nretires = 2\n"),
            "/srv/jobs/daily.toml:3: options.retires: ",
            "unknown key `retires` in [options] (did you mean `retries`?); it takes `cache`, `retries`",
        ),
        (
            format!("{range}[step]\nfilter = \"id > 1\"\n"),
            "/srv/jobs/daily.toml:3: step: ",
            "unknown table `step` (did you mean `steps`?); a job file has name, source, sources, steps, sink, options",
        ),
        // No suggestion when nothing is close.
        (
            format!("{range}[[steps]]\nsort = [\"id\"]\nfrobnicate = true\n"),
            "steps[0].frobnicate: ",
            "unknown key `frobnicate` in a sort step; a sort step takes `sort`",
        ),
    ];
    for (text, location, message) in cases {
        let error = refusal("/srv/jobs/daily.toml", &text);
        assert!(error.starts_with("/srv/jobs/daily.toml:"), "{error}");
        assert!(
            error.contains(location),
            "{error:?} should contain {location:?}"
        );
        assert!(
            error.contains(message),
            "{error:?} should contain {message:?}"
        );
        if !message.contains("did you mean") {
            assert!(!error.contains("did you mean"), "{error}");
        }
    }
}

#[test]
fn the_keys_each_step_takes_are_accepted() {
    let file = r#"
[source]
range = 100

[[steps]]
with_column = { name = "g", expr = "id % 4" }

[[steps]]
repartition = 3
keys = ["g"]

[[steps]]
groupby = ["g"]
agg = ["count(*) as n"]

[options]
cache = "none"
retries = 1
"#;
    let parsed = parse_job_file("job.toml", file, builtins()).unwrap();
    let built = Dataset::range(100)
        .unwrap()
        .with_column("g", col("id") % lit(4i64))
        .unwrap()
        .repartition_by(3, &["g"])
        .unwrap()
        .groupby(&["g"])
        .agg(vec![floe_client::Aggregation::count_rows("n")])
        .unwrap();
    assert_eq!(parsed.dataset.fingerprint(), built.fingerprint());
}

#[test]
fn a_file_that_cannot_be_read_is_named() {
    let dir = tempfile::tempdir().unwrap();
    // A real Parquet file, written by the local executor.
    let out = dir.path().join("parquet");
    Dataset::range(50)
        .unwrap()
        .write_parquet(&out, floe_client::WriteOptions::default())
        .unwrap()
        .execute_locally()
        .unwrap();
    let parquet = std::fs::read_dir(&out)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.extension().is_some_and(|ext| ext == "parquet"))
        .unwrap();
    let good_csv = dir.path().join("good.csv");
    std::fs::write(&good_csv, "id\n1\n").unwrap();
    let named = |paths: &[&std::path::Path]| -> String {
        let list: Vec<String> = paths
            .iter()
            .map(|p| format!("{:?}", p.to_str().unwrap()))
            .collect();
        refusal(
            "job.toml",
            &format!("[source]\nread_csv = [{}]\n", list.join(", ")),
        )
    };
    for error in [named(&[&parquet]), named(&[&good_csv, &parquet])] {
        assert!(
            error.starts_with("job.toml:1: source.read_csv: "),
            "{error}"
        );
        assert!(
            error.contains(&format!("{}: ", parquet.display())),
            "the error should name {}: {error}",
            parquet.display()
        );
    }
    // A directory read as CSV: the glob's files are named.
    let glob = out.join("*");
    let error = named(&[&glob]);
    assert!(error.contains(&parquet.display().to_string()), "{error}");
}

#[test]
fn a_job_file_names_itself_joins_and_unions_named_sources_and_sets_sink_options() {
    let dir = tempfile::tempdir().unwrap();
    let orders = dir.path().join("orders.csv");
    let customers = dir.path().join("customers.csv");
    std::fs::write(&orders, "id,customer,amount\n1,7,2.5\n2,8,4.0\n").unwrap();
    std::fs::write(&customers, "customer,region\n7,north\n").unwrap();
    let out = dir.path().join("out");
    let file = format!(
        r#"
name = "orders by region"

[source]
read_csv = ["{orders}"]

[sources.customers]
read_csv = ["{customers}"]

[sources.more]
read_csv = ["{orders}"]

[[steps]]
union = ["more"]

[[steps]]
join = {{ with = "customers", on = ["customer"], how = "left" }}

[sink]
write_parquet = "{out}"
mode = "overwrite"
compression = "snappy"
"#,
        orders = orders.display(),
        customers = customers.display(),
        out = out.display()
    );
    let parsed = parse_job_file("job.toml", &file, builtins()).unwrap();
    assert_eq!(parsed.name.as_deref(), Some("orders by region"));
    let built = Dataset::read_csv(&[&orders])
        .unwrap()
        .union(&Dataset::read_csv(&[&orders]).unwrap())
        .unwrap()
        .join(
            &Dataset::read_csv(&[&customers]).unwrap(),
            &["customer"],
            JoinType::Left,
        )
        .unwrap()
        .write_parquet(
            &out,
            floe_client::WriteOptions {
                mode: WriteMode::Overwrite,
                compression: Some(floe_client::Compression::Snappy),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(parsed.dataset.fingerprint(), built.fingerprint());
    assert!(
        parsed
            .dataset
            .explain()
            .unwrap()
            .contains("compression=snappy")
    );

    // Mistakes name the field, and suggest.
    for (bad, field, problem) in [
        (
            "[source]\nrange = 3\n[[steps]]\njoin = { with = \"custmers\", on = [\"id\"] }\n\
             [sources.customers]\nrange = 2\n",
            "steps[0].join.with",
            "no source named `custmers` (did you mean `customers`?)",
        ),
        (
            "[source]\nrange = 3\n[[steps]]\nunion = [\"x\"]\n",
            "steps[0].union",
            "the file defines none",
        ),
        (
            "[source]\nrange = 3\n[sources.b]\nrange = 2\n[[steps]]\n\
             join = { with = \"b\", on = [\"id\"], how = \"lef\" }\n",
            "steps[0].join.how",
            "(did you mean `left`?)",
        ),
        (
            "[source]\nrange = 3\n[sink]\nwrite_json = \"/tmp/x\"\nmode = \"overwirte\"\n",
            "sink.mode",
            "(did you mean `overwrite`?)",
        ),
        (
            "[source]\nrange = 3\n[[steps]]\nfitler = \"id > 1\"\n",
            "steps[0].fitler",
            "(did you mean `filter`?)",
        ),
        (
            "[source]\nrange = 3\n[[steps]]\nfilter = \"id >\"\n",
            "steps[0].filter",
            "column 5: the expression ends too early",
        ),
    ] {
        let error = parse_job_file("job.toml", bad, builtins()).err().unwrap();
        assert_eq!(error.field, field, "{bad}: {error}");
        assert!(error.message.contains(problem), "{bad}: {error}");
    }
}

#[test]
fn file_sources_take_partitioning_and_sinks_partition_by_as_the_builder_does() {
    let dir = tempfile::tempdir().unwrap();
    for (day, hour) in [("2026-11-29", 1), ("2026-11-30", 2)] {
        let path = dir
            .path()
            .join(format!("events/day={day}/hour={hour}/part-0.txt"));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, format!("a line of {day}\n")).unwrap();
    }
    let events = dir.path().join("events");
    let out = dir.path().join("out");
    let file = format!(
        r#"
[source]
read_text = "{}"
partitioning = {{ day = "string", hour = "int64" }}

[[steps]]
filter = "hour >= 2"

[sink]
write_parquet = "{}"
partition_by = ["day"]
"#,
        events.display(),
        out.display()
    );
    let parsed = parse_job_file("job.toml", &file, builtins()).unwrap();
    let options = floe_client::ReadOptions {
        columns: None,
        partitioning: floe_client::Partitioning::Declared(vec![
            floe_client::PartitionColumn::new("day", floe_client::PartitionType::Utf8),
            floe_client::PartitionColumn::new("hour", floe_client::PartitionType::Int64),
        ]),
    };
    let built = Dataset::read_with(floe_client::FileFormat::Text, &[&events], &options)
        .unwrap()
        .filter(col("hour").gt_eq(lit(2i64)))
        .unwrap()
        .write_parquet(
            &out,
            floe_client::WriteOptions {
                partition_by: vec!["day".to_owned()],
                ..floe_client::WriteOptions::default()
            },
        )
        .unwrap();
    assert_eq!(parsed.dataset.fingerprint(), built.fingerprint());
    assert_eq!(
        parsed.dataset.column_names(),
        ["text", "day", "hour"],
        "the partition columns follow the file's"
    );

    // `"none"` reads the directories as plain ones; a binary source takes it too.
    let plain = format!(
        "[source]\nread_binary_files = \"{}\"\npartitioning = \"none\"\n",
        events.display()
    );
    let parsed = parse_job_file("job.toml", &plain, builtins()).unwrap();
    assert_eq!(parsed.dataset.column_names(), ["path", "bytes"]);

    for (bad, problem) in [
        (
            "[source]\nread_text = \"x\"\npartitioning = { day = \"date\" }\n",
            "unknown partition type",
        ),
        (
            "[source]\nread_text = \"x\"\npartitioning = \"spark\"\n",
            "expected \"hive\", \"none\"",
        ),
        (
            "[source]\nrange = 3\npartitioning = \"hive\"\n",
            "partitioning",
        ),
        (
            "[source]\nrange = 3\n[sink]\nwrite_parquet = \"/tmp/x\"\npartition_by = [\"id\"]\n",
            "partition_by names every column",
        ),
    ] {
        let error = refusal("bad.toml", bad);
        assert!(error.contains(problem), "{bad}: {error}");
    }
}
