//! `anneal rl` under context parallelism (`parallelism.cp = 2` on 2 MPI ranks: the group's
//! first rank rolls out with the whole policy, and each rank runs chunks `r` and `3 − r` of
//! every padded row through the trainer's forward, its attention gathering the group's keys
//! and values whole) against one process: the rollout and trainer logprobs stay bitwise
//! equal (mismatch exactly 0 every step), step 1's loss is the single process's bit for bit
//! (the whole logits are the same bits, and the loss runs on them unchanged), and the curve
//! follows it (see the test for the tolerance), resumes continue bit for bit and move
//! between one process and cp = 2; what RL does not run beside cp is refused in one line.

use anneal_tests::cli as common;

mod dist_support;
mod rl_support;

use common::{ok, user_error};
use dist_support::follows_single;
use rl_support::{first_step_samples, resume_copy, resumes_bitwise, rl, rl_job, steps};
use serde_json::Value;

const CP2: &str = "parallelism.cp=2";

fn field(r: &Value, name: &str) -> f64 {
    r[name].as_f64().unwrap_or_else(|| panic!("{name} in {r}"))
}

fn losses(rows: &[Value]) -> Vec<f64> {
    rows.iter().map(|r| field(r, "loss")).collect()
}

#[test]
fn context_parallel_rl_keeps_parity_follows_one_process_and_resumes() {
    let dir = rl_job("cp");
    let (out, one_dir) = rl(1, &dir, "one", &[]);
    ok(&out);
    let (out, cp_dir) = rl(2, &dir, "cp2", &[CP2]);
    let stdout = ok(&out);
    assert!(stdout.contains("cp: rank 0 of 2"), "{stdout}");
    let (one, two) = (steps(&one_dir), steps(&cp_dir));
    assert_eq!(
        (one.len(), two.len()),
        (4, 4),
        "the first rank alone writes rows"
    );
    // Every row of the trainer's forward is the rollout decode's, bit for bit.
    for r in one.iter().chain(&two) {
        assert_eq!(r["logprob_mismatch_max"].as_f64(), Some(0.0), "{r}");
    }
    assert!(
        field(&one[0], "loss").abs() > 1e-3,
        "a loss worth comparing"
    );
    assert_eq!(
        field(&one[0], "loss").to_bits(),
        field(&two[0], "loss").to_bits(),
        "step 1"
    );
    assert_eq!(first_step_samples(&one_dir), first_step_samples(&cp_dir));
    // The gradients are each rank's rows' share summed over the group (and the keys' and
    // values' gradients each rank's queries' shares summed), so they round differently from
    // one backward: the updates, hence later steps, differ in the last bits. The losses then
    // follow within 1e-4 relative (step 1 within 1e-6, here exact), as FSDP's do, and the
    // gradient norms within 1e-4 relative; the samples, and so the rewards, stay the same.
    follows_single("cp2", &losses(&one), &losses(&two));
    for (a, b) in one.iter().zip(&two) {
        let (g, h) = (field(a, "grad_norm"), field(b, "grad_norm"));
        assert!((g - h).abs() <= 1e-4 * g, "step {}: {g} vs {h}", a["step"]);
        assert_eq!(a["reward_mean"], b["reward_mean"], "step {}", a["step"]);
    }

    // The checkpoints hold whole tensors: cp = 2 continues its own bit for bit, and step 3 of
    // a run moved between one process and cp = 2 is the run that wrote the checkpoint's.
    resumes_bitwise(2, &dir, &cp_dir, "cp2-again", &[CP2]);
    for (n, done, set, run) in [
        (1, &cp_dir, &[][..], "cp2-to-one"),
        (2, &one_dir, &[CP2][..], "one-to-cp2"),
    ] {
        let resumed = resume_copy(n, &dir, done, run, set);
        let before = steps(done);
        assert_eq!(
            field(&before[2], "loss").to_bits(),
            field(&resumed[2], "loss").to_bits(),
            "{run}: step 3"
        );
        follows_single(run, &losses(&before), &losses(&resumed));
        for r in &resumed[2..] {
            assert_eq!(r["logprob_mismatch_max"].as_f64(), Some(0.0), "{run}: {r}");
        }
    }
}

#[test]
fn what_context_parallel_rl_does_not_run_is_a_user_error() {
    let dir = rl_job("cp-refused");
    for (set, needles) in [
        (
            "parallelism.tp=2",
            &["parallelism.cp", "parallelism.tp"][..],
        ),
        (
            "parallelism.dp_shard=2",
            &["parallelism.cp", "parallelism.dp_shard"][..],
        ),
    ] {
        let (out, _) = rl(4, &dir, "refused", &[CP2, set]);
        user_error(&out, needles);
    }
}
