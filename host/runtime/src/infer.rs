//! Inference with a model plugin: log-probabilities of a sequence, and generation by prefill +
//! decode over the host's KV cache, with temperature / top-k / top-p sampling.

use crate::plugins::{
    AudioInputs, ForwardOpts, ImageInputs, KvCache, Params, PluginModel, ResidentTensorParallel,
    TensorParallelism,
};
use anneal_engine::invariant::set_batch_invariant;
use anneal_engine::rng::RngKey;
use anneal_engine::{autograd, Result, Tensor};
use std::sync::Arc;

/// A request the model cannot serve as asked: bad sampling settings or a sequence that does not
/// fit the model's positions. These are the caller's to fix (the CLI exits with code 2).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// Temperature negative or not a number.
    #[error("temperature {0} must be a finite number ≥ 0 (0 is greedy)")]
    Temperature(f32),
    /// Top-p outside `(0, 1]`.
    #[error("top_p {0} must be within (0, 1]")]
    TopP(f32),
    /// Fewer than two tokens to score.
    #[error("scoring needs at least two tokens, got {0}")]
    TooShort(usize),
    /// An empty prompt.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// More tokens than the model has positions.
    #[error("the sequence has {len} tokens, more than the model's {max} positions (max_seq_len)")]
    TooLong {
        /// Tokens given.
        len: usize,
        /// The model's `max_seq_len`.
        max: usize,
    },
    /// The prompt fills every position, so nothing can be generated.
    #[error("the prompt has {len} tokens and fills the model's {max} positions (max_seq_len); nothing is left to generate")]
    NoRoom {
        /// Prompt tokens.
        len: usize,
        /// The model's `max_seq_len`.
        max: usize,
    },
}

impl From<RequestError> for anneal_engine::Error {
    fn from(e: RequestError) -> Self {
        anneal_engine::Error::Invalid {
            op: "infer",
            msg: e.to_string(),
        }
    }
}

impl Sampling {
    /// Refuses settings that cannot define a distribution: a negative or NaN temperature, a
    /// top-p outside `(0, 1]`.
    pub fn validate(&self) -> std::result::Result<(), RequestError> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(RequestError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(RequestError::TopP(self.top_p));
        }
        Ok(())
    }
}

/// Checks that `len` tokens can be scored by a model with `max_seq_len` positions.
pub fn check_scoring(len: usize, max_seq_len: usize) -> std::result::Result<(), RequestError> {
    if len < 2 {
        return Err(RequestError::TooShort(len));
    }
    if len > max_seq_len {
        return Err(RequestError::TooLong {
            len,
            max: max_seq_len,
        });
    }
    Ok(())
}

/// How many tokens can follow a prompt of `prompt_len` tokens: `max_new`, capped so that prompt
/// and completion fit the model's `max_seq_len` positions. A prompt that leaves no room is an
/// error.
pub fn new_token_budget(
    prompt_len: usize,
    max_new: usize,
    max_seq_len: usize,
) -> std::result::Result<usize, RequestError> {
    if prompt_len == 0 {
        return Err(RequestError::EmptyPrompt);
    }
    if prompt_len > max_seq_len {
        return Err(RequestError::TooLong {
            len: prompt_len,
            max: max_seq_len,
        });
    }
    if prompt_len == max_seq_len && max_new > 0 {
        return Err(RequestError::NoRoom {
            len: prompt_len,
            max: max_seq_len,
        });
    }
    Ok(max_new.min(max_seq_len - prompt_len))
}

/// Where the model's weights live (the CPU for a model without any): token ids go there, so
/// the embedding runs beside its table; positions stay on the host, which reads them.
pub fn device_of(params: &Params) -> anneal_engine::Device {
    params
        .values()
        .next()
        .map_or(anneal_engine::Device::Cpu, |t| t.device())
}

fn positions(start: usize, n: usize) -> Result<Tensor> {
    Tensor::from_vec((start as i64..(start + n) as i64).collect(), &[n])
}

/// `log p(token[i+1] | tokens[..=i])` for every position of one sequence, and the loss (their
/// negated mean).
///
/// Runs batch-invariant, so the values equal, bit for bit, those [`generate`] reports.
pub fn logprobs(model: &PluginModel, params: &Params, tokens: &[i64]) -> Result<(Vec<f32>, f32)> {
    logprobs_with_images(model, params, tokens, None)
}

