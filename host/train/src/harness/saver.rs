//! The run loop's side of saving checkpoints.

use super::RunDir;
use crate::checkpoint::{CheckpointError, Checkpointer, ShardedCheckpointer, Snapshot};
use crate::{Console, TrainError};
use anneal_config::JobConfig;
use anneal_dist::Collective;
use std::path::Path;
use std::time::Instant;

/// Saves a run's checkpoints into `<run_dir>/checkpoints` as `checkpoint.*` configures: every
/// `interval` steps and at the last one, in the background or inline. A failed save fails the
/// run ([`CheckpointError::SaveFailed`]) as soon as it is known, so a run never goes on as if
/// its progress were safe.
pub struct Saver {
    checkpointer: Checkpointer,
    interval: u64,
    total: u64,
}

impl Saver {
    /// The saver of `run` for a run of `training.steps` steps.
    pub fn new(cfg: &JobConfig, run: &RunDir) -> Saver {
        let ck = &cfg.checkpoint;
        Saver {
            checkpointer: Checkpointer::new(
                run.path().join("checkpoints"),
                ck.keep_latest,
                ck.async_save,
            ),
            interval: ck.interval,
            total: cfg.training.steps,
        }
    }

    /// Whether step `step` is saved: every `checkpoint.interval` steps and at the last one.
    pub fn due(&self, step: u64) -> bool {
        is_due(self.interval, self.total, step)
    }

    /// Saves step `step` when [`Saver::due`], with the snapshot `capture` builds.
    pub fn save_if_due(
        &mut self,
        step: u64,
        console: &Console,
        capture: impl FnOnce(Vec<Vec<u8>>) -> Snapshot,
    ) -> Result<(), TrainError> {
        if self.due(step) {
            self.save(step, console, capture)?;
        }
        Ok(())
    }

    /// Hands the snapshot `capture` builds (of step `step`) to the checkpointer and notes how
    /// long the step was blocked. The previous save's failure is returned instead.
    pub fn save(
        &mut self,
        step: u64,
        console: &Console,
        capture: impl FnOnce(Vec<Vec<u8>>) -> Snapshot,
    ) -> Result<(), TrainError> {
        let started = Instant::now();
        let previous = self.checkpointer.last_saved();
        let report = self
            .checkpointer
            .save(capture)
            .map_err(|e| save_failed(step, e.to_string()))?;
        if let Some(reason) = report.previous_failed {
            return Err(save_failed(previous.unwrap_or(step), reason));
        }
        let blocked = started.elapsed().as_secs_f64();
        let waited = if report.waited_s > 0.01 {
            format!(
                ", {:.2}s of it waiting for the previous save",
                report.waited_s
            )
        } else {
            String::new()
        };
        console.note(&format!(
            "checkpoint: step {step} saving; training blocked {blocked:.3}s{waited}"
        ));
        Ok(())
    }

    /// Ends a run's checkpointing: a run stopped on request after completing steps since
    /// `resumed_from` saves step `step` unless that step is saved already; then the save in
    /// flight is waited for, and its failure fails the run.
    pub fn finish(
        &mut self,
        stopped: bool,
        step: u64,
        resumed_from: u64,
        console: &Console,
        capture: impl FnOnce(Vec<Vec<u8>>) -> Snapshot,
    ) -> Result<(), TrainError> {
        if stopped && step > resumed_from && self.checkpointer.last_saved() != Some(step) {
            self.save(step, console, capture)?;
        }
        let last = self.checkpointer.last_saved();
        match self.checkpointer.wait() {
            Some(reason) => Err(save_failed(last.unwrap_or(step), reason)),
            None => Ok(()),
        }
    }
}

/// [`Saver`] for one rank of a sharded (FSDP / HSDP) run's writing group: each rank writes its
/// own shard of every save, and rank 0 of `comm` (the job's rank 0) publishes the step once it
/// has every rank's piece. Every method is collective over the group's `comm`.
pub struct ShardSaver {
    checkpointer: ShardedCheckpointer,
    interval: u64,
    total: u64,
}

