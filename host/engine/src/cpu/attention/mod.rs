//! Fused attention kernels, FlashAttention-2 style.
//!
//! Forward: for each (batch, query head, query block) an online softmax runs over key blocks
//! (`S = Q Kᵀ`, running max and sum, `O += P V` with `gemm`), keeping the per-row logsumexp.
//! Keys and values are read in place when each head's rows are contiguous (a KV cache with room
//! to grow), so a decode step does not copy the cache. In batch-invariant mode the scores are
//! row-by-row dot products and `P V` runs on the packed kernel (see [`forward`]).
//! Backward: for each (batch, kv head) the scores are recomputed block by block from `q`, `k`
//! and the saved logsumexp; `dK`/`dV` of a key block accumulate over every query block and every
//! query head sharing the kv head, in a fixed order. Key blocks that the causal / window mask
//! hides entirely are skipped, so memory is `O(block²)` per task and work follows the mask.
//!
//! Determinism: tasks own disjoint output rows and loop in a fixed order, so results do not
//! depend on the thread count.

mod backward;

pub(crate) use backward::backward;

use super::finish;
use super::simd::{self, simd_kernel};
use crate::error::Result;
use crate::ops::AttentionSpec;
use crate::storage::Storage;
use crate::{DType, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

/// Query rows per block.
const BQ: usize = 64;
/// Key rows per block.
const BK: usize = 64;

#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    hq: usize,
    hkv: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
}

impl Dims {
    fn of(q: &Tensor, k: &Tensor, v: &Tensor) -> Dims {
        let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
        Dims {
            b: qs[0],
            hq: qs[1],
            hkv: ks[1],
            tq: qs[2],
            tk: ks[2],
            d: qs[3],
            dv: vs[3],
        }
    }
    fn group(&self) -> usize {
        self.hq / self.hkv
    }
}

/// How a mask meets one (query block, key block) tile.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tile {
    /// Every key hidden from every query: skip.
    Hidden,
    /// Every key visible to every query: no per-element mask.
    Open,
    /// Mixed: mask element by element.
    Partial,
}

/// Per-block position ranges, so tiles are classified without scanning positions.
struct BlockRanges {
    q: Vec<(i64, i64)>,
    k: Vec<(i64, i64)>,
}

fn ranges(pos: &[i64], block: usize) -> Vec<(i64, i64)> {
    pos.chunks(block)
        .map(|c| {
            let lo = c.iter().copied().min().unwrap_or(0);
            let hi = c.iter().copied().max().unwrap_or(0);
            (lo, hi)
        })
        .collect()
}

impl BlockRanges {
    fn new(spec: &AttentionSpec) -> BlockRanges {
        BlockRanges {
            q: ranges(&spec.q_pos, BQ),
            k: ranges(&spec.k_pos, BK),
        }
    }

    fn tile(&self, spec: &AttentionSpec, qb: usize, kb: usize) -> Tile {
        let causal = spec.causal || spec.window.is_some();
        if !causal {
            return Tile::Open;
        }
        let ((qlo, qhi), (klo, khi)) = (self.q[qb], self.k[kb]);
        let w = spec.window.map(|w| w as i64);
        let hidden = klo > qhi || w.is_some_and(|w| khi <= qlo - w);
        let open = khi <= qlo && w.is_none_or(|w| klo > qhi - w);
        if hidden {
            Tile::Hidden
        } else if open {
            Tile::Open
        } else {
            Tile::Partial
        }
    }
}

/// `dst[m, n] (+)= beta * a[m, k] @ b[k, n]` on raw strided f32 data, single-threaded.
///
/// # Safety
/// Every element addressed by the shapes and (row, column) strides lies inside its allocation,
/// and `dst` does not alias `a` or `b`.
#[allow(clippy::too_many_arguments)]
unsafe fn mm(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    b_rs: usize,
    b_cs: usize,
    beta: f32,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        accumulate,
        a,
        a_cs as isize,
        a_rs as isize,
        b,
        b_cs as isize,
        b_rs as isize,
        1.0,
        beta,
        false,
        false,
        false,
        Parallelism::None,
    );
}

simd_kernel! {
    /// The largest value (-inf for an empty row).
    fn row_max(x: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; 16];
        let mut chunks = x.chunks_exact(16);
        for c in &mut chunks {
            for l in 0..16 {
                acc[l] = acc[l].max(c[l]);
            }
        }
        for (l, &v) in chunks.remainder().iter().enumerate() {
            acc[l] = acc[l].max(v);
        }
        acc.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
    }
}

