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
    /// Group-limited routing `(n_group, topk_group)` (DeepSeek-V3): the experts form `n_group`
    /// equal groups, a group's score is the sum of its best two `score + bias`, and a token
    /// chooses its top-k among the experts of its `topk_group` best groups only.
    pub groups: Option<(usize, usize)>,
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
            groups: None,
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
        if let Some((n_group, topk_group)) = self.groups {
            let e = self.num_experts;
            let fits = n_group >= 1
                && e.is_multiple_of(n_group)
                && e / n_group >= 2
                && (1..=n_group).contains(&topk_group)
                && self.top_k <= topk_group * (e / n_group);
            if !fits {
                return Err(invalid(
                    "moe_router",
                    format!(
                        "groups: n_group = {n_group} must split the {e} experts into equal groups \
                         of at least 2, topk_group = {topk_group} must be between 1 and n_group, \
                         and top_k = {} must fit in topk_group groups",
                        self.top_k
                    ),
                ));
            }
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

/// `choice [N, E]` with the experts outside each row's `topk_group` best groups set to -inf;
/// a group's score is the sum of its two best entries (DeepSeek-V3's `n_group` routing). Tensor
/// ops on the scores' device (nothing read back); equal group scores keep the lower group, as
/// top-k takes equal values lower index first.
fn limit_to_groups(choice: &Tensor, n_group: usize, topk_group: usize) -> Result<Tensor> {
    let (n, e) = (choice.shape()[0], choice.shape()[1]);
    let size = e / n_group;
    let grouped = choice.reshape(&[n, n_group, size])?;
    let best_two = grouped.topk(2, -1, true, true)?.0;
    let group_score = best_two.sum_dims(&[-1], false)?;
    let keep = group_score.topk(topk_group, -1, true, true)?.1;
    let ones = Tensor::zeros_on(&[n, topk_group], DType::F32, choice.device())?.add_scalar(1.0)?;
    let kept = Tensor::zeros_on(&[n, n_group], DType::F32, choice.device())?
        .scatter_add(1, &keep, &ones)?
        .reshape(&[n, n_group, 1])?;
    // x + (-inf) is -inf for every score a router gives.
    let dropped = grouped.add_scalar(f32::NEG_INFINITY)?;
    crate::ops::where_(&kept, &grouped, &dropped)?.reshape(&[n, e])
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
        let mut choice = match bias {
            Some(b) => scores.detach().add(&b.detach().to_dtype(DType::F32)?)?,
            None => scores.detach(),
        };
        if let Some((n_group, topk_group)) = spec.groups {
            choice = limit_to_groups(&choice, n_group, topk_group)?;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_limited_routing_chooses_inside_the_best_groups() {
        // 6 experts in 3 groups of 2, sigmoid scores: by the sum of their two, groups 2
        // (0.88 + 0.62) and 1 (0.73 + 0.71) beat group 0 (0.95 + 0.01), whose expert 0 is
        // the single best.
        let logits = Tensor::from_vec(vec![3.0f32, -5.0, 1.0, 0.9, 2.0, 0.5], &[1, 6]).unwrap();
        let spec = RouterSpec {
            score: RouterScore::Sigmoid,
            groups: Some((3, 2)),
            ..RouterSpec::new(6, 2)
        };
        let r = route(&logits, None, &spec).unwrap();
        assert_eq!(r.experts.to_vec::<i64>(), [4, 2]);
        let plain = route(
            &logits,
            None,
            &RouterSpec {
                groups: None,
                ..spec
            },
        )
        .unwrap();
        assert_eq!(plain.experts.to_vec::<i64>(), [0, 4]);
        for bad in [(4, 1), (3, 0), (3, 4), (6, 1)] {
            let s = RouterSpec {
                groups: Some(bad),
                ..spec
            };
            assert!(s.validate().is_err(), "{bad:?}");
        }
    }
}
