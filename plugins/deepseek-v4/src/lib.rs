//! The DeepSeek-V4 plugin: compressed sparse attention (CSA) and heavily compressed attention
//! (HCA) blocks over a sliding window with sinks (`attention.rs`), manifold-constrained
//! hyper-connections and hash- or learned-routed experts (`model.rs`), multi-token prediction in
//! training (`mtp.rs`), with a debug flavor that trains on the built-in corpus in minutes and
//! the released shapes for FLOP and memory accounting. A plugin of its own rather than part of deepseek-v3: V4 keeps no MLA latent,
//! carries several residual streams and lays its checkpoint out differently; what it shares
//! with V3 (the expert ops) lives in the SDK.

pub mod attention;
pub mod config;
pub mod decode;
pub mod hf;
pub mod model;
pub mod mtp;
pub mod spec;

pub use config::DeepseekV4Args;
pub use model::DeepseekV4;

anneal_plugin_api::model_factory!(DeepseekV4, crate::config);

anneal_plugin_api::export_plugin!(model DeepseekV4, name = "deepseek_v4", model_types = ["deepseek_v4"], description = "DeepSeek-V4 decoder (compressed sparse / heavily compressed attention with a lightning indexer, sliding window and sinks, grouped low-rank output, manifold-constrained hyper-connections, hash- and learned-routed experts)");

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_plugin_api::sdk::Factory;
    use anneal_plugin_api::sdk::ParamSpec;

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
    fn the_mtp_module_is_a_sliding_learned_block_named_as_deepseeks_release() {
        let plain = DeepseekV4::create(None, serde_json::json!({})).unwrap();
        let m = DeepseekV4::create(None, serde_json::json!({"mtp_layers": 1})).unwrap();
        let find = |n: &str| m.spec.params.iter().find(|p| p.name == n);
        let hf = |n: &str| find(n).unwrap().hf.as_ref().unwrap().sources.clone();
        assert_eq!(find("mtp.e_proj.weight").unwrap().shape, [256, 256]);
        assert_eq!(hf("mtp.e_proj.weight"), ["mtp.0.e_proj.weight"]);
        assert_eq!(hf("mtp.h_proj.weight"), ["mtp.0.h_proj.weight"]);
        assert_eq!(hf("mtp.norm.weight"), ["mtp.0.norm.weight"]);
        assert_eq!(find("mtp.hc_head.fn").unwrap().shape, [2, 512]);
        assert_eq!(hf("mtp.hc_head.fn"), ["mtp.0.hc_head_fn"]);
        assert_eq!(hf("mtp.block.hc_attn.fn"), ["mtp.0.hc_attn_fn"]);
        assert_eq!(
            hf("mtp.block.attention.wq_a.weight"),
            ["mtp.0.attn.wq_a.weight"]
        );
        assert_eq!(
            hf("mtp.block.ffn.router.balance_bias"),
            ["mtp.0.ffn.gate.bias"]
        );
        assert_eq!(
            hf("mtp.block.ffn.experts.w1")[7],
            "mtp.0.ffn.experts.7.w1.weight"
        );
        // No compressor nor indexer: DeepSeek's release ends `compress_ratios` with a 0 for it.
        let attention = |p: &&ParamSpec| p.name.starts_with("mtp.block.attention.");
        assert!(!m
            .spec
            .params
            .iter()
            .filter(attention)
            .any(|p| { p.name.contains("compressor") || p.name.contains("indexer") }));
        assert!(find("mtp.block.ffn.router.tid2eid").is_none());
        // The main model's parameters are the same; the module trains but never runs at
        // inference, and costs FLOPs in training.
        for p in &plain.spec.params {
            assert_eq!(find(&p.name), Some(p), "{}", p.name);
        }
        assert_eq!(m.spec.active_params, plain.spec.active_params);
        assert!(m.spec.flops_per_token > plain.spec.flops_per_token);
        assert_eq!(m.spec.n_layers, plain.spec.n_layers);
    }

    #[test]
    fn bad_args_are_refused_by_name() {
        for (args, key) in [
            (serde_json::json!({"top_k": 9}), "more experts per token"),
            (serde_json::json!({"o_groups": 3}), "o_groups"),
            (serde_json::json!({"rope_head_dim": 15}), "rope_head_dim"),
            (serde_json::json!({"scoring": "relu"}), "scoring"),
            (serde_json::json!({"mtp_layers": 2}), "mtp_layers = 2"),
            (
                serde_json::json!({"n_layers": 5}),
                "layer_types has 4 entries",
            ),
        ] {
            let e = DeepseekV4::create(None, args.clone())
                .err()
                .expect("refused");
            assert!(e.msg.contains(key), "{args}: {e}");
        }
    }
}
