//! A node's log files: the agent (with its job drivers) and each worker process write their
//! log to a size-capped, rotated file under `<data_dir>/logs`, and process-UDF children write
//! theirs (stdout and stderr) beside their sockets; [`read_logs`] answers
//! `NodeRequest::ReadLogs` from them, so an operator reads any node's logs from the dashboard.
//!
//! A file is rotated when the next write would take it past [`LogFiles::max_bytes`]:
//! `agent.log` becomes `agent.log.1` (and `.1` becomes `.2`, …), the oldest beyond
//! [`LogFiles::kept`] is removed. So a source never holds more than
//! `max_bytes × (kept + 1)` on disk.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use floe_api::node_protocol::{LogLevel, LogLine, LogQuery};

use crate::{Error, Result};

/// The directory under the data directory that holds the rotated logs.
pub const LOG_DIR: &str = "logs";
/// The agent's log file (its job drivers log there too).
pub const AGENT_LOG: &str = "agent.log";
/// The most lines one `ReadLogs` answers.
pub const MAX_TAIL: u32 = 5_000;
/// Longer lines are cut to this many bytes in an answer.
const MAX_LINE_BYTES: usize = 4 << 10;
/// An answer's lines are cut (oldest first) to this many bytes, well under a frame.
const MAX_ANSWER_BYTES: usize = 2 << 20;

/// How big a log file may grow and how many rotated files are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogFiles {
    pub max_bytes: u64,
    pub kept: u32,
}

impl Default for LogFiles {
    /// 8 MiB a file, 3 rotated kept: at most 32 MiB a source.
    fn default() -> Self {
        Self {
            max_bytes: 8 << 20,
            kept: 3,
        }
    }
}

/// The log file of a worker process in slot `slot`.
pub fn worker_log(slot: u32) -> String {
    format!("worker-{slot}.log")
}

/// A log file that rotates itself; clones write to the same file.
#[derive(Debug, Clone)]
pub struct RotatingLog {
    inner: Arc<Mutex<Rotating>>,
}

#[derive(Debug)]
struct Rotating {
    path: PathBuf,
    limits: LogFiles,
    file: File,
    written: u64,
}

impl RotatingLog {
    /// Opens (appending) `dir/name`, creating `dir` when missing.
    pub fn open(dir: &Path, name: &str, limits: LogFiles) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            op: "creating the log directory",
            source,
        })?;
        let path = dir.join(name);
        let file = append(&path)?;
        let written = file.metadata().map_or(0, |meta| meta.len());
        Ok(Self {
            inner: Arc::new(Mutex::new(Rotating {
                path,
                limits,
                file,
                written,
            })),
        })
    }
}

fn append(path: &Path) -> Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|source| Error::Io {
            op: "opening a log file",
            source,
        })
}

impl Rotating {
    fn rotate(&mut self) -> std::io::Result<()> {
        let numbered = |n: u32| {
            let mut name = self.path.clone().into_os_string();
            name.push(format!(".{n}"));
            PathBuf::from(name)
        };
        let _ = std::fs::remove_file(numbered(self.limits.kept));
        for n in (1..self.limits.kept).rev() {
            let _ = std::fs::rename(numbered(n), numbered(n + 1));
        }
        if self.limits.kept == 0 {
            std::fs::remove_file(&self.path)?;
        } else {
            std::fs::rename(&self.path, numbered(1))?;
        }
        self.file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        self.written = 0;
        Ok(())
    }
}

impl Write for RotatingLog {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if inner.written > 0 && inner.written + bytes.len() as u64 > inner.limits.max_bytes {
            inner.rotate()?;
        }
        let written = inner.file.write(bytes)?;
        inner.written += written as u64;
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .file
            .flush()
    }
}

/// The newest lines matching `query` from the log files under `data_dir`, oldest first.
pub fn read_logs(data_dir: &Path, query: &LogQuery) -> Result<Vec<LogLine>> {
    let tail = query.tail.min(MAX_TAIL) as usize;
    let text = query.text.as_ref().map(|text| text.to_lowercase());
    let job = query.job.map(|job| JobMarks::new(&job.to_string()));
    let mut found: Vec<LogLine> = Vec::new();
    for (source, files) in log_sources(data_dir)? {
        // A source's rotated files, oldest first, so its lines come in order.
        let mut lines: VecDeque<LogLine> = VecDeque::new();
        let mut stamp: Option<String> = None;
        for path in files {
            let Ok(file) = File::open(&path) else {
                continue; // rotated or removed meanwhile
            };
            for line in BufReader::new(file).split(b'\n') {
                let Ok(line) = line else { break };
                let line = String::from_utf8_lossy(&line).into_owned();
                // A line without a time (a panic's, a UDF's) sorts with the line before it.
                if let Some(time) = timestamp(&line) {
                    stamp = Some(time.to_owned());
                }
                let level = line_level(&line);
                let wanted = query
                    .level
                    .is_none_or(|min| level.is_some_and(|l| l >= min))
                    && text
                        .as_ref()
                        .is_none_or(|text| line.to_lowercase().contains(text.as_str()))
                    && job.as_ref().is_none_or(|job| job.matches(&line));
                if !wanted {
                    continue;
                }
                if lines.len() == tail {
                    lines.pop_front();
                }
                lines.push_back(LogLine {
                    source: source.clone(),
                    time: stamp.clone(),
                    level,
                    text: cut(line),
                });
            }
        }
        found.extend(lines);
    }
    // Stable: a source's lines without a time stay in place.
    found.sort_by(|a, b| a.time.cmp(&b.time));
    Ok(newest(found, tail))
}

