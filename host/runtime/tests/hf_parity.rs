//! The model plugins against Hugging Face transformers (Llama, Qwen3, Qwen3-MoE and Mixtral from
//! the Llama plugin; gpt-oss, DeepSeek-V3 and Kimi K2.7, Qwen3.5, Muse Glimmer, Muse Spark and Kimi K3 from their own): the same weights give the same logits and gradients
//! (fixtures written by tests/reference/make_hf_fixtures.py), decode with a KV cache matches the
//! full forward bit for bit, recompute matches plain backward, and export/import round-trips.

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::Tensor;
use anneal_runtime::hf;
use anneal_runtime::plugins::{ForwardOpts, KvCache, PluginModel};
use common::{
    assert_decode_follows, assert_gradients_match, fixture, leaves, max_abs_diff, model_for,
    next_token_loss, plugin, positions,
};
use std::sync::Arc;

/// Every fixture with a transformers reference.
const FIXTURES: [&str; 18] = [
    "tiny_llama",
    "tiny_llama3_scaled",
    "tiny_qwen3",
    "tiny_qwen3_moe",
    "tiny_mixtral",
    "tiny_gpt_oss",
    "tiny_gpt_oss_other",
    "tiny_deepseek_v3",
    "tiny_deepseek_v3_plain_q",
    "tiny_kimi_linear",
    "tiny_kimi_linear_other",
    "tiny_qwen3_5",
    "tiny_qwen3_5_moe",
    "tiny_qwen3_5_other",
    "tiny_muse_glimmer",
    "tiny_kimi_k25",
    "tiny_muse_spark",
    "tiny_kimi_k3",
];

/// The linear-attention fixtures (rows of 150 to 200 tokens: the delta rule's 64-token chunks).
const LINEAR_ATTENTION: [&str; 6] = [
    "tiny_qwen3_5",
    "tiny_qwen3_5_moe",
    "tiny_qwen3_5_other",
    "tiny_kimi_linear",
    "tiny_kimi_linear_other",
    "tiny_kimi_k3",
];

#[test]
fn logits_match_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
        let tokens = &exp["tokens"];
        let t = tokens.shape()[1];
        let logits = model
            .forward(&params, tokens, &positions(0, t), &ForwardOpts::default())
            .unwrap();
        assert_eq!(logits.shape(), exp["logits"].shape(), "{name}");
        let d = max_abs_diff(&logits.to_vec_f32(), &exp["logits"].to_vec_f32());
        println!("{name}: max |logit difference| {d:e}");
        assert!(d <= 1e-4, "{name}: max |logit difference| {d}");
    }
}

#[test]
fn decode_with_kv_cache_matches_the_full_forward() {
    let dir = fixture("tiny_qwen3");
    let (model, params) = model_for(&dir);
    let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
    let tokens = exp["tokens"].narrow(0, 0, 1).unwrap();
    let t = tokens.shape()[1];
    let full = model
        .forward(&params, &tokens, &positions(0, t), &ForwardOpts::default())
        .unwrap()
        .to_vec_f32();
    let v = full.len() / t;
    let cache = Arc::new(KvCache::new());
    let opts = ForwardOpts {
        cache: Some(cache.clone()),
        ..Default::default()
    };
    let prefill = 6;
    let first = model
        .forward(
            &params,
            &tokens.narrow(1, 0, prefill).unwrap(),
            &positions(0, prefill),
            &opts,
        )
        .unwrap()
        .to_vec_f32();
    assert!(max_abs_diff(&first, &full[..prefill * v]) < 1e-4);
    assert_decode_follows(&model, &params, &tokens, prefill, &full, &opts, 1e-4);
    assert_eq!(cache.len(), t);
}

