//! An in-memory index of this replica's job history file, for `/api/jobs?all=true`: each
//! job's newest line (its offset, length and state), read forward as the file grows. A page
//! counts and picks its jobs from the index and reads only the lines it shows, so listing
//! stays fast at 100,000 jobs in history, at any offset and with any state filter, and its
//! `total` is exact. The index costs about 64 bytes a job.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use floe_api::state::JobSummary;
use floe_core::JobId;

use crate::{Error, Result};

/// Bytes read per step while catching up with the file.
const READ_STEP: usize = 1 << 20;

pub(crate) struct HistoryIndex {
    path: PathBuf,
    indexed: Mutex<Indexed>,
}

#[derive(Default)]
struct Indexed {
    /// Bytes of the file indexed: whole lines only.
    read: u64,
    /// Lines in file order; a job's older lines are marked superseded.
    lines: Vec<Line>,
    /// Each job's newest line in `lines`.
    newest: HashMap<JobId, usize>,
}

struct Line {
    job: JobId,
    offset: u64,
    len: u32,
    state: &'static str,
    /// The job's name, for the name filter.
    name: Option<Box<str>>,
    superseded: bool,
}

/// Which history jobs a page lists.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct HistoryFilter<'a> {
    /// Only jobs in this state (its name, as `JobStatus::name` spells it).
    pub state: Option<&'a str>,
    /// Only jobs whose name contains this text.
    pub name: Option<&'a str>,
}

impl HistoryFilter<'_> {
    fn matches(&self, line: &Line) -> bool {
        self.state.is_none_or(|state| line.state == state)
            && self.name.is_none_or(|wanted| {
                line.name
                    .as_deref()
                    .is_some_and(|name| name.contains(wanted))
            })
    }
}

/// One page of the history.
pub(crate) struct HistoryPage {
    /// Jobs in the history matching the filter (each once).
    pub total: usize,
    /// The page's summaries, newest first.
    pub jobs: Vec<JobSummary>,
}

impl HistoryIndex {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            indexed: Mutex::new(Indexed::default()),
        }
    }

    /// The history's jobs that `filter` picks and `exclude` does not name (the jobs still in
    /// the cluster state), newest first: `total`, and `take` of them after `skip`.
    pub fn page(
        &self,
        filter: HistoryFilter<'_>,
        exclude: impl Fn(JobId) -> bool,
        skip: usize,
        take: usize,
    ) -> Result<HistoryPage> {
        let mut indexed = self.indexed.lock().unwrap_or_else(PoisonError::into_inner);
        indexed.catch_up(&self.path)?;
        let matching = || {
            indexed
                .lines
                .iter()
                .rev()
                .filter(|line| !line.superseded && filter.matches(line) && !exclude(line.job))
        };
        let total = matching().count();
        let wanted: Vec<(u64, u32)> = matching()
            .skip(skip)
            .take(take)
            .map(|line| (line.offset, line.len))
            .collect();
        drop(indexed);
        if wanted.is_empty() {
            return Ok(HistoryPage {
                total,
                jobs: Vec::new(),
            });
        }
        let mut file = File::open(&self.path).map_err(Error::io("open", &self.path))?;
        let jobs = wanted
            .into_iter()
            .map(|(offset, len)| read_line(&self.path, &mut file, offset, len))
            .collect::<Result<_>>()?;
        Ok(HistoryPage { total, jobs })
    }
}

impl Indexed {
    /// Indexes the lines appended since the last call; starts over when the file shrank
    /// (replaced), and waits for a line still being written.
    fn catch_up(&mut self, path: &Path) -> Result<()> {
        let mut file = match File::open(path) {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                *self = Self::default();
                return Ok(());
            }
            Err(error) => return Err(Error::io("open", path)(error)),
        };
        let len = file.metadata().map_err(Error::io("stat", path))?.len();
        if len < self.read {
            *self = Self::default();
        }
        file.seek(SeekFrom::Start(self.read))
            .map_err(Error::io("read", path))?;
        let mut pending: Vec<u8> = Vec::new();
        let mut chunk = vec![0; READ_STEP];
        loop {
            let n = file.read(&mut chunk).map_err(Error::io("read", path))?;
            if n == 0 {
                return Ok(());
            }
            pending.extend_from_slice(&chunk[..n]);
            let Some(last_newline) = pending.iter().rposition(|byte| *byte == b'\n') else {
                continue;
            };
            let rest = pending.split_off(last_newline + 1);
            let mut offset = self.read;
            for line in pending.split_inclusive(|byte| *byte == b'\n') {
                let text = &line[..line.len() - 1];
                if !text.is_empty() {
                    let summary: JobSummary =
                        serde_json::from_slice(text).map_err(|error| Error::Corrupt {
                            path: path.to_owned(),
                            offset,
                            reason: format!("a history line does not decode: {error}"),
                        })?;
                    self.add(summary, offset, text.len());
                }
                offset += line.len() as u64;
            }
            self.read = offset;
            pending = rest;
        }
    }

    fn add(&mut self, summary: JobSummary, offset: u64, len: usize) {
        if let Some(older) = self.newest.insert(summary.id, self.lines.len()) {
            self.lines[older].superseded = true;
        }
        self.lines.push(Line {
            job: summary.id,
            offset,
            len: u32::try_from(len).unwrap_or(u32::MAX),
            state: summary.status.name(),
            name: summary.name.map(String::into_boxed_str),
            superseded: false,
        });
    }
}

