//! The mixture-of-experts host ops (`moe_route`, `moe_dispatch`, `moe_combine`, `moe_ffn`,
//! `grouped_matmul_nt`): each maps its typed attributes (`anneal_plugin_api::ops`) onto the
//! engine op of the same name, so a plugin's MoE layer computes exactly what the engine does.
//! `moe_ffn` runs its experts over the session's expert group when the trainer installed one
//! (expert parallelism), or as this rank's slices of them over the tensor-parallel group
//! (`ops_tp.rs`), which the plugin never sees.

use super::host::HostSession;
use anneal_engine::ops::{
    self as eo, ExpertActivation, ExpertLayout, MoeSpec, MoeWeights, RouterScore, RouterSpec,
    SharedExpert,
};
use anneal_engine::Tensor;
use anneal_plugin_api::abi::Handle;
use anneal_plugin_api::ops as o;

type R<T> = Result<T, String>;

fn e(err: anneal_engine::Error) -> String {
    err.to_string()
}

fn arg<'a>(inputs: &'a [Tensor], i: usize, op: &str) -> R<&'a Tensor> {
    inputs.get(i).ok_or_else(|| format!("{op} needs input {i}"))
}

/// A count attribute, refused when negative (it comes from a plugin).
fn count(op: &str, name: &str, v: i64) -> R<usize> {
    usize::try_from(v).map_err(|_| format!("{op}: {name} = {v} must not be negative"))
}

/// The router spec from the attributes both routing ops share.
fn router_spec(
    op: &str,
    num_experts: i64,
    top_k: i64,
    score: &str,
    renormalize: bool,
    route_scale: f64,
    groups: (Option<i64>, Option<i64>),
) -> R<RouterSpec> {
    let score = match score {
        "softmax" => RouterScore::Softmax,
        "sigmoid" => RouterScore::Sigmoid,
        other => {
            return Err(format!(
                "{op}: score must be 'softmax' or 'sigmoid', got '{other}'"
            ))
        }
    };
    Ok(RouterSpec {
        num_experts: count(op, "num_experts", num_experts)?,
        top_k: count(op, "top_k", top_k)?,
        score,
        renormalize,
        route_scale: route_scale as f32,
        groups: match groups {
            (Some(n), Some(k)) => Some((count(op, "n_group", n)?, count(op, "topk_group", k)?)),
            (None, None) => None,
            _ => {
                return Err(format!(
                    "{op}: group-limited routing needs n_group and topk_group"
                ))
            }
        },
    })
}

/// `moe_route(logits [, bias])` → (weights, experts, scores).
pub(crate) fn route(inputs: &[Tensor], a: o::MoeRoute) -> R<Vec<Tensor>> {
    let op = o::MoeRoute::OP;
    let spec = router_spec(
        op,
        a.num_experts,
        a.top_k,
        &a.score,
        a.renormalize,
        a.route_scale,
        (a.n_group, a.topk_group),
    )?;
    let r = eo::route(arg(inputs, 0, op)?, inputs.get(1), &spec).map_err(e)?;
    Ok(vec![r.weights, r.experts, r.scores])
}

/// `moe_dispatch(x, experts)` → token rows in expert order.
pub(crate) fn dispatch(inputs: &[Tensor], a: o::MoeDispatch) -> R<Vec<Tensor>> {
    let op = o::MoeDispatch::OP;
    let n = count(op, "num_experts", a.num_experts)?;
    let routing = eo::sort_by_expert(arg(inputs, 1, op)?, n).map_err(e)?;
    Ok(vec![arg(inputs, 0, op)?
        .moe_dispatch(&routing)
        .map_err(e)?])
}

/// `moe_combine(y, weights, experts)` → the weighted sum back in token order.
pub(crate) fn combine(inputs: &[Tensor], a: o::MoeCombine) -> R<Vec<Tensor>> {
    let op = o::MoeCombine::OP;
    let n = count(op, "num_experts", a.num_experts)?;
    let routing = eo::sort_by_expert(arg(inputs, 2, op)?, n).map_err(e)?;
    Ok(vec![arg(inputs, 0, op)?
        .moe_combine(arg(inputs, 1, op)?, &routing)
        .map_err(e)?])
}

