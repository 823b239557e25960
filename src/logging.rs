//! The process's log: a `tracing` event is formatted on the thread that logs it, and written
//! to stderr (and, for nodes and workers, their rotated file) by a thread of its own.
//!
//! A write to stderr or to a file can wait: on a page under writeback, on a full pipe to
//! journald. The scheduler logs from its Raft loop, where such a wait delays every commit
//! behind it (session 35 measured waits of 2.7–9.7 ms), so no thread that logs ever writes: it
//! queues the line. The queue is bounded; while the writer is that far behind, new lines are
//! dropped and counted, and the writer logs the count once it catches up. The queue is flushed
//! when the process ends ([`LogFlushGuard`]) and in the panic hook, so the last lines, and a
//! panic's message, still reach the log.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::time::{Duration, Instant};

use anyhow::Context;
use floe_core::config::LogFormat;
use floe_node::logs::{LogFiles, RotatingLog};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

use crate::node::LogFile;

/// Lines queued for the writer before new ones are dropped: at ~200 bytes a line, 3 MiB.
const QUEUED_LINES: usize = 16 << 10;
/// How long the end of the process, or a panic, waits for the queued lines to be written.
const FLUSH_WAIT: Duration = Duration::from_secs(2);
/// The writer thread's name; a panic on it must not wait for it.
const WRITER_THREAD: &str = "log-writer";

/// Installs the process's log subscriber, filtered by `RUST_LOG` (default: info). Hold the
/// returned guard until the process ends.
pub fn init(format: LogFormat, log_file: Option<LogFile>) -> anyhow::Result<LogFlushGuard> {
    let filter = EnvFilter::try_from_default_env().or_else(|error| {
        if std::env::var_os(EnvFilter::DEFAULT_ENV).is_some() {
            Err(error).context("RUST_LOG is not a valid filter")
        } else {
            Ok(EnvFilter::new("info"))
        }
    })?;
    let file = log_file
        .map(|file| {
            RotatingLog::open(&file.dir, &file.name, LogFiles::default())
                .with_context(|| format!("cannot open the log file {}", file.dir.display()))
        })
        .transpose()?;
    // Colours only for a person at a terminal: log files and journald get plain text.
    let ansi = file.is_none() && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let logs_panics = file.is_some();
    let queue = LogQueue::start(StderrAndFile(file), QUEUED_LINES)
        .context("cannot start the log writer thread")?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(queue.clone());
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    installed.map_err(|error| anyhow::anyhow!("cannot install the log subscriber: {error}"))?;
    let default_hook = std::panic::take_hook();
    let flushed_on_panic = queue.clone();
    std::panic::set_hook(Box::new(move |info| {
        if logs_panics {
            // A panic's message reaches the log file too, where the dashboard reads it.
            tracing::error!("panicked: {info}");
        }
        // What was logged before the panic is written before the default hook's message.
        if std::thread::current().name() != Some(WRITER_THREAD) {
            flushed_on_panic.flush(FLUSH_WAIT);
        }
        default_hook(info);
    }));
    Ok(LogFlushGuard(queue))
}

/// Writes the queued log lines when dropped, waiting at most [`FLUSH_WAIT`].
pub struct LogFlushGuard(LogQueue);

impl Drop for LogFlushGuard {
    fn drop(&mut self) {
        self.0.flush(FLUSH_WAIT);
    }
}

enum Message {
    Line(Vec<u8>),
    /// Answered once every line queued before it is written and the sink flushed.
    Flush(SyncSender<()>),
}

/// The sending side of the log writer thread; each event becomes one queued line.
#[derive(Clone)]
struct LogQueue {
    sender: SyncSender<Message>,
    /// Lines dropped since the writer started, because the queue was full.
    dropped: Arc<AtomicU64>,
}

