//! NCCL on the rank's GPU for the hot data-parallel collectives of a multi-process GPU job, on
//! device buffers (raw addresses, NCCL's `*_device` entry points): DDP's gradient sum (the
//! gradients flattened on the GPU, an NCCL reduce-scatter and all-gather on one buffer, the sums
//! split back as device tensors); FSDP's per-unit parameter all-gathers and gradient
//! reduce-scatters (the units keep this rank's f32 shard rows on the GPU, the gathered
//! parameters are device tensors, the gradient rows are summed on the GPU:
//! [`crate::parallel::fsdp`]'s `units/device.rs`); and HSDP's sum of the gradient rows over the
//! replicas (an NCCL communicator of its own over the `dp_replicate` ranks). Quantized or bf16
//! parameter gathers (`parallelism.fsdp_all_gather_dtype` other than f32) keep their encoding on
//! the host: their buffers are staged through host memory over the same NCCL communicators.
//! Every other collective stays staged ([`super::staged`]).
//!
//! Which path runs: `ANNEAL_COLLECTIVES` = `auto` (the default: NCCL where every rank of the job
//! can load it), `staged` (always through host memory over MPI) or `nccl` (NCCL, or an error
//! saying why it cannot run). With `pp` every collective stays staged; the `tp`, `cp` and `ep`
//! groups take NCCL on device buffers ([`super::nccl_groups`]), beside which FSDP's units stay
//! staged. The communicators are built once, at job start,
//! each bootstrapped over an MPI communicator of the same ranks (NCCL's unique id broadcast over
//! it). DDP's communicator queues on the engine's communication stream
//! (`anneal_engine::streams`): the sum waits on the device for an event recorded on the compute
//! stream after the flattening, compute waits for one recorded after the collectives, and the
//! three buffers are recorded on the communication stream so the allocator does not hand them
//! to compute work before NCCL is done with them; the host never waits for NCCL. FSDP's
//! communicators run on streams of their own, ordered by waiting on each (the engine's stream
//! before a call, NCCL's after it: FSDP's prefetched gathers are launched early and waited for
//! when their unit is reached); overlapping compute with them is a later stage.
//!
//! Sums: the DDP path and HSDP's replica sum are the staged path's reduce-scatter then
//! all-gather (every rank the same bits); FSDP's reduce-scatters lay their buffers out as the
//! staged path does and add each micro-batch's rows to zeros in the same order. On the CPU emulation NCCL sums in rank order as MPI does, so both paths give the same
//! bits; real NCCL picks its own order (within rounding of the staged path).

use crate::TrainError;
use anneal_dist::nccl::{Nccl, NcclDtype};
use anneal_dist::{Collective, DistError};
use anneal_engine::{DType, Device, Tensor};
use std::cell::RefCell;

#[path = "nccl_streams.rs"]
mod streams;

/// The environment variable choosing the path: `auto`, `staged` or `nccl`.
pub const ENV: &str = "ANNEAL_COLLECTIVES";

/// The path `ANNEAL_COLLECTIVES` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// NCCL where every rank can run it, staged otherwise.
    Auto,
    /// Staged through host memory over MPI.
    Staged,
    /// NCCL, or an error.
    Nccl,
}

/// The path `ANNEAL_COLLECTIVES` asks for; another value is a user error naming it.
pub fn choice() -> Result<Choice, TrainError> {
    parse(std::env::var(ENV).ok().as_deref())
}

fn parse(value: Option<&str>) -> Result<Choice, TrainError> {
    match value.map(str::trim) {
        None | Some("") | Some("auto") => Ok(Choice::Auto),
        Some("staged") => Ok(Choice::Staged),
        Some("nccl") => Ok(Choice::Nccl),
        Some(other) => Err(TrainError::Config(format!(
            "environment: `{ENV}` = {other:?} is not a collectives path (use auto, staged or nccl)"
        ))),
    }
}

/// FSDP's NCCL gather and reduce-scatter communicators over the shard ranks.
pub(crate) type ShardNccl = (Nccl, Nccl);

/// This rank's NCCL communicators.
pub(crate) struct DeviceComms {
    /// Over the ranks summing gradients (without FSDP): DDP's gradient sum on device buffers.
    pub grads: Option<Nccl>,
    /// FSDP's gather and reduce-scatter communicators over the shard ranks, until the units take
    /// them at their first step.
    pub shard: RefCell<Option<ShardNccl>>,
    /// Under HSDP, over the `dp_replicate` ranks: the sum of the gradient rows over the replicas.
    pub replicate: Option<Nccl>,
}

/// An NCCL communicator over `comm`'s ranks on GPU `ordinal`, bootstrapped over a split of
/// `comm` (same ranks). Collective over `comm`.
fn over(comm: &dyn Collective, ordinal: usize) -> Result<Nccl, TrainError> {
    let boot = comm.split(0, comm.rank() as u32)?;
    Ok(Nccl::new(boot, Some(ordinal))?)
}

/// As [`over`], queued on the engine's communication stream of GPU `ordinal`.
fn over_comm_stream(comm: &dyn Collective, ordinal: usize) -> Result<Nccl, TrainError> {
    if let Some(why) = anneal_dist::nccl::unavailable() {
        return Err(DistError::Unavailable(why).into());
    }
    let stream = anneal_engine::cuda::comm_stream(ordinal)?;
    let boot = comm.split(0, comm.rank() as u32)?;
    Ok(Nccl::new_on_stream(boot, stream)?)
}

