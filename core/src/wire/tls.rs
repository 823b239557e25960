//! TLS for every connection, with rustls and its `ring` provider (no OpenSSL, no C toolchain
//! beyond what `ring` builds).
//!
//! What `[tls]` sets decides a process's part ([`TlsRole`]): a user's client verifies servers
//! against the CA; a cluster member (replica, node) also serves with its certificate and
//! presents the same certificate as a client certificate when it calls another member.
//! Servers accept peers without a client certificate too (user clients have none) and record
//! in the connection's [`Peer`](super::Peer) whether a certificate chaining to the CA was
//! verified, so a server can require one for what only members may do.
//!
//! A TLS server tells a plaintext peer why it is refused in the floe handshake's own
//! plaintext format, so an old or misconfigured client reads "this server requires TLS"
//! rather than a framing error. TLS 1.3 session tickets are off: a server writes nothing a
//! client did not ask for, which keeps [`Connection::peer_has_closed`]'s probe exact.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::handshake::{HANDSHAKE_MAX_FRAME, HandshakeReply, Refusal, encode_reply};
use super::{FramedStream, WireError, within};
use crate::config::{TlsConfig, TlsRole};

/// The first byte of a TLS record carrying a handshake message (a ClientHello). A floe
/// plaintext hello starts with its frame length's high byte, which the 4 KiB pre-handshake
/// limit keeps at 0.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Why the TLS files cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("invalid setting {key}: {reason}")]
    Incomplete {
        key: &'static str,
        reason: &'static str,
    },
    #[error("tls.{key} = {}: {source}", path.display())]
    Pem {
        key: &'static str,
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("tls.{key} = {}: the file holds no certificate", path.display())]
    NoCertificate { key: &'static str, path: PathBuf },
    #[error("tls.{key} = {}: {source}", path.display())]
    Rejected {
        key: &'static str,
        path: PathBuf,
        source: rustls::Error,
    },
    #[error("tls.ca = {}: cannot verify client certificates with it: {source}", path.display())]
    Verifier {
        path: PathBuf,
        source: rustls::server::VerifierBuilderError,
    },
    #[error("cannot generate a throwaway certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("cannot write {}: {source}", path.display())]
    Write { path: PathBuf, source: io::Error },
}

/// A process's loaded TLS configuration, shared by all its connections.
pub struct TlsContext {
    connector: TlsConnector,
    /// Members only: serves with the member certificate, verifying optional client
    /// certificates against the CA.
    acceptor: Option<TlsAcceptor>,
    /// Members only: the same certificate for HTTPS, without client certificates (browsers).
    http: Option<Arc<ServerConfig>>,
}

impl std::fmt::Debug for TlsContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsContext")
            .field("serves", &self.acceptor.is_some())
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl TlsContext {
    /// Reads and checks the files `role` names; `None` for plaintext.
    pub fn load(role: TlsRole<'_>) -> Result<Option<Self>, TlsError> {
        let (ca, member) = match role {
            TlsRole::Plaintext => return Ok(None),
            TlsRole::Client { ca } => (ca, None),
            TlsRole::Member { ca, cert, key } => (ca, Some((cert, key))),
        };
        let roots = Arc::new(read_roots(ca)?);
        let rejected = |key: &'static str, path: &Path| {
            let path = path.to_owned();
            move |source| TlsError::Rejected { key, path, source }
        };
        let client = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(rejected("ca", ca))?
            .with_root_certificates(Arc::clone(&roots));
        let Some((cert, key)) = member else {
            let client = client.with_no_client_auth();
            return Ok(Some(Self {
                connector: TlsConnector::from(Arc::new(client)),
                acceptor: None,
                http: None,
            }));
        };
        let chain = read_chain(cert)?;
        let private_key = PrivateKeyDer::from_pem_file(key).map_err(|source| TlsError::Pem {
            key: "key",
            path: key.to_owned(),
            source,
        })?;
        let client = client
            .with_client_auth_cert(chain.clone(), private_key.clone_key())
            .map_err(rejected("key", key))?;
        let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
            .allow_unauthenticated()
            .build()
            .map_err(|source| TlsError::Verifier {
                path: ca.to_owned(),
                source,
            })?;
        let mut server = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(rejected("cert", cert))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), private_key.clone_key())
            .map_err(rejected("key", key))?;
        server.send_tls13_tickets = 0;
        let http = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(rejected("cert", cert))?
            .with_no_client_auth()
            .with_single_cert(chain, private_key)
            .map_err(rejected("key", key))?;
        Ok(Some(Self {
            connector: TlsConnector::from(Arc::new(client)),
            acceptor: Some(TlsAcceptor::from(Arc::new(server))),
            http: Some(Arc::new(http)),
        }))
    }

    /// The HTTPS server configuration of a member; `None` for a client-only context.
    pub fn http_server(&self) -> Option<ServerConfig> {
        self.http.as_deref().cloned()
    }

    /// The client side, for callers outside the RPC layer (tests' HTTPS clients).
    pub fn client_config(&self) -> Arc<ClientConfig> {
        Arc::clone(self.connector.config())
    }
}

