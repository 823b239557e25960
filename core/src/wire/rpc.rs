//! A typed request/response layer over framed connections.
//!
//! A [`Protocol`] names a request and a response type; [`RpcServer`] serves a [`Handler`] for
//! it, and [`RpcClient`] calls it. A request frame is an 8-byte big-endian request id followed
//! by the encoded request; a response frame repeats the id and carries
//! `Result<Response, RemoteError>`. Because the id sits outside the codec, a request body that
//! does not decode is answered with a `BadRequest` error and the connection stays usable.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

use super::handshake::{self, HANDSHAKE_MAX_FRAME, Hello, PeerKind};
use super::{FramedStream, WireConfig, WireError, codec};

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
    Internal,
}

impl std::fmt::Display for RemoteErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RemoteErrorKind::BadRequest => "bad request",
            RemoteErrorKind::NotFound => "not found",
            RemoteErrorKind::Unavailable => "unavailable",
            RemoteErrorKind::Internal => "internal error",
        })
    }
}

/// Who sent a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub addr: SocketAddr,
    pub kind: PeerKind,
}

/// Serves one [`Protocol`]. Handlers run concurrently, one task per connection.
pub trait Handler<P: Protocol>: Send + Sync + 'static {
    fn handle(
        &self,
        peer: Peer,
        request: P::Request,
    ) -> impl Future<Output = Result<P::Response, RemoteError>> + Send;
}

const ID_LEN: usize = 8;

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
    peer: PeerKind,
    stream: Option<FramedStream<TcpStream>>,
    next_id: u64,
    _protocol: std::marker::PhantomData<P>,
}

impl<P: Protocol> RpcClient<P> {
    /// Connects and handshakes now, so a wrong address or token shows up here.
    pub async fn connect(
        addr: impl Into<String>,
        config: WireConfig,
        peer: PeerKind,
    ) -> Result<Self, WireError> {
        let addr = addr.into();
        let stream = open(&addr, &config, peer).await?;
        Ok(Self {
            addr,
            config,
            peer,
            stream: Some(stream),
            next_id: 1,
            _protocol: std::marker::PhantomData,
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub async fn call(&mut self, request: &P::Request) -> Result<P::Response, WireError> {
        let mut stream = match self.stream.take() {
            Some(stream) if !stream.peer_has_closed() => stream,
            _ => open(&self.addr, &self.config, self.peer).await?,
        };
        let id = self.next_id;
        self.next_id += 1;
        let reply = exchange::<P, _>(&mut stream, id, request, &self.config).await?;
        self.stream = Some(stream);
        reply.map_err(WireError::Remote)
    }
}

async fn open(
    addr: &str,
    config: &WireConfig,
    peer: PeerKind,
) -> Result<FramedStream<TcpStream>, WireError> {
    let connect_timeout = config.timeouts.connect();
    let socket = tokio::time::timeout(connect_timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| WireError::Timeout {
            op: "connecting",
            after: connect_timeout,
        })?
        .map_err(|source| WireError::Connect {
            addr: addr.to_owned(),
            source,
        })?;
    // Requests are small and latency-bound; never wait to coalesce them.
    socket.set_nodelay(true).map_err(|source| WireError::Io {
        op: "configuring the socket",
        source,
    })?;
    let mut stream = FramedStream::new(
        socket,
        config.max_frame,
        config.timeouts.read(),
        config.timeouts.write(),
    );
    let hello = Hello {
        peer,
        token: config.token.clone(),
    };
    handshake::client_handshake(&mut stream, &hello, config.timeouts.handshake()).await?;
    Ok(stream)
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
    let (reply_id, reply) = decode_response::<P>(body)?;
    if reply_id != id {
        return Err(WireError::IdMismatch {
            expected: id,
            got: reply_id,
        });
    }
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
        if config.token.is_empty() {
            return Err(WireError::EmptyToken);
        }
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
    let mut stream = FramedStream::new(
        socket,
        HANDSHAKE_MAX_FRAME,
        config.timeouts.read(),
        config.timeouts.write(),
    );
    let kind =
        match handshake::server_handshake(&mut stream, &config.token, config.timeouts.handshake())
            .await
        {
            Ok(kind) => kind,
            Err(error) => {
                tracing::warn!(protocol = P::NAME, %addr, %error, "connection refused");
                return;
            }
        };
    stream.set_max_frame(config.max_frame);
    let peer = Peer { addr, kind };
    loop {
        let (id, request) = match stream.recv(config.timeouts.idle()).await {
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
        let reply = match request {
            Ok(request) => handler.handle(peer, request).await,
            Err(error) => Err(RemoteError::new(
                RemoteErrorKind::BadRequest,
                error.to_string(),
            )),
        };
        if let Err(error) = stream
            .send_with(|out| encode_response::<P>(id, &reply, out))
            .await
        {
            tracing::warn!(protocol = P::NAME, %addr, %error, "cannot send a response");
            return;
        }
    }
}
