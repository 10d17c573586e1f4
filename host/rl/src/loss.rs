//! The policy-gradient losses of the GRPO family, built from engine ops so autograd gives the
//! gradient.
//!
//! Every sequence `i` of a batch has a completion of `L_i` tokens, padded to `L`, a reward `R_i`,
//! and belongs to a group of `group_size` completions of the same prompt (consecutive rows).
//!
//! - `grpo`: `A_i = (R_i − mean_g) / (std_g + ε)`; per-token clipped surrogate, mean over each
//!   sequence's tokens, then mean over sequences.
//! - `dr_grpo`: `A_i = R_i − mean_g`; tokens summed and divided by a constant
//!   (`sequences × max_new_tokens`), so long and short answers weigh the same per token.
//! - `dapo`: GRPO advantages, groups whose rewards are all equal dropped, asymmetric clip
//!   (`1 − clip_low`, `1 + clip_high`), mean over every kept token of the batch.
//!
//! The ratio `r = exp(logp − logp_rollout)` compares the trainer's policy with the one that
//! sampled (the same engine, so for the current version `r = 1` exactly). With
//! `is_correction_cap = C > 0` the ratio is truncated at `C` (the token's loss is scaled by
//! `min(r, C) / r`, detached), bounding the weight of samples much likelier under the trainer
//! than under the rollout policy. The optional KL penalty to a frozen reference uses the k3
//! estimator `exp(q − p) − (q − p) − 1` (`p` trainer, `q` reference), aggregated like the
//! policy term.

use anneal_config::RlLoss;
use anneal_engine::{Result, Tensor};

/// Standard deviation floor of group normalization.
pub const STD_EPS: f64 = 1e-4;

/// Settings of the loss.
#[derive(Clone, Debug)]
pub struct LossSettings {
    /// Which loss.
    pub kind: RlLoss,
    /// Lower clip: the ratio is kept above `1 − clip_low` (for positive advantages it only
    /// matters below 1).
    pub clip_low: f64,
    /// Upper clip: `1 + clip_high`.
    pub clip_high: f64,
    /// Weight of the k3 KL penalty (0 = off).
    pub kl_coef: f64,
    /// Truncated importance-ratio cap (0 = off).
    pub is_cap: f64,
    /// The constant length of Dr.GRPO's normalization (`max_new_tokens`).
    pub norm_len: usize,
    /// Weight of the entropy bonus (0 = off): `−entropy_coef · H` joins each token's loss.
    pub entropy_coef: f64,
}

impl LossSettings {
    /// The settings `rl.*` configures.
    pub fn from_config(r: &anneal_config::Rl) -> LossSettings {
        LossSettings {
            kind: r.loss,
            clip_low: r.clip_low,
            clip_high: r.clip_high,
            kl_coef: r.kl_coef,
            is_cap: r.is_correction_cap,
            norm_len: r.max_new_tokens,
            entropy_coef: r.entropy_coef,
        }
    }
}

/// One batch as the loss sees it. Host vectors are row-major `[N, L]`.
pub struct LossBatch<'a> {
    /// Trainer log-probabilities of the completion tokens, `[N, L]` (records the graph).
    pub logp_nl: &'a Tensor,
    /// Rollout log-probabilities, `N·L`.
    pub rollout_logp: &'a [f32],
    /// Reference log-probabilities, `N·L`, when a KL penalty is on.
    pub ref_logp: Option<&'a [f32]>,
    /// 1 for completion tokens, 0 for padding, `N·L`.
    pub mask: &'a [f32],
    /// Combined reward of each sequence.
    pub rewards: &'a [f64],
    /// Per-token entropy of the trainer's distribution, `[N, L]` (records the graph), when an
    /// entropy bonus is on.
    pub entropy_nl: Option<&'a Tensor>,
    /// Sequences per group.
    pub group_size: usize,
    /// The whole step's counts when this batch is one data-parallel rank's share of it (the
    /// normalizers must be the step's, so the ranks' losses add up to the whole batch's);
    /// `None`: this batch is the whole step.
    pub whole: Option<WholeStep>,
}

