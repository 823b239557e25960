use std::path::PathBuf;

use arrow_schema::{DataType, Field, Schema};

use super::optimizer::{Optimizer, PushFilters, PushLimits, PushProjections, Rule};
use super::physical::PhysicalPlan;
use super::*;
use crate::expr::{col, lit, when};
use crate::fingerprint::FileStamp;

/// A catalog with two UDFs, enough to check how plans use a catalog.
struct TestCatalog {
    signatures: Vec<UdfSignature>,
}

impl TestCatalog {
    fn new() -> Self {
        Self {
            signatures: vec![
                UdfSignature::new("scale", 1, UdfKind::RowPreserving)
                    .param("column", ParamType::Str, "column to scale")
                    .param_with_default("factor", ParamType::Float, 1.0, "multiplier"),
                UdfSignature::new("explode", 2, UdfKind::RowChanging),
            ],
        }
    }
}

impl UdfCatalog for TestCatalog {
    fn signature(&self, name: &str, version: u32) -> Option<&UdfSignature> {
        self.signatures
            .iter()
            .find(|s| s.name == name && s.version == version)
    }

    fn registered(&self) -> Vec<String> {
        self.signatures
            .iter()
            .map(|s| format!("{}@{}", s.name, s.version))
            .collect()
    }

    fn output_schema(
        &self,
        _call: &UdfCall,
        params: &UdfParams,
        input: &Schema,
        operator: &str,
    ) -> Result<Schema, PlanError> {
        if let Some(column) = params.str("column") {
            input
                .column_with_name(column)
                .ok_or_else(|| PlanError::unknown_column(operator, column, input))?;
        }
        Ok(input.clone())
    }
}

fn stamp(name: &str, size: u64) -> FileStamp {
    FileStamp {
        path: PathBuf::from(format!("/data/{name}")),
        size,
        modified_secs: 1_700_000_000,
        modified_nanos: 0,
        version: None,
    }
}

fn sales_schema() -> Schema {
    Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("region", DataType::Utf8, true),
        Field::new("price", DataType::Float64, true),
        Field::new("qty", DataType::Int32, false),
    ])
}

fn parquet(files: Vec<FileStamp>) -> LogicalPlan {
    LogicalPlan::read(FileScan::new(FileFormat::Parquet, files, sales_schema())).unwrap()
}

fn sales() -> LogicalPlan {
    parquet(vec![stamp("a.parquet", 100), stamp("b.parquet", 200)])
}

fn names(plan: &LogicalPlan) -> Vec<String> {
    plan.schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect()
}

/// Every node of a linear pipeline, from the source up.
fn chain(plan: &LogicalPlan) -> Vec<LogicalPlan> {
    let mut nodes = vec![plan.clone()];
    while let Some(input) = nodes.last().and_then(|n| n.inputs().first().cloned()) {
        nodes.push(input);
    }
    nodes.reverse();
    nodes
}

/// The pipeline used by the fingerprint test, with one argument chosen by `variant`.
fn pipeline(variant: usize) -> LogicalPlan {
    let pick =
        |index: usize, normal: i64, changed: i64| if variant == index { changed } else { normal };
    let files = vec![stamp("a.parquet", 100 + pick(0, 0, 1) as u64)];
    parquet(files)
        .with_column("total", col("price") * lit(pick(1, 2, 3)))
        .unwrap()
        .filter(col("qty").gt(lit(pick(2, 1, 2) as i32)))
        .unwrap()
        .udf(
            UdfCall::new("scale", 1)
                .with("column", "price")
                .with("factor", pick(3, 2, 4) as f64),
            UdfKind::RowPreserving,
            None,
            &TestCatalog::new(),
        )
        .unwrap()
        .sort(vec![if variant == 4 {
            SortKey::desc("total")
        } else {
            SortKey::asc("total")
        }])
        .unwrap()
        .limit(pick(5, 10, 11) as u64)
        .unwrap()
}

#[test]
fn changing_one_argument_changes_every_downstream_fingerprint_and_none_upstream() {
    let base = chain(&pipeline(usize::MAX));
    // Variant i changes an argument of node i (node 0 is the source: its file size).
    let changed_node = [0, 1, 2, 3, 4, 5];
    for (variant, &changed) in changed_node.iter().enumerate() {
        let other = chain(&pipeline(variant));
        assert_eq!(other.len(), base.len());
        for (index, (a, b)) in base.iter().zip(&other).enumerate() {
            if index < changed {
                assert_eq!(
                    a.fingerprint(),
                    b.fingerprint(),
                    "variant {variant} node {index}"
                );
            } else {
                assert_ne!(
                    a.fingerprint(),
                    b.fingerprint(),
                    "variant {variant} node {index}"
                );
            }
        }
    }
    // Building the same pipeline twice gives the same fingerprints.
    let again = chain(&pipeline(usize::MAX));
    for (a, b) in base.iter().zip(&again) {
        assert_eq!(a.fingerprint(), b.fingerprint());
    }
}

