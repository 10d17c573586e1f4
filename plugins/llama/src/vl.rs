//! Qwen3-VL (`qwen3_vl`, transformers' `Qwen3VLForConditionalGeneration`; and `qwen3_vl_moe`,
//! whose decoder is Qwen3-MoE's with fused expert tensors): the Qwen3 decoder with the vision
//! tower of [`anneal_plugin_api::sdk::vision`]. The `embed` stage runs the tower
//! on the forward's images and puts the merged embeddings into the image placeholder tokens;
//! the DeepStack features travel beside the hidden state, each added to the placeholder
//! positions after one of the first blocks.
//!
//! Text alone keeps 1-D positions: transformers' interleaved 3-D MRoPE then gives every axis
//! the same position, which is the 1-D rotary embedding. With images, `embed` reads the token
//! ids and computes the 3-D positions ([`anneal_plugin_api::sdk::vision::mrope`]), which travel
//! beside the hidden state to every block; with a KV cache the prompt's delta is kept as state,
//! so decode continues it. This file reads and writes the config and names the flavors; the
//! `embed` stage and MRoPE are the SDK's, shared with Qwen3.5.

use crate::config::LlamaArgs;
pub use anneal_plugin_api::sdk::vision::VlArgs;
use anneal_plugin_api::sdk::vision::{TextShape, VisionArgs};
use anneal_plugin_api::sdk::{HfConfig, ParamSpec};

/// The text decoder's sizes the vision settings must fit.
pub fn text_shape(a: &LlamaArgs) -> TextShape {
    TextShape {
        dim: a.dim,
        n_layers: a.n_layers,
        rotary_pairs: a.head_dim() / 2,
        vocab_size: a.vocab_size,
    }
}

/// The arguments of a `qwen3_vl` or `qwen3_vl_moe` `config.json`: its `text_config` read as
/// Qwen3's or Qwen3-MoE's (whose router always renormalises its top-k weights), its
/// `vision_config` and `image_token_id`.
pub fn from_hf_config(c: &serde_json::Value) -> Result<LlamaArgs, String> {
    let f = HfConfig::new(c);
    let model_type = f.str("model_type")?.unwrap_or("qwen3_vl").to_string();
    let moe = model_type == "qwen3_vl_moe";
    let mut text = f
        .get("text_config")
        .filter(|t| t.is_object())
        .ok_or_else(|| format!("config.json: {model_type} needs a 'text_config' object"))?
        .clone();
    text["model_type"] = if moe { "qwen3_moe" } else { "qwen3" }.into();
    if moe {
        text["norm_topk_prob"] = true.into();
    }
    // The model's own flag decides (transformers' text configs carry a default of their own).
    match f.bool("tie_word_embeddings")? {
        Some(tie) => text["tie_word_embeddings"] = tie.into(),
        None if text.get("tie_word_embeddings").is_none() => {
            text["tie_word_embeddings"] = false.into()
        }
        None => {}
    }
    let mut args = crate::config::from_hf_config(&text)
        .map_err(|e| e.replacen("config.json: ", "config.json: text_config: ", 1))?;
    args.hf_model_type = model_type;
    let vl = VlArgs::from_hf(&f, &HfConfig::new(&text), &[])?;
    vl.validate(&text_shape(&args))
        .map_err(|e| format!("config.json: {e}"))?;
    args.vision = Some(vl);
    Ok(args)
}

