//! Packed f32 matrix products with our own micro-kernels (BLIS-style blocking): AVX-512, and
//! AVX2 + FMA on CPUs without it (the same `MR × NR` block as 6 × 16 sub-blocks, the same bits).
//!
//! Why not only the `gemm` crate: on stable Rust it has AVX2 kernels only, which halves the
//! FMA width on cores with full-width AVX-512 (Intel, Zen 5); and it picks code paths by
//! size, so a row's result depends on how many rows the product has. On Zen 4 (512-bit ops
//! run as two 256-bit halves) both reach about the same FMA throughput in f32; measure with
//! `examples/gemm_bench.rs`. A transposed operand (the `dA = dC·Bᵀ`, `dB = Aᵀ·dC` products of
//! backward) is packed once into the layout the micro-kernel streams (`MR`-row strips of A,
//! `NR`-column strips of B, k-major), so the kernel never sees a stride.
//!
//! A row-major A is read in place (each kernel row streams one row of A); any other A is
//! packed per task. Loop nest, for `C[m×n] = A[m×k]·B[k×n]` (row-major C):
//! ```text
//! for each KC block of k:
//!   for each NC block of columns:         pack B[kc, nc] (shared by all tasks)
//!     parallel over MC×NT tiles:          pack the tile's A rows unless A is row-major;
//!                                         MR×NR micro-kernels, C += A_strip · B_strip
//! ```
//! Determinism: every element of C is `C + Σ_k a·b` as one FMA chain per KC block, the blocks
//! added in order; tiles only decide *who* computes an element, never *how*. So results are
//! bitwise identical for any thread count, and a row's result does not depend on how many
//! rows the product has or where the row sits (what batch-invariant mode needs).

mod avx2;
mod avx512;
pub(crate) mod bf16;
pub(crate) mod pack_cache;

use super::simd::{self, SimdLevel};
use crate::alloc::Buffer;
use rayon::prelude::*;

/// Rows of C per micro-kernel.
pub(crate) const MR: usize = avx512::MR;
/// Columns of C per micro-kernel.
pub(crate) const NR: usize = avx512::NR;
/// Depth of one packed block: an `MR × KC` strip of A (12 KiB) stays in L1.
const KC: usize = 256;
/// Columns of B packed at once (`KC × NC` floats, 2 MiB at most, in L2/L3).
const NC: usize = 2048;
/// Rows per parallel task (a multiple of `MR`).
const MC: usize = 8 * MR;
/// Columns per parallel task (a multiple of `NR`).
const NT: usize = 8 * NR;
/// Below this many multiply-adds a product runs on the calling thread: waking the pool costs
/// more than it saves (a decode step's products are this small).
const PARALLEL_MIN_MACS: usize = 1 << 19;
/// Columns per task when the product has a single row block: narrower tasks so that every
/// thread gets work in a decode step.
const NT_FEW_ROWS: usize = 2 * NR;

/// A read-only strided matrix: element `(i, j)` is `data[off + i·rs + j·cs]`.
pub(crate) struct MatRef<'a, T = f32> {
    /// The elements (the matrix lies inside).
    pub data: &'a [T],
    /// Index of element (0, 0).
    pub off: usize,
    /// Row stride.
    pub rs: usize,
    /// Column stride.
    pub cs: usize,
}

impl<T> Clone for MatRef<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for MatRef<'_, T> {}

