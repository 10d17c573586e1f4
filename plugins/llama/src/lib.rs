//! The Llama plugin: Llama 3, Qwen3 and Qwen3-MoE in one model file, with named flavors from the debug
//! model to the released sizes.

pub mod config;
pub mod hf;
pub mod model;
pub mod spec;
pub mod vl;

pub use config::LlamaArgs;
pub use model::Llama;

anneal_plugin_api::model_factory!(Llama, crate::config);

anneal_plugin_api::export_plugin!(model Llama, name = "llama", model_types = ["llama", "qwen3", "qwen3_moe", "mixtral", "qwen3_vl", "qwen3_vl_moe"], description = "Llama 3 / Qwen3 / Qwen3-MoE / Mixtral / Qwen3-VL (dense and MoE) decoder (GQA, RoPE, SwiGLU or routed SwiGLU experts, RMSNorm; Qwen3-VL's vision tower)");

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_plugin_api::sdk::Factory;

    #[test]
    fn debugmodel_has_the_benchmark_shape() {
        let m = Llama::create(Some("debugmodel"), serde_json::json!({})).unwrap();
        let n: usize = spec::params(&m.args)
            .iter()
            .map(|p| p.shape.iter().product::<usize>())
            .sum();
        assert_eq!(n, 8_390_912); // 8.39M
        let s = &m.spec;
        assert_eq!(s.n_layers, 4);
        assert!(s.params.iter().all(|p| p.hf.is_some()));
    }

    #[test]
    fn debugmodel_vl_has_a_tiny_tower_and_the_chat_tokenizers_vision_tokens() {
        let m = Llama::create(Some("debugmodel_vl"), serde_json::json!({})).unwrap();
        let visual = spec::params(&m.args)
            .iter()
            .filter(|p| p.name.starts_with("visual."))
            .count();
        assert!(visual > 0);
        let vl = m.args.vision.as_ref().unwrap();
        assert_eq!(vl.image_token_id, 5);
        assert_eq!(vl.vision_start_token_id, Some(3));
        assert_eq!(m.args.hf_model_type, "qwen3_vl");
    }

    #[test]
    fn released_sizes_count_right() {
        let count = |f| {
            let m = Llama::create(Some(f), serde_json::json!({})).unwrap();
            spec::params(&m.args)
                .iter()
                .map(|p| p.shape.iter().product::<usize>())
                .sum::<usize>()
        };
        assert_eq!(count("llama3_8b"), 8_030_261_248);
        assert_eq!(count("llama3_1b"), 1_235_814_400);
        assert_eq!(count("qwen3_0.6b"), 596_049_920);
        // Qwen3-30B-A3B: 128 experts of 768 in each of 48 layers.
        assert_eq!(count("qwen3_30b_a3b"), 30_532_122_624);
        assert_eq!(count("mixtral_8x7b"), 46_702_792_704);
        // Qwen3-VL as transformers counts it (vision tower included; the 2B ties its
        // embedding): 2B 2,127,532,032 (tower 406,957,056), 8B 8,767,123,696, 30B-A3B
        // 31,070,754,032.
        assert_eq!(count("qwen3_vl_2b"), 2_127_532_032);
        assert_eq!(count("qwen3_vl_8b"), 8_767_123_696);
        assert_eq!(count("qwen3_vl_30b_a3b"), 31_070_754_032);
    }

    #[test]
    fn moe_flavors_route_and_cost_only_the_active_experts() {
        let m = Llama::create(Some("debugmodel_qwen3_moe"), serde_json::json!({})).unwrap();
        let moe = m.args.moe.as_ref().unwrap();
        assert!((0..m.args.n_layers).all(|i| m.args.moe_of(i).is_some()));
        let w1 = m
            .spec
            .params
            .iter()
            .find(|p| p.name == "layers.0.feed_forward.experts.w1")
            .unwrap();
        assert_eq!(w1.shape, [moe.n_experts, moe.expert_ffn_dim, m.args.dim]);
        assert_eq!(w1.placement.expert_dim, Some(0));
        let hf = w1.hf.as_ref().unwrap();
        assert_eq!(hf.sources.len(), moe.n_experts);
        assert_eq!(
            hf.sources[7],
            "model.layers.0.mlp.experts.7.gate_proj.weight"
        );
        // Dense layers keep the plain MLP; FLOPs count top-k of the experts.
        let mixed = Llama::create(
            Some("debugmodel_qwen3_moe"),
            serde_json::json!({"moe": {"dense_layers": [1]}}),
        )
        .unwrap();
        assert!(mixed.args.moe_of(1).is_none());
        assert!(mixed
            .spec
            .params
            .iter()
            .any(|p| p.name == "layers.1.feed_forward.w1.weight"));
        let all_active = Llama::create(
            Some("debugmodel_qwen3_moe"),
            serde_json::json!({"moe": {"top_k": 8}}),
        )
        .unwrap();
        assert!(all_active.spec.flops_per_token > m.spec.flops_per_token);
    }

    #[test]
    fn flops_count_attention_at_the_run_s_sequence_length() {
        // Llama 3.2 1B: 6 per trained parameter a token goes through (the untied input
        // embedding's lookup excluded) and 12 · layers · heads · head_dim per key position.
        let m = Llama::create(Some("llama3_1b"), serde_json::json!({})).unwrap();
        let s = &m.spec;
        assert_eq!(s.max_seq_len, 131072);
        let per_key = (12 * 16 * 32 * 64) as f64;
        assert_eq!(s.context_flops_per_token, per_key);
        let at_2048 = s.flops_per_token_at(2048);
        assert_eq!(
            s.flops_per_token - at_2048,
            per_key * (131072 - 2048) as f64
        );
        assert_eq!(s.flops_per_token_at(131072), s.flops_per_token);
        assert_eq!(s.flops_per_token_at(1 << 20), s.flops_per_token);
        // Attention at 2048 keys adds about 14% to the products, not 7 times them.
        assert!(at_2048 < 1.2 * (s.flops_per_token - per_key * 131072.0));
    }

    #[test]
    fn bad_args_are_refused() {
        assert!(Llama::create(Some("nope"), serde_json::json!({})).is_err());
        let e = Llama::create(None, serde_json::json!({"n_kv_heads": 3}))
            .err()
            .unwrap();
        assert!(e.msg.contains("n_kv_heads"), "{e}");
        let e = Llama::create(None, serde_json::json!({"dimm": 3}))
            .err()
            .unwrap();
        assert!(e.msg.contains("dimm"), "{e}");
    }

    #[test]
    fn bad_values_are_refused_by_name() {
        for (args, key) in [
            (serde_json::json!({"dim": "x"}), "dim: invalid type"),
            (serde_json::json!({"norm_eps": -1e-5}), "norm_eps"),
            (serde_json::json!({"rope_theta": 0.0}), "rope_theta"),
            (serde_json::json!({"dim": 0}), "dim must be at least 1"),
            (serde_json::json!({"max_seq_len": 0}), "max_seq_len"),
            (serde_json::json!({"sliding_layers": [7]}), "sliding_layers"),
        ] {
            let e = Llama::create(None, args.clone()).err().expect("refused");
            assert!(e.msg.contains(key), "{args}: {e}");
        }
        let hf = serde_json::json!({"hf_config": {
            "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100, "rms_norm_eps": -1e-6
        }});
        let e = Llama::create(None, hf).err().expect("refused");
        assert!(e.msg.contains("rms_norm_eps"), "{e}");
    }
}
