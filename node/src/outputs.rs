//! The agent's side of a task's outputs: objects created in the node's store for a worker to
//! write in place, held unsealed while it writes, and sealed when it says it is done.
//!
//! The agent never touches an output's bytes. It creates each object at the size the worker
//! measured, hands the worker the location, and keeps the object's writer: while the writer
//! lives the range stays the object's, even if the object is deleted meanwhile, so nothing can
//! be allocated over memory a live worker may still write. The writers are dropped (the objects
//! abandoned, their memory freed) when the task fails — and only once its worker has stopped
//! writing: it said so, or it is dead. An output an earlier run of the task left in the store
//! stays as it is (tasks are deterministic) and is not written again; a packed one is checked
//! against this run's parts first, since readers find each part by this run's table.

use floe_api::node_protocol::{OutputRef, Part, TaskFailure, output_id};
use floe_core::hash::xxh3_64;
use floe_core::{ObjectId, TaskId};
use floe_objectstore::{ObjectStore, ObjectWriter};

use crate::worker::{OutputPlace, WrittenOutput};

/// One task's outputs, from the sizes its worker measured to the sealed objects.
pub(crate) struct TaskOutputs {
    store: ObjectStore,
    task: TaskId,
    slots: Vec<Slot>,
}

enum Slot {
    /// Created here, being written by the worker.
    Writing(ObjectWriter),
    /// Left by an earlier run; `revived` if it had been deleted and this run brought it back
    /// (so a failure deletes it again).
    Present { object: ObjectId, revived: bool },
}

impl TaskOutputs {
    pub(crate) fn new(store: ObjectStore, task: TaskId) -> Self {
        Self {
            store,
            task,
            slots: Vec::new(),
        }
    }

    /// Makes room for outputs of `sizes` bytes: output `i` is object `output_id(task, i)`.
    /// Returns where the worker writes each, or why the store has none (then nothing stays).
    pub(crate) fn make_room(&mut self, sizes: &[u64]) -> Result<Vec<OutputPlace>, TaskFailure> {
        if !self.slots.is_empty() {
            let message = "the worker asked for room for its outputs twice".into();
            return Err(self.abandon(TaskFailure::Error { message }));
        }
        let mut places = Vec::with_capacity(sizes.len());
        for (index, &size) in sizes.iter().enumerate() {
            let object = u32::try_from(index)
                .map(|index| output_id(self.task, index))
                .map_err(|_| {
                    let message = "a task made more than 2^32 outputs".into();
                    self.abandon(TaskFailure::Error { message })
                })?;
            // A rebuilt task's outputs keep their ids. A copy still here from an earlier run
            // (the driver thought it lost, or a task here still reads it) holds the same bytes.
            if self.store.contains(object) {
                self.slots.push(Slot::Present {
                    object,
                    revived: false,
                });
                places.push(OutputPlace::Present);
                continue;
            }
            if self.store.revive(object) {
                self.slots.push(Slot::Present {
                    object,
                    revived: true,
                });
                places.push(OutputPlace::Present);
                continue;
            }
            match self.store.create_for_another_process(object, size) {
                Ok(writer) => {
                    places.push(OutputPlace::Write(writer.location()));
                    self.slots.push(Slot::Writing(writer));
                }
                // A deleted object whose last writer is still finishing keeps its name until
                // then: a retry a moment later finds it free.
                Err(error @ floe_objectstore::Error::AlreadyExists { .. }) => {
                    let message = format!("cannot store output {index} yet: {error}");
                    return Err(self.abandon(TaskFailure::Transient { message }));
                }
                Err(error) => {
                    let message = format!("cannot store output {index}: {error}");
                    return Err(self.abandon(TaskFailure::Error { message }));
                }
            }
        }
        Ok(places)
    }

    /// Seals what the worker wrote and answers each output's reference. On failure nothing
    /// this run stored stays.
    pub(crate) fn seal(mut self, written: &[WrittenOutput]) -> Result<Vec<OutputRef>, TaskFailure> {
        if written.len() != self.slots.len() {
            let message = format!(
                "the worker finished {} outputs of {}",
                written.len(),
                self.slots.len()
            );
            return Err(self.abandon(TaskFailure::Error { message }));
        }
        let mut refs = Vec::with_capacity(written.len());
        // Outputs sealed or revived so far, deleted again if a later one fails.
        let mut kept = Vec::new();
        let mut slots = std::mem::take(&mut self.slots).into_iter();
        for output in written {
            let Some(slot) = slots.next() else {
                break;
            };
            let sealed = match slot {
                Slot::Writing(writer) => {
                    let object = writer.object();
                    let size = writer.location().len;
                    // A packed object is hashed part by part, not whole.
                    let sealed = match (output.checksum, output.parts.is_empty()) {
                        (Some(checksum), _) => writer.seal_with_checksum(checksum),
                        (None, false) => writer.seal(),
                        (None, true) => Err(floe_objectstore::Error::NotSealed { object }),
                    };
                    sealed
                        .map(|()| (object, size, output.checksum, true))
                        .map_err(|error| TaskFailure::Transient {
                            message: format!("cannot seal output {object}: {error}"),
                        })
                }
                Slot::Present { object, revived } => {
                    if revived {
                        kept.push(object);
                    }
                    self.present(object, &output.parts)
                        .map(|(size, checksum)| (object, size, checksum, false))
                }
            };
            match sealed {
                Ok((object, size, checksum, sealed_here)) => {
                    if sealed_here {
                        kept.push(object);
                    }
                    refs.push(OutputRef {
                        object,
                        size,
                        checksum,
                        rows: output.rows,
                        parts: output.parts.clone(),
                    });
                }
                Err(failure) => {
                    self.slots = slots.collect();
                    self.delete(&kept);
                    return Err(self.abandon(failure));
                }
            }
        }
        Ok(refs)
    }

