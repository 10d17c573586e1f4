//! Shared pieces of the row-wise fused kernels: fixed task sizes and lane-split reductions.
//!
//! Reductions keep 16 interleaved partial results combined pairwise, so the compiler vectorizes
//! them and the order (hence the result) depends only on the row length.

use super::simd::simd_kernel;
use super::CHUNK;
use crate::dtype::Element;

const LANES: usize = 16;

/// Rows handled by one parallel task for rows of `d` elements (depends on sizes only).
pub(crate) fn rows_per_task(d: usize) -> usize {
    (CHUNK / d.max(1)).max(1)
}

#[inline(always)]
fn fold(mut acc: [f32; LANES], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            acc[i] = f(acc[i], acc[i + w]);
        }
    }
    acc[0]
}

simd_kernel! {
    /// Maximum of a row (-inf when empty; NaNs are skipped like `f32::max`).
    pub(crate) fn row_max(x: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; LANES];
        let mut chunks = x.chunks_exact(LANES);
        for c in &mut chunks {
            for i in 0..LANES {
                acc[i] = acc[i].max(c[i]);
            }
        }
        let mut m = fold(acc, f32::max);
        for &v in chunks.remainder() {
            m = m.max(v);
        }
        m
    }
}

simd_kernel! {
    /// Σ x.
    pub(crate) fn row_sum(x: &[f32]) -> f32 {
        let mut acc = [0f32; LANES];
        let mut chunks = x.chunks_exact(LANES);
        for c in &mut chunks {
            for i in 0..LANES {
                acc[i] += c[i];
            }
        }
        let mut s = fold(acc, |a, b| a + b);
        for &v in chunks.remainder() {
            s += v;
        }
        s
    }
}

simd_kernel! {
    /// Σ a·b.
    pub(crate) fn row_dot(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; LANES];
        let mut ca = a.chunks_exact(LANES);
        let mut cb = b.chunks_exact(LANES);
        for (x, y) in (&mut ca).zip(&mut cb) {
            for i in 0..LANES {
                acc[i] += x[i] * y[i];
            }
        }
        let mut s = fold(acc, |a, b| a + b);
        for (&x, &y) in ca.remainder().iter().zip(cb.remainder()) {
            s += x * y;
        }
        s
    }
}

simd_kernel! {
    /// Σ (x - c)².
    pub(crate) fn row_sq_dev(x: &[f32], c: f32) -> f32 {
        let mut acc = [0f32; LANES];
        let mut chunks = x.chunks_exact(LANES);
        for v in &mut chunks {
            for i in 0..LANES {
                let d = v[i] - c;
                acc[i] += d * d;
            }
        }
        let mut s = fold(acc, |a, b| a + b);
        for &v in chunks.remainder() {
            s += (v - c) * (v - c);
        }
        s
    }
}

/// Converts a row of any element type into `dst` as f32.
pub(crate) fn load_row<T: Element>(src: &[T], dst: &mut [f32]) {
    dst.iter_mut().zip(src).for_each(|(d, &s)| *d = s.to_f32());
}

/// Writes a row of f32 values as `T` (round-to-nearest-even for half types).
pub(crate) fn store_row<T: Element>(src: &[f32], dst: &mut [T]) {
    dst.iter_mut()
        .zip(src)
        .for_each(|(d, &s)| *d = T::from_f32(s));
}

/// Sums per-block partial vectors (each of length `d`) in block order: the fixed-order
/// reduction behind weight gradients.
pub(crate) fn sum_partials(partials: &[Vec<f32>], d: usize) -> Vec<f32> {
    let mut out = vec![0f32; d];
    for p in partials {
        out.iter_mut().zip(p).for_each(|(o, &v)| *o += v);
    }
    out
}
