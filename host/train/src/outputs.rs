//! A model's auxiliary losses and statistics (see `PluginModel::forward_full`) over one
//! optimizer step: the losses, weighted by `training.aux_loss_weights` (1 when unlisted), join
//! the loss that is backpropagated; for `metrics.jsonl` everything is averaged over the step's
//! micro-batches.

use anneal_engine::Tensor;
use std::collections::BTreeMap;

/// `Σ weight(name) · loss` over a forward's auxiliary losses, or `None` when it has none.
pub fn weighted_aux(
    weights: &BTreeMap<String, f64>,
    aux: &[(String, Tensor)],
) -> anneal_engine::Result<Option<Tensor>> {
    let mut total: Option<Tensor> = None;
    for (name, loss) in aux {
        let w = weights.get(name).copied().unwrap_or(1.0);
        let term = loss.reshape(&[])?.mul_scalar(w as f32)?;
        total = Some(match total {
            Some(t) => t.add(&term)?,
            None => term,
        });
    }
    Ok(total)
}

/// The fields every `metrics.jsonl` row may carry, which a statistic must not be named.
const RESERVED: [&str; 12] = [
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "tflops",
    "mfu",
    "mem_peak_bytes",
    "val_loss",
    "aux_loss",
    "tokens",
    "time",
];

/// Running sums over the micro-batches of one step, kept where the model computed them (on a
/// GPU, summed there): nothing is read back per micro-batch. The values come to the host once,
/// with the step's losses and gradient norm ([`StepOutputs::pending`] /
/// [`StepOutputs::take_values`]), or on first use.
#[derive(Default)]
pub struct StepOutputs {
    micro_batches: usize,
    /// The weighted auxiliary losses' sum.
    aux_total: Option<Tensor>,
    /// `aux_loss.<name>` (unweighted) and statistics by name: f32 elementwise sums and whether
    /// the value is a scalar.
    sums: Vec<(String, Tensor, bool)>,
    /// The statistics as tensors, summed over micro-batches (for the buffer hook).
    stat_tensors: Vec<(String, Tensor)>,
    /// The sums' values, once read.
    values: Option<Values>,
}

/// What [`StepOutputs`] sums read back: the auxiliary total and each named sum.
#[derive(Clone, Default)]
struct Values {
    aux_total: Option<f64>,
    sums: Vec<Vec<f64>>,
}

impl StepOutputs {
    /// Adds one micro-batch: its weighted auxiliary total, its losses and its statistics.
    pub fn add(
        &mut self,
        aux_total: Option<&Tensor>,
        aux: &[(String, Tensor)],
        stats: &[(String, Tensor)],
    ) -> anneal_engine::Result<()> {
        self.micro_batches += 1;
        self.values = None;
        for (name, t) in stats {
            let t = t.detach();
            match self.stat_tensors.iter_mut().find(|(n, _)| n == name) {
                Some((_, sum)) => *sum = sum.add(&t)?,
                None => self.stat_tensors.push((name.clone(), t)),
            }
        }
        if let Some(t) = aux_total {
            let t = t
                .detach()
                .to_dtype(anneal_engine::DType::F32)?
                .reshape(&[])?;
            self.aux_total = Some(match self.aux_total.take() {
                Some(sum) => sum.add(&t)?,
                None => t,
            });
        }
        let named = aux
            .iter()
            .map(|(n, t)| (format!("aux_loss.{n}"), t))
            .chain(stats.iter().map(|(n, t)| (n.clone(), t)));
        for (name, t) in named {
            if RESERVED.contains(&name.as_str()) {
                return Err(anneal_engine::Error::Invalid {
                    op: "plugin",
                    msg: format!("the model named a statistic '{name}', a metrics.jsonl field"),
                });
            }
            let t = t.detach().to_dtype(anneal_engine::DType::F32)?;
            let t = t.reshape(&[t.numel()])?;
            match self.sums.iter_mut().find(|(n, _, _)| *n == name) {
                // A value whose size changed between micro-batches keeps its first shape.
                Some((_, sum, _)) if sum.numel() == t.numel() => *sum = sum.add(&t)?,
                Some(_) => {}
                None => {
                    let scalar = t.numel() == 1 && t.rank() <= 1;
                    self.sums.push((name, t, scalar));
                }
            }
        }
        Ok(())
    }

