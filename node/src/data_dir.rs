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
//! clean (the node tells the cache index first), and once registered its node id, so the
//! next node on the directory, at the same address, registers as its replacement and the
//! scheduler retires the old id at once instead of after missed heartbeats.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use floe_core::NodeId;
use floe_objectstore::{ObjectStore, StoreConfig};

use crate::{Error, Result};

const LOCK_FILE: &str = "node.lock";

/// The lock on a node's data directory; released when dropped or when the process dies.
#[derive(Debug)]
pub struct DataDirLock {
    /// Holds the lock; records are written through files of their own (see [`record_in`]).
    _file: File,
    dir: std::path::PathBuf,
    /// The record of the node that held the directory before, if it left one.
    predecessor: Option<Holder>,
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
    /// The id the scheduler gave the node, once it registered.
    pub node: Option<NodeId>,
}

impl Holder {
    fn encode(&self) -> String {
        let rpc = self
            .rpc
            .as_ref()
            .map_or_else(String::new, |rpc| format!("rpc={rpc}\n"));
        let node = self
            .node
            .map_or_else(String::new, |node| format!("node={}\n", node.get()));
        format!(
            "pid={}\nstore={}\nsocket={}\n{rpc}{node}",
            self.pid, self.store, self.socket
        )
    }

    /// Reads a record; an empty file (a holder killed before it wrote one) is `None`.
    fn decode(text: &str) -> Result<Option<Self>, String> {
        if text.trim().is_empty() {
            return Ok(None);
        }
        let (mut pid, mut store, mut socket, mut rpc, mut node) = (None, None, None, None, None);
        for line in text.lines().filter(|line| !line.trim().is_empty()) {
            let (key, value) = line
                .split_once('=')
                .ok_or_else(|| format!("line {line:?} is not key=value"))?;
            let slot = match key {
                "pid" => &mut pid,
                "store" => &mut store,
                "socket" => &mut socket,
                "rpc" => &mut rpc,
                "node" => &mut node,
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
            node: node
                .map(|node| match node.parse() {
                    Ok(id) if id > 0 => Ok(NodeId::new(id)),
                    _ => Err(format!("node {node:?} is not a node id")),
                })
                .transpose()?,
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
        if let Some(predecessor) = &predecessor {
            remove_remains(dir, predecessor, store)?;
        }
        record_in(dir, holder)?;
        Ok(Self {
            _file: file,
            dir: dir.to_owned(),
            predecessor,
        })
    }

    /// The record the node before this one on the directory left, if any: it is dead.
    pub fn predecessor(&self) -> Option<&Holder> {
        self.predecessor.as_ref()
    }

    /// Replaces the lock file's record with `holder`.
    pub fn record(&self, holder: &Holder) -> Result<()> {
        record_in(&self.dir, holder)
    }
}

/// Replaces the record in the lock file of `dir`, which this process holds, with `holder`.
/// It writes through a file of its own: the lock is an `flock` on the [`DataDirLock`]'s open
/// file, which only closing that file releases. So the agent's registration records its id
/// through this without holding a handle that would keep the directory locked.
pub fn record_in(dir: &Path, holder: &Holder) -> Result<()> {
    let path = dir.join(LOCK_FILE);
    let io = |action| io_error(action, &path);
    let mut file = OpenOptions::new()
        .write(true)
        .open(&path)
        .map_err(io("open"))?;
    file.set_len(0).map_err(io("truncate"))?;
    file.seek(SeekFrom::Start(0)).map_err(io("rewind"))?;
    file.write_all(holder.encode().as_bytes())
        .and_then(|()| file.sync_data())
        .map_err(io("write"))
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
            node: None,
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
            ..record.clone()
        };
        assert_eq!(Holder::decode(&serving.encode()), Ok(Some(serving.clone())));
        let registered = Holder {
            node: Some(NodeId::new(12)),
            ..serving
        };
        assert_eq!(
            registered.encode(),
            "pid=42\nstore=node-42\nsocket=node-42.sock\nrpc=127.0.0.1:7000\nnode=12\n"
        );
        assert_eq!(Holder::decode(&registered.encode()), Ok(Some(registered)));
        assert_eq!(Holder::decode(""), Ok(None));
        for (text, problem) in [
            ("pid=1\nstore=a\n", "no socket"),
            ("pid=x\nstore=a\nsocket=s\n", "not a process id"),
            ("pid=1\nstore=a\nsocket=s\ncolour=red\n", "unknown key"),
            ("pid=1\npid=2\nstore=a\nsocket=s\n", "twice"),
            ("pid=1\nstore=a\nsocket=../../etc/x\n", "not a file name"),
            ("pid=1\nstore=a\nsocket=s\nnode=0\n", "not a node id"),
            ("pid=1\nstore=a\nsocket=s\nnode=-3\n", "not a node id"),
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
        let serving = Holder {
            rpc: Some("127.0.0.1:7000".into()),
            ..holder(std::process::id())
        };
        first.record(&serving).unwrap();
        assert_eq!(live_holder(dir.path()).unwrap(), Some(serving.clone()));
        // Once registered, its id, recorded through a file of its own: the lock holds.
        let serving_registered = Holder {
            node: Some(NodeId::new(3)),
            ..serving
        };
        record_in(dir.path(), &serving_registered).unwrap();
        assert_eq!(
            live_holder(dir.path()).unwrap(),
            Some(serving_registered.clone())
        );
        // Released with its holder: the next claim reads the record and takes over.
        drop(first);
        assert_eq!(live_holder(dir.path()).unwrap(), None);
        let second = DataDirLock::claim(dir.path(), &holder(7), &store).unwrap();
        assert_eq!(second.predecessor(), Some(&serving_registered));
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
