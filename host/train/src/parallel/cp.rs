//! Context parallelism (`parallelism.cp`): each sequence of a micro-batch is cut into `2·cp`
//! equal chunks and rank `r` of a `cp` group holds chunks `r` and `2·cp − 1 − r` (causal load
//! balancing: under a causal mask a head chunk is cheap and its mirror from the tail dear, so
//! every rank does the same work). Its tokens, targets and positions are those chunks; the
//! attention host op passes keys and values around the group's ring ([`crate::parallel::context`]), and
//! everything else in a block works token by token.
//!
//! Each rank's loss is the mean over its tokens divided by `cp` (every rank holds as many
//! tokens), so summing over the group gives the micro-batch's mean; gradients, losses,
//! auxiliary losses and statistics are summed over data-parallel × `cp` ranks
//! ([`crate::parallel::dist::Dist::grads`]). A model's auxiliary losses are computed per rank over its
//! own tokens (a router's balancing loss sees half of each sequence under cp = 2) and weighted
//! by `1 / cp` like the cross-entropy, so the reported `aux_loss.*` are the mean over the
//! group's ranks, close to but not the single process's; statistics summed for the buffer hook
//! (expert token counts) are the whole step's, exactly, while their reported means are per
//! rank's tokens.
//!
//! Composed: inside pipeline stages ([`crate::parallel::pp`]) each stage runs its blocks on this rank's
//! chunks ([`Context::local_batch`]), with the ring over the stage's `cp` group and hidden
//! tensors passed between ranks of the same `cp` coordinate. Under expert parallelism the MoE
//! layers dispatch this rank's tokens over an expert group within its `cp` coordinate, and each
//! slice of experts is sharded over its `efsdp × cp` ranks ([`anneal_dist::Mesh::expert_comms`]).

use crate::parallel::context::{ActiveRing, RankRing};
use crate::TrainError;
use anneal_config::JobConfig;
use anneal_data::Batch;
use anneal_dist::{Collective, Mesh, MeshDim};
use anneal_engine::ops::KvRing;
use anneal_engine::Tensor;
use std::sync::Arc;

/// The communicators of a `cp > 1` mesh.
pub(crate) struct CpComms {
    /// This rank's `cp` group, by `cp` coordinate.
    pub cp: Box<dyn Collective>,
    /// The same ranks, for the attention ring (taken by the trainer).
    pub ring: Option<Box<dyn Collective>>,
    /// Data-parallel × `cp` ranks: what gradients and losses are summed over.
    pub grads: Box<dyn Collective>,
}

impl CpComms {
    /// The communicators when `mesh` has `cp > 1`, `None` otherwise. Collective over `world`.
    pub fn new(mesh: &Mesh, world: &dyn Collective) -> Result<Option<CpComms>, TrainError> {
        if mesh.degree(MeshDim::Cp) == 1 {
            return Ok(None);
        }
        let cp = mesh.comm(world, MeshDim::Cp)?;
        let ring = mesh.comm(world, MeshDim::Cp)?;
        let grads = mesh.comm_of(
            world,
            &[MeshDim::DpReplicate, MeshDim::DpShard, MeshDim::Cp],
        )?;
        Ok(Some(CpComms {
            cp,
            ring: Some(ring),
            grads,
        }))
    }
}

