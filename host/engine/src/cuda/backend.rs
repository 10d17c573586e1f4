//! `CudaBackend`: the [`Backend`] kernels on a GPU. Elementwise ops, reductions, casts and
//! matmul (cuBLAS) are here; index, selection and dropout kernels in `index.rs`, MoE routing and
//! the grouped GEMM in `moe.rs`, attention in `attention.rs`, fused transformer kernels in
//! `fused.rs`. An op without a CUDA kernel returns an error naming it (never a panic).

use super::launch::{
    any_suffix, check_rows, empty, float_suffix, gpu_of, grid, launch, not_yet, per_row, ptr,
    storage_ptr, Strided,
};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ops::{BinaryOp, ReduceOp, UnaryOp};
use crate::{DType, Tensor};

/// The CUDA backend (stateless: each tensor names its device).
pub struct CudaBackend;

fn unary_code(op: UnaryOp) -> i32 {
    match op {
        UnaryOp::Neg => 0,
        UnaryOp::Exp => 1,
        UnaryOp::Log => 2,
        UnaryOp::Sqrt => 3,
        UnaryOp::Rsqrt => 4,
        UnaryOp::Tanh => 5,
        UnaryOp::Sigmoid => 6,
        UnaryOp::Silu => 7,
        UnaryOp::Gelu => 8,
        UnaryOp::GeluErf => 9,
        UnaryOp::Relu => 10,
        UnaryOp::Softplus => 11,
        UnaryOp::Abs => 12,
        UnaryOp::Sin => 13,
        UnaryOp::Cos => 14,
    }
}

fn binary_code(op: BinaryOp) -> i32 {
    match op {
        BinaryOp::Add => 0,
        BinaryOp::Sub => 1,
        BinaryOp::Mul => 2,
        BinaryOp::Div => 3,
        BinaryOp::Maximum => 4,
        BinaryOp::Minimum => 5,
        BinaryOp::Ge => 6,
        BinaryOp::Le => 7,
        BinaryOp::Eq => 8,
    }
}

/// A contiguous copy of `x` in `dtype` on its device (the strided copy kernel).
pub(crate) fn copy_cast(x: &Tensor, dtype: DType, op: &'static str) -> Result<Tensor> {
    let gpu = gpu_of(x, op)?;
    let out = empty(&gpu, dtype, x.shape())?;
    let n = x.numel();
    if n == 0 {
        return Ok(out);
    }
    let name = format!("copy_{}_{}", any_suffix(x.dtype()), any_suffix(dtype));
    if !COPIES.contains(&name.as_str()) {
        return Err(not_yet_cast(x.dtype(), dtype));
    }
    let (src, dst) = (storage_ptr(x, op)?, ptr(&out, op)?);
    let s = Strided::of(x.layout(), op)?;
    let n = n as i64;
    launch!(gpu, "copy", name, grid(n as usize); src, dst, s, n)?;
    Ok(out)
}

/// The copy kernels of kernels/copy.cu (source to destination dtype).
const COPIES: [&str; 14] = [
    "copy_f32_f32",
    "copy_f32_bf16",
    "copy_bf16_f32",
    "copy_bf16_bf16",
    "copy_i64_i64",
    "copy_i32_i32",
    "copy_i32_i64",
    "copy_i64_i32",
    "copy_i64_f32",
    "copy_i64_bf16",
    "copy_i32_f32",
    "copy_f32_i64",
    "copy_bf16_i64",
    "copy_f32_i32",
];

fn not_yet_cast(from: DType, to: DType) -> Error {
    Error::Invalid {
        op: "cast",
        msg: format!("no CUDA copy kernel from {from} to {to} yet"),
    }
}

/// `x` itself when contiguous (and of `dtype`), else a contiguous copy in `dtype`.
pub(crate) fn contiguous_as(x: &Tensor, dtype: DType, op: &'static str) -> Result<Tensor> {
    if x.is_contiguous() && x.dtype() == dtype {
        Ok(x.clone())
    } else {
        copy_cast(x, dtype, op)
    }
}

