//! Inference under tensor parallelism: `anneal generate --tp 2` under `mpiexec -n 2` (each rank
//! holding half the heads, of the weights and of the KV cache) decodes the same greedy tokens
//! as one process (Llama and Qwen3), with logprobs within float rounding of its, and rank 0 alone prints; what
//! does not split is one error line, exit code 2.

use anneal_tests::cli as common;

use common::{anneal, anneal_bin, ok, root, user_error};
use std::process::{Command, Output};

const PROMPT: &str = "1,5,9,3";

fn fixture(name: &str) -> std::path::PathBuf {
    root().join("host/runtime/tests/fixtures").join(name)
}

fn generate_args(c: &mut Command, model: &str, extra: &[&str]) {
    c.args(["generate", "--model-dir"])
        .arg(fixture(model))
        .args(["--prompt-tokens", PROMPT, "--max-new-tokens", "12"])
        .args(["--temperature", "0"])
        .args(extra);
}

/// `mpiexec -n <n> anneal generate ...`.
fn mpiexec_generate(n: usize, model: &str, extra: &[&str]) -> Output {
    let mut c = anneal_dist::launch::mpiexec_command(n, &anneal_bin(), &[]).expect("mpiexec");
    c.env_remove("ANNEAL_PLUGIN_PATH");
    generate_args(&mut c, model, extra);
    c.output().expect("run mpiexec")
}

fn json(stdout: &str) -> serde_json::Value {
    let lines: Vec<&str> = stdout.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines.len(),
        1,
        "one JSON line (rank 0 alone prints): {stdout}"
    );
    serde_json::from_str(lines[0]).expect("one JSON object")
}

#[test]
fn tensor_parallel_generate_follows_one_process() {
    // The Llama 3 family, and Qwen3 with its per-head q/k norms applied to each rank's heads.
    for model in ["tiny_llama", "tiny_qwen3"] {
        let mut c = anneal();
        generate_args(&mut c, model, &[]);
        let one = json(&ok(&c.output().unwrap()));
        let two = json(&ok(&mpiexec_generate(2, model, &["--tp", "2"])));
        assert_eq!(two["tp"], 2);
        assert_eq!(one["tokens"].as_array().unwrap().len(), 12);
        assert_eq!(
            one["tokens"], two["tokens"],
            "{model}, greedy: the same tokens"
        );
        // The head's and the row-split projections' sums run in another order than one
        // process's products, so the logprobs agree to rounding, not bit for bit.
        let lp = |v: &serde_json::Value| -> Vec<f64> {
            v["logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        };
        for (a, b) in lp(&one).iter().zip(lp(&two)) {
            assert!((a - b).abs() < 1e-4, "{model}: logprob {a} vs {b}");
        }
        // The KV cache holds each rank's heads: half the bytes per token of one process's.
        assert_eq!(
            one["cache_bytes_per_token"].as_u64().unwrap(),
            2 * two["cache_bytes_per_token"].as_u64().unwrap(),
            "{model}"
        );
    }
}

#[test]
fn what_does_not_split_is_a_user_error() {
    // One process cannot hold a slice alone.
    let mut c = anneal();
    generate_args(&mut c, "tiny_llama", &["--tp", "2"]);
    user_error(&c.output().unwrap(), &["--tp 2", "mpiexec -n 2"]);
}
