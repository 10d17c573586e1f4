//! FSDP inside pipeline stages (`pp` × `dp_shard`). Between steps each rank holds its rows of
//! its stages' parameters, gradients and optimizer state, as plain FSDP does. A step gathers
//! the stage's whole parameters once and keeps them through every micro-batch's forward and
//! backward: the schedule interleaves micro-batches, so gathering per block and micro-batch
//! would multiply the traffic by their number (TorchTitan keeps them too, with
//! `reshard_after_forward = False` under PP). Once the schedule ends, each gradient is
//! reduce-scattered to its rows and the whole tensors go.
//!
//! Under expert parallelism (`ep`, borrowing dp_shard's ranks) an expert parameter is gathered
//! over its efsdp ranks into this rank's slice of the experts only, never the whole: the MoE
//! layers send token rows to the ranks holding the other slices ([`crate::parallel::ep`]).

use crate::parallel::fsdp::Fsdp;
use crate::TrainError;
use anneal_dist::Collective;
use anneal_engine::Tensor;
use anneal_runtime::plugins::Params;
use std::sync::Arc;

/// A stage's whole parameters for one step, gathered from the shards.
pub(crate) struct Gathered {
    /// The whole parameters, in the shards' order (trainable leaves when training).
    pub named: Vec<(String, Tensor)>,
    /// The same tensors (and the model's buffers) as the forward's map.
    pub params: Params,
}

/// The communicator parameter `i`'s rows are sharded over: `efsdp` for an expert parameter
/// under expert parallelism, `comm` (`dp_shard`) otherwise.
fn comm_of<'a>(
    fsdp: &Fsdp,
    i: usize,
    comm: &'a dyn Collective,
    efsdp: Option<&'a dyn Collective>,
) -> Result<&'a dyn Collective, TrainError> {
    match fsdp.experts().get(i) {
        Some(true) => efsdp.ok_or_else(|| {
            TrainError::Pipeline("an expert parameter without an expert-FSDP group".into())
        }),
        _ => Ok(comm),
    }
}

/// Gathers every shard of `shards` (this rank's rows, laid out by `fsdp`) over `comm`
/// (`dp_shard`; expert parameters over `efsdp`, into this rank's slice of the experts) into
/// its whole tensor, next to `buffers`. Collective over both.
pub(crate) fn gather(
    fsdp: &Fsdp,
    comm: &dyn Collective,
    efsdp: Option<&dyn Collective>,
    shards: &[(String, Tensor)],
    buffers: &[(String, Tensor)],
    training: bool,
) -> Result<Gathered, TrainError> {
    let mut named = Vec::with_capacity(shards.len());
    for (i, ((name, shard), (shape, rows))) in shards.iter().zip(fsdp.layouts()).enumerate() {
        let c = comm_of(fsdp, i, comm, efsdp)?;
        let whole = rows.all_gather(c, &shard.to_vec_f32())?;
        let t = crate::parallel::staged::rebuild(whole, shape, shard.dtype(), shard.device())?;
        named.push((name.clone(), if training { t.requires_grad_() } else { t }));
    }
    let params = Arc::new(named.iter().chain(buffers).cloned().collect());
    Ok(Gathered { named, params })
}

/// This rank's rows of each gradient of `whole` summed over `comm` (`dp_shard`; expert
/// parameters over `efsdp`), and whether the parameter got a gradient on this rank (one that
/// got none sends zeros). Collective over both.
pub(crate) fn scatter_grads(
    fsdp: &Fsdp,
    comm: &dyn Collective,
    efsdp: Option<&dyn Collective>,
    whole: &[(String, Tensor)],
) -> Result<(Vec<Vec<f32>>, Vec<bool>), TrainError> {
    let mut rows = Vec::with_capacity(whole.len());
    let mut got = Vec::with_capacity(whole.len());
    for (i, ((_, p), (_, shard))) in whole.iter().zip(fsdp.layouts()).enumerate() {
        let comm = comm_of(fsdp, i, comm, efsdp)?;
        let g = p.grad();
        got.push(g.is_some());
        let full = match g {
            Some(g) => g.to_vec_f32(),
            None => vec![0f32; shard.full_len()],
        };
        rows.push(shard.reduce_scatter(comm, &full)?);
    }
    Ok((rows, got))
}
