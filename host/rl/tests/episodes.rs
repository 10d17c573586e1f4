//! Multi-turn RL on a tiny Llama with environments written in Rust (the WebAssembly sandbox's
//! own tests cover the modules; these cover the episodes): the trainer sees the sampled tokens
//! exactly (logprob mismatch 0 with observations between the policy's turns, which a wrong loss
//! mask would break), every turn is recorded, and environments that fail, never finish or
//! flood the context end their episode while the run goes on.

use anneal_config::{resolve, Source};
use anneal_data::chat::template::CHATML_SPECIALS;
use anneal_data::TextTokenizer;
use anneal_rl::episode::{EnvEpisode, EnvFailure, EnvStart, EnvStep, Environment};
use anneal_rl::rollout::NoRewards;
use anneal_rl::{run_rl, RlOptions, RlSummary};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// What the test environment does, from the task's `mode`.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Answers two turns with an observation, then rewards the third by its length.
    ThreeTurns,
    /// Fails its second step.
    FailsAtStep2,
    /// Never says done.
    NeverDone,
    /// Answers with an observation longer than any episode.
    Floods,
    /// Cannot start.
    FailsAtInit,
}

struct Env {
    mode: Mode,
}

struct Episode {
    mode: Mode,
    steps: usize,
}

impl Environment for Env {
    fn start(&self, task: &Value) -> Result<(Box<dyn EnvEpisode>, EnvStart), EnvFailure> {
        if self.mode == Mode::FailsAtInit {
            return Err(EnvFailure {
                kind: "trap".into(),
                message: "init trapped".into(),
            });
        }
        let question = task["prompt"].as_str().unwrap_or_default().to_string();
        let start = EnvStart {
            messages: vec![anneal_data::chat::template::Message::new("user", question)],
            tools: vec![],
        };
        let episode = Episode {
            mode: self.mode,
            steps: 0,
        };
        Ok((Box::new(episode), start))
    }
}

impl EnvEpisode for Episode {
    fn step(&mut self, turn: &Value) -> Result<EnvStep, EnvFailure> {
        self.steps += 1;
        let text = turn["text"].as_str().unwrap_or_default();
        match (self.mode, self.steps) {
            (Mode::FailsAtStep2, 2) => Err(EnvFailure {
                kind: "fuel_exhausted".into(),
                message: "step ran out of fuel".into(),
            }),
            (Mode::Floods, _) => Ok(EnvStep {
                observation: "flood ".repeat(200),
                role: "tool".into(),
                ..EnvStep::default()
            }),
            (Mode::ThreeTurns, 3) => Ok(EnvStep {
                reward: text.len() as f64 / 10.0,
                done: true,
                correct: Some(text.len() > 3),
                ..EnvStep::default()
            }),
            _ => Ok(EnvStep {
                observation: format!("seen {} bytes", text.len()),
                role: "tool".into(),
                reward: 0.25,
                ..EnvStep::default()
            }),
        }
    }
}

