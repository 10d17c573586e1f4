//! Vectorized f32 ↔ bf16 conversion (the casts mixed precision does on every matrix product).
//! Rounding is to nearest even, NaNs stay NaN: the same bits as `half::bf16::from_f32`.

use super::simd::simd_kernel;
use half::bf16;

simd_kernel! {
    /// `dst[i] = bf16(src[i])`, round to nearest even.
    pub(crate) fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
        let dst: &mut [u16] = bytemuck::cast_slice_mut(dst);
        for (d, &s) in dst.iter_mut().zip(src) {
            let x = s.to_bits();
            let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
            let nan = ((x >> 16) | 0x40) as u16;
            *d = if x & 0x7fff_ffff > 0x7f80_0000 { nan } else { rounded };
        }
    }
}

simd_kernel! {
    /// `dst[i] = f32(src[i])` (exact).
    pub(crate) fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
        let src: &[u16] = bytemuck::cast_slice(src);
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s as u32) << 16);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_match_half_bit_for_bit() {
        let mut xs: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.5,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0x3f80_8000), // a tie: rounds to even (down)
            f32::from_bits(0x3f81_8000), // a tie: rounds to even (up)
            f32::from_bits(0x7f7f_ffff),
        ];
        let mut s = 0x1234_5678u32;
        for _ in 0..100_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            xs.push(f32::from_bits(s));
        }
        let mut got = vec![bf16::ZERO; xs.len()];
        f32_to_bf16(&xs, &mut got);
        for (x, g) in xs.iter().zip(&got) {
            assert_eq!(
                g.to_bits(),
                bf16::from_f32(*x).to_bits(),
                "{x:e} ({:#x})",
                x.to_bits()
            );
        }
        let mut back = vec![0f32; xs.len()];
        bf16_to_f32(&got, &mut back);
        for (g, b) in got.iter().zip(&back) {
            assert_eq!(b.to_bits(), g.to_f32().to_bits());
        }
    }
}
