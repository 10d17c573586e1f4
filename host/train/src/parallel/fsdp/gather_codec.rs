//! How FSDP's parameter all-gathers travel (`parallelism.fsdp_all_gather_dtype`): as f32, as
//! bf16, or quantized blockwise to int8 or fp8 (e4m3) with one f32 scale per block of
//! `fsdp_all_gather_block` values, dequantized on receipt. Only the gathers are encoded: every
//! rank (the shard's owner included) computes with the decoded values, so all ranks see the same
//! parameters in forward and backward; gradients, their reduce-scatter, the optimizer and the
//! checkpoints stay full precision.
//!
//! The transport moves 32-bit words, so an encoded shard is packed into words: the block scales
//! first (quantized codes), then the codes or bf16 halves, four or two to a word. MPI copies the
//! words bit for bit (a gather computes nothing on them).

use crate::TrainError;

/// The largest finite fp8 e4m3 value (`e4m3fn`: no infinities, 0x7f is NaN).
const E4M3_MAX: f32 = 448.0;

/// The encoding of the parameter all-gathers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum GatherCodec {
    /// Plain f32: exact.
    F32,
    /// bf16 (round to nearest even): 2 bytes a value.
    Bf16,
    /// int8 codes `round(x / s)` with `s = max|x| / 127` per block.
    Int8 { block: usize },
    /// fp8 e4m3 codes of `x / s` with `s = max|x| / 448` per block.
    Fp8E4m3 { block: usize },
}

impl GatherCodec {
    /// The codec a config names (`float32`/`f32`, `bfloat16`/`bf16`, `int8`, `fp8_e4m3`), with
    /// `block` values per scale for the quantized ones.
    pub fn parse(dtype: &str, block: usize) -> Result<GatherCodec, TrainError> {
        let quantized = |c: fn(usize) -> GatherCodec| {
            if block == 0 {
                Err(TrainError::Config(
                    "parallelism.fsdp_all_gather_block must be at least 1".into(),
                ))
            } else {
                Ok(c(block))
            }
        };
        match dtype {
            "float32" | "f32" => Ok(GatherCodec::F32),
            "bfloat16" | "bf16" => Ok(GatherCodec::Bf16),
            "int8" => quantized(|block| GatherCodec::Int8 { block }),
            "fp8_e4m3" | "float8_e4m3fn" => quantized(|block| GatherCodec::Fp8E4m3 { block }),
            other => Err(TrainError::Config(format!(
                "parallelism.fsdp_all_gather_dtype: unknown dtype '{other}' (float32, bfloat16, int8 or fp8_e4m3)"
            ))),
        }
    }

    /// Words an encoded run of `n` values takes.
    pub fn words(&self, n: usize) -> usize {
        match *self {
            GatherCodec::F32 => n,
            GatherCodec::Bf16 => n.div_ceil(2),
            GatherCodec::Int8 { block } | GatherCodec::Fp8E4m3 { block } => {
                n.div_ceil(block) + n.div_ceil(4)
            }
        }
    }

    /// `values` encoded into [`GatherCodec::words`] words.
    pub fn encode(&self, values: Vec<f32>) -> Vec<f32> {
        let words = |bytes: &[u8]| -> Vec<f32> {
            bytes
                .chunks(4)
                .map(|c| {
                    let mut w = [0u8; 4];
                    w[..c.len()].copy_from_slice(c);
                    f32::from_bits(u32::from_le_bytes(w))
                })
                .collect()
        };
        match *self {
            GatherCodec::F32 => values,
            GatherCodec::Bf16 => {
                let bytes: Vec<u8> = values
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                    .collect();
                words(&bytes)
            }
            GatherCodec::Int8 { block } | GatherCodec::Fp8E4m3 { block } => {
                let fp8 = matches!(self, GatherCodec::Fp8E4m3 { .. });
                let top = if fp8 { E4M3_MAX } else { 127.0 };
                let mut scales = Vec::with_capacity(values.len().div_ceil(block));
                let mut codes = Vec::with_capacity(values.len());
                for chunk in values.chunks(block) {
                    let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let scale = if amax > 0.0 && amax.is_finite() {
                        amax / top
                    } else {
                        0.0
                    };
                    scales.push(scale);
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    codes.extend(chunk.iter().map(|&v| {
                        let x = v * inv;
                        if fp8 {
                            e4m3_from_f32(x)
                        } else {
                            x.round().clamp(-127.0, 127.0) as i8 as u8
                        }
                    }));
                }
                scales.extend(words(&codes));
                scales
            }
        }
    }

