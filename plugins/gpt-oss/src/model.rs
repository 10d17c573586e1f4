//! gpt-oss (OpenAI, 2025): pre-norm decoder blocks of grouped-query attention with learned
//! sinks, alternating sliding-window and full attention, YaRN rotary positions, and a mixture
//! of clamped-SwiGLU experts, written with host ops.
//!
//! ```text
//! h   = x + Wo · Attention(RMSNorm(x)) + bo          q, k, v = W · x + b; one sink logit per head
//! out = h + Σ_{e ∈ topk(Wr · y + br)} g_e · (We_down · act(We_gate · y + b, We_up · y + b) + b)
//!       with y = RMSNorm(h), act(g, u) = (clamp(u, ±L) + 1) · g' · σ(α g'), g' = min(g, L)
//! ```

use crate::config::GptOssArgs;
use crate::spec::{BlockParams, GptOssParams};
use anneal_plugin_api::sdk::kit::blocks::{self, GqaOpts};
use anneal_plugin_api::sdk::kit::{nth_layer, BlockNorms, Decoder, Frame, Norm};
use anneal_plugin_api::sdk::{
    Ctx, Host, ModelSpec, MoeFfnOpts, Param, Result, Rope, Router, Tensor,
};

/// A gpt-oss model: its arguments and declared parameters (the weights live in the host).
pub struct GptOss {
    /// Shapes and options.
    pub args: GptOssArgs,
    /// Handles to every parameter.
    pub params: GptOssParams,
    /// The spec, built (and checked) once when the model is created.
    pub spec: ModelSpec,
}

impl GptOss {
    /// Declares the parameters of `args` and checks the spec they make.
    pub fn new(args: GptOssArgs) -> Result<Self> {
        args.validate()?;
        let (params, specs) = crate::spec::declare(&args);
        let spec = crate::spec::model_spec(&args, specs);
        spec.check()?;
        Ok(GptOss { args, params, spec })
    }

    fn block(&self, index: usize) -> Result<&BlockParams> {
        nth_layer(&self.params.layers, index)
    }
}

impl Decoder for GptOss {
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
            rope: Some(Rope {
                yarn: a.yarn.clone(),
                ..Rope::new(a.rope_theta, a.head_dim)
            }),
            sliding_window: a.window_of(index),
            ..Default::default()
        };
        blocks::gqa(ctx, &self.block(index)?.attention, &opts, index, x, None)
    }

    fn feed_forward<'h>(&self, ctx: &Ctx<'h>, index: usize, x: &Tensor<'h>) -> Result<Tensor<'h>> {
        let a = &self.args;
        let p = &self.block(index)?.experts;
        // Softmax over the top-k logits = the full softmax's top-k weights, renormalised.
        let mut opts = MoeFfnOpts::new(Router {
            renormalize: true,
            ..Router::new(a.n_experts, a.top_k)
        });
        opts.aux_loss_coef = a.aux_loss_coef;
        opts.clamped_swiglu = Some((a.swiglu_alpha, a.swiglu_limit));
        let w = |p: &Param| ctx.w(p);
        let (router_bias, gate_bias, up_bias, down_bias) = (
            w(&p.router_bias)?,
            w(&p.gate.1)?,
            w(&p.up.1)?,
            w(&p.down.1)?,
        );
        let balance_bias = p.balance_bias.as_ref().map(w).transpose()?;
        opts.router_bias = Some(&router_bias);
        opts.gate_bias = Some(&gate_bias);
        opts.up_bias = Some(&up_bias);
        opts.down_bias = Some(&down_bias);
        opts.balance_bias = balance_bias.as_ref();
        x.moe_ffn(
            &w(&p.router)?,
            &w(&p.gate.0)?,
            &w(&p.up.0)?,
            &w(&p.down.0)?,
            &opts,
        )?
        .report(ctx, index, balance_bias.as_ref())
    }

    /// Aux-loss-free balancing: each block's routing bias moves towards balance.
    fn before_step(&self, host: Host<'_>, _step: u64) -> Result<()> {
        for (index, l) in self.params.layers.iter().enumerate() {
            if let Some(bias) = &l.experts.balance_bias {
                host.update_balance_bias(index, bias, self.args.balance_rate)?;
            }
        }
        Ok(())
    }
}
