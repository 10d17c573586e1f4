//! Pipeline × tensor × context parallelism on 8 real MPI ranks (one compute thread each,
//! oversubscribed) with the tiny Llama of 4 blocks: PP2 × TP2 × CP2 (rank `4 s + 2 c + t` runs
//! stage `s` with the tensor-parallel slices `t` on the sequences' chunks `c` and `3 − c`),
//! with and without sequence parallelism, follows the single process (step 1 within 1e-6,
//! every step and the validation loss within 1e-4) and reruns bitwise; its checkpoint, written
//! by the first cp coordinate's `pp × tp` ranks, resumes in one process and as CP2 × TP2 on the
//! single process's curve. With FSDP too (PP2 × TP2 × FSDP2 × CP2, 16 ranks) it follows the
//! single process and its checkpoint resumes in one process. Under sequence parallelism a cp
//! rank's part of the sequence must split over `tp`, or the layout is refused naming the keys.

mod dist_support;

use anneal_tests::cli as common;

use common::{losses, ok, rows, user_error, Job};
use dist_support::{
    assert_pieces, copy_run, follows_single, loss_values, manifest_of, mpiexec_train, rows_slice,
    train_one,
};
use std::path::Path;

/// Four micro-batches of one sequence of 32 tokens per step, 4 blocks (2 per stage).
const STEPS: [&str; 6] = [
    "training.micro_batch_size=1",
    "training.steps=10",
    "training.threads=1",
    "metrics.eval_freq=10",
    "checkpoint.interval=5",
    "model.args.n_layers=4",
];

const PP2_TP2_CP2: [&str; 3] = ["parallelism.pp=2", "parallelism.tp=2", "parallelism.cp=2"];

