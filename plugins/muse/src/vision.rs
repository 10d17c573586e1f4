//! Muse Glimmer's vision tower, in host ops: patches embedded by one product, learned 2-D
//! positions resampled bilinearly to each image's grid, blocks of pre-norm attention over
//! windows of the position table's size (every 4th block and the last over the whole frame)
//! with 2-D axial RoPE, the patches merged `m × m` into one row, then the adapter and the
//! projection into the decoder's width, normed without a gain.
//!
//! ```text
//! x = LN_pre(W_p · pixels + Σ_taps w · P[tap])          in window order
//! x = x + Proj(Attn(RoPE₂(q, k), v)), x = x + fc2(GELU(fc1(LN₂(x))))   per block, q, k, v of LN₁(x)
//! y = RMSNorm(W_proj · GELU(fc2(GELU(fc1(Shuffle(LN_post(x)))))))      no gain
//! ```

use crate::config::VisionArgs;
use anneal_plugin_api::sdk::kit::blocks::{scaleless_rms_norm, Proj};
use anneal_plugin_api::sdk::vision::{
    attend_within, block_order, frames, push_grid_taps, rotate_half,
};
use anneal_plugin_api::sdk::{Ctx, Images, Param, Result, Tensor};

/// A LayerNorm's gain and bias.
pub type LayerNorm = (Param, Param);

/// One block of the tower.
pub struct Block {
    /// Before attention.
    pub norm1: LayerNorm,
    /// Queries, keys and values, with biases.
    pub qkv: [Proj; 3],
    /// Attention's output projection, with a bias.
    pub proj: Proj,
    /// Before the MLP.
    pub norm2: LayerNorm,
    /// The MLP's two layers, with biases.
    pub mlp: [Proj; 2],
}

/// The tower's, adapter's and projection's parameters.
pub struct Tower {
    /// `[hidden, temporal · 3 · p · p]`, no bias.
    pub patch: Param,
    /// The learned positions `[pos_h · pos_w, hidden]`.
    pub positions: Param,
    /// After the patch and position embeddings.
    pub ln_pre: LayerNorm,
    /// The blocks.
    pub blocks: Vec<Block>,
    /// Before the merge.
    pub ln_post: LayerNorm,
    /// The adapter's two layers, no biases.
    pub adapter: [Param; 2],
    /// Into the decoder's width, no bias.
    pub projection: Param,
}

fn layer_norm<'h>(
    ctx: &Ctx<'h>,
    x: &Tensor<'h>,
    (w, b): &LayerNorm,
    eps: f64,
) -> Result<Tensor<'h>> {
    x.layer_norm(&ctx.w(w)?, Some(&ctx.w(b)?), eps)
}

/// Bilinear taps (half-pixel centres, out-of-range taps weighing nothing) of target index
/// `i` on an axis of `size` into a table side of `side`.
fn axis_taps(i: usize, size: usize, side: usize) -> ([usize; 2], [f32; 2]) {
    let src = (i as f32 + 0.5) * side as f32 / size as f32 - 0.5;
    let floor = src.floor();
    let mut taps = [0; 2];
    let mut weights = [0.0; 2];
    for k in 0..2 {
        let raw = floor as i64 + k as i64;
        let w = (1.0 - (src - floor - k as f32).abs()).max(0.0);
        taps[k] = raw.clamp(0, side as i64 - 1) as usize;
        weights[k] = if raw >= 0 && raw < side as i64 {
            w
        } else {
            0.0
        };
    }
    (taps, weights)
}

/// The four taps into the position table of each patch of an `h × w` frame, in raster order.
/// The reference passes the grid as `(w, h)`, so patch `k` is read at row `k / h`, column
/// `k % h` of a `w × h` target (the same as `(k / w, k % w)` for the square grids it is
/// trained on).
fn position_taps(h: usize, w: usize, side: usize, idx: &mut Vec<i64>, wts: &mut Vec<f32>) {
    for k in 0..h * w {
        push_grid_taps(
            side,
            axis_taps(k / h, w, side),
            axis_taps(k % h, h, side),
            idx,
            wts,
        );
    }
}

