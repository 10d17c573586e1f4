//! Scaled dot-product attention: one fused op (FlashAttention-2 style kernels) covering causal
//! and sliding-window masks, GQA/MQA, Gemma-2 logit soft-capping, gpt-oss attention sinks and
//! explicit positions for decoding against a KV cache.

use super::be;
use crate::autograd::record;
use crate::error::{invalid, Error, Result};
use crate::{DType, Tensor};

/// Options of [`scaled_dot_product_attention`]. `AttentionParams::default()` is plain
/// non-causal attention with scale `1/sqrt(D)`.
#[derive(Clone, Default)]
pub struct AttentionParams {
    /// Multiplies `q·k` before masking; `None` means `1/sqrt(D)`.
    pub scale: Option<f32>,
    /// A query at position `p` sees only keys at positions `<= p`.
    pub causal: bool,
    /// A query at position `p` sees only keys at positions in `(p - window, p]` (implies causal).
    pub sliding_window: Option<usize>,
    /// Logits become `softcap * tanh(logits / softcap)` before masking (Gemma 2).
    pub softcap: Option<f32>,
    /// Per-query-head learned logits `[Hq]` that join every row's softmax denominator without a
    /// value (gpt-oss); they receive a gradient.
    pub sinks: Option<Tensor>,
    /// Absolute positions `[Tq]` (i64 or i32) of the queries. Default `0..Tq`, or the last `Tq`
    /// positions `Tk-Tq..Tk` when `Tq < Tk` (decoding after a cache).
    pub q_pos: Option<Tensor>,
    /// Absolute positions `[Tk]` (i64 or i32) of the keys. Default `0..Tk`.
    pub k_pos: Option<Tensor>,
}

impl AttentionParams {
    /// Causal attention with default scale and positions.
    pub fn causal() -> AttentionParams {
        AttentionParams {
            causal: true,
            ..AttentionParams::default()
        }
    }
}

/// The resolved, validated form of [`AttentionParams`] that backends compute with.
#[derive(Clone, Debug)]
pub struct AttentionSpec {
    /// Logit scale.
    pub scale: f32,
    /// Keys after the query's position are masked.
    pub causal: bool,
    /// Keys at or before `position - window` are masked (and keys after the query too).
    pub window: Option<usize>,
    /// Soft-capping constant of the logits.
    pub softcap: Option<f32>,
    /// Query positions, `Tq` of them.
    pub q_pos: Vec<i64>,
    /// Key positions, `Tk` of them.
    pub k_pos: Vec<i64>,
}

impl AttentionSpec {
    /// True when the query at position `qp` sees the key at position `kp`.
    #[inline]
    pub fn visible(&self, qp: i64, kp: i64) -> bool {
        let causal = self.causal || self.window.is_some();
        (!causal || kp <= qp) && self.window.is_none_or(|w| kp > qp - w as i64)
    }
}

/// Gradients of one attention call (each in its input's dtype).
pub struct AttentionGrads {
    /// d/dq, `[B, Hq, Tq, D]`.
    pub q: Tensor,
    /// d/dk, `[B, Hkv, Tk, D]` (summed over the query heads sharing each kv head).
    pub k: Tensor,
    /// d/dv, `[B, Hkv, Tk, Dv]`.
    pub v: Tensor,
    /// d/dsinks, `[Hq]`, when sinks were given.
    pub sinks: Option<Tensor>,
}

const OP: &str = "attention";

fn positions(t: &Tensor, n: usize, what: &str) -> Result<Vec<i64>> {
    if !matches!(t.dtype(), DType::I64 | DType::I32) {
        return Err(Error::DType {
            op: OP,
            got: t.dtype(),
            expected: "i64 or i32 positions",
        });
    }
    if t.shape() != [n] {
        return Err(invalid(
            OP,
            format!("{what} must have shape [{n}], got {:?}", t.shape()),
        ));
    }
    Ok(t.to_vec::<i64>())
}

