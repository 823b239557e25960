use std::collections::BTreeMap;
use std::fs::File;
use std::time::{Duration, SystemTime};

use proptest::prelude::*;

use super::*;

fn transform(
    parent: &FingerprintInputs,
    name: &str,
    version: u32,
    args: &Args,
) -> FingerprintInputs {
    FingerprintInputs::Transform(
        TransformDescription::new(vec![parent.clone()], name, version, args).unwrap(),
    )
}

/// range(1000) -> map(expr, factor) -> filter(predicate) -> random_shuffle(seed 42).
fn golden_chain() -> Vec<FingerprintInputs> {
    let source = FingerprintInputs::Source(SourceDescription::range(1000));
    let map = transform(
        &source,
        "map",
        1,
        &Args::new()
            .arg("expr", "x * factor")
            .arg_with_default("factor", 2.5, 1.0)
            .performance("batch_size", 4096u64),
    );
    let filter = transform(&map, "filter", 2, &Args::new().arg("predicate", "x > 10"));
    let shuffle = transform(
        &filter,
        "random_shuffle",
        1,
        &Args::new().seed(Seed::new(42)),
    );
    vec![source, map, filter, shuffle]
}

/// These constants are the pinned encoding. If this test fails, every cached entry on every
/// cluster stops matching: change them only on purpose, together with the domain strings.
#[test]
fn golden_fingerprints_are_fixed_constants() {
    let shown: Vec<String> = golden_chain()
        .iter()
        .map(|inputs| inputs.fingerprint().to_string())
        .collect();
    assert_eq!(
        shown,
        [
            "93f4640a37d1e224efea11a90659057b",
            "d33dfc2b37f7e1c85e8d635ae6f45646",
            "b3b106cb38f5f7e2af326be3d45ba739",
            "9af5755060a0cacafc59891ee9264938",
        ]
    );
    assert_eq!(
        SourceDescription::in_memory(b"hello floe")
            .fingerprint()
            .to_string(),
        "58039fd4e3b2772cbe43fc2880035243"
    );
    assert_eq!(
        HashedArg::new("factor".into(), ArgValue::Float(2.5))
            .hash
            .to_string(),
        "bacc798e5736c956b071dce7f84818d8"
    );
}

/// The documented layout, rebuilt by hand and hashed in one shot, matches the streaming
/// encoder: length-prefixed domain, then fixed-width little-endian fields.
#[test]
fn the_encoding_is_the_documented_byte_layout() {
    fn prefixed(out: &mut Vec<u8>, bytes: &[u8]) {
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(bytes);
    }
    let mut range = Vec::new();
    prefixed(&mut range, b"floe.fingerprint.source.range.v1");
    range.extend_from_slice(&1000u64.to_le_bytes());
    let range_fp = crate::hash::xxh3_128(&range);
    assert_eq!(SourceDescription::range(1000).fingerprint().get(), range_fp);

    let mut arg = Vec::new();
    prefixed(&mut arg, b"floe.fingerprint.arg.v1");
    prefixed(&mut arg, b"factor");
    arg.push(4); // the Float tag
    arg.extend_from_slice(&2.5f64.to_bits().to_le_bytes());
    let arg_hash = crate::hash::xxh3_128(&arg);
    assert_eq!(
        HashedArg::new("factor".into(), ArgValue::Float(2.5))
            .hash
            .get(),
        arg_hash
    );

    let mut map = Vec::new();
    prefixed(&mut map, b"floe.fingerprint.transform.v1");
    map.extend_from_slice(&1u64.to_le_bytes());
    map.extend_from_slice(&range_fp.to_le_bytes());
    prefixed(&mut map, b"map");
    map.extend_from_slice(&1u32.to_le_bytes());
    map.extend_from_slice(&1u64.to_le_bytes());
    map.extend_from_slice(&arg_hash.to_le_bytes());
    let args = Args::new().arg_with_default("factor", 2.5, 1.0);
    assert_eq!(
        update(&[Fingerprint::new(range_fp)], "map", 1, &args)
            .unwrap()
            .get(),
        crate::hash::xxh3_128(&map)
    );
}

