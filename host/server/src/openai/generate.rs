//! Running a request's choices on the model's decode loop and turning their token events into
//! text updates (both endpoints, streaming or not).

use super::error::{OaiError, OaiResult};
use super::models::ServedModel;
use super::request::GenOptions;
use super::text::TextStream;
use anneal_runtime::infer::Sampling;
use anneal_runtime::plugins::ImageInputs;
use anneal_runtime::serving::{Event, Finish, Request, ServingError, Token};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// One token in a logprobs report.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    /// The token.
    pub token: TokenText,
    /// Its logprob.
    pub logprob: f32,
    /// Where its text starts in the choice's text (bytes).
    pub offset: usize,
    /// The most likely alternatives with their logprobs, most likely first.
    pub top: Vec<(TokenText, f32)>,
}

/// A token as a logprobs report shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenText {
    /// Its id.
    pub id: i64,
    /// Its text; for bytes that are not UTF-8 (part of a character) `bytes:\xe2\x80`, as
    /// OpenAI writes them, so different tokens print differently.
    pub text: String,
    /// Its exact bytes.
    pub bytes: Vec<u8>,
}

impl TokenText {
    /// Token `id` of `tokenizer`.
    pub fn new(tokenizer: &anneal_data::TextTokenizer, id: i64) -> TokenText {
        let bytes = tokenizer.token_bytes(u32::try_from(id).unwrap_or(u32::MAX));
        let text = match std::str::from_utf8(&bytes) {
            Ok(text) => text.to_string(),
            Err(_) => bytes.iter().fold(String::from("bytes:"), |mut s, b| {
                s.push_str(&format!("\\x{b:02x}"));
                s
            }),
        };
        TokenText { id, text, bytes }
    }
}

/// What the choices of a request produce, in order.
#[derive(Debug)]
pub enum Update {
    /// New text of choice `index` (possibly empty when only logprobs are new).
    Delta {
        /// The choice.
        index: usize,
        /// Its new text.
        text: String,
        /// Logprobs of the tokens behind it (when asked for).
        logprobs: Vec<TokenLogprob>,
    },
    /// Choice `index` ended (`stop` or `length`).
    Finish {
        /// The choice.
        index: usize,
        /// OpenAI's `finish_reason`.
        reason: &'static str,
    },
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    /// Prompt tokens (each prompt once, whatever `n`).
    pub prompt: usize,
    /// Generated tokens over all choices.
    pub completion: usize,
}

/// The choices of one request, running: choice `p * n + j` is completion `j` of prompt `p`.
pub struct Running {
    model: Arc<ServedModel>,
    opts: GenOptions,
    events: UnboundedReceiver<(usize, Event)>,
    cancel: Vec<Arc<AtomicBool>>,
    prompt_tokens: usize,
}

impl Drop for Running {
    fn drop(&mut self) {
        // A client that went away takes its rows out of the batch.
        self.cancel
            .iter()
            .for_each(|c| c.store(true, Ordering::Relaxed));
    }
}

/// A seed for requests that give none.
pub(super) fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

/// One prompt of a request: its tokens (image placeholders expanded) and its images.
pub struct Prompt {
    /// The token ids.
    pub tokens: Vec<i64>,
    /// The images of its placeholder runs, in order.
    pub images: Option<Arc<ImageInputs>>,
}

impl Prompt {
    /// A prompt of text tokens.
    pub fn text(tokens: Vec<i64>) -> Prompt {
        Prompt {
            tokens,
            images: None,
        }
    }
}

