//! Tensor parallelism with FSDP (`tp` × `dp_shard`), FSDP applied last as TorchTitan does:
//! each tensor-parallel rank first keeps its slices of the split parameters ([`crate::parallel::tp::TpLayout`]),
//! then those local slices (and the replicated parameters) are sharded by dim-0 rows over the
//! rank's `dp_shard` group exactly as plain FSDP shards whole parameters ([`crate::parallel::fsdp`]). The
//! per-block gather hook therefore hands the runner the local slices, which the tensor-parallel
//! host ops use as they do without FSDP ([`Hook`]).
//!
//! Gradients travel the FSDP way only: reduce-scattered over `dp_shard` (then summed over
//! `dp_replicate` under HSDP), never over `tp` for a split parameter, whose slices are
//! different tensors; under sequence parallelism the replicated parameters' shard gradients are
//! then summed over `tp` ([`crate::parallel::Placements::sum_partial_grads`] on the shards: every rank of a
//! tensor-parallel group holds the same rows of them). The norm is the placements' one
//! ([`crate::parallel`]).
//!
//! Checkpoints are the parallel layer's ([`crate::parallel::checkpoint`]).

use anneal_runtime::plugins::{Params, Stage, StageParams, TensorParallelism};

/// The runner's stage hook under TP × FSDP: the FSDP driver's per-block gathers (of the local
/// slices) with the tensor-parallel context beside them.
pub(crate) struct Hook {
    /// The context the `linear` / `embedding` host ops use.
    pub tp: TensorParallelism,
}

impl StageParams for Hook {
    fn params(&self, stage: Stage) -> anneal_engine::Result<Params> {
        crate::parallel::fsdp::Hook.params(stage)
    }

    fn after_forward(&self, stage: Stage) -> anneal_engine::Result<()> {
        crate::parallel::fsdp::Hook.after_forward(stage)
    }

    fn before_backward(&self, layer: usize) -> anneal_engine::Result<()> {
        crate::parallel::fsdp::Hook.before_backward(layer)
    }

    fn tensor_parallel(&self) -> Option<TensorParallelism> {
        Some(self.tp.clone())
    }

    /// Under `ep` too, the MoE layers send the rows to the experts' ranks of the same `tp`
    /// coordinate (each holding its experts' width slices).
    fn expert_parallel(&self) -> Option<anneal_engine::ops::ExpertParallel> {
        crate::parallel::ep::current()
    }
}
