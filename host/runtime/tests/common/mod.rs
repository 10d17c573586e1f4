//! Shared by the plugin tests: builds the workspace's plugin crates once per test binary.
#![allow(dead_code)]

use anneal_engine::Tensor;
use anneal_runtime::hf;
use anneal_runtime::plugins::{discover, find_for_model_type_in, LoadedPlugin, PluginModel};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The folder of the freshly built plugin crates (the test's `target/<profile>/`).
pub fn plugin_dir() -> &'static Path {
    anneal_tests::cli::built_dir()
}

/// The plugin called `name` from the freshly built ones.
pub fn plugin(name: &str) -> LoadedPlugin {
    discover(&[plugin_dir().to_path_buf()])
        .into_iter()
        .flatten()
        .find(|p| p.name() == name)
        .unwrap_or_else(|| panic!("plugin {name} not discovered"))
}

/// A fixture folder of this crate.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The plugin model serving the Hugging Face directory `dir` (by its `model_type`), with the
/// directory's weights.
pub fn model_for(dir: &Path) -> (PluginModel, Arc<HashMap<String, Tensor>>) {
    let cfg = hf::read_config(dir).unwrap();
    let model_type = hf::model_type(dir, &cfg).unwrap();
    let loaded = find_for_model_type_in(&[plugin_dir().to_path_buf()], model_type).unwrap();
    let inst = loaded
        .create(None, &serde_json::json!({ "hf_config": cfg }))
        .unwrap();
    let model = PluginModel::new(loaded.name(), inst).unwrap();
    let params = hf::load_params(dir, model.spec()).unwrap();
    (model, Arc::new(params))
}

/// Positions `start..start + n`.
pub fn positions(start: usize, n: usize) -> Tensor {
    Tensor::from_vec((start as i64..(start + n) as i64).collect(), &[n]).unwrap()
}

/// The largest element-wise difference of two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Decodes `tokens[from..]` (`[1, t]`) one token at a time through `opts`' KV cache, which
/// already holds the prompt before `from`: every step's logits stay within `tol` of its row of
/// `full`, the whole sequence's logits (`[t × vocab]` flattened).
pub fn assert_decode_follows(
    model: &PluginModel,
    params: &Arc<HashMap<String, Tensor>>,
    tokens: &Tensor,
    from: usize,
    full: &[f32],
    opts: &anneal_runtime::plugins::ForwardOpts,
    tol: f32,
) {
    let t = tokens.shape()[1];
    let v = full.len() / t;
    for pos in from..t {
        let step = model
            .forward(
                params,
                &tokens.narrow(1, pos, 1).unwrap(),
                &positions(pos, 1),
                opts,
            )
            .unwrap()
            .to_vec_f32();
        let d = max_abs_diff(&step, &full[pos * v..(pos + 1) * v]);
        assert!(d < tol, "position {pos}: max |logit difference| {d}");
    }
}
