//! Concatenation as slab copies: each outer slab of the output is filled by one task with one
//! `memcpy` per input, whatever the dtype (bytes are copied, never converted).

use super::index::split_at_dim;
use crate::error::Result;
use crate::storage::Storage;
use crate::Tensor;
use rayon::prelude::*;

/// Joins tensors of one dtype and matching other dims along `dim`.
pub(crate) fn cat(tensors: &[Tensor], dim: usize) -> Result<Tensor> {
    let dtype = tensors[0].dtype();
    let es = dtype.size_in_bytes();
    let mut shape = tensors[0].shape().to_vec();
    shape[dim] = tensors.iter().map(|t| t.shape()[dim]).sum();
    let (outer, total, inner) = split_at_dim(&shape, dim);
    // Strided inputs are made contiguous first so every slab of an input is one run of bytes.
    let srcs: Vec<Tensor> = tensors
        .iter()
        .map(|t| match t.layout().contiguous_range() {
            Some(_) => t.clone(),
            None => t.materialize(dtype),
        })
        .collect();
    let guards: Vec<_> = srcs.iter().map(|t| t.storage()).collect();
    let runs: Vec<(&[u8], usize)> = srcs
        .iter()
        .zip(&guards)
        .map(|(t, g)| {
            let (a, b) = t
                .layout()
                .contiguous_range()
                .expect("made contiguous above");
            (&g.as_bytes()[a * es..b * es], t.shape()[dim] * inner * es)
        })
        .collect();
    let mut out = Storage::any(dtype, outer * total * inner);
    let slab = total * inner * es;
    if slab > 0 {
        out.as_bytes_mut()
            .par_chunks_mut(slab)
            .enumerate()
            .for_each(|(o, dst)| {
                let mut at = 0;
                for &(src, width) in &runs {
                    dst[at..at + width].copy_from_slice(&src[o * width..(o + 1) * width]);
                    at += width;
                }
            });
    }
    drop(guards);
    Tensor::from_storage(out, &shape)
}