/// [`logprobs`] of a prompt holding images: `tokens` carry each image's placeholder tokens
/// already expanded (as the processor returns them), `images` the processed pixels.
pub fn logprobs_with_images(
    model: &PluginModel,
    params: &Params,
    tokens: &[i64],
    images: Option<Arc<ImageInputs>>,
) -> Result<(Vec<f32>, f32)> {
    logprobs_with_media(model, params, tokens, images, None)
}

/// [`logprobs`] of a prompt holding images or audio clips: `tokens` carry each one's
/// placeholder tokens already expanded (as the processor returns them), `images` the processed
/// pixels, `audio` the padded waveforms.
pub fn logprobs_with_media(
    model: &PluginModel,
    params: &Params,
    tokens: &[i64],
    images: Option<Arc<ImageInputs>>,
    audio: Option<Arc<AudioInputs>>,
) -> Result<(Vec<f32>, f32)> {
    let _g = autograd::no_grad();
    let _inv = set_batch_invariant(true);
    let n = tokens.len();
    check_scoring(n, model.spec().max_seq_len)?;
    let ids = Tensor::from_slice(tokens, &[1, n])?.to_device(device_of(params))?;
    let opts = ForwardOpts {
        images,
        audio,
        ..ForwardOpts::default()
    };
    let logits = model.forward(params, &ids, &positions(0, n)?, &opts)?;
    let v = logits.shape()[2];
    let rows = logits.to_vec_f32();
    let out: Vec<f32> = (0..n - 1)
        .map(|i| token_logprob(&rows[i * v..(i + 1) * v], tokens[i + 1] as usize))
        .collect();
    let loss = -out.iter().map(|&x| x as f64).sum::<f64>() / out.len() as f64;
    Ok((out, loss as f32))
}

/// `log softmax(row)[token]`, normalised by [`anneal_engine::logsumexp`] (f64 sums, one fixed
/// order, vectorized: a decode step scores a whole vocabulary per row). Every caller that reports a
/// logprob (scoring, generation, the RL trainer) goes through here, so equal logits give equal
/// logprobs bit for bit.
pub fn token_logprob(row: &[f32], token: usize) -> f32 {
    (row[token] as f64 - anneal_engine::logsumexp(row)) as f32
}

/// How to pick the next token.
#[derive(Clone, Debug)]
pub struct Sampling {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `p` (1 = all).
    pub top_p: f32,
    /// Seed of the sampling stream (draw `i` uses offset `i`, so runs are reproducible).
    pub seed: u64,
    /// Stop after producing this token.
    pub eos: Option<i64>,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            eos: None,
        }
    }
}

/// Generated tokens and their log-probabilities under the model (before temperature and
/// truncation).
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// The new token ids.
    pub tokens: Vec<i64>,
    /// `log p(token)` of each new token.
    pub logprobs: Vec<f32>,
}

/// Samples one token from `logits` (one row); returns the id.
pub fn sample(logits: &[f32], s: &Sampling, draw: f32) -> usize {
    if s.temperature <= 0.0 {
        // First maximum, like the engine's argmax.
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        return best;
    }
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    // Sort by logit descending, ties by lower id: deterministic.
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if s.top_k > 0 {
        idx.truncate(s.top_k);
    }
    let m = logits[idx[0]];
    let mut p: Vec<f64> = idx
        .iter()
        .map(|&i| (((logits[i] - m) / s.temperature) as f64).exp())
        .collect();
    let z: f64 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= z);
    if s.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = p.len();
        for (j, &x) in p.iter().enumerate() {
            acc += x;
            if acc >= s.top_p as f64 {
                keep = j + 1;
                break;
            }
        }
        p.truncate(keep);
        idx.truncate(keep);
        let z: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= z);
    }
    let mut acc = 0.0;
    for (j, &x) in p.iter().enumerate() {
        acc += x;
        if (draw as f64) < acc {
            return idx[j];
        }
    }
    idx[idx.len() - 1]
}

