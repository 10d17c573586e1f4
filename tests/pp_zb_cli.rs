//! Zero-bubble pipeline schedules on real MPI ranks: PP(2) under `zero_bubble` (ZB-H1; and
//! interleaved over 2 stages per rank), `zbv` (2 stages per rank in V order) and both with
//! every block recomputed give the losses and gradient norms of 1F1B bitwise, step after step (each step's update depends on the gradients, so the
//! curves stay bitwise only if the gradients are); the bubble theory of each schedule is
//! logged. A V schedule with other than 2 stages per rank is a one-line error naming the key.

mod dist_support;

use anneal_tests::cli as common;

use common::{ok, rows, user_error, Job};
use dist_support::mpiexec_train;
use std::path::Path;

/// Four micro-batches of one sequence per step, one thread per rank, 4 blocks (so 2 ranks can
/// hold 2 stages each), every step logged.
const BASE: [&str; 7] = [
    "training.micro_batch_size=1",
    "training.steps=6",
    "training.threads=1",
    "metrics.log_freq=1",
    "metrics.eval_freq=100",
    "model.args.n_layers=4",
    "parallelism.pp=2",
];

/// Each logged step's (loss, grad_norm) as bits, the bubble theory, and the peak memory.
struct Run {
    curve: Vec<(u64, u64)>,
    theory: f64,
    measured: f64,
    peak: u64,
}

fn run(job: &Job, name: &str, extra: &[&str]) -> Run {
    let dir = job.dir.join(name);
    let set: Vec<&str> = BASE.iter().chain(extra).copied().collect();
    let stdout = ok(&mpiexec_train(2, job, &dir, &set));
    assert!(stdout.contains("pipeline: "), "{stdout}");
    of(&dir)
}

fn of(dir: &Path) -> Run {
    let rows = rows(dir);
    let num = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k}"));
    let curve: Vec<(u64, u64)> = rows
        .iter()
        .map(|r| (num(r, "loss").to_bits(), num(r, "grad_norm").to_bits()))
        .collect();
    assert_eq!(curve.len(), 6, "a row per step");
    let n = rows.len() as f64;
    Run {
        curve,
        theory: num(&rows[0], "pp_bubble_theory"),
        measured: rows.iter().map(|r| num(r, "pp_bubble")).sum::<f64>() / n,
        peak: rows
            .iter()
            .filter_map(|r| r["mem_peak_bytes"].as_u64())
            .max()
            .unwrap_or(0),
    }
}

#[test]
fn zero_bubble_schedules_give_1f1b_gradients_bitwise() {
    let job = Job::new("pp-zb");
    let v2 = "parallelism.pp_virtual_stages=2";
    // (name, its settings, the 1F1B run over the same stages, the bubble in theory with
    // p = 2 and m = 4: 1F1B (p-1)/(vm+p-1), zero bubble (p-1)/(3vm+p-1)).
    let runs: [(&str, Vec<&str>, &str, f64); 8] = [
        ("1f1b", vec![], "1f1b", 1.0 / 5.0),
        (
            "zero_bubble",
            vec!["parallelism.pp_schedule=zero_bubble"],
            "1f1b",
            1.0 / 13.0,
        ),
        (
            "interleaved",
            vec!["parallelism.pp_schedule=interleaved_1f1b", v2],
            "interleaved",
            1.0 / 9.0,
        ),
        // Four stages in V order against 1F1B's two: the split of the blocks does not change
        // the sums either.
        (
            "zbv",
            vec!["parallelism.pp_schedule=zbv", v2],
            "1f1b",
            1.0 / 25.0,
        ),
        (
            "zero_bubble_interleaved",
            vec!["parallelism.pp_schedule=zero_bubble", v2],
            "interleaved",
            1.0 / 25.0,
        ),
        (
            "1f1b_recompute",
            vec!["activation_checkpoint.mode=full"],
            "1f1b_recompute",
            1.0 / 5.0,
        ),
        (
            "zero_bubble_recompute",
            vec![
                "parallelism.pp_schedule=zero_bubble",
                "activation_checkpoint.mode=full",
            ],
            "1f1b_recompute",
            1.0 / 13.0,
        ),
        (
            "zbv_recompute",
            vec![
                "parallelism.pp_schedule=zbv",
                v2,
                "activation_checkpoint.mode=full",
            ],
            "1f1b_recompute",
            1.0 / 25.0,
        ),
    ];
    let mut done: Vec<(&str, Run)> = Vec::new();
    for (name, set, reference, theory) in &runs {
        let r = run(&job, name, set);
        assert!(
            (r.theory - theory).abs() < 1e-12,
            "{name}: theory {}",
            r.theory
        );
        assert!(
            (0.0..1.0).contains(&r.measured),
            "{name}: bubble {}",
            r.measured
        );
        eprintln!(
            "{name}: bubble {:.3} (theory {theory:.3}), mem_peak_bytes {}",
            r.measured, r.peak
        );
        if reference != name {
            let want = &done
                .iter()
                .find(|(n, _)| n == reference)
                .expect("ran first")
                .1;
            assert_eq!(
                r.curve, want.curve,
                "{name} vs {reference}: (loss, grad_norm) bits"
            );
        }
        done.push((name, r));
    }
}

