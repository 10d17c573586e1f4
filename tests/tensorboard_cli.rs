//! TensorBoard event files beside `metrics.jsonl`, read back by TensorBoard's own reader
//! (`tests/tensorboard_read.py`, the `tensorboard` package in `.venv`): every numeric field of
//! every row is a scalar of the same name at the row's step, with the row's value (as the f32
//! TensorBoard stores), and a resumed run adds a file whose scalars continue the curve.

use anneal_tests::cli::{ok, rows, Job};
use anneal_tests::serve::repo;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// Every scalar TensorBoard reads in `run_dir`: (tag, step) → (value, wall time).
fn tensorboard_scalars(run_dir: &Path) -> BTreeMap<(String, u64), (f64, f64)> {
    let py = repo().join(".venv/bin/python");
    let out = Command::new(&py)
        .arg(repo().join("tests/tensorboard_read.py"))
        .arg(run_dir)
        .output()
        .unwrap_or_else(|e| panic!("run {} (scripts/setup-python.sh): {e}", py.display()));
    assert!(
        out.status.success(),
        "TensorBoard's reader failed (is tensorboard in .venv? run scripts/setup-python.sh):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut scalars = BTreeMap::new();
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        let e: serde_json::Value = serde_json::from_str(line).unwrap();
        let key = (
            e["tag"].as_str().unwrap().to_string(),
            e["step"].as_u64().unwrap(),
        );
        let value = (
            e["value"].as_f64().unwrap(),
            e["wall_time"].as_f64().unwrap(),
        );
        assert!(
            scalars.insert(key.clone(), value).is_none(),
            "{key:?} twice"
        );
    }
    scalars
}

/// Every numeric field of `metrics.jsonl` but `step` / `wall_time`, keyed as TensorBoard's.
fn jsonl_scalars(run_dir: &Path) -> BTreeMap<(String, u64), (f64, f64)> {
    let mut scalars = BTreeMap::new();
    for row in rows(run_dir) {
        let step = row["step"].as_u64().unwrap();
        let wall = row["wall_time"].as_f64().expect("every row has wall_time");
        for (key, value) in row.as_object().unwrap() {
            if let (Some(v), false) = (value.as_f64(), key == "step" || key == "wall_time") {
                scalars.insert((key.clone(), step), (v, wall));
            }
        }
    }
    scalars
}

#[test]
fn tensorboard_reads_the_same_scalars_as_metrics_jsonl_across_a_resume() {
    let job = Job::new("tensorboard");
    let (out, run_dir) = job.train(
        "run",
        &[
            "training.steps=4",
            "checkpoint.interval=4",
            "metrics.eval_freq=2",
        ],
    );
    ok(&out);
    let (out, _) = job.train(
        "run",
        &[
            "training.steps=8",
            "checkpoint.interval=4",
            "metrics.eval_freq=2",
        ],
    );
    ok(&out);
    let files = std::fs::read_dir(&run_dir)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().starts_with("events.out.tfevents.")
        })
        .count();
    assert_eq!(files, 2, "one event file per process that wrote the run");
    let board = tensorboard_scalars(&run_dir);
    let jsonl = jsonl_scalars(&run_dir);
    let tags: Vec<_> = jsonl.keys().map(|(t, _)| t.as_str()).collect();
    for tag in [
        "loss",
        "grad_norm",
        "lr",
        "val_loss",
        "tokens_per_s",
        "time",
    ] {
        assert!(tags.contains(&tag), "{tag} in metrics.jsonl");
    }
    assert_eq!(
        board.keys().collect::<Vec<_>>(),
        jsonl.keys().collect::<Vec<_>>(),
        "the same (tag, step) pairs"
    );
    let steps: Vec<u64> = board
        .keys()
        .filter(|(t, _)| t == "loss")
        .map(|k| k.1)
        .collect();
    assert_eq!(
        steps,
        (1..=8).collect::<Vec<_>>(),
        "the resumed run continues the curve"
    );
    for (key, (value, wall)) in &jsonl {
        let (seen, seen_wall) = board[key];
        // Compared as f32 (what TensorBoard stores): JSON's decimal text may round either
        // way by one f64 ulp, never by an f32 one.
        assert_eq!(
            seen as f32, *value as f32,
            "{key:?}: TensorBoard stores f32"
        );
        assert!(
            (seen_wall - wall).abs() < 5.0,
            "{key:?}: wall time {seen_wall} vs {wall}"
        );
    }
}
