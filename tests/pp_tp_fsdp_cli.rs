//! Pipeline × tensor parallelism × FSDP on 8 real MPI ranks (one compute thread each, on 2
//! cores) with the tiny Llama of 4 blocks: rank `4 s + 2 d + t` runs stage `s` with the
//! tensor-parallel slices `t`, holding shard `d` of them (FSDP applied last, over the stage's
//! `dp_shard` ranks). With and without sequence parallelism the curve follows the single
//! process (step 1 within 1e-6, every step and the validation losses within 1e-4);
//! every rank writes global pieces of its stage, so one process and TP2 × FSDP2 resume the
//! checkpoint on the single curve, and the same layout resumes it bit for bit.

mod dist_support;

use anneal_tests::cli as common;

use common::{losses, ok, rows, user_error, Job};
use dist_support::{
    assert_pieces, follows_single, loss_values, manifest_of, mpiexec_train, resumed_copy,
    rows_slice,
};
use std::path::{Path, PathBuf};

/// Four micro-batches of one sequence per step (two per `dp_shard` rank), 4 blocks (2 per
/// stage), a checkpoint at step 5.
const STEPS: [&str; 7] = [
    "training.micro_batch_size=1",
    "training.steps=10",
    "training.threads=1",
    "metrics.eval_freq=5",
    "checkpoint.interval=5",
    "checkpoint.keep_latest=2",
    "model.args.n_layers=4",
];

const PP2_TP2_FSDP2: [&str; 3] = [
    "parallelism.pp=2",
    "parallelism.tp=2",
    "parallelism.dp_shard=2",
];

fn settings(extra: &[&'static str]) -> Vec<&'static str> {
    STEPS.iter().chain(extra).copied().collect()
}

/// Resumes `from`'s step-5 checkpoint (its step-10 one dropped) in `layout` on `n` ranks,
/// checks the whole curve against the single process's `want` and returns the run dir.
fn resume_as(
    job: &Job,
    name: &str,
    from: &Path,
    n: usize,
    layout: &[&'static str],
    want: &[f64],
) -> PathBuf {
    let got = resumed_copy(job, name, from, (&[10], 5), n, &settings(layout));
    follows_single(name, want, &got);
    job.dir.join(name)
}

#[test]
fn tensor_parallel_stages_shard_over_dp_shard_on_the_single_curve_and_reshard() {
    let job = Job::new("pp-tp-fsdp");
    let (single, single_dir) = job.train("single", &settings(&[]));
    ok(&single);
    let want = loss_values(&single_dir);
    let run = |name: &str, layout: &[&'static str]| {
        let dir = job.dir.join(name);
        let out = ok(&mpiexec_train(8, &job, &dir, &settings(layout)));
        for line in [
            "tp: rank 0 of 2",
            "pipeline: 2 stage(s)",
            "stage parameters sharded over 2 rank(s)",
        ] {
            assert!(out.contains(line), "{name}: {line}: {out}");
        }
        // Every rank evaluates through the gathered tensor-parallel stages.
        assert!(!val_losses(&dir).is_empty(), "{name}: validation");
        dir
    };
    let sharded = run("pp2-tp2-fsdp2", &PP2_TP2_FSDP2);
    follows_single("PP2 x TP2 x FSDP2", &want, &loss_values(&sharded));
    let (one, staged) = (val_losses(&single_dir), val_losses(&sharded));
    assert_eq!(one.len(), staged.len(), "validation rows");
    for (a, b) in one.iter().zip(&staged) {
        assert!((a - b).abs() / a < 1e-4, "val loss {b} vs {a}");
    }
    let mut sp = PP2_TP2_FSDP2.to_vec();
    sp.push("parallelism.tp_sequence=true");
    let sharded_sp = run("pp2-tp2-fsdp2-sp", &sp);
    follows_single(
        "PP2 x TP2 x FSDP2 with SP",
        &want,
        &loss_values(&sharded_sp),
    );
    pieces(&manifest_of(&sharded.join("checkpoints/step-5")));

    // The 8 pieces resume in one process, in TP2 x FSDP2, and in the same layout bit for bit.
    resume_as(&job, "as-single", &sharded, 1, &[], &want);
    let tp2_fsdp2 = ["parallelism.tp=2", "parallelism.dp_shard=2"];
    resume_as(&job, "as-tp2-fsdp2", &sharded, 4, &tp2_fsdp2, &want);
    let again = resume_as(&job, "as-itself", &sharded, 8, &PP2_TP2_FSDP2, &want);
    assert_eq!(losses(&again), losses(&sharded), "resumes bit for bit");

    // Pipeline stages gather their shards in float32.
    let out = mpiexec_train(
        8,
        &job,
        &job.dir.join("int8"),
        &settings(&[
            "parallelism.pp=2",
            "parallelism.tp=2",
            "parallelism.dp_shard=2",
            "parallelism.fsdp_all_gather_dtype=\"int8\"",
        ]),
    );
    user_error(
        &out,
        &["parallelism.fsdp_all_gather_dtype", "parallelism.pp"],
    );
}

/// The logged validation losses.
fn val_losses(run_dir: &Path) -> Vec<f64> {
    rows(run_dir)
        .iter()
        .filter_map(|r| r["val_loss"].as_f64())
        .collect()
}

/// Rank `4 s + 2 d + t` writes stage `s`'s global rows: shard `d` of its column / vocab slice
/// `t`; of a row-split tensor, shard `d`'s rows gathered full width over tp, half of them per
/// tp rank; a replicated tensor's shard rows from the first tp rank only.
fn pieces(m: &serde_json::Value) {
    let rows = rows_slice;
    assert_pieces(
        m,
        8,
        &[
            ("model/tok_embeddings.weight", 0, rows(0, 80, 32)),
            ("model/tok_embeddings.weight", 2, rows(80, 160, 32)),
            ("model/tok_embeddings.weight", 1, rows(160, 240, 32)),
            ("model/layers.0.attention.wq.weight", 1, rows(16, 24, 32)),
            ("model/layers.0.attention.wq.weight", 3, rows(24, 32, 32)),
            ("model/layers.1.attention.wo.weight", 1, rows(8, 16, 32)),
            ("model/layers.1.attention.wo.weight", 2, rows(16, 24, 32)),
            ("model/layers.3.attention.wq.weight", 7, rows(24, 32, 32)),
            ("model/layers.3.feed_forward.w2.weight", 6, rows(16, 24, 64)),
            ("model/output.weight", 7, rows(240, 320, 32)),
            ("model/norm.weight", 6, serde_json::json!([[16, 32]])),
        ],
        &[
            // Another stage's parameters, and a replicated one on the second tp rank.
            ("model/layers.0.attention.wq.weight", 5),
            ("model/layers.3.attention.wq.weight", 3),
            ("model/norm.weight", 7),
        ],
    );
}
