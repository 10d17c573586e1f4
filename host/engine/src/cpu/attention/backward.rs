//! Attention backward (FlashAttention-2 style): scores are recomputed tile by tile from `q`, `k`
//! and the saved logsumexp, with `delta = rowsum(dO ∘ O)` computed first.
//!
//! Two schedules, chosen from sizes only (so results never depend on the thread count):
//! - grouped (enough batch × kv heads to keep threads busy): one task per (batch, kv head) owns
//!   `dK`/`dV` of that head and `dQ` of its query heads, so everything runs in one sweep;
//! - split (few batch × kv heads, e.g. one long sequence): `dK`/`dV` run as one task per key
//!   block, then `dQ` as one task per query block, recomputing the probabilities in each pass.

use super::{dot, exp_sub_sum, mm, scores, softmax_grad, BlockRanges, Dims, Tile, BK, BQ};
use crate::cpu::finish;
use crate::cpu::simd;
use crate::error::Result;
use crate::ops::{AttentionGrads, AttentionSpec};
use crate::storage::Storage;
use crate::{DType, Tensor};
use rayon::prelude::*;

/// Below this many (batch, kv head) pairs the split schedule runs.
const GROUPED_MIN_TASKS: usize = 8;

/// Backward: gradients for q, k, v (and sinks) from the forward's output and logsumexp.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: Option<&Tensor>,
    out: &Tensor,
    lse: &Tensor,
    grad: &Tensor,
    spec: &AttentionSpec,
) -> Result<AttentionGrads> {
    let dm = Dims::of(q, k, v);
    let g = dm.group();
    let (qd, kd, vd) = (q.contig::<f32>(), k.contig::<f32>(), v.contig::<f32>());
    let (od, ld, gd) = (
        out.contig::<f32>(),
        lse.contig::<f32>(),
        grad.contig::<f32>(),
    );
    let br = BlockRanges::new(spec);
    let mut dq = Storage::zeros(DType::F32, q.numel());
    let mut dk = Storage::zeros(DType::F32, k.numel());
    let mut dv = Storage::zeros(DType::F32, v.numel());
    let (dq_all, dk_all, dv_all) = (
        dq.as_mut_slice::<f32>(),
        dk.as_mut_slice::<f32>(),
        dv.as_mut_slice::<f32>(),
    );
    let rows = dm.b * dm.hq * dm.tq;
    let mut delta = vec![0f32; rows];
    if dm.dv > 0 {
        delta.par_chunks_mut(BQ).enumerate().for_each(|(c, dl)| {
            for (i, x) in dl.iter_mut().enumerate() {
                let r = (c * BQ + i) * dm.dv;
                *x = dot(&gd[r..r + dm.dv], &od[r..r + dm.dv]);
            }
        });
    }
    if rows > 0 && dm.tk > 0 && dm.dv > 0 {
        let ctx = Ctx {
            dm,
            spec,
            br: &br,
            q: &qd,
            k: &kd,
            v: &vd,
            go: &gd,
            lse: &ld,
            delta: &delta,
        };
        if dm.b * dm.hkv >= GROUPED_MIN_TASKS {
            dq_all
                .par_chunks_mut(g * dm.tq * dm.d)
                .zip(dk_all.par_chunks_mut(dm.tk * dm.d))
                .zip(dv_all.par_chunks_mut(dm.tk * dm.dv))
                .enumerate()
                .for_each(|(bk, ((dq_g, dk_h), dv_h))| {
                    let mut t = Scratch::new(spec);
                    for (gi, dq_h) in dq_g.chunks_mut(dm.tq * dm.d).enumerate() {
                        let bh = bk * g + gi;
                        for kb in 0..dm.tk.div_ceil(BK) {
                            let (dk_j, dv_j) = key_rows(dm, kb, dk_h, dv_h);
                            for (qb, dq_i) in dq_h.chunks_mut(BQ * dm.d).enumerate() {
                                ctx.tile(&mut t, bh, qb, kb, Some(dq_i), Some((dk_j, dv_j)));
                            }
                        }
                    }
                });
        } else {
            // dK, dV: one task per key block of each (batch, kv head).
            dk_all
                .par_chunks_mut(dm.tk * dm.d)
                .zip(dv_all.par_chunks_mut(dm.tk * dm.dv))
                .enumerate()
                .for_each(|(bk, (dk_h, dv_h))| {
                    dk_h.par_chunks_mut(BK * dm.d)
                        .zip(dv_h.par_chunks_mut(BK * dm.dv))
                        .enumerate()
                        .for_each(|(kb, (dk_j, dv_j))| {
                            let mut t = Scratch::new(spec);
                            for gi in 0..g {
                                for qb in 0..dm.tq.div_ceil(BQ) {
                                    let kv = Some((&mut *dk_j, &mut *dv_j));
                                    ctx.tile(&mut t, bk * g + gi, qb, kb, None, kv);
                                }
                            }
                        });
                });
            // dQ: one task per query block of each (batch, query head).
            dq_all
                .par_chunks_mut(dm.tq * dm.d)
                .enumerate()
                .for_each(|(bh, dq_h)| {
                    dq_h.par_chunks_mut(BQ * dm.d)
                        .enumerate()
                        .for_each(|(qb, dq_i)| {
                            let mut t = Scratch::new(spec);
                            for kb in 0..dm.tk.div_ceil(BK) {
                                ctx.tile(&mut t, bh, qb, kb, Some(&mut *dq_i), None);
                            }
                        });
                });
        }
    }
    let dsinks = match sinks {
        None => None,
        Some(s) => {
            // d/dsink_h = -Σ_rows p_sink · delta, with p_sink = exp(sink_h - lse).
            let sv = s.to_vec_f32();
            let mut total = vec![0f32; dm.hq];
            for (r, (&l, &dl)) in ld.iter().zip(&delta).enumerate() {
                let h = (r / dm.tq.max(1)) % dm.hq;
                total[h] -= simd::exp(sv[h] - l) * dl;
            }
            Some(finish(Storage::from_slice(&total), &[dm.hq], s.dtype())?)
        }
    };
    Ok(AttentionGrads {
        q: finish(dq, q.shape(), q.dtype())?,
        k: finish(dk, k.shape(), k.dtype())?,
        v: finish(dv, v.shape(), v.dtype())?,
        sinks: dsinks,
    })
}