#[test]
fn defaults_and_performance_arguments_are_not_hashed() {
    let catalog = TestCatalog::new();
    let scaled = |call: UdfCall, batch: Option<u64>| {
        sales()
            .udf(call, UdfKind::RowPreserving, batch, &catalog)
            .unwrap()
            .fingerprint()
    };
    let implicit = scaled(UdfCall::new("scale", 1).with("column", "price"), None);
    let explicit = scaled(
        UdfCall::new("scale", 1)
            .with("column", "price")
            .with("factor", 1.0),
        Some(4096),
    );
    assert_eq!(implicit, explicit);
    assert_ne!(
        implicit,
        scaled(
            UdfCall::new("scale", 1)
                .with("column", "price")
                .with("factor", 1.5),
            None
        )
    );
    // cache() marks an output; it does not change what the data is.
    assert_eq!(
        sales().cache().unwrap().fingerprint(),
        sales().fingerprint()
    );
    // Two reads of the same files in another order are the same source.
    let reordered = parquet(vec![stamp("b.parquet", 200), stamp("a.parquet", 100)]);
    assert_eq!(reordered.fingerprint(), sales().fingerprint());
    let mut unsorted = FileScan::new(FileFormat::Parquet, Vec::new(), sales_schema());
    unsorted.files = vec![stamp("b.parquet", 200), stamp("a.parquet", 100)];
    assert_eq!(
        LogicalPlan::read(unsorted).unwrap().fingerprint(),
        sales().fingerprint()
    );
}

#[test]
fn schema_inference_through_row_wise_operators() {
    let plan = sales()
        .with_column("total", col("price") * col("qty"))
        .unwrap()
        .drop_columns(&["region"])
        .unwrap()
        .rename(&[("qty", "quantity")])
        .unwrap()
        .select(&["total", "id", "quantity"])
        .unwrap();
    assert_eq!(names(&plan), vec!["total", "id", "quantity"]);
    assert_eq!(
        plan.schema().field(0),
        &Field::new("total", DataType::Float64, true)
    );
    // with_column on an existing name replaces it in place.
    let replaced = sales()
        .with_column("qty", col("qty").cast(DataType::Utf8))
        .unwrap();
    assert_eq!(names(&replaced), names(&sales()));
    assert_eq!(replaced.schema().field(3).data_type(), &DataType::Utf8);
    let range = LogicalPlan::range(5).unwrap();
    assert_eq!(
        range.schema(),
        &Schema::new(vec![Field::new("id", DataType::Int64, false)])
    );
    let projected = LogicalPlan::read(FileScan {
        projection: Some(vec!["price".into(), "id".into()]),
        ..FileScan::new(FileFormat::Parquet, vec![stamp("a", 1)], sales_schema())
    })
    .unwrap();
    assert_eq!(names(&projected), vec!["id", "price"]);
}

#[test]
fn schema_inference_through_all_to_all_operators() {
    let aggregated = sales()
        .aggregate(
            &["region"],
            vec![
                Aggregation::count_rows("n"),
                Aggregation::of(AggFunction::Sum, "qty"),
                Aggregation::of(AggFunction::Mean, "price"),
                Aggregation::of(AggFunction::Min, "region").alias("first_region"),
                Aggregation::of(AggFunction::Std, "price"),
                Aggregation::of(AggFunction::CountDistinct, "id"),
                Aggregation::of(AggFunction::Max, "price"),
            ],
        )
        .unwrap();
    let fields: Vec<(String, DataType, bool)> = aggregated
        .schema()
        .fields()
        .iter()
        .map(|f| (f.name().clone(), f.data_type().clone(), f.is_nullable()))
        .collect();
    let expected = vec![
        ("region", DataType::Utf8, true),
        ("n", DataType::Int64, false),
        ("sum_qty", DataType::Int64, true),
        ("mean_price", DataType::Float64, true),
        ("first_region", DataType::Utf8, true),
        ("std_price", DataType::Float64, true),
        ("count_distinct_id", DataType::Int64, false),
        ("max_price", DataType::Float64, true),
    ];
    let expected: Vec<(String, DataType, bool)> = expected
        .into_iter()
        .map(|(n, t, b)| (n.to_owned(), t, b))
        .collect();
    assert_eq!(fields, expected);

    let regions = LogicalPlan::read(FileScan::new(
        FileFormat::Json,
        vec![stamp("r.json", 5)],
        Schema::new(vec![
            Field::new("region", DataType::Utf8, false),
            Field::new("price", DataType::Float64, false),
        ]),
    ))
    .unwrap();
    let joined = sales()
        .join(&regions, &["region"], &["region"], JoinType::Left)
        .unwrap();
    assert_eq!(
        names(&joined),
        vec!["id", "region", "price", "qty", "price_right"]
    );
    assert!(joined.schema().field(4).is_nullable());
    let semi = sales()
        .join(&regions, &["region"], &["region"], JoinType::Anti)
        .unwrap();
    assert_eq!(semi.schema(), sales().schema());
    let full = sales()
        .join(&regions, &["region"], &["region"], JoinType::Full)
        .unwrap();
    assert!(
        full.schema().field(0).is_nullable(),
        "left id under full join"
    );

    for plan in [
        sales()
            .sort(vec![SortKey::desc("price"), SortKey::asc("id")])
            .unwrap(),
        sales().repartition(4, &[]).unwrap(),
        sales().repartition(4, &["region"]).unwrap(),
        sales().random_shuffle(Some(7)).unwrap(),
        sales().union(&sales()).unwrap(),
        sales().cache().unwrap(),
        sales().limit(3).unwrap(),
    ] {
        assert_eq!(
            plan.schema(),
            sales().schema(),
            "{}",
            plan.operator().name()
        );
    }
    assert_eq!(
        names(&sales().unique(&["region", "qty"]).unwrap()),
        vec!["region", "qty"]
    );
}