/// A tokenizer with ChatML's turn markers, trained on a few rendered turns.
fn setup(name: &str) -> PathBuf {
    anneal_tests::cli::built_dir();
    let dir = std::env::temp_dir().join(format!("anneal-episodes-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let docs: Vec<String> = (0..200u64)
        .map(|i| {
            let (p, a) = anneal_rl::rollout::digits_sort_task(99, i);
            format!("<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n<|im_start|>user\n<tool_response>\nseen {i} bytes\n</tool_response><|im_end|>\n")
        })
        .collect();
    let tok = TextTokenizer::train_bpe_with_specials(&docs, 300, &CHATML_SPECIALS).unwrap();
    tok.save(&dir.join("tokenizer.json")).unwrap();
    dir
}

fn run(dir: &Path, mode: Mode, sets: &[&str]) -> RlSummary {
    let run_dir = dir.join("run");
    let _ = std::fs::remove_dir_all(&run_dir);
    let toml = format!(
        r#"[model]
plugin = "llama"
flavor = "debugmodel"
args = {{ dim = 32, n_layers = 2, n_heads = 2, n_kv_heads = 2, ffn_dim = 64, vocab_size = 300, max_seq_len = 128 }}
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
max_turns = 3
environment = "rust"
eval_freq = 0
samples_every = 1
"#,
        tok = dir.join("tokenizer.json").display()
    );
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let source = Source::Text {
        text: &toml,
        name: "test",
    };
    let cfg = resolve(source, &sets).unwrap();
    let opts = RlOptions {
        environment: Some(Arc::new(Env { mode })),
        ..RlOptions::default()
    };
    run_rl(
        &cfg,
        &run_dir,
        Arc::new(NoRewards),
        &AtomicBool::new(false),
        &opts,
    )
    .unwrap()
}

fn samples(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("run/samples.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn roles(sample: &Value) -> Vec<&str> {
    sample["turns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["role"].as_str().unwrap())
        .collect()
}

#[test]
fn episodes_train_on_the_sampled_tokens_exactly() {
    let dir = setup("exact");
    let s = run(&dir, Mode::ThreeTurns, &[]);
    assert_eq!(s.steps, 3);
    for r in &s.rows {
        // Observations sit between the policy's turns: had their tokens been trained on (or
        // re-tokenized), the trainer's logprobs would not equal the rollout's.
        assert_eq!(r.logprob_mismatch_max, 0.0, "step {}", r.step);
        assert_eq!(r.reward_errors, 0);
    }
    assert!(s.rows.iter().any(|r| r.grad_norm > 0.0));
    let rows = samples(&dir);
    assert_eq!(rows.len(), 3 * 8);
    let mut finished = 0;
    for row in &rows {
        let turns = row["turns"].as_array().unwrap();
        let policy: u64 = turns
            .iter()
            .filter(|t| t["role"] == "policy")
            .map(|t| t["tokens"].as_u64().unwrap())
            .sum();
        // `tokens` counts the policy's tokens only.
        assert_eq!(row["tokens"].as_u64().unwrap(), policy, "{row}");
        assert_eq!(roles(row)[0], "prompt");
        if roles(row) == ["prompt", "policy", "tool", "policy", "tool", "policy"] {
            finished += 1;
            let want = 0.5 + turns[5]["text"].as_str().unwrap().len() as f64 / 10.0;
            assert_eq!(row["reward"].as_f64().unwrap(), want, "{row}");
        }
    }
    // An untrained policy often runs out of its 6 tokens inside a turn (the episode then ends
    // there), but some episodes finish all three turns.
    assert!(finished > 0, "no episode took its three turns");
}

#[test]
fn a_failing_environment_ends_its_episode_and_the_run_goes_on() {
    let dir = setup("fail");
    let s = run(&dir, Mode::FailsAtStep2, &["rl.error_reward=-1.0"]);
    assert_eq!(s.steps, 3);
    assert!(s.rows.iter().all(|r| r.logprob_mismatch_max == 0.0));
    let rows = samples(&dir);
    let failed: Vec<&Value> = rows
        .iter()
        .filter(|r| {
            r["turns"].as_array().unwrap().iter().any(|t| {
                t["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("fuel_exhausted"))
            })
        })
        .collect();
    assert!(!failed.is_empty());
    for r in failed {
        assert_eq!(r["reward"].as_f64(), Some(-1.0));
    }
    let errors: u64 = s.rows.iter().map(|r| r.reward_errors).sum();
    assert!(errors > 0);

    let s = run(
        &dir,
        Mode::FailsAtInit,
        &["rl.error_reward=-1.0", "training.steps=1"],
    );
    assert_eq!(s.rows[0].reward_errors, 8);
    for r in samples(&dir) {
        assert_eq!(roles(&r), ["prompt"]);
        assert!(r["turns"][0]["error"]
            .as_str()
            .unwrap()
            .contains("init trapped"));
    }
}

#[test]
fn episodes_stop_at_max_turns_and_at_the_token_budget() {
    let dir = setup("limits");
    run(
        &dir,
        Mode::NeverDone,
        &["training.steps=1", "rl.max_new_tokens=2"],
    );
    let rows = samples(&dir);
    assert!(rows.iter().any(|r| {
        let turns = r["turns"].as_array().unwrap();
        turns.len() == 6
            && turns[5]["error"]
                .as_str()
                .unwrap_or_default()
                .contains("max_turns")
    }));
    // Hitting a limit is not an environment failure: the episode keeps what it earned.
    for r in &rows {
        assert!(r["reward"].as_f64().unwrap() >= 0.0, "{r}");
    }

    run(
        &dir,
        Mode::Floods,
        &["training.steps=1", "rl.max_episode_tokens=80"],
    );
    for r in samples(&dir) {
        let turns = r["turns"].as_array().unwrap();
        assert!(!roles(&r).contains(&"tool"), "a flood was appended: {r}");
        let last = turns.last().unwrap();
        assert!(
            last["error"]
                .as_str()
                .unwrap_or_default()
                .contains("max_episode_tokens"),
            "{r}"
        );
    }
}
