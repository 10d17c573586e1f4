//! Unary maps, broadcasting binary ops and scalar ops, with their gradients.

use super::be;
use crate::autograd::record;
use crate::error::Result;
use crate::layout::broadcast_shapes;
use crate::{DType, Tensor};

/// Elementwise functions of one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryOp {
    /// -x
    Neg,
    /// e^x
    Exp,
    /// ln x
    Log,
    /// √x
    Sqrt,
    /// 1/√x
    Rsqrt,
    /// tanh x
    Tanh,
    /// 1/(1+e^-x)
    Sigmoid,
    /// x·σ(x)
    Silu,
    /// GELU, tanh approximation
    Gelu,
    /// GELU, exact (erf)
    GeluErf,
    /// max(x, 0)
    Relu,
    /// ln(1+e^x) (linear above 20, like PyTorch)
    Softplus,
    /// |x|
    Abs,
    /// sin x
    Sin,
    /// cos x
    Cos,
}

impl UnaryOp {
    /// The op's name in errors and traces.
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Silu => "silu",
            UnaryOp::Gelu => "gelu",
            UnaryOp::GeluErf => "gelu_erf",
            UnaryOp::Relu => "relu",
            UnaryOp::Softplus => "softplus",
            UnaryOp::Abs => "abs",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
        }
    }
}

/// Elementwise functions of two tensors (broadcasting).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    /// a + b
    Add,
    /// a - b
    Sub,
    /// a · b
    Mul,
    /// a / b
    Div,
    /// max(a, b)
    Maximum,
    /// min(a, b)
    Minimum,
    /// 1 where a ≥ b, else 0 (a mask: not differentiable)
    Ge,
    /// 1 where a ≤ b, else 0 (a mask: not differentiable)
    Le,
    /// 1 where a = b, else 0 (a mask: not differentiable)
    Eq,
}

impl BinaryOp {
    /// The op's name in errors and traces.
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
            BinaryOp::Ge => "ge",
            BinaryOp::Le => "le",
            BinaryOp::Eq => "eq",
        }
    }
}

fn unary(op: UnaryOp, x: &Tensor) -> Result<Tensor> {
    x.check_device(op.name())?;
    let out = be(x)?.unary(op, x)?;
    Ok(record(op.name(), out, &[x], || {
        let x = x.detach();
        move |g: &Tensor| Ok(vec![Some(be(&x)?.unary_grad(op, &x, g)?)])
    }))
}

/// `a` and `b` (detached) broadcast to their common shape, on one device: operands on two
/// devices (a host-built constant beside a GPU tensor) have the host one copied to the GPU, so
/// the op runs there instead of reading device memory on the host.
fn broadcast_on_one_device(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    let shape = broadcast_shapes(op.name(), a.shape(), b.shape())?;
    let (ea, eb) = (a.expand(&shape)?.detach(), b.expand(&shape)?.detach());
    Ok(match (a.device(), b.device()) {
        (da, db) if da == db => (ea, eb),
        (crate::Device::Cpu, db) => (ea.to_device(db)?, eb),
        (da, _) => (ea, eb.to_device(da)?),
    })
}

/// `a op b` with broadcasting. Gradients are summed back to each operand's shape.
pub(crate) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (ea, eb) = broadcast_on_one_device(op, a, b)?;
    let out = be(&ea)?.binary(op, &ea, &eb)?;
    Ok(record(op.name(), out, &[a, b], || {
        let need = (a.requires_grad(), b.requires_grad());
        let (a, b) = (a.detach(), b.detach());
        move |g: &Tensor| {
            let (ga, gb) = match op {
                BinaryOp::Add => (g.clone(), g.clone()),
                BinaryOp::Sub => (g.clone(), g.neg()?),
                BinaryOp::Mul => (g.mul(&b)?, g.mul(&a)?),
                BinaryOp::Div => {
                    let ga = g.div(&b)?;
                    // d(a/b)/db = -a/b² = -(a/b)/b
                    let gb = ga.mul(&a)?.div(&b)?.neg()?;
                    (ga, gb)
                }
                BinaryOp::Maximum | BinaryOp::Minimum => {
                    let pick_a = if op == BinaryOp::Maximum {
                        a.ge(&b)?
                    } else {
                        a.le(&b)?
                    };
                    let ga = g.mul(&pick_a)?;
                    (ga.clone(), g.sub(&ga)?)
                }
                // Masks are flat: no gradient reaches either side.
                BinaryOp::Ge | BinaryOp::Le | BinaryOp::Eq => {
                    let zero = g.mul_scalar(0.0)?;
                    (zero.clone(), zero)
                }
            };
            // Each operand gets its gradient in its own dtype (a bf16 activation added to an
            // f32 residual gets a bf16 gradient), so mixed-precision backward stays in bf16,
            // and on its own device; an operand that takes no gradient (a host-built constant
            // beside a GPU tensor) gets none, so nothing is copied back to the host for it.
            let back = |grad: Tensor, like: &Tensor, needed: bool| -> Result<Option<Tensor>> {
                if !needed {
                    return Ok(None);
                }
                let grad = grad.sum_to_shape(like.shape())?.to_dtype(like.dtype())?;
                Ok(Some(grad.to_device(like.device())?))
            };
            Ok(vec![back(ga, &a, need.0)?, back(gb, &b, need.1)?])
        }
    }))
}

/// `a + b` (crate-internal shorthand used by autograd).
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary(BinaryOp::Add, a, b)
}

