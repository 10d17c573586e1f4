//! Tensor parallelism over mixture-of-experts layers on real MPI ranks (one compute thread each)
//! with a tiny Qwen3-MoE (4 experts of width 16, top 2, aux-loss-free balancing and the
//! balancing loss on): each rank holds every expert's half (gate and up by outputs, down by
//! inputs) beside its share of the heads; the router stays whole and routes the whole batch on
//! every rank, and each layer's output is summed over the group once. TP2 and TP2 with sequence
//! parallelism follow the single process (step 1 within 1e-6, 50 steps within 1e-4), TP2
//! reruns bitwise, the balancing bias stays the same bits on every rank and sees the single
//! process's token counts, and a TP2 checkpoint (the experts' slices gathered whole) resumes in
//! one process on the single process's curve. TP2 composes with FSDP2, CP2 and PP2 (4 ranks
//! each, on the single process's curve; TP2 x FSDP2's checkpoint resumes in one process).
//! TP2 x EP2 (dp_shard 2, 4 ranks: each rank holds half the width of half the experts, the
//! rows sent to the expert group's rank of the same tp coordinate) follows the single
//! process, resumes its own checkpoint bit for bit and its checkpoint resumes in one process;
//! it composes with SP (4 ranks), CP2 and PP2 (8 ranks each), on the single process's curve.

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

/// Four micro-batches of one sequence, all four on each rank of the TP group.
const STEPS: [&str; 6] = [
    "training.micro_batch_size=1",
    "training.steps=50",
    "training.threads=1",
    "metrics.eval_freq=25",
    "checkpoint.interval=40",
    "checkpoint.keep_latest=2",
];

const TP2: [&str; 1] = ["parallelism.tp=2"];
const TP2_SP: [&str; 2] = ["parallelism.tp=2", "parallelism.tp_sequence=true"];

