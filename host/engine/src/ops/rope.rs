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

/// YaRN frequency scaling (Hugging Face `rope_type = "yarn"`, gpt-oss and DeepSeek-V3):
/// high frequencies are kept, low ones divided by `factor`, with a linear ramp between the
/// dims that turn `beta_fast` and `beta_slow` times over the original context; the tables are
/// multiplied by an attention factor that sharpens the softmax at long range.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnScaling {
    /// How much longer the context is than the original one.
    pub factor: f64,
    /// Dims that rotate at least this many times over the original context are kept.
    pub beta_fast: f64,
    /// Dims that rotate at most this many times are fully interpolated.
    pub beta_slow: f64,
    /// The context length the model was pretrained with.
    pub original_max_position_embeddings: usize,
    /// Round the ramp's ends to whole dims (Hugging Face's default; gpt-oss turns it off).
    pub truncate: bool,
    /// The factor on `cos` and `sin`; `None` derives it from `factor` (and `mscale`,
    /// `mscale_all_dim` when both are given) as Hugging Face does.
    pub attention_factor: Option<f64>,
    /// DeepSeek's numerator scale of the derived attention factor.
    pub mscale: Option<f64>,
    /// DeepSeek's denominator scale of the derived attention factor.
    pub mscale_all_dim: Option<f64>,
}

impl YarnScaling {
    /// The factor `cos` and `sin` are multiplied by.
    pub fn attention_factor(&self) -> f64 {
        let m = |scale: f64, mscale: f64| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * mscale * scale.ln() + 1.0
            }
        };
        match (self.attention_factor, self.mscale, self.mscale_all_dim) {
            (Some(a), _, _) => a,
            (None, Some(ms), Some(all)) if ms != 0.0 && all != 0.0 => {
                m(self.factor, ms) / m(self.factor, all)
            }
            _ => m(self.factor, 1.0),
        }
    }

    /// The `rot_dim / 2` frequencies from the unscaled `base` ones (`theta^(-2i / rot_dim)`).
    fn scale(&self, base: &[f64], rot_dim: usize, theta: f64) -> Vec<f64> {
        let orig = self.original_max_position_embeddings as f64;
        // The (fractional) dim whose wavelength fits `turns` times into the original context.
        let dim_of = |turns: f64| {
            rot_dim as f64 * (orig / (turns * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (dim_of(self.beta_fast), dim_of(self.beta_slow));
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, high) = (low.max(0.0), high.min(rot_dim as f64 - 1.0));
        let span = if low == high { 0.001 } else { high - low };
        base.iter()
            .enumerate()
            .map(|(i, &f)| {
                let ramp = ((i as f64 - low) / span).clamp(0.0, 1.0);
                // `ramp` is 0 for the fast dims (kept) and 1 for the slow ones (interpolated).
                f / self.factor * ramp + f * (1.0 - ramp)
            })
            .collect()
    }
}

/// How the base frequencies are stretched for a longer context.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// Llama 3's wavelength bands.
    Llama3(Llama3Scaling),
    /// YaRN's ramp and attention factor.
    Yarn(YarnScaling),
}

impl From<Llama3Scaling> for RopeScaling {
    fn from(s: Llama3Scaling) -> Self {
        RopeScaling::Llama3(s)
    }
}

impl From<YarnScaling> for RopeScaling {
    fn from(s: YarnScaling) -> Self {
        RopeScaling::Yarn(s)
    }
}

impl RopeScaling {
    /// The factor on the `cos` and `sin` tables (1 but for YaRN).
    pub fn attention_factor(&self) -> f64 {
        match self {
            RopeScaling::Llama3(_) => 1.0,
            RopeScaling::Yarn(y) => y.attention_factor(),
        }
    }
}

/// The `rot_dim / 2` inverse frequencies `theta^(-2i / rot_dim)`, with optional Llama 3 or
/// YaRN scaling, computed in f64 by the same formulas as Hugging Face's
/// `_compute_llama3_parameters` and `_compute_yarn_parameters`.
pub fn rope_inv_freq(rot_dim: usize, theta: f64, scaling: Option<RopeScaling>) -> Vec<f64> {
    let half = rot_dim / 2;
    let base: Vec<f64> = (0..half)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / rot_dim as f64))
        .collect();
    match scaling {
        None => base,
        Some(RopeScaling::Yarn(y)) => y.scale(&base, rot_dim, theta),
        Some(RopeScaling::Llama3(s)) => base
            .into_iter()
            .map(|f| {
                let old = s.original_max_position_embeddings as f64;
                let (low_wl, high_wl) = (old / s.low_freq_factor, old / s.high_freq_factor);
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < high_wl {
                    f
                } else if wavelen > low_wl {
                    f / s.factor
                } else {
                    let smooth = (old / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * f / s.factor + smooth * f
                }
            })
            .collect(),
    }
}

/// `(cos, sin)` tables of shape `positions.shape + [rot_dim / 2]` for integer `positions`
/// (`[T]` gives `[T, R]`, `[B, T]` gives per-sequence `[B, T, R]`), angles
/// `position * inv_freq` computed in f64 and rounded to f32 (times YaRN's attention factor).
pub fn rope_tables(
    positions: &Tensor,
    rot_dim: usize,
    theta: f64,
    scaling: Option<RopeScaling>,
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
    let gain = scaling.map_or(1.0, |s| s.attention_factor());
    if !(gain.is_finite() && gain > 0.0) {
        return Err(invalid(
            OP,
            format!("the attention factor must be > 0, got {gain}"),
        ));
    }
    let pos = positions.to_vec::<i64>();
    let mut cos = Vec::with_capacity(pos.len() * inv.len());
    let mut sin = Vec::with_capacity(pos.len() * inv.len());
    for &p in &pos {
        for &f in &inv {
            let a = p as f64 * f;
            cos.push((a.cos() * gain) as f32);
            sin.push((a.sin() * gain) as f32);
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
        self.check_device(OP)?;
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
