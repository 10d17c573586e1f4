//! DeepSeek-V4's multi-token prediction (`mtp_layers = 1`): the MTP module's gradients match
//! central finite differences of its loss; the main model is untouched by it (the training
//! forward's logits and the main loss's gradients bit for bit those of the same weights without
//! the module, no `mtp` loss at inference, the same log-probabilities and generations); its
//! weights export under DeepSeek's `mtp.0.*` names and read back.

mod common;

use anneal_engine::{autograd, Tensor};
use anneal_runtime::hf;
use anneal_runtime::infer::{self, Sampling};
use anneal_runtime::plugins::{ForwardOpts, ForwardOutput, Params, PluginModel};
use common::{plugin, positions};
use std::collections::HashMap;
use std::sync::Arc;

/// Every block kind (sliding, CSA, HCA, CSA) over two streams, small enough for finite
/// differences, with and without the MTP module, each token going to `top_k` of 4 experts.
fn model(mtp_layers: usize, top_k: usize) -> PluginModel {
    let args = serde_json::json!({
        "dim": 32, "n_heads": 2, "head_dim": 16, "rope_head_dim": 8, "q_lora_rank": 16,
        "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 8,
        "index_topk": 3, "csa_rate": 2, "hca_rate": 4, "sliding_window": 6, "n_experts": 4,
        "top_k": top_k, "expert_ffn_dim": 32, "vocab_size": 64, "max_seq_len": 64,
        "mtp_layers": mtp_layers,
    });
    let inst = plugin("deepseek_v4").create(None, &args).unwrap();
    PluginModel::new("deepseek_v4", inst).unwrap()
}

/// Two rows of 20 token ids.
fn tokens() -> Tensor {
    let ids: Vec<i64> = (0..40).map(|i| (i * 37 + 11) % 64).collect();
    Tensor::from_vec(ids, &[2, 20]).unwrap()
}

fn training() -> ForwardOpts {
    ForwardOpts {
        training: true,
        ..Default::default()
    }
}

fn forward(model: &PluginModel, params: &Params, opts: &ForwardOpts) -> ForwardOutput {
    model
        .forward_full(params, &tokens(), &positions(0, 20), opts)
        .unwrap()
}

fn named<'a>(list: &'a [(String, Tensor)], name: &str) -> Option<&'a Tensor> {
    list.iter().find(|(n, _)| n == name).map(|(_, t)| t)
}

/// The `mtp` auxiliary loss at `params`, without gradients.
fn mtp_loss(model: &PluginModel, params: &HashMap<String, Tensor>) -> f64 {
    let _g = autograd::no_grad();
    let out = forward(model, &Arc::new(params.clone()), &training());
    named(&out.aux_losses, "mtp").unwrap().item().unwrap() as f64
}

/// `t` with element `i` set to `v`.
fn with(t: &Tensor, i: usize, v: f32) -> Tensor {
    let mut data = t.to_vec_f32();
    data[i] = v;
    Tensor::from_vec(data, t.shape()).unwrap()
}

#[test]
fn the_mtp_gradients_match_finite_differences() {
    // Every token to every expert: a step of the router's weights then changes the routing
    // weights only, never the choice (which has no gradient and would jump the loss).
    let model = model(1, 4);
    let params = model.init_params(7).unwrap();
    let mtp: Vec<String> = model
        .spec()
        .params
        .iter()
        .filter(|p| p.trainable && p.name.starts_with("mtp."))
        .map(|p| p.name.clone())
        .collect();
    assert!(mtp.len() > 20, "{mtp:?}");
    let leaves: HashMap<String, Tensor> = params
        .iter()
        .map(|(k, v)| {
            let leaf = v.detach();
            let leaf = if mtp.contains(k) {
                leaf.requires_grad_()
            } else {
                leaf
            };
            (k.clone(), leaf)
        })
        .collect();
    let leaves = Arc::new(leaves);
    let out = forward(&model, &leaves, &training());
    let loss = named(&out.aux_losses, "mtp").expect("an mtp loss");
    // Reported as the statistic too, with the loss's value.
    let stat = named(&out.stats, "mtp_loss").expect("an mtp_loss statistic");
    assert_eq!(stat.item().unwrap(), loss.item().unwrap());
    loss.backward().unwrap();
    let eps = 1e-2f32;
    let mut worst = 0f64;
    for name in &mtp {
        let g = leaves[name]
            .grad()
            .unwrap_or_else(|| panic!("{name}: no gradient"))
            .to_vec_f32();
        // The element of the largest gradient, where the difference is far above rounding.
        let (i, &gi) = g
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
            .unwrap();
        let x = params[name].to_vec_f32()[i];
        let at = |v: f32| {
            let mut p = params.clone();
            p.insert(name.clone(), with(&params[name], i, v));
            mtp_loss(&model, &p)
        };
        let fd = (at(x + eps) - at(x - eps)) / (2.0 * eps as f64);
        let rel = (fd - gi as f64).abs() / (gi.abs() as f64).max(1e-3);
        println!("{name}[{i}]: autograd {gi:e}, finite differences {fd:e}, relative {rel:e}");
        worst = worst.max(rel);
        assert!(rel < 2e-2, "{name}[{i}]: autograd {gi} vs {fd}");
    }
    println!("worst relative difference {worst:e}");
}

