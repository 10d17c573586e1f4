//! Whole-vocabulary logits from a vocabulary-split output head, for the consumers that need
//! every column on every rank: sampling a token during decode (every rank of the group must draw
//! the same one) and the RL trainer's logprobs, entropy and loss, which must read the same rows
//! the rollout read so the logprob-parity invariant can hold bit for bit.
//!
//! The forward is an all-gather along the last dim (rank order, so the rows are the
//! single-process head's values column for column). Every rank then computes the same loss from
//! the same whole logits, so every rank's gradient of them is the same: the backward keeps this
//! rank's columns of it and sends nothing (a reduce-scatter would count it `ranks` times).

use super::tp::TensorParallelGroup;
use crate::autograd::record;
use crate::error::{invalid, Result};
use crate::Tensor;

/// `x [.., V / ranks]` (this rank's columns of a vocabulary-split product, rank `r` holding
/// columns `[r·V/ranks, (r+1)·V/ranks)`) joined over the group into `[.., V]`; the gradient is
/// this rank's columns of the whole one (see the module docs).
pub fn tp_vocab_gather(x: &Tensor, tp: &TensorParallelGroup) -> Result<Tensor> {
    const OP: &str = "tp_vocab_gather";
    let g = tp.group.clone();
    let rank = g.rank();
    let Some(&cols) = x.shape().last() else {
        return Err(invalid(OP, "a scalar has no vocabulary dim".to_string()));
    };
    let last = x.rank() - 1;
    // Along the last dim in rank order: rank r's columns land at `r · cols`.
    let out = super::tp::gather_along(g.as_ref(), x, last)?;
    Ok(record(OP, out, &[x], move || {
        move |grad: &Tensor| {
            let mine = grad
                .narrow(last as isize, rank * cols, cols)?
                .contiguous()?;
            Ok(vec![Some(mine)])
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::TpGroup;
    use std::sync::Arc;

    /// Rank 1 of two whose peer holds `other`: what a real group would return.
    struct Pair {
        other: Vec<f32>,
    }

    impl TpGroup for Pair {
        fn ranks(&self) -> usize {
            2
        }
        fn rank(&self) -> usize {
            1
        }
        fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
            buf.iter_mut().zip(&self.other).for_each(|(b, o)| *b += o);
            Ok(())
        }
        fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
            Ok(self.other.iter().chain(local).copied().collect())
        }
        fn reduce_scatter_sum(&self, _send: &[f32]) -> Result<Vec<f32>> {
            unreachable!("the vocabulary gather never reduces")
        }
    }

    #[test]
    fn joins_columns_in_rank_order_and_keeps_its_own_gradient() {
        // Rank 0 holds columns 0..2 of two rows ([[0, 1], [4, 5]]), rank 1 (this one) columns
        // 2..4. The gather runs along dim 0 with the vocabulary dim moved to the front, so rank
        // 0 sends its block column-major.
        let tp = TensorParallelGroup {
            group: Arc::new(Pair {
                other: vec![0.0, 4.0, 1.0, 5.0],
            }),
        };
        let x = Tensor::from_vec(vec![2.0, 3.0, 6.0, 7.0], &[2, 2])
            .unwrap()
            .requires_grad_();
        let y = tp_vocab_gather(&x, &tp).unwrap();
        assert_eq!(y.shape(), [2, 4]);
        assert_eq!(y.to_vec_f32(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        let w = Tensor::from_vec((1..=8).map(|v| v as f32).collect(), &[2, 4]).unwrap();
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(x.grad().unwrap().to_vec_f32(), [3.0, 4.0, 7.0, 8.0]);
    }
}
