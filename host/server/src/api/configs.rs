//! `GET /api/configs`, `GET /api/configs/{name}`, `POST /api/configs/validate`, and the checks
//! a new run's config passes (the same for both).

use super::{ApiError, ApiResult};
use crate::config::{self, ConfigsDir, Kind, Problem};
use crate::AppState;
use anneal_reward::{MemberSpec, RewardSet, SetError};
use axum::extract::{Path, State};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// The config files of the configs folder.
pub async fn list(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!(config::list(&configs_dir(&state))))
}

/// The configs folder (`--configs`), named as seen from the runs' working directory.
pub fn configs_dir(state: &AppState) -> ConfigsDir {
    ConfigsDir::new(&state.options.configs_dir, &state.options.work_dir)
}

/// One config file's text.
pub async fn show(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    let (path, text) = read_config(&state, &name)?;
    Ok(Json(json!({ "name": name, "path": path, "text": text })))
}

/// Reads a file of the configs folder (by its listed path or its name); anything else is a
/// 404 naming the folder.
pub fn read_config(state: &AppState, requested: &str) -> ApiResult<(String, String)> {
    let configs = configs_dir(state);
    let (path, file) = config::locate(&configs, requested).ok_or_else(|| {
        ApiError::not_found(format!("no config '{requested}' in {}", configs.display()))
    })?;
    let text = std::fs::read_to_string(&file)
        .map_err(|e| ApiError::internal(format!("cannot read {path}: {e}")))?;
    Ok((path, text))
}

/// A config to check: inline text or a file of the configs folder, plus overrides, plus (for RL
/// jobs) reward modules picked from those uploaded.
#[derive(Deserialize)]
pub struct ConfigRequest {
    /// Inline TOML.
    pub config: Option<String>,
    /// A file of the configs folder: its path as `GET /api/configs` lists it, or its name.
    pub config_path: Option<String>,
    /// `key.path=value` overrides.
    #[serde(default)]
    pub overrides: Vec<String>,
    /// Uploaded reward modules to train with: they become `rl.rewards` (an override after the
    /// others), which makes the job an RL job.
    #[serde(default)]
    pub rewards: Vec<RewardPick>,
}

/// One uploaded reward module and its weight.
#[derive(Clone, Debug, Deserialize)]
pub struct RewardPick {
    /// The module's id (`GET /api/rewards`).
    pub id: i64,
    /// Its weight in the combined reward (default 1).
    #[serde(default = "one")]
    pub weight: f64,
}

fn one() -> f64 {
    1.0
}

/// A config that resolved: what a run is created with.
pub struct Checked {
    /// The config text as given (or as read from the configs folder).
    pub text: String,
    /// The full resolved config as TOML.
    pub resolved: String,
    /// The file's path in the configs folder, when it came from one.
    pub path: Option<String>,
    /// The overrides the process gets: the request's, then `rl.rewards` for picked modules.
    pub overrides: Vec<String>,
    /// Training or RL.
    pub kind: Kind,
    /// What the run will say about the config at its start (prompts it leaves out).
    pub notes: Vec<String>,
}

impl ConfigRequest {
    /// The text and the name to resolve it under, and the configs folder's path when there is
    /// one.
    pub fn source(&self, state: &AppState) -> ApiResult<(String, String, Option<String>)> {
        match (&self.config, &self.config_path) {
            (Some(text), None) => Ok((text.clone(), "config".into(), None)),
            (None, Some(p)) => {
                let (path, text) = read_config(state, p)?;
                Ok((text, path.clone(), Some(path)))
            }
            _ => Err(ApiError::bad_request(format!(
                "give exactly one of \"config\" (TOML text) and \"config_path\" (a file of {})",
                configs_dir(state).display()
            ))),
        }
    }

    /// Resolves the config (a 422 with the problem by key path when it does not), and for an RL
    /// job loads its reward modules as the run will (a module that does not load or does not
    /// match the reward ABI is a 422 naming `rl.rewards[i].path`). Then makes the run's own
    /// up-front checks ([`anneal_train::preflight::train`], [`anneal_rl::preflight`]: the
    /// mesh, the device, the plugins and the model's context, the data or the prompts), so a
    /// config called valid here does not fail at start for any of them.
    pub fn check(&self, state: &AppState) -> ApiResult<Checked> {
        let (text, name, path) = self.source(state)?;
        let mut overrides = self.overrides.clone();
        if !self.rewards.is_empty() {
            overrides.push(rewards_override(state, &self.rewards)?);
        }
        let kind = Kind::of(&text, &overrides);
        let cfg = config::resolve(&text, &name, &overrides)
            .map_err(|problem| ApiError::invalid_config(vec![problem]))?;
        if kind == Kind::Rl {
            check_rewards(state, &cfg)?;
        }
        let notes = preflight(&cfg, kind)?;
        Ok(Checked {
            text,
            resolved: cfg.to_toml(),
            path,
            overrides,
            kind,
            notes,
        })
    }
}

