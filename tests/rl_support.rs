//! What the RL tests share (a module of each, like `dist_support`): the digit-sorting
//! tokenizer, and the multi-rank tests' job (a length reward and `rl.toml` in a temporary
//! folder, `anneal rl` on one process or under `mpiexec`).

// Each test file uses its own part of these.
#![allow(dead_code)]

use anneal_tests::cli::{anneal, anneal_bin, rows};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Core-module reward (ABI v1): the completion's length in bytes, so a group's rewards differ.
const REWARD_WAT: &str = r#"(module
  (memory (export "memory") 1)
  (global $next (mut i32) (i32.const 1024))
  (func (export "alloc") (param $len i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $next))
    (global.set $next (i32.add (global.get $next) (local.get $len)))
    (local.get $p))
  (func (export "score")
    (param $pp i32) (param $pl i32) (param $cp i32) (param $cl i32) (param $mp i32) (param $ml i32)
    (result f64)
    (f64.convert_i32_u (local.get $cl)))
  (func (export "anneal_reward_abi") (result i32) (i32.const 1)))
"#;

/// An empty folder `<temp>/<name>-<pid>` (what a previous run left there is removed).
pub fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Saves to `path` a byte-level BPE tokenizer of `vocab` tokens fitted on `docs` digit-sorting
/// tasks (prompt and answer) of the demo's generator with `seed`: the RL jobs' tokenizer.
pub fn digits_tokenizer(path: &Path, seed: u64, docs: u64, vocab: usize) {
    let docs: Vec<String> = (0..docs)
        .map(|i| {
            let (p, a) = anneal_rl::rollout::digits_sort_task(seed, i);
            format!("{p}{a}")
        })
        .collect();
    anneal_data::TextTokenizer::train_bpe_on_texts(&docs, vocab)
        .unwrap()
        .save(path)
        .unwrap();
}

/// A folder with a tokenizer, the reward and `rl.toml`: 4 synchronous GRPO steps of 4
/// digit-sorting prompts x 4 samples from fresh weights, with a KL penalty and an entropy bonus
/// (which keeps the loss away from 0: on-policy, the advantages of a group cancel).
pub fn rl_job(name: &str) -> PathBuf {
    let dir = fresh_dir(&format!("anneal-rl-dist-{name}"));
    digits_tokenizer(&dir.join("tokenizer.json"), 99, 200, 260);
    std::fs::write(dir.join("reward.wat"), REWARD_WAT).unwrap();
    let config = format!(
        r#"[job]
name = "rl-dist"
[model]
plugin = "llama"
flavor = "debugmodel"
args = {{ dim = 32, n_layers = 2, n_heads = 2, n_kv_heads = 2, ffn_dim = 64, vocab_size = 272, max_seq_len = 64 }}
[optimizer]
plugin = "adamw"
lr = 1e-2
[lr_scheduler]
warmup_steps = 0
decay = "constant"
[training]
steps = 4
seed = 5
threads = 1
[checkpoint]
interval = 2
[metrics]
log_freq = 1
progress_bar = false
[rl]
tokenizer = "{tok}"
group_size = 4
prompts_per_step = 4
max_new_tokens = 6
rewards = [{{ path = "{reward}", weight = 1.0 }}]
kl_coef = 0.05
entropy_coef = 0.01
max_staleness = 0
rollout_threads = 1
eval_freq = 2
eval_prompts = 8
samples_every = 1
samples_per_step = 16
"#,
        tok = dir.join("tokenizer.json").display(),
        reward = dir.join("reward.wat").display(),
    );
    std::fs::write(dir.join("rl.toml"), config).unwrap();
    dir
}

/// `anneal rl` on `n` ranks (`n = 1`: no mpiexec) in `<dir>/<run>`.
pub fn rl(n: usize, dir: &Path, run: &str, set: &[&str]) -> (Output, PathBuf) {
    let run_dir = dir.join(run);
    let mut c = if n == 1 {
        anneal()
    } else {
        let mut c = anneal_dist::launch::mpiexec_command(n, &anneal_bin(), &[]).expect("mpiexec");
        c.env_remove("ANNEAL_PLUGIN_PATH");
        c
    };
    c.arg("rl")
        .arg(dir.join("rl.toml"))
        .arg("--run-dir")
        .arg(&run_dir);
    for s in set {
        c.args(["--set", s]);
    }
    (c.output().expect("run anneal rl"), run_dir)
}

