//! Mixture-of-experts host ops on the plugin [`Tensor`]: the whole dropless MoE layer
//! ([`Tensor::moe_ffn`]) and its parts (router, dispatch, grouped products, combine), each one
//! host op computed by the engine, forward and backward.

use super::{Ctx, Error, Host, Param, Result, Tensor};
use crate::ops::{self, OpAttrs};

/// How router logits become per-expert scores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RouterScore {
    /// A softmax over the experts (Mixtral, Qwen3-MoE, GPT-OSS).
    #[default]
    Softmax,
    /// An independent sigmoid per expert (DeepSeek-V3).
    Sigmoid,
}

impl RouterScore {
    fn name(self) -> String {
        match self {
            RouterScore::Softmax => "softmax".into(),
            RouterScore::Sigmoid => "sigmoid".into(),
        }
    }
}

/// A top-k router: `weights = score[topk(score + bias)]`, optionally renormalised, times
/// `route_scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Router {
    /// Experts in the layer.
    pub num_experts: usize,
    /// Experts each token is sent to.
    pub top_k: usize,
    /// Softmax or sigmoid scores.
    pub score: RouterScore,
    /// Divide the chosen weights by their sum (Qwen3-MoE's `norm_topk_prob`, Mixtral).
    pub renormalize: bool,
    /// Factor on the final weights, 1 for none.
    pub route_scale: f64,
    /// Group-limited routing `(n_group, topk_group)` (DeepSeek-V3): a token chooses among the
    /// experts of its `topk_group` best groups (a group scores the sum of its best two).
    pub groups: Option<(usize, usize)>,
}

impl Router {
    /// A softmax router over `num_experts` choosing `top_k`, without renormalisation or scale.
    pub fn new(num_experts: usize, top_k: usize) -> Router {
        Router {
            num_experts,
            top_k,
            score: RouterScore::Softmax,
            renormalize: false,
            route_scale: 1.0,
            groups: None,
        }
    }
}

/// The optional parts of a [`Tensor::moe_ffn`] layer; start from [`MoeFfnOpts::new`].
#[derive(Clone)]
pub struct MoeFfnOpts<'a, 'h> {
    /// The router.
    pub router: Router,
    /// Coefficient of the auxiliary load-balancing loss; 0 computes none.
    pub aux_loss_coef: f64,
    /// Matrices stored `[.., out, in]` (stacked `Linear` weights, Hugging Face's layout)
    /// instead of `[.., in, out]`.
    pub out_in: bool,
    /// GPT-OSS's clamped SwiGLU experts, `(alpha, limit)`; plain SwiGLU when `None`.
    pub clamped_swiglu: Option<(f64, f64)>,
    /// `[E]`: the router's trained logit bias (GPT-OSS).
    pub router_bias: Option<&'a Tensor<'h>>,
    /// `[E]`, not trained: the aux-loss-free balancing bias (steers the choice only).
    pub balance_bias: Option<&'a Tensor<'h>>,
    /// `[E, F]`: per-expert bias of the gate product.
    pub gate_bias: Option<&'a Tensor<'h>>,
    /// `[E, F]`: per-expert bias of the up product.
    pub up_bias: Option<&'a Tensor<'h>>,
    /// `[E, D]`: per-expert bias of the down product.
    pub down_bias: Option<&'a Tensor<'h>>,
    /// A shared expert every token goes through: `[gate, up, down]`.
    pub shared: Option<[&'a Tensor<'h>; 3]>,
}

impl<'a, 'h> MoeFfnOpts<'a, 'h> {
    /// `router` with plain SwiGLU experts in the `[in, out]` layout, nothing optional.
    pub fn new(router: Router) -> Self {
        MoeFfnOpts {
            router,
            aux_loss_coef: 0.0,
            out_in: false,
            clamped_swiglu: None,
            router_bias: None,
            balance_bias: None,
            gate_bias: None,
            up_bias: None,
            down_bias: None,
            shared: None,
        }
    }
}

