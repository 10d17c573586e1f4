//! Mixture-of-experts helpers: the grouped matrix product over rows sorted by expert, and the
//! routing bookkeeping (histogram, sort by expert, inverse permutation) that feeds it.

use super::be;
use crate::autograd::record;
use crate::error::{invalid, Error, Result};
use crate::{DType, Tensor};

/// Rows per expert for [`Tensor::grouped_matmul`]: a slice of counts or a 1-d integer tensor.
pub trait ExpertCounts {
    /// The counts as `usize`, or why they are not valid counts.
    fn to_counts(&self) -> Result<Vec<usize>>;
}

impl ExpertCounts for [usize] {
    fn to_counts(&self) -> Result<Vec<usize>> {
        Ok(self.to_vec())
    }
}

impl ExpertCounts for Vec<usize> {
    fn to_counts(&self) -> Result<Vec<usize>> {
        Ok(self.clone())
    }
}

impl<const N: usize> ExpertCounts for [usize; N] {
    fn to_counts(&self) -> Result<Vec<usize>> {
        Ok(self.to_vec())
    }
}

impl ExpertCounts for Tensor {
    fn to_counts(&self) -> Result<Vec<usize>> {
        if !matches!(self.dtype(), DType::I64 | DType::I32) || self.rank() != 1 {
            return Err(invalid(
                "grouped_matmul",
                format!(
                    "counts must be a 1-d i64/i32 tensor, got {} of shape {:?}",
                    self.dtype(),
                    self.shape()
                ),
            ));
        }
        self.to_vec::<i64>()
            .into_iter()
            .map(|c| {
                usize::try_from(c)
                    .map_err(|_| invalid("grouped_matmul", format!("negative count {c}")))
            })
            .collect()
    }
}

impl Tensor {
    /// The MoE expert product: for `self = x [N, K]` with rows sorted by expert and
    /// `w [E, K, M]`, the first `counts[0]` rows are multiplied by `w[0]`, the next `counts[1]`
    /// by `w[1]`, and so on, giving `[N, M]`. `counts` has `E` entries summing to `N`.
    /// Gradients flow to `x` and `w`; results are identical with any thread count. Inside an
    /// autocast region both operands are cast to its dtype first, as `matmul` does.
    pub fn grouped_matmul<C: ExpertCounts + ?Sized>(
        &self,
        w: &Tensor,
        counts: &C,
    ) -> Result<Tensor> {
        self.grouped(w, counts.to_counts()?, false)
    }

    /// [`Tensor::grouped_matmul`] with each expert's weight stored `[out, in]`, as a stack of
    /// `Linear` weights (`w [E, M, K]`, Hugging Face's fused-expert layout): row block `e` of
    /// `x [N, K]` times `w[e]ᵀ`, giving `[N, M]`. No transposed copy is made.
    pub fn grouped_matmul_nt<C: ExpertCounts + ?Sized>(
        &self,
        w: &Tensor,
        counts: &C,
    ) -> Result<Tensor> {
        self.grouped(w, counts.to_counts()?, true)
    }

    /// `x · w[e]` per row block, or `x · w[e]ᵀ` when `nt`.
    fn grouped(&self, w: &Tensor, counts: Vec<usize>, nt: bool) -> Result<Tensor> {
        const OP: &str = "grouped_matmul";
        let k_dim = if nt { 2 } else { 1 };
        if self.rank() != 2 || w.rank() != 3 || self.shape()[1] != w.shape()[k_dim] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.shape().to_vec(),
                rhs: w.shape().to_vec(),
            });
        }
        if counts.len() != w.shape()[0] {
            return Err(invalid(
                OP,
                format!(
                    "{} counts for {} experts (weights of shape {:?})",
                    counts.len(),
                    w.shape()[0],
                    w.shape()
                ),
            ));
        }
        let total: usize = counts.iter().sum();
        if total != self.shape()[0] {
            return Err(invalid(
                OP,
                format!(
                    "counts {counts:?} sum to {total}, but x of shape {:?} has {} rows",
                    self.shape(),
                    self.shape()[0]
                ),
            ));
        }
        if let Some(dt) = crate::autocast::autocast_dtype() {
            // Mixed precision as for `matmul`: both operands in the low precision (the casts
            // carry the gradients back to f32 master weights), f32 accumulation inside.
            let cast = |t: &Tensor| t.dtype().is_float() && t.dtype() != dt;
            if cast(self) || cast(w) {
                let _off = crate::autocast::set_autocast(None);
                return self.to_dtype(dt)?.grouped(&w.to_dtype(dt)?, counts, nt);
            }
        }
        let out = be(self)?.grouped_matmul(&self.detach(), &w.detach(), &counts, nt)?;
        Ok(record(OP, out, &[self, w], || {
            let (x, w_saved) = (self.detach(), w.detach());
            let (need_x, need_w) = (self.requires_grad(), w.requires_grad());
            move |g: &Tensor| {
                // dx = g · w[e]ᵀ (or g · w[e] when the forward read w transposed);
                // dw[e] = x_eᵀ · g_e (or its transpose g_eᵀ · x_e, in w's own layout).
                let gx = if need_x {
                    Some(be(g)?.grouped_matmul(g, &w_saved, &counts, !nt)?)
                } else {
                    None
                };
                let gw = if !need_w {
                    None
                } else if nt {
                    Some(be(g)?.grouped_matmul_weight_grad(g, &x, &counts)?)
                } else {
                    Some(be(g)?.grouped_matmul_weight_grad(&x, g, &counts)?)
                };
                Ok(vec![gx, gw])
            }
        }))
    }
}

