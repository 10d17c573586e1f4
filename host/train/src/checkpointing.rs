//! The run loop's side of checkpoints, shared by `anneal train` and `anneal rl`: resuming a run
//! dir from its newest usable checkpoint, keeping `metrics.jsonl` in step with it, saving with a
//! report of how long the step was blocked, and the save of a stopped run.

use crate::checkpoint::{
    load_latest, remove_stale_tmp, CheckpointError, Checkpointer, Loaded, Snapshot,
};
use crate::metrics::Console;
use crate::{io_err, TrainError};
use anneal_config::JobConfig;
use std::path::Path;
use std::time::Instant;

/// Where a run starts: the step of the checkpoint it resumed from and the seconds trained before
/// it (both 0 for a fresh start).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Resumed {
    /// Steps completed by the checkpoint.
    pub step: u64,
    /// Seconds of training (over every earlier process of the run) up to that step.
    pub elapsed_s: f64,
}

/// The checkpointer of `run_dir` as `cfg.checkpoint` configures it.
pub fn checkpointer(cfg: &JobConfig, run_dir: &Path) -> Checkpointer {
    let ck = &cfg.checkpoint;
    Checkpointer::new(run_dir.join("checkpoints"), ck.keep_latest, ck.async_save)
}

/// Whether step `step` of a run of `total` steps is saved: every `checkpoint.interval` steps and
/// at the last one.
pub fn save_due(cfg: &JobConfig, step: u64, total: u64) -> bool {
    let interval = cfg.checkpoint.interval;
    (interval > 0 && step.is_multiple_of(interval)) || step == total
}

/// Copies the run's tokenizer to `<run_dir>/tokenizer.json` (what `anneal checkpoint export` and a
/// later `rl.init_from` find next to the checkpoints); nothing to do when it already is that file.
pub fn keep_tokenizer(tokenizer: &Path, run_dir: &Path) -> Result<(), TrainError> {
    let copy = run_dir.join("tokenizer.json");
    let same = match (tokenizer.canonicalize(), copy.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if !same {
        std::fs::copy(tokenizer, &copy).map_err(io_err(&copy))?;
    }
    Ok(())
}

/// Resumes the run in `run_dir`: removes saves left incomplete by a killed process, loads the
/// newest usable checkpoint (or `checkpoint.load_step`; damaged ones are skipped with a note,
/// and with none usable the run fails unless `checkpoint.allow_fresh_start`), hands it to
/// `restore`, and drops the metric rows a process wrote after it. A fresh start drops every row
/// of an earlier attempt.
pub fn resume(
    cfg: &JobConfig,
    run_dir: &Path,
    console: &Console,
    restore: impl FnOnce(Loaded) -> Result<(), TrainError>,
) -> Result<Resumed, TrainError> {
    let root = run_dir.join("checkpoints");
    for name in remove_stale_tmp(&root) {
        console.note(&format!("checkpoint: removed the incomplete save {name}"));
    }
    let loaded = match load_latest(&root, cfg.checkpoint.load_step, &|m| console.note(m)) {
        Ok(l) => l,
        Err(e @ CheckpointError::NoneUsable { .. }) if cfg.checkpoint.allow_fresh_start => {
            console.note(&format!(
                "{e}: starting fresh (checkpoint.allow_fresh_start)"
            ));
            None
        }
        Err(e) => return Err(e.into()),
    };
    let Some(loaded) = loaded else {
        let dropped = keep_metrics_up_to(run_dir, None)?;
        if dropped > 0 {
            console.note(&format!(
                "metrics: dropped {dropped} row(s) of an earlier attempt without checkpoints"
            ));
        }
        return Ok(Resumed::default());
    };
    let resumed = Resumed {
        step: loaded.state.step,
        elapsed_s: loaded.state.elapsed_s,
    };
    console.note(&format!(
        "resuming from {} (step {})",
        loaded.dir.display(),
        resumed.step
    ));
    restore(loaded)?;
    keep_metrics_up_to(run_dir, Some(resumed.step))?;
    Ok(resumed)
}

/// Drops the rows of `metrics.jsonl` (and of an RL run's `samples.jsonl`) past `step` (all of
/// them for `None`), written after the checkpoint by a run that then died, so the resumed curve
/// continues without duplicates. Rewrites the files atomically; returns how many metric rows it
/// dropped.
pub fn keep_metrics_up_to(run_dir: &Path, step: Option<u64>) -> Result<usize, TrainError> {
    keep_rows_up_to(&run_dir.join("samples.jsonl"), step)?;
    keep_rows_up_to(&run_dir.join("metrics.jsonl"), step)
}

/// Keeps the JSON lines of `path` whose `step` is at most `step` (none for `None`); a missing
/// file is left missing. Returns how many rows it dropped.
fn keep_rows_up_to(path: &Path, step: Option<u64>) -> Result<usize, TrainError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(0);
    };
    let mut dropped = 0;
    let kept: String = text
        .lines()
        .filter(|l| {
            let keep = step.is_some_and(|step| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s <= step)
            });
            dropped += usize::from(!keep && !l.trim().is_empty());
            keep
        })
        .flat_map(|l| [l, "\n"])
        .collect();
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, kept).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    Ok(dropped)
}

/// Hands the snapshot `capture` builds (of step `step`) to the checkpointer, and notes how long
/// the step was blocked and whether the previous background save failed.
pub fn save(
    checkpointer: &mut Checkpointer,
    step: u64,
    console: &Console,
    capture: impl FnOnce(Vec<Vec<u8>>) -> Snapshot,
) -> Result<(), TrainError> {
    let started = Instant::now();
    let report = checkpointer.save(capture)?;
    if let Some(e) = report.previous_failed {
        console.note(&format!("checkpoint: the previous save failed: {e}"));
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
/// `resumed_from` saves step `step` unless that step is saved already; then the save in flight
/// is waited for, and its failure fails the run.
pub fn save_at_exit(
    checkpointer: &mut Checkpointer,
    stopped: bool,
    step: u64,
    resumed_from: u64,
    console: &Console,
    capture: impl FnOnce(Vec<Vec<u8>>) -> Snapshot,
) -> Result<(), TrainError> {
    if stopped && step > resumed_from && checkpointer.last_saved() != Some(step) {
        save(checkpointer, step, console, capture)?;
    }
    match checkpointer.wait() {
        Some(e) => Err(TrainError::Checkpoint(CheckpointError::Mismatch(format!(
            "the last save failed: {e}"
        )))),
        None => Ok(()),
    }
}
