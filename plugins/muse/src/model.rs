//! Muse Glimmer (Meta, 2026): the SDK's decoder with sandwich norms, filled with gated
//! grouped-query attention and a SwiGLU feed-forward.
//!
//! ```text
//! x₀  = RMSNorm(Embed(tokens))                          no gain
//! h   = x + RMSNorm₀(Attention(RMSNorm₀(x)))            RMSNorm₀ = RMSNorm · (1 + w)
//! out = h + RMSNorm₀(W2 · (SiLU(W1 y) ⊙ W3 y)),  y = RMSNorm₀(h)
//! logits = c · tanh(m · W_out · RMSNorm(x_L) / c)
//!
//! Attention: q, k = RMSNorm(W_q x), RMSNorm(W_k x) per head, no gain; q ·= s;
//!   RoPE on three blocks of four, none (NoPE, full attention) on every 4th counted from the
//!   last, a sliding window elsewhere;  out = W_o · (Attention(q, k, v) ⊙ σ(W_g x))
//! ```

use crate::config::MuseArgs;
use crate::spec::{BlockParams, FeedForward, LatentExperts, MuseParams};
use anneal_plugin_api::sdk::kit::blocks::{self, GqaOpts, SigmoidRouting};
use anneal_plugin_api::sdk::kit::{nth_layer, BlockNorms, Decoder, Frame, Norm, Sublayer};
use anneal_plugin_api::sdk::{vision, Ctx, ModelSpec, Result, Rope, Tensor};

/// A Muse Glimmer model: its arguments and declared parameters (the weights live in the host).
pub struct Muse {
    /// Shapes and options.
    pub args: MuseArgs,
    /// Handles to every parameter.
    pub params: MuseParams,
    /// The spec, built (and checked) once when the model is created.
    pub spec: ModelSpec,
}

impl Muse {
    /// Declares the parameters of `args` and checks the spec they make.
    pub fn new(args: MuseArgs) -> Result<Self> {
        args.validate()?;
        let (params, specs) = crate::spec::declare(&args);
        let spec = crate::spec::model_spec(&args, specs);
        spec.check()?;
        Ok(Muse { args, params, spec })
    }

    fn block(&self, index: usize) -> Result<&BlockParams> {
        nth_layer(&self.params.layers, index)
    }

    /// Muse Spark's sparse feed-forward on `x [B, T, D]`: sigmoid scores of `m · W_r · x` (the
    /// routing bias steers the choice only), the top-k weights renormalised and scaled; the
    /// experts run on the normed latent projection, each output scaled by `1 + w` and normed.
    fn latent_experts<'h>(
        &self,
        ctx: &Ctx<'h>,
        p: &LatentExperts,
        x: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let sp = a
            .spark
            .as_ref()
            .ok_or("a sparse block in a model without Spark settings")?;
        let s = x.shape()?;
        let (b, t, d) = (s[0] as i64, s[1] as i64, s[2] as i64);
        let e = sp.n_experts;
        let flat = x.reshape(&[b * t, d])?;
        let scores = flat
            .to_dtype("f32")?
            .linear(&ctx.w(&p.router)?.to_dtype("f32")?)?
            .scale(a.output_multiplier)?
            .unary("sigmoid")?;
        let routing = SigmoidRouting {
            top_k: sp.top_k,
            groups: None,
            renormalize: Some(1e-15),
            scale: sp.routed_scaling_factor,
        };
        let (experts, weights) = blocks::sigmoid_route(&scores, &ctx.w(&p.bias)?, &routing)?;
        let [_, _, _, counts] = ctx.host.sort_by_expert(&experts, e)?;
        let latent = Norm::centred(a.norm_eps).apply(
            ctx,
            &flat.linear(&ctx.w(&p.pre_proj)?)?,
            &p.pre_norm,
        )?;
        let rows = latent.moe_dispatch(&experts, e)?;
        let gate = rows.grouped_matmul_nt(&ctx.w(&p.gate)?, &counts)?;
        let up = rows.grouped_matmul_nt(&ctx.w(&p.up)?, &counts)?;
        let out = gate
            .swiglu(&up)?
            .grouped_matmul_nt(&ctx.w(&p.down)?, &counts)?;
        let scaled = out.mul(&ctx.w(&p.post_norm)?.affine(1.0, 1.0)?)?;
        blocks::scaleless_rms_norm(ctx, &scaled, a.post_norm_eps)?
            .moe_combine(&weights.to_dtype(&out.dtype()?)?, &experts, e)?
            .linear(&ctx.w(&p.post_proj)?)?
            .reshape(&[b, t, d])
    }
}

impl Decoder for Muse {
    fn spec(&self) -> ModelSpec {
        self.spec.clone()
    }

    fn norm(&self) -> Norm {
        Norm::centred(self.args.norm_eps)
    }

    fn post_norm(&self) -> Norm {
        Norm::centred(self.args.post_norm_eps)
    }

    fn final_norm(&self) -> Norm {
        Norm::plain(self.args.norm_eps)
    }

