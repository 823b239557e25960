//! Fuzzing the job-spec reader (proptest): whatever text arrives — from `floe submit` or the
//! REST API — it answers with a spec or an error, never a panic or a stack overflow.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use floe_client::Registry;
use floe_client::jobspec::{PathPolicy, parse_expr, parse_job_file_with};
use proptest::prelude::*;

fn parse(text: &str) -> Result<(), String> {
    let udfs = Arc::new(Registry::with_builtins());
    parse_job_file_with(
        "fuzz",
        text,
        udfs,
        &PathPolicy::submitted(floe_core::config::AllowedPaths::any()),
    )
    .map(drop)
    .map_err(|error| error.to_string())
}

/// Fragments of the spec format, so random files get past the TOML parser often.
fn spec_fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("[source]\nrange = 100\n".to_owned()),
        Just("[source]\nread_csv = [\"/nonexistent/*.csv\"]\n".to_owned()),
        Just("[[steps]]\n".to_owned()),
        Just("[sink]\nwrite_parquet = \"/tmp/x\"\n".to_owned()),
        Just("[options]\nretries = 2\n".to_owned()),
        "[a-z_]{1,10} = \"[ -~]{0,20}\"\n",
        "filter = \"[ -~]{0,40}\"\n",
        "with_column = \\{ name = \"[a-z]{1,5}\", expr = \"[ -~]{0,30}\" \\}\n",
        "groupby = \\[\"[a-z]{1,4}\"\\]\nagg = \\[\"[ -~]{0,20}\"\\]\n",
        "[ -~\n]{0,40}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_text_is_a_spec_or_an_error(text in "[ -~\n\t]{0,400}") {
        let _ = parse(&text);
    }

    #[test]
    fn spec_shaped_text_is_a_spec_or_an_error(parts in prop::collection::vec(spec_fragment(), 0..8)) {
        let _ = parse(&parts.concat());
    }

    #[test]
    fn expression_shaped_text_parses_or_errs(text in "[a-z0-9 ()+*/%<>=!'.,-]{0,200}") {
        let _ = parse_expr(&text);
    }
}

#[test]
fn deep_nesting_is_refused_before_it_can_exhaust_the_stack() {
    for open in ["(", "not ", "-", "lower("] {
        let text = format!("{}a", open.repeat(100_000));
        let error = parse_expr(&text).unwrap_err();
        assert!(
            error.message.contains("nested more than") || error.message.contains("tokens"),
            "{open:?}: {error}"
        );
    }
    let chain = vec!["a"; 50_000].join(" + ");
    assert!(parse_expr(&chain).unwrap_err().message.contains("tokens"));
    // Within the limits, nesting still works.
    let nested = format!("{}a{}", "(".repeat(60), ")".repeat(60));
    assert_eq!(parse_expr(&nested).unwrap().to_string(), "col(\"a\")");
    let spec = format!(
        "[source]\nrange = 3\n[[steps]]\nfilter = \"{}a > 1\"\n",
        "(".repeat(100)
    );
    assert!(parse(&spec).unwrap_err().contains("nested more than"));
}
