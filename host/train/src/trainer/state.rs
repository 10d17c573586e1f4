//! The trainer's checkpoint side: the snapshot an exact resume needs, and restoring from one,
//! whole or as this rank's piece (FSDP rows, pipeline stages).

use super::Trainer;
use crate::checkpoint::{Loaded, PieceRef, Snapshot, TrainState};
use crate::harness::{
    params_from_checkpoint, params_of_from_checkpoint, params_of_rows_from_checkpoint,
    restore_optimizer, restore_optimizer_of, restore_optimizer_of_with, restore_optimizer_with,
};
use crate::TrainError;
use std::sync::Arc;

impl Trainer {
    /// A host-memory copy of everything an exact resume needs: parameters (`model/<name>`),
    /// optimizer state (`optim/<param>.<state>`), step, data position.
    /// `spare` buffers (from a previous snapshot) are reused.
    /// Under FSDP it holds this rank's piece of the checkpoint: its rows of the parameters and
    /// of their optimizer state (and, on shard rank 0, the buffers and any state held whole),
    /// so no rank ever holds the whole model to save it.
    pub fn snapshot(&self, elapsed_s: f64, spare: Vec<Vec<u8>>) -> Snapshot {
        let mut state = TrainState {
            elapsed_s,
            step: self.step,
            seed: self.cfg.training.seed,
            loader: self.loader.state(),
            lr: self.last_lr,
            tokens: self.tokens,
            model: format!("{}/{}", self.cfg.model.plugin, self.cfg.model.flavor),
            optimizer: self.cfg.optimizer.plugin.clone(),
            config: self.cfg.to_toml(),
            tokenizer_sha256: None,
            data_sha256: None,
            rl: None,
        };
        self.provenance.stamp(&mut state);
        let optim_state = self.optimizer.state();
        if let (Some(tp), Some(fsdp)) = (&self.tp, &self.fsdp) {
            // The stage's first shard and tp rank writes what its stage holds whole (the
            // save group spans the stages under pipeline parallelism).
            let first = self.dist.shard().is_none_or(|c| c.rank() == 0) && tp.place().0 == 0;
            let gathered = self.tp_fsdp_save.gathered();
            let mut pieces = Vec::new();
            crate::tp_fsdp::pieces(
                tp,
                fsdp,
                first,
                &self.named,
                &self.buffers,
                optim_state,
                &gathered,
                &mut pieces,
            );
            return Snapshot::capture_pieces(state, pieces, spare);
        }
        if let Some(tp) = &self.tp {
            return self.tp_snapshot(tp, state, spare);
        }
        let Some(fsdp) = &self.fsdp else {
            let params = self
                .named
                .iter()
                .chain(&self.buffers)
                .map(|(n, p)| (format!("model/{n}"), p));
            let optim = optim_state.iter().map(|(n, t)| (format!("optim/{n}"), t));
            return Snapshot::capture(state, params.chain(optim), spare);
        };
        // Tensors held whole (buffers, replicated state) are saved by shard rank 0 alone.
        let first = self.dist.shard().is_none_or(|c| c.rank() == 0);
        let mut pieces: Vec<PieceRef<'_>> = Vec::new();
        let shards = self.named.iter().map(|(n, p)| (n, p));
        let buffers = self.buffers.iter().map(|(n, p)| (n, p));
        fsdp.shard_pieces(first, "model", shards, buffers, &mut pieces);
        fsdp.state_pieces(first, &self.named, optim_state, &mut pieces);
        Snapshot::capture_pieces(state, pieces, spare)
    }

    /// Under tensor parallelism, gathers what this rank's snapshot needs from the others (the
    /// row-split tensors, saved whole): every rank of the save group calls it before a save.
    pub fn prepare_save(&self) -> Result<(), TrainError> {
        match (&self.tp, self.dist.tp()) {
            (Some(tp), Some(comm)) if self.fsdp.is_some() => self.tp_fsdp_save.prepare(
                tp,
                self.fsdp.as_ref().expect("matched is_some"),
                comm.as_ref(),
                &self.named,
                self.optimizer.state(),
            ),
            (Some(tp), Some(comm)) => {
                tp.prepare_save(comm.as_ref(), &self.named, self.optimizer.state())
            }
            _ => Ok(()),
        }
    }

