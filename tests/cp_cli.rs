//! Context-parallel `anneal train` on real MPI ranks (one compute thread each): CP(2), CP(2)
//! with every block recomputed, CP(2) × FSDP(2) and CP(2) × DDP(2) (through `--nproc 4`) match
//! the single process (step 1 within 1e-6 relative, the 50-step curve within 1e-4, the
//! validation losses too), a rerun is bitwise identical, and the ring's traffic is logged
//! (`cp_ring_bytes`) equal to its formula; a mixture-of-experts model trains under CP(2) with
//! its router statistics summed over the ranks; CP(2) × TP(2), with and without sequence
//! parallelism, matches too and its checkpoint resumes in one process; CP(2) × FSDP(2)
//! checkpoints reshard to one process and back; layouts context parallelism cannot run are one-line errors with exit
//! code 2, naming the keys.

mod dist_support;

use anneal_tests::cli as common;

use common::{anneal, losses, ok, rows, user_error, Job};
use dist_support::{copy_run, loss_values, manifest_of, mpiexec_train, train_one};
use std::path::Path;

/// Four micro-batches of one sequence of 32 tokens per step, one thread per rank.
const LAYOUT: [&str; 4] = [
    "training.micro_batch_size=1",
    "training.steps=50",
    "training.threads=1",
    "metrics.eval_freq=25",
];

fn with(extra: &[&'static str]) -> Vec<&'static str> {
    LAYOUT.iter().chain(extra).copied().collect()
}

/// Step 1 within 1e-6 relative, every step within `tol` relative.
fn assert_matches(one: &[f64], other: &[f64], tol: f64, what: &str) {
    assert_eq!(one.len(), other.len(), "{what}: steps");
    let rel = |a: f64, b: f64| (a - b).abs() / a.abs();
    assert!(
        rel(one[0], other[0]) < 1e-6,
        "{what}: step 1: {} vs {}",
        one[0],
        other[0]
    );
    for (step, (a, b)) in one.iter().zip(other).enumerate() {
        assert!(
            rel(*a, *b) < tol,
            "{what}: step {}: {a} vs {b} (rel {:e})",
            step + 1,
            rel(*a, *b)
        );
    }
}

fn val_losses(run_dir: &Path) -> Vec<f64> {
    rows(run_dir)
        .iter()
        .filter_map(|r| r["val_loss"].as_f64())
        .collect()
}

/// The ring's bytes per step on one rank of the tiny Llama (2 blocks, 2 KV heads of 16, f32):
/// per block and micro-batch, `cp − 1` forward passes of keys, values and their positions
/// (each `T/cp` rows), again when the block is recomputed, and `cp` backward passes that add
/// the keys' and values' f32 gradients.
fn ring_theory(cp: u64, micro_per_rank: u64, recompute: bool) -> u64 {
    ring_theory_heads(cp, micro_per_rank, recompute, 2)
}

/// [`ring_theory`] with `kv_heads` key/value heads on each rank (fewer under tensor
/// parallelism, which splits the heads).
fn ring_theory_heads(cp: u64, micro_per_rank: u64, recompute: bool, kv_heads: u64) -> u64 {
    let (blocks, kv, t) = (2, kv_heads * 16, 32 / cp);
    let fwd = (cp - 1) * (2 * t * kv * 4 + t * 8);
    let bwd = cp * (4 * t * kv * 4 + t * 8);
    let per_block = fwd * if recompute { 2 } else { 1 } + bwd;
    blocks * micro_per_rank * per_block
}

fn ring_bytes(run_dir: &Path) -> Vec<u64> {
    rows(run_dir)
        .iter()
        .filter_map(|r| r["cp_ring_bytes"].as_u64())
        .collect()
}

#[test]
fn context_parallel_layouts_match_the_single_process_and_rerun_bitwise() {
    let job = Job::new("cp");
    let (single, single_dir) = job.train("single", &LAYOUT);
    ok(&single);
    let one = loss_values(&single_dir);
    assert_eq!(one.len(), 50);
    // (name, ranks, settings, micro-batches per rank, recompute)
    let layouts: [(&str, usize, Vec<&str>, u64, bool); 3] = [
        ("cp2", 2, with(&["parallelism.cp=2"]), 4, false),
        (
            "cp2-recompute",
            2,
            with(&["parallelism.cp=2", "activation_checkpoint.mode=full"]),
            4,
            true,
        ),
        (
            "cp2xfsdp2",
            4,
            with(&["parallelism.cp=2", "parallelism.dp_shard=2"]),
            2,
            false,
        ),
    ];
    for (name, n, set, micro, recompute) in &layouts {
        let dir = job.dir.join(name);
        let stdout = ok(&mpiexec_train(*n, &job, &dir, set));
        assert!(
            stdout.contains("cp: rank 0 of 2 holds positions 0..8 and 24..32"),
            "{stdout}"
        );
        assert_matches(&one, &loss_values(&dir), 1e-4, name);
        let (a, b) = (val_losses(&single_dir), val_losses(&dir));
        assert_eq!(a.len(), b.len(), "{name}: validation losses");
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() / x < 1e-4, "{name}: val {x} vs {y}");
        }
        let theory = ring_theory(2, *micro, *recompute);
        let measured = ring_bytes(&dir);
        assert_eq!(measured.len(), 50, "{name}: cp_ring_bytes on every row");
        assert!(
            measured.iter().all(|&m| m == theory),
            "{name}: ring bytes {:?} vs theory {theory}",
            &measured[..3]
        );
        eprintln!("{name}: ring {theory} bytes per step per rank, measured the same");
    }
    // The same layout twice is bitwise identical.
    let again = job.dir.join("cp2-again");
    ok(&mpiexec_train(2, &job, &again, &layouts[0].2));
    assert_eq!(losses(&job.dir.join("cp2")), losses(&again), "CP(2) twice");

    // CP(2) × DDP(2) through `anneal train --nproc 4`.
    let ddp = job.dir.join("cp2xddp2");
    let mut c = anneal();
    c.args(["train", "--nproc", "4"])
        .arg(job.config())
        .arg("--run-dir")
        .arg(&ddp);
    for s in with(&["parallelism.cp=2", "parallelism.dp_replicate=2"]) {
        c.args(["--set", s]);
    }
    let stdout = ok(&c.output().unwrap());
    assert!(stdout.contains("rank 0 of 4"), "{stdout}");
    assert_matches(&one, &loss_values(&ddp), 1e-4, "cp2xddp2");
    assert!(ring_bytes(&ddp)
        .iter()
        .all(|&m| m == ring_theory(2, 2, false)));
}

