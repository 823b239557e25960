use super::*;

fn entry(index: u64, term: u64, data: &str) -> Entry {
    Entry {
        index,
        term,
        data: data.as_bytes().to_vec().into(),
        ..Entry::default()
    }
}

fn entries(range: std::ops::RangeInclusive<u64>, term: u64) -> Vec<Entry> {
    range
        .map(|index| entry(index, term, &format!("e{index}")))
        .collect()
}

fn hard_state(term: u64, vote: u64, commit: u64) -> HardState {
    HardState {
        term,
        vote,
        commit,
        ..HardState::default()
    }
}

fn snapshot(index: u64, term: u64, data: &str) -> Snapshot {
    let mut snapshot = Snapshot {
        data: data.as_bytes().to_vec().into(),
        ..Snapshot::default()
    };
    snapshot.mut_metadata().index = index;
    snapshot.mut_metadata().term = term;
    snapshot
        .mut_metadata()
        .set_conf_state(ConfState::from((vec![1, 2, 3], vec![])));
    snapshot
}

/// Prepares `snapshot` with its data as one piece.
fn prepare_whole(
    writer: &SnapshotWriter,
    snapshot: &Snapshot,
    entries: &[Entry],
) -> Result<Prepared> {
    let piece = SnapshotPiece {
        bytes: &snapshot.data,
        hash: xxh3_128(&snapshot.data),
    };
    writer.prepare(snapshot, &[piece], entries)
}

fn all_entries(log: &impl Storage) -> Vec<(u64, u64, Vec<u8>)> {
    let low = log.first_index().unwrap();
    let high = log.last_index().unwrap() + 1;
    log.entries(low, high, None, GetEntriesContext::empty(false))
        .unwrap()
        .into_iter()
        .map(|entry| (entry.index, entry.term, entry.data.to_vec()))
        .collect()
}

fn expected(range: std::ops::RangeInclusive<u64>, term: u64) -> Vec<(u64, u64, Vec<u8>)> {
    range
        .map(|index| (index, term, format!("e{index}").into_bytes()))
        .collect()
}

#[test]
fn memory_log_appends_overwrites_and_compacts() {
    let mut log = MemoryLog::new(vec![1, 2, 3]);
    assert_eq!(log.first_index().unwrap(), 1);
    assert_eq!(log.last_index().unwrap(), 0);
    log.persist(&entries(1..=5, 1), Some(&hard_state(1, 1, 3)))
        .unwrap();
    // A new leader overwrites the uncommitted suffix from index 4.
    log.persist(&entries(4..=6, 2), None).unwrap();
    let mut want = expected(1..=3, 1);
    want.extend(expected(4..=6, 2));
    assert_eq!(all_entries(&log), want);
    assert_eq!(log.term(5).unwrap(), 2);
    assert_eq!(log.hard_state().commit, 3);

    log.compact(snapshot(4, 2, "state@4")).unwrap();
    assert_eq!(log.first_index().unwrap(), 5);
    assert_eq!(log.term(4).unwrap(), 2);
    assert!(matches!(
        log.term(3),
        Err(raft::Error::Store(StorageError::Compacted))
    ));
    assert_eq!(all_entries(&log), expected(5..=6, 2));
    assert_eq!(log.snapshot(0, 2).unwrap().data.to_vec(), b"state@4");
    // A gap is refused, not silently accepted.
    assert!(log.persist(&entries(9..=9, 2), None).is_err());
}

#[test]
fn disk_log_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
        log.persist(&entries(1..=3, 1), Some(&hard_state(1, 2, 2)))
            .unwrap();
        log.persist(&entries(3..=4, 2), Some(&hard_state(2, 3, 4)))
            .unwrap();
    }
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    let mut want = expected(1..=2, 1);
    want.extend(expected(3..=4, 2));
    assert_eq!(all_entries(&log), want);
    let state = log.initial_state().unwrap();
    assert_eq!(
        (
            state.hard_state.term,
            state.hard_state.vote,
            state.hard_state.commit
        ),
        (2, 3, 4)
    );
    assert_eq!(state.conf_state.voters, vec![1, 2, 3]);
    assert_eq!(log.lost_tail(), None);
}

