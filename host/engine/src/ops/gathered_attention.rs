//! Gathered sparse attention (DeepSeek-V4's compressed sparse and heavily compressed
//! attention): each query scores only the keys it may see — its sliding window of recent
//! tokens, the compressed blocks it may see (every complete one, or those the indexer chose),
//! and a per-head sink — instead of a score row over every key with the rest masked. The work
//! per query is then O(window + visible blocks), not O(sequence).
//!
//! One shared key/value head (K = V, as V4 has): `keys [B, S, D]` are the window's tokens,
//! `blocks [B, N, D]` the compressed blocks, and every query head of `q [B, H, T, D]` reads
//! them. Query `t` at position `p` sees window key `j` when `0 <= p - k_pos[j] < window`, and
//! block `w` when it is complete (`w < (p + 1) / rate`) and, with a selection, named by
//! `selected[t]`.
//!
//! Batch invariance: a query's row is a fixed sequence of f32 operations over its visible keys
//! in a fixed order (window keys by index, then blocks by ascending block index, the
//! selection sorted and deduplicated first), independent of which other queries or rows run
//! with it. A decode step over a cache therefore reproduces the training forward's bits.
//!
//! With `q` on a CUDA device the op runs there (`cuda::gathered_attention`: the same visibility
//! and order, an online softmax over each row's columns) and reads nothing back to the host;
//! only the shape checks, which read no values, are shared with the host path.

use crate::autograd::record;
use crate::error::{invalid, Error, Result};
use crate::{DType, Tensor};
use rayon::prelude::*;

const OP: &str = "gathered_attention";

/// Queries per backward task: each task accumulates its key gradients in its own buffer, and
/// the buffers are summed in task order, so the gradient does not depend on the thread count.
const BACKWARD_CHUNK: usize = 1024;

/// What [`gathered_attention`] attends over besides the window keys.
#[derive(Clone)]
pub struct GatheredAttentionParams {
    /// Query positions (i64 or i32), `[T]` shared by the batch or `[B, T]`.
    pub q_pos: Tensor,
    /// Window key positions (i64 or i32), `[S]` or `[B, S]`.
    pub k_pos: Tensor,
    /// Compressed blocks `[B, N, D]` (keys and values); block `w` covers positions
    /// `[w·rate, (w+1)·rate)`.
    pub blocks: Option<Tensor>,
    /// The blocks each query may see (i64 `[B, T, k]`); `None`: every complete block. Entries
    /// naming a block not yet complete (or out of range) are ignored, repeats count once.
    pub selected: Option<Tensor>,
    /// Per-head logits `[H]` joining every row's softmax without a value; they get a gradient.
    pub sinks: Option<Tensor>,
    /// Window keys visible to a query: those at positions `(p - window, p]`.
    pub window: usize,
    /// Tokens per compressed block.
    pub compress_rate: usize,
    /// Multiplies `q·k`; `None` is `1/sqrt(D)`.
    pub scale: Option<f32>,
}

/// The shapes of a call, checked without reading any value (so a device call reads none).
struct Dims {
    b: usize,
    h: usize,
    t: usize,
    d: usize,
    s: usize,
    n: usize,
    scale: f32,
    /// Batch rows of `q_pos` and `k_pos` (1 or B).
    qb: usize,
    kb: usize,
    /// The selection's batch rows (1 or B) and choices per query.
    sel: Option<(usize, usize)>,
}

/// The resolved shapes and each query's visible columns (`c < s`: window key `c`, else block
/// `c - s`), in CSR form over the rows `b·T + t`.
struct Plan {
    b: usize,
    h: usize,
    t: usize,
    d: usize,
    s: usize,
    n: usize,
    scale: f32,
    offsets: Vec<usize>,
    cols: Vec<u32>,
}

impl Plan {
    fn cols(&self, r: usize) -> &[u32] {
        &self.cols[self.offsets[r]..self.offsets[r + 1]]
    }
}

/// Positions `[n]` or `[B, n]`: how many batch rows they have.
fn position_rows(t: &Tensor, n: usize, b: usize, what: &str) -> Result<usize> {
    if !matches!(t.dtype(), DType::I64 | DType::I32) {
        return Err(Error::DType {
            op: OP,
            got: t.dtype(),
            expected: "i64 or i32 positions",
        });
    }
    match *t.shape() {
        [m] if m == n => Ok(1),
        [bb, m] if m == n && (bb == b || bb == 1) => Ok(bb),
        _ => Err(invalid(
            OP,
            format!("{what} must be [{n}] or [{b}, {n}], got {:?}", t.shape()),
        )),
    }
}

