//! Qwen3-VL against transformers (fixture written by tests/reference/make_vl_fixture.py): the
//! vision tower's merged image embeddings and DeepStack features for two images of different
//! sizes (one resized by the processor), reached through the `embed` stage with every token a
//! placeholder; the text model's logits; images the model cannot place are refused.

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::Tensor;
use anneal_runtime::plugins::{ForwardOpts, ImageInputs};
use common::{fixture, max_abs_diff, model_for, positions};
use std::collections::BTreeMap;
use std::sync::Arc;

const IMAGE_TOKEN: i64 = 90;

fn images(exp: &BTreeMap<String, Tensor>) -> Arc<ImageInputs> {
    let grid: Vec<i64> = exp["image_grid_thw"]
        .to_dtype(anneal_engine::DType::F32)
        .unwrap()
        .to_vec_f32()
        .iter()
        .map(|&v| v as i64)
        .collect();
    Arc::new(ImageInputs {
        pixel_values: exp["pixel_values"].clone(),
        grid_thw: grid
            .chunks(3)
            .map(|g| [g[0] as usize, g[1] as usize, g[2] as usize])
            .collect(),
    })
}

#[test]
fn vision_tower_matches_transformers() {
    let dir = fixture("tiny_qwen3_vl");
    let (model, params) = model_for(&dir);
    let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
    let want = &exp["image_embeds"];
    let n = want.shape()[0];
    let tokens = Tensor::from_vec(vec![IMAGE_TOKEN; n], &[1, n]).unwrap();
    let opts = ForwardOpts {
        images: Some(images(&exp)),
        ..Default::default()
    };
    let hidden = model
        .embed(&params, &tokens, &positions(0, n), &opts)
        .unwrap();
    assert_eq!(
        hidden.len(),
        3,
        "the hidden state and two DeepStack features"
    );
    let names = ["image_embeds", "deepstack.0", "deepstack.1"];
    for (got, name) in hidden.iter().zip(names) {
        assert_eq!(got.shape(), [1, n, 32], "{name}");
        let d = max_abs_diff(&got.to_vec_f32(), &exp[name].to_vec_f32());
        println!("{name}: max |difference| {d:e}");
        assert!(d <= 1e-4, "{name}: max |difference| {d}");
    }
}

#[test]
fn text_logits_match_transformers() {
    let dir = fixture("tiny_qwen3_vl");
    let (model, params) = model_for(&dir);
    let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
    let tokens = &exp["tokens"];
    let t = tokens.shape()[1];
    let logits = model
        .forward(&params, tokens, &positions(0, t), &ForwardOpts::default())
        .unwrap();
    let d = max_abs_diff(&logits.to_vec_f32(), &exp["logits"].to_vec_f32());
    println!("text logits: max |difference| {d:e}");
    assert!(d <= 1e-4, "max |logit difference| {d}");
}

#[test]
fn images_that_do_not_fit_are_refused() {
    let dir = fixture("tiny_qwen3_vl");
    let (model, params) = model_for(&dir);
    let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
    let opts = ForwardOpts {
        images: Some(images(&exp)),
        ..Default::default()
    };
    // Five placeholders for six image tokens.
    let mut ids = vec![IMAGE_TOKEN; 5];
    ids.push(3);
    let tokens = Tensor::from_vec(ids, &[1, 6]).unwrap();
    let err = model
        .forward(&params, &tokens, &positions(0, 6), &opts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("masked_scatter") && err.contains("6"), "{err}");
    // A grid that does not cover the pixel rows.
    let mut bad = (*images(&exp)).clone();
    bad.grid_thw[1] = [1, 2, 2];
    let opts = ForwardOpts {
        images: Some(Arc::new(bad)),
        ..Default::default()
    };
    let err = model
        .forward(&params, &tokens, &positions(0, 6), &opts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("pixel_values has 24 patch rows"), "{err}");
}
