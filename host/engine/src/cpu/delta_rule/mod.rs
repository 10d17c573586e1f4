//! CPU kernels of the gated delta rule (see `ops::delta_rule`): the chunked forward and
//! backward (`chunk`), and the token-by-token recurrence for decode.
//!
//! Work splits over (batch, value head) pairs; inside a head the chunks run in order on the
//! calling task, with single-threaded products, so results do not depend on the thread count.

mod chunk;

use super::sgemm;
use crate::backend::DeltaRuleBackend;
use crate::error::Result;
use crate::ops::{DeltaRuleInputs, DeltaRuleSpec as DeltaRuleDims};
use crate::Tensor;
use chunk::{RowGrads, Rows, Sizes, Work, CHUNK};
use rayon::prelude::*;

/// `c[m×n] (+)= a[m×k] · b[k×n]` for strided `a` (`(i, l)` at `i·ars + l·acs`) and `b`, with
/// `c` row-major; single-threaded (callers spread over heads).
///
/// On the packed kernels (AVX-512, AVX2) an element's result does not depend on `m`, `n` or on the
/// other rows, and extra trailing terms of exact zero leave it unchanged: what makes a partial
/// chunk's rows equal to the same rows of a full chunk. Without it, batch-invariant mode uses a
/// plain loop with the same properties (slower), and the `gemm` crate otherwise.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mm(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    ars: usize,
    acs: usize,
    b: &[f32],
    brs: usize,
    bcs: usize,
    c: &mut [f32],
    accumulate: bool,
) {
    let c = &mut c[..m * n];
    if sgemm::available() {
        let ra = sgemm::MatRef {
            data: a,
            off: 0,
            rs: ars,
            cs: acs,
        };
        let rb = sgemm::MatRef {
            data: b,
            off: 0,
            rs: brs,
            cs: bcs,
        };
        sgemm::sgemm_into(m, n, k, ra, rb, None, c, accumulate, false);
        return;
    }
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 || crate::invariant::batch_invariant() {
        for i in 0..m {
            for j in 0..n {
                let mut s = if accumulate { c[i * n + j] } else { 0.0 };
                for l in 0..k {
                    s += a[i * ars + l * acs] * b[l * brs + j * bcs];
                }
                c[i * n + j] = s;
            }
        }
        return;
    }
    let fits = |d: &[f32], rows: usize, cols: usize, rs: usize, cs: usize| {
        (rows - 1) * rs + (cols - 1) * cs < d.len()
    };
    assert!(
        fits(a, m, k, ars, acs) && fits(b, k, n, brs, bcs),
        "mm operands out of bounds"
    );
    // SAFETY: the operands were checked to hold every addressed element; `c` is a distinct
    // mutable slice of m·n elements.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            acs as isize,
            ars as isize,
            b.as_ptr(),
            bcs as isize,
            brs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// The inputs of one call, as contiguous f32 `[B, T, H, ·]` slices (q unscaled).
struct Inputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    /// `[B, Hv, Dk, Dv]`, zeros when absent.
    state: Option<&'a [f32]>,
}

/// One value head's rows, gathered contiguous (`q` scaled).
struct Head {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

/// Rows `[t, d]` of head `h` from a `[B, T, H, d]` slice, for batch `b`.
fn gather(x: &[f32], m: &DeltaRuleDims, b: usize, h: usize, heads: usize, d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(m.t * d);
    for t in 0..m.t {
        let at = ((b * m.t + t) * heads + h) * d;
        out.extend_from_slice(&x[at..at + d]);
    }
    out
}

impl Head {
    fn of(x: &Inputs, m: &DeltaRuleDims, bh: usize) -> Head {
        let (b, h) = (bh / m.hv, bh % m.hv);
        let hk = h / (m.hv / m.hk);
        let mut q = gather(x.q, m, b, hk, m.hk, m.dk);
        q.iter_mut().for_each(|v| *v *= m.scale);
        Head {
            q,
            k: gather(x.k, m, b, hk, m.hk, m.dk),
            v: gather(x.v, m, b, h, m.hv, m.dv),
            g: gather(x.g, m, b, h, m.hv, m.gd()),
            beta: gather(x.beta, m, b, h, m.hv, 1),
        }
    }

