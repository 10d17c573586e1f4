//! `training.dtype = "bfloat16"` end to end: bitwise determinism (across runs and thread
//! counts), exact resume from a checkpoint, and a loss curve that tracks f32's.

use anneal_tests::cli as common;

use common::{losses, ok, Job};

const BF16: &str = "training.dtype=\"bfloat16\"";

#[test]
fn bf16_is_deterministic_resumes_exactly_and_tracks_f32() {
    let job = Job::new("bf16");
    let base = [
        "training.steps=12",
        "checkpoint.interval=3",
        "checkpoint.keep_latest=10",
        "metrics.eval_freq=0",
    ];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        base.iter().chain(extra).copied().collect()
    };
    let (a, dir_a) = job.train("a", &with(&[BF16]));
    let (b, dir_b) = job.train("b", &with(&[BF16, "training.threads=1"]));
    let (f, dir_f) = job.train("f32", &with(&[]));
    ok(&a);
    ok(&b);
    ok(&f);
    let want = losses(&dir_a);
    assert_eq!(want.len(), 12);
    assert_eq!(losses(&dir_b), want, "1 thread vs all threads");
    assert_ne!(losses(&dir_f), want, "bf16 is not silently f32");

    // Resume: drop the checkpoints after step 6 and run the same command again.
    let dir_c = job.dir.join("c");
    let status = std::process::Command::new("cp")
        .arg("-r")
        .arg(&dir_a)
        .arg(&dir_c)
        .status()
        .unwrap();
    assert!(status.success());
    for s in [9, 12] {
        std::fs::remove_dir_all(dir_c.join(format!("checkpoints/step-{s}"))).unwrap();
    }
    let (c, _) = job.train("c", &with(&[BF16]));
    let stdout = ok(&c);
    assert!(stdout.contains("resuming from"), "{stdout}");
    assert_eq!(
        losses(&dir_c),
        want,
        "the resumed bf16 curve continues bit for bit"
    );

    // Mixed precision follows the f32 curve within 2% at every step.
    let to_f = |v: Vec<u64>| v.into_iter().map(f64::from_bits).collect::<Vec<_>>();
    for (i, (x, y)) in to_f(want).iter().zip(to_f(losses(&dir_f))).enumerate() {
        assert!(
            (x - y).abs() <= 0.02 * y,
            "step {}: bf16 {x} vs f32 {y}",
            i + 1
        );
    }
}

/// A model declared in bf16 (as Llama 3.2 and Qwen3 checkpoints ship) trains on f32 master
/// weights, computing in `training.dtype`: its optimizer steps (AdamW keeps f32 state), its
/// checkpoint holds the f32 masters, and the run resumes from it bit for bit. With tied
/// embeddings the first loss is near a uniform guess's, not hundreds.
#[test]
fn a_model_declared_in_bf16_trains_on_f32_masters_and_resumes() {
    let job = Job::new("bf16-declared");
    let set = [
        "model.args.dtype=\"bf16\"",
        "model.args.tie_embeddings=true",
        BF16,
        "checkpoint.interval=2",
        "checkpoint.keep_latest=10",
        "metrics.eval_freq=0",
    ];
    let steps = |n: &'static str| -> Vec<&'static str> {
        set.iter().copied().chain(std::iter::once(n)).collect()
    };
    let (whole, dir) = job.train("whole", &steps("training.steps=4"));
    ok(&whole);
    let want = losses(&dir);
    assert_eq!(want.len(), 4);
    let first = f64::from_bits(want[0]);
    let uniform = 320f64.ln();
    assert!(
        first.is_finite() && first < uniform + 2.0,
        "first loss {first} vs ln(vocab) {uniform}"
    );
    let (half, half_dir) = job.train("half", &steps("training.steps=2"));
    ok(&half);
    let (rest, _) = job.train("half", &steps("training.steps=4"));
    ok(&rest);
    assert_eq!(losses(&half_dir), want, "resumed from the f32 masters");
}