/// The `dK`/`dV` rows of key block `kb` within one head's gradients.
fn key_rows<'a>(
    dm: Dims,
    kb: usize,
    dk_h: &'a mut [f32],
    dv_h: &'a mut [f32],
) -> (&'a mut [f32], &'a mut [f32]) {
    let (k0, k1) = (kb * BK, ((kb + 1) * BK).min(dm.tk));
    (
        &mut dk_h[k0 * dm.d..k1 * dm.d],
        &mut dv_h[k0 * dm.dv..k1 * dm.dv],
    )
}

/// Per-task tile buffers.
struct Scratch {
    p: Vec<f32>,
    dp: Vec<f32>,
    dcap: Vec<f32>,
}

impl Scratch {
    fn new(spec: &AttentionSpec) -> Scratch {
        Scratch {
            p: vec![0f32; BQ * BK],
            dp: vec![0f32; BQ * BK],
            dcap: if spec.softcap.is_some() {
                vec![0f32; BQ * BK]
            } else {
                Vec::new()
            },
        }
    }
}

/// Everything the tiles read: contiguous f32 inputs and per-row statistics.
struct Ctx<'a> {
    dm: Dims,
    spec: &'a AttentionSpec,
    br: &'a BlockRanges,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    go: &'a [f32],
    lse: &'a [f32],
    delta: &'a [f32],
}