/// Checks shapes and options; returns the spec the kernels use.
pub(crate) fn resolve(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttentionParams,
) -> Result<AttentionSpec> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 4 {
            return Err(invalid(
                OP,
                format!("{name} must be [B, H, T, D], got shape {:?}", t.shape()),
            ));
        }
        if !t.dtype().is_float() {
            return Err(Error::DType {
                op: OP,
                got: t.dtype(),
                expected: "a floating dtype",
            });
        }
        t.check_device(OP)?;
    }
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    let mismatch = |a: &[usize], b: &[usize]| Error::ShapeMismatch {
        op: OP,
        lhs: a.to_vec(),
        rhs: b.to_vec(),
    };
    if qs[0] != ks[0] || qs[3] != ks[3] || ks[1] == 0 || qs[1] % ks[1] != 0 {
        return Err(mismatch(qs, ks));
    }
    if ks[..3] != vs[..3] {
        return Err(mismatch(ks, vs));
    }
    let (tq, tk, d) = (qs[2], ks[2], qs[3]);
    if d == 0 {
        return Err(invalid(OP, "the head dim D must be at least 1"));
    }
    let scale = p.scale.unwrap_or(1.0 / (d.max(1) as f32).sqrt());
    if !scale.is_finite() {
        return Err(invalid(OP, format!("scale must be finite, got {scale}")));
    }
    if let Some(c) = p.softcap {
        if !(c > 0.0 && c.is_finite()) {
            return Err(invalid(OP, format!("softcap must be positive, got {c}")));
        }
    }
    if p.sliding_window == Some(0) {
        return Err(invalid(OP, "sliding_window must be at least 1"));
    }
    if let Some(s) = &p.sinks {
        if s.shape() != [qs[1]] {
            return Err(invalid(
                OP,
                format!(
                    "sinks must have shape [{}] (Hq), got {:?}",
                    qs[1],
                    s.shape()
                ),
            ));
        }
        if !s.dtype().is_float() {
            return Err(Error::DType {
                op: OP,
                got: s.dtype(),
                expected: "floating sinks",
            });
        }
    }
    let q_pos = match &p.q_pos {
        Some(t) => positions(t, tq, "q_pos")?,
        None => {
            let start = tk.saturating_sub(tq) as i64;
            (0..tq as i64).map(|i| start + i).collect()
        }
    };
    let k_pos = match &p.k_pos {
        Some(t) => positions(t, tk, "k_pos")?,
        None => (0..tk as i64).collect(),
    };
    Ok(AttentionSpec {
        scale,
        causal: p.causal,
        window: p.sliding_window,
        softcap: p.softcap,
        q_pos,
        k_pos,
    })
}

/// `softmax(mask(softcap(scale · q kᵀ))) v` per batch and head, fused: memory stays
/// `O(T · block)`, the `[Tq, Tk]` score matrix is never stored.
///
/// Shapes: `q [B, Hq, Tq, D]`, `k [B, Hkv, Tk, D]`, `v [B, Hkv, Tk, Dv]` with `Hq` a multiple of
/// `Hkv` (query head `h` reads kv head `h / (Hq / Hkv)`); the result is `[B, Hq, Tq, Dv]` in
/// `q`'s dtype. Rows that see no key (and have no sink) are zero.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttentionParams,
) -> Result<Tensor> {
    // With the packed kernel the CPU attention is row-independent by itself (see
    // `cpu::attention::forward`); elsewhere queries and keys are padded onto aligned tiles.
    if crate::invariant::batch_invariant() && !crate::cpu::sgemm_available() {
        if let Some(out) = invariant_attention(q, k, v, params)? {
            return Ok(out);
        }
    }
    let spec = resolve(q, k, v, params)?;
    let sinks = params.sinks.as_ref();
    let (out, lse) = be(q)?.attention(
        &q.detach(),
        &k.detach(),
        &v.detach(),
        sinks.map(|s| s.detach()).as_ref(),
        &spec,
    )?;
    let mut inputs = vec![q, k, v];
    if let Some(s) = sinks {
        inputs.push(s);
    }
    let saved_out = out.clone();
    Ok(record("attention", out, &inputs, || {
        let (q, k, v) = (q.detach(), k.detach(), v.detach());
        let sinks = sinks.map(|s| s.detach());
        move |g: &Tensor| {
            let grads = be(&q)?.attention_backward(
                &q,
                &k,
                &v,
                sinks.as_ref(),
                &saved_out,
                &lse,
                g,
                &spec,
            )?;
            let mut out = vec![Some(grads.q), Some(grads.k), Some(grads.v)];
            if sinks.is_some() {
                out.push(grads.sinks);
            }
            Ok(out)
        }
    }))
}

