//! The Raft log: entries, hard state and the latest snapshot.
//!
//! [`LogStore`] is what the replica needs beyond raft-rs's read-only [`Storage`]: durable
//! writes. [`MemoryLog`] keeps everything in memory (tests, and the read side of the disk
//! store); [`DiskLog`] adds a write-ahead log and a snapshot file under `paths.raft_dir`.
//!
//! On disk, both files are sequences of records: a 4-byte little-endian payload length, a
//! 4-byte check of that length, an 8-byte xxh3 of the payload, then the payload. The length
//! check lets recovery tell a record that was being written when the process died (its header
//! is intact but its payload is short or fails its checksum, and nothing follows it: the torn
//! tail is cut off) from damage in the middle of the log (an error: entries that may have been
//! acknowledged must never silently disappear). A cut tail is reported as a [`LostTail`], which
//! tells the replica whether it provably lost entries it had acknowledged.
//!
//! A snapshot file holds either the whole snapshot in one record (one installed from the
//! leader) or a manifest: the snapshot without its data, then where each piece of the data
//! lies in the piece files (`snapshot.pieces.<index>`, records too, each written by the build
//! of the snapshot at that index). A build writes only the pieces no earlier manifest holds,
//! so a large state that changed a little writes a little ([`SnapshotWriter::prepare`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, btree_map};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use floe_core::hash::{Xxh3_64, xxh3_64, xxh3_128};
use protobuf::CodedOutputStream;
use protobuf::wire_format::WireType;
use raft::prelude::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};

use crate::{Error, Result};

/// What [`LogStore::persist`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Persisted {
    /// Entries or a hard state were written and made durable.
    Written,
    /// There was nothing to write.
    Nothing,
}

/// A Raft log that can be written durably. Reads come from raft-rs's [`Storage`].
pub trait LogStore: Storage + Send + 'static {
    /// Appends `entries` (replacing any conflicting suffix) and records `hard_state`; both are
    /// durable when this returns.
    fn persist(&mut self, entries: &[Entry], hard_state: Option<&HardState>) -> Result<Persisted>;

    /// Replaces the whole log by a snapshot received from the leader.
    fn apply_snapshot(&mut self, snapshot: Snapshot) -> Result<()>;

    /// Keeps `snapshot` of the local state machine and lets go of the entries it covers,
    /// returned with the snapshot it replaces. A snapshot [`LogStore::snapshot_writer`]
    /// already wrote is not written again.
    fn compact(&mut self, snapshot: Snapshot) -> Result<Compacted>;

    /// Writes snapshots durably off the Raft loop, so a large state's encoding and fsync
    /// never hold up commits; [`LogStore::compact`] then only drops the covered entries.
    fn snapshot_writer(&self) -> SnapshotWriter {
        SnapshotWriter::InMemory
    }

    /// The latest snapshot (index 0 when there is none yet).
    fn latest_snapshot(&self) -> &Snapshot;

    /// What was missing from the end of the log when it was opened, if anything.
    fn lost_tail(&self) -> Option<LostTail>;
}

/// What keeping a snapshot let go of: the snapshot it replaced and the entries it covers.
/// The replaced snapshot is the whole state encoded (14 MB at 100,000 jobs), and freeing it
/// on the Raft loop took 6–33 ms of every snapshot kept in `floe-bench scale`: the caller
/// drops it where that delays no commit.
#[derive(Debug, Default)]
pub struct Compacted {
    _snapshot: Snapshot,
    _entries: Vec<Entry>,
}

/// The end of a log that did not survive until it was opened again: a record cut short (a
/// crash in the middle of a write, or a disk that lost bytes it had reported written), or
/// entries gone from under a hard state that says they were committed.
///
/// A record cut short by a crash was never acknowledged: votes and acknowledgements are sent
/// only once their write is durable. Dropping it is safe, and nothing here can tell it apart
/// from lost durable bytes. What *can* be told is `recorded_commit > last_index`: a hard
/// state that survived says entries up to `recorded_commit` were committed, and this log
/// held them — durably, since it recorded their commit — but now ends before them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LostTail {
    /// Bytes cut off the end of the WAL (0 when records are missing whole).
    pub dropped_bytes: u64,
    /// The last entry the log still holds.
    pub last_index: u64,
    /// The highest commit index the surviving hard states record. The log's commit index
    /// is lowered to `last_index` when it is higher (raft-rs refuses to start otherwise).
    pub recorded_commit: u64,
}

impl LostTail {
    /// Whether entries this replica held durably, and so may have acknowledged, are gone.
    pub fn lost_committed_entries(&self) -> bool {
        self.recorded_commit > self.last_index
    }
}

/// The log in memory: a snapshot followed by the entries after it.
#[derive(Debug, Clone, Default)]
pub struct MemoryLog {
    hard_state: HardState,
    conf_state: ConfState,
    snapshot: Snapshot,
    /// `entries[0].index == snapshot index + 1`.
    entries: Vec<Entry>,
}

impl MemoryLog {
    /// An empty log whose replica group is `voters` (a fixed membership).
    pub fn new(voters: Vec<u64>) -> Self {
        Self {
            conf_state: ConfState::from((voters, Vec::new())),
            ..Self::default()
        }
    }

    fn snapshot_index(&self) -> u64 {
        self.snapshot.get_metadata().index
    }

    fn last(&self) -> u64 {
        self.snapshot_index() + self.entries.len() as u64
    }

    pub fn hard_state(&self) -> &HardState {
        &self.hard_state
    }

    /// Appends entries, dropping any suffix they replace. A gap, or an entry the snapshot
    /// already covers, is a broken invariant of the caller and is reported as an error.
    fn append(&mut self, entries: &[Entry]) -> std::result::Result<(), String> {
        let Some(first) = entries.first() else {
            return Ok(());
        };
        if first.index <= self.snapshot_index() {
            return Err(format!(
                "entry {} is already covered by the snapshot at {}",
                first.index,
                self.snapshot_index()
            ));
        }
        if first.index > self.last() + 1 {
            return Err(format!(
                "entry {} leaves a gap after the last entry {}",
                first.index,
                self.last()
            ));
        }
        let keep = (first.index - self.snapshot_index() - 1) as usize;
        self.entries.truncate(keep);
        self.entries.extend_from_slice(entries);
        Ok(())
    }

