//! `anneal rl` under tensor parallelism × FSDP (`parallelism.tp = 2` with
//! `parallelism.dp_shard = 2` on 4 MPI ranks: each rank keeps half the rows of its half of the
//! heads, gathers its rows over `dp_shard` to its slices once per step, and its tensor-parallel
//! group rolls out and trains on them together) against one process: the rollout and trainer
//! logprobs stay bitwise equal (mismatch exactly 0), the curve follows the one-process run, the
//! checkpoints hold whole tensors and a TP × FSDP resume continues bit for bit, and a TP × FSDP
//! run resumes one process's checkpoint. Qwen3's per-head norm gradients (partial over `tp`) are
//! summed over the group before FSDP reduce-scatters them.

use anneal_tests::cli as common;

mod dist_support;
mod rl_layout_support;
mod rl_support;

use common::ok;
use dist_support::follows_single;
use rl_layout_support::{follows_one_process, losses, mismatch_zero};
use rl_support::{resume_copy, resumes_bitwise, rl, rl_job, steps};
use serde_json::Value;

const TP2_FSDP2: [&str; 2] = ["parallelism.tp=2", "parallelism.dp_shard=2"];

/// The checkpoint's tensors as `[name, global_shape, slice]`, sorted.
fn tensors(run_dir: &std::path::Path, step: u64) -> Vec<Value> {
    let path = run_dir.join(format!("checkpoints/step-{step}/manifest.json"));
    let text = std::fs::read_to_string(&path).expect("a checkpoint manifest");
    let v: Value = serde_json::from_str(&text).unwrap();
    let mut out: Vec<Value> = v["tensors"]
        .as_array()
        .expect("tensors")
        .iter()
        .map(|e| serde_json::json!([e["name"], e["global_shape"], e["slice"]]))
        .collect();
    out.sort_by_key(|e| e.to_string());
    out
}

#[test]
fn tensor_parallel_by_sharded_rl_keeps_parity_follows_one_process_and_resumes() {
    let dir = rl_job("tp-fsdp");
    let (out, one_dir) = rl(1, &dir, "one", &[]);
    ok(&out);
    let (out, tf_dir) = rl(4, &dir, "tp2-fsdp2", &TP2_FSDP2);
    let stdout = ok(&out);
    assert!(
        stdout.contains("fsdp: the policy sharded over 2"),
        "{stdout}"
    );
    let rank3 = std::fs::read_to_string(tf_dir.join("logs/rank-3.log")).expect("rank 3's log");
    assert!(
        rank3.contains("rank 1 of 2, tensor-parallel rank 1 of 2"),
        "{rank3}"
    );
    // The group decodes and trains on the very slices gathered from the rows.
    let (one, _) = follows_one_process("tp2-fsdp2", &one_dir, &tf_dir, (false, 1e-4));

    // Whole tensors, as one process saves them: the same names, shapes and pieces.
    assert_eq!(tensors(&tf_dir, 2), tensors(&one_dir, 2));
    resumes_bitwise(4, &dir, &tf_dir, "tp2-fsdp2-again", &TP2_FSDP2);

    // One process's checkpoint: each rank reads its slices' rows and goes on like one process.
    let resumed = resume_copy(4, &dir, &one_dir, "one-to-tp2-fsdp2", &TP2_FSDP2);
    follows_single("one-to-tp2-fsdp2", &losses(&one), &losses(&resumed));
    mismatch_zero("one-to-tp2-fsdp2", &resumed[2..]);
}

/// Qwen3's q/k norms are replicated over `tp` but applied to each rank's heads apart, so their
/// gradients are partial: summed over the group on the gathered slices, then reduce-scattered
/// to the rows; the gradient norm (over both axes) follows one process.
#[test]
fn tensor_parallel_by_sharded_rl_sums_qwen3s_per_head_norm_gradients() {
    let dir = rl_job("tp-fsdp-qwen3");
    let qwen3 = "model.flavor=\"debugmodel_qwen3\"";
    let (out, one_dir) = rl(1, &dir, "one", &[qwen3]);
    ok(&out);
    let (out, tf_dir) = rl(4, &dir, "tp2-fsdp2", &[qwen3, TP2_FSDP2[0], TP2_FSDP2[1]]);
    ok(&out);
    let (one, four) = (steps(&one_dir), steps(&tf_dir));
    assert_eq!((one.len(), four.len()), (4, 4));
    follows_single("qwen3 tp2-fsdp2", &losses(&one), &losses(&four));
    for (a, b) in one.iter().zip(&four) {
        assert_eq!(b["logprob_mismatch_max"].as_f64(), Some(0.0), "{b}");
        let norm = |r: &Value| r["grad_norm"].as_f64().expect("grad_norm");
        let (g, h) = (norm(a), norm(b));
        assert!((g - h).abs() <= 1e-4 * g, "step {}: {g} vs {h}", a["step"]);
    }
}
