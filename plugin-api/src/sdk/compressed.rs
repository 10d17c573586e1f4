//! Compressed sparse attention's mask (DeepSeek-V4) as one host op: which window keys and which
//! compressed blocks each query sees, built by the host from positions and the indexer's choice
//! rather than composed from comparisons the op set does not have; and the gathered attention
//! that attends over only those keys.

use super::{Error, Host, Result, Tensor};
use crate::ops;

/// What a [`Host::compressed_mask`] covers besides the compressed blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CompressedMaskOpts {
    /// The sliding window over the uncompressed keys (including the query's own position);
    /// `None` for a mask over the blocks alone.
    pub window: Option<usize>,
    /// Tokens per compressed block.
    pub compress_rate: usize,
    /// Compressed blocks after the window keys.
    pub n_blocks: usize,
    /// Each block's column right after its last key's (see [`crate::ops::CompressedMask`]).
    pub interleaved: bool,
}

impl<'h> Host<'h> {
    /// The additive mask (f32 `[B, T, S + n_blocks]`, 0 visible, -inf not) of queries at
    /// `q_pos` over window keys at `k_pos` (with `opts.window`) then the compressed blocks;
    /// `selected` (i64 `[B, T, k]`) restricts each query to the blocks it names.
    pub fn compressed_mask(
        &self,
        q_pos: &Tensor<'h>,
        k_pos: Option<&Tensor<'h>>,
        selected: Option<&Tensor<'h>>,
        opts: &CompressedMaskOpts,
    ) -> Result<Tensor<'h>> {
        if opts.window.is_some() != k_pos.is_some() {
            return Err(Error::input(
                "compressed_mask: window keys' positions go with a window",
            ));
        }
        let attrs = ops::CompressedMask {
            window: opts.window.map(|w| w as i64),
            compress_rate: opts.compress_rate as i64,
            n_blocks: opts.n_blocks as i64,
            selected: selected.is_some(),
            interleaved: opts.interleaved,
        };
        let mut inputs = vec![q_pos];
        inputs.extend(k_pos);
        inputs.extend(selected);
        let mut out = self.call_op(&attrs, &inputs)?;
        match (out.pop(), out.is_empty()) {
            (Some(t), true) => Ok(t),
            _ => Err(Error::internal(
                "host op compressed_mask returned the wrong number of outputs",
            )),
        }
    }
}

/// What a [`Host::gathered_attention`] attends over besides the window keys.
#[derive(Clone, Copy)]
pub struct GatheredAttentionOpts<'a, 'h> {
    /// Window keys visible to a query at `p`: those at positions `(p - window, p]`.
    pub window: usize,
    /// Tokens per compressed block.
    pub compress_rate: usize,
    /// Multiplies `q·k`; `None` is `1/sqrt(D)`.
    pub scale: Option<f64>,
    /// Per-head sink logits `[H]`.
    pub sinks: Option<&'a Tensor<'h>>,
    /// Compressed blocks `[B, N, D]` (keys and values).
    pub blocks: Option<&'a Tensor<'h>>,
    /// The blocks each query may see (i64 `[B, T, k]`); `None`: every complete block.
    pub selected: Option<&'a Tensor<'h>>,
}

impl<'h> Host<'h> {
    /// Attention of `q [B, H, T, D]` at positions `q_pos` over one shared key/value head: the
    /// window keys `keys [B, S, D]` at `k_pos` and the compressed blocks of `opts`, each query
    /// scoring only what it may see (see [`crate::ops::GatheredAttention`]): the values of
    /// [`Host::compressed_mask`] over full score rows at the cost of the visible keys alone.
    pub fn gathered_attention(
        &self,
        q: &Tensor<'h>,
        keys: &Tensor<'h>,
        q_pos: &Tensor<'h>,
        k_pos: &Tensor<'h>,
        opts: &GatheredAttentionOpts<'_, 'h>,
    ) -> Result<Tensor<'h>> {
        let attrs = ops::GatheredAttention {
            window: opts.window as i64,
            compress_rate: opts.compress_rate as i64,
            scale: opts.scale,
            sinks: opts.sinks.is_some(),
            blocks: opts.blocks.is_some(),
            selected: opts.selected.is_some(),
        };
        let mut inputs = vec![q, keys, q_pos, k_pos];
        inputs.extend(opts.sinks);
        inputs.extend(opts.blocks);
        inputs.extend(opts.selected);
        let mut out = self.call_op(&attrs, &inputs)?;
        match (out.pop(), out.is_empty()) {
            (Some(t), true) => Ok(t),
            _ => Err(Error::internal(
                "host op gathered_attention returned the wrong number of outputs",
            )),
        }
    }
}
