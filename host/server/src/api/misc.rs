//! `GET /api/health` and `GET /api/plugins`.

use super::{ApiError, ApiResult};
use anneal_plugin_api::abi::PluginKind;
use anneal_runtime::plugins::{discover, search_paths};
use axum::Json;
use serde_json::{json, Value};

/// `{"status":"ok","version":"..."}`.
pub async fn health() -> Json<Value> {
    Json(json!({ "status": "ok", "version": env!("CARGO_PKG_VERSION") }))
}

/// The plugins in the search path (`anneal plugins list`), and the files that failed to load.
pub async fn plugins() -> ApiResult<Json<Value>> {
    let value = tokio::task::spawn_blocking(|| {
        let dirs = search_paths();
        let mut plugins = Vec::new();
        let mut errors = Vec::new();
        for entry in discover(&dirs) {
            match entry {
                Ok(p) => plugins.push(json!({
                    "name": p.name(),
                    "kind": match p.kind() {
                        PluginKind::Model => "model",
                        PluginKind::Optimizer => "optimizer",
                    },
                    "api_version": p.info.api_version,
                    "flavors": p.info.flavors.iter().map(|f| f.to_string()).collect::<Vec<_>>(),
                    "model_types": p.model_types().collect::<Vec<_>>(),
                    "description": p.info.description.to_string(),
                    "file": p.path.display().to_string(),
                })),
                Err(e) => errors.push(e.to_string()),
            }
        }
        let searched: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        json!({ "plugins": plugins, "errors": errors, "searched": searched })
    })
    .await
    .map_err(|e| ApiError::internal(format!("listing plugins failed: {e}")))?;
    Ok(Json(value))
}