    fn rows(&self, t0: usize, l: usize, z: Sizes) -> Rows<'_> {
        Rows {
            q: &self.q[t0 * z.dk..(t0 + l) * z.dk],
            k: &self.k[t0 * z.dk..(t0 + l) * z.dk],
            v: &self.v[t0 * z.dv..(t0 + l) * z.dv],
            g: &self.g[t0 * z.gd..(t0 + l) * z.gd],
            beta: &self.beta[t0..t0 + l],
            l,
        }
    }
}

fn sizes(m: &DeltaRuleDims) -> Sizes {
    Sizes {
        dk: m.dk,
        dv: m.dv,
        gd: m.gd(),
    }
}

/// What the forward returns: output `[B, T, Hv, Dv]`, final state `[B, Hv, Dk, Dv]` and, when
/// asked, the state entering every chunk `[B·Hv, chunks, Dk, Dv]` (the backward's checkpoints).
struct Forward {
    out: Vec<f32>,
    state: Vec<f32>,
    chunk_states: Vec<f32>,
}

/// The chunked forward.
fn forward(x: &Inputs, m: &DeltaRuleDims, save: bool) -> Forward {
    let z = sizes(m);
    let chunks = m.t.div_ceil(CHUNK);
    let ss = m.dk * m.dv;
    // The mode is per thread: the pool's threads take the caller's (see `mm`).
    let invariant = crate::invariant::batch_invariant();
    let per_head: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..m.b * m.hv)
        .into_par_iter()
        .map(|bh| {
            let _mode = crate::invariant::set_batch_invariant(invariant);
            let head = Head::of(x, m, bh);
            let mut s = match x.state {
                Some(s0) => s0[bh * ss..(bh + 1) * ss].to_vec(),
                None => vec![0.0; ss],
            };
            let mut o = vec![0f32; m.t * m.dv];
            let mut saved = Vec::with_capacity(if save { chunks * ss } else { 0 });
            let mut w = Work::default();
            for c in 0..chunks {
                let t0 = c * CHUNK;
                let l = CHUNK.min(m.t - t0);
                if save {
                    saved.extend_from_slice(&s);
                }
                let rows = head.rows(t0, l, z);
                chunk::forward(&rows, &mut s, &mut o[t0 * m.dv..(t0 + l) * m.dv], z, &mut w);
            }
            (o, s, saved)
        })
        .collect();
    let mut out = vec![0f32; m.b * m.t * m.hv * m.dv];
    let mut state = Vec::with_capacity(m.b * m.hv * ss);
    let mut chunk_states = Vec::new();
    for (bh, (o, s, saved)) in per_head.into_iter().enumerate() {
        let (b, h) = (bh / m.hv, bh % m.hv);
        for t in 0..m.t {
            let at = ((b * m.t + t) * m.hv + h) * m.dv;
            out[at..at + m.dv].copy_from_slice(&o[t * m.dv..(t + 1) * m.dv]);
        }
        state.extend_from_slice(&s);
        chunk_states.extend_from_slice(&saved);
    }
    Forward {
        out,
        state,
        chunk_states,
    }
}

/// Gradients of every input, laid out like the inputs (`state` always computed).
struct Grads {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
}

