//! `anneal logprobs` and `anneal generate`: inference from a Hugging Face model directory with a
//! model plugin.

use anneal_runtime::hf;
use anneal_runtime::infer::{self, Sampling};
use anneal_runtime::plugins::{find, Params, PluginModel};
use anyhow::Context;
use std::path::Path;
use std::sync::Arc;

/// Parses `1,2,3` into token ids.
pub fn parse_tokens(s: &str) -> anyhow::Result<Vec<i64>> {
    s.split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| {
            t.trim()
                .parse::<i64>()
                .with_context(|| format!("'{t}' is not a token id"))
        })
        .collect()
}

/// Loads the plugin, builds the model `config.json` describes and fills in its weights.
pub fn load_hf_model(dir: &Path, plugin: &str) -> anyhow::Result<(PluginModel, Params)> {
    let cfg = hf::read_config(dir)?;
    let loaded = find(plugin)?;
    let inst = loaded.create(None, &serde_json::json!({ "hf_config": cfg }))?;
    let model = PluginModel::new(plugin, inst)?;
    let params = hf::load_params(dir, model.spec())?;
    Ok((model, Arc::new(params)))
}

fn check_vocab(model: &PluginModel, tokens: &[i64]) -> anyhow::Result<()> {
    let v = model.spec().vocab_size as i64;
    if let Some(t) = tokens.iter().find(|&&t| t < 0 || t >= v) {
        anyhow::bail!("token id {t} is outside the vocabulary (0..{v})");
    }
    Ok(())
}

/// Prints `{"logprobs":[...],"loss":...}`.
pub fn logprobs(dir: &Path, plugin: &str, tokens: &str) -> anyhow::Result<()> {
    let tokens = parse_tokens(tokens)?;
    let (model, params) = load_hf_model(dir, plugin)?;
    check_vocab(&model, &tokens)?;
    let (lp, loss) = infer::logprobs(&model, &params, &tokens)?;
    println!("{}", serde_json::json!({ "logprobs": lp, "loss": loss }));
    Ok(())
}

/// Prints `{"tokens":[...],"logprobs":[...]}` for the generated tokens.
pub fn generate(
    dir: &Path,
    plugin: &str,
    prompt: &str,
    max_new: usize,
    sampling: Sampling,
) -> anyhow::Result<()> {
    let prompt = parse_tokens(prompt)?;
    let (model, params) = load_hf_model(dir, plugin)?;
    check_vocab(&model, &prompt)?;
    let g = infer::generate(&model, &params, &prompt, max_new, &sampling)?;
    println!(
        "{}",
        serde_json::json!({ "prompt_tokens": prompt, "tokens": g.tokens, "logprobs": g.logprobs })
    );
    Ok(())
}
