//! What every `anneal rl` layout test asserts of a layout against one process, and of
//! checkpoints moved between the two. Included as a module beside `dist_support` and
//! `rl_support`.

#![allow(dead_code)]

use crate::dist_support::follows_single;
use crate::rl_support::{first_step_samples, resume_copy, resumes_bitwise, steps};
use serde_json::Value;
use std::path::Path;

/// A numeric field of a row.
pub fn field(r: &Value, key: &str) -> f64 {
    r[key].as_f64().unwrap_or_else(|| panic!("{key} in {r}"))
}

/// The losses of training rows.
pub fn losses(rows: &[Value]) -> Vec<f64> {
    rows.iter().map(|r| field(r, "loss")).collect()
}

/// Every row's rollouts were scored by the trainer with exactly their own logprobs.
pub fn mismatch_zero(name: &str, rows: &[Value]) {
    for r in rows {
        assert_eq!(r["logprob_mismatch_max"].as_f64(), Some(0.0), "{name}: {r}");
    }
}

/// Asserts that the 4-step run in `run_dir` (laid out as `name`) follows the one-process run in
/// `one_dir`: the lead rank alone wrote 4 rows, every rollout's logprobs are the trainer's
/// (mismatch exactly 0), step 1's loss is one process's bit for bit where `step1_bitwise` (the
/// same policy and the same samples; later steps sum gradients in another order) and within
/// 1e-6 relative otherwise, the losses follow within 1e-4 relative, the gradient norms within
/// `norm_tol` relative, and step 1 sampled the same completions. Returns both runs' rows.
pub fn follows_one_process(
    name: &str,
    one_dir: &Path,
    run_dir: &Path,
    (step1_bitwise, norm_tol): (bool, f64),
) -> (Vec<Value>, Vec<Value>) {
    let (one, other) = (steps(one_dir), steps(run_dir));
    assert_eq!(
        (one.len(), other.len()),
        (4, 4),
        "{name}: the lead rank alone writes rows"
    );
    mismatch_zero("one process", &one);
    mismatch_zero(name, &other);
    let (a, b) = (losses(&one), losses(&other));
    assert!(a[0].abs() > 1e-3, "a loss worth comparing");
    if step1_bitwise {
        assert_eq!(
            a[0].to_bits(),
            b[0].to_bits(),
            "{name} step 1: {} vs {}",
            b[0],
            a[0]
        );
    }
    follows_single(name, &a, &b);
    for (x, y) in one.iter().zip(&other) {
        let (g, h) = (field(x, "grad_norm"), field(y, "grad_norm"));
        assert!(
            (g - h).abs() <= norm_tol * g,
            "{name} step {}: grad norm {h} vs {g}",
            x["step"]
        );
    }
    assert_eq!(
        first_step_samples(one_dir),
        first_step_samples(run_dir),
        "{name}: step 1's samples"
    );
    (one, other)
}

/// The checkpoints of `layout` (on `n` ranks with `set`) and of one process move between
/// them: `layout` resumes its own step-2 checkpoint bit for bit, and a run continued from the
/// other's checkpoint starts step 3 from the saved bits (bitwise the run that wrote it), follows
/// it after, and keeps the mismatch at 0.
pub fn checkpoints_move(
    dir: &Path,
    one_dir: &Path,
    layout_dir: &Path,
    (n, name, set): (usize, &str, &[&str]),
) {
    resumes_bitwise(n, dir, layout_dir, &format!("{name}-again"), set);
    for (n, done, set, run) in [
        (1, layout_dir, &[][..], format!("{name}-to-one")),
        (n, one_dir, set, format!("one-to-{name}")),
    ] {
        let resumed = resume_copy(n, dir, done, &run, set);
        let before = steps(done);
        assert_eq!(
            field(&before[2], "loss").to_bits(),
            field(&resumed[2], "loss").to_bits(),
            "{run}: step 3"
        );
        follows_single(&run, &losses(&before), &losses(&resumed));
        mismatch_zero(&run, &resumed[2..]);
    }
}
