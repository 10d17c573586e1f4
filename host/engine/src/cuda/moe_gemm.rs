//! The grouped expert GEMM of mixture-of-experts in one launch, with the per-expert row counts
//! read on the device only (kernels/moe_gemm.cu): the counts of a routing computed on the GPU
//! never travel to the host, so the product queues without waiting for the device.
//!
//! [`grouped_matmul`] and [`grouped_matmul_weight_grad`] are the CUDA backend's grouped
//! products (bf16 operands give bf16, anything else f32), and make any counts safe without a
//! host check: a negative count is 0, a group running past
//! `N` is cut at `N`, rows past the counts' sum are zeros. bf16 runs on tensor cores (wmma, f32
//! accumulation) from sm_80, everything else on a tiled SIMT kernel accumulating in f32. Every
//! output element is summed in a fixed order without atomics: two runs give the same bits.
//!
//! The `_with` functions are the same products with the kernel family chosen, for the tests
//! (the SIMT bf16 kernels never run by default on an sm_80+ device or the emulator).

use super::backend::contiguous_as;
use super::launch::{empty, gpu_of, launch, ptr, zeros};
use super::wmma::tensor_cores;
use crate::error::{Error, Result};
use crate::{DType, Tensor};
use cudarc::driver::LaunchConfig;

/// Output rows per block (`MG_BM` of kernels/moe_gemm.cu; rows of `K` in the weight gradient).
const BM: usize = 64;
/// Output columns per block (`MG_BN`).
const BN: usize = 64;
/// Threads of the tensor-core kernels (4 warps of 32×32 output each).
const WMMA_THREADS: u32 = 128;
/// Threads of the SIMT kernels (16×16, 4×4 outputs each).
const SIMT_THREADS: u32 = 256;
/// The largest grid y and z dimension.
const GRID_YZ: usize = 65_535;

/// Which kernels a product runs on.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// Tensor cores for bf16 on sm_80 and later, SIMT otherwise (what the backend uses).
    Auto,
    /// The SIMT kernels whatever the dtype and device.
    Simt,
}

/// `x [N, K]` with rows grouped by expert (`counts[e]` consecutive rows for expert `e`, in
/// expert order) times `w[e]` (`w [E, K, M]`) or, with `transpose_w`, times `w[e]ᵀ`
/// (`w [E, M, K]`): `[N, M]`. One kernel launch; the counts are read on the device only.
pub(crate) fn grouped_matmul(
    x: &Tensor,
    w: &Tensor,
    counts: &Tensor,
    transpose_w: bool,
) -> Result<Tensor> {
    grouped_matmul_with(x, w, counts, transpose_w, Kernels::Auto)
}

/// `out[e] = x_eᵀ · g_e` over the row groups of `counts`: `[E, K, M]` for `x [N, K]`,
/// `g [N, M]`; zeros for an empty group. One launch; the counts are read on the device only.
pub(crate) fn grouped_matmul_weight_grad(
    x: &Tensor,
    g: &Tensor,
    counts: &Tensor,
) -> Result<Tensor> {
    grouped_matmul_weight_grad_with(x, g, counts, Kernels::Auto)
}

/// [`grouped_matmul`] on the kernels `kernels` picks (for the tests).
#[doc(hidden)]
pub fn grouped_matmul_with(
    x: &Tensor,
    w: &Tensor,
    counts: &Tensor,
    transpose_w: bool,
    kernels: Kernels,
) -> Result<Tensor> {
    const OP: &str = "grouped_matmul";
    let k_dim = if transpose_w { 2 } else { 1 };
    if x.rank() != 2 || w.rank() != 3 || x.shape()[1] != w.shape()[k_dim] {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: x.shape().to_vec(),
            rhs: w.shape().to_vec(),
        });
    }
    let gpu = gpu_of(x, OP)?;
    let (n, k, ne) = (x.shape()[0], x.shape()[1], w.shape()[0]);
    let m = w.shape()[3 - k_dim];
    let counts = device_counts(counts, x, w, ne, OP)?;
    let dtype = product_dtype(x, w);
    if n * m == 0 || k == 0 || ne == 0 {
        // Nothing to sum (or no expert: every row is past the counts).
        return zeros(&gpu, dtype, &[n, m]);
    }
    // Each group wastes less than one row tile, and the rows past the counts take the rest.
    let row_tiles = n.div_ceil(BM) + ne + 1;
    let col_tiles = m.div_ceil(BN);
    if row_tiles > i32::MAX as usize || col_tiles > GRID_YZ {
        return Err(too_big(OP, format!("[{n}, {m}] with {ne} experts")));
    }
    let (x, w) = (contiguous_as(x, dtype, OP)?, contiguous_as(w, dtype, OP)?);
    let out = empty(&gpu, dtype, &[n, m])?;
    let wmma = uses_wmma(dtype, &gpu.arch, kernels);
    let name = format!(
        "moe_gemm_{}{}_{}",
        if wmma { "wmma_" } else { "" },
        if transpose_w { "nt" } else { "nn" },
        suffix(dtype)
    );
    let cfg = LaunchConfig {
        grid_dim: (row_tiles as u32, col_tiles as u32, 1),
        block_dim: (if wmma { WMMA_THREADS } else { SIMT_THREADS }, 1, 1),
        shared_mem_bytes: 0,
    };
    let (xp, wp, cp, op) = (
        ptr(&x, OP)?,
        ptr(&w, OP)?,
        ptr(&counts, OP)?,
        ptr(&out, OP)?,
    );
    let [n, k, m, ne] = [n, k, m, ne].map(|v| v as i64);
    launch!(gpu, "moe_gemm", name, cfg; xp, wp, cp, op, n, k, m, ne)?;
    Ok(out)
}

