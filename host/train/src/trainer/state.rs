//! The trainer's checkpoint side: the snapshot an exact resume needs, and restoring from one,
//! whole or as this rank's piece (FSDP rows, pipeline stages).

use super::Trainer;
use crate::checkpoint::{Loaded, Snapshot, TrainState};
use crate::parallel::checkpoint;
use crate::TrainError;

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
        // The tensors held whole are written by the first rank of the shard and tp groups.
        let first = self.dist.shard().is_none_or(|c| c.rank() == 0)
            && self.tp.as_ref().is_none_or(|tp| tp.place().0 == 0);
        let gathered = self.save_rows.gathered();
        let mut pieces = Vec::new();
        checkpoint::pieces(
            self.cut(),
            first,
            (&self.named, &self.buffers),
            self.optimizer.state(),
            &gathered,
            &mut pieces,
        );
        Snapshot::capture_pieces(state, pieces, spare)
    }

    /// A LoRA run's checkpoint: the adapters by name and the model's buffers (the base is
    /// frozen, and rebuilt from where the run took it rather than saved).
    fn read_adapters(
        &self,
        ckpt: &Loaded,
    ) -> Result<Vec<(String, anneal_engine::Tensor)>, TrainError> {
        let buffers: std::collections::HashSet<&str> =
            self.buffers.iter().map(|(n, _)| n.as_str()).collect();
        let keep = |n: &str| buffers.contains(n);
        let mut all =
            checkpoint::read_params(self.cut(), ckpt, &self.model, ("model", &keep), &[])?;
        for (name, p) in &self.named {
            let key = format!("model/{name}");
            let fits = ckpt
                .describe(&key)
                .is_some_and(|(shape, _)| shape == p.shape());
            if !fits {
                return Err(TrainError::Checkpoint(
                    crate::checkpoint::CheckpointError::Mismatch(format!(
                        "{}: no adapter {key} of shape {:?}: the checkpoint was not taken with \
                         this [lora] (rank and targets)",
                        ckpt.dir.display(),
                        p.shape()
                    )),
                ));
            }
            all.push((name.clone(), ckpt.tensor(&key)?.detach()));
        }
        Ok(all)
    }

    /// The layouts that cut this rank's parameters from the whole.
    fn cut(&self) -> checkpoint::Cut<'_> {
        checkpoint::Cut {
            tp: self.tp.as_ref(),
            fsdp: self.fsdp.as_ref(),
        }
    }

    /// Under tensor parallelism, gathers what this rank's snapshot needs from the others (the
    /// rows of the tensors split along a dim other than 0): every rank of the save group calls
    /// it before a save.
    pub fn prepare_save(&self) -> Result<(), TrainError> {
        match self.dist.tp() {
            Some(comm) => self.save_rows.prepare(
                self.cut(),
                comm.as_ref(),
                &self.named,
                self.optimizer.state(),
            ),
            None => Ok(()),
        }
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
        let loaded = match self.lora.is_some() {
            true => self.read_adapters(&ckpt)?,
            false => checkpoint::read_params(
                self.cut(),
                &ckpt,
                &self.model,
                ("model", &keep),
                &self.named,
            )?,
        };
        let (named, buffers) = crate::harness::split_buffers(&self.model, loaded);
        let cut = checkpoint::Cut {
            tp: self.tp.as_ref(),
            fsdp: self.fsdp.as_ref(),
        };
        let mine = (named.as_slice(), staged);
        checkpoint::read_optimizer(cut, &ckpt, mine, &mut self.optimizer)?;
        // A checkpoint loads on the host whatever device wrote it; placed here.
        let (named, buffers) =
            crate::device::place_policy(self.device, named, buffers, &mut self.optimizer)?;
        self.loader.restore(&ckpt.state.loader)?;
        self.named = named;
        self.buffers = buffers;
        self.params = self.resident_params();
        self.release_full();
        self.step = ckpt.state.step;
        self.tokens = ckpt.state.tokens;
        self.last_lr = ckpt.state.lr;
        Ok(())
    }
}
