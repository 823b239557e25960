//! What a fingerprint was computed from, kept so a cache miss can be explained.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::canonical::CanonicalHasher;
use super::{
    ArgValue, Args, FileStamp, Fingerprint, FingerprintError, HashedArg, SourceDescription,
};

/// The lineage behind a fingerprint: a source, or a transform over parent lineages.
///
/// It serializes as a flat table of nodes (see [`LineageTable`]), so a deep plan never nests
/// deeply in JSON or bincode, and decoding recomputes every fingerprint and sub-hash from the
/// recorded values: a decoded lineage is always consistent with itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "LineageTable", try_from = "LineageTable")]
pub enum FingerprintInputs {
    Source(SourceDescription),
    Transform(TransformDescription),
}

/// One transform applied to its parents, with the arguments that entered its fingerprint.
/// Serialized as part of a [`FingerprintInputs`], which recomputes it on decoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransformDescription {
    transform: String,
    version: u32,
    parents: Vec<FingerprintInputs>,
    args: Vec<HashedArg>,
    fingerprint: Fingerprint,
}

pub(crate) fn transform_fingerprint(
    parents: &[Fingerprint],
    transform: &str,
    version: u32,
    args: &[HashedArg],
) -> Fingerprint {
    let mut hasher = CanonicalHasher::new("floe.fingerprint.transform.v1");
    hasher.len(parents.len());
    parents
        .iter()
        .for_each(|parent| hasher.fingerprint(*parent));
    hasher.bytes(transform.as_bytes());
    hasher.u32(version);
    // Each sub-hash already covers the argument's name and tagged value.
    hasher.len(args.len());
    args.iter().for_each(|arg| hasher.fingerprint(arg.hash));
    hasher.finish()
}

impl TransformDescription {
    pub fn new(
        parents: Vec<FingerprintInputs>,
        transform: impl Into<String>,
        version: u32,
        args: &Args,
    ) -> Result<Self, FingerprintError> {
        let transform = transform.into();
        let args = args.hashed()?;
        let parent_fingerprints: Vec<Fingerprint> =
            parents.iter().map(FingerprintInputs::fingerprint).collect();
        let fingerprint = transform_fingerprint(&parent_fingerprints, &transform, version, &args);
        Ok(Self {
            transform,
            version,
            parents,
            args,
            fingerprint,
        })
    }

    pub fn transform(&self) -> &str {
        &self.transform
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn parents(&self) -> &[FingerprintInputs] {
        &self.parents
    }

    /// The hashed arguments, sorted by name.
    pub fn args(&self) -> &[HashedArg] {
        &self.args
    }

    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    fn label(&self) -> String {
        format!("{}@{}", self.transform, self.version)
    }
}

impl FingerprintInputs {
    pub fn fingerprint(&self) -> Fingerprint {
        match self {
            FingerprintInputs::Source(source) => source.fingerprint(),
            FingerprintInputs::Transform(transform) => transform.fingerprint(),
        }
    }

    fn label(&self) -> String {
        match self {
            FingerprintInputs::Source(source) => format!("{} source", source.kind()),
            FingerprintInputs::Transform(transform) => transform.label(),
        }
    }

    /// What makes `self` (the lineage asked for) differ from `stored` (one that was cached).
    /// Empty when the fingerprints are equal. Parents are compared recursively, so the answer
    /// points at the argument or source that actually changed, however deep.
    pub fn differences(&self, stored: &FingerprintInputs) -> Vec<Difference> {
        if self.fingerprint() == stored.fingerprint() {
            return Vec::new();
        }
        match (self, stored) {
            (FingerprintInputs::Transform(requested), FingerprintInputs::Transform(stored))
                if requested.transform == stored.transform =>
            {
                transform_differences(requested, stored)
            }
            (FingerprintInputs::Source(requested), FingerprintInputs::Source(stored)) => {
                source_differences(requested, stored)
            }
            _ => vec![Difference::Operation {
                requested: self.label(),
                stored: stored.label(),
            }],
        }
    }

