//! DeepSeek-V3 (DeepSeek-AI, 2024) and Kimi K2: pre-norm decoder blocks of multi-head latent
//! attention and a mixture of experts (the first blocks dense), written with host ops.
//!
//! ```text
//! q        = W_qb · RMSNorm(W_qa · x)                      (or W_q · x without q_lora_rank)
//! c, k_r   = split(W_kva · x)                              the latent [kv_lora_rank] and one
//! k_n, v   = split(W_kvb · RMSNorm(c))                     RoPE key shared by the heads
//! o        = softmax(([q_n, RoPE(q_r)] · [k_n, RoPE(k_r)]ᵀ) · mscale² / √d_qk) · v
//!          (computed with W_kvb absorbed into q and o, so only [c, k_r] is cached)
//! h        = x + W_o · o
//! out      = h + Σ_{e ∈ topk_groups(σ(W_r · y) + b)} g_e · FFN_e(y) + FFN_shared(y),  y = RMSNorm(h)
//! ```
//! Kimi Linear: the same blocks with MLA that encodes no positions (`RoPE` left out, the dims
//! kept) and Kimi Delta Attention (`kda.rs`) instead of MLA in three blocks of four.
//!
//! The router scores with a sigmoid, chooses inside the best `topk_group` of `n_group` expert
//! groups with the aux-loss-free bias `b`, and weighs with the unbiased scores, renormalised and
//! times `routed_scaling_factor`.
//!
//! Multi-token prediction (training only): `h'_i = Block(W_eh · [RMSNorm(Emb(t_{i+1}));
//! RMSNorm(h_i)])` predicts `t_{i+2}` through the shared head; its cross-entropy is the
//! auxiliary loss `mtp`. The next tokens' embeddings and targets travel from `embed` to `head`
//! as extra hidden tensors, which the blocks pass through.

use crate::config::DeepseekArgs;
use crate::spec::{BlockParams, DeepseekParams, FeedForward, Mixer, MtpParams};
use anneal_plugin_api::sdk::kit::kda::{self, KdaDecay};
use anneal_plugin_api::sdk::kit::mla::{self, MlaParams};
use anneal_plugin_api::sdk::vision;
use anneal_plugin_api::sdk::{
    Ctx, Host, Model, ModelSpec, MoeFfnOpts, Result, Rope, Router, RouterScore, Tensor,
};

/// A DeepSeek-V3 model: its arguments and declared parameters (the weights live in the host).
pub struct DeepseekV3 {
    /// Shapes and options.
    pub args: DeepseekArgs,
    /// Handles to every parameter.
    pub params: DeepseekParams,
    /// The spec, built (and checked) once when the model is created.
    pub spec: ModelSpec,
}

impl DeepseekV3 {
    /// Declares the parameters of `args` and checks the spec they make.
    pub fn new(args: DeepseekArgs) -> Result<Self> {
        args.validate()?;
        let (params, specs) = crate::spec::declare(&args);
        let spec = crate::spec::model_spec(&args, specs);
        spec.check()?;
        Ok(DeepseekV3 { args, params, spec })
    }

    fn rope(&self) -> Rope {
        let a = &self.args;
        Rope {
            theta: a.rope_theta,
            rot_dim: a.qk_rope_head_dim,
            interleaved: a.rope_interleave,
            llama3_scaling: None,
            yarn: a.yarn.clone(),
        }
    }