    fn install_snapshot(&mut self, snapshot: Snapshot) -> std::result::Result<(), String> {
        let meta = snapshot.get_metadata();
        if meta.index < self.snapshot_index() {
            return Err(format!(
                "snapshot at {} is older than the current one at {}",
                meta.index,
                self.snapshot_index()
            ));
        }
        self.hard_state.term = self.hard_state.term.max(meta.term);
        self.hard_state.commit = self.hard_state.commit.max(meta.index);
        self.conf_state = meta.get_conf_state().clone();
        self.entries.clear();
        self.snapshot = snapshot;
        Ok(())
    }

    fn compact_to(&mut self, snapshot: Snapshot) -> std::result::Result<Compacted, String> {
        let index = snapshot.get_metadata().index;
        if index <= self.snapshot_index() {
            return Ok(Compacted::default());
        }
        if index > self.last() {
            return Err(format!(
                "cannot compact to {index}: the log ends at {}",
                self.last()
            ));
        }
        // The entries after the snapshot move to a new vector (a few, once the snapshot is
        // built); the covered ones stay in the old one, which goes with the replaced snapshot.
        let covered = (index - self.snapshot_index()) as usize;
        let after = self.entries.split_off(covered);
        let entries = std::mem::replace(&mut self.entries, after);
        // Only committed entries are compacted; say so, in case the last hard state written
        // predates the commit (raft-rs reports some commit advances outside the hard state).
        self.hard_state.commit = self.hard_state.commit.max(index);
        self.conf_state = snapshot.get_metadata().get_conf_state().clone();
        Ok(Compacted {
            _snapshot: std::mem::replace(&mut self.snapshot, snapshot),
            _entries: entries,
        })
    }
}

impl Storage for MemoryLog {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState::new(
            self.hard_state.clone(),
            self.conf_state.clone(),
        ))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low <= self.snapshot_index() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last() + 1 || low > high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let offset = self.snapshot_index() + 1;
        let mut entries = self.entries[(low - offset) as usize..(high - offset) as usize].to_vec();
        raft::util::limit_size(&mut entries, max_size.into());
        Ok(entries)
    }

    fn term(&self, index: u64) -> raft::Result<u64> {
        let snapshot = self.snapshot.get_metadata();
        if index == snapshot.index {
            return Ok(snapshot.term);
        }
        if index < snapshot.index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        self.entries
            .get((index - snapshot.index - 1) as usize)
            .map(|entry| entry.term)
            .ok_or(raft::Error::Store(StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.snapshot_index() + 1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last())
    }

    fn snapshot(&self, _request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        if self.snapshot_index() == 0 {
            // Nothing was ever compacted, so every follower can still be sent entries.
            return Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        Ok(self.snapshot.clone())
    }
}

impl LogStore for MemoryLog {
    fn persist(&mut self, entries: &[Entry], hard_state: Option<&HardState>) -> Result<Persisted> {
        if entries.is_empty() && hard_state.is_none() {
            return Ok(Persisted::Nothing);
        }
        self.append(entries).map_err(Error::LogInvariant)?;
        if let Some(hard_state) = hard_state {
            self.hard_state = hard_state.clone();
        }
        Ok(Persisted::Written)
    }

    fn apply_snapshot(&mut self, snapshot: Snapshot) -> Result<()> {
        self.install_snapshot(snapshot).map_err(Error::LogInvariant)
    }

    fn compact(&mut self, snapshot: Snapshot) -> Result<Compacted> {
        self.compact_to(snapshot).map_err(Error::LogInvariant)
    }

    fn latest_snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    fn lost_tail(&self) -> Option<LostTail> {
        None
    }
}

/// Where a log keeps its snapshots durably; cloned to a background task that writes one.
#[derive(Debug, Clone)]
pub enum SnapshotWriter {
    /// The log keeps its snapshot in memory only.
    InMemory,
    /// The files of a [`DiskLog`], guarded by what they hold, so a slow background write
    /// never replaces a newer snapshot (one installed from the leader meanwhile).
    File {
        dir: PathBuf,
        written: Arc<Mutex<Written>>,
        /// The log kept a prepared next WAL and has not moved to it yet: its file must not be
        /// touched until it has (see [`DiskLog::persist`]). Outside the lock, so the Raft loop
        /// saying it moved never waits for a snapshot being written.
        switching: Arc<AtomicBool>,
    },
}

/// What a [`DiskLog`]'s snapshot files hold.
#[derive(Debug, Default)]
pub struct Written {
    /// The index of the snapshot in the snapshot file.
    snapshot: u64,
    /// A next WAL prepared for the snapshot at `.0`, holding its entries up to `.1`.
    next_wal: Option<(u64, u64)>,
    /// The pieces the snapshot file's manifest names (none for a snapshot in one record).
    pieces: StoredPieces,
}

/// A run of a snapshot's data, named by the xxh3-128 of its bytes: the snapshot store keeps
/// each piece once, whichever snapshots share it.
#[derive(Debug, Clone, Copy)]
pub struct SnapshotPiece<'a> {
    pub bytes: &'a [u8],
    pub hash: u128,
}

/// What [`SnapshotWriter::prepare`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prepared {
    /// Bytes of the snapshot's data written to new piece files; the rest were already stored.
    pub written_bytes: u64,
}

/// Where the pieces of the snapshot file's manifest lie, and the piece files they are in.
#[derive(Debug, Default)]
struct StoredPieces {
    at: HashMap<u128, PieceLocation>,
    /// Each piece file the manifest names, and its length.
    files: BTreeMap<u64, u64>,
}

/// A piece's record: in the piece file of the snapshot at `file`, at `offset`, its bytes
/// `len` long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PieceLocation {
    file: u64,
    offset: u64,
    len: u32,
}

/// The bytes of a piece's place in a manifest: file, offset, length and hash.
const MANIFEST_PIECE_LEN: usize = 8 + 8 + 4 + 16;

