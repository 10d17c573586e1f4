//! Composed layouts on real MPI ranks (one compute thread each, 4 ranks oversubscribed):
//! context parallelism inside pipeline stages (PP(2) × CP(2)), expert parallelism under
//! context parallelism (CP(2) × EP(2), the experts split over dp_shard 2) and inside pipeline
//! stages (PP(2) × EP(2) over dp_shard 2, each stage updating its blocks' balancing bias)
//! follow the single process (step 1 within 1e-6 relative, 50 steps within 1e-4, the
//! validation losses too), rerun bitwise and save checkpoints that one process resumes on the
//! single process's curve; so does PP(2) × CP(2) × FSDP(2) on 8 ranks (10 steps).

mod dist_support;

use anneal_tests::cli as common;

use common::{losses, ok, rows, Job};
use dist_support::{
    copy_run, follows_single, loss_values, manifest_of, mpiexec_train, piece, train_one,
};
use std::path::Path;

/// Four micro-batches of one sequence of 32 tokens per step, one thread per rank, 4 blocks
/// (2 per stage under pp = 2).
const LAYOUT: [&str; 6] = [
    "training.micro_batch_size=1",
    "training.steps=50",
    "training.threads=1",
    "metrics.eval_freq=25",
    "checkpoint.interval=25",
    "model.args.n_layers=4",
];

/// The tiny Qwen3-MoE of the expert-parallel tests (4 experts, aux-loss-free balancing on);
/// its load-balancing loss weighs 0, because under cp each rank's sees half of every sequence
/// (see `crate::cp` in anneal-train), which no other layout reproduces.
const MOE: [&str; 5] = [
    "model.flavor=\"debugmodel_qwen3_moe\"",
    "model.args.moe.n_experts=4",
    "model.args.moe.expert_ffn_dim=16",
    "model.args.moe.balance_rate=0.01",
    "training.aux_loss_weights.load_balance=0.0",
];

fn with(base: &[&'static str], extra: &[&'static str]) -> Vec<&'static str> {
    base.iter().chain(extra).copied().collect()
}

fn val_losses(run_dir: &Path) -> Vec<f64> {
    rows(run_dir)
        .iter()
        .filter_map(|r| r["val_loss"].as_f64())
        .collect()
}

fn assert_val_matches(one: &Path, other: &Path, what: &str) {
    let (a, b) = (val_losses(one), val_losses(other));
    assert_eq!(a.len(), 2, "{what}: validation at steps 25 and 50");
    assert_eq!(a.len(), b.len(), "{what}: validation losses");
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() / x < 1e-4, "{what}: val {x} vs {y}");
    }
}

/// Resumes `from`'s step-25 checkpoint in one process and checks that steps 26..=50 stay on the
/// single process's curve `one`.
fn resumes_in_one_process(job: &Job, from: &Path, set: &[&str], one: &[f64], what: &str) {
    let to_one = job.dir.join(format!("{what}-to-one"));
    copy_run(from, &to_one, &[50]);
    let stdout = ok(&train_one(job, &to_one, set));
    assert!(
        stdout.contains("step 25"),
        "{what}: resumes from 25: {stdout}"
    );
    let resumed = loss_values(&to_one);
    assert_eq!(resumed.len(), 50, "{what}: 25 + 25 rows");
    follows_single(&format!("{what} -> single"), one, &resumed);
}

