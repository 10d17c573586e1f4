//! Where each stage of a forward gets its parameters when they are not all resident: under
//! FSDP a block's parameters exist in full only around its own forward and backward. The runner
//! ([`super::PluginModel::forward_full`]) asks a [`StageParams`] for each stage's map, says when
//! a stage's forward has ended, and (through an identity op on a block's outputs) when the
//! backward is about to enter the block.

use super::Params;

/// A stage of the forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Token ids to the first hidden state.
    Embed,
    /// Block `i`.
    Layer(usize),
    /// The last hidden state to logits.
    Head,
}

/// Supplies the parameters of each stage of a forward and learns when a block's forward and
/// backward start and end. Called on the thread that runs the forward and the backward.
pub trait StageParams: Send + Sync {
    /// Everything `stage` reads by name (parameters and buffers). For a block this runs once
    /// for its forward and, when the block is recomputed, again in backward (a recompute's
    /// leaves then collect the block's gradients).
    fn params(&self, stage: Stage) -> anneal_engine::Result<Params>;

    /// The forward of `stage` has ended: what it read may be freed until
    /// [`StageParams::before_backward`] (a recomputed block's first run too: its recompute asks
    /// [`StageParams::params`] again).
    fn after_forward(&self, stage: Stage) -> anneal_engine::Result<()>;

    /// The backward is about to run block `i`'s ops (a block that is not recomputed): its
    /// parameters must hold their values again. Called at most once per block and backward.
    fn before_backward(&self, layer: usize) -> anneal_engine::Result<()>;

    /// The expert group the stages' MoE layers send their rows over (expert parallelism: the
    /// expert weights in [`StageParams::params`] are then this rank's share of the experts);
    /// `None` runs every expert locally.
    fn expert_parallel(&self) -> Option<anneal_engine::ops::ExpertParallel> {
        None
    }

    /// The tensor-parallel group the stages' linears and embeddings run over (the split
    /// parameters in [`StageParams::params`] are then this rank's slices); `None` runs them
    /// whole.
    fn tensor_parallel(&self) -> Option<super::TensorParallelism> {
        None
    }
}

/// The stage source of a tensor-parallel forward whose parameters are all resident: every stage
/// reads `params` (this rank's slices of the split parameters, the others whole) and the
/// `linear` / `embedding` host ops run over `tp`. What a tensor-parallel decode (generation,
/// RL rollouts) and the RL trainer's forward run with.
pub struct ResidentTensorParallel {
    /// What every stage reads.
    pub params: Params,
    /// The group and the split parameters.
    pub tp: super::TensorParallelism,
}

impl StageParams for ResidentTensorParallel {
    fn params(&self, _stage: Stage) -> anneal_engine::Result<Params> {
        Ok(self.params.clone())
    }

    fn after_forward(&self, _stage: Stage) -> anneal_engine::Result<()> {
        Ok(())
    }

    fn before_backward(&self, _layer: usize) -> anneal_engine::Result<()> {
        Ok(())
    }

    fn tensor_parallel(&self) -> Option<super::TensorParallelism> {
        Some(self.tp.clone())
    }
}
