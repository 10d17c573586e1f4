//! Llama 3 (and Qwen3): pre-norm decoder blocks of grouped-query attention with rotary
//! positions and a SwiGLU feed-forward, written with host ops.
//!
//! ```text
//! h   = x + Attention(RMSNorm(x))
//! out = h + W2 · (SiLU(W1 · RMSNorm(h)) ⊙ W3 · RMSNorm(h))
//! ```

use crate::config::LlamaArgs;
use anneal_plugin_api::sdk::{AttentionOpts, Ctx, Host, Model, ModelSpec, Result, Rope, Tensor};

/// A Llama-family model: its arguments (the weights live in the host).
pub struct Llama {
    /// Shapes and options.
    pub args: LlamaArgs,
}

/// The parameters of block `i`, fetched by name from the host.
struct Block<'h> {
    host: Host<'h>,
    prefix: String,
}

impl<'h> Block<'h> {
    fn w(&self, name: &str) -> Result<Tensor<'h>> {
        self.host.param(&format!("{}.{name}", self.prefix))
    }
}

impl Llama {
    fn rope(&self) -> Rope {
        Rope {
            theta: self.args.rope_theta,
            rot_dim: self.args.head_dim(),
            interleaved: false,
            llama3_scaling: self.args.rope_scaling.clone(),
        }
    }

    fn attention<'h>(
        &self,
        ctx: &Ctx<'h>,
        l: &Block<'h>,
        index: usize,
        x_btd: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let (b, t) = {
            let s = x_btd.shape()?;
            (s[0] as i64, s[1] as i64)
        };
        let (nh, nkv, hd) = (a.n_heads as i64, a.n_kv_heads as i64, a.head_dim() as i64);
        let mut q_bthd = x_btd
            .linear(&l.w("attention.wq.weight")?)?
            .reshape(&[b, t, nh, hd])?;
        let mut k_bthd = x_btd
            .linear(&l.w("attention.wk.weight")?)?
            .reshape(&[b, t, nkv, hd])?;
        let v_bthd = x_btd
            .linear(&l.w("attention.wv.weight")?)?
            .reshape(&[b, t, nkv, hd])?;
        if a.qk_norm {
            q_bthd = q_bthd.rms_norm(&l.w("attention.q_norm.weight")?, a.norm_eps)?;
            k_bthd = k_bthd.rms_norm(&l.w("attention.k_norm.weight")?, a.norm_eps)?;
        }
        let rope = self.rope();
        let q_bhtd = q_bthd.transpose(1, 2)?.rope(&ctx.positions, &rope)?;
        let k_bhtd = k_bthd.transpose(1, 2)?.rope(&ctx.positions, &rope)?;
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
            .reshape(&[b, t, nh * hd])?
            .linear(&l.w("attention.wo.weight")?)
    }

    fn feed_forward<'h>(&self, l: &Block<'h>, x: &Tensor<'h>) -> Result<Tensor<'h>> {
        let gate = x.linear(&l.w("feed_forward.w1.weight")?)?;
        let up = x.linear(&l.w("feed_forward.w3.weight")?)?;
        gate.swiglu(&up)?.linear(&l.w("feed_forward.w2.weight")?)
    }
}

impl Model for Llama {
    fn spec(&self) -> ModelSpec {
        crate::spec::model_spec(&self.args)
    }

    fn embed<'h>(&self, _ctx: &Ctx<'h>, tokens: Tensor<'h>) -> Result<Vec<Tensor<'h>>> {
        let table = tokens.host().param("tok_embeddings.weight")?;
        Ok(vec![table.embedding(&tokens)?])
    }

    fn layer<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        hidden: Vec<Tensor<'h>>,
    ) -> Result<Vec<Tensor<'h>>> {
        let x_btd = hidden
            .into_iter()
            .next()
            .ok_or("layer: missing hidden state")?;
        let l = Block {
            host: x_btd.host(),
            prefix: format!("layers.{index}"),
        };
        let eps = self.args.norm_eps;
        let h = x_btd.add(&self.attention(
            ctx,
            &l,
            index,
            &x_btd.rms_norm(&l.w("attention_norm.weight")?, eps)?,
        )?)?;
        let out = h.add(&self.feed_forward(&l, &h.rms_norm(&l.w("ffn_norm.weight")?, eps)?)?)?;
        Ok(vec![out])
    }

    fn head<'h>(&self, _ctx: &Ctx<'h>, hidden: Vec<Tensor<'h>>) -> Result<Tensor<'h>> {
        let h = hidden
            .into_iter()
            .next()
            .ok_or("head: missing hidden state")?;
        let host = h.host();
        let out = if self.args.tie_embeddings {
            "tok_embeddings.weight"
        } else {
            "output.weight"
        };
        h.rms_norm(&host.param("norm.weight")?, self.args.norm_eps)?
            .linear(&host.param(out)?)
    }
}
