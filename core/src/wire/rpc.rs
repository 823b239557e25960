//! A typed request/response layer over framed connections.
//!
//! A [`Protocol`] names a request and a response type; [`RpcServer`] serves a [`Handler`] for
//! it, and [`RpcClient`] calls it. A request frame is an 8-byte big-endian request id followed
//! by the encoded request; a response frame repeats the id and carries
//! `Result<Response, RemoteError>`. Because the id sits outside the codec, a request body that
//! does not decode is answered with a `BadRequest` error and the connection stays usable.
//!
//! A response may carry an [`Attachment`]: bytes sent from where they lie after the encoded
//! response, so a large payload (an object's chunk) is neither copied into the frame buffer
//! on the way out nor out of it on the way in ([`RpcClient::call_into`] reads it straight
//! into the caller's memory). Such a frame sets the id's top bit and puts the encoded
//! response's length (u32 big-endian) between the id and the response. An attachment whose
//! bytes also lie in a file ([`FileRange`]) goes out with `sendfile(2)`: the kernel sends the
//! file's pages without a copy through user space. Because the kernel still reads those pages
//! after the call returns, the server keeps the attachment (and whatever pin it holds) until
//! the connection's next request shows the client has read the whole reply, or until the
//! connection ends.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

use super::handshake::{self, HANDSHAKE_MAX_FRAME, Hello};
use super::tls::{self, Connection};
use super::{FramedStream, WireConfig, WireError, codec, within};
use crate::auth::Principal;

/// One RPC service's message types.
pub trait Protocol: Send + Sync + 'static {
    /// Names the service in logs.
    const NAME: &'static str;
    type Request: Serialize + DeserializeOwned + Send + Sync + 'static;
    type Response: Serialize + DeserializeOwned + Send + Sync + 'static;
}

/// An error the remote handler chose to return; the connection is still healthy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct RemoteError {
    pub kind: RemoteErrorKind,
    pub message: String,
}

impl RemoteError {
    pub fn new(kind: RemoteErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RemoteErrorKind {
    /// The request could not be decoded or is not valid; sending it again will not help.
    BadRequest,
    NotFound,
    /// The server cannot serve it now (e.g. not the leader); another attempt may succeed.
    Unavailable,
    /// The caller is authenticated but lacks the right to this request.
    Forbidden,
    Internal,
}

impl std::fmt::Display for RemoteErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RemoteErrorKind::BadRequest => "bad request",
            RemoteErrorKind::NotFound => "not found",
            RemoteErrorKind::Unavailable => "unavailable",
            RemoteErrorKind::Forbidden => "forbidden",
            RemoteErrorKind::Internal => "internal error",
        })
    }
}

/// Who sent a request: the address, and who the handshake verified the peer to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub addr: SocketAddr,
    pub principal: Principal,
    /// Whether the peer presented a TLS client certificate that chains to the cluster's CA,
    /// as cluster members do (user clients have none; plaintext connections never do).
    pub member_certificate: bool,
}

/// Serves one [`Protocol`]. Handlers run concurrently, one task per connection.
pub trait Handler<P: Protocol>: Send + Sync + 'static {
    fn handle(
        &self,
        peer: Peer,
        request: P::Request,
    ) -> impl Future<Output = Result<P::Response, RemoteError>> + Send;

    /// Like [`Handler::handle`], for protocols where some responses carry an [`Attachment`];
    /// the server always calls this one.
    fn handle_attached(
        &self,
        peer: Peer,
        request: P::Request,
    ) -> impl Future<Output = AttachedReply<P::Response>> + Send {
        async move { (self.handle(peer, request).await, None) }
    }
}

/// Bytes sent after a response without being copied into the frame buffer: usually pinned
/// views of some memory, kept alive until the client has read them. It may have several
/// parts (ranges of several objects), sent one after the other. Or, made with
/// [`Attachment::holding`], no bytes at all: only something kept alive (pins of memory the
/// client reads by other means) until the client's next request, with a plain response.
pub struct Attachment {
    parts: Vec<AttachedPart>,
    held: Option<Box<dyn Send>>,
}

