//! Each replica's job history: one JSON line per job that left the replicated state
//! (`DeleteJob`, `PruneJobs`), appended as the replica applies the command, so the file grows
//! with the jobs ever run while the state stays bounded. Readers take the newest lines from
//! the end, so a listing costs what it shows, not the file's length.
//!
//! Every replica writes its own copy. A replica that installs a snapshot from the leader skips
//! the entries the snapshot covers, so its file misses the summaries pruned in them; the
//! other replicas' files still have them. A restarted replica applies again the entries after
//! its last snapshot and appends their summaries again; readers list each job once.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use floe_api::state::JobSummary;

use crate::{Error, Result};

/// The history file's name in a replica's data directory.
pub const HISTORY_FILE: &str = "history.jsonl";

/// Bytes read per step when reading the file backwards.
const READ_STEP: u64 = 64 * 1024;

/// Appends summaries to one replica's history file.
pub struct HistoryWriter {
    path: PathBuf,
    file: Option<File>,
}

impl HistoryWriter {
    /// A writer for `path`; the file is created on the first append.
    pub fn new(path: PathBuf) -> Self {
        Self { path, file: None }
    }

    /// Appends one line per summary and syncs the file, so what a replica applied is in its
    /// history before it applies more.
    pub fn append(&mut self, summaries: &[JobSummary]) -> Result<()> {
        if summaries.is_empty() {
            return Ok(());
        }
        let mut lines = Vec::new();
        for summary in summaries {
            serde_json::to_writer(&mut lines, summary).map_err(|error| Error::Corrupt {
                path: self.path.clone(),
                offset: 0,
                reason: format!("cannot encode a job summary: {error}"),
            })?;
            lines.push(b'\n');
        }
        let file = match &mut self.file {
            Some(file) => file,
            None => self.file.insert(
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.path)
                    .map_err(Error::io("open", &self.path))?,
            ),
        };
        file.write_all(&lines)
            .map_err(Error::io("append to", &self.path))?;
        file.sync_data().map_err(Error::io("sync", &self.path))
    }
}

/// The newest `limit` summaries in the history file at `path`, newest first, each job once;
/// none when the file does not exist yet. A line cut short by a crash mid-append is skipped;
/// any other line that does not decode is an error naming its place.
pub fn read_newest(path: &Path, limit: usize) -> Result<Vec<JobSummary>> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(Error::io("open", path)(error)),
    };
    let len = file.metadata().map_err(Error::io("stat", path))?.len();
    let mut end = len;
    // Bytes from `start` to `end` of the file: whole lines, except maybe the first.
    let mut tail: Vec<u8> = Vec::new();
    let mut newest = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    while newest.len() < limit {
        let start = end.saturating_sub(READ_STEP);
        let mut chunk = vec![0; (end - start) as usize];
        file.seek(SeekFrom::Start(start))
            .and_then(|_| file.read_exact(&mut chunk))
            .map_err(Error::io("read", path))?;
        chunk.extend_from_slice(&tail);
        tail = chunk;
        // Everything after the first newline is whole lines (unless the file starts here).
        let cut = if start == 0 {
            0
        } else {
            match tail.iter().position(|byte| *byte == b'\n') {
                Some(newline) => newline + 1,
                None => {
                    end = start;
                    continue;
                }
            }
        };
        let whole = tail.split_off(cut);
        for (back, line) in whole
            .split(|byte| *byte == b'\n')
            .filter(|line| !line.is_empty())
            .rev()
            .enumerate()
        {
            match serde_json::from_slice::<JobSummary>(line) {
                Ok(summary) => {
                    if seen.insert(summary.id) {
                        newest.push(summary);
                    }
                }
                // Only the file's very last line can be torn by a crash.
                Err(_)
                    if back == 0
                        && start + (cut as u64) + (whole.len() as u64) == len
                        && !whole.ends_with(b"\n") => {}
                Err(error) => {
                    return Err(Error::Corrupt {
                        path: path.to_owned(),
                        offset: start + cut as u64,
                        reason: format!("a history line does not decode: {error}"),
                    });
                }
            }
            if newest.len() == limit {
                break;
            }
        }
        if start == 0 {
            break;
        }
        end = start;
        // `tail` keeps the partial first line for the next, earlier step.
    }
    Ok(newest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use floe_api::state::{JobStatus, Removal};
    use floe_core::{JobId, SubmissionId};

    fn summary(id: u64) -> JobSummary {
        JobSummary {
            id: JobId::new(id),
            submission: SubmissionId::new(u128::from(id)),
            name: None,
            status: JobStatus::Failed {
                message: "x".repeat(500),
            },
            attempts: 1,
            submitted_at_ms: id,
            started_at_ms: Some(id + 1),
            ended_at_ms: Some(id + 2),
            stats: None,
            release: None,
            removal: Removal::Pruned,
            removed_at_ms: id + 3,
        }
    }

    #[test]
    fn reads_the_newest_lines_first_across_read_steps() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(HISTORY_FILE);
        assert!(read_newest(&path, 10).unwrap().is_empty());
        let mut writer = HistoryWriter::new(path.clone());
        // About 600 bytes a line: 1000 lines span many 64 KiB steps.
        let all: Vec<JobSummary> = (1..=1000).map(summary).collect();
        for batch in all.chunks(7) {
            writer.append(batch).unwrap();
        }
        let newest = read_newest(&path, 3).unwrap();
        let ids: Vec<u64> = newest.iter().map(|s| s.id.get()).collect();
        assert_eq!(ids, vec![1000, 999, 998]);
        let every = read_newest(&path, usize::MAX).unwrap();
        assert_eq!(every.len(), 1000);
        assert!(every.iter().rev().eq(all.iter()));
        // A restarted replica appending the last batch again: still listed once.
        writer.append(&all[995..]).unwrap();
        let ids: Vec<u64> = read_newest(&path, 7)
            .unwrap()
            .iter()
            .map(|s| s.id.get())
            .collect();
        assert_eq!(ids, vec![1000, 999, 998, 997, 996, 995, 994]);
    }

    #[test]
    fn a_torn_last_line_is_skipped_and_other_damage_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(HISTORY_FILE);
        let mut writer = HistoryWriter::new(path.clone());
        writer.append(&[summary(1), summary(2)]).unwrap();
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(b"{\"id\":3,\"sta").unwrap();
        let ids: Vec<u64> = read_newest(&path, 10)
            .unwrap()
            .iter()
            .map(|s| s.id.get())
            .collect();
        assert_eq!(ids, vec![2, 1]);
        file.write_all(b"\n").unwrap();
        assert!(matches!(read_newest(&path, 10), Err(Error::Corrupt { .. })));
    }
}
