//! `anneal train` end to end on a tiny Llama and a tiny corpus written here: metrics keys,
//! bitwise determinism, gradient accumulation, one-line errors with exit code 2, the non-finite
//! guard, and a graceful stop on SIGTERM.

use anneal_tests::cli as common;

use common::{anneal, losses, ok, rows, Job};
use std::process::{Output, Stdio};

#[test]
fn trains_and_writes_every_metric_key() {
    let job = Job::new("keys");
    let (out, run_dir) = job.train("run", &[]);
    ok(&out);
    let rows = rows(&run_dir);
    let train_rows: Vec<_> = rows.iter().filter(|r| r.get("loss").is_some()).collect();
    assert_eq!(train_rows.len(), 8, "log_freq = 1 gives a row per step");
    for r in &train_rows {
        for key in [
            "step",
            "loss",
            "grad_norm",
            "lr",
            "tokens_per_s",
            "mfu",
            "mem_peak_bytes",
            "time",
        ] {
            assert!(
                r.get(key).is_some_and(|v| v.is_number()),
                "{key} missing in {r}"
            );
        }
    }
    let val: Vec<f64> = rows.iter().filter_map(|r| r["val_loss"].as_f64()).collect();
    assert_eq!(val.len(), 2, "eval_freq = 4 over 8 steps");
    let first = train_rows[0]["loss"].as_f64().unwrap();
    let last = train_rows[7]["loss"].as_f64().unwrap();
    assert!(
        first > 5.0 && first < 6.5,
        "starts near ln(320) = 5.77: {first}"
    );
    assert!(last < first - 0.5, "loss falls: {first} -> {last}");
    // The warmup reaches the peak at step 2, then cosine decays towards 0.1 × peak.
    assert_eq!(train_rows[0]["lr"].as_f64(), Some(5e-3));
    assert_eq!(train_rows[1]["lr"].as_f64(), Some(1e-2));
    assert!((train_rows[7]["lr"].as_f64().unwrap() - 1e-3).abs() < 1e-12);
    // The run dir keeps the resolved config, which is what `config show` prints.
    let shown = anneal()
        .args(["config", "show"])
        .arg(job.config())
        .output()
        .unwrap();
    ok(&shown);
    assert_eq!(
        std::fs::read_to_string(run_dir.join("config.toml")).unwrap(),
        String::from_utf8(shown.stdout).unwrap()
    );
}

#[test]
fn same_seed_gives_bitwise_identical_losses() {
    let job = Job::new("determinism");
    let (a, dir_a) = job.train("a", &[]);
    let (b, dir_b) = job.train("b", &["training.threads=1"]);
    let (c, dir_c) = job.train("c", &["training.seed=8"]);
    ok(&a);
    ok(&b);
    ok(&c);
    assert_eq!(losses(&dir_a).len(), 8);
    assert_eq!(
        losses(&dir_a),
        losses(&dir_b),
        "same seed, 1 thread vs all threads"
    );
    assert_ne!(
        losses(&dir_a),
        losses(&dir_c),
        "another seed trains differently"
    );
}

#[test]
fn gradient_accumulation_matches_the_full_batch() {
    let job = Job::new("accum");
    let (full, dir_full) = job.train("full", &["training.steps=3"]);
    let (acc, dir_acc) = job.train("acc", &["training.steps=3", "training.micro_batch_size=1"]);
    ok(&full);
    ok(&acc);
    let f: Vec<f64> = losses(&dir_full).into_iter().map(f64::from_bits).collect();
    let a: Vec<f64> = losses(&dir_acc).into_iter().map(f64::from_bits).collect();
    for (x, y) in f.iter().zip(&a) {
        assert!(
            (x - y).abs() < 1e-4,
            "full batch {f:?} vs 4 micro-batches {a:?}"
        );
    }
}

fn user_error(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn bad_configs_fail_with_one_line_and_exit_code_2() {
    let job = Job::new("errors");
    let cases: [(&[&str], &str); 5] = [
        (&["training.stepz=3"], "training.stepz"),
        (&["training.steps=\"many\""], "training.steps"),
        (&["model.plugin=\"nosuch\""], "nosuch"),
        (
            &["data.path=\"/nonexistent/corpus\""],
            "/nonexistent/corpus",
        ),
        (&["model.args.vocab_size=100"], "model.args.vocab_size"),
    ];
    for (set, needle) in cases {
        let (out, run_dir) = job.train("bad", set);
        let err = user_error(&out);
        assert!(err.contains(needle), "{set:?}: {err}");
        assert!(!run_dir.join("metrics.jsonl").exists() || rows(&run_dir).is_empty());
    }
    let bad_file = job.dir.join("bad.toml");
    std::fs::write(&bad_file, "[training]\nsteps = 3\nlearning_rate = 1\n").unwrap();
    let out = anneal().arg("train").arg(&bad_file).output().unwrap();
    let err = user_error(&out);
    assert!(
        err.contains("training.learning_rate") && err.contains("bad.toml"),
        "{err}"
    );
    let out = anneal()
        .args(["config", "show"])
        .arg(&bad_file)
        .output()
        .unwrap();
    user_error(&out);
}

#[test]
fn non_finite_loss_stops_with_a_clear_message() {
    let job = Job::new("nan");
    let (out, run_dir) = job.train(
        "run",
        &[
            "optimizer.lr=1e30",
            "lr_scheduler.warmup_steps=0",
            "training.max_grad_norm=0.0",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(
        err.contains("stopping") && !err.contains("panicked"),
        "{err}"
    );
    let logged = losses(&run_dir);
    assert!(
        logged.iter().all(|l| f64::from_bits(*l).is_finite()),
        "only finite steps are logged"
    );
}

#[test]
fn sigterm_stops_after_the_current_step() {
    let job = Job::new("sigterm");
    let run_dir = job.dir.join("run");
    let child = anneal()
        .arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(&run_dir)
        .args(["--set", "training.steps=100000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = run_dir.join("metrics.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while std::fs::read_to_string(&metrics).map_or(true, |s| s.lines().count() < 2) {
        assert!(
            std::time::Instant::now() < deadline,
            "no metrics after 120 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    ok(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("stop requested"), "{stdout}");
    assert!(losses(&run_dir).len() < 100000);
}

#[test]
fn json_lines_train_through_the_configured_text_field() {
    let job = Job::new("field");
    // The tiny corpus's lines as JSON records whose text is under `body` (no `text` field).
    let dir = job.dir.join("records");
    std::fs::create_dir_all(&dir).unwrap();
    let mut lines = String::new();
    for f in ["doc0.txt", "doc1.txt"] {
        let text = std::fs::read_to_string(job.dir.join("corpus").join(f)).unwrap();
        for chunk in text.lines().collect::<Vec<_>>().chunks(20) {
            lines.push_str(&serde_json::json!({ "id": f, "body": chunk.join("\n") }).to_string());
            lines.push('\n');
        }
    }
    std::fs::write(dir.join("records.jsonl"), lines).unwrap();
    let path = format!("data.path={:?}", dir.display().to_string());
    let (out, run_dir) = job.train(
        "body",
        &[&path, "data.text_field=\"body\"", "training.steps=3"],
    );
    ok(&out);
    assert_eq!(losses(&run_dir).len(), 3);
    // The default field is missing from these records: a clear error naming it.
    let (out, _) = job.train("text", &[&path, "training.steps=3"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("\"text\"") || err.contains("`text`"), "{err}");
}
