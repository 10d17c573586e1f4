//! The Hugging Face `config.json` of a DeepSeek-V3 model (each parameter declares its own
//! Hugging Face name in `spec.rs`).

use crate::config::DeepseekArgs;
use anneal_plugin_api::sdk::HfAdapter;
use serde_json::json;

/// The config for export.
pub fn adapter(a: &DeepseekArgs) -> HfAdapter {
    if a.hf_model_type == "kimi_linear" {
        return kimi_linear_adapter(a);
    }
    let config = json!({
        "model_type": a.hf_model_type,
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": a.dim,
        "intermediate_size": a.ffn_dim,
        "moe_intermediate_size": a.expert_ffn_dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_heads,
        "vocab_size": a.vocab_size,
        "rms_norm_eps": a.norm_eps,
        "rope_parameters": a.rope().to_hf(),
        "rope_interleave": a.rope_interleave,
        "max_position_embeddings": a.max_seq_len,
        "q_lora_rank": a.q_lora_rank,
        "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        // The leading dense blocks, so a model listing all its blocks dense reads back so.
        "first_k_dense_replace": (0..a.n_layers).take_while(|&i| !a.is_sparse(i)).count(),
        "n_routed_experts": a.n_experts,
        "num_experts_per_tok": a.top_k,
        "n_shared_experts": a.n_shared_experts,
        "n_group": a.n_group,
        "topk_group": a.topk_group,
        "norm_topk_prob": a.norm_topk_prob,
        "routed_scaling_factor": a.routed_scaling_factor,
        "scoring_func": a.scoring,
        "num_nextn_predict_layers": a.mtp_layers,
        "attention_bias": false,
        "tie_word_embeddings": a.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": if a.dtype == "bf16" { "bfloat16" } else { "float32" },
    });
    HfAdapter { config }
}

/// Kimi Linear's config, with the keys transformers' `save_pretrained` writes (its
/// `attribute_map` names: `num_experts`, `num_experts_per_token`, ...) and the layer patterns
/// spelled out.
fn kimi_linear_adapter(a: &DeepseekArgs) -> HfAdapter {
    let kda = a.kda.as_ref();
    let layer_types: Vec<&str> = (0..a.n_layers)
        .map(|i| match a.kda_at(i) {
            Some(_) => "linear_attention",
            None => "full_attention",
        })
        .collect();
    let mlp_layer_types: Vec<&str> = (0..a.n_layers)
        .map(|i| if a.is_sparse(i) { "sparse" } else { "dense" })
        .collect();
    let mut config = json!({
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "hidden_size": a.dim,
        "intermediate_size": a.ffn_dim,
        "moe_intermediate_size": a.expert_ffn_dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_heads,
        "vocab_size": a.vocab_size,
        "rms_norm_eps": a.norm_eps,
        "model_max_length": a.max_seq_len,
        "q_lora_rank": a.q_lora_rank,
        "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        "layer_types": layer_types,
        "mlp_layer_types": mlp_layer_types,
        "linear_num_heads": kda.map(|k| k.n_heads),
        "linear_head_dim": kda.map(|k| k.head_dim),
        "linear_conv_kernel_dim": kda.map(|k| k.conv_kernel),
        "num_experts": a.n_experts,
        "num_experts_per_token": a.top_k,
        "num_shared_experts": a.n_shared_experts,
        "num_expert_group": a.n_group,
        "topk_group": a.topk_group,
        "moe_renormalize": a.norm_topk_prob,
        "routed_scaling_factor": a.routed_scaling_factor,
        "attention_bias": false,
        "tie_word_embeddings": a.tie_embeddings,
        "hidden_act": "silu",
        "pad_token_id": null,
        "bos_token_id": null,
        "eos_token_id": null,
        "torch_dtype": if a.dtype == "bf16" { "bfloat16" } else { "float32" },
    });
    if a.hf_released_layout {
        // As the released configs spell it (1-based lists), which is also how the reader
        // tells this layout from transformers' (`mlp_layer_types` absent).
        let (kda_layers, full): (Vec<usize>, Vec<usize>) =
            (1..=a.n_layers).partition(|&l| a.kda_at(l - 1).is_some());
        let obj = config.as_object_mut().expect("a JSON object");
        obj.remove("layer_types");
        obj.remove("mlp_layer_types");
        for k in [
            "linear_num_heads",
            "linear_head_dim",
            "linear_conv_kernel_dim",
        ] {
            obj.remove(k);
        }
        obj.insert(
            "linear_attn_config".into(),
            json!({
                "kda_layers": kda_layers,
                "full_attn_layers": full,
                "num_heads": kda.map(|k| k.n_heads),
                "head_dim": kda.map(|k| k.head_dim),
                "short_conv_kernel_size": kda.map(|k| k.conv_kernel),
            }),
        );
        let first_dense = (0..a.n_layers).take_while(|&i| !a.is_sparse(i)).count();
        obj.insert("first_k_dense_replace".into(), first_dense.into());
    }
    HfAdapter { config }
}
