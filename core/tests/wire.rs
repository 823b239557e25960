//! The wire protocol end to end: frames, handshake and typed RPC over real TCP sockets.

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use floe_core::auth::{Authenticator, ClusterSecret, Credential, Identity};
use floe_core::config::TimeoutsConfig;
use floe_core::wire::handshake::{
    self, HANDSHAKE_MAX_FRAME, HandshakeReply, Hello, MAGIC, Refusal,
};
use floe_core::wire::rpc::{self, Handler, Peer, Protocol, RemoteError, RemoteErrorKind};
use floe_core::wire::{
    FileRange, FramedStream, PROTOCOL_VERSION, RpcClient, RpcServer, WireConfig, WireError,
    WireTls, codec,
};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::net::TcpStream;

const TOKEN: &str = "test-cluster-token";

struct Echo;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum EchoRequest {
    Say(String),
    Blob(Vec<u8>),
    Fail(RemoteErrorKind),
    /// Answered with `len` copies of `byte` as an attachment.
    Repeat {
        byte: u8,
        len: usize,
    },
    /// Answered with an attachment of `len` zeros in memory that says it is also `len` bytes
    /// of the file at `path` from `offset`: what arrives shows which of the two was sent.
    FromFile {
        path: std::path::PathBuf,
        offset: u64,
        len: usize,
    },
    /// Answered with an attachment of several parts: `len` copies of `byte` for each, then
    /// `len` bytes of the file at `path` from `offset` (sent with sendfile).
    Parts {
        repeats: Vec<(u8, usize)>,
        path: std::path::PathBuf,
        offset: u64,
        len: usize,
    },
    /// Answered plainly, with an attachment that only holds a [`Held`].
    Hold,
}

/// Holds nothing but counts its drops in [`HELD_DROPPED`] (only one test asks for it).
struct Held;

static HELD_DROPPED: AtomicUsize = AtomicUsize::new(0);

impl Drop for Held {
    fn drop(&mut self) {
        HELD_DROPPED.fetch_add(1, Ordering::SeqCst);
    }
}

/// File attachments the server has dropped (only one test asks for them).
static FILE_ATTACHMENTS_DROPPED: AtomicUsize = AtomicUsize::new(0);

/// Memory bytes of a file attachment, counted in [`FILE_ATTACHMENTS_DROPPED`] when dropped.
struct CountedBytes(Vec<u8>);