/// The last `tail` of `lines`, cut further (oldest first) to [`MAX_ANSWER_BYTES`].
pub fn newest(mut lines: Vec<LogLine>, tail: usize) -> Vec<LogLine> {
    if lines.len() > tail {
        lines.drain(..lines.len() - tail);
    }
    let mut bytes = 0;
    let keep = lines
        .iter()
        .rev()
        .take_while(|line| {
            bytes += line.text.len() + line.source.len();
            bytes <= MAX_ANSWER_BYTES
        })
        .count();
    lines.drain(..lines.len() - keep);
    lines
}

fn cut(mut line: String) -> String {
    if line.len() > MAX_LINE_BYTES {
        let mut end = MAX_LINE_BYTES;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
        line.push('…');
    }
    line
}

/// Every log source under `data_dir` with its files, oldest first: the rotated logs in
/// `logs/`, and each live process-UDF child's log in the agent's `udf-<pid>/` directory.
fn log_sources(data_dir: &Path) -> Result<Vec<(String, Vec<PathBuf>)>> {
    let mut sources: std::collections::BTreeMap<String, Vec<(u32, PathBuf)>> =
        std::collections::BTreeMap::new();
    for (path, name) in list(&data_dir.join(LOG_DIR))? {
        let (source, generation) = match name.rsplit_once(".log.") {
            Some((stem, n)) => match n.parse::<u32>() {
                Ok(n) => (format!("{stem}.log"), n),
                Err(_) => continue,
            },
            None if name.ends_with(".log") => (name, 0),
            None => continue,
        };
        sources.entry(source).or_default().push((generation, path));
    }
    for (dir, name) in list(data_dir)? {
        if !name.starts_with("udf-") || !dir.is_dir() {
            continue;
        }
        for (path, child) in list(&dir)? {
            if child.ends_with(".log") {
                sources
                    .entry(format!("udf-{child}"))
                    .or_default()
                    .push((0, path));
            }
        }
    }
    Ok(sources
        .into_iter()
        .map(|(source, mut files)| {
            // The highest generation is the oldest.
            files.sort_by_key(|file| std::cmp::Reverse(file.0));
            (source, files.into_iter().map(|(_, path)| path).collect())
        })
        .collect())
}

/// The entries of `dir` with their names; none when it does not exist.
fn list(dir: &Path) -> Result<Vec<(PathBuf, String)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(Error::Io {
                op: "listing the log directory",
                source,
            });
        }
    };
    Ok(entries
        .filter_map(std::result::Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            Some((entry.path(), name))
        })
        .collect())
}

/// The time a line starts with: text logs begin with an RFC 3339 time, JSON logs carry a
/// `"timestamp"` field.
fn timestamp(line: &str) -> Option<&str> {
    if let Some(rest) = line.split_once("\"timestamp\":\"").map(|(_, rest)| rest) {
        return rest.split('"').next();
    }
    let first = line.split_whitespace().next()?;
    (first.len() >= 20 && first.as_bytes()[..4].iter().all(u8::is_ascii_digit)).then_some(first)
}

/// A line's level: the text format's second word, or the JSON format's `"level"` field.
fn line_level(line: &str) -> Option<LogLevel> {
    if let Some((_, rest)) = line.split_once("\"level\":\"") {
        return LogLevel::parse(rest.split('"').next()?);
    }
    timestamp(line)?;
    LogLevel::parse(line.split_whitespace().nth(1)?)
}

/// The marks of a job in a line: the `job=ID` field of a span or event in text logs, or
/// `"job":"ID"` in JSON logs.
struct JobMarks {
    text: String,
    json: String,
}

impl JobMarks {
    fn new(job: &str) -> Self {
        Self {
            text: format!("job={job}"),
            json: format!("\"job\":\"{job}\""),
        }
    }