/// Queues every choice of `prompts` (each with its token budget) on the model's decode loop.
pub fn start(
    model: Arc<ServedModel>,
    prompts: Vec<(Prompt, usize)>,
    opts: GenOptions,
) -> OaiResult<Running> {
    let (tx, events) = unbounded_channel();
    let seed = opts.seed.unwrap_or_else(fresh_seed);
    let prompt_tokens = prompts.iter().map(|(p, _)| p.tokens.len()).sum();
    let mut cancel = Vec::new();
    for (p, (prompt, max_new)) in prompts.into_iter().enumerate() {
        for j in 0..opts.n {
            let index = p * opts.n + j;
            let request = Request {
                prompt: prompt.tokens.clone(),
                max_new,
                sampling: Sampling {
                    temperature: opts.temperature,
                    top_k: opts.top_k,
                    top_p: opts.top_p,
                    seed: seed.wrapping_add(j as u64),
                    eos: None,
                },
                stop_tokens: model.stop_ids.clone(),
                top_logprobs: opts.logprobs.unwrap_or(0),
                images: prompt.images.clone(),
            };
            let flag = Arc::new(AtomicBool::new(false));
            let (tx, stop) = (tx.clone(), flag.clone());
            let sink =
                Box::new(move |e| !stop.load(Ordering::Relaxed) && tx.send((index, e)).is_ok());
            model.scheduler.submit(request, sink).map_err(|e| match e {
                ServingError::TokenOutOfRange { .. } | ServingError::EmptyPrompt => {
                    OaiError::invalid(Some("prompt"), e.to_string())
                }
                e => OaiError::server(e.to_string()),
            })?;
            cancel.push(flag);
        }
    }
    Ok(Running {
        model,
        opts,
        events,
        cancel,
        prompt_tokens,
    })
}

impl Running {
    /// The number of choices.
    pub fn choices(&self) -> usize {
        self.cancel.len()
    }

    /// Receives every choice's tokens until all have finished, calling `emit` with each update
    /// (`emit` returning false, e.g. a closed stream, stops everything). Returns the usage.
    pub async fn drive(mut self, mut emit: impl FnMut(Update) -> bool) -> OaiResult<Usage> {
        let model = self.model.clone();
        let (tok, stop) = (&model.tokenizer, self.opts.stop.clone());
        let mut texts: Vec<TextStream<'_>> = (0..self.choices())
            .map(|_| TextStream::new(tok, &stop))
            .collect();
        let mut open = self.choices();
        let mut done = vec![false; open];
        let mut usage = Usage {
            prompt: self.prompt_tokens,
            completion: 0,
        };
        let decode_err =
            |e: anneal_data::DataError| OaiError::server(format!("cannot decode the output: {e}"));
        while open > 0 {
            let Some((index, event)) = self.events.recv().await else {
                return Err(OaiError::server("the model's decode loop stopped"));
            };
            if done[index] {
                continue;
            }
            let finish = match event {
                Event::Token(t) => {
                    usage.completion += 1;
                    if model.stop_ids.contains(&t.id) {
                        // The end-of-text token ends the choice but adds no text; Done follows.
                        continue;
                    }
                    let logprobs = match self.opts.logprobs {
                        Some(_) => vec![self.logprob(&t, texts[index].offset())],
                        None => vec![],
                    };
                    let piece = texts[index].push(t.id).map_err(decode_err)?;
                    let news = !piece.text.is_empty() || !logprobs.is_empty();
                    let delta = Update::Delta {
                        index,
                        text: piece.text,
                        logprobs,
                    };
                    if news && !emit(delta) {
                        return Ok(usage);
                    }
                    if !piece.stopped {
                        continue;
                    }
                    self.cancel[index].store(true, Ordering::Relaxed);
                    "stop"
                }
                Event::Done(f) => {
                    let rest = texts[index].finish().map_err(decode_err)?;
                    if !rest.is_empty()
                        && !emit(Update::Delta {
                            index,
                            text: rest,
                            logprobs: vec![],
                        })
                    {
                        return Ok(usage);
                    }
                    match f {
                        Finish::Stop => "stop",
                        Finish::Length => "length",
                    }
                }
                Event::Failed(msg) => {
                    return Err(OaiError::server(format!("generation failed: {msg}")))
                }
            };
            done[index] = true;
            open -= 1;
            if !emit(Update::Finish {
                index,
                reason: finish,
            }) {
                return Ok(usage);
            }
        }
        Ok(usage)
    }

    fn logprob(&self, t: &Token, offset: usize) -> TokenLogprob {
        let tok = &self.model.tokenizer;
        TokenLogprob {
            token: TokenText::new(tok, t.id),
            logprob: t.logprob,
            offset,
            top: t
                .top
                .iter()
                .map(|&(id, lp)| (TokenText::new(tok, id), lp))
                .collect(),
        }
    }
}
