//! Process UDFs: `map_batches` by a long-lived child process in any language (Python first).
//!
//! The plan holds what to run (command, arguments), what it runs on (the content hash of every
//! file the user names, [`FileDigest`]) and what it must produce (the output schema), all
//! hashed into the fingerprint, plus how to run it (the per-node pool size, a memory hint,
//! rows per call and a timeout), which is performance only and never hashed. The node crate
//! runs it (`floe_engine::udf::process`); the protocol between a worker and the child is in
//! `docs/PROCESS_UDFS.md`.
//!
//! What a node lets a process UDF run is [`UdfCodePolicy`]: a script file under
//! `node.udf_roots`, never code passed inline (`-c`, `-m`, stdin), unless
//! `node.udf_allow_inline` says otherwise.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow_schema::Schema;
use serde::{Deserialize, Serialize};

use super::PlanError;
use crate::config::NodeConfig;
use crate::fingerprint::{ArgValue, Args, FileDigest, Fingerprint, update};

/// The default time a child has to answer one batch (and to start and greet).
pub const DEFAULT_PROCESS_TIMEOUT_MS: u64 = 300_000;
/// The largest pool a node keeps for one process UDF.
pub const MAX_PROCESS_CONCURRENCY: u32 = 1024;
/// Interpreter options that may come before a UDF's script: they change how it runs, never
/// what code runs.
pub const SCRIPT_OPTIONS: [&str; 8] = ["-u", "-B", "-O", "-OO", "-s", "-S", "-I", "-q"];
/// Variables a UDF may not declare: the node sets `FLOE_*` and `PYTHONPATH` itself, `PATH`
/// decides which program the command names, and the others make an interpreter or the loader
/// run code from outside the script (`LD_PRELOAD`, `PYTHONUSERBASE`'s `.pth` files,
/// `NODE_OPTIONS=--require`, …).
const RESERVED_ENV: [&str; 9] = [
    "PATH",
    "BASH_ENV",
    "ENV",
    "GCONV_PATH",
    "NODE_OPTIONS",
    "PERL5LIB",
    "PERL5OPT",
    "RUBYLIB",
    "RUBYOPT",
];
const RESERVED_ENV_PREFIXES: [&str; 3] = ["FLOE_", "LD_", "PYTHON"];
/// The `PYTHON*` variables a UDF may declare: they change how Python runs, never what runs.
const PYTHON_SETTINGS: [&str; 6] = [
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONFAULTHANDLER",
    "PYTHONHASHSEED",
    "PYTHONIOENCODING",
    "PYTHONUNBUFFERED",
    "PYTHONUTF8",
];

/// How many child processes a node keeps for one process UDF: at least `min` once it has been
/// used, at most `max` at a time. A task waits for a free child when all `max` are busy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Concurrency {
    pub min: u32,
    pub max: u32,
}

impl Concurrency {
    pub fn new(min: u32, max: u32) -> Self {
        Self { min, max }
    }
}

impl Default for Concurrency {
    /// One warm child, growing to one per CPU the node has (`max` 0 means "the node's CPUs").
    fn default() -> Self {
        Self { min: 1, max: 0 }
    }
}

/// A process UDF as a user describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessUdf {
    /// The program, looked up on the node's `PATH` (e.g. `python3`). A node only runs commands
    /// listed in its `node.udf_commands`.
    pub command: String,
    pub args: Vec<String>,
    /// Files the process reads (the script and what it imports), hashed by content.
    pub files: Vec<FileDigest>,
    /// What the process returns; `None` means the input's schema.
    pub output_schema: Option<Schema>,
    pub concurrency: Concurrency,
    /// Bytes of heap one child needs; a placement hint, 0 for none.
    pub memory: u64,
    /// Rows per call; `None` sends each block whole.
    pub batch_size: Option<u64>,
    /// How long one call (or the child's start) may take before the child is killed.
    pub timeout_ms: u64,
    /// The child's environment besides `PATH`, `PYTHONPATH` and `FLOE_UDF_FD`: it inherits
    /// nothing from the node.
    pub env: BTreeMap<String, String>,
    /// For inline code only (`-c` and its serialized function in `args`): what the code is,
    /// hashed into the fingerprint instead of `args`, whose serialized bytes differ between
    /// runs of the same code (the Python client's function hash).
    #[serde(default)]
    pub code_identity: Option<String>,
}

