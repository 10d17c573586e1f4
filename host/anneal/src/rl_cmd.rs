//! `anneal rl`: RL post-training with rewards from WebAssembly modules.

use crate::errors::UserError;
use crate::train_cmd::{default_run_dir, install_stop_signals, load};
use anneal_reward::{ErrorKind, MemberSpec, RewardSet, Sandbox, SandboxConfig, ScoreInput};
use anneal_rl::rollout::{ModuleScore, Prompt, RewardFailure, Scored, Scorer};
use anneal_rl::{run_rl_dist, RlOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The configured reward modules as one [`RewardSet`]: the set's rule (weighted sum, `correct`
/// when every module that reports it agrees) is the reward; each module's part travels with the
/// sample into `samples.jsonl`.
struct WasmScorer {
    set: RewardSet,
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
        let combined = self.set.score(&input);
        Scored {
            reward: combined.reward,
            correct: combined.correct,
            failures: combined
                .errors()
                .map(|(_, e)| match e.kind() {
                    ErrorKind::Timeout => RewardFailure::Timeout,
                    _ => RewardFailure::Error,
                })
                .collect(),
            modules: combined
                .modules
                .into_iter()
                .map(|m| ModuleScore {
                    error: m.error_kind().map(|k| k.as_str().to_string()),
                    message: m.result.as_ref().err().map(|e| e.message()),
                    score: m.result.ok(),
                    name: m.name,
                    weight: m.weight,
                    reward: m.reward,
                    correct: m.correct,
                })
                .collect(),
        }
    }
}

fn scorer(cfg: &anneal_config::JobConfig) -> anyhow::Result<WasmScorer> {
    let r = &cfg.rl;
    let sandbox = Sandbox::new(SandboxConfig {
        timeout: Duration::from_millis(r.reward_timeout_ms),
        error_reward: r.error_reward,
        ..SandboxConfig::default()
    })?;
    let specs: Vec<MemberSpec> = r
        .rewards
        .iter()
        .map(|spec| MemberSpec {
            path: PathBuf::from(&spec.path),
            name: spec.name.clone(),
            weight: spec.weight,
        })
        .collect();
    // The set's error names the module; the context names the key (the exit code follows the
    // error's kind, see `errors::exit_code`).
    let set = RewardSet::load(Arc::new(sandbox), &specs, r.error_reward).map_err(|e| {
        let key = match e.index() {
            None => return UserError(
                "config: `rl.rewards`: name at least one reward module, e.g. rewards = [{ path = \"reward-wasm/examples/exact_match/reward.wat\", weight = 1.0 }]".into(),
            )
            .into(),
            Some(i) if matches!(e, anneal_reward::SetError::Weight { .. }) => {
                format!("config: `rl.rewards[{i}].weight`")
            }
            Some(i) => format!("config: `rl.rewards[{i}].path`"),
        };
        anyhow::Error::new(e).context(key)
    })?;
    Ok(WasmScorer { set })
}

/// Post-trains until the configured steps, or until SIGINT/SIGTERM. Under `mpiexec -n N`
/// (N > 1) every process is one data-parallel rank (`parallelism.dp_replicate`); rank 0 holds
/// the run dir, the others log to `<run_dir>/logs/rank-<r>.log`.
pub fn rl(config: &Path, set: &[String], run_dir: Option<PathBuf>) -> anyhow::Result<()> {
    let cfg = load(config, set)?;
    if cfg.training.threads > 0 {
        anneal_engine::init_threads(cfg.training.threads)?;
    }
    let run_dir = run_dir.unwrap_or_else(|| default_run_dir(&cfg.job.name));
    // MPI only when a launcher started this process; a plain run never touches it.
    let world = anneal_dist::init()?;
    if world.size() == 1 {
        return rl_on(&cfg, &run_dir, world.as_ref());
    }
    let run_dir = crate::dist_cmd::prepare_rank(world.as_ref(), cfg.training.threads, run_dir)?;
    // A rank that fails ends every rank (with its exit code) rather than leave them waiting.
    match rl_on(&cfg, &run_dir, world.as_ref()) {
        Ok(()) => Ok(()),
        Err(e) => crate::dist_cmd::fail_job(world.as_ref(), e),
    }
}

fn rl_on(
    cfg: &anneal_config::JobConfig,
    run_dir: &Path,
    world: &dyn anneal_dist::Collective,
) -> anyhow::Result<()> {
    // The layout first: a refused mesh is the error, whatever else the config lacks.
    let dist = anneal_train::Dist::unbatched(cfg, world)?;
    anneal_rl::check_layout(cfg, &dist)?;
    // With an environment the reward modules are optional: they add to its rewards.
    let scorer: Arc<dyn Scorer> = match cfg.rl.environment.is_empty() || !cfg.rl.rewards.is_empty()
    {
        true => Arc::new(scorer(cfg)?),
        false => Arc::new(anneal_rl::rollout::NoRewards),
    };
    let environment = match cfg.rl.environment.is_empty() {
        true => None,
        false => Some(Arc::new(crate::rl_env::WasmEnvironment::load(cfg)?) as _),
    };
    let opts = RlOptions {
        environment,
        ..RlOptions::default()
    };
    let stop = install_stop_signals()?;
    // The exit code follows `TrainError::is_user_error` (see `errors::exit_code`).
    run_rl_dist(cfg, run_dir, scorer, &stop, &opts, dist)?;
    Ok(())
}
