//! Elementwise kernels: unary maps and their derivatives, broadcasting binary ops.

use super::simd::{self, simd_kernel};
use super::{finish, float_out, CHUNK};
use crate::error::{invalid, Error, Result};
use crate::layout::Layout;
use crate::ops::{BinaryOp, UnaryOp};
use crate::storage::Storage;
use crate::{DType, Tensor};
use rayon::prelude::*;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;
const INV_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
const INV_SQRT_2PI: f32 = 0.398_942_3;

simd_kernel! {
    fn unary_f32(op: UnaryOp, x: &[f32], y: &mut [f32]) {
        macro_rules! each {
            (|$v:ident| $e:expr) => {
                for (o, &$v) in y.iter_mut().zip(x) {
                    *o = $e;
                }
            };
        }
        match op {
            UnaryOp::Neg => each!(|v| -v),
            UnaryOp::Exp => each!(|v| simd::exp(v)),
            UnaryOp::Log => each!(|v| v.ln()),
            UnaryOp::Sqrt => each!(|v| v.sqrt()),
            UnaryOp::Rsqrt => each!(|v| 1.0 / v.sqrt()),
            UnaryOp::Tanh => each!(|v| v.tanh()),
            UnaryOp::Sigmoid => each!(|v| simd::sigmoid(v)),
            UnaryOp::Silu => each!(|v| v * simd::sigmoid(v)),
            UnaryOp::Gelu => each!(|v| 0.5 * v * (1.0 + (SQRT_2_OVER_PI * (v + GELU_C * v * v * v)).tanh())),
            UnaryOp::GeluErf => each!(|v| 0.5 * v * (1.0 + simd::erf(v * INV_SQRT_2))),
            UnaryOp::Relu => each!(|v| v.max(0.0)),
            UnaryOp::Softplus => each!(|v| if v > 20.0 { v } else { v.max(0.0) + (simd::exp(-v.abs())).ln_1p() }),
            UnaryOp::Abs => each!(|v| v.abs()),
            UnaryOp::Sin => each!(|v| v.sin()),
            UnaryOp::Cos => each!(|v| v.cos()),
        }
    }
}

simd_kernel! {
    fn unary_grad_f32(op: UnaryOp, x: &[f32], g: &[f32], out: &mut [f32]) {
        macro_rules! each {
            (|$v:ident, $g:ident| $e:expr) => {
                for ((o, &$v), &$g) in out.iter_mut().zip(x).zip(g) {
                    *o = $e;
                }
            };
        }
        match op {
            UnaryOp::Neg => each!(|_v, g| -g),
            UnaryOp::Exp => each!(|v, g| g * simd::exp(v)),
            UnaryOp::Log => each!(|v, g| g / v),
            UnaryOp::Sqrt => each!(|v, g| g * 0.5 / v.sqrt()),
            UnaryOp::Rsqrt => each!(|v, g| g * -0.5 / (v * v.sqrt())),
            UnaryOp::Tanh => each!(|v, g| { let t = v.tanh(); g * (1.0 - t * t) }),
            UnaryOp::Sigmoid => each!(|v, g| { let s = simd::sigmoid(v); g * s * (1.0 - s) }),
            UnaryOp::Silu => each!(|v, g| { let s = simd::sigmoid(v); g * s * (1.0 + v * (1.0 - s)) }),
            UnaryOp::Gelu => each!(|v, g| {
                let u = SQRT_2_OVER_PI * (v + GELU_C * v * v * v);
                let t = u.tanh();
                let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * v * v);
                g * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * du)
            }),
            UnaryOp::GeluErf => each!(|v, g| {
                let cdf = 0.5 * (1.0 + simd::erf(v * INV_SQRT_2));
                let pdf = INV_SQRT_2PI * simd::exp(-0.5 * v * v);
                g * (cdf + v * pdf)
            }),
            UnaryOp::Relu => each!(|v, g| if v > 0.0 { g } else { 0.0 }),
            UnaryOp::Softplus => each!(|v, g| if v > 20.0 { g } else { g * simd::sigmoid(v) }),
            UnaryOp::Abs => each!(|v, g| if v > 0.0 { g } else if v < 0.0 { -g } else { 0.0 }),
            UnaryOp::Sin => each!(|v, g| g * v.cos()),
            UnaryOp::Cos => each!(|v, g| -g * v.sin()),
        }
    }
}

