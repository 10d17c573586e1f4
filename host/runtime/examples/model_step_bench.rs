//! One training step (forward, mean cross-entropy over the next tokens, backward) of a model
//! loaded from a transformers checkpoint folder through its plugin, timed per iteration: the
//! Anneal side of `bench/linear_attention.sh`, which saves a one-block Qwen3.5 (a Gated DeltaNet
//! mixer and a small MLP) and runs transformers on the same weights. Prints one JSON object:
//! `{"seconds": [..], "forward": [..]}` (`forward`: the forward part of each iteration).
//!
//! Run: `RAYON_NUM_THREADS=2 cargo run --release -p anneal-runtime --example model_step_bench --
//!   --model-dir DIR --seq 2048 --iters 3 [--batch 1] [--plugin-dir target/release]`

use anneal_engine::ops::{cross_entropy, CrossEntropy};
use anneal_engine::rng::RngKey;
use anneal_engine::Tensor;
use anneal_runtime::hf;
use anneal_runtime::plugins::{find_for_model_type_in, ForwardOpts, PluginModel};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

type Error = Box<dyn std::error::Error>;

/// `--name value` from the command line.
fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1).cloned()
}

fn count(name: &str, default: usize) -> Result<usize, Error> {
    match arg(name) {
        None => Ok(default),
        Some(v) => v
            .parse()
            .map_err(|_| format!("{name} needs a positive integer, got {v}").into()),
    }
}

fn main() -> Result<(), Error> {
    let dir = PathBuf::from(arg("--model-dir").ok_or("--model-dir DIR is required")?);
    let (t, b, iters) = (
        count("--seq", 2048)?,
        count("--batch", 1)?,
        count("--iters", 3)?,
    );
    // The plugins sit next to this example's folder (target/<profile>/) unless told otherwise.
    let plugin_dir = match arg("--plugin-dir") {
        Some(d) => PathBuf::from(d),
        None => std::env::current_exe()?
            .parent()
            .and_then(|p| p.parent())
            .ok_or("cannot locate the plugin folder; pass --plugin-dir")?
            .to_path_buf(),
    };
    let cfg = hf::read_config(&dir)?;
    let model_type = hf::model_type(&dir, &cfg)?;
    let loaded = find_for_model_type_in(&[plugin_dir], model_type)?;
    let inst = loaded.create(None, &serde_json::json!({ "hf_config": cfg }))?;
    let model = PluginModel::new(loaded.name(), inst)?;
    let params = hf::load_params(&dir, model.spec())?;
    let leaves: HashMap<String, Tensor> = params
        .iter()
        .map(|(k, v)| (k.clone(), v.detach().requires_grad_()))
        .collect();
    let leaves = Arc::new(leaves);
    let vocab = cfg["vocab_size"]
        .as_u64()
        .or_else(|| cfg["text_config"]["vocab_size"].as_u64())
        .ok_or("config.json has no vocab_size")? as f32;
    let tokens = Tensor::rand_uniform(
        &[b, t],
        0.0,
        vocab,
        &RngKey::new(3, "tokens"),
        0,
        anneal_engine::DType::F32,
    )?
    .to_dtype(anneal_engine::DType::I64)?;
    let positions = Tensor::from_vec((0..t as i64).collect(), &[t])?;
    let opts = ForwardOpts {
        training: true,
        ..Default::default()
    };
    let (mut seconds, mut forward) = (vec![], vec![]);
    for _ in 0..iters {
        let start = Instant::now();
        let logits = model.forward(&leaves, &tokens, &positions, &opts)?;
        let v = logits.shape()[2];
        let inputs = logits.narrow(1, 0, t - 1)?.reshape(&[b * (t - 1), v])?;
        let targets = tokens
            .narrow(1, 1, t - 1)?
            .contiguous()?
            .reshape(&[b * (t - 1)])?;
        let loss = cross_entropy(&inputs, &targets, &CrossEntropy::default())?;
        forward.push(start.elapsed().as_secs_f64());
        loss.backward()?;
        seconds.push(start.elapsed().as_secs_f64());
        for leaf in leaves.values() {
            leaf.zero_grad();
        }
    }
    println!(
        "{}",
        serde_json::json!({ "seconds": seconds, "forward": forward, "seq": t, "batch": b })
    );
    Ok(())
}
