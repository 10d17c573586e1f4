//! The decoder skeleton every family shares: embedding → blocks → norm → head. A plugin
//! implements [`Decoder`] (its attention and feed-forward, and where its parameters are) and
//! gets [`Model`](crate::sdk::Model) for it; `model.rs` then holds only what differs from the
//! baseline.
//!
//! ```text
//! h   = x + post_attn(Attention(pre_attn(x)))
//! out = h + post_ffn(FFN(pre_ffn(h)))
//! ```
//! `post_*` are the sandwich norms some families add (absent: the identity); every norm is
//! RMSNorm with the decoder's [`Norm`]. A family with gated residuals (`α·x + β·y`) overrides
//! [`Decoder::residual`].

use crate::sdk::{Ctx, Host, Model, ModelSpec, Param, Result, Tensor};

/// The RMSNorm every norm of a decoder uses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Norm {
    /// The epsilon inside the root.
    pub eps: f64,
    /// Zero-centred gain: `x̂ · (1 + w)` (Qwen3.5, Gemma-style); `false`: `x̂ · w`.
    pub offset: bool,
}

impl Norm {
    /// `x̂ · w`.
    pub fn plain(eps: f64) -> Self {
        Norm { eps, offset: false }
    }

    /// `x̂ · (1 + w)`.
    pub fn centred(eps: f64) -> Self {
        Norm { eps, offset: true }
    }

    /// `x · w / rms(x)` (or `x · (1 + w) / rms(x)`).
    pub fn apply<'h>(&self, ctx: &Ctx<'h>, x: &Tensor<'h>, w: &Param) -> Result<Tensor<'h>> {
        let w = ctx.w(w)?;
        if self.offset {
            x.rms_norm(&w.affine(1.0, 1.0)?, self.eps)
        } else {
            x.rms_norm(&w, self.eps)
        }
    }
}

/// The parameters around the blocks: the embedding table, the final norm and the output
/// projection, and how the head shapes its logits.
pub struct Frame<'a> {
    /// `[V, D]` token embeddings.
    pub tok_embeddings: &'a Param,
    /// The final norm's gain.
    pub norm: &'a Param,
    /// `[V, D]` output projection (the embedding table itself when tied).
    pub output: &'a Param,
    /// Logits multiplied by this before any soft-cap (`None`: 1).
    pub logit_multiplier: Option<f64>,
    /// Logits soft-capped as `c · tanh(z / c)` (`None`: raw).
    pub logit_softcap: Option<f64>,
}

impl<'a> Frame<'a> {
    /// The frame of these parameters, with raw logits.
    pub fn new(tok_embeddings: &'a Param, norm: &'a Param, output: &'a Param) -> Self {
        Frame {
            tok_embeddings,
            norm,
            output,
            logit_multiplier: None,
            logit_softcap: None,
        }
    }
}

/// A block's norms: before attention and feed-forward, and the optional sandwich norms on
/// their outputs.
pub struct BlockNorms<'a> {
    /// Before the token mixer.
    pub attention: &'a Param,
    /// Before the feed-forward.
    pub ffn: &'a Param,
    /// On the token mixer's output, before the residual add.
    pub post_attention: Option<&'a Param>,
    /// On the feed-forward's output, before the residual add.
    pub post_ffn: Option<&'a Param>,
}

impl<'a> BlockNorms<'a> {
    /// The pre-norms alone (no sandwich norms).
    pub fn pre(attention: &'a Param, ffn: &'a Param) -> Self {
        BlockNorms {
            attention,
            ffn,
            post_attention: None,
            post_ffn: None,
        }
    }
}

/// A block's two sublayers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sublayer {
    /// The token mixer.
    Attention,
    /// The feed-forward.
    FeedForward,
}

/// Which attention a block uses (`layer_types` in `config.json`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Attends to the last `sliding_window` positions.
    SlidingAttention,
    /// Attends to every earlier position.
    FullAttention,
}

/// Block `index` of `layers`, or an error naming how many there are.
pub fn nth_layer<T>(layers: &[T], index: usize) -> Result<&T> {
    layers
        .get(index)
        .ok_or_else(|| format!("layer {index}: the model has {}", layers.len()).into())
}

