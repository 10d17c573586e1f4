//! DeepSeek-V4 (DeepSeek-AI, 2026): blocks of compressed attention (`attention.rs`) and a
//! mixture of experts, joined by manifold-constrained hyper-connections instead of a plain
//! residual, written with host ops.
//!
//! ```text
//! X        [B, T, N, D]: N residual streams (the embedding copied N times)
//! pre, post, comb = HC(X):  m = W_hc · RMSNorm(flatten(X))
//!          pre  = σ(m_pre · s₀ + b_pre) + ε          how the streams collapse into the block input
//!          post = 2σ(m_post · s₁ + b_post)          how the block output spreads over the streams
//!          comb = Sinkhorn(softmax(m_comb · s₂ + b_comb) + ε)   doubly stochastic N×N mixing
//! X'       = post ⊗ Block(RMSNorm(Σ_n pre_n X_n)) + combᵀ X      (attention, then the same for the MoE)
//! logits   = W_out · RMSNorm(Σ_n (σ(W_head · RMSNorm(flatten(X)) · s + b) + ε)_n X_n)
//! MoE(y)   = Σ_{e ∈ E(t)} g_e · FFN_e(y) + FFN_shared(y),  g = normalise(√softplus(W_r y))_E(t) · scale
//!          E(t) = top-k(√softplus(W_r y) + bias)  or  tid2eid[token]  (hash-routed blocks)
//! ```
//! With `mtp_layers = 1`, training also predicts the token after next (`mtp.rs`).
//! The experts' SwiGLU clamps the gate at `swiglu_limit` and the up product to `±swiglu_limit`.

use crate::config::{DeepseekV4Args, MlpType};
use crate::spec::{BlockParams, DeepseekV4Params, HyperConnection, MoeParams, Routing};
use anneal_plugin_api::ops;
use anneal_plugin_api::sdk::{
    tokens_per_expert_stat, Ctx, Error, Host, Model, ModelSpec, Result, Tensor,
};

/// A DeepSeek-V4 model: its arguments and declared parameters (the weights live in the host).
pub struct DeepseekV4 {
    /// Shapes and options.
    pub args: DeepseekV4Args,
    /// Handles to every parameter.
    pub params: DeepseekV4Params,
    /// The spec, built (and checked) once when the model is created.
    pub spec: ModelSpec,
}

fn clamp<'h>(x: &Tensor<'h>, min: f64, max: f64) -> Result<Tensor<'h>> {
    x.host().call1(
        ops::Clamp::OP,
        &[x],
        &ops::OpAttrs::to_attrs(&ops::Clamp { min, max }),
    )
}

impl DeepseekV4 {
    /// Declares the parameters of `args` and checks the spec they make.
    pub fn new(args: DeepseekV4Args) -> Result<Self> {
        args.validate()?;
        let (params, specs) = crate::spec::declare(&args);
        let spec = crate::spec::model_spec(&args, specs);
        spec.check()?;
        Ok(DeepseekV4 { args, params, spec })
    }