#[test]
fn update_agrees_with_the_description_it_summarizes() {
    let chain = golden_chain();
    let FingerprintInputs::Transform(map) = &chain[1] else {
        panic!("the second step is a transform")
    };
    let args = Args::new()
        .arg("expr", "x * factor")
        .arg_with_default("factor", 2.5, 1.0);
    assert_eq!(
        update(&[chain[0].fingerprint()], "map", 1, &args).unwrap(),
        map.fingerprint()
    );
    // The fingerprint is a function of the parent fingerprints only, not their descriptions.
    assert_ne!(
        update(&[chain[1].fingerprint()], "map", 1, &args).unwrap(),
        map.fingerprint()
    );
}

#[test]
fn display_and_parse_round_trip_and_reject_other_spellings() {
    let fingerprint = Fingerprint::new(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
    assert_eq!(fingerprint.to_string(), "0123456789abcdef0011223344556677");
    assert_eq!(
        fingerprint.to_string().parse::<Fingerprint>().unwrap(),
        fingerprint
    );
    for bad in [
        "0123456789ABCDEF0011223344556677",
        "abc",
        "+123456789abcdef0011223344556677",
    ] {
        assert!(matches!(
            bad.parse::<Fingerprint>(),
            Err(FingerprintError::Malformed(_))
        ));
    }
}

#[test]
fn serde_uses_hex_in_text_and_u128_in_binary() {
    let fingerprint = Fingerprint::new(0xfeed);
    let json = serde_json::to_string(&fingerprint).unwrap();
    assert_eq!(json, "\"0000000000000000000000000000feed\"");
    assert_eq!(
        serde_json::from_str::<Fingerprint>(&json).unwrap(),
        fingerprint
    );
    let bytes = crate::wire::codec::encode(&fingerprint).unwrap();
    assert_eq!(
        crate::wire::codec::decode::<Fingerprint>(&bytes, "fingerprint").unwrap(),
        fingerprint
    );
}

#[test]
fn an_argument_equal_to_its_default_does_not_change_the_fingerprint() {
    let parent = [Fingerprint::new(7)];
    let omitted = update(&parent, "map", 1, &Args::new().arg("expr", "x")).unwrap();
    let spelled_out = Args::new()
        .arg("expr", "x")
        .arg_with_default("batched", false, false);
    assert_eq!(update(&parent, "map", 1, &spelled_out).unwrap(), omitted);
    let changed = Args::new()
        .arg("expr", "x")
        .arg_with_default("batched", true, false);
    assert_ne!(update(&parent, "map", 1, &changed).unwrap(), omitted);
}

#[test]
fn performance_only_arguments_do_not_change_the_fingerprint() {
    let parent = [Fingerprint::new(7)];
    let base = update(&parent, "map", 1, &Args::new().arg("expr", "x")).unwrap();
    let tuned = Args::new()
        .performance("parallelism", 64u64)
        .arg("expr", "x")
        .performance("batch_size", 512u64)
        .performance("block_size", 1u64 << 27);
    assert_eq!(update(&parent, "map", 1, &tuned).unwrap(), base);
    // They are still carried for the executor.
    assert_eq!(tuned.get("batch_size"), Some(&ArgValue::UInt(512)));
    assert_eq!(tuned.get("absent"), None);
}

#[test]
fn a_version_bump_changes_the_fingerprint() {
    let parent = [Fingerprint::new(7)];
    let args = Args::new().arg("expr", "x");
    assert_ne!(
        update(&parent, "map", 1, &args).unwrap(),
        update(&parent, "map", 2, &args).unwrap()
    );
}

#[test]
fn parents_id_and_argument_names_all_matter_but_declaration_order_does_not() {
    let args = Args::new().arg("a", 1i64).arg("b", 2i64);
    let base = update(&[Fingerprint::new(1)], "map", 1, &args).unwrap();
    let reordered = Args::new().arg("b", 2i64).arg("a", 1i64);
    assert_eq!(
        update(&[Fingerprint::new(1)], "map", 1, &reordered).unwrap(),
        base
    );
    assert_ne!(
        update(&[Fingerprint::new(2)], "map", 1, &args).unwrap(),
        base
    );
    assert_ne!(
        update(&[Fingerprint::new(1)], "filter", 1, &args).unwrap(),
        base
    );
    let renamed = Args::new().arg("a", 1i64).arg("c", 2i64);
    assert_ne!(
        update(&[Fingerprint::new(1)], "map", 1, &renamed).unwrap(),
        base
    );
    let two_parents = [Fingerprint::new(1), Fingerprint::new(2)];
    let swapped = [Fingerprint::new(2), Fingerprint::new(1)];
    assert_ne!(
        update(&two_parents, "join", 1, &args).unwrap(),
        update(&swapped, "join", 1, &args).unwrap()
    );
}

#[test]
fn every_type_is_tagged_and_floats_hash_by_bits() {
    let hash = |value: ArgValue| HashedArg::new("x".into(), value).hash;
    let ones = [
        hash(ArgValue::Int(1)),
        hash(ArgValue::UInt(1)),
        hash(ArgValue::Float(1.0)),
        hash(ArgValue::Str("1".into())),
        hash(ArgValue::Bytes(vec![1])),
        hash(ArgValue::Bool(true)),
        hash(ArgValue::List(vec![ArgValue::Int(1)])),
        hash(ArgValue::Fingerprint(Fingerprint::new(1))),
    ];
    for (i, a) in ones.iter().enumerate() {
        for b in &ones[i + 1..] {
            assert_ne!(a, b);
        }
    }
    assert_ne!(hash(ArgValue::Float(0.0)), hash(ArgValue::Float(-0.0)));
    assert_eq!(
        hash(ArgValue::Float(f64::NAN)),
        hash(ArgValue::Float(f64::NAN))
    );
    assert_eq!(ArgValue::Float(f64::NAN), ArgValue::Float(f64::NAN));
    assert_ne!(ArgValue::Float(0.0), ArgValue::Float(-0.0));
}

#[test]
fn lengths_are_prefixed_so_concatenations_cannot_collide() {
    let hash = |value: ArgValue| HashedArg::new("x".into(), value).hash;
    let split = |a: &str, b: &str| ArgValue::List(vec![a.into(), b.into()]);
    assert_ne!(hash(split("ab", "c")), hash(split("a", "bc")));
    assert_ne!(
        HashedArg::new("ab".into(), "c".into()).hash,
        HashedArg::new("a".into(), "bc".into()).hash
    );
    let nested = ArgValue::List(vec![ArgValue::List(vec![]), ArgValue::Null]);
    let flat = ArgValue::List(vec![ArgValue::List(vec![ArgValue::Null])]);
    assert_ne!(hash(nested), hash(flat));
}

#[test]
fn maps_hash_in_key_order_whatever_the_insertion_order() {
    let mut forward = BTreeMap::new();
    forward.insert("a".to_owned(), ArgValue::Int(1));
    forward.insert("b".to_owned(), ArgValue::Int(2));
    let mut backward = BTreeMap::new();
    backward.insert("b".to_owned(), ArgValue::Int(2));
    backward.insert("a".to_owned(), ArgValue::Int(1));
    assert_eq!(
        HashedArg::new("m".into(), forward.into()).hash,
        HashedArg::new("m".into(), backward.into()).hash
    );
}

#[test]
fn a_duplicate_argument_is_an_error() {
    let args = Args::new().arg("x", 1i64).performance("x", 2i64);
    let error = update(&[], "map", 1, &args).unwrap_err();
    assert!(matches!(error, FingerprintError::DuplicateArgument { name } if name == "x"));
}

#[test]
fn touching_a_source_file_changes_the_fingerprint() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.csv");
    let b = dir.path().join("b.csv");
    std::fs::write(&a, "x\n1\n").unwrap();
    std::fs::write(&b, "x\n2\n").unwrap();
    let base = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    File::options()
        .write(true)
        .open(&a)
        .unwrap()
        .set_modified(base)
        .unwrap();
    File::options()
        .write(true)
        .open(&b)
        .unwrap()
        .set_modified(base)
        .unwrap();

    let before = SourceDescription::files([&a, &b]).unwrap();
    // Order, duplicates and spelling (a relative `..` detour) do not matter.
    let detour = dir.path().join("sub");
    std::fs::create_dir(&detour).unwrap();
    let same = SourceDescription::files([b.clone(), detour.join("../a.csv"), a.clone()]).unwrap();
    assert_eq!(same.fingerprint(), before.fingerprint());

    File::options()
        .write(true)
        .open(&a)
        .unwrap()
        .set_modified(base + Duration::from_nanos(1))
        .unwrap();
    let touched = SourceDescription::files([&a, &b]).unwrap();
    assert_ne!(touched.fingerprint(), before.fingerprint());
    let FingerprintInputs::Source(SourceDescription::Files(stamps)) =
        FingerprintInputs::Source(touched.clone())
    else {
        panic!("a file source")
    };
    assert_eq!(stamps[0].path, std::fs::canonicalize(&a).unwrap());
    assert_eq!(stamps[0].modified_nanos, 1);

    let differences =
        FingerprintInputs::Source(touched).differences(&FingerprintInputs::Source(before));
    assert_eq!(differences.len(), 1);
    assert!(
        matches!(&differences[0], Difference::FileChanged { requested, .. } if requested.path.ends_with("a.csv"))
    );
}