impl<T> MatRef<'_, T> {
    /// Whether every element of a `rows × cols` matrix lies inside `data`.
    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0
            || cols == 0
            || self.off + (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// Whether this CPU runs a packed kernel (AVX-512, or AVX2 + FMA); else callers use the `gemm`
/// crate and batch-invariant mode pads products to fixed tiles.
pub(crate) fn available() -> bool {
    matches!(simd::level(), SimdLevel::Avx512 | SimdLevel::Avx2)
}

/// The micro-kernel for this CPU: `C[rows × NR] (+)= A_strip · B_strip` (see
/// [`avx512::kernel_rows`] for the operands). Both kernels give the same bits.
///
/// # Safety
/// As for [`avx512::kernel_rows`]; [`available`] holds.
#[allow(clippy::too_many_arguments)]
unsafe fn kernel_rows(
    rows: usize,
    kc: usize,
    a: &[*const f32; MR],
    a_step: usize,
    b: *const f32,
    b_step: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // SAFETY: the caller's contract; the level says which instructions the CPU has.
    unsafe {
        if simd::level() == SimdLevel::Avx512 {
            avx512::kernel_rows(rows, kc, a, a_step, b, b_step, c, ldc, accumulate)
        } else {
            avx2::kernel_rows(rows, kc, a, a_step, b, b_step, c, ldc, accumulate)
        }
    }
}

/// `c[m×n] = a[m×k] · b[k×n]` with `c` row-major and contiguous. Spreads over the rayon pool
/// when `parallel`; the result is the same either way. `b_source` names where B lives, so a B
/// that stays unchanged across calls is packed once (see [`pack_cache`]); the result is the
/// same with or without it. Panics if an operand does not fit its slice or the CPU lacks
/// both kernels (callers check [`available`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    a: MatRef<'_>,
    b: MatRef<'_>,
    b_source: Option<&pack_cache::Source>,
    c: &mut [f32],
    parallel: bool,
) {
    sgemm_into(m, n, k, a, b, b_source, c, false, parallel)
}

/// [`sgemm`], adding to `c` when `accumulate` (each element's FMA chain then starts from its
/// value in `c`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm_into(
    m: usize,
    n: usize,
    k: usize,
    a: MatRef<'_>,
    b: MatRef<'_>,
    b_source: Option<&pack_cache::Source>,
    c: &mut [f32],
    accumulate: bool,
    parallel: bool,
) {
    assert!(available(), "sgemm needs AVX-512 or AVX2 + FMA");
    assert!(
        a.fits(m, k) && b.fits(k, n) && c.len() == m * n,
        "sgemm operands out of bounds"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return;
    }
    let parallel = parallel && m * n * k >= PARALLEL_MIN_MACS;
    // A row-major A is read in place (each kernel row streams one row of A: measured no
    // slower than packing, which costs a scatter); other layouts are packed per task.
    let direct_a = a.cs == 1;
    let cached = b_source.and_then(|src| pack_cache::get(src, b, parallel));
    // A row-major B whose strips are all full is read in place when there is one strip of
    // rows (each element of B is then loaded once either way, and packing would double that).
    let direct_b = cached.is_none() && b.cs == 1 && n.is_multiple_of(NR) && m <= MR;
    let mut pb = if cached.is_some() || direct_b {
        Buffer::any(0)
    } else {
        Buffer::any(NC.min(n).div_ceil(NR) * NR * KC.min(k) * 4)
    };
    let c_addr = c.as_mut_ptr() as usize;
    let tiles_m = m.div_ceil(MC);
    let nt = if tiles_m == 1 && parallel {
        NT_FEW_ROWS
    } else {
        NT
    };
    for (kb, p0) in (0..k).step_by(KC).enumerate() {
        let kc = KC.min(k - p0);
        for j0 in (0..n).step_by(NC) {
            let nc = NC.min(n - j0);
            let bsrc = match &cached {
                Some(packed) => BStrips::Packed(packed.block(p0, j0, kc, nc)),
                None if direct_b => BStrips::InPlace {
                    b,
                    first: b.off + p0 * b.rs + j0,
                },
                None => {
                    let strips_n = nc.div_ceil(NR);
                    let pb = &mut bytemuck::cast_slice_mut::<u8, f32>(pb.as_bytes_mut())
                        [..strips_n * NR * kc];
                    pack_b(b, n, p0, j0, kc, nc, pb, parallel);
                    BStrips::Packed(pb)
                }
            };
            let bsrc = &bsrc;
            let tiles_n = nc.div_ceil(nt);
            let tile = |t: usize| {
                let (ti, tj) = (t / tiles_n, t % tiles_n);
                let rows = ti * MC..(ti * MC + MC).min(m);
                let cols = tj * nt..(tj * nt + nt).min(nc);
                let block = Block {
                    a,
                    direct_a,
                    p0,
                    kc,
                    j0,
                    ldc: n,
                    accumulate: kb > 0 || accumulate,
                };
                // SAFETY: tiles cover disjoint blocks of C (rows × j0+cols), so no element is
                // written by two tasks; `c` outlives the parallel loop.
                unsafe { compute_tile(&block, bsrc, rows, cols, c_addr as *mut f32) }
            };
            if parallel {
                (0..tiles_m * tiles_n).into_par_iter().for_each(tile);
            } else {
                (0..tiles_m * tiles_n).for_each(tile);
            }
        }
    }
}