#[test]
fn linear_attention_decode_equals_the_full_forward_bitwise() {
    // A prefill that ends inside the second 64-token chunk, then one token at a time past the
    // next boundary. With batch-invariant kernels the host's convolution tail and recurrent
    // state give every step the bits of the full forward (the RL invariant); without them
    // (`--fast`: the delta rule's recurrence) every step stays within 1e-4.
    for invariant in [true, false] {
        let _inv = anneal_engine::invariant::set_batch_invariant(invariant);
        for name in LINEAR_ATTENTION {
            let dir = fixture(name);
            let (model, params) = model_for(&dir);
            let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
            let (t, prefill) = (140, 70);
            let tokens = exp["tokens"]
                .narrow(0, 1, 1)
                .unwrap()
                .narrow(1, 0, t)
                .unwrap();
            let full = model
                .forward(&params, &tokens, &positions(0, t), &ForwardOpts::default())
                .unwrap()
                .to_vec_f32();
            let v = full.len() / t;
            let same = |got: &[f32], want: &[f32], at: String| {
                if invariant {
                    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(got), bits(want), "{name}: {at}");
                } else {
                    let d = max_abs_diff(got, want);
                    assert!(d < 1e-4, "{name} (fast): {at}: {d}");
                }
            };
            let opts = ForwardOpts {
                cache: Some(Arc::new(KvCache::new())),
                ..Default::default()
            };
            let first = model
                .forward(
                    &params,
                    &tokens.narrow(1, 0, prefill).unwrap(),
                    &positions(0, prefill),
                    &opts,
                )
                .unwrap()
                .to_vec_f32();
            same(&first, &full[..prefill * v], "prefill".into());
            for pos in prefill..t {
                let step = model
                    .forward(
                        &params,
                        &tokens.narrow(1, pos, 1).unwrap(),
                        &positions(pos, 1),
                        &opts,
                    )
                    .unwrap()
                    .to_vec_f32();
                same(
                    &step,
                    &full[pos * v..(pos + 1) * v],
                    format!("position {pos}"),
                );
            }
        }
    }
}

#[test]
fn recompute_gives_identical_gradients() {
    let dir = fixture("tiny_llama");
    let (model, params) = model_for(&dir);
    let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
    let tokens = &exp["tokens"];
    let t = tokens.shape()[1];
    let run = |recompute: bool| {
        let leaves: std::collections::HashMap<String, Tensor> = params
            .iter()
            .map(|(k, v)| (k.clone(), v.detach().requires_grad_()))
            .collect();
        let leaves = Arc::new(leaves);
        let opts = ForwardOpts {
            training: true,
            recompute_every: recompute as usize,
            ..Default::default()
        };
        let logits = model
            .forward(&leaves, tokens, &positions(0, t), &opts)
            .unwrap();
        logits
            .mul(&logits)
            .unwrap()
            .mean_all()
            .unwrap()
            .backward()
            .unwrap();
        let mut names: Vec<&String> = leaves.keys().collect();
        names.sort();
        names
            .into_iter()
            .map(|n| leaves[n].grad().unwrap().to_vec_f32())
            .collect::<Vec<_>>()
    };
    assert_eq!(run(false), run(true));
}

