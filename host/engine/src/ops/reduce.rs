//! Reductions: sum, mean, max, min, argmax, argmin, var.

use super::be;
use crate::autograd::record;
use crate::error::Result;
use crate::layout::resolve_dim;
use crate::{DType, Tensor};

/// Reductions over one dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Σ
    Sum,
    /// maximum value
    Max,
    /// minimum value
    Min,
    /// index of the (first) maximum, as i64
    ArgMax,
    /// index of the (first) minimum, as i64
    ArgMin,
}

impl ReduceOp {
    /// The op's name in errors and traces.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
            ReduceOp::ArgMin => "argmin",
        }
    }
}

/// Resolves, dedups and sorts (descending) a list of dims; empty means all dims.
fn resolve_dims(op: &'static str, dims: &[isize], rank: usize) -> Result<Vec<usize>> {
    let mut v: Vec<usize> = if dims.is_empty() {
        (0..rank).collect()
    } else {
        dims.iter()
            .map(|&d| resolve_dim(op, d, rank))
            .collect::<Result<_>>()?
    };
    v.sort_unstable_by(|a, b| b.cmp(a));
    v.dedup();
    Ok(v)
}

fn kept_shape(shape: &[usize], dims: &[usize]) -> Vec<usize> {
    let mut s = shape.to_vec();
    for &d in dims {
        s[d] = 1;
    }
    s
}

fn squeezed_shape(shape: &[usize], dims: &[usize]) -> Vec<usize> {
    shape
        .iter()
        .enumerate()
        .filter(|(i, _)| !dims.contains(i))
        .map(|(_, &n)| n)
        .collect()
}

impl Tensor {
    /// Sum over `dims` (all dims when empty).
    pub fn sum_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let dims = resolve_dims("sum", dims, self.rank())?;
        let mut out = self.detach();
        for &d in &dims {
            out = be(self)?.reduce(ReduceOp::Sum, &out, d)?;
        }
        if self.rank() == 0 {
            out = self.detach().materialize(self.dtype());
        }
        let kept = kept_shape(self.shape(), &dims);
        let final_shape = if keepdim {
            kept.clone()
        } else {
            squeezed_shape(self.shape(), &dims)
        };
        let out = out.reshape(&final_shape)?;
        let in_shape = self.shape().to_vec();
        Ok(record("sum", out, &[self], || {
            move |g: &Tensor| {
                Ok(vec![Some(
                    g.reshape(&kept)?.expand(&in_shape)?.contiguous()?,
                )])
            }
        }))
    }

    /// Sum of every element, as a 0-d tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        self.sum_dims(&[], false)
    }

    /// Mean over `dims` (all dims when empty).
    pub fn mean_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let rd = resolve_dims("mean", dims, self.rank())?;
        let n: usize = rd.iter().map(|&d| self.shape()[d]).product();
        self.sum_dims(dims, keepdim)?
            .mul_scalar(1.0 / n.max(1) as f32)
    }

    /// Mean of every element, as a 0-d tensor.
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean_dims(&[], false)
    }

    /// Maximum over one dim; the gradient is shared equally among tied maxima.
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        self.extreme(ReduceOp::Max, dim, keepdim)
    }

    /// Minimum over one dim; the gradient is shared equally among tied minima.
    pub fn min_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        self.extreme(ReduceOp::Min, dim, keepdim)
    }

    fn extreme(&self, op: ReduceOp, dim: isize, keepdim: bool) -> Result<Tensor> {
        let d = resolve_dim(op.name(), dim, self.rank())?;
        let kept = be(self)?.reduce(op, &self.detach(), d)?;
        let shape = if keepdim {
            kept.shape().to_vec()
        } else {
            squeezed_shape(self.shape(), &[d])
        };
        let out = kept.reshape(&shape)?;
        Ok(record(op.name(), out, &[self], || {
            let x = self.detach();
            move |g: &Tensor| {
                let hit = x.eq_mask(&kept)?;
                let count = hit.sum_dims(&[d as isize], true)?;
                let g = g.reshape(kept.shape())?;
                Ok(vec![Some(hit.mul(&g.div(&count)?)?)])
            }
        }))
    }

    /// Index of the first maximum along `dim`, as i64.
    pub fn argmax(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        self.arg_extreme(ReduceOp::ArgMax, dim, keepdim)
    }

    /// Index of the first minimum along `dim`, as i64.
    pub fn argmin(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        self.arg_extreme(ReduceOp::ArgMin, dim, keepdim)
    }

    fn arg_extreme(&self, op: ReduceOp, dim: isize, keepdim: bool) -> Result<Tensor> {
        let d = resolve_dim(op.name(), dim, self.rank())?;
        let out = be(self)?.reduce(op, &self.detach(), d)?;
        debug_assert_eq!(out.dtype(), DType::I64);
        if keepdim {
            Ok(out)
        } else {
            out.reshape(&squeezed_shape(self.shape(), &[d]))
        }
    }

    /// Variance over `dims` with `correction` (1 = unbiased, like PyTorch's default).
    pub fn var_dims(&self, dims: &[isize], correction: usize, keepdim: bool) -> Result<Tensor> {
        let rd = resolve_dims("var", dims, self.rank())?;
        let n: usize = rd.iter().map(|&d| self.shape()[d]).product();
        let mean = self.mean_dims(dims, true)?;
        let dev = self.sub(&mean)?;
        let ss = dev.mul(&dev)?.sum_dims(dims, keepdim)?;
        ss.mul_scalar(1.0 / (n as f32 - correction as f32).max(0.0))
    }
}

