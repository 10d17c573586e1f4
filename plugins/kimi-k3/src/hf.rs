//! The Hugging Face `config.json` of a Kimi K3 model (each parameter declares its own Hugging
//! Face name in `spec.rs`).

use crate::config::KimiK3Args;
use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::HfAdapter;
use serde_json::{json, Value};

/// The config for export: the declared keys, then what transformers reads beside them.
pub fn adapter(a: &KimiK3Args) -> HfAdapter {
    let mut config = Value::Object(a.to_hf());
    config["model_type"] = json!("kimi_k3");
    config["architectures"] = json!(["KimiK3ForCausalLM"]);
    config["num_key_value_heads"] = json!(a.n_heads);
    config["linear_attn_value_heads"] = json!(a.kda_heads);
    config["linear_attn_value_head_dim"] = json!(a.kda_head_dim);
    config["use_full_rank_output_gate"] = json!(true);
    // Written as `null` when absent: transformers' defaults are the released model's values.
    config["forget_gate_lower_bound"] = json!(a.forget_gate_lower_bound);
    config["activation_situ_linear_beta"] = json!(a.situ_linear_beta);
    config["attention_bias"] = json!(false);
    config["hidden_act"] = json!("situ");
    config["torch_dtype"] = json!(if a.dtype == "bf16" {
        "bfloat16"
    } else {
        "float32"
    });
    HfAdapter { config }
}