#[test]
fn a_missing_source_file_is_an_error_naming_it() {
    let error = SourceDescription::files(["/nonexistent/floe/input.parquet"]).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("/nonexistent/floe/input.parquet")
    );
}

#[test]
fn range_and_in_memory_sources_hash_what_they_hold() {
    assert_eq!(
        SourceDescription::range(10).fingerprint(),
        SourceDescription::range(10).fingerprint()
    );
    assert_ne!(
        SourceDescription::range(10).fingerprint(),
        SourceDescription::range(11).fingerprint()
    );
    assert_ne!(
        SourceDescription::in_memory(b"abc").fingerprint(),
        SourceDescription::in_memory(b"abd").fingerprint()
    );
    assert_eq!(
        SourceDescription::in_memory(b"abc").fingerprint(),
        SourceDescription::in_memory(&b"xabc"[1..]).fingerprint()
    );
}

#[test]
fn unseeded_submissions_differ_and_a_resubmitted_plan_matches_itself() {
    let source = FingerprintInputs::Source(SourceDescription::range(100));
    let submit = |seed: Option<u64>| {
        let seed = Seed::resolve(seed).unwrap();
        transform(&source, "random_shuffle", 1, &Args::new().seed(seed))
    };
    let first = submit(None);
    let second = submit(None);
    assert_ne!(first.fingerprint(), second.fingerprint());
    // The plan stores the drawn seed: shipping it to a driver and fingerprinting again (a retry
    // or a restarted driver) lands on the same entry.
    let shipped: FingerprintInputs =
        serde_json::from_str(&serde_json::to_string(&first).unwrap()).unwrap();
    let FingerprintInputs::Transform(shipped) = shipped else {
        panic!("a transform")
    };
    let recomputed = update(
        &[source.fingerprint()],
        "random_shuffle",
        1,
        &Args::new().seed(Seed::new(shipped.args()[0].value_as_seed())),
    )
    .unwrap();
    assert_eq!(recomputed, first.fingerprint());
    assert_eq!(submit(Some(9)).fingerprint(), submit(Some(9)).fingerprint());
}

