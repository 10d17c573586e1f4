//! `anneal rl` pipeline parallel (`parallelism.pp = 2` on 2 MPI ranks: each holds its stages'
//! parameters and AdamW state, gathers the whole policy once per step for the rollouts, which
//! every rank decodes identically, and trains through the pipeline with one micro-batch per
//! group) against one process: rollout and trainer logprobs stay bitwise equal (mismatch
//! exactly 0) at every step, step 1 is the single process's loss and samples bit for bit and
//! the curve follows it; the checkpoints are whole (written by the first rank), so the
//! pipeline resumes its own bit for bit, one process resumes the pipeline's and the pipeline
//! one process's.

use anneal_tests::cli as common;

mod dist_support;
mod rl_layout_support;
mod rl_support;

use common::{ok, user_error};
use dist_support::{manifest_of, piece};
use rl_layout_support::{checkpoints_move, follows_one_process};
use rl_support::{rl, rl_job, steps};

const PP2: &str = "parallelism.pp=2";

#[test]
fn pipeline_rl_keeps_parity_follows_one_process_and_resumes() {
    let dir = rl_job("pp");
    let (out, one_dir) = rl(1, &dir, "one", &[]);
    ok(&out);
    let (out, pp_dir) = rl(2, &dir, "pp2", &[PP2]);
    let stdout = ok(&out);
    assert!(
        stdout.contains("pipeline: 2 stage(s) on 2 rank(s)"),
        "{stdout}"
    );
    // The rollouts decode with the gathered stages the pipeline's forward runs on.
    let (one, two) = follows_one_process("pp2", &one_dir, &pp_dir, (true, 1e-4));
    for key in ["reward_mean", "entropy"] {
        assert_eq!(one[0][key], two[0][key], "step 1 {key}");
    }

    // The checkpoint is whole: both stages' parameters, optimizer state and reference in the
    // first rank's one shard.
    let manifest = manifest_of(&pp_dir.join("checkpoints/step-2"));
    for name in [
        "model/tok_embeddings.weight",
        "model/layers.1.attention.wq.weight",
        "model/output.weight",
        "optim/layers.0.attention.wq.weight.exp_avg",
        "optim/layers.1.attention.wq.weight.exp_avg",
        "ref/layers.1.attention.wq.weight",
    ] {
        let p = piece(&manifest, name, "shard-00000-of-00001.safetensors")
            .unwrap_or_else(|| panic!("{name} is in the one shard: {manifest}"));
        assert!(p["global_shape"].is_array(), "{p}");
    }

    // The pipeline resumes its own checkpoint bit for bit; across layouts the continued
    // run's step 3 starts from the saved bits (bitwise the run that wrote the checkpoint).
    checkpoints_move(&dir, &one_dir, &pp_dir, (2, "pp2", &[PP2]));
}

#[test]
fn zero_bubble_rl_is_the_1f1b_pipeline_bit_for_bit() {
    // The zero-bubble schedule splits each backward into input and weight passes: the same
    // sums, so the same losses and gradient norms as 1F1B at every step.
    let dir = rl_job("pp-zb");
    let (out, f1b) = rl(2, &dir, "1f1b", &[PP2]);
    ok(&out);
    let (out, zb) = rl(2, &dir, "zb", &[PP2, "parallelism.pp_schedule=zero_bubble"]);
    ok(&out);
    let (a, b) = (steps(&f1b), steps(&zb));
    assert_eq!((a.len(), b.len()), (4, 4));
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(y["logprob_mismatch_max"].as_f64(), Some(0.0), "{y}");
        for key in ["loss", "grad_norm", "reward_mean"] {
            assert_eq!(x[key], y[key], "step {} {key}", x["step"]);
        }
    }
}

#[test]
fn what_pipeline_rl_does_not_run_is_a_user_error() {
    let dir = rl_job("pp-refused");
    for (set, needles) in [
        (
            "rl.max_staleness=1",
            &["rl.max_staleness", "parallelism.pp"][..],
        ),
        (
            "rl.rollout_threads=2",
            &["rl.rollout_threads", "parallelism.pp"][..],
        ),
    ] {
        let (out, _) = rl(2, &dir, "refused", &[PP2, set]);
        user_error(&out, needles);
    }
    let (out, _) = rl(4, &dir, "refused", &[PP2, "parallelism.dp_replicate=2"]);
    user_error(&out, &["parallelism.dp_replicate", "parallelism.pp"]);
}
