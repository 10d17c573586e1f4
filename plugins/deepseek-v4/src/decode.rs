//! Decode caches: what a DeepSeek-V4 attention block keeps in the host between calls of one
//! sequence, so a step costs O(window + compressed blocks) instead of O(prefix).
//!
//! ```text
//! window         keys [B, 1, L, Dh] and positions [B, L] of the recent tokens, from a multiple
//!                of 64 (PAD) before the window's start: L < sliding_window + 64
//! kv.blocks      compressed keys/values [B, n, Dh] of every complete block (CSA, HCA)
//! kv.pending     the compressor's inputs (values, gate logits [B, m, width], positions [B, m])
//!                of the tokens since the last complete block's start: m < 2·rate
//! index.*        the same for the CSA indexer's compressed keys [B, n, Di]
//! ```
//! Per call: the new tokens' keys join the window (then its start moves on by whole 64-token
//! blocks), their compressor inputs join the pending ones, and every block they complete is
//! pooled by the same ops as the training forward, from the same rows, and appended. Every
//! step is batch-invariant arithmetic on the same values as the training forward, so its
//! logits are the training forward's bits (tested in `hf_parity_deepseek_v4`).
//!
//! The bookkeeping reads only shapes (a plugin never sees the host's values), so a per-row
//! batch (continuous batching) stacks rows whose caches have the same shapes; the host's
//! serving loop groups its rows that way.

use crate::attention::PAD;
use crate::spec::Compressor;
use anneal_plugin_api::sdk::{Ctx, Result, Rope, Tensor};

/// Positions `[T]` or `[B, T]` as f32 rows `[B, T]` (`like` is any `[B, T, D]` tensor); f32
/// holds every position below 2²⁴ exactly.
fn rows_of<'h>(pos: &Tensor<'h>, like: &Tensor<'h>) -> Result<Tensor<'h>> {
    let s = like.shape()?;
    let zeros = like
        .narrow(2, 0, 1)?
        .reshape(&[s[0] as i64, s[1] as i64])?
        .scale(0.0)?;
    zeros.add(&pos.to_dtype("f32")?)
}

/// `old` (when cached) then `new`, along `dim`.
fn after<'h>(
    ctx: &Ctx<'h>,
    old: Option<Tensor<'h>>,
    new: &Tensor<'h>,
    dim: i64,
) -> Result<Tensor<'h>> {
    match old {
        Some(old) => ctx.host.cat(&[&old, new], dim),
        None => Ok(new.clone()),
    }
}

impl crate::model::DeepseekV4 {
    /// The window's keys `[B, 1, L, Dh]` and positions (i64 `[B, L]`) for this call: the
    /// cached recent tokens then the new ones `kv [B, 1, T, Dh]` at `pos`. Keeps them for the
    /// next call, without the whole 64-token blocks that have left the window.
    pub(crate) fn cached_window<'h>(
        &self,
        ctx: &Ctx<'h>,
        layer: usize,
        kv: &Tensor<'h>,
        pos: &Tensor<'h>,
    ) -> Result<(Tensor<'h>, Tensor<'h>)> {
        let s = kv.shape()?;
        let (b, t, d) = (s[0] as i64, s[2] as i64, s[3] as i64);
        let new_pos = rows_of(pos, &kv.reshape(&[b, t, d])?)?;
        let keys = after(ctx, ctx.state(layer, "window")?, kv, 2)?;
        let at = after(ctx, ctx.state(layer, "window.pos")?, &new_pos, 1)?;
        // The window starts at a multiple of PAD, so `len - w` tokens before the newest
        // query's window are cached; whole PAD blocks of them can go.
        let (len, w) = (keys.shape()?[2], self.args.sliding_window);
        let drop = len.saturating_sub(w) / PAD * PAD;
        ctx.set_state(layer, "window", &keys.narrow(2, drop, len - drop)?)?;
        ctx.set_state(layer, "window.pos", &at.narrow(1, drop, len - drop)?)?;
        Ok((keys, at.to_dtype("i64")?))
    }

    /// The compressed blocks `[B, n, dim]` of the sequence so far (`None` before the first
    /// completes): [`Self::compress`] over this call's tokens without a cache; with one
    /// (`cached` is the layer), the cached blocks plus those this call's tokens complete,
    /// kept under `name`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn compressed<'h>(
        &self,
        ctx: &Ctx<'h>,
        cached: Option<usize>,
        name: &str,
        c: &Compressor,
        x: &Tensor<'h>,
        pos: &Tensor<'h>,
        dim: usize,
        rate: usize,
        overlap: bool,
        rope: &Rope,
    ) -> Result<Option<Tensor<'h>>> {
        let Some(layer) = cached else {
            return self.compress(ctx, c, x, pos, dim, rate, overlap, rope);
        };
        let key = |part: &str| format!("{name}.{part}");
        let (kv, gate) = self.compressor_inputs(ctx, c, x)?;
        let kv = after(ctx, ctx.state(layer, &key("pending.kv"))?, &kv, 1)?;
        let gate = after(ctx, ctx.state(layer, &key("pending.gate"))?, &gate, 1)?;
        let at = after(
            ctx,
            ctx.state(layer, &key("pending.pos"))?,
            &rows_of(pos, x)?,
            1,
        )?;
        let old = ctx.state(layer, &key("blocks"))?;
        // The pending tokens start at a block's first token: the last complete block's once
        // there is one (CSA pools its first series into the next block; HCA keeps it too, so
        // the pending inputs are never empty), else the sequence's.
        let had = old.as_ref().map_or(Ok(0), |t| t.shape().map(|s| s[1]))?;
        let prev = usize::from(had > 0);
        let m = kv.shape()?[1];
        let complete = m / rate;
        let blocks = if complete > prev {
            let (b, n) = (kv.shape()?[0] as i64, complete as i64);
            let starts = at
                .narrow(1, 0, complete * rate)?
                .reshape(&[b, n, rate as i64])?
                .narrow(2, 0, 1)?
                .reshape(&[b, n])?
                .to_dtype("i64")?;
            let pooled = self.pool(
                ctx, c, &kv, &gate, &starts, complete, dim, rate, overlap, rope,
            )?;
            let fresh = pooled.narrow(1, prev, complete - prev)?;
            Some(ctx.cache_append(layer, &key("blocks"), &fresh, 1)?)
        } else {
            old
        };
        let keep = (complete.saturating_sub(1) * rate).min(m);
        ctx.set_state(layer, &key("pending.kv"), &kv.narrow(1, keep, m - keep)?)?;
        ctx.set_state(
            layer,
            &key("pending.gate"),
            &gate.narrow(1, keep, m - keep)?,
        )?;
        ctx.set_state(layer, &key("pending.pos"), &at.narrow(1, keep, m - keep)?)?;
        Ok(blocks)
    }
}

