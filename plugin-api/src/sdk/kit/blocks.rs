//! Pieces the families repeat, each written once with host ops: the SwiGLU feed-forward, a
//! sigmoid gate, soft-capped values, grouped-query attention with its variants (QK-norm, RoPE
//! or none, a sliding window, sinks, an output gate) and a gated shared expert.

use crate::sdk::vision::mrope;
use crate::sdk::{AttentionOpts, Ctx, Param, Result, Rope, Tensor};

/// `W2 · (SiLU(W1 · x) ⊙ W3 · x)`.
pub fn swiglu<'h>(
    ctx: &Ctx<'h>,
    x: &Tensor<'h>,
    w1: &Param,
    w3: &Param,
    w2: &Param,
) -> Result<Tensor<'h>> {
    let gate = x.linear(&ctx.w(w1)?)?;
    let up = x.linear(&ctx.w(w3)?)?;
    gate.swiglu(&up)?.linear(&ctx.w(w2)?)
}

/// `x ⊙ sigmoid(gate)`.
pub fn gated<'h>(x: &Tensor<'h>, gate: &Tensor<'h>) -> Result<Tensor<'h>> {
    x.mul(&gate.unary("sigmoid")?)
}

/// `x / rms(x)`: RMSNorm without a gain (`x · (mean(x²) + eps)^-½`).
pub fn scaleless_rms_norm<'h>(ctx: &Ctx<'h>, x: &Tensor<'h>, eps: f64) -> Result<Tensor<'h>> {
    let d = *x.shape()?.last().ok_or("scaleless_rms_norm: a scalar")?;
    let ones = ctx
        .host
        .constant_f32(&[d], &vec![1.0; d], x)?
        .to_dtype(&x.dtype()?)?;
    x.rms_norm(&ones, eps)
}

/// `c · tanh(z / c)`: values squashed smoothly into `(-c, c)` (soft-capped logits).
pub fn softcap<'h>(z: &Tensor<'h>, c: f64) -> Result<Tensor<'h>> {
    z.scale(1.0 / c)?.unary("tanh")?.scale(c)
}

/// `routed + sigmoid(x · g) ⊙ SwiGLU_shared(x)`: a shared expert beside routed ones, scaled by
/// its own gate (Qwen-MoE style).
pub fn gated_shared_expert<'h>(
    ctx: &Ctx<'h>,
    x: &Tensor<'h>,
    routed: &Tensor<'h>,
    [w1, w3, w2]: [&Param; 3],
    gate: &Param,
) -> Result<Tensor<'h>> {
    let g = x.linear(&ctx.w(gate)?)?.unary("sigmoid")?;
    routed.add(&swiglu(ctx, x, w1, w3, w2)?.mul(&g)?)
}

/// A linear projection with an optional bias.
#[derive(Clone, Debug)]
pub struct Proj {
    /// `[out, in]`.
    pub weight: Param,
    /// `[out]`.
    pub bias: Option<Param>,
}

impl Proj {
    /// A projection without a bias.
    pub fn new(weight: Param) -> Self {
        Proj { weight, bias: None }
    }

    /// `x · Wᵀ (+ b)`.
    pub fn apply<'h>(&self, ctx: &Ctx<'h>, x: &Tensor<'h>) -> Result<Tensor<'h>> {
        let y = x.linear(&ctx.w(&self.weight)?)?;
        match &self.bias {
            Some(b) => y.add(&ctx.w(b)?),
            None => Ok(y),
        }
    }
}

/// The parameters of grouped-query attention.
#[derive(Clone, Debug)]
pub struct GqaParams {
    /// Queries (with `gate_in_query`, each head's queries then its gate).
    pub wq: Proj,
    /// Keys.
    pub wk: Proj,
    /// Values.
    pub wv: Proj,
    /// The output projection.
    pub wo: Proj,
    /// Per-head RMSNorm gains of queries and keys (QK-norm).
    pub qk_norm: Option<(Param, Param)>,
    /// One learned sink logit per head.
    pub sinks: Option<Param>,
    /// A separate output gate `[n_heads · head_dim, dim]` on the block's input: the attention
    /// output is multiplied by `sigmoid(gate · x)` (Muse).
    pub gate: Option<Proj>,
}