/// `moe_ffn(x, router, gate, up, down)` → (out, tokens per expert, imbalance, entropy
/// [, aux loss]).
pub(crate) fn ffn(inputs: &[Tensor], a: o::MoeFfn, session: &HostSession) -> R<Vec<Tensor>> {
    let op = o::MoeFfn::OP;
    let get = |h: Option<Handle>| h.map(|h| session.get(h)).transpose();
    let (router_bias, balance_bias) = (get(a.router_bias)?, get(a.balance_bias)?);
    let (gate_bias, up_bias, down_bias) = (get(a.gate_bias)?, get(a.up_bias)?, get(a.down_bias)?);
    let shared = match (get(a.shared_gate)?, get(a.shared_up)?, get(a.shared_down)?) {
        (Some(g), Some(u), Some(d)) => Some((g, u, d)),
        (None, None, None) => None,
        _ => return Err(format!("{op}: a shared expert needs gate, up and down")),
    };
    let activation = match (a.clamp_alpha, a.clamp_limit) {
        (None, None) => ExpertActivation::SwiGlu,
        (Some(alpha), Some(limit)) => ExpertActivation::ClampedSwiGlu {
            alpha: alpha as f32,
            limit: limit as f32,
        },
        _ => return Err(format!("{op}: clamped SwiGLU needs both alpha and limit")),
    };
    let spec = MoeSpec {
        router: router_spec(
            op,
            a.num_experts,
            a.top_k,
            &a.score,
            a.renormalize,
            a.route_scale,
            (a.n_group, a.topk_group),
        )?,
        aux_loss_coef: a.aux_loss_coef as f32,
        activation,
    };
    let w = MoeWeights {
        router_bias: router_bias.as_ref(),
        balance_bias: balance_bias.as_ref(),
        gate_bias: gate_bias.as_ref(),
        up_bias: up_bias.as_ref(),
        down_bias: down_bias.as_ref(),
        shared: shared
            .as_ref()
            .map(|(gate, up, down)| SharedExpert { gate, up, down }),
        layout: if a.out_in {
            ExpertLayout::OutIn
        } else {
            ExpertLayout::InOut
        },
        ..MoeWeights::new(
            arg(inputs, 1, op)?,
            arg(inputs, 2, op)?,
            arg(inputs, 3, op)?,
            arg(inputs, 4, op)?,
        )
    };
    let tp = match session.tp() {
        Some(tp) => tp.moe(
            w.router,
            [w.gate, w.up, w.down],
            w.shared.map(|s| [s.gate, s.up, s.down]),
        )?,
        None => None,
    };
    let x = arg(inputs, 0, op)?;
    // Under both, each rank holds its expert slice's share of every expert's width.
    let out = match (tp, session.experts()) {
        (Some(tp), ep) => eo::moe_ffn_tp_ep(x, &w, &spec, &tp, ep),
        (None, ep) => eo::moe_ffn_ep(x, &w, &spec, ep),
    }
    .map_err(e)?;
    // The statistics are tensors where the layer's output lives, computed there.
    let s = out.stats;
    let mut v = vec![out.out, s.tokens_per_expert, s.imbalance, s.entropy];
    v.extend(out.aux_loss);
    Ok(v)
}

/// `grouped_matmul_nt(x, w, counts)`.
pub(crate) fn grouped_matmul_nt(inputs: &[Tensor]) -> R<Vec<Tensor>> {
    let op = o::GroupedMatmulNt::OP;
    let y = arg(inputs, 0, op)?
        .grouped_matmul_nt(arg(inputs, 1, op)?, arg(inputs, 2, op)?)
        .map_err(e)?;
    Ok(vec![y])
}
