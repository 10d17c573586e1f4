//! Llama 3 (and Qwen3, Qwen3-MoE): pre-norm decoder blocks of grouped-query attention with
//! rotary positions and a SwiGLU feed-forward, written with host ops.
//!
//! ```text
//! h   = x + Attention(RMSNorm(x))
//! out = h + W2 · (SiLU(W1 · RMSNorm(h)) ⊙ W3 · RMSNorm(h))
//! ```
//! In Qwen3-MoE's sparse layers the feed-forward is `Σ_{e ∈ topk(softmax(Wr · x))} g_e · FFN_e(x)`
//! over SwiGLU experts (dropless, one host op).

use crate::config::LlamaArgs;
use crate::spec::{BlockParams, FeedForward, LlamaParams};
use anneal_plugin_api::sdk::vision::{self, mrope};
use anneal_plugin_api::sdk::{
    AttentionOpts, Ctx, Host, Model, ModelSpec, MoeFfnOpts, Result, Rope, Router, Tensor,
};

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

    fn rope(&self) -> Rope {
        Rope {
            theta: self.args.rope_theta,
            rot_dim: self.args.head_dim(),
            interleaved: false,
            llama3_scaling: self.args.rope_scaling.clone(),
            yarn: self.args.yarn.clone(),
        }
    }

    fn attention<'h>(
        &self,
        ctx: &Ctx<'h>,
        l: &BlockParams,
        index: usize,
        x_btd: &Tensor<'h>,
        pos3: Option<&Tensor<'h>>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let hd = a.head_dim() as i64;
        // Shapes come from the projections, not from `x`: a host running tensor parallelism
        // hands back its share of the heads (`-1`), and under sequence parallelism `x` holds
        // a share of the sequence while the projections see all of it.
        let q = x_btd.linear(&ctx.w(&l.wq)?)?;
        let (b, t) = {
            let s = q.shape()?;
            (s[0] as i64, s[1] as i64)
        };
        let mut q_bthd = q.reshape(&[b, t, -1, hd])?;
        let mut k_bthd = x_btd.linear(&ctx.w(&l.wk)?)?.reshape(&[b, t, -1, hd])?;
        let v_bthd = x_btd.linear(&ctx.w(&l.wv)?)?.reshape(&[b, t, -1, hd])?;
        if let Some((q_norm, k_norm)) = &l.qk_norm {
            q_bthd = q_bthd.rms_norm(&ctx.w(q_norm)?, a.norm_eps)?;
            k_bthd = k_bthd.rms_norm(&ctx.w(k_norm)?, a.norm_eps)?;
        }
        let rope = self.rope();
        let section = a.vision.as_ref().map(|vl| vl.mrope_section.as_slice());
        let turn = |x: Tensor<'h>| mrope::rotate(ctx, x, pos3, section, &rope);
        let q_bhtd = turn(q_bthd.transpose(1, 2)?)?;
        let k_bhtd = turn(k_bthd.transpose(1, 2)?)?;
        let v_bhtd = v_bthd.transpose(1, 2)?;
        let opts = AttentionOpts {
            causal: true,
            sliding_window: a.window_of(index),
            cache_layer: ctx.use_cache.then_some(index),
            ..Default::default()
        };
        let o_bhtd = q_bhtd.attention(&k_bhtd, &v_bhtd, &ctx.positions, &opts)?;
        o_bhtd
            .transpose(1, 2)?
            .reshape(&[b, t, -1])?
            .linear(&ctx.w(&l.wo)?)
    }

    fn feed_forward<'h>(
        &self,
        ctx: &Ctx<'h>,
        l: &BlockParams,
        index: usize,
        x: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        match &l.ffn {
            FeedForward::Dense { w1, w2, w3 } => {
                let gate = x.linear(&ctx.w(w1)?)?;
                let up = x.linear(&ctx.w(w3)?)?;
                gate.swiglu(&up)?.linear(&ctx.w(w2)?)
            }
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
}

impl Model for Llama {
    fn spec(&self) -> ModelSpec {
        self.spec.clone()
    }

    fn embed<'h>(&self, ctx: &Ctx<'h>, tokens: Tensor<'h>) -> Result<Vec<Tensor<'h>>> {
        let h = ctx.w(&self.params.tok_embeddings)?.embedding(&tokens)?;
        let tower = self.params.vision.as_ref().zip(self.args.vision.as_ref());
        vision::embed(ctx, tower, &self.args.hf_model_type, &tokens, h)
    }

    fn layer<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        hidden: Vec<Tensor<'h>>,
    ) -> Result<Vec<Tensor<'h>>> {
        // Qwen3-VL with images: then the 3-D positions and the DeepStack features to add.
        let mut hidden = hidden.into_iter();
        let x_btd = hidden.next().ok_or("layer: missing hidden state")?;
        let pos3 = hidden.next();
        let l = self
            .params
            .layers
            .get(index)
            .ok_or_else(|| format!("layer {index}: the model has {}", self.args.n_layers))?;
        let eps = self.args.norm_eps;
        let h = x_btd.add(&self.attention(
            ctx,
            l,
            index,
            &x_btd.rms_norm(&ctx.w(&l.attention_norm)?, eps)?,
            pos3.as_ref(),
        )?)?;
        let normed = h.rms_norm(&ctx.w(&l.ffn_norm)?, eps)?;
        let out = h.add(&self.feed_forward(ctx, l, index, &normed)?)?;
        vision::add_deepstack(out, pos3, hidden.collect())
    }

    /// Aux-loss-free balancing: each sparse layer's routing bias moves towards balance.
    fn before_optimizer_step(&self, host: Host<'_>, _step: u64) -> Result<()> {
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
