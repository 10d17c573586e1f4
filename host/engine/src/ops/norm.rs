//! RMSNorm and LayerNorm over the last dim, each one fused forward and one fused backward kernel.
//! Weight/bias gradients are reduced in a fixed row-block order (bitwise reproducible).

use super::{fused, require_float};
use crate::autograd::record;
use crate::error::{invalid, Error, Result};
use crate::Tensor;

/// Checks `x` (rank >= 1, float) and an optional per-feature parameter of shape `[D]`.
fn check(op: &'static str, x: &Tensor, params: &[Option<&Tensor>]) -> Result<()> {
    require_float(op, x)?;
    x.check_device(op)?;
    if x.rank() == 0 {
        return Err(invalid(op, "needs at least one dim to normalize over"));
    }
    let d = x.shape()[x.rank() - 1];
    for p in params.iter().flatten() {
        require_float(op, p)?;
        if p.shape() != [d] {
            return Err(Error::ShapeMismatch {
                op,
                lhs: x.shape().to_vec(),
                rhs: p.shape().to_vec(),
            });
        }
    }
    Ok(())
}

impl Tensor {
    /// RMSNorm over the last dim: `x / sqrt(mean(x²) + eps) * weight` (`weight: [D]`, or none
    /// for a unit scale). Gradients flow to `x` and `weight`.
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        check("rms_norm", self, &[weight])?;
        let w = weight.map(|w| w.detach());
        let (out, rstd) = fused(self)?.rms_norm(&self.detach(), w.as_ref(), eps)?;
        let mut inputs = vec![self];
        inputs.extend(weight);
        Ok(record("rms_norm", out, &inputs, || {
            let x = self.detach();
            let need_w = weight.is_some_and(|w| w.requires_grad());
            move |g: &Tensor| {
                let (dx, dw) = fused(g)?.rms_norm_backward(&x, w.as_ref(), &rstd, g, need_w)?;
                let mut grads = vec![Some(dx)];
                if w.is_some() {
                    grads.push(dw);
                }
                Ok(grads)
            }
        }))
    }

    /// LayerNorm over the last dim: `(x - mean) / sqrt(var + eps) * weight + bias` with the
    /// biased variance (as PyTorch); `weight`/`bias` are `[D]` or none. Gradients flow to all.
    pub fn layer_norm(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        check("layer_norm", self, &[weight, bias])?;
        let w = weight.map(|w| w.detach());
        let b = bias.map(|b| b.detach());
        let (out, mean, rstd) =
            fused(self)?.layer_norm(&self.detach(), w.as_ref(), b.as_ref(), eps)?;
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        Ok(record("layer_norm", out, &inputs, || {
            let x = self.detach();
            let need = (
                weight.is_some_and(|w| w.requires_grad()),
                bias.is_some_and(|b| b.requires_grad()),
            );
            let (has_w, has_b, b_dtype) = (w.is_some(), b.is_some(), bias.map(|b| b.dtype()));
            move |g: &Tensor| {
                let (dx, dw, db) =
                    fused(g)?.layer_norm_backward(&x, w.as_ref(), &mean, &rstd, g, need)?;
                let mut grads = vec![Some(dx)];
                if has_w {
                    grads.push(dw);
                }
                if has_b {
                    grads.push(match (db, b_dtype) {
                        (Some(db), Some(dt)) => Some(db.to_dtype(dt)?),
                        (db, _) => db,
                    });
                }
                Ok(grads)
            }
        }))
    }
}