/// How top-k routed tokens are laid out by expert (see [`sort_by_expert`]).
#[derive(Clone, Debug)]
pub struct ExpertRouting {
    /// `[N * k]` i64: for each sorted slot, the flat (token * k + choice) assignment it holds.
    /// Assignments of one expert keep their original order (a stable sort).
    pub order: Tensor,
    /// `[N * k]` i64: for each sorted slot, the token (row of x) it holds (`order / k`); feed it
    /// to `index_select(0, ..)` to build the expert-sorted input.
    pub token: Tensor,
    /// `[N * k]` i64: for each flat assignment, the sorted slot holding it (inverse of `order`);
    /// `index_select(0, ..)` with it brings expert outputs back to assignment order.
    pub inverse: Tensor,
    /// Assignments per expert, for [`Tensor::grouped_matmul`].
    pub counts: Vec<usize>,
}

/// Counts of each value `0..num_bins` in an integer tensor, as an i64 `[num_bins]` tensor.
/// A value outside `0..num_bins` is an [`Error::IndexOutOfRange`].
pub fn histogram(ids: &Tensor, num_bins: usize) -> Result<Tensor> {
    let counts = count_ids("histogram", ids, num_bins)?.1;
    let v: Vec<i64> = counts.iter().map(|&c| c as i64).collect();
    Tensor::from_vec(v, &[num_bins])
}

fn count_ids(op: &'static str, ids: &Tensor, num_bins: usize) -> Result<(Vec<i64>, Vec<usize>)> {
    if !matches!(ids.dtype(), DType::I64 | DType::I32) {
        return Err(Error::DType {
            op,
            got: ids.dtype(),
            expected: "i64 or i32 expert ids",
        });
    }
    let v = ids.to_vec::<i64>();
    let mut counts = vec![0usize; num_bins];
    for &e in &v {
        if e < 0 || e as usize >= num_bins {
            return Err(Error::IndexOutOfRange {
                op,
                index: e,
                size: num_bins,
            });
        }
        counts[e as usize] += 1;
    }
    Ok((v, counts))
}

/// Groups top-k routing choices `expert_ids [N, k]` (i64/i32) by expert with a stable counting
/// sort: the permutation, its inverse, the token of each sorted slot and the per-expert counts.
pub fn sort_by_expert(expert_ids: &Tensor, num_experts: usize) -> Result<ExpertRouting> {
    if expert_ids.rank() != 2 {
        return Err(invalid(
            "sort_by_expert",
            format!(
                "expert ids must be [tokens, k], got shape {:?}",
                expert_ids.shape()
            ),
        ));
    }
    let k = expert_ids.shape()[1];
    let (ids, counts) = count_ids("sort_by_expert", expert_ids, num_experts)?;
    let mut next = Vec::with_capacity(num_experts);
    let mut start = 0;
    for &c in &counts {
        next.push(start);
        start += c;
    }
    let n = ids.len();
    let (mut order, mut inverse) = (vec![0i64; n], vec![0i64; n]);
    for (a, &e) in ids.iter().enumerate() {
        let slot = next[e as usize];
        next[e as usize] += 1;
        order[slot] = a as i64;
        inverse[a] = slot as i64;
    }
    let token: Vec<i64> = order.iter().map(|&a| a / k.max(1) as i64).collect();
    Ok(ExpertRouting {
        order: Tensor::from_vec(order, &[n])?,
        token: Tensor::from_vec(token, &[n])?,
        inverse: Tensor::from_vec(inverse, &[n])?,
        counts,
    })
}
