//! The delta rule's decode state, cached across tokens like a KV cache.
//!
//! How decode agrees with training bit for bit (the RL invariant): in batch-invariant mode a
//! step does not run the recurrence. It keeps the state at the last position that is a multiple
//! of 64 (the *anchor*) and the keys, values, decays and betas of the tokens after it (fewer
//! than 64), and runs the chunked kernel over those tokens plus the new ones from the anchor.
//! The chunks are then the very chunks a prefill or a training forward of the whole sequence
//! computes, and each row of a chunk depends on the rows before it only, through products whose
//! results do not depend on how many rows they have (see `cpu::delta_rule::mm`). So every
//! output and the state have the same bits either way. The cost: a step redoes the partial
//! chunk, `O(L · (L + Dk) · (Dk + Dv))` per head for `L ≤ 64` tokens since the anchor, instead
//! of the recurrence's `O(Dk · Dv)`. Measured for 16 heads of `Dk = Dv = 128` after a 2048-token
//! prompt, 2 threads: 2.6 ms per step against 0.5 ms for the recurrence (`delta_rule_bench
//! --decode`), about 5×; and the cache holds up to 63 tokens of k, v, g and β per sequence and
//! head. Outside that mode a step runs the recurrence on the current state,
//! and the anchor is brought forward one whole chunk at a time, so the cache stays usable in
//! either mode.

use super::delta_rule::{be, prepare, resolve, DeltaRuleInputs, DeltaRuleParams, DELTA_RULE_CHUNK};
use crate::autograd::no_grad;
use crate::error::Result;
use crate::ops::cat;
use crate::{DType, Tensor};

/// Per-layer decode state of [`super::gated_delta_rule`]: the recurrent matrix `[B, Hv, Dk,
/// Dv]` after every token seen, and what batch-invariant steps need (see the module doc).
#[derive(Clone, Debug)]
pub struct DeltaRuleCache {
    params: DeltaRuleParams,
    state: Tensor,
    anchor: Tensor,
    /// `k` (normalized as the kernel reads it), `v`, `g`, `beta` of the tokens after the anchor.
    pending: Option<[Tensor; 4]>,
    len: usize,
}

/// Rows `a..a + n` along the sequence dim, as a contiguous tensor.
fn rows(t: &Tensor, a: usize, n: usize) -> Result<Tensor> {
    t.narrow(1, a, n)?.contiguous()
}

/// `[a, b]` along the sequence dim (`a` may be absent).
fn join(a: Option<&Tensor>, b: &Tensor) -> Result<Tensor> {
    match a {
        Some(a) => cat(&[a.clone(), b.clone()], 1),
        None => Ok(b.clone()),
    }
}

impl DeltaRuleCache {
    /// A cache starting from `initial_state` `[B, Hv, Dk, Dv]` at position 0; `params` are the
    /// layer's options, used by every step.
    pub fn new(initial_state: &Tensor, params: DeltaRuleParams) -> Result<DeltaRuleCache> {
        let state = initial_state.detach().materialize(DType::F32);
        Ok(DeltaRuleCache {
            params,
            anchor: state.clone(),
            state,
            pending: None,
            len: 0,
        })
    }

    /// A cache starting from a zero state.
    pub fn zeros(
        batch: usize,
        v_heads: usize,
        k_dim: usize,
        v_dim: usize,
        params: DeltaRuleParams,
    ) -> Result<DeltaRuleCache> {
        DeltaRuleCache::new(
            &Tensor::zeros(&[batch, v_heads, k_dim, v_dim], DType::F32),
            params,
        )
    }

    /// The state after every token seen, `[B, Hv, Dk, Dv]` f32.
    pub fn state(&self) -> &Tensor {
        &self.state
    }

    /// Bytes the cache holds: the state, the anchor state and the pending tokens since the
    /// anchor (for all `B` sequences).
    pub fn bytes(&self) -> usize {
        let size = |t: &Tensor| t.numel() * t.dtype().size_in_bytes();
        let pending: usize = self.pending.iter().flatten().map(size).sum();
        size(&self.state) + size(&self.anchor) + pending
    }