fn error_text(result: Result<LogicalPlan, PlanError>) -> String {
    result.unwrap_err().to_string()
}

#[test]
fn validation_errors_name_operator_column_and_types() {
    let available = "id Int64 not null, region Utf8, price Float64, qty Int32 not null";
    assert_eq!(
        error_text(sales().select(&["id", "prize"])),
        format!("select: unknown column \"prize\" (available: {available})")
    );
    assert_eq!(
        error_text(sales().filter(col("price") + lit(1.0))),
        "filter: expected a Boolean predicate, but (col(\"price\") + 1.0) has type Float64"
    );
    assert_eq!(
        error_text(sales().with_column("up", col("price").upper())),
        "with_column(\"up\"): expected Utf8 for upper, but col(\"price\") has type Float64"
    );
    let other = LogicalPlan::range(3).unwrap();
    assert_eq!(
        error_text(sales().join(&other, &["id"], &["key"], JoinType::Inner)),
        "join(inner): key \"key\" is missing on the right side (available: id Int64 not null)"
    );
    assert_eq!(
        error_text(other.join(&sales(), &["key"], &["id"], JoinType::Semi)),
        format!(
            "join(semi): key \"key\" is missing on the left side (available: id Int64 not null)"
        )
    );
    assert_eq!(
        error_text(sales().join(&other, &["region"], &["id"], JoinType::Inner)),
        "join(inner): key types differ: left \"region\" is Utf8, right \"id\" is Int64"
    );
    assert_eq!(
        error_text(sales().union(&other)),
        format!("union: schemas differ: left has {available}, right has id Int64 not null")
    );
    assert_eq!(
        error_text(sales().aggregate(
            &["region"],
            vec![Aggregation::of(AggFunction::Mean, "region")]
        )),
        "aggregate: expected a numeric column for mean, but col(\"region\") has type Utf8"
    );
    assert_eq!(
        error_text(sales().rename(&[("id", "qty")])),
        "rename: column \"qty\" appears more than once"
    );
    assert_eq!(
        error_text(sales().repartition(0, &[])),
        "repartition: needs 1 to 65536 partitions, got 0"
    );
    let catalog = TestCatalog::new();
    let map_batches_error =
        |call: UdfCall| error_text(sales().udf(call, UdfKind::RowPreserving, None, &catalog));
    assert_eq!(
        map_batches_error(UdfCall::new("scale", 2)),
        "map_batches(scale): unknown UDF \"scale\"@2 (registered: scale@1, explode@2)"
    );
    assert_eq!(
        map_batches_error(UdfCall::new("scale", 1)),
        "map_batches(scale): scale@1 needs parameter \"column\""
    );
    assert_eq!(
        map_batches_error(
            UdfCall::new("scale", 1)
                .with("column", "price")
                .with("factor", "x")
        ),
        "map_batches(scale): scale@1 parameter \"factor\" must be Float, got \"x\""
    );
    assert_eq!(
        map_batches_error(UdfCall::new("explode", 2)),
        "map_batches(explode): this UDF may change the row count: use flat_map"
    );
    assert!(
        sales()
            .udf(
                UdfCall::new("explode", 2),
                UdfKind::RowChanging,
                None,
                &catalog
            )
            .is_ok()
    );
}

#[test]
fn udf_calls_are_rechecked_against_the_running_binary() {
    let plan = sales()
        .udf(
            UdfCall::new("scale", 1).with("column", "price"),
            UdfKind::RowPreserving,
            None,
            &TestCatalog::new(),
        )
        .unwrap()
        .limit(3)
        .unwrap();
    plan.check_udfs(&TestCatalog::new()).unwrap();
    // Another binary whose scale@1 has a different default factor.
    let mut other = TestCatalog::new();
    other.signatures[0] = UdfSignature::new("scale", 1, UdfKind::RowPreserving)
        .param("column", ParamType::Str, "column to scale")
        .param_with_default("factor", ParamType::Float, 2.0, "multiplier");
    assert_eq!(
        plan.check_udfs(&other).unwrap_err().to_string(),
        "map_batches(scale): scale@1 differs between the client and this binary (kind, \
         parameters or output schema); rebuild them from the same sources"
    );
    other.signatures.remove(0);
    assert_eq!(
        plan.check_udfs(&other).unwrap_err().to_string(),
        "map_batches(scale): unknown UDF \"scale\"@1 (registered: explode@2)"
    );
}

#[test]
fn lineage_matches_the_fingerprint_and_explains_a_change() {
    let build = |threshold: i32, file_size: u64| {
        parquet(vec![stamp("a.parquet", file_size)])
            .filter(col("qty").gt(lit(threshold)))
            .unwrap()
            .cache()
            .unwrap()
            .join(
                &LogicalPlan::range(4).unwrap(),
                &["id"],
                &["id"],
                JoinType::Semi,
            )
            .unwrap()
    };
    let plan = build(1, 100);
    let lineage = plan.lineage().unwrap();
    assert_eq!(lineage.fingerprint(), plan.fingerprint());
    assert!(
        lineage
            .differences(&build(1, 100).lineage().unwrap())
            .is_empty()
    );
    // The join's first parent is the (cached) filter, whose `predicate` argument changed.
    let changed = build(2, 100).lineage().unwrap();
    let differences = lineage.differences(&changed);
    let crate::fingerprint::Difference::Parent {
        index, differences, ..
    } = &differences[0]
    else {
        panic!("{differences:?}");
    };
    assert_eq!(*index, 0);
    assert!(matches!(
        &differences[0],
        crate::fingerprint::Difference::Argument { name, .. } if name == "predicate"
    ));
    // A touched file shows up as a changed file, however deep.
    let touched = build(1, 101).lineage().unwrap();
    let text = format!("{:?}", lineage.differences(&touched));
    assert!(text.contains("FileChanged"), "{text}");
}

