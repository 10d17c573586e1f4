//! The job's model and optimizer plugins, created from `model.*` and `optimizer.*`.

use crate::TrainError;
use anneal_config::JobConfig;
use anneal_runtime::plugins::{find, PluginModel, PluginOptimizer};

/// The model plugin `model.plugin` with `model.flavor` and `model.args`.
pub fn load_model(cfg: &JobConfig) -> Result<PluginModel, TrainError> {
    let plugin = find(&cfg.model.plugin)?;
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
