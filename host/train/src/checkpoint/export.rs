//! Checkpoint → Hugging Face directory: the model plugin is rebuilt from the run's saved config,
//! its parameters come from the checkpoint, and the plugin's adapter names the HF tensors.

use super::{load_model, CheckpointError};
use std::path::Path;

/// The files a run may keep beside its tokenizer that an export carries: the tokenizer's
/// settings (a chat run's template and end-of-turn token), a vision model's image processor,
/// and the generation settings of the Hugging Face directory the run started from.
pub const RUN_FILES: [&str; 3] = [
    "tokenizer_config.json",
    "preprocessor_config.json",
    "generation_config.json",
];

/// Writes `config.json`, `model.safetensors` and, when the run kept them, `tokenizer.json` and
/// [`RUN_FILES`] for the checkpoint in `step_dir` (a `<run_dir>/checkpoints/step-<N>`
/// directory) into `out`.
/// Files already in `out` are replaced only with `overwrite`; otherwise the first one found is
/// [`CheckpointError::WouldOverwrite`] and nothing is written.
pub fn export_hf(step_dir: &Path, out: &Path, overwrite: bool) -> Result<(), CheckpointError> {
    if !overwrite {
        if let Some(existing) = anneal_runtime::hf::EXPORT_FILES
            .iter()
            .chain(&RUN_FILES)
            .map(|f| out.join(f))
            .find(|p| p.symlink_metadata().is_ok())
        {
            return Err(CheckpointError::WouldOverwrite(existing));
        }
    }
    let m = load_model(step_dir)?;
    anneal_runtime::hf::export(out, m.model.spec(), &m.params, m.tokenizer.as_deref())
        .map_err(|e| CheckpointError::Mismatch(format!("{}: {e}", step_dir.display())))?;
    let Some(run) = step_dir.parent().and_then(Path::parent) else {
        return Ok(());
    };
    for name in RUN_FILES {
        let (from, to) = (run.join(name), out.join(name));
        if from.is_file() {
            std::fs::copy(&from, &to).map_err(super::io_err(&to))?;
        }
    }
    Ok(())
}
