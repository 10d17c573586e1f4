//! The Qwen3.5 plugin: Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet blocks interleaved 3:1 with
//! output-gated full attention) in one model file, with debug flavors that train on the
//! built-in corpus in minutes and the released shapes for FLOP and memory accounting.
//! Checkpoints with vision (`Qwen3_5ForConditionalGeneration`) add the SDK's vision tower.

pub mod config;
pub mod hf;
pub mod model;
pub mod spec;

pub use config::Qwen35Args;
pub use model::Qwen35;

anneal_plugin_api::model_factory!(Qwen35, crate::config);

anneal_plugin_api::export_plugin!(model Qwen35, name = "qwen3_5", model_types = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"], description = "Qwen3.5 / Qwen3.5-MoE decoder (Gated DeltaNet linear attention 3:1 with output-gated full attention, partial RoPE, zero-centred RMSNorm, routed experts with a gated shared expert; the vision tower and interleaved MRoPE of checkpoints with vision)");

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_plugin_api::sdk::Factory;
    use config::LayerType;

    fn create(flavor: &str, args: serde_json::Value) -> Qwen35 {
        Qwen35::create(Some(flavor), args).unwrap()
    }

    fn count(m: &Qwen35) -> usize {
        m.spec
            .params
            .iter()
            .map(|p| p.shape.iter().product::<usize>())
            .sum()
    }

    #[test]
    fn released_sizes_count_like_transformers() {
        // transformers 5.24 on the meta device: `Qwen3_5ForCausalLM(Qwen3_5TextConfig())` and
        // `Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig())`.
        assert_eq!(
            count(&create("qwen3_5_9b", serde_json::json!({}))),
            8_953_803_264
        );
        let moe = create("qwen3_5_35b_a3b", serde_json::json!({}));
        assert_eq!(count(&moe), 34_660_610_688);
        // 8 of 256 experts of 3 · 2048 · 512 in each of 40 layers: about 3B active.
        let active = moe.spec.active_params.unwrap();
        assert_eq!(active, 34_660_610_688 - 40 * 248 * 3 * 2048 * 512);
        // With transformers' default tower (`Qwen3_5VisionConfig(out_hidden_size=dim)`):
        // `Qwen3_5ForConditionalGeneration` and `Qwen3_5MoeForConditionalGeneration`.
        let vl = create("qwen3_5_9b_vl", serde_json::json!({}));
        assert_eq!(count(&vl), 9_409_813_744);
        assert_eq!(vl.args.hf_model_type, "qwen3_5");
        let moe_vl = create("qwen3_5_35b_a3b_vl", serde_json::json!({}));
        assert_eq!(count(&moe_vl), 35_107_181_936);
        assert!((3.0e9..4.0e9).contains(&(active as f64)), "{active}");
    }

    #[test]
    fn flops_count_the_linear_attention_layers() {
        let m = create("qwen3_5_9b", serde_json::json!({}));
        let a = &m.args;
        assert_eq!(
            (
                a.count(LayerType::LinearAttention),
                a.count(LayerType::FullAttention)
            ),
            (24, 8)
        );
        // 6 · (8,953,803,264 − the 248,320 × 4096 embedding) for the products;
        let products = 6.0 * (8_953_803_264.0 - 248_320.0 * 4096.0);
        // 8 full-attention layers: 12 · 16 heads · 256 · 32,768 positions;
        let attention = 12.0 * 8.0 * 16.0 * 256.0 * 32_768.0;
        // 24 Gated DeltaNet layers, 32 value heads of 128 x 128, chunks of 64, 3 x forward:
        // 6·128·128 + 2·64·(3·128 + 2·128) + 2·64²/3 = 98,304 + 81,920 + 2,730.67 per head.
        let delta = 3.0 * 24.0 * 32.0 * (98_304.0 + 81_920.0 + 2.0 * 4096.0 / 3.0);
        let want = products + attention + delta;
        assert!(
            (m.spec.flops_per_token - want).abs() <= 1e-9 * want,
            "{} vs {want}",
            m.spec.flops_per_token
        );
        // Tied, the one table is still the output head's product: the same count.
        let tied = create("qwen3_5_9b", serde_json::json!({"tie_embeddings": true}));
        assert!((tied.spec.flops_per_token - want).abs() <= 1e-9 * want);
    }

    #[test]
    fn layers_follow_the_pattern_and_map_to_transformers_names() {
        let m = create("debugmodel_moe", serde_json::json!({}));
        let hf_of = |name: &str| {
            let p = m.spec.params.iter().find(|p| p.name == name).unwrap();
            p.hf.as_ref().unwrap().sources.clone()
        };
        assert_eq!(
            hf_of("layers.0.linear_attn.conv1d.weight"),
            ["model.layers.0.linear_attn.conv1d.weight"]
        );
        assert_eq!(
            hf_of("layers.3.attention.wq.weight"),
            ["model.layers.3.self_attn.q_proj.weight"]
        );
        assert_eq!(
            hf_of("layers.1.feed_forward.experts.w2")[7],
            "model.layers.1.mlp.experts.7.down_proj.weight"
        );
        assert_eq!(
            hf_of("layers.2.feed_forward.shared_expert_gate.weight"),
            ["model.layers.2.mlp.shared_expert_gate.weight"]
        );
        // Only the full-attention block keeps a KV cache.
        assert_eq!(m.spec.kv_cache, [None, None, None, Some((2, 64))]);
        let other = create(
            "debugmodel",
            serde_json::json!({"layer_types": ["full_attention", "linear_attention"], "n_layers": 2,
                               "tie_embeddings": true, "hf_model_type": "qwen3_5"}),
        );
        assert!(other.spec.params.iter().all(|p| p.name != "output.weight"));
        assert!(other
            .spec
            .params
            .iter()
            .any(|p| p.name == "layers.0.attention.q_norm.weight"));
        let embed = other
            .spec
            .params
            .iter()
            .find(|p| p.name == "tok_embeddings.weight")
            .unwrap();
        assert_eq!(
            embed.hf.as_ref().unwrap().sources,
            ["model.language_model.embed_tokens.weight"]
        );
    }

    #[test]
    fn bad_args_are_refused_by_name() {
        for (args, key) in [
            (serde_json::json!({"dimm": 3}), "dimm"),
            (
                serde_json::json!({"linear_n_key_heads": 3}),
                "linear_n_value_heads",
            ),
            (
                serde_json::json!({"layer_types": ["full_attention"]}),
                "layer_types",
            ),
            (
                serde_json::json!({"partial_rotary_factor": 0.0}),
                "partial_rotary_factor",
            ),
            (
                serde_json::json!({"moe": {"n_experts": 2, "top_k": 3, "expert_ffn_dim": 8, "shared_ffn_dim": 8}}),
                "moe.top_k",
            ),
        ] {
            let e = Qwen35::create(Some("debugmodel"), args.clone())
                .err()
                .expect("refused");
            assert!(e.msg.contains(key), "{args}: {e}");
        }
    }
}
