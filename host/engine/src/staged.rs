//! Tensors staged through host memory for the collectives between ranks: the one place where
//! a tensor's values leave its device for a host buffer that a collective (MPI, over
//! `anneal_dist::Collective` in the trainer, or the engine's `TpGroup` / `KvRing` /
//! `ExpertExchange`) moves, and where the result is rebuilt on the device and in the dtype it
//! came from.
//!
//! This stage stages through host memory: a GPU tensor is copied to the host, reduced or
//! exchanged there, and copied back. The next stage (NCCL on device buffers) replaces these
//! functions and the trainer's `parallel::staged`, not their callers. On the CPU nothing is
//! copied beyond what the collectives always did, so CPU results are bit for bit unchanged.

use crate::{DType, Device, Result, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes this process has moved between a device and host memory for collectives.
static STAGED_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes this process has copied between a GPU and host memory for collectives so far (both
/// directions, counted in the tensors' own dtypes): 0 where every collective runs on device
/// buffers. The trainer reports it at the end of a multi-process GPU run.
pub fn staged_bytes() -> u64 {
    STAGED_BYTES.load(Ordering::Relaxed)
}

/// Counts `t`'s bytes when it crosses between a device and the host.
fn count(t: &Tensor, to: Device) {
    if t.device() != to {
        let bytes = (t.numel() * t.dtype().size_in_bytes()) as u64;
        STAGED_BYTES.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// `t`'s values as f32 in host memory (row-major), whatever its device and dtype.
pub fn to_host(t: &Tensor) -> Vec<f32> {
    count(t, Device::Cpu);
    t.to_vec_f32()
}

/// Several tensors' values as f32, one after another in one host buffer (the order given).
pub fn flatten(ts: &[&Tensor]) -> Vec<f32> {
    let mut buf = Vec::with_capacity(ts.iter().map(|t| t.numel()).sum());
    for t in ts {
        count(t, Device::Cpu);
        buf.extend(t.to_vec_f32());
    }
    buf
}

/// A tensor of `shape` from host `values`, cast to `dtype` and placed on `device`: what comes
/// back from a collective, where its source lives.
pub fn from_host(
    values: Vec<f32>,
    shape: &[usize],
    dtype: DType,
    device: Device,
) -> Result<Tensor> {
    place(Tensor::from_vec(values, shape)?.to_dtype(dtype)?, device)
}

/// [`from_host`] keeping the f32 dtype (no cast, as the caller's code did before).
pub fn from_host_f32(values: Vec<f32>, shape: &[usize], device: Device) -> Result<Tensor> {
    place(Tensor::from_vec(values, shape)?, device)
}

/// `t` (built on the host from a collective's result) on `device`; unchanged on the CPU.
/// Never detaches: a tensor already on `device` is returned as it is.
pub fn place(t: Tensor, device: Device) -> Result<Tensor> {
    if t.device() == device {
        Ok(t)
    } else {
        count(&t, device);
        t.to_device(device)
    }
}

/// `t`'s elements as raw bytes in its own dtype, in host memory (what a byte-wise send moves).
pub fn to_host_bytes(t: &Tensor) -> Vec<u8> {
    count(t, Device::Cpu);
    t.to_bytes()
}

/// A tensor of `shape` and `dtype` from raw host `bytes` (a byte-wise receive), on `device`.
pub fn from_host_bytes(
    bytes: &[u8],
    dtype: DType,
    shape: &[usize],
    device: Device,
) -> Result<Tensor> {
    place(
        Tensor::from_storage(crate::Storage::from_bytes(dtype, bytes), shape)?,
        device,
    )
}
