//! Cross-entropy fused with log-softmax.
//!
//! Forward: one pass per row with an online max / sum-exp over fixed blocks (the row is read
//! once; bf16/f16 logits are converted block by block, so no `[N, V]` f32 copy exists).
//! Backward: one pass writing `(softmax - smoothed one-hot) * scale` straight in the logits'
//! dtype.

use super::rowwise::{load_row, row_max, row_sum, rows_per_task, store_row};
use super::simd::{self, simd_kernel};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::storage::Storage;
use crate::{DType, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

/// Block length of the online pass (fits L1 with room to spare).
const BLOCK: usize = 512;

simd_kernel! {
    /// Σ exp(x - m).
    fn exp_sum(x: &[f32], m: f32) -> f32 {
        let mut acc = [0f32; 16];
        let mut cx = x.chunks_exact(16);
        for xs in &mut cx {
            for i in 0..16 {
                acc[i] += simd::exp(xs[i] - m);
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
        for &v in cx.remainder() {
            s += simd::exp(v - m);
        }
        s
    }
}

simd_kernel! {
    /// `out = (exp(x - lse) - floor) * scale`.
    fn softmax_grad_block(x: &[f32], lse: f32, floor: f32, scale: f32, out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = (simd::exp(v - lse) - floor) * scale;
        }
    }
}

/// A block of a row as f32: the slice itself for f32 storage, else converted into `buf`.
fn as_f32<'a, T: Element>(blk: &'a [T], buf: &'a mut [f32; BLOCK]) -> &'a [f32] {
    if T::DTYPE == DType::F32 {
        bytemuck::cast_slice(blk)
    } else {
        load_row(blk, &mut buf[..blk.len()]);
        &buf[..blk.len()]
    }
}

/// `(logsumexp, Σ x)` of one row in a single pass (`Σ x` only when `want_sum`).
fn row_stats<T: Element>(row: &[T], want_sum: bool) -> (f32, f32) {
    let mut buf = [0f32; BLOCK];
    let (mut m, mut s, mut sum) = (f32::NEG_INFINITY, 0f32, 0f32);
    for blk in row.chunks(BLOCK) {
        let x = as_f32(blk, &mut buf);
        let bm = row_max(x);
        if bm > m {
            s *= simd::exp(m - bm);
            m = bm;
        }
        if m > f32::NEG_INFINITY {
            s += exp_sum(x, m);
        }
        if want_sum {
            sum += row_sum(x);
        }
    }
    (m + s.ln(), sum)
}

/// Checked targets; `None` marks an ignored row.
pub(crate) fn checked_targets(
    targets: &Tensor,
    vocab: usize,
    ignore_index: Option<i64>,
) -> Result<Vec<Option<usize>>> {
    targets
        .contig::<i64>()
        .iter()
        .map(|&t| {
            if Some(t) == ignore_index {
                Ok(None)
            } else if t < 0 || t as u64 >= vocab as u64 {
                Err(Error::IndexOutOfRange {
                    op: "cross_entropy",
                    index: t,
                    size: vocab,
                })
            } else {
                Ok(Some(t as usize))
            }
        })
        .collect()
}

/// Runs `f` on the logits as a contiguous slice of their own element type.
fn with_logits<R>(logits: &Tensor, f: impl FnOnce(&dyn LogitRows) -> R) -> R {
    let owned;
    let t = if logits.is_contiguous() {
        logits
    } else {
        owned = logits.materialize(logits.dtype());
        &owned
    };
    let (a, b) = t.layout().contiguous_range().expect("contiguous by now");
    let g = t.storage();
    match t.dtype() {
        DType::BF16 => f(&&g.as_slice::<bf16>()[a..b]),
        DType::F16 => f(&&g.as_slice::<f16>()[a..b]),
        _ => f(&&g.as_slice::<f32>()[a..b]),
    }
}

/// Row kernels over logits of some element type (dispatch once per call, not per element).
trait LogitRows: Sync {
    fn forward(&self, v: usize, tg: &[Option<usize>], eps: f32, loss: &mut [f32], lse: &mut [f32]);
    fn backward(
        &self,
        v: usize,
        tg: &[Option<usize>],
        eps: f32,
        lse: &[f32],
        scale: &[f32],
    ) -> Storage;
}

impl<T: Element> LogitRows for &[T] {
    fn forward(&self, v: usize, tg: &[Option<usize>], eps: f32, loss: &mut [f32], lse: &mut [f32]) {
        let per = rows_per_task(v);
        loss.par_chunks_mut(per)
            .zip(lse.par_chunks_mut(per))
            .zip(self.par_chunks(per * v).zip(tg.par_chunks(per)))
            .for_each(|((lc, sc), (xc, tc))| {
                for (((l, s), row), t) in lc.iter_mut().zip(sc).zip(xc.chunks_exact(v)).zip(tc) {
                    let Some(t) = *t else {
                        (*l, *s) = (0.0, 0.0);
                        continue;
                    };
                    let (z, sum) = row_stats(row, eps > 0.0);
                    let nll = z - row[t].to_f32();
                    *l = if eps > 0.0 {
                        (1.0 - eps) * nll + eps * (z - sum / v as f32)
                    } else {
                        nll
                    };
                    *s = z;
                }
            });
    }

    fn backward(
        &self,
        v: usize,
        tg: &[Option<usize>],
        eps: f32,
        lse: &[f32],
        scale: &[f32],
    ) -> Storage {
        let mut out = Storage::any(T::DTYPE, self.len());
        let per = rows_per_task(v);
        out.as_mut_slice::<T>()
            .par_chunks_mut(per * v)
            .zip(self.par_chunks(per * v))
            .enumerate()
            .for_each(|(task, (oc, xc))| {
                let (mut xb, mut gb) = ([0f32; BLOCK], [0f32; BLOCK]);
                for (i, (orow, xrow)) in oc.chunks_exact_mut(v).zip(xc.chunks_exact(v)).enumerate()
                {
                    let r = task * per + i;
                    let (sc, target) = match tg[r] {
                        Some(t) if scale[r] != 0.0 => (scale[r], t),
                        _ => {
                            orow.fill(T::from_f32(0.0));
                            continue;
                        }
                    };
                    for (k, (ob, xblk)) in
                        orow.chunks_mut(BLOCK).zip(xrow.chunks(BLOCK)).enumerate()
                    {
                        let x = as_f32(xblk, &mut xb);
                        let g = &mut gb[..x.len()];
                        softmax_grad_block(x, lse[r], eps / v as f32, sc, g);
                        let j0 = k * BLOCK;
                        if (j0..j0 + x.len()).contains(&target) {
                            g[target - j0] -= (1.0 - eps) * sc;
                        }
                        store_row(g, ob);
                    }
                }
            });
        out
    }
}

pub(crate) fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: Option<i64>,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    let (n, v) = (logits.shape()[0], logits.shape()[1]);
    let tg = checked_targets(targets, v, ignore_index)?;
    let (mut loss, mut lse) = (vec![0f32; n], vec![0f32; n]);
    if v > 0 {
        with_logits(logits, |rows| {
            rows.forward(v, &tg, eps, &mut loss, &mut lse)
        });
    }
    Ok((Tensor::from_vec(loss, &[n])?, Tensor::from_vec(lse, &[n])?))
}

pub(crate) fn cross_entropy_backward(
    logits: &Tensor,
    targets: &Tensor,
    lse: &Tensor,
    row_scale: &Tensor,
    ignore_index: Option<i64>,
    eps: f32,
) -> Result<Tensor> {
    let v = logits.shape()[1];
    let tg = checked_targets(targets, v, ignore_index)?;
    let (lse, scale) = (lse.contig::<f32>(), row_scale.contig::<f32>());
    let out = if v > 0 {
        with_logits(logits, |rows| rows.backward(v, &tg, eps, &lse, &scale))
    } else {
        Storage::any(logits.dtype(), 0)
    };
    Tensor::from_storage(out, logits.shape())
}

#[cfg(test)]
mod tests {
    #[test]
    #[ignore]
    fn exp_sum_speed() {
        let x: Vec<f32> = (0..4096).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
        let t = std::time::Instant::now();
        let mut s = 0.0;
        for _ in 0..10000 {
            s += super::exp_sum(std::hint::black_box(&x), 1.0);
        }
        let ns = t.elapsed().as_nanos() as f64 / (4096.0 * 10000.0);
        let t = std::time::Instant::now();
        for _ in 0..10000 {
            s += super::super::rowwise::row_max(std::hint::black_box(&x));
        }
        let ns2 = t.elapsed().as_nanos() as f64 / (4096.0 * 10000.0);
        println!(
            "exp_sum {ns:.3} ns/elem, row_max {ns2:.3} ns/elem ({s}) {:?}",
            crate::simd_level()
        );
    }
}
