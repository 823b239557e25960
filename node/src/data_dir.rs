//! The node's claim on its data directory, and the clean-up after a predecessor that was
//! killed.
//!
//! A node holds an exclusive `flock` on `<data_dir>/node.lock` for as long as its process
//! lives; the kernel releases it however the process ends, SIGKILL included. So two nodes
//! never share a directory, and a node that gets the lock knows the previous holder is dead.
//! The lock file records what the holder leaves outside its own process when it is killed:
//! its pid, its object store's name (which names its shared-memory segment and its spill and
//! fallback files) and its worker socket. The next node on the directory reads that record,
//! removes those remains, logs what it removed and writes its own record. Once serving, the
//! node adds its RPC address, so `floe cache clean` on the host can ask the live node to
//! clean (the node tells the cache index first).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use floe_objectstore::{ObjectStore, StoreConfig};

use crate::{Error, Result};

const LOCK_FILE: &str = "node.lock";

/// The lock on a node's data directory; released when dropped or when the process dies.
#[derive(Debug)]
pub struct DataDirLock {
    file: File,
    path: std::path::PathBuf,
}

/// What a node records about itself in its lock file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    /// The object store's name: its segment is `/floe-<store>`, its files `<store>-…`.
    pub store: String,
    /// The worker socket's file name in the data directory.
    pub socket: String,
    /// The node's RPC address, once it serves.
    pub rpc: Option<String>,
}

impl Holder {
    fn encode(&self) -> String {
        let rpc = self
            .rpc
            .as_ref()
            .map_or_else(String::new, |rpc| format!("rpc={rpc}\n"));
        format!(
            "pid={}\nstore={}\nsocket={}\n{rpc}",
            self.pid, self.store, self.socket
        )
    }

    /// Reads a record; an empty file (a holder killed before it wrote one) is `None`.
    fn decode(text: &str) -> Result<Option<Self>, String> {
        if text.trim().is_empty() {
            return Ok(None);
        }
        let (mut pid, mut store, mut socket, mut rpc) = (None, None, None, None);
        for line in text.lines().filter(|line| !line.trim().is_empty()) {
            let (key, value) = line
                .split_once('=')
                .ok_or_else(|| format!("line {line:?} is not key=value"))?;
            let slot = match key {
                "pid" => &mut pid,
                "store" => &mut store,
                "socket" => &mut socket,
                "rpc" => &mut rpc,
                other => return Err(format!("unknown key {other:?}")),
            };
            if slot.replace(value.to_owned()).is_some() {
                return Err(format!("{key} appears twice"));
            }
        }
        let missing = |key: &str| format!("no {key}");
        let pid = pid.ok_or_else(|| missing("pid"))?;
        let socket = socket.ok_or_else(|| missing("socket"))?;
        // The socket is removed by name in the data directory: a path could point anywhere.
        if socket.is_empty() || socket.contains('/') || socket == "." || socket == ".." {
            return Err(format!("socket {socket:?} is not a file name"));
        }
        Ok(Some(Self {
            pid: pid
                .parse()
                .map_err(|_| format!("pid {pid:?} is not a process id"))?,
            store: store.ok_or_else(|| missing("store"))?,
            socket,
            rpc,
        }))
    }
}