#[test]
fn export_then_import_round_trips() {
    for name in [
        "tiny_qwen3_moe",
        "tiny_mixtral",
        "tiny_deepseek_v3",
        "tiny_deepseek_v3_plain_q",
    ] {
        export_round_trip_of(name);
    }
    for name in LINEAR_ATTENTION {
        let cfg = export_round_trip_of(name);
        let orig = hf::read_config(&fixture(name)).unwrap();
        for key in [
            "layer_types",
            "rope_parameters",
            "linear_conv_kernel_dim",
            "linear_num_value_heads",
            "shared_expert_intermediate_size",
            "tie_word_embeddings",
        ] {
            assert_eq!(cfg[key], orig[key], "{name}: {key}");
        }
    }
    let cfg = export_round_trip_of("tiny_gpt_oss");
    let orig = hf::read_config(&fixture("tiny_gpt_oss")).unwrap();
    for key in ["layer_types", "rope_parameters", "swiglu_limit", "head_dim"] {
        assert_eq!(cfg[key], orig[key], "tiny_gpt_oss: {key}");
    }
    for name in ["tiny_kimi_linear", "tiny_kimi_linear_other"] {
        let cfg = export_round_trip_of(name);
        let orig = hf::read_config(&fixture(name)).unwrap();
        for key in [
            "layer_types",
            "mlp_layer_types",
            "linear_num_heads",
            "linear_head_dim",
            "linear_conv_kernel_dim",
            "num_experts",
            "num_experts_per_token",
            "num_shared_experts",
            "num_expert_group",
            "topk_group",
            "moe_renormalize",
            "q_lora_rank",
            "rms_norm_eps",
            "model_max_length",
        ] {
            assert_eq!(cfg[key], orig[key], "{name}: {key}");
        }
    }
    // Muse Glimmer nests the decoder's and the tower's keys: each that names the architecture
    // comes back (not token ids the tiny vocabulary lacks, nor what transformers derives).
    let cfg = export_round_trip_of("tiny_muse_glimmer");
    let orig = hf::read_config(&fixture("tiny_muse_glimmer")).unwrap();
    for part in ["text_config", "vision_config"] {
        let skip: &[&str] = match part {
            "vision_config" => &["max_position_embeddings"],
            _ => &[],
        };
        assert_keys_come_back("tiny_muse_glimmer", &orig[part], &cfg[part], skip);
    }
    for key in [
        "out_hidden_size",
        "projector_hidden_size",
        "image_token_id",
        "video_token_id",
    ] {
        assert_eq!(cfg[key], orig[key], "tiny_muse_glimmer: {key}");
    }
    // Kimi K3: every key transformers reads back but those it derives.
    let cfg = export_round_trip_of("tiny_kimi_k3");
    let orig = hf::read_config(&fixture("tiny_kimi_k3")).unwrap();
    assert_keys_come_back("tiny_kimi_k3", &orig, &cfg, &["dtype", "torch_dtype"]);
    let cfg = export_round_trip_of("tiny_llama3_scaled");
    assert_eq!(cfg["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(cfg["tie_word_embeddings"], true);
}

/// Each key of `orig` (a transformers `config.json` or a part of one) is in `exported` with its
/// value, but for the values transformers derives or fills in (and `skip`).
fn assert_keys_come_back(
    name: &str,
    orig: &serde_json::Value,
    exported: &serde_json::Value,
    skip: &[&str],
) {
    let derived = [
        "transformers_version",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "initializer_range",
        "attention_dropout",
    ];
    for (k, v) in orig.as_object().unwrap() {
        if !derived.contains(&k.as_str()) && !skip.contains(&k.as_str()) {
            assert_eq!(&exported[k], v, "{name}: {k}");
        }
    }
}

/// Exports fixture `name`, imports it back and returns the exported `config.json`: the same
/// tensors (stacked experts split per expert and stacked back), and the same values as the
/// fixture for transformers' keys that name the architecture.
fn export_round_trip_of(name: &str) -> serde_json::Value {
    let (model, params) = model_for(&fixture(name));
    let out = std::env::temp_dir().join(format!("anneal-hf-export-{name}-{}", std::process::id()));
    hf::export(&out, model.spec(), &params, None).unwrap();
    let back = hf::load_params(&out, model.spec()).unwrap();
    for (k, v) in params.iter() {
        assert_eq!(back[k].to_vec_f32(), v.to_vec_f32(), "{name}: {k}");
    }
    let cfg = hf::read_config(&out).unwrap();
    let orig = hf::read_config(&fixture(name)).unwrap();
    for key in [
        "model_type",
        "num_experts_per_tok",
        "num_local_experts",
        "moe_intermediate_size",
        "intermediate_size",
        "norm_topk_prob",
        "mlp_only_layers",
        "sliding_window",
    ] {
        assert_eq!(cfg[key], orig[key], "{name}: {key}");
    }
    let _ = std::fs::remove_dir_all(&out);
    cfg
}

#[test]
fn missing_weights_are_named() {
    let dir = fixture("tiny_llama");
    let cfg = hf::read_config(&dir).unwrap();
    // A qwen3-shaped model wants q_norm weights the llama directory does not have.
    let mut cfg2 = cfg.clone();
    cfg2["model_type"] = "qwen3".into();
    let inst = plugin("llama")
        .create(None, &serde_json::json!({ "hf_config": cfg2 }))
        .unwrap();
    let model = PluginModel::new("llama", inst).unwrap();
    let err = hf::load_params(&dir, model.spec()).unwrap_err().to_string();
    assert!(
        err.contains("q_norm") && err.contains("tiny_llama"),
        "{err}"
    );
}

#[test]
fn loss_and_every_gradient_match_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
        let tokens = &exp["tokens"];
        let t = tokens.shape()[1];
        let leaves = leaves(&params);
        let opts = ForwardOpts {
            training: true,
            ..Default::default()
        };
        let logits = model
            .forward(&leaves, tokens, &positions(0, t), &opts)
            .unwrap();
        let loss = next_token_loss(&logits, tokens);
        let want = exp["loss"].to_vec_f32()[0];
        assert!(
            (loss.item().unwrap() - want).abs() <= 1e-5,
            "{name}: loss {} vs {want}",
            loss.item().unwrap()
        );
        println!(
            "{name}: |loss difference| {:e}",
            (loss.item().unwrap() - want).abs()
        );
        loss.backward().unwrap();
        let (worst, _) = assert_gradients_match(name, &dir, &model, &leaves, &exp, 1e-4);
        println!("{name}: worst relative gradient difference {worst:e}");
    }
}

