//! Shared by the plugin tests: builds the workspace's plugin crates once per test binary.
#![allow(dead_code)]

use anneal_engine::Tensor;
use anneal_runtime::hf;
use anneal_runtime::plugins::{
    discover, find_for_model_type_in, ImageInputs, LoadedPlugin, PluginModel,
};
use std::collections::{BTreeMap, HashMap};
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

/// The image processor's output a fixture's `expected.safetensors` holds (`pixel_values`,
/// `image_grid_thw`), as one forward's images.
pub fn fixture_images(exp: &BTreeMap<String, Tensor>) -> Arc<ImageInputs> {
    let grid = exp["image_grid_thw"].to_vec::<i64>();
    Arc::new(ImageInputs {
        pixel_values: exp["pixel_values"].clone(),
        grid_thw: grid
            .chunks(3)
            .map(|g| [g[0] as usize, g[1] as usize, g[2] as usize])
            .collect(),
    })
}

/// Exports `params` of `model` (loaded from the fixture `dir`, called `name`) as a Hugging
/// Face directory and checks that it imports back to the same tensors and holds the fixture's
/// tensor names and shapes; returns the exported `config.json` and the fixture's, for the
/// caller's checks of the keys its model writes. `ANNEAL_VL_EXPORT=DIR` keeps the export under
/// `DIR/<name>` (for `tests/reference/check_vl_export.py`); otherwise it is removed.
pub fn assert_export_round_trip(
    name: &str,
    dir: &Path,
    model: &PluginModel,
    params: &HashMap<String, Tensor>,
) -> (serde_json::Value, serde_json::Value) {
    let keep = std::env::var_os("ANNEAL_VL_EXPORT").map(|d| PathBuf::from(d).join(name));
    let out = keep.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("anneal-vl-export-{name}-{}", std::process::id()))
    });
    hf::export(&out, model.spec(), params, None).unwrap();
    let back = hf::load_params(&out, model.spec()).unwrap();
    assert_eq!(back.len(), params.len());
    for (k, v) in params.iter() {
        assert_eq!(back[k].to_vec_f32(), v.to_vec_f32(), "{name}: {k}");
    }
    // The same tensor names and shapes as transformers' checkpoint.
    let shapes = |t: &HashMap<String, Tensor>| {
        let mut v: Vec<(String, Vec<usize>)> = t
            .iter()
            .map(|(k, t)| (k.clone(), t.shape().to_vec()))
            .collect();
        v.sort();
        v
    };
    let ours = hf::read_tensors(&out).unwrap();
    let theirs = hf::read_tensors(dir).unwrap();
    assert_eq!(shapes(&ours), shapes(&theirs), "{name}");
    let configs = (
        hf::read_config(&out).unwrap(),
        hf::read_config(dir).unwrap(),
    );
    if keep.is_none() {
        let _ = std::fs::remove_dir_all(&out);
    }
    configs
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

/// Prefills `tokens[..prefill]` (`[1, t]`) through `media` (the forward's images or audio) into
/// a fresh KV cache, within 1e-4 of `full` (the whole sequence's logits, `[t × vocab]`
/// flattened), then decodes the rest one token at a time from that cache, each step within 1e-4
/// too ([`assert_decode_follows`]).
pub fn assert_prefill_then_decode(
    name: &str,
    model: &PluginModel,
    params: &Arc<HashMap<String, Tensor>>,
    tokens: &Tensor,
    full: &[f32],
    prefill: usize,
    media: anneal_runtime::plugins::ForwardOpts,
) {
    use anneal_runtime::plugins::{ForwardOpts, KvCache};
    let v = full.len() / tokens.shape()[1];
    let cache = Arc::new(KvCache::new());
    let first = model
        .forward(
            params,
            &tokens.narrow(1, 0, prefill).unwrap(),
            &positions(0, prefill),
            &ForwardOpts {
                cache: Some(cache.clone()),
                ..media
            },
        )
        .unwrap()
        .to_vec_f32();
    assert!(
        max_abs_diff(&first, &full[..prefill * v]) <= 1e-4,
        "{name}: prefill"
    );
    let opts = ForwardOpts {
        cache: Some(cache),
        ..Default::default()
    };
    assert_decode_follows(model, params, tokens, prefill, full, &opts, 1e-4);
}

/// Every parameter of `params` as a fresh leaf that takes a gradient.
pub fn leaves(params: &HashMap<String, Tensor>) -> Arc<HashMap<String, Tensor>> {
    Arc::new(
        params
            .iter()
            .map(|(k, v)| (k.clone(), v.detach().requires_grad_()))
            .collect(),
    )
}

/// The mean next-token cross-entropy of `logits` (`[B, T, V]`) on `tokens` (`[B, T]`), as
/// PyTorch's `cross_entropy` of the shifted rows.
pub fn next_token_loss(logits: &Tensor, tokens: &Tensor) -> Tensor {
    use anneal_engine::ops::{cross_entropy, CrossEntropy};
    let (b, t, v) = (tokens.shape()[0], tokens.shape()[1], logits.shape()[2]);
    let inputs = logits
        .narrow(1, 0, t - 1)
        .unwrap()
        .reshape(&[b * (t - 1), v])
        .unwrap();
    let targets = tokens
        .narrow(1, 1, t - 1)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape(&[b * (t - 1)])
        .unwrap();
    cross_entropy(&inputs, &targets, &CrossEntropy::default()).unwrap()
}

/// Asserts that every trainable parameter's gradient in `leaves` is within `tol` (relative to
/// the reference's largest magnitude) of transformers' `grad.<checkpoint name>` tensors in
/// `reference`, mapped onto our parameters as the checkpoint's weights are (per-expert tensors
/// stacked, fused ones split, transposes). Returns the worst relative difference and how many
/// parameters were compared.
pub fn assert_gradients_match(
    name: &str,
    dir: &Path,
    model: &PluginModel,
    leaves: &HashMap<String, Tensor>,
    reference: &std::collections::BTreeMap<String, Tensor>,
    tol: f32,
) -> (f32, usize) {
    let hf_grads: HashMap<String, Tensor> = reference
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("grad.")?.to_string(), v.clone())))
        .collect();
    // Buffers (DeepSeek-V3's routing bias) take no gradient.
    let mut trained = model.spec().clone();
    trained.params.retain(|p| p.trainable);
    let want = hf::params_from_tensors(dir, &hf_grads, &trained).unwrap();
    assert!(!want.is_empty(), "{name}: no reference gradients");
    let (mut worst, mut compared) = (0f32, 0);
    for (ours, leaf) in leaves.iter().filter(|(n, _)| want.contains_key(*n)) {
        compared += 1;
        let w = want[ours].to_vec_f32();
        // A parameter the forward left alone (a vision tower under text) has no gradient: 0.
        let g = leaf
            .grad()
            .map_or_else(|| vec![0.0; w.len()], |g| g.to_vec_f32());
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
        let rel = max_abs_diff(&g, &w) / scale;
        worst = worst.max(rel);
        assert!(
            rel <= tol,
            "{name}: gradient of {ours}: relative difference {rel}"
        );
    }
    (worst, compared)
}
