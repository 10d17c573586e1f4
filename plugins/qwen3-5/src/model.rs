//! Qwen3.5 (and Qwen3.5-MoE): pre-norm blocks whose token mixer is Gated DeltaNet in most
//! layers and output-gated softmax attention in every fourth, written with host ops.
//!
//! ```text
//! h   = x + Mixer(RMSNorm₀(x))            RMSNorm₀(x) = RMSNorm(x) · (1 + w)  (zero-centred)
//! out = h + FFN(RMSNorm₀(h))              SwiGLU, or routed experts + σ(g·x) · shared expert
//!
//! Gated DeltaNet:
//!   q, k, v = split(SiLU(CausalConv₄(W_qkv x)))           per head: q, k L2-normalised
//!   β = σ(W_b x),  g = −exp(A_log) · softplus(W_a x + dt_bias)
//!   S_t = e^{g_t} S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ k_t)ᵀ,  o_t = S_tᵀ q_t / √d_k
//!   out = W_o · (RMSNorm(o) · w ⊙ SiLU(W_z x))              per value head
//!
//! Gated attention:
//!   q, gate = chunk(W_q x) per head;  q, k = RMSNorm₀ per head, RoPE on the first rot_dim dims
//!   out = W_o · (Attention(q, k, v) ⊙ σ(gate))
//! ```
//! Decode keeps, per sequence, the convolution's last K−1 inputs and the delta rule's state
//! (linear layers) and the keys and values (attention layers) in the host's cache.
//!
//! With vision (`Qwen3_5ForConditionalGeneration`), `embed` runs the SDK's vision tower on the
//! forward's images and puts the merged embeddings into the image placeholders; the 3-D
//! positions travel beside the hidden state, and the full-attention layers turn the rotated
//! dims of queries and keys by interleaved MRoPE (the Gated DeltaNet layers take no positions).

use crate::config::Qwen35Args;
use crate::spec::{BlockParams, FeedForward, LinearAttention, Mixer, Qwen35Params};
use anneal_plugin_api::sdk::kit::blocks::{self, GqaOpts};
use anneal_plugin_api::sdk::kit::{nth_layer, BlockNorms, Decoder, Frame, Norm};
use anneal_plugin_api::sdk::vision;
use anneal_plugin_api::sdk::{
    Ctx, DeltaRuleOpts, ModelSpec, MoeFfnOpts, Result, Rope, Router, Tensor,
};

/// A Qwen3.5 model: its arguments and declared parameters (the weights live in the host).
pub struct Qwen35 {
    /// Shapes and options.
    pub args: Qwen35Args,
    /// Handles to every parameter.
    pub params: Qwen35Params,
    /// The spec, built (and checked) once when the model is created.
    pub spec: ModelSpec,
}

fn batch_and_time(x_btd: &Tensor<'_>) -> Result<(i64, i64)> {
    let s = x_btd.shape()?;
    Ok((s[0] as i64, s[1] as i64))
}

impl Qwen35 {
    /// Declares the parameters of `args` and checks the spec they make.
    pub fn new(args: Qwen35Args) -> Result<Self> {
        args.validate()?;
        let (params, specs) = crate::spec::declare(&args);
        let spec = crate::spec::model_spec(&args, specs);
        spec.check()?;
        Ok(Qwen35 { args, params, spec })
    }

    fn block(&self, index: usize) -> Result<&BlockParams> {
        nth_layer(&self.params.layers, index)
    }

    fn linear_attention<'h>(
        &self,
        ctx: &Ctx<'h>,
        l: &LinearAttention,
        index: usize,
        x_btd: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let (b, t) = batch_and_time(x_btd)?;
        let (hk, dk) = (a.linear_n_key_heads as i64, a.linear_key_head_dim as i64);
        let (hv, dv) = (
            a.linear_n_value_heads as i64,
            a.linear_value_head_dim as i64,
        );
        let cache = ctx.use_cache.then_some(index);
        let conv_ck = ctx
            .w(&l.conv1d)?
            .reshape(&[a.conv_dim() as i64, a.linear_conv_kernel as i64])?;
        let qkv_btc = x_btd
            .linear(&ctx.w(&l.in_proj_qkv)?)?
            .causal_conv1d(&conv_ck, true, cache)?;
        let key_dim = a.linear_key_dim();
        let q_bthd = qkv_btc.narrow(2, 0, key_dim)?.reshape(&[b, t, hk, dk])?;
        let k_bthd = qkv_btc
            .narrow(2, key_dim, key_dim)?
            .reshape(&[b, t, hk, dk])?;
        let v_bthd = qkv_btc
            .narrow(2, 2 * key_dim, a.linear_value_dim())?
            .reshape(&[b, t, hv, dv])?;
        let beta_bth = x_btd.linear(&ctx.w(&l.in_proj_b)?)?.unary("sigmoid")?;
        // The log-decay in f32 whatever the parameters' dtype, as transformers computes it: a
        // sum of many of them must not round to the next bf16 step.
        let decay_rate = ctx
            .w(&l.a_log)?
            .to_dtype("f32")?
            .unary("exp")?
            .scale(-1.0)?;
        let g_bth = x_btd
            .linear(&ctx.w(&l.in_proj_a)?)?
            .to_dtype("f32")?
            .add(&ctx.w(&l.dt_bias)?.to_dtype("f32")?)?
            .unary("softplus")?
            .mul(&decay_rate)?;
        let opts = DeltaRuleOpts {
            qk_l2norm: true,
            cache_layer: cache,
            ..Default::default()
        };
        let o_bthd = q_bthd.gated_delta_rule(&k_bthd, &v_bthd, &g_bth, &beta_bth, &opts)?;
        let z_bthd = x_btd
            .linear(&ctx.w(&l.in_proj_z)?)?
            .reshape(&[b, t, hv, dv])?;
        o_bthd
            .rms_norm(&ctx.w(&l.norm)?, a.norm_eps)?
            .mul(&z_bthd.silu()?)?
            .reshape(&[b, t, hv * dv])?
            .linear(&ctx.w(&l.out_proj)?)
    }
}