impl Tensor {
    /// `scaled_dot_product_attention(self, k, v, params)`: see [`scaled_dot_product_attention`].
    pub fn attention(&self, k: &Tensor, v: &Tensor, params: &AttentionParams) -> Result<Tensor> {
        scaled_dot_product_attention(self, k, v, params)
    }
}

/// Consecutive positions `start..start + n` of an optional position tensor, if they are.
fn consecutive(pos: Option<&Tensor>, default_start: i64, n: usize) -> Option<i64> {
    let Some(p) = pos else {
        return Some(default_start);
    };
    let v = p.to_vec::<i64>();
    let s = *v.first()?;
    if v.len() != n {
        return None;
    }
    v.iter()
        .enumerate()
        .all(|(i, &x)| x == s + i as i64)
        .then_some(s)
}

/// Zero rows along dim 2 of a `[B, H, T, D]`-shaped tensor.
fn zero_rows(like: &Tensor, n: usize) -> Result<Tensor> {
    let s = like.shape();
    Tensor::zeros_on(&[s[0], s[1], n, s[3]], like.dtype(), like.device())
}

/// Batch-invariant attention: queries and keys are laid out on 64-aligned blocks by position
/// (zero-padded), so a query row meets the same tiles, in the same order, whether it is computed
/// in a full causal forward or in a decode step against a KV cache. Applies to causal attention
/// over keys at positions `0..Tk` and consecutive query positions; `None` otherwise.
fn invariant_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttentionParams,
) -> Result<Option<Tensor>> {
    use crate::invariant::TILE;
    if !params.causal || q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        return Ok(None);
    }
    let (tq, tk) = (q.shape()[2], k.shape()[2]);
    if tq == 0 || tk == 0 {
        return Ok(None);
    }
    if consecutive(params.k_pos.as_ref(), 0, tk) != Some(0) {
        return Ok(None);
    }
    let Some(q0) = consecutive(params.q_pos.as_ref(), tk as i64 - tq as i64, tq) else {
        return Ok(None);
    };
    if q0 < 0 || q0 as usize + tq > tk {
        return Ok(None);
    }
    let base = q0 as usize / TILE * TILE;
    let lead = q0 as usize - base;
    let rows = (lead + tq).div_ceil(TILE) * TILE;
    let keys = tk.div_ceil(TILE) * TILE;
    let pad = |t: &Tensor, before: usize, after: usize| -> Result<Tensor> {
        let mut parts = Vec::new();
        if before > 0 {
            parts.push(zero_rows(t, before)?);
        }
        parts.push(t.clone());
        if after > 0 {
            parts.push(zero_rows(t, after)?);
        }
        if parts.len() == 1 {
            return Ok(t.clone());
        }
        crate::ops::cat(&parts, 2)
    };
    let qp = pad(q, lead, rows - lead - tq)?;
    let (kp, vp) = (pad(k, 0, keys - tk)?, pad(v, 0, keys - tk)?);
    let positions = |start: usize, n: usize| {
        Tensor::from_vec((start as i64..(start + n) as i64).collect::<Vec<_>>(), &[n])
    };
    let padded = AttentionParams {
        q_pos: Some(positions(base, rows)?),
        k_pos: Some(positions(0, keys)?),
        ..params.clone()
    };
    let _plain = crate::invariant::set_batch_invariant(false);
    let out = scaled_dot_product_attention(&qp, &kp, &vp, &padded)?;
    Ok(Some(out.narrow(2, lead, tq)?))
}