/// The Qwen3-VL flavors: `qwen3_vl_2b`, `qwen3_vl_8b` and `qwen3_vl_30b_a3b` as released
/// (parameter counts equal transformers'), and `debugmodel_vl`, the debug model with a tiny
/// tower whose vision tokens are ids 3 to 6, where tokenizers trained on chat data number
/// them (`<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>`, after
/// `<|endoftext|>`, `<|im_start|>` and `<|im_end|>`).
pub fn flavor(name: &str) -> Option<LlamaArgs> {
    let tower = |depth, hidden_size, intermediate_size, out_hidden_size, deepstack: [usize; 3]| {
        VisionArgs {
            depth,
            hidden_size,
            num_heads: 16,
            intermediate_size,
            out_hidden_size,
            patch_size: 16,
            temporal_patch_size: 2,
            in_channels: 3,
            spatial_merge_size: 2,
            num_position_embeddings: 2304,
            deepstack_visual_indexes: deepstack.to_vec(),
            hidden_act: "gelu_pytorch_tanh".into(),
            rope_theta: 10_000.0,
        }
    };
    // Qwen's vision tokens: <|vision_start|> 151652, <|vision_end|> 151653, <|image_pad|>
    // 151655, <|video_pad|> 151656.
    let qwen = |text: LlamaArgs, vision: VisionArgs, model_type: &str| LlamaArgs {
        rope_theta: 5_000_000.0,
        max_seq_len: 262_144,
        hf_model_type: model_type.into(),
        vision: Some(VlArgs {
            vision,
            image_token_id: 151_655,
            mrope_section: vec![24, 20, 20],
            video_token_id: Some(151_656),
            vision_start_token_id: Some(151_652),
            vision_end_token_id: Some(151_653),
        }),
        ..text
    };
    let qwen3_8b = crate::config::flavor("qwen3_8b")?;
    Some(match name {
        "qwen3_vl_2b" => qwen(
            LlamaArgs {
                dim: 2048,
                n_layers: 28,
                n_heads: 16,
                ffn_dim: 6144,
                tie_embeddings: true,
                ..qwen3_8b
            },
            tower(24, 1024, 4096, 2048, [5, 11, 17]),
            "qwen3_vl",
        ),
        "qwen3_vl_8b" => qwen(
            qwen3_8b,
            tower(27, 1152, 4304, 4096, [8, 16, 24]),
            "qwen3_vl",
        ),
        "qwen3_vl_30b_a3b" => qwen(
            crate::config::flavor("qwen3_30b_a3b")?,
            tower(27, 1152, 4304, 2048, [8, 16, 24]),
            "qwen3_vl_moe",
        ),
        "debugmodel_vl" => {
            let text = crate::config::flavor("debugmodel_qwen3")?;
            LlamaArgs {
                hf_model_type: "qwen3_vl".into(),
                vision: Some(VlArgs {
                    vision: VisionArgs {
                        depth: 2,
                        hidden_size: 64,
                        num_heads: 2,
                        intermediate_size: 128,
                        num_position_embeddings: 64,
                        deepstack_visual_indexes: vec![0],
                        ..tower(0, 0, 0, text.dim, [0; 3])
                    },
                    image_token_id: 5,
                    mrope_section: vec![12, 10, 10],
                    video_token_id: Some(6),
                    vision_start_token_id: Some(3),
                    vision_end_token_id: Some(4),
                }),
                ..text
            }
        }
        _ => return None,
    })
}

/// Moves the text model's Hugging Face names under `model.language_model.` (where
/// `Qwen3VLForConditionalGeneration` keeps them; `lm_head` stays).
pub fn text_under_language_model(specs: &mut [ParamSpec]) {
    for p in specs {
        if let Some(m) = &mut p.hf {
            for s in &mut m.sources {
                if let Some(rest) = s.strip_prefix("model.") {
                    if !rest.starts_with("visual.") {
                        *s = format!("model.language_model.{rest}");
                    }
                }
            }
        }
    }
}

