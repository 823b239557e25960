//! Reading a job's result while the job runs.
//!
//! A job submitted with [`ResultDelivery::Streamed`] hands its output blocks to the client as
//! it produces them. [`ResultStream`] asks the node running the job's driver (named in the
//! replicated job record) for the next blocks with a long-poll, `NextOutputs`, that also
//! acknowledges every block read so far; the blocks themselves come from the nodes holding
//! them, as a held output's do ([`Holders`]). The scheduler's leader is not in the per-block
//! path.
//!
//! Ownership: the driver frees each block once acknowledged, and holds production while the
//! client lags by the job's buffer; the job ends when the client has read every block. A
//! stream dropped before its end cancels the job (in the background, on the client's
//! runtime), which frees what it still holds; a client that vanishes without a word is
//! caught by the driver after 10 minutes without a poll. A failure or a cancel ends the
//! stream with the job's error.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use arrow::record_batch::RecordBatch;
use floe_api::node_protocol::{NodeProtocol, NodeRequest, NodeResponse, StreamEnd};
use floe_api::state::{Command, JobRecord, JobStatus};
use floe_core::JobId;
use floe_core::job::{OutputBlock, ResultDelivery};
use floe_core::wire::RpcClient;

use crate::cluster::{Holders, Inner};
use crate::{Error, Result};

/// How long one `NextOutputs` poll lets the driver's node hold it (the node caps it at 10 s,
/// under the client's read timeout).
const POLL_WAIT: Duration = Duration::from_secs(5);
/// How long a watch of the job record waits for its driver to start, per call.
const DRIVER_WAIT: Duration = Duration::from_millis(200);
/// The pause before asking again when the driver's node has no stream open yet (the driver
/// is planning), or no longer (it is committing the outcome).
const NO_STREAM_PAUSE: Duration = Duration::from_millis(50);
/// How long the end of a stream waits for the driver to commit the job's success: it says
/// the output is complete just before it proposes that, so this is one commit, not a wait
/// on the job.
const FINISH_WAIT: Duration = Duration::from_secs(1);

/// The default buffer of a streamed result: the output bytes a driver lets wait for the
/// client before it pauses the final operator. Large enough to keep every node busy on
/// tasks of 1–128 MiB blocks, small against a node's store.
pub const DEFAULT_STREAM_BUFFER_BYTES: u64 = 256 << 20;

/// Where the stream is read from.
enum Source {
    /// The driver is not known yet (the job is pending, or its driver restarted).
    Unknown,
    /// Attempt `attempt`'s driver, on the node at the other end of `node`.
    Driver {
        attempt: u32,
        node: Box<RpcClient<NodeProtocol>>,
    },
    /// Every block was read, or the stream failed: nothing more comes.
    Ended,
}

/// A streamed job's output, read in order while the job produces it.
pub struct ResultStream {
    inner: Arc<Inner>,
    job: JobId,
    source: Source,
    /// The attempt whose blocks were read, once one was.
    attempt: Option<u32>,
    /// Blocks read and decoded: what the next poll acknowledges.
    read: u64,
    /// Blocks the driver announced, not yet read.
    announced: VecDeque<OutputBlock>,
    /// Whether the driver said the output is complete after the announced blocks.
    complete: bool,
    holders: Holders,
    /// Batches of the current block not yet returned, last first.
    pending: Vec<RecordBatch>,
}

impl ResultStream {
    pub(crate) fn new(inner: Arc<Inner>, job: JobId) -> Self {
        Self {
            inner,
            job,
            source: Source::Unknown,
            attempt: None,
            read: 0,
            announced: VecDeque::new(),
            complete: false,
            holders: Holders::default(),
            pending: Vec::new(),
        }
    }

    pub fn job(&self) -> JobId {
        self.job
    }

    /// Blocks read so far.
    pub fn blocks_read(&self) -> u64 {
        self.read
    }

    /// The next batch, as soon as the job has produced it; `None` after the last one, once
    /// the job's record says it ended (or a second passed without that). An error (the job
    /// failed, was cancelled, a block was lost) ends the stream.
    pub async fn next_batch(&mut self) -> Result<Option<RecordBatch>> {
        let next = self.next_inner().await;
        if next.is_err() {
            self.source = Source::Ended;
        }
        if matches!(self.source, Source::Ended) {
            self.holders.close();
        }
        next
    }

    async fn next_inner(&mut self) -> Result<Option<RecordBatch>> {
        loop {
            if let Some(batch) = self.pending.pop() {
                return Ok(Some(batch));
            }
            if matches!(self.source, Source::Ended) {
                return Ok(None);
            }
            if let Some(block) = self.announced.pop_front() {
                match self.holders.fetch(&self.inner, &block).await {
                    Ok(mut batches) => {
                        self.read += 1;
                        batches.reverse();
                        self.pending = batches;
                    }
                    // A failing job frees its blocks: its error says more than the block's.
                    Err(lost) => return Err(self.poll(Duration::ZERO).await.err().unwrap_or(lost)),
                }
                continue;
            }
            if self.complete {
                self.await_finish().await;
                self.source = Source::Ended;
                return Ok(None);
            }
            self.poll(POLL_WAIT).await?;
        }
    }