    /// The `n` values of an encoded run `words`.
    pub fn decode(&self, words: &[f32], n: usize) -> Vec<f32> {
        let bytes = |w: &[f32]| -> Vec<u8> {
            w.iter()
                .flat_map(|x| x.to_bits().to_le_bytes())
                .collect::<Vec<u8>>()
        };
        match *self {
            GatherCodec::F32 => words[..n].to_vec(),
            GatherCodec::Bf16 => bytes(words)
                .chunks(2)
                .take(n)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            GatherCodec::Int8 { block } | GatherCodec::Fp8E4m3 { block } => {
                let fp8 = matches!(self, GatherCodec::Fp8E4m3 { .. });
                // Every code's value, looked up rather than recomputed per element.
                let table: [f32; 256] = std::array::from_fn(|c| {
                    if fp8 {
                        e4m3_to_f32(c as u8)
                    } else {
                        c as u8 as i8 as f32
                    }
                });
                let n_scales = n.div_ceil(block);
                let (scales, codes) = words.split_at(n_scales);
                bytes(codes)
                    .into_iter()
                    .take(n)
                    .enumerate()
                    .map(|(i, c)| table[c as usize] * scales[i / block])
                    .collect()
            }
        }
    }
}

/// The value of the fp8 e4m3 (`e4m3fn`) code `c`.
fn e4m3_to_f32(c: u8) -> f32 {
    let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((c >> 3) & 0x0f, c & 0x07);
    if e == 0x0f && m == 0x07 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m as f32 / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m as f32 / 8.0) * 2f32.powi(e as i32 - 7)
    };
    sign * mag
}