/// Bytes of positions the caches keep per cached token (f32).
const POS_BYTES: usize = 4;

/// Bytes the decode caches of one sequence hold after `tokens` tokens, with `value_bytes` per
/// cached value (4 for f32): per layer the window (keys and positions of `tokens` less the
/// whole 64-token blocks before the window), and for CSA/HCA layers the compressed blocks,
/// the pending compressor inputs and, for CSA, the indexer's blocks and pending inputs.
pub fn cache_bytes(a: &crate::DeepseekV4Args, tokens: usize, value_bytes: usize) -> usize {
    let window = tokens - tokens.saturating_sub(a.sliding_window) / PAD * PAD;
    let mut total = 0;
    for i in 0..a.n_layers {
        total += window * (a.head_dim * value_bytes + POS_BYTES);
        let kind = a.layer_type(i);
        let Some(rate) = a.rate(kind) else {
            continue;
        };
        let blocks = tokens / rate;
        let pending = tokens - blocks.saturating_sub(1) * rate;
        let series = |dim: usize, overlap: bool| {
            let width = if overlap { 2 * dim } else { dim };
            blocks * dim * value_bytes + pending * (2 * width * value_bytes + POS_BYTES)
        };
        let csa = kind == crate::config::AttentionType::CompressedSparseAttention;
        total += series(a.head_dim, csa);
        if csa {
            total += series(a.index_head_dim, true);
        }
    }
    total
}

/// Bytes a plain KV cache of the same model holds after `tokens` tokens: every layer's keys
/// and values at `head_dim` (one shared head), `value_bytes` each.
pub fn plain_kv_bytes(a: &crate::DeepseekV4Args, tokens: usize, value_bytes: usize) -> usize {
    tokens * a.n_layers * 2 * a.head_dim * value_bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeepseekV4;
    use anneal_plugin_api::sdk::Factory;

    #[test]
    fn the_caches_of_a_fixture_shape_count_by_hand() {
        // tests/fixtures/tiny_deepseek_v4: sliding, CSA (4), HCA (8), CSA layers; head 16,
        // index head 8, window 8; after 89 tokens, f32.
        let args = serde_json::json!({
            "dim": 32, "n_layers": 4, "n_heads": 4, "head_dim": 16, "rope_head_dim": 4,
            "index_head_dim": 8, "csa_rate": 4, "hca_rate": 8, "sliding_window": 8,
            "layer_types": ["sliding_attention", "compressed_sparse_attention",
                            "heavily_compressed_attention", "compressed_sparse_attention"],
            "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        });
        let m = DeepseekV4::create(None, args).unwrap();
        // Window: 89 - 64 = 25 tokens × (16 × 4 + 4) = 1700 per layer.
        // CSA: 22 blocks × 64 + 5 pending × (2 × 32 × 4 + 4) = 1408 + 1300; its indexer
        //      22 × 32 + 5 × (2 × 16 × 4 + 4) = 704 + 660.
        // HCA: 11 blocks × 64 + 9 pending × (2 × 16 × 4 + 4) = 704 + 1188.
        let want = 4 * 1700 + 2 * (1408 + 1300 + 704 + 660) + 704 + 1188;
        assert_eq!(cache_bytes(&m.args, 89, 4), want);
        assert_eq!(want, 16_836);
        assert_eq!(plain_kv_bytes(&m.args, 89, 4), 89 * 4 * 2 * 16 * 4);
    }

    #[test]
    fn the_flash_caches_at_a_million_tokens() {
        let m = DeepseekV4::create(Some("deepseek_v4_flash"), serde_json::json!({})).unwrap();
        let n = 1 << 20;
        let (ours, plain) = (cache_bytes(&m.args, n, 2), plain_kv_bytes(&m.args, n, 2));
        println!(
            "deepseek_v4_flash at {n} tokens, bf16: {ours} bytes ({:.1} per token) vs {plain} \
             ({:.1} per token), {:.1}x smaller",
            ours as f64 / n as f64,
            plain as f64 / n as f64,
            plain as f64 / ours as f64
        );
        // The figures docs/training.md quotes: 6,596 bytes per token against 88,064, 13.4× smaller
        // (20 CSA layers at 512 / 4 + 128 / 4 values per token, 23 HCA at 512 / 128).
        assert_eq!((ours, plain), (6_915_933_824, 92_341_796_864));
    }
}
