//! The dropless mixture-of-experts feed-forward layer and its two data movements:
//!
//! ```text
//! routing  = route(x · W_router)                       top-k experts and weights per token
//! x_sorted = dispatch(x)                               token rows in expert order (stable)
//! h        = swiglu(x_sorted ·ₑ W_gate, x_sorted ·ₑ W_up)   grouped products, no padding
//! y_sorted = h ·ₑ W_down
//! out      = combine(y_sorted, weights) [+ shared(x)]  weighted sum back in token order
//! ```
//! (`·ₑ` is [`Tensor::grouped_matmul`]: each expert's contiguous rows times its own weight.)
//! Every token reaches all its k experts (no capacity, nothing dropped), and each step sums
//! in a fixed order, so results are bitwise identical for any thread count. Optional
//! per-expert biases on the three products and GPT-OSS's clamped activation make the same
//! function serve GPT-OSS.
//!
//! Under tensor parallelism ([`moe_ffn_tp`], Megatron's expert tensor parallelism without
//! expert parallelism) every rank holds each expert's slice of `F`: gate and up split by their
//! outputs, down by its inputs. The router stays whole and routes the whole batch on every
//! rank with the same bits (so the counts, the balancing loss and an aux-loss-free bias see
//! the whole batch's statistics everywhere); the experts' products give partial sums that are
//! combined with the routing weights and then summed over the group once, `[tokens, D]`:
//!
//! ```text
//! x_all   = tp_copy(x)         (SP: tp_gather(x) along the sequence)
//! logits  = x · W_router       (SP: this rank's tokens, then tp_gather_replicated)
//! weights = tp_copy(weights)   the partial outputs give partial weight gradients: summed
//! out     = tp_reduce(combine(experts_local(x_all), weights))   (SP: tp_scatter)
//! ```
//! The router reads `x` rather than `x_all`: its gradient is whole on every rank, and
//! `tp_copy`'s backward sums only the experts' partial ones.
//!
//! With an expert group as well ([`moe_ffn_tp_ep`]) `experts_local` sends the rows of `x_all`
//! to their experts' ranks ([`super::moe_ep`]), each rank of the expert group holding its
//! experts' slices of the same tensor-parallel coordinate; nothing else changes.

use super::be;
use super::moe::{sort_by_expert, ExpertCounts, ExpertRouting};
use super::moe_balance::{load_balancing_loss, RouterStats};
use super::moe_ep::{run_experts, ExpertParallel};
use super::moe_router::{route, RouterSpec};
use super::tp::{
    tp_copy, tp_gather, tp_gather_replicated, tp_reduce, tp_scatter, TensorParallelGroup,
};
use crate::autograd::record;
use crate::cpu::float_out;
use crate::error::{invalid, Error, Result};
use crate::{DType, Tensor};

impl Tensor {
    /// The token rows of `self [N, D]` in expert order: row `s` is `self[routing.token[s]]`,
    /// `[N·k, D]`. The gradient sums each token's k rows back (in choice order).
    pub fn moe_dispatch(&self, routing: &ExpertRouting) -> Result<Tensor> {
        const OP: &str = "moe_dispatch";
        let slots = routing.token.numel();
        let n = self.shape().first().copied().unwrap_or(0);
        // A routing made for another batch would index past x: caught here by its size (and,
        // when its indices are on the host, by the backend's checks), never read out of bounds.
        if self.rank() != 2 || (slots > 0 && (n == 0 || !slots.is_multiple_of(n))) {
            return Err(invalid(
                OP,
                format!(
                    "x must be [tokens, hidden] for the routing's tokens ({slots} routed \
                     slots), got shape {:?}",
                    self.shape()
                ),
            ));
        }
        let dtype = float_out(self.dtype());
        let out = be(self)?.moe_dispatch(&self.detach(), &routing.token, dtype)?;
        Ok(record(OP, out, &[self], || {
            let k = slots / n.max(1);
            let inverse = routing.inverse.clone();
            move |g: &Tensor| {
                let dx = be(g)?.moe_dispatch_backward(g, &inverse, k, g.dtype())?;
                Ok(vec![Some(dx)])
            }
        }))
    }

