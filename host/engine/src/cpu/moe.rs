//! Grouped matrix products for mixture-of-experts layers: rows sorted by expert, one weight
//! matrix per expert.
//!
//! On AVX-512 or AVX2 each expert's product runs on the packed kernel ([`super::sgemm`]), whose
//! result does not depend on threads or on how rows are split, so experts are scheduled freely:
//! small experts one per task (each packs its weight once), large ones spread over the pool.
//! Elsewhere, work is cut into (expert, block of rows) tasks whose boundaries depend only on the
//! counts, each a single-threaded `gemm`. Either way results are bitwise identical with any
//! thread count.
//! bf16 operands run on the AVX512-BF16 kernel the same way (f32 accumulation) where the CPU
//! has it.

use super::finish;
use super::sgemm::{self, MatRef};
use crate::error::Result;
use crate::storage::Storage;
use crate::{DType, Tensor};
use gemm::Parallelism;
use half::bf16;
use rayon::prelude::*;

/// Rows per task in the forward and input-gradient products.
const ROW_BLOCK: usize = 128;

/// `dst[m, n] = a[m, k] @ b[k, n]` with explicit element strides (row, column) for `a` and `b`;
/// `dst` is row-major.
#[allow(clippy::too_many_arguments)]
fn gemm_strided(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    a: &[f32],
    (a_rs, a_cs): (usize, usize),
    b: &[f32],
    (b_rs, b_cs): (usize, usize),
) {
    assert_eq!(dst.len(), m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        dst.fill(0.0);
        return;
    }
    // Bounds: the farthest element each operand reaches lies inside its slice.
    assert!((m - 1) * a_rs + (k - 1) * a_cs < a.len());
    assert!((k - 1) * b_rs + (n - 1) * b_cs < b.len());
    // SAFETY: the asserts above bound every element gemm reads; dst is exclusively borrowed and
    // sized m*n with row-major strides (n, 1).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// The dtype of a product of `a` and `b` (theirs when shared and floating, else f32).
fn product_dtype(a: &Tensor, b: &Tensor) -> DType {
    if a.dtype() == b.dtype() && a.dtype().is_float() {
        a.dtype()
    } else {
        DType::F32
    }
}

/// Rows `r0..r0+counts[0]` of `x [N, K]` times `w[0]`, the next `counts[1]` rows times `w[1]`,
/// and so on, for `w [E, K, M]`; with `transpose_w` each `w[e]` is used transposed (`x [N, M]`).
pub(crate) fn grouped_matmul(
    x: &Tensor,
    w: &Tensor,
    counts: &[usize],
    transpose_w: bool,
) -> Result<Tensor> {
    let (rows, kx) = (x.shape()[0], x.shape()[1]);
    let (kw, mw) = (w.shape()[1], w.shape()[2]);
    // Per expert: b = w[e] ([kw, mw], strides (mw, 1)) or its transpose ([mw, kw], strides (1, mw)).
    let (inner, cols, b_strides) = if transpose_w {
        (mw, kw, (1, mw))
    } else {
        (kw, mw, (mw, 1))
    };
    debug_assert_eq!(inner, kx);
    let mut out = Storage::any(DType::F32, rows * cols);
    crate::flops::add(2 * (rows * inner * cols) as u64);
    let geo = Geometry {
        kx,
        w_stride: kw * mw,
        inner,
        cols,
        b_strides,
    };
    if x.dtype() == DType::BF16 && w.dtype() == DType::BF16 && sgemm::bf16::available() {
        // bf16 operands on AVX512-BF16 dot products, read in place, f32 accumulation.
        let (xb, wb) = (x.contig::<bf16>(), w.contig::<bf16>());
        packed_forward(
            &xb,
            &wb,
            counts,
            &geo,
            out.as_mut_slice(),
            sgemm::bf16::gemm,
        );
        drop((xb, wb));
        return finish(out, &[rows, cols], DType::BF16);
    }
    let xs = x.contig::<f32>();
    let ws = w.contig::<f32>();
    if sgemm::available() {
        packed_forward(&xs, &ws, counts, &geo, out.as_mut_slice(), sgemm_f32);
        drop((xs, ws));
        return finish(out, &[rows, cols], product_dtype(x, w));
    }
    // (expert, first row, rows) tasks, in row order so their outputs tile `out`.
    let mut tasks = Vec::new();
    let mut r0 = 0;
    for (e, &c) in counts.iter().enumerate() {
        let mut s = 0;
        while s < c {
            let len = ROW_BLOCK.min(c - s);
            tasks.push((e, r0 + s, len));
            s += len;
        }
        r0 += c;
    }
    let mut pieces = Vec::with_capacity(tasks.len());
    let mut rest = out.as_mut_slice::<f32>();
    for &(e, r, len) in &tasks {
        let (head, tail) = rest.split_at_mut(len * cols);
        pieces.push((e, r, len, head));
        rest = tail;
    }
    pieces.into_par_iter().for_each(|(e, r, len, dst)| {
        gemm_strided(
            len,
            cols,
            inner,
            dst,
            &xs[r * kx..(r + len) * kx],
            (kx, 1),
            &ws[e * kw * mw..(e + 1) * kw * mw],
            b_strides,
        );
    });
    drop((xs, ws));
    finish(out, &[rows, cols], product_dtype(x, w))
}

/// The weight gradient of a grouped product: `out[e] = x_e^T @ g_e` for `x [N, K]`, `g [N, M]`,
/// giving `[E, K, M]` (zeros for experts without rows). Tasks are blocks of `ROW_BLOCK` rows of
/// each `out[e]`; each sums over the expert's rows inside one `gemm`.
pub(crate) fn grouped_matmul_weight_grad(
    x: &Tensor,
    g: &Tensor,
    counts: &[usize],
) -> Result<Tensor> {
    let (k, m) = (x.shape()[1], g.shape()[1]);
    let mut out = Storage::any(DType::F32, counts.len() * k * m);
    let rows: usize = counts.iter().sum();
    crate::flops::add(2 * (rows * k * m) as u64);
    if x.dtype() == DType::BF16 && g.dtype() == DType::BF16 && sgemm::bf16::available() {
        let (xb, gb) = (x.contig::<bf16>(), g.contig::<bf16>());
        packed_weight_grad(
            &xb,
            &gb,
            counts,
            (k, m),
            out.as_mut_slice(),
            sgemm::bf16::gemm,
        );
        drop((xb, gb));
        return finish(out, &[counts.len(), k, m], DType::BF16);
    }
    let xs = x.contig::<f32>();
    let gs = g.contig::<f32>();
    if sgemm::available() {
        packed_weight_grad(&xs, &gs, counts, (k, m), out.as_mut_slice(), sgemm_f32);
        drop((xs, gs));
        return finish(out, &[counts.len(), k, m], product_dtype(x, g));
    }
    // (first row of x, rows, first output row within out[e], output rows) per task, in order.
    let mut tasks = Vec::new();
    let mut r0 = 0;
    for &c in counts {
        let mut i = 0;
        while i < k {
            let len = ROW_BLOCK.min(k - i);
            tasks.push((r0, c, i, len));
            i += len;
        }
        r0 += c;
    }
    let mut pieces = Vec::with_capacity(tasks.len());
    let mut rest = out.as_mut_slice::<f32>();
    for &(r, c, i, len) in &tasks {
        let (head, tail) = rest.split_at_mut(len * m);
        pieces.push((r, c, i, len, head));
        rest = tail;
    }
    pieces.into_par_iter().for_each(|(r, c, i, len, dst)| {
        // Rows i..i+len of x_e^T: element (a, row) sits at x[r + row, i + a] → strides (1, k).
        let a = if c == 0 {
            &xs[..0]
        } else {
            &xs[r * k + i..(r + c) * k]
        };
        gemm_strided(len, m, c, dst, a, (1, k), &gs[r * m..(r + c) * m], (m, 1));
    });
    drop((xs, gs));
    finish(out, &[counts.len(), k, m], product_dtype(x, g))
}

/// A packed product `c[m×n] = a[m×k] · b[k×n]` (f32 or bf16 operands, f32 `c`), parallel over
/// the pool when asked; the result does not depend on that choice.
type PackedGemm<T> = fn(usize, usize, usize, MatRef<'_, T>, MatRef<'_, T>, &mut [f32], bool);

/// Sizes of a grouped product: `x [N, kx]` row-major, `w` `[E, ..]` with `w_stride` elements
/// per expert read with `b_strides`, each expert's product `[c, inner] · [inner, cols]`.
struct Geometry {
    kx: usize,
    w_stride: usize,
    inner: usize,
    cols: usize,
    b_strides: (usize, usize),
}

/// The forward (or input-gradient) product on a packed kernel, one product per expert.
/// The packed f32 product without the packed-operand cache (expert slices of a weight are
/// packed per call; a decode step's experts change with its tokens).
fn sgemm_f32(
    m: usize,
    n: usize,
    k: usize,
    a: sgemm::MatRef<'_>,
    b: sgemm::MatRef<'_>,
    c: &mut [f32],
    parallel: bool,
) {
    sgemm::sgemm(m, n, k, a, b, None, c, parallel)
}

fn packed_forward<T: Sync>(
    xs: &[T],
    ws: &[T],
    counts: &[usize],
    geo: &Geometry,
    out: &mut [f32],
    gemm: PackedGemm<T>,
) {
    let rows: usize = counts.iter().sum();
    // One product per expert: rows [r0, r0 + c) of x times w[e] (or its transpose).
    let mut pieces = Vec::with_capacity(counts.len());
    let (mut rest, mut r0) = (out, 0);
    for (e, &c) in counts.iter().enumerate() {
        let (head, tail) = rest.split_at_mut(c * geo.cols);
        pieces.push((e, r0, c, head));
        rest = tail;
        r0 += c;
    }
    per_expert(pieces, rows, |(e, r, c, dst), parallel| {
        let a = MatRef {
            data: xs,
            off: r * geo.kx,
            rs: geo.kx,
            cs: 1,
        };
        let b = MatRef {
            data: ws,
            off: e * geo.w_stride,
            rs: geo.b_strides.0,
            cs: geo.b_strides.1,
        };
        gemm(c, geo.cols, geo.inner, a, b, dst, parallel);
    });
}

/// The weight gradient `out[e] = x_e^T · g_e` on a packed kernel, one product per expert
/// (`x [N, k]`, `g [N, m]`).
fn packed_weight_grad<T: Sync>(
    xs: &[T],
    gs: &[T],
    counts: &[usize],
    (k, m): (usize, usize),
    out: &mut [f32],
    gemm: PackedGemm<T>,
) {
    let rows: usize = counts.iter().sum();
    let mut pieces = Vec::with_capacity(counts.len());
    let (mut rest, mut r0) = (out, 0);
    for &c in counts {
        let (head, tail) = rest.split_at_mut(k * m);
        pieces.push((r0, c, head));
        rest = tail;
        r0 += c;
    }
    per_expert(pieces, rows, |(r, c, dst), parallel| {
        // x_e^T: x's rows read as columns.
        let a = MatRef {
            data: xs,
            off: r * k,
            rs: 1,
            cs: k,
        };
        let b = MatRef {
            data: gs,
            off: r * m,
            rs: m,
            cs: 1,
        };
        gemm(k, m, c, a, b, dst, parallel);
    });
}

/// Runs one product per expert (`run(piece, spread_over_pool)`). Experts holding more than `1 / threads` of all `rows` run one after
/// another, each spread over the pool (one task could not balance them); the rest run one
/// expert per task. The packed kernel's result is the same either way, so this choice never
/// changes a bit.
fn per_expert<P: Send + RowCount>(pieces: Vec<P>, rows: usize, run: impl Fn(P, bool) + Sync) {
    let threads = rayon::current_num_threads();
    if threads <= 1 {
        pieces.into_iter().for_each(|p| run(p, false));
        return;
    }
    let (big, small): (Vec<P>, Vec<P>) =
        pieces.into_iter().partition(|p| p.rows() * threads > rows);
    big.into_iter().for_each(|p| run(p, true));
    small.into_par_iter().for_each(|p| run(p, false));
}

/// The rows of x an expert's product covers (its count).
trait RowCount {
    fn rows(&self) -> usize;
}

impl RowCount for (usize, usize, usize, &mut [f32]) {
    fn rows(&self) -> usize {
        self.2
    }
}

impl RowCount for (usize, usize, &mut [f32]) {
    fn rows(&self) -> usize {
        self.1
    }
}
