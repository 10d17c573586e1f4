//! Ops: each declares its shape rule, forward (a backend kernel) and backward side by side.
//!
//! Every op is available as a method on [`Tensor`] (`x.exp()?`, `a.matmul(&b)?`) and records a
//! node in the autograd graph when grad is enabled and an input requires grad.

mod attention;
mod cp_gather;
mod delta_rule;
mod delta_rule_cache;
mod elementwise;
mod gathered_attention;
mod matmul;
mod reduce;
mod ring_attention;
mod view;

pub use attention::{scaled_dot_product_attention, AttentionGrads, AttentionParams, AttentionSpec};
pub use cp_gather::{cp_gather, gather_attention, GatherGrad};
pub use delta_rule::{
    gated_delta_rule, gated_delta_rule_recurrent, DeltaRuleInputs, DeltaRuleOutput,
    DeltaRuleParams, DeltaRuleSpec, DELTA_RULE_CHUNK,
};
pub use delta_rule_cache::DeltaRuleCache;
pub use elementwise::{BinaryOp, UnaryOp};
pub use gathered_attention::{gathered_attention, GatheredAttentionParams};
pub use reduce::{read_values, sum_of_squares_each, ReduceOp};
pub use ring_attention::{ring_attention, KvRing};

pub(crate) use elementwise::add;

use crate::backend::{backend_for, Backend};
use crate::error::Result;
use crate::Tensor;

/// The backend for `t`'s device.
pub(crate) fn be(t: &Tensor) -> Result<&'static dyn Backend> {
    backend_for(t.device())
}

/// `dst += src` without autograd (gradient accumulation, optimizer updates).
pub fn add_assign(dst: &Tensor, src: &Tensor) -> Result<()> {
    be(dst)?.add_assign(dst, src)
}

mod embedding;
mod loss;
mod norm;
mod rope;
mod softmax;

pub use loss::{cross_entropy, CrossEntropy, Reduction};
pub use rope::{
    rope_inv_freq, rope_tables, Llama3Scaling, RopeLayout, RopeScaling, RopeSpec, RopeStyle,
    YarnScaling,
};

/// The fused-kernel backend for `t`'s device.
pub(crate) fn fused(t: &Tensor) -> Result<&'static dyn crate::backend::FusedBackend> {
    crate::backend::fused_backend_for(t.device())
}

/// Fails with [`crate::Error::DType`] unless `t` holds floats.
pub(crate) fn require_float(op: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(crate::Error::DType {
            op,
            got: t.dtype(),
            expected: "a floating dtype",
        })
    }
}

mod index;
mod moe;
mod moe_balance;
mod moe_ep;
mod moe_layer;
mod moe_router;
mod random;
mod shape;

mod optim;
mod swiglu;
mod tp;
mod tp_vocab;
pub(crate) use optim::AdamWConsts;
pub use optim::{adamw_step, AdamW, AdamWTensors};

pub use index::where_;
pub use moe::{histogram, sort_by_expert, ExpertCounts, ExpertRouting};
pub use moe_balance::{
    load_balancing_loss, update_router_bias, ExpertLoad, RouterStats, DEFAULT_BIAS_UPDATE_RATE,
};
pub use moe_ep::{staged_start_rows, ExpertExchange, ExpertParallel, RowsInFlight, TensorInFlight};
pub use moe_layer::{
    moe_ffn, moe_ffn_ep, moe_ffn_tp, moe_ffn_tp_ep, ExpertActivation, ExpertLayout, MoeOutput,
    MoeSpec, MoeTensorParallel, MoeWeights, SharedExpert,
};
pub use moe_router::{route, RouterScore, RouterSpec, Routing};
pub use shape::{cat, stack};
pub use tp::{
    staged_all_gather, staged_all_reduce, staged_reduce_scatter, tp_copy, tp_embedding, tp_gather,
    tp_gather_replicated, tp_reduce, tp_scatter, vocab_parallel_cross_entropy, TensorParallelGroup,
    TpGroup,
};
pub use tp_vocab::tp_vocab_gather;
