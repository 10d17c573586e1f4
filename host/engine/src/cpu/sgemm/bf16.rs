//! bf16 × bf16 → f32 matrix products on AVX512-BF16 (`vdpbf16ps`): each instruction multiplies
//! 16 pairs of bf16 values and adds both products to 16 f32 accumulators, twice the work of an
//! f32 FMA per instruction. Accumulation is f32 throughout (mixed precision: bf16 inputs, f32
//! sums).
//!
//! Same blocking as the f32 kernel (see the parent module), over pairs of k: both operands are
//! packed as 32-bit words holding `(x[k], x[k+1])` (a zero in the high half when k is odd),
//! A in `MR`-row strips per task, B in `NR`-column strips shared by all tasks. The same
//! determinism holds: one fixed chain per element per KC block, blocks added in order, so
//! results do not depend on the thread count or on where a row sits.

use super::MatRef;
use crate::alloc::Buffer;
use half::bf16;
use rayon::prelude::*;

/// Rows of C per micro-kernel.
const MR: usize = 12;
/// Columns of C per micro-kernel (two zmm of f32).
const NR: usize = 32;
/// k values per block (an `MR`-row strip is 12 KiB of pairs).
const KC: usize = 512;
/// Columns of B packed at once.
const NC: usize = 2048;
/// Rows per parallel task.
const MC: usize = 8 * MR;
/// Columns per parallel task.
const NT: usize = 8 * NR;

/// Whether this CPU has the `vdpbf16ps` instruction (and AVX-512F around it).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            super::simd::level() == super::SimdLevel::Avx512
                && std::arch::is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The 32-bit word of a pair: `lo` in the low half (the even k), `hi` in the high half.
#[inline(always)]
fn pair(lo: bf16, hi: bf16) -> u32 {
    lo.to_bits() as u32 | (hi.to_bits() as u32) << 16
}

/// `c[m×n] = a[m×k] · b[k×n]` (bf16 operands, f32 `c`, row-major and contiguous).
/// Panics if an operand does not fit or the CPU lacks AVX512-BF16 (check [`available`]).
pub(crate) fn gemm(
    m: usize,
    n: usize,
    k: usize,
    a: MatRef<'_, bf16>,
    b: MatRef<'_, bf16>,
    c: &mut [f32],
    parallel: bool,
) {
    assert!(available(), "bf16 gemm needs AVX512-BF16");
    assert!(
        a.fits(m, k) && b.fits(k, n) && c.len() == m * n,
        "bf16 gemm operands out of bounds"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    // A row-major A with an even k already holds its pairs as adjacent bf16 (the even k in the
    // low half): the kernel reads its rows in place instead of repacking them for every
    // column tile.
    let direct_a = a.cs == 1 && k.is_multiple_of(2);
    let kq_max = KC.min(k).div_ceil(2);
    let mut pb = Buffer::any(NC.min(n).div_ceil(NR) * NR * kq_max * 4);
    let c_addr = c.as_mut_ptr() as usize;
    for (kb, p0) in (0..k).step_by(KC).enumerate() {
        let kc = KC.min(k - p0);
        let kq = kc.div_ceil(2);
        for j0 in (0..n).step_by(NC) {
            let nc = NC.min(n - j0);
            let pb = &mut bytemuck::cast_slice_mut::<u8, u32>(pb.as_bytes_mut())
                [..nc.div_ceil(NR) * NR * kq];
            pack_b(b, p0, j0, kc, nc, pb, parallel);
            let pb = &*pb;
            let (tiles_m, tiles_n) = (m.div_ceil(MC), nc.div_ceil(NT));
            let tile = |t: usize| {
                let (ti, tj) = (t / tiles_n, t % tiles_n);
                let rows = ti * MC..(ti * MC + MC).min(m);
                let cols = tj * NT..(tj * NT + NT).min(nc);
                let run = |asrc: ASource<'_>| {
                    // SAFETY: tiles write disjoint blocks of C; `c` outlives the loop.
                    unsafe {
                        compute_tile(
                            asrc,
                            pb,
                            kq,
                            rows.clone(),
                            cols.clone(),
                            j0,
                            n,
                            c_addr as *mut f32,
                            kb > 0,
                        )
                    }
                };
                if direct_a {
                    run(ASource::InPlace { a, p0 });
                } else {
                    PACKED_A.with_borrow_mut(|pa| {
                        pa.resize(MC * KC.div_ceil(2), 0);
                        let pa = &mut pa[..rows.len().div_ceil(MR) * MR * kq];
                        pack_a(a, rows.clone(), p0, kc, pa);
                        run(ASource::Packed(pa));
                    });
                }
            };
            if parallel {
                (0..tiles_m * tiles_n).into_par_iter().for_each(tile);
            } else {
                (0..tiles_m * tiles_n).for_each(tile);
            }
        }
    }
}

