//! The models `anneal serve --model PATH` serves: each loaded once at startup, with its
//! tokenizer, chat template, stop tokens and its own decode loop.
//!
//! A path is either a checkpoint step directory (`<run>/checkpoints/step-<N>`, holding
//! `train_state.json`: the plugin, flavor and args come from the run's saved config, the
//! tokenizer is `<run>/tokenizer.json`), served as `<run>-step-<N>`; or a Hugging Face
//! directory (`config.json`, safetensors, `tokenizer.json`, optionally `tokenizer_config.json`,
//! `chat_template.jinja`, `generation_config.json`), run with the `llama` plugin and served
//! under its folder name. Two models with one name are refused at startup.

use super::images::Vision;
use super::template::{special_token, ChatTemplate};
use anneal_data::TextTokenizer;
use anneal_runtime::serving::{Scheduler, SchedulerOptions};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One served model.
pub struct ServedModel {
    /// The name clients use (`model` in requests).
    pub id: String,
    /// When it was loaded (Unix seconds).
    pub created: u64,
    /// Where it was loaded from.
    pub path: PathBuf,
    /// Its decode loop.
    pub scheduler: Scheduler,
    /// Its tokenizer.
    pub tokenizer: TextTokenizer,
    /// Its chat template, or why it cannot be used.
    pub template: Result<ChatTemplate, String>,
    /// Token ids that end a completion (end of text, end of turn).
    pub stop_ids: Vec<i64>,
    /// The longest sequence (prompt + completion) the model takes.
    pub context: usize,
    /// How it reads images; `None` for a text-only model.
    pub vision: Option<Vision>,
}

/// Why `--model` paths could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A model could not be loaded.
    #[error("--model {}: {msg}", path.display())]
    Load {
        /// The path given.
        path: PathBuf,
        /// What went wrong.
        msg: String,
    },
    /// Two paths give the same model name.
    #[error("two models are named '{id}' ({} and {}); serve one of them", first.display(), second.display())]
    Duplicate {
        /// The name.
        id: String,
        /// The first path.
        first: PathBuf,
        /// The second path.
        second: PathBuf,
    },
}

/// Loads every path, in order; names must be unique.
pub fn load_models(
    paths: &[PathBuf],
    options: &SchedulerOptions,
) -> Result<Vec<Arc<ServedModel>>, ModelError> {
    let mut models: Vec<Arc<ServedModel>> = Vec::new();
    for path in paths {
        let id = model_id(path)?;
        if let Some(other) = models.iter().find(|m| m.id == id) {
            return Err(ModelError::Duplicate {
                id,
                first: other.path.clone(),
                second: path.clone(),
            });
        }
        models.push(Arc::new(load(path, id, options)?));
    }
    Ok(models)
}

/// The name a path is served under: `<run>-step-<N>` for a checkpoint step directory, the
/// model id (`org/name`) for a snapshot of the local Hugging Face cache, the folder name for
/// another Hugging Face directory.
pub fn model_id(path: &Path) -> Result<String, ModelError> {
    let fail = |msg: String| ModelError::Load {
        path: path.to_path_buf(),
        msg,
    };
    let full = path
        .canonicalize()
        .map_err(|e| fail(format!("cannot open it: {e}")))?;
    let name = |p: &Path| {
        p.file_name()
            .and_then(|n| n.to_str())
            .map(str::to_owned)
            .ok_or_else(|| fail("its folder name is not UTF-8".into()))
    };
    if full.join("train_state.json").is_file() {
        let run = full
            .parent()
            .and_then(Path::parent)
            .ok_or_else(|| fail("a checkpoint step directory sits in <run>/checkpoints/".into()))?;
        Ok(format!("{}-{}", name(run)?, name(&full)?))
    } else if full.join("config.json").is_file() {
        Ok(cached_model_id(&full).unwrap_or(name(&full)?))
    } else {
        Err(fail(
            "neither a checkpoint step directory (train_state.json) nor a Hugging Face \
             directory (config.json)"
                .into(),
        ))
    }
}

