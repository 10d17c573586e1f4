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
//!   residual widths per token; under sequence parallelism the norms' values on this rank's
//!   share of the sequence); recomputed blocks keep their input only, plus one block at a
//!   time; a pipeline rank's chunks hold what its schedule keeps in flight, found by running
//!   the schedule's own op list (`pp::schedule::ops`): 1F1B keeps `min(m, pp − rank)`
//!   micro-batches, interleaving more chunks, and a zero-bubble schedule's deferred weight
//!   pass keeps each product's input and output gradient (the head's logits' gradient too);
//! - **buffers**: the model's buffers (not trained) and working memory: the accumulated
//!   gradient's new copy for the largest parameter (when a rank runs two or more micro-batches),
//!   FSDP's gathered outer unit (or a pipeline stage's gathered parameters and their whole
//!   gradients); with a MoE load-balancing loss every FSDP unit in full (the loss's gradient
//!   reaches every router at once, so the backward gathers every block up front).
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

/// Activation values per token a parameter of (local) `shape` accounts for.
fn values_per_token(shape: &[usize]) -> u64 {
    match shape {
        [out, inp] => (*out + *inp) as u64,
        [d] => 2 * *d as u64,
        [_, out, inp] => 2 * (*out + *inp) as u64,
        other => other.iter().map(|&d| d as u64).product(),
    }
}

/// What one micro-batch costs a chunk (a pipeline stage; the whole model without pipeline),
/// in bytes per token.
#[derive(Clone, Copy, Default)]
struct ChunkCost {
    /// Kept from its forward until its backward.
    forward: f64,
    /// Kept from its input-gradient pass until its deferred weight pass (zero-bubble
    /// schedules): each product's input and output gradient, the head's logits' gradient.
    weight: f64,
    /// The largest block's activations (what recompute brings back, one block at a time).
    largest: f64,
}

/// The cost of the chunk holding `blocks` (and the head when `head`), per token of a
/// micro-batch.
fn chunk_cost(
    cfg: &JobConfig,
    spec: &ModelSpec,
    v: &RankView,
    blocks: std::ops::Range<usize>,
    head: bool,
) -> ChunkCost {
    let ac = &cfg.activation_checkpoint;
    let every = match ac.mode {
        RecomputeMode::Full => 1,
        RecomputeMode::Selective => ac.every.max(1),
        RecomputeMode::None | RecomputeMode::Budget => 0,
    };
    // Under sequence parallelism the norms run on this rank's share of the sequence.
    let vector_share = if v.sequence {
        1.0 / v.degrees.tp as f64
    } else {
        1.0
    };
    let mut cost = ChunkCost::default();
    for l in blocks {
        let (mut values, mut products) = (0f64, 0f64);
        for p in v.params.iter().filter(|p| p.layer == Some(l)) {
            let n = values_per_token(&p.local) as f64;
            if p.local.len() == 1 {
                values += n * vector_share;
            } else {
                values += n;
                products += n;
            }
        }
        let block = BLOCK_FACTOR * values;
        cost.largest = cost.largest.max(block);
        cost.forward += if every > 0 && l % every == 0 {
            v.dim as f64
        } else {
            block
        };
        cost.weight += products;
    }
    if head {
        let vocab = v
            .params
            .iter()
            .find(|p| p.outer == Some(super::layout::Outer::Head) && p.local.len() == 2)
            .map_or(spec.vocab_size, |p| p.local[0]);
        cost.forward += 2.0 * vocab as f64 + 4.0 * v.dim as f64 * vector_share;
        cost.weight += (vocab + v.dim) as f64;
    }
    ChunkCost {
        forward: cost.forward * 4.0,
        weight: cost.weight * 4.0,
        largest: cost.largest * 4.0,
    }
}

/// The most activation bytes per token `v` keeps alive at once: its chunks' micro-batches in
/// flight as its schedule runs them (1F1B keeps `min(m, pp − rank)`, interleaving and deferred
/// weight passes more), plus one recomputed block.
fn activation_per_token(cfg: &JobConfig, spec: &ModelSpec, v: &RankView) -> f64 {
    let costs: Vec<ChunkCost> = v
        .stages
        .iter()
        .map(|(s, blocks)| chunk_cost(cfg, spec, v, blocks.clone(), *s + 1 == v.n_stages))
        .collect();
    let largest = costs.iter().map(|c| c.largest).fold(0.0, f64::max);
    let recompute = match cfg.activation_checkpoint.mode {
        RecomputeMode::Full | RecomputeMode::Selective => largest,
        RecomputeMode::None | RecomputeMode::Budget => 0.0,
    };
    let Some(schedule) = v.schedule else {
        return costs.iter().map(|c| c.forward).sum::<f64>() + recompute;
    };
    use crate::parallel::pp::schedule::{ops, Op};
    let (p, chunks, m) = (v.degrees.pp, v.stages.len(), v.micro_batches.max(1));
    let split = schedule.splits_backward();
    let (mut live, mut peak) = (0f64, 0f64);
    for op in ops(schedule, p, chunks, m, v.pp_rank) {
        match op {
            Op::Forward { chunk, .. } => {
                live += costs[chunk].forward;
                peak = peak.max(live);
            }
            Op::Backward { chunk, .. } => {
                live -= costs[chunk].forward;
                if split {
                    live += costs[chunk].weight;
                    peak = peak.max(live);
                }
            }
            Op::Weight { chunk, .. } => live -= costs[chunk].weight,
        }
    }
    peak + recompute
}

