//! DeepSeek-V4's attention: one shared key/value head (K = V) over a sliding window of recent
//! tokens plus compressed blocks of the past, with attention sinks.
//!
//! ```text
//! q       = RMSNorm_head(W_qb · RMSNorm(W_qa · x)),  RoPE on each head's trailing dims
//! kv      = RoPE(RMSNorm(W_kv · x))                  the one key/value head
//! C_w     = RoPE_{w·m}(RMSNorm(Σ_j softmax_j(Z_j + B_j) ⊙ V_j))   block w of m tokens
//!           (CSA: the 2m tokens of blocks w-1 and w, two series; HCA: the m of block w)
//! sel(t)  = top-k_w Σ_h w_{t,h} · ReLU(q^I_{t,h} · K^I_w)   (CSA's lightning indexer)
//! o       = RoPE_{-t}(softmax([q·kv_window; q·C_sel(t)] / √Dh, sinks) · [kv_window; C_sel(t)])
//! out     = W_ob · blockdiag_g(W_oa,g) · o              grouped low-rank output projection
//! ```
//! A block is visible to query `t` once all its tokens are at or before `t`. CSA and HCA
//! layers attend through the host's gathered op (`gathered_attention`: each query scores only
//! its window, its blocks and the sink); sliding layers through a score row masked by the host
//! (`compressed_mask`). The indexer's choice passes no gradient, as in transformers.

use crate::config::AttentionType;
use crate::spec::{AttentionParams, Compressor, Indexer};
use anneal_plugin_api::sdk::{
    CompressedMaskOpts, Ctx, GatheredAttentionOpts, Result, Rope, Tensor,
};

/// Attention rows are padded to a multiple of this many columns (see `attend`), and the
/// window's keys to one before the compressed blocks (see `attention`).
pub(crate) const PAD: usize = 64;

/// The position given to padding keys: after every query, so the mask hides them.
const FAR: f64 = (1u64 << 40) as f64;

/// `x · rsqrt(mean(x²) + eps)` over the last dim (no weight).
pub fn unweighted_rms_norm<'h>(x: &Tensor<'h>, eps: f64) -> Result<Tensor<'h>> {
    let ms = x.mul(x)?.mean(&[-1], true)?.affine(1.0, eps)?;
    x.mul(&ms.unary("rsqrt")?)
}

/// RoPE on the trailing `rope.rot_dim` dims of `x [B, H, T, D]` (DeepSeek-V4's `[nope | rope]`
/// head layout, interleaved pairs).
fn rope_tail<'h>(
    ctx: &Ctx<'h>,
    x: &Tensor<'h>,
    pos: &Tensor<'h>,
    rope: &Rope,
) -> Result<Tensor<'h>> {
    let d = *x.shape()?.last().ok_or("rope of a scalar")?;
    let r = rope.rot_dim;
    let rotated = x.narrow(3, d - r, r)?.rope(pos, rope)?;
    if r == d {
        return Ok(rotated);
    }
    ctx.host.cat(&[&x.narrow(3, 0, d - r)?, &rotated], 3)
}

/// The position of each complete block's first token: `pos[w·rate]` for `w < n`.
fn block_positions<'h>(pos: &Tensor<'h>, n: usize, rate: usize) -> Result<Tensor<'h>> {
    let s = pos.shape()?;
    let last = s.len() as i64 - 1;
    let mut grid: Vec<i64> = s[..s.len() - 1].iter().map(|&d| d as i64).collect();
    let flat = grid.clone();
    grid.extend([n as i64, rate as i64]);
    let mut out = flat;
    out.push(n as i64);
    pos.narrow(last, 0, n * rate)?
        .reshape(&grid)?
        .narrow(last + 1, 0, 1)?
        .reshape(&out)
}

