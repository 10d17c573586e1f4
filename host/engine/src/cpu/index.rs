//! Indexing kernels: top-k, index_select / index_add, gather / scatter_add, where.
//!
//! Pure copies (index_select, gather) keep the input's dtype bit for bit; accumulating kernels
//! (index_add, scatter_add) compute in f32. Accumulations run over disjoint output slabs in
//! parallel and, inside a slab, in increasing source position, so results never depend on the
//! thread count.

use super::{finish, float_out, CHUNK};
use crate::error::{Error, Result};
use crate::layout::{contiguous_strides, Layout};
use crate::storage::Storage;
use crate::{DType, Element, Tensor};
use rayon::prelude::*;
use std::cmp::Ordering;

/// `(outer, size, inner)`: the products of the dims before `dim`, the dim itself, and after.
pub(crate) fn split_at_dim(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    (
        shape[..dim].iter().product(),
        shape[dim],
        shape[dim + 1..].iter().product(),
    )
}

/// For each row-major position of `sub`, the row-major linear index of the same coordinates in
/// `full` (which is at least as large in every dim).
pub(crate) fn sub_offsets(sub: &[usize], full: &[usize]) -> Vec<usize> {
    let layout = Layout::from_parts(sub.to_vec(), contiguous_strides(full), 0);
    let mut v = Vec::with_capacity(layout.numel());
    if sub.is_empty() {
        v.push(0);
    } else {
        layout.for_each_index(|i| v.push(i));
    }
    v
}

/// The indices of `idx` (i64 or i32) as i64, each checked to lie in `0..size`.
pub(crate) fn read_indices(op: &'static str, idx: &Tensor, size: usize) -> Result<Vec<i64>> {
    if !matches!(idx.dtype(), DType::I64 | DType::I32) {
        return Err(Error::DType {
            op,
            got: idx.dtype(),
            expected: "i64 or i32 indices",
        });
    }
    let v = idx.contig::<i64>().to_vec();
    if let Some(&bad) = v.iter().find(|&&i| i < 0 || i as usize >= size) {
        return Err(Error::IndexOutOfRange {
            op,
            index: bad,
            size,
        });
    }
    Ok(v)
}

/// Runs a generic function for the runtime dtype of a tensor.
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            DType::I32 => $f::<i32>($($arg),*),
            DType::I64 => $f::<i64>($($arg),*),
        }
    };
}

/// `out[o, l, i] = x[o, idx[l], i]` along `dim`, in `x`'s dtype.
pub(crate) fn index_select(x: &Tensor, dim: usize, idx: &Tensor) -> Result<Tensor> {
    let idx = read_indices("index_select", idx, x.shape()[dim])?;
    by_dtype!(x.dtype(), index_select_t(x, dim, &idx))
}

fn index_select_t<T: Element>(x: &Tensor, dim: usize, idx: &[i64]) -> Result<Tensor> {
    let (_, n, inner) = split_at_dim(x.shape(), dim);
    let mut shape = x.shape().to_vec();
    shape[dim] = idx.len();
    let xs = x.contig::<T>();
    let mut out = vec![T::zeroed(); shape.iter().product()];
    let slab = idx.len() * inner;
    if slab > 0 {
        out.par_chunks_mut(slab).enumerate().for_each(|(o, dst)| {
            let src = &xs[o * n * inner..(o + 1) * n * inner];
            for (l, &i) in idx.iter().enumerate() {
                let i = i as usize;
                dst[l * inner..(l + 1) * inner].copy_from_slice(&src[i * inner..(i + 1) * inner]);
            }
        });
    }
    drop(xs);
    Tensor::from_vec(out, &shape)
}

