//! Muse Spark Open's audio input against transformers: `tiny_muse_spark`'s raw-waveform tower
//! (two stages of strided patch embeddings and causal depthwise convolution blocks) on two
//! clips of different lengths, from `expected_audio.safetensors` (written by
//! `tests/reference/make_audio_fixture.py`): the audio embeddings in their placeholders, the
//! logits of a prompt holding both clips, the loss and every gradient (the tower's included),
//! decode after the audio against the full forward, a clip alone giving its batch rows, and the
//! refusals (placeholders that do not match the clips, a model without an audio tower).

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::Tensor;
use anneal_runtime::plugins::{AudioInputs, ForwardOpts};
use common::{
    assert_gradients_match, assert_prefill_then_decode, fixture, leaves, max_abs_diff, model_for,
    next_token_loss, positions,
};
use std::collections::BTreeMap;
use std::sync::Arc;

const NAME: &str = "tiny_muse_spark";
const AUDIO_TOKEN: i64 = 93;
const DIM: usize = 64;

fn expected() -> BTreeMap<String, Tensor> {
    load_safetensors(fixture(NAME).join("expected_audio.safetensors")).unwrap()
}

/// The fixture's clips: the feature extractor's padded waveforms and each clip's length.
fn audio(exp: &BTreeMap<String, Tensor>) -> Arc<AudioInputs> {
    Arc::new(AudioInputs {
        input_values: exp["input_values"].clone(),
        lengths: exp["audio_lengths"]
            .to_vec::<i64>()
            .iter()
            .map(|&n| n as usize)
            .collect(),
    })
}

fn with_audio(exp: &BTreeMap<String, Tensor>) -> ForwardOpts {
    ForwardOpts {
        audio: Some(audio(exp)),
        ..Default::default()
    }
}

/// The rows of the embedding stage's output at the audio placeholders, in order.
fn audio_rows(hidden: &Tensor, tokens: &Tensor) -> Vec<f32> {
    let rows = hidden.to_vec_f32();
    tokens
        .to_vec::<i64>()
        .iter()
        .enumerate()
        .filter(|(_, &id)| id == AUDIO_TOKEN)
        .flat_map(|(r, _)| rows[r * DIM..(r + 1) * DIM].to_vec())
        .collect()
}

#[test]
fn audio_tower_and_logits_with_audio_match_transformers() {
    let (model, params) = model_for(&fixture(NAME));
    let exp = expected();
    let tokens = &exp["tokens"];
    let t = tokens.shape()[1];
    let hidden = model
        .embed(&params, tokens, &positions(0, t), &with_audio(&exp))
        .unwrap();
    assert_eq!(hidden.len(), 1, "the hidden state only: positions stay 1-D");
    let d = max_abs_diff(
        &audio_rows(&hidden[0], tokens),
        &exp["audio_embeds"].to_vec_f32(),
    );
    println!("{NAME}: audio embeddings: max |difference| {d:e}");
    assert!(d <= 1e-4, "max |audio embedding difference| {d}");
    let logits = model
        .forward(&params, tokens, &positions(0, t), &with_audio(&exp))
        .unwrap();
    let d = max_abs_diff(&logits.to_vec_f32(), &exp["logits"].to_vec_f32());
    println!("{NAME}: logits with audio: max |difference| {d:e}");
    assert!(d <= 1e-4, "max |logit difference| {d}");
    // The audio reaches the logits: without it the same tokens score otherwise.
    let plain = model
        .forward(&params, tokens, &positions(0, t), &ForwardOpts::default())
        .unwrap();
    assert!(max_abs_diff(&plain.to_vec_f32(), &exp["logits"].to_vec_f32()) > 1e-2);
}

#[test]
fn loss_and_every_gradient_with_audio_match_transformers() {
    let dir = fixture(NAME);
    let (model, params) = model_for(&dir);
    let exp = expected();
    let tokens = &exp["tokens"];
    let leaves = leaves(&params);
    let opts = ForwardOpts {
        training: true,
        ..with_audio(&exp)
    };
    let logits = model
        .forward(&leaves, tokens, &positions(0, tokens.shape()[1]), &opts)
        .unwrap();
    let loss = next_token_loss(&logits, tokens);
    let (ours, want) = (loss.item().unwrap(), exp["loss"].to_vec_f32()[0]);
    assert!((ours - want).abs() <= 1e-5, "loss {ours} vs {want}");
    loss.backward().unwrap();
    let (worst, compared) = assert_gradients_match(NAME, &dir, &model, &leaves, &exp, 1e-4);
    let trainable = model.spec().params.iter().filter(|p| p.trainable).count();
    assert_eq!(compared, trainable);
    // The tower trains: every one of its parameters has a gradient.
    let tower: Vec<&String> = leaves
        .keys()
        .filter(|n| n.starts_with("audio_tower."))
        .collect();
    assert!(!tower.is_empty());
    for name in tower {
        let g = leaves[name].grad().expect("a gradient").to_vec_f32();
        assert!(g.iter().any(|&x| x != 0.0), "{name}: no gradient");
    }
    println!(
        "{NAME}: |loss difference| {:e}, worst relative gradient difference {worst:e} over \
         {compared} parameters",
        (ours - want).abs()
    );
}