impl SnapshotWriter {
    /// Writes `snapshot` unless the file already holds it or a newer one.
    pub fn write(&self, snapshot: &Snapshot) -> Result<()> {
        let SnapshotWriter::File { dir, written, .. } = self else {
            return Ok(());
        };
        let mut written = written.lock().unwrap_or_else(PoisonError::into_inner);
        write_snapshot_file(dir, &mut written, snapshot)
    }

    /// Writes `snapshot`, whose data is `pieces` joined, then the start of the WAL that
    /// follows it: `entries`, the committed ones after the snapshot. Only the pieces the
    /// store does not hold yet are written (one new piece file, synced, then the manifest);
    /// piece files no manifest names any more are removed. Keeping the snapshot
    /// ([`LogStore::compact`]) then writes nothing: the log's next write appends what came
    /// since to the next WAL instead of the WAL, with the one fsync that write makes anyway,
    /// and renames it over the WAL.
    pub fn prepare(
        &self,
        snapshot: &Snapshot,
        pieces: &[SnapshotPiece],
        entries: &[Entry],
    ) -> Result<Prepared> {
        let SnapshotWriter::File {
            dir,
            written,
            switching,
        } = self
        else {
            return Ok(Prepared::default());
        };
        let mut written = written.lock().unwrap_or_else(PoisonError::into_inner);
        let prepared = write_snapshot_pieces(dir, &mut written, snapshot, pieces)?;
        let index = snapshot.get_metadata().index;
        if written.snapshot != index || switching.load(Ordering::SeqCst) {
            // A newer snapshot was installed meanwhile, or the log has yet to move to the last
            // next WAL: keeping this snapshot rewrites the WAL instead.
            return Ok(prepared);
        }
        let mut bytes = Vec::new();
        for entry in entries {
            encode_record(TAG_ENTRY, &encode_message(entry, "log entry")?, &mut bytes)?;
        }
        let path = dir.join(WAL_NEXT_FILE);
        let mut file = File::create(&path).map_err(Error::io("creating", &path))?;
        write_synced(&mut file, &path, &[&bytes])?;
        sync_dir(dir)?;
        let last = entries.last().map_or(index, |entry| entry.index);
        written.next_wal = Some((index, last));
        Ok(prepared)
    }

    /// The last entry of the next WAL prepared for the snapshot at `index`, if one is; the
    /// log is then switching to it until [`SnapshotWriter::switched`].
    fn take_prepared(&self, index: u64) -> Option<u64> {
        let SnapshotWriter::File {
            written, switching, ..
        } = self
        else {
            return None;
        };
        let mut written = written.lock().unwrap_or_else(PoisonError::into_inner);
        match written.next_wal.take() {
            Some((prepared, last)) if prepared == index => {
                switching.store(true, Ordering::SeqCst);
                Some(last)
            }
            _ => None,
        }
    }

    /// The log has moved to the next WAL it kept: a later snapshot may prepare another.
    fn switched(&self) {
        if let SnapshotWriter::File { switching, .. } = self {
            switching.store(false, Ordering::SeqCst);
        }
    }

    /// Removes a next WAL the log will not move to, so recovery never reads it; under the
    /// lock, so that no snapshot being prepared is writing it meanwhile.
    fn discard_next_wal(&self) -> Result<()> {
        let SnapshotWriter::File {
            dir,
            written,
            switching,
        } = self
        else {
            return Ok(());
        };
        let mut written = written.lock().unwrap_or_else(PoisonError::into_inner);
        let path = dir.join(WAL_NEXT_FILE);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(Error::io("removing", &path)(error)),
        }
        written.next_wal = None;
        switching.store(false, Ordering::SeqCst);
        Ok(())
    }
}

fn write_snapshot_file(dir: &Path, written: &mut Written, snapshot: &Snapshot) -> Result<()> {
    let index = snapshot.get_metadata().index;
    if index <= written.snapshot {
        return Ok(());
    }
    let record = SnapshotRecord::of(snapshot)?;
    write_atomically(dir, SNAPSHOT_FILE, &record.pieces())?;
    written.snapshot = index;
    written.next_wal = None;
    written.pieces = StoredPieces::default();
    remove_piece_files_but(dir, &BTreeMap::new());
    Ok(())
}

/// Writes `snapshot` as a manifest of `pieces` (its data joined) unless the file already
/// holds it or a newer one: the pieces the store lacks go to a new piece file named by the
/// snapshot's index, synced with its directory entry before the manifest that names it
/// replaces the last; then the piece files the manifest does not name are removed.
///
/// A piece file may hold pieces of earlier snapshots no longer used: one whose pieces in
/// this snapshot take less than half of it is not named again, its pieces written anew
/// instead, so the piece files a manifest names hold less than twice its data (and the
/// new file), and a piece file is copied at most once per halving.
fn write_snapshot_pieces(
    dir: &Path,
    written: &mut Written,
    snapshot: &Snapshot,
    pieces: &[SnapshotPiece],
) -> Result<Prepared> {
    let index = snapshot.get_metadata().index;
    if index <= written.snapshot {
        return Ok(Prepared::default());
    }
    let data_len: usize = pieces.iter().map(|piece| piece.bytes.len()).sum();
    if data_len != snapshot.data.len() {
        return Err(Error::LogInvariant(format!(
            "a snapshot's {} bytes of data were given as {data_len} bytes of pieces",
            snapshot.data.len()
        )));
    }
    let (located, prepared) = write_pieces_and_manifest(dir, &written.pieces, snapshot, pieces)?;
    written.snapshot = index;
    written.next_wal = None;
    written.pieces = located;
    remove_piece_files_but(dir, &written.pieces.files);
    Ok(prepared)
}

