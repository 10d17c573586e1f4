//! A chat request's prompt: its messages rendered by the model's template and tokenized, and
//! its images read and their placeholders expanded, on a blocking thread (a template is the
//! model's code and may loop, and images take time to decode; the async workers must stay free
//! to answer everyone else, `/api/health` included).
//!
//! At most [`Renders::new`]'s count of renders run at once (each holds a thread, and memory up
//! to its fuel); a request that waits longer than a render's time limit for a turn is answered
//! 503. A render is held to the template's [`RenderLimits`](super::template::RenderLimits) and
//! is cancelled when its request is dropped (the client went away) or waited on too long.

use super::error::{OaiError, OaiResult};
use super::generate::Prompt;
use super::images;
use super::models::ServedModel;
use super::request::{self, ChatInput};
use super::template::TemplateError;
use axum::http::StatusCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// The turns for chat template renders that the `/v1` handlers share.
#[derive(Clone)]
pub struct Renders(Arc<Semaphore>);

impl Renders {
    /// Turns for `n` renders at once (at least one).
    pub fn new(n: usize) -> Renders {
        Renders(Arc::new(Semaphore::new(n.max(1))))
    }

    /// One per core, at most 4: a few runaway templates cannot take every core or much memory.
    pub fn for_this_machine() -> Renders {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Renders::new(cores.min(4))
    }
}

/// Sets the flag when dropped: a handler future dropped with its client stops its render.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The prompt of a chat request for `model`: tokens, and images when its messages hold some.
pub async fn prompt(
    model: &Arc<ServedModel>,
    chat: ChatInput,
    renders: &Renders,
) -> OaiResult<Prompt> {
    if let (Some(first), None) = (chat.images.first(), &model.vision) {
        return Err(OaiError::invalid(
            Some(&first.param),
            format!(
                "model `{}` reads no images: it is a text-only model (no preprocessor_config.json)",
                model.id
            ),
        )
        .with_code("images_not_supported"));
    }
    let template = model
        .template
        .as_ref()
        .map_err(|e| OaiError::server(e.clone()))?;
    if chat.tools.is_some() && template.is_fallback() {
        return Err(OaiError::invalid(
            Some("tools"),
            format!(
                "model `{}` has no chat template, and the plain `role: content` format it falls back to cannot show tools",
                model.id
            ),
        ));
    }
    let limits = template.limits();
    let busy = || OaiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: format!(
            "the server is busy rendering other chat templates (waited {} s); try again",
            limits.max_time.as_secs_f64()
        ),
        kind: "server_error",
        param: None,
        code: Some("server_busy"),
    };
    let permit = tokio::time::timeout(limits.max_time, Arc::clone(&renders.0).acquire_owned())
        .await
        .map_err(|_| busy())?
        .map_err(|_| busy())?;
    let cancel = Arc::new(AtomicBool::new(false));
    let _cancel_on_drop = CancelOnDrop(Arc::clone(&cancel));
    let job = {
        let model = Arc::clone(model);
        let cancel = Arc::clone(&cancel);
        tokio::task::spawn_blocking(move || {
            // The turn is given back when the render has really stopped.
            let _permit = permit;
            let template = model
                .template
                .as_ref()
                .map_err(|e| OaiError::server(e.clone()))?;
            let text = template
                .render_request(
                    &chat.messages,
                    chat.tools.as_ref(),
                    chat.add_generation_prompt,
                    &cancel,
                )
                .map_err(template_error)?;
            let tokens = request::encode(&model, &text, "messages")?;
            match &model.vision {
                Some(vision) if !chat.images.is_empty() => {
                    let (tokens, images) = images::attach(vision, tokens, &chat.images)?;
                    Ok(Prompt {
                        tokens,
                        images: Some(images),
                    })
                }
                _ => Ok(Prompt::text(tokens)),
            }
        })
    };
    // The render checks its own clock whenever it writes and its fuel ends a silent loop; this
    // bound (a little later) covers what neither catches, such as one slow filter call.
    let waited = limits.max_time + Duration::from_secs(2);
    match tokio::time::timeout(waited, job).await {
        Ok(Ok(result)) => result,
        Ok(Err(e)) => Err(OaiError::server(format!(
            "rendering the chat template failed: {e}"
        ))),
        Err(_) => Err(template_error(TemplateError::Limit(format!(
            "it ran past {} s",
            limits.max_time.as_secs_f64()
        )))),
    }
}

/// A template failure as the request's error: the messages made the model's template fail or
/// run past its limits.
fn template_error(e: TemplateError) -> OaiError {
    match e {
        TemplateError::Limit(_) => {
            OaiError::invalid(Some("messages"), e.to_string()).with_code("chat_template_limit")
        }
        TemplateError::Cancelled => OaiError::server(e.to_string()),
        _ => OaiError::invalid(Some("messages"), e.to_string()),
    }
}
