//! `anneal rl` on 2 MPI ranks (data parallel, one compute thread each) against one process:
//! the same prompts and rollouts, a first-step loss bitwise the single process's, later losses
//! within 1e-4, rollout and trainer log-probabilities still equal (mismatch exactly 0), rank 0
//! alone writing the run's files, and the layouts RL does not run refused in one line.

use anneal_tests::cli as common;

use common::{anneal, anneal_bin, ok, rows, user_error};
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

/// A folder with a tokenizer, the reward and `rl.toml`: 4 synchronous GRPO steps of 4
/// digit-sorting prompts x 4 samples from fresh weights, with a KL penalty and an entropy bonus
/// (which keeps the loss away from 0: on-policy, the advantages of a group cancel).
fn rl_job(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("anneal-rl-dist-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let docs: Vec<String> = (0..200u64)
        .map(|i| {
            let (p, a) = anneal_rl::rollout::digits_sort_task(99, i);
            format!("{p}{a}")
        })
        .collect();
    anneal_data::TextTokenizer::train_bpe_on_texts(&docs, 260)
        .unwrap()
        .save(&dir.join("tokenizer.json"))
        .unwrap();
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
fn rl(n: usize, dir: &Path, run: &str, set: &[&str]) -> (Output, PathBuf) {
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
fn steps(run_dir: &Path) -> Vec<Value> {
    rows(run_dir)
        .into_iter()
        .filter(|r| r["step"].as_u64() > Some(0))
        .collect()
}

/// The rows of `samples.jsonl`.
fn samples(run_dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(run_dir.join("samples.jsonl"))
        .expect("samples.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

#[test]
fn two_ranks_train_like_one_process() {
    let dir = rl_job("ddp");
    let (out, one_dir) = rl(1, &dir, "one", &[]);
    ok(&out);
    let (out, two_dir) = rl(2, &dir, "two", &[]);
    ok(&out);
    let (one, two) = (steps(&one_dir), steps(&two_dir));
    assert_eq!((one.len(), two.len()), (4, 4));
    let loss = |r: &Value| r["loss"].as_f64().expect("loss");
    assert_eq!(
        loss(&one[0]).to_bits(),
        loss(&two[0]).to_bits(),
        "step 1 bitwise"
    );
    assert!(
        loss(&one[0]).abs() > 1e-3,
        "a loss worth comparing: {}",
        one[0]
    );
    for (a, b) in one.iter().zip(&two) {
        let (x, y) = (loss(a), loss(b));
        assert!(
            (x - y).abs() <= 1e-4 * x.abs(),
            "step {}: {x} vs {y}",
            a["step"]
        );
        let (g, h) = (
            a["grad_norm"].as_f64().unwrap(),
            b["grad_norm"].as_f64().unwrap(),
        );
        assert!(
            (g - h).abs() <= 1e-4 * g,
            "step {}: grad norm {g} vs {h}",
            a["step"]
        );
        assert_eq!(b["logprob_mismatch_max"].as_f64(), Some(0.0), "{b}");
        assert_eq!(a["logprob_mismatch_max"].as_f64(), Some(0.0), "{a}");
    }
    // Step 1 rolls out the same prompts with the same weights: the same rewards and samples.
    for key in ["reward_mean", "reward_std", "response_len_mean"] {
        assert_eq!(one[0][key], two[0][key], "{key}");
    }
    let first = |s: Vec<Value>| -> Vec<Value> {
        s.into_iter()
            .filter(|r| r["step"] == 1)
            .map(|r| serde_json::json!([r["prompt_index"], r["completion"], r["reward"]]))
            .collect()
    };
    let (s1, s2) = (first(samples(&one_dir)), first(samples(&two_dir)));
    assert_eq!(s1.len(), 16, "every sample of step 1 is recorded");
    assert_eq!(s1, s2, "step 1's samples");
    // Rank 0 holds the run: checkpoints of steps 2 and 4; rank 1 logs beside it.
    for step in [2, 4] {
        assert!(two_dir.join(format!("checkpoints/step-{step}")).is_dir());
    }
    let rank1 = std::fs::read_to_string(two_dir.join("logs/rank-1.log")).expect("rank 1's log");
    assert!(rank1.contains("rank 1 of 2"), "{rank1}");

    // The 2-rank run resumes from its step-2 checkpoint with the same losses.
    let again = dir.join("two-resumed");
    let copied = Command::new("cp")
        .arg("-r")
        .arg(&two_dir)
        .arg(&again)
        .status()
        .unwrap();
    assert!(copied.success());
    std::fs::remove_dir_all(again.join("checkpoints/step-4")).unwrap();
    let (out, _) = rl(2, &dir, "two-resumed", &[]);
    let stdout = ok(&out);
    assert!(stdout.contains("step 2"), "resumes from step 2: {stdout}");
    let resumed = steps(&again);
    assert_eq!(resumed.len(), 4);
    for (a, b) in two.iter().zip(&resumed) {
        assert_eq!(loss(a).to_bits(), loss(b).to_bits(), "step {}", a["step"]);
    }
}

#[test]
fn layouts_rl_does_not_run_are_user_errors() {
    let dir = rl_job("refused");
    for (set, needles) in [
        (
            "parallelism.dp_shard=2",
            &["parallelism.dp_shard", "FSDP"][..],
        ),
        ("rl.prompts_per_step=3", &["rl.prompts_per_step", "2"][..]),
    ] {
        let (out, _) = rl(2, &dir, "refused", &[set]);
        user_error(&out, needles);
    }
}
