//! The Kimi K3 plugin: Kimi Delta Attention and gated multi-head latent attention without RoPE
//! in one layer pattern, latent mixtures of experts with SiTU-GLU, and attention over block
//! residuals in place of plain skip connections (`config.rs` declares the arguments with their
//! `config.json` keys, `spec.rs` the parameters, `model.rs` the forward).

pub mod config;
pub mod hf;
pub mod model;
pub mod spec;

pub use config::KimiK3Args;
pub use model::KimiK3;

anneal_plugin_api::model_factory!(KimiK3, crate::config);

anneal_plugin_api::export_plugin!(model KimiK3, name = "kimi_k3", model_types = ["kimi_k3"], description = "Kimi K3 decoder (Kimi Delta Attention with a bounded forget gate and gated MLA without RoPE, latent mixtures of SiTU-GLU experts with shared experts, attention over block residuals)");

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_plugin_api::sdk::Factory;
    use serde_json::json;

    fn model(flavor: &str, args: serde_json::Value) -> Result<KimiK3, String> {
        KimiK3::create(Some(flavor), args).map_err(|e| e.to_string())
    }

    fn refused(flavor: &str, args: serde_json::Value) -> String {
        model(flavor, args).err().expect("refused")
    }

    /// Trained parameters (transformers counts no buffers: the routing biases).
    fn count(flavor: &str) -> usize {
        model(flavor, json!({}))
            .unwrap()
            .spec
            .params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.shape.iter().product::<usize>())
            .sum()
    }

    #[test]
    fn the_released_layer_pattern_has_24_mla_blocks_and_one_dense() {
        let a = config::kimi_k3();
        let mla: Vec<usize> = (0..93).filter(|&i| !a.is_kda(i)).collect();
        assert_eq!(mla.len(), 24);
        assert_eq!(&mla[..3], [3, 7, 11]);
        assert_eq!(&mla[22..], [91, 92]);
        assert_eq!(
            (0..93).filter(|&i| !a.is_sparse(i)).collect::<Vec<_>>(),
            [0]
        );
        // Residual blocks of 12 open at 0, 12, .., 84.
        assert_eq!((0..93).filter(|&i| a.opens_block(i)).count(), 8);
        // KDA blocks keep no KV cache.
        let m = model("debugmodel", json!({})).unwrap();
        let cached: Vec<usize> = (0..6).filter(|&i| m.spec.kv_cache[i].is_some()).collect();
        assert_eq!(cached, [3, 5]);
    }

    #[test]
    fn blocks_declare_transformers_names() {
        let m = model("debugmodel", json!({})).unwrap();
        let hf = |n: &str| {
            let p = m.spec.params.iter().find(|p| p.name == n).unwrap();
            (p.shape.clone(), p.hf.as_ref().unwrap().sources.clone())
        };
        let (shape, src) = hf("layers.0.attention.conv1d.weight");
        assert_eq!(shape, [768, 1, 4]);
        assert_eq!(src[2], "model.layers.0.self_attn.v_conv.conv1d.weight");
        assert_eq!(hf("layers.0.attention.A_log").0, [4, 1]);
        assert_eq!(hf("layers.0.attention.dt_bias").0, [4, 64]);
        assert_eq!(
            hf("layers.0.attention.g_proj.weight").1,
            ["model.layers.0.self_attn.output_gate.weight"]
        );
        assert_eq!(
            hf("layers.3.attention.gate.weight").1,
            ["model.layers.3.self_attn.output_gate_proj.weight"]
        );
        assert_eq!(
            hf("layers.1.pre_mix.query.weight").1,
            ["model.layers.1.pre_attn_residual.pseudo_queries.weight"]
        );
        assert_eq!(
            hf("final_mix.norm.weight").1,
            ["model.final_attn_residual.attn_residual_norm.weight"]
        );
        assert_eq!(hf("layers.1.moe.gate").0, [8, 128, 128]);
        assert_eq!(
            hf("layers.1.moe.gate").1,
            ["model.layers.1.mlp.experts.gate_up_proj"]
        );
        assert_eq!(
            hf("layers.1.moe.shared.w2.weight").1,
            ["model.layers.1.mlp.shared_experts.down_proj.weight"]
        );
        assert_eq!(
            hf("layers.0.feed_forward.w1.weight").1,
            ["model.layers.0.mlp.gate_proj.weight"]
        );
    }

    #[test]
    fn bad_arguments_are_named() {
        let err = refused("debugmodel", json!({"layer_types": ["full_attention"]}));
        assert!(err.contains("layer_types lists 1 blocks"), "{err}");
        let err = refused("debugmodel", json!({"forget_gate_lower_bound": 0.5}));
        assert!(err.contains("forget_gate_lower_bound"), "{err}");
        let err = refused("debugmodel", json!({"n_group": 3}));
        assert!(err.contains("n_group (3)"), "{err}");
        let mut types = config::debugmodel().mlp_layer_types;
        types[2] = "moe".into();
        let err = refused("debugmodel", json!({ "mlp_layer_types": types }));
        assert!(err.contains("mlp_layer_types"), "{err}");
    }

    #[test]
    fn config_json_round_trips_and_refuses_what_does_not_run() {
        let a = config::debugmodel();
        let cfg = hf::adapter(&a).config;
        assert_eq!(cfg["model_type"], "kimi_k3");
        assert_eq!(cfg["forget_gate_lower_bound"], -5.0);
        assert_eq!(config::from_hf_config(&cfg).unwrap(), a);
        let with = |k: &str, v: serde_json::Value| {
            let mut c = cfg.clone();
            c[k] = v;
            config::from_hf_config(&c).unwrap_err()
        };
        assert!(
            with("use_full_rank_output_gate", json!(false)).contains("use_full_rank_output_gate")
        );
        assert!(with("num_key_value_heads", json!(2)).contains("num_key_value_heads = 2"));
        assert!(
            with("linear_attn_value_head_dim", json!(32)).contains("linear_attn_value_head_dim")
        );
        assert!(with("model_type", json!("kimi_k25")).contains("kimi_k25"));
        assert!(with("hidden_act", json!("silu")).contains("hidden_act"));
        let mut c = cfg.clone();
        c.as_object_mut()
            .unwrap()
            .remove("routed_expert_hidden_size");
        let err = config::from_hf_config(&c).unwrap_err();
        assert!(err.contains("routed_expert_hidden_size"), "{err}");
        // The softplus gate of Kimi Linear when the bound is null.
        let mut c = cfg.clone();
        c["forget_gate_lower_bound"] = serde_json::Value::Null;
        assert_eq!(
            config::from_hf_config(&c).unwrap().forget_gate_lower_bound,
            None
        );
    }

    #[test]
    fn parameter_counts() {
        // Printed for the record; compared with transformers' in the parity fixtures' script.
        println!(
            "debugmodel {} kimi_k3 {}",
            count("debugmodel"),
            count("kimi_k3")
        );
        assert_eq!(count("debugmodel"), 9_082_704);
    }
}
