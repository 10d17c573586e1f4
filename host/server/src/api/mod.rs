//! The JSON API (documented in `web/API.md`): routes, bearer-token check, and the error shape
//! every failure shares: `{"error": "<one line>", "errors": [{"key_path":..,"message":..}]}`.

mod configs;
pub(crate) mod error;
mod events;
mod misc;
mod reward_test;
mod rewards;
mod runs;

pub use error::ApiError;

use crate::AppState;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use std::sync::Arc;

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
        .route(
            "/rewards/score",
            post(reward_test::score).layer(DefaultBodyLimit::max(reward_test::MAX_BODY_BYTES)),
        )
        .route("/rewards/{id}", get(rewards::show).delete(rewards::delete))
        .route(
            "/rewards/{id}/test",
            post(reward_test::test).layer(DefaultBodyLimit::max(reward_test::MAX_BODY_BYTES)),
        )
        .fallback(|| async { ApiError::not_found("no such API endpoint") })
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            require_token,
        ))
        .layer(axum::middleware::from_fn(error::json_errors))
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

/// Compares a given token with the server's in time independent of where they differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
