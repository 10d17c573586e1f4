//! The CUDA backend (feature `cuda`): cudarc with dynamic loading, so a binary built without CUDA
//! runs everywhere and finds the GPUs where a driver is installed.
//!
//! cudarc panics when a library it needs cannot be loaded, so nothing here calls into CUDA before
//! [`unavailable`] has checked that the driver (libcuda), cuBLAS and NVRTC are present and that
//! the driver sees a GPU. Kernels are CUDA C sources ([`kernels`]) compiled at run time by NVRTC
//! for the device's architecture; device memory comes from a caching, stream-ordered allocator
//! whose policy ([`pool`]) is plain Rust, testable without a GPU.

pub mod attention;
mod backend;
mod blas;
mod delta_rule;
mod device;
mod fused;
pub(crate) mod gathered_attention;
mod index;
pub mod kernels;
mod launch;
mod moe;
pub mod moe_gemm;
pub mod pool;
mod profiled;
mod staging;
mod streams;
pub mod wmma;

pub use backend::CudaBackend;
pub use delta_rule::{CudaDeltaRule, HostDeltaRule};
pub use device::{gpu, memory_stats, DeviceBuffer, Gpu};
pub(crate) use profiled::Profiled;
pub use streams::comm_stream;

use crate::error::{Error, Result};
use crate::storage::Storage;
use crate::{Device, Tensor};

/// A copy of `t` on `device` (contiguous, same dtype, no autograd): host to GPU, GPU to host,
/// or between GPUs through the host.
pub(crate) fn to_device(t: &Tensor, device: Device) -> Result<Tensor> {
    match (t.device(), device) {
        (Device::Cpu, Device::Cuda(n)) => {
            let g = gpu(n)?;
            let bytes = t.to_bytes();
            let mem = g.upload(&bytes)?;
            let mut st = Storage::on_device(mem, t.dtype(), t.numel());
            if keeps_mirror(t.dtype(), bytes.len()) {
                st = st.with_mirror(Storage::from_bytes(t.dtype(), &bytes));
            }
            Ok(Tensor::from_parts(
                std::sync::Arc::new(std::sync::RwLock::new(st)),
                crate::layout::Layout::contiguous(t.shape()),
                device,
            ))
        }
        (Device::Cuda(_), Device::Cpu) => {
            let c = backend::contiguous_as(t, t.dtype(), "to_device")?;
            let g = c.storage();
            let mem = g.device_mem().ok_or_else(|| Error::DeviceUnavailable {
                device: c.device(),
                reason: "to_device: the tensor's memory is not on the GPU".into(),
            })?;
            let size = t.dtype().size_in_bytes();
            let mut bytes = vec![0u8; t.numel() * size];
            mem.gpu()
                .download(mem.ptr() + (c.layout().offset() * size) as u64, &mut bytes)?;
            drop(g);
            Tensor::from_storage(Storage::from_bytes(t.dtype(), &bytes), t.shape())
        }
        (Device::Cuda(_), Device::Cuda(_)) => to_device(&to_device(t, Device::Cpu)?, device),
        (Device::Cpu, Device::Cpu) => Ok(t.detach()),
    }
}

/// Uploads of integer tensors up to this size keep their host values beside them
/// ([`Storage::with_mirror`]): a batch's token ids and targets, whose host reads (range checks,
/// the loss's mask, the embedding gradient's grouping) then cost no device round trip.
const MIRROR_BYTES: usize = 4 << 20;

fn keeps_mirror(dtype: crate::DType, bytes: usize) -> bool {
    matches!(dtype, crate::DType::I64 | crate::DType::I32) && bytes <= MIRROR_BYTES
}

/// Zeros of `shape` and `dtype` on GPU `ordinal`.
pub(crate) fn zeros_on(shape: &[usize], dtype: crate::DType, ordinal: usize) -> Result<Tensor> {
    launch::zeros(&gpu(ordinal)?, dtype, shape)
}

/// Writes `src` (any device, any dtype, `dst`'s shape) into the GPU view `dst`, which may be
/// strided: `src` is brought to `dst`'s device and dtype, then one kernel scatters it by `dst`'s
/// layout.
pub(crate) fn copy_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    const OP: &str = "copy";
    const PUTS: [&str; 4] = ["put_f32", "put_bf16", "put_i64", "put_i32"];
    let gpu = launch::gpu_of(dst, OP)?;
    let n = dst.numel();
    if n == 0 {
        return Ok(());
    }
    let name = format!("put_{}", launch::any_suffix(dst.dtype()));
    if !PUTS.contains(&name.as_str()) {
        return Err(Error::Invalid {
            op: OP,
            msg: format!("no CUDA kernel writes into a {} view yet", dst.dtype()),
        });
    }
    let src = if src.device() == dst.device() {
        src.detach()
    } else {
        src.to_device(dst.device())?
    };
    let src = backend::contiguous_as(&src, dst.dtype(), OP)?;
    let s = launch::Strided::of(dst.layout(), OP)?;
    let (sp, dp) = (launch::ptr(&src, OP)?, launch::storage_ptr(dst, OP)?);
    // Counted as a write, as a host write is.
    drop(dst.storage_mut());
    let n = n as i64;
    launch::launch!(gpu, "copy", name, launch::grid(n as usize); sp, dp, s, n)?;
    Ok(())
}