/// A decoder-only model in the baseline's shape. The hidden state between stages is the
/// residual stream followed by what the plugin carries beside it (`extra`: a vision model's
/// 3-D positions, say), handed to every block unchanged.
pub trait Decoder: Send + Sync + 'static {
    /// Parameters, module tree and costs.
    fn spec(&self) -> ModelSpec;
    /// The norm before each block's attention and feed-forward.
    fn norm(&self) -> Norm;
    /// The sandwich norms' (on the attention's and feed-forward's outputs); the default is
    /// [`Decoder::norm`].
    fn post_norm(&self) -> Norm {
        self.norm()
    }
    /// The final norm's; the default is [`Decoder::norm`].
    fn final_norm(&self) -> Norm {
        self.norm()
    }
    /// The parameters around the blocks.
    fn frame(&self) -> Frame<'_>;
    /// Block `index`'s norms (an error when there is no such block).
    fn block_norms(&self, index: usize) -> Result<BlockNorms<'_>>;
    /// Block `index`'s token mixer on its normed input.
    fn attention<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        x: &Tensor<'h>,
        extra: &[Tensor<'h>],
    ) -> Result<Tensor<'h>>;
    /// Block `index`'s feed-forward on its normed input.
    fn feed_forward<'h>(&self, ctx: &Ctx<'h>, index: usize, x: &Tensor<'h>) -> Result<Tensor<'h>>;

    /// The embedded tokens `h` to the first stage's hidden state (a vision model puts its
    /// images in here); the default is `h` alone.
    fn embed_more<'h>(
        &self,
        ctx: &Ctx<'h>,
        tokens: &Tensor<'h>,
        h: Tensor<'h>,
    ) -> Result<Vec<Tensor<'h>>> {
        let _ = (ctx, tokens);
        Ok(vec![h])
    }

    /// Block `index`'s output with what travels beside it to the next stage; the default
    /// hands `extra` on unchanged.
    fn after_block<'h>(
        &self,
        index: usize,
        out: Tensor<'h>,
        extra: Vec<Tensor<'h>>,
    ) -> Result<Vec<Tensor<'h>>> {
        let _ = index;
        Ok(std::iter::once(out).chain(extra).collect())
    }

    /// Adds sublayer `which`'s output `y` (after its sandwich norm, if any) to the residual
    /// stream `x` of block `index`; the default is `x + y` (a gated residual overrides it).
    fn residual<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        which: Sublayer,
        x: &Tensor<'h>,
        y: Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let _ = (ctx, index, which);
        x.add(&y)
    }

    /// As [`Model::before_optimizer_step`].
    fn before_step(&self, host: Host<'_>, step: u64) -> Result<()> {
        let _ = (host, step);
        Ok(())
    }
}

/// `post(f(pre(x)))`: a sublayer's output before the residual.
fn sublayer<'h>(
    ctx: &Ctx<'h>,
    [pre_norm, post_norm]: [Norm; 2],
    x: &Tensor<'h>,
    pre: &Param,
    post: Option<&Param>,
    f: impl FnOnce(&Tensor<'h>) -> Result<Tensor<'h>>,
) -> Result<Tensor<'h>> {
    let y = f(&pre_norm.apply(ctx, x, pre)?)?;
    match post {
        Some(post) => post_norm.apply(ctx, &y, post),
        None => Ok(y),
    }
}

impl<D: Decoder> Model for D {
    fn spec(&self) -> ModelSpec {
        Decoder::spec(self)
    }

    fn embed<'h>(&self, ctx: &Ctx<'h>, tokens: Tensor<'h>) -> Result<Vec<Tensor<'h>>> {
        let h = ctx.w(self.frame().tok_embeddings)?.embedding(&tokens)?;
        self.embed_more(ctx, &tokens, h)
    }

    fn layer<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        hidden: Vec<Tensor<'h>>,
    ) -> Result<Vec<Tensor<'h>>> {
        let mut hidden = hidden.into_iter();
        let x = hidden.next().ok_or("layer: missing hidden state")?;
        let extra: Vec<Tensor<'h>> = hidden.collect();
        let n = self.block_norms(index)?;
        let norm = [self.norm(), self.post_norm()];
        let y = sublayer(ctx, norm, &x, n.attention, n.post_attention, |x| {
            self.attention(ctx, index, x, &extra)
        })?;
        let h = self.residual(ctx, index, Sublayer::Attention, &x, y)?;
        let y = sublayer(ctx, norm, &h, n.ffn, n.post_ffn, |x| {
            self.feed_forward(ctx, index, x)
        })?;
        let out = self.residual(ctx, index, Sublayer::FeedForward, &h, y)?;
        self.after_block(index, out, extra)
    }

    fn head<'h>(&self, ctx: &Ctx<'h>, hidden: Vec<Tensor<'h>>) -> Result<Tensor<'h>> {
        let h = hidden
            .into_iter()
            .next()
            .ok_or("head: missing hidden state")?;
        let f = self.frame();
        let mut logits = self
            .final_norm()
            .apply(ctx, &h, f.norm)?
            .linear(&ctx.w(f.output)?)?;
        if let Some(m) = f.logit_multiplier {
            logits = logits.scale(m)?;
        }
        match f.logit_softcap {
            Some(c) => crate::sdk::kit::blocks::softcap(&logits, c),
            None => Ok(logits),
        }
    }

    fn before_optimizer_step(&self, host: Host<'_>, step: u64) -> Result<()> {
        self.before_step(host, step)
    }
}
