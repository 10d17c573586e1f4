//! The Hugging Face `config.json` of a model (each parameter declares its own checkpoint name
//! in `spec.rs`). DeepSeek-V4 rotates the trailing `qk_rope_head_dim` dims of each head with
//! interleaved pairs; the model narrows to them and uses the host's interleaved RoPE, so tensors
//! map one to one.

use crate::config::DeepseekV4Args;
use anneal_plugin_api::sdk::HfAdapter;
use serde_json::json;

/// The config for export, in transformers 5's `deepseek_v4` keys.
pub fn adapter(a: &DeepseekV4Args) -> HfAdapter {
    let partial = a.rope_head_dim as f64 / a.head_dim as f64;
    let mut compress = json!({
        "rope_type": "default",
        "rope_theta": a.compress_rope_theta,
        "partial_rotary_factor": partial,
    });
    if let Some(y) = &a.compress_yarn {
        compress = json!({
            "rope_type": "yarn",
            "rope_theta": a.compress_rope_theta,
            "partial_rotary_factor": partial,
            "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
            "truncate": y.truncate,
            "attention_factor": y.attention_factor.unwrap_or(1.0),
        });
    }
    HfAdapter {
        config: json!({
            "model_type": "deepseek_v4",
            "architectures": ["DeepseekV4ForCausalLM"],
            "hidden_size": a.dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": 1,
            "head_dim": a.head_dim,
            "qk_rope_head_dim": a.rope_head_dim,
            "partial_rotary_factor": partial,
            "q_lora_rank": a.q_lora_rank,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "compress_rope_theta": a.compress_rope_theta,
            "rope_parameters": {
                "main": {
                    "rope_type": "default",
                    "rope_theta": a.rope_theta,
                    "partial_rotary_factor": partial,
                },
                "compress": compress,
            },
            "max_position_embeddings": a.max_seq_len,
            "layer_types": a.layer_types,
            "compress_rates": {
                "compressed_sparse_attention": a.csa_rate,
                "heavily_compressed_attention": a.hca_rate,
            },
            "sliding_window": a.sliding_window,
            "o_groups": a.o_groups,
            "o_lora_rank": a.o_lora_rank,
            "index_n_heads": a.index_n_heads,
            "index_head_dim": a.index_head_dim,
            "index_topk": a.index_topk,
            "hc_mult": a.hc_mult,
            "hc_sinkhorn_iters": a.hc_sinkhorn_iters,
            "hc_eps": a.hc_eps,
            "mlp_layer_types": a.mlp_layer_types,
            "n_routed_experts": a.n_experts,
            "num_experts_per_tok": a.top_k,
            "moe_intermediate_size": a.expert_ffn_dim,
            "n_shared_experts": a.n_shared_experts,
            "scoring_func": a.scoring,
            "norm_topk_prob": true,
            "routed_scaling_factor": a.routed_scaling_factor,
            "swiglu_limit": a.swiglu_limit,
            "num_nextn_predict_layers": a.mtp_layers,
            "tie_word_embeddings": a.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": false,
            "dtype": if a.dtype == "bf16" { "bfloat16" } else { "float32" },
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{flavor, from_hf_config, FLAVORS};

    #[test]
    fn the_exported_config_reads_back_the_same() {
        for name in FLAVORS {
            let a = flavor(name).unwrap();
            let back = from_hf_config(&adapter(&a).config).unwrap();
            // The balancing rate is a training setting, not part of the checkpoint, and
            // transformers' checkpoints carry no MTP module.
            assert_eq!(
                DeepseekV4Args {
                    balance_rate: 0.0,
                    mtp_layers: 0,
                    ..a
                },
                back,
                "{name}"
            );
        }
    }

    #[test]
    fn deepseeks_own_config_keys_read_like_transformers_names() {
        let a = flavor("deepseek_v4_flash").unwrap();
        let mut c = adapter(&a).config;
        let obj = c.as_object_mut().unwrap();
        for k in ["layer_types", "mlp_layer_types", "compress_rates"] {
            obj.remove(k);
        }
        // 43 blocks: 2 HCA, then CSA and HCA alternating, as transformers' default.
        let ratios: Vec<usize> = (0..43)
            .map(|i| if i >= 2 && (i - 2) % 2 == 1 { 4 } else { 128 })
            .collect();
        obj.insert("compress_ratios".into(), json!(ratios));
        obj.insert("num_hash_layers".into(), json!(3));
        obj.insert("compress_rate_csa".into(), json!(4));
        obj.insert("compress_rate_hca".into(), json!(128));
        assert_eq!(
            from_hf_config(&c).unwrap(),
            DeepseekV4Args {
                balance_rate: 0.0,
                ..a
            }
        );
        c["compress_ratios"][0] = json!(7);
        let e = from_hf_config(&c).unwrap_err();
        assert!(e.contains("compress_ratios holds 7"), "{e}");
    }
}
