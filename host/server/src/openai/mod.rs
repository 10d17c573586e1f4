//! The OpenAI-compatible endpoint under `/v1`: `GET /v1/models`, `POST /v1/completions` and
//! `POST /v1/chat/completions` (`stream: true` answers with server-sent events; with `tools`,
//! tool calls), and the token endpoints `POST /v1/generate`, `/v1/tokenize`, `/v1/detokenize`,
//! for the models given to `anneal serve --model PATH`.
//!
//! ```text
//! models.rs     loading --model paths (checkpoint step dirs, HF dirs): names, tokenizer, stops
//! template.rs   chat templates (Jinja, as transformers renders them) and the fallback format
//! chat.rs       rendering a chat prompt on a blocking thread, bounded and cancellable
//! request.rs    reading and checking request fields (errors name the field)
//! tool_calls.rs a completion's tool calls in OpenAI's shape, whole or streamed
//! tokens.rs     token ids in and out: /v1/generate, /v1/tokenize, /v1/detokenize
//! generate.rs   queueing choices on the model's decode loop (anneal_runtime::serving) and
//!               turning token events into text updates (stop strings, logprobs)
//! text.rs       incremental detokenization with stop strings
//! responses.rs  response bodies and stream chunks in OpenAI's shapes
//! error.rs      OpenAI's error shape, for every failure under /v1
//! ```
//!
//! Concurrent requests to one model share its decode loop: each choice joins the running batch
//! at the next step (continuous batching). With a server token, every call needs
//! `Authorization: Bearer <token>` (the client's `api_key`), as the rest of the API does.

mod chat;
mod error;
mod generate;
mod images;
pub mod models;
mod request;
mod responses;
pub use anneal_data::chat::template;
mod text;
mod tokens;
mod tool_calls;

pub use error::{openai_errors, refusal, MAX_CHAT_REQUEST_BYTES, MAX_REQUEST_BYTES};
pub use models::{load_models, ModelError, ServedModel};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use error::{OaiError, OaiResult};
use request::{Api, Body, GenOptions};
use responses::{Collector, Header};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc::unbounded_channel;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// What the `/v1` handlers share.
pub struct OpenAi {
    models: Vec<Arc<ServedModel>>,
    token: Option<String>,
    renders: chat::Renders,
}

impl OpenAi {
    fn find(&self, name: &str) -> OaiResult<Arc<ServedModel>> {
        self.models
            .iter()
            .find(|m| m.id == name)
            .cloned()
            .ok_or_else(|| OaiError::no_model(name))
    }
}

/// The `/v1` routes (to be nested under `/v1`) for `models`; with `token`, calls need it.
pub fn routes(models: Vec<Arc<ServedModel>>, token: Option<String>) -> Router {
    let state = Arc::new(OpenAi {
        models,
        token,
        renders: chat::Renders::for_this_machine(),
    });
    Router::new()
        .route("/models", get(list_models))
        .route("/models/{id}", get(show_model))
        .route("/completions", post(completions))
        .route(
            "/chat/completions",
            post(chat_completions).layer(DefaultBodyLimit::max(MAX_CHAT_REQUEST_BYTES)),
        )
        .route("/generate", post(token_generate))
        .route(
            "/tokenize",
            post(tokenize).layer(DefaultBodyLimit::max(MAX_CHAT_REQUEST_BYTES)),
        )
        .route("/detokenize", post(detokenize))
        .fallback(|| async { OaiError::no_route() })
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            require_token,
        ))
        // Outermost: what axum answers by itself (a body over the limit, a wrong method)
        // gets OpenAI's shape too.
        .layer(axum::middleware::from_fn(openai_errors))
        .with_state(state)
}