/// Token `step` of a sequence sampled with `s` from its stream `key` (`RngKey::new(seed,
/// "sampling")`; draw `i` at offset `i`), and its logprob. Every decoder (one sequence, a batch,
/// the serving loop) picks through here, so equal logits and seeds give equal tokens.
pub fn pick(logits: &[f32], s: &Sampling, key: &RngKey, step: usize) -> (usize, f32) {
    let draw = key.uniform_vec(step as u64, 1)[0];
    let next = sample(logits, s, draw);
    (next, token_logprob(logits, next))
}

/// Prefill `prompt` into a fresh KV cache, then decode up to `max_new` tokens one at a time.
pub fn generate(
    model: &PluginModel,
    params: &Params,
    prompt: &[i64],
    max_new: usize,
    s: &Sampling,
) -> Result<Generation> {
    let mut out = generate_batch(model, params, &[prompt], max_new, std::slice::from_ref(s))?;
    Ok(out.remove(0))
}

/// Completes several prompts of the same length together, one batch row each: a prefill of all
/// rows, then decode steps until every row has produced its end-of-sequence token or `max_new`
/// tokens. Row `i` continues `prompts[i]` with `samplings[i]`'s stream; since the kernels run
/// batch-invariant, its tokens and logprobs equal, bit for bit, those of [`generate`] on that
/// prompt alone, so batching only shares the per-step cost.
pub fn generate_batch(
    model: &PluginModel,
    params: &Params,
    prompts: &[&[i64]],
    max_new: usize,
    samplings: &[Sampling],
) -> Result<Vec<Generation>> {
    generate_batch_timed(model, params, prompts, max_new, samplings, true).map(|(g, _)| g)
}

/// Wall-clock split of a [`generate_batch_timed`] call.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DecodeStats {
    /// Seconds of the prefill (the first forward, over the whole prompts).
    pub prefill_s: f64,
    /// Seconds of the decode steps after it.
    pub decode_s: f64,
    /// Tokens the decode steps produced, over all rows.
    pub decode_tokens: usize,
    /// Bytes the KV cache holds per token of one sequence, over all layers (keys and values
    /// as the model hands them to attention: a latent cache is as small as its latent).
    pub cache_bytes_per_token: usize,
    /// Bytes of fixed-size state one sequence holds whatever its length (linear attention's
    /// recurrent state and convolution tail).
    pub state_bytes_per_sequence: usize,
    /// Bytes one sequence's cache holds at the end, everything together (keys, values and
    /// whatever state the model keeps, such as DeepSeek-V4's window and compressed blocks).
    pub cache_bytes: usize,
    /// Tokens the cache has seen: the prompt and every generated token fed back.
    pub cache_tokens: usize,
    /// Bytes per token of a plain KV cache of the same model in f32: every layer's full keys
    /// and values at the width its spec declares (`ModelSpec::kv_cache`).
    pub plain_kv_bytes_per_token: usize,
}

/// [`generate_batch`] with the mode made explicit and the time split reported:
/// `batch_invariant = false` runs the fast kernels (a row's tokens may then depend on the
/// batch it is in, so only use it where that does not matter, such as throughput runs).
pub fn generate_batch_timed(
    model: &PluginModel,
    params: &Params,
    prompts: &[&[i64]],
    max_new: usize,
    samplings: &[Sampling],
    batch_invariant: bool,
) -> Result<(Vec<Generation>, DecodeStats)> {
    generate_batch_tp(
        model,
        params,
        prompts,
        max_new,
        samplings,
        batch_invariant,
        None,
    )
}

/// The forward options of a decode over `params`: with `tp`, every stage reads `params` (this
/// rank's slices) and the projections run over the group, without sequence parallelism (a
/// decode step has one position to split).
pub fn tensor_parallel_opts(params: &Params, tp: Option<&TensorParallelism>) -> ForwardOpts {
    ForwardOpts {
        stage_params: tp.map(|tp| {
            Arc::new(ResidentTensorParallel {
                params: params.clone(),
                tp: TensorParallelism {
                    sequence: false,
                    ..tp.clone()
                },
            }) as Arc<dyn crate::plugins::StageParams>
        }),
        ..Default::default()
    }
}

