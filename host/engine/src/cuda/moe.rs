//! Dropless MoE on CUDA, with nothing read back to the host: the stable sort of top-k choices
//! by expert, dispatch, combine and their gradients (kernels/moe.cu, in f32 with the CPU
//! backend's summation order), and the grouped expert GEMM in one launch reading the counts on
//! the device (`moe_gemm.rs`).

use super::backend::{contiguous_as, copy_cast};
use super::device::Gpu;
use super::launch::{empty, gpu_of, grid, launch, per_row, ptr, upload, zeros};
use crate::error::Result;
use crate::{DType, Device, Tensor};
use cudarc::driver::LaunchConfig;
use std::sync::Arc;

/// Assignments per block of the sort's passes (`SORT_CHUNK` of kernels/moe.cu).
const SORT_CHUNK: usize = 256;

/// `t` returned in `dtype` (it is f32).
fn finish(t: Tensor, dtype: DType, op: &'static str) -> Result<Tensor> {
    if dtype == DType::F32 {
        Ok(t)
    } else {
        copy_cast(&t, dtype, op)
    }
}

/// An index tensor as contiguous i64 on `gpu` (uploaded when it is a host tensor).
fn index_on(gpu: &Arc<Gpu>, t: &Tensor, op: &'static str) -> Result<Tensor> {
    match t.device() {
        Device::Cpu => upload(gpu, &t.to_vec::<i64>(), t.shape()),
        _ => contiguous_as(t, DType::I64, op),
    }
}

