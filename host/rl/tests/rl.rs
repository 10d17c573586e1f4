//! RL end to end on a tiny Llama: every metric key, bitwise parity of rollout and trainer
//! logprobs in synchronous mode (and a perturbation that breaks it), failing rewards counted
//! without stopping the run, the staleness bound with asynchronous workers, and a stop request
//! that saves a checkpoint the same run continues from bit for bit.

use anneal_config::{resolve, Source};
use anneal_data::TextTokenizer;
use anneal_rl::rollout::{Prompt, RewardFailure, Scored, Scorer};
use anneal_rl::{run_rl, RlOptions, RlSummary};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Exact match against `metadata.answer`, with partial credit for digits (so an untrained
/// policy's rewards differ within a group); every `fail_every`-th call fails (every other
/// failure is a timeout).
struct ExactMatch {
    fail_every: u64,
    calls: AtomicU64,
}

impl Scorer for ExactMatch {
    fn score(&self, prompt: &Prompt, completion: &str) -> Scored {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.fail_every > 0 && n.is_multiple_of(self.fail_every) {
            let kind = if (n / self.fail_every).is_multiple_of(2) {
                RewardFailure::Timeout
            } else {
                RewardFailure::Error
            };
            return Scored {
                reward: -1.0,
                correct: None,
                failures: vec![kind],
                ..Default::default()
            };
        }
        let ok = prompt.metadata["answer"].as_str() == Some(completion.trim());
        Scored {
            reward: if ok {
                1.0
            } else {
                0.1 * completion.chars().filter(char::is_ascii_digit).count() as f64
            },
            correct: Some(ok),
            failures: vec![],
            ..Default::default()
        }
    }
}

fn setup(name: &str) -> PathBuf {
    anneal_tests::cli::built_dir();
    let dir = std::env::temp_dir().join(format!("anneal-rl-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let docs: Vec<String> = (0..200u64)
        .map(|i| {
            let (p, a) = anneal_rl::rollout::digits_sort_task(99, i);
            format!("{p}{a}")
        })
        .collect();
    let tok = TextTokenizer::train_bpe_on_texts(&docs, 260).unwrap();
    tok.save(&dir.join("tokenizer.json")).unwrap();
    dir
}

fn run(dir: &std::path::Path, sets: &[&str], fail_every: u64, opts: RlOptions) -> RlSummary {
    let scorer = Arc::new(ExactMatch {
        fail_every,
        calls: AtomicU64::new(0),
    });
    // A fresh run each time: the same run dir would resume from its checkpoints.
    let run_dir = dir.join("run");
    let _ = std::fs::remove_dir_all(&run_dir);
    run_in(&run_dir, dir, sets, scorer, &AtomicBool::new(false), &opts)
}

/// Runs RL in `run_dir` with the tokenizer of `dir`.
fn run_in(
    run_dir: &std::path::Path,
    dir: &std::path::Path,
    sets: &[&str],
    scorer: Arc<dyn Scorer>,
    stop: &AtomicBool,
    opts: &RlOptions,
) -> RlSummary {
    try_run_in(run_dir, dir, sets, scorer, stop, opts).unwrap()
}

/// [`run_in`], returning the run's error.
fn try_run_in(
    run_dir: &std::path::Path,
    dir: &std::path::Path,
    sets: &[&str],
    scorer: Arc<dyn Scorer>,
    stop: &AtomicBool,
    opts: &RlOptions,
) -> Result<RlSummary, anneal_train::TrainError> {
    let toml = format!(
        r#"[model]
plugin = "llama"
flavor = "debugmodel"
args = {{ dim = 32, n_layers = 2, n_heads = 2, n_kv_heads = 2, ffn_dim = 64, vocab_size = 272, max_seq_len = 64 }}
[optimizer]
plugin = "adamw"
lr = 1e-2
[lr_scheduler]
warmup_steps = 0
[training]
steps = 3
seed = 5
[metrics]
log_freq = 1
progress_bar = false
[rl]
tokenizer = "{tok}"
group_size = 4
prompts_per_step = 2
max_new_tokens = 6
eval_freq = 0
"#,
        tok = dir.join("tokenizer.json").display()
    );
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let cfg = resolve(
        Source::Text {
            text: &toml,
            name: "test",
        },
        &sets,
    )
    .unwrap();
    run_rl(&cfg, run_dir, scorer, stop, opts)
}

/// A scorer that panics: a bug in a reward integration, not in the user's input.
struct Panics;

impl Scorer for Panics {
    fn score(&self, _: &Prompt, _: &str) -> Scored {
        panic!("scorer exploded")
    }
}

#[test]
fn a_panicking_rollout_fails_the_run_as_a_runtime_error_instead_of_hanging() {
    let dir = setup("panic");
    let (tx, rx) = std::sync::mpsc::channel();
    let worker_dir = dir.clone();
    std::thread::spawn(move || {
        let run_dir = worker_dir.join("run");
        let out = try_run_in(
            &run_dir,
            &worker_dir,
            &[],
            Arc::new(Panics),
            &AtomicBool::new(false),
            &RlOptions::default(),
        );
        let _ = tx.send(out.map(|s| s.steps));
    });
    let out = rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the run ends instead of waiting for rollouts forever");
    match out {
        Err(e @ anneal_train::TrainError::Rollout(_)) => {
            assert!(!e.is_user_error(), "a crash is not the user's to fix");
            assert!(e.to_string().contains("scorer exploded"), "{e}");
        }
        other => panic!("expected a rollout failure, got {other:?}"),
    }
}

#[test]
fn synchronous_rl_has_exactly_zero_logprob_mismatch_and_every_key() {
    let dir = setup("sync");
    let s = run(&dir, &[], 0, RlOptions::default());
    assert_eq!(s.steps, 3);
    for r in &s.rows {
        assert_eq!(r.logprob_mismatch_max, 0.0, "step {}", r.step);
        assert_eq!(r.staleness_mean, 0.0);
        assert!(r.response_len_mean > 0.0 && r.entropy > 0.0);
    }
    let text = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    for r in &rows {
        for key in [
            "step",
            "reward_mean",
            "reward_std",
            "accuracy",
            "response_len_mean",
            "entropy",
            "kl_ref",
            "logprob_mismatch_max",
            "staleness_mean",
            "reward_errors",
            "reward_timeouts",
            "t_rollout",
            "t_reward",
            "t_train",
        ] {
            assert!(r.get(key).is_some(), "{key} missing in {r}");
        }
    }
    // The parameters moved: later steps score samples of a new version, still exactly.
    assert!(s.rows.iter().any(|r| r.grad_norm > 0.0));
    // With the KL penalty on, kl_ref is reported (0 at the first step: policy = reference).
    let s = run(
        &dir,
        &["rl.kl_coef=0.1", "training.steps=2"],
        0,
        RlOptions::default(),
    );
    assert_eq!(s.rows[0].kl_ref, Some(0.0));
    assert!(s.rows[1].kl_ref.is_some_and(|k| k > 0.0));
    assert!(s.rows.iter().all(|r| r.logprob_mismatch_max == 0.0));
}

#[test]
fn perturbed_rollout_weights_show_a_mismatch() {
    let dir = setup("perturb");
    let s = run(
        &dir,
        &[],
        0,
        RlOptions {
            perturb_rollout_weights: 1e-3,
            ..RlOptions::default()
        },
    );
    assert!(s.rows.iter().all(|r| r.logprob_mismatch_max > 0.0));
}

#[test]
fn failing_rewards_are_counted_and_the_run_continues() {
    let dir = setup("fail");
    let s = run(&dir, &["rl.loss=\"dapo\""], 3, RlOptions::default());
    assert_eq!(s.steps, 3);
    let errors: u64 = s.rows.iter().map(|r| r.reward_errors).sum();
    let timeouts: u64 = s.rows.iter().map(|r| r.reward_timeouts).sum();
    // 24 calls, every third fails, every other failure a timeout.
    assert_eq!((errors, timeouts), (8, 4));
}

#[test]
fn asynchronous_workers_respect_the_staleness_bound() {
    let dir = setup("async");
    let s = run(
        &dir,
        &[
            "rl.max_staleness=2",
            "rl.rollout_threads=2",
            "rl.rollout_compute_threads=1",
            "training.steps=5",
            "rl.loss=\"dr_grpo\"",
            "rl.is_correction_cap=2.0",
        ],
        0,
        RlOptions::default(),
    );
    assert_eq!(s.steps, 5);
    assert!(s.rows.iter().all(|r| r.staleness_mean <= 2.0));
}

/// Scores like [`ExactMatch`] and asks the run to stop once it has scored `after` completions.
struct StopAfter {
    inner: ExactMatch,
    after: u64,
    stop: Arc<AtomicBool>,
}

impl Scorer for StopAfter {
    fn score(&self, prompt: &Prompt, completion: &str) -> Scored {
        let scored = self.inner.score(prompt, completion);
        if self.inner.calls.load(Ordering::SeqCst) >= self.after {
            self.stop.store(true, Ordering::SeqCst);
        }
        scored
    }
}

/// The metric rows of a run dir without the fields that measure time.
fn computed_rows(run_dir: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut r: serde_json::Value = serde_json::from_str(l).unwrap();
            let obj = r.as_object_mut().unwrap();
            for k in [
                "t_rollout",
                "t_reward",
                "t_train",
                "t_wait",
                "samples_per_s",
                "time",
                "wall_time",
            ] {
                obj.remove(k);
            }
            r
        })
        .collect()
}

#[test]
fn a_stopped_run_saves_and_resumes_bit_for_bit() {
    let dir = setup("resume");
    let sets = [
        "training.steps=6",
        "rl.kl_coef=0.1",
        "rl.updates_per_batch=2",
        "checkpoint.interval=0",
    ];
    let exact = || ExactMatch {
        fail_every: 0,
        calls: AtomicU64::new(0),
    };
    let no_stop = AtomicBool::new(false);
    let opts = RlOptions::default();
    let reference = dir.join("reference");
    let s = run_in(&reference, &dir, &sets, Arc::new(exact()), &no_stop, &opts);
    assert_eq!((s.steps, s.stopped), (6, false));

    // The stop request comes with the last sample of step 3 (2 prompts x 4 samples a step): the
    // run ends after step 2 or 3, whichever it is finishing, and saves it.
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = Arc::new(StopAfter {
        inner: exact(),
        after: 3 * 8,
        stop: stop.clone(),
    });
    let run = dir.join("stopped");
    let s = run_in(&run, &dir, &sets, stopping, &stop, &opts);
    assert!(s.stopped && (2..=3).contains(&s.steps), "{s:?}");
    let stopped_at = s.steps;
    assert!(run
        .join(format!("checkpoints/step-{stopped_at}/manifest.json"))
        .is_file());

    let s = run_in(&run, &dir, &sets, Arc::new(exact()), &no_stop, &opts);
    assert_eq!((s.resumed_from, s.steps), (stopped_at, 6));
    assert_eq!(computed_rows(&run), computed_rows(&reference));
}
