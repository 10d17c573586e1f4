//! The parallel layer: where each trained parameter lives over the job's mesh
//! ([`Placements`]: for every axis of the mesh, `Shard(dim)`, `Replicate`, `Partial` or
//! `Stage`), and what is written once over those placements instead of once per layout: the
//! gradient norm ([`Placements::grad_norm`]), which clipping then uses, the sums of gradients
//! that are partial over an axis ([`Placements::sum_partial_grads`]), and the trainer's
//! checkpoint pieces and restores ([`checkpoint`]).
//!
//! Each layout contributes to the placements rather than owning a code path: FSDP shards
//! every parameter's rows over its ranks, tensor parallelism splits the parameters a plugin
//! declares split (column, row, vocab, experts' widths) and keeps the rest whole, a pipeline
//! puts each parameter on one stage, and data-parallel replicas hold copies.

pub(crate) mod checkpoint;
pub(crate) mod context;
pub(crate) mod cp;
pub(crate) mod dist;
pub(crate) mod ep;
pub(crate) mod fsdp;
pub(crate) mod full_matrix;
mod grads;
pub mod nccl;
pub(crate) mod nccl_groups;
mod norm;
mod placement;
pub(crate) mod pp;
pub(crate) mod staged;
pub(crate) mod tp;
pub(crate) mod tp_fsdp;
pub(crate) mod tp_infer;

pub use placement::{Axis, Placement, Placements};
/// The pipeline as `anneal rl` drives it: its stages' setup, the schedule with a caller's
/// last-stage loss, and every stage's tensors gathered on every rank.
pub use pp::{
    setup as pipeline_setup, whole::gather_whole as pipeline_gather, LossFn, Pipeline,
    StepCtx as PipelineCtx, StepResult as PipelineResult,
};
