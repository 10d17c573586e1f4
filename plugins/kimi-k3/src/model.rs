//! Kimi K3 (Moonshot AI, 2026), written with host ops.
//!
//! ```text
//! block i:   x_in = Mix_pre(bank ++ [p])                     (p itself while the bank is empty)
//!            if i % S == 0: bank += [p]; p = 0                (a residual block opens)
//!            p    = p + Mixer(RMSNorm(x_in))                  KDA or gated MLA without RoPE
//!            p    = p + FFN(RMSNorm(Mix_post(bank ++ [p])))   SiTU-GLU, or the latent MoE
//! logits   = W_out · RMSNorm(Mix_final(bank ++ [p]))
//! Mix(v_1..v_n) = Σ_j softmax_j(w · RMSNorm(v_j)) · v_j         attention over depth, per token
//! ```
//! `p` starts as the token embedding. Instead of one residual stream, the model keeps the sum
//! of the open block's outputs `p` and a bank of each closed block's sum, and every sublayer
//! reads a learned per-token mixture of them.
//!
//! The latent MoE: the router chooses by `σ(W_r x) + b` (DeepSeek-V3's sigmoid routing), the
//! input goes down to the latent width, each chosen expert is a SiTU-GLU there, their weighted
//! sum is normed and projected back up, and shared SiTU-GLU experts read the input.
//! `SiTU(g, u) = β·tanh(g/β) · σ(g) · β_l·tanh(u/β_l)`, in f32.

use crate::config::KimiK3Args;
use crate::spec::{BlockParams, FeedForward, KimiK3Params, LatentMoe, Mixer, ResidualMix};
use anneal_plugin_api::sdk::kit::blocks::{self, SigmoidRouting};
use anneal_plugin_api::sdk::kit::{kda, mla, nth_layer};
use anneal_plugin_api::sdk::{Ctx, Model, ModelSpec, Param, Result, Tensor};

/// A Kimi K3 model: its arguments and declared parameters (the weights live in the host).
pub struct KimiK3 {
    /// Shapes and options.
    pub args: KimiK3Args,
    /// Handles to every parameter.
    pub params: KimiK3Params,
    /// The spec, built (and checked) once when the model is created.
    pub spec: ModelSpec,
}

impl KimiK3 {
    /// Declares the parameters of `args` and checks the spec they make.
    pub fn new(args: KimiK3Args) -> Result<Self> {
        args.validate()?;
        let (params, specs) = crate::spec::declare(&args);
        let spec = crate::spec::model_spec(&args, specs);
        spec.check()?;
        Ok(KimiK3 { args, params, spec })
    }

    /// `Σ_j softmax_j(w · RMSNorm(v_j)) · v_j` over `bank ++ [last]` (each `[B, T, D]`), in
    /// f32 and returned in `last`'s dtype.
    fn mix<'h>(
        &self,
        ctx: &Ctx<'h>,
        m: &ResidualMix,
        bank: &[Tensor<'h>],
        last: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let s = last.shape()?;
        let (b, t, d) = (s[0] as i64, s[1] as i64, s[2] as i64);
        let dtype = last.dtype()?;
        let f32 = |x: &Tensor<'h>| x.to_dtype("f32");
        let entries: Vec<Tensor<'h>> = bank.iter().chain([last]).map(f32).collect::<Result<_>>()?;
        let n = entries.len() as i64;
        let refs: Vec<&Tensor<'h>> = entries.iter().collect();
        let values = ctx.host.stack(&refs, 2)?; // [B, T, N, D]
        let probs = values
            .rms_norm(&f32(&ctx.w(&m.norm)?)?, self.args.norm_eps)?
            .linear(&f32(&ctx.w(&m.query)?)?)?
            .reshape(&[b, t, 1, n])?
            .softmax(3)?;
        let out = probs.matmul(&values)?.reshape(&[b, t, d])?;
        if dtype == "f32" {
            Ok(out)
        } else {
            out.to_dtype(&dtype)
        }
    }