#[test]
fn logprobs_match_transformers() {
    for name in [
        "tiny_llama",
        "tiny_qwen3",
        "tiny_qwen3_moe",
        "tiny_mixtral",
        "tiny_gpt_oss",
        "tiny_gpt_oss_other",
        "tiny_deepseek_v3",
        "tiny_deepseek_v3_plain_q",
        "tiny_kimi_linear",
        "tiny_kimi_linear_other",
        "tiny_qwen3_5",
        "tiny_qwen3_5_moe",
        "tiny_qwen3_5_other",
        "tiny_kimi_k3",
    ] {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
        let t = exp["tokens"].shape()[1];
        for row in 0..2 {
            let ids = exp["tokens"].narrow(0, row, 1).unwrap().to_vec::<i64>();
            let (lp, loss) = anneal_runtime::infer::logprobs(&model, &params, &ids).unwrap();
            let want = exp["logprobs"].narrow(0, row, 1).unwrap().to_vec_f32();
            assert!(max_abs_diff(&lp, &want) < 1e-4, "{name} row {row}");
            let want_loss = -want.iter().sum::<f32>() / (t - 1) as f32;
            assert!((loss - want_loss).abs() < 1e-5);
        }
    }
}

#[test]
fn generation_logprobs_equal_training_forward_bitwise_and_batch_invariant() {
    use anneal_runtime::infer::{generate, logprobs, Sampling};
    let dir = fixture("tiny_qwen3");
    let (model, params) = model_for(&dir);
    let prompt = [3i64, 14, 15, 92, 65];
    let s = Sampling {
        temperature: 1.0,
        seed: 11,
        ..Default::default()
    };
    let g = generate(&model, &params, &prompt, 12, &s).unwrap();
    assert_eq!(g.tokens.len(), 12);
    let mut full = prompt.to_vec();
    full.extend(&g.tokens);
    let (lp, _) = logprobs(&model, &params, &full).unwrap();
    let tail = &lp[prompt.len() - 1..];
    assert!(
        max_abs_diff(tail, &g.logprobs) < 1e-5,
        "decode-time logprobs vs the training forward's: {tail:?} vs {:?}",
        g.logprobs
    );
    // Same sampling seed, same tokens.
    assert_eq!(generate(&model, &params, &prompt, 12, &s).unwrap(), g);

    // A sequence alone and right-padded in a batch with a longer one: identical logits rows.
    let _inv = anneal_engine::invariant::set_batch_invariant(true);
    let short = &full[..9];
    let alone = model
        .forward(
            &params,
            &Tensor::from_slice(short, &[1, 9]).unwrap(),
            &positions(0, 9),
            &ForwardOpts::default(),
        )
        .unwrap();
    let mut batch = full.clone();
    batch.extend(short);
    batch.extend(std::iter::repeat_n(0i64, full.len() - 9));
    let both = model
        .forward(
            &params,
            &Tensor::from_slice(&batch, &[2, full.len()]).unwrap(),
            &positions(0, full.len()),
            &ForwardOpts::default(),
        )
        .unwrap();
    let in_batch = both.narrow(0, 1, 1).unwrap().narrow(1, 0, 9).unwrap();
    let d = max_abs_diff(&alone.to_vec_f32(), &in_batch.to_vec_f32());
    assert!(
        d < 1e-5,
        "a sequence's logits alone vs in a batch differ by {d}"
    );
}

