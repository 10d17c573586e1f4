//! The language-model side of a Qwen vision-language model (Qwen3-VL, Qwen3.5), shared by the
//! plugins that serve one: the settings a `config.json` adds to the text decoder's
//! ([`VlArgs`]), and the `embed` stage with images ([`embed_images`]: the tower's merged
//! embeddings in the placeholder tokens, the 3-D positions and the DeepStack features beside the
//! hidden state) or without ([`embed_text`]: decode continues a cached prompt's positions).
//!
//! Text alone keeps 1-D positions: transformers' interleaved 3-D MRoPE then gives every axis the
//! same position, which is the 1-D rotary embedding. With images, `embed` reads the token ids
//! and computes the 3-D positions ([`super::mrope`]), which travel beside the hidden state to
//! every block; with a KV cache the prompt's delta is kept as state, so decode continues it.

use super::{mrope, VisionArgs, VisionTower};
use crate::sdk::{Ctx, HfConfig, Images, Result, Tensor};
use serde::{Deserialize, Serialize};

/// What a vision-language model adds to its text decoder's arguments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VlArgs {
    /// The vision tower.
    pub vision: VisionArgs,
    /// The placeholder token each merged image embedding replaces.
    pub image_token_id: usize,
    /// How many rotary frequency pairs the text model's MRoPE gives the time, height and width
    /// positions (`rope_parameters.mrope_section`).
    #[serde(default)]
    pub mrope_section: Vec<usize>,
    /// The video placeholder and the tokens around each image or video, kept for export
    /// (processors and chat templates read them from `config.json`).
    #[serde(default)]
    pub video_token_id: Option<usize>,
    /// See `video_token_id`.
    #[serde(default)]
    pub vision_start_token_id: Option<usize>,
    /// See `video_token_id`.
    #[serde(default)]
    pub vision_end_token_id: Option<usize>,
}

/// The text decoder's sizes a [`VlArgs`] must fit.
pub struct TextShape {
    /// Hidden size (the merged image embeddings' width).
    pub dim: usize,
    /// Blocks (each DeepStack feature is added after one).
    pub n_layers: usize,
    /// Rotary frequency pairs per attention head (half the rotated dims).
    pub rotary_pairs: usize,
    /// Vocabulary size (the image token must be in it).
    pub vocab_size: usize,
}

impl VlArgs {
    /// From a `config.json` whose `text` object (its `text_config`) has been read as the text
    /// decoder's: the top-level `vision_config`, `image_token_id` and the video and vision
    /// start/end tokens, and `text`'s `rope_parameters.mrope_section` (`default_section` when
    /// absent). Sectioned (not interleaved) MRoPE is refused.
    pub fn from_hf(
        top: &HfConfig<'_>,
        text: &HfConfig<'_>,
        default_section: &[usize],
    ) -> Result<Self, String> {
        let key = ["rope_parameters", "rope_scaling"]
            .into_iter()
            .find(|k| text.get(k).is_some());
        let mrope_section = match key {
            Some(key) => {
                let r = text.object(key)?;
                if r.bool("mrope_interleaved")? == Some(false) {
                    return Err(format!(
                        "config.json: text_config.{key}.mrope_interleaved = false (Qwen2-VL's \
                         sectioned MRoPE) is not supported"
                    ));
                }
                r.uint_list("mrope_section")?
            }
            None => None,
        };
        Ok(VlArgs {
            vision: VisionArgs::from_hf(&top.object("vision_config")?)?,
            image_token_id: top.need_uint("image_token_id")?,
            mrope_section: mrope_section.unwrap_or_else(|| default_section.to_vec()),
            video_token_id: top.uint("video_token_id")?,
            vision_start_token_id: top.uint("vision_start_token_id")?,
            vision_end_token_id: top.uint("vision_end_token_id")?,
        })
    }

    /// Checks the tower and the tokens fit the text model; errors name the key under
    /// `vision.` (the text model's field holding these arguments).
    pub fn validate(&self, text: &TextShape) -> Result<(), String> {
        self.vision
            .validate()
            .map_err(|e| format!("vision.vision.{e}"))?;
        if self.vision.out_hidden_size != text.dim {
            return Err(format!(
                "vision.vision.out_hidden_size {} must equal the text model's dim {}",
                self.vision.out_hidden_size, text.dim
            ));
        }
        if self.vision.deepstack_visual_indexes.len() > text.n_layers {
            return Err(format!(
                "vision.vision.deepstack_visual_indexes: {} DeepStack features for {} layers",
                self.vision.deepstack_visual_indexes.len(),
                text.n_layers
            ));
        }
        let pairs: usize = self.mrope_section.iter().sum();
        if !self.mrope_section.is_empty() && pairs != text.rotary_pairs {
            return Err(format!(
                "vision.mrope_section {:?} must add up to the {} rotary frequency pairs of a head",
                self.mrope_section, text.rotary_pairs
            ));
        }
        if self.image_token_id >= text.vocab_size {
            return Err(format!(
                "vision.image_token_id {} is outside the vocabulary of {}",
                self.image_token_id, text.vocab_size
            ));
        }
        Ok(())
    }

