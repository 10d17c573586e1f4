//! Linear-attention host ops on the plugin [`Tensor`]: the gated delta rule (Gated DeltaNet,
//! Kimi Delta Attention) and the short causal convolution in front of it. Each keeps its decode
//! state in the host when given a cache layer, as attention keeps its KV cache.

use super::{Result, Tensor};
use crate::ops;

/// Options of [`Tensor::gated_delta_rule`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DeltaRuleOpts {
    /// Multiplies `q`; `Dk^-0.5` when `None`.
    pub scale: Option<f64>,
    /// L2-normalize `q` and `k` over their head dim first (transformers'
    /// `use_qk_l2norm_in_kernel`).
    pub qk_l2norm: bool,
    /// The layer whose recurrent state the host keeps (inference with a cache).
    pub cache_layer: Option<usize>,
}

impl<'h> Tensor<'h> {
    /// The gated delta rule with `self` as the queries `q [B, T, Hk, Dk]`: keys `k` like `q`,
    /// values `v [B, T, Hv, Dv]` (value head `h` reads key head `h / (Hv / Hk)`), the log-decay
    /// `g` (≤ 0) `[B, T, Hv]` per head or `[B, T, Hv, Dk]` per key channel, write strengths
    /// `beta [B, T, Hv]`. Returns the outputs `[B, T, Hv, Dv]` in `q`'s dtype.
    pub fn gated_delta_rule(
        &self,
        k: &Tensor<'h>,
        v: &Tensor<'h>,
        g: &Tensor<'h>,
        beta: &Tensor<'h>,
        opts: &DeltaRuleOpts,
    ) -> Result<Tensor<'h>> {
        let attrs = ops::GatedDeltaRule {
            scale: opts.scale,
            qk_l2norm: opts.qk_l2norm,
            cache_layer: opts.cache_layer.map(|l| l as i64),
        };
        self.op_with(attrs, &[k, v, g, beta])
    }

    /// Causal depthwise convolution of `self = x [B, T, C]` along the sequence with the kernel
    /// `w [C, K]` (transformers' `conv1d.weight [C, 1, K]` reshaped), no bias, then SiLU when
    /// `silu`: `y[t, c] = Σ_j w[c, j] · x[t − K + 1 + j, c]`, zeros before the sequence. With
    /// `cache_layer` the host keeps the last `K − 1` inputs for the next call.
    pub fn causal_conv1d(
        &self,
        w: &Tensor<'h>,
        silu: bool,
        cache_layer: Option<usize>,
    ) -> Result<Tensor<'h>> {
        let attrs = ops::CausalConv1d {
            silu,
            cache_layer: cache_layer.map(|l| l as i64),
        };
        self.op_with(attrs, &[w])
    }
}