/// The chunked backward from the forward's chunk states, the output gradient `d_out` and the
/// final state's gradient `d_state`.
fn backward(
    x: &Inputs,
    m: &DeltaRuleDims,
    chunk_states: &[f32],
    d_out: &[f32],
    d_state: &[f32],
) -> Grads {
    let z = sizes(m);
    let chunks = m.t.div_ceil(CHUNK);
    let ss = m.dk * m.dv;
    let gd = m.gd();
    let invariant = crate::invariant::batch_invariant();
    let per_head: Vec<[Vec<f32>; 6]> = (0..m.b * m.hv)
        .into_par_iter()
        .map(|bh| {
            let _mode = crate::invariant::set_batch_invariant(invariant);
            let head = Head::of(x, m, bh);
            let (b, h) = (bh / m.hv, bh % m.hv);
            let d_o = gather(d_out, m, b, h, m.hv, m.dv);
            let mut ds = d_state[bh * ss..(bh + 1) * ss].to_vec();
            let mut g = [
                vec![0f32; m.t * m.dk],
                vec![0f32; m.t * m.dk],
                vec![0f32; m.t * m.dv],
                vec![0f32; m.t * gd],
                vec![0f32; m.t],
            ];
            let mut w = Work::default();
            for c in (0..chunks).rev() {
                let t0 = c * CHUNK;
                let l = CHUNK.min(m.t - t0);
                let rows = head.rows(t0, l, z);
                let s = &chunk_states[(bh * chunks + c) * ss..(bh * chunks + c + 1) * ss];
                let [gq, gk, gv, gg, gb] = &mut g;
                let gr = RowGrads {
                    q: &mut gq[t0 * m.dk..(t0 + l) * m.dk],
                    k: &mut gk[t0 * m.dk..(t0 + l) * m.dk],
                    v: &mut gv[t0 * m.dv..(t0 + l) * m.dv],
                    g: &mut gg[t0 * gd..(t0 + l) * gd],
                    beta: &mut gb[t0..t0 + l],
                };
                chunk::backward(
                    &rows,
                    s,
                    &d_o[t0 * m.dv..(t0 + l) * m.dv],
                    &mut ds,
                    gr,
                    z,
                    &mut w,
                );
            }
            let [gq, gk, gv, gg, gb] = g;
            [gq, gk, gv, gg, gb, ds]
        })
        .collect();
    let mut out = Grads {
        q: vec![0f32; m.b * m.t * m.hk * m.dk],
        k: vec![0f32; m.b * m.t * m.hk * m.dk],
        v: vec![0f32; m.b * m.t * m.hv * m.dv],
        g: vec![0f32; m.b * m.t * m.hv * gd],
        beta: vec![0f32; m.b * m.t * m.hv],
        state: Vec::with_capacity(m.b * m.hv * ss),
    };
    let group = m.hv / m.hk;
    // Value heads sharing a key head add their q and k gradients in head order.
    for (bh, [gq, gk, gv, gg, gb, ds]) in per_head.into_iter().enumerate() {
        let (b, h) = (bh / m.hv, bh % m.hv);
        let hk = h / group;
        for t in 0..m.t {
            let at = ((b * m.t + t) * m.hk + hk) * m.dk;
            for d in 0..m.dk {
                out.q[at + d] += gq[t * m.dk + d] * m.scale;
                out.k[at + d] += gk[t * m.dk + d];
            }
            let at = ((b * m.t + t) * m.hv + h) * m.dv;
            out.v[at..at + m.dv].copy_from_slice(&gv[t * m.dv..(t + 1) * m.dv]);
            let at = ((b * m.t + t) * m.hv + h) * gd;
            out.g[at..at + gd].copy_from_slice(&gg[t * gd..(t + 1) * gd]);
            out.beta[(b * m.t + t) * m.hv + h] = gb[t];
        }
        out.state.extend_from_slice(&ds);
    }
    out
}

/// The recurrence token by token from `state` (updated in place): for each token,
/// `S ← e^g ⊙ S`, `S ← S + k (β (v − Sᵀk))ᵀ`, `o = Sᵀ q`. Returns the outputs `[B, T, Hv, Dv]`.
fn recurrent(x: &Inputs, m: &DeltaRuleDims, state: &mut [f32]) -> Vec<f32> {
    let ss = m.dk * m.dv;
    let gd = m.gd();
    let per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(ss)
        .enumerate()
        .map(|(bh, s)| {
            let head = Head::of(x, m, bh);
            let mut o = vec![0f32; m.t * m.dv];
            let mut mem = vec![0f32; m.dv];
            for t in 0..m.t {
                let (q, k) = (&head.q[t * m.dk..][..m.dk], &head.k[t * m.dk..][..m.dk]);
                let v = &head.v[t * m.dv..][..m.dv];
                mem.fill(0.0);
                for d in 0..m.dk {
                    let e = head.g[t * gd + if gd == 1 { 0 } else { d }].exp();
                    let row = &mut s[d * m.dv..(d + 1) * m.dv];
                    for (x, y) in row.iter_mut().zip(mem.iter_mut()) {
                        *x *= e;
                        *y += *x * k[d];
                    }
                }
                let beta = head.beta[t];
                mem.iter_mut()
                    .zip(v)
                    .for_each(|(y, v)| *y = beta * (v - *y));
                let out = &mut o[t * m.dv..(t + 1) * m.dv];
                for d in 0..m.dk {
                    let row = &mut s[d * m.dv..(d + 1) * m.dv];
                    for ((x, y), o) in row.iter_mut().zip(&mem).zip(out.iter_mut()) {
                        *x += k[d] * y;
                        *o += *x * q[d];
                    }
                }
            }
            o
        })
        .collect();
    let mut out = vec![0f32; m.b * m.t * m.hv * m.dv];
    for (bh, o) in per_head.into_iter().enumerate() {
        let (b, h) = (bh / m.hv, bh % m.hv);
        for t in 0..m.t {
            let at = ((b * m.t + t) * m.hv + h) * m.dv;
            out[at..at + m.dv].copy_from_slice(&o[t * m.dv..(t + 1) * m.dv]);
        }
    }
    out
}