    /// Tokens seen.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before the first token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Feeds `T ≥ 1` new tokens (a prompt or one decode step; shapes as in
    /// [`super::gated_delta_rule`]) and returns their outputs `[B, T, Hv, Dv]`. Records no
    /// gradient.
    pub fn step(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
    ) -> Result<Tensor> {
        let _ng = no_grad();
        let m = resolve(q, k, v, g, beta, Some(&self.state), &self.params)?;
        let out_dtype = q.dtype();
        let (q, k) = prepare(q, k, &self.params)?;
        let q = q.f32_or_converted();
        let new = [k, v.clone(), g.clone(), beta.clone()].map(|t| t.f32_or_converted());
        let (v, g, beta) = (&new[1], &new[2], &new[3]);
        let out = if crate::invariant::batch_invariant() {
            let pend = self.pending.as_ref().map_or(0, |p| p[0].shape()[1]);
            let q_all = join(
                Some(&Tensor::zeros(&[m.b, pend, m.hk, m.dk], DType::F32)),
                &q,
            )?;
            let all = self.joined(&new)?;
            let total = pend + m.t;
            let (out, state, chunk_states) = self.chunked(&q_all, &all)?;
            let full = total / DELTA_RULE_CHUNK * DELTA_RULE_CHUNK;
            if full == total {
                self.anchor = state.clone();
            } else if full > 0 {
                // The state entering chunk `full / 64` of this run.
                let at = chunk_states.narrow(1, full / DELTA_RULE_CHUNK, 1)?;
                self.anchor = at.reshape(self.anchor.shape())?.contiguous()?;
            }
            self.state = state;
            self.keep_after(&all, full, total)?;
            rows(&out, pend, m.t)?
        } else {
            let x = DeltaRuleInputs {
                q: &q,
                k: &new[0],
                v,
                g,
                beta,
                state: Some(&self.state),
            };
            let (out, state) = be(&q)?.delta_rule_recurrent(&x, &m)?;
            self.state = state;
            let all = self.joined(&new)?;
            let total = all[0].shape()[1];
            let full = total / DELTA_RULE_CHUNK * DELTA_RULE_CHUNK;
            if full > 0 {
                let head = all.each_ref().map(|t| rows(t, 0, full));
                let [hk, hv, hg, hb] = head;
                let head = [hk?, hv?, hg?, hb?];
                let zq = Tensor::zeros(head[0].shape(), DType::F32);
                // The anchor is what batch-invariant steps continue from, so its chunks run in
                // that mode whatever this step's (on CPUs without a packed kernel the modes'
                // products differ; with one they are the same kernel).
                let _mode = crate::invariant::set_batch_invariant(true);
                self.anchor = self.chunked(&zq, &head)?.1;
            }
            self.keep_after(&all, full, total)?;
            out
        };
        self.len += m.t;
        Ok(if out_dtype == DType::F32 {
            out
        } else {
            out.to_dtype(out_dtype)?
        })
    }

    /// The pending tokens followed by `new`.
    fn joined(&self, new: &[Tensor; 4]) -> Result<[Tensor; 4]> {
        let p = self.pending.as_ref();
        Ok([
            join(p.map(|p| &p[0]), &new[0])?,
            join(p.map(|p| &p[1]), &new[1])?,
            join(p.map(|p| &p[2]), &new[2])?,
            join(p.map(|p| &p[3]), &new[3])?,
        ])
    }

    /// Keeps the tokens of `all` from `full` on as the pending ones.
    fn keep_after(&mut self, all: &[Tensor; 4], full: usize, total: usize) -> Result<()> {
        self.pending = if full == total {
            None
        } else {
            let r = |t: &Tensor| rows(t, full, total - full);
            Some([r(&all[0])?, r(&all[1])?, r(&all[2])?, r(&all[3])?])
        };
        Ok(())
    }

    /// The chunked kernel over `[k, v, g, beta]` (with queries `q`) from the anchor: outputs,
    /// final state and the state entering each chunk.
    fn chunked(&self, q: &Tensor, all: &[Tensor; 4]) -> Result<(Tensor, Tensor, Tensor)> {
        let raw = DeltaRuleParams {
            qk_l2norm: false,
            ..self.params
        };
        let [k, v, g, beta] = all;
        let m = resolve(q, k, v, g, beta, Some(&self.anchor), &raw)?;
        let x = DeltaRuleInputs {
            q,
            k,
            v,
            g,
            beta,
            state: Some(&self.anchor),
        };
        let (out, state, chunk_states) = be(q)?.delta_rule(&x, &m, true)?;
        let chunk_states = chunk_states.expect("the kernel returns chunk states when asked");
        Ok((out, state, chunk_states))
    }
}
