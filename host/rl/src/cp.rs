//! `anneal rl` under context parallelism (`parallelism.cp`): the ranks of a `cp` group train on
//! the same groups, each running its part of every padded row through the trainer's forward.
//!
//! - Rollouts decode with the whole policy (replicated over the `cp` ranks): the group's first
//!   rank rolls out, evaluates and writes the run's files, and hands each step's taken groups
//!   to the others ([`share_taken`]), so the group trains on one batch whatever the rollouts'
//!   timing.
//! - The trainer forward holds, of every row padded to a multiple of `2·cp`, chunks `r` and
//!   `2·cp − 1 − r` at their global positions (as `anneal train`'s context parallelism). It
//!   runs batch-invariant, where the attention gathers the group's keys and values whole
//!   ([`anneal_engine::ops::gather_attention`]) instead of merging partial softmaxes around the
//!   ring, so each row's logits are bitwise the whole forward's and so the rollout decode's:
//!   the logprob mismatch stays exactly 0.
//! - The logits rows are gathered whole ([`RlContext::whole_rows`], whose backward keeps this
//!   rank's rows), so the metrics and the loss run unchanged on the whole batch, identically on
//!   every rank of the group; each rank's parameter gradients are its rows' share, summed over
//!   data-parallel × `cp` ranks ([`anneal_train::Dist::grads`]).
//! - A model's auxiliary losses see this rank's tokens and are weighted `1 / cp`, as in
//!   training.

use crate::buffer::{Item, Taken};
use crate::rollout::Group;
use anneal_engine::ops::{cp_gather, GatherGrad, KvRing};
use anneal_engine::Tensor;
use anneal_train::preflight::Degrees;
use anneal_train::{CpContext, Dist, TrainError};
use std::sync::Arc;

/// Refuses what `anneal rl` does not run under context parallelism yet: `cp` beside tensor
/// parallelism or sharded parameters. A user error naming the keys.
pub(crate) fn check(mesh: &Degrees) -> Result<(), TrainError> {
    let cp = mesh.cp;
    if cp == 1 {
        return Ok(());
    }
    for (key, n) in [
        ("parallelism.tp", mesh.tp),
        ("parallelism.dp_shard", mesh.dp_shard),
    ] {
        if n > 1 {
            return Err(TrainError::Config(format!(
                "config: `parallelism.cp` ({cp}) with `{key}` ({n}): `anneal rl` runs context parallel over whole (replicated) policies only, not beside {key} yet; set one of them to 1"
            )));
        }
    }
    Ok(())
}

/// A `cp > 1` RL rank's side of context parallelism: its part of each row and the ring,
/// installed on this thread while it lives.
pub(crate) struct RlContext {
    ctx: CpContext,
}

impl RlContext {
    /// Takes the ring's communicator from `dist` and installs it on this thread; `None`
    /// unless `cp > 1`.
    pub fn of_dist(dist: &mut Dist) -> Option<RlContext> {
        dist.take_ring_comm().map(|ring| RlContext {
            ctx: CpContext::activate(ring),
        })
    }

    /// This rank's `cp` coordinate.
    pub fn rank(&self) -> usize {
        self.ctx.rank()
    }

    /// Ranks in the `cp` group.
    pub fn size(&self) -> usize {
        self.ctx.size()
    }

    /// The ring the attention host op gathers over.
    pub fn ring(&self) -> Arc<dyn KvRing> {
        self.ctx.ring()
    }

    /// `t` rounded up to a multiple of `2·cp` (padding after every row's last token changes
    /// no real position's logits under the causal mask).
    pub fn padded(&self, t: usize) -> usize {
        let chunks = 2 * self.size();
        t.div_ceil(chunks) * chunks
    }

    /// For the log: what this rank holds.
    pub fn summary(&self) -> String {
        format!(
            "cp: rank {} of {} runs chunks {} and {} of every row of the trainer's forward (all-gathered keys and values); rollouts and evaluation on cp rank 0",
            self.rank(),
            self.size(),
            self.rank(),
            2 * self.size() - 1 - self.rank()
        )
    }

