//! The DeepSeek-V4 plugin through the CLI: a small model of every block kind trains, `anneal
//! logprobs` on the tiny transformers checkpoint prints transformers' values, `anneal generate`
//! decodes with the per-layer caches (their bytes counted by hand against a plain KV cache) and
//! the training forward reproduces its log-probabilities bit for bit, multi-token prediction
//! trains as the auxiliary loss `mtp` (logged as `mtp_loss`) without touching generation, and
//! `anneal rl` on configs/rl_digits_deepseek_v4.toml keeps the rollout and trainer
//! log-probabilities equal (mismatch exactly 0).

mod rl_support;

use anneal_tests::cli::{anneal, floats, json_of, ok, root, rows, Job};
use serde_json::Value;
use std::path::Path;

/// A small DeepSeek-V4 for the tiny corpus (rows of 32 tokens): sliding, CSA (blocks of 2, the
/// indexer keeping 3), HCA (blocks of 4) and CSA blocks over a window of 6, two streams.
use anneal_tests::tiny::DEEPSEEK_V4 as TINY;

#[test]
fn a_small_model_of_every_block_kind_trains() {
    let job = Job::new("deepseek_v4");
    let config = job.config_with_model("deepseek_v4", "deepseek_v4", TINY);
    let run = job.dir.join("run");
    ok(&anneal()
        .arg("train")
        .arg(&config)
        .arg("--run-dir")
        .arg(&run)
        .output()
        .unwrap());
    let steps = rows(&run);
    let loss = |r: &Value| r["loss"].as_f64().expect("a loss");
    let (first, last) = (loss(&steps[0]), loss(steps.last().unwrap()));
    assert!(last.is_finite() && last < first, "{first} -> {last}");
    assert!(steps.last().unwrap()["mfu"]
        .as_f64()
        .is_some_and(|m| m > 0.0));
}

