//! Indexing ops: top-k, index_select, gather, scatter_add, where, masked_fill.
//!
//! Indices are i64 or i32 tensors; an index outside its dim is an [`Error::IndexOutOfRange`]
//! naming the op (negative indices are out of range, not counted from the end). Every kernel
//! accumulates in a fixed order, so results are identical with any thread count.

use super::be;
use crate::autograd::record;
use crate::cpu::float_out;
use crate::error::{invalid, Error, Result};
use crate::layout::{broadcast_shapes, resolve_dim};
use crate::{DType, Tensor};

fn check_index_dtype(op: &'static str, idx: &Tensor) -> Result<()> {
    match idx.dtype() {
        DType::I64 | DType::I32 => Ok(()),
        got => Err(Error::DType {
            op,
            got,
            expected: "i64 or i32 indices",
        }),
    }
}

/// Checks PyTorch's gather/scatter shape rule: same rank, and `idx` no larger than `other`
/// in every dim (every dim but `dim` when `except_dim`).
fn check_fits(
    op: &'static str,
    idx: &Tensor,
    other: &Tensor,
    dim: usize,
    except_dim: bool,
) -> Result<()> {
    let fits = idx.rank() == other.rank()
        && idx
            .shape()
            .iter()
            .zip(other.shape())
            .enumerate()
            .all(|(d, (&i, &o))| (except_dim && d == dim) || i <= o);
    if fits {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            op,
            lhs: other.shape().to_vec(),
            rhs: idx.shape().to_vec(),
        })
    }
}

impl Tensor {
    /// The `k` largest (`largest`) or smallest entries along `dim`, as `(values, indices)` with
    /// `indices` in i64. Equal values are taken lower index first (and, when `sorted`, listed in
    /// that order); NaN counts as larger than every number, as in PyTorch. With `sorted` the
    /// entries come best first; without it they come in increasing index order.
    ///
    /// Values keep `self`'s floating dtype (integer inputs give f32 values) and are
    /// differentiable: their gradient goes to the chosen positions.
    pub fn topk(
        &self,
        k: usize,
        dim: isize,
        largest: bool,
        sorted: bool,
    ) -> Result<(Tensor, Tensor)> {
        let d = resolve_dim("topk", dim, self.rank())?;
        if k > self.shape()[d] {
            return Err(invalid(
                "topk",
                format!(
                    "k = {k} exceeds size {} of dim {d} in shape {:?}",
                    self.shape()[d],
                    self.shape()
                ),
            ));
        }
        let (values, indices) = be(self)?.topk(&self.detach(), k, d, largest, sorted)?;
        let values = record("topk", values, &[self], || {
            let (shape, dtype, idx) = (self.shape().to_vec(), self.dtype(), indices.clone());
            move |g: &Tensor| {
                let zeros = Tensor::zeros_on(&shape, float_out(dtype), g.device())?;
                Ok(vec![Some(zeros.scatter_add(d as isize, &idx, g)?)])
            }
        });
        Ok((values, indices))
    }

    /// Slices of `dim` picked by the 1-d index `idx` (i64 or i32), in its order:
    /// `out[.., l, ..] = self[.., idx[l], ..]`. The gradient adds back into the picked slices.
    pub fn index_select(&self, dim: isize, idx: &Tensor) -> Result<Tensor> {
        let d = resolve_dim("index_select", dim, self.rank())?;
        check_index_dtype("index_select", idx)?;
        if idx.rank() != 1 {
            return Err(invalid(
                "index_select",
                format!("index must be 1-d, got shape {:?}", idx.shape()),
            ));
        }
        let out = be(self)?.index_select(&self.detach(), d, idx)?;
        Ok(record("index_select", out, &[self], || {
            let (shape, dtype, idx) = (self.shape().to_vec(), self.dtype(), idx.detach());
            move |g: &Tensor| {
                let zeros = Tensor::zeros_on(&shape, float_out(dtype), g.device())?;
                Ok(vec![Some(zeros.index_add(d as isize, &idx, g)?)])
            }
        }))
    }

    /// `self` plus `src` added into the slices of `dim` named by the 1-d index `idx`:
    /// `out[.., idx[l], ..] += src[.., l, ..]` (repeated indices accumulate, in index order).
    pub fn index_add(&self, dim: isize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
        let d = resolve_dim("index_add", dim, self.rank())?;
        check_index_dtype("index_add", idx)?;
        let mut want = self.shape().to_vec();
        want[d] = idx.numel();
        if idx.rank() != 1 || src.shape() != want.as_slice() {
            return Err(Error::ShapeMismatch {
                op: "index_add",
                lhs: want,
                rhs: src.shape().to_vec(),
            });
        }
        let out = be(self)?.index_add(&self.detach(), d, idx, &src.detach())?;
        Ok(record("index_add", out, &[self, src], || {
            let idx = idx.detach();
            move |g: &Tensor| {
                Ok(vec![
                    Some(g.clone()),
                    Some(g.index_select(d as isize, &idx)?),
                ])
            }
        }))
    }