fn float_rank(t: &Tensor, rank: usize, what: &str) -> Result<()> {
    if t.rank() != rank {
        return Err(invalid(
            OP,
            format!("{what} must have rank {rank}, got shape {:?}", t.shape()),
        ));
    }
    if !t.dtype().is_float() {
        return Err(Error::DType {
            op: OP,
            got: t.dtype(),
            expected: "a floating dtype",
        });
    }
    Ok(())
}

/// Checks the shapes and dtypes (reading no value).
fn dims(q: &Tensor, keys: &Tensor, p: &GatheredAttentionParams) -> Result<Dims> {
    float_rank(q, 4, "q [B, H, T, D]")?;
    float_rank(keys, 3, "keys [B, S, D]")?;
    let (b, h, t, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let s = keys.shape()[1];
    if keys.shape()[0] != b || keys.shape()[2] != d {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: q.shape().to_vec(),
            rhs: keys.shape().to_vec(),
        });
    }
    let n = match &p.blocks {
        Some(c) => {
            float_rank(c, 3, "blocks [B, N, D]")?;
            if c.shape()[0] != b || c.shape()[2] != d {
                return Err(Error::ShapeMismatch {
                    op: OP,
                    lhs: q.shape().to_vec(),
                    rhs: c.shape().to_vec(),
                });
            }
            c.shape()[1]
        }
        None => 0,
    };
    if s + n > u32::MAX as usize {
        return Err(invalid(OP, format!("{s} keys and {n} blocks are too many")));
    }
    if p.window == 0 || p.compress_rate == 0 {
        return Err(invalid(OP, "window and compress_rate must be at least 1"));
    }
    let scale = p.scale.unwrap_or(1.0 / (d.max(1) as f32).sqrt());
    if !scale.is_finite() {
        return Err(invalid(OP, format!("scale must be finite, got {scale}")));
    }
    if let Some(sk) = &p.sinks {
        if sk.shape() != [h] || !sk.dtype().is_float() {
            return Err(invalid(
                OP,
                format!("sinks must be floats of shape [{h}], got {:?}", sk.shape()),
            ));
        }
    }
    let qb = position_rows(&p.q_pos, t, b, "q_pos")?;
    let kb = position_rows(&p.k_pos, s, b, "k_pos")?;
    let sel = match &p.selected {
        Some(x) => match *x.shape() {
            [sb, st, k] if st == t && (sb == b || sb == 1) && x.dtype() == DType::I64 => {
                Some((sb, k))
            }
            _ => {
                return Err(invalid(
                    OP,
                    format!("selected must be i64 [{b}, {t}, k], got {:?}", x.shape()),
                ))
            }
        },
        None => None,
    };
    Ok(Dims {
        b,
        h,
        t,
        d,
        s,
        n,
        scale,
        qb,
        kb,
        sel,
    })
}

/// Lists every query's visible columns on the host (reading the positions and selection).
fn plan(dm: &Dims, p: &GatheredAttentionParams) -> Result<Plan> {
    let Dims {
        b,
        h,
        t,
        d,
        s,
        n,
        scale,
        qb,
        kb,
        ..
    } = *dm;
    let (qp, kp) = (p.q_pos.to_vec::<i64>(), p.k_pos.to_vec::<i64>());
    let sel = match (dm.sel, &p.selected) {
        (Some((sb, k)), Some(x)) => Some((sb, k, x.to_vec::<i64>())),
        _ => None,
    };
    // Window keys in ascending position (the usual case) are found by bisection.
    let sorted: Vec<bool> = (0..kb)
        .map(|r| kp[r * s..][..s].windows(2).all(|w| w[0] <= w[1]))
        .collect();
    let window = p.window as i64;
    let rate = p.compress_rate as i64;
    let rows: Vec<Vec<u32>> = (0..b * t)
        .into_par_iter()
        .map(|r| {
            let (bi, ti) = (r / t, r % t);
            let pos = qp[(bi % qb) * t + ti];
            let kr = &kp[(bi % kb) * s..][..s];
            let mut cols = Vec::new();
            if sorted[bi % kb] {
                let lo = kr.partition_point(|&k| k <= pos - window);
                let hi = kr.partition_point(|&k| k <= pos);
                cols.extend((lo..hi.max(lo)).map(|j| j as u32));
            } else {
                let seen = |&(_, &k): &(usize, &i64)| k <= pos && pos - k < window;
                cols.extend(kr.iter().enumerate().filter(seen).map(|(j, _)| j as u32));
            }
            let ready = ((pos + 1).max(0) / rate).min(n as i64);
            let first = cols.len();
            match &sel {
                None => cols.extend((0..ready).map(|w| (s as i64 + w) as u32)),
                Some((sb, k, idx)) => {
                    let named = &idx[((bi % sb) * t + ti) * k..][..*k];
                    cols.extend(
                        named
                            .iter()
                            .filter(|&&w| (0..ready).contains(&w))
                            .map(|&w| (s as i64 + w) as u32),
                    );
                    cols[first..].sort_unstable();
                    let mut kept = first;
                    for i in first..cols.len() {
                        if i == first || cols[i] != cols[kept - 1] {
                            cols[kept] = cols[i];
                            kept += 1;
                        }
                    }
                    cols.truncate(kept);
                }
            }
            cols
        })
        .collect();
    let mut offsets = Vec::with_capacity(rows.len() + 1);
    offsets.push(0);
    for r in &rows {
        offsets.push(offsets.last().copied().unwrap_or(0) + r.len());
    }
    let cols = rows.concat();
    Ok(Plan {
        b,
        h,
        t,
        d,
        s,
        n,
        scale,
        offsets,
        cols,
    })
}

