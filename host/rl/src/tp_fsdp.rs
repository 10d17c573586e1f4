//! `anneal rl` under tensor parallelism × FSDP (`parallelism.tp` with `parallelism.dp_shard`):
//! FSDP applied last, as in training. Each rank keeps its `dp_shard` rows of its tensor-parallel
//! slices (of the policy, the optimizer state and the KL reference); a step gathers the rows
//! over the rank's `dp_shard` group (the ranks of the same `tp` coordinate) to its whole
//! slices, once, and the rollouts and the trainer then run on them as under tensor parallelism
//! alone. The gradients' `tp`-partial parts (per-head norms) are summed over the group on the
//! gathered slices, then reduce-scattered over `dp_shard`; the norm adds over both axes (the
//! placements). Checkpoints hold whole tensors, as under tensor parallelism alone: every rank
//! gathers its rows to slices ([`Slices::of`]), the group gathers the slices, the lead writes;
//! any layout resumes them (a TP × FSDP run reads its slices, then keeps its rows).

use crate::trainer::RlTrainer;
use anneal_engine::Tensor;
use anneal_runtime::plugins::Params;
use anneal_train::{Dist, TrainError};
use std::collections::BTreeMap;

/// This rank's whole tensor-parallel slices of what a checkpoint holds.
pub(crate) struct Slices {
    /// The trained parameters, sorted by name.
    pub named: Vec<(String, Tensor)>,
    /// The optimizer state of `named`.
    pub state: BTreeMap<String, Tensor>,
    /// The KL reference (parameters and buffers), when the run keeps one.
    pub reference: Option<Params>,
}

impl Slices {
    /// The trainer's slices: as they are without FSDP; under FSDP gathered from this rank's
    /// rows over its `dp_shard` group (exact f32). Collective over that group.
    pub fn of(
        trainer: &RlTrainer<'_>,
        state: &BTreeMap<String, Tensor>,
        dist: &Dist,
    ) -> Result<Slices, TrainError> {
        let Some(f) = trainer.fsdp else {
            return Ok(Slices {
                named: trainer.named.clone(),
                state: state.clone(),
                reference: trainer.reference.clone(),
            });
        };
        let rows = &trainer.named;
        Ok(Slices {
            named: f.gather(dist, rows, false)?,
            state: f.gather_state(dist, rows, state)?,
            reference: trainer
                .reference
                .as_ref()
                .map(|r| f.gather_map(dist, rows, r))
                .transpose()?,
        })
    }
}
