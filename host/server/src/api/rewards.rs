//! Reward modules: upload (size-limited, compiled and checked against the reward ABI before it is
//! stored), list, show, delete. Scoring sample inputs, with one module or several combined as
//! an RL run combines them, is in `reward_test.rs`.

use super::{parse_id, ApiError, ApiResult};
use crate::registry::Reward;
use crate::AppState;
use anneal_reward::{ModuleKind, RewardModule};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// The reward module record with this id (404 when there is none).
pub fn find_reward(state: &AppState, raw: &str) -> ApiResult<Reward> {
    let id = parse_id("reward module", raw)?;
    state
        .registry
        .reward(id)?
        .ok_or_else(|| ApiError::not_found(format!("no reward module with id {id}")))
}

/// Every stored reward module, newest first.
pub async fn list(State(state): State<Arc<AppState>>) -> ApiResult<Json<Value>> {
    Ok(Json(json!(state.registry.rewards()?)))
}

/// One reward module.
pub async fn show(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    Ok(Json(json!(find_reward(&state, &id)?)))
}

/// `?name=reward.wasm`.
#[derive(Deserialize)]
pub struct UploadQuery {
    name: Option<String>,
}

fn clean_name(name: Option<&str>) -> String {
    let name: String = name
        .unwrap_or("reward.wasm")
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        .take(100)
        .collect();
    if name.is_empty() {
        "reward.wasm".into()
    } else {
        name
    }
}

/// Stores a reward module sent as the raw request body (a `.wasm` binary, or WebAssembly text):
/// `201` with the record, `413` when larger than the limit, `422` when it does not compile or
/// does not match the reward ABI.
pub async fn upload(
    State(state): State<Arc<AppState>>,
    Query(q): Query<UploadQuery>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let limit = state.options.max_upload_bytes;
    let bytes = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the module is larger than the upload limit of {limit} bytes"),
            )
        } else {
            ApiError::bad_request(format!("cannot read the upload: {e}"))
        }
    })?;
    if bytes.is_empty() {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "the upload is empty; send the module's bytes as the request body",
        ));
    }
    let name = clean_name(q.name.as_deref());
    let stored = tokio::task::spawn_blocking({
        let state = Arc::clone(&state);
        move || store(&state, &name, &bytes)
    })
    .await
    .map_err(|e| ApiError::internal(format!("checking the module failed: {e}")))??;
    Ok((StatusCode::CREATED, Json(json!(stored))))
}

fn invalid(message: String) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, message)
}

fn store(state: &AppState, name: &str, bytes: &[u8]) -> ApiResult<Reward> {
    let binary = wat::parse_bytes(bytes).map_err(|e| {
        let text = e.to_string();
        invalid(format!(
            "{name}: not a WebAssembly binary, nor valid WebAssembly text: {}",
            text.lines().next().unwrap_or_default()
        ))
    })?;
    let sandbox = state.sandbox()?;
    let module = sandbox
        .load_bytes(name, &binary)
        .map_err(|e| invalid(e.to_string()))?;
    if let Some(problem) = module.abi_problem() {
        return Err(invalid(format!(
            "{name} does not match the reward ABI: {problem}"
        )));
    }
    let sha = hex(&Sha256::digest(&binary));
    let dir = &state.options.rewards_dir();
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(dir.join(format!("{sha}.wasm")), &binary))
        .map_err(|e| ApiError::internal(format!("cannot store the module: {e}")))?;
    let kind = match module.kind() {
        ModuleKind::Core => "core",
        ModuleKind::Component => "component",
    };
    Ok(state
        .registry
        .add_reward(name, &sha, binary.len() as i64, kind)?)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Deletes a reward module (its file too, unless another record has the same bytes): `204`.
pub async fn delete(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let reward = find_reward(&state, &id)?;
    let shared = state.registry.delete_reward(reward.id, &reward.sha256)?;
    if !shared {
        let _ = std::fs::remove_file(state.stored_reward_path(&reward));
    }
    Ok(StatusCode::NO_CONTENT)
}

/// The stored module of a record, compiled (or from the sandbox's cache).
pub fn load_stored(state: &AppState, reward: &Reward) -> ApiResult<RewardModule> {
    let path = state.stored_reward_path(reward);
    let bytes = std::fs::read(&path)
        .map_err(|e| ApiError::internal(format!("cannot read {}: {e}", path.display())))?;
    state
        .sandbox()?
        .load_bytes(&reward.name, &bytes)
        .map_err(|e| ApiError::internal(e.to_string()))
}