/// The training rows (those with a loss).
pub fn steps(run_dir: &Path) -> Vec<Value> {
    rows(run_dir)
        .into_iter()
        .filter(|r| r["step"].as_u64() > Some(0))
        .collect()
}

/// The rows of `samples.jsonl`.
pub fn samples(run_dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(run_dir.join("samples.jsonl"))
        .expect("samples.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

/// Step 1's samples of a run as `[prompt_index, completion, reward]`, in the file's order.
pub fn first_step_samples(run_dir: &Path) -> Vec<Value> {
    samples(run_dir)
        .into_iter()
        .filter(|r| r["step"] == 1)
        .map(|r| serde_json::json!([r["prompt_index"], r["completion"], r["reward"]]))
        .collect()
}

/// Copies the finished 4-step run `done` to `<dir>/<run>`, drops its step-4 checkpoint and runs
/// `anneal rl` there again on `n` ranks with `set`: it must resume from step 2. Returns the
/// continued run's training rows (steps 1 and 2 as `done` logged them, then its own).
pub fn resume_copy(n: usize, dir: &Path, done: &Path, run: &str, set: &[&str]) -> Vec<Value> {
    let again = dir.join(run);
    let copied = Command::new("cp")
        .arg("-r")
        .arg(done)
        .arg(&again)
        .status()
        .unwrap();
    assert!(copied.success());
    std::fs::remove_dir_all(again.join("checkpoints/step-4")).unwrap();
    let (out, _) = rl(n, dir, run, set);
    let stdout = anneal_tests::cli::ok(&out);
    assert!(stdout.contains("step 2"), "resumes from step 2: {stdout}");
    let resumed = steps(&again);
    assert_eq!(resumed.len(), 4);
    resumed
}

/// [`resume_copy`], whose every step's loss must be bit for bit what `done` logged.
pub fn resumes_bitwise(n: usize, dir: &Path, done: &Path, run: &str, set: &[&str]) {
    let resumed = resume_copy(n, dir, done, run, set);
    let loss = |r: &Value| r["loss"].as_f64().expect("loss");
    for (a, b) in steps(done).iter().zip(&resumed) {
        assert_eq!(loss(a).to_bits(), loss(b).to_bits(), "step {}", a["step"]);
    }
}

/// `anneal rl` on the digits demo's `config` (relative to the repository root) for three short
/// steps from scratch, with the demo's bytes-only tokenizer and `set` on top: every step's
/// rollout log-probabilities equal the trainer's (mismatch 0).
pub fn digits_without_mismatch(name: &str, config: &Path, set: &[&str]) {
    let dir = fresh_dir(name);
    let tok = dir.join("tokenizer.json");
    digits_tokenizer(&tok, 7, 50, 257);
    let mut c = anneal();
    c.current_dir(anneal_tests::cli::root())
        .arg("rl")
        .arg(config)
        .arg("--run-dir")
        .arg(dir.join("run"));
    let tokenizer = format!("rl.tokenizer=\"{}\"", tok.display());
    let steps = [
        "rl.init_from=\"\"",
        "training.steps=3",
        "rl.prompts_per_step=4",
        "rl.group_size=4",
        "rl.eval_freq=0",
    ];
    for s in steps
        .iter()
        .copied()
        .chain([tokenizer.as_str()])
        .chain(set.iter().copied())
    {
        c.args(["--set", s]);
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = rows(&dir.join("run"));
    let trained: Vec<&Value> = rows.iter().filter(|r| r["loss"].is_number()).collect();
    assert_eq!(trained.len(), 3, "{rows:?}");
    for r in trained {
        assert_eq!(r["logprob_mismatch_max"].as_f64(), Some(0.0), "{r}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
