//! Kimi Linear's Kimi Delta Attention blocks: the SDK's KDA (`kit::kda`) under the names
//! transformers' `kimi_linear` gives it (the decay softplus-gated, the output gate low-rank).

use crate::config::KdaArgs;
use anneal_plugin_api::sdk::kit::kda::{self, KdaHfNames, KdaShape};
use anneal_plugin_api::sdk::LayerScope;

pub use anneal_plugin_api::sdk::kit::kda::KdaParams;

impl KdaArgs {
    /// The shapes the SDK's KDA takes.
    pub fn shape(&self) -> KdaShape {
        KdaShape {
            n_heads: self.n_heads,
            head_dim: self.head_dim,
            conv_kernel: self.conv_kernel,
        }
    }
}

/// Declares block `l`'s KDA parameters as Kimi Linear's checkpoints name them: the three
/// convolutions `q_conv1d`, `k_conv1d`, `v_conv1d`, `A_log [1, 1, H, 1]`, `dt_bias [H·D]`.
pub fn declare(l: &mut LayerScope, dim: usize, k: &KdaArgs, depth_std: f64) -> KdaParams {
    let h = k.n_heads;
    let names = KdaHfNames {
        conv: "{p}_conv1d.weight",
        forget: ["f_a_proj", "f_b_proj"],
        beta: "b_proj",
        out_gate: &["g_a_proj", "g_b_proj"],
        a_log_shape: &[1, 1, h, 1],
        dt_bias_shape: &[h * k.head_dim],
    };
    kda::declare(l, dim, &k.shape(), &names, depth_std)
}
