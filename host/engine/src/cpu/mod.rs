//! The CPU backend: rayon's persistent thread pool, runtime SIMD dispatch, `gemm` for matrix
//! products. Floating kernels compute in f32 whatever the storage dtype.
//!
//! Determinism: work is split into chunks whose boundaries depend on sizes only, never on the
//! number of threads, and every reduction sums in a fixed order, so results are bitwise
//! identical with any thread count.

mod attention;
mod elementwise;
mod matmul;
mod reduce;
pub(crate) mod simd;

use crate::backend::Backend;
use crate::error::Result;
use crate::ops::{BinaryOp, ReduceOp, UnaryOp};
use crate::storage::Storage;
use crate::{DType, Tensor};

/// Elements per parallel task in elementwise kernels (fixed, for determinism).
pub(crate) const CHUNK: usize = 1 << 14;

/// The CPU backend.
pub struct CpuBackend;

/// A contiguous tensor of `dtype` from f32 results (converted when `dtype` is not f32).
pub(crate) fn finish(out: Storage, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let t = Tensor::from_storage(out, shape)?;
    Ok(if dtype == DType::F32 {
        t
    } else {
        t.materialize(dtype)
    })
}

/// The dtype a floating op returns for an input dtype (integers compute and return as f32).
pub(crate) fn float_out(dtype: DType) -> DType {
    if dtype.is_float() {
        dtype
    } else {
        DType::F32
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn unary(&self, op: UnaryOp, x: &Tensor) -> Result<Tensor> {
        elementwise::unary(op, x)
    }
    fn unary_grad(&self, op: UnaryOp, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
        elementwise::unary_grad(op, x, grad)
    }
    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        elementwise::binary(op, a, b)
    }
    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        elementwise::map(x, move |v| v * mul + add)
    }
    fn powf(&self, x: &Tensor, e: f32) -> Result<Tensor> {
        if e == 2.0 {
            return elementwise::map(x, |v| v * v);
        }
        elementwise::map(x, move |v| v.powf(e))
    }
    fn clamp(&self, x: &Tensor, lo: f32, hi: f32) -> Result<Tensor> {
        elementwise::map(x, move |v| v.max(lo).min(hi))
    }
    fn reduce(&self, op: ReduceOp, x: &Tensor, dim: usize) -> Result<Tensor> {
        reduce::reduce(op, x, dim)
    }
    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        matmul::matmul(a, b)
    }
    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        Ok(x.materialize(dtype))
    }
    fn add_assign(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        elementwise::add_assign(dst, src)
    }
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&Tensor>,
        spec: &crate::ops::AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        attention::forward(q, k, v, sinks, spec)
    }
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
    ) -> Result<crate::ops::AttentionGrads> {
        attention::backward(q, k, v, sinks, out, lse, grad, spec)
    }
}
