//! One chunk of the gated delta rule, forward and backward, on one value head.
//!
//! For a chunk of `L ≤ 64` rows entering with state `S [Dk, Dv]`, with `γ_i` the cumulative
//! log-decay inside the chunk (a scalar per row for GDN, a `Dk` vector for KDA), `Γ = γ_{L-1}`
//! and `e^γ` applied per key channel:
//! ```text
//! R[i,j] = Σ_d k_i k_j e^{γ_i-γ_j}  (j < i)     A = diag(β) R      T = (I + A)⁻¹
//! W = T (diag(β) K ⊙ e^γ)      U = T diag(β) V     V' = U − W S
//! P[i,j] = Σ_d q_i k_j e^{γ_i-γ_j}  (j ≤ i)
//! O = (Q ⊙ e^γ) S + P V'
//! S' = e^Γ ⊙ S + (K ⊙ e^{Γ-γ})ᵀ V'
//! ```
//! The backward recomputes these from the saved entering state and applies the chain rule in
//! reverse (`dA = −Tᵀ dT Tᵀ` for the triangular inverse).
//!
//! Row independence (what batch-invariant decode relies on): every row of every intermediate
//! depends only on rows at or before it, `T` is built row by row by forward substitution, and the
//! products run on the packed kernel whose element results do not depend on the other rows (see
//! `super::mm`). So a row gets the same bits whether its chunk holds 64 rows or only the rows up
//! to it.

use super::mm;

/// Rows per chunk.
pub(crate) const CHUNK: usize = 64;

/// Largest `|γ_i − γ_0|` (per channel) for which KDA's pair products factor as
/// `(x_i e^{γ_i−γ_0}) · (y_j e^{γ_0−γ_j})` without leaving f32's normal range; rows beyond it are
/// computed pair by pair.
const FACTOR_LIMIT: f32 = 80.0;

/// Sizes shared by every chunk of a call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizes {
    /// Key head dim.
    pub dk: usize,
    /// Value head dim.
    pub dv: usize,
    /// Decay values per row: 1 (per head, GDN) or `dk` (per key channel, KDA).
    pub gd: usize,
}

/// One chunk's inputs (row-major, `l` rows each; `q` already scaled).
pub(crate) struct Rows<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// Raw log-decays `[l, gd]`.
    pub g: &'a [f32],
    pub beta: &'a [f32],
    pub l: usize,
}

/// Gradients of one chunk's rows (accumulated into).
pub(crate) struct RowGrads<'a> {
    pub q: &'a mut [f32],
    pub k: &'a mut [f32],
    pub v: &'a mut [f32],
    pub g: &'a mut [f32],
    pub beta: &'a mut [f32],
}

/// Intermediates of one chunk (sized for a full chunk, reused across chunks).
#[derive(Default)]
pub(crate) struct Work {
    gam: Vec<f32>,
    eg: Vec<f32>,
    eg_last: Vec<f32>,
    eg_rest: Vec<f32>,
    r: Vec<f32>,
    a: Vec<f32>,
    t: Vec<f32>,
    kbe: Vec<f32>,
    vb: Vec<f32>,
    w: Vec<f32>,
    u: Vec<f32>,
    vn: Vec<f32>,
    p: Vec<f32>,
    qe: Vec<f32>,
    ke: Vec<f32>,
    tmp: Vec<f32>,
    pair: PairWork,
}

#[derive(Default)]
struct PairWork {
    xr: Vec<f32>,
    yr: Vec<f32>,
    m: Vec<f32>,
    dx: Vec<f32>,
    dy: Vec<f32>,
    flag: Vec<bool>,
}

fn resize(v: &mut Vec<f32>, n: usize) {
    v.clear();
    v.resize(n, 0.0);
}

/// The decay index of channel `d` in a row of `gd` values.
#[inline]
fn ch(d: usize, gd: usize) -> usize {
    if gd == 1 {
        0
    } else {
        d
    }
}