/// The values of `tensors`, each flattened, in order, as f64: what a step logs, read together.
/// Consecutive tensors on one GPU are joined there and come back in one device→host copy (one
/// wait for the device's queue), however many there are; host tensors are read in place.
pub fn read_values(tensors: &[Tensor]) -> Result<Vec<f64>> {
    let mut out = Vec::new();
    let mut rest = tensors;
    while let Some(first) = rest.first() {
        let run = rest
            .iter()
            .take_while(|t| t.device() == first.device())
            .count();
        let (these, after) = rest.split_at(run);
        rest = after;
        if first.device() == crate::Device::Cpu || run == 1 {
            for t in these {
                out.extend(t.to_vec_f32().into_iter().map(f64::from));
            }
            continue;
        }
        let flat = these
            .iter()
            .map(|t| {
                t.detach()
                    .to_dtype(crate::DType::F32)?
                    .reshape(&[t.numel()])
            })
            .collect::<Result<Vec<_>>>()?;
        out.extend(
            crate::ops::cat(&flat, 0)?
                .to_vec_f32()
                .into_iter()
                .map(f64::from),
        );
    }
    Ok(out)
}

/// `Σ x²` of each of `tensors` (one device, any float dtype) as an f32 tensor
/// `[tensors.len()]` on that device: a gradient norm's parts in one pass (on a GPU two launches
/// whatever the count, each tensor's chunks summed in a fixed order). Not differentiable.
pub fn sum_of_squares_each(tensors: &[&Tensor]) -> Result<Tensor> {
    let Some(first) = tensors.first() else {
        return Tensor::from_vec(Vec::<f32>::new(), &[0]);
    };
    if let Some(t) = tensors.iter().find(|t| t.device() != first.device()) {
        return Err(crate::error::invalid(
            "sum_of_squares_each",
            format!("tensors on {} and {}", first.device(), t.device()),
        ));
    }
    crate::backend::optim_backend_for(first.device())?.sum_of_squares(tensors)
}

impl Tensor {
    /// `Σ x²` over all elements, accumulated in f64 over chunks whose bounds depend only on the
    /// size and summed in order, so the value is bitwise identical for any thread count. Not
    /// differentiable; meant for gradient norms.
    pub fn sum_of_squares(&self) -> f64 {
        use rayon::prelude::*;
        let _p = crate::profile::scope("sum_of_squares");
        if self.device() != crate::Device::Cpu {
            // On a GPU: [`sum_of_squares_each`]'s kernels there, one value read back, instead of
            // downloading the whole tensor.
            let on_device =
                || -> Result<f64> { Ok(f64::from(sum_of_squares_each(&[self])?.item()?)) };
            if let Ok(v) = on_device() {
                return v;
            }
        }
        let values = self.contig::<f32>();
        let parts: Vec<f64> = values
            .par_chunks(1 << 15)
            .map(|chunk| chunk.iter().map(|&x| x as f64 * x as f64).sum::<f64>())
            .collect();
        parts.iter().sum()
    }
}
