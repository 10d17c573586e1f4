//! Rotary position embedding: one pass over `x`, rotating pairs by table angles and copying the
//! non-rotary tail. The backward is the same kernel rotating by the negative angle.

use super::rowwise::rows_per_task;
use super::simd::simd_kernel;
use super::{finish, float_out};
use crate::error::Result;
use crate::ops::{RopeLayout, RopeSpec, RopeStyle};
use crate::storage::Storage;
use crate::{DType, Tensor};
use rayon::prelude::*;

simd_kernel! {
    /// Rotates one row of `D` values: pairs use `cos[i]`, `sign * sin[i]`; the tail is copied.
    fn rotate_row(x: &[f32], y: &mut [f32], cos: &[f32], sin: &[f32], sign: f32, interleaved: bool) {
        let r = cos.len();
        if interleaved {
            for i in 0..r {
                let (c, s) = (cos[i], sign * sin[i]);
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                y[2 * i] = a * c - b * s;
                y[2 * i + 1] = a * s + b * c;
            }
        } else {
            let (xa, xb) = x[..2 * r].split_at(r);
            let (ya, yb) = y[..2 * r].split_at_mut(r);
            for i in 0..r {
                let (c, s) = (cos[i], sign * sin[i]);
                ya[i] = xa[i] * c - xb[i] * s;
                yb[i] = xb[i] * c + xa[i] * s;
            }
        }
        y[2 * r..].copy_from_slice(&x[2 * r..]);
    }
}

/// Rotates `x` (rank 4, checked by the op) with `[T, R]` or `[B, T, R]` tables.
pub(crate) fn rope(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    spec: RopeSpec,
    inverse: bool,
) -> Result<Tensor> {
    let s = x.shape();
    let (heads, t_len) = match spec.layout {
        RopeLayout::Bhtd => (s[1], s[2]),
        RopeLayout::Bthd => (s[2], s[1]),
    };
    let d = s[3];
    let r = *cos.shape().last().unwrap_or(&0);
    let batched = cos.rank() == 3;
    let xs = x.contig::<f32>();
    let (cs, ss) = (cos.contig::<f32>(), sin.contig::<f32>());
    let mut out = Storage::any(DType::F32, xs.len());
    let sign = if inverse { -1.0 } else { 1.0 };
    let interleaved = spec.style == RopeStyle::Interleaved;
    if d > 0 {
        let per = rows_per_task(d);
        out.as_mut_slice::<f32>()
            .par_chunks_mut(per * d)
            .zip(xs.par_chunks(per * d))
            .enumerate()
            .for_each(|(task, (yc, xc))| {
                for (i, (yr, xr)) in yc.chunks_exact_mut(d).zip(xc.chunks_exact(d)).enumerate() {
                    let row = task * per + i;
                    let (b, t) = match spec.layout {
                        RopeLayout::Bhtd => (row / (heads * t_len), row % t_len),
                        RopeLayout::Bthd => (row / (heads * t_len), (row / heads) % t_len),
                    };
                    let tr = if batched { b * t_len + t } else { t };
                    let (c, sn) = (&cs[tr * r..(tr + 1) * r], &ss[tr * r..(tr + 1) * r]);
                    rotate_row(xr, yr, c, sn, sign, interleaved);
                }
            });
    }
    drop((xs, cs, ss));
    finish(out, s, float_out(x.dtype()))
}
