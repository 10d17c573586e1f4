//! Muon (an optimizer that needs whole matrices) under FSDP on real MPI ranks (one compute
//! thread each), in the owner layout: each matrix's rows, gradient and state go to one owner
//! rank, which steps on the full matrix and sends the updated rows back, so the run follows the
//! single process's while each matrix is orthogonalized once.
//!
//! With two micro-batches over two ranks the summed gradient is bitwise the single process's
//! (one addition, which commutes), so every loss of FSDP(2) is bitwise the single process's:
//! the parameters after each step are the same bits. With four ranks the gradients are summed
//! pairwise in rank order whatever the layout (`anneal_dist::rank_order_sum`), so FSDP(4) and
//! HSDP(2×2) are bitwise DDP(4) (the same sums, the plain unsharded step) and stay within 1e-5
//! of the single process, which adds its four micro-batches in sequence, while the optimizer
//! state stays sharded. (Newton–Schulz runs in bf16, Muon's default: a gradient that differs in
//! its last f32 bit can round to another bf16 value, so the 4-rank curve drifts from the single
//! process's by about 1e-6 after a few steps.)

mod dist_support;

use anneal_tests::cli as common;

use common::{losses, ok, rows, Job};
use dist_support::mpiexec_train;
use std::path::Path;

/// Training and validation losses of a run, as bits.
fn all_losses(run_dir: &Path) -> (Vec<u64>, Vec<u64>) {
    let val = rows(run_dir)
        .iter()
        .filter_map(|r| r["val_loss"].as_f64())
        .map(f64::to_bits)
        .collect();
    (losses(run_dir), val)
}

const STEPS: usize = 8;

fn settings(micro: &'static str, extra: &[&'static str]) -> Vec<&'static str> {
    let mut s = vec![
        "optimizer.plugin=muon",
        micro,
        "training.steps=8",
        "training.threads=1",
        "metrics.eval_freq=4",
    ];
    s.extend_from_slice(extra);
    s
}

#[test]
fn muon_under_fsdp_steps_the_full_matrices() {
    let job = Job::new("muon-fsdp");

    // Two micro-batches: FSDP(2) is bitwise the single process, every step.
    let two = "training.micro_batch_size=2";
    let (single, single_dir) = job.train("single2", &settings(two, &[]));
    ok(&single);
    let (one, one_val) = all_losses(&single_dir);
    assert_eq!(one.len(), STEPS);
    assert_eq!(one_val.len(), 2);
    let first = f64::from_bits(one[0]);
    let last = f64::from_bits(one[STEPS - 1]);
    assert!(last < first - 0.5, "Muon trains: {first} -> {last}");
    let dir = job.dir.join("fsdp2");
    ok(&mpiexec_train(
        2,
        &job,
        &dir,
        &settings(two, &["parallelism.dp_shard=2"]),
    ));
    let (fsdp2, fsdp2_val) = all_losses(&dir);
    assert_eq!(fsdp2, one, "FSDP(2) training losses bitwise");
    // Rank 0 owns part of the matrices, not all of them, and sent their rows and updates.
    let total = rows(&single_dir)[0]["state_bytes"].as_u64().unwrap();
    for r in rows(&dir).iter().filter(|r| r["loss"].is_number()) {
        let owned = r["owner_matrices"].as_u64().unwrap();
        assert!(owned > 0 && r["owner_work"].as_f64().unwrap() > 0.0, "{r}");
        let bytes = r["owner_bytes"].as_u64().unwrap();
        assert!(
            bytes > 0 && bytes < total,
            "owner bytes {bytes} vs state {total}"
        );
    }
    let owned0 = rows(&dir)[0]["owner_matrices"].as_u64().unwrap();
    println!("FSDP(2): rank 0 owns {owned0} matrices");
    assert_eq!(fsdp2_val, one_val, "FSDP(2) validation losses bitwise");

    // Four micro-batches over four ranks.
    let four = "training.micro_batch_size=1";
    let (single, single_dir) = job.train("single4", &settings(four, &[]));
    ok(&single);
    let one: Vec<f64> = losses(&single_dir)
        .into_iter()
        .map(f64::from_bits)
        .collect();
    let ddp_dir = job.dir.join("ddp4");
    ok(&mpiexec_train(4, &job, &ddp_dir, &settings(four, &[])));
    let ddp4 = losses(&ddp_dir);
    for (name, extra) in [
        (
            "fsdp4",
            &["parallelism.dp_shard=-1", "parallelism.dp_replicate=1"][..],
        ),
        ("hsdp2x2", &["parallelism.dp_shard=2"][..]),
    ] {
        let dir = job.dir.join(name);
        ok(&mpiexec_train(4, &job, &dir, &settings(four, extra)));
        let got = losses(&dir);
        assert_eq!(got, ddp4, "{name}: bitwise DDP(4)");
        assert_eq!(got[0], one[0].to_bits(), "{name}: step 1 bitwise");
        for (step, (a, b)) in one.iter().zip(&got).enumerate() {
            let b = f64::from_bits(*b);
            assert!(
                (a - b).abs() / a < 1e-5,
                "{name} step {}: {a} vs {b}",
                step + 1
            );
        }
    }
    // The optimizer state stays sharded between steps: FSDP(4) holds a quarter of DDP's
    // parameter + gradient + optimizer bytes (up to the padding of the last rows).
    let state = |d: &Path| -> f64 {
        rows(d)
            .iter()
            .filter_map(|r| r["state_bytes"].as_u64())
            .next_back()
            .expect("state_bytes") as f64
    };
    let ratio = state(&job.dir.join("fsdp4")) / state(&ddp_dir);
    assert!(
        (ratio - 0.25).abs() < 0.05,
        "FSDP(4): {ratio} of DDP's bytes"
    );
}