pub(crate) fn unary(op: UnaryOp, x: &Tensor) -> Result<Tensor> {
    let src = x.contig::<f32>();
    let mut out = Storage::any(DType::F32, src.len());
    out.as_mut_slice::<f32>()
        .par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(y, x)| unary_f32(op, x, y));
    drop(src);
    finish(out, x.shape(), float_out(x.dtype()))
}

pub(crate) fn unary_grad(op: UnaryOp, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let xs = x.contig::<f32>();
    let gs = grad.contig::<f32>();
    let mut out = Storage::any(DType::F32, xs.len());
    out.as_mut_slice::<f32>()
        .par_chunks_mut(CHUNK)
        .zip(xs.par_chunks(CHUNK).zip(gs.par_chunks(CHUNK)))
        .for_each(|(o, (x, g))| unary_grad_f32(op, x, g, o));
    drop((xs, gs));
    finish(out, x.shape(), float_out(grad.dtype()))
}

/// Applies `f` to every element (computing in f32).
pub(crate) fn map(x: &Tensor, f: impl Fn(f32) -> f32 + Sync + Send) -> Result<Tensor> {
    let src = x.contig::<f32>();
    let mut out = Storage::any(DType::F32, src.len());
    out.as_mut_slice::<f32>()
        .par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(y, x)| y.iter_mut().zip(x).for_each(|(y, &x)| *y = f(x)));
    drop(src);
    finish(out, x.shape(), float_out(x.dtype()))
}

simd_kernel! {
    /// One row of a binary op: `a` and `b` have element steps of 0 or 1.
    fn binary_row(op: BinaryOp, a: &[f32], a_step: usize, b: &[f32], b_step: usize, out: &mut [f32]) {
        macro_rules! rows {
            ($f:expr) => {
                match (a_step, b_step) {
                    (1, 1) => out.iter_mut().zip(a).zip(b).for_each(|((o, &x), &y)| *o = $f(x, y)),
                    (1, _) => { let y = b[0]; out.iter_mut().zip(a).for_each(|(o, &x)| *o = $f(x, y)) }
                    (_, 1) => { let x = a[0]; out.iter_mut().zip(b).for_each(|(o, &y)| *o = $f(x, y)) }
                    _ => { let v = $f(a[0], b[0]); out.fill(v) }
                }
            };
        }
        match op {
            BinaryOp::Add => rows!(|x: f32, y: f32| x + y),
            BinaryOp::Sub => rows!(|x: f32, y: f32| x - y),
            BinaryOp::Mul => rows!(|x: f32, y: f32| x * y),
            BinaryOp::Div => rows!(|x: f32, y: f32| x / y),
            BinaryOp::Maximum => rows!(|x: f32, y: f32| x.max(y)),
            BinaryOp::Minimum => rows!(|x: f32, y: f32| x.min(y)),
            BinaryOp::Ge => rows!(|x: f32, y: f32| f32::from(u8::from(x >= y))),
            BinaryOp::Le => rows!(|x: f32, y: f32| f32::from(u8::from(x <= y))),
            BinaryOp::Eq => rows!(|x: f32, y: f32| f32::from(u8::from(x == y))),
        }
    }
}

/// Storage offsets of the start of every row (all dims but the last) of a layout.
fn row_offsets(l: &Layout) -> Vec<usize> {
    let rank = l.rank();
    if rank == 0 {
        return vec![l.offset()];
    }
    let outer = Layout::from_parts(
        l.shape()[..rank - 1].to_vec(),
        l.strides()[..rank - 1].to_vec(),
        l.offset(),
    );
    let mut v = Vec::with_capacity(outer.numel());
    outer.for_each_index(|i| v.push(i));
    v
}