/// Counts of the whole step across data-parallel ranks (see [`LossBatch::whole`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WholeStep {
    /// Sequences in the step.
    pub samples: usize,
    /// Completion tokens of the sequences that take part (`dapo`'s normalizer).
    pub kept_tokens: f64,
}

/// Completion tokens of the sequences that take part, given each sequence's `keep` flag.
pub fn kept_tokens(mask: &[f32], keep: &[bool]) -> f64 {
    let l = mask.len() / keep.len().max(1);
    (0..keep.len())
        .filter(|&i| keep[i])
        .map(|i| mask[i * l..(i + 1) * l].iter().sum::<f32>() as f64)
        .sum()
}

/// The loss and what it saw.
pub struct LossOut {
    /// The scalar to call `backward` on.
    pub loss: Tensor,
    /// Each token's term of `loss`, `[N, L]` (detached): the loss is their sum, so ranks
    /// holding parts of a step can add them up in the whole batch's order.
    pub terms: Tensor,
    /// Advantage of each sequence.
    pub advantages: Vec<f32>,
    /// Mean k3 KL over the kept tokens (0 without a reference).
    pub kl_mean: f64,
    /// Groups dropped for equal rewards (`dapo` only).
    pub dropped_groups: usize,
}

/// Per-sequence advantages and whether each sequence takes part.
pub fn advantages(kind: RlLoss, rewards: &[f64], group_size: usize) -> (Vec<f32>, Vec<bool>) {
    debug_assert!(group_size > 0 && rewards.len().is_multiple_of(group_size));
    let mut adv = Vec::with_capacity(rewards.len());
    let mut keep = Vec::with_capacity(rewards.len());
    for g in rewards.chunks(group_size) {
        let n = g.len() as f64;
        let mean = g.iter().sum::<f64>() / n;
        let var = if g.len() > 1 {
            g.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0)
        } else {
            0.0
        };
        let std = var.sqrt();
        let all_equal = g.iter().all(|&r| r == g[0]);
        for &r in g {
            let a = match kind {
                RlLoss::DrGrpo => r - mean,
                RlLoss::Grpo | RlLoss::Dapo => (r - mean) / (std + STD_EPS),
            };
            adv.push(a as f32);
            keep.push(!(kind == RlLoss::Dapo && all_equal));
        }
    }
    (adv, keep)
}

