//! Softmax and log-softmax over one dim, forward and backward, each a single fused kernel.
//!
//! The last dim runs row by row (max, exp-and-sum, scale); any other dim runs on `[n, inner]`
//! blocks vectorized along `inner`. Rows never straddle tasks, so results do not depend on the
//! thread count.

use super::rowwise::{row_dot, row_max, row_sum, rows_per_task};
use super::simd::{self, simd_kernel};
use super::{finish, float_out};
use crate::error::Result;
use crate::storage::Storage;
use crate::{DType, Tensor};
use rayon::prelude::*;

simd_kernel! {
    /// `y = exp(x - m)`, returning Σ y (16 interleaved partial sums).
    fn exp_shift_sum(x: &[f32], m: f32, y: &mut [f32]) -> f32 {
        let mut acc = [0f32; 16];
        let mut cx = x.chunks_exact(16);
        let mut cy = y.chunks_exact_mut(16);
        for (xs, ys) in (&mut cx).zip(&mut cy) {
            for i in 0..16 {
                let e = simd::exp(xs[i] - m);
                ys[i] = e;
                acc[i] += e;
            }
        }
        let mut w = 16;
        while w > 1 {
            w /= 2;
            for i in 0..w {
                acc[i] += acc[i + w];
            }
        }
        let mut s = acc[0];
        for (&xv, yv) in cx.remainder().iter().zip(cy.into_remainder()) {
            let e = simd::exp(xv - m);
            *yv = e;
            s += e;
        }
        s
    }
}

simd_kernel! {
    fn finish_row(x: &[f32], y: &mut [f32], m: f32, s: f32, log: bool) {
        if log {
            let c = m + s.ln();
            y.iter_mut().zip(x).for_each(|(y, &x)| *y = x - c);
        } else {
            let r = 1.0 / s;
            y.iter_mut().for_each(|y| *y *= r);
        }
    }
}

simd_kernel! {
    fn grad_row(y: &[f32], g: &[f32], out: &mut [f32], log: bool) {
        if log {
            let sg = row_sum(g);
            for ((o, &y), &g) in out.iter_mut().zip(y).zip(g) {
                *o = g - simd::exp(y) * sg;
            }
        } else {
            let dot = row_dot(g, y);
            for ((o, &y), &g) in out.iter_mut().zip(y).zip(g) {
                *o = y * (g - dot);
            }
        }
    }
}

simd_kernel! {
    /// Softmax down columns: `x[r]`, `y[r]` are row `r`'s slices of one column strip of
    /// width `w`; `m`, `s` are `w`-long scratch.
    fn softmax_cols(x: &[&[f32]], y: &mut [&mut [f32]], log: bool, m: &mut [f32], s: &mut [f32]) {
        m.copy_from_slice(x[0]);
        for row in &x[1..] {
            m.iter_mut().zip(row.iter()).for_each(|(m, &v)| *m = m.max(v));
        }
        s.fill(0.0);
        for (xr, yr) in x.iter().zip(y.iter_mut()) {
            for (((y, &x), &m), s) in yr.iter_mut().zip(xr.iter()).zip(m.iter()).zip(s.iter_mut()) {
                let e = simd::exp(x - m);
                *y = e;
                *s += e;
            }
        }
        if log {
            m.iter_mut().zip(s.iter()).for_each(|(m, &s)| *m += s.ln());
            for (xr, yr) in x.iter().zip(y.iter_mut()) {
                for ((y, &x), &c) in yr.iter_mut().zip(xr.iter()).zip(m.iter()) {
                    *y = x - c;
                }
            }
        } else {
            s.iter_mut().for_each(|s| *s = 1.0 / *s);
            for yr in y.iter_mut() {
                yr.iter_mut().zip(s.iter()).for_each(|(y, &r)| *y *= r);
            }
        }
    }
}

simd_kernel! {
    /// Softmax gradient down columns (row slices of one strip, as in `softmax_cols`).
    fn grad_cols(y: &[&[f32]], g: &[&[f32]], out: &mut [&mut [f32]], log: bool, acc: &mut [f32]) {
        acc.fill(0.0);
        for (yr, gr) in y.iter().zip(g.iter()) {
            for ((a, &y), &g) in acc.iter_mut().zip(yr.iter()).zip(gr.iter()) {
                *a += if log { g } else { g * y };
            }
        }
        for ((yr, gr), or) in y.iter().zip(g.iter()).zip(out.iter_mut()) {
            for (((o, &y), &g), &a) in or.iter_mut().zip(yr.iter()).zip(gr.iter()).zip(acc.iter()) {
                *o = if log { g - simd::exp(y) * a } else { y * (g - a) };
            }
        }
    }
}

