//! `data.allowed_paths`: the directories jobs may read from and write to.
//!
//! A job names paths (input files, a sink directory, the files of a process UDF) that the
//! scheduler opens to plan it and the nodes open to run it. With no roots configured any path
//! goes, as a single-user cluster expects. With roots, every path must lie under one of them
//! *after* resolving it: symlinks and `..` are followed for the part that exists, so neither
//! can step outside, and a path that does not exist yet (a sink directory) may not contain `..`
//! at all in its missing part.
//!
//! A root may also be an object-storage prefix (`s3://bucket/prefix`): an object URL is
//! allowed when it lies under such a root segment by segment and has no `.` or `..` segment
//! (object stores resolve neither, but a later local join or a proxy might).

use std::path::{Component, Path, PathBuf};

/// Why a path was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path} is outside data.allowed_paths ({roots})")]
pub struct PathNotAllowed {
    pub path: PathBuf,
    pub roots: String,
}

/// The roots paths must lie under; none means any path is allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedPaths {
    roots: Vec<PathBuf>,
}

impl AllowedPaths {
    /// Any path at all.
    pub fn any() -> Self {
        Self::default()
    }

    /// Paths under `roots` (absolute; resolved now when they exist, so a root that is a
    /// symlink still matches the paths resolved through it).
    pub fn under(roots: &[PathBuf]) -> Self {
        Self {
            roots: roots
                .iter()
                .map(|root| {
                    if crate::location::is_remote(root) {
                        root.clone()
                    } else {
                        resolve(root).unwrap_or_else(|| root.clone())
                    }
                })
                .collect(),
        }
    }

    pub fn is_restricted(&self) -> bool {
        !self.roots.is_empty()
    }

    /// Checks `path`, which must be absolute when any root is set.
    pub fn check(&self, path: &Path) -> Result<(), PathNotAllowed> {
        if self.roots.is_empty() {
            return Ok(());
        }
        let refused = || PathNotAllowed {
            path: path.to_owned(),
            roots: self
                .roots
                .iter()
                .map(|root| root.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        };
        if let Some(url) = crate::location::remote_url(path) {
            return if self.allows_url(url) {
                Ok(())
            } else {
                Err(refused())
            };
        }
        if !path.is_absolute() {
            return Err(refused());
        }
        let Some(resolved) = resolve(path) else {
            return Err(refused());
        };
        let escapes = resolved
            .components()
            .any(|component| component == Component::ParentDir);
        if escapes || !self.roots.iter().any(|root| resolved.starts_with(root)) {
            return Err(refused());
        }
        Ok(())
    }
}

impl AllowedPaths {
    /// Whether object `url` lies under a remote root: the same scheme and bucket, then the
    /// root's segments as a prefix of the URL's.
    fn allows_url(&self, url: &str) -> bool {
        let Some((_, rest)) = url.split_once("://") else {
            return false;
        };
        if rest
            .split('/')
            .any(|segment| segment == "." || segment == "..")
        {
            return false;
        }
        self.roots.iter().any(|root| {
            let Some(root) = crate::location::remote_url(root) else {
                return false;
            };
            let root = root.trim_end_matches('/');
            url == root
                || url
                    .strip_prefix(root)
                    .is_some_and(|below| below.starts_with('/'))
        })
    }
}

/// `path` with its longest existing ancestor canonicalized (symlinks and `..` resolved) and
/// the rest appended as written; `None` when a part that does not resolve is a dangling
/// symlink, which a later write would follow anywhere.
fn resolve(path: &Path) -> Option<PathBuf> {
    let mut existing = path.to_owned();
    let mut missing = Vec::new();
    loop {
        if let Ok(canonical) = std::fs::canonicalize(&existing) {
            return Some(
                missing
                    .iter()
                    .rev()
                    .fold(canonical, |resolved, part: &std::ffi::OsString| {
                        resolved.join(part)
                    }),
            );
        }
        if std::fs::symlink_metadata(&existing).is_ok_and(|meta| meta.file_type().is_symlink()) {
            return None;
        }
        match (existing.file_name(), existing.parent()) {
            (Some(name), Some(parent)) => {
                missing.push(name.to_owned());
                existing = parent.to_owned();
            }
            // Nothing of it exists (or it ends in `..`): keep it as written, so a `..` in it
            // is seen and refused.
            _ => return Some(path.to_owned()),
        }
    }
}
