//! `anneal rl` expert parallel (`parallelism.ep = 2`, borrowing `parallelism.dp_shard = 2` on 2
//! MPI ranks) with a tiny Qwen3-MoE (4 experts, aux-loss-free balancing) against one process:
//! each rank keeps two of the four experts (and their AdamW state) beside its FSDP rows of the
//! dense parameters; a step gathers the experts whole for its rollouts while the trainer's
//! forward runs expert parallel (token rows sent to the experts' ranks), and the two give the
//! same logprobs bit for bit (mismatch exactly 0).
//!
//! Against one process the router's balancing loss is weighted 0: it is a statistic of each
//! rank's own batch, so any data-parallel split (FSDP's too) changes its gradient. Then step 1's
//! loss is the single process's bit for bit and the curve follows it (within 1e-4, the
//! data-parallel tolerance: the gradients are summed in another order, which the sampled
//! completions can amplify), with the same rewards. With the balancing loss on, EP(2) follows
//! FSDP(2), the same split, within 1e-6. Each rank writes its own experts' rows; the run resumes
//! itself bit for bit and one process resumes it. With `tp` as well it is refused (one line
//! naming the keys).

use anneal_tests::cli as common;

mod dist_support;
mod rl_layout_support;
mod rl_support;

use common::{ok, user_error};
use dist_support::{follows_single, manifest_of, piece};
use rl_layout_support::{follows_one_process, losses};
use rl_support::{resume_copy, resumes_bitwise, rl, rl_job, steps};

const MOE: [&str; 4] = [
    "model.flavor=\"debugmodel_qwen3_moe\"",
    "model.args.moe.n_experts=4",
    "model.args.moe.expert_ffn_dim=16",
    "model.args.moe.balance_rate=0.01",
];

/// The balancing loss is a statistic of each rank's batch (see the module docs).
const NO_AUX: &str = "training.aux_loss_weights.load_balance=0";

const EP2: [&str; 2] = ["parallelism.dp_shard=2", "parallelism.ep=2"];

fn moe(extra: &[&'static str]) -> Vec<&'static str> {
    MOE.iter().chain(extra).copied().collect()
}

#[test]
fn expert_parallel_rl_keeps_parity_follows_one_process_and_resumes() {
    let dir = rl_job("ep");
    let (out, one_dir) = rl(1, &dir, "one", &moe(&[NO_AUX]));
    ok(&out);
    let ep2 = moe(&[EP2[0], EP2[1], NO_AUX]);
    let (out, ep_dir) = rl(2, &dir, "ep2", &ep2);
    let stdout = ok(&out);
    assert!(
        stdout.contains("expert parameters in 2 slices of experts"),
        "{stdout}"
    );
    // The rollouts decode with the experts made whole; the trainer runs them expert parallel.
    let (one, two) = follows_one_process("ep2", &one_dir, &ep_dir, (true, 1e-6));
    for (a, b) in one.iter().zip(&two) {
        assert_eq!(a["reward_mean"], b["reward_mean"], "step {}", a["step"]);
    }

    // Rank 1 wrote experts 2..4 of every expert stack, with their optimizer state and reference.
    let manifest = manifest_of(&ep_dir.join("checkpoints/step-2"));
    for name in [
        "model/layers.0.feed_forward.experts.w1",
        "optim/layers.0.feed_forward.experts.w1.exp_avg",
        "ref/layers.0.feed_forward.experts.w1",
    ] {
        let p = piece(&manifest, name, "shard-00001-of-00002.safetensors")
            .unwrap_or_else(|| panic!("{name} in shard 1: {manifest}"));
        assert_eq!(p["slice"][0], serde_json::json!([2, 4]), "{p}");
    }

    // EP2 resumes its own checkpoint bit for bit; one process resumes it on the curve.
    resumes_bitwise(2, &dir, &ep_dir, "ep2-again", &ep2);
    let resumed = resume_copy(1, &dir, &ep_dir, "ep2-to-one", &moe(&[NO_AUX]));
    follows_single("ep2-to-one", &losses(&two), &losses(&resumed));
    assert_eq!(resumed[2]["logprob_mismatch_max"].as_f64(), Some(0.0));
}

#[test]
fn expert_parallel_rl_with_the_balancing_loss_follows_fsdp() {
    let dir = rl_job("ep-aux");
    let no_save = "checkpoint.interval=0";
    let (out, fsdp_dir) = rl(2, &dir, "fsdp2", &moe(&[EP2[0], no_save]));
    ok(&out);
    let (out, ep_dir) = rl(2, &dir, "ep2", &moe(&[EP2[0], EP2[1], no_save]));
    ok(&out);
    let (fsdp, ep) = (steps(&fsdp_dir), steps(&ep_dir));
    for r in fsdp.iter().chain(&ep) {
        assert_eq!(r["logprob_mismatch_max"].as_f64(), Some(0.0), "{r}");
        assert!(r["aux_loss"].as_f64().is_some_and(|a| a > 0.0), "{r}");
    }
    let (a, b) = (losses(&fsdp), losses(&ep));
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-6 * x.abs(),
            "step {}: {x} vs {y}",
            step + 1
        );
    }
    for (x, y) in fsdp.iter().zip(&ep) {
        assert_eq!(x["reward_mean"], y["reward_mean"], "step {}", x["step"]);
    }
}

#[test]
fn expert_parallel_rl_refuses_what_it_does_not_run() {
    let dir = rl_job("ep-refused");
    // ep borrows dp_shard's ranks; the model needs experts; the rollouts are synchronous.
    let (out, _) = rl(2, &dir, "no-shard", &moe(&["parallelism.ep=2"]));
    user_error(&out, &["parallelism.ep", "parallelism.dp_shard"]);
    let (out, _) = rl(2, &dir, "dense", &EP2);
    user_error(&out, &["parallelism.ep", "no experts"]);
    let (out, _) = rl(
        2,
        &dir,
        "async",
        &moe(&[EP2[0], EP2[1], "rl.max_staleness=1"]),
    );
    user_error(&out, &["rl.max_staleness", "parallelism.dp_shard"]);
    // Experts split by both ep and tp train (`anneal train`), but the RL policy does not yet.
    let (out, _) = rl(4, &dir, "tp", &moe(&[EP2[0], EP2[1], "parallelism.tp=2"]));
    user_error(&out, &["parallelism.tp", "parallelism.ep"]);
}