    /// The sums still to read (none once read): read them with the step's other values and
    /// hand the values to [`StepOutputs::take_values`].
    pub fn pending(&self) -> Vec<Tensor> {
        if self.values.is_some() {
            return Vec::new();
        }
        self.aux_total
            .iter()
            .cloned()
            .chain(self.sums.iter().map(|(_, t, _)| t.clone()))
            .collect()
    }

    /// Takes the values read for [`StepOutputs::pending`]'s tensors, in its order.
    pub fn take_values(&mut self, values: &[f64]) {
        if self.values.is_some() {
            return;
        }
        let mut at = 0;
        let aux_total = self.aux_total.as_ref().map(|_| {
            at += 1;
            values.get(at - 1).copied().unwrap_or(f64::NAN)
        });
        let sums = self
            .sums
            .iter()
            .map(|(_, t, _)| {
                let v = values.get(at..at + t.numel()).unwrap_or(&[]).to_vec();
                at += t.numel();
                v
            })
            .collect();
        self.values = Some(Values { aux_total, sums });
    }

    /// The sums' values: those taken, else read now.
    fn values(&self) -> anneal_engine::Result<Values> {
        if let Some(v) = &self.values {
            return Ok(v.clone());
        }
        let mut fresh = StepOutputs {
            aux_total: self.aux_total.clone(),
            sums: self.sums.clone(),
            ..StepOutputs::default()
        };
        fresh.take_values(&anneal_engine::ops::read_values(&self.pending())?);
        Ok(fresh.values.unwrap_or_default())
    }

    /// Sums everything over the data-parallel ranks (each rank saw its share of the step's
    /// micro-batches), so the fields, the auxiliary total and the statistics the model's buffer
    /// hook gets are those of the whole step, the same on every rank. Every rank's model emits
    /// the same names, so the buffers line up.
    pub fn reduce_across(
        &mut self,
        comm: &dyn anneal_dist::Collective,
    ) -> Result<(), crate::TrainError> {
        if comm.size() == 1 {
            return Ok(());
        }
        let values = self.values()?;
        let mut buf = vec![
            self.micro_batches as f32,
            values.aux_total.unwrap_or(0.0) as f32,
        ];
        let stats: Vec<Vec<f32>> = self
            .stat_tensors
            .iter()
            .map(|(_, t)| t.to_vec_f32())
            .collect();
        for v in &stats {
            buf.extend(v);
        }
        for sum in &values.sums {
            buf.extend(sum.iter().map(|&v| v as f32));
        }
        comm.all_reduce_sum(&mut buf)?;
        self.micro_batches = buf[0].round() as usize;
        let aux_total = values.aux_total.map(|_| buf[1] as f64);
        let mut at = 2;
        for ((_, t), v) in self.stat_tensors.iter_mut().zip(&stats) {
            let summed = Tensor::from_slice(&buf[at..at + v.len()], t.shape())?;
            *t = summed.to_dtype(t.dtype())?;
            at += v.len();
        }
        let sums = values
            .sums
            .iter()
            .map(|sum| {
                let v = buf[at..at + sum.len()].iter().map(|&v| v as f64).collect();
                at += sum.len();
                v
            })
            .collect();
        self.values = Some(Values { aux_total, sums });
        Ok(())
    }

    /// Sums the weighted auxiliary loss over `comm`'s ranks (pipeline stages: each holds the
    /// part its blocks emitted); the named losses and statistics stay this rank's. Collective.
    pub fn sum_aux_total_across(
        &mut self,
        comm: &dyn anneal_dist::Collective,
    ) -> Result<(), crate::TrainError> {
        let mut values = self.values()?;
        let mut buf = [
            values.aux_total.unwrap_or(0.0) as f32,
            f32::from(u8::from(values.aux_total.is_some())),
        ];
        comm.all_reduce_sum(&mut buf)?;
        if buf[1] > 0.0 {
            values.aux_total = Some(buf[0] as f64);
        }
        self.values = Some(values);
        Ok(())
    }

    /// Each statistic summed over the step's micro-batches (token counts of a whole step).
    pub fn stat_sums(&self) -> &[(String, Tensor)] {
        &self.stat_tensors
    }

