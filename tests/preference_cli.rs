//! Preference tuning (`[preference]`: DPO and SimPO) of the tiny Qwen3 fixture on a synthetic
//! preference set whose chosen answers say "yes" and rejected ones "no":
//! - DPO starts at a zero margin (the policy is its own reference) and raises the
//!   chosen-vs-rejected margin on held-out pairs, which end up all on the chosen side;
//! - a resumed run continues bit for bit (the reference rebuilt from the start);
//! - SimPO (no reference, length-normalized) raises the held-out margin too, and so does DPO
//!   on LoRA adapters (the reference is then the base without them);
//! - two data-parallel ranks, each on whole pairs, follow one process;
//! - data and settings that do not fit are refused by their key.

#[path = "dist_support.rs"]
mod dist_support;
#[path = "sft_support.rs"]
mod sft_support;

use anneal_tests::cli as common;

use common::rows;
use sft_support::{job, train};
use std::path::{Path, PathBuf};

/// 64 pairs: "is A B?" answered "yes, A is B." (chosen) or "no, A is not B." (rejected).
fn pairs(dir: &Path) -> PathBuf {
    let things = [
        "the sky", "a lemon", "the sea", "snow", "grass", "a plum", "coal", "milk",
    ];
    let colors = [
        "blue", "yellow", "green", "white", "black", "red", "grey", "pink",
    ];
    let mut lines = String::new();
    for i in 0..64 {
        let (a, b) = (things[i % 8], colors[(i * 3 + i / 8) % 8]);
        let line = serde_json::json!({
            "prompt": format!("Question {i}: is {a} {b}? Answer:"),
            "chosen": format!(" yes, {a} is {b}."),
            "rejected": format!(" no, {a} is not {b}."),
        });
        lines += &format!("{line}\n");
    }
    let path = dir.join("pairs.jsonl");
    std::fs::write(&path, lines).unwrap();
    path
}

/// The job's config pointed at the pairs, with `extra` overrides.
fn set<'a>(data: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut s = vec![
        data,
        "data.format=\"preference\"",
        "data.pack=false",
        "data.val_fraction=0.25",
        "data.shuffle=true",
        "training.steps=24",
        "metrics.eval_freq=12",
        "metrics.eval_batches=8",
        "optimizer.lr=5e-3",
    ];
    s.extend_from_slice(extra);
    s
}

/// Every held-out margin and accuracy logged, in order.
fn held_out(run: &Path) -> Vec<(f64, f64)> {
    rows(run)
        .iter()
        .filter_map(|r| Some((r["val_margin"].as_f64()?, r["eval_accuracy"].as_f64()?)))
        .collect()
}

#[test]
fn dpo_raises_the_held_out_margin_and_resumes_bit_for_bit() {
    let dir = job("dpo", |s| s);
    let data = format!("data.path=\"{}\"", pairs(&dir).display());
    let dpo = set(
        &data,
        &[
            "preference.loss=\"dpo\"",
            "preference.beta=0.1",
            "checkpoint.interval=12",
        ],
    );
    let run = train(&dir, "dpo", &dpo);
    let all = rows(&run);
    // The first step's policy is its reference: every margin is zero.
    assert_eq!(all[0]["pref_margin"], 0.0, "{}", all[0]);
    let evals = held_out(&run);
    assert_eq!(evals.len(), 2, "{all:?}");
    assert!(evals[0].0 > 0.0 && evals[1].0 > evals[0].0, "{evals:?}");
    assert_eq!(
        evals[1].1, 1.0,
        "every held-out pair on the chosen side: {evals:?}"
    );

    // Resumed from step 12, the same curve.
    let curve = |run: &Path| -> Vec<u64> {
        rows(run)
            .iter()
            .flat_map(|r| ["loss", "pref_margin", "val_margin"].map(|k| r[k].as_f64()))
            .flatten()
            .map(f64::to_bits)
            .collect()
    };
    let want = curve(&run);
    std::fs::remove_dir_all(run.join("checkpoints/step-24")).unwrap();
    let run = train(&dir, "dpo", &dpo);
    assert_eq!(curve(&run), want);

    // SimPO: no reference, length-normalized, with a target margin.
    let simpo = set(
        &data,
        &[
            "preference.loss=\"simpo\"",
            "preference.beta=2.0",
            "preference.gamma=0.5",
        ],
    );
    let evals = held_out(&train(&dir, "simpo", &simpo));
    assert!(evals[1].0 > evals[0].0, "{evals:?}");

    // DPO on LoRA adapters: the reference is the base without them.
    let lora = set(
        &data,
        &[
            "preference.loss=\"dpo\"",
            "lora.rank=4",
            "optimizer.lr=2e-2",
        ],
    );
    let run = train(&dir, "lora", &lora);
    assert_eq!(rows(&run)[0]["pref_margin"], 0.0);
    let evals = held_out(&run);
    assert!(evals[0].0 > 0.0 && evals[1].0 > evals[0].0, "{evals:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn preference_settings_that_do_not_fit_are_refused() {
    let dir = job("dpo-bad", |s| s);
    let data = format!("data.path=\"{}\"", pairs(&dir).display());
    let refused = |set: &[&str], needles: &[&str]| sft_support::refused(&dir, set, needles);
    // Pairs without a preference loss, and a preference loss without pairs.
    refused(&set(&data, &[]), &["`preference.loss`"]);
    refused(
        &["preference.loss=\"dpo\""],
        &["`preference.loss`", "pairs"],
    );
    // A micro-batch must hold whole pairs.
    refused(
        &set(
            &data,
            &[
                "preference.loss=\"dpo\"",
                "training.micro_batch_size=3",
                "training.batch_size=3",
            ],
        ),
        &["`training.micro_batch_size`"],
    );
    refused(
        &set(&data, &["preference.loss=\"dpo\"", "preference.beta=0.0"]),
        &["preference.beta"],
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn two_data_parallel_ranks_tune_on_whole_pairs_as_one_process() {
    let dir = job("dpo-ddp", |s| s);
    let data = format!("data.path=\"{}\"", pairs(&dir).display());
    // The launcher runs the job's config as `tiny.toml`.
    std::fs::copy(dir.join("sft.toml"), dir.join("tiny.toml")).unwrap();
    let job = common::Job { dir: dir.clone() };
    // Micro-batches of 4 rows: each rank takes 2, one whole pair.
    let set = set(
        &data,
        &[
            "preference.loss=\"dpo\"",
            "training.steps=6",
            "metrics.eval_freq=0",
        ],
    );
    let one = train(&dir, "one", &set);
    let two = dir.join("two");
    common::ok(&dist_support::mpiexec_train(2, &job, &two, &set));
    dist_support::assert_follows(&one, &two, 6);
    // One row each would split the pairs.
    let odd = [
        &set[..],
        &["training.micro_batch_size=2", "training.batch_size=2"],
    ]
    .concat();
    let out = dist_support::mpiexec_train(2, &job, &dir.join("odd"), &odd);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("splits a preference pair"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