/// The loss of one batch.
pub fn rl_loss(b: &LossBatch, s: &LossSettings) -> Result<LossOut> {
    let shape = b.logp_nl.shape().to_vec();
    let (n, l) = (shape[0], shape[1]);
    debug_assert_eq!(b.rewards.len(), n);
    let (adv, keep) = advantages(s.kind, b.rewards, b.group_size);
    let dropped_groups = keep
        .chunks(b.group_size)
        .filter(|g| !g.iter().any(|&k| k))
        .count();
    // Per-token weight: which tokens count and how the sum is normalized.
    let whole = b.whole.unwrap_or(WholeStep {
        samples: n,
        kept_tokens: kept_tokens(b.mask, &keep),
    });
    let mut weight = vec![0f32; n * l];
    for i in 0..n {
        if !keep[i] {
            continue;
        }
        let len: f32 = b.mask[i * l..(i + 1) * l].iter().sum();
        let norm = match s.kind {
            RlLoss::Grpo => len as f64 * whole.samples as f64,
            RlLoss::DrGrpo => (whole.samples * s.norm_len.max(1)) as f64,
            RlLoss::Dapo => whole.kept_tokens,
        };
        if len == 0.0 || norm == 0.0 {
            continue;
        }
        for j in 0..l {
            weight[i * l + j] = b.mask[i * l + j] / norm as f32;
        }
    }
    let logp = b.logp_nl;
    let old = Tensor::from_slice(b.rollout_logp, &[n, l])?;
    let log_ratio = logp.sub(&old)?.mul(&Tensor::from_slice(b.mask, &[n, l])?)?;
    let ratio = log_ratio.exp()?;
    let adv_t = Tensor::from_vec(
        (0..n * l).map(|k| adv[k / l]).collect::<Vec<f32>>(),
        &[n, l],
    )?;
    let unclipped = ratio.mul(&adv_t)?;
    let clipped = ratio
        .clamp((1.0 - s.clip_low) as f32, (1.0 + s.clip_high) as f32)?
        .mul(&adv_t)?;
    let mut per_token = unclipped.minimum(&clipped)?.neg()?;
    if s.is_cap > 0.0 {
        let r = ratio.to_vec_f32();
        let trunc: Vec<f32> = r
            .iter()
            .map(|&x| {
                if x as f64 > s.is_cap {
                    (s.is_cap / x as f64) as f32
                } else {
                    1.0
                }
            })
            .collect();
        per_token = per_token.mul(&Tensor::from_vec(trunc, &[n, l])?)?;
    }
    let mut kl_mean = 0.0;
    if let (Some(r), true) = (b.ref_logp, s.kl_coef > 0.0) {
        let d = Tensor::from_slice(r, &[n, l])?.sub(logp)?;
        let d = d.mul(&Tensor::from_slice(b.mask, &[n, l])?)?;
        let kl = d.exp()?.sub(&d)?.add_scalar(-1.0)?;
        let kv = kl.to_vec_f32();
        let tokens: f64 = b.mask.iter().map(|&m| m as f64).sum();
        kl_mean = kv
            .iter()
            .zip(b.mask)
            .map(|(&k, &m)| k as f64 * m as f64)
            .sum::<f64>()
            / tokens.max(1.0);
        per_token = per_token.add(&kl.mul_scalar(s.kl_coef as f32)?)?;
    }
    if let (Some(h), true) = (b.entropy_nl, s.entropy_coef > 0.0) {
        per_token = per_token.sub(&h.mul_scalar(s.entropy_coef as f32)?)?;
    }
    let weighted = per_token.mul(&Tensor::from_vec(weight, &[n, l])?)?;
    let loss = weighted.sum_all()?;
    Ok(LossOut {
        loss,
        terms: weighted.detach(),
        advantages: adv,
        kl_mean,
        dropped_groups,
    })
}

/// `log p(target)` of each row of `logprobs_nlv` (`[N, L, V]`, log-softmaxed logits) at
/// `targets` (`N·L` ids), as an `[N, L]` tensor on the autograd graph.
pub fn gather_logprobs(logprobs_nlv: &Tensor, targets: &[i64]) -> Result<Tensor> {
    let s = logprobs_nlv.shape().to_vec();
    let (n, l) = (s[0], s[1]);
    let idx = Tensor::from_slice(targets, &[n, l, 1])?.to_device(logprobs_nlv.device())?;
    logprobs_nlv.gather(-1, &idx)?.reshape(&[n, l])
}