impl ProcessUdf {
    /// A UDF run as `command args…`, with default pool, no files and the input's schema.
    pub fn new(command: impl Into<String>, args: &[&str]) -> Self {
        Self {
            command: command.into(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            files: Vec::new(),
            output_schema: None,
            concurrency: Concurrency::default(),
            memory: 0,
            batch_size: None,
            timeout_ms: DEFAULT_PROCESS_TIMEOUT_MS,
            env: BTreeMap::new(),
            code_identity: None,
        }
    }

    /// Fingerprints this inline code by `identity` rather than by its command line.
    pub fn code_identity(mut self, identity: impl Into<String>) -> Self {
        self.code_identity = Some(identity.into());
        self
    }

    /// Sets a variable in the child's environment.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// Adds a file whose content the output depends on (hashed now).
    pub fn file(self, path: &Path) -> Result<Self, PlanError> {
        Ok(self.pinned(FileDigest::of(path)?))
    }

    /// Adds a file already hashed.
    pub fn pinned(mut self, digest: FileDigest) -> Self {
        self.files.push(digest);
        self.files.sort();
        self.files.dedup();
        self
    }

    pub fn output_schema(mut self, schema: Schema) -> Self {
        self.output_schema = Some(schema);
        self
    }

    pub fn concurrency(mut self, concurrency: Concurrency) -> Self {
        self.concurrency = concurrency;
        self
    }

    pub fn memory(mut self, bytes: u64) -> Self {
        self.memory = bytes;
        self
    }

    pub fn batch_size(mut self, rows: u64) -> Self {
        self.batch_size = Some(rows);
        self
    }

    pub fn timeout_ms(mut self, timeout_ms: u64) -> Self {
        self.timeout_ms = timeout_ms;
        self
    }

    /// The operator name errors use.
    pub fn label(&self) -> String {
        format!("map_batches({})", self.command_line())
    }

    /// `command arg…` as one line, for messages.
    pub fn command_line(&self) -> String {
        std::iter::once(self.command.as_str())
            .chain(self.args.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" ")
    }

    pub(crate) fn validate(&self) -> Result<(), PlanError> {
        let invalid = |message: &str| Err(PlanError::invalid(&self.label(), message));
        if self.command.trim().is_empty() {
            return invalid("the command is empty");
        }
        if self.command.contains('\0') || self.args.iter().any(|a| a.contains('\0')) {
            return invalid("the command line contains a NUL byte");
        }
        let Concurrency { min, max } = self.concurrency;
        if max > MAX_PROCESS_CONCURRENCY || (max != 0 && min > max) {
            return invalid(&format!(
                "concurrency must be 0 <= min <= max <= {MAX_PROCESS_CONCURRENCY} (max 0: one \
                 per CPU), got ({min}, {max})"
            ));
        }
        if self.timeout_ms == 0 {
            return invalid("the timeout must be positive");
        }
        if self.batch_size == Some(0) {
            return invalid("batch_size must be positive");
        }
        if self.code_identity.is_some() && self.script().is_ok() {
            return invalid(
                "a code identity replaces the arguments in the fingerprint of inline code only; \
                 a script is identified by its content",
            );
        }
        for (key, value) in &self.env {
            if key.is_empty() || key.contains(['=', '\0']) || value.contains('\0') {
                return invalid(&format!("env: {key:?} is not a valid variable"));
            }
            let reserved = RESERVED_ENV.contains(&key.as_str())
                || RESERVED_ENV_PREFIXES.iter().any(|p| key.starts_with(p));
            if reserved && !PYTHON_SETTINGS.contains(&key.as_str()) {
                return invalid(&format!(
                    "env: {key} is set by the node or runs code from outside the script; a UDF \
                     may not declare {}, or variables starting with {} (but {})",
                    RESERVED_ENV.join(", "),
                    RESERVED_ENV_PREFIXES.join(", "),
                    PYTHON_SETTINGS.join(", ")
                ));
            }
        }
        Ok(())
    }

    /// The pinned script this command line runs, if it is `command [SCRIPT_OPTIONS…] script
    /// [arg…]`; otherwise how it runs inline code.
    pub fn script(&self) -> Result<&FileDigest, InlineCode> {
        for arg in &self.args {
            if SCRIPT_OPTIONS.contains(&arg.as_str()) {
                continue;
            }
            if arg == "-" {
                return Err(InlineCode::Stdin);
            }
            if arg.starts_with('-') {
                return Err(InlineCode::OptionBeforeScript(arg.clone()));
            }
            return self
                .files
                .iter()
                .find(|file| file.path == Path::new(arg))
                .ok_or_else(|| InlineCode::ScriptNotPinned(arg.clone()));
        }
        Err(InlineCode::NoScript)
    }

    /// The semantic arguments (what the output depends on) and the performance-only ones.
    pub(crate) fn args(&self) -> Args {
        let strings =
            |items: &[String]| ArgValue::List(items.iter().map(|s| s.as_str().into()).collect());
        let files = self
            .files
            .iter()
            .map(|file| {
                ArgValue::List(vec![
                    file.path.to_string_lossy().into_owned().into(),
                    file.content.to_string().into(),
                ])
            })
            .collect();
        let schema = self
            .output_schema
            .as_ref()
            .map_or(ArgValue::Null, |schema| {
                ArgValue::List(
                    schema
                        .fields()
                        .iter()
                        .map(|field| {
                            ArgValue::List(vec![
                                field.name().as_str().into(),
                                field.data_type().to_string().into(),
                                field.is_nullable().into(),
                            ])
                        })
                        .collect(),
                )
            });
        let code = match &self.code_identity {
            Some(identity) => {
                ArgValue::List(vec!["code_identity".into(), identity.as_str().into()])
            }
            None => strings(&self.args),
        };
        let mut args = Args::new()
            .arg("command", self.command.as_str())
            .arg("args", code)
            .arg("files", ArgValue::List(files))
            .arg_with_default("output_schema", schema, ArgValue::Null)
            .arg_with_default("env", self.env_arg(), ArgValue::Map(BTreeMap::new()))
            .performance("concurrency_min", self.concurrency.min)
            .performance("concurrency_max", self.concurrency.max)
            .performance("memory", self.memory)
            .performance("timeout_ms", self.timeout_ms);
        if let Some(batch_size) = self.batch_size {
            args = args.performance("batch_size", batch_size);
        }
        args
    }

    /// Which pool of child processes serves this UDF on a node: equal for calls that run the
    /// same program on the same files, whatever their pool sizes.
    pub fn pool_key(&self) -> Result<Fingerprint, PlanError> {
        let args = Args::new()
            .arg(
                "command_line",
                ArgValue::List(
                    std::iter::once(&self.command)
                        .chain(&self.args)
                        .map(|s| s.as_str().into())
                        .collect(),
                ),
            )
            .arg(
                "files",
                ArgValue::List(
                    self.files
                        .iter()
                        .map(|f| f.content.to_string().into())
                        .collect(),
                ),
            )
            .arg("env", self.env_arg());
        Ok(update(&[], "process_udf_pool", 1, &args)?)
    }

    fn env_arg(&self) -> ArgValue {
        ArgValue::Map(
            self.env
                .iter()
                .map(|(key, value)| (key.clone(), value.as_str().into()))
                .collect(),
        )
    }
}

/// How a command line runs code that is not a pinned script.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InlineCode {
    #[error("`-` runs code read from stdin")]
    Stdin,
    #[error(
        "{0:?} comes before the script, and only {opts} may (-c, -m and other options that run \
         code from an argument are inline code)",
        opts = SCRIPT_OPTIONS.join(" ")
    )]
    OptionBeforeScript(String),
    #[error(
        "the script {0:?} is not a file the UDF pins (list it in `files`, by the same absolute path)"
    )]
    ScriptNotPinned(String),
    #[error("the command line names no script file (without one, an interpreter reads stdin)")]
    NoScript,
}

