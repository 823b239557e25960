//! The agent's side of a task's outputs: objects created in the node's store for a worker to
//! write in place, held unsealed while it writes, and sealed when it says it is done.
//!
//! The agent never touches an output's bytes. It creates each object at the size the worker
//! measured, hands the worker the location, and keeps the object's writer: while the writer
//! lives the range stays the object's, even if the object is deleted meanwhile, so nothing can
//! be allocated over memory a live worker may still write. The writers are dropped (the objects
//! abandoned, their memory freed) when the task fails — and only once its worker has stopped
//! writing: it said so, or it is dead. An output an earlier run of the task left in the store
//! stays as it is (tasks are deterministic) and is not written again.

use floe_api::node_protocol::{OutputRef, TaskFailure, output_id};
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
            match self.store.create(object, size) {
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
                    // One an earlier run still writes is not there yet: a later retry finds it.
                    self.present(object, !output.parts.is_empty())
                        .map(|(size, checksum)| (object, size, checksum, false))
                        .ok_or_else(|| TaskFailure::Transient {
                            message: format!("output {object} is not readable in the store"),
                        })
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

    /// The size and checksum of an output an earlier run stored (a packed one's parts carry
    /// theirs: it is not hashed whole).
    fn present(&self, object: ObjectId, packed: bool) -> Option<(u64, Option<u64>)> {
        if packed {
            let view = self.store.get(object).ok()?;
            return Some((view.len() as u64, self.store.checksum(object)));
        }
        let (size, checksum) = self.store.size_and_checksum(object).ok()?;
        Some((size, Some(checksum)))
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