#[test]
fn multi_token_prediction_trains_as_an_auxiliary_loss_and_leaves_generation_alone() {
    let job = Job::new("deepseek_v4_mtp");
    let args = TINY.replace(" }", ", mtp_layers = 1, balance_rate = 0.01 }");
    let config = job.config_with_model("deepseek_v4", "deepseek_v4", &args);
    let train = |name: &str, mode: &str| {
        let run = job.dir.join(name);
        let mut c = anneal();
        c.arg("train").arg(&config).arg("--run-dir").arg(&run);
        let mode = format!("activation_checkpoint.mode=\"{mode}\"");
        for s in [
            "training.steps=3",
            "checkpoint.interval=3",
            "training.aux_loss_weights.mtp=0.3",
            mode.as_str(),
        ] {
            c.args(["--set", s]);
        }
        ok(&c.output().unwrap());
        run
    };
    let run = train("run", "none");
    // Recomputing every block (which passes MTP's input through) changes nothing, bit for bit.
    let recomputed = train("recomputed", "full");
    let curve = |run: &std::path::Path| -> Vec<(u64, u64)> {
        rows(run)
            .iter()
            .map(|r| {
                let bits = |k: &str| r[k].as_f64().expect(k).to_bits();
                (bits("loss"), bits("mtp_loss"))
            })
            .collect()
    };
    assert_eq!(curve(&recomputed), curve(&run));
    let last = rows(&run).last().unwrap().clone();
    for key in ["mtp_loss", "aux_loss.mtp"] {
        assert!(last[key].as_f64().is_some_and(|v| v > 0.0), "{key}: {last}");
    }
    // Both start near ln(320): the token after next is about as hard as the next at first.
    let (mtp, loss) = (
        last["mtp_loss"].as_f64().unwrap(),
        last["loss"].as_f64().unwrap(),
    );
    assert!((mtp - loss).abs() < 2.0, "{last}");
    let step = run.join("checkpoints/step-3");
    let saved =
        anneal_engine::io::load_safetensors(step.join("shard-00000-of-00001.safetensors")).unwrap();
    assert!(saved.contains_key("model/mtp.e_proj.weight"));
    // The MTP block's learned router moved its balancing bias like the main blocks'.
    let bias = saved["model/mtp.block.ffn.router.balance_bias"].to_vec_f32();
    assert!(bias.iter().any(|v| v.abs() > 1e-3), "{bias:?}");

    // The export carries the module under DeepSeek's names, which generation leaves aside: it
    // decodes the main model, its log-probabilities the training forward's bit for bit.
    let hf = job.dir.join("hf");
    ok(&anneal()
        .args(["checkpoint", "export", "--to-hf"])
        .arg(&hf)
        .arg(&step)
        .output()
        .unwrap());
    let written = anneal_engine::io::load_safetensors(hf.join("model.safetensors")).unwrap();
    assert!(written.contains_key("mtp.0.e_proj.weight"));
    let prompt = "5,9,14,2,77,31,8,100,12,6";
    let g = json_of(
        &anneal()
            .args(["generate", "--model-dir"])
            .arg(&hf)
            .args(["--prompt-tokens", prompt, "--max-new-tokens", "8"])
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
    assert_eq!(new.len(), 8, "{g}");
    let lp = json_of(
        &anneal()
            .args(["logprobs", "--model-dir"])
            .arg(&hf)
            .args(["--tokens", &format!("{prompt},{}", new.join(","))])
            .output()
            .unwrap(),
    );
    assert_eq!(floats(&lp["logprobs"])[9..], floats(&g["logprobs"])[..]);
}

#[test]
fn logprobs_and_generation_on_the_transformers_checkpoint() {
    let dir = root().join("host/runtime/tests/fixtures/tiny_deepseek_v4");
    let exp = anneal_engine::io::load_safetensors(dir.join("expected.safetensors")).unwrap();
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

    // A prompt of 30 tokens decoded 12 more: CSA and HCA blocks complete during decoding.
    let prompt = ids[..30].join(",");
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
    let all = format!("{prompt},{}", new.join(","));
    let lp = json_of(
        &anneal()
            .args(["logprobs", "--model-dir"])
            .arg(&dir)
            .args(["--tokens", &all])
            .output()
            .unwrap(),
    );
    assert_eq!(floats(&lp["logprobs"])[29..], floats(&g["logprobs"])[..]);

    // 60 tokens: the caches have seen 89 (the last one is not fed back). Counted by hand
    // (plugins/deepseek-v4/src/decode.rs, f32 values and positions): per layer the window keeps
    // 89 - 64 = 25 tokens × (16 × 4 + 4) = 1700 bytes; each CSA layer 22 blocks × 64 and 5
    // pending inputs × (2 × 32 × 4 + 4), its indexer 22 × 32 and 5 × (2 × 16 × 4 + 4); the HCA
    // layer 11 × 64 and 9 × (2 × 16 × 4 + 4). A plain KV cache: 89 × 4 layers × 2 × 16 × 4.
    let out = anneal()
        .args(["generate", "--model-dir"])
        .arg(&dir)
        .args(["--prompt-tokens", &prompt, "--max-new-tokens", "60"])
        .output()
        .unwrap();
    let g = json_of(&out);
    assert_eq!(g["cache_tokens"], 89, "{g}");
    let want = 4 * 1700 + 2 * (22 * 64 + 5 * 260 + 22 * 32 + 5 * 132) + 11 * 64 + 9 * 132;
    assert_eq!(g["cache_bytes"], want, "{g}");
    assert_eq!(g["plain_kv_bytes"], 89 * 4 * 2 * 16 * 4, "{g}");
    assert_eq!(g["plain_kv_bytes_per_token"], 512, "{g}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cache: 16836 bytes for 89 tokens (189.2 per token) against 45568 for a plain KV cache of this model (512.0 per token)"),
        "{err}"
    );
}

#[test]
fn rl_digits_on_a_deepseek_v4_policy_has_no_logprob_mismatch() {
    rl_support::digits_without_mismatch(
        "anneal-deepseek-v4-rl",
        Path::new("configs/rl_digits_deepseek_v4.toml"),
        &[],
    );
}
