//! Checkpoint → Hugging Face directory: the model plugin is rebuilt from the run's saved config,
//! its parameters come from the checkpoint, and the plugin's adapter names the HF tensors.

use super::{load_model, CheckpointError};
use serde_json::Value;
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
    let run = step_dir.parent().and_then(Path::parent);
    if let Some(run) = run {
        for name in RUN_FILES {
            let (from, to) = (run.join(name), out.join(name));
            if from.is_file() {
                std::fs::copy(&from, &to).map_err(super::io_err(&to))?;
            }
        }
    }
    complete_config(out, m.hf_config.as_ref())
}

/// Completes the exported `config.json` with what the model plugin does not write: every key
/// of the Hugging Face checkpoint the run started from (`hf_config`: its token ids,
/// `initializer_range`, ...), and otherwise `eos_token_id` from the exported tokenizer's
/// end-of-turn token (`tokenizer_config.json`'s `eos_token`), so that generation stops where
/// the run's chats end a turn.
fn complete_config(out: &Path, hf_config: Option<&Value>) -> Result<(), CheckpointError> {
    let path = out.join("config.json");
    let read = |p: &Path| -> Option<Value> {
        serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()
    };
    let Some(Value::Object(mut cfg)) = read(&path) else {
        return Ok(());
    };
    let before = cfg.len();
    if let Some(Value::Object(source)) = hf_config {
        for (k, v) in source {
            if cfg.get(k).is_none_or(Value::is_null) {
                cfg.insert(k.clone(), v.clone());
            }
        }
    }
    if cfg.get("eos_token_id").is_none_or(Value::is_null) {
        let eos = read(&out.join("tokenizer_config.json"))
            .and_then(|tc| anneal_data::chat::template::special_token(tc.get("eos_token")))
            .zip(read(&out.join("tokenizer.json")))
            .and_then(|(eos, tok)| eos_id(&tok, &eos));
        if let Some(id) = eos {
            cfg.insert("eos_token_id".into(), id.into());
        }
    }
    if cfg.len() == before {
        return Ok(());
    }
    let text = serde_json::to_string_pretty(&Value::Object(cfg)).unwrap_or_default();
    std::fs::write(&path, text).map_err(super::io_err(&path))
}

/// The id of `token` in a `tokenizer.json`: an added (special) token, or the model's vocabulary.
fn eos_id(tokenizer: &Value, token: &str) -> Option<u64> {
    let added = tokenizer["added_tokens"].as_array().and_then(|a| {
        a.iter()
            .find(|t| t["content"] == token)
            .and_then(|t| t["id"].as_u64())
    });
    added.or_else(|| tokenizer["model"]["vocab"][token].as_u64())
}