impl AsRef<[u8]> for CountedBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for CountedBytes {
    fn drop(&mut self) {
        FILE_ATTACHMENTS_DROPPED.fetch_add(1, Ordering::SeqCst);
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum EchoResponse {
    Said(String),
    BlobLen(usize),
    Repeated,
}

impl Protocol for Echo {
    const NAME: &'static str = "echo";
    type Request = EchoRequest;
    type Response = EchoResponse;
}

struct EchoHandler;

impl Handler<Echo> for EchoHandler {
    async fn handle(&self, peer: Peer, request: EchoRequest) -> Result<EchoResponse, RemoteError> {
        match request {
            EchoRequest::Say(text) => Ok(EchoResponse::Said(format!(
                "{:?} says {text}",
                peer.principal
            ))),
            EchoRequest::Blob(bytes) => Ok(EchoResponse::BlobLen(bytes.len())),
            EchoRequest::Fail(kind) => Err(RemoteError::new(kind, "asked to fail")),
            EchoRequest::Repeat { .. }
            | EchoRequest::FromFile { .. }
            | EchoRequest::Parts { .. }
            | EchoRequest::Hold => Err(RemoteError::new(
                RemoteErrorKind::Internal,
                "answered by handle_attached",
            )),
        }
    }

    async fn handle_attached(
        &self,
        peer: Peer,
        request: EchoRequest,
    ) -> rpc::AttachedReply<EchoResponse> {
        match request {
            EchoRequest::Repeat { byte, len } => (
                Ok(EchoResponse::Repeated),
                Some(rpc::Attachment::new(vec![byte; len])),
            ),
            EchoRequest::FromFile { path, offset, len } => match std::fs::File::open(&path) {
                Ok(file) => {
                    let range = FileRange {
                        file: Arc::new(file),
                        offset,
                    };
                    let attachment = rpc::Attachment::new(CountedBytes(vec![0; len]));
                    (Ok(EchoResponse::Repeated), Some(attachment.in_file(range)))
                }
                Err(error) => (
                    Err(RemoteError::new(
                        RemoteErrorKind::NotFound,
                        error.to_string(),
                    )),
                    None,
                ),
            },
            EchoRequest::Parts {
                repeats,
                path,
                offset,
                len,
            } => {
                let file = Arc::new(std::fs::File::open(&path).unwrap());
                let mut attachment = rpc::Attachment::new(Vec::new());
                for (byte, len) in repeats {
                    attachment = attachment.then(rpc::Attachment::new(vec![byte; len]));
                }
                let from_file =
                    rpc::Attachment::new(vec![0; len]).in_file(FileRange { file, offset });
                (Ok(EchoResponse::Repeated), Some(attachment.then(from_file)))
            }
            EchoRequest::Hold => (
                Ok(EchoResponse::Repeated),
                Some(rpc::Attachment::holding(Held)),
            ),
            other => (self.handle(peer, other).await, None),
        }
    }
}

fn wire_config(token: &str) -> WireConfig {
    let secret = ClusterSecret::new(token);
    WireConfig {
        identity: Identity::new(Credential::Member {
            secret: secret.clone(),
        }),
        authenticator: Arc::new(Authenticator::new(
            secret,
            None,
            std::path::PathBuf::from("/nonexistent/floe-tokens"),
        )),
        max_frame: 1 << 20,
        timeouts: TimeoutsConfig {
            connect_ms: 2_000,
            handshake_ms: 2_000,
            read_ms: 2_000,
            write_ms: 2_000,
            idle_ms: 10_000,
        },
        tls: WireTls::Plaintext,
    }
}

async fn start_server(config: WireConfig) -> RpcServer {
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    RpcServer::bind::<Echo, _>(addr, Arc::new(EchoHandler), config)
        .await
        .unwrap()
}

/// Connects to `server` as a member presenting `secret`.
async fn connect(server: &RpcServer, secret: &str) -> Result<RpcClient<Echo>, WireError> {
    RpcClient::<Echo>::connect(server.local_addr().to_string(), wire_config(secret)).await
}

async fn assert_serves(server: &RpcServer) {
    let mut client = connect(server, TOKEN).await.unwrap();
    let reply = client.call(&EchoRequest::Say("hi".into())).await.unwrap();
    assert_eq!(reply, EchoResponse::Said("Member says hi".into()));
}

fn pipe(max_frame: usize) -> (FramedStream<DuplexStream>, FramedStream<DuplexStream>) {
    let (a, b) = tokio::io::duplex(1 << 20);
    let timeout = Duration::from_secs(2);
    (
        FramedStream::new(a, max_frame, timeout, timeout),
        FramedStream::new(b, max_frame, timeout, timeout),
    )
}

const WAIT: Duration = Duration::from_secs(2);

#[tokio::test]
async fn every_message_kind_round_trips_through_frames() {
    let (mut left, mut right) = pipe(1 << 20);

    let hello = Hello {
        credential: Credential::Member {
            secret: ClusterSecret::new("secret"),
        },
    };
    left.send_with(|out| handshake::encode_hello(PROTOCOL_VERSION, &hello, out))
        .await
        .unwrap();
    let body = right.recv(WAIT).await.unwrap();
    assert_eq!(&body[..4], &MAGIC, "magic leads the hello");
    assert_eq!(
        handshake::decode_hello(body).unwrap(),
        (PROTOCOL_VERSION, Some(hello))
    );

    let replies = [
        HandshakeReply::Welcome,
        HandshakeReply::Refused {
            reason: Refusal::Unauthenticated,
            message: "no".into(),
        },
        HandshakeReply::Refused {
            reason: Refusal::VersionMismatch {
                server: PROTOCOL_VERSION,
                client: PROTOCOL_VERSION + 1,
            },
            message: "versions".into(),
        },
        HandshakeReply::Refused {
            reason: Refusal::Malformed,
            message: "garbage".into(),
        },
    ];
    for reply in replies {
        left.send_with(|out| {
            handshake::encode_reply(&reply, out);
            Ok(())
        })
        .await
        .unwrap();
        let body = right.recv(WAIT).await.unwrap();
        assert_eq!(
            handshake::decode_reply(body, PROTOCOL_VERSION + 1).unwrap(),
            reply
        );
    }

    let requests = [
        EchoRequest::Say("héllo".into()),
        EchoRequest::Blob(vec![7; 70_000]),
        EchoRequest::Fail(RemoteErrorKind::NotFound),
    ];
    for (id, request) in (1u64..).zip(requests) {
        left.send_with(|out| rpc::encode_request::<Echo>(id, &request, out))
            .await
            .unwrap();
        let (got_id, got) = rpc::decode_request::<Echo>(right.recv(WAIT).await.unwrap()).unwrap();
        assert_eq!((got_id, got.unwrap()), (id, request));
    }

    let responses = [
        Ok(EchoResponse::Said("x".into())),
        Ok(EchoResponse::BlobLen(3)),
        Err(RemoteError::new(RemoteErrorKind::BadRequest, "b")),
        Err(RemoteError::new(RemoteErrorKind::NotFound, "n")),
        Err(RemoteError::new(RemoteErrorKind::Unavailable, "u")),
        Err(RemoteError::new(RemoteErrorKind::Internal, "i")),
    ];
    for (id, response) in (100u64..).zip(responses) {
        right
            .send_with(|out| rpc::encode_response::<Echo>(id, &response, out))
            .await
            .unwrap();
        let decoded = rpc::decode_response::<Echo>(left.recv(WAIT).await.unwrap()).unwrap();
        assert_eq!(decoded, (id, response));
    }
}

#[tokio::test]
async fn frames_are_big_endian_length_prefixed() {
    let (a, mut raw) = tokio::io::duplex(1024);
    let mut framed = FramedStream::new(a, 1024, WAIT, WAIT);
    framed
        .send_with(|out| {
            out.extend_from_slice(b"abc");
            Ok(())
        })
        .await
        .unwrap();
    let mut bytes = [0u8; 7];
    raw.read_exact(&mut bytes).await.unwrap();
    assert_eq!(bytes, [0, 0, 0, 3, b'a', b'b', b'c']);
}

#[tokio::test]
async fn an_oversize_frame_is_refused_on_both_ends() {
    let (mut left, _right) = pipe(1024);
    let error = left
        .send_with(|out| {
            out.resize(out.len() + 1025, 0);
            Ok(())
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            WireError::FrameTooLarge {
                len: 1025,
                max: 1024
            }
        ),
        "{error}"
    );

    // A peer that announces 4 GiB gets an immediate error: no body is ever sent, so waiting
    // for it (or allocating it) would show up as a timeout here.
    let error = recv_error(&u32::MAX.to_be_bytes(), ThenThePeer::FallsSilent, WAIT).await;
    assert!(
        matches!(error, WireError::FrameTooLarge { len, max: 1024 } if len == u64::from(u32::MAX)),
        "{error}"
    );
}

/// What the peer does after sending its bytes.
enum ThenThePeer {
    Closes,
    FallsSilent,
}

/// The error a reader with a 1 KiB frame limit and the given read timeout reports for a peer
/// that sent `bytes`.
async fn recv_error(bytes: &[u8], then: ThenThePeer, read_timeout: Duration) -> WireError {
    let (a, mut raw) = tokio::io::duplex(1024);
    raw.write_all(bytes).await.unwrap();
    let _kept_open = match then {
        ThenThePeer::Closes => {
            drop(raw);
            None
        }
        ThenThePeer::FallsSilent => Some(raw),
    };
    let mut framed = FramedStream::new(a, 1024, read_timeout, read_timeout);
    framed.recv(WAIT).await.unwrap_err()
}

#[tokio::test]
async fn truncated_frames_and_stalls_are_errors() {
    let mut header_and_half_a_body = 100u32.to_be_bytes().to_vec();
    header_and_half_a_body.extend_from_slice(&[1; 50]);
    let error = recv_error(&header_and_half_a_body, ThenThePeer::Closes, WAIT).await;
    assert!(
        matches!(error, WireError::Truncated { expected: 100 }),
        "{error}"
    );

    let error = recv_error(&[0, 0], ThenThePeer::Closes, WAIT).await;
    assert!(
        matches!(error, WireError::Truncated { expected: 4 }),
        "half a header: {error}"
    );

    let short = Duration::from_millis(50);
    let error = recv_error(&10u32.to_be_bytes(), ThenThePeer::FallsSilent, short).await;
    assert!(
        matches!(error, WireError::Timeout { .. }),
        "a header, then silence: {error}"
    );

    let error = recv_error(&[], ThenThePeer::Closes, WAIT).await;
    assert!(
        matches!(error, WireError::Closed),
        "a clean close between frames: {error}"
    );
}

#[tokio::test]
async fn calls_and_remote_errors() {
    let server = start_server(wire_config(TOKEN)).await;
    let mut client = connect(&server, TOKEN).await.unwrap();
    assert_eq!(
        client.call(&EchoRequest::Say("a".into())).await.unwrap(),
        EchoResponse::Said("Member says a".into())
    );
    let error = client
        .call(&EchoRequest::Fail(RemoteErrorKind::Unavailable))
        .await
        .unwrap_err();
    match error {
        WireError::Remote(remote) => {
            assert_eq!(remote.kind, RemoteErrorKind::Unavailable);
            assert_eq!(remote.message, "asked to fail");
        }
        other => panic!("expected a remote error, got {other}"),
    }
    // A remote error leaves the connection usable.
    assert_eq!(
        client
            .call(&EchoRequest::Blob(vec![1; 5000]))
            .await
            .unwrap(),
        EchoResponse::BlobLen(5000)
    );
}

#[tokio::test]
async fn a_request_over_the_frame_limit_fails_before_sending() {
    let server = start_server(wire_config(TOKEN)).await;
    let mut client = connect(&server, TOKEN).await.unwrap();
    let error = client
        .call(&EchoRequest::Blob(vec![0; 2 << 20]))
        .await
        .unwrap_err();
    assert!(matches!(error, WireError::FrameTooLarge { .. }), "{error}");
    // The client reconnects for the next call.
    assert_eq!(
        client.call(&EchoRequest::Blob(vec![0; 10])).await.unwrap(),
        EchoResponse::BlobLen(10)
    );
}

#[tokio::test]
async fn wrong_token_is_refused_with_a_reason() {
    let server = start_server(wire_config(TOKEN)).await;
    let result = connect(&server, "not-the-token").await;
    match result {
        Err(WireError::Refused {
            reason: Refusal::Unauthenticated,
            message,
        }) => assert!(message.contains("FLOE_CLUSTER_SECRET"), "{message}"),
        Err(other) => panic!("expected a wrong-token refusal, got {other}"),
        Ok(_) => panic!("a wrong token was accepted"),
    }
    let result = connect(&server, "").await;
    assert!(
        matches!(result, Err(WireError::NoCredential)),
        "a client without a credential does not even try"
    );
    assert_serves(&server).await;
}

#[tokio::test]
async fn a_server_without_a_token_does_not_start() {
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let result = RpcServer::bind::<Echo, _>(addr, Arc::new(EchoHandler), wire_config("")).await;
    assert!(matches!(result, Err(WireError::NoCredential)));
}

/// Opens a raw TCP connection, sends `bytes` as they are, and returns whatever the server
/// answers before closing.
async fn raw_exchange(server: &RpcServer, bytes: &[u8]) -> Vec<u8> {
    let mut socket = TcpStream::connect(server.local_addr()).await.unwrap();
    // The server may close before reading everything; that is an answer too.
    let _ = socket.write_all(bytes).await;
    let _ = socket.shutdown().await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(WAIT * 2, socket.read_to_end(&mut answer)).await;
    answer
}

fn parse_reply(answer: &[u8]) -> HandshakeReply {
    let len = u32::from_be_bytes(answer[..4].try_into().unwrap()) as usize;
    assert_eq!(answer.len(), 4 + len, "exactly one reply frame, then close");
    handshake::decode_reply(&answer[4..], 99).unwrap()
}

#[tokio::test]
async fn a_version_mismatch_is_refused_with_both_versions() {
    let server = start_server(wire_config(TOKEN)).await;
    let mut body = Vec::new();
    let hello = Hello {
        credential: Credential::Member {
            secret: ClusterSecret::new(TOKEN),
        },
    };
    handshake::encode_hello(99, &hello, &mut body).unwrap();
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    match parse_reply(&raw_exchange(&server, &frame).await) {
        HandshakeReply::Refused {
            reason: Refusal::VersionMismatch { server, client },
            message,
        } => {
            assert_eq!((server, client), (PROTOCOL_VERSION, 99));
            assert!(message.contains("speaks 99"), "{message}");
        }
        other => panic!("expected a version refusal, got {other:?}"),
    }
    assert_serves(&server).await;
}

#[tokio::test]
async fn garbage_and_oversize_handshakes_are_refused_and_the_server_keeps_serving() {
    let server = start_server(wire_config(TOKEN)).await;

    // HTTP on the RPC port: the first four bytes read as a ~1.2 GB length.
    let answer = raw_exchange(&server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(
        matches!(parse_reply(&answer), HandshakeReply::Refused { reason: Refusal::Malformed, ref message } if message.contains("exceeds")),
        "{answer:?}"
    );

    // A small frame that is not a hello.
    let answer = raw_exchange(&server, &[0, 0, 0, 3, 1, 2, 3]).await;
    assert!(matches!(
        parse_reply(&answer),
        HandshakeReply::Refused {
            reason: Refusal::Malformed,
            ..
        }
    ));

    // A hello of the right version whose body is garbage.
    let mut body = MAGIC.to_vec();
    body.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    body.extend_from_slice(&[0xff; 16]);
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    assert!(matches!(
        parse_reply(&raw_exchange(&server, &frame).await),
        HandshakeReply::Refused {
            reason: Refusal::Malformed,
            ..
        }
    ));

    // Just over the pre-authentication limit.
    let header = ((HANDSHAKE_MAX_FRAME + 1) as u32).to_be_bytes();
    assert!(matches!(
        parse_reply(&raw_exchange(&server, &header).await),
        HandshakeReply::Refused {
            reason: Refusal::Malformed,
            ..
        }
    ));

    // A truncated hello: the server gives up on it without a reply.
    assert!(raw_exchange(&server, &[0, 0, 0, 50, b'F']).await.is_empty());

    assert_serves(&server).await;
}

#[tokio::test]
async fn a_malformed_request_gets_bad_request_and_the_connection_survives() {
    let server = start_server(wire_config(TOKEN)).await;
    let socket = TcpStream::connect(server.local_addr()).await.unwrap();
    let mut stream = FramedStream::new(socket, 1 << 20, WAIT, WAIT);
    let hello = Hello {
        credential: Credential::Member {
            secret: ClusterSecret::new(TOKEN),
        },
    };
    handshake::client_handshake(&mut stream, &hello, WAIT)
        .await
        .unwrap();

    stream
        .send_with(|out| {
            out.extend_from_slice(&7u64.to_be_bytes());
            out.extend_from_slice(&[0xee; 9]);
            Ok(())
        })
        .await
        .unwrap();
    let (id, reply) = rpc::decode_response::<Echo>(stream.recv(WAIT).await.unwrap()).unwrap();
    assert_eq!(id, 7);
    let error = reply.unwrap_err();
    assert_eq!(error.kind, RemoteErrorKind::BadRequest);
    assert!(
        error.message.contains("cannot decode the request"),
        "{}",
        error.message
    );

    stream
        .send_with(|out| rpc::encode_request::<Echo>(8, &EchoRequest::Say("ok".into()), out))
        .await
        .unwrap();
    let (id, reply) = rpc::decode_response::<Echo>(stream.recv(WAIT).await.unwrap()).unwrap();
    assert_eq!(
        (id, reply),
        (8, Ok(EchoResponse::Said("Member says ok".into())))
    );
}

#[tokio::test]
async fn an_idle_connection_closed_by_the_server_is_replaced_transparently() {
    let mut config = wire_config(TOKEN);
    config.timeouts.idle_ms = 100;
    let server = start_server(config).await;
    let mut client = connect(&server, TOKEN).await.unwrap();
    client.call(&EchoRequest::Say("one".into())).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        client.call(&EchoRequest::Say("two".into())).await.unwrap(),
        EchoResponse::Said("Member says two".into())
    );
}

#[tokio::test]
async fn shutting_down_closes_connections() {
    let server = start_server(wire_config(TOKEN)).await;
    let mut client = connect(&server, TOKEN).await.unwrap();
    server.shutdown();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let error = client
        .call(&EchoRequest::Say("x".into()))
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            WireError::Connect { .. } | WireError::Closed | WireError::Io { .. }
        ),
        "{error}"
    );
}

