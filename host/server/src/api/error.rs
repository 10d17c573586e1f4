//! The one error shape of the API, `{"error": "<one line>", ...}`, and the middleware that gives
//! it to the failures axum answers by itself (a body that is not JSON, a wrong content type, a
//! body over the limit, a bad query string, a wrong method), so that a client never has to
//! parse anything else.

use crate::config::Problem;
use crate::registry::RegistryError;
use crate::runs::RunError;
use axum::extract::{OriginalUri, Request};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

/// An API failure: an HTTP status, one line, and (for configs) the problems by key path.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    problems: Vec<Problem>,
    /// More fields of the body (a reward test stopped by its budget adds the results so far).
    extra: Map<String, Value>,
}

impl ApiError {
    /// A failure with a status and a message.
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            problems: Vec::new(),
            extra: Map::new(),
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
            .map(|p| one_line(&p.message))
            .unwrap_or_else(|| "invalid config".into());
        ApiError {
            problems,
            ..ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, message)
        }
    }

    /// 500, for failures of the server's own machinery.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// Adds a field to the body next to `error`.
    pub fn with(mut self, key: &str, value: Value) -> ApiError {
        self.extra.insert(key.to_string(), value);
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The one-line message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = self.extra;
        body.insert("error".into(), json!(self.message));
        if !self.problems.is_empty() {
            body.insert("errors".into(), json!(self.problems));
        }
        (self.status, Json(Value::Object(body))).into_response()
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

/// Collapses whitespace (newlines included) to single spaces.
pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The most of a non-JSON error body that is turned into the message (axum's rejections are
/// one short sentence).
const MAX_MESSAGE_BYTES: usize = 16 * 1024;

/// An error response that is not JSON (axum's own: a body over the limit, a wrong method, a
/// bad path), caught by [`catch_plain_errors`] so a middleware can answer it in its own shape.
pub struct PlainError {
    /// The response's status.
    pub status: StatusCode,
    method: axum::http::Method,
    path: String,
    text: String,
    allow: Option<header::HeaderValue>,
}

impl PlainError {
    /// One line for the user: the allowed methods for a 405, else axum's text, else the
    /// status's reason.
    pub fn message(&self) -> String {
        let (method, path) = (&self.method, &self.path);
        match (&self.allow, self.status) {
            (allow, StatusCode::METHOD_NOT_ALLOWED) => format!(
                "{method} is not allowed on {path}; use {}",
                allow
                    .as_ref()
                    .and_then(|a| a.to_str().ok())
                    .unwrap_or("another method")
            ),
            _ if !self.text.is_empty() => self.text.clone(),
            _ => format!(
                "{method} {path}: {}",
                self.status.canonical_reason().unwrap_or("failed")
            ),
        }
    }

    /// `out`, the error in the caller's shape, with the original `Allow` header kept.
    pub fn answer(self, mut out: Response) -> Response {
        if let Some(allow) = self.allow {
            out.headers_mut().insert(header::ALLOW, allow);
        }
        out
    }
}

/// Runs the inner service and hands back its error responses that are not JSON as
/// [`PlainError`]; every other response passes as it is.
pub async fn catch_plain_errors(request: Request, next: Next) -> Result<Response, PlainError> {
    let method = request.method().clone();
    let path = request
        .extensions()
        .get::<OriginalUri>()
        .map_or_else(|| request.uri().path(), |u| u.0.path())
        .to_string();
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return Ok(response);
    }
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, MAX_MESSAGE_BYTES)
        .await
        .map(|b| one_line(&String::from_utf8_lossy(&b)))
        .unwrap_or_default();
    Err(PlainError {
        status,
        method,
        path,
        text,
        allow: parts.headers.get(header::ALLOW).cloned(),
    })
}

/// Rewrites every error response that is not JSON into `{"error": ...}` with the same status
/// (and `Allow` header, for a wrong method).
pub async fn json_errors(request: Request, next: Next) -> Response {
    match catch_plain_errors(request, next).await {
        Ok(response) => response,
        Err(plain) => {
            let out = ApiError::new(plain.status, plain.message()).into_response();
            plain.answer(out)
        }
    }
}
