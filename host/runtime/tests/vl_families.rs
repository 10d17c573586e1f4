//! The vision families on 1-D positions against transformers: Muse Glimmer (`muse_glimmer`,
//! `MuseGlimmerForConditionalGeneration`: windowed attention, bilinear positions), Muse Spark
//! Open (`muse_spark`: the same tower before gated-residual, latent-MoE blocks) and Kimi K2.7
//! (`kimi_k25`, `Kimi_K25ForConditionalGeneration`: MoonViT3d, bicubic positions, the released
//! checkpoints' fused RoPE-interleaved `wqkv`), from `expected_vl.safetensors` of their tiny
//! fixtures (written by `tests/reference/make_hf_fixtures.py`): the tower's merged embeddings
//! for two images (an 8 × 8 grid and a 4 × 8 one), the logits of a prompt holding both, the
//! loss and every gradient, the tower's included, decode after the images against the full
//! forward, and export back to the checkpoint's names.

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::Tensor;
use anneal_runtime::plugins::ForwardOpts;
use common::{
    assert_gradients_match, assert_prefill_then_decode, fixture, fixture_images, leaves,
    max_abs_diff, model_for, next_token_loss, positions,
};
use std::collections::BTreeMap;

const NAMES: [&str; 3] = ["tiny_muse_glimmer", "tiny_kimi_k25", "tiny_muse_spark"];

fn expected(name: &str) -> BTreeMap<String, Tensor> {
    load_safetensors(fixture(name).join("expected_vl.safetensors")).unwrap()
}

fn with_images(exp: &BTreeMap<String, Tensor>) -> ForwardOpts {
    ForwardOpts {
        images: Some(fixture_images(exp)),
        ..Default::default()
    }
}

#[test]
fn vision_tower_and_logits_with_images_match_transformers() {
    for name in NAMES {
        let (model, params) = model_for(&fixture(name));
        let exp = expected(name);
        let tokens = &exp["vl_tokens"];
        let t = tokens.shape()[1];
        let hidden = model
            .embed(&params, tokens, &positions(0, t), &with_images(&exp))
            .unwrap();
        assert_eq!(hidden.len(), 1, "the hidden state only: positions stay 1-D");
        let rows = hidden[0].to_vec_f32();
        let image_token = 95;
        let picked: Vec<f32> = tokens
            .to_vec::<i64>()
            .iter()
            .enumerate()
            .filter(|(_, &id)| id == image_token)
            .flat_map(|(r, _)| rows[r * 64..(r + 1) * 64].to_vec())
            .collect();
        let d = max_abs_diff(&picked, &exp["image_embeds"].to_vec_f32());
        println!("{name}: image embeddings: max |difference| {d:e}");
        assert!(d <= 1e-4, "{name}: max |difference| {d}");
        let logits = model
            .forward(&params, tokens, &positions(0, t), &with_images(&exp))
            .unwrap();
        let d = max_abs_diff(&logits.to_vec_f32(), &exp["vl_logits"].to_vec_f32());
        println!("{name}: logits with images: max |difference| {d:e}");
        assert!(d <= 1e-4, "{name}: max |logit difference| {d}");
        let plain = model
            .forward(&params, tokens, &positions(0, t), &ForwardOpts::default())
            .unwrap();
        assert!(max_abs_diff(&plain.to_vec_f32(), &exp["vl_logits"].to_vec_f32()) > 1e-2);
    }
}

#[test]
fn loss_and_every_gradient_with_images_match_transformers() {
    for name in NAMES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let exp = expected(name);
        let tokens = &exp["vl_tokens"];
        let leaves = leaves(&params);
        let opts = ForwardOpts {
            training: true,
            ..with_images(&exp)
        };
        let logits = model
            .forward(&leaves, tokens, &positions(0, tokens.shape()[1]), &opts)
            .unwrap();
        let loss = next_token_loss(&logits, tokens);
        let (ours, want) = (loss.item().unwrap(), exp["vl_loss"].to_vec_f32()[0]);
        assert!((ours - want).abs() <= 1e-5, "{name}: loss {ours} vs {want}");
        loss.backward().unwrap();
        let (worst, compared) = assert_gradients_match(name, &dir, &model, &leaves, &exp, 1e-4);
        let trainable = model.spec().params.iter().filter(|p| p.trainable).count();
        assert_eq!(compared, trainable);
        println!(
            "{name}: |loss difference| {:e}, worst relative gradient difference {worst:e}",
            (ours - want).abs()
        );
    }
}

#[test]
fn decode_after_the_images_follows_the_full_forward() {
    for name in NAMES {
        let (model, params) = model_for(&fixture(name));
        let exp = expected(name);
        let tokens = &exp["vl_tokens"];
        let full = exp["vl_logits"].to_vec_f32();
        let prefill = 34; // past both images (3 + 16 + 6 + 8 tokens)
        assert_prefill_then_decode(
            name,
            &model,
            &params,
            tokens,
            &full,
            prefill,
            with_images(&exp),
        );
    }
}

/// Export writes a checkpoint that imports back to the same tensors, with the checkpoint's names
/// and shapes and its vision config; `ANNEAL_VL_EXPORT=DIR` keeps it under `DIR/<fixture>` for
/// `tests/reference/check_vl_export.py`, which reloads it in transformers.
#[test]
fn export_imports_back_with_its_vision_config() {
    for name in NAMES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let (cfg, orig) = common::assert_export_round_trip(name, &dir, &model, &params);
        for key in [
            "model_type",
            "architectures",
            "image_token_id",
            "out_hidden_size",
        ] {
            assert_eq!(cfg[key], orig[key], "{key}");
        }
        assert_eq!(
            cfg["vision_config"]["layer_types"],
            orig["vision_config"]["layer_types"]
        );
        assert_eq!(
            cfg["text_config"]["layer_rope_theta"],
            orig["text_config"]["layer_rope_theta"]
        );
    }
}
