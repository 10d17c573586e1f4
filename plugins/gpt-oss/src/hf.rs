//! The Hugging Face `config.json` of a gpt-oss model (each parameter declares its own Hugging
//! Face name in `spec.rs`).

use crate::config::{GptOssArgs, LayerType};
use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::HfAdapter;
use serde_json::json;

/// The config for export: the declared keys, then what depends on none of them.
pub fn adapter(a: &GptOssArgs) -> HfAdapter {
    let mut config = serde_json::Value::Object(a.to_hf());
    let layer_types: Vec<LayerType> = (0..a.n_layers).map(|i| a.layer_type(i)).collect();
    if let Some(o) = config.as_object_mut() {
        // gpt-oss's configs carry their RoPE as transformers 5 writes it.
        o.remove("rope_scaling");
        o.remove("rope_theta");
    }
    let rope = a.hf_rope().map(|r| r.to_hf());
    for (k, v) in [
        ("model_type", json!("gpt_oss")),
        ("architectures", json!(["GptOssForCausalLM"])),
        ("rope_parameters", json!(rope)),
        ("layer_types", json!(layer_types)),
        ("output_router_logits", json!(a.aux_loss_coef > 0.0)),
        ("attention_bias", json!(true)),
        ("hidden_act", json!("silu")),
        (
            "torch_dtype",
            json!(if a.dtype == "bf16" {
                "bfloat16"
            } else {
                "float32"
            }),
        ),
    ] {
        config[k] = v;
    }
    HfAdapter { config }
}
