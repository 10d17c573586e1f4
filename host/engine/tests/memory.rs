//! Allocator statistics and activation memory under recompute regions. One test in this binary,
//! so no other test allocates concurrently and the global counters are exact.

mod common;

use anneal_engine::alloc::{memory_stats, reset_peak};
use anneal_engine::autograd::{checkpoint, RegionFn};
use anneal_engine::Tensor;
use common::randn;
use std::sync::Arc;

/// Peak bytes above the starting point while running forward + backward of a 4-block MLP.
fn peak_of_training_step(recompute: bool) -> (usize, Vec<f32>) {
    let w = randn(&[256, 256], "w").requires_grad_();
    let x = randn(&[512, 256], "x");
    let base = memory_stats().current_bytes;
    reset_peak();
    let mut h = x.clone();
    for _ in 0..4 {
        let w2 = w.clone();
        let block: RegionFn =
            Arc::new(move |t: &[Tensor]| t[0].matmul(&w2)?.silu()?.matmul(&w2)?.tanh());
        h = if recompute {
            checkpoint(&[h], block).unwrap()
        } else {
            block(&[h]).unwrap()
        };
    }
    h.sum_all().unwrap().backward().unwrap();
    let peak = memory_stats().peak_bytes - base;
    (peak, w.grad().unwrap().to_vec_f32())
}

#[test]
fn allocator_tracks_usage_and_recompute_lowers_the_peak() {
    let before = memory_stats();
    let t = Tensor::zeros(&[1 << 20], anneal_engine::DType::F32);
    let during = memory_stats();
    assert!(during.current_bytes >= before.current_bytes + (4 << 20));
    drop(t);
    let after = memory_stats();
    assert!(after.current_bytes < during.current_bytes);
    assert!(
        after.cached_bytes >= 4 << 20,
        "freed block is kept for reuse"
    );
    let hits = after.cache_hits;
    let _again = Tensor::zeros(&[1 << 20], anneal_engine::DType::F32);
    assert!(
        memory_stats().cache_hits > hits,
        "same-size allocation is served from the cache"
    );

    let (plain, g1) = peak_of_training_step(false);
    let (ckpt, g2) = peak_of_training_step(true);
    assert_eq!(g1, g2, "recompute gives bitwise-identical gradients");
    assert!(
        ckpt * 10 < plain * 7,
        "recompute peak {ckpt} B should be well below {plain} B"
    );
}