/// The run's up-front checks, with the processes the server starts it with; a refusal is a 422
/// under the key it names.
fn preflight(cfg: &anneal_config::JobConfig, kind: Kind) -> ApiResult<Vec<String>> {
    let processes = config::processes(cfg);
    let checked = match kind {
        Kind::Train => anneal_train::preflight::train(cfg, processes).map(|_| Vec::new()),
        Kind::Rl => anneal_rl::preflight(cfg, processes),
    };
    checked.map_err(|e| {
        ApiError::invalid_config(vec![Problem {
            key_path: e.key_path(),
            message: e.to_string(),
        }])
    })
}

fn problem(key_path: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_config(vec![Problem {
        key_path: Some(key_path.to_string()),
        message: message.into(),
    }])
}

/// `rl.rewards=[{ path = "<home>/rewards/<sha256>.wasm", weight = .., name = ".." }, ..]` for the
/// picked modules.
fn rewards_override(state: &AppState, picks: &[RewardPick]) -> ApiResult<String> {
    let mut items = Vec::with_capacity(picks.len());
    for (i, pick) in picks.iter().enumerate() {
        let reward = state.registry.reward(pick.id)?.ok_or_else(|| {
            problem(
                "rl.rewards",
                format!(
                    "rewards[{i}]: no uploaded reward module with id {}",
                    pick.id
                ),
            )
        })?;
        if !pick.weight.is_finite() {
            return Err(problem(
                &format!("rl.rewards[{i}].weight"),
                "must be a finite number",
            ));
        }
        let path = state.stored_reward_path(&reward);
        // JSON string escapes are TOML basic-string escapes; `{:?}` prints a TOML float.
        items.push(format!(
            "{{ path = {}, weight = {:?}, name = {} }}",
            json!(path.to_string_lossy()),
            pick.weight,
            json!(reward.name)
        ));
    }
    Ok(format!("rl.rewards=[{}]", items.join(", ")))
}

/// Loads the job's environment and reward modules as `anneal rl` will (relative paths are
/// from the runs' working directory).
fn check_rewards(state: &AppState, cfg: &anneal_config::JobConfig) -> ApiResult<()> {
    let work_dir = &state.options.work_dir;
    if !cfg.rl.environment.is_empty() {
        let path = work_dir.join(&cfg.rl.environment);
        if let Err(e) = state.sandbox()?.load_env_file(&path) {
            return Err(problem("rl.environment", e.to_string()));
        }
        // With an environment the reward modules are optional: they add to its rewards.
        if cfg.rl.rewards.is_empty() {
            return Ok(());
        }
    }
    let specs: Vec<MemberSpec> = cfg
        .rl
        .rewards
        .iter()
        .map(|r| MemberSpec {
            path: work_dir.join(&r.path),
            name: r.name.clone(),
            weight: r.weight,
        })
        .collect();
    match RewardSet::load(state.sandbox()?.clone(), &specs, cfg.rl.error_reward) {
        Ok(_) => Ok(()),
        Err(e @ SetError::Empty) => Err(problem(
            "rl.rewards",
            format!("{e}: pick one of the uploaded modules, or set rl.rewards"),
        )),
        Err(e @ SetError::Weight { index, .. }) => Err(problem(
            &format!("rl.rewards[{index}].weight"),
            e.to_string(),
        )),
        Err(e @ (SetError::Load { index, .. } | SetError::Abi { index, .. })) => {
            Err(problem(&format!("rl.rewards[{index}].path"), e.to_string()))
        }
    }
}

/// Resolves and checks a config: `200 {"ok":true,"kind":"train"|"rl","resolved":"<toml>",
/// "overrides":[..],"notes":[..]}` or `422` with the problems.
pub async fn validate(
    State(state): State<Arc<AppState>>,
    Json(request): Json<ConfigRequest>,
) -> ApiResult<Json<Value>> {
    let checked = tokio::task::spawn_blocking({
        let state = Arc::clone(&state);
        move || request.check(&state)
    })
    .await
    .map_err(|e| ApiError::internal(format!("validation failed: {e}")))??;
    Ok(Json(json!({
        "ok": true,
        "kind": checked.kind,
        "resolved": checked.resolved,
        "overrides": checked.overrides,
        "notes": checked.notes,
    })))
}