    /// The top-level `config.json` keys of an export: the image, video and vision start/end
    /// tokens and the `vision_config` ([`VisionArgs::hf_config`]).
    pub fn hf_keys(
        &self,
        vision_model_type: &str,
        deepstack: bool,
    ) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        m.insert("image_token_id".into(), self.image_token_id.into());
        m.insert("video_token_id".into(), self.video_token_id.into());
        m.insert(
            "vision_start_token_id".into(),
            self.vision_start_token_id.into(),
        );
        m.insert(
            "vision_end_token_id".into(),
            self.vision_end_token_id.into(),
        );
        m.insert(
            "vision_config".into(),
            self.vision.hf_config(vision_model_type, deepstack),
        );
        m
    }

    /// Adds `mrope_section` and `mrope_interleaved` to the text config's `rope_parameters`.
    pub fn add_mrope(&self, rope_parameters: &mut serde_json::Value) {
        rope_parameters["mrope_section"] = serde_json::json!(self.mrope_section);
        rope_parameters["mrope_interleaved"] = true.into();
    }
}

/// The `embed` stage of a model declared with a tower and its settings (`tower`; `None`: a
/// text model, whose `model_type` an error names when the forward has images): the token
/// embeddings `h`, and with images what [`embed_images`] adds, without them [`embed_text`]'s.
pub fn embed<'h>(
    ctx: &Ctx<'h>,
    tower: Option<(&VisionTower, &VlArgs)>,
    model_type: &str,
    tokens: &Tensor<'h>,
    h: Tensor<'h>,
) -> Result<Vec<Tensor<'h>>> {
    match (&ctx.images, tower) {
        (None, Some(_)) => embed_text(ctx, h),
        (None, None) => Ok(vec![h]),
        (Some(images), Some((tower, vl))) => {
            embed_images(ctx, tower, vl.image_token_id, tokens, h, images)
        }
        (Some(_), None) => {
            Err(format!("this {model_type} model takes no images (it has no vision tower)").into())
        }
    }
}

/// The `embed` stage with images: token embeddings `h` with the image placeholders replaced by
/// the tower's embeddings, then the 3-D positions (f32 `[3, B, T]`, from the token ids), then
/// one `[B, T, D]` tensor per DeepStack feature (zero outside the placeholders).
pub fn embed_images<'h>(
    ctx: &Ctx<'h>,
    tower: &VisionTower,
    image_token_id: usize,
    tokens: &Tensor<'h>,
    h: Tensor<'h>,
    images: &Images<'h>,
) -> Result<Vec<Tensor<'h>>> {
    let out = tower.forward(ctx, images)?;
    let shape = tokens.shape()?;
    let [b, t] = shape[..] else {
        return Err(format!("tokens must be [B, T], got {shape:?}").into());
    };
    let ids = tokens.read_ints()?;
    let m = tower.args.spatial_merge_size;
    let (pos, deltas) = mrope::rope_index(&ids, (b, t), &images.grids, image_token_id as i64, m)?;
    let pos: Vec<f32> = pos.iter().map(|&p| p as f32).collect();
    let pos3 = ctx.host.constant_f32(&[3, b, t], &pos, &h)?;
    if ctx.use_cache {
        // Decode continues from each row's last position plus its delta.
        let deltas = ctx.host.constant_i64(&[b, 1], &deltas, tokens)?;
        ctx.set_state(0, MROPE_DELTA, &deltas)?;
    }
    let mask = placeholder_mask(tokens, image_token_id)?;
    let zeros = h.scale(0.0)?;
    let mut hidden = vec![h.masked_scatter(&mask, &out.embeds)?, pos3];
    for f in &out.deepstack {
        hidden.push(zeros.masked_scatter(&mask, f)?);
    }
    Ok(hidden)
}

/// 1 where `tokens` hold `id`, 0 elsewhere (f32, the tokens' shape): where
/// [`Tensor::masked_scatter`] puts a tower's embeddings. Ids are exact in f32 below 2^24.
pub fn placeholder_mask<'h>(tokens: &Tensor<'h>, id: usize) -> Result<Tensor<'h>> {
    tokens
        .to_dtype("f32")?
        .affine(1.0, -(id as f64))?
        .unary("abs")?
        .clamp(0.0, 1.0)?
        .affine(-1.0, 1.0)
}

/// Where a cached sequence keeps its MRoPE delta (`max position + 1 − length` of its prompt).
const MROPE_DELTA: &str = "mrope_delta";

/// The `embed` stage without images: with a cache whose prompt had images, the 3-D positions
/// of these tokens (all three the position plus the prompt's delta) follow the hidden state.
pub fn embed_text<'h>(ctx: &Ctx<'h>, h: Tensor<'h>) -> Result<Vec<Tensor<'h>>> {
    if !ctx.use_cache {
        return Ok(vec![h]);
    }
    let Some(delta) = ctx.state(0, MROPE_DELTA)? else {
        return Ok(vec![h]);
    };
    let p = ctx
        .positions
        .to_dtype("f32")?
        .add(&delta.to_dtype("f32")?)?;
    let pos3 = ctx.host.stack(&[&p, &p, &p], 0)?;
    ctx.set_state(0, MROPE_DELTA, &delta)?;
    Ok(vec![h, pos3])
}

/// After block `out` was computed from a hidden state that carried 3-D positions `pos3` and
/// DeepStack features `rest`: the first feature is added (this block is the next one they
/// belong after), and the positions and the other features travel on.
pub fn add_deepstack<'h>(
    out: Tensor<'h>,
    pos3: Option<Tensor<'h>>,
    rest: Vec<Tensor<'h>>,
) -> Result<Vec<Tensor<'h>>> {
    let Some(pos3) = pos3 else {
        return Ok(vec![out]);
    };
    let mut rest = rest.into_iter();
    let out = match rest.next() {
        Some(f) => out.add(&f)?,
        None => out,
    };
    let mut hidden = vec![out, pos3];
    hidden.extend(rest);
    Ok(hidden)
}