/// A contiguous copy of a GPU tensor in `dtype`, on its device.
pub(crate) fn materialize(t: &Tensor, dtype: crate::DType) -> Result<Tensor> {
    backend::copy_cast(t, dtype, "copy")
}

/// The whole of a GPU storage copied to host memory (for host reads such as `to_vec`).
pub(crate) fn download_storage(s: &Storage) -> Result<Storage> {
    let mem = s.device_mem().ok_or_else(|| Error::Invalid {
        op: "download",
        msg: "the storage is not on a GPU".into(),
    })?;
    let mut bytes = vec![0u8; s.len() * s.dtype().size_in_bytes()];
    mem.gpu().download(mem.ptr(), &mut bytes)?;
    Ok(Storage::from_bytes(s.dtype(), &bytes))
}

/// What the probe found on a usable CUDA device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device ordinal.
    pub ordinal: usize,
    /// The marketing name (`NVIDIA H200`).
    pub name: String,
    /// Total device memory in bytes.
    pub total_mem: usize,
    /// Compute capability `(major, minor)`: (9, 0) for Hopper.
    pub compute_capability: (i32, i32),
    /// How many CUDA devices the driver sees.
    pub device_count: usize,
}

impl DeviceInfo {
    /// The NVRTC architecture name for this device (`sm_90`).
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cuda:{} {} ({:.1} GiB, {}, {} device{})",
            self.ordinal,
            self.name,
            self.total_mem as f64 / (1u64 << 30) as f64,
            self.arch(),
            self.device_count,
            if self.device_count == 1 { "" } else { "s" }
        )
    }
}

/// The shared libraries the backend loads, with the name cudarc looks for and where they come
/// from: (what, file, hint).
const LIBRARIES: [(&str, &str, &str); 3] = [
    (
        "the CUDA driver library",
        "libcuda.so",
        "no NVIDIA driver is installed",
    ),
    (
        "cuBLAS",
        "libcublas.so",
        "install the CUDA toolkit or the nvidia-cublas wheel and put its lib folder on LD_LIBRARY_PATH",
    ),
    (
        "NVRTC",
        "libnvrtc.so",
        "install the CUDA toolkit or the nvidia-cuda-nvrtc wheel and put its lib folder on LD_LIBRARY_PATH",
    ),
];

/// Which of the backend's libraries cannot be loaded, as `(what, file, hint)`, in the order
/// they are needed. Never calls into CUDA.
pub fn missing_libraries() -> Vec<(&'static str, &'static str, &'static str)> {
    // SAFETY: these only try to open the shared libraries by name (dlopen), calling nothing.
    let present = unsafe {
        [
            cudarc::driver::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
        ]
    };
    LIBRARIES
        .iter()
        .zip(present)
        .filter(|(_, ok)| !ok)
        .map(|(lib, _)| *lib)
        .collect()
}

/// Whether NVRTC can be loaded (all that compiling kernels needs; no driver or GPU).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library by name.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Why CUDA device `ordinal` cannot be used on this machine, or what it is. Never panics: the
/// libraries are checked before any call, and driver errors become the reason.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, String> {
    let missing = missing_libraries();
    if !missing.is_empty() {
        let names: Vec<String> = missing
            .iter()
            .map(|(what, file, hint)| format!("{what} ({file}) was not found: {hint}"))
            .collect();
        return Err(names.join("; "));
    }
    let count = match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n > 0 => n as usize,
        Ok(_) => return Err("the CUDA driver reports no GPU".into()),
        Err(e) => return Err(format!("the CUDA driver could not count GPUs: {e}")),
    };
    if ordinal >= count {
        return Err(format!(
            "cuda:{ordinal} does not exist: the driver sees {count} GPU(s)"
        ));
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal)
        .map_err(|e| format!("cannot create a context on cuda:{ordinal}: {e}"))?;
    let err = |what: &str, e: cudarc::driver::DriverError| format!("cuda:{ordinal} {what}: {e}");
    Ok(DeviceInfo {
        ordinal,
        name: ctx.name().map_err(|e| err("name", e))?,
        total_mem: ctx.total_mem().map_err(|e| err("memory size", e))?,
        compute_capability: ctx
            .compute_capability()
            .map_err(|e| err("compute capability", e))?,
        device_count: count,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_reports_a_reason_instead_of_panicking() {
        match probe(0) {
            Ok(info) => {
                // A machine with a GPU: the probe describes it.
                assert!(!info.name.is_empty());
                assert!(info.total_mem > 0);
            }
            Err(why) => {
                // This machine (no driver) and CI: the reason names what is missing.
                assert!(!why.is_empty());
                if !missing_libraries().is_empty() {
                    assert!(why.contains("was not found"), "{why}");
                }
            }
        }
    }

    #[test]
    fn a_device_past_the_last_is_refused() {
        let err = probe(usize::MAX / 2).expect_err("no machine has that many GPUs");
        assert!(!err.is_empty());
    }
}