impl crate::model::DeepseekV4 {
    /// The RoPE of a block type: the plain one for sliding blocks, the compressed one (its own
    /// base, maybe YaRN) for CSA/HCA blocks, their compressors and indexers.
    pub(crate) fn rope_of(&self, t: AttentionType) -> Rope {
        let a = &self.args;
        let sliding = t == AttentionType::SlidingAttention;
        Rope {
            theta: if sliding {
                a.rope_theta
            } else {
                a.compress_rope_theta
            },
            rot_dim: a.rope_head_dim,
            interleaved: true,
            llama3_scaling: None,
            yarn: if sliding {
                None
            } else {
                a.compress_yarn.clone()
            },
        }
    }

    /// Block `index`'s attention on `x [B, T, D]`.
    pub(crate) fn attention<'h>(
        &self,
        ctx: &Ctx<'h>,
        p: &AttentionParams,
        index: usize,
        x: &Tensor<'h>,
        pos: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let s = x.shape()?;
        let (b, t) = (s[0], s[1]);
        let (h, hd) = (a.n_heads, a.head_dim);
        let kind = a.layer_type(index);
        let rope = self.rope_of(kind);

        let q_latent = x
            .linear(&ctx.w(&p.wq_a)?)?
            .rms_norm(&ctx.w(&p.q_norm)?, a.norm_eps)?;
        let q = q_latent
            .linear(&ctx.w(&p.wq_b)?)?
            .reshape(&[b as i64, t as i64, h as i64, hd as i64])?
            .transpose(1, 2)?;
        let q = rope_tail(ctx, &unweighted_rms_norm(&q, a.norm_eps)?, pos, &rope)?;
        let kv = x
            .linear(&ctx.w(&p.wkv)?)?
            .rms_norm(&ctx.w(&p.kv_norm)?, a.norm_eps)?
            .reshape(&[b as i64, 1, t as i64, hd as i64])?;
        let kv = rope_tail(ctx, &kv, pos, &rope)?;

