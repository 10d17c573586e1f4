//! Cross-entropy fused with log-softmax: one forward pass per row (online max / sum-exp), one
//! backward pass writing `(softmax - smoothed one-hot) * scale`.

use super::{fused, require_float};
use crate::autograd::record;
use crate::error::{Error, Result};
use crate::{DType, Tensor};

/// How per-token losses combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// Mean over the non-ignored tokens (0, with zero gradients, when every token is ignored;
    /// PyTorch returns NaN there).
    Mean,
    /// Sum over the non-ignored tokens.
    Sum,
    /// One loss per token, shaped like `targets` (0 at ignored tokens).
    None,
}

/// Options of [`cross_entropy`]; the default matches PyTorch's (`ignore_index = -100`, mean).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropy {
    /// Targets equal to this contribute nothing and are not counted.
    pub ignore_index: Option<i64>,
    /// How per-token losses combine.
    pub reduction: Reduction,
    /// `ε` in `(1-ε)·nll + ε·mean_j(-log p_j)` (PyTorch's `label_smoothing`), in `[0, 1]`.
    pub label_smoothing: f32,
}

impl Default for CrossEntropy {
    fn default() -> Self {
        CrossEntropy {
            ignore_index: Some(-100),
            reduction: Reduction::Mean,
            label_smoothing: 0.0,
        }
    }
}

/// Cross-entropy of `logits [.., V]` (f32, bf16 or f16; computed in f32) against integer
/// `targets [..]` (i64 or i32). A target outside `0..V` that is not `ignore_index` is an
/// [`Error::IndexOutOfRange`]. Returns a 0-d f32 loss (mean, sum) or per-token f32 losses (none).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, opts: &CrossEntropy) -> Result<Tensor> {
    const OP: &str = "cross_entropy";
    require_float(OP, logits)?;
    logits.check_device(OP)?;
    if !matches!(targets.dtype(), DType::I64 | DType::I32) {
        return Err(Error::DType {
            op: OP,
            got: targets.dtype(),
            expected: "i64 or i32 targets",
        });
    }
    let r = logits.rank();
    if r == 0 || logits.shape()[..r - 1] != *targets.shape() {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: logits.shape().to_vec(),
            rhs: targets.shape().to_vec(),
        });
    }
    let eps = opts.label_smoothing;
    if !(0.0..=1.0).contains(&eps) {
        return Err(crate::error::invalid(
            OP,
            format!("label_smoothing must be in [0, 1], got {eps}"),
        ));
    }
    let v = logits.shape()[r - 1];
    let n = targets.numel();
    let logits2 = logits.reshape(&[n, v])?;
    let tg = targets.reshape(&[n])?.detach();
    let ignore = opts.ignore_index;
    let (rows, lse) = fused(logits)?.cross_entropy(&logits2.detach(), &tg, ignore, eps)?;
    let valid = Valid::of(&tg, ignore)?;
    let reduction = opts.reduction;
    let out = match (reduction, &valid) {
        (Reduction::None, _) => rows,
        (_, Valid::Host { n_valid, .. }) => {
            let div = if reduction == Reduction::Mean {
                (*n_valid).max(1) as f64
            } else {
                1.0
            };
            if logits.device() == crate::Device::Cpu {
                // Sequential f64 sum: a fixed order whatever the thread count.
                let total: f64 = rows.to_vec_f32().iter().map(|&l| l as f64).sum();
                Tensor::scalar((total / div) as f32)
            } else {
                // Summed where the rows are (the device's fixed-order reduction): the loss
                // stays on the device until the step reads its logged scalars.
                rows.sum_all()?.mul_scalar((1.0 / div) as f32)?
            }
        }
        (_, Valid::Device { inv_count, .. }) => match reduction {
            Reduction::Mean => rows.sum_all()?.mul(inv_count)?,
            _ => rows.sum_all()?,
        },
    };
    let out = record(OP, out, &[&logits2], || {
        let x = logits2.detach();
        move |g: &Tensor| {
            let scale = match &valid {
                Valid::Host { valid, n_valid } if g.device() == crate::Device::Cpu => {
                    host_row_scale(&g.to_vec_f32(), valid, reduction, *n_valid)?
                        .to_device(x.device())?
                }
                Valid::Host { valid, n_valid } => {
                    let mask: Vec<f32> = valid.iter().map(|&ok| f32::from(u8::from(ok))).collect();
                    let mask = Tensor::from_vec(mask, &[valid.len()])?.to_device(g.device())?;
                    let inv = (reduction == Reduction::Mean && *n_valid > 0)
                        .then(|| 1.0 / *n_valid as f32);
                    device_row_scale(g, &mask, reduction, |t| match inv {
                        Some(inv) => t.mul_scalar(inv),
                        None => Ok(t),
                    })?
                }
                Valid::Device { mask, inv_count } => {
                    device_row_scale(g, mask, reduction, |t| match reduction {
                        Reduction::Mean => t.mul(inv_count),
                        _ => Ok(t),
                    })?
                }
            };
            Ok(vec![Some(fused(&x)?.cross_entropy_backward(
                &x, &tg, &lse, &scale, ignore, eps,
            )?)])
        }
    });
    match reduction {
        Reduction::None => out.reshape(targets.shape()),
        _ => Ok(out),
    }
}

