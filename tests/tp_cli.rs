//! Tensor (and sequence) parallelism on real MPI ranks (one compute thread each) with the tiny
//! Llama: each rank holds its slices of the column-, row- and vocab-split projections (one of the
//! two heads, half the feed-forward, half the vocabulary), the linears' inputs and outputs are
//! combined over the group and the loss never gathers the logits. TP2, TP2 with sequence
//! parallelism, TP2 × DDP2 and TP2 × FSDP2 (FSDP over each rank's slices) follow the single
//! process (step 1 within 1e-6, 50 steps within 1e-4) and rerun bitwise; their checkpoints hold
//! global pieces, so a single process and other layouts resume them (TP2 × FSDP2 → FSDP4 →
//! single), and TP2 and TP2 × FSDP2 resume a single process's. Full recompute under TP (with
//! SP, and with SP × FSDP2) follows too; quantized FSDP gathers run under TP.
//! Layouts that do not divide the model are one line naming the keys, exit 2.

mod dist_support;

use anneal_tests::cli as common;

use common::{losses, ok, rows, user_error, Job};
use dist_support::{
    copy_run, follows_after, follows_single, loss_values, manifest_of, mpiexec_train, piece,
    resumed_copy,
};
use std::path::Path;

/// Four micro-batches of one sequence: all four on each rank of a TP group, two per replica
/// under TP2 × DDP2.
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
const TP2_FSDP2: [&str; 2] = ["parallelism.tp=2", "parallelism.dp_shard=2"];

