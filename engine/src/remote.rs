//! Object storage (`s3://`, `gs://`, `az://`, `http(s)://`) through the `object_store` crate:
//! listing and globs, ranged reads, multipart uploads, copies and deletes.
//!
//! Credentials and endpoints come from the process's environment, as each cloud's tools
//! read them (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
//! `AWS_REGION`, `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`, `GOOGLE_SERVICE_ACCOUNT`,
//! `AZURE_STORAGE_ACCOUNT_NAME`, …), overridden by the `[storage]` section of floe's
//! configuration, which the process hands to [`configure`] once it has loaded it. A URL that
//! carries a user or password is refused, so secrets never travel in a plan, a stamp or a job
//! record.
//!
//! `object_store` is async; the kernels are not. Every call here runs on one private runtime
//! and the calling thread waits for it, so callers stay plain functions whether they run in a
//! worker, a test or inside the driver's own runtime.

use std::collections::HashMap;
use std::future::Future;
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::{Buf, Bytes};
use floe_core::config::StorageConfig;
use floe_core::fingerprint::FileStamp;
use futures::TryStreamExt;
use object_store::path::Path as Key;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt, WriteMultipart};
use parquet::file::reader::{ChunkReader, Length};

use crate::{Error, Result};

/// Bytes per part of a multipart upload (S3's minimum part is 5 MiB).
const UPLOAD_PART_BYTES: usize = 8 << 20;
/// Parts of one upload in flight at once.
const UPLOAD_CONCURRENCY: usize = 4;
/// How much of a Parquet file's tail the first footer read fetches; most footers fit.
const FOOTER_GUESS_BYTES: u64 = 64 << 10;
/// Threads of the runtime object-storage calls run on; they wait on the network, not the CPU.
const RUNTIME_THREADS: usize = 2;

/// One object (or prefix) in a store: the store, the URL up to the bucket, and the key.
#[derive(Clone)]
pub struct Object {
    store: Arc<dyn ObjectStore>,
    /// `scheme://bucket` (or `scheme://host:port` for HTTP), without a trailing `/`.
    base: String,
    key: Key,
}

impl std::fmt::Debug for Object {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url())
    }
}

impl Object {
    /// The object `path` names, or `None` when it is a local path.
    pub fn of(path: &Path) -> Result<Option<Self>> {
        match floe_core::location::remote_url(path) {
            Some(url) => Self::parse(url).map(Some),
            None => Ok(None),
        }
    }

    /// The object-storage prefix `path` names as a sink's directory, or `None` when it is a
    /// local path. `http(s)://` is refused: plain HTTP has no multipart upload, and publishing
    /// needs listing, copies and deletes, which only WebDAV servers add; floe reads HTTP(S)
    /// and writes to `s3://`, `gs://` and `az://`.
    pub fn sink_of(path: &Path) -> Result<Option<Self>> {
        let object = Self::of(path)?;
        if let Some(object) = &object
            && matches!(object.base.split_once("://"), Some(("http" | "https", _)))
        {
            return Err(Error::Remote {
                url: object.url(),
                message: "http(s):// is read-only: write to s3://, gs:// or az://".to_owned(),
            });
        }
        Ok(object)
    }

    fn parse(text: &str) -> Result<Self> {
        let refuse = |message: &str| Error::Remote {
            url: text.to_owned(),
            message: message.to_owned(),
        };
        let url = url::Url::parse(text).map_err(|e| refuse(&e.to_string()))?;
        if !url.username().is_empty() || url.password().is_some() {
            // Never echo the URL back: it holds the secret.
            return Err(Error::Remote {
                url: format!("{}://…", url.scheme()),
                message: "credentials in a URL are refused; set them in the environment".to_owned(),
            });
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(refuse("a URL with a query or fragment is refused"));
        }
        let host = url
            .host_str()
            .ok_or_else(|| refuse("the URL names no bucket"))?;
        let base = match url.port() {
            Some(port) => format!("{}://{host}:{port}", url.scheme()),
            None => format!("{}://{host}", url.scheme()),
        };
        let key = Key::from_url_path(url.path()).map_err(|e| refuse(&e.to_string()))?;
        Ok(Self {
            store: store(url.scheme(), &base)?,
            base,
            key,
        })
    }

    pub fn url(&self) -> String {
        url_of(&self.base, &self.key)
    }

