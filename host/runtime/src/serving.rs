//! Continuous batching: one decode loop per served model, on its own thread, that many
//! requests share.
//!
//! ```text
//! submit ──► inbox ──► [decode thread]  loop:
//!                        take what arrived; prefill new prompts (grouped by length), each
//!                          into its own single-row KV cache, and sample their first token
//!                        one decode step for every running row: ids [B, 1] at positions
//!                          [B, 1] (each row's own length) over KvCache::per_row(rows)
//!                        hand each row's token to its sink; rows that finished (a stop token,
//!                          max tokens) or whose receiver went away leave the batch
//! ```
//!
//! Requests therefore join the running batch at the next step and leave it as soon as they are
//! done, instead of waiting for a whole batch. The loop runs batch-invariant (fixed matmul
//! tiles) and attention runs row by row over each row's own cache, so a request's tokens and
//! logprobs are the same, bit for bit, alone or next to any others, and equal those of
//! [`crate::infer::generate`] with the same sampling settings (tested).

use crate::infer::{pick, Generation, Sampling};
use crate::plugins::{ForwardOpts, ImageInputs, KvCache, Params, PluginModel};
use anneal_engine::invariant::set_batch_invariant;
use anneal_engine::rng::RngKey;
use anneal_engine::{autograd, Tensor};
use std::collections::{BTreeMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// One completion to decode.
#[derive(Clone, Debug)]
pub struct Request {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<i64>,
    /// Generate at most this many tokens.
    pub max_new: usize,
    /// Temperature, top-k, top-p and the seed of the request's sampling stream; `eos`, when
    /// set, is one more stop token.
    pub sampling: Sampling,
    /// Tokens that end the completion (included as its last token).
    pub stop_tokens: Vec<i64>,
    /// How many of the most likely alternatives to report with each token (0 = none).
    pub top_logprobs: usize,
    /// The prompt's images, in the order of their placeholder runs (the prompt holds each
    /// image's placeholder tokens already expanded). Only the prefill reads them: a request
    /// with images is prefilled alone, and decode continues its 3-D positions from its cache.
    pub images: Option<Arc<ImageInputs>>,
}

/// One generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct Token {
    /// Its id.
    pub id: i64,
    /// `log p(id)` under the model (before temperature and truncation).
    pub logprob: f32,
    /// The `top_logprobs` most likely ids at this step with their logprobs, most likely first.
    pub top: Vec<(i64, f32)>,
}

/// Why a completion ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// It produced a stop token.
    Stop,
    /// It reached `max_new` tokens.
    Length,
}

/// What a request's sink receives: its tokens as they come, then how it ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The next token.
    Token(Token),
    /// The last event of a completed request.
    Done(Finish),
    /// The last event of a request the model failed on (the message says why).
    Failed(String),
}

/// Receives a request's events on the decode thread; returning `false` cancels the request
/// (it leaves the batch before the next step). It should not block.
pub type Sink = Box<dyn FnMut(Event) -> bool + Send>;

/// Settings of a decode loop.
#[derive(Clone, Debug)]
pub struct SchedulerOptions {
    /// Most rows decoded together; more requests wait for a free row.
    pub max_batch: usize,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        // Batch-invariant matrix products work on 64-row tiles: up to 64 rows cost about as
        // much per step as one.
        SchedulerOptions {
            max_batch: anneal_engine::invariant::TILE,
        }
    }
}

/// Counters of a decode loop, for tests and logs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    /// Requests accepted.
    pub requests: u64,
    /// Prefill forwards run (one per group of same-length prompts joining at once).
    pub prefills: u64,
    /// Decode steps run.
    pub steps: u64,
    /// Tokens generated.
    pub tokens: u64,
    /// The most rows one decode step had.
    pub max_rows: usize,
}

