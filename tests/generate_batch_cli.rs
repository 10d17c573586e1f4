//! `anneal generate --batch N [--fast]`: batched decode reports its timing; in the default
//! batch-invariant mode row 0 of a batch equals a batch-1 run bit for bit; `--fast` runs.

use anneal_tests::cli as common;

use common::{anneal, root};

fn run(extra: &[&str]) -> serde_json::Value {
    let out = anneal()
        .args(["generate", "--model-dir"])
        .arg(root().join("host/runtime/tests/fixtures/tiny_llama"))
        .args([
            "--max-new-tokens",
            "6",
            "--prompt-tokens",
            "1,5,9,3",
            "--temperature",
            "0.8",
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

#[test]
fn batched_decode_reports_timing_and_row_0_matches_batch_1() {
    let one = run(&[]);
    let many = run(&["--batch", "5"]);
    assert_eq!(many["batch"], 5);
    assert_eq!(many["batch_invariant"], true);
    assert_eq!(
        one["tokens"], many["tokens"],
        "batch-invariant: row 0 is the batch-1 run"
    );
    assert_eq!(one["logprobs"], many["logprobs"]);
    for v in [&one, &many] {
        assert!(v["prefill_s"].as_f64().unwrap() > 0.0);
        assert!(v["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    }
    let fast = run(&["--batch", "5", "--fast"]);
    assert_eq!(fast["batch_invariant"], false);
    assert_eq!(fast["tokens"].as_array().unwrap().len(), 6);

    let out = anneal()
        .args(["generate", "--model-dir"])
        .arg(root().join("host/runtime/tests/fixtures/tiny_llama"))
        .args(["--prompt-tokens", "1,2", "--batch", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--batch"));
}