    /// The weighted combine of expert outputs `self [N·k, D]` (expert order, as from
    /// [`Tensor::moe_dispatch`]) back into token order: `out[t] = Σ_j weights[t, j] ·
    /// self[routing.inverse[t·k + j]]`, `[N, D]`. Gradients flow to the outputs and weights.
    pub fn moe_combine(&self, weights: &Tensor, routing: &ExpertRouting) -> Result<Tensor> {
        const OP: &str = "moe_combine";
        let slots = routing.inverse.numel();
        if self.rank() != 2
            || weights.rank() != 2
            || weights.numel() != slots
            || self.shape()[0] != slots
        {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.shape().to_vec(),
                rhs: weights.shape().to_vec(),
            });
        }
        let dtype = float_out(self.dtype());
        let out =
            be(self)?.moe_combine(&self.detach(), &weights.detach(), &routing.inverse, dtype)?;
        Ok(record(OP, out, &[self, weights], || {
            let (y, w) = (self.detach(), weights.detach());
            let need = (self.requires_grad(), weights.requires_grad());
            let dtypes = (y.dtype(), float_out(w.dtype()));
            let (order, inverse) = (routing.order.clone(), routing.inverse.clone());
            move |g: &Tensor| {
                let (dy, dw) =
                    be(g)?.moe_combine_backward(&y, &w, g, &order, &inverse, need, dtypes)?;
                Ok(vec![dy, dw])
            }
        }))
    }
}

/// A dense SwiGLU feed-forward every token goes through next to the routed experts
/// (DeepSeek's and Qwen2-MoE's shared experts): `swiglu(x·gate, x·up)·down`.
#[derive(Clone, Copy, Debug)]
pub struct SharedExpert<'a> {
    /// `[D, F_shared]` (`[F_shared, D]` in [`ExpertLayout::OutIn`]).
    pub gate: &'a Tensor,
    /// Shaped like `gate`.
    pub up: &'a Tensor,
    /// `[F_shared, D]` (`[D, F_shared]` in [`ExpertLayout::OutIn`]).
    pub down: &'a Tensor,
}

/// How a layer's matrices are stored; shapes below are for [`ExpertLayout::InOut`], and
/// `OutIn` swaps the last two dims of every matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertLayout {
    /// `[.., in, out]`, multiplied as `x · W` (GPT-OSS's expert tensors).
    InOut,
    /// `[.., out, in]`, stacked `Linear` weights multiplied as `x · Wᵀ` without a transposed
    /// copy (Mixtral's and Qwen-MoE's experts in transformers 5, every router).
    OutIn,
}

/// The parameters of one MoE feed-forward layer with `E` experts, hidden size `D` and expert
/// width `F`, stored as `layout` says. Start from [`MoeWeights::new`] and set the optional
/// parts.
#[derive(Clone, Copy, Debug)]
pub struct MoeWeights<'a> {
    /// `[D, E]`: the router's logits are `x · router (+ router_bias)`, computed in f32.
    pub router: &'a Tensor,
    /// `[E]`: the router's trained logit bias (GPT-OSS).
    pub router_bias: Option<&'a Tensor>,
    /// `[E]`, not trained: the aux-loss-free balancing bias (steers the choice only).
    pub balance_bias: Option<&'a Tensor>,
    /// `[E, D, F]`.
    pub gate: &'a Tensor,
    /// `[E, D, F]`.
    pub up: &'a Tensor,
    /// `[E, F, D]`.
    pub down: &'a Tensor,
    /// `[E, F]`, `[E, F]`, `[E, D]`: per-expert biases of the three products (GPT-OSS).
    pub gate_bias: Option<&'a Tensor>,
    /// See `gate_bias`.
    pub up_bias: Option<&'a Tensor>,
    /// See `gate_bias`.
    pub down_bias: Option<&'a Tensor>,
    /// Shared experts added to every token's output.
    pub shared: Option<SharedExpert<'a>>,
    /// How the matrices (router, experts, shared experts) are stored.
    pub layout: ExpertLayout,
}