/// What [`Tensor::moe_ffn`] returns; pass `aux_loss` to `ctx.aux_loss` and the statistics to
/// `ctx.stat`.
pub struct MoeFfnOutput<'h> {
    /// The layer's output, shaped like its input.
    pub out: Tensor<'h>,
    /// `[E]` f32: tokens routed to each expert in this pass.
    pub tokens_per_expert: Tensor<'h>,
    /// f32 scalar: max over mean of the tokens per expert (1 is perfectly even).
    pub imbalance: Tensor<'h>,
    /// f32 scalar: mean entropy (nats) of the router's probabilities.
    pub entropy: Tensor<'h>,
    /// `aux_loss_coef ·` the load-balancing loss, differentiable, when the coefficient is not 0.
    pub aux_loss: Option<Tensor<'h>>,
}

/// The statistic that carries MoE layer `layer`'s tokens per expert (summed over a step, which
/// [`Host::update_balance_bias`] reads).
pub fn tokens_per_expert_stat(layer: usize) -> String {
    format!("moe.layer{layer}.tokens_per_expert")
}

impl<'h> MoeFfnOutput<'h> {
    /// Hands layer `layer`'s auxiliary loss and statistics to the host (`moe.layer<i>.` load
    /// imbalance, router entropy and, with a balancing bias, tokens per expert and the bias)
    /// and returns the layer's output.
    pub fn report(
        self,
        ctx: &Ctx<'h>,
        layer: usize,
        balance_bias: Option<&Tensor<'h>>,
    ) -> Result<Tensor<'h>> {
        if let Some(aux) = &self.aux_loss {
            ctx.aux_loss("load_balance", aux)?;
        }
        ctx.stat(&format!("moe.layer{layer}.imbalance"), &self.imbalance)?;
        ctx.stat(&format!("moe.layer{layer}.entropy"), &self.entropy)?;
        if let Some(b) = balance_bias {
            ctx.stat(&tokens_per_expert_stat(layer), &self.tokens_per_expert)?;
            ctx.stat(&format!("moe.layer{layer}.balance_bias"), b)?;
        }
        Ok(self.out)
    }
}

impl Host<'_> {
    /// Aux-loss-free balancing (DeepSeek-V3), for a plugin's `before_optimizer_step`: layer
    /// `layer`'s routing bias moves by `rate` towards the experts that got fewer tokens than
    /// the mean over the step and away from those that got more (`sign(mean − tokens)`,
    /// mean-centred so the biases do not drift). Needs the layer's forward to have reported
    /// its tokens per expert ([`MoeFfnOutput::report`] with the bias). A layer that reported no
    /// tokens this step keeps its bias: the host ran it elsewhere (another pipeline stage holds
    /// the layer, its bias and its statistics, and updates it there) or not at all.
    pub fn update_balance_bias(&self, layer: usize, bias: &Param, rate: f64) -> Result<()> {
        let Ok(tokens) = self.param(&format!("stats.{}", tokens_per_expert_stat(layer))) else {
            return Ok(());
        };
        let below = tokens.mean(&[0], true)?.sub(&tokens)?;
        // tanh of a large multiple is sign(): counts differ by whole tokens or not at all.
        let step = below.scale(1e6)?.unary("tanh")?.scale(rate)?;
        let centred = step.sub(&step.mean(&[0], true)?)?;
        let b = self.param(bias.name())?;
        b.assign(&b.add(&centred)?)
    }
}

