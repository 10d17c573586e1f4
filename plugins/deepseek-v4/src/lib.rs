//! The DeepSeek-V4 plugin: compressed sparse attention (CSA) and heavily compressed attention
//! (HCA) blocks over a sliding window with sinks (`attention.rs`), manifold-constrained
//! hyper-connections and hash- or learned-routed experts (`model.rs`), with a debug flavor that
//! trains on the built-in corpus in minutes and the released shapes for FLOP and memory
//! accounting. A plugin of its own rather than part of deepseek-v3: V4 keeps no MLA latent,
//! carries several residual streams and lays its checkpoint out differently; what it shares
//! with V3 (the expert ops) lives in the SDK.

pub mod attention;
pub mod config;
pub mod decode;
pub mod hf;
pub mod model;
pub mod spec;

use anneal_plugin_api::sdk::{model_args, Factory, Result};
pub use config::DeepseekV4Args;
pub use model::DeepseekV4;

impl Factory for DeepseekV4 {
    fn flavors() -> Vec<String> {
        config::FLAVORS.iter().map(|s| s.to_string()).collect()
    }

    /// `args` may hold `"hf_config": {..config.json..}` to build the model a Hugging Face
    /// directory describes; its other keys override single fields.
    fn create(flavor: Option<&str>, args: serde_json::Value) -> Result<Self> {
        DeepseekV4::new(model_args(
            flavor,
            args,
            config::FLAVORS,
            config::flavor,
            config::from_hf_config,
        )?)
    }
}

anneal_plugin_api::export_plugin!(model DeepseekV4, name = "deepseek_v4", model_types = ["deepseek_v4"], description = "DeepSeek-V4 decoder (compressed sparse / heavily compressed attention with a lightning indexer, sliding window and sinks, grouped low-rank output, manifold-constrained hyper-connections, hash- and learned-routed experts)");

#[cfg(test)]
mod tests {
    use super::*;

    fn trained(m: &DeepseekV4) -> usize {
        m.spec
            .params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.shape.iter().product::<usize>())
            .sum()
    }

    #[test]
    fn the_released_flash_shape_counts_like_transformers() {
        // transformers 5.24 `DeepseekV4ForCausalLM(DeepseekV4Config())` on the meta device
        // (the routing tables and biases are buffers there too; no MTP module).
        let m = DeepseekV4::create(Some("deepseek_v4_flash"), serde_json::json!({})).unwrap();
        assert_eq!(trained(&m), 284_325_869_015);
        // 6 of 256 experts per token: about 13B active parameters.
        let active = m.spec.active_params.unwrap() as f64 / 1e9;
        assert!((12.0..14.5).contains(&active), "{active}");
        // Compressed attention at 1M tokens costs a fraction of dense attention: per token,
        // CSA attends 128 + 512 keys and HCA 128 + 4096, not 524288.
        let dense = 12.0 * 64.0 * 512.0 * 524_288.0 * 43.0;
        let attn: f64 = (0..43)
            .map(|i| spec::attention_flops(&m.args, i, m.args.max_seq_len))
            .sum();
        assert!(attn < dense / 50.0, "{attn} vs {dense}");
    }

    #[test]
    fn bad_args_are_refused_by_name() {
        for (args, key) in [
            (serde_json::json!({"top_k": 9}), "more experts per token"),
            (serde_json::json!({"o_groups": 3}), "o_groups"),
            (serde_json::json!({"rope_head_dim": 15}), "rope_head_dim"),
            (serde_json::json!({"scoring": "relu"}), "scoring"),
            (
                serde_json::json!({"n_layers": 5}),
                "layer_types has 4 entries",
            ),
        ] {
            let e = DeepseekV4::create(None, args.clone())
                .err()
                .expect("refused");
            assert!(e.0.contains(key), "{args}: {e}");
        }
    }
}