/// `base` plus, along `dim`, `out[o, idx[l], i] += src[o, l, i]` (in f32, sources in order).
pub(crate) fn index_add(base: &Tensor, dim: usize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
    let idx = read_indices("index_add", idx, base.shape()[dim])?;
    let (_, n, inner) = split_at_dim(base.shape(), dim);
    let mut out = Storage::any(DType::F32, base.numel());
    out.as_mut_slice::<f32>()
        .copy_from_slice(&base.contig::<f32>());
    let ss = src.contig::<f32>();
    let slab = n * inner;
    if slab > 0 {
        out.as_mut_slice::<f32>()
            .par_chunks_mut(slab)
            .enumerate()
            .for_each(|(o, dst)| {
                let s = &ss[o * idx.len() * inner..(o + 1) * idx.len() * inner];
                for (l, &i) in idx.iter().enumerate() {
                    let d = &mut dst[i as usize * inner..(i as usize + 1) * inner];
                    d.iter_mut()
                        .zip(&s[l * inner..(l + 1) * inner])
                        .for_each(|(d, &v)| *d += v);
                }
            });
    }
    drop(ss);
    finish(out, base.shape(), float_out(base.dtype()))
}

/// Offsets shared by gather and scatter_add for an index of shape `ishape` against a tensor of
/// shape `full` along `dim`: slab bases of the outer coordinates and offsets of the inner ones.
struct IndexGeometry {
    /// Sizes of the index along `dim` and after it.
    len: usize,
    inner: usize,
    /// Linear outer coordinate in `full[..dim]` of each index outer position.
    full_outer: Vec<usize>,
    /// Linear inner offset in `full[dim+1..]` of each index inner position.
    full_inner: Vec<usize>,
}

impl IndexGeometry {
    fn new(ishape: &[usize], full: &[usize], dim: usize) -> IndexGeometry {
        let (_, len, inner) = split_at_dim(ishape, dim);
        IndexGeometry {
            len,
            inner,
            full_outer: sub_offsets(&ishape[..dim], &full[..dim]),
            full_inner: sub_offsets(&ishape[dim + 1..], &full[dim + 1..]),
        }
    }
}

/// PyTorch's gather: `out[.., j, ..] = x[.., idx[.., j, ..], ..]` along `dim`; `out` has the
/// index's shape and `x`'s dtype.
pub(crate) fn gather(x: &Tensor, dim: usize, idx: &Tensor) -> Result<Tensor> {
    let iv = read_indices("gather", idx, x.shape()[dim])?;
    by_dtype!(x.dtype(), gather_t(x, dim, &iv, idx.shape()))
}

fn gather_t<T: Element>(x: &Tensor, dim: usize, idx: &[i64], ishape: &[usize]) -> Result<Tensor> {
    let g = IndexGeometry::new(ishape, x.shape(), dim);
    let (_, n, xinner) = split_at_dim(x.shape(), dim);
    let xs = x.contig::<T>();
    let mut out = vec![T::zeroed(); idx.len()];
    let slab = g.len * g.inner;
    if slab > 0 {
        out.par_chunks_mut(slab).enumerate().for_each(|(o, dst)| {
            let base = g.full_outer[o] * n * xinner;
            let iv = &idx[o * slab..(o + 1) * slab];
            for j in 0..g.len {
                for (k, &off) in g.full_inner.iter().enumerate() {
                    let p = j * g.inner + k;
                    dst[p] = xs[base + iv[p] as usize * xinner + off];
                }
            }
        });
    }
    drop(xs);
    Tensor::from_vec(out, ishape)
}

