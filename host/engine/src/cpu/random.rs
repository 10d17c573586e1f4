//! Dropout as one pass: the keep decision of element `i` comes from the Philox stream at
//! `offset + i`, so the forward and the backward (and any recomputation) use the same mask.

use super::{finish, float_out, CHUNK};
use crate::error::Result;
use crate::rng::RngKey;
use crate::storage::Storage;
use crate::{DType, Tensor};
use rayon::prelude::*;

/// `x * scale` where the uniform draw at `offset + i` is at least `p`, else 0 (in f32, returned
/// in `x`'s floating dtype).
pub(crate) fn dropout(x: &Tensor, p: f32, scale: f32, key: &RngKey, offset: u64) -> Result<Tensor> {
    let xs = x.contig::<f32>();
    let mut out = Storage::any(DType::F32, xs.len());
    out.as_mut_slice::<f32>()
        .par_chunks_mut(CHUNK)
        .zip(xs.par_chunks(CHUNK))
        .enumerate()
        .for_each(|(c, (o, x))| {
            let u = key.uniform_vec(offset + (c * CHUNK) as u64, o.len());
            for ((o, &x), &u) in o.iter_mut().zip(x).zip(&u) {
                *o = if u >= p { x * scale } else { 0.0 };
            }
        });
    drop(xs);
    finish(out, x.shape(), float_out(x.dtype()))
}