/// [`grouped_matmul_weight_grad`] on the kernels `kernels` picks (for the tests).
#[doc(hidden)]
pub fn grouped_matmul_weight_grad_with(
    x: &Tensor,
    g: &Tensor,
    counts: &Tensor,
    kernels: Kernels,
) -> Result<Tensor> {
    const OP: &str = "grouped_matmul_weight_grad";
    if x.rank() != 2 || g.rank() != 2 || x.shape()[0] != g.shape()[0] {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: x.shape().to_vec(),
            rhs: g.shape().to_vec(),
        });
    }
    let gpu = gpu_of(x, OP)?;
    let (n, k, m) = (x.shape()[0], x.shape()[1], g.shape()[1]);
    let ne = counts.shape().first().copied().unwrap_or(0);
    let counts = device_counts(counts, x, g, ne, OP)?;
    let dtype = product_dtype(x, g);
    if ne * k * m == 0 || n == 0 {
        // No rows or nothing to write: every group's gradient is zero.
        return zeros(&gpu, dtype, &[ne, k, m]);
    }
    let (col_tiles, row_tiles) = (m.div_ceil(BN), k.div_ceil(BM));
    if col_tiles > i32::MAX as usize || row_tiles > GRID_YZ || ne > GRID_YZ {
        return Err(too_big(OP, format!("[{ne}, {k}, {m}]")));
    }
    let (x, g) = (contiguous_as(x, dtype, OP)?, contiguous_as(g, dtype, OP)?);
    let out = empty(&gpu, dtype, &[ne, k, m])?;
    let wmma = uses_wmma(dtype, &gpu.arch, kernels);
    let name = format!(
        "moe_wgrad_{}{}",
        if wmma { "wmma_" } else { "" },
        suffix(dtype)
    );
    let cfg = LaunchConfig {
        grid_dim: (col_tiles as u32, row_tiles as u32, ne as u32),
        block_dim: (if wmma { WMMA_THREADS } else { SIMT_THREADS }, 1, 1),
        shared_mem_bytes: 0,
    };
    let (xp, gp, cp, op) = (
        ptr(&x, OP)?,
        ptr(&g, OP)?,
        ptr(&counts, OP)?,
        ptr(&out, OP)?,
    );
    let [n, k, m, ne] = [n, k, m, ne].map(|v| v as i64);
    launch!(gpu, "moe_gemm", name, cfg; xp, gp, cp, op, n, k, m, ne)?;
    Ok(out)
}

/// bf16 when both operands are bf16, else f32 (the per-expert products' rule).
fn product_dtype(a: &Tensor, b: &Tensor) -> DType {
    if a.dtype() == DType::BF16 && b.dtype() == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    }
}

/// Whether a product in `dtype` on a device of `arch` runs on tensor cores.
fn uses_wmma(dtype: DType, arch: &str, kernels: Kernels) -> bool {
    dtype == DType::BF16 && kernels == Kernels::Auto && tensor_cores(arch)
}

/// The kernel-name suffix of the compute dtype.
fn suffix(dtype: DType) -> &'static str {
    if dtype == DType::BF16 {
        "bf16"
    } else {
        "f32"
    }
}

/// `counts` as a contiguous i64 `[E]` tensor on the operands' GPU (an i32 one converted there
/// by a copy kernel): checked by shape, dtype and device only, its values never read here.
fn device_counts(
    counts: &Tensor,
    a: &Tensor,
    b: &Tensor,
    experts: usize,
    op: &'static str,
) -> Result<Tensor> {
    if !matches!(counts.dtype(), DType::I64 | DType::I32) {
        return Err(Error::DType {
            op,
            got: counts.dtype(),
            expected: "i64 or i32 counts",
        });
    }
    if counts.rank() != 1 || counts.shape()[0] != experts {
        return Err(Error::Invalid {
            op,
            msg: format!(
                "counts must be 1-d with one entry per expert ({experts}), got {:?}",
                counts.shape()
            ),
        });
    }
    if counts.device() != a.device() || b.device() != a.device() {
        return Err(Error::Invalid {
            op,
            msg: format!(
                "operands and counts must be on one GPU, got {}, {} and counts on {}",
                a.device(),
                b.device(),
                counts.device()
            ),
        });
    }
    contiguous_as(counts, DType::I64, op)
}

/// A product whose grid does not fit one launch.
fn too_big(op: &'static str, what: String) -> Error {
    Error::Invalid {
        op,
        msg: format!("{what} exceeds one CUDA grid"),
    }
}
