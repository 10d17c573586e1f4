//! Joining and splitting: cat, stack, split, chunk.
//!
//! `cat` copies; `split` and `chunk` return views (narrow), so their gradients come from
//! `narrow`'s rule.

use crate::autograd::record;
use crate::error::{invalid, Error, Result};
use crate::layout::resolve_dim;
use crate::Tensor;

/// Joins tensors along an existing `dim`. All must share dtype, rank and every other dim. The
/// gradient of each input is its slice of the output's gradient.
pub fn cat(tensors: &[Tensor], dim: isize) -> Result<Tensor> {
    let first = tensors
        .first()
        .ok_or_else(|| invalid("cat", "needs at least one tensor"))?;
    let d = resolve_dim("cat", dim, first.rank())?;
    for t in tensors {
        let same_other_dims = t.rank() == first.rank()
            && t.shape()
                .iter()
                .zip(first.shape())
                .enumerate()
                .all(|(i, (a, b))| i == d || a == b);
        if !same_other_dims {
            return Err(Error::ShapeMismatch {
                op: "cat",
                lhs: first.shape().to_vec(),
                rhs: t.shape().to_vec(),
            });
        }
        if t.dtype() != first.dtype() {
            return Err(invalid(
                "cat",
                format!("dtypes differ: {} and {}", first.dtype(), t.dtype()),
            ));
        }
        if t.device() != first.device() {
            return Err(invalid(
                "cat",
                format!("devices differ: {} and {}", first.device(), t.device()),
            ));
        }
    }
    let detached: Vec<Tensor> = tensors.iter().map(|t| t.detach()).collect();
    let out = super::be(first)?.cat(&detached, d)?;
    let mut start = 0;
    let bounds: Vec<(usize, usize)> = tensors
        .iter()
        .map(|t| {
            let b = (start, t.shape()[d]);
            start += t.shape()[d];
            b
        })
        .collect();
    let inputs: Vec<&Tensor> = tensors.iter().collect();
    Ok(record("cat", out, &inputs, || {
        let need: Vec<bool> = tensors.iter().map(|t| t.requires_grad()).collect();
        move |g: &Tensor| {
            bounds
                .iter()
                .zip(&need)
                .map(|(&(s, len), &need)| {
                    if need {
                        Ok(Some(g.narrow(d as isize, s, len)?))
                    } else {
                        Ok(None)
                    }
                })
                .collect()
        }
    }))
}

/// Joins tensors of one shape along a new dim inserted at `dim` (which may equal their rank).
pub fn stack(tensors: &[Tensor], dim: isize) -> Result<Tensor> {
    let first = tensors
        .first()
        .ok_or_else(|| invalid("stack", "needs at least one tensor"))?;
    let d = resolve_dim("stack", dim, first.rank() + 1)?;
    if let Some(t) = tensors.iter().find(|t| t.shape() != first.shape()) {
        return Err(Error::ShapeMismatch {
            op: "stack",
            lhs: first.shape().to_vec(),
            rhs: t.shape().to_vec(),
        });
    }
    let expanded: Vec<Tensor> = tensors
        .iter()
        .map(|t| t.unsqueeze(d as isize))
        .collect::<Result<_>>()?;
    cat(&expanded, d as isize)
}

impl Tensor {
    /// Views of consecutive pieces of `dim` of `split_size` elements each (the last may be
    /// shorter), like PyTorch's `split(int)`.
    pub fn split(&self, split_size: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = resolve_dim("split", dim, self.rank())?;
        if split_size == 0 {
            return Err(invalid("split", "split_size must be positive"));
        }
        let n = self.shape()[d];
        let mut sizes = vec![split_size; n / split_size];
        if !n.is_multiple_of(split_size) {
            sizes.push(n % split_size);
        }
        self.split_with_sizes(&sizes, dim)
    }

    /// Views of consecutive pieces of `dim` with the given `sizes`, which must sum to its size.
    pub fn split_with_sizes(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        let d = resolve_dim("split", dim, self.rank())?;
        let total: usize = sizes.iter().sum();
        if total != self.shape()[d] {
            return Err(invalid(
                "split",
                format!(
                    "sizes {sizes:?} sum to {total}, but dim {d} of shape {:?} has {}",
                    self.shape(),
                    self.shape()[d]
                ),
            ));
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&len| {
                let piece = self.narrow(d as isize, start, len);
                start += len;
                piece
            })
            .collect()
    }

    /// `n` views along `dim` of `ceil(size / n)` elements each, like PyTorch's `chunk` (fewer
    /// than `n` pieces when the size does not allow `n`).
    pub fn chunk(&self, n: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = resolve_dim("chunk", dim, self.rank())?;
        if n == 0 {
            return Err(invalid("chunk", "the number of chunks must be positive"));
        }
        let size = self.shape()[d];
        if size == 0 {
            return Ok(vec![self.clone()]);
        }
        self.split(size.div_ceil(n), dim)
    }
}
