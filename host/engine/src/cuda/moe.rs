//! Dropless MoE on CUDA: routing (kernels/moe.cu: dispatch, combine and their gradients, in f32
//! with the CPU backend's summation order) and the grouped expert GEMM as one cuBLAS product
//! per expert on row ranges of the sorted tokens.

use super::backend::{contiguous_as, copy_cast};
use super::launch::{empty, gpu_of, grid, launch, per_row, ptr, upload, zeros};
use crate::error::{Error, Result};
use crate::{DType, Tensor};

/// `t` returned in `dtype` (it is f32).
fn finish(t: Tensor, dtype: DType, op: &'static str) -> Result<Tensor> {
    if dtype == DType::F32 {
        Ok(t)
    } else {
        copy_cast(&t, dtype, op)
    }
}

/// Each routing entry must name a row of a tensor with `rows` rows: checked on the host so a
/// routing made for another batch is an error, not an out-of-bounds read.
fn check_rows_of(op: &'static str, v: &[i64], rows: usize) -> Result<()> {
    match v.iter().find(|&&i| i < 0 || i as u64 >= rows as u64) {
        Some(&bad) => Err(Error::IndexOutOfRange {
            op,
            index: bad,
            size: rows,
        }),
        None => Ok(()),
    }
}

/// `out[s] = x[token[s]]` for `x [N, D]`, in `dtype`.
pub(crate) fn dispatch(x: &Tensor, token: &[i64], dtype: DType) -> Result<Tensor> {
    const OP: &str = "moe_dispatch";
    let gpu = gpu_of(x, OP)?;
    let (n, d) = (x.shape()[0], x.shape()[1]);
    check_rows_of(OP, token, n)?;
    let out = empty(&gpu, DType::F32, &[token.len(), d])?;
    if token.len() * d > 0 {
        let x = contiguous_as(x, DType::F32, OP)?;
        let t = upload(&gpu, token, &[token.len()])?;
        let (xp, tp, op_) = (ptr(&x, OP)?, ptr(&t, OP)?, ptr(&out, OP)?);
        let (s, d64) = (token.len() as i64, d as i64);
        launch!(gpu, "moe", "moe_dispatch_f32", grid(token.len() * d); xp, tp, op_, s, d64)?;
    }
    finish(out, dtype, OP)
}

/// `dx[t] = Σ_j g[inverse[t·k + j]]`, in choice order, in `dtype`.
pub(crate) fn dispatch_backward(
    g: &Tensor,
    inverse: &[i64],
    k: usize,
    dtype: DType,
) -> Result<Tensor> {
    const OP: &str = "moe_dispatch_backward";
    let gpu = gpu_of(g, OP)?;
    let d = g.shape()[1];
    let n = inverse.len() / k.max(1);
    check_rows_of(OP, inverse, g.shape()[0])?;
    let out = zeros(&gpu, DType::F32, &[n, d])?;
    if n * d * k > 0 {
        let g = contiguous_as(g, DType::F32, OP)?;
        let inv = upload(&gpu, inverse, &[inverse.len()])?;
        let (gp, ip, op_) = (ptr(&g, OP)?, ptr(&inv, OP)?, ptr(&out, OP)?);
        let [n64, k64, d64] = [n, k, d].map(|v| v as i64);
        launch!(gpu, "moe", "moe_dispatch_backward_f32", grid(n * d); gp, ip, op_, n64, k64, d64)?;
    }
    finish(out, dtype, OP)
}

/// `out[t] = Σ_j w[t, j] · y[inverse[t·k + j]]` for `y [N·k, D]`, `w [N, k]`, in `dtype`.
pub(crate) fn combine(y: &Tensor, w: &Tensor, inverse: &[i64], dtype: DType) -> Result<Tensor> {
    const OP: &str = "moe_combine";
    let gpu = gpu_of(y, OP)?;
    let (n, k, d) = (w.shape()[0], w.shape()[1], y.shape()[1]);
    check_rows_of(OP, inverse, y.shape()[0])?;
    let out = zeros(&gpu, DType::F32, &[n, d])?;
    if n * d * k > 0 {
        let (y, w) = (
            contiguous_as(y, DType::F32, OP)?,
            contiguous_as(w, DType::F32, OP)?,
        );
        let inv = upload(&gpu, inverse, &[inverse.len()])?;
        let (yp, wp, ip, op_) = (ptr(&y, OP)?, ptr(&w, OP)?, ptr(&inv, OP)?, ptr(&out, OP)?);
        let [n64, k64, d64] = [n, k, d].map(|v| v as i64);
        launch!(gpu, "moe", "moe_combine_f32", grid(n * d); yp, wp, ip, op_, n64, k64, d64)?;
    }
    finish(out, dtype, OP)
}

