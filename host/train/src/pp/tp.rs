//! Tensor (and sequence) parallelism inside pipeline stages (`pp` × `tp`). Each stage's blocks
//! run tensor-parallel over the stage's `tp` group exactly as without stages ([`crate::tp`]):
//! the rank keeps its slices of its stages' parameters, the forward's `linear` / `embedding`
//! host ops combine over the group, the first stage's embedding is vocab-split and the last
//! stage's loss vocab-parallel ([`cross_entropy`]). Hidden tensors travel between the ranks
//! that share a `tp` coordinate on neighbouring stages (the `pp` communicator of that
//! coordinate): without sequence parallelism each sends its copy of the whole activation,
//! under it its share of the sequence, so the pipeline's traffic per rank falls by `tp`.
//!
//! The norm ([`grad_norm`]) counts each slice once over `tp`, then adds the stages' sums over
//! `pp` in name order, the same bits on every rank. Checkpoints hold global pieces written by
//! every stage's `tp` ranks (rows of the column/vocab slices; the row-split and replicated
//! tensors whole from the group's first rank), so any layout reads them.
//!
//! With `dp_shard` too (FSDP applied last) a stage's slices are what FSDP shards over the
//! stage's `dp_shard` ranks ([`crate::pp::sharded`]: gathered once per step, gradients
//! reduce-scattered over `dp_shard` only, never summed over `tp`), the norm adds the shard's
//! squares, then the slices once over `tp`, then the stages ([`sharded_grad_norm`]), and
//! checkpoints are TP × FSDP's global pieces ([`crate::tp_fsdp`]) written by every rank of
//! the first replica.

use super::Pipeline;
use crate::tp::TpLayout;
use crate::TrainError;
use anneal_dist::Collective;
use anneal_engine::ops::{vocab_parallel_cross_entropy, CrossEntropy};
use anneal_engine::Tensor;
use anneal_runtime::plugins::ForwardOpts;

/// The vocab-parallel cross-entropy of `logits` (`[tokens, vocab / tp]`, this rank's columns)
/// against `y` when the forward ran tensor-parallel (`opts` carries the group), without ever
/// gathering the logits; `None` otherwise.
pub(crate) fn cross_entropy(
    logits: &Tensor,
    y: &Tensor,
    opts: &ForwardOpts,
) -> Result<Option<Tensor>, TrainError> {
    let Some(tp) = opts.stage_params.as_ref().and_then(|s| s.tensor_parallel()) else {
        return Ok(None);
    };
    let ignore = CrossEntropy::default().ignore_index;
    Ok(Some(vocab_parallel_cross_entropy(
        logits, y, ignore, &tp.group,
    )?))
}

/// The global gradient norm of `named` (this rank's slices of its stages' parameters): each
/// parameter's squares summed over `tp` counting each slice once ([`TpLayout::grad_sums`]),
/// then over `pp` and in name order ([`Pipeline::norm_of_sums`]), so every rank gets the same
/// bits. Collective over both.
pub(crate) fn grad_norm(
    pipe: &Pipeline,
    layout: &TpLayout,
    tp: &dyn Collective,
    pp: &dyn Collective,
    named: &[(String, Tensor)],
) -> Result<f64, TrainError> {
    let sums = layout.grad_sums(tp, named)?;
    pipe.norm_of_sums(pp, named.iter().map(|(n, _)| n.as_str()).zip(sums))
}

/// The global gradient norm under PP × TP × FSDP, from this rank's shards of its stages'
/// slices (`shards`): each parameter's squares summed over `shard` in rank order, then over
/// `tp` counting each slice once ([`crate::tp_fsdp::grad_sums`]), then over `pp` and in name
/// order ([`Pipeline::norm_of_sums`]), so every rank gets the same bits. Collective over all
/// three.
pub(crate) fn sharded_grad_norm(
    pipe: &Pipeline,
    layout: &TpLayout,
    (shard, tp, pp): (&dyn Collective, &dyn Collective, &dyn Collective),
    shards: &[(String, Tensor)],
) -> Result<f64, TrainError> {
    let sums = crate::tp_fsdp::grad_sums(layout, shard, tp, shards)?;
    pipe.norm_of_sums(pp, shards.iter().map(|(n, _)| n.as_str()).zip(sums))
}
