//! Reductions over one dim, in a fixed summation order.

use super::simd::simd_kernel;
use super::{finish, float_out};
use crate::error::Result;
use crate::ops::ReduceOp;
use crate::storage::Storage;
use crate::{DType, Tensor};
use rayon::prelude::*;

const LANES: usize = 16;
/// Block length of two-level sums over very long rows (fixed, for determinism).
const BLOCK: usize = 1 << 13;

simd_kernel! {
    /// Sum of a contiguous run with 16 interleaved partial sums, combined pairwise.
    fn sum_run(x: &[f32]) -> f32 {
        let mut acc = [0f32; LANES];
        let mut chunks = x.chunks_exact(LANES);
        for c in &mut chunks {
            for i in 0..LANES {
                acc[i] += c[i];
            }
        }
        let mut w = LANES;
        while w > 1 {
            w /= 2;
            for i in 0..w {
                acc[i] += acc[i + w];
            }
        }
        let mut s = acc[0];
        for &v in chunks.remainder() {
            s += v;
        }
        s
    }
}

fn sum_long(x: &[f32]) -> f32 {
    if x.len() <= BLOCK * 4 {
        return sum_run(x);
    }
    let partial: Vec<f32> = x.par_chunks(BLOCK).map(sum_run).collect();
    sum_run(&partial)
}

fn extreme_row(x: &[f32], max: bool) -> (f32, usize) {
    let mut best = x[0];
    let mut idx = 0;
    for (i, &v) in x.iter().enumerate().skip(1) {
        if (max && v > best) || (!max && v < best) || (v.is_nan() && !best.is_nan()) {
            best = v;
            idx = i;
        }
    }
    (best, idx)
}

/// One outer slice of a reduction over a middle dim: output values, optional arg indices, input.
type ReduceTask<'a> = (&'a mut [f32], Option<&'a mut [i64]>, &'a [f32]);

pub(crate) fn reduce(op: ReduceOp, x: &Tensor, dim: usize) -> Result<Tensor> {
    let shape = x.shape();
    let n = shape[dim];
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let mut out_shape = shape.to_vec();
    out_shape[dim] = 1;
    let src = x.contig::<f32>();
    let arg = matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin);
    let mut vals = Storage::any(DType::F32, outer * inner);
    let mut idxs = vec![0i64; if arg { outer * inner } else { 0 }];
    if n == 0 {
        let fill = match op {
            ReduceOp::Sum => 0.0,
            ReduceOp::Max => f32::NEG_INFINITY,
            ReduceOp::Min => f32::INFINITY,
            _ => {
                return Err(crate::error::invalid(
                    op.name(),
                    "cannot take the arg of an empty dim",
                ));
            }
        };
        vals.as_mut_slice::<f32>().fill(fill);
        drop(src);
        return finish(vals, &out_shape, float_out(x.dtype()));
    }
    let v = vals.as_mut_slice::<f32>();
    if inner == 1 {
        match op {
            ReduceOp::Sum if outer == 1 => v[0] = sum_long(&src),
            ReduceOp::Sum => v
                .par_iter_mut()
                .zip(src.par_chunks(n))
                .for_each(|(o, row)| *o = sum_run(row)),
            _ => {
                let max = matches!(op, ReduceOp::Max | ReduceOp::ArgMax);
                let res: Vec<(f32, usize)> =
                    src.par_chunks(n).map(|row| extreme_row(row, max)).collect();
                for (i, (b, k)) in res.into_iter().enumerate() {
                    v[i] = b;
                    if arg {
                        idxs[i] = k as i64;
                    }
                }
            }
        }
    } else {
        let max = matches!(op, ReduceOp::Max | ReduceOp::ArgMax);
        let idx_chunks: Vec<&mut [i64]> = if arg {
            idxs.chunks_mut(inner).collect()
        } else {
            Vec::new()
        };
        let mut idx_iter = idx_chunks.into_iter();
        let mut tasks: Vec<ReduceTask> = Vec::with_capacity(outer);
        for (o, block) in v.chunks_mut(inner).zip(src.chunks(n * inner)) {
            tasks.push((o, idx_iter.next(), block));
        }
        tasks.into_par_iter().for_each(|(o, mut ix, block)| {
            o.copy_from_slice(&block[..inner]);
            for r in 1..n {
                let row = &block[r * inner..(r + 1) * inner];
                match op {
                    ReduceOp::Sum => o.iter_mut().zip(row).for_each(|(a, &b)| *a += b),
                    _ => {
                        for (j, (a, &b)) in o.iter_mut().zip(row).enumerate() {
                            if (max && b > *a) || (!max && b < *a) || (b.is_nan() && !a.is_nan()) {
                                *a = b;
                                if let Some(ix) = ix.as_deref_mut() {
                                    ix[j] = r as i64;
                                }
                            }
                        }
                    }
                }
            }
        });
    }
    drop(src);
    if arg {
        return Tensor::from_slice(&idxs, &out_shape);
    }
    finish(vals, &out_shape, float_out(x.dtype()))
}