/// With a token configured, every call needs `Authorization: Bearer <token>`.
async fn require_token(State(state): State<Arc<OpenAi>>, request: Request, next: Next) -> Response {
    let Some(token) = &state.token else {
        return next.run(request).await;
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given.is_some_and(|g| crate::api::constant_time_eq(g.as_bytes(), token.as_bytes())) {
        next.run(request).await
    } else {
        OaiError::unauthorized().into_response()
    }
}

fn model_json(m: &ServedModel) -> Value {
    json!({
        "id": m.id,
        "object": "model",
        "created": m.created,
        "owned_by": "anneal",
        "max_model_len": m.context,
    })
}

/// `GET /v1/models`.
async fn list_models(State(state): State<Arc<OpenAi>>) -> Json<Value> {
    let data: Vec<Value> = state.models.iter().map(|m| model_json(m)).collect();
    Json(json!({ "object": "list", "data": data }))
}

/// `GET /v1/models/{id}`.
async fn show_model(State(state): State<Arc<OpenAi>>, Path(id): Path<String>) -> Response {
    match state.find(&id) {
        Ok(m) => Json(model_json(&m)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/completions`.
async fn completions(State(state): State<Arc<OpenAi>>, body: Bytes) -> Response {
    respond(&state, Api::Completions, &body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/chat/completions`.
async fn chat_completions(State(state): State<Arc<OpenAi>>, body: Bytes) -> Response {
    respond(&state, Api::Chat, &body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/generate`: token ids in, token ids and logprobs out.
async fn token_generate(State(state): State<Arc<OpenAi>>, body: Bytes) -> Response {
    json_or_error(tokens::generate(&state, &body).await)
}

/// `POST /v1/tokenize`.
async fn tokenize(State(state): State<Arc<OpenAi>>, body: Bytes) -> Response {
    json_or_error(tokens::tokenize(&state, &body).await)
}

/// `POST /v1/detokenize`.
async fn detokenize(State(state): State<Arc<OpenAi>>, body: Bytes) -> Response {
    json_or_error(tokens::detokenize(&state, &body).await)
}

fn json_or_error(result: OaiResult<Value>) -> Response {
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Both endpoints: check the request, queue its choices, answer with one body or a stream.
async fn respond(state: &OpenAi, api: Api, bytes: &[u8]) -> OaiResult<Response> {
    let body = Body::parse(bytes)?;
    let name: String = body.require("model")?;
    let model = state.find(&name)?;
    let opts = GenOptions::parse(&body, api)?;
    let mut tool_calls = false;
    let prompts = match api {
        Api::Completions => request::completion_prompts(&body, &model)?
            .into_iter()
            .map(generate::Prompt::text)
            .collect(),
        Api::Chat => {
            let mut chat = request::chat_messages(&body)?;
            if let Some(tools) = request::chat_tools(&body, bytes)? {
                tool_calls = tools.parse_calls;
                chat.tools = Some(tools.tools);
            }
            vec![chat::prompt(&model, chat, &state.renders).await?]
        }
    };
    let budgets = prompts
        .into_iter()
        .map(|p| {
            let budget = request::token_budget(p.tokens.len(), &model, &opts, api)?;
            Ok((p, budget))
        })
        .collect::<OaiResult<Vec<_>>>()?;
    let header = Header::new(api, &model.id);
    let running = generate::start(model, budgets, opts.clone())?;
    if opts.stream {
        return Ok(stream(header, running, opts, tool_calls));
    }
    let mut collector =
        Collector::new(running.choices(), opts.logprobs.is_some()).with_tool_calls(tool_calls);
    let usage = running
        .drive(|u| {
            collector.add(u);
            true
        })
        .await?;
    Ok(Json(collector.body(&header, usage)).into_response())
}

/// Server-sent events: `data: {chunk}` per update, an error object if generation fails, the
/// usage when asked for, then `data: [DONE]`. A client that disconnects cancels its choices.
/// With `tool_calls`, each chat choice's text goes through a [`tool_calls::ToolStream`]: the
/// calls come as one `delta.tool_calls` chunk before the finish chunk (`tool_calls`).
fn stream(
    header: Header,
    running: generate::Running,
    opts: GenOptions,
    tool_calls: bool,
) -> Response {
    let (tx, rx) = unbounded_channel::<Result<SseEvent, Infallible>>();
    tokio::spawn(async move {
        let send = |v: Value| tx.send(Ok(SseEvent::default().data(v.to_string()))).is_ok();
        if header.api == Api::Chat {
            for index in 0..running.choices() {
                if !send(responses::role_chunk(&header, index)) {
                    return;
                }
            }
        }
        let logprobs = opts.logprobs.is_some();
        let mut splits: Vec<tool_calls::ToolStream> = (0..running.choices())
            .map(|_| tool_calls::ToolStream::default())
            .collect();
        let mut emit = |u: generate::Update| {
            if !tool_calls {
                return send(responses::chunk(&header, &u, logprobs));
            }
            match u {
                generate::Update::Delta {
                    index,
                    text,
                    logprobs: lps,
                } => {
                    let text = splits[index].push(&text);
                    if text.is_empty() && lps.is_empty() {
                        return true;
                    }
                    let u = generate::Update::Delta {
                        index,
                        text,
                        logprobs: lps,
                    };
                    send(responses::chunk(&header, &u, logprobs))
                }
                generate::Update::Finish { index, reason } => {
                    let end = splits[index].finish();
                    if !end.content.is_empty() {
                        let u = generate::Update::Delta {
                            index,
                            text: end.content,
                            logprobs: vec![],
                        };
                        if !send(responses::chunk(&header, &u, logprobs)) {
                            return false;
                        }
                    }
                    let reason = match end.calls.is_empty() {
                        true => reason,
                        false => {
                            if !send(responses::tool_calls_chunk(&header, index, end.calls)) {
                                return false;
                            }
                            "tool_calls"
                        }
                    };
                    send(responses::chunk(
                        &header,
                        &generate::Update::Finish { index, reason },
                        logprobs,
                    ))
                }
            }
        };
        match running.drive(&mut emit).await {
            Ok(usage) if opts.include_usage => {
                send(responses::usage_chunk(&header, usage));
            }
            Ok(_) => {}
            Err(e) => {
                send(e.body());
            }
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
    });
    Sse::new(UnboundedReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}
