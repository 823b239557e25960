//! A plain HTTP/1.1 client over a TCP socket (or rustls, for HTTPS), enough for the REST API
//! and a WebDriver server, so the tests depend on no HTTP client crate.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use floe_core::config::TlsRole;
use floe_core::wire::{TlsContext, TlsError};
use rustls::pki_types::ServerName;

/// A response: the status code and the body as text.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

/// A response whose body is bytes (an Arrow stream), with its content type.
#[derive(Debug)]
pub struct BinaryResponse {
    pub status: u16,
    pub content_type: Option<String>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|error| panic!("not JSON ({error}): {}", self.body))
    }
}

/// The `host:port` of a local cluster's HTTP API (and dashboard).
pub fn http_addr(cluster: &floe_client::LocalCluster) -> String {
    let url = cluster.dashboard_url();
    url.trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .to_owned()
}

/// One request on a fresh connection (`Connection: close`, so the body ends at EOF).
pub fn request(
    method: &str,
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    exchange(connect(addr), method, addr, path, headers, body)
}

fn connect(addr: &str) -> TcpStream {
    let stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    stream
}

/// A GET over HTTPS with `token` as the bearer token (none when empty), verifying the server
/// against the CA certificate in `ca`.
pub fn get_tls(addr: &str, path: &str, token: &str, ca: &Path) -> Result<Response, TlsError> {
    let auth = bearer(token);
    request_tls("GET", addr, path, &auth_header(&auth), b"", ca)
}

/// A JSON POST over HTTPS with `token` as the bearer token, verifying the server against `ca`.
pub fn post_json_tls(
    addr: &str,
    path: &str,
    token: &str,
    body: &serde_json::Value,
    ca: &Path,
) -> Result<Response, TlsError> {
    let auth = bearer(token);
    let mut headers = auth_header(&auth);
    headers.push(("Content-Type", "application/json"));
    request_tls(
        "POST",
        addr,
        path,
        &headers,
        body.to_string().as_bytes(),
        ca,
    )
}

fn request_tls(
    method: &str,
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    ca: &Path,
) -> Result<Response, TlsError> {
    let role = TlsRole::Client { ca };
    let context = TlsContext::load(role)?.expect("a client role loads a context");
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    let name = ServerName::try_from(host.to_owned()).expect("a host name or address");
    let connection =
        rustls::ClientConnection::new(context.client_config(), name).expect("a client connection");
    let stream = rustls::StreamOwned::new(connection, connect(addr));
    Ok(exchange(stream, method, addr, path, headers, body))
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// The `Authorization` header for `auth` (from [`bearer`]), none for an empty token.
fn auth_header(auth: &str) -> Vec<(&'static str, &str)> {
    if auth == "Bearer " {
        Vec::new()
    } else {
        vec![("Authorization", auth)]
    }
}

fn exchange(
    stream: impl Read + Write,
    method: &str,
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    let response = exchange_bytes(stream, method, addr, path, headers, body);
    Response {
        status: response.status,
        body: String::from_utf8_lossy(&response.body).into_owned(),
    }
}

fn exchange_bytes(
    stream: impl Read + Write,
    method: &str,
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> BinaryResponse {
    try_exchange_bytes(stream, method, addr, path, headers, body).unwrap_or_else(|cut| {
        panic!(
            "{method} {path}: the server ended the response before its last chunk \
             ({} bytes of body)",
            cut.body_bytes
        )
    })
}

/// A chunked response the server ended before its last chunk: how a streamed body reports an
/// error it meets after its headers went out.
#[derive(Debug)]
pub struct CutShort {
    pub status: u16,
    pub body_bytes: usize,
}

fn try_exchange_bytes(
    mut stream: impl Read + Write,
    method: &str,
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<BinaryResponse, CutShort> {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body).unwrap();
    // Read by the response's own framing: not every server closes the connection.
    let mut raw = Vec::new();
    let mut buffer = [0u8; 64 * 1024];
    loop {
        let read = match stream.read(&mut buffer) {
            Ok(read) => read,
            // A TLS peer that closes without close_notify; the framing below decides.
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => 0,
            Err(error) => panic!("reading the response: {error}"),
        };
        raw.extend_from_slice(&buffer[..read]);
        if read == 0 || response_complete(&raw) {
            break;
        }
    }
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let body = &raw[end + 4..];
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = if header(&head, "transfer-encoding").is_some_and(|v| v == "chunked") {
        if !response_complete(&raw) {
            return Err(CutShort {
                status,
                body_bytes: body.len(),
            });
        }
        unchunk(body)
    } else {
        body.to_owned()
    };
    Ok(BinaryResponse {
        status,
        content_type: header(&head, "content-type").map(str::to_owned),
        body,
    })
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        key.trim().eq_ignore_ascii_case(name).then(|| value.trim())
    })
}

fn response_complete(raw: &[u8]) -> bool {
    let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&raw[..end]);
    let body = &raw[end + 4..];
    if let Some(length) = header(&head, "content-length") {
        return body.len() >= length.parse::<usize>().unwrap();
    }
    if header(&head, "transfer-encoding").is_some_and(|v| v == "chunked") {
        return body.ends_with(b"0\r\n\r\n");
    }
    false
}

fn unchunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line = body.windows(2).position(|w| w == b"\r\n").unwrap();
        let size = std::str::from_utf8(&body[..line]).unwrap();
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        let rest = &body[line + 2..];
        out.extend_from_slice(&rest[..size]);
        body = &rest[size + 2..];
    }
}

/// A GET with `token` as the bearer token (none when empty).
pub fn get(addr: &str, path: &str, token: &str) -> Response {
    let auth = bearer(token);
    request("GET", addr, path, &auth_header(&auth), b"")
}

/// A GET with `token` as the bearer token whose body is kept as bytes.
pub fn get_bytes(addr: &str, path: &str, token: &str) -> BinaryResponse {
    let auth = bearer(token);
    exchange_bytes(connect(addr), "GET", addr, path, &auth_header(&auth), b"")
}

/// A GET like [`get_bytes`] that reports a response the server cut short instead of failing.
pub fn try_get_bytes(addr: &str, path: &str, token: &str) -> Result<BinaryResponse, CutShort> {
    let auth = bearer(token);
    try_exchange_bytes(connect(addr), "GET", addr, path, &auth_header(&auth), b"")
}

/// A JSON POST with `token` as the bearer token (none when empty).
pub fn post_json(addr: &str, path: &str, token: &str, body: &serde_json::Value) -> Response {
    let auth = bearer(token);
    let mut headers = auth_header(&auth);
    headers.push(("Content-Type", "application/json"));
    request("POST", addr, path, &headers, body.to_string().as_bytes())
}

/// Polls `check` every 100 ms until it returns Some, or panics with `what` after `timeout`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
