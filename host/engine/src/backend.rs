//! The compute backend trait: the kernels behind every op. Ops (in `ops/`) own shape rules and
//! gradients; a backend only computes. Inputs arrive already broadcast (as strided views) and
//! outputs are fresh contiguous tensors without autograd.

use crate::error::{Error, Result};
use crate::ops::{BinaryOp, ReduceOp, UnaryOp};
use crate::{DType, Device, Tensor};

/// Kernels a device must provide.
pub trait Backend: Send + Sync {
    /// A short name (`cpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// Elementwise `op(x)`.
    fn unary(&self, op: UnaryOp, x: &Tensor) -> Result<Tensor>;
    /// `grad * op'(x)`, elementwise.
    fn unary_grad(&self, op: UnaryOp, x: &Tensor, grad: &Tensor) -> Result<Tensor>;
    /// Elementwise `op(a, b)` of two tensors of the same shape (either may be a broadcast view).
    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor>;
    /// `x * mul + add`, elementwise.
    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor>;
    /// `x ^ e`, elementwise.
    fn powf(&self, x: &Tensor, e: f32) -> Result<Tensor>;
    /// `x` clamped to `[lo, hi]`.
    fn clamp(&self, x: &Tensor, lo: f32, hi: f32) -> Result<Tensor>;
    /// Reduces dim `dim` (kept with size 1 in the output).
    fn reduce(&self, op: ReduceOp, x: &Tensor, dim: usize) -> Result<Tensor>;
    /// Batched matrix product of `[batch.., m, k]` and `[batch.., k, n]` with equal batch dims.
    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;
    /// A contiguous copy in `dtype`.
    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor>;
    /// `dst += src` in place (same shape; `dst` contiguous).
    fn add_assign(&self, dst: &Tensor, src: &Tensor) -> Result<()>;
    /// Fused attention forward: the output `[B, Hq, Tq, Dv]` (in `q`'s dtype) and the per-row
    /// logsumexp `[B, Hq, Tq]` (f32) that the backward pass recomputes probabilities from.
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&Tensor>,
        spec: &crate::ops::AttentionSpec,
    ) -> Result<(Tensor, Tensor)>;
    /// Fused attention backward from the forward's output and logsumexp.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&Tensor>,
        out: &Tensor,
        lse: &Tensor,
        grad: &Tensor,
        spec: &crate::ops::AttentionSpec,
    ) -> Result<crate::ops::AttentionGrads>;
}

/// The backend computing on `device`, or why none can.
pub fn backend_for(device: Device) -> Result<&'static dyn Backend> {
    match device {
        Device::Cpu => Ok(&crate::cpu::CpuBackend),
        d @ Device::Cuda(_) => Err(Error::DeviceUnavailable {
            device: d,
            reason: "this build has no CUDA backend yet".into(),
        }),
    }
}
