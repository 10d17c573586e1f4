//! The AVX-512 micro-kernel: a 12 × 32 block of C in 24 zmm accumulators. Each step of k
//! loads two vectors of the B strip, broadcasts twelve values of the A strip, and issues 24
//! FMAs; 24 independent chains hide the FMA latency, and 32 registers hold everything. Fewer
//! rows (the last strip of a product, a decode step's handful of rows) run the same code with
//! `R < MR` rows: each element of C is the same FMA chain, so the same bits, at the cost of the
//! rows present only.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Rows of C per call.
pub(crate) const MR: usize = 12;
/// Columns of C per call (two zmm vectors).
pub(crate) const NR: usize = 32;

/// `C[R×NR] (+)= A_strip · B_strip` over depth `kc` (rows `0..R` of the strip). Row `r` of the A strip is read at
/// `a[r] + p·a_step` (a packed strip, or rows of A in place); row `p` of the B strip is the
/// NR floats at `b + p·b_step` (a packed k-major strip with `b_step = NR`, or a row-major B
/// read in place). With `accumulate`, the chains start from C's values, else from zero.
///
/// # Safety
/// The CPU supports AVX-512F; every `a[r] + p·a_step` and `b + p·b_step .. + NR` for `p < kc`
/// are readable; `c` points to R rows of NR writable floats at stride `ldc`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn kernel<const R: usize>(
    kc: usize,
    a: &[*const f32; MR],
    a_step: usize,
    b: *const f32,
    b_step: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    const { assert!(R >= 1 && R <= MR) };
    let mut lo = [_mm512_setzero_ps(); R];
    let mut hi = [_mm512_setzero_ps(); R];
    if accumulate {
        for r in 0..R {
            // SAFETY: row r of C has NR floats (the caller's contract).
            unsafe {
                lo[r] = _mm512_loadu_ps(c.add(r * ldc));
                hi[r] = _mm512_loadu_ps(c.add(r * ldc + 16));
            }
        }
    }
    for p in 0..kc {
        // SAFETY: p < kc, within what the caller guarantees readable.
        unsafe {
            let b0 = _mm512_loadu_ps(b.add(p * b_step));
            let b1 = _mm512_loadu_ps(b.add(p * b_step + 16));
            let off = p * a_step;
            for r in 0..R {
                let x = _mm512_set1_ps(*a[r].add(off));
                lo[r] = _mm512_fmadd_ps(x, b0, lo[r]);
                hi[r] = _mm512_fmadd_ps(x, b1, hi[r]);
            }
        }
    }
    for r in 0..R {
        // SAFETY: as for the loads.
        unsafe {
            _mm512_storeu_ps(c.add(r * ldc), lo[r]);
            _mm512_storeu_ps(c.add(r * ldc + 16), hi[r]);
        }
    }
}

/// Never called: [`super::available`] is false off x86-64.
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn kernel<const R: usize>(
    _kc: usize,
    _a: &[*const f32; MR],
    _a_step: usize,
    _b: *const f32,
    _b_step: usize,
    _c: *mut f32,
    _ldc: usize,
    _accumulate: bool,
) {
    unreachable!("the AVX-512 kernel is only built for x86-64")
}

/// [`kernel`] for `rows` rows (1..=MR), dispatched to the instance with that many.
///
/// # Safety
/// As for [`kernel`] with `R = rows`.
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
    macro_rules! dispatch {
        ($($r:literal)*) => {
            match rows {
                // SAFETY: the caller's contract, with R = rows.
                $($r => unsafe { kernel::<$r>(kc, a, a_step, b, b_step, c, ldc, accumulate) },)*
                _ => unreachable!("kernel rows {rows} outside 1..={MR}"),
            }
        };
    }
    dispatch!(1 2 3 4 5 6 7 8 9 10 11 12)
}
