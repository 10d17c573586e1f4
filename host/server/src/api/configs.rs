//! `GET /api/configs`, `GET /api/configs/{name}`, `POST /api/configs/validate`.

use super::{ApiError, ApiResult};
use crate::config;
use crate::AppState;
use axum::extract::{Path, State};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// The config files under `configs/`.
pub async fn list(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!(config::list(&state.options.configs_dir)))
}

/// One config file's text.
pub async fn show(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    let (path, text) = read_config(&state, &name)?;
    Ok(Json(json!({ "name": name, "path": path, "text": text })))
}

/// Reads `configs/<name>`; anything else is a 404.
pub fn read_config(state: &AppState, requested: &str) -> ApiResult<(String, String)> {
    let (path, file) = config::locate(&state.options.configs_dir, requested)
        .ok_or_else(|| ApiError::not_found(format!("no config '{requested}' in configs/")))?;
    let text = std::fs::read_to_string(&file)
        .map_err(|e| ApiError::internal(format!("cannot read {path}: {e}")))?;
    Ok((path, text))
}

/// A config to check: inline text or a file under `configs/`, plus overrides.
#[derive(Deserialize)]
pub struct ConfigRequest {
    /// Inline TOML.
    pub config: Option<String>,
    /// `configs/<file>`.
    pub config_path: Option<String>,
    /// `key.path=value` overrides.
    #[serde(default)]
    pub overrides: Vec<String>,
}

impl ConfigRequest {
    /// The text and the name to resolve it under, and the `configs/` path when there is one.
    pub fn source(&self, state: &AppState) -> ApiResult<(String, String, Option<String>)> {
        match (&self.config, &self.config_path) {
            (Some(text), None) => Ok((text.clone(), "config".into(), None)),
            (None, Some(p)) => {
                let (path, text) = read_config(state, p)?;
                Ok((text, path.clone(), Some(path)))
            }
            _ => Err(ApiError::bad_request(
                "give exactly one of \"config\" (TOML text) and \"config_path\" (configs/<file>)",
            )),
        }
    }

    /// Resolves the config: the full TOML, or a 422 with the problem by key path.
    pub fn resolve(&self, state: &AppState) -> ApiResult<(String, String, Option<String>)> {
        let (text, name, path) = self.source(state)?;
        match config::resolve(&text, &name, &self.overrides) {
            Ok(resolved) => Ok((text, resolved, path)),
            Err(problem) => Err(ApiError::invalid_config(vec![problem])),
        }
    }
}

/// Resolves a config: `200 {"ok":true,"resolved":"<toml>"}` or `422` with the problems.
pub async fn validate(
    State(state): State<Arc<AppState>>,
    Json(request): Json<ConfigRequest>,
) -> ApiResult<Json<Value>> {
    let (_, resolved, _) = tokio::task::spawn_blocking({
        let state = Arc::clone(&state);
        move || request.resolve(&state)
    })
    .await
    .map_err(|e| ApiError::internal(format!("validation failed: {e}")))??;
    Ok(Json(json!({ "ok": true, "resolved": resolved })))
}
