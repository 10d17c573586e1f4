//! Mixture-of-experts helpers: the grouped matrix product over rows sorted by expert, and the
//! routing bookkeeping (histogram, sort by expert, inverse permutation) that feeds it.

use super::be;
use crate::autograd::record;
use crate::error::{invalid, Error, Result};
use crate::{DType, Device, Tensor};

/// Rows per expert for [`Tensor::grouped_matmul`]: a slice of counts or a 1-d integer tensor
/// (on a GPU, such as [`ExpertRouting::counts`], it stays there: the product reads it on the
/// device).
pub trait ExpertCounts {
    /// The counts as a 1-d i64 tensor on `device`, or why they are not counts.
    fn counts_on(&self, device: Device) -> Result<Tensor>;
}

/// Host counts as an i64 tensor on `device` (on a GPU with its host copy, so checks read it
/// without a wait).
fn host_counts(counts: &[usize], device: Device) -> Result<Tensor> {
    let v: Vec<i64> = counts.iter().map(|&c| c as i64).collect();
    Tensor::from_vec(v, &[counts.len()])?.to_device(device)
}

impl ExpertCounts for [usize] {
    fn counts_on(&self, device: Device) -> Result<Tensor> {
        host_counts(self, device)
    }
}

impl ExpertCounts for Vec<usize> {
    fn counts_on(&self, device: Device) -> Result<Tensor> {
        host_counts(self, device)
    }
}

impl<const N: usize> ExpertCounts for [usize; N] {
    fn counts_on(&self, device: Device) -> Result<Tensor> {
        host_counts(self, device)
    }
}

impl ExpertCounts for Tensor {
    fn counts_on(&self, device: Device) -> Result<Tensor> {
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
        let c = if self.dtype() == DType::I64 {
            self.clone()
        } else {
            self.to_dtype(DType::I64)?
        };
        c.to_device(device)
    }
}

/// The counts as `usize` when their values are on the host ([`Tensor::host_resident`]), after
/// checking none is negative; `None` for counts only the device holds.
fn counts_on_host(counts: &Tensor) -> Result<Option<Vec<usize>>> {
    if !counts.host_resident() {
        return Ok(None);
    }
    counts
        .to_vec::<i64>()
        .into_iter()
        .map(|c| {
            usize::try_from(c).map_err(|_| invalid("grouped_matmul", format!("negative count {c}")))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
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
        self.grouped(w, counts.counts_on(self.device())?, false)
    }

    /// [`Tensor::grouped_matmul`] with each expert's weight stored `[out, in]`, as a stack of
    /// `Linear` weights (`w [E, M, K]`, Hugging Face's fused-expert layout): row block `e` of
    /// `x [N, K]` times `w[e]ᵀ`, giving `[N, M]`. No transposed copy is made.
    pub fn grouped_matmul_nt<C: ExpertCounts + ?Sized>(
        &self,
        w: &Tensor,
        counts: &C,
    ) -> Result<Tensor> {
        self.grouped(w, counts.counts_on(self.device())?, true)
    }

    /// `x · w[e]` per row block, or `x · w[e]ᵀ` when `nt`. Counts on the host are checked
    /// against `x`'s rows; counts only the device holds are trusted (the kernel never reads
    /// past `x` whatever they are), so the product never waits for the device.
    fn grouped(&self, w: &Tensor, counts: Tensor, nt: bool) -> Result<Tensor> {
        const OP: &str = "grouped_matmul";
        let k_dim = if nt { 2 } else { 1 };
        if self.rank() != 2 || w.rank() != 3 || self.shape()[1] != w.shape()[k_dim] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.shape().to_vec(),
                rhs: w.shape().to_vec(),
            });
        }
        if counts.numel() != w.shape()[0] {
            return Err(invalid(
                OP,
                format!(
                    "{} counts for {} experts (weights of shape {:?})",
                    counts.numel(),
                    w.shape()[0],
                    w.shape()
                ),
            ));
        }
        if let Some(host) = counts_on_host(&counts)? {
            let total: usize = host.iter().sum();
            if total != self.shape()[0] {
                return Err(invalid(
                    OP,
                    format!(
                        "counts {host:?} sum to {total}, but x of shape {:?} has {} rows",
                        self.shape(),
                        self.shape()[0]
                    ),
                ));
            }
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

/// How top-k routed tokens are laid out by expert (see [`sort_by_expert`]). Every tensor is
/// on the expert ids' device: on a GPU the routing never leaves it.
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
    /// `[E]` i64: assignments per expert, for [`Tensor::grouped_matmul`].
    pub counts: Tensor,
}

impl ExpertRouting {
    /// The counts on the host (a device→host copy when the routing was made on a GPU): for
    /// what must know sizes on the host, such as the expert-parallel exchange.
    pub fn host_counts(&self) -> Vec<usize> {
        crate::cpu::moe_route::host_counts(&self.counts)
    }
}

/// Counts of each value `0..num_bins` in an integer tensor, as an i64 `[num_bins]` tensor on
/// its device. A value outside `0..num_bins` is an [`Error::IndexOutOfRange`] when the values
/// are on the host (see [`sort_by_expert`]).
pub fn histogram(ids: &Tensor, num_bins: usize) -> Result<Tensor> {
    let flat = ids.reshape(&[ids.numel(), 1])?;
    Ok(sort_by_expert_in("histogram", &flat, num_bins)?.counts)
}

/// Fails unless every id is in `0..num_bins`.
fn check_ids(op: &'static str, ids: &Tensor, num_bins: usize) -> Result<()> {
    match ids
        .to_vec::<i64>()
        .into_iter()
        .find(|&e| e < 0 || e as usize >= num_bins)
    {
        Some(e) => Err(Error::IndexOutOfRange {
            op,
            index: e,
            size: num_bins,
        }),
        None => Ok(()),
    }
}

/// Groups top-k routing choices `expert_ids [N, k]` (i64/i32) by expert with a stable counting
/// sort: the permutation, its inverse, the token of each sorted slot and the per-expert counts,
/// on the ids' device (a GPU sorts with kernels: nothing comes back to the host). Ids are
/// checked to be in `0..num_experts` when their values are on the host; ids a GPU computed
/// (a router's top-k) are in range by construction, and an out-of-range one is never used to
/// index memory.
pub fn sort_by_expert(expert_ids: &Tensor, num_experts: usize) -> Result<ExpertRouting> {
    sort_by_expert_in("sort_by_expert", expert_ids, num_experts)
}

fn sort_by_expert_in(
    op: &'static str,
    expert_ids: &Tensor,
    num_experts: usize,
) -> Result<ExpertRouting> {
    if expert_ids.rank() != 2 {
        return Err(invalid(
            op,
            format!(
                "expert ids must be [tokens, k], got shape {:?}",
                expert_ids.shape()
            ),
        ));
    }
    if !matches!(expert_ids.dtype(), DType::I64 | DType::I32) {
        return Err(Error::DType {
            op,
            got: expert_ids.dtype(),
            expected: "i64 or i32 expert ids",
        });
    }
    if expert_ids.host_resident() {
        check_ids(op, expert_ids, num_experts)?;
    }
    let [order, token, inverse, counts] =
        be(expert_ids)?.sort_by_expert(&expert_ids.detach(), num_experts)?;
    Ok(ExpertRouting {
        order,
        token,
        inverse,
        counts,
    })
}
