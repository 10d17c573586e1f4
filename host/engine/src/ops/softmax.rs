//! Softmax and log-softmax over any dim, with fused forward and backward kernels.

use super::{fused, require_float};
use crate::autograd::record;
use crate::error::Result;
use crate::layout::resolve_dim;
use crate::Tensor;

impl Tensor {
    /// `exp(x) / Σ exp(x)` over `dim` (negative counts from the end), max-shifted for stability.
    /// The last dim is the fast path; other dims are vectorized across the trailing dims.
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        softmax_op(self, dim, false)
    }

    /// `x - log Σ exp(x)` over `dim`, computed without forming the softmax.
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        softmax_op(self, dim, true)
    }
}

fn softmax_op(x: &Tensor, dim: isize, log: bool) -> Result<Tensor> {
    let name = if log { "log_softmax" } else { "softmax" };
    require_float(name, x)?;
    x.check_device(name)?;
    // A 0-d tensor behaves as a single-element row.
    if x.rank() == 0 {
        return softmax_op(&x.reshape(&[1])?, dim, log)?.reshape(&[]);
    }
    let d = resolve_dim(name, dim, x.rank())?;
    let out = fused(x)?.softmax(&x.detach(), d, log)?;
    Ok(record(name, out.clone(), &[x], || {
        let y = out.detach();
        move |g: &Tensor| Ok(vec![Some(fused(g)?.softmax_backward(&y, g, d, log)?)])
    }))
}