#[test]
fn a_join_fingerprint_follows_both_sides() {
    let left = |n| LogicalPlan::range(n).unwrap();
    let right = |n| {
        LogicalPlan::range(n)
            .unwrap()
            .with_column("v", lit(1))
            .unwrap()
    };
    let join = |l, r| {
        left(l)
            .join(&right(r), &["id"], &["id"], JoinType::Inner)
            .unwrap()
            .fingerprint()
    };
    assert_eq!(join(5, 6), join(5, 6));
    assert_ne!(join(5, 6), join(5, 7));
    assert_ne!(join(5, 6), join(4, 6));
    // Sides are ordered: swapping them is another join.
    let swapped = right(6)
        .join(&left(5), &["id"], &["id"], JoinType::Inner)
        .unwrap();
    assert_ne!(swapped.fingerprint(), join(5, 6));
}

#[test]
fn sizes_a_plan_cannot_represent_or_run_are_refused() {
    let error = LogicalPlan::range(u64::MAX).unwrap_err().to_string();
    assert!(error.contains("exceeds the largest Int64"), "{error}");
    assert!(LogicalPlan::range(i64::MAX as u64).is_ok());
    let range = LogicalPlan::range(10).unwrap();
    let error = range.repartition(u32::MAX, &[]).unwrap_err().to_string();
    assert!(error.contains("needs 1 to 65536 partitions"), "{error}");
    assert!(range.repartition(65_536, &[]).is_ok());
}

#[test]
fn right_and_full_joins_make_a_key_nullable_when_the_right_key_can_be_null() {
    // `id` of range is a non-nullable Int64; the right key is a nullable Int64 or an Int32.
    let left = LogicalPlan::range(5).unwrap();
    let nullable_right = LogicalPlan::range(5)
        .unwrap()
        .with_column(
            "k",
            when(col("id").gt(lit(2i64)), col("id"), crate::expr::null()),
        )
        .unwrap();
    let narrower_right = LogicalPlan::range(5)
        .unwrap()
        .with_column("k", col("id").cast(DataType::Int32))
        .unwrap();
    let same_right = LogicalPlan::range(5)
        .unwrap()
        .rename(&[("id", "k")])
        .unwrap();
    let key_nullable = |right: &LogicalPlan, how| {
        let joined = left.join(right, &["id"], &["k"], how).unwrap();
        joined.schema().field_with_name("id").unwrap().is_nullable()
    };
    for how in [JoinType::Right, JoinType::Full] {
        assert!(key_nullable(&nullable_right, how), "{how:?}");
        assert!(key_nullable(&narrower_right, how), "{how:?}");
        assert!(!key_nullable(&same_right, how), "{how:?}");
    }
    assert!(!key_nullable(&nullable_right, JoinType::Inner));
    assert!(!key_nullable(&nullable_right, JoinType::Left));
}

#[test]
fn seeds_are_drawn_at_submission_and_hashed() {
    let unseeded = sales().random_shuffle(None).unwrap().limit(5).unwrap();
    assert!(matches!(
        unseeded.check_resolved(),
        Err(PlanError::UnresolvedSeed { .. })
    ));
    let first = unseeded.resolve_seeds().unwrap();
    let second = unseeded.resolve_seeds().unwrap();
    first.check_resolved().unwrap();
    assert_ne!(first.fingerprint(), second.fingerprint());
    // Resolving again keeps the drawn seed: a retry reuses its own cache entries.
    assert_eq!(
        first.resolve_seeds().unwrap().fingerprint(),
        first.fingerprint()
    );
    let seeded = |seed| sales().random_shuffle(Some(seed)).unwrap().fingerprint();
    assert_eq!(seeded(1), seeded(1));
    assert_ne!(seeded(1), seeded(2));
}

#[test]
fn plans_round_trip_through_the_wire_codec() {
    let right = LogicalPlan::range(10).unwrap();
    let plan = sales()
        .with_column("k", col("id") % lit(3i64))
        .unwrap()
        .join(&right, &["k"], &["id"], JoinType::Inner)
        .unwrap()
        .write(WriteSpec {
            format: FileFormat::Csv(CsvOptions::default()),
            directory: PathBuf::from("/out"),
            target_file_size: DEFAULT_TARGET_FILE_SIZE,
            mode: WriteMode::Overwrite,
            compression: Compression::Uncompressed,
            partition_by: Vec::new(),
        })
        .unwrap();
    let bytes = crate::wire::codec::encode(&plan).unwrap();
    let decoded: LogicalPlan = crate::wire::codec::decode(&bytes, "plan").unwrap();
    assert_eq!(decoded.fingerprint(), plan.fingerprint());
    assert_eq!(decoded.display_tree(), plan.display_tree());
}