        let rate = a.rate(kind).unwrap_or(1);
        let overlap = kind == AttentionType::CompressedSparseAttention;
        let cached = ctx.use_cache.then_some(index);
        // The window's keys and positions: a decode step's follow the cached recent ones.
        let (window, window_pos) = match cached {
            Some(layer) => self.cached_window(ctx, layer, &kv, pos)?,
            None => (kv, pos.clone()),
        };
        let blocks = match &p.compressor {
            Some(c) => self.compressed(ctx, cached, "kv", c, x, pos, hd, rate, overlap, &rope)?,
            None => None,
        };
        let index_keys = match &p.indexer {
            Some(ix) => {
                let (c, di) = (&ix.compressor, a.index_head_dim);
                self.compressed(ctx, cached, "index", c, x, pos, di, a.csa_rate, true, &rope)?
            }
            None => None,
        };
        let selected = match (&p.indexer, &index_keys) {
            (Some(ix), Some(keys)) => Some(self.select(ctx, ix, x, pos, &q_latent, keys)?),
            _ => None,
        };
        let o = if a.rate(kind).is_some() {
            // CSA/HCA: each query scores only its window, its blocks and the sink. Every call
            // of a compressed layer goes through this op (also before its first block
            // completes), so a decode step reduces a query's row exactly as training does.
            let len = window.shape()?[2];
            let keys = window.reshape(&[b as i64, len as i64, hd as i64])?;
            let sinks = ctx.w(&p.sinks)?;
            let opts = GatheredAttentionOpts {
                window: a.sliding_window,
                compress_rate: rate,
                scale: Some((hd as f64).powf(-0.5)),
                sinks: Some(&sinks),
                blocks: blocks.as_ref(),
                selected: selected.as_ref(),
            };
            ctx.host
                .gathered_attention(&q, &keys, pos, &window_pos, &opts)?
        } else {
            self.masked(
                ctx,
                p,
                &q,
                window,
                window_pos,
                blocks.as_ref(),
                selected.as_ref(),
                pos,
                rate,
            )?
        };
        // K = V, so the values carry their keys' rotation: undo it at the query's position.
        let back = pos.to_dtype("f32")?.scale(-1.0)?.to_dtype("i64")?;
        let o = rope_tail(ctx, &o, &back, &rope)?;
        self.grouped_output(ctx, p, &o)
    }

    /// The masked formulation: `q` against a score row over every window key and block, the
    /// ones a query may not see masked by the host (`compressed_mask`). Sliding layers use it;
    /// the host's tests of `gathered_attention` check that op against this formulation.
    #[allow(clippy::too_many_arguments)]
    fn masked<'h>(
        &self,
        ctx: &Ctx<'h>,
        p: &AttentionParams,
        q: &Tensor<'h>,
        window: Tensor<'h>,
        window_pos: Tensor<'h>,
        blocks: Option<&Tensor<'h>>,
        selected: Option<&Tensor<'h>>,
        pos: &Tensor<'h>,
        rate: usize,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let (b, hd) = (q.shape()?[0], a.head_dim);
        let n_blocks = blocks.map_or(Ok(0), |c| c.shape().map(|s| s[1]))?;
        // Keys: the window's, zeros up to a multiple of PAD, then the compressed blocks. A
        // key's column modulo PAD is then its position's (the window starts at a multiple of
        // PAD), so a decode step, whose row holds only the recent window and the blocks,
        // reduces its visible columns in the same lanes and order as the training forward;
        // the columns it leaves out are masked there and only add exact zeros.
        let (keys, key_pos) = match &blocks {
            Some(c) => {
                let len = window.shape()?[2];
                let pad = len.next_multiple_of(PAD) - len;
                let zero = window.narrow(2, 0, 1)?.scale(0.0)?;
                let mut k: Vec<&Tensor<'h>> = vec![&window];
                k.extend(std::iter::repeat_n(&zero, pad));
                let c = c.reshape(&[b as i64, 1, n_blocks as i64, hd as i64])?;
                k.push(&c);
                let last = window_pos.shape()?.len() as i64 - 1;
                let never = window_pos
                    .narrow(last, 0, 1)?
                    .to_dtype("f32")?
                    .affine(0.0, FAR)?
                    .to_dtype("i64")?;
                let mut kp: Vec<&Tensor<'h>> = vec![&window_pos];
                kp.extend(std::iter::repeat_n(&never, pad));
                (ctx.host.cat(&k, 2)?, ctx.host.cat(&kp, last)?)
            }
            None => (window, window_pos),
        };
        let mask = ctx.host.compressed_mask(
            pos,
            Some(&key_pos),
            selected,
            &CompressedMaskOpts {
                window: Some(a.sliding_window),
                compress_rate: rate,
                n_blocks,
                interleaved: false,
            },
        )?;
        self.attend(ctx, p, q, &keys, &mask)
    }

    /// `softmax(q·kᵀ/√Dh + mask, with sinks)·k` for `q [B, H, T, Dh]` over the one shared head
    /// `keys [B, 1, S, Dh]` and `mask [B | 1, T, S]`.
    fn attend<'h>(
        &self,
        ctx: &Ctx<'h>,
        p: &AttentionParams,
        q: &Tensor<'h>,
        keys: &Tensor<'h>,
        mask: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let qs = q.shape()?;
        let (b, h, t, hd) = (qs[0] as i64, qs[1] as i64, qs[2] as i64, qs[3] as i64);
        let s = keys.shape()?[2] as i64;
        // All heads share the key head: one product over H·T query rows.
        let raw = q
            .reshape(&[b, 1, h * t, hd])?
            .matmul(&keys.transpose(2, 3)?)?
            .reshape(&[b, h, t, s])?
            .scale((a.head_dim as f64).powf(-0.5))?;
        let mb = mask.shape()?[0] as i64;
        let masked = raw.add(&mask.reshape(&[mb, 1, t, s])?)?;
        // The softmax row and the values' reduction run over a whole number of 64-column
        // blocks, the sink in the last column (a zero value): a decode step, which sees a
        // shorter row laid out alike (see `attention`), then reduces its visible columns in the
        // same lanes and order as the training forward, whose extra columns only add exact
        // zeros. The constant columns
        // are built from a finite column of the scores so they have its shape.
        let total = (s as usize + 1).div_ceil(PAD) * PAD;
        let pad = total - s as usize - 1;
        let col = raw.narrow(3, 0, 1)?;
        let sinks = ctx.w(&p.sinks)?.reshape(&[1, h, 1, 1])?;
        let sink_col = col.scale(0.0)?.add(&sinks)?;
        let never = col.affine(0.0, f64::NEG_INFINITY)?;
        let mut logits: Vec<&Tensor<'h>> = vec![&masked];
        logits.extend(std::iter::repeat_n(&never, pad));
        logits.push(&sink_col);
        let probs = ctx.host.cat(&logits, 3)?.softmax(3)?;
        let zero = keys.narrow(2, 0, 1)?.scale(0.0)?;
        let mut values: Vec<&Tensor<'h>> = vec![keys];
        values.extend(std::iter::repeat_n(&zero, pad + 1));
        probs
            .reshape(&[b, 1, h * t, total as i64])?
            .matmul(&ctx.host.cat(&values, 2)?)?
            .reshape(&[b, h, t, hd])
    }

    /// `W_ob · [W_oa,g · o_g]_g` for `o [B, H, T, Dh]`: heads in `o_groups` groups, each
    /// projected to `o_lora_rank` by its own matrix, then mixed to the hidden size.
    fn grouped_output<'h>(
        &self,
        ctx: &Ctx<'h>,
        p: &AttentionParams,
        o: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let s = o.shape()?;
        let (b, t) = (s[0] as i64, s[2] as i64);
        let g = a.o_groups as i64;
        let per = (a.n_heads * a.head_dim) as i64 / g;
        let r = a.o_lora_rank as i64;
        let w = ctx.w(&p.wo_a)?.reshape(&[g, r, per])?.transpose(1, 2)?;
        o.transpose(1, 2)?
            .reshape(&[b * t, g, per])?
            .transpose(0, 1)?
            .matmul(&w)?
            .transpose(0, 1)?
            .reshape(&[b, t, g * r])?
            .linear(&ctx.w(&p.wo_b)?)
    }

    /// The compressor's two projections of `x [B, T, D]`: values and gate logits `[B, T,
    /// width]` (width `2·dim` with `overlap`, two series).
    pub(crate) fn compressor_inputs<'h>(
        &self,
        ctx: &Ctx<'h>,
        c: &Compressor,
        x: &Tensor<'h>,
    ) -> Result<(Tensor<'h>, Tensor<'h>)> {
        Ok((x.linear(&ctx.w(&c.wkv)?)?, x.linear(&ctx.w(&c.wgate)?)?))
    }

    /// The complete blocks of `rate` tokens of `x [B, T, D]` pooled to `[B, n, dim]` (`None`
    /// when there is none yet).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn compress<'h>(
        &self,
        ctx: &Ctx<'h>,
        c: &Compressor,
        x: &Tensor<'h>,
        pos: &Tensor<'h>,
        dim: usize,
        rate: usize,
        overlap: bool,
        rope: &Rope,
    ) -> Result<Option<Tensor<'h>>> {
        let n = x.shape()?[1] / rate;
        if n == 0 {
            return Ok(None);
        }
        let (kv, gate) = self.compressor_inputs(ctx, c, x)?;
        let at = block_positions(pos, n, rate)?;
        self.pool(ctx, c, &kv, &gate, &at, n, dim, rate, overlap, rope)
            .map(Some)
    }

    /// The first `n` blocks of `rate` tokens of the compressor inputs `kv`, `gate` `[B, ≥ n·rate,
    /// width]` pooled to `[B, n, dim]`, block `w` rotated to its first token's position `at[w]`.
    /// With `overlap` (CSA), block `w` pools its own tokens' second series with block `w-1`'s
    /// first series (block 0's missing half weighs nothing).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pool<'h>(
        &self,
        ctx: &Ctx<'h>,
        c: &Compressor,
        kv: &Tensor<'h>,
        gate: &Tensor<'h>,
        at: &Tensor<'h>,
        n: usize,
        dim: usize,
        rate: usize,
        overlap: bool,
        rope: &Rope,
    ) -> Result<Tensor<'h>> {
        let b = kv.shape()?[0];
        let width = if overlap { 2 * dim } else { dim };
        let grid = [b as i64, n as i64, rate as i64, width as i64];
        let kv = kv.narrow(1, 0, n * rate)?.reshape(&grid)?;
        let gate = gate
            .narrow(1, 0, n * rate)?
            .reshape(&grid)?
            .add(&ctx.w(&c.ape)?)?;
        let (kv, gate) = if overlap {
            let prev = |x: &Tensor<'h>, fill: Tensor<'h>| -> Result<Tensor<'h>> {
                let first = x.narrow(3, 0, dim)?;
                if n == 1 {
                    return Ok(fill);
                }
                ctx.host.cat(&[&fill, &first.narrow(1, 0, n - 1)?], 1)
            };
            let first_kv = kv.narrow(1, 0, 1)?.narrow(3, 0, dim)?;
            let first_gate = gate.narrow(1, 0, 1)?.narrow(3, 0, dim)?;
            let kv_prev = prev(&kv, first_kv.scale(0.0)?)?;
            let gate_prev = prev(&gate, first_gate.affine(0.0, f64::NEG_INFINITY)?)?;
            (
                ctx.host.cat(&[&kv_prev, &kv.narrow(3, dim, dim)?], 2)?,
                ctx.host.cat(&[&gate_prev, &gate.narrow(3, dim, dim)?], 2)?,
            )
        } else {
            (kv, gate)
        };
        let pooled = kv
            .mul(&gate.softmax(2)?)?
            .sum(&[2], false)?
            .rms_norm(&ctx.w(&c.norm)?, self.args.norm_eps)?
            .reshape(&[b as i64, 1, n as i64, dim as i64])?;
        rope_tail(ctx, &pooled, at, rope)?.reshape(&[b as i64, n as i64, dim as i64])
    }

    /// The lightning indexer: for each query of `x [B, T, D]`, the `index_topk` best of the
    /// compressed index keys `keys [B, n, Di]` (i64 `[B, T, k]`; blocks not yet complete may
    /// fill the tail when fewer are, and the mask drops them).
    fn select<'h>(
        &self,
        ctx: &Ctx<'h>,
        ix: &Indexer,
        x: &Tensor<'h>,
        pos: &Tensor<'h>,
        q_latent: &Tensor<'h>,
        keys: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let a = &self.args;
        let s = x.shape()?;
        let (b, t) = (s[0] as i64, s[1] as i64);
        let n = keys.shape()?[1];
        let (hi, di) = (a.index_n_heads as i64, a.index_head_dim);
        let rope = self.rope_of(AttentionType::CompressedSparseAttention);
        let q = q_latent
            .linear(&ctx.w(&ix.wq_b)?)?
            .reshape(&[b, t, hi, di as i64])?
            .transpose(1, 2)?;
        let q = rope_tail(ctx, &q, pos, &rope)?.transpose(1, 2)?;
        let scores = q
            .reshape(&[b, t * hi, di as i64])?
            .matmul(&keys.transpose(1, 2)?)?
            .reshape(&[b, t, hi, n as i64])?
            .unary("relu")?
            .scale((di as f64).powf(-0.5))?;
        let weights = x
            .linear(&ctx.w(&ix.weights_proj)?)?
            .scale((hi as f64).powf(-0.5))?
            .reshape(&[b, t, hi, 1])?;
        let future = ctx.host.compressed_mask(
            pos,
            None,
            None,
            &CompressedMaskOpts {
                window: None,
                compress_rate: a.csa_rate,
                n_blocks: n,
                interleaved: false,
            },
        )?;
        let (_, chosen) = scores
            .mul(&weights)?
            .sum(&[2], false)?
            .add(&future)?
            .topk(a.index_topk.min(n), 2)?;
        Ok(chosen)
    }
}
