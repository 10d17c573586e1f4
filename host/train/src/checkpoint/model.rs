//! A checkpoint as a model to run: the model plugin rebuilt from the run's saved config, its
//! parameters from the checkpoint's `model/<name>` tensors. Export and serving both start here.

use super::{load_dir, CheckpointError};
use anneal_config::{resolve_with_env, Source};
use anneal_engine::Tensor;
use anneal_runtime::plugins::{find, PluginModel};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The model of one checkpoint step.
pub struct CheckpointModel {
    /// The model plugin instance (plugin, flavor and args of the run's config).
    pub model: PluginModel,
    /// Its parameters, by the plugin's names.
    pub params: HashMap<String, Tensor>,
    /// The step the checkpoint was taken at.
    pub step: u64,
    /// The run's `tokenizer.json` (`<run_dir>/tokenizer.json`), when the run kept one.
    pub tokenizer: Option<PathBuf>,
    /// The `config.json` of the Hugging Face checkpoint the run started from
    /// (`model.args.hf_config`), when it started from one.
    pub hf_config: Option<serde_json::Value>,
    /// A LoRA run's adapters (merged into `params` already) and their tensors by name.
    pub lora: Option<(crate::lora::Adapters, HashMap<String, Tensor>)>,
    /// Where a LoRA run's base model came from (`checkpoint.init_from_hf`), if a directory.
    pub base_dir: Option<String>,
}

/// Loads (and verifies) the checkpoint in `step_dir`, a `<run_dir>/checkpoints/step-<N>`
/// directory, and rebuilds its model.
pub fn load_model(step_dir: &Path) -> Result<CheckpointModel, CheckpointError> {
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
    let plugin = crate::harness::model_plugin_name(&cfg)
        .map_err(|e| fail(e.to_string()))
        .and_then(|name| find(&name).map_err(|e| fail(e.to_string())))?;
    let args = serde_json::Value::Object(cfg.model.args.clone());
    let hf_config = cfg.model.args.get("hf_config").cloned();
    let inst = plugin
        .create(Some(&cfg.model.flavor), &args)
        .map_err(|e| fail(e.to_string()))?;
    let model = PluginModel::new(plugin.name(), inst).map_err(|e| fail(e.to_string()))?;
    let lora =
        crate::lora::Adapters::plan(&cfg.lora, model.spec()).map_err(|e| fail(e.to_string()))?;
    // A LoRA run saved its adapters and buffers: the base comes from where it started.
    let mut params = match &lora {
        // Held as training held it (in `lora.base_dtype`).
        Some(l) => crate::lora::base_params(&cfg, &model)
            .and_then(|base| l.freeze(base.into_iter().collect()))
            .map_err(|e| fail(e.to_string()))?
            .into_iter()
            .collect(),
        None => HashMap::new(),
    };
    for p in &model.spec().params {
        match loaded.tensors.get(&format!("model/{}", p.name)) {
            Some(t) => {
                params.insert(p.name.clone(), t.clone());
            }
            None if params.contains_key(&p.name) => {}
            None => return Err(fail(format!("no parameter {}", p.name))),
        }
    }
    let lora = match lora {
        Some(l) => {
            let adapters: HashMap<String, Tensor> = loaded
                .tensors
                .iter()
                .filter_map(|(k, t)| {
                    let name = k.strip_prefix("model/")?;
                    crate::lora::is_adapter(name).then(|| (name.to_owned(), t.clone()))
                })
                .collect();
            l.merge(&mut params, &adapters)
                .map_err(|e| fail(e.to_string()))?;
            Some((l, adapters))
        }
        None => None,
    };
    let tokenizer = step_dir
        .parent()
        .and_then(Path::parent)
        .map(|run| run.join("tokenizer.json"))
        .filter(|p| p.is_file());
    Ok(CheckpointModel {
        model,
        params,
        step: loaded.state.step,
        tokenizer,
        hf_config,
        lora,
        base_dir: cfg.checkpoint.init_from_hf.clone(),
    })
}
