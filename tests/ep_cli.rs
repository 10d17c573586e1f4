//! Expert parallelism on real MPI ranks (one compute thread each) with a tiny Qwen3-MoE (4
//! experts, aux-loss-free balancing on): `ep` borrows the ranks of `dp_shard`, each rank keeps
//! its slice of the experts and the MoE layers send token rows to their experts' ranks and
//! back. EP2 (dp_shard 2: dense parameters FSDP(2), experts split in two) and EP2 × FSDP2
//! (dp_shard 4: each slice of experts sharded again over 2 ranks) follow the single process
//! (step 1 within 1e-6, 50 steps within 1e-4), rerun bitwise, keep the balancing bias identical
//! on every rank and save checkpoints a single process resumes. Bad layouts are one line
//! naming the keys, exit 2. HSDP(2×2) × EP2 and EP2 with full recompute follow the single
//! process too.

mod dist_support;

use anneal_tests::cli as common;

use common::{losses, ok, rows, user_error, Job};
use dist_support::{
    follows_after, follows_single, loss_values, manifest_of, mpiexec_train, piece, resumed_copy,
};
use std::path::Path;

const MOE: [&str; 4] = [
    "model.flavor=\"debugmodel_qwen3_moe\"",
    "model.args.moe.n_experts=4",
    "model.args.moe.expert_ffn_dim=16",
    "model.args.moe.balance_rate=0.01",
];

/// Four micro-batches of one sequence: one or two per rank on 4 or 2 ranks.
const STEPS: [&str; 6] = [
    "training.micro_batch_size=1",
    "training.steps=50",
    "training.threads=1",
    "metrics.eval_freq=25",
    "checkpoint.interval=40",
    "checkpoint.keep_latest=2",
];