    /// How far `stored` is from `self`: the number of differing leaves, with a different
    /// operation counting as very far. Used to find the nearest cached entry.
    pub fn distance(&self, stored: &FingerprintInputs) -> u64 {
        self.differences(stored)
            .iter()
            .map(Difference::weight)
            .sum()
    }
}

/// The serialized form of a lineage: nodes with parents before children, each shared
/// sub-lineage once; the last node is the lineage itself. Fingerprints and argument hashes are
/// not stored: they are recomputed on decoding.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LineageTable {
    nodes: Vec<LineageNode>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
enum LineageNode {
    Source(SourceDescription),
    Transform {
        transform: String,
        version: u32,
        /// Indices of earlier nodes.
        parents: Vec<usize>,
        /// Hashed arguments, sorted by name.
        args: Vec<(String, ArgValue)>,
    },
}

impl From<FingerprintInputs> for LineageTable {
    fn from(inputs: FingerprintInputs) -> Self {
        fn add(
            inputs: &FingerprintInputs,
            nodes: &mut Vec<LineageNode>,
            seen: &mut BTreeMap<Fingerprint, usize>,
        ) -> usize {
            if let Some(&index) = seen.get(&inputs.fingerprint()) {
                return index;
            }
            let node = match inputs {
                FingerprintInputs::Source(source) => LineageNode::Source(source.clone()),
                FingerprintInputs::Transform(transform) => LineageNode::Transform {
                    transform: transform.transform.clone(),
                    version: transform.version,
                    parents: transform
                        .parents
                        .iter()
                        .map(|parent| add(parent, nodes, seen))
                        .collect(),
                    args: transform
                        .args
                        .iter()
                        .map(|arg| (arg.name.clone(), arg.value.clone()))
                        .collect(),
                },
            };
            nodes.push(node);
            seen.insert(inputs.fingerprint(), nodes.len() - 1);
            nodes.len() - 1
        }
        let mut nodes = Vec::new();
        add(&inputs, &mut nodes, &mut BTreeMap::new());
        LineageTable { nodes }
    }
}

impl TryFrom<LineageTable> for FingerprintInputs {
    type Error = String;

