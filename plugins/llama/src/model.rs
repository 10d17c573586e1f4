//! Llama 3 (and Qwen3, Qwen3-MoE, Mixtral, Qwen3-VL): the SDK's decoder of pre-norm blocks,
//! filled with grouped-query attention with rotary positions and a SwiGLU feed-forward.
//!
//! ```text
//! h   = x + Attention(RMSNorm(x))
//! out = h + W2 · (SiLU(W1 · RMSNorm(h)) ⊙ W3 · RMSNorm(h))
//! ```
//! In Qwen3-MoE's sparse layers the feed-forward is `Σ_{e ∈ topk(softmax(Wr · x))} g_e · FFN_e(x)`
//! over SwiGLU experts (dropless, one host op).

use crate::config::LlamaArgs;
use crate::spec::{BlockParams, FeedForward, LlamaParams};
use anneal_plugin_api::sdk::kit::blocks::{self, GqaOpts};
use anneal_plugin_api::sdk::kit::{nth_layer, BlockNorms, Decoder, Frame, Norm};
use anneal_plugin_api::sdk::vision;
use anneal_plugin_api::sdk::{Ctx, Host, ModelSpec, MoeFfnOpts, Result, Rope, Router, Tensor};

/// A Llama-family model: its arguments and declared parameters (the weights live in the host).
pub struct Llama {
    /// Shapes and options.
    pub args: LlamaArgs,
    /// Handles to every parameter.
    pub params: LlamaParams,
    /// The spec, built (and checked) once when the model is created.
    pub spec: ModelSpec,
}

impl Llama {
    /// Declares the parameters of `args` and checks the spec they make.
    pub fn new(args: LlamaArgs) -> Result<Self> {
        args.validate()?;
        let (params, specs) = crate::spec::declare(&args);
        let spec = crate::spec::model_spec(&args, specs);
        spec.check()?;
        Ok(Llama { args, params, spec })
    }

    fn block(&self, index: usize) -> Result<&BlockParams> {
        nth_layer(&self.params.layers, index)
    }
}

impl Decoder for Llama {
    fn spec(&self) -> ModelSpec {
        self.spec.clone()
    }

    fn norm(&self) -> Norm {
        Norm::plain(self.args.norm_eps)
    }

    fn frame(&self) -> Frame<'_> {
        let p = &self.params;
        Frame::new(&p.tok_embeddings, &p.norm, &p.output)
    }

    fn block_norms(&self, index: usize) -> Result<BlockNorms<'_>> {
        let l = self.block(index)?;
        Ok(BlockNorms::pre(&l.attention_norm, &l.ffn_norm))
    }

    /// `extra`, with images: Qwen3-VL's 3-D positions, then the DeepStack features.
    fn attention<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        x: &Tensor<'h>,
        extra: &[Tensor<'h>],
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let opts = GqaOpts {
            head_dim: a.head_dim(),
            rope: Some(Rope {
                llama3_scaling: a.rope_scaling.clone(),
                yarn: a.yarn.clone(),
                ..Rope::new(a.rope_theta, a.head_dim())
            }),
            qk_norm: Some(self.norm()),
            sliding_window: a.window_of(index),
            mrope_section: a.vision.as_ref().map(|vl| vl.mrope_section.as_slice()),
            ..Default::default()
        };
        blocks::gqa(
            ctx,
            &self.block(index)?.attention,
            &opts,
            index,
            x,
            extra.first(),
        )
    }

    fn feed_forward<'h>(&self, ctx: &Ctx<'h>, index: usize, x: &Tensor<'h>) -> Result<Tensor<'h>> {
        match &self.block(index)?.ffn {
            FeedForward::Dense { w1, w2, w3 } => blocks::swiglu(ctx, x, w1, w3, w2),
            FeedForward::Experts {
                router,
                w1,
                w2,
                w3,
                balance_bias,
            } => {
                let m = self
                    .args
                    .moe_of(index)
                    .ok_or_else(|| format!("layer {index} has experts but no MoE settings"))?;
                let mut opts = MoeFfnOpts::new(Router {
                    renormalize: m.norm_topk_prob,
                    ..Router::new(m.n_experts, m.top_k)
                });
                opts.out_in = true;
                opts.aux_loss_coef = m.aux_loss_coef;
                let bias = balance_bias.as_ref().map(|b| ctx.w(b)).transpose()?;
                opts.balance_bias = bias.as_ref();
                let moe = x.moe_ffn(
                    &ctx.w(router)?,
                    &ctx.w(w1)?,
                    &ctx.w(w3)?,
                    &ctx.w(w2)?,
                    &opts,
                )?;
                moe.report(ctx, index, bias.as_ref())
            }
        }
    }

    fn embed_more<'h>(
        &self,
        ctx: &Ctx<'h>,
        tokens: &Tensor<'h>,
        h: Tensor<'h>,
    ) -> Result<Vec<Tensor<'h>>> {
        let tower = self.params.vision.as_ref().zip(self.args.vision.as_ref());
        vision::embed(ctx, tower, &self.args.hf_model_type, tokens, h)
    }

    /// Qwen3-VL with images: the DeepStack features are added after the first blocks.
    fn after_block<'h>(
        &self,
        _index: usize,
        out: Tensor<'h>,
        extra: Vec<Tensor<'h>>,
    ) -> Result<Vec<Tensor<'h>>> {
        let mut extra = extra.into_iter();
        let pos3 = extra.next();
        vision::add_deepstack(out, pos3, extra.collect())
    }

    /// Aux-loss-free balancing: each sparse layer's routing bias moves towards balance.
    fn before_step(&self, host: Host<'_>, _step: u64) -> Result<()> {
        for (index, l) in self.params.layers.iter().enumerate() {
            if let (
                FeedForward::Experts {
                    balance_bias: Some(bias),
                    ..
                },
                Some(m),
            ) = (&l.ffn, self.args.moe_of(index))
            {
                host.update_balance_bias(index, bias, m.balance_rate)?;
            }
        }
        Ok(())
    }
}
