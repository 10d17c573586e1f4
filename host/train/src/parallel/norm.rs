//! The global gradient norm, written once over placements.
//!
//! Each rank takes every parameter's f64 sum of squares of the gradient it holds (0 for one it
//! does not hold or that got none); then, axis by axis in [`Axis::ALL`]'s order, the sums are
//! gathered over the axis' ranks and combined per parameter: a split parameter's (`Shard`,
//! `Stage`) added in rank order, a replicated one's taken from the first rank. Finally the
//! parameters are added in name order. Every rank of the job ends with the same bits, and the
//! order depends on the placements alone, not on which layouts produced them.

use super::{Axis, Placement, Placements};
use crate::{Dist, TrainError};
use anneal_dist::Collective;
use anneal_engine::Tensor;

impl Placements {
    /// The global L2 norm of the gradients of `local` (this rank's pieces of the parameters, by
    /// name). Collective over every axis that splits some parameter.
    pub fn grad_norm(&self, dist: &Dist, local: &[(String, Tensor)]) -> Result<f64, TrainError> {
        Ok(self.grad_norm_reading(dist, local, &[])?.0)
    }

    /// [`Placements::grad_norm`], also reading the values of `extra` (the step's losses) with
    /// it: gradients on a GPU give their sums of squares there, and those and `extra` come back
    /// in one device→host copy, the step's only one (host gradients are summed in f64 on the
    /// host as before).
    pub fn grad_norm_reading(
        &self,
        dist: &Dist,
        local: &[(String, Tensor)],
        extra: &[Tensor],
    ) -> Result<(f64, Vec<f64>), TrainError> {
        let mut sums = vec![0f64; self.names().len()];
        let (mut on_device, mut grads) = (Vec::new(), Vec::new());
        for (name, p) in local {
            if let (Some(i), Some(g)) = (self.index(name), p.grad()) {
                if g.device() == anneal_engine::Device::Cpu {
                    sums[i] = g.sum_of_squares();
                } else {
                    on_device.push(i);
                    grads.push(g);
                }
            }
        }
        // One pass over the device's gradients (a job's gradients share one device; gradients
        // on several devices take one pass each).
        let mut reads = match grads.first().map(|g| g.device()) {
            Some(d) if grads.iter().all(|g| g.device() == d) => {
                vec![anneal_engine::ops::sum_of_squares_each(
                    &grads.iter().collect::<Vec<_>>(),
                )?]
            }
            _ => grads
                .iter()
                .map(|g| anneal_engine::ops::sum_of_squares_each(&[g]))
                .collect::<Result<Vec<_>, _>>()?,
        };
        reads.extend(extra.iter().cloned());
        let values = anneal_engine::ops::read_values(&reads)?;
        let (parts, extra) = values.split_at(on_device.len());
        for (&i, &v) in on_device.iter().zip(parts) {
            sums[i] = v;
        }
        let extra = extra.to_vec();
        for (axis, places) in self.axes() {
            if places.iter().all(|&p| p == Placement::Replicate) {
                continue;
            }
            let Some(comm) = dist.axis(axis) else {
                continue;
            };
            if comm.size() > 1 {
                sums = self.combine(axis, places, &gather(comm, &sums)?)?;
            }
        }
        Ok((sums.iter().sum::<f64>().sqrt(), extra))
    }

    /// Each parameter's sum over an axis from every rank's sums (`all`, rank by rank).
    fn combine(
        &self,
        axis: Axis,
        places: &[Placement],
        all: &[Vec<f64>],
    ) -> Result<Vec<f64>, TrainError> {
        places
            .iter()
            .enumerate()
            .map(|(i, &place)| match place {
                Placement::Replicate => Ok(all[0][i]),
                p if p.is_split() => Ok(all.iter().map(|r| r[i]).sum::<f64>()),
                _ => Err(self.unexpected(i, axis, "gradient norm")),
            })
            .collect()
    }
}

/// Every rank's `local` values over `comm`, rank by rank (sent as their bits, so nothing is
/// rounded on the way).
fn gather(comm: &dyn Collective, local: &[f64]) -> Result<Vec<Vec<f64>>, TrainError> {
    let bits: Vec<i64> = local.iter().map(|v| v.to_bits() as i64).collect();
    let mut all = vec![0i64; bits.len() * comm.size()];
    comm.all_gather((&bits[..]).into(), (&mut all[..]).into())?;
    Ok(all
        .chunks(bits.len().max(1))
        .take(comm.size())
        .map(|r| r.iter().map(|&b| f64::from_bits(b as u64)).collect())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_axis_adds_split_parameters_in_rank_order_and_takes_replicated_ones_once() {
        let p =
            Placements::replicated(["a", "b", "c", "d"].map(String::from)).with(Axis::Tp, |n| {
                match n {
                    "a" => Placement::Shard(1),
                    "b" => Placement::Replicate,
                    "c" => Placement::Stage,
                    _ => Placement::Partial,
                }
            });
        let (_, places) = p.axes().next().unwrap();
        // Three ranks' per-parameter sums of squares; rank order matters for the bits.
        let all = vec![
            vec![1e16, 2.0, 0.0, 0.0],
            vec![1.0, 2.0, 5.0, 0.0],
            vec![-1e16, 2.0, 0.0, 0.0],
        ];
        let err = p.combine(Axis::Tp, places, &all).unwrap_err().to_string();
        assert!(
            err.contains("parameter d") && err.contains("parallelism.tp"),
            "{err}"
        );
        let p = p.with(Axis::Tp, |n| match n {
            "b" | "d" => Placement::Replicate,
            "c" => Placement::Stage,
            _ => Placement::Shard(0),
        });
        let (_, places) = p.axes().next().unwrap();
        let sums = p.combine(Axis::Tp, places, &all).unwrap();
        // (1e16 + 1) - 1e16 in f64 is 0: the ranks' sums added in order 0, 1, 2.
        assert_eq!(sums, [0.0, 2.0, 5.0, 0.0]);
    }
}