/// The part of [`write_snapshot_pieces`] that writes: the new piece file and the manifest,
/// given what the store holds; returns where the manifest's pieces lie.
fn write_pieces_and_manifest(
    dir: &Path,
    stored: &StoredPieces,
    snapshot: &Snapshot,
    pieces: &[SnapshotPiece],
) -> Result<(StoredPieces, Prepared)> {
    let index = snapshot.get_metadata().index;
    // A stored piece is one of the same hash and length.
    let stored_at = |piece: &SnapshotPiece| {
        stored
            .at
            .get(&piece.hash)
            .filter(|at| at.len as usize == piece.bytes.len())
    };
    let mut used: BTreeMap<u64, u64> = BTreeMap::new();
    let mut counted = HashSet::new();
    for piece in pieces {
        if let Some(at) = stored_at(piece)
            && counted.insert(piece.hash)
        {
            *used.entry(at.file).or_default() += piece_record_len(at.len);
        }
    }
    let kept_files: BTreeSet<u64> = used
        .into_iter()
        .filter(|(file, used)| 2 * used >= stored.files[file])
        .map(|(file, _)| file)
        .collect();
    let mut located = StoredPieces::default();
    let mut records: Vec<[u8; HEADER_LEN + 1]> = Vec::new();
    let mut new_pieces: Vec<&[u8]> = Vec::new();
    let mut file_len = 0u64;
    let mut manifest = Vec::new();
    let meta = encode_without_data(snapshot)?;
    manifest.extend_from_slice(&record_len(meta.len())?.to_le_bytes());
    manifest.extend_from_slice(&meta);
    for piece in pieces {
        let kept = stored_at(piece).filter(|at| kept_files.contains(&at.file));
        let written = located
            .at
            .get(&piece.hash)
            .filter(|at| at.len as usize == piece.bytes.len());
        let at = match written.or(kept) {
            Some(at) => *at,
            None => {
                let mut checksum = Xxh3_64::new();
                checksum.update(&[TAG_PIECE]);
                checksum.update(piece.bytes);
                let mut record = [0; HEADER_LEN + 1];
                let header = record_header(record_len(piece.bytes.len() + 1)?, checksum.digest());
                record[..HEADER_LEN].copy_from_slice(&header);
                record[HEADER_LEN] = TAG_PIECE;
                records.push(record);
                new_pieces.push(piece.bytes);
                let at = PieceLocation {
                    file: index,
                    offset: file_len,
                    len: record_len(piece.bytes.len())?,
                };
                file_len += piece_record_len(at.len);
                at
            }
        };
        let file_size = if at.file == index {
            0
        } else {
            stored.files[&at.file]
        };
        located.files.insert(at.file, file_size);
        located.at.insert(piece.hash, at);
        manifest.extend_from_slice(&at.file.to_le_bytes());
        manifest.extend_from_slice(&at.offset.to_le_bytes());
        manifest.extend_from_slice(&at.len.to_le_bytes());
        manifest.extend_from_slice(&piece.hash.to_le_bytes());
    }
    if !new_pieces.is_empty() {
        let path = dir.join(piece_file_name(index));
        let mut file = File::create(&path).map_err(Error::io("creating", &path))?;
        let slices: Vec<&[u8]> = records
            .iter()
            .zip(&new_pieces)
            .flat_map(|(record, bytes)| [&record[..], bytes])
            .collect();
        write_synced(&mut file, &path, &slices)?;
        // The manifest's rename must never outlast the piece file's name after a crash.
        sync_dir(dir)?;
        located.files.insert(index, file_len);
    }
    let mut record = Vec::with_capacity(HEADER_LEN + 1 + manifest.len());
    encode_record(TAG_MANIFEST, &manifest, &mut record)?;
    write_atomically(dir, SNAPSHOT_FILE, &[&record])?;
    let prepared = Prepared {
        written_bytes: new_pieces.iter().map(|bytes| bytes.len() as u64).sum(),
    };
    Ok((located, prepared))
}

/// The bytes of a piece's record in its file.
fn piece_record_len(len: u32) -> u64 {
    (HEADER_LEN + 1) as u64 + u64::from(len)
}

fn piece_file_name(index: u64) -> String {
    format!("{PIECE_FILE_PREFIX}{index}")
}

/// Removes every piece file but `kept`'s: those no manifest names (a crash may have left
/// one between a piece file and its manifest). Called once the snapshot that names `kept` is
/// durable, so a failure only leaves files for the next call: it is logged, not returned.
fn remove_piece_files_but(dir: &Path, kept: &BTreeMap<u64, u64>) {
    let removed = std::fs::read_dir(dir).and_then(|entries| {
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name();
            let unnamed = name
                .to_str()
                .and_then(|name| name.strip_prefix(PIECE_FILE_PREFIX))
                .and_then(|index| index.parse::<u64>().ok())
                .is_some_and(|file| !kept.contains_key(&file));
            if unnamed {
                std::fs::remove_file(entry.path())?;
            }
        }
        Ok(())
    });
    if let Err(error) = removed {
        tracing::warn!(dir = %dir.display(), %error, "cannot remove piece files no snapshot names");
    }
}

/// Reads the snapshot a manifest describes (see [`write_snapshot_pieces`]), and where its
/// pieces lie.
fn read_manifest(dir: &Path, manifest: &[u8]) -> Result<(Snapshot, StoredPieces)> {
    let path = dir.join(SNAPSHOT_FILE);
    let corrupt = |reason: String| Error::Corrupt {
        path: path.clone(),
        offset: 0,
        reason,
    };
    let (meta_len, rest) = manifest
        .split_first_chunk::<4>()
        .ok_or_else(|| corrupt("a manifest cut short".into()))?;
    let meta_len = u32::from_le_bytes(*meta_len) as usize;
    let (meta, places) = rest
        .split_at_checked(meta_len)
        .ok_or_else(|| corrupt("a manifest cut short".into()))?;
    if places.len() % MANIFEST_PIECE_LEN != 0 {
        return Err(corrupt("a manifest's piece list is cut short".into()));
    }
    let mut snapshot: Snapshot = decode_message(meta, "snapshot")?;
    let mut stored = StoredPieces::default();
    let mut files: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut data = Vec::new();
    for place in places.chunks_exact(MANIFEST_PIECE_LEN) {
        let field = |from: usize, to: usize| &place[from..to];
        let at = PieceLocation {
            file: u64::from_le_bytes(field(0, 8).try_into().expect("8 bytes")),
            offset: u64::from_le_bytes(field(8, 16).try_into().expect("8 bytes")),
            len: u32::from_le_bytes(field(16, 20).try_into().expect("4 bytes")),
        };
        let hash = u128::from_le_bytes(field(20, 36).try_into().expect("16 bytes"));
        let file_path = dir.join(piece_file_name(at.file));
        let bytes = match files.entry(at.file) {
            btree_map::Entry::Occupied(read) => read.into_mut(),
            btree_map::Entry::Vacant(unread) => {
                let bytes = std::fs::read(&file_path).map_err(Error::io("reading", &file_path))?;
                stored.files.insert(at.file, bytes.len() as u64);
                unread.insert(bytes)
            }
        };
        let start = usize::try_from(at.offset).unwrap_or(usize::MAX);
        let end = start.saturating_add(HEADER_LEN + 1 + at.len as usize);
        let record = bytes.get(start..end).unwrap_or_default();
        let records = read_records(&file_path, record)?;
        let piece = match records.records[..] {
            [(TAG_PIECE, piece)] if records.valid_len == record.len() => piece,
            _ => {
                return Err(Error::Corrupt {
                    path: file_path,
                    offset: at.offset,
                    reason: "no whole piece record where the manifest says".into(),
                });
            }
        };
        if xxh3_128(piece) != hash {
            return Err(Error::Corrupt {
                path: file_path,
                offset: at.offset,
                reason: "a piece whose bytes are not the ones the manifest names".into(),
            });
        }
        data.extend_from_slice(piece);
        stored.at.insert(hash, at);
    }
    snapshot.data = data.into();
    Ok((snapshot, stored))
}