fn wal_len(dir: &Path) -> u64 {
    std::fs::metadata(dir.join(WAL_FILE)).unwrap().len()
}

/// Cuts the last `bytes` bytes off the WAL in `dir`.
fn cut_wal(dir: &Path, bytes: u64) {
    let file = OpenOptions::new()
        .write(true)
        .open(dir.join(WAL_FILE))
        .unwrap();
    file.set_len(wal_len(dir) - bytes).unwrap();
}

#[test]
fn a_torn_last_record_is_cut_off() {
    for cut in [1, 5, HEADER_LEN as u64 + 2] {
        let dir = tempfile::tempdir().unwrap();
        let before_last;
        {
            let mut log = DiskLog::open(dir.path(), vec![1]).unwrap();
            log.persist(&entries(1..=3, 1), None).unwrap();
            before_last = wal_len(dir.path());
            log.persist(&entries(4..=4, 1), None).unwrap();
        }
        let full = wal_len(dir.path());
        cut_wal(dir.path(), cut);

        let mut log = DiskLog::open(dir.path(), vec![1]).unwrap();
        assert_eq!(all_entries(&log), expected(1..=3, 1), "cut {cut}");
        assert_eq!(wal_len(dir.path()), before_last, "the tail is truncated");
        let lost = log.lost_tail().unwrap();
        assert_eq!(
            (lost.dropped_bytes, lost.last_index, lost.recorded_commit),
            (full - cut - before_last, 3, 0)
        );
        assert!(!lost.lost_committed_entries());
        // The log keeps working after the repair.
        log.persist(&entries(4..=5, 1), None).unwrap();
        drop(log);
        let log = DiskLog::open(dir.path(), vec![1]).unwrap();
        assert_eq!(all_entries(&log), expected(1..=5, 1));
    }
}

#[test]
fn a_damaged_last_payload_is_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = DiskLog::open(dir.path(), vec![1]).unwrap();
        log.persist(&entries(1..=3, 1), None).unwrap();
    }
    let path = dir.path().join(WAL_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let log = DiskLog::open(dir.path(), vec![1]).unwrap();
    assert_eq!(all_entries(&log), expected(1..=2, 1));
}

#[test]
fn a_damaged_middle_record_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = DiskLog::open(dir.path(), vec![1]).unwrap();
        log.persist(&entries(1..=3, 1), None).unwrap();
    }
    let path = dir.path().join(WAL_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    // The last byte of the first record's payload.
    let first_len = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
    bytes[HEADER_LEN + first_len - 1] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let error = DiskLog::open(dir.path(), vec![1]).unwrap_err();
    assert!(
        matches!(&error, Error::Corrupt { offset: 0, reason, .. } if reason.contains("checksum")),
        "{error}"
    );
    // A damaged length is caught by its own check, also before the tail.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[HEADER_LEN + first_len - 1] ^= 0xff;
    bytes[0] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    let error = DiskLog::open(dir.path(), vec![1]).unwrap_err();
    assert!(
        matches!(&error, Error::Corrupt { reason, .. } if reason.contains("header")),
        "{error}"
    );
}

#[test]
fn compaction_keeps_the_snapshot_and_shrinks_the_wal() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
        log.persist(&entries(1..=100, 1), Some(&hard_state(1, 1, 100)))
            .unwrap();
        let before = wal_len(dir.path());
        log.compact(snapshot(90, 1, "state@90")).unwrap();
        assert!(wal_len(dir.path()) < before / 5);
        log.persist(&entries(101..=102, 1), None).unwrap();
    }
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert_eq!(log.first_index().unwrap(), 91);
    assert_eq!(all_entries(&log), expected(91..=102, 1));
    assert_eq!(log.latest_snapshot().data.to_vec(), b"state@90");
    assert_eq!(log.initial_state().unwrap().hard_state.commit, 100);
}

