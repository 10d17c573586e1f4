//! PIL's bicubic resize (`Image.resize(size, Image.BICUBIC)`) for 8-bit RGB, reproduced step for
//! step from libImaging/Resample.c so the result is PIL's byte for byte: a separable convolution
//! (horizontal pass, then vertical) whose filter support widens with the downscale factor
//! (antialiasing), coefficients normalised in `f64` then fixed to 22-bit integers, sums rounded and
//! clipped to 8 bits after each pass.

use rayon::prelude::*;

use super::RgbImage;

/// Fixed-point bits of the 8-bit path's coefficients (`32 - 8 - 2` in PIL).
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// PIL's bicubic kernel, `a = -0.5`, support 2.
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// One output position's window of inputs: first input, count, and `ksize` fixed-point weights.
struct Coeffs {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
}

/// `precompute_coeffs` then `normalize_coeffs_8bpc` for a full-image box `[0, in_size)`.
fn precompute(in_size: usize, out_size: usize) -> Coeffs {
    const SUPPORT: f64 = 2.0;
    // PIL takes the box as `float`; whole sizes below 2^24 are exact there.
    let (in0, in1) = (0.0f32, in_size as f32);
    let scale = (in1 - in0) as f64 / out_size as f64;
    let filterscale = if scale < 1.0 { 1.0 } else { scale };
    let support = SUPPORT * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = in0 as f64 + (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // `(int)` in C truncates toward zero, as `as` does.
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) - xmin;
        let (xmin, count) = (xmin as usize, xmax.max(0) as usize);
        let mut ww = 0.0;
        k.fill(0.0);
        for (x, kx) in k.iter_mut().enumerate().take(count) {
            let w = bicubic(((x + xmin) as f64 - center + 0.5) * ss);
            *kx = w;
            ww += w;
        }
        for kx in k.iter_mut().take(count) {
            if ww != 0.0 {
                *kx /= ww;
            }
        }
        let unit = (1u32 << PRECISION_BITS) as f64;
        for (dst, &kx) in weights[xx * ksize..(xx + 1) * ksize].iter_mut().zip(&k) {
            *dst = if kx < 0.0 {
                (-0.5 + kx * unit) as i32
            } else {
                (0.5 + kx * unit) as i32
            };
        }
        bounds.push((xmin, count));
    }
    Coeffs {
        ksize,
        bounds,
        weights,
    }
}

/// Rounds a fixed-point sum back to a byte, as PIL's `clip8`.
fn clip8(v: i64) -> u8 {
    if v >= (1i64 << PRECISION_BITS << 8) {
        255
    } else if v <= 0 {
        0
    } else {
        (v >> PRECISION_BITS) as u8
    }
}

/// One pass along rows (`horizontal`) or columns, from `src` (`src_w × src_h`) into a new buffer.
fn pass(src: &[u8], src_w: usize, src_h: usize, c: &Coeffs, horizontal: bool) -> Vec<u8> {
    let out_n = c.bounds.len();
    let (out_w, out_h) = if horizontal {
        (out_n, src_h)
    } else {
        (src_w, out_n)
    };
    let mut out = vec![0u8; out_w * out_h * 3];
    // Output rows are independent: splitting them over threads changes no value.
    out.par_chunks_mut(out_w * 3)
        .enumerate()
        .for_each(|(yy, row)| {
            for xx in 0..out_w {
                let o = if horizontal { xx } else { yy };
                let (min, count) = c.bounds[o];
                let k = &c.weights[o * c.ksize..o * c.ksize + count];
                let mut ss = [1i64 << (PRECISION_BITS - 1); 3];
                for (i, &w) in k.iter().enumerate() {
                    let at = if horizontal {
                        (yy * src_w + min + i) * 3
                    } else {
                        ((min + i) * src_w + xx) * 3
                    };
                    for (s, &v) in ss.iter_mut().zip(&src[at..at + 3]) {
                        *s += v as i64 * w as i64;
                    }
                }
                for (dst, &s) in row[xx * 3..xx * 3 + 3].iter_mut().zip(&ss) {
                    *dst = clip8(s);
                }
            }
        });
    out
}

/// Resizes to `width × height` exactly as PIL's `Image.resize((width, height), BICUBIC)` on an
/// RGB image: the same size returns a copy, and a pass whose side does not change is skipped.
/// A zero target side, or an empty input, gives an empty image of the target size.
pub fn resize_bicubic(image: &RgbImage, width: u32, height: u32) -> RgbImage {
    let (in_w, in_h) = (image.width as usize, image.height as usize);
    if width == 0 || height == 0 || in_w == 0 || in_h == 0 {
        let pixels = vec![0; width as usize * height as usize * 3];
        return RgbImage {
            width,
            height,
            pixels,
        };
    }
    let (out_w, out_h) = (width as usize, height as usize);
    let mut pixels = image.pixels.clone();
    let mut cur_w = in_w;
    if out_w != in_w {
        let c = precompute(in_w, out_w);
        pixels = pass(&pixels, in_w, in_h, &c, true);
        cur_w = out_w;
    }
    if out_h != in_h {
        let c = precompute(in_h, out_h);
        pixels = pass(&pixels, cur_w, in_h, &c, false);
    }
    RgbImage {
        width,
        height,
        pixels,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_weights_sum_to_one_in_fixed_point() {
        for (i, o) in [(33, 56), (200, 112), (90, 84), (7, 3)] {
            let c = precompute(i, o);
            for row in c.weights.chunks(c.ksize) {
                let sum: i64 = row.iter().map(|&w| w as i64).sum();
                assert!(
                    (sum - (1 << PRECISION_BITS)).abs() <= c.ksize as i64,
                    "{i}->{o}: {sum}"
                );
            }
        }
    }

    #[test]
    fn flat_image_stays_flat() {
        let img = RgbImage::new(5, 4, [9u8, 200, 77].repeat(20)).unwrap();
        let out = resize_bicubic(&img, 13, 2);
        assert!(out.pixels.chunks(3).all(|p| p == [9, 200, 77]));
        assert_eq!(resize_bicubic(&img, 0, 3).pixels.len(), 0);
    }
}
