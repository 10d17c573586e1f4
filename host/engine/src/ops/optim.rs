//! Optimizer updates as single fused, in-place, multi-tensor ops (not recorded by autograd).
//!
//! AdamW (Loshchilov & Hutter) over every parameter in one pass over memory, no temporaries:
//!
//! ```text
//! m ← β₁·m + (1−β₁)·g            v ← β₂·v + (1−β₂)·g²
//! θ ← θ·(1 − lr·λ) − lr · (m / (1−β₁ᵗ)) / (√(v / (1−β₂ᵗ)) + ε)
//! ```
//! computed in f32 in exactly this order, so it matches the same update composed from
//! elementwise ops bit for bit.

use crate::error::{invalid, Error, Result};
use crate::{DType, Tensor};

/// AdamW hyperparameters of one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate of this step.
    pub lr: f64,
    /// Decay rate of the first moment.
    pub beta1: f64,
    /// Decay rate of the second moment.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay λ.
    pub weight_decay: f64,
    /// The step being taken, counting from 1 (bias correction).
    pub step: u64,
}

/// One parameter's tensors for [`adamw_step`]: the parameter, its gradient, and its two
/// moment estimates (updated in place).
#[derive(Clone, Copy, Debug)]
pub struct AdamWTensors<'a> {
    /// The parameter θ (contiguous f32).
    pub param: &'a Tensor,
    /// Its gradient (f32, same shape).
    pub grad: &'a Tensor,
    /// First moment m (contiguous f32, same shape).
    pub exp_avg: &'a Tensor,
    /// Second moment v (contiguous f32, same shape).
    pub exp_avg_sq: &'a Tensor,
}

/// The f32 constants the kernel uses, derived once per step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamWConsts {
    pub b1: f32,
    pub one_minus_b1: f32,
    pub b2: f32,
    pub one_minus_b2: f32,
    pub inv_bc1: f32,
    pub inv_bc2: f32,
    pub eps: f32,
    pub lr: f32,
    pub decay: f32,
}

impl AdamW {
    pub(crate) fn consts(&self) -> AdamWConsts {
        let t = self.step.max(1) as i32;
        let (b1, b2) = (self.beta1, self.beta2);
        AdamWConsts {
            b1: b1 as f32,
            one_minus_b1: (1.0 - b1) as f32,
            b2: b2 as f32,
            one_minus_b2: (1.0 - b2) as f32,
            inv_bc1: (1.0 / (1.0 - b1.powi(t))) as f32,
            inv_bc2: (1.0 / (1.0 - b2.powi(t))) as f32,
            eps: self.eps as f32,
            lr: self.lr as f32,
            decay: (1.0 - self.lr * self.weight_decay) as f32,
        }
    }
}

/// Applies one AdamW step to every parameter of `groups` in place, as one parallel pass.
/// Every tensor must be f32 on the CPU, each group's four of one shape, the parameter and
/// moments contiguous, and no two tensors may share storage.
pub fn adamw_step(groups: &[AdamWTensors<'_>], hp: &AdamW) -> Result<()> {
    const OP: &str = "adamw";
    let mut seen = std::collections::HashSet::new();
    for g in groups {
        for t in [g.param, g.grad, g.exp_avg, g.exp_avg_sq] {
            if t.device() != groups[0].param.device() {
                return Err(invalid(
                    OP,
                    format!(
                        "tensors on {} and {}: every tensor must be on one device",
                        groups[0].param.device(),
                        t.device()
                    ),
                ));
            }
            if t.dtype() != DType::F32 {
                return Err(Error::DType {
                    op: OP,
                    got: t.dtype(),
                    expected: "f32 (parameters, gradients and moments)",
                });
            }
            if t.shape() != g.param.shape() {
                return Err(Error::ShapeMismatch {
                    op: OP,
                    lhs: g.param.shape().to_vec(),
                    rhs: t.shape().to_vec(),
                });
            }
            if !seen.insert(t.storage_id()) {
                return Err(invalid(
                    OP,
                    "two of the tensors share storage (each parameter, gradient and moment must be its own tensor)",
                ));
            }
        }
        for t in [g.param, g.exp_avg, g.exp_avg_sq] {
            if !t.is_contiguous() {
                return Err(invalid(
                    OP,
                    format!(
                        "updates in place need contiguous tensors; one of shape {:?} is strided",
                        t.shape()
                    ),
                ));
            }
        }
    }
    let device = groups
        .first()
        .map_or(crate::Device::Cpu, |g| g.param.device());
    crate::backend::optim_backend_for(device)?.adamw(groups, hp)
}
