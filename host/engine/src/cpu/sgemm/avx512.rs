//! The AVX-512 micro-kernel: a 12 × 32 block of C in 24 zmm accumulators. Each step of k
//! loads two vectors of the B strip, broadcasts twelve values of the A strip, and issues 24
//! FMAs; 24 independent chains hide the FMA latency, and 32 registers hold everything.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Rows of C per call.
pub(crate) const MR: usize = 12;
/// Columns of C per call (two zmm vectors).
pub(crate) const NR: usize = 32;

/// `C[MR×NR] (+)= A_strip · B_strip` over depth `kc`. Row `r` of the A strip is read at
/// `a[r] + p·a_step` (a packed strip, or rows of A in place); `b` is a packed k-major strip
/// (`b[p·NR + c]`). With `accumulate`, the chains start from C's values, else from zero.
///
/// # Safety
/// The CPU supports AVX-512F; every `a[r] + p·a_step` for `p < kc` and `b[..kc·NR]` are
/// readable; `c` points to MR rows of NR writable floats at stride `ldc`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn kernel(
    kc: usize,
    a: &[*const f32; MR],
    a_step: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    if accumulate {
        for r in 0..MR {
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
            let b0 = _mm512_loadu_ps(b.add(p * NR));
            let b1 = _mm512_loadu_ps(b.add(p * NR + 16));
            let off = p * a_step;
            for r in 0..MR {
                let x = _mm512_set1_ps(*a[r].add(off));
                lo[r] = _mm512_fmadd_ps(x, b0, lo[r]);
                hi[r] = _mm512_fmadd_ps(x, b1, hi[r]);
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

/// Never called: [`super::available`] is false off x86-64.
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn kernel(
    _kc: usize,
    _a: &[*const f32; MR],
    _a_step: usize,
    _b: *const f32,
    _c: *mut f32,
    _ldc: usize,
    _accumulate: bool,
) {
    unreachable!("the AVX-512 kernel is only built for x86-64")
}
