//! The DeepSeek-V3 plugin: DeepSeek-V3 and Kimi K2 (multi-head latent attention, sigmoid
//! group-limited routing with shared experts and an aux-loss-free bias) in one model file, with
//! a debug flavor that trains on the built-in corpus in minutes.

pub mod config;
pub mod hf;
pub mod model;
pub mod spec;

use anneal_plugin_api::sdk::{model_args, Factory, Result};
pub use config::DeepseekArgs;
pub use model::DeepseekV3;

impl Factory for DeepseekV3 {
    fn flavors() -> Vec<String> {
        config::FLAVORS.iter().map(|s| s.to_string()).collect()
    }

    /// `args` may hold `"hf_config": {..config.json..}` to build the model a Hugging Face
    /// directory describes; its other keys override single fields.
    fn create(flavor: Option<&str>, args: serde_json::Value) -> Result<Self> {
        DeepseekV3::new(model_args(
            flavor,
            args,
            config::FLAVORS,
            config::flavor,
            config::from_hf_config,
        )?)
    }
}

anneal_plugin_api::export_plugin!(model DeepseekV3, name = "deepseek_v3", model_types = ["deepseek_v3", "kimi_k2"], description = "DeepSeek-V3 / Kimi K2 decoder (multi-head latent attention, YaRN RoPE, sigmoid group-limited routing with shared experts and an aux-loss-free bias)");

#[cfg(test)]
mod tests {
    use super::*;

    /// Trained parameters (the routing biases are buffers, as in transformers, which has no
    /// MTP module) and those a token goes through.
    fn count(flavor: &str) -> (usize, usize) {
        let m = DeepseekV3::create(Some(flavor), serde_json::json!({})).unwrap();
        let total: usize = m
            .spec
            .params
            .iter()
            .filter(|p| p.trainable && !p.name.starts_with("mtp."))
            .map(|p| p.shape.iter().product::<usize>())
            .sum();
        (total, total - spec::idle_params(&m.args))
    }

    #[test]
    fn released_sizes_count_like_transformers() {
        // transformers 5.24 `DeepseekV3ForCausalLM` on the meta device (no MTP module).
        assert_eq!(count("deepseek_v3_671b").0, 671_026_404_352);
        assert_eq!(count("kimi_k2_1t").0, 1_026_408_209_408);
        assert_eq!(count("moonlight_16b_a3b").0, 15_960_108_544);
        // transformers' `DeepseekV2ForCausalLM` for V2-Lite.
        assert_eq!(count("deepseek_v2_lite_16b").0, 15_706_484_224);
        // DeepSeek-V3's 37B active parameters per token.
        let active = count("deepseek_v3_671b").1 as f64 / 1e9;
        assert!((36.5..38.0).contains(&active), "{active}");
    }

    #[test]
    fn the_debug_model_has_a_dense_first_block_and_grouped_experts() {
        let m = DeepseekV3::create(None, serde_json::json!({})).unwrap();
        let find = |n: &str| m.spec.params.iter().find(|p| p.name == n);
        assert!(find("layers.0.feed_forward.w1.weight").is_some());
        let w1 = find("layers.1.feed_forward.experts.w1").unwrap();
        assert_eq!(w1.shape, [8, 128, 256]);
        let bias = find("layers.1.feed_forward.router.balance_bias").unwrap();
        assert!(!bias.trainable);
        assert_eq!(
            bias.hf.as_ref().unwrap().sources,
            ["model.layers.1.mlp.gate.e_score_correction_bias"]
        );
        assert!(m.spec.params.iter().all(|p| p.hf.is_some()));
        // The MTP module: one more (sparse) block where DeepSeek's checkpoints keep it.
        let eh = find("mtp.eh_proj.weight").unwrap();
        assert_eq!(eh.shape, [256, 512]);
        assert_eq!(
            eh.hf.as_ref().unwrap().sources,
            ["model.layers.4.eh_proj.weight"]
        );
        assert!(find("mtp.block.feed_forward.experts.w1").is_some());
    }

    #[test]
    fn bad_args_are_refused_by_name() {
        for (args, key) in [
            (
                serde_json::json!({"topk_group": 5}),
                "topk_group (5) must not exceed n_group (4)",
            ),
            (serde_json::json!({"top_k": 9}), "more experts per token"),
            (
                serde_json::json!({"qk_rope_head_dim": 15}),
                "qk_rope_head_dim",
            ),
        ] {
            let e = DeepseekV3::create(None, args.clone())
                .err()
                .expect("refused");
            assert!(e.0.contains(key), "{args}: {e}");
        }
    }
}
