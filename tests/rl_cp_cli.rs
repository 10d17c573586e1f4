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
mod rl_layout_support;
mod rl_support;

use common::{ok, user_error};
use rl_layout_support::{checkpoints_move, follows_one_process};
use rl_support::{rl, rl_job};

const CP2: &str = "parallelism.cp=2";

#[test]
fn context_parallel_rl_keeps_parity_follows_one_process_and_resumes() {
    let dir = rl_job("cp");
    let (out, one_dir) = rl(1, &dir, "one", &[]);
    ok(&out);
    let (out, cp_dir) = rl(2, &dir, "cp2", &[CP2]);
    let stdout = ok(&out);
    assert!(stdout.contains("cp: rank 0 of 2"), "{stdout}");
    // Every row of the trainer's forward is the rollout decode's, bit for bit.
    // The gradients are each rank's rows' share summed over the group (and the keys' and
    // values' gradients each rank's queries' shares summed), so they round differently from
    // one backward: the updates, hence later steps, differ in the last bits. The losses then
    // follow within 1e-4 relative (step 1 within 1e-6, here exact), as FSDP's do, and the
    // gradient norms within 1e-4 relative; the samples, and so the rewards, stay the same.
    let (one, two) = follows_one_process("cp2", &one_dir, &cp_dir, (true, 1e-4));
    for (a, b) in one.iter().zip(&two) {
        assert_eq!(a["reward_mean"], b["reward_mean"], "step {}", a["step"]);
    }

    // The checkpoints hold whole tensors: cp = 2 continues its own bit for bit, and step 3 of
    // a run moved between one process and cp = 2 is the run that wrote the checkpoint's.
    checkpoints_move(&dir, &one_dir, &cp_dir, (2, "cp2", &[CP2]));
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