/// `Σ a·b` in a fixed order: eight lanes, then a fixed tree, then the tail.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (a8.remainder(), b8.remainder());
    for (x, y) in a8.zip(b8) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// `y += a·x`.
#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// `[B, H, T, D]` ↔ `[B, T, H, D]` (the same permutation both ways).
fn swap_ht(x: &[f32], b: usize, h: usize, t: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for bi in 0..b {
        for hi in 0..h {
            for ti in 0..t {
                let src = ((bi * h + hi) * t + ti) * d;
                let dst = ((bi * t + ti) * h + hi) * d;
                out[dst..dst + d].copy_from_slice(&x[src..src + d]);
            }
        }
    }
    out
}

/// The f32 values of a float tensor.
fn values(t: &Tensor) -> Vec<f32> {
    t.to_vec_f32()
}

/// The inputs as f32 rows: queries `[B, T, H, D]`, keys `[B, S, D]`, blocks `[B, N, D]`, sinks.
struct Data {
    q: Vec<f32>,
    keys: Vec<f32>,
    blocks: Vec<f32>,
    sinks: Option<Vec<f32>>,
}

impl Data {
    #[inline]
    fn row<'a>(&'a self, p: &Plan, bi: usize, c: u32) -> &'a [f32] {
        let c = c as usize;
        if c < p.s {
            &self.keys[(bi * p.s + c) * p.d..][..p.d]
        } else {
            &self.blocks[(bi * p.n + c - p.s) * p.d..][..p.d]
        }
    }
}

/// The forward: outputs `[B, T, H, D]` and each row's logsumexp `[B, T, H]` (−∞ for a row that
/// sees nothing; its output is zero).
fn forward(p: &Plan, x: &Data) -> (Vec<f32>, Vec<f32>) {
    let _s = crate::profile::scope(OP);
    let (h, d) = (p.h, p.d);
    let mut out = vec![0f32; p.b * p.t * h * d];
    let mut lse = vec![f32::NEG_INFINITY; p.b * p.t * h];
    out.par_chunks_mut(h * d)
        .zip(lse.par_chunks_mut(h))
        .enumerate()
        .for_each_init(Vec::new, |buf, (r, (o, l))| {
            let bi = r / p.t;
            let cols = p.cols(r);
            buf.resize(cols.len(), 0.0);
            for hi in 0..h {
                let qh = &x.q[(r * h + hi) * d..][..d];
                let sink = x.sinks.as_ref().map(|s| s[hi]);
                let mut m = sink.unwrap_or(f32::NEG_INFINITY);
                for (v, &c) in buf.iter_mut().zip(cols) {
                    *v = dot(qh, x.row(p, bi, c)) * p.scale;
                    m = m.max(*v);
                }
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let mut sum = 0f32;
                for v in buf.iter_mut() {
                    *v = (*v - m).exp();
                    sum += *v;
                }
                if let Some(s) = sink {
                    sum += (s - m).exp();
                }
                let oh = &mut o[hi * d..][..d];
                for (&w, &c) in buf.iter().zip(cols) {
                    axpy(oh, w, x.row(p, bi, c));
                }
                let inv = 1.0 / sum;
                oh.iter_mut().for_each(|v| *v *= inv);
                l[hi] = m + sum.ln();
            }
        });
    (out, lse)
}

