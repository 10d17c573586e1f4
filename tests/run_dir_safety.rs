//! Nothing a user owns is lost or silently changed: one process per run directory (an OS lock
//! that `kill -9` does not leave behind), a refused resume that changes no file, resumes on
//! another tokenizer or corpus refused unless allowed, exports that never overwrite without
//! `--force`, and a failed save that fails the run.

use anneal_tests::cli::{anneal, ok, root, rows, Job};
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

/// Waits until `run_dir/run.lock` names `pid` (the process holds the run) and the run has
/// logged a step.
fn wait_for_holder(run_dir: &Path, pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let lock = run_dir.join("run.lock");
    let holds = || {
        std::fs::read_to_string(&lock)
            .ok()
            .map(|s| s.trim().to_string())
            == Some(pid.to_string())
    };
    let logged = || {
        std::fs::read_to_string(run_dir.join("metrics.jsonl")).is_ok_and(|t| t.contains("\"step\""))
    };
    while !(holds() && logged()) {
        assert!(Instant::now() < deadline, "{pid} never held the run");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// Asserts exit code 2 with one `error:` line containing `needle`.
fn refused(out: &Output, needle: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no error line in: {err}"));
    assert!(line.contains(needle), "{needle:?} not in {line:?}");
}

#[test]
fn a_held_run_dir_refuses_a_second_writer_and_kill_9_leaves_no_stale_lock() {
    let job = Job::new("lock");
    let run_dir = job.dir.join("run");
    let mut first = job.spawn(
        &run_dir,
        &["training.steps=1000000", "checkpoint.interval=0"],
        &[],
    );
    wait_for_holder(&run_dir, first.id());

    let (second, _) = job.train("run", &["training.steps=2"]);
    refused(&second, &format!("in use by process {}", first.id()));
    // `anneal rl` is refused the same way, before it loads anything.
    let wat = root().join("reward-wasm/examples/exact_match/reward.wat");
    let rewards = format!(
        "rl.rewards=[{{ path = \"{}\", weight = 1.0 }}]",
        wat.display()
    );
    let rl = anneal()
        .arg("rl")
        .arg(job.config())
        .arg("--run-dir")
        .arg(&run_dir)
        .args(["--set", &rewards])
        .output()
        .unwrap();
    refused(&rl, &format!("in use by process {}", first.id()));
    let config = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
    assert!(
        config.contains("steps = 1000000"),
        "the refused processes left the holder's config alone"
    );

    first.kill().unwrap(); // SIGKILL: no chance to clean up
    first.wait().unwrap();
    let (after, _) = job.train("run", &["training.steps=2"]);
    ok(&after);
}

#[test]
fn a_refused_resume_changes_no_file_of_the_run() {
    let job = Job::new("refused");
    let (out, run_dir) = job.train("run", &[]);
    ok(&out);
    let files = ["config.toml", "tokenizer.json", "metrics.jsonl"];
    let before: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(run_dir.join(f)).unwrap())
        .collect();
    // Another vocabulary: a new tokenizer is trained, and the checkpoint refuses it.
    let (out, _) = job.train("run", &["data.vocab_size=300", "training.steps=12"]);
    refused(&out, "another tokenizer");
    for (f, old) in files.iter().zip(&before) {
        assert_eq!(
            &std::fs::read(run_dir.join(f)).unwrap(),
            old,
            "{f} changed by a refused resume"
        );
    }
}

/// A job whose tokenizer is a fixed file (copied from a first run), so the corpus can change
/// without the tokenizer changing.
fn job_with_fixed_tokenizer(name: &str) -> (Job, String) {
    let job = Job::new(name);
    let (out, first) = job.train("first", &["training.steps=1"]);
    ok(&out);
    let tok = job.dir.join("tokenizer.json");
    std::fs::copy(first.join("tokenizer.json"), &tok).unwrap();
    (job, format!("data.tokenizer=\"{}\"", tok.display()))
}

#[test]
fn resuming_on_another_corpus_is_refused_unless_allowed() {
    let (job, tokenizer) = job_with_fixed_tokenizer("corpus");
    let (out, run_dir) = job.train("run", &[&tokenizer, "checkpoint.interval=4"]);
    ok(&out);
    std::fs::write(
        job.dir.join("corpus/extra.txt"),
        "a new play about the sea and a storm.\n".repeat(200),
    )
    .unwrap();
    let steps = "training.steps=10";
    let (out, _) = job.train("run", &[&tokenizer, steps]);
    refused(&out, "another data");
    assert!(stderr(&out).contains("checkpoint.allow_data_change"));
    let (out, _) = job.train(
        "run",
        &[&tokenizer, steps, "checkpoint.allow_data_change=true"],
    );
    ok(&out);
    assert_eq!(rows(&run_dir).last().unwrap()["step"].as_u64(), Some(10));
}

#[test]
fn resuming_with_another_tokenizer_is_refused_unless_allowed() {
    let (job, tokenizer) = job_with_fixed_tokenizer("tokenizer");
    let (out, run_dir) = job.train("run", &[&tokenizer]);
    ok(&out);
    // Same vocabulary size, other merges: the shapes fit, the tokens do not.
    let docs: Vec<String> = (0..50)
        .map(|i| format!("zebra {i} quartz jumps over {} lazy dogs\n", i * 7).repeat(20))
        .collect();
    let other = job.dir.join("other-tokenizer.json");
    anneal_data::TextTokenizer::train_bpe_on_texts(&docs, 320)
        .unwrap()
        .save(&other)
        .unwrap();
    let other_set = format!("data.tokenizer=\"{}\"", other.display());
    let steps = "training.steps=10";
    let (out, _) = job.train("run", &[&other_set, steps]);
    refused(&out, "another tokenizer");
    let kept = std::fs::read(run_dir.join("tokenizer.json")).unwrap();
    assert_eq!(kept, std::fs::read(job.dir.join("tokenizer.json")).unwrap());
    let (out, _) = job.train(
        "run",
        &[
            &other_set,
            steps,
            "checkpoint.allow_tokenizer_change=true",
            "checkpoint.allow_data_change=true",
        ],
    );
    ok(&out);
    // The run now trains with (and keeps) the other tokenizer.
    assert_eq!(
        std::fs::read(run_dir.join("tokenizer.json")).unwrap(),
        std::fs::read(&other).unwrap()
    );
}

#[test]
fn export_never_overwrites_without_force() {
    let job = Job::new("export");
    let (out, run_dir) = job.train("run", &[]);
    ok(&out);
    let step = run_dir.join("checkpoints/step-8");
    let hf = job.dir.join("hf");
    let export = |force: bool| {
        let mut c = anneal();
        c.args(["checkpoint", "export", "--to-hf"])
            .arg(&hf)
            .arg(&step);
        if force {
            c.arg("--force");
        }
        c.output().unwrap()
    };
    ok(&export(false));
    std::fs::write(hf.join("config.json"), "mine").unwrap();
    let again = export(false);
    refused(&again, "config.json exists; pass --force");
    assert_eq!(std::fs::read(hf.join("config.json")).unwrap(), b"mine");
    ok(&export(true));
    assert_ne!(std::fs::read(hf.join("config.json")).unwrap(), b"mine");
}

#[test]
fn a_failed_save_fails_the_run_with_exit_code_1() {
    let job = Job::new("save-fails");
    let run_dir = job.dir.join("run");
    std::fs::create_dir_all(&run_dir).unwrap();
    // A file where the checkpoints folder should be: every save fails in the OS.
    std::fs::write(run_dir.join("checkpoints"), "not a folder").unwrap();
    for (mode, stopped_by) in [("true", 4), ("false", 2)] {
        let _ = std::fs::remove_file(run_dir.join("metrics.jsonl"));
        let (out, _) = job.train(
            "run",
            &["checkpoint.interval=2", &format!("checkpoint.async={mode}")],
        );
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "async={mode}: {err}");
        assert!(err.contains("saving step 2 failed"), "async={mode}: {err}");
        // The run stops as soon as the failure is known (at the next save when saving in the
        // background), instead of training on unsaved.
        let last = rows(&run_dir).last().unwrap()["step"].as_u64().unwrap();
        assert_eq!(last, stopped_by, "async={mode}");
    }
}
