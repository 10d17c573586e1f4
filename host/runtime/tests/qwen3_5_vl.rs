//! Qwen3.5 and Qwen3.5-MoE with vision (`qwen3_5` / `qwen3_5_moe` checkpoints of transformers'
//! `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`) against
//! transformers (fixtures written by `tests/reference/make_vl_fixture.py --qwen3-5`): the tower's
//! merged embeddings for two images of different sizes (one resized by the processor, the
//! pixels `tiny_qwen3_vl`'s); the 3-D positions of a prompt holding both; the logits of a text
//! prompt and of that prompt, through Gated DeltaNet and gated full attention turned by
//! interleaved MRoPE on half of each head; the loss and every gradient; export and import back
//! (`ANNEAL_VL_EXPORT` keeps the exports for `tests/reference/check_vl_export.py`); decode after
//! the image prompt against the full forward.

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::Tensor;
use anneal_runtime::plugins::{ForwardOpts, ImageInputs};
use common::{
    assert_export_round_trip, assert_gradients_match, assert_prefill_then_decode, fixture,
    fixture_images, leaves, max_abs_diff, model_for, next_token_loss, positions,
};
use std::sync::Arc;

const IMAGE_TOKEN: i64 = 90;

/// The dense model and the MoE one (experts saved per expert), each with its own expectations.
const FIXTURES: [&str; 2] = ["tiny_qwen3_5_vl", "tiny_qwen3_5_moe_vl"];

/// The processor's output for the two images, which these fixtures share with `tiny_qwen3_vl`.
fn images() -> Arc<ImageInputs> {
    fixture_images(
        &load_safetensors(fixture("tiny_qwen3_vl").join("expected.safetensors")).unwrap(),
    )
}

fn with_images() -> ForwardOpts {
    ForwardOpts {
        images: Some(images()),
        ..Default::default()
    }
}

#[test]
fn vision_tower_matches_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
        // The two images' placeholders (2 and 4 tokens) apart by one text token.
        let ids = [
            IMAGE_TOKEN,
            IMAGE_TOKEN,
            1,
            IMAGE_TOKEN,
            IMAGE_TOKEN,
            IMAGE_TOKEN,
            IMAGE_TOKEN,
        ];
        let image_rows = [0, 1, 3, 4, 5, 6];
        let tokens = Tensor::from_vec(ids.to_vec(), &[1, ids.len()]).unwrap();
        let hidden = model
            .embed(&params, &tokens, &positions(0, ids.len()), &with_images())
            .unwrap();
        assert_eq!(
            hidden.len(),
            2,
            "{name}: hidden state and 3-D positions only"
        );
        assert_eq!(
            hidden[1].to_vec_f32(),
            [0., 0., 2., 3., 3., 3., 3., 0., 0., 2., 3., 3., 4., 4., 0., 1., 2., 3., 4., 3., 4.]
        );
        assert_eq!(hidden[0].shape(), [1, ids.len(), 32]);
        let rows = hidden[0].to_vec_f32();
        let picked: Vec<f32> = image_rows
            .iter()
            .flat_map(|&r| rows[r * 32..(r + 1) * 32].to_vec())
            .collect();
        let d = max_abs_diff(&picked, &exp["image_embeds"].to_vec_f32());
        println!("{name}: image embeddings: max |difference| {d:e}");
        assert!(d <= 1e-4, "{name}: max |difference| {d}");
    }
}

#[test]
fn text_logits_match_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
        let tokens = &exp["tokens"];
        let t = tokens.shape()[1];
        let logits = model
            .forward(&params, tokens, &positions(0, t), &ForwardOpts::default())
            .unwrap();
        let d = max_abs_diff(&logits.to_vec_f32(), &exp["logits"].to_vec_f32());
        println!("{name}: text logits: max |difference| {d:e}");
        assert!(d <= 1e-4, "{name}: max |logit difference| {d}");
    }
}

