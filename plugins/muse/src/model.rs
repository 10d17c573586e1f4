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
use crate::spec::{BlockParams, MuseParams};
use anneal_plugin_api::sdk::kit::blocks::{self, GqaOpts};
use anneal_plugin_api::sdk::kit::{nth_layer, BlockNorms, Decoder, Frame, Norm};
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

    fn block_norms(&self, index: usize) -> Result<BlockNorms<'_>> {
        let l = self.block(index)?;
        Ok(BlockNorms {
            attention: &l.attention_norm,
            ffn: &l.ffn_norm,
            post_attention: Some(&l.attention_post_norm),
            post_ffn: Some(&l.ffn_post_norm),
        })
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
            sliding_window: a.window_of(index),
            ..Default::default()
        };
        blocks::gqa(ctx, &self.block(index)?.attention, &opts, index, x, None)
    }

    fn feed_forward<'h>(&self, ctx: &Ctx<'h>, index: usize, x: &Tensor<'h>) -> Result<Tensor<'h>> {
        let [w1, w3, w2] = &self.block(index)?.ffn;
        blocks::swiglu(ctx, x, w1, w3, w2)
    }

    /// The embeddings are normed without a gain; with images, the tower's embeddings replace
    /// the placeholders' (positions stay 1-D: the decoder's RoPE sees one index per token).
    fn embed_more<'h>(
        &self,
        ctx: &Ctx<'h>,
        tokens: &Tensor<'h>,
        h: Tensor<'h>,
    ) -> Result<Vec<Tensor<'h>>> {
        let h = blocks::scaleless_rms_norm(ctx, &h, self.args.norm_eps)?;
        let Some(images) = &ctx.images else {
            return Ok(vec![h]);
        };
        let (Some(tower), Some(v)) = (&self.params.vision, &self.args.vision) else {
            return Err(
                "this muse_glimmer_text model takes no images (it has no vision tower)".into(),
            );
        };
        let embeds = tower.forward(ctx, v, self.args.norm_eps, images)?;
        let mask = vision::placeholder_mask(tokens, v.image_token_id)?;
        Ok(vec![h.masked_scatter(&mask, &embeds)?])
    }
}