/// The `config.json` of a Qwen3-VL (or Qwen3-VL-MoE) export: `text` (the decoder's keys) as its
/// `text_config`, the tower as its `vision_config`.
pub fn hf_config(mut text: serde_json::Value, a: &LlamaArgs, vl: &VlArgs) -> serde_json::Value {
    use serde_json::json;
    let tie = text["tie_word_embeddings"].clone();
    let torch_dtype = text["torch_dtype"].clone();
    if let Some(o) = text.as_object_mut() {
        for k in [
            "architectures",
            "rope_theta",
            "rope_scaling",
            "tie_word_embeddings",
        ] {
            o.remove(k);
        }
    }
    let moe = a.hf_model_type == "qwen3_vl_moe";
    let (model_type, architecture) = if moe {
        ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration")
    } else {
        ("qwen3_vl", "Qwen3VLForConditionalGeneration")
    };
    text["model_type"] = json!(format!("{model_type}_text"));
    text["rope_parameters"] = json!({"rope_type": "default", "rope_theta": a.rope_theta});
    vl.add_mrope(&mut text["rope_parameters"]);
    let mut config = json!({
        "model_type": model_type,
        "architectures": [architecture],
        "tie_word_embeddings": tie,
        "torch_dtype": torch_dtype,
        "text_config": text,
    });
    if let Some(o) = config.as_object_mut() {
        o.extend(vl.hf_keys(&format!("{model_type}_vision"), true));
    }
    config
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    fn config() -> serde_json::Value {
        json!({
            "model_type": "qwen3_vl",
            "image_token_id": 90,
            "tie_word_embeddings": false,
            "text_config": {
                "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                "head_dim": 16, "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                    "mrope_section": [2, 3, 3], "mrope_interleaved": true}
            },
            "vision_config": {
                "depth": 3, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                "out_hidden_size": 32, "patch_size": 16, "num_position_embeddings": 16,
                "deepstack_visual_indexes": [0, 1],
                "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}
            }
        })
    }

    #[test]
    fn qwen3_vl_config_reads_both_towers_and_names_transformers_tensors() {
        let a = crate::config::from_hf_config(&config()).unwrap();
        let vl = a.vision.as_ref().unwrap();
        assert_eq!(vl.image_token_id, 90);
        assert_eq!(vl.mrope_section, [2, 3, 3]);
        assert!(a.qk_norm);
        let specs = crate::spec::params(&a);
        let hf = |name: &str| {
            let p = specs.iter().find(|p| p.name == name).unwrap();
            p.hf.as_ref().unwrap().sources.concat()
        };
        assert_eq!(
            hf("tok_embeddings.weight"),
            "model.language_model.embed_tokens.weight"
        );
        assert_eq!(
            hf("layers.1.attention.wq.weight"),
            "model.language_model.layers.1.self_attn.q_proj.weight"
        );
        assert_eq!(hf("output.weight"), "lm_head.weight");
        assert_eq!(
            hf("visual.blocks.2.attn.qkv.bias"),
            "model.visual.blocks.2.attn.qkv.bias"
        );
        assert_eq!(
            hf("visual.deepstack_merger_list.1.norm.weight"),
            "model.visual.deepstack_merger_list.1.norm.weight"
        );
        let tower: usize = specs
            .iter()
            .filter(|p| p.name.starts_with("visual."))
            .map(|p| p.shape.iter().product::<usize>())
            .sum();
        assert_eq!(tower, vl.vision.n_params());
        // The export names the architecture and nests both configs.
        let exported = crate::hf::adapter(&a).config;
        assert_eq!(
            exported["architectures"][0],
            "Qwen3VLForConditionalGeneration"
        );
        assert_eq!(
            exported["text_config"]["rope_parameters"]["mrope_section"],
            json!([2, 3, 3])
        );
        assert_eq!(
            exported["vision_config"]["deepstack_visual_indexes"],
            json!([0, 1])
        );
    }

    #[test]
    fn bad_qwen3_vl_configs_are_refused_by_key() {
        let cases = [
            (
                "/vision_config/out_hidden_size",
                json!(48),
                "out_hidden_size",
            ),
            (
                "/vision_config/num_position_embeddings",
                json!(15),
                "num_position_embeddings",
            ),
            (
                "/vision_config/deepstack_visual_indexes",
                json!([5]),
                "deepstack_visual_indexes",
            ),
            ("/vision_config/num_heads", json!(3), "num_heads"),
            ("/image_token_id", json!(96), "image_token_id"),
            (
                "/text_config/rope_parameters/mrope_section",
                json!([2, 2, 2]),
                "mrope_section",
            ),
            (
                "/text_config/rope_parameters/mrope_interleaved",
                json!(false),
                "mrope_interleaved",
            ),
            (
                "/text_config/hidden_size",
                json!("x"),
                "text_config: 'hidden_size'",
            ),
        ];
        for (pointer, value, key) in cases {
            let mut c = config();
            *c.pointer_mut(pointer).unwrap() = value;
            let e = crate::config::from_hf_config(&c).expect_err(pointer);
            assert!(e.contains(key), "{pointer}: {e}");
        }
        let mut c = config();
        c.as_object_mut().unwrap().remove("vision_config");
        let e = crate::config::from_hf_config(&c).unwrap_err();
        assert!(e.contains("vision_config"), "{e}");
    }
}
