//! The Muse plugin through the CLI: the debug flavor trains (and DDP(2), FSDP(2) and TP(2)
//! follow one process), `anneal logprobs` on the tiny transformers checkpoint prints transformers' values,
//! `anneal generate` decodes with the KV cache and the training forward reproduces its
//! log-probabilities bit for bit, and `anneal rl` on the digits demo
//! with a Muse policy keeps the rollout and trainer log-probabilities equal (mismatch 0); Muse
//! Spark trains and its data-parallel layouts follow.

mod dist_support;
mod rl_support;

use anneal_tests::cli::{anneal, floats, json_of, ok, root, rows, Job};
use serde_json::Value;

/// The tiny test model's `[model]` as Muse: sandwich norms, gated attention with a scaleless
/// QK-norm, NoPE full attention on the last block and RoPE with a window of 8 on the first.
const MUSE: [&str; 4] = [
    "model.plugin=\"muse\"",
    "model.args.head_dim=16",
    "model.args.n_kv_heads=2",
    "model.args.sliding_window=8",
];

#[test]
fn the_debug_flavor_trains_and_ddp_follows_one_process() {
    let job = Job::new("muse");
    let mut set = MUSE.to_vec();
    set.extend([
        "training.steps=6",
        "training.micro_batch_size=2",
        "training.threads=1",
        "metrics.eval_freq=0",
    ]);
    let (out, one) = job.train("one", &set);
    ok(&out);
    let losses = dist_support::loss_values(&one);
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(last.is_finite() && last < first, "{first} -> {last}");
    let two = job.dir.join("ddp");
    ok(&dist_support::mpiexec_train(2, &job, &two, &set));
    dist_support::assert_follows(&one, &two, losses.len());
    // FSDP shards every parameter; TP splits the heads (the gate with the queries), the
    // feed-forward and the vocabulary.
    for (name, layout) in [
        ("fsdp2", "parallelism.dp_shard=2"),
        ("tp2", "parallelism.tp=2"),
    ] {
        let run = job.dir.join(name);
        let with: Vec<&str> = set.iter().copied().chain([layout]).collect();
        ok(&dist_support::mpiexec_train(2, &job, &run, &with));
        dist_support::follows_single(name, &losses, &dist_support::loss_values(&run));
    }
}

/// Muse Spark: blocks joined by gated residuals, the second sparse (4 experts of 16 in a latent
/// width of 16, top 2); DDP(2) and FSDP(2) follow one process; tensor parallelism is refused
/// (its latent experts are not split yet) naming the key.
#[test]
fn muse_spark_trains_and_data_parallel_layouts_follow() {
    let job = Job::new("muse-spark");
    let mut set = MUSE.to_vec();
    set.extend([
        "model.flavor=\"debugmodel_spark\"",
        "model.args.spark={ n_experts = 4, top_k = 2, expert_ffn_dim = 16, latent_dim = 16, routed_scaling_factor = 1.0, residual_gate_temperature = 0.3, mlp_layer_types = [\"dense\", \"sparse\"] }",
        "training.steps=6",
        "training.micro_batch_size=2",
        "training.threads=1",
        "metrics.eval_freq=0",
    ]);
    let (out, one) = job.train("one", &set);
    ok(&out);
    let losses = dist_support::loss_values(&one);
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(last.is_finite() && last < first, "{first} -> {last}");
    for (name, layout) in [("ddp", None), ("fsdp2", Some("parallelism.dp_shard=2"))] {
        let run = job.dir.join(name);
        let with: Vec<&str> = set.iter().copied().chain(layout).collect();
        ok(&dist_support::mpiexec_train(2, &job, &run, &with));
        dist_support::follows_single(name, &losses, &dist_support::loss_values(&run));
    }
    let with: Vec<&str> = set.iter().copied().chain(["parallelism.tp=2"]).collect();
    let out = dist_support::mpiexec_train(2, &job, &job.dir.join("tp2"), &with);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("parallelism.tp"), "{err}");
}

#[test]
fn logprobs_and_generation_on_the_transformers_checkpoint() {
    let dir = root().join("host/runtime/tests/fixtures/tiny_muse_glimmer");
    let exp = anneal_engine::io::load_safetensors(dir.join("expected.safetensors")).unwrap();
    let tokens = exp["tokens"].narrow(0, 0, 1).unwrap().to_vec::<i64>();
    let want = exp["logprobs"].narrow(0, 0, 1).unwrap().to_vec_f32();
    let ids: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
    let logprobs = |tokens: &str| {
        json_of(
            &anneal()
                .args(["logprobs", "--model-dir"])
                .arg(&dir)
                .args(["--tokens", tokens])
                .output()
                .unwrap(),
        )
    };
    let got = floats(&logprobs(&ids.join(","))["logprobs"]);
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert!((g - *w as f64).abs() < 1e-4, "{g} vs {w}");
    }
    // Decoded past the window of 4 on the RoPE blocks.
    let prompt = ids[..5].join(",");
    let g = json_of(
        &anneal()
            .args(["generate", "--model-dir"])
            .arg(&dir)
            .args(["--prompt-tokens", &prompt, "--max-new-tokens", "10"])
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
    assert_eq!(new.len(), 10, "{g}");
    let all = format!("{prompt},{}", new.join(","));
    assert_eq!(
        floats(&logprobs(&all)["logprobs"])[4..],
        floats(&g["logprobs"])[..]
    );
}

#[test]
fn rl_digits_on_a_muse_policy_has_no_logprob_mismatch() {
    let dir = rl_support::fresh_dir("anneal-muse-rl");
    let tok = dir.join("tokenizer.json");
    rl_support::digits_tokenizer(&tok, 7, 50, 257);
    let out = anneal()
        .current_dir(root())
        .args(["rl", "configs/rl_digits.toml", "--run-dir"])
        .arg(dir.join("run"))
        .args(["--set", "model.plugin=\"muse\""])
        .args(["--set", "model.flavor=\"debugmodel\""])
        .args(["--set", "model.args.head_dim=16"])
        .args(["--set", "model.args.n_kv_heads=2"])
        .args(["--set", "rl.init_from=\"\""])
        .args(["--set", &format!("rl.tokenizer=\"{}\"", tok.display())])
        .args(["--set", "training.steps=3"])
        .args(["--set", "rl.prompts_per_step=4"])
        .args(["--set", "rl.group_size=4"])
        .args(["--set", "rl.eval_freq=0"])
        .output()
        .unwrap();
    ok(&out);
    let steps = rows(&dir.join("run"));
    let trained: Vec<&Value> = steps.iter().filter(|r| r["loss"].is_number()).collect();
    assert_eq!(trained.len(), 3, "{steps:?}");
    for r in trained {
        assert_eq!(r["logprob_mismatch_max"].as_f64(), Some(0.0), "{r}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
