//! Fingerprints of the data a plan starts from.

use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};

use super::canonical::CanonicalHasher;
use super::{Fingerprint, FingerprintError};
use crate::JobId;

const FILE_CONTENT_DOMAIN: &str = "floe.fingerprint.udf-file-content.v1";

/// A file a process UDF runs (its script, a module it imports, a model), pinned by content:
/// editing it changes the hash, touching it without a change does not.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FileDigest {
    /// Absolute, with symlinks resolved.
    pub path: PathBuf,
    pub content: Fingerprint,
}

impl FileDigest {
    /// Reads `path` (a regular file: a device or a pipe could be endless) and hashes its
    /// bytes as they are read, so a large model is never held in memory.
    pub fn of(path: &Path) -> Result<Self, FingerprintError> {
        use std::io::Read;
        let error = |source| FingerprintError::SourceFile {
            path: path.to_owned(),
            source,
        };
        let absolute = std::fs::canonicalize(path).map_err(error)?;
        // Checked before opening: opening a FIFO would block.
        let not_regular = || {
            error(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file",
            ))
        };
        if !std::fs::metadata(&absolute).map_err(error)?.is_file() {
            return Err(not_regular());
        }
        let mut file = std::fs::File::open(&absolute).map_err(error)?;
        let metadata = file.metadata().map_err(error)?;
        if !metadata.is_file() {
            return Err(not_regular());
        }
        let mut hasher = CanonicalHasher::new(FILE_CONTENT_DOMAIN);
        hasher.u64(metadata.len());
        let mut chunk = vec![0u8; 1 << 20];
        let mut read = 0u64;
        loop {
            let n = file.read(&mut chunk).map_err(error)?;
            if n == 0 {
                break;
            }
            hasher.bytes_part(&chunk[..n]);
            read += n as u64;
        }
        if read != metadata.len() {
            return Err(error(std::io::Error::other(
                "the file changed while it was hashed",
            )));
        }
        Ok(Self {
            path: absolute,
            content: hasher.finish(),
        })
    }

    /// The content hash of `bytes`, as [`FileDigest::of`] computes it.
    pub fn hash(bytes: &[u8]) -> Fingerprint {
        let mut hasher = CanonicalHasher::new(FILE_CONTENT_DOMAIN);
        hasher.bytes(bytes);
        hasher.finish()
    }
}

/// What a source read, in enough detail to say what changed between two runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SourceDescription {
    /// Files, sorted by absolute path. The contents are not read: size and modification time
    /// stand for them (as HF `datasets` does), so fingerprinting a terabyte costs one `stat`
    /// per file and touching a file invalidates what was computed from it.
    Files(Vec<FileStamp>),
    /// The integers `0..n`.
    Range { n: u64 },
    /// Data the client supplied inline, identified by the hash of its bytes.
    InMemory { content: Fingerprint, len: u64 },
    /// The held output of job `job`, identified by that output's fingerprint.
    Materialized {
        job: JobId,
        fingerprint: Fingerprint,
    },
}

/// One source file as it was when the plan was fingerprinted.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FileStamp {
    pub path: PathBuf,
    pub size: u64,
    /// Modification time as seconds and nanoseconds since the Unix epoch (negative before it).
    pub modified_secs: i64,
    pub modified_nanos: u32,
    /// An object's version id, else its ETag: what object storage changes on every write
    /// (a rewrite within the same second keeps the modification time). `None` for local files.
    pub version: Option<String>,
}

impl FileStamp {
    /// Stats `path`, made absolute (symlinks resolved) so two spellings of one file agree.
    pub fn of(path: &Path) -> Result<Self, FingerprintError> {
        let error = |source| FingerprintError::SourceFile {
            path: path.to_owned(),
            source,
        };
        let absolute = std::fs::canonicalize(path).map_err(error)?;
        let metadata = std::fs::metadata(&absolute).map_err(error)?;
        let modified = metadata.modified().map_err(error)?;
        let (modified_secs, modified_nanos) = match modified.duration_since(UNIX_EPOCH) {
            Ok(after) => (
                i64::try_from(after.as_secs()).unwrap_or(i64::MAX),
                after.subsec_nanos(),
            ),
            Err(before) => {
                // Before the epoch: floor to whole seconds so the nanoseconds stay positive.
                let before = before.duration();
                let secs = i64::try_from(before.as_secs()).unwrap_or(i64::MAX);
                match before.subsec_nanos() {
                    0 => (-secs, 0),
                    nanos => (-secs - 1, 1_000_000_000 - nanos),
                }
            }
        };
        Ok(Self {
            path: absolute,
            size: metadata.len(),
            modified_secs,
            modified_nanos,
            version: None,
        })
    }
}

impl SourceDescription {
    /// Stats every file; the order and spelling of `paths` do not matter.
    pub fn files<P: AsRef<Path>>(
        paths: impl IntoIterator<Item = P>,
    ) -> Result<Self, FingerprintError> {
        let mut stamps = paths
            .into_iter()
            .map(|path| FileStamp::of(path.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        stamps.sort();
        stamps.dedup();
        Ok(SourceDescription::Files(stamps))
    }

    pub fn range(n: u64) -> Self {
        SourceDescription::Range { n }
    }

    pub fn in_memory(content: &[u8]) -> Self {
        let mut hasher = CanonicalHasher::new("floe.fingerprint.memory-content.v1");
        hasher.bytes(content);
        SourceDescription::InMemory {
            content: hasher.finish(),
            len: content.len() as u64,
        }
    }

    pub fn fingerprint(&self) -> Fingerprint {
        match self {
            SourceDescription::Files(stamps) => {
                let mut hasher = CanonicalHasher::new("floe.fingerprint.source.files.v1");
                hasher.len(stamps.len());
                for stamp in stamps {
                    hasher.bytes(stamp.path.as_os_str().as_encoded_bytes());
                    hasher.u64(stamp.size);
                    hasher.i64(stamp.modified_secs);
                    hasher.u32(stamp.modified_nanos);
                    // Only remote stamps have one, so local files keep their fingerprints.
                    if let Some(version) = &stamp.version {
                        hasher.bytes(version.as_bytes());
                    }
                }
                hasher.finish()
            }
            SourceDescription::Range { n } => {
                let mut hasher = CanonicalHasher::new("floe.fingerprint.source.range.v1");
                hasher.u64(*n);
                hasher.finish()
            }
            SourceDescription::InMemory { content, len } => {
                let mut hasher = CanonicalHasher::new("floe.fingerprint.source.memory.v1");
                hasher.fingerprint(*content);
                hasher.u64(*len);
                hasher.finish()
            }
            // The rows are the materializing job's output: they share its identity.
            SourceDescription::Materialized { fingerprint, .. } => *fingerprint,
        }
    }

    pub(crate) fn kind(&self) -> &'static str {
        match self {
            SourceDescription::Files(_) => "files",
            SourceDescription::Range { .. } => "range",
            SourceDescription::InMemory { .. } => "in-memory data",
            SourceDescription::Materialized { .. } => "materialized result",
        }
    }
}
