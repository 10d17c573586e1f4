//! Pipeline × tensor parallelism on real MPI ranks (one compute thread each, 4 ranks on 2
//! cores) with the tiny Llama of 4 blocks: PP2 × TP2 (rank `2 s + t` runs stage `s` with the
//! tensor-parallel slices `t`), with sequence parallelism and with the interleaved schedule,
//! follows the single process (step 1 within 1e-6, 50 steps within 1e-4) and reruns bitwise;
//! so does PP2 × TP2 × DDP2 on 8 ranks (10 steps).
//! Every stage's tp ranks write global pieces of their stage's parameters, so one process
//! resumes PP2 × TP2's checkpoint on the single curve and PP2 × TP2 resumes a single
//! process's.

mod dist_support;

use anneal_tests::cli as common;

use common::{losses, ok, rows, Job};
use dist_support::{
    assert_pieces, follows_single, loss_values, manifest_of, mpiexec_train, resumed_copy,
    rows_slice,
};
use std::path::Path;

/// Four micro-batches of one sequence per step, 4 blocks (2 per stage, or 1 per virtual stage).
const STEPS: [&str; 7] = [
    "training.micro_batch_size=1",
    "training.steps=50",
    "training.threads=1",
    "metrics.eval_freq=25",
    "checkpoint.interval=40",
    "checkpoint.keep_latest=2",
    "model.args.n_layers=4",
];

const PP2_TP2: [&str; 2] = ["parallelism.pp=2", "parallelism.tp=2"];
const PP2_TP2_SP: [&str; 3] = [
    "parallelism.pp=2",
    "parallelism.tp=2",
    "parallelism.tp_sequence=true",
];

fn settings(extra: &[&'static str]) -> Vec<&'static str> {
    STEPS.iter().chain(extra).copied().collect()
}

/// Resumes `from`'s step-40 checkpoint (its step-50 one dropped) in `layout` on `n` ranks and
/// checks steps 41..=50 against the single process's `want`.
fn resume_as(job: &Job, name: &str, from: &Path, n: usize, layout: &[&'static str], want: &[f64]) {
    let got = resumed_copy(job, name, from, (&[50], 40), n, &settings(layout));
    follows_single(name, want, &got);
}

#[test]
fn pipeline_stages_run_tensor_parallel_on_the_single_curve_and_reshard() {
    let job = Job::new("pp-tp");
    let (single, single_dir) = job.train("single", &settings(&[]));
    ok(&single);
    let want = loss_values(&single_dir);
    let run = |name: &str, layout: &[&'static str]| {
        let dir = job.dir.join(name);
        let out = ok(&mpiexec_train(4, &job, &dir, &settings(layout)));
        assert!(out.contains("tp: rank 0 of 2"), "{name}: {out}");
        assert!(out.contains("pipeline: 2 stage(s)"), "{name}: {out}");
        dir
    };
    let pp_tp = run("pp2-tp2", &PP2_TP2);
    let pp_tp_again = run("pp2-tp2-again", &PP2_TP2);
    let pp_tp_sp = run("pp2-tp2-sp", &PP2_TP2_SP);
    follows_single("PP2 x TP2", &want, &loss_values(&pp_tp));
    follows_single("PP2 x TP2 with SP", &want, &loss_values(&pp_tp_sp));
    assert_eq!(
        losses(&pp_tp),
        losses(&pp_tp_again),
        "PP2 x TP2 reruns bitwise"
    );
    for dir in [&pp_tp, &pp_tp_sp] {
        let r = rows(dir);
        // Every rank evaluates through the stages (tensor-parallel there too).
        assert!(r.iter().any(|r| r["val_loss"].is_number()), "{r:?}");
        assert!(r[0]["pp_bubble"].is_number(), "{:?}", r[0]);
    }
    pieces(&manifest_of(&pp_tp.join("checkpoints/step-40")));

    // One process resumes the pipeline's tensor-parallel checkpoint, and the other way round.
    resume_as(&job, "pp2-tp2-as-single", &pp_tp, 1, &[], &want);
    resume_as(&job, "single-as-pp2-tp2", &single_dir, 4, &PP2_TP2, &want);
}

/// Interleaved 1F1B (two virtual stages of one block per rank) under TP2.
#[test]
fn interleaved_pipeline_stages_run_tensor_parallel() {
    let job = Job::new("pp-tp-interleaved");
    let short = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut s = settings(extra);
        s.extend(["training.steps=20", "checkpoint.interval=0"]);
        s
    };
    let (single, single_dir) = job.train("single", &short(&[]));
    ok(&single);
    let want = loss_values(&single_dir);
    let dir = job.dir.join("pp2-tp2-interleaved");
    let layout = [
        "parallelism.pp=2",
        "parallelism.tp=2",
        "parallelism.pp_schedule=interleaved_1f1b",
        "parallelism.pp_virtual_stages=2",
    ];
    let out = ok(&mpiexec_train(4, &job, &dir, &short(&layout)));
    assert!(out.contains("pipeline: 4 stage(s)"), "{out}");
    follows_single("PP2 x TP2 interleaved", &want, &loss_values(&dir));
}

/// Rank `2 s + t` of PP2 × TP2 writes stage `s`'s global pieces: rows of its column- and
/// vocab-split slices; on the first tp rank the row-split tensors whole and the replicated ones.
fn pieces(m: &serde_json::Value) {
    let rows = rows_slice;
    assert_pieces(
        m,
        4,
        &[
            ("model/tok_embeddings.weight", 0, rows(0, 160, 32)),
            ("model/tok_embeddings.weight", 1, rows(160, 320, 32)),
            ("model/layers.0.attention.wq.weight", 1, rows(16, 32, 32)),
            ("model/layers.1.attention.wo.weight", 0, rows(0, 32, 32)),
            ("model/layers.3.attention.wq.weight", 3, rows(16, 32, 32)),
            ("model/layers.3.feed_forward.w2.weight", 2, rows(0, 32, 64)),
            ("model/output.weight", 3, rows(160, 320, 32)),
            ("model/norm.weight", 2, serde_json::json!([[0, 32]])),
        ],
        &[
            // Another stage's parameters, and what the first tp rank writes.
            ("model/layers.0.attention.wq.weight", 2),
            ("model/layers.3.attention.wq.weight", 1),
            ("model/layers.1.attention.wo.weight", 1),
            ("model/norm.weight", 3),
        ],
    );
}

/// Replicas of the whole PP2 × TP2 pipeline (8 ranks): the batch splits over `dp_replicate`,
/// the gradients are summed over it, and the curve stays the single process's.
#[test]
fn replicated_pipelines_of_tensor_parallel_stages_follow_the_single_process() {
    let job = Job::new("pp-tp-dp");
    let short = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut s = settings(extra);
        s.extend(["training.steps=10", "checkpoint.interval=0"]);
        s
    };
    let (single, single_dir) = job.train("single", &short(&[]));
    ok(&single);
    let want = loss_values(&single_dir);
    let dir = job.dir.join("pp2-tp2-dp2");
    let layout = [
        "parallelism.pp=2",
        "parallelism.tp=2",
        "parallelism.dp_replicate=2",
    ];
    ok(&mpiexec_train(8, &job, &dir, &short(&layout)));
    follows_single("PP2 x TP2 x DDP2", &want, &loss_values(&dir));
}