    /// `W2 · SiTU(W1 x, W3 x)`.
    fn situ_glu<'h>(
        &self,
        ctx: &Ctx<'h>,
        [w1, w3, w2]: &[Param; 3],
        x: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let gate = x.linear(&ctx.w(w1)?)?;
        let up = x.linear(&ctx.w(w3)?)?;
        blocks::situ_glu(&gate, &up, a.situ_beta, a.situ_linear_beta)?.linear(&ctx.w(w2)?)
    }

    /// The latent mixture of experts on `x [B, T, D]`.
    fn latent_moe<'h>(&self, ctx: &Ctx<'h>, p: &LatentMoe, x: &Tensor<'h>) -> Result<Tensor<'h>> {
        let a = &self.args;
        let s = x.shape()?;
        let (b, t, d) = (s[0] as i64, s[1] as i64, s[2] as i64);
        let e = a.n_experts;
        let flat = x.reshape(&[b * t, d])?;
        let scores = flat
            .to_dtype("f32")?
            .linear(&ctx.w(&p.router)?.to_dtype("f32")?)?
            .unary("sigmoid")?;
        let routing = SigmoidRouting {
            top_k: a.top_k,
            groups: Some((a.n_group, a.topk_group)),
            renormalize: a.norm_topk_prob.then_some(1e-20),
            scale: a.routed_scaling_factor,
        };
        let (experts, weights) = blocks::sigmoid_route(&scores, &ctx.w(&p.bias)?, &routing)?;
        let [_, _, _, counts] = ctx.host.sort_by_expert(&experts, e)?;
        let rows = flat
            .linear(&ctx.w(&p.down_proj)?)?
            .moe_dispatch(&experts, e)?;
        let gate = rows.grouped_matmul_nt(&ctx.w(&p.gate)?, &counts)?;
        let up = rows.grouped_matmul_nt(&ctx.w(&p.up)?, &counts)?;
        let out = blocks::situ_glu(&gate, &up, a.situ_beta, a.situ_linear_beta)?
            .grouped_matmul_nt(&ctx.w(&p.down)?, &counts)?;
        let routed = out
            .moe_combine(&weights.to_dtype(&out.dtype()?)?, &experts, e)?
            .rms_norm(&ctx.w(&p.norm)?, a.norm_eps)?
            .linear(&ctx.w(&p.up_proj)?)?
            .reshape(&[b, t, d])?;
        match &p.shared {
            Some(shared) => routed.add(&self.situ_glu(ctx, shared, x)?),
            None => Ok(routed),
        }
    }

    /// Block `index` on the open block's sum `p` and the bank; returns the new sum and bank.
    fn block<'h>(
        &self,
        ctx: &Ctx<'h>,
        l: &BlockParams,
        index: usize,
        p: Tensor<'h>,
        mut bank: Vec<Tensor<'h>>,
    ) -> Result<(Tensor<'h>, Vec<Tensor<'h>>)> {
        let a = &self.args;
        let eps = a.norm_eps;
        let x = if bank.is_empty() {
            p.clone()
        } else {
            self.mix(ctx, &l.pre_mix, &bank, &p)?
        };
        // A block that opens files the stream so far and starts its own sum.
        let opens = a.opens_block(index);
        if opens {
            bank.push(p.clone());
        }
        let h = x.rms_norm(&ctx.w(&l.attention_norm)?, eps)?;
        let mixed = match &l.mixer {
            Mixer::Kda(k) => kda::forward(ctx, k, &a.kda_shape(), a.kda_decay(), index, &h, eps)?,
            Mixer::Mla(m) => {
                let scale = (a.mla_shape().qk_head_dim() as f64).powf(-0.5);
                mla::forward(
                    ctx,
                    m,
                    &a.mla_shape(),
                    None,
                    scale,
                    index,
                    &h,
                    &ctx.positions,
                )?
            }
        };
        let p = if opens { mixed } else { mixed.add(&p)? };
        let y = self
            .mix(ctx, &l.post_mix, &bank, &p)?
            .rms_norm(&ctx.w(&l.ffn_norm)?, eps)?;
        let y = match &l.ffn {
            FeedForward::Dense(w) => self.situ_glu(ctx, w, &y)?,
            FeedForward::Latent(m) => self.latent_moe(ctx, m, &y)?,
        };
        Ok((y.add(&p)?, bank))
    }
}

impl Model for KimiK3 {
    fn spec(&self) -> ModelSpec {
        self.spec.clone()
    }

    /// The embedding, which opens the first residual block (the bank is still empty).
    fn embed<'h>(&self, ctx: &Ctx<'h>, tokens: Tensor<'h>) -> Result<Vec<Tensor<'h>>> {
        Ok(vec![ctx
            .w(&self.params.tok_embeddings)?
            .embedding(&tokens)?])
    }

    /// Hidden state: the open block's sum, then the bank of closed blocks' sums.
    fn layer<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        hidden: Vec<Tensor<'h>>,
    ) -> Result<Vec<Tensor<'h>>> {
        let mut hidden = hidden.into_iter();
        let p = hidden.next().ok_or("layer: missing hidden state")?;
        let l = nth_layer(&self.params.layers, index)?;
        let (p, bank) = self.block(ctx, l, index, p, hidden.collect())?;
        Ok([p].into_iter().chain(bank).collect())
    }

    fn head<'h>(&self, ctx: &Ctx<'h>, hidden: Vec<Tensor<'h>>) -> Result<Tensor<'h>> {
        let mut hidden = hidden.into_iter();
        let p = hidden.next().ok_or("head: missing hidden state")?;
        let bank: Vec<Tensor<'h>> = hidden.collect();
        let pm = &self.params;
        self.mix(ctx, &pm.final_mix, &bank, &p)?
            .rms_norm(&ctx.w(&pm.norm)?, self.args.norm_eps)?
            .linear(&ctx.w(&pm.output)?)
    }
}