impl<'a> MoeWeights<'a> {
    /// The router and expert matrices in [`ExpertLayout::InOut`], with no biases and no shared
    /// expert.
    pub fn new(router: &'a Tensor, gate: &'a Tensor, up: &'a Tensor, down: &'a Tensor) -> Self {
        MoeWeights {
            router,
            router_bias: None,
            balance_bias: None,
            gate,
            up,
            down,
            gate_bias: None,
            up_bias: None,
            down_bias: None,
            shared: None,
            layout: ExpertLayout::InOut,
        }
    }
}

/// The experts' gated activation of `(gate, up)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertActivation {
    /// `silu(gate) · up` (Llama, Mixtral, Qwen-MoE, DeepSeek).
    SwiGlu,
    /// GPT-OSS's clamped variant: `gate' = min(gate, limit)`, `up' = clamp(up, ±limit)`,
    /// `(up' + 1) · gate' · sigmoid(alpha · gate')` (alpha 1.702, limit 7 in gpt-oss).
    ClampedSwiGlu {
        /// Slope inside the sigmoid.
        alpha: f32,
        /// Clamp bound.
        limit: f32,
    },
}

impl ExpertActivation {
    fn apply(self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        match self {
            ExpertActivation::SwiGlu => gate.swiglu(up),
            ExpertActivation::ClampedSwiGlu { alpha, limit } => {
                let g = gate.clamp(f32::NEG_INFINITY, limit)?;
                let u = up.clamp(-limit, limit)?;
                let glu = g.mul(&g.mul_scalar(alpha)?.sigmoid()?)?;
                u.add_scalar(1.0)?.mul(&glu)
            }
        }
    }
}

/// What one MoE layer computes besides its weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeSpec {
    /// The router.
    pub router: RouterSpec,
    /// Coefficient of the auxiliary load-balancing loss; 0 computes none.
    pub aux_loss_coef: f32,
    /// The experts' activation.
    pub activation: ExpertActivation,
}

impl MoeSpec {
    /// SwiGLU experts behind `router`, without auxiliary loss.
    pub fn new(router: RouterSpec) -> MoeSpec {
        MoeSpec {
            router,
            aux_loss_coef: 0.0,
            activation: ExpertActivation::SwiGlu,
        }
    }
}

/// The result of [`moe_ffn`].
#[derive(Clone, Debug)]
pub struct MoeOutput {
    /// The layer's output, shaped like its input.
    pub out: Tensor,
    /// `aux_loss_coef · load_balancing_loss`, a differentiable scalar to add to the training
    /// loss, when the coefficient is not 0.
    pub aux_loss: Option<Tensor>,
    /// `[E]` i64: tokens routed to each expert in this pass (feed [`super::ExpertLoad::add`]),
    /// on the layer's device.
    pub counts: Tensor,
    /// Router statistics of this pass.
    pub stats: RouterStats,
}

/// Fails unless `t` has `want` as its shape, naming the weight.
fn expect_shape(name: &str, t: &Tensor, want: &[usize]) -> Result<()> {
    if t.shape() == want {
        Ok(())
    } else {
        Err(invalid(
            "moe_ffn",
            format!("{name} must have shape {want:?}, got {:?}", t.shape()),
        ))
    }
}

/// The dropless MoE feed-forward layer (see the module docs) for `x [.., D]`.
pub fn moe_ffn(x: &Tensor, w: &MoeWeights<'_>, spec: &MoeSpec) -> Result<MoeOutput> {
    moe_ffn_ep(x, w, spec, None)
}