#[test]
fn an_installed_snapshot_replaces_the_log() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
        log.persist(&entries(1..=3, 1), Some(&hard_state(1, 1, 3)))
            .unwrap();
        log.apply_snapshot(snapshot(50, 4, "leader@50")).unwrap();
        log.persist(&entries(51..=52, 4), Some(&hard_state(4, 0, 52)))
            .unwrap();
    }
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert_eq!(log.first_index().unwrap(), 51);
    assert_eq!(all_entries(&log), expected(51..=52, 4));
    assert_eq!(log.term(50).unwrap(), 4);
    assert_eq!(log.latest_snapshot().data.to_vec(), b"leader@50");
}

#[test]
fn a_damaged_snapshot_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = DiskLog::open(dir.path(), vec![1]).unwrap();
        log.persist(&entries(1..=3, 1), None).unwrap();
        log.compact(snapshot(2, 1, "state@2")).unwrap();
    }
    let path = dir.path().join(SNAPSHOT_FILE);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    assert!(matches!(
        DiskLog::open(dir.path(), vec![1]),
        Err(Error::Corrupt { .. })
    ));
}

#[test]
fn a_log_is_opened_by_one_replica_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let log = DiskLog::open(dir.path(), vec![1]).unwrap();
    assert!(matches!(
        DiskLog::open(dir.path(), vec![1]),
        Err(Error::LogInUse { .. })
    ));
    drop(log);
    DiskLog::open(dir.path(), vec![1]).unwrap();
}

/// The case that crash-looped a replica: after a compaction the WAL starts with the hard state
/// (commit at the last entry) and the entries follow, so cutting its last 100 bytes leaves a
/// commit index past the last entry, which raft-rs refuses to start from.
#[test]
fn a_cut_tail_under_a_recorded_commit_is_reported_and_the_log_still_starts() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
        log.persist(&entries(1..=40, 2), Some(&hard_state(2, 1, 40)))
            .unwrap();
        log.compact(snapshot(30, 2, "state@30")).unwrap();
    }
    cut_wal(dir.path(), 100);

    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    let last = log.last_index().unwrap();
    assert!((31..40).contains(&last), "last entry {last}");
    assert_eq!(all_entries(&log), expected(31..=last, 2));
    let lost = log.lost_tail().unwrap();
    assert_eq!((lost.last_index, lost.recorded_commit), (last, 40));
    assert!(
        lost.dropped_bytes > 0 && lost.dropped_bytes < 100,
        "{lost:?}"
    );
    assert!(lost.lost_committed_entries());
    let state = log.initial_state().unwrap();
    assert_eq!(
        (
            state.hard_state.term,
            state.hard_state.vote,
            state.hard_state.commit
        ),
        (2, 1, last),
        "the commit index is lowered to the last entry; term and vote stay"
    );
    // raft-rs starts on it (it panics on a commit index past the last entry) and resumes
    // applying after the snapshot.
    let config = raft::Config {
        id: 1,
        applied: 30,
        ..raft::Config::default()
    };
    let raw = raft::RawNode::new(&config, log, &crate::logging::raft_logger(1)).unwrap();
    assert_eq!(raw.raft.raft_log.committed, last);
    assert_eq!(raw.raft.raft_log.last_index(), last);
    drop(raw);

    // The torn bytes are gone from the file, but the hard state that proves the loss is
    // not: a replica restarted before catching up is told again.
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert_eq!(
        log.lost_tail(),
        Some(LostTail {
            dropped_bytes: 0,
            last_index: last,
            recorded_commit: 40
        })
    );
}

fn file_len(dir: &Path, name: &str) -> u64 {
    std::fs::metadata(dir.join(name)).unwrap().len()
}

