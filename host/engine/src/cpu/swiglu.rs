//! SwiGLU kernels: `y = silu(g)·u` and its two input gradients in one pass each.

use super::simd::{self, simd_kernel};
use super::{finish, float_out, CHUNK};
use crate::error::Result;
use crate::storage::Storage;
use crate::{DType, Tensor};
use rayon::prelude::*;

simd_kernel! {
    fn forward(g: &[f32], u: &[f32], y: &mut [f32]) {
        for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
            *y = g * simd::sigmoid(g) * u;
        }
    }
}

simd_kernel! {
    /// `dg = dy·u·s·(1 + g·(1 − s))`, `du = dy·g·s` with `s = sigmoid(g)`: the order of the
    /// composed silu / mul backward, so the values are the same.
    fn backward(g: &[f32], u: &[f32], dy: &[f32], dg: &mut [f32], du: &mut [f32]) {
        for i in 0..g.len() {
            let (gv, uv, d) = (g[i], u[i], dy[i]);
            let s = simd::sigmoid(gv);
            du[i] = d * (gv * s);
            dg[i] = (d * uv) * s * (1.0 + gv * (1.0 - s));
        }
    }
}

pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (g, u) = (gate.contig::<f32>(), up.contig::<f32>());
    let mut out = Storage::any(DType::F32, g.len());
    out.as_mut_slice::<f32>()
        .par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
        .for_each(|(y, (g, u))| forward(g, u, y));
    drop((g, u));
    finish(out, gate.shape(), float_out(gate.dtype()))
}

pub(crate) fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let (g, u, d) = (gate.contig::<f32>(), up.contig::<f32>(), dy.contig::<f32>());
    let mut dg = Storage::any(DType::F32, g.len());
    let mut du = Storage::any(DType::F32, g.len());
    dg.as_mut_slice::<f32>()
        .par_chunks_mut(CHUNK)
        .zip(du.as_mut_slice::<f32>().par_chunks_mut(CHUNK))
        .zip(
            g.par_chunks(CHUNK)
                .zip(u.par_chunks(CHUNK))
                .zip(d.par_chunks(CHUNK)),
        )
        .for_each(|((dg, du), ((g, u), d))| backward(g, u, d, dg, du));
    drop((g, u, d));
    Ok((
        finish(dg, gate.shape(), float_out(gate.dtype()))?,
        finish(du, up.shape(), float_out(up.dtype()))?,
    ))
}
