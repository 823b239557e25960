//! Where data lives: a local path, or an object in object storage named by a URL
//! (`s3://bucket/key`, `gs://…`, `az://…`, `http(s)://…`).
//!
//! Plans, file stamps and sinks carry both as a `PathBuf`, so every place that names a file
//! names either; [`remote_url`] tells them apart. A URL never carries credentials: the nodes
//! and the driver take those from their environment.

use std::path::Path;

/// The URL `path` spells when it names an object (`scheme://…`), else `None` (a local path).
pub fn remote_url(path: &Path) -> Option<&str> {
    let text = path.to_str()?;
    let (scheme, rest) = text.split_once("://")?;
    let is_scheme = !scheme.is_empty()
        && scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    (is_scheme && !rest.is_empty()).then_some(text)
}

/// Whether `path` names an object rather than a local file.
pub fn is_remote(path: &Path) -> bool {
    remote_url(path).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_told_from_paths() {
        assert_eq!(
            remote_url(Path::new("s3://bucket/a/b.parquet")),
            Some("s3://bucket/a/b.parquet")
        );
        assert!(is_remote(Path::new("https://host/x.csv")));
        assert!(!is_remote(Path::new("/data/s3://x")));
        assert!(!is_remote(Path::new("data/x.csv")));
        assert!(!is_remote(Path::new("s3://")));
        assert!(!is_remote(Path::new("1s3://bucket")));
    }
}
