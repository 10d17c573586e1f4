//! Context parallelism by all-gather (Llama 3's): every rank of a [`KvRing`] gathers the whole
//! sequence's keys and values and attends its own query rows to them with the ordinary
//! attention op. Unlike the ring's online-softmax merge, each query row then goes through
//! exactly the computation it has in a forward over the whole sequence, so in batch-invariant
//! mode (the RL trainer's logprob pass, which must reproduce the rollouts' decode bit for bit)
//! [`super::ring_attention`] takes this path.
//!
//! The gathered keys are put back in position order, so a query row meets its keys in the
//! order a single process has them; the queries run in runs of consecutive positions (a
//! context-parallel rank holds a chunk from the head and its mirror from the tail), each an
//! attention call of its own, which the batch-invariant kernels compute row by row.
//!
//! [`cp_gather`] is also the op that makes a rank's rows of anything whole (the RL trainer's
//! logits): its backward either keeps this rank's rows of a gradient every rank computed alike
//! ([`GatherGrad::Own`]), or sums every rank's partial gradient of the whole and keeps this
//! rank's rows of the sum ([`GatherGrad::Sum`], the keys and values: each rank's queries add
//! their part).

use super::attention::AttentionParams;
use super::ring_attention::KvRing;
use crate::autograd::record;
use crate::error::{invalid, Result};
use crate::{DType, Tensor};
use std::sync::Arc;

const OP: &str = "cp_gather";

/// What the backward of [`cp_gather`] does with the gradient of the whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatherGrad {
    /// Every rank computed the same gradient of the whole (the same loss from the same whole
    /// tensor): keep this rank's rows, send nothing (a sum would count it once per rank).
    Own,
    /// Each rank's gradient of the whole is partial (its own queries' share): sum them over
    /// the ring and keep this rank's rows.
    Sum,
}

/// Every rank's `blocks`, each rank's at the index of how many passes it took to arrive
/// (`[0]` is this rank's own, `[s]` came from `s` ranks back): `size − 1` passes.
fn all_blocks(ring: &dyn KvRing, blocks: Vec<Tensor>) -> Result<Vec<Vec<Tensor>>> {
    let want = blocks.len();
    let mut all = vec![blocks];
    for _ in 1..ring.size() {
        let got = ring.pass(all.last().map(Vec::as_slice).unwrap_or(&[]))?;
        if got.len() != want {
            return Err(invalid(
                OP,
                format!("the ring returned {} tensors for {want}", got.len()),
            ));
        }
        all.push(got);
    }
    Ok(all)
}

/// `x`, this rank's rows along `dim` at the global positions `pos` (i64 or i32 `[x.shape[dim]]`),
/// joined with every other rank's of `ring` into the whole, its rows in ascending position
/// order; returns it with the sorted positions. Collective: every rank calls it in the same
/// order with the same shapes but along `dim`. See [`GatherGrad`] for the backward.
pub fn cp_gather(
    x: &Tensor,
    dim: usize,
    pos: &Tensor,
    ring: Arc<dyn KvRing>,
    grad: GatherGrad,
) -> Result<(Tensor, Vec<i64>)> {
    if dim >= x.rank() || pos.rank() != 1 || pos.numel() != x.shape()[dim] {
        return Err(invalid(
            OP,
            format!(
                "positions {:?} do not label dim {dim} of {:?}",
                pos.shape(),
                x.shape()
            ),
        ));
    }
    let own = pos.to_dtype(DType::I64)?;
    let own_pos = own.to_vec::<i64>();
    let blocks = all_blocks(ring.as_ref(), vec![x.detach().contiguous()?, own.clone()])?;
    let mut parts = Vec::with_capacity(blocks.len());
    let mut positions = Vec::new();
    for b in &blocks {
        parts.push(b[0].clone());
        positions.extend(b[1].to_vec::<i64>());
    }
    let joined = super::cat(&parts, dim as isize)?;
    // Ascending positions: the order a single process holds the rows in.
    let mut order: Vec<usize> = (0..positions.len()).collect();
    order.sort_by_key(|&i| positions[i]);
    if order.windows(2).any(|w| positions[w[0]] == positions[w[1]]) {
        return Err(invalid(OP, "two ranks hold the same position"));
    }
    let sorted: Vec<i64> = order.iter().map(|&i| positions[i]).collect();
    let idx = Tensor::from_vec(order.iter().map(|&i| i as i64).collect(), &[order.len()])?;
    let idx = crate::staged::place(idx, x.device())?;
    let whole = joined.index_select(dim as isize, &idx)?;
    // Where each of this rank's rows sits in the whole.
    let mine: Vec<i64> = own_pos
        .iter()
        .map(|p| sorted.binary_search(p).map(|i| i as i64))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| invalid(OP, "a position of this rank is missing from the whole"))?;
    let mine = crate::staged::place(Tensor::from_vec(mine, &[own_pos.len()])?, x.device())?;
    let out = record(OP, whole, &[x], move || {
        move |g: &Tensor| {
            let g = match grad {
                GatherGrad::Own => g.clone(),
                GatherGrad::Sum => {
                    let parts = all_blocks(ring.as_ref(), vec![g.contiguous()?])?;
                    let mut sum = parts[0][0].to_dtype(DType::F32)?.to_vec_f32();
                    for p in &parts[1..] {
                        for (a, b) in sum.iter_mut().zip(p[0].to_vec_f32()) {
                            *a += b;
                        }
                    }
                    crate::staged::from_host(sum, g.shape(), g.dtype(), g.device())?
                }
            };
            Ok(vec![Some(g.index_select(dim as isize, &mine)?)])
        }
    });
    Ok((out, sorted))
}

/// Attention of this rank's queries over the keys/values of every rank of `ring`, gathered
/// whole: `q [B, Hq, Tq, D]`, `k`, `v` this rank's rows at the positions `params.q_pos`
/// (= `params.k_pos`, required). Each query row is computed as in
/// [`super::scaled_dot_product_attention`] over the whole sequence (bitwise under
/// batch-invariant mode, whose kernels compute rows independently). The key and value
/// gradients are each rank's queries' shares summed over the ring.
pub fn gather_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttentionParams,
    ring: Arc<dyn KvRing>,
) -> Result<Tensor> {
    let (Some(q_pos), Some(k_pos)) = (&params.q_pos, &params.k_pos) else {
        return Err(invalid("ring_attention", "q_pos and k_pos must be given"));
    };
    let (kw, kp) = cp_gather(k, 2, k_pos, ring.clone(), GatherGrad::Sum)?;
    let (vw, _) = cp_gather(v, 2, k_pos, ring, GatherGrad::Sum)?;
    let k_pos = Tensor::from_vec(kp.clone(), &[kp.len()])?;
    let q_pos = q_pos.to_dtype(DType::I64)?.to_vec::<i64>();
    let mut outs = Vec::new();
    let mut start = 0;
    while start < q_pos.len() {
        let mut end = start + 1;
        while end < q_pos.len() && q_pos[end] == q_pos[end - 1] + 1 {
            end += 1;
        }
        let run = Tensor::from_vec(q_pos[start..end].to_vec(), &[end - start])?;
        let qs = q.narrow(2, start, end - start)?.contiguous()?;
        let p = AttentionParams {
            q_pos: Some(run),
            k_pos: Some(k_pos.clone()),
            ..params.clone()
        };
        outs.push(qs.attention(&kw, &vw, &p)?);
        start = end;
    }
    match outs.len() {
        0 => Err(invalid("ring_attention", "no query rows")),
        1 => Ok(outs.remove(0)),
        _ => super::cat(&outs, 2),
    }
}