/// The order that groups each frame's patches by window of `win × win` (row-major windows,
/// row-major inside), and the windows' lengths; patch indices count across frames.
fn window_order(frames: &[(usize, usize)], win: usize) -> (Vec<usize>, Vec<usize>) {
    let (mut order, mut lens, mut base) = (vec![], vec![], 0);
    for &(h, w) in frames {
        for wr in 0..h.div_ceil(win) {
            for wc in 0..w.div_ceil(win) {
                let start = order.len();
                for r in wr * win..((wr + 1) * win).min(h) {
                    for c in wc * win..((wc + 1) * win).min(w) {
                        order.push(base + r * w + c);
                    }
                }
                lens.push(order.len() - start);
            }
        }
        base += h * w;
    }
    (order, lens)
}

/// The 2-D axial rotary tables `[n, 1, head_dim]` of the patches at `(row, col)`: positions
/// `(col + 1, row + 1)` (the reference's flip and offset) each turn a quarter of the
/// frequencies, repeated over both halves.
fn rotary(pos: &[(usize, usize)], head_dim: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let spatial = head_dim / 2;
    let inv: Vec<f32> = (0..spatial / 2)
        .map(|j| 1.0 / (theta as f32).powf((2 * j) as f32 / spatial as f32))
        .collect();
    let (mut cos, mut sin) = (vec![], vec![]);
    for &(r, c) in pos {
        let angles: Vec<f32> = [c + 1, r + 1]
            .iter()
            .flat_map(|&p| inv.iter().map(move |f| p as f32 * f))
            .collect();
        for _ in 0..2 {
            cos.extend(angles.iter().map(|a| a.cos()));
            sin.extend(angles.iter().map(|a| a.sin()));
        }
    }
    (cos, sin)
}