#[test]
fn a_sink_refuses_a_relative_directory_and_a_codec_its_format_lacks() {
    let spec = |directory: &str, format: FileFormat, compression: Compression| WriteSpec {
        format,
        directory: PathBuf::from(directory),
        target_file_size: DEFAULT_TARGET_FILE_SIZE,
        mode: WriteMode::Error,
        compression,
        partition_by: Vec::new(),
    };
    let plan = LogicalPlan::range(3).unwrap();
    let relative = plan
        .write(spec("out", FileFormat::Parquet, Compression::Zstd))
        .unwrap_err()
        .to_string();
    assert!(
        relative.contains("the directory out is relative"),
        "{relative}"
    );
    let csv = plan
        .write(spec("/out", FileFormat::Json, Compression::Zstd))
        .unwrap_err()
        .to_string();
    assert!(
        csv.contains("compression zstd applies to Parquet only"),
        "{csv}"
    );
    plan.write(spec("/out", FileFormat::Json, Compression::Uncompressed))
        .unwrap();
}

#[test]
fn a_file_named_twice_is_read_twice() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.csv");
    std::fs::write(&path, "x\n1\n").unwrap();
    let stamp = crate::fingerprint::FileStamp::of(&path).unwrap();
    let schema = Schema::new(vec![Field::new("x", DataType::Int64, true)]);
    let scan = |files: Vec<_>| {
        FileScan::new(
            FileFormat::Csv(CsvOptions::default()),
            files,
            schema.clone(),
        )
    };
    let once = LogicalPlan::read(scan(vec![stamp.clone()])).unwrap();
    let twice = LogicalPlan::read(scan(vec![stamp.clone(), stamp])).unwrap();
    assert_eq!(read_of(&twice).files.len(), 2);
    assert_ne!(once.fingerprint(), twice.fingerprint());
}

fn read_of(plan: &LogicalPlan) -> FileScan {
    let mut node = plan.clone();
    loop {
        if let Operator::Read(scan) = node.operator() {
            return scan.clone();
        }
        node = node.inputs()[0].clone();
    }
}

#[test]
fn filters_move_into_parquet_reads_through_projections_and_renames() {
    let plan = sales()
        .rename(&[("price", "cost")])
        .unwrap()
        .select(&["id", "cost"])
        .unwrap()
        .filter(col("cost").gt(lit(10.0)))
        .unwrap()
        .filter(col("id").lt(lit(100i64)))
        .unwrap();
    let optimized = Optimizer::new(vec![Box::new(PushFilters)])
        .optimize(&plan)
        .unwrap();
    let scan = read_of(&optimized);
    assert_eq!(
        scan.predicate,
        Some(col("price").gt(lit(10.0)).and(col("id").lt(lit(100i64))))
    );
    assert!(
        chain(&optimized)
            .iter()
            .all(|n| !matches!(n.operator(), Operator::Filter { .. }))
    );
    assert_eq!(optimized.schema(), plan.schema());
    // CSV readers cannot skip data by statistics: the filter stays a filter.
    let csv = LogicalPlan::read(FileScan::new(
        FileFormat::Csv(CsvOptions::default()),
        vec![stamp("a.csv", 1)],
        sales_schema(),
    ))
    .unwrap()
    .filter(col("qty").gt(lit(1)))
    .unwrap();
    let optimized = PushFilters.apply(&csv).unwrap();
    assert_eq!(read_of(&optimized).predicate, None);
    // A filter never moves below the with_column that defines its column.
    let defined = sales()
        .with_column("t", col("qty") * lit(2))
        .unwrap()
        .filter(col("t").gt(lit(4i64)))
        .unwrap();
    assert!(matches!(
        PushFilters.apply(&defined).unwrap().operator(),
        Operator::Filter { .. }
    ));
}

#[test]
fn projections_move_into_reads() {
    let plan = sales()
        .with_column("total", col("price") * lit(2.0))
        .unwrap()
        .drop_columns(&["region"])
        .unwrap()
        .select(&["total", "id"])
        .unwrap();
    let optimized = PushProjections.apply(&plan).unwrap();
    assert_eq!(
        read_of(&optimized).projection,
        Some(vec!["id".to_owned(), "price".to_owned()])
    );
    assert_eq!(optimized.schema(), plan.schema());
    // The drop of a column no longer read disappears with it.
    assert!(
        chain(&optimized)
            .iter()
            .all(|n| !matches!(n.operator(), Operator::Drop { .. }))
    );
    let aggregated = sales()
        .aggregate(&["region"], vec![Aggregation::of(AggFunction::Sum, "qty")])
        .unwrap();
    assert_eq!(
        read_of(&PushProjections.apply(&aggregated).unwrap()).projection,
        Some(vec!["region".to_owned(), "qty".to_owned()])
    );
    // A UDF may read any column: nothing is pruned below it.
    let udf = sales()
        .udf(
            UdfCall::new("scale", 1).with("column", "price"),
            UdfKind::RowPreserving,
            None,
            &TestCatalog::new(),
        )
        .unwrap()
        .select(&["id"])
        .unwrap();
    assert_eq!(
        read_of(&PushProjections.apply(&udf).unwrap()).projection,
        None
    );
}

