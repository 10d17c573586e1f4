//! The units' reduce-scatters on the host path: which unit goes next (strictly last block,
//! ..., first block, outer, so every rank starts the same collectives in the same order), the
//! send buffer laid out rank block by rank block, and this rank's summed rows added to the
//! step's. On GPU ranks with NCCL the device path ([`super::device`]) takes over each step.

use super::{Flight, Units};
use crate::TrainError;

impl Units {
    pub(super) fn mark_final(
        &mut self,
        u: usize,
        generation: u64,
        k: usize,
    ) -> Result<(), TrainError> {
        let live = &mut self.mb()?.live[u];
        if live.generation != generation || k >= live.fired.len() {
            return Ok(());
        }
        live.fired[k] = true;
        self.issue_scatters(false)
    }

    /// The unit at position `pos` of the scatter order (last block first, outer last).
    fn scatter_unit(&self, pos: usize) -> usize {
        let n = self.n_layers();
        if pos < n {
            n - 1 - pos
        } else {
            n
        }
    }

    /// Starts the reduce-scatters of the units, in scatter order, whose gradients are all final
    /// (of every remaining unit with `all`); keeps at most two in flight.
    pub(super) fn issue_scatters(&mut self, all: bool) -> Result<(), TrainError> {
        let total = self.units.len();
        let n = self.n_layers();
        loop {
            let pos = self.mb()?.scattered;
            if pos >= total {
                return Ok(());
            }
            let u = self.scatter_unit(pos);
            let live = &self.mb()?.live[u];
            // The outer unit goes when the backward returns: its leaves may be reached by
            // several passes (a recompute's own, then the main one), and a hook fires per pass.
            let ready = u < n && !live.leaves.is_empty() && live.fired.iter().all(|&f| f);
            if !(all || ready) {
                return Ok(());
            }
            self.start_scatter(u)?;
            if !all {
                self.early_scatters += 1;
            }
            self.mb()?.scattered += 1;
            while self.mb()?.scatters.len() > 2 {
                self.finish_oldest_scatter()?;
            }
        }
    }

    /// Starts unit `u`'s reduce-scatters (members' gradients, zeros for none, in one buffer
    /// per group laid out rank block by rank block) and lets go of its leaves.
    fn start_scatter(&mut self, u: usize) -> Result<(), TrainError> {
        if self.dev.is_some() {
            return self.start_scatter_device(u);
        }
        let live = std::mem::take(&mut self.mb()?.live[u]);
        let members = &self.units[u];
        let grads: Vec<Option<Vec<f32>>> = members
            .iter()
            .enumerate()
            .map(|(k, _)| {
                live.leaves
                    .get(k)
                    .and_then(|l| l.grad())
                    .map(|g| g.to_vec_f32())
            })
            .collect();
        let mut started = Vec::new();
        for (group, ks) in self.groups(u) {
            let members = &self.units[u];
            let ranks = self.comms(group)?.1.size();
            let stride: usize = ks.iter().map(|&k| members[k].shard.block_len()).sum();
            let mut send = vec![0f32; stride * ranks];
            for r in 0..ranks {
                let mut at = r * stride;
                for &k in &ks {
                    let block = members[k].shard.block_len();
                    if let Some(g) = &grads[k] {
                        let from = (r * block).min(g.len());
                        let to = ((r + 1) * block).min(g.len());
                        send[at..at + (to - from)].copy_from_slice(&g[from..to]);
                    }
                    at += block;
                }
            }
            let pending = self.comms(group)?.1.ireduce_scatter_sum(send)?;
            started.push((group, Flight::Host(pending)));
        }
        for (m, g) in self.units[u].iter().zip(&grads) {
            if g.is_some() {
                self.got_grad[m.index] = true;
            }
        }
        let pending = started;
        if !live.leaves.is_empty() && !live.released {
            let bytes = self.unit_bytes(u);
            self.let_go(bytes);
        }
        drop(live);
        self.mb()?.scatters.push_back((u, pending));
        Ok(())
    }

    /// Waits for the oldest reduce-scatter in flight and adds this rank's rows to the step's.
    pub(super) fn finish_oldest_scatter(&mut self) -> Result<(), TrainError> {
        let Some((u, pending)) = self.mb()?.scatters.pop_front() else {
            return Ok(());
        };
        if self.dev.is_some() {
            return self.finish_scatter_device(u, pending);
        }
        let groups = self.groups(u);
        for (g, pending) in pending {
            let block = pending.wait_host()?;
            let ks = groups
                .iter()
                .find(|(gg, _)| *gg == g)
                .map(|(_, ks)| ks.as_slice())
                .unwrap_or_default();
            let mut at = 0;
            for &k in ks {
                let m = &self.units[u][k];
                let rows = &block[at..at + m.shard.len()];
                for (acc, v) in self.grad_rows[m.index].iter_mut().zip(rows) {
                    *acc += v;
                }
                at += m.shard.block_len();
            }
        }
        Ok(())
    }
}
