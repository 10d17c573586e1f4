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
use crate::spec::{AttentionParams, BlockParams, ExpertParams, GptOssParams};
use anneal_plugin_api::sdk::{
    AttentionOpts, Ctx, Host, Model, ModelSpec, MoeFfnOpts, Param, Result, Rope, Router, Tensor,
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

/// `x · Wᵀ + b`.
fn linear<'h>(ctx: &Ctx<'h>, x: &Tensor<'h>, (w, b): &(Param, Param)) -> Result<Tensor<'h>> {
    x.linear(&ctx.w(w)?)?.add(&ctx.w(b)?)
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

    fn attention<'h>(
        &self,
        ctx: &Ctx<'h>,
        p: &AttentionParams,
        index: usize,
        x_btd: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let (b, t) = {
            let s = x_btd.shape()?;
            (s[0] as i64, s[1] as i64)
        };
        let (nh, nkv, hd) = (a.n_heads as i64, a.n_kv_heads as i64, a.head_dim as i64);
        let rope = Rope {
            theta: a.rope_theta,
            rot_dim: a.head_dim,
            interleaved: false,
            llama3_scaling: None,
            yarn: a.yarn.clone(),
        };
        let heads = |w, n| -> Result<Tensor<'h>> {
            linear(ctx, x_btd, w)?
                .reshape(&[b, t, n, hd])?
                .transpose(1, 2)
        };
        let q_bhtd = heads(&p.wq, nh)?.rope(&ctx.positions, &rope)?;
        let k_bhtd = heads(&p.wk, nkv)?.rope(&ctx.positions, &rope)?;
        let v_bhtd = heads(&p.wv, nkv)?;
        let sinks = ctx.w(&p.sinks)?;
        let opts = AttentionOpts {
            causal: true,
            sliding_window: a.window_of(index),
            cache_layer: ctx.use_cache.then_some(index),
            sinks: Some(&sinks),
            ..Default::default()
        };
        let o_bhtd = q_bhtd.attention(&k_bhtd, &v_bhtd, &ctx.positions, &opts)?;
        let o = o_bhtd.transpose(1, 2)?.reshape(&[b, t, nh * hd])?;
        linear(ctx, &o, &p.wo)
    }

    fn experts<'h>(
        &self,
        ctx: &Ctx<'h>,
        p: &ExpertParams,
        index: usize,
        x: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
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
}

impl Model for GptOss {
    fn spec(&self) -> ModelSpec {
        self.spec.clone()
    }

    fn embed<'h>(&self, ctx: &Ctx<'h>, tokens: Tensor<'h>) -> Result<Vec<Tensor<'h>>> {
        Ok(vec![ctx
            .w(&self.params.tok_embeddings)?
            .embedding(&tokens)?])
    }

    fn layer<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        hidden: Vec<Tensor<'h>>,
    ) -> Result<Vec<Tensor<'h>>> {
        let x = hidden
            .into_iter()
            .next()
            .ok_or("layer: missing hidden state")?;
        let l: &BlockParams = self
            .params
            .layers
            .get(index)
            .ok_or_else(|| format!("layer {index}: the model has {}", self.args.n_layers))?;
        let eps = self.args.norm_eps;
        let attn_in = x.rms_norm(&ctx.w(&l.attention_norm)?, eps)?;
        let h = x.add(&self.attention(ctx, &l.attention, index, &attn_in)?)?;
        let ffn_in = h.rms_norm(&ctx.w(&l.ffn_norm)?, eps)?;
        Ok(vec![h.add(&self.experts(ctx, &l.experts, index, &ffn_in)?)?])
    }

    /// Aux-loss-free balancing: each block's routing bias moves towards balance.
    fn before_optimizer_step(&self, host: Host<'_>, _step: u64) -> Result<()> {
        for (index, l) in self.params.layers.iter().enumerate() {
            if let Some(bias) = &l.experts.balance_bias {
                host.update_balance_bias(index, bias, self.args.balance_rate)?;
            }
        }
        Ok(())
    }

    fn head<'h>(&self, ctx: &Ctx<'h>, hidden: Vec<Tensor<'h>>) -> Result<Tensor<'h>> {
        let h = hidden
            .into_iter()
            .next()
            .ok_or("head: missing hidden state")?;
        let p = &self.params;
        h.rms_norm(&ctx.w(&p.norm)?, self.args.norm_eps)?
            .linear(&ctx.w(&p.output)?)
    }
}
