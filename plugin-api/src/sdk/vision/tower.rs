//! The vision tower's forward, in host ops.

use super::grid::{interpolation_taps, merge_order, rotary_tables};
use super::{Merger, VisionBlock, VisionTower};
use crate::sdk::{AttentionOpts, Ctx, Images, Param, Result, Tensor};

/// What the tower makes of a forward's images.
pub struct VisionOutput<'h> {
    /// The merged image embeddings `[tokens, out_hidden_size]`, one row per placeholder token,
    /// image after image.
    pub embeds: Tensor<'h>,
    /// One `[tokens, out_hidden_size]` tensor per DeepStack index, in order.
    pub deepstack: Vec<Tensor<'h>>,
}

/// `x · wᵀ + b`.
fn affine<'h>(ctx: &Ctx<'h>, x: &Tensor<'h>, (w, b): &(Param, Param)) -> Result<Tensor<'h>> {
    x.linear(&ctx.w(w)?)?.add(&ctx.w(b)?)
}

fn norm<'h>(ctx: &Ctx<'h>, x: &Tensor<'h>, (w, b): &(Param, Param)) -> Result<Tensor<'h>> {
    x.layer_norm(&ctx.w(w)?, Some(&ctx.w(b)?), 1e-6)
}

/// Every image's frames as `(h, w)` runs of the patch rows, checked against the pixel rows and
/// the merge size `m`.
pub fn frames(images: &Images<'_>, m: usize, rows: usize) -> Result<Vec<(usize, usize)>> {
    let mut out = vec![];
    for (i, &[t, h, w]) in images.grids.iter().enumerate() {
        if t == 0 || h == 0 || w == 0 || !h.is_multiple_of(m) || !w.is_multiple_of(m) {
            return Err(format!(
                "image {i}: grid ({t}, {h}, {w}) must be positive with h and w multiples of the \
                 merge size {m}"
            )
            .into());
        }
        out.extend(std::iter::repeat_n((h, w), t));
    }
    let total: usize = out.iter().map(|(h, w)| h * w).sum();
    if total != rows {
        return Err(
            format!("pixel_values has {rows} patch rows but the image grids make {total}").into(),
        );
    }
    Ok(out)
}

impl VisionTower {
    /// The merged image embeddings and DeepStack features of `images`.
    pub fn forward<'h>(&self, ctx: &Ctx<'h>, images: &Images<'h>) -> Result<VisionOutput<'h>> {
        let a = &self.args;
        let pixels = &images.pixel_values;
        let shape = pixels.shape()?;
        if shape.len() != 2 || shape[1] != a.patch_dim() {
            return Err(format!(
                "pixel_values must be [patches, {}] (C·t·p·p), got {shape:?}",
                a.patch_dim()
            )
            .into());
        }
        let frames = frames(images, a.spatial_merge_size, shape[0])?;
        let (h, m, side) = (a.hidden_size as i64, a.spatial_merge_size, a.grid_side());
        // Patch embedding: the Conv3d's stride equals its kernel, so it is one product.
        let w = ctx.w(&self.patch_w)?.reshape(&[h, -1])?;
        let mut x = pixels.linear(&w)?.add(&ctx.w(&self.patch_b)?)?;
        // Learned positions, interpolated to each frame's grid, and the rotary tables.
        let (mut idx, mut wts, mut pos) = (vec![], vec![], vec![]);
        for &(fh, fw) in &frames {
            let (i, w) = interpolation_taps(fh, fw, m, side);
            idx.extend(i);
            wts.extend(w);
            pos.extend(merge_order(fh, fw, m));
        }
        let n = pos.len();
        let host = ctx.host;
        let idx = host.constant_i64(&[n, 4], &idx, pixels)?;
        let wts = host.constant_f32(&[n, 4, 1], &wts, pixels)?;
        let pos_embeds = ctx
            .w(&self.pos_embed)?
            .embedding(&idx)?
            .mul(&wts)?
            .sum(&[1], false)?;
        x = x.add(&pos_embeds)?;
        let hd = a.head_dim();
        let (cos, sin) = rotary_tables(&pos, hd, a.rope_theta);
        let cos = host.constant_f32(&[n, 1, hd], &cos, pixels)?;
        let sin = host.constant_f32(&[n, 1, hd], &sin, pixels)?;
        let rot = Rotary { cos, sin };
        let segments: Vec<usize> = frames.iter().map(|(fh, fw)| fh * fw).collect();
        let mut deepstack = vec![];
        for (i, b) in self.blocks.iter().enumerate() {
            x = self.block(ctx, b, &x, &rot, &segments)?;
            if let Some(j) = a.deepstack_visual_indexes.iter().position(|&d| d == i) {
                deepstack.push(self.merge(ctx, &self.deepstack[j], &x)?);
            }
        }
        Ok(VisionOutput {
            embeds: self.merge(ctx, &self.merger, &x)?,
            deepstack,
        })
    }

