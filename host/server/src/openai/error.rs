//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP
//! status OpenAI uses for the same failure.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

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
            message: "no such endpoint: this server answers /v1/models, /v1/completions and /v1/chat/completions".into(),
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