impl LogQueue {
    /// Starts the thread that writes queued lines to `sink`; it lives as long as the process,
    /// since the installed subscriber holds a sender to the end.
    fn start(sink: impl Write + Send + 'static, capacity: usize) -> std::io::Result<Self> {
        let (sender, receiver) = mpsc::sync_channel(capacity);
        let dropped = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&dropped);
        std::thread::Builder::new()
            .name(WRITER_THREAD.into())
            .spawn(move || write_lines(&receiver, sink, &counted))?;
        Ok(Self { sender, dropped })
    }

    /// Queues `line`, or counts it as dropped when the queue is full; never waits.
    fn push(&self, line: Vec<u8>) {
        match self.sender.try_send(Message::Line(line)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
            // The writer is gone only if it panicked; there is nowhere left to write.
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    /// Waits, at most `wait`, until every line queued so far is written; false if it was not.
    fn flush(&self, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        let (done, written) = mpsc::sync_channel(1);
        let mut flush = Message::Flush(done);
        loop {
            match self.sender.try_send(flush) {
                Ok(()) => break,
                Err(TrySendError::Full(message)) if Instant::now() < deadline => {
                    flush = message;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => return false,
            }
        }
        written
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .is_ok()
    }
}

/// The writer thread: writes each line in order, and logs how many were dropped each time it
/// has caught up with the queue (so that event finds room in it).
fn write_lines(receiver: &Receiver<Message>, mut sink: impl Write, dropped: &AtomicU64) {
    let mut reported = 0;
    loop {
        let message = match receiver.try_recv() {
            Ok(message) => message,
            Err(TryRecvError::Disconnected) => return,
            Err(TryRecvError::Empty) => {
                let total = dropped.load(Ordering::Relaxed);
                if total > reported {
                    tracing::warn!(
                        lines = total - reported,
                        "log lines were dropped: writing the log fell behind"
                    );
                    reported = total;
                }
                let Ok(message) = receiver.recv() else { return };
                message
            }
        };
        match message {
            // A failed write has nowhere to be reported; the next line may succeed.
            Message::Line(line) => {
                let _ = sink.write_all(&line);
            }
            Message::Flush(done) => {
                let _ = sink.flush();
                let _ = done.send(());
            }
        }
    }
}

impl<'a> MakeWriter<'a> for LogQueue {
    type Writer = QueuedLine<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        QueuedLine {
            queue: self,
            line: Vec::new(),
        }
    }
}

/// One event's formatted bytes, queued as one line when the formatter is done with it.
struct QueuedLine<'a> {
    queue: &'a LogQueue,
    line: Vec<u8>,
}

impl Write for QueuedLine<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.line.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for QueuedLine<'_> {
    fn drop(&mut self) {
        if !self.line.is_empty() {
            self.queue.push(std::mem::take(&mut self.line));
        }
    }
}

/// Writes each log line to stderr and, for nodes and workers, to their rotated log file,
/// which the dashboard reads.
struct StderrAndFile(Option<RotatingLog>);