    fn attention<'h>(
        &self,
        ctx: &Ctx<'h>,
        p: &MlaParams,
        index: usize,
        x: &Tensor<'h>,
        positions: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        // Kimi Linear's MLA keeps the "RoPE" dims but encodes no positions.
        let rope = a.mla_rope.then(|| self.rope());
        mla::forward(
            ctx,
            p,
            &a.mla_shape(),
            rope.as_ref(),
            a.softmax_scale(),
            index,
            x,
            positions,
        )
    }

    /// Block `index` (attention then feed-forward, pre-norm) on `x` at `positions`.
    fn block<'h>(
        &self,
        ctx: &Ctx<'h>,
        l: &BlockParams,
        index: usize,
        x: &Tensor<'h>,
        positions: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let eps = self.args.norm_eps;
        let attn_in = x.rms_norm(&ctx.w(&l.attention_norm)?, eps)?;
        let mixed = match &l.attention {
            Mixer::Mla(p) => self.attention(ctx, p, index, &attn_in, positions)?,
            Mixer::Kda(p) => {
                let k = self
                    .args
                    .kda
                    .as_ref()
                    .ok_or("a KDA block without kda args")?;
                kda::forward(ctx, p, &k.shape(), KdaDecay::Softplus, index, &attn_in, eps)?
            }
        };
        let h = x.add(&mixed)?;
        let ffn_in = h.rms_norm(&ctx.w(&l.ffn_norm)?, eps)?;
        h.add(&self.feed_forward(ctx, &l.ffn, index, &ffn_in)?)
    }

    /// The MTP loss from the main model's last hidden state `h [B, T, D]`, the embeddings of
    /// tokens `1..T-1` and the targets `2..T` (`[B, T-2]` each): reported as the auxiliary
    /// loss `mtp` and the statistic `mtp_loss`.
    fn mtp_loss<'h>(
        &self,
        ctx: &Ctx<'h>,
        m: &MtpParams,
        h: &Tensor<'h>,
        next_embedding: &Tensor<'h>,
        targets: &Tensor<'h>,
    ) -> Result<()> {
        let a = &self.args;
        let s = targets.shape()?;
        let (b, t) = (s[0], s[1]);
        let positions = ctx
            .positions
            .narrow(ctx.positions.shape()?.len() as i64 - 1, 0, t)?;
        let e = next_embedding.rms_norm(&ctx.w(&m.enorm)?, a.norm_eps)?;
        let hm = h.narrow(1, 0, t)?.rms_norm(&ctx.w(&m.hnorm)?, a.norm_eps)?;
        let x = ctx.host.cat(&[&e, &hm], 2)?.linear(&ctx.w(&m.eh_proj)?)?;
        let y = self.block(ctx, &m.block, a.n_layers, &x, &positions)?;
        let logits = y
            .rms_norm(&ctx.w(&m.norm)?, a.norm_eps)?
            .linear(&ctx.w(&self.params.output)?)?
            .reshape(&[(b * t) as i64, a.vocab_size as i64])?;
        let loss = logits.cross_entropy(&targets.reshape(&[(b * t) as i64])?, None)?;
        ctx.aux_loss("mtp", &loss)?;
        ctx.stat("mtp_loss", &loss)
    }

    fn feed_forward<'h>(
        &self,
        ctx: &Ctx<'h>,
        ffn: &FeedForward,
        index: usize,
        x: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        match ffn {
            FeedForward::Dense { w1, w2, w3 } => {
                let gate = x.linear(&ctx.w(w1)?)?;
                gate.swiglu(&x.linear(&ctx.w(w3)?)?)?.linear(&ctx.w(w2)?)
            }
            FeedForward::Experts {
                router,
                bias,
                w1,
                w2,
                w3,
                shared,
            } => {
                let score = if a.scoring == "softmax" {
                    RouterScore::Softmax
                } else {
                    RouterScore::Sigmoid
                };
                let mut opts = MoeFfnOpts::new(Router {
                    score,
                    renormalize: a.norm_topk_prob,
                    route_scale: a.routed_scaling_factor,
                    groups: (a.n_group > 1).then_some((a.n_group, a.topk_group)),
                    ..Router::new(a.n_experts, a.top_k)
                });
                opts.out_in = true;
                opts.aux_loss_coef = a.aux_loss_coef;
                let bias = ctx.w(bias)?;
                opts.balance_bias = Some(&bias);
                let shared = shared
                    .as_ref()
                    .map(|[g, u, d]| {
                        Ok::<_, anneal_plugin_api::sdk::Error>([ctx.w(g)?, ctx.w(u)?, ctx.w(d)?])
                    })
                    .transpose()?;
                opts.shared = shared.as_ref().map(|[g, u, d]| [g, u, d]);
                let reported = (a.balance_rate > 0.0).then_some(&bias);
                x.moe_ffn(
                    &ctx.w(router)?,
                    &ctx.w(w1)?,
                    &ctx.w(w3)?,
                    &ctx.w(w2)?,
                    &opts,
                )?
                .report(ctx, index, reported)
            }
        }
    }
}