fn read_line(path: &Path, file: &mut File, offset: u64, len: u32) -> Result<JobSummary> {
    let mut line = vec![0; len as usize];
    file.seek(SeekFrom::Start(offset))
        .and_then(|_| file.read_exact(&mut line))
        .map_err(Error::io("read", path))?;
    serde_json::from_slice(&line).map_err(|error| Error::Corrupt {
        path: path.to_owned(),
        offset,
        reason: format!("a history line does not decode: {error}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::HistoryWriter;
    use floe_api::state::{JobStatus, Removal};
    use floe_core::SubmissionId;

    fn summary(id: u64, status: JobStatus) -> JobSummary {
        JobSummary {
            id: JobId::new(id),
            // Every thousandth job is a nightly one.
            name: id.is_multiple_of(1_000).then(|| format!("nightly-{id}")),
            submission: SubmissionId::random(),
            status,
            attempts: 1,
            submitted_at_ms: id,
            started_at_ms: None,
            ended_at_ms: None,
            stats: None,
            release: None,
            removal: Removal::Pruned,
            removed_at_ms: id,
        }
    }

    fn state(state: &str) -> HistoryFilter<'_> {
        HistoryFilter {
            state: Some(state),
            name: None,
        }
    }

    fn ids(page: &HistoryPage) -> Vec<u64> {
        page.jobs.iter().map(|job| job.id.get()).collect()
    }

    #[test]
    fn pages_count_and_filter_from_the_index_and_follow_the_file_as_it_grows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.jsonl");
        let index = HistoryIndex::new(path.clone());
        let none = |_| false;
        assert_eq!(
            index
                .page(HistoryFilter::default(), none, 0, 10)
                .unwrap()
                .total,
            0
        );

        let mut writer = HistoryWriter::new(path.clone());
        let status = |id: u64| {
            if id.is_multiple_of(4) {
                JobStatus::Failed {
                    message: "x".into(),
                }
            } else {
                JobStatus::Succeeded
            }
        };
        let batch: Vec<JobSummary> = (1..=100_000).map(|id| summary(id, status(id))).collect();
        writer.append(&batch).unwrap();

        let started = std::time::Instant::now();
        let page = index.page(HistoryFilter::default(), none, 0, 3).unwrap();
        assert_eq!(page.total, 100_000);
        assert_eq!(ids(&page), [100_000, 99_999, 99_998]);
        // Deep in the history, failed only: ids ≡ 0 (mod 4), newest first.
        let failed = index.page(state("failed"), none, 20_000, 2).unwrap();
        assert_eq!(failed.total, 25_000);
        assert_eq!(ids(&failed), [20_000, 19_996]);
        // By name, and by name and state: a thousandth is named, all of those failed.
        let nightly = HistoryFilter {
            state: Some("failed"),
            name: Some("nightly"),
        };
        let named = index.page(nightly, none, 1, 2).unwrap();
        assert_eq!(named.total, 100);
        assert_eq!(ids(&named), [99_000, 98_000]);
        // Later pages use the index built by the first.
        let again = std::time::Instant::now();
        let last = index
            .page(HistoryFilter::default(), none, 99_999, 50)
            .unwrap();
        assert_eq!(ids(&last), [1]);
        assert!(again.elapsed() < std::time::Duration::from_millis(300));
        assert!(started.elapsed() < std::time::Duration::from_secs(20));

        // A job appended again (a restarted replica) is listed once, as its newest line says;
        // jobs the state still has are left out.
        writer
            .append(&[
                summary(7, JobStatus::Cancelled),
                summary(100_001, JobStatus::Succeeded),
            ])
            .unwrap();
        let page = index
            .page(
                HistoryFilter::default(),
                |job| job == JobId::new(100_000),
                0,
                3,
            )
            .unwrap();
        assert_eq!(page.total, 100_000);
        assert_eq!(ids(&page), [100_001, 7, 99_999]);
        assert_eq!(page.jobs[1].status, JobStatus::Cancelled);
        assert_eq!(index.page(state("cancelled"), none, 0, 5).unwrap().total, 1);
    }

    #[test]
    fn a_line_being_written_waits_and_a_replaced_file_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.jsonl");
        let index = HistoryIndex::new(path.clone());
        let mut line = serde_json::to_vec(&summary(1, JobStatus::Succeeded)).unwrap();
        line.push(b'\n');
        let torn = serde_json::to_vec(&summary(2, JobStatus::Succeeded)).unwrap();
        let mut bytes = line.clone();
        bytes.extend_from_slice(&torn[..10]);
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(
            ids(&index
                .page(HistoryFilter::default(), |_| false, 0, 5)
                .unwrap()),
            [1]
        );
        std::fs::write(&path, &line[..line.len() - 1]).unwrap();
        let page = index
            .page(HistoryFilter::default(), |_| false, 0, 5)
            .unwrap();
        assert_eq!(
            page.total, 0,
            "a shorter file is indexed again, its torn line waits"
        );
    }
}