/// How grouped-query attention runs in one block.
#[derive(Clone, Debug, Default)]
pub struct GqaOpts<'a> {
    /// Per-head size.
    pub head_dim: usize,
    /// RoPE (`None`: no positions, NoPE).
    pub rope: Option<Rope>,
    /// The QK-norm's RMSNorm (with the gains of [`GqaParams::qk_norm`]).
    pub qk_norm: Option<super::decoder::Norm>,
    /// A QK-norm without gains, of this epsilon (Muse).
    pub scaleless_qk_norm: Option<f64>,
    /// Queries multiplied by this after the QK-norm, on top of attention's `1/√head_dim`.
    pub query_scale: Option<f64>,
    /// Each head's output normed without a gain, of this epsilon (Muse Spark).
    pub scaleless_out_norm: Option<f64>,
    /// Attend to the last this many positions only.
    pub sliding_window: Option<usize>,
    /// The query projection holds a per-head sigmoid gate after each head's queries; the
    /// attention output is multiplied by it (Qwen3.5's gated attention).
    pub gate_in_query: bool,
    /// Multimodal RoPE sections (used with the 3-D positions of a prompt with images).
    pub mrope_section: Option<&'a [usize]>,
}

/// Grouped-query attention of block `index` on `x [B, T, D]`: causal, with the KV cache when
/// the forward uses one; `pos3` (f32 `[3, B, T]`): the 3-D positions of a prompt with images,
/// for multimodal RoPE. Shapes come from the projections, not from `x`: under tensor
/// parallelism the host hands back a share of the heads (`-1`), and under sequence
/// parallelism `x` holds a share of the sequence while the projections see all of it.
pub fn gqa<'h>(
    ctx: &Ctx<'h>,
    p: &GqaParams,
    opts: &GqaOpts<'_>,
    index: usize,
    x_btd: &Tensor<'h>,
    pos3: Option<&Tensor<'h>>,
) -> Result<Tensor<'h>> {
    let hd = opts.head_dim as i64;
    let q = p.wq.apply(ctx, x_btd)?;
    let (b, t) = {
        let s = q.shape()?;
        (s[0] as i64, s[1] as i64)
    };
    let (mut q_bthd, gate) = if opts.gate_in_query {
        let qg = q.reshape(&[b, t, -1, 2 * hd])?;
        let gate = qg
            .narrow(3, opts.head_dim, opts.head_dim)?
            .reshape(&[b, t, -1])?;
        (qg.narrow(3, 0, opts.head_dim)?, Some(gate))
    } else {
        (q.reshape(&[b, t, -1, hd])?, None)
    };
    let mut k_bthd = p.wk.apply(ctx, x_btd)?.reshape(&[b, t, -1, hd])?;
    let v_bthd = p.wv.apply(ctx, x_btd)?.reshape(&[b, t, -1, hd])?;
    if let (Some((qn, kn)), Some(norm)) = (&p.qk_norm, opts.qk_norm) {
        q_bthd = norm.apply(ctx, &q_bthd, qn)?;
        k_bthd = norm.apply(ctx, &k_bthd, kn)?;
    }
    if let Some(eps) = opts.scaleless_qk_norm {
        q_bthd = scaleless_rms_norm(ctx, &q_bthd, eps)?;
        k_bthd = scaleless_rms_norm(ctx, &k_bthd, eps)?;
    }
    if let Some(s) = opts.query_scale {
        q_bthd = q_bthd.scale(s)?;
    }
    let turn = |x: Tensor<'h>| match &opts.rope {
        Some(rope) => mrope::rotate(ctx, x, pos3, opts.mrope_section, rope),
        None => Ok(x),
    };
    let q_bhtd = turn(q_bthd.transpose(1, 2)?)?;
    let k_bhtd = turn(k_bthd.transpose(1, 2)?)?;
    let v_bhtd = v_bthd.transpose(1, 2)?;
    let sinks = p.sinks.as_ref().map(|s| ctx.w(s)).transpose()?;
    let attention = AttentionOpts {
        causal: true,
        sliding_window: opts.sliding_window,
        cache_layer: ctx.use_cache.then_some(index),
        sinks: sinks.as_ref(),
        ..Default::default()
    };
    let o_bhtd = q_bhtd.attention(&k_bhtd, &v_bhtd, &ctx.positions, &attention)?;
    let mut o_bthd = o_bhtd.transpose(1, 2)?;
    if let Some(eps) = opts.scaleless_out_norm {
        o_bthd = scaleless_rms_norm(ctx, &o_bthd, eps)?;
    }
    let mut o = o_bthd.reshape(&[b, t, -1])?;
    if let Some(g) = gate {
        o = gated(&o, &g)?;
    }
    if let Some(g) = &p.gate {
        o = gated(&o, &g.apply(ctx, x_btd)?)?;
    }
    p.wo.apply(ctx, &o)
}