    /// PyTorch's gather: `out[i][j][k] = self[i][idx[i][j][k]][k]` for `dim = 1` (likewise for
    /// other dims). `idx` has the rank of `self` and is no larger in any other dim; the output
    /// has `idx`'s shape. The gradient scatter-adds back.
    pub fn gather(&self, dim: isize, idx: &Tensor) -> Result<Tensor> {
        let d = resolve_dim("gather", dim, self.rank())?;
        check_index_dtype("gather", idx)?;
        check_fits("gather", idx, self, d, true)?;
        let out = be(self)?.gather(&self.detach(), d, idx)?;
        Ok(record("gather", out, &[self], || {
            let (shape, dtype, idx) = (self.shape().to_vec(), self.dtype(), idx.detach());
            move |g: &Tensor| {
                let zeros = Tensor::zeros_on(&shape, float_out(dtype), g.device())?;
                Ok(vec![Some(zeros.scatter_add(d as isize, &idx, g)?)])
            }
        }))
    }

    /// PyTorch's scatter_add: `self` plus `out[i][idx[i][j][k]][k] += src[i][j][k]` for
    /// `dim = 1`. Only the `idx`-shaped corner of `src` is used. Contributions to one position
    /// are summed in increasing source order (deterministic), in f32; the result has `self`'s
    /// floating dtype (f32 for integer `self`). Gradients flow to `self` and `src`.
    pub fn scatter_add(&self, dim: isize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
        let d = resolve_dim("scatter_add", dim, self.rank())?;
        check_index_dtype("scatter_add", idx)?;
        check_fits("scatter_add", idx, self, d, true)?;
        check_fits("scatter_add", idx, src, d, false)?;
        let out = be(self)?.scatter_add(&self.detach(), d, idx, &src.detach())?;
        Ok(record("scatter_add", out, &[self, src], || {
            let (src_shape, idx) = (src.shape().to_vec(), idx.detach());
            let need_src = src.requires_grad();
            move |g: &Tensor| {
                let gs = if !need_src {
                    None
                } else if idx.shape() == src_shape.as_slice() {
                    Some(g.gather(d as isize, &idx)?)
                } else {
                    // Positions of `src` outside the index's corner did not contribute. The
                    // corner is written on the host (copy_into is a host copy).
                    let full = Tensor::zeros(&src_shape, g.dtype());
                    let mut corner = full.clone();
                    for (dim, &n) in idx.shape().iter().enumerate() {
                        corner = corner.narrow(dim as isize, 0, n)?;
                    }
                    let picked = g.gather(d as isize, &idx)?.to_device(crate::Device::Cpu)?;
                    super::view::copy_into(&corner, &picked)?;
                    Some(full.to_device(g.device())?)
                };
                Ok(vec![Some(g.clone()), gs])
            }
        }))
    }

    /// Masked fill: `value` where `mask` (any dtype, nonzero = true, broadcast to this shape)
    /// holds, `self` elsewhere. The gradient passes where the mask is false.
    pub fn masked_fill(&self, mask: &Tensor, value: f32) -> Result<Tensor> {
        let shape = broadcast_shapes("masked_fill", self.shape(), mask.shape())?;
        if shape != self.shape() {
            return Err(Error::ShapeMismatch {
                op: "masked_fill",
                lhs: self.shape().to_vec(),
                rhs: mask.shape().to_vec(),
            });
        }
        let fill =
            Tensor::full(&[], value as f64, float_out(self.dtype())).to_device(self.device())?;
        where_(mask, &fill, self)
    }
}

/// Elementwise select: `a` where `cond` is nonzero, else `b`; all three broadcast together.
/// `cond` may have any dtype. The result has `a`'s dtype when `a` and `b` share a floating
/// dtype, else f32. Gradients go to `a` where `cond` holds and to `b` elsewhere.
pub fn where_(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let shape = broadcast_shapes("where", a.shape(), b.shape())?;
    let shape = broadcast_shapes("where", cond.shape(), &shape)?;
    same_device("where", &[cond, a, b])?;
    let dtype = if a.dtype() == b.dtype() {
        float_out(a.dtype())
    } else {
        DType::F32
    };
    // Convert before broadcasting, so a small mask or operand is converted, not its expansion.
    let as_f32 = |t: &Tensor| -> Result<Tensor> { t.f32_or_converted().expand(&shape) };
    let (c, ea, eb) = (as_f32(cond)?, as_f32(a)?, as_f32(b)?);
    let out = be(a)?.where_(&c, &ea, &eb, dtype)?;
    Ok(record("where", out, &[a, b], || {
        let (a_shape, b_shape) = (a.shape().to_vec(), b.shape().to_vec());
        let (need_a, need_b) = (a.requires_grad(), b.requires_grad());
        move |g: &Tensor| {
            let zero = Tensor::zeros_on(&[], g.dtype(), g.device())?;
            let ga = if need_a {
                Some(where_(&c, g, &zero)?.sum_to_shape(&a_shape)?)
            } else {
                None
            };
            let gb = if need_b {
                Some(where_(&c, &zero, g)?.sum_to_shape(&b_shape)?)
            } else {
                None
            };
            Ok(vec![ga, gb])
        }
    }))
}

/// Fails unless every tensor lives on the first one's device (a kernel reads all of them).
fn same_device(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    let device = ts[0].device();
    match ts.iter().find(|t| t.device() != device) {
        None => Ok(()),
        Some(t) => Err(Error::DeviceUnavailable {
            device: t.device(),
            reason: format!("{op}: operands on {device} and {}", t.device()),
        }),
    }
}
