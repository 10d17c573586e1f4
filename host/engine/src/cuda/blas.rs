//! Matrix products through cuBLAS: f32 in full f32 (no TF32, so GPU and CPU agree closely),
//! bf16 inputs with f32 accumulation. Row-major `C = A·B` is computed as the column-major
//! `Cᵀ = Bᵀ·Aᵀ`, so no operand is transposed or copied.

use super::backend::contiguous_as;
use super::launch::{empty, gpu_of, ptr, zeros};
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
    let data_type = if dtype == DType::BF16 {
        cudaDataType::CUDA_R_16BF
    } else {
        cudaDataType::CUDA_R_32F
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
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| super::device::cuda_error(gpu.ordinal, "cuBLAS gemm", format!("{e:?}")))?;
    Ok(out)
}