#[test]
fn bitwise_parity_holds_across_tile_boundaries_and_for_llama() {
    use anneal_runtime::infer::{generate, logprobs, Sampling};
    for name in [
        "tiny_llama",
        "tiny_llama3_scaled",
        "tiny_qwen3_moe",
        "tiny_mixtral",
        "tiny_gpt_oss",
        "tiny_gpt_oss_other",
        "tiny_deepseek_v3",
        "tiny_kimi_linear",
        "tiny_kimi_linear_other",
        "tiny_qwen3_5",
        "tiny_qwen3_5_moe",
        "tiny_qwen3_5_other",
        "tiny_kimi_k3",
    ] {
        let (model, params) = model_for(&fixture(name));
        let prompt: Vec<i64> = (0..58).map(|i| (i * 37 + 5) % 96).collect();
        let s = Sampling {
            temperature: 0.9,
            top_k: 40,
            seed: 5,
            ..Default::default()
        };
        let g = generate(&model, &params, &prompt, 14, &s).unwrap();
        let mut full = prompt.clone();
        full.extend(&g.tokens);
        let (lp, _) = logprobs(&model, &params, &full).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&lp[prompt.len() - 1..]), bits(&g.logprobs), "{name}");
    }
}

#[test]
fn without_batch_invariance_decode_drifts() {
    // The test above can fail: with plain kernels a decode step (one row) takes other code paths
    // than the full forward and lands a few ulp away.
    let (model, params) = model_for(&fixture("tiny_llama"));
    let toks: Vec<i64> = (0..40).map(|i| (i * 37 + 5) % 96).collect();
    let full = model
        .forward(
            &params,
            &Tensor::from_slice(&toks, &[1, 40]).unwrap(),
            &positions(0, 40),
            &ForwardOpts::default(),
        )
        .unwrap();
    let cache = Arc::new(KvCache::new());
    let opts = ForwardOpts {
        cache: Some(cache),
        ..Default::default()
    };
    model
        .forward(
            &params,
            &Tensor::from_slice(&toks[..39], &[1, 39]).unwrap(),
            &positions(0, 39),
            &opts,
        )
        .unwrap();
    let step = model
        .forward(
            &params,
            &Tensor::from_slice(&toks[39..], &[1, 1]).unwrap(),
            &positions(39, 1),
            &opts,
        )
        .unwrap()
        .to_vec_f32();
    let row = full.narrow(1, 39, 1).unwrap().to_vec_f32();
    assert!(max_abs_diff(&step, &row) < 1e-4);
    assert_ne!(
        step, row,
        "plain mode unexpectedly bitwise equal; the invariance test would not detect a regression"
    );
}

