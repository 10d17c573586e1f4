//! FSDP(2) with encoded parameter all-gathers (`parallelism.fsdp_all_gather_dtype`) on real MPI
//! ranks: bf16 halves the bytes each rank sends in gathers and the blockwise int8 / fp8 (e4m3)
//! ones take at most 55% of bf16's; the loss curve stays close to the exact (f32) gather's, the
//! run learns, and a quantized run reruns bitwise. A bad dtype or block is one line naming the
//! key, exit 2.

mod dist_support;

use anneal_tests::cli as common;

use common::{losses, ok, rows, user_error, Job};
use dist_support::{loss_values, mpiexec_train};
use std::path::Path;

const LAYOUT: [&str; 5] = [
    "training.micro_batch_size=2",
    "training.steps=20",
    "training.threads=1",
    "metrics.eval_freq=0",
    "parallelism.dp_shard=2",
];

/// The bytes each step's parameter gathers sent from this rank (rank 0's metrics).
fn gather_bytes(run_dir: &Path) -> Vec<u64> {
    rows(run_dir)
        .iter()
        .filter_map(|r| r["fsdp_gather_bytes"].as_u64())
        .collect()
}

#[test]
fn encoded_gathers_cut_the_bytes_and_keep_the_curve() {
    let job = Job::new("fsdp-gather");
    let run = |name: &str, dtype: &str| {
        let dir = job.dir.join(name);
        let set = format!("parallelism.fsdp_all_gather_dtype={dtype}");
        let mut args = LAYOUT.to_vec();
        args.push(&set);
        ok(&mpiexec_train(2, &job, &dir, &args));
        dir
    };
    let exact = run("f32", "float32");
    let bf16 = run("bf16", "bfloat16");
    let int8 = run("int8", "int8");
    let fp8 = run("fp8", "fp8_e4m3");
    let int8_again = run("int8-again", "int8");

    let bytes = |d: &Path| {
        let b = gather_bytes(d);
        assert_eq!(b.len(), 20, "{}", d.display());
        assert!(b.iter().all(|&x| x == b[0] && x > 0), "{b:?}");
        b[0] as f64
    };
    let (f32_b, bf16_b) = (bytes(&exact), bytes(&bf16));
    assert!(
        (bf16_b / f32_b - 0.5).abs() < 0.01,
        "bf16 {bf16_b} vs f32 {f32_b}"
    );
    for (name, d) in [("int8", &int8), ("fp8", &fp8)] {
        let ratio = bytes(d) / bf16_b;
        println!("{name}: {ratio:.3} of bf16's gather bytes");
        assert!(ratio <= 0.55, "{name}: {ratio} of bf16's bytes");
    }
    let want = loss_values(&exact);
    for (name, d, tol) in [
        ("bf16", &bf16, 0.01),
        ("int8", &int8, 0.02),
        ("fp8", &fp8, 0.03),
    ] {
        let got = loss_values(d);
        for (step, (a, b)) in want.iter().zip(&got).enumerate() {
            let rel = (a - b).abs() / a.abs();
            assert!(
                rel < tol,
                "{name} step {}: {b} vs exact {a} (rel {rel:e})",
                step + 1
            );
        }
        assert!(
            got[19] < got[0] - 0.5,
            "{name} learns: {} -> {}",
            got[0],
            got[19]
        );
        println!("{name}: step 20 loss {} vs exact {}", got[19], want[19]);
    }
    assert_ne!(
        losses(&int8),
        losses(&exact),
        "int8 gathers change the values"
    );
    assert_eq!(
        losses(&int8),
        losses(&int8_again),
        "a quantized run reruns bitwise"
    );
}

#[test]
fn bad_gather_settings_name_the_key() {
    let job = Job::new("fsdp-gather-bad");
    for (set, key) in [
        (
            "parallelism.fsdp_all_gather_dtype=int4",
            "parallelism.fsdp_all_gather_dtype",
        ),
        (
            "parallelism.fsdp_all_gather_block=0",
            "parallelism.fsdp_all_gather_block",
        ),
    ] {
        let (out, _) = job.train("bad", &[set]);
        user_error(&out, &[key]);
    }
}
