//! SwiGLU, the gated feed-forward activation of Llama: `silu(gate) ⊙ up`, one fused kernel
//! forward and one backward (instead of silu, mul, and three backward ops with temporaries).
//! Computed in f32 in the same order as the composed ops, so results match them bit for bit.

use super::require_float;
use crate::autograd::record;
use crate::error::{Error, Result};
use crate::Tensor;

/// The fused-kernel backend for `t`'s device.
fn fusion(t: &Tensor) -> Result<&'static dyn crate::backend::FusionBackend> {
    crate::backend::fusion_backend_for(t.device())
}

impl Tensor {
    /// `silu(self) * up` elementwise (`self` is the gate); both of one shape. Gradients flow
    /// to both.
    pub fn swiglu(&self, up: &Tensor) -> Result<Tensor> {
        const OP: &str = "swiglu";
        require_float(OP, self)?;
        require_float(OP, up)?;
        self.check_device(OP)?;
        if self.shape() != up.shape() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.shape().to_vec(),
                rhs: up.shape().to_vec(),
            });
        }
        let out = fusion(self)?.swiglu(&self.detach(), &up.detach())?;
        Ok(record(OP, out, &[self, up], || {
            let (gate, up) = (self.detach(), up.detach());
            move |g: &Tensor| {
                let (dg, du) = fusion(g)?.swiglu_backward(&gate, &up, g)?;
                Ok(vec![Some(dg), Some(du)])
            }
        }))
    }
}
