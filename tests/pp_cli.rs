//! Pipeline-parallel `anneal train` on real MPI ranks (one compute thread each): PP(2) under
//! 1F1B, interleaved 1F1B (2 virtual stages per rank) and with every block recomputed, and
//! PP(2) × DDP(2) and PP(2) × FSDP(2) match the single process (step 1 bitwise, the curve within
//! 1e-4), a rerun is bitwise identical, the measured bubble is logged beside the schedule's
//! theory; each stage saves its own parameters (each of its shard ranks its rows under FSDP) and
//! the checkpoints reshard between PP(2), PP(2) × FSDP(2), FSDP(4) and one process; a block's
//! buffers (a MoE router's balancing bias) live, update and save with its stage; layouts
//! that do not fit the model are one-line errors with exit code 2.

mod dist_support;

use anneal_tests::cli as common;

use common::{losses, ok, rows, user_error, Job};
use dist_support::{copy_run, loss_values, manifest_of, mpiexec_train, piece, train_one};
use std::path::Path;

/// Four micro-batches of one sequence per step, one thread per rank, 4 blocks (so 2 ranks can
/// hold 2 stages each).
const LAYOUT: [&str; 5] = [
    "training.micro_batch_size=1",
    "training.steps=50",
    "training.threads=1",
    "metrics.eval_freq=25",
    "model.args.n_layers=4",
];