    fn try_from(table: LineageTable) -> Result<Self, String> {
        // How often each node is a parent, so a node used once is moved rather than cloned
        // (a chain then decodes in linear time).
        let mut uses = vec![0usize; table.nodes.len()];
        for (index, node) in table.nodes.iter().enumerate() {
            if let LineageNode::Transform { parents, .. } = node {
                for &parent in parents {
                    if parent >= index {
                        return Err(format!(
                            "lineage node {index} names node {parent} as a parent, which does not precede it"
                        ));
                    }
                    uses[parent] += 1;
                }
            }
        }
        let mut built: Vec<Option<FingerprintInputs>> = Vec::with_capacity(table.nodes.len());
        for node in table.nodes {
            let inputs = match node {
                LineageNode::Source(source) => FingerprintInputs::Source(source),
                LineageNode::Transform {
                    transform,
                    version,
                    parents,
                    args,
                } => {
                    if args.windows(2).any(|pair| pair[0].0 >= pair[1].0) {
                        return Err(format!(
                            "the arguments of {transform}@{version} are not sorted and unique"
                        ));
                    }
                    let mut parent_inputs = Vec::with_capacity(parents.len());
                    for parent in parents {
                        uses[parent] -= 1;
                        let slot = &mut built[parent];
                        let taken = if uses[parent] == 0 {
                            slot.take()
                        } else {
                            slot.clone()
                        };
                        parent_inputs.push(taken.ok_or("a lineage node is used twice")?);
                    }
                    let args: Vec<HashedArg> = args
                        .into_iter()
                        .map(|(name, value)| HashedArg::new(name, value))
                        .collect();
                    let parent_fingerprints: Vec<Fingerprint> = parent_inputs
                        .iter()
                        .map(FingerprintInputs::fingerprint)
                        .collect();
                    let fingerprint =
                        transform_fingerprint(&parent_fingerprints, &transform, version, &args);
                    FingerprintInputs::Transform(TransformDescription {
                        transform,
                        version,
                        parents: parent_inputs,
                        args,
                        fingerprint,
                    })
                }
            };
            built.push(Some(inputs));
        }
        built
            .pop()
            .flatten()
            .ok_or_else(|| "an empty lineage".to_owned())
    }
}

fn transform_differences(
    requested: &TransformDescription,
    stored: &TransformDescription,
) -> Vec<Difference> {
    let transform = requested.label();
    let mut differences = Vec::new();
    if requested.version != stored.version {
        differences.push(Difference::Version {
            transform: requested.transform.clone(),
            requested: requested.version,
            stored: stored.version,
        });
    }
    differences.extend(arg_differences(&transform, &requested.args, &stored.args));
    if requested.parents.len() != stored.parents.len() {
        differences.push(Difference::ParentCount {
            transform,
            requested: requested.parents.len(),
            stored: stored.parents.len(),
        });
        return differences;
    }
    for (index, (mine, theirs)) in requested.parents.iter().zip(&stored.parents).enumerate() {
        let inner = mine.differences(theirs);
        if !inner.is_empty() {
            differences.push(Difference::Parent {
                transform: transform.clone(),
                index,
                differences: inner,
            });
        }
    }
    differences
}

/// Both lists are sorted by name, so one merge walk pairs them up.
fn arg_differences(
    transform: &str,
    requested: &[HashedArg],
    stored: &[HashedArg],
) -> Vec<Difference> {
    let mut differences = Vec::new();
    let (mut mine, mut theirs) = (requested.iter().peekable(), stored.iter().peekable());
    loop {
        let change = match (mine.peek(), theirs.peek()) {
            (None, None) => break,
            (Some(a), Some(b)) => match a.name.cmp(&b.name) {
                Ordering::Equal => {
                    let (a, b) = (mine.next(), theirs.next());
                    match (a, b) {
                        (Some(a), Some(b)) if a.hash != b.hash => Some((
                            a.name.clone(),
                            ArgChange::Changed {
                                requested: a.value.clone(),
                                stored: b.value.clone(),
                            },
                        )),
                        _ => None,
                    }
                }
                Ordering::Less => mine
                    .next()
                    .map(|a| (a.name.clone(), ArgChange::Added(a.value.clone()))),
                Ordering::Greater => theirs
                    .next()
                    .map(|b| (b.name.clone(), ArgChange::Removed(b.value.clone()))),
            },
            (Some(_), None) => mine
                .next()
                .map(|a| (a.name.clone(), ArgChange::Added(a.value.clone()))),
            (None, Some(_)) => theirs
                .next()
                .map(|b| (b.name.clone(), ArgChange::Removed(b.value.clone()))),
        };
        if let Some((name, change)) = change {
            differences.push(Difference::Argument {
                transform: transform.to_owned(),
                name,
                change,
            });
        }
    }
    differences
}

fn source_differences(
    requested: &SourceDescription,
    stored: &SourceDescription,
) -> Vec<Difference> {
    match (requested, stored) {
        (SourceDescription::Files(mine), SourceDescription::Files(theirs)) => {
            file_differences(mine, theirs)
        }
        (SourceDescription::Range { n: mine }, SourceDescription::Range { n: theirs }) => {
            vec![Difference::Range {
                requested: *mine,
                stored: *theirs,
            }]
        }
        (
            SourceDescription::InMemory { content: mine, .. },
            SourceDescription::InMemory {
                content: theirs, ..
            },
        ) => vec![Difference::InMemoryContent {
            requested: *mine,
            stored: *theirs,
        }],
        (
            SourceDescription::Materialized { job: mine, .. },
            SourceDescription::Materialized { job: theirs, .. },
        ) => vec![Difference::Operation {
            requested: format!("job {mine}'s materialized result"),
            stored: format!("job {theirs}'s materialized result"),
        }],
        _ => vec![Difference::Operation {
            requested: format!("{} source", requested.kind()),
            stored: format!("{} source", stored.kind()),
        }],
    }
}

fn file_differences(requested: &[FileStamp], stored: &[FileStamp]) -> Vec<Difference> {
    let mut differences = Vec::new();
    let (mut mine, mut theirs) = (requested.iter().peekable(), stored.iter().peekable());
    loop {
        let difference = match (mine.peek(), theirs.peek()) {
            (None, None) => break,
            (Some(a), Some(b)) => match a.path.cmp(&b.path) {
                Ordering::Equal => match (mine.next(), theirs.next()) {
                    (Some(a), Some(b)) if a != b => Some(Difference::FileChanged {
                        requested: a.clone(),
                        stored: b.clone(),
                    }),
                    _ => None,
                },
                Ordering::Less => mine.next().map(|a| Difference::FileAdded(a.path.clone())),
                Ordering::Greater => theirs
                    .next()
                    .map(|b| Difference::FileRemoved(b.path.clone())),
            },
            (Some(_), None) => mine.next().map(|a| Difference::FileAdded(a.path.clone())),
            (None, Some(_)) => theirs
                .next()
                .map(|b| Difference::FileRemoved(b.path.clone())),
        };
        differences.extend(difference);
    }
    differences
}

/// How an argument differs between the requested lineage and a stored one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ArgChange {
    /// Hashed now, absent (or at its default) in the stored entry.
    Added(ArgValue),
    /// Hashed in the stored entry, absent (or at its default) now.
    Removed(ArgValue),
    Changed {
        requested: ArgValue,
        stored: ArgValue,
    },
}

