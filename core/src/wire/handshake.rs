//! The first exchange on every connection.
//!
//! The client's hello is `FLOE` + protocol version (u32, big-endian) + a codec-encoded
//! [`Hello`]; the server's reply is `FLOE` + its version + a status byte + a UTF-8 reason.
//! Magic, version and status sit outside the codec so that two different floe releases can
//! always tell each other *why* they cannot talk. Before the credential is checked, frames are
//! limited to [`HANDSHAKE_MAX_FRAME`], so an unauthenticated peer cannot make a server
//! allocate more than that. The hello carries a [`Credential`]; the server's
//! [`Authenticator`] turns it into the [`Principal`] every request is authorized against —
//! what a peer says about itself beyond its credential counts for nothing.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};

use super::tls::ClientCertificate;
use super::{FramedStream, WireError, codec, within};
use crate::auth::{Authenticator, Credential, Principal};

/// Bumped whenever any message layout changes; peers must match exactly.
pub const PROTOCOL_VERSION: u32 = 14;
pub const MAGIC: [u8; 4] = *b"FLOE";
/// The frame limit until the peer has presented a valid credential.
pub const HANDSHAKE_MAX_FRAME: usize = 4096;
const PREFIX_LEN: usize = 8;

/// The codec-encoded part of the client's first frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub credential: Credential,
}

/// Why a server refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Unauthenticated,
    VersionMismatch {
        server: u32,
        client: u32,
    },
    Malformed,
    /// A plaintext peer reached a server that serves only TLS.
    TlsRequired,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Unauthenticated => f.write_str("unauthenticated"),
            Refusal::VersionMismatch { server, client } => write!(
                f,
                "protocol version mismatch (server {server}, client {client})"
            ),
            Refusal::Malformed => f.write_str("malformed handshake"),
            Refusal::TlsRequired => f.write_str("the server requires TLS"),
        }
    }
}

/// The server's answer to a [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeReply {
    Welcome,
    Refused { reason: Refusal, message: String },
}

/// Writes a hello frame body speaking protocol `version` (always [`PROTOCOL_VERSION`] outside
/// tests of version skew).
pub fn encode_hello(version: u32, hello: &Hello, out: &mut Vec<u8>) -> Result<(), WireError> {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&version.to_be_bytes());
    codec::encode_into(hello, out)
}

/// Reads a hello frame body: the peer's protocol version and, when it is ours, its hello.
pub fn decode_hello(body: &[u8]) -> Result<(u32, Option<Hello>), WireError> {
    let version = split_prefix(body)?.0;
    if version != PROTOCOL_VERSION {
        return Ok((version, None));
    }
    let hello = codec::decode(&body[PREFIX_LEN..], "handshake hello")?;
    Ok((version, Some(hello)))
}

pub fn encode_reply(reply: &HandshakeReply, out: &mut Vec<u8>) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    match reply {
        HandshakeReply::Welcome => out.push(0),
        HandshakeReply::Refused { reason, message } => {
            out.push(match reason {
                Refusal::Unauthenticated => 1,
                Refusal::VersionMismatch { .. } => 2,
                Refusal::Malformed => 3,
                Refusal::TlsRequired => 4,
            });
            out.extend_from_slice(message.as_bytes());
        }
    }
}

/// Reads a reply frame body sent to a client that speaks `client_version`.
pub fn decode_reply(body: &[u8], client_version: u32) -> Result<HandshakeReply, WireError> {
    let (server, rest) = split_prefix(body)?;
    let Some((&status, message)) = rest.split_first() else {
        return Err(WireError::NotFloe(
            "the handshake reply has no status".into(),
        ));
    };
    let message = String::from_utf8_lossy(message).into_owned();
    let reason = match status {
        0 => return Ok(HandshakeReply::Welcome),
        1 => Refusal::Unauthenticated,
        2 => Refusal::VersionMismatch {
            server,
            client: client_version,
        },
        3 => Refusal::Malformed,
        4 => Refusal::TlsRequired,
        other => {
            return Err(WireError::NotFloe(format!(
                "unknown handshake status {other}"
            )));
        }
    };
    Ok(HandshakeReply::Refused { reason, message })
}

