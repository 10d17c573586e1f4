//! Preference tuning on pairs of rows (chosen `2i`, rejected `2i + 1`; see
//! `anneal_data::preference`): DPO (Rafailov et al., 2023) against a frozen reference model,
//! and SimPO (Meng et al., 2024), length-normalized and reference-free. Each row's
//! log-probability `π` is the sum over its completion's tokens; per pair
//!
//! - DPO: `z = β · ((π_c − ρ_c) − (π_r − ρ_r))`, `ρ` the reference's log-probabilities;
//! - SimPO: `z = β · (π_c / |c| − π_r / |r|) − γ`;
//!
//! and the loss is the mean over pairs of `−log σ(z) = softplus(−z)`. `z` is the pair's
//! implicit reward margin: the run logs its mean (`pref_margin`) and the share of pairs where
//! it is positive (`pref_accuracy`), in training and on held-out pairs.

use anneal_config::{Preference, PreferenceLoss};
use anneal_data::IGNORE_INDEX;
use anneal_engine::{DType, Result, Tensor};

/// The summed log-probability of each row's trained targets, `[B]`, from logits `[B, T, V]`
/// and targets `[B · T]` ([`IGNORE_INDEX`] where no loss is taken).
pub fn row_logps(logits_btv: &Tensor, targets: &[i64]) -> Result<Tensor> {
    let (b, t) = (logits_btv.shape()[0], logits_btv.shape()[1]);
    let device = logits_btv.device();
    let lp = logits_btv.to_dtype(DType::F32)?.log_softmax(-1)?;
    let idx: Vec<i64> = targets.iter().map(|&x| x.max(0)).collect();
    let mask: Vec<f32> = targets
        .iter()
        .map(|&x| if x == IGNORE_INDEX { 0.0 } else { 1.0 })
        .collect();
    let idx = Tensor::from_slice(&idx, &[b, t, 1])?.to_device(device)?;
    let mask = Tensor::from_slice(&mask, &[b, t])?.to_device(device)?;
    lp.gather(-1, &idx)?
        .reshape(&[b, t])?
        .mul(&mask)?
        .sum_dims(&[-1], false)
}

/// Trained targets per row of `targets` (`rows` rows).
pub fn row_lengths(targets: &[i64], rows: usize) -> Vec<f32> {
    let t = targets.len() / rows.max(1);
    targets
        .chunks(t.max(1))
        .map(|r| r.iter().filter(|&&x| x != IGNORE_INDEX).count() as f32)
        .collect()
}

/// The loss of the pairs of `policy` (`[B]` row log-probabilities, `B` even) and each pair's
/// margin `z`. `reference` holds the reference model's row log-probabilities (DPO), `lengths`
/// each row's trained tokens (SimPO).
pub fn pair_loss(
    cfg: &Preference,
    policy: &Tensor,
    reference: Option<&[f32]>,
    lengths: &[f32],
) -> Result<(Tensor, Vec<f32>)> {
    let pairs = policy.shape()[0] / 2;
    let device = policy.device();
    let both = policy.reshape(&[pairs, 2])?;
    let chosen = both.narrow(1, 0, 1)?.reshape(&[pairs])?;
    let rejected = both.narrow(1, 1, 1)?.reshape(&[pairs])?;
    let constant = |v: Vec<f32>| Tensor::from_slice(&v, &[pairs])?.to_device(device);
    let z = match cfg.loss {
        PreferenceLoss::Simpo => {
            let inv = |side: usize| {
                constant(
                    (0..pairs)
                        .map(|i| 1.0 / lengths[2 * i + side].max(1.0))
                        .collect(),
                )
            };
            chosen
                .mul(&inv(0)?)?
                .sub(&rejected.mul(&inv(1)?)?)?
                .mul_scalar(cfg.beta as f32)?
                .add_scalar(-cfg.gamma as f32)?
        }
        _ => {
            let r = reference.unwrap_or(&[]);
            let diff = (0..pairs)
                .map(|i| {
                    r.get(2 * i).copied().unwrap_or(0.0) - r.get(2 * i + 1).copied().unwrap_or(0.0)
                })
                .collect();
            chosen
                .sub(&rejected)?
                .sub(&constant(diff)?)?
                .mul_scalar(cfg.beta as f32)?
        }
    };
    let loss = z.neg()?.softplus()?.mean_all()?;
    let margins = z.to_device(anneal_engine::Device::Cpu)?.to_vec_f32();
    Ok((loss, margins))
}

