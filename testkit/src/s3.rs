//! A real S3-compatible server for tests: `s3s-fs` (objects are files under a temporary
//! directory, one directory per bucket) serving HTTP on 127.0.0.1, with SigV4 authentication
//! by a fixed test key pair. It runs on its own runtime in the test process; the cluster's
//! processes reach it over the socket like any S3 endpoint.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use s3s::auth::SimpleAuth;
use s3s::service::S3ServiceBuilder;

/// The access key id the server accepts.
pub const ACCESS_KEY: &str = "floe-test-access-key";
/// The secret key the server accepts; a test checks it appears nowhere it must not.
pub const SECRET_KEY: &str = "floe-test-secret-3f9a1c7e5b2d";

/// A running server; stops when dropped.
pub struct S3Server {
    pub address: SocketAddr,
    root: tempfile::TempDir,
    /// Kept so the server runs until the test drops it.
    _runtime: tokio::runtime::Runtime,
}

impl S3Server {
    /// Starts a server with empty `buckets`.
    pub fn start(buckets: &[&str]) -> Self {
        let root = tempfile::Builder::new()
            .prefix("floe-s3-")
            .tempdir()
            .unwrap();
        for bucket in buckets {
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
            builder.build()
        };
        runtime.spawn(async move {
            let http = ConnBuilder::new(TokioExecutor::new());
            while let Ok((socket, _)) = listener.accept().await {
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
            _runtime: runtime,
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// The environment a client needs to reach the server: the usual AWS variables.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.to_owned()),
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_REGION", "us-east-1".to_owned()),
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

    /// Where object `key` of `bucket` is kept on disk.
    pub fn object_path(&self, bucket: &str, key: &str) -> PathBuf {
        self.root.path().join(bucket).join(key)
    }

    /// The directory holding every bucket.
    pub fn root(&self) -> &Path {
        self.root.path()
    }
}
