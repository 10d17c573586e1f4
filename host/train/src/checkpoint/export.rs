//! Checkpoint → Hugging Face directory: the model plugin is rebuilt from the run's saved config,
//! its parameters come from the checkpoint, and the plugin's adapter names the HF tensors.

use super::{load_model, CheckpointError};
use std::path::Path;

/// Writes `config.json`, `model.safetensors` and, when the run kept one, `tokenizer.json` for
/// the checkpoint in `step_dir` (a `<run_dir>/checkpoints/step-<N>` directory) into `out`.
/// Files already in `out` are replaced only with `overwrite`; otherwise the first one found is
/// [`CheckpointError::WouldOverwrite`] and nothing is written.
pub fn export_hf(step_dir: &Path, out: &Path, overwrite: bool) -> Result<(), CheckpointError> {
    if !overwrite {
        if let Some(existing) = anneal_runtime::hf::EXPORT_FILES
            .iter()
            .map(|f| out.join(f))
            .find(|p| p.symlink_metadata().is_ok())
        {
            return Err(CheckpointError::WouldOverwrite(existing));
        }
    }
    let m = load_model(step_dir)?;
    anneal_runtime::hf::export(out, m.model.spec(), &m.params, m.tokenizer.as_deref())
        .map_err(|e| CheckpointError::Mismatch(format!("{}: {e}", step_dir.display())))
}