/// Runs `f` on contiguous f32 views of the inputs.
fn with_slices<R>(x: &DeltaRuleInputs<'_>, f: impl FnOnce(&Inputs) -> R) -> R {
    let c: Vec<_> = [x.q, x.k, x.v, x.g, x.beta]
        .map(|t| t.contig::<f32>())
        .into();
    let s = x.state.map(|s| s.contig::<f32>());
    f(&Inputs {
        q: &c[0][..],
        k: &c[1][..],
        v: &c[2][..],
        g: &c[3][..],
        beta: &c[4][..],
        state: s.as_ref().map(|s| &s[..]),
    })
}

impl DeltaRuleBackend for super::CpuBackend {
    fn delta_rule(
        &self,
        x: &DeltaRuleInputs<'_>,
        m: &DeltaRuleDims,
        save: bool,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let _p = crate::profile::scope("delta_rule");
        let f = with_slices(x, |i| forward(i, m, save));
        let chunks = m.t.div_ceil(CHUNK);
        Ok((
            Tensor::from_vec(f.out, &[m.b, m.t, m.hv, m.dv])?,
            Tensor::from_vec(f.state, &[m.b, m.hv, m.dk, m.dv])?,
            save.then(|| Tensor::from_vec(f.chunk_states, &[m.b * m.hv, chunks, m.dk, m.dv]))
                .transpose()?,
        ))
    }

    fn delta_rule_backward(
        &self,
        x: &DeltaRuleInputs<'_>,
        m: &DeltaRuleDims,
        chunk_states: &Tensor,
        d_out: &Tensor,
        d_state: &Tensor,
    ) -> Result<[Tensor; 6]> {
        let _p = crate::profile::scope("delta_rule_backward");
        let (cs, dout, dst) = (
            chunk_states.contig::<f32>(),
            d_out.contig::<f32>(),
            d_state.contig::<f32>(),
        );
        let g = with_slices(x, |i| backward(i, m, &cs, &dout, &dst));
        let qk = [m.b, m.t, m.hk, m.dk];
        Ok([
            Tensor::from_vec(g.q, &qk)?,
            Tensor::from_vec(g.k, &qk)?,
            Tensor::from_vec(g.v, &[m.b, m.t, m.hv, m.dv])?,
            Tensor::from_vec(g.g, x.g.shape())?,
            Tensor::from_vec(g.beta, &[m.b, m.t, m.hv])?,
            Tensor::from_vec(g.state, &[m.b, m.hv, m.dk, m.dv])?,
        ])
    }

    fn delta_rule_recurrent(
        &self,
        x: &DeltaRuleInputs<'_>,
        m: &DeltaRuleDims,
    ) -> Result<(Tensor, Tensor)> {
        let _p = crate::profile::scope("delta_rule_recurrent");
        let shape = [m.b, m.hv, m.dk, m.dv];
        let mut s = match x.state {
            Some(s) => s.to_vec_f32(),
            None => vec![0.0; shape.iter().product()],
        };
        let out = with_slices(x, |i| recurrent(i, m, &mut s));
        Ok((
            Tensor::from_vec(out, &[m.b, m.t, m.hv, m.dv])?,
            Tensor::from_vec(s, &shape)?,
        ))
    }
}