#[test]
fn a_mixture_of_experts_trains_under_context_parallelism() {
    let job = Job::new("cp-moe");
    let set = [
        "model.flavor=\"debugmodel_qwen3_moe\"",
        "model.args.moe.n_experts=4",
        "model.args.moe.expert_ffn_dim=16",
        "model.args.moe.balance_rate=0.01",
        "training.micro_batch_size=1",
        "training.steps=10",
        "training.threads=1",
        "checkpoint.interval=10",
    ];
    let (single, single_dir) = job.train("single", &set);
    ok(&single);
    let mut cp: Vec<&str> = set.to_vec();
    cp.push("parallelism.cp=2");
    let dir = job.dir.join("cp2");
    ok(&mpiexec_train(2, &job, &dir, &cp));
    // The balancing loss is each rank's over its tokens (half of every sequence), so only
    // step 1, before any update, is the single process's; the curves stay close.
    assert_matches(
        &loss_values(&single_dir),
        &loss_values(&dir),
        1e-2,
        "moe cp2",
    );
    let last = rows(&dir).last().unwrap().clone();
    assert!(
        last["aux_loss.load_balance"].as_f64().unwrap() > 0.0,
        "{last}"
    );
    // Means per micro-batch: one sequence of 32 tokens, each routed to 2 experts, in one
    // process; under cp = 2 per rank's 16 tokens.
    let routed = |run: &Path| -> f64 {
        rows(run).last().unwrap()["moe.layer0.tokens_per_expert"]
            .as_array()
            .expect("tokens per expert")
            .iter()
            .map(|v| v.as_f64().unwrap())
            .sum()
    };
    assert_eq!(routed(&single_dir), 64.0);
    assert_eq!(routed(&dir), 32.0);
    // The routing bias moved from the whole step's counts (the run checks at its end that
    // both ranks hold the same bias, and fails otherwise).
    let bias = |run: &Path| {
        anneal_engine::io::load_safetensors(
            run.join("checkpoints/step-10/shard-00000-of-00001.safetensors"),
        )
        .unwrap()["model/layers.0.feed_forward.router.balance_bias"]
            .to_vec_f32()
    };
    assert!(bias(&dir).iter().any(|&b| b != 0.0));
}