/// SiTU-GLU (Kimi K3): `β·tanh(g/β) · σ(g) · u`, the linear branch first soft-capped,
/// `u ← β_l·tanh(u/β_l)`, when `linear_beta` is set; computed in f32 and returned in the gate's
/// dtype.
pub fn situ_glu<'h>(
    gate: &Tensor<'h>,
    up: &Tensor<'h>,
    beta: f64,
    linear_beta: Option<f64>,
) -> Result<Tensor<'h>> {
    let dtype = gate.dtype()?;
    let (g, u) = (gate.to_dtype("f32")?, up.to_dtype("f32")?);
    let u = match linear_beta {
        Some(c) => softcap(&u, c)?,
        None => u,
    };
    let out = softcap(&g, beta)?.mul(&g.unary("sigmoid")?)?.mul(&u)?;
    if dtype == "f32" {
        Ok(out)
    } else {
        out.to_dtype(&dtype)
    }
}

/// Sigmoid top-k routing as DeepSeek-V3 does it, for a plugin that runs its experts itself.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SigmoidRouting {
    /// Experts each token is sent to.
    pub top_k: usize,
    /// Group-limited choice `(n_group, topk_group)`: a token chooses among the experts of its
    /// `topk_group` best groups, a group scoring the sum of its best two biased scores.
    pub groups: Option<(usize, usize)>,
    /// Divide the chosen weights by their sum plus this epsilon; `None` keeps them.
    pub renormalize: Option<f64>,
    /// Factor on the final weights.
    pub scale: f64,
}

/// Routes tokens by their sigmoid `scores [N, E]` (f32): the choice by `scores + bias` (the
/// balancing bias `[E]` steers the choice only), the weights the chosen unbiased scores.
/// Returns the experts `[N, k]` and their weights `[N, k]` (f32).
pub fn sigmoid_route<'h>(
    scores: &Tensor<'h>,
    bias: &Tensor<'h>,
    r: &SigmoidRouting,
) -> Result<(Tensor<'h>, Tensor<'h>)> {
    let biased = scores.add(&bias.to_dtype("f32")?)?;
    let choice = match r.groups {
        Some((groups, keep)) if groups > 1 => {
            let s = biased.shape()?;
            let (n, e) = (s[0] as i64, s[1] as i64);
            let g = groups as i64;
            let by_group = biased.reshape(&[n, g, e / g])?;
            let group_scores = by_group.topk(2, 2)?.0.sum(&[2], false)?;
            let best = group_scores.topk(keep, 1)?.1;
            // 1 for the chosen groups, 0 elsewhere, spread over each group's experts.
            let zeros = group_scores.scale(0.0)?;
            let mask = zeros.scatter_add(1, &best, &best_ones(&zeros, &best)?)?;
            by_group.mul(&mask.reshape(&[n, g, 1])?)?.reshape(&[n, e])?
        }
        _ => biased,
    };
    let experts = choice.topk(r.top_k, 1)?.1;
    let chosen = scores.gather(1, &experts)?;
    let weights = match r.renormalize {
        Some(eps) => chosen.div(&chosen.sum(&[1], true)?.affine(1.0, eps)?)?,
        None => chosen,
    };
    Ok((experts, weights.scale(r.scale)?))
}

/// Ones shaped like `idx`, in `like`'s dtype.
fn best_ones<'h>(like: &Tensor<'h>, idx: &Tensor<'h>) -> Result<Tensor<'h>> {
    like.gather(1, idx)?.scale(0.0)?.affine(1.0, 1.0)
}