/// A snapshot written off the Raft loop with the start of the next WAL, then kept: keeping it
/// writes no file (the Raft loop makes no fsync of its own for it); the next write appends
/// what came since to the next WAL and moves to it, and the log reopens with every entry.
#[test]
fn a_prepared_compaction_moves_to_the_next_wal_with_the_next_write() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
        log.persist(&entries(1..=100, 1), Some(&hard_state(1, 1, 95)))
            .unwrap();
        let writer = log.snapshot_writer();
        prepare_whole(&writer, &snapshot(90, 1, "state@90"), &entries(91..=95, 1)).unwrap();
        // Appended while the snapshot was being written.
        log.persist(&entries(101..=103, 1), None).unwrap();
        let wal_before = wal_len(dir.path());
        let next_before = file_len(dir.path(), WAL_NEXT_FILE);
        log.compact(snapshot(90, 1, "state@90")).unwrap();
        assert_eq!(wal_len(dir.path()), wal_before);
        assert_eq!(file_len(dir.path(), WAL_NEXT_FILE), next_before);
        assert_eq!(log.first_index().unwrap(), 91);
        log.persist(&entries(104..=105, 1), Some(&hard_state(1, 1, 105)))
            .unwrap();
        assert!(!dir.path().join(WAL_NEXT_FILE).exists());
        assert!(wal_len(dir.path()) < wal_before / 5);
        log.persist(&entries(106..=106, 1), None).unwrap();
        // The WAL renamed over is closed, off this thread, soon after.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !deleted_files_open_under(dir.path()).is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "the old WAL is still open"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert_eq!(log.first_index().unwrap(), 91);
    assert_eq!(all_entries(&log), expected(91..=106, 1));
    assert_eq!(log.latest_snapshot().data.to_vec(), b"state@90");
    assert_eq!(log.initial_state().unwrap().hard_state.commit, 105);
}

/// The files under `dir` that this process holds open after they were removed or renamed over.
fn deleted_files_open_under(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter(|target| {
            target.starts_with(dir) && target.to_string_lossy().ends_with(" (deleted)")
        })
        .collect()
}

/// A crash after a prepared snapshot was kept and before the next write: the entries written
/// to the old WAL since the snapshot was copied are in `wal` only, and must come back.
#[test]
fn a_crash_between_keeping_a_snapshot_and_the_next_write_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
        log.persist(&entries(1..=100, 1), Some(&hard_state(1, 1, 95)))
            .unwrap();
        prepare_whole(
            &log.snapshot_writer(),
            &snapshot(90, 1, "state@90"),
            &entries(91..=95, 1),
        )
        .unwrap();
        log.persist(&entries(101..=103, 1), Some(&hard_state(1, 1, 100)))
            .unwrap();
        log.compact(snapshot(90, 1, "state@90")).unwrap();
    }
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert_eq!(all_entries(&log), expected(91..=103, 1));
    assert_eq!(log.initial_state().unwrap().hard_state.commit, 100);
    assert!(!dir.path().join(WAL_NEXT_FILE).exists());
}

/// A second snapshot prepared before the log moved to the first one's next WAL must not
/// touch that file: it is kept by rewriting the WAL, and nothing is lost.
#[test]
fn a_snapshot_prepared_before_the_log_moved_to_the_last_next_wal_rewrites_the_wal() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
        log.persist(&entries(1..=100, 1), Some(&hard_state(1, 1, 100)))
            .unwrap();
        let writer = log.snapshot_writer();
        prepare_whole(&writer, &snapshot(50, 1, "state@50"), &entries(51..=100, 1)).unwrap();
        log.compact(snapshot(50, 1, "state@50")).unwrap();
        let next_before = std::fs::read(dir.path().join(WAL_NEXT_FILE)).unwrap();
        // No write since: the log still has to move to the next WAL.
        prepare_whole(&writer, &snapshot(80, 1, "state@80"), &entries(81..=100, 1)).unwrap();
        assert_eq!(
            std::fs::read(dir.path().join(WAL_NEXT_FILE)).unwrap(),
            next_before
        );
        log.compact(snapshot(80, 1, "state@80")).unwrap();
        assert!(!dir.path().join(WAL_NEXT_FILE).exists());
        log.persist(&entries(101..=102, 1), Some(&hard_state(1, 1, 102)))
            .unwrap();
        // The next snapshot may prepare a next WAL again.
        prepare_whole(&writer, &snapshot(90, 1, "state@90"), &entries(91..=102, 1)).unwrap();
        log.compact(snapshot(90, 1, "state@90")).unwrap();
        log.persist(&entries(103..=103, 1), Some(&hard_state(1, 1, 103)))
            .unwrap();
        assert!(!dir.path().join(WAL_NEXT_FILE).exists());
    }
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert_eq!(log.latest_snapshot().data.to_vec(), b"state@90");
    assert_eq!(all_entries(&log), expected(91..=103, 1));
}