/// The memory of one pipeline rank.
fn of_rank(
    cfg: &JobConfig,
    spec: &ModelSpec,
    optimizer: &OptimizerSpec,
    v: &RankView,
) -> MemoryPlan {
    let f = v.fsdp;
    let bytes = |p: &Held| v.rows(p) * p.elem;
    let parameters: u64 = v.trained().map(bytes).sum();
    let gradients = parameters;
    let optimizer_bytes: u64 = v
        .trained()
        .map(|p| v.rows(p) * 4 * optimizer.state.len() as u64)
        .sum();
    let model_buffers: u64 = v.params.iter().filter(|p| !p.trainable).map(bytes).sum();
    let m = v.micro_batches;
    let activations = (v.tokens as f64 * activation_per_token(cfg, spec, v)) as u64;
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
    // Under FSDP the rows' gradients are made at the step's end, when the activations are
    // gone: FSDP's units keep them in host buffers of their own until then (`fsdp/units.rs`;
    // at the peak only the outer unit's are tensors), and a pipeline stage reduce-scatters
    // its whole gradients once its schedule ran (`pp/sharded.rs`). Under CP × FSDP the
    // measured peak holds every row's gradient and one more whole copy of the largest
    // parameter (measured on the bench layouts, not traced to its allocation).
    let outer_grads = v.trained().filter(|p| p.layer.is_none()).map(bytes).sum();
    let largest_whole = v.trained().map(whole).max().unwrap_or(0);
    let (grads_at_peak, cp_extra) = match (f > 1, v.degrees.pp > 1, v.degrees.cp > 1) {
        (true, _, true) => (gradients, largest_whole),
        (true, false, false) => (outer_grads, 0),
        (true, true, false) => (0, 0),
        (false, ..) if m >= 2 => (gradients, 0),
        (false, ..) => (outer_grads, 0),
    };
    let mut buffers = model_buffers + working + cp_extra;
    let mut peak = parameters + grads_at_peak + optimizer_bytes + activations + buffers;
    // A MoE load-balancing loss reaches every layer's router straight from the loss, so the
    // backward's first steps ask for every block's parameters: FSDP's units gather them all
    // again while the activations are still alive (measured: `fsdp_full_bytes_peak` is every
    // unit in full). The peak is then this moment's when it is the larger (under CP the
    // end of the step's, above, can be).
    if f > 1 && v.degrees.pp == 1 && v.moe.as_ref().is_some_and(|m| m.aux_loss) {
        let blocks_whole: u64 = v.trained().filter(|p| p.layer.is_some()).map(whole).sum();
        let gathered = model_buffers + working + blocks_whole;
        let backward_start = parameters + outer_grads + optimizer_bytes + activations + gathered;
        if backward_start > peak {
            (buffers, peak) = (gathered, backward_start);
        }
    }
    MemoryPlan {
        rank: v.pp_rank,
        parameters,
        gradients,
        optimizer: optimizer_bytes,
        activations,
        buffers,
        peak,
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
pub fn assumptions(cfg: &JobConfig, v: &RankView) -> Vec<String> {
    let mut out = vec![
        "memory is the busiest rank's: parameters, gradients and optimizer state (f32) on its slices and FSDP rows; activations ~0.87 x the values each block's weights read and write per token, 2V + 4 dim for the logits (fitted to the CPU engine's measured peaks), the micro-batches and deferred weight passes its pipeline schedule keeps in flight".to_string(),
    ];
    if v.fsdp > 1 && v.degrees.pp == 1 && v.moe.as_ref().is_some_and(|m| m.aux_loss) {
        out.push(
            "the MoE load-balancing loss makes FSDP gather every block at the backward's start: the peak holds every unit in full"
                .into(),
        );
    }
    if cfg.parallelism.tp_sequence {
        out.push(
            "sequence parallelism splits the norms' activations over tp; its smaller residual activations are not subtracted"
                .into(),
        );
    }
    out
}
