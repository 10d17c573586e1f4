//! The fused transformer kernels on CUDA ([`FusedBackend`], [`FusionBackend`],
//! [`OptimBackend`]): softmax, RMSNorm, LayerNorm, RoPE, embedding, cross-entropy, SwiGLU and
//! AdamW, each forward and backward one kernel with fixed-order reductions (norm weight and bias
//! gradients in two fixed stages, never with atomics).

use super::backend::{contiguous_as, copy_cast, CudaBackend};
use super::launch::{
    check_rows, empty, float_suffix, gpu_of, grid, launch, not_yet, per_row, ptr, upload, zeros,
};
use crate::backend::{FusedBackend, FusionBackend, OptimBackend};
use crate::error::{Error, Result};
use crate::ops::{AdamW, AdamWTensors, RopeLayout, RopeSpec, RopeStyle};
use crate::{DType, Tensor};
use cudarc::driver::{DeviceRepr, LaunchConfig};

/// Threads per row-wise block (a power of two, as the block reductions need).
const ROW_THREADS: u32 = 256;
/// Rows per partial sum of the RMSNorm weight gradient (fixed: the sum order never changes).
const DW_CHUNK: usize = 256;

/// `f` over the last dim of `xs` when `dim` is another: the operands with `dim` and the last
/// swapped (views), `f`'s result swapped back and made contiguous. `None` when `dim` is last.
fn via_last_dim(
    xs: &[&Tensor],
    dim: usize,
    f: impl FnOnce(&[Tensor], usize) -> Result<Tensor>,
) -> Option<Result<Tensor>> {
    let last = xs[0].rank().checked_sub(1)?;
    if dim == last {
        return None;
    }
    let run = || {
        let swapped = xs
            .iter()
            .map(|x| x.transpose(dim as isize, last as isize))
            .collect::<Result<Vec<_>>>()?;
        f(&swapped, last)?
            .transpose(dim as isize, last as isize)?
            .contiguous()
    };
    Some(run())
}

/// `w` as contiguous f32 on the device, or a null pointer when absent.
fn weight_f32(w: Option<&Tensor>, op: &'static str) -> Result<(Option<Tensor>, u64)> {
    match w {
        None => Ok((None, 0)),
        Some(w) => {
            let w = contiguous_as(w, DType::F32, op)?;
            let p = ptr(&w, op)?;
            Ok((Some(w), p))
        }
    }
}

impl FusedBackend for CudaBackend {
    fn softmax(&self, x: &Tensor, dim: usize, log: bool) -> Result<Tensor> {
        const OP: &str = "softmax";
        // Over another dim (an attention's scores over keys held in dim -2): by a transpose.
        if let Some(r) = via_last_dim(&[x], dim, |t, d| self.softmax(&t[0], d, log)) {
            return r;
        }
        let suf = float_suffix(x.dtype(), OP)?;
        let gpu = gpu_of(x, OP)?;
        let x = contiguous_as(x, x.dtype(), OP)?;
        let out = empty(&gpu, x.dtype(), x.shape())?;
        let n = x.shape()[dim];
        let rows = x.numel() / n.max(1);
        if rows * n > 0 {
            check_rows(rows, OP)?;
            let (xp, yp, n, lg) = (ptr(&x, OP)?, ptr(&out, OP)?, n as i64, log as i32);
            launch!(gpu, "softmax", format!("softmax_{suf}"), per_row(rows, ROW_THREADS); xp, yp, n, lg)?;
        }
        Ok(out)
    }