fn settings(extra: &[&'static str]) -> Vec<&'static str> {
    STEPS.iter().chain(extra).copied().collect()
}

/// Resumes `from`'s step-40 checkpoint (its step-50 one dropped) in `layout` on `n` ranks and
/// checks steps 41..=50 against the single process's `want`.
fn resume_as(job: &Job, name: &str, from: &Path, n: usize, layout: &[&'static str], want: &[f64]) {
    let got = resumed_copy(job, name, from, (&[50], 40), n, &settings(layout));
    follows_after(name, want, &got, 40);
}

#[test]
fn tensor_parallel_runs_follow_the_single_process_and_reshard() {
    let job = Job::new("tp");
    let (single, single_dir) = job.train("single", &settings(&[]));
    ok(&single);
    let want = loss_values(&single_dir);

    let run = |name: &str, n: usize, layout: &[&'static str]| {
        let dir = job.dir.join(name);
        let out = ok(&mpiexec_train(n, &job, &dir, &settings(layout)));
        assert!(out.contains("tp: rank 0 of 2"), "{name}: {out}");
        dir
    };
    let tp2 = run("tp2", 2, &TP2);
    let tp2_again = run("tp2-again", 2, &TP2);
    let tp2_sp = run("tp2-sp", 2, &TP2_SP);
    let tp2_dp2 = run(
        "tp2-dp2",
        4,
        &["parallelism.tp=2", "parallelism.dp_replicate=2"],
    );
    follows_single("TP2", &want, &loss_values(&tp2));
    follows_single("TP2 with SP", &want, &loss_values(&tp2_sp));
    follows_single("TP2 x DDP2", &want, &loss_values(&tp2_dp2));
    assert_eq!(losses(&tp2), losses(&tp2_again), "TP2 reruns bitwise");
    let tp2_fsdp2 = run("tp2-fsdp2", 4, &TP2_FSDP2);
    let tp2_fsdp2_again = run("tp2-fsdp2-again", 4, &TP2_FSDP2);
    follows_single("TP2 x FSDP2", &want, &loss_values(&tp2_fsdp2));
    assert_eq!(
        losses(&tp2_fsdp2),
        losses(&tp2_fsdp2_again),
        "TP2 x FSDP2 reruns bitwise"
    );

    // Column splits are rows of the whole: rank 1 holds the second head's query rows; a
    // row-split weight is saved whole by the group's first rank.
    let m = manifest_of(&tp2.join("checkpoints/step-40"));
    let wq = "model/layers.0.attention.wq.weight";
    let p = piece(&m, wq, "shard-00001-of-00002.safetensors")
        .unwrap_or_else(|| panic!("{wq} in shard 1: {m}"));
    assert_eq!(p["slice"][0], serde_json::json!([16, 32]), "{p}");
    let wo = "model/layers.0.attention.wo.weight";
    let p = piece(&m, wo, "shard-00000-of-00002.safetensors")
        .unwrap_or_else(|| panic!("{wo} in shard 0: {m}"));
    assert_eq!(p["slice"][1], serde_json::json!([0, 32]), "{p}");
    let emb = "model/tok_embeddings.weight";
    let p = piece(&m, emb, "shard-00001-of-00002.safetensors")
        .unwrap_or_else(|| panic!("{emb} in shard 1: {m}"));
    assert_eq!(p["slice"][0], serde_json::json!([160, 320]), "{p}");

    tp2_fsdp2_pieces(&manifest_of(&tp2_fsdp2.join("checkpoints/step-40")));

    // Any layout resumes any other's checkpoint, on the single process's curve.
    resume_as(&job, "tp2-as-single", &tp2, 1, &[], &want);
    resume_as(&job, "tp2-as-tp2-sp", &tp2, 2, &TP2_SP, &want);
    resume_as(&job, "tp2-sp-as-dp2", &tp2_sp, 2, &[], &want);
    resume_as(&job, "single-as-tp2", &single_dir, 2, &TP2, &want);
    resume_as(
        &job,
        "single-as-tp2-fsdp2",
        &single_dir,
        4,
        &TP2_FSDP2,
        &want,
    );
    // TP2 x FSDP2 at step 40 -> FSDP4 (saving step 45) -> one process, steps 46..=50.
    let fsdp4 = &["parallelism.dp_shard=4", "checkpoint.interval=5"];
    resume_as(&job, "tp2-fsdp2-as-fsdp4", &tp2_fsdp2, 4, fsdp4, &want);
    let one = job.dir.join("fsdp4-as-single");
    copy_run(&job.dir.join("tp2-fsdp2-as-fsdp4"), &one, &[50]);
    let (out, _) = job.train("fsdp4-as-single", &settings(&[]));
    assert!(ok(&out).contains("(step 45)"), "resumed at 45");
    let got = loss_values(&one);
    assert_eq!(got.len(), 50, "45 + 5 rows");
    follows_single("TP2 x FSDP2 -> FSDP4 -> single", &want, &got);
}

/// Rank `2 s + t` of TP2 × FSDP2 holds shard `s` of its tensor-parallel slices (`t`), and
/// writes global rows of the whole: of a column-split weight, rows of its slice; of a
/// row-split one, full-width rows (its share of its shard's rows, gathered over tp); of a
/// replicated one, its shard's rows on the first tp rank only.
fn tp2_fsdp2_pieces(m: &serde_json::Value) {
    assert_eq!(m["world_size"], 4, "{m}");
    let rows_of = |name: &str, shard: usize| -> Option<serde_json::Value> {
        let p = piece(m, name, &format!("shard-{shard:05}-of-00004.safetensors"))?;
        Some(p["slice"].clone())
    };
    let wq = "model/layers.0.attention.wq.weight";
    let wo = "model/layers.0.attention.wo.weight";
    let norm = "model/layers.0.attention_norm.weight";
    for (rank, wq_rows, wo_rows) in [
        (0, [0, 8], [0, 8]),
        (1, [16, 24], [8, 16]),
        (2, [8, 16], [16, 24]),
        (3, [24, 32], [24, 32]),
    ] {
        let slice = serde_json::json!([wq_rows, [0, 32]]);
        assert_eq!(rows_of(wq, rank), Some(slice), "{wq} on rank {rank}");
        let slice = serde_json::json!([wo_rows, [0, 32]]);
        assert_eq!(rows_of(wo, rank), Some(slice), "{wo} on rank {rank}");
    }
    assert_eq!(rows_of(norm, 0), Some(serde_json::json!([[0, 16]])));
    assert_eq!(rows_of(norm, 2), Some(serde_json::json!([[16, 32]])));
    assert_eq!(
        rows_of(norm, 1),
        None,
        "{norm}: the first tp rank writes it"
    );
}

#[test]
fn tensor_parallelism_composes_with_recompute() {
    let job = Job::new("tp-recompute");
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
            "tp2-full-recompute",
            2,
            &["parallelism.tp=2", "activation_checkpoint.mode=\"full\""][..],
        ),
        (
            "tp2-sp-full-recompute",
            2,
            &[
                "parallelism.tp=2",
                "parallelism.tp_sequence=true",
                "activation_checkpoint.mode=\"full\"",
            ][..],
        ),
        // The norms' partial gradients under SP are summed over tp on the FSDP shards.
        (
            "tp2-sp-fsdp2-full-recompute",
            4,
            &[
                "parallelism.tp=2",
                "parallelism.tp_sequence=true",
                "parallelism.dp_shard=2",
                "activation_checkpoint.mode=\"full\"",
            ][..],
        ),
    ] {
        let dir = job.dir.join(name);
        ok(&mpiexec_train(n, &job, &dir, &short(layout)));
        follows_single(name, &want, &loss_values(&dir));
    }
}

/// Quantized parameter gathers run on the tensor-parallel slices: int8 sends at most 30% of the
/// exact gather's bytes and stays on the single process's curve (within 1e-2).
#[test]
fn quantized_fsdp_gathers_run_under_tensor_parallelism() {
    let job = Job::new("tp-fsdp-int8");
    let short = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut s = settings(extra);
        s.extend(["training.steps=10", "checkpoint.interval=0"]);
        s
    };
    let (single, single_dir) = job.train("single", &short(&[]));
    ok(&single);
    let want = loss_values(&single_dir);
    let run = |name: &str, dtype: &'static str| {
        let dir = job.dir.join(name);
        let mut layout = TP2_FSDP2.to_vec();
        layout.push(dtype);
        ok(&mpiexec_train(4, &job, &dir, &short(&layout)));
        dir
    };
    let exact = run("f32", "parallelism.fsdp_all_gather_dtype=\"float32\"");
    let int8 = run("int8", "parallelism.fsdp_all_gather_dtype=\"int8\"");
    let gathered = |d: &Path| -> u64 {
        let r = rows(d);
        r[0]["fsdp_gather_bytes"]
            .as_u64()
            .expect("fsdp_gather_bytes")
    };
    let (f, q) = (gathered(&exact), gathered(&int8));
    assert!(q * 10 <= f * 3, "int8 {q} vs f32 {f} bytes");
    for (step, (a, b)) in want.iter().zip(&loss_values(&int8)).enumerate() {
        assert!(
            (a - b).abs() / a < 1e-2,
            "int8 step {}: {b} vs {a}",
            step + 1
        );
    }
}

