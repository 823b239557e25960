//! `[tls]`: the certificate files of a cluster that runs TLS.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::ConfigError;
use crate::wire::TlsError;

/// `[tls]`: PEM files. Every path empty (the default) means plaintext, which servers accept
/// only on a loopback address. A client sets `ca` alone; a cluster member (replica, node)
/// sets all three, serves with `cert` and presents it as its client certificate too.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// The CA certificate(s) peers' certificates must chain to. Default empty: no TLS.
    pub ca: PathBuf,
    /// This process's certificate chain, leaf first; it must name (DNS or IP) the host the
    /// others reach it by. Default empty.
    pub cert: PathBuf,
    /// The private key of `cert` (PKCS#8, PKCS#1 or SEC1). Default empty.
    pub key: PathBuf,
}

/// Which files a process has: what it can do over TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsRole<'a> {
    /// No TLS: connections are plaintext.
    Plaintext,
    /// Verifies servers against `ca`; has no certificate of its own (a user's client).
    Client { ca: &'a Path },
    /// Verifies against `ca`, serves with `cert`, and presents it to servers it calls.
    Member {
        ca: &'a Path,
        cert: &'a Path,
        key: &'a Path,
    },
}

impl TlsConfig {
    /// What the files set make of this process; a combination that means nothing (a key
    /// without a certificate, a certificate without a CA to check peers by) is an error.
    pub fn role(&self) -> Result<TlsRole<'_>, TlsError> {
        let set = |path: &PathBuf| !path.as_os_str().is_empty();
        match (set(&self.ca), set(&self.cert), set(&self.key)) {
            (false, false, false) => Ok(TlsRole::Plaintext),
            (true, false, false) => Ok(TlsRole::Client { ca: &self.ca }),
            (true, true, true) => Ok(TlsRole::Member {
                ca: &self.ca,
                cert: &self.cert,
                key: &self.key,
            }),
            (_, true, false) => Err(incomplete("tls.key", "is empty while tls.cert is set")),
            (_, false, true) => Err(incomplete("tls.cert", "is empty while tls.key is set")),
            (false, true, true) => Err(incomplete(
                "tls.ca",
                "is empty while tls.cert is set; members verify each other against the CA",
            )),
        }
    }

    /// The same CA without a certificate of its own: what a user's client of this cluster
    /// needs.
    pub fn client_only(&self) -> TlsConfig {
        TlsConfig {
            ca: self.ca.clone(),
            ..TlsConfig::default()
        }
    }

    /// The `section.key=value` settings (`--set`) that give another process these files.
    pub fn settings(&self) -> Vec<String> {
        [("ca", &self.ca), ("cert", &self.cert), ("key", &self.key)]
            .into_iter()
            .filter(|(_, path)| !path.as_os_str().is_empty())
            .map(|(key, path)| format!("tls.{key}={}", path.display()))
            .collect()
    }

    /// Refuses a server that would listen in plaintext on a non-loopback address (whoever
    /// can reach the port could read the cluster's traffic, token included), and a server
    /// with a CA but no certificate of its own (its peers would speak TLS to it).
    pub fn check_server(&self, bind_host: IpAddr) -> Result<(), ConfigError> {
        match self.role()? {
            TlsRole::Member { .. } => Ok(()),
            TlsRole::Plaintext if bind_host.is_loopback() => Ok(()),
            TlsRole::Plaintext => Err(invalid(
                "net.bind_host",
                &format!(
                    "{bind_host} is not a loopback address, and plaintext is allowed only on \
                     loopback; set tls.ca, tls.cert and tls.key (see docs/SECURITY.md)"
                ),
            )),
            // Its peers would speak TLS to a server that cannot.
            TlsRole::Client { .. } => Err(invalid(
                "tls.cert",
                "is empty: a server needs its own certificate and key besides tls.ca",
            )),
        }
    }
}

fn incomplete(key: &'static str, reason: &'static str) -> TlsError {
    TlsError::Incomplete { key, reason }
}

fn invalid(key: &'static str, reason: &str) -> ConfigError {
    ConfigError::Invalid {
        key,
        reason: reason.to_owned(),
    }
}