/// Gradients in f32: queries `[B, T, H, D]`, keys `[B, S, D]`, blocks `[B, N, D]`, sinks `[H]`.
struct Grads {
    q: Vec<f32>,
    keys: Vec<f32>,
    blocks: Vec<f32>,
    sinks: Vec<f32>,
}

/// The backward of [`forward`] given the upstream gradient `g` and the saved output and
/// logsumexp (all `[B, T, H, ·]`).
fn backward(p: &Plan, x: &Data, out: &[f32], lse: &[f32], g: &[f32]) -> Grads {
    let _s = crate::profile::scope("gathered_attention_backward");
    let (h, d, s, n) = (p.h, p.d, p.s, p.n);
    let rows = p.b * p.t;
    let mut dq = vec![0f32; rows * h * d];
    let width = s + n;
    // Each task: its queries' key/block gradients for the batch rows it touches, its sinks'.
    let parts: Vec<(usize, Vec<f32>, Vec<f32>)> = dq
        .par_chunks_mut(BACKWARD_CHUNK * h * d)
        .enumerate()
        .map(|(chunk, dq)| {
            let r0 = chunk * BACKWARD_CHUNK;
            let b0 = r0 / p.t;
            let r1 = r0 + dq.len() / (h * d);
            let nb = (r1 - 1) / p.t - b0 + 1;
            let mut dk = vec![0f32; nb * width * d];
            let mut dsink = vec![0f32; h];
            for r in r0..r1 {
                let bi = r / p.t;
                let cols = p.cols(r);
                let base = (bi - b0) * width;
                for hi in 0..h {
                    let l = lse[r * h + hi];
                    if l == f32::NEG_INFINITY {
                        continue;
                    }
                    let at = (r * h + hi) * d;
                    let (qh, gh, oh) = (&x.q[at..][..d], &g[at..][..d], &out[at..][..d]);
                    let delta = dot(gh, oh);
                    let dqh = &mut dq[(r - r0) * h * d + hi * d..][..d];
                    for &c in cols {
                        let k = x.row(p, bi, c);
                        let pr = (dot(qh, k) * p.scale - l).exp();
                        let ds = pr * (dot(gh, k) - delta) * p.scale;
                        axpy(dqh, ds, k);
                        let dkr = &mut dk[(base + c as usize) * d..][..d];
                        axpy(dkr, ds, qh);
                        axpy(dkr, pr, gh);
                    }
                    if let Some(sk) = &x.sinks {
                        dsink[hi] -= (sk[hi] - l).exp() * delta;
                    }
                }
            }
            (b0, dk, dsink)
        })
        .collect();
    // Sum the tasks' buffers in task order, row by row in parallel.
    let mut dkb = vec![0f32; p.b * width * d];
    dkb.par_chunks_mut(d).enumerate().for_each(|(i, acc)| {
        let (bi, c) = (i / width, i % width);
        for (b0, part, _) in &parts {
            let nb = part.len() / (width * d);
            if (*b0..*b0 + nb).contains(&bi) {
                let src = &part[((bi - b0) * width + c) * d..][..d];
                acc.iter_mut().zip(src).for_each(|(a, v)| *a += v);
            }
        }
    });
    let mut sinks = vec![0f32; h];
    for (_, _, ds) in &parts {
        sinks.iter_mut().zip(ds).for_each(|(a, v)| *a += v);
    }
    let mut keys = Vec::with_capacity(p.b * s * d);
    let mut blocks = Vec::with_capacity(p.b * n * d);
    for row in dkb.chunks(width * d) {
        keys.extend_from_slice(&row[..s * d]);
        blocks.extend_from_slice(&row[s * d..]);
    }
    Grads {
        q: dq,
        keys,
        blocks,
        sinks,
    }
}

