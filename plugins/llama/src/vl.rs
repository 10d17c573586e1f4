//! Qwen3-VL (`qwen3_vl`, transformers' `Qwen3VLForConditionalGeneration`): the Qwen3 decoder
//! with the vision tower of [`anneal_plugin_api::sdk::vision`]. The `embed` stage runs the tower
//! on the forward's images and puts the merged embeddings into the image placeholder tokens;
//! the DeepStack features travel beside the hidden state, each added to the placeholder
//! positions after one of the first blocks.
//!
//! Text positions are plain 1-D here: for text, transformers' interleaved 3-D MRoPE gives every
//! axis the same position, which is the 1-D rotary embedding. The 3-D positions of a prompt
//! with images (`get_rope_index`) are not computed yet, so a forward with images matches
//! transformers in its image embeddings and DeepStack features, not yet in its logits.

use crate::config::LlamaArgs;
use anneal_plugin_api::sdk::vision::{VisionArgs, VisionTower};
use anneal_plugin_api::sdk::{Ctx, HfConfig, Images, ParamSpec, Result, Tensor};
use serde::{Deserialize, Serialize};

/// What Qwen3-VL adds to the text model's arguments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VlArgs {
    /// The vision tower.
    pub vision: VisionArgs,
    /// The placeholder token each merged image embedding replaces.
    pub image_token_id: usize,
    /// How many rotary frequency pairs the text model's MRoPE gives the time, height and width
    /// positions (`rope_parameters.mrope_section`), kept for export.
    #[serde(default)]
    pub mrope_section: Vec<usize>,
}

impl VlArgs {
    /// Checks the tower fits the text model.
    pub fn validate(&self, a: &LlamaArgs) -> Result<(), String> {
        self.vision
            .validate()
            .map_err(|e| format!("vision.vision.{e}"))?;
        if self.vision.out_hidden_size != a.dim {
            return Err(format!(
                "vision.vision.out_hidden_size {} must equal the text model's dim {}",
                self.vision.out_hidden_size, a.dim
            ));
        }
        if self.vision.deepstack_visual_indexes.len() > a.n_layers {
            return Err(format!(
                "vision.vision.deepstack_visual_indexes: {} DeepStack features for {} layers",
                self.vision.deepstack_visual_indexes.len(),
                a.n_layers
            ));
        }
        let pairs: usize = self.mrope_section.iter().sum();
        if !self.mrope_section.is_empty() && pairs != a.head_dim() / 2 {
            return Err(format!(
                "vision.mrope_section {:?} must add up to half the head dim ({})",
                self.mrope_section,
                a.head_dim() / 2
            ));
        }
        if self.image_token_id >= a.vocab_size {
            return Err(format!(
                "vision.image_token_id {} is outside the vocabulary of {}",
                self.image_token_id, a.vocab_size
            ));
        }
        Ok(())
    }
}

/// The arguments of a `qwen3_vl` `config.json`: its `text_config` read as Qwen3's, its
/// `vision_config` and `image_token_id`.
pub fn from_hf_config(c: &serde_json::Value) -> Result<LlamaArgs, String> {
    let f = HfConfig::new(c);
    let mut text = f
        .get("text_config")
        .filter(|t| t.is_object())
        .ok_or("config.json: qwen3_vl needs a 'text_config' object")?
        .clone();
    text["model_type"] = "qwen3".into();
    if text.get("tie_word_embeddings").is_none() {
        text["tie_word_embeddings"] = f.bool("tie_word_embeddings")?.unwrap_or(false).into();
    }
    let mut args = crate::config::from_hf_config(&text)
        .map_err(|e| e.replacen("config.json: ", "config.json: text_config.", 1))?;
    args.hf_model_type = "qwen3_vl".into();
    let tf = HfConfig::new(&text);
    let mrope_section = match tf.get("rope_parameters").or(tf.get("rope_scaling")) {
        Some(_) => {
            let key = ["rope_parameters", "rope_scaling"]
                .into_iter()
                .find(|k| tf.get(k).is_some())
                .unwrap_or("rope_parameters");
            let r = tf.object(key)?;
            if r.bool("mrope_interleaved")? == Some(false) {
                return Err(format!(
                    "config.json: text_config.{key}.mrope_interleaved = false (Qwen2-VL's \
                     sectioned MRoPE) is not supported"
                ));
            }
            r.uint_list("mrope_section")?.unwrap_or_default()
        }
        None => vec![],
    };
    let vl = VlArgs {
        vision: VisionArgs::from_hf(&f.object("vision_config")?)?,
        image_token_id: f.need_uint("image_token_id")?,
        mrope_section,
    };
    vl.validate(&args)
        .map_err(|e| format!("config.json: {e}"))?;
    args.vision = Some(vl);
    Ok(args)
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

/// The `embed` stage with images: token embeddings `h` with the image placeholders replaced by
/// the tower's embeddings, then one `[B, T, D]` tensor per DeepStack feature (zero outside the
/// placeholders).
pub fn embed_images<'h>(
    ctx: &Ctx<'h>,
    tower: &VisionTower,
    image_token_id: usize,
    tokens: &Tensor<'h>,
    h: Tensor<'h>,
    images: &Images<'h>,
) -> Result<Vec<Tensor<'h>>> {
    let out = tower.forward(ctx, images)?;
    // 1 where the token is the placeholder: ids are exact in f32 below 2^24.
    let mask = tokens
        .to_dtype("f32")?
        .affine(1.0, -(image_token_id as f64))?
        .unary("abs")?
        .clamp(0.0, 1.0)?
        .affine(-1.0, 1.0)?;
    let zeros = h.scale(0.0)?;
    let mut hidden = vec![h.masked_scatter(&mask, &out.embeds)?];
    for f in &out.deepstack {
        hidden.push(zeros.masked_scatter(&mask, f)?);
    }
    Ok(hidden)
}

/// After block `out` was computed from a hidden state that carried DeepStack features
/// `rest`: the first is added (this block is the next one they belong after) and the others
/// travel on.
pub fn add_deepstack<'h>(out: Tensor<'h>, rest: Vec<Tensor<'h>>) -> Result<Vec<Tensor<'h>>> {
    let mut rest = rest.into_iter();
    match rest.next() {
        None => Ok(vec![out]),
        Some(f) => {
            let mut hidden = vec![out.add(&f)?];
            hidden.extend(rest);
            Ok(hidden)
        }
    }
}

/// The `config.json` of a Qwen3-VL export: `text` (the Qwen3 decoder's keys) as its
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
    text["model_type"] = json!("qwen3_vl_text");
    text["rope_parameters"] = json!({
        "rope_type": "default",
        "rope_theta": a.rope_theta,
        "mrope_section": vl.mrope_section,
        "mrope_interleaved": true,
    });
    let v = &vl.vision;
    json!({
        "model_type": "qwen3_vl",
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": vl.image_token_id,
        "tie_word_embeddings": tie,
        "torch_dtype": torch_dtype,
        "text_config": text,
        "vision_config": {
            "model_type": "qwen3_vl_vision",
            "depth": v.depth,
            "hidden_size": v.hidden_size,
            "num_heads": v.num_heads,
            "intermediate_size": v.intermediate_size,
            "out_hidden_size": v.out_hidden_size,
            "patch_size": v.patch_size,
            "temporal_patch_size": v.temporal_patch_size,
            "in_channels": v.in_channels,
            "spatial_merge_size": v.spatial_merge_size,
            "num_position_embeddings": v.num_position_embeddings,
            "deepstack_visual_indexes": v.deepstack_visual_indexes,
            "hidden_act": v.hidden_act,
            "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
        },
    })
}