/// `logits [.., V']` of `model` as whole-vocabulary rows: unchanged when they already are; under
/// `tp` a vocabulary-split head's columns joined over the group in rank order (the same bits as
/// one process's head, on every rank, with a gradient reaching this rank's columns).
pub fn whole_vocab(
    model: &PluginModel,
    logits: Tensor,
    tp: Option<&TensorParallelism>,
) -> Result<Tensor> {
    let v = model.spec().vocab_size;
    match (tp, logits.shape().last().copied()) {
        (Some(tp), Some(cols)) if cols != v => {
            if cols * tp.group.group.ranks() != v {
                return Err(anneal_engine::Error::Invalid {
                    op: "generate",
                    msg: format!(
                        "the head gave {cols} logits per position on each of {} tensor-parallel ranks; the vocabulary has {v}",
                        tp.group.group.ranks()
                    ),
                });
            }
            anneal_engine::ops::tp_vocab_gather(&logits, &tp.group)
        }
        _ => Ok(logits),
    }
}

/// [`generate_batch_timed`] as one rank of a tensor-parallel group when `tp` is given: `params`
/// are this rank's slices, each layer's KV cache holds this rank's heads, and every rank draws
/// the same tokens (the logits are made whole before sampling and every rank uses the same
/// streams), so the ranks decode in lockstep. Every rank of the group must call it with the
/// same prompts and settings (each forward is collective). Without `tp`, the one-process
/// decode.
pub fn generate_batch_tp(
    model: &PluginModel,
    params: &Params,
    prompts: &[&[i64]],
    max_new: usize,
    samplings: &[Sampling],
    batch_invariant: bool,
    tp: Option<&TensorParallelism>,
) -> Result<(Vec<Generation>, DecodeStats)> {
    let setup = DecodeSetup {
        tp,
        ..Default::default()
    };
    generate_batch_with(
        model,
        params,
        prompts,
        max_new,
        samplings,
        batch_invariant,
        setup,
    )
}

/// What a decode runs with beside its prompts: a tensor-parallel group, and the images and
/// audio clips of the prompts (their placeholder tokens expanded in the prompts).
#[derive(Clone, Default)]
pub struct DecodeSetup<'a> {
    /// The group of [`generate_batch_tp`], if any.
    pub tp: Option<&'a TensorParallelism>,
    /// The prompts' images, read by the prefill only: the model keeps what decode needs of
    /// them (Qwen3-VL's position offset) in the KV cache.
    pub images: Option<Arc<ImageInputs>>,
    /// The prompts' audio clips, read by the prefill only, like the images.
    pub audio: Option<Arc<AudioInputs>>,
}