/// PyTorch's scatter_add: `x` plus `out[.., idx[.., j, ..], ..] += src[.., j, ..]` along `dim`
/// (in f32). Each outer slab of the output is filled by one task in increasing `j`.
pub(crate) fn scatter_add(x: &Tensor, dim: usize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
    let iv = read_indices("scatter_add", idx, x.shape()[dim])?;
    let gx = IndexGeometry::new(idx.shape(), x.shape(), dim);
    let gs = IndexGeometry::new(idx.shape(), src.shape(), dim);
    let (xouter, n, xinner) = split_at_dim(x.shape(), dim);
    let (_, sn, sinner) = split_at_dim(src.shape(), dim);
    // Which index outer position (if any) writes each output slab.
    let mut writer = vec![None; xouter];
    for (o, &xo) in gx.full_outer.iter().enumerate() {
        writer[xo] = Some(o);
    }
    let mut out = Storage::any(DType::F32, x.numel());
    out.as_mut_slice::<f32>()
        .copy_from_slice(&x.contig::<f32>());
    let ss = src.contig::<f32>();
    let slab = gx.len * gx.inner;
    if n * xinner > 0 && slab > 0 {
        out.as_mut_slice::<f32>()
            .par_chunks_mut(n * xinner)
            .zip(writer.par_iter())
            .for_each(|(dst, w)| {
                let Some(o) = *w else { return };
                let iv = &iv[o * slab..(o + 1) * slab];
                let sbase = gs.full_outer[o] * sn * sinner;
                for j in 0..gx.len {
                    for k in 0..gx.inner {
                        let p = j * gx.inner + k;
                        let d = iv[p] as usize * xinner + gx.full_inner[k];
                        dst[d] += ss[sbase + j * sinner + gs.full_inner[k]];
                    }
                }
            });
    }
    drop(ss);
    finish(out, x.shape(), float_out(x.dtype()))
}

/// An f32 operand read row by row in place: element `j` of row `r` sits at
/// `data[offsets[r] + j * step]` with `step` 0 (broadcast) or 1.
struct Rows {
    tensor: Tensor,
    offsets: Vec<usize>,
    step: usize,
}

impl Rows {
    /// Reads `t` in place when it is f32 with a last-dim stride of 0 or 1 (plain or broadcast
    /// rows), else from a contiguous f32 copy.
    fn new(t: &Tensor) -> Rows {
        let rank = t.rank();
        let last_stride = if rank == 0 {
            1
        } else {
            t.layout().strides()[rank - 1]
        };
        let tensor = if t.dtype() == DType::F32 && last_stride <= 1 {
            t.clone()
        } else {
            t.materialize(DType::F32)
        };
        let l = tensor.layout();
        let (outer, step) = if rank == 0 {
            (Layout::from_parts(vec![], vec![], l.offset()), 1)
        } else {
            let outer = Layout::from_parts(
                l.shape()[..rank - 1].to_vec(),
                l.strides()[..rank - 1].to_vec(),
                l.offset(),
            );
            (outer, l.strides()[rank - 1])
        };
        let mut offsets = Vec::with_capacity(outer.numel());
        outer.for_each_index(|i| offsets.push(i));
        Rows {
            tensor,
            offsets,
            step,
        }
    }
}

/// `cond != 0 ? a : b` for three f32 tensors of one shape (broadcast views are read in place,
/// without expanding them), returned in `dtype`.
pub(crate) fn where_(cond: &Tensor, a: &Tensor, b: &Tensor, dtype: DType) -> Result<Tensor> {
    let shape = cond.shape().to_vec();
    let width = shape.last().copied().unwrap_or(1);
    let ops = [Rows::new(cond), Rows::new(a), Rows::new(b)];
    let guards: Vec<_> = ops.iter().map(|o| o.tensor.storage()).collect();
    let data: Vec<&[f32]> = guards.iter().map(|g| g.as_slice::<f32>()).collect();
    let rows = ops[0].offsets.len();
    let mut out = Storage::any(DType::F32, rows * width);
    let per_task = (CHUNK / width.max(1)).max(1);
    if width > 0 {
        out.as_mut_slice::<f32>()
            .par_chunks_mut(per_task * width)
            .enumerate()
            .for_each(|(t, dst)| {
                for (i, row) in dst.chunks_mut(width).enumerate() {
                    let r = t * per_task + i;
                    let at = |k: usize, j: usize| data[k][ops[k].offsets[r] + j * ops[k].step];
                    for (j, o) in row.iter_mut().enumerate() {
                        *o = if at(0, j) != 0.0 { at(1, j) } else { at(2, j) };
                    }
                }
            });
    }
    drop(data);
    drop(guards);
    finish(out, &shape, dtype)
}