/// Why a node will not run a process UDF's code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UdfCodeRefused {
    #[error(
        "inline code is refused: {0}. A process UDF runs a script file under node.udf_roots; \
         node.udf_allow_inline = true allows inline code"
    )]
    Inline(InlineCode),
    #[error("the script {} does not exist", .0.display())]
    ScriptMissing(PathBuf),
    #[error(
        "the script {} is not under node.udf_roots ([{roots}]): this node runs UDF scripts \
         only from those directories",
        script.display()
    )]
    OutsideRoots { script: PathBuf, roots: String },
}

/// Where a node lets process-UDF code come from (`node.udf_roots`, `node.udf_allow_inline`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UdfCodePolicy {
    /// Directories a UDF's script must be under.
    pub roots: Vec<PathBuf>,
    /// Any command line the node's `udf_commands` allow runs, inline code included, and the
    /// roots are not checked (inline code could read a script from anywhere anyway).
    pub allow_inline: bool,
}

impl UdfCodePolicy {
    pub fn for_node(node: &NodeConfig) -> Self {
        Self {
            roots: node.udf_roots.clone(),
            allow_inline: node.udf_allow_inline,
        }
    }

    /// What a submitter can check without the node's files: no inline code.
    pub fn check_command_line(&self, udf: &ProcessUdf) -> Result<(), UdfCodeRefused> {
        if self.allow_inline {
            return Ok(());
        }
        udf.script().map(drop).map_err(UdfCodeRefused::Inline)
    }

    /// What a node checks before it starts a child: no inline code, and the script (symlinks
    /// and `..` resolved) under one of the roots.
    pub fn check(&self, udf: &ProcessUdf) -> Result<(), UdfCodeRefused> {
        if self.allow_inline {
            return Ok(());
        }
        let script = udf.script().map_err(UdfCodeRefused::Inline)?;
        let resolved = std::fs::canonicalize(&script.path)
            .map_err(|_| UdfCodeRefused::ScriptMissing(script.path.clone()))?;
        let under_a_root = self
            .roots
            .iter()
            .any(|root| std::fs::canonicalize(root).is_ok_and(|root| resolved.starts_with(root)));
        if under_a_root {
            return Ok(());
        }
        let roots = self
            .roots
            .iter()
            .map(|root| root.display().to_string())
            .collect::<Vec<_>>();
        Err(UdfCodeRefused::OutsideRoots {
            script: resolved,
            roots: roots.join(", "),
        })
    }
}