fn with(extra: &[&'static str]) -> Vec<&'static str> {
    LAYOUT.iter().chain(extra).copied().collect()
}

/// Step 1 bitwise, every step within 1e-4 relative.
fn assert_matches(one: &[f64], other: &[f64], what: &str) {
    assert_eq!(one.len(), other.len(), "{what}: steps");
    assert_eq!(
        one[0].to_bits(),
        other[0].to_bits(),
        "{what}: step 1: {} vs {}",
        one[0],
        other[0]
    );
    for (step, (a, b)) in one.iter().zip(other).enumerate() {
        let rel = (a - b).abs() / a.abs();
        assert!(
            rel < 1e-4,
            "{what}: step {}: {a} vs {b} (rel {rel:e})",
            step + 1
        );
    }
}

/// The pipeline's bubble figures of the logged rows: (measured, theory).
fn bubbles(run_dir: &Path) -> Vec<(f64, f64)> {
    rows(run_dir)
        .iter()
        .filter_map(|r| Some((r["pp_bubble"].as_f64()?, r["pp_bubble_theory"].as_f64()?)))
        .collect()
}

#[test]
fn pipelines_match_the_single_process_and_rerun_bitwise() {
    let job = Job::new("pp");
    let (single, single_dir) = job.train("single", &LAYOUT);
    ok(&single);
    let one = loss_values(&single_dir);
    assert_eq!(one.len(), 50);
    // Theory: (p - 1) / (v m + p - 1), m this data-parallel rank's micro-batches.
    let layouts: [(&str, usize, Vec<&str>, f64); 5] = [
        ("pp2", 2, with(&["parallelism.pp=2"]), 1.0 / 5.0),
        (
            "pp2-interleaved",
            2,
            with(&[
                "parallelism.pp=2",
                "parallelism.pp_schedule=interleaved_1f1b",
                "parallelism.pp_virtual_stages=2",
            ]),
            1.0 / 9.0,
        ),
        (
            "pp2xddp2",
            4,
            with(&["parallelism.pp=2", "parallelism.dp_replicate=2"]),
            1.0 / 3.0,
        ),
        // Every block recomputed in backward, inside its stage.
        (
            "pp2-recompute",
            2,
            with(&["parallelism.pp=2", "activation_checkpoint.mode=full"]),
            1.0 / 5.0,
        ),
        // Each stage's parameters sharded over 2 ranks (FSDP inside the stages).
        (
            "pp2xfsdp2",
            4,
            with(&["parallelism.pp=2", "parallelism.dp_shard=2"]),
            1.0 / 3.0,
        ),
    ];
    for (name, n, set, theory) in &layouts {
        let dir = job.dir.join(name);
        let stdout = ok(&mpiexec_train(*n, &job, &dir, set));
        assert!(stdout.contains("pipeline: "), "{stdout}");
        let got = loss_values(&dir);
        assert_matches(&one, &got, name);
        eprintln!(
            "{name}: whole curve bitwise: {}",
            one.iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        let b = bubbles(&dir);
        assert_eq!(b.len(), 50, "{name}: pp_bubble on every row");
        for (measured, t) in &b {
            assert!(
                (t - theory).abs() < 1e-12,
                "{name}: theory {t}, want {theory}"
            );
            assert!((0.0..1.0).contains(measured), "{name}: bubble {measured}");
        }
        let mean = b.iter().map(|x| x.0).sum::<f64>() / b.len() as f64;
        eprintln!("{name}: measured bubble {mean:.3}, theory {theory:.3}");
        assert!(rows(&dir).iter().any(|r| r["val_loss"].is_number()));
        assert!(rows(&dir)[0]["comm_bytes"].as_u64().is_some_and(|c| c > 0));
    }
    // The same layout twice is bitwise identical.
    for (name, n, set, _) in layouts
        .iter()
        .filter(|l| ["pp2", "pp2xfsdp2"].contains(&l.0))
    {
        let again = job.dir.join(format!("{name}-again"));
        ok(&mpiexec_train(*n, &job, &again, set));
        assert_eq!(losses(&job.dir.join(name)), losses(&again), "{name} twice");
    }
    // The single process's validation losses too (every rank takes part in evaluation).
    let val = |d: &Path| -> Vec<u64> {
        rows(d)
            .iter()
            .filter_map(|r| r["val_loss"].as_f64().map(f64::to_bits))
            .collect()
    };
    assert_eq!(
        val(&single_dir),
        val(&job.dir.join("pp2")),
        "validation losses"
    );
}

#[test]
fn each_stage_saves_its_parameters_and_checkpoints_reshard() {
    let job = Job::new("pp-reshard");
    let set = [
        "training.micro_batch_size=1",
        "training.steps=10",
        "training.threads=1",
        "checkpoint.interval=5",
        "model.args.n_layers=4",
    ];
    let pp: Vec<&str> = set.iter().copied().chain(["parallelism.pp=2"]).collect();
    let (single, single_dir) = job.train("single", &set);
    ok(&single);
    let pp_dir = job.dir.join("pp2");
    ok(&mpiexec_train(2, &job, &pp_dir, &pp));
    // Each stage wrote its own parameters: blocks 0-1 and the embedding on rank 0, blocks
    // 2-3 and the head on rank 1, with their optimizer state.
    let step5 = pp_dir.join("checkpoints/step-5");
    let manifest = manifest_of(&step5);
    assert_eq!(manifest["world_size"], 2);
    let (first, second) = (
        "shard-00000-of-00002.safetensors",
        "shard-00001-of-00002.safetensors",
    );
    for (name, shard, other) in [
        ("model/tok_embeddings.weight", first, second),
        ("model/layers.0.attention.wq.weight", first, second),
        ("model/layers.3.attention.wq.weight", second, first),
        ("model/output.weight", second, first),
    ] {
        assert!(piece(&manifest, name, shard).is_some(), "{name} in {shard}");
        assert!(
            piece(&manifest, name, other).is_none(),
            "{name} not in {other}"
        );
    }
    assert!(manifest["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["name"] == "optim/output.weight.exp_avg" && t["shard"] == second));
    let (one, two) = (loss_values(&single_dir), loss_values(&pp_dir));
    assert_matches(&one, &two, "pp2");

    // PP(2) -> one process: resume the pipeline's step 5 without a pipeline.
    let to_one = job.dir.join("pp2-to-one");
    copy_run(&pp_dir, &to_one, &[10]);
    let out = train_one(&job, &to_one, &set);
    let stdout = ok(&out);
    assert!(stdout.contains("step 5"), "resumes from step 5: {stdout}");
    let resumed = loss_values(&to_one);
    assert_eq!(resumed.len(), 10);
    assert_eq!(
        resumed[5].to_bits(),
        two[5].to_bits(),
        "step 6 after the reshard"
    );
    assert_matches(&one, &resumed, "pp2 -> single");

    // One process -> PP(2), interleaved over 4 stages.
    let to_pp = job.dir.join("one-to-pp2");
    copy_run(&single_dir, &to_pp, &[10]);
    let interleaved: Vec<&str> = pp
        .iter()
        .copied()
        .chain([
            "parallelism.pp_schedule=interleaved_1f1b",
            "parallelism.pp_virtual_stages=2",
        ])
        .collect();
    let stdout = ok(&mpiexec_train(2, &job, &to_pp, &interleaved));
    assert!(stdout.contains("step 5"), "{stdout}");
    let log = std::fs::read_to_string(to_pp.join("logs/rank-1.log")).unwrap();
    assert!(log.contains("resuming from"), "rank 1 resumes too: {log}");
    assert_matches(&one, &loss_values(&to_pp), "single -> pp2 interleaved");
}

/// A block's buffers live with its stage: on the tiny Qwen3-MoE with aux-loss-free balancing,
/// each stage updates its blocks' routing bias from their token counts and saves it, so PP(2)
/// stays on the single process's curve, and checkpoints reshard both ways with the biases.
#[test]
fn stages_hold_and_update_their_blocks_buffers() {
    let job = Job::new("pp-buffers");
    let set = [
        "model.flavor=\"debugmodel_qwen3_moe\"",
        "model.args.moe.n_experts=4",
        "model.args.moe.expert_ffn_dim=16",
        "model.args.moe.balance_rate=0.01",
        "training.micro_batch_size=1",
        "training.steps=10",
        "training.threads=1",
        "checkpoint.interval=5",
        "model.args.n_layers=4",
    ];
    let pp: Vec<&str> = set.iter().copied().chain(["parallelism.pp=2"]).collect();
    let (single, single_dir) = job.train("single", &set);
    ok(&single);
    let one = loss_values(&single_dir);
    let pp_dir = job.dir.join("pp2");
    ok(&mpiexec_train(2, &job, &pp_dir, &pp));
    let two = loss_values(&pp_dir);
    assert_matches(&one, &two, "pp2 with balancing biases");
    let manifest = manifest_of(&pp_dir.join("checkpoints/step-5"));
    let (first, second) = (
        "shard-00000-of-00002.safetensors",
        "shard-00001-of-00002.safetensors",
    );
    for (layer, shard, other) in [(1, first, second), (2, second, first)] {
        let name = format!("model/layers.{layer}.feed_forward.router.balance_bias");
        assert!(
            piece(&manifest, &name, shard).is_some(),
            "{name} in {shard}"
        );
        assert!(
            piece(&manifest, &name, other).is_none(),
            "{name} not in {other}"
        );
    }
    // PP(2) -> one process, and one process -> PP(2), from step 5.
    let to_one = job.dir.join("pp2-to-one");
    copy_run(&pp_dir, &to_one, &[10]);
    assert!(ok(&train_one(&job, &to_one, &set)).contains("step 5"));
    let resumed = loss_values(&to_one);
    assert_eq!(
        resumed[5].to_bits(),
        two[5].to_bits(),
        "step 6 after the reshard"
    );
    assert_matches(&one, &resumed, "pp2 -> single");
    let to_pp = job.dir.join("one-to-pp2");
    copy_run(&single_dir, &to_pp, &[10]);
    assert!(ok(&mpiexec_train(2, &job, &to_pp, &pp)).contains("step 5"));
    assert_matches(&one, &loss_values(&to_pp), "single -> pp2");
}

/// PP(2) × FSDP(2) saves each stage's rows on its shard ranks; its checkpoint resumes as
/// FSDP(4), whose checkpoint resumes in one process, all on the single process's curve.
#[test]
fn sharded_stages_reshard_to_fsdp_and_to_one_process() {
    let job = Job::new("pp-fsdp-reshard");
    let set = [
        "training.micro_batch_size=1",
        "training.steps=15",
        "training.threads=1",
        "checkpoint.interval=5",
        "model.args.n_layers=4",
    ];
    let plus = |extra: &[&'static str]| -> Vec<&str> {
        set.iter().copied().chain(extra.iter().copied()).collect()
    };
    let (single, single_dir) = job.train("single", &set);
    ok(&single);
    let one = loss_values(&single_dir);
    let pp_dir = job.dir.join("pp2xfsdp2");
    let stdout = ok(&mpiexec_train(
        4,
        &job,
        &pp_dir,
        &plus(&["parallelism.pp=2", "parallelism.dp_shard=2"]),
    ));
    assert!(
        stdout.contains("pipeline: ") && stdout.contains("fsdp: "),
        "{stdout}"
    );
    assert_matches(&one, &loss_values(&pp_dir), "pp2 x fsdp2");
    // Four pieces: each stage's tensors split over its two shard ranks, never elsewhere.
    let manifest = manifest_of(&pp_dir.join("checkpoints/step-5"));
    assert_eq!(manifest["world_size"], 4);
    let shards_of = |name: &str| -> Vec<String> {
        (0..4)
            .map(|i| format!("shard-{i:05}-of-00004.safetensors"))
            .filter(|s| piece(&manifest, name, s).is_some())
            .collect()
    };
    let (first, last) = (
        shards_of("model/layers.0.attention.wq.weight"),
        shards_of("model/output.weight"),
    );
    assert_eq!(first.len(), 2, "a block's rows on two ranks: {first:?}");
    assert_eq!(last.len(), 2, "the head's rows on two ranks: {last:?}");
    assert!(
        first.iter().all(|s| !last.contains(s)),
        "{first:?} {last:?}"
    );
    assert_eq!(shards_of("optim/output.weight.exp_avg"), last);

    // PP(2) × FSDP(2) at step 5 -> FSDP(4), which saves steps 10 and 15.
    let to_fsdp = job.dir.join("to-fsdp4");
    copy_run(&pp_dir, &to_fsdp, &[10, 15]);
    let stdout = ok(&mpiexec_train(
        4,
        &job,
        &to_fsdp,
        &plus(&["parallelism.dp_shard=4"]),
    ));
    assert!(stdout.contains("step 5"), "resumes from step 5: {stdout}");
    let fsdp = loss_values(&to_fsdp);
    assert_matches(&one, &fsdp, "pp2 x fsdp2 -> fsdp4");

    // FSDP(4) at step 10 -> one process.
    let to_one = job.dir.join("to-one");
    copy_run(&to_fsdp, &to_one, &[15]);
    let out = train_one(&job, &to_one, &set);
    let stdout = ok(&out);
    assert!(stdout.contains("step 10"), "resumes from step 10: {stdout}");
    let resumed = loss_values(&to_one);
    assert_eq!(resumed.len(), 15);
    assert_eq!(
        resumed[10].to_bits(),
        fsdp[10].to_bits(),
        "step 11 after the reshard"
    );
    assert_matches(&one, &resumed, "fsdp4 -> single");
}

#[test]
fn layouts_that_do_not_fit_the_model_are_user_errors() {
    let job = Job::new("pp-errors");
    // The tiny model has 2 blocks: 2 ranks × 2 virtual stages is too many.
    let out = mpiexec_train(
        2,
        &job,
        &job.dir.join("a"),
        &[
            "training.micro_batch_size=1",
            "parallelism.pp=2",
            "parallelism.pp_schedule=interleaved_1f1b",
            "parallelism.pp_virtual_stages=2",
        ],
    );
    user_error(&out, &["parallelism.pp", "pp_virtual_stages", "2 layer"]);
    // A split that does not sum to the layer count.
    let out = mpiexec_train(
        2,
        &job,
        &job.dir.join("b"),
        &[
            "training.micro_batch_size=1",
            "parallelism.pp=2",
            "parallelism.pp_split=[1, 2]",
        ],
    );
    user_error(&out, &["parallelism.pp_split", "summing to 2"]);
    // Interleaving needs the micro-batches to be a multiple of the ranks: 1 micro-batch here.
    let out = mpiexec_train(
        2,
        &job,
        &job.dir.join("c"),
        &[
            "model.args.n_layers=4",
            "parallelism.pp=2",
            "parallelism.pp_schedule=interleaved_1f1b",
            "parallelism.pp_virtual_stages=2",
        ],
    );
    user_error(
        &out,
        &["training.batch_size", "pp_schedule", "parallelism.pp"],
    );
    // Unknown schedules and virtual stages under plain 1F1B are refused before anything runs.
    let (out, _) = job.train("d", &["parallelism.pp_schedule=gpipe"]);
    user_error(&out, &["parallelism.pp_schedule", "gpipe"]);
    let (out, _) = job.train("e", &["parallelism.pp_virtual_stages=2"]);
    user_error(&out, &["parallelism.pp_virtual_stages", "1f1b"]);
    // (`anneal rl` runs under a pipeline: tests/rl_pp_cli.rs.)
}
