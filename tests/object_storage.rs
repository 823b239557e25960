//! A multi-process cluster reading and writing object storage: a real S3-compatible server
//! (`s3s-fs`) on 127.0.0.1, with its keys passed to every process in the usual AWS
//! environment variables. Results are checked against sums computed here; the keys must show
//! up in no job record, REST answer or log.
//!
//! One test: the environment is set once, before the cluster's processes start.
#![allow(clippy::unwrap_used)]

#[path = "object_storage/shared.rs"]
mod shared;

use floe_testkit::s3::S3Server;

#[test]
fn a_cluster_reads_and_writes_s3_and_never_shows_the_keys() {
    let server = S3Server::start(&["lake"]);
    // SAFETY: the only test of this binary, before any thread or process of its own starts;
    // the cluster's processes inherit the variables.
    unsafe { server.export_env() };
    shared::a_cluster_reads_and_writes_s3_and_never_shows_the_keys(&server, &[]);
}