impl HashedArg {
    fn value_as_seed(&self) -> u64 {
        match self.value {
            ArgValue::UInt(seed) => seed,
            _ => panic!("seeds are unsigned"),
        }
    }
}

#[test]
fn differences_name_the_argument_or_the_parent_that_changed() {
    let chain = golden_chain();
    let source = &chain[0];
    let map = |factor: f64| {
        transform(
            source,
            "map",
            1,
            &Args::new()
                .arg("expr", "x * factor")
                .arg_with_default("factor", factor, 1.0),
        )
    };
    let filter = |parent: &FingerprintInputs, version: u32| {
        transform(
            parent,
            "filter",
            version,
            &Args::new().arg("predicate", "x > 10"),
        )
    };
    let stored = filter(&map(2.5), 2);

    assert!(stored.differences(&stored.clone()).is_empty());

    let deep = filter(&map(3.0), 2).differences(&stored);
    assert_eq!(
        deep,
        [Difference::Parent {
            transform: "filter@2".into(),
            index: 0,
            differences: vec![Difference::Argument {
                transform: "map@1".into(),
                name: "factor".into(),
                change: ArgChange::Changed {
                    requested: ArgValue::Float(3.0),
                    stored: ArgValue::Float(2.5),
                },
            }],
        }]
    );
    assert_eq!(
        deep[0].to_string(),
        "input 0 of filter@2 differs: argument `factor` of map@1 is 3.0, the cached entry used 2.5"
    );

    let defaulted = filter(&map(1.0), 2).differences(&stored);
    assert!(matches!(
        &defaulted[0],
        Difference::Parent { differences, .. }
            if differences == &[Difference::Argument {
                transform: "map@1".into(),
                name: "factor".into(),
                change: ArgChange::Removed(ArgValue::Float(2.5)),
            }]
    ));

    let bumped = filter(&map(2.5), 3).differences(&stored);
    assert_eq!(
        bumped,
        [Difference::Version {
            transform: "filter".into(),
            requested: 3,
            stored: 2
        }]
    );

    let other = transform(&map(2.5), "sort", 1, &Args::new().arg("key", "x"));
    assert!(matches!(
        other.differences(&stored)[..],
        [Difference::Operation { .. }]
    ));
    assert!(other.distance(&stored) > filter(&map(3.0), 3).distance(&stored));
    assert_eq!(filter(&map(3.0), 3).distance(&stored), 2);
}

