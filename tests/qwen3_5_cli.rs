//! The Qwen3.5 plugin through the CLI: the debug flavors (dense and MoE) train, `anneal logprobs`
//! on the tiny transformers checkpoint prints transformers' values, `anneal generate` decodes
//! with the host-kept linear-attention state and the training forward reproduces its
//! log-probabilities bit for bit, and `anneal rl` on configs/rl_digits_qwen3_5.toml keeps the
//! rollout and trainer log-probabilities equal (mismatch exactly 0).

mod rl_support;

use anneal_tests::cli::{anneal, floats, json_of, ok, root, rows, Job};
use serde_json::Value;
use std::path::Path;

/// A small Qwen3.5 for the tiny corpus: three Gated DeltaNet blocks and one attention block.
use anneal_tests::tiny::QWEN3_5 as TINY;

#[test]
fn debug_flavors_train_and_the_moe_reports_its_experts() {
    let job = Job::new("qwen3_5");
    let config = job.config_with_model("qwen3_5", "qwen3_5", TINY);
    let train = |run: &str, set: &[&str]| {
        let mut c = anneal();
        c.arg("train")
            .arg(&config)
            .arg("--run-dir")
            .arg(job.dir.join(run));
        for s in set {
            c.args(["--set", s]);
        }
        ok(&c.output().unwrap());
        rows(&job.dir.join(run))
    };
    let dense = train("dense", &[]);
    let loss = |r: &Value| r["loss"].as_f64().expect("a loss");
    let (first, last) = (loss(&dense[0]), loss(dense.last().unwrap()));
    assert!(last.is_finite() && last < first, "{first} -> {last}");
    // The spec's FLOPs reach the metrics (MFU against the config's 1 TFLOP/s).
    assert!(dense.last().unwrap()["mfu"]
        .as_f64()
        .is_some_and(|m| m > 0.0));

    let moe = train(
        "moe",
        &[
            "model.flavor=\"debugmodel_moe\"",
            "model.args.ffn_dim=0",
            "model.args.moe={ n_experts = 4, top_k = 2, expert_ffn_dim = 16, shared_ffn_dim = 24, aux_loss_coef = 0.01 }",
        ],
    );
    let r = moe.last().unwrap();
    assert!(loss(r).is_finite(), "{r}");
    for layer in 0..4 {
        assert!(
            r[format!("moe.layer{layer}.imbalance")].as_f64().unwrap() >= 1.0,
            "{r}"
        );
    }
    assert!(r["aux_loss.load_balance"].as_f64().unwrap() > 0.0, "{r}");
}

#[test]
fn logprobs_and_generation_on_the_transformers_checkpoint() {
    let dir = root().join("host/runtime/tests/fixtures/tiny_qwen3_5");
    let exp = anneal_engine::io::load_safetensors(dir.join("expected.safetensors")).unwrap();
    // 160 tokens: the delta rule runs three 64-token chunks.
    let tokens = exp["tokens"].narrow(0, 0, 1).unwrap().to_vec::<i64>();
    let want = exp["logprobs"].narrow(0, 0, 1).unwrap().to_vec_f32();
    let ids: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
    let lp = json_of(
        &anneal()
            .args(["logprobs", "--model-dir"])
            .arg(&dir)
            .args(["--tokens", &ids.join(",")])
            .output()
            .unwrap(),
    );
    let got = floats(&lp["logprobs"]);
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert!((g - *w as f64).abs() < 1e-4, "{g} vs {w}");
    }

    // A prompt ending inside the first chunk, decoded past its boundary.
    let prompt = ids[..60].join(",");
    let g = json_of(
        &anneal()
            .args(["generate", "--model-dir"])
            .arg(&dir)
            .args(["--prompt-tokens", &prompt, "--max-new-tokens", "12"])
            .args(["--temperature", "0.8", "--seed", "4"])
            .output()
            .unwrap(),
    );
    let new: Vec<String> = g["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.to_string())
        .collect();
    assert_eq!(new.len(), 12, "{g}");
    // Only the attention block caches keys and values per token (2 KV heads of 16, f32); the
    // three Gated DeltaNet blocks keep a state of fixed size per sequence.
    assert_eq!(g["cache_bytes_per_token"], 2 * 2 * 16 * 4, "{g}");
    assert!(
        g["state_bytes_per_sequence"]
            .as_u64()
            .is_some_and(|b| b > 0),
        "{g}"
    );
    let all = format!("{prompt},{}", new.join(","));
    let lp = json_of(
        &anneal()
            .args(["logprobs", "--model-dir"])
            .arg(&dir)
            .args(["--tokens", &all])
            .output()
            .unwrap(),
    );
    assert_eq!(floats(&lp["logprobs"])[59..], floats(&g["logprobs"])[..]);
}

#[test]
fn rl_digits_on_a_qwen3_5_policy_has_no_logprob_mismatch() {
    rl_support::digits_without_mismatch(
        "anneal-qwen3-5-rl",
        Path::new("configs/rl_digits_qwen3_5.toml"),
        &[],
    );
}
