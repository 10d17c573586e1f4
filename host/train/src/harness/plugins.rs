//! The job's model and optimizer plugins, created from `model.*` and `optimizer.*`.

use crate::TrainError;
use anneal_config::JobConfig;
use anneal_runtime::plugins::{find, LoadedPlugin, PluginModel, PluginOptimizer};
use serde_json::Value;
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
    let Some((key, dir)) = hf_start(cfg) else {
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

/// The Hugging Face directory a job starts from, with the key that names it:
/// `checkpoint.init_from_hf`, or `rl.init_from` when that holds a `config.json` (and is not a
/// checkpoint step dir).
fn hf_start(cfg: &JobConfig) -> Option<(&'static str, &str)> {
    match &cfg.checkpoint.init_from_hf {
        Some(dir) => Some(("checkpoint.init_from_hf", dir.as_str())),
        None => {
            let rl = cfg.rl.init_from.as_str();
            let is_hf = !rl.is_empty()
                && Path::new(rl).join("config.json").is_file()
                && !Path::new(rl).join("manifest.json").exists();
            is_hf.then_some(("rl.init_from", rl))
        }
    }
}

/// `cfg` with `model.plugin` filled in by [`model_plugin_name`], and `model.args` by
/// [`model_args`], so a run records (and a checkpoint is later rebuilt with) the plugin and
/// arguments it actually used: starting from a Hugging Face directory, its `config.json`
/// travels in the run's config, and an export or a server rebuilds the model without the
/// directory.
pub fn with_model_plugin(cfg: &JobConfig) -> Result<JobConfig, TrainError> {
    let mut cfg = cfg.clone();
    cfg.model.plugin = model_plugin_name(&cfg)?;
    if hf_start(&cfg).is_some() {
        let plugin = find(&cfg.model.plugin)
            .map_err(|e| TrainError::Config(format!("config: `model.plugin`: {e}")))?;
        cfg.model.args = model_args(&cfg, &plugin)?;
    }
    Ok(cfg)
}

/// `cfg` as a start from a Hugging Face model implies it:
/// - a model id (`org/name[@revision]`) in `checkpoint.init_from_hf` or `rl.init_from` becomes
///   its directory in the local Hugging Face cache ([`anneal_runtime::hf::hub::resolve`]);
/// - the tokenizer comes with the weights, so with `checkpoint.init_from_hf`,
///   `data.tokenizer = "train"` (the default) becomes the directory's `tokenizer.json` (with
///   its `tokenizer_config.json` and chat template beside it), and a directory without one is
///   refused: a tokenizer trained here would number tokens unlike the embeddings. A
///   `data.tokenizer` path is kept.
pub fn with_hf_start(cfg: &JobConfig) -> Result<JobConfig, TrainError> {
    let mut cfg = cfg.clone();
    let resolve = |key: &str, spec: &str| {
        anneal_runtime::hf::hub::resolve(spec)
            .map(|p| p.to_string_lossy().into_owned())
            .map_err(|e| TrainError::Config(format!("config: `{key}`: {e}")))
    };
    if !cfg.rl.init_from.is_empty() {
        cfg.rl.init_from = resolve("rl.init_from", &cfg.rl.init_from)?;
    }
    let Some(spec) = cfg.checkpoint.init_from_hf.clone() else {
        return Ok(cfg);
    };
    let dir = resolve("checkpoint.init_from_hf", &spec)?;
    cfg.checkpoint.init_from_hf = Some(dir.clone());
    if cfg.data.tokenizer != "train" {
        return Ok(cfg);
    }
    let tokenizer = Path::new(&dir).join("tokenizer.json");
    if !tokenizer.is_file() {
        return Err(TrainError::Config(format!(
            "config: `checkpoint.init_from_hf`: {dir} has no tokenizer.json, and data.tokenizer = \"train\" would train a new one whose ids do not match the checkpoint's embeddings; set data.tokenizer to the tokenizer.json the checkpoint was trained with"
        )));
    }
    cfg.data.tokenizer = tokenizer.to_string_lossy().into_owned();
    Ok(cfg)
}

/// The model plugin (`model.plugin`, see [`model_plugin_name`]) with `model.flavor` and
/// `model.args`; starting from a Hugging Face directory (`checkpoint.init_from_hf`, or
/// `rl.init_from` when it is one), with every argument its `config.json` gives
/// ([`args_from_hf`]).
pub fn load_model(cfg: &JobConfig) -> Result<PluginModel, TrainError> {
    let plugin = find(&model_plugin_name(cfg)?)?;
    let args = Value::Object(model_args(cfg, &plugin)?);
    Ok(PluginModel::new(
        plugin.name(),
        plugin.create(Some(&cfg.model.flavor), &args)?,
    )?)
}

/// The arguments `plugin` builds the job's model from: `model.args`; starting from a Hugging
/// Face directory (`checkpoint.init_from_hf`, or `rl.init_from` when it is one) that do not hold
/// its `config.json` yet, with it as `hf_config` ([`args_from_hf`]).
pub fn model_args(
    cfg: &JobConfig,
    plugin: &LoadedPlugin,
) -> Result<serde_json::Map<String, Value>, TrainError> {
    match hf_start(cfg) {
        Some((key, dir)) if !cfg.model.args.contains_key(HF_CONFIG) => {
            args_from_hf(cfg, plugin, (key, Path::new(dir)))
        }
        _ => Ok(cfg.model.args.clone()),
    }
}

/// The argument that carries a Hugging Face `config.json` to a model plugin.
const HF_CONFIG: &str = "hf_config";

/// The arguments of a model that starts from the Hugging Face directory `dir`: all of its
/// `config.json` (every argument, not only the shapes: `rope_theta`, norms' epsilon, rope
/// scaling, ...), with `model.args` on top only where they agree with it. An argument that
/// would change what the checkpoint's `config.json` says is refused naming it, since the
/// weights were trained with the directory's values; an argument `config.json` does not carry
/// applies.
fn args_from_hf(
    cfg: &JobConfig,
    plugin: &LoadedPlugin,
    (key, dir): (&str, &Path),
) -> Result<serde_json::Map<String, Value>, TrainError> {
    // Without its nulls (absent to every plugin), so the run's TOML config can record it.
    let hf = without_nulls(
        anneal_runtime::hf::read_config(dir)
            .map_err(|e| TrainError::Config(format!("config: `{key}`: {e}")))?,
    );
    // The config.json the model built from `hf` and one argument would export.
    let exported = |arg: Option<(&String, &Value)>| -> Result<Value, TrainError> {
        let mut args = serde_json::Map::new();
        args.insert(HF_CONFIG.into(), hf.clone());
        if let Some((key, value)) = arg {
            args.insert(key.clone(), value.clone());
        }
        let model = PluginModel::new(plugin.name(), plugin.create(None, &Value::Object(args))?)?;
        Ok(model
            .spec()
            .hf
            .as_ref()
            .map_or(Value::Null, |a| a.config.clone()))
    };
    let checkpoint = exported(None)?;
    for arg in &cfg.model.args {
        if let Some((field, was, now)) = first_difference(&checkpoint, &exported(Some(arg))?) {
            return Err(TrainError::Config(format!(
                "config: `model.args.{}` = {} contradicts the checkpoint of {key} ({}: config.json's `{field}` is {was}, the argument makes it {now}); leave it out: the directory's config.json gives every argument",
                arg.0,
                arg.1,
                dir.display()
            )));
        }
    }
    let mut args = cfg.model.args.clone();
    args.insert(HF_CONFIG.into(), hf);
    Ok(args)
}

/// `v` without the object fields that are null (TOML has no null).
fn without_nulls(v: Value) -> Value {
    match v {
        Value::Object(o) => Value::Object(
            o.into_iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k, without_nulls(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.into_iter().map(without_nulls).collect()),
        other => other,
    }
}

/// The first top-level field where two `config.json` objects differ, with both values.
fn first_difference(a: &Value, b: &Value) -> Option<(String, String, String)> {
    let show = |v: Option<&Value>| v.map_or("absent".to_string(), Value::to_string);
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => x
            .keys()
            .chain(y.keys())
            .find(|k| x.get(*k) != y.get(*k))
            .map(|k| (k.clone(), show(x.get(k)), show(y.get(k)))),
        _ => (a != b).then(|| ("(the whole file)".into(), a.to_string(), b.to_string())),
    }
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
