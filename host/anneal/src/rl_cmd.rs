//! `anneal rl`: RL post-training with rewards from WebAssembly modules.

use crate::train_cmd::{default_run_dir, install_stop_signals, load};
use crate::user_bail;
use anneal_reward::{ErrorKind, RewardModule, Sandbox, SandboxConfig, ScoreInput};
use anneal_rl::rollout::{Prompt, RewardFailure, Scored, Scorer};
use anneal_rl::{run_rl, RlOptions};
use anyhow::Context;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The configured reward modules in one sandbox; rewards combine by weight.
struct WasmScorer {
    sandbox: Sandbox,
    modules: Vec<(RewardModule, f64)>,
}

impl Scorer for WasmScorer {
    fn score(&self, prompt: &Prompt, completion: &str) -> Scored {
        let input = ScoreInput {
            prompt: prompt.prompt.clone(),
            completion: completion.to_string(),
            metadata: if prompt.metadata.is_null() {
                serde_json::json!({})
            } else {
                prompt.metadata.clone()
            },
        };
        let mut out = Scored {
            reward: 0.0,
            correct: None,
            failures: vec![],
        };
        for (module, weight) in &self.modules {
            let o = self.sandbox.score(module, &input);
            // A failed call's reward is already the configured error reward.
            out.reward += weight * o.reward;
            if let Err(e) = &o.result {
                out.failures.push(match e.kind() {
                    ErrorKind::Timeout => RewardFailure::Timeout,
                    _ => RewardFailure::Error,
                });
            }
            if let Some(c) = o
                .details
                .as_ref()
                .and_then(|d| d.get("correct"))
                .and_then(|v| v.as_bool())
            {
                out.correct = Some(out.correct.unwrap_or(true) && c);
            }
        }
        out
    }
}

fn scorer(cfg: &anneal_config::JobConfig) -> anyhow::Result<WasmScorer> {
    let r = &cfg.rl;
    if r.rewards.is_empty() {
        user_bail!("config: `rl.rewards`: name at least one reward module, e.g. rewards = [{{ path = \"reward-wasm/examples/exact_match/reward.wat\", weight = 1.0 }}]");
    }
    let sandbox = Sandbox::new(SandboxConfig {
        timeout: Duration::from_millis(r.reward_timeout_ms),
        error_reward: r.error_reward,
        ..SandboxConfig::default()
    })?;
    let mut modules = Vec::new();
    for (i, spec) in r.rewards.iter().enumerate() {
        let module = sandbox
            .load_file(Path::new(&spec.path))
            // The load error names the file.
            .with_context(|| format!("config: `rl.rewards[{i}].path`"))?;
        if let Some(problem) = module.abi_problem() {
            user_bail!(
                "config: `rl.rewards[{i}].path`: {} does not match the reward ABI ({problem})",
                spec.path
            );
        }
        modules.push((module, spec.weight));
    }
    Ok(WasmScorer { sandbox, modules })
}

/// Post-trains until the configured steps, or until SIGINT/SIGTERM.
pub fn rl(config: &Path, set: &[String], run_dir: Option<PathBuf>) -> anyhow::Result<()> {
    let cfg = load(config, set)?;
    if cfg.training.threads > 0 {
        anneal_engine::init_threads(cfg.training.threads)?;
    }
    let scorer = Arc::new(scorer(&cfg)?);
    let run_dir = run_dir.unwrap_or_else(|| default_run_dir(&cfg.job.name));
    let stop = install_stop_signals()?;
    // The exit code follows `TrainError::is_user_error` (see `errors::exit_code`).
    run_rl(&cfg, &run_dir, scorer, &stop, &RlOptions::default())?;
    Ok(())
}