/// A snapshot installed from the leader replaces the log, and with it a next WAL the log had
/// yet to move to.
#[test]
fn an_installed_snapshot_discards_a_next_wal_not_moved_to() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
        log.persist(&entries(1..=100, 1), Some(&hard_state(1, 1, 100)))
            .unwrap();
        prepare_whole(
            &log.snapshot_writer(),
            &snapshot(50, 1, "state@50"),
            &entries(51..=100, 1),
        )
        .unwrap();
        log.compact(snapshot(50, 1, "state@50")).unwrap();
        log.apply_snapshot(snapshot(200, 2, "leader@200")).unwrap();
        assert!(!dir.path().join(WAL_NEXT_FILE).exists());
        log.persist(&entries(201..=202, 2), Some(&hard_state(2, 3, 202)))
            .unwrap();
    }
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert_eq!(log.latest_snapshot().data.to_vec(), b"leader@200");
    assert_eq!(all_entries(&log), expected(201..=202, 2));
}

/// A crash after the next WAL was prepared but before the compaction kept it: its entries
/// repeat `wal`'s, and must not cut off the entries `wal` holds after them.
#[test]
fn a_next_wal_left_by_an_unfinished_compaction_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
        log.persist(&entries(1..=100, 1), Some(&hard_state(1, 2, 100)))
            .unwrap();
        prepare_whole(
            &log.snapshot_writer(),
            &snapshot(50, 1, "state@50"),
            &entries(51..=60, 1),
        )
        .unwrap();
    }
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert_eq!(all_entries(&log), expected(51..=100, 1));
    assert_eq!(
        log.initial_state().unwrap().hard_state,
        hard_state(1, 2, 100)
    );
    assert!(!dir.path().join(WAL_NEXT_FILE).exists());
}

/// A crash after the swap's rename, which is not fsynced, did not last: the old `wal` is
/// back beside `wal.next`, which alone holds what was appended since the swap.
#[test]
fn a_swap_whose_rename_did_not_last_is_recovered_from_both_files() {
    let dir = tempfile::tempdir().unwrap();
    let old_wal = dir.path().join("wal.old");
    {
        let mut log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
        log.persist(&entries(1..=100, 1), Some(&hard_state(1, 1, 100)))
            .unwrap();
        prepare_whole(
            &log.snapshot_writer(),
            &snapshot(90, 1, "state@90"),
            &entries(91..=100, 1),
        )
        .unwrap();
        std::fs::copy(dir.path().join(WAL_FILE), &old_wal).unwrap();
        log.compact(snapshot(90, 1, "state@90")).unwrap();
        log.persist(&entries(101..=102, 2), Some(&hard_state(2, 3, 102)))
            .unwrap();
        log.persist(&entries(103..=104, 2), Some(&hard_state(2, 3, 104)))
            .unwrap();
    }
    std::fs::rename(dir.path().join(WAL_FILE), dir.path().join(WAL_NEXT_FILE)).unwrap();
    std::fs::rename(&old_wal, dir.path().join(WAL_FILE)).unwrap();
    {
        let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
        let mut want = expected(91..=100, 1);
        want.extend(expected(101..=104, 2));
        assert_eq!(all_entries(&log), want);
        assert_eq!(
            log.initial_state().unwrap().hard_state,
            hard_state(2, 3, 104)
        );
    }
    // Merged into one `wal` at that open: a second open reads the same.
    assert!(!dir.path().join(WAL_NEXT_FILE).exists());
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert_eq!(log.last_index().unwrap(), 104);
}