/// Where one (KC block, NC block) of B is read from.
enum BStrips<'a> {
    /// Packed NR-column strips, k-major (see [`pack_b`]).
    Packed(&'a [f32]),
    /// A row-major B read in place; `first` indexes element (p0, j0).
    InPlace { b: MatRef<'a>, first: usize },
}

/// What every task of one (KC block, NC block) shares.
struct Block<'a> {
    a: MatRef<'a>,
    /// Read A's rows in place instead of packing them.
    direct_a: bool,
    /// First column of A (row of B) of this KC block.
    p0: usize,
    /// Depth of this block.
    kc: usize,
    /// First column of C of this NC block.
    j0: usize,
    /// Row stride of C.
    ldc: usize,
    /// Add to C (every KC block after the first).
    accumulate: bool,
}

/// Zeros the kernel reads for rows past the end of a row-major A (an edge strip).
static ZERO_ROW: [f32; KC] = [0.0; KC];

/// Runs the micro-kernels of one task's block of C.
///
/// # Safety
/// `c` points to a row-major `m × ldc` matrix of which this call alone writes the block
/// `rows × (j0 + cols)`; `bsrc` holds the block's B (packed as by [`pack_b`] for its depth, or
/// in place).
unsafe fn compute_tile(
    blk: &Block<'_>,
    bsrc: &BStrips<'_>,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    c: *mut f32,
) {
    let (kc, ldc, accumulate) = (blk.kc, blk.ldc, blk.accumulate);
    let a = blk.a;
    let m_end = rows.end;
    PACKED_A.with_borrow_mut(|packed| {
        if !blk.direct_a {
            packed.resize(MC * KC, 0.0);
            pack_a_block(
                a,
                rows.clone(),
                blk.p0,
                kc,
                &mut packed[..rows.len().div_ceil(MR) * MR * kc],
            );
        }
        for i in rows.clone().step_by(MR) {
            let mr = MR.min(m_end - i);
            let (a_rows, a_step) = if blk.direct_a {
                let mut r = [ZERO_ROW.as_ptr(); MR];
                for (k, row) in r.iter_mut().enumerate().take(mr) {
                    let start = a.off + (i + k) * a.rs + blk.p0;
                    // Bounds: the whole row segment lies inside A (checked by `fits`).
                    *row = a.data[start..start + kc].as_ptr();
                }
                (r, 1)
            } else {
                let s = &packed[((i - rows.start) / MR) * MR * kc..][..MR * kc];
                (std::array::from_fn(|r| s[r..].as_ptr()), MR)
            };
            for j in cols.clone().step_by(NR) {
                let nr = NR.min(cols.end - j);
                let (b_strip, b_step) = match *bsrc {
                    BStrips::Packed(pb) => (pb[(j / NR) * NR * kc..][..NR * kc].as_ptr(), NR),
                    // Bounds: rows p0..p0+kc, columns j0+j..+NR of B lie inside it (`fits`,
                    // and n is a multiple of NR on this path).
                    BStrips::InPlace { b, first } => {
                        let start = first + j;
                        (b.data[start..start + (kc - 1) * b.rs + NR].as_ptr(), b.rs)
                    }
                };
                // SAFETY: (i, j0 + j) and the mr × nr block after it are inside this task's block.
                let dst = unsafe { c.add(i * ldc + blk.j0 + j) };
                if nr == NR {
                    // SAFETY: mr rows of NR elements at stride ldc, all in bounds.
                    unsafe {
                        kernel_rows(
                            mr, kc, &a_rows, a_step, b_strip, b_step, dst, ldc, accumulate,
                        )
                    };
                } else {
                    // Edge columns: the same kernel on a full-width copy (each element is the
                    // same FMA chain, so edge elements round exactly like interior ones).
                    let mut tmp = [0f32; MR * NR];
                    if accumulate {
                        for r in 0..mr {
                            // SAFETY: row r of the mr × nr block is in bounds.
                            let src = unsafe { std::slice::from_raw_parts(dst.add(r * ldc), nr) };
                            tmp[r * NR..r * NR + nr].copy_from_slice(src);
                        }
                    }
                    // SAFETY: tmp is MR × NR with row stride NR.
                    unsafe {
                        kernel_rows(
                            mr,
                            kc,
                            &a_rows,
                            a_step,
                            b_strip,
                            b_step,
                            tmp.as_mut_ptr(),
                            NR,
                            accumulate,
                        )
                    };
                    for r in 0..mr {
                        // SAFETY: as above.
                        let out = unsafe { std::slice::from_raw_parts_mut(dst.add(r * ldc), nr) };
                        out.copy_from_slice(&tmp[r * NR..r * NR + nr]);
                    }
                }
            }
        }
    });
}

