//! Tokens in, tokens out, for agent harnesses that keep a conversation as token ids (RL
//! rollouts: verifiers, prime-rl, verl's agent loop) and must never tokenize the model's own
//! output again:
//!
//! - `POST /v1/generate`: `prompt_token_ids` → the sampled `token_ids` with the `logprobs` of
//!   each under the served model, the stop token included (as vLLM's and SGLang's token
//!   endpoints report it), so a harness appends them and the next turn's tokens as they are.
//! - `POST /v1/tokenize`: `text` (or `prompt`), or `messages` (+ `tools`,
//!   `add_generation_prompt`) rendered as `/v1/chat/completions` renders them → `token_ids`.
//! - `POST /v1/detokenize`: `token_ids` → `text` (special tokens included).
//!
//! Generation runs on the model's decode loop like every other request, which is
//! batch-invariant, so a token's logprob equals, bit for bit, the one `anneal logprobs` gives
//! at its position of the whole sequence, whatever else the server is running.

use super::error::{OaiError, OaiResult};
use super::generate::fresh_seed;
use super::request::{self, Body, SamplingFields};
use super::OpenAi;
use anneal_runtime::infer::Sampling;
use anneal_runtime::serving::{Event, Finish, Request, ServingError};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc::unbounded_channel;

/// Token ids of field `key`: a list of integers.
fn ids(body: &Body, key: &str) -> OaiResult<Option<Vec<i64>>> {
    body.get::<Vec<i64>>(key)
}

/// `POST /v1/generate`.
pub async fn generate(state: &OpenAi, bytes: &[u8]) -> OaiResult<Value> {
    let body = Body::parse(bytes)?;
    let name: String = body.require("model")?;
    let model = state.find(&name)?;
    let prompt = ids(&body, "prompt_token_ids")?.ok_or_else(|| {
        OaiError::invalid(Some("prompt_token_ids"), "`prompt_token_ids` is required")
    })?;
    if prompt.is_empty() {
        return Err(OaiError::invalid(
            Some("prompt_token_ids"),
            "`prompt_token_ids` is empty",
        ));
    }
    if body.raw("images").is_some() {
        return Err(OaiError::unsupported(
            "images",
            "token prompts are text only for now: send images through /v1/chat/completions",
        ));
    }
    let SamplingFields {
        temperature,
        top_p,
        top_k,
        seed,
    } = SamplingFields::parse(&body)?;
    let extra_stops = ids(&body, "stop_token_ids")?.unwrap_or_default();
    let ignore_eos = body.get::<bool>("ignore_eos")?.unwrap_or(false);
    let max_tokens = match body.get::<i64>("max_tokens")? {
        Some(m) if m < 1 => {
            return Err(OaiError::invalid(
                Some("max_tokens"),
                format!("`max_tokens` must be at least 1, got {m}"),
            ))
        }
        m => m.map(|m| m as usize),
    };
    if prompt.len() >= model.context {
        return Err(OaiError::invalid(
            Some("prompt_token_ids"),
            format!(
                "This model's maximum context length is {} tokens, but the prompt has {} tokens",
                model.context,
                prompt.len()
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = model.context - prompt.len();
    let mut stop_tokens = match ignore_eos {
        true => vec![],
        false => model.stop_ids.clone(),
    };
    stop_tokens.extend(extra_stops);
    let prompt_tokens = prompt.len();
    let request = Request {
        prompt,
        max_new: max_tokens.unwrap_or(room).min(room),
        sampling: Sampling {
            temperature,
            top_k,
            top_p,
            seed: seed.unwrap_or_else(fresh_seed),
            eos: None,
        },
        stop_tokens,
        top_logprobs: 0,
        images: None,
    };
    let (tx, mut rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let _cancel_on_drop = CancelOnDrop(Arc::clone(&cancel));
    let stop = Arc::clone(&cancel);
    let sink = Box::new(move |e| !stop.load(Ordering::Relaxed) && tx.send(e).is_ok());
    model.scheduler.submit(request, sink).map_err(|e| match e {
        ServingError::TokenOutOfRange { .. } | ServingError::EmptyPrompt => {
            OaiError::invalid(Some("prompt_token_ids"), e.to_string())
        }
        e => OaiError::server(e.to_string()),
    })?;
    let (mut token_ids, mut logprobs) = (Vec::new(), Vec::new());
    let finish = loop {
        match rx.recv().await {
            Some(Event::Token(t)) => {
                token_ids.push(t.id);
                logprobs.push(t.logprob);
            }
            Some(Event::Done(Finish::Stop)) => break "stop",
            Some(Event::Done(Finish::Length)) => break "length",
            Some(Event::Failed(msg)) => {
                return Err(OaiError::server(format!("generation failed: {msg}")))
            }
            None => return Err(OaiError::server("the model's decode loop stopped")),
        }
    };
    let completion_tokens = token_ids.len();
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(json!({
        "id": format!("gen-{:016x}", fresh_seed()),
        "object": "generate",
        "created": created,
        "model": model.id,
        "token_ids": token_ids,
        "logprobs": logprobs,
        "finish_reason": finish,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }))
}

/// Sets the flag when dropped: a request whose client went away leaves the batch.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// `POST /v1/tokenize`.
pub async fn tokenize(state: &OpenAi, bytes: &[u8]) -> OaiResult<Value> {
    let body = Body::parse(bytes)?;
    let name: String = body.require("model")?;
    let model = state.find(&name)?;
    let text = match body.get::<String>("text")? {
        Some(t) => Some((t, "text")),
        None => body.get::<String>("prompt")?.map(|t| (t, "prompt")),
    };
    let token_ids = match (text, body.raw("messages")) {
        (Some((text, param)), None) => request::encode(&model, &text, param)?,
        (None, Some(_)) => {
            let mut chat = request::chat_messages(&body)?;
            chat.tools = request::chat_tools(&body, bytes)?.map(|t| t.tools);
            chat.add_generation_prompt = body.get::<bool>("add_generation_prompt")?.unwrap_or(true);
            super::chat::prompt(&model, chat, &state.renders)
                .await?
                .tokens
        }
        _ => {
            return Err(OaiError::invalid(
                None,
                "give `text` (or `prompt`) or `messages`, not both",
            ))
        }
    };
    Ok(json!({
        "token_ids": token_ids,
        "count": token_ids.len(),
        "max_model_len": model.context,
    }))
}

/// `POST /v1/detokenize`.
pub async fn detokenize(state: &OpenAi, bytes: &[u8]) -> OaiResult<Value> {
    let body = Body::parse(bytes)?;
    let name: String = body.require("model")?;
    let model = state.find(&name)?;
    let token_ids = ids(&body, "token_ids")?
        .ok_or_else(|| OaiError::invalid(Some("token_ids"), "`token_ids` is required"))?;
    let vocab = model.tokenizer.vocab_size() as i64;
    if let Some(i) = token_ids.iter().position(|&t| !(0..vocab).contains(&t)) {
        return Err(OaiError::invalid(
            Some("token_ids"),
            format!(
                "`token_ids[{i}]` = {} is outside the tokenizer's vocabulary (0..{vocab})",
                token_ids[i]
            ),
        ));
    }
    let ids: Vec<u32> = token_ids.iter().map(|&t| t as u32).collect();
    let text = model
        .tokenizer
        .decode(&ids)
        .map_err(|e| OaiError::invalid(Some("token_ids"), format!("cannot decode: {e}")))?;
    Ok(json!({ "text": text }))
}
