//! Rotary position embedding (RoPE), fused: one kernel rotates every pair of `x` by its
//! position's angle; the backward rotates the gradient by the negative angle.
//!
//! Two pairings: **interleaved** `(2i, 2i+1)` (the RoFormer paper, Meta's Llama reference) and
//! **half-split** `(i, i + R)` (Hugging Face's `rotate_half`). With tables `[.., R]`, the first
//! `2R` features rotate and the rest pass through (partial rotary).

use super::{fused, require_float};
use crate::autograd::record;
use crate::error::{invalid, Error, Result};
use crate::{DType, Tensor};

/// Which features form a rotating pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i+1)`: the original paper and Meta's Llama code.
    Interleaved,
    /// Pairs `(i, i + rot_dim/2)`: Hugging Face `rotate_half`.
    HalfSplit,
}

/// Where the sequence and head dims sit in a rank-4 `x`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// `[batch, heads, seq, head_dim]`.
    Bhtd,
    /// `[batch, seq, heads, head_dim]`.
    Bthd,
}

/// How to apply RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeSpec {
    /// The pairing of features.
    pub style: RopeStyle,
    /// The layout of `x`.
    pub layout: RopeLayout,
}

/// Llama 3 frequency scaling (Hugging Face `rope_type = "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    /// Divides the low frequencies (`factor`).
    pub factor: f64,
    /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled fully.
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context length the model was pretrained with.
    pub original_max_position_embeddings: usize,
}

/// The `rot_dim / 2` inverse frequencies `theta^(-2i / rot_dim)`, with optional Llama 3 scaling,
/// computed in f64 by the same formula as Hugging Face's `_compute_llama3_parameters`.
pub fn rope_inv_freq(rot_dim: usize, theta: f64, scaling: Option<Llama3Scaling>) -> Vec<f64> {
    let half = rot_dim / 2;
    (0..half)
        .map(|i| {
            let f = 1.0 / theta.powf((2 * i) as f64 / rot_dim as f64);
            let Some(s) = scaling else { return f };
            let old = s.original_max_position_embeddings as f64;
            let (low_wl, high_wl) = (old / s.low_freq_factor, old / s.high_freq_factor);
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < high_wl {
                f
            } else if wavelen > low_wl {
                f / s.factor
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

/// `(cos, sin)` tables of shape `positions.shape + [rot_dim / 2]` for integer `positions`
/// (`[T]` gives `[T, R]`, `[B, T]` gives per-sequence `[B, T, R]`), angles
/// `position * inv_freq` computed in f64 and rounded to f32.
pub fn rope_tables(
    positions: &Tensor,
    rot_dim: usize,
    theta: f64,
    scaling: Option<Llama3Scaling>,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "rope_tables";
    if positions.dtype().is_float() {
        return Err(Error::DType {
            op: OP,
            got: positions.dtype(),
            expected: "i64 or i32 positions",
        });
    }
    if rot_dim == 0 || !rot_dim.is_multiple_of(2) {
        return Err(invalid(
            OP,
            format!("rot_dim must be even and > 0, got {rot_dim}"),
        ));
    }
    if theta.is_nan() || theta <= 0.0 {
        return Err(invalid(OP, format!("theta must be > 0, got {theta}")));
    }
    let inv = rope_inv_freq(rot_dim, theta, scaling);
    let pos = positions.to_vec::<i64>();
    let mut cos = Vec::with_capacity(pos.len() * inv.len());
    let mut sin = Vec::with_capacity(pos.len() * inv.len());
    for &p in &pos {
        for &f in &inv {
            let a = p as f64 * f;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    let mut shape = positions.shape().to_vec();
    shape.push(inv.len());
    Ok((
        Tensor::from_vec(cos, &shape)?,
        Tensor::from_vec(sin, &shape)?,
    ))
}

impl Tensor {
    /// Applies rotary position embedding to rank-4 `x` (`spec.layout` says which of dims 1, 2 is
    /// the sequence) with `cos`/`sin` tables `[T, R]` (shared by the batch) or `[B, T, R]`,
    /// `2R <= head_dim`. Gradients flow to `x` only (the tables are constants).
    pub fn rope(&self, cos: &Tensor, sin: &Tensor, spec: RopeSpec) -> Result<Tensor> {
        const OP: &str = "rope";
        require_float(OP, self)?;
        self.check_cpu(OP)?;
        let mismatch = |t: &Tensor| Error::ShapeMismatch {
            op: OP,
            lhs: self.shape().to_vec(),
            rhs: t.shape().to_vec(),
        };
        if self.rank() != 4 {
            return Err(invalid(
                OP,
                format!(
                    "x must be rank 4 ([B, H, T, D] or [B, T, H, D]), got {:?}",
                    self.shape()
                ),
            ));
        }
        if cos.shape() != sin.shape() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: cos.shape().to_vec(),
                rhs: sin.shape().to_vec(),
            });
        }
        let s = self.shape();
        let t_len = match spec.layout {
            RopeLayout::Bhtd => s[2],
            RopeLayout::Bthd => s[1],
        };
        let ok = match cos.shape() {
            [t, r] => *t == t_len && 2 * r <= s[3],
            [b, t, r] => *b == s[0] && *t == t_len && 2 * r <= s[3],
            _ => false,
        };
        if !ok {
            return Err(mismatch(cos));
        }
        let (c, sn) = (
            cos.to_dtype(DType::F32)?.detach(),
            sin.to_dtype(DType::F32)?.detach(),
        );
        let out = fused(self)?.rope(&self.detach(), &c, &sn, spec, false)?;
        Ok(record(OP, out, &[self], || {
            move |g: &Tensor| Ok(vec![Some(fused(g)?.rope(g, &c, &sn, spec, true)?)])
        }))
    }
}