simd_kernel! {
    /// `x = exp(x - m)` in place; returns the sum.
    fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
        let mut acc = [0f32; 16];
        let mut chunks = x.chunks_exact_mut(16);
        for c in &mut chunks {
            for l in 0..16 {
                c[l] = simd::exp(c[l] - m);
                acc[l] += c[l];
            }
        }
        for (l, v) in chunks.into_remainder().iter_mut().enumerate() {
            *v = simd::exp(*v - m);
            acc[l] += *v;
        }
        acc.iter().sum()
    }
}

simd_kernel! {
    /// `x = cap * tanh(x / cap)`; when `dcap` is given it receives `1 - tanh²` (the derivative).
    fn soft_cap(x: &mut [f32], cap: f32, dcap: &mut [f32]) {
        let inv = 1.0 / cap;
        let keep = !dcap.is_empty();
        for (i, v) in x.iter_mut().enumerate() {
            let t = 1.0 - 2.0 / (simd::exp(2.0 * *v * inv) + 1.0);
            *v = cap * t;
            if keep {
                dcap[i] = 1.0 - t * t;
            }
        }
    }
}

simd_kernel! {
    /// `x *= s`.
    fn scale_row(x: &mut [f32], s: f32) {
        for v in x.iter_mut() {
            *v *= s;
        }
    }
}

simd_kernel! {
    /// `ds = p * (dp - delta) [* dcap]`, written over `dp`.
    fn softmax_grad(p: &[f32], dp: &mut [f32], delta: f32, dcap: &[f32]) {
        if dcap.is_empty() {
            for (g, &pv) in dp.iter_mut().zip(p) {
                *g = pv * (*g - delta);
            }
        } else {
            for ((g, &pv), &c) in dp.iter_mut().zip(p).zip(dcap) {
                *g = pv * (*g - delta) * c;
            }
        }
    }
}

simd_kernel! {
    /// `sum(a * b)`.
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; 16];
        let mut ca = a.chunks_exact(16);
        let mut cb = b.chunks_exact(16);
        for (x, y) in (&mut ca).zip(&mut cb) {
            for l in 0..16 {
                acc[l] += x[l] * y[l];
            }
        }
        for (l, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
            acc[l] += x * y;
        }
        acc.iter().sum()
    }
}

/// Sets hidden entries of a partial tile to -inf.
fn mask_tile(
    s: &mut [f32],
    stride: usize,
    spec: &AttentionSpec,
    q0: usize,
    k0: usize,
    cols: usize,
) {
    for (r, row) in s.chunks_mut(stride).enumerate() {
        let qp = spec.q_pos[q0 + r];
        for (c, v) in row[..cols].iter_mut().enumerate() {
            if !spec.visible(qp, spec.k_pos[k0 + c]) {
                *v = f32::NEG_INFINITY;
            }
        }
    }
}

/// Scores of one tile: `s = softcap(scale · Q Kᵀ)` masked, `rows × cols` with row stride `BK`.
/// With `invariant`, the products run on the packed kernel, whose result for a row does not
/// depend on the rows around it (see [`forward`]).
#[allow(clippy::too_many_arguments)]
fn scores(
    invariant: bool,
    s: &mut [f32],
    dcap: &mut [f32],
    q: &[f32],
    k: &[f32],
    d: usize,
    rows: usize,
    cols: usize,
    spec: &AttentionSpec,
    tile: Tile,
    q0: usize,
    k0: usize,
) {
    assert!(q.len() >= rows * d && k.len() >= cols * d && s.len() >= rows * BK);
    if invariant {
        invariant_scores(s, q, k, d, rows, cols, spec.scale);
    } else {
        // SAFETY: the assert bounds q (rows × d), k (cols × d, read transposed) and s (rows × BK).
        unsafe {
            mm(
                rows,
                cols,
                d,
                s.as_mut_ptr(),
                BK,
                false,
                q.as_ptr(),
                d,
                1,
                k.as_ptr(),
                1,
                d,
                spec.scale,
            );
        }
    }
    if let Some(cap) = spec.softcap {
        for r in 0..rows {
            let dc = if dcap.is_empty() {
                &mut [][..]
            } else {
                &mut dcap[r * BK..r * BK + cols]
            };
            soft_cap(&mut s[r * BK..r * BK + cols], cap, dc);
        }
    }
    if tile == Tile::Partial {
        mask_tile(&mut s[..rows * BK], BK, spec, q0, k0, cols);
    }
}

