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
use crate::spec::{
    BlockParams, FeedForward, FullAttention, LinearAttention, Mixer, Qwen35Params, SwiGlu,
};
use anneal_plugin_api::sdk::vision::{self, mrope};
use anneal_plugin_api::sdk::{
    AttentionOpts, Ctx, DeltaRuleOpts, Model, ModelSpec, MoeFfnOpts, Result, Rope, Router, Tensor,
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

/// `RMSNorm(x) · (1 + w)`: Qwen3.5's norms keep `w` centred on 0.
fn norm0<'h>(x: &Tensor<'h>, w: &Tensor<'h>, eps: f64) -> Result<Tensor<'h>> {
    x.rms_norm(&w.affine(1.0, 1.0)?, eps)
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

    /// Gated softmax attention; `pos3` (f32 `[3, B, T]`): the 3-D positions of a prompt with
    /// images, for MRoPE.
    fn full_attention<'h>(
        &self,
        ctx: &Ctx<'h>,
        l: &FullAttention,
        index: usize,
        x_btd: &Tensor<'h>,
        pos3: Option<&Tensor<'h>>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let (b, t) = batch_and_time(x_btd)?;
        let (nh, nkv, hd) = (a.n_heads as i64, a.n_kv_heads as i64, a.head_dim);
        let qg_bthd = x_btd
            .linear(&ctx.w(&l.wq)?)?
            .reshape(&[b, t, nh, 2 * hd as i64])?;
        let gate_btd = qg_bthd
            .narrow(3, hd, hd)?
            .reshape(&[b, t, nh * hd as i64])?;
        let q_bthd = norm0(&qg_bthd.narrow(3, 0, hd)?, &ctx.w(&l.q_norm)?, a.norm_eps)?;
        let k_bthd = x_btd
            .linear(&ctx.w(&l.wk)?)?
            .reshape(&[b, t, nkv, hd as i64])?;
        let k_bthd = norm0(&k_bthd, &ctx.w(&l.k_norm)?, a.norm_eps)?;
        let v_bthd = x_btd
            .linear(&ctx.w(&l.wv)?)?
            .reshape(&[b, t, nkv, hd as i64])?;
        // Text-only multimodal RoPE has one position per token in all three sections: plain RoPE.
        let rope = Rope {
            theta: a.rope_theta,
            rot_dim: a.rot_dim(),
            interleaved: false,
            llama3_scaling: None,
            yarn: None,
        };
        let section = a.vision.as_ref().map(|vl| vl.mrope_section.as_slice());
        let turn = |x: Tensor<'h>| mrope::rotate(ctx, x, pos3, section, &rope);
        let q_bhtd = turn(q_bthd.transpose(1, 2)?)?;
        let k_bhtd = turn(k_bthd.transpose(1, 2)?)?;
        let opts = AttentionOpts {
            causal: true,
            cache_layer: ctx.use_cache.then_some(index),
            ..Default::default()
        };
        let o_bhtd = q_bhtd.attention(&k_bhtd, &v_bthd.transpose(1, 2)?, &ctx.positions, &opts)?;
        o_bhtd
            .transpose(1, 2)?
            .reshape(&[b, t, nh * hd as i64])?
            .mul(&gate_btd.unary("sigmoid")?)?
            .linear(&ctx.w(&l.wo)?)
    }

    fn swiglu<'h>(ctx: &Ctx<'h>, w: &SwiGlu, x: &Tensor<'h>) -> Result<Tensor<'h>> {
        let gate = x.linear(&ctx.w(&w.w1)?)?;
        gate.swiglu(&x.linear(&ctx.w(&w.w3)?)?)?
            .linear(&ctx.w(&w.w2)?)
    }

    fn feed_forward<'h>(
        &self,
        ctx: &Ctx<'h>,
        l: &BlockParams,
        index: usize,
        x: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let (router, w1, w2, w3, shared, shared_gate) = match &l.ffn {
            FeedForward::Dense(w) => return Self::swiglu(ctx, w, x),
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
        let gate = x.linear(&ctx.w(shared_gate)?)?.unary("sigmoid")?;
        routed.add(&Self::swiglu(ctx, shared, x)?.mul(&gate)?)
    }
}

impl Model for Qwen35 {
    fn spec(&self) -> ModelSpec {
        self.spec.clone()
    }

    /// The token embeddings; with images, the tower's embeddings in their placeholders and the
    /// 3-D positions beside them (with a cache after such a prompt, the positions decode
    /// continues).
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
        // With images, the 3-D positions follow the hidden state (Qwen3.5 has no DeepStack).
        let mut hidden = hidden.into_iter();
        let x_btd = hidden.next().ok_or("layer: missing hidden state")?;
        let pos3 = hidden.next();
        let l = self
            .params
            .layers
            .get(index)
            .ok_or_else(|| format!("layer {index}: the model has {}", self.args.n_layers))?;
        let eps = self.args.norm_eps;
        let normed = norm0(&x_btd, &ctx.w(&l.attention_norm)?, eps)?;
        let mixed = match &l.mixer {
            Mixer::Linear(m) => self.linear_attention(ctx, m, index, &normed)?,
            Mixer::Full(m) => self.full_attention(ctx, m, index, &normed, pos3.as_ref())?,
        };
        let h = x_btd.add(&mixed)?;
        let normed = norm0(&h, &ctx.w(&l.ffn_norm)?, eps)?;
        let out = h.add(&self.feed_forward(ctx, l, index, &normed)?)?;
        Ok(std::iter::once(out).chain(pos3).collect())
    }

    fn head<'h>(&self, ctx: &Ctx<'h>, hidden: Vec<Tensor<'h>>) -> Result<Tensor<'h>> {
        let h = hidden
            .into_iter()
            .next()
            .ok_or("head: missing hidden state")?;
        let p = &self.params;
        norm0(&h, &ctx.w(&p.norm)?, self.args.norm_eps)?.linear(&ctx.w(&p.output)?)
    }
}
