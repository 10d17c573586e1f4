//! Tensor (and sequence) parallelism inside pipeline stages (`pp` × `tp`). Each stage's blocks
//! run tensor-parallel over the stage's `tp` group exactly as without stages ([`crate::parallel::tp`]):
//! the rank keeps its slices of its stages' parameters, the forward's `linear` / `embedding`
//! host ops combine over the group, the first stage's embedding is vocab-split and the last
//! stage's loss vocab-parallel ([`cross_entropy`]). Hidden tensors travel between the ranks
//! that share a `tp` coordinate on neighbouring stages (the `pp` communicator of that
//! coordinate): without sequence parallelism each sends its copy of the whole activation,
//! under it its share of the sequence, so the pipeline's traffic per rank falls by `tp`.
//!
//! Checkpoints hold global pieces written by
//! every stage's `tp` ranks (rows of the column/vocab slices; the row-split and replicated
//! tensors whole from the group's first rank), so any layout reads them.
//!
//! With `dp_shard` too (FSDP applied last) a stage's slices are what FSDP shards over the
//! stage's `dp_shard` ranks ([`crate::parallel::pp::sharded`]: gathered once per step, gradients
//! reduce-scattered over `dp_shard` only, never summed over `tp`) and checkpoints are TP × FSDP's global pieces ([`crate::parallel::tp_fsdp`]) written by every rank of
//! the first replica.

use crate::TrainError;
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