/// With the stages tensor-parallel (PP(2) × TP(2)) or their parameters FSDP-sharded
/// (PP(2) × FSDP(2)), on 4 ranks, the zero-bubble schedules still give 1F1B's curve bitwise:
/// the collectives inside a stage run where its ranks run the same passes.
#[test]
fn zero_bubble_schedules_compose_with_tp_and_fsdp() {
    let job = Job::new("pp-zb-composed");
    let v2 = "parallelism.pp_virtual_stages=2";
    let tp = "parallelism.tp=2";
    let fsdp = "parallelism.dp_shard=2";
    let zb = "parallelism.pp_schedule=zero_bubble";
    let zbv = "parallelism.pp_schedule=zbv";
    // (name, settings, the 1F1B run whose losses and gradient norms to match bitwise: the
    // norm adds per parameter over the placements, so a V, whose first rank holds the first
    // and the last stage, adds in the same order as 1F1B).
    for (name, set, reference) in [
        ("tp_1f1b", vec![tp], None),
        ("tp_zero_bubble", vec![tp, zb], Some("tp_1f1b")),
        ("tp_zbv", vec![tp, zbv, v2], Some("tp_1f1b")),
        ("fsdp_1f1b", vec![fsdp], None),
        ("fsdp_zero_bubble", vec![fsdp, zb], Some("fsdp_1f1b")),
        ("fsdp_zbv", vec![fsdp, zbv, v2], Some("fsdp_1f1b")),
    ] {
        let dir = job.dir.join(name);
        let all: Vec<&str> = BASE.iter().chain(&set).copied().collect();
        ok(&mpiexec_train(4, &job, &dir, &all));
        let Some(reference) = reference else { continue };
        let (got, want) = (of(&dir).curve, of(&job.dir.join(reference)).curve);
        let losses = |c: &[(u64, u64)]| c.iter().map(|x| x.0).collect::<Vec<_>>();
        assert_eq!(losses(&got), losses(&want), "{name} vs {reference}: losses");
        assert_eq!(got, want, "{name} vs {reference}: gradient norms");
    }
}

#[test]
fn a_v_needs_two_stages_per_rank() {
    let job = Job::new("pp-zb-errors");
    for v in ["1", "3"] {
        let stages = format!("parallelism.pp_virtual_stages={v}");
        let (out, _) = job.train(v, &["parallelism.pp_schedule=zbv", stages.as_str()]);
        user_error(&out, &["parallelism.pp_virtual_stages", "zbv", "2"]);
    }
    let (out, _) = job.train("gpipe", &["parallelism.pp_schedule=gpipe"]);
    user_error(&out, &["parallelism.pp_schedule", "zero_bubble", "zbv"]);
}