    /// The object `name` below this one (`name` may hold `/`).
    pub fn join(&self, name: &str) -> Self {
        let key = name
            .split('/')
            .fold(self.key.clone(), |key, part| key.join(part));
        Self {
            store: self.store.clone(),
            base: self.base.clone(),
            key,
        }
    }

    fn run<T: Send + 'static, F>(&self, future: F) -> Result<T>
    where
        F: Future<Output = object_store::Result<T>> + Send + 'static,
    {
        block(&self.url(), future)
    }

    /// The object's stamp (size, time, ETag), or `None` when there is no such object.
    pub fn stamp(&self) -> Result<Option<FileStamp>> {
        let (store, key) = (self.store.clone(), self.key.clone());
        match self.run(async move { store.head(&key).await }) {
            Ok(meta) => Ok(Some(stamp(&self.base, &meta))),
            Err(Error::RemoteStore { source, .. })
                if matches!(*source, object_store::Error::NotFound { .. }) =>
            {
                Ok(None)
            }
            Err(error) => Err(error),
        }
    }

    /// Every visible object below this prefix (recursively), sorted by key; names with a
    /// segment starting with `.` or `_` are skipped, as local directories' are.
    pub fn list_below(&self) -> Result<Vec<FileStamp>> {
        let (store, prefix) = (self.store.clone(), self.key.clone());
        let listed = self.run(async move {
            let prefix = (!prefix.as_ref().is_empty()).then_some(prefix);
            store.list(prefix.as_ref()).try_collect::<Vec<_>>().await
        })?;
        let visible = listed
            .into_iter()
            .filter(|meta| {
                relative(&self.key, &meta.location)
                    .split('/')
                    .all(|segment| !hidden(segment))
            })
            .collect();
        let mut stamps: Vec<FileStamp> = self
            .with_etags(visible)?
            .iter()
            .map(|meta| stamp(&self.base, meta))
            .collect();
        stamps.sort();
        Ok(stamps)
    }

    /// The objects directly in this prefix whose names match `pattern` (`*`, `?`).
    fn list_matching(&self, pattern: &str) -> Result<Vec<FileStamp>> {
        let (store, prefix) = (self.store.clone(), self.key.clone());
        let listed = self.run(async move {
            let prefix = (!prefix.as_ref().is_empty()).then_some(prefix);
            store.list_with_delimiter(prefix.as_ref()).await
        })?;
        let matching = listed
            .objects
            .into_iter()
            .filter(|meta| {
                let name = meta.location.filename().unwrap_or_default();
                !hidden(name) && crate::read::wildcard_match(pattern, name)
            })
            .collect();
        let mut stamps: Vec<FileStamp> = self
            .with_etags(matching)?
            .iter()
            .map(|meta| stamp(&self.base, meta))
            .collect();
        stamps.sort();
        Ok(stamps)
    }

    /// `listed` with each object's ETag: a listing that lacks one (some S3-compatible servers
    /// leave it out) is completed by a HEAD, so a stamp always pins the object's content.
    fn with_etags(&self, listed: Vec<ObjectMeta>) -> Result<Vec<ObjectMeta>> {
        if listed
            .iter()
            .all(|meta| meta.e_tag.is_some() || meta.version.is_some())
        {
            return Ok(listed);
        }
        let store = self.store.clone();
        self.run(async move {
            let mut completed = Vec::with_capacity(listed.len());
            for meta in listed {
                if meta.e_tag.is_none() && meta.version.is_none() {
                    completed.push(store.head(&meta.location).await?);
                } else {
                    completed.push(meta);
                }
            }
            Ok(completed)
        })
    }

    /// The whole object.
    pub fn get(&self) -> Result<Bytes> {
        let (store, key) = (self.store.clone(), self.key.clone());
        self.run(async move { store.get(&key).await?.bytes().await })
    }

    /// Bytes `range` of the object.
    pub fn get_range(&self, range: Range<u64>) -> Result<Bytes> {
        let (store, key) = (self.store.clone(), self.key.clone());
        self.run(async move { store.get_range(&key, range).await })
    }

    /// Starts fetching the byte ranges `ranges` of the object (concurrently) and returns at
    /// once; [`Pending::wait`] gives them. `fetched` counts their bytes as they arrive, also
    /// when nobody waits for them any more.
    pub fn start_get_ranges(
        &self,
        ranges: Vec<Range<u64>>,
        fetched: Arc<AtomicU64>,
    ) -> Result<Pending<Vec<Bytes>>> {
        let (store, key) = (self.store.clone(), self.key.clone());
        start(&self.url(), async move {
            let bytes = store.get_ranges(&key, &ranges).await?;
            fetched.fetch_add(
                bytes.iter().map(|b| b.len() as u64).sum(),
                Ordering::Relaxed,
            );
            Ok(bytes)
        })
    }