#[test]
fn an_aggregate_takes_only_the_columns_it_reads_from_the_stage_before_it() {
    // `total` is made from `price`, and only `total` is summed: `price` is dropped right
    // after `total` is made, in the stage that reads it, instead of crossing the shuffle.
    let plan = sales()
        .with_column("total", col("price") * lit(2.0))
        .unwrap()
        .aggregate(
            &["region"],
            vec![Aggregation::of(AggFunction::Sum, "total")],
        )
        .unwrap();
    let optimized = PushProjections.apply(&plan).unwrap();
    let ops: Vec<&'static str> = chain(&optimized)
        .iter()
        .map(|n| n.operator().name())
        .collect();
    assert_eq!(
        ops,
        vec!["read_parquet", "with_column", "select", "aggregate"]
    );
    assert_eq!(names(&optimized.inputs()[0]), ["region", "total"]);
    assert_eq!(
        read_of(&optimized).projection,
        Some(vec!["region".to_owned(), "price".to_owned()])
    );
    assert_eq!(optimized.schema(), plan.schema());
    // Applied again, the rule changes nothing.
    let again = PushProjections.apply(&optimized).unwrap();
    assert_eq!(again.fingerprint(), optimized.fingerprint());
    // A count of rows reads no column: its input is left whole rather than emptied.
    let counted = sales()
        .with_column("total", col("price") * lit(2.0))
        .unwrap()
        .aggregate(&[], vec![Aggregation::count_rows("n")])
        .unwrap();
    let optimized = PushProjections.apply(&counted).unwrap();
    assert!(
        chain(&optimized)
            .iter()
            .all(|n| !matches!(n.operator(), Operator::Select { .. }))
    );
}

#[test]
fn limits_move_down_and_merge() {
    let plan = sales()
        .with_column("x", col("qty") + lit(1))
        .unwrap()
        .limit(10)
        .unwrap()
        .limit(4)
        .unwrap();
    let optimized = Optimizer::new(vec![Box::new(PushLimits)])
        .optimize(&plan)
        .unwrap();
    let ops: Vec<&'static str> = chain(&optimized)
        .iter()
        .map(|n| n.operator().name())
        .collect();
    assert_eq!(ops, vec!["read_parquet", "limit", "with_column"]);
    assert_eq!(read_of(&optimized).limit, Some(4));
    let range = LogicalPlan::range(100).unwrap().limit(7).unwrap();
    assert_eq!(
        PushLimits.apply(&range).unwrap().fingerprint(),
        LogicalPlan::range(7).unwrap().fingerprint()
    );
    // Filters change the row count: a limit stays above them.
    let filtered = sales()
        .filter(col("qty").gt(lit(1)))
        .unwrap()
        .limit(3)
        .unwrap();
    assert_eq!(
        PushLimits.apply(&filtered).unwrap().fingerprint(),
        filtered.fingerprint()
    );
    // Once the filter is inside the read, the read applies it before its limit, so the limit
    // may join it; but a filter never moves into a read that already limits.
    let optimized = Optimizer::default().optimize(&filtered).unwrap();
    let scan = read_of(&optimized);
    assert!(scan.predicate.is_some());
    assert_eq!(scan.limit, Some(3));
    let limited_first = sales()
        .limit(3)
        .unwrap()
        .filter(col("qty").gt(lit(1)))
        .unwrap();
    let optimized = Optimizer::default().optimize(&limited_first).unwrap();
    assert!(matches!(optimized.operator(), Operator::Filter { .. }));
    assert_eq!(read_of(&optimized).predicate, None);
}

#[test]
fn row_wise_operators_fuse_into_their_read_stage() {
    let plan = sales()
        .filter(col("qty").gt(lit(1)))
        .unwrap()
        .with_column("total", col("price") * col("qty"))
        .unwrap()
        .sort(vec![SortKey::asc("total")])
        .unwrap()
        .with_column("rank", col("total") + lit(1.0))
        .unwrap()
        .select(&["rank"])
        .unwrap();
    let physical = PhysicalPlan::from_logical(&plan);
    let kinds: Vec<String> = physical
        .stages
        .iter()
        .map(|s| format!("{}+{}", s.kind.name(), s.row_ops.len()))
        .collect();
    assert_eq!(kinds, vec!["read+2", "sort+0", "map+2"]);
    assert_eq!(
        physical.stage(physical.output).fingerprint,
        plan.fingerprint()
    );
    assert_eq!(physical.stages[0].inputs, vec![]);
    assert_eq!(physical.stages[2].inputs, vec![physical::StageId(1)]);
    // A read consumed twice (a self-join) cannot absorb either consumer's operators.
    let doubled = sales().with_column("two", lit(2)).unwrap();
    let shared = sales();
    let joined = shared
        .filter(col("qty").gt(lit(1)))
        .unwrap()
        .union(&shared.filter(col("qty").lt(lit(1))).unwrap())
        .unwrap();
    let physical = PhysicalPlan::from_logical(&joined);
    assert_eq!(physical.stages.len(), 4, "{physical}");
    // Two equal subplans built separately are one stage.
    let twice = sales().union(&sales()).unwrap();
    let physical = PhysicalPlan::from_logical(&twice);
    assert_eq!(physical.stages.len(), 2, "{physical}");
    assert_eq!(physical.stages[1].inputs, vec![physical::StageId(0); 2]);
    // Optimized, each branch's filter becomes its own read's predicate: two reads, no maps.
    let optimized = Optimizer::default().optimize(&joined).unwrap();
    let physical = PhysicalPlan::from_logical(&optimized);
    let kinds: Vec<&str> = physical.stages.iter().map(|s| s.kind.name()).collect();
    assert_eq!(kinds, vec!["read", "read", "union"]);
    // cache() shares its input's fingerprint but stays a stage.
    let cached = sales().cache().unwrap();
    assert_eq!(PhysicalPlan::from_logical(&cached).stages.len(), 2);
    assert_eq!(PhysicalPlan::from_logical(&doubled).stages.len(), 1);
}