impl ShardSaver {
    /// The saver into `<run_dir>/checkpoints`; `tag` (the same on every rank of the job) names
    /// the saves' temporary directories.
    pub fn new(cfg: &JobConfig, run_dir: &Path, tag: String) -> ShardSaver {
        let ck = &cfg.checkpoint;
        ShardSaver {
            checkpointer: ShardedCheckpointer::new(
                run_dir.join("checkpoints"),
                ck.keep_latest,
                ck.async_save,
                tag,
            ),
            interval: ck.interval,
            total: cfg.training.steps,
        }
    }

    /// The saver of one rank of `group` (the ranks writing a checkpoint together): rank 0's
    /// tag for the saves' temporary directories is broadcast, so every rank writes into the
    /// same one. Collective over `group`.
    pub fn for_group(
        cfg: &JobConfig,
        run_dir: &Path,
        group: &dyn Collective,
    ) -> Result<ShardSaver, TrainError> {
        let mut tag = tag_seed().to_le_bytes();
        group.broadcast(&mut tag, 0)?;
        let tag = u64::from_le_bytes(tag);
        Ok(ShardSaver::new(cfg, run_dir, format!("{tag:016x}")))
    }

    /// Whether step `step` is saved (as [`Saver::due`]).
    pub fn due(&self, step: u64) -> bool {
        is_due(self.interval, self.total, step)
    }

    /// At the end of step `step`: publishes a save whose writes have all ended, then saves
    /// `step` when it is due (as [`Saver::due`]).
    pub fn step_end(
        &mut self,
        step: u64,
        comm: &dyn Collective,
        console: &Console,
        capture: impl FnOnce(Vec<Vec<u8>>) -> Snapshot,
    ) -> Result<(), TrainError> {
        if let Some(dir) = self.checkpointer.publish_when_written(comm)? {
            console.note(&format!("checkpoint: {} published", dir.display()));
        }
        if is_due(self.interval, self.total, step) {
            self.save(step, comm, console, capture)?;
        }
        Ok(())
    }

    fn save(
        &mut self,
        step: u64,
        comm: &dyn Collective,
        console: &Console,
        capture: impl FnOnce(Vec<Vec<u8>>) -> Snapshot,
    ) -> Result<(), TrainError> {
        let report = self.checkpointer.save(comm, capture)?;
        console.note(&format!(
            "checkpoint: step {step} saving its shard {} of {}; training blocked {:.3}s",
            comm.rank(),
            comm.size(),
            report.blocked_s
        ));
        Ok(())
    }

    /// As [`Saver::finish`]: a stopped run saves its last step unless saved already; then the
    /// save in flight is written and published.
    pub fn finish(
        &mut self,
        stopped: bool,
        step: u64,
        resumed_from: u64,
        comm: &dyn Collective,
        console: &Console,
        capture: impl FnOnce(Vec<Vec<u8>>) -> Snapshot,
    ) -> Result<(), TrainError> {
        if stopped && step > resumed_from && self.checkpointer.last_saved() != Some(step) {
            self.save(step, comm, console, capture)?;
        }
        if let Some(dir) = self.checkpointer.wait(comm)? {
            console.note(&format!("checkpoint: {} published", dir.display()));
        }
        Ok(())
    }
}

/// A value for the name of a save's temporary directories, unique to this process and moment.
fn tag_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ u64::from(std::process::id()).rotate_left(40)
}

/// Every `interval` steps (none for 0) and at the last one, `total`.
fn is_due(interval: u64, total: u64, step: u64) -> bool {
    (interval > 0 && step.is_multiple_of(interval)) || step == total
}

fn save_failed(step: u64, reason: String) -> TrainError {
    TrainError::Checkpoint(CheckpointError::SaveFailed { step, reason })
}
