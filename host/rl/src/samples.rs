//! `<run dir>/samples.jsonl`: what the policy wrote and how each reward module scored it, for
//! reading runs (the server's samples view) rather than for training.
//!
//! One JSON object per sample: `step` (the trainer step that trained on it), `version` (the
//! policy version that sampled it), `prompt_index`, `sample` (its place in the group), `prompt`,
//! `completion`, `tokens` (completion tokens), `reward`, `correct` (or null) and `scores`: per
//! reward module `name, weight, score` (null when the call failed), `reward, correct, error`
//! (the kind, or null) and `message`. A multi-turn episode adds `turns`: `role` (`prompt`,
//! `policy`, or the observation's role), `text`, `tokens`, and on the turn where it happened
//! `reward` (the environment's step reward) and `error` (why the episode ended early);
//! `completion` is then the policy's last turn and `tokens` counts the policy's tokens.
//!
//! Bounded: only step 1 and every `rl.samples_every`-th step are written, at most
//! `rl.samples_per_step` samples each (the first, in group order). On resume the rows past the
//! checkpoint's step are dropped with those of `metrics.jsonl`.

use crate::buffer::Item;
use crate::rollout::{Group, ModuleScore, PromptSource};
use anneal_config::Rl;
use anneal_train::{io_err, TrainError};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The file name, in the run dir.
pub const SAMPLES_FILE: &str = "samples.jsonl";

/// One line of `samples.jsonl`.
#[derive(Serialize)]
struct SampleRow<'a> {
    step: u64,
    version: u64,
    prompt_index: u64,
    sample: usize,
    prompt: &'a str,
    completion: &'a str,
    tokens: usize,
    reward: f64,
    correct: Option<bool>,
    scores: &'a [ModuleScore],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    turns: &'a [crate::episode::Turn],
}

/// Appends the samples of the chosen steps to `<run dir>/samples.jsonl`.
pub struct SampleLog {
    path: PathBuf,
    file: Option<std::fs::File>,
    prompts: PromptSource,
    every: u64,
    per_step: usize,
}

impl SampleLog {
    /// Opens (appending) the run's samples file as `rl.samples_every` and
    /// `rl.samples_per_step` say; with `samples_every = 0` nothing is ever written. `prompts`
    /// gives each sample's prompt text.
    pub fn open(run_dir: &Path, rl: &Rl, prompts: PromptSource) -> Result<SampleLog, TrainError> {
        let path = run_dir.join(SAMPLES_FILE);
        let file = if rl.samples_every > 0 && rl.samples_per_step > 0 {
            Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map_err(io_err(&path))?,
            )
        } else {
            None
        };
        Ok(SampleLog {
            path,
            file,
            prompts,
            every: rl.samples_every,
            per_step: rl.samples_per_step,
        })
    }

    /// Whether step `step`'s samples are written.
    pub fn due(&self, step: u64) -> bool {
        self.file.is_some() && (step == 1 || step.is_multiple_of(self.every))
    }

    /// Writes the samples trainer step `step` trained on (`items`, as taken from the buffer),
    /// when the step is due. One write per step, so a reader never sees half a step unless the
    /// process dies inside it (a reader skips an unfinished last line).
    pub fn write(&mut self, step: u64, items: &[Item<Group>]) -> Result<(), TrainError> {
        if !self.due(step) {
            return Ok(());
        }
        let mut text = String::new();
        let samples = items
            .iter()
            .flat_map(|it| {
                it.value
                    .samples
                    .iter()
                    .enumerate()
                    .map(move |(j, s)| (it, j, s))
            })
            .take(self.per_step);
        for (item, j, s) in samples {
            let prompt = self.prompts.get(item.value.index);
            let row = SampleRow {
                step,
                version: item.version,
                prompt_index: item.value.index,
                sample: j,
                prompt: &prompt.prompt,
                completion: &s.text,
                tokens: s.policy_tokens(),
                reward: s.scored.reward,
                correct: s.scored.correct,
                scores: &s.scored.modules,
                turns: &s.turns,
            };
            text.push_str(&serde_json::to_string(&row).expect("a sample row always serializes"));
            text.push('\n');
        }
        if let Some(f) = &mut self.file {
            f.write_all(text.as_bytes()).map_err(io_err(&self.path))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::{Prompt, Sample, Scored};
    use std::sync::Arc;

    fn group(index: u64, n: usize) -> Group {
        Group {
            index,
            samples: (0..n)
                .map(|j| Sample {
                    tokens: vec![1, 2, 3],
                    prompt_len: 1,
                    logprobs: vec![-0.5, -0.25],
                    policy: vec![],
                    turns: vec![],
                    text: format!("c{index}-{j}"),
                    scored: Scored {
                        reward: j as f64,
                        correct: Some(j == 0),
                        failures: vec![],
                        modules: vec![ModuleScore {
                            name: "m".into(),
                            weight: 1.0,
                            score: Some(j as f64),
                            reward: j as f64,
                            ..Default::default()
                        }],
                    },
                })
                .collect(),
            t_rollout: 0.0,
            t_reward: 0.0,
        }
    }

    #[test]
    fn only_due_steps_are_written_and_each_is_capped() {
        let dir = std::env::temp_dir().join(format!("anneal-samples-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let prompts = PromptSource::List(Arc::new(vec![
            Prompt {
                prompt: "a=".into(),
                metadata: serde_json::Value::Null,
            },
            Prompt {
                prompt: "b=".into(),
                metadata: serde_json::Value::Null,
            },
        ]));
        let rl = Rl {
            samples_every: 3,
            samples_per_step: 5,
            ..Rl::default()
        };
        let mut log = SampleLog::open(&dir, &rl, prompts).expect("open");
        let items = vec![
            Item {
                version: 0,
                value: group(0, 3),
            },
            Item {
                version: 0,
                value: group(1, 3),
            },
        ];
        for step in 1..=6 {
            log.write(step, &items).expect("write");
        }
        let rows: Vec<serde_json::Value> = std::fs::read_to_string(dir.join(SAMPLES_FILE))
            .expect("read")
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect();
        let steps: Vec<u64> = rows
            .iter()
            .map(|r| r["step"].as_u64().expect("step"))
            .collect();
        assert_eq!(steps, [1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 6, 6, 6, 6, 6]);
        let r = &rows[4];
        assert_eq!(r["prompt"], "b=");
        assert_eq!(r["prompt_index"], 1);
        assert_eq!(r["sample"], 1);
        assert_eq!(r["completion"], "c1-1");
        assert_eq!(r["tokens"], 2);
        assert_eq!(r["correct"], false);
        assert_eq!(r["scores"][0]["name"], "m");
        assert_eq!(r["scores"][0]["error"], serde_json::Value::Null);

        let off = Rl {
            samples_every: 0,
            ..Rl::default()
        };
        let quiet = dir.join("off");
        std::fs::create_dir_all(&quiet).expect("dir");
        let mut log =
            SampleLog::open(&quiet, &off, PromptSource::DigitsSort { seed: 1 }).expect("open");
        log.write(1, &items).expect("write");
        assert!(!quiet.join(SAMPLES_FILE).exists());
    }
}
