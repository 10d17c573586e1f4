//! Kimi K2.7's vision tower (MoonViT3d, transformers' `kimi_k25`) and its projector, in host
//! ops: patches embedded by one product, the learned 2-D position grid resampled bicubically to
//! each image's grid, pre-norm blocks attending within each image with 2-D RoPE on pairs of
//! channels, the patches of each `kh × kw` block gathered into one row, then the projector into
//! the decoder's width. Weights keep the released checkpoints' layout (a fused, RoPE-interleaved
//! `wqkv`), so the rotation turns adjacent channel pairs.
//!
//! ```text
//! x = W_p · pixels + b + Σ_taps w · P[tap]
//! x = x + W_o · Attn(RoPE₂(q, k), v), x = x + fc2(GELU_tanh(fc1(LN₂(x))))   q, k, v = W_qkv · LN₁(x)
//! y = W_out · GELU(W_in · rows(LN_pre(LN_final(x))) + b) + b                 rows: kh·kw patches
//! ```

use anneal_plugin_api::sdk::kit::blocks::Proj;
use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::vision::{attend_within, block_order, frames, push_grid_taps};
use anneal_plugin_api::sdk::{
    Ctx, Decl, HfConfig, HfMap, Images, Init, Param, ParamTable, Result, Tensor,
};
use serde::{Deserialize, Serialize};

/// MoonViT3d's shapes (`vision_config`) and the projector's (top level).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct MoonVitArgs {
    /// Patch side in pixels.
    #[arg(hf = "patch_size", default = 14, min = 1)]
    pub patch_size: usize,
    /// Rows of the learned position grid.
    #[arg(hf = "pos_emb_height", default = 64, min = 1)]
    pub pos_emb_height: usize,
    /// Columns of the learned position grid.
    #[arg(hf = "pos_emb_width", default = 64, min = 1)]
    pub pos_emb_width: usize,
    /// Frames of the temporal table (videos, which this tower does not take yet).
    #[arg(hf = "pos_emb_time", default = 4)]
    pub pos_emb_time: usize,
    /// Heads.
    #[arg(hf = "num_attention_heads", default = 16, min = 1)]
    pub num_heads: usize,
    /// Blocks.
    #[arg(hf = "num_hidden_layers", default = 27, min = 1)]
    pub depth: usize,
    /// Width.
    #[arg(hf = "hidden_size", default = 1152, min = 1)]
    pub hidden_size: usize,
    /// Hidden size of each block's MLP.
    #[arg(hf = "intermediate_size", default = 4304, min = 1)]
    pub intermediate_size: usize,
    /// The MLP's activation.
    #[arg(hf = "hidden_act", default = "gelu_pytorch_tanh".into(), one_of("gelu_pytorch_tanh", "gelu"))]
    pub hidden_act: String,
    /// Patches merged into one decoder token, `[rows, columns]`.
    #[arg(hf = "merge_kernel_size", default = vec![2, 2])]
    pub merge_kernel_size: Vec<usize>,
    /// The base of the 2-D RoPE (`rope_parameters.rope_theta`).
    #[arg(positive)]
    pub rope_theta: f64,
    /// The projector's LayerNorm width (`projection_hidden_size`, top level).
    pub projection_hidden_size: usize,
    /// The projector's LayerNorm epsilon (`projection_layer_norm_eps`, top level).
    pub projection_layer_norm_eps: f64,
    /// The image placeholder token (`image_token_id`, top level).
    pub image_token_id: usize,
    /// The video placeholder token (`video_token_id`, top level).
    pub video_token_id: usize,
    /// Before an image's placeholders (`vision_start_token_id`, top level).
    pub vision_start_token_id: usize,
    /// After them (`vision_end_token_id`, top level).
    pub vision_end_token_id: usize,
}

impl MoonVitArgs {
    /// transformers' `Kimi_K25Config()` tower and tokens.
    pub fn released() -> Self {
        MoonVitArgs {
            patch_size: 14,
            pos_emb_height: 64,
            pos_emb_width: 64,
            pos_emb_time: 4,
            num_heads: 16,
            depth: 27,
            hidden_size: 1152,
            intermediate_size: 4304,
            hidden_act: "gelu_pytorch_tanh".into(),
            merge_kernel_size: vec![2, 2],
            rope_theta: 10_000.0,
            projection_hidden_size: 1152,
            projection_layer_norm_eps: 1e-5,
            image_token_id: 163_605,
            video_token_id: 163_840,
            vision_start_token_id: 163_602,
            vision_end_token_id: 163_604,
        }
    }

