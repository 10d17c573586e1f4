//! Resuming a run from its newest usable checkpoint, with the checks every run makes before
//! anything of the run directory changes.

use super::RunDir;
use crate::checkpoint::{
    load_latest_with, remove_stale_tmp, CheckpointError, Contents, Loaded, TrainState,
};
use crate::{io_err, Console, TrainError};
use anneal_config::JobConfig;
use anneal_engine::Tensor;
use anneal_runtime::plugins::{PluginModel, PluginOptimizer};
use std::ops::Range;
use std::path::Path;

/// The files of a run directory with one JSON row per step (`{"step": N, ...}`), cut back to
/// the checkpoint's step on resume so curves continue without duplicates.
pub const STEP_LOGS: [&str; 2] = ["metrics.jsonl", "samples.jsonl"];

/// Which command a checkpoint belongs to: a run resumes only from its own kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunKind {
    /// `anneal train`.
    Train,
    /// `anneal rl`.
    Rl,
}

/// What a run trains on, recorded in each of its checkpoints and compared on resume: hex
/// SHA-256 digests of the tokenizer and of the data.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Provenance {
    /// Of the tokenizer's JSON form ([`anneal_data::TextTokenizer::sha256`]).
    pub tokenizer_sha256: String,
    /// Of the data (the tokenized training stream, or an RL run's prompts).
    pub data_sha256: String,
}

impl Provenance {
    /// Writes the digests into a checkpoint's train state.
    pub fn stamp(&self, state: &mut TrainState) {
        state.tokenizer_sha256 = Some(self.tokenizer_sha256.clone());
        state.data_sha256 = Some(self.data_sha256.clone());
    }