/// The dtype two float operands compute in: theirs when equal, else f32 (as the CPU backend).
fn common_float(a: DType, b: DType) -> DType {
    if a == b {
        a
    } else {
        DType::F32
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn unary(&self, op: UnaryOp, x: &Tensor) -> Result<Tensor> {
        let name = op.name();
        let suf = float_suffix(x.dtype(), name)?;
        let gpu = gpu_of(x, name)?;
        let x = contiguous_as(x, x.dtype(), name)?;
        let out = empty(&gpu, x.dtype(), x.shape())?;
        let n = x.numel() as i64;
        if n > 0 {
            let (code, xp, yp) = (unary_code(op), ptr(&x, name)?, ptr(&out, name)?);
            launch!(gpu, "elementwise", format!("unary_{suf}"), grid(n as usize); code, xp, yp, n)?;
        }
        Ok(out)
    }

    fn unary_grad(&self, op: UnaryOp, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let name = op.name();
        let dtype = common_float(x.dtype(), grad.dtype());
        let suf = float_suffix(dtype, name)?;
        let gpu = gpu_of(x, name)?;
        let (x, g) = (
            contiguous_as(x, dtype, name)?,
            contiguous_as(grad, dtype, name)?,
        );
        let out = empty(&gpu, dtype, x.shape())?;
        let n = x.numel() as i64;
        if n > 0 {
            let (code, xp, gp, op_) = (
                unary_code(op),
                ptr(&x, name)?,
                ptr(&g, name)?,
                ptr(&out, name)?,
            );
            launch!(gpu, "elementwise", format!("unary_grad_{suf}"), grid(n as usize); code, xp, gp, op_, n)?;
        }
        // The gradient comes back in the gradient's dtype, as on the CPU.
        if out.dtype() != grad.dtype() && grad.dtype().is_float() {
            return copy_cast(&out, grad.dtype(), name);
        }
        Ok(out)
    }

    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let name = op.name();
        if a.shape() != b.shape() {
            return Err(Error::ShapeMismatch {
                op: name,
                lhs: a.shape().to_vec(),
                rhs: b.shape().to_vec(),
            });
        }
        let dtype = common_float(a.dtype(), b.dtype());
        let suf = float_suffix(dtype, name)?;
        let gpu = gpu_of(a, name)?;
        // Broadcast views stay views (the kernel reads them through their strides) unless a
        // dtype conversion is needed.
        let a = if a.dtype() == dtype {
            a.clone()
        } else {
            copy_cast(a, dtype, name)?
        };
        let b = if b.dtype() == dtype {
            b.clone()
        } else {
            copy_cast(b, dtype, name)?
        };
        let out = empty(&gpu, dtype, a.shape())?;
        let n = a.numel() as i64;
        if n > 0 {
            let code = binary_code(op);
            let (ap, sa) = (storage_ptr(&a, name)?, Strided::of(a.layout(), name)?);
            let (bp, sb) = (storage_ptr(&b, name)?, Strided::of(b.layout(), name)?);
            let op_ = ptr(&out, name)?;
            launch!(gpu, "elementwise", format!("binary_{suf}"), grid(n as usize); code, ap, sa, bp, sb, op_, n)?;
        }
        Ok(out)
    }

    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        let suf = float_suffix(x.dtype(), "affine")?;
        let gpu = gpu_of(x, "affine")?;
        let x = contiguous_as(x, x.dtype(), "affine")?;
        let out = empty(&gpu, x.dtype(), x.shape())?;
        let n = x.numel() as i64;
        if n > 0 {
            let (xp, yp) = (ptr(&x, "affine")?, ptr(&out, "affine")?);
            launch!(gpu, "elementwise", format!("affine_{suf}"), grid(n as usize); xp, yp, mul, add, n)?;
        }
        Ok(out)
    }

    fn powf(&self, x: &Tensor, e: f32) -> Result<Tensor> {
        let suf = float_suffix(x.dtype(), "powf")?;
        let gpu = gpu_of(x, "powf")?;
        let x = contiguous_as(x, x.dtype(), "powf")?;
        let out = empty(&gpu, x.dtype(), x.shape())?;
        let n = x.numel() as i64;
        if n > 0 {
            let (xp, yp) = (ptr(&x, "powf")?, ptr(&out, "powf")?);
            launch!(gpu, "elementwise", format!("powf_{suf}"), grid(n as usize); xp, yp, e, n)?;
        }
        Ok(out)
    }

    fn clamp(&self, x: &Tensor, lo: f32, hi: f32) -> Result<Tensor> {
        let suf = float_suffix(x.dtype(), "clamp")?;
        let gpu = gpu_of(x, "clamp")?;
        let x = contiguous_as(x, x.dtype(), "clamp")?;
        let out = empty(&gpu, x.dtype(), x.shape())?;
        let n = x.numel() as i64;
        if n > 0 {
            let (xp, yp) = (ptr(&x, "clamp")?, ptr(&out, "clamp")?);
            launch!(gpu, "elementwise", format!("clamp_{suf}"), grid(n as usize); xp, yp, lo, hi, n)?;
        }
        Ok(out)
    }

    fn reduce(&self, op: ReduceOp, x: &Tensor, dim: usize) -> Result<Tensor> {
        let name = op.name();
        let suf = float_suffix(x.dtype(), name)?;
        let gpu = gpu_of(x, name)?;
        let shape = x.shape();
        let n = shape[dim];
        let outer: usize = shape[..dim].iter().product();
        let inner: usize = shape[dim + 1..].iter().product();
        let mut out_shape = shape.to_vec();
        out_shape[dim] = 1;
        if n == 0 {
            return Err(not_yet("reduce over an empty dim"));
        }
        let code = match op {
            ReduceOp::Sum => 0i32,
            ReduceOp::Max => 1,
            ReduceOp::Min => 2,
            ReduceOp::ArgMax => 3,
            ReduceOp::ArgMin => 4,
        };
        let arg = code >= 3;
        let x = contiguous_as(x, x.dtype(), name)?;
        let out = empty(&gpu, if arg { DType::I64 } else { x.dtype() }, &out_shape)?;
        if outer * inner == 0 {
            return Ok(out);
        }
        let xp = ptr(&x, name)?;
        let op_ = ptr(&out, name)?;
        let (yp, ip) = if arg { (0u64, op_) } else { (op_, 0u64) };
        let (outer, n, inner) = (outer as i64, n as i64, inner as i64);
        if inner == 1 {
            check_rows(outer as usize, name)?;
            launch!(gpu, "reduce", format!("reduce_rows_{suf}"), per_row(outer as usize, 256); code, xp, yp, ip, n)?;
        } else {
            launch!(gpu, "reduce", format!("reduce_cols_{suf}"), grid((outer * inner) as usize); code, xp, yp, ip, outer, n, inner)?;
        }
        Ok(out)
    }

    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        super::blas::matmul(a, b)
    }

    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        copy_cast(x, dtype, "cast")
    }

    fn add_assign(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        const OP: &str = "add_assign";
        let suf = float_suffix(dst.dtype(), OP)?;
        if !dst.is_contiguous() {
            return Err(Error::Invalid {
                op: OP,
                msg: "the destination must be contiguous".into(),
            });
        }
        let gpu = gpu_of(dst, OP)?;
        let src = if src.dtype() == dst.dtype() {
            src.clone()
        } else {
            copy_cast(src, dst.dtype(), OP)?
        };
        let n = dst.numel() as i64;
        if n > 0 {
            let (dp, sp, s) = (
                ptr(dst, OP)?,
                storage_ptr(&src, OP)?,
                Strided::of(src.layout(), OP)?,
            );
            launch!(gpu, "elementwise", format!("add_assign_{suf}"), grid(n as usize); dp, sp, s, n)?;
        }
        Ok(())
    }

    fn topk(
        &self,
        x: &Tensor,
        k: usize,
        dim: usize,
        largest: bool,
        sorted: bool,
    ) -> Result<(Tensor, Tensor)> {
        super::index::topk(x, k, dim, largest, sorted)
    }
    fn index_select(&self, x: &Tensor, dim: usize, idx: &Tensor) -> Result<Tensor> {
        super::index::index_select(x, dim, idx)
    }
    fn index_add(&self, base: &Tensor, dim: usize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
        super::index::index_add(base, dim, idx, src)
    }
    fn gather(&self, x: &Tensor, dim: usize, idx: &Tensor) -> Result<Tensor> {
        super::index::gather(x, dim, idx)
    }
    fn scatter_add(&self, x: &Tensor, dim: usize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
        super::index::scatter_add(x, dim, idx, src)
    }
    fn where_(&self, cond: &Tensor, a: &Tensor, b: &Tensor, dtype: DType) -> Result<Tensor> {
        super::index::where_(cond, a, b, dtype)
    }
    fn sort_by_expert(&self, ids: &Tensor, num_experts: usize) -> Result<[Tensor; 4]> {
        super::moe::sort_by_expert(ids, num_experts)
    }
    fn grouped_matmul(
        &self,
        x: &Tensor,
        w: &Tensor,
        counts: &Tensor,
        transpose_w: bool,
    ) -> Result<Tensor> {
        super::moe_gemm::grouped_matmul(x, w, counts, transpose_w)
    }
    fn grouped_matmul_weight_grad(
        &self,
        x: &Tensor,
        g: &Tensor,
        counts: &Tensor,
    ) -> Result<Tensor> {
        super::moe_gemm::grouped_matmul_weight_grad(x, g, counts)
    }
    fn moe_dispatch(&self, x: &Tensor, token: &Tensor, dtype: DType) -> Result<Tensor> {
        super::moe::dispatch(x, token, dtype)
    }
    fn moe_dispatch_backward(
        &self,
        g: &Tensor,
        inverse: &Tensor,
        k: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        super::moe::dispatch_backward(g, inverse, k, dtype)
    }
    fn moe_combine(
        &self,
        y: &Tensor,
        w: &Tensor,
        inverse: &Tensor,
        dtype: DType,
    ) -> Result<Tensor> {
        super::moe::combine(y, w, inverse, dtype)
    }
    fn moe_combine_backward(
        &self,
        y: &Tensor,
        w: &Tensor,
        g: &Tensor,
        order: &Tensor,
        inverse: &Tensor,
        need: (bool, bool),
        dtypes: (DType, DType),
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        super::moe::combine_backward(y, w, g, order, inverse, need, dtypes)
    }
    fn cat(&self, tensors: &[Tensor], dim: usize) -> Result<Tensor> {
        super::index::cat(tensors, dim)
    }
    fn dropout(
        &self,
        x: &Tensor,
        p: f32,
        scale: f32,
        key: &crate::rng::RngKey,
        offset: u64,
    ) -> Result<Tensor> {
        super::index::dropout(x, p, scale, key, offset)
    }
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&Tensor>,
        spec: &crate::ops::AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        super::attention::forward(q, k, v, sinks, spec)
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
        super::attention::backward(q, k, v, sinks, out, lse, grad, spec)
    }
}

#[cfg(test)]
mod tests {
    use super::COPIES;

    #[test]
    fn every_listed_copy_kernel_is_defined() {
        let src = crate::cuda::kernels::source("copy")
            .expect("copy source")
            .source;
        for name in COPIES {
            assert!(
                src.contains(&format!("({name},")),
                "{name} is not in copy.cu"
            );
        }
    }
}
