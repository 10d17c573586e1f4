//! What `anneal train` and `anneal rl` refuse before they start, and what a refused start
//! leaves: the model's context, the device, the data, configs that would train nothing
//! (`rl.group_size = 1`, a DeepSeek-V3 without an MoE layer), each one error line naming the
//! key with exit code 2, and no new run directory (nor anything removed from an old one).

mod rl_support;

use anneal_tests::cli::{anneal, ok, rows, user_error, Job};
use std::path::{Path, PathBuf};
use std::process::Output;

/// `anneal <cmd> <config> --run-dir <run_dir> --set ...` to its end.
fn run(cmd: &str, config: &Path, run_dir: &Path, set: &[&str]) -> Output {
    let mut c = anneal();
    c.arg(cmd).arg(config).arg("--run-dir").arg(run_dir);
    for s in set {
        c.args(["--set", s]);
    }
    c.output().expect("run anneal")
}

/// Whether `anneal info` finds a usable CUDA device 0 here (then `job.device = "cuda"` runs).
fn has_gpu() -> bool {
    let out = anneal().arg("info").output().expect("anneal info");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.starts_with("cuda backend:") && l.contains(" on ") && !l.contains('('))
}

#[test]
fn the_run_refuses_up_front_naming_the_key_and_leaves_no_run_dir() {
    let job = Job::new("preflight");
    let config = job.config();
    // `runs/` does not exist yet: a refused start makes neither it nor the run dir.
    let runs = job.dir.join("runs");
    let refused = |set: &[&str], words: &[&str]| {
        let run_dir = runs.join("r");
        user_error(&run("train", &config, &run_dir, set), words);
        assert!(!runs.exists(), "{set:?} left {}", runs.display());
    };
    // The tiny model has 64 positions.
    refused(
        &["training.seq_len=128"],
        &["`training.seq_len`", "128", "max_seq_len 64"],
    );
    refused(
        &["data.path=\"/nonexistent/corpus\""],
        &["`data.path`", "/nonexistent/corpus"],
    );
    refused(&["model.plugin=\"nope\""], &["`model.plugin`", "nope"]);
    refused(&["model.flavor=\"huge\""], &["`model.flavor`", "huge"]);
    refused(
        &["model.args.norm_eps=-1e-5"],
        &["`model.args.norm_eps`", "llama"],
    );
    refused(&["optimizer.plugin=\"nope\""], &["`optimizer.plugin`"]);
    // Packing is for chat data: text is already packed into windows.
    refused(&["data.pack=true"], &["`data.pack`", "chat data"]);
    refused(&["job.device=\"cuda:99\""], &["`job.device`", "cuda:99"]);
    if !has_gpu() {
        refused(&["job.device=\"cuda\""], &["`job.device`", "cuda"]);
    }
    // A JSON Lines corpus whose documents lack the configured field.
    let jsonl = job.dir.join("docs.jsonl");
    std::fs::write(&jsonl, "{\"body\": \"the king speaks\"}\n").unwrap();
    let path = format!("data.path=\"{}\"", jsonl.display());
    refused(&[&path], &["`data.path`", "docs.jsonl:1", "\"text\""]);
}

#[test]
fn a_start_refused_later_takes_back_what_it_made_and_only_that() {
    let job = Job::new("refused-later");
    // The first line is fine, a later one is not: only reading the corpus finds it, after the
    // run dir was taken.
    let corpus = job.dir.join("bad.jsonl");
    let mut text = "{\"text\": \"the king speaks of the sea\"}\n".repeat(50);
    text.push_str("not json\n");
    std::fs::write(&corpus, text).unwrap();
    let data = format!("data.path=\"{}\"", corpus.display());
    let new_dir = job.dir.join("runs/new");
    let out = run("train", &job.config(), &new_dir, &[&data]);
    user_error(&out, &["bad.jsonl:51"]);
    assert!(
        !job.dir.join("runs").exists(),
        "the new run dir and runs/ are gone"
    );
    // A run dir that was there keeps all it had (and its own lock file).
    let old = job.dir.join("old");
    ok(&run("train", &job.config(), &old, &["training.steps=1"]));
    let before = listing(&old);
    user_error(
        &run("train", &job.config(), &old, &[&data]),
        &["bad.jsonl:51"],
    );
    assert_eq!(listing(&old), before);
}

