//! Streamed results: the output blocks a driver hands to its client as the job produces them.
//!
//! A node keeps one [`ResultStreams`] for the drivers it hosts. A driver whose job streams
//! its result ([`ResultDelivery::Streamed`](floe_core::job::ResultDelivery)) opens a
//! [`StreamPublisher`] for its attempt and publishes each output bundle as it is emitted, in
//! output order; the node answers the client's `NextOutputs` long-polls from it. A poll says
//! how many blocks the client has read, which acknowledges them: the driver frees acknowledged
//! blocks and pauses the final operator while the unacknowledged bytes exceed the job's
//! buffer, so a slow reader holds production instead of filling the stores.
//!
//! Ownership: the driver owns every block until the client acknowledged it, and frees the
//! rest when the job ends (a failure or a cancel ends the stream at once, with its reason).
//! The publisher is the stream's one owner: dropping it (the driver ended, or was aborted)
//! ends a stream still open with an error and removes it from the node, so no entry outlives
//! its driver. A client that finds no stream learns the end from the job's record.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use floe_api::node_protocol::{StreamEnd, StreamedOutputs};
use floe_core::JobId;
use floe_core::job::OutputBlock;
use tokio::sync::watch;

/// The most blocks one `NextOutputs` answer carries, so an answer stays a small frame.
const MAX_BLOCKS_PER_ANSWER: usize = 1024;

/// What the driver has published and the client not yet acknowledged, and how it ended.
#[derive(Debug, Default)]
struct Published {
    /// The output index of `blocks[0]`: everything before it is acknowledged.
    first: u64,
    blocks: Vec<OutputBlock>,
    end: Option<StreamEnd>,
}

impl Published {
    fn total(&self) -> u64 {
        self.first + self.blocks.len() as u64
    }
}

#[derive(Debug)]
struct Stream {
    attempt: u32,
    published: watch::Sender<Published>,
    /// How many blocks the client acknowledged (never goes down).
    acked: watch::Sender<u64>,
    /// When a client last asked, to tell a slow reader from a vanished one.
    last_poll: Mutex<Instant>,
}

/// The streams of the drivers a node hosts, by job. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct ResultStreams {
    streams: Arc<Mutex<BTreeMap<JobId, Arc<Stream>>>>,
}

impl ResultStreams {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<JobId, Arc<Stream>>> {
        // Every critical section is one map operation: a panic leaves the map whole.
        self.streams.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens the stream of `attempt` of `job`, replacing an earlier attempt's.
    pub fn open(&self, job: JobId, attempt: u32) -> StreamPublisher {
        let stream = Arc::new(Stream {
            attempt,
            published: watch::Sender::new(Published::default()),
            acked: watch::Sender::new(0),
            last_poll: Mutex::new(Instant::now()),
        });
        self.lock().insert(job, Arc::clone(&stream));
        StreamPublisher {
            streams: self.clone(),
            job,
            stream: StreamHandle(stream),
        }
    }

    /// How many streams are open (for tests of their end).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Answers a client's long-poll: acknowledges the first `from` blocks, then waits up to
    /// `wait` for a block after them or for the end. `None` when no stream of that attempt is
    /// open here; an error when `from` is past what was published.
    pub async fn next(
        &self,
        job: JobId,
        attempt: u32,
        from: u64,
        wait: Duration,
    ) -> Result<Option<StreamedOutputs>, String> {
        let Some(stream) = self
            .lock()
            .get(&job)
            .filter(|s| s.attempt == attempt)
            .cloned()
        else {
            return Ok(None);
        };
        *stream
            .last_poll
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        let total = stream.published.borrow().total();
        if from > total {
            return Err(format!(
                "job {job} has published {total} output blocks; {from} cannot have been read"
            ));
        }
        stream.published.send_modify(|published| {
            let read = usize::try_from(from.saturating_sub(published.first))
                .unwrap_or(usize::MAX)
                .min(published.blocks.len());
            published.blocks.drain(..read);
            published.first += read as u64;
        });
        stream.acked.send_if_modified(|acked| {
            let advanced = from > *acked;
            *acked = (*acked).max(from);
            advanced
        });
        let mut watching = stream.published.subscribe();
        // A timeout, or the publisher gone, both answer with what is there now.
        let _ = tokio::time::timeout(
            wait,
            watching.wait_for(|published| published.total() > from || published.end.is_some()),
        )
        .await;
        let published = watching.borrow();
        let start = usize::try_from(from.saturating_sub(published.first)).unwrap_or(usize::MAX);
        let blocks: Vec<OutputBlock> = published
            .blocks
            .iter()
            .skip(start)
            .take(MAX_BLOCKS_PER_ANSWER)
            .copied()
            .collect();
        let all_sent = from + blocks.len() as u64 == published.total();
        let end = match &published.end {
            Some(StreamEnd::Complete) if !all_sent => None,
            end => end.clone(),
        };
        Ok(Some(StreamedOutputs { from, blocks, end }))
    }
}

/// The driver's side of one open stream, shared by its execution. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct StreamHandle(Arc<Stream>);

impl StreamHandle {
    pub(crate) fn publish(&self, blocks: impl IntoIterator<Item = OutputBlock>) {
        self.0
            .published
            .send_modify(|published| published.blocks.extend(blocks));
    }