fn read_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in read_chain_of("ca", path)? {
        roots.add(cert).map_err(|source| TlsError::Rejected {
            key: "ca",
            path: path.to_owned(),
            source,
        })?;
    }
    Ok(roots)
}

fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    read_chain_of("cert", path)
}

fn read_chain_of(key: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |source| TlsError::Pem {
        key,
        path: path.to_owned(),
        source,
    };
    let chain = CertificateDer::pem_file_iter(path)
        .map_err(pem)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem)?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            key,
            path: path.to_owned(),
        });
    }
    Ok(chain)
}

/// The TLS side of a [`WireConfig`](super::WireConfig): loaded once when the configuration is
/// read, so every connection of a process shares one context. A file that cannot be used
/// fails the first bind or connect (and a service's preflight, before that).
#[derive(Debug, Clone)]
pub enum WireTls {
    Plaintext,
    Tls(Arc<TlsContext>),
    Unusable(Arc<TlsError>),
}

impl WireTls {
    pub fn from_config(config: &TlsConfig) -> Self {
        match config.role().and_then(TlsContext::load) {
            Ok(Some(context)) => WireTls::Tls(Arc::new(context)),
            Ok(None) => WireTls::Plaintext,
            Err(error) => WireTls::Unusable(Arc::new(error)),
        }
    }

    /// The loaded context, `None` for plaintext.
    pub fn context(&self) -> Result<Option<&Arc<TlsContext>>, WireError> {
        match self {
            WireTls::Plaintext => Ok(None),
            WireTls::Tls(context) => Ok(Some(context)),
            WireTls::Unusable(error) => Err(WireError::Tls(Arc::clone(error))),
        }
    }
}

/// A connection's byte stream: a TCP socket, plain or inside TLS.
#[derive(Debug)]
pub enum Connection {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

impl Connection {
    fn socket(&self) -> &TcpStream {
        match self {
            Connection::Plain(socket) => socket,
            Connection::Tls(stream) => stream.get_ref().0,
        }
    }

    /// True when the peer has closed (or reset) a connection we are not reading from, or sent
    /// bytes nobody asked for. Checked without blocking before reusing a connection.
    pub fn peer_has_closed(&self) -> bool {
        let mut probe = [0u8; 1];
        let socket = self.socket();
        // A peek leaves TLS records where rustls will read them.
        // SAFETY: the descriptor is open for the call (borrowed through `socket`), and the
        // buffer is one valid, writable byte.
        let peeked = unsafe {
            libc::recv(
                socket.as_raw_fd(),
                probe.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if peeked < 0 {
            io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock
        } else {
            // 0: the peer closed; more: the stream is out of step (or a TLS alert).
            true
        }
    }
}

macro_rules! delegate {
    ($self:ident, $stream:ident => $call:expr) => {
        match $self.get_mut() {
            Connection::Plain($stream) => {
                let $stream = Pin::new($stream);
                $call
            }
            Connection::Tls($stream) => {
                let $stream = Pin::new(&mut **$stream);
                $call
            }
        }
    };
}

impl AsyncRead for Connection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        delegate!(self, stream => stream.poll_read(cx, buf))
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, stream => stream.poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, stream => stream.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, stream => stream.poll_shutdown(cx))
    }
}

