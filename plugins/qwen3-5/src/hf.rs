//! The Hugging Face `config.json` of a model (each parameter declares its own Hugging Face name
//! in `spec.rs`). transformers' `rotate_half` partial RoPE is the half-split layout over the
//! first `rot_dim` dims that the host's RoPE uses, so tensors map one to one.

use crate::config::{LayerType, Qwen35Args};
use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::HfAdapter;
use serde_json::json;

/// The config for export: the text model's keys, nested under `text_config` for the
/// `qwen3_5` / `qwen3_5_moe` model types (which tie at the top level), with the vision tower's
/// `vision_config`, the image tokens and the MRoPE sections when the model has vision.
pub fn adapter(a: &Qwen35Args) -> HfAdapter {
    let moe = a.moe.is_some();
    let text_type = if moe {
        "qwen3_5_moe_text"
    } else {
        "qwen3_5_text"
    };
    let layer_types: Vec<LayerType> = (0..a.n_layers).map(|i| a.layer_type(i)).collect();
    let mut text = serde_json::Value::Object(a.to_hf());
    for (k, v) in [
        ("model_type", json!(text_type)),
        (
            "architectures",
            json!([if moe {
                "Qwen3_5MoeForCausalLM"
            } else {
                "Qwen3_5ForCausalLM"
            }]),
        ),
        (
            "rope_parameters",
            json!({
                "rope_type": "default",
                "rope_theta": a.rope_theta,
                "partial_rotary_factor": a.partial_rotary_factor,
            }),
        ),
        ("layer_types", json!(layer_types)),
        ("hidden_act", json!("silu")),
        ("attention_bias", json!(false)),
        (
            "dtype",
            json!(if a.dtype == "bf16" {
                "bfloat16"
            } else {
                "float32"
            }),
        ),
    ] {
        text[k] = v;
    }
    match &a.moe {
        Some(m) => text["output_router_logits"] = json!(m.aux_loss_coef > 0.0),
        None => text["intermediate_size"] = json!(a.ffn_dim),
    }
    if !a.nested() {
        return HfAdapter { config: text };
    }
    if let Some(vl) = &a.vision {
        vl.add_mrope(&mut text["rope_parameters"]);
    }
    let architecture = if moe {
        "Qwen3_5MoeForConditionalGeneration"
    } else {
        "Qwen3_5ForConditionalGeneration"
    };
    let mut config = json!({
        "model_type": a.hf_model_type,
        "architectures": [architecture],
        "tie_word_embeddings": a.tie_embeddings,
        "text_config": text,
    });
    if let (Some(vl), Some(o)) = (&a.vision, config.as_object_mut()) {
        o.extend(vl.hf_keys(&format!("{}_vision", a.hf_model_type), false));
    }
    HfAdapter { config }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{flavor, from_hf_config};

    #[test]
    fn the_exported_config_reads_back_the_same() {
        for name in ["debugmodel", "debugmodel_moe"] {
            let mut a = flavor(name).unwrap();
            a.layer_types = (0..a.n_layers).map(|i| a.layer_type(i)).rev().collect();
            a.full_attention_interval = 4;
            let back = from_hf_config(&adapter(&a).config).unwrap();
            assert_eq!(back, a, "{name}");
            a.hf_model_type = if a.moe.is_some() {
                "qwen3_5_moe"
            } else {
                "qwen3_5"
            }
            .into();
            a.tie_embeddings = true;
            let back = from_hf_config(&adapter(&a).config).unwrap();
            assert_eq!(back, a, "{name} nested");
        }
    }

    #[test]
    fn a_model_with_vision_exports_transformers_config() {
        let a = from_hf_config(&crate::config::tests::with_vision()).unwrap();
        let c = adapter(&a).config;
        assert_eq!(c["architectures"][0], "Qwen3_5ForConditionalGeneration");
        assert_eq!(c["image_token_id"], 90);
        assert_eq!(c["vision_config"]["model_type"], "qwen3_5_vision");
        assert!(c["vision_config"].get("deepstack_visual_indexes").is_none());
        let rope = &c["text_config"]["rope_parameters"];
        assert_eq!(rope["mrope_section"], json!([2, 1, 1]));
        assert_eq!(rope["partial_rotary_factor"], 0.5);
        // Reads back the same (the layer pattern written out in full).
        let back = from_hf_config(&c).unwrap();
        assert_eq!(
            (back.vision, back.tie_embeddings),
            (a.vision.clone(), false)
        );
        // The tower's parameters under transformers' names, outside the text model.
        let specs = crate::spec::params(&a);
        let hf = |name: &str| {
            let p = specs.iter().find(|p| p.name == name).unwrap();
            p.hf.as_ref().unwrap().sources.concat()
        };
        assert_eq!(
            hf("visual.blocks.1.attn.qkv.weight"),
            "model.visual.blocks.1.attn.qkv.weight"
        );
        assert_eq!(
            hf("tok_embeddings.weight"),
            "model.language_model.embed_tokens.weight"
        );
        assert!(specs.iter().all(|p| !p.name.contains("deepstack")));
        let tower: usize = specs
            .iter()
            .filter(|p| p.name.starts_with("visual."))
            .map(|p| p.shape.iter().product::<usize>())
            .sum();
        assert_eq!(tower, a.vision.as_ref().unwrap().vision.n_params());
    }
}
