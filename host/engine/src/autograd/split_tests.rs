use crate::autograd::checkpoint;
use crate::{DType, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Deterministic values, not all the same, so a sum's order shows in its bits.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed * 97);
            ((h % 2001) as f32 - 1000.0) / 337.0
        })
        .collect()
}

fn leaf(shape: &[usize], seed: u32) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(values(n, seed), shape)
        .unwrap()
        .requires_grad_()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>().iter().map(|v| v.to_bits()).collect()
}

/// Weights of a small two-layer block, one used twice, one scaling through a non-splitting op.
struct Block {
    w1: Tensor,
    w2: Tensor,
    scale: Tensor,
    ids_table: Tensor,
}

impl Block {
    fn new() -> Block {
        Block {
            w1: leaf(&[6, 4], 1),
            w2: leaf(&[4, 6], 2),
            scale: leaf(&[4], 3),
            ids_table: leaf(&[5, 4], 4),
        }
    }

    fn params(&self) -> [&Tensor; 4] {
        [&self.w1, &self.w2, &self.scale, &self.ids_table]
    }

    /// `x [2, 3, 4]` through the block (plus an embedding, all weight side) to one value per
    /// element, so the seed gradient is not uniform.
    fn forward(&self, x: &Tensor) -> Tensor {
        let w1t = self.w1.transpose(0, 1).unwrap();
        let h = x.matmul(&w1t).unwrap();
        let h = h.mul(&h).unwrap().mul_scalar(0.1).unwrap();
        let y = h.matmul(&self.w2.transpose(0, 1).unwrap()).unwrap();
        // w1 again, on the output side: two contributions to one leaf.
        let y = y
            .matmul(&w1t)
            .unwrap()
            .matmul(&self.w2.transpose(0, 1).unwrap());
        let y = y.unwrap().mul(&self.scale).unwrap();
        let ids = Tensor::from_vec(vec![0i64, 3, 1, 4, 2, 3], &[2, 3]).unwrap();
        let e = self.ids_table.embedding(&ids).unwrap();
        y.add(&e).unwrap().add(x).unwrap()
    }
}

fn seed() -> Tensor {
    Tensor::from_vec(values(24, 9), &[2, 3, 4]).unwrap()
}

/// Each leaf's gradient after `micro` micro-batches run whole (`split` false) or split, with
/// every input pass before the weight passes of earlier micro-batches (a pipeline's order).
fn run(micro: usize, split: bool, recompute: bool) -> Vec<Vec<u32>> {
    let b = Arc::new(Block::new());
    let mut grads = Vec::new();
    let mut queued = Vec::new();
    let mut xs = Vec::new();
    for k in 0..micro {
        let x = leaf(&[2, 3, 4], 10 + k as u32);
        let out = if recompute {
            let b2 = b.clone();
            checkpoint(
                &[x.clone()],
                Arc::new(move |xs: &[Tensor]| Ok(b2.forward(&xs[0]))),
            )
            .unwrap()
        } else {
            b.forward(&x)
        };
        if split {
            let w = out.backward_split(seed(), &[&x]).unwrap();
            // The input's gradient is final after the input pass, the weights' are not.
            assert!(x.grad().is_some());
            if k == 0 {
                assert!(b.params().iter().all(|p| p.grad().is_none()));
            }
            queued.push(w);
        } else {
            out.backward_with(seed()).unwrap();
        }
        xs.push(x);
    }
    for w in queued {
        assert!(!w.is_empty());
        w.run().unwrap();
    }
    for x in &xs {
        grads.push(bits(&x.grad().unwrap()));
    }
    for p in b.params() {
        grads.push(bits(&p.grad().unwrap()));
    }
    grads
}

#[test]
fn split_gradients_are_bitwise_the_whole_passes() {
    for micro in [1, 3] {
        for recompute in [false, true] {
            assert_eq!(
                run(micro, true, recompute),
                run(micro, false, recompute),
                "micro-batches {micro}, recompute {recompute}"
            );
        }
    }
    // And recompute changes nothing either.
    assert_eq!(run(2, true, true), run(2, false, false));
}

#[test]
fn with_nothing_wanted_now_everything_waits_for_the_weight_pass() {
    let b = Block::new();
    let x = Tensor::from_vec(values(24, 5), &[2, 3, 4]).unwrap();
    let w = b.forward(&x).backward_split(seed(), &[]).unwrap();
    assert!(b.params().iter().all(|p| p.grad().is_none()));
    w.run().unwrap();
    let whole = Block::new();
    whole.forward(&x).backward_with(seed()).unwrap();
    for (p, q) in b.params().iter().zip(whole.params()) {
        assert_eq!(bits(&p.grad().unwrap()), bits(&q.grad().unwrap()));
    }
}

#[test]
fn a_weights_hooks_fire_once_in_the_weight_pass() {
    let b = Block::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    b.w1.register_grad_hook(Box::new(move |_| {
        seen.fetch_add(1, Ordering::SeqCst);
    }))
    .unwrap();
    let x = leaf(&[2, 3, 4], 7);
    let w = b.forward(&x).backward_split(seed(), &[&x]).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    w.run().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[test]
fn passes_with_nothing_deferred_run_back_to_back() {
    let x = leaf(&[2], 1);
    let y = x.mul_scalar(2.0).unwrap();
    let w = y
        .backward_split(Tensor::ones(&[2], DType::F32), &[&x])
        .unwrap();
    assert!(w.is_empty());
    assert_eq!(x.grad().unwrap().to_vec::<f32>(), [2.0, 2.0]);
    // The queue was reset: a second split pass runs.
    let z = x.mul_scalar(3.0).unwrap();
    z.backward_split(Tensor::ones(&[2], DType::F32), &[&x])
        .unwrap()
        .run()
        .unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>(), [5.0, 5.0]);
}