    fn frame(&self) -> Frame<'_> {
        let p = &self.params;
        Frame {
            logit_multiplier: Some(self.args.output_multiplier),
            logit_softcap: Some(self.args.logit_softcap),
            ..Frame::new(&p.tok_embeddings, &p.norm, &p.output)
        }
    }

    /// Spark's post-norms are not the centred kind: [`Decoder::residual`] applies them.
    fn block_norms(&self, index: usize) -> Result<BlockNorms<'_>> {
        let l = self.block(index)?;
        let spark = self.args.spark.is_some();
        Ok(BlockNorms {
            post_attention: l.attention_post_norm.as_ref(),
            post_ffn: (!spark).then_some(&l.ffn_post_norm),
            ..BlockNorms::pre(&l.attention_norm, &l.ffn_norm)
        })
    }

    /// Spark: the attention's output normed without a gain, the feed-forward's scaled by `1 + w`
    /// then normed, each joined to the residual by its gate, `α·x + β·y` with
    /// `β = σ(g/τ)`, `α = √max(σ(−g/τ)·(1 + β), 10⁻³)`.
    fn residual<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        which: Sublayer,
        x: &Tensor<'h>,
        y: Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let (Some(sp), Some(gates)) = (&self.args.spark, &self.block(index)?.residual_gates) else {
            return x.add(&y);
        };
        let eps = self.args.post_norm_eps;
        let (y, gate) = match which {
            Sublayer::Attention => (blocks::scaleless_rms_norm(ctx, &y, eps)?, &gates[0]),
            Sublayer::FeedForward => {
                let w = ctx.w(&self.block(index)?.ffn_post_norm)?.affine(1.0, 1.0)?;
                (
                    blocks::scaleless_rms_norm(ctx, &y.mul(&w)?, eps)?,
                    &gates[1],
                )
            }
        };
        // The gates are f32 parameters, computed in f32, applied in the stream's dtype.
        let dtype = x.dtype()?;
        let g = ctx.w(gate)?.scale(1.0 / sp.residual_gate_temperature)?;
        let beta = g.unary("sigmoid")?;
        let alpha = g
            .scale(-1.0)?
            .unary("sigmoid")?
            .mul(&beta.affine(1.0, 1.0)?)?
            .clamp(1e-3, f64::INFINITY)?
            .sqrt()?;
        x.mul(&alpha.to_dtype(&dtype)?)?
            .add(&y.mul(&beta.to_dtype(&dtype)?)?)
    }

    fn attention<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        x: &Tensor<'h>,
        _extra: &[Tensor<'h>],
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let opts = GqaOpts {
            head_dim: a.head_dim,
            rope: a
                .has_rope(index)
                .then_some(Rope::new(a.rope_theta, a.head_dim)),
            scaleless_qk_norm: Some(a.norm_eps),
            query_scale: Some(a.qk_scale_factor),
            scaleless_out_norm: a.spark.is_some().then_some(a.norm_eps),
            sliding_window: a.window_of(index),
            ..Default::default()
        };
        blocks::gqa(ctx, &self.block(index)?.attention, &opts, index, x, None)
    }

    fn feed_forward<'h>(&self, ctx: &Ctx<'h>, index: usize, x: &Tensor<'h>) -> Result<Tensor<'h>> {
        match &self.block(index)?.ffn {
            FeedForward::Dense([w1, w3, w2]) => blocks::swiglu(ctx, x, w1, w3, w2),
            FeedForward::Latent(p) => self.latent_experts(ctx, p, x),
        }
    }

    /// The embeddings are normed without a gain; with images, the vision tower's embeddings
    /// replace the image placeholders', with audio (Spark) the audio tower's the audio
    /// placeholders' (positions stay 1-D: the decoder's RoPE sees one index per token).
    fn embed_more<'h>(
        &self,
        ctx: &Ctx<'h>,
        tokens: &Tensor<'h>,
        h: Tensor<'h>,
    ) -> Result<Vec<Tensor<'h>>> {
        let mut h = blocks::scaleless_rms_norm(ctx, &h, self.args.norm_eps)?;
        if let Some(images) = &ctx.images {
            let (Some(tower), Some(v)) = (&self.params.vision, &self.args.vision) else {
                return Err(format!(
                    "this {} model takes no images (it has no vision tower)",
                    self.args.model_type()
                )
                .into());
            };
            let embeds = tower.forward(ctx, v, self.args.norm_eps, images)?;
            let mask = vision::placeholder_mask(tokens, v.image_token_id)?;
            h = h.masked_scatter(&mask, &embeds)?;
        }
        if let Some(audio) = &ctx.audio {
            let (Some(tower), Some(au)) = (&self.params.audio, &self.args.audio) else {
                return Err(format!(
                    "this {} model takes no audio (it has no audio tower; Muse Spark's \
                     checkpoints with an audio_config do)",
                    self.args.model_type()
                )
                .into());
            };
            let embeds = tower.forward(ctx, au, self.args.norm_eps, audio)?;
            let id = au.audio_token_id as i64;
            let placeholders = tokens.read_ints()?.iter().filter(|&&t| t == id).count();
            let made = embeds.shape()?[0];
            if placeholders != made {
                let per = au.samples_per_token();
                return Err(format!(
                    "the tokens hold {placeholders} audio placeholder tokens (id {id}) but the \
                     {} audio clip(s) make {made} audio embeddings (a clip of n samples takes \
                     ceil(n / {per}) placeholders: {:?})",
                    audio.lengths.len(),
                    audio
                        .lengths
                        .iter()
                        .map(|n| n.div_ceil(per))
                        .collect::<Vec<_>>()
                )
                .into());
            }
            let mask = vision::placeholder_mask(tokens, au.audio_token_id)?;
            h = h.masked_scatter(&mask, &embeds)?;
        }
        Ok(vec![h])
    }
}
