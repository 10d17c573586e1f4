//! Qwen3-VL against transformers (fixture written by tests/reference/make_vl_fixture.py): the
//! vision tower's merged image embeddings and DeepStack features for two images of different
//! sizes (one resized by the processor), reached through the `embed` stage with every token a
//! placeholder; the logits of a text prompt and of a prompt holding both images (3-D MRoPE
//! positions, features in the placeholders, DeepStack); the loss of that prompt and every
//! gradient, the vision tower's included; export and import back; decode after an image prompt
//! against the full forward; images the model cannot place are refused.

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::Tensor;
use anneal_runtime::plugins::ForwardOpts;
use common::{
    assert_export_round_trip, assert_gradients_match, assert_prefill_then_decode, fixture,
    fixture_images, leaves, max_abs_diff, model_for, next_token_loss, positions,
};
use std::sync::Arc;

const IMAGE_TOKEN: i64 = 90;

/// The dense model and the MoE one (fused expert tensors), each with its own expectations.
const FIXTURES: [&str; 2] = ["tiny_qwen3_vl", "tiny_qwen3_vl_moe"];

#[test]
fn vision_tower_matches_transformers() {
    let dir = fixture("tiny_qwen3_vl");
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
    let opts = ForwardOpts {
        images: Some(fixture_images(&exp)),
        ..Default::default()
    };
    let hidden = model
        .embed(&params, &tokens, &positions(0, ids.len()), &opts)
        .unwrap();
    assert_eq!(
        hidden.len(),
        4,
        "hidden state, 3-D positions, two DeepStack features"
    );
    let got_positions: Vec<f32> = hidden[1].to_vec_f32();
    assert_eq!(
        got_positions,
        // time, height, width: the first image's 1 × 2 tokens from 0, text at 2, the second
        // image's 2 × 2 from 3.
        [0., 0., 2., 3., 3., 3., 3., 0., 0., 2., 3., 3., 4., 4., 0., 1., 2., 3., 4., 3., 4.]
    );
    for (got, name) in [&hidden[0], &hidden[2], &hidden[3]].into_iter().zip([
        "image_embeds",
        "deepstack.0",
        "deepstack.1",
    ]) {
        assert_eq!(got.shape(), [1, ids.len(), 32], "{name}");
        let rows = got.to_vec_f32();
        let picked: Vec<f32> = image_rows
            .iter()
            .flat_map(|&r| rows[r * 32..(r + 1) * 32].to_vec())
            .collect();
        let d = max_abs_diff(&picked, &exp[name].to_vec_f32());
        println!("{name}: max |difference| {d:e}");
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
fn logits_with_images_match_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
        let tokens = &exp["vl_tokens"];
        let t = tokens.shape()[1];
        let opts = ForwardOpts {
            images: Some(fixture_images(&exp)),
            ..Default::default()
        };
        let logits = model
            .forward(&params, tokens, &positions(0, t), &opts)
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
/// parameter (the vision tower, the mergers and the text decoder), against transformers'
/// (`grads.safetensors`, written by `make_vl_fixture.py --grads`).
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
            images: Some(fixture_images(&exp)),
            training: true,
            ..Default::default()
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
        println!(
            "{name}: |loss difference| {:e}, worst relative gradient difference {worst:e}",
            (ours - want).abs()
        );
    }
}

/// Export writes a checkpoint that imports back to the same tensors (the MoE model's experts
/// fused again), with the vision config and the image tokens transformers needs;
/// `ANNEAL_VL_EXPORT=DIR` keeps each under `DIR/<fixture>` for
/// `tests/reference/check_vl_export.py`, which reloads it in transformers.
#[test]
fn export_imports_back_with_its_vision_config() {
    for name in FIXTURES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let (cfg, orig) = assert_export_round_trip(name, &dir, &model, &params);
        for key in [
            "model_type",
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
            "tie_word_embeddings",
        ] {
            assert_eq!(cfg[key], orig[key], "{name}: {key}");
        }
        for key in [
            "depth",
            "hidden_size",
            "num_heads",
            "intermediate_size",
            "out_hidden_size",
            "patch_size",
            "temporal_patch_size",
            "spatial_merge_size",
            "num_position_embeddings",
            "deepstack_visual_indexes",
        ] {
            assert_eq!(
                cfg["vision_config"][key], orig["vision_config"][key],
                "{name}: vision_config.{key}"
            );
        }
        for key in ["model_type", "num_experts_per_tok", "moe_intermediate_size"] {
            assert_eq!(
                cfg["text_config"][key], orig["text_config"][key],
                "{name}: text_config.{key}"
            );
        }
        assert_eq!(
            cfg["text_config"]["rope_parameters"]["mrope_section"],
            orig["text_config"]["rope_parameters"]["mrope_section"]
        );
    }
}