/// A snapshot larger than a sync step is written in steps, and reads back whole.
#[test]
fn a_snapshot_written_in_sync_steps_reads_back_whole() {
    let dir = tempfile::tempdir().unwrap();
    let data: String = (0..(2 * SYNC_STEP_BYTES + 12_345) / 8)
        .map(|n| format!("{:08x}", n % 0xffff_ffff))
        .collect();
    {
        let mut log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
        log.persist(&entries(1..=10, 1), Some(&hard_state(1, 1, 10)))
            .unwrap();
        prepare_whole(
            &log.snapshot_writer(),
            &snapshot(8, 1, &data),
            &entries(9..=10, 1),
        )
        .unwrap();
        log.compact(snapshot(8, 1, &data)).unwrap();
    }
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert!(log.latest_snapshot().data.len() > 2 * SYNC_STEP_BYTES);
    assert_eq!(log.latest_snapshot().data.to_vec(), data.into_bytes());
    assert_eq!(all_entries(&log), expected(9..=10, 1));
}

/// The snapshot record written in pieces around the snapshot's data reads back as the same
/// snapshot as one encoded whole, whatever the data's length takes as a varint (one byte up
/// to 127, two from 128, three from 16,384): the very bytes of the whole encoding.
#[test]
fn a_snapshot_record_in_pieces_decodes_as_the_whole_message_does() {
    for len in [0, 1, 127, 128, 300, 16_383, 16_384, 70_000] {
        let data: String = (0..len)
            .map(|n| char::from(b'a' + (n % 26) as u8))
            .collect();
        let snapshot = snapshot(7, 3, &data);
        let record = SnapshotRecord::of(&snapshot).unwrap();
        let bytes: Vec<u8> = record.pieces().concat();
        let records = read_records(Path::new("snapshot"), &bytes).unwrap();
        assert_eq!(records.valid_len, bytes.len(), "{len} bytes of data");
        let [(TAG_SNAPSHOT, body)] = records.records[..] else {
            panic!("{len} bytes of data: not one snapshot record");
        };
        let decoded: Snapshot = decode_message(body, "snapshot").unwrap();
        assert_eq!(decoded, snapshot, "{len} bytes of data");
        let mut whole = Vec::new();
        encode_record(
            TAG_SNAPSHOT,
            &encode_message(&snapshot, "snapshot").unwrap(),
            &mut whole,
        )
        .unwrap();
        assert_eq!(bytes, whole, "{len} bytes of data");
    }
}

/// Keeping a snapshot hands back what it lets go of, for the caller to free off the Raft
/// task: the snapshot it replaces and exactly the entries it covers.
#[test]
fn compacting_hands_back_the_replaced_snapshot_and_the_covered_entries() {
    let indexes = |entries: &[Entry]| entries.iter().map(|entry| entry.index).collect::<Vec<_>>();
    let mut log = MemoryLog::new(vec![1]);
    log.persist(&entries(1..=6, 1), Some(&hard_state(1, 1, 6)))
        .unwrap();

    let first = log.compact(snapshot(2, 1, "state@2")).unwrap();
    assert_eq!(first._snapshot.get_metadata().index, 0);
    assert_eq!(indexes(&first._entries), [1, 2]);

    let second = log.compact(snapshot(5, 1, "state@5")).unwrap();
    assert_eq!(second._snapshot.data.to_vec(), b"state@2");
    assert_eq!(indexes(&second._entries), [3, 4, 5]);
    assert_eq!(all_entries(&log), expected(6..=6, 1));
    assert_eq!(log.snapshot(0, 2).unwrap().data.to_vec(), b"state@5");

    // An older snapshot changes nothing and lets go of nothing.
    let older = log.compact(snapshot(4, 1, "state@4")).unwrap();
    assert!(older._entries.is_empty());
    assert_eq!(older._snapshot.get_metadata().index, 0);
    assert_eq!(all_entries(&log), expected(6..=6, 1));
}

/// A log in `dir` holding entries 1 to 30, all committed.
fn log_of_30_entries(dir: &Path) -> DiskLog {
    let mut log = DiskLog::open(dir, vec![1, 2, 3]).unwrap();
    log.persist(&entries(1..=30, 1), Some(&hard_state(1, 1, 30)))
        .unwrap();
    log
}

