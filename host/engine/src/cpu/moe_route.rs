//! Dropless MoE dispatch and combine: moving token rows into expert order and weighted expert
//! outputs back into token order.
//!
//! Every output row is written by exactly one task, and each sum runs over a token's `k`
//! choices in choice order, so results are bitwise identical with any thread count (no atomic
//! or racing scatter-add).

use super::finish;
use crate::error::Result;
use crate::storage::Storage;
use crate::{DType, Tensor};
use rayon::prelude::*;

/// Rows per rayon task: enough to amortise scheduling on rows of a few hundred floats.
const ROWS_PER_TASK: usize = 16;

/// `out[s] = x[token[s]]` for `x [N, D]`: the expert-sorted copy of the tokens.
pub(crate) fn dispatch(x: &Tensor, token: &[i64], dtype: DType) -> Result<Tensor> {
    let _p = crate::profile::scope("moe_dispatch");
    let d = x.shape()[1];
    let xs = x.contig::<f32>();
    let mut out = Storage::any(DType::F32, token.len() * d);
    if d > 0 {
        out.as_mut_slice::<f32>()
            .par_chunks_mut(d)
            .with_min_len(ROWS_PER_TASK)
            .zip(token.par_iter())
            .for_each(|(dst, &t)| dst.copy_from_slice(&xs[t as usize * d..][..d]));
    }
    drop(xs);
    finish(out, &[token.len(), d], dtype)
}

/// The gradient of [`dispatch`]: `dx[t] = Σ_j g[inverse[t·k + j]]` for `j` in `0..k`, summed
/// in choice order.
pub(crate) fn dispatch_backward(
    g: &Tensor,
    inverse: &[i64],
    k: usize,
    dtype: DType,
) -> Result<Tensor> {
    let d = g.shape()[1];
    let _p = crate::profile::scope("moe_dispatch_backward");
    let n = inverse.len() / k.max(1);
    let gs = g.contig::<f32>();
    let mut out = Storage::any(DType::F32, n * d);
    if d > 0 {
        out.as_mut_slice::<f32>()
            .par_chunks_mut(d)
            .with_min_len(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(t, dst)| {
                dst.fill(0.0);
                for &s in &inverse[t * k..(t + 1) * k] {
                    let src = &gs[s as usize * d..][..d];
                    dst.iter_mut().zip(src).for_each(|(o, &v)| *o += v);
                }
            });
    }
    drop(gs);
    finish(out, &[n, d], dtype)
}

/// `out[t] = Σ_j w[t, j] · y[inverse[t·k + j]]` for expert outputs `y [N·k, D]` in sorted order
/// and weights `w [N, k]`: the weighted combine back into token order.
pub(crate) fn combine(y: &Tensor, w: &Tensor, inverse: &[i64], dtype: DType) -> Result<Tensor> {
    let _p = crate::profile::scope("moe_combine");
    let (n, k) = (w.shape()[0], w.shape()[1]);
    let d = y.shape()[1];
    let (ys, ws) = (y.contig::<f32>(), w.contig::<f32>());
    let mut out = Storage::any(DType::F32, n * d);
    if d > 0 {
        out.as_mut_slice::<f32>()
            .par_chunks_mut(d)
            .with_min_len(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(t, dst)| {
                dst.fill(0.0);
                for j in 0..k {
                    let (s, wt) = (inverse[t * k + j] as usize, ws[t * k + j]);
                    let src = &ys[s * d..][..d];
                    dst.iter_mut().zip(src).for_each(|(o, &v)| *o += wt * v);
                }
            });
    }
    drop((ys, ws));
    finish(out, &[n, d], dtype)
}

/// The gradients of [`combine`] for the output gradient `g [N, D]`: `dy [N·k, D]` (sorted
/// slot `s` holding assignment `a = order[s]` gets `w[a] · g[a / k]`) and `dw [N, k]`
/// (`dw[a] = ⟨g[a / k], y[inverse[a]]⟩`, summed in f64 in index order).
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
    let _p = crate::profile::scope("moe_combine_backward");
    let (n, k) = (w.shape()[0], w.shape()[1]);
    let d = y.shape()[1];
    let gs = g.contig::<f32>();
    let dy = if need.0 {
        let ws = w.contig::<f32>();
        let mut out = Storage::any(DType::F32, n * k * d);
        if d > 0 {
            out.as_mut_slice::<f32>()
                .par_chunks_mut(d)
                .with_min_len(ROWS_PER_TASK)
                .zip(order.par_iter())
                .for_each(|(dst, &a)| {
                    let (wt, src) = (ws[a as usize], &gs[(a as usize / k) * d..][..d]);
                    dst.iter_mut().zip(src).for_each(|(o, &v)| *o = wt * v);
                });
        }
        drop(ws);
        Some(finish(out, &[n * k, d], dtypes.0)?)
    } else {
        None
    };
    let dw = if need.1 {
        let ys = y.contig::<f32>();
        let mut out = Storage::any(DType::F32, n * k);
        out.as_mut_slice::<f32>()
            .par_iter_mut()
            .with_min_len(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(a, o)| {
                let (yr, gr) = (&ys[inverse[a] as usize * d..][..d], &gs[(a / k) * d..][..d]);
                *o = yr
                    .iter()
                    .zip(gr)
                    .map(|(&p, &q)| p as f64 * q as f64)
                    .sum::<f64>() as f32;
            });
        drop(ys);
        Some(finish(out, &[n, k], dtypes.1)?)
    } else {
        None
    };
    drop(gs);
    Ok((dy, dw))
}

/// Per-expert counts as `usize` (a negative count, which no sort produces, as 0).
pub(crate) fn host_counts(counts: &Tensor) -> Vec<usize> {
    counts
        .to_vec::<i64>()
        .into_iter()
        .map(|c| c.max(0) as usize)
        .collect()
}

/// The stable counting sort of top-k choices `ids [N, k]` by expert (ids checked by the
/// caller): `[order, token, inverse, counts]` as i64 tensors. Assignment `a` (token `a / k`,
/// choice `a % k`) goes to slot `start[e] + (earlier assignments of e)`.
pub(crate) fn sort_by_expert(ids: &Tensor, num_experts: usize) -> Result<[Tensor; 4]> {
    let k = ids.shape()[1].max(1);
    let ids = ids.to_vec::<i64>();
    let mut counts = vec![0i64; num_experts];
    for &e in &ids {
        counts[e as usize] += 1;
    }
    let mut next: Vec<i64> = counts
        .iter()
        .scan(0i64, |start, &c| {
            let s = *start;
            *start += c;
            Some(s)
        })
        .collect();
    let n = ids.len();
    let (mut order, mut inverse) = (vec![0i64; n], vec![0i64; n]);
    for (a, &e) in ids.iter().enumerate() {
        let slot = next[e as usize];
        next[e as usize] += 1;
        order[slot as usize] = a as i64;
        inverse[a] = slot;
    }
    let token: Vec<i64> = order.iter().map(|&a| a / k as i64).collect();
    Ok([
        Tensor::from_vec(order, &[n])?,
        Tensor::from_vec(token, &[n])?,
        Tensor::from_vec(inverse, &[n])?,
        Tensor::from_vec(counts, &[num_experts])?,
    ])
}