thread_local! {
    /// Each worker's packed block of A (`MC × KC` floats), reused across calls.
    static PACKED_A: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Packs rows `rows` of `a`, columns `p0..p0+kc`, into consecutive k-major strips of `MR`
/// rows (`dst[strip·MR·kc + p·MR + r]`), zero-padding the last strip's missing rows.
fn pack_a_block(
    a: MatRef<'_>,
    rows: std::ops::Range<usize>,
    p0: usize,
    kc: usize,
    dst: &mut [f32],
) {
    let m = rows.len();
    if !m.is_multiple_of(MR) {
        dst[(m / MR) * MR * kc..].fill(0.0);
    }
    let base = a.off + rows.start * a.rs + p0 * a.cs;
    if a.rs == 1 {
        // Column-major A (a transposed operand): each k gives the block's rows contiguously.
        for p in 0..kc {
            let src = &a.data[base + p * a.cs..][..m];
            for (s, chunk) in src.chunks(MR).enumerate() {
                dst[s * MR * kc + p * MR..][..chunk.len()].copy_from_slice(chunk);
            }
        }
    } else if a.cs == 1 {
        // Row-major A: read each row contiguously, write it down its strip's column.
        for r in 0..m {
            let src = &a.data[base + r * a.rs..][..kc];
            let strip = &mut dst[(r / MR) * MR * kc..][..MR * kc];
            for (p, &v) in src.iter().enumerate() {
                strip[p * MR + r % MR] = v;
            }
        }
    } else {
        for r in 0..m {
            let strip = &mut dst[(r / MR) * MR * kc..][..MR * kc];
            for p in 0..kc {
                strip[p * MR + r % MR] = a.data[base + r * a.rs + p * a.cs];
            }
        }
    }
}

/// Packs `b[p0..p0+kc, j0..j0+nc]` into `NR`-column strips, k-major (`strip[p·NR + c]`),
/// zero-padding the last strip's missing columns.
#[allow(clippy::too_many_arguments)]
fn pack_b(
    b: MatRef<'_>,
    n: usize,
    p0: usize,
    j0: usize,
    kc: usize,
    nc: usize,
    out: &mut [f32],
    parallel: bool,
) {
    debug_assert!(j0 + nc <= n);
    let strip = |(s, dst): (usize, &mut [f32])| {
        let c0 = j0 + s * NR;
        let cols = NR.min(j0 + nc - c0);
        if cols < NR {
            dst.fill(0.0);
        }
        let base = b.off + p0 * b.rs + c0 * b.cs;
        if b.cs == 1 {
            // Row-major B: each k gives `cols` contiguous values.
            for p in 0..kc {
                let src = &b.data[base + p * b.rs..][..cols];
                dst[p * NR..p * NR + cols].copy_from_slice(src);
            }
        } else if b.rs == 1 {
            // Column-major B (a transposed weight): read each column contiguously.
            for c in 0..cols {
                let src = &b.data[base + c * b.cs..][..kc];
                for (p, &v) in src.iter().enumerate() {
                    dst[p * NR + c] = v;
                }
            }
        } else {
            for p in 0..kc {
                for c in 0..cols {
                    dst[p * NR + c] = b.data[base + p * b.rs + c * b.cs];
                }
            }
        }
    };
    if parallel {
        out.par_chunks_mut(NR * kc).enumerate().for_each(strip);
    } else {
        out.chunks_mut(NR * kc).enumerate().for_each(strip);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1) with many mantissa bits.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Element (i, j) as one fused multiply-add chain over k, from `init`: what every kernel
    /// must give bit for bit.
    fn chain(a: &MatRef<'_>, b: &MatRef<'_>, i: usize, j: usize, k: usize, init: f32) -> f32 {
        (0..k).fold(init, |s, l| {
            a.data[a.off + i * a.rs + l * a.cs].mul_add(b.data[b.off + l * b.rs + j * b.cs], s)
        })
    }

    #[test]
    fn every_element_is_one_fma_chain_whatever_the_rows_layout_and_threads() {
        if !available() {
            return;
        }
        // Two KC blocks, an edge column strip, row counts around MR and MC, both layouts of
        // each operand, accumulating or not, on one thread and on the pool.
        let (k, n) = (KC + 45, 2 * NR + 7);
        let ad = values(2 * MC * k + 3, 1);
        let bd = values(k * n + 5, 2);
        for m in [1, 5, MR, MR + 1, MC + 3] {
            for (a_t, b_t, accumulate, parallel) in [
                (false, false, false, false),
                (true, false, true, true),
                (false, true, false, true),
                (true, true, true, false),
            ] {
                let a = if a_t {
                    MatRef {
                        data: &ad,
                        off: 3,
                        rs: 1,
                        cs: m,
                    }
                } else {
                    MatRef {
                        data: &ad,
                        off: 3,
                        rs: k,
                        cs: 1,
                    }
                };
                let b = if b_t {
                    MatRef {
                        data: &bd,
                        off: 5,
                        rs: 1,
                        cs: k,
                    }
                } else {
                    MatRef {
                        data: &bd,
                        off: 5,
                        rs: n,
                        cs: 1,
                    }
                };
                let init = values(m * n, 3);
                let mut c = init.clone();
                sgemm_into(m, n, k, a, b, None, &mut c, accumulate, parallel);
                for i in 0..m {
                    for j in 0..n {
                        let start = if accumulate { init[i * n + j] } else { 0.0 };
                        assert_eq!(
                            c[i * n + j].to_bits(),
                            chain(&a, &b, i, j, k, start).to_bits(),
                            "m {m} a_t {a_t} b_t {b_t} acc {accumulate} at ({i}, {j})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_avx2_and_avx512_kernels_give_the_same_bits() {
        #[cfg(target_arch = "x86_64")]
        {
            if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
                return;
            }
            let kc = 37;
            let a_strip = values(MR * kc, 4);
            let b_strip = values(NR * kc, 5);
            let a: [*const f32; MR] = std::array::from_fn(|r| a_strip[r..].as_ptr());
            for rows in 1..=MR {
                for accumulate in [false, true] {
                    let init = values(MR * NR, 6);
                    let mut c = init.clone();
                    // SAFETY: the CPU has AVX2 + FMA; the strips hold MR × kc and NR × kc
                    // floats (packed, steps MR and NR), C holds MR × NR.
                    unsafe {
                        avx2::kernel_rows(
                            rows,
                            kc,
                            &a,
                            MR,
                            b_strip.as_ptr(),
                            NR,
                            c.as_mut_ptr(),
                            NR,
                            accumulate,
                        )
                    };
                    for r in 0..rows {
                        for j in 0..NR {
                            let want = (0..kc)
                                .fold(if accumulate { init[r * NR + j] } else { 0.0 }, |s, p| {
                                    a_strip[p * MR + r].mul_add(b_strip[p * NR + j], s)
                                });
                            assert_eq!(c[r * NR + j].to_bits(), want.to_bits(), "({r}, {j})");
                        }
                    }
                    assert_eq!(
                        c[rows * NR..],
                        init[rows * NR..],
                        "rows past {rows} untouched"
                    );
                    if simd::level() == SimdLevel::Avx512 {
                        let mut c512 = init.clone();
                        // SAFETY: as above, and the CPU has AVX-512F.
                        unsafe {
                            avx512::kernel_rows(
                                rows,
                                kc,
                                &a,
                                MR,
                                b_strip.as_ptr(),
                                NR,
                                c512.as_mut_ptr(),
                                NR,
                                accumulate,
                            )
                        };
                        assert_eq!(c512, c, "rows {rows} accumulate {accumulate}");
                    }
                }
            }
        }
    }
}