/// Attention of `q [B, H, T, D]` over the window keys `keys [B, S, D]` (also the values) and
/// the compressed blocks of `params`, each query over only what it may see (see the module
/// docs); the result is `[B, H, T, D]` in `q`'s dtype. Gradients reach `q`, `keys`, the blocks
/// and the sinks; none reach the positions or the selection.
pub fn gathered_attention(
    q: &Tensor,
    keys: &Tensor,
    params: &GatheredAttentionParams,
) -> Result<Tensor> {
    let dm = dims(q, keys, params)?;
    #[cfg(feature = "cuda")]
    if matches!(q.device(), crate::Device::Cuda(_)) {
        return on_device(q, keys, params, &dm);
    }
    let p = plan(&dm, params)?;
    let data = Data {
        q: swap_ht(&values(q), p.b, p.h, p.t, p.d),
        keys: values(keys),
        blocks: params.blocks.as_ref().map(values).unwrap_or_default(),
        sinks: params.sinks.as_ref().map(values),
    };
    let (out, lse) = forward(&p, &data);
    let (b, h, t, d) = (p.b, p.h, p.t, p.d);
    let result = Tensor::from_vec(swap_ht(&out, b, t, h, d), q.shape())?
        .to_dtype(q.dtype())?
        .to_device(q.device())?;
    let mut inputs = vec![q, keys];
    inputs.extend(params.blocks.as_ref());
    inputs.extend(params.sinks.as_ref());
    let (blocks, sinks) = (params.blocks.clone(), params.sinks.clone());
    let (qt, kt) = (q.detach(), keys.detach());
    Ok(record(OP, result, &inputs, move || {
        move |g: &Tensor| {
            let g = swap_ht(&values(g), b, h, t, d);
            let gr = backward(&p, &data, &out, &lse, &g);
            let like = |v: Vec<f32>, t: &Tensor| -> Result<Option<Tensor>> {
                let x = Tensor::from_vec(v, t.shape())?.to_dtype(t.dtype())?;
                Ok(Some(x.to_device(t.device())?))
            };
            let mut grads = vec![like(swap_ht(&gr.q, b, t, h, d), &qt)?, like(gr.keys, &kt)?];
            if let Some(c) = &blocks {
                grads.push(like(gr.blocks, c)?);
            }
            if let Some(sk) = &sinks {
                grads.push(like(gr.sinks, sk)?);
            }
            Ok(grads)
        }
    }))
}

/// [`gathered_attention`] with `q` on a CUDA device: the kernels of
/// `cuda::gathered_attention`, forward and backward, with nothing read back to the host (inputs
/// on the host are uploaded; the gradients go back to their inputs' devices).
#[cfg(feature = "cuda")]
fn on_device(
    q: &Tensor,
    keys: &Tensor,
    params: &GatheredAttentionParams,
    dm: &Dims,
) -> Result<Tensor> {
    use crate::cuda::gathered_attention as cuda;
    let dev = q.device();
    let shape = cuda::Shape {
        b: dm.b,
        h: dm.h,
        t: dm.t,
        d: dm.d,
        s: dm.s,
        n: dm.n,
        qb: dm.qb,
        kb: dm.kb,
        sel: dm.sel,
        window: params.window,
        rate: params.compress_rate,
        scale: dm.scale,
        sinks: params.sinks.is_some(),
    };
    let plan = cuda::plan(q, params, &shape)?;
    let here = |t: &Tensor| t.to_device(dev);
    let (qd, kd) = (q.detach(), here(keys)?);
    let bd = params.blocks.as_ref().map(here).transpose()?;
    let sd = params.sinks.as_ref().map(here).transpose()?;
    let (result, out, lse) = cuda::forward(&plan, &qd, &kd, bd.as_ref(), sd.as_ref())?;
    let mut inputs = vec![q, keys];
    inputs.extend(params.blocks.as_ref());
    inputs.extend(params.sinks.as_ref());
    let homes: Vec<crate::Device> = inputs.iter().map(|t| t.device()).collect();
    Ok(record(OP, result, &inputs, move || {
        move |g: &Tensor| {
            let g = g.to_device(dev)?;
            let gr = cuda::backward(&plan, &qd, &kd, bd.as_ref(), sd.as_ref(), &out, &lse, &g)?;
            let mut grads = vec![Some(gr.q), Some(gr.keys)];
            grads.extend(gr.blocks.map(Some));
            grads.extend(gr.sinks.map(Some));
            grads
                .into_iter()
                .zip(&homes)
                .map(|(x, &home)| x.map(|x| x.to_device(home)).transpose())
                .collect()
        }
    }))
}

impl Tensor {
    /// `gathered_attention(self, keys, params)`: see [`gathered_attention`].
    pub fn gathered_attention(
        &self,
        keys: &Tensor,
        params: &GatheredAttentionParams,
    ) -> Result<Tensor> {
        gathered_attention(self, keys, params)
    }
}