/// Column-strip width for softmax over a non-last dim: strips are independent tasks, so a
/// single `[n, inner]` block (small outer) still spreads over threads.
const STRIP: usize = 256;

/// Row slices of every column strip of a row-major `[n, inner]` block: `strips[c][r]`.
fn strips(block: &[f32], inner: usize) -> Vec<Vec<&[f32]>> {
    let mut out: Vec<Vec<&[f32]>> = (0..inner.div_ceil(STRIP)).map(|_| Vec::new()).collect();
    for row in block.chunks_exact(inner) {
        for (c, piece) in row.chunks(STRIP).enumerate() {
            out[c].push(piece);
        }
    }
    out
}

/// Mutable version of [`strips`].
fn strips_mut(block: &mut [f32], inner: usize) -> Vec<Vec<&mut [f32]>> {
    let mut out: Vec<Vec<&mut [f32]>> = (0..inner.div_ceil(STRIP)).map(|_| Vec::new()).collect();
    for row in block.chunks_exact_mut(inner) {
        for (c, piece) in row.chunks_mut(STRIP).enumerate() {
            out[c].push(piece);
        }
    }
    out
}

/// `(outer, n, inner)` of a shape split at `dim`.
fn split(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

pub(crate) fn softmax(x: &Tensor, dim: usize, log: bool) -> Result<Tensor> {
    let (_, n, inner) = split(x.shape(), dim);
    let src = x.contig::<f32>();
    let mut out = Storage::any(DType::F32, src.len());
    let y = out.as_mut_slice::<f32>();
    if n > 0 && inner == 1 {
        let rows = rows_per_task(n);
        y.par_chunks_mut(rows * n)
            .zip(src.par_chunks(rows * n))
            .for_each(|(yc, xc)| {
                for (yr, xr) in yc.chunks_exact_mut(n).zip(xc.chunks_exact(n)) {
                    let m = row_max(xr);
                    let s = exp_shift_sum(xr, m, yr);
                    finish_row(xr, yr, m, s, log);
                }
            });
    } else if n > 0 && inner > 0 {
        y.par_chunks_mut(n * inner)
            .zip(src.par_chunks(n * inner))
            .for_each(|(yb, xb)| {
                strips_mut(yb, inner)
                    .into_par_iter()
                    .zip(strips(xb, inner))
                    .for_each(|(mut ys, xs)| {
                        let w = xs[0].len();
                        let (mut m, mut s) = (vec![0f32; w], vec![0f32; w]);
                        softmax_cols(&xs, &mut ys, log, &mut m, &mut s);
                    });
            });
    }
    drop(src);
    finish(out, x.shape(), float_out(x.dtype()))
}

pub(crate) fn softmax_backward(y: &Tensor, g: &Tensor, dim: usize, log: bool) -> Result<Tensor> {
    let (_, n, inner) = split(y.shape(), dim);
    let ys = y.contig::<f32>();
    let gs = g.contig::<f32>();
    let mut out = Storage::any(DType::F32, ys.len());
    let o = out.as_mut_slice::<f32>();
    if n > 0 && inner == 1 {
        let rows = rows_per_task(n);
        o.par_chunks_mut(rows * n)
            .zip(ys.par_chunks(rows * n).zip(gs.par_chunks(rows * n)))
            .for_each(|(oc, (yc, gc))| {
                for ((or, yr), gr) in oc
                    .chunks_exact_mut(n)
                    .zip(yc.chunks_exact(n))
                    .zip(gc.chunks_exact(n))
                {
                    grad_row(yr, gr, or, log);
                }
            });
    } else if n > 0 && inner > 0 {
        o.par_chunks_mut(n * inner)
            .zip(ys.par_chunks(n * inner).zip(gs.par_chunks(n * inner)))
            .for_each(|(ob, (yb, gb))| {
                strips_mut(ob, inner)
                    .into_par_iter()
                    .zip(strips(yb, inner).into_par_iter().zip(strips(gb, inner)))
                    .for_each(|(mut os, (ys, gs))| {
                        let mut acc = vec![0f32; ys[0].len()];
                        grad_cols(&ys, &gs, &mut os, log, &mut acc);
                    });
            });
    }
    drop((ys, gs));
    finish(out, y.shape(), float_out(g.dtype()))
}