/// Where a task's rows of A are read from.
#[derive(Clone, Copy)]
enum ASource<'a> {
    /// Packed by [`pack_a`] for this task.
    Packed(&'a [u32]),
    /// A row-major A read in place from column `p0` (k even).
    InPlace { a: MatRef<'a, bf16>, p0: usize },
}

/// Pairs of zeros the kernel reads for rows past the end of an in-place A.
static ZERO_PAIRS: [u32; KC / 2] = [0; KC / 2];

thread_local! {
    /// Each worker's packed block of A, reused across calls.
    static PACKED_A: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The micro-kernels of one task's block of C.
///
/// # Safety
/// `c` points to a row-major matrix with row stride `ldc` of which this call alone writes
/// `rows × (j0 + cols)`; `pa` holds the task's rows packed by [`pack_a`] and `pb` the block's
/// columns packed by [`pack_b`], both over `kq` pairs.
#[allow(clippy::too_many_arguments)]
unsafe fn compute_tile(
    asrc: ASource<'_>,
    pb: &[u32],
    kq: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    j0: usize,
    ldc: usize,
    c: *mut f32,
    accumulate: bool,
) {
    for i in rows.clone().step_by(MR) {
        let mr = MR.min(rows.end - i);
        let (a_rows, a_step) = match asrc {
            ASource::Packed(pa) => {
                let strip = pa[((i - rows.start) / MR) * MR * kq..][..MR * kq].as_ptr();
                // SAFETY: r < MR, inside the strip.
                (std::array::from_fn(|r| unsafe { strip.add(r) }), MR)
            }
            ASource::InPlace { a, p0 } => {
                let mut ptrs = [ZERO_PAIRS.as_ptr(); MR];
                for (r, ptr) in ptrs.iter_mut().enumerate().take(mr) {
                    let start = a.off + (i + r) * a.rs + p0;
                    // Bounds: the row's 2·kq values lie inside A (`fits`, and k is even).
                    *ptr = a.data[start..start + 2 * kq].as_ptr().cast::<u32>();
                }
                (ptrs, 1)
            }
        };
        for j in cols.clone().step_by(NR) {
            let nr = NR.min(cols.end - j);
            let b_strip = pb[(j / NR) * NR * kq..][..NR * kq].as_ptr();
            // SAFETY: inside this task's block of C.
            let dst = unsafe { c.add(i * ldc + j0 + j) };
            if mr == MR && nr == NR {
                // SAFETY: a full MR × NR tile in bounds; strips hold kq pairs.
                unsafe { kernel(kq, &a_rows, a_step, b_strip, dst, ldc, accumulate) };
            } else {
                // Edge tile through a full-size copy: edge rows round like interior ones.
                let mut tmp = [0f32; MR * NR];
                if accumulate {
                    for r in 0..mr {
                        // SAFETY: row r of the block is in bounds.
                        let src = unsafe { std::slice::from_raw_parts(dst.add(r * ldc), nr) };
                        tmp[r * NR..r * NR + nr].copy_from_slice(src);
                    }
                }
                // SAFETY: tmp is MR × NR with stride NR.
                unsafe {
                    kernel(
                        kq,
                        &a_rows,
                        a_step,
                        b_strip,
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
}

/// `C[MR×NR] (+)= A·B` over `kq` pairs of k: row `r`'s pair `q` is the (possibly unaligned)
/// word at `a[r] + q·a_step`, and `b[q·NR + c]` are pair words.
///
/// # Safety
/// AVX512-BF16 is available; each `a[r] + q·a_step` for `q < kq` is readable, `b` holds
/// `kq·NR` words; `c` has MR rows of NR writable floats at stride `ldc`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel(
    kq: usize,
    a: &[*const u32; MR],
    a_step: usize,
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    use std::arch::x86_64::*;
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    if accumulate {
        for r in 0..MR {
            // SAFETY: the caller's contract on c.
            unsafe {
                lo[r] = _mm512_loadu_ps(c.add(r * ldc));
                hi[r] = _mm512_loadu_ps(c.add(r * ldc + 16));
            }
        }
    }
    for q in 0..kq {
        // SAFETY: q < kq, within both strips.
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(q * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(q * NR + 16).cast()));
            let off = q * a_step;
            for r in 0..MR {
                let word = a[r].add(off).read_unaligned();
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(word as i32));
                lo[r] = _mm512_dpbf16_ps(lo[r], x, b0);
                hi[r] = _mm512_dpbf16_ps(hi[r], x, b1);
            }
        }
    }
    for r in 0..MR {
        // SAFETY: as for the loads.
        unsafe {
            _mm512_storeu_ps(c.add(r * ldc), lo[r]);
            _mm512_storeu_ps(c.add(r * ldc + 16), hi[r]);
        }
    }
}

/// Never called: [`available`] is false off x86-64.
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(
    _: usize,
    _: &[*const u32; MR],
    _: usize,
    _: *const u32,
    _: *mut f32,
    _: usize,
    _: bool,
) {
    unreachable!("the AVX512-BF16 kernel is only built for x86-64")
}

/// Packs rows `rows` of `a`, k in `p0..p0+kc`, into `MR`-row strips of pair words
/// (`dst[strip·MR·kq + q·MR + r]`), zero-padding missing rows and an odd last k.
fn pack_a(
    a: MatRef<'_, bf16>,
    rows: std::ops::Range<usize>,
    p0: usize,
    kc: usize,
    dst: &mut [u32],
) {
    let kq = kc.div_ceil(2);
    let m = rows.len();
    if !m.is_multiple_of(MR) {
        dst[(m / MR) * MR * kq..].fill(0);
    }
    let at = |i: usize, p: usize| -> bf16 {
        if p < kc {
            a.data[a.off + (rows.start + i) * a.rs + (p0 + p) * a.cs]
        } else {
            bf16::ZERO
        }
    };
    if a.cs == 1 {
        // Row-major: a row's pairs are adjacent in memory.
        for i in 0..m {
            let row = &a.data[a.off + (rows.start + i) * a.rs + p0..][..kc];
            let strip = &mut dst[(i / MR) * MR * kq..][..MR * kq];
            for q in 0..kq {
                let hi = row.get(2 * q + 1).copied().unwrap_or(bf16::ZERO);
                strip[q * MR + i % MR] = pair(row[2 * q], hi);
            }
        }
    } else if a.rs == 1 {
        // Column-major A (the transposed activations of a weight gradient): each k gives the
        // rows contiguously, so a pair is two contiguous runs zipped.
        // The odd last k pairs with zeros (allocated only then).
        let zeros = if kc.is_multiple_of(2) {
            Vec::new()
        } else {
            vec![bf16::ZERO; m]
        };
        for q in 0..kq {
            let run = |p: usize| -> &[bf16] {
                if p < kc {
                    &a.data[a.off + rows.start + (p0 + p) * a.cs..][..m]
                } else {
                    &zeros
                }
            };
            let (even, odd) = (run(2 * q), run(2 * q + 1));
            for (s, (e, o)) in even.chunks(MR).zip(odd.chunks(MR)).enumerate() {
                let words = &mut dst[s * MR * kq + q * MR..][..e.len()];
                for ((w, &lo), &hi) in words.iter_mut().zip(e).zip(o) {
                    *w = pair(lo, hi);
                }
            }
        }
    } else {
        for i in 0..m {
            let strip = &mut dst[(i / MR) * MR * kq..][..MR * kq];
            for q in 0..kq {
                strip[q * MR + i % MR] = pair(at(i, 2 * q), at(i, 2 * q + 1));
            }
        }
    }
}

/// Packs `b[p0..p0+kc, j0..j0+nc]` into `NR`-column strips of pair words
/// (`dst[strip·NR·kq + q·NR + c]`), zero-padding missing columns and an odd last k.
fn pack_b(
    b: MatRef<'_, bf16>,
    p0: usize,
    j0: usize,
    kc: usize,
    nc: usize,
    out: &mut [u32],
    parallel: bool,
) {
    let kq = kc.div_ceil(2);
    let strip = |(s, dst): (usize, &mut [u32])| {
        let c0 = j0 + s * NR;
        let cols = NR.min(j0 + nc - c0);
        if cols < NR {
            dst.fill(0);
        }
        let at = |p: usize, c: usize| -> bf16 {
            if p < kc {
                b.data[b.off + (p0 + p) * b.rs + (c0 + c) * b.cs]
            } else {
                bf16::ZERO
            }
        };
        if b.rs == 1 {
            // Column-major B (a transposed weight): a column's pairs are adjacent.
            for c in 0..cols {
                let col = &b.data[b.off + p0 + (c0 + c) * b.cs..][..kc];
                for q in 0..kq {
                    let hi = col.get(2 * q + 1).copied().unwrap_or(bf16::ZERO);
                    dst[q * NR + c] = pair(col[2 * q], hi);
                }
            }
        } else if b.cs == 1 {
            // Row-major B: each k gives the strip's columns contiguously.
            let zeros = [bf16::ZERO; NR];
            for q in 0..kq {
                let run = |p: usize| -> &[bf16] {
                    if p < kc {
                        &b.data[b.off + (p0 + p) * b.rs + c0..][..cols]
                    } else {
                        &zeros[..cols]
                    }
                };
                let words = &mut dst[q * NR..][..cols];
                for ((w, &lo), &hi) in words.iter_mut().zip(run(2 * q)).zip(run(2 * q + 1)) {
                    *w = pair(lo, hi);
                }
            }
        } else {
            for q in 0..kq {
                for c in 0..cols {
                    dst[q * NR + c] = pair(at(2 * q, c), at(2 * q + 1, c));
                }
            }
        }
    };
    if parallel {
        out.par_chunks_mut(NR * kq).enumerate().for_each(strip);
    } else {
        out.chunks_mut(NR * kq).enumerate().for_each(strip);
    }
}
