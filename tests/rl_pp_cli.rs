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
mod rl_support;

use common::{ok, user_error};
use dist_support::{follows_single, manifest_of, piece};
use rl_support::{first_step_samples, resume_copy, resumes_bitwise, rl, rl_job, steps};
use serde_json::Value;

const PP2: &str = "parallelism.pp=2";

fn loss(r: &Value) -> f64 {
    r["loss"].as_f64().expect("loss")
}

/// The losses of training rows.
fn losses(rows: &[Value]) -> Vec<f64> {
    rows.iter().map(loss).collect()
}

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
    let (one, two) = (steps(&one_dir), steps(&pp_dir));
    assert_eq!(
        (one.len(), two.len()),
        (4, 4),
        "the first rank alone writes rows"
    );
    assert!(loss(&one[0]).abs() > 1e-3, "a loss worth comparing");
    // The rollouts decode with the gathered stages the pipeline's forward runs on.
    for r in one.iter().chain(&two) {
        assert_eq!(r["logprob_mismatch_max"].as_f64(), Some(0.0), "{r}");
    }
    assert_eq!(loss(&one[0]).to_bits(), loss(&two[0]).to_bits(), "step 1");
    for key in ["reward_mean", "entropy"] {
        assert_eq!(one[0][key], two[0][key], "step 1 {key}");
    }
    follows_single("pp2", &losses(&one), &losses(&two));
    for (a, b) in one.iter().zip(&two) {
        let (g, h) = (
            a["grad_norm"].as_f64().unwrap(),
            b["grad_norm"].as_f64().unwrap(),
        );
        assert!((g - h).abs() <= 1e-4 * g, "step {}: {g} vs {h}", a["step"]);
    }
    assert_eq!(first_step_samples(&one_dir), first_step_samples(&pp_dir));

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
    resumes_bitwise(2, &dir, &pp_dir, "pp2-again", &[PP2]);
    for (n, done, set, run) in [
        (1, &pp_dir, &[][..], "pp2-to-one"),
        (2, &one_dir, &[PP2][..], "one-to-pp2"),
    ] {
        let resumed = resume_copy(n, &dir, done, run, set);
        let before = steps(done);
        assert_eq!(
            loss(&before[2]).to_bits(),
            loss(&resumed[2]).to_bits(),
            "{run}: step 3"
        );
        follows_single(run, &losses(&before), &losses(&resumed));
        for r in &resumed[2..] {
            assert_eq!(r["logprob_mismatch_max"].as_f64(), Some(0.0), "{run}: {r}");
        }
    }
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