pub(crate) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.shape() != b.shape() {
        return Err(Error::ShapeMismatch {
            op: op.name(),
            lhs: a.shape().to_vec(),
            rhs: b.shape().to_vec(),
        });
    }
    for t in [a, b] {
        if !t.dtype().is_float() {
            return Err(Error::DType {
                op: op.name(),
                got: t.dtype(),
                expected: "a floating dtype (cast integer tensors first)",
            });
        }
    }
    let out_dtype = if a.dtype() == b.dtype() {
        a.dtype()
    } else {
        DType::F32
    };
    let shape = a.shape().to_vec();
    let n = a.numel();
    let mut out = Storage::any(DType::F32, n);
    let o = out.as_mut_slice::<f32>();
    if n == 0 {
        return finish(out, &shape, out_dtype);
    }
    // Keep f32 operands in place (broadcast views included); convert others once.
    let (ta, tb) = (a.f32_or_converted(), b.f32_or_converted());
    let (ga, gb) = (ta.storage(), tb.storage());
    let (sa, sb): (&[f32], &[f32]) = (ga.as_slice(), gb.as_slice());
    let (la, lb) = (ta.layout().clone(), tb.layout().clone());
    if let (Some((a0, a1)), Some((b0, b1))) = (la.contiguous_range(), lb.contiguous_range()) {
        o.par_chunks_mut(CHUNK)
            .zip(
                sa[a0..a1]
                    .par_chunks(CHUNK)
                    .zip(sb[b0..b1].par_chunks(CHUNK)),
            )
            .for_each(|(o, (x, y))| binary_row(op, x, 1, y, 1, o));
        return finish(out, &shape, out_dtype);
    }
    let rank = shape.len();
    let inner = shape[rank - 1];
    let (sa_in, sb_in) = (la.strides()[rank - 1], lb.strides()[rank - 1]);
    let (ra, rb) = (row_offsets(&la), row_offsets(&lb));
    let rows_per_task = (CHUNK / inner.max(1)).max(1);
    o.par_chunks_mut(rows_per_task * inner)
        .enumerate()
        .for_each(|(task, chunk)| {
            let mut tmp_a = Vec::new();
            let mut tmp_b = Vec::new();
            for (r, orow) in chunk.chunks_mut(inner).enumerate() {
                let row = task * rows_per_task + r;
                let xa = strided_row(sa, ra[row], sa_in, inner, &mut tmp_a);
                let xb = strided_row(sb, rb[row], sb_in, inner, &mut tmp_b);
                binary_row(op, xa.0, xa.1, xb.0, xb.1, orow);
            }
        });
    finish(out, &shape, out_dtype)
}

/// A row as a slice with step 0 or 1, gathering into `tmp` when the stride is larger.
fn strided_row<'a>(
    s: &'a [f32],
    start: usize,
    stride: usize,
    n: usize,
    tmp: &'a mut Vec<f32>,
) -> (&'a [f32], usize) {
    match stride {
        0 => (&s[start..start + 1], 0),
        1 => (&s[start..start + n], 1),
        _ => {
            tmp.clear();
            tmp.extend((0..n).map(|i| s[start + i * stride]));
            (&tmp[..], 1)
        }
    }
}

pub(crate) fn add_assign(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.shape() != src.shape() {
        return Err(Error::ShapeMismatch {
            op: "add_assign",
            lhs: dst.shape().to_vec(),
            rhs: src.shape().to_vec(),
        });
    }
    let Some((d0, d1)) = dst.layout().contiguous_range() else {
        return Err(invalid("add_assign", "destination must be contiguous"));
    };
    // Read the source first: it may share storage with the destination.
    let s = src.contig::<f32>().to_vec();
    let mut guard = dst.storage_mut();
    macro_rules! acc {
        ($t:ty) => {{
            let d = &mut guard.as_mut_slice::<$t>()[d0..d1];
            d.par_chunks_mut(CHUNK)
                .zip(s.par_chunks(CHUNK))
                .for_each(|(d, s)| {
                    d.iter_mut().zip(s).for_each(|(d, &s)| {
                        *d = <$t as crate::Element>::from_f32(crate::Element::to_f32(*d) + s)
                    })
                });
        }};
    }
    match dst.dtype() {
        DType::F32 => acc!(f32),
        DType::BF16 => acc!(half::bf16),
        DType::F16 => acc!(half::f16),
        d => {
            return Err(Error::DType {
                op: "add_assign",
                got: d,
                expected: "a floating dtype",
            })
        }
    }
    Ok(())
}
