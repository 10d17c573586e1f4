//! `anneal rl` with sharded parameters (`parallelism.dp_shard = 2` on 2 MPI ranks: each holds
//! half the rows of the policy, of its gradients, of the AdamW state and of the KL reference
//! between steps, and gathers the policy whole once per step for its rollouts and the trainer)
//! against one process: rollout and trainer logprobs stay bitwise equal (mismatch exactly 0),
//! step 1 is the single process's loss bit for bit and the curve follows it, the checkpoints
//! hold each rank's rows as FSDP training writes them, and they reshard: FSDP(2) resumes its
//! own, one process resumes FSDP(2)'s and FSDP(2) one process's, each continuing bit for bit.
//! HSDP (two replicas of FSDP(2) on 4 ranks) follows one process and FSDP(2) resumes it.

use anneal_tests::cli as common;

mod dist_support;
mod rl_layout_support;
mod rl_support;

use common::{ok, user_error};
use dist_support::{follows_single, manifest_of, piece};
use rl_layout_support::{checkpoints_move, follows_one_process, losses, mismatch_zero};
use rl_support::{resume_copy, rl, rl_job, steps};

const FSDP2: &str = "parallelism.dp_shard=2";

#[test]
fn sharded_rl_keeps_parity_follows_one_process_and_reshards() {
    let dir = rl_job("fsdp");
    let (out, one_dir) = rl(1, &dir, "one", &[]);
    ok(&out);
    let (out, fsdp_dir) = rl(2, &dir, "fsdp2", &[FSDP2]);
    let stdout = ok(&out);
    assert!(
        stdout.contains("fsdp: the policy sharded over 2"),
        "{stdout}"
    );
    // The rollouts decode with the gathered policy the trainer's forward runs on.
    follows_one_process("fsdp2", &one_dir, &fsdp_dir, (true, 1e-4));

    // Each rank wrote its rows of the policy, of the optimizer state and of the reference.
    let step2 = fsdp_dir.join("checkpoints/step-2");
    let manifest = manifest_of(&step2);
    for name in [
        "model/layers.0.attention.wq.weight",
        "optim/layers.0.attention.wq.weight.exp_avg",
        "ref/layers.0.attention.wq.weight",
    ] {
        for shard in [
            "shard-00000-of-00002.safetensors",
            "shard-00001-of-00002.safetensors",
        ] {
            let p = piece(&manifest, name, shard)
                .unwrap_or_else(|| panic!("{name} has a piece in {shard}: {manifest}"));
            assert_eq!(p["global_shape"], serde_json::json!([32, 32]), "{p}");
        }
    }

    // Resharding: the continued runs' step 3 starts from the saved bits (bitwise the run that
    // wrote the checkpoint), step 4 follows it.
    checkpoints_move(&dir, &one_dir, &fsdp_dir, (2, "fsdp2", &[FSDP2]));
}

#[test]
fn hybrid_sharded_rl_follows_one_process_and_reshards_to_fsdp() {
    // HSDP: two replicas of a policy sharded over two ranks, each rank rolling out a quarter
    // of the prompts; the gradients reduce-scatter within a replica and sum across them.
    let dir = rl_job("hsdp");
    let (out, one_dir) = rl(1, &dir, "one", &[]);
    ok(&out);
    let hsdp = [FSDP2, "parallelism.dp_replicate=2"];
    let (out, hsdp_dir) = rl(4, &dir, "hsdp", &hsdp);
    let stdout = ok(&out);
    assert!(
        stdout.contains("fsdp: the policy sharded over 2"),
        "{stdout}"
    );
    let (one, four) = (steps(&one_dir), steps(&hsdp_dir));
    assert_eq!(four.len(), 4, "rank 0 alone writes rows");
    mismatch_zero("hsdp", &four);
    follows_single("hsdp", &losses(&one), &losses(&four));
    // The first replica's ranks wrote the checkpoint as FSDP(2) writes it: FSDP(2) resumes it.
    let resumed = resume_copy(2, &dir, &hsdp_dir, "hsdp-to-fsdp2", &[FSDP2]);
    follows_single("hsdp-to-fsdp2", &losses(&one), &losses(&resumed));
    assert_eq!(resumed[2]["logprob_mismatch_max"].as_f64(), Some(0.0));
}

#[test]
fn what_sharded_rl_does_not_run_is_a_user_error() {
    let dir = rl_job("fsdp-refused");
    for (set, needles) in [
        (
            "rl.max_staleness=1",
            &["rl.max_staleness", "parallelism.dp_shard"][..],
        ),
        (
            "rl.rollout_threads=2",
            &["rl.rollout_threads", "parallelism.dp_shard"][..],
        ),
        // Expert parallelism needs a model with experts (tests/rl_ep_cli.rs runs one).
        ("parallelism.ep=2", &["parallelism.ep", "no experts"][..]),
        (
            "parallelism.fsdp_all_gather_dtype=bfloat16",
            &["parallelism.fsdp_all_gather_dtype"][..],
        ),
    ] {
        let (out, _) = rl(2, &dir, "refused", &[FSDP2, set]);
        user_error(&out, needles);
    }
}