/// The stable counting sort of `ids [N, k]` by expert in three launches (chunk histograms,
/// their prefixes, the scatter): `[order, token, inverse, counts]` on the device, in the CPU
/// backend's order exactly (integer work: no rounding to differ).
pub(crate) fn sort_by_expert(ids: &Tensor, num_experts: usize) -> Result<[Tensor; 4]> {
    const OP: &str = "sort_by_expert";
    let gpu = gpu_of(ids, OP)?;
    let (n, k) = (ids.numel(), ids.shape().get(1).copied().unwrap_or(1).max(1));
    let order = zeros(&gpu, DType::I64, &[n])?;
    let token = zeros(&gpu, DType::I64, &[n])?;
    let inverse = zeros(&gpu, DType::I64, &[n])?;
    let counts = zeros(&gpu, DType::I64, &[num_experts])?;
    if n == 0 || num_experts == 0 {
        return Ok([order, token, inverse, counts]);
    }
    let chunks = n.div_ceil(SORT_CHUNK);
    let ids = index_on(&gpu, ids, OP)?;
    let hist = empty(&gpu, DType::I64, &[chunks, num_experts])?;
    let start = empty(&gpu, DType::I64, &[num_experts])?;
    let (ip, hp, cp, sp) = (
        ptr(&ids, OP)?,
        ptr(&hist, OP)?,
        ptr(&counts, OP)?,
        ptr(&start, OP)?,
    );
    let (op_, tp, vp) = (ptr(&order, OP)?, ptr(&token, OP)?, ptr(&inverse, OP)?);
    let [n64, e64, c64, k64] = [n, num_experts, chunks, k].map(|v| v as i64);
    let blocks = |shared: usize| LaunchConfig {
        grid_dim: (chunks as u32, 1, 1),
        block_dim: (SORT_CHUNK as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    launch!(gpu, "moe", "moe_sort_hist", blocks(4 * num_experts); ip, hp, n64, e64)?;
    launch!(gpu, "moe", "moe_sort_scan", per_row(1, 256); hp, cp, sp, c64, e64)?;
    launch!(gpu, "moe", "moe_sort_scatter", blocks(0); ip, hp, sp, op_, tp, vp, n64, e64, k64)?;
    Ok([order, token, inverse, counts])
}

/// `out[s] = x[token[s]]` for `x [N, D]`, in `dtype`.
pub(crate) fn dispatch(x: &Tensor, token: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "moe_dispatch";
    let gpu = gpu_of(x, OP)?;
    let (n, d, s) = (x.shape()[0], x.shape()[1], token.numel());
    let out = empty(&gpu, DType::F32, &[s, d])?;
    if s * d > 0 {
        let x = contiguous_as(x, DType::F32, OP)?;
        let t = index_on(&gpu, token, OP)?;
        let (xp, tp, op_) = (ptr(&x, OP)?, ptr(&t, OP)?, ptr(&out, OP)?);
        let [s64, d64, n64] = [s, d, n].map(|v| v as i64);
        launch!(gpu, "moe", "moe_dispatch_f32", grid(s * d); xp, tp, op_, s64, d64, n64)?;
    }
    finish(out, dtype, OP)
}

/// `dx[t] = Σ_j g[inverse[t·k + j]]`, in choice order, in `dtype`.
pub(crate) fn dispatch_backward(
    g: &Tensor,
    inverse: &Tensor,
    k: usize,
    dtype: DType,
) -> Result<Tensor> {
    const OP: &str = "moe_dispatch_backward";
    let gpu = gpu_of(g, OP)?;
    let (s, d) = (g.shape()[0], g.shape()[1]);
    let n = inverse.numel() / k.max(1);
    let out = zeros(&gpu, DType::F32, &[n, d])?;
    if n * d * k > 0 {
        let g = contiguous_as(g, DType::F32, OP)?;
        let inv = index_on(&gpu, inverse, OP)?;
        let (gp, ip, op_) = (ptr(&g, OP)?, ptr(&inv, OP)?, ptr(&out, OP)?);
        let [n64, k64, d64, s64] = [n, k, d, s].map(|v| v as i64);
        launch!(gpu, "moe", "moe_dispatch_backward_f32", grid(n * d); gp, ip, op_, n64, k64, d64, s64)?;
    }
    finish(out, dtype, OP)
}

/// `out[t] = Σ_j w[t, j] · y[inverse[t·k + j]]` for `y [N·k, D]`, `w [N, k]`, in `dtype`.
pub(crate) fn combine(y: &Tensor, w: &Tensor, inverse: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "moe_combine";
    let gpu = gpu_of(y, OP)?;
    let (n, k, d, s) = (w.shape()[0], w.shape()[1], y.shape()[1], y.shape()[0]);
    let out = zeros(&gpu, DType::F32, &[n, d])?;
    if n * d * k > 0 {
        let (y, w) = (
            contiguous_as(y, DType::F32, OP)?,
            contiguous_as(w, DType::F32, OP)?,
        );
        let inv = index_on(&gpu, inverse, OP)?;
        let (yp, wp, ip, op_) = (ptr(&y, OP)?, ptr(&w, OP)?, ptr(&inv, OP)?, ptr(&out, OP)?);
        let [n64, k64, d64, s64] = [n, k, d, s].map(|v| v as i64);
        launch!(gpu, "moe", "moe_combine_f32", grid(n * d); yp, wp, ip, op_, n64, k64, d64, s64)?;
    }
    finish(out, dtype, OP)
}

/// The gradients of [`combine`]: `dy [N·k, D]` and `dw [N, k]` (each when `need` asks).
#[allow(clippy::too_many_arguments)]
pub(crate) fn combine_backward(
    y: &Tensor,
    w: &Tensor,
    g: &Tensor,
    order: &Tensor,
    inverse: &Tensor,
    need: (bool, bool),
    dtypes: (DType, DType),
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    const OP: &str = "moe_combine_backward";
    let gpu = gpu_of(g, OP)?;
    let (n, k, d, s) = (w.shape()[0], w.shape()[1], y.shape()[1], y.shape()[0]);
    let g = contiguous_as(g, DType::F32, OP)?;
    let [k64, d64, s64] = [k, d, s].map(|v| v as i64);
    let dy = if need.0 {
        let out = empty(&gpu, DType::F32, &[n * k, d])?;
        if n * k * d > 0 {
            let w = contiguous_as(w, DType::F32, OP)?;
            let ord = index_on(&gpu, order, OP)?;
            let (wp, gp, op_, dp) = (ptr(&w, OP)?, ptr(&g, OP)?, ptr(&ord, OP)?, ptr(&out, OP)?);
            let nk = (n * k) as i64;
            launch!(gpu, "moe", "moe_combine_dy_f32", grid(n * k * d); wp, gp, op_, dp, nk, k64, d64)?;
        }
        Some(finish(out, dtypes.0, OP)?)
    } else {
        None
    };
    let dw = if need.1 {
        let out = zeros(&gpu, DType::F32, &[n, k])?;
        if n * k * d > 0 {
            super::launch::check_rows(n * k, OP)?;
            let y = contiguous_as(y, DType::F32, OP)?;
            let inv = index_on(&gpu, inverse, OP)?;
            let (yp, gp, ip, op_) = (ptr(&y, OP)?, ptr(&g, OP)?, ptr(&inv, OP)?, ptr(&out, OP)?);
            let threads = d.next_power_of_two().clamp(32, 256) as u32;
            launch!(gpu, "moe", "moe_combine_dw_f32", per_row(n * k, threads); yp, gp, ip, op_, k64, d64, s64)?;
        }
        Some(finish(out, dtypes.1, OP)?)
    } else {
        None
    };
    Ok((dy, dw))
}