/// Wraps a freshly connected socket in TLS when `tls` is set, verifying the server as `addr`'s
/// host names it.
pub async fn connect(
    socket: TcpStream,
    addr: &str,
    tls: &WireTls,
    timeout: Duration,
) -> Result<Connection, WireError> {
    let Some(context) = tls.context()? else {
        return Ok(Connection::Plain(socket));
    };
    let host = server_host(addr);
    let name = ServerName::try_from(host.to_owned()).map_err(|_| WireError::TlsHandshake {
        addr: addr.to_owned(),
        source: io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{host:?} is neither a DNS name nor an IP address"),
        ),
    })?;
    let stream = within(
        timeout,
        "the TLS handshake",
        context.connector.connect(name, socket),
    )
    .await?
    .map_err(|source| client_handshake_error(addr, source))?;
    Ok(Connection::Tls(Box::new(stream.into())))
}

/// The host part of `host:port` or `[v6]:port`.
fn server_host(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    host.strip_prefix('[')
        .and_then(|host| host.strip_suffix(']'))
        .unwrap_or(host)
}

fn client_handshake_error(addr: &str, source: io::Error) -> WireError {
    let addr = addr.to_owned();
    match source
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::InvalidMessage(_)) => WireError::ServerNotTls { addr },
        Some(error @ (rustls::Error::InvalidCertificate(_) | rustls::Error::AlertReceived(_))) => {
            WireError::Certificate {
                addr,
                source: error.clone(),
            }
        }
        _ => WireError::TlsHandshake { addr, source },
    }
}

/// What the transport proved about a peer before its handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientCertificate {
    /// A plaintext connection (served on loopback only): nothing to prove.
    Plaintext,
    /// TLS with a client certificate that chains to the cluster's CA, as members present.
    Member,
    /// TLS without a client certificate, as user clients connect.
    Absent,
}

/// An accepted connection and what its peer proved with a certificate.
pub struct Accepted {
    pub connection: Connection,
    pub certificate: ClientCertificate,
}

/// The server side of a new connection: TLS when `tls` is set, where a peer that starts in
/// plaintext is told (in plaintext) that TLS is required and refused.
pub async fn accept(
    socket: TcpStream,
    tls: &WireTls,
    timeouts: &crate::config::TimeoutsConfig,
) -> Result<Accepted, WireError> {
    let acceptor = match tls.context()? {
        Some(context) => context.acceptor.as_ref(),
        None => None,
    };
    let Some(acceptor) = acceptor else {
        return Ok(Accepted {
            connection: Connection::Plain(socket),
            certificate: ClientCertificate::Plaintext,
        });
    };
    let timeout = timeouts.handshake();
    let mut first = [0u8; 1];
    let peeked = within(timeout, "the handshake", socket.peek(&mut first))
        .await?
        .map_err(|source| WireError::Io {
            op: "receiving a frame",
            source,
        })?;
    if peeked == 0 {
        return Err(WireError::Closed);
    }
    if first[0] != TLS_HANDSHAKE_RECORD {
        return Err(refuse_plaintext(socket, timeouts).await);
    }
    let stream = within(timeout, "the TLS handshake", acceptor.accept(socket))
        .await?
        .map_err(|source| WireError::Io {
            op: "the TLS handshake",
            source,
        })?;
    // The verifier accepts only certificates chaining to the CA, so any certificate is one.
    let certificate = match stream.get_ref().1.peer_certificates() {
        Some(_) => ClientCertificate::Member,
        None => ClientCertificate::Absent,
    };
    Ok(Accepted {
        connection: Connection::Tls(Box::new(stream.into())),
        certificate,
    })
}

