//! Bridges raft-rs's slog output into `tracing`, so Raft's own messages (elections, term
//! changes, rejected appends) land in the same log stream, filtered by `RUST_LOG` under the
//! `raft` target.

use std::fmt::Write as _;

use slog::{Drain, Level, Never, OwnedKVList, Record};

/// A slog drain that re-emits every record as a tracing event with target `raft`.
#[derive(Debug, Clone, Copy, Default)]
pub struct TracingDrain;

/// Collects slog key-values as ` key=value` text.
struct KeyValues(String);

impl slog::Serializer for KeyValues {
    fn emit_arguments(&mut self, key: slog::Key, value: &std::fmt::Arguments<'_>) -> slog::Result {
        // Writing to a String cannot fail.
        let _ = write!(self.0, " {key}={value}");
        Ok(())
    }
}

impl Drain for TracingDrain {
    type Ok = ();
    type Err = Never;

    fn log(&self, record: &Record<'_>, values: &OwnedKVList) -> Result<(), Never> {
        let mut fields = KeyValues(String::new());
        // A value whose formatting fails is left out rather than failing the log call.
        let _ = slog::KV::serialize(&record.kv(), record, &mut fields);
        let _ = slog::KV::serialize(values, record, &mut fields);
        let message = record.msg();
        let fields = fields.0;
        match record.level() {
            Level::Critical | Level::Error => {
                tracing::error!(target: "raft", "{message}{fields}");
            }
            Level::Warning => tracing::warn!(target: "raft", "{message}{fields}"),
            Level::Info => tracing::info!(target: "raft", "{message}{fields}"),
            Level::Debug => tracing::debug!(target: "raft", "{message}{fields}"),
            Level::Trace => tracing::trace!(target: "raft", "{message}{fields}"),
        }
        Ok(())
    }
}

/// The logger handed to raft-rs, tagged with the replica's id.
pub fn raft_logger(replica: u64) -> slog::Logger {
    slog::Logger::root(TracingDrain, slog::o!("replica" => replica))
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Collects everything the subscriber writes.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn slog_records_become_tracing_events_with_their_fields() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let logger = raft_logger(7);
            slog::warn!(logger, "became leader"; "term" => 3);
            slog::trace!(logger, "below the subscriber's level");
        });
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(text.contains("WARN"), "{text}");
        assert!(text.contains("raft:"), "the target is raft: {text}");
        assert!(text.contains("became leader term=3 replica=7"), "{text}");
    }
}