impl Model for DeepseekV3 {
    fn spec(&self) -> ModelSpec {
        self.spec.clone()
    }

    /// The hidden state; in training with MTP, also the next tokens' embeddings and the
    /// targets two ahead, for `head`.
    fn embed<'h>(&self, ctx: &Ctx<'h>, tokens: Tensor<'h>) -> Result<Vec<Tensor<'h>>> {
        let table = ctx.w(&self.params.tok_embeddings)?;
        let mut h = table.embedding(&tokens)?;
        if let Some(images) = &ctx.images {
            let (Some(tower), Some(v)) = (&self.params.vision, &self.args.vision) else {
                return Err(format!(
                    "this {} model takes no images (it has no vision tower)",
                    self.args.hf_model_type
                )
                .into());
            };
            let embeds = tower.forward(ctx, v, images)?;
            let mask = vision::placeholder_mask(&tokens, v.image_token_id)?;
            h = h.masked_scatter(&mask, &embeds)?;
        }
        let t = tokens.shape()?[1];
        if !(ctx.training && self.params.mtp.is_some() && t > 2) {
            return Ok(vec![h]);
        }
        let next = table.embedding(&tokens.narrow(1, 1, t - 2)?)?;
        Ok(vec![h, next, tokens.narrow(1, 2, t - 2)?])
    }

    fn layer<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        hidden: Vec<Tensor<'h>>,
    ) -> Result<Vec<Tensor<'h>>> {
        let mut hidden = hidden.into_iter();
        let x = hidden.next().ok_or("layer: missing hidden state")?;
        let l: &BlockParams = self
            .params
            .layers
            .get(index)
            .ok_or_else(|| format!("layer {index}: the model has {}", self.args.n_layers))?;
        // MTP's inputs pass through untouched.
        let mut out = vec![self.block(ctx, l, index, &x, &ctx.positions)?];
        out.extend(hidden);
        Ok(out)
    }

    /// Aux-loss-free balancing: each sparse block's `e_score_correction_bias` moves towards
    /// balance by `balance_rate` per step (nothing when it is 0).
    fn before_optimizer_step(&self, host: Host<'_>, _step: u64) -> Result<()> {
        if self.args.balance_rate <= 0.0 {
            return Ok(());
        }
        let mtp = self.params.mtp.as_ref().map(|m| &m.block);
        for (index, l) in self.params.layers.iter().chain(mtp).enumerate() {
            if let FeedForward::Experts { bias, .. } = &l.ffn {
                // A block that reported no tokens (the MTP block without its loss, a block on
                // another pipeline stage) keeps its bias.
                host.update_balance_bias(index, bias, self.args.balance_rate)?;
            }
        }
        Ok(())
    }

    fn head<'h>(&self, ctx: &Ctx<'h>, hidden: Vec<Tensor<'h>>) -> Result<Tensor<'h>> {
        let mut hidden = hidden.into_iter();
        let h = hidden.next().ok_or("head: missing hidden state")?;
        let p = &self.params;
        if let (Some(m), Some(next), Some(targets)) = (&p.mtp, hidden.next(), hidden.next()) {
            self.mtp_loss(ctx, m, &h, &next, &targets)?;
        }
        h.rms_norm(&ctx.w(&p.norm)?, self.args.norm_eps)?
            .linear(&ctx.w(&p.output)?)
    }
}