#[test]
fn positions_and_logits_with_images_match_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
        let tokens = &exp["vl_tokens"];
        let t = tokens.shape()[1];
        // transformers' get_rope_index.
        let hidden = model
            .embed(&params, tokens, &positions(0, t), &with_images())
            .unwrap();
        let want: Vec<f32> = exp["vl_positions"]
            .to_vec::<i64>()
            .iter()
            .map(|&p| p as f32)
            .collect();
        assert_eq!(hidden[1].to_vec_f32(), want, "{name}: 3-D positions");
        let logits = model
            .forward(&params, tokens, &positions(0, t), &with_images())
            .unwrap();
        assert_eq!(logits.shape(), exp["vl_logits"].shape());
        let d = max_abs_diff(&logits.to_vec_f32(), &exp["vl_logits"].to_vec_f32());
        println!("{name}: logits with images: max |difference| {d:e}");
        assert!(d <= 1e-4, "{name}: max |logit difference| {d}");
        // Without the images the same prompt gives other logits: the features reach the model.
        let plain = model
            .forward(&params, tokens, &positions(0, t), &ForwardOpts::default())
            .unwrap();
        assert!(max_abs_diff(&plain.to_vec_f32(), &exp["vl_logits"].to_vec_f32()) > 1e-2);
    }
}

/// The mean next-token loss of the prompt with both images, and its gradient for every
/// parameter (the vision tower, the merger, the Gated DeltaNet and attention blocks, the
/// experts), against transformers' (`grads.safetensors`).
#[test]
fn loss_and_every_gradient_with_images_match_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
        let grads = load_safetensors(dir.join("grads.safetensors")).unwrap();
        let tokens = &exp["vl_tokens"];
        let leaves = leaves(&params);
        let opts = ForwardOpts {
            training: true,
            ..with_images()
        };
        let logits = model
            .forward(&leaves, tokens, &positions(0, tokens.shape()[1]), &opts)
            .unwrap();
        let loss = next_token_loss(&logits, tokens);
        let (ours, want) = (loss.item().unwrap(), grads["vl_loss"].to_vec_f32()[0]);
        assert!((ours - want).abs() <= 1e-5, "{name}: loss {ours} vs {want}");
        loss.backward().unwrap();
        let (worst, compared) = assert_gradients_match(name, &dir, &model, &leaves, &grads, 1e-4);
        // Every parameter has its reference, the vision tower's and the experts' included.
        let trainable = model.spec().params.iter().filter(|p| p.trainable).count();
        assert_eq!(compared, trainable, "{name}");
        assert!(model
            .spec()
            .params
            .iter()
            .any(|p| p.name.starts_with("visual.")));
        println!(
            "{name}: |loss difference| {:e}, worst relative gradient difference {worst:e}",
            (ours - want).abs()
        );
    }
}

/// Export writes a checkpoint that imports back to the same tensors, with transformers' names
/// and shapes and a `config.json` holding the vision config (no DeepStack key), the image
/// tokens and the MRoPE sections; `ANNEAL_VL_EXPORT=DIR` keeps each under `DIR/<fixture>` for
/// `tests/reference/check_vl_export.py`, which reloads it in transformers.
#[test]
fn export_imports_back_with_its_vision_config() {
    for name in FIXTURES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let (cfg, orig) = assert_export_round_trip(name, &dir, &model, &params);
        for key in [
            "model_type",
            "architectures",
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
            "tie_word_embeddings",
        ] {
            assert_eq!(cfg[key], orig[key], "{name}: {key}");
        }
        for key in [
            "model_type",
            "depth",
            "hidden_size",
            "num_heads",
            "intermediate_size",
            "out_hidden_size",
            "patch_size",
            "temporal_patch_size",
            "spatial_merge_size",
            "num_position_embeddings",
            "hidden_act",
            "rope_parameters",
            "deepstack_visual_indexes",
        ] {
            assert_eq!(
                cfg["vision_config"][key], orig["vision_config"][key],
                "{name}: vision_config.{key}"
            );
        }
        for key in [
            "model_type",
            "layer_types",
            "head_dim",
            "num_experts",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        ] {
            assert_eq!(
                cfg["text_config"][key], orig["text_config"][key],
                "{name}: text_config.{key}"
            );
        }
        for key in [
            "mrope_section",
            "mrope_interleaved",
            "partial_rotary_factor",
        ] {
            assert_eq!(
                cfg["text_config"]["rope_parameters"][key],
                orig["text_config"]["rope_parameters"][key],
                "{name}: text_config.rope_parameters.{key}"
            );
        }
    }
}

/// Prefill past both images with a cache (Gated DeltaNet states and the attention layer's
/// keys and values), then decode token by token: the positions continue the images' (the
/// prompt's MRoPE delta), every step within 1e-4 of transformers' full forward.
#[test]
fn decode_after_an_image_prompt_continues_its_positions() {
    for name in FIXTURES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
        let tokens = &exp["vl_tokens"];
        let full = exp["vl_logits"].to_vec_f32();
        let prefill = 15; // past both images
        assert_prefill_then_decode(name, &model, &params, tokens, &full, prefill, with_images());
    }
}