impl Work {
    /// Computes every forward intermediate of the chunk entering with state `s`.
    fn prepare(&mut self, c: &Rows, s: &[f32], z: Sizes) {
        let (l, dk, dv, gd) = (c.l, z.dk, z.dv, z.gd);
        resize(&mut self.gam, l * gd);
        for i in 0..l {
            for e in 0..gd {
                let prev = if i == 0 {
                    0.0
                } else {
                    self.gam[(i - 1) * gd + e]
                };
                self.gam[i * gd + e] = prev + c.g[i * gd + e];
            }
        }
        let last = &self.gam[(l - 1) * gd..l * gd];
        self.eg = self.gam.iter().map(|x| x.exp()).collect();
        self.eg_last = last.iter().map(|x| x.exp()).collect();
        self.eg_rest = (0..l * gd)
            .map(|n| (last[n % gd] - self.gam[n]).exp())
            .collect();

        resize(&mut self.r, l * l);
        pair(c.k, c.k, &self.gam, l, z, true, &mut self.r, &mut self.pair);
        self.a = self.r.clone();
        for i in 0..l {
            for x in &mut self.a[i * l..(i + 1) * l] {
                *x *= c.beta[i];
            }
        }
        unit_lower_inverse(&self.a, l, &mut self.t);

        resize(&mut self.kbe, l * dk);
        resize(&mut self.qe, l * dk);
        resize(&mut self.ke, l * dk);
        for i in 0..l {
            for d in 0..dk {
                let n = i * gd + ch(d, gd);
                self.kbe[i * dk + d] = c.beta[i] * c.k[i * dk + d] * self.eg[n];
                self.qe[i * dk + d] = c.q[i * dk + d] * self.eg[n];
                self.ke[i * dk + d] = c.k[i * dk + d] * self.eg_rest[n];
            }
        }
        resize(&mut self.vb, l * dv);
        for i in 0..l {
            for e in 0..dv {
                self.vb[i * dv + e] = c.beta[i] * c.v[i * dv + e];
            }
        }
        resize(&mut self.w, l * dk);
        mm(
            l,
            dk,
            l,
            &self.t,
            l,
            1,
            &self.kbe,
            dk,
            1,
            &mut self.w,
            false,
        );
        resize(&mut self.u, l * dv);
        mm(l, dv, l, &self.t, l, 1, &self.vb, dv, 1, &mut self.u, false);
        resize(&mut self.tmp, l * dv);
        mm(l, dv, dk, &self.w, dk, 1, s, dv, 1, &mut self.tmp, false);
        self.vn = self.u.iter().zip(&self.tmp).map(|(u, t)| u - t).collect();
        resize(&mut self.p, l * l);
        pair(
            c.q,
            c.k,
            &self.gam,
            l,
            z,
            false,
            &mut self.p,
            &mut self.pair,
        );
    }
}

/// `t = (I + a)⁻¹` for a strictly lower `a [l, l]`, by forward substitution row by row (row `i`
/// reads rows before it only, in a fixed order).
fn unit_lower_inverse(a: &[f32], l: usize, t: &mut Vec<f32>) {
    resize(t, l * l);
    for i in 0..l {
        t[i * l + i] = 1.0;
        for m in 0..i {
            let f = a[i * l + m];
            if f == 0.0 {
                continue;
            }
            let (done, row) = t.split_at_mut(i * l);
            for (x, y) in row[..=m].iter_mut().zip(&done[m * l..m * l + m + 1]) {
                *x -= f * y;
            }
        }
    }
}

