//! Compressed sparse attention's mask (DeepSeek-V4) as one host op: which window keys and which
//! compressed blocks each query sees, built by the host from positions and the indexer's choice
//! rather than composed from comparisons the op set does not have.

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
            return Err(Error(
                "compressed_mask: window keys' positions go with a window".into(),
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
            _ => Err(Error(
                "host op compressed_mask returned the wrong number of outputs".into(),
            )),
        }
    }
}
