//! floe-testkit: what floe's integration tests share, so no test file copies another's set-up.
//!
//! - [`http`]: a plain HTTP/1.1 client over a TCP socket, enough for the REST API and a
//!   WebDriver server, so the tests depend on no HTTP client crate.
//! - [`files`]: data files written for a test.
//!
//! A dev-dependency only: nothing in a production binary links it.

#![allow(clippy::unwrap_used)]

pub mod files;
pub mod http;
