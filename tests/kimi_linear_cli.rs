//! Kimi Linear through the CLI: the debug flavor (Kimi Delta Attention and MLA without RoPE, in
//! the DeepSeek-V3 plugin) trains, recomputes its blocks bit for bit and checkpoints the KDA
//! parameters; on the tiny transformers fixture `anneal logprobs` prints transformers' values
//! and `anneal generate`, decoding from the per-layer recurrent state across a 64-token chunk
//! boundary, gives the training forward's logprobs bit for bit.

use anneal_tests::cli::{self, anneal, ok, root, rows, Job};
use std::path::PathBuf;

fn fixture() -> PathBuf {
    root().join("host/runtime/tests/fixtures/tiny_kimi_linear")
}

#[test]
fn the_debug_flavor_trains_and_recomputes_bitwise() {
    let job = Job::new("kimi-linear");
    let config = job.config_with_model(
        "kimi_linear",
        "deepseek_v3",
        anneal_tests::tiny::KIMI_LINEAR,
    );
    let train = |name: &str, mode: &str| {
        let run = job.dir.join(name);
        let mut c = anneal();
        c.arg("train").arg(&config).arg("--run-dir").arg(&run);
        let mode = format!("activation_checkpoint.mode=\"{mode}\"");
        for s in [
            "model.flavor=\"kimi_linear_debug\"",
            "training.steps=4",
            "checkpoint.interval=4",
            mode.as_str(),
        ] {
            c.args(["--set", s]);
        }
        ok(&c.output().unwrap());
        run
    };
    let run = train("run", "none");
    let losses: Vec<f64> = rows(&run)
        .iter()
        .filter_map(|r| r["loss"].as_f64())
        .collect();
    assert_eq!(losses.len(), 4, "{losses:?}");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(losses[3] < losses[0], "{losses:?}");
    // Recomputing every block (the KDA block's convolution and delta rule included) changes
    // nothing, bit for bit.
    let recomputed = train("recomputed", "full");
    let bits = |run: &std::path::Path| -> Vec<u64> {
        rows(run)
            .iter()
            .filter_map(|r| r["loss"].as_f64())
            .map(f64::to_bits)
            .collect()
    };
    assert_eq!(bits(&recomputed), bits(&run));
    let saved = anneal_engine::io::load_safetensors(
        run.join("checkpoints/step-4/shard-00000-of-00001.safetensors"),
    )
    .unwrap();
    // Block 0 is KDA (one convolution over [q, k, v]: 3 · 2 heads · 16 channels), block 1 MLA.
    assert_eq!(
        saved["model/layers.0.attention.conv1d.weight"].shape(),
        [96, 1, 4]
    );
    assert_eq!(
        saved["model/layers.0.attention.A_log"].shape(),
        [1, 1, 2, 1]
    );
    assert!(saved.contains_key("model/layers.1.attention.wkv_b.weight"));
    assert!(!saved.contains_key("model/layers.0.attention.wkv_b.weight"));
}

#[test]
fn logprobs_match_transformers_and_generation_matches_the_training_forward() {
    let dir = fixture();
    let exp = anneal_engine::io::load_safetensors(dir.join("expected.safetensors")).unwrap();
    let tokens = exp["tokens"].narrow(0, 0, 1).unwrap().to_vec::<i64>();
    let want = exp["logprobs"].narrow(0, 0, 1).unwrap().to_vec_f32();
    // 160 tokens: the delta rule runs over three 64-token chunks. A 60-token prompt and 10 new
    // tokens: decode crosses position 64 on the recurrent state.
    cli::assert_logprobs_and_decode(&dir, &tokens, &want, [60, 10], 3);
}