fn split_prefix(body: &[u8]) -> Result<(u32, &[u8]), WireError> {
    match body.split_first_chunk::<PREFIX_LEN>() {
        Some((prefix, rest)) if prefix[..4] == MAGIC => {
            let version = u32::from_be_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]);
            Ok((version, rest))
        }
        _ => Err(WireError::NotFloe(
            "the peer did not start with the floe handshake".into(),
        )),
    }
}

/// Runs the client side: sends our hello and returns once the server welcomed us.
pub async fn client_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut FramedStream<S>,
    hello: &Hello,
    timeout: Duration,
) -> Result<(), WireError> {
    let exchange = async {
        stream
            .send_with(|out| encode_hello(PROTOCOL_VERSION, hello, out))
            .await?;
        let body = stream.recv(timeout).await?;
        decode_reply(body, PROTOCOL_VERSION)
    };
    let reply = within(timeout, "the handshake", exchange).await??;
    match reply {
        HandshakeReply::Welcome => Ok(()),
        HandshakeReply::Refused { reason, message } => Err(WireError::Refused { reason, message }),
    }
}

/// Runs the server side: reads the hello, checks version and credential (secrets compared in
/// constant time), and answers. A refused peer is told why before the error is returned.
pub async fn server_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut FramedStream<S>,
    authenticator: &Authenticator,
    certificate: ClientCertificate,
    timeout: Duration,
) -> Result<Principal, WireError> {
    let exchange = async {
        let verdict = match stream.recv(timeout).await {
            Ok(body) => judge(body, authenticator, certificate),
            Err(WireError::FrameTooLarge { len, max }) => Err((
                Refusal::Malformed,
                format!("handshake frame of {len} bytes exceeds the {max}-byte limit"),
            )),
            Err(other) => return Err(other),
        };
        let reply = match &verdict {
            Ok(_) => HandshakeReply::Welcome,
            Err((reason, message)) => HandshakeReply::Refused {
                reason: *reason,
                message: message.clone(),
            },
        };
        // The reply is best effort: a peer that sent garbage may already be gone.
        let sent = stream
            .send_with(|out| {
                encode_reply(&reply, out);
                Ok(())
            })
            .await;
        match verdict {
            Ok(peer) => sent.map(|()| peer),
            Err((reason, message)) => Err(WireError::Refused { reason, message }),
        }
    };
    within(timeout, "the handshake", exchange).await?
}

fn judge(
    body: &[u8],
    authenticator: &Authenticator,
    certificate: ClientCertificate,
) -> Result<Principal, (Refusal, String)> {
    let (version, hello) = decode_hello(body)
        .map_err(|error| (Refusal::Malformed, format!("malformed handshake: {error}")))?;
    let Some(hello) = hello else {
        return Err((
            Refusal::VersionMismatch {
                server: PROTOCOL_VERSION,
                client: version,
            },
            format!(
                "protocol version mismatch: this server speaks {PROTOCOL_VERSION}, the peer \
                 speaks {version}; run the same floe release on every machine"
            ),
        ));
    };
    let principal = authenticator
        .verify(&hello.credential)
        .map_err(|refused| (Refusal::Unauthenticated, refused.0))?;
    // Over TLS a stolen secret alone does not make a member: the certificate must come too.
    if principal.is_member() && certificate == ClientCertificate::Absent {
        return Err((
            Refusal::Unauthenticated,
            format!(
                "{principal} presented no certificate: over TLS a cluster member must also \
                 present a certificate signed by the cluster's CA (tls.cert and tls.key)"
            ),
        ));
    }
    Ok(principal)
}