/// `m[i,j] = Σ_d x_i[d] y_j[d] e^{γ_i[d]−γ_j[d]}` for `j ≤ i` (`j < i` when `strict`), 0 above.
#[allow(clippy::too_many_arguments)]
fn pair(
    x: &[f32],
    y: &[f32],
    gam: &[f32],
    l: usize,
    z: Sizes,
    strict: bool,
    m: &mut [f32],
    pw: &mut PairWork,
) {
    let dk = z.dk;
    let keep = |i: usize, j: usize| j < i || (!strict && j == i);
    if z.gd == 1 {
        mm(l, l, dk, x, dk, 1, y, 1, dk, m, false);
        for i in 0..l {
            for j in 0..l {
                let v = &mut m[i * l + j];
                *v = if keep(i, j) {
                    *v * (gam[i] - gam[j]).exp()
                } else {
                    0.0
                };
            }
        }
        return;
    }
    factor(x, y, gam, l, dk, pw);
    mm(l, l, dk, &pw.xr, dk, 1, &pw.yr, 1, dk, m, false);
    for i in 0..l {
        for j in 0..l {
            let v = &mut m[i * l + j];
            if !keep(i, j) {
                *v = 0.0;
            } else if pw.flag[i] || pw.flag[j] {
                *v = (0..dk)
                    .map(|d| {
                        x[i * dk + d] * y[j * dk + d] * (gam[i * dk + d] - gam[j * dk + d]).exp()
                    })
                    .sum();
            }
        }
    }
}

/// KDA's factored operands relative to row 0, and which rows are too far from it to factor.
fn factor(x: &[f32], y: &[f32], gam: &[f32], l: usize, dk: usize, pw: &mut PairWork) {
    resize(&mut pw.xr, l * dk);
    resize(&mut pw.yr, l * dk);
    pw.flag.clear();
    for i in 0..l {
        let mut far = false;
        for d in 0..dk {
            let rel = gam[i * dk + d] - gam[d];
            far |= rel.abs() > FACTOR_LIMIT;
            pw.xr[i * dk + d] = x[i * dk + d] * rel.exp();
            pw.yr[i * dk + d] = y[i * dk + d] * (-rel).exp();
        }
        if far {
            // Computed pair by pair; zeros keep an overflowed factor out of the products.
            pw.xr[i * dk..(i + 1) * dk].fill(0.0);
            pw.yr[i * dk..(i + 1) * dk].fill(0.0);
        }
        pw.flag.push(far);
    }
}

/// Backward of [`pair`] given `dm` (zero where `m` is masked): adds to `dx`, `dy` and `dgam`.
#[allow(clippy::too_many_arguments)]
fn pair_backward(
    x: &[f32],
    y: &[f32],
    gam: &[f32],
    l: usize,
    z: Sizes,
    dm: &mut [f32],
    dx: &mut [f32],
    dy: &mut [f32],
    dgam: &mut [f32],
    pw: &mut PairWork,
) {
    let (dk, gd) = (z.dk, z.gd);
    resize(&mut pw.dx, l * dk);
    resize(&mut pw.dy, l * dk);
    if gd == 1 {
        for i in 0..l {
            for j in 0..=i {
                dm[i * l + j] *= (gam[i] - gam[j]).exp();
            }
        }
        mm(l, dk, l, dm, l, 1, y, dk, 1, &mut pw.dx, false);
        mm(l, dk, l, dm, 1, l, x, dk, 1, &mut pw.dy, false);
    } else {
        factor(x, y, gam, l, dk, pw);
        pw.m = dm.to_vec();
        for i in 0..l {
            for j in 0..=i {
                if pw.flag[i] || pw.flag[j] {
                    pw.m[i * l + j] = 0.0;
                }
            }
        }
        mm(l, dk, l, &pw.m, l, 1, &pw.yr, dk, 1, &mut pw.dx, false);
        mm(l, dk, l, &pw.m, 1, l, &pw.xr, dk, 1, &mut pw.dy, false);
        for n in 0..l * dk {
            if pw.flag[n / dk] {
                continue;
            }
            let rel = gam[n] - gam[n % dk];
            pw.dx[n] *= rel.exp();
            pw.dy[n] *= (-rel).exp();
        }
        for i in 0..l {
            for j in 0..=i {
                let g = dm[i * l + j];
                if !(pw.flag[i] || pw.flag[j]) || g == 0.0 {
                    continue;
                }
                for d in 0..dk {
                    let e = g * (gam[i * dk + d] - gam[j * dk + d]).exp();
                    pw.dx[i * dk + d] += e * y[j * dk + d];
                    pw.dy[j * dk + d] += e * x[i * dk + d];
                }
            }
        }
    }
    for i in 0..l {
        for d in 0..dk {
            let n = i * dk + d;
            dgam[i * gd + ch(d, gd)] += x[n] * pw.dx[n] - y[n] * pw.dy[n];
            dx[n] += pw.dx[n];
            dy[n] += pw.dy[n];
        }
    }
}