    /// The tower of a `kimi_k25` `config.json` (`top`).
    pub fn from_top(top: &HfConfig<'_>) -> Result<Self, String> {
        let v = top.object("vision_config")?;
        let mut a = MoonVitArgs::from_hf(&v)?;
        a.rope_theta = match v.get("rope_parameters") {
            Some(_) => v.object("rope_parameters")?.float("rope_theta")?,
            None => None,
        }
        .unwrap_or(10_000.0);
        a.projection_hidden_size = top.uint("projection_hidden_size")?.unwrap_or(a.hidden_size);
        a.projection_layer_norm_eps = top.float("projection_layer_norm_eps")?.unwrap_or(1e-5);
        a.image_token_id = top.uint("image_token_id")?.unwrap_or(163_605);
        a.video_token_id = top.uint("video_token_id")?.unwrap_or(163_840);
        a.vision_start_token_id = top.uint("vision_start_token_id")?.unwrap_or(163_602);
        a.vision_end_token_id = top.uint("vision_end_token_id")?.unwrap_or(163_604);
        Ok(a)
    }

    /// The top level's keys and `vision_config` for export.
    pub fn to_top(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut vision = self.to_hf();
        vision.insert("model_type".into(), "kimi_k25_vision".into());
        vision.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "axial", "rope_theta": self.rope_theta}),
        );
        let mut top = serde_json::Map::new();
        top.insert("vision_config".into(), vision.into());
        for (k, v) in [
            ("projection_hidden_size", self.projection_hidden_size.into()),
            (
                "projection_layer_norm_eps",
                self.projection_layer_norm_eps.into(),
            ),
            ("image_token_id", self.image_token_id.into()),
            ("video_token_id", self.video_token_id.into()),
            ("vision_start_token_id", self.vision_start_token_id.into()),
            ("vision_end_token_id", self.vision_end_token_id.into()),
        ] {
            top.insert(k.into(), v);
        }
        top
    }

    /// Checks the shapes fit together and the decoder's vocabulary.
    pub fn validate(&self, vocab_size: usize) -> Result<(), String> {
        self.check_at("vision.")?;
        if self.merge_kernel_size.len() != 2 || self.merge_kernel_size.contains(&0) {
            return Err(format!(
                "vision.merge_kernel_size must be two sizes ≥ 1, got {:?}",
                self.merge_kernel_size
            ));
        }
        let hd = self.hidden_size / self.num_heads;
        if !self.hidden_size.is_multiple_of(self.num_heads) || !hd.is_multiple_of(4) {
            return Err(format!(
                "vision.hidden_size ({}) over vision.num_heads ({}) must be a multiple of 4 (2-D RoPE)",
                self.hidden_size, self.num_heads
            ));
        }
        if self.projection_hidden_size != self.hidden_size {
            return Err(format!(
                "projection_hidden_size ({}) must equal vision.hidden_size ({})",
                self.projection_hidden_size, self.hidden_size
            ));
        }
        if self.image_token_id >= vocab_size {
            return Err(format!(
                "image_token_id ({}) must be below vocab_size ({vocab_size})",
                self.image_token_id
            ));
        }
        Ok(())
    }

    fn kernel(&self) -> (usize, usize) {
        (self.merge_kernel_size[0], self.merge_kernel_size[1])
    }
}

/// A LayerNorm's gain and bias.
type LayerNorm = (Param, Param);

/// One block.
pub struct Block {
    norm1: LayerNorm,
    qkv: [Proj; 3],
    proj: Proj,
    norm2: LayerNorm,
    mlp: [Proj; 2],
}

/// The tower's and projector's parameters.
pub struct MoonVit {
    patch: Proj,
    positions: Param,
    blocks: Vec<Block>,
    final_norm: LayerNorm,
    pre_norm: LayerNorm,
    in_proj: Proj,
    out_proj: Proj,
}

