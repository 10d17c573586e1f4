//! The AVX2 + FMA micro-kernel: the same `MR × NR` (12 × 32) block of C as the AVX-512 kernel,
//! computed as 6 × 16 sub-blocks in 12 ymm accumulators (16 registers hold a sub-block, its two
//! B vectors and one broadcast; the classic Haswell shape). Each element of C is still one FMA
//! chain over k starting from C's value or zero, and a lane's fused multiply-add rounds the same
//! at any vector width, so this kernel gives the AVX-512 kernel's bits: products are
//! row-independent (batch-invariant mode's premise) on AVX2-only CPUs too.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{MR, NR};

/// Rows of one sub-block.
const SUB_R: usize = 6;
/// Columns of one sub-block (two ymm vectors).
const SUB_C: usize = 16;

/// `C[R × 16] (+)= A_rows · B[.., col0..col0+16]` over depth `kc`: row `r` of A is read at
/// `a[r] + p·a_step`, row `p` of B at `b + p·b_step + col0`.
///
/// # Safety
/// The CPU supports AVX2 and FMA; the reads and writes lie inside what [`kernel_rows`]'s caller
/// guarantees.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn sub_kernel<const R: usize>(
    kc: usize,
    a: &[*const f32],
    a_step: usize,
    b: *const f32,
    b_step: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    const { assert!(R >= 1 && R <= SUB_R) };
    let mut lo = [_mm256_setzero_ps(); R];
    let mut hi = [_mm256_setzero_ps(); R];
    if accumulate {
        for r in 0..R {
            // SAFETY: row r of C has 16 floats from c (the caller's contract).
            unsafe {
                lo[r] = _mm256_loadu_ps(c.add(r * ldc));
                hi[r] = _mm256_loadu_ps(c.add(r * ldc + 8));
            }
        }
    }
    for p in 0..kc {
        // SAFETY: p < kc, within what the caller guarantees readable.
        unsafe {
            let b0 = _mm256_loadu_ps(b.add(p * b_step));
            let b1 = _mm256_loadu_ps(b.add(p * b_step + 8));
            let off = p * a_step;
            for r in 0..R {
                let x = _mm256_broadcast_ss(&*a[r].add(off));
                lo[r] = _mm256_fmadd_ps(x, b0, lo[r]);
                hi[r] = _mm256_fmadd_ps(x, b1, hi[r]);
            }
        }
    }
    for r in 0..R {
        // SAFETY: as for the loads.
        unsafe {
            _mm256_storeu_ps(c.add(r * ldc), lo[r]);
            _mm256_storeu_ps(c.add(r * ldc + 8), hi[r]);
        }
    }
}

/// Never called: the AVX2 level is never detected off x86-64.
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn sub_kernel<const R: usize>(
    _kc: usize,
    _a: &[*const f32],
    _a_step: usize,
    _b: *const f32,
    _b_step: usize,
    _c: *mut f32,
    _ldc: usize,
    _accumulate: bool,
) {
    unreachable!("the AVX2 kernel is only built for x86-64")
}

/// `C[rows × NR] (+)= A_strip · B_strip`, with the contract of the AVX-512
/// [`super::avx512::kernel_rows`] (rows 1..=MR).
///
/// # Safety
/// The CPU supports AVX2 and FMA; otherwise as for the AVX-512 kernel.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn kernel_rows(
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
    debug_assert!((1..=MR).contains(&rows));
    for r0 in (0..rows).step_by(SUB_R) {
        let sub_rows = SUB_R.min(rows - r0);
        let a_sub = &a[r0..r0 + sub_rows];
        for c0 in (0..NR).step_by(SUB_C) {
            // SAFETY: rows r0.. of the block and columns c0..c0+16 of the strip lie inside
            // the caller's block; `b` advanced by c0 stays inside each row of the strip.
            let (bs, cs) = unsafe { (b.add(c0), c.add(r0 * ldc + c0)) };
            macro_rules! dispatch {
                ($($r:literal)*) => {
                    match sub_rows {
                        // SAFETY: the caller's contract, with R = sub_rows.
                        $($r => unsafe {
                            sub_kernel::<$r>(kc, a_sub, a_step, bs, b_step, cs, ldc, accumulate)
                        },)*
                        _ => unreachable!("sub-block rows {sub_rows} outside 1..={SUB_R}"),
                    }
                };
            }
            dispatch!(1 2 3 4 5 6)
        }
    }
}