    fn matches(&self, line: &str) -> bool {
        if line.contains(&self.json) {
            return true;
        }
        // `job=7` must not match `job=70`.
        line.match_indices(&self.text).any(|(at, _)| {
            let before = line[..at].chars().next_back();
            let after = line[at + self.text.len()..].chars().next();
            before.is_none_or(|c| !c.is_alphanumeric() && c != '_')
                && after.is_none_or(|c| !c.is_ascii_digit())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use floe_core::JobId;

    fn query(job: Option<u64>, tail: u32, text: Option<&str>, level: Option<LogLevel>) -> LogQuery {
        LogQuery {
            job: job.map(JobId::new),
            tail,
            text: text.map(str::to_owned),
            level,
        }
    }

    fn write_lines(log: &mut RotatingLog, lines: &[&str]) {
        for line in lines {
            log.write_all(format!("{line}\n").as_bytes()).unwrap();
        }
    }

    #[test]
    fn a_log_rotates_at_its_cap_and_keeps_only_the_newest_files() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().join(LOG_DIR);
        let limits = LogFiles {
            max_bytes: 100,
            kept: 2,
        };
        let mut log = RotatingLog::open(&logs, AGENT_LOG, limits).unwrap();
        for n in 0..50 {
            write_lines(
                &mut log,
                &[&format!(
                    "2026-12-01T10:00:{n:02}.000000Z  INFO floe: line {n}"
                )],
            );
        }
        let mut names: Vec<String> = list(&logs).unwrap().into_iter().map(|(_, n)| n).collect();
        names.sort();
        assert_eq!(names, ["agent.log", "agent.log.1", "agent.log.2"]);
        for (path, _) in list(&logs).unwrap() {
            assert!(std::fs::metadata(path).unwrap().len() <= 100);
        }
        // The newest lines survive, in order, across the rotated files.
        let lines = read_logs(dir.path(), &query(None, 3, None, None)).unwrap();
        let texts: Vec<&str> = lines.iter().map(|l| l.text.as_str()).collect();
        assert!(texts[0].ends_with("line 47"), "{texts:?}");
        assert!(texts[2].ends_with("line 49"), "{texts:?}");
        assert!(lines.iter().all(|l| l.source == AGENT_LOG));
    }

    #[test]
    fn reading_filters_by_job_text_and_level_and_merges_sources_by_time() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().join(LOG_DIR);
        let mut agent = RotatingLog::open(&logs, AGENT_LOG, LogFiles::default()).unwrap();
        let mut worker = RotatingLog::open(&logs, &worker_log(0), LogFiles::default()).unwrap();
        write_lines(
            &mut agent,
            &[
                "2026-12-01T10:00:01.000000Z  INFO driver{job=7 attempt=1}: floe_driver: started",
                "2026-12-01T10:00:03.000000Z  WARN driver{job=70 attempt=1}: floe_driver: slow",
                "2026-12-01T10:00:05.000000Z ERROR driver{job=7 attempt=1}: floe_driver: Failed",
                "a panic's second line",
            ],
        );
        write_lines(
            &mut worker,
            &["2026-12-01T10:00:02.000000Z DEBUG task{job=7}: floe_node::worker: ran"],
        );
        let udf = dir.path().join("udf-42");
        std::fs::create_dir_all(&udf).unwrap();
        std::fs::write(udf.join("child-0.log"), "model loaded\n").unwrap();

        let all = read_logs(dir.path(), &query(None, 100, None, None)).unwrap();
        assert_eq!(all.len(), 6);
        let job = read_logs(dir.path(), &query(Some(7), 100, None, None)).unwrap();
        let texts: Vec<&str> = job.iter().map(|l| l.text.as_str()).collect();
        assert_eq!(texts.len(), 3, "{texts:?}");
        assert!(texts[0].ends_with("started"));
        assert_eq!(job[1].source, "worker-0.log");
        assert!(texts[2].ends_with("Failed"));
        let warn = read_logs(dir.path(), &query(None, 100, None, Some(LogLevel::Warn))).unwrap();
        assert_eq!(warn.len(), 2);
        assert_eq!(warn[1].level, Some(LogLevel::Error));
        let text = read_logs(dir.path(), &query(None, 100, Some("FAILED"), None)).unwrap();
        assert_eq!(text.len(), 1);
        let udf = read_logs(dir.path(), &query(None, 100, Some("model"), None)).unwrap();
        assert_eq!(udf[0].source, "udf-child-0.log");
        assert_eq!(udf[0].level, None);
    }

    #[test]
    fn json_lines_give_their_level_and_job() {
        let line =
            r#"{"timestamp":"2026-12-01T10:00:01Z","level":"WARN","fields":{},"span":{"job":"7"}}"#;
        assert_eq!(line_level(line), Some(LogLevel::Warn));
        assert!(JobMarks::new("7").matches(line));
        assert!(!JobMarks::new("70").matches(line));
        assert!(!JobMarks::new("7").matches("x subjob=7 y"));
    }
}
