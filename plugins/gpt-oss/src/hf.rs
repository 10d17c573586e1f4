//! The Hugging Face `config.json` of a gpt-oss model (each parameter declares its own Hugging
//! Face name in `spec.rs`).

use crate::config::{GptOssArgs, LayerType};
use anneal_plugin_api::sdk::HfAdapter;
use serde_json::json;

/// The config for export.
pub fn adapter(a: &GptOssArgs) -> HfAdapter {
    let layer_types: Vec<LayerType> = (0..a.n_layers).map(|i| a.layer_type(i)).collect();
    let config = json!({
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": a.dim,
        "intermediate_size": a.expert_ffn_dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim,
        "vocab_size": a.vocab_size,
        "rms_norm_eps": a.norm_eps,
        "rope_parameters": a.rope().to_hf(),
        "max_position_embeddings": a.max_seq_len,
        "sliding_window": a.sliding_window,
        "layer_types": layer_types,
        "num_local_experts": a.n_experts,
        "num_experts_per_tok": a.top_k,
        "swiglu_alpha": a.swiglu_alpha,
        "swiglu_limit": a.swiglu_limit,
        "router_aux_loss_coef": a.aux_loss_coef,
        "output_router_logits": a.aux_loss_coef > 0.0,
        "attention_bias": true,
        "tie_word_embeddings": a.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": if a.dtype == "bf16" { "bfloat16" } else { "float32" },
    });
    HfAdapter { config }
}