#[test]
fn bad_tensor_parallel_layouts_name_the_keys() {
    let job = Job::new("tp-bad");
    let one_step = |extra: &[&'static str]| -> Vec<&'static str> {
        ["training.micro_batch_size=2", "training.steps=1"]
            .iter()
            .chain(extra)
            .copied()
            .collect()
    };
    let tp2 = |name: &str, extra: &[&'static str]| {
        let mut s = one_step(&TP2);
        s.extend(extra);
        mpiexec_train(2, &job, &job.dir.join(name), &s)
    };
    // Heads, key/value heads and the vocabulary must split over tp.
    let out = mpiexec_train(
        3,
        &job,
        &job.dir.join("three"),
        &one_step(&["parallelism.tp=3"]),
    );
    user_error(&out, &["parallelism.tp", "model.args.n_heads"]);
    let out = tp2("kv", &["model.args.n_kv_heads=1"]);
    user_error(&out, &["parallelism.tp", "model.args.n_kv_heads"]);
    let out = tp2("vocab", &["model.args.vocab_size=321"]);
    user_error(
        &out,
        &["parallelism.tp", "tok_embeddings.weight", "vocab_size"],
    );
    // Sequence parallelism splits the sequence; it needs tp.
    let out = tp2(
        "seq",
        &["parallelism.tp_sequence=true", "training.seq_len=31"],
    );
    user_error(&out, &["parallelism.tp_sequence", "training.seq_len"]);
    let (out, _) = job.train("sp-alone", &one_step(&["parallelism.tp_sequence=true"]));
    user_error(&out, &["parallelism.tp_sequence", "parallelism.tp"]);
    // What does not run under tp yet: Muon (experts: tests/tp_moe_cli.rs).
    let out = tp2("muon", &["optimizer.plugin=\"muon\""]);
    user_error(&out, &["parallelism.tp", "optimizer.plugin"]);
    // A model whose spec does not declare tensor-parallel support (the llama plugin's Mixtral
    // flavors): the plugin says so, not a list of family names in the host.
    let out = tp2("mixtral", &["model.flavor=\"debugmodel_mixtral\""]);
    user_error(
        &out,
        &["parallelism.tp", "mixtral", "tensor-parallel support"],
    );
}

/// Qwen3's q/k norms are shared by the heads and applied to each apart: every rank applies them
/// to its heads, so their gradients are partial and the host sums them over the group (with
/// and without sequence parallelism, where the other norms' are partial too).
#[test]
fn tensor_parallel_qwen3_sums_its_per_head_norms_gradients() {
    let job = Job::new("tp-qwen3");
    let qwen3 = [
        "model.flavor=\"debugmodel_qwen3\"",
        "model.args.n_kv_heads=2",
    ];
    let (single, single_dir) = job.train("single", &settings(&qwen3));
    ok(&single);
    let want = loss_values(&single_dir);
    for (name, layout) in [("tp2", &TP2[..]), ("tp2-sp", &TP2_SP[..])] {
        let dir = job.dir.join(name);
        let s: Vec<&'static str> = settings(&qwen3)
            .into_iter()
            .chain(layout.iter().copied())
            .collect();
        ok(&mpiexec_train(2, &job, &dir, &s));
        follows_single(&format!("Qwen3 {name}"), &want, &loss_values(&dir));
    }
}
