//! The Qwen3-VL vision tower (transformers' `Qwen3VLVisionModel`), as parameters and host ops
//! any model plugin can declare and run in its `embed` stage: patch embedding (the stride =
//! kernel Conv3d as one product over the patch rows), the learned position table bilinearly
//! interpolated to each image's grid, 2-D rotary embedding, pre-norm blocks whose attention
//! stays inside each image (each frame), the 2×2 patch merger and the DeepStack mergers.
//!
//! [`VisionArgs::from_hf`] reads a `vision_config`; [`VisionTower::declare`] adds the tower's
//! parameters (Hugging Face names under `model.visual.`) to a [`ParamTable`];
//! [`VisionTower::forward`] turns a forward's [`Images`](super::Images) into the merged image
//! embeddings and the DeepStack features (Qwen3.5's tower is the same without DeepStack).
//!
//! The text decoder's side: [`VlArgs`] (the image tokens and MRoPE sections a `config.json`
//! adds), [`embed`] (the `embed` stage: [`embed_images`] or [`embed_text`]), [`mrope`] (the 3-D
//! positions and the interleaved rotary embedding by them) and [`add_deepstack`].

mod grid;
mod lm;
pub mod mrope;
mod tower;

pub use grid::{block_order, interpolation_taps, merge_order, push_grid_taps, rotary_tables};
pub use lm::{add_deepstack, embed, embed_images, embed_text, placeholder_mask, TextShape, VlArgs};
pub use tower::{attend_within, frames, rotate_half};

use super::{Decl, HfConfig, Param, ParamTable};
use serde::{Deserialize, Serialize};

/// The shape of a Qwen3-VL vision tower (the fields of transformers' `Qwen3VLVisionConfig`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VisionArgs {
    /// Blocks.
    pub depth: usize,
    /// Width of the blocks.
    pub hidden_size: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Width of the blocks' MLP.
    pub intermediate_size: usize,
    /// Width of the merged features (the text model's hidden size).
    pub out_hidden_size: usize,
    /// Pixels per patch side.
    pub patch_size: usize,
    /// Frames per patch.
    pub temporal_patch_size: usize,
    /// Colour channels.
    pub in_channels: usize,
    /// Patches per merged token side (2: four patches make one token).
    pub spatial_merge_size: usize,
    /// Entries of the learned position table (a square grid).
    pub num_position_embeddings: usize,
    /// Blocks after which a DeepStack merger taps the features, in order.
    pub deepstack_visual_indexes: Vec<usize>,
    /// The blocks' MLP activation: `gelu_pytorch_tanh` or `gelu` (erf).
    pub hidden_act: String,
    /// Base of the 2-D rotary frequencies.
    pub rope_theta: f64,
}

impl VisionArgs {
    /// From a Hugging Face `vision_config` object; errors name the key.
    pub fn from_hf(f: &HfConfig<'_>) -> Result<Self, String> {
        let a = VisionArgs {
            depth: f.need_uint("depth")?,
            hidden_size: f.need_uint("hidden_size")?,
            num_heads: f.need_uint("num_heads")?,
            intermediate_size: f.need_uint("intermediate_size")?,
            out_hidden_size: f.need_uint("out_hidden_size")?,
            patch_size: f.uint("patch_size")?.unwrap_or(16),
            temporal_patch_size: f.uint("temporal_patch_size")?.unwrap_or(2),
            in_channels: f.uint("in_channels")?.unwrap_or(3),
            spatial_merge_size: f.uint("spatial_merge_size")?.unwrap_or(2),
            num_position_embeddings: f.uint("num_position_embeddings")?.unwrap_or(2304),
            deepstack_visual_indexes: f.uint_list("deepstack_visual_indexes")?.unwrap_or_default(),
            hidden_act: f
                .str("hidden_act")?
                .unwrap_or("gelu_pytorch_tanh")
                .to_string(),
            // `rope_parameters` names the axial rope, which `HfConfig::rope` does not know.
            rope_theta: match f.float("rope_theta")? {
                Some(t) => t,
                None if f.get("rope_parameters").is_some() => f
                    .object("rope_parameters")?
                    .float("rope_theta")?
                    .unwrap_or(10_000.0),
                None => 10_000.0,
            },
        };
        a.validate()
            .map_err(|e| format!("config.json: vision_config.{e}"))?;
        Ok(a)
    }

