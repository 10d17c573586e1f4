//! RMSNorm and LayerNorm over the last dim: fused forward (statistics + scale in one kernel) and
//! fused backward (input gradient and weight/bias partial sums in one pass).
//!
//! Weight and bias gradients are reduced deterministically: each fixed block of rows (its size
//! depends on `d` only) yields a partial sum, and the partials are added in block order.

use super::rowwise::{row_dot, row_sq_dev, row_sum, rows_per_task, sum_partials};
use super::simd::simd_kernel;
use super::{finish, float_out};
use crate::error::Result;
use crate::storage::Storage;
use crate::{DType, Tensor};
use rayon::prelude::*;

/// Rows per weight-gradient partial sum: at least 32 so partials stay small next to `x`.
fn grad_block_rows(d: usize) -> usize {
    rows_per_task(d).max(32)
}

simd_kernel! {
    /// `y = (x - mean) * rstd * w + b`, with `w`/`b` empty meaning 1/0.
    fn normalize_row(x: &[f32], y: &mut [f32], mean: f32, rstd: f32, w: &[f32], b: &[f32]) {
        match (w.is_empty(), b.is_empty()) {
            (true, true) => y.iter_mut().zip(x).for_each(|(y, &x)| *y = (x - mean) * rstd),
            (false, true) => y
                .iter_mut()
                .zip(x)
                .zip(w)
                .for_each(|((y, &x), &w)| *y = (x - mean) * rstd * w),
            (true, false) => y
                .iter_mut()
                .zip(x)
                .zip(b)
                .for_each(|((y, &x), &b)| *y = (x - mean) * rstd + b),
            (false, false) => y
                .iter_mut()
                .zip(x)
                .zip(w.iter().zip(b))
                .for_each(|((y, &x), (&w, &b))| *y = (x - mean) * rstd * w + b),
        }
    }
}

simd_kernel! {
    /// One row of the norm backward. `xhat` and `gh` are scratch; `centered` selects LayerNorm.
    /// Accumulates `g * xhat` into `gw` and `g` into `gb` when those are non-empty.
    fn norm_grad_row(
        x: &[f32], g: &[f32], w: &[f32], mean: f32, rstd: f32, centered: bool,
        gx: &mut [f32], xhat: &mut [f32], gh: &mut [f32], gw: &mut [f32], gb: &mut [f32]
    ) {
        let d = x.len() as f32;
        xhat.iter_mut().zip(x).for_each(|(h, &x)| *h = (x - mean) * rstd);
        if w.is_empty() {
            gh.copy_from_slice(g);
        } else {
            gh.iter_mut().zip(g).zip(w).for_each(|((h, &g), &w)| *h = g * w);
        }
        let c2 = row_dot(gh, xhat) / d;
        let c1 = if centered { row_sum(gh) / d } else { 0.0 };
        for ((o, &h), &xh) in gx.iter_mut().zip(gh.iter()).zip(xhat.iter()) {
            *o = rstd * (h - c1 - xh * c2);
        }
        if !gw.is_empty() {
            gw.iter_mut().zip(g).zip(xhat.iter()).for_each(|((a, &g), &xh)| *a += g * xh);
        }
        if !gb.is_empty() {
            gb.iter_mut().zip(g).for_each(|(a, &g)| *a += g);
        }
    }
}

/// Shared forward: `centered` selects LayerNorm (mean subtracted) over RMSNorm.
fn norm_forward(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    eps: f32,
    centered: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let shape = x.shape();
    let d = *shape.last().unwrap_or(&1);
    let rows = x.numel() / d.max(1);
    let xs = x.contig::<f32>();
    let ws = w.map(|w| w.contig::<f32>());
    let bs = b.map(|b| b.contig::<f32>());
    let (wv, bv): (&[f32], &[f32]) = (ws.as_deref().unwrap_or(&[]), bs.as_deref().unwrap_or(&[]));
    let mut out = Storage::any(DType::F32, xs.len());
    let mut means = vec![0f32; rows];
    let mut rstds = vec![0f32; rows];
    if d > 0 {
        let per = rows_per_task(d);
        out.as_mut_slice::<f32>()
            .par_chunks_mut(per * d)
            .zip(xs.par_chunks(per * d))
            .zip(means.par_chunks_mut(per).zip(rstds.par_chunks_mut(per)))
            .for_each(|((yc, xc), (mc, rc))| {
                for (((yr, xr), m), r) in yc
                    .chunks_exact_mut(d)
                    .zip(xc.chunks_exact(d))
                    .zip(mc.iter_mut())
                    .zip(rc.iter_mut())
                {
                    let mean = if centered {
                        row_sum(xr) / d as f32
                    } else {
                        0.0
                    };
                    let var = row_sq_dev(xr, mean) / d as f32;
                    let rstd = 1.0 / (var + eps).sqrt();
                    normalize_row(xr, yr, mean, rstd, wv, bv);
                    (*m, *r) = (mean, rstd);
                }
            });
    }
    drop((xs, ws, bs));
    Ok((
        finish(out, shape, float_out(x.dtype()))?,
        Tensor::from_vec(means, &[rows])?,
        Tensor::from_vec(rstds, &[rows])?,
    ))
}