impl DataDirLock {
    /// Locks `dir` for this node, removes what the previous holder left if it was killed
    /// (its store's segment, spill and fallback files, found under `store`'s directories by
    /// the recorded name, and its worker socket), then records `holder`. Fails at once,
    /// naming the directory and the holder's pid, if a live node holds the lock.
    pub fn claim(dir: &Path, holder: &Holder, store: &StoreConfig) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        let io = |action| io_error(action, &path);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io("open"))?;
        let mut text = String::new();
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                // The holder writes its record right after locking; it may not have yet.
                let _ = file.read_to_string(&mut text);
                let pid = Holder::decode(&text).ok().flatten().map(|held| held.pid);
                return Err(Error::DataDirInUse {
                    dir: dir.to_owned(),
                    pid,
                });
            }
            Err(std::fs::TryLockError::Error(source)) => return Err(io("lock")(source)),
        }
        file.read_to_string(&mut text).map_err(io("read"))?;
        let predecessor = Holder::decode(&text).map_err(|problem| Error::BadLockRecord {
            path: path.clone(),
            problem,
        })?;
        if let Some(predecessor) = predecessor {
            remove_remains(dir, &predecessor, store)?;
        }
        let mut lock = Self { file, path };
        lock.record(holder)?;
        Ok(lock)
    }

    /// Replaces the lock file's record with `holder`.
    pub fn record(&mut self, holder: &Holder) -> Result<()> {
        let io = |action| io_error(action, &self.path);
        let file = &mut self.file;
        file.set_len(0).map_err(io("truncate"))?;
        file.seek(SeekFrom::Start(0)).map_err(io("rewind"))?;
        file.write_all(holder.encode().as_bytes())
            .and_then(|()| file.sync_data())
            .map_err(io("write"))
    }
}

/// The record of the live node holding `dir`, or `None` when no node holds it.
pub fn live_holder(dir: &Path) -> Result<Option<Holder>> {
    let path = dir.join(LOCK_FILE);
    let io = |action| io_error(action, &path);
    let mut file = match File::open(&path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(io("open")(source)),
    };
    match file.try_lock_shared() {
        // Nobody holds it: dropping the file releases the shared lock just taken.
        Ok(()) => return Ok(None),
        Err(std::fs::TryLockError::WouldBlock) => {}
        Err(std::fs::TryLockError::Error(source)) => return Err(io("lock")(source)),
    }
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(io("read"))?;
    Holder::decode(&text).map_err(|problem| Error::BadLockRecord {
        path: path.clone(),
        problem,
    })
}

/// Turns an I/O error doing `action` on `path` into the node's error.
fn io_error(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.to_owned();
    move |source| Error::DataDirIo {
        action,
        path,
        source,
    }
}

/// Removes what a dead `predecessor` left, logging each removal.
fn remove_remains(dir: &Path, predecessor: &Holder, store: &StoreConfig) -> Result<()> {
    if predecessor.pid != std::process::id() && is_running(predecessor.pid) {
        // The lock says the recorded node is dead, so its pid was reused by another process,
        // whose own segment may carry the recorded name.
        tracing::warn!(
            pid = predecessor.pid,
            store = predecessor.store,
            "the previous node on this data directory is gone but its pid runs another \
             process; leaving what may be that process's shared memory and files alone"
        );
        return Ok(());
    }
    let dead_store = StoreConfig {
        name: predecessor.store.clone(),
        ..store.clone()
    };
    let mut removed = ObjectStore::remove_dead_store(&dead_store)?;
    let socket = dir.join(&predecessor.socket);
    match std::fs::remove_file(&socket) {
        Ok(()) => removed.push(socket),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(Error::DataDirIo {
                action: "remove",
                path: socket,
                source,
            });
        }
    }
    if !removed.is_empty() {
        tracing::warn!(
            pid = predecessor.pid,
            ?removed,
            "removed what the killed node before this one on the data directory left"
        );
    }
    Ok(())
}