/// Which rows count (their target is not the ignored index).
enum Valid {
    /// Read from targets whose values are on the host.
    Host {
        /// Per row.
        valid: Vec<bool>,
        /// How many.
        n_valid: usize,
    },
    /// Computed where targets the device made live, never read back.
    Device {
        /// `[n]` f32: 1 for a counted row.
        mask: Tensor,
        /// 0-d f32: `1 / max(rows counted, 1)`.
        inv_count: Tensor,
    },
}

impl Valid {
    fn of(tg: &Tensor, ignore: Option<i64>) -> Result<Valid> {
        if tg.host_resident() {
            let valid: Vec<bool> = tg
                .to_vec::<i64>()
                .iter()
                .map(|&t| Some(t) != ignore)
                .collect();
            let n_valid = valid.iter().filter(|&&b| b).count();
            return Ok(Valid::Host { valid, n_valid });
        }
        let _g = crate::autograd::no_grad();
        let t = tg.to_dtype(DType::F32)?;
        let mask = match ignore {
            // Token ids are exact in f32 (below 2²⁴).
            Some(i) => {
                let ignored = Tensor::scalar(i as f32).to_device(tg.device())?;
                t.eq_mask(&ignored)?.mul_scalar(-1.0)?.add_scalar(1.0)?
            }
            None => t.mul_scalar(0.0)?.add_scalar(1.0)?,
        };
        let count = mask.sum_all()?.clamp(1.0, f32::INFINITY)?;
        let one = Tensor::scalar(1.0).to_device(tg.device())?;
        Ok(Valid::Device {
            inv_count: one.div(&count)?,
            mask,
        })
    }
}

/// The cross-entropy backward's per-row scale from the output gradient `gv` read on the host.
fn host_row_scale(
    gv: &[f32],
    valid: &[bool],
    reduction: Reduction,
    n_valid: usize,
) -> Result<Tensor> {
    let scale: Vec<f32> = match reduction {
        Reduction::None => valid
            .iter()
            .zip(gv)
            .map(|(&ok, &g)| if ok { g } else { 0.0 })
            .collect(),
        Reduction::Sum | Reduction::Mean => {
            let s = if reduction == Reduction::Mean && n_valid > 0 {
                gv[0] / n_valid as f32
            } else {
                gv[0]
            };
            valid.iter().map(|&ok| if ok { s } else { 0.0 }).collect()
        }
    };
    Tensor::from_vec(scale, &[valid.len()])
}

/// [`host_row_scale`] where the output gradient `g` lives on a GPU: `mask · g`, then `mean`
/// for the mean's division; the gradient never comes down.
fn device_row_scale(
    g: &Tensor,
    mask: &Tensor,
    reduction: Reduction,
    mean: impl Fn(Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let g = match reduction {
        // One gradient per row, shaped like the targets.
        Reduction::None => g.detach().reshape(&[mask.numel()])?,
        // A 0-d gradient, broadcast over the rows.
        Reduction::Sum | Reduction::Mean => g.detach(),
    };
    let scaled = mask.mul(&g)?;
    match reduction {
        Reduction::Mean => mean(scaled),
        _ => Ok(scaled),
    }
}

impl Tensor {
    /// [`cross_entropy`] of these logits against `targets`.
    pub fn cross_entropy(&self, targets: &Tensor, opts: &CrossEntropy) -> Result<Tensor> {
        cross_entropy(self, targets, opts)
    }
}
