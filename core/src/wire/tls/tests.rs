use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::*;
use crate::auth::{ClientToken, ClusterSecret, Scope, Scopes, TokensFile};
use crate::config::{Config, TimeoutsConfig};
use crate::wire::rpc::{AttachedReply, Attachment, FileRange, Handler, Peer, Protocol};
use crate::wire::{Refusal, RemoteError, RpcClient, RpcServer, WireConfig};
/// Every timeout of the tests' connections: a refusal must come well before it.
const TIMEOUT: Duration = Duration::from_secs(3);

struct Probe;

#[derive(Debug, Serialize, Deserialize)]
enum ProbeRequest {
    /// Answers what the server learned of the caller.
    WhoAmI,
    /// Answers with `len` bytes of the file at `path` as an attachment that also names the
    /// file, so a plain connection would send it with `sendfile(2)`.
    FileBytes { path: PathBuf, len: usize },
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum ProbeResponse {
    Caller {
        /// The verified principal, as `Display` shows it.
        principal: String,
        member_certificate: bool,
    },
    Attached,
}

impl Protocol for Probe {
    const NAME: &'static str = "probe";
    type Request = ProbeRequest;
    type Response = ProbeResponse;
}

struct ProbeHandler;

impl Handler<Probe> for ProbeHandler {
    async fn handle(
        &self,
        peer: Peer,
        request: ProbeRequest,
    ) -> Result<ProbeResponse, RemoteError> {
        self.handle_attached(peer, request).await.0
    }

    async fn handle_attached(
        &self,
        peer: Peer,
        request: ProbeRequest,
    ) -> AttachedReply<ProbeResponse> {
        match request {
            ProbeRequest::WhoAmI => (
                Ok(ProbeResponse::Caller {
                    principal: peer.principal.to_string(),
                    member_certificate: peer.member_certificate,
                }),
                None,
            ),
            ProbeRequest::FileBytes { path, len } => {
                let bytes = std::fs::read(&path).expect("the test wrote the file");
                let range = FileRange {
                    file: Arc::new(std::fs::File::open(&path).expect("the test wrote the file")),
                    offset: 0,
                };
                let attachment = Attachment::new(bytes[..len].to_vec()).in_file(range);
                (Ok(ProbeResponse::Attached), Some(attachment))
            }
        }
    }
}

/// Who a test connection claims to be.
#[derive(Debug, Clone, Copy)]
enum As {
    /// A client with a `read` token.
    Client,
    /// A cluster member with the cluster secret.
    Member,
}

/// The secret and a tokens file every test server and client shares, made once per process.
fn credentials() -> &'static Config {
    static CONFIG: std::sync::OnceLock<(tempfile::TempDir, Config)> = std::sync::OnceLock::new();
    &CONFIG
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("a temp dir");
            let mut tokens = TokensFile::default();
            let token: ClientToken = tokens
                .create("probe", Scopes::new([Scope::Read]))
                .expect("a token");
            let file = dir.path().join("tokens");
            tokens.save(&file).expect("save the tokens");
            let mut config = Config::default();
            config.cluster.secret = ClusterSecret::new("tls-test-secret");
            config.auth.tokens_file = file;
            config.client.token = token;
            config.timeouts = TimeoutsConfig {
                connect_ms: 3_000,
                handshake_ms: 3_000,
                read_ms: 3_000,
                write_ms: 3_000,
                idle_ms: 10_000,
            };
            (dir, config)
        })
        .1
}

fn wire_as(tls: &TlsConfig, who: As) -> WireConfig {
    let config = credentials();
    let wire = match who {
        As::Client => WireConfig::client(config),
        As::Member => WireConfig::member(config),
    };
    WireConfig {
        max_frame: 8 << 20,
        ..wire.with_tls(tls)
    }
}

/// A server's settings (servers present the member credential when they call out).
fn wire(tls: &TlsConfig) -> WireConfig {
    wire_as(tls, As::Member)
}

fn client_of(member: &TlsConfig) -> TlsConfig {
    TlsConfig {
        ca: member.ca.clone(),
        ..TlsConfig::default()
    }
}

async fn serve(tls: &TlsConfig) -> RpcServer {
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("an address");
    RpcServer::bind::<Probe, _>(addr, Arc::new(ProbeHandler), wire(tls))
        .await
        .expect("the server starts")
}

async fn connect(
    server: &RpcServer,
    tls: &TlsConfig,
    who: As,
) -> Result<RpcClient<Probe>, WireError> {
    RpcClient::<Probe>::connect(server.local_addr().to_string(), wire_as(tls, who)).await
}

