//! Host ops under context parallelism: a forward whose [`HostSession`] has a ring
//! ([`super::ForwardOpts::ring`]) holds one rank's part of the sequence (with causal load
//! balancing, two chunks that are not contiguous), so attention must see every rank's keys and
//! anything that runs along the sequence on its own state cannot run on a part.
//!
//! - `attention` becomes [`anneal_engine::ops::ring_attention`]: masks come from the positions
//!   the forward was given, which are the part's global positions, so windows, softcap, sinks
//!   and grouped queries need nothing else.
//! - A KV cache (decode) and per-row positions (continuous batching) are generation's, which
//!   does not run under context parallelism.
//! - The linear-attention recurrences (`gated_delta_rule`, `causal_conv1d`), the named-state ops
//!   (`cache_append`, `state_get`, `state_set`) and DeepSeek-V4's compressed-attention mask
//!   read the sequence in order from its first token: a part would silently give a different
//!   model, so they are refused, naming the key that asked for the split.

use super::host::HostSession;
use anneal_engine::ops::{AttentionParams, KvRing};
use anneal_engine::Tensor;
use anneal_plugin_api::ops as o;
use std::sync::Arc;

/// Ops that run along the whole sequence from its start, which a rank's part cannot.
const SEQUENTIAL: [&str; 6] = [
    o::GatedDeltaRule::OP,
    o::CausalConv1d::OP,
    o::CacheAppend::OP,
    o::StateGet::OP,
    o::StateSet::OP,
    o::CompressedMask::OP,
];

/// Refuses `op` when the session splits the sequence and `op` cannot run on a part of it.
pub(crate) fn check(op: &str, session: &HostSession) -> Result<(), String> {
    match session.ring() {
        Some(ring) if SEQUENTIAL.contains(&op) => Err(format!(
            "{op} runs along the whole sequence from its first token and does not run under context parallelism (parallelism.cp = {}); set parallelism.cp = 1 for this model",
            ring.size()
        )),
        _ => Ok(()),
    }
}

/// `attention` over the keys of every rank of `ring`: `q`, `k`, `v` are this rank's part,
/// `positions [T]` its global positions (queries and keys alike).
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: &Tensor,
    cached: bool,
    params: impl Fn(Tensor, Tensor) -> AttentionParams,
    ring: &Arc<dyn KvRing>,
) -> Result<Tensor, String> {
    let cp = ring.size();
    if cached {
        return Err(format!(
            "attention: a KV cache (generation) does not run under context parallelism (parallelism.cp = {cp}); set parallelism.cp = 1"
        ));
    }
    if positions.rank() != 1 {
        return Err(format!(
            "attention: per-row positions {:?} do not run under context parallelism (parallelism.cp = {cp}); give positions [T]",
            positions.shape()
        ));
    }
    anneal_engine::ops::ring_attention(
        q,
        k,
        v,
        &params(positions.clone(), positions.clone()),
        ring.clone(),
    )
    .map_err(|e| e.to_string())
}