#[test]
fn codec_rejects_trailing_bytes_and_lies_about_lengths() {
    let mut bytes = codec::encode(&EchoRequest::Say("abc".into())).unwrap();
    bytes.push(0);
    assert!(codec::decode::<EchoRequest>(&bytes, "request").is_err());
    // A Vec claiming 2^60 elements in a 20-byte message fails instead of reserving memory.
    let mut lying = vec![1u8];
    lying.push(0xff);
    lying.extend_from_slice(&(1u64 << 60).to_le_bytes());
    lying.extend_from_slice(&[0; 10]);
    assert!(codec::decode::<EchoRequest>(&lying, "request").is_err());
}

#[tokio::test]
async fn attachments_arrive_in_the_callers_memory_and_mismatches_are_errors() {
    let server = start_server(wire_config(TOKEN)).await;
    let mut client = connect(&server, TOKEN).await.unwrap();

    // Larger than a socket buffer, so the attachment arrives in several reads.
    let mut dest = vec![0u8; 700_000];
    let reply = client
        .call_into(
            &EchoRequest::Repeat {
                byte: 7,
                len: 700_000,
            },
            &mut dest,
        )
        .await
        .unwrap();
    assert_eq!(reply, EchoResponse::Repeated);
    assert!(dest.iter().all(|byte| *byte == 7));

    // A length other than the caller's is refused, not written past or short of `dest`.
    let mut short = vec![0u8; 10];
    let error = client
        .call_into(&EchoRequest::Repeat { byte: 1, len: 11 }, &mut short)
        .await
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("expected 10 attached bytes, got 11"),
        "{error}"
    );
    assert_eq!(short, [0; 10]);

    // A remote error is still a remote error; a success without attachment is refused.
    let error = client
        .call_into(&EchoRequest::Fail(RemoteErrorKind::NotFound), &mut short)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, WireError::Remote(remote) if remote.kind == RemoteErrorKind::NotFound),
        "{error}"
    );
    let error = client
        .call_into(&EchoRequest::Say("hi".into()), &mut short)
        .await
        .unwrap_err();
    assert!(error.to_string().contains("has none"), "{error}");

    // `call` does not misread an attached response as a plain one.
    let error = client
        .call(&EchoRequest::Repeat { byte: 1, len: 4 })
        .await
        .unwrap_err();
    assert!(error.to_string().contains("call_into"), "{error}");

    // After all that, the client still works (it reconnected where a call broke the stream).
    let mut four = [0u8; 4];
    client
        .call_into(&EchoRequest::Repeat { byte: 9, len: 4 }, &mut four)
        .await
        .unwrap();
    assert_eq!(four, [9; 4]);
    assert_eq!(
        client
            .call(&EchoRequest::Say("again".into()))
            .await
            .unwrap(),
        EchoResponse::Said("Member says again".into())
    );
}

