//! A CUDA tensor's memory as a raw device address, for collectives that move device buffers
//! directly (NCCL, in `anneal-dist`), and the wait that orders them after the engine's work.

use crate::{Device, Result, Tensor};

impl Tensor {
    /// The GPU ordinal and the device address of the first element of a contiguous tensor on a
    /// CUDA device; `None` on the CPU, for a strided view, for released memory, or in a build
    /// without the `cuda` feature.
    ///
    /// The address is valid while this tensor (or another sharing its storage) lives. The
    /// engine queues its work on the device's stream, so the values are there only after that
    /// work: call [`synchronize`] on the device (or queue the reader on the same stream) first.
    /// A caller that writes through the address writes the tensor's storage behind the engine:
    /// do so only into a tensor made for that purpose (e.g. fresh [`Tensor::zeros_on`]).
    pub fn cuda_ptr(&self) -> Option<(usize, u64)> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(ordinal) = self.device() {
            if !self.is_contiguous() {
                return None;
            }
            let offset = (self.layout().offset() * self.dtype().size_in_bytes()) as u64;
            // Taken as a write: whatever is written through the address, a host copy kept
            // beside the storage (`Storage::with_mirror`) is dropped rather than go stale.
            return self
                .storage_mut()
                .device_mem()
                .map(|m| (ordinal, m.ptr() + offset));
        }
        None
    }
}

/// Waits for the work queued so far on `device` (its stream, on a GPU); nothing on the CPU.
pub fn synchronize(device: Device) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => crate::cuda::gpu(n)?.synchronize(),
        _ => Ok(()),
    }
}