    /// The size and checksum of an output an earlier run stored. A packed one is not hashed
    /// whole: each part this run made must lie in it and hash the same. If not (the stored
    /// copy was damaged, or the task does not make the same bytes twice), a reader of the
    /// parts this run reports would read other bytes: the stored copy is deleted (readers
    /// holding it keep it until they are done) and the task fails to be retried, which writes
    /// this run's bytes.
    fn present(&self, object: ObjectId, parts: &[Part]) -> Result<(u64, Option<u64>), TaskFailure> {
        // One an earlier run still writes is not there yet: a later retry finds it.
        let unreadable = || TaskFailure::Transient {
            message: format!("output {object} is not readable in the store"),
        };
        if parts.is_empty() {
            let (size, checksum) = self
                .store
                .size_and_checksum(object)
                .map_err(|_| unreadable())?;
            return Ok((size, Some(checksum)));
        }
        let view = self.store.get(object).map_err(|_| unreadable())?;
        let bytes = view.as_bytes();
        let same = |part: &Part| {
            let start = usize::try_from(part.offset).ok()?;
            let end = start.checked_add(usize::try_from(part.len).ok()?)?;
            Some(xxh3_64(bytes.get(start..end)?) == part.checksum)
        };
        if let Some(index) = parts.iter().position(|part| same(part) != Some(true)) {
            drop(view);
            self.delete(&[object]);
            let message = format!(
                "output {object}, stored by an earlier run of the task, differs from this \
                 run's in part {index}; deleted, to be written again"
            );
            return Err(TaskFailure::Transient { message });
        }
        Ok((bytes.len() as u64, self.store.checksum(object)))
    }

    /// Drops what this run stored and has not sealed (its writers, the objects it revived),
    /// and returns `failure`.
    fn abandon(&mut self, failure: TaskFailure) -> TaskFailure {
        let revived: Vec<ObjectId> = std::mem::take(&mut self.slots)
            .into_iter()
            .filter_map(|slot| match slot {
                Slot::Present {
                    object,
                    revived: true,
                } => Some(object),
                Slot::Present { .. } | Slot::Writing(_) => None,
            })
            .collect();
        self.delete(&revived);
        failure
    }

    fn delete(&self, objects: &[ObjectId]) {
        for object in objects {
            match self.store.delete(*object) {
                Ok(()) | Err(floe_objectstore::Error::NotFound { .. }) => {}
                Err(error) => tracing::warn!(%object, %error, "cannot delete an output"),
            }
        }
    }
}

/// A task that ends without sealing its outputs leaves none of those it stored.
impl Drop for TaskOutputs {
    fn drop(&mut self) {
        if !self.slots.is_empty() {
            self.abandon(TaskFailure::Cancelled);
        }
    }
}

#[cfg(test)]
mod tests {
    use floe_objectstore::{Backing, StoreConfig};

    use super::*;

    fn store(dir: &std::path::Path) -> ObjectStore {
        let config = StoreConfig {
            name: "outputs-unit".into(),
            capacity: 1 << 20,
            spill_threshold: 1.0,
            min_spilling_size: 1 << 20,
            spill_dir: dir.join("spill"),
            fallback_dir: dir.join("fallback"),
        };
        ObjectStore::open_with(config, Backing::Heap).unwrap()
    }

    fn part(bytes: &[u8], offset: usize, len: usize) -> Part {
        Part {
            offset: offset as u64,
            len: len as u64,
            rows: 1,
            checksum: xxh3_64(&bytes[offset..offset + len]),
        }
    }

    #[test]
    fn a_packed_output_an_earlier_run_stored_is_kept_only_if_its_parts_match_this_runs() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let task = TaskId::new(9);
        let object = output_id(task, 0);
        let stored = b"first partition.second one";
        store.put(object, stored).unwrap();
        let rerun = |parts: Vec<Part>| {
            let mut outputs = TaskOutputs::new(store.clone(), task);
            let places = outputs.make_room(&[stored.len() as u64]).unwrap();
            assert!(matches!(places[..], [OutputPlace::Present]));
            outputs.seal(&[WrittenOutput {
                rows: Some(2),
                checksum: None,
                parts,
            }])
        };

        let same = vec![part(stored, 0, 16), part(stored, 16, 10)];
        let refs = rerun(same.clone()).unwrap();
        assert_eq!(
            (refs[0].object, refs[0].size),
            (object, stored.len() as u64)
        );
        assert_eq!(refs[0].parts, same);

        // This run laid its rows out otherwise: its parts are not the stored bytes, or lie
        // past their end.
        let other = b"second one......first partition";
        let past_the_end = Part {
            offset: 20,
            ..part(stored, 16, 10)
        };
        for parts in [
            vec![part(other, 0, 10), part(other, 16, 10)],
            vec![part(stored, 0, 16), past_the_end],
        ] {
            if !store.contains(object) {
                store.put(object, stored).unwrap();
            }
            let reader = store.get(object).unwrap();
            let failure = rerun(parts).unwrap_err();
            assert!(
                matches!(&failure, TaskFailure::Transient { message } if message.contains("differs")),
                "{failure:?}"
            );
            // The stale copy is gone for new readers; one that held it still reads it whole.
            assert!(!store.contains(object));
            assert_eq!(reader.as_bytes(), stored);
            drop(reader);
            // The retry finds no copy and writes its own.
            let mut outputs = TaskOutputs::new(store.clone(), task);
            let places = outputs.make_room(&[other.len() as u64]).unwrap();
            assert!(matches!(places[..], [OutputPlace::Write(_)]), "{places:?}");
        }
    }
}