struct AttachedPart {
    bytes: Box<dyn AsRef<[u8]> + Send>,
    file: Option<FileRange>,
}

/// Where an attachment's bytes also lie in a file, so a TCP connection can send them with
/// `sendfile(2)`.
#[derive(Debug, Clone)]
pub struct FileRange {
    pub file: Arc<std::fs::File>,
    /// The offset of the attachment's first byte in `file`.
    pub offset: u64,
}

impl Attachment {
    pub fn new(bytes: impl AsRef<[u8]> + Send + 'static) -> Self {
        Self {
            parts: vec![AttachedPart {
                bytes: Box::new(bytes),
                file: None,
            }],
            held: None,
        }
    }

    /// Sends nothing after a plain response, and keeps `keep` until the connection's next
    /// request or its end, as a sent attachment's bytes are kept.
    pub fn holding(keep: impl Send + 'static) -> Self {
        Self {
            parts: Vec::new(),
            held: Some(Box::new(keep)),
        }
    }

    /// Whether this attachment only holds something and sends no frame of its own.
    fn only_holds(&self) -> bool {
        self.parts.is_empty() && self.held.is_some()
    }

    /// Says that the last part's bytes are also `range` of a file. The caller promises that
    /// those file bytes equal the part's and stay unchanged while it lives.
    pub fn in_file(mut self, range: FileRange) -> Self {
        if let Some(last) = self.parts.last_mut() {
            last.file = Some(range);
        }
        self
    }

    /// This attachment followed by `next`'s parts.
    pub fn then(mut self, next: Attachment) -> Self {
        self.parts.extend(next.parts);
        self.held = match (self.held, next.held) {
            (Some(first), Some(second)) => Some(Box::new((first, second))),
            (first, second) => first.or(second),
        };
        self
    }

    /// The parts' bytes, in order.
    pub fn parts(&self) -> impl Iterator<Item = &[u8]> {
        self.parts.iter().map(|part| (*part.bytes).as_ref())
    }

    /// Bytes in all parts.
    pub fn len(&self) -> usize {
        self.parts().map(<[u8]>::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for Attachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Attachment({} bytes in {} parts)",
            self.len(),
            self.parts.len()
        )
    }
}

/// A response and, for the requests that have one, its attachment.
pub type AttachedReply<R> = (Result<R, RemoteError>, Option<Attachment>);

const ID_LEN: usize = 8;
/// Set in a response's id when an attachment follows the response.
const ATTACHED: u64 = 1 << 63;
const ATTACHED_HEAD_LEN: usize = ID_LEN + 4;

pub fn encode_request<P: Protocol>(
    id: u64,
    request: &P::Request,
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    out.extend_from_slice(&id.to_be_bytes());
    codec::encode_into(request, out)
}

/// Splits a request frame into its id and the decoded request; only a frame too short to
/// hold an id is an error of the whole frame.
pub fn decode_request<P: Protocol>(
    body: &[u8],
) -> Result<(u64, Result<P::Request, WireError>), WireError> {
    let (id, rest) = split_id(body, "request")?;
    Ok((id, codec::decode(rest, "request")))
}

pub fn encode_response<P: Protocol>(
    id: u64,
    response: &Result<P::Response, RemoteError>,
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    out.extend_from_slice(&id.to_be_bytes());
    codec::encode_into(response, out)
}

fn encode_attached_response<P: Protocol>(
    id: u64,
    response: &Result<P::Response, RemoteError>,
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    out.extend_from_slice(&(id | ATTACHED).to_be_bytes());
    let len_at = out.len();
    out.extend_from_slice(&[0; 4]);
    codec::encode_into(response, out)?;
    let encoded_len = out.len() - len_at - 4;
    let encoded_len = u32::try_from(encoded_len).map_err(|_| WireError::FrameTooLarge {
        len: encoded_len as u64,
        max: u64::from(u32::MAX),
    })?;
    out[len_at..len_at + 4].copy_from_slice(&encoded_len.to_be_bytes());
    Ok(())
}