#[test]
fn context_parallelism_runs_inside_pipeline_stages() {
    let job = Job::new("pp-cp");
    let (single, single_dir) = job.train("single", &LAYOUT);
    ok(&single);
    let one = loss_values(&single_dir);
    assert_eq!(one.len(), 50);
    let set = with(&LAYOUT, &["parallelism.pp=2", "parallelism.cp=2"]);
    let dir = job.dir.join("pp2xcp2");
    let stdout = ok(&mpiexec_train(4, &job, &dir, &set));
    assert!(
        stdout.contains("pipeline: ")
            && stdout.contains("cp: rank 0 of 2 holds positions 0..8 and 24..32"),
        "{stdout}"
    );
    follows_single("pp2 x cp2", &one, &loss_values(&dir));
    assert_val_matches(&single_dir, &dir, "pp2 x cp2");
    // Rank 0's ring: its stage's 2 blocks × 4 micro-batches; per block one forward pass of
    // keys, values (2 heads of 16, f32, 16 rows) and their positions, and two backward passes
    // that add the keys' and values' gradients.
    let (t, kv) = (16u64, 32u64);
    let theory = 2 * 4 * ((2 * t * kv * 4 + t * 8) + 2 * (4 * t * kv * 4 + t * 8));
    let logged = rows(&dir);
    assert_eq!(logged.len(), 50);
    for r in &logged {
        assert_eq!(r["cp_ring_bytes"].as_u64(), Some(theory), "{r}");
        // 1F1B over 2 stages and 4 micro-batches: (p − 1) / (m + p − 1).
        assert_eq!(r["pp_bubble_theory"].as_f64(), Some(0.2), "{r}");
    }
    // The same layout twice is bitwise identical.
    let again = job.dir.join("pp2xcp2-again");
    ok(&mpiexec_train(4, &job, &again, &set));
    assert_eq!(losses(&dir), losses(&again), "PP(2) x CP(2) twice");
    // The cp ranks hold copies of their stage: the first cp coordinate's stages save it, one
    // shard each.
    let manifest = manifest_of(&dir.join("checkpoints/step-25"));
    assert_eq!(manifest["world_size"], 2, "{manifest}");
    assert!(piece(
        &manifest,
        "model/output.weight",
        "shard-00001-of-00002.safetensors"
    )
    .is_some());
    resumes_in_one_process(&job, &dir, &LAYOUT, &one, "pp2xcp2");
}

#[test]
fn expert_parallelism_runs_under_context_parallelism() {
    let job = Job::new("cp-ep");
    let set = with(&LAYOUT, &MOE);
    let (single, single_dir) = job.train("single", &set);
    ok(&single);
    let one = loss_values(&single_dir);
    let layout = with(
        &set,
        &[
            "parallelism.cp=2",
            "parallelism.dp_shard=2",
            "parallelism.ep=2",
        ],
    );
    let dir = job.dir.join("cp2xep2");
    let stdout = ok(&mpiexec_train(4, &job, &dir, &layout));
    assert!(
        stdout.contains("cp: rank 0 of 2") && stdout.contains("ep: "),
        "{stdout}"
    );
    assert!(
        stdout.contains("buffers identical on every rank"),
        "the balancing bias is checked: {stdout}"
    );
    follows_single("cp2 x ep2", &one, &loss_values(&dir));
    assert_val_matches(&single_dir, &dir, "cp2 x ep2");
    let a2a: Vec<u64> = rows(&dir)
        .iter()
        .filter_map(|r| r["ep_a2a_bytes"].as_u64())
        .collect();
    assert_eq!(a2a.len(), 50);
    assert!(a2a.iter().all(|&b| b > 0), "{a2a:?}");
    let again = job.dir.join("cp2xep2-again");
    ok(&mpiexec_train(4, &job, &again, &layout));
    assert_eq!(losses(&dir), losses(&again), "CP(2) x EP(2) twice");
    // Shard rank s·cp + c holds expert slice s (experts 2s, 2s + 1), sharded over its cp
    // ranks: one expert each.
    let m = manifest_of(&dir.join("checkpoints/step-25"));
    assert_eq!(m["world_size"], 4);
    let name = "model/layers.0.feed_forward.experts.w1";
    for (shard, rows) in [(0, [0, 1]), (1, [1, 2]), (2, [2, 3]), (3, [3, 4])] {
        let file = format!("shard-{shard:05}-of-00004.safetensors");
        let p = piece(&m, name, &file).unwrap_or_else(|| panic!("{name} in {file}: {m}"));
        assert_eq!(p["slice"][0], serde_json::json!(rows), "{p}");
    }
    resumes_in_one_process(&job, &dir, &set, &one, "cp2xep2");
}