#[test]
fn descriptions_survive_a_json_round_trip_exactly() {
    let source = FingerprintInputs::Source(SourceDescription::range(5));
    let odd = transform(
        &source,
        "fill_null",
        1,
        &Args::new()
            .arg("value", f64::NAN)
            .arg("bytes", ArgValue::Bytes(vec![0, 255]))
            .arg("neg", -0.0),
    );
    let back: FingerprintInputs =
        serde_json::from_str(&serde_json::to_string(&odd).unwrap()).unwrap();
    assert_eq!(back, odd);
    assert_eq!(back.fingerprint(), odd.fingerprint());
}

#[test]
fn a_deep_lineage_serializes_flat_and_decodes_consistently() {
    let mut plan = FingerprintInputs::Source(SourceDescription::range(10));
    for index in 0..300i64 {
        plan = transform(&plan, "map", 1, &Args::new().arg("step", index));
    }
    // JSON nests only a few levels however deep the plan (serde_json stops at 128).
    let json = serde_json::to_string(&plan).unwrap();
    let back: FingerprintInputs = serde_json::from_str(&json).unwrap();
    assert_eq!(back, plan);
    let bytes = crate::wire::codec::encode(&plan).unwrap();
    let back: FingerprintInputs = crate::wire::codec::decode(&bytes, "lineage").unwrap();
    assert_eq!(back.fingerprint(), plan.fingerprint());
}

#[test]
fn a_shared_parent_is_stored_once() {
    let source = FingerprintInputs::Source(SourceDescription::range(10));
    let left = transform(&source, "map", 1, &Args::new().arg("side", "left"));
    let right = transform(&source, "map", 1, &Args::new().arg("side", "right"));
    let join = FingerprintInputs::Transform(
        TransformDescription::new(vec![left, right], "join", 1, &Args::new().arg("on", "id"))
            .unwrap(),
    );
    let json = serde_json::to_value(&join).unwrap();
    assert_eq!(json["nodes"].as_array().unwrap().len(), 4);
    assert_eq!(
        serde_json::from_value::<FingerprintInputs>(json).unwrap(),
        join
    );
}

#[test]
fn decoding_recomputes_fingerprints_and_rejects_malformed_tables() {
    let chain = golden_chain();
    let mut json = serde_json::to_value(&chain[2]).unwrap();
    // Editing a recorded value changes the decoded fingerprint: nothing stored is trusted.
    let text = json.to_string().replace("x > 10", "x > 11");
    let edited: FingerprintInputs = serde_json::from_str(&text).unwrap();
    assert_ne!(edited.fingerprint(), chain[2].fingerprint());

    json["nodes"][1]["Transform"]["parents"] = serde_json::json!([1]);
    let error = serde_json::from_value::<FingerprintInputs>(json).unwrap_err();
    assert!(error.to_string().contains("does not precede it"), "{error}");

    let unsorted = serde_json::json!({"nodes": [
        {"Source": {"Range": {"n": 1}}},
        {"Transform": {"transform": "map", "version": 1, "parents": [0],
            "args": [["b", "Null"], ["a", "Null"]]}}
    ]});
    let error = serde_json::from_value::<FingerprintInputs>(unsorted).unwrap_err();
    assert!(error.to_string().contains("not sorted"), "{error}");
    let empty = serde_json::json!({"nodes": []});
    assert!(serde_json::from_value::<FingerprintInputs>(empty).is_err());
}

proptest! {
    #[test]
    fn fingerprints_round_trip_through_text(value: u128) {
        let fingerprint = Fingerprint::new(value);
        prop_assert_eq!(fingerprint.to_string().parse::<Fingerprint>().unwrap(), fingerprint);
    }

    #[test]
    fn distinct_strings_get_distinct_argument_hashes(a in ".{0,12}", b in ".{0,12}") {
        let ha = HashedArg::new("s".into(), a.clone().into()).hash;
        let hb = HashedArg::new("s".into(), b.clone().into()).hash;
        prop_assert_eq!(ha == hb, a == b);
    }
}