impl DeviceComms {
    /// Communicators on GPU `ordinal`: over `grads` when parameters are not sharded, else a
    /// gather and a reduce-scatter one over `shard` (and one over `replicate` under HSDP).
    /// Collective over all three.
    pub fn new(
        grads: &dyn Collective,
        shard: Option<&dyn Collective>,
        replicate: Option<&dyn Collective>,
        ordinal: usize,
    ) -> Result<DeviceComms, TrainError> {
        let (grads, shard) = match shard {
            None => (Some(over_comm_stream(grads, ordinal)?), None),
            Some(s) => (None, Some((over(s, ordinal)?, over(s, ordinal)?))),
        };
        let replicate = match (&shard, replicate) {
            (Some(_), Some(r)) => Some(over(r, ordinal)?),
            _ => None,
        };
        Ok(DeviceComms {
            grads,
            shard: RefCell::new(shard),
            replicate,
        })
    }
}

/// Why this rank cannot take NCCL on `device`, or `None` when it can.
pub(crate) fn unavailable(device: Device) -> Option<String> {
    match device {
        Device::Cuda(_) => anneal_dist::nccl::unavailable(),
        _ => Some("the job's device is not a GPU".into()),
    }
}

fn no_device(what: &str) -> TrainError {
    TrainError::Dist(DistError::Backend(format!(
        "NCCL gradient sum: {what} is not a contiguous tensor on the communicator's GPU"
    )))
}

/// DDP's gradient sum over `nccl`'s ranks on device buffers, as
/// [`crate::Dist::all_reduce_grads`] does it staged: every gradient (zeros for none) and a flag
/// per parameter in one f32 buffer, summed by a reduce-scatter then an all-gather so every rank
/// holds the same bits. Returns `false`, doing nothing, unless every parameter lives on the
/// communicator's GPU (the same answer on every rank: they hold the same model).
pub(crate) fn all_reduce_grads(
    nccl: &Nccl,
    named: &[(String, Tensor)],
) -> Result<bool, TrainError> {
    let device = Device::Cuda(nccl.device());
    if named.iter().any(|(_, p)| p.device() != device) {
        return Ok(false);
    }
    let ranks = nccl.size();
    let total: usize = named.iter().map(|(_, p)| p.numel()).sum();
    let flags_at = total;
    let len = total + named.len();
    let padded = len.div_ceil(ranks) * ranks;
    let mut parts = Vec::with_capacity(named.len() + 2);
    let mut flags = Vec::with_capacity(named.len());
    for (_, p) in named {
        let n = p.numel();
        parts.push(match p.grad() {
            Some(g) => g.to_dtype(DType::F32)?.contiguous()?.reshape(&[n])?,
            None => Tensor::zeros_on(&[n], DType::F32, device)?,
        });
        flags.push(p.grad().map_or(0.0f32, |_| 1.0));
    }
    parts.push(Tensor::from_slice(&flags, &[flags.len()])?.to_device(device)?);
    if padded > len {
        parts.push(Tensor::zeros_on(&[padded - len], DType::F32, device)?);
    }
    let send = anneal_engine::ops::cat(&parts, 0)?.contiguous()?;
    drop(parts);
    let block = Tensor::zeros_on(&[padded / ranks], DType::F32, device)?;
    let out = Tensor::zeros_on(&[padded], DType::F32, device)?;
    let ptr = |t: &Tensor, what: &str| match t.cuda_ptr() {
        Some((o, p)) if o == nccl.device() => Ok(p),
        _ => Err(no_device(what)),
    };
    let (s, b, o) = (
        ptr(&send, "the send buffer")?,
        ptr(&block, "the block")?,
        ptr(&out, "the result")?,
    );
    // NCCL queues on the communication stream: it waits (on the device) for compute's writes of
    // the three buffers, and their blocks stay out of compute's reach until it is done.
    let on_comm = streams::comm_ordered(nccl, device)?;
    for t in [&send, &block, &out] {
        on_comm.record(t)?;
    }
    // SAFETY: the three tensors are contiguous f32 on the communicator's GPU with these lengths
    // (`send` and `out` `padded`, `block` `padded / ranks`); the communicator's stream waits for
    // their writes (above, or a full synchronisation when it is not the engine's communication
    // stream), and their blocks are not reused before the stream's work is done
    // (`record_stream`), so dropping them before it has run is safe.
    unsafe {
        nccl.reduce_scatter_sum_device(s, b, padded / ranks, NcclDtype::F32)?;
        nccl.all_gather_device(b, o, padded / ranks, NcclDtype::F32)?;
    }
    // Compute (and so the host reads below, which go through it) waits for the sum.
    on_comm.done()?;
    drop((send, block));
    let summed = out.narrow(0, flags_at, named.len())?.to_vec_f32();
    let mut at = 0;
    for ((_, p), &flag) in named.iter().zip(&summed) {
        let n = p.numel();
        if flag > 0.0 {
            let sum = out.narrow(0, at, n)?.reshape(p.shape())?;
            // Each gradient in storage of its own (an optimizer refuses tensors that share it).
            let g = match p.grad() {
                Some(old) if old.dtype() != DType::F32 => sum.to_dtype(old.dtype())?,
                _ => {
                    let g = Tensor::zeros_on(p.shape(), DType::F32, device)?;
                    g.copy_from(&sum)?;
                    g
                }
            };
            p.set_grad(Some(g))?;
        }
        at += n;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_reads_its_three_values_and_names_itself_otherwise() {
        assert_eq!(parse(None).unwrap(), Choice::Auto);
        assert_eq!(parse(Some("auto")).unwrap(), Choice::Auto);
        assert_eq!(parse(Some("staged")).unwrap(), Choice::Staged);
        assert_eq!(parse(Some(" nccl ")).unwrap(), Choice::Nccl);
        let e = parse(Some("mpi")).unwrap_err().to_string();
        assert!(
            e.contains("ANNEAL_COLLECTIVES") && e.contains("\"mpi\""),
            "{e}"
        );
    }
}