#[test]
fn cp2_fsdp2_checkpoints_reshard_to_one_process_and_back() {
    let job = Job::new("cp-reshard");
    let set = [
        "training.micro_batch_size=1",
        "training.steps=10",
        "training.threads=1",
        "checkpoint.interval=5",
    ];
    let layout: Vec<&str> = set
        .iter()
        .copied()
        .chain(["parallelism.cp=2", "parallelism.dp_shard=2"])
        .collect();
    let (single, single_dir) = job.train("single", &set);
    ok(&single);
    let dir = job.dir.join("cp2xfsdp2");
    ok(&mpiexec_train(4, &job, &dir, &layout));
    // FSDP shards over dp_shard × cp: four shards.
    assert_eq!(
        manifest_of(&dir.join("checkpoints/step-5"))["world_size"],
        4
    );
    let (one, four) = (loss_values(&single_dir), loss_values(&dir));
    assert_matches(&one, &four, 1e-4, "cp2xfsdp2");

    // CP(2) × FSDP(2) → one process.
    let to_one = job.dir.join("to-one");
    copy_run(&dir, &to_one, &[10]);
    let out = train_one(&job, &to_one, &set);
    let stdout = ok(&out);
    assert!(stdout.contains("step 5"), "resumes from step 5: {stdout}");
    let resumed = loss_values(&to_one);
    assert_eq!(resumed.len(), 10);
    assert_matches(&one, &resumed, 1e-4, "cp2xfsdp2 -> single");

    // One process → CP(2).
    let to_cp = job.dir.join("to-cp2");
    copy_run(&single_dir, &to_cp, &[10]);
    let cp2: Vec<&str> = set.iter().copied().chain(["parallelism.cp=2"]).collect();
    let stdout = ok(&mpiexec_train(2, &job, &to_cp, &cp2));
    assert!(stdout.contains("step 5"), "{stdout}");
    assert_matches(&one, &loss_values(&to_cp), 1e-4, "single -> cp2");
}

/// CP(2) × TP(2) (and with sequence parallelism): the ring carries each rank's half of the
/// heads; the curve is the single process's, a rerun is bitwise, the checkpoint resumes in one
/// process.
#[test]
fn context_and_tensor_parallelism_compose() {
    let job = Job::new("cp-tp");
    let set: Vec<&str> = with(&["checkpoint.interval=25"]);
    let (single, single_dir) = job.train("single", &set);
    ok(&single);
    let one = loss_values(&single_dir);
    let plus = |extra: &[&'static str]| -> Vec<&str> {
        set.iter().copied().chain(extra.iter().copied()).collect()
    };
    let cptp = plus(&["parallelism.cp=2", "parallelism.tp=2"]);
    for (name, layout) in [
        ("cp2xtp2", cptp.clone()),
        (
            "cp2xtp2-sp",
            plus(&[
                "parallelism.cp=2",
                "parallelism.tp=2",
                "parallelism.tp_sequence=true",
            ]),
        ),
    ] {
        let dir = job.dir.join(name);
        let stdout = ok(&mpiexec_train(4, &job, &dir, &layout));
        assert!(stdout.contains("cp: rank 0 of 2"), "{stdout}");
        assert_matches(&one, &loss_values(&dir), 1e-4, name);
        // One of the two KV heads per rank goes around the ring.
        let theory = ring_theory_heads(2, 4, false, 1);
        assert!(
            ring_bytes(&dir).iter().all(|&m| m == theory),
            "{name}: ring bytes vs theory {theory}"
        );
    }
    let again = job.dir.join("cp2xtp2-again");
    ok(&mpiexec_train(4, &job, &again, &cptp));
    assert_eq!(
        losses(&job.dir.join("cp2xtp2")),
        losses(&again),
        "CP(2) x TP(2) twice"
    );
    // CP(2) × TP(2) at step 25 → one process.
    let to_one = job.dir.join("cp2xtp2-to-one");
    copy_run(&job.dir.join("cp2xtp2"), &to_one, &[50]);
    let out = train_one(&job, &to_one, &set);
    let stdout = ok(&out);
    assert!(stdout.contains("step 25"), "resumes from step 25: {stdout}");
    assert_matches(&one, &loss_values(&to_one), 1e-4, "cp2xtp2 -> single");
}

#[test]
fn layouts_context_parallelism_cannot_run_are_user_errors() {
    let job = Job::new("cp-errors");
    // 30 tokens do not cut into 4 chunks: refused before any process starts, and on the ranks
    // of a job.
    let (out, _) = job.train("a", &["parallelism.cp=2", "training.seq_len=30"]);
    user_error(&out, &["training.seq_len", "parallelism.cp"]);
    let out = mpiexec_train(
        2,
        &job,
        &job.dir.join("a2"),
        &["parallelism.cp=2", "training.seq_len=30"],
    );
    user_error(&out, &["training.seq_len", "parallelism.cp"]);
}