    /// The hyper-connection weights of `x [B, T, N, D]`: `post [B, T, N, 1]`, the mixing
    /// matrix transposed `combᵀ [B, T, N, N]` and the collapsed block input `[B, T, D]`.
    fn hc_pre<'h>(
        &self,
        ctx: &Ctx<'h>,
        hc: &HyperConnection,
        x: &Tensor<'h>,
    ) -> Result<(Tensor<'h>, Tensor<'h>, Tensor<'h>)> {
        let a = &self.args;
        let s = x.shape()?;
        let (b, t, n, d) = (s[0] as i64, s[1] as i64, a.hc_mult, s[3] as i64);
        let eps = a.hc_eps;
        let mixes =
            crate::attention::unweighted_rms_norm(&x.reshape(&[b, t, n as i64 * d])?, a.norm_eps)?
                .linear(&ctx.w(&hc.fn_)?)?;
        let (base, scale) = (ctx.w(&hc.base)?, ctx.w(&hc.scale)?);
        let logits = |at: usize, len: usize, k: usize| -> Result<Tensor<'h>> {
            mixes
                .narrow(2, at, len)?
                .mul(&scale.narrow(0, k, 1)?)?
                .add(&base.narrow(0, at, len)?)
        };
        let pre = logits(0, n, 0)?.unary("sigmoid")?.affine(1.0, eps)?;
        let post = logits(n, n, 1)?.unary("sigmoid")?.scale(2.0)?;
        let comb = logits(2 * n, n * n, 2)?
            .reshape(&[b, t, n as i64, n as i64])?
            .softmax(3)?
            .affine(1.0, eps)?;
        // Sinkhorn-Knopp towards a doubly stochastic matrix: columns first, then rows and
        // columns in turn, as transformers does.
        let normalise = |m: Tensor<'h>, dim: i64| -> Result<Tensor<'h>> {
            m.div(&m.sum(&[dim], true)?.affine(1.0, eps)?)
        };
        let mut comb = normalise(comb, 2)?;
        for _ in 1..a.hc_sinkhorn_iters {
            comb = normalise(normalise(comb, 3)?, 2)?;
        }
        let collapsed = pre
            .reshape(&[b, t, n as i64, 1])?
            .mul(x)?
            .sum(&[2], false)?;
        Ok((
            post.reshape(&[b, t, n as i64, 1])?,
            comb.transpose(2, 3)?,
            collapsed,
        ))
    }

    /// `post ⊗ out + combᵀ x`: the block output `[B, T, D]` spread over the streams, plus the
    /// streams mixed.
    fn hc_post<'h>(
        &self,
        x: &Tensor<'h>,
        out: &Tensor<'h>,
        post: &Tensor<'h>,
        comb_t: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let s = out.shape()?;
        let spread = post.mul(&out.reshape(&[s[0] as i64, s[1] as i64, 1, s[2] as i64])?)?;
        spread.add(&comb_t.matmul(x)?)
    }

    /// Block `index` on the streams `x [B, T, N, D]` at positions `pos`; `tokens` feed hash
    /// routing.
    pub(crate) fn block<'h>(
        &self,
        ctx: &Ctx<'h>,
        l: &BlockParams,
        index: usize,
        x: &Tensor<'h>,
        tokens: &Tensor<'h>,
        pos: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let eps = self.args.norm_eps;
        let (post, comb_t, input) = self.hc_pre(ctx, &l.hc_attn, x)?;
        let input = input.rms_norm(&ctx.w(&l.attention_norm)?, eps)?;
        let attn = self.attention(ctx, &l.attention, index, &input, pos)?;
        let x = self.hc_post(x, &attn, &post, &comb_t)?;
        let (post, comb_t, input) = self.hc_pre(ctx, &l.hc_ffn, &x)?;
        let input = input.rms_norm(&ctx.w(&l.ffn_norm)?, eps)?;
        let ffn = self.moe(ctx, &l.ffn, index, &input, tokens)?;
        self.hc_post(&x, &ffn, &post, &comb_t)
    }

    /// The streams `x [B, T, N, D]` collapsed to `[B, T, D]` by the head's weights
    /// `σ(W · RMSNorm(flatten(x)) · s + b) + ε`.
    pub(crate) fn collapse<'h>(
        &self,
        ctx: &Ctx<'h>,
        hc: &HyperConnection,
        x: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let s = x.shape()?;
        let (b, t, n, d) = (s[0] as i64, s[1] as i64, s[2] as i64, s[3] as i64);
        let pre = crate::attention::unweighted_rms_norm(&x.reshape(&[b, t, n * d])?, a.norm_eps)?
            .linear(&ctx.w(&hc.fn_)?)?
            .mul(&ctx.w(&hc.scale)?)?
            .add(&ctx.w(&hc.base)?)?
            .unary("sigmoid")?
            .affine(1.0, a.hc_eps)?;
        pre.reshape(&[b, t, n, 1])?.mul(x)?.sum(&[2], false)
    }

    /// The mixture of experts on `y [B, T, D]`.
    fn moe<'h>(
        &self,
        ctx: &Ctx<'h>,
        p: &MoeParams,
        index: usize,
        y: &Tensor<'h>,
        tokens: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let s = y.shape()?;
        let (b, t, d) = (s[0] as i64, s[1] as i64, s[2] as i64);
        let (e, limit) = (a.n_experts, a.swiglu_limit);
        let flat = y.reshape(&[b * t, d])?;
        let logits = flat.linear(&ctx.w(&p.router)?)?;
        let scores = match a.scoring.as_str() {
            "softmax" => logits.softmax(1)?,
            "sigmoid" => logits.unary("sigmoid")?,
            _ => logits.unary("softplus")?.sqrt()?,
        };
        let experts = match &p.routing {
            Routing::Learned { bias } => scores.add(&ctx.w(bias)?)?.topk(a.top_k, 1)?.1,
            Routing::Hash { table } => ctx
                .w(table)?
                .index_select(0, &tokens.reshape(&[b * t])?)?
                .to_dtype("i64")?,
        };
        let chosen = scores.gather(1, &experts)?;
        let weights = chosen
            .div(&chosen.sum(&[1], true)?.affine(1.0, 1e-20)?)?
            .scale(a.routed_scaling_factor)?;
        let [_, _, _, counts] = ctx.host.sort_by_expert(&experts, e)?;
        if matches!(p.routing, Routing::Learned { .. }) && a.balance_rate > 0.0 {
            ctx.stat(&tokens_per_expert_stat(index), &counts.to_dtype("f32")?)?;
        }
        let rows = flat.moe_dispatch(&experts, e)?;
        let gate = clamp(
            &rows.grouped_matmul_nt(&ctx.w(&p.w1)?, &counts)?,
            f64::NEG_INFINITY,
            limit,
        )?;
        let up = clamp(
            &rows.grouped_matmul_nt(&ctx.w(&p.w3)?, &counts)?,
            -limit,
            limit,
        )?;
        let routed = gate
            .swiglu(&up)?
            .grouped_matmul_nt(&ctx.w(&p.w2)?, &counts)?
            .moe_combine(&weights, &experts, e)?;
        let sh = &p.shared;
        let gate = clamp(&flat.linear(&ctx.w(&sh.w1)?)?, f64::NEG_INFINITY, limit)?;
        let up = clamp(&flat.linear(&ctx.w(&sh.w3)?)?, -limit, limit)?;
        let shared = gate.swiglu(&up)?.linear(&ctx.w(&sh.w2)?)?;
        routed.add(&shared)?.reshape(&[b, t, d])
    }
}

