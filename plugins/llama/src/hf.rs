//! The Hugging Face `config.json` of a model (each parameter declares its own Hugging Face name
//! in `spec.rs`). HF's `rotate_half` RoPE is the half-split layout the model uses, so tensors
//! map one to one, unpermuted.

use crate::config::LlamaArgs;
use anneal_plugin_api::sdk::{HfAdapter, HfRope};
use serde_json::json;

/// The config for export.
pub fn adapter(a: &LlamaArgs) -> HfAdapter {
    let architecture = match a.hf_model_type.as_str() {
        "qwen3" => "Qwen3ForCausalLM",
        "qwen3_moe" => "Qwen3MoeForCausalLM",
        "mixtral" => "MixtralForCausalLM",
        _ => "LlamaForCausalLM",
    };
    let mut config = json!({
        "model_type": a.hf_model_type,
        "architectures": [architecture],
        "hidden_size": a.dim,
        "intermediate_size": a.ffn_dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim(),
        "vocab_size": a.vocab_size,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_seq_len,
        "tie_word_embeddings": a.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": if a.dtype == "bf16" { "bfloat16" } else { "float32" },
    });
    if let Some(s) = &a.rope_scaling {
        config["rope_scaling"] = json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        });
    }
    if a.yarn.is_some() {
        let rope = HfRope {
            theta: a.rope_theta,
            llama3: None,
            yarn: a.yarn.clone(),
        };
        config["rope_scaling"] = rope.to_hf();
    }
    if let Some(m) = &a.moe {
        config["num_local_experts"] = json!(m.n_experts);
        config["num_experts_per_tok"] = json!(m.top_k);
        config["router_aux_loss_coef"] = json!(m.aux_loss_coef);
        config["output_router_logits"] = json!(m.aux_loss_coef > 0.0);
        if matches!(a.hf_model_type.as_str(), "qwen3_moe" | "qwen3_vl_moe") {
            config["num_experts"] = json!(m.n_experts);
            config["moe_intermediate_size"] = json!(m.expert_ffn_dim);
            config["norm_topk_prob"] = json!(m.norm_topk_prob);
            config["decoder_sparse_step"] = json!(m.sparse_step);
            config["mlp_only_layers"] = json!(m.dense_layers);
        }
    }
    if a.hf_model_type == "mixtral" {
        if let Some(m) = &a.moe {
            config["intermediate_size"] = json!(m.expert_ffn_dim);
        }
        config["sliding_window"] = json!(a.sliding_window);
    } else if let Some(w) = a.sliding_window {
        config["sliding_window"] = json!(w);
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
