//! Embedding lookup (a row gather) and its scatter-add backward.
//!
//! The backward is deterministic without atomics: ids are bucketed by a stable counting sort,
//! then each vocabulary row sums its gradient rows in position order; tasks own disjoint
//! vocabulary ranges.

use super::rowwise::rows_per_task;
use super::{finish, float_out};
use crate::error::{Error, Result};
use crate::storage::Storage;
use crate::{DType, Tensor};
use rayon::prelude::*;

/// The ids as usize, or the first out-of-range one as an error naming `op`.
pub(crate) fn checked_ids(op: &'static str, ids: &Tensor, size: usize) -> Result<Vec<usize>> {
    let raw = ids.contig::<i64>();
    raw.iter()
        .map(|&i| {
            if i < 0 || i as u64 >= size as u64 {
                Err(Error::IndexOutOfRange { op, index: i, size })
            } else {
                Ok(i as usize)
            }
        })
        .collect()
}

pub(crate) fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (vocab, d) = (weight.shape()[0], weight.shape()[1]);
    let idx = checked_ids("embedding", ids, vocab)?;
    let mut shape = ids.shape().to_vec();
    shape.push(d);
    // Gather raw bytes: any dtype, no conversion.
    let w = weight.detach().contiguous()?;
    let guard = w.storage();
    let eb = w.dtype().size_in_bytes();
    let row_bytes = d * eb;
    let (first, _) = w
        .layout()
        .contiguous_range()
        .expect("contiguous() gives a contiguous layout");
    let start = first * eb;
    let src = &guard.as_bytes()[start..start + vocab * row_bytes];
    let mut out = Storage::any(w.dtype(), idx.len() * d);
    if row_bytes > 0 {
        let per = rows_per_task(d);
        out.as_bytes_mut()
            .par_chunks_mut(per * row_bytes)
            .zip(idx.par_chunks(per))
            .for_each(|(oc, ic)| {
                for (or, &i) in oc.chunks_exact_mut(row_bytes).zip(ic) {
                    or.copy_from_slice(&src[i * row_bytes..(i + 1) * row_bytes]);
                }
            });
    }
    drop(guard);
    Tensor::from_storage(out, &shape)
}

pub(crate) fn embedding_backward(
    ids: &Tensor,
    g: &Tensor,
    vocab: usize,
    dtype: DType,
) -> Result<Tensor> {
    let idx = checked_ids("embedding", ids, vocab)?;
    let d = *g.shape().last().unwrap_or(&0);
    // Stable counting sort: `order[start[v]..start[v + 1]]` are the positions holding id v.
    let mut start = vec![0usize; vocab + 1];
    for &i in &idx {
        start[i + 1] += 1;
    }
    for v in 0..vocab {
        start[v + 1] += start[v];
    }
    let mut fill = start.clone();
    let mut order = vec![0usize; idx.len()];
    for (p, &i) in idx.iter().enumerate() {
        order[fill[i]] = p;
        fill[i] += 1;
    }
    let gs = g.contig::<f32>();
    let mut out = Storage::zeros(DType::F32, vocab * d);
    if d > 0 {
        let per = rows_per_task(d);
        out.as_mut_slice::<f32>()
            .par_chunks_mut(per * d)
            .enumerate()
            .for_each(|(task, oc)| {
                for (k, or) in oc.chunks_exact_mut(d).enumerate() {
                    let v = task * per + k;
                    for &p in &order[start[v]..start[v + 1]] {
                        let gr = &gs[p * d..(p + 1) * d];
                        or.iter_mut().zip(gr).for_each(|(o, &g)| *o += g);
                    }
                }
            });
    }
    drop(gs);
    finish(out, &[vocab, d], float_out(dtype))
}
