//! Gradient sums written over placements: a gradient `Partial` over an axis is summed over
//! its ranks.

use super::{Axis, Placements};
use crate::TrainError;
use anneal_dist::Collective;
use anneal_engine::Tensor;

impl Placements {
    /// Sums over `comm` (the ranks of `axis`), in one buffer, the gradients of `local` (this
    /// rank's parameters) that are `Partial` over `axis`; a parameter without a gradient adds
    /// zeros and keeps none. Collective over `comm`: every rank holds the same names.
    pub fn sum_partial_grads(
        &self,
        axis: Axis,
        comm: &dyn Collective,
        local: &[(String, Tensor)],
    ) -> Result<(), TrainError> {
        let mine: Vec<&(String, Tensor)> = local
            .iter()
            .filter(|(n, _)| self.grad_is_partial(n, axis))
            .collect();
        if mine.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::new();
        for (_, p) in &mine {
            match p.grad() {
                Some(g) => buf.extend(g.to_vec_f32()),
                None => buf.resize(buf.len() + p.numel(), 0.0),
            }
        }
        comm.all_reduce_sum(&mut buf)?;
        let mut at = 0;
        for (_, p) in mine {
            let n = p.numel();
            if let Some(old) = p.grad() {
                let g = super::staged::rebuild(
                    buf[at..at + n].to_vec(),
                    p.shape(),
                    old.dtype(),
                    old.device(),
                )?;
                p.set_grad(Some(g))?;
            }
            at += n;
        }
        Ok(())
    }
}