/// A snapshot's one record, as [`encode_record`] would lay it out around its protobuf
/// encoding, in pieces that leave the snapshot's data where it is. Encoding the message and
/// then the record copied the whole state twice more (14 MB each at 100,000 jobs), into
/// memory touched for the first time, on the builder whose CPU time every commit beside it
/// pays for (docs/BENCHMARKS.md).
struct SnapshotRecord<'a> {
    header: [u8; HEADER_LEN],
    /// The record's tag, then the data field's key and length as protobuf writes them.
    data_prefix: Vec<u8>,
    data: &'a [u8],
    /// The rest of the message: the snapshot without its data, encoded. The data field comes
    /// first, as protobuf writes fields in the order of their numbers: the pieces are the
    /// bytes the whole message's encoding would be.
    rest: Vec<u8>,
}

impl<'a> SnapshotRecord<'a> {
    fn of(snapshot: &'a Snapshot) -> Result<Self> {
        let rest = encode_without_data(snapshot)?;
        let data = &snapshot.data[..];
        let mut data_prefix = vec![TAG_SNAPSHOT];
        // As protobuf does, an empty field is left out.
        if !data.is_empty() {
            put_data_key(data.len(), &mut data_prefix).map_err(|error| Error::Protobuf {
                what: "snapshot",
                message: error.to_string(),
            })?;
        }
        let len = record_len(data_prefix.len() + data.len() + rest.len())?;
        let mut checksum = Xxh3_64::new();
        for piece in [&data_prefix[..], data, &rest] {
            checksum.update(piece);
        }
        let header = record_header(len, checksum.digest());
        Ok(Self {
            header,
            data_prefix,
            data,
            rest,
        })
    }

    fn pieces(&self) -> [&[u8]; 4] {
        [&self.header, &self.data_prefix, self.data, &self.rest]
    }
}

/// `snapshot`'s message without its data (its metadata), encoded.
fn encode_without_data(snapshot: &Snapshot) -> Result<Vec<u8>> {
    let mut without_data = Snapshot::default();
    without_data.set_metadata(snapshot.get_metadata().clone());
    encode_message(&without_data, "snapshot")
}

/// The field number of `Snapshot.data` in raft's `eraftpb.proto`.
const SNAPSHOT_DATA_FIELD: u32 = 1;

/// Appends what precedes `len` bytes of `Snapshot.data` in the message's encoding: the field's
/// key and the bytes' length.
fn put_data_key(len: usize, out: &mut Vec<u8>) -> protobuf::ProtobufResult<()> {
    let mut stream = CodedOutputStream::vec(out);
    stream.write_tag(SNAPSHOT_DATA_FIELD, WireType::WireTypeLengthDelimited)?;
    stream.write_raw_varint64(len as u64)?;
    stream.flush()
}

/// Replays the records of the WAL file at `path` (none when it does not exist) into
/// `memory`; returns the file's length and where its valid records end. An entry the log
/// already holds with the same term is skipped, so a next WAL that repeats entries of `wal`
/// never cuts off what follows them.
fn replay_wal(path: &Path, memory: &mut MemoryLog) -> Result<(usize, usize)> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(error) => return Err(Error::io("reading", path)(error)),
    };
    let records = read_records(path, &bytes)?;
    for (tag, body) in &records.records {
        match *tag {
            TAG_ENTRY => {
                let entry: Entry = decode_message(body, "log entry")?;
                // Entries the snapshot covers were written before a compaction finished.
                let held = entry.index <= memory.last()
                    && memory.term(entry.index).ok() == Some(entry.term);
                if entry.index > memory.snapshot_index() && !held {
                    memory.append(&[entry]).map_err(|reason| Error::Corrupt {
                        path: path.to_owned(),
                        offset: 0,
                        reason,
                    })?;
                }
            }
            TAG_HARD_STATE => {
                let hard_state: HardState = decode_message(body, "hard state")?;
                // The snapshot may be newer than the last hard state written before it.
                memory.hard_state.term = hard_state.term.max(memory.hard_state.term);
                memory.hard_state.commit = hard_state.commit.max(memory.hard_state.commit);
                memory.hard_state.vote = hard_state.vote;
            }
            other => {
                return Err(Error::Corrupt {
                    path: path.to_owned(),
                    offset: 0,
                    reason: format!("unknown record tag {other}"),
                });
            }
        }
    }
    Ok((bytes.len(), records.valid_len))
}