    /// Checks the shape; the error starts with the offending key.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("depth", self.depth),
            ("hidden_size", self.hidden_size),
            ("num_heads", self.num_heads),
            ("intermediate_size", self.intermediate_size),
            ("out_hidden_size", self.out_hidden_size),
            ("patch_size", self.patch_size),
            ("temporal_patch_size", self.temporal_patch_size),
            ("in_channels", self.in_channels),
            ("spatial_merge_size", self.spatial_merge_size),
        ];
        for (k, v) in positive {
            if v == 0 {
                return Err(format!("{k} must be at least 1"));
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_heads)
            || !(self.hidden_size / self.num_heads).is_multiple_of(4)
        {
            return Err(format!(
                "num_heads: hidden_size {} over {} heads must give a head dim divisible by 4 \
                 (2-D rotary embedding)",
                self.hidden_size, self.num_heads
            ));
        }
        let side = self.grid_side();
        if side < 2 || side * side != self.num_position_embeddings {
            return Err(format!(
                "num_position_embeddings must be a square of at least 4, got {}",
                self.num_position_embeddings
            ));
        }
        if let Some(&i) = self
            .deepstack_visual_indexes
            .iter()
            .find(|&&i| i >= self.depth)
        {
            return Err(format!(
                "deepstack_visual_indexes: block {i} is past the last of {}",
                self.depth
            ));
        }
        if !matches!(self.hidden_act.as_str(), "gelu_pytorch_tanh" | "gelu") {
            return Err(format!(
                "hidden_act must be gelu_pytorch_tanh or gelu, got '{}'",
                self.hidden_act
            ));
        }
        if self.rope_theta <= 0.0 {
            return Err("rope_theta must be positive".into());
        }
        Ok(())
    }

    /// The `vision_config` of an export, of model type `model_type`; `deepstack`: with
    /// `deepstack_visual_indexes` (Qwen3-VL's; Qwen3.5's config has no such key).
    pub fn hf_config(&self, model_type: &str, deepstack: bool) -> serde_json::Value {
        let mut c = serde_json::json!({
            "model_type": model_type,
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "intermediate_size": self.intermediate_size,
            "out_hidden_size": self.out_hidden_size,
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "in_channels": self.in_channels,
            "spatial_merge_size": self.spatial_merge_size,
            "num_position_embeddings": self.num_position_embeddings,
            "hidden_act": self.hidden_act,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        });
        if deepstack {
            c["deepstack_visual_indexes"] = serde_json::json!(self.deepstack_visual_indexes);
        }
        c
    }

    /// Side of the learned position grid.
    pub fn grid_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt().round() as usize
    }

    /// Head width.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Values per patch row of `pixel_values` (`C·t·p·p`).
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Width of a merged token before the merger's projection (`hidden · m²`).
    pub fn merged_dim(&self) -> usize {
        self.hidden_size * self.spatial_merge_size * self.spatial_merge_size
    }

    /// Parameters of the tower.
    pub fn n_params(&self) -> usize {
        let (h, i, m, o) = (
            self.hidden_size,
            self.intermediate_size,
            self.merged_dim(),
            self.out_hidden_size,
        );
        let merger = |norm: usize| 2 * norm + m * m + m + o * m + o;
        let block = 4 * h + 3 * h * h + 3 * h + h * h + h + 2 * h * i + i + h;
        h * self.patch_dim()
            + h
            + self.num_position_embeddings * h
            + self.depth * block
            + merger(h)
            + self.deepstack_visual_indexes.len() * merger(m)
    }
}

/// One vision block's parameters.
pub struct VisionBlock {
    norm1: (Param, Param),
    norm2: (Param, Param),
    qkv: (Param, Param),
    proj: (Param, Param),
    fc1: (Param, Param),
    fc2: (Param, Param),
}

