//! `rl.environment`: multi-turn episodes with an environment module in the WebAssembly
//! sandbox (`anneal_reward`'s episodes), as `anneal_rl`'s [`Environment`].

use anneal_reward::{CallError, EnvModule, Episode, EpisodeLimits, Sandbox, SandboxConfig};
use anneal_rl::episode::{EnvEpisode, EnvFailure, EnvStart, EnvStep, Environment};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// An environment module and the limits of its episodes.
pub struct WasmEnvironment {
    sandbox: Arc<Sandbox>,
    module: EnvModule,
    limits: EpisodeLimits,
}

/// A running episode; dropping it closes the module's instance.
struct WasmEpisode {
    episode: Option<Episode>,
}

fn failure(e: CallError) -> EnvFailure {
    EnvFailure {
        kind: e.kind().as_str().to_string(),
        message: e.message(),
    }
}

impl WasmEnvironment {
    /// Loads `rl.environment` with `rl`'s deadlines.
    pub fn load(cfg: &anneal_config::JobConfig) -> anyhow::Result<WasmEnvironment> {
        let r = &cfg.rl;
        let sandbox = Arc::new(Sandbox::new(SandboxConfig {
            error_reward: r.error_reward,
            ..SandboxConfig::default()
        })?);
        let module = sandbox
            .load_env_file(Path::new(&r.environment))
            .map_err(|e| anyhow::Error::new(e).context("config: `rl.environment`"))?;
        let limits = EpisodeLimits {
            step_timeout: Duration::from_millis(r.env_step_timeout_ms),
            episode_timeout: Duration::from_millis(r.env_episode_timeout_ms),
            ..EpisodeLimits::default()
        };
        Ok(WasmEnvironment {
            sandbox,
            module,
            limits,
        })
    }
}

impl Environment for WasmEnvironment {
    fn start(&self, task: &Value) -> Result<(Box<dyn EnvEpisode>, EnvStart), EnvFailure> {
        let (episode, start) = self
            .sandbox
            .start_episode(&self.module, task, self.limits)
            .map_err(failure)?;
        let messages = start
            .messages
            .into_iter()
            .map(|m| anneal_data::chat::template::Message::new(m.role, m.content))
            .collect();
        let started = EnvStart {
            messages,
            tools: start.tools,
        };
        let episode = WasmEpisode {
            episode: Some(episode),
        };
        Ok((Box::new(episode), started))
    }
}

impl EnvEpisode for WasmEpisode {
    fn step(&mut self, turn: &Value) -> Result<EnvStep, EnvFailure> {
        let Some(episode) = self.episode.as_mut() else {
            return Err(EnvFailure {
                kind: "closed".into(),
                message: "the episode is over".into(),
            });
        };
        let out = episode.step(turn).map_err(failure)?;
        let correct = out
            .details
            .as_ref()
            .and_then(|d| d.get("correct"))
            .and_then(Value::as_bool);
        Ok(EnvStep {
            observation: out.observation,
            role: out.role,
            reward: out.reward,
            done: out.done,
            correct,
        })
    }
}

impl Drop for WasmEpisode {
    fn drop(&mut self) {
        if let Some(episode) = self.episode.take() {
            episode.close();
        }
    }
}
