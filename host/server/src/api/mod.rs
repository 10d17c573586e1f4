//! The JSON API (documented in `web/API.md`): routes, bearer-token check, and the error shape
//! every failure shares: `{"error": "<one line>", "errors": [{"key_path":..,"message":..}]}`.

mod configs;
mod events;
mod misc;
mod rewards;
mod runs;

use crate::config::Problem;
use crate::registry::RegistryError;
use crate::runs::RunError;
use crate::AppState;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use std::sync::Arc;

/// An API failure: an HTTP status, one line, and (for configs) the problems by key path.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    problems: Vec<Problem>,
}

impl ApiError {
    /// A failure with a status and a message.
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            problems: Vec::new(),
        }
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }

    /// 400.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    /// 422 for an invalid config, listing its problems.
    pub fn invalid_config(problems: Vec<Problem>) -> ApiError {
        // `error` stays one line; a problem's own message may span lines (a TOML syntax error
        // with its caret), which the UI shows as they are.
        let message = problems
            .first()
            .map(|p| p.message.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_else(|| "invalid config".into());
        ApiError {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            message,
            problems,
        }
    }

    /// 500, for failures of the server's own machinery.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({ "error": self.message });
        if !self.problems.is_empty() {
            body["errors"] = json!(self.problems);
        }
        (self.status, Json(body)).into_response()
    }
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        ApiError::internal(e.to_string())
    }
}

impl From<RunError> for ApiError {
    fn from(e: RunError) -> Self {
        let status = match &e {
            RunError::NotFound(_) => StatusCode::NOT_FOUND,
            RunError::Conflict(_) => StatusCode::CONFLICT,
            RunError::Registry(_) | RunError::Io(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, e.to_string())
    }
}

/// What a handler returns.
pub type ApiResult<T> = Result<T, ApiError>;

/// Parses a path id; anything but a positive integer is an unknown id (404), never a path.
pub fn parse_id(what: &str, raw: &str) -> ApiResult<i64> {
    raw.parse::<i64>()
        .ok()
        .filter(|id| *id > 0)
        .ok_or_else(|| ApiError::not_found(format!("no {what} with id '{raw}'")))
}

/// The API routes (to be nested under `/api`).
pub fn routes(state: Arc<AppState>) -> Router {
    let upload_limit = state.options.max_upload_bytes;
    Router::new()
        .route("/health", get(misc::health))
        .route("/plugins", get(misc::plugins))
        .route("/configs", get(configs::list))
        .route("/configs/validate", post(configs::validate))
        .route("/configs/{name}", get(configs::show))
        .route("/runs", get(runs::list).post(runs::create))
        .route("/runs/{id}", get(runs::show).delete(runs::delete))
        .route("/runs/{id}/stop", post(runs::stop))
        .route("/runs/{id}/resume", post(runs::resume))
        .route("/runs/{id}/metrics", get(runs::metrics))
        .route("/runs/{id}/logs", get(runs::logs))
        .route("/runs/{id}/checkpoints", get(runs::checkpoints))
        .route("/runs/{id}/samples", get(runs::samples))
        .route("/runs/{id}/generate", post(runs::generate))
        .route("/runs/{id}/events", get(events::run_events))
        .route(
            "/rewards",
            get(rewards::list)
                .post(rewards::upload)
                .layer(DefaultBodyLimit::max(upload_limit)),
        )
        .route("/rewards/score", post(rewards::score))
        .route("/rewards/{id}", get(rewards::show).delete(rewards::delete))
        .route("/rewards/{id}/test", post(rewards::test))
        .fallback(|| async { ApiError::not_found("no such API endpoint") })
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            require_token,
        ))
        .with_state(state)
}

/// With a token configured, every API call needs `Authorization: Bearer <token>` (or, for
/// `EventSource`, which cannot set headers, `?token=<token>`).
async fn require_token(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(token) = &state.options.token else {
        return next.run(request).await;
    };
    let from_header = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let from_query = request.uri().query().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("token="))
            .map(str::to_string)
    });
    let given = from_header.map(str::to_string).or(from_query);
    if given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes())) {
        next.run(request).await
    } else {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "this server needs a token: send Authorization: Bearer <token>",
        )
        .into_response()
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