impl MoonVit {
    /// Declares the tower under the released checkpoints' names.
    pub fn declare(t: &mut ParamTable, v: &MoonVitArgs, text_dim: usize) -> Self {
        let h = v.hidden_size;
        let p = v.patch_size;
        let enc = "vision_tower.encoder";
        let patch = proj(pair(
            t,
            "vision.patch_embed",
            vec![h, 3, p, p],
            &format!("{enc}.patch_embed.proj"),
        ));
        let blocks = (0..v.depth)
            .map(|j| {
                let (ours, theirs) = (format!("vision.layers.{j}"), format!("{enc}.blocks.{j}"));
                let norm1 = pair(
                    t,
                    &format!("{ours}.norm1"),
                    vec![h],
                    &format!("{theirs}.norm0"),
                );
                // q, k and v are thirds of the fused `wqkv`.
                let mut third = |name: &str, i: usize| {
                    let hf = |what: &str| {
                        HfMap::one(format!("{theirs}.wqkv.{what}")).part(0, i, 3, false)
                    };
                    let bias = add(t, &format!("{ours}.attn.{name}.bias"), vec![h], hf("bias"));
                    let weight = add(
                        t,
                        &format!("{ours}.attn.{name}.weight"),
                        vec![h, h],
                        hf("weight"),
                    );
                    Proj {
                        weight,
                        bias: Some(bias),
                    }
                };
                let qkv = [third("q", 0), third("k", 1), third("v", 2)];
                let attn_proj = pair(
                    t,
                    &format!("{ours}.attn.proj"),
                    vec![h, h],
                    &format!("{theirs}.wo"),
                );
                let norm2 = pair(
                    t,
                    &format!("{ours}.norm2"),
                    vec![h],
                    &format!("{theirs}.norm1"),
                );
                let fc1 = pair(
                    t,
                    &format!("{ours}.mlp.fc1"),
                    vec![v.intermediate_size, h],
                    &format!("{theirs}.mlp.fc0"),
                );
                let fc2 = pair(
                    t,
                    &format!("{ours}.mlp.fc2"),
                    vec![h, v.intermediate_size],
                    &format!("{theirs}.mlp.fc1"),
                );
                Block {
                    norm1,
                    qkv,
                    proj: proj(attn_proj),
                    norm2,
                    mlp: [proj(fc1), proj(fc2)],
                }
            })
            .collect();
        let positions = add(
            t,
            "vision.pos_emb",
            vec![v.pos_emb_height, v.pos_emb_width, h],
            HfMap::one("vision_tower.patch_embed.pos_emb.weight"),
        );
        let final_norm = pair(
            t,
            "vision.final_layernorm",
            vec![h],
            &format!("{enc}.final_layernorm"),
        );
        let wide = h * v.kernel().0 * v.kernel().1;
        let pre_norm = pair(
            t,
            "mm_projector.pre_norm",
            vec![h],
            "model.mm_projector.pre_norm",
        );
        let in_proj = proj(pair(
            t,
            "mm_projector.in_proj",
            vec![wide, wide],
            "mm_projector.proj.0",
        ));
        let out_proj = proj(pair(
            t,
            "mm_projector.out_proj",
            vec![text_dim, wide],
            "mm_projector.proj.2",
        ));
        MoonVit {
            patch,
            positions,
            blocks,
            final_norm,
            pre_norm,
            in_proj,
            out_proj,
        }
    }