macro_rules! unary_methods {
    ($($name:ident => $op:ident),* $(,)?) => {
        impl Tensor {
            $(
                #[doc = concat!("Elementwise `", stringify!($name), "`.")]
                pub fn $name(&self) -> Result<Tensor> {
                    unary(UnaryOp::$op, self)
                }
            )*
        }
    };
}

unary_methods! {
    neg => Neg, exp => Exp, log => Log, sqrt => Sqrt, rsqrt => Rsqrt, tanh => Tanh,
    sigmoid => Sigmoid, silu => Silu, gelu => Gelu, gelu_erf => GeluErf, relu => Relu,
    softplus => Softplus, abs => Abs, sin => Sin, cos => Cos,
}

impl Tensor {
    /// Elementwise sum with broadcasting.
    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryOp::Add, self, rhs)
    }

    /// Elementwise difference with broadcasting.
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryOp::Sub, self, rhs)
    }

    /// Elementwise product with broadcasting.
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryOp::Mul, self, rhs)
    }

    /// Elementwise quotient with broadcasting.
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryOp::Div, self, rhs)
    }

    /// Elementwise maximum with broadcasting (the gradient goes to `self` on ties).
    pub fn maximum(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryOp::Maximum, self, rhs)
    }

    /// Elementwise minimum with broadcasting (the gradient goes to `self` on ties).
    pub fn minimum(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryOp::Minimum, self, rhs)
    }

    /// `self * mul + add` with scalars.
    pub fn affine(&self, mul: f32, add: f32) -> Result<Tensor> {
        self.check_device("affine")?;
        let out = be(self)?.affine(self, mul, add)?;
        Ok(record("affine", out, &[self], || {
            move |g: &Tensor| Ok(vec![Some(be(g)?.affine(g, mul, 0.0)?)])
        }))
    }

    /// `self + v`.
    pub fn add_scalar(&self, v: f32) -> Result<Tensor> {
        self.affine(1.0, v)
    }

    /// `self * v`.
    pub fn mul_scalar(&self, v: f32) -> Result<Tensor> {
        self.affine(v, 0.0)
    }

    /// `self ^ e` for a scalar exponent.
    pub fn powf(&self, e: f32) -> Result<Tensor> {
        self.check_device("pow")?;
        let out = be(self)?.powf(self, e)?;
        Ok(record("pow", out, &[self], || {
            let x = self.detach();
            move |g: &Tensor| {
                let d = be(&x)?.powf(&x, e - 1.0)?.mul_scalar(e)?;
                Ok(vec![Some(g.mul(&d)?)])
            }
        }))
    }

    /// `self` clamped to `[lo, hi]`; the gradient passes where the value was inside.
    pub fn clamp(&self, lo: f32, hi: f32) -> Result<Tensor> {
        self.check_device("clamp")?;
        let out = be(self)?.clamp(self, lo, hi)?;
        Ok(record("clamp", out, &[self], || {
            let x = self.detach();
            move |g: &Tensor| {
                // 1 inside [lo, hi]: the clamped value equals x there (computed where x is).
                let mask = x.clamp(lo, hi)?.eq_mask(&x)?;
                Ok(vec![Some(g.mul(&mask)?)])
            }
        }))
    }

    /// 1.0 where `self >= rhs` (broadcasting), else 0.0; not differentiable.
    pub fn ge(&self, rhs: &Tensor) -> Result<Tensor> {
        compare(BinaryOp::Ge, self, rhs)
    }

    /// 1.0 where `self <= rhs` (broadcasting), else 0.0; not differentiable.
    pub fn le(&self, rhs: &Tensor) -> Result<Tensor> {
        compare(BinaryOp::Le, self, rhs)
    }

    /// 1.0 where `self == rhs` (broadcasting), else 0.0; not differentiable.
    pub fn eq_mask(&self, rhs: &Tensor) -> Result<Tensor> {
        compare(BinaryOp::Eq, self, rhs)
    }

    /// The tensor converted to `dtype`; gradients convert back.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let src = self.dtype();
        let out = be(self)?.cast(self, dtype)?;
        if !dtype.is_float() || !src.is_float() {
            return Ok(out);
        }
        Ok(record("to_dtype", out, &[self], || {
            move |g: &Tensor| Ok(vec![Some(g.to_dtype(src)?)])
        }))
    }

    /// Sums broadcast dims of a gradient back down to `shape`.
    pub(crate) fn sum_to_shape(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let lead = self.rank() - shape.len();
        let mut dims: Vec<isize> = (0..lead as isize).collect();
        for (i, &n) in shape.iter().enumerate() {
            if n == 1 && self.shape()[lead + i] != 1 {
                dims.push((lead + i) as isize);
            }
        }
        self.sum_dims(&dims, true)?.reshape(shape)
    }
}

/// A comparison mask (f32 1.0 / 0.0) of `a` and `b` broadcast together, computed where they
/// live, recorded for no gradient.
fn compare(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (ea, eb) = broadcast_on_one_device(op, a, b)?;
    // Integer operands compare as f32, as before.
    let as_float = |t: Tensor| -> Result<Tensor> {
        if t.dtype().is_float() {
            Ok(t)
        } else {
            t.to_dtype(DType::F32)
        }
    };
    let mask = be(&ea)?.binary(op, &as_float(ea.clone())?, &as_float(eb)?)?;
    mask.to_dtype(DType::F32)
}