fn settings(extra: &[&'static str]) -> Vec<&'static str> {
    STEPS.iter().chain(extra).copied().collect()
}

fn val_loss(run_dir: &Path) -> f64 {
    let r = rows(run_dir);
    let v = r
        .iter()
        .filter_map(|r| r["val_loss"].as_f64())
        .collect::<Vec<_>>();
    assert_eq!(v.len(), 1, "one validation, at step 10: {r:?}");
    v[0]
}

/// Rank 0's ring bytes per step: its stage's 2 blocks × 4 micro-batches; each rank attends
/// with its one KV head of 16 (f32) over 16 of the 32 tokens: one forward pass of keys, values
/// and positions, two backward passes adding the keys' and values' gradients.
fn ring_theory() -> u64 {
    let (t, kv) = (16u64, 16u64);
    2 * 4 * ((2 * t * kv * 4 + t * 8) + 2 * (4 * t * kv * 4 + t * 8))
}

#[test]
fn pipeline_stages_run_tensor_and_context_parallel_and_reshard() {
    let job = Job::new("pp-tp-cp");
    let (single, single_dir) = job.train("single", &settings(&[]));
    ok(&single);
    let want = loss_values(&single_dir);
    let run = |name: &str, extra: &[&'static str]| {
        let dir = job.dir.join(name);
        let layout: Vec<&'static str> = PP2_TP2_CP2.iter().chain(extra).copied().collect();
        let out = ok(&mpiexec_train(8, &job, &dir, &settings(&layout)));
        for line in [
            "pipeline: 2 stage(s)",
            "tp: rank 0 of 2",
            "cp: rank 0 of 2 holds positions 0..8 and 24..32",
            // The cp ranks of a stage hold the same slices, bit for bit.
            "replicas identical",
        ] {
            assert!(out.contains(line), "{name}: {line}: {out}");
        }
        follows_single(name, &want, &loss_values(&dir));
        let (a, b) = (val_loss(&single_dir), val_loss(&dir));
        assert!((a - b).abs() / a < 1e-4, "{name}: val {b} vs {a}");
        for r in rows(&dir) {
            assert_eq!(
                r["cp_ring_bytes"].as_u64(),
                Some(ring_theory()),
                "{name}: {r}"
            );
            // 1F1B over 2 stages and 4 micro-batches: (p − 1) / (m + p − 1).
            assert_eq!(r["pp_bubble_theory"].as_f64(), Some(0.2), "{name}: {r}");
        }
        dir
    };
    let pp_tp_cp = run("pp2-tp2-cp2", &[]);
    run("pp2-tp2-cp2-sp", &["parallelism.tp_sequence=true"]);
    let again = run("pp2-tp2-cp2-again", &[]);
    assert_eq!(
        losses(&pp_tp_cp),
        losses(&again),
        "PP2 x TP2 x CP2 reruns bitwise"
    );
    pieces(&manifest_of(&pp_tp_cp.join("checkpoints/step-5")));

    // One process resumes the 8 ranks' checkpoint, and so do CP2 × TP2's 4 ranks.
    let to_one = job.dir.join("to-one");
    copy_run(&pp_tp_cp, &to_one, &[10]);
    let out = ok(&train_one(&job, &to_one, &settings(&[])));
    assert!(out.contains("step 5"), "resumes from step 5: {out}");
    follows_single("PP2 x TP2 x CP2 -> single", &want, &loss_values(&to_one));
    let to_cp_tp = job.dir.join("to-cp2-tp2");
    copy_run(&pp_tp_cp, &to_cp_tp, &[10]);
    let layout = settings(&["parallelism.cp=2", "parallelism.tp=2"]);
    let out = ok(&mpiexec_train(4, &job, &to_cp_tp, &layout));
    assert!(out.contains("step 5"), "resumes from step 5: {out}");
    follows_single(
        "PP2 x TP2 x CP2 -> CP2 x TP2",
        &want,
        &loss_values(&to_cp_tp),
    );
}

#[test]
fn pipeline_stages_run_tensor_parallel_beside_both_fsdp_and_context_parallelism() {
    // All four dims on 16 ranks: each stage's tp slices sharded over dp_shard x cp, its
    // sequences split over cp. It follows the single process, and its checkpoint (every
    // rank's global rows) resumes in one process on the single process's curve.
    let job = Job::new("pp-tp-fsdp-cp");
    let (single, single_dir) = job.train("single", &settings(&[]));
    ok(&single);
    let want = loss_values(&single_dir);
    let dir = job.dir.join("pp2-tp2-fsdp2-cp2");
    let layout: Vec<&'static str> = PP2_TP2_CP2
        .iter()
        .chain(&["parallelism.dp_shard=2"])
        .copied()
        .collect();
    let out = ok(&mpiexec_train(16, &job, &dir, &settings(&layout)));
    for line in ["pipeline: 2 stage(s)", "tp: rank 0 of 2", "cp: rank 0 of 2"] {
        assert!(out.contains(line), "{line}: {out}");
    }
    follows_single("PP2 x TP2 x FSDP2 x CP2", &want, &loss_values(&dir));
    let to_one = job.dir.join("to-one");
    copy_run(&dir, &to_one, &[10]);
    let out = ok(&train_one(&job, &to_one, &settings(&[])));
    assert!(out.contains("step 5"), "resumes from step 5: {out}");
    follows_single(
        "PP2 x TP2 x FSDP2 x CP2 -> single",
        &want,
        &loss_values(&to_one),
    );
}

/// The first cp coordinate's ranks `4 s + t` write the checkpoint as shard `2 s + t`: stage
/// `s`'s rows of its column- and vocab-split slices, and on the first tp rank the row-split
/// tensors whole and the replicated ones; the second cp coordinate's copies are not written.
fn pieces(m: &serde_json::Value) {
    let rows = rows_slice;
    assert_pieces(
        m,
        4,
        &[
            ("model/tok_embeddings.weight", 1, rows(160, 320, 32)),
            ("model/layers.0.attention.wk.weight", 1, rows(16, 32, 32)),
            ("model/layers.1.attention.wo.weight", 0, rows(0, 32, 32)),
            ("model/layers.2.feed_forward.w1.weight", 3, rows(32, 64, 32)),
            ("model/layers.3.feed_forward.w2.weight", 2, rows(0, 32, 64)),
            ("model/output.weight", 3, rows(160, 320, 32)),
            ("model/norm.weight", 2, serde_json::json!([[0, 32]])),
        ],
        &[
            ("model/layers.0.attention.wk.weight", 3),
            ("model/layers.1.attention.wo.weight", 1),
            ("model/norm.weight", 3),
        ],
    );
}

/// Sequence parallelism splits a cp rank's part of each sequence: 20 tokens cut into 4 chunks
/// for cp = 2, but a rank's 10 do not split over tp = 4 (refused before any model is built).
#[test]
fn sequence_parallel_parts_that_do_not_split_are_user_errors() {
    let job = Job::new("pp-tp-cp-errors");
    let out = mpiexec_train(
        8,
        &job,
        &job.dir.join("sp"),
        &settings(&[
            "parallelism.pp=1",
            "parallelism.cp=2",
            "parallelism.tp=4",
            "parallelism.tp_sequence=true",
            "training.seq_len=20",
        ]),
    );
    user_error(
        &out,
        &[
            "parallelism.tp_sequence",
            "training.seq_len",
            "parallelism.cp",
            "parallelism.tp",
        ],
    );
}