    /// The projected image embeddings `[tokens, text_dim]` of `images`, image after image.
    pub fn forward<'h>(
        &self,
        ctx: &Ctx<'h>,
        a: &MoonVitArgs,
        images: &Images<'h>,
    ) -> Result<Tensor<'h>> {
        let pixels = &images.pixel_values;
        let shape = pixels.shape()?;
        let patch_dim = 3 * a.patch_size * a.patch_size;
        if shape.len() != 2 || shape[1] != patch_dim {
            return Err(format!(
                "pixel_values must be [patches, {patch_dim}] (C·p·p), got {shape:?}"
            )
            .into());
        }
        if images.grids.iter().any(|g| g[0] != 1) {
            return Err("videos (grids with t > 1) are not supported by this tower yet".into());
        }
        let (kh, kw) = a.kernel();
        if images
            .grids
            .iter()
            .any(|g| g[1] % kh != 0 || g[2] % kw != 0)
        {
            return Err(
                format!("image grids must be multiples of the merge kernel {kh} × {kw}").into(),
            );
        }
        let frames = frames(images, 1, shape[0])?;
        let host = ctx.host;
        let h = a.hidden_size as i64;
        let w = ctx.w(&self.patch.weight)?.reshape(&[h, -1])?;
        let mut x = pixels
            .linear(&w)?
            .add(&ctx.w(self.patch.bias.as_ref().ok_or("patch bias")?)?)?;
        let (mut idx, mut wts, mut raster) = (vec![], vec![], vec![]);
        for &(fh, fw) in &frames {
            bicubic_taps(fh, fw, a.pos_emb_height, &mut idx, &mut wts);
            raster.extend((0..fh * fw).map(|k| (k / fw, k % fw)));
        }
        let n = raster.len();
        let idx = host.constant_i64(&[n, 16], &idx, pixels)?;
        let wts = host.constant_f32(&[n, 16, 1], &wts, pixels)?;
        let table = ctx.w(&self.positions)?.reshape(&[-1, h])?;
        x = x.add(&table.embedding(&idx)?.mul(&wts)?.sum(&[1], false)?)?;
        let hd = a.hidden_size / a.num_heads;
        let (cos, sin) = pair_tables(&raster, hd, a.rope_theta);
        let cos = host.constant_f32(&[n, 1, hd / 2, 1], &cos, pixels)?;
        let sin = host.constant_f32(&[n, 1, hd / 2, 1], &sin, pixels)?;
        let segments: Vec<usize> = frames.iter().map(|(fh, fw)| fh * fw).collect();
        for b in &self.blocks {
            x = self.block(ctx, a, b, &x, (&cos, &sin), &segments)?;
        }
        let layer_norm = |x: &Tensor<'h>, (w, b): &LayerNorm, eps| {
            x.layer_norm(&ctx.w(w)?, Some(&ctx.w(b)?), eps)
        };
        let x = layer_norm(&x, &self.final_norm, 1e-5)?;
        let order = block_order(&frames, kh, kw);
        let order = host.constant_i64(&[n], &order, pixels)?;
        let rows = layer_norm(
            &x.index_select(0, &order)?,
            &self.pre_norm,
            a.projection_layer_norm_eps,
        )?
        .reshape(&[-1, h * (kh * kw) as i64])?;
        let hidden = self.in_proj.apply(ctx, &rows)?.unary("gelu_erf")?;
        self.out_proj.apply(ctx, &hidden)
    }

    fn block<'h>(
        &self,
        ctx: &Ctx<'h>,
        a: &MoonVitArgs,
        b: &Block,
        x: &Tensor<'h>,
        (cos, sin): (&Tensor<'h>, &Tensor<'h>),
        segments: &[usize],
    ) -> Result<Tensor<'h>> {
        let (heads, hd) = (a.num_heads as i64, (a.hidden_size / a.num_heads) as i64);
        let n = x.shape()?[0] as i64;
        let layer_norm = |x: &Tensor<'h>, (w, bias): &LayerNorm| {
            x.layer_norm(&ctx.w(w)?, Some(&ctx.w(bias)?), 1e-5)
        };
        let normed = layer_norm(x, &b.norm1)?;
        let heads_of = |p: &Proj| p.apply(ctx, &normed)?.reshape(&[n, heads, hd]);
        // Adjacent channels (2i, 2i + 1) turn together by angle i.
        let turn = |t: Tensor<'h>| -> Result<Tensor<'h>> {
            let pairs = t.reshape(&[n, heads, hd / 2, 2])?;
            let (even, odd) = (pairs.narrow(3, 0, 1)?, pairs.narrow(3, 1, 1)?);
            let e = even.mul(cos)?.sub(&odd.mul(sin)?)?;
            let o = odd.mul(cos)?.add(&even.mul(sin)?)?;
            t.host().cat(&[&e, &o], 3)?.reshape(&[n, heads, hd])
        };
        let [wq, wk, wv] = &b.qkv;
        let q = turn(heads_of(wq)?)?;
        let k = turn(heads_of(wk)?)?;
        let v = heads_of(wv)?;
        let x = x.add(
            &b.proj
                .apply(ctx, &attend_within(ctx, &q, &k, &v, segments)?)?,
        )?;
        let [fc1, fc2] = &b.mlp;
        let act = if a.hidden_act == "gelu" {
            "gelu_erf"
        } else {
            "gelu"
        };
        let hidden = fc1.apply(ctx, &layer_norm(&x, &b.norm2)?)?.unary(act)?;
        x.add(&fc2.apply(ctx, &hidden)?)
    }
}

