//! Per-rank memory of a training run, from what the rank holds ([`super::layout`]) and the
//! batch it trains on, and the peak the allocator will report (`mem_peak_bytes`, the job's
//! busiest rank).
//!
//! - **parameters, gradients**: the rank's slices (FSDP: its padded rows), in their dtype;
//! - **optimizer state**: the optimizer's state tensors per parameter, f32, on the same rows;
//! - **activations**: what one micro-batch keeps for backward, per token: for each block
//!   `0.87 ×` the values its parameters read and write (`in + out` per matrix, `2·d` per vector,
//!   `2·(in + out)` per expert stack) and `2·V + 4·dim` for the head's logits, their softmax and
//!   gradients (fitted to the engine's measured peaks of the debug Llama: a block keeps ~23
//!   residual widths per token); recomputed blocks keep their input only, plus one block at a
//!   time; a pipeline rank holds `min(m, pp − rank)` micro-batches in flight (1F1B);
//! - **buffers**: the model's buffers (not trained) and working memory: the accumulated
//!   gradient's new copy for the largest parameter (when a rank runs two or more micro-batches),
//!   FSDP's gathered outer unit (or a pipeline stage's gathered parameters and their whole
//!   gradients).
//!
//! With one micro-batch per rank the peak holds the head's gradients but not yet the blocks'
//! (they appear as the activations they replace are freed); from the second micro-batch on it
//! holds every gradient.

use super::layout::{Held, RankView};
use anneal_config::{JobConfig, RecomputeMode};
use anneal_plugin_api::spec::{ModelSpec, OptimizerSpec};
use serde::Serialize;

/// Share of the values a block's parameters read and write that stays alive for backward
/// (fitted on the debug Llama; see the module docs).
const BLOCK_FACTOR: f64 = 0.87;

/// One rank's memory, in bytes.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MemoryPlan {
    /// The pipeline rank these figures are for (the one with the highest peak).
    pub rank: usize,
    /// Trained parameters.
    pub parameters: u64,
    /// Their gradients.
    pub gradients: u64,
    /// The optimizer's state.
    pub optimizer: u64,
    /// Activations kept for backward (every micro-batch in flight).
    pub activations: u64,
    /// Model buffers and working memory (see the module docs).
    pub buffers: u64,
    /// The estimated peak (`mem_peak_bytes`).
    pub peak: u64,
}

fn rows(p: &Held, fsdp: usize) -> u64 {
    if fsdp > 1 {
        p.shard_numel(fsdp)
    } else {
        p.numel()
    }
}

/// Activation values per token a parameter of (local) `shape` accounts for.
fn values_per_token(shape: &[usize]) -> u64 {
    match shape {
        [out, inp] => (*out + *inp) as u64,
        [d] => 2 * *d as u64,
        [_, out, inp] => 2 * (*out + *inp) as u64,
        other => other.iter().map(|&d| d as u64).product(),
    }
}

/// Activation bytes per token of one micro-batch on `v`, and the largest block's (recompute).
fn activation_per_token(cfg: &JobConfig, spec: &ModelSpec, v: &RankView) -> u64 {
    let ac = &cfg.activation_checkpoint;
    let every = match ac.mode {
        RecomputeMode::Full => 1,
        RecomputeMode::Selective => ac.every.max(1),
        RecomputeMode::None | RecomputeMode::Budget => 0,
    };
    let (mut kept, mut largest) = (0f64, 0f64);
    for (_, blocks) in &v.stages {
        for l in blocks.clone() {
            let values: u64 = v
                .params
                .iter()
                .filter(|p| p.layer == Some(l))
                .map(|p| values_per_token(&p.local))
                .sum();
            let block = BLOCK_FACTOR * values as f64;
            largest = largest.max(block);
            kept += if every > 0 && l % every == 0 {
                v.dim as f64
            } else {
                block
            };
        }
    }
    if every > 0 {
        kept += largest;
    }
    if v.has_head() {
        let vocab = v
            .params
            .iter()
            .find(|p| p.outer == Some(super::layout::Outer::Head) && p.local.len() == 2)
            .map_or(spec.vocab_size, |p| p.local[0]);
        kept += (2 * vocab + 4 * v.dim) as f64;
    }
    (kept * 4.0) as u64
}

/// The memory of one pipeline rank.
fn of_rank(
    cfg: &JobConfig,
    spec: &ModelSpec,
    optimizer: &OptimizerSpec,
    v: &RankView,
) -> MemoryPlan {
    let f = v.fsdp;
    let bytes = |p: &Held| rows(p, f) * p.elem;
    let parameters: u64 = v.trained().map(bytes).sum();
    let gradients = parameters;
    let optimizer_bytes: u64 = v
        .trained()
        .map(|p| rows(p, f) * 4 * optimizer.state.len() as u64)
        .sum();
    let model_buffers: u64 = v.params.iter().filter(|p| !p.trainable).map(bytes).sum();
    let m = v.micro_batches;
    let in_flight = if v.degrees.pp > 1 {
        m.min(v.degrees.pp - v.pp_rank).max(1)
    } else {
        1
    } as u64;
    let activations = in_flight * v.tokens as u64 * activation_per_token(cfg, spec, v);
    let whole = |p: &Held| p.numel() * p.elem;
    let working = match (f > 1, v.degrees.pp > 1) {
        // A stage's parameters gathered whole for the step and their whole gradients.
        (true, true) => 2 * v.trained().map(whole).sum::<u64>(),
        // The outer unit, gathered for the whole micro-batch.
        (true, false) => v.trained().filter(|p| p.layer.is_none()).map(whole).sum(),
        (false, _) if m >= 2 => v.trained().map(whole).max().unwrap_or(0),
        (false, _) => 0,
    };
    // With one micro-batch the blocks' gradients replace their activations as backward runs.
    let grads_at_peak = if m >= 2 || f > 1 {
        gradients
    } else {
        v.trained().filter(|p| p.layer.is_none()).map(bytes).sum()
    };
    let buffers = model_buffers + working;
    MemoryPlan {
        rank: v.pp_rank,
        parameters,
        gradients,
        optimizer: optimizer_bytes,
        activations,
        buffers,
        peak: parameters + grads_at_peak + optimizer_bytes + activations + buffers,
    }
}

/// The memory of the busiest rank of `views` (every pipeline rank; one without pipeline).
pub fn plan(
    cfg: &JobConfig,
    spec: &ModelSpec,
    optimizer: &OptimizerSpec,
    views: &[RankView],
) -> MemoryPlan {
    views
        .iter()
        .map(|v| of_rank(cfg, spec, optimizer, v))
        .max_by_key(|m| m.peak)
        .unwrap_or_default()
}

/// What the memory figures assume, in words.
pub fn assumptions(cfg: &JobConfig) -> Vec<String> {
    let mut out = vec![
        "memory is the busiest rank's: parameters, gradients and optimizer state (f32) on its slices and FSDP rows; activations ~0.87 x the values each block's weights read and write per token, 2V + 4 dim for the logits (fitted to the CPU engine's measured peaks), min(m, pp - rank) micro-batches in flight under 1F1B".to_string(),
    ];
    if cfg.parallelism.tp_sequence {
        out.push(
            "sequence parallelism's smaller norm and residual activations are not subtracted"
                .into(),
        );
    }
    if cfg.parallelism.pp_virtual_stages > 1 {
        out.push("interleaved 1F1B's extra in-flight chunks are not added".into());
    }
    out
}
