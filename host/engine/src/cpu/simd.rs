//! Runtime SIMD dispatch and vectorizable math.
//!
//! Kernels are written as plain loops over slices; `simd_kernel!` compiles each one three times
//! (AVX-512, AVX2+FMA, baseline) and picks the best the CPU supports at run time, so no
//! `-C target-cpu` is needed. The math helpers are branch-free so the compiler vectorizes them.
//! Every variant performs the same operations in the same order: results are identical
//! whichever is chosen for elementwise kernels.

use std::sync::OnceLock;

/// The instruction-set level kernels run at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    /// AVX-512F (with VL, BW, DQ).
    Avx512,
    /// AVX2 with FMA.
    Avx2,
    /// Whatever the target's baseline is.
    Baseline,
}

/// The SIMD level detected on this CPU (cached), overridable with `ANNEAL_SIMD=baseline|avx2`.
pub fn level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = std::env::var("ANNEAL_SIMD").ok();
        #[cfg(target_arch = "x86_64")]
        {
            let avx512 = is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512dq");
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            match cap.as_deref() {
                Some("baseline") => SimdLevel::Baseline,
                Some("avx2") if avx2 => SimdLevel::Avx2,
                _ if avx512 => SimdLevel::Avx512,
                _ if avx2 => SimdLevel::Avx2,
                _ => SimdLevel::Baseline,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = cap;
            SimdLevel::Baseline
        }
    })
}

/// Defines a function whose body is compiled per SIMD level and dispatched at run time.
macro_rules! simd_kernel {
    ($(#[$m:meta])* $vis:vis fn $name:ident $(<$($g:ident : $b:path),*>)? ($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name $(<$($g: $b),*>)? ($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx512 $(<$($g: $b),*>)? ($($arg: $ty),*) $(-> $ret)? $body
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2 $(<$($g: $b),*>)? ($($arg: $ty),*) $(-> $ret)? $body
                match $crate::cpu::simd::level() {
                    // SAFETY: the CPU supports the features these variants were compiled for.
                    $crate::cpu::simd::SimdLevel::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    $crate::cpu::simd::SimdLevel::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::cpu::simd::SimdLevel::Baseline => {}
                }
            }
            $body
        }
    };
}
pub(crate) use simd_kernel;

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;

/// e^x to about 1 ulp, branch-free; exactly 0 below the normal range (so `exp(-inf) == 0`).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // max/min (not clamp) map NaN into range, so the unchecked cast below stays defined.
    #[allow(clippy::manual_clamp)]
    let xc = x.max(-87.33).min(88.72);
    let k = (xc * LOG2E + 0.5).floor();
    let r = xc - k * LN2_HI - k * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // SAFETY: `k` is an integer in [-126, 129] (xc is finite and clamped), so the cast is exact.
    // A plain `as` cast saturates, which AVX2 cannot vectorize: every exp went scalar.
    let ki: i32 = unsafe { k.to_int_unchecked() };
    let scale = f32::from_bits(((ki + 127) << 23) as u32);
    let y = p * scale;
    let y = if x < -87.33 { 0.0 } else { y };
    if x.is_nan() {
        x
    } else if x > 88.72 {
        f32::INFINITY
    } else {
        y
    }
}

/// The logistic function 1 / (1 + e^-x).
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// erf(x), absolute error below 1.2e-7 (Numerical Recipes' erfc Chebyshev fit).
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let z = x.abs() as f64;
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    let r = (1.0 - erfc) as f32;
    if x < 0.0 {
        -r
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp(x), x.exp());
            worst = worst.max(((a - b) / b).abs());
            x += 0.013;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn erf_matches_known_values() {
        for (x, e) in [
            (0.0f32, 0.0f32),
            (0.5, 0.520_499_9),
            (1.0, 0.842_700_8),
            (-2.0, -0.995_322_3),
            (3.0, 0.999_977_9),
        ] {
            assert!((erf(x) - e).abs() < 2e-7, "erf({x}) = {} vs {e}", erf(x));
        }
    }
}