/// The nearest fp8 e4m3 code to `x` (ties to the even code), saturating at ±448. Rounds the
/// f32 bits directly: in the normal range the exponent and the top three mantissa bits are the
/// code once the 20 bits below are rounded off (a carry rolls into the exponent, as it should);
/// below 2⁻⁶ the codes are multiples of 2⁻⁹.
fn e4m3_from_f32(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    if a.is_nan() {
        return 0x7f;
    }
    let code = if a < 2f32.powi(-6) {
        (a * 512.0).round_ties_even() as u8
    } else {
        let bits = a.to_bits();
        let rounded = (bits + 0x7_ffff + ((bits >> 20) & 1)) >> 20;
        // f32's exponent bias is 127, e4m3's 7.
        (rounded - (120 << 3)) as u8
    };
    sign | code
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * 0.37).sin() * (1.0 + (i % 7) as f32)) * 0.05)
            .collect()
    }

    #[test]
    fn each_codec_round_trips_within_its_precision() {
        let v = values(1000);
        for (codec, tol) in [
            (GatherCodec::F32, 0.0),
            (GatherCodec::Bf16, 1.0 / 256.0),
            (GatherCodec::Int8 { block: 128 }, 0.5 / 127.0),
            (GatherCodec::Fp8E4m3 { block: 256 }, 1.0 / 16.0),
        ] {
            let words = codec.encode(v.clone());
            assert_eq!(words.len(), codec.words(v.len()), "{codec:?}");
            let back = codec.decode(&words, v.len());
            let block = match codec {
                GatherCodec::Int8 { block } | GatherCodec::Fp8E4m3 { block } => block,
                _ => v.len(),
            };
            for (i, (a, b)) in v.iter().zip(&back).enumerate() {
                let amax = v[i / block * block..((i / block + 1) * block).min(v.len())]
                    .iter()
                    .fold(0f32, |m, x| m.max(x.abs()));
                // Relative to the value for floats, to the block's largest for int8.
                let bound = match codec {
                    GatherCodec::Int8 { .. } => tol * amax,
                    _ => tol * a.abs() + 1e-3 * amax * (codec != GatherCodec::F32) as u8 as f32,
                };
                assert!((a - b).abs() <= bound, "{codec:?} [{i}]: {a} -> {b}");
            }
        }
    }

    #[test]
    fn quantized_gathers_take_about_half_the_bytes_of_bf16() {
        let n = 4096;
        let bf16 = GatherCodec::Bf16.words(n) as f64;
        for codec in [
            GatherCodec::Int8 { block: 128 },
            GatherCodec::Fp8E4m3 { block: 128 },
        ] {
            let ratio = codec.words(n) as f64 / bf16;
            assert!(ratio <= 0.55, "{codec:?}: {ratio}");
        }
        assert_eq!(GatherCodec::F32.words(n), 2 * GatherCodec::Bf16.words(n));
    }

    /// The nearest code by search over the code table (the definition, slowly).
    fn e4m3_nearest(x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs().min(E4M3_MAX);
        let mut best = 0u8;
        for c in 1..=0x7eu8 {
            let (d, db) = ((e4m3_to_f32(c) - a).abs(), (e4m3_to_f32(best) - a).abs());
            if d < db || (d == db && c % 2 == 0) {
                best = c;
            }
        }
        sign | best
    }

    #[test]
    fn e4m3_rounding_is_the_nearest_code_ties_to_even() {
        // Every code, every midpoint between neighbours (a tie), and points just off them.
        let mut xs = Vec::new();
        for c in 0..0x7eu8 {
            let (lo, hi) = (e4m3_to_f32(c), e4m3_to_f32(c + 1));
            let mid = (lo + hi) / 2.0;
            xs.extend([lo, mid, mid * (1.0 + 1e-6), mid * (1.0 - 1e-6), hi]);
        }
        xs.extend([500.0, 1e9, 1e-12, 0.0, 2f32.powi(-10), 3.0 * 2f32.powi(-10)]);
        for x in xs {
            for v in [x, -x] {
                assert_eq!(e4m3_from_f32(v), e4m3_nearest(v), "{v}");
            }
        }
    }

    #[test]
    fn e4m3_codes_are_exact_where_representable_and_saturate() {
        for (x, code) in [
            (0.0f32, 0x00u8),
            (448.0, 0x7e),
            (1.0, 0x38),
            (-1.0, 0xb8),
            (2f32.powi(-9), 0x01),
            (0.875 * 2f32.powi(-6), 0x07),
            (1e6, 0x7e),
        ] {
            assert_eq!(e4m3_from_f32(x), code, "{x}");
            assert_eq!(e4m3_to_f32(code), x.clamp(-448.0, 448.0), "{code:#x}");
        }
        // 1.0625 sits halfway between 1.0 (even code 0x38) and 1.125 (0x39).
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        assert_eq!(e4m3_from_f32(1.07), 0x39);
        for c in 0..=0x7eu8 {
            assert_eq!(e4m3_from_f32(e4m3_to_f32(c)), c);
        }
    }

    #[test]
    fn zero_blocks_and_names_are_handled() {
        let codec = GatherCodec::Int8 { block: 4 };
        let v = vec![0.0, 0.0, 0.0, 0.0, 1.0, -1.0];
        assert_eq!(codec.decode(&codec.encode(v.clone()), 6), v);
        assert!(GatherCodec::parse("int4", 128)
            .unwrap_err()
            .to_string()
            .contains("parallelism.fsdp_all_gather_dtype"));
        assert!(GatherCodec::parse("int8", 0).is_err());
        assert_eq!(GatherCodec::parse("bf16", 0).unwrap(), GatherCodec::Bf16);
    }
}