#[test]
fn expert_parallelism_runs_inside_pipeline_stages() {
    let job = Job::new("pp-ep");
    // The balancing bias on (each stage updates its blocks' from their token counts) and the
    // balancing loss counted.
    let set = with(&LAYOUT, &MOE[..4]);
    let (single, single_dir) = job.train("single", &set);
    ok(&single);
    let one = loss_values(&single_dir);
    let layout = with(
        &set,
        &[
            "parallelism.pp=2",
            "parallelism.dp_shard=2",
            "parallelism.ep=2",
        ],
    );
    let dir = job.dir.join("pp2xep2");
    let stdout = ok(&mpiexec_train(4, &job, &dir, &layout));
    assert!(
        stdout.contains("pipeline: ") && stdout.contains("ep: "),
        "{stdout}"
    );
    assert!(
        stdout.contains("buffers identical on every rank"),
        "the balancing bias is checked: {stdout}"
    );
    follows_single("pp2 x ep2", &one, &loss_values(&dir));
    assert_val_matches(&single_dir, &dir, "pp2 x ep2");
    let last = rows(&dir).last().unwrap().clone();
    assert!(
        last["aux_loss.load_balance"].as_f64().unwrap() > 0.0,
        "{last}"
    );
    assert!(rows(&dir)
        .iter()
        .all(|r| r["ep_a2a_bytes"].as_u64().is_some_and(|b| b > 0)));
    let again = job.dir.join("pp2xep2-again");
    ok(&mpiexec_train(4, &job, &again, &layout));
    assert_eq!(losses(&dir), losses(&again), "PP(2) x EP(2) twice");
    // Stage 0 (blocks 0-1) on shards 0 and 1, each with its slice of the experts, never the
    // whole; stage 1 on shards 2 and 3.
    let m = manifest_of(&dir.join("checkpoints/step-25"));
    assert_eq!(m["world_size"], 4);
    for (name, shard, rows) in [
        ("model/layers.0.feed_forward.experts.w1", 0, [0, 2]),
        ("model/layers.0.feed_forward.experts.w1", 1, [2, 4]),
        ("model/layers.3.feed_forward.experts.w2", 2, [0, 2]),
        ("model/layers.3.feed_forward.experts.w2", 3, [2, 4]),
    ] {
        let file = format!("shard-{shard:05}-of-00004.safetensors");
        let p = piece(&m, name, &file).unwrap_or_else(|| panic!("{name} in {file}: {m}"));
        assert_eq!(p["slice"][0], serde_json::json!(rows), "{p}");
    }
    // Each block's bias lives (and is saved) with its stage, whole, by the stage's first shard.
    for (layer, shard) in [(0, 0), (3, 2)] {
        let name = format!("model/layers.{layer}.feed_forward.router.balance_bias");
        let file = format!("shard-{shard:05}-of-00004.safetensors");
        assert!(piece(&m, &name, &file).is_some(), "{name} in {file}: {m}");
    }
    resumes_in_one_process(&job, &dir, &set, &one, "pp2xep2");
}

/// PP(2) × CP(2) × FSDP(2) on 8 ranks: FSDP shards each stage over dp_shard × cp, so every cp
/// rank saves its own rows (8 shards), and the checkpoint resumes in one process.
#[test]
fn pipeline_stages_shard_over_dp_shard_times_cp() {
    let job = Job::new("pp-cp-fsdp");
    let set = [
        "training.micro_batch_size=1",
        "training.steps=10",
        "training.threads=1",
        "checkpoint.interval=5",
        "model.args.n_layers=4",
    ];
    let (single, single_dir) = job.train("single", &set);
    ok(&single);
    let one = loss_values(&single_dir);
    let layout = with(
        &set,
        &[
            "parallelism.pp=2",
            "parallelism.cp=2",
            "parallelism.dp_shard=2",
        ],
    );
    let dir = job.dir.join("pp2xcp2xfsdp2");
    ok(&mpiexec_train(8, &job, &dir, &layout));
    follows_single("pp2 x cp2 x fsdp2", &one, &loss_values(&dir));
    let m = manifest_of(&dir.join("checkpoints/step-5"));
    assert_eq!(m["world_size"], 8, "every rank saves its rows");
    let to_one = job.dir.join("to-one");
    copy_run(&dir, &to_one, &[10]);
    let stdout = ok(&train_one(&job, &to_one, &set));
    assert!(stdout.contains("step 5"), "resumes from 5: {stdout}");
    follows_single("pp2 x cp2 x fsdp2 -> single", &one, &loss_values(&to_one));
}
