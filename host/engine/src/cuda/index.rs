//! Index, selection and random kernels on CUDA (kernels/index.cu): top-k, index_select /
//! index_add, gather / scatter_add, where, cat and dropout.
//!
//! Indices whose values are on the host (uploaded ones, [`Tensor::host_resident`]) are checked
//! against the indexed size there, as the CPU backend does, so a bad index is an error. Indices
//! the device computed (a router's top-k, a sort) stay there unread, so nothing waits for the
//! device; the kernels bounds-check every use (an index outside its dim reads zero and adds
//! nothing), so none is ever an out-of-bounds access. Copies move
//! elements of 2, 4 or 8 bytes bit for bit; accumulations run in f32 in the CPU backend's order.

use super::backend::{contiguous_as, copy_cast};
use super::launch::{empty, gpu_of, grid, launch, per_row, ptr, upload, Strided};
use crate::cpu::float_out;
use crate::cpu::index::{read_indices, split_at_dim, sub_offsets};
use crate::error::{Error, Result};
use crate::rng::RngKey;
use crate::{DType, Tensor};
use std::sync::Arc;

/// The suffix of the copy kernels moving elements of `dtype`'s size.
fn bytes_suffix(dtype: DType) -> &'static str {
    match dtype.size_in_bytes() {
        2 => "b2",
        4 => "b4",
        _ => "b8",
    }
}

/// `idx` as contiguous i64 on `gpu`: checked against `size` and uploaded when its values are on
/// the host, else converted where it is.
fn indices(gpu: &Arc<super::Gpu>, op: &'static str, idx: &Tensor, size: usize) -> Result<Tensor> {
    if idx.host_resident() || idx.device() != crate::Device::Cuda(gpu.ordinal) {
        let v = read_indices(op, idx, size)?;
        return upload(gpu, &v, idx.shape());
    }
    if !matches!(idx.dtype(), DType::I64 | DType::I32) {
        return Err(Error::DType {
            op,
            got: idx.dtype(),
            expected: "i64 or i32 indices",
        });
    }
    contiguous_as(idx, DType::I64, op)
}

/// A host list of offsets as an i64 device tensor.
fn offsets(gpu: &Arc<super::Gpu>, v: &[usize]) -> Result<Tensor> {
    let v: Vec<i64> = v.iter().map(|&o| o as i64).collect();
    upload(gpu, &v, &[v.len()])
}

/// `t` as a fresh contiguous f32 tensor (a copy even when it already is one: the accumulating
/// kernels write into it).
fn f32_copy(t: &Tensor, op: &'static str) -> Result<Tensor> {
    let t = if t.dtype().is_float() || matches!(t.dtype(), DType::I32 | DType::I64) {
        t.clone()
    } else {
        return Err(Error::DType {
            op,
            got: t.dtype(),
            expected: "a float or integer tensor",
        });
    };
    copy_cast(&t, DType::F32, op)
}

/// `t` (f32) returned in `dtype`.
fn finish(t: Tensor, dtype: DType, op: &'static str) -> Result<Tensor> {
    if dtype == DType::F32 {
        Ok(t)
    } else {
        copy_cast(&t, dtype, op)
    }
}

/// `out[o, l, i] = x[o, idx[l], i]` along `dim`, in `x`'s dtype.
pub(crate) fn index_select(x: &Tensor, dim: usize, idx: &Tensor) -> Result<Tensor> {
    const OP: &str = "index_select";
    let gpu = gpu_of(x, OP)?;
    let (outer, n, inner) = split_at_dim(x.shape(), dim);
    let idx = indices(&gpu, OP, idx, n)?;
    let len = idx.numel();
    let mut shape = x.shape().to_vec();
    shape[dim] = len;
    let out = empty(&gpu, x.dtype(), &shape)?;
    let total = outer * len * inner;
    if total > 0 {
        let x = contiguous_as(x, x.dtype(), OP)?;
        let (xp, ip, op_) = (ptr(&x, OP)?, ptr(&idx, OP)?, ptr(&out, OP)?);
        let (outer, n, len, inner) = (outer as i64, n as i64, len as i64, inner as i64);
        let name = format!("index_select_{}", bytes_suffix(x.dtype()));
        launch!(gpu, "index", name, grid(total); xp, ip, op_, outer, n, len, inner)?;
    }
    Ok(out)
}