/// A patch merger's parameters (the final one, or a DeepStack one that normalizes after the
/// 2×2 shuffle).
pub struct Merger {
    norm: (Param, Param),
    fc1: (Param, Param),
    fc2: (Param, Param),
    postshuffle_norm: bool,
}

/// The declared tower: its arguments and parameter handles.
pub struct VisionTower {
    /// Its shape.
    pub args: VisionArgs,
    patch_w: Param,
    patch_b: Param,
    pos_embed: Param,
    blocks: Vec<VisionBlock>,
    merger: Merger,
    deepstack: Vec<Merger>,
}

/// Declares `visual.<name>`, Hugging Face's `model.visual.<name>`.
fn add(
    t: &mut ParamTable,
    name: &str,
    shape: Vec<usize>,
    init: impl FnOnce(Decl) -> Decl,
) -> Param {
    let d = init(Decl::new(&format!("visual.{name}"), shape));
    t.add(d.hf_name(&format!("model.visual.{name}")))
}

/// A `[out, in]` linear layer's weight and bias.
fn linear(t: &mut ParamTable, name: &str, out: usize, inp: usize) -> (Param, Param) {
    let std = (inp as f64).powf(-0.5);
    (
        add(t, &format!("{name}.weight"), vec![out, inp], |d| {
            d.trunc_normal(std)
        }),
        add(t, &format!("{name}.bias"), vec![out], |d| d),
    )
}

/// A LayerNorm's weight (ones) and bias.
fn layer_norm(t: &mut ParamTable, name: &str, n: usize) -> (Param, Param) {
    (
        add(t, &format!("{name}.weight"), vec![n], Decl::ones),
        add(t, &format!("{name}.bias"), vec![n], |d| d),
    )
}

impl VisionTower {
    /// Adds the tower's parameters to `t` as `visual.*`, Hugging Face's `model.visual.*`
    /// (outside any block: the tower runs in the `embed` stage).
    pub fn declare(args: VisionArgs, t: &mut ParamTable) -> Self {
        let a = &args;
        let (h, m) = (a.hidden_size, a.merged_dim());
        let patch_shape = vec![
            h,
            a.in_channels,
            a.temporal_patch_size,
            a.patch_size,
            a.patch_size,
        ];
        let patch_std = (a.patch_dim() as f64).powf(-0.5);
        let patch_w = add(t, "patch_embed.proj.weight", patch_shape, |d| {
            d.trunc_normal(patch_std)
        });
        let patch_b = add(t, "patch_embed.proj.bias", vec![h], |d| d);
        let pos_embed = add(
            t,
            "pos_embed.weight",
            vec![a.num_position_embeddings, h],
            |d| d.normal(0.02),
        );
        let blocks = (0..a.depth)
            .map(|i| {
                let b = format!("blocks.{i}");
                VisionBlock {
                    norm1: layer_norm(t, &format!("{b}.norm1"), h),
                    norm2: layer_norm(t, &format!("{b}.norm2"), h),
                    qkv: linear(t, &format!("{b}.attn.qkv"), 3 * h, h),
                    proj: linear(t, &format!("{b}.attn.proj"), h, h),
                    fc1: linear(t, &format!("{b}.mlp.linear_fc1"), a.intermediate_size, h),
                    fc2: linear(t, &format!("{b}.mlp.linear_fc2"), h, a.intermediate_size),
                }
            })
            .collect();
        let merger = |t: &mut ParamTable, name: &str, post: bool| Merger {
            norm: layer_norm(t, &format!("{name}.norm"), if post { m } else { h }),
            fc1: linear(t, &format!("{name}.linear_fc1"), m, m),
            fc2: linear(t, &format!("{name}.linear_fc2"), a.out_hidden_size, m),
            postshuffle_norm: post,
        };
        let final_merger = merger(t, "merger", false);
        let deepstack = (0..a.deepstack_visual_indexes.len())
            .map(|j| merger(t, &format!("deepstack_merger_list.{j}"), true))
            .collect();
        VisionTower {
            patch_w,
            patch_b,
            pos_embed,
            blocks,
            merger: final_merger,
            deepstack,
            args,
        }
    }
}
