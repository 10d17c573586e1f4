//! The Hugging Face layout of the same weights: names and `config.json`. HF's `rotate_half`
//! RoPE is the half-split layout the model uses, so tensors map one to one, unpermuted.

use crate::config::LlamaArgs;
use anneal_plugin_api::sdk::{HfAdapter, ParamSpec};
use serde_json::json;

/// The Hugging Face name of one of our parameters.
pub fn hf_name(ours: &str) -> String {
    if let Some(rest) = ours.strip_prefix("layers.") {
        let (i, rest) = rest.split_once('.').unwrap_or((rest, ""));
        let mapped = match rest {
            "attention.wq.weight" => "self_attn.q_proj.weight",
            "attention.wk.weight" => "self_attn.k_proj.weight",
            "attention.wv.weight" => "self_attn.v_proj.weight",
            "attention.wo.weight" => "self_attn.o_proj.weight",
            "attention.q_norm.weight" => "self_attn.q_norm.weight",
            "attention.k_norm.weight" => "self_attn.k_norm.weight",
            "attention_norm.weight" => "input_layernorm.weight",
            "ffn_norm.weight" => "post_attention_layernorm.weight",
            "feed_forward.w1.weight" => "mlp.gate_proj.weight",
            "feed_forward.w2.weight" => "mlp.down_proj.weight",
            "feed_forward.w3.weight" => "mlp.up_proj.weight",
            other => other,
        };
        return format!("model.layers.{i}.{mapped}");
    }
    match ours {
        "tok_embeddings.weight" => "model.embed_tokens.weight".into(),
        "norm.weight" => "model.norm.weight".into(),
        "output.weight" => "lm_head.weight".into(),
        other => other.into(),
    }
}

/// Names and config for export and import.
pub fn adapter(a: &LlamaArgs, params: &[ParamSpec]) -> HfAdapter {
    let qwen = a.hf_model_type == "qwen3";
    let mut config = json!({
        "model_type": a.hf_model_type,
        "architectures": [if qwen { "Qwen3ForCausalLM" } else { "LlamaForCausalLM" }],
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
    if let Some(w) = a.sliding_window {
        config["sliding_window"] = json!(w);
        config["use_sliding_window"] = json!(true);
    }
    HfAdapter {
        config,
        names: params
            .iter()
            .map(|p| (p.name.clone(), hf_name(&p.name)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_transformers_layout() {
        assert_eq!(
            hf_name("layers.3.feed_forward.w1.weight"),
            "model.layers.3.mlp.gate_proj.weight"
        );
        assert_eq!(
            hf_name("layers.0.attention.k_norm.weight"),
            "model.layers.0.self_attn.k_norm.weight"
        );
        assert_eq!(
            hf_name("tok_embeddings.weight"),
            "model.embed_tokens.weight"
        );
        assert_eq!(hf_name("output.weight"), "lm_head.weight");
    }
}