    /// One pre-norm block: attention inside each frame, then the MLP.
    fn block<'h>(
        &self,
        ctx: &Ctx<'h>,
        b: &VisionBlock,
        x: &Tensor<'h>,
        rot: &Rotary<'h>,
        segments: &[usize],
    ) -> Result<Tensor<'h>> {
        let (n, heads, hd) = (
            x.shape()?[0] as i64,
            self.args.num_heads as i64,
            self.args.head_dim() as i64,
        );
        let qkv = affine(ctx, &norm(ctx, x, &b.norm1)?, &b.qkv)?.reshape(&[n, 3, heads, hd])?;
        let q = rot.apply(&qkv.narrow(1, 0, 1)?.reshape(&[n, heads, hd])?)?;
        let k = rot.apply(&qkv.narrow(1, 1, 1)?.reshape(&[n, heads, hd])?)?;
        let v = qkv.narrow(1, 2, 1)?.reshape(&[n, heads, hd])?;
        let attended = attend_within(ctx, &q, &k, &v, segments)?;
        let attn = affine(ctx, &attended, &b.proj)?;
        let x = x.add(&attn)?;
        let hidden = affine(ctx, &norm(ctx, &x, &b.norm2)?, &b.fc1)?;
        let act = match self.args.hidden_act.as_str() {
            "gelu" => hidden.unary("gelu_erf")?,
            _ => hidden.unary("gelu")?,
        };
        x.add(&affine(ctx, &act, &b.fc2)?)
    }

    /// A patch merger: LayerNorm (before or after gathering each 2×2 block into one row),
    /// then `fc2(GELU(fc1(·)))`.
    fn merge<'h>(&self, ctx: &Ctx<'h>, mg: &Merger, x: &Tensor<'h>) -> Result<Tensor<'h>> {
        let wide = self.args.merged_dim() as i64;
        let rows = if mg.postshuffle_norm {
            norm(ctx, &x.reshape(&[-1, wide])?, &mg.norm)?
        } else {
            norm(ctx, x, &mg.norm)?.reshape(&[-1, wide])?
        };
        affine(
            ctx,
            &affine(ctx, &rows, &mg.fc1)?.unary("gelu_erf")?,
            &mg.fc2,
        )
    }
}

/// Non-causal attention of `q`, `k`, `v` (`[n, heads, head_dim]`) within consecutive segments
/// of `segments` rows (a frame, a window): each attends to itself only. Returns `[n, heads ·
/// head_dim]`.
pub fn attend_within<'h>(
    ctx: &Ctx<'h>,
    q: &Tensor<'h>,
    k: &Tensor<'h>,
    v: &Tensor<'h>,
    segments: &[usize],
) -> Result<Tensor<'h>> {
    let shape = q.shape()?;
    let (heads, hd) = (shape[1] as i64, shape[2] as i64);
    let mut outs = vec![];
    let mut start = 0;
    for &len in segments {
        // [len, H, D] -> [1, H, len, D].
        let part = |t: &Tensor<'h>| {
            t.narrow(0, start, len)?
                .transpose(0, 1)?
                .reshape(&[1, heads, len as i64, hd])
        };
        let positions = ctx
            .host
            .constant_i64(&[len], &(0..len as i64).collect::<Vec<_>>(), q)?;
        let opts = AttentionOpts {
            causal: false,
            ..Default::default()
        };
        let o = part(q)?.attention(&part(k)?, &part(v)?, &positions, &opts)?;
        outs.push(
            o.reshape(&[heads, len as i64, hd])?
                .transpose(0, 1)?
                .reshape(&[len as i64, -1])?,
        );
        start += len;
    }
    let refs: Vec<&Tensor<'h>> = outs.iter().collect();
    ctx.host.cat(&refs, 0)
}

/// `x·cos + rotate_half(x)·sin` on `[patches, heads, head_dim]`, the tables `[patches, 1,
/// head_dim]`: the whole head turns, its halves paired.
pub fn rotate_half<'h>(x: &Tensor<'h>, cos: &Tensor<'h>, sin: &Tensor<'h>) -> Result<Tensor<'h>> {
    let half = x.shape()?[2] / 2;
    let x1 = x.narrow(2, 0, half)?;
    let x2 = x.narrow(2, half, half)?;
    let rotated = x.host().cat(&[&x2.scale(-1.0)?, &x1], 2)?;
    x.mul(cos)?.add(&rotated.mul(sin)?)
}

/// The 2-D rotary tables, `[patches, 1, head_dim]`.
struct Rotary<'h> {
    cos: Tensor<'h>,
    sin: Tensor<'h>,
}

impl<'h> Rotary<'h> {
    /// `x·cos + rotate_half(x)·sin` on `[patches, heads, head_dim]`.
    fn apply(&self, x: &Tensor<'h>) -> Result<Tensor<'h>> {
        rotate_half(x, &self.cos, &self.sin)
    }
}