async fn who_am_i(server: &RpcServer, tls: &TlsConfig, who: As) -> ProbeResponse {
    let mut client = connect(server, tls, who).await.expect("connects");
    client.call(&ProbeRequest::WhoAmI).await.expect("answers")
}

#[tokio::test]
async fn a_tls_round_trip_records_whether_the_caller_is_a_member() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let member = generate_throwaway(dir.path(), &[]).expect("certificates");
    let server = serve(&member).await;

    assert_eq!(
        who_am_i(&server, &client_of(&member), As::Client).await,
        ProbeResponse::Caller {
            principal: "token 'probe'".into(),
            member_certificate: false
        },
        "a client with the CA only has no certificate"
    );
    assert_eq!(
        who_am_i(&server, &member, As::Member).await,
        ProbeResponse::Caller {
            principal: "an unregistered member".into(),
            member_certificate: true
        },
        "a member presents its certificate"
    );
}

#[tokio::test]
async fn a_member_secret_without_a_member_certificate_is_refused() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let member = generate_throwaway(dir.path(), &[]).expect("certificates");
    let server = serve(&member).await;
    // Someone who learned the cluster secret but holds no certificate of the CA.
    let error = connect(&server, &client_of(&member), As::Member)
        .await
        .err()
        .expect("the secret alone is refused over TLS");
    assert!(
        matches!(
            error,
            WireError::Refused {
                reason: Refusal::Unauthenticated,
                ..
            }
        ),
        "{error}"
    );
    assert!(
        error.to_string().contains("presented no certificate"),
        "{error}"
    );
}

#[tokio::test]
async fn attachments_that_lie_in_files_travel_inside_tls() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let member = generate_throwaway(dir.path(), &[]).expect("certificates");
    let path = dir.path().join("payload");
    let payload: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&path, &payload).expect("write the payload");
    let server = serve(&member).await;
    let mut client = connect(&server, &client_of(&member), As::Client)
        .await
        .expect("connects");
    let len = 2_500_000;
    let mut dest = vec![0u8; len];
    let reply = client
        .call_into(
            &ProbeRequest::FileBytes {
                path: path.clone(),
                len,
            },
            &mut dest,
        )
        .await
        .expect("answers");
    assert_eq!(reply, ProbeResponse::Attached);
    assert!(dest == payload[..len], "the attachment arrived intact");
    // The connection stays usable after an attachment.
    let again = client.call(&ProbeRequest::WhoAmI).await.expect("answers");
    assert!(matches!(again, ProbeResponse::Caller { .. }));
}

#[tokio::test]
async fn a_plaintext_client_is_told_the_server_requires_tls() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let member = generate_throwaway(dir.path(), &[]).expect("certificates");
    let server = serve(&member).await;
    let started = Instant::now();
    let error = connect(&server, &TlsConfig::default(), As::Client)
        .await
        .err()
        .expect("a plaintext client is refused");
    assert!(
        matches!(
            error,
            WireError::Refused {
                reason: Refusal::TlsRequired,
                ..
            }
        ),
        "{error}"
    );
    assert!(error.to_string().contains("requires TLS"), "{error}");
    assert!(
        started.elapsed() < TIMEOUT,
        "refused at once, not by a timeout"
    );
}

#[tokio::test]
async fn a_client_trusting_another_ca_refuses_the_server() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let member = generate_throwaway(dir.path(), &[]).expect("certificates");
    let other_dir = tempfile::tempdir().expect("a temp dir");
    let other = generate_throwaway(other_dir.path(), &[]).expect("certificates");
    let server = serve(&member).await;
    let started = Instant::now();
    let error = connect(&server, &client_of(&other), As::Client)
        .await
        .err()
        .expect("the server's certificate is not trusted");
    assert!(matches!(error, WireError::Certificate { .. }), "{error}");
    assert!(
        error
            .to_string()
            .contains("invalid peer certificate: UnknownIssuer"),
        "{error}"
    );
    assert!(
        started.elapsed() < TIMEOUT,
        "refused at once, not by a timeout"
    );
}

#[tokio::test]
async fn a_member_certificate_from_another_ca_is_refused() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let member = generate_throwaway(dir.path(), &[]).expect("certificates");
    let other_dir = tempfile::tempdir().expect("a temp dir");
    let other = generate_throwaway(other_dir.path(), &[]).expect("certificates");
    let server = serve(&member).await;
    // Trusts the server, but presents a certificate the server's CA did not sign.
    let impostor = TlsConfig {
        ca: member.ca.clone(),
        ..other
    };
    let started = Instant::now();
    let refused = match connect(&server, &impostor, As::Member).await {
        Err(error) => error,
        // TLS 1.3 lets the client finish first; the server's verdict arrives as an alert.
        Ok(mut client) => client
            .call(&ProbeRequest::WhoAmI)
            .await
            .expect_err("the server refuses the certificate"),
    };
    assert!(
        refused.to_string().contains("UnknownCA") || refused.to_string().contains("alert"),
        "{refused}"
    );
    assert!(
        started.elapsed() < TIMEOUT,
        "refused at once, not by a timeout"
    );
}