/// `base` plus `src[o, l, i]` added at `[o, idx[l], i]` along `dim` (f32, in index order).
pub(crate) fn index_add(base: &Tensor, dim: usize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
    const OP: &str = "index_add";
    let gpu = gpu_of(base, OP)?;
    let (outer, n, inner) = split_at_dim(base.shape(), dim);
    let idx = indices(&gpu, OP, idx, n)?;
    let len = idx.numel();
    let out = f32_copy(base, OP)?;
    if outer * inner * len > 0 {
        let src = contiguous_as(src, DType::F32, OP)?;
        let (op_, sp, ip) = (ptr(&out, OP)?, ptr(&src, OP)?, ptr(&idx, OP)?);
        let (o64, n, len, i64_) = (outer as i64, n as i64, len as i64, inner as i64);
        launch!(gpu, "index", "index_add_f32", grid(outer * inner); op_, sp, ip, o64, n, len, i64_)?;
    }
    finish(out, float_out(base.dtype()), OP)
}

/// PyTorch's gather along `dim`: the index's shape, `x`'s dtype.
pub(crate) fn gather(x: &Tensor, dim: usize, idx: &Tensor) -> Result<Tensor> {
    const OP: &str = "gather";
    let gpu = gpu_of(x, OP)?;
    let (_, n, xinner) = split_at_dim(x.shape(), dim);
    let ishape = idx.shape().to_vec();
    let (outer, len, inner) = split_at_dim(&ishape, dim);
    let iv = indices(&gpu, OP, idx, n)?;
    let out = empty(&gpu, x.dtype(), &ishape)?;
    let total = outer * len * inner;
    if total > 0 {
        let xo = offsets(&gpu, &sub_offsets(&ishape[..dim], &x.shape()[..dim]))?;
        let xi = offsets(
            &gpu,
            &sub_offsets(&ishape[dim + 1..], &x.shape()[dim + 1..]),
        )?;
        let x = contiguous_as(x, x.dtype(), OP)?;
        let (xp, ip, xop, xip, op_) = (
            ptr(&x, OP)?,
            ptr(&iv, OP)?,
            ptr(&xo, OP)?,
            ptr(&xi, OP)?,
            ptr(&out, OP)?,
        );
        let dims = [outer, len, inner, n, xinner].map(|v| v as i64);
        let [o, l, i, n, xin] = dims;
        let name = format!("gather_{}", bytes_suffix(x.dtype()));
        launch!(gpu, "index", name, grid(total); xp, ip, xop, xip, op_, o, l, i, n, xin)?;
    }
    Ok(out)
}

/// PyTorch's scatter_add along `dim` (f32, each position's sources in increasing order).
pub(crate) fn scatter_add(x: &Tensor, dim: usize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
    const OP: &str = "scatter_add";
    let gpu = gpu_of(x, OP)?;
    let (_, n, xinner) = split_at_dim(x.shape(), dim);
    let (_, sn, sinner) = split_at_dim(src.shape(), dim);
    let ishape = idx.shape().to_vec();
    let (outer, len, inner) = split_at_dim(&ishape, dim);
    let iv = indices(&gpu, OP, idx, n)?;
    let out = f32_copy(x, OP)?;
    if outer * len * inner > 0 {
        let part = |full: &[usize]| -> Result<(Tensor, Tensor)> {
            Ok((
                offsets(&gpu, &sub_offsets(&ishape[..dim], &full[..dim]))?,
                offsets(&gpu, &sub_offsets(&ishape[dim + 1..], &full[dim + 1..]))?,
            ))
        };
        let ((xo, xi), (so, si)) = (part(x.shape())?, part(src.shape())?);
        let src = contiguous_as(src, DType::F32, OP)?;
        let (op_, sp, ip) = (ptr(&out, OP)?, ptr(&src, OP)?, ptr(&iv, OP)?);
        let (xop, xip, sop, sip) = (ptr(&xo, OP)?, ptr(&xi, OP)?, ptr(&so, OP)?, ptr(&si, OP)?);
        let [o, l, i, n, xin, sn, sin] =
            [outer, len, inner, n, xinner, sn, sinner].map(|v| v as i64);
        launch!(gpu, "index", "scatter_add_f32", grid(outer * inner);
            op_, sp, ip, xop, xip, sop, sip, o, l, i, n, xin, sn, sin)?;
    }
    finish(out, float_out(x.dtype()), OP)
}

/// `cond != 0 ? a : b` for three f32 tensors of one shape (broadcast views read in place),
/// returned in `dtype`.
pub(crate) fn where_(cond: &Tensor, a: &Tensor, b: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "where";
    let gpu = gpu_of(cond, OP)?;
    let as_f32 = |t: &Tensor| -> Result<Tensor> {
        if t.dtype() == DType::F32 {
            Ok(t.clone())
        } else {
            copy_cast(t, DType::F32, OP)
        }
    };
    let (c, a, b) = (as_f32(cond)?, as_f32(a)?, as_f32(b)?);
    let out = empty(&gpu, DType::F32, c.shape())?;
    let n = c.numel();
    if n > 0 {
        let (cp, sc) = (
            super::launch::storage_ptr(&c, OP)?,
            Strided::of(c.layout(), OP)?,
        );
        let (ap, sa) = (
            super::launch::storage_ptr(&a, OP)?,
            Strided::of(a.layout(), OP)?,
        );
        let (bp, sb) = (
            super::launch::storage_ptr(&b, OP)?,
            Strided::of(b.layout(), OP)?,
        );
        let (op_, n64) = (ptr(&out, OP)?, n as i64);
        launch!(gpu, "index", "where_f32", grid(n); cp, sc, ap, sa, bp, sb, op_, n64)?;
    }
    finish(out, dtype, OP)
}