/// Shared backward: `(dx, dw, db)`.
#[allow(clippy::too_many_arguments)]
fn norm_backward(
    x: &Tensor,
    w: Option<&Tensor>,
    mean: Option<&Tensor>,
    rstd: &Tensor,
    g: &Tensor,
    need_w: bool,
    need_b: bool,
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    let shape = x.shape();
    let d = *shape.last().unwrap_or(&1);
    let rows = x.numel() / d.max(1);
    let xs = x.contig::<f32>();
    let gs = g.contig::<f32>();
    let ws = w.map(|w| w.contig::<f32>());
    let wv: &[f32] = ws.as_deref().unwrap_or(&[]);
    let ms = mean.map(|m| m.contig::<f32>());
    let rs = rstd.contig::<f32>();
    let need_w = need_w && w.is_some();
    let mut out = Storage::any(DType::F32, xs.len());
    let per = grad_block_rows(d);
    let mut partials: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
    if d > 0 && rows > 0 {
        partials = out
            .as_mut_slice::<f32>()
            .par_chunks_mut(per * d)
            .zip(xs.par_chunks(per * d).zip(gs.par_chunks(per * d)))
            .enumerate()
            .map(|(blk, (oc, (xc, gc)))| {
                let mut gw = vec![0f32; if need_w { d } else { 0 }];
                let mut gb = vec![0f32; if need_b { d } else { 0 }];
                let (mut xhat, mut gh) = (vec![0f32; d], vec![0f32; d]);
                for (i, ((or, xr), gr)) in oc
                    .chunks_exact_mut(d)
                    .zip(xc.chunks_exact(d))
                    .zip(gc.chunks_exact(d))
                    .enumerate()
                {
                    let row = blk * per + i;
                    let m = ms.as_deref().map_or(0.0, |m| m[row]);
                    norm_grad_row(
                        xr,
                        gr,
                        wv,
                        m,
                        rs[row],
                        ms.is_some(),
                        or,
                        &mut xhat,
                        &mut gh,
                        &mut gw,
                        &mut gb,
                    );
                }
                (gw, gb)
            })
            .collect();
    }
    drop((xs, gs, ws, ms, rs));
    let dx = finish(out, shape, float_out(x.dtype()))?;
    let (gw_parts, gb_parts): (Vec<Vec<f32>>, Vec<Vec<f32>>) = partials.into_iter().unzip();
    let reduce = |parts: &[Vec<f32>], dtype: DType| -> Result<Tensor> {
        Tensor::from_vec(sum_partials(parts, d), &[d])?.to_dtype(float_out(dtype))
    };
    let dw = match (need_w, w) {
        (true, Some(w)) => Some(reduce(&gw_parts, w.dtype())?),
        _ => None,
    };
    let db = if need_b {
        Some(reduce(&gb_parts, g.dtype())?)
    } else {
        None
    };
    Ok((dx, dw, db))
}

pub(crate) fn rms_norm(x: &Tensor, w: Option<&Tensor>, eps: f32) -> Result<(Tensor, Tensor)> {
    let (y, _, rstd) = norm_forward(x, w, None, eps, false)?;
    Ok((y, rstd))
}

pub(crate) fn rms_norm_backward(
    x: &Tensor,
    w: Option<&Tensor>,
    rstd: &Tensor,
    g: &Tensor,
    need_w: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let (dx, dw, _) = norm_backward(x, w, None, rstd, g, need_w, false)?;
    Ok((dx, dw))
}

pub(crate) fn layer_norm(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    eps: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    norm_forward(x, w, b, eps, true)
}

pub(crate) fn layer_norm_backward(
    x: &Tensor,
    w: Option<&Tensor>,
    mean: &Tensor,
    rstd: &Tensor,
    g: &Tensor,
    need: (bool, bool),
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    norm_backward(x, w, Some(mean), rstd, g, need.0, need.1)
}
