//! Multi-token prediction (training only), as DeepSeek-V3's with the residual streams kept
//! apart, following DeepSeek's release (`MTPBlock`):
//!
//! ```text
//! X'_i     = W_h · RMSNorm(X_i) + W_e · RMSNorm(Emb(t_{i+1}))   each stream; X_i the main model's
//!                                                                 last streams at i  [B, T-2, N, D]
//! logits_i = W_out · RMSNorm(collapse_mtp(Block(X'_i)))         predicts t_{i+2}
//! ```
//! `Block` is a sliding-window block routed by its learned router (DeepSeek's `compress_ratios`
//! ends with a 0 for it); the embedding and output projection are the main model's. Its
//! cross-entropy is the auxiliary loss `mtp`, also reported as the statistic `mtp_loss`. The
//! next tokens' embeddings travel from `embed` to `head` as an extra hidden tensor, which the
//! blocks pass through.

use crate::spec::MtpParams;
use anneal_plugin_api::sdk::{Ctx, Result, Tensor};

impl crate::model::DeepseekV4 {
    /// The MTP loss from the main model's last streams `x [B, T, N, D]`, the embeddings of
    /// tokens `1..T-1` (`next [B, T-2, D]`), the token ids `[B, T]` and their positions.
    pub(crate) fn mtp_loss<'h>(
        &self,
        ctx: &Ctx<'h>,
        m: &MtpParams,
        x: &Tensor<'h>,
        next: &Tensor<'h>,
        tokens: &Tensor<'h>,
        pos: &Tensor<'h>,
    ) -> Result<()> {
        let a = &self.args;
        let s = x.shape()?;
        let (b, t, n, d) = (s[0] as i64, s[1] - 2, s[2] as i64, s[3] as i64);
        let last = pos.shape()?.len() as i64 - 1;
        let pos = pos.narrow(last, 0, t)?;
        let t = t as i64;
        let e = next
            .rms_norm(&ctx.w(&m.enorm)?, a.norm_eps)?
            .linear(&ctx.w(&m.e_proj)?)?
            .reshape(&[b, t, 1, d])?;
        let h = x
            .narrow(1, 0, t as usize)?
            .reshape(&[b, t * n, d])?
            .rms_norm(&ctx.w(&m.hnorm)?, a.norm_eps)?
            .linear(&ctx.w(&m.h_proj)?)?
            .reshape(&[b, t, n, d])?;
        // The block's hash routing (unused: it routes by its router) would see the tokens it
        // embeds, t_{i+1}.
        let ids = tokens.narrow(1, 1, t as usize)?;
        let y = self.block(ctx, &m.block, a.n_layers, &h.add(&e)?, &ids, &pos)?;
        let logits = self
            .collapse(ctx, &m.hc_head, &y)?
            .rms_norm(&ctx.w(&m.norm)?, a.norm_eps)?
            .linear(&ctx.w(&self.params.output)?)?
            .reshape(&[b * t, a.vocab_size as i64])?;
        let targets = tokens.narrow(1, 2, t as usize)?.reshape(&[b * t])?;
        let loss = logits.cross_entropy(&targets, None)?;
        ctx.aux_loss("mtp", &loss)?;
        ctx.stat("mtp_loss", &loss)
    }
}