/// Total order for top-k: NaN above everything (as in PyTorch), then value, then the lower
/// index first among equal values.
fn rank_order(largest: bool, va: f32, ia: u32, vb: f32, ib: u32) -> Ordering {
    let by_value = match (va.is_nan(), vb.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        _ => va.partial_cmp(&vb).unwrap_or(Ordering::Equal),
    };
    let by_value = if largest {
        by_value.reverse()
    } else {
        by_value
    };
    by_value.then(ia.cmp(&ib))
}

/// The best `k` positions of `line` (any order) by a partial selection: for large `k`.
fn top_by_select(line: &[f32], k: usize, largest: bool) -> Vec<u32> {
    let cmp = |a: &u32, b: &u32| rank_order(largest, line[*a as usize], *a, line[*b as usize], *b);
    let mut order: Vec<u32> = (0..line.len() as u32).collect();
    if k < line.len() {
        order.select_nth_unstable_by(k - 1, cmp);
        order.truncate(k);
    }
    order
}

/// The best `k` positions of `line` (any order) by one scan keeping a sorted buffer of `k`: for
/// small `k`, where almost every element loses against the current k-th best at once. Scanning
/// in index order and replacing only on strictly better values keeps lower indices on ties.
fn top_by_scan(line: &[f32], k: usize, largest: bool) -> Vec<u32> {
    let better = |a: (f32, u32), b: (f32, u32)| rank_order(largest, a.0, a.1, b.0, b.1).is_lt();
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    for (i, &v) in line.iter().enumerate() {
        let cand = (v, i as u32);
        if best.len() == k {
            // Fast reject on the value alone; NaN and ties fall through to the full order.
            let worst = best[k - 1].0;
            if (largest && v < worst) || (!largest && v > worst) || !better(cand, best[k - 1]) {
                continue;
            }
        }
        let at = best.partition_point(|&b| better(b, cand));
        best.insert(at, cand);
        best.truncate(k);
    }
    best.into_iter().map(|(_, i)| i).collect()
}

/// The `k` largest (or smallest) entries along `dim`: values (float dtype of `x`) and i64
/// indices. `sorted` orders them best first; otherwise they come in increasing index order.
pub(crate) fn topk(
    x: &Tensor,
    k: usize,
    dim: usize,
    largest: bool,
    sorted: bool,
) -> Result<(Tensor, Tensor)> {
    let last = x.rank() - 1;
    let mut perm: Vec<usize> = (0..x.rank()).collect();
    perm.swap(dim, last);
    let moved = x.with_layout(x.layout().permute(&perm)?);
    let n = moved.shape()[last];
    let rows = moved.numel() / n.max(1);
    let xs = moved.contig::<f32>();
    let mut vals = vec![0f32; rows * k];
    let mut idxs = vec![0i64; rows * k];
    if k > 0 {
        vals.par_chunks_mut(k)
            .zip(idxs.par_chunks_mut(k))
            .enumerate()
            .for_each(|(r, (vo, io))| {
                let line = &xs[r * n..(r + 1) * n];
                let order = if k * 8 <= n {
                    top_by_scan(line, k, largest)
                } else {
                    top_by_select(line, k, largest)
                };
                let cmp = |a: &u32, b: &u32| {
                    rank_order(largest, line[*a as usize], *a, line[*b as usize], *b)
                };
                let mut order = order;
                if sorted {
                    order.sort_unstable_by(cmp);
                } else {
                    order.sort_unstable();
                }
                for ((v, i), &o) in vo.iter_mut().zip(io.iter_mut()).zip(&order) {
                    *v = line[o as usize];
                    *i = o as i64;
                }
            });
    }
    drop(xs);
    let mut moved_shape = moved.shape().to_vec();
    moved_shape[last] = k;
    let back = |t: Tensor| -> Tensor {
        let view = t.with_layout(t.layout().permute(&perm).expect("a swap is a permutation"));
        view.materialize(view.dtype())
    };
    let v = Tensor::from_storage(Storage::from_slice(&vals), &moved_shape)?;
    let i = Tensor::from_vec(idxs, &moved_shape)?;
    Ok((back(v).materialize(float_out(x.dtype())), back(i)))
}
