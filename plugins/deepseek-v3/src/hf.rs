//! The Hugging Face `config.json` of a DeepSeek-V3 model (each parameter declares its own
//! Hugging Face name in `spec.rs`).

use crate::config::DeepseekArgs;
use anneal_plugin_api::sdk::HfAdapter;
use serde_json::json;

/// The config for export.
pub fn adapter(a: &DeepseekArgs) -> HfAdapter {
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
        "first_k_dense_replace": a.first_k_dense,
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
