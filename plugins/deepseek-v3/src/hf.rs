//! The Hugging Face `config.json` of a DeepSeek-V3 model (each parameter declares its own
//! Hugging Face name in `spec.rs`).

use crate::config::DeepseekArgs;
use crate::kimi_config::NOT_KIMI_KEYS;
use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::HfAdapter;
use serde_json::{json, Value};

/// The config for export: the declared keys, then what depends on the model type.
pub fn adapter(a: &DeepseekArgs) -> HfAdapter {
    let mut config = Value::Object(a.to_hf());
    // Written as `null` when absent: transformers' DeepSeek-V3 default is a rank.
    config["q_lora_rank"] = json!(a.q_lora_rank);
    config["num_key_value_heads"] = json!(a.n_heads);
    config["attention_bias"] = json!(false);
    config["hidden_act"] = json!("silu");
    config["torch_dtype"] = json!(if a.dtype == "bf16" {
        "bfloat16"
    } else {
        "float32"
    });
    // The leading dense blocks, so a model listing all its blocks dense reads back so.
    let first_dense = (0..a.n_layers).take_while(|&i| !a.is_sparse(i)).count();
    if a.hf_model_type != "kimi_linear" {
        config["architectures"] = json!(["DeepseekV3ForCausalLM"]);
        config["first_k_dense_replace"] = json!(first_dense);
        // Read back as 0: transformers' checkpoints carry no MTP weights (DeepSeek's own do).
        config["num_nextn_predict_layers"] = json!(a.mtp_layers);
        if let Some(v) = &a.vision {
            // Kimi K2.7: the decoder as its `text_config`, the tower beside it.
            config["model_type"] = json!("deepseek_v3");
            let mut top = v.to_top();
            top.insert("model_type".into(), json!("kimi_k25"));
            top.insert(
                "architectures".into(),
                json!(["Kimi_K25ForConditionalGeneration"]),
            );
            top.insert("tie_word_embeddings".into(), json!(a.tie_embeddings));
            top.insert("text_config".into(), config);
            return HfAdapter {
                config: Value::Object(top),
            };
        }
        return HfAdapter { config };
    }
    // Kimi Linear: the keys transformers' `save_pretrained` writes (its `attribute_map` names)
    // and the layer patterns spelled out.
    let obj = config.as_object_mut().expect("a JSON object");
    for (v3, kimi) in [
        ("max_position_embeddings", "model_max_length"),
        ("n_routed_experts", "num_experts"),
        ("num_experts_per_tok", "num_experts_per_token"),
        ("n_shared_experts", "num_shared_experts"),
        ("n_group", "num_expert_group"),
        ("norm_topk_prob", "moe_renormalize"),
    ] {
        let v = obj.remove(v3).unwrap_or_default();
        obj.insert(kimi.into(), v);
    }
    for k in NOT_KIMI_KEYS {
        obj.remove(k);
    }
    obj.insert("architectures".into(), json!(["KimiLinearForCausalLM"]));
    for k in ["pad_token_id", "bos_token_id", "eos_token_id"] {
        obj.insert(k.into(), Value::Null);
    }
    if a.hf_released_layout {
        // As the released configs spell it (1-based lists), which is also how the reader
        // tells this layout from transformers' (`mlp_layer_types` absent).
        let (kda_layers, full): (Vec<usize>, Vec<usize>) =
            (1..=a.n_layers).partition(|&l| a.kda_at(l - 1).is_some());
        let kda = a.kda.as_ref();
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
        obj.insert("first_k_dense_replace".into(), first_dense.into());
    } else {
        let layer_types: Vec<&str> = (0..a.n_layers)
            .map(|i| match a.kda_at(i) {
                Some(_) => "linear_attention",
                None => "full_attention",
            })
            .collect();
        let mlp_layer_types: Vec<&str> = (0..a.n_layers)
            .map(|i| if a.is_sparse(i) { "sparse" } else { "dense" })
            .collect();
        obj.insert("layer_types".into(), json!(layer_types));
        obj.insert("mlp_layer_types".into(), json!(mlp_layer_types));
    }
    HfAdapter { config }
}
