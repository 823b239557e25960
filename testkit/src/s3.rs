//! A real S3-compatible server for tests: `s3s-fs` (objects are files under a temporary
//! directory, one directory per bucket) serving HTTP on 127.0.0.1, with SigV4 authentication
//! by a fixed test key pair. It runs on its own runtime in the test process; the cluster's
//! processes reach it over the socket like any S3 endpoint.
//!
//! Tests put their input objects through the server's S3 API ([`S3Server::put_file`]), as any
//! writer to a bucket does: `s3s-fs` then keeps each object's ETag beside it. A file dropped
//! straight into a bucket's directory has none, and `s3s-fs` computes it by hashing the whole
//! file on every GET and HEAD of it: about 0.8 s per ranged read of a 287 MB file, which is
//! no S3 server's behaviour and hid everything else the `floe-bench s3` reads cost.

use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use object_store::aws::AmazonS3Builder;
use object_store::{ObjectStoreExt, WriteMultipart};
use s3s::auth::SimpleAuth;
use s3s::service::S3ServiceBuilder;

/// The access key id the server accepts.
pub const ACCESS_KEY: &str = "floe-test-access-key";
/// The secret key the server accepts; a test checks it appears nowhere it must not.
pub const SECRET_KEY: &str = "floe-test-secret-3f9a1c7e5b2d";
/// The region the clients sign for (the server accepts any).
const REGION: &str = "us-east-1";
/// Bytes per part when [`S3Server::put_file`] uploads (S3's minimum part is 5 MiB).
const PART_BYTES: usize = 8 << 20;

/// What a test server serves.
pub struct S3ServerConfig<'a> {
    /// Buckets only signed requests reach.
    pub buckets: &'a [&'a str],
    /// Buckets whose objects anyone may also read unsigned (GET and HEAD of an object, as a
    /// public bucket serves them): what `http://` URLs are tested against. Everything else
    /// on them (listing, writing) still needs a signature.
    pub public_buckets: &'a [&'a str],
}

/// Lets signed requests through (the server's auth has checked their signature) and unsigned
/// object reads of the public buckets; refuses every other unsigned request.
struct PublicReads {
    buckets: Vec<String>,
}

#[async_trait::async_trait]
impl s3s::access::S3Access for PublicReads {
    async fn check(&self, cx: &mut s3s::access::S3AccessContext<'_>) -> s3s::S3Result<()> {
        if cx.credentials().is_some() {
            return Ok(());
        }
        let public_object = cx
            .s3_path()
            .as_object()
            .is_some_and(|(bucket, _)| self.buckets.iter().any(|b| b == bucket));
        let read = matches!(cx.s3_op().name(), "GetObject" | "HeadObject");
        if public_object && read {
            Ok(())
        } else {
            Err(s3s::s3_error!(AccessDenied, "Signature required"))
        }
    }
}

/// A running server; stops when dropped.
pub struct S3Server {
    pub address: SocketAddr,
    root: tempfile::TempDir,
    /// Runs the server until the test drops it, and the uploads of [`Self::put_file`].
    runtime: tokio::runtime::Runtime,
}

impl S3Server {
    /// Starts a server with empty `buckets`, every request signed.
    pub fn start(buckets: &[&str]) -> Self {
        Self::start_with(&S3ServerConfig {
            buckets,
            public_buckets: &[],
        })
    }