#[test]
fn the_main_model_is_untouched_by_the_mtp_module() {
    let (with_mtp, without) = (model(1, 2), model(0, 2));
    let params = with_mtp.init_params(3).unwrap();
    let main: HashMap<String, Tensor> = without
        .spec()
        .params
        .iter()
        .map(|p| (p.name.clone(), params[&p.name].clone()))
        .collect();
    // The same seed draws the main model's weights alike with and without the module.
    let fresh = without.init_params(3).unwrap();
    for (k, v) in &main {
        assert_eq!(v.to_vec_f32(), fresh[k].to_vec_f32(), "{k}");
    }
    let leaves = |names: &HashMap<String, Tensor>| -> Params {
        Arc::new(
            names
                .iter()
                .map(|(k, v)| (k.clone(), v.detach().requires_grad_()))
                .collect(),
        )
    };
    let (a, b) = (leaves(&params), leaves(&main));
    let (out_a, out_b) = (
        forward(&with_mtp, &a, &training()),
        forward(&without, &b, &training()),
    );
    assert_eq!(out_a.logits.to_vec_f32(), out_b.logits.to_vec_f32());
    assert!(named(&out_a.aux_losses, "mtp").is_some());
    assert!(named(&out_b.aux_losses, "mtp").is_none());
    // The main loss: the same gradients for every main parameter, none for the module.
    let main_loss = |logits: &Tensor| {
        use anneal_engine::ops::{cross_entropy, CrossEntropy};
        let inputs = logits.narrow(1, 0, 19).unwrap().reshape(&[38, 64]).unwrap();
        let targets = tokens()
            .narrow(1, 1, 19)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape(&[38])
            .unwrap();
        cross_entropy(&inputs, &targets, &CrossEntropy::default()).unwrap()
    };
    main_loss(&out_a.logits).backward().unwrap();
    main_loss(&out_b.logits).backward().unwrap();
    for (k, leaf) in b.iter() {
        let (ga, gb) = (a[k].grad(), leaf.grad());
        assert_eq!(
            ga.map(|g| g.to_vec_f32()),
            gb.map(|g| g.to_vec_f32()),
            "{k}"
        );
    }
    for (k, leaf) in a.iter().filter(|(k, _)| k.starts_with("mtp.")) {
        assert!(leaf.grad().is_none(), "{k}: a gradient from the main loss");
    }

    // At inference the module does not run: no loss, the same logits, log-probabilities and
    // generations.
    let (a, b) = (Arc::new(params.clone()), Arc::new(main));
    let out = forward(&with_mtp, &a, &ForwardOpts::default());
    assert!(out.aux_losses.is_empty() && named(&out.stats, "mtp_loss").is_none());
    assert_eq!(
        out.logits.to_vec_f32(),
        forward(&without, &b, &ForwardOpts::default())
            .logits
            .to_vec_f32()
    );
    let ids = tokens().narrow(0, 0, 1).unwrap().to_vec::<i64>();
    assert_eq!(
        infer::logprobs(&with_mtp, &a, &ids).unwrap(),
        infer::logprobs(&without, &b, &ids).unwrap()
    );
    let s = Sampling {
        temperature: 0.8,
        seed: 5,
        ..Default::default()
    };
    let (ga, gb) = (
        infer::generate(&with_mtp, &a, &ids[..12], 10, &s).unwrap(),
        infer::generate(&without, &b, &ids[..12], 10, &s).unwrap(),
    );
    assert_eq!((ga.tokens, ga.logprobs), (gb.tokens, gb.logprobs));
}

#[test]
fn the_mtp_weights_export_under_deepseeks_names_and_read_back() {
    let model = model(1, 2);
    let params = model.init_params(11).unwrap();
    let out = std::env::temp_dir().join(format!("anneal-dsv4-mtp-export-{}", std::process::id()));
    hf::export(&out, model.spec(), &params, None).unwrap();
    let written = anneal_engine::io::load_safetensors(out.join("model.safetensors")).unwrap();
    for name in [
        "mtp.0.e_proj.weight",
        "mtp.0.h_proj.weight",
        "mtp.0.enorm.weight",
        "mtp.0.hnorm.weight",
        "mtp.0.norm.weight",
        "mtp.0.hc_head_fn",
        "mtp.0.attn.wq_a.weight",
        "mtp.0.ffn.experts.3.w2.weight",
        "mtp.0.ffn.gate.bias",
    ] {
        assert!(written.contains_key(name), "{name} not written");
    }
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["num_nextn_predict_layers"], 1);
    let back = hf::load_params(&out, model.spec()).unwrap();
    for (k, v) in &params {
        assert_eq!(back[k].to_vec_f32(), v.to_vec_f32(), "{k}");
    }
    let _ = std::fs::remove_dir_all(&out);
}
