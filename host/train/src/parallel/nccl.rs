//! NCCL on the rank's GPU for the hot data-parallel collectives of a multi-process GPU job:
//! DDP's gradient sum runs on one device buffer (the gradients flattened on the GPU, an NCCL
//! reduce-scatter and all-gather on its raw address, the sums split back as device tensors),
//! and FSDP's per-unit parameter all-gathers and gradient reduce-scatters run over NCCL
//! communicators (their buffers still staged through host memory: the units keep this rank's
//! rows as host f32). Every other collective stays staged ([`super::staged`]).
//!
//! Which path runs: `ANNEAL_COLLECTIVES` = `auto` (the default: NCCL where every rank of the job
//! can load it), `staged` (always through host memory over MPI) or `nccl` (NCCL, or an error
//! saying why it cannot run). With `pp` every collective stays staged; the `tp`, `cp` and `ep`
//! groups take NCCL on device buffers ([`super::nccl_groups`]), beside which FSDP's units stay
//! staged. The communicators are built once, at job start,
//! each bootstrapped over an MPI communicator of the same ranks (NCCL's unique id broadcast over
//! it). Compute and NCCL run on different streams, ordered by waiting on each (the engine's
//! stream before a call, NCCL's after it); overlapping them is a later stage.
//!
//! Sums: the DDP path is the staged path's reduce-scatter then all-gather (every rank the same
//! bits). On the CPU emulation NCCL sums in rank order as MPI does, so both paths give the same
//! bits; real NCCL picks its own order (within rounding of the staged path).

use crate::TrainError;
use anneal_dist::nccl::{Nccl, NcclDtype};
use anneal_dist::{Collective, DistError};
use anneal_engine::{DType, Device, Tensor};
use std::cell::RefCell;

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

/// A group's gather and reduce-scatter communicators (FSDP's units keep one of each).
pub(crate) type GroupComms = (Box<dyn Collective>, Box<dyn Collective>);

/// This rank's NCCL communicators.
pub(crate) struct DeviceComms {
    /// Over the ranks summing gradients (without FSDP): DDP's gradient sum on device buffers.
    pub grads: Option<Nccl>,
    /// FSDP's gather and reduce-scatter communicators over the shard ranks, until the units take
    /// them at their first step.
    pub shard: RefCell<Option<GroupComms>>,
}

/// An NCCL communicator over `comm`'s ranks on GPU `ordinal`, bootstrapped over a split of
/// `comm` (same ranks). Collective over `comm`.
fn over(comm: &dyn Collective, ordinal: usize) -> Result<Nccl, TrainError> {
    let boot = comm.split(0, comm.rank() as u32)?;
    Ok(Nccl::new(boot, Some(ordinal))?)
}

impl DeviceComms {
    /// Communicators on GPU `ordinal`: over `grads` when parameters are not sharded, else a
    /// gather and a reduce-scatter one over `shard`. Collective over both.
    pub fn new(
        grads: &dyn Collective,
        shard: Option<&dyn Collective>,
        ordinal: usize,
    ) -> Result<DeviceComms, TrainError> {
        let (grads, shard) = match shard {
            None => (Some(over(grads, ordinal)?), None),
            Some(s) => {
                let gather = Box::new(over(s, ordinal)?) as Box<dyn Collective>;
                let scatter = Box::new(over(s, ordinal)?) as Box<dyn Collective>;
                (None, Some((gather, scatter)))
            }
        };
        Ok(DeviceComms {
            grads,
            shard: RefCell::new(shard),
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
    // NCCL runs on its own stream: the engine's writes of the three buffers must be done.
    anneal_engine::synchronize(device)?;
    // SAFETY: the three tensors are contiguous f32 on the communicator's GPU with these lengths
    // (`send` and `out` `padded`, `block` `padded / ranks`), their writes are synchronised above,
    // and they live (unchanged but for NCCL's writes into fresh `block` and `out`) until the
    // stream is synchronised below.
    unsafe {
        nccl.reduce_scatter_sum_device(s, b, padded / ranks, NcclDtype::F32)?;
        nccl.all_gather_device(b, o, padded / ranks, NcclDtype::F32)?;
    }
    nccl.synchronize()?;
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