    /// This rank's part of `n` rows of `t` input ids (`t` a multiple of `2·cp`): ids
    /// `[n, t / cp]` and their global positions `[t / cp]`.
    pub fn local(
        &self,
        inputs: &[i64],
        n: usize,
        t: usize,
    ) -> Result<(Tensor, Tensor), TrainError> {
        let pos = self.ctx.local_positions(t);
        let ids: Vec<i64> = (0..n)
            .flat_map(|r| pos.iter().map(move |&p| inputs[r * t + p]))
            .collect();
        let tl = pos.len();
        Ok((
            Tensor::from_vec(ids, &[n, tl])?,
            Tensor::from_vec(pos.into_iter().map(|p| p as i64).collect(), &[tl])?,
        ))
    }

    /// `logits [n, t / cp, v]`, this rank's rows, joined over the group into `[n, t, v]`. Every
    /// rank computes the same loss from the same whole logits, so the backward keeps this
    /// rank's rows of the gradient. Collective over the group.
    pub fn whole_rows(&self, logits: &Tensor) -> Result<Tensor, TrainError> {
        let tl = logits.shape().get(1).copied().unwrap_or(0);
        let t = tl * self.size();
        let pos = self.ctx.local_positions(t);
        let pos = Tensor::from_vec(pos.into_iter().map(|p| p as i64).collect(), &[tl])?;
        let (whole, sorted) = cp_gather(logits, 1, &pos, self.ring(), GatherGrad::Own)?;
        debug_assert!(sorted.iter().enumerate().all(|(i, &p)| p == i as i64));
        Ok(whole)
    }
}

/// The step's taken groups of the `cp` group's first rank (`taken`, `None` on the others) on
/// every rank of the group. They travel as JSON, with what the trainer reads as numbers (each
/// sample's reward and rollout logprobs) beside them as exact bits: a JSON float need not
/// parse back to the same bits, and the logprobs must (the mismatch is compared exactly).
/// Collective over the group.
pub(crate) fn share_taken(
    dist: &Dist,
    taken: Option<Taken<Group>>,
) -> Result<Taken<Group>, TrainError> {
    let Some(comm) = dist.cp() else {
        return taken.ok_or_else(|| TrainError::Rollout("no rollouts were taken".into()));
    };
    let err = |e: serde_json::Error| TrainError::Rollout(format!("the cp group's rollouts: {e}"));
    let mut bytes = match &taken {
        Some(t) => {
            let items: Vec<(u64, &Group)> =
                t.items.iter().map(|it| (it.version, &it.value)).collect();
            let exact: Vec<u64> = t
                .items
                .iter()
                .flat_map(|it| exact_bits(&it.value))
                .collect();
            serde_json::to_vec(&(t.dropped, items, exact)).map_err(err)?
        }
        None => Vec::new(),
    };
    let mut len = (bytes.len() as u64).to_le_bytes();
    comm.broadcast(&mut len, 0)?;
    bytes.resize(u64::from_le_bytes(len) as usize, 0);
    comm.broadcast(&mut bytes, 0)?;
    if let Some(t) = taken {
        return Ok(t);
    }
    type Payload = (usize, Vec<(u64, Group)>, Vec<u64>);
    let (dropped, items, exact): Payload = serde_json::from_slice(&bytes).map_err(err)?;
    let mut exact = exact.into_iter();
    let mut items: Vec<Item<Group>> = items
        .into_iter()
        .map(|(version, value)| Item { version, value })
        .collect();
    for s in items.iter_mut().flat_map(|it| it.value.samples.iter_mut()) {
        s.scored.reward = f64::from_bits(exact.next().unwrap_or_default());
        for lp in &mut s.logprobs {
            *lp = f32::from_bits(exact.next().unwrap_or_default() as u32);
        }
    }
    Ok(Taken { items, dropped })
}

/// A group's rewards and rollout logprobs as bits, sample by sample.
fn exact_bits(g: &Group) -> impl Iterator<Item = u64> + '_ {
    g.samples.iter().flat_map(|s| {
        std::iter::once(s.scored.reward.to_bits())
            .chain(s.logprobs.iter().map(|lp| u64::from(lp.to_bits())))
    })
}