/// One reason a lineage misses a stored entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Difference {
    /// A different operation (or kind of source) at this point of the plan.
    Operation {
        requested: String,
        stored: String,
    },
    Version {
        transform: String,
        requested: u32,
        stored: u32,
    },
    Argument {
        transform: String,
        name: String,
        change: ArgChange,
    },
    ParentCount {
        transform: String,
        requested: usize,
        stored: usize,
    },
    /// Parent `index` of `transform` differs, for the nested reasons.
    Parent {
        transform: String,
        index: usize,
        differences: Vec<Difference>,
    },
    Range {
        requested: u64,
        stored: u64,
    },
    FileAdded(PathBuf),
    FileRemoved(PathBuf),
    FileChanged {
        requested: FileStamp,
        stored: FileStamp,
    },
    InMemoryContent {
        requested: Fingerprint,
        stored: Fingerprint,
    },
}

impl Difference {
    fn weight(&self) -> u64 {
        match self {
            // A different operation shares nothing with what was asked for.
            Difference::Operation { .. } => 1_000,
            Difference::Parent { differences, .. } => {
                differences.iter().map(Difference::weight).sum()
            }
            _ => 1,
        }
    }
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Difference::Operation { requested, stored } => {
                write!(
                    f,
                    "the plan has {requested} where the cached entry has {stored}"
                )
            }
            Difference::Version {
                transform,
                requested,
                stored,
            } => write!(
                f,
                "{transform} is at version {requested}, the cached entry was made by version {stored}"
            ),
            Difference::Argument {
                transform,
                name,
                change,
            } => match change {
                ArgChange::Added(value) => write!(
                    f,
                    "argument `{name}` of {transform} is {value}, the cached entry used its default"
                ),
                ArgChange::Removed(value) => write!(
                    f,
                    "argument `{name}` of {transform} is at its default, the cached entry used {value}"
                ),
                ArgChange::Changed { requested, stored } => write!(
                    f,
                    "argument `{name}` of {transform} is {requested}, the cached entry used {stored}"
                ),
            },
            Difference::ParentCount {
                transform,
                requested,
                stored,
            } => write!(
                f,
                "{transform} has {requested} inputs, the cached entry had {stored}"
            ),
            Difference::Parent {
                transform,
                index,
                differences,
            } => {
                write!(f, "input {index} of {transform} differs: ")?;
                for (position, difference) in differences.iter().enumerate() {
                    if position > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "{difference}")?;
                }
                Ok(())
            }
            Difference::Range { requested, stored } => {
                write!(
                    f,
                    "range({requested}) where the cached entry read range({stored})"
                )
            }
            Difference::FileAdded(path) => {
                write!(f, "source file {} is new", path.display())
            }
            Difference::FileRemoved(path) => {
                write!(f, "source file {} is no longer read", path.display())
            }
            Difference::FileChanged { requested, stored } => write!(
                f,
                "source file {} changed (size {} -> {}, modified {}.{:09} -> {}.{:09})",
                requested.path.display(),
                stored.size,
                requested.size,
                stored.modified_secs,
                stored.modified_nanos,
                requested.modified_secs,
                requested.modified_nanos
            ),
            Difference::InMemoryContent { requested, stored } => write!(
                f,
                "in-memory data has content {requested}, the cached entry was made from {stored}"
            ),
        }
    }
}