/// The entropy `−Σ p log p` of each row of `logprobs_nlv` (`[N, L, V]`, log-softmaxed), as an
/// `[N, L]` tensor on the autograd graph.
pub fn entropies(logprobs_nlv: &Tensor) -> Result<Tensor> {
    logprobs_nlv
        .exp()?
        .mul(logprobs_nlv)?
        .sum_dims(&[-1], false)?
        .neg()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(kind: RlLoss) -> LossSettings {
        LossSettings {
            kind,
            clip_low: 0.2,
            clip_high: 0.28,
            kl_coef: 0.0,
            is_cap: 0.0,
            norm_len: 4,
            entropy_coef: 0.0,
        }
    }

    /// Two groups of two sequences, L = 3.
    struct Case {
        logp: Vec<f32>,
        rollout: Vec<f32>,
        mask: Vec<f32>,
        rewards: Vec<f64>,
    }

    fn case() -> Case {
        Case {
            logp: vec![
                -1.0, -0.5, -2.0, //
                -0.3, -1.2, 0.0, //
                -0.7, -0.9, -0.1, //
                -2.0, -0.4, -0.6,
            ],
            rollout: vec![
                -1.1, -0.5, -1.0, //
                -0.3, -1.0, 0.0, //
                -0.7, -0.6, -0.1, //
                -2.0, -0.4, -0.9,
            ],
            mask: vec![
                1.0, 1.0, 1.0, //
                1.0, 1.0, 0.0, //
                1.0, 1.0, 1.0, //
                1.0, 1.0, 1.0,
            ],
            rewards: vec![1.0, 0.0, 0.5, 0.5],
        }
    }

    fn loss_of(c: &Case, logp: &[f32], s: &LossSettings, ref_logp: Option<&[f32]>) -> LossOut {
        let t = Tensor::from_slice(logp, &[4, 3]).unwrap().requires_grad_();
        rl_loss(
            &LossBatch {
                logp_nl: &t,
                rollout_logp: &c.rollout,
                ref_logp,
                mask: &c.mask,
                rewards: &c.rewards,
                entropy_nl: None,
                group_size: 2,
                whole: None,
            },
            s,
        )
        .unwrap()
    }

    /// The same loss computed token by token in f64.
    fn reference(c: &Case, logp: &[f32], s: &LossSettings, ref_logp: Option<&[f32]>) -> f64 {
        let (adv, keep) = advantages(s.kind, &c.rewards, 2);
        let kept_tokens: f64 = (0..4)
            .filter(|&i| keep[i])
            .map(|i| c.mask[i * 3..i * 3 + 3].iter().sum::<f32>() as f64)
            .sum();
        let mut total = 0.0;
        for i in 0..4 {
            if !keep[i] {
                continue;
            }
            let len: f64 = c.mask[i * 3..i * 3 + 3].iter().map(|&m| m as f64).sum();
            let mut seq = 0.0;
            for j in 0..3 {
                let k = i * 3 + j;
                if c.mask[k] == 0.0 {
                    continue;
                }
                let r = (logp[k] as f64 - c.rollout[k] as f64).exp();
                let a = adv[i] as f64;
                let rc = r.clamp(1.0 - s.clip_low, 1.0 + s.clip_high);
                let mut t = -(r * a).min(rc * a);
                if s.is_cap > 0.0 && r > s.is_cap {
                    t *= s.is_cap / r;
                }
                if let Some(q) = ref_logp {
                    let d = q[k] as f64 - logp[k] as f64;
                    t += s.kl_coef * (d.exp() - d - 1.0);
                }
                seq += t;
            }
            total += match s.kind {
                RlLoss::Grpo => seq / len / 4.0,
                RlLoss::DrGrpo => seq / (4.0 * s.norm_len as f64),
                RlLoss::Dapo => seq / kept_tokens,
            };
        }
        total
    }

    #[test]
    fn advantages_by_hand() {
        let (a, keep) = advantages(RlLoss::Grpo, &[1.0, 0.0, 0.5, 0.5], 2);
        // Group 1: mean 0.5, unbiased std sqrt(0.5) = 0.7071.
        let want = 0.5 / (0.5f64.sqrt() + STD_EPS);
        assert!((a[0] as f64 - want).abs() < 1e-6 && (a[1] as f64 + want).abs() < 1e-6);
        assert_eq!((a[2], a[3]), (0.0, 0.0));
        assert!(keep.iter().all(|&k| k));
        let (a, _) = advantages(RlLoss::DrGrpo, &[1.0, 0.0, 0.5, 0.5], 2);
        assert_eq!(a, vec![0.5, -0.5, 0.0, 0.0]);
        let (_, keep) = advantages(RlLoss::Dapo, &[1.0, 0.0, 0.5, 0.5], 2);
        assert_eq!(keep, vec![true, true, false, false]);
    }

    #[test]
    fn on_policy_grpo_by_hand() {
        // r = 1 everywhere: the loss is −Σ_i A_i / N = 0 and the gradient of token (i, j) is
        // −A_i / (N · L_i).
        let c = case();
        let t = Tensor::from_slice(&c.rollout, &[4, 3])
            .unwrap()
            .requires_grad_();
        let out = rl_loss(
            &LossBatch {
                logp_nl: &t,
                rollout_logp: &c.rollout,
                ref_logp: None,
                mask: &c.mask,
                rewards: &c.rewards,
                entropy_nl: None,
                group_size: 2,
                whole: None,
            },
            &settings(RlLoss::Grpo),
        )
        .unwrap();
        assert!(out.loss.item().unwrap().abs() < 1e-6);
        out.loss.backward().unwrap();
        let g = t.grad().unwrap().to_vec_f32();
        let a0 = 0.5 / (0.5f64.sqrt() + STD_EPS);
        let want = [
            -a0 / 12.0,
            -a0 / 12.0,
            -a0 / 12.0,
            a0 / 8.0,
            a0 / 8.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
        ];
        for (x, w) in g.iter().zip(want) {
            assert!((*x as f64 - w).abs() < 1e-6, "{g:?}");
        }
    }

    #[test]
    fn values_match_the_f64_reference_for_every_loss() {
        let c = case();
        let reference_logp: Vec<f32> = c.logp.iter().map(|x| x - 0.1).collect();
        for kind in [RlLoss::Grpo, RlLoss::DrGrpo, RlLoss::Dapo] {
            for (kl, cap) in [(0.0, 0.0), (0.1, 0.0), (0.0, 1.5)] {
                let s = LossSettings {
                    kl_coef: kl,
                    is_cap: cap,
                    ..settings(kind)
                };
                let r = (kl > 0.0).then_some(&reference_logp[..]);
                let got = loss_of(&c, &c.logp, &s, r).loss.item().unwrap() as f64;
                let want = reference(&c, &c.logp, &s, r);
                assert!(
                    (got - want).abs() < 1e-5,
                    "{kind:?} kl {kl} cap {cap}: {got} vs {want}"
                );
            }
        }
        let s = settings(RlLoss::Dapo);
        assert_eq!(loss_of(&c, &c.logp, &s, None).dropped_groups, 1);
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let c = case();
        let reference_logp: Vec<f32> = c.logp.iter().map(|x| x - 0.1).collect();
        for kind in [RlLoss::Grpo, RlLoss::Dapo] {
            let s = LossSettings {
                kl_coef: 0.1,
                ..settings(kind)
            };
            let t = Tensor::from_slice(&c.logp, &[4, 3])
                .unwrap()
                .requires_grad_();
            let out = rl_loss(
                &LossBatch {
                    logp_nl: &t,
                    rollout_logp: &c.rollout,
                    ref_logp: Some(&reference_logp),
                    mask: &c.mask,
                    rewards: &c.rewards,
                    entropy_nl: None,
                    group_size: 2,
                    whole: None,
                },
                &s,
            )
            .unwrap();
            out.loss.backward().unwrap();
            let g = t.grad().unwrap().to_vec_f32();
            let h = 1e-3f32;
            for k in 0..12 {
                let (mut up, mut dn) = (c.logp.clone(), c.logp.clone());
                up[k] += h;
                dn[k] -= h;
                let fd = (reference(&c, &up, &s, Some(&reference_logp))
                    - reference(&c, &dn, &s, Some(&reference_logp)))
                    / (2.0 * h as f64);
                assert!(
                    (g[k] as f64 - fd).abs() < 1e-3,
                    "{kind:?} token {k}: autograd {} vs finite differences {fd}",
                    g[k]
                );
            }
        }
    }

    #[test]
    fn gather_logprobs_matches_token_logprob() {
        let logits: Vec<f32> = (0..2 * 3 * 5)
            .map(|i| ((i * 7) % 11) as f32 * 0.3)
            .collect();
        let t = Tensor::from_slice(&logits, &[2, 3, 5]).unwrap();
        let targets = [0i64, 4, 2, 1, 3, 3];
        let got = gather_logprobs(&t.log_softmax(-1).unwrap(), &targets)
            .unwrap()
            .to_vec_f32();
        for (k, &tok) in targets.iter().enumerate() {
            let want =
                anneal_runtime::infer::token_logprob(&logits[k * 5..k * 5 + 5], tok as usize);
            assert!((got[k] - want).abs() < 1e-5);
        }
    }

    /// Entropy of a row by hand, in f64.
    fn row_entropy(row: &[f32]) -> f64 {
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
        row.iter()
            .map(|&x| {
                let lp = x as f64 - m - z.ln();
                -lp.exp() * lp
            })
            .sum()
    }

    #[test]
    fn entropy_bonus_matches_hand_computed_value_and_finite_differences() {
        // Equal rewards: zero advantages, so the loss is the bonus alone,
        // −coef · Σ_i Σ_t mask · H / (len_i · N) under GRPO.
        let (n, l, v) = (2usize, 3usize, 4usize);
        let logits: Vec<f32> = (0..n * l * v)
            .map(|i| ((i * 5) % 7) as f32 * 0.4 - 1.0)
            .collect();
        let mask = [1.0f32, 1.0, 0.0, 1.0, 1.0, 1.0];
        let targets = [0i64, 1, 2, 3, 0, 1];
        let coef = 0.3;
        let loss_of = |x: &[f32]| -> (f64, Option<Vec<f32>>) {
            let t = Tensor::from_slice(x, &[n, l, v]).unwrap().requires_grad_();
            let lp_nlv = t.log_softmax(-1).unwrap();
            let logp = gather_logprobs(&lp_nlv, &targets).unwrap();
            let h = entropies(&lp_nlv).unwrap();
            let old = logp.to_vec_f32();
            let mut s = settings(RlLoss::Grpo);
            s.entropy_coef = coef;
            let out = rl_loss(
                &LossBatch {
                    logp_nl: &logp,
                    rollout_logp: &old,
                    ref_logp: None,
                    entropy_nl: Some(&h),
                    mask: &mask,
                    rewards: &[1.0, 1.0],
                    group_size: 2,
                    whole: None,
                },
                &s,
            )
            .unwrap();
            let value = out.loss.item().unwrap() as f64;
            out.loss.backward().unwrap();
            (value, t.grad().map(|g| g.to_vec_f32()))
        };
        let (value, grad) = loss_of(&logits);
        let mut want = 0.0;
        for i in 0..n {
            let len: f32 = mask[i * l..(i + 1) * l].iter().sum();
            for t in 0..l {
                let k = i * l + t;
                want -= coef * mask[k] as f64 * row_entropy(&logits[k * v..(k + 1) * v])
                    / (len as f64 * n as f64);
            }
        }
        assert!((value - want).abs() < 1e-6, "{value} vs {want}");
        let grad = grad.expect("logits get a gradient");
        let h = 1e-2f32;
        for k in [0, 5, 9, 13, 22] {
            let (mut up, mut dn) = (logits.clone(), logits.clone());
            up[k] += h;
            dn[k] -= h;
            let fd = (loss_of(&up).0 - loss_of(&dn).0) / (2.0 * h as f64);
            assert!(
                (grad[k] as f64 - fd).abs() < 1e-3,
                "logit {k}: {} vs {fd}",
                grad[k]
            );
        }
        // Padding rows contribute nothing: logit 2·v.. belongs to a masked token.
        assert!(grad[2 * v..3 * v].iter().all(|&g| g == 0.0));
    }
}