/// [`moe_ffn`] with the experts split over an expert group when `ep` is given: the expert
/// weights (and per-expert biases) are this rank's `E / ranks` experts, routing and combine
/// stay on this rank's tokens, and the rows travel to their experts' ranks and back
/// ([`super::moe_ep`]). Router statistics and the auxiliary loss are this rank's tokens', as
/// in data parallelism.
pub fn moe_ffn_ep(
    x: &Tensor,
    w: &MoeWeights<'_>,
    spec: &MoeSpec,
    ep: Option<&ExpertParallel>,
) -> Result<MoeOutput> {
    moe_ffn_in(x, w, spec, ep, None)
}

/// How [`moe_ffn_tp`] runs over a tensor-parallel group.
#[derive(Clone, Debug)]
pub struct MoeTensorParallel {
    /// The group: every rank holds slice `rank` of each expert's `F` (and of the shared
    /// experts' width).
    pub group: TensorParallelGroup,
    /// Sequence parallelism: the input and output hold this rank's share of this dim (the
    /// sequence of `[batch, seq, D]`), gathered before the experts and scattered after.
    pub sequence_dim: Option<usize>,
}

/// [`moe_ffn`] over a tensor-parallel group (see the module docs): `w.gate` / `w.up` are this
/// rank's `[E, F / ranks, ..]` column slices and `w.down` its row slice (likewise the shared
/// experts'), the router is whole. The output, the statistics and the auxiliary loss are the
/// whole batch's, the same bits on every rank. Per-expert biases are not split (refused).
pub fn moe_ffn_tp(
    x: &Tensor,
    w: &MoeWeights<'_>,
    spec: &MoeSpec,
    tp: &MoeTensorParallel,
) -> Result<MoeOutput> {
    moe_ffn_tp_ep(x, w, spec, tp, None)
}

/// [`moe_ffn_tp`] with the experts also split over an expert group when `ep` is given
/// (expert tensor parallelism beside expert parallelism): the stacks are this rank's
/// `E / ep` experts, each cut to this rank's `F / tp` slice. Every rank of a tensor-parallel
/// group routes the same tokens (the gathered sequence under SP) and sends the same rows to
/// the rank of its expert group that holds the rows' experts; that rank shares its
/// tensor-parallel coordinate (`anneal_dist::Mesh::expert_comms`), so the rows come back as
/// the partial sums of that width slice and are combined and summed over the tensor-parallel
/// group once, as without `ep`. The backward's exchanges carry the partial input gradients,
/// which the input's `tp_copy` (`tp_gather`) then sums. Routing, statistics and the
/// auxiliary loss are the tokens' of the tensor-parallel group, the same bits on its ranks.
pub fn moe_ffn_tp_ep(
    x: &Tensor,
    w: &MoeWeights<'_>,
    spec: &MoeSpec,
    tp: &MoeTensorParallel,
    ep: Option<&ExpertParallel>,
) -> Result<MoeOutput> {
    if w.gate_bias.is_some() || w.up_bias.is_some() || w.down_bias.is_some() {
        return Err(invalid(
            "moe_ffn",
            "per-expert biases are not split under tensor parallelism yet",
        ));
    }
    moe_ffn_in(x, w, spec, ep, Some(tp))
}