impl Ctx<'_> {
    /// One (query block, key block) tile of (batch·query head) `bh`: accumulates into the query
    /// block's `dq` rows and/or the key block's `(dk, dv)` rows.
    fn tile(
        &self,
        t: &mut Scratch,
        bh: usize,
        qb: usize,
        kb: usize,
        dq: Option<&mut [f32]>,
        dkv: Option<(&mut [f32], &mut [f32])>,
    ) {
        let spec = self.spec;
        let tile = self.br.tile(spec, qb, kb);
        if tile == Tile::Hidden {
            return;
        }
        let Dims {
            d, dv: dvd, tq, tk, ..
        } = self.dm;
        let bk = bh / self.dm.group();
        let (q0, k0) = (qb * BQ, kb * BK);
        let (rows, cols) = (BQ.min(tq - q0), BK.min(tk - k0));
        let row0 = bh * tq + q0;
        let q_blk = &self.q[row0 * d..(row0 + rows) * d];
        let go_blk = &self.go[row0 * dvd..(row0 + rows) * dvd];
        let key0 = bk * tk + k0;
        let k_blk = &self.k[key0 * d..(key0 + cols) * d];
        let v_blk = &self.v[key0 * dvd..(key0 + cols) * dvd];
        let (p, dp) = (&mut t.p, &mut t.dp);
        scores(
            false,
            p,
            &mut t.dcap,
            q_blk,
            k_blk,
            d,
            rows,
            cols,
            spec,
            tile,
            q0,
            k0,
        );
        for r in 0..rows {
            let l = self.lse[row0 + r];
            let row = &mut p[r * BK..r * BK + cols];
            if l == f32::NEG_INFINITY {
                row.fill(0.0);
            } else {
                exp_sub_sum(row, l);
            }
        }
        // SAFETY (all mm calls below): p and dp hold rows × BK; q_blk rows × d; go_blk rows × dv;
        // k_blk, v_blk cols × d / dv; destinations are asserted to fit and are buffers distinct
        // from every operand.
        let mut dkv = dkv;
        if let Some((dk, dv)) = dkv.as_mut() {
            assert!(dk.len() >= cols * d && dv.len() >= cols * dvd);
            // dV_j += Pᵀ dO_i
            unsafe {
                mm(
                    cols,
                    dvd,
                    rows,
                    dv.as_mut_ptr(),
                    dvd,
                    true,
                    p.as_ptr(),
                    1,
                    BK,
                    go_blk.as_ptr(),
                    dvd,
                    1,
                    1.0,
                );
            }
        }
        // dP = dO_i V_jᵀ
        unsafe {
            mm(
                rows,
                cols,
                dvd,
                dp.as_mut_ptr(),
                BK,
                false,
                go_blk.as_ptr(),
                dvd,
                1,
                v_blk.as_ptr(),
                1,
                dvd,
                1.0,
            );
        }
        for r in 0..rows {
            let dc = if t.dcap.is_empty() {
                &[][..]
            } else {
                &t.dcap[r * BK..r * BK + cols]
            };
            softmax_grad(
                &p[r * BK..r * BK + cols],
                &mut dp[r * BK..r * BK + cols],
                self.delta[row0 + r],
                dc,
            );
        }
        if let Some(dq) = dq {
            assert!(dq.len() >= rows * d);
            // dQ_i += scale · dS K_j
            unsafe {
                mm(
                    rows,
                    d,
                    cols,
                    dq.as_mut_ptr(),
                    d,
                    true,
                    dp.as_ptr(),
                    BK,
                    1,
                    k_blk.as_ptr(),
                    d,
                    1,
                    spec.scale,
                );
            }
        }
        if let Some((dk, _)) = dkv {
            // dK_j += scale · dSᵀ Q_i
            unsafe {
                mm(
                    cols,
                    d,
                    rows,
                    dk.as_mut_ptr(),
                    d,
                    true,
                    dp.as_ptr(),
                    1,
                    BK,
                    q_blk.as_ptr(),
                    d,
                    1,
                    spec.scale,
                );
            }
        }
    }
}