fn load(path: &Path, id: String, options: &SchedulerOptions) -> Result<ServedModel, ModelError> {
    let fail = |msg: String| ModelError::Load {
        path: path.to_path_buf(),
        msg,
    };
    let full = path.canonicalize().map_err(|e| fail(e.to_string()))?;
    let (model, params, tokenizer_path) = if full.join("train_state.json").is_file() {
        let m = anneal_train::checkpoint::load_model(&full).map_err(|e| fail(e.to_string()))?;
        let tok = m
            .tokenizer
            .ok_or_else(|| fail("its run has no tokenizer.json".into()))?;
        (m.model, m.params, tok)
    } else {
        let (model, params) =
            anneal_runtime::hf::load_model(&full, None).map_err(|e| fail(e.to_string()))?;
        (model, params, full.join("tokenizer.json"))
    };
    if !tokenizer_path.is_file() {
        return Err(fail(format!(
            "no tokenizer at {}",
            tokenizer_path.display()
        )));
    }
    let tokenizer = TextTokenizer::from_file(&tokenizer_path).map_err(|e| fail(e.to_string()))?;
    // tokenizer_config.json, chat_template.jinja and generation_config.json sit beside it.
    let dir = tokenizer_path.parent().unwrap_or(&full).to_path_buf();
    let template = ChatTemplate::load(&dir).map_err(|e| e.to_string());
    if let Err(e) = &template {
        eprintln!("warning: model {id}: {e}; chat completions are refused");
    }
    let stop_ids = stop_ids(&dir, &tokenizer);
    // A vision model's processor sits beside its config (a Hugging Face directory) or its
    // tokenizer (a run).
    let vision = match Vision::load(&full).map_err(fail)? {
        Some(v) => Some(v),
        None if dir != full => Vision::load(&dir).map_err(fail)?,
        None => None,
    };
    let context = model.spec().max_seq_len;
    let scheduler = Scheduler::start(Arc::new(model), Arc::new(params), options.clone())
        .map_err(|e| fail(format!("cannot start its decode thread: {e}")))?;
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(ServedModel {
        id,
        created,
        path: path.to_path_buf(),
        scheduler,
        tokenizer,
        template,
        stop_ids,
        context,
        vision,
    })
}

/// The tokenizer's end-of-text id, `tokenizer_config.json`'s `eos_token` and
/// `generation_config.json`'s `eos_token_id` (a number or a list).
fn stop_ids(dir: &Path, tokenizer: &TextTokenizer) -> Vec<i64> {
    let read = |name: &str| -> Value {
        std::fs::read_to_string(dir.join(name))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(Value::Null)
    };
    let mut ids = vec![tokenizer.eos_id() as i64];
    if let Some(eos) = special_token(read("tokenizer_config.json").get("eos_token")) {
        // A special token encodes as exactly one id.
        if let Ok([id]) = tokenizer.encode(&eos).as_deref() {
            ids.push(*id as i64);
        }
    }
    match read("generation_config.json").get("eos_token_id") {
        Some(Value::Number(n)) => ids.extend(n.as_i64()),
        Some(Value::Array(list)) => ids.extend(list.iter().filter_map(Value::as_i64)),
        _ => {}
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// `org/name` for a snapshot of the Hugging Face cache (`.../models--org--name/snapshots/<commit>`).
fn cached_model_id(dir: &Path) -> Option<String> {
    let snapshots = dir.parent()?;
    if snapshots.file_name()? != "snapshots" {
        return None;
    }
    let repo = snapshots.parent()?.file_name()?.to_str()?;
    let (org, name) = repo.strip_prefix("models--")?.split_once("--")?;
    Some(format!("{org}/{name}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_snapshot_is_served_under_its_model_id() {
        let root = std::env::temp_dir().join(format!("anneal-models-{}", std::process::id()));
        let snap = root.join("hub/models--org--tiny-lm/snapshots/0123abcd");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        assert_eq!(model_id(&snap).unwrap(), "org/tiny-lm");
        let plain = root.join("my-model");
        std::fs::create_dir_all(&plain).unwrap();
        std::fs::write(plain.join("config.json"), "{}").unwrap();
        assert_eq!(model_id(&plain).unwrap(), "my-model");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