/// A copy of `params` on `device` that later updates of the originals never reach: DPO's
/// reference model.
pub fn frozen_copy(
    params: &anneal_runtime::plugins::Params,
    device: anneal_engine::Device,
) -> std::result::Result<anneal_runtime::plugins::Params, crate::TrainError> {
    let mut out = std::collections::HashMap::with_capacity(params.len());
    for (name, t) in params.iter() {
        let host = t.to_device(anneal_engine::Device::Cpu)?;
        let mut bytes = Vec::new();
        host.copy_bytes_into(&mut bytes);
        let copy = Tensor::from_storage(
            anneal_engine::Storage::from_bytes(host.dtype(), &bytes),
            host.shape(),
        )?;
        out.insert(name.clone(), copy.to_device(device)?);
    }
    Ok(std::sync::Arc::new(out))
}

/// The statistics of `margins` the run logs: their mean and the share above zero.
pub fn margin_stats(margins: &[f32]) -> (f64, f64) {
    let n = margins.len().max(1) as f64;
    let mean = margins.iter().map(|&z| z as f64).sum::<f64>() / n;
    let right = margins.iter().filter(|&&z| z > 0.0).count() as f64 / n;
    (mean, right)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(loss: PreferenceLoss) -> Preference {
        Preference {
            loss,
            beta: 0.5,
            gamma: 0.25,
        }
    }

    #[test]
    fn dpo_and_simpo_match_their_formulas() {
        let policy = Tensor::from_vec(vec![-3.0f32, -5.0, -4.0, -2.0], &[4]).unwrap();
        let reference = [-3.5f32, -4.0, -4.0, -3.0];
        let (loss, z) =
            pair_loss(&cfg(PreferenceLoss::Dpo), &policy, Some(&reference), &[]).unwrap();
        // z = 0.5 * ((−3 + 3.5) − (−5 + 4)) = 0.75; 0.5 * ((−4 + 4) − (−2 + 3)) = −0.5.
        assert_eq!(z, vec![0.75, -0.5]);
        let softplus = |x: f64| (1.0 + x.exp()).ln();
        let want = (softplus(-0.75) + softplus(0.5)) / 2.0;
        assert!((loss.item().unwrap() as f64 - want).abs() < 1e-6);
        let lengths = [2.0f32, 5.0, 4.0, 1.0];
        let (_, z) = pair_loss(&cfg(PreferenceLoss::Simpo), &policy, None, &lengths).unwrap();
        // 0.5 * (−3/2 + 5/5) − 0.25 = −0.5; 0.5 * (−4/4 + 2/1) − 0.25 = 0.25.
        assert_eq!(z, vec![-0.5, 0.25]);
        assert_eq!(margin_stats(&z), (-0.125, 0.5));
    }

    #[test]
    fn row_log_probabilities_sum_the_trained_targets() {
        // One row of two positions over a vocabulary of 2; only the second target trains.
        let logits = Tensor::from_vec(vec![0.0f32, 0.0, 1.0, 0.0], &[1, 2, 2]).unwrap();
        let lp = row_logps(&logits, &[IGNORE_INDEX, 1]).unwrap().to_vec_f32();
        let want = -(1.0f64.exp() + 1.0).ln();
        assert!((lp[0] as f64 - want).abs() < 1e-6, "{lp:?}");
        assert_eq!(row_lengths(&[IGNORE_INDEX, 1, 0, 1], 2), vec![1.0, 2.0]);
    }
}