/// The `k` best entries along `dim` (values in `x`'s float dtype, i64 indices), best first when
/// `sorted`, else by increasing index; ties to the lower index, NaN above every number.
pub(crate) fn topk(
    x: &Tensor,
    k: usize,
    dim: usize,
    largest: bool,
    sorted: bool,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "topk";
    let gpu = gpu_of(x, OP)?;
    let last = x.rank() - 1;
    let mut perm: Vec<usize> = (0..x.rank()).collect();
    perm.swap(dim, last);
    // The selected dim moved last, as a contiguous f32 copy (one row per line to select from).
    let moved = copy_cast(&x.with_layout(x.layout().permute(&perm)?), DType::F32, OP)?;
    let n = moved.shape()[last];
    let rows = moved.numel() / n.max(1);
    let mut shape = moved.shape().to_vec();
    shape[last] = k;
    let vals = empty(&gpu, DType::F32, &shape)?;
    let idxs = empty(&gpu, DType::I64, &shape)?;
    if rows * k > 0 {
        super::launch::check_rows(rows, OP)?;
        let threads = n.next_power_of_two().clamp(32, 256) as u32;
        let (xp, vp, ip) = (ptr(&moved, OP)?, ptr(&vals, OP)?, ptr(&idxs, OP)?);
        let (n64, k64, lg, so) = (n as i64, k as i64, largest as i32, sorted as i32);
        launch!(gpu, "index", "topk_f32", per_row(rows, threads); xp, vp, ip, n64, k64, lg, so)?;
    }
    let back = |t: Tensor, dtype: DType| -> Result<Tensor> {
        let view = t.with_layout(t.layout().permute(&perm)?);
        copy_cast(&view, dtype, OP)
    };
    Ok((back(vals, float_out(x.dtype()))?, back(idxs, DType::I64)?))
}

/// Joins tensors of one dtype along `dim`, copying their elements bit for bit.
pub(crate) fn cat(tensors: &[Tensor], dim: usize) -> Result<Tensor> {
    const OP: &str = "cat";
    let first = tensors.first().ok_or_else(|| Error::Invalid {
        op: OP,
        msg: "needs at least one tensor".into(),
    })?;
    let gpu = gpu_of(first, OP)?;
    let dtype = first.dtype();
    let mut shape = first.shape().to_vec();
    shape[dim] = tensors.iter().map(|t| t.shape()[dim]).sum();
    let (outer, total, inner) = split_at_dim(&shape, dim);
    let out = empty(&gpu, dtype, &shape)?;
    let mut at = 0;
    for t in tensors {
        let width = t.shape()[dim] * inner;
        if outer * width > 0 {
            let src = contiguous_as(t, dtype, OP)?;
            let (sp, op_) = (ptr(&src, OP)?, ptr(&out, OP)?);
            let [o, w, tot, a] = [outer, width, total * inner, at].map(|v| v as i64);
            let name = format!("cat_{}", bytes_suffix(dtype));
            launch!(gpu, "index", name, grid(outer * width); sp, op_, o, w, tot, a)?;
        }
        at += width;
    }
    Ok(out)
}

/// `x · scale` where the uniform draw of `key` at `offset + i` is at least `p`, else 0: the
/// CPU backend's mask (same Philox stream), computed in f32 and returned in `x`'s float dtype.
pub(crate) fn dropout(x: &Tensor, p: f32, scale: f32, key: &RngKey, offset: u64) -> Result<Tensor> {
    const OP: &str = "dropout";
    let gpu = gpu_of(x, OP)?;
    let dtype = if x.dtype() == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    };
    let x = contiguous_as(x, dtype, OP)?;
    let out = empty(&gpu, dtype, x.shape())?;
    let n = x.numel();
    if n > 0 {
        let (seed, stream) = key.parts();
        let (xp, yp, n64) = (ptr(&x, OP)?, ptr(&out, OP)?, n as i64);
        let suf = super::launch::float_suffix(dtype, OP)?;
        launch!(gpu, "index", format!("dropout_{suf}"), grid(n); xp, yp, seed, stream, offset, p, scale, n64)?;
    }
    Ok(out)
}
