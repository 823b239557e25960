//! floe-testkit: what floe's integration tests share, so no test file copies another's set-up.
//!
//! - [`cluster`]: real clusters of `floe scheduler` and `floe node` processes
//!   ([`cluster::TestCluster`]), their settings, and the runtime a synchronous test uses.
//! - [`node`]: calls to a node agent's RPC service.
//! - [`process`]: the `floe` command, signals by pid, and waiting for processes to be gone.
//! - [`batches`]: values read back out of result batches.
//! - [`files`]: data files written for a test, and Parquet files a job wrote, read back.
//! - [`http`]: a plain HTTP/1.1 client over a TCP socket, enough for the REST API and a
//!   WebDriver server, so the tests depend on no HTTP client crate.
//!
//! The tests pass the binary under test in (`env!("CARGO_BIN_EXE_floe")` only exists in
//! them). A dev-dependency only: nothing in a production binary links it.

// Helpers fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

pub mod batches;
pub mod cluster;
pub mod files;
pub mod http;
pub mod node;
pub mod process;
pub mod s3;
