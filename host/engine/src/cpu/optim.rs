//! Fused optimizer kernels: one pass over every parameter's tensors, in place.

use super::simd::simd_kernel;
use super::CHUNK;
use crate::error::Result;
use crate::ops::{AdamWConsts, AdamWTensors};
use rayon::prelude::*;

simd_kernel! {
    fn adamw_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: &AdamWConsts) {
        for i in 0..p.len() {
            let gi = g[i];
            let mi = m[i] * c.b1 + gi * c.one_minus_b1;
            let vi = v[i] * c.b2 + (gi * gi) * c.one_minus_b2;
            m[i] = mi;
            v[i] = vi;
            let denom = (vi * c.inv_bc2).sqrt() + c.eps;
            let update = (mi * c.inv_bc1) / denom;
            p[i] = p[i] * c.decay - update * c.lr;
        }
    }
}

/// Work item: the same `CHUNK`-sized range of one parameter's four tensors.
type Item<'a> = (&'a mut [f32], &'a [f32], &'a mut [f32], &'a mut [f32]);

pub(crate) fn adamw(groups: &[AdamWTensors<'_>], c: &AdamWConsts) -> Result<()> {
    // Gradients are read in place when contiguous (the usual case), else copied once.
    let grads: Vec<_> = groups.iter().map(|g| g.grad.contig::<f32>()).collect();
    let mut params: Vec<_> = groups.iter().map(|g| g.param.storage_mut()).collect();
    let mut m: Vec<_> = groups.iter().map(|g| g.exp_avg.storage_mut()).collect();
    let mut v: Vec<_> = groups.iter().map(|g| g.exp_avg_sq.storage_mut()).collect();
    let mut items: Vec<Item<'_>> = Vec::new();
    for (i, (((p, g), m), v)) in params
        .iter_mut()
        .zip(&grads)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
        .enumerate()
    {
        // Contiguous (checked by the op): the tensor's elements are one range of its storage.
        let (a, b) = groups[i]
            .param
            .layout()
            .contiguous_range()
            .expect("checked contiguous");
        let (ma, mb) = groups[i]
            .exp_avg
            .layout()
            .contiguous_range()
            .expect("checked contiguous");
        let (va, vb) = groups[i]
            .exp_avg_sq
            .layout()
            .contiguous_range()
            .expect("checked contiguous");
        let p = &mut p.as_mut_slice::<f32>()[a..b];
        let m = &mut m.as_mut_slice::<f32>()[ma..mb];
        let v = &mut v.as_mut_slice::<f32>()[va..vb];
        let g: &[f32] = g;
        items.extend(
            p.chunks_mut(CHUNK)
                .zip(g.chunks(CHUNK))
                .zip(m.chunks_mut(CHUNK))
                .zip(v.chunks_mut(CHUNK))
                .map(|(((p, g), m), v)| (p, g, m, v)),
        );
    }
    items
        .into_par_iter()
        .for_each(|(p, g, m, v)| adamw_chunk(p, g, m, v, c));
    Ok(())
}
