//! Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Kimi Linear, Kimi K3), written with
//! host ops.
//!
//! ```text
//! q        = W_qb · RMSNorm(W_qa · x)                      (or W_q · x without a query rank)
//! c, k_r   = split(W_kva · x)                              the latent [kv_lora_rank] and one
//! k_n, v   = split(W_kvb · RMSNorm(c))                     "RoPE" key shared by the heads
//! o        = softmax(([q_n, RoPE(q_r)] · [k_n, RoPE(k_r)]ᵀ) · scale) · v
//!          (computed with W_kvb absorbed into q and o, so only [c, k_r] is cached)
//! out      = W_o · o                                       (Kimi K3: W_o · (o ⊙ σ(W_g · x)))
//! ```
//! Without RoPE (Kimi Linear, Kimi K3) the shared part of the key is kept but encodes no
//! positions.

use crate::sdk::{AttentionOpts, Ctx, Decl, LayerScope, Param, Result, Rope, Tensor};

/// The RMSNorm epsilon of the two latents (transformers' default, not the config's).
pub const LATENT_NORM_EPS: f64 = 1e-6;

/// MLA's shapes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaShape {
    /// Attention heads.
    pub n_heads: usize,
    /// Rank of the query compression; `None` projects queries directly.
    pub q_lora_rank: Option<usize>,
    /// Rank of the key/value compression: the latent a token caches.
    pub kv_lora_rank: usize,
    /// Per-head query/key dims without RoPE.
    pub qk_nope_head_dim: usize,
    /// Per-head query/key dims of the part shared by the heads (rotated when RoPE is on).
    pub qk_rope_head_dim: usize,
    /// Per-head value dims.
    pub v_head_dim: usize,
}

