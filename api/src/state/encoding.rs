//! The state's encoding for a snapshot, copying what the last snapshot already encoded.
//!
//! Most of a large state is finished jobs, whose records rarely change again (a release of
//! their output is about all), and encoding them was the larger part of a snapshot build's
//! CPU time, which commits pay for whatever
//! the builder's priority (docs/BENCHMARKS.md). Each snapshot keeps where every job record's
//! bytes lie in it ([`EncodedJobs`]); the next one copies those bytes for each record that
//! is still the same shared record, and encodes only the others.
//!
//! Invariant: the result is byte for byte [`ClusterState::encode`]'s. It holds because
//! [`EncodedJobs`] holds the jobs map it encoded (an O(1) copy), so every record whose bytes
//! it kept stays alive and shared: `apply`'s copy-on-write (`Arc::make_mut`) copies such a
//! record before changing it, and no other record can be allocated at its address. A record
//! at a kept address is the kept record, unchanged. Records are matched by address alone,
//! never read: taking a reference to each (`Arc::clone`) would touch every record's
//! counter, a cache miss each, which cost more than encoding them.

use std::sync::Arc;

use bytes::Bytes;
use floe_core::JobId;
use floe_core::wire::codec;
use imbl::OrdMap;

use super::{ClusterState, JobRecord};
use crate::Result;

/// Where each job record's encoding lies in a snapshot's data, for the next snapshot to copy.
#[derive(Default)]
pub struct EncodedJobs {
    data: Bytes,
    /// The records encoded, held so that none of them changes or is freed (see the module's
    /// invariant).
    _jobs: OrdMap<JobId, Arc<JobRecord>>,
    /// In job id order, as the state's jobs iterate.
    records: Vec<EncodedJob>,
    /// How many of the records were copied from the last encoding rather than encoded.
    copied: usize,
}

struct EncodedJob {
    id: JobId,
    /// The record's address, which identifies it while `EncodedJobs::_jobs` holds it.
    address: usize,
    start: usize,
    end: usize,
}

impl EncodedJobs {
    /// The whole state's encoding.
    pub fn data(&self) -> &Bytes {
        &self.data
    }

    /// How many records' encodings are kept.
    pub fn records(&self) -> usize {
        self.records.len()
    }

    /// How many records were copied from the last encoding rather than encoded.
    pub fn copied(&self) -> usize {
        self.copied
    }
}

impl ClusterState {
    /// Encodes the state into a buffer of `capacity` bytes, copying from `last` each job
    /// record it holds unchanged; the encoding, the same bytes as [`ClusterState::encode`]'s,
    /// is the result's [`EncodedJobs::data`].
    pub fn encode_reusing(&self, last: &EncodedJobs, capacity: usize) -> Result<EncodedJobs> {
        // Taken apart without `..`, so a field added to the state fails to compile here until
        // it is encoded (or, like `submissions`, named as not encoded). Fields reordered, or
        // given serde attributes, compile still: the tests, which compare with `encode`,
        // catch those.
        let ClusterState {
            applied_index,
            applied_commands,
            next_node_id,
            next_job_id,
            nodes,
            jobs,
            submissions: _,
            actors,
            cache,
            unfinished,
            drivers,
            outputs_to_free,
            job_counts,
            ended,
            holding_outputs,
            actors_by_job,
            cache_use,
        } = self;
        let mut data = Vec::with_capacity(capacity);
        let out = &mut data;
        codec::encode_into(applied_index, out)?;
        codec::encode_into(applied_commands, out)?;
        codec::encode_into(next_node_id, out)?;
        codec::encode_into(next_job_id, out)?;
        codec::encode_into(nodes, out)?;
        codec::encode_len(jobs.len(), out)?;
        let mut last_records = last.records.iter().peekable();
        let mut records = Vec::with_capacity(jobs.len());
        let mut copied = 0;
        for (id, record) in jobs {
            codec::encode_into(id, out)?;
            let address = Arc::as_ptr(record).addr();
            while last_records.next_if(|kept| kept.id < *id).is_some() {}
            let start = out.len();
            match last_records.next_if(|kept| kept.id == *id) {
                Some(kept) if kept.address == address => {
                    out.extend_from_slice(&last.data[kept.start..kept.end]);
                    copied += 1;
                }
                _ => codec::encode_into(&**record, out)?,
            }
            records.push(EncodedJob {
                id: *id,
                address,
                start,
                end: out.len(),
            });
        }
        codec::encode_into(actors, out)?;
        codec::encode_into(cache, out)?;
        codec::encode_into(unfinished, out)?;
        codec::encode_into(drivers, out)?;
        codec::encode_into(outputs_to_free, out)?;
        codec::encode_into(job_counts, out)?;
        codec::encode_into(ended, out)?;
        codec::encode_into(holding_outputs, out)?;
        codec::encode_into(actors_by_job, out)?;
        codec::encode_into(cache_use, out)?;
        Ok(EncodedJobs {
            data: Bytes::from(data),
            _jobs: jobs.clone(),
            records,
            copied,
        })
    }
}