/// [`generate_batch_tp`] with its [`DecodeSetup`].
pub fn generate_batch_with(
    model: &PluginModel,
    params: &Params,
    prompts: &[&[i64]],
    max_new: usize,
    samplings: &[Sampling],
    batch_invariant: bool,
    setup: DecodeSetup<'_>,
) -> Result<(Vec<Generation>, DecodeStats)> {
    let tp = setup.tp;
    let _g = autograd::no_grad();
    let _inv = set_batch_invariant(batch_invariant);
    let mut stats = DecodeStats::default();
    let started = std::time::Instant::now();
    let width = prompts.first().map_or(0, |p| p.len());
    let invalid = |msg: &str| {
        Err(anneal_engine::Error::Invalid {
            op: "generate",
            msg: msg.into(),
        })
    };
    if prompts.len() != samplings.len() {
        return invalid("needs one sampling setting per prompt");
    }
    if prompts.iter().any(|p| p.len() != width) {
        return invalid("the prompts of a batch must have the same length");
    }
    for s in samplings {
        s.validate()?;
    }
    // Positions past the model's context would index past its RoPE tables and KV layout.
    let max_new = if prompts.is_empty() {
        max_new
    } else {
        new_token_budget(width, max_new, model.spec().max_seq_len)?
    };
    let rows = samplings.len();
    let keys: Vec<RngKey> = samplings
        .iter()
        .map(|s| RngKey::new(s.seed, "sampling"))
        .collect();
    let mut out = vec![
        Generation {
            tokens: vec![],
            logprobs: vec![],
        };
        rows
    ];
    if rows == 0 {
        return Ok((out, stats));
    }
    let cache = Arc::new(KvCache::new());
    let opts = ForwardOpts {
        cache: Some(cache.clone()),
        ..tensor_parallel_opts(params, tp)
    };
    let mut running = vec![true; rows];
    let mut input: Vec<i64> = prompts.concat();
    let mut width = width;
    let mut pos = 0;
    for step in 0..max_new {
        let ids = Tensor::from_slice(&input, &[rows, width])?.to_device(device_of(params))?;
        let logits = if step == 0 && (setup.images.is_some() || setup.audio.is_some()) {
            let prefill = ForwardOpts {
                images: setup.images.clone(),
                audio: setup.audio.clone(),
                ..opts.clone()
            };
            model.forward(params, &ids, &positions(pos, width)?, &prefill)?
        } else {
            model.forward(params, &ids, &positions(pos, width)?, &opts)?
        };
        let logits = whole_vocab(model, logits, tp)?;
        pos += width;
        let v = logits.shape()[2];
        let last = logits
            .narrow(1, width - 1, 1)?
            .reshape(&[rows, v])?
            .to_vec_f32();
        for (i, s) in samplings.iter().enumerate() {
            if !running[i] {
                // A finished row keeps its place in the batch (its cache grows in step with
                // the others) and repeats its last token; its outputs are ignored.
                continue;
            }
            let (next, logprob) = pick(&last[i * v..(i + 1) * v], s, &keys[i], step);
            out[i].tokens.push(next as i64);
            out[i].logprobs.push(logprob);
            running[i] = s.eos != Some(next as i64);
            if step > 0 {
                stats.decode_tokens += 1;
            }
        }
        if step == 0 {
            stats.prefill_s = started.elapsed().as_secs_f64();
        }
        if !running.iter().any(|&r| r) {
            break;
        }
        input = out
            .iter()
            .map(|g| *g.tokens.last().expect("one token per step"))
            .collect();
        width = 1;
    }
    stats.decode_s = started.elapsed().as_secs_f64() - stats.prefill_s;
    stats.cache_bytes_per_token = cache.bytes_per_token();
    stats.state_bytes_per_sequence = cache.state_bytes_per_sequence();
    stats.cache_bytes = cache.bytes_held();
    stats.cache_tokens = pos;
    stats.plain_kv_bytes_per_token = model
        .spec()
        .kv_cache
        .iter()
        .flatten()
        .map(|(heads, dim)| 2 * heads * dim * 4)
        .sum();
    Ok((out, stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_settings_that_define_no_distribution_are_refused() {
        let with = |temperature, top_p| Sampling {
            temperature,
            top_p,
            ..Sampling::default()
        };
        assert!(with(0.0, 1.0).validate().is_ok());
        assert!(with(0.7, 0.9).validate().is_ok());
        for t in [-1.0, f32::NAN, f32::INFINITY] {
            assert!(matches!(
                with(t, 1.0).validate(),
                Err(RequestError::Temperature(_))
            ));
        }
        for p in [0.0, -0.5, 1.5, f32::NAN] {
            assert!(matches!(
                with(1.0, p).validate(),
                Err(RequestError::TopP(_))
            ));
        }
    }

    #[test]
    fn sequences_must_fit_the_model_positions() {
        assert!(check_scoring(64, 64).is_ok());
        assert_eq!(
            check_scoring(65, 64),
            Err(RequestError::TooLong { len: 65, max: 64 })
        );
        assert_eq!(check_scoring(1, 64), Err(RequestError::TooShort(1)));
        assert_eq!(new_token_budget(3, 100, 64), Ok(61));
        assert_eq!(new_token_budget(3, 8, 64), Ok(8));
        assert_eq!(
            new_token_budget(64, 1, 64),
            Err(RequestError::NoRoom { len: 64, max: 64 })
        );
        assert_eq!(
            new_token_budget(70, 1, 64),
            Err(RequestError::TooLong { len: 70, max: 64 })
        );
        assert_eq!(new_token_budget(0, 1, 64), Err(RequestError::EmptyPrompt));
    }
}