#[test]
fn decode_after_the_audio_follows_the_full_forward() {
    let (model, params) = model_for(&fixture(NAME));
    let exp = expected();
    let tokens = &exp["tokens"];
    let ids = tokens.to_vec::<i64>();
    let full = exp["logits"].to_vec_f32();
    // Past both clips' placeholders.
    let prefill = ids.iter().rposition(|&t| t == AUDIO_TOKEN).unwrap() + 1;
    assert!(prefill < ids.len());
    assert_prefill_then_decode(
        NAME,
        &model,
        &params,
        tokens,
        &full,
        prefill,
        with_audio(&exp),
    );
}

#[test]
fn a_clip_alone_gives_its_rows_of_the_batch() {
    let (model, params) = model_for(&fixture(NAME));
    let exp = expected();
    let batch = audio(&exp);
    // The second clip (56 samples, 7 tokens), padded only to its own length: the tower is
    // causal, so the batch's longer padding changes none of its tokens.
    let n = batch.lengths[1];
    let width = batch.input_values.shape()[1];
    let alone = AudioInputs {
        input_values: batch
            .input_values
            .narrow(0, 1, 1)
            .unwrap()
            .narrow(1, 0, n)
            .unwrap()
            .contiguous()
            .unwrap(),
        lengths: vec![n],
    };
    assert!(n < width && n.is_multiple_of(8));
    let tokens = Tensor::from_vec(vec![AUDIO_TOKEN; n / 8], &[1, n / 8]).unwrap();
    let opts = ForwardOpts {
        audio: Some(Arc::new(alone)),
        ..Default::default()
    };
    let hidden = model
        .embed(&params, &tokens, &positions(0, n / 8), &opts)
        .unwrap();
    let want = exp["audio_embeds"].to_vec_f32();
    let d = max_abs_diff(&hidden[0].to_vec_f32(), &want[want.len() - n / 8 * DIM..]);
    assert!(d <= 1e-6, "max |difference| {d}");
}

#[test]
fn placeholders_that_do_not_match_and_models_without_a_tower_are_refused() {
    let (model, params) = model_for(&fixture(NAME));
    let exp = expected();
    let ids = exp["tokens"].to_vec::<i64>();
    // One placeholder short.
    let at = ids.iter().position(|&t| t == AUDIO_TOKEN).unwrap();
    let mut short = ids.clone();
    short.remove(at);
    let tokens = Tensor::from_vec(short.clone(), &[1, short.len()]).unwrap();
    let e = model
        .forward(
            &params,
            &tokens,
            &positions(0, short.len()),
            &with_audio(&exp),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("19 audio placeholder tokens (id 93)") && e.contains("make 20"),
        "{e}"
    );
    // Rows that are not a whole number of audio tokens.
    let ragged = AudioInputs {
        input_values: Tensor::from_vec(vec![0.0f32; 12], &[1, 12]).unwrap(),
        lengths: vec![12],
    };
    let tokens = Tensor::from_vec(vec![AUDIO_TOKEN; 2], &[1, 2]).unwrap();
    let e = model
        .forward(
            &params,
            &tokens,
            &positions(0, 2),
            &ForwardOpts {
                audio: Some(Arc::new(ragged)),
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a multiple of the 8 samples"), "{e}");
    // Muse Glimmer has no audio tower.
    let (glimmer, glimmer_params) = model_for(&fixture("tiny_muse_glimmer"));
    let tokens = Tensor::from_vec(vec![1i64, 2, 3], &[1, 3]).unwrap();
    let e = glimmer
        .forward(
            &glimmer_params,
            &tokens,
            &positions(0, 3),
            &with_audio(&exp),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("takes no audio"), "{e}");
}