impl<'h> Tensor<'h> {
    /// The dropless MoE feed-forward layer on `self [.., D]`: route, dispatch, grouped SwiGLU
    /// experts, weighted combine, shared experts. `router [D, E]`, `gate`/`up` `[E, D, F]`,
    /// `down [E, F, D]` (last two dims swapped when `opts.out_in`).
    pub fn moe_ffn(
        &self,
        router: &Tensor<'h>,
        gate: &Tensor<'h>,
        up: &Tensor<'h>,
        down: &Tensor<'h>,
        opts: &MoeFfnOpts<'_, 'h>,
    ) -> Result<MoeFfnOutput<'h>> {
        let h = |t: Option<&Tensor<'h>>| t.map(Tensor::raw);
        let r = &opts.router;
        let attrs = ops::MoeFfn {
            num_experts: r.num_experts as i64,
            top_k: r.top_k as i64,
            score: r.score.name(),
            renormalize: r.renormalize,
            route_scale: r.route_scale,
            aux_loss_coef: opts.aux_loss_coef,
            out_in: opts.out_in,
            clamp_alpha: opts.clamped_swiglu.map(|c| c.0),
            clamp_limit: opts.clamped_swiglu.map(|c| c.1),
            router_bias: h(opts.router_bias),
            balance_bias: h(opts.balance_bias),
            gate_bias: h(opts.gate_bias),
            up_bias: h(opts.up_bias),
            down_bias: h(opts.down_bias),
            shared_gate: h(opts.shared.map(|s| s[0])),
            shared_up: h(opts.shared.map(|s| s[1])),
            shared_down: h(opts.shared.map(|s| s[2])),
            n_group: r.groups.map(|g| g.0 as i64),
            topk_group: r.groups.map(|g| g.1 as i64),
        };
        let v = self
            .host()
            .call_op(&attrs, &[self, router, gate, up, down])?;
        // The host decides whether the coefficient is 0 (in its own precision): 5 outputs
        // with a loss, 4 without.
        if !(4..=5).contains(&v.len()) {
            return Err(Error::internal(format!(
                "host op moe_ffn returned {} outputs, expected 4 or 5",
                v.len()
            )));
        }
        let mut v = v.into_iter();
        let mut next = || {
            v.next()
                .ok_or_else(|| Error::internal("moe_ffn: missing output"))
        };
        Ok(MoeFfnOutput {
            out: next()?,
            tokens_per_expert: next()?,
            imbalance: next()?,
            entropy: next()?,
            aux_loss: next().ok(),
        })
    }

    /// The router on `self = logits [N, E]`, with an optional `[E]` balancing bias that steers
    /// the choice only: (weights `[N, k]` f32, experts `[N, k]` i64, scores `[N, E]` f32).
    pub fn moe_route(
        &self,
        bias: Option<&Tensor<'h>>,
        router: &Router,
    ) -> Result<(Tensor<'h>, Tensor<'h>, Tensor<'h>)> {
        let attrs = ops::MoeRoute {
            num_experts: router.num_experts as i64,
            top_k: router.top_k as i64,
            score: router.score.name(),
            renormalize: router.renormalize,
            route_scale: router.route_scale,
            n_group: router.groups.map(|g| g.0 as i64),
            topk_group: router.groups.map(|g| g.1 as i64),
        };
        let mut inputs = vec![self];
        inputs.extend(bias);
        let [w, e, s]: [Tensor<'h>; 3] =
            self.host()
                .call_op(&attrs, &inputs)?
                .try_into()
                .map_err(|_| {
                    Error::internal("host op moe_route returned the wrong number of outputs")
                })?;
        Ok((w, e, s))
    }

    /// The token rows of `self [N, D]` in expert order for the choices `experts [N, k]`:
    /// `[N·k, D]`, ready for [`Tensor::grouped_matmul`] with the per-expert counts.
    pub fn moe_dispatch(&self, experts: &Tensor<'h>, num_experts: usize) -> Result<Tensor<'h>> {
        let attrs = ops::MoeDispatch {
            num_experts: num_experts as i64,
        };
        self.host()
            .call1(ops::MoeDispatch::OP, &[self, experts], &attrs.to_attrs())
    }

    /// Expert outputs `self [N·k, D]` (expert order, as from [`Tensor::moe_dispatch`]) summed
    /// back into token order with `weights [N, k]`: `[N, D]`.
    pub fn moe_combine(
        &self,
        weights: &Tensor<'h>,
        experts: &Tensor<'h>,
        num_experts: usize,
    ) -> Result<Tensor<'h>> {
        let attrs = ops::MoeCombine {
            num_experts: num_experts as i64,
        };
        self.host().call1(
            ops::MoeCombine::OP,
            &[self, weights, experts],
            &attrs.to_attrs(),
        )
    }

    /// [`Tensor::grouped_matmul`] with each expert's weight stored `[out, in]` (`w [E, M, K]`).
    pub fn grouped_matmul_nt(&self, w: &Tensor<'h>, counts: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.host()
            .call1(ops::GroupedMatmulNt::OP, &[self, w, counts], &[])
    }
}
