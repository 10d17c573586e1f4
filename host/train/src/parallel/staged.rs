//! Tensor-level collectives: the one seam between the trainer's tensors (which live on the
//! job's device) and `anneal_dist::Collective` (which moves host slices). Every layout that
//! sends a tensor's values to other ranks and takes a tensor back goes through here: tensors
//! flattened to one host buffer, the collective run on it, each result rebuilt on its source's
//! device and in its source's dtype.
//!
//! This stage stages through host memory (over `anneal_engine::staged`): a GPU rank copies its
//! tensors to the host, the collective runs there over MPI, and the results are copied back.
//! The next stage (NCCL on device buffers) swaps this module's bodies, not its callers; DDP's
//! gradient sum and FSDP's unit collectives already take NCCL when it runs
//! ([`crate::parallel::nccl`]). On the
//! CPU nothing changes: the same buffers, sums and casts as before, so results are bit for
//! bit those of the host-only code.

use crate::TrainError;
use anneal_engine::{staged, DType, Device, Tensor};

/// The tensors' values as f32, one after another in one host buffer.
pub fn flatten(ts: &[&Tensor]) -> Vec<f32> {
    staged::flatten(ts)
}

/// A tensor of `shape` from a collective's host `values`, in `dtype` on `device`.
pub fn rebuild(
    values: Vec<f32>,
    shape: &[usize],
    dtype: DType,
    device: Device,
) -> Result<Tensor, TrainError> {
    Ok(staged::from_host(values, shape, dtype, device)?)
}

/// A tensor shaped, typed and placed like `like` from a collective's host `values`.
pub fn rebuild_like(values: Vec<f32>, like: &Tensor) -> Result<Tensor, TrainError> {
    rebuild(values, like.shape(), like.dtype(), like.device())
}

/// `t` (made on the host from a collective's result) on `device`; unchanged when it is there.
pub fn place(t: Tensor, device: Device) -> Result<Tensor, TrainError> {
    Ok(staged::place(t, device)?)
}
