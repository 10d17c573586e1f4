//! `anneal rl` on 2 MPI ranks (data parallel, one compute thread each) against one process:
//! the same prompts and rollouts, a first-step loss bitwise the single process's, later losses
//! within 1e-4, rollout and trainer log-probabilities still equal (mismatch exactly 0), rank 0
//! alone writing the run's files, and the layouts RL does not run refused in one line.

use anneal_tests::cli as common;

mod rl_support;

use common::{ok, user_error};
use rl_support::{first_step_samples, resumes_bitwise, rl, rl_job, steps};
use serde_json::Value;

#[test]
fn two_ranks_train_like_one_process() {
    let dir = rl_job("ddp");
    let (out, one_dir) = rl(1, &dir, "one", &[]);
    ok(&out);
    let (out, two_dir) = rl(2, &dir, "two", &[]);
    ok(&out);
    let (one, two) = (steps(&one_dir), steps(&two_dir));
    assert_eq!((one.len(), two.len()), (4, 4));
    let loss = |r: &Value| r["loss"].as_f64().expect("loss");
    assert_eq!(
        loss(&one[0]).to_bits(),
        loss(&two[0]).to_bits(),
        "step 1 bitwise"
    );
    assert!(
        loss(&one[0]).abs() > 1e-3,
        "a loss worth comparing: {}",
        one[0]
    );
    for (a, b) in one.iter().zip(&two) {
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
        assert_eq!(b["logprob_mismatch_max"].as_f64(), Some(0.0), "{b}");
        assert_eq!(a["logprob_mismatch_max"].as_f64(), Some(0.0), "{a}");
    }
    // Step 1 rolls out the same prompts with the same weights: the same rewards and samples.
    for key in ["reward_mean", "reward_std", "response_len_mean"] {
        assert_eq!(one[0][key], two[0][key], "{key}");
    }
    let (s1, s2) = (first_step_samples(&one_dir), first_step_samples(&two_dir));
    assert_eq!(s1.len(), 16, "every sample of step 1 is recorded");
    assert_eq!(s1, s2, "step 1's samples");
    // Rank 0 holds the run: checkpoints of steps 2 and 4; rank 1 logs beside it.
    for step in [2, 4] {
        assert!(two_dir.join(format!("checkpoints/step-{step}")).is_dir());
    }
    let rank1 = std::fs::read_to_string(two_dir.join("logs/rank-1.log")).expect("rank 1's log");
    assert!(rank1.contains("rank 1 of 2"), "{rank1}");

    // The 2-rank run resumes from its step-2 checkpoint with the same losses.
    resumes_bitwise(2, &dir, &two_dir, "two-resumed", &[]);
}

#[test]
fn layouts_rl_does_not_run_are_user_errors() {
    let dir = rl_job("refused");
    // (Pipeline stages run: tests/rl_pp_cli.rs.)
    let (out, _) = rl(2, &dir, "refused", &["rl.prompts_per_step=3"]);
    user_error(&out, &["rl.prompts_per_step", "2"]);
}