    /// Waits for the job's record to say it ended, so whoever read the whole result sees the
    /// job ended (its stats, its status) as soon as the stream says so. Every block is read
    /// whatever happens here: a driver that dies before its commit only leaves the record
    /// behind, and that is not the reader's error.
    async fn await_finish(&self) {
        let watched = self
            .inner
            .scheduler
            .lock()
            .await
            .watch_job(self.job, FINISH_WAIT)
            .await;
        match watched {
            Ok(Some(record)) if record.status.is_finished() => {}
            Ok(record) => {
                let status = record.map(|record| record.status.name());
                tracing::debug!(job = %self.job, ?status, "the job's end is not committed yet");
            }
            Err(error) => tracing::debug!(job = %self.job, %error, "cannot read the job's end"),
        }
    }

    /// Asks the driver's node for the blocks after those read, acknowledging those.
    async fn poll(&mut self, wait: Duration) -> Result<()> {
        let (attempt, node) = match &mut self.source {
            Source::Driver { attempt, node } => (*attempt, node),
            Source::Ended => return Ok(()),
            Source::Unknown => return self.find_driver().await,
        };
        let request = NodeRequest::NextOutputs {
            job: self.job,
            attempt,
            from: self.read,
            wait_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
        };
        let answer = match node.call(&request).await {
            Ok(NodeResponse::Outputs(answer)) => answer,
            Ok(other) => return Err(Error::Unexpected(format!("{other:?}"))),
            // The node died or restarted: the job record says what happens next.
            Err(error) => {
                tracing::debug!(job = %self.job, %error, "the driver's node did not answer");
                None
            }
        };
        let Some(outputs) = answer else {
            self.source = Source::Unknown;
            tokio::time::sleep(NO_STREAM_PAUSE).await;
            return self.find_driver().await;
        };
        self.announced.extend(outputs.blocks);
        match outputs.end {
            None => Ok(()),
            Some(StreamEnd::Complete) => {
                self.complete = true;
                Ok(())
            }
            Some(StreamEnd::Failed { message }) => Err(Error::JobFailed {
                job: self.job,
                message,
            }),
            Some(StreamEnd::Cancelled) => Err(Error::JobCancelled(self.job)),
        }
    }

    /// Learns from the job record which driver streams the job now, or how it ended.
    async fn find_driver(&mut self) -> Result<()> {
        let record = self
            .inner
            .scheduler
            .lock()
            .await
            .watch_job(self.job, DRIVER_WAIT)
            .await?
            .ok_or(Error::UnknownJob(self.job))?;
        match &record.status {
            // It succeeds only once every block is acknowledged: nothing is left to read, and
            // the record already says the job ended.
            JobStatus::Succeeded => {
                self.source = Source::Ended;
                Ok(())
            }
            JobStatus::Failed { message } => Err(Error::JobFailed {
                job: self.job,
                message: message.clone(),
            }),
            JobStatus::Cancelled => Err(Error::JobCancelled(self.job)),
            JobStatus::Pending => Ok(()),
            JobStatus::Running => self.connect_driver(&record).await,
        }
    }

    async fn connect_driver(&mut self, record: &JobRecord) -> Result<()> {
        let Some(driver) = record.driver else {
            return Ok(());
        };
        if self.read > 0 && self.attempt != Some(record.attempts) {
            return Err(Error::StreamInterrupted {
                job: self.job,
                reason: format!(
                    "its driver started again (attempt {}) after {} blocks were read, and a \
                     new attempt streams from the start",
                    record.attempts, self.read
                ),
            });
        }
        let Some(addr) = self.holders.address(&self.inner, driver).await? else {
            return Ok(());
        };
        // A node that cannot be reached now is asked again on the next look at the record.
        match RpcClient::<NodeProtocol>::connect(&addr, self.inner.wire.clone()).await {
            Ok(node) => {
                self.source = Source::Driver {
                    attempt: record.attempts,
                    node: Box::new(node),
                };
                self.attempt = Some(record.attempts);
            }
            Err(error) => {
                tracing::debug!(job = %self.job, %driver, %error, "cannot reach the driver's node");
                tokio::time::sleep(NO_STREAM_PAUSE).await;
            }
        }
        Ok(())
    }
}

impl Drop for ResultStream {
    fn drop(&mut self) {
        let job = self.job;
        match std::mem::replace(&mut self.source, Source::Ended) {
            Source::Ended => {}
            // Everything was read but the last acknowledgement not sent: send it, so the job
            // ends as succeeded rather than waiting for a reader that left.
            Source::Driver { attempt, mut node } if self.complete && self.announced.is_empty() => {
                let request = NodeRequest::NextOutputs {
                    job,
                    attempt,
                    from: self.read,
                    wait_ms: 0,
                };
                self.inner.runtime.spawn(async move {
                    if let Err(error) = node.call(&request).await {
                        tracing::debug!(%job, %error, "acknowledging the last result blocks failed");
                    }
                });
            }
            // Left before the end: the job is cancelled, and frees what it holds.
            Source::Driver { .. } | Source::Unknown => {
                let inner = Arc::clone(&self.inner);
                self.inner.runtime.spawn(async move {
                    let cancel = Command::CancelJob { job };
                    if let Err(error) = inner.propose_for(job, cancel).await {
                        tracing::debug!(%job, %error, "cancelling an abandoned stream's job failed");
                    }
                });
            }
        }
    }
}

/// The options of a job streamed to this client: `options`, streamed with the default buffer
/// unless they already say how.
pub(crate) fn streamed(options: &floe_core::job::JobOptions) -> floe_core::job::JobOptions {
    let mut options = options.clone();
    if options.result == ResultDelivery::Held {
        options.result = ResultDelivery::Streamed {
            buffer_bytes: DEFAULT_STREAM_BUFFER_BYTES,
        };
    }
    options
}