const HEADER_LEN: usize = 16;
const TAG_ENTRY: u8 = 1;
const TAG_HARD_STATE: u8 = 2;
const TAG_SNAPSHOT: u8 = 3;
const TAG_MANIFEST: u8 = 4;
const TAG_PIECE: u8 = 5;
const WAL_FILE: &str = "wal";
/// The WAL being started after a snapshot; renamed over [`WAL_FILE`] once complete. Recovery
/// reads it after `wal` when the rename did not last (the directory is not fsynced on the
/// Raft loop).
const WAL_NEXT_FILE: &str = "wal.next";
const SNAPSHOT_FILE: &str = "snapshot";
const PIECE_FILE_PREFIX: &str = "snapshot.pieces.";
const LOCK_FILE: &str = "lock";

fn length_check(len: u32) -> u32 {
    // Truncation is the point: 32 bits of a hash of the length guard the length.
    xxh3_64(&len.to_le_bytes()) as u32
}

/// Appends one record holding `tag` + `body` to `out`.
fn encode_record(tag: u8, body: &[u8], out: &mut Vec<u8>) -> Result<()> {
    let len = record_len(body.len() + 1)?;
    let start = out.len();
    out.extend_from_slice(&[0; HEADER_LEN]);
    out.push(tag);
    out.extend_from_slice(body);
    let header = record_header(len, xxh3_64(&out[start + HEADER_LEN..]));
    out[start..start + HEADER_LEN].copy_from_slice(&header);
    Ok(())
}

/// A record's payload (tag and body) length as its header holds it.
fn record_len(payload_len: usize) -> Result<u32> {
    u32::try_from(payload_len)
        .map_err(|_| Error::LogInvariant(format!("a {payload_len}-byte record is too large")))
}

/// The header of a record whose payload is `len` bytes with the xxh3-64 `checksum`: the length,
/// 32 bits of a hash of it, and the checksum.
fn record_header(len: u32, checksum: u64) -> [u8; HEADER_LEN] {
    let mut header = [0; HEADER_LEN];
    header[..4].copy_from_slice(&len.to_le_bytes());
    header[4..8].copy_from_slice(&length_check(len).to_le_bytes());
    header[8..].copy_from_slice(&checksum.to_le_bytes());
    header
}

/// What reading a file of records found.
struct Records<'a> {
    records: Vec<(u8, &'a [u8])>,
    /// Where the valid records end; anything after is a torn tail.
    valid_len: usize,
}

fn read_records<'a>(path: &Path, bytes: &'a [u8]) -> Result<Records<'a>> {
    let corrupt = |offset: usize, reason: String| Error::Corrupt {
        path: path.to_owned(),
        offset: offset as u64,
        reason,
    };
    let mut records = Vec::new();
    let mut offset = 0;
    while offset < bytes.len() {
        let rest = &bytes[offset..];
        let Some((header, payload_and_more)) = rest.split_first_chunk::<HEADER_LEN>() else {
            break; // A header cut short can only be the last write.
        };
        let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        let check = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
        if check != length_check(len) {
            return Err(corrupt(offset, "record header checksum mismatch".into()));
        }
        let len = len as usize;
        let Some(payload) = payload_and_more.get(..len) else {
            break; // The header made it to disk, the payload did not: a torn tail.
        };
        let mut checksum = [0u8; 8];
        checksum.copy_from_slice(&header[8..]);
        if xxh3_64(payload) != u64::from_le_bytes(checksum) {
            if payload_and_more.len() == len {
                break; // The last record's payload is damaged: a torn tail.
            }
            return Err(corrupt(offset, "record checksum mismatch".into()));
        }
        let Some((&tag, body)) = payload.split_first() else {
            return Err(corrupt(offset, "empty record".into()));
        };
        records.push((tag, body));
        offset += HEADER_LEN + len;
    }
    Ok(Records {
        records,
        valid_len: offset,
    })
}

fn decode_message<M: protobuf::Message>(body: &[u8], what: &'static str) -> Result<M> {
    M::parse_from_bytes(body).map_err(|error| Error::Protobuf {
        what,
        message: error.to_string(),
    })
}

fn encode_message<M: protobuf::Message>(message: &M, what: &'static str) -> Result<Vec<u8>> {
    message.write_to_bytes().map_err(|error| Error::Protobuf {
        what,
        message: error.to_string(),
    })
}

/// Writes `pieces`, one after the other, to `path` atomically: a temp file in the same
/// directory, fsync, rename, then fsync of the directory so the rename itself survives a crash.
fn write_atomically(dir: &Path, name: &str, pieces: &[&[u8]]) -> Result<()> {
    let path = dir.join(name);
    let temp = dir.join(format!("{name}.tmp"));
    let mut file = File::create(&temp).map_err(Error::io("creating", &temp))?;
    write_synced(&mut file, &temp, pieces)?;
    std::fs::rename(&temp, &path).map_err(Error::io("renaming into place", &path))?;
    sync_dir(dir)
}

/// Bytes of a large file (a snapshot, a next or rewritten WAL) written between two
/// `fdatasync`s, so the disk never holds more than this much of it unflushed and a WAL `fsync`
/// waits behind at most that. Measured on the 2-core test VM's disk, with a 14 MB snapshot
/// written every second beside a 300-byte WAL append fsynced in a loop (six snapshots each):
/// the WAL fsync's median during a snapshot was 7.2–9.2 ms syncing every 4 MiB against
/// 1.6–1.9 ms every 512 KiB (1.9 ms with no snapshot), for about the same snapshot time
/// (64–80 ms against 75–103 ms); 256 KiB steps doubled the snapshot time for nothing more.
const SYNC_STEP_BYTES: usize = 512 << 10;

/// Writes `pieces`, one after the other, to `file` (`path` names it in errors) and makes them
/// durable, syncing after every [`SYNC_STEP_BYTES`] on the way.
fn write_synced(file: &mut File, path: &Path, pieces: &[&[u8]]) -> Result<()> {
    let mut unsynced = 0;
    for piece in pieces {
        for step in piece.chunks(SYNC_STEP_BYTES) {
            if unsynced >= SYNC_STEP_BYTES {
                file.sync_data().map_err(Error::io("syncing", path))?;
                unsynced = 0;
            }
            file.write_all(step).map_err(Error::io("writing", path))?;
            unsynced += step.len();
        }
    }
    file.sync_all().map_err(Error::io("syncing", path))
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|dir| dir.sync_all())
        .map_err(Error::io("syncing directory", dir))
}

