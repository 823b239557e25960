//! A job's sinks: their tasks write into a staging directory beside each sink's directory,
//! and the files are published by the sink's write mode only once the job has succeeded
//! (`floe_engine::write::publish`), so a failed job leaves the directory as it was and an
//! `overwrite` never shows a mix of old and new files.

use std::path::PathBuf;

use floe_core::JobId;
use floe_core::config::{AllowedPaths, PathNotAllowed};
use floe_core::plan::physical::StageKind;
use floe_core::plan::{WriteMode, WriteSpec};

use crate::plan::Planned;

/// Why a sink cannot be staged or published.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SinkError {
    /// Nodes refuse such a sink's tasks, and the driver moves no file there either (a sink
    /// with no task would otherwise be published unchecked).
    #[error(transparent)]
    NotAllowed(#[from] PathNotAllowed),
    #[error(transparent)]
    Write(#[from] floe_engine::Error),
}

/// One sink as the user asked for it, and where its tasks write meanwhile.
pub(crate) struct StagedSink {
    target: WriteSpec,
    staging: PathBuf,
    token: String,
}

/// Points every sink of `planned` at a staging directory of its own, after checking that an
/// `error`-mode sink's directory holds no files yet (the client checked at submission, but the
/// directory may have filled since). `started_ms` tells one submission of a job from another.
pub(crate) fn stage_sinks(
    planned: &mut Planned,
    allowed: &AllowedPaths,
    job: JobId,
    attempt: u32,
    started_ms: u128,
) -> Result<Vec<StagedSink>, SinkError> {
    let token = format!("job{job}-{attempt}-{started_ms:x}");
    let mut sinks = Vec::new();
    for operator in &mut planned.operators {
        let spec = match (&mut operator.stage.kind, &mut operator.sink) {
            (StageKind::Write(spec), _) | (_, Some(spec)) => spec,
            _ => continue,
        };
        let staging = floe_engine::write::staging_directory(&spec.directory, &token);
        allowed.check(&spec.directory)?;
        allowed.check(&staging)?;
        if spec.mode == WriteMode::Error {
            floe_engine::write::check_empty(&spec.directory)?;
        }
        sinks.push(StagedSink {
            target: spec.clone(),
            staging: staging.clone(),
            token: token.clone(),
        });
        spec.directory = staging;
    }
    Ok(sinks)
}

/// Publishes every sink's files; the first failure is the job's.
pub(crate) fn publish(sinks: &[StagedSink]) -> Result<(), floe_engine::Error> {
    for sink in sinks {
        floe_engine::write::publish(&sink.target, &sink.staging, &sink.token)?;
    }
    Ok(())
}

/// Removes what a failed or cancelled job staged.
pub(crate) fn discard(sinks: &[StagedSink]) {
    for sink in sinks {
        floe_engine::write::discard(&sink.staging);
    }
}
