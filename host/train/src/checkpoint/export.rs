//! Checkpoint → Hugging Face directory: the model plugin is rebuilt from the run's saved config,
//! its parameters come from the checkpoint, and the plugin's adapter names the HF tensors.

use super::{load_dir, CheckpointError};
use anneal_config::{resolve_with_env, Source};
use anneal_runtime::plugins::{find, PluginModel};
use std::collections::HashMap;
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
    let loaded = load_dir(step_dir)?;
    let fail = |m: String| CheckpointError::Mismatch(format!("{}: {m}", step_dir.display()));
    let cfg = resolve_with_env(
        Source::Text {
            text: &loaded.state.config,
            name: "the checkpoint's config",
        },
        &[],
        &[],
    )
    .map_err(|e| fail(e.to_string()))?;
    let plugin = find(&cfg.model.plugin).map_err(|e| fail(e.to_string()))?;
    let args = serde_json::Value::Object(cfg.model.args.clone());
    let inst = plugin
        .create(Some(&cfg.model.flavor), &args)
        .map_err(|e| fail(e.to_string()))?;
    let model = PluginModel::new(plugin.name(), inst).map_err(|e| fail(e.to_string()))?;
    let mut params = HashMap::new();
    for p in &model.spec().params {
        let t = loaded
            .tensors
            .get(&format!("model/{}", p.name))
            .ok_or_else(|| fail(format!("no parameter {}", p.name)))?;
        params.insert(p.name.clone(), t.clone());
    }
    let tokenizer = step_dir
        .parent()
        .and_then(Path::parent)
        .map(|run| run.join("tokenizer.json"))
        .filter(|p| p.is_file());
    anneal_runtime::hf::export(out, model.spec(), &params, tokenizer.as_deref())
        .map_err(|e| fail(e.to_string()))
}