    /// Blocks published so far.
    pub(crate) fn published(&self) -> u64 {
        self.0.published.borrow().total()
    }

    pub(crate) fn acked(&self) -> u64 {
        *self.0.acked.borrow()
    }

    /// A receiver woken by each acknowledgement.
    pub(crate) fn watch_acks(&self) -> watch::Receiver<u64> {
        self.0.acked.subscribe()
    }

    /// How long since a client last asked for the stream.
    pub(crate) fn idle(&self) -> Duration {
        self.0
            .last_poll
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .elapsed()
    }

    fn end(&self, end: StreamEnd) {
        self.0.published.send_modify(|published| {
            published.end.get_or_insert(end);
        });
    }
}

/// The owner of an open stream: ends it and removes it from the node when dropped.
#[derive(Debug)]
pub struct StreamPublisher {
    streams: ResultStreams,
    job: JobId,
    stream: StreamHandle,
}

impl StreamPublisher {
    pub(crate) fn handle(&self) -> StreamHandle {
        self.stream.clone()
    }

    /// Ends the stream with the job's outcome (the first end given is kept).
    pub(crate) fn end(&self, end: StreamEnd) {
        self.stream.end(end);
    }
}

impl Drop for StreamPublisher {
    fn drop(&mut self) {
        self.stream.end(StreamEnd::Failed {
            message: "the job's driver stopped before the stream ended".into(),
        });
        let mut streams = self.streams.lock();
        if streams
            .get(&self.job)
            .is_some_and(|open| Arc::ptr_eq(open, &self.stream.0))
        {
            streams.remove(&self.job);
        }
    }
}

#[cfg(test)]
mod tests {
    use floe_core::{NodeId, ObjectId};

    use super::*;

    fn block(n: u128) -> OutputBlock {
        OutputBlock {
            object: ObjectId::new(n),
            node: NodeId::new(1),
            rows: 1,
            bytes: 10,
        }
    }

    #[tokio::test]
    async fn a_poll_acknowledges_what_it_read_and_the_end_follows_the_last_block() {
        let streams = ResultStreams::default();
        let job = JobId::new(7);
        let publisher = streams.open(job, 1);
        let handle = publisher.handle();
        handle.publish([block(1), block(2)]);
        let wait = Duration::from_millis(10);
        let first = streams.next(job, 1, 0, wait).await.unwrap().unwrap();
        assert_eq!(first.blocks, vec![block(1), block(2)]);
        assert_eq!(handle.acked(), 0);
        publisher.end(StreamEnd::Complete);
        // The end comes with the last blocks.
        let after_one = streams.next(job, 1, 1, wait).await.unwrap().unwrap();
        assert_eq!(
            (after_one.blocks, after_one.end),
            (vec![block(2)], Some(StreamEnd::Complete))
        );
        assert_eq!(handle.acked(), 1);
        let last = streams.next(job, 1, 2, wait).await.unwrap().unwrap();
        assert_eq!((last.blocks, last.end), (vec![], Some(StreamEnd::Complete)));
        assert!(streams.next(job, 1, 3, wait).await.is_err());
        assert!(streams.next(job, 2, 2, wait).await.unwrap().is_none());
        drop(publisher);
        assert!(streams.is_empty());
        assert!(streams.next(job, 1, 2, wait).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_failure_ends_the_stream_at_once_and_a_dropped_publisher_ends_it_too() {
        let streams = ResultStreams::default();
        let job = JobId::new(8);
        let publisher = streams.open(job, 1);
        publisher.handle().publish([block(1)]);
        publisher.end(StreamEnd::Failed {
            message: "boom".into(),
        });
        let answer = streams
            .next(job, 1, 0, Duration::ZERO)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            answer.end,
            Some(StreamEnd::Failed {
                message: "boom".into()
            })
        );
        drop(publisher);
        let other = JobId::new(9);
        let publisher = streams.open(other, 1);
        let waiting = {
            let streams = streams.clone();
            tokio::spawn(async move { streams.next(other, 1, 0, Duration::from_secs(30)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(publisher);
        let answer = waiting.await.unwrap().unwrap().unwrap();
        assert!(matches!(answer.end, Some(StreamEnd::Failed { .. })));
        assert!(streams.is_empty());
    }
}