impl Decoder for Qwen35 {
    fn spec(&self) -> ModelSpec {
        self.spec.clone()
    }

    /// Qwen3.5's norms keep `w` centred on 0: `RMSNorm(x) · (1 + w)`.
    fn norm(&self) -> Norm {
        Norm::centred(self.args.norm_eps)
    }

    fn frame(&self) -> Frame<'_> {
        let p = &self.params;
        Frame::new(&p.tok_embeddings, &p.norm, &p.output)
    }

    fn block_norms(&self, index: usize) -> Result<BlockNorms<'_>> {
        let l = self.block(index)?;
        Ok(BlockNorms::pre(&l.attention_norm, &l.ffn_norm))
    }

    /// `extra`, with images: the 3-D positions (Qwen3.5 has no DeepStack), which only the
    /// full-attention layers take.
    fn attention<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        x: &Tensor<'h>,
        extra: &[Tensor<'h>],
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        match &self.block(index)?.mixer {
            Mixer::Linear(m) => self.linear_attention(ctx, m, index, x),
            Mixer::Full(p) => {
                // Text-only multimodal RoPE has one position per token in all three
                // sections: plain RoPE.
                let opts = GqaOpts {
                    head_dim: a.head_dim,
                    rope: Some(Rope::new(a.rope_theta, a.rot_dim())),
                    qk_norm: Some(self.norm()),
                    gate_in_query: true,
                    mrope_section: a.vision.as_ref().map(|vl| vl.mrope_section.as_slice()),
                    ..Default::default()
                };
                blocks::gqa(ctx, p, &opts, index, x, extra.first())
            }
        }
    }

    fn feed_forward<'h>(&self, ctx: &Ctx<'h>, index: usize, x: &Tensor<'h>) -> Result<Tensor<'h>> {
        let (router, w1, w2, w3, shared, shared_gate) = match &self.block(index)?.ffn {
            FeedForward::Dense(w) => return blocks::swiglu(ctx, x, &w.w1, &w.w3, &w.w2),
            FeedForward::Experts {
                router,
                w1,
                w2,
                w3,
                shared,
                shared_gate,
            } => (router, w1, w2, w3, shared, shared_gate),
        };
        let m = self
            .args
            .moe
            .as_ref()
            .ok_or("a block has experts but the model no MoE settings")?;
        let mut opts = MoeFfnOpts::new(Router {
            renormalize: true,
            ..Router::new(m.n_experts, m.top_k)
        });
        opts.out_in = true;
        opts.aux_loss_coef = m.aux_loss_coef;
        let routed = x
            .moe_ffn(
                &ctx.w(router)?,
                &ctx.w(w1)?,
                &ctx.w(w3)?,
                &ctx.w(w2)?,
                &opts,
            )?
            .report(ctx, index, None)?;
        let shared = [&shared.w1, &shared.w3, &shared.w2];
        blocks::gated_shared_expert(ctx, x, &routed, shared, shared_gate)
    }

    /// The token embeddings; with images, the tower's embeddings in their placeholders and the
    /// 3-D positions beside them (with a cache after such a prompt, the positions decode
    /// continues).
    fn embed_more<'h>(
        &self,
        ctx: &Ctx<'h>,
        tokens: &Tensor<'h>,
        h: Tensor<'h>,
    ) -> Result<Vec<Tensor<'h>>> {
        let tower = self.params.vision.as_ref().zip(self.args.vision.as_ref());
        vision::embed(ctx, tower, &self.args.hf_model_type, tokens, h)
    }
}
