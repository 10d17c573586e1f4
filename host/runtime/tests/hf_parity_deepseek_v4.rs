//! The DeepSeek-V4 plugin against Hugging Face transformers' `deepseek_v4`: tiny random
//! checkpoints (fixtures written by tests/reference/make_hf_fixtures.py: several compression
//! rates and block mixes, one and two residual streams, hash- and learned-routed experts, rows
//! long enough that compression, the indexer's top-k and the window all matter) give the same
//! logits, log-probabilities, loss and gradients, and export/import round-trips.

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::Tensor;
use anneal_runtime::hf;
use anneal_runtime::plugins::ForwardOpts;
use common::{fixture, max_abs_diff, model_for, next_token_loss, positions};
use std::collections::HashMap;
use std::sync::Arc;

const FIXTURES: [&str; 3] = [
    "tiny_deepseek_v4",
    "tiny_deepseek_v4_other",
    "tiny_deepseek_v4_yarn",
];

#[test]
fn logits_and_logprobs_match_transformers() {
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
        for row in 0..2 {
            let ids = tokens.narrow(0, row, 1).unwrap().to_vec::<i64>();
            let (lp, loss) = anneal_runtime::infer::logprobs(&model, &params, &ids).unwrap();
            let want = exp["logprobs"].narrow(0, row, 1).unwrap().to_vec_f32();
            let d = max_abs_diff(&lp, &want);
            assert!(d < 1e-4, "{name} row {row}: max |logprob difference| {d}");
            let want_loss = -want.iter().sum::<f32>() / (t - 1) as f32;
            assert!((loss - want_loss).abs() < 1e-5, "{name} row {row}");
        }
    }
}

#[test]
fn loss_and_every_gradient_match_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
        let tokens = &exp["tokens"];
        let t = tokens.shape()[1];
        let trainable: Vec<&str> = model
            .spec()
            .params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.name.as_str())
            .collect();
        let leaves: HashMap<String, Tensor> = params
            .iter()
            .map(|(k, v)| {
                let leaf = v.detach();
                let leaf = if trainable.contains(&k.as_str()) {
                    leaf.requires_grad_()
                } else {
                    leaf
                };
                (k.clone(), leaf)
            })
            .collect();
        let leaves = Arc::new(leaves);
        let opts = ForwardOpts {
            training: true,
            ..Default::default()
        };
        let logits = model
            .forward(&leaves, tokens, &positions(0, t), &opts)
            .unwrap();
        let loss = next_token_loss(&logits, tokens);
        let want = exp["loss"].to_vec_f32()[0];
        let got = loss.item().unwrap();
        println!("{name}: |loss difference| {:e}", (got - want).abs());
        assert!((got - want).abs() <= 1e-5, "{name}: loss {got} vs {want}");
        loss.backward().unwrap();
        let hf_grads: HashMap<String, Tensor> = exp
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("grad.")?.to_string(), v.clone())))
            .collect();
        let mut spec = model.spec().clone();
        spec.params.retain(|p| p.trainable);
        let want = hf::params_from_tensors(&dir, &hf_grads, &spec).unwrap();
        let largest = trainable
            .iter()
            .flat_map(|n| want[*n].to_vec_f32())
            .fold(0f32, |m, x| m.max(x.abs()));
        let mut worst = 0f32;
        for name_ in &trainable {
            let w = want[*name_].to_vec_f32();
            // The indexer's weights take no gradient through the top-k choice (zeros in the
            // fixture), so they may have none here either.
            let g = leaves[*name_]
                .grad()
                .map(|g| g.to_vec_f32())
                .unwrap_or_else(|| vec![0.0; w.len()]);
            // Relative to the parameter's own gradient, except where that is pure rounding:
            // with one stream the head's collapse is a scalar per token that the final RMSNorm
            // divides out again, leaving a gradient of order eps (1e-7 here) that both sides
            // compute as a difference of terms of order 1. Those are held to 1e-4 of the
            // model's largest gradient instead.
            let own = w.iter().fold(0f32, |m, x| m.max(x.abs()));
            let scale = if own < 1e-5 * largest { largest } else { own };
            let rel = max_abs_diff(&g, &w) / scale.max(1e-12);
            worst = worst.max(rel);
            assert!(
                rel <= 1e-4,
                "{name}: gradient of {name_}: relative difference {rel}"
            );
        }
        println!("{name}: worst relative gradient difference {worst:e}");
    }
}