/// Every path under `dir`, sorted.
fn listing(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p.clone());
            }
            out.push(p);
        }
    }
    out.sort();
    out
}

#[test]
fn a_deepseek_without_an_moe_layer_is_refused_unless_its_dense_blocks_are_listed() {
    let job = Job::new("dense-deepseek");
    let args = anneal_tests::tiny::DEEPSEEK_V3;
    let config = job.config_with_model("ds", "deepseek_v3", args);
    let runs = job.dir.join("runs");
    let out = run(
        "train",
        &config,
        &runs.join("a"),
        &["model.args.first_k_dense=2"],
    );
    user_error(
        &out,
        &["`model.args.first_k_dense`", "no MoE layer", "dense_layers"],
    );
    assert!(!runs.exists());
    // Meant: every block listed as dense trains.
    ok(&run(
        "train",
        &config,
        &runs.join("b"),
        &[
            "model.args.first_k_dense=2",
            "model.args.dense_layers=[0, 1]",
            "training.steps=1",
        ],
    ));
}

#[test]
fn rl_refuses_a_group_of_one() {
    let job = Job::new("rl-group");
    let runs = job.dir.join("runs");
    let out = run(
        "rl",
        &job.config(),
        &runs.join("a"),
        &["rl.group_size=1", "rl.loss=\"dr_grpo\""],
    );
    user_error(&out, &["`rl.group_size`", "dr_grpo", "advantage is 0"]);
    assert!(!runs.exists());
}

#[test]
fn rl_prompts_too_long_for_the_context_are_refused_by_line_or_skipped_and_counted() {
    let dir = rl_support::rl_job("long-prompts");
    // 40 prompts; line 30 alone (80 characters, no merge covers them) fills more than the
    // tiny model's 64 positions.
    let prompts = dir.join("prompts.jsonl");
    let lines: Vec<String> = (1..=40)
        .map(|i| match i {
            30 => format!("{{\"prompt\":\"{}\"}}", "xyz ".repeat(20)),
            _ => format!("{{\"prompt\":\"{}=\"}}", 100 + i),
        })
        .collect();
    std::fs::write(&prompts, lines.join("\n")).unwrap();
    let path = format!("rl.prompts_path=\"{}\"", prompts.display());
    let config = dir.join("rl.toml");
    let run_dir = dir.join("runs/a");
    let out = run("rl", &config, &run_dir, &[&path]);
    user_error(
        &out,
        &[
            "`rl.prompts_path`",
            "prompts.jsonl line 30",
            "rl.skip_long_prompts",
        ],
    );
    assert!(!dir.join("runs").exists());
    // Skipped: said once at the start and counted in every row.
    let set = [
        path.as_str(),
        "rl.skip_long_prompts=true",
        "training.steps=2",
    ];
    let stdout = ok(&run("rl", &config, &run_dir, &set));
    assert_eq!(
        stdout.matches("skipping 1 prompt(s)").count(),
        1,
        "{stdout}"
    );
    let rows = rows(&run_dir);
    assert!(rows.len() >= 2);
    assert!(rows.iter().all(|r| r["prompts_skipped"] == 1), "{rows:?}");

    // Held-out prompts from a file of their own (`rl.eval_prompts_path`): one too long is
    // refused by its line, since evaluation cannot skip it.
    let eval = dir.join("eval.jsonl");
    std::fs::write(&eval, lines[25..31].join("\n")).unwrap();
    let eval_path = format!("rl.eval_prompts_path=\"{}\"", eval.display());
    let fresh = dir.join("runs/b");
    let out = run("rl", &config, &fresh, &[&eval_path]);
    user_error(&out, &["`rl.eval_prompts_path`", "eval.jsonl line 5"]);
    // Three held-out prompts: eval_accuracy counts whole prompts of three.
    std::fs::write(&eval, lines[0..3].join("\n")).unwrap();
    ok(&run(
        "rl",
        &config,
        &fresh,
        &[&eval_path, "training.steps=2"],
    ));
    let evals: Vec<f64> = anneal_tests::cli::rows(&fresh)
        .iter()
        .filter_map(|r| r["eval_accuracy"].as_f64())
        .collect();
    assert!(!evals.is_empty());
    for a in evals {
        assert!(((a * 3.0) - (a * 3.0).round()).abs() < 1e-9, "{a}");
    }
}
