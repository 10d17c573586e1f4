//! Random ops on counter-based streams: the mask of element `i` is a pure function of
//! (key, offset + i), so recomputation (activation checkpointing) and backward regenerate it
//! instead of saving it.

use super::be;
use crate::autograd::record;
use crate::error::{invalid, Result};
use crate::rng::RngKey;
use crate::{DType, Tensor};

fn check_p(p: f32) -> Result<()> {
    if (0.0..=1.0).contains(&p) {
        Ok(())
    } else {
        Err(invalid(
            "dropout",
            format!("probability must lie in [0, 1], got {p}"),
        ))
    }
}

impl Tensor {
    /// The dropout multiplier for `shape` (f32): `1 / (1 - p)` where element `i` is kept, 0
    /// where dropped. Element `i` is dropped when the uniform draw of `key` at `offset + i` is
    /// below `p`.
    pub fn dropout_mask(shape: &[usize], p: f32, key: &RngKey, offset: u64) -> Result<Tensor> {
        check_p(p)?;
        let n = shape.iter().product();
        let scale = if p < 1.0 { 1.0 / (1.0 - p) } else { 0.0 };
        let v: Vec<f32> = key
            .uniform_vec(offset, n)
            .into_iter()
            .map(|u| if u >= p { scale } else { 0.0 })
            .collect();
        Tensor::from_vec(v, shape)
    }

    /// Inverted dropout: each element zeroed with probability `p`, survivors scaled by
    /// `1 / (1 - p)`. The mask is [`Tensor::dropout_mask`] of (`key`, `offset`), regenerated in
    /// backward rather than stored; `p = 0` returns `self` unchanged.
    pub fn dropout(&self, p: f32, key: &RngKey, offset: u64) -> Result<Tensor> {
        check_p(p)?;
        if p == 0.0 {
            return Ok(self.clone());
        }
        let scale = if p < 1.0 { 1.0 / (1.0 - p) } else { 0.0 };
        let out = be(self)?.dropout(&self.detach(), p, scale, key, offset)?;
        Ok(record("dropout", out, &[self], || {
            let key = key.clone();
            move |g: &Tensor| Ok(vec![Some(be(g)?.dropout(g, p, scale, &key, offset)?)])
        }))
    }

    /// 1.0 with probability `p` and 0.0 otherwise, for each element of `shape` (in `dtype`),
    /// drawn from `key` at `offset + i`.
    pub fn bernoulli(
        shape: &[usize],
        p: f32,
        key: &RngKey,
        offset: u64,
        dtype: DType,
    ) -> Result<Tensor> {
        if !(0.0..=1.0).contains(&p) {
            return Err(invalid(
                "bernoulli",
                format!("probability must lie in [0, 1], got {p}"),
            ));
        }
        let n = shape.iter().product();
        let v: Vec<f32> = key
            .uniform_vec(offset, n)
            .into_iter()
            .map(|u| if u < p { 1.0 } else { 0.0 })
            .collect();
        Tensor::from_vec(v, shape)?.to_dtype(dtype)
    }
}