    /// Refuses a checkpoint trained with another tokenizer or on other data, unless the config
    /// allows it (`checkpoint.allow_tokenizer_change`, `checkpoint.allow_data_change`).
    /// Checkpoints from before the digests were recorded pass with a note.
    fn check(&self, cfg: &JobConfig, ckpt: &Loaded, note: &dyn Fn(&str)) -> Result<(), TrainError> {
        let ck = &cfg.checkpoint;
        let pairs = [
            (
                "tokenizer",
                &ckpt.state.tokenizer_sha256,
                &self.tokenizer_sha256,
                ck.allow_tokenizer_change,
                "checkpoint.allow_tokenizer_change",
            ),
            (
                "data",
                &ckpt.state.data_sha256,
                &self.data_sha256,
                ck.allow_data_change,
                "checkpoint.allow_data_change",
            ),
        ];
        for (what, saved, now, allowed, key) in pairs {
            match saved {
                None => note(&format!(
                    "checkpoint: {} records no {what} hash; not compared",
                    ckpt.dir.display()
                )),
                Some(saved) if saved != now && allowed => note(&format!(
                    "checkpoint: the {what} differs from the checkpoint's; resuming anyway ({key})"
                )),
                Some(saved) if saved != now => {
                    return Err(mismatch(
                        ckpt,
                        format!(
                            "it was trained with another {what} (sha256 {} here, {} in the \
                             checkpoint); use the run's own {what}, a new --run-dir, or set \
                             {key} = true",
                            short(now),
                            short(saved)
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

fn short(hex: &str) -> &str {
    &hex[..hex.len().min(12)]
}

fn mismatch(ckpt: &Loaded, m: String) -> TrainError {
    TrainError::Checkpoint(CheckpointError::Mismatch(format!(
        "{}: {m}",
        ckpt.dir.display()
    )))
}

/// Where a run starts: the step of the checkpoint it resumed from and the seconds trained before
/// it (both 0 for a fresh start).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Resumed {
    /// Steps completed by the checkpoint.
    pub step: u64,
    /// Seconds of training (over every earlier process of the run) up to that step.
    pub elapsed_s: f64,
}

/// Resumes the run in `run`: removes saves left incomplete by a killed process, loads the
/// newest usable checkpoint (or `checkpoint.load_step`; damaged ones are skipped with a note,
/// and with none usable the run fails unless `checkpoint.allow_fresh_start`), checks that it
/// is a checkpoint of this kind of run with this seed, tokenizer and data, hands it to
/// `restore`, and cuts the step logs back to it. A fresh start drops every row of an earlier
/// attempt. Nothing of the run directory but incomplete saves changes before the checks pass.
pub fn resume(
    cfg: &JobConfig,
    run: &RunDir,
    kind: RunKind,
    provenance: &Provenance,
    console: &Console,
    restore: impl FnOnce(Loaded) -> Result<(), TrainError>,
) -> Result<Resumed, TrainError> {
    resume_with(cfg, run, kind, provenance, console, Contents::All, restore)
}

/// [`resume`] loading the checkpoint as `contents` says: an FSDP rank reads its rows on demand
/// ([`Contents::OnDemand`]) rather than every tensor whole.
pub fn resume_with(
    cfg: &JobConfig,
    run: &RunDir,
    kind: RunKind,
    provenance: &Provenance,
    console: &Console,
    contents: Contents,
    restore: impl FnOnce(Loaded) -> Result<(), TrainError>,
) -> Result<Resumed, TrainError> {
    let root = run.path().join("checkpoints");
    for name in remove_stale_tmp(&root) {
        console.note(&format!("checkpoint: removed the incomplete save {name}"));
    }
    let loaded = match load_latest_with(
        &root,
        cfg.checkpoint.load_step,
        &|m| console.note(m),
        contents,
    ) {
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
        let dropped = truncate_step_logs(run.path(), None)?;
        if dropped > 0 {
            console.note(&format!(
                "metrics: dropped {dropped} row(s) of an earlier attempt without checkpoints"
            ));
        }
        return Ok(Resumed::default());
    };
    match (kind, loaded.state.rl.is_some()) {
        (RunKind::Train, true) => {
            return Err(mismatch(
                &loaded,
                "a checkpoint of an RL run (`anneal rl`); start `anneal train` from it through \
                 `anneal checkpoint export --to-hf` and checkpoint.init_from_hf"
                    .into(),
            ))
        }
        (RunKind::Rl, false) => {
            return Err(mismatch(
                &loaded,
                "a checkpoint of `anneal train`, not of an RL run; start RL from it with \
                 rl.init_from in a new run dir"
                    .into(),
            ))
        }
        _ => {}
    }
    if loaded.state.seed != cfg.training.seed {
        return Err(mismatch(
            &loaded,
            format!(
                "saved with training.seed = {}, the config has {}",
                loaded.state.seed, cfg.training.seed
            ),
        ));
    }
    provenance.check(cfg, &loaded, &|m| console.note(m))?;
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
    truncate_step_logs(run.path(), Some(resumed.step))?;
    Ok(resumed)
}

/// Which dim-0 rows of a checkpoint tensor a rank keeps, given its global name and whole
/// shape: `None` keeps it whole.
pub type RowsOf<'a> = &'a dyn Fn(&str, &[usize]) -> Option<Range<usize>>;

/// The parameters `model` declares, read from `<prefix>/<name>` of `ckpt` with their shapes and
/// dtypes checked, sorted by name (the fixed order of norms and updates), detached.
pub fn params_from_checkpoint(
    ckpt: &Loaded,
    model: &PluginModel,
    prefix: &str,
) -> Result<Vec<(String, Tensor)>, TrainError> {
    params_of_rows_from_checkpoint(ckpt, model, prefix, &|_| true, &|_, _| None)
}

/// [`params_from_checkpoint`] of the parameters `keep` picks by name (a pipeline rank's
/// stages), keeping of each the rows `rows` picks (an FSDP rank's shard), read from whichever
/// of the checkpoint's shards hold them; the others are neither read nor checked.
pub fn params_of_rows_from_checkpoint(
    ckpt: &Loaded,
    model: &PluginModel,
    prefix: &str,
    keep: &dyn Fn(&str) -> bool,
    rows: RowsOf<'_>,
) -> Result<Vec<(String, Tensor)>, TrainError> {
    let spec = model.spec();
    let mut named = Vec::with_capacity(spec.params.len());
    for p in spec.params.iter().filter(|p| keep(&p.name)) {
        let key = format!("{prefix}/{}", p.name);
        let (shape, dtype) = ckpt
            .describe(&key)
            .ok_or_else(|| mismatch(ckpt, format!("no tensor {key}")))?;
        // Training keeps f32 masters of a model declared in bf16 or f16 (`f32_masters`).
        let master = dtype == "f32" && matches!(p.dtype.as_str(), "bf16" | "f16");
        if shape != p.shape.as_slice() || (dtype != p.dtype && !master) {
            return Err(mismatch(
                ckpt,
                format!(
                    "{key} is {dtype} {shape:?}, the model wants {} {:?}",
                    p.dtype, p.shape
                ),
            ));
        }
        let t = match rows(&p.name, shape) {
            Some(r) => ckpt.rows(&key, r)?,
            None => ckpt.tensor(&key)?,
        };
        named.push((p.name.clone(), t.detach()));
    }
    named.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(named)
}

/// Loads the optimizer state `optim/<param>.<state>` of `ckpt` into `optimizer` for `named`
/// (whole parameters: every tensor read whole).
pub fn restore_optimizer(
    ckpt: &Loaded,
    named: &[(String, Tensor)],
    optimizer: &mut PluginOptimizer,
) -> Result<(), TrainError> {
    let whole = crate::parallel::checkpoint::Cut::default();
    crate::parallel::checkpoint::read_optimizer(whole, ckpt, (named, false), optimizer)
}

/// Drops the rows of the step logs ([`STEP_LOGS`]) past `step` (all of them for `None`),
/// written after the checkpoint by a run that then died. Rewrites each file atomically;
/// returns how many rows of `metrics.jsonl` it dropped.
pub fn truncate_step_logs(run_dir: &Path, step: Option<u64>) -> Result<usize, TrainError> {
    let mut metrics_dropped = 0;
    for (i, name) in STEP_LOGS.iter().enumerate() {
        let dropped = keep_rows_up_to(&run_dir.join(name), step)?;
        if i == 0 {
            metrics_dropped = dropped;
        }
    }
    Ok(metrics_dropped)
}

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
    if dropped == 0 {
        return Ok(0);
    }
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, kept).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    Ok(dropped)
}