    pub fn start_with(config: &S3ServerConfig<'_>) -> Self {
        let root = tempfile::Builder::new()
            .prefix("floe-s3-")
            .tempdir()
            .unwrap();
        for bucket in config.buckets.iter().chain(config.public_buckets) {
            std::fs::create_dir(root.path().join(bucket)).unwrap();
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("test-s3-server")
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let address = listener.local_addr().unwrap();
        let service = {
            let mut builder = S3ServiceBuilder::new(s3s_fs::FileSystem::new(root.path()).unwrap());
            builder.set_auth(SimpleAuth::from_single(ACCESS_KEY, SECRET_KEY));
            builder.set_access(PublicReads {
                buckets: config
                    .public_buckets
                    .iter()
                    .map(|b| (*b).to_owned())
                    .collect(),
            });
            builder.build()
        };
        runtime.spawn(async move {
            let http = ConnBuilder::new(TokioExecutor::new());
            while let Ok((socket, _)) = listener.accept().await {
                // hyper writes a response's head and its body in separate writes. With
                // Nagle's algorithm on, the body waits until the client acknowledges the head,
                // which a client with nothing to send delays by 40 ms: per GET, on loopback.
                // Real S3 endpoints answer without that stall. (A socket that refuses the
                // option still serves, only slower.)
                let _ = socket.set_nodelay(true);
                let connection = http
                    .serve_connection(TokioIo::new(socket), service.clone())
                    .into_owned();
                tokio::spawn(async move {
                    let _ = connection.await;
                });
            }
        });
        Self {
            address,
            root,
            runtime,
        }
    }

    /// `http://127.0.0.1:<port>`; a public bucket's object is `<endpoint>/<bucket>/<key>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// The environment a client needs to reach the server: the usual AWS variables.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.to_owned()),
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_REGION", REGION.to_owned()),
            ("AWS_ALLOW_HTTP", "true".to_owned()),
        ]
    }

    /// Sets [`Self::env`] in this process, so its reads and the processes it starts reach
    /// the server.
    ///
    /// # Safety
    /// As [`std::env::set_var`]: no other thread may read or write the environment meanwhile,
    /// so call it first thing in a test binary's only test.
    pub unsafe fn export_env(&self) {
        for (name, value) in self.env() {
            // SAFETY: the caller promises no other thread touches the environment now.
            unsafe { std::env::set_var(name, value) };
        }
    }

    /// Uploads local file `file` as object `key` of `bucket` through the server's S3 API (a
    /// multipart upload, as large objects are written to any S3), so the server keeps the
    /// object's ETag as S3 does. Replaces what was there; panics when the upload fails.
    pub fn put_file(&self, bucket: &str, key: &str, file: &Path) {
        // The client's TLS is rustls with `ring`, as floe's; installing it twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let store = AmazonS3Builder::new()
            .with_endpoint(self.endpoint())
            .with_bucket_name(bucket)
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .with_region(REGION)
            .with_allow_http(true)
            .build()
            .unwrap();
        let key = object_store::path::Path::from(key);
        let mut source = std::fs::File::open(file).unwrap();
        let (sender, receiver) = std::sync::mpsc::sync_channel(1);
        // On the server's runtime, and waited for here, so a caller inside a runtime of its
        // own does not block one of that runtime's threads on a nested `block_on`.
        self.runtime.spawn(async move {
            let upload = async {
                let mut writer = WriteMultipart::new_with_chunk_size(
                    store.put_multipart(&key).await?,
                    PART_BYTES,
                );
                let mut chunk = vec![0; PART_BYTES];
                loop {
                    let n = source
                        .read(&mut chunk)
                        .map_err(|e| object_store::Error::Generic {
                            store: "test upload",
                            source: Box::new(e),
                        })?;
                    if n == 0 {
                        break;
                    }
                    writer.wait_for_capacity(2).await?;
                    writer.write(&chunk[..n]);
                }
                writer.finish().await
            };
            let _ = sender.send(upload.await);
        });
        receiver.recv().unwrap().unwrap();
    }

    /// Where object `key` of `bucket` is kept on disk: for reading what a job wrote without
    /// any floe code. Tests write objects with [`Self::put_file`], not here (see the module
    /// comment).
    pub fn object_path(&self, bucket: &str, key: &str) -> PathBuf {
        self.root.path().join(bucket).join(key)
    }

    /// The directory holding every bucket.
    pub fn root(&self) -> &Path {
        self.root.path()
    }
}