    /// Uploads local file `file` as this object with a multipart upload: the object appears
    /// whole when the upload completes, or not at all.
    pub fn upload(&self, file: &Path) -> Result<()> {
        let (store, key, file) = (self.store.clone(), self.key.clone(), file.to_owned());
        self.run(async move {
            let unreadable = |error: std::io::Error| object_store::Error::Generic {
                store: "upload",
                source: Box::new(error),
            };
            // Disk reads are quick next to the network; the runtime's threads may take them.
            let mut source = std::fs::File::open(&file).map_err(unreadable)?;
            let mut writer = WriteMultipart::new_with_chunk_size(
                store.put_multipart(&key).await?,
                UPLOAD_PART_BYTES,
            );
            let mut chunk = vec![0; UPLOAD_PART_BYTES];
            loop {
                let n = source.read(&mut chunk).map_err(unreadable)?;
                if n == 0 {
                    break;
                }
                writer.wait_for_capacity(UPLOAD_CONCURRENCY).await?;
                writer.write(&chunk[..n]);
            }
            writer.finish().await.map(|_| ())
        })
    }

    /// Copies this object to `to` (same store), replacing what is there.
    pub fn copy_to(&self, to: &Object) -> Result<()> {
        let (store, from, to) = (self.store.clone(), self.key.clone(), to.key.clone());
        self.run(async move { store.copy(&from, &to).await })
    }

    pub fn delete(&self) -> Result<()> {
        let (store, key) = (self.store.clone(), self.key.clone());
        self.run(async move { store.delete(&key).await })
    }

    /// Deletes every object below this prefix, hidden ones included.
    pub fn delete_below(&self) -> Result<()> {
        let (store, prefix) = (self.store.clone(), self.key.clone());
        self.run(async move {
            let listed = store.list(Some(&prefix)).try_collect::<Vec<_>>().await?;
            for meta in listed {
                store.delete(&meta.location).await?;
            }
            Ok(())
        })
    }

    /// The name of `stamp`'s object relative to this prefix.
    pub fn relative_name(&self, stamp: &FileStamp) -> Result<String> {
        let object = Object::parse(&stamp.path.to_string_lossy())?;
        Ok(relative(&self.key, &object.key).to_owned())
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from(self.url())
    }

    /// The object's file name (its last key segment).
    pub fn name(&self) -> &str {
        self.key.filename().unwrap_or_default()
    }

    /// The prefix this object is in.
    pub fn parent(&self) -> Self {
        let mut parts: Vec<_> = self.key.parts().collect();
        parts.pop();
        Self {
            store: self.store.clone(),
            base: self.base.clone(),
            key: Key::from_iter(parts),
        }
    }
}

/// Expands a remote path, directory-like prefix or glob (in its last segment) into stamps.
pub fn expand(url: &str) -> Result<Vec<FileStamp>> {
    let object = Object::parse(url)?;
    let name = object.name().to_owned();
    let stamps = if name.contains(['*', '?']) {
        object.parent().list_matching(&name)?
    } else if object.key.as_ref().is_empty() || url.ends_with('/') {
        object.list_below()?
    } else {
        match object.stamp() {
            Ok(Some(stamp)) => vec![stamp],
            Ok(None) => object.list_below()?,
            // Some S3-compatible servers answer a HEAD of a "directory" with an error other
            // than 404; it is one only if nothing is below it.
            Err(error) => match object.list_below()? {
                below if below.is_empty() => return Err(error),
                below => below,
            },
        }
    };
    if stamps.is_empty() {
        return Err(Error::NoFiles(url.to_owned()));
    }
    Ok(stamps)
}

fn relative<'a>(prefix: &Key, key: &'a Key) -> &'a str {
    let key = key.as_ref();
    match prefix.as_ref() {
        "" => key,
        prefix => key
            .strip_prefix(prefix)
            .map_or(key, |rest| rest.trim_start_matches('/')),
    }
}

fn hidden(name: &str) -> bool {
    name.starts_with('.') || name.starts_with('_')
}

fn url_of(base: &str, key: &Key) -> String {
    format!("{base}/{key}")
}