/// Closes a WAL that was renamed over on a thread of its own. Its last close frees the file's
/// blocks and page cache, which took 4.5–6 ms in `floe-bench scale`: on the Raft loop, that
/// is a commit's write waiting. A thread that cannot be started leaves the close to this one.
fn close_elsewhere(replaced: File) {
    let _ = std::thread::Builder::new()
        .name("wal-close".into())
        .spawn(move || drop(replaced));
}

/// A next WAL prepared by the snapshot writer and kept with its snapshot: it holds the
/// committed entries after the snapshot up to `last`, durably, and nothing else yet.
#[derive(Debug)]
struct NextWal {
    file: File,
    last: u64,
}

/// The durable log: a [`MemoryLog`] for reads, mirrored by a WAL and a snapshot file.
#[derive(Debug)]
pub struct DiskLog {
    memory: MemoryLog,
    dir: PathBuf,
    wal: File,
    buffer: Vec<u8>,
    lost_tail: Option<LostTail>,
    snapshot_file: SnapshotWriter,
    /// The next WAL of a kept snapshot, which the next write moves to.
    next_wal: Option<NextWal>,
    /// Held while the log is open: two replicas writing one log would corrupt it. The OS
    /// releases it when the process dies, however it dies.
    _lock: File,
}

impl DiskLog {
    /// Opens (or creates) the log in `dir`. `voters` is the replica group; it is used until
    /// a snapshot records one. A torn tail is cut off; corruption anywhere else is an error.
    pub fn open(dir: &Path, voters: Vec<u64>) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(Error::io("creating", dir))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = File::create(&lock_path).map_err(Error::io("creating", &lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(Error::LogInUse {
                    path: dir.to_owned(),
                });
            }
            Err(std::fs::TryLockError::Error(error)) => {
                return Err(Error::io("locking", &lock_path)(error));
            }
        }
        let mut memory = MemoryLog::new(voters);
        let mut pieces = StoredPieces::default();
        let snapshot_path = dir.join(SNAPSHOT_FILE);
        match std::fs::read(&snapshot_path) {
            Ok(bytes) => {
                let records = read_records(&snapshot_path, &bytes)?;
                // The snapshot is renamed into place whole, so anything short of one complete
                // record is damage, not a torn write.
                let snapshot = match records.records[..] {
                    [(TAG_SNAPSHOT, body)] => decode_message(body, "snapshot")?,
                    [(TAG_MANIFEST, body)] => {
                        let (snapshot, stored) = read_manifest(dir, body)?;
                        pieces = stored;
                        snapshot
                    }
                    _ => {
                        return Err(Error::Corrupt {
                            path: snapshot_path,
                            offset: records.valid_len as u64,
                            reason: "expected exactly one snapshot or manifest record".into(),
                        });
                    }
                };
                memory
                    .install_snapshot(snapshot)
                    .map_err(Error::LogInvariant)?;
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(Error::io("reading", &snapshot_path)(error)),
        }
        remove_piece_files_but(dir, &pieces.files);
        let wal_path = dir.join(WAL_FILE);
        let (len, valid_len) = replay_wal(&wal_path, &mut memory)?;
        let next_path = dir.join(WAL_NEXT_FILE);
        // A compaction's rename of the next WAL over `wal` that did not last, or a next WAL
        // prepared by a compaction that never finished: either way its entries are read after
        // `wal`'s, and the two are merged into one `wal` below.
        let next_wal = next_path.exists();
        let next_dropped = if next_wal {
            let (next_len, next_valid) = replay_wal(&next_path, &mut memory)?;
            next_len - next_valid
        } else {
            0
        };
        let wal = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&wal_path)
            .map_err(Error::io("opening", &wal_path))?;
        let dropped_bytes = (len - valid_len + next_dropped) as u64;
        if dropped_bytes > 0 && !next_wal {
            tracing::warn!(
                path = %wal_path.display(),
                kept = valid_len,
                dropped = dropped_bytes,
                "cutting off a torn record at the end of the raft log"
            );
            wal.set_len(valid_len as u64)
                .and_then(|()| wal.sync_all())
                .map_err(Error::io("truncating", &wal_path))?;
        }
        let last_index = memory.last();
        let recorded_commit = memory.hard_state.commit;
        let lost_tail = (dropped_bytes > 0 || recorded_commit > last_index).then_some(LostTail {
            dropped_bytes,
            last_index,
            recorded_commit,
        });
        if recorded_commit > last_index {
            tracing::error!(
                path = %wal_path.display(),
                recorded_commit,
                last_index,
                "the raft log lost entries its hard state says were committed; its commit \
                 index is lowered to the last entry it holds"
            );
            // Lowering what this replica knows to be committed is safe (the leader tells it
            // again); what it may have acknowledged is the replica's concern (see LostTail).
            memory.hard_state.commit = last_index;
        }
        let snapshot_file = SnapshotWriter::File {
            dir: dir.to_owned(),
            written: Arc::new(Mutex::new(Written {
                snapshot: memory.snapshot_index(),
                next_wal: None,
                pieces,
            })),
            switching: Arc::default(),
        };
        let mut log = Self {
            memory,
            dir: dir.to_owned(),
            wal,
            buffer: Vec::new(),
            lost_tail,
            snapshot_file,
            next_wal: None,
            _lock: lock,
        };
        if next_wal {
            log.rewrite_wal()?;
            std::fs::remove_file(&next_path).map_err(Error::io("removing", &next_path))?;
            sync_dir(dir)?;
        }
        Ok(log)
    }

    pub fn memory(&self) -> &MemoryLog {
        &self.memory
    }

    /// Moves to the next WAL with this write: appends to it every entry after its `last`
    /// (those written to the old WAL since the snapshot was copied, then this write's) and
    /// the hard state, fsyncs once (the fsync this write makes anyway), and renames it over
    /// the WAL. `memory` already holds this write. The rename is not fsynced; until it lasts,
    /// recovery reads `wal.next` after `wal`.
    fn switch_to_next_wal(&mut self, mut next: NextWal) -> Result<()> {
        let next_path = self.dir.join(WAL_NEXT_FILE);
        self.buffer.clear();
        let after = (next.last - self.memory.snapshot_index()) as usize;
        for entry in &self.memory.entries[after..] {
            encode_record(
                TAG_ENTRY,
                &encode_message(entry, "log entry")?,
                &mut self.buffer,
            )?;
        }
        let hard_state = encode_message(&self.memory.hard_state, "hard state")?;
        encode_record(TAG_HARD_STATE, &hard_state, &mut self.buffer)?;
        next.file
            .write_all(&self.buffer)
            .map_err(Error::io("appending to", &next_path))?;
        next.file
            .sync_data()
            .map_err(Error::io("syncing", &next_path))?;
        let wal_path = self.dir.join(WAL_FILE);
        std::fs::rename(&next_path, &wal_path).map_err(Error::io("renaming", &next_path))?;
        close_elsewhere(std::mem::replace(&mut self.wal, next.file));
        self.snapshot_file.switched();
        Ok(())
    }

    /// Rewrites the WAL to hold only the current hard state and the entries after the
    /// snapshot; called after the snapshot file is durable.
    fn rewrite_wal(&mut self) -> Result<()> {
        let mut bytes = Vec::new();
        let hard_state = encode_message(&self.memory.hard_state, "hard state")?;
        encode_record(TAG_HARD_STATE, &hard_state, &mut bytes)?;
        for entry in &self.memory.entries {
            encode_record(TAG_ENTRY, &encode_message(entry, "log entry")?, &mut bytes)?;
        }
        write_atomically(&self.dir, WAL_FILE, &[&bytes])?;
        let wal_path = self.dir.join(WAL_FILE);
        let wal = OpenOptions::new()
            .append(true)
            .open(&wal_path)
            .map_err(Error::io("opening", &wal_path))?;
        close_elsewhere(std::mem::replace(&mut self.wal, wal));
        Ok(())
    }
}