impl Tower {
    /// The merged image embeddings `[tokens, text_dim]` of `images`, image after image.
    pub fn forward<'h>(
        &self,
        ctx: &Ctx<'h>,
        a: &VisionArgs,
        text_eps: f64,
        images: &Images<'h>,
    ) -> Result<Tensor<'h>> {
        let pixels = &images.pixel_values;
        let shape = pixels.shape()?;
        let patch_dim = a.patch_temporal * 3 * a.patch_size * a.patch_size;
        if shape.len() != 2 || shape[1] != patch_dim {
            return Err(format!(
                "pixel_values must be [patches, {patch_dim}] (t·C·p·p), got {shape:?}"
            )
            .into());
        }
        let m = a.merge_size;
        let frames = frames(images, m, shape[0])?;
        let host = ctx.host;
        let (mut idx, mut wts, mut raster) = (vec![], vec![], vec![]);
        for &(h, w) in &frames {
            position_taps(h, w, a.pos_emb_height, &mut idx, &mut wts);
            raster.extend((0..h * w).map(|k| (k / w, k % w)));
        }
        let n = raster.len();
        let idx = host.constant_i64(&[n, 4], &idx, pixels)?;
        let wts = host.constant_f32(&[n, 4, 1], &wts, pixels)?;
        let pos = ctx
            .w(&self.positions)?
            .embedding(&idx)?
            .mul(&wts)?
            .sum(&[1], false)?;
        let x = pixels.linear(&ctx.w(&self.patch)?)?.add(&pos)?;
        let x = layer_norm(ctx, &x, &self.ln_pre, a.layer_norm_eps)?;
        // Blocks run in window order; full attention spans each frame, which stays contiguous.
        let (order, windows) = window_order(&frames, a.pos_emb_height);
        let order_t = host.constant_i64(
            &[n],
            &order.iter().map(|&i| i as i64).collect::<Vec<_>>(),
            pixels,
        )?;
        let mut x = x.index_select(0, &order_t)?;
        let hd = a.hidden_size / a.num_heads;
        let ordered: Vec<(usize, usize)> = order.iter().map(|&i| raster[i]).collect();
        let (cos, sin) = rotary(&ordered, hd, a.rope_theta);
        let cos = host.constant_f32(&[n, 1, hd], &cos, pixels)?;
        let sin = host.constant_f32(&[n, 1, hd], &sin, pixels)?;
        let whole: Vec<usize> = frames.iter().map(|(h, w)| h * w).collect();
        for (i, b) in self.blocks.iter().enumerate() {
            let full = match a.layer_types.get(i) {
                Some(t) => t == "full_attention",
                None => (i + 1) % 4 == 0 || i + 1 == a.depth,
            };
            let segments = if full { &whole } else { &windows };
            x = self.block(ctx, a, b, &x, (&cos, &sin), segments)?;
        }
        let mut back = vec![0i64; n];
        for (k, &i) in order.iter().enumerate() {
            back[i] = k as i64;
        }
        let x = x.index_select(0, &host.constant_i64(&[n], &back, pixels)?)?;
        let x = layer_norm(ctx, &x, &self.ln_post, a.layer_norm_eps)?;
        let merge = host.constant_i64(&[n], &block_order(&frames, m, m), pixels)?;
        let (h, mm) = (a.hidden_size as i64, (m * m) as i64);
        // Each block's m² rows into one row, channel-major (`[.., d · m² + j]`).
        let merged = x
            .index_select(0, &merge)?
            .reshape(&[-1, mm, h])?
            .transpose(1, 2)?
            .reshape(&[-1, h * mm])?;
        let [fc1, fc2] = &self.adapter;
        let adapted = merged
            .linear(&ctx.w(fc1)?)?
            .unary("gelu_erf")?
            .linear(&ctx.w(fc2)?)?
            .unary("gelu_erf")?;
        let projected = adapted.linear(&ctx.w(&self.projection)?)?;
        scaleless_rms_norm(ctx, &projected, text_eps)
    }

    /// One pre-norm block: attention inside each segment, then the MLP.
    fn block<'h>(
        &self,
        ctx: &Ctx<'h>,
        a: &VisionArgs,
        b: &Block,
        x: &Tensor<'h>,
        (cos, sin): (&Tensor<'h>, &Tensor<'h>),
        segments: &[usize],
    ) -> Result<Tensor<'h>> {
        let heads = a.num_heads as i64;
        let hd = (a.hidden_size / a.num_heads) as i64;
        let n = x.shape()?[0] as i64;
        let normed = layer_norm(ctx, x, &b.norm1, 1e-5)?;
        let heads_of = |p: &Proj| p.apply(ctx, &normed)?.reshape(&[n, heads, hd]);
        let [wq, wk, wv] = &b.qkv;
        let q = rotate_half(&heads_of(wq)?, cos, sin)?;
        let k = rotate_half(&heads_of(wk)?, cos, sin)?;
        let v = heads_of(wv)?;
        let attended = attend_within(ctx, &q, &k, &v, segments)?;
        let x = x.add(&b.proj.apply(ctx, &attended)?)?;
        let [fc1, fc2] = &b.mlp;
        let hidden = fc1
            .apply(ctx, &layer_norm(ctx, &x, &b.norm2, 1e-5)?)?
            .unary("gelu_erf")?;
        x.add(&fc2.apply(ctx, &hidden)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_cover_each_frame_once_in_window_order() {
        // A 4 × 6 frame with windows of 4: a 4 × 4 window, then a 4 × 2 one; then a 2 × 2 frame.
        let (order, lens) = window_order(&[(4, 6), (2, 2)], 4);
        assert_eq!(lens, [16, 8, 4]);
        assert_eq!(&order[..5], &[0, 1, 2, 3, 6]);
        assert_eq!(&order[16..18], &[4, 5]);
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, (0..28).collect::<Vec<_>>());
    }

    #[test]
    fn bilinear_taps_match_half_pixel_resampling() {
        // The same size: each patch reads its own cell at full weight.
        let (t, w) = axis_taps(2, 4, 4);
        assert_eq!((t[0], w[0], w[1]), (2, 1.0, 0.0));
        // Upsampling 2 -> 4: the first target sits a quarter cell before cell 0's centre.
        let (t, w) = axis_taps(0, 4, 2);
        assert_eq!((t, w), ([0, 0], [0.0, 0.75]));
        assert_eq!(block_order(&[(2, 4)], 2, 2), [0, 1, 4, 5, 2, 3, 6, 7]);
    }
}