fn stamp(base: &str, meta: &ObjectMeta) -> FileStamp {
    FileStamp {
        path: PathBuf::from(url_of(base, &meta.location)),
        size: meta.size,
        modified_secs: meta.last_modified.timestamp(),
        // Whole seconds: a listing gives milliseconds, a HEAD's Last-Modified only seconds,
        // and both must stamp the object alike. The ETag tells rewrites apart.
        modified_nanos: 0,
        // Listings carry the ETag but not the version id, and a stamp from a listing must
        // equal one from a HEAD of the same object.
        version: meta.e_tag.clone().or_else(|| meta.version.clone()),
    }
}

/// The stores built so far, by `scheme://bucket`.
type Stores = Mutex<HashMap<String, Arc<dyn ObjectStore>>>;

fn stores() -> &'static Stores {
    static STORES: OnceLock<Stores> = OnceLock::new();
    STORES.get_or_init(Mutex::default)
}

/// The `[storage]` settings stores are built with, over the environment's.
fn settings() -> &'static Mutex<StorageConfig> {
    static SETTINGS: OnceLock<Mutex<StorageConfig>> = OnceLock::new();
    SETTINGS.get_or_init(Mutex::default)
}

/// Builds every store from now on with `storage` over the environment's settings (the stores
/// built before are dropped). A process calls it once, when it has loaded its configuration.
pub fn configure(storage: &StorageConfig) {
    *settings()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = storage.clone();
    stores()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clear();
}

/// `builder` with every `[storage]` option that `parse` knows (each cloud's builder takes
/// its own keys).
fn with_settings<B, K: std::str::FromStr>(mut builder: B, with: impl Fn(B, K, &str) -> B) -> B {
    let storage = settings()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    for (key, value) in storage.options() {
        if let Ok(key) = key.parse::<K>() {
            builder = with(builder, key, value);
        }
    }
    builder
}

/// The store for `base`, built once per process from the environment and [`configure`]'s
/// settings.
fn store(scheme: &str, base: &str) -> Result<Arc<dyn ObjectStore>> {
    let stores = stores();
    if let Some(store) = stores
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(base)
    {
        return Ok(store.clone());
    }
    // TLS goes through rustls with `ring`; installing it twice is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let failed = |source: object_store::Error| Error::RemoteStore {
        url: base.to_owned(),
        source: Box::new(source),
    };
    let built: Arc<dyn ObjectStore> = match scheme {
        "s3" | "s3a" => Arc::new(
            with_settings(
                object_store::aws::AmazonS3Builder::from_env().with_url(base),
                |builder, key: object_store::aws::AmazonS3ConfigKey, value| {
                    builder.with_config(key, value)
                },
            )
            .build()
            .map_err(failed)?,
        ),
        "gs" => Arc::new(
            with_settings(
                object_store::gcp::GoogleCloudStorageBuilder::from_env().with_url(base),
                |builder, key: object_store::gcp::GoogleConfigKey, value| {
                    builder.with_config(key, value)
                },
            )
            .build()
            .map_err(failed)?,
        ),
        "az" | "azure" | "abfs" | "abfss" | "adl" => Arc::new(
            with_settings(
                object_store::azure::MicrosoftAzureBuilder::from_env().with_url(base),
                |builder, key: object_store::azure::AzureConfigKey, value| {
                    builder.with_config(key, value)
                },
            )
            .build()
            .map_err(failed)?,
        ),
        "http" | "https" => Arc::new(
            object_store::http::HttpBuilder::new()
                .with_url(base)
                .with_client_options(
                    object_store::ClientOptions::new().with_allow_http(scheme == "http"),
                )
                .build()
                .map_err(failed)?,
        ),
        other => {
            return Err(Error::Remote {
                url: base.to_owned(),
                message: format!(
                    "scheme `{other}` is not supported (s3, s3a, gs, az, abfs, abfss, http, https are)"
                ),
            });
        }
    };
    stores
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(base.to_owned(), built.clone());
    Ok(built)
}

fn runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<Option<tokio::runtime::Runtime>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(RUNTIME_THREADS)
                .thread_name("floe-object-store")
                .enable_all()
                .build()
                .ok()
        })
        .as_ref()
        .ok_or_else(|| Error::Remote {
            url: String::new(),
            message: "cannot start the object-storage runtime".to_owned(),
        })
}