/// Prepares the snapshot at `index` of `pieces` joined, keeps it, and moves the log to its
/// next WAL with a write of the hard state (the entries must reach `index`).
fn snapshot_in_pieces(log: &mut DiskLog, index: u64, pieces: &[&str]) -> Prepared {
    let snapshot = snapshot(index, 1, &pieces.concat());
    let pieces: Vec<SnapshotPiece> = pieces
        .iter()
        .map(|piece| SnapshotPiece {
            bytes: piece.as_bytes(),
            hash: xxh3_128(piece.as_bytes()),
        })
        .collect();
    let entries = log
        .entries(
            index + 1,
            log.last_index().unwrap() + 1,
            None,
            GetEntriesContext::empty(false),
        )
        .unwrap();
    let prepared = log
        .snapshot_writer()
        .prepare(&snapshot, &pieces, &entries)
        .unwrap();
    log.compact(snapshot).unwrap();
    log.persist(&[], Some(&hard_state(1, 1, 30))).unwrap();
    prepared
}

/// The piece files in `dir`, by the index of the snapshot that wrote each.
fn piece_files(dir: &Path) -> Vec<u64> {
    let mut files: Vec<u64> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|entry| {
            let name = entry.unwrap().file_name().into_string().unwrap();
            name.strip_prefix(PIECE_FILE_PREFIX)?.parse().ok()
        })
        .collect();
    files.sort_unstable();
    files
}

/// A snapshot in pieces writes only the pieces the store lacks, reads back whole after a
/// reopen, and leaves no piece file its manifest does not name.
#[test]
fn a_snapshot_in_pieces_writes_only_the_pieces_the_store_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c) = ("a".repeat(1_000), "b".repeat(1_000), "c".repeat(1_000));
    {
        let mut log = log_of_30_entries(dir.path());
        let first = snapshot_in_pieces(&mut log, 10, &[&a, &b, &c]);
        assert_eq!(first.written_bytes, 3_000);
        // One piece changed, one repeated: only the new piece is written.
        let second = snapshot_in_pieces(&mut log, 20, &[&a, "B", &c, &a]);
        assert_eq!(second.written_bytes, 1);
        assert_eq!(piece_files(dir.path()), [10, 20]);
    }
    {
        let mut log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
        let snapshot = log.latest_snapshot();
        assert_eq!(snapshot.get_metadata().index, 20);
        assert_eq!(
            snapshot.data.to_vec(),
            [&a, "B", &c, &a].concat().into_bytes()
        );
        assert_eq!(all_entries(&log), expected(21..=30, 1));
        // The store kept where its pieces lie: a reopened log writes only what is new.
        let third = snapshot_in_pieces(&mut log, 25, &[&a, "B", &c, "d"]);
        assert_eq!(third.written_bytes, 1);
        // Nothing shared: every earlier piece file goes.
        let fourth = snapshot_in_pieces(&mut log, 28, &["x", "y"]);
        assert_eq!(fourth.written_bytes, 2);
        assert_eq!(piece_files(dir.path()), [28]);
    }
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert_eq!(log.latest_snapshot().data.to_vec(), b"xy");
    assert_eq!(all_entries(&log), expected(29..=30, 1));
}

/// A piece file less than half of which the snapshot uses is not named again: its pieces are
/// written anew, and it goes; one used at least half stays.
#[test]
fn pieces_in_files_mostly_unused_are_written_anew() {
    let dir = tempfile::tempdir().unwrap();
    let big = "x".repeat(10_000);
    let mut log = log_of_30_entries(dir.path());
    snapshot_in_pieces(&mut log, 10, &[&big, "small"]);
    let prepared = snapshot_in_pieces(&mut log, 20, &["small", "new"]);
    assert_eq!(prepared.written_bytes, 8);
    assert_eq!(piece_files(dir.path()), [20]);
    let prepared = snapshot_in_pieces(&mut log, 25, &["small", "newer"]);
    assert_eq!(prepared.written_bytes, 5);
    assert_eq!(piece_files(dir.path()), [20, 25]);
}

