//! Matrix products through cuBLAS: f32 in full f32 (no TF32 unless `crate::set_allow_tf32`
//! asked for it, so GPU and CPU agree closely),
//! bf16 inputs with f32 accumulation. Row-major `C = A·B` is computed as the column-major
//! `Cᵀ = Bᵀ·Aᵀ`, so no operand is transposed or copied. In batch-invariant mode the products
//! run on kernels/gemm.cu instead: one FMA chain per element whatever the shape, so a row's
//! result does not depend on the rows beside it (cuBLAS picks its algorithm by size).

use super::backend::contiguous_as;
use super::device::Gpu;
use super::launch::{empty, gpu_of, launch, ptr, zeros};
use crate::error::{Error, Result};
use crate::{DType, Tensor};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};

/// Batched `[batch.., m, k] @ [batch.., k, n]` (equal batch dims).
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "matmul";
    let rank = a.rank();
    let (m, k, n) = (
        a.shape()[rank - 2],
        a.shape()[rank - 1],
        b.shape()[rank - 1],
    );
    let batch_shape = &a.shape()[..rank - 2];
    let batch: usize = batch_shape.iter().product();
    let mut out_shape = batch_shape.to_vec();
    out_shape.extend([m, n]);
    let dtype = if a.dtype() == b.dtype() && a.dtype() == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    };
    let gpu = gpu_of(a, OP)?;
    if batch * m * n == 0 {
        return empty(&gpu, dtype, &out_shape);
    }
    if k == 0 {
        return zeros(&gpu, dtype, &out_shape);
    }
    let too_big = |v: usize| v > i32::MAX as usize;
    if too_big(m) || too_big(n) || too_big(k) || too_big(batch) {
        return Err(Error::Invalid {
            op: OP,
            msg: format!("dims {m}x{k}x{n} (batch {batch}) exceed cuBLAS's 32-bit sizes"),
        });
    }
    let (a, b) = (contiguous_as(a, dtype, OP)?, contiguous_as(b, dtype, OP)?);
    let out = empty(&gpu, dtype, &out_shape)?;
    if crate::invariant::batch_invariant() {
        invariant(&gpu, &a, &b, &out, [batch, m, k, n])?;
        return Ok(out);
    }
    let data_type = if dtype == DType::BF16 {
        cudaDataType::CUDA_R_16BF
    } else {
        cudaDataType::CUDA_R_32F
    };
    // TF32 only where asked (`crate::set_allow_tf32`), for f32 operands.
    let compute = if dtype == DType::F32 && crate::allow_tf32() {
        cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
    } else {
        cublasComputeType_t::CUBLAS_COMPUTE_32F
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    let blas = gpu.blas()?;
    gpu.bind()?;
    // SAFETY: the pointers are live device allocations of the contiguous operands and output,
    // sized batch·m·k, batch·k·n and batch·m·n elements; cuBLAS runs on the device's stream.
    unsafe {
        cudarc::cublas::result::gemm_strided_batched_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_N,
            cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            m as i32,
            k as i32,
            (&alpha as *const f32).cast(),
            ptr(&b, OP)? as *const std::ffi::c_void,
            data_type,
            n as i32,
            (k * n) as i64,
            ptr(&a, OP)? as *const std::ffi::c_void,
            data_type,
            k as i32,
            (m * k) as i64,
            (&beta as *const f32).cast(),
            ptr(&out, OP)? as *mut std::ffi::c_void,
            data_type,
            n as i32,
            (m * n) as i64,
            batch as i32,
            compute,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| super::device::cuda_error(gpu.ordinal, "cuBLAS gemm", format!("{e:?}")))?;
    Ok(out)
}

/// Outputs per block side of kernels/gemm.cu (`GT`).
const INVARIANT_TILE: usize = 64;
/// The hardware's bound on a grid's y and z dimensions.
const GRID_YZ: usize = 65_535;

/// `out[b] = a[b]·b[b]` (contiguous `[batch, m, k]`, `[batch, k, n]`, `[batch, m, n]`, all of
/// `out`'s dtype) on the batch-invariant kernel, in launches of at most [`GRID_YZ`] batch
/// entries.
fn invariant(
    gpu: &std::sync::Arc<Gpu>,
    a: &Tensor,
    b: &Tensor,
    out: &Tensor,
    [batch, m, k, n]: [usize; 4],
) -> Result<()> {
    const OP: &str = "matmul";
    let row_tiles = m.div_ceil(INVARIANT_TILE);
    if row_tiles > GRID_YZ {
        return Err(Error::Invalid {
            op: OP,
            msg: format!("{m} rows exceed one launch of the batch-invariant product"),
        });
    }
    let name = format!(
        "gemm_invariant_{}",
        super::launch::float_suffix(out.dtype(), OP)?
    );
    let size = out.dtype().size_in_bytes() as u64;
    let (pa, pb, pc) = (ptr(a, OP)?, ptr(b, OP)?, ptr(out, OP)?);
    let (mi, ki, ni) = (m as i64, k as i64, n as i64);
    let mut first = 0;
    while first < batch {
        let count = (batch - first).min(GRID_YZ);
        let at = |p: u64, per: usize| p + (first * per) as u64 * size;
        let (ca, cb, cc) = (at(pa, m * k), at(pb, k * n), at(pc, m * n));
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (
                n.div_ceil(INVARIANT_TILE) as u32,
                row_tiles as u32,
                count as u32,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(gpu, "gemm", name, cfg; ca, cb, cc, mi, ki, ni)?;
        first += count;
    }
    Ok(())
}
