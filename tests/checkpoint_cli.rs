//! Checkpoints end to end: SIGKILL before, during and after a save, then the same command
//! resumes and the loss curve continues bit for bit; damaged checkpoints are skipped with the
//! reason; retention; a graceful stop saves.

use anneal_tests::cli as common;

use common::{anneal, losses, ok, Job};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

const STEPS: &str = "training.steps=300";

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn sigkill(mut child: Child) {
    child.kill().expect("SIGKILL");
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "the run must have been killed, not finished"
    );
}

fn logged_steps(run_dir: &Path) -> usize {
    std::fs::read_to_string(run_dir.join("metrics.jsonl")).map_or(0, |s| s.lines().count())
}

fn tmp_dirs(ckpt: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(ckpt)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.to_string_lossy().contains(".tmp-"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn sigkill_anywhere_then_the_same_command_continues_bitwise() {
    let job = Job::new("sigkill");
    let set = [
        STEPS,
        "metrics.log_freq=1",
        "metrics.eval_freq=0",
        "checkpoint.interval=30",
    ];
    let (out, reference) = job.train("reference", &set);
    ok(&out);
    let want = losses(&reference);
    assert_eq!(want.len(), 300);

    // Between saves: after step-30 is published, before step-60 is due.
    let a = job.dir.join("between");
    let child = job.spawn(&a, &set, &[]);
    wait_for("step 35 with step-30 published", || {
        logged_steps(&a) >= 35 && a.join("checkpoints/step-30").exists()
    });
    sigkill(child);
    // Mid-write: the writer pauses between the shard and the manifest of step-60.
    let b = job.dir.join("midwrite");
    let pause = [("ANNEAL_TEST_CHECKPOINT_PAUSE_MS", "1500")];
    let child = job.spawn(&b, &set, &pause);
    let ckpt = b.join("checkpoints");
    wait_for("a half-written step-60", || {
        ckpt.join("step-30").exists()
            && tmp_dirs(&ckpt).iter().any(|d| {
                d.to_string_lossy().contains("step-60.tmp-")
                    && d.join("shard-00000-of-00001.safetensors").exists()
            })
    });
    sigkill(child);
    assert!(!ckpt.join("step-60").exists());
    // Right after a publish.
    let c = job.dir.join("afterpublish");
    let child = job.spawn(&c, &set, &[]);
    wait_for("step-60 published", || {
        c.join("checkpoints/step-60").exists()
    });
    sigkill(child);

    // The kill lands after the publish the test waited for; a later save may also have been
    // published before the signal arrived, but never the half-written one.
    for (dir, min_step, max_step) in [(&a, 30, 300), (&b, 30, 30), (&c, 60, 300)] {
        let (out, _) = job.train(dir.file_name().unwrap().to_str().unwrap(), &set);
        let stdout = ok(&out);
        let prefix = format!(
            "resuming from {}",
            dir.join("checkpoints").join("step-").display()
        );
        let from: u64 = stdout
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no resume line in {stdout}"));
        assert!(
            (min_step..=max_step).contains(&from) && from.is_multiple_of(30),
            "{}: resumed from {from}",
            dir.display()
        );
        assert_eq!(
            losses(dir),
            want,
            "{}: the resumed curve differs",
            dir.display()
        );
    }
    assert!(
        tmp_dirs(&ckpt).is_empty(),
        "the incomplete save is cleaned up"
    );
}

/// A finished 12-step run with checkpoints at 3, 6, 9, 12, copied to a fresh run dir.
fn finished_run(job: &Job, name: &str) -> PathBuf {
    let src = job.dir.join("base");
    if !src.exists() {
        let (out, _) = job.train(
            "base",
            &[
                "training.steps=12",
                "checkpoint.interval=3",
                "checkpoint.keep_latest=10",
            ],
        );
        ok(&out);
    }
    let dst = job.dir.join(name);
    let status = std::process::Command::new("cp")
        .arg("-r")
        .arg(&src)
        .arg(&dst)
        .status()
        .unwrap();
    assert!(status.success());
    dst
}

#[test]
fn damaged_checkpoints_are_skipped_with_the_reason() {
    let job = Job::new("corrupt");
    type Damage = fn(&Path);
    let cases: [(&str, Damage, &str); 4] = [
        (
            "flipped",
            |d| {
                let p = d.join("shard-00000-of-00001.safetensors");
                let mut b = std::fs::read(&p).unwrap();
                let mid = b.len() / 2;
                b[mid] ^= 0x40;
                std::fs::write(&p, b).unwrap();
            },
            "checksum mismatch in shard-00000-of-00001.safetensors",
        ),
        (
            "truncated",
            |d| {
                let p = d.join("manifest.json");
                let b = std::fs::read(&p).unwrap();
                std::fs::write(&p, &b[..b.len() / 2]).unwrap();
            },
            "manifest.json is not valid JSON",
        ),
        (
            "version",
            |d| {
                let p = d.join("manifest.json");
                let t = std::fs::read_to_string(&p)
                    .unwrap()
                    .replace("\"format_version\": 1", "\"format_version\": 99");
                std::fs::write(&p, t).unwrap();
            },
            "format version 99",
        ),
        (
            "missing",
            |d| std::fs::remove_file(d.join("shard-00000-of-00001.safetensors")).unwrap(),
            "missing file",
        ),
    ];
    let base_losses = {
        let base = finished_run(&job, "unused");
        losses(&base)
    };
    for (name, damage, reason) in cases {
        let run = finished_run(&job, name);
        damage(&run.join("checkpoints/step-12"));
        let (out, _) = job.train(
            name,
            &[
                "training.steps=12",
                "checkpoint.interval=3",
                "checkpoint.keep_latest=10",
            ],
        );
        let stdout = ok(&out);
        assert!(stdout.contains(reason), "{name}: {stdout}");
        assert!(
            stdout.contains(&format!(
                "resuming from {}",
                run.join("checkpoints/step-9").display()
            )),
            "{name}: {stdout}"
        );
        assert_eq!(
            losses(&run),
            base_losses,
            "{name}: steps 10..12 retrained identically"
        );
    }

    // Nothing usable: a clear error, not a fresh start, unless asked.
    let run = finished_run(&job, "allbad");
    for s in [3, 6, 9, 12] {
        std::fs::write(run.join(format!("checkpoints/step-{s}/manifest.json")), "{").unwrap();
    }
    let (out, _) = job.train("allbad", &["training.steps=12"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("no usable checkpoint") && err.trim().lines().count() == 1,
        "{err}"
    );
    let (out, _) = job.train(
        "allbad",
        &["training.steps=12", "checkpoint.allow_fresh_start=true"],
    );
    assert!(ok(&out).contains("starting fresh"));
}

#[test]
fn keeps_the_newest_and_saves_on_a_graceful_stop() {
    let job = Job::new("retention");
    let (out, run) = job.train(
        "run",
        &[
            "training.steps=8",
            "checkpoint.interval=2",
            "checkpoint.keep_latest=2",
        ],
    );
    ok(&out);
    let mut names: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["step-6", "step-8"]);

    let stop = job.dir.join("stop");
    let child = job.spawn(
        &stop,
        &[
            "training.steps=100000",
            "checkpoint.interval=1000",
            "metrics.log_freq=1",
        ],
        &[],
    );
    wait_for("a few steps", || logged_steps(&stop) >= 5);
    let killed = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    ok(&out);
    let last = losses(&stop).len();
    assert!(
        stop.join(format!("checkpoints/step-{last}/manifest.json"))
            .exists(),
        "saved at the stop (step {last})"
    );
    // Resuming with load_step picks that checkpoint explicitly; an unknown step is an error.
    let (out, _) = job.train(
        "stop",
        &[
            "training.steps=100000",
            &format!("checkpoint.load_step={}", last + 1),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("checkpoint.load_step"));
}

#[test]
fn hugging_face_export_round_trips_into_a_new_run() {
    let job = Job::new("hf");
    let set = [
        "training.steps=6",
        "checkpoint.interval=6",
        "metrics.eval_freq=6",
    ];
    let (out, run) = job.train("run", &set);
    ok(&out);
    let val_at_6 = common::rows(&run)
        .iter()
        .rev()
        .find_map(|r| r["val_loss"].as_f64())
        .expect("a val_loss row");
    let hf = job.dir.join("hf");
    let out = anneal()
        .args(["checkpoint", "export", "--to-hf"])
        .arg(&hf)
        .arg(run.join("checkpoints/step-6"))
        .output()
        .unwrap();
    ok(&out);
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(hf.join(f).is_file(), "{f}");
    }
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "llama");
    assert_eq!(cfg["hidden_size"], 32);
    // A run started from the export with a zero learning rate evaluates exactly as the source did;
    // with no `model.plugin` it runs (and records) the plugin serving the export's model_type.
    let from_hf = format!("checkpoint.init_from_hf=\"{}\"", hf.display());
    let (out, run2) = job.train(
        "fromhf",
        &[
            "training.steps=1",
            "optimizer.lr=0.0",
            "metrics.eval_freq=1",
            "model.plugin=\"\"",
            &from_hf,
        ],
    );
    ok(&out);
    let recorded = std::fs::read_to_string(run2.join("config.toml")).unwrap();
    assert!(recorded.contains("plugin = \"llama\""), "{recorded}");
    let val = common::rows(&run2)
        .iter()
        .find_map(|r| r["val_loss"].as_f64())
        .unwrap();
    assert_eq!(val.to_bits(), val_at_6.to_bits(), "{val} vs {val_at_6}");
    // Every argument comes from config.json, not only the shapes: a checkpoint trained with
    // another rope_theta runs with it, and model.args contradicting it is refused by name.
    let theta = job.dir.join("hf-theta");
    std::fs::create_dir_all(&theta).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(hf.join(f), theta.join(f)).unwrap();
    }
    // The directory's generation settings and tokenizer settings travel to the run's exports.
    let generation = r#"{"max_new_tokens": 7, "eos_token_id": 0}"#;
    let tokenizer_config = r#"{"eos_token": "<|endoftext|>", "chat_template": "{{ messages }}"}"#;
    std::fs::write(theta.join("generation_config.json"), generation).unwrap();
    std::fs::write(theta.join("tokenizer_config.json"), tokenizer_config).unwrap();
    let mut changed = cfg.clone();
    assert_ne!(changed["rope_theta"], 10_000.0);
    changed["rope_theta"] = 10_000.0.into();
    std::fs::write(theta.join("config.json"), changed.to_string()).unwrap();
    let from_theta = format!("checkpoint.init_from_hf=\"{}\"", theta.display());
    let (out, _) = job.train(
        "theta-refused",
        &[
            &from_theta,
            "training.steps=1",
            "model.args.rope_theta=500000.0",
        ],
    );
    let line = common::error_line(&out, 2);
    assert!(
        line.contains("`model.args.rope_theta`") && line.contains("10000"),
        "{line}"
    );
    let (out, run3) = job.train("theta", &[&from_theta, "training.steps=1"]);
    ok(&out);
    let exported = job.dir.join("hf-theta-out");
    let out = anneal()
        .args(["checkpoint", "export", "--to-hf"])
        .arg(&exported)
        .arg(run3.join("checkpoints/step-1"))
        .output()
        .unwrap();
    ok(&out);
    let again: serde_json::Value =
        serde_json::from_slice(&std::fs::read(exported.join("config.json")).unwrap()).unwrap();
    assert_eq!(again["rope_theta"], 10_000.0);
    for (name, text) in [
        ("generation_config.json", generation),
        ("tokenizer_config.json", tokenizer_config),
    ] {
        assert_eq!(
            std::fs::read_to_string(exported.join(name)).unwrap(),
            text,
            "{name}"
        );
    }
    // The tokenizer comes with the weights: a directory without one is refused.
    std::fs::remove_file(theta.join("tokenizer.json")).unwrap();
    let (out, _) = job.train("no-tokenizer", &[&from_theta, "training.steps=1"]);
    let line = common::error_line(&out, 2);
    assert!(
        line.contains("checkpoint.init_from_hf") && line.contains("tokenizer.json"),
        "{line}"
    );
    // The exported directory serves inference too.
    let out = anneal()
        .args(["logprobs", "--model-dir"])
        .arg(&hf)
        .args(["--tokens", "5,6,7"])
        .output()
        .unwrap();
    let by_dir = ok(&out);
    // A model id resolves in the local Hugging Face cache (huggingface_hub's layout).
    let hf_home = job.dir.join("hf-home");
    let repo = hf_home.join("hub/models--acme--tiny");
    let snapshot = repo.join("snapshots/c0ffee");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "c0ffee\n").unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(hf.join(f), snapshot.join(f)).unwrap();
    }
    let with_cache = |args: &[&str]| {
        let mut c = anneal();
        c.env("HF_HOME", &hf_home)
            .env_remove("HF_HUB_CACHE")
            .args(args);
        c.output().unwrap()
    };
    let by_id = with_cache(&["logprobs", "--model-dir", "acme/tiny", "--tokens", "5,6,7"]);
    assert_eq!(ok(&by_id), by_dir);
    let config = job.config().display().to_string();
    let from_id = job.dir.join("from-id");
    let out = with_cache(&[
        "train",
        &config,
        "--run-dir",
        &from_id.display().to_string(),
        "--set",
        "checkpoint.init_from_hf=\"acme/tiny@main\"",
        "--set",
        "training.steps=1",
        "--set",
        "optimizer.lr=0.0",
        "--set",
        "metrics.eval_freq=1",
    ]);
    ok(&out);
    let val = common::rows(&from_id)
        .iter()
        .find_map(|r| r["val_loss"].as_f64())
        .unwrap();
    assert_eq!(val.to_bits(), val_at_6.to_bits());
    let out = with_cache(&["logprobs", "--model-dir", "acme/missing", "--tokens", "5"]);
    let line = common::error_line(&out, 2);
    assert!(
        line.contains("huggingface-cli download acme/missing"),
        "{line}"
    );
    // Not a checkpoint: a clear error.
    let out = anneal()
        .args(["checkpoint", "export", "--to-hf"])
        .arg(job.dir.join("x"))
        .arg(&hf)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("manifest.json"));
}