/// An object-storage call running on the object-storage runtime. Dropping it does not stop
/// the call: it runs to its end (bounded by the client's timeouts) and its result is dropped.
pub struct Pending<T> {
    url: String,
    receiver: std::sync::mpsc::Receiver<object_store::Result<T>>,
}

impl<T> Pending<T> {
    /// Waits for the call on this thread (which may itself be a runtime's: the call never
    /// runs here, so no runtime is nested).
    pub fn wait(self) -> Result<T> {
        let url = self.url;
        self.receiver
            .recv()
            .map_err(|_| Error::Remote {
                url: url.clone(),
                message: "the object-storage call was dropped".to_owned(),
            })?
            .map_err(|source| Error::RemoteStore {
                url,
                source: Box::new(source),
            })
    }
}

/// Starts `future` on the object-storage runtime.
fn start<T: Send + 'static, F>(url: &str, future: F) -> Result<Pending<T>>
where
    F: Future<Output = object_store::Result<T>> + Send + 'static,
{
    let (sender, receiver) = std::sync::mpsc::sync_channel(1);
    runtime()?.spawn(async move {
        let _ = sender.send(future.await);
    });
    Ok(Pending {
        url: url.to_owned(),
        receiver,
    })
}

/// Runs `future` on the object-storage runtime and waits for it on this thread.
fn block<T: Send + 'static, F>(url: &str, future: F) -> Result<T>
where
    F: Future<Output = object_store::Result<T>> + Send + 'static,
{
    start(url, future)?.wait()
}

/// Byte ranges of one object held in memory, served to the Parquet reader as if they were
/// the file: it asks only for the footer and the column chunks fetched for it.
pub struct FetchedRanges {
    size: u64,
    /// Sorted by start; they do not overlap.
    ranges: Vec<(u64, Bytes)>,
}

impl FetchedRanges {
    pub fn new(size: u64, mut ranges: Vec<(u64, Bytes)>) -> Self {
        ranges.sort_by_key(|(start, _)| *start);
        Self { size, ranges }
    }

    fn slice(&self, start: u64, length: Option<usize>) -> parquet::errors::Result<Bytes> {
        let missing = || {
            parquet::errors::ParquetError::General(format!(
                "bytes {start}.. of a remote file were not fetched"
            ))
        };
        let index = self
            .ranges
            .partition_point(|(begin, _)| *begin <= start)
            .checked_sub(1)
            .ok_or_else(missing)?;
        let (begin, bytes) = &self.ranges[index];
        let offset = usize::try_from(start - begin).map_err(|_| missing())?;
        let end = match length {
            Some(length) => offset.checked_add(length).ok_or_else(missing)?,
            None => bytes.len(),
        };
        if end > bytes.len() {
            return Err(missing());
        }
        Ok(bytes.slice(offset..end))
    }
}

impl Length for FetchedRanges {
    fn len(&self) -> u64 {
        self.size
    }
}

impl ChunkReader for FetchedRanges {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        Ok(self.slice(start, None)?.reader())
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        self.slice(start, Some(length))
    }
}

/// Fetches the footer of Parquet object `object` of `size` bytes: one ranged read of its
/// tail, a second when the metadata is longer than the first guessed. Returns the tail
/// as a reader and the bytes fetched.
pub fn parquet_footer(object: &Object, size: u64) -> Result<(FetchedRanges, u64)> {
    let bad = |message: String| Error::BadFile {
        path: object.path(),
        message,
    };
    if size < 8 {
        return Err(bad(format!("{size} bytes is too short for Parquet")));
    }
    let guess = FOOTER_GUESS_BYTES.min(size);
    let mut tail = object.get_range(size - guess..size)?;
    let mut fetched = tail.len() as u64;
    let footer = tail.len().checked_sub(8).map(|at| &tail[at..]);
    let metadata_len = match footer {
        Some(footer) if &footer[4..] == b"PAR1" => u64::from(u32::from_le_bytes([
            footer[0], footer[1], footer[2], footer[3],
        ])),
        _ => return Err(bad("no Parquet footer (PAR1) at its end".to_owned())),
    };
    let needed = metadata_len + 8;
    if needed > size {
        return Err(bad(format!("its footer claims {needed} bytes of {size}")));
    }
    if needed > guess {
        tail = object.get_range(size - needed..size)?;
        fetched += tail.len() as u64;
    }
    let start = size - tail.len() as u64;
    Ok((FetchedRanges::new(size, vec![(start, tail)]), fetched))
}