    /// The weighted auxiliary total's mean over the micro-batches, if any (read now unless
    /// the values were taken).
    pub fn aux_total(&self) -> anneal_engine::Result<Option<f64>> {
        let n = self.micro_batches.max(1) as f64;
        Ok(self.values()?.aux_total.map(|t| t / n))
    }

    /// Means over the micro-batches, as `metrics.jsonl` fields: numbers for scalars, lists for
    /// vectors. A model reporting per-layer load imbalance (`moe.layer<i>.imbalance`) also gets
    /// the run's summary over its layers: `moe.imbalance` (the mean) and `moe.imbalance_max`.
    pub fn fields(&self) -> anneal_engine::Result<BTreeMap<String, serde_json::Value>> {
        let mut f = self.means()?;
        let layers: Vec<f64> = f
            .iter()
            .filter(|(k, _)| {
                k.strip_prefix("moe.layer")
                    .and_then(|r| r.strip_suffix(".imbalance"))
                    .is_some_and(|i| i.parse::<usize>().is_ok())
            })
            .filter_map(|(_, v)| v.as_f64())
            .collect();
        if !layers.is_empty() {
            let mean = layers.iter().sum::<f64>() / layers.len() as f64;
            let max = layers.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            f.entry("moe.imbalance".into()).or_insert(mean.into());
            f.entry("moe.imbalance_max".into()).or_insert(max.into());
        }
        Ok(f)
    }

    fn means(&self) -> anneal_engine::Result<BTreeMap<String, serde_json::Value>> {
        let n = self.micro_batches.max(1) as f64;
        let values = self.values()?;
        Ok(self
            .sums
            .iter()
            .zip(&values.sums)
            .map(|((name, _, scalar), sum)| {
                let mean: Vec<f64> = sum.iter().map(|s| s / n).collect();
                let v = if *scalar {
                    serde_json::json!(mean.first().copied().unwrap_or(f64::NAN))
                } else {
                    serde_json::json!(mean)
                };
                (name.clone(), v)
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_are_weighted_and_values_averaged_over_micro_batches() {
        let t = |v: &[f32], s: &[usize]| Tensor::from_slice(v, s).unwrap();
        let weights = BTreeMap::from([("balance".to_string(), 0.5)]);
        let aux = vec![
            ("balance".to_string(), t(&[2.0], &[])),
            ("z".to_string(), t(&[1.0], &[1])),
        ];
        let total = weighted_aux(&weights, &aux).unwrap().unwrap();
        assert_eq!(total.item().unwrap(), 2.0);
        assert!(weighted_aux(&weights, &[]).unwrap().is_none());
        let mut step = StepOutputs::default();
        let stats = |a: f32| vec![("load".to_string(), t(&[a, 2.0 * a], &[2]))];
        step.add(Some(&total), &aux, &stats(1.0)).unwrap();
        step.add(Some(&t(&[4.0], &[])), &aux, &stats(3.0)).unwrap();
        assert_eq!(step.aux_total().unwrap(), Some(3.0));
        let f = step.fields().unwrap();
        assert_eq!(f["load"], serde_json::json!([2.0, 4.0]));
        assert_eq!(step.stat_sums()[0].1.to_vec_f32(), vec![4.0, 8.0]);
        assert_eq!(f["aux_loss.balance"], serde_json::json!(2.0));
        assert_eq!(f["aux_loss.z"], serde_json::json!(1.0));
        assert!(!f.contains_key("moe.imbalance"));
        let mut moe = StepOutputs::default();
        let layers = |a: f32, b: f32| {
            vec![
                ("moe.layer0.imbalance".to_string(), t(&[a], &[])),
                ("moe.layer1.imbalance".to_string(), t(&[b], &[])),
            ]
        };
        moe.add(None, &[], &layers(1.5, 1.0)).unwrap();
        moe.add(None, &[], &layers(2.5, 1.0)).unwrap();
        let f = moe.fields().unwrap();
        assert_eq!(f["moe.imbalance"], serde_json::json!(1.5));
        assert_eq!(f["moe.imbalance_max"], serde_json::json!(2.0));
        let clash = vec![("loss".to_string(), t(&[1.0], &[]))];
        assert!(step.add(None, &[], &clash).is_err());
    }
}
