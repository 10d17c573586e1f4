//! Keeping experts evenly loaded: the aux-loss-free router-bias update (DeepSeek-V3), the
//! classic auxiliary load-balancing loss (Switch Transformer, as Hugging Face's Mixtral and
//! Qwen-MoE compute it), and router statistics for metrics.

use super::moe::ExpertCounts;
use super::moe_router::RouterScore;
use crate::error::{invalid, Error, Result};
use crate::{DType, Device, Tensor};

/// The default step `u` of the aux-loss-free bias update.
pub const DEFAULT_BIAS_UPDATE_RATE: f32 = 1e-3;

/// Tokens routed to each expert, summed over every micro-batch of one optimizer step (the
/// counts the bias update needs: gradient accumulation must not change what a step sees).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExpertLoad {
    counts: Vec<u64>,
}

impl ExpertLoad {
    /// No tokens yet, for `num_experts` experts.
    pub fn new(num_experts: usize) -> ExpertLoad {
        ExpertLoad {
            counts: vec![0; num_experts],
        }
    }

    /// Adds one forward pass's per-expert counts (e.g. [`super::MoeOutput::counts`]; counts
    /// on a GPU are copied back).
    pub fn add<C: ExpertCounts + ?Sized>(&mut self, counts: &C) -> Result<()> {
        let counts: Vec<i64> = counts.counts_on(Device::Cpu)?.to_vec();
        if counts.len() != self.counts.len() {
            return Err(invalid(
                "expert_load",
                format!("{} counts for {} experts", counts.len(), self.counts.len()),
            ));
        }
        for (s, &c) in self.counts.iter_mut().zip(&counts) {
            *s += c.max(0) as u64;
        }
        Ok(())
    }

    /// The summed counts.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// Max over mean tokens per expert (1 when perfectly even, 0 with no tokens).
    pub fn imbalance(&self) -> f32 {
        imbalance(&self.counts)
    }

    /// Applies [`update_router_bias`] with these counts, then starts a new step.
    pub fn apply_bias_update(&mut self, bias: &Tensor, rate: f32) -> Result<()> {
        update_router_bias(bias, &self.counts, rate)?;
        self.counts.iter_mut().for_each(|c| *c = 0);
        Ok(())
    }
}

/// Max over mean of `counts` (0 when all are 0).
fn imbalance(counts: &[u64]) -> f32 {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return 0.0;
    }
    let mean = total as f64 / counts.len() as f64;
    let max = counts.iter().copied().max().unwrap_or(0);
    (max as f64 / mean) as f32
}

/// The aux-loss-free balancing step, in place on the (untrained) router `bias [E]`:
/// `bias += d − mean(d)` with `d = rate · sign(mean(counts) − counts)`, so under-loaded
/// experts become likelier picks and the bias keeps its mean. `counts` are the step's tokens
/// per expert (all micro-batches).
pub fn update_router_bias(bias: &Tensor, counts: &[u64], rate: f32) -> Result<()> {
    if bias.shape() != [counts.len()] || !bias.dtype().is_float() {
        return Err(invalid(
            "update_router_bias",
            format!(
                "bias must be a float [{}] tensor, got {} of shape {:?}",
                counts.len(),
                bias.dtype(),
                bias.shape()
            ),
        ));
    }
    if counts.is_empty() {
        return Ok(());
    }
    let mean = counts.iter().map(|&c| c as f64).sum::<f64>() / counts.len() as f64;
    let d: Vec<f32> = counts
        .iter()
        .map(|&c| {
            let gap = mean - c as f64;
            if gap > 0.0 {
                rate
            } else if gap < 0.0 {
                -rate
            } else {
                0.0
            }
        })
        .collect();
    let d_mean = d.iter().sum::<f32>() / d.len() as f32;
    let delta: Vec<f32> = d.iter().map(|&v| v - d_mean).collect();
    let _g = crate::autograd::no_grad();
    let delta = Tensor::from_vec(delta, &[counts.len()])?.to_device(bias.device())?;
    let updated = bias.to_dtype(DType::F32)?.add(&delta)?;
    bias.copy_from(&updated)
}