/// A piece whose bytes changed on disk, or a piece file gone, fails the reopen rather than
/// giving raft a wrong state; a piece file no manifest names (a crash before its manifest)
/// is removed.
#[test]
fn a_damaged_or_missing_piece_fails_the_reopen_and_an_unnamed_one_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = log_of_30_entries(dir.path());
        snapshot_in_pieces(&mut log, 10, &["one", "two"]);
    }
    std::fs::write(dir.path().join(piece_file_name(99)), b"left by a crash").unwrap();
    drop(DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap());
    assert_eq!(piece_files(dir.path()), [10]);

    let path = dir.path().join(piece_file_name(10));
    let good = std::fs::read(&path).unwrap();
    let mut damaged = good.clone();
    *damaged.last_mut().unwrap() ^= 1;
    std::fs::write(&path, &damaged).unwrap();
    let error = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap_err();
    assert!(matches!(error, Error::Corrupt { .. }), "{error}");

    std::fs::remove_file(&path).unwrap();
    let error = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap_err();
    assert!(matches!(error, Error::Io { .. }), "{error}");

    std::fs::write(&path, &good).unwrap();
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert_eq!(log.latest_snapshot().data.to_vec(), b"onetwo");
}

/// A snapshot installed from the leader is written whole, and the piece files go.
#[test]
fn an_installed_snapshot_replaces_the_pieces() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = log_of_30_entries(dir.path());
        snapshot_in_pieces(&mut log, 10, &["one", "two"]);
        log.apply_snapshot(snapshot(40, 2, "from the leader"))
            .unwrap();
        assert_eq!(piece_files(dir.path()), Vec::<u64>::new());
    }
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert_eq!(log.latest_snapshot().data.to_vec(), b"from the leader");
}

/// A crash after a build wrote its piece file and before its manifest: the reopened log reads
/// the last manifest, whose older piece files are all still there, and drops the new file.
#[test]
fn a_piece_file_whose_manifest_was_never_written_is_dropped_at_the_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c) = ("a".repeat(100), "b".repeat(100), "c".repeat(100));
    {
        let mut log = log_of_30_entries(dir.path());
        snapshot_in_pieces(&mut log, 10, &[&a, &b]);
        snapshot_in_pieces(&mut log, 20, &[&a, &c]);
        assert_eq!(piece_files(dir.path()), [10, 20]);
    }
    let crashed = dir.path().join(piece_file_name(25));
    std::fs::copy(dir.path().join(piece_file_name(20)), &crashed).unwrap();
    let log = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap();
    assert_eq!(piece_files(dir.path()), [10, 20]);
    assert_eq!(
        log.latest_snapshot().data.to_vec(),
        [a, c].concat().into_bytes()
    );
}

/// Pieces that do not add up to the snapshot's data are refused, and a piece named like a
/// stored one but of another length is written, not taken for it.
#[test]
fn pieces_are_checked_against_the_data_and_the_stored_length() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_of_30_entries(dir.path());
    let writer = log.snapshot_writer();
    let short = SnapshotPiece {
        bytes: b"abc",
        hash: 7,
    };
    let error = writer
        .prepare(&snapshot(10, 1, "abcd"), &[short], &[])
        .unwrap_err();
    assert!(matches!(error, Error::LogInvariant(_)), "{error}");
    assert_eq!(piece_files(dir.path()), Vec::<u64>::new());
    writer
        .prepare(&snapshot(10, 1, "abc"), &[short], &[])
        .unwrap();
    let longer = SnapshotPiece {
        bytes: b"abcd",
        hash: 7,
    };
    let prepared = writer
        .prepare(&snapshot(20, 1, "abcd"), &[longer], &[])
        .unwrap();
    assert_eq!(prepared.written_bytes, 4);
}

/// A manifest that is not one (cut short, or its piece list cut mid-piece) fails the reopen.
#[test]
fn a_damaged_manifest_fails_the_reopen() {
    for manifest in [vec![9, 0], vec![0, 0, 0, 0, 1, 2, 3]] {
        let dir = tempfile::tempdir().unwrap();
        drop(DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap());
        let mut record = Vec::new();
        encode_record(TAG_MANIFEST, &manifest, &mut record).unwrap();
        std::fs::write(dir.path().join(SNAPSHOT_FILE), &record).unwrap();
        let error = DiskLog::open(dir.path(), vec![1, 2, 3]).unwrap_err();
        assert!(
            matches!(error, Error::Corrupt { .. }),
            "{manifest:?}: {error}"
        );
    }
}
