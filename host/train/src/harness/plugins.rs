//! The job's model and optimizer plugins, created from `model.*` and `optimizer.*`.

use crate::TrainError;
use anneal_config::JobConfig;
use anneal_runtime::plugins::{find, PluginModel, PluginOptimizer};
use std::path::Path;

/// The plugin used when neither the config nor a Hugging Face directory names one.
const DEFAULT_MODEL_PLUGIN: &str = "llama";

/// The model plugin a job runs: `model.plugin` when set; otherwise the plugin serving the
/// `model_type` of the Hugging Face directory the job starts from (`checkpoint.init_from_hf`,
/// or `rl.init_from` when that holds a `config.json`), otherwise `llama`.
pub fn model_plugin_name(cfg: &JobConfig) -> Result<String, TrainError> {
    if !cfg.model.plugin.is_empty() {
        return Ok(cfg.model.plugin.clone());
    }
    let from_hf = match &cfg.checkpoint.init_from_hf {
        Some(dir) => Some(("checkpoint.init_from_hf", dir.as_str())),
        None => {
            let rl = cfg.rl.init_from.as_str();
            let is_hf = !rl.is_empty()
                && Path::new(rl).join("config.json").is_file()
                && !Path::new(rl).join("manifest.json").exists();
            is_hf.then_some(("rl.init_from", rl))
        }
    };
    let Some((key, dir)) = from_hf else {
        return Ok(DEFAULT_MODEL_PLUGIN.into());
    };
    let dir = Path::new(dir);
    let pick = || {
        let hf_cfg = anneal_runtime::hf::read_config(dir)?;
        anneal_runtime::hf::plugin_for(dir, &hf_cfg, None)
    };
    let plugin = pick().map_err(|e| TrainError::Config(format!("config: `{key}`: {e}")))?;
    Ok(plugin.name().to_string())
}

/// `cfg` with `model.plugin` filled in by [`model_plugin_name`], so a run records (and a
/// checkpoint is later rebuilt with) the plugin it actually used.
pub fn with_model_plugin(cfg: &JobConfig) -> Result<JobConfig, TrainError> {
    let mut cfg = cfg.clone();
    cfg.model.plugin = model_plugin_name(&cfg)?;
    Ok(cfg)
}

/// The model plugin (`model.plugin`, see [`model_plugin_name`]) with `model.flavor` and
/// `model.args`.
pub fn load_model(cfg: &JobConfig) -> Result<PluginModel, TrainError> {
    let plugin = find(&model_plugin_name(cfg)?)?;
    let args = serde_json::Value::Object(cfg.model.args.clone());
    Ok(PluginModel::new(
        plugin.name(),
        plugin.create(Some(&cfg.model.flavor), &args)?,
    )?)
}

/// The optimizer plugin `optimizer.plugin` with `optimizer.args`.
pub fn load_optimizer(cfg: &JobConfig) -> Result<PluginOptimizer, TrainError> {
    let plugin = find(&cfg.optimizer.plugin)?;
    let args = serde_json::Value::Object(cfg.optimizer.args.clone());
    Ok(PluginOptimizer::new(
        plugin.name(),
        plugin.create(None, &args)?,
    )?)
}