/// Whether process `pid` exists and is not a zombie (a zombie holds no locks and no memory).
fn is_running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the command name, which is in parentheses and may hold any byte.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(pid: u32) -> Holder {
        Holder {
            pid,
            store: format!("node-{pid}"),
            socket: format!("node-{pid}.sock"),
            rpc: None,
        }
    }

    /// A store named `name` with its directories in `dir`.
    fn store_in(dir: &Path, name: &str) -> StoreConfig {
        StoreConfig {
            name: name.into(),
            capacity: 1 << 20,
            spill_threshold: 0.8,
            min_spilling_size: 1 << 20,
            spill_dir: dir.join("spill"),
            fallback_dir: dir.join("fallback"),
        }
    }

    #[test]
    fn records_round_trip_and_bad_ones_are_refused() {
        let record = holder(42);
        assert_eq!(Holder::decode(&record.encode()), Ok(Some(record.clone())));
        let serving = Holder {
            rpc: Some("127.0.0.1:7000".into()),
            ..record
        };
        assert_eq!(Holder::decode(&serving.encode()), Ok(Some(serving)));
        assert_eq!(Holder::decode(""), Ok(None));
        for (text, problem) in [
            ("pid=1\nstore=a\n", "no socket"),
            ("pid=x\nstore=a\nsocket=s\n", "not a process id"),
            ("pid=1\nstore=a\nsocket=s\ncolour=red\n", "unknown key"),
            ("pid=1\npid=2\nstore=a\nsocket=s\n", "twice"),
            ("pid=1\nstore=a\nsocket=../../etc/x\n", "not a file name"),
            ("garbage\n", "not key=value"),
        ] {
            let error = Holder::decode(text).unwrap_err();
            assert!(error.contains(problem), "{text:?}: {error}");
        }
    }

    #[test]
    fn a_second_claim_fails_naming_the_directory_and_the_holders_pid() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path(), "unused");
        let first = DataDirLock::claim(dir.path(), &holder(std::process::id()), &store).unwrap();
        let error = DataDirLock::claim(dir.path(), &holder(7), &store).unwrap_err();
        let message = error.to_string();
        assert!(
            matches!(&error, Error::DataDirInUse { pid: Some(pid), .. } if *pid == std::process::id()),
            "{message}"
        );
        assert!(
            message.contains(&dir.path().display().to_string()),
            "{message}"
        );
        assert!(
            message.contains(&format!("pid {}", std::process::id())),
            "{message}"
        );
        // The live holder's record, with its address once it serves, is readable meanwhile.
        let mut first = first;
        let serving = Holder {
            rpc: Some("127.0.0.1:7000".into()),
            ..holder(std::process::id())
        };
        first.record(&serving).unwrap();
        assert_eq!(live_holder(dir.path()).unwrap(), Some(serving));
        // Released with its holder: the next claim reads the record and takes over.
        drop(first);
        assert_eq!(live_holder(dir.path()).unwrap(), None);
        DataDirLock::claim(dir.path(), &holder(7), &store).unwrap();
        let record = std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap();
        assert_eq!(record, holder(7).encode());
    }

    #[test]
    fn a_dead_predecessors_socket_and_files_are_removed_and_a_live_pids_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path(), "ours");
        std::fs::create_dir_all(&store.spill_dir).unwrap();
        // A pid that no process has: above the kernel's largest.
        let dead = holder(u32::MAX - 1);
        let remains = [
            dir.path().join(&dead.socket),
            store.spill_dir.join(format!("{}-000001.spill", dead.store)),
        ];
        for path in &remains {
            std::fs::write(path, b"left").unwrap();
        }
        std::fs::write(dir.path().join(LOCK_FILE), dead.encode()).unwrap();
        drop(DataDirLock::claim(dir.path(), &holder(std::process::id()), &store).unwrap());
        assert!(remains.iter().all(|path| !path.exists()));

        // A recorded pid that runs (here: pid 1) is some other process now: nothing of its
        // is touched.
        let reused = holder(1);
        let theirs = dir.path().join(&reused.socket);
        std::fs::write(&theirs, b"live").unwrap();
        std::fs::write(dir.path().join(LOCK_FILE), reused.encode()).unwrap();
        drop(DataDirLock::claim(dir.path(), &holder(std::process::id()), &store).unwrap());
        assert!(theirs.exists());

        // A record that cannot be read stops the node, naming the file.
        std::fs::write(dir.path().join(LOCK_FILE), "who=knows\n").unwrap();
        let error = DataDirLock::claim(dir.path(), &holder(3), &store).unwrap_err();
        assert!(
            error.to_string().contains("node.lock") && error.to_string().contains("who"),
            "{error}"
        );
    }
}