#[test]
fn explain_prints_logical_optimized_and_physical_plans() {
    let plan = sales()
        .filter(col("price").gt(lit(5.0)))
        .unwrap()
        .select(&["id"])
        .unwrap()
        .limit(3)
        .unwrap();
    let text = plan.explain().unwrap();
    let logical = text.find("== Logical plan ==").unwrap();
    let optimized = text.find("== Optimized plan ==").unwrap();
    let physical = text.find("== Physical plan ==").unwrap();
    assert!(logical < optimized && optimized < physical);
    assert!(
        text[optimized..physical]
            .contains("projection=[id, price] predicate=(col(\"price\") > 5.0)")
    );
    assert!(text[physical..].contains("stage 0: read_parquet files=2"));
    assert!(text[physical..].contains("then select [id]"));
    assert!(text.contains(&plan.fingerprint().to_string()));
    assert_eq!(
        Optimizer::default().rule_names(),
        vec!["push_filters", "push_projections", "push_limits"]
    );
}

#[test]
fn process_udfs_hash_file_contents_and_command_but_not_pool_settings() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("udf.py");
    std::fs::write(&script, "OFFSET = 1\n").unwrap();
    let udf = || {
        ProcessUdf::new("python3", &[script.to_str().unwrap()])
            .file(&script)
            .unwrap()
    };
    let base = sales().process_udf(udf()).unwrap();
    assert_eq!(
        base.schema(),
        sales().schema(),
        "no output schema: the input's"
    );

    // Pool size, memory, timeout and batch size are performance only.
    let tuned = udf()
        .concurrency(Concurrency::new(2, 8))
        .memory(1 << 30)
        .timeout_ms(5_000)
        .batch_size(100);
    assert_eq!(
        sales().process_udf(tuned).unwrap().fingerprint(),
        base.fingerprint()
    );

    // Rewriting the same bytes (a new modification time) keeps the fingerprint.
    std::fs::write(&script, "OFFSET = 1\n").unwrap();
    assert_eq!(
        sales().process_udf(udf()).unwrap().fingerprint(),
        base.fingerprint()
    );

    // Editing the script, the command, its arguments or the output schema changes it.
    let mut changed = vec![
        sales()
            .process_udf(ProcessUdf::new("python3.12", &[script.to_str().unwrap()]))
            .unwrap(),
        sales()
            .process_udf(udf().output_schema(Schema::new(vec![Field::new(
                "x",
                DataType::Int64,
                true,
            )])))
            .unwrap(),
    ];
    let mut with_arg = udf();
    with_arg.args.push("--fast".to_owned());
    changed.push(sales().process_udf(with_arg).unwrap());
    std::fs::write(&script, "OFFSET = 2\n").unwrap();
    changed.push(sales().process_udf(udf()).unwrap());
    for plan in &changed {
        assert_ne!(plan.fingerprint(), base.fingerprint(), "{plan:?}");
    }
    assert_ne!(udf().pool_key().unwrap(), {
        std::fs::write(&script, "OFFSET = 3\n").unwrap();
        udf().pool_key().unwrap()
    });

    // A process UDF may change the row count: a limit stays above it.
    assert!(!Operator::ProcessUdf(udf()).preserves_rows());
}

#[test]
fn inline_code_with_an_identity_is_fingerprinted_by_it_not_by_its_bytes() {
    let inline = |payload: &str, identity: &str| {
        ProcessUdf::new("python3", &["-c", "import floe_udf", payload]).code_identity(identity)
    };
    let fingerprint = |udf| sales().process_udf(udf).unwrap().fingerprint();
    // Two serializations of the same code share a fingerprint; other code does not.
    assert_eq!(
        fingerprint(inline("pickle-a", "code-1")),
        fingerprint(inline("pickle-b", "code-1"))
    );
    assert_ne!(
        fingerprint(inline("pickle-a", "code-1")),
        fingerprint(inline("pickle-a", "code-2"))
    );
    // Without an identity the arguments are the code.
    assert_ne!(
        fingerprint(ProcessUdf::new(
            "python3",
            &["-c", "import floe_udf", "pickle-a"]
        )),
        fingerprint(ProcessUdf::new(
            "python3",
            &["-c", "import floe_udf", "pickle-b"]
        ))
    );
    // A pinned script is identified by its content: an identity beside it is refused.
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("udf.py");
    std::fs::write(&script, "pass\n").unwrap();
    let scripted = ProcessUdf::new("python3", &[script.to_str().unwrap()])
        .file(&script)
        .unwrap()
        .code_identity("code-1");
    let error = sales().process_udf(scripted).unwrap_err().to_string();
    assert!(error.contains("inline code only"), "{error}");
}