fn settings(extra: &[&'static str]) -> Vec<&'static str> {
    MOE.iter().chain(&STEPS).chain(extra).copied().collect()
}

/// The last step's tokens per expert of the first sparse layer.
fn counts(run_dir: &Path) -> serde_json::Value {
    rows(run_dir).last().expect("metrics rows")["moe.layer1.tokens_per_expert"].clone()
}

#[test]
fn tensor_parallel_experts_follow_the_single_process_and_resume() {
    let job = Job::new("tp-moe");
    let (single, single_dir) = job.train("single", &settings(&[]));
    ok(&single);
    let want = loss_values(&single_dir);
    let run = |name: &str, layout: &[&'static str]| {
        let dir = job.dir.join(name);
        let out = ok(&mpiexec_train(2, &job, &dir, &settings(layout)));
        assert!(out.contains("tp: rank 0 of 2"), "{name}: {out}");
        assert!(
            out.contains("buffers identical on every rank"),
            "{name}: the balancing bias is checked: {out}"
        );
        dir
    };
    let tp2 = run("tp2", &TP2);
    let tp2_again = run("tp2-again", &TP2);
    let tp2_sp = run("tp2-sp", &TP2_SP);
    follows_single("MoE TP2", &want, &loss_values(&tp2));
    follows_single("MoE TP2 with SP", &want, &loss_values(&tp2_sp));
    assert_eq!(losses(&tp2), losses(&tp2_again), "MoE TP2 reruns bitwise");
    // Every rank routes the whole batch: the counts that move the bias are one process's.
    assert_eq!(counts(&single_dir), counts(&tp2));
    assert_eq!(counts(&single_dir), counts(&tp2_sp));

    // The experts' slices are cut along a dim other than 0: the group's first rank saves
    // them whole (gate `[4, 16, 32]` by its expert width, down `[4, 32, 16]` too).
    let m = manifest_of(&tp2.join("checkpoints/step-40"));
    for (name, width_dim) in [
        ("model/layers.0.feed_forward.experts.w1", 1),
        ("model/layers.0.feed_forward.experts.w2", 2),
    ] {
        let p = piece(&m, name, "shard-00000-of-00002.safetensors")
            .unwrap_or_else(|| panic!("{name} in shard 0: {m}"));
        assert_eq!(p["slice"][width_dim], serde_json::json!([0, 16]), "{p}");
        assert!(piece(&m, name, "shard-00001-of-00002.safetensors").is_none());
    }

    // Resumed in one process at step 40, steps 41..=50 stay on the single process's curve.
    let got = resumed_copy(&job, "tp2-as-single", &tp2, (&[50], 40), 1, &settings(&[]));
    follows_after("tp2-as-single", &want, &got, 40);
}

#[test]
fn tensor_parallel_experts_compose_with_fsdp_context_and_pipeline_parallelism() {
    // The balancing loss weighted 0: under cp it is each rank's tokens' (see docs/distributed.md), so
    // every layout here must follow the same single process. The balancing bias stays on: its
    // token counts are summed over the data-parallel and cp ranks.
    let job = Job::new("tp-moe-composed");
    let no_aux = ["training.aux_loss_weights.load_balance=0.0"];
    let (single, single_dir) = job.train("single", &settings(&no_aux));
    ok(&single);
    let want = loss_values(&single_dir);
    let fsdp = ["parallelism.tp=2", "parallelism.dp_shard=2"];
    let cp = ["parallelism.tp=2", "parallelism.cp=2"];
    let pp = ["parallelism.tp=2", "parallelism.pp=2"];
    let mut dirs = Vec::new();
    for (name, layout) in [("tp2-fsdp2", &fsdp), ("tp2-cp2", &cp), ("pp2-tp2", &pp)] {
        let dir = job.dir.join(name);
        let set: Vec<&str> = settings(&no_aux).into_iter().chain(*layout).collect();
        let out = ok(&mpiexec_train(4, &job, &dir, &set));
        assert!(
            out.contains("buffers identical on every rank"),
            "{name}: the balancing bias is checked: {out}"
        );
        follows_single(name, &want, &loss_values(&dir));
        dirs.push(dir);
    }
    // Each rank of the first stage routes the whole batch of its data-parallel and cp share;
    // summed, the counts that move the bias are one process's.
    assert_eq!(counts(&single_dir), counts(&dirs[0]));
    // TP2 x FSDP2's checkpoint (expert slices sharded by rows, saved as global pieces) resumes
    // in one process on the single process's curve.
    let name = "tp2-fsdp2-as-single";
    let got = resumed_copy(&job, name, &dirs[0], (&[50], 40), 1, &settings(&no_aux));
    follows_after(name, &want, &got, 40);
}

#[test]
fn tensor_parallel_expert_layouts_not_supported_name_the_keys() {
    let job = Job::new("tp-moe-bad");
    let one_step = |extra: &[&'static str]| -> Vec<&'static str> {
        MOE.iter()
            .chain(&["training.micro_batch_size=2", "training.steps=1"])
            .chain(extra)
            .copied()
            .collect()
    };
    let launch = |name: &str, n: usize, extra: &[&'static str]| {
        mpiexec_train(n, &job, &job.dir.join(name), &one_step(extra))
    };
    // Each expert's width must split over tp.
    let out = launch(
        "width",
        2,
        &["parallelism.tp=2", "model.args.moe.expert_ffn_dim=15"],
    );
    user_error(&out, &["parallelism.tp", "moe.expert_ffn_dim"]);
}

#[test]
fn experts_split_by_tensor_and_expert_parallelism_follow_the_single_process_and_resume() {
    let job = Job::new("tp-ep-moe");
    // Ten steps, a checkpoint at 5: enough for the curve and the resumes.
    let short = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut s = settings(extra);
        s.extend([
            "training.steps=10",
            "metrics.eval_freq=5",
            "checkpoint.interval=5",
        ]);
        s
    };
    let (single, single_dir) = job.train("single", &short(&[]));
    ok(&single);
    let want = loss_values(&single_dir);
    let layout = [
        "parallelism.tp=2",
        "parallelism.dp_shard=2",
        "parallelism.ep=2",
    ];
    let dir = job.dir.join("tp2-ep2");
    let out = ok(&mpiexec_train(4, &job, &dir, &short(&layout)));
    for line in [
        "tp: rank 0 of 2",
        "in 2 slices of experts (this rank: slice 0)",
        "buffers identical on every rank",
    ] {
        assert!(out.contains(line), "{line}: {out}");
    }
    let got = loss_values(&dir);
    follows_single("MoE TP2 x EP2", &want, &got);
    let rel: Vec<f64> = want
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs() / a.abs())
        .collect();
    println!(
        "TP2 x EP2 against one process: step 1 {:.1e}, at most {:.1e} over {} steps",
        rel[0],
        rel.iter().cloned().fold(0.0, f64::max),
        rel.len()
    );
    // Each tp rank routes its data-parallel share whole: summed over dp_shard, the counts
    // that move the bias are one process's.
    assert_eq!(counts(&single_dir), counts(&dir));
    let a2a: Vec<u64> = rows(&dir)
        .iter()
        .filter_map(|r| r["ep_a2a_bytes"].as_u64())
        .collect();
    assert!(a2a.len() == 10 && a2a.iter().all(|&b| b > 0), "{a2a:?}");

    // Ranks are (dp_shard, tp) with tp fastest: shard s holds experts 2s..2s+2, and its two
    // tp ranks write one expert each, gathered full width (16) over tp.
    let m = manifest_of(&dir.join("checkpoints/step-5"));
    for (name, width_dim) in [
        ("model/layers.0.feed_forward.experts.w1", 1),
        ("model/layers.0.feed_forward.experts.w2", 2),
    ] {
        for rank in 0..4 {
            let file = format!("shard-{rank:05}-of-00004.safetensors");
            let p = piece(&m, name, &file).unwrap_or_else(|| panic!("{name} in {file}: {m}"));
            assert_eq!(p["slice"][0], serde_json::json!([rank, rank + 1]), "{p}");
            assert_eq!(p["slice"][width_dim], serde_json::json!([0, 16]), "{p}");
        }
    }

    // Resumed at step 5 in the same layout: the same bits; in one process: the single curve.
    let again = resumed_copy(&job, "tp2-ep2-again", &dir, (&[10], 5), 4, &short(&layout));
    assert_eq!(
        again.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        losses(&dir),
        "TP2 x EP2 resumes its checkpoint bit for bit"
    );
    let got = resumed_copy(&job, "tp2-ep2-as-single", &dir, (&[10], 5), 1, &short(&[]));
    follows_after("tp2-ep2-as-single", &want, &got, 5);
}

#[test]
fn experts_split_both_ways_compose_with_sequence_context_and_pipeline_parallelism() {
    // The balancing loss weighted 0 (under cp it is each rank's tokens'); the bias stays on.
    let job = Job::new("tp-ep-moe-composed");
    let short = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut s = settings(extra);
        s.extend([
            "training.steps=6",
            "metrics.eval_freq=0",
            "checkpoint.interval=0",
            "training.aux_loss_weights.load_balance=0.0",
        ]);
        s
    };
    let (single, single_dir) = job.train("single", &short(&[]));
    ok(&single);
    let want = loss_values(&single_dir);
    let tp_ep = [
        "parallelism.tp=2",
        "parallelism.dp_shard=2",
        "parallelism.ep=2",
    ];
    for (name, n, extra) in [
        ("tp2-sp-ep2", 4, "parallelism.tp_sequence=true"),
        ("cp2-tp2-ep2", 8, "parallelism.cp=2"),
        ("pp2-tp2-ep2", 8, "parallelism.pp=2"),
    ] {
        let dir = job.dir.join(name);
        let layout: Vec<&'static str> = tp_ep.iter().copied().chain([extra]).collect();
        let out = ok(&mpiexec_train(n, &job, &dir, &short(&layout)));
        for line in ["in 2 slices of experts", "buffers identical on every rank"] {
            assert!(out.contains(line), "{name}: {line}: {out}");
        }
        follows_single(name, &want, &loss_values(&dir));
    }
}
