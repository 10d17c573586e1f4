//! Tensor-core products through `nvcuda::wmma` (kernels/wmma.cu): `a · b` in f32 from bf16
//! operands whose dims are multiples of 16, `b` as `[k, n]` or transposed as `[n, k]`.
//!
//! Not the backend's matmul: cuBLAS is faster and already runs bf16 on tensor cores. This is the
//! tested vehicle of the wmma fragments and cp.async pipeline (kernels/include/ on a GPU, the
//! CUDA emulation's own headers in CI) that tensor-core kernels such as attention build on, so
//! what they rely on is checked against the CPU wherever the tests run.

use super::backend::{contiguous_as, copy_cast};
use super::launch::{empty, gpu_of, launch, ptr, zeros};
use crate::error::{Error, Result};
use crate::{DType, Tensor};
use cudarc::driver::LaunchConfig;

const OP: &str = "wmma_matmul";
/// Rows and columns of the output per block (`WT` of kernels/wmma.cu; 4 warps of 16×16).
const TILE: usize = 32;
/// What every dim must be a multiple of: the fragment's side.
const FRAG: usize = 16;

/// How the second operand of [`matmul_bf16`] is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BLayout {
    /// `b` is `[k, n]`: the product is `a · b`.
    RowMajor,
    /// `b` is `[n, k]` (a linear layer's weight): the product is `a · bᵀ`.
    ColMajor,
}

/// `a [m, k] · b` as f32 `[m, n]` on tensor cores: bf16 products accumulated in f32 (so within
/// f32 rounding of the same sum on the CPU), `a` and `b` bf16 on one GPU of sm_80 or later, `m`,
/// `n` and `k` multiples of 16.
pub fn matmul_bf16(a: &Tensor, b: &Tensor, layout: BLayout) -> Result<Tensor> {
    let invalid = |msg: String| Error::Invalid { op: OP, msg };
    for t in [a, b] {
        if t.dtype() != DType::BF16 {
            return Err(Error::DType {
                op: OP,
                got: t.dtype(),
                expected: "bf16",
            });
        }
    }
    if a.rank() != 2 || b.rank() != 2 || a.device() != b.device() {
        return Err(invalid(format!(
            "takes two matrices on one GPU, got {:?} on {} and {:?} on {}",
            a.shape(),
            a.device(),
            b.shape(),
            b.device()
        )));
    }
    let (m, k) = (a.shape()[0], a.shape()[1]);
    let (kb, n) = match layout {
        BLayout::RowMajor => (b.shape()[0], b.shape()[1]),
        BLayout::ColMajor => (b.shape()[1], b.shape()[0]),
    };
    if kb != k || [m, n, k].iter().any(|d| d % FRAG != 0) {
        return Err(invalid(format!(
            "needs [m, k] · [k, n] ({layout:?}) with m, n, k multiples of {FRAG}, got {:?} and {:?}",
            a.shape(),
            b.shape()
        )));
    }
    let gpu = gpu_of(a, OP)?;
    if !tensor_cores(&gpu.arch) {
        return Err(invalid(format!(
            "bf16 tensor cores need sm_80 or later, the device is {}",
            gpu.arch
        )));
    }
    if m.div_ceil(TILE) > 65_535 {
        return Err(invalid(format!("{m} rows exceed one grid")));
    }
    if m * n == 0 || k == 0 {
        return zeros(&gpu, DType::F32, &[m, n]);
    }
    let (a, b) = (aligned(a, OP)?, aligned(b, OP)?);
    let c = empty(&gpu, DType::F32, &[m, n])?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(TILE) as u32, m.div_ceil(TILE) as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let name = match layout {
        BLayout::RowMajor => "wmma_gemm_bf16_nn",
        BLayout::ColMajor => "wmma_gemm_bf16_nt",
    };
    let (ap, bp, cp) = (ptr(&a, OP)?, ptr(&b, OP)?, ptr(&c, OP)?);
    let (m, n, k) = (m as i64, n as i64, k as i64);
    launch!(gpu, "wmma", name, cfg; ap, bp, cp, m, n, k)?;
    Ok(c)
}

/// Whether a device of architecture `arch` (`sm_90`) has the bf16 tensor cores the wmma kernels
/// use (sm_80 and later).
pub(crate) fn tensor_cores(arch: &str) -> bool {
    arch.trim_start_matches("sm_")
        .parse::<u32>()
        .is_ok_and(|cc| cc >= 80)
}

/// `t` as contiguous bf16 with its first element 32-byte aligned, as fragment loads and cp.async
/// need: itself, or a fresh copy (device allocations are aligned; a view's offset may not be).
pub(crate) fn aligned(t: &Tensor, op: &'static str) -> Result<Tensor> {
    let c = contiguous_as(t, DType::BF16, op)?;
    if ptr(&c, op)? % 32 == 0 {
        Ok(c)
    } else {
        copy_cast(&c, DType::BF16, op)
    }
}
