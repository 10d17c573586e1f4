//! Matrix products with broadcasting batch dims.

use super::be;
use crate::autograd::{record, SplitRule};
use crate::error::{Error, Result};
use crate::layout::broadcast_shapes;
use crate::Tensor;

impl Tensor {
    /// `self @ rhs` for `[.., m, k] @ [.., k, n]` with broadcast batch dims.
    ///
    /// A 2-d `rhs` against a batched `self` (the `x @ W` of a linear layer) runs as one large
    /// product over all rows, which is what makes linear layers fast.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        let mismatch = || Error::ShapeMismatch {
            op: "matmul",
            lhs: self.shape().to_vec(),
            rhs: rhs.shape().to_vec(),
        };
        if self.rank() < 2 || rhs.rank() < 2 {
            return Err(mismatch());
        }
        let (ra, rb) = (self.rank(), rhs.rank());
        let (m, k) = (self.shape()[ra - 2], self.shape()[ra - 1]);
        let (k2, n) = (rhs.shape()[rb - 2], rhs.shape()[rb - 1]);
        if k != k2 {
            return Err(mismatch());
        }
        self.check_device("matmul")?;
        if let Some(dt) = crate::autocast::autocast_dtype() {
            let cast = |t: &Tensor| t.dtype().is_float() && t.dtype() != dt;
            if cast(self) || cast(rhs) {
                let _off = crate::autocast::set_autocast(None);
                // A transposed weight is cast in its own layout and transposed back, so the
                // product still reads it transposed (and its gradient comes back in place).
                let cast_to = |t: &Tensor| {
                    if is_transposed_matrix(t) {
                        t.transpose(0, 1)?.to_dtype(dt)?.transpose(0, 1)
                    } else {
                        t.to_dtype(dt)
                    }
                };
                return cast_to(self)?.matmul(&cast_to(rhs)?);
            }
        }
        let out = if rb == 2 && ra > 2 {
            let rows = self.numel() / k.max(1);
            let a2 = match self.layout().reshape(&[rows, k]) {
                Some(l) => self.with_layout(l),
                None => self.detach().contiguous()?.reshape(&[rows, k])?,
            };
            let mut shape = self.shape()[..ra - 1].to_vec();
            shape.push(n);
            // The row-tiled product is a CPU kernel; the CUDA backend's products are
            // batch-invariant in this mode by themselves (cuda/kernels/gemm.cu).
            if crate::invariant::batch_invariant() && self.device() == crate::Device::Cpu {
                crate::cpu::matmul_row_tiles(&a2, &rhs.detach())?.reshape(&shape)?
            } else {
                be(self)?.matmul(&a2, &rhs.detach())?.reshape(&shape)?
            }
        } else {
            let batch = broadcast_shapes("matmul", &self.shape()[..ra - 2], &rhs.shape()[..rb - 2])
                .map_err(|_| mismatch())?;
            let mut sa = batch.clone();
            sa.extend([m, k]);
            let mut sb = batch.clone();
            sb.extend([k, n]);
            be(self)?.matmul(&self.detach().expand(&sa)?, &rhs.detach().expand(&sb)?)?
        };
        Ok(record("matmul", out, &[self, rhs], || {
            let (need_a, need_b) = (self.requires_grad(), rhs.requires_grad());
            let (a, b) = (self.detach(), rhs.detach());
            // The two gradients are separate products, so a split backward computes `ga` in
            // its input pass and `gb` (a weight's) in its weight pass.
            SplitRule(move |g: &Tensor, want: &[bool]| {
                let wants = |i: usize| want.is_empty() || want[i];
                let (need_a, need_b) = (need_a && wants(0), need_b && wants(1));
                let ga = if need_a {
                    Some(g.matmul(&b.transpose(-1, -2)?)?.sum_to_shape(a.shape())?)
                } else {
                    None
                };
                let gb = if !need_b {
                    None
                } else if b.rank() == 2 && a.rank() > 2 {
                    let k = a.shape()[a.rank() - 1];
                    let n = g.shape()[g.rank() - 1];
                    let a2 = a.reshape(&[a.numel() / k.max(1), k])?;
                    let g2 = g.reshape(&[g.numel() / n.max(1), n])?;
                    if is_transposed_matrix(&b) {
                        // `b` is a weight `w [n, k]` read as `wᵀ` (a linear layer): compute
                        // `dw = gᵀ·a` in w's own layout, so the gradient reaches the weight
                        // contiguous instead of as a strided view that must be copied.
                        Some(g2.transpose(0, 1)?.matmul(&a2)?.transpose(0, 1)?)
                    } else {
                        Some(a2.transpose(0, 1)?.matmul(&g2)?)
                    }
                } else {
                    Some(a.transpose(-1, -2)?.matmul(g)?.sum_to_shape(b.shape())?)
                };
                Ok(vec![ga, gb])
            })
        }))
    }
}

/// A 2-d view whose transpose is contiguous (strides `[1, rows]`).
fn is_transposed_matrix(t: &Tensor) -> bool {
    let (s, st) = (t.shape(), t.layout().strides());
    t.rank() == 2 && s[0] > 1 && s[1] > 1 && st[0] == 1 && st[1] == s[0]
}