    fn softmax_backward(&self, y: &Tensor, g: &Tensor, dim: usize, log: bool) -> Result<Tensor> {
        const OP: &str = "softmax_backward";
        if let Some(r) = via_last_dim(&[y, g], dim, |t, d| {
            self.softmax_backward(&t[0], &t[1], d, log)
        }) {
            return r;
        }
        let dtype = if y.dtype() == g.dtype() {
            y.dtype()
        } else {
            DType::F32
        };
        let suf = float_suffix(dtype, OP)?;
        let gpu = gpu_of(y, OP)?;
        let (y, g) = (contiguous_as(y, dtype, OP)?, contiguous_as(g, dtype, OP)?);
        let out = empty(&gpu, dtype, y.shape())?;
        let n = y.shape()[dim];
        let rows = y.numel() / n.max(1);
        if rows * n > 0 {
            check_rows(rows, OP)?;
            let (yp, gp, dp, n, lg) = (
                ptr(&y, OP)?,
                ptr(&g, OP)?,
                ptr(&out, OP)?,
                n as i64,
                log as i32,
            );
            launch!(gpu, "softmax", format!("softmax_backward_{suf}"), per_row(rows, ROW_THREADS); yp, gp, dp, n, lg)?;
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &Tensor, w: Option<&Tensor>, eps: f32) -> Result<(Tensor, Tensor)> {
        const OP: &str = "rms_norm";
        let suf = float_suffix(x.dtype(), OP)?;
        let gpu = gpu_of(x, OP)?;
        let x = contiguous_as(x, x.dtype(), OP)?;
        let d = *x.shape().last().unwrap_or(&1);
        let rows = x.numel() / d.max(1);
        let (_w, wp) = weight_f32(w, OP)?;
        let out = empty(&gpu, x.dtype(), x.shape())?;
        let rstd = empty(&gpu, DType::F32, &[rows])?;
        if rows * d > 0 {
            check_rows(rows, OP)?;
            let (xp, yp, rp, d) = (ptr(&x, OP)?, ptr(&out, OP)?, ptr(&rstd, OP)?, d as i64);
            launch!(gpu, "norm", format!("rms_norm_{suf}"), per_row(rows, ROW_THREADS); xp, wp, yp, rp, d, eps)?;
        }
        Ok((out, rstd))
    }

    fn rms_norm_backward(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        rstd: &Tensor,
        g: &Tensor,
        need_w: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        const OP: &str = "rms_norm_backward";
        let suf = float_suffix(x.dtype(), OP)?;
        let gpu = gpu_of(x, OP)?;
        let x = contiguous_as(x, x.dtype(), OP)?;
        let g = contiguous_as(g, x.dtype(), OP)?;
        let rstd = contiguous_as(rstd, DType::F32, OP)?;
        let d = *x.shape().last().unwrap_or(&1);
        let rows = x.numel() / d.max(1);
        let (_w, wp) = weight_f32(w, OP)?;
        let dx = empty(&gpu, x.dtype(), x.shape())?;
        if rows * d == 0 {
            let dw = match (need_w, w) {
                (true, Some(w)) => Some(zeros(&gpu, w.dtype(), &[d])?),
                _ => None,
            };
            return Ok((dx, dw));
        }
        check_rows(rows, OP)?;
        let (xp, rp, gp, dp) = (ptr(&x, OP)?, ptr(&rstd, OP)?, ptr(&g, OP)?, ptr(&dx, OP)?);
        let d64 = d as i64;
        launch!(gpu, "norm", format!("rms_norm_backward_{suf}"), per_row(rows, ROW_THREADS); xp, wp, rp, gp, dp, d64)?;
        let dw = match (need_w, w) {
            (true, Some(w)) => {
                // Two fixed-order stages: chunks of rows, then the chunks (reduce over dim 0).
                let chunks = rows.div_ceil(DW_CHUNK);
                let part = empty(&gpu, DType::F32, &[chunks, d])?;
                let pp = ptr(&part, OP)?;
                let (rows64, chunk) = (rows as i64, DW_CHUNK as i64);
                let cfg = LaunchConfig {
                    grid_dim: (d.div_ceil(256) as u32, chunks as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                launch!(gpu, "norm", format!("rms_norm_dw_partial_{suf}"), cfg; xp, rp, gp, pp, rows64, d64, chunk)?;
                let dw =
                    crate::backend::Backend::reduce(self, crate::ops::ReduceOp::Sum, &part, 0)?
                        .reshape(&[d])?;
                Some(if w.dtype() == DType::F32 {
                    dw
                } else {
                    copy_cast(&dw, w.dtype(), OP)?
                })
            }
            _ => None,
        };
        Ok((dx, dw))
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        b: Option<&Tensor>,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "layer_norm";
        let suf = float_suffix(x.dtype(), OP)?;
        let gpu = gpu_of(x, OP)?;
        let x = contiguous_as(x, x.dtype(), OP)?;
        let d = *x.shape().last().unwrap_or(&1);
        let rows = x.numel() / d.max(1);
        let ((_w, wp), (_b, bp)) = (weight_f32(w, OP)?, weight_f32(b, OP)?);
        let out = empty(&gpu, x.dtype(), x.shape())?;
        let mean = empty(&gpu, DType::F32, &[rows])?;
        let rstd = empty(&gpu, DType::F32, &[rows])?;
        if rows * d > 0 {
            check_rows(rows, OP)?;
            let (xp, yp, mp, rp) = (
                ptr(&x, OP)?,
                ptr(&out, OP)?,
                ptr(&mean, OP)?,
                ptr(&rstd, OP)?,
            );
            let d = d as i64;
            launch!(gpu, "norm", format!("layer_norm_{suf}"), per_row(rows, ROW_THREADS); xp, wp, bp, yp, mp, rp, d, eps)?;
        }
        Ok((out, mean, rstd))
    }

    fn layer_norm_backward(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        g: &Tensor,
        need: (bool, bool),
    ) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        const OP: &str = "layer_norm_backward";
        let suf = float_suffix(x.dtype(), OP)?;
        let gpu = gpu_of(x, OP)?;
        let g_dtype = g.dtype();
        let x = contiguous_as(x, x.dtype(), OP)?;
        let g = contiguous_as(g, x.dtype(), OP)?;
        let (mean, rstd) = (
            contiguous_as(mean, DType::F32, OP)?,
            contiguous_as(rstd, DType::F32, OP)?,
        );
        let d = *x.shape().last().unwrap_or(&1);
        let rows = x.numel() / d.max(1);
        let (_w, wp) = weight_f32(w, OP)?;
        let need_w = need.0 && w.is_some();
        let dx = empty(&gpu, x.dtype(), x.shape())?;
        // The weight and bias gradients come back in the weight's and the gradient's float dtype,
        // as on the CPU.
        let back = |t: Tensor, dtype: DType| -> Result<Tensor> {
            let dtype = if dtype.is_float() { dtype } else { DType::F32 };
            if dtype == DType::F32 {
                Ok(t)
            } else {
                copy_cast(&t, dtype, OP)
            }
        };
        if rows * d == 0 {
            let dw = match (need_w, w) {
                (true, Some(w)) => Some(back(zeros(&gpu, DType::F32, &[d])?, w.dtype())?),
                _ => None,
            };
            let db = if need.1 {
                Some(back(zeros(&gpu, DType::F32, &[d])?, g_dtype)?)
            } else {
                None
            };
            return Ok((dx, dw, db));
        }
        check_rows(rows, OP)?;
        let (xp, mp, rp, gp, dp) = (
            ptr(&x, OP)?,
            ptr(&mean, OP)?,
            ptr(&rstd, OP)?,
            ptr(&g, OP)?,
            ptr(&dx, OP)?,
        );
        let d64 = d as i64;
        launch!(gpu, "norm", format!("layer_norm_backward_{suf}"), per_row(rows, ROW_THREADS); xp, wp, mp, rp, gp, dp, d64)?;
        if !need_w && !need.1 {
            return Ok((dx, None, None));
        }
        // Two fixed-order stages, as for RMSNorm: chunks of rows, then the chunks.
        let chunks = rows.div_ceil(DW_CHUNK);
        let part_w = if need_w {
            Some(empty(&gpu, DType::F32, &[chunks, d])?)
        } else {
            None
        };
        let part_b = if need.1 {
            Some(empty(&gpu, DType::F32, &[chunks, d])?)
        } else {
            None
        };
        let pw = part_w
            .as_ref()
            .map(|t| ptr(t, OP))
            .transpose()?
            .unwrap_or(0);
        let pb = part_b
            .as_ref()
            .map(|t| ptr(t, OP))
            .transpose()?
            .unwrap_or(0);
        let (rows64, chunk) = (rows as i64, DW_CHUNK as i64);
        let cfg = LaunchConfig {
            grid_dim: (d.div_ceil(256) as u32, chunks as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(gpu, "norm", format!("layer_norm_dwb_partial_{suf}"), cfg; xp, mp, rp, gp, pw, pb, rows64, d64, chunk)?;
        let sum = |part: Option<Tensor>, dtype: DType| -> Result<Option<Tensor>> {
            part.map(|p| {
                let s = crate::backend::Backend::reduce(self, crate::ops::ReduceOp::Sum, &p, 0)?
                    .reshape(&[d])?;
                back(s, dtype)
            })
            .transpose()
        };
        let dw = sum(part_w, w.map_or(DType::F32, |w| w.dtype()))?;
        let db = sum(part_b, g_dtype)?;
        Ok((dx, dw, db))
    }

    fn rope(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        spec: RopeSpec,
        inverse: bool,
    ) -> Result<Tensor> {
        const OP: &str = "rope";
        let suf = float_suffix(x.dtype(), OP)?;
        let gpu = gpu_of(x, OP)?;
        let x = contiguous_as(x, x.dtype(), OP)?;
        let (cs, sn) = (
            contiguous_as(cos, DType::F32, OP)?,
            contiguous_as(sin, DType::F32, OP)?,
        );
        let s = x.shape().to_vec();
        let (heads, t_len) = match spec.layout {
            RopeLayout::Bhtd => (s[1], s[2]),
            RopeLayout::Bthd => (s[2], s[1]),
        };
        let d = s[3];
        if d % 2 == 1 {
            return Err(not_yet("rope with an odd head dim"));
        }
        let r = *cs.shape().last().unwrap_or(&0);
        let out = empty(&gpu, x.dtype(), &s)?;
        let rows = x.numel() / d.max(1);
        if rows * d > 0 {
            let (xp, yp, cp, sp) = (ptr(&x, OP)?, ptr(&out, OP)?, ptr(&cs, OP)?, ptr(&sn, OP)?);
            let (rows64, h, t, d64, r64) =
                (rows as i64, heads as i64, t_len as i64, d as i64, r as i64);
            let layout = (spec.layout == RopeLayout::Bthd) as i32;
            let batched = (cs.rank() == 3) as i32;
            let inter = (spec.style == RopeStyle::Interleaved) as i32;
            let sign = if inverse { -1.0f32 } else { 1.0 };
            launch!(gpu, "rope", format!("rope_{suf}"), grid(rows * d / 2);
                xp, yp, cp, sp, rows64, h, t, d64, r64, layout, batched, inter, sign)?;
        }
        Ok(out)
    }

    fn embedding(&self, weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
        const OP: &str = "embedding";
        let suf = float_suffix(weight.dtype(), OP)?;
        let gpu = gpu_of(weight, OP)?;
        let w = contiguous_as(weight, weight.dtype(), OP)?;
        let ids = contiguous_as(ids, DType::I64, OP)?;
        let d = w.shape()[1];
        let mut shape = ids.shape().to_vec();
        shape.push(d);
        let out = empty(&gpu, w.dtype(), &shape)?;
        let n = ids.numel();
        if n * d > 0 {
            let (wp, ip, op_, n64, d64) = (
                ptr(&w, OP)?,
                ptr(&ids, OP)?,
                ptr(&out, OP)?,
                n as i64,
                d as i64,
            );
            launch!(gpu, "embedding", format!("embedding_{suf}"), grid(n * d); wp, ip, op_, n64, d64)?;
        }
        Ok(out)
    }

    fn embedding_backward(
        &self,
        ids: &Tensor,
        g: &Tensor,
        vocab: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        const OP: &str = "embedding_backward";
        let suf = float_suffix(g.dtype(), OP)?;
        let gpu = gpu_of(g, OP)?;
        let g = contiguous_as(g, g.dtype(), OP)?;
        let d = *g.shape().last().unwrap_or(&0);
        let dw = zeros(&gpu, DType::F32, &[vocab, d])?;
        // Group positions by token on the host (a stable sort keeps position order within a
        // token), so the kernel sums each token's rows in a fixed order without atomics.
        let ids_host: Vec<i64> = ids.to_vec();
        let mut order: Vec<i64> = (0..ids_host.len() as i64).collect();
        order.sort_by_key(|&i| ids_host[i as usize]);
        let (mut tokens, mut starts) = (Vec::new(), Vec::new());
        for (k, &i) in order.iter().enumerate() {
            let t = ids_host[i as usize];
            if tokens.last() != Some(&t) {
                tokens.push(t);
                starts.push(k as i64);
            }
        }
        starts.push(order.len() as i64);
        if !tokens.is_empty() && d > 0 {
            let order_d = upload(&gpu, &order, &[order.len()])?;
            let starts_d = upload(&gpu, &starts, &[starts.len()])?;
            let tokens_d = upload(&gpu, &tokens, &[tokens.len()])?;
            let (gp, op_, sp, tp, wp, d64) = (
                ptr(&g, OP)?,
                ptr(&order_d, OP)?,
                ptr(&starts_d, OP)?,
                ptr(&tokens_d, OP)?,
                ptr(&dw, OP)?,
                d as i64,
            );
            let cfg = LaunchConfig {
                // Tokens on x (up to 2³¹ − 1 blocks), column blocks on y (at most 65535).
                grid_dim: (tokens.len() as u32, d.div_ceil(256) as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(gpu, "embedding", format!("embedding_backward_{suf}"), cfg; gp, op_, sp, tp, wp, d64)?;
        }
        if dtype == DType::F32 {
            Ok(dw)
        } else {
            copy_cast(&dw, dtype, OP)
        }
    }

    fn cross_entropy(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        ignore_index: Option<i64>,
        label_smoothing: f32,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "cross_entropy";
        let suf = float_suffix(logits.dtype(), OP)?;
        let gpu = gpu_of(logits, OP)?;
        let (n, v) = (logits.shape()[0], logits.shape()[1]);
        check_targets(targets, v, ignore_index)?;
        let x = contiguous_as(logits, logits.dtype(), OP)?;
        let t = contiguous_as(targets, DType::I64, OP)?;
        let loss = zeros(&gpu, DType::F32, &[n])?;
        let lse = zeros(&gpu, DType::F32, &[n])?;
        if n * v > 0 {
            check_rows(n, OP)?;
            let (xp, tp, lp, sp) = (ptr(&x, OP)?, ptr(&t, OP)?, ptr(&loss, OP)?, ptr(&lse, OP)?);
            let (v64, has, ign) = (
                v as i64,
                ignore_index.is_some() as i32,
                ignore_index.unwrap_or(0),
            );
            launch!(gpu, "loss", format!("cross_entropy_{suf}"), per_row(n, ROW_THREADS);
                xp, tp, lp, sp, v64, has, ign, label_smoothing)?;
        }
        Ok((loss, lse))
    }

    fn cross_entropy_backward(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        lse: &Tensor,
        row_scale: &Tensor,
        ignore_index: Option<i64>,
        label_smoothing: f32,
    ) -> Result<Tensor> {
        const OP: &str = "cross_entropy_backward";
        let suf = float_suffix(logits.dtype(), OP)?;
        let gpu = gpu_of(logits, OP)?;
        let (n, v) = (logits.shape()[0], logits.shape()[1]);
        check_targets(targets, v, ignore_index)?;
        let x = contiguous_as(logits, logits.dtype(), OP)?;
        let t = contiguous_as(targets, DType::I64, OP)?;
        let lse = contiguous_as(lse, DType::F32, OP)?;
        let sc = contiguous_as(row_scale, DType::F32, OP)?;
        let dx = empty(&gpu, x.dtype(), x.shape())?;
        if n * v > 0 {
            check_rows(n, OP)?;
            let (xp, tp, lp, sp, dp) = (
                ptr(&x, OP)?,
                ptr(&t, OP)?,
                ptr(&lse, OP)?,
                ptr(&sc, OP)?,
                ptr(&dx, OP)?,
            );
            let (v64, has, ign) = (
                v as i64,
                ignore_index.is_some() as i32,
                ignore_index.unwrap_or(0),
            );
            launch!(gpu, "loss", format!("cross_entropy_backward_{suf}"), per_row(n, ROW_THREADS);
                xp, tp, lp, sp, dp, v64, has, ign, label_smoothing)?;
        }
        Ok(dx)
    }
}

/// Targets must index the vocabulary (or be the ignored index): checked on the host, as the
/// CPU backend does, so a bad target is an error rather than an out-of-bounds read.
fn check_targets(targets: &Tensor, vocab: usize, ignore_index: Option<i64>) -> Result<()> {
    // Targets the device computed are not read back (the kernel flags a bad one with a NaN).
    if !targets.host_resident() {
        return Ok(());
    }
    for t in targets.to_vec::<i64>() {
        if Some(t) != ignore_index && (t < 0 || t as u64 >= vocab as u64) {
            return Err(Error::IndexOutOfRange {
                op: "cross_entropy",
                index: t,
                size: vocab,
            });
        }
    }
    Ok(())
}

impl FusionBackend for CudaBackend {
    fn swiglu(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        const OP: &str = "swiglu";
        let dtype = if gate.dtype() == up.dtype() {
            gate.dtype()
        } else {
            DType::F32
        };
        let suf = float_suffix(dtype, OP)?;
        let gpu = gpu_of(gate, OP)?;
        let (g, u) = (
            contiguous_as(gate, dtype, OP)?,
            contiguous_as(up, dtype, OP)?,
        );
        let out = empty(&gpu, dtype, g.shape())?;
        let n = g.numel();
        if n > 0 {
            let (gp, up_, op_, n64) = (ptr(&g, OP)?, ptr(&u, OP)?, ptr(&out, OP)?, n as i64);
            launch!(gpu, "elementwise", format!("swiglu_{suf}"), grid(n); gp, up_, op_, n64)?;
        }
        Ok(out)
    }

    fn swiglu_backward(
        &self,
        gate: &Tensor,
        up: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "swiglu_backward";
        let dtype = if gate.dtype() == up.dtype() && up.dtype() == grad.dtype() {
            gate.dtype()
        } else {
            DType::F32
        };
        let suf = float_suffix(dtype, OP)?;
        let gpu = gpu_of(gate, OP)?;
        let (g, u, d) = (
            contiguous_as(gate, dtype, OP)?,
            contiguous_as(up, dtype, OP)?,
            contiguous_as(grad, dtype, OP)?,
        );
        let (dg, du) = (
            empty(&gpu, dtype, g.shape())?,
            empty(&gpu, dtype, g.shape())?,
        );
        let n = g.numel();
        if n > 0 {
            let (gp, upp, dp, dgp, dup, n64) = (
                ptr(&g, OP)?,
                ptr(&u, OP)?,
                ptr(&d, OP)?,
                ptr(&dg, OP)?,
                ptr(&du, OP)?,
                n as i64,
            );
            launch!(gpu, "elementwise", format!("swiglu_backward_{suf}"), grid(n); gp, upp, dp, dgp, dup, n64)?;
        }
        Ok((dg, du))
    }
}

/// One tensor of the fused AdamW launch (the `AdamWTensor` struct of kernels/adamw.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AdamWDesc {
    p: u64,
    g: u64,
    m: u64,
    v: u64,
    n: i64,
}

/// The `AdamWConsts` struct of kernels/adamw.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AdamWConstsC([f32; 9]);

// SAFETY: plain old data in the C layout the kernel declares.
unsafe impl DeviceRepr for AdamWConstsC {}

/// Elements each AdamW block updates.
const ADAMW_CHUNK: usize = 16 * 1024;

impl OptimBackend for CudaBackend {
    fn adamw(&self, groups: &[AdamWTensors<'_>], hp: &AdamW) -> Result<()> {
        const OP: &str = "adamw";
        let Some(first) = groups.first() else {
            return Ok(());
        };
        let gpu = gpu_of(first.param, OP)?;
        let mut descs = Vec::with_capacity(groups.len());
        let (mut block_tensor, mut block_start) = (Vec::<i32>::new(), Vec::<i64>::new());
        // Gradients may be strided views: contiguous copies live until the launch is queued
        // (the stream-ordered pool keeps their memory from later work until it has run).
        let mut keep = Vec::new();
        for (i, g) in groups.iter().enumerate() {
            let grad = contiguous_as(g.grad, DType::F32, OP)?;
            let n = g.param.numel();
            descs.push(AdamWDesc {
                p: ptr(g.param, OP)?,
                g: ptr(&grad, OP)?,
                m: ptr(g.exp_avg, OP)?,
                v: ptr(g.exp_avg_sq, OP)?,
                n: n as i64,
            });
            keep.push(grad);
            for start in (0..n).step_by(ADAMW_CHUNK) {
                block_tensor.push(i as i32);
                block_start.push(start as i64);
            }
        }
        if block_tensor.is_empty() {
            return Ok(());
        }
        let raw: Vec<i64> = descs
            .iter()
            .flat_map(|d| [d.p as i64, d.g as i64, d.m as i64, d.v as i64, d.n])
            .collect();
        let descs_d = upload(&gpu, &raw, &[raw.len()])?;
        let bt = upload(&gpu, &block_tensor, &[block_tensor.len()])?;
        let bs = upload(&gpu, &block_start, &[block_start.len()])?;
        let c = hp.consts();
        let consts = AdamWConstsC([
            c.b1,
            c.one_minus_b1,
            c.b2,
            c.one_minus_b2,
            c.inv_bc1,
            c.inv_bc2,
            c.eps,
            c.lr,
            c.decay,
        ]);
        let (dp, btp, bsp, chunk) = (
            ptr(&descs_d, OP)?,
            ptr(&bt, OP)?,
            ptr(&bs, OP)?,
            ADAMW_CHUNK as i64,
        );
        launch!(gpu, "adamw", "adamw_multi", per_row(block_tensor.len(), ROW_THREADS); dp, btp, bsp, chunk, consts)?;
        drop(keep);
        Ok(())
    }

    fn sum_of_squares(&self, tensors: &[&Tensor]) -> Result<Tensor> {
        const OP: &str = "sum_of_squares";
        let Some(first) = tensors.first() else {
            return Err(Error::Invalid {
                op: OP,
                msg: "no tensors".into(),
            });
        };
        let gpu = gpu_of(first, OP)?;
        let out = zeros(&gpu, DType::F32, &[tensors.len()])?;
        let (mut raw, mut block_tensor, mut block_start) = (Vec::new(), Vec::new(), Vec::new());
        let mut first_block = Vec::with_capacity(tensors.len() + 1);
        // f32 contiguous copies where needed, alive until the launches are queued.
        let mut keep = Vec::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            let x = contiguous_as(t, DType::F32, OP)?;
            let n = x.numel();
            raw.extend([ptr(&x, OP)? as i64, n as i64]);
            first_block.push(block_tensor.len() as i64);
            for start in (0..n).step_by(ADAMW_CHUNK) {
                block_tensor.push(i as i32);
                block_start.push(start as i64);
            }
            keep.push(x);
        }
        first_block.push(block_tensor.len() as i64);
        if block_tensor.is_empty() {
            return Ok(out);
        }
        let partial = empty(&gpu, DType::F32, &[block_tensor.len()])?;
        let descs = upload(&gpu, &raw, &[raw.len()])?;
        let bt = upload(&gpu, &block_tensor, &[block_tensor.len()])?;
        let bs = upload(&gpu, &block_start, &[block_start.len()])?;
        let fb = upload(&gpu, &first_block, &[first_block.len()])?;
        let (dp, btp, bsp, pp, chunk) = (
            ptr(&descs, OP)?,
            ptr(&bt, OP)?,
            ptr(&bs, OP)?,
            ptr(&partial, OP)?,
            ADAMW_CHUNK as i64,
        );
        launch!(gpu, "adamw", "sum_squares_multi", per_row(block_tensor.len(), ROW_THREADS); dp, btp, bsp, chunk, pp)?;
        let (fbp, op, n) = (ptr(&fb, OP)?, ptr(&out, OP)?, tensors.len() as i64);
        launch!(gpu, "adamw", "sum_squares_finish", grid(tensors.len()); pp, fbp, n, op)?;
        drop(keep);
        Ok(out)
    }
}
