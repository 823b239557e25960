//! Every job-spec example in the README and in `docs/*.md` is a valid job file: each
//! ```` ```toml ```` block with a `[source]` table is checked whole, and each block of steps
//! alone (a fragment showing one step) is checked after a `range` source.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use floe_client::jobspec::check_job_file;

/// The README and every Markdown file in `docs/`.
fn documents() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// Each fenced `toml` block of `text`, with the line it starts on.
fn toml_blocks(text: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (index, line) in text.lines().enumerate() {
        match (&mut current, line.trim_start()) {
            (None, fence) if fence.starts_with("```toml") => {
                current = Some((index + 2, String::new()))
            }
            (Some(_), "```") => blocks.extend(current.take()),
            (Some((_, block)), _) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    assert!(current.is_none(), "an unclosed ```toml block");
    blocks
}

/// Whether a block is a job spec (whole, or steps alone) rather than, say, a configuration.
fn job_spec(block: &str) -> Option<String> {
    let has = |table: &str| block.lines().any(|line| line.trim() == table);
    if has("[source]") {
        Some(block.to_owned())
    } else if has("[[steps]]") {
        Some(format!("[source]\nrange = 1\n\n{block}"))
    } else {
        None
    }
}

#[test]
fn every_job_spec_example_in_the_docs_parses() {
    let mut checked = 0;
    let mut failures = Vec::new();
    for document in documents() {
        let text = std::fs::read_to_string(&document).unwrap();
        for (line, block) in toml_blocks(&text) {
            let Some(spec) = job_spec(&block) else {
                continue;
            };
            let name = format!("{}:{line}", document.display());
            if let Err(error) = check_job_file(&name, &spec) {
                failures.push(format!("{error}\n{block}"));
            }
            checked += 1;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    // The README's example, PROCESS_UDFS.md's and JOBSPEC.md's dozens: a broken extractor
    // that finds nothing must not pass.
    assert!(checked >= 20, "only {checked} examples found");
}

#[test]
fn the_checker_refuses_what_the_docs_once_had() {
    // An inline table spanning lines is not TOML.
    let multi_line =
        "[source]\nrange = 1\n[[steps]]\nmap_batches = { command = \"python3\",\n    args = [] }\n";
    assert!(check_job_file("old.toml", multi_line).is_err());
    let misspelled = "[source]\nrange = 1\n[[steps]]\nfiltr = \"id > 1\"\n";
    let error = check_job_file("typo.toml", misspelled).unwrap_err();
    assert!(error.message.contains("did you mean `filter`"), "{error}");
}
