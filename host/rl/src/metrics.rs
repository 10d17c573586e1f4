//! What an RL run reports per step: one [`RlRow`] in `metrics.jsonl` and a line on the
//! terminal.

use crate::buffer::Taken;
use crate::rollout::{Group, RewardFailure};
use crate::trainer::StepOut;
use serde::Serialize;

/// One row of an RL run's `metrics.jsonl`.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RlRow {
    /// Trainer steps completed (0: the row before training, with the starting accuracy).
    pub step: u64,
    /// Mean combined reward of the step's samples.
    pub reward_mean: f64,
    /// Their standard deviation.
    pub reward_std: f64,
    /// Share of samples a reward module called correct (`None` when none reports it).
    pub accuracy: Option<f64>,
    /// Mean completion length in tokens.
    pub response_len_mean: f64,
    /// Mean per-token entropy of the trainer's distribution over completion tokens (nats).
    pub entropy: f64,
    /// Mean k3 KL to the reference (`None` without `rl.kl_coef`).
    pub kl_ref: Option<f64>,
    /// Max |rollout − trainer| logprob over samples of the current version (0 expected).
    pub logprob_mismatch_max: f64,
    /// Mean policy-version lag of the step's samples.
    pub staleness_mean: f64,
    /// Failed reward calls in this step's samples (timeouts included).
    pub reward_errors: u64,
    /// Of which timeouts.
    pub reward_timeouts: u64,
    /// Rollout seconds of this step's groups (summed over workers).
    pub t_rollout: f64,
    /// Reward seconds of this step's groups.
    pub t_reward: f64,
    /// Trainer seconds (forward, backward, update, publish).
    pub t_train: f64,
    /// Seconds the trainer waited for rollouts.
    pub t_wait: f64,
    /// The loss value.
    pub loss: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate.
    pub lr: f64,
    /// Groups dropped for equal rewards (`dapo`).
    pub dropped_groups: u64,
    /// Rollouts discarded for staleness.
    pub dropped_stale: u64,
    /// Samples trained on per second of wall time since the previous row.
    pub samples_per_s: f64,
    /// Greedy accuracy on the held-out prompts, on evaluation steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_accuracy: Option<f64>,
    /// Seconds since the start.
    pub time: f64,
    /// Prompts of `rl.prompts_path` the run leaves out for not fitting the model's context
    /// (`rl.skip_long_prompts`); absent when none are.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompts_skipped: Option<u64>,
    /// The model's weighted auxiliary losses, added to the loss trained on (`loss` is
    /// without them, as in `anneal train`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// Each `aux_loss.<name>` (unweighted) and each statistic the model reported.
    #[serde(flatten)]
    pub outputs: std::collections::BTreeMap<String, serde_json::Value>,
}

impl RlRow {
    /// Whether `name` is one of the row's own fields, which a model's statistic must not take.
    pub(crate) fn has_field(name: &str) -> bool {
        let full = RlRow {
            eval_accuracy: Some(0.0),
            aux_loss: Some(0.0),
            prompts_skipped: Some(0),
            ..Default::default()
        };
        serde_json::to_value(full)
            .ok()
            .and_then(|v| v.as_object().map(|o| o.contains_key(name)))
            .unwrap_or(false)
    }

    /// The row of `step`: statistics of the batch `taken` (taken at policy `version`) and of
    /// the trainer's first update on it (`out`).
    pub(crate) fn of_step(
        step: u64,
        version: u64,
        lr: f64,
        taken: &Taken<Group>,
        out: &StepOut,
        seconds_since_last_row: f64,
    ) -> RlRow {
        let samples: Vec<_> = taken
            .items
            .iter()
            .flat_map(|it| it.value.samples.iter())
            .collect();
        let n = samples.len() as f64;
        let rewards: Vec<f64> = samples.iter().map(|s| s.scored.reward).collect();
        let mean = rewards.iter().sum::<f64>() / n;
        let std = (rewards.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        let judged: Vec<bool> = samples.iter().filter_map(|s| s.scored.correct).collect();
        let failures = samples.iter().flat_map(|s| s.scored.failures.iter());
        let (mut errors, mut timeouts) = (0, 0);
        for f in failures {
            errors += 1;
            if *f == RewardFailure::Timeout {
                timeouts += 1;
            }
        }
        let items = &taken.items;
        RlRow {
            step,
            reward_mean: mean,
            reward_std: std,
            accuracy: (!judged.is_empty())
                .then(|| judged.iter().filter(|&&c| c).count() as f64 / judged.len() as f64),
            response_len_mean: samples
                .iter()
                .map(|s| s.policy_tokens() as f64)
                .sum::<f64>()
                / n,
            entropy: out.entropy,
            kl_ref: out.kl,
            logprob_mismatch_max: out.mismatch_max,
            staleness_mean: items
                .iter()
                .map(|it| (version - it.version) as f64)
                .sum::<f64>()
                / items.len() as f64,
            reward_errors: errors,
            reward_timeouts: timeouts,
            t_rollout: items.iter().map(|it| it.value.t_rollout).sum(),
            t_reward: items.iter().map(|it| it.value.t_reward).sum(),
            t_train: 0.0,
            t_wait: 0.0,
            loss: out.loss,
            grad_norm: out.grad_norm,
            lr,
            dropped_groups: out.dropped_groups as u64,
            dropped_stale: taken.dropped as u64,
            samples_per_s: n / seconds_since_last_row.max(1e-9),
            eval_accuracy: None,
            time: 0.0,
            prompts_skipped: None,
            aux_loss: out.aux_loss,
            outputs: out.outputs.clone(),
        }
    }

    /// The row as one terminal line.
    pub(crate) fn console_line(&self) -> String {
        let r = self;
        let mut s = format!(
        "step {:>6}  reward {:.3}±{:.3}  len {:.1}  entropy {:.3}  mismatch {:e}  stale {:.2}  loss {:.4}",
        r.step, r.reward_mean, r.reward_std, r.response_len_mean, r.entropy, r.logprob_mismatch_max, r.staleness_mean, r.loss
    );
        if let Some(a) = r.accuracy {
            s.push_str(&format!("  acc {a:.3}"));
        }
        if let Some(a) = r.eval_accuracy {
            s.push_str(&format!("  eval_accuracy {a:.3}"));
        }
        if r.reward_errors > 0 {
            s.push_str(&format!(
                "  reward_errors {} (timeouts {})",
                r.reward_errors, r.reward_timeouts
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::RlRow;

    #[test]
    fn statistics_may_not_take_the_name_of_a_row_field() {
        for taken in [
            "entropy",
            "reward_mean",
            "eval_accuracy",
            "aux_loss",
            "loss",
        ] {
            assert!(RlRow::has_field(taken), "{taken}");
        }
        assert!(!RlRow::has_field("router_entropy"));
        // The model's outputs are flattened into the row beside its own fields.
        let row = RlRow {
            outputs: [("router_entropy".to_string(), serde_json::json!(1.5))].into(),
            ..Default::default()
        };
        let v = serde_json::to_value(row).unwrap();
        assert_eq!(v["router_entropy"], 1.5);
        assert!(
            v.get("aux_loss").is_none(),
            "left out when the model has none"
        );
    }
}