/// The gradients of [`combine`]: `dy [N·k, D]` and `dw [N, k]` (each when `need` asks).
#[allow(clippy::too_many_arguments)]
pub(crate) fn combine_backward(
    y: &Tensor,
    w: &Tensor,
    g: &Tensor,
    order: &[i64],
    inverse: &[i64],
    need: (bool, bool),
    dtypes: (DType, DType),
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    const OP: &str = "moe_combine_backward";
    let gpu = gpu_of(g, OP)?;
    let (n, k, d) = (w.shape()[0], w.shape()[1], y.shape()[1]);
    check_rows_of(OP, order, n * k)?;
    check_rows_of(OP, inverse, y.shape()[0])?;
    let g = contiguous_as(g, DType::F32, OP)?;
    let [k64, d64] = [k, d].map(|v| v as i64);
    let dy = if need.0 {
        let out = empty(&gpu, DType::F32, &[n * k, d])?;
        if n * k * d > 0 {
            let w = contiguous_as(w, DType::F32, OP)?;
            let ord = upload(&gpu, order, &[order.len()])?;
            let (wp, gp, op_, dp) = (ptr(&w, OP)?, ptr(&g, OP)?, ptr(&ord, OP)?, ptr(&out, OP)?);
            let s = order.len() as i64;
            launch!(gpu, "moe", "moe_combine_dy_f32", grid(n * k * d); wp, gp, op_, dp, s, k64, d64)?;
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
            let inv = upload(&gpu, inverse, &[inverse.len()])?;
            let (yp, gp, ip, op_) = (ptr(&y, OP)?, ptr(&g, OP)?, ptr(&inv, OP)?, ptr(&out, OP)?);
            let threads = d.next_power_of_two().clamp(32, 256) as u32;
            launch!(gpu, "moe", "moe_combine_dw_f32", per_row(n * k, threads); yp, gp, ip, op_, k64, d64)?;
        }
        Some(finish(out, dtypes.1, OP)?)
    } else {
        None
    };
    Ok((dy, dw))
}

/// Rows `start..start + len` of a 2-d tensor (a view).
fn rows(t: &Tensor, start: usize, len: usize) -> Result<Tensor> {
    Ok(t.with_layout(t.layout().narrow(0, start, len)?))
}

/// Expert `e` of `w [E, K, M]` as a `[K, M]` view (its transpose with `transpose`).
fn expert(w: &Tensor, e: usize, transpose: bool) -> Result<Tensor> {
    let (k, m) = (w.shape()[1], w.shape()[2]);
    let one = w.layout().narrow(0, e, 1)?;
    let l =
        crate::layout::Layout::from_parts(vec![k, m], one.strides()[1..].to_vec(), one.offset());
    let l = if transpose { l.permute(&[1, 0])? } else { l };
    Ok(w.with_layout(l))
}

/// Rows of `x [N, K]` grouped by `counts` times `w[e]` (or `w[e]ᵀ`): one cuBLAS product per
/// non-empty group, written into its rows of the output.
pub(crate) fn grouped_matmul(
    x: &Tensor,
    w: &Tensor,
    counts: &[usize],
    transpose_w: bool,
) -> Result<Tensor> {
    const OP: &str = "grouped_matmul";
    let gpu = gpu_of(x, OP)?;
    let m = if transpose_w {
        w.shape()[1]
    } else {
        w.shape()[2]
    };
    let dtype = if x.dtype() == w.dtype() && x.dtype() == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    };
    let x = contiguous_as(x, dtype, OP)?;
    let n = x.shape()[0];
    let mut parts = Vec::new();
    let mut start = 0;
    for (e, &c) in counts.iter().enumerate() {
        if c > 0 {
            parts.push(super::blas::matmul(
                &rows(&x, start, c)?,
                &expert(w, e, transpose_w)?,
            )?);
        }
        start += c;
    }
    if parts.is_empty() {
        return zeros(&gpu, dtype, &[n, m]);
    }
    super::index::cat(&parts, 0)
}

/// `out[e] = x_eᵀ · g_e` over the row groups of `counts`: `[E, K, M]` (zeros for an empty
/// group), one cuBLAS product per group.
pub(crate) fn grouped_matmul_weight_grad(
    x: &Tensor,
    g: &Tensor,
    counts: &[usize],
) -> Result<Tensor> {
    const OP: &str = "grouped_matmul_weight_grad";
    let gpu = gpu_of(x, OP)?;
    let (k, m) = (x.shape()[1], g.shape()[1]);
    let dtype = if x.dtype() == g.dtype() && x.dtype() == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    };
    let (x, g) = (contiguous_as(x, dtype, OP)?, contiguous_as(g, dtype, OP)?);
    let mut parts = Vec::with_capacity(counts.len());
    let mut start = 0;
    for &c in counts {
        let part = if c > 0 {
            let xt = rows(&x, start, c)?;
            let xt = xt.with_layout(xt.layout().permute(&[1, 0])?);
            super::blas::matmul(&xt, &rows(&g, start, c)?)?
        } else {
            zeros(&gpu, dtype, &[k, m])?
        };
        parts.push(part.with_layout(crate::layout::Layout::contiguous(&[1, k, m])));
        start += c;
    }
    if parts.is_empty() {
        return zeros(&gpu, dtype, &[0, k, m]);
    }
    super::index::cat(&parts, 0)
}