/// The user error of a `cp > 1` layout, naming the keys: a sequence that does not cut into
/// `2·cp` chunks, or whose part on a cp rank does not split over `tp` under sequence
/// parallelism.
pub(crate) fn check_mesh(cfg: &JobConfig, mesh: &Mesh) -> Result<(), TrainError> {
    let cp = mesh.degree(MeshDim::Cp);
    if cp == 1 {
        return Ok(());
    }
    let seq = cfg.training.seq_len;
    if !seq.is_multiple_of(2 * cp) {
        return Err(TrainError::Config(format!(
            "config: `training.seq_len` ({seq}) must be a multiple of 2 × `parallelism.cp` ({}): each rank holds a chunk from the head and one from the tail of every sequence; pick a seq_len that is a multiple of {}",
            2 * cp,
            2 * cp
        )));
    }
    // Sequence parallelism splits this rank's part of each sequence, not the whole.
    let tp = mesh.degree(MeshDim::Tp);
    let part = seq / cp;
    if cfg.parallelism.tp_sequence && tp > 1 && !part.is_multiple_of(tp) {
        return Err(TrainError::Config(format!(
            "config: `parallelism.tp_sequence` splits each cp rank's {part} tokens (`training.seq_len` {seq} / `parallelism.cp` {cp}) over `parallelism.tp` = {tp} ranks, which does not divide them; pick a seq_len that is a multiple of {}",
            2 * cp * tp / gcd(2, tp)
        )));
    }
    Ok(())
}

fn gcd(a: usize, b: usize) -> usize {
    match b {
        0 => a,
        _ => gcd(b, a % b),
    }
}

/// Which part of every sequence this rank holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Split {
    /// This rank's `cp` coordinate.
    pub rank: usize,
    /// Ranks in the `cp` group.
    pub size: usize,
}

impl Split {
    /// The positions this rank holds in a sequence of `seq_len` (a multiple of `2·size`):
    /// chunk `rank`, then chunk `2·size − 1 − rank`.
    pub fn positions(&self, seq_len: usize) -> Vec<usize> {
        let c = seq_len / (2 * self.size);
        let (head, tail) = (self.rank, 2 * self.size - 1 - self.rank);
        (head * c..(head + 1) * c)
            .chain(tail * c..(tail + 1) * c)
            .collect()
    }

    /// This rank's part of `rows` sequences of `seq_len` laid out row after row: `[rows, T/cp]`
    /// values, row after row.
    pub fn take<T: Copy>(&self, values: &[T], rows: usize, seq_len: usize) -> Vec<T> {
        let pos = self.positions(seq_len);
        (0..rows)
            .flat_map(|r| pos.iter().map(move |&p| values[r * seq_len + p]))
            .collect()
    }
}

/// A `cp > 1` trainer's side of context parallelism: which part of each sequence it holds,
/// and the attention ring, installed on the training thread while the trainer lives (also
/// `anneal rl`'s, as `anneal_train::CpContext`).
pub struct Context {
    split: Split,
    ring: Arc<dyn KvRing>,
    _active: ActiveRing,
}

impl Context {
    /// Installs `ring` (the `cp` group, by coordinate) on this thread.
    pub fn activate(ring: Box<dyn Collective>) -> Context {
        let split = Split {
            rank: ring.rank(),
            size: ring.size(),
        };
        let (active, ring) = RankRing::activate(ring);
        Context {
            split,
            ring,
            _active: active,
        }
    }

    /// Ranks in the `cp` group.
    pub fn size(&self) -> usize {
        self.split.size
    }

    /// This rank's `cp` coordinate.
    pub fn rank(&self) -> usize {
        self.split.rank
    }

    /// The positions this rank holds in a sequence of `seq_len` (a multiple of `2·cp`), in the
    /// order its part lays them out.
    pub fn local_positions(&self, seq_len: usize) -> Vec<usize> {
        self.split.positions(seq_len)
    }

    /// The ring the attention op passes keys and values around.
    pub fn ring(&self) -> Arc<dyn KvRing> {
        self.ring.clone()
    }

    /// The global positions this rank holds (i64 `[seq_len / cp]`).
    pub fn positions(&self, seq_len: usize) -> Result<Tensor, TrainError> {
        let pos: Vec<i64> = self
            .split
            .positions(seq_len)
            .into_iter()
            .map(|p| p as i64)
            .collect();
        let n = pos.len();
        Ok(Tensor::from_vec(pos, &[n])?)
    }

