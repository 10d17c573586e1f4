//! The Anneal engine: tensors, dtypes, devices, ops with autograd, and the CPU backend.
//!
//! ```
//! use anneal_engine::{Tensor, DType};
//! let w = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap().requires_grad_();
//! let x = Tensor::ones(&[3, 2], DType::F32);
//! let loss = x.matmul(&w).unwrap().sum_all().unwrap();
//! loss.backward().unwrap();
//! assert_eq!(w.grad().unwrap().to_vec::<f32>(), vec![3.0, 3.0, 3.0, 3.0]);
//! ```

pub mod alloc;
pub mod autocast;
pub mod autograd;
pub mod backend;
mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
mod device_ptr;
mod dtype;
mod error;
pub mod flops;
pub mod invariant;
pub mod io;
pub mod layout;
pub mod ops;
pub mod profile;
pub mod rng;
pub mod staged;
mod storage;
pub mod streams;
mod tensor;

pub use cpu::logsumexp::logsumexp;
pub use cpu::simd::{level as simd_level, SimdLevel};
pub use device::Device;
pub use device_ptr::synchronize;
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use storage::Storage;
pub use streams::{record_stream, Stream, StreamEvent};
pub use tensor::Tensor;

/// Sizes the CPU backend's persistent thread pool (call once, before any op; later calls fail).
/// Without it the pool uses `RAYON_NUM_THREADS` or one thread per core.
pub fn init_threads(n: usize) -> Result<()> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .map_err(|e| error::Error::Invalid {
            op: "init_threads",
            msg: e.to_string(),
        })
}

static ALLOW_TF32: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Lets float32 matrix products on a GPU round their inputs to TF32 (tensor cores, f32
/// accumulation), for the whole process (`training.allow_tf32`). Off by default; the CPU
/// backend, bf16 products and batch-invariant mode ignore it.
pub fn set_allow_tf32(on: bool) {
    ALLOW_TF32.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`set_allow_tf32`] turned TF32 products on.
pub fn allow_tf32() -> bool {
    ALLOW_TF32.load(std::sync::atomic::Ordering::Relaxed)
}

/// The matrix-product kernels this CPU runs, in words (chosen at run time by its features):
/// `f32: ...; bf16: ...`.
pub fn matmul_kernels() -> String {
    let f32 = if cpu::sgemm_available() && cpu::simd::level() == cpu::simd::SimdLevel::Avx512 {
        "packed AVX-512 (12x32 FMA micro-kernel)"
    } else if cpu::sgemm_available() {
        "packed AVX2/FMA (12x32 block as 6x16 micro-kernels)"
    } else {
        "gemm crate (AVX2/FMA or scalar)"
    };
    let bf16 = if cpu::bf16_gemm_available() {
        "AVX512-BF16 dot products, f32 accumulation"
    } else {
        "converted to f32"
    };
    format!("f32: {f32}; bf16: {bf16}")
}

/// Threads the CPU backend computes with.
pub fn num_threads() -> usize {
    rayon::current_num_threads()
}