/// Why a request was refused.
#[derive(Debug, thiserror::Error)]
pub enum ServingError {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A prompt token is not in the model's vocabulary.
    #[error("token id {token} is outside the vocabulary (0..{vocab})")]
    TokenOutOfRange {
        /// The token.
        token: i64,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The decode loop has stopped (the scheduler is shutting down).
    #[error("the model's decode loop has stopped")]
    Stopped,
    /// The model failed on this request.
    #[error("generation failed: {0}")]
    Failed(String),
}

/// A finished completion, as [`Scheduler::complete`] returns it.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The tokens and their logprobs.
    pub generation: Generation,
    /// Why it ended.
    pub finish: Finish,
}

struct Job {
    request: Request,
    sink: Sink,
}

/// The decode loop of one model: accepts requests from any thread and decodes them together.
/// Dropping it stops the loop (requests still running get [`Event::Failed`]).
pub struct Scheduler {
    inbox: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<Mutex<Stats>>,
    vocab: usize,
}

impl Scheduler {
    /// Starts the decode thread for `model` with `params`.
    pub fn start(
        model: Arc<PluginModel>,
        params: Params,
        options: SchedulerOptions,
    ) -> std::io::Result<Scheduler> {
        let (inbox, jobs) = mpsc::channel();
        let stats = Arc::new(Mutex::new(Stats::default()));
        let vocab = model.spec().vocab_size;
        let worker = Worker {
            model,
            params,
            max_batch: options.max_batch.max(1),
            stats: stats.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("anneal-decode".into())
            .spawn(move || worker.run(jobs))?;
        Ok(Scheduler {
            inbox: Some(inbox),
            thread: Some(thread),
            stats,
            vocab,
        })
    }

    /// Queues `request`; its events go to `sink` on the decode thread.
    pub fn submit(&self, request: Request, sink: Sink) -> Result<(), ServingError> {
        if request.prompt.is_empty() {
            return Err(ServingError::EmptyPrompt);
        }
        if let Some(&token) = request
            .prompt
            .iter()
            .find(|&&t| t < 0 || t as usize >= self.vocab)
        {
            return Err(ServingError::TokenOutOfRange {
                token,
                vocab: self.vocab,
            });
        }
        self.stats.lock().expect("stats lock poisoned").requests += 1;
        let inbox = self.inbox.as_ref().ok_or(ServingError::Stopped)?;
        inbox
            .send(Job { request, sink })
            .map_err(|_| ServingError::Stopped)
    }

    /// Queues `request`; its events arrive on the returned channel (dropping it cancels).
    pub fn submit_channel(&self, request: Request) -> Result<Receiver<Event>, ServingError> {
        let (tx, rx) = mpsc::channel();
        self.submit(request, Box::new(move |e| tx.send(e).is_ok()))?;
        Ok(rx)
    }

    /// Decodes `request` (alongside whatever else is running) and waits for the result.
    pub fn complete(&self, request: Request) -> Result<Completion, ServingError> {
        let rx = self.submit_channel(request)?;
        let mut generation = Generation {
            tokens: vec![],
            logprobs: vec![],
        };
        for event in rx {
            match event {
                Event::Token(t) => {
                    generation.tokens.push(t.id);
                    generation.logprobs.push(t.logprob);
                }
                Event::Done(finish) => return Ok(Completion { generation, finish }),
                Event::Failed(msg) => return Err(ServingError::Failed(msg)),
            }
        }
        Err(ServingError::Stopped)
    }

    /// The loop's counters so far.
    pub fn stats(&self) -> Stats {
        self.stats.lock().expect("stats lock poisoned").clone()
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // Closing the inbox ends the loop after its current step.
        self.inbox.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A request in the running batch.
struct Row {
    request: Request,
    sink: Sink,
    /// Its own KV cache (single row), which it carries from batch to batch.
    cache: Arc<KvCache>,
    key: RngKey,
    /// Tokens produced so far; the last one is the next step's input.
    produced: Vec<i64>,
    /// Positions in its cache (prompt + produced tokens already fed back).
    len: usize,
    live: bool,
}

impl Row {
    /// Samples this row's next token from its logits, tells the sink, and retires the row when
    /// it is finished or cancelled.
    fn take_token(&mut self, logits: &[f32]) {
        let step = self.produced.len();
        let (id, logprob) = pick(logits, &self.request.sampling, &self.key, step);
        let id = id as i64;
        let top = top_logprobs(logits, self.request.top_logprobs);
        self.produced.push(id);
        let r = &self.request;
        let finish = if r.stop_tokens.contains(&id) || r.sampling.eos == Some(id) {
            Some(Finish::Stop)
        } else if self.produced.len() >= r.max_new {
            Some(Finish::Length)
        } else {
            None
        };
        self.live = (self.sink)(Event::Token(Token { id, logprob, top }));
        if let Some(f) = finish {
            if self.live {
                (self.sink)(Event::Done(f));
            }
            self.live = false;
        }
    }

    fn fail(&mut self, msg: &str) {
        if self.live {
            (self.sink)(Event::Failed(msg.to_string()));
        }
        self.live = false;
    }
}

/// The `k` most likely ids of a row of logits (ties to the lower id) with their logprobs.
fn top_logprobs(logits: &[f32], k: usize) -> Vec<(i64, f32)> {
    if k == 0 {
        return vec![];
    }
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    idx.truncate(k);
    // The normaliser once for the row: the same bits `token_logprob` gives.
    let lse = anneal_engine::logsumexp(logits);
    idx.into_iter()
        .map(|i| (i as i64, (logits[i] as f64 - lse) as f32))
        .collect()
}

struct Worker {
    model: Arc<PluginModel>,
    params: Params,
    max_batch: usize,
    stats: Arc<Mutex<Stats>>,
}

impl Worker {
    fn run(self, jobs: Receiver<Job>) {
        // The flags are per thread: everything this loop computes is inference, batch-invariant.
        let _no_grad = autograd::no_grad();
        let _invariant = set_batch_invariant(true);
        let mut waiting: VecDeque<Job> = VecDeque::new();
        let mut rows: Vec<Row> = Vec::new();
        loop {
            if rows.is_empty() && waiting.is_empty() {
                match jobs.recv() {
                    Ok(job) => waiting.push_back(job),
                    Err(_) => return,
                }
            }
            loop {
                match jobs.try_recv() {
                    Ok(job) => waiting.push_back(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        let msg = "the server is shutting down";
                        rows.iter_mut().for_each(|r| r.fail(msg));
                        for mut job in waiting {
                            (job.sink)(Event::Failed(msg.into()));
                        }
                        return;
                    }
                }
            }
            let free = self.max_batch.saturating_sub(rows.len()).min(waiting.len());
            let joining: Vec<Job> = waiting.drain(..free).collect();
            rows.extend(self.prefill(joining));
            rows.retain(|r| r.live);
            if !rows.is_empty() {
                self.decode_step(&mut rows);
                rows.retain(|r| r.live);
            }
        }
    }

    /// Prefills new requests, one forward per group of text prompts of the same length and one
    /// per prompt with images (each row into its own fresh cache), and samples their first
    /// tokens. Returns the rows still live.
    fn prefill(&self, jobs: Vec<Job>) -> Vec<Row> {
        let mut groups: BTreeMap<usize, Vec<Row>> = BTreeMap::new();
        let mut alone: Vec<Row> = Vec::new();
        for mut job in jobs {
            if job.request.max_new == 0 {
                (job.sink)(Event::Done(Finish::Length));
                continue;
            }
            let row = Row {
                key: RngKey::new(job.request.sampling.seed, "sampling"),
                cache: Arc::new(KvCache::new()),
                produced: Vec::new(),
                len: job.request.prompt.len(),
                live: true,
                request: job.request,
                sink: job.sink,
            };
            if row.request.images.is_some() {
                alone.push(row);
            } else {
                groups.entry(row.len).or_default().push(row);
            }
        }
        let groups = groups
            .into_values()
            .chain(alone.into_iter().map(|row| vec![row]));
        let mut out = Vec::new();
        for mut group in groups {
            let width = group[0].len;
            let images = group[0].request.images.clone();
            let ids: Vec<i64> = group
                .iter()
                .flat_map(|r| r.request.prompt.iter().copied())
                .collect();
            let positions: Vec<i64> = (0..group.len()).flat_map(|_| 0..width as i64).collect();
            self.stats.lock().expect("stats lock poisoned").prefills += 1;
            self.forward_rows(&mut group, ids, positions, width, images);
            out.extend(group.into_iter().filter(|r| r.live));
        }
        out
    }

    /// One decode step: every row feeds back its last token at its own position. Rows whose
    /// caches hold named state of different shapes (a model that keeps its own per-layer
    /// caches and reads them by shape, as DeepSeek-V4's compressed ones) cannot stack in one
    /// forward: each group of rows whose shapes agree runs its own, which batch-invariant
    /// kernels make invisible in the results. Models whose rows always agree (plain KV
    /// caches, fixed-size states) stay one forward.
    fn decode_step(&self, rows: &mut [Row]) {
        {
            let mut s = self.stats.lock().expect("stats lock poisoned");
            s.steps += 1;
            s.max_rows = s.max_rows.max(rows.len());
        }
        rows.sort_by_cached_key(|r| r.cache.state_shapes());
        let mut start = 0;
        while start < rows.len() {
            let shapes = rows[start].cache.state_shapes();
            let end = start
                + rows[start..]
                    .iter()
                    .take_while(|r| r.cache.state_shapes() == shapes)
                    .count();
            let group = &mut rows[start..end];
            let ids: Vec<i64> = group
                .iter()
                .map(|r| {
                    *r.produced
                        .last()
                        .expect("a running row has produced a token")
                })
                .collect();
            let positions: Vec<i64> = group.iter().map(|r| r.len as i64).collect();
            group.iter_mut().for_each(|r| r.len += 1);
            self.forward_rows(group, ids, positions, 1, None);
            start = end;
        }
    }

    /// Runs `ids` (`[rows, width]`) at `positions` (same shape) over the rows' own caches,
    /// with `images` when the prompt holds some, and gives each row the logits of its last
    /// position. A failure fails every row of the call.
    fn forward_rows(
        &self,
        rows: &mut [Row],
        ids: Vec<i64>,
        positions: Vec<i64>,
        width: usize,
        images: Option<Arc<ImageInputs>>,
    ) {
        let n = rows.len();
        let caches: Vec<Arc<KvCache>> = rows.iter().map(|r| r.cache.clone()).collect();
        let run = || -> anneal_engine::Result<Vec<f32>> {
            let device = crate::infer::device_of(&self.params);
            let ids = Tensor::from_vec(ids, &[n, width])?.to_device(device)?;
            let positions = Tensor::from_vec(positions, &[n, width])?;
            let images = match images {
                Some(im) => Some(Arc::new(ImageInputs {
                    pixel_values: im.pixel_values.to_device(device)?,
                    grid_thw: im.grid_thw.clone(),
                })),
                None => None,
            };
            let opts = ForwardOpts {
                cache: Some(Arc::new(KvCache::per_row(caches))),
                images,
                ..Default::default()
            };
            let logits = self.model.forward(&self.params, &ids, &positions, &opts)?;
            let v = logits.shape()[2];
            Ok(logits
                .narrow(1, width - 1, 1)?
                .reshape(&[n, v])?
                .to_vec_f32())
        };
        // A panic in the host (a broken invariant) fails these requests, not the loop.
        let result = match catch_unwind(AssertUnwindSafe(run)) {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err("internal error in the decode loop (panic)".to_string()),
        };
        match result {
            Ok(last) => {
                let v = last.len() / n.max(1);
                let mut tokens = 0;
                for (i, row) in rows.iter_mut().enumerate() {
                    row.take_token(&last[i * v..(i + 1) * v]);
                    tokens += 1;
                }
                self.stats.lock().expect("stats lock poisoned").tokens += tokens;
            }
            Err(msg) => rows.iter_mut().for_each(|r| r.fail(&msg)),
        }
    }
}