impl Model for DeepseekV4 {
    fn spec(&self) -> ModelSpec {
        self.spec.clone()
    }

    /// The embedding copied onto every stream `[B, T, N, D]`, the token ids (hash routing) and
    /// their positions; in training with MTP, also the embeddings of tokens `1..T-1` for
    /// `head`. A decode step covers its new tokens only: the attention blocks keep what they
    /// need of the past in the host (`decode.rs`).
    fn embed<'h>(&self, ctx: &Ctx<'h>, tokens: Tensor<'h>) -> Result<Vec<Tensor<'h>>> {
        let table = ctx.w(&self.params.tok_embeddings)?;
        let h = table.embedding(&tokens)?;
        let s = h.shape()?;
        let one = h.reshape(&[s[0] as i64, s[1] as i64, 1, s[2] as i64])?;
        let copies: Vec<&Tensor<'h>> = std::iter::repeat_n(&one, self.args.hc_mult).collect();
        let mut out = vec![
            ctx.host.cat(&copies, 2)?,
            tokens.clone(),
            ctx.positions.clone(),
        ];
        let t = s[1];
        if ctx.training && !ctx.use_cache && self.params.mtp.is_some() && t > 2 {
            out.push(table.embedding(&tokens.narrow(1, 1, t - 2)?)?);
        }
        Ok(out)
    }

    fn layer<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        hidden: Vec<Tensor<'h>>,
    ) -> Result<Vec<Tensor<'h>>> {
        let mut hidden = hidden.into_iter();
        let (Some(x), Some(tokens), Some(pos)) = (hidden.next(), hidden.next(), hidden.next())
        else {
            return Err(Error::internal(
                "layer: expected the streams, token ids and positions",
            ));
        };
        let l = self
            .params
            .layers
            .get(index)
            .ok_or_else(|| format!("layer {index}: the model has {}", self.args.n_layers))?;
        let out = self.block(ctx, l, index, &x, &tokens, &pos)?;
        // MTP's input passes through untouched.
        let mut out = vec![out, tokens, pos];
        out.extend(hidden);
        Ok(out)
    }

    /// Aux-loss-free balancing: each learned router's bias moves towards balance by
    /// `balance_rate` per step (nothing when it is 0).
    fn before_optimizer_step(&self, host: Host<'_>, _step: u64) -> Result<()> {
        if self.args.balance_rate <= 0.0 {
            return Ok(());
        }
        let mtp = self.params.mtp.as_ref().map(|m| &m.block);
        for (index, l) in self.params.layers.iter().chain(mtp).enumerate() {
            if let Routing::Learned { bias } = &l.ffn.routing {
                debug_assert_eq!(self.args.mlp_type(index), MlpType::Moe);
                // A block that reported no tokens (the MTP block without its loss, a block on
                // another pipeline stage) keeps its bias.
                host.update_balance_bias(index, bias, self.args.balance_rate)?;
            }
        }
        Ok(())
    }

    fn head<'h>(&self, ctx: &Ctx<'h>, hidden: Vec<Tensor<'h>>) -> Result<Tensor<'h>> {
        let mut hidden = hidden.into_iter();
        let x = hidden.next().ok_or("head: missing hidden state")?;
        let p = &self.params;
        if let (Some(m), Some(tokens), Some(pos), Some(next)) =
            (&p.mtp, hidden.next(), hidden.next(), hidden.next())
        {
            self.mtp_loss(ctx, m, &x, &next, &tokens, &pos)?;
        }
        self.collapse(ctx, &p.hc_head, &x)?
            .rms_norm(&ctx.w(&p.norm)?, self.args.norm_eps)?
            .linear(&ctx.w(&p.output)?)
    }
}