simd_kernel! {
    /// `out[c] = scale · (q · k_c)` for `out.len()` keys (rows of `k`, `d` values each): 16 lane
    /// sums over `d` folded by a fixed pairwise tree, so a score's bits depend on its query and
    /// key only, never on how many rows or keys are scored together.
    fn row_scores(q: &[f32], k: &[f32], d: usize, scale: f32, out: &mut [f32]) {
        let q = &q[..d];
        for (c, o) in out.iter_mut().enumerate() {
            let kr = &k[c * d..(c + 1) * d];
            let mut acc = [0f32; 16];
            let mut cq = q.chunks_exact(16);
            let mut ck = kr.chunks_exact(16);
            for (x, y) in (&mut cq).zip(&mut ck) {
                for l in 0..16 {
                    acc[l] += x[l] * y[l];
                }
            }
            for (l, (x, y)) in cq.remainder().iter().zip(ck.remainder()).enumerate() {
                acc[l] += x * y;
            }
            let mut width = 8;
            while width > 0 {
                for l in 0..width {
                    acc[l] += acc[l + width];
                }
                width /= 2;
            }
            *o = scale * acc[0];
        }
    }
}

/// `s[r·BK + c] = scale · (q_r · k_c)` in batch-invariant mode: row by row with
/// [`row_scores`], so a decode step (one query) costs one pass over the keys and gets the bits
/// the same query gets inside a prefill.
fn invariant_scores(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    d: usize,
    rows: usize,
    cols: usize,
    scale: f32,
) {
    for (r, dst) in s.chunks_mut(BK).take(rows).enumerate() {
        row_scores(&q[r * d..(r + 1) * d], k, d, scale, &mut dst[..cols]);
    }
}

/// `o[rows × dv] += p[rows × cols] (row stride BK) · v[cols × dv]` on the packed kernel.
fn invariant_pv(o: &mut [f32], p: &[f32], v: &[f32], rows: usize, cols: usize, dv: usize) {
    use super::sgemm::{sgemm_into, MatRef};
    let pa = MatRef {
        data: p,
        off: 0,
        rs: BK,
        cs: 1,
    };
    let vb = MatRef {
        data: v,
        off: 0,
        rs: dv,
        cs: 1,
    };
    sgemm_into(
        rows,
        dv,
        cols,
        pa,
        vb,
        None,
        &mut o[..rows * dv],
        true,
        false,
    );
}

/// Forward: returns the output (`q`'s dtype) and the f32 logsumexp `[B, Hq, Tq]`.
///
/// In batch-invariant mode (on the calling thread) and on CPUs with the packed kernel, the
/// two products of each tile run on it: a query row then gets the same bits whether it is
/// computed with 63 other rows in a prefill or alone in a decode step, so no padding is needed.
/// Key blocks stay aligned to index 0, and the extra keys a prefill's tile holds are masked to
/// exact zeros that change no sum.
pub(crate) fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: Option<&Tensor>,
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor)> {
    let dm = Dims::of(q, k, v);
    let invariant = invariant_kernels();
    let qd = q.contig::<f32>();
    let ((kd, k_base), (vd, v_base)) = (head_blocks(k), head_blocks(v));
    let sink_vals: Option<Vec<f32>> = sinks.map(|s| s.to_vec_f32());
    let br = BlockRanges::new(spec);
    let mut out = Storage::any(DType::F32, dm.b * dm.hq * dm.tq * dm.dv);
    let mut lse = Storage::zeros(DType::F32, dm.b * dm.hq * dm.tq);
    let (o_all, l_all) = (out.as_mut_slice::<f32>(), lse.as_mut_slice::<f32>());
    if !o_all.is_empty() {
        let (qd, kd, vd) = (&qd[..], &kd[..], &vd[..]);
        o_all
            .par_chunks_mut(dm.tq * dm.dv)
            .zip(l_all.par_chunks_mut(dm.tq))
            .enumerate()
            .for_each(|(bh, (o_bh, l_bh))| {
                let (b, h) = (bh / dm.hq, bh % dm.hq);
                let hk = h / dm.group();
                let q_bh = &qd[bh * dm.tq * dm.d..(bh + 1) * dm.tq * dm.d];
                let k_bh = &kd[k_base[b * dm.hkv + hk]..][..dm.tk * dm.d];
                let v_bh = &vd[v_base[b * dm.hkv + hk]..][..dm.tk * dm.dv];
                let sink = sink_vals.as_ref().map(|s| s[h]);
                o_bh.par_chunks_mut(BQ * dm.dv)
                    .zip(l_bh.par_chunks_mut(BQ))
                    .enumerate()
                    .for_each(|(qb, (o, l))| {
                        forward_block(dm, spec, &br, invariant, qb, q_bh, k_bh, v_bh, sink, o, l)
                    });
            });
    }
    let out_shape = [dm.b, dm.hq, dm.tq, dm.dv];
    Ok((
        finish(out, &out_shape, q.dtype())?,
        finish(lse, &[dm.b, dm.hq, dm.tq], DType::F32)?,
    ))
}

