//! `anneal rl` under tensor parallelism (`parallelism.tp = 2` on 2 MPI ranks, each holding
//! half the heads of the policy, of its KV cache during rollouts and of the trainer's
//! projections) against one process: the rollout and trainer logprobs stay bitwise equal
//! (mismatch exactly 0), the curve follows the one-process run within 1e-4, the checkpoints
//! hold whole tensors (a resume continues bit for bit), a run started from a checkpoint reads
//! each rank's slices and follows one process, and what the ranks of a group cannot do together
//! is refused in one line.

use anneal_tests::cli as common;

mod rl_support;

use common::{ok, user_error};
use rl_support::{first_step_samples, resumes_bitwise, rl, rl_job, steps};
use serde_json::Value;

const TP2: &str = "parallelism.tp=2";

/// Qwen3's q/k norms are replicated but applied to each head apart, so every tensor-parallel
/// rank's gradient of them is partial: the RL trainer sums them over the group (the
/// placements' partial gradients, as pretraining does), and its gradient norm follows one
/// process.
#[test]
fn tensor_parallel_rl_sums_qwen3s_per_head_norm_gradients() {
    let dir = rl_job("tp-qwen3");
    let qwen3 = "model.flavor=\"debugmodel_qwen3\"";
    let (out, one_dir) = rl(1, &dir, "one", &[qwen3]);
    ok(&out);
    let (out, tp_dir) = rl(2, &dir, "tp2", &[qwen3, TP2]);
    ok(&out);
    let (one, two) = (steps(&one_dir), steps(&tp_dir));
    assert_eq!((one.len(), two.len()), (4, 4));
    for (a, b) in one.iter().zip(&two) {
        assert_eq!(b["logprob_mismatch_max"].as_f64(), Some(0.0), "{b}");
        let norm = |r: &Value| r["grad_norm"].as_f64().expect("grad_norm");
        let (g, h) = (norm(a), norm(b));
        assert!(
            (g - h).abs() <= 1e-4 * g,
            "step {}: grad norm {g} vs {h}",
            a["step"]
        );
    }
}

#[test]
fn tensor_parallel_rl_keeps_parity_and_follows_one_process() {
    let dir = rl_job("tp");
    let (out, one_dir) = rl(1, &dir, "one", &[]);
    ok(&out);
    let (out, tp_dir) = rl(2, &dir, "tp2", &[TP2]);
    ok(&out);
    let (one, two) = (steps(&one_dir), steps(&tp_dir));
    assert_eq!(
        (one.len(), two.len()),
        (4, 4),
        "the lead rank alone writes rows"
    );
    let loss = |r: &Value| r["loss"].as_f64().expect("loss");
    assert!(loss(&one[0]).abs() > 1e-3, "a loss worth comparing");
    for (a, b) in one.iter().zip(&two) {
        // The decode and the training forward sum the same partials in the same order.
        assert_eq!(b["logprob_mismatch_max"].as_f64(), Some(0.0), "{b}");
        let (x, y) = (loss(a), loss(b));
        assert!(
            (x - y).abs() <= 1e-4 * x.abs(),
            "step {}: {x} vs {y}",
            a["step"]
        );
        let (g, h) = (
            a["grad_norm"].as_f64().unwrap(),
            b["grad_norm"].as_f64().unwrap(),
        );
        assert!(
            (g - h).abs() <= 1e-4 * g,
            "step {}: grad norm {g} vs {h}",
            a["step"]
        );
    }
    // Step 1 samples the same completions from the same weights (the logits differ from one
    // process's by rounding only, far from moving a draw at this size).
    assert_eq!(first_step_samples(&one_dir), first_step_samples(&tp_dir));
    let rank1 = std::fs::read_to_string(tp_dir.join("logs/rank-1.log")).expect("rank 1's log");
    assert!(rank1.contains("tensor-parallel rank 1 of 2"), "{rank1}");

    // The checkpoints hold whole tensors: a TP2 resume from step 2 continues bit for bit, and
    // the saved policy has the one-process shapes.
    let manifest = std::fs::read_to_string(tp_dir.join("checkpoints/step-2/manifest.json"))
        .expect("a step-2 checkpoint");
    let one_manifest =
        std::fs::read_to_string(one_dir.join("checkpoints/step-2/manifest.json")).unwrap();
    // Every tensor whole, as one process saves it: the same names, shapes and pieces.
    let shapes = |m: &str| -> Vec<Value> {
        let v: Value = serde_json::from_str(m).unwrap();
        let mut out: Vec<Value> = v["tensors"]
            .as_array()
            .expect("tensors")
            .iter()
            .map(|e| serde_json::json!([e["name"], e["global_shape"], e["slice"]]))
            .collect();
        out.sort_by_key(|e| e.to_string());
        out
    };
    assert_eq!(shapes(&manifest), shapes(&one_manifest));
    resumes_bitwise(2, &dir, &tp_dir, "tp2-resumed", &[TP2]);

    // Starting from a checkpoint, each rank reads its slices tensor by tensor (never the whole
    // policy) and goes on like one process started from the same checkpoint.
    let from = format!(
        "rl.init_from={}",
        one_dir.join("checkpoints/step-2").display()
    );
    let short = "training.steps=2";
    let (out, one_from) = rl(1, &dir, "one-from", &[&from, short]);
    ok(&out);
    let (out, tp_from) = rl(2, &dir, "tp2-from", &[TP2, &from, short]);
    ok(&out);
    let rank1 = std::fs::read_to_string(tp_from.join("logs/rank-1.log")).expect("rank 1's log");
    assert!(rank1.contains("keeps its slices"), "{rank1}");
    let (one, two) = (steps(&one_from), steps(&tp_from));
    assert_eq!((one.len(), two.len()), (2, 2));
    for (a, b) in one.iter().zip(&two) {
        assert_eq!(b["logprob_mismatch_max"].as_f64(), Some(0.0), "{b}");
        let (x, y) = (loss(a), loss(b));
        assert!((x - y).abs() <= 1e-4 * x.abs(), "from step 2: {x} vs {y}");
    }
    assert_eq!(first_step_samples(&one_from), first_step_samples(&tp_from));
}

#[test]
fn what_a_tensor_parallel_group_cannot_roll_out_is_a_user_error() {
    let dir = rl_job("tp-refused");
    for (set, needles) in [
        (
            "rl.max_staleness=1",
            &["rl.max_staleness", "parallelism.tp"][..],
        ),
        ("rl.rollout_threads=2", &["rl.rollout_threads"][..]),
        (
            "parallelism.tp_sequence=true",
            &["parallelism.tp_sequence"][..],
        ),
        (
            "model.args.n_kv_heads=1",
            &["parallelism.tp", "n_kv_heads"][..],
        ),
    ] {
        let (out, _) = rl(2, &dir, "refused", &[TP2, set]);
        user_error(&out, needles);
    }
}