/// Reads a plaintext peer's hello and answers that this server requires TLS.
async fn refuse_plaintext(
    socket: TcpStream,
    timeouts: &crate::config::TimeoutsConfig,
) -> WireError {
    let message = "this server requires TLS: set tls.ca (FLOE_TLS_CA) to the cluster's CA \
                   certificate"
        .to_owned();
    let mut stream = FramedStream::new(
        Connection::Plain(socket),
        HANDSHAKE_MAX_FRAME,
        timeouts.read(),
        timeouts.write(),
    );
    let reply = HandshakeReply::Refused {
        reason: Refusal::TlsRequired,
        message: message.clone(),
    };
    let answer = async {
        // Whatever the peer sent, it is not a TLS client; the reply is best effort.
        let _ = stream.recv(timeouts.handshake()).await;
        let _ = stream
            .send_with(|out| {
                encode_reply(&reply, out);
                Ok(())
            })
            .await;
    };
    let _ = within(timeouts.handshake(), "the handshake", answer).await;
    WireError::Refused {
        reason: Refusal::TlsRequired,
        message,
    }
}

/// Refuses to serve plaintext on a non-loopback address.
pub fn check_bind(addr: SocketAddr, tls: &WireTls) -> Result<(), WireError> {
    let serves_tls = matches!(tls.context()?, Some(context) if context.acceptor.is_some());
    if serves_tls || addr.ip().is_loopback() {
        Ok(())
    } else {
        Err(WireError::PlaintextOffLoopback { addr })
    }
}

/// Files of a throwaway CA's member certificate, as [`generate_throwaway`] wrote them.
pub const THROWAWAY_CA_FILE: &str = "ca.pem";
const THROWAWAY_CERT_FILE: &str = "member.pem";
const THROWAWAY_KEY_FILE: &str = "member-key.pem";

/// Writes a throwaway CA certificate and one member certificate and key signed by it into
/// `dir`, and returns the `[tls]` settings of a member. The certificate names `localhost`,
/// `127.0.0.1`, `::1` and `hosts`. The CA's key is never written: once this returns, nothing
/// can sign another certificate this cluster trusts.
pub fn generate_throwaway(dir: &Path, hosts: &[String]) -> Result<TlsConfig, TlsError> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
        KeyUsagePurpose,
    };
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // A name of its own, so certificates of two throwaway CAs are told apart by issuer.
    let tag = getrandom::u64().unwrap_or_else(|_| u64::from(std::process::id()));
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("floe throwaway CA {tag:016x}"));
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate()?;
    let ca = ca_params.self_signed(&ca_key)?;

    let mut names = vec![
        "localhost".to_owned(),
        "127.0.0.1".to_owned(),
        "::1".to_owned(),
    ];
    names.extend(hosts.iter().cloned());
    let mut params = CertificateParams::new(names)?;
    params
        .distinguished_name
        .push(DnType::CommonName, "floe member");
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &ca, &ca_key)?;

    let config = TlsConfig {
        ca: dir.join(THROWAWAY_CA_FILE),
        cert: dir.join(THROWAWAY_CERT_FILE),
        key: dir.join(THROWAWAY_KEY_FILE),
    };
    write_file(&config.ca, ca.pem().as_bytes(), 0o644)?;
    write_file(&config.cert, cert.pem().as_bytes(), 0o644)?;
    write_file(&config.key, key.serialize_pem().as_bytes(), 0o600)?;
    Ok(config)
}

fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let write = || -> io::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(path)?;
        file.write_all(bytes)?;
        file.sync_all()
    };
    write().map_err(|source| TlsError::Write {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests;