pub fn decode_response<P: Protocol>(
    body: &[u8],
) -> Result<(u64, Result<P::Response, RemoteError>), WireError> {
    let (id, rest) = split_id(body, "response")?;
    Ok((id, codec::decode(rest, "response")?))
}

fn split_id<'a>(body: &'a [u8], what: &'static str) -> Result<(u64, &'a [u8]), WireError> {
    body.split_first_chunk::<ID_LEN>()
        .map(|(id, rest)| (u64::from_be_bytes(*id), rest))
        .ok_or(WireError::Decode {
            what,
            message: format!("{} bytes is too short to hold a request id", body.len()),
        })
}

/// A connection to one server of protocol `P`. Calls are sequential; a connection broken by
/// an I/O error, a timeout or a framing error is dropped and the next call reconnects.
pub struct RpcClient<P: Protocol> {
    addr: String,
    config: WireConfig,
    /// The connection, and the version of the identity it was opened with: a connection
    /// opened before the identity changed (a node that registered) is opened again.
    stream: Option<(u64, FramedStream<Connection>)>,
    next_id: u64,
    _protocol: std::marker::PhantomData<P>,
}

impl<P: Protocol> RpcClient<P> {
    /// Connects and handshakes now, so a wrong address or credential shows up here.
    pub async fn connect(addr: impl Into<String>, config: WireConfig) -> Result<Self, WireError> {
        let addr = addr.into();
        let stream = open(&addr, &config).await?;
        Ok(Self {
            addr,
            config,
            stream: Some(stream),
            next_id: 1,
            _protocol: std::marker::PhantomData,
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    async fn usable_stream(&mut self) -> Result<(u64, FramedStream<Connection>), WireError> {
        match self.stream.take() {
            Some((version, stream))
                if !stream.peer_has_closed() && version == self.config.identity.version() =>
            {
                Ok((version, stream))
            }
            _ => open(&self.addr, &self.config).await,
        }
    }

    pub async fn call(&mut self, request: &P::Request) -> Result<P::Response, WireError> {
        let (version, mut stream) = self.usable_stream().await?;
        let id = self.next_id;
        self.next_id += 1;
        let reply = exchange::<P, _>(&mut stream, id, request, &self.config).await?;
        self.stream = Some((version, stream));
        reply.map_err(WireError::Remote)
    }

    /// Calls a request whose successful response carries an attachment of exactly
    /// `dest.len()` bytes, read straight into `dest`. A successful response without one, or
    /// with one of another length, is an error and drops the connection.
    pub async fn call_into(
        &mut self,
        request: &P::Request,
        dest: &mut [u8],
    ) -> Result<P::Response, WireError> {
        self.call_into_parts(request, &mut [dest]).await
    }

    /// Like [`Self::call_into`], reading the attachment into `dests` one after the other: it
    /// must be exactly as long as they are together.
    pub async fn call_into_parts(
        &mut self,
        request: &P::Request,
        dests: &mut [&mut [u8]],
    ) -> Result<P::Response, WireError> {
        let (version, mut stream) = self.usable_stream().await?;
        let id = self.next_id;
        self.next_id += 1;
        stream
            .send_with(|out| encode_request::<P>(id, request, out))
            .await?;
        let reply = receive_attached::<P, _>(&mut stream, id, dests, &self.config).await?;
        self.stream = Some((version, stream));
        reply.map_err(WireError::Remote)
    }
}

async fn receive_attached<P: Protocol, S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut FramedStream<S>,
    id: u64,
    dests: &mut [&mut [u8]],
    config: &WireConfig,
) -> Result<Result<P::Response, RemoteError>, WireError> {
    let expected: usize = dests.iter().map(|dest| dest.len()).sum();
    let malformed = |message: String| WireError::Decode {
        what: "response",
        message,
    };
    let len = stream.recv_len(config.timeouts.read()).await?;
    if len < ID_LEN {
        return Err(malformed(format!(
            "{len} bytes is too short to hold a request id"
        )));
    }
    let (reply_id, _) = split_id(stream.recv_part(ID_LEN).await?, "response")?;
    if reply_id & ATTACHED == 0 {
        check_id(id, reply_id)?;
        let reply = codec::decode::<Result<P::Response, RemoteError>>(
            stream.recv_part(len - ID_LEN).await?,
            "response",
        )?;
        return match reply {
            Ok(_) => Err(malformed(format!(
                "expected {expected} attached bytes, the response has none"
            ))),
            Err(error) => Ok(Err(error)),
        };
    }
    check_id(id, reply_id & !ATTACHED)?;
    if len < ATTACHED_HEAD_LEN {
        return Err(malformed(format!(
            "{len} bytes is too short for an attached response"
        )));
    }
    let head = stream.recv_part(ATTACHED_HEAD_LEN - ID_LEN).await?;
    let mut encoded_len = [0u8; 4];
    encoded_len.copy_from_slice(head);
    let encoded_len = u32::from_be_bytes(encoded_len) as usize;
    let attached = (len - ATTACHED_HEAD_LEN)
        .checked_sub(encoded_len)
        .ok_or_else(|| {
            malformed(format!(
                "a {encoded_len}-byte response in a {len}-byte frame"
            ))
        })?;
    if attached != expected {
        return Err(malformed(format!(
            "expected {expected} attached bytes, got {attached}"
        )));
    }
    let reply = codec::decode(stream.recv_part(encoded_len).await?, "response")?;
    for dest in dests.iter_mut() {
        stream.recv_part_into(dest).await?;
    }
    Ok(reply)
}

fn check_id(expected: u64, got: u64) -> Result<(), WireError> {
    if expected == got {
        Ok(())
    } else {
        Err(WireError::IdMismatch { expected, got })
    }
}

async fn open(
    addr: &str,
    config: &WireConfig,
) -> Result<(u64, FramedStream<Connection>), WireError> {
    let (version, credential) = config.identity.current();
    if credential.is_empty() {
        return Err(WireError::NoCredential);
    }
    let connect_timeout = config.timeouts.connect();
    let socket = within(connect_timeout, "connecting", TcpStream::connect(addr))
        .await?
        .map_err(|source| WireError::Connect {
            addr: addr.to_owned(),
            source,
        })?;
    // Requests are small and latency-bound; never wait to coalesce them.
    socket.set_nodelay(true).map_err(|source| WireError::Io {
        op: "configuring the socket",
        source,
    })?;
    let connection = tls::connect(socket, addr, &config.tls, config.timeouts.handshake()).await?;
    let mut stream = FramedStream::new(
        connection,
        config.max_frame,
        config.timeouts.read(),
        config.timeouts.write(),
    );
    let hello = Hello { credential };
    handshake::client_handshake(&mut stream, &hello, config.timeouts.handshake()).await?;
    Ok((version, stream))
}

async fn exchange<P: Protocol, S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut FramedStream<S>,
    id: u64,
    request: &P::Request,
    config: &WireConfig,
) -> Result<Result<P::Response, RemoteError>, WireError> {
    stream
        .send_with(|out| encode_request::<P>(id, request, out))
        .await?;
    let body = stream.recv(config.timeouts.read()).await?;
    if split_id(body, "response")?.0 & ATTACHED != 0 {
        return Err(WireError::Decode {
            what: "response",
            message: "the response carries an attachment: call it with `call_into`".into(),
        });
    }
    let (reply_id, reply) = decode_response::<P>(body)?;
    check_id(id, reply_id)?;
    Ok(reply)
}

/// A running server; dropping it (or calling [`RpcServer::shutdown`]) stops accepting and
/// closes every connection.
pub struct RpcServer {
    local_addr: SocketAddr,
    accept_loop: JoinHandle<()>,
}

impl RpcServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving `handler`.
    pub async fn bind<P: Protocol, H: Handler<P>>(
        addr: SocketAddr,
        handler: Arc<H>,
        config: WireConfig,
    ) -> Result<Self, WireError> {
        if config.authenticator.cluster_secret().is_empty() {
            return Err(WireError::NoCredential);
        }
        tls::check_bind(addr, &config.tls)?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| WireError::Bind { addr, source })?;
        let local_addr = listener.local_addr().map_err(|source| WireError::Io {
            op: "reading the bound address",
            source,
        })?;
        tracing::info!(protocol = P::NAME, %local_addr, "rpc server listening");
        let accept_loop = tokio::spawn(accept_loop::<P, H>(listener, handler, config));
        Ok(Self {
            local_addr,
            accept_loop,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn shutdown(self) {
        drop(self);
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

async fn accept_loop<P: Protocol, H: Handler<P>>(
    listener: TcpListener,
    handler: Arc<H>,
    config: WireConfig,
) {
    // Owning the connection tasks here means aborting this loop aborts them all.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((socket, addr)) => {
                    connections.spawn(serve_connection::<P, H>(socket, addr, handler.clone(), config.clone()));
                }
                Err(error) => {
                    // Usually descriptor exhaustion: back off instead of spinning.
                    tracing::warn!(protocol = P::NAME, %error, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn serve_connection<P: Protocol, H: Handler<P>>(
    socket: TcpStream,
    addr: SocketAddr,
    handler: Arc<H>,
    config: WireConfig,
) {
    if let Err(error) = socket.set_nodelay(true) {
        tracing::debug!(%addr, %error, "cannot set TCP_NODELAY");
    }
    let accepted = match tls::accept(socket, &config.tls, &config.timeouts).await {
        Ok(accepted) => accepted,
        Err(error) => {
            tracing::warn!(protocol = P::NAME, %addr, %error, "connection refused");
            return;
        }
    };
    let mut stream = FramedStream::new(
        accepted.connection,
        HANDSHAKE_MAX_FRAME,
        config.timeouts.read(),
        config.timeouts.write(),
    );
    let principal = match handshake::server_handshake(
        &mut stream,
        &config.authenticator,
        accepted.certificate,
        config.timeouts.handshake(),
    )
    .await
    {
        Ok(principal) => principal,
        Err(error) => {
            tracing::warn!(protocol = P::NAME, %addr, %error, "connection refused");
            return;
        }
    };
    stream.set_max_frame(config.max_frame);
    let peer = Peer {
        addr,
        principal,
        member_certificate: accepted.certificate == tls::ClientCertificate::Member,
    };
    // The last reply's attachment, kept until the client has read it (see the module docs).
    let mut unread: Option<Attachment> = None;
    loop {
        let received = stream.recv(config.timeouts.idle()).await;
        drop(unread.take());
        let (id, request) = match received {
            Ok(body) => match decode_request::<P>(body) {
                Ok(decoded) => decoded,
                Err(error) => {
                    tracing::warn!(protocol = P::NAME, %addr, %error, "closing connection");
                    return;
                }
            },
            Err(WireError::Closed) => return,
            Err(error) => {
                tracing::warn!(protocol = P::NAME, %addr, %error, "closing connection");
                return;
            }
        };
        let (reply, attachment) = match request {
            Ok(request) => handler.handle_attached(peer.clone(), request).await,
            Err(error) => (
                Err(RemoteError::new(
                    RemoteErrorKind::BadRequest,
                    error.to_string(),
                )),
                None,
            ),
        };
        let sent = match attachment
            .as_ref()
            .filter(|attachment| !attachment.only_holds())
        {
            None => {
                stream
                    .send_with(|out| encode_response::<P>(id, &reply, out))
                    .await
            }
            Some(attachment) => {
                let parts: Vec<(&[u8], Option<&FileRange>)> = attachment
                    .parts
                    .iter()
                    .map(|part| ((*part.bytes).as_ref(), part.file.as_ref()))
                    .collect();
                stream
                    .send_with_attachment(
                        |out| encode_attached_response::<P>(id, &reply, out),
                        &parts,
                    )
                    .await
            }
        };
        if let Err(error) = sent {
            tracing::warn!(protocol = P::NAME, %addr, %error, "cannot send a response");
            return;
        }
        unread = attachment;
    }
}