impl Storage for DiskLog {
    fn initial_state(&self) -> raft::Result<RaftState> {
        self.memory.initial_state()
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        self.memory.entries(low, high, max_size, context)
    }

    fn term(&self, index: u64) -> raft::Result<u64> {
        self.memory.term(index)
    }

    fn first_index(&self) -> raft::Result<u64> {
        self.memory.first_index()
    }

    fn last_index(&self) -> raft::Result<u64> {
        self.memory.last_index()
    }

    fn snapshot(&self, request_index: u64, to: u64) -> raft::Result<Snapshot> {
        self.memory.snapshot(request_index, to)
    }
}

impl LogStore for DiskLog {
    fn persist(&mut self, entries: &[Entry], hard_state: Option<&HardState>) -> Result<Persisted> {
        if entries.is_empty() && hard_state.is_none() {
            return Ok(Persisted::Nothing);
        }
        if let Some(next) = self.next_wal.take() {
            self.memory.persist(entries, hard_state)?;
            if entries
                .first()
                .is_some_and(|first| first.index <= next.last)
            {
                // Only a new leader's entries replace a suffix, and the next WAL holds
                // committed entries only; should it happen anyway, start afresh.
                drop(next);
                self.snapshot_file.discard_next_wal()?;
                self.rewrite_wal()?;
                return Ok(Persisted::Written);
            }
            self.switch_to_next_wal(next)?;
            return Ok(Persisted::Written);
        }
        self.buffer.clear();
        for entry in entries {
            let body = encode_message(entry, "log entry")?;
            encode_record(TAG_ENTRY, &body, &mut self.buffer)?;
        }
        if let Some(hard_state) = hard_state {
            let body = encode_message(hard_state, "hard state")?;
            encode_record(TAG_HARD_STATE, &body, &mut self.buffer)?;
        }
        let wal_path = || self.dir.join(WAL_FILE);
        self.wal
            .write_all(&self.buffer)
            .map_err(|source| Error::io("appending to", wal_path())(source))?;
        // One fsync for the whole batch: this is what makes batching proposals pay.
        self.wal
            .sync_data()
            .map_err(|source| Error::io("syncing", wal_path())(source))?;
        self.memory.persist(entries, hard_state)?;
        Ok(Persisted::Written)
    }

    fn apply_snapshot(&mut self, snapshot: Snapshot) -> Result<()> {
        self.next_wal = None;
        self.snapshot_file.discard_next_wal()?;
        self.snapshot_file.write(&snapshot)?;
        self.memory
            .install_snapshot(snapshot)
            .map_err(Error::LogInvariant)?;
        self.rewrite_wal()
    }

    /// With a next WAL prepared for this snapshot, keeping it writes nothing: the next write
    /// moves to that WAL. Without one, the snapshot file and the WAL are rewritten here.
    fn compact(&mut self, snapshot: Snapshot) -> Result<Compacted> {
        let index = snapshot.get_metadata().index;
        if index <= self.memory.snapshot_index() {
            return Ok(Compacted::default());
        }
        match self.snapshot_file.take_prepared(index) {
            Some(last) if (index..=self.memory.last()).contains(&last) => {
                let next_path = self.dir.join(WAL_NEXT_FILE);
                let file = OpenOptions::new()
                    .append(true)
                    .open(&next_path)
                    .map_err(Error::io("opening", &next_path))?;
                let compacted = self
                    .memory
                    .compact_to(snapshot)
                    .map_err(Error::LogInvariant)?;
                self.next_wal = Some(NextWal { file, last });
                Ok(compacted)
            }
            _ => {
                // A next WAL prepared for this snapshot that does not fit the log, or one the
                // log has yet to move to: the rewritten WAL replaces both.
                self.next_wal = None;
                self.snapshot_file.discard_next_wal()?;
                self.snapshot_file.write(&snapshot)?;
                let compacted = self
                    .memory
                    .compact_to(snapshot)
                    .map_err(Error::LogInvariant)?;
                self.rewrite_wal()?;
                Ok(compacted)
            }
        }
    }

    fn snapshot_writer(&self) -> SnapshotWriter {
        self.snapshot_file.clone()
    }

    fn latest_snapshot(&self) -> &Snapshot {
        &self.memory.snapshot
    }

    fn lost_tail(&self) -> Option<LostTail> {
        self.lost_tail
    }
}

#[cfg(test)]
mod tests;
