//! The Hugging Face `config.json` of a Muse Glimmer model: the decoder's declared keys as its
//! `text_config`, the tower's as its `vision_config` (each parameter declares its own name in
//! `spec.rs`).

use crate::config::MuseArgs;
use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::HfAdapter;
use serde_json::{json, Value};

/// The config for export.
pub fn adapter(a: &MuseArgs) -> HfAdapter {
    let mut text = Value::Object(a.to_hf());
    let layer_types: Vec<_> = (0..a.n_layers).map(|i| a.layer_type(i)).collect();
    // transformers writes NoPE's base as the integer 0.
    let thetas: Vec<Value> = (0..a.n_layers)
        .map(|i| {
            if a.has_rope(i) {
                json!(a.rope_theta)
            } else {
                json!(0)
            }
        })
        .collect();
    let dtype = if a.dtype == "bf16" {
        "bfloat16"
    } else {
        "float32"
    };
    let family = a.model_type().trim_end_matches("_text");
    let act_key = if a.spark.is_some() {
        "hidden_act"
    } else {
        "hidden_activation"
    };
    for (k, v) in [
        ("model_type", json!(format!("{family}_text"))),
        ("layer_types", json!(layer_types)),
        ("layer_rope_theta", json!(thetas)),
        (act_key, json!("silu")),
        ("attention_bias", json!(false)),
        ("dtype", json!(dtype)),
    ] {
        text[k] = v;
    }
    if let Some(o) = text.as_object_mut() {
        // transformers 5 keeps the base in `rope_parameters`.
        o.remove("rope_theta");
        o.insert(
            "rope_parameters".into(),
            json!({"rope_type": "default", "rope_theta": a.rope_theta}),
        );
    }
    let Some(v) = &a.vision else {
        return HfAdapter { config: text };
    };
    let mut vision = Value::Object(v.to_hf());
    vision["model_type"] = json!(format!("{family}_vision"));
    vision["rope_parameters"] = json!({"rope_type": "axial", "rope_theta": v.rope_theta});
    vision["hidden_act"] = json!("gelu");
    let architecture = if a.spark.is_some() {
        "MuseSparkForConditionalGeneration"
    } else {
        "MuseGlimmerForConditionalGeneration"
    };
    let mut config = json!({
        "model_type": family,
        "architectures": [architecture],
        "text_config": text,
        "vision_config": vision,
        "out_hidden_size": v.out_hidden_size,
        "projector_hidden_size": v.projector_hidden_size,
        "projector_hidden_act": "gelu",
        "image_token_id": v.image_token_id,
        "video_token_id": v.video_token_id,
        "tie_word_embeddings": a.tie_embeddings,
        "dtype": dtype,
    });
    if let Some(au) = &a.audio {
        let mut audio = Value::Object(au.to_hf());
        audio["model_type"] = json!(format!("{family}_audio"));
        audio["num_hidden_layers"] = json!(au.hidden_sizes.len());
        audio["out_hidden_size"] = json!(a.dim);
        config["audio_config"] = audio;
        config["audio_token_id"] = json!(au.audio_token_id);
    }
    HfAdapter { config }
}