    /// A tensor-parallel rank's piece of the checkpoint: its rows of the column- and
    /// vocab-split tensors; on the group's first rank also the row-split ones (gathered by
    /// [`Trainer::prepare_save`]), the replicated ones and the buffers.
    fn tp_snapshot(
        &self,
        tp: &crate::tp::TpLayout,
        state: TrainState,
        spare: Vec<Vec<u8>>,
    ) -> Snapshot {
        let first = tp.place().0 == 0;
        let gathered = tp.gathered();
        let mut pieces: Vec<PieceRef<'_>> = Vec::new();
        let named = self
            .named
            .iter()
            .map(|(n, p)| (n.as_str(), format!("model/{n}"), p));
        let optim = self
            .optimizer
            .state()
            .iter()
            .map(|(k, t)| (k.as_str(), format!("optim/{k}"), t));
        for (name, key, t) in named.chain(optim) {
            match tp.row_piece(name, t.shape()) {
                Some(piece) => pieces.push((key, t, Some(piece))),
                // A row-split tensor (or its state) comes whole from the gather.
                None if gathered.iter().any(|(k, _)| *k == key) => {}
                None if first => pieces.push((key, t, None)),
                None => {}
            }
        }
        if first {
            pieces.extend(gathered.iter().map(|(k, t)| (k.clone(), t, None)));
            pieces.extend(
                self.buffers
                    .iter()
                    .map(|(n, p)| (format!("model/{n}"), p, None)),
            );
        }
        Snapshot::capture_pieces(state, pieces, spare)
    }

    /// Continues from a checkpoint that [`crate::harness::resume`] accepted: parameters,
    /// optimizer state, step and data position. Under FSDP each rank reads just its rows, from
    /// whichever shards of whatever layout hold them.
    pub fn restore(&mut self, ckpt: Loaded) -> Result<(), TrainError> {
        // Under pipeline parallelism, this rank's stages' parameters and buffers alone.
        let staged = self.pipeline.is_some();
        let own: std::collections::HashSet<String> = self
            .named
            .iter()
            .chain(&self.buffers)
            .map(|(n, _)| n.clone())
            .collect();
        let keep = |n: &str| !staged || own.contains(n);
        let (named, buffers) = match &self.fsdp {
            Some(fsdp) if self.tp.is_some() => {
                let tp = self.tp.as_ref().expect("matched is_some");
                // Under pipeline parallelism, this rank's stages alone.
                let mine = (&self.named, self.pipeline.is_some());
                crate::tp_fsdp::restore(tp, fsdp, &ckpt, &self.model, mine, &mut self.optimizer)?
            }
            Some(fsdp) => {
                let rows: std::collections::HashMap<&str, std::ops::Range<usize>> = self
                    .named
                    .iter()
                    .zip(fsdp.param_rows())
                    .map(|((n, _), (_, r))| (n.as_str(), r))
                    .collect();
                let rows_of = |n: &str, _: &[usize]| rows.get(n).cloned();
                let loaded =
                    params_of_rows_from_checkpoint(&ckpt, &self.model, "model", &keep, &rows_of)?;
                let (shards, buffers) = crate::harness::split_buffers(&self.model, loaded);
                let state_rows =
                    |key: &str, shape: &[usize]| fsdp.state_rows(&self.named, key, shape);
                match staged {
                    true => {
                        restore_optimizer_of_with(&ckpt, &shards, &mut self.optimizer, &state_rows)?
                    }
                    false => {
                        restore_optimizer_with(&ckpt, &shards, &mut self.optimizer, &state_rows)?
                    }
                }
                (shards, buffers)
            }
            None if self.tp.is_some() => {
                let tp = self.tp.as_ref().expect("matched is_some");
                let loaded =
                    crate::tp::params_from_checkpoint(tp, &ckpt, &self.model, "model", &keep)?;
                let (named, buffers) = crate::harness::split_buffers(&self.model, loaded);
                crate::tp::restore_optimizer(tp, &ckpt, &named, &mut self.optimizer, staged)?;
                (named, buffers)
            }
            None if staged => {
                // This rank's stages' parameters and their optimizer state, nothing else.
                let loaded = params_of_from_checkpoint(&ckpt, &self.model, "model", &keep)?;
                let (named, buffers) = crate::harness::split_buffers(&self.model, loaded);
                restore_optimizer_of(&ckpt, &named, &mut self.optimizer)?;
                (named, buffers)
            }
            None => {
                let loaded = params_from_checkpoint(&ckpt, &self.model, "model")?;
                let (named, buffers) = crate::harness::split_buffers(&self.model, loaded);
                restore_optimizer(&ckpt, &named, &mut self.optimizer)?;
                (named, buffers)
            }
        };
        // A checkpoint loads on the host whatever device wrote it; placed here (only one
        // process runs on a GPU, so only the last arm above reaches this with a GPU device).
        let (named, buffers) =
            crate::device::place_policy(self.device, named, buffers, &mut self.optimizer)?;
        self.loader.restore(&ckpt.state.loader)?;
        self.params = Arc::new(named.iter().chain(&buffers).cloned().collect());
        self.named = named;
        self.buffers = buffers;
        self.release_full();
        self.step = ckpt.state.step;
        self.tokens = ckpt.state.tokens;
        self.last_lr = ckpt.state.lr;
        Ok(())
    }
}