/// The `B·H` blocks of a `[B, H, T, D]` operand as `T` contiguous rows of `D` each: the
/// elements and where each block starts. Read in place when every block already is contiguous
/// (a KV cache with room to grow is a view whose heads sit `capacity` rows apart), else from a
/// contiguous copy.
fn head_blocks(t: &Tensor) -> (crate::tensor::Contig<'_, f32>, Vec<usize>) {
    let (shape, strides) = (t.shape(), t.layout().strides());
    let (b, h, rows, d) = (shape[0], shape[1], shape[2], shape[3]);
    let rows_contiguous = (d <= 1 || strides[3] == 1) && (rows <= 1 || strides[2] == d);
    if t.dtype() == DType::F32 && rows_contiguous && t.layout().contiguous_range().is_none() {
        let guard = t.storage();
        let len = guard.len();
        let off = t.layout().offset();
        let bases = (0..b * h)
            .map(|i| off + (i / h) * strides[0] + (i % h) * strides[1])
            .collect();
        return (
            crate::tensor::Contig::Borrowed(guard, 0, len, std::marker::PhantomData),
            bases,
        );
    }
    let data = t.contig::<f32>();
    (data, (0..b * h).map(|i| i * rows * d).collect())
}

/// Whether this call's tiles run on the row-independent packed kernel: batch-invariant mode on
/// the calling thread, and a CPU that has the kernel.
pub(crate) fn invariant_kernels() -> bool {
    crate::invariant::batch_invariant() && super::sgemm::available()
}

/// One query block of one (batch, head): online softmax over the visible key blocks.
#[allow(clippy::too_many_arguments)]
fn forward_block(
    dm: Dims,
    spec: &AttentionSpec,
    br: &BlockRanges,
    invariant: bool,
    qb: usize,
    q_bh: &[f32],
    k_bh: &[f32],
    v_bh: &[f32],
    sink: Option<f32>,
    o: &mut [f32],
    lse: &mut [f32],
) {
    let (d, dv) = (dm.d, dm.dv);
    let q0 = qb * BQ;
    let rows = lse.len();
    let q_blk = &q_bh[q0 * d..(q0 + rows) * d];
    // A sink starts every row's softmax as a logit with no value.
    let mut m = vec![sink.unwrap_or(f32::NEG_INFINITY); rows];
    let mut l = vec![if sink.is_some() { 1.0f32 } else { 0.0 }; rows];
    let mut s = vec![0f32; BQ * BK];
    o.fill(0.0);
    for kb in 0..dm.tk.div_ceil(BK) {
        let tile = br.tile(spec, qb, kb);
        if tile == Tile::Hidden {
            continue;
        }
        let k0 = kb * BK;
        let cols = BK.min(dm.tk - k0);
        let k_blk = &k_bh[k0 * d..(k0 + cols) * d];
        scores(
            invariant,
            &mut s,
            &mut [],
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
            let row = &mut s[r * BK..r * BK + cols];
            let m_new = m[r].max(row_max(row));
            if m_new == f32::NEG_INFINITY {
                row.fill(0.0);
                continue;
            }
            let alpha = simd::exp(m[r] - m_new);
            let sum = exp_sub_sum(row, m_new);
            l[r] = l[r] * alpha + sum;
            if alpha != 1.0 {
                scale_row(&mut o[r * dv..(r + 1) * dv], alpha);
            }
            m[r] = m_new;
        }
        let v_blk = &v_bh[k0 * dv..(k0 + cols) * dv];
        assert!(o.len() >= rows * dv);
        if invariant {
            invariant_pv(o, &s, v_blk, rows, cols, dv);
            continue;
        }
        // SAFETY: s holds rows × BK, v_blk cols × dv, o rows × dv (asserted).
        unsafe {
            mm(
                rows,
                dv,
                cols,
                o.as_mut_ptr(),
                dv,
                true,
                s.as_ptr(),
                BK,
                1,
                v_blk.as_ptr(),
                dv,
                1,
                1.0,
            );
        }
    }
    for r in 0..rows {
        if l[r] > 0.0 {
            scale_row(&mut o[r * dv..(r + 1) * dv], 1.0 / l[r]);
            lse[r] = m[r] + l[r].ln();
        } else {
            o[r * dv..(r + 1) * dv].fill(0.0);
            lse[r] = f32::NEG_INFINITY;
        }
    }
}