#[test]
fn process_udf_settings_are_validated() {
    let bad = [
        (ProcessUdf::new(" ", &[]), "the command is empty"),
        (
            ProcessUdf::new("python3", &[]).concurrency(Concurrency::new(3, 2)),
            "got (3, 2)",
        ),
        (
            ProcessUdf::new("python3", &[]).timeout_ms(0),
            "timeout must be positive",
        ),
        (
            ProcessUdf::new("python3", &[]).batch_size(0),
            "batch_size must be positive",
        ),
        (ProcessUdf::new("python3", &["a\0b"]), "NUL byte"),
        (
            ProcessUdf::new("python3", &[]).env("FLOE_CLUSTER_TOKEN", "x"),
            "may not declare",
        ),
        (
            ProcessUdf::new("python3", &[]).env("PATH", "/tmp"),
            "may not declare",
        ),
        (
            ProcessUdf::new("python3", &[]).env("LD_PRELOAD", "/x.so"),
            "may not declare",
        ),
        (
            ProcessUdf::new("python3", &[]).env("PYTHONUSERBASE", "/tmp/x"),
            "may not declare",
        ),
        (
            ProcessUdf::new("python3", &[]).env("NODE_OPTIONS", "--require /tmp/x.js"),
            "may not declare",
        ),
        (
            ProcessUdf::new("python3", &[]).env("A=B", "x"),
            "not a valid variable",
        ),
    ];
    for (udf, expected) in bad {
        let error = error_text(sales().process_udf(udf));
        assert!(
            error.starts_with("map_batches(") && error.contains(expected),
            "{error}"
        );
    }
    let missing = ProcessUdf::new("python3", &[]).file(std::path::Path::new("/no/such/udf.py"));
    assert!(missing.is_err());
}

#[test]
fn a_file_digest_streams_to_the_hash_of_its_bytes_and_refuses_devices() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.bin");
    // Over the 1 MiB read chunk, so the streamed hash crosses chunk boundaries.
    let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    let digest = crate::fingerprint::FileDigest::of(&path).unwrap();
    assert_eq!(digest.content, crate::fingerprint::FileDigest::hash(&bytes));
    assert!(crate::fingerprint::FileDigest::of(std::path::Path::new("/dev/zero")).is_err());
    assert!(crate::fingerprint::FileDigest::of(dir.path()).is_err());
}

#[test]
fn a_udf_env_is_part_of_its_fingerprint_and_pool() {
    let plain = ProcessUdf::new("python3", &["/srv/udf.py"]);
    let with_env = plain.clone().env("MODEL", "small");
    // Settings of how Python runs may be declared.
    sales()
        .process_udf(with_env.clone().env("PYTHONUNBUFFERED", "1"))
        .unwrap();
    assert_ne!(
        sales().process_udf(plain.clone()).unwrap().fingerprint(),
        sales().process_udf(with_env.clone()).unwrap().fingerprint()
    );
    assert_ne!(plain.pool_key().unwrap(), with_env.pool_key().unwrap());
}

#[test]
fn udf_code_comes_from_a_pinned_script_under_the_roots_unless_inline_is_allowed() {
    let roots = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let script = roots.path().join("udf.py");
    let outside = elsewhere.path().join("udf.py");
    std::fs::write(&script, "pass\n").unwrap();
    std::fs::write(&outside, "pass\n").unwrap();
    let pinned = |path: &std::path::Path, options: &[&str]| {
        let digest = crate::fingerprint::FileDigest::of(path).unwrap();
        let mut args: Vec<&str> = options.to_vec();
        let path = digest.path.to_str().unwrap().to_owned();
        args.push(&path);
        args.push("--fast");
        ProcessUdf::new("python3", &args).pinned(digest.clone())
    };
    let policy = UdfCodePolicy {
        roots: vec![roots.path().to_owned()],
        allow_inline: false,
    };
    policy.check(&pinned(&script, &[])).unwrap();
    policy.check(&pinned(&script, &["-u", "-B"])).unwrap();

    let refused = [
        (
            ProcessUdf::new("python3", &["-c", "print(1)"]),
            "\"-c\" comes before the script",
        ),
        (
            ProcessUdf::new("python3", &["-m", "http.server"]),
            "\"-m\" comes before",
        ),
        (
            ProcessUdf::new("python3", &["-Sc", "print(1)"]),
            "\"-Sc\" comes before",
        ),
        (ProcessUdf::new("python3", &["-"]), "stdin"),
        (ProcessUdf::new("python3", &[]), "names no script"),
        (
            ProcessUdf::new("python3", &["/srv/udf.py"]),
            "not a file the UDF pins",
        ),
    ];
    for (udf, reason) in refused {
        let error = policy.check_command_line(&udf).unwrap_err().to_string();
        assert!(
            error.contains(reason) && error.contains("node.udf_allow_inline"),
            "{error}"
        );
        assert!(policy.check(&udf).is_err());
    }
    // A pinned script outside the roots passes the submitter's check, not the node's.
    let stray = pinned(&outside, &[]);
    policy.check_command_line(&stray).unwrap();
    let error = policy.check(&stray).unwrap_err().to_string();
    assert!(error.contains("is not under node.udf_roots"), "{error}");
    // `..` does not leave a root.
    let escaping = roots
        .path()
        .join("..")
        .join(elsewhere.path().file_name().unwrap());
    let mut sneaky = pinned(&outside, &[]);
    sneaky.args[0] = escaping.join("udf.py").to_str().unwrap().to_owned();
    sneaky.files[0].path = escaping.join("udf.py");
    assert!(
        policy
            .check(&sneaky)
            .unwrap_err()
            .to_string()
            .contains("node.udf_roots")
    );
    // No roots: nothing runs.
    let error = UdfCodePolicy::default()
        .check(&pinned(&script, &[]))
        .unwrap_err();
    assert!(error.to_string().contains("node.udf_roots ([])"), "{error}");

    let inline = UdfCodePolicy {
        roots: Vec::new(),
        allow_inline: true,
    };
    inline
        .check(&ProcessUdf::new("python3", &["-c", "print(1)"]))
        .unwrap();
    inline.check(&stray).unwrap();
}
