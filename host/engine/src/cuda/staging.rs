//! Host <-> device copies through pinned (page-locked) staging memory: the DMA engine reads and
//! writes pinned pages directly, and two halves let the CPU fill (or drain) one while the other
//! is in flight, so a large checkpoint or batch moves at bus speed instead of through the
//! driver's pageable path.

use super::device::Gpu;
use crate::error::Result;
use cudarc::driver::{result as drv, CudaEvent};

/// Bytes per half of the staging buffer.
pub(crate) const HALF: usize = 8 << 20;
/// Copies below this go straight from pageable memory (staging would only add a memcpy).
pub(crate) const MIN_STAGED: usize = 1 << 20;

/// Two pinned halves of [`HALF`] bytes each, owned by one device.
pub(crate) struct Staging {
    ptr: *mut u8,
}

// SAFETY: the pinned block is owned by this value and only used under the device's lock.
unsafe impl Send for Staging {}

impl Staging {
    pub(crate) fn new(gpu: &Gpu) -> Result<Staging> {
        gpu.bind()?;
        // SAFETY: a fresh page-locked allocation of 2·HALF bytes, freed in Drop.
        let ptr = unsafe { drv::malloc_host(2 * HALF, 0) }
            .map_err(|e| super::device::cuda_error(gpu.ordinal, "pinned host memory", e))?;
        Ok(Staging { ptr: ptr.cast() })
    }

    fn half(&mut self, h: usize) -> &mut [u8] {
        // SAFETY: ptr holds 2·HALF bytes; `h` is 0 or 1; &mut self makes the slice exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(h * HALF), HALF) }
    }

    /// Copies `bytes` to device address `dst`, chunk by chunk through alternating halves; a
    /// half is refilled only once the copy that last read it has finished (its event).
    pub(crate) fn upload(&mut self, gpu: &Gpu, dst: u64, bytes: &[u8]) -> Result<()> {
        let mut done: [Option<CudaEvent>; 2] = [None, None];
        for (i, chunk) in bytes.chunks(HALF).enumerate() {
            let h = i % 2;
            if let Some(e) = done[h].take() {
                e.synchronize().map_err(|e| gpu_err(gpu, e))?;
            }
            let buf = &mut self.half(h)[..chunk.len()];
            buf.copy_from_slice(chunk);
            // SAFETY: `dst + i·HALF` has `chunk.len()` bytes left (the caller's block holds
            // `bytes.len()`); the pinned half stays untouched until its event has fired.
            unsafe {
                drv::memcpy_htod_async(dst + (i * HALF) as u64, &*buf, gpu.stream.cu_stream())
            }
            .map_err(|e| gpu_err(gpu, e))?;
            done[h] = Some(gpu.stream.record_event(None).map_err(|e| gpu_err(gpu, e))?);
        }
        gpu.synchronize()
    }

    /// Copies `out.len()` bytes from device address `src`: chunk `i` is drained from its half
    /// while chunk `i + 1` is in flight into the other.
    pub(crate) fn download(&mut self, gpu: &Gpu, src: u64, out: &mut [u8]) -> Result<()> {
        let n = out.len().div_ceil(HALF);
        let mut pending: Option<(usize, CudaEvent)> = None;
        for i in 0..=n {
            if i < n {
                let len = HALF.min(out.len() - i * HALF);
                let buf = &mut self.half(i % 2)[..len];
                // SAFETY: `src + i·HALF` has `len` bytes; the half was drained (below) before
                // this copy is queued into it again.
                unsafe {
                    drv::memcpy_dtoh_async(buf, src + (i * HALF) as u64, gpu.stream.cu_stream())
                }
                .map_err(|e| gpu_err(gpu, e))?;
            }
            let next = if i < n {
                Some((
                    i,
                    gpu.stream.record_event(None).map_err(|e| gpu_err(gpu, e))?,
                ))
            } else {
                None
            };
            if let Some((j, e)) = pending.take() {
                e.synchronize().map_err(|e| gpu_err(gpu, e))?;
                let len = HALF.min(out.len() - j * HALF);
                let start = j * HALF;
                let half = &self.half(j % 2)[..len];
                out[start..start + len].copy_from_slice(half);
            }
            pending = next;
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host in `new`; no copy is in flight (every upload and
        // download waits for its copies before returning).
        let _ = unsafe { drv::free_host(self.ptr.cast()) };
    }
}

fn gpu_err(gpu: &Gpu, e: impl std::fmt::Display) -> crate::Error {
    super::device::cuda_error(gpu.ordinal, "staged copy", e)
}