#[test]
fn sharded_directories_load_like_single_files() {
    let dir = fixture("tiny_llama");
    let (model, params) = model_for(&dir);
    let tensors = hf::read_tensors(&dir).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let out = std::env::temp_dir().join(format!("anneal-hf-sharded-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(dir.join("config.json"), out.join("config.json")).unwrap();
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        let list: Vec<(&str, &Tensor)> = chunk.iter().map(|n| (n.as_str(), &tensors[*n])).collect();
        anneal_engine::io::save_safetensors(out.join(&file), &list).unwrap();
        for n in chunk {
            weight_map.insert(n.to_string(), file.clone().into());
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(out.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let back = hf::load_params(&out, model.spec()).unwrap();
    for (k, v) in params.iter() {
        assert_eq!(back[k].to_vec_f32(), v.to_vec_f32(), "{k}");
    }
    // A shard listed in the index but missing is named in the error.
    std::fs::remove_file(out.join("model-00002-of-00002.safetensors")).unwrap();
    let err = hf::load_params(&out, model.spec()).unwrap_err().to_string();
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn batched_generation_equals_one_prompt_at_a_time_bitwise() {
    use anneal_runtime::infer::{generate, generate_batch, Sampling};
    let (model, params) = model_for(&fixture("tiny_llama"));
    let prompts: Vec<Vec<i64>> = (0..5)
        .map(|r| (0..7).map(|i| (i * 31 + r * 17 + 3) % 96).collect())
        .collect();
    // Different settings per row, all with an end token.
    let samplings: Vec<Sampling> = (0..5)
        .map(|r| Sampling {
            temperature: if r == 2 { 0.0 } else { 0.8 + 0.1 * r as f32 },
            top_k: if r == 3 { 5 } else { 0 },
            seed: 40 + r as u64,
            eos: Some(7),
            ..Default::default()
        })
        .collect();
    let rows: Vec<&[i64]> = prompts.iter().map(|p| p.as_slice()).collect();
    let batch = generate_batch(&model, &params, &rows, 10, &samplings).unwrap();
    for (r, got) in batch.iter().enumerate() {
        let alone = generate(&model, &params, &prompts[r], 10, &samplings[r]).unwrap();
        assert_eq!(got, &alone, "row {r}");
    }
    assert!(batch.iter().any(|g| g.tokens.len() == 10));

    let uneven = [prompts[0].as_slice(), &prompts[1][..5]];
    let err = generate_batch(&model, &params, &uneven, 4, &samplings[..2]).unwrap_err();
    assert!(err.to_string().contains("same length"), "{err}");
}

#[test]
fn kimi_linear_reads_and_writes_the_released_checkpoint_layout() {
    // Moonshot's checkpoints keep the dense block's MLP under `mlp.` (transformers'
    // save_pretrained writes `block_sparse_moe.`) and give the layer pattern as
    // linear_attn_config's 1-based lists: the fixture's weights so laid out give transformers'
    // logits, and an export writes that layout back.
    let src = fixture("tiny_kimi_linear");
    let dir = std::env::temp_dir().join(format!("anneal-kimi-released-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = hf::read_config(&src).unwrap();
    let obj = cfg.as_object_mut().unwrap();
    obj.remove("layer_types");
    obj.remove("mlp_layer_types");
    obj.insert(
        "linear_attn_config".into(),
        serde_json::json!({"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 4,
                           "head_dim": 16, "short_conv_kernel_size": 4}),
    );
    obj.insert("first_k_dense_replace".into(), 1.into());
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let tensors = hf::read_tensors(&src).unwrap();
    let renamed: Vec<(String, &Tensor)> = tensors
        .iter()
        .map(|(k, v)| (k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."), v))
        .collect();
    assert!(renamed
        .iter()
        .any(|(k, _)| k == "model.layers.0.mlp.gate_proj.weight"));
    let list: Vec<(&str, &Tensor)> = renamed.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    anneal_engine::io::save_safetensors(dir.join("model.safetensors"), &list).unwrap();

    let (model, params) = model_for(&dir);
    let exp = load_safetensors(src.join("expected.safetensors")).unwrap();
    let t = exp["tokens"].shape()[1];
    let logits = model
        .forward(
            &params,
            &exp["tokens"],
            &positions(0, t),
            &ForwardOpts::default(),
        )
        .unwrap();
    let d = max_abs_diff(&logits.to_vec_f32(), &exp["logits"].to_vec_f32());
    assert!(d <= 1e-4, "max |logit difference| {d}");

    let out = dir.join("export");
    hf::export(&out, model.spec(), &params, None).unwrap();
    let back = hf::load_params(&out, model.spec()).unwrap();
    for (k, v) in params.iter() {
        assert_eq!(back[k].to_vec_f32(), v.to_vec_f32(), "{k}");
    }
    let written = hf::read_config(&out).unwrap();
    assert_eq!(written["linear_attn_config"], cfg["linear_attn_config"]);
    assert_eq!(written["first_k_dense_replace"], 1);
    assert!(written["mlp_layer_types"].is_null() && written["layer_types"].is_null());
    assert!(hf::read_tensors(&out)
        .unwrap()
        .contains_key("model.layers.0.mlp.down_proj.weight"));
    let _ = std::fs::remove_dir_all(&dir);
}
