//! Kimi K3 through the CLI: a tiny model (KDA and gated MLA, attention over block residuals, a
//! latent mixture of experts) trains, recomputes its blocks, and DDP(2), FSDP(2) and PP(2)
//! follow one process while tensor and expert parallelism are refused naming their keys; on
//! the tiny transformers fixture `anneal logprobs` prints transformers' values and `anneal
//! generate`, decoding across a 64-token chunk boundary, gives the training forward's logprobs
//! bit for bit; `anneal rl` on the digits demo with a Kimi K3 policy has no logprob mismatch.

mod dist_support;
mod rl_support;

use anneal_tests::cli::{self, ok, root, Job};

/// A job whose config is the tiny Kimi K3.
fn job(name: &str) -> Job {
    let job = Job::new(name);
    let config = job.config_with_model("kimi_k3", "kimi_k3", anneal_tests::tiny::KIMI_K3);
    std::fs::copy(config, job.config()).unwrap();
    job
}

const SET: [&str; 4] = [
    "training.steps=6",
    "training.micro_batch_size=2",
    "training.threads=1",
    "metrics.eval_freq=0",
];

#[test]
fn the_tiny_model_trains_recomputes_and_data_parallel_layouts_follow() {
    let job = job("kimi-k3");
    let (out, one) = job.train("one", &SET);
    ok(&out);
    let losses = dist_support::loss_values(&one);
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(last.is_finite() && last < first, "{first} -> {last}");
    // Recomputing every block follows within rounding: the bank's entries feed every later
    // block, and the gradients they gather from those blocks are summed in another order when
    // each block's backward runs on its own.
    let with: Vec<&str> = SET
        .iter()
        .copied()
        .chain(["activation_checkpoint.mode=\"full\""])
        .collect();
    let (out, recomputed) = job.train("recomputed", &with);
    ok(&out);
    let again = dist_support::loss_values(&recomputed);
    assert_eq!(again.len(), losses.len());
    for (a, b) in again.iter().zip(&losses) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{again:?} vs {losses:?}");
    }
    // Pipeline stages pass the bank of residuals between them like any hidden state.
    for (name, layout) in [
        ("ddp", None),
        ("fsdp2", Some("parallelism.dp_shard=2")),
        ("pp2", Some("parallelism.pp=2")),
    ] {
        let run = job.dir.join(name);
        let with: Vec<&str> = SET.iter().copied().chain(layout).collect();
        ok(&dist_support::mpiexec_train(2, &job, &run, &with));
        dist_support::follows_single(name, &losses, &dist_support::loss_values(&run));
    }
    for (name, layout, key) in [
        ("tp2", &["parallelism.tp=2"][..], "parallelism.tp"),
        (
            "ep2",
            &["parallelism.dp_shard=2", "parallelism.ep=2"][..],
            "parallelism.ep",
        ),
    ] {
        let with: Vec<&str> = SET.iter().copied().chain(layout.iter().copied()).collect();
        let out = dist_support::mpiexec_train(2, &job, &job.dir.join(name), &with);
        assert!(!out.status.success(), "{name}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(key), "{name}: {err}");
    }
}

#[test]
fn logprobs_match_transformers_and_generation_matches_the_training_forward() {
    let dir = root().join("host/runtime/tests/fixtures/tiny_kimi_k3");
    let exp = anneal_engine::io::load_safetensors(dir.join("expected.safetensors")).unwrap();
    let tokens = exp["tokens"].narrow(0, 0, 1).unwrap().to_vec::<i64>();
    let want = exp["logprobs"].narrow(0, 0, 1).unwrap().to_vec_f32();
    // 60 prompt tokens and 10 new ones: decode crosses position 64 on the recurrent state.
    cli::assert_logprobs_and_decode(&dir, &tokens, &want, [60, 10], 3);
}

#[test]
fn rl_digits_on_a_kimi_k3_policy_has_no_logprob_mismatch() {
    // The digits demo's config with the tiny Kimi K3 as its `[model]` (the llama arguments
    // would not parse as Kimi K3's).
    let dir = rl_support::fresh_dir("anneal-kimi-k3-rl-config");
    let args = anneal_tests::tiny::KIMI_K3.replace("vocab_size = 320", "vocab_size = 257");
    let config: String = std::fs::read_to_string(root().join("configs/rl_digits.toml"))
        .unwrap()
        .lines()
        .map(|l| match l {
            l if l.starts_with("plugin = \"llama\"") => "plugin = \"kimi_k3\"\n".to_string(),
            l if l.starts_with("args = { dim") => format!("args = {args}\n"),
            l => format!("{l}\n"),
        })
        .collect();
    let path = dir.join("rl_digits_kimi_k3.toml");
    std::fs::write(&path, config).unwrap();
    rl_support::digits_without_mismatch("anneal-kimi-k3-rl", &path, &[]);
    let _ = std::fs::remove_dir_all(&dir);
}