fn settings(extra: &[&'static str]) -> Vec<&'static str> {
    MOE.iter().chain(&STEPS).chain(extra).copied().collect()
}

/// The bytes each step's expert exchanges sent from rank 0.
fn a2a_bytes(run_dir: &Path) -> Vec<u64> {
    rows(run_dir)
        .iter()
        .filter_map(|r| r["ep_a2a_bytes"].as_u64())
        .collect()
}

#[test]
fn expert_parallel_runs_follow_the_single_process_and_reshard() {
    let job = Job::new("ep");
    let (single, single_dir) = job.train("single", &settings(&[]));
    ok(&single);
    let want = loss_values(&single_dir);

    let run = |name: &str, n: usize, layout: &[&'static str]| {
        let dir = job.dir.join(name);
        let out = ok(&mpiexec_train(n, &job, &dir, &settings(layout)));
        assert!(
            out.contains("buffers identical on every rank"),
            "{name}: the balancing bias is checked: {out}"
        );
        dir
    };
    let ep2 = run("ep2", 2, &["parallelism.dp_shard=2", "parallelism.ep=2"]);
    let ep2_again = run(
        "ep2-again",
        2,
        &["parallelism.dp_shard=2", "parallelism.ep=2"],
    );
    let ep2_fsdp2 = run(
        "ep2-fsdp2",
        4,
        &["parallelism.dp_shard=4", "parallelism.ep=2"],
    );
    follows_single("EP2", &want, &loss_values(&ep2));
    follows_single("EP2 x FSDP2", &want, &loss_values(&ep2_fsdp2));
    assert_eq!(losses(&ep2), losses(&ep2_again), "EP2 reruns bitwise");
    // The whole step's token counts feed the bias, as in one process.
    let counts = |d: &Path| rows(d).last().unwrap()["moe.layer1.tokens_per_expert"].clone();
    assert_eq!(counts(&single_dir), counts(&ep2));
    for d in [&ep2, &ep2_fsdp2] {
        let b = a2a_bytes(d);
        assert_eq!(b.len(), 50, "{}", d.display());
        assert!(b.iter().all(|&x| x > 0), "{b:?}");
        println!("{}: {} expert exchange bytes at step 1", d.display(), b[0]);
    }

    // Each shard holds whole experts of the expert stacks: EP2's rank 1 rows 2..4 of 4.
    let m = manifest_of(&ep2.join("checkpoints/step-40"));
    let name = "model/layers.0.feed_forward.experts.w1";
    let p = piece(&m, name, "shard-00001-of-00002.safetensors")
        .unwrap_or_else(|| panic!("{name} in shard 1: {m}"));
    assert_eq!(p["slice"][0], serde_json::json!([2, 4]), "{p}");

    // EP2 and EP2 x FSDP2 checkpoints resume as one process, on the single process's curve.
    for (name, from) in [("ep2", &ep2), ("ep2-fsdp2", &ep2_fsdp2)] {
        let name = format!("{name}-as-single");
        let got = resumed_copy(&job, &name, from, (&[50], 40), 1, &settings(&[]));
        follows_after(&name, &want, &got, 40);
    }
}

#[test]
fn bad_expert_layouts_name_the_keys() {
    let job = Job::new("ep-bad");
    let moe = |extra: &[&'static str]| -> Vec<&'static str> {
        MOE.iter()
            .chain(&["training.micro_batch_size=2", "training.steps=1"])
            .chain(extra)
            .copied()
            .collect()
    };
    // ep must divide dp_shard (it adds no processes).
    let (out, _) = job.train("one", &moe(&["parallelism.ep=2"]));
    user_error(&out, &["parallelism.ep = 2", "parallelism.dp_shard = 1"]);
    let out = mpiexec_train(
        2,
        &job,
        &job.dir.join("three"),
        &moe(&["parallelism.dp_shard=2", "parallelism.ep=3"]),
    );
    user_error(&out, &["parallelism.ep = 3", "parallelism.dp_shard = 2"]);
    let (out, _) = job.train("wild", &moe(&["parallelism.ep=-1"]));
    user_error(&out, &["parallelism.ep", "dp_shard"]);
    // The experts must split evenly; the model must have experts; Muon is refused.
    let ep2 = ["parallelism.dp_shard=2", "parallelism.ep=2"];
    let mut three = moe(&ep2);
    three.push("model.args.moe.n_experts=3");
    let out = mpiexec_train(2, &job, &job.dir.join("uneven"), &three);
    user_error(&out, &["parallelism.ep", "3 experts"]);
    let mut dense: Vec<&str> = vec!["training.micro_batch_size=2", "training.steps=1"];
    dense.extend(ep2);
    let out = mpiexec_train(2, &job, &job.dir.join("dense"), &dense);
    user_error(&out, &["parallelism.ep", "no experts"]);
    let mut muon = moe(&ep2);
    muon.push("optimizer.plugin=\"muon\"");
    let out = mpiexec_train(2, &job, &job.dir.join("muon"), &muon);
    user_error(&out, &["parallelism.ep", "optimizer.plugin"]);
}

#[test]
fn expert_parallelism_composes_with_hsdp_and_recompute() {
    let job = Job::new("ep-more");
    let short = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut s = settings(extra);
        s.extend(["training.steps=20", "checkpoint.interval=0"]);
        s
    };
    let (single, single_dir) = job.train("single", &short(&[]));
    ok(&single);
    let want = loss_values(&single_dir);
    for (name, n, layout) in [
        (
            "HSDP(2x2) x EP2",
            4,
            &[
                "parallelism.dp_replicate=2",
                "parallelism.dp_shard=2",
                "parallelism.ep=2",
            ][..],
        ),
        (
            "EP2 with recompute",
            2,
            &[
                "parallelism.dp_shard=2",
                "parallelism.ep=2",
                "activation_checkpoint.mode=\"full\"",
            ][..],
        ),
    ] {
        let dir = job.dir.join(name.replace([' ', '(', ')'], "_"));
        let out = ok(&mpiexec_train(n, &job, &dir, &short(layout)));
        assert!(
            out.contains("buffers identical on every rank"),
            "{name}: {out}"
        );
        follows_single(name, &want, &loss_values(&dir));
    }
}