impl MlaShape {
    /// Query/key dims per head.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// How queries are made: projected directly, or through a normalised low-rank latent.
pub enum QueryParams {
    /// `wq [n_heads · qk_head_dim, dim]`.
    Direct(Param),
    /// `wq_a [q_lora_rank, dim]`, its RMSNorm `[q_lora_rank]`, `wq_b [n_heads · qk_head_dim,
    /// q_lora_rank]`.
    LowRank(Param, Param, Param),
}

/// Multi-head latent attention's parameters in one block.
pub struct MlaParams {
    /// The query path.
    pub q: QueryParams,
    /// `wkv_a [kv_lora_rank + qk_rope_head_dim, dim]`: the latent and the shared key.
    pub wkv_a: Param,
    /// RMSNorm of the latent `[kv_lora_rank]`.
    pub kv_norm: Param,
    /// `wkv_b [n_heads · (qk_nope_head_dim + v_head_dim), kv_lora_rank]`: keys and values
    /// from the latent.
    pub wkv_b: Param,
    /// `[n_heads · v_head_dim, dim]`: a sigmoid gate on the heads' output (Kimi K3).
    pub gate: Option<Param>,
    /// `wo [dim, n_heads · v_head_dim]`.
    pub wo: Param,
}

/// Declares MLA's parameters in block scope `l` under `attention.` (Hugging Face names under
/// `self_attn.`; the gate, when `gated`, is `output_gate_proj`).
pub fn declare(
    l: &mut LayerScope,
    dim: usize,
    s: &MlaShape,
    gated: bool,
    depth_std: f64,
) -> MlaParams {
    let (d, h) = (dim, s.n_heads);
    let std = 0.02;
    let mut norm = |name: &str, n: usize, hf: &str| l.add(Decl::new(name, [n]).ones().hf_name(hf));
    let kv_norm = norm(
        "attention.kv_norm.weight",
        s.kv_lora_rank,
        "self_attn.kv_a_layernorm.weight",
    );
    let q_norm = s.q_lora_rank.map(|r| {
        norm(
            "attention.q_norm.weight",
            r,
            "self_attn.q_a_layernorm.weight",
        )
    });
    let mut linear = |name: &str, shape: [usize; 2], std: f64, hf: &str, col: bool| {
        let decl = Decl::new(name, shape).trunc_normal(std).hf_name(hf);
        l.add(if col { decl.column() } else { decl.row() })
    };
    let q_out = h * s.qk_head_dim();
    let q = match (s.q_lora_rank, q_norm) {
        (Some(r), Some(q_norm)) => QueryParams::LowRank(
            linear(
                "attention.wq_a.weight",
                [r, d],
                std,
                "self_attn.q_a_proj.weight",
                false,
            ),
            q_norm,
            linear(
                "attention.wq_b.weight",
                [q_out, r],
                std,
                "self_attn.q_b_proj.weight",
                true,
            ),
        ),
        _ => QueryParams::Direct(linear(
            "attention.wq.weight",
            [q_out, d],
            std,
            "self_attn.q_proj.weight",
            true,
        )),
    };
    let wkv_a = linear(
        "attention.wkv_a.weight",
        [s.kv_lora_rank + s.qk_rope_head_dim, d],
        std,
        "self_attn.kv_a_proj_with_mqa.weight",
        false,
    );
    let wkv_b = linear(
        "attention.wkv_b.weight",
        [h * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank],
        std,
        "self_attn.kv_b_proj.weight",
        true,
    );
    let gate = gated.then(|| {
        linear(
            "attention.gate.weight",
            [h * s.v_head_dim, d],
            std,
            "self_attn.output_gate_proj.weight",
            true,
        )
    });
    let wo = linear(
        "attention.wo.weight",
        [d, h * s.v_head_dim],
        depth_std,
        "self_attn.o_proj.weight",
        false,
    );
    MlaParams {
        q,
        wkv_a,
        kv_norm,
        wkv_b,
        gate,
        wo,
    }
}

/// MLA of block `index` on `x [B, T, dim]` at `positions`: `rope` rotates the shared part of
/// queries and keys (`None`: no positions), `scale` multiplies the scores.
#[allow(clippy::too_many_arguments)]
pub fn forward<'h>(
    ctx: &Ctx<'h>,
    p: &MlaParams,
    s: &MlaShape,
    rope: Option<&Rope>,
    scale: f64,
    index: usize,
    x: &Tensor<'h>,
    positions: &Tensor<'h>,
) -> Result<Tensor<'h>> {
    let (b, t) = {
        let sh = x.shape()?;
        (sh[0] as i64, sh[1] as i64)
    };
    let h = s.n_heads as i64;
    let (dn, dr, dv) = (s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim);
    let rotate = |x: Tensor<'h>| match rope {
        Some(r) => x.rope(positions, r),
        None => Ok(x),
    };
    let q = match &p.q {
        QueryParams::Direct(wq) => x.linear(&ctx.w(wq)?)?,
        QueryParams::LowRank(wq_a, q_norm, wq_b) => x
            .linear(&ctx.w(wq_a)?)?
            .rms_norm(&ctx.w(q_norm)?, LATENT_NORM_EPS)?
            .linear(&ctx.w(wq_b)?)?,
    };
    let q = q.reshape(&[b, t, h, (dn + dr) as i64])?.transpose(1, 2)?;
    let q_rope = rotate(q.narrow(3, dn, dr)?)?;

    let r = s.kv_lora_rank;
    let kv = x.linear(&ctx.w(&p.wkv_a)?)?;
    let latent = kv
        .narrow(2, 0, r)?
        .rms_norm(&ctx.w(&p.kv_norm)?, LATENT_NORM_EPS)?
        .reshape(&[b, 1, t, r as i64])?;
    let k_rope = rotate(
        kv.narrow(2, r, dr)?
            .reshape(&[b, t, 1, dr as i64])?
            .transpose(1, 2)?,
    )?;
    // The up-projection absorbed: per head, q_n · (W_uk c)ᵀ = (q_n W_uk) · cᵀ, and the
    // values W_uv c are applied after attending over c. Attention then runs as one shared
    // key head [c, k_r] and value head c (what the cache holds), in training and decode
    // alike, so a decode step computes exactly the training forward's arithmetic.
    let w_ukv = ctx.w(&p.wkv_b)?.reshape(&[h, (dn + dv) as i64, r as i64])?;
    let q_latent = q.narrow(3, 0, dn)?.matmul(&w_ukv.narrow(1, 0, dn)?)?;
    let q = ctx.host.cat(&[&q_latent, &q_rope], 3)?;
    let k = ctx.host.cat(&[&latent, &k_rope], 3)?;
    let opts = AttentionOpts {
        causal: true,
        scale: Some(scale),
        cache_layer: ctx.use_cache.then_some(index),
        // The values are the keys' latent part: the cache keeps [c, k_r] once.
        value_from_key: Some(r),
        ..Default::default()
    };
    let o_latent = q.attention(&k, &latent, positions, &opts)?;
    let o = o_latent
        .matmul(&w_ukv.narrow(1, dn, dv)?.transpose(1, 2)?)?
        .transpose(1, 2)?
        .reshape(&[b, t, h * dv as i64])?;
    let o = match &p.gate {
        Some(g) => o.mul(&x.linear(&ctx.w(g)?)?.unary("sigmoid")?)?,
        None => o,
    };
    o.linear(&ctx.w(&p.wo)?)
}