/// One of the tower's parameters, replicated under tensor parallelism (the tower is small beside
/// the decoder): zero biases, unit LayerNorm gains, truncated normal matrices.
fn add(t: &mut ParamTable, name: &str, shape: Vec<usize>, hf: HfMap) -> Param {
    let decl = Decl::new(name, shape.clone()).hf(hf).replicated();
    t.add(match (shape.len(), name.ends_with(".bias")) {
        (1, true) => decl.init(Init::Zeros),
        (1, false) => decl.ones(),
        _ => decl.trunc_normal(0.02),
    })
}

/// A weight of `shape` and its bias, named `{name}.weight` / `.bias` (`{hf}.…` in checkpoints).
fn pair(t: &mut ParamTable, name: &str, shape: Vec<usize>, hf: &str) -> (Param, Param) {
    let bias = add(
        t,
        &format!("{name}.bias"),
        vec![shape[0]],
        HfMap::one(format!("{hf}.bias")),
    );
    let weight = add(
        t,
        &format!("{name}.weight"),
        shape,
        HfMap::one(format!("{hf}.weight")),
    );
    (weight, bias)
}

fn proj((weight, bias): (Param, Param)) -> Proj {
    Proj {
        weight,
        bias: Some(bias),
    }
}

/// Bicubic taps (Keys' kernel, a = −0.75; half-pixel centres; taps past the edge clamped to it)
/// of target index `i` on an axis of `size` into a table side of `side`.
fn axis_taps(i: usize, size: usize, side: usize) -> ([usize; 4], [f32; 4]) {
    let a = -0.75f32;
    let src = (i as f32 + 0.5) * side as f32 / size as f32 - 0.5;
    let floor = src.floor();
    let (mut taps, mut weights) = ([0; 4], [0.0; 4]);
    for (k, offset) in (-1i64..3).enumerate() {
        let d = (src - floor - offset as f32).abs();
        weights[k] = if d <= 1.0 {
            ((a + 2.0) * d - (a + 3.0)) * d * d + 1.0
        } else {
            ((a * d - 5.0 * a) * d + 8.0 * a) * d - 4.0 * a
        };
        taps[k] = (floor as i64 + offset).clamp(0, side as i64 - 1) as usize;
    }
    (taps, weights)
}

/// The 16 taps into the position grid of each patch of an `h × w` frame, in raster order.
fn bicubic_taps(h: usize, w: usize, side: usize, idx: &mut Vec<i64>, wts: &mut Vec<f32>) {
    for k in 0..h * w {
        push_grid_taps(
            side,
            axis_taps(k / w, h, side),
            axis_taps(k % w, w, side),
            idx,
            wts,
        );
    }
}

/// The rotation tables `[n, 1, head_dim / 2, 1]` of the patches at `(row, col)`: channel pair
/// `2j` turns by `col · f_j`, pair `2j + 1` by `row · f_j`, over a quarter of the frequencies.
fn pair_tables(pos: &[(usize, usize)], head_dim: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let spatial = head_dim / 2;
    let inv: Vec<f32> = (0..spatial / 2)
        .map(|j| 1.0 / (theta as f32).powf((2 * j) as f32 / spatial as f32))
        .collect();
    let (mut cos, mut sin) = (vec![], vec![]);
    for &(r, c) in pos {
        for f in &inv {
            for p in [c, r] {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
    }
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bicubic_taps_keep_cells_at_the_same_size_and_sum_to_one() {
        let (t, w) = axis_taps(2, 4, 4);
        assert_eq!((t[1], w[1]), (2, 1.0));
        assert!(w[0].abs() < 1e-6 && w[2].abs() < 1e-6 && w[3].abs() < 1e-6);
        let (_, w) = axis_taps(0, 8, 4);
        assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }
}