/// Forward of one chunk: writes its `l` output rows to `o` and advances `s` to the state after
/// the chunk.
pub(crate) fn forward(c: &Rows, s: &mut [f32], o: &mut [f32], z: Sizes, w: &mut Work) {
    let (l, dk, dv, gd) = (c.l, z.dk, z.dv, z.gd);
    w.prepare(c, s, z);
    mm(l, dv, dk, &w.qe, dk, 1, s, dv, 1, o, false);
    mm(l, dv, l, &w.p, l, 1, &w.vn, dv, 1, o, true);
    for d in 0..dk {
        let e = w.eg_last[ch(d, gd)];
        for x in &mut s[d * dv..(d + 1) * dv] {
            *x *= e;
        }
    }
    mm(dk, dv, l, &w.ke, 1, dk, &w.vn, dv, 1, s, true);
}

/// Backward of one chunk that entered with state `s`: given the output rows' gradient `d_o` and
/// the gradient `ds` of the state after the chunk, adds the rows' gradients to `gr` and replaces
/// `ds` with the gradient of the entering state.
pub(crate) fn backward(
    c: &Rows,
    s: &[f32],
    d_o: &[f32],
    ds: &mut [f32],
    gr: RowGrads,
    z: Sizes,
    w: &mut Work,
) {
    let (l, dk, dv, gd) = (c.l, z.dk, z.dv, z.gd);
    w.prepare(c, s, z);
    let mut dgam = vec![0f32; l * gd];
    let mut dlast = vec![0f32; gd];

    // dV' = Pᵀ dO + Ke dS'
    let mut dvn = vec![0f32; l * dv];
    mm(l, dv, l, &w.p, 1, l, d_o, dv, 1, &mut dvn, false);
    mm(l, dv, dk, &w.ke, dk, 1, ds, dv, 1, &mut dvn, true);
    // dP = dO V'ᵀ on the kept (j ≤ i) entries
    let mut dp = vec![0f32; l * l];
    mm(l, l, dv, d_o, dv, 1, &w.vn, 1, dv, &mut dp, false);
    for i in 0..l {
        dp[i * l + i + 1..(i + 1) * l].fill(0.0);
    }
    // Through Qe = Q ⊙ e^γ
    let mut t = vec![0f32; l * dk];
    mm(l, dk, dv, d_o, dv, 1, s, 1, dv, &mut t, false);
    for i in 0..l {
        for d in 0..dk {
            let (n, e) = (i * dk + d, i * gd + ch(d, gd));
            gr.q[n] += t[n] * w.eg[e];
            dgam[e] += t[n] * w.qe[n];
        }
    }
    // Through Ke = K ⊙ e^{Γ−γ}
    mm(l, dk, dv, &w.vn, dv, 1, ds, 1, dv, &mut t, false);
    for i in 0..l {
        for d in 0..dk {
            let (n, e) = (i * dk + d, i * gd + ch(d, gd));
            gr.k[n] += t[n] * w.eg_rest[e];
            let x = t[n] * w.ke[n];
            dgam[e] -= x;
            dlast[ch(d, gd)] += x;
        }
    }
    // Through e^Γ ⊙ S
    for d in 0..dk {
        let row: f32 = (0..dv).map(|e| s[d * dv + e] * ds[d * dv + e]).sum();
        dlast[ch(d, gd)] += w.eg_last[ch(d, gd)] * row;
    }
    // dS = Qeᵀ dO + e^Γ ⊙ dS' − Wᵀ dV'
    let mut ds_in = vec![0f32; dk * dv];
    mm(dk, dv, l, &w.qe, 1, dk, d_o, dv, 1, &mut ds_in, false);
    for d in 0..dk {
        let e = w.eg_last[ch(d, gd)];
        for n in d * dv..(d + 1) * dv {
            ds_in[n] += e * ds[n];
        }
    }
    let mut tmp = vec![0f32; dk * dv];
    mm(dk, dv, l, &w.w, 1, dk, &dvn, dv, 1, &mut tmp, false);
    for (a, b) in ds_in.iter_mut().zip(&tmp) {
        *a -= b;
    }
    // dW = −dV' Sᵀ, dU = dV'
    let mut dw = vec![0f32; l * dk];
    mm(l, dk, dv, &dvn, dv, 1, s, 1, dv, &mut dw, false);
    dw.iter_mut().for_each(|x| *x = -*x);
    // dT = dU Vbᵀ + dW Kbeᵀ; dVb = Tᵀ dU; dKbe = Tᵀ dW
    let mut dt = vec![0f32; l * l];
    mm(l, l, dv, &dvn, dv, 1, &w.vb, 1, dv, &mut dt, false);
    mm(l, l, dk, &dw, dk, 1, &w.kbe, 1, dk, &mut dt, true);
    let mut dvb = vec![0f32; l * dv];
    mm(l, dv, l, &w.t, 1, l, &dvn, dv, 1, &mut dvb, false);
    let mut dkbe = vec![0f32; l * dk];
    mm(l, dk, l, &w.t, 1, l, &dw, dk, 1, &mut dkbe, false);
    // dA = −Tᵀ dT Tᵀ, strictly lower
    let mut tt = vec![0f32; l * l];
    mm(l, l, l, &w.t, 1, l, &dt, l, 1, &mut tt, false);
    let mut da = vec![0f32; l * l];
    mm(l, l, l, &tt, l, 1, &w.t, 1, l, &mut da, false);
    for i in 0..l {
        for j in 0..l {
            da[i * l + j] = if j < i { -da[i * l + j] } else { 0.0 };
        }
    }
    // Vb = diag(β) V, Kbe = diag(β) K ⊙ e^γ
    for i in 0..l {
        let mut db = 0.0;
        for e in 0..dv {
            let n = i * dv + e;
            gr.v[n] += c.beta[i] * dvb[n];
            db += dvb[n] * c.v[n];
        }
        for d in 0..dk {
            let (n, e) = (i * dk + d, i * gd + ch(d, gd));
            gr.k[n] += c.beta[i] * w.eg[e] * dkbe[n];
            db += dkbe[n] * c.k[n] * w.eg[e];
            dgam[e] += dkbe[n] * w.kbe[n];
        }
        // A = diag(β) R
        for j in 0..i {
            db += da[i * l + j] * w.r[i * l + j];
            da[i * l + j] *= c.beta[i];
        }
        gr.beta[i] += db;
    }
    // R = pair(K, K), P = pair(Q, K)
    let mut dk_row = vec![0f32; l * dk];
    let mut dk_col = vec![0f32; l * dk];
    pair_backward(
        c.k,
        c.k,
        &w.gam,
        l,
        z,
        &mut da,
        &mut dk_row,
        &mut dk_col,
        &mut dgam,
        &mut w.pair,
    );
    pair_backward(
        c.q,
        c.k,
        &w.gam,
        l,
        z,
        &mut dp,
        gr.q,
        &mut dk_col,
        &mut dgam,
        &mut w.pair,
    );
    for n in 0..l * dk {
        gr.k[n] += dk_row[n] + dk_col[n];
    }
    // Γ = γ_{l−1}; γ is the running sum of g inside the chunk.
    for e in 0..gd {
        dgam[(l - 1) * gd + e] += dlast[e];
    }
    let mut acc = vec![0f32; gd];
    for i in (0..l).rev() {
        for e in 0..gd {
            acc[e] += dgam[i * gd + e];
            gr.g[i * gd + e] += acc[e];
        }
    }
    ds.copy_from_slice(&ds_in);
}
