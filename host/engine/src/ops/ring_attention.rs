//! Context-parallel attention: the sequence is split across the ranks of a ring, each holding
//! its queries and its keys/values; the key/value blocks travel once around the ring, each
//! rank attending its queries to every block as it passes and merging the partial results
//! with the online-softmax rule. Nothing here knows how blocks travel: a [`KvRing`] (MPI
//! between processes in the trainer) passes them.
//!
//! Masks are positional ([`AttentionSpec::q_pos`] / `k_pos`), so any split of the sequence
//! works: the causal load balancing of context parallelism (each rank holds a chunk from the
//! head and its mirror from the tail) only decides which positions a rank holds. A block that
//! a rank's queries cannot see contributes rows with logsumexp −∞, which the merge skips.
//!
//! Forward: `n − 1` passes of (k, v, k positions). Backward: `n` passes of (k, v, k positions,
//! dk, dv): each rank adds its queries' gradient for the block it holds, and after the last
//! pass every block is home with the gradient from every rank's queries. The per-block
//! backward needs only the merged output and logsumexp (FlashAttention's `delta = rowsum(dO ∘
//! O)` and `P = exp(S − lse)`), so it is the single-block kernel unchanged. Sinks join the
//! first (local) block only, so they enter each row's denominator once.
//!
//! Partial outputs are merged in f32; with bf16 inputs each partial is rounded to bf16 by the
//! kernel first, so bf16 context parallelism is close to, not equal to, the single process.
//!
//! In batch-invariant mode the keys and values are gathered whole instead
//! ([`super::gather_attention`]): each query row is then the whole forward's bit for bit, which
//! the merge cannot give.

use super::attention::{resolve, AttentionParams, AttentionSpec};
use super::be;
use crate::autograd::record;
use crate::error::{invalid, Result};
use crate::{staged, DType, Tensor};
use std::sync::Arc;

/// One rank's place in a ring of context-parallel ranks.
pub trait KvRing: Send + Sync {
    /// Ranks in the ring.
    fn size(&self) -> usize;
    /// Sends `blocks` to the next rank and returns what the previous rank sent: tensors of the
    /// same shapes and dtypes, in the same order. Every rank calls it the same number of times.
    fn pass(&self, blocks: &[Tensor]) -> Result<Vec<Tensor>>;
}

const OP: &str = "ring_attention";

/// Attention of this rank's queries over the keys/values of every rank of `ring`: `q [B, Hq,
/// Tq, D]`, `k [B, Hkv, Tk, D]`, `v [B, Hkv, Tk, Dv]` are this rank's, `params.q_pos` /
/// `params.k_pos` their absolute positions in the whole sequence (required, since a rank's
/// slice does not start at 0). Equal to [`super::scaled_dot_product_attention`] over the whole
/// sequence, restricted to this rank's query rows (up to the rounding of the merge; exactly
/// in batch-invariant mode, which gathers the keys instead, see the module docs).
pub fn ring_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttentionParams,
    ring: Arc<dyn KvRing>,
) -> Result<Tensor> {
    let (Some(_), Some(k_pos)) = (&params.q_pos, &params.k_pos) else {
        return Err(invalid(OP, "q_pos and k_pos must be given"));
    };
    if crate::invariant::batch_invariant() {
        return super::gather_attention(q, k, v, params, ring);
    }
    let spec = resolve(q, k, v, params)?;
    let k_pos = k_pos.to_dtype(DType::I64)?;
    let sinks = params.sinks.as_ref();
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let mut block = vec![kd.clone(), vd.clone(), k_pos.clone()];
    let mut merged: Option<Partial> = None;
    for step in 0..ring.size() {
        if step > 0 {
            block = pass(ring.as_ref(), &block, 3)?;
        }
        let spec = with_keys(&spec, &block[2]);
        let sink = if step == 0 {
            sinks.map(|s| s.detach())
        } else {
            None
        };
        let (out, lse) = be(q)?.attention(&qd, &block[0], &block[1], sink.as_ref(), &spec)?;
        let part = Partial::of(&out, &lse);
        merged = Some(match merged {
            None => part,
            Some(acc) => acc.merge(part),
        });
    }
    let merged = merged.ok_or_else(|| invalid(OP, "the ring has no ranks"))?;
    let (out, lse) = merged.into_tensors(q, v)?;
    let mut inputs = vec![q, k, v];
    if let Some(s) = sinks {
        inputs.push(s);
    }
    let saved_out = out.clone();
    Ok(record(OP, out, &inputs, || {
        let sinks = sinks.map(|s| s.detach());
        move |g: &Tensor| {
            let back = be(&qd)?;
            let mut dq = vec![0f32; qd.numel()];
            let mut dsinks = None;
            // The dk/dv accumulators live with the keys, so the ring passes them device to
            // device where it can.
            let dk0 = Tensor::zeros_on(kd.shape(), DType::F32, kd.device())?;
            let dv0 = Tensor::zeros_on(vd.shape(), DType::F32, vd.device())?;
            let mut block = vec![kd.clone(), vd.clone(), k_pos.clone(), dk0, dv0];
            for step in 0..ring.size() {
                let spec = with_keys(&spec, &block[2]);
                let sink = if step == 0 { sinks.as_ref() } else { None };
                let grads = back.attention_backward(
                    &qd, &block[0], &block[1], sink, &saved_out, &lse, g, &spec,
                )?;
                add_into(&mut dq, &grads.q);
                block[3] = plus(&block[3], &grads.k)?;
                block[4] = plus(&block[4], &grads.v)?;
                if step == 0 {
                    dsinks = grads.sinks;
                }
                // The last pass brings every block home with all ranks' contributions.
                block = pass(ring.as_ref(), &block, 5)?;
            }
            // The sums were made in host memory (staged: `crate::staged`); each gradient
            // lands on its input's device.
            let dq = staged::from_host(dq, qd.shape(), qd.dtype(), qd.device())?;
            let mut out = vec![
                Some(dq),
                Some(staged::place(block[3].to_dtype(kd.dtype())?, kd.device())?),
                Some(staged::place(block[4].to_dtype(vd.dtype())?, vd.device())?),
            ];
            if sinks.is_some() {
                out.push(dsinks);
            }
            Ok(out)
        }
    }))
}

