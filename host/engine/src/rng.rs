//! Counter-based random numbers (Philox 4x32-10).
//!
//! A value is a pure function of (seed, stream name, offset): element `i` of a random tensor
//! drawn at `offset` is the same whatever the thread count, the sharding or the order of draws.
//! Initialization keys streams by parameter name; dropout keys them by step and layer, which
//! also makes recomputation (activation checkpointing) reproduce the same masks.

use crate::{DType, Result, Tensor};
use rayon::prelude::*;

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox 4x32 with 10 rounds: four random u32 from a 128-bit counter and a 64-bit key.
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for _ in 0..10 {
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        c = [
            ((p1 >> 32) as u32) ^ c[1] ^ k[0],
            p1 as u32,
            ((p0 >> 32) as u32) ^ c[3] ^ k[1],
            p0 as u32,
        ];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// FNV-1a hash of a stream name.
fn hash_name(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Where random values come from: a seed and a named stream. Offsets index into the stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RngKey {
    seed: u64,
    stream: u64,
}

impl RngKey {
    /// The stream `name` under `seed`.
    pub fn new(seed: u64, name: &str) -> RngKey {
        RngKey {
            seed,
            stream: hash_name(name),
        }
    }

    /// A sub-stream (e.g. per step or per layer) derived from this one.
    pub fn fold(&self, name: &str) -> RngKey {
        RngKey {
            seed: self.seed,
            stream: hash_name(name) ^ self.stream.rotate_left(17),
        }
    }

    /// The seed and the hashed stream name: what a device kernel needs to draw the same values.
    pub(crate) fn parts(&self) -> (u64, u64) {
        (self.seed, self.stream)
    }

    /// Four u32 for block `block` of the stream (block `b` covers offsets `4b..4b+4`).
    fn block(&self, block: u64) -> [u32; 4] {
        philox4x32(
            [
                block as u32,
                (block >> 32) as u32,
                self.stream as u32,
                (self.stream >> 32) as u32,
            ],
            [self.seed as u32, (self.seed >> 32) as u32],
        )
    }

    /// `n` uniform floats in [0, 1) starting at `offset` of the stream.
    pub fn uniform_vec(&self, offset: u64, n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n];
        out.par_chunks_mut(4096).enumerate().for_each(|(c, chunk)| {
            // One Philox block serves four consecutive offsets.
            let mut cached = (u64::MAX, [0u32; 4]);
            for (j, o) in chunk.iter_mut().enumerate() {
                let idx = offset + (c * 4096 + j) as u64;
                if cached.0 != idx / 4 {
                    cached = (idx / 4, self.block(idx / 4));
                }
                let r = cached.1[(idx % 4) as usize];
                // 24 high bits → exactly representable in [0, 1).
                *o = (r >> 8) as f32 * (1.0 / 16_777_216.0);
            }
        });
        out
    }

    /// `n` standard normal floats starting at `offset` (Box–Muller; each value uses one Philox
    /// block, so value `i` depends only on `offset + i`).
    pub fn normal_vec(&self, offset: u64, n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n];
        out.par_chunks_mut(4096).enumerate().for_each(|(c, chunk)| {
            for (j, o) in chunk.iter_mut().enumerate() {
                let idx = offset + (c * 4096 + j) as u64;
                let r = self.block(idx);
                let u1 = ((r[0] >> 8) as f64 + 1.0) * (1.0 / 16_777_217.0);
                let u2 = (r[1] >> 8) as f64 * (1.0 / 16_777_216.0);
                *o = ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32;
            }
        });
        out
    }
}

impl Tensor {
    /// Uniform values in `[lo, hi)` drawn from `key` at `offset`.
    pub fn rand_uniform(
        shape: &[usize],
        lo: f32,
        hi: f32,
        key: &RngKey,
        offset: u64,
        dtype: DType,
    ) -> Result<Tensor> {
        let n = shape.iter().product();
        let v: Vec<f32> = key
            .uniform_vec(offset, n)
            .into_iter()
            .map(|u| lo + (hi - lo) * u)
            .collect();
        Tensor::from_vec(v, shape)?.to_dtype(dtype)
    }

    /// Normal values with `mean` and `std` drawn from `key` at `offset`.
    pub fn rand_normal(
        shape: &[usize],
        mean: f32,
        std: f32,
        key: &RngKey,
        offset: u64,
        dtype: DType,
    ) -> Result<Tensor> {
        let n = shape.iter().product();
        let v: Vec<f32> = key
            .normal_vec(offset, n)
            .into_iter()
            .map(|z| mean + std * z)
            .collect();
        Tensor::from_vec(v, shape)?.to_dtype(dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_known_answer() {
        // Random123's published known-answer vector for philox4x32_10 with all-zero input.
        assert_eq!(
            philox4x32([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
    }

    #[test]
    fn values_depend_only_on_offset() {
        let k = RngKey::new(7, "layers.0.w");
        let all = k.uniform_vec(0, 10_000);
        assert_eq!(&all[5000..], &k.uniform_vec(5000, 5000)[..]);
        let n = k.normal_vec(3, 9000);
        assert_eq!(&n[997..], &k.normal_vec(1000, 8003)[..]);
        assert_ne!(
            k.uniform_vec(0, 8),
            RngKey::new(7, "layers.1.w").uniform_vec(0, 8)
        );
        let mean = n.iter().sum::<f32>() / n.len() as f32;
        let var = n.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n.len() as f32;
        assert!(
            mean.abs() < 0.05 && (var - 1.0).abs() < 0.05,
            "mean {mean} var {var}"
        );
    }
}
