//! The Hugging Face `config.json` of a model (each parameter declares its own Hugging Face name
//! in `spec.rs`). HF's `rotate_half` RoPE is the half-split layout the model uses, so tensors
//! map one to one, unpermuted.

use crate::config::LlamaArgs;
use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::HfAdapter;
use serde_json::json;

/// The config for export: the declared keys, then what depends on the model type.
pub fn adapter(a: &LlamaArgs) -> HfAdapter {
    let architecture = match a.hf_model_type.as_str() {
        "qwen3" => "Qwen3ForCausalLM",
        "qwen3_moe" => "Qwen3MoeForCausalLM",
        "mixtral" => "MixtralForCausalLM",
        _ => "LlamaForCausalLM",
    };
    let mut config = serde_json::Value::Object(a.to_hf());
    config["model_type"] = json!(a.hf_model_type);
    config["architectures"] = json!([architecture]);
    config["head_dim"] = json!(a.head_dim());
    config["hidden_act"] = json!("silu");
    config["attention_bias"] = json!(false);
    config["mlp_bias"] = json!(false);
    config["torch_dtype"] = json!(if a.dtype == "bf16" {
        "bfloat16"
    } else {
        "float32"
    });
    if let Some(m) = &a.moe {
        config["num_local_experts"] = json!(m.n_experts);
        config["output_router_logits"] = json!(m.aux_loss_coef > 0.0);
        if let ("mixtral", Some(o)) = (a.hf_model_type.as_str(), config.as_object_mut()) {
            // Mixtral's experts are its feed-forward; the Qwen3-MoE keys are not its own.
            o.insert("intermediate_size".into(), json!(m.expert_ffn_dim));
            for k in [
                "num_experts",
                "moe_intermediate_size",
                "norm_topk_prob",
                "decoder_sparse_step",
                "mlp_only_layers",
            ] {
                o.remove(k);
            }
        }
    }
    if a.hf_model_type != "mixtral" && a.sliding_window.is_some() {
        config["use_sliding_window"] = json!(true);
    }
    if let Some(vl) = &a.vision {
        config = crate::vl::hf_config(config, a, vl);
    }
    HfAdapter { config }
}

#[cfg(test)]
mod tests {
    use crate::config::flavor;
    use crate::spec::params;

    fn hf_of(name: &str) -> String {
        let a = flavor("debugmodel_qwen3").unwrap();
        let p = params(&a).into_iter().find(|p| p.name == name).unwrap();
        let m = p.hf.unwrap();
        assert!(m.steps.is_empty());
        m.sources.concat()
    }

    #[test]
    fn names_map_to_transformers_layout() {
        assert_eq!(
            hf_of("layers.3.feed_forward.w1.weight"),
            "model.layers.3.mlp.gate_proj.weight"
        );
        assert_eq!(
            hf_of("layers.0.attention.k_norm.weight"),
            "model.layers.0.self_attn.k_norm.weight"
        );
        assert_eq!(hf_of("tok_embeddings.weight"), "model.embed_tokens.weight");
        assert_eq!(hf_of("output.weight"), "lm_head.weight");
    }
}