#[tokio::test]
async fn a_tls_client_is_told_a_plaintext_server_does_not_speak_tls() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let member = generate_throwaway(dir.path(), &[]).expect("certificates");
    let server = serve(&TlsConfig::default()).await;
    let started = Instant::now();
    let error = connect(&server, &client_of(&member), As::Client)
        .await
        .err()
        .expect("a plaintext server cannot speak TLS");
    assert!(matches!(error, WireError::ServerNotTls { .. }), "{error}");
    assert!(
        started.elapsed() < TIMEOUT,
        "refused at once, not by a timeout"
    );
}

#[tokio::test]
async fn plaintext_is_served_only_on_loopback() {
    let anywhere: SocketAddr = "0.0.0.0:0".parse().expect("an address");
    let refused = RpcServer::bind::<Probe, _>(
        anywhere,
        Arc::new(ProbeHandler),
        wire(&TlsConfig::default()),
    )
    .await
    .err()
    .expect("plaintext off loopback is refused");
    assert!(
        matches!(refused, WireError::PlaintextOffLoopback { .. }),
        "{refused}"
    );

    let dir = tempfile::tempdir().expect("a temp dir");
    let member = generate_throwaway(dir.path(), &[]).expect("certificates");
    let server = RpcServer::bind::<Probe, _>(anywhere, Arc::new(ProbeHandler), wire(&member))
        .await
        .expect("TLS may listen anywhere");
    drop(server);
    let client_only =
        RpcServer::bind::<Probe, _>(anywhere, Arc::new(ProbeHandler), wire(&client_of(&member)))
            .await
            .err()
            .expect("a server needs a certificate of its own");
    assert!(
        matches!(client_only, WireError::PlaintextOffLoopback { .. }),
        "{client_only}"
    );
}

#[test]
fn unusable_files_are_named() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let missing = TlsConfig {
        ca: dir.path().join("missing.pem"),
        ..TlsConfig::default()
    };
    let error =
        TlsContext::load(missing.role().expect("a client role")).expect_err("a missing CA file");
    assert!(error.to_string().contains("tls.ca"), "{error}");
    assert!(error.to_string().contains("missing.pem"), "{error}");

    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "").expect("write");
    let no_certificate = TlsConfig {
        ca: empty,
        ..TlsConfig::default()
    };
    let error = TlsContext::load(no_certificate.role().expect("a client role"))
        .expect_err("an empty CA file");
    assert!(
        matches!(error, TlsError::NoCertificate { key: "ca", .. }),
        "{error}"
    );
}

#[test]
fn the_host_of_an_address_names_the_server() {
    assert_eq!(server_host("127.0.0.1:7700"), "127.0.0.1");
    assert_eq!(server_host("node-3.example:7800"), "node-3.example");
    assert_eq!(server_host("[::1]:7700"), "::1");
}

#[tokio::test]
async fn the_server_certificate_must_name_the_host_dialled() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let member = generate_throwaway(dir.path(), &[]).expect("certificates");
    // 127.0.0.2 is loopback too, but the certificate names only 127.0.0.1 and localhost.
    let elsewhere: SocketAddr = "127.0.0.2:0".parse().expect("an address");
    let server = RpcServer::bind::<Probe, _>(elsewhere, Arc::new(ProbeHandler), wire(&member))
        .await
        .expect("the server starts");
    let error = connect(&server, &client_of(&member), As::Client)
        .await
        .err()
        .expect("the certificate does not name 127.0.0.2");
    assert!(matches!(error, WireError::Certificate { .. }), "{error}");
    assert!(
        error
            .to_string()
            .contains("certificate not valid for name \"127.0.0.2\""),
        "{error}"
    );

    let named_dir = tempfile::tempdir().expect("a temp dir");
    let named =
        generate_throwaway(named_dir.path(), &["127.0.0.2".to_owned()]).expect("certificates");
    let server = RpcServer::bind::<Probe, _>(elsewhere, Arc::new(ProbeHandler), wire(&named))
        .await
        .expect("the server starts");
    assert!(matches!(
        who_am_i(&server, &client_of(&named), As::Client).await,
        ProbeResponse::Caller { .. }
    ));
}
