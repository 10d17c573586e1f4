//! The Hugging Face `config.json` of a model (each parameter declares its own checkpoint name
//! in `spec.rs`). DeepSeek-V4 rotates the trailing `qk_rope_head_dim` dims of each head with
//! interleaved pairs; the model narrows to them and uses the host's interleaved RoPE, so tensors
//! map one to one.

use crate::config::DeepseekV4Args;
use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::HfAdapter;
use serde_json::json;

/// The config for export, in transformers 5's `deepseek_v4` keys: the declared keys, then the
/// constants and what is derived from them.
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
    let mut config = serde_json::Value::Object(a.to_hf());
    config["model_type"] = json!("deepseek_v4");
    config["architectures"] = json!(["DeepseekV4ForCausalLM"]);
    config["num_key_value_heads"] = json!(1);
    config["partial_rotary_factor"] = json!(partial);
    config["rope_parameters"] = json!({
        "main": {
            "rope_type": "default",
            "rope_theta": a.rope_theta,
            "partial_rotary_factor": partial,
        },
        "compress": compress,
    });
    config["compress_rates"] = json!({
        "compressed_sparse_attention": a.csa_rate,
        "heavily_compressed_attention": a.hca_rate,
    });
    // Read back as 0: transformers drops DeepSeek's `mtp.*` weights on load.
    config["num_nextn_predict_layers"] = json!(a.mtp_layers);
    config["norm_topk_prob"] = json!(true);
    config["hidden_act"] = json!("silu");
    config["attention_bias"] = json!(false);
    config["dtype"] = json!(if a.dtype == "bf16" {
        "bfloat16"
    } else {
        "float32"
    });
    HfAdapter { config }
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