    /// For the log: what this rank holds.
    pub fn summary(&self, seq_len: usize) -> String {
        let c = seq_len / (2 * self.split.size);
        let (head, tail) = (self.split.rank, 2 * self.split.size - 1 - self.split.rank);
        format!(
            "cp: rank {} of {} holds positions {}..{} and {}..{} of every sequence ({} of {seq_len} tokens)",
            self.split.rank,
            self.split.size,
            head * c,
            (head + 1) * c,
            tail * c,
            (tail + 1) * c,
            2 * c
        )
    }

    /// This rank's part of a batch: token ids `[B, T/cp]`, targets `[B·T/cp]` and `T/cp`.
    pub fn batch(&self, b: &Batch) -> Result<(Tensor, Tensor, usize), TrainError> {
        let t = b.seq_len / self.split.size;
        let x = self.split.take(&b.inputs, b.batch, b.seq_len);
        let y = self.split.take(&b.targets, b.batch, b.seq_len);
        Ok((
            Tensor::from_vec(x, &[b.batch, t])?,
            Tensor::from_vec(y, &[b.batch * t])?,
            t,
        ))
    }

    /// This rank's part of a batch as a batch of its own (`[B, T/cp]` token ids and targets):
    /// what a pipeline stage runs on under context parallelism.
    pub fn local_batch(&self, b: &Batch) -> Batch {
        Batch {
            inputs: self.split.take(&b.inputs, b.batch, b.seq_len),
            targets: self.split.take(&b.targets, b.batch, b.seq_len),
            batch: b.batch,
            seq_len: b.seq_len / self.split.size,
            images: Vec::new(),
            row_images: Vec::new(),
            positions: Vec::new(),
        }
    }

    /// The step's micro-batch losses from every rank's means over its tokens (`local`, this
    /// rank's micro-batches in order), gathered over `grads` (data-parallel × cp ranks, cp
    /// fastest): each micro-batch's loss is the mean of its cp parts. Collective.
    pub fn micro_batch_losses(
        &self,
        grads: &dyn Collective,
        local: &[f32],
    ) -> Result<Vec<f32>, TrainError> {
        let per = local.len();
        let mut all = vec![0f32; per * grads.size()];
        grads.all_gather(local.into(), (&mut all[..]).into())?;
        let cp = self.split.size;
        Ok(all
            .chunks(per * cp)
            .flat_map(|group| {
                (0..per).map(move |j| {
                    let sum: f64 = (0..cp).map(|c| f64::from(group[c * per + j])).sum();
                    (sum / cp as f64) as f32
                })
            })
            .collect())
    }

    /// Each value the mean of the `cp` ranks' values (`comm`: the cp group). Collective.
    pub fn sum_parts(&self, comm: &dyn Collective, local: &[f32]) -> Result<Vec<f32>, TrainError> {
        let mut buf = local.to_vec();
        comm.all_reduce_sum(&mut buf)?;
        let cp = self.split.size as f32;
        Ok(buf.into_iter().map(|v| v / cp).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_hold_a_head_chunk_and_its_mirror_and_cover_the_sequence() {
        let t = 12;
        for size in [1, 2, 3] {
            let mut all: Vec<usize> = (0..size)
                .flat_map(|rank| Split { rank, size }.positions(t))
                .collect();
            all.sort_unstable();
            assert_eq!(all, (0..t).collect::<Vec<_>>(), "cp = {size}");
        }
        let s = Split { rank: 0, size: 2 };
        assert_eq!(s.positions(8), vec![0, 1, 6, 7]);
        let s = Split { rank: 1, size: 2 };
        assert_eq!(s.positions(8), vec![2, 3, 4, 5]);
        let values: Vec<i64> = (0..16).collect();
        assert_eq!(
            Split { rank: 0, size: 2 }.take(&values, 2, 8),
            vec![0, 1, 6, 7, 8, 9, 14, 15]
        );
    }
}