fn moe_ffn_in(
    x: &Tensor,
    w: &MoeWeights<'_>,
    spec: &MoeSpec,
    ep: Option<&ExpertParallel>,
    tp: Option<&MoeTensorParallel>,
) -> Result<MoeOutput> {
    spec.router.validate()?;
    let d = *x
        .shape()
        .last()
        .ok_or_else(|| invalid("moe_ffn", "x is a scalar"))?;
    let e = spec.router.num_experts;
    // The experts this rank holds.
    let el = match ep {
        Some(p) if p.exchange.ranks() == 0 || !e.is_multiple_of(p.exchange.ranks()) => {
            return Err(invalid(
                "moe_ffn",
                format!(
                    "{e} experts do not split evenly over {} expert-parallel ranks",
                    p.exchange.ranks()
                ),
            ))
        }
        Some(p) => e / p.exchange.ranks(),
        None => e,
    };
    let out_in = w.layout == ExpertLayout::OutIn;
    // `[.., a, b]` as stored: swapped in the out-in layout.
    let stored = |lead: &[usize], a: usize, b: usize| -> Vec<usize> {
        let mut v = lead.to_vec();
        v.extend(if out_in { [b, a] } else { [a, b] });
        v
    };
    let f = w
        .gate
        .shape()
        .get(if out_in { 1 } else { 2 })
        .copied()
        .unwrap_or(0);
    expect_shape("router", w.router, &stored(&[], d, e))?;
    expect_shape("gate", w.gate, &stored(&[el], d, f))?;
    expect_shape("up", w.up, &stored(&[el], d, f))?;
    expect_shape("down", w.down, &stored(&[el], f, d))?;
    // A 2-d matrix for `x · W`: a transposed view in the out-in layout.
    let as_in_out = |m: &Tensor| {
        if out_in {
            m.transpose(0, 1)
        } else {
            Ok(m.clone())
        }
    };
    if let Some(s) = &w.shared {
        let fs = s
            .gate
            .shape()
            .get(usize::from(!out_in))
            .copied()
            .unwrap_or(0);
        expect_shape("shared gate", s.gate, &stored(&[], d, fs))?;
        expect_shape("shared up", s.up, &stored(&[], d, fs))?;
        expect_shape("shared down", s.down, &stored(&[], fs, d))?;
    }
    for (name, b, want) in [
        ("router_bias", w.router_bias, vec![e]),
        ("balance_bias", w.balance_bias, vec![e]),
        ("gate_bias", w.gate_bias, vec![el, f]),
        ("up_bias", w.up_bias, vec![el, f]),
        ("down_bias", w.down_bias, vec![el, d]),
    ] {
        if let Some(b) = b {
            expect_shape(name, b, &want)?;
        }
    }
    // The tokens the experts read: under tensor parallelism every rank's whole batch (the
    // input's gradient then summed over the group), gathered along the sequence under SP.
    let sequence = tp.and_then(|t| t.sequence_dim);
    let x_all = match (tp, sequence) {
        (None, _) => x.clone(),
        (Some(t), None) => tp_copy(x, &t.group),
        (Some(t), Some(dim)) => tp_gather(x, dim, &t.group)?,
    };
    let n = x_all.numel() / d.max(1);
    let x2 = x_all.reshape(&[n, d])?;
    // `a [rows, in] · m [in, out]` as one batched product, the path on which batch-invariant
    // mode makes a token's row independent of the other tokens (a decode step equals the
    // forward).
    let linear = |a: &Tensor, m: &Tensor| -> Result<Tensor> {
        let (rows, out) = (a.shape()[0], m.shape()[1]);
        a.reshape(&[1, rows, a.shape()[1]])?
            .matmul(m)?
            .reshape(&[rows, out])
    };
    let router = as_in_out(w.router)?;
    // The router reads `x` itself (this rank's tokens under SP): its gradient is whole, not a
    // partial sum for `tp_copy` / `tp_gather` to add up.
    let xr = x.reshape(&[x.numel() / d.max(1), d])?;
    // The router stays in f32 even inside an autocast region: expert choice is sensitive to
    // rounding of the logits (the gate is computed in f32, as in Megatron and TorchTitan).
    let no_autocast = crate::autocast::set_autocast(None);
    let mut logits = if xr.dtype() == DType::F32 && router.dtype() == DType::F32 {
        linear(&xr, &router)?
    } else {
        linear(&xr.to_dtype(DType::F32)?, &router.to_dtype(DType::F32)?)?
    };
    if let (Some(t), Some(dim)) = (tp, sequence) {
        // Every rank routes the whole batch, with the same bits.
        let mut local = x.shape().to_vec();
        *local.last_mut().expect("x has a hidden dim") = e;
        logits = tp_gather_replicated(&logits.reshape(&local)?, dim, &t.group)?.reshape(&[n, e])?;
    }
    if let Some(b) = w.router_bias {
        logits = logits.add(&b.to_dtype(DType::F32)?)?;
    }
    let r = route(&logits, w.balance_bias, &spec.router)?;
    drop(no_autocast);
    let routing = sort_by_expert(&r.experts, e)?;
    let biased = w.gate_bias.is_some() || w.up_bias.is_some() || w.down_bias.is_some();
    // The experts' products over rows grouped by expert (`counts` rows each, of the experts
    // this rank holds); `rows` is the expert of each sorted row, for the per-expert biases.
    let experts = |xs: &Tensor, counts: &Tensor, rows: Option<Tensor>| -> Result<Tensor> {
        let product = |a: &Tensor, m: &Tensor, bias: Option<&Tensor>| -> Result<Tensor> {
            let y = if out_in {
                a.grouped_matmul_nt(m, counts)?
            } else {
                a.grouped_matmul(m, counts)?
            };
            match (bias, &rows) {
                (Some(b), Some(rows)) => y.add(&b.index_select(0, rows)?),
                _ => Ok(y),
            }
        };
        let h = spec.activation.apply(
            &product(xs, w.gate, w.gate_bias)?,
            &product(xs, w.up, w.up_bias)?,
        )?;
        product(&h, w.down, w.down_bias)
    };
    let xs = x2.moe_dispatch(&routing)?;
    let ys = match ep {
        // The exchange needs its sizes on the host: expert parallelism reads the counts.
        Some(p) => run_experts(p, &xs, &routing.host_counts(), &|xs, local| {
            let rows = if biased {
                let ids: Vec<i64> = local
                    .iter()
                    .enumerate()
                    .flat_map(|(ex, &c)| std::iter::repeat_n(ex as i64, c))
                    .collect();
                let len = ids.len();
                Some(Tensor::from_vec(ids, &[len])?.to_device(xs.device())?)
            } else {
                None
            };
            experts(xs, &local.counts_on(xs.device())?, rows)
        })?,
        None => {
            // Each sorted row's expert is its choice, in sorted order: found on the device.
            let rows = if biased {
                let flat = r.experts.reshape(&[r.experts.numel()])?;
                Some(flat.index_select(0, &routing.order)?)
            } else {
                None
            };
            experts(&xs, &routing.counts, rows)?
        }
    };
    // Under TP the experts' outputs are partial sums, and so is the gradient the combine
    // gives the routing weights: `tp_copy` sums it over the group.
    let weights = match tp {
        Some(t) => tp_copy(&r.weights, &t.group),
        None => r.weights.clone(),
    };
    let mut out = ys.moe_combine(&weights, &routing)?;
    if let Some(s) = &w.shared {
        let hs = linear(&x2, &as_in_out(s.gate)?)?.swiglu(&linear(&x2, &as_in_out(s.up)?)?)?;
        out = out.add(&linear(&hs, &as_in_out(s.down)?)?)?;
    }
    // The partial sums added over the group once, `[tokens, D]` (under SP each rank keeps its
    // share of the sequence).
    let out = out.reshape(x_all.shape())?;
    let out = match (tp, sequence) {
        (None, _) => out,
        (Some(t), None) => tp_reduce(&out, &t.group)?,
        (Some(t), Some(dim)) => tp_scatter(&out, dim, &t.group)?,
    };
    let aux_loss = if spec.aux_loss_coef != 0.0 {
        Some(
            load_balancing_loss(&r.scores, &routing.counts, spec.router.score)?
                .mul_scalar(spec.aux_loss_coef)?,
        )
    } else {
        None
    };
    let stats = RouterStats::new(&r.scores, &routing.counts, spec.router.score)?;
    Ok(MoeOutput {
        out,
        aux_loss,
        counts: routing.counts,
        stats,
    })
}