/// An attachment that only holds something (a node's loan) sends a plain response, and lives
/// as a sent one does: until the connection's next request, or its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holding_attachment_sends_nothing_and_lives_until_the_next_request() {
    let server = start_server(wire_config(TOKEN)).await;
    let mut client = connect(&server, TOKEN).await.unwrap();
    assert_eq!(
        client.call(&EchoRequest::Hold).await.unwrap(),
        EchoResponse::Repeated
    );
    assert_eq!(HELD_DROPPED.load(Ordering::SeqCst), 0);
    client.call(&EchoRequest::Say("next".into())).await.unwrap();
    assert_eq!(HELD_DROPPED.load(Ordering::SeqCst), 1);

    client.call(&EchoRequest::Hold).await.unwrap();
    drop(client);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while HELD_DROPPED.load(Ordering::SeqCst) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the held value outlived its connection"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_attachments_go_by_sendfile_and_live_until_the_client_has_read_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("chunk");
    let content: Vec<u8> = (0..1_500_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&path, &content).unwrap();
    let server = start_server(wire_config(TOKEN)).await;
    let mut client = connect(&server, TOKEN).await.unwrap();
    let from_file = |offset: u64, len: usize| EchoRequest::FromFile {
        path: path.clone(),
        offset,
        len,
    };

    // The file's bytes arrive, not the attachment's zeros: the server sent the file.
    let mut dest = vec![0u8; 1_000_000];
    client
        .call_into(&from_file(300_000, 1_000_000), &mut dest)
        .await
        .unwrap();
    assert!(dest == content[300_000..1_300_000], "not the file's bytes");

    // The kernel may still read the file's pages after sendfile returns, so the server keeps
    // the attachment until the connection's next request shows the reply was read.
    assert_eq!(FILE_ATTACHMENTS_DROPPED.load(Ordering::SeqCst), 0);
    client.call(&EchoRequest::Say("next".into())).await.unwrap();
    assert_eq!(FILE_ATTACHMENTS_DROPPED.load(Ordering::SeqCst), 1);

    // Or until the connection ends.
    let mut small = vec![0u8; 10];
    client
        .call_into(&from_file(5, 10), &mut small)
        .await
        .unwrap();
    assert_eq!(small, content[5..15]);
    drop(client);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while FILE_ATTACHMENTS_DROPPED.load(Ordering::SeqCst) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the attachment outlived its connection"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // A file that ends before the attachment does breaks the call instead of hanging it.
    let mut client = connect(&server, TOKEN).await.unwrap();
    let mut past_the_end = vec![0u8; 200_000];
    let error = client
        .call_into(&from_file(1_400_000, 200_000), &mut past_the_end)
        .await
        .unwrap_err();
    assert!(
        matches!(error, WireError::Truncated { .. } | WireError::Io { .. }),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attachment_of_several_parts_arrives_in_order_across_the_callers_buffers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("part");
    let content: Vec<u8> = (0..400_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&path, &content).unwrap();
    let server = start_server(wire_config(TOKEN)).await;
    let mut client = connect(&server, TOKEN).await.unwrap();
    let request = EchoRequest::Parts {
        repeats: vec![(1, 300_000), (2, 5), (3, 200_000)],
        path,
        offset: 100,
        len: 300_000,
    };
    let mut expected = vec![1u8; 300_000];
    expected.extend([2; 5]);
    expected.extend([3; 200_000]);
    expected.extend(&content[100..300_100]);
    // Buffers that cut across the parts: the attachment is one byte stream.
    let mut whole = vec![0u8; expected.len()];
    let (first, rest) = whole.split_at_mut(100_000);
    let (second, third) = rest.split_at_mut(250_007);
    client
        .call_into_parts(&request, &mut [first, second, third])
        .await
        .unwrap();
    assert!(whole == expected, "the parts did not arrive in order");
    // The lengths must add up.
    let mut short = vec![0u8; expected.len() - 1];
    let error = client.call_into(&request, &mut short).await.unwrap_err();
    assert!(error.to_string().contains("attached bytes"), "{error}");
}
