//! The gpt-oss plugin: OpenAI's open-weight mixture-of-experts models (gpt-oss-20b, -120b)
//! in one model file, with a debug flavor that trains on the built-in corpus in minutes.

pub mod config;
pub mod hf;
pub mod model;
pub mod spec;

pub use config::GptOssArgs;
pub use model::GptOss;

anneal_plugin_api::model_factory!(GptOss, crate::config);

anneal_plugin_api::export_plugin!(model GptOss, name = "gpt_oss", model_types = ["gpt_oss"], description = "gpt-oss decoder (GQA with attention sinks, alternating sliding/full attention, YaRN RoPE, clamped-SwiGLU experts with biases)");

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_plugin_api::sdk::Factory;

    fn count(flavor: &str) -> usize {
        let m = GptOss::create(Some(flavor), serde_json::json!({})).unwrap();
        m.spec
            .params
            .iter()
            .map(|p| p.shape.iter().product::<usize>())
            .sum()
    }

    #[test]
    fn released_sizes_count_like_transformers() {
        // transformers 5.24 `GptOssForCausalLM` on the meta device.
        assert_eq!(count("gpt_oss_20b"), 20_914_757_184);
        assert_eq!(count("gpt_oss_120b"), 116_829_156_672);
    }

    #[test]
    fn experts_map_onto_the_fused_interleaved_tensors() {
        let m = GptOss::create(None, serde_json::json!({})).unwrap();
        let find = |n: &str| m.spec.params.iter().find(|p| p.name == n).unwrap();
        let up = find("layers.1.feed_forward.experts.w3");
        assert_eq!(up.shape, [8, 256, 256]);
        let hf = up.hf.as_ref().unwrap();
        assert_eq!(hf.sources, ["model.layers.1.mlp.experts.gate_up_proj"]);
        assert_eq!(hf.part_of(), Some((1, 2)));
        let router = find("layers.0.feed_forward.router.weight");
        assert_eq!(router.shape, [256, 8]);
        assert!(m.spec.params.iter().all(|p| p.hf.is_some()));
        // Sliding layers cost fewer attention FLOPs than full ones.
        let all_full = GptOss::create(
            None,
            serde_json::json!({"layer_types": vec!["full_attention"; 4]}),
        )
        .unwrap();
        assert!(all_full.spec.flops_per_token > m.spec.flops_per_token);
    }

    #[test]
    fn bad_args_are_refused_by_name() {
        for (args, key) in [
            (serde_json::json!({"top_k": 9}), "more experts per token"),
            (serde_json::json!({"dimm": 3}), "dimm"),
            (serde_json::json!({"sliding_window": 0}), "sliding_window"),
        ] {
            let e = GptOss::create(None, args.clone()).err().expect("refused");
            assert!(e.msg.contains(key), "{args}: {e}");
        }
        assert!(GptOss::create(Some("nope"), serde_json::json!({})).is_err());
    }
}