#[test]
fn decode_after_an_image_prompt_continues_its_positions() {
    let dir = fixture("tiny_qwen3_vl");
    let (model, params) = model_for(&dir);
    let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
    let tokens = &exp["vl_tokens"];
    let full = exp["vl_logits"].to_vec_f32();
    let prefill = 15; // past both images
    let media = ForwardOpts {
        images: Some(fixture_images(&exp)),
        ..Default::default()
    };
    assert_prefill_then_decode(
        "tiny_qwen3_vl",
        &model,
        &params,
        tokens,
        &full,
        prefill,
        media,
    );
}

#[test]
fn images_that_do_not_fit_are_refused() {
    let dir = fixture("tiny_qwen3_vl");
    let (model, params) = model_for(&dir);
    let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
    let opts = ForwardOpts {
        images: Some(fixture_images(&exp)),
        ..Default::default()
    };
    // Five placeholders for the first image's two tokens.
    let mut ids = vec![IMAGE_TOKEN; 5];
    ids.push(3);
    let tokens = Tensor::from_vec(ids, &[1, 6]).unwrap();
    let err = model
        .forward(&params, &tokens, &positions(0, 6), &opts)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("image 0 has 2 placeholder tokens") && err.contains("has 5 in a row"),
        "{err}"
    );
    // A grid that does not cover the pixel rows.
    let mut bad = (*fixture_images(&exp)).clone();
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

/// Continuous batching with images: a request whose prompt holds both images is prefilled
/// with them, its first token is transformers' greedy one at transformers' logprob, and its
/// tokens and logprobs are the same bits alone and beside text requests joining at once.
#[test]
fn the_decode_loop_serves_a_prompt_with_images_alone_or_beside_text() {
    use anneal_runtime::infer::Sampling;
    use anneal_runtime::serving::{Request, Scheduler, SchedulerOptions};
    let dir = fixture("tiny_qwen3_vl");
    let (model, params) = model_for(&dir);
    let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
    let prompt = exp["vl_tokens"].to_vec::<i64>();
    let logits = exp["vl_logits"].to_vec_f32();
    let v = logits.len() / prompt.len();
    let last = &logits[logits.len() - v..];
    let greedy = (0..v).max_by(|&a, &b| last[a].total_cmp(&last[b])).unwrap();
    let request = |prompt: Vec<i64>, images| Request {
        prompt,
        max_new: 4,
        sampling: Sampling {
            temperature: 0.0,
            ..Sampling::default()
        },
        stop_tokens: vec![],
        top_logprobs: 0,
        images,
    };
    let sched = Scheduler::start(Arc::new(model), params, SchedulerOptions::default()).unwrap();
    let with_images = request(prompt.clone(), Some(fixture_images(&exp)));
    let alone = sched.complete(with_images.clone()).unwrap().generation;
    assert_eq!(alone.tokens[0], greedy as i64);
    let lse = anneal_engine::logsumexp(last);
    let want = (last[greedy] as f64 - lse) as f32;
    assert!(
        (alone.logprobs[0] - want).abs() <= 1e-4,
        "{} vs {want}",
        alone.logprobs[0]
    );
    // The same prompt without its images is another sequence (the placeholders embed as text).
    let blind = sched
        .complete(request(prompt.clone(), None))
        .unwrap()
        .generation;
    assert_ne!(blind.logprobs, alone.logprobs);
    // Beside text requests of the prompt's length and another length, all joining at once.
    let others = [
        request(prompt.iter().map(|&t| t % 90).collect(), None),
        request(vec![1, 2, 3], None),
    ];
    let rxs: Vec<_> = std::iter::once(with_images)
        .chain(others)
        .map(|r| sched.submit_channel(r).unwrap())
        .collect();
    let first: Vec<_> = rxs[0]
        .iter()
        .filter_map(|e| match e {
            anneal_runtime::serving::Event::Token(t) => Some((t.id, t.logprob.to_bits())),
            _ => None,
        })
        .collect();
    let bits: Vec<_> = alone
        .tokens
        .iter()
        .zip(&alone.logprobs)
        .map(|(&t, lp)| (t, lp.to_bits()))
        .collect();
    assert_eq!(first, bits);
    assert!(sched.stats().max_rows >= 2);
}
