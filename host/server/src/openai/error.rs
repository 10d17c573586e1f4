//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP
//! status OpenAI uses for the same failure. Every error under `/v1` has it: the handlers' own,
//! what axum answers by itself (a body over [`MAX_REQUEST_BYTES`], a wrong method; rewritten
//! by [`openai_errors`]) and the request checks of `guard.rs` ([`refusal`]).

use crate::api::error::catch_plain_errors;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// The largest request body `/v1` reads (a 413 beyond it), and the most text a chat request's
/// messages may hold.
pub const MAX_REQUEST_BYTES: usize = 2 << 20;

/// The largest body of a chat request, whose images may take more than its text.
pub const MAX_CHAT_REQUEST_BYTES: usize = 24 << 20;

/// A failed OpenAI-compatible call.
#[derive(Debug)]
pub struct OaiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// One line for the user.
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, `context_length_exceeded`, ...).
    pub code: Option<&'static str>,
}

impl OaiError {
    /// 400: the request is wrong; `param` names the field.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> OaiError {
        OaiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
        }
    }

    /// 400 for a known field this server does not implement (or only with its default value).
    pub fn unsupported(param: &str, what: &str) -> OaiError {
        OaiError::invalid(
            Some(param),
            format!("`{param}` is not supported by this server ({what})"),
        )
        .with_code("unsupported_parameter")
    }

    /// 404 for a model that is not served.
    pub fn no_model(name: &str) -> OaiError {
        OaiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "The model `{name}` does not exist (GET /v1/models lists the served models)"
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 401: the server needs a token and the request had none or another.
    pub fn unauthorized() -> OaiError {
        OaiError {
            status: StatusCode::UNAUTHORIZED,
            message: "this server needs a token: send Authorization: Bearer <token> (the client's api_key)".into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 404 for a path that is not part of the API.
    pub fn no_route() -> OaiError {
        OaiError {
            status: StatusCode::NOT_FOUND,
            message: "no such endpoint: this server answers /v1/models, /v1/completions, /v1/chat/completions, /v1/generate, /v1/tokenize and /v1/detokenize".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("unknown_url"),
        }
    }

    /// 500: the model or the server failed.
    pub fn server(message: impl Into<String>) -> OaiError {
        OaiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// Any status, with the `type` and `code` OpenAI gives it: what the server's own checks
    /// and axum's rejections become under `/v1`.
    pub fn from_status(status: StatusCode, message: impl Into<String>) -> OaiError {
        let (kind, code) = match status {
            StatusCode::UNAUTHORIZED => ("authentication_error", Some("invalid_api_key")),
            StatusCode::FORBIDDEN => ("permission_error", Some("forbidden")),
            StatusCode::NOT_FOUND => ("invalid_request_error", Some("unknown_url")),
            StatusCode::METHOD_NOT_ALLOWED => ("invalid_request_error", Some("method_not_allowed")),
            StatusCode::PAYLOAD_TOO_LARGE => ("invalid_request_error", Some("request_too_large")),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => {
                ("invalid_request_error", Some("unsupported_media_type"))
            }
            s if s.is_server_error() => ("server_error", None),
            _ => ("invalid_request_error", None),
        };
        OaiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code,
        }
    }

    /// The same error with a code.
    pub fn with_code(mut self, code: &'static str) -> OaiError {
        self.code = Some(code);
        self
    }

    /// The JSON body (also sent as the last event of a failed stream).
    pub fn body(&self) -> serde_json::Value {
        json!({ "error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for OaiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// What a handler returns.
pub type OaiResult<T> = Result<T, OaiError>;

/// A refusal of `guard.rs` (403, 415) in OpenAI's shape.
pub fn refusal(status: StatusCode, message: impl Into<String>) -> Response {
    OaiError::from_status(status, message).into_response()
}

/// Rewrites every error response under `/v1` that is not JSON (axum's own: a body over the
/// limit, a wrong method, a bad path) into OpenAI's shape with the same status (and `Allow`).
pub async fn openai_errors(request: Request, next: Next) -> Response {
    match catch_plain_errors(request, next).await {
        Ok(response) => response,
        Err(plain) => {
            let message = match plain.status {
                StatusCode::PAYLOAD_TOO_LARGE => format!(
                    "the request body is larger than this server reads: {} bytes ({} MiB), or {} MiB for chat requests with images",
                    MAX_REQUEST_BYTES,
                    MAX_REQUEST_BYTES >> 20,
                    MAX_CHAT_REQUEST_BYTES >> 20
                ),
                _ => plain.message(),
            };
            let out = OaiError::from_status(plain.status, message).into_response();
            plain.answer(out)
        }
    }
}