/// `spec` with the positions of the keys in `k_pos`.
fn with_keys(spec: &AttentionSpec, k_pos: &Tensor) -> AttentionSpec {
    AttentionSpec {
        k_pos: k_pos.to_vec::<i64>(),
        ..spec.clone()
    }
}

/// One pass around the ring, checking the ring kept the blocks' count.
fn pass(ring: &dyn KvRing, block: &[Tensor], want: usize) -> Result<Vec<Tensor>> {
    let got = ring.pass(block)?;
    if got.len() != want {
        return Err(invalid(
            OP,
            format!("the ring returned {} tensors for {want}", got.len()),
        ));
    }
    Ok(got)
}

fn add_into(acc: &mut [f32], t: &Tensor) {
    for (a, b) in acc.iter_mut().zip(t.to_vec_f32()) {
        *a += b;
    }
}

/// `acc + t` in f32, a fresh tensor on `acc`'s device (what arrived from the ring is not ours
/// to write): one IEEE addition per element, the same bits on every backend.
fn plus(acc: &Tensor, t: &Tensor) -> Result<Tensor> {
    let t = staged::place(t.to_dtype(DType::F32)?, acc.device())?;
    acc.to_dtype(DType::F32)?.add(&t)
}

/// A partial attention result in f32: the output rows `[rows, Dv]` and their logsumexp.
struct Partial {
    out: Vec<f32>,
    lse: Vec<f32>,
}

impl Partial {
    fn of(out: &Tensor, lse: &Tensor) -> Partial {
        Partial {
            out: out.to_vec_f32(),
            lse: lse.to_vec_f32(),
        }
    }

    /// The online-softmax merge: each row is the two rows weighted by their share of the
    /// combined denominator, `exp(lse_i − lse)`; a row that saw no key (−∞) adds nothing.
    fn merge(mut self, other: Partial) -> Partial {
        let rows = self.lse.len();
        let dv = self.out.len().checked_div(rows).unwrap_or(0);
        for r in 0..rows {
            let (a, b) = (self.lse[r], other.lse[r]);
            if b == f32::NEG_INFINITY {
                continue;
            }
            let row = r * dv..(r + 1) * dv;
            if a == f32::NEG_INFINITY {
                self.out[row.clone()].copy_from_slice(&other.out[row]);
                self.lse[r] = b;
                continue;
            }
            let m = a.max(b);
            let (ea, eb) = ((a - m).exp(), (b - m).exp());
            let s = ea + eb;
            let (wa, wb) = (ea / s, eb / s);
            for (x, y) in self.out[row.clone()].iter_mut().zip(&other.out[row]) {
                *x = *x * wa + *y * wb;
            }
            self.lse[r] = m + s.ln();
        }
        self
    }

    /// The output `[B, Hq, Tq, Dv]` in `q`'s dtype and the logsumexp `[B, Hq, Tq]` in f32.
    fn into_tensors(self, q: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (qs, dv) = (q.shape(), v.shape()[3]);
        let out = staged::from_host(self.out, &[qs[0], qs[1], qs[2], dv], q.dtype(), q.device())?;
        let lse = staged::from_host_f32(self.lse, &qs[..3], q.device())?;
        Ok((out, lse))
    }
}