#[test]
fn export_then_import_round_trips() {
    for name in FIXTURES {
        let (model, params) = model_for(&fixture(name));
        let out =
            std::env::temp_dir().join(format!("anneal-hf-export-{name}-{}", std::process::id()));
        hf::export(&out, model.spec(), &params, None).unwrap();
        let back = hf::load_params(&out, model.spec()).unwrap();
        for (k, v) in params.iter() {
            assert_eq!(back[k].to_vec_f32(), v.to_vec_f32(), "{name}: {k}");
        }
        let cfg = hf::read_config(&out).unwrap();
        let orig = hf::read_config(&fixture(name)).unwrap();
        for key in [
            "model_type",
            "layer_types",
            "mlp_layer_types",
            "compress_rates",
            "hc_mult",
            "sliding_window",
            "index_topk",
            "o_groups",
            "n_routed_experts",
            "num_experts_per_tok",
            "scoring_func",
            "tie_word_embeddings",
        ] {
            assert_eq!(cfg[key], orig[key], "{name}: {key}");
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn generation_logprobs_equal_the_training_forward_bitwise() {
    // `generate` decodes with the per-layer caches (window, compressed blocks, pending
    // compressor inputs, the indexer's keys); with batch-invariant kernels its
    // log-probabilities are the training forward's bits, across the 64-row tile boundary and
    // through blocks completing mid-generation.
    use anneal_runtime::infer::{generate, logprobs, Sampling};
    let _inv = anneal_engine::invariant::set_batch_invariant(true);
    for name in FIXTURES {
        let (model, params) = model_for(&fixture(name));
        let prompt: Vec<i64> = (0..58).map(|i| (i * 37 + 5) % 96).collect();
        let s = Sampling {
            temperature: 0.9,
            top_k: 40,
            seed: 5,
            ..Default::default()
        };
        let g = generate(&model, &params, &prompt, 14, &s).unwrap();
        assert_eq!(g.tokens.len(), 14, "{name}");
        let mut full = prompt.clone();
        full.extend(&g.tokens);
        let (lp, _) = logprobs(&model, &params, &full).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&lp[prompt.len() - 1..]), bits(&g.logprobs), "{name}");
    }
}

#[test]
fn recompute_carries_every_stream_and_gives_identical_gradients() {
    // The blocks pass the residual streams, the token ids (hash routing) and the positions to
    // each other; activation recompute replays each block from all three.
    for name in FIXTURES {
        let dir = fixture(name);
        let (model, params) = model_for(&dir);
        let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
        let tokens = &exp["tokens"];
        let t = tokens.shape()[1];
        let trainable: Vec<String> = model
            .spec()
            .params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.name.clone())
            .collect();
        let run = |recompute: bool| {
            let leaves: HashMap<String, Tensor> = params
                .iter()
                .map(|(k, v)| {
                    let leaf = v.detach();
                    let leaf = if trainable.contains(k) {
                        leaf.requires_grad_()
                    } else {
                        leaf
                    };
                    (k.clone(), leaf)
                })
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
            trainable
                .iter()
                .map(|n| leaves[n].grad().map(|g| g.to_vec_f32()))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(false), run(true), "{name}");
    }
}

/// Log-probability bits.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn long_decodes_keep_the_training_forward_bits_past_many_blocks_and_the_window() {
    // 100 tokens after a prompt of 40: every compression rate's blocks complete many times
    // during decode, and the cached window drops whole 64-token blocks twice (at 64 + window
    // and 128 + window tokens), so a step attends to far fewer keys than the prefix holds.
    use anneal_runtime::infer::{generate_batch, logprobs, Sampling};
    let _inv = anneal_engine::invariant::set_batch_invariant(true);
    for name in FIXTURES {
        let (model, params) = model_for(&fixture(name));
        let prompts: Vec<Vec<i64>> = (0..2)
            .map(|r| (0..40).map(|i| (i * 29 + 7 + r * 11) % 96).collect())
            .collect();
        let samplings: Vec<Sampling> = (0..2)
            .map(|r| Sampling {
                temperature: 1.0,
                seed: 11 + r,
                ..Default::default()
            })
            .collect();
        let refs: Vec<&[i64]> = prompts.iter().map(|p| &p[..]).collect();
        let out = generate_batch(&model, &params, &refs, 100, &samplings).unwrap();
        for (prompt, g) in prompts.iter().zip(&out) {
            assert_eq!(g.tokens.len(), 100, "{name}");
            let mut full = prompt.clone();
            full.extend(&g.tokens);
            let (lp, _) = logprobs(&model, &params, &full).unwrap();
            assert_eq!(bits(&lp[prompt.len() - 1..]), bits(&g.logprobs), "{name}");
        }
    }
}

#[test]
fn the_serving_loop_decodes_prompts_of_different_lengths_as_the_training_forward() {
    // Continuous batching: requests of different lengths share decode steps (rows whose
    // caches differ in shape run in their own forward within a step); each request's
    // log-probabilities are the training forward's bits and its solo decode's.
    use anneal_runtime::infer::{generate, logprobs, Sampling};
    use anneal_runtime::serving::{Event, Request, Scheduler, SchedulerOptions};
    let (model, params) = model_for(&fixture("tiny_deepseek_v4"));
    let model = Arc::new(model);
    let sched =
        Scheduler::start(model.clone(), params.clone(), SchedulerOptions::default()).unwrap();
    let requests: Vec<Request> = [3usize, 17, 40, 61, 17]
        .iter()
        .enumerate()
        .map(|(r, &len)| Request {
            prompt: (0..len).map(|i| ((i * 31 + r * 5) % 96) as i64).collect(),
            max_new: 60 + 7 * r,
            sampling: Sampling {
                temperature: if r % 2 == 0 { 0.0 } else { 0.9 },
                seed: r as u64,
                ..Default::default()
            },
            stop_tokens: vec![],
            top_logprobs: 0,
            images: None,
        })
        .collect();
    let receivers: Vec<_> = requests
        .iter()
        .map(|r| sched.submit_channel(r.clone()).unwrap())
        .collect();
    for (r, rx) in requests.iter().zip(receivers) {
        let (mut ids, mut lps) = (vec![], vec![]);
        for e in rx {
            match e {
                Event::Token(t) => {
                    ids.push(t.id);
                    lps.push(t.logprob);
                }
                Event::Done(_) => break,
                Event::Failed(m) => panic!("request failed: {m}"),
            }
        }
        assert_eq!(ids.len(), r.max_new);
        let mut full = r.prompt.clone();
        full.extend(&ids);
        let (lp, _) = logprobs(&model, &params, &full).unwrap();
        assert_eq!(
            bits(&lp[r.prompt.len() - 1..]),
            bits(&lps),
            "{:?}",
            r.prompt
        );
        let solo = generate(&model, &params, &r.prompt, r.max_new, &r.sampling).unwrap();
        assert_eq!(ids, solo.tokens);
    }
    let stats = sched.stats();
    assert!(
        stats.max_rows >= 4,
        "the requests did not run together: {stats:?}"
    );
}
