//! The MoE router: scores from router logits, top-k expert choice, and the weights the chosen
//! experts' outputs are combined with.
//!
//! ```text
//! scores  = softmax(logits) | sigmoid(logits)            (f32, whatever the logits' dtype)
//! experts = topk(scores + bias, k)                       (bias steers the choice only)
//! weights = scores[experts]  (/ Σ weights if renormalize) · route_scale
//! ```
//! The bias of aux-loss-free balancing (DeepSeek-V3) changes which experts are picked but never
//! the weights, so it gets no gradient; the weights are differentiable through the scores.

use crate::error::{invalid, Error, Result};
use crate::{DType, Tensor};

/// How router logits become per-expert scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterScore {
    /// A softmax over the experts (Mixtral, Qwen3-MoE, GPT-OSS).
    Softmax,
    /// An independent sigmoid per expert (DeepSeek-V3).
    Sigmoid,
}

/// What a router computes; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterSpec {
    /// Experts in the layer.
    pub num_experts: usize,
    /// Experts each token is sent to.
    pub top_k: usize,
    /// Softmax or sigmoid scores.
    pub score: RouterScore,
    /// Divide the chosen weights by their sum (Qwen3-MoE's `norm_topk_prob`, Mixtral).
    pub renormalize: bool,
    /// Factor on the final weights (DeepSeek-V3's `routed_scaling_factor`), 1 for none.
    pub route_scale: f32,
}

impl RouterSpec {
    /// A softmax router over `num_experts` choosing `top_k`, without renormalisation or scale.
    pub fn new(num_experts: usize, top_k: usize) -> RouterSpec {
        RouterSpec {
            num_experts,
            top_k,
            score: RouterScore::Softmax,
            renormalize: false,
            route_scale: 1.0,
        }
    }

    /// Fails unless `1 <= top_k <= num_experts` and the scale is finite.
    pub fn validate(&self) -> Result<()> {
        if self.top_k == 0 || self.top_k > self.num_experts {
            return Err(invalid(
                "moe_router",
                format!(
                    "top_k = {} experts per token must be between 1 and num_experts = {}",
                    self.top_k, self.num_experts
                ),
            ));
        }
        if !self.route_scale.is_finite() {
            return Err(invalid(
                "moe_router",
                format!("route_scale = {} is not finite", self.route_scale),
            ));
        }
        Ok(())
    }
}

/// A router's decision for `N` tokens.
#[derive(Clone, Debug)]
pub struct Routing {
    /// `[N, k]` f32: the weight of each chosen expert (differentiable).
    pub weights: Tensor,
    /// `[N, k]` i64: the chosen experts, best (by `score + bias`) first.
    pub experts: Tensor,
    /// `[N, E]` f32: every expert's score (differentiable), for the auxiliary loss and
    /// statistics.
    pub scores: Tensor,
}

/// Routes tokens from `logits [N, E]` (any float dtype; scores are computed in f32). `bias`
/// (`[E]`, not trained) is added to the scores for the top-k choice only.
pub fn route(logits: &Tensor, bias: Option<&Tensor>, spec: &RouterSpec) -> Result<Routing> {
    spec.validate()?;
    let e = spec.num_experts;
    if logits.rank() != 2 || logits.shape()[1] != e {
        return Err(invalid(
            "moe_router",
            format!(
                "logits must be [tokens, num_experts = {e}], got shape {:?}",
                logits.shape()
            ),
        ));
    }
    if let Some(b) = bias {
        if b.shape() != [e] {
            return Err(Error::ShapeMismatch {
                op: "moe_router",
                lhs: logits.shape().to_vec(),
                rhs: b.shape().to_vec(),
            });
        }
    }
    let logits = if logits.dtype() == DType::F32 {
        logits.clone()
    } else {
        logits.to_dtype(DType::F32)?
    };
    let scores = match spec.score {
        RouterScore::Softmax => logits.softmax(-1)?,
        RouterScore::Sigmoid => logits.sigmoid()?,
    };
    let experts = {
        let _g = crate::autograd::no_grad();
        let choice = match bias {
            Some(b) => scores.detach().add(&b.detach().to_dtype(DType::F32)?)?,
            None => scores.detach(),
        };
        choice.topk(spec.top_k, -1, true, true)?.1
    };
    let mut weights = scores.gather(1, &experts)?;
    if spec.renormalize {
        // The tiny floor only matters for sigmoid scores that all underflow; on any sum a
        // softmax top-k can produce it rounds away, so weights match the plain division.
        let sum = weights.sum_dims(&[-1], true)?.add_scalar(1e-20)?;
        weights = weights.div(&sum)?;
    }
    if spec.route_scale != 1.0 {
        weights = weights.mul_scalar(spec.route_scale)?;
    }
    Ok(Routing {
        weights,
        experts,
        scores,
    })
}