impl Write for StderrAndFile {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        // A closed stderr (a detached agent) must not stop the file from getting the line.
        let _ = std::io::stderr().write_all(bytes);
        match &mut self.0 {
            Some(file) => file.write_all(bytes).map(|()| bytes.len()),
            None => Ok(bytes.len()),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        self.0.as_mut().map_or(Ok(()), Write::flush)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// A sink that records its lines, and holds every write while its gate is closed.
    #[derive(Clone, Default)]
    struct GatedSink {
        lines: Arc<Mutex<Vec<Vec<u8>>>>,
        gate: Arc<Mutex<()>>,
    }

    impl Write for GatedSink {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            let _open = self.gate.lock().unwrap();
            self.lines.lock().unwrap().push(bytes.to_vec());
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn line(n: usize) -> Vec<u8> {
        format!("line {n}\n").into_bytes()
    }

    #[test]
    fn a_stuck_sink_never_holds_the_thread_that_logs_and_lines_past_the_queue_are_counted() {
        const CAPACITY: usize = 8;
        const SENT: usize = 100;
        let sink = GatedSink::default();
        let closed = sink.gate.lock().unwrap();
        let queue = LogQueue::start(sink.clone(), CAPACITY).unwrap();
        // Each event's bytes arrive as one line, whatever pieces the formatter writes them in.
        let (pushed, all_pushed) = mpsc::channel();
        let logging = queue.clone();
        std::thread::spawn(move || {
            for n in 0..SENT {
                let mut writer = logging.make_writer();
                let bytes = line(n);
                let (head, tail) = bytes.split_at(3);
                writer.write_all(head).unwrap();
                writer.write_all(tail).unwrap();
            }
            pushed.send(()).unwrap();
        });
        all_pushed
            .recv_timeout(Duration::from_secs(10))
            .expect("logging waited on a sink that does not write");
        assert!(
            !queue.flush(Duration::from_millis(50)),
            "the sink wrote nothing yet"
        );
        drop(closed);
        assert!(
            queue.flush(FLUSH_WAIT),
            "the queue drains once the sink writes"
        );

        let written = sink.lines.lock().unwrap().clone();
        let dropped = usize::try_from(queue.dropped.load(Ordering::Relaxed)).unwrap();
        assert_eq!(
            written.len() + dropped,
            SENT,
            "every line is written or counted"
        );
        // The writer holds one line in the stuck write and the queue the next ones; no more.
        assert!(
            (CAPACITY..=CAPACITY + 1).contains(&written.len()),
            "{} lines written",
            written.len()
        );
        // Whole lines, in order: the first ones, and (when the writer took its first line only
        // after the queue had filled) one that found the room it left.
        let expected: Vec<Vec<u8>> = (0..CAPACITY).map(line).collect();
        assert_eq!(written[..CAPACITY], expected);
        if let Some(last) = written.get(CAPACITY) {
            assert!((CAPACITY..SENT).any(|n| *last == line(n)), "{last:?}");
        }
    }

    #[test]
    fn the_writer_logs_how_many_lines_it_dropped_once_it_catches_up() {
        const SENT: usize = 50;
        let sink = GatedSink::default();
        let queue = LogQueue::start(sink.clone(), 4).unwrap();
        // The only global subscriber of this test binary: the writer thread's own event goes
        // through it, back into the queue, like every other event of the process.
        let subscriber = tracing_subscriber::fmt()
            .with_writer(queue.clone())
            .with_ansi(false)
            .with_env_filter(EnvFilter::new("floe::logging=warn"))
            .finish();
        tracing::subscriber::set_global_default(subscriber).unwrap();
        let closed = sink.gate.lock().unwrap();
        for n in 0..SENT {
            queue.push(line(n));
        }
        drop(closed);
        let dropped = queue.dropped.load(Ordering::Relaxed);
        assert!(dropped > 0, "a queue of 4 holds {SENT} lines");
        let notice = format!("log lines were dropped: writing the log fell behind lines={dropped}");
        let deadline = Instant::now() + FLUSH_WAIT;
        let reported = loop {
            assert!(queue.flush(FLUSH_WAIT));
            let lines = sink.lines.lock().unwrap().clone();
            let notices: Vec<String> = lines
                .iter()
                .map(|line| String::from_utf8_lossy(line).into_owned())
                .filter(|line| line.contains("dropped"))
                .collect();
            if !notices.is_empty() || Instant::now() > deadline {
                break notices;
            }
        };
        assert_eq!(reported.len(), 1, "{reported:?}");
        assert!(reported[0].contains("WARN"), "{}", reported[0]);
        assert!(reported[0].contains(&notice), "{}", reported[0]);
    }

    #[test]
    fn a_flush_returns_once_everything_queued_before_it_is_written() {
        let sink = GatedSink::default();
        let queue = LogQueue::start(sink.clone(), QUEUED_LINES).unwrap();
        for n in 0..1_000 {
            queue.push(line(n));
        }
        assert!(queue.flush(FLUSH_WAIT));
        let expected: Vec<Vec<u8>> = (0..1_000).map(line).collect();
        assert_eq!(*sink.lines.lock().unwrap(), expected);
        assert_eq!(queue.dropped.load(Ordering::Relaxed), 0);
    }
}