/// Per-token probabilities over the experts: softmax scores as they are, sigmoid scores
/// divided by their sum.
fn probabilities(scores: &Tensor, score: RouterScore) -> Result<Tensor> {
    match score {
        RouterScore::Softmax => Ok(scores.clone()),
        RouterScore::Sigmoid => scores.div(&scores.sum_dims(&[-1], true)?.add_scalar(1e-20)?),
    }
}

/// The auxiliary load-balancing loss `E · Σ_e f_e · P_e` for `scores [N, E]` and the layer's
/// `counts` (tokens routed to each expert, all top-k choices): `f_e = counts_e / N` (so the f's
/// sum to k) and `P_e` the mean probability of expert `e`. It is `k` when routing is even, and
/// equals Hugging Face's `load_balancing_loss_func` for one layer without padding. The
/// gradient flows through `P` only (the counts are not differentiable). Multiply by the loss
/// coefficient before adding it to the training loss. Counts on the scores' GPU stay there.
pub fn load_balancing_loss<C: ExpertCounts + ?Sized>(
    scores: &Tensor,
    counts: &C,
    score: RouterScore,
) -> Result<Tensor> {
    let counts = counts.counts_on(scores.device())?;
    if scores.rank() != 2 || scores.shape()[1] != counts.numel() {
        return Err(Error::ShapeMismatch {
            op: "load_balancing_loss",
            lhs: scores.shape().to_vec(),
            rhs: counts.shape().to_vec(),
        });
    }
    let (n, e) = (scores.shape()[0], counts.numel());
    let f = counts
        .to_dtype(DType::F32)?
        .mul_scalar(1.0 / n.max(1) as f32)?;
    let p = probabilities(scores, score)?.mean_dims(&[0], false)?;
    p.mul(&f)?.sum_all()?.mul_scalar(e as f32)
}

/// What a router did in one forward pass, for metrics: f32 tensors on the router's device,
/// computed there (reading them is the caller's choice, once per step with the loss).
#[derive(Clone, Debug)]
pub struct RouterStats {
    /// `[E]`: tokens routed to each expert (all top-k choices).
    pub tokens_per_expert: Tensor,
    /// Scalar: max over mean of `tokens_per_expert` (1 is perfectly even, 0 with no tokens).
    pub imbalance: Tensor,
    /// Scalar: mean over tokens of the entropy (nats) of their probabilities over experts:
    /// `ln E` when the router is undecided, 0 when it is certain.
    pub entropy: Tensor,
}

impl RouterStats {
    /// Statistics of `scores [N, E]` and the per-expert `counts` they led to.
    pub fn new<C: ExpertCounts + ?Sized>(
        scores: &Tensor,
        counts: &C,
        score: RouterScore,
    ) -> Result<RouterStats> {
        let counts = counts.counts_on(scores.device())?;
        if scores.rank() != 2 || scores.shape()[1] != counts.numel() {
            return Err(Error::ShapeMismatch {
                op: "router_stats",
                lhs: scores.shape().to_vec(),
                rhs: counts.shape().to_vec(),
            });
        }
        let _g = crate::autograd::no_grad();
        let n = scores.shape()[0];
        let tokens = counts.to_dtype(DType::F32)?;
        // max / mean, and 0 / tiny = 0 when no token was routed.
        let mean = tokens.mean_all()?.clamp(f32::MIN_POSITIVE, f32::INFINITY)?;
        let imbalance = tokens.max_dim(0, false)?.div(&mean)?;
        // -p·ln p with 0·ln 0 taken as 0 (the clamp keeps ln finite where p is 0).
        let p = probabilities(&scores.detach(), score)?;
        let plogp = p.mul(&p.clamp(f32::MIN_POSITIVE, f32::INFINITY)?.log()?)?;
        let entropy = plogp.sum_all()?.mul_scalar(-1.0 / n.max(1) as f32)?;
        Ok(RouterStats {
            tokens_per_expert: tokens,
            imbalance,
            entropy,
        })
    }
}
